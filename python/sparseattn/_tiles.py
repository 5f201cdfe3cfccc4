"""Tile-state maps of flash_attention's block-sparse masks, built with torch ops on the tensors' device.

The CUDA kernels read one dense map per call: uint8 [B|1, Hb|1, nQ, nK] with 0 = the tile is absent (neither
loaded nor computed), 1 = it exists, 2 = it exists and is full (the element mask is not read for its keys). This
module turns the other forms into that map without a host synchronisation:
- FlexAttention's lists (kv_num_blocks / kv_indices, and the full_ lists) are scattered into it;
- a batched element mask is summarised into it (a tile whose elements are all False becomes absent, one whose
  elements are all True becomes full), so that masked-out tiles are skipped even without a block-sparse mask.
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
