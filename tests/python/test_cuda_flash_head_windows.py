"""flash_attention's per-head windows (window=(left, right), a side an int32 [Hq] tensor): on CUDA against the CPU
path of the same function on float32 copies of the same inputs (o, lse, dq, dk, dv), both kernel families
(attention_mma), every head-dim pair, bf16 and fp16, GQA groups 1/4/8 and MQA, batched and packed, causal and not,
with a mask, bias, tile map or gate; poisoned outputs, a deterministic backward, the kernels' work counts (each
head's own tiles), short no-grad calls (which must not take the decode kernel); bad window tensors. The Python-side
validation runs on the CPU too."""
import pytest
import torch

import sparseattn
import sparseattn.functional as functional
from sparseattn import _ops
from attention_check import check_close, check_lse, cpu_copy, poison_allocator

HAS_CUDA = torch.cuda.is_available() and sparseattn._C.built_with_cuda()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and a CUDA build of sparseattn")
cuda_only = [pytest.mark.gpu, requires_cuda]

DTYPES = [torch.bfloat16, torch.float16]
DIMS = [(64, 64), (128, 128), (192, 128), (256, 256)]
I32 = torch.int32


def run(fn, inputs, d_o, device):
    """fn(*inputs) -> (o, lse) on `device` copies; returns o, lse and the gradients of o . d_o with respect to the
    floating inputs (None entries skipped)."""
    move = (lambda t: t) if device == "cuda" else cpu_copy
    leaves = [None if x is None else move(x).detach().clone().requires_grad_() for x in inputs]
    if device == "cuda":
        poison_allocator()
    o, lse = fn(*leaves)
    if device == "cuda":
        poison_allocator()
    grads = torch.autograd.grad(o, [x for x in leaves if x is not None], move(d_o))
    return o, lse, grads


def compare(fn_gpu, fn_cpu, inputs, dtype, names=("dq", "dk", "dv")):
    """Forward and backward of fn_gpu (CUDA) and fn_cpu (float32 CPU copies) with the same d_o: o, lse and the
    gradients; returns the CUDA gradients."""
    d_o = torch.randn_like(fn_gpu(*inputs)[0])
    o, lse, grads = run(fn_gpu, inputs, d_o, "cuda")
    o_ref, lse_ref, grads_ref = run(fn_cpu, inputs, d_o, "cpu")
    check_close("o", o, o_ref, dtype, 4)
    check_lse(lse, lse_ref)
    assert len(grads) == len(names)
    for name, g, r in zip(names, grads, grads_ref):
        check_close(name, g, r, dtype, 16 if name in ("dalpha", "ddelta") else 8)  # as test_cuda_flash_gated.py
    return grads


def side(spec, device):
    """A window side: an int, or a list of per-head bounds as an int32 tensor on `device`."""
    return spec if isinstance(spec, int) else torch.tensor(spec, dtype=I32, device=device)


def windows(left, right, device):
    return (side(left, device), side(right, device))


