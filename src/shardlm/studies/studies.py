"""The five studies: each measures its points here (through a PointStore) and predicts the
cluster with the planner, and returns a StudyOutput (tables, plots, predicted rows, commands).
docs/studies/README.md says what each shows and how to read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.errors import ConfigError
from shardlm.hardware.catalog import Cluster
from shardlm.planner.cost import cost_basis, training_cost
import shardlm.studies.predict as P
from shardlm.studies.points import MiB, Point, PointStore, largest_fitting
from shardlm.studies.report import Plot, Section, StudyOutput, table
from shardlm.studies.specs import STRATEGIES, Study

GB = 1e9
MEASURE_NOTE = ("Measured memory is the rank-0 process's peak resident set size (VmHWM, the "
                "JSONL's peak_rss_bytes: python, torch, gloo and the data included), not the byte "
                "ledger (model_state_bytes: parameters, gradients and optimizer states only, which "
                "does not grow with the batch). The cap is checked against it after each run; it is "
                "not enforced by the operating system.")
NOISE_NOTE = ("Measured on a 2-core CPU shared with other jobs, fp32, a few steps per point: "
              "speeds are noisy (±10-20% on a quiet machine, far more under load); memory is "
              "steady to a few MiB. A point of r ranks is pinned to r cores (taskset: one core per "
              "rank, one thread each), so a rank computes on one core at every rank count.")


@dataclass
class Context:
    study: Study
    store: PointStore
    cluster: Cluster
    ranks: int
    """The most ranks measured here."""
    cap_mib: float
    notes: list[str] = field(default_factory=list)
    points: list[Point] = field(default_factory=list)

    def point(self, label: str, ranks: int, settings: dict) -> Point:
        m = self.study.measured
        p = Point.make(label, ranks, {**m.model, "train.steps": m.steps, **settings})
        if p not in self.points:
            self.points.append(p)
        return p

    def measure(self, point: Point) -> dict:
        result = self.store.measure(point)
        if "error" in result:
            self.notes.append(f"{point.label} failed: {result['error']}")
        return result

    def expect(self, points: int) -> None:
        """Tell the progress bar about points to come (a search's count is a guess)."""
        if self.store.progress is not None:
            self.store.progress.expect(points)

    def commands(self) -> list[tuple[str, str]]:
        return [(p.label, p.command) for p in self.points]


def _settings(key: str, micro: int, accum: int = 1) -> dict:
    strat = STRATEGIES[key]
    moe = {"model.experts": 4, "model.top_k": 2} if strat.moe else {}
    return {**strat.settings, **moe, "train.micro_batch": micro, "train.grad_accum": accum}


def _mib(b) -> float | None:
    return None if b is None else b / MiB


def _model(settings: dict) -> str:
    """'gpt-mini (d_model 512, n_heads 8)': the preset and the shape keys a study changes."""
    shape = [f"{k[6:]} {v}" for k, v in settings.items() if k.startswith("model.") and k != "model.preset"]
    return settings["model.preset"] + (f" ({', '.join(shape)})" if shape else "")


def _pct(x) -> float | None:
    return None if x is None else 100 * x


def _ok(result: dict) -> bool:
    return "error" not in result


# ---------------------------------------------------------------------------------------------
# max-batch and offload-rescue: the same search, two questions


def batch_search(ctx: Context) -> StudyOutput:
    s, cap, ranks = ctx.study, ctx.cap_mib, ctx.ranks
    model, params = P.model_of(s.predicted.model, s.predicted.seq)
    where = f"{s.predicted.model} at seq {s.predicted.seq} on {ctx.cluster.describe()}"
    curve = Plot("memory_vs_batch", f"Measured peak RSS per rank, {ranks} ranks", "micro-batch",
                 "MiB (rank 0, peak RSS)", hline=(cap, f"cap {cap:g} MiB"), logx=True)
    bars = Plot("max_batch", "Largest micro-batch that fits", "strategy", "micro-batch", kind="bar")
    rows, predicted = [], []
    basis = cost_basis(ctx.cluster, s.predicted_epoch_tokens)
    ctx.expect(len(s.strategies) * 3)
    for key in s.strategies:
        strat = STRATEGIES[key]
        make = lambda b, key=key: ctx.point(f"{key} b={b}", ranks, _settings(key, b))  # noqa: E731
        seen: dict[int, dict] = {}

        def fits(b: int, make=make, seen=seen) -> bool:
            seen[b] = result = ctx.measure(make(b))
            if _ok(result):
                curve.add(strat.label, b, result["peak_rss_bytes"] / MiB)
            return _ok(result) and result["peak_rss_bytes"] <= cap * MiB

        best, probes = largest_fitting(fits, s.max_batch)
        here = P.predicted_here_max_batch(make, cap, s.max_batch)
        at = seen.get(best, {})
        pbest, prow = P.predicted_max_batch(model, params, s.predicted.seq, ctx.cluster, strat, 4096,
                                            s.predicted.precision)
        if prow is not None:
            predicted.append({"strategy": key, **prow})
        tps = at.get("tokens_per_s") if best else None
        ptps = prow["tokens_per_s"] if prow else None
        cost = training_cost(ptps, ctx.cluster.world_size, basis) if ptps else None
        shown = "none" if not best else f"≥ {best} (the limit)" if best == s.max_batch else best
        rows.append([strat.label, shown, ", ".join(map(str, probes)), _mib(at.get("peak_rss_bytes")),
                     here or "none", tps, s.epoch_tokens / tps / 60 if tps else None,
                     pbest or "none", None if prow is None else prow["peak_bytes"] / GB,
                     ptps, s.predicted_epoch_tokens / ptps / 3600 if ptps else None,
                     cost and cost.usd, cost and cost.kwh])
        bars.add(f"measured here (cap {cap:g} MiB)", strat.label, best)
        bars.add("planner, here", strat.label, here)
        bars.add(f"planner, {s.predicted.model} on {ctx.cluster.world_size}x{ctx.cluster.device.name}",
                 strat.label, pbest)
    headers = ["strategy", "largest b (measured)", "probes", "peak MiB at b", "largest b (planner here)",
               "tokens/s at b", f"min / epoch of {s.epoch_tokens:.0e} tok",
               "largest b (planner, cluster)", "GB/rank at b", "tokens/s at b",
               f"h / epoch of {s.predicted_epoch_tokens:.0e} tok", "USD / epoch", "kWh / epoch"]
    m = s.measured
    body = (f"Measured: {_model(m.model)}, seq {m.model['train.seq_len']}, {ranks} ranks, "
            f"fp32, {m.steps} steps per probe; a point fits when its peak RSS is at most "
            f"{cap:g} MiB; the search doubles the micro-batch from 1 (up to {s.max_batch}) and then "
            f"bisects. Predicted: {where}, precision {s.predicted.precision}, the same search over "
            f"the planner's peak against the device's memory.\n\n" + table(headers, rows))
    notes = [MEASURE_NOTE, NOISE_NOTE, "Cost of a predicted epoch (planner/cost.py): "
             + "; ".join(basis.describe()) + "."]
    if s.name == "offload-rescue":
        notes.append("On a CPU the cpu offload tier is the device's own memory (docs/planner.md, "
                     "section 1): CPU offload cannot lower the measured peak here, the NVMe tier "
                     "(files under the run directory) can; on a GPU both move states off the device.")
        held = [r[0] for r in rows if r[0] in (STRATEGIES["ddp"].label, STRATEGIES["zero3"].label)
                and r[1] != "none"]
        if held:
            notes.append(f"Premise not met here: {', '.join(held)} fit(s) at batch 1 under {cap:g} MiB; "
                         f"rerun with a lower --cap-mib.")
    return StudyOutput(s.title, s.question, notes + ctx.notes,
                       [Section("Largest micro-batch, measured and predicted", body)],
                       [bars, curve], predicted, ctx.commands())


# ---------------------------------------------------------------------------------------------
# zero-sweep


def zero_sweep(ctx: Context) -> StudyOutput:
    s = ctx.study
    measured_rows = []
    states = Plot("sweep_measured_states", "Measured model states per rank (byte ledger)", "ZeRO stage",
                  "MiB per rank")
    comm = Plot("sweep_measured_comm", "Measured communication per rank per step", "ZeRO stage",
                "MiB per step")
    ctx.expect(len(s.sizes) * len(s.measured.ranks) * len(s.strategies))
    for size in s.sizes:
        for ranks in s.measured.ranks:
            for key in s.strategies:
                strat = STRATEGIES[key]
                point = ctx.point(f"{size} {ranks}r {key}", ranks,
                                  {"model.preset": size, **_settings(key, s.measured.micro_batch)})
                r = ctx.measure(point)
                if not _ok(r):
                    continue
                here = P.predict_here(point)
                measured_rows.append([size, ranks, strat.stage, _mib(r["model_state_bytes"]),
                                      _mib(here["model_state_bytes"]), _mib(r["peak_rss_bytes"]),
                                      _mib(here["peak_rss_bytes"]), r["tokens_per_s"], here["tokens_per_s"],
                                      _mib(r["comm_bytes"]), _pct(r["mfu"])])
                states.add(f"{size}, {ranks} rank(s)", strat.stage, r["model_state_bytes"] / MiB)
                comm.add(f"{size}, {ranks} rank(s)", strat.stage, r["comm_bytes"] / MiB)
    predicted, predicted_rows = [], []
    counts = P.rank_counts(ctx.cluster, s.predicted_ranks)
    memory = Plot("sweep_predicted_memory", f"Predicted peak memory per device, {counts[-1]} x "
                  f"{ctx.cluster.device.name}", "ZeRO stage", "GB per device", logy=True)
    mfu = Plot("sweep_predicted_mfu", f"Predicted MFU (configurations that fit), {counts[-1]} devices",
               "ZeRO stage", "MFU %")
    for family, names in (("decoder", s.predicted_sizes), ("encoder-decoder", s.encoder_decoder_sizes)):
        for name in names:
            model, params = P.model_of(name, s.predicted.seq)
            for n in counts:
                cluster = P.sized(ctx.cluster, n)
                for key in s.strategies:
                    strat = STRATEGIES[key]
                    row = P.predict(model, params, s.predicted.seq, cluster, strat, s.predicted.micro_batch,
                                    precision=s.predicted.precision)
                    predicted.append({"model": name, "family": family, "strategy": key, **row})
                    predicted_rows.append([name, family, n, strat.stage, row["peak_bytes"] / GB,
                                           "yes" if row["fits"] else "no", row["tokens_per_s"],
                                           row["comm_bytes"] / GB, 100 * row["mfu"]])
                    if n == counts[-1]:
                        memory.add(name, strat.stage, row["peak_bytes"] / GB)
                        if row["fits"]:
                            mfu.add(name, strat.stage, 100 * row["mfu"])
    memory.hline = (predicted[0]["capacity_bytes"] / GB, "device memory") if predicted else None
    m = s.measured
    mbody = (f"{', '.join(s.sizes)}; seq {m.model['train.seq_len']}, micro-batch {m.micro_batch} per "
             f"rank, fp32, {m.steps} steps; 'planner' = the planner's prediction for the same run on "
             f"this CPU.\n\n" + table(["model", "ranks", "stage", "states MiB", "planner", "peak RSS MiB",
                                      "planner", "tokens/s", "planner", "comm MiB/step", "MFU %"],
                                     measured_rows))
    pbody = (f"Micro-batch {s.predicted.micro_batch} x seq {s.predicted.seq} per device, precision "
             f"{s.predicted.precision}, on {', '.join(str(n) for n in counts)} x {ctx.cluster.device.name} "
             f"({ctx.cluster.node.per_node} per node). Encoder-decoder rows: "
             f"{' '.join(P.ENCODER_DECODER_NOTE.split())}" + "\n\n" + table(["model", "family", "devices", "stage", "peak GB/device", "fits",
                                         "tokens/s", "comm GB/step/device", "MFU %"], predicted_rows))
    notes = [MEASURE_NOTE.split(". The cap")[0] + ".", NOISE_NOTE,
             "The T5-shaped encoder-decoder family is predicted only, not measured: the "
             "measured half is the decoder family (the trainer's seq2seq path, model.hf_config "
             "with data.format = 'seq2seq', is not wired into this study yet)."]
    return StudyOutput(s.title, s.question, notes + ctx.notes,
                       [Section("Measured here (decoder family)", mbody),
                        Section(f"Predicted on {ctx.cluster.device.name}", pbody)],
                       [states, comm, memory, mfu], predicted, ctx.commands())


# ---------------------------------------------------------------------------------------------
# strategies


def strategies(ctx: Context) -> StudyOutput:
    s, ranks = ctx.study, ctx.ranks
    micro = s.measured.micro_batch
    global_batch = micro * ranks
    mem = Plot("strategies_memory", f"Measured memory per rank, {ranks} ranks", "strategy", "MiB", kind="bar")
    speed = Plot("strategies_throughput", f"Measured tokens/s, {ranks} ranks", "strategy", "tokens/s", kind="bar")
    cmem = Plot("strategies_cluster_memory", f"Predicted memory per device, {s.predicted.model}", "strategy",
                "GB", kind="bar")
    cspeed = Plot("strategies_cluster_throughput", f"Predicted throughput, {s.predicted.model}", "strategy",
                  "thousand tokens/s", kind="bar")
    model, params = P.model_of(s.predicted.model, s.predicted.seq)
    rows, prows, predicted = [], [], []
    ctx.expect(len(s.strategies))
    for key in s.strategies:
        strat = STRATEGIES[key]
        dp = ranks // (strat.tp * strat.pp)
        r = ctx.measure(ctx.point(f"{key}", ranks, _settings(key, micro, max(1, global_batch // (micro * dp)))))
        if _ok(r):
            rows.append([strat.label, _mib(r["peak_rss_bytes"]), _mib(r["model_state_bytes"]), r["tokens_per_s"],
                         _mib(r["comm_bytes"]), _pct(r["mfu"]), strat.note])
            mem.add("peak RSS", strat.label, r["peak_rss_bytes"] / MiB)
            mem.add("model states (ledger)", strat.label, r["model_state_bytes"] / MiB)
            speed.add("measured", strat.label, r["tokens_per_s"])
        else:
            rows.append([strat.label, None, None, None, None, None, f"failed: {r['error'][:120]}"])
        world = ctx.cluster.world_size
        try:
            p = P.predict(model, params, s.predicted.seq, ctx.cluster, strat, s.predicted.micro_batch,
                          s.predicted.micro_batch * world, s.degrees, s.predicted.precision)
        except ConfigError as e:
            prows.append([strat.label, None, None, None, None, None, f"not modelled: {e}"])
            continue
        predicted.append({"strategy": key, **p})
        layout = f"tp {p['tp']} pp {p['pp']} ep {p['ep']}"
        prows.append([strat.label, layout, p["peak_bytes"] / GB, "yes" if p["fits"] else "no",
                      p["tokens_per_s"], p["comm_bytes"] / GB, 100 * p["mfu"]])
        cmem.add("peak per device", strat.label, p["peak_bytes"] / GB)
        if p["fits"]:
            cspeed.add("fits", strat.label, p["tokens_per_s"] / 1e3)
    cmem.hline = (predicted[0]["capacity_bytes"] / GB, "device memory") if predicted else None
    m = s.measured
    mbody = (f"{_model(m.model)}, seq {m.model['train.seq_len']}, global batch {global_batch} "
             f"sequences (micro-batch {micro}; layouts with fewer data ranks accumulate), fp32, "
             f"{m.steps} steps, {ranks} ranks; tp, pp and ep at degree 2.\n\n"
             + table(["strategy", "peak RSS MiB", "states MiB", "tokens/s", "comm MiB/step", "MFU %", "note"], rows))
    pbody = (f"{s.predicted.model}, seq {s.predicted.seq}, global batch {s.predicted.micro_batch * ctx.cluster.world_size}"
             f" sequences, on {ctx.cluster.describe()}; degrees at this scale: {s.degrees} (the expert row "
             f"is the model with {P.MOE_EXPERTS} experts, top-2).\n\n"
             + table(["strategy", "layout", "peak GB/device", "fits", "tokens/s", "comm GB/step/device", "MFU %"],
                     prows))
    return StudyOutput(s.title, s.question, [MEASURE_NOTE.split(". The cap")[0] + ".", NOISE_NOTE] + ctx.notes,
                       [Section("Measured here", mbody), Section("Predicted on the cluster", pbody)],
                       [mem, speed, cmem, cspeed], predicted, ctx.commands())


# ---------------------------------------------------------------------------------------------
# scaling


def scaling(ctx: Context) -> StudyOutput:
    s = ctx.study
    key = s.strategies[0]
    strat = STRATEGIES[key]
    micro = s.measured.micro_batch
    counts = list(range(1, ctx.ranks + 1))
    here = Plot("scaling_measured", "Measured tokens/s against ranks", "ranks", "tokens/s")
    rows = []
    ctx.expect(2 * len(counts))
    base = {}
    for mode in ("weak", "strong"):
        for n in counts:
            b = micro if mode == "weak" else max(1, micro * ctx.ranks // n)
            r = ctx.measure(ctx.point(f"{key} {n}r b={b}", n, _settings(key, b)))
            if not _ok(r):
                continue
            base.setdefault(mode, r["tokens_per_s"])
            gain = r["tokens_per_s"] / base[mode]
            rows.append([mode, n, b * n, r["tokens_per_s"], _pct(r["mfu"]), _mib(r["comm_bytes"]),
                         gain, gain / n])
            here.add(mode, n, r["tokens_per_s"])
    model, params = P.model_of(s.predicted.model, s.predicted.seq)
    top = max(s.predicted_ranks)
    throughput = Plot("scaling_throughput", f"Predicted tokens/s, {s.predicted.model} on "
                      f"{ctx.cluster.device.name}", "devices", "tokens/s", logx=True, logy=True)
    mfu = Plot("scaling_mfu", "Predicted MFU and communication share", "devices", "%", logx=True)
    prows, predicted = [], []
    first = {}
    basis = cost_basis(ctx.cluster, 1e9)
    for mode in ("weak", "strong"):
        for n in s.predicted_ranks:
            b = s.predicted.micro_batch if mode == "weak" else min(s.predicted.micro_batch, top // n)
            p = P.predict(model, params, s.predicted.seq, P.sized(ctx.cluster, n), strat, b,
                          s.predicted.micro_batch * n if mode == "weak" else top, precision=s.predicted.precision)
            predicted.append({"mode": mode, "strategy": key, **p})
            first.setdefault(mode, (n, p["tokens_per_s"]))
            n0, t0 = first[mode]
            prows.append([mode, n, p["global_batch"], b, p["grad_accum"], "yes" if p["fits"] else "no",
                          p["tokens_per_s"], 100 * p["mfu"], 100 * p["comm_share"],
                          p["tokens_per_s"] / t0 / (n / n0),
                          training_cost(p["tokens_per_s"], n, basis).usd])
            throughput.add(mode, n, p["tokens_per_s"])
            mfu.add(f"MFU, {mode}", n, 100 * p["mfu"])
            mfu.add(f"exposed communication, {mode}", n, 100 * p["comm_share"])
    m = s.measured
    mbody = (f"{strat.label}, {_model(m.model)}, seq {m.model['train.seq_len']}, fp32, {m.steps} steps. "
             f"Weak: micro-batch {micro} per rank; strong: global batch {micro * ctx.ranks} split over the "
             f"ranks. Speed-up: tokens/s over one rank's; efficiency: speed-up ÷ ranks. "
             f"The communication share is predicted only (the JSONL counts bytes, not wait time).\n\n"
             + table(["mode", "ranks", "global batch", "tokens/s", "MFU %", "comm MiB/step", "speed-up",
                      "efficiency"], rows))
    pbody = (f"{strat.label}, {s.predicted.model}, seq {s.predicted.seq}, precision {s.predicted.precision}, "
             f"{ctx.cluster.device.name} nodes of {ctx.cluster.node.per_node} ({ctx.cluster.node.inter.name} "
             f"between nodes). Weak: micro-batch {s.predicted.micro_batch} per device; strong: {top} sequences "
             f"per step at every size (gradient accumulation where the micro-batch would exceed "
             f"{s.predicted.micro_batch}). Efficiency: tokens/s per device relative to the smallest "
             f"size. Communication share: exposed (not overlapped) communication / step time. Cost: "
             f"{'; '.join(basis.describe())}.\n\n"
             + table(["mode", "devices", "global batch", "micro-batch", "grad accum", "fits", "tokens/s",
                      "MFU %", "comm share %", "efficiency", "USD per 1e9 tokens"], prows))
    return StudyOutput(s.title, s.question, [NOISE_NOTE] + ctx.notes,
                       [Section("Measured here", mbody), Section("Predicted to 1,024 devices", pbody)],
                       [here, throughput, mfu], predicted, ctx.commands())


RUN = {"max-batch": batch_search, "offload-rescue": batch_search, "zero-sweep": zero_sweep,
       "strategies": strategies, "scaling": scaling}
