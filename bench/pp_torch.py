"""bench_pp.py's reference: torch.distributed.pipelining (its GPipe, 1F1B, interleaved 1F1B, ZB-V
and DualPipeV schedules) on shardlm's Decoder, cut into the same stages as shardlm cuts it
(models.flops.pipeline_split), with the same data, optimizer and clipping."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from common import peak_rss_bytes, reset_peak_rss, timed_steps
from common.peer import adamw, reference_setup, token_loss
from shardlm.parallel.pipeline.tables import V_SHAPED
from shardlm.models.flops import pipeline_split
from shardlm.parallel.data.zero.optim import lr_at, param_groups, set_lr




class TorchStage(nn.Module):
    """One pipeline stage of shardlm's Decoder for torch's PipelineStage: its blocks; the token
    embedding and positions on the first stage (forward takes token ids), the final norm and
    head on the last (forward returns logits); otherwise hidden states in and out."""

    def __init__(self, model, blocks: range, first: bool, last: bool):
        super().__init__()
        cfg = model.cfg
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first and cfg.position == "learned" else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in blocks)
        self.norm_f = model.norm_f if last else None
        self.head = model.head if last else None
        self.rope = cfg.position == "rope"
        if self.rope:
            self.register_buffer("rope_cos", model.rope_cos, persistent=False)
            self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1]
        if self.tok_emb is not None:  # x: token ids (B, T)
            h = self.tok_emb(x)
            if self.pos_emb is not None:
                h = h + self.pos_emb(torch.arange(T, device=x.device))
        else:  # x: the previous stage's hidden states (B, T, C)
            h = x
        rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.rope else None
        for block in self.blocks:
            h = block(h, rope)
        if self.head is not None:
            return self.head(self.norm_f(h))  # (B, T, vocab)
        return h


def torch_rank(rank: int, world: int, overrides: dict, spec: tuple, warmup: int, steps: int) -> dict:
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

    schedule_name, pp, virtual = spec
    if pp != world:
        raise ValueError("torch's cases here are pure pipelines (pp = ranks)")
    # the same micro-batches as shardlm's pipeline; the model whole on every rank
    cfg, loader, model = reference_setup(overrides, 0, 1)
    if cfg.model.tie_embeddings:
        raise ValueError("torch's stages would train two copies of a tied embedding: untie it")
    t = cfg.train
    micro = t.grad_accum  # micro-batches per step
    n_stages = pp * virtual
    v_shaped = schedule_name in V_SHAPED  # rank r holds stages r and 2pp-1-r (both libraries)
    split = pipeline_split(cfg.model, t.seq_len, n_stages, cfg.parallel.pp_layers, virtual, "v" if v_shaped else "loop")
    bounds = [sum(split[:g]) for g in range(n_stages + 1)]
    ids = [rank, n_stages - 1 - rank] if v_shaped else list(range(rank, n_stages, pp))  # else s on rank s mod pp
    modules = [TorchStage(model, range(bounds[s], bounds[s + 1]), s == 0, s == n_stages - 1) for s in ids]
    del model  # the other stages' blocks are freed with it
    device = torch.device("cpu")
    stages = [PipelineStage(m, s, n_stages, device) for m, s in zip(modules, ids)]

    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    multi = {"interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
    kind = single.get(schedule_name) or multi[schedule_name]
    schedule = kind(stages[0] if schedule_name in single else stages, n_microbatches=micro, loss_fn=token_loss)
    holder = nn.ModuleList(modules)
    params = [p for p in holder.parameters()]
    optimizer = adamw(param_groups(holder, t.weight_decay), t)
    first, last = 0 in ids, n_stages - 1 in ids
    setup_rss = peak_rss_bytes()
    reset_peak_rss()  # the steps' own high-water mark follows (Linux; elsewhere the process's)

    def step(s: int) -> float:
        set_lr(optimizer, lr_at(s, t))
        batches = loader.micro_batches(s)
        x = torch.cat([b[0] for b in batches])  # chunked back into the same micro-batches
        y = torch.cat([b[1] for b in batches])
        losses: list[torch.Tensor] = []
        schedule.step(*((x,) if first else ()), target=y if last else None,
                      losses=losses if last else None, return_outputs=False)
        grads = [p.grad for p in params if p.grad is not None]
        squares = (torch.nn.utils.get_total_norm(grads) ** 2 if grads else torch.zeros(())).reshape(1)
        dist.all_reduce(squares)  # the whole model's squared norm, over the pipeline
        torch.nn.utils.clip_grads_with_norm_(params, t.grad_clip, squares.sqrt()[0])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = (torch.stack(losses).mean().detach() if last else torch.zeros(())).reshape(1)
        dist.all_reduce(total)  # the last stage's; zero elsewhere
        return float(total[0])

    out = timed_steps(step, warmup, steps)
    return {**out, "setup_rss": setup_rss, "steps_rss": peak_rss_bytes(),
            "stage": rank, "records": []}
