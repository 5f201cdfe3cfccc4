"""flash_attention's sparse-softmax threshold (softmax_threshold) on CUDA, against the CPU path of the same function on
float32 copies of the same inputs with the same threshold: o, lse, dq, dk, dv (and dbias, dalpha, ddelta with a
bias, mask or gate), tau in {0.05, 0.5, 1}, causal or not, batched and packed, odd sizes, every head-dim pair,
bf16 and fp16, GQA groups 1/4/8, both kernel families (attention_mma; threshold_block is the forward kernel's tiles,
sparseattn._C.flash_attention_threshold_tiles); the recorded decisions against a float64 re-implementation of the
rule; work counts that show the skipped tiles; a deterministic backward; the CUDA-only errors. CPU tests at the
end check what runs without a GPU: the decision map's shape, the op's third output and the C++ API's checks.

Inputs with a margin: the decision compares a tile's largest logit with a bar (running max + log tau_row), so a
logit within rounding of the bar could go either way between fp32 (CUDA) and float64 (CPU). The inputs give every
key tile of a (batch, KV head) one of LEVEL_COUNT logit levels 3.7 apart, in a random order (q and k share a
component whose product sets the level; the rest is noise of about 0.1 in logits), so tile maxima differ strongly.
The levels are few and centred on 0 so that the shared component stays moderate.

Bounds of the gradients: the kernels round P and dS to 16 bits for their products (and O, which Delta = rowsum(dO O)
reads), so dQ = scale dS K carries that rounding times |k| although the rows of dS sum to about 0 and dQ itself can
be small. dQ's bound is therefore eps x (8 x its largest reference value + 2 x its rounding scale R), with R =
scale max_t sum_j P_tj (|dP_tj| + |Delta_t|) max|k_j| (a bound of sum_j |dS_tj| |k_j|) computed in float64 from the
recorded decisions (dq_rounding_scale); a tile left out or added changes dQ by about its share of R, far more than
2 eps R. dK and dV keep eps x 8 x their largest reference value. Under causal
masking tau_row varies by row, so a row can still land near the bar: the float64 re-implementation reports each
decision's margin, the recorded decisions must match wherever the margin exceeds 1e-3, and the comparison against
the CPU threshold runs when every margin does; otherwise (rare) the CPU reference takes the CUDA decisions as its
tile map, which is the same computation given those decisions.
"""
import math

import pytest
import torch

import sparseattn
from sparseattn import _ops
from attention_check import check_close, check_lse, cpu_copy, poison_allocator

pytestmark_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sparseattn._C.built_with_cuda(),
                       reason="needs a CUDA GPU and a CUDA build of sparseattn"),
]

DTYPES = [torch.bfloat16, torch.float16]
DIMS = [(64, 64), (128, 128), (192, 128), (256, 256)]
TAUS = [0.05, 0.5, 1.0]
NEG_INF = float("-inf")
LEVEL_GAP = 3.7
LEVEL_COUNT = 6
MARGIN = 1e-3


def gpu(fn):
    for mark in pytestmark_gpu:
        fn = mark(fn)
    return fn


# ------------------------------------------------------------------------------------------------ helpers


def kernel_tiles(dtype, Dqk, Dv):
    """The threshold_block that the CUDA forward takes for q and v of this dtype and these head dims (the
    attention_mma fixture picks the family)."""
    q = torch.empty(1, 1, 1, Dqk, dtype=dtype, device="cuda")
    v = torch.empty(1, 1, 1, Dv, dtype=dtype, device="cuda")
    tiles = tuple(sparseattn._C.flash_attention_threshold_tiles(q, v))
    assert tiles[0] > 0 and tiles[1] > 0, f"no CUDA tiles for {dtype}, {Dqk}, {Dv}"
    return tiles


