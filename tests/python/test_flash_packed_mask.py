"""flash_attention's packed (varlen) mask and bias (CPU reference, float64): the row form [Hm|1, Nq|1, Lk] and
the key form [Hm|1, Nk] (docs/semantics.md section 8, "Mask and bias, batched and packed") against a pure-torch
implementation run per sequence on that sequence's slice of the mask and bias: mask/bias head dims Hq/Hkv/1,
broadcast over queries, GQA groups 1/2, causal and not, Tq != Tk, dq/dk/dv/dbias via autograd, gradcheck,
the spec's worked example, errors."""

import math

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()

F64 = torch.float64
CU_Q = [0, 3, 4, 9]   # Tq = 3, 1, 5
CU_K = [0, 5, 7, 10]  # Tk = 5, 2, 3: with causal, sequence 2's first two queries see no key
LK = 6                # row form width, above the longest key count (5): column 5 is never read


def ref_attention(q, k, v, keep, bias, *, causal, scale):
    """One sequence: q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv], keep bool [Hq, T|1, S] or None, bias
    [Hq, T|1, S] or None. Returns o [T, Hq, Dv] and lse [Hq, T]; a row with no kept key gives 0 and -inf."""
    T, Hq, _ = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    G = Hq // Hkv
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    logits = scale * torch.einsum("thd,shd->hts", q, kk)
    if bias is not None:
        logits = logits + bias
    allowed = torch.ones(Hq, T, S, dtype=torch.bool)
    if keep is not None:
        allowed = allowed & keep
    if causal:
        allowed = allowed & (torch.arange(S)[None, :] <= torch.arange(T)[:, None] + S - T)[None]
    any_key = allowed.any(-1, keepdim=True)
    filled = torch.where(any_key, logits.masked_fill(~allowed, -math.inf), torch.zeros_like(logits))
    p = torch.softmax(filled, dim=-1) * any_key
    lse = torch.where(any_key[..., 0], torch.logsumexp(filled, dim=-1), torch.full_like(logits[..., 0], -math.inf))
    return torch.einsum("hts,shd->thd", p, vv), lse


