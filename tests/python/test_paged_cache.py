"""sparseattn.cache.PagedKVCache on the CPU: appending, forking with shared pages and copy on write, freeing, the
errors a serving loop can make, and attention equal to flash_attention over each sequence's gathered keys."""
import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
from sparseattn.cache import PagedKVCache  # noqa: E402


def make(num_pages=12, page_size=4, max_pages=5, heads=2, dim=8):
    return PagedKVCache(num_pages, page_size, heads, dim, max_pages_per_seq=max_pages, dtype=torch.float64)


def tokens(batch, n, gen, heads=2, dim=8):
    return torch.randn(batch, n, heads, dim, dtype=torch.float64, generator=gen)


def test_append_fork_and_attend_match_the_gathered_sequences():
    gen = torch.Generator().manual_seed(0)
    cache = make()
    a = cache.add_sequence()
    ka, va = tokens(1, 6, gen), tokens(1, 6, gen)
    cache.append([a], ka, va)
    b = cache.fork(a)
    assert cache.pages(b) == cache.pages(a) and cache.free_pages == 10  # shared, not copied
    kn, vn = tokens(2, 3, gen), tokens(2, 3, gen)
    cache.append([a, b], kn, vn)
    assert cache.pages(a)[0] == cache.pages(b)[0]  # the full first page stays shared
    assert cache.pages(a)[1] != cache.pages(b)[1]  # the partial page was copied before the writes
    expected = {a: (torch.cat([ka[0], kn[0]]), torch.cat([va[0], vn[0]])),
                b: (torch.cat([ka[0], kn[1]]), torch.cat([va[0], vn[1]]))}
    for seq in (a, b):
        k, v = cache.gather(seq)
        torch.testing.assert_close(k, expected[seq][0], rtol=0, atol=0)
        torch.testing.assert_close(v, expected[seq][1], rtol=0, atol=0)
    q = torch.randn(2, 3, 4, 8, dtype=torch.float64, generator=gen)
    o, lse = cache.attend(q, [a, b], return_lse=True)
    for row, seq in enumerate((a, b)):
        k, v = expected[seq]
        o_ref, lse_ref = sa.flash_attention(q[row:row + 1], k[None], v[None], causal=True, return_lse=True)
        torch.testing.assert_close(o[row:row + 1], o_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[row:row + 1], lse_ref, rtol=1e-12, atol=1e-12)


def test_free_returns_pages_no_one_else_holds():
    gen = torch.Generator().manual_seed(1)
    cache = make()
    a = cache.add_sequence()
    cache.append([a], tokens(1, 9, gen), tokens(1, 9, gen))  # 3 pages
    b = cache.fork(a)
    cache.free(a)
    assert cache.free_pages == 9  # b still holds the 3 pages
    cache.free(b)
    assert cache.free_pages == 12


def test_exactly_enough_pages_for_a_copy_on_write():
    gen = torch.Generator().manual_seed(2)
    cache = make(num_pages=3)
    a = cache.add_sequence()
    cache.append([a], tokens(1, 6, gen), tokens(1, 6, gen))  # pages 0, 1 (1 partial)
    b = cache.fork(a)
    cache.append([a, b], tokens(2, 1, gen), tokens(2, 1, gen))  # one copy: the last holder writes in place
    assert cache.free_pages == 0


@pytest.mark.parametrize("case", ["too_long", "no_pages", "unknown", "twice", "shape", "dtype"])
def test_bad_appends_raise_before_writing(case):
    gen = torch.Generator().manual_seed(3)
    cache = make(num_pages=3, max_pages=2)
    a = cache.add_sequence()
    before = cache.k_pages.clone()
    k, v, seqs, match = tokens(1, 9, gen), tokens(1, 9, gen), [a], "block table holds"
    if case == "no_pages":
        b = cache.add_sequence()
        k, v, seqs, match = tokens(2, 8, gen), tokens(2, 8, gen), [a, b], "free pages"
    elif case == "unknown":
        k, v, seqs, match = tokens(1, 1, gen), tokens(1, 1, gen), [7], "not a live sequence"
    elif case == "twice":
        k, v, seqs, match = tokens(2, 1, gen), tokens(2, 1, gen), [a, a], "twice"
    elif case == "shape":
        k, v, match = tokens(1, 1, gen, heads=3), tokens(1, 1, gen), "expected"
    elif case == "dtype":
        k, v, match = tokens(1, 1, gen).float(), tokens(1, 1, gen), "float32"
    with pytest.raises(sa.SparseAttnError, match=match):
        cache.append(seqs, k, v)
    assert torch.equal(cache.k_pages, before) and cache.length(a) == 0


@pytest.mark.skipif(not torch.cuda.is_available() or not sa.built_with_cuda(), reason="needs a CUDA GPU and build")
def test_paged_cache_on_cuda_matches_the_cpu_reference():
    gen = torch.Generator().manual_seed(4)
    cache = PagedKVCache(64, 16, 2, 128, max_pages_per_seq=16, dtype=torch.bfloat16, device="cuda")
    seqs = [cache.add_sequence() for _ in range(3)]
    for n, seq in zip((50, 17, 100), seqs):
        k, v = (torch.randn(1, n, 2, 128, generator=gen).bfloat16().cuda() for _ in range(2))
        cache.append([seq], k, v)
    seqs.append(cache.fork(seqs[0]))
    cache.append(seqs, *(torch.randn(4, 1, 2, 128, generator=gen).bfloat16().cuda() for _ in range(2)))
    q = torch.randn(4, 1, 16, 128, generator=gen).bfloat16().cuda()
    o = cache.attend(q, seqs)
    for row, seq in enumerate(seqs):
        k, v = cache.gather(seq)
        o_ref = sa.flash_attention(q[row:row + 1].float().cpu(), k[None].float().cpu(), v[None].float().cpu(),
                                   causal=True)
        torch.testing.assert_close(o[row:row + 1].float().cpu(), o_ref, rtol=2e-2, atol=2e-2)
