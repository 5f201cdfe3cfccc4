"""The public functions of sparseattn.

Every function takes batched tensors [B, T, H, D] or packed varlen tensors [N, H, D] with ``cu_seqlens``
(int32 [B+1] on the device of the data). Float tensors share one dtype (float16, bfloat16, float32 or
float64). ``scale=None`` means 1/sqrt(Dqk). Gates are [B, T, Hq] (packed [N, Hq]) and used as given.
Errors raise :class:`sparseattn.SparseAttnError` (a ``ValueError``) or one of its subclasses, with a message
that names the operation and the argument, before anything is allocated or computed. CPU tensors run the C++
reference backend.

The NSA functions also take a chunk of T queries against S >= T keys (k, v or the compressed blocks of S keys):
query t then sits at key position t + S - T and gets exactly the row of the full call (T = S) there
(docs/semantics.md section 11). Batched, S comes from k (``seqlen_k`` where there is no k); packed, the keys'
sequences are ``cu_seqlens_k``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
import torch.utils.checkpoint
from torch import Tensor

from . import _C
from . import _checks as chk
from . import _ops
from . import _tiles
from . import decode as _decode
from ._errors import SparseAttnError, SparseAttnUnsupportedError, make_error

#: The (Dqk, Dv) head-dim pairs with CUDA kernels (sparseattn.CUDA_HEAD_DIMS), from the binding.
CUDA_HEAD_DIMS: tuple[tuple[int, int], ...] = tuple(tuple(pair) for pair in _C.cuda_head_dims())

__all__ = [
    "NSAConfig",
    "combine",
    "compress_kv",
    "compressed_attention",
    "compressed_cu_seqlens",
    "create_mask",
    "flash_attention",
    "nsa_attention",
    "select_blocks",
    "selected_attention",
]


@dataclasses.dataclass(frozen=True)
class NSAConfig:
    """NSA hyper-parameters (defaults from the NSA paper), validated when the config is built.

    cmp_block (l) and cmp_stride (d): compressed blocks cover tokens [j*d, j*d + l); d divides l and sel_block.
    sel_block (l'): tokens per selection block, l <= l'. num_selected (n): selected blocks per query and KV head,
    the num_init initial and num_local local (forced) blocks included. window (w): sliding-window width, the
    query included. scale: softmax scale of all three branches (None: 1/sqrt(Dqk)).

    Raises:
        SparseAttnTypeError: a field of the wrong type (the sizes and counts are ints, not bools, floats,
            strings or None; scale is a real number or None).
        SparseAttnError: a field out of range (block sizes, num_selected and window positive, num_init and
            num_local >= 0, the sizes and counts within 32-bit ints, the window within a 64-bit int, scale
            finite and positive). The constraints between fields (d divides l and l', l <= l',
            num_init + num_local <= n) are checked by the ops that use the config.

    Example:
        >>> import sparseattn
        >>> cfg = sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, window=64)
        >>> cfg.window
        64
    """

    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    num_selected: int = 16
    num_init: int = 1
    num_local: int = 2
    window: int = 512
    scale: Optional[float] = None

    def __post_init__(self):
        self._validate()

    def _validate(self) -> None:
        """Checks every field (also called by nsa_attention: a config unpickled or changed with
        object.__setattr__ skipped __post_init__)."""
        op = "NSAConfig"
        for name in ("cmp_block", "cmp_stride", "sel_block", "num_selected"):
            chk.int_arg(op, name, getattr(self, name), minimum=1)
        for name in ("num_init", "num_local"):
            chk.int_arg(op, name, getattr(self, name), minimum=0)
        chk.int_arg(op, "window", self.window, minimum=1, maximum=chk.INT64_MAX)
        chk.scale_arg(op, "scale", self.scale)


# ------------------------------------------------------------------------------------------------- functions


def _compressed_cu(cu_seqlens: Tensor, block: int, stride: int) -> Tensor:
    """compressed_cu_seqlens without its checks (block and stride validated, cu_seqlens checked by the op)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    blocks = torch.clamp_min(torch.div(lengths - block, stride, rounding_mode="floor") + 1, 0)
    return torch.cat([cu_seqlens[:1] * 0, torch.cumsum(blocks, 0, dtype=torch.int32)])


def compressed_cu_seqlens(cu_seqlens: Tensor, block: int = 32, stride: int = 16) -> Tensor:
    """Prefix sums of the number of compressed blocks of each sequence.

    A sequence of T tokens has (T - block) // stride + 1 compressed blocks if T >= block, else 0. This is the
    layout of packed compressed K/V (``cu_seqlens_cmp``). Pure torch ops, no host synchronisation.

    Args:
        cu_seqlens: int32 [B+1], the token prefix sums: starts at 0, non-decreasing.
        block: tokens per compressed block (l), a positive int.
        stride: tokens between the starts of two blocks (d), a positive int.

    Returns:
        int32 [B+1] on cu_seqlens' device.

    Raises:
        SparseAttnTypeError: cu_seqlens is not a tensor, block or stride not an int.
        SparseAttnDTypeError: cu_seqlens is not int32.
        SparseAttnError: cu_seqlens is not 1-D with at least one entry; block or stride not positive or
            beyond 32 bits; on the CPU, cu_seqlens does not start at 0 or decreases (CUDA tensors are not
            read: that would synchronise).

    Example:
        >>> import torch, sparseattn
        >>> cu = torch.tensor([0, 32, 96, 106], dtype=torch.int32)
        >>> sparseattn.compressed_cu_seqlens(cu, block=32, stride=16).tolist()
        [0, 1, 4, 4]
    """
    op = "compressed_cu_seqlens"
    chk.tensor_arg(op, "cu_seqlens", cu_seqlens, kind="int32")
    chk.cu_seqlens_arg(op, "cu_seqlens", cu_seqlens)
    block = chk.int_arg(op, "block", block, minimum=1)
    stride = chk.int_arg(op, "stride", stride, minimum=1)
    chk.cu_seqlens_contents(op, "cu_seqlens", cu_seqlens)
    return _compressed_cu(cu_seqlens, block, stride)


