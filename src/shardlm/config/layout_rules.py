"""The checks across fields that say which layouts and features compose (config.rules runs them
with the others): the degrees of parallelism against the model's heads, experts, sequence and
pipeline; ZeRO stages against offload; LoRA / QLoRA, FP8, document masks, activation offload,
seq2seq and Muon against the axes. Each names the keys to change (docs/architecture.md,
"Composition matrix": no pair of its 23 features is refused)."""

from __future__ import annotations


from shardlm.config.fields import Config, _cross, compile_on, document_mask_on
from shardlm.parallel.pipeline.tables import NAMED
from shardlm.errors import ConfigError


@_cross("parallel.tp", "model.n_heads", "model.n_kv_heads")
def _tp_divides_heads(cfg: Config) -> list[str]:
    tp, m = cfg.parallel.tp, cfg.model
    kv = m.n_kv_heads or m.n_heads
    return ([f"parallel.tp = {tp} must divide model.n_heads = {m.n_heads}, and either divide the "
             f"key/value heads ({kv}) or be a multiple of them (each key/value head is then "
             f"replicated on tp / n_kv_heads ranks): each rank computes whole heads"]
            if tp > 1 and (m.n_heads % tp or (kv % tp and tp % kv)) else [])


@_cross("parallel.sequence_parallel", "parallel.tp")
def _sequence_parallel_needs_tp(cfg: Config) -> list[str]:
    par = cfg.parallel
    return (["parallel.sequence_parallel = true splits the sequence inside the tensor-parallel group: "
             "it needs parallel.tp > 1"] if par.sequence_parallel and par.tp == 1 else [])


@_cross("parallel.async_tp", "parallel.tp", "parallel.sequence_parallel", "precision.compute", "lora.quantize")
def _async_tp_composes(cfg: Config) -> list[str]:
    """parallel.async_tp decomposes sequence parallelism's all-gather / reduce-scatter around the
    tensor-parallel linears' plain matmuls (parallel/tensor/async_tp.py)."""
    par = cfg.parallel
    if not par.async_tp:
        return []
    if par.tp == 1 or not par.sequence_parallel:
        return [f"parallel.async_tp = true overlaps sequence parallelism's all-gather / reduce-scatter "
                f"with the tensor-parallel matmuls: it needs parallel.tp > 1 (got {par.tp}) and "
                f"parallel.sequence_parallel = true (got {str(par.sequence_parallel).lower()}); set "
                f"them, or async_tp = false"]
    # train.compile: the decomposed linears are custom ops, each one opaque node of the block's graph;
    # precision.compute = 'fp8': each piece is rounded at the whole tensor's amax, max-reduced
    # over the group first (parallel/tensor/async_fp8.py); lora.quantize: the base is dequantised
    # for the pieces (layers.overlap_weight)
    if cfg.precision.compute == "fp8" and cfg.lora.rank > 0:
        return [f"parallel.async_tp = true with precision.compute = 'fp8' and lora.rank = {cfg.lora.rank}: "
                f"the pieces travel rounded to E4M3, and LoRA's adapter reads the unrounded gathered "
                f"input, which would be a second all-gather of the same rows. Set parallel.async_tp = "
                f"false (blocking sequence parallelism composes with both), or train LoRA in bf16 / fp32"]
    return []


@_cross("parallel.pp", "parallel.pp_layers", "parallel.pp_schedule", "parallel.pp_virtual",
        "model.n_layers", "train.grad_accum")
