"""One typed configuration tree: defaults < preset < TOML file < command-line overrides.

Every field has a docstring (the string literal under it), which `shardlm train --help-config`
prints. Parsing is strict: an unknown key is an error naming the closest valid key. `validate()`
holds every check — each value's type, finiteness and range, then those across fields — reports
them all at once, and runs before any work starts (and before any process is spawned).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints


from shardlm.config.fields import (COMPUTE_DTYPES, OFFLOAD_TIERS, RECOMPUTE_MODES,  # noqa: F401
                                   key_of, leaf_fields)  # (the names shardlm.config.schema has always exported)
from shardlm.config.rules import validation_errors
from shardlm.config.model import LoRAConfig, ModelConfig
from shardlm.errors import ConfigError


@dataclass
class DataConfig:
    source: str = "stdlib"
    """'stdlib' = the Python standard library's own .py files (always present), or a path to a
    text/JSONL file or a directory of them (comma-separated for several); also Arrow / Parquet,
    streamed: a datasets save_to_disk directory (a DatasetDict: its 'train' split), or .parquet
    files, a directory of them or a glob (pip install 'shardlm[data]'; docs/finetuning.md)."""
    cache_dir: str = ""
    """Where the tokenizer and token shards are cached; '' = ~/.cache/shardlm (or $SHARDLM_CACHE)."""
    val_fraction: float = 0.01
    """Fraction of the token stream held out for validation (unused with data.val_source)."""
    max_bytes: int = 0
    """Read at most this many bytes of text (0 = all): small values make quick experiments."""
    jsonl_field: str = "text"
    """For JSONL sources: the field holding the document text (Arrow / Parquet: the column)."""
    val_source: str = ""
    """Held-out data for evaluation, in data.source's forms and data.format (a DatasetDict: its
    'validation', else 'test' split), tokenized with the training data's tokenizer; then all of
    data.source trains. '' = the last data.val_fraction of data.source."""
    columns: str = ""
    """data.format chat / prompt_completion / seq2seq: the fields (JSONL) or columns (Arrow /
    Parquet) holding 'messages', 'prompt' and 'completion' ('source' and 'target') when named
    otherwise, e.g. 'prompt=question,completion=answer'. '' = those names."""
    document_mask: str = "auto"
    """Attention only within each document of a row, positions restarting at 0 per document
    (docs/finetuning.md): 'on', 'off', or 'auto' = on for the packed formats (chat,
    prompt_completion: a row holds several examples), else off (for 'text', 'on' cuts the
    pre-training windows at each end-of-text token)."""
    format: str = "text"
    """'text' = documents joined into one token stream (pre-training); 'chat' = JSONL of
    {"messages": [{"role", "content"}, ...]}, loss on assistant tokens only; 'prompt_completion' =
    JSONL of {"prompt", "completion"}, loss on the completion only. Both packed into rows of
    train.seq_len + 1 tokens (docs/finetuning.md). 'seq2seq' = JSONL of {"source", "target"} for
    an encoder-decoder (model.hf_config / model.hf_path): the source padded or cut to
    data.source_len tokens, the target (+ end token) to train.seq_len, loss on the target."""
    source_len: int = 0
    """data.format = 'seq2seq': encoder tokens per example (padded / cut); 0 = train.seq_len."""


@dataclass
class LocalSGDConfig:
    """[train] local_sgd = {every = 4, outer = "diloco"}: replicas that synchronise every few
    steps instead of every step (parallel/data/zero/local_sgd.py; docs/parallelism.md, local SGD / DiLoCo)."""

    every: int = 0
    """With parallel.dp_replicate = R > 1: each replica takes this many optimizer steps on its own
    (its gradients reduced only within the replica), then the replicas' parameters are averaged
    into the outer model by one all-reduce (0 = off: gradients averaged over every replica every
    step). The run's last step always ends a round."""
    outer: str = "diloco"
    """The outer step on the pseudo-gradient Δ = θ_outer − mean_r θ_r: 'diloco' (Douillard et al.
    2023: SGD with Nesterov momentum, outer_lr and outer_momentum) or 'average' (plain local SGD:
    θ_outer ← mean_r θ_r, i.e. outer lr 1 without momentum; outer_lr and outer_momentum unused)."""
    outer_lr: float = 0.7
    """'diloco': the outer learning rate (0.7 in the DiLoCo paper)."""
    outer_momentum: float = 0.9
    """'diloco': the outer Nesterov momentum (0.9 in the DiLoCo paper)."""


