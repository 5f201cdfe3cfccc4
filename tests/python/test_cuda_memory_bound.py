"""GPU kernels of the memory-bound ops (compress_kv, combine) against the float64 CPU reference."""
import pytest
import torch

import sparseattn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
    reason="needs a CUDA GPU and a CUDA build of sparseattn",
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def poison_allocator():
    """Fill recently freed cached blocks with NaN so that an unwritten output element shows up."""
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    block.fill_(0xFF)  # 0xFFFF is NaN in fp16/bf16 and 0xFFFFFFFF in fp32
    del block


def tolerance(dtype):
    return {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]


def assert_close(got, ref, dtype):
    got = got.double().cpu()
    assert not torch.isnan(got).any(), "unwritten or NaN elements"
    # One rounding of the output to `dtype` plus fp32 accumulation: relative to the reference's scale.
    scale = ref.abs().max().clamp_min(1e-6)
    assert (got - ref).abs().max() <= tolerance(dtype) * scale


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block,stride", [(32, 16), (64, 64), (8, 4)])
def test_compress_kv_batched(dtype, block, stride):
    B, T, H, Dk, Dv = 2, 301, 11, 192, 128  # 11 heads: the backward's warps take runs of 8 and 3
    k = torch.randn(B, T, H, Dk, dtype=dtype, device="cuda", requires_grad=True)
    v = torch.randn(B, T, H, Dv, dtype=dtype, device="cuda", requires_grad=True)
    poison_allocator()
    k_cmp, v_cmp = sparseattn.compress_kv(k, v, block=block, stride=stride)
    k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (k, v))
    k_ref, v_ref = sparseattn.compress_kv(k64, v64, block=block, stride=stride)
    assert_close(k_cmp, k_ref.detach(), dtype)
    assert_close(v_cmp, v_ref.detach(), dtype)

    dk_cmp, dv_cmp = torch.randn_like(k_cmp), torch.randn_like(v_cmp)
    poison_allocator()
    dk, dv = torch.autograd.grad((k_cmp, v_cmp), (k, v), (dk_cmp, dv_cmp))
    dk_ref, dv_ref = torch.autograd.grad((k_ref, v_ref), (k64, v64), (dk_cmp.double().cpu(), dv_cmp.double().cpu()))
    assert_close(dk, dk_ref, dtype)
    assert_close(dv, dv_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_kv_unaligned_rows(dtype):
    """Views one element into their storage: rows not 16-byte aligned take the element-wise kernels."""
    B, T, H, D = 2, 133, 3, 64
    k_store = torch.randn(B, T, H, D + 1, dtype=dtype, device="cuda", requires_grad=True)
    v_store = torch.randn(B, T, H, D + 1, dtype=dtype, device="cuda", requires_grad=True)
    k, v = k_store[..., 1:], v_store[..., 1:]
    poison_allocator()
    k_cmp, v_cmp = sparseattn.compress_kv(k, v, block=32, stride=16)
    k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (k, v))
    k_ref, v_ref = sparseattn.compress_kv(k64, v64, block=32, stride=16)
    assert_close(k_cmp, k_ref.detach(), dtype)
    assert_close(v_cmp, v_ref.detach(), dtype)
    grads = tuple(torch.randn(*x.shape[:-1], D + 1, dtype=dtype, device="cuda")[..., 1:] for x in (k_cmp, v_cmp))
    poison_allocator()
    dk, dv = torch.autograd.grad((k_cmp, v_cmp), (k_store, v_store), grads)
    dk_ref, dv_ref = torch.autograd.grad((k_ref, v_ref), (k64, v64), tuple(g.double().cpu() for g in grads))
    assert_close(dk[..., 1:], dk_ref, dtype)
    assert_close(dv[..., 1:], dv_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_kv_packed(dtype):
    lengths = [1, 31, 32, 65, 1000, 47]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    N, H, D = int(cu[-1]), 2, 64
    k = torch.randn(N, H, D, dtype=dtype, device="cuda", requires_grad=True)
    v = torch.randn(N, H, D, dtype=dtype, device="cuda", requires_grad=True)
    poison_allocator()
    k_cmp, v_cmp = sparseattn.compress_kv(k, v, block=32, stride=16, cu_seqlens=cu.cuda())
    k64, v64 = (x.detach().double().cpu().requires_grad_() for x in (k, v))
    k_ref, v_ref = sparseattn.compress_kv(k64, v64, block=32, stride=16, cu_seqlens=cu)
    assert_close(k_cmp, k_ref.detach(), dtype)  # includes the zeroed tail rows
    assert_close(v_cmp, v_ref.detach(), dtype)
    grads = torch.randn_like(k_cmp), torch.randn_like(v_cmp)
    poison_allocator()
    dk, dv = torch.autograd.grad((k_cmp, v_cmp), (k, v), grads)
    dk_ref, dv_ref = torch.autograd.grad((k_ref, v_ref), (k64, v64), tuple(g.double().cpu() for g in grads))
    assert_close(dk, dk_ref, dtype)
    assert_close(dv, dv_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("present", [(True, True, True), (False, True, True), (True, False, False)])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("heads_dim", [(7, 128), (20, 40), (9, 264)], ids=lambda s: f"H{s[0]}-D{s[1]}")
def test_combine(dtype, present, packed, heads_dim):
    # Lane groups take runs of up to 8 heads of a token: one short run, runs of 8 then 4 with 4 groups per warp
    # (groups of different tokens in a warp), and rows longer than a warp's 16-byte pieces.
    lead = (1000,) if packed else (2, 333)
    H, Dv = heads_dim
    outs = [torch.randn(*lead, H, Dv, dtype=dtype, device="cuda", requires_grad=True) if p else None for p in present]
    gates = [torch.rand(*lead, H, dtype=dtype, device="cuda", requires_grad=True) if p else None for p in present]
    poison_allocator()
    o = sparseattn.combine(*outs, *gates)
    cpu = [x.detach().double().cpu().requires_grad_() if x is not None else None for x in outs + gates]
    o_ref = sparseattn.combine(*cpu)
    assert_close(o, o_ref.detach(), dtype)

    d_o = torch.randn_like(o)
    inputs = [x for x in outs + gates if x is not None]
    poison_allocator()
    grads = torch.autograd.grad(o, inputs, d_o)
    grads_ref = torch.autograd.grad(o_ref, [x for x in cpu if x is not None], d_o.double().cpu())
    for got, ref in zip(grads, grads_ref):
        assert_close(got, ref, dtype)


def test_float64_on_cuda_is_a_clear_error():
    k = torch.randn(1, 64, 1, 64, dtype=torch.float64, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="float64"):
        sparseattn.compress_kv(k, k)
