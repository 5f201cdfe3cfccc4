"""nn.Modules: the NSA attention core and a full NSA attention layer (projections, gates, rotary embedding)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ._errors import SparseAttnError, make_error
from .functional import NSAConfig, nsa_attention

__all__ = ["NativeSparseAttention", "NativeSparseAttentionCore", "apply_rotary", "sequence_positions"]


class NativeSparseAttentionCore(nn.Module):
    """NSA on already projected q, k, v and activated gates (see :func:`sparseattn.nsa_attention`)."""

    def __init__(self, config: Optional[NSAConfig] = None):
        super().__init__()
        self.config = NSAConfig() if config is None else config

    def forward(self, q: Tensor, k: Tensor, v: Tensor, g_cmp: Optional[Tensor] = None,
                g_slc: Optional[Tensor] = None, g_swa: Optional[Tensor] = None, *,
                cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None) -> Tensor:
        return nsa_attention(q, k, v, g_cmp, g_slc, g_swa, config=self.config, cu_seqlens=cu_seqlens,
                             max_seqlen=max_seqlen)

    def extra_repr(self) -> str:
        return repr(self.config)


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
    shape. Rotary positions restart at 0 for every packed sequence.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: Optional[int] = None, config: Optional[NSAConfig] = None, rotary: bool = True,
                 rope_theta: float = 10000.0, bias: bool = False, device=None, dtype=None):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise make_error(SparseAttnError, "config", "NativeSparseAttention", "num_kv_heads",
                             f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if rotary and head_dim % 2 != 0:
            raise make_error(SparseAttnError, "config", "NativeSparseAttention", "head_dim",
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
        self.core = NativeSparseAttentionCore(config)

    @property
    def config(self) -> NSAConfig:
        return self.core.config

    def forward(self, x: Tensor, *, cu_seqlens: Optional[Tensor] = None,
                max_seqlen: Optional[int] = None) -> Tensor:
        packed = cu_seqlens is not None
        if x.dim() != (2 if packed else 3):
            raise make_error(SparseAttnError, "shape", "NativeSparseAttention", "x",
                             f"expected [N, hidden] with cu_seqlens or [B, T, hidden], got {list(x.shape)}")
        lead = x.shape[:-1]
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.v_head_dim))
        g_cmp, g_slc, g_swa = torch.sigmoid(self.g_proj(x)).unflatten(-1, (3, self.num_heads)).unbind(-2)
        if self.rotary:
            positions = sequence_positions(x.shape[-2], cu_seqlens, x.device)
            q = apply_rotary(q, positions, self.rope_theta)
            k = apply_rotary(k, positions, self.rope_theta)
        o = self.core(q, k, v, g_cmp, g_slc, g_swa, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return self.o_proj(o.reshape(*lead, self.num_heads * self.v_head_dim))

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, rotary={self.rotary}")

