"""The process group side of context parallelism: rank and size, which backend serves which device, and the one
small all_gather through which the ranks agree on a call's configuration (or all raise).

The agreement check is what keeps bad input from hanging a job: every rank validates its own arguments without
raising, then every rank takes part in one all_gather of a short int64 vector (an error flag and the call's
configuration), and only then raises -- the same error class on every rank -- if any rank failed its own checks
or the ranks disagree.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .. import _checks as chk
from .._errors import SparseAttnError, make_error

# The backends each device type may use. gloo also takes CUDA tensors, by staging them through host memory, which
# costs more than the attention it serves: CUDA tensors need NCCL.
_SERVES = {"cpu": ("gloo", "mpi"), "cuda": ("nccl",)}


def default_group(op: str, group) -> dist.ProcessGroup:
    """`group`, or the default (world) group when None; raises if torch.distributed is not initialized or this
    process is not a member."""
    if not dist.is_available() or not dist.is_initialized():
        raise make_error(SparseAttnError, "config", op, "group",
                         "needs an initialized torch.distributed process group "
                         "(torch.distributed.init_process_group)")
    group = dist.group.WORLD if group is None else group
    if dist.get_rank(group) < 0:
        raise make_error(SparseAttnError, "config", op, "group", "this process is not a member of the group")
    return group


def rank_and_size(group) -> tuple[int, int]:
    """This process's rank in `group` and the group's size."""
    return dist.get_rank(group), dist.get_world_size(group)


def backend_map(group) -> dict[str, str]:
    """{device type: backend name} of a group, e.g. {"cpu": "gloo", "cuda": "nccl"}."""
    config = dist.get_backend_config(group) if hasattr(dist, "get_backend_config") else dist.get_backend(group)
    config = str(config).lower()
    if ":" not in config:  # a single backend for every device it serves
        return {device: config for device, names in _SERVES.items() if config in names}
    out = {}
    for entry in config.split(","):
        device, _, backend = entry.partition(":")
        out[device.strip()] = backend.strip()
    return out


def backend_error(op: str, arg: str, backends: dict[str, str], device: torch.device) -> Optional[SparseAttnError]:
    """The error for tensors on `device` and a group with `backends` ({device type: backend}), or None when the
    group has a backend that serves that device without staging copies (gloo for CPU tensors, NCCL for CUDA)."""
    kind = device.type
    backend = backends.get(kind)
    allowed = _SERVES.get(kind)
    if allowed is None:
        return make_error(SparseAttnError, "device", op, arg,
                          f"is on {device}; context parallelism runs on CPU tensors (gloo) and CUDA tensors (NCCL)")
    if backend in allowed:
        return None
    described = ", ".join(f"{d}:{b}" for d, b in backends.items()) or "none"
    if kind == "cuda" and backend == "gloo":
        message = ("is a CUDA tensor but the process group serves CUDA tensors with gloo, which copies every tensor "
                   "through host memory; use a group with the NCCL backend for CUDA tensors")
    elif kind == "cpu":
        message = (f"is a CPU tensor but the process group has no gloo backend for CPU tensors (its backends: "
                   f"{described}); use a gloo group for CPU tensors, NCCL for CUDA tensors")
    else:
        message = (f"is a CUDA tensor but the process group has no NCCL backend for CUDA tensors (its backends: "
                   f"{described})")
    return make_error(SparseAttnError, "device", op, arg, message)


def agreement_device(backends: dict[str, str], tensors_device: Optional[torch.device] = None) -> torch.device:
    """Where the configuration all_gather runs: the CPU when the group has gloo for it (no device synchronisation),
    else a CUDA device (the tensors' one if they are on CUDA, else the current one). Its type depends on the group
    alone, so every rank picks the same kind of device."""
    if backends.get("cpu") in _SERVES["cpu"]:
        return torch.device("cpu")
    if backends.get("cuda") == "nccl" and torch.cuda.is_available():
        if tensors_device is not None and tensors_device.type == "cuda":
            return tensors_device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def float_bits(value: float) -> int:
    """The bits of a float64 as an int64 (to carry a float in the int64 configuration vector exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


# scale=None in the configuration vector: the bits of a NaN, which no valid scale has
_SCALE_NONE = -1


def scale_code(scale: Optional[float]) -> int:
    """The int64 that carries a scale (a float or None) in the configuration vector."""
    return _SCALE_NONE if scale is None else float_bits(scale)


def show_scale(code: int) -> str:
    return "None" if code == _SCALE_NONE else repr(struct.unpack("<d", struct.pack("<q", code))[0])


def stable_code(text: str) -> int:
    """A code of a string that is the same in every process (Python's hash() is salted per process)."""
    return zlib.crc32(text.encode())


def show_code(names: Sequence[str]) -> Callable[[int], str]:
    """Shows a stable_code of one of `names` as that name (any other code as "another value")."""
    table = {stable_code(name): name for name in names}
    return lambda code: table.get(code, "another value")


SHOW_DEVICE = show_code(("cpu", "cuda", "meta", "mps", "xpu"))
SHOW_DTYPE = show_code(tuple(str(t).removeprefix("torch.") for t in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)))


@dataclass(frozen=True)
class Field:
    """One entry of a configuration vector: the argument it belongs to, what it is, and how to show a value in a
    message (None: values are codes or digests, not shown)."""

    argument: str
    what: str
    show: Optional[Callable[[int], str]] = str


def _show_count(code: int) -> str:
    return "None" if code < 0 else str(code)


# The tail of every op's configuration vector: the tensors' dtype, device, documents and sizes (the shard length
# last, the one entry ranks may differ in). tensor_values gives the matching values.
TENSOR_FIELDS = (
    Field("q", "the dtype", SHOW_DTYPE),
    Field("q", "the device type", SHOW_DEVICE),
    Field("cu_seqlens", "the number of documents", _show_count),
    Field("cu_seqlens", "its last entry", _show_count),
    Field("cu_seqlens", "its contents", None),
    Field("q", "the batch size B"),
    Field("q", "the query heads Hq"),
    Field("k", "the key/value heads Hkv"),
    Field("q", "the head dim Dqk"),
    Field("v", "the value head dim Dv"),
    Field("q", "the shard length"),
)


def tensor_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: Optional[Sequence[int]]) -> tuple[int, ...]:
    """The values of TENSOR_FIELDS for this rank (cu: the documents' host cu_seqlens, None when batched)."""
    packed = cu is not None
    return (stable_code(chk.dtype_name(q.dtype)), stable_code(q.device.type),
            len(cu) - 1 if packed else -1, cu[-1] if packed else -1, stable_code(repr(cu)) if packed else 0,
            0 if packed else q.shape[0], q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1],
            q.shape[0 if packed else 1])


