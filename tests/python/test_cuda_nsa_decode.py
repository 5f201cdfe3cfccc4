"""CUDA nsa_decode against the CPU reference (nsa_attention over each sequence's gathered keys, float64): the
selection agrees with the reference's except near ties (rounding), and o equals the reference computed with the
kernel's own selection within the input precision's bound; Tq 1..16, groups 1/4/16, every head-dim pair, both
16-bit dtypes, long contexts over many compressed splits (heuristic and forced split counts, bit-identical run to
run), the selection's exact ties and long candidate lists (up to 4600 blocks, n up to 64) against the expected
lists, CUDA-graph capture and replay with new lengths and tables equal to eager calls, and the inputs the kernels
do not take. The cases that run the compressed kernel run with both of its warp counts (8, the default, and 4 where
SPARSEATTN_NSA_DECODE_WARPS=4)."""
import pytest
import torch

import sparseattn
from nsa_decode_check import call, chunk_reference, paged_case

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
    reason="needs a CUDA GPU and a CUDA build of sparseattn",
)

SMALL = sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, num_init=1, num_local=1,
                             window=48)
DEFAULT = sparseattn.NSAConfig()
TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}


def cpu_block_indices(case, cfg, branches=(True, True, True)):
    """The CPU path's selection of `case` in float64."""
    cpu = {k: (v.cpu() if torch.is_tensor(v) else [t.cpu() for t in v]) for k, v in case.items()}
    cpu = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else
               [t.double() for t in v] if isinstance(v, list) else v) for k, v in cpu.items()}
    return call(cpu, cfg, branches, return_block_indices=True)[1]


@pytest.fixture(params=[None, "4"], ids=["warps8", "warps4"])
def compressed_warps(request, monkeypatch):
    """The compressed kernel's warp count for the test: the default (8 warps) or SPARSEATTN_NSA_DECODE_WARPS=4."""
    if request.param is None:
        monkeypatch.delenv("SPARSEATTN_NSA_DECODE_WARPS", raising=False)
    else:
        monkeypatch.setenv("SPARSEATTN_NSA_DECODE_WARPS", request.param)
    return request.param


def check_against_reference(case, cfg, dtype, branches=(True, True, True), **kw):
    o, idx = call(case, cfg, branches, return_block_indices=True, **kw) if branches[1] else (
        call(case, cfg, branches, **kw), None)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    if idx is not None:
        ref_idx = cpu_block_indices(case, cfg, branches)
        same_rows = (idx.cpu() == ref_idx).all(-1)
        # Rows may differ only where two blocks' scores tie within rounding: few rows, one swap each.
        assert same_rows.float().mean() >= 0.9, f"{(~same_rows).sum()} of {same_rows.numel()} selections differ"
        for row in (~same_rows).nonzero().tolist():
            a, b = set(idx.cpu()[tuple(row)].tolist()), set(ref_idx[tuple(row)].tolist())
            assert len(a ^ b) <= 2
    ref = chunk_reference(case, cfg, branches, block_indices=idx)
    torch.testing.assert_close(o.cpu().double(), ref, rtol=TOL[dtype], atol=TOL[dtype])
    return o


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", list(sparseattn.CUDA_HEAD_DIMS))
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (8, 2), (16, 1)])
@pytest.mark.parametrize("Tq", [1, 5, 16])
def test_matches_reference(dtype, dims, Hq, Hkv, Tq, compressed_warps):
    g = torch.Generator().manual_seed(hash((str(dtype), dims, Hq, Tq)) % 2**31)
    lengths = [Tq + 3, 300, 517, 1000]
    case = paged_case(lengths, Tq, Hq, Hkv, dims[0], dims[1], 32, SMALL, dtype, g, shared_prefix=64, device="cuda")
    check_against_reference(case, SMALL, dtype)


@pytest.mark.parametrize("branches", [(True, False, False), (False, True, False), (False, False, True),
                                      (False, True, True)])
def test_single_branches(branches, compressed_warps):
    g = torch.Generator().manual_seed(9)
    case = paged_case([33, 250, 700], 2, 8, 2, 128, 128, 16, SMALL, torch.bfloat16, g, device="cuda")
    check_against_reference(case, SMALL, torch.bfloat16, branches)


@pytest.mark.parametrize("num_splits", [0, 3, 1])
@pytest.mark.parametrize("Tq", [1, 4])
def test_long_context_split_kv(num_splits, Tq, compressed_warps):
    g = torch.Generator().manual_seed(num_splits * 10 + Tq)
    lengths = [20000, 9000, 3000 + Tq]
    case = paged_case(lengths, Tq, 16, 1, 128, 128, 64, DEFAULT, torch.bfloat16, g, device="cuda", scale=0.5)
    o = check_against_reference(case, DEFAULT, torch.bfloat16, num_splits=num_splits)
    again = call(case, DEFAULT, num_splits=num_splits)
    assert torch.equal(o, again)  # deterministic


