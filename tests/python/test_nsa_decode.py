"""nsa_decode on the CPU: the rows of nsa_attention over each sequence's gathered keys (docs/semantics.md section
12), checked against nsa_attention on contiguous K/V of the full sequence (the chunk's rows of the full call),
with shuffled page tables, lengths that differ within a batch, shared prefix pages, each branch alone, compressed
rows from the cache's own pooling (NSAPagedKVCache), and the bad inputs refused before any work."""
import pytest
import torch

import sparseattn
from nsa_decode_check import call, chunk_reference, paged_case, rows
from sparseattn.cache import NSAPagedKVCache

SMALL = sparseattn.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, num_init=1, num_local=1,
                             window=20)


@pytest.mark.parametrize("Tq", [1, 3, 16])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (4, 1), (6, 2)])
def test_matches_the_full_forward_rows(Tq, Hq, Hkv):
    g = torch.Generator().manual_seed(100 * Tq + Hq)
    lengths = [Tq, 37, 64, 97][: 3] + [max(Tq, 130)]
    case = paged_case(lengths, Tq, Hq, Hkv, 8, 8, 16, SMALL, torch.float64, g, shared_prefix=0)
    o, idx = call(case, SMALL, return_block_indices=True)
    # The definition: nsa_attention on each sequence's contiguous keys, full sequence (T = S), last Tq rows.
    for b, L in enumerate(lengths):
        qf = torch.randn(1, L, Hq, 8, dtype=torch.float64, generator=g)
        qf[0, L - Tq:] = case["q"][b]
        gf = [torch.rand(1, L, Hq, dtype=torch.float64, generator=g) for _ in range(3)]
        for i in range(3):
            gf[i][0, L - Tq:] = case["gates"][i][b]
        full = sparseattn.nsa_attention(qf, case["ks"][b][None], case["vs"][b][None], *gf, config=SMALL)
        torch.testing.assert_close(o[b], full[0, L - Tq:], rtol=1e-10, atol=1e-10)
        assert (idx[b] >= -1).all() and (idx[b] < -(-L // SMALL.sel_block)).all()


def test_varlen_batch_with_shared_prefix_and_each_branch():
    g = torch.Generator().manual_seed(7)
    lengths = [200, 75, 131, 48]
    case = paged_case(lengths, 2, 4, 2, 16, 8, 32, SMALL, torch.float32, g, shared_prefix=64)
    # The shared pages really are shared: the first two table entries agree.
    assert (case["block_table"][:, :2] == case["block_table"][0, :2]).all()
    for branches in [(True, True, True), (True, False, False), (False, True, False), (False, False, True),
                     (True, False, True)]:
        o = call(case, SMALL, branches)
        ref = chunk_reference(case, SMALL, branches, dtype=torch.float32)
        torch.testing.assert_close(o, ref, rtol=0, atol=0)


def test_paged_cache_keeps_the_compressed_rows():
    g = torch.Generator().manual_seed(3)
    cfg = SMALL
    cache = NSAPagedKVCache(num_pages=40, page_size=16, num_kv_heads=2, head_dim=8, max_pages_per_seq=12,
                            config=cfg, max_seqs=4, dtype=torch.float64)
    a = cache.add_sequence()
    k = torch.randn(1, 90, 2, 8, dtype=torch.float64, generator=g)
    v = torch.randn(1, 90, 2, 8, dtype=torch.float64, generator=g)
    cache.append([a], k[:, :50], v[:, :50])
    b = cache.fork(a)                                       # shares a's 50 tokens (3 full pages + a partial one)
    cache.append([a], k[:, 50:70], v[:, 50:70])
    kb = torch.randn(1, 30, 2, 8, dtype=torch.float64, generator=g)
    cache.append([b], kb, kb.flip(1))
    for _ in range(5):                                      # decode steps, one token each
        step = torch.randn(2, 1, 2, 8, dtype=torch.float64, generator=g)
        cache.append([a, b], step, step * 2)
        q = torch.randn(2, 1, 4, 8, dtype=torch.float64, generator=g)
        gates = [torch.rand(2, 1, 4, dtype=torch.float64, generator=g) for _ in range(3)]
        o = cache.nsa_decode(q, [a, b], g_cmp=gates[0], g_slc=gates[1], g_swa=gates[2])
        for row, seq in enumerate([a, b]):
            ks, vs = cache.gather(seq)
            assert cache.compressed_rows(seq) == rows(ks.shape[0], cfg)
            # No k_cmp: nsa_attention pools the gathered keys itself.
            ref = sparseattn.nsa_attention(q[row: row + 1], ks[None], vs[None], *(t[row: row + 1] for t in gates),
                                           config=cfg)
            torch.testing.assert_close(o[row: row + 1], ref, rtol=1e-12, atol=1e-12)


def test_sequences_shorter_than_a_compressed_block():
    g = torch.Generator().manual_seed(11)
    case = paged_case([1, 5, 8], 1, 2, 1, 8, 8, 16, SMALL, torch.float64, g)
    o = call(case, SMALL)
    torch.testing.assert_close(o, chunk_reference(case, SMALL), rtol=0, atol=0)


def _bad(case, **changes):
    args = dict(block_table=case["block_table"], cache_seqlens=case["cache_seqlens"], k_cmp=case["k_cmp"],
                v_cmp=case["v_cmp"], g_cmp=case["gates"][0], g_slc=case["gates"][1], g_swa=case["gates"][2],
                config=SMALL)
    q, kp, vp = changes.pop("q", case["q"]), changes.pop("k_pages", case["k_pages"]), case["v_pages"]
    args.update(changes)
    return lambda: sparseattn.nsa_decode(q, kp, vp, **args)


def test_bad_inputs_raise_before_any_work():
    g = torch.Generator().manual_seed(5)
    case = paged_case([40, 70], 2, 4, 2, 8, 8, 16, SMALL, torch.float32, g)
    table = case["block_table"].clone()
    table[1, 1] = case["k_pages"].shape[0]
    with pytest.raises(sparseattn.SparseAttnError, match=r"nsa_decode.*block_table.*outside"):
        _bad(case, block_table=table)()
    too_long = torch.tensor([40, case["block_table"].shape[1] * 16 + 1], dtype=torch.int32)
    with pytest.raises(sparseattn.SparseAttnError, match=r"nsa_decode.*cache_seqlens.*outside"):
        _bad(case, cache_seqlens=too_long)()
    with pytest.raises(sparseattn.SparseAttnError, match=r"nsa_decode.*cache_seqlens.*outside"):
        _bad(case, cache_seqlens=torch.tensor([1, 70], dtype=torch.int32))()   # fewer keys than queries
    with pytest.raises(sparseattn.SparseAttnDTypeError, match=r"nsa_decode.*k_cache"):
        _bad(case, k_pages=case["k_pages"].double())()
    with pytest.raises(sparseattn.SparseAttnError, match=r"nsa_decode.*k_cache.*heads"):
        _bad(case, k_pages=case["k_pages"][:, :, :1].expand(-1, -1, 3, -1).contiguous())()
    with pytest.raises(sparseattn.SparseAttnError, match=r"nsa_decode.*k_cmp.*compressed rows"):
        _bad(case, k_cmp=case["k_cmp"][:, :3], v_cmp=case["v_cmp"][:, :3])()
    with pytest.raises(sparseattn.SparseAttnDTypeError, match=r"nsa_decode.*cache_seqlens"):
        _bad(case, cache_seqlens=case["cache_seqlens"].long())()
    with pytest.raises(sparseattn.SparseAttnError, match=r"nsa_decode.*gates"):
        _bad(case, g_cmp=None, g_slc=None, g_swa=None)()
    with pytest.raises(sparseattn.SparseAttnError, match=r"nsa_decode.*q.*Tq"):
        _bad(case, q=torch.zeros(2, 17, 4, 8))()
    with pytest.raises(sparseattn.SparseAttnTypeError, match=r"nsa_decode.*config"):
        _bad(case, config="defaults")()


def test_custom_op_fake_impl_and_compile():
    g = torch.Generator().manual_seed(13)
    case = paged_case([40, 70], 2, 4, 2, 8, 8, 16, SMALL, torch.float32, g)
    args = (case["q"], case["k_pages"], case["v_pages"], case["block_table"], case["cache_seqlens"], case["k_cmp"],
            case["v_cmp"], *case["gates"], SMALL.cmp_block, SMALL.cmp_stride, SMALL.sel_block, SMALL.num_selected,
            SMALL.num_init, SMALL.num_local, SMALL.window, None, 0, True)
    torch.library.opcheck(torch.ops.sparseattn.nsa_decode.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda *a: call(case, SMALL), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(), call(case, SMALL), rtol=0, atol=0)
