"""A chunked PyTorch implementation of NSA for long sequences: the float32 reference of test_cuda_nsa_long.py.

The semantics are naive_nsa.py's (docs/semantics.md), but the queries are processed in chunks and no tensor of
size T x T is ever built: compressed attention of a chunk sees the Tc compressed keys, selected attention
gathers only the n * l' keys of each query's selected blocks, and the sliding window only the w - 1 keys
before the chunk. Every chunk runs under torch.utils.checkpoint, so the backward holds the intermediates of
one chunk at a time. Batched layout only ([B, T, H, D]).

Precision:
- the attention math runs in ``compute_dtype``: float32 for the reference, bfloat16 for "torch in the input
  precision" (the yardstick of the error bounds);
- the gradient contributions of the chunks are summed in the dtype of the inputs, so pass float32 leaves
  (holding the bf16 values) to sum them in float32 whatever ``compute_dtype`` is;
- compressed K/V are means computed in float64 and rounded once to ``storage_dtype`` (the dtype the data is
  stored in), exactly as compress_kv specifies, so the reference computes the function the library computes
  and its block selection can be compared with the library's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from naive_nsa import config_from, default_scale, num_selection_blocks

NEG_INF = float("-inf")


@dataclass
class Result:
    """o [B, T, Hq, Dv] in compute_dtype; log-sum-exps [B, Hq, T] (float32, float64 when computing in float64)
    of each computed branch (None for a skipped one)."""

    o: torch.Tensor
    lse_cmp: Optional[torch.Tensor]
    lse_slc: Optional[torch.Tensor]
    lse_swa: Optional[torch.Tensor]


@dataclass
class Selection:
    """The reference's own top-n selection.

    indices: int32 [B, T, Hkv, n] (ascending, -1 padded). scores: [B, Hkv, T, nsel] in compute_dtype (the
    layout of naive_nsa.selection_scores). margin: float64 [B, T, Hkv], (a - b) / a with a the score of the
    weakest block chosen by score and b the score of the best candidate left out; inf where no candidate
    competes for the last slot (every chosen block is forced, or every candidate is chosen).
    """

    indices: torch.Tensor
    scores: torch.Tensor
    margin: torch.Tensor


# ------------------------------------------------------------------------------------------------ pieces


def compress(x: torch.Tensor, block: int, stride: int, storage_dtype: torch.dtype) -> torch.Tensor:
    """Mean of x [T, H, D] over tokens [j*stride, j*stride + block), in float64, rounded to storage_dtype,
    returned in x's dtype: [Tc, H, D]. Differentiable (the rounding passes the gradient through)."""
    if x.shape[0] < block:
        return x[:0] * 1.0
    means = x.double().unfold(0, block, stride).mean(dim=-1)  # [Tc, H, D]
    # Not means.to(storage_dtype) alone: its backward would round the gradient to storage_dtype too.
    rounded = means + (means.to(storage_dtype).double() - means).detach()
    return rounded.to(x.dtype)


def overlap_weights(tc: int, nsel: int, cmp_block: int, cmp_stride: int, sel_block: int,
                    device=None) -> torch.Tensor:
    """W[j, b] = |[j*d, j*d + l) ∩ [b*l', (b+1)*l')| / d as float64 [Tc, nsel] (small integers / d: exact)."""
    start = torch.arange(tc, device=device, dtype=torch.float64)[:, None] * cmp_stride
    sel_start = torch.arange(nsel, device=device, dtype=torch.float64)[None, :] * sel_block
    overlap = torch.minimum(start + cmp_block, sel_start + sel_block) - torch.maximum(start, sel_start)
    return overlap.clamp_min(0) / cmp_stride


def _masked_softmax(s: torch.Tensor, keep: torch.Tensor):
    """Softmax of scores s [..., L] over the kept keys. Returns p (0 on a row without a kept key) and the
    log-sum-exp in float32 or wider (-inf on such a row)."""
    lse_dtype = torch.promote_types(s.dtype, torch.float32)
    if s.shape[-1] == 0:
        return s, torch.full(s.shape[:-1], NEG_INF, device=s.device, dtype=lse_dtype)
    s = s.masked_fill(~keep, NEG_INF)
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    nonempty = denom > 0
    p = e / torch.where(nonempty, denom, torch.ones_like(denom))
    lse = torch.where(nonempty, m.to(lse_dtype) + torch.log(denom.detach().to(lse_dtype)), NEG_INF).squeeze(-1)
    return p, lse


def _heads_last(lse: torch.Tensor) -> torch.Tensor:
    """[C, Hkv, G] -> [Hq, C]."""
    return lse.flatten(1).transpose(0, 1)


def _compressed_probabilities(q, k_cmp, positions, cfg, scale):
    """q [C, Hkv, G, D] at token positions [C]; k_cmp [Tc, Hkv, D]. Returns p [C, Hkv, G, Tc] and lse
    [C, Hkv, G] of the blocks that have ended (j*d + l - 1 <= t)."""
    block_end = torch.arange(k_cmp.shape[0], device=q.device) * cfg.cmp_stride + cfg.cmp_block - 1
    keep = (block_end[None, :] <= positions[:, None])[:, None, None, :]
    s = torch.einsum("chgd,jhd->chgj", q, k_cmp) * scale
    return _masked_softmax(s, keep)


