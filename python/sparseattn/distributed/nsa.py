"""Context-parallel sparseattn.nsa_attention: each rank holds a shard of the tokens of q, k, v and the gates and
gets its shard of the output; the result equals the single-process call on the whole sequence.

Compressed attention and selection read the whole prefix of a query's document (every compressed block that
ends at or before it, every selection block that starts at or before it), so each chunk of a rank needs every key
from the start of its first query's document to its end: the plan of causal attention without a window
(:mod:`.plan`). Each chunk is then NSA over a query chunk (docs/semantics.md section 11): its queries against that
prefix, bottom-right aligned, which gives exactly the full call's rows.

Packed, a chunk's first document may have started on an earlier chunk (more keys than queries) while the documents
that start inside the chunk have as many keys as queries. The first runs as a batched query chunk of one sequence
([1, T_b, ..] against [1, S_b, ..]), the others as one packed call without cu_seqlens_k (an ordinary packed call):
at most two calls per chunk, in the forms the CUDA kernels take (their packed query chunks are narrower).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import _checks as chk
from .. import _ops
from .._errors import SparseAttnDTypeError, SparseAttnError, make_error
from ..functional import NSAConfig
from . import group as _group
from .calls import call_key_rows, call_query_rows, call_views, int32_on
from .documents import host_cu_seqlens
from .exchange import KeyExchange, reduce_to_owners
from .plan import METHODS, AttentionCall, ContextPlan, choose_method, make_plan
from .sharding import LAYOUTS, agreed_stream_length

_OP = "distributed.nsa_attention"
_EXCHANGES = ("auto",) + METHODS
_GATES = ("g_cmp", "g_slc", "g_swa")
# The NSAConfig fields passed to the op, in its order (scale last).
_SIZES = ("cmp_block", "cmp_stride", "sel_block", "num_selected", "num_init", "num_local", "window")


def _show_gates(mask: int) -> str:
    return "[" + ", ".join(name for i, name in enumerate(_GATES) if mask >> i & 1) + "]"


_CONFIG_FIELDS = (
    _group.Field("layout", "the layout", lambda c: repr(LAYOUTS[c])),
    _group.Field("exchange", "the exchange", lambda c: repr(_EXCHANGES[c])),
    *(_group.Field("config", f"config.{name}") for name in _SIZES),
    _group.Field("config", "config.scale", _group.show_scale),
    _group.Field("g_cmp", "the gates given", _show_gates),
    *_group.TENSOR_FIELDS,
)


def nsa_attention(q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor] = None, g_slc: Optional[Tensor] = None,
                  g_swa: Optional[Tensor] = None, *, group=None, config: Optional[NSAConfig] = None,
                  layout: str = "zigzag", cu_seqlens=None, exchange: str = "auto") -> Tensor:
    """Context-parallel Native Sparse Attention: sparseattn.nsa_attention over a sequence sharded across the
    ranks of a process group (docs/distributed.md).

    Every rank of `group` calls it with its shard of q, k, v and the gates (the same tokens of all of them, cut
    by :func:`sparseattn.distributed.shard` with `layout`) and the same configuration; each gets the output rows
    of its own tokens, equal to the single-process ``sparseattn.nsa_attention`` on the whole sequence. K and V
    are exchanged so that each chunk of the shard has every key before its end (compressed attention and
    selection read the whole prefix); each chunk then runs sparseattn.nsa_attention on its queries against that
    prefix (a query chunk, docs/semantics.md section 11). The backward computes dq and the gates' gradients
    locally and returns each key's dK/dV to the rank that holds it, summed in rank order (deterministic). A
    collective, forward and backward: every rank of the group must call it, and run its backward.

    Args:
        q: this rank's shard, [B, T_r, Hq, Dqk], or packed [N_r, Hq, Dqk] with cu_seqlens.
        k: [B, T_r, Hkv, Dqk] (packed [N_r, Hkv, Dqk]), the same tokens as q; Hkv divides Hq.
        v: [B, T_r, Hkv, Dv] (packed [N_r, Hkv, Dv]).
        g_cmp, g_slc, g_swa: gates [B, T_r, Hq] (packed [N_r, Hq]) in q's dtype, used as given; at least one,
            and the same ones on every rank. A branch whose gate is None is skipped.
        group: the torch.distributed process group (None: the default group). CPU tensors need gloo, CUDA
            tensors NCCL.
        config: an NSAConfig (None: the defaults), the same on every rank.
        layout: how the sequence is sharded: "zigzag" (load-balanced causal) or "contiguous".
        cu_seqlens: the packed layout: document bounds of the whole packed stream (int32 [B+1], on the host as a
            CPU tensor or a list of ints), the same on every rank; documents may cross shard boundaries.
        exchange: how K and V travel: "auto" (all_gather), "all_gather" (stage i gathers chunk i of every rank),
            or "all_to_all" (each rank receives exactly the keys its chunks need: less traffic and memory when
            packed documents are shorter than the sequence).

    Returns:
        o [B, T_r, Hq, Dv] (packed [N_r, Hq, Dv]) in q's dtype, rows in the layout of this rank's shard.

    Raises:
        SparseAttnError: on every rank of the group, when any rank's arguments are invalid (as for
            sparseattn.nsa_attention), the ranks disagree on the configuration, the gates given or on shapes
            other than their token counts, the shard lengths are not those of `layout` for their sum, cu_seqlens
            ends past the packed stream, or the group's backend does not serve the tensors' device (gloo for CPU
            tensors, NCCL for CUDA tensors); also when torch.distributed is not initialized.
        SparseAttnTypeError: an argument of the wrong type (raised on every rank, like the errors above).
        SparseAttnDTypeError: non-float or mismatched dtypes, cu_seqlens not int32.
        SparseAttnUnsupportedError: on every rank, when sparseattn.nsa_attention does not take a query chunk of
            this configuration on the tensors' device (the op's error says why).

    Example:
        >>> import torch, torch.distributed as dist, sparseattn
        >>> from sparseattn import distributed as sad
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> cfg = sparseattn.NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, num_selected=3, window=16)
        >>> q, k, v = torch.randn(1, 50, 4, 16), torch.randn(1, 50, 2, 16), torch.randn(1, 50, 2, 16)
        >>> g = torch.sigmoid(torch.randn(1, 50, 4))
        >>> shards = [sad.shard(x, dim=1) for x in (q, k, v, g)]   # this rank's tokens (all of them here)
        >>> o_r = sad.nsa_attention(*shards[:3], shards[3], shards[3], shards[3], config=cfg)
        >>> torch.equal(sad.unshard(o_r, dim=1), sparseattn.nsa_attention(q, k, v, g, g, g, config=cfg))
        True
        >>> dist.destroy_process_group()
    """
    group = _group.default_group(_OP, group)
    backends = _group.backend_map(group)
    rank, size = _group.rank_and_size(group)
    gates = (g_cmp, g_slc, g_swa)
    values, error, local = None, None, None
    try:
        local = _local_config(q, k, v, gates, config, layout, cu_seqlens, exchange)
        error = _group.backend_error(_OP, "q", backends, q.device)
        if error is None:
            error = _chunk_error(q, k, v, gates, local)
        if error is None:
            values = _config_values(local, q, k, v, gates)
    except SparseAttnError as exc:
        error = exc
    rows = _group.agree(_OP, group, backends, _CONFIG_FIELDS, values, error, differ_ok=("the shard length",),
                        tensors_device=q.device if isinstance(q, Tensor) else None)
    cu = local["cu"]
    total = agreed_stream_length(_OP, rows, local["layout"], cu)
    plan = make_prefix_plan(total, size, rank, local["layout"], cu, local["exchange"])
    return _ShardedNSA.apply(q, k, v, *gates, plan, group, cu is None, local["nsa"])


def make_prefix_plan(total: int, world_size: int, rank: int, layout: str, cu: Optional[tuple[int, ...]],
                     exchange: str = "auto") -> ContextPlan:
    """The plan of an operation whose queries read every key of their document up to themselves (NSA): the plan
    of causal attention without a window, one call per chunk (per run of document pieces when packed), each with
    its queries and the keys from the start of its first query's document to the chunk's end. "auto" exchanges
    K/V by all_gather (the reach is unbounded)."""
    method = choose_method(exchange, True, (-1, -1))
    return make_plan(total, world_size, rank, layout, cu, True, (-1, -1), method)


def _local_config(q, k, v, gates, config, layout, cu_seqlens, exchange) -> dict:
    """This rank's arguments, checked without communication (raises SparseAttnError)."""
    config = NSAConfig() if config is None else config
    if not isinstance(config, NSAConfig):
        raise chk.type_error(_OP, "config", "a sparseattn.NSAConfig or None", config)
    config._validate()
    nsa = tuple(int(getattr(config, name)) for name in _SIZES) + (chk.scale_arg(_OP, "scale", config.scale),)
    layout = chk.choice_arg(_OP, "layout", layout, LAYOUTS)
    exchange = chk.choice_arg(_OP, "exchange", exchange, _EXCHANGES)
    cu = host_cu_seqlens(_OP, "cu_seqlens", cu_seqlens)
    packed = cu is not None
    for name, t in (("q", q), ("k", k), ("v", v)):
        chk.tokens_arg(_OP, name, t, packed)
    for name, t in zip(_GATES, gates):
        chk.tensor_arg(_OP, name, t, optional=True)
    if all(g is None for g in gates):
        raise make_error(SparseAttnError, "config", _OP, "g_cmp",
                         "no gate given: pass at least one of g_cmp, g_slc, g_swa (a branch without gate is skipped)")
    for name, t in (("k", k), ("v", v)) + tuple((n, g) for n, g in zip(_GATES, gates) if g is not None):
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
                             f"k, v and the gates), got {list(t.shape)}")
    for name, g in zip(_GATES, gates):
        if g is not None and g.shape != q.shape[:-1]:
            raise make_error(SparseAttnError, "shape", _OP, name,
                             f"expected {list(q.shape[:-1])} (q's tokens and heads), got {list(g.shape)}")
    if v.shape[-2] != k.shape[-2] or k.shape[-1] != q.shape[-1] or k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise make_error(SparseAttnError, "shape", _OP, "k",
                         f"expected k [.., Hkv, Dqk] and v [.., Hkv, Dv] with Hkv dividing Hq and q's Dqk; got q "
                         f"{list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}")
    return dict(nsa=nsa, layout=layout, exchange=exchange, cu=cu)


