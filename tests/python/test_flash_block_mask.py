"""flash_attention's block-sparse masks (dense tile mask, FlexAttention-style lists with full tiles, a
FlexAttention BlockMask) and per-head windows (CPU reference, float64) against a pure-torch implementation that
expands the tile mask to an element mask (docs/semantics.md section 8): batched and packed, GQA groups 1/2/4,
causal and not, decode-shaped calls, gradients (autograd and gradcheck), rows with every tile absent, errors."""

import math

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()

F64 = torch.float64


def ref_attention(q, k, v, keep, *, causal, scale=None, bias=None):
    """One sequence: q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv], keep bool [Hq, T, S] (element mask after
    tiles and windows), bias [Hq, T, S] or None. Returns o [T, Hq, Dv] and lse [Hq, T]."""
    T, Hq, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    G = Hq // Hkv
    scale = 1 / math.sqrt(D) if scale is None else scale
    kk, vv = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    logits = scale * torch.einsum("thd,shd->hts", q, kk)
    if bias is not None:
        logits = logits + bias
    if causal:
        keep = keep & (torch.arange(S)[None, :] <= torch.arange(T)[:, None] + S - T)[None]
    logits = logits.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0
    return torch.einsum("hts,shd->thd", p, vv), lse


def expand_tiles(tiles, T, S, bq, bk):
    """A tile mask [..., nQ, nK] (nQ, nK at least the tile counts) to an element mask [..., T, S]."""
    t = torch.arange(T) // bq
    s = torch.arange(S) // bk
    return tiles[..., t, :][..., :, s]


def tiles_to_lists(tiles):
    """A bool tile mask [..., nQ, nK] to (kv_num_blocks, kv_indices) with maxK = nK, padding of -3."""
    counts = tiles.sum(-1).to(torch.int32)
    nk = tiles.shape[-1]
    order = torch.where(tiles, torch.arange(nk), nk + torch.arange(nk)).argsort(dim=-1).to(torch.int32)
    indices = torch.where(torch.arange(nk) < counts[..., None], order, torch.full_like(order, -3))
    return counts, indices


def head_of(tiles_heads, Hq, Hkv):
    """Query head h -> the tile tensor's head index for a head dimension of Hq, Hkv or 1."""
    if tiles_heads == Hq:
        return lambda h: h
    if tiles_heads == 1:
        return lambda h: 0
    return lambda h: h // (Hq // Hkv)


def ref_batched(q, k, v, tiles, bq, bk, *, causal, bias=None):
    """Batched: tiles [B|1, Hb|1, nQ, nK]; bias [B, Hq, T, S] or None."""
    B, T, Hq, _ = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    hb = head_of(tiles.shape[1], Hq, Hkv)
    outs, lses = [], []
    for b in range(B):
        tb = tiles[0 if tiles.shape[0] == 1 else b]
        keep = torch.stack([expand_tiles(tb[hb(h)], T, S, bq, bk) for h in range(Hq)])
        o, lse = ref_attention(q[b], k[b], v[b], keep, causal=causal, bias=None if bias is None else bias[b])
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def rand(*shape, grad=False):
    return torch.randn(*shape, dtype=F64, requires_grad=grad)


