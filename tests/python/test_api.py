"""API behaviour of every op on CPU: exported names, config, output shapes and dtypes, error types/messages."""

import dataclasses

import pytest
import torch

from helpers import (cu_seqlens_of, gates, pack, qkv, raises_arg, randn, require_sparseattn)

sa = require_sparseattn()
Err, DTypeErr, UnsupErr = sa.SparseAttnError, sa.SparseAttnDTypeError, sa.SparseAttnUnsupportedError

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
SMALL = dict(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, num_init=1, num_local=2, window=64)


def lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------- exports


def test_exports():
    for name in ["NSAConfig", "compressed_cu_seqlens", "compress_kv", "compressed_attention", "select_blocks",
                 "selected_attention", "flash_attention", "combine", "nsa_attention",
                 "NativeSparseAttentionCore", "NativeSparseAttention", "SparseAttnError",
                 "SparseAttnDTypeError", "SparseAttnUnsupportedError"]:
        assert hasattr(sa, name), name


def test_exception_hierarchy():
    assert issubclass(Err, ValueError)
    assert issubclass(DTypeErr, Err) and issubclass(DTypeErr, TypeError)
    assert issubclass(UnsupErr, NotImplementedError)


def test_config_defaults_and_frozen():
    c = sa.NSAConfig()
    assert dataclasses.is_dataclass(c)
    assert (c.cmp_block, c.cmp_stride, c.sel_block, c.num_selected, c.num_init, c.num_local, c.window,
            c.scale) == (32, 16, 64, 16, 1, 2, 512, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.window = 3
    c2 = dataclasses.replace(c, window=64)
    assert c2.window == 64 and c.window == 512


def test_custom_ops_registered():
    ns = torch.ops.sparseattn
    names = [n for n in dir(ns) if not n.startswith("_")]
    assert names, "no op registered under torch.ops.sparseattn"


# ------------------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize("block,stride", [(32, 16), (16, 8), (8, 8)])
def test_compressed_cu_seqlens(block, stride):
    lengths = [0, 1, 31, 32, 33, 48, 100, 7]
    cu = cu_seqlens_of(lengths)
    got = sa.compressed_cu_seqlens(cu, block=block, stride=stride)
    nb = [(n - block) // stride + 1 if n >= block else 0 for n in lengths]
    exp = [0]
    for n in nb:
        exp.append(exp[-1] + n)
    assert got.dtype == torch.int32 and got.device == cu.device
    assert got.tolist() == exp


def test_compressed_cu_seqlens_defaults():
    got = sa.compressed_cu_seqlens(cu_seqlens_of([32, 64, 10]))
    assert got.tolist() == [0, 1, 4, 4]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("T", [1, 15, 16, 31, 32, 40, 64])
def test_compress_kv_shapes(T, dtype):
    k = randn(2, T, 3, 8, dtype=dtype)
    v = randn(2, T, 3, 5, dtype=dtype)
    kc, vc = sa.compress_kv(k, v, block=16, stride=8)
    tc = (T - 16) // 8 + 1 if T >= 16 else 0
    assert kc.shape == (2, tc, 3, 8) and vc.shape == (2, tc, 3, 5)
    assert kc.dtype == dtype and vc.dtype == dtype


def test_compress_kv_packed_shape():
    lengths = [5, 40, 16, 0, 23]
    N = sum(lengths) + 3
    k, v = randn(N, 2, 8), randn(N, 2, 4)
    kc, vc = sa.compress_kv(k, v, block=16, stride=8, cu_seqlens=cu_seqlens_of(lengths))
    assert kc.shape == (N // 8, 2, 8) and vc.shape == (N // 8, 2, 4)


@pytest.mark.parametrize("dtype", FLOATS)
def test_attention_op_shapes(dtype):
    B, T, Hq, Hkv, D, Dv = 2, 40, 6, 2, 16, 8
    q, k, v = qkv(B, T, Hq, Hkv, D, Dv, dtype=dtype)
    kc, vc = sa.compress_kv(k, v, block=16, stride=8)
    o, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8)
    assert o.shape == (B, T, Hq, Dv) and o.dtype == dtype
    assert lse.shape == (B, Hq, T) and lse.dtype == lse_dtype(dtype)
    idx = sa.select_blocks(q, kc, lse, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=3)
    assert idx.shape == (B, T, Hkv, 3) and idx.dtype == torch.int32
    o, lse = sa.selected_attention(q, k, v, idx, block=32)
    assert o.shape == (B, T, Hq, Dv) and o.dtype == dtype
    assert lse.shape == (B, Hq, T) and lse.dtype == lse_dtype(dtype)
    o = sa.flash_attention(q, k, v, causal=True)
    assert isinstance(o, torch.Tensor) and o.shape == (B, T, Hq, Dv) and o.dtype == dtype
    o, lse = sa.flash_attention(q, k, v, causal=True, return_lse=True)
    assert lse.shape == (B, Hq, T) and lse.dtype == lse_dtype(dtype)
    g = gates(B, T, Hq, dtype=dtype)
    o = sa.combine(o, o, None, g, g, None)
    assert o.shape == (B, T, Hq, Dv) and o.dtype == dtype
    o = sa.nsa_attention(q, k, v, g, g, g, config=sa.NSAConfig(**SMALL))
    assert o.shape == (B, T, Hq, Dv) and o.dtype == dtype


def test_flash_cross_shapes():
    q = randn(2, 5, 4, 16)
    k, v = randn(2, 9, 1, 16), randn(2, 9, 1, 12)
    o, lse = sa.flash_attention(q, k, v, causal=True, return_lse=True)
    assert o.shape == (2, 5, 4, 12) and lse.shape == (2, 4, 5)


def test_packed_shapes():
    lengths = [1, 40, 0, 33]
    N, Hq, Hkv, D = sum(lengths) + 2, 4, 2, 16
    q, k, v = randn(N, Hq, D), randn(N, Hkv, D), randn(N, Hkv, 8)
    cu = cu_seqlens_of(lengths)
    ccu = sa.compressed_cu_seqlens(cu, block=16, stride=8)
    kc, vc = sa.compress_kv(k, v, block=16, stride=8, cu_seqlens=cu)
    o, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8, cu_seqlens=cu, cu_seqlens_cmp=ccu)
    assert o.shape == (N, Hq, 8) and lse.shape == (Hq, N)
    o2, lse2 = sa.compressed_attention(q, kc, vc, block=16, stride=8, cu_seqlens=cu)  # cmp cu derived
    n = int(cu[-1])
    torch.testing.assert_close(o2[:n], o[:n])
    idx = sa.select_blocks(q, kc, lse, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=3,
                           cu_seqlens=cu, cu_seqlens_cmp=ccu)
    assert idx.shape == (N, Hkv, 3) and idx.dtype == torch.int32
    o, lse = sa.selected_attention(q, k, v, idx, block=32, cu_seqlens=cu)
    assert o.shape == (N, Hq, 8) and lse.shape == (Hq, N)
    o = sa.flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=40,
                           max_seqlen_k=40)
    assert o.shape == (N, Hq, 8)
    g = gates(N, Hq)
    o = sa.nsa_attention(q, k, v, g, g, g, config=sa.NSAConfig(**SMALL), cu_seqlens=cu, max_seqlen=40)
    assert o.shape == (N, Hq, 8)