def _pipeline_fits(cfg: Config) -> list[str]:
    from shardlm.config.dims import parse_layers
    from shardlm.parallel.pipeline.tables import V_SHAPED
    from shardlm.parallel.pipeline.schedules import table_for

    par, n = cfg.parallel, cfg.model.n_layers
    if par.pp == 1:
        return ["parallel.pp_layers is set but parallel.pp = 1: set parallel.pp to the number of "
                "stages, or leave pp_layers empty"] if par.pp_layers else []
    problems = []
    stages = par.pp * par.pp_virtual
    schedule, virtual, micro = par.pp_schedule, par.pp_virtual, cfg.train.grad_accum
    if schedule in V_SHAPED and virtual != 2:
        problems.append(f"parallel.pp_schedule = '{schedule}' places two chunks per rank in a V (rank r "
                        f"holds stages r and 2·pp-1-r): set parallel.pp_virtual = 2 (got {virtual})")
    elif schedule in ("gpipe", "1f1b", "zb") and virtual > 1:
        problems.append(f"parallel.pp_schedule = '{schedule}' with parallel.pp_virtual = {virtual}: "
                        f"'{schedule}' runs one chunk per rank (pp_virtual = 1); several: 'interleaved', "
                        f"or two in a V: 'zbv', 'dualpipev'")
    elif schedule == "interleaved" and virtual == 1:
        problems.append("parallel.pp_schedule = 'interleaved' with parallel.pp_virtual = 1: the "
                        "'interleaved' schedule runs pp_virtual >= 2 chunks per rank")
    elif schedule == "interleaved" and micro % par.pp:
        problems.append(f"parallel.pp_schedule = 'interleaved' sends micro-batches through each chunk "
                        f"in groups of pp = {par.pp}: train.grad_accum = {micro} must divide by it")
    elif schedule == "dualpipev" and micro < 2 * par.pp:
        problems.append(f"parallel.pp_schedule = 'dualpipev' needs at least 2·pp = {2 * par.pp} "
                        f"micro-batches (train.grad_accum = {micro}): raise grad_accum or use 'zbv'")
    elif schedule in NAMED or schedule.startswith("file:"):
        try:  # the table itself: built (or read) and simulated, as the run will execute it
            table_for(schedule, par.pp, virtual, micro)
        except ConfigError as e:
            problems.append(f"parallel.pp_schedule = '{schedule}': {e}")
    if stages > n:
        problems.append(f"parallel.pp × pp_virtual = {stages} stages exceed the model's {n} layers "
                        f"(model.n_layers): every stage needs at least one block")
    elif par.pp_layers:
        try:
            parse_layers(par.pp_layers, n, stages)
        except ConfigError as e:
            problems.append(str(e))
    return problems


@_cross("model.experts", "model.top_k", "parallel.ep", "parallel.tp", "parallel.cp", "parallel.dp_shard",
        "parallel.ep_rebalance_every")
def _experts_fit(cfg: Config) -> list[str]:
    m, par, problems = cfg.model, cfg.parallel, []
    if m.experts and m.top_k > m.experts:
        problems.append(f"model.top_k = {m.top_k} exceeds model.experts = {m.experts}: a token "
                        f"cannot choose more experts than there are")
    if par.ep > 1:
        if not m.experts or m.experts % par.ep:
            problems.append(f"parallel.ep = {par.ep} must divide model.experts = {m.experts}: each "
                            f"expert-parallel rank holds experts / ep of them"
                            + ("" if m.experts else " (this model has none: set model.experts)"))
        if par.dp_shard > 0 and (par.dp_shard * par.cp) % par.ep:
            problems.append(f"parallel.ep = {par.ep} must divide parallel.dp_shard × parallel.cp = "
                            f"{par.dp_shard} × {par.cp}: expert-parallel ranks are data- and "
                            f"context-parallel ranks of one shard group")
        if par.tp > 1 and par.ep_rebalance_every:
            problems.append(f"parallel.ep_rebalance_every = {par.ep_rebalance_every} with parallel.tp = "
                            f"{par.tp} is not built yet (re-placement moves experts within one ep group, "
                            f"not an ep × tp grid): set it to 0 or parallel.tp = 1")
    spread = par.tp * par.ep  # the experts are spread over the tp ranks and the ep ranks: ep × tp
    if m.experts and par.tp > 1 and m.experts % spread:
        problems.append(f"parallel.tp × parallel.ep = {par.tp} × {par.ep} must divide model.experts = "
                        f"{m.experts}: with tensor parallelism each of the ep × tp ranks holds "
                        f"experts / (ep × tp) of them")
    return problems


