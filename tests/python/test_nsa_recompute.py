"""nsa_attention(recompute=...): "branches" (the op keeps only log-sum-exps, selection and pooled K/V and recomputes
the branch outputs in its backward) and "full" (torch.utils.checkpoint around the op) give the same output and
gradients as the default "none", bit for bit, and keep less for the backward (checked by the tensors autograd saves
and by the op's workspace size)."""
import pytest
import torch

from helpers import require_sparseattn

sa = require_sparseattn()
from sparseattn import _C, _ops  # noqa: E402

CFG = sa.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, num_selected=3, num_local=1, window=16)
MODES = ("none", "branches", "selected_and_window", "full")
GATE_SETS = [(1, 1, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1)]


def inputs(gen, packed=False, T=97, S=None, heads=(4, 2), dim=16, dtype=torch.float64, gates=(1, 1, 1)):
    hq, hkv = heads
    S = T if S is None else S
    shape_q, shape_k = ((T,), (S,)) if packed else ((2, T), (2, S))
    q = torch.randn(*shape_q, hq, dim, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(*shape_k, hkv, dim, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(*shape_k, hkv, dim, generator=gen, dtype=dtype, requires_grad=True)
    g = [torch.rand(*shape_q, hq, generator=gen, dtype=dtype, requires_grad=True) if on else None for on in gates]
    return q, k, v, g


def saved_bytes(fn):
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(total)


def run_modes(q, k, v, gates, d_o, modes=MODES, **kwargs):
    """{mode: (o, grads of q, k, v and the given gates and k_cmp/v_cmp, bytes autograd saved)}."""
    grad_inputs = [t for t in (q, k, v, *gates, kwargs.get("k_cmp"), kwargs.get("v_cmp")) if t is not None]
    results = {}
    for mode in modes:
        o, kept = saved_bytes(lambda: sa.nsa_attention(q, k, v, *gates, config=CFG, recompute=mode, **kwargs))
        results[mode] = (o, torch.autograd.grad(o, grad_inputs, d_o), kept)
    return results


def assert_all_equal(results):
    o0, g0, _ = results["none"]
    for mode, (o, grads, _) in results.items():
        assert torch.equal(o, o0), mode
        assert len(grads) == len(g0)
        for i, (a, b) in enumerate(zip(grads, g0)):
            assert torch.equal(a, b), (mode, i)


@pytest.mark.parametrize("gates", GATE_SETS)
@pytest.mark.parametrize("packed", [False, True])
def test_modes_give_the_same_output_and_gradients(packed, gates):
    gen = torch.Generator().manual_seed(10 * int(packed) + sum(g << i for i, g in enumerate(gates)))
    q, k, v, g = inputs(gen, packed, gates=gates)
    cu = torch.tensor([0, 40, 97], dtype=torch.int32) if packed else None
    d_o = torch.randn(q.shape, generator=gen, dtype=q.dtype)
    results = run_modes(q, k, v, g, d_o, cu_seqlens=cu)
    assert_all_equal(results)
    inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, *g) if t is not None)
    index_bytes = 0 if cu is None else 2 * cu.numel() * cu.element_size()  # cu_seqlens and the compressed one
    kept = {mode: r[2] for mode, r in results.items()}
    assert kept["full"] <= inputs_bytes + index_bytes
    # "none" keeps every branch output the backward reads; "branches" none of them.
    output_bytes = q.shape[:-1].numel() * v.shape[-1] * q.element_size()
    assert kept["branches"] + output_bytes <= kept["none"]
    # "selected_and_window" keeps the compressed output where that branch runs, and drops the other two.
    dropped = gates[1] + gates[2]
    assert kept["selected_and_window"] + dropped * output_bytes <= kept["none"]
    if gates[0]:
        assert kept["selected_and_window"] >= kept["branches"] + output_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_modes_with_user_compression_selection_and_query_chunks(dtype):
    gen = torch.Generator().manual_seed(7)
    # Query chunk: 30 queries at the end of 97 keys; GQA group 3; user k_cmp/v_cmp; then user block_indices.
    q, k, v, g = inputs(gen, T=30, S=97, heads=(6, 2), dtype=dtype)
    d_o = torch.randn(q.shape, generator=gen, dtype=dtype)
    k_cmp, v_cmp = sa.compress_kv(k.detach(), v.detach(), block=CFG.cmp_block, stride=CFG.cmp_stride)
    k_cmp, v_cmp = (t.clone().requires_grad_() for t in (k_cmp, v_cmp))
    assert_all_equal(run_modes(q, k, v, g, d_o, k_cmp=k_cmp, v_cmp=v_cmp))
    n_blocks = -(-97 // CFG.sel_block)
    idx = torch.full((2, 30, 2, 3), -1, dtype=torch.int32)
    for t in range(30):
        visible = (67 + t) // CFG.sel_block + 1  # blocks up to the one holding key position 67 + t
        picks = torch.randperm(visible, generator=gen)[:3].sort().values
        idx[:, t, :, : picks.numel()] = picks.to(torch.int32)
    assert n_blocks >= visible
    assert_all_equal(run_modes(q, k, v, g, d_o, block_indices=idx))


def test_branches_mode_is_deterministic_and_works_without_grad():
    gen = torch.Generator().manual_seed(11)
    q, k, v, g = inputs(gen)
    d_o = torch.randn(q.shape, generator=gen, dtype=q.dtype)
    first = run_modes(q, k, v, g, d_o, modes=("branches",))["branches"]
    second = run_modes(q, k, v, g, d_o, modes=("branches",))["branches"]
    assert torch.equal(first[0], second[0])
    for a, b in zip(first[1], second[1]):
        assert torch.equal(a, b)
    with torch.no_grad():
        assert torch.equal(sa.nsa_attention(q, k, v, *g, config=CFG, recompute="branches"), first[0])
    # An output gradient that is not contiguous (stands in for o in the backward, which does not read o).
    wide = torch.randn(*q.shape[:-1], 2 * v.shape[-1], generator=gen, dtype=q.dtype)
    d_o = wide[..., : v.shape[-1]]
    assert d_o.stride(-1) == 1 and not d_o.is_contiguous()
    assert_all_equal(run_modes(q, k, v, g, d_o))


def sizes(mode, T=4096, hq=64, hkv=4, dim=128, gates=(1, 1, 1), device="cpu", backward=False):
    """Per token: (workspace, forward scratch[, backward scratch]) of nsa_attention at the paper's defaults, bf16
    shapes (the size queries take shapes only: a CPU build sizes CUDA calls too, without the kernels' own
    workspaces)."""
    q, kv, g = ("bfloat16", (1, T, hq, dim)), ("bfloat16", (1, T, hkv, dim)), ("bfloat16", (1, T, hq))
    gs = [g if on else None for on in gates]
    config = (32, 16, 64, 16, 1, 2, 512, None)
    queries = [_C.nsa_workspace_size, _C.nsa_forward_scratch_size]
    if backward:
        queries.append(_C.nsa_backward_scratch_size)
    return [f(device, 0, q, kv, kv, None, None, None, *gs, q, None, None, 0, *config, recompute=mode) / T
            for f in queries]


def test_workspace_sizes_per_token():
    none_ws, none_scratch = sizes("none")
    branches_ws, branches_scratch = sizes("branches")
    # 64/4 heads, D = 128, bf16: three outputs (49,152 B), lses (768), indices (256), pooled K/V (128) per token.
    assert 50_000 <= none_ws <= 50_400 and none_scratch == 0
    assert 1_100 <= branches_ws <= 1_200
    # The forward holds two branch outputs in scratch; the window's goes into o.
    assert branches_scratch == 2 * 64 * 128 * 2
    # Without the compressed branch its outputs serve selection only and are not kept.
    assert sizes("branches", gates=(0, 1, 1))[0] < branches_ws - 200
    # "selected_and_window" keeps the compressed output too; its forward scratch holds the selected output.
    assert sizes("selected_and_window") == [branches_ws + 64 * 128 * 2, 64 * 128 * 2]
    # The backward's scratch: on the CPU one recomputed output and its lse more; on CUDA only the lse (the outputs
    # are recomputed in dq's memory).
    output, lse = 64 * 128 * 2, 64 * 4
    for mode in ("branches", "selected_and_window"):
        assert sizes(mode, backward=True)[2] - sizes("none", backward=True)[2] >= output + lse
        cuda_extra = sizes(mode, device="cuda", backward=True)[2] - sizes("none", device="cuda", backward=True)[2]
        assert lse <= cuda_extra < lse + 64


def test_backward_checks_the_mode_through_the_workspace_size():
    gen = torch.Generator().manual_seed(12)
    q, k, v, g = inputs(gen)
    args = (q, k, v, None, None, None, *g, None, None, 0, CFG.cmp_block, CFG.cmp_stride, CFG.sel_block,
            CFG.num_selected, CFG.num_init, CFG.num_local, CFG.window, None)
    with torch.no_grad():
        o, workspace = _ops.nsa_attention(*args, None, 0, "branches")
        with pytest.raises(sa.SparseAttnError, match="workspace"):
            _ops.nsa_attention_backward(*args, o, workspace, torch.ones_like(o), None, 0, "none")
        with pytest.raises(sa.SparseAttnError, match="recompute"):
            _ops.nsa_attention(*args, None, 0, "outputs")


def test_branches_mode_needs_a_contiguous_o():
    gen = torch.Generator().manual_seed(13)
    q, k, v, g = inputs(gen)
    q, k, v = (t.detach() for t in (q, k, v))
    g = [t.detach() for t in g]
    config = (CFG.cmp_block, CFG.cmp_stride, CFG.sel_block, CFG.num_selected, CFG.num_init, CFG.num_local,
              CFG.window, None)
    o = torch.empty(q.shape[0], q.shape[1], q.shape[2], 2 * q.shape[3], dtype=q.dtype)[..., : q.shape[3]]
    assert o.stride(-1) == 1 and not o.is_contiguous()
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    scratch = torch.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(sa.SparseAttnError, match="contiguous"):
        _C.nsa_attention(q, k, v, None, None, None, *g, o, None, None, 0, *config, workspace, scratch, 0,
                         recompute="branches")


def test_module_switch_and_bad_values():
    core = sa.NativeSparseAttentionCore(CFG, recompute=True)
    assert core.recompute == "full" and "recompute='full'" in repr(core)
    assert sa.NativeSparseAttentionCore(CFG, recompute=False).recompute == "none"
    core = sa.NativeSparseAttentionCore(CFG, recompute="branches")
    assert "recompute='branches'" in repr(core)
    gen = torch.Generator().manual_seed(3)
    q, k, v, gates = inputs(gen)
    with torch.no_grad():
        assert torch.equal(core(q, k, v, *gates), sa.nsa_attention(q, k, v, *gates, config=CFG))
    layer = sa.NativeSparseAttention(32, 4, 2, 8, config=CFG, recompute="branches", dtype=torch.float64)
    assert layer.core.recompute == "branches"
    with pytest.raises(sa.SparseAttnError, match="recompute"):
        sa.NativeSparseAttentionCore(CFG, recompute="yes")
    with pytest.raises(sa.SparseAttnTypeError, match="recompute"):
        sa.NativeSparseAttentionCore(CFG, recompute=1)
    with pytest.raises(sa.SparseAttnTypeError, match="recompute"):
        sa.nsa_attention(q, k, v, *gates, config=CFG, recompute=None)


@pytest.mark.skipif(not torch.cuda.is_available() or not sa.built_with_cuda(), reason="needs a CUDA GPU and build")
def test_recompute_on_cuda_is_bit_equal_and_lowers_the_peak():
    gen = torch.Generator(device="cuda").manual_seed(4)
    T, opts = 8192, dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, T, 16, 128, generator=gen, **opts).requires_grad_()
    k = torch.randn(1, T, 1, 128, generator=gen, **opts).requires_grad_()
    v = torch.randn(1, T, 1, 128, generator=gen, **opts).requires_grad_()
    gates = [torch.rand(1, T, 16, generator=gen, **opts).requires_grad_() for _ in range(3)]
    d_o = torch.randn(q.shape, generator=gen, **opts)
    results = {}
    for recompute in MODES:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        o = sa.nsa_attention(q, k, v, *gates, recompute=recompute)
        grads = torch.autograd.grad(o, (q, k, v, *gates), d_o)
        torch.cuda.synchronize()
        results[recompute] = (o, grads, torch.cuda.max_memory_allocated() - base)
    for mode in ("branches", "full"):
        assert torch.equal(results["none"][0], results[mode][0])
        for a, b in zip(results["none"][1], results[mode][1]):
            assert torch.equal(a, b)
    assert results["branches"][2] < results["none"][2]


def test_bench_reports_both_modes():
    from sparseattn import bench
    shape = bench.Shape.parse("64/4/128/128")
    result = {"shape": {"heads_q": 64, "heads_kv": 4, "dim_qk": 128, "dim_v": 128}, "seqlen": 262144,
              "times_ms": {"nsa_fwd": 300.0, "nsa_fwd_bwd": 1000.0, "nsa_branches_fwd_bwd": 1100.0,
                           "nsa_selected_and_window_fwd_bwd": 1050.0}, "reps": {},
              "peak_memory_gb": {"nsa": 30.0, "nsa_branches": 15.0, "nsa_selected_and_window": 20.0}, "errors": {}}
    result = bench.summarize(result, shape, 262144, sa.NSAConfig())
    meta = {"gpu": "Test GPU", "date": "2026-01-02", "commit": "abc1234", "torch": "2.11", "dtype": "bfloat16",
            "config": {"window": 512}}
    text = bench.markdown(meta, [result])
    assert "| 64/4, 128/128 | 256K | 1000 | 1100 | +10.0% | 1050 | +5.0% | 30.00 / 15.00 / 20.00 |" in text
    assert bench.measurements_per_case(False) == 2 * len(bench.DENSE) + 4
