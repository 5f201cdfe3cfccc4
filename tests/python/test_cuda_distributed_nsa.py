"""Context-parallel nsa_attention on 2 and 4 GPUs over NCCL (each world size that the machine has), in bf16/fp16: each rank's shard of the output and of the
gradients of q, k, v and the gates against float64 (CPU reference), bounded by the single-GPU call's own error
(distributed_cases.lowp_violations); bit-identical reruns; bad input raising on every rank.

Most cases select every candidate block (num_selected at least the sequence's selection blocks), so that a near-tie
of selection scores, which bf16 and float64 may break differently, cannot move a block; compression, the window and
the gates still run over the prefix each chunk gathers. Two cases keep the NSA defaults (top 16 of up to 64 blocks).

Where this build's CUDA nsa_attention takes no query chunk, every rank raises SparseAttnUnsupportedError before the
exchange (tested), and the comparisons skip with the op's reason."""

import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
import torch.distributed as dist  # noqa: E402

from distributed_cases import lowp_violations  # noqa: E402
from distributed_pool import Pool, RankError, values  # noqa: E402

WORLDS = (2, 4)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < min(WORLDS), reason=f"needs {min(WORLDS)} CUDA devices"),
    pytest.mark.skipif(not sa.built_with_cuda(), reason="needs a CUDA build of sparseattn"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(), reason="needs NCCL"),
]

SMALL = dict(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=64, num_init=1, num_local=2, window=64)


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def pool(request):
    if torch.cuda.device_count() < request.param:
        pytest.skip(f"needs {request.param} CUDA devices")
    p = Pool(request.param, backend="nccl")
    yield p
    if not p.broken:
        p.close()


@pytest.fixture(scope="module")
def chunk_unsupported(pool):
    """None when every rank runs a sharded call, else the reason every rank gave for rejecting it."""
    results = pool.run("nsa_call", T=300, Hq=4, Hkv=1, D=64, dtype="bfloat16", config=SMALL)
    if all(not isinstance(r, RankError) for r in results):
        return None
    if all(isinstance(r, RankError) and "SparseAttnUnsupportedError" in r.classes for r in results):
        return results[0].message
    raise AssertionError(f"the ranks neither all ran nor all rejected the call: {results}")


def test_every_rank_runs_or_every_rank_rejects(pool, chunk_unsupported):
    """The chunk support of the op is decided on every rank before the exchange: both run, or both raise
    SparseAttnUnsupportedError naming the query chunk (and then return to the next call without hanging)."""
    if chunk_unsupported is not None:
        assert "query chunk" in chunk_unsupported, chunk_unsupported
    values(pool.run("round_trip", T=17, layout="zigzag"))  # the group still works


# (id, kwargs of distributed_cases.nsa_compare); dtype bfloat16 unless given
CASES = [
    ("all-selected-d128", dict(T=2048, B=1, Hq=8, Hkv=2, Dqk=128, Dv=128,
                               config=dict(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=32, window=512))),
    ("batch-2-d64", dict(T=1000, B=2, Hq=4, Hkv=1, Dqk=64, Dv=64, config=SMALL)),
    ("contiguous-uneven", dict(T=1001, B=1, Hq=4, Hkv=2, Dqk=64, Dv=64, config=SMALL, layout="contiguous")),
    ("packed", dict(T=1800, Hq=4, Hkv=1, Dqk=64, Dv=64, config=SMALL, cu_seqlens=[0, 500, 501, 1500, 1790])),
    ("packed-short-all_to_all", dict(T=1600, Hq=4, Hkv=2, Dqk=128, Dv=128, config=SMALL, exchange="all_to_all",
                                     cu_seqlens=[0, 90, 300, 333, 700, 1000, 1005, 1300, 1600])),
    ("some-gates", dict(T=900, B=1, Hq=4, Hkv=1, Dqk=64, Dv=64, config=SMALL, gates=("g_cmp", "g_slc"))),
    ("rank-without-tokens", dict(T=1, B=1, Hq=2, Hkv=1, Dqk=64, Dv=64, config=SMALL)),
    ("gqa-192-128", dict(T=640, B=1, Hq=16, Hkv=1, Dqk=192, Dv=128, config=SMALL)),
    ("float16", dict(T=1200, B=1, Hq=4, Hkv=2, Dqk=128, Dv=128, config=SMALL, dtype="float16")),
    ("defaults", dict(T=4096, B=1, Hq=8, Hkv=2, Dqk=128, Dv=128)),
    ("defaults-packed", dict(T=3000, Hq=4, Hkv=1, Dqk=128, Dv=128, cu_seqlens=[0, 1200, 1210, 3000])),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_single_gpu(pool, chunk_unsupported, kwargs):
    if chunk_unsupported is not None:
        pytest.skip(f"this build's CUDA nsa_attention takes no query chunk: {chunk_unsupported}")
    kwargs = dict(kwargs)
    dtype = kwargs.setdefault("dtype", "bfloat16")
    for rank, result in enumerate(values(pool.run("nsa_compare", **kwargs))):
        bad = lowp_violations(result, pool.world_size, dtype)
        assert not bad, f"rank {rank}: {bad}; max differences to the single-GPU call: {result['max_diff_single']}"
        assert result["bit_equal"], f"rank {rank}: two runs differ"


def assert_every_rank_raises(results, match):
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), f"rank {rank} returned {result!r} instead of raising"
        assert "SparseAttnError" in result.classes and match in result.message, f"rank {rank}: {result!r}"


def test_gloo_group_with_cuda_tensors(pool):
    assert_every_rank_raises(pool.run("nsa_call", group_backend="gloo", dtype="bfloat16", D=64),
                             "gloo, which copies every tensor")


def test_nccl_group_with_cpu_tensors(pool):
    assert_every_rank_raises(pool.run("nsa_call", device="cpu"), "no gloo backend for CPU tensors")


def test_ranks_disagree(pool):
    results = pool.run("nsa_call", dtype="bfloat16", D=64, per_rank={1: dict(gates=("g_swa",))})
    assert_every_rank_raises(results, "the gates given")


def test_float32_is_rejected_on_every_rank(pool):
    """The CUDA pipeline takes bf16/fp16: float32 CUDA tensors stop every rank before the exchange."""
    results = pool.run("nsa_call", dtype="float32", D=64)
    assert_every_rank_raises(results, "sparseattn.nsa_attention")
    assert all("SparseAttnUnsupportedError" in r.classes for r in results)
