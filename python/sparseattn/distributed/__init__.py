"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed process group
(NCCL for CUDA tensors, gloo for CPU tensors). See docs/distributed.md.

- :func:`flash_attention`: sparseattn.flash_attention on a sharded sequence, forward and backward.
- :func:`nsa_attention`: sparseattn.nsa_attention on a sharded sequence, forward and backward (each chunk of a
  shard runs NSA over a query chunk against the keys before it).
- Sharding (:mod:`.sharding`): :func:`shard`, :func:`unshard`, :func:`shard_ranges`, :func:`shard_lengths`,
  :func:`shard_positions`; layouts "zigzag" (load-balanced causal) and "contiguous".

The pieces below them are written for reuse by other context-parallel operations: the range arithmetic
(:mod:`.ranges`), packed documents across shards (:mod:`.documents`), the host-side plan of chunks, calls and
transfers (:mod:`.plan`), the exchange and the deterministic reduction (:mod:`.exchange`), and the cross-rank
agreement check (:mod:`.group`).
"""

from .flash import flash_attention
from .nsa import nsa_attention
from .sharding import LAYOUTS, chunk_bounds, shard, shard_lengths, shard_positions, shard_ranges, unshard

__all__ = [
    "LAYOUTS",
    "chunk_bounds",
    "flash_attention",
    "nsa_attention",
    "shard",
    "shard_lengths",
    "shard_positions",
    "shard_ranges",
    "unshard",
]