def test_indices_format():
    B, T, Hq, Hkv = 1, 200, 4, 2
    q, k, v = qkv(B, T, Hq, Hkv, 16)
    kc, vc = sa.compress_kv(k, v, block=16, stride=8)
    _, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8)
    idx = sa.select_blocks(q, kc, lse, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4)
    for t in range(T):
        cur = t // 32
        for h in range(Hkv):
            row = idx[0, t, h].tolist()
            valid = [b for b in row if b >= 0]
            assert valid == sorted(set(valid)), row
            assert len(valid) == min(4, cur + 1), (t, row)
            assert row[len(valid):] == [-1] * (4 - len(valid)), row
            assert 0 in valid and cur in valid and (cur == 0 or cur - 1 in valid), (t, row)  # forced


def test_select_blocks_not_differentiable():
    q, k, v = qkv(1, 40, 2, 1, 8, requires_grad=True)
    kc, vc = sa.compress_kv(k, v, block=16, stride=8)
    _, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8)
    idx = sa.select_blocks(q, kc, lse, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=3)
    assert not idx.requires_grad


def test_combine_skips_none_branches():
    o1, o2, o3 = randn(2, 5, 3, 4), randn(2, 5, 3, 4), randn(2, 5, 3, 4)
    g1, g3 = gates(2, 5, 3), gates(2, 5, 3)
    got = sa.combine(o1, None, o3, g1, None, g3)
    torch.testing.assert_close(got, g1[..., None] * o1 + g3[..., None] * o3)
    got = sa.combine(o1, o2, o3, None, None, g3)  # outputs of skipped branches are ignored
    torch.testing.assert_close(got, g3[..., None] * o3)


