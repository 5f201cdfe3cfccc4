"""A/B of two builds of sparseattn on one GPU: the GPU time of every kernel of one NSA forward+backward, the wall time
of the whole call, and a checksum of the output and of every gradient, so that two builds can be compared kernel by
kernel and checked to give the same bits.

    python scripts/ab_kernels.py run LABEL OUT.json [CASE ...]     # one build: whichever sparseattn Python imports
    python scripts/ab_kernels.py report A1.json B1.json [A2.json B2.json ...]

A CASE is Hq/Hkv@T:inputs, e.g. 64/4@65536:random or 64/4@65536:drifting (D = 128, bf16, batch 1, NSA defaults; the
inputs as in sparseattn.bench, drawn from a fixed seed, so every run sees the same tensors). `run` profiles three
forward+backward calls after a warm-up one (kernel ms: their mean) and times the call with the benchmark's Timer; the
inputs and the timer come from the build's sparseattn.bench (revisions from 2026-11-27 on). `report` takes the runs
in pairs (A, B, A, B, ...: alternate the builds, each run a fresh process) and prints, per case, whether every run's
checksums agree, the wall and kernel totals of each run, and the mean of each kernel over the A runs and over the B
runs with the change in percent. scripts/gpu_ab.sh builds both and runs this.
"""
from __future__ import annotations

import json
import statistics
import sys

DEFAULT_CASES = ["64/4@65536:random", "64/4@65536:drifting", "32/8@65536:random", "32/32@65536:random"]


def parse_case(text: str) -> tuple[int, int, int, str]:
    """'64/4@65536:random' -> (64, 4, 65536, 'random')."""
    heads, rest = text.split("@")
    seqlen, inputs = rest.split(":")
    heads_q, heads_kv = (int(x) for x in heads.split("/"))
    if inputs not in ("random", "drifting"):
        raise SystemExit(f"ab_kernels: inputs must be random or drifting, not {inputs!r} (case {text!r})")
    return heads_q, heads_kv, int(seqlen), inputs


def checksum(tensor) -> int:
    """A position-weighted sum of the tensor's 16-bit patterns: equal for equal bits, almost surely different
    otherwise. Computed on the GPU, so a 1 GB gradient costs no copy."""
    import torch

    bits = tensor.detach().contiguous().view(-1).view(torch.int16).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) * 2654435761 % 1000003 + 1
    return int((bits * weights).sum().item())


def nsa_inputs(heads_q: int, heads_kv: int, seqlen: int, inputs: str):
    """The leaves of an NSA call (q, k, v and the three gates, requiring gradients) and d_o: D = 128, bf16, batch 1,
    drawn on the GPU from a fixed seed (q and k as sparseattn.bench's drifting tokens where inputs is "drifting")."""
    import torch

    from sparseattn.bench import drifting_tokens

    generator = torch.Generator(device="cuda")
    generator.manual_seed(1234)

    def normal(heads):
        return torch.randn(1, seqlen, heads, 128, device="cuda", generator=generator).bfloat16()

    if inputs == "drifting":
        q = drifting_tokens(seqlen, heads_q, 128, generator=generator)
        k = drifting_tokens(seqlen, heads_kv, 128, generator=generator)
    else:
        q, k = normal(heads_q), normal(heads_kv)
    v = normal(heads_kv)
    gates = [torch.rand(1, seqlen, heads_q, device="cuda", generator=generator).bfloat16() for _ in range(3)]
    d_o = normal(heads_q)
    return [t.requires_grad_() for t in (q, k, v, *gates)], d_o


def run(label: str, out: str, cases: list[str]) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sparseattn import NSAConfig, nsa_attention
    from sparseattn.bench import Timer, kernel_name

    timer = Timer(rep_ms=300, warmup_ms=50, max_reps=20)
    results = {}
    for case in cases:
        leaves, d_o = nsa_inputs(*parse_case(case))

        def forward_backward():
            out = nsa_attention(*leaves, config=NSAConfig())
            return (out, *torch.autograd.grad(out, leaves, d_o))

        sums = [checksum(t) for t in forward_backward()]
        # Profiled here rather than through the build's sparseattn.bench.kernel_times, so that both builds are
        # measured by the same code.
        forward_backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                forward_backward()
            torch.cuda.synchronize()
        kernels: dict[str, float] = {}
        for event in prof.key_averages():
            gpu_us = getattr(event, "device_time_total", 0.0)
            if gpu_us > 0:
                name = kernel_name(event.key)
                kernels[name] = kernels.get(name, 0.0) + gpu_us / 3000
        wall_ms = timer.measure(forward_backward)[0]
        results[case] = {"wall_ms": wall_ms, "kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
                         "kernels_total_ms": sum(kernels.values()), "checksums": sums}
        print(f"{label} {case}: wall {wall_ms:.2f} ms, kernels {sum(kernels.values()):.2f} ms", flush=True)
        del d_o, leaves
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


def report(a_runs: list[dict], b_runs: list[dict], min_ms: float = 0.2) -> str:
    """The comparison `report` prints, from the A runs and the B runs (dicts as `run` writes them)."""
    lines = []
    for case in a_runs[0]:
        runs = [r for r in a_runs + b_runs if case in r]
        same = all(r[case]["checksums"] == runs[0][case]["checksums"] for r in runs)
        lines.append(f"## {case}: outputs and gradients {'bit for bit equal' if same else 'DIFFER'}")
        for key, title in (("wall_ms", "wall"), ("kernels_total_ms", "kernels")):
            a = " ".join(f"{r[case][key]:.2f}" for r in a_runs if case in r)
            b = " ".join(f"{r[case][key]:.2f}" for r in b_runs if case in r)
            lines.append(f"{title} ms: A {a} | B {b}")
        names = list(dict.fromkeys(n for r in runs for n in r[case]["kernels_ms"]))
        rows = []
        for name in names:
            a = statistics.mean(r[case]["kernels_ms"].get(name, 0.0) for r in a_runs if case in r)
            b = statistics.mean(r[case]["kernels_ms"].get(name, 0.0) for r in b_runs if case in r)
            if max(a, b) >= min_ms:
                change = f"{100 * (b / a - 1):+6.1f}%" if a > 0 else "    new"
                rows.append((-a, f"  {a:8.3f} {b:8.3f} {change}  {name}"))
        lines += [row for _, row in sorted(rows)]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and argv[0] == "run":
        run(argv[1], argv[2], argv[3:] or DEFAULT_CASES)
    elif len(argv) >= 3 and argv[0] == "report" and len(argv[1:]) % 2 == 0:
        loaded = []
        for path in argv[1:]:
            with open(path) as f:
                loaded.append(json.load(f))
        print(report(loaded[0::2], loaded[1::2]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
