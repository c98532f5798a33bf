"""The CUDA lane (issue 26): what only a GPU can show. Every test here is marked `cuda` and skips
with the reason "no CUDA device" where there is none (conftest.py); `bench/gpu_check.py` runs
them on a GPU machine. Tolerances are stated per test; "bitwise" means the same kernels on the
same values, where only where a tensor lives differs.

One GPU is the lane's machine: ZeRO's collectives run over a one-rank NCCL group (every
collective's code path, nothing to exchange), and two ranks on one GPU are refused.
"""

from __future__ import annotations

import collections

import json
import math

import pytest
import torch
import torch.distributed as dist

from conftest import tiny_overrides
from shardlm.train import build as run_build
from shardlm.config.load import load_config
from shardlm.errors import ConfigError
from shardlm.launch.runtime import Runtime, pick_device
from shardlm.comm.mesh import Mesh
from shardlm.train.build import build_run
from shardlm.train.loop import train
from shardlm.train.step import train_step

pytestmark = pytest.mark.cuda


def _overrides(tmp_path, **extra) -> dict:
    """tiny_overrides on the GPU: llama-tiny, fp32 unless a test says otherwise."""
    return tiny_overrides(tmp_path, **{"model.preset": "llama-tiny", "run.device": "cuda",
                                       "train.micro_batch": 4, **extra})


def _case(overrides: dict, steps: int, runtime: Runtime | None = None) -> dict:
    """Train `steps` steps; the losses, whole fp32 parameters on the host, and the run."""
    run = build_run(load_config(overrides=overrides).validate(), runtime)
    losses = [train_step(run, step).loss for step in range(steps)]
    with run.strategy.full_parameters():
        params = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    return {"losses": losses, "params": params, "run": run}


def _rel(a: dict, b: dict) -> float:
    """The largest relative difference of any parameter."""
    return max(float((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)) for n in b)


def _bitwise(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], what
    for name, value in b["params"].items():
        assert torch.equal(a["params"][name], value), f"{what}: {name}"


def test_bf16_on_the_gpu_tracks_the_cpu_fp32_reference(tmp_path):
    """fp32 on the GPU = fp32 on the CPU up to summation order (1e-5 relative; TF32 is off by
    default); bf16 autocast on the GPU within 2e-2 of the loss and 0.1 of the parameters."""
    steps = 5
    cpu = _case(_overrides(tmp_path / "cpu", **{"run.device": "cpu"}), steps)
    gpu32 = _case(_overrides(tmp_path / "fp32"), steps)
    gpu16 = _case(_overrides(tmp_path / "bf16", **{"precision.compute": "bf16"}), steps)
    assert gpu32["run"].runtime.device.type == "cuda"
    print("losses cpu fp32", cpu["losses"], "gpu fp32", gpu32["losses"], "gpu bf16", gpu16["losses"])
    assert gpu32["losses"] == pytest.approx(cpu["losses"], rel=1e-5)
    assert _rel(gpu32["params"], cpu["params"]) <= 1e-4
    assert gpu16["losses"] == pytest.approx(cpu["losses"], rel=2e-2)
    assert _rel(gpu16["params"], cpu["params"]) <= 0.1


@pytest.fixture
def one_rank_nccl(tmp_path, monkeypatch):
    """A one-rank NCCL group, and the run's mesh over it: ZeRO's reduce-scatters, all-gathers
    and all-reduces go through NCCL (a world of one otherwise has no group at all)."""
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'group'}", rank=0,
                            world_size=1, device_id=device)
    world = dist.group.WORLD
    monkeypatch.setattr(run_build, "build_mesh",
                        lambda dims, device, rank: Mesh(dims, 0, None, world, None, dp_group=world))
    try:
        yield Runtime(0, 1, 0, 1, device, "nccl")
    finally:
        dist.destroy_process_group()


def test_zero_stages_over_a_one_rank_nccl_group(tmp_path, one_rank_nccl):
    """Stages 1-3 through NCCL = stage 0 (no group) at fp32: a one-rank reduce-scatter and
    all-gather are copies, so bitwise; the ledger shows the collectives ran."""
    steps = 3
    reference = _case(_overrides(tmp_path / "local"), steps)
    for stage in (1, 2, 3):
        got = _case(_overrides(tmp_path / str(stage), **{"parallel.zero_stage": stage}), steps, one_rank_nccl)
        assert got["run"].strategy.shard_comm.backend == "nccl"
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-6), stage
        assert _rel(got["params"], reference["params"]) <= 1e-6, stage
    # the last run's ledger: a one-rank group still counts what each collective moved
    assert got["run"].strategy.ledger.total() > 0


