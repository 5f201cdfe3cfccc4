"""The cases the context-parallel tests run on every rank of a distributed_pool.Pool (each is called as
case(rank, world_size, **kwargs) and returns something picklable). Every rank builds the same full inputs from a
seed, runs the single-process sparseattn.flash_attention on them as the reference, and the sharded call on its
shard; the comparison happens on each rank, against the shard of the reference."""

from __future__ import annotations

import torch
import torch.distributed as dist

import sparseattn
from sparseattn import distributed as sad


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _inputs(seed, B, T, Hq, Hkv, Dqk, Dv, packed, dtype, device):
    """Full q, k, v and an output weight (the loss is sum(o * weight)), the same on every rank; float64 first so
    that every dtype gets the same values, rounded."""
    g = torch.Generator().manual_seed(seed)
    lead = (T,) if packed else (B, T)
    tensors = [torch.randn(*lead, h, d, generator=g, dtype=torch.float64) for h, d in ((Hq, Dqk), (Hkv, Dqk),
                                                                                          (Hkv, Dv), (Hq, Dv))]
    return [t.to(device=device, dtype=dtype) for t in tensors]


EPS = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def lowp_violations(result: dict, world_size: int, dtype: str) -> list[str]:
    """The bound of a bf16/fp16 sharded call, per output: its error against float64 is at most twice the error of
    the single-process call on the same device, plus one rounding (unit roundoff x the largest value) for each of
    the 2R dK/dV partials (every rank's flash_attention backward rounds the partial of each of its two chunks to
    the input dtype before the owner adds them up in float32), plus 1e-5 (lse: plus 1e-4)."""
    eps = EPS[getattr(torch, dtype)]
    out = []
    for name, err in result["errors64"].items():
        single = result["single_errors64"][name]
        if name == "lse":
            bound = 2 * single + 1e-4
        else:
            bound = 2 * single + 2 * world_size * eps * result["magnitude64"][name] + 1e-5
        if not err <= bound:
            out.append(f"{name}: error {err:.3e} > bound {bound:.3e} (single-process error {single:.3e})")
    return out


def _max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| (0 where both are the same infinity)."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if got.numel() == 0:
        return 0.0
    got, ref = got.double(), ref.double()
    same = (got == ref) | (torch.isnan(got) & torch.isnan(ref))
    return float(torch.where(same, torch.zeros_like(got), (got - ref).abs()).max())


def _sharded_run(q, k, v, w, dim, lse_dim, layout, **kwargs):
    q_r, k_r, v_r, w_r = (sad.shard(x, dim=dim, layout=layout).detach().requires_grad_() for x in (q, k, v, w))
    o_r, lse_r = sad.flash_attention(q_r, k_r, v_r, layout=layout, return_lse=True, **kwargs)
    (o_r.double() * w_r.double()).sum().backward()
    return o_r.detach(), lse_r, q_r.grad, k_r.grad, v_r.grad


