"""sparseattn: trainable sparse attention (Native Sparse Attention) with a torch-free C++/CUDA core.

CPU tensors run the C++ reference backend; CUDA tensors run the CUDA kernels where this build has them
and raise :class:`SparseAttnUnsupportedError` otherwise (never a silent fallback).
"""

from . import _C
from ._errors import SparseAttnDTypeError, SparseAttnError, SparseAttnUnsupportedError

_C._set_error_types(SparseAttnError, SparseAttnDTypeError, SparseAttnUnsupportedError)

from .functional import (  # noqa: E402
    NSAConfig,
    combine,
    compress_kv,
    compressed_attention,
    compressed_cu_seqlens,
    flash_attention,
    nsa_attention,
    select_blocks,
    selected_attention,
)
from .modules import NativeSparseAttention, NativeSparseAttentionCore  # noqa: E402

__version__ = _C.__version__

#: The (Dqk, Dv) head-dim pairs with CUDA kernels, e.g. ``((64, 64), (128, 128), (192, 128), (256, 256))``; the CPU
#: reference takes any head dims.
CUDA_HEAD_DIMS: tuple[tuple[int, int], ...] = tuple(tuple(pair) for pair in _C.cuda_head_dims())


def built_with_cuda() -> bool:
    """True when this build of the extension contains CUDA kernels."""
    return _C.built_with_cuda()


__all__ = [
    "CUDA_HEAD_DIMS",
    "NSAConfig",
    "NativeSparseAttention",
    "NativeSparseAttentionCore",
    "SparseAttnDTypeError",
    "SparseAttnError",
    "SparseAttnUnsupportedError",
    "__version__",
    "built_with_cuda",
    "combine",
    "compress_kv",
    "compressed_attention",
    "compressed_cu_seqlens",
    "flash_attention",
    "nsa_attention",
    "select_blocks",
    "selected_attention",
]
