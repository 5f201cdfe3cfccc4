"""GPU kernels of NSA block selection (select_blocks) and selected attention (forward + backward) against the
float64 CPU reference fed the same rounded inputs.

Tolerance (architecture brief): error of the kernel <= 2 x the error of the same math done by PyTorch in the
input precision (the naive oracle on the GPU in fp16/bf16) + one unit of rounding of the output's magnitude;
no NaN; identical -inf positions. Selection: index sets equal except where the reference's score gap between
the swapped blocks is within 1e-4 of the row's largest score (fp32 scores vs the float64 reference).
"""
import pytest
import torch

import naive_nsa as nv
from helpers import cu_seqlens_of, max_err, pack, random_indices, require_sparseattn, selection_gap_ok, \
    indices_mismatch_report

sa = require_sparseattn()

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or not sa._C.built_with_cuda(),
    reason="needs a CUDA GPU and a CUDA build of sparseattn",
)

LOWP = [torch.bfloat16, torch.float16]
EPS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}


def poison_allocator():
    """Fill recently freed cached blocks with NaN so that an unwritten output element shows up."""
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    block.fill_(0xFF)
    del block


def assert_lowp(got, ref, base, dtype, name):
    got = got.detach().cpu()
    ref = ref.detach().cpu().double()
    base = base.detach().cpu()
    assert not torch.isnan(got).any(), f"{name}: NaN (unwritten element?)"
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{name}: -inf positions differ"
    err = max_err(got, ref)
    bound = 2.0 * max_err(base, ref) + EPS[dtype] * ref.abs().nan_to_num(0, 0, 0).max().item() + 1e-6
    assert err <= bound, f"{name}: max abs error {err:.3e} > bound {bound:.3e} (torch in {dtype}: " \
                         f"{max_err(base, ref):.3e})"


def assert_lse(got, ref, name="lse"):
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    assert got.dtype == ref.dtype
    assert not torch.isnan(got).any(), f"{name}: NaN"
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref)), f"{name}: -inf positions differ"
    fin = torch.isfinite(ref)
    err = max_err(got, ref)
    assert err <= 1e-4 * (1 + (ref[fin].abs().max().item() if fin.any() else 0)), f"{name}: fp32 lse error {err:.3e}"


# ----------------------------------------------------------------------------------------------- select_blocks


