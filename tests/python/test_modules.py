"""nn.Modules: NativeSparseAttentionCore (== nsa_attention) and NativeSparseAttention (projections, gates,
rotary): shapes, dtypes, backward, packed == batched (rotary positions restart at every sequence)."""

import pytest
import torch

import naive_nsa as nv
from helpers import assert_close64, cu_seqlens_of, gates, pack, qkv, randn, require_sparseattn, unpack

sa = require_sparseattn()

TINY = dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, num_init=1, num_local=1, window=16)


def test_core_equals_functional():
    cfg = sa.NSAConfig(**TINY)
    core = sa.NativeSparseAttentionCore(cfg)
    assert isinstance(core, torch.nn.Module)
    q, k, v = qkv(2, 50, 4, 2, 32)
    gs = [gates(2, 50, 4) for _ in range(3)]
    assert_close64(core(q, k, v, *gs), sa.nsa_attention(q, k, v, *gs, config=cfg))
    assert_close64(core(q, k, v, *gs), nv.nsa_attention(q, k, v, *gs, config=cfg))
    lengths = [3, 50]
    cu = cu_seqlens_of(lengths)
    packed = [pack(x, lengths) for x in (q, k, v, *gs)]
    assert_close64(core(*packed, cu_seqlens=cu, max_seqlen=50),
                   sa.nsa_attention(*packed, config=cfg, cu_seqlens=cu, max_seqlen=50))


def test_core_default_config():
    core = sa.NativeSparseAttentionCore()
    q, k, v = qkv(1, 40, 2, 1, 16)
    g = gates(1, 40, 2)
    assert_close64(core(q, k, v, g, g, g), sa.nsa_attention(q, k, v, g, g, g))


def make(dtype=torch.float64, **kw):
    args = dict(hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=16, config=sa.NSAConfig(**TINY), dtype=dtype)
    args.update(kw)
    return sa.NativeSparseAttention(**args)


@pytest.mark.parametrize("kw", [dict(), dict(rotary=False), dict(v_head_dim=8), dict(bias=True),
                                dict(num_kv_heads=1, num_heads=3, head_dim=24), dict(num_kv_heads=4)],
                         ids=["default", "norope", "dv8", "bias", "G3", "G1"])
def test_module_shapes_and_backward(kw):
    m = make(**kw)
    assert isinstance(m, torch.nn.Module)
    params = list(m.parameters())
    assert params and all(p.dtype == torch.float64 for p in params)
    if kw.get("bias"):
        assert any(n.endswith("bias") for n, _ in m.named_parameters()), [n for n, _ in m.named_parameters()]
    x = randn(2, 45, 48, requires_grad=True)
    y = m(x)
    assert y.shape == (2, 45, 48) and y.dtype == torch.float64
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    for n, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, f"parameter {n} got an all-zero gradient"


@pytest.mark.parametrize("rotary", [True, False])
def test_module_packed_equals_batched(rotary):
    """Each packed sequence equals the module run on it alone: rotary positions restart per sequence."""
    m = make(rotary=rotary)
    lengths = [1, 45, 17, 32]
    x = randn(len(lengths), max(lengths), 48)
    cu = cu_seqlens_of(lengths)
    xp = pack(x, lengths).requires_grad_(True)
    yp = m(xp, cu_seqlens=cu, max_seqlen=max(lengths))
    assert yp.shape == xp.shape
    for b, (n, yb) in enumerate(zip(lengths, unpack(yp, lengths))):
        ref = m(x[b : b + 1, :n])
        assert_close64(yb, ref[0], name=f"sequence {b}")


def test_module_float32_and_device_arg():
    m = make(dtype=torch.float32, device="cpu")
    x = randn(1, 33, 48, dtype=torch.float32)
    y = m(x)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_module_lowp(dtype):
    m = make(dtype=dtype)
    x = randn(2, 40, 48, dtype=dtype, requires_grad=True)
    y = m(x)
    assert y.dtype == dtype and torch.isfinite(y).all()
    y.float().sum().backward()
    assert torch.isfinite(x.grad).all()
