"""The project's benchmark: sparseattn's NSA stages and pipeline against dense causal attention (PyTorch SDPA with
the cuDNN and flash backends), timed in the same process.

    python -m sparseattn.bench                                  # the whole matrix of the issue
    python -m sparseattn.bench --time-budget-s 420              # ... fitted into about 7 minutes
    python -m sparseattn.bench --shapes 64/4/128/128 --seqlens 8K 64K --no-stages
    python -m sparseattn.bench --inputs drifting                # q and k with locality (drifting_tokens)
    python -m sparseattn.bench --from-json bench/results/X.json # redo the markdown and plot of a run (no GPU)
    SPARSEATTN_COMMIT=abc1234 python -m sparseattn.bench        # name the commit (a copy of the tree, a stale .git)

Shapes are Hq/Hkv/Dqk/Dv; batch 1, causal, NSA defaults except --window. Cases run shortest T first (all shapes
at one T, then the next T); JSON and markdown are rewritten after every case, so an interrupted run keeps what
it measured, and the plot is drawn at the end.

Timing: CUDA events around each run, 256 MB of L2-flushing writes and a 1 ms GPU sleep before every timed run
(the sleep keeps the GPU busy while the host launches the run, so that a short stage is timed by its kernels,
not by the host's launch overhead), median. A
measurement is a first run (which also gives the peak memory of fwd+bwd: the most allocated on top of the
inputs), one more to estimate the warm run time if the first was shorter than the target, untimed runs up to
--warmup-ms, then timed runs up to --rep-ms in total (at least 1, at most --max-reps). "fwd" runs under
torch.no_grad(); "fwd+bwd" is the forward and torch.autograd.grad of q, k, v (and the NSA gates). NSA fwd+bwd is
measured with the default recompute="none" and again with recompute="branches" and "selected_and_window" (time and
peak memory of each). With
--time-budget-s the target of each measurement is also capped at its share of the time left, and the cases not
started within the budget are recorded as skipped.

A measurement that fails is recorded with its reason and the run goes on: "OOM" (torch.OutOfMemoryError),
"unsupported" (no CUDA kernel in this build of sparseattn), "unavailable" (e.g. an SDPA backend that does not
take the shape; its warnings say why), "skipped" (time budget, or a stage whose input failed).

FLOP counts (multiply-adds x 2, causal halves counted exactly as the visible keys):
  dense causal forward      4 * Hq * D * T^2 / 2                 (D = (Dqk + Dv) / 2)
  compressed attention      4 * Hq * D * T * Tc / 2              (Tc = number of compressed blocks)
  selected attention        4 * Hq * D * T * n * l'
  sliding window            4 * Hq * D * T * w
  backward                  2.5 x the forward (FlashAttention's convention)
Effective TFLOP/s of NSA use the sum of its three branches.

--kernels adds, per case, the GPU time of every kernel of one NSA forward+backward (torch.profiler, after one
warm-up run): the backward's own breakdown, which the stage-by-stage forward times do not give.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import statistics
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from . import _errors
from .functional import (NSAConfig, combine, compress_kv, compressed_attention, flash_attention, nsa_attention,
                         select_blocks, selected_attention)

SHAPES = ["64/4/128/128", "32/8/128/128", "32/32/128/128", "28/4/128/128", "64/4/192/128"]
SEQLENS = [8192, 16384, 32768, 65536, 131072]
STAGES = ("compress_kv", "compressed_attention", "select_blocks", "selected_attention", "sliding_window", "combine")
DENSE = ("sdpa_cudnn", "sdpa_flash")
BACKWARD_FLOPS = 2.5  # x the forward


@dataclass
class Shape:
    heads_q: int
    heads_kv: int
    dim_qk: int
    dim_v: int

    @staticmethod
    def parse(text: str) -> "Shape":
        hq, hkv, dqk, dv = (int(x) for x in text.split("/"))
        return Shape(hq, hkv, dqk, dv)

    def label(self) -> str:
        return f"{self.heads_q}/{self.heads_kv}, {self.dim_qk}/{self.dim_v}"


def parse_seqlen(text: str) -> int:
    """8192, 8K or 8k (times 1024), 1M or 1m (times 1024^2)."""
    units = {"k": 1024, "m": 1024 * 1024}
    unit = units.get(text[-1].lower())
    return int(text[:-1]) * unit if unit else int(text)


def seqlen_label(seqlen: int) -> str:
    if seqlen % (1024 * 1024) == 0:
        return f"{seqlen // (1024 * 1024)}M"
    return f"{seqlen // 1024}K" if seqlen % 1024 == 0 else str(seqlen)


# ------------------------------------------------------------------------------------------------- timing


SLEEP_CYCLES = 2_000_000  # about 1 ms at an H100's 1.75-1.98 GHz


class Timer:
    """Times callables with CUDA events and shares an optional wall-clock budget among the measurements left."""

    def __init__(self, rep_ms: float = 100.0, warmup_ms: float = 25.0, max_reps: int = 100,
                 budget_s: Optional[float] = None):
        self.rep_ms, self.warmup_ms, self.max_reps = rep_ms, warmup_ms, max_reps
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.measurements_left = 1
        self._flush = None

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def target_ms(self) -> float:
        """Timed milliseconds wanted for the next measurement."""
        if self.deadline is None:
            return self.rep_ms
        share = (self.deadline - time.monotonic()) * 1000 / max(1, self.measurements_left)
        return max(0.0, min(self.rep_ms, share))

    def measure(self, fn: Callable[[], object], peak_memory: bool = False):
        """Returns (median ms, timed runs, peak GB over the inputs or None, the first run's result)."""
        torch.cuda.synchronize()
        if peak_memory:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        first_ms, value = _timed(fn)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if peak_memory else None
        target = self.target_ms()
        self.measurements_left = max(1, self.measurements_left - 1)
        # The first run pays one-time costs (e.g. cuDNN plans); a short one is timed again, warm, as the estimate.
        estimate_ms = max(_timed(fn)[0] if first_ms <= target else first_ms, 1e-3)
        for _ in range(min(self.max_reps, int(min(self.warmup_ms, target) / estimate_ms))):
            fn()
        reps = max(1, min(self.max_reps, int(target / estimate_ms)))
        if self._flush is None:
            self._flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for begin, finish in events:
            self._flush.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)
            begin.record()
            fn()
            finish.record()
        torch.cuda.synchronize()
        return statistics.median(b.elapsed_time(f) for b, f in events), reps, peak, value


