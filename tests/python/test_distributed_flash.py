"""Context-parallel flash_attention (sparseattn.distributed) on the CPU: 2 and 4 processes in a gloo group,
each comparing its shard of the output and of the q/k/v gradients with the single-process
sparseattn.flash_attention on the same inputs; bad input raising on every rank; the sharding helpers."""

import doctest

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
import torch.distributed as dist  # noqa: E402

import sparseattn.distributed as sad  # noqa: E402
from distributed_cases import lowp_violations  # noqa: E402
from distributed_pool import Pool, RankError, values  # noqa: E402
from sparseattn.distributed import documents, flash, group, plan, ranges, sharding  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

TOLERANCE = {"float64": 1e-12, "float32": 2e-5}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"R{n}")
def pool(request):
    p = Pool(request.param)
    yield p
    if not p.broken:
        p.close()


def assert_matches(results, dtype="float64"):
    for rank, result in enumerate(values(results)):
        bad = {name: err for name, err in result["errors"].items() if not err <= TOLERANCE[dtype]}
        assert not bad, f"rank {rank}: errors above {TOLERANCE[dtype]}: {bad}"
        assert result.get("bit_equal", True), f"rank {rank}: two runs differ"


# (id, kwargs of distributed_cases.compare)
CASES = [
    ("causal", dict(causal=True)),
    ("full", dict(causal=False)),
    ("causal-window", dict(causal=True, window=(3, 0))),
    ("causal-window-all_gather", dict(causal=True, window=(3, 0), exchange="all_gather")),
    ("causal-all_to_all", dict(causal=True, exchange="all_to_all")),
    ("two-sided-window", dict(causal=False, window=(2, 5), T=23)),
    ("left-window-only", dict(causal=False, window=(4, -1), T=19)),
    ("right-window-only", dict(causal=False, window=(-1, 3), T=19)),
    ("uneven", dict(causal=True, T=13, B=1)),
    ("rank-without-tokens", dict(causal=True, T=1)),
    ("fewer-tokens-than-chunks", dict(causal=True, window=(1, 0), T=3)),
    ("single-token", dict(causal=False, T=1, window=(0, 0))),
    ("contiguous", dict(causal=True, T=17, layout="contiguous")),
    ("contiguous-window", dict(causal=True, window=(5, 0), T=17, layout="contiguous")),
    ("gqa-scale", dict(causal=True, Hq=6, Hkv=2, Dqk=5, Dv=3, scale=0.3, T=21)),
    ("mha", dict(causal=True, Hq=3, Hkv=3)),
    ("float32", dict(causal=True, window=(6, 0), T=29, dtype="float32")),
    ("packed-causal", dict(causal=True, T=30, cu_seqlens=[0, 7, 7, 19, 26, 30])),
    ("packed-full", dict(causal=False, T=30, cu_seqlens=[0, 11, 12, 30])),
    ("packed-window", dict(causal=True, window=(4, 0), T=30, cu_seqlens=[0, 5, 21, 30])),
    ("packed-two-sided", dict(causal=False, window=(3, 6), T=30, cu_seqlens=[0, 9, 10, 25, 30])),
    ("packed-two-sided-all_gather", dict(causal=False, window=(3, 6), T=30, cu_seqlens=[0, 9, 10, 25, 30],
                                         exchange="all_gather")),
    ("packed-left-window", dict(causal=False, window=(5, -1), T=33, cu_seqlens=[0, 14, 33], layout="contiguous")),
    ("packed-trailing-rows", dict(causal=True, T=26, cu_seqlens=[0, 4, 17, 21], cu_as_list=True)),
    ("packed-one-document", dict(causal=True, T=11, cu_seqlens=[0, 11], layout="contiguous")),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_single_process(pool, kwargs):
    kwargs = dict(kwargs)
    assert_matches(pool.run("compare", **kwargs), kwargs.get("dtype", "float64"))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_within_bound(pool, dtype):
    """16-bit inputs (the GPU dtypes, here through the CPU reference): against float64, as accurate as the
    single-process call up to one rounding per rank; forward and dq equal to the single-process call."""
    for kwargs in (dict(causal=True, T=40, Dqk=16, Dv=16), dict(causal=True, window=(7, 0), T=37,
                                                                cu_seqlens=[0, 13, 30, 37])):
        for rank, result in enumerate(values(pool.run("compare", dtype=dtype, **kwargs))):
            bad = lowp_violations(result, pool.world_size, dtype)
            assert not bad, f"rank {rank}: {bad}"
            assert result["bit_equal"]
            assert all(result["errors"][n] == 0 for n in ("o", "lse", "dq")), result["errors"]


def test_rank_without_tokens_holds_none(pool):
    results = values(pool.run("compare", causal=True, T=1, repeat=False))
    lengths = sad.shard_lengths(1, pool.world_size)
    assert [r["rows"] for r in results] == list(lengths)
    assert 0 in lengths


def test_lse_and_output_dtypes(pool):
    for dtype, lse in (("float64", "torch.float64"), ("float32", "torch.float32")):
        result = values(pool.run("compare", dtype=dtype, repeat=False))[0]
        assert result["dtypes"][0] == f"torch.{dtype}" and result["dtypes"][1] == lse


def test_window_exchange_moves_only_the_halo(pool):
    """Under a window the all_to_all brings each rank its chunks' keys and the halo before them, not the sequence."""
    T, w = 64, 3
    summaries = values(pool.run("plan_summary", T=T, causal=True, window=(w, 0)))
    chunk = T // (2 * pool.world_size)
    for s in summaries:
        assert s["method"] == "all_to_all"
        assert s["received"] <= 2 * (chunk + w) and s["key_rows"] <= 2 * (chunk + w)
    full = values(pool.run("plan_summary", T=T, causal=True, window=(-1, -1)))
    assert all(s["method"] == "all_gather" and s["received"] == T for s in full)
    # zigzag causal: the early chunk needs only stage 0 (the first half), the late chunk stage 1
    assert all(s["stages"] == [0, 1] for s in full)


def test_shard_round_trip(pool):
    for layout in sad.LAYOUTS:
        for T, dim in ((13, 1), (3, 0), (16, 2)):
            for r in values(pool.run("round_trip", T=T, layout=layout, dim=dim)):
                assert r["equal"] and r["positions_ok"]


# ------------------------------------------------------------------------------------------- bad input


def assert_every_rank_raises(results, match=None, cls=sa.SparseAttnError):
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), f"rank {rank} returned {result!r} instead of raising"
        assert cls.__name__ in result.classes, f"rank {rank} raised {result!r}"
        if match is not None:
            assert match in result.message, f"rank {rank}: {result.message!r} lacks {match!r}"


