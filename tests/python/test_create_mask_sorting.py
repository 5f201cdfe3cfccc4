"""The sorting implementation of create_mask that CUDA tensors use (python/sparseattn/_topk_mask.py), run on CPU
tensors against the C++ reference: ties, NaN, infinities, padding, windows, every dtype, rows processed in chunks."""
import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
from sparseattn import _topk_mask  # noqa: E402


def rounded_bias(gen, shape, dtype):
    """Few distinct values (many ties), with NaN and both infinities sprinkled in."""
    bias = torch.randint(-3, 4, shape, generator=gen).double() / 2
    special = torch.rand(shape, generator=gen)
    bias[special < 0.05] = float("nan")
    bias[(special >= 0.05) & (special < 0.08)] = float("inf")
    bias[(special >= 0.08) & (special < 0.11)] = -float("inf")
    return bias.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0)), (False, (3, 2))])
@pytest.mark.parametrize("keep", [1, 4, 40])
def test_sorting_matches_the_reference(dtype, causal, window, keep, monkeypatch):
    monkeypatch.setattr(_topk_mask, "_CHUNK_ELEMENTS", 2 * 3 * 23 * 4)  # 4 rows per chunk: several chunks
    gen = torch.Generator().manual_seed(keep * 7 + int(causal))
    bias = rounded_bias(gen, (2, 3, 17, 23), dtype)
    padding = torch.rand(2, 23, generator=gen) > 0.2
    got = _topk_mask.create_mask(bias, padding, keep, causal, *window)
    expected = sa.create_mask(bias, keep, causal=causal, key_padding_mask=padding, window=window)
    assert torch.equal(got, expected)


def test_empty_and_decode_shapes():
    gen = torch.Generator().manual_seed(1)
    assert _topk_mask.create_mask(torch.zeros(1, 1, 0, 5), None, 2, True, -1, -1).shape == (1, 1, 0, 5)
    bias = rounded_bias(gen, (1, 2, 1, 300), torch.float32)
    assert torch.equal(_topk_mask.create_mask(bias, None, 8, True, -1, -1), sa.create_mask(bias, 8, causal=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_create_mask_on_cuda_matches_the_cpu_reference():
    gen = torch.Generator().manual_seed(2)
    bias = rounded_bias(gen, (2, 4, 64, 200), torch.bfloat16)
    padding = torch.rand(2, 200, generator=gen) > 0.1
    got = sa.create_mask(bias.cuda(), 16, causal=True, key_padding_mask=padding.cuda())
    assert torch.equal(got.cpu(), sa.create_mask(bias, 16, causal=True, key_padding_mask=padding))
