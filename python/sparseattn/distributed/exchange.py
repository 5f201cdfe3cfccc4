"""Running a plan's transfers (:mod:`.plan`): the exchange of K/V into each rank's key buffer (forward) and the
reduction of dK/dV partials onto their owners (backward).

Collectives move token-major buffers ([rows, ...], the token dimension first), so the same code serves the
batched layout (tokens at dim 1) and the packed one (dim 0). Every collective is issued with async_op=True;
:class:`KeyExchange` waits for a stage only when a chunk needs its keys.

A ring exchange (each rank passing key blocks to its neighbour while it computes) would replace KeyExchange and
the chunk loop that waits on it; the plan's key sets, the per-chunk calls and :func:`reduce_to_owners` stay.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .plan import ContextPlan, Segment, Transfer


def _pack(source: Tensor, segments: Sequence[Segment], rows: int, dim: int) -> Tensor:
    """A token-major send buffer of `rows` rows holding the runs `segments` of `source` (rows outside the runs are
    padding, never read); a view of `source` where one run is the whole buffer and needs no reordering."""
    if dim == 0 and len(segments) == 1 and segments[0][1] == 0 and segments[0][2] == rows:
        view = source.narrow(0, segments[0][0], rows)
        if view.is_contiguous():
            return view
    shape = (rows,) + tuple(s for i, s in enumerate(source.shape) if i != dim)
    out = source.new_empty(shape)
    for src, dst, count in segments:
        out[dst:dst + count] = source.narrow(dim, src, count).movedim(dim, 0)
    return out


def _start(transfer: Transfer, source: Tensor, dim: int, group) -> tuple[Optional[dist.Work], Tensor, Tensor]:
    """Issues the collective of `transfer` for `source` (async); returns (work, send buffer, receive buffer)."""
    send = _pack(source, transfer.send_segments, sum(transfer.send_counts) if transfer.method == "all_to_all"
                 else transfer.send_counts[0], dim)
    recv = send.new_empty((sum(transfer.recv_counts),) + tuple(send.shape[1:]))
    if transfer.method == "all_gather":
        work = dist.all_gather_into_tensor(recv, send, group=group, async_op=True)
    else:
        work = dist.all_to_all_single(recv, send, list(transfer.recv_counts), list(transfer.send_counts),
                                      group=group, async_op=True)
    return work, send, recv


class KeyExchange:
    """The exchange of a rank's K and V (or any tensors laid out like them) into its key buffers: every stage's
    collectives are issued at construction (stage 0's K, its V, stage 1's K, ...); :meth:`wait` blocks for the
    stages a chunk needs and copies their rows into place."""

    def __init__(self, plan: ContextPlan, tensors: Sequence[Tensor], dim: int, group):
        self.plan, self.dim = plan, dim
        self.buffers = []
        for t in tensors:
            shape = list(t.shape)
            shape[dim] = plan.key_rows
            self.buffers.append(t.new_empty(shape))
        self._pending = []
        for transfer in plan.stages:
            self._pending.append(None if not transfer.active else [_start(transfer, t, dim, group) for t in tensors])
        self._done = -1

    def wait(self, stage: int) -> list[Tensor]:
        """The key buffers, with the rows of every stage up to `stage` in place."""
        while self._done < stage:
            self._done += 1
            started = self._pending[self._done]
            if started is None:
                continue
            segments = self.plan.stages[self._done].recv_segments
            for (work, _send, recv), buffer in zip(started, self.buffers):
                work.wait()
                _unpack_copy(recv, buffer, segments, self.dim)
            self._pending[self._done] = None
        return self.buffers


def _unpack_copy(recv: Tensor, buffer: Tensor, segments: Sequence[Segment], dim: int) -> None:
    for src, dst, count in segments:
        buffer.narrow(dim, dst, count).copy_(recv[src:src + count].movedim(0, dim))


def reduce_to_owners(partials: Sequence[Tensor], plan: ContextPlan, dim: int, group,
                     dtype: torch.dtype) -> list[Tensor]:
    """Sums the ranks' partials over their key sets onto the owners of the keys: returns, for each partial (laid
    out like a key buffer), this rank's shard of the sum, in `dtype`.

    One all_to_all per partial sends each owner the rows it holds (bytes moved, no arithmetic); each owner then
    adds what it received in sender-rank order, 0 to R-1, in the partials' dtype. The sum of every element thus
    has one fixed order, whatever the backend, network or timing: the result is bit-identical run to run. (A
    reduce_scatter would move the same bytes, but its summation order is the backend's choice: NCCL's depends on
    its algorithm, channels and topology.)
    """
    transfer = plan.reduction
    started = [None if not transfer.active else _start(transfer, p, dim, group) for p in partials]
    out = []
    for partial, entry in zip(partials, started):
        shape = list(partial.shape)
        shape[dim] = plan.local_length
        total = partial.new_zeros(shape)
        if entry is not None:
            work, _send, recv = entry
            work.wait()
            for src, dst, count in transfer.recv_segments:
                total.narrow(dim, dst, count).add_(recv[src:src + count].movedim(0, dim))
        out.append(total.to(dtype))
    return out