def heads_to_q(t, Hq):
    """[Hm, ...] to [Hq, ...]: Hm = Hq as is, 1 broadcast, Hkv repeated over each group."""
    if t.shape[0] == Hq:
        return t
    if t.shape[0] == 1:
        return t.expand(Hq, *t.shape[1:])
    return t.repeat_interleave(Hq // t.shape[0], dim=0)


def seq_slice(t, form, b, Hq):
    """Sequence b's [Hq, Tq_b|1, Tk_b] part of a packed mask or bias (None stays None)."""
    if t is None:
        return None
    q0, q1, k0, k1 = CU_Q[b], CU_Q[b + 1], CU_K[b], CU_K[b + 1]
    if form == "key":
        part = t[:, k0:k1][:, None, :]
    elif t.shape[1] == 1:
        part = t[:, :, : k1 - k0]
    else:
        part = t[:, q0:q1, : k1 - k0]
    return heads_to_q(part, Hq)


def ref_packed(q, k, v, mask, mask_form, bias, bias_form, *, causal, scale):
    os, lses = [], []
    Hq = q.shape[1]
    for b in range(len(CU_Q) - 1):
        q_b, k_b, v_b = q[CU_Q[b]:CU_Q[b + 1]], k[CU_K[b]:CU_K[b + 1]], v[CU_K[b]:CU_K[b + 1]]
        o, lse = ref_attention(q_b, k_b, v_b, seq_slice(mask, mask_form, b, Hq), seq_slice(bias, bias_form, b, Hq),
                               causal=causal, scale=scale)
        os.append(o)
        lses.append(lse)
    return torch.cat(os), torch.cat(lses, dim=1)


def make(form, Hm, gen, *, kind):
    """A packed mask (kind='mask') or bias of `form`: 'row' [Hm, Nq, Lk], 'shared' [Hm, 1, Lk], 'key' [Hm, Nk]."""
    shape = {"row": (Hm, CU_Q[-1], LK), "shared": (Hm, 1, LK), "key": (Hm, CU_K[-1])}[form]
    if kind == "mask":
        return torch.rand(shape, generator=gen, dtype=F64) < 0.75
    return torch.randn(shape, generator=gen, dtype=F64)


def inputs(Hq, Hkv, seed, D=4, Dv=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(CU_Q[-1], Hq, D, generator=gen, dtype=F64)
    k = torch.randn(CU_K[-1], Hkv, D, generator=gen, dtype=F64)
    v = torch.randn(CU_K[-1], Hkv, Dv, generator=gen, dtype=F64)
    return q, k, v, gen


def cu(values):
    return torch.tensor(values, dtype=torch.int32)


FORMS = [("row", "row"), ("key", "key"), ("row", "key"), ("key", "row"), ("shared", "key"), ("row", "shared"),
         (None, "key"), ("row", None)]


@pytest.mark.parametrize("mask_form,bias_form", FORMS)
@pytest.mark.parametrize("heads", ["Hq", "Hkv", "1"])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_matches_per_sequence_reference(mask_form, bias_form, heads, group, causal):
    Hkv = 2
    Hq = Hkv * group
    Hm = {"Hq": Hq, "Hkv": Hkv, "1": 1}[heads]
    q, k, v, gen = inputs(Hq, Hkv, seed=FORMS.index((mask_form, bias_form)) * 16 + group * 4 + len(heads) * 2 + causal)
    mask = None if mask_form is None else make(mask_form, Hm, gen, kind="mask")
    bias = None if bias_form is None else make(bias_form, Hm, gen, kind="bias")
    d_o = torch.randn(CU_Q[-1], Hq, v.shape[-1], generator=gen, dtype=F64)
    scale = 0.7

    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([bias.clone().requires_grad_()] if bias is not None else [])
    o, lse = sa.flash_attention(*leaves[:3], mask=mask, bias=leaves[3] if bias is not None else None, causal=causal,
                                scale=scale, cu_seqlens_q=cu(CU_Q), cu_seqlens_k=cu(CU_K), return_lse=True)
    grads = torch.autograd.grad(o, leaves, d_o)

    ref_leaves = [t.clone().requires_grad_() for t in leaves]
    o_ref, lse_ref = ref_packed(*ref_leaves[:3], mask, mask_form, ref_leaves[3] if bias is not None else None,
                                bias_form, causal=causal, scale=scale)
    ref_grads = torch.autograd.grad(o_ref, ref_leaves, d_o)

    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-10, atol=1e-12)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert g.shape == r.shape, name
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-11, msg=name)
    if bias is not None and bias_form != "key":
        # Column LK - 1 is past every sequence's keys: never read, dbias 0.
        assert torch.all(grads[3][..., LK - 1] == 0)


@pytest.mark.parametrize("mask_form,bias_form", [("row", "row"), ("key", "key"), ("shared", "row")])
def test_packed_equals_sparseattn_batched_per_sequence(mask_form, bias_form):
    Hq, Hkv = 4, 2
    q, k, v, gen = inputs(Hq, Hkv, seed=5)
    mask = make(mask_form, Hkv, gen, kind="mask")
    bias = make(bias_form, 1, gen, kind="bias")
    o = sa.flash_attention(q, k, v, mask=mask, bias=bias, causal=True, cu_seqlens_q=cu(CU_Q), cu_seqlens_k=cu(CU_K))
    for b in range(len(CU_Q) - 1):
        sl = lambda t, form: seq_slice(t, form, b, t.shape[0])[None]  # [1, Hm, T|1, S]: the batched form
        o_b = sa.flash_attention(q[None, CU_Q[b]:CU_Q[b + 1]], k[None, CU_K[b]:CU_K[b + 1]],
                                 v[None, CU_K[b]:CU_K[b + 1]], mask=sl(mask, mask_form).contiguous(),
                                 bias=sl(bias, bias_form).contiguous(), causal=True)
        torch.testing.assert_close(o[CU_Q[b]:CU_Q[b + 1]], o_b[0], rtol=1e-12, atol=1e-13)


