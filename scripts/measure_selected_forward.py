"""Times the CUDA forwards of selected_attention (query-outer per token and in its group form, KV-block-outer on
wgmma and on mma.sync) over group sizes, on NSA indices from select_blocks: the measurements behind the heuristic of
src/cuda/selection/forward_plan.h.

    python scripts/measure_selected_forward.py [--seqlens 16K 64K] [--groups 1 2 4 8 12 16 32]
"""
import argparse
import os

import torch
from triton.testing import do_bench

import sparseattn as sa
from sparseattn.bench import parse_seqlen

VARIANTS = {"query": {"SPARSEATTN_SELECTED_FORWARD": "query"},
            "group": {"SPARSEATTN_SELECTED_FORWARD": "group"},
            "kv wgmma": {"SPARSEATTN_SELECTED_FORWARD": "kv"},
            "kv mma.sync": {"SPARSEATTN_SELECTED_FORWARD": "kv", "SPARSEATTN_ATTENTION_MMA": "sync"}}


def nsa_indices(q, k, v, config):
    k_cmp, v_cmp = sa.compress_kv(k, v, block=config.cmp_block, stride=config.cmp_stride)
    _, lse = sa.compressed_attention(q, k_cmp, v_cmp, block=config.cmp_block, stride=config.cmp_stride)
    return sa.select_blocks(q, k_cmp, lse, cmp_block=config.cmp_block, cmp_stride=config.cmp_stride,
                            sel_block=config.sel_block, num_selected=config.num_selected, num_init=config.num_init,
                            num_local=config.num_local)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", nargs="+", type=parse_seqlen, default=[16384, 65536])
    parser.add_argument("--groups", nargs="+", type=int, default=[1, 2, 4, 8, 12, 16, 32])
    parser.add_argument("--heads-kv", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
    config = sa.NSAConfig()
    print(f"{torch.cuda.get_device_name()}, bf16, Hkv {args.heads_kv}, D {args.dim}, NSA defaults; forward ms "
          "(median); ratio: query-outer / KV-block-outer (wgmma)")
    print("| T | G | " + " | ".join(VARIANTS) + " | ratio |\n|---|---|" + "---|" * (len(VARIANTS) + 1))
    for seqlen in args.seqlens:
        for group in args.groups:
            gen = torch.Generator(device="cuda").manual_seed(seqlen + group)
            hq, hkv, d = group * args.heads_kv, args.heads_kv, args.dim
            q, k, v = (torch.randn(1, seqlen, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for h in (hq, hkv, hkv))
            with torch.no_grad():
                idx = nsa_indices(q, k, v, config)
                times = {}
                for name, env in VARIANTS.items():
                    os.environ.update(env)
                    times[name] = do_bench(lambda: sa.selected_attention(q, k, v, idx, block=config.sel_block),
                                           warmup=50, rep=200, return_mode="median")
                    for key in env:
                        del os.environ[key]
            print(f"| {seqlen // 1024}K | {group} | " + " | ".join(f"{t:.2f}" for t in times.values())
                  + f" | {times['query'] / times['kv wgmma']:.2f} |", flush=True)
            del q, k, v, idx
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