def _gate_mask(gates) -> int:
    return sum(1 << i for i, g in enumerate(gates) if g is not None)


def _config_values(local: dict, q: Tensor, k: Tensor, v: Tensor, gates) -> tuple[int, ...]:
    """The configuration vector compared across ranks, one int per _CONFIG_FIELDS entry (the shard length last)."""
    return (LAYOUTS.index(local["layout"]), _EXCHANGES.index(local["exchange"]), *local["nsa"][:-1],
            _group.scale_code(local["nsa"][-1]), _gate_mask(gates), *_group.tensor_values(q, k, v, local["cu"]))


def _chunk_error(q: Tensor, k: Tensor, v: Tensor, gates, local: dict) -> Optional[SparseAttnError]:
    """The error of this rank's calls, found before any rank exchanges anything: whether sparseattn.nsa_attention
    takes a query chunk of this configuration, dtype, head sizes and gates on q's device, forward and backward
    (the CUDA kernels may not take chunks; the configuration may be inconsistent). Every rank asks, tokens or
    not, so that all of them reject the call together."""
    found = _probe_chunk(q.device, q.dtype, q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1], _gate_mask(gates),
                         local["cu"] is not None, local["nsa"])
    if found is None:
        return None
    cls, kind, argument, message = found
    return make_error(cls, kind, _OP, argument or "q",
                      f"each chunk of the shard runs sparseattn.nsa_attention on its queries against the keys "
                      f"before them (a query chunk), which this call's configuration, dtype or device does not "
                      f"take: {message}")


