"""NSA over a query chunk on CUDA (docs/semantics.md section 11): T queries against S >= T keys, query t at key
position t + S - T. Every chunk result on CUDA is compared with the CPU float64 reference of the same chunk and with
the last T rows of the CUDA full call (T = S), forward and backward (the full call's output gradient is zero on the
other rows); bfloat16, 64/4 and 32/32 heads, head dims 128/128 and 192/128, batched and packed.

Bound: the chunk's error vs float64 <= 2 x the error of the CUDA full call on the same rows (itself bounded against
torch's low-precision error by test_cuda_nsa.py and test_cuda_selection.py) + one rounding of the output + 1e-5.
"""
import pytest
import torch

import naive_nsa as nv
from helpers import cu_seqlens_of, indices_mismatch_report, max_err, require_sparseattn, selection_gap_ok

sa = require_sparseattn()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sa._C.built_with_cuda(),
                       reason="needs a CUDA GPU and a CUDA build of sparseattn"),
]

DTYPE = torch.bfloat16
EPS = 2.0 ** -8
HEADS = [(64, 4), (32, 32)]
DIMS = [(128, 128), (192, 128)]
CFG = sa.NSAConfig(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=8, num_init=1, num_local=2, window=100)
# (layout, per-sequence keys S_b, per-sequence queries T_b): batched sequences share S and T.
SHAPES = {
    "batched": ([450, 450], [37, 37]),
    "decode": ([300, 300], [1, 1]),
    "whole": ([150, 150], [150, 150]),
    "packed": ([1, 300, 161, 64, 129, 250], [1, 17, 161, 0, 1, 30]),
}


def poison_allocator():
    """Fill recently freed cached blocks with NaN so that an unwritten output element shows up."""
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    block.fill_(0xFF)
    del block


class Chunk:
    """A full problem (a query per key) and its chunk: sequence b keeps its last counts[b] queries."""

    def __init__(self, name):
        keys, counts = SHAPES[name]
        self.packed = name == "packed"
        self.keys, self.counts = keys, counts
        if self.packed:
            self.cu_k, self.cu_q = cu_seqlens_of(keys), cu_seqlens_of(counts)
            starts = self.cu_k[:-1].tolist()
            self.rows = torch.tensor([s + S - T + t for s, S, T in zip(starts, keys, counts) for t in range(T)],
                                     dtype=torch.int64)
            self.lead = (sum(keys),)
        else:
            self.S, self.T = keys[0], counts[0]
            self.lead = (len(keys), self.S)

    def pick(self, x):
        """The chunk's rows of a full token tensor."""
        return x[self.rows.to(x.device)] if self.packed else x[:, self.S - self.T:]

    def pick_lse(self, lse):
        return lse[:, self.rows.to(lse.device)] if self.packed else lse[..., self.S - self.T:]

    def spread(self, chunk, full_like):
        """A full tensor that is `chunk` on the chunk's rows and zero elsewhere."""
        full = torch.zeros_like(full_like)
        if self.packed:
            full[self.rows.to(full.device)] = chunk
        else:
            full[:, self.S - self.T:] = chunk
        return full

    def full_kw(self, device):
        return {"cu_seqlens": self.cu_k.to(device)} if self.packed else {}

    def chunk_kw(self, device, batched_keys=False):
        if self.packed:
            return {"cu_seqlens": self.cu_q.to(device), "cu_seqlens_k": self.cu_k.to(device)}
        return {"seqlen_k": self.S} if batched_keys else {}


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.float32).to(DTYPE)


def cpu64(x):
    return x.detach().double().cpu()


def check(name, got, ref64, base):
    """got (the chunk on CUDA) vs ref64 (the chunk on the CPU in float64), with base the CUDA full call's rows."""
    got, ref64, base = got.detach().cpu().double(), ref64.detach().cpu().double(), base.detach().cpu().double()
    assert not torch.isnan(got).any(), f"{name}: NaN (unwritten element?)"
    if got.numel() == 0:
        return
    finite = torch.isfinite(ref64)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref64)), f"{name}: -inf positions differ"
    got, ref64, base = got[finite], ref64[finite], base[finite]
    base_err = max_err(base, ref64)
    bound = 2 * base_err + EPS * ref64.abs().max().item() + 1e-5
    err = max_err(got, ref64)
    assert err <= bound, f"{name}: chunk error {err:.3e} > bound {bound:.3e} (full call on CUDA: {base_err:.3e})"
    diff = max_err(got, base)
    assert diff <= bound, f"{name}: chunk differs from the full call's rows by {diff:.3e} > {bound:.3e}"


