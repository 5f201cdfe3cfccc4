"""nsa_attention(recompute="branches" and "selected_and_window") on CUDA: the same output and gradients as
recompute="none", bit for bit
(the backward recomputes each branch's output with the forward's own kernel call, and the gate gradients and
deltas per branch with the same combine_backward kernel), for the batched and packed layouts, GQA groups, every
head dim, skipped branches, user selection and query chunks; deterministic; and less memory kept and at peak.
Freed cache blocks are poisoned with NaN before each run, so a recomputed buffer read before it is written shows."""
import pytest
import torch

import sparseattn
from attention_check import poison_allocator
from helpers import cu_seqlens_of, pack

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
                       reason="needs a CUDA GPU and a CUDA build of sparseattn"),
]

SMALL = sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, window=64)
CASES = [  # (T, Hq, Hkv, Dqk, Dv, config)
    (1000, 8, 2, 128, 128, sparseattn.NSAConfig()),
    (333, 6, 2, 64, 64, SMALL),
    (700, 4, 1, 192, 128, sparseattn.NSAConfig(cmp_block=64, cmp_stride=64, sel_block=128, num_selected=8,
                                               window=100)),
    (65, 3, 3, 256, 256, sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=16, num_selected=3, window=5)),
    (1500, 16, 1, 128, 128, sparseattn.NSAConfig()),
]
GATE_SETS = [(1, 1, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)]


def make(shape_q, shape_k, hq, hkv, dqk, dv, dtype, gen, gates=(1, 1, 1)):
    opts = dict(device="cuda", dtype=dtype)
    q = torch.randn(*shape_q, hq, dqk, generator=gen, **opts).requires_grad_()
    k = torch.randn(*shape_k, hkv, dqk, generator=gen, **opts).requires_grad_()
    v = torch.randn(*shape_k, hkv, dv, generator=gen, **opts).requires_grad_()
    g = [torch.rand(*shape_q, hq, generator=gen, **opts).requires_grad_() if on else None for on in gates]
    d_o = torch.randn(*shape_q, hq, dv, generator=gen, **opts)
    return q, k, v, g, d_o


def run(mode, q, k, v, gates, d_o, **kwargs):
    poison_allocator()
    inputs = [t for t in (q, k, v, *gates) if t is not None]
    o = sparseattn.nsa_attention(q, k, v, *gates, recompute=mode, **kwargs)
    return [o, *torch.autograd.grad(o, inputs, d_o)]


def assert_modes_equal(q, k, v, gates, d_o, modes=("branches", "selected_and_window"), **kwargs):
    expected = run("none", q, k, v, gates, d_o, **kwargs)
    for tensor in expected:
        assert torch.isfinite(tensor).all()
    for mode in modes:
        got = run(mode, q, k, v, gates, d_o, **kwargs)
        for i, (a, b) in enumerate(zip(got, expected)):
            assert torch.equal(a, b), (mode, i)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-{c[1]}x{c[2]}-d{c[3]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batched_bit_equal(case, dtype):
    T, hq, hkv, dqk, dv, config = case
    gen = torch.Generator(device="cuda").manual_seed(T + hq)
    q, k, v, g, d_o = make((2, T), (2, T), hq, hkv, dqk, dv, dtype, gen)
    assert_modes_equal(q, k, v, g, d_o, modes=("branches", "selected_and_window", "full"), config=config)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"T{c[0]}-{c[1]}x{c[2]}-d{c[3]}")
