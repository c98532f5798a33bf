"""The `cuda` lane's kernel-level checks (bench/gpu_check.py runs them with tests/test_cuda.py's
training-level ones): SDPA with grouped kv heads where flash attention does not take the call,
and context parallelism's fused hops against the math hop. Skipped with 'no CUDA device' on a
machine without one (conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype, masked", [(torch.float32, False), (torch.bfloat16, True)])
def test_grouped_kv_attention_runs_a_fused_kernel_on_the_gpu(dtype, masked):
    """Grouped-query attention (4 query heads over 2 kv heads) where CUDA's flash kernel does not
    take the call (fp32; a mask: documents, a window): the kv heads are repeated first
    (models/attention.py kernel_takes_grouped_kv), so SDPA runs its memory-efficient kernel, not
    its math one, which held the (T, T) probabilities (measured on an H200, 2026-11-29: 77 MiB
    against 1 MiB at 8 x 4 heads x 512 tokens, fp32). At 2048 tokens the forward's peak above its
    inputs stays under 1/8 of those probabilities (512 MiB fp32) and matches the math backend."""
    from shardlm.models.attention import attend, prepare

    B, T = 8, 2048
    g = torch.Generator().manual_seed(9)
    q = torch.randn(B, 4, T, 16, generator=g).to("cuda", dtype).requires_grad_()
    k, v = (torch.randn(B, 2, T, 16, generator=g).to("cuda", dtype).requires_grad_() for _ in range(2))
    positions = torch.arange(T, device="cuda").remainder(T // 4).expand(B, T) if masked else None
    mask = prepare("sdpa", positions, T, q.device, dtype) if masked else None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = attend(q, k, v, mask)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    probabilities = B * 4 * T * T * 4
    print(f"{dtype} masked={masked}: forward peak {extra / 2**20:,.0f} MiB above its inputs")
    assert extra < probabilities / 8
    reference = attend(q, k, v, prepare("math", positions, T, q.device, dtype))
    torch.testing.assert_close(out.float(), reference.float(), **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32
                                                                  else dict(rtol=2e-2, atol=2e-2)))


# -- context parallelism's fused hops (parallel/context/ring_blocks.py) --------------------------


def _cp_hop(fused: bool, monkeypatch, fn, *args):
    """fn(*args) through CUDA's fused kernels or, with them switched off, the math path."""
    from shardlm.parallel.context import ring_blocks

    with monkeypatch.context() as m:
        if not fused:
            m.setattr(ring_blocks, "_has_cuda_fused", lambda q: False)
        return fn(*args)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7 = 7.8e-3 (a unit in the last place of 1)


