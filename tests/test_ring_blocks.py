"""The ring's per-hop kernels (parallel/context/ring_blocks.py) in one process: the fused CPU flash
attention hop against the portable math hop, and what the fused hop allocates."""

from __future__ import annotations

import pytest
import torch

from shardlm.parallel.context import ring_blocks
from shardlm.parallel.context.ring_blocks import BlockMask, block_backward, block_forward

SCALE = 0.25


def _hop(fused: bool, monkeypatch, fn, *args):
    """fn(*args) on the fused path or, with the kernel switched off, the math path."""
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(ring_blocks, "_has_cpu_flash", lambda q: False)
        return fn(*args)


def _documents(batch: int, length: int, seed: int) -> torch.Tensor:
    """(batch, length) document ids: three random cuts per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(batch, length, dtype=torch.long)
    for b in range(batch):
        for cut in torch.randint(1, length, (3,), generator=g).tolist():
            ids[b, cut:] += 1
    return ids


def _front_hop(B: int, H: int, tq: int, tk: int, d: int, seed: int):
    """q, k, v, dout and the positions of a rank's tq queries after tk earlier keys (random)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, tq, d, generator=g)
    k, v = (torch.randn(B, H, tk + tq, d, generator=g) for _ in range(2))
    dout = torch.randn(B, H, tq, d, generator=g)
    return q, k, v, dout, torch.arange(tk, tk + tq), torch.arange(tk + tq)


# A rank's hop in the ring's layout: its 96 queries sit after 80 earlier keys (a 'front' hop,
# where some queries see no key of the block) and over their own 96 keys (the diagonal, causal).
# The whole attention's output and log-sum-exp, which every hop's backward takes, are the math
# kernel's over all 176 keys.
@pytest.mark.parametrize("masking", ["causal", "window", "documents", "documents+window"])
def test_fused_hop_equals_the_math_hop(monkeypatch, masking):
    """Forward (output, log-sum-exp, the rows that see nothing) and backward (dq, dk, dv given the
    whole attention's output and log-sum-exp) of the fused hop equal the math hop's, fp32, on
    random blocks; with masks the query rows run in several tiles (MASK_ELEMENTS lowered).
    Tolerance: both kernels sum fp32 products in different orders over the head width d = 16
    (scores) and the hop's keys n <= 176 (outputs, gradients), and the fused kernel's
    vectorised exp is within 2 ulp: a first-order bound of (n + d)·eps on terms of order one,
    (176 + 16)·1.2e-7 = 2.3e-5 (measured on AMD Zen 3: under 2e-6)."""
    monkeypatch.setattr(ring_blocks, "MASK_ELEMENTS", 2 * 24 * 80)  # ~24 query rows per call
    monkeypatch.setattr(ring_blocks, "MIN_TILE_ROWS", 8)
    B, H, tq, tk, d = 2, 3, 96, 80, 16
    q, k, v, dout, qpos, kpos = _front_hop(B, H, tq, tk, d, seed=1)
    docs = _documents(B, tk + tq, seed=2) if masking.startswith("documents") else None
    window = 40 if masking.endswith("window") else 0  # the front hop: rows blind to it too
    whole = BlockMask(qpos, kpos, window, docs)
    out, lse = _hop(False, monkeypatch, block_forward, q, k, v, False, SCALE, whole)
    bound = (tk + tq + d) * torch.finfo(torch.float32).eps
    tol = dict(rtol=bound, atol=bound)
    for keys, causal in ((slice(0, tk), False), (slice(tk, tk + tq), True)):
        kk, vv = k[:, :, keys].contiguous(), v[:, :, keys].contiguous()
        mask = None if docs is None and not window else BlockMask(qpos, kpos[keys], window, docs)
        fused, math = (_hop(f, monkeypatch, block_forward, q, kk, vv, causal, SCALE, mask) for f in (True, False))
        seen = math[1].isfinite()
        assert torch.equal(fused[1].isfinite(), seen)  # the same rows see nothing (-inf)
        if masking != "causal" and not causal:
            assert not seen.all()  # the case that needs the kernel's blind rows mended
        torch.testing.assert_close(fused[0], math[0], **tol)
        torch.testing.assert_close(fused[1][seen], math[1][seen], **tol)
        grads = [_hop(f, monkeypatch, block_backward, dout, q, kk, vv, out, lse, causal, SCALE, mask)
                 for f in (True, False)]
        for name, a, b in zip(("dq", "dk", "dv"), *grads):
            torch.testing.assert_close(a, b, **tol, msg=name)


