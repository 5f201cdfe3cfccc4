"""create_mask (CPU): the worked example of docs/semantics.md, random shapes against a pure-torch top-k, decode
shapes, use with flash_attention, validation errors, custom-op registration and torch.compile."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import raises_arg, require_sparseattn

sa = require_sparseattn()

NAN = float("nan")
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


def torch_create_mask(bias, keep, causal=False, key_padding_mask=None, window=(-1, -1)):
    """Pure torch: the keep largest visible biases per row; ties to the lower index (stable sorts), NaN never kept."""
    B, H, T, S = bias.shape
    values = bias.double()
    t = torch.arange(T)[:, None]
    s = torch.arange(S)[None, :]
    aligned = t + S - T
    visible = torch.ones(T, S, dtype=torch.bool)
    if causal:
        visible &= s <= aligned
    if window[0] >= 0:
        visible &= s >= aligned - window[0]
    if window[1] >= 0:
        visible &= s <= aligned + window[1]
    visible = visible.expand(B, H, T, S).clone()
    if key_padding_mask is not None:
        visible &= key_padding_mask[:, None, None, :]
    visible &= ~torch.isnan(values)
    # Order: visible first, then larger value, then lower index (two stable sorts, the minor key first).
    key = torch.where(visible, values, torch.full_like(values, -math.inf))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    by_visible = torch.sort(visible.gather(-1, order).to(torch.int8), dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, by_visible)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(S).expand_as(order).contiguous())
    return visible & (rank < keep)


def topk_create_mask(bias, keep, causal=False, key_padding_mask=None):
    """A second oracle on distinct values: torch.topk over the masked bias (-inf where not visible)."""
    B, H, T, S = bias.shape
    visible = torch.ones(T, S, dtype=torch.bool)
    if causal:
        visible = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    visible = visible.expand(B, H, T, S).clone()
    if key_padding_mask is not None:
        visible &= key_padding_mask[:, None, None, :]
    masked = bias.double().masked_fill(~visible, -math.inf)
    out = torch.zeros(B, H, T, S, dtype=torch.bool)
    if S > 0:
        idx = masked.topk(min(keep, S), dim=-1).indices
        out.scatter_(-1, idx, True)
    return out & visible


# ---------------------------------------------------------------------------------------------- semantics


EXAMPLE_BIAS = [[[[0.5, 2.0, 1.0, 3.0, -1.0],
                  [2.0, 9.0, 1.0, 1.0, 5.0],
                  [NAN, 4.0, 0.3, -0.5, 0.7]]]]
EXAMPLE_PADDING = [[True, False, True, True, True]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_semantics_example(dtype):
    """The numbers of docs/semantics.md, "### create_mask"."""
    bias = torch.tensor(EXAMPLE_BIAS, dtype=dtype)
    pad = torch.tensor(EXAMPLE_PADDING)
    T, F = 1, 0
    cases = [
        (dict(keep=2, causal=True, key_padding_mask=pad), [[T, F, T, F, F], [T, F, T, F, F], [F, F, T, F, T]]),
        (dict(keep=2, key_padding_mask=pad), [[F, F, T, T, F], [T, F, F, F, T], [F, F, T, F, T]]),
        (dict(keep=9, causal=True, key_padding_mask=pad), [[T, F, T, F, F], [T, F, T, T, F], [F, F, T, T, T]]),
    ]
    for kwargs, expected in cases:
        got = sa.create_mask(bias, **kwargs)
        assert got.dtype == torch.bool and got.shape == bias.shape
        assert got[0, 0].int().tolist() == expected, kwargs
        keep = kwargs.pop("keep")
        assert torch_create_mask(bias, keep, **kwargs)[0, 0].int().tolist() == expected, kwargs


def test_ties_infinities_and_empty_rows():
    inf = math.inf
    bias = torch.tensor([[[[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 2.0], [-inf, NAN, 0.0, inf], [NAN] * 4]]])
    assert sa.create_mask(bias, 2).int().tolist() == [[[[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]]]]
    assert sa.create_mask(bias, 3).int().tolist() == [[[[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 1], [0, 0, 0, 0]]]]
    # More queries than keys with causal: the first T - S rows see nothing.
    square = torch.zeros(1, 1, 4, 2)
    assert sa.create_mask(square, 1, causal=True).int().tolist() == [[[[0, 0], [0, 0], [1, 0], [1, 0]]]]
    # A fully padded sequence.
    pad = torch.tensor([[False, False], [True, False]])
    assert sa.create_mask(torch.zeros(2, 1, 1, 2), 2, key_padding_mask=pad).int().tolist() == [[[[0, 0]]], [[[1, 0]]]]


# ---------------------------------------------------------------------------------------- against torch


def _random_case(gen, dtype):
    B, H = int(torch.randint(1, 3, (1,), generator=gen)), int(torch.randint(1, 4, (1,), generator=gen))
    T, S = int(torch.randint(1, 20, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
    bias = torch.randn(B, H, T, S, generator=gen, dtype=torch.float64)
    if dtype in (torch.float16, torch.bfloat16):  # low precision: many ties
        bias = bias.to(dtype)
    else:
        bias = (bias * 2).round().to(dtype)  # integers in a small range: ties for sure
    if bool(torch.rand(1, generator=gen) < 0.3):
        bias[torch.rand(bias.shape, generator=gen) < 0.1] = NAN
    pad = None
    if bool(torch.rand(1, generator=gen) < 0.5):
        pad = torch.rand(B, S, generator=gen) < 0.8
    keep = int(torch.randint(1, S + 3, (1,), generator=gen))
    causal = bool(torch.rand(1, generator=gen) < 0.5)
    window = (-1, -1)
    if bool(torch.rand(1, generator=gen) < 0.4):
        window = (int(torch.randint(-1, 8, (1,), generator=gen)), int(torch.randint(-1, 8, (1,), generator=gen)))
    return bias, keep, causal, pad, window


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_against_torch(dtype):
    gen = torch.Generator().manual_seed(1234 + DTYPES.index(dtype))
    for _ in range(60):
        bias, keep, causal, pad, window = _random_case(gen, dtype)
        got = sa.create_mask(bias, keep, causal=causal, key_padding_mask=pad, window=window)
        ref = torch_create_mask(bias, keep, causal, pad, window)
        assert torch.equal(got, ref), (tuple(bias.shape), keep, causal, window)
        # Each row keeps min(keep, visible) keys.
        assert bool((got.sum(-1) <= keep).all())


def test_distinct_values_against_topk():
    for T, S, causal in [(7, 7, True), (3, 11, True), (5, 5, False), (1, 300, True)]:
        bias = torch.randn(2, 3, T, S, dtype=torch.float64)
        pad = torch.rand(2, S) < 0.7
        for keep in (1, 4, S):
            got = sa.create_mask(bias, keep, causal=causal, key_padding_mask=pad)
            assert torch.equal(got, topk_create_mask(bias, keep, causal, pad)), (T, S, causal, keep)


@pytest.mark.parametrize("causal", [False, True])
def test_decode_shape(causal):
    """Tq = 1 against Tk = 300 (bottom-right aligned: the one query sees every key)."""
    bias = torch.randn(4, 2, 1, 300, dtype=torch.bfloat16)
    pad = torch.ones(4, 300, dtype=torch.bool)
    pad[1, 250:] = False
    got = sa.create_mask(bias, 64, causal=causal, key_padding_mask=pad)
    assert torch.equal(got, torch_create_mask(bias, 64, causal, pad))
    assert got.sum(-1).tolist() == [[[64]] * 2] * 4
    assert not bool(got[1, :, :, 250:].any())


def test_strided_and_expanded_bias():
    key_bias = torch.randn(2, 3, 1, 17)
    expanded = key_bias.expand(2, 3, 9, 17)  # stride 0 over the rows: no copy
    got = sa.create_mask(expanded, 5, causal=True)
    assert torch.equal(got, sa.create_mask(expanded.contiguous(), 5, causal=True))
    wide = torch.randn(2, 3, 9, 34)
    noncontig = wide[..., ::2]
    assert torch.equal(sa.create_mask(noncontig, 4), torch_create_mask(noncontig, 4))
    assert sa.create_mask(torch.zeros(0, 2, 3, 4), 2).shape == (0, 2, 3, 4)
    assert sa.create_mask(torch.zeros(1, 2, 3, 0), 2).shape == (1, 2, 3, 0)


def test_no_gradient():
    bias = torch.randn(1, 2, 4, 6, requires_grad=True)
    m = sa.create_mask(bias, 2)
    assert not m.requires_grad and m.grad_fn is None


# ------------------------------------------------------------------------------------------ flash_attention


def test_feeds_flash_attention():
    """flash_attention(q, k, v, mask=create_mask(bias, ...), bias=bias) equals attention over the kept keys."""
    B, T, S, Hq, Hkv, D = 2, 6, 10, 4, 2, 8
    q = torch.randn(B, T, Hq, D, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, D, dtype=torch.float64)
    bias = torch.randn(B, Hkv, T, S, dtype=torch.float64, requires_grad=True)
    pad = torch.ones(B, S, dtype=torch.bool)
    pad[1, 7:] = False
    mask = sa.create_mask(bias, 3, causal=True, key_padding_mask=pad)
    o = sa.flash_attention(q, k, v, causal=True, mask=mask, bias=bias)
    # Naive attention over the kept keys (the mask already applies causal and padding).
    G = Hq // Hkv
    kk, vv = k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, kk) / math.sqrt(D) + bias.repeat_interleave(G, dim=1)
    s = s.masked_fill(~mask.repeat_interleave(G, dim=1), -math.inf)
    ref = torch.einsum("bhts,bshd->bthd", torch.softmax(s, dim=-1), vv)
    torch.testing.assert_close(o, ref, rtol=1e-10, atol=1e-10)
    o.sum().backward()  # the bias gradient flows through attention, not through the mask
    assert bias.grad is not None and bool(torch.isfinite(bias.grad).all())


# --------------------------------------------------------------------------------------------- validation


def _bias():
    return torch.randn(2, 3, 4, 5)


@pytest.mark.parametrize("what, call, exc, arg", [
    ("int bias", lambda: sa.create_mask(torch.ones(2, 3, 4, 5, dtype=torch.int32), 2), sa.SparseAttnDTypeError, "bias"),
    ("int64 bias", lambda: sa.create_mask(torch.ones(2, 3, 4, 5, dtype=torch.int64), 2), sa.SparseAttnDTypeError,
     "bias"),
    ("rank 3", lambda: sa.create_mask(torch.randn(3, 4, 5), 2), sa.SparseAttnError, "bias"),
    ("rank 5", lambda: sa.create_mask(torch.randn(1, 2, 3, 4, 5), 2), sa.SparseAttnError, "bias"),
    ("bias list", lambda: sa.create_mask([[1.0]], 2), sa.SparseAttnTypeError, "bias"),
    ("keep 0", lambda: sa.create_mask(_bias(), 0), sa.SparseAttnError, "keep"),
    ("keep -1", lambda: sa.create_mask(_bias(), -1), sa.SparseAttnError, "keep"),
    ("keep 2**31", lambda: sa.create_mask(_bias(), 2**31), sa.SparseAttnError, "keep"),
    ("keep float", lambda: sa.create_mask(_bias(), 2.0), sa.SparseAttnTypeError, "keep"),
    ("keep bool", lambda: sa.create_mask(_bias(), True), sa.SparseAttnTypeError, "keep"),
    ("causal int", lambda: sa.create_mask(_bias(), 2, causal=1), sa.SparseAttnTypeError, "causal"),
    ("window int", lambda: sa.create_mask(_bias(), 2, window=3), sa.SparseAttnTypeError, "window"),
    ("padding float", lambda: sa.create_mask(_bias(), 2, key_padding_mask=torch.ones(2, 5)), sa.SparseAttnDTypeError,
     "key_padding_mask"),
    ("padding batch", lambda: sa.create_mask(_bias(), 2, key_padding_mask=torch.ones(1, 5, dtype=torch.bool)),
     sa.SparseAttnError, "key_padding_mask"),
    ("padding keys", lambda: sa.create_mask(_bias(), 2, key_padding_mask=torch.ones(2, 4, dtype=torch.bool)),
     sa.SparseAttnError, "key_padding_mask"),
    ("padding rank", lambda: sa.create_mask(_bias(), 2, key_padding_mask=torch.ones(2, 1, 5, dtype=torch.bool)),
     sa.SparseAttnError, "key_padding_mask"),
    ("padding meta", lambda: sa.create_mask(_bias(), 2, key_padding_mask=torch.ones(2, 5, dtype=torch.bool,
                                                                                   device="meta")),
     sa.SparseAttnError, "key_padding_mask"),
])
def test_validation(what, call, exc, arg):
    with raises_arg(exc, arg) as info:
        call()
    assert str(info.value).startswith(f"sparseattn.create_mask: argument '{arg}': "), str(info.value)


def test_binding_validates_too():
    """The C++ API's own checks, reached through the binding without the Python layer's."""
    from sparseattn import _C

    bias = torch.randn(2, 3, 4, 5)
    with raises_arg(sa.SparseAttnError, "keep") as info:
        _C.create_mask(bias, None, torch.empty(2, 3, 4, 5, dtype=torch.bool), 0, False, -1, -1, 0)
    assert info.value.kind == "config"
    with raises_arg(sa.SparseAttnError, "mask"):
        _C.create_mask(bias, None, torch.empty(2, 3, 4, 4, dtype=torch.bool), 1, False, -1, -1, 0)
    with raises_arg(sa.SparseAttnDTypeError, "mask"):
        _C.create_mask(bias, None, torch.empty(2, 3, 4, 5), 1, False, -1, -1, 0)


@pytest.mark.gpu
def test_cuda_at_the_cpp_api_is_unsupported():
    # sparseattn.create_mask takes CUDA tensors through torch's sorts (test_create_mask_sorting.py); the C++ API
    # has no CUDA kernel of it.
    bias = torch.randn(1, 1, 2, 3, device="cuda")
    with raises_arg(sa.SparseAttnUnsupportedError, "bias") as info:
        sa._C.create_mask(bias, None, torch.empty(1, 1, 2, 3, dtype=torch.bool, device="cuda"), 1, False, -1, -1, 0)
    assert "use CPU tensors" in str(info.value)


# ------------------------------------------------------------------------------------ custom op and compile


def test_opcheck():
    bias = torch.randn(2, 3, 5, 7)
    pad = torch.rand(2, 7) < 0.8
    op = torch.ops.sparseattn.create_mask.default
    torch.library.opcheck(op, (bias, pad, 3, True, -1, -1))
    torch.library.opcheck(op, (bias.to(torch.bfloat16), None, 2, False, 2, 0))


def test_compile_fullgraph():
    torch.compiler.reset()
    try:
        def fn(q, k, v, bias, pad):
            mask = sa.create_mask(bias, 3, causal=True, key_padding_mask=pad)
            return sa.flash_attention(q, k, v, causal=True, mask=mask, bias=bias) * 2.0, mask

        q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 9, 1, 8), torch.randn(1, 9, 1, 8)
        bias = torch.randn(1, 1, 6, 9)
        pad = torch.rand(1, 9) < 0.8
        o_e, m_e = fn(q, k, v, bias, pad)
        o_c, m_c = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, bias, pad)
        assert torch.equal(m_c, m_e)
        torch.testing.assert_close(o_c, o_e)
    finally:
        torch.compiler.reset()