def _timed(fn: Callable[[], object]):
    """(milliseconds, result) of one run of fn."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    value = fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), value


def failure_reason(error: BaseException, warned: list) -> str:
    message = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    if isinstance(error, torch.OutOfMemoryError):
        kind = "out of memory"
    elif isinstance(error, _errors.SparseAttnUnsupportedError):
        kind = "unsupported"
    else:
        kind = "unavailable"
    notes = (re.sub(r"\s*\(Triggered internally at [^)]*\)", "", str(w.message)).strip() for w in warned)
    details = "; ".join(dict.fromkeys(note.splitlines()[0] for note in notes if note))
    return f"{kind}: {message}" + (f" [{details}]" if details else "")


class Case:
    """The result dict of one (shape, T) case and the measurements that fill it."""

    def __init__(self, shape: Shape, seqlen: int, timer: Timer):
        self.timer = timer
        self.result = {"shape": asdict(shape), "seqlen": seqlen, "times_ms": {}, "reps": {}, "peak_memory_gb": {},
                       "errors": {}}

    def fail(self, key: str, reason: str) -> None:
        self.result["times_ms"][key] = None
        self.result["errors"][key] = reason

    def measure(self, key: str, fn: Callable[[], object], peak_memory: bool = False):
        """Times fn as `key`; returns the result of its first run, or None (recorded with the reason) when it
        fails."""
        failed = False
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                ms, reps, peak, value = self.timer.measure(fn, peak_memory)
            except (RuntimeError, NotImplementedError, ValueError) as error:
                self.fail(key, failure_reason(error, warned))
                failed, value = True, None
            else:
                self.result["times_ms"][key], self.result["reps"][key] = ms, reps
                if peak_memory:
                    self.result["peak_memory_gb"][key.removesuffix("_fwd_bwd")] = peak
        if failed:  # after the except block, which kept the failed call's frames (and tensors) alive
            torch.cuda.empty_cache()
        return value


# ------------------------------------------------------------------------------------------------ one case


def nsa_flops(shape: Shape, seqlen: int, config: NSAConfig) -> dict[str, float]:
    dim = (shape.dim_qk + shape.dim_v) / 2
    tc = max(0, (seqlen - config.cmp_block) // config.cmp_stride + 1)
    per_key = 4 * shape.heads_q * dim * seqlen
    return {
        "compressed": per_key * tc / 2,
        "selected": per_key * config.num_selected * config.sel_block,
        "window": per_key * min(config.window, seqlen),
    }


def dense_flops(shape: Shape, seqlen: int) -> float:
    return 4 * shape.heads_q * (shape.dim_qk + shape.dim_v) / 2 * seqlen * seqlen / 2


def measure_dense(case: Case, q, k, v, d_o) -> None:
    """SDPA causal attention (layout [B, H, T, D], GQA through enable_gqa) with one backend at a time."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION}
    qd, kd, vd = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    d_od = d_o.transpose(1, 2)
    for name in DENSE:
        def forward(backend=backends[name]):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

        def forward_only():
            forward()

        def forward_backward():
            torch.autograd.grad(forward(), (qd, kd, vd), d_od)

        with torch.no_grad():
            case.measure(f"{name}_fwd", forward_only)
        case.measure(f"{name}_fwd_bwd", forward_backward, peak_memory=True)


