"""torch.compile(fullgraph=True) over the custom ops (aot_eager backend: traces the fake impls and the
registered autograd, without Inductor codegen), forward and backward equal to eager; torch.library.opcheck."""

import pytest
import torch

from helpers import assert_close64, cu_seqlens_of, gates, grads, leaf_clones, pack, qkv, randn, require_sparseattn

sa = require_sparseattn()

TINY = dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, num_init=1, num_local=1, window=16)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


def eager_vs_compiled(fn, inputs):
    outs, do = [], None
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        leaves = leaf_clones(*inputs)
        o = f(*leaves)
        if do is None:
            do = torch.randn_like(o)
        outs.append((o, grads(o, leaves, do)))
    (o_e, g_e), (o_c, g_c) = outs
    assert_close64(o_c, o_e, name="o")
    for i, (a, b) in enumerate(zip(g_c, g_e)):
        assert_close64(a, b, name=f"grad[{i}]")


def test_compile_nsa_batched():
    cfg = sa.NSAConfig(**TINY)
    q, k, v = qkv(2, 50, 4, 2, 32)
    gs = [gates(2, 50, 4) for _ in range(3)]

    def fn(q, k, v, a, b, c):
        return sa.nsa_attention(q, k, v, a, b, c, config=cfg) * 2.0

    eager_vs_compiled(fn, [q, k, v, *gs])


def test_compile_nsa_packed_user_cmp():
    cfg = sa.NSAConfig(**TINY)
    lengths = [5, 40, 23]
    cu = cu_seqlens_of(lengths)
    q, k, v = qkv(3, 40, 4, 2, 32)
    q, k, v = pack(q, lengths), pack(k, lengths), pack(v, lengths)
    n = q.shape[0]
    kc, vc = randn(n // 4, 2, 32), randn(n // 4, 2, 32)
    gs = [gates(n, 4) for _ in range(3)]

    def fn(q, k, v, kc, vc, a, b, c):
        return sa.nsa_attention(q, k, v, a, b, c, config=cfg, k_cmp=kc, v_cmp=vc, cu_seqlens=cu, max_seqlen=40)

    eager_vs_compiled(fn, [q, k, v, kc, vc, *gs])


def test_compile_pipeline_of_ops():
    """compress -> compressed attention -> select -> selected attention -> flash (window) -> combine."""
    q, k, v = qkv(1, 60, 4, 2, 32)
    gs = [gates(1, 60, 4) for _ in range(3)]
    bias = randn(1, 1, 60, 60)

    def fn(q, k, v, bias, a, b, c):
        kc, vc = sa.compress_kv(k, v, block=8, stride=4)
        o_c, lse = sa.compressed_attention(q, kc, vc, block=8, stride=4)
        idx = sa.select_blocks(q, kc, lse, cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3)
        o_s, _ = sa.selected_attention(q, k, v, idx, block=16)
        o_w = sa.flash_attention(q, k, v, causal=True, window=(15, 0), bias=bias)
        return sa.combine(o_c, o_s, o_w, a, b, c)

    eager_vs_compiled(fn, [q, k, v, bias, *gs])


def test_compile_flash_gated():
    """Gated flash_attention (CPU only) with both thresholds, and create_mask feeding a mask: the gradients of
    q, k, v, alpha and delta through the registered autograd."""
    q, k, v = qkv(1, 30, 4, 2, 16)
    alpha, delta = randn(1, 30, 4), randn(1, 30, 2)
    bias = randn(1, 2, 30, 30)

    def fn(q, k, v, alpha, delta):
        mask = sa.create_mask(bias, 12, causal=True)
        o = sa.flash_attention(q, k, v, causal=True, alpha=alpha, delta=delta, gate_threshold=-4.0,
                               softmax_threshold=0.02, threshold_block=(8, 4))
        return o + sa.flash_attention(q, k, v, causal=True, mask=mask, bias=bias, alpha=alpha, delta=delta,
                                      gate="product")

    eager_vs_compiled(fn, [q, k, v, alpha, delta])


# flash_attention_gated / _product: the same op called with alpha and delta (recorded under their own names).
# flash_attention_packed: packed q/k/v with a row-form mask and a key-form bias; flash_attention_tiles: a block-sparse
# tile mask and per-head windows.
OPS = ["compress_kv", "compressed_attention", "select_blocks", "selected_attention", "flash_attention",
       "flash_attention_gated", "flash_attention_product", "flash_attention_packed", "flash_attention_tiles",
       "combine", "nsa_attention", "create_mask"]


@pytest.fixture(scope="module")
def recorded_calls():
    """Every sparseattn op as the functional API calls it (captured with a dispatch-mode recorder)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = {}

    class Recorder(TorchDispatchMode):
        def __init__(self, suffix=""):
            super().__init__()
            self.suffix = suffix

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "sparseattn":
                calls.setdefault(func.name().split("::")[-1].split(".")[0] + self.suffix, (func, args, kwargs))
            return func(*args, **kwargs)

    torch.manual_seed(0)
    cfg = sa.NSAConfig(**TINY)
    q, k, v = qkv(1, 40, 4, 2, 16, requires_grad=True)
    gs = [gates(1, 40, 4, requires_grad=True) for _ in range(3)]
    bias = randn(1, 2, 40, 40, requires_grad=True)
    with Recorder():
        kc, vc = sa.compress_kv(k, v, block=8, stride=4)
        _, lse = sa.compressed_attention(q, kc, vc, block=8, stride=4)
        idx = sa.select_blocks(q, kc, lse, cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3)
        sa.selected_attention(q, k, v, idx, block=16)
        sa.flash_attention(q, k, v, causal=True, bias=bias, mask=torch.rand(1, 1, 40, 40) > 0.2)
        sa.combine(q, q, q, *gs)
        sa.nsa_attention(q, k, v, *gs, config=cfg)
        sa.create_mask(bias.detach(), 5, causal=True, key_padding_mask=torch.rand(1, 40) < 0.8, window=(9, 0))
    alpha, delta = randn(1, 40, 4, requires_grad=True), randn(1, 40, 2, requires_grad=True)
    with Recorder("_gated"):
        sa.flash_attention(q, k, v, causal=True, alpha=alpha, delta=delta, gate_threshold=-3.0,
                           softmax_threshold=0.05, threshold_block=(8, 4))
    with Recorder("_product"):
        sa.flash_attention(q, k, v, bias=bias, alpha=alpha, delta=delta, gate="product")
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    qp, kp, vp = (t.detach()[0].requires_grad_(True) for t in (q, k, v))
    key_bias = randn(2, 40, requires_grad=True)
    with Recorder("_packed"):
        sa.flash_attention(qp, kp, vp, causal=True, mask=torch.rand(1, 40, 25) > 0.2, bias=key_bias, cu_seqlens_q=cu,
                           cu_seqlens_k=cu, max_seqlen_q=25, max_seqlen_k=25)
    with Recorder("_tiles"):
        sa.flash_attention(q, k, v, block_mask=torch.rand(1, 4, 5, 5) > 0.3, block_size=(8, 8),
                           window=(torch.tensor([3, -1, 7, -1], dtype=torch.int32), -1))
    return calls


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op, recorded_calls):
    """torch.library.opcheck: schema, fake impl, autograd registration, AOT dispatch (static and dynamic)."""
    assert op in recorded_calls, f"sparseattn::{op} was not dispatched; recorded: {sorted(recorded_calls)}"
    func, args, kwargs = recorded_calls[op]
    torch.library.opcheck(func, args, kwargs)
