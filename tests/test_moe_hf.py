"""Mixtures of experts and transformers, both ways.

Export: a LLaMA-style MoE (moe-tiny) becomes a `MixtralForCausalLM` (shardlm.checkpoint.export) with our
logits, its files in Mixtral's published layout (`block_sparse_moe.experts.{e}.w1/w2/w3`); an
MoE Mixtral cannot express is a ConfigError naming each field.

Training: tiny Mixtral, Qwen2-MoE and OLMoE models built from transformers configs train
unmodified through CausalLMAdapter on the ZeRO engine, stage 3 on 2 gloo ranks, against one
process with the same global batch and one rank's thread count (zero_cases.reference_case), as
tests/test_hf_models.py does for GPT-2, LLaMA and T5; and, built on the meta device, each rank
materialises its units to the weights one process materialises whole. Units: the decoder
layers, the children of the largest ModuleList (`model.model.layers`), without naming a class.

Load balancing: transformers adds `router_aux_loss_coef × aux_loss` only to the loss it computes
from labels; the adapter attaches it to the logits (models/hf.py), so the loop's own loss trains
with it: the gradients equal transformers' own loss's, the router learns from the term alone
(logits × 0), scaled by MoEStats.grad_scale as our layers' terms are. The parity runs below
train with it (Mixtral 0.001, Qwen2-MoE 0.001, OLMoE 0.01): the term is per micro-batch (one
forward's router logits), so a rank's micro-batch gets what one process's accumulation step
gets, and the tolerances are unchanged.

Expert parallelism (parallel.ep = 2 on 2 ranks): each experts module (stacked gate_up_proj /
down_proj, forward taking the routing decision) becomes StackedExperts (parallel/expert/dispatch.py),
this rank's 2 of 4 experts, tokens exchanged by all-to-all; the run matches one process with
grad_accum 2 at ZeRO stages 0 and 3 (Mixtral), 3 (Qwen2-MoE: a shared expert beside) and 2
(OLMoE). Built on the meta device, each rank materialises its experts' rows of the weights one
process materialises whole. A layout StackedExperts cannot run is a ConfigError naming the
module and what differs.

The reference: Mixtral unmodified (transformers' eager experts: StackedExperts' gradients are
bitwise its, in one process). Qwen2-MoE and OLMoE against one process running StackedExperts
over all experts: in one process their gradients differ from the eager module's by ~1e-7
relative (measured: 9e-8 .. 4e-7 per parameter, Qwen2-MoE), because the block input's gradient
sums its paths (one gather of the routed rows here, one per expert there, the shared expert,
the router) in another order; Adam turns that into ~1e-4 relative on its tiny-gradient,
zero-initialised q/k biases within 3 steps. test_stacked_experts_compute_the_eager_experts
checks StackedExperts against the eager module directly.

Measured at ep 2 (fp32, 3 steps): losses bitwise; parameters <= 2.5e-7 relative (the experts':
each expert's matmuls run over both ranks' rows at once, not one micro-batch's at a time, so
the kernels round differently), except Qwen2-MoE's key biases, 2.1e-5 relative but 1.7e-7
absolute: their gradient is nearly zero (under rotary embeddings a key bias shifts the scores
only through position), so Adam's normalised steps make a small-norm tensor of rounding-level
gradient differences. Asserted: 1e-6 relative; those biases 1e-6 absolute.

Tolerance, measured (fp32, 3 steps, grad_clip 1.0), experts 'eager': losses bitwise for all
three; parameters bitwise for Mixtral and Qwen2-MoE, 2.0e-8 relative for OLMoE (its router):
the clip coefficient's ulp (test_hf_models.py says why: the sharded gradient norm is summed
from per-shard partial norms). With the library's own experts kernel (grouped_mm on
transformers 5.23 / torch 2.13) the same at stages 2 and 3: losses bitwise, parameters
<= 5e-8. Asserted: 1e-6 relative, as test_hf_models.py asserts everything not bitwise.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from conftest import tiny_overrides
from moe_hf_cases import MOE_MODELS, moe_hf_built, moe_hf_ep_cases, moe_hf_model, moe_hf_train_cases
from parity import rel
from tp_cases import whole_params
from worlds import several
from shardlm.checkpoint.weights import save_weights
from shardlm.config.load import load_config
from shardlm.data.tokenizer import train_tokenizer
from shardlm.errors import ConfigError
from shardlm.checkpoint.export import export_hf, hf_family, hf_state_dict
from shardlm.models.decoder import build_model
from shardlm.launch.spawn import run_ranks
from shardlm.parallel.data.zero.units import collect_units
from zero_cases import reference_case

transformers = pytest.importorskip("transformers")

STEPS, WORLD = 3, 2


# --- export ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["def add(a, b):\n    return a + b\n"] * 50, 512)  # moe-tiny: 512


def _moe_run(tmp_path, tokenizer, **model):
    """moe-tiny (with `model` overrides) saved as a run directory; norms start at 1 and the
    router near uniform: perturbed so that every tensor, and which experts win, matters."""
    cfg = load_config(overrides={"model.preset": "moe-tiny", **{f"model.{k}": v for k, v in model.items()}})
    model = build_model(cfg.model, "cpu", seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    run = tmp_path / "runs" / "run"
    save_weights(run, model, cfg, tokenizer)
    return run, model.eval()


@pytest.mark.parametrize("model", [{}, {"tie_embeddings": True, "rope_theta": 500000.0, "top_k": 1}],
                         ids=["moe-tiny", "tied-top1"])
def test_moe_exports_as_mixtral_with_our_logits(tmp_path, tokenizer, model):
    run, ours = _moe_run(tmp_path, tokenizer, **model)
    out = export_hf(run, tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.model_type == "mixtral"
    assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == \
        (4, ours.cfg.top_k, 96)
    assert config.output_router_logits is False and config.router_aux_loss_coef == 0.01
    hf = transformers.MixtralForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    print(f"Mixtral {model}: max |logits diff| = {diff:.3g}")
    assert diff <= 1e-5

    # The files hold Mixtral's published per-expert layout, whatever the class keeps in memory.
    sd = ours.state_dict()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for i in range(2):
            h, b = f"model.layers.{i}.block_sparse_moe", f"blocks.{i}.mlp"
            assert torch.equal(f.get_tensor(f"{h}.gate.weight"), sd[f"{b}.router.weight"])
            for e in range(4):
                gate_up, down = sd[f"{b}.experts.gate_up"][e], sd[f"{b}.experts.down"][e]
                assert torch.equal(f.get_tensor(f"{h}.experts.{e}.w1.weight"), gate_up[:96])
                assert torch.equal(f.get_tensor(f"{h}.experts.{e}.w3.weight"), gate_up[96:])
                assert torch.equal(f.get_tensor(f"{h}.experts.{e}.w2.weight"), down)
        # transformers 4's in-memory layout is that one: the per-expert mapping names the same
        # tensors (the tied head is one tensor in memory, absent from the file).
        per_expert = hf_state_dict(sd, ours.cfg, stacked_experts=False)
        assert set(per_expert) - {"lm_head.weight"} <= names
        assert names <= set(per_expert)
        for name in names:
            assert torch.equal(f.get_tensor(name), per_expert[name]), name


@pytest.mark.parametrize("model, message", [
    ({"router": "sigmoid"}, r"model.router = 'sigmoid' \(Mixtral's router is a softmax"),
    ({"shared_experts": 1}, r"model.shared_experts = 1 \(Mixtral has no shared experts"),
    ({"moe_every": 2}, r"model.moe_every = 2 \(blocks \[0\] are dense"),
    ({"capacity_factor": 1.25}, r"model.capacity_factor = 1.25 \(Mixtral is dropless"),
    ({"balance": "bias"}, r"model.balance = 'bias' \(the balancing bias changes which experts"),
    ({"bias": True}, r"model.bias = True \(Mixtral's linears have no biases"),
    ({"mlp": "gelu"}, r"model.mlp = 'gelu' \(Mixtral is LLaMA-style"),
])
def test_moe_mixtral_cannot_express_is_config_error(model, message):
    cfg = load_config(overrides={"model.preset": "moe-tiny", **{f"model.{k}": v for k, v in model.items()}})
    with pytest.raises(ConfigError, match="cannot export this mixture-of-experts model to "
                                          "transformers' MixtralForCausalLM: " + message):
        hf_family(cfg.model)


def test_unexportable_moe_run_writes_nothing(tmp_path, tokenizer):
    run, _ = _moe_run(tmp_path, tokenizer, router="sigmoid", shared_experts=1)
    with pytest.raises(ConfigError, match="model.router = 'sigmoid'.*; model.shared_experts = 1"):
        export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# --- transformers MoE models under ZeRO --------------------------------------------------------

def _base(tmp_path, **extra):
    return tiny_overrides(tmp_path, train__micro_batch=4, **extra)


CASES = [(name, "eager") for name in MOE_MODELS] + [("mixtral", None)]  # (model, experts kernel)


EP_CASES = [("mixtral", 3), ("mixtral", 0), ("qwen2_moe", 3), ("olmoe", 2)]  # (model, ZeRO stage)
EP_REF_STACKED = {"mixtral": False, "qwen2_moe": True, "olmoe": True}  # the reference's experts
EP = {"parallel.ep": 2, "model.experts": 4, "model.top_k": 2}
"""ep = 2 (model.experts names the experts for the config's checks: cfg.model describes the
transformers model for nothing else)."""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every 2-rank run of this file in one spawned world (tests/worlds.py), one set of rank
    processes (each importing torch and transformers) instead of three: the ZeRO-3 parity cases,
    the meta-built models at stage 3, and the ep = 2 cases with the meta-built Mixtral before
    any step. Each case builds its model under a fixed seed and its own run."""
    tmp = tmp_path_factory.mktemp("moe-hf")
    zero3 = [(name, experts, {**_base(tmp), "parallel.zero_stage": 3}, STEPS) for name, experts in CASES]
    built = [(name, {**_base(tmp), "parallel.zero_stage": 3, "run.name": name}) for name in MOE_MODELS]
    ep = [(name, "cpu", {**_base(tmp), **EP, "parallel.zero_stage": stage, "run.name": f"{name}-{stage}"}, STEPS)
          for name, stage in EP_CASES]
    ep.append(("mixtral", "meta", {**_base(tmp), **EP, "parallel.zero_stage": 3, "run.name": "meta"}, 0))
    ranks = run_ranks(several, WORLD, tmp, [(moe_hf_train_cases, (zero3,)), (moe_hf_built, (built,)),
                                            (moe_hf_ep_cases, (ep,))], timeout=600)
    return {"tmp": tmp, "zero3": [r[0] for r in ranks], "built": (built, [r[1] for r in ranks]),
            "ep": [r[2] for r in ranks]}


