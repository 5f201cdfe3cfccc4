"""Timing helpers shared by the flash_attention measurement scripts (measure_flash_tiles.py,
measure_flash_key_bias.py, measure_softmax_threshold.py): GPU time per kernel group under torch.profiler and wall
time under CUDA events. Imported from the scripts' own folder (python puts it on sys.path when a script runs)."""
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

# flash_attention's kernel groups: a profiler name starting with void sparseattn::cuda::attention::<prefix> (the
# dK/dV head-split reductions excluded).
KERNELS = {"forward": "attention_forward", "dQ": "attention_dq", "dK/dV": "attention_dkv"}


def kernel_ms(step, reps=3, extra=None):
    """GPU ms of each kernel group (KERNELS, then `extra`: {group: a substring of the kernel name}) per call of
    step, after one warm-up call."""
    extra = extra or {}
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    totals = dict.fromkeys(list(KERNELS) + list(extra), 0.0)
    for event in prof.key_averages():
        for group, part in extra.items():
            if part in event.key:
                totals[group] += event.device_time_total / 1000 / reps
        for group, prefix in KERNELS.items():
            if event.key.startswith(f"void sparseattn::cuda::attention::{prefix}") and "reduce" not in event.key:
                totals[group] += event.device_time_total / 1000 / reps
    return totals


def wall_ms(step, reps=10):
    """Median wall ms of step (CUDA events), after one warm-up call."""
    step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
