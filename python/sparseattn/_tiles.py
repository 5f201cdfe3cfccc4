"""Tile-state maps of flash_attention's block-sparse masks, built with torch ops on the tensors' device.

The CUDA kernels read one dense map per call: uint8 [B|1, Hb|1, nQ, nK] with 0 = the tile is absent (neither
loaded nor computed), 1 = it exists, 2 = it exists and is full (the element mask is not read for its keys). This
module turns the other forms into that map without a host synchronisation:
- FlexAttention's lists (kv_num_blocks / kv_indices, and the full_ lists) are scattered into it;
- a batched element mask is summarised into it (a tile whose elements are all False becomes absent, one whose
  elements are all True becomes full), so that masked-out tiles are skipped even without a block-sparse mask;
- the gate threshold (docs/semantics.md section 8) decides per (query tile, key tile) pair from the ranges of alpha
  and delta over the pair, which is what a tile map says: the pairs it skips become absent.
On CUDA the list contents are not validated (that would need a host synchronisation): entries past a row's count
or outside [0, nK) are dropped. On the CPU the C++ API validates them.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

ABSENT, PRESENT, FULL = 0, 1, 2


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def from_lists(kv_num_blocks: Tensor, kv_indices: Tensor, full_kv_num_blocks: Optional[Tensor],
               full_kv_indices: Optional[Tensor], n_k: int) -> Tensor:
    """The tile-state map of FlexAttention's lists: uint8 [B|1, H|1, nQ, n_k] (the partial lists' leading dims)."""
    lead = torch.broadcast_shapes(kv_num_blocks.shape, kv_indices.shape[:-1])
    states = torch.zeros(*lead, n_k + 1, dtype=torch.uint8, device=kv_indices.device)
    for count, indices, value in ((kv_num_blocks, kv_indices, PRESENT), (full_kv_num_blocks, full_kv_indices, FULL)):
        if count is None or indices is None or indices.shape[-1] == 0:
            continue
        idx = indices.long().expand(*lead, indices.shape[-1])
        slots = torch.arange(indices.shape[-1], device=indices.device)
        valid = (slots < count.long().expand(lead)[..., None]) & (idx >= 0) & (idx < n_k)
        idx = torch.where(valid, idx, torch.full_like(idx, n_k))  # dropped entries land in the spare column
        values = torch.where(valid, torch.full_like(idx, value), torch.zeros_like(idx)).to(torch.uint8)
        states.scatter_reduce_(-1, idx, values, reduce="amax")
    return states[..., :n_k].contiguous()


def from_bool(block_mask: Tensor) -> Tensor:
    """A bool tile mask as a tile-state map (True: the tile exists, its element mask read)."""
    return block_mask.to(torch.uint8)


def from_mask(mask: Tensor, block_q: int, block_k: int, n_q: int, n_k: int) -> Tensor:
    """The summary of a batched element mask [B|1, H|1, T|1, S] in tiles of block_q x block_k: uint8
    [B|1, H|1, n_q, n_k], 0 where every element of the tile is False, 2 where every one is True, 1 otherwise.
    Elements past T or S count as neither (they are not computed)."""
    b, h, rows, keys = mask.shape
    row_tiles = 1 if rows == 1 else n_q
    row_block = rows if rows == 1 else block_q
    pad_rows = row_tiles * row_block - rows
    pad_keys = n_k * block_k - keys
    as_int = mask.to(torch.uint8)
    # any: pad with 0; all: pad with 1, so that padding changes neither.
    any_true = torch.nn.functional.pad(as_int, (0, pad_keys, 0, pad_rows), value=0)
    all_true = torch.nn.functional.pad(as_int, (0, pad_keys, 0, pad_rows), value=1)
    shape = (b, h, row_tiles, row_block, n_k, block_k)
    some = any_true.view(shape).amax(dim=(3, 5))
    every = all_true.view(shape).amin(dim=(3, 5))
    states = torch.where(every > 0, torch.full_like(some, FULL), some)  # some is 0 or 1
    return states.expand(b, h, n_q, n_k) if row_tiles == 1 else states


def combine(given: Tensor, summary: Tensor) -> Tensor:
    """The map of a block-sparse mask `given` and the summary of an element mask over the same tiles: a tile the
    user gives as absent or full keeps that state, one given as existing takes the summary's. Head dims of Hq
    and Hkv are matched by repeating each KV head over its group of query heads; dims of 1 broadcast."""
    hg, hs = given.shape[1], summary.shape[1]
    if hg != hs and 1 not in (hg, hs):
        if hg < hs:
            given = given.repeat_interleave(hs // hg, dim=1)
        else:
            summary = summary.repeat_interleave(hg // hs, dim=1)
    return torch.where(given == PRESENT, summary, given).contiguous()


def tile_counts(length: int, block: int) -> int:
    return _ceil_div(max(length, 0), block)


def _tile_ranges(x: Tensor, block: int, n: int, batch: int, cu_seqlens: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(min, max) of a gate tensor over tiles of `block` rows aligned to each sequence's first row: float64
    [batch, n, H] each; tiles without rows get +inf and -inf. x is [B, L, H] (batched) or [N, H] with cu_seqlens."""
    x = x.detach().to(torch.float64)
    if cu_seqlens is None:
        b, rows, heads = x.shape
        pad = n * block - rows
        if pad < 0:  # rows past the n tiles are not attended through this map
            x, pad = x[:, :n * block], 0
        low = torch.nn.functional.pad(x, (0, 0, 0, pad), value=float("inf"))
        high = torch.nn.functional.pad(x, (0, 0, 0, pad), value=float("-inf"))
        return low.view(b, n, block, heads).amin(2), high.view(b, n, block, heads).amax(2)
    rows, heads = x.shape
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
    index = torch.arange(rows, device=x.device)
    sequence = torch.searchsorted(cu, index, right=True) - 1
    tile = (index - cu[sequence.clamp(0, batch)]) // block
    valid = (sequence >= 0) & (sequence < batch) & (tile < n)
    slot = torch.where(valid, sequence * n + tile, torch.full_like(index, batch * n))[:, None].expand(rows, heads)
    low = torch.full((batch * n + 1, heads), float("inf"), dtype=torch.float64, device=x.device)
    high = torch.full((batch * n + 1, heads), float("-inf"), dtype=torch.float64, device=x.device)
    low.scatter_reduce_(0, slot, x, reduce="amin")
    high.scatter_reduce_(0, slot, x, reduce="amax")
    return low[:-1].view(batch, n, heads), high[:-1].view(batch, n, heads)


