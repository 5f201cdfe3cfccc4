"""Times the selected-attention backward with each of its two CUDA dQ paths (query-outer, KV-block-outer on
wgmma) over group sizes, on NSA indices from select_blocks: the measurements behind the dQ heuristic of
src/cuda/selection/backward_plan.h. Both runs share everything but the dQ (the forward is timed out).

    python scripts/measure_selected_dq.py [--seqlens 16K 64K] [--groups 4 5 6 7 8 9 12 16]
"""
import argparse
import os

import torch
from triton.testing import do_bench

import sparseattn as sa
from sparseattn.bench import parse_seqlen

from measure_selected_forward import nsa_indices

PATHS = ("query", "kv")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", nargs="+", type=parse_seqlen, default=[16384, 65536])
    parser.add_argument("--groups", nargs="+", type=int, default=[4, 5, 6, 7, 8, 9, 12, 16])
    parser.add_argument("--heads-kv", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    config = sa.NSAConfig()
    print(f"{torch.cuda.get_device_name()}, bf16, Hkv {args.heads_kv}, D {args.dim}, NSA defaults; backward ms "
          "(median of fwd+bwd less fwd); ratio: query-outer / KV-block-outer dQ")
    print("| T | G | " + " | ".join(PATHS) + " | ratio |\n|---|---|" + "---|" * (len(PATHS) + 1))
    for seqlen in args.seqlens:
        for group in args.groups:
            gen = torch.Generator(device="cuda").manual_seed(seqlen + group)
            hq, hkv, d = group * args.heads_kv, args.heads_kv, args.dim
            q, k, v = (torch.randn(1, seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=gen,
                                   requires_grad=True) for h in (hq, hkv, hkv))
            d_o = torch.randn(1, seqlen, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            with torch.no_grad():
                idx = nsa_indices(q, k, v, config)
                forward = do_bench(lambda: sa.selected_attention(q, k, v, idx, block=config.sel_block),
                                   warmup=20, rep=100, return_mode="median")
            times = {}
            for path in PATHS:
                os.environ["SPARSEATTN_SELECTED_DQ"] = path
                step = lambda: torch.autograd.grad(sa.selected_attention(q, k, v, idx, block=config.sel_block)[0],
                                                   (q, k, v), d_o)
                times[path] = do_bench(step, warmup=10, rep=100, return_mode="median") - forward
                del os.environ["SPARSEATTN_SELECTED_DQ"]
            print(f"| {seqlen // 1024}K | {group} | " + " | ".join(f"{t:.2f}" for t in times.values())
                  + f" | {times['query'] / times['kv']:.2f} |", flush=True)
            del q, k, v, d_o, idx
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