@functools.lru_cache(maxsize=64)
def _probe_chunk(device: torch.device, dtype: torch.dtype, heads_q: int, heads_kv: int, dim_qk: int, dim_v: int,
                 gate_mask: int, packed: bool, nsa: tuple) -> Optional[tuple]:
    """(class, kind, argument, message) of the error that sparseattn.nsa_attention's forward or backward raises
    for the calls a sharded call makes, or None when they run: a batched query chunk (one query against two keys)
    and, for a packed stream, a packed call of two one-token documents. Cached: the answer depends on these
    properties alone."""
    zeros = functools.partial(torch.zeros, dtype=dtype, device=device)
    probes = [((1, 1), (1, 2), None)]
    if packed:
        probes.append(((2,), (2,), (0, 1, 2)))
    try:
        for lead_q, lead_k, cu in probes:
            q = zeros(*lead_q, heads_q, dim_qk)
            k, v = zeros(*lead_k, heads_kv, dim_qk), zeros(*lead_k, heads_kv, dim_v)
            gates = [zeros(*lead_q, heads_q) if gate_mask >> i & 1 else None for i in range(len(_GATES))]
            cu_q = None if cu is None else int32_on(cu, device)
            cu_cmp = None if cu is None else int32_on(_compressed_bounds(cu, nsa), device)
            max_q = 0 if cu is None else 1
            o, workspace = _ops.nsa_attention(q, k, v, None, None, None, *gates, cu_q, cu_cmp, max_q, *nsa, None, 0)
            _ops.nsa_attention_backward(q, k, v, None, None, None, *gates, cu_q, cu_cmp, max_q, *nsa, o, workspace,
                                        torch.zeros_like(o), None, 0)
    except SparseAttnError as exc:
        return type(exc), getattr(exc, "kind", "value"), getattr(exc, "argument", ""), str(exc)
    return None