def _compressed_branch(q, k_cmp, v_cmp, positions, cfg, scale):
    p, lse = _compressed_probabilities(q, k_cmp, positions, cfg, scale)
    return torch.einsum("chgj,jhd->chgd", p, v_cmp), lse


def _selected_branch(q, k, v, indices, positions, cfg, scale):
    """Attention to the tokens <= t of the listed blocks, gathered per query: indices [C, Hkv, n]."""
    offsets = torch.arange(cfg.sel_block, device=q.device)
    token = (indices.long()[..., None] * cfg.sel_block + offsets).flatten(2)  # [C, Hkv, n * l']
    listed = (indices >= 0)[..., None].expand(*indices.shape, cfg.sel_block).flatten(2)
    keep = listed & (token <= positions[:, None, None])
    token = torch.where(keep, token, torch.zeros_like(token))
    head = torch.arange(k.shape[1], device=q.device)[None, :, None]
    k_sel, v_sel = k[token, head], v[token, head]  # [C, Hkv, n * l', D]
    s = torch.einsum("chgd,chld->chgl", q, k_sel) * scale
    p, lse = _masked_softmax(s, keep[:, :, None, :])
    return torch.einsum("chgl,chld->chgd", p, v_sel), lse


def _window_branch(q, k, v, t0, positions, cfg, scale):
    """Attention to keys [t - w + 1, t], reading only keys [t0 - w + 1, t1) of the chunk."""
    lo = max(0, t0 - cfg.window + 1)
    hi = t0 + q.shape[0]
    key_pos = torch.arange(lo, hi, device=q.device)
    keep = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - cfg.window)
    s = torch.einsum("chgd,lhd->chgl", q, k[lo:hi]) * scale
    p, lse = _masked_softmax(s, keep[:, None, None, :])
    return torch.einsum("chgl,lhd->chgd", p, v[lo:hi]), lse


