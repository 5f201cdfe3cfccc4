"""The TMA producers of the wgmma attention forward, dQ and dK/dV (the default for the forward and dQ from 1536 keys
and 128 queries on, for the dK/dV at every size; SPARSEATTN_ATTENTION_TMA=1 forces them, =0 the cp.async producers): NSA's compressed attention and sliding window,
and flash_attention's dense causal and windowed calls, against float64 (attention_check.py's bound) and bit for bit
against the cp.async producers, at odd lengths, varlen packed batches whose sequences end inside key and query tiles
(those tiles stay on cp.async with zero fill), every head-dim pair of the wgmma forward and dQ, bf16 and fp16; the
backward's dq (the dQ kernel's TMA variant) and dk, dv (the dK/dV kernel's TMA variant: query steps of 64 rows, 32 at
192/128, against 128 keys per CTA), with group sizes 1 and above (head splits), and NSA's backward (P factors from the
gates). Where the device runs the wgmma kernels (sm_90a), a profile shows that the switch selects the TMA kernels;
elsewhere both runs take the same kernels and the comparisons still hold."""
import pytest
import torch

import sparseattn
from attention_check import (assert_bounded, assert_lse, cmp_visible, flash_visible, naive_attention, naive_packed,
                             num_blocks, poison_allocator)
from helpers import cu_seqlens_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
                       reason="needs a CUDA GPU and a CUDA build of sparseattn"),
]

SWITCH = "SPARSEATTN_ATTENTION_TMA"
DTYPES = [torch.bfloat16, torch.float16]
# The head-dim pairs of the wgmma forward and dQ (WgmmaFwdTile, WgmmaDqTile) among those of head_dims.h.
WGMMA_DIMS = [(64, 64), (128, 128), (192, 128)]


def forward_both(monkeypatch, op, *inputs):
    """op(*inputs) -> (o, lse) with the cp.async producer, then with the TMA producer; outputs poisoned first."""
    results = []
    for value in ("0", "1"):
        monkeypatch.setenv(SWITCH, value)
        poison_allocator()
        with torch.no_grad():
            o, lse = op(*inputs)
        torch.cuda.synchronize()
        results.append((o.clone(), lse.clone()))
    monkeypatch.delenv(SWITCH)
    return results


def check(monkeypatch, op, ref_fn, inputs, dtype, rows=None):
    """Both producers against float64 (o: attention_check's bound against the same math in `dtype`; lse), and
    the TMA producer's o and lse equal to the cp.async producer's bit for bit. rows: the packed rows that belong
    to a sequence (the others are no sequence's)."""
    (o_cp, lse_cp), (o_tma, lse_tma) = forward_both(monkeypatch, op, *inputs)
    with torch.no_grad():
        o64, lse64 = ref_fn(*(x.double() for x in inputs))
        o_lp, _ = ref_fn(*inputs)
    if rows is not None:
        o_cp, o_tma, o64, o_lp = o_cp[:rows], o_tma[:rows], o64[:rows], o_lp[:rows]
        lse_cp, lse_tma, lse64 = lse_cp[..., :rows], lse_tma[..., :rows], lse64[..., :rows]
    for o, lse in ((o_cp, lse_cp), (o_tma, lse_tma)):
        assert_bounded("o", o, o64, o_lp, dtype)
        assert_lse(lse, lse64)
    assert torch.equal(o_tma, o_cp), "o: the TMA producer differs from the cp.async producer"
    assert torch.equal(lse_tma, lse_cp), "lse: the TMA producer differs from the cp.async producer"


def backward_both(monkeypatch, op, inputs, d_o):
    """The gradients (dq, dk, dv) of op(*inputs)[0] against d_o with the cp.async producers, then with the TMA
    producers (the forward's too, whose outputs are the same bit for bit); gradients poisoned first."""
    results = []
    for value in ("0", "1"):
        monkeypatch.setenv(SWITCH, value)
        leaves = [x.detach().requires_grad_() for x in inputs]
        poison_allocator()
        o, _ = op(*leaves)
        poison_allocator()
        grads = torch.autograd.grad(o, leaves, d_o)
        torch.cuda.synchronize()
        results.append([g.clone() for g in grads])
    monkeypatch.delenv(SWITCH)
    return results


