"""Random invalid calls at every public function and module (CPU): each must raise a sparseattn error naming the
operation and an argument, before touching its inputs, and never crash the process.

A seeded generator takes a valid call of each target (compress_kv, compressed_attention, select_blocks,
selected_attention, flash_attention (plain, and gated with both thresholds), combine, nsa_attention,
compressed_cu_seqlens, create_mask, NSAConfig, and the modules' constructors and forwards, batched and packed)
and changes one argument: a wrong Python type, a negative, zero or
out-of-range int (2**31, 2**63, ...), a wrong rank, dtype (int64 indices included) or device (a meta tensor next
to CPU tensors), a sparse tensor, a size that does not match the other arguments, bad cu_seqlens or index
contents, an inconsistent configuration, an unknown gate name, a threshold out of range or NaN, a bad tile
pair. Each mutation comes with what it must give: an error (of a given
class: a wrong Python type raises SparseAttnTypeError, also a TypeError; a wrong dtype SparseAttnDTypeError), or,
for the few that are still valid calls (a non-contiguous last dimension, a numpy int, window=None, ...), success,
and for some of those the unmutated call's exact output.

The calls run in a child process, in chunks (one per test), so that a crash fails the test with the call that
caused it; each chunk's child writes every call's description to a file before making it. The newest targets
(EXHAUSTIVE) also run every one of their mutations once, in order.

Run a chunk by hand: python tests/python/test_invalid_calls.py SEED COUNT [PROGRESS [TARGET,...]]
(with targets: every mutation of those targets, COUNT ignored)
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
import tempfile
import traceback

import numpy as np
import pytest
import torch

CHUNKS = 4
CALLS_PER_CHUNK = 1400
# Every mutation of these targets runs once (test_every_mutation), on top of the random chunks.
EXHAUSTIVE = ("create_mask", "flash_attention_gated", "flash_attention_gated_packed")
SEED = 20240917
TIMEOUT_S = 240

# ------------------------------------------------------------------------------------------ the child process


class Fields(dict):
    """The fields of an NSAConfig that the call builds (so that field mutations reach NSAConfig itself)."""


def _noncontig(t):
    """The same values with a last-dimension stride of 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _resized(t, dim, size):
    shape = list(t.shape)
    shape[dim] = size
    if t.dtype == torch.int32:
        return torch.zeros(shape, dtype=torch.int32) - 1
    if t.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    return torch.randn(shape, dtype=t.dtype)


class Arg:
    """How one argument of a target may be mutated.

    kind: tensor (float), mask (bool tensor), index (int32 block indices), cu, cu_cmp, int, scale, flag,
    window, config, device, dtype, real (an optional float: thresholds), choice (a string of `choices`), pair
    (two positive ints: tiles). sizes: (dim, size) changes known to be invalid. none: what None gives
    ("error", "type", "valid", "same" or None: not generated). minimum/maximum: the valid range of an int.
    bad/good: further (description, value) pairs that are invalid / valid. absent: the base call does not pass
    it. packed: an index tensor of the packed layout. rows: cu_seqlens bounded by the rows of a tensor. meta,
    noncontig: what a meta tensor and a non-contiguous last dimension give. float_dtypes: what the other float
    dtypes of a tensor give ("dtype": must match; "valid": any float dtype is taken).
    """

    def __init__(self, kind, *, sizes=(), none="error", minimum=1, maximum=2**31 - 1, bad=(), good=(), absent=False,
                 packed=False, rows=True, meta="error", noncontig="same", float_dtypes="dtype", choices=()):
        self.kind, self.sizes, self.none = kind, sizes, none
        self.minimum, self.maximum, self.bad, self.good = minimum, maximum, bad, good
        self.absent, self.packed, self.rows, self.meta, self.noncontig = absent, packed, rows, meta, noncontig
        self.float_dtypes, self.choices = float_dtypes, choices


# Expectations: "type" (SparseAttnTypeError), "dtype" (SparseAttnDTypeError), "error" (any SparseAttnError),
# "valid" (no error), "same" (no error and the unmutated call's output).
def _type_values():
    return [("float 1.5", 1.5), ("str 'x'", "x"), ("bool True", True), ("list", [1, 2]), ("dict", {"a": 1}),
            ("object()", object())]