def test_cuda_graph_replay_equals_eager(compressed_warps):
    g = torch.Generator().manual_seed(21)
    case = paged_case([900, 2000], 1, 16, 4, 128, 128, 64, DEFAULT, torch.bfloat16, g, device="cuda",
                      spare_pages=40, max_cmp=200)
    static = {k: v for k, v in case.items()}
    call(case, DEFAULT)  # warm-up outside the graph (kernel attributes, allocator pools)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(static, DEFAULT)
    other = paged_case([1500, 1900], 1, 16, 4, 128, 128, 64, DEFAULT, torch.bfloat16, g, device="cuda",
                       spare_pages=40, max_cmp=200)
    for name in ["q", "k_pages", "v_pages", "k_cmp", "v_cmp"]:
        n = min(static[name].shape[0], other[name].shape[0])
        static[name][:n].copy_(other[name][:n])
    for i in range(3):
        static["gates"][i].copy_(other["gates"][i])
    cols = min(static["block_table"].shape[1], other["block_table"].shape[1])
    static["block_table"][:, :cols].copy_(other["block_table"][:, :cols])
    static["cache_seqlens"].copy_(other["cache_seqlens"])
    graph.replay()
    torch.cuda.synchronize()
    eager = call(static, DEFAULT)
    assert torch.equal(out, eager)


def test_inputs_the_kernels_do_not_take():
    g = torch.Generator().manual_seed(1)
    case = paged_case([100, 60], 1, 4, 1, 64, 64, 16, SMALL, torch.float32, g, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="nsa_decode"):
        call(case, SMALL)
    case = paged_case([100, 60], 1, 32, 1, 64, 64, 16, SMALL, torch.bfloat16, g, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match=r"nsa_decode.*groups of at most 16"):
        call(case, SMALL)
    case = paged_case([100, 60], 1, 4, 1, 64, 64, 24, SMALL, torch.bfloat16, g, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match=r"nsa_decode.*k_cache.*multiples of 16"):
        call(case, SMALL)
    case = paged_case([100, 60], 1, 4, 1, 64, 64, 16, SMALL, torch.bfloat16, g, device="cuda")
    with pytest.raises(sparseattn.SparseAttnError, match=r"nsa_decode.*block_table"):
        sparseattn.nsa_decode(case["q"], case["k_pages"], case["v_pages"], block_table=case["block_table"][:1],
                              cache_seqlens=case["cache_seqlens"], k_cmp=case["k_cmp"], v_cmp=case["v_cmp"],
                              g_swa=case["gates"][2], config=SMALL)


def test_trusted_device_data_is_clamped():
    """Lengths past the capacity and page indices past the pool read nothing outside the given tensors."""
    g = torch.Generator().manual_seed(2)
    case = paged_case([200, 90], 1, 4, 1, 64, 64, 16, SMALL, torch.bfloat16, g, device="cuda")
    case["cache_seqlens"] = torch.tensor([10**6, 90], dtype=torch.int32, device="cuda")
    case["block_table"] = case["block_table"].clone()
    case["block_table"][1, 0] = 10**6
    o = call(case, SMALL)
    torch.cuda.synchronize()
    assert o.shape == (2, 1, 4, 64)


@pytest.mark.parametrize("num_selected", [16, 64])
def test_selection_ties_and_many_candidates(num_selected, compressed_warps):
    """Exact ties and long candidate lists: blocks of one compressed row each (l = d = l' = 16); every query head
    has q = 100 e_0 and every compressed key is -100 e_0 (probability exactly 0 in float32 and float64, so those
    blocks' scores tie at 0 exactly) except a few hot rows 100 - i/2 (scores e^6.25 apart: no near ties). The
    chosen blocks are then the hot ones and the lowest-index tied ones, identical to the CPU reference's. The
    sequences have about 600, 2000, 4000 and 4600 candidate blocks: up to 4, 8 and 16 per thread of the select
    kernel (scores in shared memory), and more than 16 with the scores in the workspace."""
    cfg = sparseattn.NSAConfig(cmp_block=16, cmp_stride=16, sel_block=16, num_selected=num_selected, num_init=1,
                               num_local=2, window=32)
    g = torch.Generator().manual_seed(num_selected)
    lengths = [600 * 16 + 5, 2000 * 16 + 9, 4000 * 16, 4600 * 16 + 15]
    Hq, Hkv, D = 4, 2, 64
    case = paged_case(lengths, 1, Hq, Hkv, D, D, 64, cfg, torch.bfloat16, g, device="cuda")
    q = torch.zeros_like(case["q"])
    q[..., 0] = 100.0
    case["q"] = q
    k_cmp = torch.zeros_like(case["k_cmp"])
    k_cmp[..., 0] = -100.0
    expected = torch.empty(len(lengths), 1, Hkv, num_selected, dtype=torch.int32)
    for b, L in enumerate(lengths):
        blocks = (L - 1) // 16 + 1
        for kv in range(Hkv):
            # Hot rows spread over the candidates (never a forced block), a different order per KV head.
            hot = [(blocks // 9) * (i + 1) + 3 * kv for i in range(8)]
            for i, j in enumerate(hot if kv % 2 == 0 else hot[::-1]):
                k_cmp[b, j, kv, 0] = 100.0 - 0.5 * i
            # Block 0 and the last two are forced; the slots left after the hot blocks go to the lowest tied ones.
            tied = [j for j in range(1, blocks - 2) if j not in hot][: num_selected - 3 - len(hot)]
            expected[b, 0, kv] = torch.tensor(sorted([0, *hot, *tied, blocks - 2, blocks - 1]), dtype=torch.int32)
    case["k_cmp"] = k_cmp
    o, idx = call(case, cfg, return_block_indices=True)
    again = call(case, cfg, return_block_indices=True)[1]
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()
    assert torch.equal(idx, again)
    ref = cpu_block_indices(case, cfg)
    assert torch.equal(ref, expected)
    assert torch.equal(idx.cpu(), expected), (idx.cpu() != expected).nonzero()[:8].tolist()