def random_tiles(shape, p=0.6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) < p


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("form", ["dense", "lists"])
@pytest.mark.parametrize("head_dim", ["Hq", "Hkv", "1"])
def test_batched_forward_backward(Hq, Hkv, causal, form, head_dim):
    torch.manual_seed(0)
    B, T, S, D, Dv, bq, bk = 2, 9, 11, 8, 4, 4, 3
    Hb = {"Hq": Hq, "Hkv": Hkv, "1": 1}[head_dim]
    tiles = random_tiles((B, Hb, 3, 4), seed=Hq * 10 + Hkv)
    q, k, v = rand(B, T, Hq, D, grad=True), rand(B, S, Hkv, D, grad=True), rand(B, S, Hkv, Dv, grad=True)
    bias = rand(B, Hq, T, S, grad=True)
    if form == "dense":
        kw = dict(block_mask=tiles)
    else:
        counts, indices = tiles_to_lists(tiles)
        kw = dict(kv_num_blocks=counts, kv_indices=indices)
    o, lse = sa.flash_attention(q, k, v, causal=causal, bias=bias, block_size=(bq, bk), return_lse=True, **kw)
    o_ref, lse_ref = ref_batched(q, k, v, tiles, bq, bk, causal=causal, bias=bias)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref.to(lse.dtype), rtol=1e-10, atol=1e-12)
    d_o = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, bias), d_o)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v, bias), d_o)
    for name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, grads_ref):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_decode_shaped(T, causal):
    torch.manual_seed(1)
    B, S, Hq, Hkv, D, bq, bk = 2, 37, 4, 2, 8, 16, 8
    tiles = random_tiles((1, Hkv, 1, 5), p=0.5, seed=T)
    tiles[..., -1] = True  # the last key tile (the newest keys) exists
    q, k, v = rand(B, T, Hq, D), rand(B, S, Hkv, D), rand(B, S, Hkv, D)
    o, lse = sa.flash_attention(q, k, v, causal=causal, block_mask=tiles, block_size=(bq, bk), return_lse=True)
    o_ref, lse_ref = ref_batched(q, k, v, tiles, bq, bk, causal=causal)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)


