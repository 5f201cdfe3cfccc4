"""Exception classes raised for errors reported by the C++ API (``sparseattn::Error``) and by the Python layer.

The binding maps the C++ error kind to one of these classes; the message is the C++ message, which names
the operation and the argument. Instances carry ``kind`` (``"shape"``, ``"dtype"``, ``"device"``,
``"layout"``, ``"config"``, ``"value"``, ``"unsupported"``, or ``"type"`` for an argument of the wrong Python
type, which only the Python layer raises), ``argument`` and ``op`` attributes.

Every class derives from :class:`SparseAttnError` (a ``ValueError``); ``except sparseattn.SparseAttnError``
catches every error of a bad call.
"""

from __future__ import annotations


class SparseAttnError(ValueError):
    """An invalid argument (shape, device, layout, config or value)."""

    kind: str = "value"
    argument: str = ""
    op: str = ""


class SparseAttnTypeError(SparseAttnError, TypeError):
    """An argument of the wrong Python type (e.g. a float or a string where an int or a tensor is expected).

    Also a ``TypeError``. :class:`SparseAttnDTypeError` (a tensor of the wrong dtype) derives from it.
    """

    kind = "type"


class SparseAttnDTypeError(SparseAttnTypeError):
    """An argument has an unsupported or mismatched dtype (also a ``TypeError``)."""

    kind = "dtype"


class SparseAttnUnsupportedError(SparseAttnError, NotImplementedError):
    """A valid request that this build or backend does not implement (e.g. CUDA kernels not built)."""

    kind = "unsupported"


def make_error(cls: type[SparseAttnError], kind: str, op: str, argument: str, message: str) -> SparseAttnError:
    """An error raised by the Python layer, formatted like the C++ messages."""
    err = cls(f"sparseattn.{op}: argument '{argument}': {message}")
    err.kind, err.op, err.argument = kind, op, argument
    return err
