"""Context-parallel nsa_attention (sparseattn.distributed) on the CPU: 2 and 4 processes in a gloo group, each
comparing its shard of the output and of the gradients of q, k, v and the gates with the single-process
sparseattn.nsa_attention on the same inputs; bad input raising on every rank; the plan of its chunks.

The configurations are small (compression blocks of 8 tokens every 4, selection blocks of 8, a window of 16) and
the sequences a few hundred tokens long, so that the shards' chunks cut through compression, selection and window
blocks."""

import doctest

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
import torch.distributed as dist  # noqa: E402

import sparseattn.distributed as sad  # noqa: E402
from distributed_cases import lowp_violations  # noqa: E402
from distributed_pool import Pool, RankError, values  # noqa: E402
from sparseattn.distributed import nsa, ranges  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

CFG = dict(cmp_block=8, cmp_stride=4, sel_block=8, num_selected=3, num_init=1, num_local=1, window=16)
# The key gradients are sums over the chunks that read a key, taken in another order than the single-process
# call's; everything else is computed by one call, exactly as the single-process call computes it.
TOLERANCE = {"float64": 1e-12, "float32": 2e-5}
EXACT = ("o", "dq", "d_g_cmp", "d_g_slc", "d_g_swa")


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
        inexact = {n: e for n, e in result["errors"].items() if n in EXACT and e != 0}
        assert not inexact, f"rank {rank}: not bit-equal to the single-process call: {inexact}"
        assert result.get("bit_equal", True), f"rank {rank}: two runs differ"


# (id, kwargs of distributed_cases.nsa_compare)
CASES = [
    ("zigzag", dict(config=CFG)),
    ("zigzag-uneven", dict(config=CFG, T=203, B=1)),
    ("contiguous", dict(config=CFG, T=203, layout="contiguous")),
    ("all_to_all", dict(config=CFG, T=190, exchange="all_to_all")),
    ("rank-without-tokens", dict(config=CFG, T=1, B=1)),
    ("ranks-without-tokens-contiguous", dict(config=CFG, T=3, layout="contiguous")),
    ("fewer-tokens-than-a-block", dict(config=CFG, T=7)),
    ("gqa-3", dict(config=CFG, T=150, Hq=6, Hkv=2, Dqk=8, Dv=12)),
    ("mha", dict(config=CFG, T=120, Hq=2, Hkv=2)),
    ("only-selection", dict(config=CFG, gates=("g_slc",))),
    ("compressed-and-window", dict(config=CFG, gates=("g_cmp", "g_swa"), layout="contiguous")),
    ("forced-blocks-scale", dict(config=dict(CFG, num_init=0, num_local=2, num_selected=4, scale=0.3), T=170)),
    ("larger-blocks", dict(config=dict(cmp_block=16, cmp_stride=8, sel_block=16, num_selected=3, window=40), T=300,
                           B=1)),
    ("every-block-selected", dict(config=dict(CFG, num_selected=40), T=250, B=1)),
    ("float32", dict(config=CFG, T=180, dtype="float32")),
    ("packed", dict(config=CFG, T=300, cu_seqlens=[0, 37, 37, 150, 290, 300])),
    ("packed-trailing-rows", dict(config=CFG, T=260, cu_seqlens=[0, 101, 230])),
    ("packed-short-documents", dict(config=CFG, T=240, cu_seqlens=[0, 9, 30, 33, 70, 100, 105, 180, 240])),
    ("packed-all_to_all", dict(config=CFG, T=240, cu_seqlens=[0, 9, 30, 33, 70, 100, 105, 180, 240],
                               exchange="all_to_all")),
    ("packed-one-document-contiguous", dict(config=CFG, T=211, cu_seqlens=[0, 211], layout="contiguous")),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_single_process(pool, kwargs):
    kwargs = dict(kwargs)
    assert_matches(pool.run("nsa_compare", **kwargs), kwargs.get("dtype", "float64"))


def test_gradients_of_the_given_gates_only(pool):
    for result in values(pool.run("nsa_compare", config=CFG, T=60, gates=("g_slc",), repeat=False)):
        assert set(result["errors"]) == {"o", "dq", "dk", "dv", "d_g_slc"}
        assert result["grads_given"] == ["o", "dq", "dk", "dv", "d_g_slc"]


def test_rank_without_tokens_holds_none(pool):
    results = values(pool.run("nsa_compare", config=CFG, T=1, B=1, repeat=False))
    lengths = sad.shard_lengths(1, pool.world_size)
    assert [r["rows"] for r in results] == list(lengths)
    assert 0 in lengths


def test_bfloat16_within_bound(pool):
    """bf16 inputs through the CPU reference: against float64, as accurate as the single-process call up to one
    rounding of the key gradients per rank and chunk; output, dq and the gates' gradients equal to the
    single-process call."""
    for kwargs in (dict(T=160), dict(T=170, cu_seqlens=[0, 60, 61, 150])):
        results = values(pool.run("nsa_compare", config=CFG, dtype="bfloat16", **kwargs))
        for rank, result in enumerate(results):
            bad = lowp_violations(result, pool.world_size, "bfloat16")
            assert not bad, f"rank {rank}: {bad}"
            assert result["bit_equal"]
            assert all(result["errors"][n] == 0 for n in EXACT), result["errors"]


def test_exchange_of_short_documents(pool):
    """all_to_all brings each rank only the keys of its chunks' documents (its own tokens and, before each chunk,
    at most a document's length); all_gather brings the sequence."""
    T, length = 240, 15
    cu = list(range(0, T + 1, length))
    gathered = values(pool.run("nsa_plan_summary", T=T, cu_seqlens=cu))
    assert all(s["method"] == "all_gather" and s["received"] == T for s in gathered)
    exact = values(pool.run("nsa_plan_summary", T=T, cu_seqlens=cu, exchange="all_to_all"))
    for s in exact:
        assert s["method"] == "all_to_all"
        assert s["received"] == s["key_rows"] <= s["rows"] + 2 * (length - 1)


def test_zigzag_chunks_wait_for_their_stage(pool):
    """zigzag: the early chunk needs only the first half of the sequence, which stage 0 brings."""
    for s in values(pool.run("nsa_plan_summary", T=64)):
        assert s["stages"] == [0, 1]


# ------------------------------------------------------------------------------------------- bad input


def assert_every_rank_raises(results, match=None, cls=sa.SparseAttnError):
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), f"rank {rank} returned {result!r} instead of raising"
        assert cls.__name__ in result.classes, f"rank {rank} raised {result!r}"
        if match is not None:
            assert match in result.message, f"rank {rank}: {result.message!r} lacks {match!r}"