def mutations(arg: Arg, base):
    """(description, value, expectation) for one argument whose base value is `base`."""
    out = []
    kind = arg.kind
    if kind in ("tensor", "mask", "index", "cu", "cu_cmp"):
        if arg.none is not None and not arg.absent:
            out.append(("None", None, arg.none))
        out += [(d, v, "type") for d, v in _type_values()]
        out.append(("int 3", 3, "type"))
        if arg.absent:  # the base call passes None: give a wrong tensor instead
            wrong = {"tensor": torch.ones(3, dtype=torch.int64), "mask": torch.ones(3, 3),
                     "index": torch.zeros(2, 3, dtype=torch.int64), "cu": torch.tensor([0, 5], dtype=torch.int32),
                     "cu_cmp": torch.tensor([0, 5], dtype=torch.int64)}[kind]
            out.append((f"tensor {list(wrong.shape)} {wrong.dtype}", wrong, "error"))
            out.append(("numpy array", np.zeros(3, dtype=np.float32), "type"))
            return out
        t = base
        out.append(("numpy array", t.numpy(), "type"))
        out.append(("meta tensor", t.to("meta"), arg.meta))
        out.append(("sparse tensor", t.to_sparse(), "error"))
        if t.dim() >= 1:
            out.append(("0-dim", t.reshape(-1)[0].clone(), "error"))
            out.append(("one more dim", t[None].clone(), "error"))
            out.append(("non-contiguous last dim", _noncontig(t), arg.noncontig))
        if t.dim() >= 2:
            out.append(("one dim less", t[0].clone(), "error"))
        if kind == "tensor":
            for dtype in (torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64):
                out.append((f"dtype {dtype}", t.to(dtype), "dtype"))
            for dtype in (torch.float64, torch.float16, torch.bfloat16):
                out.append((f"dtype {dtype}", t.to(dtype), arg.float_dtypes))
        elif kind == "mask":
            for dtype in (torch.float32, torch.int64, torch.uint8, torch.int32):
                out.append((f"dtype {dtype}", t.to(dtype), "dtype"))
        else:
            hint = " (needs .int())"
            for dtype in (torch.int64, torch.float32, torch.int16, torch.bool, torch.float64):
                out.append((f"dtype {dtype}{hint if dtype == torch.int64 else ''}", t.to(dtype), "dtype"))
        for dim, size in arg.sizes:
            out.append((f"size of dim {dim} -> {size}", _resized(t, dim, size), "error"))
        if kind == "index":
            for desc, values in (("out of range 99", [0, 1, 99]), ("negative -7", [0, -7, 1]),
                                 ("descending", [1, 0, -1]), ("duplicate", [0, 0, 1]),
                                 ("padding before an entry", [-1, 0, 1])):
                bad = t.clone()
                bad.reshape(-1, bad.shape[-1])[_index_row(t, arg)] = torch.tensor(values[: t.shape[-1]],
                                                                                  dtype=torch.int32)
                out.append((f"index contents {desc}", bad, "error"))
        if kind == "cu":
            n = int(t[-1])
            bad = [("not starting at 0", [1, *t[1:].tolist()]), ("decreasing", [0, n + 1, n]),
                   ("negative", [0, -3, n])]
            if arg.rows:
                bad.append(("beyond the rows", [0, int(t[1]), n + 50]))
            for desc, values in bad:
                out.append((f"cu_seqlens contents {desc}: {values}", torch.tensor(values, dtype=torch.int32),
                            "error"))
            out.append(("empty", t[:0].clone(), "error"))
        if kind == "cu_cmp":
            out.append(("wrong contents", t + torch.arange(t.numel(), dtype=torch.int32), "error"))
        return out
    if kind == "int":
        value = 16 if base is None else base
        out += [("float 1.5", 1.5, "type"), ("str", str(value), "type"), ("bool True", True, "type"),
                ("bool False", False, "type"), ("list", [value], "type"), ("tensor", torch.tensor(value), "type"),
                ("complex", complex(value, 1), "type"), (f"float {float(value)}", float(value), "type")]
        if base is not None:
            out.append(("numpy int", np.int64(base), "same"))
        if arg.none is not None and base is not None:
            out.append(("None", None, arg.none))
        # The in-range ones among these are cheap to run: 0 (num_init, max_seqlen) and the big values of the
        # int64 arguments (window, max_seqlen), which only bound something.
        for v in (-1, 0, -2**31, -2**63, -(2**70), 2**31, 2**32 + 16, 2**63 - 1, 2**63, 2**64 + 16, 10**30):
            out.append((f"{v}", v, "valid" if arg.minimum <= v <= arg.maximum else "error"))
        out += [(d, v, "error") for d, v in arg.bad]
        out += [(d, v, "valid") for d, v in arg.good]
        return out
    if kind == "scale":
        out += [("str 'abc'", "abc", "type"), ("bool True", True, "type"), ("list", [0.5], "type"),
                ("complex", 1 + 1j, "type"), ("tensor", torch.tensor(0.5), "type")]
        out += [(repr(v), v, "error") for v in (-1.0, 0, 0.0, math.nan, math.inf, -math.inf, 10**400, -(10**400))]
        out += [("int 2", 2, "valid"), ("numpy float32 0.25", np.float32(0.25), "valid")]
        if arg.none is not None:
            out.append(("None", None, arg.none))
        return out
    if kind == "flag":
        out += [("str 'yes'", "yes", "type"), ("int 1", 1, "type"), ("int 0", 0, "type"), ("None", None, "type"),
                ("float 1.5", 1.5, "type"), ("numpy bool", np.bool_(base), "same")]
        return out
    if kind == "window":
        out += [("int 5", 5, "type"), ("str 'ab'", "ab", "type"), ("(1,)", (1,), "type"),
                ("(1, 2, 3)", (1, 2, 3), "type"), ("set", {1, 2}, "type"), ("('a', 0)", ("a", 0), "type"), ("(1.5, 0)", (1.5, 0), "type"),
                ("(None, 0)", (None, 0), "type"), ("(0, True)", (0, True), "type"),
                ("(2**63, 0)", (2**63, 0), "error"), ("(0, -2**63 - 1)", (0, -(2**63) - 1), "error"),
                ("None", None, "valid"), ("list [3, 0]", [3, 0], "valid"), ("(-5, 0)", (-5, 0), "valid"),
                ("(2**40, 0)", (2**40, 0), "valid"), ("numpy ints", (np.int64(3), np.int32(0)), "valid")]
        return out
    if kind == "real":  # an optional float: the range checks are the C++ API's; non-finite is never taken
        out += [("str '0.5'", "0.5", "type"), ("bool True", True, "type"), ("bool False", False, "type"),
                ("list", [0.5], "type"), ("complex", 0.5 + 1j, "type"), ("tensor", torch.tensor(0.5), "type"),
                ("dict", {"a": 0.5}, "type")]
        out += [(repr(v), v, "error") for v in (math.nan, -math.nan, math.inf, -math.inf, 10**400, -(10**400))]
        out.append(("numpy float32 0.25", np.float32(0.25), "valid"))
        if arg.none is not None:
            out.append(("None", None, arg.none))
        out += [(d, v, "error") for d, v in arg.bad]
        out += [(d, v, "valid") for d, v in arg.good]
        return out
    if kind == "choice":
        out += [("None", None, "type"), ("int 1", 1, "type"), ("bytes", arg.choices[0].encode(), "type"),
                ("list", [arg.choices[0]], "type"), ("bool True", True, "type"), ("''", "", "error"),
                ("'nonsense'", "nonsense", "error"), ("upper case", arg.choices[0].upper(), "error"),
                ("leading space", " " + arg.choices[0], "error")]
        out += [(repr(c), c, "valid") for c in arg.choices]
        return out
    if kind == "pair":  # (block_q, block_k), positive int64s
        out += [("int 5", 5, "type"), ("str 'ab'", "ab", "type"), ("None", None, "type"), ("(4,)", (4,), "type"),
                ("(4, 4, 4)", (4, 4, 4), "type"), ("set", {4, 5}, "type"), ("(1.5, 4)", (1.5, 4), "type"),
                ("(True, 4)", (True, 4), "type"), ("(None, 4)", (None, 4), "type"), ("('4', 4)", ("4", 4), "type"),
                ("(4, 4.0)", (4, 4.0), "type"), ("(0, 4)", (0, 4), "error"), ("(4, 0)", (4, 0), "error"),
                ("(-1, -1)", (-1, -1), "error"), ("(4, -2**63)", (4, -(2**63)), "error"),
                ("(2**63, 4)", (2**63, 4), "error"), ("(4, 2**64 + 4)", (4, 2**64 + 4), "error"),
                ("list [4, 4]", [4, 4], "valid"), ("(1, 1)", (1, 1), "valid"),
                ("numpy ints", (np.int64(4), np.int32(4)), "valid"), ("(2**31, 4)", (2**31, 4), "valid"),
                ("(2**62, 2**62)", (2**62, 2**62), "valid"), ("(2**63 - 1, 4)", (2**63 - 1, 4), "valid"),
                ("(4, 2**63 - 1)", (4, 2**63 - 1), "valid"), ("(2**63 - 39, 4)", (2**63 - 39, 4), "valid"),
                ("(2**63 - 1, 2**63 - 1)", (2**63 - 1, 2**63 - 1), "valid")]
        return out
    if kind == "config":
        out += [("int 5", 5, "type"), ("str", "cfg", "type"), ("dict", {"window": 64}, "type")]
        if arg.none is not None:
            out.append(("None", None, arg.none))
        return out
    if kind == "device":
        out += [("'nonsense'", "nonsense", "error"), ("float 3.5", 3.5, "type"), ("-1", -1, "error"),
                ("'cpu'", "cpu", "valid"), ("torch.device('cpu')", torch.device("cpu"), "valid"),
                ("list", ["cpu"], "type")]
        return out
    if kind == "dtype":
        out += [("torch.int32", torch.int32, "dtype"), ("torch.complex64", torch.complex64, "dtype"),
                ("str 'float32'", "float32", "type"), ("int 5", 5, "type"), ("torch.float64", torch.float64, "valid")]
        return out
    raise AssertionError(kind)