def compress_kv(k: Tensor, v: Tensor, *, block: int = 32, stride: int = 16,
                cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Mean-pool k and v over compressed blocks (block j covers tokens [j*stride, j*stride + block)).

    Differentiable w.r.t. k and v.

    Args:
        k: [B, T, Hkv, Dqk], or packed [N, Hkv, Dqk] with cu_seqlens.
        v: [B, T, Hkv, Dv] (packed [N, Hkv, Dv]), the dtype and device of k.
        block: tokens per compressed block (l); stride must divide it.
        stride: tokens between the starts of two blocks (d).
        cu_seqlens: int32 [B+1] for the packed layout, None for the batched one.

    Returns:
        (k_cmp, v_cmp). Batched: [B, Tc, Hkv, D] with Tc = (T - block) // stride + 1 if T >= block else 0.
        Packed: [N // stride, Hkv, D], rows laid out by ``compressed_cu_seqlens(cu_seqlens, block, stride)``
        (rows past the last sequence are zero).

    Raises:
        SparseAttnTypeError: an argument of the wrong type (a tensor, an int or None expected).
        SparseAttnDTypeError: k or v not floating point, or of different dtypes; cu_seqlens not int32.
        SparseAttnError: wrong ranks or sizes, mixed devices, block/stride not positive (or stride not
            dividing block), bad cu_seqlens contents (checked on the CPU).
        SparseAttnUnsupportedError: CUDA tensors with a build that has no CUDA kernels.

    Example:
        >>> import torch, sparseattn
        >>> k, v = torch.randn(2, 40, 2, 16), torch.randn(2, 40, 2, 8)
        >>> k_cmp, v_cmp = sparseattn.compress_kv(k, v, block=16, stride=8)
        >>> tuple(k_cmp.shape), tuple(v_cmp.shape)
        ((2, 4, 2, 16), (2, 4, 2, 8))
    """
    op = "compress_kv"
    block = chk.int_arg(op, "block", block, minimum=1)
    stride = chk.int_arg(op, "stride", stride, minimum=1)
    chk.cu_seqlens_arg(op, "cu_seqlens", cu_seqlens)
    packed = cu_seqlens is not None
    chk.tokens_arg(op, "k", k, packed)
    chk.tensor_arg(op, "v", v)
    chk.same_rank(op, "v", v, k, "k")
    chk.devices(op, k, "k", [("v", v), ("cu_seqlens", cu_seqlens)])
    cu_cmp = _compressed_cu(cu_seqlens, block, stride) if packed else None
    return _ops.compress_kv(k, v, cu_seqlens, cu_cmp, 0, block, stride)


def _cu_seqlens_cmp(cu_seqlens: Optional[Tensor], cu_seqlens_cmp: Optional[Tensor], block: int,
                    stride: int, cu_seqlens_k: Optional[Tensor] = None) -> Optional[Tensor]:
    """The caller's cu_seqlens_cmp, or the one compressed_cu_seqlens derives from the keys' sequences (packed)."""
    if cu_seqlens_cmp is not None or cu_seqlens is None:
        return cu_seqlens_cmp
    return _compressed_cu(cu_seqlens if cu_seqlens_k is None else cu_seqlens_k, block, stride)


def compressed_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, *, block: int = 32, stride: int = 16,
                         scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None,
                         cu_seqlens_cmp: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                         seqlen_k: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Attention of every query to the compressed blocks that end at or before it (j*stride + block - 1 <= t).

    A query that sees no block gets o = 0 and lse = -inf. Differentiable w.r.t. q, k_cmp and v_cmp (not
    through lse). For a query chunk (S >= T keys, whose compressed blocks k_cmp holds), t is the query's key
    position t + S - T.

    Args:
        q: [B, T, Hq, Dqk], or packed [N, Hq, Dqk] with cu_seqlens.
        k_cmp: [B, Tc, Hkv, Dqk] (packed [Nc, Hkv, Dqk]), e.g. from :func:`compress_kv`; Hkv divides Hq.
        v_cmp: [B, Tc, Hkv, Dv] (packed [Nc, Hkv, Dv]).
        block, stride: the compression the blocks came from (l, d).
        scale: softmax scale, a finite positive number; None: 1/sqrt(Dqk).
        cu_seqlens: int32 [B+1] for the packed layout.
        cu_seqlens_cmp: int32 [B+1], the packed layout of k_cmp/v_cmp (default
            ``compressed_cu_seqlens(cu_seqlens_k or cu_seqlens, block, stride)``).
        cu_seqlens_k: int32 [B+1], packed query chunks: the keys' sequences, S_b >= T_b keys each (needs
            cu_seqlens). None: the keys are q's.
        seqlen_k: batched query chunks: S >= T keys per sequence (k_cmp is [B, (S - block) // stride + 1, ...]).
            None: S = T.

    Returns:
        (o, lse): o like q with v_cmp's head dim; lse [B, Hq, T] (packed [Hq, N]) in float32 (float64 for
        float64 inputs).

    Raises:
        SparseAttnTypeError: an argument of the wrong type.
        SparseAttnDTypeError: non-float or mismatched dtypes, index tensors not int32.
        SparseAttnError: wrong ranks or sizes (heads, head dims, Tc), mixed devices, bad block/stride/scale,
            bad cu_seqlens or cu_seqlens_cmp (contents checked on the CPU).
        SparseAttnUnsupportedError: CUDA tensors this build or its kernels do not take.

    Example:
        >>> import torch, sparseattn
        >>> q, k, v = torch.randn(1, 40, 4, 16), torch.randn(1, 40, 2, 16), torch.randn(1, 40, 2, 16)
        >>> k_cmp, v_cmp = sparseattn.compress_kv(k, v, block=16, stride=8)
        >>> o, lse = sparseattn.compressed_attention(q, k_cmp, v_cmp, block=16, stride=8)
        >>> tuple(o.shape), tuple(lse.shape), lse.dtype
        ((1, 40, 4, 16), (1, 4, 40), torch.float32)
        >>> o8, _ = sparseattn.compressed_attention(q[:, -8:], k_cmp, v_cmp, block=16, stride=8, seqlen_k=40)
        >>> torch.equal(o8, o[:, -8:])  # the last 8 queries against all 40 keys: the full call's last rows
        True
    """
    op = "compressed_attention"
    block = chk.int_arg(op, "block", block, minimum=1)
    stride = chk.int_arg(op, "stride", stride, minimum=1)
    scale = chk.scale_arg(op, "scale", scale)
    seqlen_k = chk.optional_int_arg(op, "seqlen_k", seqlen_k, minimum=0)
    chk.cu_seqlens_arg(op, "cu_seqlens", cu_seqlens)
    chk.cu_seqlens_arg(op, "cu_seqlens_cmp", cu_seqlens_cmp)
    chk.cu_seqlens_arg(op, "cu_seqlens_k", cu_seqlens_k)
    packed = cu_seqlens is not None
    chk.tokens_arg(op, "q", q, packed)
    chk.tokens_arg(op, "k_cmp", k_cmp, packed)
    chk.tensor_arg(op, "v_cmp", v_cmp)
    chk.same_rank(op, "v_cmp", v_cmp, k_cmp, "k_cmp")
    chk.devices(op, q, "q", [("k_cmp", k_cmp), ("v_cmp", v_cmp), ("cu_seqlens", cu_seqlens),
                             ("cu_seqlens_cmp", cu_seqlens_cmp), ("cu_seqlens_k", cu_seqlens_k)])
    cu_seqlens_cmp = _cu_seqlens_cmp(cu_seqlens, cu_seqlens_cmp, block, stride, cu_seqlens_k)
    return _ops.compressed_attention(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, 0, block, stride, scale,
                                     cu_seqlens_k, seqlen_k)


def select_blocks(q: Tensor, k_cmp: Tensor, lse_cmp: Tensor, *, cmp_block: int = 32, cmp_stride: int = 16,
                  sel_block: int = 64, num_selected: int = 16, num_init: int = 1, num_local: int = 2,
                  scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None,
                  cu_seqlens_cmp: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                  seqlen_k: Optional[int] = None) -> Tensor:
    """NSA block selection from compressed-attention probabilities (shared by each query-head group).

    Each query ranks the selection blocks it can see by the compressed-attention probability mass they cover,
    summed over the query heads of its KV head, and keeps the top ``num_selected``, the ``num_init`` first
    and ``num_local`` last (current) blocks always included. Not differentiable. A query chunk (S >= T keys)
    applies every rule at the query's key position t + S - T.

    Args:
        q: [B, T, Hq, Dqk], or packed [N, Hq, Dqk] with cu_seqlens.
        k_cmp: [B, Tc, Hkv, Dqk] (packed [Nc, Hkv, Dqk]), compressed keys.
        lse_cmp: compressed_attention's log-sum-exp for the same q, k_cmp and scale: [B, Hq, T] (packed
            [Hq, N]), float32 (float64 for float64 q).
        cmp_block, cmp_stride: the compression (l, d); d divides l and sel_block.
        sel_block: tokens per selection block (l' >= l).
        num_selected: blocks per row (n >= num_init + num_local).
        num_init, num_local: forced initial and local blocks (>= 0).
        scale: softmax scale, as given to compressed_attention; None: 1/sqrt(Dqk).
        cu_seqlens, cu_seqlens_cmp: the packed layouts (cu_seqlens_cmp defaults to
            ``compressed_cu_seqlens(cu_seqlens_k or cu_seqlens, cmp_block, cmp_stride)``).
        cu_seqlens_k: int32 [B+1], packed query chunks: the keys' sequences, S_b >= T_b keys each (needs
            cu_seqlens). None: the keys are q's.
        seqlen_k: batched query chunks: S >= T keys per sequence, whose compressed blocks k_cmp holds. None: S = T.

    Returns:
        int32 [B, T, Hkv, num_selected] (packed [N, Hkv, num_selected]): ascending block indices, -1 padded.

    Raises:
        SparseAttnTypeError: an argument of the wrong type.
        SparseAttnDTypeError: non-float or mismatched dtypes (lse_cmp's included), index tensors not int32.
        SparseAttnError: wrong ranks or sizes, mixed devices, an inconsistent configuration, bad cu_seqlens.
        SparseAttnUnsupportedError: CUDA tensors or a configuration the CUDA kernel does not take.

    Example:
        >>> import torch, sparseattn
        >>> q, k, v = torch.randn(1, 64, 4, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
        >>> k_cmp, v_cmp = sparseattn.compress_kv(k, v, block=16, stride=8)
        >>> _, lse = sparseattn.compressed_attention(q, k_cmp, v_cmp, block=16, stride=8)
        >>> idx = sparseattn.select_blocks(q, k_cmp, lse, cmp_block=16, cmp_stride=8, sel_block=32,
        ...                                num_selected=2, num_init=1, num_local=1)
        >>> tuple(idx.shape), idx[0, 63, 0].tolist()
        ((1, 64, 2, 2), [0, 1])
        >>> last = sparseattn.select_blocks(q[:, -1:], k_cmp, lse[:, :, -1:], cmp_block=16, cmp_stride=8,
        ...                                 sel_block=32, num_selected=2, num_init=1, num_local=1, seqlen_k=64)
        >>> torch.equal(last, idx[:, -1:])  # query 63 alone against its 64 keys: the same blocks
        True
    """
    op = "select_blocks"
    cmp_block = chk.int_arg(op, "cmp_block", cmp_block, minimum=1)
    cmp_stride = chk.int_arg(op, "cmp_stride", cmp_stride, minimum=1)
    sel_block = chk.int_arg(op, "sel_block", sel_block, minimum=1)
    num_selected = chk.int_arg(op, "num_selected", num_selected, minimum=1)
    num_init = chk.int_arg(op, "num_init", num_init, minimum=0)
    num_local = chk.int_arg(op, "num_local", num_local, minimum=0)
    scale = chk.scale_arg(op, "scale", scale)
    seqlen_k = chk.optional_int_arg(op, "seqlen_k", seqlen_k, minimum=0)
    chk.cu_seqlens_arg(op, "cu_seqlens", cu_seqlens)
    chk.cu_seqlens_arg(op, "cu_seqlens_cmp", cu_seqlens_cmp)
    chk.cu_seqlens_arg(op, "cu_seqlens_k", cu_seqlens_k)
    packed = cu_seqlens is not None
    chk.tokens_arg(op, "q", q, packed)
    chk.tokens_arg(op, "k_cmp", k_cmp, packed)
    chk.tensor_arg(op, "lse_cmp", lse_cmp)
    chk.devices(op, q, "q", [("k_cmp", k_cmp), ("lse_cmp", lse_cmp), ("cu_seqlens", cu_seqlens),
                             ("cu_seqlens_cmp", cu_seqlens_cmp), ("cu_seqlens_k", cu_seqlens_k)])
    cu_seqlens_cmp = _cu_seqlens_cmp(cu_seqlens, cu_seqlens_cmp, cmp_block, cmp_stride, cu_seqlens_k)
    return _ops.select_blocks(q.detach(), k_cmp.detach(), lse_cmp.detach(), cu_seqlens, cu_seqlens_cmp, 0,
                              cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, scale,
                              None if cu_seqlens_k is None else cu_seqlens_k.detach(), seqlen_k)


def selected_attention(q: Tensor, k: Tensor, v: Tensor, indices: Tensor, *, block: int = 64,
                       scale: Optional[float] = None, cu_seqlens: Optional[Tensor] = None,
                       cu_seqlens_k: Optional[Tensor] = None,
                       max_seqlen_k: Optional[int] = None) -> tuple[Tensor, Tensor]:
    """Attention of query t to the tokens at positions <= t of its KV head's selected blocks.

    Differentiable w.r.t. q, k and v. For a query chunk (k and v longer than q), t is the query's key position
    t + S - T.

    Args:
        q: [B, T, Hq, Dqk], or packed [N, Hq, Dqk] with cu_seqlens.
        k: [B, S, Hkv, Dqk] with S >= T (packed [Nk, Hkv, Dqk]); Hkv divides Hq.
        v: [B, S, Hkv, Dv] (packed [Nk, Hkv, Dv]).
        indices: int32 [B, T, Hkv, n] (packed [N, Hkv, n]): per row, ascending block indices, -1 padded at
            the end (as :func:`select_blocks` returns). Block b covers tokens [b*block, (b+1)*block).
        block: tokens per selection block (l'), a positive int.
        scale: softmax scale; None: 1/sqrt(Dqk).
        cu_seqlens: int32 [B+1] for the packed layout.
        cu_seqlens_k: int32 [B+1], packed query chunks: the keys' sequences, S_b >= T_b keys each (needs
            cu_seqlens). None: the keys are q's.
        max_seqlen_k: an upper bound of the keys' packed lengths (None or 0: not known).

    Returns:
        (o, lse): o [B, T, Hq, Dv] (packed [N, Hq, Dv]); lse [B, Hq, T] (packed [Hq, N]) in float32
        (float64 for float64 inputs).

    Raises:
        SparseAttnTypeError: an argument of the wrong type.
        SparseAttnDTypeError: non-float or mismatched dtypes; indices or cu_seqlens not int32 (convert
            int64 indices with ``indices.int()``).
        SparseAttnError: wrong ranks or sizes, mixed devices, bad block or scale, bad cu_seqlens, indices not
            ascending or out of range (contents checked on the CPU).
        SparseAttnUnsupportedError: CUDA tensors this build or its kernels do not take.

    Example:
        >>> import torch, sparseattn
        >>> q, k, v = torch.randn(1, 64, 4, 16), torch.randn(1, 64, 2, 16), torch.randn(1, 64, 2, 16)
        >>> idx = torch.tensor([0, -1], dtype=torch.int32).expand(1, 64, 2, 2)  # block 0 only
        >>> o, lse = sparseattn.selected_attention(q, k, v, idx, block=32)
        >>> tuple(o.shape)
        (1, 64, 4, 16)
        >>> o1, _ = sparseattn.selected_attention(q[:, -1:], k, v, idx[:, -1:], block=32)  # a decoding step
        >>> torch.equal(o1, o[:, -1:])
        True
    """
    op = "selected_attention"
    block = chk.int_arg(op, "block", block, minimum=1)
    scale = chk.scale_arg(op, "scale", scale)
    max_seqlen_k = chk.optional_int_arg(op, "max_seqlen_k", max_seqlen_k, minimum=0)
    chk.cu_seqlens_arg(op, "cu_seqlens", cu_seqlens)
    chk.cu_seqlens_arg(op, "cu_seqlens_k", cu_seqlens_k)
    packed = cu_seqlens is not None
    chk.tokens_arg(op, "q", q, packed)
    chk.tokens_arg(op, "k", k, packed)
    chk.tensor_arg(op, "v", v)
    chk.same_rank(op, "v", v, k, "k")
    chk.tensor_arg(op, "indices", indices, kind="int32")
    chk.devices(op, q, "q", [("k", k), ("v", v), ("indices", indices), ("cu_seqlens", cu_seqlens),
                             ("cu_seqlens_k", cu_seqlens_k)])
    return _ops.selected_attention(q, k, v, indices.detach(), cu_seqlens, 0, block, scale,
                                   None if cu_seqlens_k is None else cu_seqlens_k.detach(), max_seqlen_k)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                    window: Union[tuple[int, int], list, None] = (-1, -1), mask: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, scale: Optional[float] = None,
                    cu_seqlens_q: Optional[Tensor] = None, cu_seqlens_k: Optional[Tensor] = None,
                    max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                    return_lse: bool = False, alpha: Optional[Tensor] = None, delta: Optional[Tensor] = None,
                    gate: str = "logsigmoid", gate_threshold: Optional[float] = None,
                    softmax_threshold: Optional[float] = None,
                    threshold_block: Union[tuple[int, int], list] = (128, 128), block_mask=None,
                    block_size: Union[tuple[int, int], list, None] = None, kv_num_blocks: Optional[Tensor] = None,
                    kv_indices: Optional[Tensor] = None, full_kv_num_blocks: Optional[Tensor] = None,
                    full_kv_indices: Optional[Tensor] = None) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Dense attention: s = scale*q.k + bias, kept where mask is True, the causal rule and the window allow.

    ``causal`` is bottom-right aligned when the key count differs from the query count (as FlashAttention).
    A row with no kept key returns 0 (lse -inf). Differentiable w.r.t. q, k, v, bias (dbias has bias's
    shape, summed deterministically over its broadcast dims), alpha and delta. On CUDA, calls of 1 to 16 queries
    that need no gradient and no optional feature run the split-KV decode kernel (:func:`sparseattn.flash_decode`).

    Gated attention (``alpha`` and ``delta``; CPU and CUDA, forward and backward) makes the logits
    scale*(q.k + g) with g = logsigmoid(alpha_t*delta_s) (or the product). ``gate_threshold`` (CPU and CUDA,
    where its decisions become a block-sparse tile map; with a block-sparse mask both must use the same tiles) and
    ``softmax_threshold`` skip (query tile, key tile) pairs of ``threshold_block`` (docs/semantics.md section 8);
    the result depends on the tile sizes. On CUDA the forward kernel decides ``softmax_threshold`` in its own tiles,
    so ``threshold_block`` must be them (128 x 128 on sm_90a for head dims (64, 64), (128, 128), (192, 128); the
    mma.sync kernels' tiles otherwise: ``sparseattn._C.flash_attention_threshold_tiles(q, v)`` gives them), and
    equal ``block_size`` with a block-sparse mask; the backward follows the forward's recorded decisions.

    Block-sparse masks say which (query tile, key tile) pairs of ``block_size`` exist: a dense tile mask
    ``block_mask`` (bool, or uint8 with 0 absent, 1 exists, 2 exists and full), or FlexAttention's lists (``kv_num_blocks``/``kv_indices``, optionally
    ``full_kv_num_blocks``/``full_kv_indices`` for tiles whose element mask is not read), or a
    ``torch.nn.attention.flex_attention.BlockMask`` as ``block_mask`` (its lists and ``BLOCK_SIZE``; its
    ``mask_mod`` is not evaluated). Keys of absent tiles are hidden and get no gradient. On CUDA, the lists are
    turned into the tile map on the device (entries out of range are dropped there, not reported: no host
    synchronisation), a batched element mask is summarised into tiles so that all-False tiles are skipped, and
    tiles that hold no kept key are neither loaded nor computed.

    Args:
        q: [B, T, Hq, Dqk], or packed [Nq, Hq, Dqk] with cu_seqlens_q.
        k: [B, S, Hkv, Dqk] (packed [Nk, Hkv, Dqk]); Hkv divides Hq.
        v: [B, S, Hkv, Dv] (packed [Nk, Hkv, Dv]).
        causal: a bool; keep keys at or before the aligned position a = t + S - T.
        window: (left, right): keep keys in [a - left, a + right]; a negative side (-1) is unbounded. Each
            side is an int, or an int32 [Hq] tensor of per-head bounds on q's device (-1 unbounded; CPU and
            CUDA, forward and backward; on CUDA the entries are not checked, a negative one is unbounded, and
            short no-grad calls with them do not take the decode kernel). None is (-1, -1).
        mask: bool, broadcast as [B|1, Hq|Hkv|1, T|1, S]; True keeps. Packed: the row
            form [Hm|1, Nq|1, Lk] (column j is key j of the row's own sequence; Lk at least every key count)
            or the key form [Hm|1, Nk] (entry m applies to packed key m for every query of its sequence),
            told apart by rank; Hm is Hq, Hkv or 1.
        bias: dtype of q, shaped like mask (either packed form, chosen independently of mask's); dbias has
            its shape, 0 on entries no sequence reads.
        scale: softmax scale; None: 1/sqrt(Dqk).
        cu_seqlens_q, cu_seqlens_k: int32 [B+1] for the packed layout; one given alone is used for both.
        max_seqlen_q, max_seqlen_k: upper bounds of the packed lengths (None or 0: not known).
        return_lse: also return the log-sum-exp.
        alpha: query-side gate, [B, T, Hq] (packed [Nq, Hq]), dtype of q or float32; needs delta.
        delta: key-side gate, [B, S, Hkv] (packed [Nk, Hkv]), dtype of q or float32; needs alpha.
        gate: "logsigmoid" (g = logsigmoid(alpha*delta), the default) or "product" (g = alpha*delta).
        gate_threshold: a float or None; skip a tile pair whose upper bound on g is below it (needs alpha).
        softmax_threshold: tau in (0, 1] or None; skip a key tile whose largest logit is below every row's
            running maximum + log(tau_row) (tau_row = tau*(a+1)/S when causal). None is plain attention.
        threshold_block: (block_q, block_k) positive ints, the tiles of both thresholds, aligned to each
            sequence's first query and key.
        block_mask: a tile mask [B|1, Hq|Hkv|1, nQ, nK], bool (True: the tile exists) or uint8 (0 absent, 1
            exists, 2 full: its element mask is not read); B counts sequences when packed (packed on CUDA:
            max_seqlen_q and max_seqlen_k are required). Or a FlexAttention BlockMask. Needs ``block_size``
            unless a BlockMask gives it.
        block_size: (bq, bk) positive ints, the tiles of the block-sparse mask, aligned to each sequence's first
            query and key; None unless a block-sparse mask is given.
        kv_num_blocks: int32 [B|1, Hq|Hkv|1, nQ]: query tile i has the key tiles kv_indices[..., i, :count].
        kv_indices: int32 [B|1, Hq|Hkv|1, nQ, maxK], strictly ascending within each count.
        full_kv_num_blocks, full_kv_indices: like the two above, listing full tiles (the element mask is not
            read there); disjoint from the partial lists.

    Returns:
        o [B, T, Hq, Dv] (packed [Nq, Hq, Dv]), or (o, lse) with ``return_lse``; lse [B, Hq, T] (packed
        [Hq, Nq]) in float32 (float64 for float64 inputs).

    Raises:
        SparseAttnTypeError: an argument of the wrong type (e.g. ``window=5``, ``causal="yes"``,
            ``gate_threshold="1"``).
        SparseAttnDTypeError: non-float or mismatched dtypes, a non-bool mask, cu_seqlens not int32.
        SparseAttnError: wrong ranks or sizes, mixed devices, a packed mask/bias narrower than a sequence, bad
            scale or max_seqlen, bad cu_seqlens (contents checked on the CPU), alpha without delta, an
            unknown gate, softmax_threshold outside (0, 1], a non-positive threshold_block; a block-sparse mask
            in two forms, without block_size, of the wrong shape or with bad list contents (out-of-range,
            repeated or descending tiles, a tile both partial and full).
        SparseAttnUnsupportedError: CUDA tensors this build or its kernels do not take (on CUDA: a threshold
            whose threshold_block differs from block_size, and softmax_threshold with a threshold_block other than
            the forward kernel's tiles).

    Example:
        >>> import torch, sparseattn
        >>> q, k, v = torch.randn(2, 10, 4, 16), torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 8)
        >>> o, lse = sparseattn.flash_attention(q, k, v, causal=True, window=(3, 0), return_lse=True)
        >>> tuple(o.shape), tuple(lse.shape)
        ((2, 10, 4, 8), (2, 4, 10))
        >>> alpha, delta = torch.randn(2, 10, 4), torch.randn(2, 10, 2)
        >>> o = sparseattn.flash_attention(q, k, v, causal=True, alpha=alpha, delta=delta,
        ...                                softmax_threshold=0.01, threshold_block=(4, 4))
        >>> tuple(o.shape)
        (2, 10, 4, 8)
        >>> tiles = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)[None, None]
        >>> o = sparseattn.flash_attention(q, k, v, causal=True, block_mask=tiles, block_size=(4, 4))
        >>> tuple(o.shape)
        (2, 10, 4, 8)
    """
    op = "flash_attention"
    causal = chk.bool_arg(op, "causal", causal)
    return_lse = chk.bool_arg(op, "return_lse", return_lse)
    window_left, window_right, window_left_heads, window_right_heads = chk.flash_window_arg(op, "window", window)
    scale = chk.scale_arg(op, "scale", scale)
    max_seqlen_q = chk.optional_int_arg(op, "max_seqlen_q", max_seqlen_q, minimum=0)
    max_seqlen_k = chk.optional_int_arg(op, "max_seqlen_k", max_seqlen_k, minimum=0)
    block_size = chk.optional_block_pair_arg(op, "block_size", block_size)
    if block_mask is not None and not isinstance(block_mask, Tensor):
        block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_size = _from_block_mask(
            op, block_mask, block_size, (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices))
    for name, t in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices),
                    ("full_kv_num_blocks", full_kv_num_blocks), ("full_kv_indices", full_kv_indices)):
        chk.tensor_arg(op, name, t, optional=True, kind="int32")
    chk.tensor_arg(op, "block_mask", block_mask, optional=True, kind="tile_states")
    block_tensors = (block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    if block_size is None and any(t is not None for t in block_tensors):
        raise chk.config_error(op, "block_size", "is required with a block-sparse mask (block_mask or the lists)")
    block_q, block_k = block_size if block_size is not None else (0, 0)
    gate = chk.choice_arg(op, "gate", gate, ("logsigmoid", "product"))
    gate_threshold = chk.optional_float_arg(op, "gate_threshold", gate_threshold)
    softmax_threshold = chk.optional_float_arg(op, "softmax_threshold", softmax_threshold)
    threshold_block_q, threshold_block_k = chk.block_pair_arg(op, "threshold_block", threshold_block)
    chk.cu_seqlens_arg(op, "cu_seqlens_q", cu_seqlens_q)
    chk.cu_seqlens_arg(op, "cu_seqlens_k", cu_seqlens_k)
    if cu_seqlens_k is None:
        cu_seqlens_k = cu_seqlens_q
    elif cu_seqlens_q is None:
        cu_seqlens_q = cu_seqlens_k
    packed = cu_seqlens_q is not None
    chk.tokens_arg(op, "q", q, packed, "cu_seqlens_q")
    chk.tokens_arg(op, "k", k, packed, "cu_seqlens_k")
    chk.tensor_arg(op, "v", v)
    chk.same_rank(op, "v", v, k, "k")
    chk.tensor_arg(op, "mask", mask, optional=True, kind="bool")
    chk.tensor_arg(op, "bias", bias, optional=True)
    chk.tensor_arg(op, "alpha", alpha, optional=True)
    chk.tensor_arg(op, "delta", delta, optional=True)
    chk.devices(op, q, "q", [("k", k), ("v", v), ("mask", mask), ("bias", bias), ("cu_seqlens_q", cu_seqlens_q),
                             ("cu_seqlens_k", cu_seqlens_k), ("alpha", alpha), ("delta", delta),
                             ("block_mask", block_mask), ("kv_num_blocks", kv_num_blocks),
                             ("kv_indices", kv_indices), ("full_kv_num_blocks", full_kv_num_blocks),
                             ("full_kv_indices", full_kv_indices), ("window_left", window_left_heads),
                             ("window_right", window_right_heads)])
    mask = None if mask is None else mask.detach()
    block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices = (
        None if t is None else t.detach() for t in block_tensors)
    if _decode_shaped(q, k, v, packed, (mask, bias, alpha, delta, gate_threshold, softmax_threshold, *block_tensors,
                                        window_left_heads, window_right_heads)):
        return _decode.flash_decode(q, k, v, causal=causal, window=(window_left, window_right), scale=scale,
                                    return_lse=return_lse)
    if q.is_cuda:
        if softmax_threshold is not None and any(t is not None for t in block_tensors) and (
                (block_q, block_k) != (threshold_block_q, threshold_block_k)):
            raise make_error(SparseAttnUnsupportedError, "unsupported", op, "threshold_block",
                             f"{(threshold_block_q, threshold_block_k)} differs from block_size {(block_q, block_k)}: "
                             "on CUDA softmax_threshold and a block-sparse mask must use the same tiles")
        gate_states = None
        if gate_threshold is not None and _gate_shapes_fit(q, k, alpha, delta, packed):
            # The CUDA kernels take the gate threshold as the tile map of its decisions (see _cuda_gate_threshold).
            gate_states, block_q, block_k = _cuda_gate_threshold(
                op, q, alpha, delta, gate_threshold, gate, (threshold_block_q, threshold_block_k), block_tensors,
                block_q, block_k, packed, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            gate_threshold = None
        given_map = gate_states if all(t is None for t in block_tensors) else block_mask
        # With softmax_threshold the kernels' tile map uses the threshold's tiles (the backward adds its decisions).
        summary_tiles = _DEFAULT_MASK_TILES if softmax_threshold is None else (threshold_block_q, threshold_block_k)
        block_mask, block_q, block_k = _cuda_tile_states(q, k, mask, given_map, kv_num_blocks, kv_indices,
                                                         full_kv_num_blocks, full_kv_indices, block_q, block_k,
                                                         packed, max_seqlen_q, max_seqlen_k, summary_tiles)
        if gate_states is not None and given_map is not gate_states:
            block_mask = _tiles.keep_where(block_mask, gate_states)
        kv_num_blocks = kv_indices = full_kv_num_blocks = full_kv_indices = None
    o, lse = _ops.flash_attention(q, k, v, mask, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  causal, window_left, window_right, scale, alpha, delta, gate, gate_threshold,
                                  softmax_threshold, threshold_block_q, threshold_block_k, block_mask,
                                  kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_q, block_k,
                                  window_left_heads, window_right_heads)
    return (o, lse) if return_lse else o


def _decode_shaped(q: Tensor, k: Tensor, v: Tensor, packed: bool, features: tuple) -> bool:
    """Whether a flash_attention call goes to the split-KV decode kernel (sparseattn.decode.flash_decode): CUDA,
    batched, 1 to 16 queries, a dtype and head dims the kernels take, none of the optional `features` (mask,
    bias, gates, thresholds, block-sparse masks, per-head windows) given, and no gradient to compute (the decode
    kernel has no backward). The result is the same attention."""
    if not q.is_cuda or packed or q.dim() != 4 or not 1 <= q.shape[1] <= 16 or q.dtype not in _DECODE_DTYPES:
        return False
    if any(feature is not None for feature in features):
        return False
    if (q.shape[-1], v.shape[-1]) not in CUDA_HEAD_DIMS:
        return False
    consistent = (k.dim() == 4 and v.dim() == 4 and k.shape[0] == q.shape[0] and k.shape[2] > 0
                  and q.shape[2] % k.shape[2] == 0 and k.shape[3] == q.shape[3] and v.shape[:3] == k.shape[:3]
                  and k.dtype == q.dtype == v.dtype and k.device == q.device == v.device)
    if not consistent:
        return False  # flash_attention's own checks name the problem
    return not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


_DECODE_DTYPES = (torch.float16, torch.bfloat16)


def _cuda_tile_states(q: Tensor, k: Tensor, mask: Optional[Tensor], block_mask: Optional[Tensor],
                      kv_num_blocks: Optional[Tensor], kv_indices: Optional[Tensor],
                      full_kv_num_blocks: Optional[Tensor], full_kv_indices: Optional[Tensor], block_q: int,
                      block_k: int, packed: bool, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                      summary_tiles: tuple[int, int] = (128, 128)):
    """The one tile-state map (uint8, _tiles.py) and tile sizes that the CUDA kernels read, from the block-sparse
    mask in any of its forms and the summary of a batched element mask (in summary_tiles when no block-sparse mask
    gives the tiles); (None, 0, 0) when neither is given."""
    if packed:
        rows = max_seqlen_q or q.shape[0]
        keys = max_seqlen_k or k.shape[0]
    else:
        rows, keys = q.shape[1], k.shape[1]
    given = None
    if block_mask is not None:
        given = _tiles.from_bool(block_mask) if block_mask.dtype == torch.bool else block_mask
    elif kv_num_blocks is not None and kv_indices is not None:
        given = _tiles.from_lists(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
                                  _tiles.tile_counts(keys, block_k))
    if mask is None or mask.dim() != 4:
        return given, block_q, block_k
    if given is None:
        block_q, block_k = summary_tiles
        n_q, n_k = _tiles.tile_counts(rows, block_q), _tiles.tile_counts(keys, block_k)
    else:
        n_q, n_k = given.shape[-2], given.shape[-1]
        if given.dim() != 4 or n_q < _tiles.tile_counts(rows, block_q) or n_k < _tiles.tile_counts(keys, block_k):
            return given, block_q, block_k  # the C++ API reports the shape
    summary = _tiles.from_mask(mask, block_q, block_k, n_q, n_k)
    return (summary.contiguous() if given is None else _tiles.combine(given, summary)), block_q, block_k


def _gate_shapes_fit(q: Tensor, k: Tensor, alpha: Optional[Tensor], delta: Optional[Tensor], packed: bool) -> bool:
    """Whether alpha and delta have the shapes the gate threshold's tile map needs; otherwise the C++ API names the
    problem."""
    if alpha is None or delta is None or not alpha.is_floating_point() or not delta.is_floating_point():
        return False
    if packed:
        return (q.dim() == 3 and k.dim() == 3 and tuple(alpha.shape) == (q.shape[0], q.shape[1])
                and tuple(delta.shape) == (k.shape[0], k.shape[1]) and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0)
    return (q.dim() == 4 and k.dim() == 4 and tuple(alpha.shape) == (q.shape[0], q.shape[1], q.shape[2])
            and tuple(delta.shape) == (k.shape[0], k.shape[1], k.shape[2]) and k.shape[2] > 0
            and q.shape[2] % k.shape[2] == 0)


def _cuda_gate_threshold(op: str, q: Tensor, alpha: Tensor, delta: Tensor, threshold: float, gate: str,
                         threshold_block: tuple[int, int], block_tensors: tuple, block_q: int, block_k: int,
                         packed: bool, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
                         max_seqlen_q: Optional[int], max_seqlen_k: Optional[int]):
    """The gate threshold on CUDA: its decisions as a tile map (0 = the pair is skipped, 1 = kept; _tiles.py) in
    tiles of threshold_block, which the kernels skip like a block-sparse mask's absent tiles. With a block-sparse
    mask both must use the same tiles (SparseAttnUnsupportedError otherwise). Returns (map, block_q, block_k)."""
    if any(t is not None for t in block_tensors) and (block_q, block_k) != threshold_block:
        raise make_error(SparseAttnUnsupportedError, "unsupported", op, "threshold_block",
                         f"{threshold_block} differs from block_size {(block_q, block_k)}: on CUDA the gate threshold "
                         "and a block-sparse mask must use the same tiles")
    block_q, block_k = threshold_block
    if packed:
        batch = cu_seqlens_q.shape[0] - 1
        rows, keys = max_seqlen_q or q.shape[0], max_seqlen_k or delta.shape[0]
    else:
        batch, rows, keys = q.shape[0], q.shape[1], delta.shape[1]
    n_q, n_k = _tiles.tile_counts(rows, block_q), _tiles.tile_counts(keys, block_k)
    states = _tiles.from_gate_threshold(alpha, delta, threshold, gate == "product", block_q, block_k, n_q, n_k,
                                        batch, cu_seqlens_q if packed else None, cu_seqlens_k if packed else None)
    return states, block_q, block_k


# Tiles of the summary of an element mask given without a block-sparse mask: the forward kernels' tiles on
# Hopper (128 queries x 128 keys).
_DEFAULT_MASK_TILES = (128, 128)


def _from_block_mask(op: str, block_mask, block_size, lists):
    """The lists and tile sizes of a FlexAttention BlockMask (its mask_mod is not evaluated)."""
    if not all(hasattr(block_mask, name) for name in ("kv_num_blocks", "kv_indices", "BLOCK_SIZE")):
        raise chk.type_error(op, "block_mask", "a bool torch.Tensor, a FlexAttention BlockMask or None", block_mask)
    if any(t is not None for t in lists):
        raise chk.config_error(op, "block_mask", "a BlockMask carries its own lists: do not also pass kv_num_blocks, "
                                                 "kv_indices or the full_ lists")
    sizes = tuple(int(b) for b in block_mask.BLOCK_SIZE)
    if block_size is not None and tuple(block_size) != sizes:
        raise chk.config_error(op, "block_size", f"is {tuple(block_size)} but the BlockMask's BLOCK_SIZE is {sizes}")
    return (None, block_mask.kv_num_blocks, block_mask.kv_indices, getattr(block_mask, "full_kv_num_blocks", None),
            getattr(block_mask, "full_kv_indices", None), sizes)


def combine(o_cmp: Optional[Tensor], o_slc: Optional[Tensor], o_swa: Optional[Tensor], g_cmp: Optional[Tensor],
            g_slc: Optional[Tensor], g_swa: Optional[Tensor]) -> Tensor:
    """NSA's gated sum o = g_cmp*o_cmp + g_slc*o_slc + g_swa*o_swa; a branch whose gate is None is skipped.

    Differentiable w.r.t. the outputs and gates of the branches that take part.

    Args:
        o_cmp, o_slc, o_swa: the branch outputs, [B, T, Hq, Dv] (packed [N, Hq, Dv]), one dtype; the output
            of a skipped branch may be None (it is ignored).
        g_cmp, g_slc, g_swa: the gates, [B, T, Hq] (packed [N, Hq]) in the outputs' dtype, or None to skip
            the branch; at least one is given.

    Returns:
        o, the shape and dtype of the branch outputs.

    Raises:
        SparseAttnTypeError: an argument that is neither a tensor nor None.
        SparseAttnDTypeError: non-float or mismatched dtypes.
        SparseAttnError: no gate given, a gated branch without its output, mismatched shapes, mixed devices.

    Example:
        >>> import torch, sparseattn
        >>> o1, o2 = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4)
        >>> g = torch.full((1, 5, 2), 0.5)
        >>> o = sparseattn.combine(o1, o2, None, g, g, None)
        >>> torch.allclose(o, 0.5 * (o1 + o2))
        True
    """
    op = "combine"
    named = (("o_cmp", o_cmp), ("o_slc", o_slc), ("o_swa", o_swa), ("g_cmp", g_cmp), ("g_slc", g_slc),
             ("g_swa", g_swa))
    for name, t in named:
        chk.tensor_arg(op, name, t, optional=True)
    # Outputs of skipped branches are not passed on (they take no part and get no gradient).
    o_cmp, o_slc, o_swa = (o if g is not None else None for o, g in ((o_cmp, g_cmp), (o_slc, g_slc), (o_swa, g_swa)))
    present = [(name, t) for name, t in zip(("o_cmp", "o_slc", "o_swa", "g_cmp", "g_slc", "g_swa"),
                                            (o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)) if t is not None]
    if not any(g is not None for g in (g_cmp, g_slc, g_swa)):
        raise make_error(SparseAttnError, "config", op, "gates", "at least one branch gate must be given")
    anchor_name, anchor = present[0]
    chk.devices(op, anchor, anchor_name, present[1:])
    return _ops.combine(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)


def nsa_attention(q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor] = None, g_slc: Optional[Tensor] = None,
                  g_swa: Optional[Tensor] = None, *, config: Optional[NSAConfig] = None,
                  k_cmp: Optional[Tensor] = None, v_cmp: Optional[Tensor] = None,
                  block_indices: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
                  max_seqlen: Optional[int] = None, cu_seqlens_k: Optional[Tensor] = None,
                  max_seqlen_k: Optional[int] = None, recompute: Union[bool, str] = False) -> Tensor:
    """The whole Native Sparse Attention pipeline in one op.

    o = g_cmp*compressed + g_slc*selected + g_swa*sliding-window attention, where a branch whose gate is None
    is skipped. Gradients reach q, k, v, the given gates and user k_cmp/v_cmp.

    Query chunks (chunked prefill, decoding against a KV cache, context parallelism): k and v may hold S >= T
    keys per sequence; query t then sits at key position t + S - T and its row is the full call's (T = S) row
    there; dk and dv cover all S keys (docs/semantics.md section 11).

    Args:
        q: [B, T, Hq, Dqk], or packed [N, Hq, Dqk] with cu_seqlens.
        k: [B, S, Hkv, Dqk] with S >= T (packed [Nk, Hkv, Dqk]); Hkv divides Hq.
        v: [B, S, Hkv, Dv] (packed [Nk, Hkv, Dv]).
        g_cmp, g_slc, g_swa: gates [B, T, Hq] (packed [N, Hq]) in q's dtype, used as given; at least one.
        config: an :class:`NSAConfig` (None: the defaults).
        k_cmp, v_cmp: user-supplied compressed K/V of the keys instead of mean pooling, both or neither
            ([B, Sc, Hkv, D]; packed laid out by ``compressed_cu_seqlens(cu_seqlens_k or cu_seqlens)``).
        block_indices: user-supplied selection, int32 [B, T, Hkv, n] (packed [N, Hkv, n]), instead of the
            top-n selection; needs g_slc.
        cu_seqlens: int32 [B+1] for the packed layout.
        max_seqlen: an upper bound of the packed lengths (None or 0: not known).
        cu_seqlens_k: int32 [B+1], packed query chunks: the keys' sequences, S_b >= T_b keys each (needs
            cu_seqlens). None: the keys are q's.
        max_seqlen_k: an upper bound of the keys' packed lengths (None or 0: not known).
        recompute: what the forward keeps for the backward (bytes per token at 64/4 heads, D = 128, bf16;
            docs/perf/2026-11-27-nsa-memory-budget.md has the buffers, peaks and costs):

            - ``"none"`` or False (default): the workspace: the three branch outputs, their log-sum-exps, the
              selection and the pooled compressed K/V (about 50 KB per token).
            - ``"branches"``: only the log-sum-exps, the selection and the pooled compressed K/V (about 1.2 KB per
              token); the backward runs each branch's forward again, just before that branch's backward, into one
              buffer (one branch output live at a time), and the forward holds the branch outputs in scratch only
              while it runs. Costs the three branch forwards once more per backward. Batched layout: the output
              is written in place by the last branch, so nothing else changes for the caller.
            - ``"selected_and_window"``: as ``"branches"`` for the selected and sliding-window outputs; the
              compressed branch's output, whose forward costs the most to run again at long T, is kept (about
              17.6 KB per token).
            - ``"full"`` or True: nothing beyond the inputs; the backward runs the whole forward again first
              (torch.utils.checkpoint), then the backward of ``"none"``: the least kept between forward and
              backward (many layers), the highest cost (one more NSA forward), and the backward's peak of ``"none"``.

            All four give the same output and gradients, bit for bit (deterministic kernels run in the same order).

    Returns:
        o [B, T, Hq, Dv] (packed [N, Hq, Dv]) in q's dtype.

    Raises:
        SparseAttnTypeError: an argument of the wrong type (config not an NSAConfig, max_seqlen not an int,
            recompute neither a bool nor a string).
        SparseAttnDTypeError: non-float or mismatched dtypes; block_indices or cu_seqlens not int32.
        SparseAttnError: wrong ranks or sizes, mixed devices, no gate, an inconsistent configuration, bad
            cu_seqlens or block_indices contents (checked on the CPU), an unknown recompute mode.
        SparseAttnUnsupportedError: CUDA tensors this build or its kernels do not take.

    Example:
        >>> import torch, sparseattn
        >>> cfg = sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, window=64)
        >>> q, k, v = torch.randn(1, 100, 4, 16), torch.randn(1, 100, 2, 16), torch.randn(1, 100, 2, 16)
        >>> g = torch.sigmoid(torch.randn(1, 100, 4))
        >>> o = sparseattn.nsa_attention(q, k, v, g, g, g, config=cfg)
        >>> tuple(o.shape)
        (1, 100, 4, 16)
        >>> g10 = g[:, -10:]  # the last 10 queries against all 100 keys
        >>> torch.equal(sparseattn.nsa_attention(q[:, -10:], k, v, g10, g10, g10, config=cfg), o[:, -10:])
        True
        >>> cu_q, cu_k = torch.tensor([0, 1, 11], dtype=torch.int32), torch.tensor([0, 40, 100], dtype=torch.int32)
        >>> qp = torch.cat([q[0, 39:40], q[0, 90:]])  # a decoding step at position 39; 10 queries of 60 keys
        >>> gp = torch.sigmoid(torch.randn(11, 4))
        >>> tuple(sparseattn.nsa_attention(qp, k[0], v[0], gp, gp, gp, config=cfg, cu_seqlens=cu_q,
        ...                                cu_seqlens_k=cu_k).shape)
        (11, 4, 16)
    """
    op = "nsa_attention"
    config = NSAConfig() if config is None else config
    if not isinstance(config, NSAConfig):
        raise chk.type_error(op, "config", "a sparseattn.NSAConfig or None", config)
    config._validate()
    recompute = recompute_arg(op, recompute)
    max_seqlen = chk.optional_int_arg(op, "max_seqlen", max_seqlen, minimum=0)
    max_seqlen_k = chk.optional_int_arg(op, "max_seqlen_k", max_seqlen_k, minimum=0)
    chk.cu_seqlens_arg(op, "cu_seqlens", cu_seqlens)
    chk.cu_seqlens_arg(op, "cu_seqlens_k", cu_seqlens_k)
    packed = cu_seqlens is not None
    chk.tokens_arg(op, "q", q, packed)
    chk.tokens_arg(op, "k", k, packed)
    chk.tensor_arg(op, "v", v)
    chk.same_rank(op, "v", v, k, "k")
    for name, t in (("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa), ("k_cmp", k_cmp), ("v_cmp", v_cmp)):
        chk.tensor_arg(op, name, t, optional=True)
    chk.tensor_arg(op, "block_indices", block_indices, optional=True, kind="int32")
    chk.devices(op, q, "q", [("k", k), ("v", v), ("g_cmp", g_cmp), ("g_slc", g_slc), ("g_swa", g_swa),
                             ("k_cmp", k_cmp), ("v_cmp", v_cmp), ("block_indices", block_indices),
                             ("cu_seqlens", cu_seqlens), ("cu_seqlens_k", cu_seqlens_k)])
    cu_cmp = _cu_seqlens_cmp(cu_seqlens, None, config.cmp_block, config.cmp_stride, cu_seqlens_k)
    if block_indices is not None:
        block_indices = block_indices.detach()
    args = (q, k, v, k_cmp, v_cmp, block_indices, g_cmp, g_slc, g_swa, cu_seqlens, cu_cmp, max_seqlen,
            int(config.cmp_block), int(config.cmp_stride), int(config.sel_block), int(config.num_selected),
            int(config.num_init), int(config.num_local), int(config.window), chk.scale_arg(op, "scale", config.scale),
            None if cu_seqlens_k is None else cu_seqlens_k.detach(), max_seqlen_k)
    if recompute == "full" and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(_nsa_output, *args, use_reentrant=False)
    return _nsa_output(*args, "none" if recompute == "full" else recompute)


RECOMPUTE_MODES = ("none", "branches", "selected_and_window", "full")


def recompute_arg(op: str, value) -> str:
    """The recompute mode of nsa_attention: one of RECOMPUTE_MODES (False: "none", True: "full")."""
    if isinstance(value, bool):
        return "full" if value else "none"
    names = ", ".join(repr(mode) for mode in RECOMPUTE_MODES)
    if not isinstance(value, str):
        raise chk.type_error(op, "recompute", f"a bool or one of {names}", value)
    if value not in RECOMPUTE_MODES:
        raise make_error(SparseAttnError, "config", op, "recompute",
                         f"expected one of {names} (or a bool), got {value!r}")
    return value


def _nsa_output(*args) -> Tensor:
    """The output of the nsa_attention op (its workspace stays inside the autograd graph)."""
    o, _workspace = _ops.nsa_attention(*args)
    return o


def create_mask(bias: Tensor, keep: int, *, causal: bool = False, key_padding_mask: Optional[Tensor] = None,
                window: Union[tuple[int, int], list, None] = (-1, -1)) -> Tensor:
    """The top-k mask of dynamic-mask attention: per row of ``bias``, the ``keep`` largest visible keys.

    A key is visible to query t when the causal rule and the window allow it (bottom-right aligned, exactly as
    :func:`flash_attention`), its ``key_padding_mask`` entry is True and its bias is not NaN (NaN is never
    kept). Ties go to the lower key index; when at most ``keep`` keys are visible all of them are kept; a row
    with none is all False. Not differentiable: pass the result as ``flash_attention(..., mask=m, bias=bias)``.
    CUDA tensors are ranked with torch's stable sorts on the device (in chunks of rows); the CPU runs the C++
    reference. Both give the same mask.

    Args:
        bias: [B, H, T, S] in float16, bfloat16, float32 or float64 (H is Hq or Hkv). A broadcast bias such as
            [B, Hkv, 1, S] is passed expanded (``bias.expand(B, Hkv, T, S)``, no copy).
        keep: the number of keys kept per row (an int, 1 <= keep < 2**31).
        causal: a bool; keep only keys at or before the aligned position a = t + S - T.
        key_padding_mask: bool [B, S], True for a real key; False keys are never kept. None: every key is real.
        window: (left, right) ints as in :func:`flash_attention`: keys in [a - left, a + right]; a negative side
            (-1) is unbounded. None is (-1, -1).

    Returns:
        bool [B, H, T, S], True for the kept keys.

    Raises:
        SparseAttnTypeError: an argument of the wrong type (``keep=2.0``, ``causal=1``).
        SparseAttnDTypeError: a non-float bias or a non-bool key_padding_mask.
        SparseAttnError: bias not 4-D, key_padding_mask not [B, S], keep < 1 or >= 2**31, mixed devices.

    Example:
        >>> import torch, sparseattn
        >>> bias = torch.tensor([[[[0.5, 2.0, 1.0, 3.0, -1.0],
        ...                        [2.0, 9.0, 1.0, 1.0, 5.0],
        ...                        [float("nan"), 4.0, 0.3, -0.5, 0.7]]]])
        >>> pad = torch.tensor([[True, False, True, True, True]])
        >>> m = sparseattn.create_mask(bias, 2, causal=True, key_padding_mask=pad)
        >>> m.int().tolist()
        [[[[1, 0, 1, 0, 0], [1, 0, 1, 0, 0], [0, 0, 1, 0, 1]]]]
        >>> q, k, v = torch.randn(1, 3, 2, 8), torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8)
        >>> sparseattn.flash_attention(q, k, v, mask=m, bias=bias.nan_to_num()).shape
        torch.Size([1, 3, 2, 8])
    """
    op = "create_mask"
    keep = chk.int_arg(op, "keep", keep, minimum=1)
    causal = chk.bool_arg(op, "causal", causal)
    window_left, window_right = chk.window_arg(op, "window", window)
    chk.tensor_arg(op, "bias", bias)
    if bias.dim() != 4:
        raise make_error(SparseAttnError, "shape", op, "bias",
                         f"expected 4 dimensions [B, H, T, S], got {list(bias.shape)}")
    chk.tensor_arg(op, "key_padding_mask", key_padding_mask, optional=True, kind="bool")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (bias.shape[0], bias.shape[3]):
        raise make_error(SparseAttnError, "shape", op, "key_padding_mask",
                         f"expected [B, S] = [{bias.shape[0]}, {bias.shape[3]}], got {list(key_padding_mask.shape)}")
    chk.devices(op, bias, "bias", [("key_padding_mask", key_padding_mask)])
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.detach()
    return _ops.create_mask(bias.detach(), key_padding_mask, keep, causal, window_left, window_right)