def test_packed_bit_equal(case):
    T, hq, hkv, dqk, dv, config = case
    lengths = [T, 1, T // 3 + 7]
    gen = torch.Generator(device="cuda").manual_seed(3 * T)
    q, k, v, g, d_o = make((3, T), (3, T), hq, hkv, dqk, dv, torch.bfloat16, gen)
    # Packed with 5 rows past the last sequence (the op leaves them untouched).
    packed = [pack(t.detach(), lengths, extra_rows=5).requires_grad_() for t in (q, k, v, *g)]
    d_o = pack(d_o, lengths, extra_rows=5)
    cu = cu_seqlens_of(lengths, device="cuda")
    assert_modes_equal(*packed[:3], packed[3:], d_o, config=config, cu_seqlens=cu, max_seqlen=max(lengths))


@pytest.mark.parametrize("gates", GATE_SETS)
@pytest.mark.parametrize("packed", [False, True])
def test_skipped_branches_bit_equal(gates, packed):
    gen = torch.Generator(device="cuda").manual_seed(sum(on << i for i, on in enumerate(gates)) + 8 * packed)
    T = 777
    q, k, v, g, d_o = make((2, T), (2, T), 8, 2, 128, 128, torch.bfloat16, gen, gates)
    kwargs = dict(config=SMALL)
    if packed:
        lengths = [T, T - 300]
        q, k, v = (pack(t.detach(), lengths).requires_grad_() for t in (q, k, v))
        g = [None if t is None else pack(t.detach(), lengths).requires_grad_() for t in g]
        d_o = pack(d_o, lengths)
        kwargs.update(cu_seqlens=cu_seqlens_of(lengths, device="cuda"), max_seqlen=T)
    assert_modes_equal(q, k, v, g, d_o, **kwargs)


def test_user_selection_and_query_chunk_bit_equal():
    gen = torch.Generator(device="cuda").manual_seed(21)
    T, S = 300, 1100  # a batched query chunk: the last 300 positions of 1100 keys
    q, k, v, g, d_o = make((2, T), (2, S), 8, 2, 128, 128, torch.bfloat16, gen)
    assert_modes_equal(q, k, v, g, d_o, config=SMALL)
    # User block indices (the chunk's own selection, taken from a run of the op's select_blocks path).
    c = SMALL
    k_cmp, v_cmp = sparseattn.compress_kv(k.detach(), v.detach(), block=c.cmp_block, stride=c.cmp_stride)
    _, lse = sparseattn.compressed_attention(q.detach(), k_cmp, v_cmp, block=c.cmp_block, stride=c.cmp_stride,
                                             seqlen_k=S)
    idx = sparseattn.select_blocks(q.detach(), k_cmp, lse, cmp_block=c.cmp_block, cmp_stride=c.cmp_stride,
                                   sel_block=c.sel_block, num_selected=c.num_selected, num_init=c.num_init,
                                   num_local=c.num_local, seqlen_k=S)
    assert_modes_equal(q, k, v, g, d_o, config=SMALL, block_indices=idx)


@pytest.mark.parametrize("mode", ["branches", "selected_and_window"])
def test_recomputation_is_deterministic(mode):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, g, d_o = make((1, 4096), (1, 4096), 16, 2, 128, 128, torch.bfloat16, gen)
    first = run(mode, q, k, v, g, d_o)
    for _ in range(2):
        for a, b in zip(run(mode, q, k, v, g, d_o), first):
            assert torch.equal(a, b)


def peak_above(fn):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - base


def test_branches_keeps_about_a_kilobyte_per_token_and_lowers_the_peak():
    T = 32768
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v, g, d_o = make((1, T), (1, T), 64, 4, 128, 128, torch.bfloat16, gen)
    peaks, kept = {}, {}
    for mode in ("none", "branches"):
        def forward_backward():
            o = sparseattn.nsa_attention(q, k, v, *g, recompute=mode)
            kept[mode] = torch.cuda.memory_allocated() - o.numel() * o.element_size()
            return torch.autograd.grad(o, (q, k, v, *g), d_o)
        before = torch.cuda.memory_allocated()
        _, peaks[mode] = peak_above(forward_backward)
        kept[mode] -= before
    # Kept between forward and backward: ~50 KB per token with "none", ~1.2 KB with "branches" (64/4, D = 128).
    assert kept["none"] > 45_000 * T
    assert kept["branches"] < 1_500 * T
    # The peak (gradients included) drops by the branch outputs at least (3 x 16 KB per token less, half of it
    # back for the one recomputed output and the forward's scratch).
    assert peaks["branches"] < peaks["none"] - 20_000 * T
