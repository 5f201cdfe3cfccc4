"""Shared helpers of the GPU attention tests (test_cuda_flash*.py, test_cuda_compressed.py).

Reference: the same math in float64 (naive torch, on the GPU), checked once against sparseattn's float64
CPU reference. Bound: the kernel's error (vs float64) <= 2 x the error of the same naive math done by torch in
the input precision (vs float64) + one rounding of the output (eps(dtype) x max|ref|) + 1e-5. lse is fp32 in both:
compared with a small absolute/relative bound and identical -inf positions.
"""
import torch

EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def poison_allocator():
    """Fill recently freed cached blocks with NaN so that an unwritten output element shows up."""
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    block.fill_(0xFF)
    del block

def check_close(name, got, ref, dtype, factor, rounding=0.0):
    """|got - ref| <= eps(dtype) * (factor * max|ref| + 2 * rounding) + 1e-4, no NaN (unwritten outputs are
    poisoned): the bound of the flash_attention tests that compare with the CPU reference on float32 copies.
    rounding: a gradient's own rounding scale where max|ref| understates it (test_cuda_flash_softmax_threshold.py's
    dq_rounding_scale)."""
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(got).any(), f"{name}: NaN or unwritten elements"
    if ref.numel() == 0:
        return
    err = (got - ref).abs().max().item()
    bound = EPS[dtype] * (factor * ref.abs().max().item() + 2 * rounding) + 1e-4
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e}"


def check_lse(got, ref):
    """lse against the reference's: no NaN, the same -inf positions, |diff| <= 2e-3 (1 + |ref|)."""
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    assert not torch.isnan(got).any(), "lse: NaN or unwritten elements"
    assert torch.equal(torch.isinf(got), torch.isinf(ref)), "lse: -inf positions differ"
    fin = torch.isfinite(ref)
    if fin.any():
        diff = (got[fin] - ref[fin]).abs()
        assert (diff <= 2e-3 * (1 + ref[fin].abs())).all(), f"lse: max error {diff.max().item():.3e}"


def cpu_copy(t):
    """A float32 CPU copy of a floating tensor (other dtypes as they are), detached; None stays None."""
    if t is None:
        return None
    return t.detach().cpu().float() if t.is_floating_point() else t.detach().cpu()


def naive_attention(q, k, v, visible, scale):
    """q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv], visible bool [T, S]. Returns o [T, Hq, Dv], lse [Hq, T]
    (-inf, o = 0 for rows without a visible key). Differentiable, NaN-free; in the dtype of the inputs."""
    G = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(G, dim=1)
    v = v.repeat_interleave(G, dim=1)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    row_any = visible.any(-1, keepdim=True)
    s = s.masked_fill(~visible, float("-inf")).masked_fill(~row_any, 0.0)
    lse = torch.logsumexp(s.float() if s.dtype in (torch.float16, torch.bfloat16) else s, -1).masked_fill(~row_any.squeeze(-1), float("-inf"))
    p = torch.softmax(s, -1) * visible
    o = torch.einsum("hts,shd->thd", p, v)
    return o, lse


def num_blocks(T, block, stride):
    """Compressed blocks of a T-token sequence (block tokens each, stride apart)."""
    return (T - block) // stride + 1 if T >= block else 0


def cmp_visible(T, Tc, block, stride, device):
    """[T, Tc] bool: query t sees compressed block j once the block ends at or before t (naive_attention's mask)."""
    t = torch.arange(T, device=device)[:, None]
    j = torch.arange(Tc, device=device)[None, :]
    return j * stride + block - 1 <= t


def flash_visible(T, S, causal, left, right, device):
    """[T, S] bool: flash_attention's visibility with the queries as the last T of S key positions; left/right < 0:
    no bound on that side (naive_attention's mask)."""
    t = torch.arange(T, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    a = t + S - T
    vis = torch.ones(T, S, dtype=torch.bool, device=device)
    if causal:
        vis &= j <= a
    if left >= 0:
        vis &= j >= a - left
    if right >= 0:
        vis &= j <= a + right
    return vis


def naive_packed(q, k, v, cu_q, cu_k, visible, scale):
    """naive_attention over packed sequences: sequence b is q rows [cu_q[b], cu_q[b + 1]) against k, v rows
    [cu_k[b], cu_k[b + 1]) with the mask visible(b, its queries, its keys). Returns o over the sequences' query rows
    and lse [Hq, those rows]."""
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        o, lse = naive_attention(qs, ks, vs, visible(b, qs.shape[0], ks.shape[0]), scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def max_err(got, ref):
    return (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0


def assert_bounded(name, got, ref64, ref_lowp, dtype):
    assert not torch.isnan(got).any(), f"{name}: NaN or unwritten elements"
    if got.numel() == 0:
        return
    err = max_err(got, ref64)
    torch_err = max_err(ref_lowp, ref64)
    # 1e-5: fp32 residual of dP - delta where the exact dS is 0 (e.g. a row with one key: dq is exactly 0).
    bound = 2 * torch_err + EPS[dtype] * ref64.abs().max().item() + 1e-5
    assert err <= bound, f"{name}: kernel error {err:.3e} > bound {bound:.3e} (torch {dtype} error {torch_err:.3e})"


def assert_lse(got, ref64):
    assert got.dtype == torch.float32
    assert not torch.isnan(got).any(), "lse: NaN or unwritten elements"
    assert torch.equal(torch.isinf(got), torch.isinf(ref64)), "lse: -inf positions differ"
    fin = torch.isfinite(ref64)
    if fin.any():
        diff = (got.double()[fin] - ref64.double()[fin]).abs()
        assert (diff <= 1e-3 * (1 + ref64.double()[fin].abs())).all(), f"lse: max error {diff.max().item():.3e}"


def run_and_compare(op, ref_fn, inputs, dtype, packed_pieces=None):
    """op(*inputs) -> (o, lse) on the GPU; ref_fn(*inputs) -> (o, lse) naive. Checks o, lse and the gradients
    of o w.r.t. the inputs, each against float64 with the bound above."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    poison_allocator()
    o, lse = op(*leaves)
    d_o = torch.randn_like(o)
    poison_allocator()
    grads = torch.autograd.grad(o, leaves, d_o)

    ref64 = [x.detach().double().requires_grad_() for x in inputs]
    o64, lse64 = ref_fn(*ref64)
    g64 = torch.autograd.grad(o64, ref64, d_o.double(), allow_unused=True)
    lowp = [x.detach().clone().requires_grad_() for x in inputs]
    o_lp, _ = ref_fn(*lowp)
    g_lp = torch.autograd.grad(o_lp, lowp, d_o, allow_unused=True)

    assert_bounded("o", o, o64.detach(), o_lp.detach(), dtype)
    assert_lse(lse, lse64.detach())
    for name, g, r, lp in zip(("dq", "dk", "dv"), grads, g64, g_lp):
        r = torch.zeros_like(g, dtype=torch.float64) if r is None else r
        lp = torch.zeros_like(g) if lp is None else lp
        assert_bounded(name, g, r, lp, dtype)
    # Deterministic backward: the same gradients bit for bit.
    again = torch.autograd.grad(op(*leaves)[0], leaves, d_o)
    for g, h in zip(grads, again):
        assert torch.equal(g, h), "backward is not deterministic"