def check_backward(monkeypatch, op, ref_fn, inputs, dtype, rows=None):
    """dq, dk and dv of both producers against float64 (attention_check's bound against the same math in `dtype`),
    and the TMA run's equal to the cp.async run's bit for bit. rows: per input, the packed rows that belong to a
    sequence (the others are no sequence's, and ref_fn leaves them out)."""
    q, v = inputs[0], inputs[2]
    d_o = torch.randn(*q.shape[:-1], v.shape[-1], dtype=dtype, device=q.device)
    cp_grads, tma_grads = backward_both(monkeypatch, op, inputs, d_o)
    ref64 = [x.detach().double().requires_grad_() for x in inputs]
    g64 = torch.autograd.grad(ref_fn(*ref64)[0], ref64, d_o[:rows[0]].double() if rows else d_o.double())
    lowp = [x.detach().clone().requires_grad_() for x in inputs]
    g_lp = torch.autograd.grad(ref_fn(*lowp)[0], lowp, d_o[:rows[0]] if rows else d_o)
    for i, name in enumerate(("dq", "dk", "dv")):
        cp, tma, r64, lp = cp_grads[i], tma_grads[i], g64[i], g_lp[i]
        if rows is not None:
            cp, tma, r64, lp = cp[:rows[i]], tma[:rows[i]], r64[:rows[i]], lp[:rows[i]]
        assert_bounded(name, cp, r64, lp, dtype)
        assert_bounded(name, tma, r64, lp, dtype)
        assert torch.equal(tma, cp), f"{name}: the TMA producers differ from the cp.async producers"


# ------------------------------------------------------------------------------------------ compressed attention


# (B, T, Hq, Hkv, block, stride): Tc = 255 (a last key tile of 127), 256 (whole tiles only), 524 (12 in the last
# tile), 185 at group 4; T leaves a short last query tile except at 4096.
CMP_CASES = [
    (2, 4097, 4, 1, 32, 16),
    (1, 4112, 4, 2, 32, 16),
    (1, 2100, 2, 1, 8, 4),
    (1, 2999, 8, 2, 32, 16),
    (1, 4096, 2, 2, 32, 16),
]


def compressed_batched(case, dims, dtype):
    """A batched compressed_attention case: (op, its float64-checkable reference, inputs)."""
    B, T, Hq, Hkv, block, stride = case
    Dqk, Dv = dims
    Tc = num_blocks(T, block, stride)
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, Tc, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, Tc, Hkv, Dv, dtype=dtype, device="cuda")
    vis = cmp_visible(T, Tc, block, stride, "cuda")

    def op(q, k, v):
        return sparseattn.compressed_attention(q, k, v, block=block, stride=stride)

    def ref(q, k, v):
        outs = [naive_attention(q[b], k[b], v[b], vis, Dqk ** -0.5) for b in range(B)]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])

    return op, ref, (q, k, v)


