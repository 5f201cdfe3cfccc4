"""CUDA flash_attention with mask, bias (and dbias) and block-sparse tile maps, against the CPU path of the same
function on float32 copies of the same inputs (forward outputs, lse, dq/dk/dv/dbias), both kernel families
(attention_mma), every head-dim pair, bf16 and fp16, GQA, batched and packed; deterministic backward; the
kernels' work counts against the tile map."""
import pytest
import torch

import sparseattn
from sparseattn import _ops
from attention_check import check_close, check_lse, cpu_copy, poison_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
                       reason="needs a CUDA GPU and a CUDA build of sparseattn"),
]

DTYPES = [torch.bfloat16, torch.float16]
DIMS = [(64, 64), (128, 128), (192, 128), (256, 256)]


def run(fn, q, k, v, bias, d_o, device):
    """fn(q, k, v, bias) -> (o, lse) on `device` copies; returns o, lse and the gradients of o . d_o with respect
    to q, k, v (and bias)."""
    move = (lambda t: t) if device == "cuda" else cpu_copy
    leaves = [move(x).detach().clone().requires_grad_() for x in (q, k, v)]
    b = None if bias is None else move(bias).detach().clone().requires_grad_()
    if device == "cuda":
        poison_allocator()
    o, lse = fn(*leaves, b)
    if device == "cuda":
        poison_allocator()
    grads = torch.autograd.grad(o, leaves + ([b] if b is not None else []), move(d_o))
    return o, lse, grads


def compare(fn_gpu, fn_cpu, q, k, v, bias, dtype):
    """Forward and backward of fn_gpu (CUDA) and fn_cpu (float32 CPU copies) with the same d_o; checks o, lse,
    dq, dk, dv (and dbias) and returns the CUDA gradients."""
    d_o = torch.randn_like(fn_gpu(q, k, v, bias)[0])
    o, lse, grads = run(fn_gpu, q, k, v, bias, d_o, "cuda")
    o_ref, lse_ref, grads_ref = run(fn_cpu, q, k, v, bias, d_o, "cpu")
    check_close("o", o, o_ref, dtype, 4)
    check_lse(lse, lse_ref)
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, grads_ref):
        check_close(name, g, r, dtype, 8)
    return grads


def shaped(code, B, Hq, Hkv, T, S):
    """A broadcast shape from a code such as "BH1S": B/1, H (Hq)/K (Hkv)/1, T/1, S."""
    sizes = {"B": B, "H": Hq, "K": Hkv, "T": T, "S": S, "1": 1}
    return [sizes[c] for c in code]


def random_mask(shape, device="cuda"):
    m = torch.rand(shape, device=device) < 0.8
    if len(shape) == 4 and shape[2] > 3:
        m[..., 3, :] = False  # a fully masked query row
    return m


