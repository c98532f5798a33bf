"""`shardlm estimate` and `shardlm plan`: the planner's two commands (their options, the model /
cluster / precision inputs they share, the cost basis of a training budget). Apart from
cli/main.py, which parses the command line and dispatches here."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardlm.errors import ConfigError


def model_args(p: argparse.ArgumentParser) -> None:
    """The model options of `estimate`, `plan` and `calibrate`: a preset or a parameter count."""
    model = p.add_argument_group("model: a preset, or a parameter count")
    model.add_argument("--model", metavar="PRESET",
                       help="a named shape (see `shardlm presets`), or a transformers config.json "
                            "(GPT-2 or LLaMA-family: GQA, SwiGLU, untied head)")
    model.add_argument("--params", type=float, metavar="N",
                       help="parameter count such as 7.5e9: model states use exactly N; the "
                            "rest is sized by a --family shape (h = 128 x layers unless given; "
                            "the family is named in the output)")
    model.add_argument("--family", choices=["gpt2", "llama", "moe"],
                       help="with --params (default gpt2): gpt2 = LayerNorm, learned positions, "
                            "GELU MLP of 4h, tied head; llama = RMSNorm, RoPE, SwiGLU MLP of 8h/3 "
                            "(up to 256), untied head, --kv-heads for GQA; moe = llama blocks "
                            "with --experts routed experts (8) and --top-k (2)")
    model.add_argument("--layers", type=int, help="with --params: layers")
    model.add_argument("--hidden", type=int, help="with --params: d_model")
    model.add_argument("--heads", type=int, help="with --params: attention heads")
    model.add_argument("--experts", type=int, help="routed experts per MoE block (overrides the model's)")
    model.add_argument("--top-k", type=int, help="experts per token (overrides the model's)")
    model.add_argument("--kv-heads", type=int, help="with --params --family llama|moe: key/value heads (GQA)")
    model.add_argument("--ffn", type=int, help="with --params: MLP hidden width (e.g. 53248 for Llama 3.1 405B)")
    model.add_argument("--vocab", type=int, default=50257, help="with --params: vocabulary")


def planner_args(p: argparse.ArgumentParser) -> None:
    """Model, hardware and precision options shared by `estimate` and `plan`."""
    from shardlm.hardware.catalog import GRID_DEFAULT, PUE_DEFAULT

    model_args(p)
    p.add_argument("--gpus", required=True, metavar="CLUSTER",
                   help="COUNTxDEVICE or NODESxPER_NODExDEVICE (8xV100-16GB, 2x8xA100-80GB), or "
                        "Nxcpu for N ranks on this machine (measured once, cached); `plan` "
                        "compares several, comma-separated (8xA100-80GB,16xV100-32GB)")
    p.add_argument("--intra", metavar="LINK", help="link inside a node (default: the device's)")
    p.add_argument("--inter", metavar="LINK", help="network between nodes, e.g. ib-hdr, roce-200")
    p.add_argument("--nics", type=int, help="network adapters per node")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's context)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16", "fp8"],
                   help="compute dtype; auto: bf16, fp16 on GPUs without bf16, the faster on a CPU; "
                        "fp8: bf16 with the blocks' linears at the device's fp8 peak (if it has one)")
    p.add_argument("--master", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--reduce", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    cost = p.add_argument_group("cost and energy of a training budget (docs/planner.md, \"Cost and energy\")")
    cost.add_argument("--tokens", type=float, metavar="N",
                      help="training budget in tokens (e.g. 1e10): report time to train, cost, "
                           "energy and CO2")
    cost.add_argument("--price-per-hour", type=float, metavar="USD",
                      help="price per device-hour (default: the catalog's lowest on-demand list "
                           "price for the device, or --cloud's; none for a CPU or an unlisted device)")
    cost.add_argument("--cloud", choices=["aws", "gcp", "azure"],
                      help="take the list price from this cloud's catalog entry")
    cost.add_argument("--pue", type=float, default=PUE_DEFAULT,
                      help=f"datacenter overhead, power usage effectiveness (default {PUE_DEFAULT:g})")
    cost.add_argument("--grid-gco2-per-kwh", type=float, default=GRID_DEFAULT, metavar="G",
                      help=f"grid carbon intensity (default {GRID_DEFAULT:g}: world average 2023, Ember)")


def planner_inputs(args: argparse.Namespace):
    """(model, Ψ given by --params or None, clusters, seq) from the shared options: --gpus may
    name several clusters, comma-separated, for `plan` to compare."""
    from shardlm.hardware.catalog import parse_cluster

    model, seq = model_input(args)
    clusters = [parse_cluster(spec.strip(), args.intra, args.inter, args.nics)
                for spec in args.gpus.split(",")]
    if len(clusters) > 1 and args.command != "plan":
        raise ConfigError(f"--gpus {args.gpus!r}: several clusters (comma-separated) are compared "
                          f"by `shardlm plan`; `shardlm {args.command}` takes one")
    return model, args.params, clusters, seq


def model_input(args: argparse.Namespace):
    """(model, seq) from model_args' options and --seq."""
    from shardlm.planner.shapes import model_from_hf_config, model_from_params, preset_model

    if (args.model is None) == (args.params is None):
        raise ConfigError("give either --model PRESET or --params N (e.g. --params 7.5e9)")
    shape_flags = [f for f, v in (("--layers", args.layers), ("--hidden", args.hidden), ("--heads", args.heads),
                                  ("--kv-heads", args.kv_heads), ("--ffn", args.ffn), ("--family", args.family)) if v]
    if args.model is not None and shape_flags:
        raise ConfigError(f"{'/'.join(shape_flags)} go(es) with --params; a preset has its shape")
    if args.model is not None:
        model = (model_from_hf_config(args.model) if args.model.endswith(".json") or "/" in args.model
                 else preset_model(args.model))
    else:
        family = args.family or "gpt2"
        moe = dict(experts=args.experts, top_k=args.top_k) if family == "moe" else {}
        model = model_from_params(args.params, args.layers, args.hidden, args.heads, args.vocab,
                                  max(args.seq or 0, 2048), family, args.kv_heads, args.ffn, **moe)
    seq = args.seq or model.max_seq_len
    if seq <= 0:
        raise ConfigError(f"--seq {seq} must be > 0")
    from dataclasses import replace

    model = replace(model, experts=model.experts if args.experts is None else args.experts,
                    top_k=model.top_k if args.top_k is None else args.top_k)
    if model.experts < 0 or (model.experts and not 1 <= model.top_k <= model.experts):
        raise ConfigError(f"experts {model.experts} must be >= 0 and top-k {model.top_k} between 1 "
                          f"and the experts")
    return model, seq


