"""Mixture-of-experts MLP: a router sends each token to `top_k` of `experts` MLPs (Shazeer et al.
2017; Switch Transformer, Fedus et al. 2021; GShard, Lepikhin et al. 2020; Mixtral; DeepSeek-V3).

    router    logits = x W_rᵀ in fp32; 'softmax' (Mixtral): the top-k of softmax(logits), their
              probabilities renormalised to sum to 1; 'sigmoid' (DeepSeek-V3): the top-k of
              sigmoid(logits) (+ the balancing bias, for the choice only), normalised.
              router_topk_norm = false (OLMoE, Qwen3-MoE's norm_topk_prob = false) keeps the
              chosen probabilities (scores) as they are
    experts   `experts` MLPs of width `expert_d_ff` (the model's MLP kind), stored stacked: one
              (E, ...) tensor per weight, so expert parallelism cuts dim 0 (placement.Split)
    shared    `shared_experts` MLPs every token goes through (DeepSeek), as one MLP of width
              shared_experts × expert_d_ff
    capacity  0: dropless. Else each expert takes at most ceil(capacity_factor · k·N / E) of the
              N tokens' k·N choices, first choices first, then by position; a dropped choice
              adds nothing (the token passes by the residual) and is counted

Balance: 'aux' adds Switch's loss  E · Σ_i f_i · P_i  (f_i the share of choices that went to
expert i, Σ f_i = k; P_i the mean router probability of i) times `aux_loss_coef`, and ST-MoE's
router z-loss mean(logsumexp(logits)²) times `z_loss_coef`; 'bias' (DeepSeek-V3's auxiliary-
loss-free balancing) adds a per-expert bias to the scores the choice is made on, after each step
moved by `bias_update_rate` toward the mean load (sign(mean − load_i)), the gating weights
unbiased; 'none' neither (the imbalance grows: the benchmark shows it).

The auxiliary losses reach backward without passing through the loss function: each layer
attaches its term to its output (`_AttachAuxLoss`, identity forward; backward feeds the term a
gradient of `MoEStats.grad_scale`, the scale the trainer gives the language-model loss), so
pipelines, activation checkpointing and every parallel axis carry them unchanged. The logged
`loss` stays the language-model loss; the terms are logged beside it.

How tokens reach the experts is the layer's `dispatcher`: `LocalDispatcher` here (every expert
on this rank), an all-to-all over the expert-parallel group from parallel/expert/dispatch.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.config.model import ModelConfig
from shardlm.models.expert_matmul import expert_linear
from shardlm.models.flops import expert_d_ff
from shardlm.models.quant import QuantFormat, quantized_linear, weight_of


@dataclass
class MoEStats:
    """What the model's mixture-of-experts layers did in this step on this rank, summed over its
    micro-batches (the trainer sums it over every rank and logs it: telemetry.moe_record), and
    the one number they need from the trainer: the gradient scale of the auxiliary losses."""

    layers: list[int]
    """The blocks with experts (all of the model's, whatever this rank's pipeline stage holds)."""
    experts: int
    grad_scale: float = 1.0
    """d(training objective)/d(one micro-batch's loss): 1/(micro-batches in the global batch),
    times the fp16 loss scale. Set by the trainer before each step."""
    sums: torch.Tensor | None = None
    """(layers, E + 4): per layer, the choices routed to each expert (before the capacity),
    then the choices dropped, the Switch loss × tokens, Σ logsumexp², and the tokens."""
    a2a_wait_s: float = 0.0
    """Seconds this rank waited in expert-parallel all-to-alls this step."""
    biases: dict[int, torch.Tensor] = field(default_factory=dict)
    """Block index -> its router's balancing bias (balance = 'bias'), fp32, the same on every
    rank (moved by globally summed loads)."""

    def reset(self) -> None:
        self.sums, self.a2a_wait_s = None, 0.0

    def record(self, layer: int, routed: torch.Tensor, dropped: torch.Tensor, aux: torch.Tensor,
               lse2: torch.Tensor, tokens: int) -> None:
        if self.sums is None:
            self.sums = torch.zeros(len(self.layers), self.experts + 4, dtype=torch.float64,
                                    device=routed.device)
        row = self.sums[self.layers.index(layer)]
        row[:self.experts] += routed.to(torch.float64)
        row[self.experts:] += torch.stack([dropped.to(torch.float64), aux.detach().double() * tokens,
                                           lse2.detach().double(), torch.tensor(float(tokens), dtype=torch.float64,
                                                                                device=routed.device)])


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `out`; backward gives `term` the gradient `scale` (Megatron-LM's
    MoEAuxLossAutoScaler): the term joins the objective wherever the layer runs."""

    @staticmethod
    def forward(ctx, out, term, scale):
        ctx.scale = scale
        ctx.save_for_backward(term)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (term,) = ctx.saved_tensors
        return grad, torch.full_like(term, ctx.scale), None


def _in_backward() -> bool:
    """True inside autograd's backward (activation-checkpoint recompute): not a new forward."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.experts, cfg.d_model))
        self.kind, self.top_k, self.topk_norm = cfg.router, cfg.top_k, cfg.router_topk_norm
        self.bias: torch.Tensor | None = None
        """The balancing bias (MoEStats.biases), set when balance = 'bias'."""
        self.sync_weight = None
        """Tensor parallelism: the weight through an all-reduce of its gradient (each rank
        routes different tokens: parallel/expert/dispatch.py)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, C) -> chosen experts (N, k) int64, their gating weights (N, k) fp32, the router
        probabilities (N, E) fp32 (for the balancing loss) and the logits (N, E) fp32."""
        with torch.autocast(x.device.type, enabled=False):
            weight = self.weight if self.sync_weight is None else self.sync_weight(self.weight)
            logits = F.linear(x.float(), weight.float())  # (N, E)
        if self.kind == "sigmoid":
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(-1, keepdim=True)
        else:
            scores = probs = torch.softmax(logits, dim=-1)
        choice = scores if self.bias is None else scores + self.bias.to(scores.device)
        chosen = torch.topk(choice.detach(), self.top_k, dim=-1).indices  # (N, k)
        gates = scores.gather(-1, chosen)
        if self.topk_norm:
            gates = gates / gates.sum(-1, keepdim=True)
        return chosen, gates, probs, logits


class Experts(nn.Module):
    """`count` experts' MLPs (global experts first .. first + count - 1), weights stacked on dim 0.

    swiglu: gate_up (E, 2f, C) rows [0, f) the gate, down (E, C, f); gelu: fc (E, f, C) +
    fc_bias (E, f), proj (E, C, f) + proj_bias (E, C)."""

    def __init__(self, cfg: ModelConfig, count: int, first: int = 0) -> None:
        super().__init__()
        d, f = cfg.d_model, expert_d_ff(cfg)
        self.count, self.first, self.hidden, self.swiglu = count, first, f, cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate_up = nn.Parameter(torch.empty(count, 2 * f, d))
            self.down = nn.Parameter(torch.empty(count, d, f))
        else:
            self.fc = nn.Parameter(torch.empty(count, f, d))
            self.proj = nn.Parameter(torch.empty(count, d, f))
            if cfg.bias:
                self.fc_bias = nn.Parameter(torch.empty(count, f))
                self.proj_bias = nn.Parameter(torch.empty(count, d))

    quant: dict[str, QuantFormat] | None = None
    """Set by models/quant.py quantize_experts (lora.quantize): each batched weight `attr` is then
    stored as `<attr>_q` bytes, a row per expert, dequantised in forward."""
    fp8: list[dict[str, Fp8Quantiser]] | None = None  # noqa: F821 (models/fp8.py, which imports this)
    """precision.compute = 'fp8' (models/fp8.py apply_fp8): one quantiser per global expert and
    weight, so each expert's matmuls scale its own weight and its own tokens, whichever rank
    holds it (expert parallelism hands the list to the Experts it builds)."""

    def stacked_weights(self) -> tuple[str, ...]:
        """The batched (E, out, in) weights, in forward's order."""
        return ("gate_up", "down") if self.swiglu else ("fc", "proj")

    def use_fp8(self, make) -> None:
        self.fp8 = [{name: make() for name in self.stacked_weights()} for _ in range(self.first + self.count)]

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, C): tokens grouped by local expert, `counts` (count,) of each -> (M, C). The
        matmuls are one grouped op each (models/expert_matmul.py: a compiled graph holds it); a
        quantised base (QLoRA) or FP8 takes each expert's matmul in a loop instead."""
        if self.quant or self.fp8 is not None:
            return self._per_expert(x, counts.tolist())
        if self.swiglu:
            gate, up = expert_linear(x, self.gate_up, None, counts).chunk(2, dim=-1)  # (M, f) each
            return expert_linear(F.silu(gate) * up, self.down, None, counts)
        h = F.gelu(expert_linear(x, self.fc, getattr(self, "fc_bias", None), counts), approximate="tanh")
        return expert_linear(h, self.proj, getattr(self, "proj_bias", None), counts)

    def _linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """Local expert e's `name` matmul (its bias where it has one): from the quantised table
        under QLoRA, in FP8 under fp8."""
        bias = getattr(self, f"{name}_bias", None)
        bias = None if bias is None else bias[e]
        fmt = self.quant.get(name) if self.quant else None
        if fmt is None:
            weight = getattr(self, name)[e]
        elif self.fp8 is None:
            return quantized_linear(x, getattr(self, f"{name}_q")[e], bias, fmt)
        else:  # FP8 over QLoRA's dequantised base, as models/lora.py's LoRALinear
            with torch.no_grad():
                weight = weight_of(getattr(self, f"{name}_q")[e], fmt, torch.float32)
        if self.fp8 is not None:
            return self.fp8[self.first + e][name].linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def _per_expert(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        outs = []
        for e, xe in enumerate(x.split(counts)):
            if self.swiglu:
                gate, up = self._linear(xe, "gate_up", e).chunk(2, dim=-1)
                outs.append(self._linear(F.silu(gate) * up, "down", e))
            else:
                h = F.gelu(self._linear(xe, "fc", e), approximate="tanh")
                outs.append(self._linear(h, "proj", e))
        return torch.cat(outs) if outs else x[:0]


@dataclass
class Routing:
    """Which (token, choice) pairs go to which expert, grouped by expert."""

    token: torch.Tensor
    """(M,) token index of each kept choice, grouped by expert (ascending), first choices first."""
    gate: torch.Tensor
    """(M,) its gating weight."""
    counts: torch.Tensor
    """(E,) kept choices per expert."""
    routed: torch.Tensor
    """(E,) choices per expert before the capacity."""


def route(chosen: torch.Tensor, gates: torch.Tensor, n_experts: int, capacity: int) -> Routing:
    """Group the (N, k) choices by expert; with capacity > 0 keep each expert's first
    `capacity` of them (choice-major: every first choice before any second, then by token)."""
    n, k = chosen.shape
    expert = chosen.t().reshape(-1)  # (k·N,) choice-major
    token = torch.arange(n, device=chosen.device).repeat(k)
    gate = gates.t().reshape(-1)
    order = torch.argsort(expert, stable=True)
    routed = torch.bincount(expert, minlength=n_experts)
    counts = routed
    if capacity > 0:
        starts = torch.cumsum(routed, 0) - routed
        position = torch.arange(order.numel(), device=order.device) - starts[expert[order]]
        order = order[position < capacity]
        counts = routed.clamp(max=capacity)
    return Routing(token[order], gate[order], counts, routed)


class LocalDispatcher:
    """Every expert on this rank: the grouped tokens go straight to them."""

    def __call__(self, x: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        return experts(x, routing.counts)


class MoE(nn.Module):
    """The mixture-of-experts MLP of block `index` (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, index: int, stats: MoEStats, dense_mlp) -> None:
        super().__init__()
        self.index, self.n_experts, self.top_k = index, cfg.experts, cfg.top_k
        self.capacity_factor, self.balance = cfg.capacity_factor, cfg.balance
        self.aux_coef, self.z_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.router = Router(cfg)
        if cfg.balance == "bias":
            self.router.bias = stats.biases.setdefault(index, torch.zeros(cfg.experts, device="cpu"))
        self.experts = Experts(cfg, cfg.experts)
        self.shared = None
        if cfg.shared_experts:
            from dataclasses import replace

            self.shared = dense_mlp(replace(cfg, d_ff=cfg.shared_experts * expert_d_ff(cfg)))
        self.stats = stats  # shared by the model's layers; a plain attribute, not a submodule
        self.dispatcher = LocalDispatcher()
        self.tokens = None
        """Tensor / context parallelism (parallel/expert/dispatch.py TokenShare): takes this rank's share
        of the tokens, gives the whole back, sums the balancing statistics over the ranks holding
        the rest of the micro-batch; None = every token here."""

    def capacity(self, n_tokens: int) -> int:
        if self.capacity_factor <= 0:
            return 0
        return math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, C)
        share = self.tokens
        local = flat if share is None else share.split(flat)  # (n, C): this rank's tokens
        n = local.shape[0]
        chosen, gates, probs, logits = self.router(local)
        routing = route(chosen, gates, self.n_experts, self.capacity(n))
        out = self.dispatcher(local[routing.token], routing, self.experts)  # (M, C)
        # out is in the autocast dtype (fp16 / bf16), the residual stream `local` may be fp32
        combined = torch.zeros_like(local).index_add(
            0, routing.token, (out * routing.gate.unsqueeze(-1).to(out.dtype)).to(local.dtype))
        # Switch's loss with f and P over every token of the micro-batch (a tensor- or context-
        # parallel group's shares summed: the same loss as one process); the z-loss of this
        # rank's tokens over the micro-batch's (the groups' shares add up to it).
        total = n if share is None else share.total(n)
        f, p_sum = routing.routed.to(torch.float32), probs.sum(0)
        if share is not None:
            f, p_sum = share.sum(f), share.reduce(p_sum)
        aux = self.n_experts * (f / total * p_sum / total).sum()
        lse2 = torch.logsumexp(logits, dim=-1).pow(2).sum()
        if torch.is_grad_enabled() and not _in_backward():  # not a recompute, not evaluation
            self.stats.record(self.index, routing.routed, (routing.routed - routing.counts).sum(),
                              aux, lse2, n)
        out = (combined if share is None else share.gather(combined)).view(shape)
        if self.shared is not None:
            out = out + self.shared(x)
        term = self.z_coef * lse2 / total + (self.aux_coef * aux if self.balance == "aux" else 0.0)
        if term.requires_grad and out.requires_grad:
            scale = self.stats.grad_scale * (1 if share is None else share.grad_factor())
            out = _AttachAuxLoss.apply(out, term, scale)
        return out


BIAS_SUFFIX = ".mlp.router.bias"
"""The balancing biases' names in saved weights: blocks.{i}.mlp.router.bias (not parameters:
run state that routing depends on, so inference routes as training did)."""


def bias_tensors(stats: MoEStats | None) -> dict[str, torch.Tensor]:
    """The routers' balancing biases by weight name (empty unless balance = 'bias')."""
    if stats is None:
        return {}
    return {f"blocks.{i}{BIAS_SUFFIX}": b.detach().cpu().clone() for i, b in stats.biases.items()}


def take_bias_tensors(stats: MoEStats | None, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load the biases bias_tensors saved into `stats`; `state` without them."""
    rest = {k: v for k, v in state.items() if not k.endswith(BIAS_SUFFIX)}
    for key in state.keys() - rest.keys():
        index = int(key.split(".")[1])
        if stats is None or index not in stats.biases:
            raise KeyError(f"{key}: the weights carry a router bias this model has no place for")
        stats.biases[index].copy_(state[key])
    return rest


@torch.no_grad()
def update_biases(stats: MoEStats, routed: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, after a step: each expert's bias moves by
    `rate` toward the mean load, b_i += rate · sign(mean − load_i). `routed` (layers, E): the
    step's choices per expert summed over every rank (the same on all of them)."""
    for row, layer in enumerate(stats.layers):
        bias = stats.biases.get(layer)
        if bias is not None:
            load = routed[row].to(torch.float32).cpu()
            bias += rate * torch.sign(load.mean() - load)
