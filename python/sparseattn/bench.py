"""The project's benchmark: sparseattn's NSA stages and pipeline against dense causal attention (PyTorch SDPA with
the cuDNN and flash backends), timed in the same process.

    python -m sparseattn.bench --shapes 64/4/128/128 32/8/128/128 --seqlens 8192 65536 --out bench/results

Timing: CUDA events through triton.testing.do_bench (warm-up, L2 flush between runs, median). A stage that has
no CUDA kernel in this build is reported as "unsupported", never timed on another device.

FLOP counts (multiply-adds x 2, causal halves counted exactly as the visible keys):
  dense causal forward      4 * Hq * D * T^2 / 2                 (D = (Dqk + Dv) / 2)
  compressed attention      4 * Hq * D * T * Tc / 2              (Tc = number of compressed blocks)
  selected attention        4 * Hq * D * T * n * l'
  sliding window            4 * Hq * D * T * w
  backward                  2.5 x the forward (FlashAttention's convention)
Effective TFLOP/s of NSA use the sum of its three branches.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

from . import _errors
from .functional import (NSAConfig, compress_kv, compressed_attention, flash_attention, nsa_attention,
                         select_blocks, selected_attention)


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


def time_ms(fn: Callable[[], object]) -> Optional[float]:
    """Median milliseconds of fn, or None when this build cannot run it on CUDA."""
    import triton.testing

    try:
        fn()
    except _errors.SparseAttnUnsupportedError:
        return None
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def peak_memory_gb(fn: Callable[[], object]) -> Optional[float]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    try:
        fn()
    except _errors.SparseAttnUnsupportedError:
        return None
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def nsa_flops(shape: Shape, seqlen: int, config: NSAConfig) -> dict[str, float]:
    dim = (shape.dim_qk + shape.dim_v) / 2
    tc = max(0, (seqlen - config.cmp_block) // config.cmp_stride + 1)
    per_key = 4 * shape.heads_q * dim * seqlen
    return {
        "compressed": per_key * tc / 2,
        "selected": per_key * config.num_selected * config.sel_block,
        "window": per_key * min(config.window, seqlen),
    }


def run_case(shape: Shape, seqlen: int, dtype: torch.dtype, config: NSAConfig) -> dict:
    device = "cuda"
    q = torch.randn(1, seqlen, shape.heads_q, shape.dim_qk, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, seqlen, shape.heads_kv, shape.dim_qk, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, seqlen, shape.heads_kv, shape.dim_v, device=device, dtype=dtype, requires_grad=True)
    gates = [torch.rand(1, seqlen, shape.heads_q, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
    d_o = torch.randn(1, seqlen, shape.heads_q, shape.dim_v, device=device, dtype=dtype)
    result: dict = {"shape": asdict(shape), "seqlen": seqlen, "times_ms": {}, "peak_memory_gb": {}}
    times = result["times_ms"]

    # Dense baselines: SDPA takes [B, H, T, D]; GQA through enable_gqa.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qd, kd, vd = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    d_od = d_o.transpose(1, 2)
    for name, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        def dense():
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True)

        def dense_fwd_bwd():
            dense().backward(d_od)

        try:
            times[f"{name}_fwd"] = time_ms(dense)
            times[f"{name}_fwd_bwd"] = time_ms(dense_fwd_bwd)
            result["peak_memory_gb"][name] = peak_memory_gb(dense_fwd_bwd)
        except RuntimeError as error:  # a backend that does not take this shape
            times[f"{name}_fwd"] = times[f"{name}_fwd_bwd"] = None
            result.setdefault("notes", []).append(f"{name}: {error}".splitlines()[0])

    # sparseattn stages, then the whole pipeline.
    c = config
    with torch.no_grad():
        times["compress_kv"] = time_ms(lambda: compress_kv(k, v, block=c.cmp_block, stride=c.cmp_stride))
        try:
            k_cmp, v_cmp = compress_kv(k, v, block=c.cmp_block, stride=c.cmp_stride)
        except _errors.SparseAttnUnsupportedError:
            k_cmp = v_cmp = None
        lse_cmp = indices = None
        if k_cmp is not None:
            times["compressed_attention"] = time_ms(
                lambda: compressed_attention(q, k_cmp, v_cmp, block=c.cmp_block, stride=c.cmp_stride))
            try:
                lse_cmp = compressed_attention(q, k_cmp, v_cmp, block=c.cmp_block, stride=c.cmp_stride)[1]
            except _errors.SparseAttnUnsupportedError:
                pass
        if lse_cmp is not None:
            select = lambda: select_blocks(q, k_cmp, lse_cmp, cmp_block=c.cmp_block, cmp_stride=c.cmp_stride,  # noqa: E731
                                           sel_block=c.sel_block, num_selected=c.num_selected, num_init=c.num_init,
                                           num_local=c.num_local)
            times["select_blocks"] = time_ms(select)
            try:
                indices = select()
            except _errors.SparseAttnUnsupportedError:
                pass
        if indices is not None:
            times["selected_attention"] = time_ms(lambda: selected_attention(q, k, v, indices, block=c.sel_block))
        times["sliding_window"] = time_ms(lambda: flash_attention(q, k, v, causal=True, window=(c.window - 1, 0)))

    def nsa():
        return nsa_attention(q, k, v, *gates, config=c)

    def nsa_fwd_bwd():
        nsa().backward(d_o)

    with torch.no_grad():
        times["nsa_fwd"] = time_ms(nsa)
    times["nsa_fwd_bwd"] = time_ms(nsa_fwd_bwd)
    result["peak_memory_gb"]["nsa"] = peak_memory_gb(nsa_fwd_bwd)

    flops = nsa_flops(shape, seqlen, c)
    nsa_forward_flops = sum(flops.values())
    dense_forward_flops = 4 * shape.heads_q * (shape.dim_qk + shape.dim_v) / 2 * seqlen * seqlen / 2
    result["flops"] = {"nsa_forward": nsa_forward_flops, "dense_forward": dense_forward_flops}

    def tflops(work, ms):
        return None if ms is None else work / (ms * 1e-3) / 1e12

    result["tflops"] = {
        "nsa_fwd": tflops(nsa_forward_flops, times["nsa_fwd"]),
        "nsa_fwd_bwd": tflops(3.5 * nsa_forward_flops, times["nsa_fwd_bwd"]),
        "sdpa_cudnn_fwd": tflops(dense_forward_flops, times.get("sdpa_cudnn_fwd")),
        "sdpa_cudnn_fwd_bwd": tflops(3.5 * dense_forward_flops, times.get("sdpa_cudnn_fwd_bwd")),
    }

    def ratio(dense_key, ours_key):
        dense_ms, ours_ms = times.get(dense_key), times.get(ours_key)
        return None if dense_ms is None or ours_ms is None else dense_ms / ours_ms

    result["ratio_vs_cudnn"] = {"fwd": ratio("sdpa_cudnn_fwd", "nsa_fwd"),
                                "fwd_bwd": ratio("sdpa_cudnn_fwd_bwd", "nsa_fwd_bwd")}
    return result


def fmt(value, digits=2) -> str:
    return "unsupported" if value is None else f"{value:.{digits}f}"


def markdown(meta: dict, results: list[dict]) -> str:
    lines = [f"# sparseattn benchmark: {meta['gpu']}, {meta['date']}, commit {meta['commit']}", "",
             f"dtype {meta['dtype']}, batch 1, causal; NSA config {meta['config']}. Times in ms (median); "
             "ratio = SDPA cuDNN time / sparseattn time.", "",
             "| Hq/Hkv, Dqk/Dv | T | cuDNN fwd | flash fwd | NSA fwd | ratio fwd | cuDNN fwd+bwd | flash fwd+bwd | "
             "NSA fwd+bwd | ratio fwd+bwd | NSA TFLOP/s fwd | peak GB NSA / cuDNN |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t, m = r["times_ms"], r["peak_memory_gb"]
        shape = Shape(**r["shape"]).label()
        lines.append(
            f"| {shape} | {r['seqlen']} | {fmt(t.get('sdpa_cudnn_fwd'))} | {fmt(t.get('sdpa_flash_fwd'))} | "
            f"{fmt(t['nsa_fwd'])} | {fmt(r['ratio_vs_cudnn']['fwd'])} | {fmt(t.get('sdpa_cudnn_fwd_bwd'))} | "
            f"{fmt(t.get('sdpa_flash_fwd_bwd'))} | {fmt(t['nsa_fwd_bwd'])} | {fmt(r['ratio_vs_cudnn']['fwd_bwd'])} | "
            f"{fmt(r['tflops']['nsa_fwd'], 0)} | {fmt(m.get('nsa'))} / {fmt(m.get('sdpa_cudnn'))} |")
    lines += ["", "Per-stage forward times (ms):", "",
              "| Hq/Hkv, Dqk/Dv | T | compress_kv | compressed_attention | select_blocks | selected_attention | "
              "sliding_window |", "|---|---|---|---|---|---|---|"]
    for r in results:
        t = r["times_ms"]
        lines.append(f"| {Shape(**r['shape']).label()} | {r['seqlen']} | " + " | ".join(
            fmt(t.get(s), 3) for s in ("compress_kv", "compressed_attention", "select_blocks",
                                      "selected_attention", "sliding_window")) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, key in (("SDPA cuDNN fwd+bwd", "sdpa_cudnn_fwd_bwd"), ("SDPA flash fwd+bwd", "sdpa_flash_fwd_bwd"),
                       ("sparseattn NSA fwd+bwd", "nsa_fwd_bwd"), ("sparseattn sliding window fwd", "sliding_window"),
                       ("SDPA cuDNN fwd", "sdpa_cudnn_fwd")):
        for shape in {Shape(**r["shape"]).label() for r in results}:
            points = [(r["seqlen"], r["times_ms"].get(key)) for r in results
                      if Shape(**r["shape"]).label() == shape and r["times_ms"].get(key) is not None]
            if points:
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", label=f"{label} ({shape})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("time (ms, median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["64/4/128/128", "32/8/128/128", "32/32/128/128",
                                                        "28/4/128/128", "64/4/192/128"],
                        help="Hq/Hkv/Dqk/Dv")
    parser.add_argument("--seqlens", nargs="+", type=int, default=[8192, 16384, 32768, 65536, 131072])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", default="bench/results", help="folder for the JSON, markdown and PNG files")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("the benchmark needs a CUDA GPU")
    config = NSAConfig(window=args.window)
    dtype = getattr(torch, args.dtype)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = os.environ.get("SPARSEATTN_COMMIT", "unknown")
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit,
            "torch": torch.__version__, "dtype": args.dtype, "config": asdict(config)}
    results = []
    for text in args.shapes:
        for seqlen in args.seqlens:
            result = run_case(Shape.parse(text), seqlen, dtype, config)
            results.append(result)
            t = result["times_ms"]
            print(f"{text} T={seqlen}: cuDNN fwd {fmt(t.get('sdpa_cudnn_fwd'))} ms, NSA fwd {fmt(t['nsa_fwd'])} ms, "
                  f"window fwd {fmt(t['sliding_window'])} ms", flush=True)
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{meta['gpu'].replace(' ', '_')}_{meta['date']}_{commit}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, results))
    plot(results, stem + ".png")
    print(markdown(meta, results))
    print(f"wrote {stem}.json, .md, .png")


if __name__ == "__main__":
    main()