def cluster_dtypes(args: argparse.Namespace, cluster):
    from shardlm.planner.search import default_dtypes

    return default_dtypes(cluster, args.precision, args.master, args.reduce)


def cost_basis(args: argparse.Namespace, cluster):
    """The CostBasis of --tokens (None without it); the other cost options need --tokens."""
    from shardlm.hardware.catalog import GRID_DEFAULT, PUE_DEFAULT
    from shardlm.planner.cost import cost_basis

    if args.tokens is None:
        given = [f for f, v in (("--price-per-hour", args.price_per_hour), ("--cloud", args.cloud),
                                ("--pue", args.pue != PUE_DEFAULT),
                                ("--grid-gco2-per-kwh", args.grid_gco2_per_kwh != GRID_DEFAULT),
                                ("--rank-by cost", getattr(args, "rank_by", "speed") == "cost")) if v]
        if given:
            raise ConfigError(f"{', '.join(given)} need(s) --tokens N (the training budget to price)")
        return None
    return cost_basis(cluster, args.tokens, args.price_per_hour, args.cloud, args.pue,
                      args.grid_gco2_per_kwh)


def cmd_estimate(args: argparse.Namespace) -> int:
    from shardlm.planner import report
    from shardlm.planner.workload import Strategy, Workload
    from shardlm.planner.memory import estimate_memory
    from shardlm.planner.timing import estimate_time
    from shardlm.planner.search import alternatives

    model, params, (cluster,), seq = planner_inputs(args)
    dtypes = cluster_dtypes(args, cluster)
    basis = cost_basis(args, cluster)
    world = cluster.world_size
    if args.micro_batch < 1 or args.grad_accum < 1 or min(args.tp, args.cp, args.pp, args.ep, args.dp_replicate) < 1:
        raise ConfigError("--micro-batch, --grad-accum, --tp, --cp, --pp, --ep and --dp-replicate must be >= 1")
    from shardlm.config.dims import ParallelDims

    dims = ParallelDims.resolve(world, args.dp_replicate, args.dp_shard, args.cp, args.tp, args.pp, args.ep)
    dp = dims.dp_size
    layout = dims
    workload = Workload(model, seq, args.micro_batch * args.grad_accum * dp, params)
    strategy = Strategy(layout, args.zero_stage, args.micro_batch, args.grad_accum, args.recompute,
                        args.offload_optimizer, args.offload_params, dtypes, args.sequence_parallel)
    memory = estimate_memory(workload, strategy, cluster)
    timing = estimate_time(workload, strategy, cluster)
    suggestions = [] if memory.fits else alternatives(workload, strategy, cluster)
    render = report.estimate_json if args.json else report.render_estimate
    print(render(workload, strategy, cluster, memory, timing, suggestions, basis))
    return 0 if memory.fits else 1


