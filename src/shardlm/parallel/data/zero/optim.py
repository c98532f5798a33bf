"""The optimizer (train.optimizer): AdamW with decoupled weight decay on matrices only, or Muon
on the hidden weight matrices with AdamW for the rest; and the warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.adamw import adamw

from shardlm.config.schema import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay weight matrices (and embeddings); never biases or norm gains (GPT-3 / nanoGPT).
    Tied parameters appear once (named_parameters de-duplicates)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    # torch's fused AdamW (one kernel over all tensors) exists for CUDA and, since 2.4, for CPU;
    # it beats the foreach path on both (on gpt2-124m it is most of our lead over a plain loop).
    fused = device.type in ("cuda", "cpu")
    if cfg.optimizer == "muon":
        return MuonWithAdamW(model, cfg, fused)
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused, foreach=None if fused else True)


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate AdamW's moments now, exactly as torch would at the first step (zeros, and the
    step counter as a tensor of the dtype the fused kernel uses), so memory is known and
    reportable before training starts, and a checkpoint can be loaded into it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                step_dtype = torch.float32 if group.get("fused") else torch.get_default_dtype()
                step = torch.zeros((), dtype=step_dtype, device=p.device if group.get("fused") else "cpu")
                optimizer.state[p] = (
                    {"step": step, "momentum_buffer": torch.zeros_like(p)} if group.get("muon") else
                    {"step": step, "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)})


def adam_steps(optimizer: torch.optim.Optimizer) -> float:
    """Steps the optimizer has taken (AdamW's bias-correction counter, the same for every
    parameter; skipped fp16 steps are not counted)."""
    return float(next(iter(optimizer.state.values()))["step"])


def set_adam_steps(optimizer: torch.optim.Optimizer, steps: float) -> None:
    for state in optimizer.state.values():
        state["step"].fill_(steps)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over `warmup_steps` to `lr`, then cosine decay to `lr*min_lr_ratio` at the
    last step. A pure function of the step, so a resumed run follows the same curve."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - 1 - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# ---------------------------------------------------------------------------------------------
# Muon (train.optimizer = 'muon'): K. Jordan, "Muon: An optimizer for hidden layers in neural
# networks" (2024); J. Liu et al., "Muon is Scalable for LLM Training" (Moonlight, 2025).

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""The quintic Newton-Schulz iteration's (a, b, c): X <- aX + b(XXᵀ)X + c(XXᵀ)²X, chosen (Jordan)
to push every singular value of the normalised X towards 1 fast; they end near 1 (within about
0.7-1.2), not exactly at it."""


def newton_schulz(grad: torch.Tensor, steps: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The orthogonal factor UVᵀ of grad = USVᵀ, approximately: `steps` quintic Newton-Schulz
    iterations in `dtype` (Jordan's reference uses bf16; fp32 here unless asked). (A, B) -> (A, B)."""
    a, b, c = NS_COEFFICIENTS
    x = grad.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide orientation: XXᵀ is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm() + 1e-7)  # spectral norm <= Frobenius norm <= 1: inside the iteration's basin
    for _ in range(steps):
        gram = x @ x.mT  # (min, min)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).to(grad.dtype)


def orthogonalise(direction: torch.Tensor, steps: int, parts: tuple[int, ...] = ()) -> torch.Tensor:
    """Newton-Schulz's UVᵀ of an (A, B) direction scaled by 0.2 sqrt(max(A, B)), so its RMS
    matches a typical AdamW update's (Moonlight, eq. 4): the same lr and weight decay then serve
    both optimizers. `parts`: row counts of the separate matrices a fused one joins
    (train.muon_split_fused), each orthogonalised and scaled as its own."""
    if parts:
        return torch.cat([orthogonalise(p, steps) for p in direction.split(list(parts))])
    return newton_schulz(direction, steps) * (0.2 * math.sqrt(max(direction.shape)))


def fused_parts(model: nn.Module, split: bool) -> dict[str, tuple[int, ...]]:
    """train.muon_split_fused: our Decoder's fused projections -> their parts' rows (a
    transformers model's q/k/v are separate already)."""
    from shardlm.models.decoder import Decoder

    return model.fused_parts() if split and isinstance(model, Decoder) else {}


def muon_update(grad: torch.Tensor, momentum_buffer: torch.Tensor, momentum: float, nesterov: bool,
                ns_steps: int, parts: tuple[int, ...] = ()) -> torch.Tensor:
    """Muon's direction for one matrix (A, B): the momentum buffer is updated in place
    (buf <- mu buf + g), Nesterov looks ahead (g + mu buf), and it is orthogonalised."""
    momentum_buffer.mul_(momentum).add_(grad)
    direction = grad.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    return orthogonalise(direction, ns_steps, parts)


def muon_params(model: nn.Module) -> list[nn.Parameter]:
    """What Muon updates: the trainable weights of the hidden linear layers (nn.Linear, or
    tensor parallelism's cuts of one; under LoRA / QLoRA the adapters' factors A and B, each a
    linear map of its own, since the base is frozen) — 2-D, and neither
    an embedding nor the output head (a tied head is the embedding). Everything else
    (embeddings, head, norms, biases, 3-D expert banks) stays with AdamW, as Jordan and Moonlight
    prescribe."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "head", None)
    excluded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    if isinstance(head, nn.Linear):
        excluded.add(id(head.weight))
    seen, out = set(), []
    for module in model.modules():
        # nn.Linear, or tensor parallelism's pieces of one (their class says `linear_map`)
        linear = isinstance(module, nn.Linear) or getattr(type(module), "linear_map", False)
        w = getattr(module, "weight", None) if linear else None  # a QLoRA base holds codes instead
        if (isinstance(w, nn.Parameter) and w.requires_grad and w.dim() == 2
                and id(w) not in excluded and id(w) not in seen):
            seen.add(id(w))
            out.append(w)
    return out


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on `muon_params(model)`, torch's AdamW (the same fused kernel build_optimizer uses)
    on the rest, in one optimizer: the loop's lr schedule, step counter, checkpoints and
    non-finite skip (`found_inf`, as fused AdamW reads it) see one object. Groups: Muon's
    (`muon`: True), AdamW with decay, AdamW without. Muon's decoupled weight decay is AdamW's:
    W <- W (1 - lr wd) - lr * muon_update(...)."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, fused: bool):
        muon = muon_params(model)
        names = {id(p): n for n, p in model.named_parameters()}
        by_name = fused_parts(model, cfg.muon_split_fused)
        self.parts = {id(p): by_name[names[id(p)]] for p in muon if names[id(p)] in by_name}
        chosen = {id(p) for p in muon}
        adamw = [g | {"params": [p for p in g["params"] if id(p) not in chosen]}
                 for g in param_groups(model, cfg.weight_decay)]
        groups = [{"params": muon, "weight_decay": cfg.weight_decay, "muon": True}] + adamw
        super().__init__([g for g in groups if g["params"]],
                         dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, muon=False,
                              momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                              ns_steps=cfg.muon_ns_steps, fused=fused))

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and bool(found_inf):  # skip all: no update, no step counted
            return None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state[p] for p in params]
            if group["muon"]:
                for p, state in zip(params, states):
                    update = muon_update(p.grad, state["momentum_buffer"], group["momentum"],
                                         group["nesterov"], group["ns_steps"], self.parts.get(id(p), ()))
                    p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                    state["step"] += 1
                continue
            beta1, beta2 = group["betas"]
            adamw(
                params, [p.grad for p in params], [s["exp_avg"] for s in states],
                [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                foreach=None if group["fused"] else True, fused=group["fused"] or None,
                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
        return None