# (B, T, S, Hq, Hkv, causal, window, mask shape, bias shape)
BATCHED = [
    (2, 70, 70, 4, 4, False, (-1, -1), "BHTS", None),
    (2, 65, 130, 4, 2, True, (-1, -1), None, "BHTS"),
    (1, 100, 77, 8, 2, False, (-1, -1), "1KTS", "B11S"),
    (2, 33, 200, 8, 1, False, (20, 5), "B11S", "1K1S"),
    (1, 129, 129, 4, 1, True, (-1, -1), "11TS", "11TS"),
    (2, 50, 96, 2, 2, False, (-1, -1), "B1TS", "BKTS"),
    (1, 200, 150, 8, 4, True, (40, -1), "BHTS", "1HTS"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("case", BATCHED, ids=lambda c: "B{}T{}S{}H{}-{}c{}w{}m{}b{}".format(*c))
def test_batched_mask_bias(attention_mma, dtype, dims, case):
    compare_batched_case(dtype, dims, case, bias_scale=1.0)


def compare_batched_case(dtype, dims, case, bias_scale):
    """A batched case (B, T, S, Hq, Hkv, causal, window, mask code, bias code; shaped()) with random q, k, v, a
    random mask and a bias of bias_scale x standard normal: o, lse and the gradients against the CPU reference."""
    B, T, S, Hq, Hkv, causal, window, mask_code, bias_code = case
    Dqk, Dv = dims
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    mask = None if mask_code is None else random_mask(shaped(mask_code, B, Hq, Hkv, T, S))
    bias = None if bias_code is None else (bias_scale * torch.randn(shaped(bias_code, B, Hq, Hkv, T, S),
                                                                    device="cuda")).to(dtype)

    def fn(mask):
        return lambda q, k, v, b: sparseattn.flash_attention(q, k, v, causal=causal, window=window, mask=mask,
                                                             bias=b, return_lse=True)

    compare(fn(mask), fn(cpu_copy(mask)), q, k, v, bias, dtype)


LENGTHS_Q = [0, 37, 64, 5, 130, 9]
LENGTHS_K = [3, 50, 64, 0, 129, 70]


def cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


# (mask form, bias form): "row" [Hq, Nq, Lk], "row1" [Hkv, 1, Lk], "key" [1, Nk], "keyK" [Hkv, Nk]
PACKED = [("row", "keyK"), ("key", "row1"), (None, "row"), ("row1", "key"), ("keyK", None)]


def packed_shape(form, Hq, Hkv, Nq, Nk, Lk):
    return {"row": [Hq, Nq, Lk], "row1": [Hkv, 1, Lk], "key": [1, Nk], "keyK": [Hkv, Nk]}[form]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("forms", PACKED, ids=lambda f: f"m{f[0]}-b{f[1]}")
def test_packed_mask_bias(attention_mma, dtype, dims, forms):
    Hq, Hkv, (Dqk, Dv) = 4, 2, dims
    Nq, Nk, Lk = sum(LENGTHS_Q), sum(LENGTHS_K), max(LENGTHS_K) + 3
    q = torch.randn(Nq, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(Nk, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(Nk, Hkv, Dv, dtype=dtype, device="cuda")
    mask_form, bias_form = forms
    mask = None if mask_form is None else torch.rand(packed_shape(mask_form, Hq, Hkv, Nq, Nk, Lk), device="cuda") < 0.8
    bias = None if bias_form is None else torch.randn(packed_shape(bias_form, Hq, Hkv, Nq, Nk, Lk),
                                                      device="cuda").to(dtype)
    causal = mask_form != "row"

    def fn(device, mask):
        cq, ck = cu(LENGTHS_Q, device), cu(LENGTHS_K, device)
        return lambda q, k, v, b: sparseattn.flash_attention(
            q, k, v, causal=causal, mask=mask, bias=b, cu_seqlens_q=cq, cu_seqlens_k=ck,
            max_seqlen_q=max(LENGTHS_Q), max_seqlen_k=max(LENGTHS_K), return_lse=True)

    compare(fn("cuda", mask), fn("cpu", cpu_copy(mask)), q, k, v, bias, dtype)


@pytest.mark.parametrize("mask_code", ["B1TS", "B11S"])
@pytest.mark.parametrize("bias_code", ["1K1S", "11TS", "1HTS", "BK1S"])
def test_backward_is_deterministic(attention_mma, bias_code, mask_code):
    """Two backward runs give bit-equal dq, dk, dv and dbias (head splits of the dK/dV kernel included: the
    group of 4 query heads over few key blocks); a key mask with a key bias takes the key-terms kernels."""
    B, T, S, Hq, Hkv, D = 2, 300, 260, 8, 2, 128
    dtype = torch.bfloat16
    q = torch.randn(B, T, Hq, D, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, D, dtype=dtype, device="cuda")
    mask = random_mask(shaped(mask_code, B, Hq, Hkv, T, S))
    bias = torch.randn(shaped(bias_code, B, Hq, Hkv, T, S), device="cuda").to(dtype)
    d_o = torch.randn(B, T, Hq, D, dtype=dtype, device="cuda")

    def grads():
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, bias)]
        o = sparseattn.flash_attention(*leaves[:3], causal=True, mask=mask, bias=leaves[3])
        return torch.autograd.grad(o, leaves, d_o)

    first, second = grads(), grads()
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), first, second):
        assert torch.equal(a, b), f"{name} differs between two runs"


