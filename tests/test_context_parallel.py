"""Context parallelism on real gloo ranks: ring attention against the whole-sequence kernel,
and training against one process with the same global batch, every precision pinned to fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp_cases import cp_world, ring_attention_case
from parity import assert_matches
from shardlm.launch.spawn import run_ranks
from worlds import several


STEPS = 3
RINGS = [(2, 4, 2, 16, False), (2, 4, 4, 16, True), (3, 2, 1, 24, False)]
"""(ranks, query heads, key/value heads, length, path): GQA, MHA, three ranks, the portable path."""
MODES = [("ring", 1, 4, 2, 16, 2.0, 0), ("ring", 1, 4, 2, 16, 0.0, 6), ("ulysses", 2, 4, 1, 16, 0.0, 0)]
LEDGER_CASES = [("gpt-tiny", "none"), ("llama-tiny", "full"), ("gpt-tiny", "selective")]


ADAM_EPS = {"train__eps": 1e-4}
"""The parity cases' AdamW eps (not 1e-8): Adam's update m / (√v + eps) is about ±lr whatever a
gradient's size, so for an element whose gradient nearly cancels, the rounding of a reordered
sum (the ring's merged softmax, the ranks' halves of the sequence summed by the reduction, one
process's single matmul over the whole sequence, cut by its own thread count) decides a step of
up to lr: with 1e-8, blocks.0.mlp.proj.weight of the 256-token case moved 1.06e-5 of its norm
under SHARDLM_TEST_PERTURB=1 (AMD EPYC Zen 3), past the bound. With 1e-4 an element's update is
at most lr·|g|/eps, so a gradient's rounding stays a rounding of its update (as
tests/test_hf_families.py's parity cases): every case's worst parameter is then within 2.4e-6
(GPT's small attn.proj biases), perturbed or not, measured."""


def _configs(tmp) -> dict[str, dict]:
    from conftest import tiny_overrides

    gpt = tiny_overrides(tmp, **ADAM_EPS)
    llama = tiny_overrides(tmp, model__preset="llama-tiny", **ADAM_EPS)
    long = tiny_overrides(tmp, train__seq_len=256, train__micro_batch=2, model__max_seq_len=256, **ADAM_EPS)
    # Gemma-2's features: every other block slides (window 16 of 64 tokens), soft-capped scores
    gemma = {**llama, "data.document_mask": "on", "model.sliding_window": 16, "model.global_every": 2,
             "model.attn_softcap": 20.0}
    window = {**gpt, "data.document_mask": "on", "model.sliding_window": 16, "model.attn_softcap": 20.0}
    return {"gpt": gpt, "llama": llama, "long": long, "gemma": gemma, "window": window}


def _parity_cases(tmp) -> list[dict]:
    c = _configs(tmp)
    return [{**c["gpt"], "parallel.cp": 2},
            {**c["llama"], "parallel.cp": 2, "parallel.zero_stage": 3},
            {**c["long"], "parallel.cp": 2, "activation.checkpoint": "full"},
            {**c["gemma"], "parallel.cp": 2, "parallel.cp_mode": "ulysses"},
            {**c["window"], "parallel.cp": 2}]


def _ledger_overrides(tmp, preset: str, recompute: str) -> dict:
    from conftest import tiny_overrides

    return {**tiny_overrides(tmp, model__preset=preset, train__micro_batch=4, train__grad_accum=2),
            "parallel.cp": 2, "activation.checkpoint": recompute}


def _checkpoint_base(tmp, n: int) -> dict:
    from conftest import tiny_overrides

    return tiny_overrides(tmp, model__preset="llama-tiny", train__micro_batch=4, train__steps=2 * n)


@pytest.fixture(scope="module")
def two_rank_world(tmp_path_factory):
    """Every 2-rank check of this file that needs no other run first, in one spawned world
    (cp_cases.cp_world): the training parity cases (cp_runs), the ledger cases, the attention
    modes, the 2-rank ring cases and the cp-2 run the checkpoint test resumes. One set of rank
    processes instead of eight."""
    tmp = tmp_path_factory.mktemp("cp")
    parity = [(case, STEPS, -1) for case in _parity_cases(tmp)]
    ledger = [(_ledger_overrides(tmp, *case), 2, -1) for case in LEDGER_CASES]
    rings = [ring[1:] for ring in RINGS if ring[0] == 2]
    saved = {**_checkpoint_base(tmp, 2), "parallel.cp": 2, "parallel.zero_stage": 2, "checkpoint.every": 2,
             "run.name": "cp2"}
    out = run_ranks(cp_world, 2, tmp, parity + ledger, [(*m[:5], True, *m[5:]) for m in MODES], rings, [saved],
                    timeout=600)
    return {"parity": [r["train"][:len(parity)] for r in out], "ledger": [r["train"][len(parity):] for r in out],
            "modes": [r["modes"] for r in out], "rings": [r["rings"] for r in out],
            "cp2_saved": out[0]["runs"][0]}


@pytest.mark.parametrize("case", range(len(RINGS)), ids=[f"{w}-{h}-{kv}-{n}-{m}" for w, h, kv, n, m in RINGS])
def test_ring_attention_equals_whole_sequence_attention(two_rank_world, tmp_path, case):
    """Each rank's output and q/k/v gradients equal those rows of the whole-sequence causal
    attention. Tolerance, fp32: the ring merges per-block softmaxes by log-sum-exp (another
    order of the sums over n <= 24 keys and d = 8 head elements; on CPU the fused flash hop,
    whose exp is within 2 ulp): a first-order bound of (n + d)·eps = 3.8e-6 on terms up to ~3
    (randn inputs): 1e-5, on any CPU. The 2-rank cases ran in the shared world; the 3-rank one
    spawns its own."""
    world, heads, kv_heads, length, math_path = RINGS[case]
    if world == 2:
        two = [i for i, ring in enumerate(RINGS) if ring[0] == 2].index(case)
        out = [r[two] for r in two_rank_world["rings"]]
    else:
        out = run_ranks(ring_attention_case, world, tmp_path, heads, kv_heads, length, math_path)
    q, k, v = (out[0][x].clone().requires_grad_() for x in "qkv")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    (ref * out[0]["weight"]).sum().backward()
    covered = torch.cat([r["positions"] for r in out]).sort().values
    assert torch.equal(covered, torch.arange(length))  # the chunks tile the sequence
    for r in out:
        p = r["positions"]
        torch.testing.assert_close(r["out"], ref.detach()[:, :, p], rtol=1e-5, atol=1e-5)
        for name, whole in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(r[name], whole[:, :, p], rtol=1e-5, atol=1e-5, msg=name)
        # K/V traffic: forward C-1 hops of this rank's k and v; backward C-1 again, plus C hops
        # of their fp32 gradients.
        kv_bytes = 2 * 2 * kv_heads * (length // world) * 8 * 4
        assert r["bytes"] == {"send_recv/cp": (2 * (world - 1) + world) * kv_bytes}


# MODES, on 2 ranks, [(mode, all-to-all degree, query heads, key/value heads, length, soft-cap,
# window)]: every mode with document masks (three documents in row 0, one crossing the chunk
# boundaries; one in row 1); the ring's scores soft-capped (Gemma 2, cap 2: most scores bent;
# the portable math hop), the ring under documents and a sliding window of 6 (the fused CPU
# flash hop with its additive mask: parallel/context/ring_blocks.py); Ulysses with one key/value head
# for two ranks (GQA: replicated). In the shared world. (The hybrid's attention is the same
# code over two groups: tested at 4 ranks on the parameter level, documents included, in
# test_cp_composes_with_tp_and_zero_on_4_ranks.)
def test_cp_modes_equal_whole_sequence_attention_with_documents(two_rank_world):
    """Each mode's output and q/k/v gradients equal those rows of one process's attention
    under the same document mask, window and soft-cap, and the ledger's bytes are the planner's
    formula for the mode (planner/cp_modes.py: all-to-alls, ring hops), priced with the model's
    head width (8 here, not d_model / n_heads = 12). Tolerance, fp32: the reference sums over n
    <= 16 keys and d = 8 head elements in one order, the ring in per-hop blocks merged by
    log-sum-exp (and the fused hop's exp within 2 ulp): a first-order bound of (n + d)·eps =
    2.9e-6 on terms up to ~3 (randn inputs): 1e-5."""
    from types import SimpleNamespace

    from shardlm.models.attention import _allowed
    from shardlm.planner.cp_modes import cp_mode_bytes

    out, cases, world = two_rank_world["modes"], MODES, 2
    for c, (mode, a2a, heads, kv_heads, length, softcap, window) in enumerate(cases):
        ranks = [r[c] for r in out]
        q, k, v = (ranks[0][x].clone().requires_grad_() for x in "qkv")
        allowed = _allowed(ranks[0]["docs"], length, q.device)
        assert not allowed[0, 0, length - 1, 0]  # the mask is more than causal
        if window:
            pos = torch.arange(length)
            allowed = allowed & (pos[:, None] - pos[None, :] < window)
        scores = (q @ k.repeat_interleave(heads // kv_heads, 1).transpose(-1, -2)) * 8 ** -0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        ref = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v.repeat_interleave(heads // kv_heads, 1)
        (ref * ranks[0]["weight"]).sum().backward()
        covered = torch.cat([r["positions"] for r in ranks]).sort().values
        assert torch.equal(covered, torch.arange(length)), mode
        model = SimpleNamespace(n_layers=1, n_heads=heads, n_kv_heads=kv_heads, d_model=12 * heads, head_dim=8)
        want = cp_mode_bytes(model, 2 * length, world, 1, 4, mode=mode, ulysses=a2a)
        for r in ranks:
            p = r["positions"]
            torch.testing.assert_close(r["out"], ref.detach()[:, :, p], rtol=1e-5, atol=1e-5, msg=mode)
            for name, whole in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
                torch.testing.assert_close(r[name], whole[:, :, p], rtol=1e-5, atol=1e-5, msg=f"{mode} {name}")
            assert r["bytes"] == {f"{op}/cp": n for op, n in want.items() if n}, mode


def _matches(got: dict, ref: dict, what: str, tol: float = 1e-5) -> None:
    assert_matches(got["losses"], got["params"], ref, what, tol)


# fp32 throughout. The ring merges each query's attention over key blocks with a log-sum-exp
# (a different order of the softmax's sums), and the ranks' gradients are summed by the ZeRO
# reduction instead of in one backward: losses agree to 1e-5 relative, parameters after 3
# AdamW steps (eps ADAM_EPS, which says why) to 1e-5.
@pytest.fixture(scope="module")
def cp_runs(two_rank_world, tmp_path_factory):
    from zero_cases import reference_case

    tmp = tmp_path_factory.mktemp("cp-ref")
    c = _configs(tmp)
    out = two_rank_world["parity"]  # the world's runs of _parity_cases, STEPS steps each
    refs = [reference_case(c["gpt"], 1, STEPS), reference_case(c["llama"], 1, STEPS),
            reference_case({**c["long"], "activation.checkpoint": "full"}, 1, STEPS),
            reference_case(c["gemma"], 1, STEPS), reference_case(c["window"], 1, STEPS)]
    return out, refs, _parity_cases(tmp)


@pytest.mark.parametrize("case, what", [(0, "cp=2 gpt (learned positions)"),
                                        (1, "cp=2 llama (GQA, RoPE), ZeRO-3"),
                                        (2, "cp=2 gpt, 256 tokens, full recompute"),
                                        (3, "cp=2 ulysses llama (GQA), documents, windows, soft-cap"),
                                        (4, "cp=2 ring gpt, documents, sliding window, soft-cap")])
def test_cp_matches_one_process(cp_runs, case, what):
    """And each step's cp bytes in the ledger are the planner's formula for the mode."""
    from shardlm.config.load import load_config
    from shardlm.planner.cp_modes import cp_mode_bytes

    out, refs, configs = cp_runs
    cfg = load_config(overrides=configs[case]).validate()
    t, par = cfg.train, cfg.parallel
    want = t.grad_accum * sum(cp_mode_bytes(cfg.model, t.micro_batch * t.seq_len, 2, 1, 4,
                                            cfg.activation.checkpoint, mode=par.cp_mode).values())
    for r in range(2):
        _matches(out[r][case], refs[case], what)
        assert out[r][case]["comm_by_op"][-1]["cp"] == want


@pytest.mark.parametrize("case", range(len(LEDGER_CASES)), ids=["-".join(c) for c in LEDGER_CASES])
def test_ledger_bytes_match_the_formula(two_rank_world, tmp_path, case):
    """The context-parallel group's bytes per step in the ledger are exactly the planner's
    formula (planner/timing.py cp_comm_bytes): the ring's key/value hops forward, again in
    backward with their gradients, and once more when the block is recomputed."""
    from shardlm.config.load import load_config
    from shardlm.planner.traffic import cp_comm_bytes

    preset, recompute = LEDGER_CASES[case]
    over = _ledger_overrides(tmp_path, preset, recompute)  # what the world trained (2 steps)
    model = load_config(overrides=over).validate().model
    expected = 2 * cp_comm_bytes(model, 4 * 64, 2, 1, 4, recompute)  # 2 micro-batches of 4 x 64
    for r in range(2):
        assert two_rank_world["ledger"][r][case]["comm_by_op"][-1]["cp"] == expected


def _four_rank_base(tmp) -> dict:
    from conftest import tiny_overrides

    return tiny_overrides(tmp, model__preset="llama-tiny", train__micro_batch=4)


@pytest.fixture(scope="module")
def four_rank_world(tmp_path_factory, two_rank_world):
    """Every 4-rank run of this file in one spawned world (tests/worlds.py): the composition
    cases of test_cp_composes_with_tp_and_zero_on_4_ranks, then the 2-rank world's cp-2
    checkpoint resumed at cp 2 x tp 2 for the checkpoint test. One set of rank processes
    instead of two."""
    from ckpt_cases import checkpoint_of, train_ranks
    from zero_cases import train_cases

    tmp = tmp_path_factory.mktemp("cp-four")
    base = _four_rank_base(tmp)
    hybrid = {**base, "data.document_mask": "on"}
    cases = [({**base, "parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True,
               "parallel.zero_stage": 1}, STEPS, -1),
             ({**base, "parallel.cp": 2, "parallel.zero_stage": 3}, STEPS, -1),
             ({**hybrid, "parallel.cp": 4, "parallel.cp_mode": "hybrid"}, STEPS, -1)]
    resume = {**_checkpoint_base(tmp, 2), "parallel.cp": 2, "parallel.tp": 2, "run.name": "cp2tp2",
              "checkpoint.resume": checkpoint_of(two_rank_world["cp2_saved"]["run_dir"], 2)}
    out = run_ranks(several, 4, tmp, [(train_cases, (cases,)), (train_ranks, (resume,))], timeout=600)
    return {"composed": [rank[0] for rank in out], "cp2tp2": out[0][1]}


def test_cp_composes_with_tp_and_zero_on_4_ranks(tmp_path, four_rank_world):
    """cp 2 × tp 2 with sequence parallelism (the tensor-parallel group splits each rank's
    chunks further), dp_shard 2 × cp 2 at ZeRO-3 (model states sharded over the four
    data- and context-parallel ranks), and cp 4 hybrid (all-to-all over pairs, a ring of two
    pairs) with document masks, each against one process with the same global batch; the
    hybrid's cp bytes are the planner's formula (planner/cp_modes.py)."""
    from shardlm.config.load import load_config
    from shardlm.planner.cp_modes import cp_mode_bytes
    from tp_cases import whole_params
    from zero_cases import reference_case

    base = _four_rank_base(tmp_path)
    hybrid = {**base, "data.document_mask": "on"}
    out = four_rank_world["composed"]  # per rank: the three cases above, in that order
    one, two = reference_case(base, 1, STEPS), reference_case(base, 2, STEPS)
    one_docs = reference_case(hybrid, 1, STEPS)
    cfg = load_config(overrides={**hybrid, "parallel.cp": 4, "parallel.cp_mode": "hybrid"}).validate()
    t = cfg.train
    cp_bytes = t.grad_accum * sum(cp_mode_bytes(cfg.model, t.micro_batch * t.seq_len, 4, 1, 4,
                                                mode="hybrid").values())
    for c in range(2):  # ranks (c, t) = 2·c + t
        pieces = [out[2 * c][0], out[2 * c + 1][0]]
        _matches({"losses": pieces[0]["losses"], "params": whole_params(pieces)}, one, f"cp2 x tp2, cp rank {c}")
    for r in range(4):
        _matches(out[r][1], two, f"dp2 x cp2 ZeRO-3, rank {r}")
        _matches(out[r][2], one_docs, f"cp4 hybrid (all-to-all 2 x ring 2), document masks, rank {r}")
        assert out[r][2]["comm_by_op"][-1]["cp"] == cp_bytes  # all-to-alls + ring hops


def test_checkpoints_load_across_context_parallel_layouts(two_rank_world, four_rank_world, tmp_path):
    """Saved at cp 2 (ZeRO-2: states sharded over the two context-parallel ranks), resumed in
    one process and at cp 2 × tp 2: the same loss curve continues."""
    from ckpt_cases import checkpoint_of, train_run

    n = 2
    base = _checkpoint_base(tmp_path, n)
    saved = two_rank_world["cp2_saved"]  # the world's train_run at cp 2, ZeRO-2, saving every n steps
    ckpt = checkpoint_of(saved["run_dir"], n)
    one = train_run({**base, "run.name": "one", "checkpoint.resume": ckpt})
    cp_tp = four_rank_world["cp2tp2"]  # resumed from it at cp 2 x tp 2 on 4 ranks
    for result in (one, cp_tp):
        assert result["start"] == n
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(saved["losses"][n:]),
                                   rtol=1e-5, atol=0)


@pytest.mark.parametrize("fields, message", [
    ({"parallel.cp": 4, "parallel.cp_mode": "ulysses", "model.n_heads": 6, "model.n_kv_heads": 3,
      "model.d_model": 96}, r"its 6 query heads .* must divide by 4"),
    ({"parallel.cp": 4, "parallel.cp_mode": "ulysses", "model.n_heads": 12, "model.n_kv_heads": 3,
      "model.d_model": 96}, r"its 3 key/value heads divide by 4 or divide it"),
    ({"parallel.cp": 2, "parallel.cp_mode": "hybrid"}, r"strictly between 1 and cp"),
    ({"parallel.cp": 8, "parallel.cp_mode": "hybrid", "parallel.cp_ulysses": 3}, r"must divide cp"),
    ({"parallel.cp": 2, "parallel.cp_ulysses": 2}, r"with cp_mode = 'ring' it has no effect"),
    ({"parallel.cp": 2, "model.attention": "math"}, r"or cp_mode = 'ulysses'"),
])
def test_cp_mode_refusals_name_the_keys_and_the_way_out(fields, message):
    """Before any process starts (Config.validate)."""
    from shardlm.config.load import load_config
    from shardlm.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"model.preset": "llama-tiny", "train.seq_len": 64, **fields}).validate()


def test_cp_mode_auto_prices_every_mode_the_heads_allow(caplog):
    """planner/cp_modes.py: at cp = 8 a head-rich model's Ulysses sends fewer bytes than the
    ring (its exchanges shrink with C, the ring's blocks do not), every hybrid degree is priced
    between, and parallel.cp_mode = 'auto' resolves to the fastest, a config that validates.
    The model's heads are 32 wide, not d_model / n_heads = 16 (model.head_dim, as Gemma's):
    each mode's bytes are priced with that width."""
    from shardlm.config.load import load_config
    from shardlm.hardware.catalog import parse_cluster
    from shardlm.planner.cp_modes import choose_cp_mode
    from shardlm.train.resolve import decide

    over = {"model.preset": "llama-tiny", "model.n_heads": 16, "model.n_kv_heads": 8, "model.d_model": 256,
            "model.head_dim": 32, "train.seq_len": 64, "run.device": "cpu", "precision.compute": "fp32",
            "parallel.cp": 8}
    m = load_config(overrides=over).validate().model
    ranked = choose_cp_mode(m, 4096, 8, 1, 2, "none", 100e9, 5e-6)
    by_mode = {(t.mode, t.ulysses): t for t in ranked}
    assert set(by_mode) == {("ring", 1), ("hybrid", 2), ("hybrid", 4), ("ulysses", 8)}
    # per block and pass, a rank's 4096/8 tokens: Ulysses sends 7/8 of q, k, v and the output
    # (16 + 2·8 + 16 heads of 32, bf16); the ring 7 hops of k and v (8 heads of 32, bf16), and
    # their fp32 gradients 8 hops in the backward
    L, t = m.n_layers, 4096 // 8
    assert by_mode["ulysses", 8].bytes == L * 2 * 7 * t * (16 + 2 * 8 + 16) // 8 * 32 * 2
    assert by_mode["ring", 1].bytes == L * (2 * 7 * 2 * t * 8 * 32 * 2 + 8 * 2 * t * 8 * 32 * 4)
    assert by_mode["ulysses", 8].bytes < by_mode["hybrid", 2].bytes < by_mode["ring", 1].bytes
    assert [t.seconds for t in ranked] == sorted(t.seconds for t in ranked)
    with caplog.at_level("INFO", logger="shardlm"):
        cfg = decide(load_config(overrides={**over, "parallel.cp_mode": "auto"}), 8, torch.device("cpu"),
                     hardware=parse_cluster("8xH100-80GB"))
    said = next(r.getMessage() for r in caplog.records if "cp_mode = auto" in r.getMessage())
    assert all(name in said for name in ("ring", "hybrid 2", "hybrid 4", "ulysses"))
    chosen = (cfg.parallel.cp_mode, cfg.parallel.cp_ulysses or (8 if cfg.parallel.cp_mode == "ulysses" else 1))
    assert chosen in by_mode and said.startswith(f"parallel.cp_mode = auto: {chosen[0]} ")


def test_cp_attention_compiles_as_one_graph():
    """The ring and Ulysses' all-to-all are custom ops (parallel/context/ops.py): compiled with
    fullgraph, as train.compile compiles a block, they trace with no graph break, and output and
    gradients equal one process's attention under the same document mask (1e-5). One process:
    a group of one rank runs the same ops (its exchanges are copies); the 2-rank compiled run is
    bench/compose.py --run --pairs cp+compile."""
    from cp_cases import document_positions
    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.models.attention import _allowed
    from shardlm.parallel.context.attention import CPState
    from shardlm.parallel.context.attention import UlyssesAttention

    cp = CPState(Comm(None, "cp", CommLedger()))
    core = UlyssesAttention(cp, cp.comm, CPState(cp.comm))  # the hybrid's path: all-to-all, then the ring
    cp.sharded, cp.documents = True, document_positions(16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 16, 8, generator=g).requires_grad_() for h in (4, 2, 2))
    # aot_eager: Dynamo's trace and AOTAutograd's joint graph (where a break or a missing
    # backward would show) without Inductor's code generation, which costs a minute here
    out = torch.compile(core.forward, fullgraph=True, backend="aot_eager")(q, k, v)
    out.sum().backward()
    got = [out.detach()] + [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_allowed(cp.documents, 16, q.device), enable_gqa=True)
    ref.sum().backward()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref.detach()] + [t.grad for t in (q, k, v)]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
