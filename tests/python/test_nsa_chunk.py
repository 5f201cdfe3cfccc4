"""NSA over a query chunk on the CPU (docs/semantics.md section 11): T queries against S >= T keys, query t at key
position t + S - T. A chunk gives the full call's (T = S) rows at those positions, and the gradients of the full
call whose output gradient is zero on the other rows; batched and packed, every NSA function and the modules."""

from __future__ import annotations

import pytest
import torch

from helpers import cu_seqlens_of, gates, randn, raises_arg, require_sparseattn

sa = require_sparseattn()

CFG = dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, num_init=1, num_local=1, window=6)


def _shapes(seed):
    """(batched S, T) and (packed per-sequence S_b, T_b) cases: one query, all of them, random in between, S not
    a multiple of any block; packed batches mix them with empty sequences and sequences without queries."""
    g = torch.Generator().manual_seed(seed)
    s = int(torch.randint(1, 70, (1,), generator=g))
    batched = [(s, 1), (s, s), (s, int(torch.randint(1, s + 1, (1,), generator=g)))]
    keys = [int(x) for x in torch.randint(1, 60, (4,), generator=g)] + [0]
    counts = [1, keys[1], 0, int(torch.randint(0, keys[3] + 1, (1,), generator=g)), 0]
    return batched, (keys, counts)


def _packed_rows(keys, counts):
    """The full problem's rows (a query per key) that the chunk's queries come from."""
    rows, start = [], 0
    for s, t in zip(keys, counts):
        rows += list(range(start + s - t, start + s))
        start += s
    return torch.tensor(rows, dtype=torch.int64)


def _cases(seed):
    """(name, full kwargs, chunk kwargs, pick) for the batched and packed cases: `pick(x)` takes the chunk's rows
    of a full token tensor."""
    batched, (keys, counts) = _shapes(seed)
    for s, t in batched:
        yield f"batched S={s} T={t}", {}, {}, (lambda x, t=t: x[:, x.shape[1] - t:]), (2, s)
    rows = _packed_rows(keys, counts)
    cu_k, cu_q = cu_seqlens_of(keys), cu_seqlens_of(counts)
    yield (f"packed S_b={keys} T_b={counts}", {"cu_seqlens": cu_k}, {"cu_seqlens": cu_q, "cu_seqlens_k": cu_k},
           (lambda x: x[rows]), (sum(keys),))


def _leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nsa_attention_chunk_rows_and_gradients(seed):
    torch.manual_seed(seed)
    cfg = sa.NSAConfig(**CFG)
    for name, full_kw, chunk_kw, pick, lead in _cases(seed):
        q, g_cmp, g_slc, g_swa = randn(*lead, 4, 8), gates(*lead, 4), gates(*lead, 4), gates(*lead, 4)
        k, v = randn(*lead, 2, 8), randn(*lead, 2, 5)
        q1, k1, v1, gc1, gs1, gw1 = _leaves(q, k, v, g_cmp, g_slc, g_swa)
        o = sa.nsa_attention(q1, k1, v1, gc1, gs1, gw1, config=cfg, **full_kw)
        q2, k2, v2, gc2, gs2, gw2 = _leaves(pick(q), k, v, pick(g_cmp), pick(g_slc), pick(g_swa))
        o_chunk = sa.nsa_attention(q2, k2, v2, gc2, gs2, gw2, config=cfg, **chunk_kw)
        assert torch.equal(o_chunk, pick(o)), name
        w = torch.randn_like(o_chunk)
        full_w = torch.zeros_like(o)
        if "cu_seqlens" in full_kw:
            full_w[_packed_rows(*_shapes(seed)[1])] = w
        else:
            full_w[:, o.shape[1] - o_chunk.shape[1]:] = w
        (o * full_w).sum().backward()
        (o_chunk * w).sum().backward()
        for got, ref, what in ((q2.grad, pick(q1.grad), "dq"), (k2.grad, k1.grad, "dk"), (v2.grad, v1.grad, "dv"),
                               (gc2.grad, pick(gc1.grad), "d_g_cmp"), (gs2.grad, pick(gs1.grad), "d_g_slc"),
                               (gw2.grad, pick(gw1.grad), "d_g_swa")):
            torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12, msg=f"{name}: {what}")
        assert torch.count_nonzero(q1.grad) == torch.count_nonzero(pick(q1.grad)), f"{name}: dq outside the chunk"