def cp_degrees(cp: int, mode: str, ulysses: int) -> tuple[int, int]:
    """(all-to-all degree, ring degree) of parallel.cp = `cp` attending by parallel.cp_mode =
    `mode` ('auto' is decided before a run: it counts as the ring here); their product is cp."""
    if mode == "ulysses":
        return cp, 1
    if mode == "hybrid":
        a2a = ulysses or 2
        return (a2a, cp // a2a) if a2a and cp % a2a == 0 else (1, cp)
    return 1, cp


@_cross("parallel.cp", "parallel.cp_mode", "parallel.cp_ulysses", "parallel.tp", "model.n_heads",
        "model.n_kv_heads")
def _cp_mode_fits(cfg: Config) -> list[str]:
    """Ulysses splits each tensor-parallel rank's heads over the all-to-all degree (parallel/
    context/ulysses.py): query heads must divide by it; key/value heads divide by it or, fewer than it,
    divide it (each then replicated on a2a / kv ranks, as tensor parallelism replicates them)."""
    par, m, problems = cfg.parallel, cfg.model, []
    mode, a2a = par.cp_mode, par.cp_ulysses
    if a2a and mode not in ("hybrid", "ulysses"):
        problems.append(f"parallel.cp_ulysses = {a2a} is the all-to-all degree of cp_mode = 'hybrid' "
                        f"(or 'ulysses'); with cp_mode = {mode!r} it has no effect: set it to 0")
    if mode == "ulysses" and a2a not in (0, par.cp):
        problems.append(f"parallel.cp_ulysses = {a2a} with cp_mode = 'ulysses': the all-to-all spans "
                        f"all parallel.cp = {par.cp} ranks; set cp_ulysses = 0, or cp_mode = 'hybrid'")
    if mode == "hybrid" and par.cp > 1 and not (1 < (a2a or 2) < par.cp and par.cp % (a2a or 2) == 0):
        problems.append(f"parallel.cp_mode = 'hybrid' with parallel.cp = {par.cp} and cp_ulysses = "
                        f"{a2a or 2}: the all-to-all degree must divide cp and lie strictly between 1 "
                        f"and cp (a ring of cp / cp_ulysses >= 2 groups); use cp_mode = 'ring' or "
                        f"'ulysses' for the ends, or e.g. cp = 4, cp_ulysses = 2")
    if par.cp == 1 or mode in ("ring", "auto") or problems:
        return problems
    a2a = cp_degrees(par.cp, mode, a2a)[0]
    heads, kv = m.n_heads // par.tp, max(1, (m.n_kv_heads or m.n_heads) // par.tp)
    if heads % a2a or (kv % a2a and a2a % kv):
        problems.append(f"parallel.cp_mode = {mode!r} splits each tensor-parallel rank's heads over "
                        f"{a2a} ranks (the all-to-all degree): its {heads} query heads (model.n_heads "
                        f"= {m.n_heads} / tp = {par.tp}) must divide by {a2a}, and its {kv} key/value "
                        f"heads divide by {a2a} or divide it (then replicated); use cp_mode = 'ring' "
                        f"(any head count) or a smaller all-to-all degree (cp_mode = 'hybrid', "
                        f"parallel.cp_ulysses)")
    return problems


@_cross("parallel.cp", "train.seq_len")
def _cp_divides_sequence(cfg: Config) -> list[str]:
    cp, t = cfg.parallel.cp, cfg.train.seq_len
    return ([f"parallel.cp = {cp} cuts each sequence into 2·cp = {2 * cp} chunks (one from the front "
             f"and one from the back per rank, for load balance), so train.seq_len = {t} must divide "
             f"by {2 * cp}; try train.seq_len = {max(2 * cp, t // (2 * cp) * 2 * cp)}"]
            if cp > 1 and t % (2 * cp) else [])


@_cross("train.optimizer", "zero.offload_optimizer", "zero.offload_params", "lora.rank")
def _muon_layout(cfg: Config) -> list[str]:
    """Muon orthogonalises whole matrices: ZeRO's flat shards are gathered per unit and tensor
    parallelism's cuts over the tp group (parallel/data/zero/muon.py); a pipeline stage, an expert-parallel
    rank and a context-parallel rank each hold their matrices whole (MoE's 3-D expert banks stay
    with AdamW), and replicas (hybrid sharding, fault-tolerant, local SGD) see the same averaged
    gradient. LoRA and QLoRA by the same rule as every layer: the adapters' factors A (r x in)
    and B (out x r) are the weights of two linear maps, each orthogonalised as its own matrix
    (the frozen base trains not at all). Refused: the nvme tier, whose masters stream from
    disk through AdamW's chunked step and are not in memory when Muon's update lands after it."""
    z = cfg.zero
    apart = {k: v for k, v, alone in (("zero.offload_optimizer", z.offload_optimizer, "nvme"),
                                      ("zero.offload_params", z.offload_params, "nvme"))
             if v == alone}
    if cfg.train.optimizer != "muon" or not apart:
        return []
    return [f"train.optimizer = 'muon' with {', '.join(f'{k} = {v!r}' for k, v in apart.items())}: "
            f"the nvme tier's masters stream from disk inside AdamW's chunked step, not in memory when "
            f"Muon's update is applied after it. Use offload 'cpu', or train.optimizer = 'adamw' "
            f"for this layout"]


@_cross("zero.offload_optimizer", "parallel.zero_stage")
def _optimizer_offload_stage(cfg: Config) -> list[str]:
    z, par = cfg.zero, cfg.parallel
    return ([f"zero.offload_optimizer = {z.offload_optimizer!r} needs parallel.zero_stage >= 1 "
             f"(stage 1 shards, and offloads, the optimizer state; one process may use it)"]
            if z.offload_optimizer != "none" and par.zero_stage == 0 else [])


@_cross("zero.offload_params", "parallel.zero_stage")
def _param_offload_stage(cfg: Config) -> list[str]:
    z, par = cfg.zero, cfg.parallel
    return ([f"zero.offload_params = {z.offload_params!r} needs parallel.zero_stage = 3 (only "
             f"stage 3 shards the parameters), got {par.zero_stage}"]
            if z.offload_params != "none" and par.zero_stage != 3 else [])


@_cross("lora.rank", "parallel.tp", "lora.quantize", "model.hf_config", "model.n_kv_heads", "model.n_heads")
def _lora_layout(cfg: Config) -> list[str]:
    """LoRA's frozen base is ZeRO units like any other (parallel/data/zero/engine.py: gathered at stage 3,
    kept by the parameter store when zero.offload_params is set). Tensor parallelism cuts our
    decoder's adapters as it cuts the linears they wrap, and a quantised base (lora.quantize) as
    whole stored rows of its byte tables (parallel/tensor/decoder.py, models/quant.py); a transformers
    model's layers (model.hf_config) are not cut yet, nor a quantised base's key/value rows that
    every rank keeps when tp > n_kv_heads."""
    if not cfg.lora.rank or cfg.parallel.tp == 1:
        return []
    m, tp = cfg.model, cfg.parallel.tp
    kv = m.n_kv_heads or m.n_heads
    blocking = [f"{key} = {value!r} ({why})" for key, value, why, on in (
        ("lora.quantize", cfg.lora.quantize, f"with parallel.tp = {tp} > model.n_kv_heads = {kv} "
         f"every rank keeps all key/value rows, which are not cut from a quantised base yet; set "
         f"parallel.tp <= {kv} or lora.quantize = 'none'", cfg.lora.quantize != "none" and tp > kv),
        ("model.hf_config", cfg.model.hf_config, "tensor parallelism cuts only our decoder's "
         "adapters; use model.preset or model.hf_path of a supported family, or parallel.tp = 1",
         bool(cfg.model.hf_config)),
    ) if on]
    return ([f"lora.rank = {cfg.lora.rank} with parallel.tp = {cfg.parallel.tp} does not compose "
             f"with: {'; '.join(blocking)}"] if blocking else [])


@_cross("lora.quantize", "lora.rank", "model.hf_config", "lora.quantize_layout", "parallel.tp")
def _qlora_composes(cfg: Config) -> list[str]:
    """lora.quantize stores our decoder's frozen block linears as packed bytes (models/quant.py)."""
    q = cfg.lora.quantize
    if q == "none":
        return []
    blocking = [f"{key} = {value!r} ({why})" for key, value, why, on in (
        ("lora.rank", cfg.lora.rank, "the quantised base is frozen: without adapters nothing "
         "trains; set lora.rank > 0", cfg.lora.rank == 0),
        ("model.hf_config", cfg.model.hf_config, "a transformers model's layers are not ours to "
         "quantise; use model.hf_path or model.preset", bool(cfg.model.hf_config)),
        ("lora.quantize_layout", cfg.lora.quantize_layout, f"parallel.tp = {cfg.parallel.tp} cuts the "
         "row-parallel linears' input, across each row's blocks; use 'columns' or 'auto'",
         cfg.lora.quantize_layout == "rows" and cfg.parallel.tp > 1),
    ) if on]
    return ([f"lora.quantize = {q!r} does not compose with: {'; '.join(blocking)}"]
            if blocking else [])


@_cross("data.format", "model.hf_path", "model.hf_config", "parallel.tp", "parallel.pp", "lora.rank")
def _seq2seq_model(cfg: Config) -> list[str]:
    """data.format = 'seq2seq' and an encoder-decoder model go together; tensor parallelism and
    the pipeline (our decoder's layers and blocks) and LoRA (our decoder's linears) do not apply
    to one yet."""
    from shardlm.config.hf_shapes import encoder_decoder_config

    m, fmt = cfg.model, cfg.data.format
    enc_dec = bool(encoder_decoder_config(m.hf_path, m.hf_config))
    if fmt != "seq2seq":
        return ([f"model.hf_config / model.hf_path name an encoder-decoder, which trains on "
                 f"data.format = 'seq2seq' (source -> target pairs), not {fmt!r}"] if enc_dec else [])
    # Neither key: perhaps a model given through the Python API (build_run(cfg, model=...)),
    # which build_run checks; a decoder-only checkpoint is certainly wrong.
    out = [] if enc_dec or not m.hf_path else [
        "data.format = 'seq2seq' needs an encoder-decoder model: model.hf_config = a T5 / BART "
        "config.json (from scratch; configs/hf/) or model.hf_path = a saved "
        "T5ForConditionalGeneration / BartForConditionalGeneration directory"]
    if cfg.parallel.tp > 1:  # refused by the loss-masked-data rule until that went (issue 28)
        out.append(f"data.format = 'seq2seq' with parallel.tp = {cfg.parallel.tp}: tensor "
                   f"parallelism cuts our decoder's layers (or a causal LM's base_model_tp_plan), "
                   f"not an encoder-decoder's; use ZeRO (parallel.zero_stage)")
    if cfg.parallel.pp > 1:
        out.append(f"data.format = 'seq2seq' with parallel.pp = {cfg.parallel.pp}: pipeline stages "
                   f"cut our decoder's blocks, not an encoder-decoder; use ZeRO (parallel.zero_stage)")
    if cfg.lora.rank:
        out.append(f"data.format = 'seq2seq' with lora.rank = {cfg.lora.rank}: LoRA applies to our "
                   f"decoder only; set lora.rank = 0 (full fine-tuning, ZeRO-3 shards it)")
    return out


@_cross("data.document_mask", "data.format", "model.attention", "parallel.tp", "parallel.cp",
        "parallel.cp_mode", "train.compile")
def _attention_composes(cfg: Config) -> list[str]:
    """Document masks ride on the input ids (PackedTokens: shardlm/data/packed.py) into Decoder.forward,
    every pipeline stage included; context parallelism keeps the whole sequence's document
    positions on every rank (the ring masks each hop by them, Ulysses attends the whole
    sequence)."""
    par, attention, problems = cfg.parallel, cfg.model.attention, []
    if document_mask_on(cfg.data):
        why = f"data.document_mask = {cfg.data.document_mask!r} (on for data.format = {cfg.data.format!r})"
        if cfg.data.format == "seq2seq":
            problems.append(f"{why}: seq2seq examples are not packed; set data.document_mask = 'off' or 'auto'")
    if attention == "per_document" and compile_on(cfg.train):
        problems.append("model.attention = 'per_document' with train.compile = true: its document "
                        "lengths are data-dependent and cannot be one graph; use 'auto' (sdpa with "
                        "a mask when compiled) or 'sdpa'")
    if attention not in ("auto", "sdpa") and par.cp > 1 and par.cp_mode != "ulysses":
        problems.append(f"model.attention = {attention!r} with parallel.cp = {par.cp} and cp_mode = "
                        f"{par.cp_mode!r}: the ring runs its own per-block kernel; use 'auto' or "
                        f"'sdpa', or cp_mode = 'ulysses' (the whole sequence per head: any backend)")
    return problems


@_cross("activation.offload", "activation.offload_blocks", "model.n_layers")
def _activation_offload_composes(cfg: Config) -> list[str]:
    """activation.offload moves what each chosen block keeps for backward to host memory: its
    saved tensors, or with recomputation (activation.checkpoint) the checkpoint's kept inputs
    (parallel/blocks/activation.py)."""
    a, n = cfg.activation, cfg.model.n_layers
    if a.offload == "none":
        return ([f"activation.offload_blocks = {a.offload_blocks} has no effect with activation.offload "
                 f"= 'none'; set activation.offload = 'cpu' or leave offload_blocks at 0"]
                if a.offload_blocks else [])
    problems = []
    if a.offload_blocks > n:
        problems.append(f"activation.offload_blocks = {a.offload_blocks} exceeds the model's {n} "
                        f"blocks (model.n_layers); 0 offloads every block")
    return problems


@_cross("precision.compute", "precision.fp8_recipe", "precision.fp8_emulate", "precision.fp8_block",
        "run.device", "parallel.tp", "model.experts", "model.n_heads",
        "model.n_kv_heads", "lora.rank", "train.compile")
def _fp8_composes(cfg: Config) -> list[str]:
    """precision.compute = 'fp8' runs the blocks' matmuls through models/fp8.py fp8_linear: the
    plain linears, LoRA's base, the tensor-parallel linears, the experts (emulated; torchao on
    FP8 hardware converts plain linears only). What does not compose yet is refused by name.
    Whether the device has FP8 is checked where the device is known (models.fp8.check_fp8_device,
    before spawning)."""
    p, par = cfg.precision, cfg.parallel
    if p.compute != "fp8":
        unused = [f"{key} = {value!r}" for key, value, default in (
            ("precision.fp8_recipe", p.fp8_recipe, "tensorwise"), ("precision.fp8_emulate", p.fp8_emulate, False),
            ("precision.fp8_block", p.fp8_block, 128)) if value != default]
        return ([f"{', '.join(unused)} has no effect with precision.compute = {p.compute!r}; set "
                 f"precision.compute = 'fp8' or drop them"] if unused else [])
    problems = []
    if cfg.run.device == "cpu" and not p.fp8_emulate:
        problems.append("precision.compute = 'fp8' with run.device = 'cpu': a CPU has no FP8 matmuls. "
                        "Set precision.fp8_emulate = true to emulate the FP8 rounding with bf16 matmuls "
                        "(for numerics, not speed), or use precision.compute = 'bf16'")
    if p.fp8_block != 128 and p.fp8_recipe != "blockwise":
        problems.append(f"precision.fp8_block = {p.fp8_block} has no effect with precision.fp8_recipe = "
                        f"{p.fp8_recipe!r}; set fp8_recipe = 'blockwise' or drop fp8_block")
    kv = cfg.model.n_kv_heads or cfg.model.n_heads
    blocking = [f"{key} = {value!r} ({why})" for key, value, why, on in (
        ("parallel.tp", par.tp, "blockwise tiles would straddle the tensor-parallel cut; use "
         "fp8_recipe = 'tensorwise' or 'delayed'", par.tp > 1 and p.fp8_recipe == "blockwise"),
        ("parallel.tp", par.tp, f"more ranks than the {kv} key/value heads: the shared key/value "
         f"rows are not scaled as one process scales them; use parallel.tp <= {kv}",
         par.tp > kv),
        ("train.compile", cfg.train.compile, "'delayed' scaling's amax history is Python state the "
         "emulation updates inside the matmul, which a compiled block cannot trace; use fp8_recipe = "
         "'tensorwise' or 'blockwise' (those compile)", compile_on(cfg.train) and p.fp8_emulate
         and p.fp8_recipe == "delayed"),
    ) if on]
    # On FP8 hardware torchao's Float8Linear converts plain nn.Linear layers only; the emulation
    # (models/fp8.py fp8_linear) also runs the layers that replace or wrap them.
    blocking += [f"{key} = {value!r} ({why}: set precision.fp8_emulate = true to study it "
                 f"numerically)" for key, value, why, on in (
        ("parallel.tp", par.tp, "torchao does not convert our tensor-parallel linears", par.tp > 1),
        ("model.experts", cfg.model.experts, "torchao does not convert the experts' batched "
         "weights", cfg.model.experts > 0),
        ("lora.rank", cfg.lora.rank, "torchao would convert LoRA's adapters, not its frozen base",
         cfg.lora.rank > 0),
    ) if on and not p.fp8_emulate]
    if blocking:
        problems.append(f"precision.compute = 'fp8' does not compose yet with: {'; '.join(blocking)}. "
                        f"Change those keys or use precision.compute = 'bf16'")
    return problems


@_cross("precision.fp8_all_gather", "precision.compute", "precision.fp8_recipe", "precision.fp8_emulate",
        "parallel.zero_stage", "lora.rank", "lora.quantize")
def _fp8_all_gather_composes(cfg: Config) -> list[str]:
    """precision.fp8_all_gather: ZeRO-3 gathers the FP8 linears' weights (models/fp8.py
    Fp8Linear) in E4M3, each shard rounded at the whole weight's scale (parallel/data/zero/fp8_gather.py).
    That is the bits of rounding the whole weight only with one scale per weight from its
    amax now (tensorwise), and only where our emulated matmul (fp8_linear) takes the bits."""
    p, par = cfg.precision, cfg.parallel
    if not p.fp8_all_gather:
        return []
    toml = lambda v: str(v).lower() if isinstance(v, bool) else repr(v)  # noqa: E731
    needs = [f"{key} = {toml(want)} (got {toml(got)})" for key, got, want in (
        ("precision.compute", p.compute, "fp8"), ("precision.fp8_recipe", p.fp8_recipe, "tensorwise"),
        ("precision.fp8_emulate", p.fp8_emulate, True), ("parallel.zero_stage", par.zero_stage, 3))
        if got != want]
    problems = ([f"precision.fp8_all_gather = true gathers ZeRO-3's FP8 weights in E4M3 at a scale from "
                 f"each weight's amax now: it needs {'; '.join(needs)}. Set those, or drop "
                 f"precision.fp8_all_gather ('delayed' and 'blockwise' scales are not one number "
                 f"from the weight's current amax; on FP8 hardware torchao's Float8Linear runs the "
                 f"matmuls, and its fp8 all-gather is FSDP2's, not our engine's)"] if needs else [])
    # tp: each weight's scale takes the max over the tp group too; LoRA: its frozen base is
    # gathered in E4M3 as a trained weight is (parallel/data/zero/fp8_gather.py)
    if cfg.lora.rank > 0 and cfg.lora.quantize != "none":
        problems.append(f"precision.fp8_all_gather = true with lora.quantize = {cfg.lora.quantize!r}: "
                        f"QLoRA's frozen base already travels as its 4-bit codes and block scales, about "
                        f"half a byte per element, less than E4M3's one byte; gathering it in FP8 would "
                        f"move more and round it twice. Drop precision.fp8_all_gather (the adapters are "
                        f"too small to matter) or set lora.quantize = 'none'")
    # train.compile: the layers' GatheredWeight views are read by the compiled block as inputs
    # (the gather and free stay in the eager hooks around it): tests/test_fp8_all_gather.py
    return problems


STAGE0_REPLICA_RANKS = ("at ZeRO stage 0 every rank of a replica holds the whole gradient and "
                        "would send all of it across replicas, dp_shard x cp times stage 1's "
                        "bytes for the same sum")
"""Why a fault-tolerant replica of several ranks needs ZeRO stage >= 1 (also cli/train.py's
check once --nproc fixes dp_shard = -1)."""


@_cross("parallel.fault_tolerant", "parallel.dp_replicate", "parallel.dp_shard", "parallel.tp",
        "parallel.cp", "parallel.pp", "parallel.ep", "parallel.zero_stage", "parallel.strategy",
        "train.global_batch", "train.local_sgd.every", "parallel.ep_rebalance_every")
def _fault_tolerant_layout(cfg: Config) -> list[str]:
    """parallel.fault_tolerant (parallel/data/fault_tolerant/quorum.py): each replica is a world
    of its own — one process, or dp_shard x cp ranks that ZeRO shards over (stages 1-3: rank i's
    gradient shard averaged with every live replica's rank i, torchft's fault-tolerant HSDP),
    tensor, expert and pipeline parallelism inside it too (rank i of a replica is the hybrid
    run's rank at its stage, replica and place, so rank i of every replica holds the same stage,
    shards and experts: train/fault_tolerance.py replica_setup);
    what cannot be built that way is refused here, by name, with why it cannot be."""
    par = cfg.parallel
    if not par.fault_tolerant:
        return []
    if par.dp_replicate < 2:
        return [f"parallel.fault_tolerant = true needs parallel.dp_replicate >= 2 (replicas that "
                f"can drop out and rejoin), got {par.dp_replicate}"]
    apart = [f"{k} = {v!r} ({why})" for k, v, why, on in (
        ("parallel.zero_stage", par.zero_stage, f"{STAGE0_REPLICA_RANKS}: use stage 1",
         par.zero_stage == 0 and (par.dp_shard not in (1, -1) or par.cp > 1)),
        ("parallel.strategy", par.strategy, "each replica plans from the machine it starts on, "
         "and replicas on different machines could choose layouts whose shards do not pair rank "
         "for rank across them: set the layout (shardlm plan prints one)", par.strategy != "manual"),
        ("parallel.ep_rebalance_every", par.ep_rebalance_every, "experts move between a "
         "replica's ranks by the loads summed since the last move; a replica that rejoins takes "
         "its peer's expert slots without the placement they follow or those loads, so its rank "
         "i would add other experts' gradients to the live replicas' rank i",
         par.ep_rebalance_every > 0),
        ("train.global_batch", cfg.train.global_batch, "the global batch shrinks while a replica "
         "is away: set train.grad_accum instead", cfg.train.global_batch > 0),
        ("train.local_sgd.every", cfg.train.local_sgd.every, "local SGD's replicas hold different "
         "models between outer steps: a rejoining one has no single live state to take, and a "
         "replica lost mid-round takes its inner steps with it", cfg.train.local_sgd.every > 0),
    ) if on]
    return ([f"parallel.fault_tolerant = true runs each replica as a world of its own (one "
             f"process, or pp x dp_shard x cp x tp ranks) and does not compose with: "
             f"{'; '.join(apart)}"] if apart else [])
