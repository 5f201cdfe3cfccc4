"""create_mask for CUDA tensors, with torch's stable sorts on the device (no C++ kernel, no host synchronisation).

The rule is docs/semantics.md's "create_mask": per row, the `keep` visible keys with the largest bias, ties to the
lower key index, NaN never kept, -inf an ordinary value. Two stable descending sorts give that order: first by
value (equal values keep their index order), then by visibility (the visible keys first, in the value order).
Values are compared in float64, as the CPU reference does. Rows are processed in chunks so that the sorts' index
tensors stay bounded.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

# Elements per sorted chunk: two int64 index tensors and a float64 copy of this many elements at a time.
_CHUNK_ELEMENTS = 1 << 25


def create_mask(bias: Tensor, key_padding_mask: Optional[Tensor], keep: int, causal: bool, window_left: int,
                window_right: int) -> Tensor:
    """bool [B, H, T, S]: the kept keys of every row of bias [B, H, T, S]."""
    batch, heads, rows, keys = bias.shape
    mask = torch.zeros(bias.shape, dtype=torch.bool, device=bias.device)
    if mask.numel() == 0:
        return mask
    step = max(1, _CHUNK_ELEMENTS // max(1, batch * heads * keys))
    s = torch.arange(keys, device=bias.device)
    ranks = torch.arange(keys, device=bias.device)
    for t0 in range(0, rows, step):
        t = torch.arange(t0, min(rows, t0 + step), device=bias.device)[:, None]
        aligned = t + keys - rows
        visible = torch.ones(t.shape[0], keys, dtype=torch.bool, device=bias.device)
        if causal:
            visible &= s <= aligned
        if window_left >= 0:
            visible &= s >= aligned - window_left
        if window_right >= 0:
            visible &= s <= aligned + window_right
        values = bias[:, :, t0:t0 + t.shape[0]].double()
        visible = visible.expand(values.shape) & ~torch.isnan(values)
        if key_padding_mask is not None:
            visible = visible & key_padding_mask[:, None, None, :]
        key = torch.where(visible, values, torch.full_like(values, -torch.inf))
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
        visible_first = torch.sort(visible.gather(-1, order).to(torch.int8), dim=-1, descending=True,
                                   stable=True).indices
        order = order.gather(-1, visible_first)
        kept = torch.zeros_like(visible)
        kept.scatter_(-1, order, (ranks < keep).expand_as(order))
        mask[:, :, t0:t0 + t.shape[0]] = kept & visible
    return mask