def _selection_inputs(lengths, Hq, Hkv, D, dtype, packed, cmp_block=32, cmp_stride=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    if packed:
        N = sum(lengths)
        cu = cu_seqlens_of(lengths)
        cu_cmp = nv.compressed_cu_seqlens(cu, cmp_block, cmp_stride)
        q = torch.randn(N, Hq, D, generator=g).to(dtype)
        kc = torch.randn(int(cu_cmp[-1]), Hkv, D, generator=g).to(dtype)
        vc = torch.randn(int(cu_cmp[-1]), Hkv, D, generator=g).to(dtype)
        _, lse = sa.compressed_attention(q.double(), kc.double(), vc.double(), block=cmp_block, stride=cmp_stride,
                                         cu_seqlens=cu, cu_seqlens_cmp=cu_cmp)
        return q, kc, lse.float(), cu, cu_cmp
    (T,) = lengths
    tc = nv.num_compressed_blocks(T, cmp_block, cmp_stride)
    q = torch.randn(2, T, Hq, D, generator=g).to(dtype)
    kc = torch.randn(2, tc, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(2, tc, Hkv, D, generator=g).to(dtype)
    _, lse = sa.compressed_attention(q.double(), kc.double(), vc.double(), block=cmp_block, stride=cmp_stride)
    return q, kc, lse.float(), None, None


def _check_selection(got, ref, q, kc, lse, kw, cu, cu_cmp):
    got = got.cpu()
    if torch.equal(got, ref):
        return
    sel = dict(cmp_block=kw["cmp_block"], cmp_stride=kw["cmp_stride"], sel_block=kw["sel_block"])
    if cu is None:
        scores = nv.selection_scores(q.double(), kc.double(), lse.double(), **sel)
        ok, report = selection_gap_ok(got, ref, scores, rtol=1e-4)
        assert ok, indices_mismatch_report(got, ref) + "\n" + report
        return
    scale = 1.0 / q.shape[-1] ** 0.5
    bounds = nv.seq_bounds(cu)
    cbounds = nv.seq_bounds(cu_cmp)
    for (s, e), (cs, ce) in zip(bounds, cbounds):
        if e == s:
            continue
        scores = nv.selection_scores_seq(q[s:e].double(), kc[cs:ce].double(), lse[:, s:e].double(),
                                         sel["cmp_block"], sel["cmp_stride"], sel["sel_block"], scale)
        ok, report = selection_gap_ok(got[s:e], ref[s:e], scores, rtol=1e-4)
        assert ok, indices_mismatch_report(got[s:e], ref[s:e]) + "\n" + report
    assert torch.equal(got[bounds[-1][1]:], ref[bounds[-1][1]:])


SELECT_CASES = [
    # (dtype, lengths, packed, Hq, Hkv, D, sel_block, n)
    (torch.bfloat16, [1], False, 2, 1, 64, 64, 16),
    (torch.float16, [63], False, 4, 2, 128, 64, 16),
    (torch.bfloat16, [65], False, 3, 1, 192, 128, 8),
    (torch.float16, [1000], False, 7, 1, 128, 64, 16),
    (torch.bfloat16, [1000], False, 16, 2, 256, 128, 8),
    (torch.bfloat16, [4097], False, 4, 1, 128, 64, 16),
    (torch.float16, [4097], False, 1, 1, 64, 128, 8),
    (torch.bfloat16, [1, 31, 65, 300, 2, 130, 1000], True, 8, 1, 128, 64, 16),
    (torch.float16, [47, 1, 0, 200, 129], True, 32, 1, 64, 128, 8),
    (torch.bfloat16, [2100], False, 64, 4, 128, 64, 16),  # the benchmark's group of 16
    (torch.bfloat16, [4097], False, 32, 1, 64, 64, 16),  # 4 tokens per tile: each CTA walks many tiles
    (torch.float16, [777], False, 24, 2, 64, 64, 16),  # G = 12: 16 rows per token, 4 of them empty
    (torch.bfloat16, [300], False, 128, 1, 64, 64, 16),  # G = 128: one token spans all 8 warps
    (torch.bfloat16, [2, 90, 1, 257], True, 40, 5, 128, 64, 16),  # G = 8 packed, 2 tokens per warp
]


@pytest.mark.parametrize("cmp_block,cmp_stride,sel_block,n", [(64, 64, 64, 16), (64, 64, 128, 8), (32, 8, 64, 8)])
def test_select_blocks_compression_configs(cmp_block, cmp_stride, sel_block, n):
    """The issue's 64/64 compression, and a small stride (more compressed blocks per selection block)."""
    q, kc, lse, _, _ = _selection_inputs([1500], 8, 2, 128, torch.bfloat16, False, cmp_block=cmp_block,
                                         cmp_stride=cmp_stride)
    kw = dict(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block, num_selected=n, num_init=1,
              num_local=2)
    ref = sa.select_blocks(q.double(), kc.double(), lse.double(), **kw)
    poison_allocator()
    got = sa.select_blocks(q.cuda(), kc.cuda(), lse.cuda(), **kw)
    _check_selection(got, ref, q, kc, lse, kw, None, None)


def test_select_blocks_unsupported_stride_is_a_clear_error():
    """One column tile must hold a selection block and its border blocks: stride 1 with 64-token blocks does not."""
    q, kc, lse, _, _ = _selection_inputs([300], 2, 1, 64, torch.bfloat16, False, cmp_block=32, cmp_stride=1)
    with pytest.raises(sa.SparseAttnUnsupportedError, match="cmp_stride"):
        sa.select_blocks(q.cuda(), kc.cuda(), lse.cuda(), cmp_block=32, cmp_stride=1, sel_block=64)


@pytest.mark.parametrize("dtype,lengths,packed,Hq,Hkv,D,sel_block,n", SELECT_CASES)
def test_select_blocks(attention_mma, dtype, lengths, packed, Hq, Hkv, D, sel_block, n):
    """Both MMA paths of the kernel: wgmma where the GPU runs it ("auto") and mma.sync."""
    q, kc, lse, cu, cu_cmp = _selection_inputs(lengths, Hq, Hkv, D, dtype, packed)
    kw = dict(cmp_block=32, cmp_stride=16, sel_block=sel_block, num_selected=n, num_init=1, num_local=2)
    extra = {} if cu is None else dict(cu_seqlens=cu, cu_seqlens_cmp=cu_cmp)
    ref = sa.select_blocks(q.double(), kc.double(), lse.double(), **kw, **extra)
    poison_allocator()
    got = sa.select_blocks(q.cuda(), kc.cuda(), lse.cuda(), **kw,
                           **{k: v.cuda() for k, v in extra.items()})
    assert got.dtype == torch.int32
    _check_selection(got, ref, q, kc, lse, kw, cu, cu_cmp)


@pytest.mark.parametrize("case", ["many_selected", "nearly_all", "tied_scores", "wide_list", "classes_64"])
def test_select_blocks_top_n_paths(case):
    """The kernel's top-n has a usual path (a threshold from the best blocks of 32 block classes, or 64 from 17
    blocks to choose on, then ranks among the blocks that reach it) and a radix select for the rest: more than 32
    blocks to choose besides the forced ones (37; nearly_all: 61 of the last rows' 62), and rows of exactly tied
    scores (zero keys: every block reaches the threshold; ties go to the lower block, so the indices must equal
    the reference's exactly). wide_list: 31 blocks to choose, so that more than 32 blocks reach the threshold and
    the usual path ranks two per lane; classes_64: 21 blocks to choose, the 64 classes' path with one list entry
    per lane."""
    q, kc, lse, _, _ = _selection_inputs([4097], 8, 2, 64, torch.bfloat16, False)
    n = {"many_selected": 40, "nearly_all": 64, "tied_scores": 16, "wide_list": 34, "classes_64": 24}[case]
    if case == "tied_scores":
        kc = torch.zeros_like(kc)
        _, lse = sa.compressed_attention(q.double(), kc.double(), kc.double(), block=32, stride=16)
        lse = lse.float()
    kw = dict(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=n, num_init=1, num_local=2)
    ref = sa.select_blocks(q.double(), kc.double(), lse.double(), **kw)
    poison_allocator()
    got = sa.select_blocks(q.cuda(), kc.cuda(), lse.cuda(), **kw)
    if case == "tied_scores":
        assert torch.equal(got.cpu(), ref), indices_mismatch_report(got.cpu(), ref)
    else:
        _check_selection(got, ref, q, kc, lse, kw, None, None)


def test_select_blocks_forced_config():
    """num_init 2, num_local 3, n 5 (forced blocks dominate short rows) and a small stride/block config."""
    q, kc, lse, _, _ = _selection_inputs([777], 4, 2, 64, torch.bfloat16, False, cmp_block=32, cmp_stride=16)
    kw = dict(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=5, num_init=2, num_local=3)
    ref = sa.select_blocks(q.double(), kc.double(), lse.double(), **kw)
    got = sa.select_blocks(q.cuda(), kc.cuda(), lse.cuda(), **kw)
    _check_selection(got, ref, q, kc, lse, kw, None, None)


SELECT_TMA_ENV, SELECT_Q_TMA_ENV = "SPARSEATTN_SELECT_TMA", "SPARSEATTN_SELECT_Q_TMA"
TMA_CASES = SELECT_CASES + [
    (torch.bfloat16, [1, 31, 65, 300, 2, 130, 1000], True, 64, 4, 128, 64, 16),  # G = 16 packed: skipped tiles
    (torch.float16, [3000], False, 32, 2, 64, 128, 8),
    (torch.bfloat16, [700, 1], True, 16, 1, 192, 64, 16),
    (torch.float16, [513], False, 64, 4, 256, 64, 16),
]


@pytest.mark.parametrize("dtype,lengths,packed,Hq,Hkv,D,sel_block,n", TMA_CASES)
def test_select_blocks_tma_matches_cp_async(monkeypatch, dtype, lengths, packed, Hq, Hkv, D, sel_block, n):
    """The K tiles (and at G = 16 the Q tile) by TMA, the default where the wgmma kernel runs, give the indices of
    the cp.async copies bit for bit: both by TMA, K alone, neither (on GPUs without TMA every run takes cp.async)."""
    q, kc, lse, cu, cu_cmp = _selection_inputs(lengths, Hq, Hkv, D, dtype, packed, seed=3)
    kw = dict(cmp_block=32, cmp_stride=16, sel_block=sel_block, num_selected=n, num_init=1, num_local=2)
    extra = {} if cu is None else dict(cu_seqlens=cu.cuda(), cu_seqlens_cmp=cu_cmp.cuda())
    got = {}
    for mode, q_mode in (("1", "1"), ("1", "0"), ("0", "1")):
        monkeypatch.setenv(SELECT_TMA_ENV, mode)
        monkeypatch.setenv(SELECT_Q_TMA_ENV, q_mode)
        poison_allocator()
        got[mode + q_mode] = sa.select_blocks(q.cuda(), kc.cuda(), lse.cuda(), **kw, **extra).cpu()
    for key in ("10", "01"):
        assert torch.equal(got["11"], got[key]), key + ": " + indices_mismatch_report(got["11"], got[key])


@pytest.mark.parametrize("Hq,Hkv,D", [(64, 4, 128), (8, 8, 64), (32, 2, 192)])
def test_select_blocks_tma_masks_the_next_sequence(monkeypatch, Hq, Hkv, D):
    """A packed sequence's last K tile reaches into the next sequence's compressed rows, which TMA loads (cp.async
    writes zeros there). Those rows here are 50x larger, so that a column the mask missed would overflow the exp and
    change the short sequences' choices: both paths must give the same indices, and the reference's."""
    lengths = [100, 700, 40, 1500]
    q, kc, lse, cu, cu_cmp = _selection_inputs(lengths, Hq, Hkv, D, torch.bfloat16, True, seed=5)
    kc[int(cu_cmp[1]):int(cu_cmp[2])] *= 50
    kc[int(cu_cmp[3]):] *= 50
    _, lse = sa.compressed_attention(q.double(), kc.double(), kc.double()[..., :128 if D == 192 else D],
                                     cu_seqlens=cu, cu_seqlens_cmp=cu_cmp)
    lse = lse.float()
    kw = dict(cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16, num_init=1, num_local=2)
    ref = sa.select_blocks(q.double(), kc.double(), lse.double(), **kw, cu_seqlens=cu, cu_seqlens_cmp=cu_cmp)
    got = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(SELECT_TMA_ENV, mode)
        poison_allocator()
        got[mode] = sa.select_blocks(q.cuda(), kc.cuda(), lse.cuda(), **kw, cu_seqlens=cu.cuda(),
                                     cu_seqlens_cmp=cu_cmp.cuda()).cpu()
    assert torch.equal(got["1"], got["0"]), indices_mismatch_report(got["1"], got["0"])
    _check_selection(got["1"], ref, q, kc, lse, kw, cu, cu_cmp)


# ------------------------------------------------------------------------------------------ selected_attention


def _indices(lengths, Hkv, n, block, packed, future, seed):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for T in lengths:
        if future:  # any blocks of the sequence, also ones starting after t (they contribute nothing)
            nsel = nv.num_selection_blocks(T, block)
            idx = torch.full((T, Hkv, n), -1, dtype=torch.int32)
            for t in range(T):
                for h in range(Hkv):
                    c = int(torch.randint(0, min(n, nsel) + 1, (), generator=g))
                    idx[t, h, :c] = torch.sort(torch.randperm(nsel, generator=g)[:c]).values.to(torch.int32)
            rows.append(idx)
        else:
            rows.append(random_indices(T, Hkv, n, block, generator=g, allow_empty=True))
    if packed:
        return torch.cat(rows, 0)
    return torch.stack(rows)


def _run_selected(q, k, v, idx, block, cu, d_o):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = sa.selected_attention(*leaves, idx, block=block, cu_seqlens=cu)
    grads = torch.autograd.grad(o, leaves, d_o)
    return o, lse, grads


def _naive_selected(q, k, v, idx, block, cu, d_o):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o, lse = nv.selected_attention(*leaves, idx, block=block, cu_seqlens=cu)
    grads = torch.autograd.grad(o, leaves, d_o, allow_unused=True)
    return o, lse, [torch.zeros_like(x) if gr is None else gr for gr, x in zip(grads, leaves)]


SELECTED_CASES = [
    # (dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n, future)
    (torch.bfloat16, [1], False, 2, 1, 64, 64, 64, 16, False),
    (torch.float16, [63], False, 4, 2, 64, 64, 64, 16, True),
    (torch.bfloat16, [65], False, 3, 1, 128, 128, 64, 16, False),
    (torch.float16, [1000], False, 8, 1, 128, 128, 128, 8, True),
    (torch.bfloat16, [1000], False, 7, 1, 192, 128, 64, 16, False),
    (torch.float16, [300], False, 2, 2, 192, 128, 128, 8, True),
    (torch.bfloat16, [300], False, 16, 1, 256, 256, 64, 16, True),
    (torch.float16, [129], False, 32, 1, 256, 256, 128, 8, False),
    (torch.bfloat16, [4097], False, 1, 1, 128, 128, 64, 16, False),
    (torch.float16, [1, 31, 65, 300, 2, 0, 130], True, 4, 1, 64, 64, 64, 16, False),
    (torch.bfloat16, [47, 1, 200, 129], True, 6, 2, 192, 128, 128, 8, True),
    (torch.float16, [100, 3, 257], True, 16, 2, 256, 256, 64, 16, False),
    (torch.bfloat16, [500], False, 2, 1, 64, 64, 16, 16, False),   # block 16 (any positive block works)
    (torch.float16, [400], False, 4, 4, 128, 128, 96, 4, True),    # block 96 (not a multiple of 64)
    # Long runs (many 64-row tiles of one block, runs across CTAs) at G = 16 and 12, batched and packed.
    (torch.bfloat16, [2500], False, 16, 1, 128, 128, 64, 16, False),
    (torch.float16, [700, 1, 1900], True, 12, 1, 64, 64, 128, 8, False),
    # Many heads x slots: the KV-block-outer forward and dQ cut their partials into several chunks of (KV head,
    # token row) pairs, head-major (7680 pairs of 34 KB here, 3285 of 68 KB in the packed case): chunks begin and
    # end inside a head's rows (and inside a sequence).
    (torch.bfloat16, [300], False, 64, 64, 256, 256, 16, 64, True),
    (torch.float16, [1, 130, 0, 257, 47], True, 60, 30, 256, 256, 64, 64, False),
]

# The CUDA forwards (src/cuda/selection/forward_plan.h): the switch is read on the host by the CUDA entry points,
# so setting it in this process selects the forward of the calls that follow ("group": the query-outer forward's
# group form, 8 tokens per CTA sharing K/V tiles; "auto": the heuristic, which lets the device choose between the
# group form and the one-token forward where the group form is supported). The KV-block-outer one
# runs on wgmma where it can (sm_90a, Dv <= 128); "kv-sync" forces its mma.sync kernel, and the mma.sync
# dK/dV kernel of the backward (the other forwards' backward runs the wgmma one where it can: 64/64, 128/128 and
# 192/128).
FORWARD_ENV = "SPARSEATTN_SELECTED_FORWARD"
MMA_ENV = "SPARSEATTN_ATTENTION_MMA"
FORWARDS = ["auto", "query", "group", "kv", "kv-sync"]


@pytest.fixture(params=FORWARDS)
def forward(request, monkeypatch):
    monkeypatch.setenv(FORWARD_ENV, request.param.removesuffix("-sync"))
    if request.param.endswith("-sync"):
        monkeypatch.setenv(MMA_ENV, "sync")
    return request.param


@pytest.mark.parametrize("dtype,lengths,packed,Hq,Hkv,Dqk,Dv,block,n,future", SELECTED_CASES)
def test_selected_attention(forward, dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n, future):
    _check_selected(dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n, future)


def _form_kernel_us(fn, one_token, group):
    """GPU time (us) of the one-token kernel named `one_token` ("query") and the group kernel named `group` ("group")
    in one call of fn."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    times = {"query": 0.0, "group": 0.0}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0.0)
        name = event.key.split("<")[0].split("::")[-1]
        if name == group:
            times["group"] += us
        elif name == one_token:
            times["query"] += us
    return times


def _sharing_case(alike):
    """128/128 inputs of 16K tokens, 16/1 heads, blocks of 16 keys, n = 16: every token the same blocks (alike), or
    the 8 tokens of each group blocks of their own."""
    T, Hq, Hkv, D, block, n = 16384, 16, 1, 128, 16, 16
    g = torch.Generator().manual_seed(41)
    q, k, v, d_o = (torch.randn(1, T, h, D, generator=g).bfloat16().cuda() for h in (Hq, Hkv, Hkv, Hq))
    t = torch.arange(T)[:, None]
    if alike:
        blocks = torch.arange(n)[None, :].expand(T, n)              # blocks 0 .. 15 for every token
    else:
        blocks = (t % 8) * n + torch.arange(n)[None, :]             # token 8i + r: blocks 16r .. 16r + 15
    # Ascending blocks, so the visible ones (b * block <= t) come first and the -1 padding last.
    idx = torch.where(blocks * block <= t, blocks, -1)[None, :, None, :].int().cuda()
    return q, k, v, d_o, idx, block


@pytest.mark.parametrize("alike", [True, False])
def test_selected_forward_form_chosen_by_sharing(monkeypatch, alike):
    """Where the group form is supported (128/128) the device chooses between it and the one-token forward from how
    many distinct blocks 8 consecutive tokens chose (src/cuda/selected_attention/group_sharing.h): all tokens alike
    -> the group form does the work; every token of a group its own blocks -> the one-token forward does. Both give
    the forced forms' outputs bit for bit, and the form not chosen returns at once."""
    q, k, v, _, idx, block = _sharing_case(alike)
    outs = {}
    for forward in ("query", "group"):
        monkeypatch.setenv(FORWARD_ENV, forward)
        outs[forward] = sa.selected_attention(q, k, v, idx, block=block)
    monkeypatch.delenv(FORWARD_ENV)
    poison_allocator()
    o, lse = sa.selected_attention(q, k, v, idx, block=block)
    for name in ("query", "group"):
        assert torch.equal(o, outs[name][0]) and torch.equal(lse, outs[name][1]), name
    times = _form_kernel_us(lambda: sa.selected_attention(q, k, v, idx, block=block),
                            "selected_forward_kernel", "selected_group_forward_kernel")
    chosen, other = ("group", "query") if alike else ("query", "group")
    assert times[chosen] > 3 * times[other], times


@pytest.mark.parametrize("alike", [True, False])
def test_selected_dq_form_chosen_by_sharing(monkeypatch, alike):
    """The same choice for the query-outer dQ (src/cuda/selected_attention/backward_plan.h, DqForm::adaptive): the
    group dQ where the tokens share, the one-token dQ where they do not; gradients bit for bit the forced forms'."""
    q, k, v, d_o, idx, block = _sharing_case(alike)
    grads = {}
    for dq in ("query", "group"):
        monkeypatch.setenv(DQ_ENV, dq)
        grads[dq] = _run_selected(q, k, v, idx, block, None, d_o)[2]
    monkeypatch.delenv(DQ_ENV, raising=False)
    poison_allocator()
    got = _run_selected(q, k, v, idx, block, None, d_o)[2]
    for name in ("query", "group"):
        for a, b in zip(got, grads[name]):
            assert torch.equal(a, b), name
    times = _form_kernel_us(lambda: _run_selected(q, k, v, idx, block, None, d_o),
                            "selected_dq_kernel", "selected_group_dq_kernel")
    chosen, other = ("group", "query") if alike else ("query", "group")
    assert times[chosen] > 3 * times[other], times


# The CUDA dQ paths of the backward (src/cuda/selected_attention/backward_plan.h): query-outer (one token per warp,
# "query", or its group form, 8 tokens per CTA sharing K/V tiles, "group") or KV-block-outer ("kv"), read on the
# host like the forward switch; the KV-block-outer one on wgmma where it can (attention_mma "auto") and on mma.sync
# ("sync").
DQ_ENV = "SPARSEATTN_SELECTED_DQ"
DQ_PATHS = ["query", "group", "kv"]


@pytest.mark.parametrize("dtype,lengths,packed,Hq,Hkv,Dqk,Dv,block,n,future", SELECTED_CASES)
def test_selected_attention_kv_outer_dq(monkeypatch, attention_mma, dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n,
                                        future):
    monkeypatch.setenv(DQ_ENV, "kv")
    _check_selected(dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n, future)


@pytest.mark.parametrize("dq", ["query", "group"])
@pytest.mark.parametrize("dtype,lengths,packed,Hq,Hkv,Dqk,Dv,block,n,future", SELECTED_CASES)
def test_selected_attention_query_outer_dq(monkeypatch, dq, dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n,
                                           future):
    monkeypatch.setenv(DQ_ENV, dq)
    _check_selected(dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n, future)


# The group dQ walks the union of its 8 tokens' lists in ascending block order; where every list ascends (as
# select_blocks' do) that is each token's own order, so its dQ is the one-token dQ's bit for bit.
GROUP_DQ_CASES = [
    # (dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n)
    (torch.bfloat16, [2000], False, 16, 1, 128, 128, 64, 16),
    (torch.float16, [1, 9, 700, 0, 13], True, 12, 2, 128, 128, 32, 8),   # G = 12: padded rows; short sequences
    (torch.bfloat16, [300], False, 20, 1, 64, 64, 64, 16),                # G = 20: a chunk of 16 and one of 4
    (torch.bfloat16, [333, 64], True, 16, 1, 192, 128, 64, 16),           # Q's rows in shared memory too
    (torch.float16, [257], False, 16, 1, 256, 256, 128, 8),
]


@pytest.mark.parametrize("dtype,lengths,packed,Hq,Hkv,Dqk,Dv,block,n", GROUP_DQ_CASES)
def test_selected_group_dq_equals_one_token_dq(monkeypatch, dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n):
    g = torch.Generator().manual_seed(31)
    if packed:
        shape, cu = (sum(lengths) + 2,), cu_seqlens_of(lengths).cuda()
        idx = torch.cat(_nsa_indices(lengths, Hkv, n, block, seed=32) + [torch.full((2, Hkv, n), -1, dtype=torch.int32)])
    else:
        shape, cu = (2, lengths[0]), None
        idx = torch.stack(_nsa_indices(lengths * 2, Hkv, n, block, seed=32))
    q, k, v, d_o = (torch.randn(*shape, h, d, generator=g).to(dtype).cuda()
                    for h, d in ((Hq, Dqk), (Hkv, Dqk), (Hkv, Dv), (Hq, Dv)))
    grads = {}
    for dq in ("query", "group"):
        monkeypatch.setenv(DQ_ENV, dq)
        poison_allocator()
        grads[dq] = _run_selected(q, k, v, idx.cuda(), block, cu, d_o)[2]
    for a, b in zip(grads["query"], grads["group"]):
        assert torch.equal(a, b)


def _check_selected(dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n, future):
    g = torch.Generator().manual_seed(1)
    if packed:
        N = sum(lengths) + 3  # 3 rows past the last sequence: left untouched (zero from the Python layer)
        shape = (N,)
        cu = cu_seqlens_of(lengths)
    else:
        shape = (2, lengths[0])
        cu = None
    q = torch.randn(*shape, Hq, Dqk, generator=g).to(dtype)
    k = torch.randn(*shape, Hkv, Dqk, generator=g).to(dtype)
    v = torch.randn(*shape, Hkv, Dv, generator=g).to(dtype)
    idx = _indices(lengths, Hkv, n, block, packed, future, seed=2)
    if packed:
        idx = torch.cat([idx, torch.full((3, Hkv, n), -1, dtype=torch.int32)])
    else:
        idx = torch.cat([idx, _indices(lengths, Hkv, n, block, packed, future, seed=3)])
    d_o = torch.randn(*shape, Hq, Dv, generator=g).to(dtype)

    o_ref, lse_ref, g_ref = _run_selected(q.double(), k.double(), v.double(), idx, block, cu, d_o.double())
    dev = [x.cuda() for x in (q, k, v)]
    cu_d = None if cu is None else cu.cuda()
    o_base, _, g_base = _naive_selected(*dev, idx.cuda(), block, cu_d, d_o.cuda())
    poison_allocator()
    o, lse, grads = _run_selected(*dev, idx.cuda(), block, cu_d, d_o.cuda())
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_lowp(o, o_ref, o_base, dtype, "o")
    assert_lse(lse, lse_ref)
    for name, got, ref, base in zip(("dq", "dk", "dv"), grads, g_ref, g_base):
        assert_lowp(got, ref, base, dtype, name)


@pytest.mark.parametrize("dq", DQ_PATHS)
def test_selected_attention_backward_deterministic(monkeypatch, forward, dq):
    monkeypatch.setenv(DQ_ENV, dq)
    T, Hq, Hkv, D, block, n = 777, 8, 2, 128, 64, 16
    g = torch.Generator().manual_seed(5)
    q, k, v, d_o = (torch.randn(1, T, h, D, generator=g).to(torch.bfloat16).cuda() for h in (Hq, Hkv, Hkv, Hq))
    idx = _indices([T], Hkv, n, block, False, False, seed=6).cuda()
    first = _run_selected(q, k, v, idx, block, None, d_o)
    for _ in range(2):
        poison_allocator()
        again = _run_selected(q, k, v, idx, block, None, d_o)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        for a, b in zip(first[2], again[2]):
            assert torch.equal(a, b)


def test_selected_attention_out_of_range_indices_are_ignored(forward):
    """Device indices are not validated (that would need a device read): entries past the sequence or
    starting after t contribute nothing, and a negative entry ends the list; no fault, no NaN."""
    T, Hq, Hkv, D, block, n = 300, 4, 1, 64, 64, 8
    g = torch.Generator().manual_seed(7)
    q, k, v, d_o = (torch.randn(1, T, h, D, generator=g).to(torch.float16).cuda() for h in (Hq, Hkv, Hkv, Hq))
    clean = torch.full((1, T, Hkv, n), -1, dtype=torch.int32)
    clean[..., 0] = 0
    clean[..., 1] = torch.arange(T, dtype=torch.int32).view(1, T, 1) // block
    clean[..., 1] = torch.where(clean[..., 1] == 0, torch.full_like(clean[..., 1], -1), clean[..., 1])
    bad = clean.clone()
    # after the valid entries (or in place of the -1 padding): huge blocks, then a negative terminator and junk
    first_pad = (clean >= 0).sum(-1, keepdim=True)
    cols = torch.arange(n).view(1, 1, 1, n)
    bad = torch.where(cols == first_pad, torch.full_like(bad, 1 << 30), bad)
    bad = torch.where(cols == first_pad + 1, torch.full_like(bad, -7), bad)
    bad = torch.where(cols == first_pad + 2, torch.zeros_like(bad), bad)  # after the terminator: ignored
    a = _run_selected(q, k, v, clean.cuda(), block, None, d_o)
    b = _run_selected(q, k, v, bad.cuda(), block, None, d_o)
    torch.cuda.synchronize()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for x, y in zip(a[2], b[2]):
        assert torch.equal(x, y)


def _nsa_indices(lengths, Hkv, n, block, seed):
    """NSA-like rows: block 0, the (up to) 2 local blocks, random earlier ones; ascending, -1 padded. Block 0
    is selected by every token, so its inverse-index segment is as long as the sequence."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for T in lengths:
        idx = torch.full((T, Hkv, n), -1, dtype=torch.int32)
        for t in range(T):
            last = t // block
            for h in range(Hkv):
                chosen = {0, last, max(last - 1, 0)}
                rest = [b for b in torch.randperm(last + 1, generator=g).tolist() if b not in chosen]
                chosen = sorted(chosen | set(rest[: max(0, n - len(chosen))]))[:n]
                idx[t, h, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        rows.append(idx)
    return rows


# dK/dV splits inverse-index segments longer than max(256 / G, 2 n block) tokens (rounded up to 32) into
# chunks with fp32 partials merged in chunk order (src/cuda/selection/chunks.cuh): block 0 here spans many
# chunks (and both 64-key subtiles of a 128 block, and the two column halves of Dqk = 192).
LONG_SEGMENT_CASES = [
    # (dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n)
    (torch.bfloat16, [3000], False, 4, 1, 64, 64, 16, 4),
    (torch.float16, [1500, 7, 0, 2100], True, 2, 2, 192, 128, 32, 4),
    (torch.bfloat16, [2500], False, 8, 2, 128, 128, 128, 2),
    (torch.float16, [2000], False, 1, 1, 256, 256, 16, 3),
]


@pytest.mark.parametrize("dq", DQ_PATHS)
@pytest.mark.parametrize("dtype,lengths,packed,Hq,Hkv,Dqk,Dv,block,n", LONG_SEGMENT_CASES)
def test_selected_attention_backward_long_segments(monkeypatch, dq, dtype, lengths, packed, Hq, Hkv, Dqk, Dv, block, n):
    monkeypatch.setenv(DQ_ENV, dq)
    g = torch.Generator().manual_seed(21)
    if packed:
        shape, cu = (sum(lengths) + 2,), cu_seqlens_of(lengths)
        idx = torch.cat(_nsa_indices(lengths, Hkv, n, block, seed=22) + [torch.full((2, Hkv, n), -1, dtype=torch.int32)])
    else:
        shape, cu = (2, lengths[0]), None
        idx = torch.stack(_nsa_indices(lengths * 2, Hkv, n, block, seed=22))
    q = torch.randn(*shape, Hq, Dqk, generator=g).to(dtype)
    k = torch.randn(*shape, Hkv, Dqk, generator=g).to(dtype)
    v = torch.randn(*shape, Hkv, Dv, generator=g).to(dtype)
    d_o = torch.randn(*shape, Hq, Dv, generator=g).to(dtype)
    _, _, g_ref = _run_selected(q.double(), k.double(), v.double(), idx, block, cu, d_o.double())
    dev = [x.cuda() for x in (q, k, v)]
    cu_d = None if cu is None else cu.cuda()
    _, _, g_base = _naive_selected(*dev, idx.cuda(), block, cu_d, d_o.cuda())
    poison_allocator()
    _, _, grads = _run_selected(*dev, idx.cuda(), block, cu_d, d_o.cuda())
    for name, got, ref, base in zip(("dq", "dk", "dv"), grads, g_ref, g_base):
        assert_lowp(got, ref, base, dtype, name)
    poison_allocator()
    _, _, again = _run_selected(*dev, idx.cuda(), block, cu_d, d_o.cuda())
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path,uses_workspace", [("kv", True), ("query", False), ("group", False), ("auto", True)])
def test_selected_forward_switch(monkeypatch, path, uses_workspace):
    """The switch picks the forward: only the KV-block-outer one asks for a workspace (its partials and
    inverse index); left to the heuristic, G = 2 over 4096 tokens runs it too."""
    monkeypatch.setenv(FORWARD_ENV, path)
    requested = []
    real = sa._ops._workspace_allocator

    def recording(like):
        allocate = real(like)
        return lambda nbytes: requested.append(nbytes) or allocate(nbytes)

    monkeypatch.setattr(sa._ops, "_workspace_allocator", recording)
    T, Hq, Hkv, D, block, n = 4096, 4, 2, 128, 64, 16
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, T, h, D, generator=g).to(torch.bfloat16).cuda() for h in (Hq, Hkv, Hkv))
    idx = random_indices(T, Hkv, n, block, generator=g, batch=1).cuda()
    o, lse = sa.selected_attention(q, k, v, idx, block=block)
    assert bool(requested) == uses_workspace and all(b > 0 for b in requested)
    # Same result as the other forward up to rounding (both accumulate in fp32).
    monkeypatch.setenv(FORWARD_ENV, "query" if uses_workspace else "kv")
    o2, lse2 = sa.selected_attention(q, k, v, idx, block=block)
    assert (o.float() - o2.float()).abs().max().item() <= 2 * EPS[torch.bfloat16] * o2.float().abs().max().item()
    assert torch.allclose(lse, lse2, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dims", [(96, 96), (128, 64), (32, 32)])
def test_selected_attention_unsupported_head_dims(dims):
    Dqk, Dv = dims
    q = torch.randn(1, 64, 2, Dqk, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, 64, 1, Dqk, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(1, 64, 1, Dv, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(1, 64, 1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(sa.SparseAttnUnsupportedError, match="head dims"):
        sa.selected_attention(q, k, v, idx)


def test_float32_on_cuda_is_a_clear_error():
    q = torch.randn(1, 64, 2, 64, device="cuda")
    k = torch.randn(1, 64, 1, 64, device="cuda")
    idx = torch.zeros(1, 64, 1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(sa.SparseAttnUnsupportedError, match="float16 or bfloat16"):
        sa.selected_attention(q, k, k, idx)
    kc = torch.randn(1, 3, 1, 64, device="cuda")
    lse = torch.zeros(1, 2, 64, device="cuda")
    with pytest.raises(sa.SparseAttnUnsupportedError, match="float16 or bfloat16"):
        sa.select_blocks(q, kc, lse)
