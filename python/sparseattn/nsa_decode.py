"""NSA decode against a paged KV cache: ``nsa_decode`` and its custom op ``sparseattn::nsa_decode``.

1 to 16 new queries per sequence (already appended to the cache) run the whole NSA forward (compressed attention,
block selection, selected attention, sliding window, gated combination) against the sequence's keys, read through a
block table from shared pages, and the compressed rows kept beside them. The rows are exactly those of
``nsa_attention`` over the gathered keys (docs/semantics.md section 12). On CUDA the work is split over CTAs and
merged in a fixed order; the workspace is allocated here with torch and its size depends on shapes only, so a call
can be captured in a CUDA graph and replayed with new ``cache_seqlens`` and ``block_table`` contents. Forward only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C
from . import _checks as chk
from ._errors import SparseAttnError, make_error
from ._ops import _arr, _stream, _workspace_allocator
from .functional import NSAConfig

_OP = "nsa_decode"


def _indices_shape(q: Tensor, k_cache: Tensor, num_selected: int, want: bool) -> list:
    return [q.shape[0], q.shape[1], k_cache.shape[2], num_selected] if want else [0]


@torch.library.custom_op("sparseattn::nsa_decode", mutates_args=())
def nsa_decode_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    k_cmp: Optional[Tensor],
    v_cmp: Optional[Tensor],
    g_cmp: Optional[Tensor],
    g_slc: Optional[Tensor],
    g_swa: Optional[Tensor],
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    num_selected: int,
    num_init: int,
    num_local: int,
    window: int,
    scale: Optional[float],
    num_splits: int,
    return_block_indices: bool,
) -> tuple[Tensor, Tensor]:
    o = torch.empty([*q.shape[:-1], v_cache.shape[-1]], dtype=q.dtype, device=q.device)
    indices = torch.empty(_indices_shape(q, k_cache, num_selected, return_block_indices), dtype=torch.int32,
                          device=q.device)
    _C.nsa_decode(_arr(q), _arr(k_cache), _arr(v_cache), _arr(block_table), _arr(cache_seqlens), _arr(k_cmp),
                  _arr(v_cmp), _arr(g_cmp), _arr(g_slc), _arr(g_swa), o, indices if return_block_indices else None,
                  cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, window, scale, num_splits,
                  _workspace_allocator(q), _stream(q))
    return o, indices


@nsa_decode_op.register_fake
def _(q, k_cache, v_cache, block_table, cache_seqlens, k_cmp, v_cmp, g_cmp, g_slc, g_swa, cmp_block, cmp_stride,
      sel_block, num_selected, num_init, num_local, window, scale, num_splits, return_block_indices):
    o = q.new_empty([*q.shape[:-1], v_cache.shape[-1]])
    indices = q.new_empty(_indices_shape(q, k_cache, num_selected, return_block_indices), dtype=torch.int32)
    return o, indices


def _rank(arg: str, t: Optional[Tensor], rank: int, form: str) -> None:
    if t is not None and t.dim() != rank:
        raise make_error(SparseAttnError, "shape", _OP, arg, f"expected {rank} dimensions {form}, got {list(t.shape)}")


def nsa_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, *, block_table: Tensor, cache_seqlens: Tensor,
               k_cmp: Optional[Tensor] = None, v_cmp: Optional[Tensor] = None, g_cmp: Optional[Tensor] = None,
               g_slc: Optional[Tensor] = None, g_swa: Optional[Tensor] = None, config: Optional[NSAConfig] = None,
               num_splits: int = 0, return_block_indices: bool = False):
    """NSA for 1 to 16 new queries per sequence against a paged KV cache and its compressed rows (decode).

    Sequence ``b`` holds ``L = cache_seqlens[b]`` keys, the ``Tq`` new ones included; query ``t`` sits at key
    position ``a = L - Tq + t``. Key ``s`` is row ``s % page_size`` of page ``block_table[b, s // page_size]``;
    compressed row ``j`` (tokens ``[j*d, j*d + l)``) is ``k_cmp[b, j]`` for ``j < rows(L) = (L - l) // d + 1``
    (0 when ``L < l``). The result equals ``nsa_attention(q[b:b+1], K, V, k_cmp=..., v_cmp=..., gates...)`` on the
    gathered keys ``K, V`` and rows (docs/semantics.md section 12): the same compressed blocks, selection (forced
    blocks, ties to the lower block), window and gates. Not differentiable (inference).

    On CUDA ``cache_seqlens`` and ``block_table`` are trusted device data (read on the device only; lengths are
    clamped to ``[Tq, capacity]``, pages to ``[0, num_pages)``, compressed rows to ``max_cmp``: no memory outside
    the given tensors is read); the CPU checks them.

    Args:
        q: [B, Tq, Hq, Dqk], 1 <= Tq <= 16.
        k_cache, v_cache: pages [num_pages, page_size, Hkv, Dqk] and [num_pages, page_size, Hkv, Dv]; Hkv divides
            Hq (on CUDA Hq / Hkv <= 16, page_size a multiple of 16).
        block_table: int32 [B, max_pages]; cache_seqlens: int32 [B], both on q's device.
        k_cmp, v_cmp: [B, max_cmp, Hkv, Dqk] and [B, max_cmp, Hkv, Dv], the compressed rows of each sequence
            (mean pooling of its keys, or your compressor's); needed with g_cmp or g_slc.
        g_cmp, g_slc, g_swa: [B, Tq, Hq] gates in q's dtype; a branch whose gate is None is skipped (at least one).
        config: NSAConfig (None: the defaults).
        num_splits: CUDA splits of the compressed rows (0: a heuristic from the SM count and the shapes).
        return_block_indices: also return the selection, int32 [B, Tq, Hkv, num_selected] (needs g_slc).

    Returns:
        o [B, Tq, Hq, Dv] in q's dtype, or (o, block_indices).

    Raises:
        SparseAttnTypeError: a config that is not an NSAConfig, a non-int num_splits.
        SparseAttnDTypeError: mismatched dtypes, block_table or cache_seqlens not int32.
        SparseAttnError: wrong ranks or sizes, no gate, mixed devices; on the CPU a length outside [Tq, capacity],
            a used block-table entry outside the pages, too few compressed rows.
        SparseAttnUnsupportedError: CUDA inputs the kernels do not take (float32, head dims outside
            ``sparseattn.CUDA_HEAD_DIMS``, a group above 16, a page size or sel_block not a multiple of 16).

    Example:
        >>> import torch, sparseattn
        >>> from sparseattn.cache import NSAPagedKVCache
        >>> cfg = sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, window=32)
        >>> cache = NSAPagedKVCache(num_pages=16, page_size=32, num_kv_heads=1, head_dim=16, max_pages_per_seq=8,
        ...                         config=cfg)
        >>> s = cache.add_sequence()
        >>> cache.append([s], torch.randn(1, 100, 1, 16), torch.randn(1, 100, 1, 16))
        >>> g = torch.full((1, 1, 4), 0.5)
        >>> o = cache.nsa_decode(torch.randn(1, 1, 4, 16), [s], g_cmp=g, g_slc=g, g_swa=g)
        >>> tuple(o.shape)
        (1, 1, 4, 16)
    """
    config = NSAConfig() if config is None else config
    if not isinstance(config, NSAConfig):
        raise chk.type_error(_OP, "config", "a sparseattn.NSAConfig", config)
    config._validate()
    num_splits = chk.int_arg(_OP, "num_splits", num_splits, minimum=0)
    return_block_indices = chk.bool_arg(_OP, "return_block_indices", return_block_indices)
    for name, t, optional, kind in (("q", q, False, "float"), ("k_cache", k_cache, False, "float"),
                                    ("v_cache", v_cache, False, "float"), ("block_table", block_table, False, "int32"),
                                    ("cache_seqlens", cache_seqlens, False, "int32"), ("k_cmp", k_cmp, True, "float"),
                                    ("v_cmp", v_cmp, True, "float"), ("g_cmp", g_cmp, True, "float"),
                                    ("g_slc", g_slc, True, "float"), ("g_swa", g_swa, True, "float")):
        chk.tensor_arg(_OP, name, t, optional=optional, kind=kind)
    _rank("q", q, 4, "[B, Tq, Hq, Dqk]")
    _rank("k_cache", k_cache, 4, "[num_pages, page_size, Hkv, Dqk]")
    _rank("v_cache", v_cache, 4, "[num_pages, page_size, Hkv, Dv]")
    _rank("k_cmp", k_cmp, 4, "[B, max_cmp, Hkv, Dqk]")
    _rank("v_cmp", v_cmp, 4, "[B, max_cmp, Hkv, Dv]")
    _rank("block_table", block_table, 2, "[B, max_pages]")
    if return_block_indices and g_slc is None:
        raise make_error(SparseAttnError, "config", _OP, "return_block_indices",
                         "the selection runs only with the g_slc gate")
    chk.devices(_OP, q, "q", [("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
                              ("cache_seqlens", cache_seqlens), ("k_cmp", k_cmp), ("v_cmp", v_cmp),
                              ("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa)])
    detach = (lambda t: None if t is None else t.detach())
    o, indices = nsa_decode_op(q.detach(), k_cache.detach(), v_cache.detach(), block_table, cache_seqlens,
                               detach(k_cmp), detach(v_cmp), detach(g_cmp), detach(g_slc), detach(g_swa),
                               config.cmp_block, config.cmp_stride, config.sel_block, config.num_selected,
                               config.num_init, config.num_local, config.window, config.scale, num_splits,
                               return_block_indices)
    return (o, indices) if return_block_indices else o


__all__ = ["nsa_decode"]
