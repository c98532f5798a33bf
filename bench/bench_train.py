"""Single-device training speed: shardlm's loop against a plain PyTorch loop, same process.

The plain loop is what a user writes from nanoGPT (the same GPT-2 maths, default AdamW, autocast
for bf16, clipping at 1.0), on the identical batches; both timed after warm-up in interleaved
rounds. MFU = model FLOPs/s (6N + 12·L·d·T per token) over this machine's matmul peak.

Reproduce:  python bench/bench_train.py            (all presets, fp32 and bf16; ~10 minutes)
            python bench/bench_train.py --presets gpt-tiny,gpt-mini --steps 6
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from common import machine, reproduce, run_overrides, table, table_row, timed_steps
from shardlm.config.load import load_config
from shardlm.launch.runtime import cpu_cores
from shardlm.models.flops import count_params
from shardlm.train.build import build_run
from shardlm.train.step import train_step

# (micro_batch, seq_len) per preset: big enough to be matmul-bound, small enough for a CPU.
SHAPES = {"gpt-tiny": (16, 64), "gpt-mini": (8, 256), "gpt2-124m": (4, 256)}


class PlainBlock(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        # Registered in shardlm's order, so parameters() line up one to one for copy_weights.
        self.ln_1, self.c_attn, self.c_proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln_2, self.c_fc, self.mlp_proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    def __init__(self, vocab: int, d: int, n_layers: int, n_heads: int, max_len: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.h = nn.ModuleList(PlainBlock(d, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


@torch.no_grad()
def copy_weights(src: nn.Module, dst: nn.Module) -> None:
    """Start both loops from identical weights: the same maths must then give the same first loss
    (a check that the comparison is fair), and no loop is slowed by a worse init (PyTorch's
    default init drives this CPU into denormal floats within a few steps, 2-6x slower)."""
    for a, b in zip(src.parameters(), dst.parameters(), strict=True):
        assert a.shape == b.shape, (a.shape, b.shape)
        b.copy_(a)


def plain_step(model, optimizer, batches, autocast) -> float:
    total = 0.0
    for x, y in batches:
        with autocast():
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1)) / len(batches)
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def bench_case(preset: str, precision: str, steps: int, rounds: int, warmup: int) -> dict:
    micro_batch, seq_len = SHAPES.get(preset, (4, 256))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(overrides={
            "model.preset": preset, "train.micro_batch": micro_batch, "train.seq_len": seq_len,
            "train.steps": 1000, **run_overrides(tmp, precision=precision)}).validate()
        run = build_run(cfg)
    m = cfg.model
    plain = PlainGPT(m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.max_seq_len)
    copy_weights(run.model, plain)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=cfg.train.lr, weight_decay=0.1)
    autocast = (contextlib.nullcontext if precision == "fp32"
                else lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    batches = {s: run.train_loader.micro_batches(s) for s in range(rounds * (steps + warmup))}
    times: dict[str, list[float]] = {"plain": [], "shardlm": []}
    first = {"plain": plain_step(plain, plain_opt, batches[0], autocast), "shardlm": train_step(run, 0)[0]}
    for r in range(rounds):
        span = range(r * (steps + warmup), (r + 1) * (steps + warmup))
        times["plain"] += timed_steps(lambda i, span=span: plain_step(plain, plain_opt, batches[span[i]], autocast),
                                      warmup, steps)["seconds"]
        times["shardlm"] += timed_steps(lambda i, span=span: train_step(run, span[i]).loss, warmup, steps)["seconds"]
    tokens = micro_batch * seq_len
    flops = run.flops_per_token * tokens
    row = {"preset": preset, "params_M": count_params(m) / 1e6, "precision": precision,
           "batch": f"{micro_batch}x{seq_len}", "peak_gflops": run.peak_flops_per_device / 1e9}
    for name, ts in times.items():
        t = statistics.median(ts)
        row[f"{name}_tok_s"] = tokens / t
        row[f"{name}_mfu"] = flops / t / run.peak_flops_per_device
    row["ratio"] = row["shardlm_tok_s"] / row["plain_tok_s"]
    row["first_loss_diff"] = abs(first["plain"] - first["shardlm"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="gpt-tiny,gpt-mini,gpt2-124m")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per loop")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per round")
    args = parser.parse_args()
    torch.set_num_threads(cpu_cores())
    print(f"{machine()}; {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    header = ("preset", "params", "prec", "batch", "plain tok/s", "shardlm tok/s", "ratio",
              "plain MFU", "shardlm MFU", "peak GFLOP/s", "|Δ first loss|")
    print(table(header, []))
    for preset in args.presets.split(","):
        for precision in args.precisions.split(","):
            r = bench_case(preset, precision, args.steps, args.rounds, args.warmup)
            print(table_row([r["preset"], f"{r['params_M']:.1f}M", r["precision"], r["batch"],
                             f"{r['plain_tok_s']:,.0f}", f"{r['shardlm_tok_s']:,.0f}", f"{r['ratio']:.2f}x",
                             f"{r['plain_mfu']:.1%}", f"{r['shardlm_mfu']:.1%}", f"{r['peak_gflops']:.0f}",
                             f"{r['first_loss_diff']:.1e}"]), flush=True)
    print(f"\n{reproduce()}")

if __name__ == "__main__":
    main()