def grads(fn, inputs, d_o):
    """(output, gradients of the differentiable inputs) of fn(*inputs) for the output gradient d_o."""
    leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    o = out[0] if isinstance(out, tuple) else out
    diff = [x for x in leaves if x.requires_grad]
    return o, torch.autograd.grad(o, diff, d_o)


def reference_selection(q, k, v, chunk):
    """The float64 CPU reference's selection on the full problem (indices of every key position)."""
    c, kw = CFG, chunk.full_kw("cpu")
    q, k, v = cpu64(q), cpu64(k), cpu64(v)
    kc, vc = sa.compress_kv(k, v, block=c.cmp_block, stride=c.cmp_stride, cu_seqlens=kw.get("cu_seqlens"))
    _, lse = sa.compressed_attention(q, kc, vc, block=c.cmp_block, stride=c.cmp_stride, **kw)
    return sa.select_blocks(q, kc, lse, cmp_block=c.cmp_block, cmp_stride=c.cmp_stride, sel_block=c.sel_block,
                            num_selected=c.num_selected, num_init=c.num_init, num_local=c.num_local, **kw)


def ids(value):
    return f"{value[0]}x{value[1]}" if isinstance(value, tuple) else None


@pytest.mark.parametrize("dims", DIMS, ids=ids)
@pytest.mark.parametrize("heads", HEADS, ids=ids)
@pytest.mark.parametrize("shape", ["batched", "packed", "decode"])
def test_compressed_attention_chunk(attention_mma, shape, heads, dims):
    (Hq, Hkv), (Dqk, Dv) = heads, dims
    chunk = Chunk(shape)
    q, k, v = randn(*chunk.lead, Hq, Dqk), randn(*chunk.lead, Hkv, Dqk), randn(*chunk.lead, Hkv, Dv)
    cu = chunk.full_kw("cuda").get("cu_seqlens")
    kc, vc = sa.compress_kv(k, v, block=32, stride=16, cu_seqlens=cu)
    d_o = randn(*chunk.pick(q).shape[:-1], Dv)

    def call(device, full):
        def fn(q_, kc_, vc_):
            kw = chunk.full_kw(device) if full else chunk.chunk_kw(device, batched_keys=True)
            return sa.compressed_attention(q_, kc_, vc_, block=32, stride=16, **kw)
        return fn

    poison_allocator()
    o_full, (dq_full, dkc_full, dvc_full) = grads(call("cuda", True), (q, kc, vc), chunk.spread(d_o, q[..., :Dv]))
    _, lse_full = sa.compressed_attention(q, kc, vc, block=32, stride=16, **chunk.full_kw("cuda"))
    poison_allocator()
    o, (dq, dkc, dvc) = grads(call("cuda", False), (chunk.pick(q), kc, vc), d_o)
    _, lse = sa.compressed_attention(chunk.pick(q), kc, vc, block=32, stride=16,
                                     **chunk.chunk_kw("cuda", batched_keys=True))
    o64, (dq64, dkc64, dvc64) = grads(call("cpu", False), (cpu64(chunk.pick(q)), cpu64(kc), cpu64(vc)), cpu64(d_o))
    _, lse64 = sa.compressed_attention(cpu64(chunk.pick(q)), cpu64(kc), cpu64(vc), block=32, stride=16,
                                       **chunk.chunk_kw("cpu", batched_keys=True))
    check("o", o, o64, chunk.pick(o_full))
    check("lse", lse, lse64, chunk.pick_lse(lse_full))
    check("dq", dq, dq64, chunk.pick(dq_full))
    check("dk_cmp", dkc, dkc64, dkc_full)
    check("dv_cmp", dvc, dvc64, dvc_full)


