"""Decode-shaped attention against a KV cache: ``flash_decode`` and its custom op ``sparseattn::flash_decode``.

A few new queries per sequence (1 to 16) attend to a long cache of keys, dense ``[B, S, Hkv, D]`` or paged
(``[num_pages, page_size, Hkv, D]`` with a block table). On CUDA the keys are split over CTAs (split-KV) and the
splits' partial results merged in a fixed order; the workspace for the partials is allocated here with torch, so
a call can be captured in a CUDA graph and replayed with new ``cache_seqlens`` and ``block_table`` contents.
Forward only (inference): the op has no autograd formula.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from . import _C
from . import _checks as chk
from ._errors import SparseAttnError, make_error
from ._ops import _arr, _lse_dtype, _stream, _workspace_allocator


def _out_shapes(q: Tensor, v_cache: Tensor) -> tuple[list, list]:
    """o [B, Tq, Hq, Dv] and lse [B, Hq, Tq]."""
    return [*q.shape[:-1], v_cache.shape[-1]], [q.shape[0], q.shape[2], q.shape[1]]


@torch.library.custom_op("sparseattn::flash_decode", mutates_args=())
def flash_decode_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Optional[Tensor],
    block_table: Optional[Tensor],
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],
    num_splits: int,
) -> tuple[Tensor, Tensor]:
    o_shape, lse_shape = _out_shapes(q, v_cache)
    o = torch.empty(o_shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(lse_shape, dtype=_lse_dtype(q.dtype), device=q.device)
    _C.flash_decode(_arr(q), _arr(k_cache), _arr(v_cache), _arr(cache_seqlens), _arr(block_table), o, lse, causal,
                    window_left, window_right, scale, num_splits, _workspace_allocator(q), _stream(q))
    return o, lse


@flash_decode_op.register_fake
def _(q, k_cache, v_cache, cache_seqlens, block_table, causal, window_left, window_right, scale, num_splits):
    o_shape, lse_shape = _out_shapes(q, v_cache)
    return q.new_empty(o_shape), q.new_empty(lse_shape, dtype=_lse_dtype(q.dtype))


def _rank(op: str, arg: str, t: Tensor, rank: int, form: str) -> None:
    if t.dim() != rank:
        raise make_error(SparseAttnError, "shape", op, arg, f"expected {rank} dimensions {form}, got {list(t.shape)}")


def flash_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cache_seqlens: Optional[Tensor] = None,
                 block_table: Optional[Tensor] = None, causal: bool = True,
                 window: Union[tuple[int, int], list, None] = (-1, -1), scale: Optional[float] = None,
                 num_splits: int = 0, return_lse: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Attention of 1 to 16 new queries per sequence against a dense or paged KV cache (decode).

    Sequence ``b`` has ``L = cache_seqlens[b]`` valid keys (the new tokens already appended) and ``Tq`` queries;
    query ``t`` is aligned to key position ``a = L - Tq + t`` (bottom-right). The result is that of
    ``flash_attention(q[b:b+1], keys[:L], values[:L], causal=causal, window=window)`` on each sequence's gathered
    keys; a query that keeps no key returns 0 (lse -inf). On CUDA the keys are cut into ``num_splits`` equal splits
    whose partial results are merged in a fixed order (groups of 8 consecutive splits, then the groups;
    docs/semantics.md section 8, "Decode-shaped calls"): the result is bit-identical run to run, and different
    split counts differ by rounding only. The number of splits
    and the workspace depend on shapes, dtypes and the device only, never on the contents of ``cache_seqlens`` or
    ``block_table``, so a call captured in a CUDA graph can be replayed with new lengths and pages. Not
    differentiable (inference).

    Dense cache: ``k_cache[b, s]`` is key ``s`` of sequence ``b``. Paged cache: key ``s`` of sequence ``b`` is row
    ``s % page_size`` of page ``block_table[b, s // page_size]``. On CUDA both int32 tensors are trusted device
    data: lengths are clamped to the capacity (``S``, or ``max_pages * page_size``) and page indices to
    ``[0, num_pages)``, so no memory outside the cache is read, and only the entries of the pages holding keys
    ``0 .. L-1`` are read; on the CPU their contents are checked.

    Args:
        q: [B, Tq, Hq, Dqk], 1 <= Tq <= 16.
        k_cache: dense [B, S, Hkv, Dqk], or paged [num_pages, page_size, Hkv, Dqk] with ``block_table``; Hkv
            divides Hq. On CUDA the page size is a multiple of 16.
        v_cache: [B, S, Hkv, Dv], or paged [num_pages, page_size, Hkv, Dv].
        cache_seqlens: int32 [B] on q's device, the valid keys of each sequence; None (dense only): all S keys.
            Required with ``block_table``.
        block_table: int32 [B, max_pages] on q's device: the pages of each sequence, in key order; None for a dense
            cache.
        causal: a bool (default True); keep keys at or before the aligned position a.
        window: (left, right) ints: keep keys in [a - left, a + right]; a negative side is unbounded. None is
            (-1, -1).
        scale: softmax scale; None: 1/sqrt(Dqk).
        num_splits: KV splits on CUDA, 0 (default) for a heuristic from the SM count, the shapes and the capacity;
            the count is rounded so that each split is whole 64-key tiles, and at most 256 are used. Ignored on
            the CPU.
        return_lse: also return the log-sum-exp.

    Returns:
        o [B, Tq, Hq, Dv] in q's dtype, or (o, lse) with ``return_lse``; lse [B, Hq, Tq] in float32 (float64 for
        float64 inputs).

    Raises:
        SparseAttnTypeError: an argument of the wrong type (e.g. ``window=5``, ``num_splits=1.5``).
        SparseAttnDTypeError: non-float or mismatched dtypes, cache_seqlens or block_table not int32.
        SparseAttnError: wrong ranks or sizes (Tq outside 1..16, Hkv not dividing Hq, a block_table not [B, ...]),
            mixed devices, a paged cache without cache_seqlens, a negative num_splits, a bad scale; on the CPU, a
            length outside [0, capacity] or a used block_table entry outside [0, num_pages).
        SparseAttnUnsupportedError: CUDA inputs the kernels do not take (float32, head dims outside
            ``sparseattn.CUDA_HEAD_DIMS``, a page size that is not a multiple of 16, misaligned rows).

    Example:
        >>> import torch
        >>> from sparseattn.decode import flash_decode
        >>> q = torch.randn(2, 1, 8, 64)                         # one new query per sequence, 8 query heads
        >>> k, v = torch.randn(2, 100, 2, 64), torch.randn(2, 100, 2, 64)   # dense cache of 100 slots, 2 KV heads
        >>> lengths = torch.tensor([37, 100], dtype=torch.int32)
        >>> o, lse = flash_decode(q, k, v, cache_seqlens=lengths, return_lse=True)
        >>> tuple(o.shape), tuple(lse.shape)
        ((2, 1, 8, 64), (2, 8, 1))
        >>> pages_k, pages_v = torch.randn(10, 16, 2, 64), torch.randn(10, 16, 2, 64)   # 10 pages of 16 keys
        >>> table = torch.tensor([[3, 0, 7], [1, 2, 9]], dtype=torch.int32)            # 3 pages per sequence
        >>> o = flash_decode(q, pages_k, pages_v, cache_seqlens=torch.tensor([20, 48], dtype=torch.int32),
        ...                  block_table=table, window=(31, 0))
        >>> tuple(o.shape)
        (2, 1, 8, 64)
    """
    op = "flash_decode"
    causal = chk.bool_arg(op, "causal", causal)
    return_lse = chk.bool_arg(op, "return_lse", return_lse)
    window_left, window_right = chk.window_arg(op, "window", window)
    scale = chk.scale_arg(op, "scale", scale)
    num_splits = chk.int_arg(op, "num_splits", num_splits, minimum=0)
    chk.tensor_arg(op, "q", q)
    chk.tensor_arg(op, "k_cache", k_cache)
    chk.tensor_arg(op, "v_cache", v_cache)
    chk.tensor_arg(op, "cache_seqlens", cache_seqlens, optional=True, kind="int32")
    chk.tensor_arg(op, "block_table", block_table, optional=True, kind="int32")
    _rank(op, "q", q, 4, "[B, Tq, Hq, Dqk]")
    form = "[num_pages, page_size, Hkv, D]" if block_table is not None else "[B, S, Hkv, D]"
    _rank(op, "k_cache", k_cache, 4, form)
    _rank(op, "v_cache", v_cache, 4, form)
    chk.devices(op, q, "q", [("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens),
                             ("block_table", block_table)])
    o, lse = flash_decode_op(q.detach(), k_cache.detach(), v_cache.detach(), cache_seqlens, block_table, causal,
                             window_left, window_right, scale, num_splits)
    return (o, lse) if return_lse else o


def flash_decode_plan(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, cache_seqlens: Optional[Tensor] = None,
                      block_table: Optional[Tensor] = None, num_splits: int = 0) -> tuple[int, int]:
    """The number of KV splits and the workspace bytes a ``flash_decode`` call with these tensors uses.

    Both depend on shapes, dtypes, ``num_splits`` and the device only (1 split and 0 bytes on the CPU); the
    tensors' contents are not read. The arguments are those of :func:`flash_decode`, unchecked.

    Args:
        q: [B, Tq, Hq, Dqk].
        k_cache: dense [B, S, Hkv, Dqk] or paged [num_pages, page_size, Hkv, Dqk].
        v_cache: like k_cache, with Dv.
        cache_seqlens: int32 [B] or None.
        block_table: int32 [B, max_pages] or None.
        num_splits: as for flash_decode (0: the heuristic).

    Returns:
        (splits, workspace_bytes).

    Raises:
        SparseAttnError: tensors the binding cannot take (e.g. more than 4 dimensions).

    Example:
        >>> import torch
        >>> from sparseattn.decode import flash_decode_plan
        >>> flash_decode_plan(torch.randn(1, 1, 4, 64), torch.randn(1, 64, 1, 64), torch.randn(1, 64, 1, 64))
        (1, 0)
    """
    return tuple(_C.flash_decode_plan(_arr(q), _arr(k_cache), _arr(v_cache), _arr(cache_seqlens), _arr(block_table),
                                      num_splits))


__all__ = ["flash_decode", "flash_decode_plan"]
