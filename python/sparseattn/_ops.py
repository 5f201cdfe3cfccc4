"""torch.library custom ops over the C++ API (namespace ``sparseattn``).

Each operation is a forward custom op returning its outputs and, where it is differentiable, a backward custom
op; both have fake (meta) implementations, and the forward has autograd registered, so the ops work under
``torch.compile(fullgraph=True)``. Outputs are allocated here with torch (caching allocator, graph-safe) and
passed to the binding, which calls the C++ API on the current CUDA stream (0 on the CPU).

Conventions of these low-level ops (the public functions in ``functional.py`` fill them in):
- ``cu_seqlens`` None means the batched layout [B, T, H, D]; otherwise the packed layout [N, H, D].
- NSA query chunks (docs/semantics.md section 11): ``cu_seqlens_k`` (packed) and ``seqlen_k`` (batched, ops
  without k; 0 means S = T) give the keys when there are more keys than queries.
- ``max_seqlen`` 0 means "not known" (the C++ API then uses N).
- ``scale`` None means 1/sqrt(Dqk).
- In the packed layout outputs are zero-initialised, because the C++ API leaves rows past the last sequence
  untouched.
- Outputs that are not differentiable (log-sum-exps, indices, workspaces) are marked so; a loss that uses
  them gets no gradient through them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C
from . import _tiles
from . import _topk_mask

Tensors = tuple[Tensor, ...]

_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
    torch.int32: "int32",
    torch.bool: "bool",
}


def _workspace_allocator(like: Tensor):
    """The allocator the binding calls for an operation's scratch workspace (torch's caching allocator)."""
    return lambda nbytes: torch.empty((nbytes,), dtype=torch.uint8, device=like.device)


def _stream(t: Tensor) -> int:
    """The handle of the current CUDA stream of t's device (0 on the CPU)."""
    if t.device.type == "cuda":
        return torch.cuda.current_stream(t.device).cuda_stream
    return 0


def _arr(t: Optional[Tensor]) -> Optional[Tensor]:
    """A tensor the binding can take through DLPack: detached, with a contiguous last dimension."""
    if t is None:
        return None
    t = t.detach()
    if t.dim() > 0 and t.size(-1) > 1 and t.stride(-1) != 1:
        # torch treats every empty tensor as contiguous, so .contiguous() would keep its strides.
        t = t.new_empty(t.shape) if t.numel() == 0 else t.contiguous()
    return t