def cmd_plan(args: argparse.Namespace) -> int:
    """The search on each --gpus cluster; with several, the best plan of each compared (ranked
    by --rank-by: time to train, or cost when --tokens prices them), then each cluster's plans."""
    from shardlm.planner import report
    from shardlm.planner.workload import Workload
    from shardlm.planner.cost import rank, training_cost
    from shardlm.planner.search import EVERYTHING, RUNTIME, search

    model, params, clusters, seq = planner_inputs(args)
    sequences = args.global_batch or max(1, args.batch_tokens // seq)
    workload = Workload(model, seq, sequences, params)
    results, bases = [], []
    for cluster in clusters:
        basis = cost_basis(args, cluster)
        result = search(workload, cluster, cluster_dtypes(args, cluster),
                        RUNTIME if args.runtime_only else EVERYTHING)
        if basis is not None:
            result.plans = rank(result.plans, [training_cost(p.timing.tokens_per_s, cluster.world_size, basis)
                                               for p in result.plans], args.rank_by)
        results.append(result)
        bases.append(basis)
    if len(results) == 1:
        print(report.plan_result_json(results[0], args.top, bases[0], args.rank_by) if args.json
              else report.render_plan(results[0], args.top, bases[0], args.rank_by))
    else:
        print(report.clusters_json(results, bases, args.top, args.rank_by) if args.json
              else report.render_clusters(results, bases, args.top, args.rank_by))
    return 0 if any(r.plans for r in results) else 1


def calibrate_args(p: argparse.ArgumentParser) -> None:
    """`shardlm calibrate`: time the model's own matmuls on this machine."""
    model_args(p)
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the model's context)")
    p.add_argument("--micro-batch", type=int, default=1, metavar="B", help="sequences per rank per pass")
    p.add_argument("--tp", type=int, default=1, metavar="D", help="tensor-parallel degree (the shards' shapes)")
    p.add_argument("--ranks", type=int, default=1, metavar="N",
                   help="ranks sharing this machine: a CPU rank gets cores // N threads, as in training")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:i] (timed with synchronisation)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="activation.checkpoint of the whole-model pass timed on a CPU (its in-situ factor)")
    p.add_argument("--repeats", type=int, default=5, help="timings per matmul shape (the best is kept) and of the whole pass (the median)")
    p.add_argument("--again", action="store_true", help="measure anew instead of reading the cache")
    p.add_argument("--disk", metavar="DIR", type=Path,
                   help="also measure the disk under DIR as the nvme tier streams (zero.offload_* = nvme): "
                        "1, 2 and 4 ranks reading and writing at once, ~2 GB written; alone (without "
                        "--model) it measures only the disk")


def _calibrate_disk(args: argparse.Namespace) -> list[str]:
    """`--disk DIR`: the nvme tier's read + write rate under DIR with 1, 2 and 4 ranks streaming
    at once (hardware/disk_probe.py), cached per machine; the planner's local CPU cluster reads it."""
    from shardlm.hardware.probe import disk_streams

    measured = disk_streams(args.disk, again=args.again)
    return [f"  disk under {args.disk}: " + ", ".join(
        f"{n} rank(s) streaming {v['bytes_per_s'] / 1e9:.2f} GB/s read + write in all" for n, v in sorted(measured.items()))
        + " (O_DIRECT 64 MiB blocks, as the nvme tier; the planner's Nxcpu clusters read it)"]