@pytest.mark.parametrize("dims", DIMS, ids=ids)
@pytest.mark.parametrize("heads", HEADS, ids=ids)
@pytest.mark.parametrize("shape", ["batched", "packed", "decode", "whole"])
def test_select_blocks_chunk(shape, heads, dims):
    """The chunk's selection on CUDA is the full call's rows (CUDA) and the reference's, but for near-ties."""
    (Hq, Hkv), (Dqk, _) = heads, dims
    chunk = Chunk(shape)
    q, k = randn(*chunk.lead, Hq, Dqk), randn(*chunk.lead, Hkv, Dqk)
    kw_full = chunk.full_kw("cuda")
    kc, _ = sa.compress_kv(k, k, block=32, stride=16, cu_seqlens=kw_full.get("cu_seqlens"))
    # The full call's lse on the CPU (float64, rounded to float32): both selections read the same lse.
    _, lse_full = sa.compressed_attention(cpu64(q), cpu64(kc), cpu64(kc), block=32, stride=16,
                                          **chunk.full_kw("cpu"))
    lse_full = lse_full.float()
    sel = dict(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=8, num_init=1, num_local=2)
    full = sa.select_blocks(q, kc, lse_full.cuda(), **sel, **kw_full).cpu()
    got = sa.select_blocks(chunk.pick(q), kc, chunk.pick_lse(lse_full).cuda(), **sel,
                           **chunk.chunk_kw("cuda", batched_keys=True)).cpu()
    ref = sa.select_blocks(cpu64(chunk.pick(q)), cpu64(kc), chunk.pick_lse(lse_full).double(), **sel,
                           **chunk.chunk_kw("cpu", batched_keys=True))
    assert torch.equal(got, chunk.pick(full)), indices_mismatch_report(got, chunk.pick(full))
    if torch.equal(got, ref):
        return
    # Near-ties: the reference's score gap between the swapped blocks is within fp32 rounding.
    scale = 1.0 / Dqk ** 0.5
    if not chunk.packed:
        scores = nv.selection_scores(cpu64(q), cpu64(kc), lse_full.double(), 32, 16, 64, scale)
        scores = scores[:, :, chunk.S - chunk.T:]
        ok, report = selection_gap_ok(got, ref, scores, rtol=1e-4)
        assert ok, indices_mismatch_report(got, ref) + "\n" + report
        return
    cu_cmp = sa.compressed_cu_seqlens(chunk.cu_k, 32, 16)
    for b, (S, T) in enumerate(zip(chunk.keys, chunk.counts)):
        if T == 0:
            continue
        s, cs, qs = int(chunk.cu_k[b]), int(cu_cmp[b]), int(chunk.cu_q[b])
        scores = nv.selection_scores_seq(cpu64(q)[s:s + S], cpu64(kc)[cs:int(cu_cmp[b + 1])],
                                         lse_full.double()[:, s:s + S], 32, 16, 64, scale)[:, S - T:]
        ok, report = selection_gap_ok(got[qs:qs + T], ref[qs:qs + T], scores, rtol=1e-4)
        assert ok, indices_mismatch_report(got[qs:qs + T], ref[qs:qs + T]) + "\n" + report


@pytest.fixture(params=["auto", "kv", "group"])
def selected_path(request, monkeypatch):
    """The selected-attention forward and dQ paths; a chunk must come out right whichever is asked for (the
    KV-block-outer ones take no chunk: the query-outer ones run instead)."""
    if request.param == "auto":
        monkeypatch.delenv("SPARSEATTN_SELECTED_FORWARD", raising=False)
        monkeypatch.delenv("SPARSEATTN_SELECTED_DQ", raising=False)
    else:
        monkeypatch.setenv("SPARSEATTN_SELECTED_FORWARD", request.param)
        monkeypatch.setenv("SPARSEATTN_SELECTED_DQ", request.param)
    return request.param


@pytest.mark.parametrize("dims", DIMS, ids=ids)
@pytest.mark.parametrize("heads", HEADS, ids=ids)
@pytest.mark.parametrize("shape", ["batched", "packed", "decode", "whole"])
def test_selected_attention_chunk(selected_path, shape, heads, dims):
    (Hq, Hkv), (Dqk, Dv) = heads, dims
    if selected_path == "group" and dims != (128, 128):
        pytest.skip("the group forward runs at 128/128")
    chunk = Chunk(shape)
    q, k, v = randn(*chunk.lead, Hq, Dqk), randn(*chunk.lead, Hkv, Dqk), randn(*chunk.lead, Hkv, Dv)
    idx = reference_selection(q, k, k, chunk).cuda()
    d_o = randn(*chunk.pick(q).shape[:-1], Dv)

    def call(indices, device, full):
        def fn(q_, k_, v_):
            kw = chunk.full_kw(device) if full else chunk.chunk_kw(device)
            return sa.selected_attention(q_, k_, v_, indices.to(device), block=64, **kw)
        return fn

    poison_allocator()
    o_full, g_full = grads(call(idx, "cuda", True), (q, k, v), chunk.spread(d_o, q[..., :Dv]))
    poison_allocator()
    o, g = grads(call(chunk.pick(idx), "cuda", False), (chunk.pick(q), k, v), d_o)
    o64, g64 = grads(call(chunk.pick(idx), "cpu", False), (cpu64(chunk.pick(q)), cpu64(k), cpu64(v)), cpu64(d_o))
    rows = int(chunk.cu_q[-1]) if chunk.packed else None
    check("o", o[:rows], o64[:rows], chunk.pick(o_full)[:rows])
    check("dq", g[0][:rows], g64[0][:rows], chunk.pick(g_full[0])[:rows])
    keys = int(chunk.cu_k[-1]) if chunk.packed else None
    check("dk", g[1][:keys], g64[1][:keys], g_full[1][:keys])
    check("dv", g[2][:keys], g64[2][:keys], g_full[2][:keys])