@pytest.fixture(scope="module")
def zero3_runs(world):
    refs = [reference_case(_base(world["tmp"]), WORLD, STEPS, model=moe_hf_model(name, experts=experts))
            for name, experts in CASES]
    return world["zero3"], refs


@pytest.mark.parametrize("index", range(len(CASES)),
                         ids=[f"{name}-{experts or 'default-experts'}" for name, experts in CASES])
def test_moe_models_at_zero3_match_one_process(zero3_runs, index):
    (rank0, rank1), refs = zero3_runs
    got, ref = rank0[index], refs[index]
    for p in ref["params"]:  # the ranks hold the same model
        assert torch.equal(rank1[index]["params"][p], got["params"][p]), p
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    assert got["params"].keys() == ref["params"].keys()
    worst = max((rel(got["params"][p], value), p) for p, value in ref["params"].items())
    print(f"{CASES[index]}: losses {got['losses']}, worst parameter {worst}")
    assert worst[0] <= 1e-6, worst


@pytest.mark.parametrize("name", MOE_MODELS)
def test_adapter_trains_with_the_models_balancing_loss(name):
    """Our loss on the adapter's logits = transformers' own loss with labels (language model +
    router_aux_loss_coef × aux_loss): the same gradients on every parameter."""
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    ours, theirs = moe_hf_model(name), moe_hf_model(name)
    assert ours.aux_coef == theirs.model.config.router_aux_loss_coef > 0
    logits = ours(ids)  # grad_scale 1: one micro-batch is the whole objective
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    out = theirs.model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    out.loss.backward()
    assert out.aux_loss > 0
    for (n, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-9), n