def _allocation_peak(fn) -> int:
    """Bytes fn() holds at its worst beyond what it started with: every CPU allocation and free
    (torch.profiler with profile_memory, the CPU allocator's own report: kernel scratch
    included), in time order."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    held = peak = 0
    for _, size in sorted(events):
        held += size
        peak = max(peak, held)
    return peak


def _diagonal_hop_peaks(q, k, v, mask, softcap: float = 0.0) -> dict[str, int]:
    """The allocation peaks of a diagonal hop's forward and backward (dout = 1) on one thread:
    the kernels' scratch is per thread, so the bound holds at any CPU kind and core count."""
    held = {}

    def forward():
        held["out"], held["lse"] = block_forward(q, k, v, True, SCALE, mask, softcap)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peaks = {"forward": _allocation_peak(forward)}
        dout = torch.ones_like(held["out"])
        peaks["backward"] = _allocation_peak(
            lambda: block_backward(dout, q, k, v, held["out"], held["lse"], True, SCALE, mask, softcap))
    finally:
        torch.set_num_threads(threads)
    return peaks


@pytest.mark.parametrize("masking", ["causal", "documents"])
def test_a_fused_hop_allocates_no_score_block(masking):
    """One rank's diagonal hop at T/C = 2048 tokens, 2 heads of 16: the fused forward and
    backward never hold a (T/C)² fp32 block, not even one head's (16 MiB). The math hop holds
    its scores for every head, several times in the backward (scores, probabilities, their
    gradient: 96 / 128 MiB measured; it fails this). Measured here: causal 0.8 / 2.0 MiB (forward /
    backward), documents 6.3 / 7.1 MiB (a tile's additive mask, 512 rows x 2048 keys fp32, is
    4 MiB of it). One thread: the kernel's scratch is per thread (~1 MiB each in the backward,
    query split x key split), not per block, so the bound holds at any length and CPU kind."""
    T, H, d = 2048, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, T, d, generator=g) for _ in range(3))
    pos = torch.arange(T)
    docs = torch.zeros(1, T, dtype=torch.long)
    docs[:, 700:] += 1
    docs[:, 1500:] += 1
    mask = None if masking == "causal" else BlockMask(pos, pos, 0, docs)
    peaks = _diagonal_hop_peaks(q, k, v, mask)
    score_block = T * T * 4  # one head's fp32 scores
    for what, peak in peaks.items():
        assert 0 < peak < score_block, f"{masking} {what}: {peak / 2**20:.1f} MiB"


def test_a_soft_capped_hop_runs_in_tiles_of_query_rows(monkeypatch):
    """Soft-capped scores (Gemma 2's c·tanh(s/c)) take no fused kernel: the math hop, a tile of
    query rows at a time. Its forward and backward equal the same hop in one tile, fp32, with
    documents and a window, over tiles of a few rows (tolerance as the fused test's: the tiles'
    dk, dv sum over the tiles in another order; (n + d)·eps); and at T/C = 4096 tokens, 2 heads
    of 16, the peak stays under one head's (T/C)² fp32 score block (64 MiB; the one-tile math hop
    holds the scores of both heads several times over in its backward: scores, their capped
    values and slope, probabilities, their gradient)."""
    cap = 2.0
    B, H, tq, tk, d = 2, 3, 96, 80, 16
    q, k, v, dout, qpos, kpos = _front_hop(B, H, tq, tk, d, seed=11)
    mask = BlockMask(qpos, kpos, 40, _documents(B, tk + tq, seed=12))
    out, lse = block_forward(q, k, v, False, SCALE, mask, cap)
    results = {}
    for elements in (1 << 40, 2 * 3 * 176 * 7):  # one tile; 7 query rows a tile
        monkeypatch.setattr(ring_blocks, "MASK_ELEMENTS", elements)
        results[elements] = (*block_forward(q, k, v, False, SCALE, mask, cap),
                             *block_backward(dout, q, k, v, out, lse, False, SCALE, mask, cap))
    bound = (tk + tq + d) * torch.finfo(torch.float32).eps
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results.values()):
        seen = b.isfinite()
        torch.testing.assert_close(a[seen], b[seen], rtol=bound, atol=bound, msg=name)
    monkeypatch.undo()

    T, H, d = 4096, 2, 16
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, H, T, d, generator=g) for _ in range(3))
    for what, peak in _diagonal_hop_peaks(q, k, v, None, cap).items():
        assert 0 < peak < T * T * 4, f"soft-capped {what}: {peak / 2**20:.1f} MiB"