def _alloc(shape, like: Tensor, *, packed: bool, dtype: Optional[torch.dtype] = None) -> Tensor:
    make = torch.zeros if packed else torch.empty
    return make(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _out_shape(q: Tensor, dim_v: int) -> list:
    return [*q.shape[:-1], dim_v]


def _lse_shape(q: Tensor, packed: bool) -> list:
    # [B, Hq, T] or packed [Hq, N]
    return [q.shape[1], q.shape[0]] if packed else [q.shape[0], q.shape[2], q.shape[1]]


def _num_compressed(length, block: int, stride: int):
    return torch.sym_max(0, (length - block) // stride + 1)


def _compressed_shape(t: Tensor, packed: bool, block: int, stride: int) -> list:
    if stride <= 0:  # an invalid config: any shape will do, the C++ API reports the config error
        return [0, *t.shape[1:]] if packed else [t.shape[0], 0, *t.shape[2:]]
    if packed:  # rows laid out by compressed_cu_seqlens; sum_b blocks(T_b) <= N // stride
        return [t.shape[0] // stride, *t.shape[1:]]
    return [t.shape[0], _num_compressed(t.shape[1], block, stride), *t.shape[2:]]


def _empty_grad(like: Tensor) -> Tensor:
    """Stand-in output for a gradient that is not computed (custom ops cannot return None)."""
    return like.new_empty((0,))


# ------------------------------------------------------------------------------------------------ compress_kv


@torch.library.custom_op("sparseattn::compress_kv", mutates_args=())
def compress_kv(
    k: Tensor,
    v: Tensor,
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cmp: Optional[Tensor],
    max_seqlen: int,
    block: int,
    stride: int,
) -> tuple[Tensor, Tensor]:
    packed = cu_seqlens is not None
    k_cmp = _alloc(_compressed_shape(k, packed, block, stride), k, packed=packed)
    v_cmp = _alloc(_compressed_shape(v, packed, block, stride), v, packed=packed)
    _C.compress_kv(_arr(k), _arr(v), k_cmp, v_cmp, _arr(cu_seqlens), _arr(cu_seqlens_cmp), max_seqlen, block,
                   stride, _stream(k))
    return k_cmp, v_cmp


@compress_kv.register_fake
def _(k, v, cu_seqlens, cu_seqlens_cmp, max_seqlen, block, stride):
    packed = cu_seqlens is not None
    return (k.new_empty(_compressed_shape(k, packed, block, stride)),
            v.new_empty(_compressed_shape(v, packed, block, stride)))


@torch.library.custom_op("sparseattn::compress_kv_backward", mutates_args=())
def compress_kv_backward(
    dk_cmp: Tensor,
    dv_cmp: Tensor,
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cmp: Optional[Tensor],
    max_seqlen: int,
    block: int,
    stride: int,
    rows: int,
) -> tuple[Tensor, Tensor]:
    packed = cu_seqlens is not None
    dk = _alloc(_token_shape(dk_cmp, packed, rows), dk_cmp, packed=packed)
    dv = _alloc(_token_shape(dv_cmp, packed, rows), dv_cmp, packed=packed)
    _C.compress_kv_backward(_arr(dk_cmp), _arr(dv_cmp), dk, dv, _arr(cu_seqlens), _arr(cu_seqlens_cmp),
                            max_seqlen, block, stride, _stream(dk_cmp))
    return dk, dv


def _token_shape(cmp: Tensor, packed: bool, rows) -> list:
    return [rows, *cmp.shape[1:]] if packed else [cmp.shape[0], rows, *cmp.shape[2:]]


@compress_kv_backward.register_fake
def _(dk_cmp, dv_cmp, cu_seqlens, cu_seqlens_cmp, max_seqlen, block, stride, rows):
    packed = cu_seqlens is not None
    return dk_cmp.new_empty(_token_shape(dk_cmp, packed, rows)), dv_cmp.new_empty(_token_shape(dv_cmp, packed, rows))


def _compress_kv_setup(ctx, inputs, output):
    k, v, cu_seqlens, cu_seqlens_cmp, max_seqlen, block, stride = inputs
    ctx.save_for_backward(cu_seqlens, cu_seqlens_cmp)
    ctx.args = (max_seqlen, block, stride, k.shape[-3])


def _compress_kv_backward(ctx, dk_cmp, dv_cmp):
    cu_seqlens, cu_seqlens_cmp = ctx.saved_tensors
    max_seqlen, block, stride, rows = ctx.args
    dk, dv = compress_kv_backward(dk_cmp, dv_cmp, cu_seqlens, cu_seqlens_cmp, max_seqlen, block, stride, rows)
    return dk, dv, None, None, None, None, None


compress_kv.register_autograd(_compress_kv_backward, setup_context=_compress_kv_setup)

# --------------------------------------------------------------------------------------- compressed_attention


@torch.library.custom_op("sparseattn::compressed_attention", mutates_args=())
def compressed_attention(
    q: Tensor,
    k_cmp: Tensor,
    v_cmp: Tensor,
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cmp: Optional[Tensor],
    max_seqlen: int,
    block: int,
    stride: int,
    scale: Optional[float],
    cu_seqlens_k: Optional[Tensor] = None,
    seqlen_k: int = 0,
) -> tuple[Tensor, Tensor]:
    packed = cu_seqlens is not None
    o = _alloc(_out_shape(q, v_cmp.shape[-1]), q, packed=packed)
    lse = _alloc(_lse_shape(q, packed), q, packed=packed, dtype=_lse_dtype(q.dtype))
    _C.compressed_attention(_arr(q), _arr(k_cmp), _arr(v_cmp), o, lse, _arr(cu_seqlens), _arr(cu_seqlens_cmp),
                            max_seqlen, block, stride, scale, _stream(q), cu_seqlens_k=_arr(cu_seqlens_k),
                            seqlen_k=seqlen_k)
    return o, lse


@compressed_attention.register_fake
def _(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, max_seqlen, block, stride, scale, cu_seqlens_k=None, seqlen_k=0):
    packed = cu_seqlens is not None
    return (q.new_empty(_out_shape(q, v_cmp.shape[-1])),
            q.new_empty(_lse_shape(q, packed), dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("sparseattn::compressed_attention_backward", mutates_args=())
def compressed_attention_backward(
    q: Tensor,
    k_cmp: Tensor,
    v_cmp: Tensor,
    o: Tensor,
    lse: Tensor,
    d_o: Tensor,
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cmp: Optional[Tensor],
    max_seqlen: int,
    block: int,
    stride: int,
    scale: Optional[float],
    cu_seqlens_k: Optional[Tensor] = None,
    seqlen_k: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    packed = cu_seqlens is not None
    dq = _alloc(q.shape, q, packed=packed)
    dk_cmp = _alloc(k_cmp.shape, k_cmp, packed=packed)
    dv_cmp = _alloc(v_cmp.shape, v_cmp, packed=packed)
    _C.compressed_attention_backward(_arr(q), _arr(k_cmp), _arr(v_cmp), _arr(o), _arr(lse), _arr(d_o), dq, dk_cmp,
                                     dv_cmp, _arr(cu_seqlens), _arr(cu_seqlens_cmp), max_seqlen, block, stride,
                                     scale, _workspace_allocator(q), _stream(q), cu_seqlens_k=_arr(cu_seqlens_k),
                                     seqlen_k=seqlen_k)
    return dq, dk_cmp, dv_cmp


@compressed_attention_backward.register_fake
def _(q, k_cmp, v_cmp, o, lse, d_o, cu_seqlens, cu_seqlens_cmp, max_seqlen, block, stride, scale, cu_seqlens_k=None,
      seqlen_k=0):
    return torch.empty_like(q), torch.empty_like(k_cmp), torch.empty_like(v_cmp)


def _compressed_attention_setup(ctx, inputs, output):
    q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, max_seqlen, block, stride, scale, cu_seqlens_k, seqlen_k = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k_cmp, v_cmp, o, lse, cu_seqlens, cu_seqlens_cmp, cu_seqlens_k)
    ctx.args = (max_seqlen, block, stride, scale)
    ctx.seqlen_k = seqlen_k


def _compressed_attention_backward(ctx, d_o, d_lse):
    q, k_cmp, v_cmp, o, lse, cu_seqlens, cu_seqlens_cmp, cu_seqlens_k = ctx.saved_tensors
    dq, dk_cmp, dv_cmp = compressed_attention_backward(q, k_cmp, v_cmp, o, lse, d_o, cu_seqlens, cu_seqlens_cmp,
                                                       *ctx.args, cu_seqlens_k, ctx.seqlen_k)
    return dq, dk_cmp, dv_cmp, None, None, None, None, None, None, None, None


compressed_attention.register_autograd(_compressed_attention_backward, setup_context=_compressed_attention_setup)

# ---------------------------------------------------------------------------------------------- select_blocks


@torch.library.custom_op("sparseattn::select_blocks", mutates_args=())
def select_blocks(
    q: Tensor,
    k_cmp: Tensor,
    lse_cmp: Tensor,
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cmp: Optional[Tensor],
    max_seqlen: int,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    num_selected: int,
    num_init: int,
    num_local: int,
    scale: Optional[float],
    cu_seqlens_k: Optional[Tensor] = None,
    seqlen_k: int = 0,
) -> Tensor:
    shape = [*q.shape[:-2], k_cmp.shape[-2], num_selected]
    if cu_seqlens is None:
        indices = torch.empty(shape, dtype=torch.int32, device=q.device)
    else:
        indices = torch.full(shape, -1, dtype=torch.int32, device=q.device)
    _C.select_blocks(_arr(q), _arr(k_cmp), _arr(lse_cmp), indices, _arr(cu_seqlens), _arr(cu_seqlens_cmp),
                     max_seqlen, cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, scale,
                     _workspace_allocator(q), _stream(q), cu_seqlens_k=_arr(cu_seqlens_k), seqlen_k=seqlen_k)
    return indices


@select_blocks.register_fake
def _(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, max_seqlen, cmp_block, cmp_stride, sel_block, num_selected,
      num_init, num_local, scale, cu_seqlens_k=None, seqlen_k=0):
    return q.new_empty([*q.shape[:-2], k_cmp.shape[-2], num_selected], dtype=torch.int32)


# ----------------------------------------------------------------------------------------- selected_attention


@torch.library.custom_op("sparseattn::selected_attention", mutates_args=())
def selected_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    cu_seqlens: Optional[Tensor],
    max_seqlen: int,
    block: int,
    scale: Optional[float],
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_k: int = 0,
) -> tuple[Tensor, Tensor]:
    packed = cu_seqlens is not None
    o = _alloc(_out_shape(q, v.shape[-1]), q, packed=packed)
    lse = _alloc(_lse_shape(q, packed), q, packed=packed, dtype=_lse_dtype(q.dtype))
    _C.selected_attention(_arr(q), _arr(k), _arr(v), _arr(indices), o, lse, _arr(cu_seqlens), max_seqlen, block,
                          scale, _workspace_allocator(q), _stream(q), cu_seqlens_k=_arr(cu_seqlens_k),
                          max_seqlen_k=max_seqlen_k)
    return o, lse


@selected_attention.register_fake
def _(q, k, v, indices, cu_seqlens, max_seqlen, block, scale, cu_seqlens_k=None, max_seqlen_k=0):
    packed = cu_seqlens is not None
    return q.new_empty(_out_shape(q, v.shape[-1])), q.new_empty(_lse_shape(q, packed), dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("sparseattn::selected_attention_backward", mutates_args=())
def selected_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    indices: Tensor,
    o: Tensor,
    lse: Tensor,
    d_o: Tensor,
    cu_seqlens: Optional[Tensor],
    max_seqlen: int,
    block: int,
    scale: Optional[float],
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_k: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    packed = cu_seqlens is not None
    dq, dk, dv = (_alloc(t.shape, t, packed=packed) for t in (q, k, v))
    _C.selected_attention_backward(_arr(q), _arr(k), _arr(v), _arr(indices), _arr(o), _arr(lse), _arr(d_o), dq, dk,
                                   dv, _arr(cu_seqlens), max_seqlen, block, scale, _workspace_allocator(q), _stream(q),
                                   cu_seqlens_k=_arr(cu_seqlens_k), max_seqlen_k=max_seqlen_k)
    return dq, dk, dv


@selected_attention_backward.register_fake
def _(q, k, v, indices, o, lse, d_o, cu_seqlens, max_seqlen, block, scale, cu_seqlens_k=None, max_seqlen_k=0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _selected_attention_setup(ctx, inputs, output):
    q, k, v, indices, cu_seqlens, max_seqlen, block, scale, cu_seqlens_k, max_seqlen_k = inputs
    o, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, indices, o, lse, cu_seqlens, cu_seqlens_k)
    ctx.args = (max_seqlen, block, scale)
    ctx.max_seqlen_k = max_seqlen_k


def _selected_attention_backward(ctx, d_o, d_lse):
    q, k, v, indices, o, lse, cu_seqlens, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = selected_attention_backward(q, k, v, indices, o, lse, d_o, cu_seqlens, *ctx.args, cu_seqlens_k,
                                             ctx.max_seqlen_k)
    return dq, dk, dv, None, None, None, None, None, None, None


selected_attention.register_autograd(_selected_attention_backward, setup_context=_selected_attention_setup)

# -------------------------------------------------------------------------------------------- flash_attention


def _flash_blocks(block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_q, block_k,
                  window_left_heads, window_right_heads):
    """The binding's block-sparse and per-head window arguments, in its order."""
    return (_arr(block_mask), _arr(kv_num_blocks), _arr(kv_indices), _arr(full_kv_num_blocks), _arr(full_kv_indices),
            block_q, block_k, _arr(window_left_heads), _arr(window_right_heads))


def _threshold_tiles_shape(q: Tensor, cu_seqlens_q: Optional[Tensor], max_seqlen_q: int, k: Tensor,
                           max_seqlen_k: int, threshold_block_q: int, threshold_block_k: int) -> list:
    """The shape of the CUDA forward's softmax-threshold decisions: [B, Hq, nQ, nK] in tiles of threshold_block
    (B counts sequences when packed; nQ, nK those of the longest sequence, packed: max_seqlen when given)."""
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.shape[0] - 1
        rows = min(max_seqlen_q, q.shape[0]) if max_seqlen_q > 0 else q.shape[0]
        keys = min(max_seqlen_k, k.shape[0]) if max_seqlen_k > 0 else k.shape[0]
        heads = q.shape[1]
    else:
        batch, rows, heads, keys = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    return [batch, heads, -(-rows // threshold_block_q), -(-keys // threshold_block_k)]


def _records_threshold(q: Tensor, softmax_threshold: Optional[float]) -> bool:
    """Whether the forward records softmax_threshold's decisions (CUDA; the CPU backward recomputes them)."""
    return softmax_threshold is not None and q.device.type == "cuda"


@torch.library.custom_op("sparseattn::flash_attention", mutates_args=())
def _flash_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],
    alpha: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    gate: str = "logsigmoid",
    gate_threshold: Optional[float] = None,
    softmax_threshold: Optional[float] = None,
    threshold_block_q: int = 128,
    threshold_block_k: int = 128,
    block_mask: Optional[Tensor] = None,
    kv_num_blocks: Optional[Tensor] = None,
    kv_indices: Optional[Tensor] = None,
    full_kv_num_blocks: Optional[Tensor] = None,
    full_kv_indices: Optional[Tensor] = None,
    block_q: int = 0,
    block_k: int = 0,
    window_left_heads: Optional[Tensor] = None,
    window_right_heads: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (o, lse, threshold_tiles): the last is, on CUDA with softmax_threshold, the forward's decisions
    (uint8 [B, Hq, nQ, nK] in tiles of threshold_block: 1 kept, 0 skipped), which the backward takes as its tile
    map; an empty uint8 tensor otherwise."""
    packed = cu_seqlens_q is not None
    o = _alloc(_out_shape(q, v.shape[-1]), q, packed=packed)
    lse = _alloc(_lse_shape(q, packed), q, packed=packed, dtype=_lse_dtype(q.dtype))
    if _records_threshold(q, softmax_threshold):
        tiles = torch.empty(_threshold_tiles_shape(q, cu_seqlens_q, max_seqlen_q, k, max_seqlen_k, threshold_block_q,
                                                   threshold_block_k), dtype=torch.uint8, device=q.device)
    else:
        tiles = q.new_empty((0,), dtype=torch.uint8)
    _C.flash_attention(_arr(q), _arr(k), _arr(v), _arr(mask), _arr(bias), o, lse, _arr(cu_seqlens_q),
                       _arr(cu_seqlens_k), max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale,
                       _arr(alpha), _arr(delta), gate, gate_threshold, softmax_threshold, threshold_block_q,
                       threshold_block_k, *_flash_blocks(block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks,
                                                         full_kv_indices, block_q, block_k, window_left_heads,
                                                         window_right_heads), _stream(q),
                       threshold_tiles=tiles if tiles.dim() == 4 else None)
    return o, lse, tiles


@_flash_attention_op.register_fake
def _(q, k, v, mask, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left,
      window_right, scale, alpha=None, delta=None, gate="logsigmoid", gate_threshold=None, softmax_threshold=None,
      threshold_block_q=128, threshold_block_k=128, block_mask=None, kv_num_blocks=None, kv_indices=None,
      full_kv_num_blocks=None, full_kv_indices=None, block_q=0, block_k=0, window_left_heads=None,
      window_right_heads=None):
    packed = cu_seqlens_q is not None
    if _records_threshold(q, softmax_threshold):
        tiles = q.new_empty(_threshold_tiles_shape(q, cu_seqlens_q, max_seqlen_q, k, max_seqlen_k, threshold_block_q,
                                                   threshold_block_k), dtype=torch.uint8)
    else:
        tiles = q.new_empty((0,), dtype=torch.uint8)
    return (q.new_empty(_out_shape(q, v.shape[-1])), q.new_empty(_lse_shape(q, packed), dtype=_lse_dtype(q.dtype)),
            tiles)


def flash_attention(*args, **kwargs) -> tuple[Tensor, Tensor]:
    """The forward op sparseattn::flash_attention (its arguments), returning (o, lse); differentiable through the
    op's autograd."""
    o, lse, _ = _flash_attention_op(*args, **kwargs)
    return o, lse


def flash_attention_with_decisions(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """Like flash_attention, also returning the op's third output: on CUDA with softmax_threshold the forward's
    decisions (uint8 [B, Hq, nQ, nK], 1 kept, 0 skipped), else an empty tensor (tests, diagnostics)."""
    return _flash_attention_op(*args, **kwargs)


@torch.library.custom_op("sparseattn::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor],
    bias: Optional[Tensor],
    o: Tensor,
    lse: Tensor,
    d_o: Tensor,
    cu_seqlens_q: Optional[Tensor],
    cu_seqlens_k: Optional[Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    window_left: int,
    window_right: int,
    scale: Optional[float],
    compute_dbias: bool,
    alpha: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    gate: str = "logsigmoid",
    gate_threshold: Optional[float] = None,
    softmax_threshold: Optional[float] = None,
    threshold_block_q: int = 128,
    threshold_block_k: int = 128,
    compute_dgates: bool = False,
    block_mask: Optional[Tensor] = None,
    kv_num_blocks: Optional[Tensor] = None,
    kv_indices: Optional[Tensor] = None,
    full_kv_num_blocks: Optional[Tensor] = None,
    full_kv_indices: Optional[Tensor] = None,
    block_q: int = 0,
    block_k: int = 0,
    window_left_heads: Optional[Tensor] = None,
    window_right_heads: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dbias, dalpha, ddelta); dbias has bias's shape if compute_dbias, dalpha and ddelta
    alpha's and delta's if compute_dgates (and alpha is given); each is empty otherwise."""
    packed = cu_seqlens_q is not None
    dq, dk, dv = (_alloc(t.shape, t, packed=packed) for t in (q, k, v))
    with_dbias = compute_dbias and bias is not None
    # zeros: a packed-form dbias leaves the entries no sequence reads untouched (they stay 0)
    dbias = torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device) if with_dbias else _empty_grad(q)
    with_dgates = compute_dgates and alpha is not None and delta is not None
    if with_dgates:
        dalpha = torch.zeros(alpha.shape, dtype=alpha.dtype, device=alpha.device)
        ddelta = torch.zeros(delta.shape, dtype=delta.dtype, device=delta.device)
    else:
        dalpha, ddelta = _empty_grad(q), _empty_grad(q)
    _C.flash_attention_backward(_arr(q), _arr(k), _arr(v), _arr(mask), _arr(bias), _arr(o), _arr(lse), _arr(d_o),
                                dq, dk, dv, dbias if with_dbias else None, _arr(cu_seqlens_q), _arr(cu_seqlens_k),
                                max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale, _arr(alpha),
                                _arr(delta), dalpha if with_dgates else None, ddelta if with_dgates else None, gate,
                                gate_threshold, softmax_threshold, threshold_block_q, threshold_block_k,
                                *_flash_blocks(block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks,
                                               full_kv_indices, block_q, block_k, window_left_heads,
                                               window_right_heads), _workspace_allocator(q), _stream(q))
    return dq, dk, dv, dbias, dalpha, ddelta


@flash_attention_backward.register_fake
def _(q, k, v, mask, bias, o, lse, d_o, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left,
      window_right, scale, compute_dbias, alpha=None, delta=None, gate="logsigmoid", gate_threshold=None,
      softmax_threshold=None, threshold_block_q=128, threshold_block_k=128, compute_dgates=False, block_mask=None,
      kv_num_blocks=None, kv_indices=None, full_kv_num_blocks=None, full_kv_indices=None, block_q=0, block_k=0,
      window_left_heads=None, window_right_heads=None):
    with_dbias = compute_dbias and bias is not None
    dbias = bias.new_empty(bias.shape) if with_dbias else q.new_empty((0,))
    with_dgates = compute_dgates and alpha is not None and delta is not None
    dalpha = alpha.new_empty(alpha.shape) if with_dgates else q.new_empty((0,))
    ddelta = delta.new_empty(delta.shape) if with_dgates else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dbias, dalpha, ddelta


def _flash_attention_setup(ctx, inputs, output):
    (q, k, v, mask, bias, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left,
     window_right, scale, alpha, delta, gate, gate_threshold, softmax_threshold, threshold_block_q,
     threshold_block_k, block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, block_q, block_k,
     window_left_heads, window_right_heads) = inputs
    o, lse, decisions = output
    ctx.mark_non_differentiable(lse, decisions)
    recorded = _records_threshold(q, softmax_threshold)
    if recorded:
        # The CUDA backward follows the forward's decisions: its tile map is the given one (same tiles, required
        # by functional.flash_attention on CUDA) with the skipped pairs made absent, or the decisions alone.
        if block_mask is not None and block_mask.dtype == torch.bool:
            block_mask = _tiles.from_bool(block_mask)
        block_mask = decisions if block_mask is None else _tiles.keep_where(block_mask, decisions)
        block_q, block_k = threshold_block_q, threshold_block_k
        softmax_threshold = None
    ctx.save_for_backward(q, k, v, mask, bias, o, lse, cu_seqlens_q, cu_seqlens_k, alpha, delta, block_mask,
                          kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, window_left_heads,
                          window_right_heads)
    ctx.block_sizes = (block_q, block_k)
    ctx.args = (max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale)
    ctx.gate_args = (gate, gate_threshold, softmax_threshold, threshold_block_q, threshold_block_k)


def _flash_attention_backward(ctx, d_o, d_lse, d_decisions):
    (q, k, v, mask, bias, o, lse, cu_seqlens_q, cu_seqlens_k, alpha, delta, block_mask, kv_num_blocks, kv_indices,
     full_kv_num_blocks, full_kv_indices, window_left_heads, window_right_heads) = ctx.saved_tensors
    compute_dbias = bias is not None and ctx.needs_input_grad[4]
    compute_dgates = alpha is not None and (ctx.needs_input_grad[13] or ctx.needs_input_grad[14])
    dq, dk, dv, dbias, dalpha, ddelta = flash_attention_backward(
        q, k, v, mask, bias, o, lse, d_o, cu_seqlens_q, cu_seqlens_k, *ctx.args, compute_dbias, alpha, delta,
        *ctx.gate_args, compute_dgates, block_mask, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices,
        *ctx.block_sizes, window_left_heads, window_right_heads)
    return (dq, dk, dv, None, (dbias if compute_dbias else None), None, None, None, None, None, None, None, None,
            dalpha if compute_dgates else None, ddelta if compute_dgates else None, None, None, None, None, None,
            None, None, None, None, None, None, None, None, None)


_flash_attention_op.register_autograd(_flash_attention_backward, setup_context=_flash_attention_setup)


def flash_attention_work(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None,
                         bias: Optional[Tensor] = None, cu_seqlens_q: Optional[Tensor] = None,
                         cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                         causal: bool = False, window_left: int = -1, window_right: int = -1,
                         scale: Optional[float] = None, block_mask: Optional[Tensor] = None, block_q: int = 0,
                         block_k: int = 0, d_o: Optional[Tensor] = None, alpha: Optional[Tensor] = None,
                         delta: Optional[Tensor] = None, gate: str = "logsigmoid",
                         window_left_heads: Optional[Tensor] = None,
                         window_right_heads: Optional[Tensor] = None, softmax_threshold: Optional[float] = None,
                         threshold_block: tuple[int, int] = (128, 128)) -> tuple[Tensor, Optional[Tensor]]:
    """Test diagnostic of the CUDA kernels' tile skipping (not a custom op, not differentiable): runs the forward
    and, given d_o, the backward of flash_attention (block_mask: bool or uint8 tile states; alpha, delta: the gate)
    with a work counter (window_left_heads, window_right_heads: per-head windows, int32 [Hq], replacing that
    side's int), and returns (forward, backward) int64 [1] tensors: the query x key elements of the kernel tiles
    computed (each tile's query rows x keys, clipped to its sequence), summed over the CTAs; the backward counts its
    dQ and dK/dV kernels (twice the forward's). backward is None without d_o. The counters stay 0 on the CPU.
    With softmax_threshold (CUDA) the forward computes the scores of every tile it walks (skipped ones included)
    and the backward runs on the forward's decisions (block_mask, if given, must use threshold_block's tiles), so
    the backward's count shows the skipped tiles."""
    packed = cu_seqlens_q is not None
    o = _alloc(_out_shape(q, v.shape[-1]), q, packed=packed)
    lse = _alloc(_lse_shape(q, packed), q, packed=packed, dtype=_lse_dtype(q.dtype))
    forward = torch.zeros(1, dtype=torch.int64, device=q.device)
    decisions = None
    if softmax_threshold is not None:
        decisions = torch.empty(_threshold_tiles_shape(q, cu_seqlens_q, max_seqlen_q, k, max_seqlen_k,
                                                       *threshold_block), dtype=torch.uint8, device=q.device)
    blocks = _flash_blocks(block_mask, None, None, None, None, block_q, block_k, window_left_heads, window_right_heads)
    _C.flash_attention(_arr(q), _arr(k), _arr(v), _arr(mask), _arr(bias), o, lse, _arr(cu_seqlens_q),
                       _arr(cu_seqlens_k), max_seqlen_q, max_seqlen_k, causal, window_left, window_right, scale,
                       _arr(alpha), _arr(delta), gate, None, softmax_threshold, *threshold_block, *blocks, _stream(q),
                       work_counter=forward, threshold_tiles=decisions)
    if d_o is None:
        return forward, None
    if decisions is not None:
        if block_mask is not None and block_mask.dtype == torch.bool:
            block_mask = _tiles.from_bool(block_mask)
        block_mask = decisions if block_mask is None else _tiles.keep_where(block_mask, decisions)
        blocks = _flash_blocks(block_mask, None, None, None, None, *threshold_block, window_left_heads,
                               window_right_heads)
    backward = torch.zeros(1, dtype=torch.int64, device=q.device)
    dq, dk, dv = (_alloc(t.shape, t, packed=packed) for t in (q, k, v))
    _C.flash_attention_backward(_arr(q), _arr(k), _arr(v), _arr(mask), _arr(bias), o, lse, _arr(d_o), dq, dk, dv,
                                None, _arr(cu_seqlens_q), _arr(cu_seqlens_k), max_seqlen_q, max_seqlen_k, causal,
                                window_left, window_right, scale, _arr(alpha), _arr(delta), None, None, gate, None,
                                None, 128, 128, *blocks, _workspace_allocator(q), _stream(q), work_counter=backward)
    return forward, backward

# ---------------------------------------------------------------------------------------------------- combine


@torch.library.custom_op("sparseattn::combine", mutates_args=())
def combine(
    o_cmp: Optional[Tensor],
    o_slc: Optional[Tensor],
    o_swa: Optional[Tensor],
    g_cmp: Optional[Tensor],
    g_slc: Optional[Tensor],
    g_swa: Optional[Tensor],
) -> Tensor:
    anchor = _combine_anchor(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa)
    o = torch.empty(anchor.shape, dtype=anchor.dtype, device=anchor.device)
    _C.combine(_arr(o_cmp), _arr(o_slc), _arr(o_swa), _arr(g_cmp), _arr(g_slc), _arr(g_swa), o, _stream(anchor))
    return o


def _combine_anchor(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa) -> Tensor:
    """The output of the first branch that takes part (the shape and dtype of the result)."""
    for o, g in ((o_cmp, g_cmp), (o_slc, g_slc), (o_swa, g_swa)):
        if g is not None and o is not None:
            return o
    for o in (o_cmp, o_slc, o_swa):
        if o is not None:
            return o
    from ._errors import SparseAttnError, make_error

    raise make_error(SparseAttnError, "config", "combine", "gates", "at least one branch gate must be given")


@combine.register_fake
def _(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa):
    return torch.empty_like(_combine_anchor(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa))


@torch.library.custom_op("sparseattn::combine_backward", mutates_args=())
def combine_backward(
    o_cmp: Optional[Tensor],
    o_slc: Optional[Tensor],
    o_swa: Optional[Tensor],
    g_cmp: Optional[Tensor],
    g_slc: Optional[Tensor],
    g_swa: Optional[Tensor],
    d_o: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (d_o_cmp, d_o_slc, d_o_swa, d_g_cmp, d_g_slc, d_g_swa); a branch without a gate gets empties."""
    outputs, gates = (o_cmp, o_slc, o_swa), (g_cmp, g_slc, g_swa)
    d_outputs = [torch.empty_like(d_o) if g is not None else None for g in gates]
    d_gates = [torch.empty(g.shape, dtype=g.dtype, device=g.device) if g is not None else None for g in gates]
    _C.combine_backward(*(_arr(t) for t in outputs), *(_arr(t) for t in gates), _arr(d_o), *d_outputs, *d_gates,
                        _stream(d_o))
    return tuple(t if t is not None else _empty_grad(d_o) for t in (*d_outputs, *d_gates))


@combine_backward.register_fake
def _(o_cmp, o_slc, o_swa, g_cmp, g_slc, g_swa, d_o):
    gates = (g_cmp, g_slc, g_swa)
    d_outputs = [torch.empty_like(d_o) if g is not None else d_o.new_empty((0,)) for g in gates]
    d_gates = [torch.empty_like(g) if g is not None else d_o.new_empty((0,)) for g in gates]
    return (*d_outputs, *d_gates)


def _combine_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _combine_backward(ctx, d_o):
    inputs = ctx.saved_tensors
    grads = combine_backward(*inputs, d_o)
    gates = inputs[3:]
    return tuple(grad if gates[i % 3] is not None else None for i, grad in enumerate(grads))


combine.register_autograd(_combine_backward, setup_context=_combine_setup)

# ---------------------------------------------------------------------------------------------- nsa_attention


def _spec(t: Optional[Tensor]):
    """(dtype name, shape) of a tensor for the binding's size queries, or None."""
    if t is None:
        return None
    return (_DTYPE_NAMES.get(t.dtype, str(t.dtype).removeprefix("torch.")), tuple(t.shape))


def _nsa_size(query, op, q, k, v, k_cmp, v_cmp, block_indices, g_cmp, g_slc, g_swa, o, cu_seqlens, cu_seqlens_cmp,
              max_seqlen, config, cu_seqlens_k=None, max_seqlen_k=0, recompute="none") -> int:
    """A size query of the binding; it validates the call (shapes only) and its errors name `op`. `o` is a tensor
    or a (dtype name, shape) spec (the output need not exist yet)."""
    device = "cuda" if q.device.type == "cuda" else "cpu"
    index = (q.device.index or 0) if device == "cuda" else 0
    o_spec = o if isinstance(o, tuple) else _spec(o)
    specs = [_spec(t) for t in (q, k, v, k_cmp, v_cmp, block_indices, g_cmp, g_slc, g_swa)]
    return query(device, index, *specs, o_spec, _spec(cu_seqlens), _spec(cu_seqlens_cmp), max_seqlen, *config, op=op,
                 cu_seqlens_k=_spec(cu_seqlens_k), max_seqlen_k=max_seqlen_k, recompute=recompute)


def _has_symbolic_shape(*tensors) -> bool:
    return any(not isinstance(s, int) for t in tensors if t is not None for s in t.shape)


@torch.library.custom_op("sparseattn::nsa_attention", mutates_args=())
def nsa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cmp: Optional[Tensor],
    v_cmp: Optional[Tensor],
    block_indices: Optional[Tensor],
    g_cmp: Optional[Tensor],
    g_slc: Optional[Tensor],
    g_swa: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cmp: Optional[Tensor],
    max_seqlen: int,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    num_selected: int,
    num_init: int,
    num_local: int,
    window: int,
    scale: Optional[float],
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_k: int = 0,
    recompute: str = "none",
) -> tuple[Tensor, Tensor]:
    """Returns (o, workspace); the uint8 workspace holds what the backward reads: with recompute "none" the branch
    outputs too, with "branches" only their log-sum-exps, the selection and the pooled compressed K/V (the backward
    recomputes the outputs; pass it the same mode), with "selected_and_window" also the compressed output."""
    config = (cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, window, scale)
    packed = cu_seqlens is not None
    keys = (cu_seqlens_k, max_seqlen_k, recompute)
    # The size queries validate the call's shapes, dtypes and config before anything is allocated.
    o_spec = _spec(q)[0], tuple(_out_shape(q, v.shape[-1]))
    tensors = (q, k, v, k_cmp, v_cmp, block_indices, g_cmp, g_slc, g_swa, o_spec, cu_seqlens, cu_seqlens_cmp)
    size = _nsa_size(_C.nsa_workspace_size, "nsa_attention", *tensors, max_seqlen, config, *keys)
    # The steps' temporary memory where the workspace cannot hold it: freed (to the cache) on return.
    scratch_size = _nsa_size(_C.nsa_forward_scratch_size, "nsa_attention", *tensors, max_seqlen, config, *keys)
    o = _alloc(o_spec[1], q, packed=packed)
    # Empty: nsa_attention writes every byte (what no step writes, it zero-fills), so this output does not
    # change from run to run (determinism; torch.library.opcheck checks it).
    workspace = torch.empty((size,), dtype=torch.uint8, device=q.device)
    scratch = torch.empty((scratch_size,), dtype=torch.uint8, device=q.device)
    _C.nsa_attention(_arr(q), _arr(k), _arr(v), _arr(k_cmp), _arr(v_cmp), _arr(block_indices), _arr(g_cmp),
                     _arr(g_slc), _arr(g_swa), o, _arr(cu_seqlens), _arr(cu_seqlens_cmp), max_seqlen, *config,
                     workspace, scratch, _stream(q), cu_seqlens_k=_arr(cu_seqlens_k), max_seqlen_k=max_seqlen_k,
                     recompute=recompute)
    return o, workspace


@nsa_attention.register_fake
def _(q, k, v, k_cmp, v_cmp, block_indices, g_cmp, g_slc, g_swa, cu_seqlens, cu_seqlens_cmp, max_seqlen, cmp_block,
      cmp_stride, sel_block, num_selected, num_init, num_local, window, scale, cu_seqlens_k=None, max_seqlen_k=0,
      recompute="none"):
    o = q.new_empty(_out_shape(q, v.shape[-1]))
    tensors = (q, k, v, k_cmp, v_cmp, block_indices, g_cmp, g_slc, g_swa, cu_seqlens, cu_seqlens_cmp, cu_seqlens_k)
    if _has_symbolic_shape(*tensors):
        # The size is a C++ function of the shapes; with symbolic shapes it is an unbacked size.
        size = torch.library.get_ctx().new_dynamic_size()
    else:
        config = (cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, window, scale)
        size = _nsa_size(_C.nsa_workspace_size, "nsa_attention", q, k, v, k_cmp, v_cmp, block_indices, g_cmp, g_slc,
                         g_swa, o, cu_seqlens, cu_seqlens_cmp, max_seqlen, config, cu_seqlens_k, max_seqlen_k,
                         recompute)
    return o, q.new_empty((size,), dtype=torch.uint8)


@torch.library.custom_op("sparseattn::nsa_attention_backward", mutates_args=())
def nsa_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cmp: Optional[Tensor],
    v_cmp: Optional[Tensor],
    block_indices: Optional[Tensor],
    g_cmp: Optional[Tensor],
    g_slc: Optional[Tensor],
    g_swa: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    cu_seqlens_cmp: Optional[Tensor],
    max_seqlen: int,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    num_selected: int,
    num_init: int,
    num_local: int,
    window: int,
    scale: Optional[float],
    o: Tensor,
    workspace: Tensor,
    d_o: Tensor,
    cu_seqlens_k: Optional[Tensor] = None,
    max_seqlen_k: int = 0,
    recompute: str = "none",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns (dq, dk, dv, dk_cmp, dv_cmp, d_g_cmp, d_g_slc, d_g_swa); absent ones are empty. `o` is not read (only
    its shape and dtype are checked: d_o may stand in for it); `recompute` is the forward's."""
    config = (cmp_block, cmp_stride, sel_block, num_selected, num_init, num_local, window, scale)
    packed = cu_seqlens is not None
    dq, dk, dv = (_alloc(t.shape, t, packed=packed) for t in (q, k, v))
    dk_cmp, dv_cmp = (_alloc(t.shape, t, packed=packed) if t is not None else None for t in (k_cmp, v_cmp))
    d_gates = [_alloc(g.shape, g, packed=packed) if g is not None else None for g in (g_cmp, g_slc, g_swa)]
    scratch_size = _nsa_size(_C.nsa_backward_scratch_size, "nsa_attention_backward", q, k, v, k_cmp, v_cmp,
                             block_indices, g_cmp, g_slc, g_swa, o, cu_seqlens, cu_seqlens_cmp, max_seqlen, config,
                             cu_seqlens_k, max_seqlen_k, recompute)
    scratch = torch.empty((scratch_size,), dtype=torch.uint8, device=q.device)
    d_o_view = _arr(d_o)
    o_view = d_o_view if o is d_o else _arr(o)  # d_o standing in for o: no second copy where d_o needs one
    _C.nsa_attention_backward(_arr(q), _arr(k), _arr(v), _arr(k_cmp), _arr(v_cmp), _arr(block_indices), _arr(g_cmp),
                              _arr(g_slc), _arr(g_swa), o_view, _arr(cu_seqlens), _arr(cu_seqlens_cmp), max_seqlen,
                              *config, workspace, d_o_view, dq, dk, dv, dk_cmp, dv_cmp, *d_gates, scratch,
                              _stream(q), cu_seqlens_k=_arr(cu_seqlens_k), max_seqlen_k=max_seqlen_k,
                              recompute=recompute)
    return tuple(t if t is not None else _empty_grad(q) for t in (dq, dk, dv, dk_cmp, dv_cmp, *d_gates))


@nsa_attention_backward.register_fake
def _(q, k, v, k_cmp, v_cmp, block_indices, g_cmp, g_slc, g_swa, cu_seqlens, cu_seqlens_cmp, max_seqlen, cmp_block,
      cmp_stride, sel_block, num_selected, num_init, num_local, window, scale, o, workspace, d_o, cu_seqlens_k=None,
      max_seqlen_k=0, recompute="none"):
    return tuple(torch.empty_like(t) if t is not None else q.new_empty((0,))
                 for t in (q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa))


_NSA_GRAD_INPUTS = (0, 1, 2, 3, 4, 6, 7, 8)  # positions of q, k, v, k_cmp, v_cmp, g_cmp, g_slc, g_swa
_NSA_NUM_INPUTS = 23


def _nsa_setup(ctx, inputs, output):
    _o, workspace = output
    ctx.mark_non_differentiable(workspace)
    # No zero gradient of the workspace (gigabytes at long T) materialised for the backward, which ignores it.
    ctx.set_materialize_grads(False)
    tensors = inputs[:11]  # q .. cu_seqlens_cmp
    # Not the output: the backward does not read it (d_o stands in for it), so the caller alone decides how long
    # it lives.
    ctx.save_for_backward(*tensors, workspace, inputs[20])  # and cu_seqlens_k
    ctx.args = inputs[11:20]  # max_seqlen and the config
    ctx.max_seqlen_k = inputs[21]
    ctx.recompute = inputs[22]


def _nsa_backward(ctx, d_o, d_workspace):
    if d_o is None:  # not materialised: nothing reached o
        return (None,) * _NSA_NUM_INPUTS
    *tensors, workspace, cu_seqlens_k = ctx.saved_tensors
    grads = nsa_attention_backward(*tensors, *ctx.args, d_o, workspace, d_o, cu_seqlens_k, ctx.max_seqlen_k,
                                   ctx.recompute)
    result = [None] * _NSA_NUM_INPUTS
    for position, grad in zip(_NSA_GRAD_INPUTS, grads):
        if tensors[position] is not None:
            result[position] = grad
    return tuple(result)


nsa_attention.register_autograd(_nsa_backward, setup_context=_nsa_setup)


# ------------------------------------------------------------------------------------------------ create_mask


@torch.library.custom_op("sparseattn::create_mask", mutates_args=())
def create_mask(
    bias: Tensor,
    key_padding_mask: Optional[Tensor],
    keep: int,
    causal: bool,
    window_left: int,
    window_right: int,
) -> Tensor:
    if bias.is_cuda:  # torch's sorts on the device: the C++ API has no CUDA kernel of create_mask
        return _topk_mask.create_mask(bias, key_padding_mask, keep, causal, window_left, window_right)
    mask = torch.empty(bias.shape, dtype=torch.bool, device=bias.device)
    _C.create_mask(_arr(bias), _arr(key_padding_mask), mask, keep, causal, window_left, window_right, _stream(bias))
    return mask


@create_mask.register_fake
def _(bias, key_padding_mask, keep, causal, window_left, window_right):
    return bias.new_empty(bias.shape, dtype=torch.bool)