def measure_stages(case: Case, q, k, v, gates, c: NSAConfig) -> None:
    """Each forward stage on the previous stages' outputs; a stage whose input failed is skipped."""
    outputs = {}
    steps = {
        "compress_kv": ((), lambda: compress_kv(k, v, block=c.cmp_block, stride=c.cmp_stride)),
        "compressed_attention": (("compress_kv",), lambda: compressed_attention(
            q, *outputs["compress_kv"], block=c.cmp_block, stride=c.cmp_stride)),
        "select_blocks": (("compress_kv", "compressed_attention"), lambda: select_blocks(
            q, outputs["compress_kv"][0], outputs["compressed_attention"][1], cmp_block=c.cmp_block,
            cmp_stride=c.cmp_stride, sel_block=c.sel_block, num_selected=c.num_selected, num_init=c.num_init,
            num_local=c.num_local)),
        "selected_attention": (("select_blocks",), lambda: selected_attention(
            q, k, v, outputs["select_blocks"], block=c.sel_block)),
        "sliding_window": ((), lambda: flash_attention(q, k, v, causal=True, window=(c.window - 1, 0))),
        "combine": (("compressed_attention", "selected_attention", "sliding_window"), lambda: combine(
            outputs["compressed_attention"][0], outputs["selected_attention"][0], outputs["sliding_window"], *gates)),
    }
    with torch.no_grad():
        for name in STAGES:
            needs, fn = steps[name]
            missing = [n for n in needs if outputs.get(n) is None]
            if missing:
                case.fail(name, f"skipped: needs the output of {', '.join(missing)}")
            else:
                outputs[name] = case.measure(name, fn)


def kernel_name(name: str) -> str:
    """A profiler kernel name without namespaces, `void` and the parameter list."""
    name = name.removeprefix("void ").strip()
    if name.endswith(")"):  # drop the parameter list: from the parenthesis that closes last, back to its match
        depth = 0
        for at in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[at], 0)
            if depth == 0:
                name = name[:at] if at > 0 else name
                break
    return re.sub(r"\(anonymous namespace\)::|\b(?:[A-Za-z_]\w*::)+", "", name)


def kernel_times(fn: Callable[[], object]) -> dict[str, float]:
    """GPU milliseconds per kernel (shortened name) of one run of fn, after a warm-up run, largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        gpu_us = getattr(event, "device_time_total", 0.0)
        if gpu_us > 0:
            key = kernel_name(event.key)
            totals[key] = totals.get(key, 0.0) + gpu_us / 1000
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def measurements_per_case(stages: bool) -> int:
    return 2 * len(DENSE) + 2 + len(RECOMPUTE_MODES) + (len(STAGES) if stages else 0)


# The recompute modes of nsa_attention timed beside the default "none" (time and peak memory of fwd+bwd).
RECOMPUTE_MODES = ("branches", "selected_and_window")


INPUTS = ("random", "drifting")


def drifting_tokens(seqlen: int, heads: int, dim: int, *, device="cuda", dtype=torch.bfloat16,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Queries or keys with locality: [1, seqlen, heads, dim], a random walk along the sequence (steps of 0.05,
    normalised by sqrt(position) so that every token has about unit size) plus independent noise of 0.5. Nearby
    tokens are alike, so neighbouring queries choose mostly the same blocks (NSA defaults, 64/4 heads: about a
    third as many distinct blocks among 8 consecutive tokens as with independent random tokens)."""
    steps = torch.randn(seqlen, heads, dim, device=device, generator=generator) * 0.05
    positions = torch.arange(1, seqlen + 1, device=device, dtype=torch.float32)[:, None, None]
    walk = steps.cumsum(0) / (positions.sqrt() * 0.05)
    noise = torch.randn(seqlen, heads, dim, device=device, generator=generator)
    return (walk + 0.5 * noise).to(dtype)[None]