# Key terms (a mask and bias without query rows: FlashKeyTermsMask, or FlashTermsMask's key-term path with a tile
# map): (B, T, S, Hq, Hkv, causal, window, mask shape, bias shape); odd key counts, every group size, a window.
KEY_TERMS = [
    (1, 131, 197, 8, 8, True, (-1, -1), None, "BK1S"),
    (2, 77, 77, 8, 4, False, (-1, -1), "B11S", "1H1S"),
    (1, 200, 130, 8, 2, True, (-1, -1), None, "111S"),
    (2, 64, 301, 8, 1, True, (50, -1), "1K1S", "BK1S"),
    (1, 300, 257, 8, 1, False, (-1, -1), "111S", None),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("case", KEY_TERMS, ids=lambda c: "B{}T{}S{}H{}-{}c{}w{}m{}b{}".format(*c))
def test_key_terms(attention_mma, dtype, dims, case):
    """A key bias (with dbias) and a key mask: o, lse, dq, dk, dv and dbias against the CPU reference."""
    compare_batched_case(dtype, dims, case, bias_scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", [(128, 128), (64, 64)], ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("packed_form", ["key", "keyK", "row1"])
def test_key_terms_packed(attention_mma, dtype, dims, packed_form):
    """Packed sequences with a key bias in each packed form and a key mask."""
    Hq, Hkv, (Dqk, Dv) = 8, 2, dims
    Nq, Nk, Lk = sum(LENGTHS_Q), sum(LENGTHS_K), max(LENGTHS_K) + 3
    q = torch.randn(Nq, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(Nk, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(Nk, Hkv, Dv, dtype=dtype, device="cuda")
    mask = torch.rand(packed_shape("key", Hq, Hkv, Nq, Nk, Lk), device="cuda") < 0.8
    bias = torch.randn(packed_shape(packed_form, Hq, Hkv, Nq, Nk, Lk), device="cuda").to(dtype)

    def fn(device, mask):
        cq, ck = cu(LENGTHS_Q, device), cu(LENGTHS_K, device)
        return lambda q, k, v, b: sparseattn.flash_attention(
            q, k, v, causal=True, mask=mask, bias=b, cu_seqlens_q=cq, cu_seqlens_k=ck,
            max_seqlen_q=max(LENGTHS_Q), max_seqlen_k=max(LENGTHS_K), return_lse=True)

    compare(fn("cuda", mask), fn("cpu", cpu_copy(mask)), q, k, v, bias, dtype)


def test_fully_masked_rows_and_sequences(attention_mma):
    """Rows whose every key the mask removes: o = 0, lse = -inf, no gradient, no NaN (also with a bias)."""
    B, T, S, H, D = 1, 40, 50, 2, 64
    dtype = torch.float16
    q, k, v = (torch.randn(B, n, H, D, dtype=dtype, device="cuda") for n in (T, S, S))
    mask = torch.rand(B, H, T, S, device="cuda") < 0.5
    mask[:, :, ::3] = False
    bias = torch.randn(B, 1, 1, S, device="cuda").to(dtype)

    def fn(mask):
        return lambda q, k, v, b: sparseattn.flash_attention(q, k, v, mask=mask, bias=b, return_lse=True)

    dq = compare(fn(mask), fn(cpu_copy(mask)), q, k, v, bias, dtype)[0]
    assert (dq[:, ::3] == 0).all()


# ------------------------------------------------------------------------------------------- block-sparse masks


def tile_map(B, H, nQ, nK, states, device="cuda"):
    """Random tile states: bool (p = 0.6 present) or uint8 0/1/2."""
    if states == "bool":
        return torch.rand(B, H, nQ, nK, device=device) < 0.6
    return torch.randint(0, 3, (B, H, nQ, nK), device=device, dtype=torch.uint8)


def ops_flash(q, k, v, mask, bias, causal=False, block_mask=None, block=(0, 0), cu_q=None, cu_k=None, max_q=0,
              max_k=0):
    return _ops.flash_attention(q, k, v, mask, bias, cu_q, cu_k, max_q, max_k, causal, -1, -1, None,
                                block_mask=block_mask, block_q=block[0], block_k=block[1])


# (block_q, block_k, map states, element mask, bias, causal)
BLOCK_CASES = [
    (64, 64, "bool", False, False, False),
    (48, 80, "uint8", True, True, False),
    (128, 32, "uint8", True, False, True),
    (17, 200, "bool", True, True, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (192, 128), (256, 256)], ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "bq{}bk{}-{}-m{}b{}c{}".format(*c))
def test_block_mask_batched(attention_mma, dtype, dims, case):
    bq, bk, states, with_mask, with_bias, causal = case
    B, T, S, Hq, Hkv, (Dqk, Dv) = 2, 190, 230, 4, 2, dims
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    blocks = tile_map(1 if with_bias else B, Hkv, -(-T // bq) + 1, -(-S // bk), states)
    mask = random_mask([B, Hq, T, S]) if with_mask else None
    bias = torch.randn(1, Hkv, 1, S, device="cuda").to(dtype) if with_bias else None

    def fn(mask, blocks):
        return lambda q, k, v, b: ops_flash(q, k, v, mask, b, causal, blocks, (bq, bk))

    compare(fn(mask, blocks), fn(cpu_copy(mask), cpu_copy(blocks)), q, k, v, bias, dtype)


# (block_q, block_k, map states, key mask): block sizes that are multiples of the kernel tiles (tiles of one state)
# and odd ones (tiles that straddle map tiles).
KEY_TERM_BLOCKS = [(128, 128, "uint8", True), (64, 256, "bool", False), (48, 80, "uint8", True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", [(128, 128), (64, 64), (192, 128), (256, 256)], ids=lambda d: f"D{d[0]}-{d[1]}")
@pytest.mark.parametrize("case", KEY_TERM_BLOCKS, ids=lambda c: "bq{}bk{}-{}-m{}".format(*c))
def test_block_mask_key_terms(attention_mma, dtype, dims, case):
    """A tile map with a key bias (and dbias) and a key mask: the key terms of the tiles of one state, the per-element
    terms of the others."""
    bq, bk, states, with_mask = case
    B, T, S, Hq, Hkv, (Dqk, Dv) = 2, 300, 333, 4, 2, dims
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    blocks = tile_map(B, Hkv, -(-T // bq), -(-S // bk), states)
    mask = random_mask([B, 1, 1, S]) if with_mask else None
    bias = torch.randn(B, Hkv, 1, S, device="cuda").to(dtype)

    def fn(mask, blocks):
        return lambda q, k, v, b: ops_flash(q, k, v, mask, b, True, blocks, (bq, bk))

    compare(fn(mask, blocks), fn(cpu_copy(mask), cpu_copy(blocks)), q, k, v, bias, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("states", ["bool", "uint8"])
def test_block_mask_packed(attention_mma, dtype, states):
    Hq, Hkv, D, bq, bk = 4, 1, 128, 32, 48
    Nq, Nk = sum(LENGTHS_Q), sum(LENGTHS_K)
    q = torch.randn(Nq, Hq, D, dtype=dtype, device="cuda")
    k = torch.randn(Nk, Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn(Nk, Hkv, D, dtype=dtype, device="cuda")
    blocks = tile_map(len(LENGTHS_Q), Hq, -(-max(LENGTHS_Q) // bq), -(-max(LENGTHS_K) // bk), states)
    mask = torch.rand(Hq, Nq, max(LENGTHS_K), device="cuda") < 0.7
    bias = torch.randn(1, Nk, device="cuda").to(dtype)

    def fn(device, mask, blocks):
        cq, ck = cu(LENGTHS_Q, device), cu(LENGTHS_K, device)
        return lambda q, k, v, b: ops_flash(q, k, v, mask, b, False, blocks, (bq, bk), cq, ck, max(LENGTHS_Q),
                                            max(LENGTHS_K))

    compare(fn("cuda", mask, blocks), fn("cpu", cpu_copy(mask), cpu_copy(blocks)), q, k, v, bias, dtype)


def expected_work(blocks, lengths_q, lengths_k, bq, bk, q_heads):
    """Query x key elements of the present tiles: per sequence, query head and present (query tile, key tile)."""
    total = 0
    group = q_heads // blocks.shape[1] if blocks.shape[1] not in (1, q_heads) else 1
    present = blocks.cpu() != 0
    for b, (T, S) in enumerate(zip(lengths_q, lengths_k)):
        for h in range(q_heads):
            hb = h if blocks.shape[1] == q_heads else (0 if blocks.shape[1] == 1 else h // group)
            m = present[b if blocks.shape[0] > 1 else 0, hb]
            for r in range(-(-T // bq)):
                for c in range(-(-S // bk)):
                    if r < m.shape[0] and c < m.shape[1] and m[r, c]:
                        total += min(bq, T - r * bq) * min(bk, S - c * bk)
    return total


@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
def test_work_counts_batched(attention_mma, dims):
    """Absent tiles are skipped: the kernels' work counts equal the present tiles' elements (block sizes that
    are multiples of every kernel tile), forward once and backward twice (dQ and dK/dV kernels)."""
    B, T, S, Hq, Hkv, (Dqk, Dv), bq, bk = 2, 300, 520, 4, 2, dims, 128, 256
    dtype = torch.bfloat16
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    d_o = torch.randn(B, T, Hq, Dv, dtype=dtype, device="cuda")
    blocks = torch.rand(B, Hkv, 3, 3, device="cuda") < 0.5
    blocks[0, 0, 1, 1] = False
    expected = expected_work(blocks, [T] * B, [S] * B, bq, bk, Hq)
    fwd, bwd = _ops.flash_attention_work(q, k, v, block_mask=blocks, block_q=bq, block_k=bk, d_o=d_o)
    assert fwd.item() == expected
    assert bwd.item() == 2 * expected
    fwd, bwd = _ops.flash_attention_work(q, k, v, d_o=d_o)  # no map: every tile
    assert fwd.item() == B * Hq * T * S
    assert bwd.item() == 2 * B * Hq * T * S


def test_work_counts_packed(attention_mma):
    Hq, Hkv, D, bq, bk = 4, 4, 64, 128, 128
    lengths_q, lengths_k = [0, 300, 129, 256], [200, 400, 1, 128]
    Nq, Nk = sum(lengths_q), sum(lengths_k)
    q = torch.randn(Nq, Hq, D, dtype=torch.float16, device="cuda")
    k = torch.randn(Nk, Hkv, D, dtype=torch.float16, device="cuda")
    v = torch.randn(Nk, Hkv, D, dtype=torch.float16, device="cuda")
    blocks = torch.randint(0, 3, (len(lengths_q), Hq, 3, 4), dtype=torch.uint8, device="cuda")
    mask = torch.rand(1, Nk, device="cuda") < 0.9
    expected = expected_work(blocks, lengths_q, lengths_k, bq, bk, Hq)
    fwd, bwd = _ops.flash_attention_work(q, k, v, mask=mask, cu_seqlens_q=cu(lengths_q, "cuda"),
                                         cu_seqlens_k=cu(lengths_k, "cuda"), max_seqlen_q=max(lengths_q),
                                         max_seqlen_k=max(lengths_k), block_mask=blocks, block_q=bq, block_k=bk,
                                         d_o=torch.randn_like(q))
    assert fwd.item() == expected
    assert bwd.item() == 2 * expected


def test_work_counts_odd_blocks_skip(attention_mma):
    """With block sizes unrelated to the kernel tiles, a kernel tile is computed when any tile it overlaps exists:
    the count lies between the present tiles' elements and the dense count, and an all-absent map computes
    nothing."""
    B, T, S, H, D, bq, bk = 1, 400, 400, 2, 128, 40, 72
    q, k, v = (torch.randn(B, T, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    blocks = torch.zeros(B, H, 10, 6, dtype=torch.bool, device="cuda")
    blocks[:, :, :2, :1] = True
    fwd, _ = _ops.flash_attention_work(q, k, v, block_mask=blocks, block_q=bq, block_k=bk)
    assert expected_work(blocks, [T], [S], bq, bk, H) <= fwd.item() < B * H * T * S
    fwd, bwd = _ops.flash_attention_work(q, k, v, block_mask=torch.zeros_like(blocks), block_q=bq, block_k=bk,
                                         d_o=torch.randn_like(q))
    assert fwd.item() == 0 and bwd.item() == 0


def sparse_causal_map(heads, n_q, n_k, density, seed):
    """bool [1, heads, n_q, n_k]: the first key tile (every causal row keeps a key), the diagonal tiles and random
    others."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(1, heads, n_q, n_k, generator=g) < density
    blocks |= torch.eye(n_q, n_k, dtype=torch.bool)
    blocks[..., 0] = True
    return blocks.cuda()


def element_mask(blocks, bq, bk, T, S):
    """The element mask [1, H, T, S] of a tile map [1, H, nQ, nK]."""
    rows = torch.arange(T, device=blocks.device) // bq
    cols = torch.arange(S, device=blocks.device) // bk
    return blocks[:, :, rows][..., cols]


@pytest.mark.parametrize("block", [(128, 128), (96, 160)], ids=lambda b: f"bq{b[0]}bk{b[1]}")
def test_block_mask_long_sequence(attention_mma, block):
    """More key tiles per query tile and more dK/dV steps per CTA than one window of the map walk holds
    (tile_walk.cuh): forward, lse and gradients against SDPA (float32, the map as an element mask), and with
    128 x 128 tiles (multiples of every kernel tile) the exact work counts."""
    bq, bk = block
    B, T, Hq, Hkv, D, dtype = 1, 17000, 4, 2, 128, torch.bfloat16
    q = torch.randn(B, T, Hq, D, dtype=dtype, device="cuda")
    k = torch.randn(B, T, Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn(B, T, Hkv, D, dtype=dtype, device="cuda")
    d_o = torch.randn(B, T, Hq, D, dtype=dtype, device="cuda")
    blocks = sparse_causal_map(Hkv, -(-T // bq), -(-T // bk), 0.05, 7)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = ops_flash(*leaves, None, None, True, blocks, block)
    grads = torch.autograd.grad(o, leaves, d_o)

    keep = element_mask(blocks, bq, bk, T, T).repeat_interleave(Hq // Hkv, dim=1)
    keep &= torch.ones(T, T, dtype=torch.bool, device="cuda").tril()
    ref_leaves = [x.float().transpose(1, 2).repeat_interleave(Hq // x.shape[2], dim=1).requires_grad_()
                  for x in (q, k, v)]
    o_ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, attn_mask=keep)
    ref_grads = torch.autograd.grad(o_ref, ref_leaves, d_o.float().transpose(1, 2))
    check_close("o", o, o_ref.transpose(1, 2), dtype, 4)
    with torch.no_grad():
        lse_ref = torch.stack([torch.logsumexp((ref_leaves[0][0, h] @ ref_leaves[1][0, h].T / D ** 0.5)
                                               .masked_fill(~keep[0, h], float("-inf")), dim=-1)
                               for h in range(Hq)])[None]
    check_lse(lse, lse_ref)
    check_close("dq", grads[0], ref_grads[0].transpose(1, 2), dtype, 8)
    for name, g, r in (("dk", grads[1], ref_grads[1]), ("dv", grads[2], ref_grads[2])):
        r = r.unflatten(1, (Hkv, Hq // Hkv)).sum(2)  # the group's query heads
        check_close(name, g, r.transpose(1, 2), dtype, 8)
    if block == (128, 128):
        # Without the causal rule (which skips kernel tiles above the diagonal, by kernel tile sizes) every kernel
        # tile of a present map tile is computed in full.
        expected = expected_work(blocks, [T], [T], bq, bk, Hq)
        fwd, bwd = _ops.flash_attention_work(q, k, v, block_mask=blocks, block_q=bq, block_k=bk, d_o=d_o)
        assert fwd.item() == expected
        assert bwd.item() == 2 * expected


def test_lists_are_unsupported_on_cuda():
    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
    counts = torch.ones(1, 2, 1, dtype=torch.int32, device="cuda")
    indices = torch.zeros(1, 2, 1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="block_mask"):
        _ops.flash_attention(q, q, q, None, None, None, None, 0, 0, False, -1, -1, None, kv_num_blocks=counts,
                             kv_indices=indices, block_q=64, block_k=64)