@dataclass
class TrainConfig:
    steps: int = 300
    """Optimizer steps to run."""
    micro_batch: int = 8
    """Sequences per forward/backward pass on each data-parallel rank."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step (global batch = micro_batch*grad_accum*dp)."""
    global_batch: int = 0
    """Sequences per optimizer step over all data-parallel ranks, kept whatever the world size:
    grad_accum is then derived at start, global_batch / (micro_batch * dp), replacing the one
    given. 0 = micro_batch * grad_accum * dp. Set it for elastic jobs, so that a gang restarted
    at another size takes the same steps through the same data (docs/launch.md)."""
    seq_len: int = 256
    """Tokens per training sequence (<= model.max_seq_len)."""
    lr: float = 1e-3
    """Peak learning rate. With model.hf_path (fine-tuning a pretrained checkpoint) and lr not
    set: 2e-5 for a full fine-tune, 2e-4 with LoRA / QLoRA (lora.rank > 0), as fine-tuning
    recipes use (config/load.py FINETUNE_LR; the start-up log says so). A full fine-tune above
    1e-4 is warned about."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr*min_lr_ratio at the last step."""
    warmup_steps: int = 30
    """Linear warmup steps from 0 to lr (set by warmup_fraction when that is > 0)."""
    warmup_fraction: float = 0.0
    """Warm-up as a fraction of train.steps, in [0, 1): > 0 sets warmup_steps = round(fraction x
    steps), at least 1, when the config is read; set it or warmup_steps, not both. 0 = use
    warmup_steps. With model.hf_path and neither set: 0.03 (the fine-tuning default)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not to biases, norms)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    optimizer: str = "adamw"
    """'adamw', or 'muon': Muon (Jordan 2024; Moonlight, Liu et al. 2025) on the hidden weight
    matrices — momentum, orthogonalised by Newton-Schulz, RMS-matched to AdamW (0.2 sqrt(max(A,
    B))) with the same lr and decoupled weight decay — and AdamW (beta1, beta2, eps) on the
    embeddings, the output head, norms and biases (src/shardlm/parallel/data/zero/optim.py). With ZeRO (stages
    0-3) each matrix is gathered and orthogonalised by one owning rank, a tensor-parallel one
    gathered whole over the tp group too (parallel/data/zero/muon.py); with every axis, the cpu tier and
    LoRA / QLoRA (each adapter factor a matrix of its own); not with the nvme tier (refused;
    docs/computation.md)."""
    muon_momentum: float = 0.95
    """Muon's momentum coefficient mu (buf <- mu buf + g)."""
    muon_nesterov: bool = True
    """Muon steps along g + mu buf (Nesterov) rather than buf."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per Muon step (5 in Jordan's and Moonlight's runs)."""
    muon_split_fused: bool = False
    """Orthogonalise a fused projection's parts as the separate matrices transformers' layout has
    (attn.qkv: q, k, v; mlp.gate_up: gate, up), each with its own 0.2 sqrt(max(A, B)) — what Muon
    on an unfused model (Llama's q_proj/k_proj/v_proj, modded-nanogpt) does. Off: each fused
    matrix is one (our Decoder's layout)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = no clipping)."""
    seed: int = 1337
    """Seeds the weights and the data order; the same seed gives the same run."""
    eval_every: int = 100
    """Compute validation loss every this many steps (0 = only at the end)."""
    eval_batches: int = 8
    """Validation micro-batches (of train.micro_batch rows) per evaluation, shared out among the
    data-parallel ranks; scored as val_loss, val_perplexity, val_token_accuracy."""
    log_every: int = 1
    """Write a JSONL line every this many steps."""
    compile: bool | str = "auto"
    """torch.compile each transformer block (regional: compile time does not grow with depth;
    the ZeRO and checkpointing hooks stay eager around it). Composes with ZeRO stages 0-3,
    offload and activation.checkpoint = 'full'; other strategies are refused by validate().
    'auto': on for a LoRA / QLoRA fine-tune on a CPU long enough to repay the first step's
    compile (ten minutes of matmuls at the machine's peak: train/resolve.py decide_compile),
    whose settings compile and where Inductor finds a C++ compiler; off otherwise (GPUs, full
    training: set true). The decision is recorded in the run's config."""
    on_nonfinite: str = "stop"
    """fp32/bf16: a NaN/inf gradient norm (a diverged run) 'stop's the run with an error, or
    'skip's that step and goes on (counted in the log's `skipped`). fp16 always skips and backs
    off its loss scale."""
    sample_tokens: int = 120
    """After training, generate this many tokens from `sample_prompt` (0 = skip)."""
    sample_prompt: str = "def "
    """Prompt for the sample printed after training."""
    local_sgd: LocalSGDConfig = field(default_factory=LocalSGDConfig)
    """Local SGD / DiLoCo across dp_replicate replicas (a nested section: train.local_sgd.every,
    ...; in TOML `local_sgd = {every = 4}` under [train])."""