def compare(rank, world_size, *, seed=0, B=2, T=16, Hq=4, Hkv=2, Dqk=8, Dv=6, causal=True, window=(-1, -1),
            scale=None, cu_seqlens=None, layout="zigzag", exchange="auto", dtype="float64", cu_as_list=False,
            repeat=True):
    """The sharded call against the single-process one on the same inputs: max errors of o, lse and the
    gradients of q, k and v on this rank's shard, the shard length, and whether a second run gave the same bits.
    With bf16/fp16 (GPU), also the errors of the single-process call against float64."""
    dtype = getattr(torch, dtype)
    device = _device(rank)
    packed = cu_seqlens is not None
    dim, lse_dim = (0, 1) if packed else (1, 2)
    q, k, v, w = _inputs(seed, B, T, Hq, Hkv, Dqk, Dv, packed, dtype, device)
    options = dict(causal=causal, window=window, scale=scale)

    def reference(q, k, v, w):
        cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        o, lse = sparseattn.flash_attention(*leaves, cu_seqlens_q=cu, return_lse=True, **options)
        (o.double() * w.double()).sum().backward()
        return [o.detach(), lse] + [x.grad for x in leaves]

    ref = reference(q, k, v, w)
    cu_arg = None if cu_seqlens is None else (list(cu_seqlens) if cu_as_list else torch.tensor(cu_seqlens,
                                                                                                 dtype=torch.int32))
    got = _sharded_run(q, k, v, w, dim, lse_dim, layout, cu_seqlens=cu_arg, exchange=exchange, **options)
    dims = (dim, lse_dim, dim, dim, dim)
    names = ("o", "lse", "dq", "dk", "dv")
    errors = {n: _max_err(g, sad.shard(r, dim=d, layout=layout)) for n, g, r, d in zip(names, got, ref, dims)}
    result = dict(errors=errors, rows=got[0].shape[dim], dtypes=[str(t.dtype) for t in got],
                  scale=max(float(t.abs().max()) if t.numel() else 0.0 for t in ref[:1] + ref[2:]))
    if repeat:
        again = _sharded_run(q, k, v, w, dim, lse_dim, layout, cu_seqlens=cu_arg, exchange=exchange, **options)
        result["bit_equal"] = all(torch.equal(a, b) for a, b in zip(got, again))
    if dtype in (torch.bfloat16, torch.float16):
        ref64 = reference(*(x.detach().cpu().double() for x in (q, k, v, w)))
        result["errors64"] = {n: _max_err(g.cpu(), sad.shard(r, dim=d, layout=layout))
                              for n, g, r, d in zip(names, got, ref64, dims)}
        result["single_errors64"] = {n: _max_err(g.cpu(), r) for n, g, r in zip(names, ref, ref64)}
        result["magnitude64"] = {n: float(r.abs().max()) if r.numel() else 0.0 for n, r in zip(names, ref64)}
    return result


def call(rank, world_size, *, per_rank=None, **kwargs):
    """One sharded forward with arguments that may differ per rank (``per_rank[rank]`` overrides ``kwargs``).
    Besides flash_attention's keyword arguments: T, B, Hq, Hkv, D, dtype (of q, k and v), q_dtype, q_dims (a
    reshape of q), lengths (the shard lengths of all ranks; default: those of the layout), device (of q, k, v),
    cu_on_device (cu_seqlens as a tensor on that device) and group_backend (a new group of every rank with this
    backend instead of the default group). Returns o's shape."""
    args = dict(T=8, B=1, Hq=2, Hkv=1, D=4, dtype="float64", q_dtype=None, q_dims=None, lengths=None,
                layout="zigzag", device=_device(rank), cu_on_device=False, group_backend=None)
    args.update(kwargs)
    args.update((per_rank or {}).get(rank, {}))
    T, B, Hq, Hkv, D = (args.pop(name) for name in ("T", "B", "Hq", "Hkv", "D"))
    dtype = getattr(torch, args.pop("dtype"))
    q_dtype = args.pop("q_dtype")
    q_dtype = dtype if q_dtype is None else getattr(torch, q_dtype)
    q_dims, lengths, device = args.pop("q_dims"), args.pop("lengths"), args.pop("device")
    length = (lengths or sad.shard_lengths(T, world_size, args["layout"]))[rank]
    lead = (length,) if args.get("cu_seqlens") is not None else (B, length)
    q = torch.randn(*lead, Hq, D, dtype=q_dtype, device=device)
    if q_dims is not None:
        q = q.reshape(q_dims)
    k, v = (torch.randn(*lead, Hkv, D, dtype=dtype, device=device) for _ in range(2))
    if args.pop("cu_on_device"):
        args["cu_seqlens"] = torch.tensor(args["cu_seqlens"], dtype=torch.int32, device=device)
    group_backend = args.pop("group_backend")
    group = None if group_backend is None else dist.new_group(backend=group_backend)
    try:
        return tuple(sad.flash_attention(q, k, v, group=group, **args).shape)
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def plan_summary(rank, world_size, *, T, causal, window, layout="zigzag", cu_seqlens=None, exchange="auto"):
    """What the plan moves: rows received by this rank's exchange, rows of its key buffer, and the chunks' stages."""
    from sparseattn.distributed.plan import choose_method, make_plan

    cu = None if cu_seqlens is None else tuple(cu_seqlens)
    method = choose_method(exchange, causal, tuple(window))
    plan = make_plan(T, world_size, rank, layout, cu, causal, tuple(window), method)
    return dict(method=method, received=sum(sum(s.recv_counts) for s in plan.stages if s.active),
                key_rows=plan.key_rows, stages=[c.stage for c in plan.chunks])