def test_default_scale_is_rsqrt_dqk():
    q, k, v = qkv(1, 9, 2, 2, 16, 4)
    a = sa.flash_attention(q, k, v)
    b = sa.flash_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(a, b)
    g = gates(1, 9, 2)
    c = sa.nsa_attention(q, k, v, None, None, g, config=sa.NSAConfig(**SMALL))
    d = sa.nsa_attention(q, k, v, None, None, g, config=sa.NSAConfig(**SMALL, scale=0.25))
    torch.testing.assert_close(c, d)


def test_meta_tensors_batched_shapes():
    """The fake (meta) implementations give the right shapes without data."""
    B, T, Hq, Hkv, D, Dv = 2, 100, 4, 2, 16, 8
    q, k, v = (x.to("meta") for x in qkv(B, T, Hq, Hkv, D, Dv, dtype=torch.bfloat16))
    kc, vc = sa.compress_kv(k, v, block=16, stride=8)
    assert kc.shape == (B, 11, Hkv, D) and kc.device.type == "meta"
    o, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8)
    assert o.shape == (B, T, Hq, Dv) and lse.shape == (B, Hq, T) and lse.dtype == torch.float32
    idx = sa.select_blocks(q, kc, lse, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=3)
    assert idx.shape == (B, T, Hkv, 3) and idx.dtype == torch.int32
    o, lse = sa.selected_attention(q, k, v, idx, block=32)
    assert o.shape == (B, T, Hq, Dv)
    o, lse = sa.flash_attention(q, k, v, causal=True, return_lse=True)
    assert o.shape == (B, T, Hq, Dv) and lse.shape == (B, Hq, T)
    g = torch.empty(B, T, Hq, dtype=torch.bfloat16, device="meta")
    assert sa.nsa_attention(q, k, v, g, g, g, config=sa.NSAConfig(**SMALL)).shape == (B, T, Hq, Dv)


# ------------------------------------------------------------------------------------------ errors

B, T, HQ, HKV, D = 2, 40, 4, 2, 16


def base(dtype=torch.float32):
    q, k, v = qkv(B, T, HQ, HKV, D, dtype=dtype)
    kc, vc = sa.compress_kv(k, v, block=16, stride=8)
    _, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8)
    idx = sa.select_blocks(q, kc, lse, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=3)
    g = gates(B, T, HQ, dtype=dtype)
    return dict(q=q, k=k, v=v, k_cmp=kc, v_cmp=vc, lse=lse, idx=idx, g=g)


def noncontig_last(x):
    """Same values, last-dimension stride 2."""
    wide = torch.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
    wide[..., ::2] = x
    y = wide[..., ::2]
    assert y.stride(-1) == 2
    return y


def calls():
    """(op name, callable(args dict) -> result) with the shared small config."""
    return {
        "compress_kv": lambda a: sa.compress_kv(a["k"], a["v"], block=16, stride=8),
        "compressed_attention": lambda a: sa.compressed_attention(a["q"], a["k_cmp"], a["v_cmp"], block=16,
                                                                  stride=8),
        "select_blocks": lambda a: sa.select_blocks(a["q"], a["k_cmp"], a["lse"], cmp_block=16, cmp_stride=8,
                                                    sel_block=32, num_selected=3),
        "selected_attention": lambda a: sa.selected_attention(a["q"], a["k"], a["v"], a["idx"], block=32),
        "flash_attention": lambda a: sa.flash_attention(a["q"], a["k"], a["v"], causal=True),
        "combine": lambda a: sa.combine(a["q"], a["q"], a["q"], a["g"], a["g"], a["g"]),
        "nsa_attention": lambda a: sa.nsa_attention(a["q"], a["k"], a["v"], a["g"], a["g"], a["g"],
                                                    config=sa.NSAConfig(**SMALL)),
    }