def test_offload_to_cpu_and_nvme_equals_no_offload(tmp_path):
    """Optimizer state (stages 1-3) on the host or in files: the same fused AdamW on the same
    values, so the two host tiers are equal bit for bit at fp32, and both equal the GPU's own
    step up to its kernel's rounding (CUDA's and the CPU's fused AdamW differ in the last bit;
    1e-6 relative; measured on an H200: the losses identical). A host step that read a gradient
    still being copied from the GPU (non_blocking, no synchronisation) would be neither.
    Stage-3 parameters on the host or in files, the optimizer on the GPU: bitwise."""
    steps = 3
    base = _overrides(tmp_path, **{"zero.nvme_chunk_mb": 1})
    for stage in (1, 2, 3):
        staged = {**base, "parallel.zero_stage": stage, "run.dir": str(tmp_path / f"s{stage}")}
        reference = _case(staged, steps)
        host = {tier: _case({**staged, "zero.offload_optimizer": tier}, steps) for tier in ("cpu", "nvme")}
        _bitwise(host["nvme"], host["cpu"], f"stage {stage}: optimizer on nvme vs cpu")
        worst = _rel(host["cpu"]["params"], reference["params"])
        print(f"stage {stage}: optimizer on the host vs the GPU: losses {host['cpu']['losses']} vs "
              f"{reference['losses']}, largest parameter difference {worst:.2e}")
        assert host["cpu"]["losses"] == pytest.approx(reference["losses"], rel=1e-6)
        assert worst <= 1e-6, stage
        if stage == 3:
            for params in ("cpu", "nvme"):
                _bitwise(_case({**staged, "zero.offload_params": params}, steps), reference,
                         f"stage 3, parameters on {params}")


def _peak_of_second_step(overrides: dict) -> dict:
    run = build_run(load_config(overrides=overrides).validate())
    losses = [train_step(run, 0).loss]
    offload = getattr(run.model, "_activation_offload", None)
    before = offload.packed_bytes if offload is not None else 0
    sizes = collections.Counter()
    if offload is not None:
        pack = offload._pack

        def counted(t):
            sizes[(tuple(t.shape), str(t.dtype), t.untyped_storage().nbytes())] += 1
            return pack(t)
        offload._pack = counted  # read when the block's forward enters (a bound method)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses.append(train_step(run, 1).loss)
    torch.cuda.synchronize()
    params = {n: p.detach().float().cpu().clone() for n, p in run.model.named_parameters()}
    return {"losses": losses, "params": params, "peak": torch.cuda.max_memory_allocated(),
            "moved": (offload.packed_bytes - before) if offload is not None else 0,
            "largest": sorted(sizes.items(), key=lambda kv: -kv[0][2])[:4]}


@pytest.mark.parametrize("documents", ["off", "on"])
def test_activation_offload_equals_keeping_and_lowers_the_peak(tmp_path, documents):
    """Saved activations to pinned host memory on a side stream and back (prefetched): the same
    losses and parameters bit for bit, and the step's peak device memory lower by most of the
    bytes moved (all but the blocks in flight: the last one's, used at once, and the prefetched).
    With document masks ('auto' runs compiled flex attention on CUDA) and without (sdpa): on an
    H200 with documents the bytes moved were 2.4x the peak's fall, so the largest saved tensors
    are printed for each."""
    base = _overrides(tmp_path, **{"model.n_layers": 8, "model.max_seq_len": 512,
                                   "train.seq_len": 512, "train.micro_batch": 8,
                                   "data.document_mask": documents})
    kept = _peak_of_second_step(base)
    moved = _peak_of_second_step({**base, "activation.offload": "cpu", "run.dir": str(tmp_path / "o")})
    _bitwise(moved, kept, "activation offload")
    saved = kept["peak"] - moved["peak"]
    print(f"documents {documents}: peak kept {kept['peak']:,} B, offloaded {moved['peak']:,} B: "
          f"{saved:,} B less; moved {moved['moved']:,} B ({saved / moved['moved']:.2f} of it); "
          f"largest saved tensors {moved['largest']}")
    assert moved["moved"] > 0
    assert saved >= 0.5 * moved["moved"]


