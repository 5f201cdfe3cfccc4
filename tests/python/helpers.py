"""Plain helpers of the sparseattn pytest suite (conftest.py holds the fixtures, markers and hooks).

Test modules start with ``sa = require_sparseattn()``: an import failure FAILS loudly unless the
environment variable SPARSEATTN_ALLOW_MISSING is set, in which case the module is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import Sequence

import pytest
import torch

ALLOW_MISSING_ENV = "SPARSEATTN_ALLOW_MISSING"


def require_sparseattn():
    """Import sparseattn; skip the calling module (env var set) or fail loudly (default)."""
    try:
        import sparseattn  # noqa: PLC0415
    except Exception as exc:  # ImportError, or an error raised while loading the extension
        if os.environ.get(ALLOW_MISSING_ENV):
            pytest.skip(f"sparseattn cannot be imported ({type(exc).__name__}: {exc}); skipped because "
                        f"{ALLOW_MISSING_ENV} is set", allow_module_level=True)
        raise ImportError(f"sparseattn cannot be imported: {type(exc).__name__}: {exc}. Build and install it "
                          f"(pip install --no-build-isolation .), or set {ALLOW_MISSING_ENV}=1 to skip the "
                          f"tests that need it.") from exc
    return sparseattn



def load_script(name: str):
    """The module of scripts/<name>.py (not a package), registered in sys.modules as dataclasses need."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------- tensors


def randn(*shape, dtype=torch.float64, requires_grad=False, scale=1.0, device="cpu"):
    x = torch.randn(*shape, dtype=torch.float64) * scale
    x = x.to(device=device, dtype=dtype)
    return x.requires_grad_(requires_grad)


def gates(*shape, dtype=torch.float64, requires_grad=False, device="cpu"):
    """Gate values as a sigmoid output (used as given by the ops)."""
    g = torch.sigmoid(torch.randn(*shape, dtype=torch.float64)).to(device=device, dtype=dtype)
    return g.requires_grad_(requires_grad)


def qkv(B, T, Hq, Hkv, Dqk, Dv=None, dtype=torch.float64, requires_grad=False, S=None, device="cpu"):
    Dv = Dqk if Dv is None else Dv
    S = T if S is None else S
    return (randn(B, T, Hq, Dqk, dtype=dtype, requires_grad=requires_grad, device=device),
            randn(B, S, Hkv, Dqk, dtype=dtype, requires_grad=requires_grad, device=device),
            randn(B, S, Hkv, Dv, dtype=dtype, requires_grad=requires_grad, device=device))


def cu_seqlens_of(lengths: Sequence[int], device="cpu") -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def pack(x: torch.Tensor, lengths: Sequence[int], extra_rows: int = 0) -> torch.Tensor:
    """Batched [B, Tmax, ...] -> packed [sum(lengths) + extra_rows, ...] (first lengths[b] tokens of each)."""
    parts = [x[b, : int(n)] for b, n in enumerate(lengths)]
    if extra_rows:
        parts.append(torch.zeros((extra_rows,) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device))
    return torch.cat(parts, dim=0)


def unpack(x: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Packed [N, ...] -> list of [lengths[b], ...]."""
    out, s = [], 0
    for n in lengths:
        out.append(x[s : s + int(n)])
        s += int(n)
    return out


def packed_lse_pieces(lse: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Packed lse [H, N] -> list of [H, lengths[b]]."""
    out, s = [], 0
    for n in lengths:
        out.append(lse[:, s : s + int(n)])
        s += int(n)
    return out


def random_indices(T, Hkv, n, sel_block, generator=None, batch=None, allow_empty=False):
    """Valid user indices [T, Hkv, n] (or [batch, T, Hkv, n]): a random subset of the candidate blocks
    (b * sel_block <= t) of size min(n, candidates), ascending, -1 padded."""
    if batch is not None:
        return torch.stack([random_indices(T, Hkv, n, sel_block, generator, None, allow_empty)
                            for _ in range(batch)])
    out = torch.full((T, Hkv, n), -1, dtype=torch.int32)
    for t in range(T):
        cand = t // sel_block + 1
        for h in range(Hkv):
            count = min(n, cand)
            if allow_empty and torch.rand((), generator=generator) < 0.1:
                count = 0
            perm = torch.randperm(cand, generator=generator)[:count]
            out[t, h, :count] = torch.sort(perm).values.to(torch.int32)
    return out


def grads(outputs, inputs, grad_outputs):
    """torch.autograd.grad with zeros for unused inputs."""
    inputs = list(inputs)
    gs = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(gs, inputs)]


def leaf_clones(*xs):
    """Fresh leaves (detached copies that require grad) of the given tensors; None stays None."""
    return [None if x is None else x.detach().clone().requires_grad_(True) for x in xs]


