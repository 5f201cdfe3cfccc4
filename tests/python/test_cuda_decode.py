"""CUDA flash_decode against the float64 CPU reference (the same function on float64 CPU copies), with the bound of
attention_check.py (2 x the error of naive torch attention in the input precision): dense and paged caches (page
sizes, shuffled pages), lengths from 0 to the capacity and not multiples of the page or the 64-key tile, windows,
every head-dim pair, group sizes 1/4/8/16 and Tq 1/3/16, split counts 1, 3 and the heuristic, each bit-identical
run to run; poisoned outputs; CUDA-graph capture and replay with new lengths and block tables; the clamping of
the trusted device data; and the inputs the kernels do not take."""
import pytest
import torch

import sparseattn
from attention_check import assert_bounded, assert_lse, flash_visible, naive_attention, poison_allocator
from decode_check import gathered, page_table, to_pages
from sparseattn.decode import flash_decode, flash_decode_plan

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
    reason="needs a CUDA GPU and a CUDA build of sparseattn",
)

DTYPES = [torch.bfloat16, torch.float16]
DIMS = list(sparseattn.CUDA_HEAD_DIMS)
SPLITS = [1, 3, 0]


def make_inputs(B, Tq, Hq, Hkv, Dqk, Dv, S, dtype, generator, scale=1.0):
    opts = dict(dtype=torch.float64, generator=generator)
    q = (torch.randn(B, Tq, Hq, Dqk, **opts) * scale).to(dtype).cuda()
    k = (torch.randn(B, S, Hkv, Dqk, **opts) * scale).to(dtype).cuda()
    v = torch.randn(B, S, Hkv, Dv, **opts).to(dtype).cuda()
    return q, k, v


def references(q, k_cache, v_cache, seqlens, table, causal, window):
    """(o, lse) in float64 from the CPU reference, and o of naive torch attention in q's dtype (on the GPU)."""
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    o64, lse64 = flash_decode(q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(),
                              cache_seqlens=cpu(seqlens), block_table=cpu(table), causal=causal, window=window,
                              return_lse=True)
    scale = q.shape[-1] ** -0.5
    outs = []
    for b, length in enumerate(seqlens.tolist()):
        k = gathered(k_cache, table, b, length)
        v = gathered(v_cache, table, b, length)
        keep = flash_visible(q.shape[1], length, causal, window[0], window[1], q.device)
        outs.append(naive_attention(q[b], k, v, keep, scale)[0])
    return o64.cuda(), lse64.cuda(), torch.stack(outs)


def check_decode(q, k_cache, v_cache, seqlens, table=None, causal=True, window=(-1, -1), splits=SPLITS):
    """Every split count against the references, each run twice with bit-identical results."""
    o64, lse64, o_lp = references(q, k_cache, v_cache, seqlens, table, causal, window)
    results = {}
    for num_splits in splits:
        runs = []
        for _ in range(2):
            poison_allocator()
            runs.append(flash_decode(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=causal,
                                     window=window, num_splits=num_splits, return_lse=True))
        (o, lse), (o2, lse2) = runs
        assert torch.equal(o, o2) and torch.equal(lse, lse2), f"num_splits={num_splits}: not deterministic"
        assert_bounded(f"o (num_splits={num_splits})", o, o64, o_lp, q.dtype)
        assert_lse(lse, lse64)
        results[num_splits] = (o, lse)
    return results


@pytest.mark.parametrize("q_len", [1, 3, 16])
@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_dense(dtype, dims, group, q_len, generator):
    Hkv = 2
    q, k, v = make_inputs(4, q_len, group * Hkv, Hkv, dims[0], dims[1], 700, dtype, generator)
    seqlens = torch.tensor([0, 5, 333, 700], dtype=torch.int32, device="cuda")
    check_decode(q, k, v, seqlens)


