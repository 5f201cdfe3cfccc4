"""flash_attention's decode-shaped CUDA calls (1 to 16 queries, no gradient, no optional feature) go to the split-KV
decode kernel and give the attention of the CPU reference; calls that need a gradient or a feature do not."""
import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
import sparseattn.functional as functional  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not sa.built_with_cuda(),
                                reason="needs a CUDA GPU and a build with CUDA kernels")


@pytest.fixture
def decode_calls(monkeypatch):
    calls = []
    real = functional._decode.flash_decode

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(functional._decode, "flash_decode", spy)
    return calls


@pytest.mark.parametrize("tq,window", [(1, (-1, -1)), (5, (100, 0)), (16, (-1, -1))])
def test_decode_shaped_calls_use_the_decode_kernel(decode_calls, tq, window):
    gen = torch.Generator(device="cuda").manual_seed(tq)
    q = torch.randn(2, tq, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(2, 3000, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(2, 3000, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    with torch.no_grad():
        o, lse = sa.flash_attention(q, k, v, causal=True, window=window, return_lse=True)
    assert len(decode_calls) == 1
    o_ref, lse_ref = sa.flash_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), causal=True, window=window,
                                        return_lse=True)
    torch.testing.assert_close(o.float().cpu(), o_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.cpu(), lse_ref, rtol=1e-3, atol=1e-3)


def test_calls_that_need_a_gradient_or_a_feature_keep_the_attention_kernels(decode_calls):
    q = torch.randn(1, 4, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 500, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 500, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    o = sa.flash_attention(q, k, v, causal=True)
    o.sum().backward()
    assert q.grad is not None and decode_calls == []
    with torch.no_grad():
        sa.flash_attention(q, k, v, causal=True, mask=torch.ones(1, 1, 1, 500, dtype=torch.bool, device="cuda"))
        sa.flash_attention(q[:, :1].repeat(1, 17, 1, 1), k, v, causal=True)  # 17 queries
    assert decode_calls == []