def qkv(B, T, S, Hq, Hkv, dims, dtype):
    Dqk, Dv = dims
    if B is None:  # packed: T and S are token counts
        return (torch.randn(T, Hq, Dqk, dtype=dtype, device="cuda"), torch.randn(S, Hkv, Dqk, dtype=dtype, device="cuda"),
                torch.randn(S, Hkv, Dv, dtype=dtype, device="cuda"))
    return (torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda"),
            torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda"),
            torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda"))


# (B, T, S, Hq, Hkv, causal, left, right): a side is an int or per-head bounds (-1 unbounded).
BATCHED = [
    (2, 70, 70, 4, 4, True, [3, -1, 0, 17], 0),  # group 1
    (1, 100, 77, 8, 2, False, [5, -1, 40, 0, -1, 12, 1, 70], [-1, 3, 0, 9, 30, -1, 2, 0]),  # group 4, both sides
    (1, 150, 200, 16, 2, True, [-1, 0, 7, 33, 64, 65, 127, 128, -1, 1, 2, 300, 9, -1, 40, 90], -1),  # group 8
    (1, 33, 200, 6, 1, False, 20, [0, -1, 5, 64, 199, 2]),  # MQA, the right side per head
    (2, 90, 40, 4, 2, True, [-1, 3, 0, 30], [-1, -1, -1, -1]),  # T > S: rows without keys; an all -1 side
    (1, 700, 700, 4, 1, True, [0, 63, 300, -1], 0),  # long: each head skips its own tiles
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("case", BATCHED, ids=lambda c: "B{}T{}S{}H{}-{}c{}".format(*c[:6]))
def test_batched(attention_mma, dtype, dims, case):
    B, T, S, Hq, Hkv, causal, left, right = case
    q, k, v = qkv(B, T, S, Hq, Hkv, dims, dtype)

    def fn(device):
        window = windows(left, right, device)
        return lambda q, k, v: sparseattn.flash_attention(q, k, v, causal=causal, window=window, return_lse=True)

    compare(fn("cuda"), fn("cpu"), (q, k, v), dtype)


LENGTHS_Q = [0, 37, 64, 5, 130, 9, 200]
LENGTHS_K = [3, 50, 64, 0, 129, 70, 260]


def cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=I32, device=device)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("causal", [False, True], ids=lambda c: f"c{c}")
def test_packed(attention_mma, dtype, dims, causal):
    Hq, Hkv = 8, 2
    left, right = [-1, 0, 5, 31, 64, -1, 100, 2], [3, -1, 0, 17, -1, 40, 1, 0]
    q, k, v = qkv(None, sum(LENGTHS_Q), sum(LENGTHS_K), Hq, Hkv, dims, dtype)

    def fn(device):
        window = windows(left, -1 if causal else right, device)
        cq, ck = cu(LENGTHS_Q, device), cu(LENGTHS_K, device)
        return lambda q, k, v: sparseattn.flash_attention(q, k, v, causal=causal, window=window, cu_seqlens_q=cq,
                                                          cu_seqlens_k=ck, max_seqlen_q=max(LENGTHS_Q),
                                                          max_seqlen_k=max(LENGTHS_K), return_lse=True)

    compare(fn("cuda"), fn("cpu"), (q, k, v), dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (192, 128)], ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("extra", ["mask_bias", "tile_map", "gate"])
def test_with_mask_bias_tiles_gate(attention_mma, dims, extra):
    """Per-head windows AND a mask and bias (dbias too), a block-sparse tile map, or a gate (dalpha, ddelta)."""
    dtype = torch.bfloat16
    B, T, S, Hq, Hkv = 2, 130, 190, 8, 2
    left, right = [-1, 0, 9, 70, 3, -1, 130, 20], [0, 5, -1, 0, 60, 2, -1, 1]
    q, k, v = qkv(B, T, S, Hq, Hkv, dims, dtype)
    inputs, names = [q, k, v], ["dq", "dk", "dv"]
    mask = blocks = None
    if extra == "mask_bias":
        mask = torch.rand(B, Hkv, T, S, device="cuda") < 0.8
        inputs.append(torch.randn(1, Hq, 1, S, device="cuda").to(dtype))
        names.append("dbias")
    elif extra == "tile_map":
        blocks = torch.randint(0, 3, (B, Hkv, -(-T // 64), -(-S // 32)), dtype=torch.uint8, device="cuda")
    else:
        inputs += [torch.randn(B, T, Hq, device="cuda"), torch.randn(B, S, Hkv, device="cuda")]
        names += ["dalpha", "ddelta"]

    def fn(device, mask, blocks):
        window = windows(left, right, device)

        def call(q, k, v, *rest):
            kwargs = dict(causal=True, window=window, mask=mask, return_lse=True)
            if extra == "mask_bias":
                kwargs["bias"] = rest[0]
            elif extra == "tile_map":
                kwargs.update(block_mask=blocks, block_size=(64, 32))
            else:
                kwargs.update(alpha=rest[0], delta=rest[1])
            return sparseattn.flash_attention(q, k, v, **kwargs)
        return call

    compare(fn("cuda", mask, blocks), fn("cpu", cpu_copy(mask), cpu_copy(blocks)), tuple(inputs), dtype,
            tuple(names))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dims", [(128, 128), (256, 256)], ids=lambda d: f"D{d[0]}-{d[1]}")
def test_backward_is_deterministic(attention_mma, dims):
    """Two backward runs give bit-equal dq, dk, dv (head splits of the dK/dV kernel included: a group of 8 query
    heads over few key blocks, each head with its own window)."""
    B, T, S, Hq, Hkv = 2, 300, 260, 8, 1
    q, k, v = qkv(B, T, S, Hq, Hkv, dims, torch.bfloat16)
    d_o = torch.randn(B, T, Hq, dims[1], dtype=torch.bfloat16, device="cuda")
    window = windows([0, 10, -1, 100, 255, 1, 64, 3], [-1, 0, 5, 0, 0, 80, -1, 2], "cuda")

    def grads():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        o = sparseattn.flash_attention(*leaves, window=window)
        return torch.autograd.grad(o, leaves, d_o)

    first, second = grads(), grads()
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two runs"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
def test_work_counts_follow_each_head(attention_mma, dims):
    """Tile skipping follows each head's window: the kernels' work counts with per-head windows equal, head by
    head, those of the same call with that head's bounds as ints (forward, and dQ plus dK/dV in the backward)."""
    B, T, S, Hq, Hkv = 2, 600, 700, 8, 2
    left, right = [0, 63, 300, -1, 5, 128, 1000, 64], [0, 0, -1, 10, 200, 0, 0, 1]
    q, k, v = qkv(B, T, S, Hq, Hkv, dims, torch.bfloat16)
    d_o = torch.randn(B, T, Hq, dims[1], dtype=torch.bfloat16, device="cuda")
    for causal in (False, True):
        fwd, bwd = _ops.flash_attention_work(q, k, v, causal=causal, d_o=d_o,
                                             window_left_heads=torch.tensor(left, dtype=I32, device="cuda"),
                                             window_right_heads=torch.tensor(right, dtype=I32, device="cuda"))
        want_fwd = want_bwd = 0
        for h in range(Hq):
            f, b = _ops.flash_attention_work(q, k, v, causal=causal, window_left=left[h], window_right=right[h],
                                             d_o=d_o)
            assert f.item() % Hq == 0 and b.item() % Hq == 0
            want_fwd += f.item() // Hq
            want_bwd += b.item() // Hq
        assert fwd.item() == want_fwd, f"causal={causal}"
        assert bwd.item() == want_bwd, f"causal={causal}"
        assert want_fwd < B * Hq * T * S


@pytest.mark.gpu
@requires_cuda
def test_work_counts_packed(attention_mma):
    Hq, Hkv, D = 4, 1, 64
    lengths_q, lengths_k = [0, 300, 129, 256], [200, 400, 1, 300]
    left = [7, -1, 150, 0]
    q, k, v = qkv(None, sum(lengths_q), sum(lengths_k), Hq, Hkv, (D, D), torch.float16)
    packing = dict(cu_seqlens_q=cu(lengths_q, "cuda"), cu_seqlens_k=cu(lengths_k, "cuda"),
                   max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k), causal=True, d_o=torch.randn_like(q))
    fwd, bwd = _ops.flash_attention_work(q, k, v, window_left_heads=torch.tensor(left, dtype=I32, device="cuda"),
                                         **packing)
    want = [_ops.flash_attention_work(q, k, v, window_left=w, **packing) for w in left]
    assert fwd.item() == sum(f.item() // Hq for f, _ in want)
    assert bwd.item() == sum(b.item() // Hq for _, b in want)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("T", [1, 5, 16])
def test_short_calls_without_gradients(monkeypatch, T):
    """Calls of 1 to 16 queries without gradients (decode-shaped) with per-head windows give each head its own
    window (flash_attention runs them on its kernels, not on the decode kernel, which takes one window)."""
    B, S, Hq, Hkv, D = 2, 300, 8, 2, 128
    dtype = torch.float16
    q, k, v = qkv(B, T, S, Hq, Hkv, (D, D), dtype)
    left = [0, 3, -1, 100, 1, 7, 299, 40]
    decode_calls = []
    monkeypatch.setattr(functional._decode, "flash_decode", lambda *args, **kwargs: decode_calls.append(args))
    with torch.no_grad():
        o, lse = sparseattn.flash_attention(q, k, v, causal=True, window=windows(left, 0, "cuda"), return_lse=True)
    o_ref, lse_ref = sparseattn.flash_attention(cpu_copy(q), cpu_copy(k), cpu_copy(v), causal=True,
                                                window=windows(left, 0, "cpu"), return_lse=True)
    assert decode_calls == []
    check_close("o", o, o_ref, dtype, 4)
    check_lse(lse, lse_ref)


@pytest.mark.gpu
@requires_cuda
def test_strided_window_tensor():
    """A per-head window tensor with a stride other than 1 is read with its stride."""
    q, k, v = qkv(1, 80, 80, 4, 2, (64, 64), torch.bfloat16)
    wide = torch.tensor([[2, 99], [-1, 99], [0, 99], [30, 99]], dtype=I32, device="cuda")
    o = sparseattn.flash_attention(q, k, v, causal=True, window=(wide[:, 0], -1))
    o_ref = sparseattn.flash_attention(q, k, v, causal=True, window=(wide[:, 0].contiguous(), -1))
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    o_cpu = sparseattn.flash_attention(cpu_copy(q), cpu_copy(k), cpu_copy(v), causal=True,
                                       window=(wide[:, 0].cpu(), -1))
    check_close("o", o, o_cpu, torch.bfloat16, 4)


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
@pytest.mark.parametrize("window, error, name", [
    ((torch.zeros(4, dtype=torch.int64), -1), sparseattn.SparseAttnDTypeError, "window_left"),
    ((-1, torch.zeros(4)), sparseattn.SparseAttnDTypeError, "window_right"),
    ((torch.zeros(3, dtype=I32), -1), sparseattn.SparseAttnError, "window_left"),
    ((-1, torch.zeros(4, 1, dtype=I32)), sparseattn.SparseAttnError, "window_right"),
    ((torch.zeros(4, dtype=torch.bool), -1), sparseattn.SparseAttnDTypeError, "window_left"),
], ids=["left-int64", "right-float", "left-shape", "right-rank", "left-bool"])
def test_bad_window_tensors(device, window, error, name):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 8, 4, 64, dtype=dtype, device=device)
    kv = torch.randn(1, 8, 2, 64, dtype=dtype, device=device)
    window = tuple(w.to(device) if isinstance(w, torch.Tensor) else w for w in window)
    with pytest.raises(error, match=name) as info:
        sparseattn.flash_attention(q, kv, kv, causal=True, window=window)
    assert "flash_attention" in str(info.value)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("side", [0, 1])
def test_window_tensor_on_another_device(side):
    """A window tensor on the CPU with CUDA inputs: the Python function and the op below it name the argument."""
    name = ("window_left", "window_right")[side]
    q = torch.randn(1, 8, 4, 64, dtype=torch.float16, device="cuda")
    kv = torch.randn(1, 8, 2, 64, dtype=torch.float16, device="cuda")
    bounds = torch.tensor([1, -1, 0, 3], dtype=I32)
    window = (bounds, -1) if side == 0 else (-1, bounds)
    with pytest.raises(sparseattn.SparseAttnError, match=name):
        sparseattn.flash_attention(q, kv, kv, window=window)
    heads = dict(window_left_heads=bounds) if side == 0 else dict(window_right_heads=bounds)
    with pytest.raises(sparseattn.SparseAttnError, match=name):
        _ops.flash_attention(q, kv, kv, None, None, None, None, 0, 0, False, -1, -1, None, **heads)


def test_window_tensor_and_int_on_one_side():
    """The C++ API takes a side either as an int or as a tensor (the int then stays -1)."""
    q = torch.randn(1, 8, 4, 64)
    kv = torch.randn(1, 8, 2, 64)
    with pytest.raises(sparseattn.SparseAttnError, match="window_left"):
        _ops.flash_attention(q, kv, kv, None, None, None, None, 0, 0, False, 3, -1, None,
                             window_left_heads=torch.zeros(4, dtype=I32))


def test_cpu_rejects_entries_below_minus_one():
    q = torch.randn(1, 8, 4, 64)
    kv = torch.randn(1, 8, 2, 64)
    with pytest.raises(sparseattn.SparseAttnError, match="window_right"):
        sparseattn.flash_attention(q, kv, kv, window=(-1, torch.tensor([0, 1, -2, 3], dtype=I32)))


def test_window_pair_types():
    q = torch.randn(1, 8, 4, 64)
    with pytest.raises(sparseattn.SparseAttnTypeError, match="window"):
        sparseattn.flash_attention(q, q[:, :, :2], q[:, :, :2], window=torch.zeros(2, 4, dtype=I32))
    with pytest.raises(sparseattn.SparseAttnTypeError, match="window"):
        sparseattn.flash_attention(q, q[:, :, :2], q[:, :, :2], window=(torch.zeros(4, dtype=I32),))


def test_cpu_per_head_windows_match_one_head_calls():
    """CPU: each head of a per-head window call equals a call of that head alone with its bounds as ints."""
    Hq, Hkv = 4, 2
    q, k, v = torch.randn(2, 20, Hq, 16), torch.randn(2, 25, Hkv, 16), torch.randn(2, 25, Hkv, 8)
    left, right = [3, -1, 0, 7], [-1, 2, 0, 0]
    o = sparseattn.flash_attention(q, k, v, causal=True, window=(torch.tensor(left, dtype=I32),
                                                                  torch.tensor(right, dtype=I32)))
    for h in range(Hq):
        hk = h // (Hq // Hkv)
        o_h = sparseattn.flash_attention(q[:, :, h:h + 1], k[:, :, hk:hk + 1], v[:, :, hk:hk + 1], causal=True,
                                         window=(left[h], right[h]))
        torch.testing.assert_close(o[:, :, h:h + 1], o_h)