def leveled_tokens(n_seqs, lengths_q, lengths_k, Hq, Hkv, Dqk, Dv, dtype, block_k, packed, device="cuda"):
    """q, k, v (batched [B, T, H, D] when not packed, else [N, H, D]) whose key tiles of each (sequence, KV head)
    sit at one of LEVEL_COUNT logit levels LEVEL_GAP apart (see the module docstring)."""
    scale = Dqk ** -0.5
    anchor = 4.0

    def tokens(lengths, heads, dim):
        return [0.3 * torch.randn(n, heads, dim, dtype=torch.float64) for n in lengths]

    qs, ks, vs = tokens(lengths_q, Hq, Dqk), tokens(lengths_k, Hkv, Dqk), tokens(lengths_k, Hkv, Dv)
    for b in range(n_seqs):
        qs[b][..., 0] = anchor
        n_tiles = max(1, -(-lengths_k[b] // block_k))
        for h in range(Hkv):
            levels = LEVEL_GAP * ((torch.randperm(n_tiles) % LEVEL_COUNT).double() - (LEVEL_COUNT - 1) / 2)
            per_key = levels.repeat_interleave(block_k)[:lengths_k[b]]
            ks[b][:, h, 0] = per_key / (anchor * scale)
    if packed:
        q, k, v = (torch.cat(t) for t in (qs, ks, vs))
    else:
        q, k, v = (torch.stack(t) for t in (qs, ks, vs))
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def cu(lengths, device="cuda"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def sequence_logits(q, k, scale, causal, window, bias=None, mask=None, gate=None):
    """float64 logits [Hq, T, S] of one sequence (q [T, Hq, D], k [S, Hkv, D]), -inf where hidden: causal and window
    (bottom-right aligned), mask [Hq, T, S] (True keeps), bias [Hq, T, S], gate g [Hq, T, S] (scaled with q.k)."""
    T, Hq, S = q.shape[0], q.shape[1], k.shape[0]
    kk = k.double().repeat_interleave(Hq // k.shape[1], dim=1)
    raw = torch.einsum("thd,shd->hts", q.double(), kk)
    if gate is not None:
        raw = raw + gate
    logits = scale * raw
    if bias is not None:
        logits = logits + bias
    t = torch.arange(T)[:, None]
    j = torch.arange(S)[None, :]
    a = t + S - T
    visible = torch.ones(T, S, dtype=torch.bool)
    if causal:
        visible &= j <= a
    if window[0] >= 0:
        visible &= j >= a - window[0]
    if window[1] >= 0:
        visible &= j <= a + window[1]
    hidden = ~visible[None].expand(Hq, T, S)
    if mask is not None:
        hidden = hidden | ~mask
    return logits.masked_fill(hidden, NEG_INF)


def expected_decisions(logits, causal, tau, block_q, block_k, n_q, n_k):
    """The rule of docs/semantics.md section 8 on float64 logits [Hq, T, S] of one sequence: (kept, margin), both
    [Hq, n_q, n_k]; margin is how far the decision is from flipping (in logits), inf where no row decides."""
    Hq, T, S = logits.shape
    kept = torch.zeros(Hq, n_q, n_k, dtype=torch.uint8)
    margin = torch.full((Hq, n_q, n_k), math.inf, dtype=torch.float64)
    a = torch.arange(T, dtype=torch.float64) + S - T
    row_tau = tau * (a + 1) / S if causal else torch.full((T,), tau, dtype=torch.float64)
    log_tau = torch.where(row_tau > 0, torch.log(row_tau.clamp_min(1e-300)), torch.full_like(row_tau, NEG_INF))
    for qt in range(-(-T // block_q)):
        rows = slice(qt * block_q, min(T, (qt + 1) * block_q))
        running = torch.full((Hq, rows.stop - rows.start), NEG_INF, dtype=torch.float64)
        for kt in range(-(-S // block_k)):
            tile_max = logits[:, rows, kt * block_k:(kt + 1) * block_k].max(dim=-1).values
            deciding = tile_max != NEG_INF
            # gap >= 0: the row reaches its bar (!(tile_max < bar)); +inf where the running max is still -inf
            gap = (tile_max - (running + log_tau[rows])).masked_fill(~deciding, NEG_INF)
            keep = (gap >= 0).any(dim=-1)
            # a kept tile flips only if its highest row falls below the bar, a skipped one if some row reaches it
            highest = gap.amax(dim=-1)
            closest_below = (-gap).masked_fill(~deciding, math.inf).amin(dim=-1)
            far = torch.where(keep, highest, closest_below)
            kept[:, qt, kt] = keep.to(torch.uint8)
            margin[:, qt, kt] = torch.where(deciding.any(-1), far, torch.full_like(far, math.inf))
            running = torch.where(keep[:, None], torch.maximum(running, tile_max), running)
    return kept, margin


def dq_rounding_scale(logits, kept, block, k, v, d_o, scale):
    """dQ's rounding scale R for one sequence (module docstring): logits float64 [Hq, T, S] with every term
    (sequence_logits), kept the CUDA decisions [Hq, nQ, nK] of the sequence in tiles of block, k [S, Hkv, Dqk], v [S,
    Hkv, Dv], d_o [T, Hq, Dv]."""
    Hq, T, S = logits.shape
    if T == 0 or S == 0:
        return 0.0
    G = Hq // k.shape[1]
    keep = kept.cpu().bool().repeat_interleave(block[0], 1)[:, :T].repeat_interleave(block[1], 2)[:, :, :S]
    p = torch.softmax(logits.masked_fill(~keep, NEG_INF), -1).nan_to_num(0.0)
    dp = torch.einsum("thd,shd->hts", d_o.detach().cpu().double(), v.detach().cpu().double().repeat_interleave(G, 1))
    ds_bound = p * (dp.abs() + (p * dp).sum(-1, keepdim=True).abs())
    k_max = k.detach().cpu().double().abs().amax(-1).repeat_interleave(G, 1).T  # [Hq, S]
    return scale * (ds_bound * k_max[:, None, :]).sum(-1).max().item()


def check_gradients(names, grads, refs, dtype, dq_rounding):
    """Each gradient against the CPU's: factor 16 for dalpha and ddelta, 8 for the others; dq's bound adds its
    rounding scale (dq_rounding_scale, the largest over the sequences)."""
    for name, g, r in zip(names, grads, refs):
        check_close(name, g, r, dtype, 16 if name in ("dalpha", "ddelta") else 8, dq_rounding if name == "dq" else 0.0)


def forward_backward(fn, tensors, d_o, device):
    """fn(*leaves) -> (o, lse) on `device` copies (None entries stay None); returns o, lse and the gradients of
    o . d_o with respect to every given tensor."""
    move = (lambda t: t) if device == "cuda" else cpu_copy
    leaves = [None if t is None else move(t).detach().clone().requires_grad_(t.is_floating_point())
              for t in tensors]
    if device == "cuda":
        poison_allocator()
    o, lse = fn(*leaves)
    given = [t for t in leaves if t is not None and t.requires_grad]
    return o, lse, torch.autograd.grad(o, given, move(d_o))


def run_case(fn_kwargs, tensors, names, dtype, decisions_expected, cuda_decisions, logits):
    """Compares the CUDA call sparseattn.flash_attention(*tensors, **fn_kwargs) with the CPU one (same threshold),
    after checking the CUDA decisions against the float64 rule wherever its margin is clear (batched tensors;
    logits: each sequence's float64 logits, for the gradients' rounding scales). Returns the CUDA gradients."""
    kept_ref, margin = decisions_expected
    clear = margin > MARGIN
    assert cuda_decisions.shape == kept_ref.shape, (
        f"decisions: {tuple(cuda_decisions.shape)} != {tuple(kept_ref.shape)}")
    got = cuda_decisions.cpu()
    assert torch.equal(got[clear], kept_ref[clear]), (
        f"decisions differ at {int((got[clear] != kept_ref[clear]).sum())} clear pairs")
    assert bool(((got == 0) | (got == 1)).all()), "decisions: entries other than 0 and 1 (unwritten?)"

    def call(extra):
        def fn(q, k, v, *rest):
            kw = dict(fn_kwargs)
            kw.update(dict(zip(names, rest)))
            kw.update(extra)
            return sparseattn.flash_attention(q, k, v, return_lse=True, **kw)
        return fn

    cpu_kw = {}
    if not bool(clear.all()):
        # Near-bar decisions: the CPU reference runs on the CUDA decisions as its tile map (no threshold).
        tb = fn_kwargs["threshold_block"]
        cpu_kw = dict(softmax_threshold=None, block_mask=got, block_size=tb)
    d_o = torch.randn_like(call({})(*tensors)[0])
    o, lse, grads = forward_backward(call({}), tensors, d_o, "cuda")
    o_ref, lse_ref, grads_ref = forward_backward(call(cpu_kw), tensors, d_o, "cpu")
    check_close("o", o, o_ref, dtype, 4)
    check_lse(lse, lse_ref)
    q, k, v = tensors[:3]
    dq_rounding = max(dq_rounding_scale(logits[b], got[b], fn_kwargs["threshold_block"], k[b], v[b], d_o[b],
                                        q.shape[-1] ** -0.5) for b in range(q.shape[0]))
    grad_names = ["dq", "dk", "dv"] + ["d" + n for n, t in zip(names, tensors[3:]) if t is not None and
                                       t.is_floating_point()]
    check_gradients(grad_names, grads, grads_ref, dtype, dq_rounding)
    return grads


def decisions_of(q, k, v, **kw):
    """The CUDA forward's recorded decisions of a call (the op's third output)."""
    args = dict(kw)
    cq, ck = args.pop("cu_seqlens_q", None), args.pop("cu_seqlens_k", None)
    mq, mk = args.pop("max_seqlen_q", 0) or 0, args.pop("max_seqlen_k", 0) or 0
    causal, (left, right) = args.pop("causal", False), args.pop("window", (-1, -1))
    tb = args.pop("threshold_block")
    tau = args.pop("softmax_threshold")
    mask, bias = args.pop("mask", None), args.pop("bias", None)
    alpha, delta = args.pop("alpha", None), args.pop("delta", None)
    assert not args, f"decisions_of: unexpected {sorted(args)}"
    _, _, decisions = _ops.flash_attention_with_decisions(
        q, k, v, mask, bias, cq, ck, mq, mk, causal, left, right, None, alpha=alpha, delta=delta,
        softmax_threshold=tau, threshold_block_q=tb[0], threshold_block_k=tb[1])
    return decisions


# ------------------------------------------------------------------------------------------------ GPU tests

HEADS = [(8, 8), (8, 2), (8, 1)]  # groups 1, 4, 8


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("dims", DIMS, ids=lambda d: f"D{d[0]}-{d[1]}")
def test_batched(attention_mma, dims, tau, causal):
    index = DIMS.index(dims) + TAUS.index(tau) + int(causal)
    dtype = DTYPES[index % 2]
    Hq, Hkv = HEADS[index % 3]
    Dqk, Dv = dims
    B, T, S = 2, 300, 333
    tb = kernel_tiles(dtype, Dqk, Dv)
    q, k, v = leveled_tokens(B, [T] * B, [S] * B, Hq, Hkv, Dqk, Dv, dtype, tb[1], packed=False)
    kw = dict(causal=causal, softmax_threshold=tau, threshold_block=tb)
    n_q, n_k = -(-T // tb[0]), -(-S // tb[1])
    logits = [sequence_logits(q[b].cpu(), k[b].cpu(), Dqk ** -0.5, causal, (-1, -1)) for b in range(B)]
    expected = [expected_decisions(x, causal, tau, tb[0], tb[1], n_q, n_k) for x in logits]
    expected = (torch.stack([e[0] for e in expected]), torch.stack([e[1] for e in expected]))
    assert bool((expected[0] == 0).any()), "the inputs should make the threshold skip some tiles"
    run_case(kw, [q, k, v], [], dtype, expected, decisions_of(q, k, v, **kw), logits)


@gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (256, 256)], ids=lambda d: f"D{d[0]}-{d[1]}")
def test_packed(attention_mma, dims, causal):
    """Packed sequences, some empty or shorter than a tile, max_seqlen given."""
    Dqk, Dv = dims
    dtype, (Hq, Hkv), tau = torch.bfloat16, (8, 2), 0.5
    lengths_q = [0, 1, 129, 300, 7]
    lengths_k = [5, 1, 200, 257, 0]
    tb = kernel_tiles(dtype, Dqk, Dv)
    q, k, v = leveled_tokens(len(lengths_q), lengths_q, lengths_k, Hq, Hkv, Dqk, Dv, dtype, tb[1], packed=True)
    kw = dict(causal=causal, softmax_threshold=tau, threshold_block=tb, cu_seqlens_q=cu(lengths_q),
              cu_seqlens_k=cu(lengths_k), max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k))
    n_q, n_k = -(-max(lengths_q) // tb[0]), -(-max(lengths_k) // tb[1])
    cq, ck = cu(lengths_q, "cpu").tolist(), cu(lengths_k, "cpu").tolist()
    kept, margin, logits = [], [], []
    for b in range(len(lengths_q)):
        logits.append(sequence_logits(q[cq[b]:cq[b + 1]].cpu(), k[ck[b]:ck[b + 1]].cpu(), Dqk ** -0.5, causal,
                                      (-1, -1)))
        e = expected_decisions(logits[-1], causal, tau, tb[0], tb[1], n_q, n_k)
        kept.append(e[0])
        margin.append(e[1])
    cpu_kw = dict(kw, cu_seqlens_q=cu(lengths_q, "cpu"), cu_seqlens_k=cu(lengths_k, "cpu"))
    decisions = decisions_of(q, k, v, **kw)

    # run_case moves tensors, not cu_seqlens: compare by hand with the CPU's own cu_seqlens.
    kept, margin = torch.stack(kept), torch.stack(margin)
    clear = margin > MARGIN
    assert torch.equal(decisions.cpu()[clear], kept[clear])
    cpu_extra = {} if bool(clear.all()) else dict(softmax_threshold=None, block_mask=decisions.cpu(), block_size=tb)
    d_o = torch.randn(q.shape[0], Hq, Dv, dtype=dtype, device="cuda")
    o, lse, grads = forward_backward(lambda q, k, v: sparseattn.flash_attention(q, k, v, return_lse=True, **kw),
                                     [q, k, v], d_o, "cuda")
    o_ref, lse_ref, grads_ref = forward_backward(
        lambda q, k, v: sparseattn.flash_attention(q, k, v, return_lse=True, **dict(cpu_kw, **cpu_extra)),
        [q, k, v], d_o, "cpu")
    check_close("o", o, o_ref, dtype, 4)
    check_lse(lse, lse_ref)
    dq_rounding = max(dq_rounding_scale(logits[b], decisions[b], tb, k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]],
                                        d_o[cq[b]:cq[b + 1]], Dqk ** -0.5) for b in range(len(lengths_q)))
    check_gradients(("dq", "dk", "dv"), grads, grads_ref, dtype, dq_rounding)


@gpu
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 300), (2, 257, 1), (1, 129, 513)], ids=str)
def test_odd_sizes(attention_mma, shape):
    B, T, S = shape
    dtype, (Hq, Hkv), (Dqk, Dv) = torch.float16, (4, 4), (128, 128)
    tb = kernel_tiles(dtype, Dqk, Dqk)
    q, k, v = leveled_tokens(B, [T] * B, [S] * B, Hq, Hkv, Dqk, Dv, dtype, tb[1], packed=False)
    for causal in (False, True):
        kw = dict(causal=causal, softmax_threshold=0.05, threshold_block=tb)
        n_q, n_k = -(-T // tb[0]), -(-S // tb[1])
        logits = [sequence_logits(q[b].cpu(), k[b].cpu(), Dqk ** -0.5, causal, (-1, -1)) for b in range(B)]
        exp = [expected_decisions(x, causal, 0.05, tb[0], tb[1], n_q, n_k) for x in logits]
        exp = (torch.stack([e[0] for e in exp]), torch.stack([e[1] for e in exp]))
        run_case(kw, [q, k, v], [], dtype, exp, decisions_of(q, k, v, **kw), logits)


@gpu
@pytest.mark.parametrize("dims", [(128, 128), (256, 256)], ids=lambda d: f"D{d[0]}-{d[1]}")
def test_with_mask_bias_gate_window(attention_mma, dims):
    """The threshold over an element mask (a fully masked row), a bias (dbias), a gate (dalpha, ddelta) and a
    window: the decisions see the logits with every term."""
    Dqk, Dv = dims
    dtype, (Hq, Hkv), (B, T, S), tau = torch.bfloat16, (4, 2), (2, 200, 260), 0.5
    tb = kernel_tiles(dtype, Dqk, Dv)
    q, k, v = leveled_tokens(B, [T] * B, [S] * B, Hq, Hkv, Dqk, Dv, dtype, tb[1], packed=False)
    mask = torch.rand(B, Hq, T, S, device="cuda") < 0.9
    mask[:, :, 5, :] = False
    bias = (0.2 * torch.randn(B, Hq, T, S, device="cuda")).to(dtype)
    alpha = torch.randn(B, T, Hq, device="cuda").to(dtype)
    delta = torch.randn(B, S, Hkv, device="cuda").to(dtype)
    window = (150, -1)
    kw = dict(causal=True, window=window, softmax_threshold=tau, threshold_block=tb)
    n_q, n_k = -(-T // tb[0]), -(-S // tb[1])
    scale = Dqk ** -0.5
    exp, logits = [], []
    for b in range(B):
        x = alpha[b].double().cpu().T[:, :, None] * delta[b].double().cpu().T.repeat_interleave(Hq // Hkv, 0)[:, None]
        g = torch.nn.functional.logsigmoid(x)
        logits.append(sequence_logits(q[b].cpu(), k[b].cpu(), scale, True, window, bias=bias[b].double().cpu(),
                                      mask=mask[b].cpu(), gate=g))
        exp.append(expected_decisions(logits[-1], True, tau, tb[0], tb[1], n_q, n_k))
    exp = (torch.stack([e[0] for e in exp]), torch.stack([e[1] for e in exp]))
    decisions = decisions_of(q, k, v, mask=mask, bias=bias, alpha=alpha, delta=delta, **kw)
    fn_kw = dict(kw, mask=None)  # the mask moves with the tensors below

    def with_mask(m):
        return dict(fn_kw, mask=m)

    kept, margin = exp
    clear = margin > MARGIN
    assert torch.equal(decisions.cpu()[clear], kept[clear])
    cpu_extra = {} if bool(clear.all()) else dict(softmax_threshold=None, block_mask=decisions.cpu(), block_size=tb)
    d_o = torch.randn(B, T, Hq, Dv, dtype=dtype, device="cuda")
    o, lse, grads = forward_backward(
        lambda q, k, v, b_, a_, d_: sparseattn.flash_attention(q, k, v, bias=b_, alpha=a_, delta=d_, return_lse=True,
                                                               **with_mask(mask)),
        [q, k, v, bias, alpha, delta], d_o, "cuda")
    o_ref, lse_ref, grads_ref = forward_backward(
        lambda q, k, v, b_, a_, d_: sparseattn.flash_attention(q, k, v, bias=b_, alpha=a_, delta=d_, return_lse=True,
                                                               **dict(with_mask(mask.cpu()), **cpu_extra)),
        [q, k, v, bias, alpha, delta], d_o, "cpu")
    check_close("o", o, o_ref, dtype, 4)
    check_lse(lse, lse_ref)
    dq_rounding = max(dq_rounding_scale(logits[b], decisions[b], tb, k[b], v[b], d_o[b], scale) for b in range(B))
    check_gradients(("dq", "dk", "dv", "dbias", "dalpha", "ddelta"), grads, grads_ref, dtype, dq_rounding)


@gpu
def test_with_block_mask_same_tiles(attention_mma):
    """A uint8 tile map in the threshold's tiles: absent tiles are neither visited nor decided (0), full ones kept
    as the threshold says; the backward's map is the given one with the skipped pairs absent."""
    dtype, (Hq, Hkv), (Dqk, Dv), (B, T, S) = torch.bfloat16, (4, 1), (64, 64), (1, 256, 640)
    tb = kernel_tiles(dtype, Dqk, Dqk)
    q, k, v = leveled_tokens(B, [T] * B, [S] * B, Hq, Hkv, Dqk, Dv, dtype, tb[1], packed=False)
    n_q, n_k = -(-T // tb[0]), -(-S // tb[1])
    states = torch.randint(0, 3, (B, 1, n_q, n_k), dtype=torch.uint8, device="cuda")
    kw = dict(softmax_threshold=0.5, threshold_block=tb, block_mask=states, block_size=tb)
    logits = sequence_logits(q[0].cpu(), k[0].cpu(), Dqk ** -0.5, False, (-1, -1))
    absent = (states[0, 0].cpu() == 0).repeat_interleave(tb[0], 0)[:T].repeat_interleave(tb[1], 1)[:, :S]
    logits = logits.masked_fill(absent[None], NEG_INF)
    kept, margin = expected_decisions(logits, False, 0.5, tb[0], tb[1], n_q, n_k)
    _, _, decisions = _ops.flash_attention_with_decisions(
        q, k, v, None, None, None, None, 0, 0, False, -1, -1, None, softmax_threshold=0.5, threshold_block_q=tb[0],
        threshold_block_k=tb[1], block_mask=states, block_q=tb[0], block_k=tb[1])
    clear = margin[None] > MARGIN
    assert torch.equal(decisions.cpu()[clear], kept[None][clear])
    assert bool((decisions.cpu()[:, :, (states[0, 0] == 0).cpu()] == 0).all())
    cpu_kw = dict(kw, block_mask=states.cpu())
    d_o = torch.randn(B, T, Hq, Dv, dtype=dtype, device="cuda")
    o, lse, grads = forward_backward(lambda q, k, v: sparseattn.flash_attention(q, k, v, return_lse=True, **kw),
                                     [q, k, v], d_o, "cuda")
    if not bool(clear.all()):
        cpu_kw = dict(kw, softmax_threshold=None, block_mask=_ops._tiles.keep_where(states.cpu(), decisions.cpu()))
    o_ref, lse_ref, grads_ref = forward_backward(
        lambda q, k, v: sparseattn.flash_attention(q, k, v, return_lse=True, **cpu_kw), [q, k, v], d_o, "cpu")
    check_close("o", o, o_ref, dtype, 4)
    check_lse(lse, lse_ref)
    dq_rounding = dq_rounding_scale(logits, decisions[0], tb, k[0], v[0], d_o[0], Dqk ** -0.5)
    check_gradients(("dq", "dk", "dv"), grads, grads_ref, dtype, dq_rounding)


@gpu
def test_work_counts_show_skipped_tiles(attention_mma):
    """The forward computes the scores of every visible tile; the backward, on the forward's decisions, fewer."""
    dtype, (Hq, Hkv), (Dqk, Dv), (B, T, S) = torch.bfloat16, (4, 2), (128, 128), (2, 512, 1024)
    tb = kernel_tiles(dtype, Dqk, Dqk)
    q, k, v = leveled_tokens(B, [T] * B, [S] * B, Hq, Hkv, Dqk, Dv, dtype, tb[1], packed=False)
    d_o = torch.randn(B, T, Hq, Dv, dtype=dtype, device="cuda")
    plain_fwd, plain_bwd = _ops.flash_attention_work(q, k, v, d_o=d_o)
    fwd, bwd = _ops.flash_attention_work(q, k, v, d_o=d_o, softmax_threshold=0.05, threshold_block=tb)
    assert fwd.item() == B * Hq * T * S == plain_fwd.item()
    assert plain_bwd.item() == 2 * plain_fwd.item()
    decisions = decisions_of(q, k, v, softmax_threshold=0.05, threshold_block=tb)
    kept_elements = int(decisions.sum().item()) * tb[0] * tb[1]  # T and S are multiples of the tiles
    assert 0 < kept_elements < B * Hq * T * S
    assert bwd.item() < 2 * fwd.item()
    assert bwd.item() >= 2 * kept_elements  # the backward's own tiles may cover a skipped pair's neighbours


@gpu
def test_backward_is_deterministic(attention_mma):
    dtype, (Hq, Hkv), (Dqk, Dv), (B, T, S) = torch.bfloat16, (8, 1), (64, 64), (1, 700, 700)
    tb = kernel_tiles(dtype, Dqk, Dqk)
    q, k, v = leveled_tokens(B, [T] * B, [S] * B, Hq, Hkv, Dqk, Dv, dtype, tb[1], packed=False)
    d_o = torch.randn(B, T, Hq, Dv, dtype=dtype, device="cuda")
    results = []
    for _ in range(2):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = sparseattn.flash_attention(*leaves, causal=True, softmax_threshold=0.5, threshold_block=tb)
        results.append([o.detach()] + list(torch.autograd.grad(o, leaves, d_o)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@gpu
def test_errors_on_cuda(attention_mma):
    """threshold_block other than the kernel's tiles, a block-sparse mask in other tiles, and the backward op given
    the threshold raise SparseAttnUnsupportedError naming the argument, before any launch."""
    q = torch.randn(1, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
    tb = kernel_tiles(q.dtype, q.shape[-1], q.shape[-1])
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="threshold_block"):
        sparseattn.flash_attention(q, q, q, softmax_threshold=0.5, threshold_block=(tb[0] // 2, tb[1]))
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="threshold_block"):
        sparseattn.flash_attention(q, q, q, softmax_threshold=0.5, threshold_block=(tb[0], 2 * tb[1]))
    blocks = torch.ones(1, 2, 4, 4, dtype=torch.bool, device="cuda")
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="threshold_block"):
        sparseattn.flash_attention(q, q, q, softmax_threshold=0.5, threshold_block=tb, block_mask=blocks,
                                   block_size=(16, 16))
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="threshold_block"):
        _ops.flash_attention(q, q, q, None, None, None, None, 0, 0, False, -1, -1, None, softmax_threshold=0.5,
                             threshold_block_q=tb[0], threshold_block_k=tb[1], block_mask=blocks.to(torch.uint8),
                             block_q=16, block_k=16)
    o, lse = _ops.flash_attention(q, q, q, None, None, None, None, 0, 0, False, -1, -1, None)
    with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="softmax_threshold"):
        _ops.flash_attention_backward(q, q, q, None, None, o, lse, o, None, None, 0, 0, False, -1, -1, None, False,
                                      softmax_threshold=0.5, threshold_block_q=tb[0], threshold_block_k=tb[1])
    # packed calls need max_seqlen_q and max_seqlen_k (the decision map's size; the backward's tile map needs them)
    qp = q[0]
    cu_q = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(sparseattn.SparseAttnError, match="max_seqlen_q"):
        sparseattn.flash_attention(qp, qp, qp, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, softmax_threshold=0.5,
                                   threshold_block=tb)
    # the decision map is the CUDA forward's output: its shape is checked
    bad = torch.zeros(1, 2, 1, 0, dtype=torch.uint8, device="cuda")
    with pytest.raises(sparseattn.SparseAttnError, match="threshold_tiles"):
        sparseattn._C.flash_attention(q, q, q, None, None, torch.empty_like(q), lse.clone(), None, None, 0, 0, False,
                                      -1, -1, None, None, None, "logsigmoid", None, 0.5, tb[0], tb[1], None, None,
                                      None, None, None, 0, 0, None, None,
                                      torch.cuda.current_stream().cuda_stream, threshold_tiles=bad)


@gpu
def test_compiles_fullgraph(attention_mma):
    """torch.compile(fullgraph=True) through the op's fake implementation (its decision map) and autograd."""
    dtype, (Hq, Hkv), (Dqk, Dv), (B, T, S) = torch.bfloat16, (4, 2), (128, 128), (1, 300, 300)
    tb = kernel_tiles(dtype, Dqk, Dqk)
    q, k, v = leveled_tokens(B, [T] * B, [S] * B, Hq, Hkv, Dqk, Dv, dtype, tb[1], packed=False)

    def fn(q, k, v):
        return sparseattn.flash_attention(q, k, v, causal=True, softmax_threshold=0.5, threshold_block=tb)

    compiled = torch.compile(fn, fullgraph=True)
    d_o = torch.randn(B, T, Hq, Dv, dtype=dtype, device="cuda")
    outs = []
    for f in (fn, compiled):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = f(*leaves)
        outs.append([o.detach()] + list(torch.autograd.grad(o, leaves, d_o)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ CPU tests


def test_decision_map_shape():
    q = torch.empty(3, 300, 8, 64)
    k = torch.empty(3, 333, 2, 64)
    assert _ops._threshold_tiles_shape(q, None, 0, k, 0, 128, 128) == [3, 8, 3, 3]
    assert _ops._threshold_tiles_shape(q, None, 0, k, 0, 128, 32) == [3, 8, 3, 11]
    qp, kp = torch.empty(500, 8, 64), torch.empty(700, 2, 64)
    cu_q = torch.tensor([0, 100, 500], dtype=torch.int32)
    # packed: the sequences' count, max_seqlen where given (at most the packed rows), else the packed rows
    assert _ops._threshold_tiles_shape(qp, cu_q, 400, kp, 129, 128, 64) == [2, 8, 4, 3]
    assert _ops._threshold_tiles_shape(qp, cu_q, 0, kp, 0, 128, 128) == [2, 8, 4, 6]
    assert _ops._threshold_tiles_shape(qp, cu_q, 10_000, kp, 0, 64, 128) == [2, 8, 8, 6]


def test_cpu_records_no_decisions_and_keeps_gradients():
    """On the CPU the op's decision output is empty (the CPU backward recomputes the decisions) and the gradients
    flow as before."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    o, lse, decisions = _ops.flash_attention_with_decisions(q, k, v, None, None, None, None, 0, 0, True, -1, -1, None,
                                                            softmax_threshold=0.5, threshold_block_q=4,
                                                            threshold_block_k=4)
    assert decisions.dtype == torch.uint8 and decisions.numel() == 0
    assert not _ops._records_threshold(q, 0.5)
    grads = torch.autograd.grad(o.sum(), (q, k, v))
    o2 = sparseattn.flash_attention(q, k, v, causal=True, softmax_threshold=0.5, threshold_block=(4, 4))
    assert torch.equal(o, o2)
    assert all(torch.isfinite(g).all() for g in grads)


def test_kernel_tiles_of_cpu_tensors_are_none():
    q = torch.empty(1, 4, 2, 64, dtype=torch.bfloat16)
    assert tuple(sparseattn._C.flash_attention_threshold_tiles(q, q)) == (0, 0)


def test_cpu_rejects_a_decision_map():
    """threshold_tiles is the CUDA forward's record: the C++ API refuses it with CPU tensors, naming it."""
    q = torch.randn(1, 4, 2, 8)
    o, lse = torch.empty(1, 4, 2, 8), torch.empty(1, 2, 4)
    tiles = torch.zeros(1, 2, 1, 1, dtype=torch.uint8)
    with pytest.raises(sparseattn.SparseAttnError, match="threshold_tiles"):
        sparseattn._C.flash_attention(q, q, q, None, None, o, lse, None, None, 0, 0, False, -1, -1, None, None, None,
                                      "logsigmoid", None, 0.5, 4, 4, None, None, None, None, None, 0, 0, None, None, 0,
                                      threshold_tiles=tiles)


def test_python_checks_before_the_backend():
    """The argument checks that run before any device code, on CPU tensors."""
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(sparseattn.SparseAttnTypeError, match="threshold_block"):
        sparseattn.flash_attention(q, q, q, softmax_threshold=0.5, threshold_block=128)
    with pytest.raises(sparseattn.SparseAttnError, match="threshold_block"):
        sparseattn.flash_attention(q, q, q, softmax_threshold=0.5, threshold_block=(0, 128))
    with pytest.raises(sparseattn.SparseAttnError, match="softmax_threshold"):
        sparseattn.flash_attention(q, q, q, softmax_threshold=0.0)
    with pytest.raises(sparseattn.SparseAttnTypeError, match="softmax_threshold"):
        sparseattn.flash_attention(q, q, q, softmax_threshold="0.5")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tau", TAUS)
def test_rule_matches_the_cpu_reference(causal, tau):
    """The GPU tests' float64 re-implementation of the rule (expected_decisions) and their leveled inputs, checked
    on the CPU: the CPU threshold equals the CPU attention over the tile map of the re-implementation's decisions,
    and the inputs skip tiles with clear margins."""
    B, T, S, Hq, Hkv, D, tb = 2, 40, 75, 4, 2, 16, (8, 16)
    q, k, v = leveled_tokens(B, [T] * B, [S] * B, Hq, Hkv, D, D, torch.float64, tb[1], packed=False, device="cpu")
    n_q, n_k = -(-T // tb[0]), -(-S // tb[1])
    exp = [expected_decisions(sequence_logits(q[b], k[b], D ** -0.5, causal, (-1, -1)), causal, tau, tb[0], tb[1],
                              n_q, n_k) for b in range(B)]
    kept = torch.stack([e[0] for e in exp])
    margin = torch.stack([e[1] for e in exp])
    assert bool((kept == 0).any()) and bool((kept == 1).any())
    assert float((margin > MARGIN).double().mean()) > 0.9
    o, lse = sparseattn.flash_attention(q, k, v, causal=causal, softmax_threshold=tau, threshold_block=tb,
                                        return_lse=True)
    o_map, lse_map = sparseattn.flash_attention(q, k, v, causal=causal, block_mask=kept, block_size=tb,
                                                return_lse=True)
    torch.testing.assert_close(o, o_map, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_map, rtol=1e-12, atol=1e-12)


def fake_cuda():
    """Fake CUDA tensors (no GPU needed): the Python layer's CUDA-side logic runs on their shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode()


def test_cuda_python_checks_without_a_gpu():
    """On (fake) CUDA tensors the Python function requires a block-sparse mask in threshold_block's tiles, before any
    device code."""
    with fake_cuda():
        q = torch.empty(1, 64, 2, 64, dtype=torch.bfloat16, device="cuda")
        blocks = torch.ones(1, 2, 4, 4, dtype=torch.bool, device="cuda")
        with pytest.raises(sparseattn.SparseAttnUnsupportedError, match="threshold_block"):
            sparseattn.flash_attention(q, q, q, softmax_threshold=0.5, threshold_block=(128, 128), block_mask=blocks,
                                       block_size=(16, 16))


class _Ctx:
    """A stand-in for autograd's ctx: what setup_context saves."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable = tensors


def test_fake_decisions_and_the_backward_tile_map():
    """The op's fake implementation gives the decision map's shape on CUDA, and the autograd setup turns the map
    into the backward's tile map (the given map with the skipped pairs absent) in threshold_block's tiles, with no
    threshold left for the CUDA backward."""
    with fake_cuda():
        q = torch.empty(2, 300, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 333, 2, 64, dtype=torch.bfloat16, device="cuda")
        args = (q, k, k, None, None, None, None, 0, 0, True, -1, -1, None)
        kw = dict(softmax_threshold=0.5, threshold_block_q=128, threshold_block_k=32)
        o, lse, decisions = _ops.flash_attention_with_decisions(*args, **kw)
        assert tuple(decisions.shape) == (2, 8, 3, 11) and decisions.dtype == torch.uint8
        _, _, none = _ops.flash_attention_with_decisions(*args)
        assert none.numel() == 0
        given = torch.ones(1, 2, 3, 11, dtype=torch.uint8, device="cuda")
        inputs = (*args, None, None, "logsigmoid", None, 0.5, 128, 32, given, None, None, None, None, 128, 32, None,
                  None)
        ctx = _Ctx()
        _ops._flash_attention_setup(ctx, inputs, (o, lse, decisions))
        block_mask = ctx.saved_tensors[11]
        assert tuple(block_mask.shape) == (2, 8, 3, 11) and block_mask.dtype == torch.uint8
        assert ctx.block_sizes == (128, 32)
        assert ctx.gate_args[2] is None  # no softmax_threshold for the backward
        ctx = _Ctx()
        _ops._flash_attention_setup(ctx, (*args, None, None, "logsigmoid", None, 0.5, 128, 32, None, None, None,
                                          None, None, 0, 0, None, None), (o, lse, decisions))
        assert ctx.saved_tensors[11] is decisions and ctx.block_sizes == (128, 32)


def test_mask_summary_uses_threshold_tiles(monkeypatch):
    """With softmax_threshold on CUDA, a batched element mask is summarised in threshold_block's tiles (the kernels
    take one tile map, in the decisions' tiles)."""
    seen = {}
    real = _ops.flash_attention

    def spy(*args, **kwargs):
        seen.update(kwargs, block_mask_arg=args[20] if len(args) > 20 else kwargs.get("block_mask"))
        seen["block_sizes"] = (args[25], args[26]) if len(args) > 26 else (kwargs["block_q"], kwargs["block_k"])
        return real(*args, **kwargs)

    monkeypatch.setattr(_ops, "flash_attention", spy)
    with fake_cuda():
        q = torch.empty(1, 300, 2, 64, dtype=torch.bfloat16, device="cuda")
        mask = torch.ones(1, 2, 300, 300, dtype=torch.bool, device="cuda")
        sparseattn.flash_attention(q, q, q, mask=mask, softmax_threshold=0.5, threshold_block=(128, 32))
    assert seen["block_sizes"] == (128, 32)
    assert tuple(seen["block_mask_arg"].shape[-2:]) == (3, 10)