@pytest.mark.parametrize("seed", [3, 4])
def test_step_functions_chunk(seed):
    """compressed_attention, select_blocks and selected_attention on their own."""
    torch.manual_seed(seed)
    for name, full_kw, chunk_kw, pick, lead in _cases(seed):
        packed = "cu_seqlens" in full_kw
        q, k, v = randn(*lead, 4, 8), randn(*lead, 2, 8), randn(*lead, 2, 8)
        kc, vc = sa.compress_kv(k, v, block=8, stride=4, cu_seqlens=full_kw.get("cu_seqlens"))
        batched_keys = {} if packed else {"seqlen_k": lead[1]}
        o, lse = sa.compressed_attention(q, kc, vc, block=8, stride=4, **full_kw)
        o_chunk, lse_chunk = sa.compressed_attention(pick(q), kc, vc, block=8, stride=4, **chunk_kw, **batched_keys)
        pick_lse = (lambda x: pick(x.transpose(0, 1)).transpose(0, 1)) if packed else (
            lambda x: x[..., x.shape[-1] - o_chunk.shape[1]:])
        assert torch.equal(o_chunk, pick(o)) and torch.equal(lse_chunk, pick_lse(lse)), name
        sel = dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=4, num_init=1, num_local=2)
        idx = sa.select_blocks(q, kc, lse, **sel, **full_kw)
        idx_chunk = sa.select_blocks(pick(q), kc, lse_chunk, **sel, **chunk_kw, **batched_keys)
        assert torch.equal(idx_chunk, pick(idx)), name
        q1, k1, v1 = _leaves(q, k, v)
        o, _ = sa.selected_attention(q1, k1, v1, idx, block=16, **full_kw)
        q2, k2, v2 = _leaves(pick(q), k, v)
        o_chunk, _ = sa.selected_attention(q2, k2, v2, idx_chunk, block=16, **chunk_kw)
        assert torch.equal(o_chunk, pick(o)), name
        w = torch.randn_like(o_chunk)
        pick(o).mul(w).sum().backward()
        o_chunk.mul(w).sum().backward()
        for got, ref, what in ((q2.grad, pick(q1.grad), "dq"), (k2.grad, k1.grad, "dk"), (v2.grad, v1.grad, "dv")):
            torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12, msg=f"{name}: {what}")


def test_user_compressed_kv_and_indices_follow_the_keys():
    torch.manual_seed(5)
    cfg = sa.NSAConfig(**CFG)
    q, k, v = randn(1, 45, 4, 8), randn(1, 45, 2, 8), randn(1, 45, 2, 8)
    g = gates(1, 45, 4)
    kc, vc = (x.detach().requires_grad_(True) for x in sa.compress_kv(k, v, block=8, stride=4))
    idx = sa.select_blocks(q, kc.detach(), sa.compressed_attention(q, kc.detach(), vc.detach(), block=8, stride=4)[1],
                           cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, num_init=1, num_local=1)
    o = sa.nsa_attention(q, k, v, g, g, None, config=cfg, k_cmp=kc, v_cmp=vc, block_indices=idx)
    kc2, vc2 = (x.detach().requires_grad_(True) for x in (kc, vc))
    o7 = sa.nsa_attention(q[:, -7:], k, v, g[:, -7:], g[:, -7:], None, config=cfg, k_cmp=kc2, v_cmp=vc2,
                          block_indices=idx[:, -7:])
    assert torch.equal(o7, o[:, -7:])
    o[:, -7:].sum().backward()
    o7.sum().backward()
    torch.testing.assert_close(kc2.grad, kc.grad, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(vc2.grad, vc.grad, atol=1e-12, rtol=1e-12)


def test_modules_take_longer_keys_and_a_kv_cache():
    torch.manual_seed(6)
    cfg = sa.NSAConfig(**CFG)
    core = sa.NativeSparseAttentionCore(cfg)
    q, k, v, g = randn(2, 30, 4, 8), randn(2, 30, 2, 8), randn(2, 30, 2, 8), gates(2, 30, 4)
    assert torch.equal(core(q[:, 20:], k, v, g[:, 20:], None, g[:, 20:]), core(q, k, v, g, None, g)[:, 20:])
    layer = sa.NativeSparseAttention(32, num_heads=4, num_kv_heads=2, head_dim=8, config=cfg, dtype=torch.float64)
    x = randn(2, 30, 32)
    full = layer(x)
    cache = (randn(2, 0, 2, 8), randn(2, 0, 2, 8))
    outs = []
    for start, end in ((0, 13), (13, 14), (14, 30)):  # prefill, one decoding step, another chunk
        out, cache = layer(x[:, start:end], kv_cache=cache)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-12, rtol=1e-12)
    assert cache[0].shape == (2, 30, 2, 8)
    # Packed: sequences of 12 and 18 tokens, cached up to 5 and 18 (the second one is decoded no further).
    lengths, cached = [12, 18], [5, 18]
    xp = torch.cat([x[0, :12], x[1, :18]])
    cu = cu_seqlens_of(lengths)
    full_p = layer(xp, cu_seqlens=cu)
    _, cache_p = layer(torch.cat([x[0, :5], x[1, :18]]), cu_seqlens=cu_seqlens_of(cached),
                       kv_cache=(randn(0, 2, 8), randn(0, 2, 8)), cu_seqlens_cache=cu_seqlens_of([0, 0]))
    rest, cache_p = layer(x[0, 5:12], cu_seqlens=cu_seqlens_of([7, 0]), kv_cache=cache_p,
                          cu_seqlens_cache=cu_seqlens_of(cached))
    torch.testing.assert_close(rest, full_p[5:12], atol=1e-12, rtol=1e-12)
    assert cache_p[0].shape == (30, 2, 8)
    with raises_arg(sa.SparseAttnError, "cu_seqlens_cache"):
        layer(x[:, :3], kv_cache=cache, cu_seqlens_cache=cu)
    with raises_arg(sa.SparseAttnError, "kv_cache[0]"):
        layer(x[:, :3], kv_cache=(randn(1, 4, 2, 8), randn(1, 4, 2, 8)))