def _cuda_kernels_on_the_cpu(monkeypatch) -> dict:
    """CUDA's fused path (ring_blocks._fused_forward/_backward's "cuda" branch) run on the CPU:
    torch's CUDA kernels replaced by the CPU flash kernel behind their CUDA signatures and
    layouts — efficient attention's log-sum-exp padded to 32 rows with garbage beyond the rows,
    its bias required (B, h, r, keys) with a 16-aligned row stride, flash's cumulative lengths
    required None. What the wiring does with them is what CUDA gets; the kernels' own numbers
    are tests/test_cuda.py's."""
    aten, calls = torch.ops.aten, {"flash": 0, "efficient": 0}
    cpu, cpu_backward = aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward

    def flash(q, k, v, dropout, causal, debug, scale):
        calls["flash"] += 1
        out, lse = cpu(q, k, v, dropout, causal, scale=scale)
        return out, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def flash_backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout, causal, seed, offset, scale):
        assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[2], k.shape[2])
        assert lse.shape == q.shape[:3] and lse.is_contiguous()
        return cpu_backward(dout, q, k, v, out, lse, dropout, causal, scale=scale)

    def _bias(bias, q, k):
        if bias is not None:
            assert bias.shape == (*q.shape[:3], k.shape[2]) and bias.stride(-2) % 16 == 0
        return bias

    def efficient(q, k, v, bias, with_lse, dropout, causal, scale):
        calls["efficient"] += 1
        out, lse = cpu(q, k, v, dropout, causal, attn_mask=_bias(bias, q, k), scale=scale)
        padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), 1e4)
        padded[..., :lse.shape[2]] = lse
        return out, padded, None, None

    def efficient_backward(dout, q, k, v, bias, out, lse, seed, offset, dropout, wanted, causal, scale):
        assert lse.shape[-1] % 32 == 0 and lse.shape[-1] - q.shape[2] < 32
        tq = q.shape[2]
        grads = cpu_backward(dout, q, k, v, out, lse[..., :tq].contiguous(), dropout, causal,
                             attn_mask=_bias(bias, q, k), scale=scale)
        return (*grads, None)

    for name, fake in (("_scaled_dot_product_flash_attention", flash),
                       ("_scaled_dot_product_flash_attention_backward", flash_backward),
                       ("_scaled_dot_product_efficient_attention", efficient),
                       ("_scaled_dot_product_efficient_attention_backward", efficient_backward)):
        monkeypatch.setattr(aten, name, fake)
    monkeypatch.setattr(ring_blocks, "_has_cpu_flash", lambda q: False)
    monkeypatch.setattr(ring_blocks, "_has_cuda_fused", lambda q: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_wiring_on_the_cpu_equals_the_cpu_fused_hop(monkeypatch, dtype):
    """The CUDA branch's wiring (kernel choice, the bias's alignment and expansion, the
    log-sum-exp's padding cut off and restored, blind rows) over CPU stand-ins of the kernels
    = the CPU fused hop, bit for bit: the same CPU kernel on the same tiles' values (the
    bias padded to 16 keys is a copy of the same values, the padded rows never read). bf16
    unmasked goes to flash, fp32 and masked hops to efficient attention; a masked bf16 hop's
    backward to it on fp32 copies."""
    B, H, tq, tk, d = 2, 3, 40, 37, 16  # 37 keys: the bias's rows need padding to 48
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, tq, d, generator=g).to(dtype)
    k, v = (torch.randn(B, H, tk + tq, d, generator=g).to(dtype) for _ in range(2))
    dout = torch.randn(B, H, tq, d, generator=g).to(dtype)
    qpos, kpos = torch.arange(tk, tk + tq), torch.arange(tk + tq)
    docs = _documents(B, tk + tq, seed=8)
    out, lse = block_forward(q, k, v, False, SCALE, BlockMask(qpos, kpos, 0, docs))
    cases = [(slice(0, tk), False, BlockMask(qpos, kpos[:tk], 20, docs)), (slice(tk, tk + tq), True, None)]
    results = {}
    for path in ("cpu", "cuda"):
        with monkeypatch.context() as m:
            calls = _cuda_kernels_on_the_cpu(m) if path == "cuda" else {}
            results[path] = [(block_forward(q, kk, vv, causal, SCALE, mask),
                              block_backward(dout, q, kk, vv, out, lse, causal, SCALE, mask))
                             for keys, causal, mask in cases
                             for kk, vv in [(k[:, :, keys].contiguous(), v[:, :, keys].contiguous())]]
    assert calls == {"flash": 1 if dtype == torch.bfloat16 else 0,
                     "efficient": 1 + (1 if dtype == torch.float32 else 0)}
    if dtype == torch.bfloat16:  # the masked hop's backward runs in fp32 on CUDA (ring_blocks
        # _fused_backward): the CPU kernel on fp32 copies, rounded to bf16 once
        keys, causal, mask = cases[0]
        up = [t.float() for t in (dout, q, k[:, :, keys], v[:, :, keys], out)]
        expected = block_backward(*up, lse, causal, SCALE, mask)
        results["cpu"][0] = (results["cpu"][0][0], tuple(g.to(dtype) for g in expected))
    for (cpu_fwd, cpu_bwd), (cuda_fwd, cuda_bwd) in zip(results["cpu"], results["cuda"]):
        for a, b in zip((*cpu_fwd, *cpu_bwd), (*cuda_fwd, *cuda_bwd)):
            assert torch.equal(a, b)