def test_ranks_disagree_on_config(pool):
    results = pool.run("nsa_call", per_rank={1: dict(config=dict(CFG, window=8))})
    assert_every_rank_raises(results, "'config': the ranks disagree on config.window: rank 0 has 16, rank 1 has 8")
    results = pool.run("nsa_call", per_rank={0: dict(config=dict(CFG, scale=0.5))})
    assert_every_rank_raises(results, "config.scale: rank 0 has 0.5, rank 1 has None")
    results = pool.run("nsa_call", per_rank={pool.world_size - 1: dict(layout="contiguous")})
    assert_every_rank_raises(results, "the layout")
    results = pool.run("nsa_call", per_rank={1: dict(exchange="all_to_all")})
    assert_every_rank_raises(results, "the exchange")


def test_ranks_disagree_on_gates_and_shapes(pool):
    results = pool.run("nsa_call", per_rank={1: dict(gates=("g_cmp", "g_swa"))})
    assert_every_rank_raises(results, "the gates given: rank 0 has [g_cmp, g_slc, g_swa], rank 1 has [g_cmp, g_swa]")
    results = pool.run("nsa_call", Hq=2, per_rank={1: dict(Hq=4)})
    assert_every_rank_raises(results, "the query heads Hq: rank 0 has 2, rank 1 has 4")
    results = pool.run("nsa_call", per_rank={1: dict(dtype="float32")})
    assert_every_rank_raises(results, "the dtype: rank 0 has float64, rank 1 has float32")


def test_rank_with_bad_arguments(pool):
    """A rank whose own arguments are invalid raises its own error; the others name it, and nobody hangs."""
    results = pool.run("nsa_call", per_rank={0: dict(gate_dtype="float32")})
    assert_every_rank_raises(results)
    assert "SparseAttnDTypeError" in results[0].classes and "'g_cmp'" in results[0].message
    assert all("rank 0 rejected its arguments" in r.message for r in results[1:])
    results = pool.run("nsa_call", per_rank={1: dict(gate_tokens=3)})
    assert_every_rank_raises(results)
    assert "q's tokens and heads" in results[1].message
    results = pool.run("nsa_call", per_rank={1: dict(config=None, gates=())})
    assert_every_rank_raises(results)
    assert "no gate given" in results[1].message


def test_config_rejected_by_the_op(pool):
    """A configuration nsa_attention rejects (the compression stride must divide the block) stops every rank
    before the exchange, with the op's reason."""
    results = pool.run("nsa_call", config=dict(CFG, cmp_stride=3))
    assert_every_rank_raises(results, "does not take")
    results = pool.run("nsa_call", config=dict(CFG, num_init=2, num_local=2))  # more forced blocks than selected
    assert_every_rank_raises(results, "sparseattn.nsa_attention")


def test_config_of_the_wrong_type(pool):
    results = pool.run("nsa_call", per_rank={1: dict(config="cmp_block=8")})
    assert_every_rank_raises(results)
    assert "SparseAttnTypeError" in results[1].classes and "NSAConfig" in results[1].message
    results = pool.run("nsa_call", per_rank={1: dict(config=None)})  # None is the default config: blocks of 32
    assert_every_rank_raises(results, "config.cmp_block: rank 0 has 8, rank 1 has 32")
    assert_every_rank_raises(pool.run("nsa_call", exchange="ring"), "'exchange'")


