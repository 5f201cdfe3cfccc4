"""CUDA compressed_attention (forward and backward) against float64 (see attention_check.py for the bound)."""
import pytest
import torch

import sparseattn
from attention_check import cmp_visible, naive_attention, naive_packed, num_blocks, run_and_compare

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
    reason="needs a CUDA GPU and a CUDA build of sparseattn",
)

DTYPES = [torch.bfloat16, torch.float16]


# (B, T, Hq, Hkv, Dqk, Dv, block, stride)
CASES = [
    (2, 63, 4, 1, 64, 64, 32, 16),
    (1, 1, 2, 1, 128, 128, 32, 16),
    (1, 31, 2, 2, 64, 64, 32, 16),
    (1, 65, 8, 1, 192, 128, 32, 16),
    (2, 1000, 16, 2, 128, 128, 32, 16),
    (1, 1000, 3, 1, 256, 256, 64, 64),
    (1, 4097, 4, 1, 192, 128, 32, 16),
    (1, 777, 2, 1, 64, 64, 8, 4),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}H{}-{}D{}-{}l{}d{}".format(*c))
def test_compressed_batched(attention_mma, dtype, case):
    B, T, Hq, Hkv, Dqk, Dv, block, stride = case
    Tc = num_blocks(T, block, stride)
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, Tc, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, Tc, Hkv, Dv, dtype=dtype, device="cuda")
    scale = Dqk ** -0.5
    vis = cmp_visible(T, Tc, block, stride, "cuda")

    def op(q, k, v):
        return sparseattn.compressed_attention(q, k, v, block=block, stride=stride)

    def ref(q, k, v):
        outs = [naive_attention(q[b], k[b], v[b], vis, scale) for b in range(B)]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])

    run_and_compare(op, ref, (q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims,group", [((64, 64), 4), ((192, 128), 1), ((256, 256), 2)])
def test_compressed_varlen(attention_mma, dtype, dims, group):
    lengths = [0, 1, 31, 32, 47, 1000, 65]
    block, stride = 32, 16
    Hkv = 2
    Hq = Hkv * group
    Dqk, Dv = dims
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    blocks = [num_blocks(n, block, stride) for n in lengths]
    cu_cmp = torch.tensor([0] + torch.tensor(blocks).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(int(cu_cmp[-1]), Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(int(cu_cmp[-1]), Hkv, Dv, dtype=dtype, device="cuda")
    scale = Dqk ** -0.5

    def op(q, k, v):
        return sparseattn.compressed_attention(q, k, v, block=block, stride=stride, cu_seqlens=cu,
                                               cu_seqlens_cmp=cu_cmp)

    def ref(q, k, v):
        return naive_packed(q, k, v, cu, cu_cmp, lambda b, n, nc: cmp_visible(n, nc, block, stride, q.device), scale)

    run_and_compare(op, ref, (q, k, v), dtype)


def test_naive_matches_cpu_reference():
    T, block, stride = 90, 32, 16
    Tc = num_blocks(T, block, stride)
    q = torch.randn(1, T, 4, 64, dtype=torch.float64)
    k, v = (torch.randn(1, Tc, 2, 64, dtype=torch.float64) for _ in range(2))
    o_ref, lse_ref = sparseattn.compressed_attention(q, k, v, block=block, stride=stride)
    o, lse = naive_attention(q[0], k[0], v[0], cmp_visible(T, Tc, block, stride, "cpu"), 64 ** -0.5)
    torch.testing.assert_close(o, o_ref[0])
    torch.testing.assert_close(lse, lse_ref[0])


def test_unsupported_head_dim_on_cuda():
    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 3, 2, 64, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, 3, 2, 32, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="head dims"):
        sparseattn.compressed_attention(q, k, v)