@pytest.mark.parametrize("dims", DIMS, ids=ids)
@pytest.mark.parametrize("heads", HEADS, ids=ids)
@pytest.mark.parametrize("shape", ["batched", "packed", "decode"])
def test_nsa_attention_chunk(shape, heads, dims):
    """The whole pipeline with the reference's selection given (so that a near-tie cannot move a block), batched
    and packed chunks, every branch gated."""
    (Hq, Hkv), (Dqk, Dv) = heads, dims
    chunk = Chunk(shape)
    q, k, v = randn(*chunk.lead, Hq, Dqk), randn(*chunk.lead, Hkv, Dqk), randn(*chunk.lead, Hkv, Dv)
    g = [torch.rand(*chunk.lead, Hq, device="cuda").to(DTYPE) for _ in range(3)]
    idx = reference_selection(q, k, v, chunk).cuda()
    d_o = randn(*chunk.pick(q).shape[:-1], Dv)
    gates = [x for x in g if x is not None]

    def call(indices, device, full):
        def fn(q_, k_, v_, *gs):
            it = iter(gs)
            gs_all = [None if x is None else next(it) for x in g]
            kw = chunk.full_kw(device) if full else chunk.chunk_kw(device)
            return sa.nsa_attention(q_, k_, v_, *gs_all, config=CFG, block_indices=indices.to(device), **kw)
        return fn

    poison_allocator()
    o_full, g_full = grads(call(idx, "cuda", True), (q, k, v, *gates), chunk.spread(d_o, q[..., :Dv]))
    poison_allocator()
    o, gr = grads(call(chunk.pick(idx), "cuda", False), (chunk.pick(q), k, v, *(chunk.pick(x) for x in gates)), d_o)
    o64, g64 = grads(call(chunk.pick(idx), "cpu", False),
                     (cpu64(chunk.pick(q)), cpu64(k), cpu64(v), *(cpu64(chunk.pick(x)) for x in gates)), cpu64(d_o))
    rows = int(chunk.cu_q[-1]) if chunk.packed else None
    keys = int(chunk.cu_k[-1]) if chunk.packed else None
    check("o", o[:rows], o64[:rows], chunk.pick(o_full)[:rows])
    check("dq", gr[0][:rows], g64[0][:rows], chunk.pick(g_full[0])[:rows])
    check("dk", gr[1][:keys], g64[1][:keys], g_full[1][:keys])
    check("dv", gr[2][:keys], g64[2][:keys], g_full[2][:keys])
    for i in range(len(gates)):
        check(f"d_gate{i}", gr[3 + i][:rows], g64[3 + i][:rows], chunk.pick(g_full[3 + i])[:rows])


@pytest.mark.parametrize("shape", ["batched", "decode", "packed"])
def test_nsa_attention_chunk_selects_as_select_blocks(shape):
    """Without block_indices the CUDA pipeline's own selection of a chunk is select_blocks' on the same device:
    outputs equal bit for bit to passing that selection."""
    chunk = Chunk(shape)
    Hq, Hkv, D = 64, 4, 128
    q, k, v = randn(*chunk.lead, Hq, D), randn(*chunk.lead, Hkv, D), randn(*chunk.lead, Hkv, D)
    g = [torch.rand(*chunk.lead, Hq, device="cuda").to(DTYPE) for _ in range(3)]
    qc, gc = chunk.pick(q), [chunk.pick(x) for x in g]
    c = CFG
    kc, vc = sa.compress_kv(k, v, block=c.cmp_block, stride=c.cmp_stride, **chunk.full_kw("cuda"))
    kw = chunk.chunk_kw("cuda", batched_keys=True)
    _, lse = sa.compressed_attention(qc, kc, vc, block=c.cmp_block, stride=c.cmp_stride, **kw)
    idx = sa.select_blocks(qc, kc, lse, cmp_block=c.cmp_block, cmp_stride=c.cmp_stride, sel_block=c.sel_block,
                           num_selected=c.num_selected, num_init=c.num_init, num_local=c.num_local, **kw)
    own = sa.nsa_attention(qc, k, v, *gc, config=c, **chunk.chunk_kw("cuda"))
    given = sa.nsa_attention(qc, k, v, *gc, config=c, block_indices=idx, **chunk.chunk_kw("cuda"))
    assert torch.equal(own, given)