# op -> the tensor arguments (as named in the Python signature) and the key of the args dict they come from
TENSOR_ARGS = {
    "compress_kv": [("k", "k"), ("v", "v")],
    "compressed_attention": [("q", "q"), ("k_cmp", "k_cmp"), ("v_cmp", "v_cmp")],
    "select_blocks": [("q", "q"), ("k_cmp", "k_cmp")],
    "selected_attention": [("q", "q"), ("k", "k"), ("v", "v")],
    "flash_attention": [("q", "q"), ("k", "k"), ("v", "v")],
    "nsa_attention": [("q", "q"), ("k", "k"), ("v", "v")],
}


def test_valid_base_calls_run():
    a = base()
    for name, fn in calls().items():
        fn(a)


@pytest.mark.parametrize("op,arg,key", [(op, arg, key) for op, lst in TENSOR_ARGS.items()
                                        for arg, key in lst[1:]])
def test_error_dtype_mismatch(op, arg, key):
    a = base()
    a[key] = a[key].double()
    with raises_arg(DTypeErr, arg):
        calls()[op](a)


@pytest.mark.parametrize("op,arg,key", [(op, lst[0][0], lst[0][1]) for op, lst in TENSOR_ARGS.items()])
def test_error_integer_dtype(op, arg, key):
    a = base()
    a[key] = (a[key] * 10).to(torch.int32)
    with raises_arg(DTypeErr, arg):
        calls()[op](a)


@pytest.mark.parametrize("op,arg,key", [(op, arg, key) for op, lst in TENSOR_ARGS.items() for arg, key in lst])
def test_noncontiguous_last_dim_rejected_or_exact(op, arg, key):
    """A last dimension with stride != 1: the C++ API rejects it (layout error naming the argument); the
    Python layer may instead copy it to contiguous memory. Either way: never a different answer."""
    a = base()
    ref = calls()[op](a)
    a[key] = noncontig_last(a[key])
    try:
        got = calls()[op](a)
    except Err as e:
        assert not isinstance(e, DTypeErr) and f"argument '{arg}'" in str(e), str(e)
        return
    ref = ref if isinstance(ref, tuple) else (ref,)
    got = got if isinstance(got, tuple) else (got,)
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


@pytest.mark.parametrize("op,arg,key", [(op, arg, key) for op, lst in TENSOR_ARGS.items()
                                        for arg, key in lst[1:]])
def test_error_head_dim_mismatch(op, arg, key):
    a = base()
    x = a[key]
    a[key] = randn(*x.shape[:-1], x.shape[-1] + 1, dtype=x.dtype)
    if op in ("compress_kv",):  # k and v may have different head dims: change the token count instead
        a[key] = randn(x.shape[0], x.shape[1] + 1, *x.shape[2:], dtype=x.dtype)
    if arg in ("v", "v_cmp") and op != "compress_kv":  # Dv may differ from Dqk: break the heads instead
        a[key] = randn(x.shape[0], x.shape[1], x.shape[2] + 1, x.shape[3], dtype=x.dtype)
    with raises_arg(Err, arg):
        calls()[op](a)


@pytest.mark.parametrize("op,arg,key", [(op, lst[0][0], lst[0][1]) for op, lst in TENSOR_ARGS.items()])
def test_error_rank(op, arg, key):
    a = base()
    a[key] = a[key][0]  # 3-D without cu_seqlens
    with raises_arg(Err, arg, *(["cu_seqlens"] if op != "flash_attention" else ["cu_seqlens_q"])):
        calls()[op](a)


@pytest.mark.parametrize("op", ["compressed_attention", "selected_attention", "flash_attention",
                                "nsa_attention", "select_blocks"])
def test_error_group_not_divisible(op):
    a = base()
    a["q"] = randn(B, T, 3, D, dtype=torch.float32)
    a["g"] = gates(B, T, 3, dtype=torch.float32)
    a["lse"] = randn(B, 3, T, dtype=torch.float32)
    with raises_arg(Err, "q", "k", "k_cmp", "v", "v_cmp"):
        calls()[op](a)


def test_error_compressed_length_mismatch():
    a = base()
    kc, vc = a["k_cmp"], a["v_cmp"]
    a["k_cmp"] = torch.cat([kc, kc[:, :1]], dim=1)
    a["v_cmp"] = torch.cat([vc, vc[:, :1]], dim=1)
    with raises_arg(Err, "k_cmp", "v_cmp"):
        calls()["compressed_attention"](a)


