"""The [model] and [lora] sections of the config tree (schema.py holds the others and Config):
the network's shape — from a preset, a checkpoint's config.json or keys — and its LoRA / QLoRA
adapters. Every field's docstring is its `--help-config` text."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    preset: str = "gpt-mini"
    """Named shape to start from (see `shardlm presets`); the other [model] keys override it."""
    vocab_size: int = 8192
    """Vocabulary size. The BPE tokenizer is trained on the corpus with exactly this many tokens."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention (query) heads per block."""
    n_kv_heads: int = 0
    """Key/value heads: 0 = n_heads (multi-head), 1 = multi-query, else grouped-query."""
    d_model: int = 256
    """Residual stream width."""
    d_ff: int = 0
    """MLP hidden width; 0 = 4*d_model for GELU, LLaMA's rounded 8/3*d_model for SwiGLU."""
    max_seq_len: int = 256
    """Longest sequence the model accepts (size of the learned position table for GPT-2)."""
    norm: str = "layernorm"
    """'layernorm' (GPT-2) or 'rmsnorm' (LLaMA)."""
    position: str = "learned"
    """'learned' absolute positions (GPT-2) or 'rope' rotary embeddings (LLaMA)."""
    mlp: str = "gelu"
    """'gelu' two-layer MLP (GPT-2) or 'swiglu' gated MLP (LLaMA); its activation is
    model.activation."""
    activation: str = "auto"
    """The MLP's activation: 'auto' = model.mlp's own (GELU's tanh form for 'gelu', as GPT-2;
    SiLU for 'swiglu'), 'gelu_tanh' (on the gate: Gemma's GeGLU), 'gelu' (exact, erf: GPT-NeoX)
    or 'silu'."""
    bias: bool = True
    """Biases in linear layers and norms (GPT-2 has them, LLaMA does not)."""
    norm_bias: bool = False
    """LayerNorms keep their biases even with model.bias = false (StableLM: biases on its norms,
    none on its MLP)."""
    qkv_bias: bool = False
    """Biases on the query/key/value projection only (Qwen2); model.bias puts them everywhere."""
    tie_embeddings: bool = True
    """Share the token embedding matrix with the output head (GPT-2 does, LLaMA does not)."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_type: str = "default"
    """RoPE frequency scaling, as transformers' ROPE_INIT_FUNCTIONS computes it (checkpoints
    load it from config.json's rope_parameters / rope_scaling): 'default' (plain RoPE),
    'linear' (frequencies / rope_factor), 'dynamic' (NTK: the base scaled for sequences past
    max_seq_len; within it, plain RoPE), 'yarn' (Peng et al. 2023: per-frequency blend of
    interpolation and extrapolation, cos/sin times an attention factor), 'llama3' (Llama 3.1's
    low/high-frequency wavelength rule)."""
    rope_factor: float = 1.0
    """The scaling factor of rope_type 'linear', 'dynamic', 'yarn' and 'llama3' (1 = none)."""
    rope_original_max_seq_len: int = 0
    """'llama3' and 'yarn': the context the model was pre-trained with before scaling
    (original_max_position_embeddings); 0 = max_seq_len."""
    rope_low_freq_factor: float = 1.0
    """'llama3': wavelengths above rope_original_max_seq_len / this are divided by rope_factor."""
    rope_high_freq_factor: float = 4.0
    """'llama3': wavelengths below rope_original_max_seq_len / this are kept; between the two
    bounds they are interpolated smoothly."""
    rope_beta_fast: float = 32.0
    """'yarn': rotations below which a frequency is extrapolated (kept)."""
    rope_beta_slow: float = 1.0
    """'yarn': rotations above which a frequency is interpolated (divided by rope_factor)."""
    rope_attention_factor: float = 0.0
    """'yarn': cos and sin are multiplied by this; 0 = YaRN's 0.1·ln(rope_factor) + 1."""
    rope_truncate: bool = True
    """'yarn': round the correction range to whole dimensions (transformers' `truncate`)."""
    head_dim: int = 0
    """Width of one attention head; 0 = d_model / n_heads. Llama 3.2 3B-style, Qwen3 and Gemma
    checkpoints set another (then d_model need not be a multiple of n_heads)."""
    norm_offset: bool = False
    """Gemma's RMSNorm: the weight w is stored as the checkpoint has it and applied as (1 + w),
    in fp32 (initialised at 0); every RMSNorm of the model, q/k norms included."""
    parallel_residual: bool = False
    """x + attn(norm1(x)) + mlp(norm2(x)): attention and MLP side by side on the block's input
    (GPT-NeoX, GPT-J) instead of one after the other."""
    rope_fraction: float = 1.0
    """RoPE rotates the first rope_fraction of each head's features, the rest pass unrotated
    (GPT-NeoX's rotary_pct, partial_rotary_factor); its frequencies are those of that width."""
    norm_placement: str = "pre"
    """'pre' (GPT-2, LLaMA: x + f(norm(x))), 'sandwich' (Gemma 2 and 3: x + norm(f(norm(x))),
    a second norm on the attention's and the MLP's outputs) or 'post' (OLMo-2: x + norm(f(x)))."""
    residual_multiplier: float = 1.0
    """Each block's attention and MLP outputs are multiplied by this before they join the
    residual stream (Granite)."""
    logits_divisor: float = 1.0
    """The logits are divided by this (Granite's logits_scaling)."""
    embedding_multiplier: float = 1.0
    """The token embeddings are multiplied by this (Gemma: sqrt(d_model))."""
    attention_scale: float = 0.0
    """The softmax's scale of q·k; 0 = 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar^-1/2)."""
    attn_softcap: float = 0.0
    """Attention logit soft-capping (Gemma 2): scores -> c·tanh(scores/c) before the mask; 0 =
    off. Needs the 'math' attention backend (model.attention 'auto' picks it)."""
    logit_softcap: float = 0.0
    """Final-logit soft-capping (Gemma 2): logits -> c·tanh(logits/c); 0 = off."""
    sliding_window: int = 0
    """Blocks that attend only to the last sliding_window tokens (themselves included; Mistral,
    Gemma 2 and 3): a mask, so sequences no longer than it attend fully. 0 = none."""
    global_every: int = 0
    """With model.sliding_window: every global_every-th block (index i with (i + 1) %
    global_every == 0) attends to the whole sequence, the others within the window (Gemma 2: 2,
    Gemma 3: 6). 0 = every block slides."""
    rope_local_theta: float = 0.0
    """The sliding-window blocks' own RoPE base (plain RoPE; Gemma 3's 10000 beside its global
    1e6); 0 = the same RoPE as the others."""
    qk_norm: bool = False
    """RMSNorm over each query and key head (weights of head_dim, shared by the heads) before
    RoPE, as Qwen3 (epsilon model.norm_eps)."""
    qk_norm_width: str = "head"
    """With model.qk_norm: 'head' (each head's features: Qwen3, Gemma 3) or 'all' (the whole
    projection, all heads at once, weights n_heads·head_dim and n_kv_heads·head_dim: OLMo-2)."""
    nope_every: int = 0
    """Every nope_every-th block (index i with (i + 1) % nope_every == 0) uses no positional
    encoding at all (NoPE: SmolLM3's no_rope_layers); 0 = every block rotates."""
    norm_eps: float = 1e-5
    """Epsilon of the normalisation layers."""
    ffn_multiple_of: int = 256
    """SwiGLU hidden width is rounded up to a multiple of this (LLaMA's convention)."""
    init_std: float = 0.02
    """Standard deviation of the weight initialisation (residual projections get /sqrt(2*n_layers))."""
    experts: int = 0
    """Mixture of experts (models/moe.py): routed experts per MoE block (0 = a dense model)."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_d_ff: int = 0
    """One expert's hidden width (0 = the dense MLP's width, d_ff)."""
    shared_experts: int = 0
    """Experts every token also goes through (DeepSeek), fused into one MLP of that many widths."""
    moe_every: int = 1
    """Every moe_every-th block has experts (1 = all; 2 = blocks 1, 3, 5, ...), the rest dense."""
    capacity_factor: float = 0.0
    """0 = dropless; else an expert takes at most ceil(factor · top_k · tokens / experts) choices
    of a micro-batch's tokens, the rest dropped (they pass by the residual; counted in the log)."""
    router: str = "softmax"
    """'softmax' (Mixtral: top-k of softmax, renormalised) or 'sigmoid' (DeepSeek-V3: top-k of
    sigmoid scores, normalised)."""
    router_topk_norm: bool = True
    """Renormalise the top-k gating weights to sum to 1 (Mixtral; Qwen3-MoE's and OLMoE's
    norm_topk_prob); false: each chosen expert weighs its own router probability (OLMoE)."""
    balance: str = "aux"
    """Load balancing: 'aux' (Switch's E·Σ f_i·P_i loss × aux_loss_coef), 'bias' (DeepSeek-V3's
    auxiliary-loss-free per-expert bias, moved by bias_update_rate after each step) or 'none'."""
    aux_loss_coef: float = 0.01
    """Coefficient of the load-balancing loss (balance = 'aux')."""
    z_loss_coef: float = 0.001
    """Coefficient of the router z-loss, mean(logsumexp(logits)²) (ST-MoE); 0 = off."""
    bias_update_rate: float = 0.001
    """balance = 'bias': how far each expert's bias moves per step toward the mean load."""
    attention: str = "auto"
    """Attention kernel (models/attention.py, docs/computation.md): 'sdpa' (torch's fused
    scaled_dot_product_attention), 'per_document' (SDPA on each packed document alone), 'flex'
    (FlexAttention with a block mask; no backward on CPU in torch 2.13), 'math' (plain
    matmul-softmax, the reference: keeps the s x s probabilities), or 'auto': 'sdpa', and with
    document masks 'flex' on CUDA, 'per_document' on CPU ('sdpa' under train.compile)."""
    family: str = ""
    """The transformers model_type whose tensor names and config export writes (model.hf_path
    sets it from config.json: a Phi-3 checkpoint exports as Phi-3, not as the Llama it computes
    like); '' = the class the other fields imply (checkpoint/hf_names.py hf_family)."""
    hf_path: str = ""
    """A local transformers directory (config.json, safetensors, tokenizer.json) to start from:
    its config.json gives the shape (in place of the preset), its weights the initial values,
    its tokenizer the tokens (docs/finetuning.md, 'Checkpoint families': GPT-2, Llama
    1 to 3.3, Mistral, Qwen2, Qwen3). '' = train from scratch.
    An encoder-decoder (config.json's is_encoder_decoder: T5, BART, ...) loads into the
    transformers model itself (data.format = 'seq2seq'); so does a decoder-only model_type our
    decoder does not map (Falcon, BLOOM, OPT, GPT-J, ...: docs/finetuning.md)."""
    hf_config: str = ""
    """A transformers encoder-decoder config.json (T5, BART families), or a directory holding one,
    built with fresh weights: training a seq2seq model from scratch (data.format = 'seq2seq';
    configs/hf/ has tiny ones). Its vocab_size sets model.vocab_size. '' = none."""