def make_qk(shape: Shape, seqlen: int, dtype: torch.dtype, inputs: str, device="cuda"):
    """q and k of a case (requiring grad): independent standard normal tokens ("random") or drifting_tokens."""
    if inputs == "drifting":
        q = drifting_tokens(seqlen, shape.heads_q, shape.dim_qk, device=device, dtype=dtype)
        k = drifting_tokens(seqlen, shape.heads_kv, shape.dim_qk, device=device, dtype=dtype)
    else:
        q = torch.randn(1, seqlen, shape.heads_q, shape.dim_qk, device=device, dtype=dtype)
        k = torch.randn(1, seqlen, shape.heads_kv, shape.dim_qk, device=device, dtype=dtype)
    return q.requires_grad_(), k.requires_grad_()


def run_case(shape: Shape, seqlen: int, dtype: torch.dtype, config: NSAConfig, timer: Timer,
             stages: bool = True, kernels: bool = False, inputs: str = "random") -> dict:
    case = Case(shape, seqlen, timer)
    case.result["inputs"] = inputs
    try:
        q, k = make_qk(shape, seqlen, dtype, inputs)
        v = torch.randn(1, seqlen, shape.heads_kv, shape.dim_v, device="cuda", dtype=dtype, requires_grad=True)
        gates = [torch.rand(1, seqlen, shape.heads_q, device="cuda", dtype=dtype, requires_grad=True)
                 for _ in range(3)]
        d_o = torch.randn(1, seqlen, shape.heads_q, shape.dim_v, device="cuda", dtype=dtype)
    except torch.OutOfMemoryError as error:
        case.result["errors"]["case"] = failure_reason(error, [])
        return summarize(case.result, shape, seqlen, config)

    measure_dense(case, q, k, v, d_o)
    if stages:
        measure_stages(case, q, k, v, gates, config)

    def nsa_forward():
        nsa_attention(q, k, v, *gates, config=config)

    def nsa_forward_backward(recompute="none"):
        torch.autograd.grad(nsa_attention(q, k, v, *gates, config=config, recompute=recompute), (q, k, v, *gates),
                            d_o)

    with torch.no_grad():
        case.measure("nsa_fwd", nsa_forward)
    case.measure("nsa_fwd_bwd", nsa_forward_backward, peak_memory=True)
    for mode in RECOMPUTE_MODES:
        case.measure(f"nsa_{mode}_fwd_bwd", lambda mode=mode: nsa_forward_backward(mode), peak_memory=True)
    if kernels and case.result["times_ms"].get("nsa_fwd_bwd") is not None:
        case.result["kernels_fwd_bwd_ms"] = kernel_times(nsa_forward_backward)
    return summarize(case.result, shape, seqlen, config)


def summarize(result: dict, shape: Shape, seqlen: int, config: NSAConfig) -> dict:
    """Adds FLOP counts, effective TFLOP/s and the ratios to SDPA cuDNN."""
    times, memory = result["times_ms"], result["peak_memory_gb"]
    forward = {"nsa": sum(nsa_flops(shape, seqlen, config).values()), "dense": dense_flops(shape, seqlen)}
    result["flops"] = {"nsa_forward": forward["nsa"], "dense_forward": forward["dense"]}
    result["tflops"] = {}
    for method, kind in (("nsa", "nsa"), ("sdpa_cudnn", "dense"), ("sdpa_flash", "dense")):
        work = forward[kind]
        for key, flops in ((f"{method}_fwd", work), (f"{method}_fwd_bwd", (1 + BACKWARD_FLOPS) * work)):
            result["tflops"][key] = None if times.get(key) is None else flops / (times[key] * 1e-3) / 1e12
    result["ratio_vs_cudnn"] = {"fwd": ratio(times.get("sdpa_cudnn_fwd"), times.get("nsa_fwd")),
                                "fwd_bwd": ratio(times.get("sdpa_cudnn_fwd_bwd"), times.get("nsa_fwd_bwd"))}
    result["peak_memory_ratio_vs_cudnn"] = ratio(memory.get("nsa"), memory.get("sdpa_cudnn"))
    return result


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return None if numerator is None or not denominator else numerator / denominator


