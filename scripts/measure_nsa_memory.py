"""Peak memory and time of one NSA forward+backward for each recompute mode of nsa_attention (the scale issue's
memory bars: T = 1M on one H200, half of today's peak at 512K, recomputation at most 15% of the fwd+bwd time at
256K).

    python scripts/measure_nsa_memory.py [--seqlens 256K 512K] [--modes none branches selected_and_window full]
                                         [--reps 3] [--shape 64/4/128/128] [--out DIR]

Batch 1, bf16, NSA defaults, random inputs. Per (T, mode), in one process, inputs allocated once:
  - peak: the most allocated during the forward and torch.autograd.grad of q, k, v and the gates, above what was
    allocated before (the inputs and d_o): the benchmark's "peak memory" (python -m sparseattn.bench); it includes
    the gradients the backward returns;
  - peak - grads: the same less the gradients' bytes (as large as q, k, v and the gates): the peak above the inputs
    and their gradients;
  - forward peak: the most allocated during the forward alone, above the inputs;
  - kept: what stays allocated between forward and backward besides the output (the op's workspace and what
    autograd saves; per token too);
  - fwd+bwd ms: median of --reps runs after the measured one (CUDA events), and its cost over mode "none".
A mode that runs out of memory is recorded as OOM and the run goes on. Writes nsa_memory.json and nsa_memory.md to
--out (default: the current directory).
"""
import argparse
import json
import os
import statistics

import torch

import sparseattn as sa
from sparseattn.bench import Shape, parse_seqlen, seqlen_label

GB = 1e9


def make_inputs(shape: Shape, seqlen: int, gen: torch.Generator):
    opts = dict(device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, seqlen, shape.heads_q, shape.dim_qk, generator=gen, **opts).requires_grad_()
    k = torch.randn(1, seqlen, shape.heads_kv, shape.dim_qk, generator=gen, **opts).requires_grad_()
    v = torch.randn(1, seqlen, shape.heads_kv, shape.dim_v, generator=gen, **opts).requires_grad_()
    gates = [torch.rand(1, seqlen, shape.heads_q, generator=gen, **opts).requires_grad_() for _ in range(3)]
    d_o = torch.randn(1, seqlen, shape.heads_q, shape.dim_v, generator=gen, **opts)
    return (q, k, v, *gates), d_o


def measure(inputs, d_o, mode: str, reps: int) -> dict:
    q, k, v, *gates = inputs
    grad_bytes = sum(t.numel() * t.element_size() for t in inputs)
    seqlen = q.shape[1]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = sa.nsa_attention(q, k, v, *gates, recompute=mode)
    torch.cuda.synchronize()
    forward_peak = torch.cuda.max_memory_allocated() - base
    kept = torch.cuda.memory_allocated() - base - o.numel() * o.element_size()
    grads = torch.autograd.grad(o, inputs, d_o)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del o, grads

    def forward_backward():
        torch.autograd.grad(sa.nsa_attention(q, k, v, *gates, recompute=mode), inputs, d_o)

    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward_backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"peak_gb": peak / GB, "peak_minus_grads_gb": (peak - grad_bytes) / GB,
            "forward_peak_gb": forward_peak / GB, "kept_gb": kept / GB, "kept_bytes_per_token": kept / seqlen,
            "peak_bytes_per_token": peak / seqlen, "fwd_bwd_ms": statistics.median(times), "times_ms": times}


