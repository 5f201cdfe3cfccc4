"""Argument checks of the Python layer, run before anything is allocated or passed to the binding.

The C++ API validates every call (shapes, dtypes, devices, strides, configuration, and on the CPU the contents of
index tensors) before it starts any work. What it cannot see is checked here, first:

- Python types: ints where ints are expected (not bools, floats, strings or None), tensors where tensors are
  expected, a real number or None for ``scale``, bools for flags. (The custom ops' schemas and the binding would
  otherwise raise torch's RuntimeError or nanobind's "incompatible function arguments".)
- integers that do not fit the C++ parameter (int32 block sizes and counts, int64 windows and lengths) or that
  are negative where a size is expected;
- whatever decides the size of an output or a workspace (the config ints, the ranks of the tensors whose sizes
  the outputs take), so that nothing is allocated with an unvalidated size;
- tensor properties the binding cannot take through DLPack (sparse or quantized tensors, dtypes outside
  float16/bfloat16/float32/float64/int32/bool) and the device of every tensor (a meta tensor next to CPU tensors
  would otherwise dispatch to the fake implementation and return a result).

Every failure raises a :class:`SparseAttnError` subclass with the message format of the C++ API,
``sparseattn.<op>: argument '<arg>': <expected, given>``.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch
from torch import Tensor

from ._errors import SparseAttnDTypeError, SparseAttnError, SparseAttnTypeError, make_error

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_NAMES = "float16, bfloat16, float32 or float64"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _short(value) -> str:
    """repr(value), cut to 40 characters (an int of 400 digits would fill the message)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _given(value) -> str:
    """A short description of a value for messages: its type and (short) repr."""
    return f"{type(value).__name__} {_short(value)}" if not isinstance(value, Tensor) else "a Tensor"


def type_error(op: str, arg: str, expected: str, value) -> SparseAttnTypeError:
    return make_error(SparseAttnTypeError, "type", op, arg, f"expected {expected}, got {_given(value)}")


def config_error(op: str, arg: str, message: str) -> SparseAttnError:
    return make_error(SparseAttnError, "config", op, arg, message)


# ------------------------------------------------------------------------------------------------- scalars


def _is_bool(value) -> bool:
    """A Python or NumPy bool."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"))


def is_int(value) -> bool:
    """A Python or NumPy integer, or a SymInt under torch.compile; never a bool."""
    if _is_bool(value):
        return False
    return isinstance(value, (numbers.Integral, torch.SymInt))


def int_arg(op: str, arg: str, value, *, minimum: int, maximum: int = INT32_MAX) -> int:
    """An int in [minimum, maximum] (default: what a C++ int holds); returned as a Python int (a SymInt stays)."""
    if not is_int(value):
        raise type_error(op, arg, "an int", value)
    if isinstance(value, torch.SymInt):
        return value  # traced by torch.compile: its range is guarded where the op's C++ check runs
    value = int(value)
    if value < minimum:
        what = {0: "a value >= 0", 1: "a positive value"}.get(minimum, f"a value >= {minimum}")
        raise config_error(op, arg, f"expected {what}, got {_short(value)}")
    if value > maximum:
        width = "a 32-bit int" if maximum == INT32_MAX else "a 64-bit int"
        raise config_error(op, arg, f"expected a value <= {maximum} ({width}), got {_short(value)}")
    return value


def optional_int_arg(op: str, arg: str, value, *, minimum: int, maximum: int = INT64_MAX,
                     default: int = 0) -> int:
    return default if value is None else int_arg(op, arg, value, minimum=minimum, maximum=maximum)


def bool_arg(op: str, arg: str, value) -> bool:
    if _is_bool(value):
        return bool(value)
    raise type_error(op, arg, "a bool", value)


def scale_arg(op: str, arg: str, value) -> Optional[float]:
    """None, or a finite positive real number (as a float)."""
    if value is None:
        return None
    if isinstance(value, torch.SymFloat):
        return value
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise type_error(op, arg, "a float or None", value)
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    if not (math.isfinite(result) and result > 0):
        raise config_error(op, arg, f"expected a finite positive value, got {_short(value)}")
    return result


def window_arg(op: str, arg: str, value) -> tuple[int, int]:
    """flash_attention's (left, right): two ints (a negative side is unbounded); None is (-1, -1)."""
    if value is None:
        return (-1, -1)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise type_error(op, arg, "a (left, right) pair of ints or None", value)
    return (int_arg(op, arg, value[0], minimum=INT64_MIN, maximum=INT64_MAX),
            int_arg(op, arg, value[1], minimum=INT64_MIN, maximum=INT64_MAX))