def test_shard_lengths_that_do_not_add_up(pool):
    R = pool.world_size
    lengths = [2] * R
    lengths[0], lengths[1] = 3, 1
    assert_every_rank_raises(pool.run("nsa_call", T=2 * R, lengths=lengths), "do not add up to the zigzag sharding")


def test_packed_stream_shorter_than_cu_seqlens(pool):
    T = 4 * pool.world_size
    assert_every_rank_raises(pool.run("nsa_call", T=T, cu_seqlens=[0, 3, T + 1]), "past the")
    results = pool.run("nsa_call", T=T, cu_seqlens=[0, 3, T], per_rank={1: dict(cu_seqlens=[0, 2, T])})
    assert_every_rank_raises(results, "'cu_seqlens': the ranks disagree on its contents")


# ------------------------------------------------------------------------------ single process, no pool


def test_prefix_plan_reads_each_documents_prefix():
    """Every call's keys run from the start of its first query's document to the chunk's end (its last query),
    and packed calls list one (queries, keys) sequence per document piece."""
    cu = (0, 10, 25, 25, 37)
    for layout in sad.LAYOUTS:
        for method in ("auto", "all_to_all"):
            for rank in range(3):
                plan = nsa.make_prefix_plan(40, 3, rank, layout, cu, method)
                for chunk in plan.chunks:
                    for call in chunk.calls:
                        assert ranges.covers(plan.key_set, (call.keys,))
                        assert call.keys[0] in cu and call.keys[1] == min(chunk.queries[1], cu[-1])
                        queries = [b - a for a, b in zip(call.cu_seqlens_q, call.cu_seqlens_q[1:])]
                        keys = [b - a for a, b in zip(call.cu_seqlens_k, call.cu_seqlens_k[1:])]
                        assert all(0 < t <= s for t, s in zip(queries, keys))
                        assert sum(keys) == call.keys[1] - call.keys[0]
                        assert sum(queries) == call.q_rows[1] - call.q_rows[0]
    plan = nsa.make_prefix_plan(40, 2, 1, "zigzag", None)
    assert [(c.q_rows, c.keys) for chunk in plan.chunks for c in chunk.calls] == [((0, 10), (0, 20)),
                                                                                   ((10, 20), (0, 30))]


def test_packed_calls_take_the_forms_cuda_runs():
    """Per chunk: the document that began before it alone (a batched query chunk, S > T), then the documents that
    begin inside it in one packed call whose keys are its queries; together exactly the plan's calls."""
    cu = (0, 10, 25, 25, 37)
    for layout in sad.LAYOUTS:
        for rank in range(3):
            plan = nsa.make_prefix_plan(40, 3, rank, layout, cu)
            calls = nsa.nsa_calls(plan)
            for _, call in calls:
                if call.cu_seqlens_q is None:
                    assert call.keys[1] - call.keys[0] > call.q_rows[1] - call.q_rows[0]
                else:
                    assert call.cu_seqlens_q == call.cu_seqlens_k
                    assert call.keys[1] - call.keys[0] == call.q_rows[1] - call.q_rows[0]
            rows = [r for _, c in calls for r in range(*c.q_rows)]
            planned = [r for chunk in plan.chunks for c in chunk.calls for r in range(*c.q_rows)]
            assert rows == planned
    plan = nsa.make_prefix_plan(40, 2, 0, "zigzag", cu)  # chunks [0, 10) and [30, 40)
    assert [(stage, c.q_rows, c.keys, c.cu_seqlens_q) for stage, c in nsa.nsa_calls(plan)] == [
        (0, (0, 10), (0, 10), (0, 10)), (1, (10, 17), (25, 37), None)]
    plan = nsa.make_prefix_plan(40, 1, 0, "contiguous", None)
    assert nsa.nsa_calls(plan) == tuple((0, c) for chunk in plan.chunks for c in chunk.calls)


def test_compressed_bounds_match_the_op():
    for cu_k in ((0, 2), (0, 7, 8, 40, 40, 77), (0,)):
        for block, stride in ((8, 4), (16, 16), (32, 16)):
            expected = sa.compressed_cu_seqlens(torch.tensor(cu_k, dtype=torch.int32), block, stride).tolist()
            assert list(nsa._compressed_bounds(cu_k, (block, stride))) == expected


def test_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(sa.SparseAttnError, match="init_process_group"):
        sad.nsa_attention(q, q, q, q[..., 0])


def test_docstring_example_runs():
    """The doctest of sparseattn.distributed.nsa_attention (on a one-rank gloo group of its own)."""
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    for test in finder.find(nsa, nsa.__name__):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0 and result.attempted > 0