def _model_pass(model, seq: int, args: argparse.Namespace, threads: int) -> str:
    """One forward + loss + backward of the whole model timed in this process (train/
    calibration.py), beside the planner's sum of its parts: the in-situ factor every layout's
    prediction of this model, micro-batch and dtype at these threads then uses."""
    from shardlm.config.dims import ParallelDims
    from shardlm.hardware.catalog import local_cpu
    from shardlm.launch.allocator import apply_malloc_policy
    from shardlm.planner.in_situ import in_situ_factor
    from shardlm.planner.memory import estimate_memory
    from shardlm.planner.workload import Dtypes, Strategy, Workload
    from shardlm.train.calibration import measured_pass

    one = Strategy(ParallelDims(), micro_batch=args.micro_batch, recompute=args.recompute,
                   dtypes=Dtypes(compute=args.precision))
    workload, alone = Workload(model, seq, args.micro_batch), local_cpu(1)
    need, have = estimate_memory(workload, one, alone).peak, alone.device.memory
    if need > 0.8 * have:  # a pass of the whole model in one process would not fit this machine
        return (f"the model's pass is not timed: one process needs ~{need / 1e9:,.1f} GB for it, this machine "
                f"has {have / 1e9:,.1f} GB available; predictions use its parts as timed apart (docs/"
                f"planner.md section 4b)")
    apply_malloc_policy()  # this process allocates as a training process does (fresh pages)
    passed = measured_pass(model, args.micro_batch, seq, args.precision, threads, args.again, args.repeats,
                           args.recompute)
    _, how = in_situ_factor(workload, one, local_cpu(args.ranks))  # read after: it holds the pass
    return (f"{how or 'no matmul curve for ' + args.precision}; it scales every layout's compute and "
            f"memory-bound work for this model (docs/planner.md section 4b)"
            + ("  (under load)" if passed["loaded"] else ""))