@dataclass
class PrecisionConfig:
    compute: str = "auto"
    """'fp32', 'bf16' (autocast), 'fp16' (autocast + dynamic loss scaling), or 'auto': bf16 on GPUs
    that support it; on CPU the faster of fp32/bf16 by the machine's measured matmul peak.
    'fp8': the blocks' linear layers multiply in FP8 (E4M3 forward, E5M2 backward; the rest in
    bf16): torchao's float8 training on a GPU with FP8 (compute capability >= 8.9), else only
    with precision.fp8_emulate (docs/computation.md, FP8)."""
    fp8_recipe: str = "tensorwise"
    """compute = 'fp8': how each tensor is scaled into FP8's range: 'tensorwise' (current scaling:
    by this tensor's amax), 'delayed' (by the amax history of the last 16 steps) or 'blockwise'
    (one scale per 1 x fp8_block tile of activations and gradients, fp8_block x fp8_block of
    weights, as DeepSeek-V3). On FP8 hardware only 'tensorwise' (torchao's)."""
    fp8_emulate: bool = False
    """compute = 'fp8' without FP8 hardware (this CPU): emulate it — round through torch's float8
    dtypes, multiply in bf16. For numerics (loss, overflow / underflow counts), not speed."""
    fp8_block: int = 128
    """fp8_recipe = 'blockwise': the tile width (DeepSeek-V3: 128)."""
    fp8_all_gather: bool = False
    """compute = 'fp8' at ZeRO stage 3: gather the blocks' FP8 linear weights already in E4M3
    (1 byte per element, half bf16's), each rank rounding its shard at the whole weight's scale
    (one all-reduce(max) of the unit's weights' amaxes), as torchao's float8 all-gather under
    FSDP2 does; the matmul takes those bits as gathered. Norms, biases and embeddings gather as
    before; gradients and their reduce-scatter are unchanged (the weights become a unit of their
    own, so the logged grad_norm rounds differently). Needs fp8_recipe = 'tensorwise',
    fp8_emulate = true and parallel.zero_stage = 3 (docs/computation.md, FP8 all-gather)."""
    cpu_bf16_gemm: str = "auto"
    """bf16 (and fp8's bf16 part) on a CPU: 'fp32' multiplies the bf16 operands of every linear
    and matmul in fp32 GEMMs and rounds the result to bf16 (exact products, fp32 accumulation:
    what a bf16 kernel computes, at fp32's speed on CPUs without bf16 matmul hardware); 'native'
    calls torch's bf16 kernels; 'auto': 'fp32' where this CPU's measured bf16 matmul peak is
    below its fp32 peak (no AVX-512-BF16 or AMX), decided once per run (resolve.py). 'native'
    under train.compile (Inductor makes the kernels). GPUs: always native (docs/computation.md)."""
    reduce: str = "auto"
    """dtype gradients are kept and reduced in: 'auto' = the compute dtype (as DeepSpeed and
    FSDP do; what the ZeRO memory formulas assume), or 'fp32' for exact reductions."""
    master: str = "fp32"
    """dtype of the master weights and optimizer states: 'fp32', or 'bf16' for FSDP's "pure bf16"
    (memory-constrained) mode, where parameters are updated in bf16."""
    loss_scale_init: float = 65536.0
    """fp16: initial loss scale."""
    loss_scale_growth_interval: int = 2000
    """fp16: double the scale after this many steps without overflow."""
    loss_scale_backoff: float = 0.5
    """fp16: multiply the scale by this on overflow (and skip that step)."""


