"""nn.Modules: the NSA attention core and a full NSA attention layer (projections, gates, rotary embedding)."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor, nn

from . import _checks as chk
from ._errors import SparseAttnDTypeError, SparseAttnError, SparseAttnTypeError, make_error
from .functional import NSAConfig, nsa_attention, recompute_arg

__all__ = ["NativeSparseAttention", "NativeSparseAttentionCore", "apply_rotary", "sequence_positions"]


def _config_arg(op: str, config) -> NSAConfig:
    if config is None:
        return NSAConfig()
    if not isinstance(config, NSAConfig):
        raise chk.type_error(op, "config", "a sparseattn.NSAConfig or None", config)
    return config


class NativeSparseAttentionCore(nn.Module):
    """NSA on already projected q, k, v and activated gates (see :func:`sparseattn.nsa_attention`).

    Args:
        config: an :class:`NSAConfig` (None: the defaults).
        recompute: what the forward keeps for the backward: "none" (or False), "branches" (recompute the branch
            outputs in the backward), "selected_and_window" (those two only) or "full" (or True: run the whole
            forward again there); see :func:`sparseattn.nsa_attention`. Stored as the mode's name.

    Raises:
        SparseAttnTypeError: config is neither an NSAConfig nor None, recompute neither a bool nor a string.
        SparseAttnError: an unknown recompute mode.
    """

    def __init__(self, config: Optional[NSAConfig] = None, recompute: Union[bool, str] = False):
        super().__init__()
        self.config = _config_arg("NativeSparseAttentionCore", config)
        self.recompute = recompute_arg("NativeSparseAttentionCore", recompute)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor] = None,
                g_slc: Optional[Tensor] = None, g_swa: Optional[Tensor] = None, *,
                cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                cu_seqlens_k: Optional[Tensor] = None, max_seqlen_k: Optional[int] = None) -> Tensor:
        """:func:`sparseattn.nsa_attention` with this module's config.

        Args:
            q: [B, T, Hq, Dqk], or packed [N, Hq, Dqk] with cu_seqlens.
            k: [B, S, Hkv, Dqk] with S >= T (packed [Nk, Hkv, Dqk]); Hkv divides Hq. More keys than queries
                make q the chunk of the last T positions (docs/semantics.md section 11).
            v: [B, S, Hkv, Dv] (packed [Nk, Hkv, Dv]).
            g_cmp, g_slc, g_swa: gates [B, T, Hq] (packed [N, Hq]) in q's dtype; at least one; a branch
                whose gate is None is skipped.
            cu_seqlens: int32 [B+1] for the packed layout.
            max_seqlen: an upper bound of the packed lengths (None: not known).
            cu_seqlens_k: int32 [B+1], packed query chunks: the keys' sequences (None: cu_seqlens).
            max_seqlen_k: an upper bound of the keys' packed lengths (None: not known).

        Returns:
            o [B, T, Hq, Dv] (packed [N, Hq, Dv]).

        Raises:
            SparseAttnError: as :func:`sparseattn.nsa_attention` (its subclasses for wrong types and dtypes).

        Example:
            >>> import torch, sparseattn
            >>> core = sparseattn.NativeSparseAttentionCore(sparseattn.NSAConfig(
            ...     cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, window=64))
            >>> q, k, v = torch.randn(1, 50, 4, 16), torch.randn(1, 50, 2, 16), torch.randn(1, 50, 2, 16)
            >>> g = torch.sigmoid(torch.randn(1, 50, 4))
            >>> tuple(core(q, k, v, g, g, g).shape)
            (1, 50, 4, 16)
            >>> torch.equal(core(q[:, -1:], k, v, g[:, -1:], g[:, -1:], g[:, -1:]), core(q, k, v, g, g, g)[:, -1:])
            True
        """
        return nsa_attention(q, k, v, g_cmp, g_slc, g_swa, config=self.config, cu_seqlens=cu_seqlens,
                             max_seqlen=max_seqlen, cu_seqlens_k=cu_seqlens_k, max_seqlen_k=max_seqlen_k,
                             recompute=self.recompute)

    def extra_repr(self) -> str:
        return repr(self.config) + (f", recompute={self.recompute!r}" if self.recompute != "none" else "")


def _device_arg(op: str, device):
    """None, or what torch.device takes (a string such as "cpu" or "cuda:0", an index or a torch.device)."""
    if device is None or isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (str, int)):
        raise chk.type_error(op, "device", "None, a torch.device, a string or an int", device)
    try:
        return torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise make_error(SparseAttnError, "device", op, "device", f"not a device: {device!r} ({exc})") from None


def _sequence_of(num_tokens: int, cu_seqlens: Tensor, device: torch.device) -> Tensor:
    """The sequence of every packed token (int64 [N]; rows past the last sequence: the last one). No host sync."""
    index = torch.arange(num_tokens, device=device, dtype=torch.int64)
    seq = torch.searchsorted(cu_seqlens[1:].to(torch.int64), index, right=True)
    return seq.clamp_max(max(cu_seqlens.shape[0] - 2, 0))


def sequence_positions(num_tokens: int, cu_seqlens: Optional[Tensor], device: torch.device) -> Tensor:
    """0-based position of every token within its sequence: arange(T) (batched) or, packed, restarting at
    every cu_seqlens boundary (rows past the last sequence continue the last one). No host sync."""
    index = torch.arange(num_tokens, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        return index
    starts = cu_seqlens[:-1].to(torch.int64)
    # The last sequence starting at or before each token (empty sequences share their start with the next one).
    seq = torch.searchsorted(starts, index, right=True) - 1
    return index - cu_seqlens.to(torch.int64)[seq.clamp_min(0)]


def _append_packed(cache: Tensor, new: Tensor, cu_cache: Tensor, cu_new: Tensor) -> tuple[Tensor, Tensor]:
    """Packed sequences of `cache` (laid out by cu_cache) each followed by its rows of `new` (cu_new): the rows and
    their cu_seqlens. Rows past the last sequence repeat a valid row (they are ignored). No host sync."""
    cu_all = (cu_cache + cu_new).to(torch.int32)
    rows = cache.shape[0] + new.shape[0]
    both = torch.cat([cache, new])
    if rows == 0:
        return both, cu_all
    index = torch.arange(rows, device=new.device, dtype=torch.int64)
    cu_all64, cu_cache64, cu_new64 = cu_all.to(torch.int64), cu_cache.to(torch.int64), cu_new.to(torch.int64)
    seq = torch.searchsorted(cu_all64[1:], index, right=True).clamp_max(cu_all.shape[0] - 2)  # its sequence
    local = index - cu_all64[seq]
    cached = cu_cache64[seq + 1] - cu_cache64[seq]
    source = torch.where(local < cached, cu_cache64[seq] + local, cache.shape[0] + cu_new64[seq] + local - cached)
    return both[source.clamp(0, rows - 1)], cu_all


def apply_rotary(x: Tensor, positions: Tensor, theta: float = 10000.0) -> Tensor:
    """Rotary position embedding (rotate-half convention) of x [..., T, H, D] at positions [T], in float32."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]  # [T, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., : dim // 2], xf[..., dim // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class NativeSparseAttention(nn.Module):
    """A Native Sparse Attention layer: q/k/v/o projections, sigmoid gates, rotary embedding and NSA.

    forward(x [B, T, hidden] or packed [N, hidden] with cu_seqlens) returns a tensor of the same leading
    shape. Rotary positions restart at 0 for every packed sequence. With a ``kv_cache`` of the keys and values
    before x (chunked prefill, decoding), x's tokens follow them and attend to both (docs/semantics.md
    section 11); forward then also returns the keys and values to cache for the next call.

    Args:
        hidden_size: model width (a positive int).
        num_heads: query heads Hq; num_kv_heads: KV heads Hkv, which divide Hq.
        head_dim: Dqk (even with rotary); v_head_dim: Dv (None: head_dim).
        config: an :class:`NSAConfig` (None: the defaults).
        rotary: apply the rotary embedding to q and k; rope_theta: its base (finite, positive).
        bias: bias terms in the projections.
        device, dtype: of the parameters (dtype: float16, bfloat16, float32 or float64).
        recompute: what NSA keeps for the backward: "none" (or False), "branches", "selected_and_window" or "full"
            (or True); see :func:`sparseattn.nsa_attention`.

    Raises:
        SparseAttnTypeError: an argument of the wrong type.
        SparseAttnError: sizes not positive or beyond 32-bit ints, Hkv not dividing Hq, an odd head_dim with
            rotary, a bad rope_theta, device or dtype.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: Optional[int] = None, config: Optional[NSAConfig] = None, rotary: bool = True,
                 rope_theta: float = 10000.0, bias: bool = False, device=None, dtype=None,
                 recompute: Union[bool, str] = False):
        super().__init__()
        op = "NativeSparseAttention"
        hidden_size = chk.int_arg(op, "hidden_size", hidden_size, minimum=1)
        num_heads = chk.int_arg(op, "num_heads", num_heads, minimum=1)
        num_kv_heads = chk.int_arg(op, "num_kv_heads", num_kv_heads, minimum=1)
        head_dim = chk.int_arg(op, "head_dim", head_dim, minimum=1)
        if v_head_dim is not None:
            v_head_dim = chk.int_arg(op, "v_head_dim", v_head_dim, minimum=1)
        config = _config_arg(op, config)
        rotary = chk.bool_arg(op, "rotary", rotary)
        if rope_theta is None:
            raise chk.type_error(op, "rope_theta", "a float", rope_theta)
        rope_theta = chk.scale_arg(op, "rope_theta", rope_theta)
        bias = chk.bool_arg(op, "bias", bias)
        device = _device_arg(op, device)
        if dtype is not None and dtype not in chk.FLOAT_DTYPES:
            cls = SparseAttnDTypeError if isinstance(dtype, torch.dtype) else SparseAttnTypeError
            raise make_error(cls, "dtype" if cls is SparseAttnDTypeError else "type", op, "dtype",
                             f"expected None or float16, bfloat16, float32 or float64, got {dtype!r}")
        if num_heads % num_kv_heads != 0:
            raise make_error(SparseAttnError, "config", op, "num_kv_heads",
                             f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if rotary and head_dim % 2 != 0:
            raise make_error(SparseAttnError, "config", op, "head_dim",
                             f"rotary embedding needs an even head_dim, got {head_dim}")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.rotary = rotary
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.v_head_dim, bias=bias, **factory)
        self.g_proj = nn.Linear(hidden_size, 3 * num_heads, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * self.v_head_dim, hidden_size, bias=bias, **factory)
        self.core = NativeSparseAttentionCore(config, recompute)

    @property
    def config(self) -> NSAConfig:
        return self.core.config

    def forward(self, x: Tensor, *, cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
                kv_cache: Optional[tuple[Tensor, Tensor]] = None, cu_seqlens_cache: Optional[Tensor] = None):
        """Projections, gates, rotary embedding, NSA and the output projection.

        Args:
            x: [B, T, hidden_size], or packed [N, hidden_size] with cu_seqlens; the dtype and device of the
                layer's parameters.
            cu_seqlens: int32 [B+1] for the packed layout (rotary positions restart at every sequence).
            max_seqlen: an upper bound of the packed lengths (None: not known).
            kv_cache: None, or (k, v) of the P tokens before x, as a previous call returned them (rotary
                applied): [B, P, Hkv, Dqk] and [B, P, Hkv, Dv], packed [Np, ...] with cu_seqlens_cache. x's
                tokens then sit at positions P .. P + T - 1 of each sequence.
            cu_seqlens_cache: int32 [B+1], the packed layout of kv_cache (with cu_seqlens).

        Returns:
            [B, T, hidden_size] (packed [N, hidden_size]); with a kv_cache, (that, (k, v)): the keys and values
            of the cache followed by x's, [B, P + T, Hkv, D] (packed, sequence b's P_b + T_b rows at
            cu_seqlens_cache + cu_seqlens).

        Raises:
            SparseAttnTypeError: x or cu_seqlens not a tensor, max_seqlen not an int.
            SparseAttnDTypeError: x's dtype is not the parameters', cu_seqlens not int32.
            SparseAttnError: wrong rank or width of x, x or cu_seqlens on another device than the parameters,
                bad cu_seqlens, and whatever :func:`sparseattn.nsa_attention` rejects.

        Example:
            >>> import torch, sparseattn
            >>> layer = sparseattn.NativeSparseAttention(64, num_heads=4, num_kv_heads=2, head_dim=16,
            ...     config=sparseattn.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, window=64))
            >>> x = torch.randn(2, 50, 64)
            >>> tuple(layer(x).shape)
            (2, 50, 64)
            >>> cu = torch.tensor([0, 30, 100], dtype=torch.int32)
            >>> tuple(layer(torch.randn(100, 64), cu_seqlens=cu, max_seqlen=70).shape)
            (100, 64)
            >>> empty = (torch.zeros(2, 0, 2, 16), torch.zeros(2, 0, 2, 16))
            >>> first, cache = layer(x[:, :40], kv_cache=empty)  # prefill 40 tokens, then 10 more
            >>> rest, cache = layer(x[:, 40:], kv_cache=cache)
            >>> torch.allclose(torch.cat([first, rest], 1), layer(x), atol=1e-6), tuple(cache[0].shape)
            (True, (2, 50, 2, 16))
        """
        op = "NativeSparseAttention"
        chk.cu_seqlens_arg(op, "cu_seqlens", cu_seqlens)
        packed = cu_seqlens is not None
        chk.tensor_arg(op, "x", x)
        if x.dim() != (2 if packed else 3) or x.shape[-1] != self.hidden_size:
            raise make_error(SparseAttnError, "shape", op, "x",
                             f"expected [N, {self.hidden_size}] with cu_seqlens or [B, T, {self.hidden_size}], "
                             f"got {list(x.shape)}")
        weight = self.q_proj.weight
        if x.dtype != weight.dtype:
            raise make_error(SparseAttnDTypeError, "dtype", op, "x",
                             f"{chk.dtype_name(x.dtype)} does not match the layer's parameters' "
                             f"{chk.dtype_name(weight.dtype)}")
        chk.same_device(op, "x", x, weight, "the layer's parameters")
        chk.cu_seqlens_arg(op, "cu_seqlens", cu_seqlens, x, "x")
        max_seqlen = chk.optional_int_arg(op, "max_seqlen", max_seqlen, minimum=0, default=None)
        cached = self._cache_arg(op, kv_cache, cu_seqlens_cache, packed, x)
        lead = x.shape[:-1]
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.v_head_dim))
        g_cmp, g_slc, g_swa = torch.sigmoid(self.g_proj(x)).unflatten(-1, (3, self.num_heads)).unbind(-2)
        if self.rotary:
            positions = sequence_positions(x.shape[-2], cu_seqlens, x.device)
            if kv_cache is not None:  # x's tokens follow the cached ones of their sequence
                if not packed:
                    positions = positions + kv_cache[0].shape[1]
                elif cached.numel() > 0:
                    positions = positions + cached[_sequence_of(x.shape[0], cu_seqlens, x.device)]
            q = apply_rotary(q, positions, self.rope_theta)
            k = apply_rotary(k, positions, self.rope_theta)
        cu_seqlens_k = None
        if kv_cache is not None:
            if packed:
                k, cu_seqlens_k = _append_packed(kv_cache[0], k, cu_seqlens_cache, cu_seqlens)
                v, _ = _append_packed(kv_cache[1], v, cu_seqlens_cache, cu_seqlens)
            else:
                k, v = torch.cat([kv_cache[0], k], dim=1), torch.cat([kv_cache[1], v], dim=1)
        o = self.core(q, k, v, g_cmp, g_slc, g_swa, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                      cu_seqlens_k=cu_seqlens_k)
        out = self.o_proj(o.reshape(*lead, self.num_heads * self.v_head_dim))
        return out if kv_cache is None else (out, (k, v))

    def _cache_arg(self, op: str, kv_cache, cu_seqlens_cache: Optional[Tensor], packed: bool,
                   x: Tensor) -> Optional[Tensor]:
        """Checks kv_cache and cu_seqlens_cache; returns the cached token count of each packed sequence (int64
        [B]), an empty tensor for the batched layout, or None without a cache."""
        if kv_cache is None:
            if cu_seqlens_cache is not None:
                raise chk.config_error(op, "cu_seqlens_cache", "is given without kv_cache")
            return None
        if not isinstance(kv_cache, (tuple, list)) or len(kv_cache) != 2:
            raise chk.type_error(op, "kv_cache", "None or a (k, v) pair of tensors", kv_cache)
        rank, heads = (3 if packed else 4), self.num_kv_heads
        for i, dim in ((0, self.head_dim), (1, self.v_head_dim)):
            name, t = f"kv_cache[{i}]", kv_cache[i]
            chk.tensor_arg(op, name, t)
            chk.same_device(op, name, t, x, "x")
            if t.dim() != rank or t.shape[-2:] != (heads, dim) or (not packed and t.shape[0] != x.shape[0]):
                expected = f"[Np, {heads}, {dim}]" if packed else f"[{x.shape[0]}, P, {heads}, {dim}]"
                raise make_error(SparseAttnError, "shape", op, name, f"expected {expected}, got {list(t.shape)}")
        if kv_cache[0].shape[:-1] != kv_cache[1].shape[:-1]:
            raise make_error(SparseAttnError, "shape", op, "kv_cache[1]",
                             f"has {list(kv_cache[1].shape[:-1])} tokens and heads, kv_cache[0] "
                             f"{list(kv_cache[0].shape[:-1])}")
        if packed != (cu_seqlens_cache is not None):
            raise chk.config_error(op, "cu_seqlens_cache", "is required with a packed kv_cache (and only then)")
        if not packed:
            return x.new_empty((0,), dtype=torch.int64)
        chk.cu_seqlens_arg(op, "cu_seqlens_cache", cu_seqlens_cache, x, "x")
        return (cu_seqlens_cache[1:] - cu_seqlens_cache[:-1]).to(torch.int64)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, rotary={self.rotary}")