@pytest.mark.parametrize("name", MOE_MODELS)
def test_router_learns_from_the_balancing_loss_alone(name):
    """Logits × 0: the language-model loss gives no gradient, the attached term does — to the
    routers (and what feeds them), not to the head; twice the grad_scale, twice the gradient.
    Evaluation (no grad) and a zero coefficient attach nothing."""
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for scale in (1.0, 2.0):
        model = moe_hf_model(name)
        model.moe_stats.grad_scale = scale
        (model(ids) * 0).sum().backward()
        routers = {n: p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}
        assert len(routers) == 2 and all(g.abs().max() > 0 for g in routers.values()), name
        assert model.model.lm_head.weight.grad.abs().max() == 0
        grads.append(routers)
    for n, g in grads[0].items():
        assert torch.allclose(2 * g, grads[1][n], rtol=1e-6, atol=0), n
    with torch.no_grad():
        assert not model(ids).requires_grad
    model = moe_hf_model(name)
    model.model.config.router_aux_loss_coef = 0.0
    from shardlm.models.hf import CausalLMAdapter
    plain = CausalLMAdapter(model.model)
    assert plain.aux_coef == 0 and plain.moe_stats.experts == 4  # still a mixture (parallel.ep)
    (plain(ids) * 0).sum().backward()
    assert all(p.grad.abs().max() == 0 for p in plain.parameters() if p.grad is not None)


