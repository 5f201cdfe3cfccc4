"""The plan of one context-parallel attention call, made on the host from sizes alone (the same on every rank):
which queries each rank's chunks hold, which keys they see, which attention calls compute them, and which rows
travel between which ranks in the exchange of K/V (forward) and in the reduction of dK/dV (backward).

Rows are named three ways: *global* positions of the sequence (or packed stream); *local* rows of a rank's shard
(its chunks back to back, :mod:`.sharding`); and *key-buffer* rows, the compact buffer in which a rank holds the
keys it needs (its key set, a range set, back to back; :mod:`.ranges`).

Exchange methods:

- ``"all_gather"``: stage i all-gathers chunk i of every rank (padded to the longest), so after all stages every
  rank has the whole sequence and copies out the keys it needs. Used when a query's reach is unbounded.
- ``"all_to_all"``: stage i sends each rank exactly the keys its chunk i needs that earlier stages did not bring
  (from each owner, in ascending position). Used when a window bounds the reach: a rank then receives its
  chunks' keys plus the window's halo before them, not the sequence.

Chunk i of a rank waits for the first stage after which all its keys have arrived, so the later stages overlap
the earlier chunks' attention (zigzag causal: chunk r needs only the first half of the sequence, which stage 0
brings).

The reduction sends every rank's dK/dV partial (over its key set) to the owners of those keys in one
all_to_all; owner o adds what it receives in sender-rank order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

from . import ranges as rs
from .documents import KeyReach, pieces
from .ranges import Range, RangeSet
from .sharding import shard_ranges

METHODS = ("all_gather", "all_to_all")

# (source row, destination row, number of rows): a run of rows copied from one buffer into another
Segment = tuple[int, int, int]


@dataclass(frozen=True)
class AttentionCall:
    """One sparseattn.flash_attention call of a chunk: the local query rows ``q_rows``, the global keys ``keys``
    (a range inside the key set), the packed pieces' cu_seqlens (relative; None for the batched layout) and
    maxima, and the window shifted so that bottom-right alignment puts each query at its global position."""

    q_rows: Range
    keys: Range
    cu_seqlens_q: Optional[tuple[int, ...]]
    cu_seqlens_k: Optional[tuple[int, ...]]
    max_seqlen_q: int
    max_seqlen_k: int
    window: tuple[int, int]


@dataclass(frozen=True)
class ChunkPlan:
    """A chunk of this rank: its global queries, the keys they see (a range, possibly empty), its calls, and the
    last exchange stage it waits for (-1: none)."""

    queries: Range
    keys: Range
    calls: tuple[AttentionCall, ...]
    stage: int


@dataclass(frozen=True)
class Transfer:
    """One collective that moves token rows between the ranks, from this rank's point of view.

    ``send_counts[r]`` rows go to rank r, cut from the source buffer by ``send_segments`` (source row, row in the
    send buffer, count), in rank order; ``recv_counts[s]`` rows come from rank s; ``recv_segments`` copy runs of
    the receive buffer into the destination buffer, in sender-rank order. For an all_gather, ``send_counts`` is
    the padded row count every rank contributes (the same for all ranks). ``active`` is False when no rank
    moves any row: then no rank issues the collective (a decision every rank makes alike).
    """

    method: str
    active: bool
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    send_segments: tuple[Segment, ...]
    recv_segments: tuple[Segment, ...]


@dataclass(frozen=True)
class ContextPlan:
    """Everything rank `rank` needs to run its part of a context-parallel attention call."""

    rank: int
    world_size: int
    total: int
    layout: str
    method: str
    local_length: int
    key_set: RangeSet
    chunks: tuple[ChunkPlan, ...]
    stages: tuple[Transfer, ...]
    reduction: Transfer

    @property
    def key_rows(self) -> int:
        """Rows of the key buffer."""
        return rs.length(self.key_set)


def choose_method(exchange: str, causal: bool, window: tuple[int, int]) -> str:
    """``"auto"``: all_to_all when a window bounds how far a query looks back (and, without causal, ahead), else
    all_gather; any other value is taken as given."""
    if exchange != "auto":
        return exchange
    reach = KeyReach.of(causal, window)
    return "all_to_all" if reach.left is not None and reach.right is not None else "all_gather"


@functools.lru_cache(maxsize=256)
def make_plan(total: int, world_size: int, rank: int, layout: str, cu: Optional[tuple[int, ...]], causal: bool,
              window: tuple[int, int], method: str) -> ContextPlan:
    """The plan of rank `rank` (see the module docstring). `cu` is the host cu_seqlens of a packed stream, None
    for the batched layout (one document per row, of `total` tokens)."""
    docs = cu if cu is not None else (0, total)
    reach = KeyReach.of(causal, window)
    aligned = causal or window[0] >= 0 or window[1] >= 0
    chunk_ranges = [shard_ranges(total, world_size, r, layout) for r in range(world_size)]
    held = [rs.normalize(c) for c in chunk_ranges]
    chunk_pieces = [[pieces(docs, start, end, reach) for start, end in chunk_ranges[r]] for r in range(world_size)]
    chunk_keys = [[(p[0].k_start, p[-1].k_end) if p else (start, start)
                   for p, (start, _) in zip(chunk_pieces[r], chunk_ranges[r])] for r in range(world_size)]
    key_sets = [rs.normalize(keys) for keys in chunk_keys]

    stages, delivered = _stages(method, rank, world_size, chunk_ranges, held, chunk_keys, key_sets)
    chunks = []
    local_start = 0
    for i, (start, end) in enumerate(chunk_ranges[rank]):
        keys = chunk_keys[rank][i]
        calls = _calls(chunk_pieces[rank][i], start - local_start, cu is not None, aligned, window)
        chunks.append(ChunkPlan((start, end), keys, calls, _first_stage_with(keys, delivered)))
        local_start += end - start
    reduction = _reduction(rank, world_size, held, key_sets)
    return ContextPlan(rank, world_size, total, layout, method, local_start, key_sets[rank], tuple(chunks),
                       tuple(stages), reduction)


def _first_stage_with(keys: Range, delivered: list[RangeSet]) -> int:
    """The first stage after which every key of `keys` has arrived (-1 for no keys)."""
    if keys[1] <= keys[0]:
        return -1
    have: RangeSet = ()
    for stage, arrived in enumerate(delivered):
        have = rs.normalize(have + arrived)
        if rs.covers(have, (keys,)):
            return stage
    raise AssertionError(f"the exchange never brings the keys {keys}")


def _calls(chunk_pieces, local_offset: int, packed: bool, aligned: bool,
           window: tuple[int, int]) -> tuple[AttentionCall, ...]:
    """The calls of a chunk: its consecutive pieces of equal alignment shift share a call (all of them when no
    causal rule or window makes the alignment matter). `local_offset` maps global query positions to local rows."""
    groups: list[list] = []
    for piece in chunk_pieces:
        if groups and (not aligned or groups[-1][-1].shift == piece.shift):
            groups[-1].append(piece)
        else:
            groups.append([piece])
    calls = []
    for group in groups:
        shift = group[0].shift if aligned else 0
        left = window[0] + shift if window[0] >= 0 else window[0]
        right = window[1] - shift if window[1] >= 0 else window[1]
        cu_q, cu_k = (0,), (0,)
        for piece in group:
            cu_q += (cu_q[-1] + piece.q_end - piece.q_start,)
            cu_k += (cu_k[-1] + piece.k_end - piece.k_start,)
        calls.append(AttentionCall(
            q_rows=(group[0].q_start - local_offset, group[-1].q_end - local_offset),
            keys=(group[0].k_start, group[-1].k_end),
            cu_seqlens_q=cu_q if packed else None,
            cu_seqlens_k=cu_k if packed else None,
            max_seqlen_q=max(p.q_end - p.q_start for p in group),
            max_seqlen_k=max(p.k_end - p.k_start for p in group),
            window=(left, right)))
    return tuple(calls)


def _stages(method, rank, world_size, chunk_ranges, held, chunk_keys, key_sets):
    """The exchange stages of `rank` and, per stage, the global ranges it brings to this rank."""
    num_chunks = len(chunk_ranges[rank])
    stages, delivered = [], []
    for i in range(num_chunks):
        if method == "all_gather":
            sources = [rs.normalize([chunk_ranges[s][i]]) for s in range(world_size)]
            padded = max(rs.length(src) for src in sources)
            recv_segments = []
            for s, src in enumerate(sources):
                for start, end in rs.intersect(src, key_sets[rank]):
                    recv_segments.append((s * padded + start - src[0][0], rs.offset_in(key_sets[rank], start),
                                          end - start))
            mine = sources[rank]
            send = ((rs.offset_in(held[rank], mine[0][0]), 0, rs.length(mine)),) if mine else ()
            stages.append(Transfer(method, padded > 0, (padded,) * world_size, (padded,) * world_size, send,
                                   tuple(recv_segments)))
            delivered.append(rs.normalize(r for src in sources for r in src))
        else:
            def new_keys(r):
                return rs.subtract(rs.normalize([chunk_keys[r][i]]), rs.normalize(chunk_keys[r][:i]))

            wanted = [new_keys(r) for r in range(world_size)]
            send_counts, send_segments, row = [], [], 0
            for r in range(world_size):
                runs = rs.intersect(held[rank], wanted[r])
                for start, end in runs:
                    send_segments.append((rs.offset_in(held[rank], start), row, end - start))
                    row += end - start
                send_counts.append(rs.length(runs))
            recv_counts, recv_segments, row = [], [], 0
            for s in range(world_size):
                runs = rs.intersect(held[s], wanted[rank])
                for start, end in runs:
                    recv_segments.append((row, rs.offset_in(key_sets[rank], start), end - start))
                    row += end - start
                recv_counts.append(rs.length(runs))
            active = any(rs.intersect(held[s], wanted[r]) for s in range(world_size) for r in range(world_size))
            stages.append(Transfer(method, active, tuple(send_counts), tuple(recv_counts), tuple(send_segments),
                                   tuple(recv_segments)))
            delivered.append(wanted[rank])
    return stages, delivered


def _reduction(rank, world_size, held, key_sets) -> Transfer:
    """The all_to_all of the backward: this rank sends the rows of its key buffer that rank o holds to rank o,
    and adds what rank s sends it onto its local rows."""
    send_counts, send_segments, row = [], [], 0
    for owner in range(world_size):
        runs = rs.intersect(key_sets[rank], held[owner])
        for start, end in runs:
            send_segments.append((rs.offset_in(key_sets[rank], start), row, end - start))
            row += end - start
        send_counts.append(rs.length(runs))
    recv_counts, recv_segments, row = [], [], 0
    for sender in range(world_size):
        runs = rs.intersect(key_sets[sender], held[rank])
        for start, end in runs:
            recv_segments.append((row, rs.offset_in(held[rank], start), end - start))
            row += end - start
        recv_counts.append(rs.length(runs))
    active = any(rs.intersect(key_sets[s], held[o]) for s in range(world_size) for o in range(world_size))
    return Transfer("all_to_all", active, tuple(send_counts), tuple(recv_counts), tuple(send_segments),
                    tuple(recv_segments))
