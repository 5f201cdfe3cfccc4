"""CUDA flash_attention with gated attention (alpha, delta; logsigmoid and product gates), against the CPU path of the
same function on float32 copies of the same inputs: o, lse, dq, dk, dv, dalpha, ddelta (and dbias), both kernel
families (attention_mma), every head-dim pair, bf16 and fp16 with 16-bit or float32 gates, GQA groups 1/4/8 and
MQA, batched and packed, odd sizes, fully masked rows, combined with mask, bias and tile maps; deterministic
backward; work counts; the gate threshold (its tile map) against the reference, with its work counts; bad inputs'
errors (the softmax threshold on CUDA: test_cuda_flash_softmax_threshold.py)."""
import pytest
import torch

import sparseattn
from sparseattn import _ops, _tiles
from attention_check import check_close, check_lse, cpu_copy, poison_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
                       reason="needs a CUDA GPU and a CUDA build of sparseattn"),
]

DTYPES = [torch.bfloat16, torch.float16]
DIMS = [(64, 64), (128, 128), (192, 128), (256, 256)]
GATES = ["logsigmoid", "product"]
NAMES = ("dq", "dk", "dv", "dalpha", "ddelta", "dbias")


def run(fn, tensors, d_o, device):
    """fn(q, k, v, alpha, delta, bias) -> (o, lse) on `device` copies of `tensors` (bias may be None); returns o, lse
    and the gradients of o . d_o with respect to every given tensor."""
    move = (lambda t: t) if device == "cuda" else cpu_copy
    leaves = [None if t is None else move(t).detach().clone().requires_grad_() for t in tensors]
    if device == "cuda":
        poison_allocator()
    o, lse = fn(*leaves)
    if device == "cuda":
        poison_allocator()
    given = [t for t in leaves if t is not None]
    return o, lse, torch.autograd.grad(o, given, move(d_o))


def compare(fn_gpu, fn_cpu, tensors, dtype, gate_factor=16):
    """Forward and backward of fn_gpu (CUDA) and fn_cpu (float32 CPU copies) with the same d_o; checks o, lse, dq,
    dk, dv, dalpha, ddelta (and dbias); returns the CUDA gradients."""
    d_o = torch.randn_like(fn_gpu(*tensors)[0])
    o, lse, grads = run(fn_gpu, tensors, d_o, "cuda")
    o_ref, lse_ref, grads_ref = run(fn_cpu, tensors, d_o, "cpu")
    check_close("o", o, o_ref, dtype, 4)
    check_lse(lse, lse_ref)
    names = [n for n, t in zip(NAMES, tensors) if t is not None]
    for name, g, r in zip(names, grads, grads_ref):
        check_close(name, g, r, dtype, gate_factor if name in ("dalpha", "ddelta") else 8)
    return grads


def gates(shape_alpha, shape_delta, dtype, gate_fp32):
    gate_dtype = torch.float32 if gate_fp32 else dtype
    alpha = torch.randn(shape_alpha, device="cuda").to(gate_dtype)
    delta = torch.randn(shape_delta, device="cuda").to(gate_dtype)
    return alpha, delta


# (B, T, S, Hq, Hkv, causal, window, gate fp32)
BATCHED = [
    (2, 70, 70, 4, 4, False, (-1, -1), False),
    (2, 65, 130, 8, 2, True, (-1, -1), True),
    (1, 100, 77, 8, 1, False, (-1, -1), False),
    (2, 33, 200, 8, 8, False, (20, 5), True),
    (1, 129, 129, 8, 1, True, (-1, -1), True),
    (1, 200, 150, 4, 1, True, (40, -1), False),
]


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("case", BATCHED, ids=lambda c: "B{}T{}S{}H{}-{}c{}w{}f{}".format(*c))
def test_batched_gated(attention_mma, gate, dtype, dims, case):
    B, T, S, Hq, Hkv, causal, window, gate_fp32 = case
    Dqk, Dv = dims
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    alpha, delta = gates((B, T, Hq), (B, S, Hkv), dtype, gate_fp32)

    def fn(q, k, v, a, d, b):
        return sparseattn.flash_attention(q, k, v, causal=causal, window=window, alpha=a, delta=d, gate=gate,
                                          bias=b, return_lse=True)

    compare(fn, fn, [q, k, v, alpha, delta, None], dtype)


LENGTHS_Q = [0, 37, 64, 5, 130, 9]
LENGTHS_K = [3, 50, 64, 0, 129, 70]


def cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (8, 1)], ids=lambda h: f"H{h[0]}-{h[1]}")
@pytest.mark.parametrize("causal", [False, True])
def test_packed_gated(attention_mma, gate, dims, heads, causal):
    (Hq, Hkv), (Dqk, Dv), dtype = heads, dims, torch.bfloat16
    Nq, Nk = sum(LENGTHS_Q), sum(LENGTHS_K)
    q = torch.randn(Nq, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(Nk, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(Nk, Hkv, Dv, dtype=dtype, device="cuda")
    alpha, delta = gates((Nq, Hq), (Nk, Hkv), dtype, gate_fp32=Hkv == 2)

    def fn(device):
        cq, ck = cu(LENGTHS_Q, device), cu(LENGTHS_K, device)
        return lambda q, k, v, a, d, b: sparseattn.flash_attention(
            q, k, v, causal=causal, alpha=a, delta=d, gate=gate, bias=b, cu_seqlens_q=cq, cu_seqlens_k=ck,
            max_seqlen_q=max(LENGTHS_Q), max_seqlen_k=max(LENGTHS_K), return_lse=True)

    compare(fn("cuda"), fn("cpu"), [q, k, v, alpha, delta, None], dtype)


def random_mask(shape, device="cuda"):
    m = torch.rand(shape, device=device) < 0.8
    if len(shape) == 4 and shape[2] > 3:
        m[..., 3, :] = False  # a fully masked query row
    return m


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dims", [(128, 128), (256, 256)], ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("bias_code", ["1K1S", "BHTS"])
def test_gated_with_mask_bias_tiles(attention_mma, gate, dims, bias_code):
    """The gate with an element mask (a fully masked row included), a bias (and dbias) and a uint8 tile map."""
    B, T, S, Hq, Hkv, (Dqk, Dv), dtype = 2, 150, 190, 4, 2, dims, torch.float16
    bq, bk = 64, 48
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    alpha, delta = gates((B, T, Hq), (B, S, Hkv), dtype, gate_fp32=False)
    mask = random_mask([B, Hq, T, S])
    shape = {"1K1S": [1, Hkv, 1, S], "BHTS": [B, Hq, T, S]}[bias_code]
    bias = torch.randn(shape, device="cuda").to(dtype)
    blocks = torch.randint(0, 3, (B, Hkv, -(-T // bq), -(-S // bk)), dtype=torch.uint8, device="cuda")

    def fn(mask, blocks):
        return lambda q, k, v, a, d, b: _ops.flash_attention(
            q, k, v, mask, b, None, None, 0, 0, True, -1, -1, None, alpha=a, delta=d, gate=gate,
            block_mask=blocks, block_q=bq, block_k=bk)

    compare(fn(mask, blocks), fn(cpu_copy(mask), cpu_copy(blocks)), [q, k, v, alpha, delta, bias], dtype)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=lambda h: f"H{h[0]}-{h[1]}")
def test_gated_with_key_bias(attention_mma, gate, dims, heads):
    """The gate with a key bias (and dbias) and a key mask, no tile map (the key-terms kernels)."""
    (Hq, Hkv), (Dqk, Dv), dtype = heads, dims, torch.bfloat16
    B, T, S = 2, 150, 203
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    alpha, delta = gates((B, T, Hq), (B, S, Hkv), dtype, gate_fp32=False)
    mask = torch.rand(B, 1, 1, S, device="cuda") < 0.8
    bias = torch.randn(B, Hkv, 1, S, device="cuda").to(dtype)

    def fn(mask):
        return lambda q, k, v, a, d, b: sparseattn.flash_attention(q, k, v, causal=True, mask=mask, alpha=a, delta=d,
                                                                    gate=gate, bias=b, return_lse=True)

    compare(fn(mask), fn(cpu_copy(mask)), [q, k, v, alpha, delta, bias], dtype)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dims", [(128, 128), (256, 256)], ids=lambda d: f"D{d[0]}-{d[1]}")
def test_backward_is_deterministic(attention_mma, gate, dims):
    """Two backward runs give bit-equal dq, dk, dv, dalpha and ddelta (head splits of the dK/dV kernel included:
    a group of 8 query heads over few key blocks)."""
    B, T, S, Hq, Hkv, (Dqk, Dv), dtype = 2, 300, 260, 8, 1, dims, torch.bfloat16
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    alpha, delta = gates((B, T, Hq), (B, S, Hkv), dtype, gate_fp32=True)
    d_o = torch.randn(B, T, Hq, Dv, dtype=dtype, device="cuda")

    def grads():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, alpha, delta)]
        o = sparseattn.flash_attention(*leaves[:3], causal=True, alpha=leaves[3], delta=leaves[4], gate=gate)
        return torch.autograd.grad(o, leaves, d_o)

    first, second = grads(), grads()
    for name, a, b in zip(NAMES, first, second):
        assert torch.equal(a, b), f"{name} differs between two runs"


def test_fully_masked_rows(attention_mma):
    """Rows whose every key the mask removes: o = 0, lse = -inf, dalpha = 0 and no NaN, with a gate."""
    B, T, S, H, D, dtype = 1, 40, 50, 2, 64, torch.float16
    q, k, v = (torch.randn(B, n, H, D, dtype=dtype, device="cuda") for n in (T, S, S))
    alpha, delta = gates((B, T, H), (B, S, H), dtype, gate_fp32=True)
    mask = torch.rand(B, H, T, S, device="cuda") < 0.5
    mask[:, :, ::3] = False

    def fn(mask):
        return lambda q, k, v, a, d, b: sparseattn.flash_attention(q, k, v, mask=mask, alpha=a, delta=d,
                                                                    return_lse=True)

    grads = compare(fn(mask), fn(cpu_copy(mask)), [q, k, v, alpha, delta, None], dtype)
    assert (grads[0][:, ::3] == 0).all() and (grads[3][:, ::3] == 0).all()


def test_short_gated_calls_skip_the_decode_kernel():
    """A gated call of few queries without gradient runs the general kernels (the decode kernel has no gate)."""
    B, T, S, Hq, Hkv, D, dtype = 2, 4, 300, 8, 2, 128, torch.bfloat16
    q = torch.randn(B, T, Hq, D, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, D, dtype=dtype, device="cuda")
    alpha, delta = gates((B, T, Hq), (B, S, Hkv), dtype, gate_fp32=False)
    with torch.no_grad():
        o = sparseattn.flash_attention(q, k, v, causal=True, alpha=alpha, delta=delta)
        ref = sparseattn.flash_attention(*map(cpu_copy, (q, k, v)), causal=True, alpha=cpu_copy(alpha),
                                         delta=cpu_copy(delta))
        plain = sparseattn.flash_attention(*map(cpu_copy, (q, k, v)), causal=True)
    check_close("o", o, ref, dtype, 4)
    assert (ref - plain).abs().max().item() > 1e-3  # the gate changes the result


def test_work_counts_with_gate(attention_mma):
    """A gate skips nothing: the work counts equal the dense ones."""
    B, T, S, Hq, Hkv, D = 1, 300, 520, 4, 2, 128
    q = torch.randn(B, T, Hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, S, Hkv, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, S, Hkv, D, dtype=torch.bfloat16, device="cuda")
    alpha, delta = gates((B, T, Hq), (B, S, Hkv), torch.bfloat16, gate_fp32=True)
    fwd, bwd = _ops.flash_attention_work(q, k, v, alpha=alpha, delta=delta, d_o=torch.randn_like(q))
    assert fwd.item() == B * Hq * T * S
    assert bwd.item() == 2 * B * Hq * T * S


def threshold_gates(shape_alpha, shape_delta, key_dim, dtype):
    """alpha >= 1; delta <= -1 on the first half of the keys, >= 1 on the rest: at gate_threshold -1.2
    (logsigmoid) or -0.5 (product) the pairs of the first half are skipped, the others kept."""
    alpha = 1 + torch.randn(shape_alpha, device="cuda").abs()
    delta = 1 + torch.randn(shape_delta, device="cuda").abs()
    delta.narrow(key_dim, 0, shape_delta[key_dim] // 2).neg_()
    return alpha.to(dtype), delta.to(dtype)


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dims", [(128, 128), (256, 256)], ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("case", [(96, 64, False, False), (128, 128, True, False), (48, 80, True, True)],
                         ids=lambda c: "bq{}bk{}c{}m{}".format(*c))
def test_gate_threshold_batched(attention_mma, gate, dims, case):
    """The gate threshold (the Python layer's tile map of its decisions) against the CPU reference's own."""
    bq, bk, causal, with_mask = case
    B, T, S, Hq, Hkv, (Dqk, Dv), dtype = 2, 190, 260, 4, 2, dims, torch.bfloat16
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    alpha, delta = threshold_gates((B, T, Hq), (B, S, Hkv), 1, torch.float32)
    mask = random_mask([B, 1, T, S]) if with_mask else None
    threshold = -1.2 if gate == "logsigmoid" else -0.5

    def fn(mask):
        return lambda q, k, v, a, d, b: sparseattn.flash_attention(
            q, k, v, causal=causal, mask=mask, alpha=a, delta=d, gate=gate, gate_threshold=threshold,
            threshold_block=(bq, bk), return_lse=True)

    compare(fn(mask), fn(cpu_copy(mask)), [q, k, v, alpha, delta, None], dtype)


@pytest.mark.parametrize("gate", GATES)
def test_gate_threshold_packed_with_block_mask(attention_mma, gate):
    """Packed, with a block-sparse mask of the same tiles: both skip."""
    Hq, Hkv, D, bq, bk, dtype = 4, 2, 64, 32, 48, torch.float16
    Nq, Nk = sum(LENGTHS_Q), sum(LENGTHS_K)
    q = torch.randn(Nq, Hq, D, dtype=dtype, device="cuda")
    k = torch.randn(Nk, Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn(Nk, Hkv, D, dtype=dtype, device="cuda")
    alpha, delta = threshold_gates((Nq, Hq), (Nk, Hkv), 0, dtype)
    blocks = torch.rand(len(LENGTHS_Q), Hkv, -(-max(LENGTHS_Q) // bq), -(-max(LENGTHS_K) // bk), device="cuda") < 0.7
    threshold = -1.2 if gate == "logsigmoid" else -0.5

    def fn(device, blocks):
        cq, ck = cu(LENGTHS_Q, device), cu(LENGTHS_K, device)
        return lambda q, k, v, a, d, b: sparseattn.flash_attention(
            q, k, v, alpha=a, delta=d, gate=gate, gate_threshold=threshold, threshold_block=(bq, bk),
            block_mask=blocks, block_size=(bq, bk), cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(LENGTHS_Q),
            max_seqlen_k=max(LENGTHS_K), return_lse=True)

    compare(fn("cuda", blocks), fn("cpu", cpu_copy(blocks)), [q, k, v, alpha, delta, None], dtype)


def test_gate_threshold_work_counts(attention_mma):
    """The gate threshold's tile map skips its pairs: with 128 x 128 tiles and no causal rule the kernels' work is
    the kept pairs' elements (forward once, backward twice), here the second half of the keys."""
    B, T, S, Hq, Hkv, D, bq, bk = 2, 384, 512, 4, 2, 128, 128, 128
    q = torch.randn(B, T, Hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, S, Hkv, D, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(B, S, Hkv, D, dtype=torch.bfloat16, device="cuda")
    alpha, delta = threshold_gates((B, T, Hq), (B, S, Hkv), 1, torch.bfloat16)
    states = _tiles.from_gate_threshold(alpha, delta, -1.2, False, bq, bk, T // bq, S // bk, B)
    assert states[..., : S // bk // 2].sum().item() == 0 and states[..., S // bk // 2:].all()
    fwd, bwd = _ops.flash_attention_work(q, k, v, block_mask=states, block_q=bq, block_k=bk, alpha=alpha,
                                         delta=delta, d_o=torch.randn_like(q))
    assert fwd.item() == B * Hq * T * S // 2
    assert bwd.item() == 2 * fwd.item()


def test_gate_threshold_tiles_must_match_on_cuda():
    """A gate threshold whose tiles differ from a block-sparse mask's (softmax_threshold's CUDA errors:
    test_cuda_flash_softmax_threshold.py)."""
    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
    alpha, delta = gates((1, 64, 2), (1, 64, 2), torch.bfloat16, gate_fp32=False)
    blocks = torch.ones(1, 2, 1, 1, dtype=torch.bool, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="threshold_block"):
        sparseattn.flash_attention(q, q, q, alpha=alpha, delta=delta, gate_threshold=-1.0, block_mask=blocks,
                                   block_size=(64, 64))


def test_bad_gates_raise():
    B, T, S, Hq, Hkv, D = 1, 20, 30, 4, 2, 64
    q = torch.randn(B, T, Hq, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(B, S, Hkv, D, dtype=torch.bfloat16, device="cuda")
    alpha, delta = gates((B, T, Hq), (B, S, Hkv), torch.bfloat16, gate_fp32=False)
    with pytest.raises(sparseattn.SparseAttnError, match="delta"):
        sparseattn.flash_attention(q, k, k, alpha=alpha)
    with pytest.raises(sparseattn.SparseAttnError, match="alpha"):
        sparseattn.flash_attention(q, k, k, alpha=alpha[:, :, :2], delta=delta)
    with pytest.raises(sparseattn.SparseAttnError, match="delta"):
        sparseattn.flash_attention(q, k, k, alpha=alpha, delta=delta[:, :10])
    with pytest.raises(sparseattn.SparseAttnDTypeError, match="alpha"):
        sparseattn.flash_attention(q, k, k, alpha=alpha.half(), delta=delta)
    with pytest.raises(sparseattn.SparseAttnError, match="alpha"):
        sparseattn.flash_attention(q, k, k, alpha=alpha.cpu(), delta=delta)