# ------------------------------------------------------------------------------------------------- reports


def fmt_ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.3f}"


def fmt_number(value: Optional[float], digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def time_cell(result: dict, key: str) -> str:
    """The time, or why there is none: OOM, unsupported, unavailable, skipped."""
    value = result["times_ms"].get(key)
    if value is not None:
        return fmt_ms(value)
    errors = result.get("errors", {})
    reason = errors.get(key) or errors.get("case")
    if reason is None:
        return "n/a"
    return "OOM" if reason.startswith("out of memory") else reason.split(":")[0]


def ordered(results: list[dict]) -> list[dict]:
    """Shape-major (in order of first appearance), then by T."""
    shapes = list(dict.fromkeys(Shape(**r["shape"]).label() for r in results))
    return sorted(results, key=lambda r: (shapes.index(Shape(**r["shape"]).label()), r["seqlen"]))


def markdown(meta: dict, results: list[dict]) -> str:
    results = ordered(results)
    lines = [f"# sparseattn benchmark: {meta['gpu']}, {meta['date']}, commit {meta['commit']}", "",
             f"dtype {meta['dtype']}, batch 1, causal, {meta.get('inputs', 'random')} q and k; NSA config "
             f"{meta['config']}. Times in ms (median); fwd runs "
             "under torch.no_grad(), fwd+bwd includes the gradients of q, k, v (and the NSA gates). cuDNN/NSA = SDPA "
             "cuDNN time / sparseattn time (> 1: sparseattn is faster). Peak memory: the most allocated on top of the "
             "inputs during fwd+bwd.", "",
             "| Hq/Hkv, Dqk/Dv | T | NSA fwd | cuDNN fwd | flash fwd | cuDNN/NSA fwd | NSA fwd+bwd | cuDNN fwd+bwd | "
             "flash fwd+bwd | cuDNN/NSA fwd+bwd | NSA TFLOP/s fwd, fwd+bwd | peak GB NSA / cuDNN | memory NSA/cuDNN |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t, m = r["times_ms"], r["peak_memory_gb"]
        cells = [Shape(**r["shape"]).label(), seqlen_label(r["seqlen"])]
        for suffix in ("fwd", "fwd_bwd"):
            cells += [time_cell(r, f"nsa_{suffix}"), time_cell(r, f"sdpa_cudnn_{suffix}"),
                      time_cell(r, f"sdpa_flash_{suffix}"),
                      fmt_number(ratio(t.get(f"sdpa_cudnn_{suffix}"), t.get(f"nsa_{suffix}")))]
        tflops = r.get("tflops", {})
        cells += [f"{fmt_number(tflops.get('nsa_fwd'), 0)}, {fmt_number(tflops.get('nsa_fwd_bwd'), 0)}",
                  f"{fmt_number(m.get('nsa'))} / {fmt_number(m.get('sdpa_cudnn'))}",
                  fmt_number(ratio(m.get("nsa"), m.get("sdpa_cudnn")))]
        lines.append("| " + " | ".join(cells) + " |")

    if any(f"nsa_{mode}_fwd_bwd" in r["times_ms"] for r in results for mode in RECOMPUTE_MODES):
        lines += ["", "NSA fwd+bwd with recompute= 'branches' (the forward keeps log-sum-exps, selection and pooled "
                  "K/V; the backward recomputes the three branch outputs) and 'selected_and_window' (keeps the "
                  "compressed output too): time, cost over the default 'none', and the peak memory of each (GB "
                  "above the inputs, gradients included):", "",
                  "| Hq/Hkv, Dqk/Dv | T | NSA fwd+bwd | branches | cost | selected_and_window | cost "
                  "| peak GB none / branches / selected_and_window |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in results:
            t, m = r["times_ms"], r["peak_memory_gb"]
            cells = [Shape(**r["shape"]).label(), seqlen_label(r["seqlen"]), time_cell(r, "nsa_fwd_bwd")]
            for mode in RECOMPUTE_MODES:
                cost = ratio(t.get(f"nsa_{mode}_fwd_bwd"), t.get("nsa_fwd_bwd"))
                cells += [time_cell(r, f"nsa_{mode}_fwd_bwd"), "n/a" if cost is None else f"{100 * (cost - 1):+.1f}%"]
            peaks = ("nsa", *(f"nsa_{mode}" for mode in RECOMPUTE_MODES))
            cells.append(" / ".join(fmt_number(m.get(key)) for key in peaks))
            lines.append("| " + " | ".join(cells) + " |")

    if any(s in r["times_ms"] for r in results for s in STAGES):
        lines += ["", "Forward times of the stages called one by one (ms); sum: all of them, to compare with the "
                  "whole pipeline (NSA fwd):", "",
                  "| Hq/Hkv, Dqk/Dv | T | " + " | ".join(STAGES) + " | sum | NSA fwd |",
                  "|---|---|" + "---|" * (len(STAGES) + 2)]
        for r in results:
            stage_times = [r["times_ms"].get(s) for s in STAGES]
            total = None if None in stage_times else sum(stage_times)
            lines.append(f"| {Shape(**r['shape']).label()} | {seqlen_label(r['seqlen'])} | "
                         + " | ".join(time_cell(r, s) for s in STAGES)
                         + f" | {'n/a' if total is None else fmt_ms(total)} | {time_cell(r, 'nsa_fwd')} |")

    for r in results:
        kernels = r.get("kernels_fwd_bwd_ms")
        if kernels:
            lines += ["", f"Kernels of one NSA fwd+bwd at {Shape(**r['shape']).label()}, T={seqlen_label(r['seqlen'])} "
                      f"(GPU ms, torch.profiler; total {fmt_ms(sum(kernels.values()))}):", "",
                      "| kernel | ms |", "|---|---|"]
            lines += [f"| `{name}` | {fmt_ms(ms)} |" for name, ms in kernels.items()]

    failures: dict[tuple[str, str], list[str]] = {}
    for r in results:
        for key, reason in r.get("errors", {}).items():
            failures.setdefault((key, reason), []).append(
                f"{Shape(**r['shape']).label()} T={seqlen_label(r['seqlen'])}")
    if failures:
        lines += ["", "Not measured:", ""]
        lines += [f"- `{key}` at {'; '.join(cases)}: {reason}" for (key, reason), cases in failures.items()]
    return "\n".join(lines) + "\n"


PLOT_LINES = (("NSA fwd", "nsa_fwd", "C0", "--"), ("NSA fwd+bwd", "nsa_fwd_bwd", "C0", "-"),
              ("cuDNN fwd", "sdpa_cudnn_fwd", "C1", "--"), ("cuDNN fwd+bwd", "sdpa_cudnn_fwd_bwd", "C1", "-"),
              ("flash fwd", "sdpa_flash_fwd", "C2", "--"), ("flash fwd+bwd", "sdpa_flash_fwd_bwd", "C2", "-"))


def plot(meta: dict, results: list[dict], path: str) -> None:
    """One panel per shape: time against T, log-log. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = ordered(results)
    shapes = list(dict.fromkeys(Shape(**r["shape"]).label() for r in results))
    cols = min(3, len(shapes))
    rows = math.ceil(len(shapes) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, shape in zip(axes.flat, shapes):
        for label, key, color, style in PLOT_LINES:
            points = [(r["seqlen"], r["times_ms"].get(key)) for r in results
                      if Shape(**r["shape"]).label() == shape and r["times_ms"].get(key) is not None]
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", color=color, linestyle=style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"Hq/Hkv, Dqk/Dv = {shape}", fontsize=10)
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shapes):]:
        ax.set_visible(False)
    fig.suptitle(f"sparseattn NSA vs SDPA: {meta['gpu']}, {meta['dtype']}, commit {meta['commit']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(stem: str, meta: dict, results: list[dict], with_plot: bool) -> list[str]:
    """Writes stem.json, stem.md and (with_plot, if matplotlib is there) stem.png; returns the paths written.
    Creates the output folder (only here: not at import, for --help or a run that stops before its first case)."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, results))
    written = [stem + ".json", stem + ".md"]
    if with_plot:
        try:
            plot(meta, results, stem + ".png")
            written.append(stem + ".png")
        except ImportError as error:
            print(f"no plot ({error}); pip install matplotlib, then rerun with --from-json {stem}.json")
    return written


# ---------------------------------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="Hq/Hkv/Dqk/Dv")
    parser.add_argument("--seqlens", nargs="+", type=parse_seqlen, default=SEQLENS, help="e.g. 8192, 8K or 1M")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--inputs", choices=INPUTS, default="random",
                        help="q and k: independent random tokens, or tokens drifting along the sequence "
                             "(locality: neighbouring queries select alike; see drifting_tokens)")
    parser.add_argument("--out", default="bench/results", help="folder for the JSON, markdown and PNG files")
    parser.add_argument("--stages", action=argparse.BooleanOptionalAction, default=True,
                        help="also time every NSA stage's forward on its own")
    parser.add_argument("--kernels", action="store_true",
                        help="also record the GPU time of every kernel of one NSA fwd+bwd (torch.profiler)")
    parser.add_argument("--time-budget-s", type=float, default=None,
                        help="wall-clock seconds the run should fit in: fewer timed runs per measurement, and "
                             "cases not started in time are recorded as skipped")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="timed milliseconds per measurement")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="untimed milliseconds before timing")
    parser.add_argument("--max-reps", type=int, default=100, help="most timed runs per measurement")
    parser.add_argument("--from-json", metavar="JSON",
                        help="rewrite the markdown and plot of an earlier run into --out (no GPU needed)")
    return parser.parse_args(argv)