def buffer_sizes(shape: Shape, seqlen: int, mode: str) -> dict:
    """Bytes per token of the op's workspace (kept), forward scratch and backward scratch (the C++ size queries)."""
    spec = {"q": ("bfloat16", (1, seqlen, shape.heads_q, shape.dim_qk)),
            "k": ("bfloat16", (1, seqlen, shape.heads_kv, shape.dim_qk)),
            "v": ("bfloat16", (1, seqlen, shape.heads_kv, shape.dim_v)),
            "g": ("bfloat16", (1, seqlen, shape.heads_q)), "o": ("bfloat16", (1, seqlen, shape.heads_q, shape.dim_v))}
    c = sa.NSAConfig()
    config = (c.cmp_block, c.cmp_stride, c.sel_block, c.num_selected, c.num_init, c.num_local, c.window, c.scale)
    queries = {"workspace": sa._C.nsa_workspace_size, "forward_scratch": sa._C.nsa_forward_scratch_size,
               "backward_scratch": sa._C.nsa_backward_scratch_size}
    return {name: query("cuda", 0, spec["q"], spec["k"], spec["v"], None, None, None, spec["g"], spec["g"], spec["g"],
                        spec["o"], None, None, 0, *config, recompute=mode) / seqlen
            for name, query in queries.items()}


def markdown(meta: dict, rows: list) -> str:
    lines = [f"{meta['device']}, torch {meta['torch']}, shape {meta['shape']}, bf16, batch 1, NSA defaults. GB = 1e9 "
             "bytes. peak: above the inputs and d_o, gradients included (the benchmark's); peak - grads: above the "
             "inputs and their gradients; cost: fwd+bwd time over mode none.", "",
             "| T | mode | peak GB | peak - grads GB | forward peak GB | kept GB (B/token) | fwd+bwd ms | cost |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sizes = r.get("buffer_bytes_per_token")
        if sizes and "error" not in r:
            r["sizes_text"] = ", ".join(f"{k} {v:,.0f}" for k, v in sizes.items())
        if "error" in r:
            lines.append(f"| {seqlen_label(r['seqlen'])} | {r['mode']} | {r['error']} | | | | | |")
            continue
        cost = "" if r.get("cost") is None else f"{100 * r['cost']:+.1f}%"
        lines.append(f"| {seqlen_label(r['seqlen'])} | {r['mode']} | {r['peak_gb']:.1f} "
                     f"| {r['peak_minus_grads_gb']:.1f} | {r['forward_peak_gb']:.1f} | {r['kept_gb']:.2f} ({r['kept_bytes_per_token']:,.0f}) "
                     f"| {r['fwd_bwd_ms']:.0f} | {cost} |")
    lines += ["", "Buffers of the op per token (bytes, from the C++ size queries):", ""]
    lines += [f"- T = {seqlen_label(r['seqlen'])}, {r['mode']}: {r['sizes_text']}" for r in rows if "sizes_text" in r]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", nargs="+", type=parse_seqlen, default=[262144, 524288])
    parser.add_argument("--modes", nargs="+", choices=("none", "branches", "selected_and_window", "full"),
                        default=["none", "branches", "selected_and_window"])
    parser.add_argument("--shape", type=Shape.parse, default=Shape.parse("64/4/128/128"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape.label(),
            "commit": os.environ.get("SPARSEATTN_COMMIT", "")}
    rows = []
    for seqlen in args.seqlens:
        inputs, d_o = make_inputs(args.shape, seqlen, torch.Generator(device="cuda").manual_seed(seqlen))
        baseline = None
        for mode in args.modes:
            row = {"seqlen": seqlen, "mode": mode}
            if mode != "full":
                row["buffer_bytes_per_token"] = buffer_sizes(args.shape, seqlen, mode)
            try:
                row.update(measure(inputs, d_o, mode, args.reps))
            except torch.OutOfMemoryError as error:
                row["error"] = "OOM"
                row["detail"] = str(error).splitlines()[0][:300]
            torch.cuda.empty_cache()
            if mode == "none" and "error" not in row:
                baseline = row["fwd_bwd_ms"]
            row["cost"] = None if baseline is None or "error" in row else row["fwd_bwd_ms"] / baseline - 1
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "nsa_memory.json"), "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
            with open(os.path.join(args.out, "nsa_memory.md"), "w") as f:
                f.write(markdown(meta, rows))
        del inputs, d_o
        torch.cuda.empty_cache()
    print(markdown(meta, rows))


if __name__ == "__main__":
    main()
