"""How a sequence of T tokens is split over the R ranks of a process group, and the helpers that cut a full
tensor into this rank's shard and put the shards back together.

Two layouts, both defined through chunks cut as ``torch.tensor_split`` cuts (the first ``T % n`` chunks have
one token more than the others, so lengths need not divide evenly and a chunk may be empty):

- ``"zigzag"`` (load-balanced causal): 2R chunks; rank r holds chunk r and chunk 2R-1-r, in that order. Under a
  causal mask the early chunk sees few keys and the late one many, so every rank gets about the same work.
- ``"contiguous"``: R chunks; rank r holds chunk r.

With T = 10 and R = 2, zigzag cuts chunks [0,3) [3,6) [6,8) [8,10): rank 0 holds tokens 0-2 and 8-9, rank 1
tokens 3-7. A rank's shard is its chunks back to back, in ascending position. With T < 2R some ranks hold no
tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .._errors import SparseAttnError, SparseAttnTypeError, make_error
from . import group as _group
from .ranges import Range

LAYOUTS = ("zigzag", "contiguous")


def chunk_bounds(total: int, num_chunks: int) -> tuple[int, ...]:
    """The boundaries of `total` tokens cut into `num_chunks` chunks as torch.tensor_split cuts them: chunk c is
    [bounds[c], bounds[c + 1]), the first ``total % num_chunks`` chunks one token longer than the others.

    Args:
        total: the number of tokens, >= 0.
        num_chunks: the number of chunks, >= 1.

    Returns:
        A tuple of num_chunks + 1 ints from 0 to total.

    Raises:
        SparseAttnError: a negative total or a chunk count below 1.

    Example:
        >>> from sparseattn.distributed import chunk_bounds
        >>> chunk_bounds(10, 4), chunk_bounds(2, 4)
        ((0, 3, 6, 8, 10), (0, 1, 2, 2, 2))
    """
    _check_sizes("distributed.chunk_bounds", total, num_chunks, 0)
    base, extra = divmod(total, num_chunks)
    bounds = [0]
    for c in range(num_chunks):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return tuple(bounds)


def shard_ranges(total: int, world_size: int, rank: int, layout: str = "zigzag") -> tuple[Range, ...]:
    """The global token ranges [start, end) that `rank` holds, in the order of its shard (ascending); zigzag gives
    two ranges (chunk r, chunk 2R-1-r), contiguous one. Ranges may be empty.

    Args:
        total: the sequence length T (tokens of the whole sequence; for packed documents, of the packed stream).
        world_size: R, the number of ranks.
        rank: the rank, 0 <= rank < R.
        layout: "zigzag" or "contiguous".

    Returns:
        A tuple of (start, end) pairs.

    Raises:
        SparseAttnError: a negative total, a rank outside [0, R), an unknown layout.

    Example:
        >>> from sparseattn.distributed import shard_ranges
        >>> shard_ranges(10, 2, 0), shard_ranges(10, 2, 1)
        (((0, 3), (8, 10)), ((3, 6), (6, 8)))
        >>> shard_ranges(10, 2, 1, layout="contiguous")
        ((5, 10),)
    """
    op = "distributed.shard_ranges"
    _check_sizes(op, total, world_size, rank)
    if layout == "zigzag":
        bounds = chunk_bounds(total, 2 * world_size)
        late = 2 * world_size - 1 - rank
        return ((bounds[rank], bounds[rank + 1]), (bounds[late], bounds[late + 1]))
    if layout == "contiguous":
        bounds = chunk_bounds(total, world_size)
        return ((bounds[rank], bounds[rank + 1]),)
    raise _layout_error(op, layout)


def shard_lengths(total: int, world_size: int, layout: str = "zigzag") -> tuple[int, ...]:
    """The number of tokens each rank holds, [R].

    Args:
        total: the sequence length T.
        world_size: R.
        layout: "zigzag" or "contiguous".

    Returns:
        A tuple of R ints that sum to T.

    Raises:
        SparseAttnError: a negative total, a world size below 1, an unknown layout.

    Example:
        >>> from sparseattn.distributed import shard_lengths
        >>> shard_lengths(10, 2), shard_lengths(3, 4)
        ((5, 5), (1, 1, 1, 0))
    """
    return tuple(sum(end - start for start, end in shard_ranges(total, world_size, r, layout))
                 for r in range(world_size))


def shard_positions(total: int, world_size: int, rank: int, layout: str = "zigzag",
                    device: Optional[torch.device] = None) -> Tensor:
    """The index map of a shard: row i of `rank`'s shard holds global token ``positions[i]`` (e.g. the positions
    of a rotary embedding, or ``x.index_select(dim, positions)`` for the shard of a full tensor).

    Args:
        total: the sequence length T.
        world_size: R.
        rank: the rank.
        layout: "zigzag" or "contiguous".
        device: where to put the result (default: CPU).

    Returns:
        int64 [shard length].

    Raises:
        SparseAttnError: as :func:`shard_ranges`.

    Example:
        >>> from sparseattn.distributed import shard_positions
        >>> shard_positions(10, 2, 0).tolist()
        [0, 1, 2, 8, 9]
    """
    ranges = shard_ranges(total, world_size, rank, layout)
    parts = [torch.arange(start, end, dtype=torch.int64, device=device) for start, end in ranges]
    return torch.cat(parts)


def shard(x: Tensor, group=None, dim: int = 1, layout: str = "zigzag") -> Tensor:
    """This rank's shard of a full tensor (the same full tensor on every rank): the rows of `dim` at
    :func:`shard_positions`. Differentiable (the gradient of the full tensor is zero outside the shard).

    Args:
        x: the full tensor, e.g. batched [B, T, H, D] (dim=1) or packed [N, H, D] (dim=0).
        group: the process group (None: the default group).
        dim: the token dimension.
        layout: "zigzag" or "contiguous".

    Returns:
        A new tensor, x's shape with ``shard_lengths(...)[rank]`` rows along `dim`.

    Raises:
        SparseAttnError: torch.distributed is not initialized, dim out of range, an unknown layout.
        SparseAttnTypeError: x is not a tensor.

    Example:
        >>> import torch, torch.distributed as dist
        >>> from sparseattn.distributed import shard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> shard(torch.arange(6.0)[None], dim=1).tolist()   # one rank holds everything
        [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
        >>> dist.destroy_process_group()
    """
    op = "distributed.shard"
    group = _group.default_group(op, group)
    dim = _token_dim(op, x, dim)
    rank, size = _group.rank_and_size(group)
    ranges = shard_ranges(x.shape[dim], size, rank, layout)
    return torch.cat([x.narrow(dim, start, end - start) for start, end in ranges], dim)


def unshard(x: Tensor, group=None, dim: int = 1, layout: str = "zigzag") -> Tensor:
    """The full tensor from every rank's shard (the inverse of :func:`shard`), on every rank.

    A collective: every rank of the group calls it. One all_gather of the shard lengths finds T (and checks that
    the shards fit the layout and agree in shape and dtype), a second one gathers the shards (padded to the
    longest). Not differentiable: the result carries no gradient back to the shards.

    Args:
        x: this rank's shard, e.g. [B, T_r, H, D] with dim=1.
        group: the process group (None: the default group).
        dim: the token dimension.
        layout: the layout the shards were cut with.

    Returns:
        The full tensor: x's shape with T = sum of the shard lengths along `dim`, tokens in global order.

    Raises:
        SparseAttnError: on every rank, when a rank's shard has another shape (besides its length), dtype or
            device kind, when the lengths are not those of `layout` for their sum, or when the group's backend
            does not serve x's device (gloo for CPU tensors, NCCL for CUDA tensors).

    Example:
        >>> import torch, torch.distributed as dist
        >>> from sparseattn.distributed import unshard
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> unshard(torch.arange(4.0)[None, :, None], dim=1).flatten().tolist()
        [0.0, 1.0, 2.0, 3.0]
        >>> dist.destroy_process_group()
    """
    op = "distributed.unshard"
    group = _group.default_group(op, group)
    backends = _group.backend_map(group)
    rank, size = _group.rank_and_size(group)
    fields = (_group.Field("layout", "the layout", lambda c: repr(LAYOUTS[c])),
              _group.Field("x", "the number of dimensions"),
              _group.Field("dim", "the token dimension"),
              _group.Field("x", "the dtype", _group.SHOW_DTYPE),
              _group.Field("x", "the device type", _group.SHOW_DEVICE),
              _group.Field("x", "the sizes of the other dimensions", None),
              _group.Field("x", "the shard length"))
    values, error = None, None
    try:
        dim = _token_dim(op, x, dim)
        if layout not in LAYOUTS:
            raise _layout_error(op, layout)
        error = _group.backend_error(op, "x", backends, x.device)
        if error is None:
            other_dims = tuple(s for i, s in enumerate(x.shape) if i != dim)
            values = (LAYOUTS.index(layout), x.dim(), dim, _group.stable_code(str(x.dtype).removeprefix("torch.")),
                      _group.stable_code(x.device.type), _group.stable_code(repr(other_dims)), x.shape[dim])
    except SparseAttnError as exc:
        error = exc
    rows = _group.agree(op, group, backends, fields, values, error, differ_ok=("the shard length",),
                        tensors_device=x.device if isinstance(x, Tensor) else None)
    lengths = [row[-1] for row in rows]
    total = sum(lengths)
    check_shard_lengths(op, "x", lengths, total, layout)
    longest = max(lengths)
    tokens_first = x.movedim(dim, 0)
    padded = tokens_first.new_zeros((longest,) + tuple(tokens_first.shape[1:]))
    padded[: x.shape[dim]] = tokens_first
    gathered = padded.new_empty((size * longest,) + tuple(padded.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    full = padded.new_empty((total,) + tuple(padded.shape[1:]))
    for r in range(size):
        row = 0
        for start, end in shard_ranges(total, size, r, layout):
            full[start:end] = gathered[r * longest + row: r * longest + row + end - start]
            row += end - start
    return full.movedim(0, dim)


def check_shard_lengths(op: str, arg: str, lengths: list[int], total: int, layout: str) -> None:
    """Raises (identically on every rank, as every rank passes the same gathered lengths) unless the ranks'
    shard lengths are those of `layout` for `total` tokens."""
    expected = shard_lengths(total, len(lengths), layout)
    if tuple(lengths) != expected:
        raise make_error(SparseAttnError, "shape", op, arg,
                         f"the ranks' shard lengths {list(lengths)} do not add up to the {layout} sharding of "
                         f"{total} tokens over {len(lengths)} ranks, which is {list(expected)} "
                         f"(cut the sequence with sparseattn.distributed.shard)")


def agreed_stream_length(op: str, rows, layout: str, cu: Optional[list[int]]) -> int:
    """The tokens of the sharded stream from the agreed configuration rows (each rank's shard length last), after
    checking (identically on every rank) that the shards are `layout`'s and that the documents' cu_seqlens end
    inside the stream."""
    lengths = [row[-1] for row in rows]
    total = sum(lengths)
    check_shard_lengths(op, "q", lengths, total, layout)
    if cu is not None and cu[-1] > total:
        raise make_error(SparseAttnError, "value", op, "cu_seqlens",
                         f"ends at {cu[-1]}, past the {total} tokens of the packed stream (the ranks' shards)")
    return total


def _token_dim(op: str, x, dim) -> int:
    if not isinstance(x, Tensor):
        raise make_error(SparseAttnTypeError, "type", op, "x", f"expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise make_error(SparseAttnError, "config", op, "dim",
                         f"expected an int in [{-x.dim()}, {x.dim()}) for a tensor of shape {list(x.shape)}, "
                         f"got {dim!r}")
    return dim % x.dim()


def _check_sizes(op: str, total: int, world_size: int, rank: int) -> None:
    for name, value, minimum in (("total", total, 0), ("world_size", world_size, 1), ("rank", rank, 0)):
        name = "num_chunks" if op.endswith("chunk_bounds") and name == "world_size" else name
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise make_error(SparseAttnError, "config", op, name, f"expected an int >= {minimum}, got {value!r}")
    if rank >= world_size:
        raise make_error(SparseAttnError, "config", op, "rank", f"expected a rank below {world_size}, got {rank}")


def _layout_error(op: str, layout) -> SparseAttnError:
    return make_error(SparseAttnError, "config", op, "layout", f"expected 'zigzag' or 'contiguous', got {layout!r}")