def compressed_varlen(dims, dtype):
    """Packed sequences whose queries (0, 1, 2100, 4112, 47, 3000, 129) start and end inside query tiles and whose
    compressed keys (0, 0, 130, 256, 1, 186, 7) start at rows that are not multiples of 128 and end inside key tiles;
    5 spare rows after the last sequence: (op, reference, inputs, the rows of q and of k and v that hold sequences)."""
    lengths = [0, 1, 2100, 4112, 47, 3000, 129]
    block, stride, Hkv, group = 32, 16, 2, 2
    Dqk, Dv = dims
    cu = cu_seqlens_of(lengths, device="cuda")
    blocks = [num_blocks(n, block, stride) for n in lengths]
    cu_cmp = cu_seqlens_of(blocks, device="cuda")
    q = torch.randn(int(cu[-1]) + 5, Hkv * group, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(int(cu_cmp[-1]) + 5, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(int(cu_cmp[-1]) + 5, Hkv, Dv, dtype=dtype, device="cuda")

    def op(q, k, v):
        return sparseattn.compressed_attention(q, k, v, block=block, stride=stride, cu_seqlens=cu,
                                               cu_seqlens_cmp=cu_cmp)

    def ref(q, k, v):  # the rows of the sequences only
        return naive_packed(q, k, v, cu, cu_cmp, lambda b, n, nc: cmp_visible(n, nc, block, stride, q.device),
                            Dqk ** -0.5)

    return op, ref, (q, k, v), int(cu[-1]), int(cu_cmp[-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", WGMMA_DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
@pytest.mark.parametrize("case", CMP_CASES, ids=lambda c: "B{}T{}H{}-{}l{}d{}".format(*c))
def test_compressed_batched(monkeypatch, dtype, dims, case):
    op, ref, inputs = compressed_batched(case, dims, dtype)
    check(monkeypatch, op, ref, inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", WGMMA_DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
def test_compressed_varlen(monkeypatch, dtype, dims):
    op, ref, inputs, q_rows, _ = compressed_varlen(dims, dtype)
    check(monkeypatch, op, ref, inputs, dtype, rows=q_rows)


# (B, T, Hq, Hkv, block, stride): Tc = 255 (a last 64-key tile of 63 rows, a dK/dV CTA of 127 keys) with a last query
# tile of 1 row; Tc = 256 (whole key tiles) with a last query tile of 16 rows; group 1 (no head splits): Tc = 186 (a
# dK/dV CTA of 58 keys), T = 3001 (a last query step of 57 rows, 25 at 192/128).
CMP_BACKWARD_CASES = [
    (2, 4097, 4, 1, 32, 16),
    (1, 4112, 4, 2, 32, 16),
    (1, 3001, 2, 2, 32, 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", WGMMA_DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
@pytest.mark.parametrize("case", CMP_BACKWARD_CASES, ids=lambda c: "B{}T{}H{}-{}l{}d{}".format(*c))
def test_compressed_backward_batched(monkeypatch, dtype, dims, case):
    op, ref, inputs = compressed_batched(case, dims, dtype)
    check_backward(monkeypatch, op, ref, inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", WGMMA_DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
def test_compressed_backward_varlen(monkeypatch, dtype, dims):
    """The packed sequences of compressed_varlen: dq, dk, dv of the rows that hold sequences."""
    op, ref, inputs, q_rows, k_rows = compressed_varlen(dims, dtype)
    check_backward(monkeypatch, op, ref, inputs, dtype, rows=(q_rows, k_rows, k_rows))


# ------------------------------------------------------------------------------- flash_attention (dense, window)


# (B, T, S, Hq, Hkv, causal, window): dense causal, NSA's sliding window (window (w - 1, 0)), whole tiles only,
# fewer queries than keys, not causal; a narrow window over eight query heads per KV head, where every dQ and dK/dV
# warpgroup skips a step of each query tile and head (the consumers' unseen steps).
FLASH_CASES = [
    (1, 4097, 4097, 2, 1, True, (-1, -1)),
    (2, 1000, 1000, 4, 2, True, (511, 0)),
    (1, 1500, 1500, 8, 1, True, (127, 0)),
    (1, 2048, 2048, 4, 1, True, (-1, -1)),
    (1, 3001, 3001, 4, 4, True, (255, 0)),
    (1, 640, 1030, 4, 1, False, (-1, -1)),
]


def flash_batched(case, dims, dtype):
    """A batched flash_attention case: (op, its float64-checkable reference, inputs)."""
    B, T, S, Hq, Hkv, causal, window = case
    Dqk, Dv = dims
    q = torch.randn(B, T, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(B, S, Hkv, Dqk, dtype=dtype, device="cuda")
    v = torch.randn(B, S, Hkv, Dv, dtype=dtype, device="cuda")
    vis = flash_visible(T, S, causal, window[0], window[1], "cuda")

    def op(q, k, v):
        return sparseattn.flash_attention(q, k, v, causal=causal, window=window, return_lse=True)

    def ref(q, k, v):
        outs = [naive_attention(q[b], k[b], v[b], vis, Dqk ** -0.5) for b in range(B)]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])

    return op, ref, (q, k, v)


def flash_varlen(window, dims, dtype):
    """Causal packed sequences that start and end inside tiles (64-row key tiles and 128-row query tiles too); keys
    and values as [N, H, D] views of [H, N, D] storage (strides that are not the contiguous ones): (op, reference,
    inputs)."""
    lengths = [5, 300, 1000, 129, 2048, 77, 1500]
    Hq, Hkv = 4, 2
    Dqk, Dv = dims
    cu = cu_seqlens_of(lengths, device="cuda")
    N = int(cu[-1])
    q = torch.randn(N, Hq, Dqk, dtype=dtype, device="cuda")
    k = torch.randn(Hkv, N, Dqk, dtype=dtype, device="cuda").transpose(0, 1)
    v = torch.randn(Hkv, N, Dv, dtype=dtype, device="cuda").transpose(0, 1)

    def op(q, k, v):
        return sparseattn.flash_attention(q, k, v, causal=True, window=window, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), return_lse=True)

    def ref(q, k, v):
        return naive_packed(q, k, v, cu, cu, lambda b, t, s: flash_visible(t, s, True, *window, q.device),
                            Dqk ** -0.5)

    return op, ref, (q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", WGMMA_DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
@pytest.mark.parametrize("case", FLASH_CASES, ids=lambda c: "B{}T{}S{}H{}-{}c{}w{}".format(*c))
def test_flash_batched(monkeypatch, dtype, dims, case):
    op, ref, inputs = flash_batched(case, dims, dtype)
    check(monkeypatch, op, ref, inputs, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [(-1, -1), (511, 0)], ids=["causal", "window512"])
@pytest.mark.parametrize("dims", WGMMA_DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
def test_flash_varlen(monkeypatch, dtype, window, dims):
    op, ref, inputs = flash_varlen(window, dims, dtype)
    check(monkeypatch, op, ref, inputs, dtype)


# (B, T, S, Hq, Hkv, causal, window): dense causal (a last 64-key tile of 1 row, a last 128-query tile of 1 row),
# NSA's sliding window (40 and 104 rows), fewer queries than keys (not causal; a last key tile of 6 rows), group 1
# with a window of 256 (a dK/dV CTA of 57 keys, a last query step of 57 rows).
FLASH_BACKWARD_CASES = [FLASH_CASES[0], FLASH_CASES[1], FLASH_CASES[4], FLASH_CASES[3]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", WGMMA_DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
@pytest.mark.parametrize("case", FLASH_BACKWARD_CASES, ids=lambda c: "B{}T{}S{}H{}-{}c{}w{}".format(*c))
def test_flash_backward_batched(monkeypatch, dtype, dims, case):
    op, ref, inputs = flash_batched(case, dims, dtype)
    check_backward(monkeypatch, op, ref, inputs, dtype)


@pytest.mark.parametrize("window,dtype", [((-1, -1), torch.bfloat16), ((511, 0), torch.float16)],
                         ids=["causal-bf16", "window512-fp16"])
@pytest.mark.parametrize("dims", WGMMA_DIMS, ids=lambda d: f"{d[0]}_{d[1]}")
def test_flash_backward_varlen(monkeypatch, window, dtype, dims):
    """The packed sequences of flash_varlen."""
    op, ref, inputs = flash_varlen(window, dims, dtype)
    check_backward(monkeypatch, op, ref, inputs, dtype)


# ------------------------------------------------------------------------------------ NSA, and the kernel choice

@pytest.mark.parametrize("dtype", DTYPES)
def test_nsa_compressed_and_window_branches(monkeypatch, dtype):
    """nsa_attention with the compressed and window branches (no selected branch): the same output bit for bit."""
    T, Hq, Hkv, D = 3001, 8, 2, 128
    config = sparseattn.NSAConfig(window=512)
    q = torch.randn(1, T, Hq, D, dtype=dtype, device="cuda")
    k = torch.randn(1, T, Hkv, D, dtype=dtype, device="cuda")
    v = torch.randn(1, T, Hkv, D, dtype=dtype, device="cuda")
    g_cmp, g_swa = (torch.rand(1, T, Hq, dtype=dtype, device="cuda") for _ in range(2))
    outputs = []
    for value in ("0", "1"):
        monkeypatch.setenv(SWITCH, value)
        poison_allocator()
        with torch.no_grad():
            outputs.append(sparseattn.nsa_attention(q, k, v, g_cmp, None, g_swa, config=config).clone())
    assert not torch.isnan(outputs[0]).any()
    assert torch.equal(outputs[1], outputs[0]), "nsa_attention: the TMA producer changes the output"


@pytest.mark.parametrize("dtype", DTYPES)
def test_nsa_backward_compressed_and_window_branches(monkeypatch, dtype):
    """nsa_attention's backward with the compressed and window branches (the gates reach the branches' backward as P
    factors, which the dK/dV's TMA producer copies with lse and delta): the gradients of q, k, v and both gates bit
    for bit."""
    T, Hq, Hkv, D = 3001, 8, 2, 128
    config = sparseattn.NSAConfig(window=512)
    inputs = [torch.randn(1, T, h, D, dtype=dtype, device="cuda") for h in (Hq, Hkv, Hkv)]
    inputs += [torch.rand(1, T, Hq, dtype=dtype, device="cuda") for _ in range(2)]
    d_o = torch.randn(1, T, Hq, D, dtype=dtype, device="cuda")
    grads = []
    for value in ("0", "1"):
        monkeypatch.setenv(SWITCH, value)
        leaves = [x.detach().requires_grad_() for x in inputs]
        poison_allocator()
        o = sparseattn.nsa_attention(leaves[0], leaves[1], leaves[2], leaves[3], None, leaves[4], config=config)
        poison_allocator()
        grads.append([g.clone() for g in torch.autograd.grad(o, leaves, d_o)])
        torch.cuda.synchronize()
    for name, cp, tma in zip(("dq", "dk", "dv", "dg_cmp", "dg_swa"), *grads):
        assert torch.isfinite(cp).all(), name
        assert torch.equal(tma, cp), f"nsa_attention {name}: the TMA producers change the gradient"


def launched_kernels(monkeypatch, value, fn, part):
    """The names of the CUDA kernels whose name holds `part` that fn() launches with SPARSEATTN_ATTENTION_TMA=value
    (None: unset)."""
    if value is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, value)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if part in e.name]


@pytest.mark.parametrize("D", [128, 64])
def test_switch_selects_the_tma_kernel(monkeypatch, D):
    """With the switch on, compressed_attention and flash_attention run attention_forward_wgmma_tma_kernel and, in
    their backward, attention_dq_wgmma_tma_kernel and attention_dkv_wgmma_tma_kernel where the cp.async run shows the
    wgmma kernels (an sm_90a build on Hopper); unset, the forward's and dQ's TMA kernels run from 1536 keys and 128
    queries on (flash_attention's 2000 of each) and the cp.async kernels below (the 124 compressed keys), the dK/dV's
    TMA kernel at every size; the mma.sync override still wins. D = 128 and 64: the dK/dV consumers' two schedules (WgmmaDkvTmaTile::kOverlapsUpdate)."""
    T = 2000
    q = torch.randn(1, T, 4, D, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, T, 2, D, dtype=torch.bfloat16, device="cuda")
    Tc = num_blocks(T, 32, 16)
    d_o = torch.randn(1, T, 4, D, dtype=torch.bfloat16, device="cuda")
    forward_calls = {
        "compressed": lambda q, k: sparseattn.compressed_attention(q, k[:, :Tc], k[:, :Tc])[0],
        "flash": lambda q, k: sparseattn.flash_attention(q, k, k, causal=True),
    }
    monkeypatch.delenv("SPARSEATTN_ATTENTION_MMA", raising=False)
    for name, call in forward_calls.items():
        def forward():
            with torch.no_grad():
                call(q, k)

        def backward():
            leaves = [q.detach().requires_grad_(), k.detach().requires_grad_()]
            torch.autograd.grad(call(*leaves), leaves, d_o)

        for fn, part, kernel in ((forward, "attention_forward", "attention_forward_wgmma"),
                                 (backward, "attention_dq", "attention_dq_wgmma"),
                                 (backward, "attention_dkv", "attention_dkv_wgmma")):
            plain = launched_kernels(monkeypatch, "0", fn, part)
            if not plain:
                pytest.skip("the profiler shows no CUDA kernels here")
            if not any(f"{kernel}_kernel" in n for n in plain):
                pytest.skip(f"{kernel} does not run here (not an sm_90a build on Hopper)")
            assert not any("tma_kernel" in n for n in plain), f"{name}: TMA kernel with the switch off: {plain}"
            with_tma = launched_kernels(monkeypatch, "1", fn, part)
            assert any(f"{kernel}_tma_kernel" in n for n in with_tma), f"{name}: {with_tma}"
            by_default = launched_kernels(monkeypatch, None, fn, part)
            tma_by_default = name == "flash" or kernel == "attention_dkv_wgmma"
            assert any(f"{kernel}_tma_kernel" in n for n in by_default) == tma_by_default, \
                f"{name} with the switch unset: {by_default}"
            monkeypatch.setenv("SPARSEATTN_ATTENTION_MMA", "sync")
            forced = launched_kernels(monkeypatch, "1", fn, part)
            assert forced and not any("wgmma" in n for n in forced), f"{name}: {forced}"
            monkeypatch.delenv("SPARSEATTN_ATTENTION_MMA")