def agree(op: str, group, backends: dict[str, str], fields: Sequence[Field], values: Optional[Sequence[int]],
          local_error: Optional[SparseAttnError], *, differ_ok: Sequence[str] = (),
          tensors_device: Optional[torch.device] = None) -> list[list[int]]:
    """All-gather every rank's configuration `values` (one int per field; None with a `local_error`) and return
    them, indexed [rank][field].

    Raises, on every rank, the same class of error: this rank's `local_error`; else a SparseAttnError naming the
    rank that failed its own checks; else one naming the first field (whose `what` is not in `differ_ok`) on which
    two ranks disagree.
    """
    width = len(fields) + 1
    row = [1] + [0] * len(fields) if values is None else [0] + [int(v) for v in values]
    if len(row) != width:
        raise AssertionError("agree: one value per field")
    device = agreement_device(backends, tensors_device)
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    _, size = rank_and_size(group)
    gathered = torch.empty(size * width, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    table = gathered.view(size, width).tolist()
    if local_error is not None:
        raise local_error
    failed = [r for r in range(size) if table[r][0]]
    if failed:
        raise make_error(SparseAttnError, "config", op, "group",
                         f"rank {failed[0]} rejected its arguments (its own error says why); every rank stops here")
    rows = [r[1:] for r in table]
    for index, field in enumerate(fields):
        if field.what in differ_ok:
            continue
        for other in range(1, size):
            if rows[other][index] != rows[0][index]:
                values_told = ("" if field.show is None else
                               f": rank 0 has {field.show(rows[0][index])}, rank {other} has "
                               f"{field.show(rows[other][index])}")
                raise make_error(SparseAttnError, "config", op, field.argument,
                                 f"the ranks disagree on {field.what}{values_told} (every rank must pass the same "
                                 f"configuration and shapes; only the token counts of the shards differ)")
    return rows