def test_error_cu_seqlens():
    lengths = [5, 30]
    N = sum(lengths)
    k, v = randn(N, 2, 8), randn(N, 2, 8)
    q = randn(N, 4, 8)
    cu = cu_seqlens_of(lengths)
    with raises_arg(DTypeErr, "cu_seqlens"):
        sa.compress_kv(k, v, block=16, stride=8, cu_seqlens=cu.long())
    with raises_arg(DTypeErr, "cu_seqlens"):
        sa.nsa_attention(q, k, v, None, None, gates(N, 4), config=sa.NSAConfig(**SMALL), cu_seqlens=cu.long())
    with raises_arg(DTypeErr, "cu_seqlens_q"):
        sa.flash_attention(q, k, v, cu_seqlens_q=cu.float(), cu_seqlens_k=cu)
    for bad in ([0, 30, 5], [1, 5, 35], [0, 5, 36]):
        badcu = torch.tensor(bad, dtype=torch.int32)
        with raises_arg(Err, "cu_seqlens"):
            sa.compress_kv(k, v, block=16, stride=8, cu_seqlens=badcu)
        with raises_arg(Err, "cu_seqlens"):
            sa.selected_attention(q, k, v, torch.zeros(N, 2, 1, dtype=torch.int32), block=32, cu_seqlens=badcu)
    with raises_arg(Err, "cu_seqlens"):
        sa.compress_kv(k, v, block=16, stride=8, cu_seqlens=cu[None])
    # documented: one of cu_seqlens_q / cu_seqlens_k given alone is used for both
    torch.testing.assert_close(sa.flash_attention(q, k, v, cu_seqlens_q=cu),
                               sa.flash_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu))


@pytest.mark.parametrize("block,stride,names", [(16, 6, ("stride", "block")), (16, 0, ("stride",)),
                                                (0, 8, ("block",)), (16, -8, ("stride",))])
def test_error_compress_config(block, stride, names):
    a = base()
    with raises_arg(Err, *names):
        sa.compress_kv(a["k"], a["v"], block=block, stride=stride)


@pytest.mark.parametrize("field,value,names", [
    ("cmp_stride", 5, ("cmp_stride", "cmp_block")),
    ("cmp_block", 64, ("cmp_block", "sel_block")),  # l > l'
    ("sel_block", 36, ("sel_block", "cmp_stride")),  # d does not divide l'
    ("cmp_stride", 0, ("cmp_stride",)),
    ("num_selected", 0, ("num_selected",)),
    ("num_selected", 2, ("num_selected", "num_init", "num_local")),  # fewer than the forced blocks
    ("num_init", -1, ("num_init",)),
    ("num_local", -1, ("num_local",)),
    ("window", 0, ("window",)),
])
def test_error_nsa_config(field, value, names):
    a = base()
    cfg = dict(SMALL, **{field: value})
    with raises_arg(Err, *names):  # either the config itself or the call rejects it
        sa.nsa_attention(a["q"], a["k"], a["v"], a["g"], a["g"], a["g"], config=sa.NSAConfig(**cfg))


@pytest.mark.parametrize("field,value,names", [
    ("cmp_stride", 0, ("cmp_stride",)),
    ("cmp_stride", 5, ("cmp_stride", "cmp_block")),
    ("cmp_block", 0, ("cmp_block",)),
    ("window", 0, ("window",)),
])
def test_error_nsa_config_packed(field, value, names):
    """Packed inputs: the config error still names the NSAConfig field (not an internal helper's argument)."""
    lengths = [5, 35]
    n = sum(lengths)
    q, k, v = randn(n, 4, 16, dtype=torch.float32), randn(n, 2, 16, dtype=torch.float32), \
        randn(n, 2, 16, dtype=torch.float32)
    g = gates(n, 4, dtype=torch.float32)
    with raises_arg(Err, *names):
        sa.nsa_attention(q, k, v, g, g, g, config=sa.NSAConfig(**dict(SMALL, **{field: value})),
                         cu_seqlens=cu_seqlens_of(lengths))


@pytest.mark.parametrize("field,value,names", [
    ("cmp_stride", 5, ("cmp_stride", "cmp_block")),
    ("cmp_block", 64, ("cmp_block", "sel_block")),
    ("sel_block", 36, ("sel_block", "cmp_stride")),
    ("num_selected", 0, ("num_selected",)),
])
def test_error_select_blocks_config(field, value, names):
    a = base()
    kw = dict(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=3)
    kw[field] = value
    with raises_arg(Err, *names):
        sa.select_blocks(a["q"], a["k_cmp"], a["lse"], **kw)