def test_flex_attention_with_documents_equals_per_document_math(tmp_path):
    """What model.attention = 'auto' picks on CUDA with document masks (flex) = the math
    reference, values and input gradients, fp32 within 1e-4 (different summation order)."""
    from shardlm.models.attention import attend, choose_backend, prepare

    assert choose_backend("auto", "cuda", True, False) == "flex"
    gen = torch.Generator().manual_seed(0)
    B, H, KV, T, D = 2, 4, 2, 256, 32
    q, k, v = (torch.randn(B, h, T, D, generator=gen).cuda().requires_grad_() for h in (H, KV, KV))
    positions = torch.cat([torch.arange(100), torch.arange(60), torch.arange(96)]).repeat(B, 1)
    positions[1] = torch.cat([torch.arange(30), torch.arange(226)])
    positions = positions.cuda()
    outs = {}
    for backend in ("flex", "math"):
        out = attend(q, k, v, prepare(backend, positions, T, q.device, q.dtype))
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        outs[backend] = (out.detach(), grads)
    (flex, flex_grads), (math_out, math_grads) = outs["flex"], outs["math"]
    assert torch.allclose(flex, math_out, atol=1e-4, rtol=1e-4)
    for a, b in zip(flex_grads, math_grads):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)


def test_compile_equals_eager_on_the_gpu(tmp_path):
    """train.compile (each block compiled by inductor) = eager, fp32 within 1e-5 of the loss."""
    steps = 3
    eager = _case(_overrides(tmp_path / "eager"), steps)
    compiled = _case(_overrides(tmp_path / "compiled", **{"train.compile": True}), steps)
    print("eager", eager["losses"], "compiled", compiled["losses"])
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert _rel(compiled["params"], eager["params"]) <= 1e-4


def test_fp8_with_torchao_tracks_bf16_eager_and_compiled(tmp_path):
    """precision.compute = 'fp8' on FP8 hardware: torchao's float8 training (real FP8 GEMMs),
    the loss within 3e-2 of bf16's over 8 steps; compiled (each block, as torchao recommends)
    = eager within 1e-2."""
    pytest.importorskip("torchao", reason="torchao not installed (pip install 'shardlm[fp8]')")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores (compute capability < 8.9)")
    steps = 8
    bf16 = _case(_overrides(tmp_path / "bf16", **{"precision.compute": "bf16"}), steps)
    fp8 = _case(_overrides(tmp_path / "fp8", **{"precision.compute": "fp8"}), steps)
    compiled = _case(_overrides(tmp_path / "fp8c", **{"precision.compute": "fp8", "train.compile": True}), steps)
    from torchao.float8.float8_linear import Float8Linear

    from shardlm.models.fp8 import Fp8Linear

    modules = list(fp8["run"].model.modules())
    # torchao's layers (real FP8 GEMMs), none of our emulation's
    assert any(isinstance(m, Float8Linear) for m in modules)
    assert not any(isinstance(m, Fp8Linear) for m in modules)
    print("bf16", bf16["losses"], "fp8", fp8["losses"], "fp8 compiled", compiled["losses"])
    assert fp8["losses"] == pytest.approx(bf16["losses"], rel=3e-2)
    assert compiled["losses"] == pytest.approx(fp8["losses"], rel=1e-2)