@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_packed(Hq, Hkv, causal):
    """Tiles start at each sequence's first query and key: rows are not aligned to multiples of bq."""
    torch.manual_seed(2)
    cu_q = torch.tensor([0, 5, 12, 13], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 15, 20], dtype=torch.int32)
    D, bq, bk = 4, 4, 3
    q, k, v = rand(13, Hq, D, grad=True), rand(20, Hkv, D, grad=True), rand(20, Hkv, D, grad=True)
    tiles = random_tiles((3, Hkv, 2, 3), p=0.7, seed=Hq)
    tiles[0::2, :, :, 2:] = False  # sequences 0 and 2 have 2 key tiles: a list may not name tile 2
    counts, indices = tiles_to_lists(tiles)
    o = sa.flash_attention(q, k, v, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, kv_num_blocks=counts,
                           kv_indices=indices, block_size=(bq, bk))
    refs = []
    for b in range(3):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        T, S = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        keep = torch.stack([expand_tiles(tiles[b, h // (Hq // Hkv)], T, S, bq, bk) for h in range(Hq)])
        refs.append(ref_attention(q[qs], k[ks], v[ks], keep, causal=causal)[0])
    o_ref = torch.cat(refs)
    torch.testing.assert_close(o, o_ref)
    d_o = torch.randn_like(o)
    for got, want in zip(torch.autograd.grad(o, (q, k, v), d_o), torch.autograd.grad(o_ref, (q, k, v), d_o)):
        torch.testing.assert_close(got, want)


def test_worked_example_lists_equal_dense_and_element_mask():
    """docs/semantics.md: T = S = 10, 4 x 4 tiles, causal, tile mask [[1,0,0],[1,1,0],[0,1,1]]."""
    torch.manual_seed(3)
    tiles = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)[None, None]
    counts = torch.tensor([[[1, 2, 2]]], dtype=torch.int32)
    indices = torch.tensor([[[[0, 99, -5], [0, 1, 7], [1, 2, 0]]]], dtype=torch.int32)  # past the count: ignored
    q, k, v = rand(1, 10, 1, 8), rand(1, 10, 1, 8), rand(1, 10, 1, 4)
    element = expand_tiles(tiles, 10, 10, 4, 4)
    o_dense = sa.flash_attention(q, k, v, causal=True, block_mask=tiles, block_size=(4, 4))
    o_lists = sa.flash_attention(q, k, v, causal=True, kv_num_blocks=counts, kv_indices=indices, block_size=(4, 4))
    o_elem = sa.flash_attention(q, k, v, causal=True, mask=element)
    torch.testing.assert_close(o_dense, o_elem, rtol=0, atol=1e-14)
    torch.testing.assert_close(o_lists, o_elem, rtol=0, atol=1e-14)
    torch.testing.assert_close(o_lists[0, 0, 0], v[0, 0, 0])  # query 0 keeps key 0 only


def test_full_tiles_skip_the_element_mask():
    torch.manual_seed(4)
    q, k, v = rand(1, 4, 2, 4), rand(1, 8, 2, 4), rand(1, 8, 2, 4)
    mask = torch.ones(1, 1, 4, 8, dtype=torch.bool)
    mask[..., 1] = False
    mask[..., 6] = False
    one = torch.ones(1, 1, 1, dtype=torch.int32)
    o = sa.flash_attention(q, k, v, mask=mask, kv_num_blocks=one, kv_indices=one[..., None],
                           full_kv_num_blocks=one, full_kv_indices=torch.zeros(1, 1, 1, 1, dtype=torch.int32),
                           block_size=(4, 4))
    keep = torch.ones(2, 4, 8, dtype=torch.bool)
    keep[..., 6] = False  # tile 1 partial: key 6 hidden; tile 0 full: key 1 kept
    torch.testing.assert_close(o[0], ref_attention(q[0], k[0], v[0], keep, causal=False)[0])


def test_rows_with_every_tile_absent():
    q, k, v = rand(1, 6, 2, 4, grad=True), rand(1, 6, 1, 4, grad=True), rand(1, 6, 1, 4, grad=True)
    bias = rand(1, 2, 6, 6, grad=True)
    tiles = torch.tensor([[1, 1], [0, 0], [0, 1]], dtype=torch.bool)[None, None]
    o, lse = sa.flash_attention(q, k, v, bias=bias, block_mask=tiles, block_size=(2, 3), return_lse=True)
    assert torch.all(o[0, 2:4] == 0)
    assert torch.all(lse[0, :, 2:4] == -math.inf)
    dq, dk, dv, dbias = torch.autograd.grad(o.sum(), (q, k, v, bias))
    assert torch.all(dq[0, 2:4] == 0)
    assert torch.all(dbias[0, :, 2:4] == 0)  # absent tiles: dbias written as 0
    assert torch.all(dbias[0, :, 4:, :3] == 0)
    assert torch.all(torch.isfinite(dk)) and torch.all(torch.isfinite(dv))


def test_gradcheck_tiny():
    torch.manual_seed(5)
    q, k, v = rand(1, 3, 2, 2, grad=True), rand(1, 4, 1, 2, grad=True), rand(1, 4, 1, 2, grad=True)
    bias = rand(1, 1, 1, 4, grad=True)
    counts = torch.tensor([[[2, 1]]], dtype=torch.int32)
    indices = torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32)
    left = torch.tensor([1, -1], dtype=torch.int32)
    fn = lambda q, k, v, bias: sa.flash_attention(q, k, v, causal=True, bias=bias, kv_num_blocks=counts,  # noqa: E731
                                                  kv_indices=indices, block_size=(2, 2), window=(left, -1))
    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


def test_flex_attention_block_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    T = S = 40
    B, Hq, Hkv, D = 1, 2, 2, 8

    def sliding_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 12)

    try:
        bm = flex.create_block_mask(sliding_causal, B=None, H=None, Q_LEN=T, KV_LEN=S, device="cpu", BLOCK_SIZE=8)
    except Exception as e:  # noqa: BLE001 - a torch without CPU support for create_block_mask
        pytest.skip(f"create_block_mask on the CPU: {e}")
    torch.manual_seed(6)
    q, k, v = rand(B, T, Hq, D), rand(B, S, Hkv, D), rand(B, S, Hkv, D)
    element = torch.tensor([[sliding_causal(0, 0, t, s) for s in range(S)] for t in range(T)])
    # The BlockMask's partial tiles need the element mask; its full tiles do not read it.
    o = sa.flash_attention(q, k, v, block_mask=bm, mask=element[None, None])
    o_ref = sa.flash_attention(q, k, v, mask=element[None, None])
    torch.testing.assert_close(o, o_ref)
    o_ref2, _ = ref_batched(q, k, v, torch.ones(1, 1, 5, 5, dtype=torch.bool), 8, 8, causal=False,
                            bias=torch.zeros(B, Hq, T, S, dtype=F64).masked_fill(~element, -math.inf))
    torch.testing.assert_close(o, o_ref2)
    with pytest.raises(sa.SparseAttnError, match="block_size"):
        sa.flash_attention(q, k, v, block_mask=bm, block_size=(16, 16))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (4, 1)])
