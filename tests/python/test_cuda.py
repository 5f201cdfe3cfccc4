"""CUDA tensors (marked `gpu`, skipped without a CUDA device).

Today the CUDA kernels are not all there: every op on CUDA tensors must either raise
SparseAttnUnsupportedError (a NotImplementedError) before doing anything, or, where a kernel exists, agree
with the CPU reference. Mixed devices are an argument error.
"""

import pytest
import torch

from helpers import cu_seqlens_of, gates, qkv, raises_arg, require_sparseattn

sa = require_sparseattn()
pytestmark = pytest.mark.gpu

TINY = dict(cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, num_init=1, num_local=1, window=16)


def cases(dtype):
    q, k, v = qkv(2, 40, 4, 2, 64, dtype=torch.float32)
    g = gates(2, 40, 4, dtype=torch.float32)
    kc, vc = sa.compress_kv(k, v, block=8, stride=4)
    _, lse = sa.compressed_attention(q, kc, vc, block=8, stride=4)
    idx = sa.select_blocks(q, kc, lse, cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3)
    cfg = sa.NSAConfig(**TINY)
    cpu = dict(q=q, k=k, v=v, g=g, kc=kc, vc=vc, lse=lse, idx=idx)
    ops = {
        "compress_kv": lambda a: sa.compress_kv(a["k"], a["v"], block=8, stride=4),
        "compressed_attention": lambda a: sa.compressed_attention(a["q"], a["kc"], a["vc"], block=8, stride=4),
        "select_blocks": lambda a: sa.select_blocks(a["q"], a["kc"], a["lse"], cmp_block=8, cmp_stride=4,
                                                    sel_block=16, num_selected=3),
        "selected_attention": lambda a: sa.selected_attention(a["q"], a["k"], a["v"], a["idx"], block=16),
        "flash_attention": lambda a: sa.flash_attention(a["q"], a["k"], a["v"], causal=True),
        "combine": lambda a: sa.combine(a["q"], a["q"], a["q"], a["g"], a["g"], a["g"]),
        "nsa_attention": lambda a: sa.nsa_attention(a["q"], a["k"], a["v"], a["g"], a["g"], a["g"], config=cfg),
    }
    return cpu, ops


def to_dtype(a, dtype):
    return {n: (x.to(dtype) if x.is_floating_point() and n != "lse" else x) for n, x in a.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("op", ["compress_kv", "compressed_attention", "select_blocks", "selected_attention",
                                "flash_attention", "combine", "nsa_attention"])
def test_cuda_unsupported_or_correct(op, dtype):
    cpu, ops = cases(dtype)
    cpu = to_dtype(cpu, dtype)
    dev = {n: x.cuda() for n, x in cpu.items()}
    try:
        out = ops[op](dev)
    except sa.SparseAttnUnsupportedError as e:
        assert isinstance(e, NotImplementedError)
        return
    ref = ops[op](cpu)
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(out, ref):
        assert a.device.type == "cuda"
        if a.dtype == torch.int32:
            assert torch.equal(a.cpu(), b)
        else:
            torch.testing.assert_close(a.cpu().float(), b.float(), atol=tol, rtol=tol)


def test_cuda_mixed_devices():
    q, k, v = qkv(1, 20, 2, 1, 64, dtype=torch.float32)
    with raises_arg(sa.SparseAttnError, "k"):
        sa.flash_attention(q.cuda(), k, v.cuda())
    with raises_arg(sa.SparseAttnError, "v"):
        sa.compress_kv(k.cuda(), v, block=8, stride=4)
    cu = cu_seqlens_of([20])
    with raises_arg(sa.SparseAttnError, "cu_seqlens"):
        sa.compress_kv(k[0].cuda(), v[0].cuda(), block=8, stride=4, cu_seqlens=cu)
    g = gates(1, 20, 2, dtype=torch.float32)
    with raises_arg(sa.SparseAttnError, "g_swa"):
        sa.nsa_attention(q.cuda(), k.cuda(), v.cuda(), None, None, g, config=sa.NSAConfig(**TINY))