@pytest.mark.parametrize("page_size", [16, 48, 64, 256])
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged(dtype, dims, page_size, generator):
    """Shuffled pages; the dense cache of the same capacity gives bit-identical results (same splits)."""
    B, Tq, Hq, Hkv = 4, 3, 8, 2
    max_pages = -(-600 // page_size)
    S = max_pages * page_size
    q, k, v = make_inputs(B, Tq, Hq, Hkv, dims[0], dims[1], S, dtype, generator)
    table, num_pages = page_table(B, S, page_size, generator)
    table = table.cuda()
    k_pages = to_pages(k, table.cpu(), num_pages, page_size, generator)
    v_pages = to_pages(v, table.cpu(), num_pages, page_size, generator)
    seqlens = torch.tensor([0, 17, page_size + 1, S], dtype=torch.int32, device="cuda")
    paged = check_decode(q, k_pages, v_pages, seqlens, table)
    for num_splits, (o, lse) in paged.items():
        o_dense, lse_dense = flash_decode(q, k, v, cache_seqlens=seqlens, num_splits=num_splits, return_lse=True)
        assert torch.equal(o, o_dense) and torch.equal(lse, lse_dense)


WINDOWS = [(True, (100, 0)), (True, (10, 5)), (True, (0, 0)), (False, (-1, 3)), (False, (-1, -1)),
           (False, (50, 50)), (True, (2000, -1))]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"c{int(w[0])}w{w[1][0]}_{w[1][1]}")
