"""Context-parallel sparseattn.flash_attention: each rank holds a shard of the tokens of q, k and v and gets its
shard of the output; the result equals the single-process call on the whole sequence."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _checks as chk
from .. import _ops
from .._errors import SparseAttnDTypeError, SparseAttnError, make_error
from ..functional import flash_attention as _flash_attention
from . import group as _group
from .documents import host_cu_seqlens
from .exchange import KeyExchange, reduce_to_owners
from .calls import call_cu_seqlens, call_key_rows, call_views
from .plan import METHODS, ContextPlan, choose_method, make_plan
from .sharding import LAYOUTS, agreed_stream_length

_OP = "distributed.flash_attention"
_EXCHANGES = ("auto",) + METHODS
_CONFIG_FIELDS = (
    _group.Field("layout", "the layout", lambda c: repr(LAYOUTS[c])),
    _group.Field("exchange", "the exchange", lambda c: repr(_EXCHANGES[c])),
    _group.Field("causal", "causal", lambda c: str(bool(c))),
    _group.Field("window", "the window's left side"),
    _group.Field("window", "the window's right side"),
    _group.Field("scale", "the scale", _group.show_scale),
    *_group.TENSOR_FIELDS,
)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = False,
                    window: Union[tuple[int, int], list, None] = (-1, -1), scale: Optional[float] = None,
                    cu_seqlens=None, return_lse: bool = False, layout: str = "zigzag",
                    exchange: str = "auto") -> Union[Tensor, tuple[Tensor, Tensor]]:
    """Context-parallel dense attention: sparseattn.flash_attention over a sequence sharded across the ranks of
    a process group (docs/distributed.md).

    Every rank of `group` calls it with its shard of q, k and v (the same tokens of all three, cut by
    :func:`sparseattn.distributed.shard` with `layout`) and the same configuration; each gets the output rows of
    its own tokens, equal to the single-process ``sparseattn.flash_attention`` on the whole sequence (causal
    alignment included: query t of the sequence sees keys up to t). K and V are exchanged (an all_gather, or an
    all_to_all of the needed keys under a window); each chunk of the shard then runs sparseattn.flash_attention
    on its queries and the keys they see. The backward computes dq locally and returns each key's dK/dV to the
    rank that holds it, summed in rank order (deterministic). A collective, forward and backward: every rank of
    the group must call it, and run its backward.

    Args:
        q: this rank's shard, [B, T_r, Hq, Dqk], or packed [N_r, Hq, Dqk] with cu_seqlens.
        k: [B, T_r, Hkv, Dqk] (packed [N_r, Hkv, Dqk]), the same tokens as q; Hkv divides Hq.
        v: [B, T_r, Hkv, Dv] (packed [N_r, Hkv, Dv]).
        group: the torch.distributed process group (None: the default group). CPU tensors need gloo, CUDA
            tensors NCCL.
        causal: a bool; query t sees keys <= t.
        window: (left, right): keys in [t - left, t + right]; a negative side is unbounded; None is (-1, -1).
        scale: softmax scale; None: 1/sqrt(Dqk).
        cu_seqlens: the packed layout: document bounds of the whole packed stream (int32 [B+1], on the host as a
            CPU tensor or a list of ints), the same on every rank; documents may cross shard boundaries.
        return_lse: also return the log-sum-exp (not differentiable).
        layout: how the sequence is sharded: "zigzag" (load-balanced causal) or "contiguous".
        exchange: "auto" (all_to_all of the needed keys when a window bounds how far a query looks, else
            all_gather), "all_gather" or "all_to_all".

    Returns:
        o [B, T_r, Hq, Dv] (packed [N_r, Hq, Dv]), or (o, lse) with ``return_lse``; lse [B, Hq, T_r] (packed
        [Hq, N_r]) in float32 (float64 for float64 inputs). Rows in the layout of this rank's shard.

    Raises:
        SparseAttnError: on every rank of the group, when any rank's arguments are invalid (as for
            sparseattn.flash_attention), the ranks disagree on the configuration or on shapes other than their
            token counts, the shard lengths are not those of `layout` for their sum, cu_seqlens ends past the
            packed stream, or the group's backend does not serve the tensors' device (gloo for CPU tensors, NCCL
            for CUDA tensors); also when torch.distributed is not initialized.
        SparseAttnTypeError: an argument of the wrong type (raised on every rank, like the errors above).
        SparseAttnDTypeError: non-float or mismatched dtypes, cu_seqlens not int32.
        SparseAttnUnsupportedError: what sparseattn.flash_attention does not take on the tensors' device.

    Example:
        >>> import torch, torch.distributed as dist, sparseattn
        >>> from sparseattn import distributed as sad
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> q, k, v = torch.randn(2, 10, 4, 16), torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 8)
        >>> q_r, k_r, v_r = (sad.shard(x, dim=1) for x in (q, k, v))   # this rank's tokens (all of them here)
        >>> o_r = sad.flash_attention(q_r, k_r, v_r, causal=True, window=(3, 0))
        >>> o = sad.unshard(o_r, dim=1)
        >>> torch.allclose(o, sparseattn.flash_attention(q, k, v, causal=True, window=(3, 0)))
        True
        >>> dist.destroy_process_group()
    """
    group = _group.default_group(_OP, group)
    backends = _group.backend_map(group)
    rank, size = _group.rank_and_size(group)
    values, error, config = None, None, None
    try:
        config = _local_config(q, k, v, causal, window, scale, cu_seqlens, return_lse, layout, exchange)
        error = _group.backend_error(_OP, "q", backends, q.device)
        if error is None:
            values = _config_values(config, q, k, v)
    except SparseAttnError as exc:
        error = exc
    rows = _group.agree(_OP, group, backends, _CONFIG_FIELDS, values, error, differ_ok=("the shard length",),
                        tensors_device=q.device if isinstance(q, Tensor) else None)
    cu = config["cu"]
    total = agreed_stream_length(_OP, rows, config["layout"], cu)
    method = choose_method(config["exchange"], config["causal"], config["window"])
    plan = make_plan(total, size, rank, config["layout"], cu, config["causal"], config["window"], method)
    o, lse = _ShardedAttention.apply(q, k, v, plan, group, cu is None, config["causal"], config["scale"])
    return (o, lse) if config["return_lse"] else o


def _local_config(q, k, v, causal, window, scale, cu_seqlens, return_lse, layout, exchange) -> dict:
    """This rank's arguments, checked without communication (raises SparseAttnError)."""
    causal = chk.bool_arg(_OP, "causal", causal)
    return_lse = chk.bool_arg(_OP, "return_lse", return_lse)
    window = chk.window_arg(_OP, "window", window)
    scale = chk.scale_arg(_OP, "scale", scale)
    layout = chk.choice_arg(_OP, "layout", layout, LAYOUTS)
    exchange = chk.choice_arg(_OP, "exchange", exchange, _EXCHANGES)
    cu = host_cu_seqlens(_OP, "cu_seqlens", cu_seqlens)
    packed = cu is not None
    chk.tokens_arg(_OP, "q", q, packed)
    chk.tokens_arg(_OP, "k", k, packed)
    chk.tokens_arg(_OP, "v", v, packed)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise make_error(SparseAttnDTypeError, "dtype", _OP, name,
                             f"expected the dtype of 'q' ({chk.dtype_name(q.dtype)}), got {chk.dtype_name(t.dtype)}")
        chk.same_device(_OP, name, t, q, "q")
    token_dim = 0 if packed else 1
    lead = q.shape[: token_dim + 1]
    for name, t in (("k", k), ("v", v)):
        if t.shape[: token_dim + 1] != lead:
            raise make_error(SparseAttnError, "shape", _OP, name,
                             f"expected the leading sizes {list(lead)} of 'q' (each rank holds the same tokens of q, "
                             f"k and v), got {list(t.shape)}")
    if v.shape[-2] != k.shape[-2] or k.shape[-1] != q.shape[-1] or k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise make_error(SparseAttnError, "shape", _OP, "k",
                         f"expected k [.., Hkv, Dqk] and v [.., Hkv, Dv] with Hkv dividing Hq and q's Dqk; got q "
                         f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    return dict(causal=causal, return_lse=return_lse, window=window, scale=scale, layout=layout,
                exchange=exchange, cu=cu)


def _config_values(config: dict, q: Tensor, k: Tensor, v: Tensor) -> tuple[int, ...]:
    """The configuration vector compared across ranks, one int per _CONFIG_FIELDS entry (the shard length last)."""
    return (LAYOUTS.index(config["layout"]), _EXCHANGES.index(config["exchange"]), int(config["causal"]),
            config["window"][0], config["window"][1], _group.scale_code(config["scale"]),
            *_group.tensor_values(q, k, v, config["cu"]))


class _ShardedAttention(torch.autograd.Function):
    """Forward: exchange K/V into key buffers, one flash_attention call per chunk piece. Backward: the
    flash_attention backward of every call, dq into place, dK/dV partials summed over the key buffer (in the
    order of the calls) and reduced onto the keys' owners (exchange.reduce_to_owners)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: ContextPlan, group, batched: bool, causal: bool,
                scale: Optional[float]):
        dim = 1 if batched else 0
        keys = KeyExchange(plan, (k, v), dim, group)
        make = torch.empty if batched else torch.zeros  # packed rows in no document stay 0, as in flash_attention
        o = make(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if batched else (q.shape[1], q.shape[0])
        lse = make(lse_shape, dtype=lse_dtype, device=q.device)
        lse_dim = dim + 1
        cu_tensors = []
        for chunk in plan.chunks:
            if not chunk.calls:
                continue
            k_buffer, v_buffer = keys.wait(chunk.stage)
            for call in chunk.calls:
                cu_q, cu_k = call_cu_seqlens(call, q.device)
                cu_tensors.append((cu_q, cu_k))
                q_call, k_call, v_call = call_views(plan, call, dim, q, k_buffer, v_buffer)
                o_call, lse_call = _flash_attention(
                    q_call, k_call, v_call, causal=causal, window=call.window, scale=scale, cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k, max_seqlen_q=call.max_seqlen_q if cu_q is not None else None,
                    max_seqlen_k=call.max_seqlen_k if cu_q is not None else None, return_lse=True)
                rows = call.q_rows[1] - call.q_rows[0]
                o.narrow(dim, call.q_rows[0], rows).copy_(o_call)
                lse.narrow(lse_dim, call.q_rows[0], rows).copy_(lse_call)
        k_buffer, v_buffer = keys.wait(len(plan.stages) - 1)  # every collective done before its buffers go
        ctx.save_for_backward(q, k_buffer, v_buffer, o, lse)
        ctx.mark_non_differentiable(lse)
        ctx.plan, ctx.group, ctx.dim, ctx.causal, ctx.scale = plan, group, dim, causal, scale
        ctx.cu_tensors, ctx.kv_dtype = cu_tensors, k.dtype
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o: Tensor, _d_lse):
        q, k_buffer, v_buffer, o, lse = ctx.saved_tensors
        plan, dim = ctx.plan, ctx.dim
        d_o = d_o.contiguous()  # its per-call views then have the row alignment the CUDA kernels need
        lse_dim = dim + 1
        dq = torch.zeros_like(q)
        partial_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        dk_partial = k_buffer.new_zeros(k_buffer.shape, dtype=partial_dtype)
        dv_partial = v_buffer.new_zeros(v_buffer.shape, dtype=partial_dtype)
        cu_tensors = iter(ctx.cu_tensors)
        for chunk in plan.chunks:
            for call in chunk.calls:
                cu_q, cu_k = next(cu_tensors)
                q_call, k_call, v_call = call_views(plan, call, dim, q, k_buffer, v_buffer)
                first, rows = call.q_rows[0], call.q_rows[1] - call.q_rows[0]
                dq_call, dk_call, dv_call = _ops.flash_attention_backward(
                    q_call, k_call, v_call, None, None, o.narrow(dim, first, rows), lse.narrow(lse_dim, first, rows),
                    d_o.narrow(dim, first, rows), cu_q, cu_k, call.max_seqlen_q if cu_q is not None else 0,
                    call.max_seqlen_k if cu_q is not None else 0, ctx.causal, call.window[0], call.window[1],
                    ctx.scale, False)[:3]
                dq.narrow(dim, first, rows).copy_(dq_call)
                key_row, key_count = call_key_rows(plan, call)
                dk_partial.narrow(dim, key_row, key_count).add_(dk_call)
                dv_partial.narrow(dim, key_row, key_count).add_(dv_call)
        dk, dv = reduce_to_owners((dk_partial, dv_partial), plan, dim, ctx.group, ctx.kv_dtype)
        return dq, dk, dv, None, None, None, None, None

