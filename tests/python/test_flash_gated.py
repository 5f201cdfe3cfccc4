"""flash_attention's gated attention (alpha, delta), gate threshold and sparse-softmax threshold (CPU reference,
float64) against an independent pure-torch implementation of docs/semantics.md section 8: batched and packed,
GQA groups 1/2/4, causal and not, decode-shaped calls, gradients (autograd and gradcheck), skipped rows, errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import require_sparseattn

sa = require_sparseattn()

NEG_INF = -math.inf


def ref_sequence(q, k, v, alpha, delta, *, causal, scale, gate, gate_threshold, tau, block):
    """One sequence: q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv], alpha [T, Hq], delta [S, Hkv] (or None).
    Returns o [T, Hq, Dv] and lse [Hq, T]."""
    T, Hq, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    G = Hq // Hkv
    bq, bk = block
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    qk = torch.einsum("thd,shd->hts", q, kk)
    if alpha is not None:
        dd = delta.repeat_interleave(G, dim=1)  # [S, Hq]
        x = alpha.t()[:, :, None] * dd.t()[:, None, :]  # [Hq, T, S]
        g = F.logsigmoid(x) if gate == "logsigmoid" else x
        logits = scale * (qk + g)
    else:
        logits = scale * qk
    t_idx = torch.arange(T)[:, None]
    s_idx = torch.arange(S)[None, :]
    aligned = t_idx + S - T
    visible = (s_idx <= aligned) if causal else torch.ones(T, S, dtype=torch.bool)
    keep = visible[None].expand(Hq, T, S).clone()
    with torch.no_grad():
        for h in range(Hq):
            for r0 in range(0, T, bq):
                r1 = min(T, r0 + bq)
                if gate_threshold is not None:
                    a = alpha[r0:r1, h].detach()
                    for c0 in range(0, S, bk):
                        d = delta[c0:c0 + bk, h // G].detach()
                        corners = torch.stack([a.min() * d.min(), a.min() * d.max(), a.max() * d.min(),
                                               a.max() * d.max()])
                        bound = corners.max()
                        bound = F.logsigmoid(bound) if gate == "logsigmoid" else bound
                        if bound < gate_threshold:
                            keep[h, r0:r1, c0:c0 + bk] = False
                if tau is None:
                    continue
                lg = logits[h, r0:r1].detach().masked_fill(~keep[h, r0:r1], NEG_INF)
                running = torch.full((r1 - r0,), NEG_INF, dtype=torch.float64)
                rows = torch.arange(r0, r1, dtype=torch.float64)
                row_tau = tau * (rows + S - T + 1) / S if causal else torch.full((r1 - r0,), tau, dtype=torch.float64)
                log_tau = torch.where(row_tau > 0, torch.log(row_tau.clamp_min(1e-300)), torch.tensor(NEG_INF))
                for c0 in range(0, S, bk):
                    if not keep[h, r0:r1, c0:c0 + bk].any():
                        continue  # gate-skipped (or fully masked): nothing to keep
                    m = lg[:, c0:c0 + bk].max(dim=1).values
                    if bool(((m == NEG_INF) | (m < running + log_tau)).all()):
                        keep[h, r0:r1, c0:c0 + bk] = False
                    else:
                        running = torch.maximum(running, m)
    logits = logits.masked_fill(~keep, NEG_INF)
    empty = ~keep.any(dim=-1)  # [Hq, T]
    safe = logits.masked_fill(empty[..., None], 0.0)
    lse = torch.logsumexp(safe, dim=-1)
    p = torch.exp(safe - lse[..., None]).masked_fill(~keep, 0.0)
    o = torch.einsum("hts,shd->thd", p, vv)
    return o, lse.masked_fill(empty, NEG_INF)


def ref_flash(q, k, v, alpha, delta, *, cu_seqlens=None, causal=False, scale=None, gate="logsigmoid",
              gate_threshold=None, softmax_threshold=None, threshold_block=(128, 128)):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kw = dict(causal=causal, scale=scale, gate=gate, gate_threshold=gate_threshold, tau=softmax_threshold,
              block=threshold_block)
    if cu_seqlens is None:
        outs = [ref_sequence(q[b], k[b], v[b], None if alpha is None else alpha[b], None if delta is None else delta[b],
                             **kw) for b in range(q.shape[0])]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])
    cq, ck = cu_seqlens
    os_, lses = [], []
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, lse = ref_sequence(q[sq], k[sk], v[sk], None if alpha is None else alpha[sq],
                              None if delta is None else delta[sk], **kw)
        os_.append(o)
        lses.append(lse)
    return torch.cat(os_), torch.cat(lses, dim=1)


def make(B, T, S, Hq, Hkv, D=8, Dv=6, seed=0, gated=True):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, sc=1.0: (torch.randn(*s, generator=gen, dtype=torch.float64) * sc).requires_grad_()
    q, k, v = r(B, T, Hq, D), r(B, S, Hkv, D), r(B, S, Hkv, Dv)
    alpha, delta = (r(B, T, Hq, sc=2.0), r(B, S, Hkv)) if gated else (None, None)
    return q, k, v, alpha, delta


def compare(inputs, *, cu=None, **kw):
    """Forward and every gradient of sparseattn against the torch reference."""
    leaves = [t for t in inputs if t is not None]
    cu_kw = {} if cu is None else dict(cu_seqlens_q=torch.tensor(cu[0], dtype=torch.int32),
                                       cu_seqlens_k=torch.tensor(cu[1], dtype=torch.int32))
    q, k, v, alpha, delta = inputs
    o, lse = sa.flash_attention(q, k, v, alpha=alpha, delta=delta, return_lse=True, **cu_kw, **kw)
    kw_ref = dict(kw)
    if "threshold_block" not in kw_ref:
        kw_ref["threshold_block"] = (128, 128)
    ro, rlse = ref_flash(q, k, v, alpha, delta, cu_seqlens=cu, **kw_ref)
    torch.testing.assert_close(o, ro, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse, rlse, atol=1e-10, rtol=1e-10)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, leaves, do, allow_unused=True)
    want = torch.autograd.grad(ro, leaves, do, allow_unused=True)
    for name, a, b in zip("q k v alpha delta".split(), got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m: f"d{name}: {m}")
    return o, lse


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gate", ["logsigmoid", "product"])
def test_gated_batched(Hq, Hkv, causal, gate):
    compare(make(2, 7, 9, Hq, Hkv, seed=Hq + Hkv), causal=causal, gate=gate)


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_thresholds_batched(Hq, Hkv, causal):
    compare(make(2, 9, 23, Hq, Hkv, seed=3), causal=causal, gate_threshold=-2.0, softmax_threshold=0.4,
            threshold_block=(4, 5))


@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [(128, 128), (2, 32)])
def test_decode_shaped(T, causal, block):
    compare(make(2, T, 300, 4, 2, seed=T), causal=causal, softmax_threshold=0.5, gate_threshold=-3.0,
            threshold_block=block)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq,Hkv", [(2, 1), (4, 4)])
def test_packed(causal, Hq, Hkv):
    lq, lk = [3, 1, 6], [5, 9, 6]
    cq, ck = [0, 3, 4, 10], [0, 5, 14, 20]
    q, k, v, alpha, delta = (t.detach()[0] for t in make(1, 10, 20, Hq, Hkv, seed=11))
    inputs = [t.clone().requires_grad_() for t in (q, k, v, alpha, delta)]
    assert sum(lq) == 10 and sum(lk) == 20
    compare(inputs, cu=(cq, ck), causal=causal, softmax_threshold=0.3, gate_threshold=-2.5, threshold_block=(2, 3))
    compare(inputs, cu=(cq, ck), causal=causal, gate="product")


def test_thresholds_skip_something():
    q, k, v, alpha, delta = make(1, 8, 64, 2, 1, seed=5)
    plain = sa.flash_attention(q, k, v, alpha=alpha, delta=delta)
    o = sa.flash_attention(q, k, v, alpha=alpha, delta=delta, softmax_threshold=1.0, threshold_block=(1, 8))
    assert not torch.allclose(o, plain)
    # No threshold and a vanishing tau are plain attention.
    tiny = sa.flash_attention(q, k, v, alpha=alpha, delta=delta, softmax_threshold=1e-300, threshold_block=(1, 8))
    torch.testing.assert_close(tiny, plain, atol=0, rtol=0)
    # Without gates flash_attention is unchanged.
    torch.testing.assert_close(sa.flash_attention(q, k, v), ref_flash(q, k, v, None, None)[0], atol=1e-12, rtol=0)


def test_softmax_threshold_without_gates():
    compare(make(2, 5, 40, 2, 1, gated=False, seed=9), causal=True, softmax_threshold=0.8, threshold_block=(2, 4))


def test_every_key_skipped():
    q, k, v, alpha, delta = make(2, 4, 6, 2, 1, seed=6)
    o, lse = sa.flash_attention(q, k, v, alpha=alpha, delta=delta, gate_threshold=0.0, return_lse=True)
    assert torch.all(o == 0) and torch.all(lse == NEG_INF)
    o.sum().backward()
    for t in (q, k, v, alpha, delta):
        assert torch.all(t.grad == 0)


def test_gradcheck_tiny():
    for gate in ("logsigmoid", "product"):
        q, k, v, alpha, delta = make(1, 3, 5, 2, 1, D=3, Dv=2, seed=7)
        fn = lambda q, k, v, a, d: sa.flash_attention(q, k, v, alpha=a, delta=d, causal=True, gate=gate,
                                                      softmax_threshold=0.2, threshold_block=(2, 2))
        assert torch.autograd.gradcheck(fn, (q, k, v, alpha, delta))


def test_float32_gates_with_float64_q():
    q, k, v, alpha, delta = make(1, 3, 5, 2, 1, seed=8)
    a32, d32 = alpha.detach().float().requires_grad_(), delta.detach().float().requires_grad_()
    o = sa.flash_attention(q, k, v, alpha=a32, delta=d32)
    o.sum().backward()
    assert a32.grad.dtype == torch.float32 and d32.grad.dtype == torch.float32


@pytest.mark.parametrize("kw,exc,arg", [
    (dict(alpha="a"), sa.SparseAttnTypeError, "alpha"),
    (dict(gate="relu"), sa.SparseAttnError, "gate"),
    (dict(gate=1), sa.SparseAttnTypeError, "gate"),
    (dict(softmax_threshold=0.0), sa.SparseAttnError, "softmax_threshold"),
    (dict(softmax_threshold=1.5), sa.SparseAttnError, "softmax_threshold"),
    (dict(softmax_threshold="0.5"), sa.SparseAttnTypeError, "softmax_threshold"),
    (dict(gate_threshold=True), sa.SparseAttnTypeError, "gate_threshold"),
    (dict(threshold_block=(0, 4)), sa.SparseAttnError, "threshold_block"),
    (dict(threshold_block=8), sa.SparseAttnTypeError, "threshold_block"),
])
def test_invalid_arguments(kw, exc, arg):
    q, k, v, alpha, delta = make(1, 3, 5, 2, 1, seed=9)
    base = dict(alpha=alpha, delta=delta)
    base.update(kw)
    with pytest.raises(exc, match=f"argument '{arg}'"):
        sa.flash_attention(q, k, v, **base)


def test_invalid_gate_tensors():
    q, k, v, alpha, delta = make(1, 3, 5, 2, 1, seed=10)
    with pytest.raises(sa.SparseAttnError, match="argument 'delta'"):
        sa.flash_attention(q, k, v, alpha=alpha)
    with pytest.raises(sa.SparseAttnError, match="argument 'alpha'"):
        sa.flash_attention(q, k, v, delta=delta)
    with pytest.raises(sa.SparseAttnError, match="argument 'alpha'"):
        sa.flash_attention(q, k, v, alpha=alpha[:, :, :1], delta=delta)
    with pytest.raises(sa.SparseAttnError, match="argument 'delta'"):
        sa.flash_attention(q, k, v, alpha=alpha, delta=delta[:, :4])
    with pytest.raises(sa.SparseAttnDTypeError, match="argument 'alpha'"):
        sa.flash_attention(q, k, v, alpha=alpha.half(), delta=delta)
    with pytest.raises(sa.SparseAttnError, match="argument 'gate_threshold'"):
        sa.flash_attention(q, k, v, gate_threshold=-1.0)