@pytest.mark.parametrize("dims", [(64, 64), (128, 128)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_windows(dtype, dims, window, paged, generator):
    causal, window = window
    B, Tq, Hq, Hkv, S = 3, 5, 8, 1, 1024
    q, k, v = make_inputs(B, Tq, Hq, Hkv, dims[0], dims[1], S, dtype, generator)
    seqlens = torch.tensor([3, 515, 1024], dtype=torch.int32, device="cuda")
    table = None
    if paged:
        table, num_pages = page_table(B, S, 32, generator)
        k = to_pages(k, table, num_pages, 32, generator)
        v = to_pages(v, table, num_pages, 32, generator)
        table = table.cuda()
    check_decode(q, k, v, seqlens, table, causal=causal, window=window)


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_splits(dtype, generator):
    """A longer cache (not a multiple of 64) where the heuristic splits several ways."""
    q, k, v = make_inputs(2, 1, 32, 8, 128, 128, 20000, dtype, generator)
    seqlens = torch.tensor([19999, 4097], dtype=torch.int32, device="cuda")
    splits, workspace = flash_decode_plan(q, k, v, cache_seqlens=seqlens)
    assert splits > 1 and workspace > 0
    # Merge groups of 8 splits: one partial group (7), one full group (8), a full and a one-split group (9), three
    # groups (20), eight (64) and the most the kernel takes (at most 256: 157 splits of 128 keys).
    check_decode(q, k, v, seqlens, splits=[0, 1, 7, 8, 9, 20, 64, 256])


@pytest.mark.parametrize("paged", [False, True])
def test_many_splits_and_row_blocks(paged, generator):
    """16 queries of a 16-head group (256 rows: four row blocks per KV head), each row block's splits merged on
    their own counters, over a batch with one empty sequence."""
    B, S, page_size = 3, 79 * 64, 64
    q, k, v = make_inputs(B, 16, 32, 2, 128, 128, S, torch.bfloat16, generator)
    seqlens = torch.tensor([5000, 0, 2311], dtype=torch.int32, device="cuda")
    table = None
    if paged:
        table, num_pages = page_table(B, S, page_size, generator)
        k = to_pages(k, table, num_pages, page_size, generator)
        v = to_pages(v, table, num_pages, page_size, generator)
        table = table.cuda()
    check_decode(q, k, v, seqlens, table, splits=[0, 9, 40])


def test_plan_ignores_contents():
    q = torch.empty(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.empty(2, 131072, 8, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    plans = {flash_decode_plan(q, k, v, cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"))
             for lengths in ([1, 1], [131072, 5], [0, 131072])}
    plans.add(flash_decode_plan(q, k, v))
    assert len(plans) == 1
    assert next(iter(plans))[0] > 1
    assert flash_decode_plan(q, k, v, num_splits=1) == (1, 0)
    assert flash_decode_plan(q[:, :, :, :64], k[..., :64], v[..., :64], num_splits=3)[0] == 3


def test_strided_inputs(generator):
    big_q, big_kv, _ = make_inputs(2, 2, 16, 4, 128, 128, 300, torch.bfloat16, generator)
    q = big_q[:, :, ::2]        # [2, 2, 8, 128], head stride 256
    k, v = big_kv[:, :, 0::2], big_kv[:, :, 1::2]  # [2, 300, 2, 128] views into one tensor
    assert not q.is_contiguous() and not k.is_contiguous()
    seqlens = torch.tensor([300, 77], dtype=torch.int32, device="cuda")
    check_decode(q, k, v, seqlens, splits=[1, 0])


def test_cuda_graph_replay(generator):
    """One capture, replayed with new cache_seqlens and a new block table: each replay equals an eager call."""
    B, Tq, Hq, Hkv, D, page_size = 3, 2, 16, 4, 128, 64
    S = 1024
    q, k, v = make_inputs(B, Tq, Hq, Hkv, D, D, S, torch.bfloat16, generator)
    table, num_pages = page_table(B, S, page_size, generator, spare=16)
    k_pages = to_pages(k, table, num_pages, page_size, generator)
    v_pages = to_pages(v, table, num_pages, page_size, generator)
    table = table.cuda()
    seqlens = torch.tensor([1, 100, 1024], dtype=torch.int32, device="cuda")
    assert flash_decode_plan(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table)[0] > 1

    def call():
        return flash_decode(q, k_pages, v_pages, cache_seqlens=seqlens, block_table=table, return_lse=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_graph, lse_graph = call()
    for lengths in ([1024, 3, 640], [0, 1023, 65], [200, 200, 200]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        table.copy_(table[torch.randperm(B, generator=generator).cuda()])  # sequences swap their pages
        o_graph.fill_(float("nan"))
        graph.replay()
        o_eager, lse_eager = call()
        assert torch.equal(o_graph, o_eager) and torch.equal(lse_graph, lse_eager)
        o64, lse64, o_lp = references(q, k_pages, v_pages, seqlens, table, True, (-1, -1))
        assert_bounded("o (graph)", o_graph, o64, o_lp, q.dtype)
        assert_lse(lse_graph, lse64)


def test_trusted_data_is_clamped(generator):
    """Lengths outside [0, capacity] act as clamped; entries past a sequence's pages are never read; bad page
    indices within them read some page of the cache, never outside it."""
    B, S, page_size = 2, 256, 16
    q, k, v = make_inputs(B, 1, 8, 2, 64, 64, S, torch.float16, generator)
    table, num_pages = page_table(B, S, page_size, generator)
    k_pages = to_pages(k, table, num_pages, page_size, generator)
    v_pages = to_pages(v, table, num_pages, page_size, generator)
    table = table.cuda()
    wild = torch.tensor([S + 1000, -7], dtype=torch.int32, device="cuda")
    clamped = torch.tensor([S, 0], dtype=torch.int32, device="cuda")
    for kv, tab in [((k, v), None), ((k_pages, v_pages), table)]:
        o, lse = flash_decode(q, *kv, cache_seqlens=wild, block_table=tab, return_lse=True)
        o_ref, lse_ref = flash_decode(q, *kv, cache_seqlens=clamped, block_table=tab, return_lse=True)
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    short = torch.tensor([40, 17], dtype=torch.int32, device="cuda")  # 3 and 2 pages
    garbage = table.clone()
    garbage[0, 3:] = 1 << 30
    garbage[1, 2:] = -(1 << 30)
    o, lse = flash_decode(q, k_pages, v_pages, cache_seqlens=short, block_table=garbage, return_lse=True)
    o_ref, lse_ref = flash_decode(q, k_pages, v_pages, cache_seqlens=short, block_table=table, return_lse=True)
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    out_of_range = table.clone()
    out_of_range[0, 0], out_of_range[1, 1] = num_pages + 5, -3
    o, _ = flash_decode(q, k_pages, v_pages, cache_seqlens=short, block_table=out_of_range, return_lse=True)
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all()


def test_opcheck(generator):
    q, k, v = make_inputs(2, 2, 8, 2, 64, 64, 128, torch.bfloat16, generator)
    seqlens = torch.tensor([100, 128], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.sparseattn.flash_decode.default, (q, k, v, seqlens, None, True, -1, -1, None, 3))


def test_unsupported(generator):
    q, k, v = make_inputs(1, 1, 4, 1, 64, 64, 64, torch.bfloat16, generator)
    pages = torch.randn(8, 8, 1, 64, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(1, 8, dtype=torch.int32, device="cuda")
    seqlens = torch.tensor([10], dtype=torch.int32, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="multiples of 16") as info:
        flash_decode(q, pages, pages, cache_seqlens=seqlens, block_table=table)
    assert info.value.argument == "k_cache"
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="float32"):
        flash_decode(q.float(), k.float(), v.float())
    q96 = torch.randn(1, 1, 4, 96, dtype=torch.bfloat16, device="cuda")
    k96 = torch.randn(1, 64, 1, 96, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="head dims"):
        flash_decode(q96, k96, k96)
    with pytest.raises(sparseattn.SparseAttnError, match="is on"):
        flash_decode(q, k.cpu(), v)