@dataclass
class ParallelConfig:
    strategy: str = "manual"
    """'manual': the keys below as given. 'auto': the planner (`shardlm plan`) picks, for this
    machine's ranks and the configured global batch, the fastest layout that fits — ZeRO stage,
    dp_replicate x dp_shard, activation.checkpoint, the micro_batch x grad_accum split and
    offload — logs why, and the run uses it. What you set (tp, cp, pp, ep, dp_replicate,
    sequence_parallel, a zero_stage other than 0) is kept, and the rest planned around it."""
    zero_stage: int = 0
    """What is sharded over dp_shard (ZeRO, Rajbhandari et al. 2020): 0 nothing (plain data
    parallel), 1 optimizer states + fp32 master, 2 + gradients, 3 + parameters."""
    dp_replicate: int = 1
    """Replicas (hybrid sharding): shard within groups of dp_shard ranks, replicate across them."""
    dp_shard: int = -1
    """Ranks a model state is sharded over; -1 = every rank the other degrees leave."""
    tp: int = 1
    """Tensor-parallel degree (Megatron-LM): attention heads, MLP width and vocabulary split over
    tp consecutive ranks; must divide n_heads, and divide n_kv_heads or be a multiple of it
    (key/value heads replicated: parallel/tensor/decoder.py)."""
    sequence_parallel: bool = False
    """With tp > 1: norms and residuals on 1/tp of the sequence each, all-gather/reduce-scatter
    in place of the all-reduces (Korthikanti et al. 2022); same results, less activation memory."""
    async_tp: bool = False
    """With tp > 1 and sequence_parallel: overlapped ("async") tensor parallelism. The all-gather
    before each column-parallel linear and the reduce-scatter after each row-parallel one are cut
    into tp pieces whose collectives are in flight while the matmuls of the rows already there
    (or the next piece's partial sums) run (parallel/tensor/async_tp.py; Wang et al. 2023, torchtitan's
    async TP, Megatron-LM's tp_comm_overlap). Same bits and bytes as the blocking version on 2
    ranks; with train.compile, FP8 (pieces rounded at the whole tensor's amax: async_fp8.py) and
    QLoRA (the base dequantised for the pieces); not FP8 with LoRA (refused)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks (2·cp load-balanced chunks),
    attention by passing key/value blocks around a ring (parallel/context/attention.py); activations
    1/cp per rank. train.seq_len must divide by 2·cp."""
    cp_mode: str = "ring"
    """How cp > 1 ranks attend (parallel/context/attention.py, parallel/context/ulysses.py; docs/architecture.md):
    'ring' (key/value blocks passed around the ring: any head count); 'ulysses' (DeepSpeed-
    Ulysses: an all-to-all trades the sequence split for a head split around attention, each
    rank attending the whole sequence with heads/cp heads: the heads per tp rank must divide by
    cp); 'hybrid' (USP: all-to-all over groups of cp_ulysses ranks, a ring across the groups);
    'auto' (the planner picks the one with the least predicted time)."""
    cp_ulysses: int = 0
    """With cp_mode = 'hybrid': the all-to-all degree (consecutive cp ranks), dividing cp; the ring
    runs over cp / cp_ulysses groups. 0 = cp for 'ulysses', 2 for 'hybrid'."""
    pp: int = 1
    """Pipeline-parallel degree: the blocks in pp contiguous stages, one per rank of a pipeline
    (parallel/pipeline/stages.py); micro-batches are train.grad_accum's."""
    pp_schedule: str = "1f1b"
    """With pp > 1: 'gpipe' (all forwards, then all backwards) or '1f1b' (one forward, one
    backward: at most pp micro-batches of activations held per stage), both idle
    (pp-1)/(grad_accum+pp-1) of a step; 'interleaved' (1F1B over pp_virtual chunks per rank:
    the idle share about 1/pp_virtual of that, for pp_virtual times the point-to-point traffic);
    'zb' (zero bubble: each backward split into the gradient sent back and the weight
    gradients, which fill the idle time; the Decoder's linear layers, not tensor-parallel ones);
    'zbv' (ZB-V: two chunks per rank in a V, rank r holding stages r and 2·pp-1-r, the backward
    split: near-zero bubble at 1F1B's activation memory; pp_virtual = 2) or 'dualpipev'
    (DeepSeek's DualPipeV: the same V, forwards paired with other micro-batches' backwards;
    pp_virtual = 2, grad_accum >= 2·pp); or 'file:PATH': your own table, a CSV of one row per
    pipeline rank of operations '<stage><F|B|I|W><micro-batch>' (docs/architecture.md), checked
    by simulating it before the run."""
    pp_virtual: int = 1
    """Model chunks per rank: 'interleaved' >= 2 (grad_accum must divide by pp); 'zbv' and
    'dualpipev' 2; a 'file:' table, its stages / pp. pp × pp_virtual stages in all, so the model
    needs that many layers."""
    pp_layers: str = ""
    """With pp > 1: blocks per stage (pp × pp_virtual counts), e.g. '4,4,3,5' ('' = balanced by
    FLOPs, the head's counted on the last stage)."""
    ep: int = 1
    """Expert-parallel degree: each rank holds model.experts / ep of every MoE block's experts,
    tokens sent to their experts' ranks and back by all-to-all (parallel/expert/dispatch.py). The ep
    ranks come out of dp_shard (ep must divide it); the dense part stays data-parallel, the
    experts are ZeRO-sharded over the dp_shard / ep ranks that hold the same ones. With tp > 1
    the experts are spread over the tensor-parallel ranks instead (ep stays 1)."""
    ep_rebalance_every: int = 0
    """With ep > 1: every this many steps, move experts between the expert-parallel ranks so
    that the busiest rank's load (measured over those steps) is as low as a greedy placement
    makes it (parallel/expert/balance.py ExpertBalancer); 0 = never."""
    reshard_after_forward: bool = True
    """Stage 3: free a unit's gathered parameters after its forward and gather again for its
    backward (memory), or keep them until its backward (one all-gather less per step). With
    pp > 1 a stage's units are held for the whole step, either way (parallel/data/zero/params.py)."""
    prefetch: bool = True
    """Stage 3: start gathering the next unit's parameters while the current one computes."""
    collective_timeout_s: float = 600.0
    """A collective not finished after this many seconds (a peer hung or died) is reported —
    rank, group, operation, bytes — and the process exits with code 4; 0 disables the watchdog.
    The process group's own timeout is this plus max(5 s, a tenth), so the report comes first."""
    fault_tolerant: bool = False
    """With dp_replicate > 1 under `shardlm train --nproc N`: each replica is its own process
    (its own world), and gradients are averaged across replicas over a group rebuilt each step
    from the replicas alive (parallel/data/fault_tolerant/quorum.py, torchft's quorum). A replica that dies drops out
    while the others keep training; the launcher restarts it and it rejoins from a live peer's
    state (docs/reliability.md, Replica groups). One rank per replica, ZeRO stage 0."""
    quorum_timeout_s: float = 30.0
    """parallel.fault_tolerant: how long a replica waits at a step for a peer of the last
    quorum that has not arrived (and has not been reported dead by the launcher) before the
    step goes on without it."""
    units: str = ""
    """Sharding units for a model that is not ours: comma-separated class names (e.g.
    'GPT2Block'); '' = the children of the largest nn.ModuleList."""


