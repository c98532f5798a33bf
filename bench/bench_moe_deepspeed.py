"""Expert-parallel mixture of experts on 2 CPU ranks (gloo): shardlm's MoE layer against
DeepSpeed's (deepspeed.moe.layer.MoE), one layer, forward + backward, on the same shapes,
weights and tokens.

    shardlm cf=F / dropless        shardlm.models.moe.MoE, experts spread over the 2 ranks
    DeepSpeed cf=F / no-drop       MoE(ep_size=2, k=2, capacity_factor=F, drop_tokens=True/False)

DeepSpeed's gating is set to route as shardlm does (top2_2nd_expert_sampling=False,
use_rts=False, min_capacity=0); the "max |Δout|" line checks the two layers agree on every token
that kept both choices. Columns: step ms and CPU ms/step (median, busier rank), dropped share,
expert rows per rank (padding included, by a forward hook), a2a bytes sent per rank per step,
setup RSS and step peak RSS (Δ over the RSS before the timed steps). Method, the differences
between the layers and results: docs/benchmarks.md, "Against DeepSpeed".

DeepSpeed on CPU: DS_ACCELERATOR=cpu (set here); its first start JIT-builds a comm op (needs a
C++ compiler and ninja). Install: pip install --no-deps deepspeed einops hjson msgpack ninja
psutil py-cpuinfo.

Reproduce:  PYTHONPATH=src python bench/bench_moe_deepspeed.py
            PYTHONPATH=src python bench/bench_moe_deepspeed.py --tokens 2048 --skew 1 --repeat 3
            PYTHONPATH=src python bench/bench_moe_deepspeed.py --mlp swiglu --d-model 512
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported (here or in a rank)

import torch
import torch.distributed as dist

from common import MiB, machine, peak_rss_bytes, proc_status, reproduce, reset_peak_rss, rounds, start_ranks, table, timed_steps
from shardlm.config.load import load_config

WORLD = 2
# key -> (label, library, dropless)
CASES = {"shardlm": ("shardlm", "shardlm", False), "deepspeed": ("DeepSpeed", "deepspeed", False),
         "shardlm-dropless": ("shardlm", "shardlm", True),
         "deepspeed-dropless": ("DeepSpeed", "deepspeed", True)}
PAIRS = [("shardlm", "deepspeed"), ("shardlm-dropless", "deepspeed-dropless")]


# -- the shared setup: config, weights, tokens ----------------------------------------------

def model_config(shape: dict, dropless: bool):
    return load_config(overrides={
        "model.preset": "moe-tiny", "model.d_model": shape["d"], "model.experts": shape["experts"],
        "model.top_k": 2, "model.expert_d_ff": shape["f"], "model.mlp": shape["mlp"],
        "model.bias": False, "model.capacity_factor": 0.0 if dropless else shape["capacity"],
        "model.router": "softmax", "model.balance": "aux", "model.shared_experts": 0,
        "model.aux_loss_coef": shape["aux_coef"], "model.z_loss_coef": 0.0}).model


def router_weight(shape: dict) -> torch.Tensor:
    g = torch.Generator().manual_seed(shape["seed"] * 1009)
    return torch.randn(shape["experts"], shape["d"], generator=g) * 0.02


def expert_weights(shape: dict, e: int) -> dict[str, torch.Tensor]:
    """Expert e's weights (nn.Linear layout), from its own generator: a rank draws only its own."""
    g = torch.Generator().manual_seed(shape["seed"] * 1009 + 1 + e)
    d, f = shape["d"], shape["f"]
    if shape["mlp"] == "swiglu":  # gate_up rows [0, f) the gate (models.decoder.SwiGLU)
        return {"gate_up": torch.randn(2 * f, d, generator=g) * 0.02, "down": torch.randn(d, f, generator=g) * 0.02}
    return {"fc": torch.randn(f, d, generator=g) * 0.02, "proj": torch.randn(d, f, generator=g) * 0.02}