def round_trip(rank, world_size, *, T, layout, dim=1):
    """shard then unshard gives back the full tensor, bit for bit; the shard's positions are shard_positions."""
    device = _device(rank)
    x = torch.arange(3 * T * 2, dtype=torch.float32, device=device).reshape(3, T, 2).movedim(1, dim)
    piece = sad.shard(x, dim=dim, layout=layout)
    positions = sad.shard_positions(T, world_size, rank, layout, device=device)
    full = sad.unshard(piece, dim=dim, layout=layout)
    return dict(equal=torch.equal(full, x), positions_ok=torch.equal(piece, x.index_select(dim, positions)),
                rows=piece.shape[dim])


def unshard_mismatch(rank, world_size):
    """unshard with a shard of another width on rank 1."""
    x = torch.zeros(2, sad.shard_lengths(8, world_size)[rank], 3 if rank != 1 else 4)
    return tuple(sad.unshard(x, dim=1).shape)


# ------------------------------------------------------------------------------------------------------ NSA

NSA_GATES = ("g_cmp", "g_slc", "g_swa")
NSA_NAMES = ("o", "dq", "dk", "dv") + tuple(f"d_{g}" for g in NSA_GATES)


def _nsa_inputs(seed, B, T, Hq, Hkv, Dqk, Dv, packed, gates, dtype, device):
    """Full q, k, v, the gates named in `gates` (None for the others; sigmoids, as a model's gates are) and an
    output weight, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    lead = (T,) if packed else (B, T)
    q, k, v, w = (torch.randn(*lead, h, d, generator=g, dtype=torch.float64)
                  for h, d in ((Hq, Dqk), (Hkv, Dqk), (Hkv, Dv), (Hq, Dv)))
    gate_values = [torch.sigmoid(torch.randn(*lead, Hq, generator=g, dtype=torch.float64)) for _ in NSA_GATES]
    gate_values = [t if name in gates else None for t, name in zip(gate_values, NSA_GATES)]
    return [None if t is None else t.to(device=device, dtype=dtype) for t in (q, k, v, *gate_values, w)]


def _nsa_sharded_run(tensors, w, dim, layout, **kwargs):
    leaves = [None if x is None else sad.shard(x, dim=dim, layout=layout).detach().requires_grad_()
              for x in tensors]
    w_r = sad.shard(w, dim=dim, layout=layout)
    o_r = sad.nsa_attention(*leaves, layout=layout, **kwargs)
    (o_r.double() * w_r.double()).sum().backward()
    return [o_r.detach()] + [None if x is None else x.grad for x in leaves]


def nsa_compare(rank, world_size, *, seed=0, B=2, T=200, Hq=4, Hkv=2, Dqk=16, Dv=8, config=None, gates=NSA_GATES,
                cu_seqlens=None, layout="zigzag", exchange="auto", dtype="float64", repeat=True):
    """The sharded sparseattn.distributed.nsa_attention against the single-process sparseattn.nsa_attention on the
    same inputs: max errors of o and the gradients of q, k, v and the given gates on this rank's shard, the shard
    length, and whether a second run gave the same bits. `config`: NSAConfig keyword arguments. With bf16/fp16,
    also the errors of the single-process call against float64."""
    dtype = getattr(torch, dtype)
    device = _device(rank)
    packed = cu_seqlens is not None
    dim = 0 if packed else 1
    cfg = sparseattn.NSAConfig(**(config or {}))
    *tensors, w = _nsa_inputs(seed, B, T, Hq, Hkv, Dqk, Dv, packed, gates, dtype, device)

    def reference(tensors, w):
        cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32, device=w.device)
        leaves = [None if x is None else x.detach().requires_grad_() for x in tensors]
        o = sparseattn.nsa_attention(*leaves, config=cfg, cu_seqlens=cu)
        (o.double() * w.double()).sum().backward()
        return [o.detach()] + [None if x is None else x.grad for x in leaves]

    ref = reference(tensors, w)
    cu_arg = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    options = dict(config=cfg, cu_seqlens=cu_arg, exchange=exchange)
    got = _nsa_sharded_run(tensors, w, dim, layout, **options)
    present = [(n, g, r) for n, g, r in zip(NSA_NAMES, got, ref) if r is not None]
    errors = {n: _max_err(g, sad.shard(r, dim=dim, layout=layout)) for n, g, r in present}
    result = dict(errors=errors, rows=got[0].shape[dim], dtypes=[str(t.dtype) for _, t, _ in present],
                  grads_given=[n for n, g, _ in zip(NSA_NAMES, got, ref) if g is not None])
    if repeat:
        again = _nsa_sharded_run(tensors, w, dim, layout, **options)
        result["bit_equal"] = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, again))
    if dtype in (torch.bfloat16, torch.float16):
        ref64 = reference([None if x is None else x.detach().cpu().double() for x in tensors], w.cpu().double())
        present64 = [(n, g, r, r64) for (n, g, r), r64 in zip(present, (r for r in ref64 if r is not None))]
        result["errors64"] = {n: _max_err(g.cpu(), sad.shard(r64, dim=dim, layout=layout))
                              for n, g, _, r64 in present64}
        result["single_errors64"] = {n: _max_err(r.cpu(), r64) for n, _, r, r64 in present64}
        result["magnitude64"] = {n: float(r64.abs().max()) if r64.numel() else 0.0 for n, _, _, r64 in present64}
        result["max_diff_single"] = {n: _max_err(g, sad.shard(r, dim=dim, layout=layout)) for n, g, r, _ in present64}
    return result


def nsa_call(rank, world_size, *, per_rank=None, **kwargs):
    """One sharded NSA forward with arguments that may differ per rank (``per_rank[rank]`` overrides ``kwargs``).
    Besides nsa_attention's keyword arguments (config: a dict of NSAConfig keyword arguments, else as given): T, B, Hq, Hkv, D, dtype,
    gate_dtype, gates (the names of the gates given), gate_tokens (a gate length other than the shard's), lengths
    (the shard lengths of all ranks), device, group_backend (as in :func:`call`). Returns o's shape."""
    args = dict(T=40, B=1, Hq=2, Hkv=1, D=16, dtype="float64", gate_dtype=None, gates=NSA_GATES, gate_tokens=None,
                lengths=None, layout="zigzag", device=_device(rank), group_backend=None,
                config=dict(cmp_block=8, cmp_stride=4, sel_block=8, num_selected=3, num_init=1, num_local=1,
                            window=16))
    args.update(kwargs)
    args.update((per_rank or {}).get(rank, {}))
    T, B, Hq, Hkv, D = (args.pop(name) for name in ("T", "B", "Hq", "Hkv", "D"))
    dtype = getattr(torch, args.pop("dtype"))
    gate_dtype = args.pop("gate_dtype")
    gate_dtype = dtype if gate_dtype is None else getattr(torch, gate_dtype)
    gates, gate_tokens = args.pop("gates"), args.pop("gate_tokens")
    lengths, device = args.pop("lengths"), args.pop("device")
    length = (lengths or sad.shard_lengths(T, world_size, args["layout"]))[rank]
    packed = args.get("cu_seqlens") is not None
    lead = (length,) if packed else (B, length)
    q, k, v = (torch.randn(*lead, h, D, dtype=dtype, device=device) for h in (Hq, Hkv, Hkv))
    gate_lead = lead if gate_tokens is None else lead[:-1] + (gate_tokens,)
    gate_args = {name: torch.rand(*gate_lead, Hq, dtype=gate_dtype, device=device) for name in gates}
    config = args.pop("config")
    args["config"] = sparseattn.NSAConfig(**config) if isinstance(config, dict) else config
    group_backend = args.pop("group_backend")
    group = None if group_backend is None else dist.new_group(backend=group_backend)
    try:
        return tuple(sad.nsa_attention(q, k, v, **gate_args, group=group, **args).shape)
    finally:
        if group is not None:
            dist.destroy_process_group(group)


def nsa_plan_summary(rank, world_size, *, T, layout="zigzag", cu_seqlens=None, exchange="auto"):
    """What NSA's plan moves: rows received by this rank's exchange, rows of its key buffer and of its shard, the
    chunks' calls as (query rows, keys) and the chunks' stages."""
    from sparseattn.distributed.nsa import make_prefix_plan

    plan = make_prefix_plan(T, world_size, rank, layout, None if cu_seqlens is None else tuple(cu_seqlens), exchange)
    return dict(method=plan.method, received=sum(sum(s.recv_counts) for s in plan.stages if s.active),
                key_rows=plan.key_rows, rows=plan.local_length, stages=[c.stage for c in plan.chunks],
                calls=[(c.q_rows, c.keys) for chunk in plan.chunks for c in chunk.calls])