def test_qlora_bitsandbytes_kernel_equals_our_dequantisation():
    """NF4 bytes dequantised on the GPU by bitsandbytes' CUDA kernel = our torch ops, bit for bit."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes not installed")
    from shardlm.models.quant_format import QuantFormat, _bnb_kernel, dequantize, dequantize_torch, quantize

    assert _bnb_kernel() is not None
    for shape in ((256, 512), (96, 200)):
        w = (torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.02).cuda()
        packed = quantize(w, "nf4")
        assert packed.is_cuda
        cpu = dequantize_torch(packed.cpu(), QuantFormat("nf4", shape), torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            ours = dequantize(packed, QuantFormat("nf4", shape), dtype)
            assert ours.is_cuda
            assert torch.equal(ours, dequantize_torch(packed, QuantFormat("nf4", shape), dtype))
            assert torch.equal(ours.cpu(), cpu.to(dtype))


def test_export_of_a_gpu_run_loads_in_transformers(tmp_path):
    """A run trained on the GPU exports (shardlm export --format hf) to a transformers model
    with its logits (fp32, 1e-4)."""
    transformers = pytest.importorskip("transformers")
    from shardlm.checkpoint.export import export_hf

    run = build_run(load_config(overrides=_overrides(tmp_path, **{"train.steps": 2})).validate())
    result = train(run)
    out = export_hf(result.run_dir, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = run.model.eval()(ids.cuda()).float().cpu()
        diff = (hf(ids).logits - ours).abs().max().item()
    print(f"max |logits diff| = {diff:.3g}")
    assert diff <= 1e-4


def test_metrics_on_the_gpu(tmp_path):
    """The JSONL of a GPU run: MFU against the device's peak (catalog), in (0, 1); the peak
    device memory (peak_device_bytes) reported."""
    result = train(build_run(load_config(overrides=_overrides(
        tmp_path, **{"train.steps": 3, "precision.compute": "bf16"})).validate()))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    assert all(0 < r["mfu"] < 1 and math.isfinite(r["loss"]) for r in records)
    assert all(0 < r["peak_device_bytes"] <= torch.cuda.get_device_properties(0).total_memory
               for r in records)


def test_two_ranks_on_one_gpu_are_refused(monkeypatch):
    """NCCL refuses two ranks on one GPU: more local ranks than GPUs is a ConfigError naming the
    fix, before any group forms; one rank per GPU takes GPU LOCAL_RANK."""
    count = torch.cuda.device_count()
    with pytest.raises(ConfigError, match="each rank needs its own GPU"):
        pick_device("auto", 0, count + 1)
    with pytest.raises(ConfigError, match="names one GPU"):
        pick_device("cuda:0", 0, 2)
    assert pick_device("auto", count - 1, count) == torch.device("cuda", count - 1)


# -- one-GPU paths of what came after the H200 check of 2026-11-26 ----------------------------


def test_muon_on_the_gpu_tracks_the_cpu_fp32_reference(tmp_path):
    """train.optimizer = 'muon' (Newton-Schulz on the hidden matrices, AdamW on the rest) at fp32
    on the GPU = on the CPU up to summation order (TF32 off). The losses as the AdamW test's
    (1e-5); the parameters within 1e-4: each Newton-Schulz step (5 of them, coefficients |a| +
    |b| + |c| = 10.3) can grow the input's relative rounding ~10x over a width-64 reduction
    (64 x 1.2e-7), 5 x 10.3 x 7.7e-6 = 4e-4 of an update, and an update is lr (1e-3 order) of
    a weight: 3 steps stay under 1e-5 of the weights; 1e-4 leaves the forward's differences room."""
    steps = 3
    muon = {"train.optimizer": "muon"}
    cpu = _case(_overrides(tmp_path / "cpu", **{**muon, "run.device": "cpu"}), steps)
    gpu = _case(_overrides(tmp_path / "gpu", **muon), steps)
    print("muon losses cpu", cpu["losses"], "gpu", gpu["losses"], "params", _rel(gpu["params"], cpu["params"]))
    assert gpu["losses"] == pytest.approx(cpu["losses"], rel=1e-5)
    assert _rel(gpu["params"], cpu["params"]) <= 1e-4


def test_fp8_all_gather_over_a_one_rank_nccl_group(tmp_path, one_rank_nccl):
    """precision.fp8_all_gather: ZeRO-3 gathers the FP8 linears' weights in E4M3 through NCCL =
    the same run without it, bit for bit (the CPU's argument, tests/test_fp8_all_gather.py:
    tensorwise rounding is element by element at the whole weight's amax; AdamW's CUDA kernel is
    element-wise too; clipping off). It takes our emulated FP8 matmul (precision.fp8_emulate);
    with torchao's real FP8 GEMMs (fp8_emulate off) the gather is FSDP2's, not our engine's, and
    the option is refused by name: checked here where torchao is installed."""
    from shardlm.errors import ConfigError

    steps = 3
    base = _overrides(tmp_path, **{"parallel.zero_stage": 3, "precision.compute": "fp8",
                                   "precision.fp8_emulate": True, "train.grad_clip": 0.0})
    plain = _case({**base, "run.dir": str(tmp_path / "plain")}, steps, one_rank_nccl)
    gathered = _case({**base, "precision.fp8_all_gather": True, "run.dir": str(tmp_path / "fp8")},
                     steps, one_rank_nccl)
    assert gathered["run"].strategy.shard_comm.backend == "nccl"
    _bitwise(gathered, plain, "fp8 all-gather vs bf16 all-gather")
    try:
        import torchao  # noqa: F401
    except ImportError:
        return  # the refusal below is the torchao path's; docs/gpu.md carries the wheel
    with pytest.raises(ConfigError, match="fp8_emulate"):
        load_config(overrides={**base, "precision.fp8_emulate": False, "precision.fp8_all_gather": True}).validate()


