"""A paged KV cache for serving: pages of keys and values shared by the sequences of a batch, with the
bookkeeping a serving loop needs (allocation, appending, forking a sequence that shares a prefix, freeing) on the
host and the data on the device.

The pages are [num_pages, page_size, Hkv, D] tensors, the layout :func:`sparseattn.flash_decode` reads with a block
table. Sequence lengths and page lists live on the host, so appending computes its write positions without a
device synchronisation (one host-to-device copy of the positions). Forked sequences share their full pages; a
shared partial last page is copied before either sequence writes into it (copy on write), so no page is ever
written by two sequences.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from . import _checks as chk
from ._errors import SparseAttnError, make_error
from .decode import flash_decode
from .functional import NSAConfig
from .nsa_decode import nsa_decode

__all__ = ["NSAPagedKVCache", "PagedKVCache"]

_OP = "PagedKVCache"


def _error(arg: str, message: str, kind: str = "value") -> SparseAttnError:
    return make_error(SparseAttnError, kind, _OP, arg, message)


class PagedKVCache:
    """Keys and values of many sequences in shared pages, with a block table per sequence.

    Args:
        num_pages: pages in the pool.
        page_size: keys per page (on CUDA a multiple of 16, as flash_decode reads them).
        num_kv_heads, head_dim: Hkv and Dqk of the keys; ``v_head_dim`` (default head_dim) of the values.
        max_pages_per_seq: the width of the block tables: a sequence holds at most this many pages.
        dtype, device: of the pages.

    Raises:
        SparseAttnError: a size that is not positive.

    Example:
        >>> import torch
        >>> from sparseattn.cache import PagedKVCache
        >>> cache = PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=16, max_pages_per_seq=4)
        >>> a = cache.add_sequence()
        >>> cache.append([a], torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16))   # a prompt of 6 tokens
        >>> b = cache.fork(a)                                                       # b shares a's 6 tokens
        >>> cache.append([a, b], torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16))
        >>> o = cache.attend(torch.randn(2, 1, 8, 16), [a, b])                      # one decode step each
        >>> tuple(o.shape), cache.length(a), cache.free_pages
        ((2, 1, 8, 16), 7, 5)
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *, max_pages_per_seq: int,
                 v_head_dim: Optional[int] = None, dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device] = "cpu"):
        for name, value in (("num_pages", num_pages), ("page_size", page_size), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("max_pages_per_seq", max_pages_per_seq)):
            chk.int_arg(_OP, name, value, minimum=1)
        v_dim = head_dim if v_head_dim is None else chk.int_arg(_OP, "v_head_dim", v_head_dim, minimum=1)
        self.page_size, self.max_pages_per_seq = page_size, max_pages_per_seq
        self.k_pages = torch.zeros(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v_pages = torch.zeros(num_pages, page_size, num_kv_heads, v_dim, dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out the lowest page first
        self._refs = [0] * num_pages
        self._pages: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        self._next_id = 0

    # ------------------------------------------------------------------------------------------- bookkeeping

    @property
    def free_pages(self) -> int:
        """Pages not held by any sequence."""
        return len(self._free)

    def add_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        seq = self._next_id
        self._next_id += 1
        self._pages[seq], self._lengths[seq] = [], 0
        return seq

    def fork(self, seq: int) -> int:
        """A new sequence that shares every token of ``seq`` (its pages, counted twice until one of the two
        writes into the shared partial page, which is then copied). Returns its id."""
        self._check_ids([seq])
        child = self.add_sequence()
        self._pages[child] = list(self._pages[seq])
        self._lengths[child] = self._lengths[seq]
        for page in self._pages[child]:
            self._refs[page] += 1
        return child

    def free(self, seq: int) -> None:
        """Releases ``seq`` and the pages no other sequence holds."""
        self._check_ids([seq])
        for page in self._pages.pop(seq):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
        del self._lengths[seq]

    def length(self, seq: int) -> int:
        """Tokens held by ``seq``."""
        self._check_ids([seq])
        return self._lengths[seq]

    def pages(self, seq: int) -> list[int]:
        """The pages of ``seq`` in key order."""
        self._check_ids([seq])
        return list(self._pages[seq])

    def block_table(self, seqs: Sequence[int]) -> Tensor:
        """int32 [len(seqs), max_pages_per_seq] on the pages' device: each sequence's pages, 0 past its last."""
        self._check_ids(seqs)
        table = torch.zeros(len(seqs), self.max_pages_per_seq, dtype=torch.int32)
        for row, seq in enumerate(seqs):
            table[row, : len(self._pages[seq])] = torch.tensor(self._pages[seq], dtype=torch.int32)
        return table.to(self.k_pages.device, non_blocking=True)

    def seqlens(self, seqs: Sequence[int]) -> Tensor:
        """int32 [len(seqs)] on the pages' device: each sequence's tokens."""
        self._check_ids(seqs)
        lengths = torch.tensor([self._lengths[seq] for seq in seqs], dtype=torch.int32)
        return lengths.to(self.k_pages.device, non_blocking=True)

    # ------------------------------------------------------------------------------------------------ data

    def append(self, seqs: Sequence[int], k: Tensor, v: Tensor) -> None:
        """Writes new keys and values k, v [len(seqs), T_new, Hkv, D] after each sequence's tokens, allocating
        pages (and copying a shared partial last page first).

        Raises:
            SparseAttnError: unknown or repeated sequence ids, shapes, dtypes or devices that do not match the
                pages, a sequence that would exceed max_pages_per_seq pages, or no free page left.
        """
        self._check_ids(seqs)
        if len(set(seqs)) != len(seqs):
            raise _error("seqs", f"names a sequence twice ({list(seqs)}): one write per sequence")
        for name, t, pages in (("k", k, self.k_pages), ("v", v, self.v_pages)):
            if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[0] != len(seqs) or t.shape[2:] != pages.shape[2:]:
                shape = None if not isinstance(t, Tensor) else tuple(t.shape)
                raise _error(name, f"expected [{len(seqs)}, T_new, {pages.shape[2]}, {pages.shape[3]}], got {shape}",
                             "shape")
            if t.dtype != pages.dtype or t.device != pages.device:
                raise _error(name, f"is {t.dtype} on {t.device}; the pages are {pages.dtype} on {pages.device}",
                             "dtype")
        if k.shape[1] != v.shape[1]:
            raise _error("v", f"has {v.shape[1]} tokens, k {k.shape[1]}", "shape")
        new = k.shape[1]
        needed, refs = 0, {}  # refs: the shared partial pages' holders left after the copies counted so far
        for seq in seqs:
            end = self._lengths[seq] + new
            if end > self.max_pages_per_seq * self.page_size:
                raise _error("k", f"sequence {seq} would hold {end} tokens; the block table holds "
                                  f"{self.max_pages_per_seq} pages of {self.page_size}")
            needed += -(-end // self.page_size) - len(self._pages[seq])
            if new > 0 and self._shared_partial(seq):
                last = self._pages[seq][-1]
                refs.setdefault(last, self._refs[last])
                if refs[last] > 1:  # the last holder writes in place
                    needed += 1
                    refs[last] -= 1
        if needed > len(self._free):
            raise _error("k", f"needs {needed} free pages, {len(self._free)} left")
        slots = []
        for seq in seqs:
            if new > 0 and self._shared_partial(seq):
                self._copy_last_page(seq)
            length = self._lengths[seq]
            while len(self._pages[seq]) * self.page_size < length + new:
                page = self._free.pop()
                self._refs[page] = 1
                self._pages[seq].append(page)
            slots += [self._pages[seq][p // self.page_size] * self.page_size + p % self.page_size
                      for p in range(length, length + new)]
            self._lengths[seq] = length + new
        index = torch.tensor(slots, dtype=torch.long).to(self.k_pages.device, non_blocking=True)
        self.k_pages.view(-1, *self.k_pages.shape[2:])[index] = k.reshape(-1, *k.shape[2:])
        self.v_pages.view(-1, *self.v_pages.shape[2:])[index] = v.reshape(-1, *v.shape[2:])

    def attend(self, q: Tensor, seqs: Sequence[int], *, causal: bool = True,
               window: Union[tuple[int, int], list, None] = (-1, -1), scale: Optional[float] = None,
               return_lse: bool = False):
        """:func:`sparseattn.flash_decode` of q [len(seqs), Tq, Hq, D] (1 <= Tq <= 16, the sequences' last Tq
        tokens, already appended) against the sequences' keys.

        Raises:
            SparseAttnError: unknown sequence ids, and what flash_decode rejects.
        """
        return flash_decode(q, self.k_pages, self.v_pages, cache_seqlens=self.seqlens(seqs),
                            block_table=self.block_table(seqs), causal=causal, window=window, scale=scale,
                            return_lse=return_lse)

    def gather(self, seq: int) -> tuple[Tensor, Tensor]:
        """The keys and values of ``seq`` as contiguous [length, Hkv, D] tensors (copies)."""
        self._check_ids([seq])
        length = self._lengths[seq]
        pages = torch.tensor(self._pages[seq], dtype=torch.long, device=self.k_pages.device)
        return (self.k_pages[pages].flatten(0, 1)[:length].clone(), self.v_pages[pages].flatten(0, 1)[:length].clone())

    # --------------------------------------------------------------------------------------------- helpers

    def _check_ids(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            if isinstance(seq, bool) or not isinstance(seq, int) or seq not in self._pages:
                raise _error("seqs", f"{seq!r} is not a live sequence of this cache")

    def _shared_partial(self, seq: int) -> bool:
        pages = self._pages[seq]
        return bool(pages) and self._lengths[seq] % self.page_size != 0 and self._refs[pages[-1]] > 1

    def _copy_last_page(self, seq: int) -> None:
        old = self._pages[seq][-1]
        page = self._free.pop()
        self.k_pages[page].copy_(self.k_pages[old])
        self.v_pages[page].copy_(self.v_pages[old])
        self._refs[old] -= 1
        self._refs[page] = 1
        self._pages[seq][-1] = page


class NSAPagedKVCache(PagedKVCache):
    """A :class:`PagedKVCache` that also keeps each sequence's compressed rows for NSA decode.

    Compressed row ``j`` of a sequence is the mean of its keys (and values) ``[j*d, j*d + l)``; it is appended by
    :meth:`append` as soon as the sequence holds ``j*d + l`` tokens and never recomputed (docs/semantics.md section
    11, "The compressed rows of a cache"). The rows live in ``k_cmp``/``v_cmp`` [max_seqs, max_cmp, Hkv, D], one
    slot per live sequence; :meth:`nsa_decode` passes the slots of its sequences (a view when they are consecutive
    slots in order, else a gathered copy).

    Args:
        As PagedKVCache, plus ``config`` (NSAConfig: cmp_block, cmp_stride and the rest of :meth:`nsa_decode`'s
        config) and ``max_seqs`` (live sequences at once, default 8).

    Raises:
        SparseAttnError: what PagedKVCache raises; a max_seqs that is not positive; add_sequence when every
            compressed slot is taken.
        SparseAttnTypeError: a config that is not an NSAConfig.

    Example:
        >>> import torch, sparseattn
        >>> from sparseattn.cache import NSAPagedKVCache
        >>> cfg = sparseattn.NSAConfig(cmp_block=4, cmp_stride=2, sel_block=16, num_selected=2, window=8)
        >>> cache = NSAPagedKVCache(num_pages=8, page_size=16, num_kv_heads=1, head_dim=8, max_pages_per_seq=4,
        ...                         config=cfg)
        >>> a = cache.add_sequence()
        >>> cache.append([a], torch.randn(1, 7, 1, 8), torch.randn(1, 7, 1, 8))
        >>> cache.compressed_rows(a)                     # rows of tokens 0..3 and 2..5
        2
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *, max_pages_per_seq: int,
                 config: Optional[NSAConfig] = None, max_seqs: int = 8, v_head_dim: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"):
        super().__init__(num_pages, page_size, num_kv_heads, head_dim, max_pages_per_seq=max_pages_per_seq,
                         v_head_dim=v_head_dim, dtype=dtype, device=device)
        self.config = NSAConfig() if config is None else config
        if not isinstance(self.config, NSAConfig):
            raise chk.type_error(_OP, "config", "a sparseattn.NSAConfig", config)
        chk.int_arg(_OP, "max_seqs", max_seqs, minimum=1)
        self.max_cmp = self._rows(max_pages_per_seq * page_size)
        shape = (max_seqs, max(self.max_cmp, 1), num_kv_heads)
        self.k_cmp = torch.zeros(*shape, head_dim, dtype=dtype, device=device)
        self.v_cmp = torch.zeros(*shape, self.v_pages.shape[-1], dtype=dtype, device=device)
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._slot: dict[int, int] = {}

    def _rows(self, length: int) -> int:
        l, d = self.config.cmp_block, self.config.cmp_stride
        return 0 if length < l else (length - l) // d + 1

    def compressed_rows(self, seq: int) -> int:
        """Compressed rows ``seq`` holds: rows(length)."""
        return self._rows(self.length(seq))

    def slot(self, seq: int) -> int:
        """The row of ``k_cmp``/``v_cmp`` that holds ``seq``'s compressed rows."""
        self._check_ids([seq])
        return self._slot[seq]

    def add_sequence(self) -> int:
        if not self._free_slots:
            raise _error("max_seqs", f"all {len(self._slot)} compressed slots are taken")
        seq = super().add_sequence()
        self._slot[seq] = self._free_slots.pop()
        return seq

    def fork(self, seq: int) -> int:
        child = super().fork(seq)
        rows = self.compressed_rows(seq)
        src, dst = self._slot[seq], self._slot[child]
        self.k_cmp[dst, :rows].copy_(self.k_cmp[src, :rows])
        self.v_cmp[dst, :rows].copy_(self.v_cmp[src, :rows])
        return child

    def free(self, seq: int) -> None:
        super().free(seq)
        self._free_slots.append(self._slot.pop(seq))

    def append(self, seqs: Sequence[int], k: Tensor, v: Tensor) -> None:
        """As :meth:`PagedKVCache.append`, then the compressed rows whose blocks the new tokens complete."""
        before = {seq: self.length(seq) for seq in seqs}
        super().append(seqs, k, v)
        l, d = self.config.cmp_block, self.config.cmp_stride
        for seq in seqs:
            first, last = self._rows(before[seq]), self._rows(self._lengths[seq])
            if last == first:
                continue
            pages = torch.tensor(self._pages[seq], dtype=torch.long)
            tokens = torch.arange(first, last)[:, None] * d + torch.arange(l)[None, :]  # [rows, l]
            slots = (pages[tokens // self.page_size] * self.page_size + tokens % self.page_size).to(self.k_pages.device)
            flat_k = self.k_pages.view(-1, *self.k_pages.shape[2:])
            flat_v = self.v_pages.view(-1, *self.v_pages.shape[2:])
            slot = self._slot[seq]
            acc = torch.float64 if self.k_cmp.dtype == torch.float64 else torch.float32  # as compress_kv
            self.k_cmp[slot, first:last] = flat_k[slots].to(acc).mean(1).to(self.k_cmp.dtype)
            self.v_cmp[slot, first:last] = flat_v[slots].to(acc).mean(1).to(self.v_cmp.dtype)

    def compressed(self, seqs: Sequence[int]) -> tuple[Tensor, Tensor]:
        """k_cmp, v_cmp [len(seqs), max_cmp, Hkv, D] of the sequences: a view when their slots are consecutive and
        in order, else a copy."""
        self._check_ids(seqs)
        slots = [self._slot[seq] for seq in seqs]
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return self.k_cmp[slots[0]: slots[0] + len(slots)], self.v_cmp[slots[0]: slots[0] + len(slots)]
        index = torch.tensor(slots, dtype=torch.long, device=self.k_cmp.device)
        return self.k_cmp[index], self.v_cmp[index]

    def nsa_decode(self, q: Tensor, seqs: Sequence[int], *, g_cmp: Optional[Tensor] = None,
                   g_slc: Optional[Tensor] = None, g_swa: Optional[Tensor] = None, num_splits: int = 0,
                   return_block_indices: bool = False):
        """:func:`sparseattn.nsa_decode` of q [len(seqs), Tq, Hq, D] (the sequences' last Tq tokens, already
        appended) against the sequences' pages and compressed rows, with this cache's config."""
        k_cmp, v_cmp = self.compressed(seqs)
        return nsa_decode(q, self.k_pages, self.v_pages, block_table=self.block_table(seqs),
                          cache_seqlens=self.seqlens(seqs), k_cmp=k_cmp, v_cmp=v_cmp, g_cmp=g_cmp, g_slc=g_slc,
                          g_swa=g_swa, config=self.config, num_splits=num_splits,
                          return_block_indices=return_block_indices)