def _index_row(t, arg):
    """A row of an index tensor (flattened to [rows, n]) inside a sequence: the last token, last KV head."""
    rows = t.reshape(-1, t.shape[-1]).shape[0]
    if arg.packed:  # packed [N, Hkv, n]: the last sequence ends at row 40 of 42
        return 39 * t.shape[1] + t.shape[1] - 1
    return rows - 1


def _config_fields_args(cross_invalid: bool, base: dict):
    """Args for the fields of an NSAConfig built by the call."""
    int32 = 2**31 - 1
    cross = [("cmp_stride", "5 (does not divide cmp_block)", 5), ("cmp_block", "64 (> sel_block)", 64),
             ("sel_block", "36 (cmp_stride does not divide it)", 36),
             ("num_selected", "1 (< num_init + num_local)", 1)]
    args = {}
    for name in ("cmp_block", "cmp_stride", "sel_block", "num_selected", "num_init", "num_local", "window"):
        extra = [(d, v) for field, d, v in cross if field == name]
        minimum = 0 if name in ("num_init", "num_local") else 1
        maximum = 2**63 - 1 if name == "window" else int32
        good = [] if cross_invalid else extra
        bad = extra if cross_invalid else []
        if name == "window" and base[name] < 2**31:
            good = good + [("window 2**31", 2**31)]
        args["cfg." + name] = Arg("int", minimum=minimum, maximum=maximum, bad=bad, good=good, none="type")
    args["cfg.scale"] = Arg("scale", none="same")
    return args