def tokens(shape: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's input (B, T, C) and the fixed output gradient G. With skew s every token gets
    s·u added, u one N(0, 1) vector shared by the ranks: the router's logits get fixed
    per-expert offsets W_r·u·s, so the experts' loads become uneven (and capacity drops appear)."""
    g = torch.Generator().manual_seed(shape["seed"] * 7919 + 13 + rank)
    n, t = shape["tokens"], shape["seq"]
    x = torch.randn(n // t, t, shape["d"], generator=g)
    if shape["skew"]:
        u = torch.randn(shape["d"], generator=torch.Generator().manual_seed(shape["seed"] * 7919))
        x += shape["skew"] * u
    return x, torch.randn(x.shape, generator=g)


# -- the two layers: each builder returns (module, step function, stats function) ------------

def build_shardlm(shape: dict, dropless: bool, rank: int):
    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.models.decoder import dense_mlp
    from shardlm.models.moe import MoE, MoEStats
    from shardlm.parallel.expert.dispatch import spread_experts

    cfg = model_config(shape, dropless)
    stats = MoEStats(layers=[0], experts=cfg.experts)
    stats.grad_scale = 1.0
    ledger = CommLedger()
    comm = Comm(dist.group.WORLD, "ep", ledger)
    with torch.device("meta"):  # experts whole only on the meta device, then this rank's E/2
        moe = MoE(cfg, 0, stats, dense_mlp)
        spread_experts(moe, "mlp", cfg, comm, stats)
    moe.to_empty(device="cpu")
    with torch.no_grad():
        moe.router.weight.copy_(router_weight(shape))
        for i in range(moe.experts.count):  # global experts first .. first + count - 1
            e = moe.experts.first + i
            for name, w in expert_weights(shape, e).items():
                getattr(moe.experts, name)[i].copy_(w)
    rows = [0]
    moe.experts.register_forward_hook(lambda mod, args, out: rows.__setitem__(0, args[0].shape[0]))

    def step(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        stats.reset()
        ledger.reset()
        out = moe(x)
        out.backward(grad)
        return out

    def figures() -> dict:
        s = stats.sums[0]
        return {"dropped": float(s[cfg.experts]), "choices": float(s[:cfg.experts].sum()),
                "rows": rows[0], "a2a": sum(v for k, v in ledger.bytes.items() if k.startswith("all_to_all")),
                "kept_both": None}

    return moe, step, figures


def build_deepspeed(shape: dict, dropless: bool, rank: int):
    import deepspeed
    import deepspeed.comm as ds_comm
    from deepspeed.moe.layer import MoE as DSMoE

    from shardlm.models.decoder import dense_mlp

    deepspeed.init_distributed(dist_backend="gloo")  # torch's group exists: DeepSpeed wraps it
    torch.set_num_threads(shape["threads"])
    cfg = model_config(shape, dropless)
    expert = dense_mlp(dataclasses.replace(cfg, d_ff=shape["f"]))  # the template DeepSpeed copies
    moe = DSMoE(shape["d"], expert=expert, num_experts=shape["experts"], ep_size=WORLD, k=2,
                capacity_factor=shape["capacity"], eval_capacity_factor=shape["capacity"],
                min_capacity=0, drop_tokens=not dropless, use_rts=False,
                top2_2nd_expert_sampling=False)
    del expert
    moe.set_deepspeed_parallelism()  # what deepspeed.initialize does: the ep group of 2 ranks
    layer = moe.deepspeed_moe
    local = layer.num_local_experts
    with torch.no_grad():
        layer.gate.wg.weight.copy_(router_weight(shape))
        for i, mod in enumerate(layer.experts.deepspeed_experts):
            for name, w in expert_weights(shape, rank * local + i).items():
                getattr(mod, name).weight.copy_(w)

    seen = {"rows": 0, "dropped": 0, "choices": 0, "kept": None}

    def gate_hook(mod, args, out):  # sparse routes: (l_aux, C, E, indices (k, S), locations, gates, counts)
        indices = out[3]
        seen.update(dropped=int((indices < 0).sum()), choices=indices.numel(), kept=(indices >= 0).all(0))

    layer.gate.register_forward_hook(gate_hook)
    layer.experts.register_forward_hook(
        lambda mod, args, out: seen.__setitem__("rows", args[0].numel() // args[0].shape[-1]))
    sent = [0]
    original = ds_comm.all_to_all_single

    def counted(output, tensor, *a, **k):  # sharded_moe calls deepspeed.comm.all_to_all_single
        sent[0] += tensor.numel() * tensor.element_size() * (WORLD - 1) // WORLD
        return original(output, tensor, *a, **k)

    ds_comm.all_to_all_single = counted
    coef = torch.tensor(shape["aux_coef"])

    def step(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        sent[0] = 0
        out, l_aux, _ = moe(x)
        torch.autograd.backward([out, l_aux], [grad, coef])
        return out

    def figures() -> dict:
        return {"dropped": seen["dropped"], "choices": seen["choices"], "rows": seen["rows"],
                "a2a": sent[0], "kept_both": seen["kept"]}

    return moe, step, figures


def case_rank(rank: int, world: int, key: str, shape: dict) -> dict:
    torch.set_num_threads(shape["threads"])
    _, library, dropless = CASES[key]
    build = build_shardlm if library == "shardlm" else build_deepspeed
    module, step, figures = build(shape, dropless, rank)
    x, grad = tokens(shape, rank)
    x.requires_grad_(True)
    setup_rss = proc_status("VmRSS")
    warmup, marks, held = shape["warmup"], {}, {}

    def mark_and_reset() -> None:  # the steps' own peak follows
        marks["before"] = proc_status("VmRSS")
        if not reset_peak_rss():
            raise RuntimeError("the step peak needs Linux's /proc/self/clear_refs to reset VmHWM")

    def run_step(s: int) -> float:
        held["out"] = step(x, grad)
        return 0.0

    def after(s: int, seconds: float) -> None:  # outside the timing: ready the next step
        out = held.pop("out")
        if s == 0:
            marks["first_out"] = out.detach().reshape(-1, shape["d"]).clone()
            marks["first_figures"] = figures()
        del out
        module.zero_grad(set_to_none=True)
        x.grad = None
        if s == warmup - 1:
            mark_and_reset()
        dist.barrier()

    if warmup == 0:
        mark_and_reset()
    dist.barrier()
    timed = timed_steps(run_step, warmup, shape["steps"], after)
    peak, f, kept = peak_rss_bytes(), figures(), marks["first_figures"]["kept_both"]
    return {"seconds": timed["seconds"], "cpu": timed["cpu"], "setup_rss": setup_rss, "before": marks["before"],
            "peak": peak, "dropped": f["dropped"], "choices": f["choices"], "rows": f["rows"], "a2a": f["a2a"],
            "out": marks["first_out"], "kept_both": kept if kept is not None else torch.zeros(0, dtype=torch.bool)}


# -- the driver ------------------------------------------------------------------------------

def measure(key: str, shape: dict, tmp: str) -> dict:
    ranks = start_ranks(case_rank, WORLD, tmp, key, shape, timeout=1800)
    step = statistics.median(max(r["seconds"][i] for r in ranks) for i in range(shape["steps"]))
    return {"step": step, "cpu": max(statistics.median(r["cpu"]) for r in ranks),
            "dropped": sum(r["dropped"] for r in ranks) / max(1, sum(r["choices"] for r in ranks)),
            "rows": statistics.mean(r["rows"] for r in ranks),
            "a2a": max(r["a2a"] for r in ranks),
            "setup": max(r["setup_rss"] for r in ranks), "peak": max(r["peak"] for r in ranks),
            "delta": max(r["peak"] - r["before"] for r in ranks),
            "out": [r["out"] for r in ranks], "kept_both": [r["kept_both"] for r in ranks]}


def case_label(key: str, args) -> str:
    label, _, dropless = CASES[key]
    if not dropless:
        return f"{label} cf={args.capacity:g}"
    return f"{label} {'dropless' if label == 'shardlm' else 'no-drop'}"


def spread(values: list[float]) -> str:
    """The median, and the range over repeats when there are several."""
    text = f"{statistics.median(values):.1f}"
    return text if len(values) == 1 else f"{text} ({min(values):.1f}-{max(values):.1f})"


def agreement(ours: dict, theirs: dict) -> tuple[float, float, int]:
    """max |Δout| over the tokens DeepSpeed kept both choices of, over all tokens, and how many
    tokens lost a choice (both ranks)."""
    kept_max, all_max, lost = 0.0, 0.0, 0
    for a, b, kept in zip(ours["out"], theirs["out"], theirs["kept_both"]):
        diff = (a - b).abs().amax(-1)
        all_max = max(all_max, float(diff.max()))
        if kept.numel():
            kept_max = max(kept_max, float(diff[kept].max()) if kept.any() else 0.0)
            lost += int((~kept).sum())
        else:
            kept_max = all_max
    return kept_max, all_max, lost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="2048,8192", help="tokens per rank, comma-separated")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-width", type=int, default=0, help="expert hidden width (0 = 4 x d_model)")
    parser.add_argument("--mlp", choices=["gelu", "swiglu"], default="gelu")
    parser.add_argument("--capacity", type=float, default=1.25, help="capacity factor of the capped cases")
    parser.add_argument("--seq", type=int, default=512, help="T of the (B, T, C) input (B = tokens / T)")
    parser.add_argument("--aux-coef", type=float, default=0.01)
    parser.add_argument("--skew", type=float, default=0.0,
                        help="add skew x a shared random vector to every token: uneven expert loads "
                             "(0.5 already drops about a third of the choices at cf 1.25)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the case list this many times round-robin; median (range)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES)}")
    args = parser.parse_args()
    keys = args.cases.split(",")
    if unknown := [k for k in keys if k not in CASES]:
        parser.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)}")
    if args.experts % WORLD:
        parser.error(f"--experts must divide by {WORLD}")
    counts = [int(t) for t in args.tokens.split(",")]
    if any(n % min(n, args.seq) for n in counts):
        parser.error("every --tokens value must divide by --seq (or be smaller than it)")
    if any(CASES[k][1] == "deepspeed" for k in keys) and importlib.util.find_spec("deepspeed") is None:
        sys.exit("deepspeed is not installed: pip install --no-deps deepspeed einops hjson msgpack ninja "
                 "psutil py-cpuinfo (see the module docstring)")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the ranks
    f = args.expert_width or 4 * args.d_model
    versions = ""
    if importlib.util.find_spec("deepspeed") is not None:
        from importlib.metadata import version
        versions += f", deepspeed {version('deepspeed')}"
    print(f"{machine()}{versions}; {WORLD} ranks (gloo), {args.threads} thread(s) each; d_model {args.d_model}, "
          f"{args.experts} experts ({args.mlp}, width {f}), top-2, fp32, input skew {args.skew:g}; "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.repeat} run(s) per case; "
          f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}", flush=True)
    rows, checks = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            shape = {"tokens": n, "seq": min(n, args.seq), "d": args.d_model, "experts": args.experts,
                     "f": f, "mlp": args.mlp, "capacity": args.capacity, "aux_coef": args.aux_coef,
                     "skew": args.skew, "warmup": args.warmup, "steps": args.steps,
                     "threads": args.threads, "seed": args.seed}
            runs = rounds(keys, args.repeat, lambda k, shape=shape: measure(k, shape, tmp),
                          label=lambda k, n=n: f"{n} tokens/rank, {case_label(k, args)}",
                          note=lambda m: f"{m['step'] * 1e3:.1f} ms/step, {m['cpu'] * 1e3:.1f} CPU ms/step")
            for k in keys:
                m = runs[k][0]  # the rest is the same in every run (same tokens, same routing)
                rows.append((f"{n:,}", *case_label(k, args).split(" ", 1), spread([r["step"] * 1e3 for r in runs[k]]),
                             spread([r["cpu"] * 1e3 for r in runs[k]]), f"{100 * m['dropped']:.2f}",
                             f"{m['rows']:,.0f}", f"{m['a2a'] / MiB:.2f}", f"{m['setup'] / MiB:.0f}",
                             f"{max(r['peak'] for r in runs[k]) / MiB:.0f}",
                             f"{max(r['delta'] for r in runs[k]) / MiB:.0f}"))
            for ours, theirs in PAIRS:
                if ours in runs and theirs in runs:
                    kept_max, all_max, lost = agreement(runs[ours][0], runs[theirs][0])
                    checks.append(f"{n:,} tokens/rank, {case_label(ours, args)} vs {case_label(theirs, args)}: "
                                  f"max |Δout| {kept_max:.2e} on the tokens that kept both choices, "
                                  f"{all_max:.2e} on all ({lost} token(s) lost a choice)")
            del runs
    header = ("tokens/rank", "layer", "capacity",
              "step ms" + (" (range over runs)" if args.repeat > 1 else ""), "CPU ms/step",
              "dropped %", "expert rows/rank", "a2a MiB sent/rank/step", "setup RSS MiB",
              "step peak RSS MiB", "step Δ MiB")
    print("\n" + table(header, rows))
    print()
    for line in checks:
        print(line)
    print(f"\n{reproduce()}")


if __name__ == "__main__":
    main()
