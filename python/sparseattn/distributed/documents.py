"""Packed documents under context parallelism: the host copy of cu_seqlens, and the cut of a range of queries
into per-document pieces, each with the keys its queries can see.

cu_seqlens describes the *global* packed stream (the same on every rank); a document may start on one rank and
end on another. Tokens past cu_seqlens[-1] belong to no document (their output is 0, as in
sparseattn.flash_attention). The batched layout is one document [0, T) per batch row.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from .. import _checks as chk
from .._errors import SparseAttnDTypeError, SparseAttnError, make_error


def host_cu_seqlens(op: str, arg: str, cu) -> Optional[tuple[int, ...]]:
    """cu_seqlens as a tuple of ints, from a CPU int32 tensor [B+1] or a list/tuple of ints; None stays None.

    Raises:
        SparseAttnError: a CUDA tensor (it would cost a device synchronisation; pass the host copy), a shape other
            than [B+1], a first entry other than 0, decreasing entries.
        SparseAttnTypeError / SparseAttnDTypeError: not a tensor or a sequence of ints; not int32.
    """
    if cu is None:
        return None
    if isinstance(cu, Tensor):
        chk.tensor_arg(op, arg, cu, kind="int32")
        if cu.device.type != "cpu":
            raise make_error(SparseAttnError, "device", op, arg,
                             f"is on {cu.device}; pass the host copy (a CPU int32 tensor or a list of ints, the same "
                             f"on every rank): the plan of the call is made on the host")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise make_error(SparseAttnError, "shape", op, arg, f"expected shape [B+1], got {list(cu.shape)}")
        values = tuple(int(x) for x in cu.tolist())
    elif isinstance(cu, (list, tuple)):
        for item in cu:
            if not chk.is_int(item):
                raise chk.type_error(op, arg, "a CPU int32 tensor or a list of ints", cu)
        if len(cu) < 1:
            raise make_error(SparseAttnError, "shape", op, arg, "expected B+1 >= 1 entries, got none")
        values = tuple(int(x) for x in cu)
        if any(not chk.INT32_MAX >= x >= -chk.INT32_MAX - 1 for x in values):
            raise make_error(SparseAttnDTypeError, "dtype", op, arg, "has an entry outside int32")
    else:
        raise chk.type_error(op, arg, "a CPU int32 tensor, a list of ints or None", cu)
    if values[0] != 0:
        raise make_error(SparseAttnError, "value", op, arg, f"must start at 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise make_error(SparseAttnError, "value", op, arg,
                             f"must be non-decreasing (entry {i}: {values[i]} after {values[i - 1]})")
    return values


@dataclass(frozen=True)
class KeyReach:
    """How far from its aligned position a query looks: `left` keys before and `right` keys after (None:
    unbounded, to the edge of its document). Causal attention has right = 0."""

    left: Optional[int]
    right: Optional[int]

    @staticmethod
    def of(causal: bool, window: tuple[int, int]) -> "KeyReach":
        left = window[0] if window[0] >= 0 else None
        right = 0 if causal else (window[1] if window[1] >= 0 else None)
        return KeyReach(left, right)


@dataclass(frozen=True)
class Piece:
    """The queries [q_start, q_end) of one document inside a query range, and the keys [k_start, k_end) of that
    document they can see (global positions). k_end - q_end is the shift of bottom-right alignment the call must
    undo; it is 0 except for a document that goes on past the query range with keys visible ahead."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int

    @property
    def shift(self) -> int:
        return self.k_end - self.q_end


def pieces(cu: tuple[int, ...], q_start: int, q_end: int, reach: KeyReach) -> list[Piece]:
    """The per-document pieces of the queries [q_start, q_end) of a packed stream with document bounds `cu`.

    Each piece's keys are the document's keys within its queries' reach: from max(document start,
    q_start - left) to min(document end, q_end + right). Queries past cu[-1] are in no document and in no piece.
    """
    q_end = min(q_end, cu[-1])
    out: list[Piece] = []
    position = q_start
    while position < q_end:
        doc = bisect.bisect_right(cu, position) - 1  # skips empty documents: their bound equals the next one
        doc_start, doc_end = cu[doc], cu[doc + 1]
        piece_end = min(doc_end, q_end)
        k_start = doc_start if reach.left is None else max(doc_start, position - reach.left)
        k_end = doc_end if reach.right is None else min(doc_end, piece_end + reach.right)
        out.append(Piece(position, piece_end, k_start, k_end))
        position = piece_end
    return out