def targets():
    """name -> (ops its errors may name, builder() -> (args, call(args) -> output, arg specs))."""
    import sparseattn as sa

    B, T, HQ, HKV, D, DV = 2, 40, 4, 2, 16, 8
    LENGTHS, N = [17, 23], 42
    SMALL = dict(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=3, num_init=1, num_local=1, window=24,
                 scale=None)

    def tokens(heads, dim, packed):
        return torch.randn(N, heads, dim) if packed else torch.randn(B, T, heads, dim)

    def cu():
        return torch.tensor([0, 17, 40], dtype=torch.int32)

    def config_of(a):
        c = a["config"]
        if isinstance(c, Fields):
            return sa.NSAConfig(**c)
        return c

    def split_config(a):
        """Puts the cfg.* entries of a back into a Fields config."""
        a = dict(a)
        fields = Fields({k[4:]: a.pop(k) for k in list(a) if k.startswith("cfg.")})
        if "config" not in a:
            a["config"] = fields
        return a

    out = {}

    def kv_sizes(packed):
        return [(0, 43), (1, 3)] if packed else [(0, 3), (1, 41), (2, 3)]

    for packed in (False, True):
        sfx = "_packed" if packed else ""
        layout_sizes_q = [(0, 30), (1, 5), (2, 17)] if packed else [(0, 3), (1, 48), (2, 5), (3, 17)]

        def compress_kv(packed=packed):
            a = dict(k=tokens(HKV, D, packed), v=tokens(HKV, DV, packed), block=16, stride=8)
            specs = dict(k=Arg("tensor", sizes=kv_sizes(packed)), v=Arg("tensor", sizes=kv_sizes(packed)),
                         block=Arg("int", bad=[("12 (stride 8 does not divide it)", 12)]),
                         stride=Arg("int", bad=[("5 (does not divide block)", 5), ("32 (> block)", 32)]))
            if packed:
                a["cu_seqlens"] = cu()
                specs["cu_seqlens"] = Arg("cu")
            else:
                specs["cu_seqlens"] = Arg("cu", absent=True)
            return a, lambda a: sa.compress_kv(a["k"], a["v"], block=a["block"], stride=a["stride"],
                                                cu_seqlens=a.get("cu_seqlens")), specs

        out["compress_kv" + sfx] = ({"compress_kv"}, compress_kv)

        def compressed_attention(packed=packed):
            k, v = tokens(HKV, D, packed), tokens(HKV, DV, packed)
            c = cu() if packed else None
            kc, vc = sa.compress_kv(k, v, block=16, stride=8, cu_seqlens=c)
            a = dict(q=tokens(HQ, D, packed), k_cmp=kc, v_cmp=vc, block=16, stride=8, scale=None)
            cmp_sizes = [(0, 7), (1, 3)] if packed else [(0, 3), (1, 5), (2, 3)]
            specs = dict(q=Arg("tensor", sizes=layout_sizes_q), k_cmp=Arg("tensor", sizes=cmp_sizes + [(-1, 17)]),
                         v_cmp=Arg("tensor", sizes=cmp_sizes), block=Arg("int", bad=[("12", 12), ("48", 48)]),
                         stride=Arg("int", bad=[("5", 5), ("4 (changes Tc)", 4)]), scale=Arg("scale", none="same"))
            if packed:
                a["cu_seqlens"] = c
                a["cu_seqlens_cmp"] = sa.compressed_cu_seqlens(c, block=16, stride=8)
                specs["cu_seqlens"] = Arg("cu")
                specs["cu_seqlens_cmp"] = Arg("cu_cmp", none="same")
            else:
                specs["cu_seqlens"] = Arg("cu", absent=True)
                specs["cu_seqlens_cmp"] = Arg("cu_cmp", absent=True)
            return a, lambda a: sa.compressed_attention(
                a["q"], a["k_cmp"], a["v_cmp"], block=a["block"], stride=a["stride"], scale=a["scale"],
                cu_seqlens=a.get("cu_seqlens"), cu_seqlens_cmp=a.get("cu_seqlens_cmp")), specs

        out["compressed_attention" + sfx] = ({"compressed_attention"}, compressed_attention)

        def select_blocks(packed=packed):
            q, k, v = tokens(HQ, D, packed), tokens(HKV, D, packed), tokens(HKV, D, packed)
            c = cu() if packed else None
            kc, vc = sa.compress_kv(k, v, block=16, stride=8, cu_seqlens=c)
            _, lse = sa.compressed_attention(q, kc, vc, block=16, stride=8, cu_seqlens=c)
            a = dict(q=q, k_cmp=kc, lse_cmp=lse, cmp_block=16, cmp_stride=8, sel_block=32, num_selected=3,
                     num_init=1, num_local=1, scale=None)
            lse_sizes = [(0, 5), (1, 41)] if packed else [(0, 3), (1, 5), (2, 41)]
            specs = dict(q=Arg("tensor", sizes=layout_sizes_q),
                         k_cmp=Arg("tensor", sizes=([(0, 1), (1, 3), (2, 17)] if packed else
                                                    [(0, 3), (1, 5), (2, 3), (3, 17)])),
                         lse_cmp=Arg("tensor", sizes=lse_sizes),
                         cmp_block=Arg("int", bad=[("64 (> sel_block)", 64), ("12", 12)]),
                         cmp_stride=Arg("int", bad=[("5", 5), ("12", 12)]),
                         sel_block=Arg("int", bad=[("36", 36), ("8 (< cmp_block)", 8)]),
                         num_selected=Arg("int", bad=[("1 (< num_init + num_local)", 1)]),
                         num_init=Arg("int", minimum=0, bad=[("3 (> num_selected - num_local)", 3)]),
                         num_local=Arg("int", minimum=0, bad=[("3", 3)]), scale=Arg("scale", none="same"))
            if packed:
                a["cu_seqlens"] = c
                specs["cu_seqlens"] = Arg("cu")
            else:
                specs["cu_seqlens"] = Arg("cu", absent=True)
            return a, lambda a: sa.select_blocks(
                a["q"], a["k_cmp"], a["lse_cmp"], cmp_block=a["cmp_block"], cmp_stride=a["cmp_stride"],
                sel_block=a["sel_block"], num_selected=a["num_selected"], num_init=a["num_init"],
                num_local=a["num_local"], scale=a["scale"], cu_seqlens=a.get("cu_seqlens")), specs

        out["select_blocks" + sfx] = ({"select_blocks"}, select_blocks)

        def selected_attention(packed=packed):
            q, k, v = tokens(HQ, D, packed), tokens(HKV, D, packed), tokens(HKV, DV, packed)
            shape = (N, HKV, 3) if packed else (B, T, HKV, 3)
            idx = torch.tensor([0, -1, -1] if packed else [0, 1, -1], dtype=torch.int32).expand(*shape).clone()
            a = dict(q=q, k=k, v=v, indices=idx, block=32, scale=None)
            ksizes = [(0, 43), (1, 3), (2, 17)] if packed else [(0, 3), (1, 41), (2, 3), (3, 17)]
            specs = dict(q=Arg("tensor", sizes=[(0, 43), (1, 5), (2, 17)] if packed else layout_sizes_q[:1] +
                               [(1, 41), (2, 5), (3, 17)]),
                         k=Arg("tensor", sizes=ksizes), v=Arg("tensor", sizes=ksizes[:-1]),
                         indices=Arg("index", sizes=[(0, 41), (1, 3)] if packed else [(0, 3), (1, 41), (2, 3)],
                                     packed=packed),
                         block=Arg("int", bad=[] if packed else [("64 (index 1 out of range)", 64)]),
                         scale=Arg("scale", none="same"))
            if packed:
                a["cu_seqlens"] = cu()
                specs["cu_seqlens"] = Arg("cu")
            else:
                specs["cu_seqlens"] = Arg("cu", absent=True)
            return a, lambda a: sa.selected_attention(a["q"], a["k"], a["v"], a["indices"], block=a["block"],
                                                      scale=a["scale"], cu_seqlens=a.get("cu_seqlens")), specs

        out["selected_attention" + sfx] = ({"selected_attention"}, selected_attention)

        def flash_attention(packed=packed):
            q, k, v = tokens(HQ, D, packed), tokens(HKV, D, packed), tokens(HKV, DV, packed)
            a = dict(q=q, k=k, v=v, causal=True, window=(7, 0), scale=None, return_lse=True, max_seqlen_q=None,
                     max_seqlen_k=None)
            specs = dict(q=Arg("tensor", sizes=[(0, 30), (1, 5), (2, 17)] if packed else
                               [(0, 3), (2, 5), (3, 17)]),
                         k=Arg("tensor", sizes=[(0, 30), (1, 3), (2, 17)] if packed else
                               [(0, 3), (1, 41), (2, 3), (3, 17)]),
                         v=Arg("tensor", sizes=[(0, 30), (1, 3)] if packed else [(0, 3), (1, 41), (2, 3)]),
                         causal=Arg("flag"), window=Arg("window"), scale=Arg("scale", none="same"),
                         return_lse=Arg("flag"),
                         max_seqlen_q=Arg("int", minimum=0, maximum=2**63 - 1, none=None,
                                          bad=[("5 (< a length)", 5)] if packed else []),
                         max_seqlen_k=Arg("int", minimum=0, maximum=2**63 - 1, none=None,
                                          bad=[("5 (< a length)", 5)] if packed else []))
            if packed:
                a.update(cu_seqlens_q=cu(), cu_seqlens_k=cu(), max_seqlen_q=23, max_seqlen_k=23)
                specs["cu_seqlens_q"] = Arg("cu", none="same")
                specs["cu_seqlens_k"] = Arg("cu", none="same")
                specs["max_seqlen_q"].none = specs["max_seqlen_k"].none = "same"
                specs["mask"] = Arg("mask", absent=True)
            else:
                a["mask"] = torch.rand(B, 1, T, T) > 0.3
                a["bias"] = torch.randn(1, HKV, T, T)
                specs["mask"] = Arg("mask", none="valid", sizes=[(0, 3), (1, 3), (2, 3), (3, 41)])
                specs["bias"] = Arg("tensor", none="valid", sizes=[(0, 3), (1, 3), (2, 3), (3, 41)])
                specs["cu_seqlens_q"] = Arg("cu", absent=True)
            # Not gated: alpha or delta alone is an error.
            specs["alpha"] = Arg("tensor", absent=True)
            specs["delta"] = Arg("tensor", absent=True)
            return a, lambda a: sa.flash_attention(
                a["q"], a["k"], a["v"], causal=a["causal"], window=a["window"], mask=a.get("mask"),
                bias=a.get("bias"), scale=a["scale"], cu_seqlens_q=a.get("cu_seqlens_q"),
                cu_seqlens_k=a.get("cu_seqlens_k"), max_seqlen_q=a["max_seqlen_q"], max_seqlen_k=a["max_seqlen_k"],
                return_lse=a["return_lse"], alpha=a.get("alpha"), delta=a.get("delta")), specs

        out["flash_attention" + sfx] = ({"flash_attention"}, flash_attention)

        def flash_gated(packed=packed):
            """Gated attention with both thresholds (CPU only): mutations of the gate arguments."""
            q, k, v = tokens(HQ, D, packed), tokens(HKV, D, packed), tokens(HKV, DV, packed)
            alpha = torch.randn(N, HQ) if packed else torch.randn(B, T, HQ)
            delta = torch.randn(N, HKV) if packed else torch.randn(B, T, HKV)
            a = dict(q=q, k=k, v=v, alpha=alpha, delta=delta, gate="logsigmoid", gate_threshold=-2.0,
                     softmax_threshold=0.05, threshold_block=(8, 4))
            specs = dict(
                # (alpha or delta alone, None for the other, is an error; float dtypes must match q's float32)
                alpha=Arg("tensor", sizes=[(0, 41), (0, 43), (1, 2)] if packed else
                          [(0, 3), (1, 41), (2, 5), (2, 2)]),
                delta=Arg("tensor", sizes=[(0, 41), (1, 4)] if packed else [(0, 3), (1, 41), (2, 4), (2, 1)]),
                gate=Arg("choice", choices=("logsigmoid", "product")),
                gate_threshold=Arg("real", none="valid", good=[("0", 0), ("-100.0", -100.0), ("1e300", 1e300),
                                                              ("-1e300", -1e300), ("int 5", 5)]),
                softmax_threshold=Arg("real", none="valid",
                                      bad=[("0", 0), ("0.0", 0.0), ("-0.0", -0.0), ("-0.5", -0.5), ("1.5", 1.5),
                                           ("1 + 1e-9", 1 + 1e-9), ("int 2", 2), ("-1e-300", -1e-300)],
                                      good=[("int 1", 1), ("1.0", 1.0), ("1e-300", 1e-300), ("5e-324", 5e-324),
                                            ("0.999", 0.999)]),
                threshold_block=Arg("pair"))
            if packed:
                a["cu_seqlens_q"] = cu()
            return a, lambda a: sa.flash_attention(
                a["q"], a["k"], a["v"], causal=True, window=(9, 0), cu_seqlens_q=a.get("cu_seqlens_q"),
                return_lse=True, alpha=a["alpha"], delta=a["delta"], gate=a["gate"],
                gate_threshold=a["gate_threshold"], softmax_threshold=a["softmax_threshold"],
                threshold_block=a["threshold_block"]), specs

        out["flash_attention_gated" + sfx] = ({"flash_attention"}, flash_gated)

        def combine(packed=packed):
            names = ("o_cmp", "o_slc", "o_swa", "g_cmp", "g_slc", "g_swa")
            a = {n: (tokens(HQ, DV, packed) if n.startswith("o") else
                     (torch.rand(N, HQ) if packed else torch.rand(B, T, HQ))) for n in names}
            osizes = [(0, 41), (1, 5), (2, 9)] if packed else [(0, 3), (1, 41), (2, 5), (3, 9)]
            specs = {n: Arg("tensor", sizes=osizes if n.startswith("o") else osizes[:-1], none="error")
                     for n in names}
            specs["g_cmp"].none = specs["g_slc"].none = specs["g_swa"].none = "valid"
            return a, lambda a: sa.combine(*(a[n] for n in names)), specs

        out["combine" + sfx] = ({"combine"}, combine)

        def nsa(packed=packed, user=False, module=False):
            q, k, v = tokens(HQ, D, packed), tokens(HKV, D, packed), tokens(HKV, DV, packed)
            gshape = (N, HQ) if packed else (B, T, HQ)
            a = dict(q=q, k=k, v=v, g_cmp=torch.rand(gshape), g_slc=torch.rand(gshape), g_swa=torch.rand(gshape),
                     max_seqlen=23 if packed else None)
            gsizes = [(0, 41), (1, 5)] if packed else [(0, 3), (1, 41), (2, 5)]
            specs = dict(q=Arg("tensor", sizes=[(0, 43), (1, 5), (2, 17)] if packed else
                               [(0, 3), (1, 41), (2, 5), (3, 17)]),
                         k=Arg("tensor", sizes=[(0, 43), (1, 3), (2, 17)] if packed else
                               [(0, 3), (1, 41), (2, 3), (3, 17)]),
                         v=Arg("tensor", sizes=[(0, 43), (1, 3)] if packed else [(0, 3), (1, 41), (2, 3)]),
                         g_cmp=Arg("tensor", sizes=gsizes, none="valid"),
                         g_slc=Arg("tensor", sizes=gsizes, none="error" if user else "valid"),
                         g_swa=Arg("tensor", sizes=gsizes, none="valid"),
                         max_seqlen=Arg("int", minimum=0, maximum=2**63 - 1, none="same" if packed else None,
                                        bad=[("5 (< a length)", 5)] if packed else []))
            if packed:
                a["cu_seqlens"] = cu()
                specs["cu_seqlens"] = Arg("cu")
            else:
                specs["cu_seqlens"] = Arg("cu", absent=True)
            if user:
                c = a.get("cu_seqlens")
                kc, vc = sa.compress_kv(k, v, block=16, stride=8, cu_seqlens=c)
                shape = (N, HKV, 3) if packed else (B, T, HKV, 3)
                idx = torch.tensor([0, -1, -1] if packed else [0, 1, -1], dtype=torch.int32).expand(*shape).clone()
                a.update(k_cmp=kc, v_cmp=vc, block_indices=idx)
                cmp_sizes = [(0, 7), (1, 3)] if packed else [(0, 3), (1, 5), (2, 3)]
                specs.update(k_cmp=Arg("tensor", sizes=cmp_sizes + [(-1, 17)]), v_cmp=Arg("tensor", sizes=cmp_sizes),
                             block_indices=Arg("index", none="valid", packed=packed,
                                               sizes=[(0, 41), (1, 3)] if packed else [(0, 3), (1, 41), (2, 3)]))
            elif not module:
                specs.update(k_cmp=Arg("tensor", absent=True), block_indices=Arg("index", absent=True))
            if module:
                core = sa.NativeSparseAttentionCore(sa.NSAConfig(**SMALL))
                return a, lambda a: core(a["q"], a["k"], a["v"], a["g_cmp"], a["g_slc"], a["g_swa"],
                                         cu_seqlens=a.get("cu_seqlens"), max_seqlen=a["max_seqlen"]), specs
            for name, value in SMALL.items():
                a["cfg." + name] = value
            specs.update(_config_fields_args(True, SMALL))
            specs["config"] = Arg("config", none=None)

            def call(a):
                a = split_config(a)
                return sa.nsa_attention(a["q"], a["k"], a["v"], a["g_cmp"], a["g_slc"], a["g_swa"],
                                        config=config_of(a), k_cmp=a.get("k_cmp"), v_cmp=a.get("v_cmp"),
                                        block_indices=a.get("block_indices"), cu_seqlens=a.get("cu_seqlens"),
                                        max_seqlen=a["max_seqlen"])
            return a, call, specs

        out["nsa_attention" + sfx] = ({"nsa_attention", "NSAConfig"}, nsa)
        out["nsa_attention_user" + sfx] = ({"nsa_attention", "NSAConfig"}, lambda packed=packed: nsa(packed, True))
        out["NativeSparseAttentionCore.forward" + sfx] = (
            {"nsa_attention"}, lambda packed=packed: nsa(packed, module=True))

        def layer_forward(packed=packed):
            torch.manual_seed(1)
            layer = sa.NativeSparseAttention(32, 4, 2, 8, config=sa.NSAConfig(**SMALL))
            x = torch.randn(N, 32) if packed else torch.randn(B, T, 32)
            a = dict(x=x, max_seqlen=23 if packed else None)
            # (a non-contiguous x may take another matmul path: valid, not necessarily bitwise equal)
            specs = dict(x=Arg("tensor", sizes=[(-1, 33), (0, 30)] if packed else [(-1, 33)], noncontig="valid"),
                         max_seqlen=Arg("int", minimum=0, maximum=2**63 - 1, none="same" if packed else None,
                                        bad=[("5 (< a length)", 5)] if packed else []))
            if packed:
                a["cu_seqlens"] = cu()
                specs["cu_seqlens"] = Arg("cu")
            else:
                specs["cu_seqlens"] = Arg("cu", absent=True)
            return a, lambda a: layer(a["x"], cu_seqlens=a.get("cu_seqlens"), max_seqlen=a["max_seqlen"]), specs

        out["NativeSparseAttention.forward" + sfx] = ({"NativeSparseAttention", "nsa_attention"}, layer_forward)

    def compressed_cu():
        a = dict(cu_seqlens=torch.tensor([0, 17, 40, 40, 90], dtype=torch.int32), block=16, stride=8)
        # (no other tensor: a meta cu_seqlens is valid, and nothing bounds its last entry)
        specs = dict(cu_seqlens=Arg("cu", rows=False, meta="valid"), block=Arg("int"), stride=Arg("int"))
        return a, lambda a: sa.compressed_cu_seqlens(a["cu_seqlens"], block=a["block"], stride=a["stride"]), specs

    out["compressed_cu_seqlens"] = ({"compressed_cu_seqlens"}, compressed_cu)

    def create_mask():
        a = dict(bias=torch.randn(B, HKV, T, T), keep=5, causal=True, key_padding_mask=torch.rand(B, T) < 0.8,
                 window=(7, 0))
        # (any 4-D float bias is taken: H and T are free, B and S must match key_padding_mask)
        specs = dict(bias=Arg("tensor", sizes=[(0, 3), (3, 41)], none="type", float_dtypes="valid"),
                     keep=Arg("int", none="type", good=[("41 (more than the keys)", 41)]), causal=Arg("flag"),
                     key_padding_mask=Arg("mask", none="valid", sizes=[(0, 3), (1, 41)]), window=Arg("window"))
        return a, lambda a: sa.create_mask(a["bias"], a["keep"], causal=a["causal"],
                                           key_padding_mask=a["key_padding_mask"], window=a["window"]), specs

    out["create_mask"] = ({"create_mask"}, create_mask)

    def config():
        a = {"cfg." + k: v for k, v in SMALL.items()}
        specs = _config_fields_args(False, SMALL)
        return a, lambda a: sa.NSAConfig(**split_config(a)["config"]), specs

    out["NSAConfig"] = ({"NSAConfig"}, config)

    def core_init():
        a = {"config": Fields(SMALL)}
        specs = {"config": Arg("config", none="valid")}
        return a, lambda a: sa.NativeSparseAttentionCore(config_of(a)), specs

    out["NativeSparseAttentionCore"] = ({"NativeSparseAttentionCore"}, core_init)

    def layer_init():
        a = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, v_head_dim=None, rotary=True,
                 rope_theta=10000.0, bias=False, device=None, dtype=None, config=Fields(SMALL))
        specs = dict(hidden_size=Arg("int"), num_heads=Arg("int", bad=[("5 (num_kv_heads 2 does not divide it)", 5)]),
                     num_kv_heads=Arg("int", bad=[("3 (does not divide num_heads)", 3)]),
                     head_dim=Arg("int", bad=[("7 (odd, with rotary)", 7)]),
                     v_head_dim=Arg("int", none="valid"), rotary=Arg("flag"),
                     rope_theta=Arg("scale", none="type"), bias=Arg("flag"), device=Arg("device"),
                     dtype=Arg("dtype"), config=Arg("config", none="valid"))
        return a, lambda a: sa.NativeSparseAttention(**dict(a, config=config_of(a))), specs

    out["NativeSparseAttention"] = ({"NativeSparseAttention"}, layer_init)
    return out


