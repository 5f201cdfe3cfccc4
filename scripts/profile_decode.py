"""GPU time of every kernel of one decode step (torch.profiler), for nsa_decode and flash_decode over the same paged
cache, at given contexts and batches: where a step's time goes, kernel by kernel (the launches' gaps are the rest
of a graph replay's time, which `python -m sparseattn.bench_inference --sections decode` measures).

    python scripts/profile_decode.py [--contexts 8K 128K] [--batches 1 64] [--heads 64/4] [--head-dim 128]
                                     [--methods nsa_decode flash_decode_paged]

bf16, NSA defaults, Tq = 1, random inputs; the median over --steps profiled steps (each after a warm-up step) of
each kernel's time. Prints one table per (batch, context).
"""
import argparse
import statistics

import torch

import sparseattn as sa
from sparseattn.bench import kernel_times, parse_seqlen
from sparseattn.bench_inference import decode_steps, random_gates


def median_kernel_us(step, steps):
    """{kernel name: median us per step} over `steps` profiled steps (bench.kernel_times, each after a warm-up)."""
    runs = [kernel_times(step) for _ in range(steps)]
    names = sorted({name for run in runs for name in run})
    return {name: 1000 * statistics.median(run.get(name, 0.0) for run in runs) for name in names}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", nargs="+", type=parse_seqlen, default=[8192, 131072])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--heads", default="64/4")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--methods", nargs="+", choices=["nsa_decode", "flash_decode_paged"],
                        default=["nsa_decode", "flash_decode_paged"])
    args = parser.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    config = sa.NSAConfig()
    for batch in args.batches:
        for context in args.contexts:
            if batch * context * hkv * args.head_dim * 4 > 40e9:
                continue
            opts = dict(device="cuda", dtype=torch.bfloat16)
            q = torch.randn(batch, 1, hq, args.head_dim, **opts)
            k = torch.randn(batch, context, hkv, args.head_dim, **opts)
            v = torch.randn(batch, context, hkv, args.head_dim, **opts)
            k_cmp, v_cmp = sa.compress_kv(k, v, block=config.cmp_block, stride=config.cmp_stride)
            gates = random_gates(batch, 1, hq, "cuda", torch.bfloat16)
            steps = decode_steps(q, k, v, gates, k_cmp, v_cmp, config)
            print(f"\n## B = {batch}, S = {context}, {args.heads}, D = {args.head_dim}")
            for method in args.methods:
                times = median_kernel_us(steps[method], args.steps)
                print(f"{method}: sum {sum(times.values()):.1f} us")
                for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
                    print(f"  {us:8.1f} us  {name[:110]}")
            del q, k, v, k_cmp, v_cmp
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