def git_commit() -> str:
    """The commit the reports name: SPARSEATTN_COMMIT when set (a copy of the tree whose .git is stale or absent, as on
    the GPU machines), else git's HEAD, else "unknown"."""
    if os.environ.get("SPARSEATTN_COMMIT"):
        return os.environ["SPARSEATTN_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report_stem(out: str, meta: dict) -> str:
    inputs = "" if meta.get("inputs", "random") == "random" else f"_{meta['inputs']}"
    return os.path.join(out, f"{meta['gpu'].replace(' ', '_')}_{meta['date']}_{meta['commit']}{inputs}")


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        written = write_reports(report_stem(args.out, saved["meta"]), saved["meta"], saved["results"], with_plot=True)
        print("wrote " + ", ".join(written))
        return
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU")
    config = NSAConfig(window=args.window)
    dtype = getattr(torch, args.dtype)
    started = time.monotonic()
    timer = Timer(args.rep_ms, args.warmup_ms, args.max_reps, args.time_budget_s)
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": git_commit(),
            "torch": torch.__version__, "dtype": args.dtype, "inputs": args.inputs, "config": asdict(config),
            "timing": {"rep_ms": args.rep_ms, "warmup_ms": args.warmup_ms, "max_reps": args.max_reps,
                       "time_budget_s": args.time_budget_s, "stages": args.stages,
                       "kernels": args.kernels}}
    stem = report_stem(args.out, meta)
    cases = [(seqlen, Shape.parse(text)) for seqlen in args.seqlens for text in args.shapes]
    results = []
    for index, (seqlen, shape) in enumerate(cases):
        if timer.out_of_time():
            result = summarize({"shape": asdict(shape), "seqlen": seqlen, "times_ms": {}, "reps": {},
                                "peak_memory_gb": {}, "errors": {"case": "skipped: time budget exhausted"}},
                               shape, seqlen, config)
        else:
            timer.measurements_left = (len(cases) - index) * measurements_per_case(args.stages)
            result = run_case(shape, seqlen, dtype, config, timer, args.stages, args.kernels, args.inputs)
        results.append(result)
        torch.cuda.empty_cache()
        meta["wall_s"] = round(time.monotonic() - started, 1)
        write_reports(stem, meta, results, with_plot=False)
        print(f"[{meta['wall_s']:.0f} s] {shape.label()} T={seqlen_label(seqlen)}: NSA fwd "
              f"{time_cell(result, 'nsa_fwd')} ms, fwd+bwd {time_cell(result, 'nsa_fwd_bwd')} ms; cuDNN fwd "
              f"{time_cell(result, 'sdpa_cudnn_fwd')} ms, fwd+bwd {time_cell(result, 'sdpa_cudnn_fwd_bwd')} ms",
              flush=True)
    written = write_reports(stem, meta, results, with_plot=True)
    print(markdown(meta, results))
    print("wrote " + ", ".join(written))


if __name__ == "__main__":
    main()