def test_error_select_blocks_lse():
    a = base()
    with raises_arg(DTypeErr, "lse_cmp"):
        sa.select_blocks(a["q"], a["k_cmp"], a["lse"].double(), cmp_block=16, cmp_stride=8, sel_block=32,
                         num_selected=3)
    with raises_arg(Err, "lse_cmp"):
        sa.select_blocks(a["q"], a["k_cmp"], a["lse"][:, :, :-1], cmp_block=16, cmp_stride=8, sel_block=32,
                         num_selected=3)


@pytest.mark.parametrize("gate", ["g_cmp", "g_slc", "g_swa"])
def test_error_gate_shape_and_dtype(gate):
    a = base()
    gs = {"g_cmp": a["g"], "g_slc": a["g"], "g_swa": a["g"]}
    cfg = sa.NSAConfig(**SMALL)
    for bad in (gates(B, T, HQ + 1), gates(B, T), gates(B, T - 1, HQ), gates(B, T, HQ, 1)):
        kw = dict(gs, **{gate: bad.float()})
        with raises_arg(Err, gate):
            sa.nsa_attention(a["q"], a["k"], a["v"], config=cfg, **kw)
        with raises_arg(Err, gate):
            sa.combine(a["q"], a["q"], a["q"], kw["g_cmp"], kw["g_slc"], kw["g_swa"])
    kw = dict(gs, **{gate: a["g"].double()})
    with raises_arg(DTypeErr, gate):
        sa.nsa_attention(a["q"], a["k"], a["v"], config=cfg, **kw)
    with raises_arg(DTypeErr, gate):
        sa.combine(a["q"], a["q"], a["q"], kw["g_cmp"], kw["g_slc"], kw["g_swa"])


def test_error_combine_outputs():
    a = base()
    o, g = a["q"], a["g"]
    with raises_arg(Err, "o_slc"):
        sa.combine(o, o[:, :-1], o, g, g, g)
    with raises_arg(Err, "o_cmp"):
        sa.combine(None, o, o, g, g, g)
    with raises_arg(DTypeErr, "o_swa"):
        sa.combine(o, o, o.double(), g, g, g)
    with pytest.raises(Err):
        sa.combine(o, o, o, None, None, None)  # no branch at all


def test_error_indices():
    a = base()
    idx = a["idx"]
    with raises_arg(DTypeErr, "indices"):
        sa.selected_attention(a["q"], a["k"], a["v"], idx.long(), block=32)
    with raises_arg(Err, "indices"):
        sa.selected_attention(a["q"], a["k"], a["v"], idx[:, :-1], block=32)
    with raises_arg(Err, "indices"):
        sa.selected_attention(a["q"], a["k"], a["v"], idx[:, :, :1].expand(B, T, HKV + 1, 3).contiguous(),
                              block=32)
    bad = idx.clone()
    bad[0, 5, 0, 0] = 2  # T = 40 has 2 selection blocks of 32: index 2 is out of range
    with raises_arg(Err, "indices"):
        sa.selected_attention(a["q"], a["k"], a["v"], bad, block=32)
    bad = idx.clone()
    bad[0, 5, 0, 0] = -7
    with raises_arg(Err, "indices"):
        sa.selected_attention(a["q"], a["k"], a["v"], bad, block=32)
    with raises_arg(Err, "block"):
        sa.selected_attention(a["q"], a["k"], a["v"], idx, block=0)
    with raises_arg(DTypeErr, "block_indices"):
        sa.nsa_attention(a["q"], a["k"], a["v"], a["g"], a["g"], a["g"], config=sa.NSAConfig(**SMALL),
                         block_indices=idx.long())


def test_error_user_compressed_kv():
    a = base()
    cfg = sa.NSAConfig(**SMALL)
    with raises_arg(Err, "v_cmp", "k_cmp"):
        sa.nsa_attention(a["q"], a["k"], a["v"], a["g"], a["g"], a["g"], config=cfg, k_cmp=a["k_cmp"])
    with raises_arg(DTypeErr, "k_cmp"):
        sa.nsa_attention(a["q"], a["k"], a["v"], a["g"], a["g"], a["g"], config=cfg, k_cmp=a["k_cmp"].double(),
                         v_cmp=a["v_cmp"])
    with raises_arg(Err, "k_cmp"):
        sa.nsa_attention(a["q"], a["k"], a["v"], a["g"], a["g"], a["g"], config=cfg, k_cmp=a["k_cmp"][..., :-1],
                         v_cmp=a["v_cmp"])