def test_moe_model_units_are_the_decoder_layers():
    for name in MOE_MODELS:
        units = [(u.name, type(u.module).__name__) for u in collect_units(moe_hf_model(name))]
        assert [u for u, _ in units] == ["root", "model.model.layers.0", "model.model.layers.1"], name
        assert units[1][1].endswith("DecoderLayer"), units


def test_meta_built_moe_models_shard_to_the_one_process_model(world):
    """Built on the meta device, each rank materialises only its units at stage 3, every leaf
    (the stacked experts, the routers, Qwen2-MoE's shared expert and its gate) initialised by
    the model's own _init_weights: the result is the model one process materialises whole."""
    from shardlm.models.init import materialize

    cases, ranks = world["built"]  # the world's moe_hf_built of each model at stage 3
    for index, (name, overrides) in enumerate(cases):
        whole = materialize(moe_hf_model(name, "meta"), "cpu", overrides.get("train.seed", 1337))
        cpu_built = moe_hf_model(name)  # the library's own init, for scale
        for key, value in [*whole.named_parameters(), *whole.named_buffers()]:
            for rank in ranks:
                assert torch.equal(rank[index][key], value.detach().float()), (name, key)
            if value.dim() >= 2:  # initialised like the library does, not left at zero or garbage
                expected = cpu_built.get_parameter(key).std()
                assert 0.5 * expected < value.std() < 2 * expected, (name, key)


# --- expert parallelism ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ep_runs(world):
    """The world's ep = 2 runs (EP_CASES, then the meta-built Mixtral before any step) and their
    one-process references."""
    tmp = world["tmp"]
    refs = {name: reference_case({**_base(tmp), "run.name": f"ref-{name}"}, WORLD, STEPS,
                                 model=moe_hf_model(name, stacked=EP_REF_STACKED[name]))
            for name in sorted({name for name, _ in EP_CASES})}
    return world["ep"], refs