def test_per_head_windows(causal, Hq, Hkv):
    torch.manual_seed(7)
    B, T, S, D = 2, 5, 9, 4
    left = torch.tensor([0, 2, -1, 4], dtype=torch.int32)
    right = torch.tensor([1, -1, 0, 3], dtype=torch.int32)
    q, k, v = rand(B, T, Hq, D, grad=True), rand(B, S, Hkv, D, grad=True), rand(B, S, Hkv, D, grad=True)
    o = sa.flash_attention(q, k, v, causal=causal, window=(left, right))
    a = torch.arange(T)[:, None] + S - T
    s = torch.arange(S)[None, :]
    keep = torch.stack([(s >= a - left[h] if left[h] >= 0 else torch.ones(T, S, dtype=torch.bool)) &
                        (s <= a + right[h] if right[h] >= 0 else torch.ones(T, S, dtype=torch.bool))
                        for h in range(Hq)])
    o_ref = torch.stack([ref_attention(q[b], k[b], v[b], keep, causal=causal)[0] for b in range(B)])
    torch.testing.assert_close(o, o_ref)
    d_o = torch.randn_like(o)
    for got, want in zip(torch.autograd.grad(o, (q, k, v), d_o), torch.autograd.grad(o_ref, (q, k, v), d_o)):
        torch.testing.assert_close(got, want)
    # One side a tensor, the other an int; the spec's example: causal, Tq = 1, Tk = 6, left = [2, -1].
    q1, k1, v1 = rand(1, 1, 2, 4), rand(1, 6, 1, 4), rand(1, 6, 1, 4)
    o1 = sa.flash_attention(q1, k1, v1, causal=True, window=(torch.tensor([2, -1], dtype=torch.int32), 0))
    keep1 = torch.ones(2, 1, 6, dtype=torch.bool)
    keep1[0, 0, :3] = False
    torch.testing.assert_close(o1[0], ref_attention(q1[0], k1[0], v1[0], keep1, causal=True)[0])


def test_compile_fullgraph():
    tiles = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)[None, None]
    left = torch.tensor([1, -1], dtype=torch.int32)

    def f(q, k, v):
        return sa.flash_attention(q, k, v, causal=True, block_mask=tiles, block_size=(4, 4), window=(left, -1))

    q, k, v = rand(1, 8, 2, 4, grad=True), rand(1, 8, 1, 4, grad=True), rand(1, 8, 1, 4, grad=True)
    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    torch.testing.assert_close(compiled, eager)
    compiled.sum().backward()


def _qkv():
    return rand(1, 8, 2, 4), rand(1, 8, 1, 4), rand(1, 8, 1, 4)


