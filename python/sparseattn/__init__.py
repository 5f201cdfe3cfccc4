"""sparseattn: trainable sparse attention (Native Sparse Attention) with a torch-free C++/CUDA core.

CPU tensors run the C++ reference backend; CUDA tensors run the CUDA kernels where this build has them
and raise :class:`SparseAttnUnsupportedError` otherwise (never a silent fallback). Every invalid call raises
:class:`SparseAttnError` (a ``ValueError``) or a subclass, naming the operation and the argument:
:class:`SparseAttnTypeError` (also a ``TypeError``) for an argument of the wrong Python type,
:class:`SparseAttnDTypeError` (a SparseAttnTypeError) for a tensor of the wrong dtype.
"""

from . import _C
from ._errors import SparseAttnDTypeError, SparseAttnError, SparseAttnTypeError, SparseAttnUnsupportedError

_C._set_error_types(SparseAttnError, SparseAttnDTypeError, SparseAttnUnsupportedError)

from . import functional as _functional  # noqa: E402
from .functional import (  # noqa: E402
    NSAConfig,
    combine,
    compress_kv,
    compressed_attention,
    compressed_cu_seqlens,
    create_mask,
    flash_attention,
    nsa_attention,
    select_blocks,
    selected_attention,
)
from .modules import NativeSparseAttention, NativeSparseAttentionCore  # noqa: E402
from .decode import flash_decode  # noqa: E402
from .nsa_decode import nsa_decode  # noqa: E402
from . import compat, distributed  # noqa: E402,F401

__version__ = _C.__version__

#: The (Dqk, Dv) head-dim pairs with CUDA kernels, e.g. ``((64, 64), (128, 128), (192, 128), (256, 256))``; the CPU
#: reference takes any head dims.
CUDA_HEAD_DIMS = _functional.CUDA_HEAD_DIMS


def built_with_cuda() -> bool:
    """Whether this build of the extension contains the CUDA kernels.

    Without them, CUDA tensors raise :class:`SparseAttnUnsupportedError` (CPU tensors always run the C++
    reference backend).

    Returns:
        True for a build with CUDA kernels, False for a CPU-only build.

    Raises:
        Nothing.

    Example:
        >>> import sparseattn
        >>> isinstance(sparseattn.built_with_cuda(), bool)
        True
    """
    return _C.built_with_cuda()


__all__ = [
    "CUDA_HEAD_DIMS",
    "NSAConfig",
    "NativeSparseAttention",
    "NativeSparseAttentionCore",
    "SparseAttnDTypeError",
    "SparseAttnError",
    "SparseAttnTypeError",
    "SparseAttnUnsupportedError",
    "__version__",
    "built_with_cuda",
    "combine",
    "compress_kv",
    "compressed_attention",
    "compressed_cu_seqlens",
    "create_mask",
    "flash_attention",
    "flash_decode",
    "nsa_attention",
    "nsa_decode",
    "select_blocks",
    "selected_attention",
]
