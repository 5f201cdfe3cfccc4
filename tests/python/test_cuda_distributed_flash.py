"""Context-parallel flash_attention on 2 and 4 GPUs over NCCL (each world size that the machine has), in bf16/fp16: each rank's shard of the output and of
the q/k/v gradients against float64 (CPU reference), bounded by the single-GPU call's own error (see
distributed_cases.lowp_violations); bit-identical reruns; bad input raising on every rank."""

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


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{w}" for w in WORLDS])
def pool(request):
    if torch.cuda.device_count() < request.param:
        pytest.skip(f"needs {request.param} CUDA devices")
    p = Pool(request.param, backend="nccl")
    yield p
    if not p.broken:
        p.close()


# (id, kwargs of distributed_cases.compare); dtype bfloat16 unless given
CASES = [
    ("causal-d128", dict(causal=True, B=2, T=1000, Hq=8, Hkv=2, Dqk=128, Dv=128)),
    ("full-d64", dict(causal=False, T=777, Hq=4, Hkv=4, Dqk=64, Dv=64)),
    ("window-all_to_all", dict(causal=True, window=(127, 0), T=2048, Hq=8, Hkv=1, Dqk=64, Dv=64)),
    ("window-all_gather", dict(causal=True, window=(127, 0), T=1500, Hq=4, Hkv=1, Dqk=64, Dv=64,
                               exchange="all_gather")),
    ("causal-all_to_all", dict(causal=True, T=1200, Hq=4, Hkv=2, Dqk=128, Dv=128, exchange="all_to_all")),
    ("two-sided-window", dict(causal=False, window=(33, 65), T=901, Hq=4, Hkv=2, Dqk=64, Dv=64)),
    ("packed-causal", dict(causal=True, T=2000, Hq=8, Hkv=2, Dqk=128, Dv=128,
                           cu_seqlens=[0, 300, 301, 1500, 1990])),
    ("packed-window", dict(causal=True, window=(63, 0), T=1700, Hq=4, Hkv=1, Dqk=64, Dv=64,
                           cu_seqlens=[0, 700, 1100, 1700])),
    ("packed-full", dict(causal=False, T=900, Hq=4, Hkv=2, Dqk=64, Dv=64, cu_seqlens=[0, 450, 460, 900])),
    ("uneven-contiguous", dict(causal=True, T=1001, Hq=4, Hkv=2, Dqk=64, Dv=64, layout="contiguous")),
    ("rank-without-tokens", dict(causal=True, T=1, Hq=2, Hkv=1, Dqk=64, Dv=64)),
    ("gqa-192-128", dict(causal=True, T=640, Hq=16, Hkv=1, Dqk=192, Dv=128)),
    ("head-dim-256", dict(causal=True, T=333, Hq=2, Hkv=2, Dqk=256, Dv=256)),
    ("float16", dict(causal=True, window=(200, 0), T=1500, Hq=4, Hkv=2, Dqk=128, Dv=128, dtype="float16")),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_single_gpu(pool, kwargs):
    kwargs = dict(kwargs)
    dtype = kwargs.setdefault("dtype", "bfloat16")
    for rank, result in enumerate(values(pool.run("compare", **kwargs))):
        bad = lowp_violations(result, pool.world_size, dtype)
        assert not bad, f"rank {rank}: {bad}"
        assert result["bit_equal"], f"rank {rank}: two runs differ"


def test_shard_round_trip(pool):
    for layout in ("zigzag", "contiguous"):
        for T, dim in ((1001, 1), (3, 0)):
            for r in values(pool.run("round_trip", T=T, layout=layout, dim=dim)):
                assert r["equal"] and r["positions_ok"]


def assert_every_rank_raises(results, match):
    for rank, result in enumerate(results):
        assert isinstance(result, RankError), f"rank {rank} returned {result!r} instead of raising"
        assert "SparseAttnError" in result.classes and match in result.message, f"rank {rank}: {result!r}"


def test_gloo_group_with_cuda_tensors(pool):
    assert_every_rank_raises(pool.run("call", group_backend="gloo", dtype="bfloat16", D=64),
                             "gloo, which copies every tensor")


def test_nccl_group_with_cpu_tensors(pool):
    assert_every_rank_raises(pool.run("call", device="cpu"), "no gloo backend for CPU tensors")


def test_cu_seqlens_on_the_device(pool):
    results = pool.run("call", T=8, dtype="bfloat16", D=64, cu_seqlens=[0, 3, 8], cu_on_device=True)
    assert_every_rank_raises(results, "host copy")


def test_ranks_disagree(pool):
    results = pool.run("call", dtype="bfloat16", D=64, causal=True, per_rank={1: dict(causal=False)})
    assert_every_rank_raises(results, "the ranks disagree on causal")