def _tensors(value, path="args"):
    """(path, tensor) for every tensor in a nested value."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}[{i}]")


def _snapshot(value):
    return [(path, t, t.shape, t.stride() if t.layout == torch.strided else None, t.clone())
            for path, t in _tensors(value)]


def _unchanged(snapshot) -> str:
    """'' or a description of the first input the call changed."""
    for path, t, shape, stride, copy in snapshot:
        if t.shape != shape or (stride is not None and t.stride() != stride):
            return f"{path} changed shape or strides"
        if t.device.type == "meta":
            continue
        a, b = (t.to_dense(), copy.to_dense()) if t.layout != torch.strided else (t, copy)
        if not torch.equal(a, b):
            return f"{path} changed its values"
    return ""


def _outputs_equal(got, ref) -> bool:
    got = list(_tensors(got))
    ref = list(_tensors(ref))
    return len(got) == len(ref) and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, ref))


def _plan(rng, table, count: int, only):
    """(name, arg, mutation index) of each call: `count` random ones, or every mutation of the targets in
    `only` in order (the mutation lists are rebuilt per call, so an index names the same mutation)."""
    if not only:
        names = sorted(table)
        for _ in range(count):
            name = rng.choice(names)
            yield name, None, None
        return
    for name in only:
        a, _, specs = table[name][1]()
        for arg in sorted(specs):
            for j in range(len(mutations(specs[arg], a.get(arg)))):
                yield name, arg, j


def worker(seed: int, count: int, progress: str, only=()) -> int:
    """Runs `count` random mutated calls (or every mutation of the targets in `only`); prints one line per
    failure; returns the number of failures."""
    import sparseattn as sa

    torch.manual_seed(seed)
    rng = random.Random(seed)
    abort_at = int(os.environ.get("SPARSEATTN_TEST_ABORT_AT", "-1"))
    table = targets()
    built = {}
    failures = 0
    counts = {"invalid": 0, "valid": 0}
    plan = list(_plan(rng, table, count, only))
    count = len(plan)
    with open(progress, "w") as log:
        for i, (name, arg, index) in enumerate(plan):
            ops, build = table[name]
            if name not in built:
                log.seek(0)
                log.write(f"building the base call of {name}\n")
                log.truncate()
                log.flush()
                a, call, specs = build()
                ref = call(dict(a))
                built[name] = (a, call, specs, ref)
            a, call, specs, ref = built[name]
            if arg is None:
                arg = rng.choice(sorted(specs))
            candidates = mutations(specs[arg], a.get(arg))
            if index is None:
                index = rng.randrange(len(candidates))
            desc, value, expect = candidates[index]
            what = f"call {i} (seed {seed}): {name} with {arg} = {desc} (expect {expect})"
            log.seek(0)
            log.write(what + "\n")
            log.truncate()
            log.flush()
            args = dict(a)
            args[arg] = value
            if abort_at == i:  # test_a_crash_names_the_call
                os.abort()
            # Snapshot every input (mutated one included) and, for modules, the parameters.
            snapshot = _snapshot(args)
            try:
                result = call(args)
                error = None
            except Exception as exc:  # noqa: BLE001 - every exception is judged below
                error = exc
            problem = ""
            if expect in ("valid", "same"):
                counts["valid"] += 1
                if error is not None:
                    problem = f"raised {type(error).__name__}: {error}"
                elif expect == "same" and not _outputs_equal(result, ref):
                    problem = "returned a different output than the unmutated call"
            else:
                counts["invalid"] += 1
                want = {"type": sa.SparseAttnTypeError, "dtype": sa.SparseAttnDTypeError}.get(expect,
                                                                                             sa.SparseAttnError)
                if error is None:
                    problem = "did not raise"
                elif not isinstance(error, want):
                    problem = (f"raised {type(error).__module__}.{type(error).__name__} (expected {want.__name__}): "
                               f"{error}\n" + "".join(traceback.format_exception(error))[-1500:])
                else:
                    message = str(error)
                    if not (error.op in ops and error.argument and
                            message.startswith(f"sparseattn.{error.op}: argument '{error.argument}': ")):
                        problem = f"error without the op ({sorted(ops)}) or argument: op={error.op!r} {message!r}"
                    elif expect == "type" and not isinstance(error, TypeError):
                        problem = f"not a TypeError: {message}"
            changed = _unchanged(snapshot)
            if changed:
                problem = (problem + "; " if problem else "") + f"the call changed an input: {changed}"
            if problem:
                failures += 1
                print(f"FAIL {what}: {problem}", flush=True)
    print(f"SUMMARY {count} calls: {counts['invalid']} invalid, {counts['valid']} valid; {failures} failures",
          flush=True)
    return failures


# ------------------------------------------------------------------------------------------------------ tests


def run_chunk(seed: int, count: int, env_extra=None, only=()) -> str:
    """Runs a chunk (or every mutation of the targets in `only`) in a child process; returns '' or why it
    failed (with the call it was making)."""
    with tempfile.TemporaryDirectory() as tmp:
        progress = os.path.join(tmp, "last_call.txt")
        env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
        cmd = [sys.executable, os.path.abspath(__file__), str(seed), str(count), progress]
        if only:
            cmd.append(",".join(only))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
        except subprocess.TimeoutExpired as exc:
            last = open(progress).read().strip() if os.path.exists(progress) else "(none)"
            return f"timed out after {TIMEOUT_S} s in: {last}\n{exc.stdout or ''}"
        last = open(progress).read().strip() if os.path.exists(progress) else "(none)"
    report = proc.stdout[-20000:] + ("\n" + proc.stderr[-5000:] if proc.stderr else "")
    if proc.returncode < 0:
        return f"the child process died of signal {-proc.returncode} in: {last}\n{report}"
    if "SUMMARY" not in proc.stdout:
        return f"the child process exited ({proc.returncode}) in: {last}\n{report}"
    if proc.returncode != 0 or "FAIL" in proc.stdout:
        return report
    return ""


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_invalid_calls(chunk):
    failure = run_chunk(SEED + chunk, CALLS_PER_CHUNK)
    assert not failure, failure


@pytest.mark.parametrize("target", EXHAUSTIVE)
def test_every_mutation(target):
    """Every mutation of the newest targets once (create_mask, gated flash_attention with thresholds)."""
    failure = run_chunk(SEED, 0, only=(target,))
    assert not failure, failure


def test_a_crash_names_the_call():
    """The guard itself: a call that kills the process fails the chunk with that call's description."""
    failure = run_chunk(SEED, 5, {"SPARSEATTN_TEST_ABORT_AT": "3"})
    assert "died of signal" in failure and "call 3 (seed" in failure, failure


if __name__ == "__main__":
    sys.exit(1 if worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else
                         os.path.join(tempfile.gettempdir(), "sparseattn_last_call.txt"),
                         tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else ()) else 0)