def test_worked_example():
    """docs/semantics.md section 8: the packed worked example, both bias forms."""
    q = torch.tensor([[[0.13, -0.13], [0.64, 0.1]], [[-0.54, 0.36], [1.3, 0.95]], [[-0.7, -1.27], [-0.62, 0.04]]],
                     dtype=F64)
    k = torch.tensor([[-2.33, -0.22], [-1.25, -0.73], [-0.54, -0.32], [0.41, 1.04], [-0.13, 1.37]], dtype=F64)[:, None]
    v = torch.tensor([-0.67, 0.35, 0.9, 0.09, -0.74], dtype=F64)[:, None, None]
    mask = torch.ones(1, 3, 3, dtype=torch.bool)
    mask[0, 1, 0] = False
    row_bias = torch.tensor([[[0.3, -0.2, 0], [0.3, -0.2, 0], [1, -1, 99.0]]], dtype=F64, requires_grad=True)
    key_bias = torch.tensor([[0.3, -0.2, 0, 1, -1]], dtype=F64, requires_grad=True)
    kw = dict(mask=mask, scale=1 / math.sqrt(2), cu_seqlens_q=cu([0, 2, 3]), cu_seqlens_k=cu([0, 3, 5]),
              return_lse=True)
    o_expected = torch.tensor([[0.142813, 0.319372], [0.629573, 0.765516], [-0.006434, -0.032469]], dtype=F64)
    lse_expected = torch.tensor([[1.055135, 0.801387, -0.013379], [0.513007, -0.430953, 1.009313]], dtype=F64)
    for bias in (row_bias, key_bias):
        o, lse = sa.flash_attention(q, k, v, bias=bias, **kw)
        torch.testing.assert_close(o[..., 0], o_expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(lse, lse_expected, rtol=0, atol=1e-6)
        o.sum().backward()
    torch.testing.assert_close(row_bias.grad, torch.tensor(
        [[[-0.588891, 0.064397, 0.524494], [0, -0.239062, 0.239062], [0.189628, -0.189628, 0]]], dtype=F64),
        rtol=0, atol=1e-6)
    assert row_bias.grad[0, 1, 0] == 0 and row_bias.grad[0, 2, 2] == 0
    torch.testing.assert_close(key_bias.grad, torch.tensor([[-0.588891, -0.174665, 0.763556, 0.189628, -0.189628]],
                                                           dtype=F64), rtol=0, atol=1e-6)


@pytest.mark.parametrize("bias_form", ["row", "key", "shared"])
def test_gradcheck_tiny(bias_form):
    gen = torch.Generator().manual_seed(3)
    cu_q, cu_k = [0, 2, 3], [0, 3, 4]
    q = torch.randn(3, 2, 2, generator=gen, dtype=F64, requires_grad=True)
    k = torch.randn(4, 1, 2, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(4, 1, 2, generator=gen, dtype=F64, requires_grad=True)
    shape = {"row": (2, 3, 3), "key": (1, 4), "shared": (1, 1, 3)}[bias_form]
    bias = torch.randn(shape, generator=gen, dtype=F64, requires_grad=True)
    mask = torch.ones(1, 3, 3, dtype=torch.bool)
    mask[0, 0, 2] = False

    def fn(q, k, v, bias):
        return sa.flash_attention(q, k, v, mask=mask, bias=bias, causal=True, cu_seqlens_q=cu(cu_q),
                                  cu_seqlens_k=cu(cu_k))

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


def _call(**over):
    q, k, v, gen = inputs(4, 2, seed=11)
    kw = dict(cu_seqlens_q=cu(CU_Q), cu_seqlens_k=cu(CU_K))
    kw.update(over)
    return sa.flash_attention(q, k, v, **kw)


@pytest.mark.parametrize("arg,value,exc,match", [
    ("mask", torch.ones(1, 1, CU_Q[-1], LK, dtype=torch.bool), sa.SparseAttnError, "row form"),
    ("mask", torch.ones(LK, dtype=torch.bool), sa.SparseAttnError, "mask"),
    ("bias", torch.zeros(2, 2, LK, dtype=F64), sa.SparseAttnError, "Nq"),
    ("bias", torch.zeros(3, CU_Q[-1], LK, dtype=F64), sa.SparseAttnError, "bias"),
    ("bias", torch.zeros(2, CU_Q[-1], 4, dtype=F64), sa.SparseAttnError, "longest sequence"),
    ("mask", torch.ones(1, CU_K[-1] + 1, dtype=torch.bool), sa.SparseAttnError, "key form"),
    ("mask", torch.ones(1, CU_K[-1], dtype=F64), sa.SparseAttnDTypeError, "mask"),
    ("bias", torch.zeros(1, CU_K[-1], dtype=torch.float32), sa.SparseAttnDTypeError, "bias"),
])
def test_errors(arg, value, exc, match):
    with pytest.raises(exc, match=match):
        _call(**{arg: value})


def test_lk_equal_to_longest_sequence_is_fine():
    o = _call(bias=torch.zeros(1, 1, 5, dtype=F64))
    torch.testing.assert_close(o, _call())