@dataclass
class ActivationConfig:
    checkpoint: str = "none"
    """Activation checkpointing per block: 'none', 'full' (recompute the whole block in backward),
    or 'selective' (keep matmul and attention outputs, recompute the cheap element-wise ops)."""
    offload: str = "none"
    """Activation offload: 'none', or 'cpu' (what autograd saves inside the chosen blocks' forward
    goes to host memory and is brought back before their backward; parameters stay). Needs
    activation.checkpoint = 'none'. On a CPU device the host is the device: nothing moves."""
    offload_blocks: int = 0
    """With activation.offload = 'cpu': offload the first N blocks (their activations wait
    longest); 0 = every block."""


@dataclass
class ZeroConfig:
    offload_optimizer: str = "none"
    """Where fp32 master weights and AdamW moments live (ZeRO-Offload / ZeRO-Infinity):
    'none' (the device), 'cpu' (host memory), 'nvme' (files under nvme_path, streamed through
    the step in chunks). Needs parallel.zero_stage >= 1 (one process may use stage 1)."""
    offload_params: str = "none"
    """Stage 3: where each unit's parameter shard lives between its gathers: 'none', 'cpu'
    (host memory; on a CPU-only machine that is where it already is), 'nvme'."""
    nvme_path: str = ""
    """Directory for the nvme tier's files ('' = <run dir>/offload). A fast local disk."""
    nvme_chunk_mb: int = 64
    """Elements streamed per chunk, in MB of one state tensor (each buffer holds 3 of them)."""
    nvme_buffers: int = 4
    """Chunks in flight (>= 3: one read ahead, one computing, one writing behind). Host memory
    for the stream = nvme_buffers x 4 x nvme_chunk_mb."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Save a resumable checkpoint every N steps and at the last step (0 = none, but for the
    one SIGTERM/SIGINT always writes). Each is a directory <run>/checkpoints/step-N."""
    keep: int = 3
    """Checkpoints kept; older ones are deleted once a newer one is complete."""
    async_: bool = False
    """(key: checkpoint.async) Write in a background thread: the loop stalls only for a copy of
    this rank's state. The write still needs CPU (serialising, SHA-256): where training already
    uses every core (measured on 2 CPU cores) it slows the steps it overlaps about as much as a
    synchronous save would have stalled; on GPU machines the cores are free and it pays."""
    resume: str = "auto"
    """'auto': continue from the run directory's latest checkpoint if there is one (what a
    restarted worker does); 'never'; or a path: a checkpoint, a run's checkpoints/ or a run
    directory (`shardlm train --resume PATH`)."""
    readers: str = "all"
    """'all': every rank reads the slices it needs; 'one': rank 0 reads, broadcasts to the
    others (for file systems that suffer many readers)."""