@pytest.mark.parametrize("masking", ["causal", "documents", "window"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_cp_hop_equals_the_math_hop_on_the_gpu(monkeypatch, masking, dtype):
    """One rank's two hops (a front block of 256 earlier keys, the causal diagonal of 256) through
    CUDA's fused kernels (flash attention unmasked in bf16; memory-efficient attention with the
    tiles' bias under documents / windows, and in fp32) = the math hop: forward (output,
    log-sum-exp, the rows that see nothing) and backward given the whole attention's output and
    log-sum-exp. Tolerance, relative (norm of the difference over the reference's): both sum in
    fp32 inside ((n + d)·eps_fp32 = 4e-5 at n <= 512 keys, d = 64); in bf16 the fused kernels
    round the probabilities to bf16 before their second product (eps/2 = 3.9e-3 each, and dS in
    the backward), and both round their outputs to bf16 once (eps/2): 2·eps forward, 4·eps
    backward. fp32 (TF32 off): (n + d)·eps_fp32 on terms of order one. The log-sum-exp is fp32
    from the same bf16 / fp32 scores on both paths: (n + d)·eps_fp32 relative."""
    from shardlm.parallel.context.ring_blocks import BlockMask, block_backward, block_forward
    from test_ring_blocks import _documents

    B, H, tq, tk, d = 2, 4, 256, 256, 64
    scale = d ** -0.5
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, tq, d, generator=g).to("cuda", dtype)
    k, v = (torch.randn(B, H, tk + tq, d, generator=g).to("cuda", dtype) for _ in range(2))
    dout = torch.randn(B, H, tq, d, generator=g).to("cuda", dtype)
    qpos, kpos = torch.arange(tk, tk + tq, device="cuda"), torch.arange(tk + tq, device="cuda")
    docs = _documents(B, tk + tq, seed=4).cuda() if masking == "documents" else None
    window = 100 if masking == "window" else 0  # the front hop: rows blind to it
    masked = docs is not None or window
    out, lse = _cp_hop(False, monkeypatch, block_forward, q, k, v, False, scale,
                       BlockMask(qpos, kpos, window, docs))
    fp32 = (tk + tq + d) * torch.finfo(torch.float32).eps
    fwd_tol, bwd_tol = (fp32, fp32) if dtype == torch.float32 else (2 * BF16_EPS, 4 * BF16_EPS)
    for keys, causal in ((slice(0, tk), False), (slice(tk, tk + tq), True)):
        kk, vv = k[:, :, keys].contiguous(), v[:, :, keys].contiguous()
        mask = BlockMask(qpos, kpos[keys], window, docs) if masked else None
        fused, math = (_cp_hop(f, monkeypatch, block_forward, q, kk, vv, causal, scale, mask) for f in (True, False))
        seen = math[1].isfinite()
        assert torch.equal(fused[1].isfinite(), seen), (masking, causal)
        assert _rel_err(fused[0], math[0]) <= fwd_tol, (masking, causal, _rel_err(fused[0], math[0]))
        torch.testing.assert_close(fused[1][seen], math[1][seen], rtol=fp32, atol=fp32 * 10)
        grads = [_cp_hop(f, monkeypatch, block_backward, dout, q, kk, vv, out, lse, causal, scale, mask)
                 for f in (True, False)]
        for name, a, b in zip(("dq", "dk", "dv"), *grads):
            assert _rel_err(a, b) <= bwd_tol, (masking, causal, name, _rel_err(a, b))


@pytest.mark.parametrize("masking", ["causal", "documents", "softcap"])
def test_fused_cp_hop_at_32k_tokens_holds_no_score_block(monkeypatch, masking):
    """The long-context row: one GPU's hop over 32,768 tokens (cp = 1: the whole sequence is the
    diagonal block), 4 heads of 128, bf16; soft-capped (c = 20) it is the math hop in tiles of
    query rows (CUDA_MASK_ELEMENTS of fp32 scores each). The fused backward's peak above its inputs stays
    under a quarter of ONE head's (T/C)² fp32 score block (1 GiB; the math hop would hold 4 heads'
    several times, 16 GiB each). Against the math hop on the last 512 query rows (they see all
    32k keys, the longest reduction): output, log-sum-exp and dq, tolerance as in the test
    above with n = 32,768: the fp32 sums' (n + d)·eps_fp32 = 3.9e-3 and bf16's 2·eps / 4·eps."""
    from shardlm.parallel.context.ring_blocks import BlockMask, block_backward, block_forward

    T, H, d, last = 32768, 4, 128, 512
    scale = d ** -0.5
    g = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(1, H, T, d, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
    pos = torch.arange(T, device="cuda")
    docs = None
    if masking == "documents":
        docs = torch.zeros(1, T, dtype=torch.long, device="cuda")
        docs[:, T // 3:] += 1
        docs[:, T // 3 + 5000:] += 1
    mask = None if docs is None else BlockMask(pos, pos, 0, docs)
    cap = 20.0 if masking == "softcap" else 0.0  # Gemma 2's: the math hop, tiles of query rows
    out, lse = block_forward(q, k, v, True, scale, mask, cap)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    dq, _, _ = block_backward(dout, q, k, v, out, lse, True, scale, mask, cap)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    block = T * T * 4  # one head's fp32 scores
    print(f"32k {masking}: fused backward peak {extra / 2**20:,.0f} MiB above its inputs "
          f"(one head's score block {block / 2**30:.0f} GiB)")
    assert extra < block / 4
    rows = slice(T - last, T)
    sub = BlockMask(pos[rows], pos, 0, docs)  # = causal (or the documents) for these rows
    m_out, m_lse = _cp_hop(False, monkeypatch, block_forward, q[:, :, rows], k, v, False, scale, sub, cap)
    m_dq = _cp_hop(False, monkeypatch, block_backward, dout[:, :, rows], q[:, :, rows], k, v,
                   out[:, :, rows], lse[:, :, rows], False, scale, sub, cap)[0]
    fp32 = (T + d) * torch.finfo(torch.float32).eps
    assert _rel_err(out[:, :, rows], m_out) <= 2 * BF16_EPS + fp32
    torch.testing.assert_close(lse[:, :, rows], m_lse, rtol=fp32, atol=fp32 * 10)
    assert _rel_err(dq[:, :, rows], m_dq) <= 4 * BF16_EPS + fp32
