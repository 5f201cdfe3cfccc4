"""transformers integration: a Llama-family causal LM whose attention layers are sparseattn's Native Sparse
Attention, trainable and usable with ``model.generate()``.

- :class:`NSALlamaConfig` / :class:`NSALlamaForCausalLM`: LlamaConfig and LlamaForCausalLM with every attention
  layer replaced by :class:`NSAAttention` (Llama's q/k/v/o projections and rotary embedding, plus a gate
  projection giving NSA's three branch gates through a sigmoid). ``save_pretrained`` / ``from_pretrained`` work
  as for any transformers model.
- :class:`SparseAttnCache`: a transformers ``Cache`` whose layers keep keys and values token-major
  ([B, capacity, Hkv, D], the layout sparseattn reads) with room to grow, so that a decode step writes only its
  new tokens and NSA reads the whole cache without a copy. Any other transformers cache works too (the keys are
  then transposed on every step).

A step with cached keys runs NSA for the new tokens against every key so far (bottom-right aligned), which gives
the rows the full forward gives for those positions: greedy ``generate()`` equals re-running the full forward on
the growing sequence. Without gradients, a :class:`SparseAttnCache` also keeps the compressed keys and values
(mean pooling, appended as their blocks complete), so a decode step pools only its new blocks instead of the whole
cache, and a step of 1 to 16 new tokens runs :func:`sparseattn.nsa_decode` over the cache's buffer seen as pages
of 64 keys (the NSA decode kernels on CUDA; where they do not take the shapes, e.g. a group above 16 query heads
per KV head, the layer falls back to :func:`sparseattn.nsa_attention` for good); any other cache makes NSA pool
every cached key at every step. Limits: sequences in a batch have equal
lengths (no padding: an attention mask with zeros is refused).

Needs the ``transformers`` package (imported when this module is).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn
from transformers import Cache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ._errors import SparseAttnError, SparseAttnUnsupportedError, make_error
from .functional import NSAConfig, compress_kv, nsa_attention
from .nsa_decode import nsa_decode

# A SparseAttnCacheLayer's token-major buffer [B, capacity, Hkv, D] is seen by nsa_decode as pages of this many keys
# (capacity a multiple of it): a multiple of 16, as the CUDA decode kernels need.
DECODE_PAGE_SIZE = 64
# The most new tokens per sequence that nsa_decode takes in one step.
DECODE_MAX_QUERIES = 16

__all__ = ["NSALlamaConfig", "NSALlamaForCausalLM", "NSAAttention", "SparseAttnCache"]

_NSA_FIELDS = ("cmp_block", "cmp_stride", "sel_block", "num_selected", "num_init", "num_local", "window")


class NSALlamaConfig(LlamaConfig):
    """LlamaConfig plus NSA's hyper-parameters (``nsa_`` + the fields of :class:`sparseattn.NSAConfig`).

    Args:
        nsa_cmp_block, nsa_cmp_stride, nsa_sel_block, nsa_num_selected, nsa_num_init, nsa_num_local,
            nsa_window: NSAConfig's fields (defaults: the NSA paper's).
        **kwargs: LlamaConfig's arguments.

    Raises:
        SparseAttnError: an NSA field out of range (as NSAConfig).

    Example:
        >>> from sparseattn.hf import NSALlamaConfig
        >>> NSALlamaConfig(nsa_window=64).nsa_config().window
        64
    """

    model_type = "sparseattn_nsa_llama"

    def __init__(self, nsa_cmp_block: int = 32, nsa_cmp_stride: int = 16, nsa_sel_block: int = 64,
                 nsa_num_selected: int = 16, nsa_num_init: int = 1, nsa_num_local: int = 2, nsa_window: int = 512,
                 **kwargs):
        self.nsa_cmp_block, self.nsa_cmp_stride, self.nsa_sel_block = nsa_cmp_block, nsa_cmp_stride, nsa_sel_block
        self.nsa_num_selected, self.nsa_num_init, self.nsa_num_local = nsa_num_selected, nsa_num_init, nsa_num_local
        self.nsa_window = nsa_window
        super().__init__(**kwargs)
        self.nsa_config()  # validates

    def nsa_config(self) -> NSAConfig:
        """The NSAConfig of the attention layers (scale: Llama's 1/sqrt(head_dim))."""
        return NSAConfig(**{name: getattr(self, "nsa_" + name) for name in _NSA_FIELDS})


class NSAAttention(nn.Module):
    """Llama's attention layer with NSA: q/k/v/o projections, rotary embedding, GQA, and a gate projection
    (hidden -> 3 x Hq, sigmoid) for the compressed, selected and sliding-window branches.

    Args:
        config: an :class:`NSALlamaConfig`.
        layer_idx: the layer's index (its slot in the cache).

    Raises:
        SparseAttnError: a configuration NSA does not take (see :class:`sparseattn.NSAConfig`).

    Example:
        >>> import torch
        >>> from sparseattn.hf import NSAAttention, NSALlamaConfig
        >>> cfg = NSALlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, nsa_cmp_block=8,
        ...                      nsa_cmp_stride=4, nsa_sel_block=8, nsa_num_selected=2, nsa_num_local=1,
        ...                      nsa_window=8)
        >>> layer = NSAAttention(cfg, 0)
        >>> cos, sin = torch.ones(1, 10, 16), torch.zeros(1, 10, 16)
        >>> out, _ = layer(torch.randn(1, 10, 64), (cos, sin))
        >>> tuple(out.shape)
        (1, 10, 64)
    """

    def __init__(self, config: NSALlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.nsa = dataclasses.replace(config.nsa_config(), scale=self.head_dim ** -0.5)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.g_proj = nn.Linear(config.hidden_size, 3 * self.num_heads, bias=True)
        self.decode_unsupported: Optional[str] = None  # why nsa_decode refused this layer's steps, once it has

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                attention_mask: Optional[Tensor] = None, past_key_values: Optional[Cache] = None,
                **kwargs) -> tuple[Tensor, None]:
        """NSA over the new tokens (hidden_states [B, T, hidden]) and, with a cache, every key before them.

        Args:
            hidden_states: [B, T, hidden].
            position_embeddings: (cos, sin) [B, T, head_dim] of the model's rotary embedding.
            attention_mask: ignored: the keys are causal, without padding (NSALlamaForCausalLM checks the
                model's attention mask).
            past_key_values: a transformers Cache (SparseAttnCache avoids copies), or None.
            **kwargs: ignored (transformers' attention keyword arguments).

        Returns:
            (output [B, T, hidden], None): NSA does not form attention weights.

        Raises:
            SparseAttnError: as :func:`sparseattn.nsa_attention`.

        Example:
            See :class:`NSAAttention`.
        """
        batch, tokens, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(batch, tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch, tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch, tokens, self.num_kv_heads, self.head_dim)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        compressed = {}
        if past_key_values is not None:
            # The cache's compressed rows hold no gradient: they serve inference only.
            pooled = isinstance(past_key_values, SparseAttnCache) and not torch.is_grad_enabled()
            extra = {"cmp_block": self.nsa.cmp_block, "cmp_stride": self.nsa.cmp_stride} if pooled else None
            keys, values = past_key_values.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx, extra)
            k, v = keys.transpose(1, 2), values.transpose(1, 2)
            if pooled:
                k_cmp, v_cmp = past_key_values.layers[self.layer_idx].compressed()
                compressed = {"k_cmp": k_cmp, "v_cmp": v_cmp}
        gates = torch.sigmoid(self.g_proj(hidden_states)).view(batch, tokens, 3, self.num_heads).to(q.dtype)
        g_cmp, g_slc, g_swa = (gates[:, :, i] for i in range(3))
        o = None
        if compressed and tokens <= DECODE_MAX_QUERIES and self.decode_unsupported is None:
            try:
                o = past_key_values.layers[self.layer_idx].nsa_decode(q, g_cmp, g_slc, g_swa, self.nsa)
            except SparseAttnUnsupportedError as error:  # raised before any launch: take the general path
                self.decode_unsupported = str(error)
        if o is None:
            o = nsa_attention(q, k, v, g_cmp, g_slc, g_swa, config=self.nsa, **compressed)
        return self.o_proj(o.reshape(batch, tokens, -1)), None


class NSALlamaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose attention layers are :class:`NSAAttention`.

    Args:
        config: an :class:`NSALlamaConfig`.

    Raises:
        SparseAttnError: a configuration NSA does not take.

    Example:
        >>> import torch
        >>> from sparseattn.hf import NSALlamaConfig, NSALlamaForCausalLM
        >>> cfg = NSALlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2, nsa_cmp_block=8, nsa_cmp_stride=4,
        ...                      nsa_sel_block=8, nsa_num_selected=2, nsa_num_local=1, nsa_window=8)
        >>> model = NSALlamaForCausalLM(cfg)
        >>> tuple(model(torch.randint(0, 32, (1, 12))).logits.shape)
        (1, 12, 32)
    """

    config_class = NSALlamaConfig

    def __init__(self, config: NSALlamaConfig):
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn = NSAAttention(config, index)
        self.post_init()

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None, **kwargs):
        """LlamaForCausalLM's forward; an attention mask with padding (a zero) raises SparseAttnUnsupportedError
        (checked with one device-to-host read when a mask is given; generate() always gives one)."""
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise make_error(SparseAttnUnsupportedError, "unsupported", "NSALlamaForCausalLM", "attention_mask",
                             "padding is not supported: give sequences of equal length")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


class SparseAttnCacheLayer(DynamicLayer):
    """One layer of :class:`SparseAttnCache`: keys and values in token-major buffers [B, capacity, Hkv, D] that
    double when full; ``keys``/``values`` are [B, Hkv, length, D] views of them (transformers' layout). When an
    update names NSA's compression (cache_kwargs ``cmp_block`` and ``cmp_stride``), the layer also keeps the
    mean-pooled compressed rows of the blocks complete so far ([B, rows, Hkv, D], token-major), pooling only the
    blocks that the update completes."""

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, dim = key_states.shape
        self._keys = key_states.new_empty(batch, 0, heads, dim)
        self._values = value_states.new_empty(batch, 0, heads, value_states.shape[-1])
        self.length = 0
        self._k_cmp, self._v_cmp = self._keys, self._values
        self.cmp_rows = 0
        self.cmp_shape: Optional[tuple[int, int]] = None  # (cmp_block, cmp_stride) of the compressed rows
        self._views()
        self.is_initialized = True

    def _rows(self, length: int) -> int:
        block, stride = self.cmp_shape
        return 0 if length < block else (length - block) // stride + 1

    def _pool(self, cache_kwargs: Optional[dict]) -> None:
        """Appends the compressed rows of the blocks complete at self.length (all of them when the compression
        changes or starts late)."""
        shape = None if not cache_kwargs or "cmp_block" not in cache_kwargs else (
            int(cache_kwargs["cmp_block"]), int(cache_kwargs["cmp_stride"]))
        if shape is None:
            return
        if shape != self.cmp_shape:
            self.cmp_shape, self.cmp_rows = shape, 0
        rows = self._rows(self.length)
        if rows <= self.cmp_rows:
            return
        block, stride = shape
        start = self.cmp_rows * stride
        end = (rows - 1) * stride + block
        k_new, v_new = compress_kv(self._keys[:, start:end], self._values[:, start:end], block=block, stride=stride)
        if self._k_cmp.shape[1] < rows:
            capacity = max(rows, 2 * self._k_cmp.shape[1], 16)
            k_cmp = self._keys.new_empty(self._keys.shape[0], capacity, *self._keys.shape[2:])
            v_cmp = self._values.new_empty(self._values.shape[0], capacity, *self._values.shape[2:])
            k_cmp[:, : self.cmp_rows] = self._k_cmp[:, : self.cmp_rows]
            v_cmp[:, : self.cmp_rows] = self._v_cmp[:, : self.cmp_rows]
            self._k_cmp, self._v_cmp = k_cmp, v_cmp
        self._k_cmp[:, self.cmp_rows: rows] = k_new
        self._v_cmp[:, self.cmp_rows: rows] = v_new
        self.cmp_rows = rows

    def compressed(self) -> tuple[Tensor, Tensor]:
        """The compressed keys and values [B, rows, Hkv, D] of the blocks complete in the cache (views)."""
        return self._k_cmp[:, : self.cmp_rows], self._v_cmp[:, : self.cmp_rows]

    def nsa_decode(self, q: Tensor, g_cmp: Tensor, g_slc: Tensor, g_swa: Tensor, config: NSAConfig) -> Tensor:
        """:func:`sparseattn.nsa_decode` of the new queries q [B, Tq, Hq, D] (their keys already appended) over this
        layer's keys, seen as pages of DECODE_PAGE_SIZE keys (sequence b's pages in order), and its compressed
        rows (needs an update that named the compression). No copy of the cache, no host synchronisation."""
        batch, capacity = self._keys.shape[:2]
        if capacity % DECODE_PAGE_SIZE or not (self._keys.is_contiguous() and self._values.is_contiguous()):
            raise make_error(SparseAttnUnsupportedError, "unsupported", "SparseAttnCache", "keys",
                             f"a buffer of {capacity} tokens is not whole contiguous pages of {DECODE_PAGE_SIZE}")
        pages = capacity // DECODE_PAGE_SIZE
        k_pages = self._keys.view(batch * pages, DECODE_PAGE_SIZE, *self._keys.shape[2:])
        v_pages = self._values.view(batch * pages, DECODE_PAGE_SIZE, *self._values.shape[2:])
        block_table = torch.arange(batch * pages, dtype=torch.int32, device=q.device).view(batch, pages)
        lengths = torch.full((batch,), self.length, dtype=torch.int32, device=q.device)
        return nsa_decode(q, k_pages, v_pages, block_table=block_table, cache_seqlens=lengths, k_cmp=self._k_cmp,
                          v_cmp=self._v_cmp, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, config=config)

    def _views(self) -> None:
        self.keys = self._keys[:, : self.length].transpose(1, 2)
        self.values = self._values[:, : self.length].transpose(1, 2)

    def _reserve(self, length: int) -> None:
        capacity = self._keys.shape[1]
        if length <= capacity:
            return
        capacity = -(-max(length, 2 * capacity, 256) // DECODE_PAGE_SIZE) * DECODE_PAGE_SIZE
        keys = self._keys.new_empty(self._keys.shape[0], capacity, *self._keys.shape[2:])
        values = self._values.new_empty(self._values.shape[0], capacity, *self._values.shape[2:])
        keys[:, : self.length] = self._keys[:, : self.length]
        values[:, : self.length] = self._values[:, : self.length]
        self._keys, self._values = keys, values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self._keys.shape[0]:
            raise make_error(SparseAttnError, "shape", "SparseAttnCache", "key_states",
                             f"has batch {key_states.shape[0]}, the cache {self._keys.shape[0]}")
        new = key_states.shape[-2]
        self._reserve(self.length + new)
        self._keys[:, self.length: self.length + new] = key_states.transpose(1, 2)
        self._values[:, self.length: self.length + new] = value_states.transpose(1, 2)
        self.length += new
        self._views()
        self._pool(args[0] if args else kwargs.get("cache_kwargs"))
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if not self.is_initialized:
            return
        keep = tokens_to_remove if tokens_to_remove > 0 else self.length + tokens_to_remove
        self.length = max(0, min(self.length, keep))
        if self.cmp_shape is not None:
            self.cmp_rows = min(self.cmp_rows, self._rows(self.length))
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
            self._k_cmp = self._k_cmp.repeat_interleave(repeats, dim=0)
            self._v_cmp = self._v_cmp.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._k_cmp, self._v_cmp = self._k_cmp[indices], self._v_cmp[indices]
            self._views()

    def reset(self) -> None:
        if self.is_initialized:
            self.length = 0
            self.cmp_rows = 0
            self._views()


class SparseAttnCache(Cache):
    """A transformers Cache of :class:`SparseAttnCacheLayer` layers (created as the model's layers first write).

    Args:
        **kwargs: ignored (transformers passes its cache arguments here).

    Raises:
        SparseAttnError: a layer updated with another batch size than it holds.

    Example:
        >>> import torch
        >>> from sparseattn.hf import SparseAttnCache
        >>> cache = SparseAttnCache()
        >>> keys, values = cache.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16), 0)
        >>> keys, values = cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)
        >>> tuple(keys.shape), cache.get_seq_length()
        ((1, 2, 6, 16), 6)
    """

    def __init__(self, **kwargs):
        super().__init__(layer_class_to_replicate=SparseAttnCacheLayer)