# ------------------------------------------------------------------------------------------ comparing


def assert_close(got, ref, *, atol, rtol=0.0, name="tensor"):
    """Like torch.testing.assert_close (equal_nan, identical infinities), with a name in the message."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != expected {tuple(ref.shape)}"
    got64, ref64 = got.detach().to(torch.float64).cpu(), ref.detach().to(torch.float64).cpu()
    # identical -inf / nan positions
    assert torch.equal(torch.isneginf(got64), torch.isneginf(ref64)), \
        f"{name}: -inf positions differ ({int((torch.isneginf(got64) != torch.isneginf(ref64)).sum())} " \
        f"elements), e.g. at {_first(torch.isneginf(got64) != torch.isneginf(ref64))}"
    assert not torch.isnan(got64).any(), f"{name}: NaN at {_first(torch.isnan(got64))}"
    fin = torch.isfinite(ref64)
    err = (got64 - ref64).abs().where(fin, torch.zeros_like(got64))
    bound = atol + rtol * ref64.abs().where(fin, torch.zeros_like(ref64))
    bad = err > bound
    if bad.any():
        i = _first(bad)
        raise AssertionError(f"{name}: {int(bad.sum())}/{bad.numel()} elements out of tolerance "
                             f"(atol={atol:g}, rtol={rtol:g}); max abs err {err.max().item():.3e}; first at "
                             f"{i}: got {got64[i].item():.6g}, expected {ref64[i].item():.6g}")


def _first(mask):
    idx = mask.nonzero()
    return tuple(idx[0].tolist()) if len(idx) else None


def max_err(got, ref):
    g, r = got.detach().to(torch.float64), ref.detach().to(torch.float64)
    fin = torch.isfinite(r)
    return (g - r).abs().where(fin, torch.zeros_like(g)).max().item() if g.numel() else 0.0


# F64 outputs of a float64 reference vs a float64 oracle: both are exact up to summation order.
F64_ATOL = 1e-10
F64_RTOL = 1e-9


def assert_close64(got, ref, name="tensor"):
    assert_close(got, ref, atol=F64_ATOL, rtol=F64_RTOL, name=name)


# ------------------------------------------------------------------------------------------- errors


@contextlib.contextmanager
def raises_arg(exc_type, *names):
    """Expect exc_type whose message names one of `names` as "argument 'NAME'"."""
    with pytest.raises(exc_type) as info:
        yield info
    msg = str(info.value)
    if names:
        ok = any(f"argument '{n}'" in msg for n in names)
        assert ok, f"error message does not name argument {' or '.join(repr(n) for n in names)}: {msg!r}"


def indices_mismatch_report(got, ref, scores=None, max_items=5):
    """Human-readable list of differing index rows (positions [..., t, h])."""
    diff = (got != ref).any(dim=-1)
    pos = diff.nonzero().tolist()
    lines = [f"{len(pos)} of {diff.numel()} index rows differ"]
    for p in pos[:max_items]:
        line = f"  at {tuple(p)}: got {got[tuple(p)].tolist()} expected {ref[tuple(p)].tolist()}"
        lines.append(line)
    return "\n".join(lines)


def selection_gap_ok(got, ref, scores, rtol, atol=0.0):
    """For each row where the index sets differ, the reference scores of the blocks only `got` chose
    must be within rounding of the scores of the blocks only `ref` chose (then it is a near-tie).

    got/ref [..., T, Hkv, n]; scores [..., Hkv, T, nsel] (reference scores). Returns (ok, report)."""
    bad = []
    rows = (got != ref).any(dim=-1).nonzero().tolist()
    for p in rows:
        *lead, t, h = p
        g = set(x for x in got[tuple(p)].tolist() if x >= 0)
        r = set(x for x in ref[tuple(p)].tolist() if x >= 0)
        if len(g) != len(r):
            bad.append(f"  at {tuple(p)}: counts differ: got {sorted(g)} expected {sorted(r)}")
            continue
        row = scores[tuple(lead) + (h, t)]
        only_g, only_r = sorted(g - r), sorted(r - g)
        top = row.abs().max().item()
        worst_r = min(row[b].item() for b in only_r)
        best_g = max(row[b].item() for b in only_g)
        gap = worst_r - best_g  # > 0: ref strictly prefers its choice
        if gap > atol + rtol * top:
            bad.append(f"  at {tuple(p)}: got {sorted(g)} expected {sorted(r)}; score gap {gap:.3e} "
                       f"(row max {top:.3e})")
    return not bad, "\n".join([f"{len(bad)} index rows differ beyond a near-tie"] + bad[:8])


def describe(**kw) -> str:
    return ", ".join(f"{k}={v}" for k, v in kw.items())