@dataclass
class LoRAConfig:
    rank: int = 0
    """LoRA adapters' rank r (Hu et al. 2021; docs/finetuning.md): only the adapters train, the
    rest of the model is frozen. 0 = off (every parameter trains)."""
    alpha: float = 16.0
    """The adapters' update is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input, in [0, 1)."""
    targets: str = ""
    """Linear layers that get adapters: comma-separated module-name patterns, each matching a
    whole name or its dotted suffix, fnmatch wildcards allowed (e.g. 'attn.qkv,mlp.down').
    '' = attention and MLP linears by model.mlp: 'attn.qkv,attn.proj,mlp.fc,mlp.proj' (gelu),
    'attn.qkv,attn.proj,mlp.gate_up,mlp.down' (swiglu)."""
    quantize: str = "none"
    """QLoRA (Dettmers et al. 2023; docs/finetuning.md): the frozen base linears of the blocks
    (those with adapters and the other attention / MLP ones) stored quantised and dequantised
    per layer in the compute dtype in forward: 'nf4' (4-bit NormalFloat, blocks of 64, double
    quantisation: ~0.52 B/param), 'int8' (per-row absmax, LLM.int8's weights: ~1 B/param),
    'none'. Needs lora.rank > 0. MoE experts are quantised too; cut by tp (tp <= n_kv_heads)
    and ep as the float weights are."""
    quantize_layout: str = "auto"
    """How the row-parallel linears (attn.proj, mlp.proj, mlp.down) are packed: 'rows' (blocks
    along each output row: bitsandbytes' layout, bit for bit its dequantised weight), 'columns'
    (blocks down each input column, so tensor parallelism's cut of the input falls between
    stored rows), 'auto' = 'columns' with parallel.tp > 1, else 'rows'. The two are different
    roundings of the same weight: 'columns' at tp = 1 gives one process the bits a tp run's
    pieces dequantise to (bench/compose.py's reference for a tp pair)."""