def test_ranks_disagree_on_config(pool):
    results = pool.run("call", causal=True, per_rank={1: dict(causal=False)})
    assert_every_rank_raises(results, "'causal': the ranks disagree on causal: rank 0 has True, rank 1 has False")
    results = pool.run("call", window=(2, 0), causal=True, per_rank={pool.world_size - 1: dict(window=(3, 0))})
    assert_every_rank_raises(results, "the window's left side")
    results = pool.run("call", per_rank={0: dict(scale=0.5)})
    assert_every_rank_raises(results, "rank 0 has 0.5")


def test_ranks_disagree_on_shapes(pool):
    results = pool.run("call", Hq=2, per_rank={1: dict(Hq=4)})
    assert_every_rank_raises(results, "the query heads Hq: rank 0 has 2, rank 1 has 4")
    results = pool.run("call", per_rank={1: dict(dtype="float32")})
    assert_every_rank_raises(results, "the dtype: rank 0 has float64, rank 1 has float32")


def test_rank_with_bad_arguments(pool):
    """A rank whose own arguments are invalid raises its own error; the others name it, and nobody hangs."""
    results = pool.run("call", per_rank={1: dict(q_dims=(-1, 2, 4))})
    assert_every_rank_raises(results)
    assert "expected 4 dimensions" in results[1].message
    assert all("rank 1 rejected its arguments" in r.message for i, r in enumerate(results) if i != 1)
    results = pool.run("call", per_rank={0: dict(q_dtype="float32")})
    assert_every_rank_raises(results)
    assert "SparseAttnDTypeError" in results[0].classes
    results = pool.run("call", per_rank={1: dict(window=5)})
    assert "SparseAttnTypeError" in results[1].classes and isinstance(results[0], RankError)


