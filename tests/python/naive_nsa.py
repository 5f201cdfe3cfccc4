"""A deliberately naive, independent PyTorch implementation of Native Sparse Attention.

Written from the semantics brief (docs/semantics.md), not from the C++ code, to serve as the oracle of the
Python test suite. Everything is dense masks over one sequence at a time (Python loops over the batch and
over compressed blocks), computed in the dtype of the inputs (use float64 for a reference). Every function is
plain torch, so torch.autograd gives the reference gradients; selection is computed on detached tensors, as
it is not differentiated.

Conventions (the package's): batched tensors [B, T, H, D], packed varlen tensors [N, H, D] with int32
cu_seqlens [B+1]; log-sum-exp [B, Hq, T] (packed [Hq, N]); gates [B, T, Hq] (packed [N, Hq]); query head h
uses KV head h // G with G = Hq // Hkv; indices int32 [..., T, Hkv, n], ascending, -1 padded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Config:
    """NSA hyper-parameters; defaults are the NSA paper's."""

    cmp_block: int = 32  # l
    cmp_stride: int = 16  # d
    sel_block: int = 64  # l'
    num_selected: int = 16  # n
    num_init: int = 1
    num_local: int = 2
    window: int = 512  # w
    scale: Optional[float] = None


def config_from(obj) -> Config:
    """A naive Config from any object with the same attribute names (e.g. sparseattn.NSAConfig)."""
    if obj is None:
        return Config()
    if isinstance(obj, Config):
        return obj
    return Config(**{f: getattr(obj, f) for f in Config.__dataclass_fields__})


# ----------------------------------------------------------------------------------------------- helpers


def num_compressed_blocks(length: int, block: int, stride: int) -> int:
    return (length - block) // stride + 1 if length >= block else 0


