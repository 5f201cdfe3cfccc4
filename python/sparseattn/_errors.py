"""Exception classes raised for errors reported by the C++ API (``sparseattn::Error``).

The binding maps the C++ error kind to one of these classes; the message is the C++ message, which names
the operation and the argument. Instances carry ``kind`` (``"shape"``, ``"dtype"``, ``"device"``,
``"layout"``, ``"config"``, ``"value"`` or ``"unsupported"``), ``argument`` and ``op`` attributes.
"""

from __future__ import annotations


class SparseAttnError(ValueError):
    """An invalid argument (shape, device, layout, config or value)."""

    kind: str = "value"
    argument: str = ""
    op: str = ""


class SparseAttnDTypeError(SparseAttnError, TypeError):
    """An argument has an unsupported or mismatched dtype."""

    kind = "dtype"


class SparseAttnUnsupportedError(SparseAttnError, NotImplementedError):
    """A valid request that this build or backend does not implement (e.g. CUDA kernels not built)."""

    kind = "unsupported"


def make_error(cls: type[SparseAttnError], kind: str, op: str, argument: str, message: str) -> SparseAttnError:
    """An error raised by the Python layer, formatted like the C++ messages."""
    err = cls(f"sparseattn.{op}: argument '{argument}': {message}")
    err.kind, err.op, err.argument = kind, op, argument
    return err