def test_shard_lengths_that_do_not_add_up(pool):
    R = pool.world_size
    lengths = [2] * R
    lengths[0], lengths[1] = 3, 1  # T = 2R, but zigzag gives every rank 2
    results = pool.run("call", T=2 * R, lengths=lengths)
    assert_every_rank_raises(results, "do not add up to the zigzag sharding")
    results = pool.run("call", T=2 * R, lengths=lengths, layout="contiguous")
    assert_every_rank_raises(results, "contiguous sharding")


def test_packed_stream_shorter_than_cu_seqlens(pool):
    T = 2 * pool.world_size
    results = pool.run("call", T=T, cu_seqlens=[0, 3, T + 1], causal=True)
    assert_every_rank_raises(results, "past the")
    results = pool.run("call", T=T, cu_seqlens=[0, 3, T], per_rank={1: dict(cu_seqlens=[0, 2, T])})
    assert_every_rank_raises(results, "'cu_seqlens': the ranks disagree on its contents")


def test_unshard_mismatch(pool):
    assert_every_rank_raises(pool.run("unshard_mismatch"), "the sizes of the other dimensions")


# ------------------------------------------------------------------------------ single process, no pool


def test_backend_must_fit_the_device():
    op = "distributed.flash_attention"
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert group.backend_error(op, "q", {"cpu": "gloo"}, cpu) is None
    assert group.backend_error(op, "q", {"cpu": "gloo", "cuda": "nccl"}, cuda) is None
    err = group.backend_error(op, "q", {"cpu": "gloo", "cuda": "gloo"}, cuda)
    assert isinstance(err, sa.SparseAttnError) and "gloo, which copies" in str(err)
    err = group.backend_error(op, "q", {"cuda": "nccl"}, cpu)
    assert isinstance(err, sa.SparseAttnError) and "no gloo backend for CPU tensors" in str(err)
    err = group.backend_error(op, "q", {"cpu": "gloo"}, torch.device("meta"))
    assert isinstance(err, sa.SparseAttnError)
    # the configuration all_gather runs where every rank can agree, whatever its tensors' device
    assert group.agreement_device({"cpu": "gloo", "cuda": "nccl"}).type == "cpu"


def test_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q = torch.randn(1, 4, 2, 4)
    with pytest.raises(sa.SparseAttnError, match="init_process_group"):
        sad.flash_attention(q, q, q)
    with pytest.raises(sa.SparseAttnError, match="init_process_group"):
        sad.shard(q)


def test_cu_seqlens_on_the_host():
    op = "distributed.flash_attention"
    assert documents.host_cu_seqlens(op, "cu_seqlens", [0, 3, 3, 9]) == (0, 3, 3, 9)
    assert documents.host_cu_seqlens(op, "cu_seqlens", torch.tensor([0, 5], dtype=torch.int32)) == (0, 5)
    with pytest.raises(sa.SparseAttnDTypeError):
        documents.host_cu_seqlens(op, "cu_seqlens", torch.tensor([0, 5]))
    with pytest.raises(sa.SparseAttnError, match="non-decreasing"):
        documents.host_cu_seqlens(op, "cu_seqlens", [0, 5, 4])
    with pytest.raises(sa.SparseAttnError, match="start at 0"):
        documents.host_cu_seqlens(op, "cu_seqlens", (1, 5))
    with pytest.raises(sa.SparseAttnTypeError):
        documents.host_cu_seqlens(op, "cu_seqlens", [0, 2.5])
    if torch.cuda.is_available():
        with pytest.raises(sa.SparseAttnError, match="host copy"):
            documents.host_cu_seqlens(op, "cu_seqlens", torch.tensor([0, 5], dtype=torch.int32, device="cuda"))


