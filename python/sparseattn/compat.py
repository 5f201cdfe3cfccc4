"""Drop-in functions for users of other attention libraries: each is a thin wrapper with the other library's
signature and layout over sparseattn's operations.

- ``flash_attn_func``, ``flash_attn_varlen_func``: flash-attn's dense attention (FlashAttention-2 signatures).
- ``flash_attn_with_kvcache``: flash-attn's decode against a dense or paged KV cache (appending the new keys).
- ``parallel_nsa``: fla's (flash-linear-attention) Native Sparse Attention.

The differences that remain are listed in each docstring; arguments the wrapped operation cannot honour raise
SparseAttnUnsupportedError instead of being ignored.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from . import _checks as chk
from ._errors import SparseAttnUnsupportedError, make_error
from .decode import flash_decode
from .functional import NSAConfig, flash_attention, nsa_attention

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "parallel_nsa"]


def _unsupported(op: str, arg: str, why: str) -> SparseAttnUnsupportedError:
    return make_error(SparseAttnUnsupportedError, "unsupported", op, arg, why)


def _flash_extras(op: str, dropout_p: float, softcap: float, alibi_slopes: Optional[Tensor]) -> None:
    if dropout_p:
        raise _unsupported(op, "dropout_p", f"attention dropout is not implemented (got {dropout_p}); pass 0.0")
    if softcap:
        raise _unsupported(op, "softcap", f"logit soft-capping is not implemented (got {softcap}); pass 0.0")
    if alibi_slopes is not None:
        raise _unsupported(op, "alibi_slopes", "ALiBi is not implemented; pass a bias to "
                                               "sparseattn.flash_attention instead")


def _window(op: str, window_size) -> tuple[int, int]:
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise chk.type_error(op, "window_size", "a (left, right) pair of ints", window_size)
    return int(window_size[0]), int(window_size[1])


def flash_attn_func(q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                    return_attn_probs: bool = False):
    """flash-attn's ``flash_attn_func`` over :func:`sparseattn.flash_attention`.

    Same layout ([B, T, Hq, D] / [B, S, Hkv, D]), GQA, bottom-right causal alignment and window convention.
    Differences: ``dropout_p``, ``softcap`` and ``alibi_slopes`` raise SparseAttnUnsupportedError unless 0 / None;
    ``deterministic`` is accepted and ignored (the backward is always deterministic); with ``return_attn_probs``
    the third value is None (flash-attn returns the dropout mask's probabilities only in its tests).

    Args:
        q, k, v: as flash-attn's: [B, T, Hq, D], [B, S, Hkv, D], [B, S, Hkv, Dv].
        dropout_p, softcap, alibi_slopes: must be 0, 0 and None.
        softmax_scale: None is 1/sqrt(D).
        causal, window_size: as flash-attn's (bottom-right aligned; -1 unbounded).
        deterministic: ignored.
        return_attn_probs: also return the log-sum-exp [B, Hq, T] (float32) and None.

    Returns:
        out [B, T, Hq, Dv], or (out, softmax_lse, None) with ``return_attn_probs``.

    Raises:
        SparseAttnUnsupportedError: dropout, soft-capping or ALiBi requested.
        SparseAttnError: as :func:`sparseattn.flash_attention`.

    Example:
        >>> import torch
        >>> from sparseattn.compat import flash_attn_func
        >>> q, k, v = torch.randn(1, 6, 4, 16), torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16)
        >>> tuple(flash_attn_func(q, k, v, causal=True).shape)
        (1, 6, 4, 16)
    """
    op = "flash_attn_func"
    _flash_extras(op, dropout_p, softcap, alibi_slopes)
    out, lse = flash_attention(q, k, v, causal=causal, window=_window(op, window_size), scale=softmax_scale,
                               return_lse=True)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Optional[Tensor] = None):
    """flash-attn's ``flash_attn_varlen_func`` over :func:`sparseattn.flash_attention` (packed layout).

    Same packed layout ([Nq, Hq, D] with int32 cu_seqlens_q; keys [Nk, Hkv, D] with cu_seqlens_k; int64
    cu_seqlens are converted). Differences: as :func:`flash_attn_func`; ``block_table`` (a paged key cache)
    raises SparseAttnUnsupportedError here (use sparseattn.flash_decode for paged caches).

    Args:
        q, k, v: packed [Nq, Hq, D], [Nk, Hkv, D], [Nk, Hkv, Dv].
        cu_seqlens_q, cu_seqlens_k: [B+1] prefix sums of the lengths (int32 or int64).
        max_seqlen_q, max_seqlen_k: upper bounds of the lengths.
        dropout_p, softcap, alibi_slopes, block_table: must be 0, 0, None and None.
        softmax_scale, causal, window_size, deterministic, return_attn_probs: as :func:`flash_attn_func`.

    Returns:
        out [Nq, Hq, Dv], or (out, softmax_lse [Hq, Nq], None) with ``return_attn_probs``.

    Raises:
        SparseAttnUnsupportedError: dropout, soft-capping, ALiBi or a block table.
        SparseAttnError: as :func:`sparseattn.flash_attention`.

    Example:
        >>> import torch
        >>> from sparseattn.compat import flash_attn_varlen_func
        >>> cu = torch.tensor([0, 3, 8])
        >>> q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
        >>> tuple(flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True).shape)
        (8, 4, 16)
    """
    op = "flash_attn_varlen_func"
    _flash_extras(op, dropout_p, softcap, alibi_slopes)
    if block_table is not None:
        raise _unsupported(op, "block_table", "paged keys are taken by sparseattn.flash_decode, not here")
    out, lse = flash_attention(q, k, v, causal=causal, window=_window(op, window_size), scale=softmax_scale,
                               cu_seqlens_q=_int32(op, "cu_seqlens_q", cu_seqlens_q),
                               cu_seqlens_k=_int32(op, "cu_seqlens_k", cu_seqlens_k), max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, return_lse=True)
    return (out, lse, None) if return_attn_probs else out


def _rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """flash-attn's rotary embedding of x [B, T, H, D] at positions [B, T]: the first 2 * cos.shape[1] dims are
    rotated, as pairs (x0, x1), (x2, x3), ... when interleaved, else as halves."""
    rot = 2 * cos.shape[1]
    compute = torch.promote_types(x.dtype, torch.float32)
    c = cos[positions][:, :, None].to(compute)  # [B, T, 1, rot / 2]
    s = sin[positions][:, :, None].to(compute)
    head, rest = x[..., :rot].to(compute), x[..., rot:]
    if interleaved:
        a, b = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = head[..., : rot // 2], head[..., rot // 2:]
        rotated = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor] = None,
                            v: Optional[Tensor] = None, rotary_cos: Optional[Tensor] = None,
                            rotary_sin: Optional[Tensor] = None, cache_seqlens: Union[int, Tensor, None] = None,
                            cache_batch_idx: Optional[Tensor] = None, cache_leftpad: Optional[Tensor] = None,
                            block_table: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Optional[Tensor] = None,
                            num_splits: int = 0, return_softmax_lse: bool = False):
    """flash-attn's ``flash_attn_with_kvcache`` over :func:`sparseattn.flash_decode`.

    Same layouts: q [B, Tq, Hq, D]; a dense cache [B, S, Hkv, D] or a paged one [num_pages, page_size, Hkv, D]
    with ``block_table`` [B, max_pages] (int32); ``cache_seqlens`` (an int or int32 [B]) counts the keys in the
    cache before this call. New keys ``k``/``v`` [B, Tnew, Hkv, D] are written into the cache in place at
    positions cache_seqlens .. cache_seqlens + Tnew - 1 (rotated first when ``rotary_cos``/``rotary_sin`` are
    given, as is q: at those positions when causal or windowed, else all at position cache_seqlens), then q
    attends to every key up to the new end, bottom-right aligned. Differences: 1 to 16 queries per sequence (the
    decode kernel's range); ``cache_batch_idx``, ``cache_leftpad``, ``softcap`` and ``alibi_slopes`` raise
    SparseAttnUnsupportedError; on CUDA the lengths and pages are trusted device data (writes and reads stay
    inside the cache: positions are clamped to it), on the CPU they are checked.

    Args:
        q: [B, Tq, Hq, D], 1 <= Tq <= 16.
        k_cache, v_cache: dense [B, S, Hkv, D] or paged [num_pages, page_size, Hkv, D]; updated in place when k/v
            are given.
        k, v: optional new keys and values [B, Tnew, Hkv, D] (both or neither).
        rotary_cos, rotary_sin: optional [max_position, rotary_dim / 2] tables (both or neither).
        cache_seqlens: keys in the cache before this call: an int or int32 [B]; None: the whole cache (dense).
        cache_batch_idx, cache_leftpad, softcap, alibi_slopes: must be None, None, 0 and None.
        block_table: int32 [B, max_pages] for a paged cache.
        softmax_scale: None is 1/sqrt(D).
        causal, window_size: as flash-attn's.
        rotary_interleaved: rotate pairs of adjacent dims (True) or the two halves (False).
        num_splits: KV splits (0: heuristic), as :func:`sparseattn.flash_decode`.
        return_softmax_lse: also return the log-sum-exp [B, Hq, Tq].

    Returns:
        out [B, Tq, Hq, Dv], or (out, softmax_lse) with ``return_softmax_lse``.

    Raises:
        SparseAttnUnsupportedError: the arguments listed above, or more than 16 queries.
        SparseAttnError: as :func:`sparseattn.flash_decode`, and k without v or rotary_cos without rotary_sin.

    Example:
        >>> import torch
        >>> from sparseattn.compat import flash_attn_with_kvcache
        >>> k_cache, v_cache = torch.zeros(2, 64, 2, 16), torch.zeros(2, 64, 2, 16)
        >>> lengths = torch.tensor([10, 3], dtype=torch.int32)
        >>> q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
        >>> out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)
        >>> tuple(out.shape), bool(k_cache[0, 10].eq(k[0, 0]).all())
        ((2, 1, 4, 16), True)
    """
    op = "flash_attn_with_kvcache"
    _flash_extras(op, 0.0, softcap, alibi_slopes)
    for name, value in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise _unsupported(op, name, "is not implemented; index or trim the cache before the call")
    if (k is None) != (v is None):
        raise make_error(chk.SparseAttnError, "config", op, "k" if k is None else "v", "k and v come together")
    if (rotary_cos is None) != (rotary_sin is None):
        raise make_error(chk.SparseAttnError, "config", op, "rotary_sin" if rotary_sin is None else "rotary_cos",
                         "rotary_cos and rotary_sin come together")
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise chk.type_error(op, "q", "a [B, Tq, Hq, D] torch.Tensor", q)
    if not 1 <= q.shape[1] <= 16:
        raise _unsupported(op, "q", f"has {q.shape[1]} queries per sequence; the decode kernel takes 1 to 16")
    batch, paged = q.shape[0], block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if cache_seqlens is None and paged:
        raise make_error(chk.SparseAttnError, "config", op, "cache_seqlens", "is required with block_table")
    if cache_seqlens is None:
        lengths = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    elif isinstance(cache_seqlens, int):
        lengths = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        lengths = cache_seqlens
    new = 0 if k is None else k.shape[1]
    if rotary_cos is not None:
        steps = torch.arange(max(q.shape[1], new), device=q.device)
        base = lengths.long()[:, None]
        if k is not None:
            k = _rotary(k, rotary_cos, rotary_sin, (base + steps[:new]).clamp(max=rotary_cos.shape[0] - 1),
                        rotary_interleaved)
        local = causal or window_size[0] >= 0 or window_size[1] >= 0
        q_positions = base + (steps[: q.shape[1]] if local else torch.zeros_like(steps[: q.shape[1]]))
        q = _rotary(q, rotary_cos, rotary_sin, q_positions.clamp(max=rotary_cos.shape[0] - 1), rotary_interleaved)
    if k is not None:
        if not q.is_cuda:
            _check_room(op, lengths, new, capacity)
        positions = (lengths.long()[:, None] + torch.arange(new, device=q.device)).clamp(0, max(capacity - 1, 0))
        if paged:
            page_size = k_cache.shape[1]
            pages = block_table.long().gather(1, positions // page_size).clamp(0, k_cache.shape[0] - 1)
            k_cache[pages, positions % page_size] = k.to(k_cache.dtype)
            v_cache[pages, positions % page_size] = v.to(v_cache.dtype)
        else:
            rows = torch.arange(batch, device=q.device)[:, None].expand_as(positions)
            k_cache[rows, positions] = k.to(k_cache.dtype)
            v_cache[rows, positions] = v.to(v_cache.dtype)
        lengths = (lengths + new).to(torch.int32)
    return flash_decode(q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table, causal=causal,
                        window=_window(op, window_size), scale=softmax_scale, num_splits=num_splits,
                        return_lse=return_softmax_lse)


def _check_room(op: str, lengths: Tensor, new: int, capacity: int) -> None:
    """CPU: the new keys fit the cache (on CUDA the lengths are trusted device data)."""
    if bool(((lengths < 0) | (lengths.long() + new > capacity)).any()):
        raise make_error(chk.SparseAttnError, "value", op, "cache_seqlens",
                         f"a sequence's {new} new keys do not fit the cache of {capacity} keys")


def _int32(op: str, arg: str, t: Optional[Tensor]) -> Optional[Tensor]:
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise chk.type_error(op, arg, "a torch.Tensor", t)
    return t.int() if t.dtype == torch.int64 else t


def _fla_indices(block_indices: Tensor, block_counts: Union[int, Tensor], num_blocks: Union[int, Tensor]) -> Tensor:
    """fla's block_indices [.., T, Hkv, S] (any integer dtype; entries past the count, negative or past the
    sequence's last block are padding) as sparseattn's: int32, strictly ascending, -1 at the tail. num_blocks:
    an int, or per token [T] (packed sequences of different lengths)."""
    idx = block_indices.long()
    slots = torch.arange(idx.shape[-1], device=idx.device)
    count = block_counts if isinstance(block_counts, int) else block_counts.long()[..., None]
    limit = num_blocks if isinstance(num_blocks, int) else num_blocks[:, None, None]
    valid = (slots < count) & (idx >= 0) & (idx < limit)
    sentinel = torch.full_like(idx, torch.iinfo(torch.int32).max)
    idx = torch.where(valid, idx, sentinel).sort(dim=-1).values
    repeated = torch.zeros_like(valid)
    repeated[..., 1:] = idx[..., 1:] == idx[..., :-1]
    idx = torch.where(repeated, sentinel, idx).sort(dim=-1).values
    return torch.where(idx == sentinel, torch.full_like(idx, -1), idx).int()


def _blocks_per_token(cu_seqlens: Tensor, tokens: int, block_size: int) -> Tensor:
    """Selection blocks of each packed token's sequence, on the device (no host synchronisation)."""
    positions = torch.arange(tokens, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens[1:].long(), positions, right=True).clamp(max=cu_seqlens.numel() - 2)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()[sequence]
    return (lengths + block_size - 1) // block_size