def cmd_calibrate(args: argparse.Namespace) -> int:
    """The model's forward matmuls on this machine at the run's per-rank threads: best-of-N
    FLOP/s per shape (cached per CPU/GPU model, torch, threads, precision, shape), the curve
    against the square matmul peak MFU uses, and what the planner assumes instead."""
    from shardlm.hardware.catalog import measured_curve
    from shardlm.hardware.probe import cached_curve, device_name, machine_load, matmul_curve
    from shardlm.launch.runtime import cpu_cores
    from shardlm.planner.compute import curve_rate
    from shardlm.planner.workload import matmul_shapes

    if min(args.micro_batch, args.tp, args.ranks, args.repeats) < 1:
        raise ConfigError("--micro-batch, --tp, --ranks and --repeats must be >= 1")
    if args.disk is not None and args.model is None and args.params is None:
        print("\n".join([f"calibrate: the disk under {args.disk}", *_calibrate_disk(args)]))
        return 0
    model, seq = model_input(args)
    if model.n_heads % args.tp:
        raise ConfigError(f"--tp {args.tp} does not divide the {model.n_heads} attention heads")
    cpu = args.device == "cpu"
    if not cpu:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--device {args.device}: no CUDA device here; use --device cpu")
    threads = max(1, cpu_cores() // args.ranks) if cpu else 1
    tokens = args.micro_batch * seq
    shapes = matmul_shapes(model, tokens, args.tp)
    curve = matmul_curve([s[1:4] for s in shapes], args.precision, threads, args.device, args.repeats,
                         args.again)
    peak = _peak(args, threads)
    load, cores = machine_load()
    measured = _weighted(shapes, curve)
    points = _smaller_batches(model, tokens, args, threads)
    # What the planner's time model reads for a run with these shapes (compute.compute_rate):
    # every point cached for this device, threads and precision, this model's included.
    planner_curve = measured_curve(cached_curve(args.precision, threads, args.device),
                           f"{args.precision}, " + (f"{threads} thread(s) on " if cpu else "") + device_name(args.device))
    planned = curve_rate(planner_curve, model, tokens, args.tp)
    lines = [f"calibrate: {model.preset} on {device_name(args.device)}"
             + (f", {threads} thread(s) per rank ({args.ranks} rank(s) on {cores} cores)" if cpu else "")
             + f", {args.precision}, micro-batch {args.micro_batch} x seq {seq} = {tokens} tokens"
             + (f", tp {args.tp}" if args.tp > 1 else ""),
             *_matmul_rows(shapes, curve, peak)]
    lines += [f"  peak ({'the square matmul MFU uses' if cpu else 'the catalog'}): {peak / 1e9:,.1f} GFLOP/s",
              f"  the model's matmuls, FLOP-weighted: {measured / 1e9:,.1f} GFLOP/s = {measured / peak:.0%} "
              f"of the peak (forward shapes)",
              f"  the planner's compute rate for this run: {planned / 1e9:,.1f} GFLOP/s = {planned / peak:.0%} "
              f"of the peak (forward and backward products on the curve; docs/planner.md section 4)",
              f"  calibration: {planner_curve.source} ({len(planner_curve.points)} points)",
              f"  the curve's fit: {planner_curve.describe_fit()}"]
    lines.append("  the curve, tokens per micro-batch -> FLOP-weighted GFLOP/s (of peak): " + ", ".join(
        f"{size} -> {rate / 1e9:,.1f} ({rate / peak:.0%})" for size, rate in [*points, (tokens, measured)]))
    if cpu:  # the memory-bound rates the step time adds (docs/planner.md section 4a)
        from shardlm.hardware.catalog import describe_memory_rates
        from shardlm.hardware.probe import memory_probe

        lines.append(f"  {describe_memory_rates(memory_probe(threads, again=args.again))}")
        lines.append(f"  {_model_pass(model, seq, args, threads)}")
    if args.disk is not None:
        lines += _calibrate_disk(args)
    loaded = [c for c in curve if c["loaded"]]
    if loaded or load > cores:
        lines.append(f"  LOAD: {len(loaded)} of {len(curve)} shapes timed beside other work (median more "
                     f"than 25% over the best, or the load average over the cores; now {load:.1f} on "
                     f"{cores} cores): best of {args.repeats} kept; rerun with --again on an idle machine")
    print("\n".join(lines))
    return 0


def _peak(args: argparse.Namespace, threads: int) -> float:
    """The peak the matmuls are compared with: the square matmul MFU uses on a CPU (at these
    threads), the catalog's for a GPU."""
    from shardlm.hardware.catalog import device_for_gpu_name
    from shardlm.hardware.probe import cpu_peak_flops, device_name

    if args.device == "cpu":
        return cpu_peak_flops(args.precision, threads)
    gpu = device_for_gpu_name(device_name(args.device))
    if gpu is None or args.precision not in gpu.peak:
        raise ConfigError(f"{device_name(args.device)}: not in the catalog with {args.precision}; "
                          f"no peak to compare with")
    return gpu.peak[args.precision]


def _weighted(shapes, curve) -> float:
    """The step's matmul FLOPs over their summed time: the rate the model's matmuls run at."""
    return (sum(2 * m * k * n * count for _, m, k, n, count in shapes)
            / sum(2 * m * k * n * count / c["flops_per_s"] for (_, m, k, n, count), c in zip(shapes, curve)))


def _smaller_batches(model, tokens: int, args: argparse.Namespace, threads: int) -> list[tuple[int, float]]:
    """The curve below this batch: (tokens per micro-batch, FLOP-weighted rate) at 1/2, 1/4 and
    1/8 of it (at least 16)."""
    from shardlm.hardware.probe import matmul_curve
    from shardlm.planner.workload import matmul_shapes

    points = []
    for size in sorted({max(16, tokens // 2**i) for i in range(1, 4)}):
        smaller = matmul_shapes(model, size, args.tp)
        points.append((size, _weighted(smaller, matmul_curve([x[1:4] for x in smaller], args.precision, threads,
                                                             args.device, args.repeats, args.again))))
    return points


def _matmul_rows(shapes, curve, peak: float) -> list[str]:
    """The table of the model's matmuls: each shape's rate, of the peak, spread and share of the
    step's matmul FLOPs."""
    total_flops = sum(2 * m * k * n * count for _, m, k, n, count in shapes)
    lines = [f"  {'matmul':<20s} {'m x k x n':>22s} {'GFLOP/s':>10s} {'of peak':>8s} {'spread':>7s} "
             f"{'step FLOPs':>10s}"]
    for (name, m, k, n, count), c in zip(shapes, curve):
        flagged = "  (under load)" if c["loaded"] else ""
        lines.append(f"  {name:<20s} {f'{m} x {k} x {n}':>22s} {c['flops_per_s'] / 1e9:>10,.1f} "
                     f"{c['flops_per_s'] / peak:>8.0%} {c['spread']:>7.0%} "
                     f"{2 * m * k * n * count / total_flops:>10.0%}{flagged}")
    return lines
