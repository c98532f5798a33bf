"""What a valid configuration is: each field's type, choices and range (fields.py), and the checks
across fields — the model's, data's, training's and run's here, which layouts and features
compose in layout_rules.py — run by shardlm.config.schema's `Config.validate()`, which reports
every problem at once.

Plain data and functions over a config object, below shardlm.config.schema in the import contract:
`cfg` is a shardlm.config.schema.Config, read by attribute; nothing here imports it.
"""

from __future__ import annotations

import shardlm.config.layout_rules  # noqa: F401  (registers the layout checks)
from shardlm.config.fields import (_CHOICES, _CROSS, _RULES, NVME_RING_MAX_MB, TRACKERS, Config, _cross,
                                   _type_problem, leaf_fields, profile_step_numbers, tracker_install_hint,
                                   tracker_names)


def _spelled(choice: object) -> str:
    """A choice as a config file spells it (TOML's true/false)."""
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


@_cross("train.global_batch", "train.micro_batch")
def _global_batch_in_micro_batches(cfg: Config) -> list[str]:
    t = cfg.train
    return ([f"train.global_batch = {t.global_batch} is not a multiple of train.micro_batch = "
             f"{t.micro_batch}: each data-parallel rank runs whole micro-batches"]
            if t.global_batch and t.global_batch % t.micro_batch else [])


def fraction_warmup_steps(fraction: float, steps: int) -> int:
    """train.warmup_fraction's steps: round(fraction x steps), at least 1 (0 for fraction 0)."""
    return max(1, round(fraction * steps)) if fraction > 0 else 0


@_cross("train.warmup_fraction", "train.warmup_steps", "train.steps")
def _warmup_fraction_applied(cfg: Config) -> list[str]:
    t = cfg.train
    steps = fraction_warmup_steps(t.warmup_fraction, t.steps)
    return ([f"train.warmup_fraction = {t.warmup_fraction:g} of train.steps = {t.steps} is "
             f"{steps} warm-up steps, but train.warmup_steps = {t.warmup_steps}: set one of them "
             f"(load_config sets warmup_steps from the fraction)"]
            if t.warmup_fraction > 0 and t.warmup_steps != steps else [])


@_cross("model.d_model", "model.n_heads", "model.head_dim")
def _heads_divide_width(cfg: Config) -> list[str]:
    m = cfg.model
    return ([f"model.d_model = {m.d_model} is not divisible by model.n_heads = {m.n_heads}; "
             f"make it so, or set model.head_dim"]
            if not m.head_dim and m.d_model % m.n_heads else [])


@_cross("model.n_kv_heads", "model.n_heads")
def _kv_heads_divide_heads(cfg: Config) -> list[str]:
    m = cfg.model
    return ([f"model.n_kv_heads = {m.n_kv_heads} must divide model.n_heads = {m.n_heads}"]
            if m.n_kv_heads and m.n_heads % m.n_kv_heads else [])


@_cross("model.position", "model.d_model", "model.n_heads", "model.head_dim")
def _rope_head_dim(cfg: Config) -> list[str]:
    m = cfg.model
    head_dim = m.head_dim or m.d_model // m.n_heads
    return ([f"RoPE needs an even head dim; model.head_dim (or d_model/n_heads) = {head_dim}"]
            if m.position == "rope" and head_dim % 2 else [])


@_cross("model.position", "model.rope_type", "model.rope_factor", "model.rope_low_freq_factor",
        "model.rope_high_freq_factor", "model.rope_beta_fast", "model.rope_beta_slow")
def _rope_scaling(cfg: Config) -> list[str]:
    m, problems = cfg.model, []
    if m.rope_type != "default" and m.position != "rope":
        problems.append(f"model.rope_type = {m.rope_type!r} scales rotary positions: it needs "
                        f"model.position = 'rope' (not {m.position!r}); or rope_type = 'default'")
    if m.rope_type == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        problems.append(f"model.rope_type = 'llama3': model.rope_high_freq_factor "
                        f"({m.rope_high_freq_factor:g}) must exceed model.rope_low_freq_factor "
                        f"({m.rope_low_freq_factor:g})")
    return problems


@_cross("model.attention", "model.attn_softcap", "model.sliding_window", "model.rope_local_theta",
        "model.norm_offset", "model.norm", "model.activation", "model.mlp", "model.experts",
        "parallel.cp", "parallel.cp_mode", "parallel.tp", "train.seq_len", "model.parallel_residual",
        "model.rope_fraction",
        "model.norm_placement", "model.residual_multiplier", "model.head_dim", "model.d_model",
        "model.n_heads", "model.position", "model.norm_bias")
