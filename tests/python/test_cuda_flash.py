"""CUDA flash_attention (forward and backward) against float64 (see attention_check.py for the bound)."""
import pytest
import torch

import sparseattn
from sparseattn import _ops
from attention_check import flash_visible, naive_attention, naive_packed, run_and_compare

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
    reason="needs a CUDA GPU and a CUDA build of sparseattn",
)

DTYPES = [torch.bfloat16, torch.float16]


def naive_flash(q, k, v, causal, window, scale):
    """Batched [B, T, H, D] naive flash attention; lse [B, Hq, T]."""
    vis = flash_visible(q.shape[1], k.shape[1], causal, window[0], window[1], q.device)
    outs = [naive_attention(q[b], k[b], v[b], vis, scale) for b in range(q.shape[0])]
    return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])


# (B, T, S, Hq, Hkv, Dqk, Dv, causal, window)
CASES = [
    (2, 63, 63, 4, 2, 64, 64, True, (-1, -1)),
    (1, 65, 65, 3, 1, 128, 128, False, (-1, -1)),
    (1, 1000, 1000, 8, 1, 64, 64, True, (100, -1)),
    (1, 1, 1, 2, 2, 256, 256, True, (-1, -1)),
    (1, 200, 333, 7, 1, 192, 128, True, (-1, -1)),
    (1, 333, 200, 16, 1, 64, 64, True, (-1, -1)),
    (1, 130, 130, 32, 1, 64, 64, False, (5, 7)),
    (2, 100, 100, 4, 4, 256, 256, True, (31, 0)),
    (1, 257, 257, 2, 1, 192, 128, False, (-1, 20)),
    (1, 4097, 4097, 2, 1, 128, 128, True, (-1, -1)),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}T{}S{}H{}-{}D{}-{}c{}w{}".format(*c[:8], c[8]))
def test_flash_batched(attention_mma, dtype, case):
    B, T, S, Hq, Hkv, Dqk, Dv, causal, window = case
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    scale = Dqk ** -0.5

    def op(q, k, v):
        return sparseattn.flash_attention(q, k, v, causal=causal, window=window, return_lse=True)

    def ref(q, k, v):
        return naive_flash(q, k, v, causal, window, scale)

    run_and_compare(op, ref, (q, k, v), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(-1, -1), (40, -1)])
@pytest.mark.parametrize("dims", [(128, 128), (64, 64)])
def test_flash_varlen(attention_mma, dtype, window, dims):
    lengths_q = [0, 1, 5, 64, 300, 1000, 7]
    lengths_k = [3, 0, 70, 64, 299, 1001, 7]
    Hq, Hkv = 4, 2
    Dqk, Dv = dims
    cu_q = torch.tensor([0] + torch.tensor(lengths_q).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + torch.tensor(lengths_k).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu_q[-1]), Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(int(cu_k[-1]), Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(int(cu_k[-1]), Hkv, Dv, dtype=dtype, device="cuda")
    scale = Dqk ** -0.5

    def op(q, k, v):
        return sparseattn.flash_attention(q, k, v, causal=True, window=window, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                          max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), return_lse=True)

    def ref(q, k, v):
        return naive_packed(q, k, v, cu_q, cu_k, lambda b, t, s: flash_visible(t, s, True, *window, q.device), scale)

    run_and_compare(op, ref, (q, k, v), dtype)


def test_naive_matches_cpu_reference():
    q, k, v = (torch.randn(1, 70, h, 64, dtype=torch.float64) for h in (4, 2, 2))
    o_ref, lse_ref = sparseattn.flash_attention(q, k, v, causal=True, window=(9, -1), return_lse=True)
    o, lse = naive_flash(q, k, v, True, (9, -1), 64 ** -0.5)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(lse, lse_ref)


def test_unsupported_on_cuda():
    q = torch.randn(1, 8, 2, 96, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="head dims"):
        sparseattn.flash_attention(q, q, q)
    q = torch.randn(1, 8, 2, 64, dtype=torch.float32, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="float32"):
        sparseattn.flash_attention(q, q, q)
    # The C++ API takes the dense tile map on CUDA; FlexAttention's lists raise there (the Python function converts
    # them: test_flash_lists_on_cuda_are_the_dense_map).
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16, device="cuda")
    counts = torch.ones(1, 1, 1, dtype=torch.int32, device="cuda")
    indices = torch.zeros(1, 1, 1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="block_mask"):
        _ops.flash_attention(q, q, q, None, None, None, None, 0, 0, False, -1, -1, None, kv_num_blocks=counts,
                             kv_indices=indices, block_q=8, block_k=8)


def test_flash_lists_on_cuda_are_the_dense_map():
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(2, 300, h, 64, dtype=torch.bfloat16, device="cuda", generator=gen) for h in (4, 2, 2))
    n = -(-300 // 64)
    counts = torch.randint(0, n + 1, (2, 2, n), dtype=torch.int32, device="cuda", generator=gen)
    indices = torch.stack([torch.randperm(n, device="cuda", generator=gen) for _ in range(2 * 2 * n)]).view(2, 2, n, n)
    indices = indices.sort(dim=-1).values.int()
    o_lists = sparseattn.flash_attention(q, k, v, kv_num_blocks=counts, kv_indices=indices, block_size=(64, 64))
    slots = torch.arange(n, device="cuda")
    tiles = torch.zeros(2, 2, n, n, dtype=torch.bool, device="cuda")
    tiles.scatter_(-1, indices.long(), slots < counts[..., None])
    o_map = sparseattn.flash_attention(q, k, v, block_mask=tiles, block_size=(64, 64))
    torch.testing.assert_close(o_lists, o_map, rtol=0, atol=0)
    o_ref = sparseattn.flash_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), kv_num_blocks=counts.cpu(),
                                       kv_indices=indices.cpu(), block_size=(64, 64))
    torch.testing.assert_close(o_lists.float().cpu(), o_ref, rtol=2e-2, atol=2e-2)


def test_too_long_sequence_is_a_clear_error():
    """The grids tile a sequence in at most 65535 tiles of 64 rows: longer ones are refused before any launch."""
    limit = 65535 * 64
    x = torch.zeros(limit + 1, 1, 64, dtype=torch.bfloat16, device="cuda")
    cu = torch.tensor([0, limit + 1], dtype=torch.int32, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="tokens"):
        sparseattn.flash_attention(x, x, x, causal=True, window=(63, 0), cu_seqlens_q=cu, cu_seqlens_k=cu)
