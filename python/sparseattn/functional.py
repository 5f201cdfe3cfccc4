"""The public functions of sparseattn.

Every function takes batched tensors [B, T, H, D] or packed varlen tensors [N, H, D] with ``cu_seqlens``
(int32 [B+1] on the device of the data). Float tensors share one dtype (float16, bfloat16, float32 or
float64). ``scale=None`` means 1/sqrt(Dqk). Gates are [B, T, Hq] (packed [N, Hq]) and used as given.
Errors raise :class:`sparseattn.SparseAttnError` (a ``ValueError``) or one of its subclasses, with a message
that names the argument. CPU tensors run the C++ reference backend.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from torch import Tensor

from . import _ops
from ._errors import SparseAttnDTypeError, SparseAttnError, make_error

__all__ = [
    "NSAConfig",
    "combine",
    "compress_kv",
    "compressed_attention",
    "compressed_cu_seqlens",
    "flash_attention",
    "nsa_attention",
    "select_blocks",
    "selected_attention",
]


@dataclasses.dataclass(frozen=True)
class NSAConfig:
    """NSA hyper-parameters (defaults from the NSA paper).

    cmp_block (l) and cmp_stride (d): compressed blocks cover tokens [j*d, j*d + l); d divides l and sel_block.
    sel_block (l'): tokens per selection block, l <= l'. num_selected (n): selected blocks per query and KV head,
    the num_init initial and num_local local (forced) blocks included. window (w): sliding-window width, the
    query included. scale: softmax scale of all three branches (None: 1/sqrt(Dqk)).
    """

    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    num_selected: int = 16
    num_init: int = 1
    num_local: int = 2
    window: int = 512
    scale: Optional[float] = None


# ------------------------------------------------------------------------------------------- argument checks


def _require_tensor(op: str, name: str, t, optional: bool = False) -> None:
    if t is None and optional:
        return
    if not isinstance(t, Tensor):
        raise make_error(SparseAttnError, "value", op, name, f"expected a torch.Tensor, got {type(t).__name__}")


def _check_cu_seqlens(op: str, name: str, cu: Optional[Tensor], like: Tensor, like_name: str) -> None:
    """cu_seqlens must be an int32 [B+1] tensor on the device of the data (checked without a host sync)."""
    if cu is None:
        return
    _require_tensor(op, name, cu)
    if cu.dtype != torch.int32:
        raise make_error(SparseAttnDTypeError, "dtype", op, name,
                         f"expected dtype int32, got {str(cu.dtype).removeprefix('torch.')} "
                         f"(use {name}.to(torch.int32))")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise make_error(SparseAttnError, "shape", op, name, f"expected shape [B+1], got {list(cu.shape)}")
    if cu.device != like.device:
        raise make_error(SparseAttnError, "device", op, name,
                         f"is on {cu.device} but '{like_name}' is on {like.device}")


def _check_tokens(op: str, name: str, t: Tensor, packed: bool, cu_name: str = "cu_seqlens") -> None:
    _require_tensor(op, name, t)
    if packed and t.dim() != 3:
        raise make_error(SparseAttnError, "shape", op, name,
                         f"expected 3 dimensions [N, H, D] because {cu_name} is given, got {list(t.shape)}")
    if not packed and t.dim() != 4:
        raise make_error(SparseAttnError, "shape", op, name,
                         f"expected 4 dimensions [B, T, H, D] (or 3 dimensions [N, H, D] with {cu_name}), "
                         f"got {list(t.shape)}")


def _scale(scale) -> Optional[float]:
    return None if scale is None else float(scale)


def _max_seqlen(max_seqlen) -> int:
    return 0 if max_seqlen is None else int(max_seqlen)


# ------------------------------------------------------------------------------------------------- functions


def compressed_cu_seqlens(cu_seqlens: Tensor, block: int = 32, stride: int = 16) -> Tensor:
    """Prefix sums of the number of compressed blocks of each sequence: int32 [B+1] on cu_seqlens' device.

    A sequence of T tokens has (T - block) // stride + 1 blocks if T >= block, else 0. Pure torch ops, no
    host synchronisation.
    """
    _require_tensor("compressed_cu_seqlens", "cu_seqlens", cu_seqlens)
    _check_cu_seqlens("compressed_cu_seqlens", "cu_seqlens", cu_seqlens, cu_seqlens, "cu_seqlens")
    if block <= 0 or stride <= 0:
        raise make_error(SparseAttnError, "config", "compressed_cu_seqlens", "block" if block <= 0 else "stride",
                         f"expected positive block and stride, got {block} and {stride}")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    blocks = torch.clamp_min(torch.div(lengths - block, stride, rounding_mode="floor") + 1, 0)
    return torch.cat([cu_seqlens[:1] * 0, torch.cumsum(blocks, 0, dtype=torch.int32)])


def _cu_cmp(cu_seqlens: Tensor, block: int, stride: int) -> Tensor:
    """compressed_cu_seqlens for an op's own call. With an invalid block or stride it returns a placeholder
    so that the op's C++ validation reports the config error under the caller's argument name."""
    if block <= 0 or stride <= 0:
        return cu_seqlens
    return compressed_cu_seqlens(cu_seqlens, block, stride)


def compress_kv(k: Tensor, v: Tensor, *, block: int = 32, stride: int = 16,
                cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Mean-pool k and v over compressed blocks (block j covers tokens [j*stride, j*stride + block)).

    Batched: returns [B, Tc, Hkv, D] with Tc = (T - block) // stride + 1 if T >= block else 0. Packed:
    [N // stride, Hkv, D] with rows laid out by ``compressed_cu_seqlens(cu_seqlens, block, stride)`` (rows
    past the last sequence are zero). Differentiable w.r.t. k and v.
    """
    op = "compress_kv"
    packed = cu_seqlens is not None
    _check_tokens(op, "k", k, packed)
    _require_tensor(op, "v", v)
    _check_cu_seqlens(op, "cu_seqlens", cu_seqlens, k, "k")
    cu_cmp = _cu_cmp(cu_seqlens, block, stride) if packed else None
    return _ops.compress_kv(k, v, cu_seqlens, cu_cmp, 0, block, stride)


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int = 32, stride: int = 16,
                         scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None,
                         cu_seqlens_cmp: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of every query to the compressed blocks that end at or before it (j*stride + block - 1 <= t).

    Returns (o, lse): o like q with v_cmp's head dim; lse [B, Hq, T] (packed [Hq, N]) in float32 (float64
    for float64 inputs). A query that sees no block gets o = 0 and lse = -inf. Packed: k_cmp/v_cmp are laid
    out by ``cu_seqlens_cmp`` (default ``compressed_cu_seqlens(cu_seqlens, block, stride)``).
    Differentiable w.r.t. q, k_cmp and v_cmp (not through lse).
    """
    op = "compressed_attention"
    packed = cu_seqlens is not None
    _check_tokens(op, "q", q, packed)
    _check_tokens(op, "k_cmp", k_cmp, packed)
    _require_tensor(op, "v_cmp", v_cmp)
    _check_cu_seqlens(op, "cu_seqlens", cu_seqlens, q, "q")
    if packed and cu_seqlens_cmp is None:
        cu_seqlens_cmp = _cu_cmp(cu_seqlens, block, stride)
    _check_cu_seqlens(op, "cu_seqlens_cmp", cu_seqlens_cmp, q, "q")
    return _ops.compressed_attention(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, 0, block, stride, _scale(scale))


def select_blocks(q: Tensor, k_cmp: Tensor, lse_cmp: Tensor, *, cmp_block: int = 32, cmp_stride: int = 16,
                  sel_block: int = 64, num_selected: int = 16, num_init: int = 1, num_local: int = 2,
                  scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None,
                  cu_seqlens_cmp: Optional[Tensor] = None) -> Tensor:
    """NSA block selection from compressed-attention probabilities (shared by each query-head group).

    Returns int32 [B, T, Hkv, num_selected] (packed [N, Hkv, num_selected]): ascending block indices, -1
    padded. ``lse_cmp`` is compressed_attention's log-sum-exp for the same q, k_cmp and scale. Not
    differentiable.
    """
    op = "select_blocks"
    packed = cu_seqlens is not None
    _check_tokens(op, "q", q, packed)
    _check_tokens(op, "k_cmp", k_cmp, packed)
    _require_tensor(op, "lse_cmp", lse_cmp)
    _check_cu_seqlens(op, "cu_seqlens", cu_seqlens, q, "q")
    if packed and cu_seqlens_cmp is None:
        cu_seqlens_cmp = _cu_cmp(cu_seqlens, cmp_block, cmp_stride)
    _check_cu_seqlens(op, "cu_seqlens_cmp", cu_seqlens_cmp, q, "q")
    return _ops.select_blocks(q.detach(), k_cmp.detach(), lse_cmp.detach(), cu_seqlens, cu_seqlens_cmp, 0,
                              cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, _scale(scale))


def selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, *, block: int = 64,
                       scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of query t to the tokens at positions <= t of its KV head's selected blocks.

    ``indices``: int32 [B, T, Hkv, n] (packed [N, Hkv, n]), ascending, -1 padded; block b covers tokens
    [b*block, (b+1)*block). Returns (o, lse). Differentiable w.r.t. q, k and v.
    """
    op = "selected_attention"
    packed = cu_seqlens is not None
    _check_tokens(op, "q", q, packed)
    _check_tokens(op, "k", k, packed)
    _require_tensor(op, "v", v)
    _require_tensor(op, "indices", indices)
    _check_cu_seqlens(op, "cu_seqlens", cu_seqlens, q, "q")
    return _ops.selected_attention(q, k, v, indices.detach(), cu_seqlens, 0, block, _scale(scale))


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    window: Union[tuple[int, int], list, None] = (-1, -1), mask: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, scale: Optional[float] = None,
                    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                    return_lse: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Dense attention: s = scale*q.k + bias, kept where mask is True, the causal rule and the window allow.

    ``causal`` is bottom-right aligned when the key count differs from the query count (as FlashAttention);
    ``window=(left, right)`` keeps keys in [a - left, a + right] around the aligned position a (-1:
    unbounded). ``mask`` (bool) and ``bias`` (dtype of q) broadcast as [B|1, Hq|Hkv|1, T|1, S] (batched
    layout only). Varlen: ``cu_seqlens_q`` and ``cu_seqlens_k`` (one given alone is used for both). A row
    with no kept key returns 0 (lse -inf). Differentiable w.r.t. q, k, v and bias (dbias has bias's shape).
    Returns o, or (o, lse) with ``return_lse``.
    """
    op = "flash_attention"
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
    elif cu_seqlens_q is None:
        cu_seqlens_q = cu_seqlens_k
    packed = cu_seqlens_q is not None
    _check_tokens(op, "q", q, packed, "cu_seqlens_q")
    _check_tokens(op, "k", k, packed, "cu_seqlens_k")
    _require_tensor(op, "v", v)
    _require_tensor(op, "mask", mask, optional=True)
    _require_tensor(op, "bias", bias, optional=True)
    _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q, "q")
    _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, k, "k")
    if window is None:
        window = (-1, -1)
    if len(window) != 2:
        raise make_error(SparseAttnError, "config", op, "window", f"expected (left, right), got {window!r}")
    mask = None if mask is None else mask.detach()
    o, lse = _ops.flash_attention(q, k, v, mask, bias, cu_seqlens_q, cu_seqlens_k, _max_seqlen(max_seqlen_q),
                                  _max_seqlen(max_seqlen_k), bool(causal), int(window[0]), int(window[1]),
                                  _scale(scale))
    return (o, lse) if return_lse else o


def combine(o_cmp: Optional[Tensor], o_slc: Optional[Tensor], o_swa: Optional[Tensor], g_cmp: Optional[Tensor],
            g_slc: Optional[Tensor], g_swa: Optional[Tensor]) -> Tensor:
    """NSA's gated sum o = g_cmp*o_cmp + g_slc*o_slc + g_swa*o_swa; a branch whose gate is None is skipped."""
    for name, t in (("o_cmp", o_cmp), ("o_slc", o_slc), ("o_swa", o_swa), ("g_cmp", g_cmp), ("g_slc", g_slc),
                    ("g_swa", g_swa)):
        _require_tensor("combine", name, t, optional=True)
    # Outputs of skipped branches are not passed on (they take no part and get no gradient).
    o_cmp, o_slc, o_swa = (o if g is not None else None for o, g in ((o_cmp, g_cmp), (o_slc, g_slc), (o_swa, g_swa)))
    return _ops.combine(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)


def nsa_attention(q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor] = None, g_slc: Optional[Tensor] = None,
                  g_swa: Optional[Tensor] = None, *, config: Optional[NSAConfig] = None,
                  k_cmp: Optional[Tensor] = None, v_cmp: Optional[Tensor] = None,
                  block_indices: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
                  max_seqlen: Optional[int] = None) -> Tensor:
    """The whole Native Sparse Attention pipeline in one op.

    q [B, T, Hq, Dqk], k [B, T, Hkv, Dqk], v [B, T, Hkv, Dv] (or packed with ``cu_seqlens``); gates
    [B, T, Hq] (packed [N, Hq]), at least one given; a branch whose gate is None is skipped.
    ``k_cmp``/``v_cmp`` (both or neither): user-supplied compressed K/V instead of mean pooling
    ([B, Tc, Hkv, D]; packed laid out by ``compressed_cu_seqlens``). ``block_indices``: user-supplied
    selection (int32 [B, T, Hkv, n]) instead of top-n selection. Gradients reach q, k, v, the given gates
    and user k_cmp/v_cmp.
    """
    op = "nsa_attention"
    config = NSAConfig() if config is None else config
    if not isinstance(config, NSAConfig):
        raise make_error(SparseAttnError, "config", op, "config",
                         f"expected a sparseattn.NSAConfig, got {type(config).__name__}")
    packed = cu_seqlens is not None
    _check_tokens(op, "q", q, packed)
    _check_tokens(op, "k", k, packed)
    _require_tensor(op, "v", v)
    for name, t in (("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa), ("k_cmp", k_cmp), ("v_cmp", v_cmp),
                    ("block_indices", block_indices)):
        _require_tensor(op, name, t, optional=True)
    _check_cu_seqlens(op, "cu_seqlens", cu_seqlens, q, "q")
    cu_cmp = _cu_cmp(cu_seqlens, config.cmp_block, config.cmp_stride) if packed else None
    if block_indices is not None:
        block_indices = block_indices.detach()
    o, _workspace = _ops.nsa_attention(
        q, k, v, k_cmp, v_cmp, block_indices, g_cmp, g_slc, g_swa, cu_seqlens, cu_cmp, _max_seqlen(max_seqlen),
        int(config.cmp_block), int(config.cmp_stride), int(config.sel_block), int(config.num_selected),
        int(config.num_init), int(config.num_local), int(config.window), _scale(config.scale))
    return o