def _nsa_chunk(t0, q, k, v, k_cmp, v_cmp, indices, g_cmp, g_slc, g_swa, cfg, scale, compute_dtype):
    """Queries [t0, t0 + C) of one sequence. Returns o [C, Hq, Dv] and the lse [Hq, C] of each computed branch."""
    C, Hq, _ = q.shape
    Hkv = k.shape[1]
    positions = torch.arange(t0, t0 + C, device=q.device)
    q, k, v, k_cmp, v_cmp = (x.to(compute_dtype) for x in (q, k, v, k_cmp, v_cmp))
    q = q.unflatten(1, (Hkv, Hq // Hkv))
    o = 0
    lse_cmp = lse_slc = lse_swa = None
    if g_cmp is not None:
        o_cmp, lse_cmp = _compressed_branch(q, k_cmp, v_cmp, positions, cfg, scale)
        o = o + g_cmp.to(compute_dtype)[..., None] * o_cmp.flatten(1, 2)
    if g_slc is not None:
        o_slc, lse_slc = _selected_branch(q, k, v, indices, positions, cfg, scale)
        o = o + g_slc.to(compute_dtype)[..., None] * o_slc.flatten(1, 2)
    if g_swa is not None:
        o_swa, lse_swa = _window_branch(q, k, v, t0, positions, cfg, scale)
        o = o + g_swa.to(compute_dtype)[..., None] * o_swa.flatten(1, 2)
    return o, *(None if lse is None else _heads_last(lse.detach()) for lse in (lse_cmp, lse_slc, lse_swa))


def _top_n(scores, positions, cfg):
    """Top-n selection of scores [C, Hkv, nsel] for queries at positions [C]: candidates
    b * l' <= t, forced initial and local blocks, the rest by score with ties to the lower index.
    Returns int32 indices [C, Hkv, n] and the relative margin [C, Hkv] (see Selection)."""
    C, Hkv, nsel = scores.shape
    n = cfg.num_selected
    block = torch.arange(nsel, device=scores.device)[None, :]
    current = (positions // cfg.sel_block)[:, None]
    candidate = block <= current
    forced = candidate & ((block < cfg.num_init) | (block > current - cfg.num_local))
    key = scores.double().masked_fill(forced[:, None], math.inf).masked_fill(~candidate[:, None], NEG_INF)
    # Stable descending sort: equal scores keep ascending block order, so ties go to the lower index.
    ranked, order = torch.sort(key, dim=-1, descending=True, stable=True)
    count = candidate.sum(dim=-1).clamp(max=n)[:, None]  # [C, 1]
    if nsel < n:
        order = torch.cat([order, order.new_full((C, Hkv, n - nsel), nsel)], dim=-1)
    ranked = torch.cat([ranked, ranked.new_full((C, Hkv, 1), NEG_INF)], dim=-1)  # the first left out may be none
    slot = torch.arange(n, device=scores.device)
    chosen = torch.where(slot < count[..., None], order[..., :n], nsel)
    indices = torch.sort(chosen, dim=-1).values
    indices = torch.where(indices == nsel, -1, indices).to(torch.int32)

    last_in = ranked.gather(-1, (count - 1).clamp_min(0)[..., None].expand(C, Hkv, 1)).squeeze(-1)
    first_out = ranked.gather(-1, count[..., None].expand(C, Hkv, 1)).squeeze(-1)
    competing = torch.isfinite(last_in) & torch.isfinite(first_out)
    margin = (last_in - first_out) / torch.where(last_in > 0, last_in, torch.ones_like(last_in))
    return indices, torch.where(competing, margin, math.inf)


# --------------------------------------------------------------------------------------------- public API


def _chunks(T: int, chunk: int):
    return [(t0, min(T, t0 + chunk)) for t0 in range(0, T, chunk)]


def reference_selection(q, k, config=None, *, storage_dtype: Optional[torch.dtype] = None, chunk: int = 256,
                        compute_dtype: torch.dtype = torch.float32) -> Selection:
    """The top-n block selection NSA makes for q [B, T, Hq, D] and k [B, T, Hkv, D] (no gradient)."""
    cfg = config_from(config)
    storage_dtype = k.dtype if storage_dtype is None else storage_dtype
    scale = default_scale(q.shape[-1], cfg.scale)
    B, T, Hq, _ = q.shape
    Hkv = k.shape[2]
    nsel = num_selection_blocks(T, cfg.sel_block)
    indices, scores, margins = [], [], []
    with torch.no_grad():
        for b in range(B):
            k_cmp = compress(k[b], cfg.cmp_block, cfg.cmp_stride, storage_dtype).to(compute_dtype)
            weights = overlap_weights(k_cmp.shape[0], nsel, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, q.device)
            parts = []
            for t0, t1 in _chunks(T, chunk):
                positions = torch.arange(t0, t1, device=q.device)
                q_c = q[b, t0:t1].to(compute_dtype).unflatten(1, (Hkv, Hq // Hkv))
                p, _ = _compressed_probabilities(q_c, k_cmp, positions, cfg, scale)
                chunk_scores = p.sum(dim=2) @ weights.to(p.dtype)  # [C, Hkv, nsel]
                parts.append((chunk_scores, *_top_n(chunk_scores, positions, cfg)))
            scores.append(torch.cat([s for s, _, _ in parts]).permute(1, 0, 2))
            indices.append(torch.cat([i for _, i, _ in parts]))
            margins.append(torch.cat([m for _, _, m in parts]))
    return Selection(torch.stack(indices), torch.stack(scores), torch.stack(margins))


def nsa_reference(q, k, v, g_cmp=None, g_slc=None, g_swa=None, config=None, *,
                  block_indices: Optional[torch.Tensor] = None, compute_dtype: torch.dtype = torch.float32,
                  storage_dtype: Optional[torch.dtype] = None, chunk: int = 256) -> Result:
    """NSA of batched q [B, T, Hq, Dqk], k [B, T, Hkv, Dqk], v [B, T, Hkv, Dv] and gates [B, T, Hq] (None:
    branch skipped), differentiable w.r.t. q, k, v and the gates. ``block_indices`` [B, T, Hkv, n]: the
    selection to use (default: the reference's own, see reference_selection)."""
    cfg = config_from(config)
    storage_dtype = k.dtype if storage_dtype is None else storage_dtype
    scale = default_scale(q.shape[-1], cfg.scale)
    if g_slc is not None and block_indices is None:
        block_indices = reference_selection(q, k, cfg, storage_dtype=storage_dtype, chunk=chunk,
                                            compute_dtype=torch.promote_types(compute_dtype, torch.float32)).indices
    B, T = q.shape[:2]
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g_cmp, g_slc, g_swa))
    outputs = []
    for b in range(B):
        k_cmp = compress(k[b], cfg.cmp_block, cfg.cmp_stride, storage_dtype)
        v_cmp = compress(v[b], cfg.cmp_block, cfg.cmp_stride, storage_dtype)
        chunks = []
        for t0, t1 in _chunks(T, chunk):
            args = (t0, q[b, t0:t1], k[b], v[b], k_cmp, v_cmp,
                    None if block_indices is None else block_indices[b, t0:t1],
                    *(None if g is None else g[b, t0:t1] for g in (g_cmp, g_slc, g_swa)), cfg, scale, compute_dtype)
            if needs_grad:
                chunks.append(checkpoint(_nsa_chunk, *args, use_reentrant=False))
            else:
                chunks.append(_nsa_chunk(*args))
        o = torch.cat([c[0] for c in chunks])
        lses = [None if chunks[0][i] is None else torch.cat([c[i] for c in chunks], dim=1) for i in (1, 2, 3)]
        outputs.append((o, *lses))
    stacked = [None if outputs[0][i] is None else torch.stack([out[i] for out in outputs]) for i in range(4)]
    return Result(*stacked)