I32 = torch.int32
BAD = [
    (dict(block_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool)), sa.SparseAttnError, "block_size"),
    (dict(block_mask=torch.ones(1, 1, 2, 2, dtype=I32), block_size=(4, 4)), sa.SparseAttnDTypeError, "block_mask"),
    (dict(block_mask=torch.ones(1, 1, 1, 2, dtype=torch.bool), block_size=(4, 4)), sa.SparseAttnError, "block_mask"),
    (dict(block_mask=torch.ones(1, 3, 2, 2, dtype=torch.bool), block_size=(4, 4)), sa.SparseAttnError, "block_mask"),
    (dict(block_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool), block_size=(0, 4)), sa.SparseAttnError, "block_size"),
    (dict(block_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool), block_size=4), sa.SparseAttnTypeError, "block_size"),
    (dict(block_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool), kv_num_blocks=torch.ones(1, 1, 2, dtype=I32),
          kv_indices=torch.zeros(1, 1, 2, 1, dtype=I32), block_size=(4, 4)), sa.SparseAttnError, "block_mask"),
    (dict(kv_num_blocks=torch.ones(1, 1, 2), kv_indices=torch.zeros(1, 1, 2, 1, dtype=I32), block_size=(4, 4)),
     sa.SparseAttnDTypeError, "kv_num_blocks"),
    (dict(kv_num_blocks=torch.ones(1, 1, 2, dtype=I32), block_size=(4, 4)), sa.SparseAttnError, "kv_indices"),
    (dict(kv_num_blocks=torch.ones(1, 1, 2, dtype=I32), kv_indices=torch.zeros(1, 1, 3, 1, dtype=I32),
          block_size=(4, 4)), sa.SparseAttnError, "kv_indices"),
    (dict(kv_num_blocks=torch.full((1, 1, 2), 2, dtype=I32), kv_indices=torch.zeros(1, 1, 2, 1, dtype=I32),
          block_size=(4, 4)), sa.SparseAttnError, "kv_num_blocks"),
    (dict(kv_num_blocks=torch.ones(1, 1, 2, dtype=I32), kv_indices=torch.full((1, 1, 2, 1), 2, dtype=I32),
          block_size=(4, 4)), sa.SparseAttnError, "kv_indices"),
    (dict(kv_num_blocks=torch.full((1, 1, 2), 2, dtype=I32), kv_indices=torch.ones(1, 1, 2, 2, dtype=I32),
          block_size=(4, 4)), sa.SparseAttnError, "kv_indices"),
    (dict(kv_num_blocks=torch.ones(1, 1, 2, dtype=I32), kv_indices=torch.zeros(1, 1, 2, 1, dtype=I32),
          full_kv_num_blocks=torch.ones(1, 1, 2, dtype=I32), full_kv_indices=torch.zeros(1, 1, 2, 1, dtype=I32),
          block_size=(4, 4)), sa.SparseAttnError, "full_kv_indices"),
    (dict(window=(torch.zeros(3, dtype=I32), -1)), sa.SparseAttnError, "window_left"),
    (dict(window=(-1, torch.zeros(2))), sa.SparseAttnDTypeError, "window_right"),
    (dict(window=(torch.tensor([0, -2], dtype=I32), -1)), sa.SparseAttnError, "window_left"),
    (dict(block_mask=[[True]], block_size=(4, 4)), sa.SparseAttnTypeError, "block_mask"),
    # A tile larger than any sequence is one tile (the tile count does not overflow).
    (dict(block_mask=torch.ones(1, 1, 0, 0, dtype=torch.bool), block_size=(2**63 - 1, 2**63 - 1)), sa.SparseAttnError,
     "block_mask"),
]


def test_tiles_larger_than_the_sequence_are_one_tile():
    q, k, v = _qkv()
    one = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    o = sa.flash_attention(q, k, v, causal=True, block_mask=one, block_size=(2**63 - 1, 2**63 - 1))
    torch.testing.assert_close(o, sa.flash_attention(q, k, v, causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("kw,exc,arg", BAD)
def test_invalid_arguments(kw, exc, arg):
    q, k, v = _qkv()
    with pytest.raises(exc, match=f"'{arg}'"):
        sa.flash_attention(q, k, v, **kw)


def test_meta_tensors_rejected_next_to_cpu():
    q, k, v = _qkv()
    with pytest.raises(sa.SparseAttnError, match="block_mask"):
        sa.flash_attention(q, k, v, block_mask=torch.ones(1, 1, 2, 2, dtype=torch.bool, device="meta"),
                           block_size=(4, 4))