@pytest.mark.parametrize("index", range(len(EP_CASES)), ids=[f"{n}-zero{s}" for n, s in EP_CASES])
def test_moe_models_at_ep2_match_one_process(ep_runs, index):
    (rank0, rank1), refs = ep_runs
    name = EP_CASES[index][0]
    ref = refs[name]
    got = [rank0[index], rank1[index]]
    experts = {n for n in ref["params"] if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert set(got[0]["splits"]) == experts and len(experts) == 4
    for n in experts:  # each rank holds its 2 of the 4 experts
        assert got[0]["params"][n].shape[0] == got[1]["params"][n].shape[0] == 2, n
    assert got[0]["losses"] == got[1]["losses"]
    assert got[0]["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    whole = whole_params(got)
    assert whole.keys() == ref["params"].keys()
    key_bias = {p for p in ref["params"] if p.endswith("k_proj.bias")}  # Qwen2-MoE's: see the docstring
    worst = max((rel(whole[p], value), p) for p, value in ref["params"].items() if p not in key_bias)
    print(f"{EP_CASES[index]} at ep 2: losses {got[0]['losses']}, worst parameter {worst}")
    assert worst[0] <= 1e-6, worst
    for p in key_bias:
        assert float((whole[p] - ref["params"][p]).abs().max()) <= 1e-6, p
    a2a = [k for k in got[0]["comm_by_op"][0] if k.startswith("ep")]
    assert a2a, got[0]["comm_by_op"][0]  # the all-to-alls ran over the ep group


@pytest.mark.parametrize("name", MOE_MODELS)
def test_stacked_experts_compute_the_eager_experts(name):
    """One process, every expert local: the loss bitwise, every gradient within 1e-6 relative
    (Mixtral's bitwise; the module docstring says why the others' are not)."""
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    out = []
    for stacked in (False, True):
        model = moe_hf_model(name, stacked=stacked)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        out.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    assert out[0][0] == out[1][0]
    assert out[0][1].keys() == out[1][1].keys()
    for n, g in out[0][1].items():
        if name == "mixtral":
            assert torch.equal(g, out[1][1][n]), n
        assert rel(out[1][1][n], g) <= 1e-6, n


def test_meta_built_moe_model_at_ep2_materialises_its_experts(ep_runs):
    from shardlm.models.init import materialize

    (rank0, rank1), _ = ep_runs
    whole = materialize(moe_hf_model("mixtral", "meta"), "cpu", 1337)
    got = whole_params([rank0[-1], rank1[-1]])
    for key, value in whole.named_parameters():
        assert torch.equal(got[key], value.detach().float()), key


def test_experts_layouts_stacked_experts_cannot_run_are_refused():
    from shardlm.parallel.expert.dispatch import hf_experts_problem, spread_hf_experts
    from shardlm.models.moe import MoEStats

    experts = moe_hf_model("mixtral").model.model.layers[0].mlp.experts
    assert hf_experts_problem(experts) is None
    experts.has_bias = True
    assert "has_bias = True" in hf_experts_problem(experts)
    experts.has_bias = False
    experts.register_parameter("down_proj_bias", torch.nn.Parameter(torch.zeros(4, 64)))
    assert "down_proj_bias" in hf_experts_problem(experts)

    class Comm1:
        size, rank = 2, 0

    model = moe_hf_model("olmoe")
    model.model.model.layers[1].mlp.experts.is_transposed = True
    with pytest.raises(ConfigError, match=r"parallel.ep = 2 cannot spread the experts of CausalLMAdapter: "
                                          r"model.model.layers.1.mlp.experts: OlmoeExperts has is_transposed = True"):
        spread_hf_experts(model, Comm1(), MoEStats([], 4))
    from hf_cases import hf_model
    with pytest.raises(ConfigError, match="has no experts module with stacked gate_up_proj"):
        spread_hf_experts(hf_model("llama"), Comm1(), MoEStats([], 4))


def test_rebalancing_a_transformers_model_is_refused():
    """Re-placement needs the per-expert loads our MoE layers record; transformers' record none."""
    from shardlm.parallel.expert.balance import ExpertBalancer

    assert ExpertBalancer(moe_hf_model("mixtral"), 0).blocks == []
    with pytest.raises(ConfigError, match="parallel.ep_rebalance_every = 1 moves experts by the loads"):
        ExpertBalancer(moe_hf_model("mixtral"), 1)