def _family_features(cfg: Config) -> list[str]:
    """The checkpoint families' features (docs/finetuning.md): each where it is computed."""
    m, problems = cfg.model, []
    if m.attn_softcap and m.attention not in ("auto", "math"):
        problems.append(f"model.attn_softcap = {m.attn_softcap:g} with model.attention = "
                        f"{m.attention!r}: only 'math' writes the scores out to cap them; use "
                        f"'auto' (picks 'math') or 'math'")
    if m.sliding_window and m.attention in ("per_document", "flex"):
        problems.append(f"model.sliding_window = {m.sliding_window} with model.attention = "
                        f"{m.attention!r}: it has no window mask yet; use 'auto', 'sdpa' or 'math'")
    if m.rope_local_theta and not m.sliding_window:
        problems.append(f"model.rope_local_theta = {m.rope_local_theta:g} is the sliding blocks' "
                        f"RoPE base, and model.sliding_window = 0 (no block slides); set both or neither")
    kv_heads = m.n_kv_heads or m.n_heads
    if m.qk_norm and m.qk_norm_width == "all" and kv_heads % cfg.parallel.tp:
        problems.append(f"model.qk_norm_width = 'all' (OLMo-2) with parallel.tp = "
                        f"{cfg.parallel.tp} > the {kv_heads} key/value heads: the key norm spans "
                        f"every head, and tensor parallelism's copies of them are not cut; use a "
                        f"parallel.tp that divides {kv_heads}")
    if m.parallel_residual and (m.norm_placement != "pre" or m.residual_multiplier != 1.0):
        problems.append(f"model.parallel_residual = true with model.norm_placement = "
                        f"{m.norm_placement!r} / residual_multiplier = {m.residual_multiplier:g}: "
                        f"parallel blocks are pre-norm, unscaled; set 'pre' and 1")
    rotated = int((m.head_dim or m.d_model // m.n_heads) * m.rope_fraction)
    if m.rope_fraction != 1.0 and (m.position != "rope" or rotated % 2 or not rotated):
        problems.append(f"model.rope_fraction = {m.rope_fraction:g} rotates {rotated} features of "
                        f"each head: it needs model.position = 'rope' and an even, non-zero count")
    if m.norm_bias and m.norm != "layernorm":
        problems.append(f"model.norm_bias = true gives LayerNorms biases: it needs model.norm = "
                        f"'layernorm' (not {m.norm!r})")
    if m.norm_offset and m.norm != "rmsnorm":
        problems.append(f"model.norm_offset = true is Gemma's RMSNorm: it needs model.norm = "
                        f"'rmsnorm' (not {m.norm!r})")
    if m.activation != "auto" and m.experts:
        problems.append(f"model.activation = {m.activation!r} with model.experts = {m.experts}: "
                        f"the experts' activation is model.mlp's own; set model.activation = 'auto'")
    return problems


@_cross("train.seq_len", "model.max_seq_len")
def _sequence_fits(cfg: Config) -> list[str]:
    t, m = cfg.train, cfg.model
    return ([f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {m.max_seq_len}; "
             f"lower train.seq_len or raise model.max_seq_len"] if t.seq_len > m.max_seq_len else [])


@_cross("train.sample_tokens", "train.sample_prompt")
def _sample_has_prompt(cfg: Config) -> list[str]:
    t = cfg.train
    return (["train.sample_prompt = '' gives the sample nothing to continue; write a prompt or set "
             "train.sample_tokens = 0"] if t.sample_tokens > 0 and not t.sample_prompt else [])


@_cross("zero.nvme_chunk_mb", "zero.nvme_buffers")
def _nvme_ring_fits(cfg: Config) -> list[str]:
    z = cfg.zero
    ring = z.nvme_buffers * 4 * z.nvme_chunk_mb
    return ([f"zero.nvme_buffers x 4 x zero.nvme_chunk_mb = {z.nvme_buffers} x 4 x {z.nvme_chunk_mb}"
             f" MB of host memory for the nvme stream exceeds {NVME_RING_MAX_MB} MB (1 TiB)"]
            if ring > NVME_RING_MAX_MB else [])


@_cross("run.tracker")
def _trackers_installed(cfg: Config) -> list[str]:
    """Each tracker named is known and its package importable: found now, before any rank starts
    (shardlm.train.tracking imports it on rank 0 only)."""
    import importlib.util

    errors = []
    for name in tracker_names(cfg.run.tracker):
        if name not in TRACKERS:
            errors.append(f"run.tracker = {cfg.run.tracker!r}: unknown tracker {name!r}; use 'none' or "
                          f"a comma list of {', '.join(TRACKERS)}")
        elif importlib.util.find_spec(TRACKERS[name]) is None:
            errors.append(f"run.tracker = {cfg.run.tracker!r} needs the {TRACKERS[name]} package, which "
                          f"is not installed: {tracker_install_hint(name)}")
    return errors


@_cross("run.profile_steps", "train.steps")
def _profile_steps_run(cfg: Config) -> list[str]:
    try:
        steps = profile_step_numbers(cfg.run.profile_steps)
    except ValueError as e:
        return [f"run.profile_steps = {cfg.run.profile_steps!r}: {e} (e.g. '5-7' or '5,6')"]
    late = [s for s in steps if s > cfg.train.steps]
    return ([f"run.profile_steps = {cfg.run.profile_steps!r} names step(s) {late} beyond train.steps = "
             f"{cfg.train.steps}: they would never run"] if late else [])


@_cross("precision.master", "precision.compute")
def _pure_bf16(cfg: Config) -> list[str]:
    p = cfg.precision
    return ([f"precision.master = 'bf16' (pure bf16) needs precision.compute = 'bf16' (or 'fp8', "
             f"whose parameters are bf16), got {p.compute!r}"]
            if p.master == "bf16" and p.compute not in ("bf16", "fp8") else [])


@_cross("train.local_sgd.every", "parallel.dp_replicate", "parallel.ep_rebalance_every")
def _local_sgd_layout(cfg: Config) -> list[str]:
    """Local SGD / DiLoCo (parallel/data/zero/local_sgd.py) needs replicas. It is checked against one
    process with ZeRO stages 0-3 and dp_shard ranks per replica, tp, cp, pp, a mixture of experts
    and expert parallelism inside each replica, optimizer and parameter offload (cpu, nvme) and
    LoRA: each rank's outer step acts on its own piece of the masters (its tp cut, its stage's
    blocks, its experts' shard), all-reduced with the rank at the same place in every other
    replica, which holds the same piece (tests/test_local_sgd.py). The router's one state beside
    its weights, the auxiliary-loss-free balancing bias (model.balance = 'bias'), is moved every
    step by the loads summed over every rank, replicas included (parallel/expert/dispatch.py
    finish_moe_step): it is the same on every replica at every step, so the outer step leaves it.
    Re-placing experts by load (parallel.ep_rebalance_every) is refused: it moves a replica's
    experts with their masters and moments (parallel/expert/balance.py), not with the outer model
    and momentum each rank keeps of its shard."""
    every, par = cfg.train.local_sgd.every, cfg.parallel
    if not every:
        return []
    if par.dp_replicate == 1:
        return [f"train.local_sgd.every = {every} synchronises replicas every {every} steps, but "
                f"parallel.dp_replicate = 1: there is one replica. Set parallel.dp_replicate (the "
                f"number of replicas, e.g. 2), or train.local_sgd.every = 0"]
    return ([f"train.local_sgd.every = {every} with parallel.ep_rebalance_every = "
             f"{par.ep_rebalance_every}: re-placing experts moves their masters and Adam moments "
             f"between a replica's ranks, but not the outer model and momentum local SGD keeps of "
             f"each rank's shard. Set parallel.ep_rebalance_every = 0, or train.local_sgd.every = 0"]
            if par.ep_rebalance_every else [])


def refusing_rules(cfg: Config) -> dict[str, list[str]]:
    """The checks across fields that object to `cfg`, by the rule's function name (e.g.
    '_fp8_composes') -> its error lines: which rule refuses a combination (bench/compose.py's
    composition matrix, tests/test_compose.py). Assumes each field passed its own checks."""
    found: dict[str, list[str]] = {}
    for _, check in _CROSS:
        problems = check(cfg)
        if problems:
            found[check.__name__] = problems
    return found


def validation_errors(cfg: Config, sections: dict[str, type]) -> list[str]:
    """Every problem with `cfg` (a shardlm.config.schema.Config; `sections`: its section classes by
    name), one line each; never raises. Each field: its type (and finiteness), then its choices
    or range; then the checks across fields whose fields passed."""
    errors: list[str] = []
    bad: set[str] = set()

    def report(key: str, message: str) -> None:
        errors.append(message)
        bad.add(key)

    for name, cls in sections.items():
        section = getattr(cfg, name, None)
        if not isinstance(section, cls):
            report(name, f"[{name}] must be a {cls.__name__}, not {type(section).__name__}")
            bad.update(f"{name}.{leaf.key}" for leaf in leaf_fields(cls))
            continue
        for leaf in leaf_fields(cls):
            key, holder = f"{name}.{leaf.key}", section
            for attr in leaf.attrs[:-1]:  # a nested section (train.local_sgd): its object first
                holder = getattr(holder, attr, None)
            if not isinstance(holder, leaf.owner):
                nested = f"{name}.{leaf.key.rpartition('.')[0]}"
                if nested not in bad:
                    report(nested, f"{nested} must be a {leaf.owner.__name__}, not {type(holder).__name__}")
                bad.add(key)
                continue
            value = getattr(holder, leaf.attrs[-1])
            problem = _type_problem(value, leaf.type)
            if problem:
                report(key, f"{key} = {value!r} {problem}")
                continue
            choices = _CHOICES.get(key)
            if choices is not None and value not in choices:
                report(key, f"{key} = {value!r}; choose one of {', '.join(_spelled(c) for c in choices)}")
                continue
            rule = _RULES.get(key)
            if rule is not None and not rule[0](value):
                report(key, f"{key} = {value!r} {rule[1]}")
    for keys, check in _CROSS:
        if bad.intersection(keys):
            continue  # a field it reads is already reported
        try:
            errors += check(cfg)
        except Exception as e:  # a check must not hide the others' errors
            errors.append(f"could not check {', '.join(keys)}: {type(e).__name__}: {e}")
    return errors