@dataclass
class RunConfig:
    dir: str = "runs"
    """Parent directory of run directories."""
    name: str = ""
    """Run directory name under `dir`; '' = a new directory (time and a random suffix). A named
    directory may exist (that is how a run continues), but one live run at a time holds it."""
    device: str = "auto"
    """'auto' (CUDA if present, else CPU), 'cpu', 'cuda', 'cuda:N'."""
    malloc_mmap_threshold: int = 8388608
    """Bytes from which glibc malloc serves a block by mmap and returns it to the OS when freed,
    fixed at start-up of every training process (mallopt; shardlm/launch/allocator.py): large
    temporaries give their memory back; smaller blocks (most activations) are reused from the
    heap without page faults (8 MiB; 128 KiB until 2026-11-29 cost up to ~45% of a step); 0 =
    glibc's dynamic default. The planner prices it (fresh memory). MALLOC_MMAP_THRESHOLD_ (or
    GLIBC_TUNABLES) in the environment takes precedence. No effect off glibc (docs/allocator.md)."""
    progress: str = "auto"
    """Progress bar: 'auto' (only on a terminal), 'on', 'off'."""
    tracker: str = "none"
    """Experiment trackers that receive the JSONL's scalars and the resolved config (rank 0):
    'none', or a comma list of 'tensorboard' (run_dir/tensorboard), 'wandb' (offline in the run
    directory unless WANDB_MODE or WANDB_API_KEY is set), 'mlflow' (a file store in
    run_dir/mlruns unless MLFLOW_TRACKING_URI is set). Each is an optional extra (docs/tracking.md)."""
    profile_steps: str = ""
    """Steps to trace with torch.profiler, numbered as the JSONL's `step` (from 1): '5-7', '5,6',
    '' = none. One Chrome trace per run of consecutive steps in run_dir/profile/, per rank."""
    time_split: str = "auto"
    """Per-step time split in the JSONL (time_forward_s, time_backward_s, time_comm_wait_s,
    time_optimizer_s, time_other_s): 'on', 'off', or 'auto' (on where the device computes
    synchronously, the CPU; elsewhere it needs a device synchronize at every phase: ask with 'on')."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The network's shape."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus and tokenizer."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimisation and loop."""
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Numeric formats."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Data parallelism and ZeRO sharding."""
    activation: ActivationConfig = field(default_factory=ActivationConfig)
    """Activation memory."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """Offload tiers for the ZeRO engine."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Low-rank adapters: fine-tune a frozen model."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Resumable, sharded checkpoints."""
    run: RunConfig = field(default_factory=RunConfig)
    """Where outputs go, which device."""

    def to_dict(self) -> dict[str, Any]:
        """Nested plain values under their config keys (what load_config reads back); a nested
        section (train.local_sgd) as a table of its own."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def validate(self) -> "Config":
        """Every cross-field check, all errors at once. Returns self for chaining."""
        errors = validation_errors(self, sections())
        if errors:
            raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))
        return self


# ---------------------------------------------------------------------------------------------
# Field docs and the flat key space


def _plain(section: Any) -> dict[str, Any]:
    """A section as {key: value}, its nested sections as tables."""
    return {key_of(f): _plain(v) if dataclasses.is_dataclass(v) else v
            for f in fields(section) for v in [getattr(section, f.name)]}


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field, read from the class source."""
    try:
        tree = ast.parse(inspect.getsource(cls).lstrip())
    except (OSError, TypeError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def sections() -> dict[str, type]:
    hints = get_type_hints(Config)
    return {f.name: hints[f.name] for f in fields(Config)}


def valid_keys() -> list[str]:
    """Every 'section.key' ('section.nested.key' for a nested section's: fields.leaf_fields)."""
    return [f"{name}.{leaf.key}" for name, cls in sections().items() for leaf in leaf_fields(cls)]