def test_sharding_maps():
    assert sharding.chunk_bounds(10, 4) == (0, 3, 6, 8, 10)
    assert sad.shard_ranges(10, 2, 0) == ((0, 3), (8, 10))
    for T in range(0, 40):
        for R in (1, 2, 3, 4, 8):
            for layout in sad.LAYOUTS:
                lengths = sad.shard_lengths(T, R, layout)
                assert sum(lengths) == T and max(lengths) - min(lengths) <= 2
                positions = torch.cat([sad.shard_positions(T, R, r, layout) for r in range(R)])
                assert sorted(positions.tolist()) == list(range(T))
                for r in range(R):
                    p = sad.shard_positions(T, R, r, layout)
                    assert torch.equal(p, p.sort().values)
    with pytest.raises(sa.SparseAttnError, match="layout"):
        sad.shard_ranges(8, 2, 0, layout="ring")
    with pytest.raises(sa.SparseAttnError, match="rank"):
        sad.shard_ranges(8, 2, 2)


def test_zigzag_balances_causal_work():
    """The number of (query, visible key) pairs of each rank under a causal mask: zigzag keeps them within one
    chunk's worth of each other, contiguous does not."""
    T, R = 64, 4

    def work(layout):
        return [sum(p + 1 for p in sad.shard_positions(T, R, r, layout).tolist()) for r in range(R)]

    zigzag, contiguous = work("zigzag"), work("contiguous")
    assert max(zigzag) - min(zigzag) <= T // (2 * R)
    assert max(contiguous) > 3 * min(contiguous)


def test_range_sets():
    assert ranges.normalize([(5, 7), (0, 2), (2, 3), (4, 4), (6, 9)]) == ((0, 3), (5, 9))
    a = ((0, 4), (6, 10))
    assert ranges.intersect(a, ((3, 7),)) == ((3, 4), (6, 7))
    assert ranges.subtract(a, ((2, 7),)) == ((0, 2), (7, 10))
    assert ranges.subtract(a, ()) == a and ranges.subtract(a, a) == ()
    assert ranges.offset_in(a, 7) == 5 and ranges.length(a) == 8
    assert ranges.covers(a, ((1, 3), (8, 9))) and not ranges.covers(a, ((3, 7),))
    with pytest.raises(ValueError):
        ranges.offset_in(a, 5)


def test_pieces_keep_their_documents():
    reach = documents.KeyReach.of(True, (2, 0))
    got = documents.pieces((0, 5, 5, 12, 20), 3, 14, reach)
    assert [(p.q_start, p.q_end, p.k_start, p.k_end) for p in got] == [(3, 5, 1, 5), (5, 12, 5, 12), (12, 14, 12, 14)]
    # without causal, keys ahead of the range: the last piece is shifted by what it sees past the range
    reach = documents.KeyReach.of(False, (-1, 3))
    got = documents.pieces((0, 10, 30), 4, 12, reach)
    assert [(p.q_start, p.q_end, p.k_start, p.k_end, p.shift) for p in got] == [(4, 10, 0, 10, 0),
                                                                                (10, 12, 10, 15, 3)]


def test_plan_calls_are_bottom_right_aligned():
    """Every call's queries end where its keys end, or its window is shifted by the difference."""
    for causal, window in ((True, (-1, -1)), (False, (2, 4)), (False, (-1, -1)), (True, (3, 0))):
        method = plan.choose_method("auto", causal, window)
        for rank in range(3):
            p = plan.make_plan(37, 3, rank, "zigzag", (0, 10, 25, 37), causal, window, method)
            for chunk in p.chunks:
                for call in chunk.calls:
                    assert call.keys[0] <= call.keys[1]
                    assert ranges.covers(p.key_set, (call.keys,))
                    if causal:
                        assert call.window == window


def test_docstring_examples_run():
    """The doctests of sparseattn.distributed (each runs on a one-rank gloo group of its own)."""
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    for module in (sad, sharding, flash):
        for test in finder.find(module, module.__name__):
            runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted > 0


def test_docstring_sections():
    for name in sad.__all__:
        obj = getattr(sad, name)
        if not callable(obj):
            continue
        doc = obj.__doc__ or ""
        missing = [s for s in ("Args:", "Returns:", "Raises:", "Example:") if s not in doc]
        assert not missing, f"sparseattn.distributed.{name}'s docstring lacks {missing}"