def test_error_flash_mask_bias():
    a = base()
    q, k, v = a["q"], a["k"], a["v"]
    mask = torch.ones(B, 1, T, T, dtype=torch.bool)
    bias = randn(1, HKV, T, T, dtype=torch.float32)
    sa.flash_attention(q, k, v, mask=mask, bias=bias)  # valid
    with raises_arg(DTypeErr, "mask"):
        sa.flash_attention(q, k, v, mask=mask.float())
    with raises_arg(DTypeErr, "bias"):
        sa.flash_attention(q, k, v, bias=bias.double())
    with raises_arg(Err, "mask"):
        sa.flash_attention(q, k, v, mask=mask[..., :-1])
    with raises_arg(Err, "bias"):
        sa.flash_attention(q, k, v, bias=randn(1, 3, T, T, dtype=torch.float32))
    with raises_arg(Err, "bias"):
        sa.flash_attention(q, k, v, bias=randn(T, T, dtype=torch.float32))
    with raises_arg(Err, "mask"):
        sa.flash_attention(q, k, v, mask=torch.ones(3, 1, T, T, dtype=torch.bool))
    cu = cu_seqlens_of([T, T])
    with raises_arg(Err, "mask"):
        sa.flash_attention(pack(q, [T, T]), pack(k, [T, T]), pack(v, [T, T]), mask=mask[:1, :, :, :],
                           cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_error_message_mentions_op_or_argument():
    a = base()
    with pytest.raises(DTypeErr) as info:
        sa.flash_attention(a["q"], a["k"].double(), a["v"])
    msg = str(info.value)
    assert "argument 'k'" in msg and ("float64" in msg or "double" in msg), msg


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_nsa_workspace_every_byte_written(monkeypatch, device, packed):
    # The forward's workspace (an output of the custom op) comes from torch.empty: nsa_attention must write
    # every byte (alignment gaps, packed rows outside the sequences, step scratch), so that two runs on
    # differently poisoned memory return the same bytes. T = 300: lse rows leave gaps before the next slice.
    # Head dim 64: the smallest with CUDA kernels.
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lengths = [130, 170] if packed else [300]
    torch.manual_seed(0)
    if packed:
        N = sum(lengths) + 5
        q, k, v = (randn(N, h, 64, dtype=dtype, device=device) for h in (8, 2, 2))
        g = [gates(N, 8, dtype=dtype, device=device) for _ in range(3)]
        cu = cu_seqlens_of(lengths, device=device)
        cu_cmp = sa.compressed_cu_seqlens(cu, block=SMALL["cmp_block"], stride=SMALL["cmp_stride"])
        max_seqlen = max(lengths)
    else:
        q, k, v = qkv(1, lengths[0], 8, 2, 64, dtype=dtype, device=device)
        g = [gates(1, lengths[0], 8, dtype=dtype, device=device) for _ in range(3)]
        cu = cu_cmp = None
        max_seqlen = 0
    config = (SMALL["cmp_block"], SMALL["cmp_stride"], SMALL["sel_block"], SMALL["num_selected"], SMALL["num_init"],
              SMALL["num_local"], SMALL["window"], None)
    real_empty = torch.empty

    def run(poison):
        def empty(*args, **kwargs):
            t = real_empty(*args, **kwargs)
            return t.fill_(poison) if kwargs.get("dtype") == torch.uint8 else t
        monkeypatch.setattr(torch, "empty", empty)
        try:
            o, workspace = torch.ops.sparseattn.nsa_attention(q, k, v, None, None, None, *g, cu, cu_cmp, max_seqlen,
                                                              *config)
        finally:
            monkeypatch.setattr(torch, "empty", real_empty)
        return o, workspace

    o0, ws0 = run(0)
    o1, ws1 = run(0xA5)
    assert ws0.numel() > 0
    assert torch.equal(ws0, ws1)
    assert torch.equal(o0[:sum(lengths)] if packed else o0, o1[:sum(lengths)] if packed else o1)