def flash_window_arg(op: str, arg: str, value) -> tuple[int, int, Optional[Tensor], Optional[Tensor]]:
    """flash_attention's window: (left, right), each an int (a negative side is unbounded) or an int32 tensor
    [Hq] of per-head bounds (-1 unbounded); None is (-1, -1). Returns (left, right, left_heads, right_heads),
    the int of a side given as a tensor being -1."""
    if value is None:
        return (-1, -1, None, None)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise type_error(op, arg, "a (left, right) pair of ints or int32 [Hq] tensors, or None", value)
    ints, tensors = [], []
    for side, name in zip(value, ("window_left", "window_right")):
        if isinstance(side, Tensor):
            tensor_arg(op, name, side, kind="int32")
            ints.append(-1)
            tensors.append(side)
        else:
            ints.append(int_arg(op, arg, side, minimum=INT64_MIN, maximum=INT64_MAX))
            tensors.append(None)
    return (ints[0], ints[1], tensors[0], tensors[1])


def optional_block_pair_arg(op: str, arg: str, value) -> Optional[tuple[int, int]]:
    """None, or a (block_q, block_k) pair of positive ints (flash_attention's block_size)."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return (int_arg(op, arg, value[0], minimum=1, maximum=INT64_MAX),
                int_arg(op, arg, value[1], minimum=1, maximum=INT64_MAX))
    raise type_error(op, arg, "a (block_q, block_k) pair of positive ints or None", value)


def optional_float_arg(op: str, arg: str, value) -> Optional[float]:
    """None, or a real number (as a float; its range is the C++ API's check)."""
    if value is None or isinstance(value, torch.SymFloat):
        return value
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise type_error(op, arg, "a float or None", value)
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def choice_arg(op: str, arg: str, value, choices: Sequence[str]) -> str:
    """One of the strings in `choices`."""
    if not isinstance(value, str):
        raise type_error(op, arg, " or ".join(repr(c) for c in choices), value)
    if value not in choices:
        raise config_error(op, arg, f"expected {' or '.join(repr(c) for c in choices)}, got {_short(value)}")
    return value


def block_pair_arg(op: str, arg: str, value) -> tuple[int, int]:
    """flash_attention's threshold_block: (queries, keys), two positive ints."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise type_error(op, arg, "a (block_q, block_k) pair of ints", value)
    return (int_arg(op, arg, value[0], minimum=1, maximum=INT64_MAX),
            int_arg(op, arg, value[1], minimum=1, maximum=INT64_MAX))


# ------------------------------------------------------------------------------------------------- tensors


def tensor_arg(op: str, arg: str, t, *, optional: bool = False, kind: str = "float") -> None:
    """A strided torch.Tensor (or None where optional) whose dtype is of `kind`: "float" (float16, bfloat16,
    float32 or float64), "int32" (index tensors and cu_seqlens), "bool" (masks) or "tile_states" (tile maps:
    bool or uint8). Which float dtype, and whether it matches the other tensors', is the C++ API's check."""
    if t is None:
        if optional:
            return
        raise type_error(op, arg, "a torch.Tensor", t)
    if not isinstance(t, Tensor):
        raise type_error(op, arg, "a torch.Tensor" + (" or None" if optional else ""), t)
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise make_error(SparseAttnError, "layout", op, arg,
                         f"expected a dense (strided) tensor, got layout {str(t.layout).removeprefix('torch.')}"
                         + (" (quantized)" if t.is_quantized else ""))
    if kind == "float" and t.dtype not in FLOAT_DTYPES:
        raise make_error(SparseAttnDTypeError, "dtype", op, arg,
                         f"expected {_FLOAT_NAMES}, got {dtype_name(t.dtype)}")
    if kind == "int32" and t.dtype != torch.int32:
        hint = f" (use {arg}.int())" if not t.is_floating_point() and not t.is_complex() else ""
        raise make_error(SparseAttnDTypeError, "dtype", op, arg,
                         f"expected dtype int32, got {dtype_name(t.dtype)}{hint}")
    if kind == "tile_states" and t.dtype not in (torch.bool, torch.uint8):
        raise make_error(SparseAttnDTypeError, "dtype", op, arg,
                         f"expected dtype bool or uint8, got {dtype_name(t.dtype)}")
    if kind == "bool" and t.dtype != torch.bool:
        raise make_error(SparseAttnDTypeError, "dtype", op, arg, f"expected dtype bool, got {dtype_name(t.dtype)}")


def same_device(op: str, arg: str, t: Optional[Tensor], anchor: Tensor, anchor_arg: str) -> None:
    if t is not None and t.device != anchor.device:
        raise make_error(SparseAttnError, "device", op, arg,
                         f"is on {t.device} but '{anchor_arg}' is on {anchor.device}")


def same_rank(op: str, arg: str, t: Tensor, anchor: Tensor, anchor_arg: str) -> None:
    if t.dim() != anchor.dim():
        raise make_error(SparseAttnError, "shape", op, arg,
                         f"expected {anchor.dim()} dimensions like '{anchor_arg}', got {list(t.shape)}")


def tokens_arg(op: str, arg: str, t, packed: bool, cu_name: str = "cu_seqlens") -> None:
    """A float token tensor: [B, T, H, D], or [N, H, D] when `cu_name` is given."""
    tensor_arg(op, arg, t)
    if packed and t.dim() != 3:
        hint = (f" (for the [1, N, H, D] packed layout of fla, squeeze the batch dimension: pass [N, H, D] with "
                f"{cu_name})") if t.dim() == 4 and t.shape[0] == 1 else ""
        raise make_error(SparseAttnError, "shape", op, arg,
                         f"expected 3 dimensions [N, H, D] because {cu_name} is given, got {list(t.shape)}{hint}")
    if not packed and t.dim() != 4:
        raise make_error(SparseAttnError, "shape", op, arg,
                         f"expected 4 dimensions [B, T, H, D] (or 3 dimensions [N, H, D] with {cu_name}), "
                         f"got {list(t.shape)}")


def cu_seqlens_arg(op: str, arg: str, cu, like: Optional[Tensor] = None, like_name: str = "") -> None:
    """None, or an int32 [B+1] tensor (on the device of `like` if given). Its contents are the C++ API's check
    (on the CPU)."""
    if cu is None:
        return
    tensor_arg(op, arg, cu, kind="int32")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise make_error(SparseAttnError, "shape", op, arg, f"expected shape [B+1], got {list(cu.shape)}")
    if like is not None:
        same_device(op, arg, cu, like, like_name)


def _readable(t: Tensor) -> bool:
    """Whether t's values can be read here for free: a real CPU tensor, outside torch.compile's tracing."""
    if t.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return not isinstance(t, FakeTensor)


def cu_seqlens_contents(op: str, arg: str, cu: Tensor) -> None:
    """On the CPU (where it costs no device sync): cu_seqlens starts at 0 and does not decrease."""
    if not _readable(cu) or cu.numel() == 0:
        return
    first = int(cu[0])
    if first != 0:
        raise make_error(SparseAttnError, "value", op, arg, f"must start at 0, got {first}")
    if cu.numel() > 1:
        bad = torch.nonzero(cu[1:] < cu[:-1])
        if bad.numel() > 0:
            entry = int(bad[0, 0]) + 1
            raise make_error(SparseAttnError, "value", op, arg,
                             f"must be non-decreasing (entry {entry}: {int(cu[entry])} after {int(cu[entry - 1])})")


def devices(op: str, anchor: Tensor, anchor_arg: str, named: Sequence[tuple[str, Optional[Tensor]]]) -> None:
    for arg, t in named:
        same_device(op, arg, t, anchor, anchor_arg)