def from_gate_threshold(alpha: Tensor, delta: Tensor, threshold: float, product: bool, block_q: int, block_k: int,
                        n_q: int, n_k: int, batch: int, cu_seqlens_q: Optional[Tensor] = None,
                        cu_seqlens_k: Optional[Tensor] = None) -> Tensor:
    """The gate threshold's decisions as a tile-state map, uint8 [batch, Hq, n_q, n_k]: 1 where the pair's upper
    bound on g reaches the threshold (logsigmoid or the product of max(amin dmin, amin dmax, amax dmin, amax dmax)
    over the query tile's alpha of head h and the key tile's delta of head h / G, every key of the tile counted), 0
    where the pair is skipped; in float64 as the CPU reference. alpha is [B, T, Hq] / packed [Nq, Hq], delta
    [B, S, Hkv] / packed [Nk, Hkv] (packed: with cu_seqlens_q and cu_seqlens_k)."""
    a_min, a_max = _tile_ranges(alpha, block_q, n_q, batch, cu_seqlens_q)
    d_min, d_max = _tile_ranges(delta, block_k, n_k, batch, cu_seqlens_k)
    group = alpha.shape[-1] // delta.shape[-1]
    a_min, a_max = (t.permute(0, 2, 1)[..., :, None] for t in (a_min, a_max))  # [B, Hq, n_q, 1]
    d_min, d_max = (t.repeat_interleave(group, dim=2).permute(0, 2, 1)[..., None, :] for t in (d_min, d_max))
    bound = torch.maximum(torch.maximum(a_min * d_min, a_min * d_max), torch.maximum(a_max * d_min, a_max * d_max))
    g = bound if product else torch.nn.functional.logsigmoid(bound)
    return (g >= threshold).to(torch.uint8).contiguous()


def keep_where(states: Tensor, kept: Tensor) -> Tensor:
    """A tile-state map with the pairs that `kept` (uint8 [B, Hq, n_q, n_k], 0 = skipped) skips made absent; the
    others keep their state. `states` may have 1, Hkv or Hq heads and a batch of 1 (broadcast); tiles past kept's
    keep their state."""
    batch, heads = kept.shape[0], kept.shape[1]
    if states.dim() != 4 or states.shape[0] not in (1, batch) or heads % states.shape[1] != 0:
        return states  # a map of the wrong shape: the C++ API reports it
    if states.shape[1] not in (1, heads):
        states = states.repeat_interleave(heads // states.shape[1], dim=1)
    n_q, n_k = min(kept.shape[-2], states.shape[-2]), min(kept.shape[-1], states.shape[-1])
    kept = kept[..., :n_q, :n_k]
    states = states.expand(batch, heads, *states.shape[-2:]).clone()
    region = states[..., :n_q, :n_k]
    states[..., :n_q, :n_k] = torch.where(kept > 0, region, torch.zeros_like(region))
    return states.contiguous()
