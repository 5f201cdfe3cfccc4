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
- :class:`SparseAttnStaticCache`: a fixed-capacity cache whose decode steps have fixed shapes and no host
  synchronisation (lengths on the device, compressed rows pooled on the device), so that transformers compiles the
  model's forward for generate() and replays each decode step as a CUDA graph.

A step with cached keys runs NSA for the new tokens against every key so far (bottom-right aligned), which gives
the rows the full forward gives for those positions: greedy ``generate()`` equals re-running the full forward on
the growing sequence. Without gradients, a :class:`SparseAttnCache` also keeps the compressed keys and values
(mean pooling, appended as their blocks complete), so a decode step pools only its new blocks instead of the whole
cache, and a step of 1 to 16 new tokens runs :func:`sparseattn.nsa_decode` over the cache's buffer seen as pages
of 64 keys (the NSA decode kernels on CUDA; where they do not take the shapes, e.g. a group above 16 query heads
per KV head, the layer falls back to :func:`sparseattn.nsa_attention` for good); any other cache makes NSA pool
every cached key at every step.

Prompts of different lengths come left-padded, with a 2D attention mask whose zeros mark the padding
(docs/semantics.md section 13): each sequence's result equals the sequence's alone. NSA runs on the real tokens only
(varlen nsa_attention), rotary positions count from each sequence's first real token, and both sparseattn caches
keep each sequence's real keys from slot 0 with its own compressed rows and length. Right padding and holes in the
mask are refused.

Needs the ``transformers`` package (imported when this module is).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor, nn
from transformers import Cache, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import CacheLayerMixin, DynamicLayer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ._errors import SparseAttnDTypeError, SparseAttnError, SparseAttnUnsupportedError, make_error
from .functional import CUDA_HEAD_DIMS, NSAConfig, compress_kv, nsa_attention
from .nsa_decode import nsa_decode

# A SparseAttnCacheLayer's token-major buffer [B, capacity, Hkv, D] is seen by nsa_decode as pages of this many keys
# (capacity a multiple of it): a multiple of 16, as the CUDA decode kernels need.
DECODE_PAGE_SIZE = 64
# The most new tokens per sequence that nsa_decode takes in one step.
DECODE_MAX_QUERIES = 16

__all__ = ["NSALlamaConfig", "NSALlamaForCausalLM", "NSAAttention", "SparseAttnCache", "SparseAttnStaticCache"]

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
            attention_mask: ignored: the keys are causal; NSALlamaForCausalLM reads the model's 2D mask and passes
                a left-padded batch's layout as ``sparseattn_padding``.
            past_key_values: a transformers Cache (SparseAttnCache avoids copies), or None.
            **kwargs: ``sparseattn_padding`` (a left-padded batch, from NSALlamaForCausalLM: NSA then runs on each
                sequence's real tokens, docs/semantics.md section 13); transformers' attention keyword arguments
                (ignored).

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
        gates = torch.sigmoid(self.g_proj(hidden_states)).view(batch, tokens, 3, self.num_heads).to(q.dtype)
        g_cmp, g_slc, g_swa = (gates[:, :, i] for i in range(3))
        padding = kwargs.get("sparseattn_padding")
        if padding is not None:
            o = self._padded_attention(padding, past_key_values, q, k, v, g_cmp, g_slc, g_swa)
            return self.o_proj(o.reshape(batch, tokens, -1)), None
        if isinstance(past_key_values, SparseAttnStaticCache):
            o = self._static_cache_attention(past_key_values, q, k, v, g_cmp, g_slc, g_swa)
            return self.o_proj(o.reshape(batch, tokens, -1)), None
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
        o = None
        if compressed and tokens <= DECODE_MAX_QUERIES and self.decode_unsupported is None:
            try:
                o = past_key_values.layers[self.layer_idx].nsa_decode(q, g_cmp, g_slc, g_swa, self.nsa)
            except SparseAttnUnsupportedError as error:  # raised before any launch: take the general path
                self.decode_unsupported = str(error)
        if o is None:
            o = nsa_attention(q, k, v, g_cmp, g_slc, g_swa, config=self.nsa, **compressed)
        return self.o_proj(o.reshape(batch, tokens, -1)), None

    def _padded_attention(self, padding: _LeftPadding, cache: Optional[Cache], q: Tensor, k: Tensor, v: Tensor,
                          g_cmp: Tensor, g_slc: Tensor, g_swa: Tensor) -> Tensor:
        """NSA of a left-padded batch (docs/semantics.md section 13): the real new queries, packed, against each
        sequence's real keys (varlen nsa_attention), scattered back to [B, T, Hq, Dv] with zero rows for the padding.
        SparseAttnCache and SparseAttnStaticCache keep each sequence's real keys from slot 0 and its compressed
        rows; a step of 1 to DECODE_MAX_QUERIES real tokens per sequence runs their nsa_decode with per-sequence
        lengths. Another cache keeps the padded layout: a sequence's real keys are its last ones."""
        batch, tokens = q.shape[:2]
        query_batch, query_position, cu_q = padding.queries()
        if isinstance(cache, (SparseAttnCache, SparseAttnStaticCache)):
            pooled = isinstance(cache, SparseAttnStaticCache) or not torch.is_grad_enabled()
            compression = (self.nsa.cmp_block, self.nsa.cmp_stride) if pooled else None
            cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx,
                         {"padding": padding, "compression": compression})
            layer = cache.layers[self.layer_idx]
            if (pooled and tokens <= DECODE_MAX_QUERIES and padding.all_new_tokens_real
                    and self.decode_unsupported is None):
                try:
                    return layer.nsa_decode(q, g_cmp, g_slc, g_swa, self.nsa)
                except SparseAttnUnsupportedError as error:  # raised before any launch: take the general path
                    if isinstance(cache, SparseAttnStaticCache):
                        raise
                    self.decode_unsupported = str(error)
            keys = _read_packed(layer._keys, layer._values, layer._k_cmp, layer._v_cmp, padding, compression)
        elif cache is not None:
            cached_k, cached_v = cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
            cached_k, cached_v = cached_k.transpose(1, 2), cached_v.transpose(1, 2)
            length = cached_k.shape[1]
            if length != padding.width:
                raise make_error(SparseAttnError, "shape", "NSAAttention", "attention_mask",
                                 f"has {padding.width} columns; the cache holds {length} tokens with the new ones")
            key_batch, key_slot, cu_k = padding.keys([length - total for total in padding.total_tokens])
            keys = {"k": cached_k[key_batch, key_slot], "v": cached_v[key_batch, key_slot], "cu_seqlens_k": cu_k}
        else:
            if padding.width != tokens:
                raise make_error(SparseAttnError, "shape", "NSAAttention", "attention_mask",
                                 f"has {padding.width} columns for {tokens} tokens and no cache")
            keys = {"k": k[query_batch, query_position], "v": v[query_batch, query_position]}
        gate = [None if g is None else g[query_batch, query_position] for g in (g_cmp, g_slc, g_swa)]
        if "cu_seqlens_k" in keys:
            keys["max_seqlen_k"] = max(padding.total_tokens)
        o = nsa_attention(q[query_batch, query_position], keys.pop("k"), keys.pop("v"), *gate, config=self.nsa,
                          cu_seqlens=cu_q, max_seqlen=max(padding.new_tokens), **keys)
        return o.new_zeros(batch, tokens, *o.shape[1:]).index_put((query_batch, query_position), o)

    def _static_cache_attention(self, cache: "SparseAttnStaticCache", q: Tensor, k: Tensor, v: Tensor, g_cmp: Tensor,
                                g_slc: Tensor, g_swa: Tensor) -> Tensor:
        """NSA of the new queries q [B, T, Hq, D] with a SparseAttnStaticCache: their keys are written at the
        cache's device length, then a step of 1 to DECODE_MAX_QUERIES tokens runs nsa_decode over the fixed buffers
        with the device lengths (no host synchronisation: the step a captured graph replays), and a longer chunk
        (a prefill, eager only) runs nsa_attention over the keys so far and the compressed rows."""
        layer = cache.layers[self.layer_idx]
        keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
        if q.shape[1] <= DECODE_MAX_QUERIES:
            return layer.nsa_decode(q, g_cmp, g_slc, g_swa, self.nsa)
        k_cmp, v_cmp = layer.compressed()
        return nsa_attention(q, keys.transpose(1, 2), values.transpose(1, 2), g_cmp, g_slc, g_swa, config=self.nsa,
                             k_cmp=k_cmp, v_cmp=v_cmp)


class NSALlamaForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM whose attention layers are :class:`NSAAttention`. Takes left-padded batches (a 2D
    attention mask with zeros before each sequence's first real token): each sequence's result is the sequence's
    alone (docs/semantics.md section 13).

    Args:
        config: an :class:`NSALlamaConfig`.

    Raises:
        SparseAttnError: a configuration NSA does not take; an attention mask that does not match the cache.
        SparseAttnUnsupportedError: an attention mask with right padding or a hole (a zero after a real token).

    Example:
        >>> import torch
        >>> from sparseattn.hf import NSALlamaConfig, NSALlamaForCausalLM
        >>> cfg = NSALlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2, nsa_cmp_block=8, nsa_cmp_stride=4,
        ...                      nsa_sel_block=8, nsa_num_selected=2, nsa_num_local=1, nsa_window=8)
        >>> model = NSALlamaForCausalLM(cfg)
        >>> tuple(model(torch.randint(0, 32, (1, 12))).logits.shape)
        (1, 12, 32)
        >>> ids = torch.randint(1, 32, (2, 12))
        >>> mask = torch.ones_like(ids)
        >>> mask[0, :5] = 0  # sequence 0: 7 tokens, left-padded
        >>> padded = model(ids, attention_mask=mask).logits
        >>> torch.allclose(padded[0, 5:], model(ids[:1, 5:]).logits[0], atol=1e-5)
        True
    """

    config_class = NSALlamaConfig

    def __init__(self, config: NSALlamaConfig):
        super().__init__(config)
        for index, layer in enumerate(self.model.layers):
            layer.self_attn = NSAAttention(config, index)
        self.post_init()

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, **kwargs):
        """LlamaForCausalLM's forward. A 2D attention mask is read once on the host (whether it has a zero); a mask
        with zeros is a left-padded batch (docs/semantics.md section 13): each sequence's result is that of the
        sequence alone, its rotary positions count from its first real token (when position_ids is None), and
        right padding or a hole raises SparseAttnUnsupportedError."""
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            tokens = (input_ids if input_ids is not None else kwargs["inputs_embeds"]).shape[1]
            kwargs["sparseattn_padding"] = _left_padding(attention_mask, tokens)
            if position_ids is None:
                position_ids = _padded_positions(attention_mask, tokens)
            # The NSA layers read the padding, not a mask: none is built (a padded one would be [B, 1, T, S]).
            attention_mask = None
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               **kwargs)

    def prepare_inputs_for_generation(self, input_ids: Tensor, next_sequence_length: Optional[int] = None,
                                      past_key_values: Optional[Cache] = None,
                                      attention_mask: Optional[Tensor] = None,
                                      inputs_embeds: Optional[Tensor] = None,
                                      is_first_iteration: Optional[bool] = False, **kwargs):
        """transformers' preparation. With a compileable cache, transformers turns the 2D mask into a 4D one
        before the forward sees it; when the prompt's mask has padding (read on the host for a prefill: the first
        iteration, a chunk of a chunked prefill or more than DECODE_MAX_QUERIES tokens), the prefill gets the 2D
        mask instead, so that the forward sees the padding (the decode steps then need no mask and no read: the
        cache's per-sequence device lengths place their tokens)."""
        source = inputs_embeds if inputs_embeds is not None and is_first_iteration else input_ids
        tokens = source.shape[1] if next_sequence_length is None else min(next_sequence_length, source.shape[1])
        prefill = is_first_iteration or next_sequence_length is None or tokens > DECODE_MAX_QUERIES
        padded = (prefill and isinstance(past_key_values, Cache) and past_key_values.is_compileable
                  and attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()))
        inputs = super().prepare_inputs_for_generation(
            input_ids, next_sequence_length=next_sequence_length, past_key_values=past_key_values,
            attention_mask=None if padded else attention_mask, inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration, **kwargs)
        if padded:
            inputs["attention_mask"] = attention_mask
        return inputs

    def get_compiled_call(self, compile_config):
        """transformers' compiled forward (the one generate() runs its decode steps through), behind a host-side
        step that reserves the new tokens in a :class:`SparseAttnStaticCache` (the capacity check, which the
        compiled updates cannot make without a synchronisation)."""
        compiled = super().get_compiled_call(compile_config)

        def call(*args, **kwargs):
            cache = kwargs.get("past_key_values")
            if isinstance(cache, SparseAttnStaticCache):
                tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]
                cache.reserve(tokens.shape[1])
            return compiled(*args, **kwargs)

        return call


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device` without a synchronisation: a CUDA copy goes through pinned memory, asynchronously
    (a pageable copy would wait for the stream's queued work)."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _paged_nsa_decode(q: Tensor, keys: Tensor, values: Tensor, k_cmp: Tensor, v_cmp: Tensor, block_table: Tensor,
                      lengths: Tensor, gates: tuple, config: NSAConfig) -> Tensor:
    """:func:`sparseattn.nsa_decode` of q over token-major buffers [B, capacity, Hkv, D] (capacity whole pages of
    DECODE_PAGE_SIZE) seen as pages, with the compressed rows k_cmp/v_cmp and int32 [B] lengths (no copy)."""
    batch, capacity = keys.shape[:2]
    pages = capacity // DECODE_PAGE_SIZE
    k_pages = keys.view(batch * pages, DECODE_PAGE_SIZE, *keys.shape[2:])
    v_pages = values.view(batch * pages, DECODE_PAGE_SIZE, *values.shape[2:])
    g_cmp, g_slc, g_swa = gates
    return nsa_decode(q, k_pages, v_pages, block_table=block_table, cache_seqlens=lengths, k_cmp=k_cmp, v_cmp=v_cmp,
                      g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa, config=config)


def _int32_on(values: list[int], device: torch.device) -> Tensor:
    """int32 [len(values)] on `device`, without a synchronisation (_to_device)."""
    return _to_device(torch.tensor(values, dtype=torch.int32), device)


def _segments(counts: list[int], starts: list[int], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Packed indices of one run per sequence: run b is the counts[b] consecutive indices from starts[b]. Returns
    (batch long [N], index long [N], cu int32 [B+1]) on `device`, built on the host from host ints (no device
    synchronisation: the device only receives them)."""
    counts_t = torch.tensor(counts, dtype=torch.long)
    total = int(counts_t.sum())
    cu = torch.zeros(len(counts) + 1, dtype=torch.long)
    torch.cumsum(counts_t, 0, out=cu[1:])
    batch = torch.repeat_interleave(torch.arange(len(counts)), counts_t, output_size=total)
    index = torch.arange(total) - cu[:-1][batch] + torch.tensor(starts, dtype=torch.long)[batch]
    return _to_device(batch, device), _to_device(index, device), _to_device(cu.to(torch.int32), device)


class _LeftPadding:
    """A left-padded batch as one forward sees it (docs/semantics.md section 13): of the T new tokens of sequence
    b, the last ``new_tokens[b]`` are real; the attention mask holds ``total_tokens[b]`` real tokens (cached and
    new), so ``cached_tokens[b] = total_tokens[b] - new_tokens[b]`` real tokens precede the new ones. Host ints,
    read from the mask once per forward; the device index tensors that every layer uses are built once, on first
    use."""

    def __init__(self, new_tokens: list[int], total_tokens: list[int], tokens: int, width: int,
                 device: torch.device):
        self.new_tokens, self.total_tokens, self.tokens, self.width = new_tokens, total_tokens, tokens, width
        self.cached_tokens = [total - new for total, new in zip(total_tokens, new_tokens)]
        self.device = device
        self._built: dict = {}

    def batch_index(self) -> Tensor:
        """long [B, 1]: row b of an index_put_."""
        return self._once("batch_index", lambda: torch.arange(len(self.new_tokens), device=self.device)[:, None])

    def cached_device(self) -> Tensor:
        """long [B]: cached_tokens on the device."""
        return self._once("cached", lambda: _to_device(torch.tensor(self.cached_tokens), self.device))

    def total_device(self) -> Tensor:
        """int32 [B]: total_tokens on the device (nsa_decode's cache_seqlens)."""
        return self._once("total", lambda: _int32_on(self.total_tokens, self.device))

    @property
    def all_new_tokens_real(self) -> bool:
        return all(new == self.tokens for new in self.new_tokens)

    def _once(self, key, build):
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    def queries(self) -> tuple[Tensor, Tensor, Tensor]:
        """(batch, position, cu_seqlens) of the real new tokens in the [B, T] chunk, packed sequence by sequence."""
        return self._once("queries", lambda: _segments(
            self.new_tokens, [self.tokens - new for new in self.new_tokens], self.device))

    def new_slots(self) -> tuple[Tensor, Tensor]:
        """(batch, slot) of the real new tokens in a cache that holds each sequence's real tokens from slot 0."""
        return self._once("new_slots", lambda: _segments(self.new_tokens, self.cached_tokens, self.device)[:2])

    def keys(self, starts: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """(batch, slot, cu_seqlens_k) of every real token, sequence b's from slot starts[b]."""
        return self._once(("keys", tuple(starts)), lambda: _segments(self.total_tokens, starts, self.device))

    def compressed_rows(self, block: int, stride: int) -> tuple[Tensor, Tensor]:
        """(batch, row) of every compressed row of the real tokens (rows(total_tokens[b]) from row 0)."""
        rows = [_compressed_rows(total, block, stride) for total in self.total_tokens]
        return self._once(("rows", block, stride), lambda: _segments(rows, [0] * len(rows), self.device)[:2])

    def new_compressed_rows(self, block: int, stride: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """The compressed rows the new tokens complete: (token batch, token slot, token cu_seqlens) of the spans of
        cached tokens that pool them (sequence b's from the first new row's first token), (row batch, row index)
        of the rows, and their count."""
        def build():
            first = [_compressed_rows(cached, block, stride) for cached in self.cached_tokens]
            last = [_compressed_rows(total, block, stride) for total in self.total_tokens]
            spans = [(end - start - 1) * stride + block if end > start else 0 for start, end in zip(first, last)]
            token_batch, token_slot, cu = _segments(spans, [start * stride for start in first], self.device)
            row_batch, row_index, _ = _segments([end - start for start, end in zip(first, last)], first,
                                                self.device)
            return token_batch, token_slot, cu, row_batch, row_index, sum(last) - sum(first)
        return self._once(("new_rows", block, stride), build)


def _left_padding(attention_mask: Tensor, tokens: int) -> _LeftPadding:
    """The layout of a 2D attention mask [B, W] (W >= T = `tokens`; the last T columns are the new tokens') with a
    zero, read with one device-to-host transfer. Refuses (SparseAttnUnsupportedError, naming the sequence) a row
    with a zero after a real token: right padding, or a hole in the middle."""
    op, arg = "NSALlamaForCausalLM", "attention_mask"
    batch, width = attention_mask.shape
    if width < tokens:
        raise make_error(SparseAttnError, "shape", op, arg, f"has {width} columns for {tokens} new tokens: a mask "
                         "covers the cached tokens and the new ones")
    real = attention_mask != 0
    change = real[:, 1:].to(torch.int8) - real[:, :-1].to(torch.int8)  # +1: a pad then a real token, -1: the reverse
    summary = torch.stack([real.sum(1), real[:, width - tokens:].sum(1), (change < 0).sum(1), real[:, -1]],
                          1).tolist()
    for sequence, (_, _, falls, last_real) in enumerate(summary):
        if falls:
            kind = ("a hole (a zero between real tokens)" if last_real
                    else "right padding (a zero after the last real token)")
            raise make_error(SparseAttnUnsupportedError, "unsupported", op, arg,
                             f"sequence {sequence} has {kind}: only left padding is supported (zeros before the "
                             "first real token only; tokenizer.padding_side = 'left')")
    return _LeftPadding([row[1] for row in summary], [row[0] for row in summary], tokens, width,
                        attention_mask.device)


def _padded_positions(attention_mask: Tensor, tokens: int) -> Tensor:
    """Rotary positions of the new tokens of a left-padded batch as generate() computes them: each sequence's real
    tokens count from 0 (padding at 0)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)[:, -tokens:]


def _write_step(keys: Tensor, values: Tensor, k_cmp: Tensor, v_cmp: Tensor, batch_index: Tensor, old: Tensor,
                k_new: Tensor, v_new: Tensor, block: int, stride: int, scratch_row: int) -> None:
    """Scatters T new tokens [B, T, Hkv, D] at the lengths `old` (long [B], on the device) of token-major buffers
    [B, capacity, Hkv, D] and pools the compressed rows their blocks complete: the candidates are the last
    ceil(T / stride) rows at the new length (no more blocks end among T consecutive tokens); a candidate that the
    step does not complete (or before row 0) goes to `scratch_row`, so that no earlier row is rewritten. Fixed
    shapes, no host synchronisation."""
    batch, tokens = k_new.shape[:2]
    capacity = keys.shape[1]
    steps = torch.arange(tokens, device=old.device)
    positions = (old[:, None] + steps).clamp_(max=capacity - 1)  # clamped: never a write out of bounds
    # index_put_ (not scatter_): torch.compile writes it into the buffer in place, without a copy of the buffer.
    keys.index_put_((batch_index, positions), k_new)
    values.index_put_((batch_index, positions), v_new)
    new = old + tokens
    candidates = -(-tokens // stride)
    last = torch.div(new - block, stride, rounding_mode="floor")  # the last complete row (< 0: none)
    rows = last[:, None] - torch.arange(candidates, device=old.device)  # [B, R]
    completed = (rows >= 0) & (rows * stride + block > old[:, None])
    token_index = (rows.clamp(min=0)[:, :, None] * stride + torch.arange(block, device=old.device))
    token_index = token_index.clamp_(max=capacity - 1).view(batch, -1)  # [B, R * block]
    target = torch.where(completed, rows, scratch_row)
    accumulate = torch.float64 if keys.dtype == torch.float64 else torch.float32  # as compress_kv
    for buffer, compressed in ((keys, k_cmp), (values, v_cmp)):
        gathered = buffer.gather(1, token_index[:, :, None, None].expand(-1, -1, *buffer.shape[2:]))
        pooled = gathered.view(batch, candidates, block, *buffer.shape[2:]).to(accumulate).sum(2) / block
        compressed.index_put_((batch_index, target), pooled.to(keys.dtype))


def _write_padded_chunk(keys: Tensor, values: Tensor, k_cmp: Optional[Tensor], v_cmp: Optional[Tensor],
                        k_new: Tensor, v_new: Tensor, padding: _LeftPadding,
                        compression: Optional[tuple[int, int]]) -> None:
    """Writes the real new tokens of a left-padded chunk [B, T, Hkv, D] into token-major buffers that hold each
    sequence's real tokens from slot 0 (sequence b's at slots cached_tokens[b]...), and, with a compression
    (block, stride), pools the compressed rows they complete into k_cmp/v_cmp [B, rows, Hkv, D] (compress_kv over
    each sequence's span of tokens, packed)."""
    query_batch, query_position, _ = padding.queries()
    slot_batch, slot = padding.new_slots()
    keys.index_put_((slot_batch, slot), k_new[query_batch, query_position])
    values.index_put_((slot_batch, slot), v_new[query_batch, query_position])
    if compression is not None:
        _pool_new_rows(keys, values, k_cmp, v_cmp, padding, compression)


def _pool_new_rows(keys: Tensor, values: Tensor, k_cmp: Tensor, v_cmp: Tensor, padding: _LeftPadding,
                   compression: tuple[int, int]) -> None:
    """Pools the compressed rows that sequence b's tokens cached_tokens[b]..total_tokens[b] complete (tokens from
    slot 0 of keys/values) into k_cmp/v_cmp: one packed compress_kv over each sequence's span of tokens."""
    block, stride = compression
    token_batch, token_slot, cu, row_batch, row_index, rows = padding.new_compressed_rows(block, stride)
    if rows == 0:
        return
    pooled_k, pooled_v = compress_kv(keys[token_batch, token_slot], values[token_batch, token_slot], block=block,
                                     stride=stride, cu_seqlens=cu)
    k_cmp.index_put_((row_batch, row_index), pooled_k[:rows])
    v_cmp.index_put_((row_batch, row_index), pooled_v[:rows])


def _read_packed(keys: Tensor, values: Tensor, k_cmp: Optional[Tensor], v_cmp: Optional[Tensor],
                 padding: _LeftPadding, compression: Optional[tuple[int, int]]) -> dict:
    """nsa_attention's packed key arguments over buffers that hold each sequence's real tokens from slot 0: k, v,
    cu_seqlens_k and, with a compression, the compressed rows of each sequence's blocks."""
    key_batch, key_slot, cu_k = padding.keys([0] * len(padding.total_tokens))
    packed = {"k": keys[key_batch, key_slot], "v": values[key_batch, key_slot], "cu_seqlens_k": cu_k}
    if compression is not None:
        row_batch, row_index = padding.compressed_rows(*compression)
        packed["k_cmp"], packed["v_cmp"] = k_cmp[row_batch, row_index], v_cmp[row_batch, row_index]
    return packed


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
        # A left-padded batch: each sequence's real tokens (from slot 0) and its padding; None without padding.
        self.seq_lengths: Optional[list[int]] = None
        self.seq_padding: Optional[list[int]] = None
        self._device_lengths: Optional[Tensor] = None  # int32 [B], the seq_lengths, for nsa_decode
        self._views()
        self.is_initialized = True

    def _pool(self, cache_kwargs: Optional[dict]) -> None:
        """Appends the compressed rows of the blocks complete at self.length (all of them when the compression
        changes or starts late)."""
        shape = None if not cache_kwargs or "cmp_block" not in cache_kwargs else (
            int(cache_kwargs["cmp_block"]), int(cache_kwargs["cmp_stride"]))
        if shape is None:
            return
        if shape != self.cmp_shape:
            self.cmp_shape, self.cmp_rows = shape, 0
        rows = _compressed_rows(self.length, *shape)
        if rows <= self.cmp_rows:
            return
        block, stride = shape
        start = self.cmp_rows * stride
        end = (rows - 1) * stride + block
        k_new, v_new = compress_kv(self._keys[:, start:end], self._values[:, start:end], block=block, stride=stride)
        self._reserve_rows(rows)
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
        block_table = torch.arange(batch * pages, dtype=torch.int32, device=q.device).view(batch, pages)
        if self.seq_lengths is None:
            lengths = torch.full((batch,), self.length, dtype=torch.int32, device=q.device)
        else:
            lengths = self._device_lengths
        return _paged_nsa_decode(q, self._keys, self._values, self._k_cmp, self._v_cmp, block_table, lengths,
                                 (g_cmp, g_slc, g_swa), config)

    def _stored(self) -> int:
        """Slots that hold tokens: the length, or a padded batch's longest sequence."""
        return self.length if self.seq_lengths is None else max(self.seq_lengths, default=0)

    def _views(self) -> None:
        stored = self._stored()
        self.keys = self._keys[:, :stored].transpose(1, 2)
        self.values = self._values[:, :stored].transpose(1, 2)

    def _reserve(self, length: int) -> None:
        capacity = self._keys.shape[1]
        if length <= capacity:
            return
        capacity = -(-max(length, 2 * capacity, 256) // DECODE_PAGE_SIZE) * DECODE_PAGE_SIZE
        keys = self._keys.new_empty(self._keys.shape[0], capacity, *self._keys.shape[2:])
        values = self._values.new_empty(self._values.shape[0], capacity, *self._values.shape[2:])
        stored = self._stored()
        keys[:, :stored] = self._keys[:, :stored]
        values[:, :stored] = self._values[:, :stored]
        self._keys, self._values = keys, values

    def _reserve_rows(self, rows: int) -> None:
        """Grows the compressed rows' buffers to at least `rows` rows, keeping every row."""
        if self._k_cmp.shape[1] >= rows:
            return
        capacity = max(rows, 2 * self._k_cmp.shape[1], 16)
        k_cmp = self._keys.new_empty(self._keys.shape[0], capacity, *self._keys.shape[2:])
        v_cmp = self._values.new_empty(self._values.shape[0], capacity, *self._values.shape[2:])
        k_cmp[:, : self._k_cmp.shape[1]] = self._k_cmp
        v_cmp[:, : self._v_cmp.shape[1]] = self._v_cmp
        self._k_cmp, self._v_cmp = k_cmp, v_cmp

    def _update_padded(self, k_new: Tensor, v_new: Tensor, padding: _LeftPadding,
                       compression: Optional[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """Appends the real new tokens [B, T, Hkv, D] of a left-padded batch at each sequence's length and, with a
        compression (block, stride), pools the rows they complete (a step of 1 to DECODE_MAX_QUERIES real tokens
        per sequence on the device, as SparseAttnStaticCache's steps; a chunk with compress_kv over each
        sequence's new blocks). Host ints only: no synchronisation."""
        batch = k_new.shape[0]
        lengths = self.seq_lengths if self.seq_lengths is not None else [self.length] * batch
        if lengths != padding.cached_tokens:
            raise make_error(SparseAttnError, "value", "SparseAttnCache", "attention_mask",
                             f"counts {padding.cached_tokens} real tokens before the new ones per sequence; the "
                             f"cache holds {lengths}")
        total = padding.total_tokens
        self._reserve(max(total))
        repool = compression is not None and compression != self.cmp_shape and any(lengths)
        if compression is not None:
            self._reserve_rows(_compressed_rows(max(total), *compression) + 1)  # + 1: the steps' scratch row
        if (compression is not None and not repool and padding.tokens <= DECODE_MAX_QUERIES
                and padding.all_new_tokens_real):
            _write_step(self._keys, self._values, self._k_cmp, self._v_cmp, padding.batch_index(),
                        padding.cached_device(), k_new, v_new, *compression, scratch_row=self._k_cmp.shape[1] - 1)
        else:
            _write_padded_chunk(self._keys, self._values, self._k_cmp, self._v_cmp, k_new, v_new, padding,
                                None if repool else compression)
            if repool:  # the rows of the cached tokens were not kept (a call with gradients) or had another shape
                _pool_new_rows(self._keys, self._values, self._k_cmp, self._v_cmp,
                               _LeftPadding(total, total, 0, 0, k_new.device), compression)
        self.cmp_shape = compression
        self.cmp_rows = 0 if compression is None else _compressed_rows(max(total), *compression)
        self.seq_lengths, self.seq_padding = list(total), [padding.width - length for length in total]
        self._device_lengths = padding.total_device()
        self.length = padding.width
        self._views()
        return self.keys, self.values

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self._keys.shape[0]:
            raise make_error(SparseAttnError, "shape", "SparseAttnCache", "key_states",
                             f"has batch {key_states.shape[0]}, the cache {self._keys.shape[0]}")
        cache_kwargs = args[0] if args else kwargs.get("cache_kwargs")
        if cache_kwargs and cache_kwargs.get("padding") is not None:
            return self._update_padded(key_states.transpose(1, 2), value_states.transpose(1, 2),
                                       cache_kwargs["padding"], cache_kwargs.get("compression"))
        if self.seq_lengths is not None:
            raise make_error(SparseAttnUnsupportedError, "unsupported", "SparseAttnCache", "attention_mask",
                             "the cache holds a left-padded batch: every call needs its attention mask")
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
        """Keeps the first `tokens_to_remove` columns (>= 0) or drops the last -tokens_to_remove; a padded batch's
        sequences keep their real tokens among those columns."""
        if not self.is_initialized:
            return
        keep = tokens_to_remove if tokens_to_remove > 0 else self.length + tokens_to_remove
        self.length = max(0, min(self.length, keep))
        if self.seq_lengths is not None:
            self.seq_lengths = [max(0, min(length, self.length - pad))
                                for length, pad in zip(self.seq_lengths, self.seq_padding)]
            self.seq_padding = [min(pad, self.length) for pad in self.seq_padding]
            self._device_lengths = _int32_on(self.seq_lengths, self._keys.device)
        if self.cmp_shape is not None:
            self.cmp_rows = min(self.cmp_rows, _compressed_rows(self._stored(), *self.cmp_shape))
        self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
            self._k_cmp = self._k_cmp.repeat_interleave(repeats, dim=0)
            self._v_cmp = self._v_cmp.repeat_interleave(repeats, dim=0)
            if self.seq_lengths is not None:
                self._select_sequences([b for b in range(len(self.seq_lengths)) for _ in range(repeats)])
            self._views()

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self._k_cmp, self._v_cmp = self._k_cmp[indices], self._v_cmp[indices]
            if self.seq_lengths is not None:
                self._select_sequences(indices.tolist() if isinstance(indices, Tensor) else list(indices))
            self._views()

    def reorder_cache(self, beam_idx: Tensor) -> None:
        """Beam search's reordering: the buffers, compressed rows and lengths follow the sequences (transformers'
        default reorders only the ``keys``/``values`` views, which the next update rebuilds from the buffers)."""
        self.batch_select_indices(beam_idx.to(self._keys.device) if self.is_initialized else beam_idx)

    def _select_sequences(self, indices: list[int]) -> None:
        self.seq_lengths = [self.seq_lengths[i] for i in indices]
        self.seq_padding = [self.seq_padding[i] for i in indices]
        self._device_lengths = _int32_on(self.seq_lengths, self._keys.device)

    def reset(self) -> None:
        if self.is_initialized:
            self.length = 0
            self.cmp_rows = 0
            self.seq_lengths = self.seq_padding = self._device_lengths = None
            self._views()


class SparseAttnCache(Cache):
    """A transformers Cache of :class:`SparseAttnCacheLayer` layers (created as the model's layers first write).
    With a left-padded batch each layer holds every sequence's real keys from slot 0 (``seq_lengths``, one length
    per sequence) and ``get_seq_length()`` is the padded width (docs/semantics.md section 13).

    Args:
        **kwargs: ignored (transformers passes its cache arguments here).

    Raises:
        SparseAttnError: a layer updated with another batch size than it holds; an attention mask that does not
            match the real tokens a padded batch's sequences hold.
        SparseAttnUnsupportedError: a call without the attention mask once the cache holds a padded batch.

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


def _compressed_rows(length: int, block: int, stride: int) -> int:
    """Compressed rows of the blocks complete in `length` tokens (compress_kv's Tc)."""
    return 0 if length < block else (length - block) // stride + 1


class SparseAttnStaticCacheLayer(CacheLayerMixin):
    """One layer of :class:`SparseAttnStaticCache`: preallocated token-major buffers (keys, values [B, capacity, Hkv,
    D]; compressed keys and values [B, max_rows + 1, Hkv, D], the last row a scratch row that no read reaches) and
    the lengths as a device tensor (int32 [B]), so that a step of 1 to DECODE_MAX_QUERIES tokens has fixed shapes and
    no host synchronisation: its keys are scattered at the device lengths, the rows of the blocks it completes are
    pooled from the buffer and scattered at their indices (the other candidates to the scratch row), and
    nsa_decode reads the buffer as pages of DECODE_PAGE_SIZE keys. A longer update (a prefill) runs eagerly: it
    reads the device length once, copies its keys and pools its new rows with compress_kv.

    ``host_length`` mirrors the length on the host for the capacity check (the longest sequence's): eager updates
    advance it, and so does :meth:`SparseAttnStaticCache.reserve` before a compiled step (NSALlamaForCausalLM's
    compiled call does it). A left-padded batch's prefill (eager, with the 2D attention mask) writes each sequence's
    real tokens from slot 0 and sets the device lengths per sequence, and ``padding`` (int32 [B]) to each
    sequence's padding; the decode steps are the same as without padding.
    """

    is_compileable = True
    is_sliding = False

    def __init__(self, batch: int, capacity: int, kv_heads: int, head_dim: int, nsa: NSAConfig,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.batch_size, self.capacity, self.nsa = batch, capacity, nsa
        self.dtype, self.device = dtype, device
        self.max_rows = _compressed_rows(capacity, nsa.cmp_block, nsa.cmp_stride)
        self._keys = torch.zeros(batch, capacity, kv_heads, head_dim, dtype=dtype, device=device)
        self._values = torch.zeros_like(self._keys)
        self._k_cmp = torch.zeros(batch, self.max_rows + 1, kv_heads, head_dim, dtype=dtype, device=device)
        self._v_cmp = torch.zeros_like(self._k_cmp)
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        # A left-padded batch: each sequence's padding (int32 [B]; the padded width is lengths + padding).
        self.padding = torch.zeros(batch, dtype=torch.int32, device=device)
        self.padded = False
        pages = capacity // DECODE_PAGE_SIZE
        self._block_table = torch.arange(batch * pages, dtype=torch.int32, device=device).view(batch, pages)
        self._batch_index = torch.arange(batch, device=device)[:, None]  # [B, 1]: row b of an index_put_
        self.host_length = 0
        # transformers' layout [B, Hkv, capacity, D] (views of the buffers, as StaticLayer's full buffers).
        self.keys, self.values = self._keys.transpose(1, 2), self._values.transpose(1, 2)
        for buffer in (self._keys, self._values, self._k_cmp, self._v_cmp, self.lengths, self.padding,
                       self._block_table, self._batch_index):
            torch._dynamo.mark_static_address(buffer)
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        """Nothing to do: the buffers are allocated by the constructor."""

    def _check(self, key_states: Tensor, value_states: Tensor) -> None:
        batch, heads, tokens, dim = key_states.shape
        expected = (self._keys.shape[0], self._keys.shape[2], self._keys.shape[3])
        if (batch, heads, dim) != expected or value_states.shape != key_states.shape:
            raise make_error(SparseAttnError, "shape", "SparseAttnStaticCache", "key_states",
                             f"keys {list(key_states.shape)} and values {list(value_states.shape)} do not fit the "
                             f"cache's [B={expected[0]}, Hkv={expected[1]}, T, D={expected[2]}]")
        if key_states.dtype != self.dtype or key_states.device != self._keys.device:
            raise make_error(SparseAttnDTypeError, "dtype", "SparseAttnStaticCache", "key_states",
                             f"{key_states.dtype} on {key_states.device}; the cache holds {self.dtype} on "
                             f"{self._keys.device}")

    def _reserve(self, tokens: int) -> None:
        """Advances the host-side length by `tokens`, refusing to pass the capacity (host ints only)."""
        if self.host_length + tokens > self.capacity:
            raise make_error(SparseAttnError, "shape", "SparseAttnStaticCache", "max_cache_len",
                             f"{self.host_length} cached + {tokens} new tokens exceed the capacity of "
                             f"{self.capacity} tokens (give a larger max_cache_len)")
        self.host_length += tokens

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Writes the new keys and values [B, Hkv, T, D] after the cached ones. T <= DECODE_MAX_QUERIES: on the
        device (fixed shapes, no synchronisation; returns the whole buffers in transformers' layout); longer: eager
        (returns views of the keys and values so far). Raises SparseAttnError on a capacity overflow (eager
        updates; compiled steps are checked by SparseAttnStaticCache.reserve)."""
        self._check(key_states, value_states)
        tokens = key_states.shape[2]
        cache_kwargs = args[0] if args else kwargs.get("cache_kwargs")
        if cache_kwargs and cache_kwargs.get("padding") is not None:
            return self._update_padded(key_states.transpose(1, 2), value_states.transpose(1, 2),
                                       cache_kwargs["padding"])
        if tokens <= DECODE_MAX_QUERIES:
            if not torch.compiler.is_compiling():
                self._reserve(tokens)
            self._append_step(key_states.transpose(1, 2), value_states.transpose(1, 2))
            return self.keys, self.values
        if torch.compiler.is_compiling():
            raise make_error(SparseAttnUnsupportedError, "unsupported", "SparseAttnStaticCache", "key_states",
                             f"a compiled step of {tokens} tokens: compiled steps take 1 to {DECODE_MAX_QUERIES} "
                             "tokens (run the prefill eagerly)")
        if self.padded:
            raise make_error(SparseAttnUnsupportedError, "unsupported", "SparseAttnStaticCache", "attention_mask",
                             f"a chunk of {tokens} tokens after a left-padded batch needs the attention mask")
        return self._append_chunk(key_states.transpose(1, 2), value_states.transpose(1, 2))

    def _append_step(self, k_new: Tensor, v_new: Tensor) -> None:
        """Scatters T new tokens [B, T, Hkv, D] at the device lengths and pools the compressed rows their blocks
        complete: the candidates are the last ceil(T / stride) rows at the new length (no more blocks end among
        T consecutive tokens); a candidate that the step does not complete (or before row 0) goes to the scratch
        row, so the rows of earlier steps and of the prefill's compress_kv are never rewritten."""
        old = self.lengths.long()
        self.lengths.add_(k_new.shape[1])
        _write_step(self._keys, self._values, self._k_cmp, self._v_cmp, self._batch_index, old, k_new, v_new,
                    self.nsa.cmp_block, self.nsa.cmp_stride, scratch_row=self.max_rows)

    def _update_padded(self, k_new: Tensor, v_new: Tensor, padding: _LeftPadding) -> tuple[Tensor, Tensor]:
        """An eager update with a left-padded batch's real new tokens [B, T, Hkv, D]: reads the device lengths once
        (they must be the real tokens the mask counts before the new ones), writes each sequence's real tokens at
        its length and pools the rows they complete with compress_kv."""
        if torch.compiler.is_compiling():
            raise make_error(SparseAttnUnsupportedError, "unsupported", "SparseAttnStaticCache", "attention_mask",
                             "a compiled step with padding: run the padded prefill eagerly")
        lengths = self.lengths.tolist()
        if lengths != padding.cached_tokens:
            raise make_error(SparseAttnError, "value", "SparseAttnStaticCache", "attention_mask",
                             f"counts {padding.cached_tokens} real tokens before the new ones per sequence; the "
                             f"cache holds {lengths}")
        longest = max(padding.total_tokens)
        if longest > self.capacity:
            raise make_error(SparseAttnError, "shape", "SparseAttnStaticCache", "max_cache_len",
                             f"a sequence of {longest} tokens exceeds the capacity of {self.capacity} tokens (give a "
                             "larger max_cache_len)")
        _write_padded_chunk(self._keys, self._values, self._k_cmp, self._v_cmp, k_new, v_new, padding,
                            (self.nsa.cmp_block, self.nsa.cmp_stride))
        self.lengths.copy_(padding.total_device())
        self.padding.copy_(_int32_on([padding.width - total for total in padding.total_tokens], self.padding.device))
        self.padded = True
        self.host_length = longest
        return self.keys, self.values

    def _append_chunk(self, k_new: Tensor, v_new: Tensor) -> tuple[Tensor, Tensor]:
        """An eager update of many tokens: reads the device length (one synchronisation), copies the tokens and
        pools the compressed rows they complete with compress_kv."""
        start = int(self.lengths[0])
        self.host_length = start
        self._reserve(k_new.shape[1])
        end = self.host_length
        self._keys[:, start:end] = k_new
        self._values[:, start:end] = v_new
        self.lengths.fill_(end)
        block, stride = self.nsa.cmp_block, self.nsa.cmp_stride
        first, rows = _compressed_rows(start, block, stride), _compressed_rows(end, block, stride)
        if rows > first:
            span = slice(first * stride, (rows - 1) * stride + block)
            k_cmp, v_cmp = compress_kv(self._keys[:, span], self._values[:, span], block=block, stride=stride)
            self._k_cmp[:, first:rows] = k_cmp
            self._v_cmp[:, first:rows] = v_cmp
        return self._keys[:, :end].transpose(1, 2), self._values[:, :end].transpose(1, 2)

    def compressed(self) -> tuple[Tensor, Tensor]:
        """The compressed keys and values [B, rows, Hkv, D] of the blocks complete at the host length (views)."""
        rows = _compressed_rows(self.host_length, self.nsa.cmp_block, self.nsa.cmp_stride)
        return self._k_cmp[:, :rows], self._v_cmp[:, :rows]

    def nsa_decode(self, q: Tensor, g_cmp: Tensor, g_slc: Tensor, g_swa: Tensor, config: NSAConfig) -> Tensor:
        """:func:`sparseattn.nsa_decode` of the new queries q [B, Tq, Hq, D] (their keys already written) over the
        buffers seen as pages, with the device lengths as cache_seqlens: the same tensors at every step."""
        return _paged_nsa_decode(q, self._keys, self._values, self._k_cmp, self._v_cmp, self._block_table,
                                 self.lengths, (g_cmp, g_slc, g_swa), config)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(query_length, 0): NSA layers read no attention mask, so transformers sizes its masks by the new tokens
        only instead of building a [B, 1, T, capacity] one."""
        return query_length, 0

    def get_seq_length(self) -> Tensor:
        """The cached length, as a 0-dim device tensor (a view of the lengths, as StaticLayer's); with a left-padded
        batch, the padded width (sequence 0's length and padding)."""
        if self.padded:
            return self.lengths[0] + self.padding[0]
        return self.lengths[0]

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.lengths.zero_()
        self.padding.zero_()
        self.padded = False
        self.host_length = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Keeps the first `tokens_to_remove` tokens (>= 0) or drops the last -tokens_to_remove (eager: reads the
        device length once). Rows of blocks past the new end are rewritten when their blocks complete again. With a
        left-padded batch the count is in columns of the padded width: each sequence keeps its real tokens among
        them."""
        if self.padded:
            width = int(self.lengths[0] + self.padding[0])
            keep = max(0, min(width, tokens_to_remove if tokens_to_remove > 0 else width + tokens_to_remove))
            torch.minimum(self.lengths, (keep - self.padding).clamp_(min=0), out=self.lengths)
            self.padding.clamp_(max=keep)
            self.host_length = int(self.lengths.max())
            return
        length = int(self.lengths[0])
        keep = tokens_to_remove if tokens_to_remove > 0 else length + tokens_to_remove
        self.host_length = max(0, min(length, keep))
        self.lengths.fill_(self.host_length)

    def _fixed_batch(self, *args, **kwargs) -> None:
        raise make_error(SparseAttnUnsupportedError, "unsupported", "SparseAttnStaticCache", "batch",
                         "the batch of a static cache is fixed (beam search and batch reordering are not supported)")

    batch_repeat_interleave = batch_select_indices = reorder_cache = _fixed_batch


def _decode_refusal(config: NSALlamaConfig, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why nsa_decode's CUDA kernels would not take the model's decode steps (None where they do), from the
    shapes alone: the limits nsa_decode documents."""
    if device.type != "cuda":
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    group = config.num_attention_heads // config.num_key_value_heads
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {dtype}: the CUDA decode kernels take bfloat16 and float16"
    if (head_dim, head_dim) not in CUDA_HEAD_DIMS:
        return f"head_dim {head_dim}: the CUDA kernels take the pairs {list(CUDA_HEAD_DIMS)}"
    if group > 16:
        return f"{group} query heads per KV head: the CUDA decode kernels take at most 16"
    if config.nsa_sel_block % 16:
        return f"nsa_sel_block {config.nsa_sel_block}: the CUDA decode kernels need a multiple of 16"
    return None


class SparseAttnStaticCache(Cache):
    """A fixed-capacity transformers Cache for :class:`NSALlamaForCausalLM` that transformers can compile and
    capture as a CUDA graph (``is_compileable``): every buffer is allocated here, the lengths live on the device,
    and a decode step (1 to DECODE_MAX_QUERIES new tokens) writes its keys, pools the compressed rows its blocks
    complete and runs :func:`sparseattn.nsa_decode` with fixed shapes and no host synchronisation. Passed to
    ``model.generate(..., past_key_values=cache)`` on CUDA, it makes generate() compile the model's forward
    (mode "reduce-overhead": one CUDA graph serves every step); the prefill runs eagerly (nsa_attention). A
    left-padded batch (prompts of different lengths) keeps each sequence's real tokens from slot 0 with its own
    device length, so the compiled steps take it unchanged (docs/semantics.md section 13).

    Args:
        config: the model's :class:`NSALlamaConfig`.
        max_batch_size: the batch (fixed: every update has exactly this many sequences).
        max_cache_len: the most tokens per sequence (rounded up to whole pages of DECODE_PAGE_SIZE).
        device, dtype: those of the model.

    Raises:
        SparseAttnError: a bad size; an update that would pass the capacity, or whose batch, heads, head dim,
            dtype or device do not fit; an attention mask that does not match the cached sequences.
        SparseAttnUnsupportedError: on CUDA, shapes the NSA decode kernels do not take (more than 16 query heads
            per KV head, a head dim without kernels, a sel_block not a multiple of 16, float32); a compiled step
            of more than DECODE_MAX_QUERIES tokens; beam search (the batch is fixed).

    Example:
        >>> import torch
        >>> from sparseattn.hf import NSALlamaConfig, NSALlamaForCausalLM, SparseAttnStaticCache
        >>> cfg = NSALlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2, nsa_cmp_block=8, nsa_cmp_stride=4,
        ...                      nsa_sel_block=8, nsa_num_selected=2, nsa_num_local=1, nsa_window=8)
        >>> model = NSALlamaForCausalLM(cfg).eval()
        >>> ids = torch.randint(1, 32, (2, 20))
        >>> cache = SparseAttnStaticCache(cfg, max_batch_size=2, max_cache_len=30, device="cpu", dtype=torch.float32)
        >>> out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4,
        ...                      do_sample=False)
        >>> tuple(out.shape), int(cache.get_seq_length()), cache.get_max_length()
        ((2, 24), 23, 64)
    """

    def __init__(self, config: NSALlamaConfig, max_batch_size: int, max_cache_len: int, device=None,
                 dtype: torch.dtype = torch.float32, **kwargs):
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise make_error(SparseAttnError, "value", "SparseAttnStaticCache", name,
                                 f"must be a positive int, got {value!r}")
        device = torch.device(device if device is not None else "cpu")
        reason = _decode_refusal(config, device, dtype)
        if reason is not None:
            raise make_error(SparseAttnUnsupportedError, "unsupported", "SparseAttnStaticCache", "config", reason)
        capacity = -(-max_cache_len // DECODE_PAGE_SIZE) * DECODE_PAGE_SIZE
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        nsa = config.nsa_config()
        layers = [SparseAttnStaticCacheLayer(max_batch_size, capacity, config.num_key_value_heads, head_dim, nsa,
                                             device, dtype) for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)

    def reserve(self, tokens: int) -> None:
        """Advances every layer's host-side length by `tokens` before a compiled step (whose updates do not run
        host code), refusing to pass the capacity. NSALlamaForCausalLM's compiled call (generate()'s) calls it."""
        for layer in self.layers:
            if layer.host_length + tokens > layer.capacity:
                layer._reserve(tokens)  # raises
        for layer in self.layers:
            layer.host_length += tokens