def _compressed_bounds(cu_k: tuple[int, ...], nsa: tuple) -> tuple[int, ...]:
    """cu_seqlens of the compressed blocks of the key sequences `cu_k` (sparseattn.compressed_cu_seqlens on the
    host): (S_b - l) // d + 1 blocks per sequence, 0 when S_b < l."""
    block, stride = nsa[0], nsa[1]
    out = [0]
    for start, end in zip(cu_k, cu_k[1:]):
        out.append(out[-1] + max((end - start - block) // stride + 1, 0))
    return tuple(out)


def nsa_calls(plan: ContextPlan) -> tuple[tuple[int, AttentionCall], ...]:
    """The nsa_attention calls of a prefix plan (:func:`make_prefix_plan`), in chunk order, each with the exchange
    stage its chunk waits for. A batched plan's calls are its own. A packed call is cut in two where its first document started before the chunk (more keys than
    queries): that document alone, with no cu_seqlens (run as a batched [1, T_b, ..] query chunk), and the
    documents after it, whose keys are their queries (cu_seqlens_k equal to cu_seqlens_q)."""
    out = []
    for chunk in plan.chunks:
        for call in chunk.calls:
            cu_q, cu_k = call.cu_seqlens_q, call.cu_seqlens_k
            if cu_q is None or cu_q[1] == cu_k[1]:
                out.append((chunk.stage, call))
                continue
            queries, keys = cu_q[1], cu_k[1]
            out.append((chunk.stage, replace(call, q_rows=(call.q_rows[0], call.q_rows[0] + queries),
                               keys=(call.keys[0], call.keys[0] + keys), cu_seqlens_q=None, cu_seqlens_k=None,
                               max_seqlen_q=queries, max_seqlen_k=keys)))
            if len(cu_q) > 2:
                rest = tuple(c - queries for c in cu_q[1:])
                longest = max(b - a for a, b in zip(rest, rest[1:]))
                out.append((chunk.stage, replace(call, q_rows=(call.q_rows[0] + queries, call.q_rows[1]),
                                                 keys=(call.keys[0] + keys, call.keys[1]), cu_seqlens_q=rest,
                                                 cu_seqlens_k=rest, max_seqlen_q=longest, max_seqlen_k=longest)))
    return tuple(out)


def _call_sequences(call: AttentionCall, nsa: tuple, device: torch.device):
    """The packed sequences of a call on the device: (cu_seqlens, cu_seqlens_k, cu_seqlens_cmp), None for what
    the call does not take (cu_seqlens_k where the keys' sequences are the queries')."""
    if call.cu_seqlens_q is None:
        return None, None, None
    cu_k = None if call.cu_seqlens_k == call.cu_seqlens_q else int32_on(call.cu_seqlens_k, device)
    return (int32_on(call.cu_seqlens_q, device), cu_k,
            int32_on(_compressed_bounds(call.cu_seqlens_k, nsa), device))


def _max_lengths(call: AttentionCall) -> tuple[int, int]:
    """max_seqlen of the call's queries and of its keys (0 for a batched call, where the shapes give them)."""
    return (call.max_seqlen_q, call.max_seqlen_k) if call.cu_seqlens_q is not None else (0, 0)


def _call_tensors(plan: ContextPlan, call: AttentionCall, dim: int, packed_stream: bool, q: Tensor,
                  k_buffer: Tensor, v_buffer: Tensor, gates, more=()):
    """The call's (q, k, v), its gates and `more` (tensors laid out like q, None allowed) as views, with a batch
    dimension of one added where one sequence of a packed stream runs as a batched query chunk."""
    first, rows = call_query_rows(call)
    single = packed_stream and call.cu_seqlens_q is None

    def view(t: Optional[Tensor], narrow: bool = True) -> Optional[Tensor]:
        if t is None:
            return None
        t = t.narrow(dim, first, rows) if narrow else t
        return t.unsqueeze(0) if single else t

    qkv = tuple(view(t, narrow=False) for t in call_views(plan, call, dim, q, k_buffer, v_buffer))
    return qkv, [view(g) for g in gates], [view(t) for t in more]


class _ShardedNSA(torch.autograd.Function):
    """Forward: exchange K/V into key buffers, then the nsa_attention calls of every chunk of the shard (a query
    chunk against its prefix; :func:`nsa_calls`). Backward: the nsa_attention backward of every call with the workspace its forward kept; dq and the gates'
    gradients into place, dK/dV partials summed over the key buffer (in call order) and reduced onto the keys'
    owners (exchange.reduce_to_owners)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor], g_slc: Optional[Tensor],
                g_swa: Optional[Tensor], plan: ContextPlan, group, batched: bool, nsa: tuple):
        dim = 1 if batched else 0
        gates = (g_cmp, g_slc, g_swa)
        keys = KeyExchange(plan, (k, v), dim, group)
        make = torch.empty if batched else torch.zeros  # packed rows in no document stay 0, as in nsa_attention
        o = make(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        calls = nsa_calls(plan)
        sequences, workspaces = [], []
        for stage, call in calls:
            k_buffer, v_buffer = keys.wait(stage)
            cu_q, cu_k, cu_cmp = _call_sequences(call, nsa, q.device)
            max_q, max_k = _max_lengths(call)
            qkv, gates_call, (o_call,) = _call_tensors(plan, call, dim, not batched, q, k_buffer, v_buffer, gates,
                                                       (o,))
            out, workspace = _ops.nsa_attention(*qkv, None, None, None, *gates_call, cu_q, cu_cmp, max_q, *nsa, cu_k,
                                                max_k)
            o_call.copy_(out)
            sequences.append((cu_q, cu_k, cu_cmp))
            workspaces.append(workspace)
        k_buffer, v_buffer = keys.wait(len(plan.stages) - 1)  # every collective done before its buffers go
        ctx.save_for_backward(q, k_buffer, v_buffer, *gates, o, *workspaces)
        ctx.plan, ctx.group, ctx.dim, ctx.batched, ctx.nsa = plan, group, dim, batched, nsa
        ctx.calls, ctx.sequences, ctx.kv_dtype = [call for _, call in calls], sequences, k.dtype
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, d_o: Tensor):
        q, k_buffer, v_buffer, g_cmp, g_slc, g_swa, o, *workspaces = ctx.saved_tensors
        plan, dim, nsa = ctx.plan, ctx.dim, ctx.nsa
        gates = (g_cmp, g_slc, g_swa)
        d_o = d_o.contiguous()  # its per-call views then have the row alignment the CUDA kernels need
        dq = torch.zeros_like(q)
        d_gates = [None if g is None else torch.zeros_like(g) for g in gates]
        partial_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        dk_partial = k_buffer.new_zeros(k_buffer.shape, dtype=partial_dtype)
        dv_partial = v_buffer.new_zeros(v_buffer.shape, dtype=partial_dtype)
        for call, (cu_q, cu_k, cu_cmp), workspace in zip(ctx.calls, ctx.sequences, workspaces):
            max_q, max_k = _max_lengths(call)
            qkv, gates_call, (o_call, d_o_call, dq_call, *d_gates_call) = _call_tensors(
                plan, call, dim, not ctx.batched, q, k_buffer, v_buffer, gates, (o, d_o, dq, *d_gates))
            grads = _ops.nsa_attention_backward(*qkv, None, None, None, *gates_call, cu_q, cu_cmp, max_q, *nsa, o_call,
                                                workspace, d_o_call, cu_k, max_k)
            dq_call.copy_(grads[0])
            for d_gate_call, grad in zip(d_gates_call, grads[5:]):
                if d_gate_call is not None:
                    d_gate_call.copy_(grad)
            dk, dv = grads[1], grads[2]
            if dk.dim() > k_buffer.dim():  # one sequence of a packed stream, run batched
                dk, dv = dk[0], dv[0]
            key_row, key_count = call_key_rows(plan, call)
            dk_partial.narrow(dim, key_row, key_count).add_(dk)
            dv_partial.narrow(dim, key_row, key_count).add_(dv)
        dk, dv = reduce_to_owners((dk_partial, dv_partial), plan, dim, ctx.group, ctx.kv_dtype)
        return dq, dk, dv, *d_gates, None, None, None, None