def test_async_tp_pieces_equal_the_plain_linears_on_the_gpu(one_rank_nccl):
    """parallel.async_tp's decomposed column (all-gather -> matmul) and row (matmul ->
    reduce-scatter) linears, cut into 4 pieces over a one-rank NCCL group (each piece's
    collective through NCCL, a copy), = F.linear on the GPU: outputs and the gradients of
    input, weight and bias, fp32 (TF32 off). cuBLAS may take another kernel for a piece's rows
    than for all of them, so not bitwise: both sum over the C = 256 features in fp32,
    C·eps = 3e-5 relative."""
    import torch.nn.functional as F

    from shardlm.comm.collectives import Comm, CommLedger
    from shardlm.parallel.tensor.async_tp import all_gather_matmul, matmul_reduce_scatter
    from shardlm.parallel.tensor.ops import op_group

    ledger = CommLedger()
    group = op_group(Comm(dist.group.WORLD, "tp", ledger))
    g = torch.Generator().manual_seed(0)
    B, t, C, H = 2, 128, 256, 512
    x = torch.randn(B, t, C, generator=g).cuda()
    w1, b1, w2 = (torch.randn(*s, generator=g).cuda() * 0.05 for s in ((H, C), (H,), (C, H)))
    probe = torch.randn(B, t, C, generator=g).cuda()
    results = {}
    for mode in ("pieces", "plain"):
        leaves = [p.clone().requires_grad_() for p in (x, w1, b1, w2)]
        xx, ww1, bb1, ww2 = leaves
        if mode == "pieces":
            hidden = all_gather_matmul(xx, ww1, bb1, group, 4)[0]
            y = matmul_reduce_scatter(F.gelu(hidden), ww2, None, group, 4)
        else:
            y = F.linear(F.gelu(F.linear(xx, ww1, bb1)), ww2)
        (y * probe).sum().backward()
        results[mode] = [y.detach(), *(p.grad for p in leaves)]
    tol = C * torch.finfo(torch.float32).eps
    for name, a, b in zip(("y", "dx", "dw1", "db1", "dw2"), results["pieces"], results["plain"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * float(b.abs().max()), msg=name)
    assert ledger.calls["all_gather/tp"] >= 4 and ledger.calls["reduce_scatter/tp"] >= 4


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gemma2"])
def test_hf_family_logits_on_the_gpu_equal_transformers_on_the_gpu(tmp_path, name):
    """A tiny random checkpoint of the family loaded by model.hf_path onto the GPU: our logits =
    transformers' (the same checkpoint, on the GPU, its eager attention) at fp32, TF32 off, within 1e-4 — the
    CPU test's 1e-5 (tests/test_hf_families.py) with room for the GPU kernels' summation orders
    over 2 layers of width <= 128."""
    pytest.importorskip("transformers")
    import transformers

    from test_hf_families import make_family_dir
    from test_hf_path import overrides as hf_overrides

    hf_dir, _ = make_family_dir(tmp_path, name)
    cfg = load_config(overrides=hf_overrides(tmp_path, hf_dir, run__device="cuda")).validate()
    run = build_run(cfg)
    x = run.train_loader.micro_batches(0)[0][0].cuda()
    # eager: transformers' reference attention, the one that applies Gemma 2's soft-capping
    # (its default on the GPU's transformers 5.17 differed from ours by 9e-3 on gemma2 only)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").cuda().eval()
    with torch.no_grad():
        ours, theirs = run.model.eval()(x), hf(input_ids=x).logits
    assert ours.is_cuda
    diff = (ours.float() - theirs.float()).abs().max().item()
    print(f"{name}: max |logits diff| on the GPU = {diff:.3g}")
    torch.testing.assert_close(ours.float(), theirs.float(), atol=1e-4, rtol=1e-4)