def test_chunk_errors_name_the_argument():
    cfg = sa.NSAConfig(**CFG)
    q, g = randn(1, 10, 4, 8), gates(1, 10, 4)
    k, v = randn(1, 9, 2, 8), randn(1, 9, 2, 8)
    with raises_arg(sa.SparseAttnError, "k"):  # S = 9 < T = 10
        sa.nsa_attention(q, k, v, g, g, g, config=cfg)
    kc, vc = sa.compress_kv(k, v, block=8, stride=4)
    with raises_arg(sa.SparseAttnError, "seqlen_k"):
        sa.compressed_attention(q, kc, vc, block=8, stride=4, seqlen_k=9)
    qp, kp, vp, gp = randn(6, 4, 8), randn(9, 2, 8), randn(9, 2, 8), gates(6, 4)
    cu_q, cu_k = cu_seqlens_of([2, 4]), cu_seqlens_of([6, 3])  # sequence 1: 3 keys, 4 queries
    with raises_arg(sa.SparseAttnError, "cu_seqlens_k"):
        sa.nsa_attention(qp, kp, vp, gp, gp, gp, config=cfg, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    with raises_arg(sa.SparseAttnError, "cu_seqlens_k"):  # keys' sequences without the packed layout
        sa.selected_attention(q, q[:, :, :2], q[:, :, :2], torch.zeros(1, 10, 2, 1, dtype=torch.int32), block=16,
                              cu_seqlens_k=cu_k)
    with raises_arg(sa.SparseAttnError, "cu_seqlens_k"):
        sa.selected_attention(qp, kp, vp, torch.zeros(6, 2, 1, dtype=torch.int32), block=16, cu_seqlens=cu_q,
                              cu_seqlens_k=cu_seqlens_of([6]))
    with raises_arg(sa.SparseAttnTypeError, "seqlen_k"):
        sa.select_blocks(q, kc, randn(1, 4, 10, dtype=torch.float32), seqlen_k=9.5)


def test_chunk_opcheck():
    """torch.library.opcheck of the NSA ops with the chunk arguments (schema, fake impls, autograd)."""
    torch.manual_seed(7)
    cu_q, cu_k = cu_seqlens_of([1, 5]), cu_seqlens_of([20, 17])
    q = randn(6, 4, 8, requires_grad=True)
    k, v = randn(37, 2, 8, requires_grad=True), randn(37, 2, 8, requires_grad=True)
    gs = [gates(6, 4, requires_grad=True) for _ in range(3)]
    cu_cmp = sa.compressed_cu_seqlens(cu_k, 8, 4)
    config = tuple(CFG[name] for name in ("cmp_block", "cmp_stride", "sel_block", "num_selected", "num_init",
                                          "num_local", "window")) + (None,)
    torch.library.opcheck(torch.ops.sparseattn.nsa_attention.default,
                          (q, k, v, None, None, None, *gs, cu_q, cu_cmp, 0, *config, cu_k, 0))
    kc, vc = sa.compress_kv(k.detach(), v.detach(), block=8, stride=4, cu_seqlens=cu_k)
    kc.requires_grad_(True)
    torch.library.opcheck(torch.ops.sparseattn.compressed_attention.default,
                          (q, kc, vc, cu_q, cu_cmp, 0, 8, 4, None, cu_k, 0))
    qb, kb, vb = randn(1, 3, 4, 8, requires_grad=True), randn(1, 40, 2, 8), randn(1, 40, 2, 8, requires_grad=True)
    idx = torch.tensor([0, 2, -1], dtype=torch.int32).expand(1, 3, 2, 3).contiguous()
    torch.library.opcheck(torch.ops.sparseattn.selected_attention.default,
                          (qb, kb, vb, idx, None, 0, 16, None, None, 0))
