"""The attention calls of a plan (:class:`.plan.AttentionCall`) as tensors: each call's queries and keys as views
of the rank's shard and key buffers, its row range in the key buffer, and its packed sequence bounds on the
tensors' device. Shared by every context-parallel operation (flash_attention, nsa_attention)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from .plan import AttentionCall, ContextPlan
from .ranges import offset_in


def int32_on(values: Sequence[int], device: torch.device) -> Tensor:
    """`values` as an int32 tensor on `device`; through pinned memory on CUDA, so that the copy does not wait for
    the device."""
    t = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    return t


def call_cu_seqlens(call: AttentionCall, device: torch.device) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The call's cu_seqlens of its queries and of its keys on `device` (None, None for the batched layout)."""
    if call.cu_seqlens_q is None:
        return None, None
    return int32_on(call.cu_seqlens_q, device), int32_on(call.cu_seqlens_k, device)


def call_key_rows(plan: ContextPlan, call: AttentionCall) -> tuple[int, int]:
    """The call's first row in the key buffer, and its key count."""
    return offset_in(plan.key_set, call.keys[0]), call.keys[1] - call.keys[0]


def call_query_rows(call: AttentionCall) -> tuple[int, int]:
    """The call's first row in the rank's shard, and its query count."""
    return call.q_rows[0], call.q_rows[1] - call.q_rows[0]


def call_views(plan: ContextPlan, call: AttentionCall, dim: int, q: Tensor, k_buffer: Tensor,
               v_buffer: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The call's queries (rows of the shard) and keys/values (rows of the key buffers), as views along the token
    dimension `dim`."""
    key_row, key_count = call_key_rows(plan, call)
    first, rows = call_query_rows(call)
    return (q.narrow(dim, first, rows), k_buffer.narrow(dim, key_row, key_count),
            v_buffer.narrow(dim, key_row, key_count))