def parallel_nsa(q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor] = None, g_slc: Optional[Tensor] = None,
                 g_swa: Optional[Tensor] = None, block_indices: Optional[Tensor] = None,
                 block_counts: Union[int, Tensor] = 16, block_size: int = 64, window_size: int = 0,
                 scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """fla's ``parallel_nsa`` over :func:`sparseattn.nsa_attention`.

    Same layout ([B, T, Hq, D] / [B, T, Hkv, D]; packed with cu_seqlens as [1, N, H, D], int64 cu_seqlens
    converted), gates [B, T, Hq], ``block_indices`` [B, T, Hkv, S] with ``block_counts`` (an int or [B, T, Hkv]),
    ``window_size`` 0 meaning no window branch. fla's compression pools non-overlapping blocks of ``block_size``,
    so the compressed blocks here are ``block_size`` tokens with stride ``block_size``.
    Differences: any GQA group size works (fla needs multiples of 16); a missing ``g_slc`` means gate 1 (as fla);
    without ``block_indices`` the blocks are chosen by sparseattn's selection (the top ``block_counts`` blocks
    with the first and the query's own block forced, ties to the lower index), which may differ from fla's
    top-k; with ``block_indices`` the entries past a row's count, negative or past the sequence's last block
    are ignored and repeats are dropped. Tuple cu_seqlens (queries shorter than keys) are not taken.

    Args:
        q, k, v: [B, T, Hq, D], [B, T, Hkv, D], [B, T, Hkv, Dv] (B = 1 with cu_seqlens).
        g_cmp, g_slc, g_swa: gates [B, T, Hq] (None: the compressed / window branch is skipped; g_slc None is 1).
        block_indices: selected blocks [B, T, Hkv, S] or None (then g_cmp is required to select).
        block_counts: blocks per query: an int, or [B, T, Hkv].
        block_size: tokens per selection (and compression) block.
        window_size: sliding-window width, the query included; 0: no window branch.
        scale: softmax scale; None is 1/sqrt(D).
        cu_seqlens: [N+1] prefix sums (int32 or int64) for packed sequences.

    Returns:
        o [B, T, Hq, Dv].

    Raises:
        SparseAttnUnsupportedError: tuple cu_seqlens; a tensor block_counts without block_indices.
        SparseAttnError: no block_indices and no g_cmp, and the errors of :func:`sparseattn.nsa_attention`.

    Example:
        >>> import torch
        >>> from sparseattn.compat import parallel_nsa
        >>> q, k, v = torch.randn(1, 40, 4, 16), torch.randn(1, 40, 1, 16), torch.randn(1, 40, 1, 16)
        >>> g = torch.rand(1, 40, 4)
        >>> tuple(parallel_nsa(q, k, v, g, g, g, block_counts=2, block_size=8, window_size=8).shape)
        (1, 40, 4, 16)
    """
    op = "parallel_nsa"
    if isinstance(cu_seqlens, tuple):
        raise _unsupported(op, "cu_seqlens", "queries shorter than keys (a tuple) are not taken here")
    if block_indices is None and g_cmp is None:
        raise make_error(chk.SparseAttnError, "config", op, "g_cmp",
                         "is required to select blocks when block_indices is None")
    if not isinstance(block_counts, (int, Tensor)) or isinstance(block_counts, bool):
        raise chk.type_error(op, "block_counts", "an int or a torch.Tensor", block_counts)
    cu = _int32(op, "cu_seqlens", cu_seqlens)
    packed = cu is not None
    if packed:
        if q.dim() != 4 or q.shape[0] != 1:
            raise make_error(chk.SparseAttnError, "shape", op, "q", "must be [1, N, Hq, D] with cu_seqlens")
        q, k, v = q[0], k[0], v[0]
        g_cmp, g_slc, g_swa = (None if g is None else g[0] for g in (g_cmp, g_slc, g_swa))
    if g_slc is None:
        g_slc = q.new_ones(q.shape[:-1])
    if block_indices is None and isinstance(block_counts, Tensor):
        raise _unsupported(op, "block_counts", "per-token counts need block_indices; selection here takes an int")
    num_selected = block_indices.shape[-1] if block_indices is not None else block_counts
    config = NSAConfig(cmp_block=block_size, cmp_stride=block_size, sel_block=block_size,
                       num_selected=num_selected, num_init=1 if num_selected > 1 else 0, num_local=1,
                       window=max(window_size, 1), scale=scale)
    indices = None
    if block_indices is not None:
        indices = block_indices[0] if packed else block_indices
        counts = block_counts if isinstance(block_counts, int) else (block_counts[0] if packed else block_counts)
        limit = _blocks_per_token(cu, q.shape[0], block_size) if packed else -(-q.shape[1] // block_size)
        indices = _fla_indices(indices, counts, limit)
    o = nsa_attention(q, k, v, g_cmp, g_slc, g_swa if window_size > 0 else None, config=config,
                      block_indices=indices, cu_seqlens=cu)
    return o[None] if packed else o