def num_selection_blocks(length: int, block: int) -> int:
    return -(-length // block)


def default_scale(head_dim: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def seq_bounds(cu_seqlens) -> list[tuple[int, int]]:
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [(cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def compressed_cu_seqlens(cu_seqlens, block: int = 32, stride: int = 16) -> torch.Tensor:
    counts = [num_compressed_blocks(e - s, block, stride) for s, e in seq_bounds(cu_seqlens)]
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return torch.tensor(out, dtype=torch.int32)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _expand_kv_heads(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[S, Hkv, D] -> [S, Hq, D]: query head h reads KV head h // G."""
    hkv = x.shape[1]
    assert num_q_heads % hkv == 0, (num_q_heads, hkv)
    return x.repeat_interleave(num_q_heads // hkv, dim=1)


def _expand_mask_heads(x: torch.Tensor, num_q_heads: int, num_kv_heads: int) -> torch.Tensor:
    """[Hm, ...] with Hm in {1, Hkv, Hq} -> broadcastable to [Hq, ...]."""
    hm = x.shape[0]
    if hm == 1 or hm == num_q_heads:
        return x
    assert hm == num_kv_heads, (hm, num_q_heads, num_kv_heads)
    return x.repeat_interleave(num_q_heads // num_kv_heads, dim=0)


# ------------------------------------------------------------------------------------ one-sequence math


def masked_attention(q, k, v, keep, scale, bias=None):
    """Dense softmax attention of one sequence under a keep mask.

    q [T, Hq, D], k [S, Hkv, D], v [S, Hkv, Dv]; keep bool broadcastable to [Hq, T, S]; bias (optional)
    broadcastable to [Hq, T, S]. Returns o [T, Hq, Dv] and lse [Hq, T]; a row with no kept key gives o = 0
    and lse = -inf (and no gradient).
    """
    T, Hq, _ = q.shape
    S = k.shape[0]
    Dv = v.shape[-1]
    if S == 0:
        o = q.new_zeros((T, Hq, Dv)) + 0.0 * v.sum()  # keeps the graph connected
        return o, q.new_full((Hq, T), NEG_INF)
    kk = _expand_kv_heads(k, Hq)
    vv = _expand_kv_heads(v, Hq)
    s = torch.einsum("thd,shd->hts", q, kk) * scale
    if bias is not None:
        s = s + bias
    keep = torch.broadcast_to(keep, s.shape)
    s = s.masked_fill(~keep, NEG_INF)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    nonempty = denom > 0
    safe = torch.where(nonempty, denom, torch.ones_like(denom))
    p = e / safe
    o = torch.einsum("hts,shd->thd", p, vv)
    lse = torch.where(nonempty, m + torch.log(safe), torch.full_like(m, NEG_INF)).squeeze(-1)
    return o, lse


def compress_seq(x, block, stride):
    """Mean of x [S, H, D] over tokens [j*stride, j*stride + block) -> [Tc, H, D] (fp32 mean for fp16/bf16)."""
    S = x.shape[0]
    tc = num_compressed_blocks(S, block, stride)
    if tc == 0:
        return x.new_zeros((0,) + tuple(x.shape[1:])) + 0.0 * x.sum()
    acc = _acc_dtype(x.dtype)
    blocks = [x[j * stride : j * stride + block].to(acc).mean(dim=0) for j in range(tc)]
    return torch.stack(blocks).to(x.dtype)


def compressed_visibility(T, tc, block, stride, device=None):
    """keep[t, j] = j*stride + block - 1 <= t."""
    t = torch.arange(T, device=device)[:, None]
    j = torch.arange(tc, device=device)[None, :]
    return j * stride + block - 1 <= t


def compressed_attention_seq(q, k_cmp, v_cmp, block, stride, scale):
    keep = compressed_visibility(q.shape[0], k_cmp.shape[0], block, stride, q.device)
    return masked_attention(q, k_cmp, v_cmp, keep, scale)


def overlap_weights(tc, nsel, block, stride, sel_block, dtype=torch.float64):
    """W[j, b] = |[j*d, j*d + l) ∩ [b*l', (b+1)*l')| / d."""
    w = torch.zeros(tc, nsel, dtype=dtype)
    for j in range(tc):
        lo, hi = j * stride, j * stride + block
        for b in range(nsel):
            blo, bhi = b * sel_block, (b + 1) * sel_block
            ov = max(0, min(hi, bhi) - max(lo, blo))
            w[j, b] = ov / stride
    return w


def selection_scores_seq(q, k_cmp, lse, block, stride, sel_block, scale):
    """S [Hkv, T, nsel]: overlap-weighted, group-summed compressed attention probabilities.

    q [T, Hq, D], k_cmp [Tc, Hkv, D], lse [Hq, T] (the log-sum-exp compressed attention returned).
    """
    T, Hq, _ = q.shape
    tc, Hkv, _ = k_cmp.shape
    G = Hq // Hkv
    nsel = num_selection_blocks(T, sel_block)
    if tc == 0 or T == 0:
        return q.new_zeros((Hkv, T, nsel))
    s = torch.einsum("thd,jhd->htj", q, _expand_kv_heads(k_cmp, Hq)) * scale
    keep = compressed_visibility(T, tc, block, stride, q.device)[None]
    p = torch.where(keep, torch.exp(s - lse[:, :, None]), torch.zeros_like(s))
    P = p.reshape(Hkv, G, T, tc).sum(dim=1)
    W = overlap_weights(tc, nsel, block, stride, sel_block, dtype=P.dtype).to(P.device)
    return P @ W


def select_from_scores(scores, sel_block, num_selected, num_init, num_local):
    """Top-n selection from scores [Hkv, T, nsel] -> int32 indices [T, Hkv, n] (ascending, -1 padded).

    Candidates b*l' <= t; forced 0..init-1 and the `local` blocks ending at t // l'; the rest by score,
    ties to the lower block index; count = min(n, candidates).
    """
    Hkv, T, nsel = scores.shape
    dev = scores.device
    t = torch.arange(T, device=dev)
    cur = (t // sel_block)[:, None]  # [T, 1]
    b = torch.arange(nsel, device=dev)[None, :]  # [1, nsel]
    cand = b <= cur
    forced = ((b < num_init) | ((b > cur - num_local) & (b <= cur))) & cand
    key = scores.detach().to(torch.float64).clone()
    key = torch.where(forced[None], torch.full_like(key, math.inf), key)
    key = torch.where(cand[None], key, torch.full_like(key, -math.inf))
    # A stable descending sort keeps equal scores in ascending block order: ties go to the lower index.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    n = num_selected
    if nsel < n:
        order = torch.cat([order, order.new_full((Hkv, T, n - nsel), -1)], dim=-1)
    top = order[..., :n]
    count = torch.clamp(cand.sum(dim=-1), max=n)  # [T]
    slot = torch.arange(n, device=dev)[None, None, :]
    top = torch.where(slot < count[None, :, None], top, torch.full_like(top, -1))
    big = nsel + n + 1
    top = torch.sort(torch.where(top < 0, torch.full_like(top, big), top), dim=-1).values
    top = torch.where(top == big, torch.full_like(top, -1), top)
    return top.permute(1, 0, 2).contiguous().to(torch.int32)


def select_blocks_seq(q, k_cmp, lse, cfg: Config, scale):
    scores = selection_scores_seq(q, k_cmp, lse, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, scale)
    return select_from_scores(scores, cfg.sel_block, cfg.num_selected, cfg.num_init, cfg.num_local)


def selected_keep(indices, T, Hq, sel_block, device=None):
    """keep [Hq, T, T] from indices [T, Hkv, n]: key s is kept iff its block is listed and s <= t."""
    Tq, Hkv, n = indices.shape
    assert Tq == T
    nsel = num_selection_blocks(T, sel_block)
    idx = indices.long().to(device)
    idx = torch.where(idx < 0, torch.full_like(idx, nsel), idx)
    sel = torch.zeros(T, Hkv, nsel + 1, dtype=torch.bool, device=device)
    sel.scatter_(2, idx, True)
    sel = sel[..., :nsel]
    s_pos = torch.arange(T, device=device)
    keep = sel[:, :, s_pos // sel_block]  # [T, Hkv, S]
    keep = keep & (s_pos[None, None, :] <= torch.arange(T, device=device)[:, None, None])
    return keep.permute(1, 0, 2).repeat_interleave(Hq // Hkv, dim=0)


def selected_attention_seq(q, k, v, indices, sel_block, scale):
    T, Hq, _ = q.shape
    keep = selected_keep(indices, T, Hq, sel_block, q.device)
    return masked_attention(q, k, v, keep, scale)


def window_keep(T, S, causal, window, device=None):
    """keep [T, S] with bottom-right alignment a = t + S - T."""
    left, right = window
    a = torch.arange(T, device=device)[:, None] + (S - T)
    s = torch.arange(S, device=device)[None, :]
    keep = torch.ones(T, S, dtype=torch.bool, device=device)
    if causal:
        keep &= s <= a
    if left is not None and left >= 0:
        keep &= s >= a - left
    if right is not None and right >= 0:
        keep &= s <= a + right
    return keep


def sliding_window_seq(q, k, v, window, scale):
    T = q.shape[0]
    keep = window_keep(T, T, True, (window - 1, 0), q.device)
    return masked_attention(q, k, v, keep, scale)


def nsa_seq(q, k, v, g_cmp, g_slc, g_swa, cfg: Config, k_cmp=None, v_cmp=None, block_indices=None):
    """The whole NSA pipeline on one sequence. Returns (o, extras) with extras holding intermediates."""
    T, Hq, Dqk = q.shape
    Dv = v.shape[-1]
    scale = default_scale(Dqk, cfg.scale)
    if k_cmp is None:
        k_cmp = compress_seq(k, cfg.cmp_block, cfg.cmp_stride)
        v_cmp = compress_seq(v, cfg.cmp_block, cfg.cmp_stride)
    extras = {"k_cmp": k_cmp, "v_cmp": v_cmp}
    o = q.new_zeros((T, Hq, Dv))
    need_cmp = g_cmp is not None or (g_slc is not None and block_indices is None)
    if need_cmp:
        o_cmp, lse = compressed_attention_seq(q, k_cmp, v_cmp, cfg.cmp_block, cfg.cmp_stride, scale)
        extras["o_cmp"], extras["lse_cmp"] = o_cmp, lse
        if g_cmp is not None:
            o = o + g_cmp[..., None] * o_cmp
    if g_slc is not None:
        idx = block_indices
        if idx is None:
            idx = select_blocks_seq(q.detach(), k_cmp.detach(), lse.detach(), cfg, scale)
        extras["indices"] = idx
        o_slc, _ = selected_attention_seq(q, k, v, idx, cfg.sel_block, scale)
        extras["o_slc"] = o_slc
        o = o + g_slc[..., None] * o_slc
    if g_swa is not None:
        o_swa, _ = sliding_window_seq(q, k, v, cfg.window, scale)
        extras["o_swa"] = o_swa
        o = o + g_swa[..., None] * o_swa
    return o, extras


# ------------------------------------------------------------------------------ batched / packed API


def _seqs(x, cu_seqlens):
    """Yields (b, slice) for batched (cu_seqlens None: x[b]) or packed layouts."""
    if cu_seqlens is None:
        for b in range(x.shape[0]):
            yield b, b
    else:
        for b, (s, e) in enumerate(seq_bounds(cu_seqlens)):
            yield b, slice(s, e)


def compress_kv(k, v, block=32, stride=16, cu_seqlens=None):
    if cu_seqlens is None:
        kc = torch.stack([compress_seq(k[b], block, stride) for b in range(k.shape[0])])
        vc = torch.stack([compress_seq(v[b], block, stride) for b in range(v.shape[0])])
        return kc, vc
    rows = k.shape[0] // stride
    kcs, vcs = [], []
    for _, sl in _seqs(k, cu_seqlens):
        kcs.append(compress_seq(k[sl], block, stride))
        vcs.append(compress_seq(v[sl], block, stride))
    kc, vc = torch.cat(kcs), torch.cat(vcs)
    pad = rows - kc.shape[0]
    kc = torch.cat([kc, kc.new_zeros((pad,) + tuple(kc.shape[1:]))])
    vc = torch.cat([vc, vc.new_zeros((pad,) + tuple(vc.shape[1:]))])
    return kc, vc


def _cmp_slices(cu_seqlens, block, stride):
    ccu = compressed_cu_seqlens(cu_seqlens, block, stride)
    return [slice(s, e) for s, e in seq_bounds(ccu)]


def compressed_attention(q, k_cmp, v_cmp, block=32, stride=16, scale=None, cu_seqlens=None,
                         cu_seqlens_cmp=None):
    scale = default_scale(q.shape[-1], scale)
    if cu_seqlens is None:
        outs = [compressed_attention_seq(q[b], k_cmp[b], v_cmp[b], block, stride, scale)
                for b in range(q.shape[0])]
        return torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs])
    if cu_seqlens_cmp is None:
        cu_seqlens_cmp = compressed_cu_seqlens(cu_seqlens, block, stride)
    cb = [slice(s, e) for s, e in seq_bounds(cu_seqlens_cmp)]
    return _packed(q, v_cmp.shape[-1], cu_seqlens,
                   lambda b, sl: compressed_attention_seq(q[sl], k_cmp[cb[b]], v_cmp[cb[b]], block, stride, scale))


def _packed(q, dv, cu_seqlens, fn):
    N, Hq, _ = q.shape
    os, lses = [], []
    last = 0
    for b, (s, e) in enumerate(seq_bounds(cu_seqlens)):
        o_b, lse_b = fn(b, slice(s, e))
        os.append(o_b)
        lses.append(lse_b)
        last = e
    tail = N - last
    os.append(q.new_zeros((tail, Hq, dv)))
    lses.append(q.new_full((Hq, tail), NEG_INF))
    return torch.cat(os, dim=0), torch.cat(lses, dim=1)


def select_blocks(q, k_cmp, lse_cmp, cmp_block=32, cmp_stride=16, sel_block=64, num_selected=16, num_init=1,
                  num_local=2, scale=None, cu_seqlens=None, cu_seqlens_cmp=None):
    cfg = Config(cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, 512, scale)
    sc = default_scale(q.shape[-1], scale)
    if cu_seqlens is None:
        return torch.stack([select_blocks_seq(q[b], k_cmp[b], lse_cmp[b], cfg, sc) for b in range(q.shape[0])])
    if cu_seqlens_cmp is None:
        cu_seqlens_cmp = compressed_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)
    cbounds = seq_bounds(cu_seqlens_cmp)
    parts = []
    last = 0
    for b, (s, e) in enumerate(seq_bounds(cu_seqlens)):
        parts.append(select_blocks_seq(q[s:e], k_cmp[slice(*cbounds[b])], lse_cmp[:, s:e], cfg, sc))
        last = e
    Hkv = k_cmp.shape[1]
    parts.append(torch.full((q.shape[0] - last, Hkv, num_selected), -1, dtype=torch.int32))
    return torch.cat(parts, dim=0)


def selection_scores(q, k_cmp, lse_cmp, cmp_block=32, cmp_stride=16, sel_block=64, scale=None):
    """Batched only: scores [B, Hkv, T, nsel] (for explaining a selection mismatch)."""
    sc = default_scale(q.shape[-1], scale)
    return torch.stack([selection_scores_seq(q[b], k_cmp[b], lse_cmp[b], cmp_block, cmp_stride, sel_block, sc)
                        for b in range(q.shape[0])])


def selected_attention(q, k, v, indices, block=64, scale=None, cu_seqlens=None):
    scale = default_scale(q.shape[-1], scale)
    if cu_seqlens is None:
        outs = [selected_attention_seq(q[b], k[b], v[b], indices[b], block, scale) for b in range(q.shape[0])]
        return torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs])
    return _packed(q, v.shape[-1], cu_seqlens,
                   lambda b, sl: selected_attention_seq(q[sl], k[sl], v[sl], indices[sl], block, scale))


def _bcast_pick(x, b, t_len, Hq, Hkv):
    """From a broadcastable [B|1, Hq|Hkv|1, T|1, S] tensor, the [Hq|1, T|1, S] slice of batch b."""
    xb = x[b if x.shape[0] > 1 else 0]
    return _expand_mask_heads(xb, Hq, Hkv)


def flash_attention(q, k, v, causal=False, window=(-1, -1), mask=None, bias=None, scale=None,
                    cu_seqlens_q=None, cu_seqlens_k=None, return_lse=False):
    scale = default_scale(q.shape[-1], scale)
    if cu_seqlens_q is None:
        Hq, Hkv = q.shape[2], k.shape[2]
        outs = []
        for b in range(q.shape[0]):
            T, S = q.shape[1], k.shape[1]
            keep = window_keep(T, S, causal, window, q.device)[None]
            if mask is not None:
                keep = keep & _bcast_pick(mask, b, T, Hq, Hkv)
            bb = _bcast_pick(bias, b, T, Hq, Hkv) if bias is not None else None
            outs.append(masked_attention(q[b], k[b], v[b], keep, scale, bb))
        o, lse = torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs])
    else:
        assert mask is None and bias is None, "this naive helper takes mask/bias in the batched layout only"
        kb = seq_bounds(cu_seqlens_k)

        def fn(b, sl):
            ks = slice(*kb[b])
            T, S = sl.stop - sl.start, ks.stop - ks.start
            keep = window_keep(T, S, causal, window, q.device)[None]
            return masked_attention(q[sl], k[ks], v[ks], keep, scale)

        o, lse = _packed(q, v.shape[-1], cu_seqlens_q, fn)
    return (o, lse) if return_lse else o


def combine(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa):
    o = None
    for ob, g in ((o_cmp, g_cmp), (o_slc, g_slc), (o_swa, g_swa)):
        if g is None:
            continue
        term = g[..., None] * ob
        o = term if o is None else o + term
    return o


def nsa_attention(q, k, v, g_cmp=None, g_slc=None, g_swa=None, config=None, k_cmp=None, v_cmp=None,
                  block_indices=None, cu_seqlens=None, return_extras=False):
    """Whole NSA. Batched or packed (with cu_seqlens; then k_cmp/v_cmp are laid out by the compressed
    cu_seqlens). Returns o (and, with return_extras, a list of per-sequence intermediates)."""
    cfg = config_from(config)

    def g_of(g, sl):
        return None if g is None else g[sl]

    extras = []
    if cu_seqlens is None:
        outs = []
        for b in range(q.shape[0]):
            o_b, ex = nsa_seq(q[b], k[b], v[b], g_of(g_cmp, b), g_of(g_slc, b), g_of(g_swa, b), cfg,
                              None if k_cmp is None else k_cmp[b], None if v_cmp is None else v_cmp[b],
                              None if block_indices is None else block_indices[b])
            outs.append(o_b)
            extras.append(ex)
        o = torch.stack(outs)
    else:
        csl = _cmp_slices(cu_seqlens, cfg.cmp_block, cfg.cmp_stride)
        outs = []
        last = 0
        for b, (s, e) in enumerate(seq_bounds(cu_seqlens)):
            sl = slice(s, e)
            o_b, ex = nsa_seq(q[sl], k[sl], v[sl], g_of(g_cmp, sl), g_of(g_slc, sl), g_of(g_swa, sl), cfg,
                              None if k_cmp is None else k_cmp[csl[b]], None if v_cmp is None else v_cmp[csl[b]],
                              None if block_indices is None else block_indices[sl])
            outs.append(o_b)
            extras.append(ex)
            last = e
        outs.append(q.new_zeros((q.shape[0] - last, q.shape[1], v.shape[-1])))
        o = torch.cat(outs)
    return (o, extras) if return_extras else o


def nsa_indices(q, k, v, config=None, k_cmp=None, cu_seqlens=None):
    """The selection NSA makes (batched [B, T, Hkv, n] or packed [N, Hkv, n]), computed in float64."""
    cfg = config_from(config)
    gate = q.new_ones(q.shape[:-1])
    _, extras = nsa_attention(q.detach(), k.detach(), v.detach(), None, gate, None, cfg,
                              None if k_cmp is None else k_cmp.detach(),
                              None if k_cmp is None else v.new_zeros(k_cmp.shape[:-1] + (v.shape[-1],)),
                              cu_seqlens=cu_seqlens, return_extras=True)
    parts = [ex["indices"] for ex in extras]
    if cu_seqlens is None:
        return torch.stack(parts)
    last = int(cu_seqlens[-1])
    parts.append(torch.full((q.shape[0] - last, k.shape[-2], cfg.num_selected), -1, dtype=torch.int32))
    return torch.cat(parts)
