"""Kernel times of flash_attention's block-sparse tile map against the dense causal kernels of the same build: one
forward+backward of each, after a warm-up, under torch.profiler (GPU time per kernel, summed over the calls of
one step), with the bench's causal tile mask (sparseattn.bench_flash.causal_tile_mask: the diagonal tiles and
random ones below, --density of the causal tiles per KV head). Prints the forward, dQ and dK/dV kernel times,
fwd+bwd wall times (CUDA events, median) and the tile map's ratios to dense.

    python scripts/measure_flash_tiles.py [--seqlen 32K] [--heads 32/8] [--density 0.1] [--tile 128]
"""
import argparse

import torch

import sparseattn as sa
from flash_kernel_timing import KERNELS, kernel_ms, wall_ms
from sparseattn.bench import parse_seqlen
from sparseattn.bench_flash import causal_tile_mask


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=parse_seqlen, default=32768)
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--tile", type=int, default=128)
    args = parser.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    t, d = args.seqlen, args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
               for h in (hq, hkv, hkv))
    d_o = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    tiles = causal_tile_mask(-(-t // args.tile), hkv, args.density, 0).cuda()
    cases = {
        "dense causal": lambda: sa.flash_attention(q, k, v, causal=True),
        f"tile map {args.density:g}": lambda: sa.flash_attention(q, k, v, causal=True, block_mask=tiles,
                                                                 block_size=(args.tile, args.tile)),
    }
    print(f"{torch.cuda.get_device_name()}, bf16, {hq}/{hkv} heads, D {d}, T {t}, causal, batch 1; "
          f"tile map: {args.tile}x{args.tile} tiles, {float(tiles.float().mean()):.4f} of all tiles kept")
    print("| case | forward | dQ | dK/dV | kernels fwd+bwd | wall fwd | wall fwd+bwd |\n|---|---|---|---|---|---|---|")
    results = {}
    for name, fn in cases.items():
        def step(fn=fn):
            out = fn()
            torch.autograd.grad(out[0] if isinstance(out, tuple) else out, (q, k, v), d_o)
        def forward(fn=fn):
            with torch.no_grad():
                fn()
        kernels = kernel_ms(step)
        results[name] = (kernels, wall_ms(forward), wall_ms(step))
        total = sum(kernels.values())
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in kernels.values())
              + f" | {total:.2f} | {results[name][1]:.2f} | {results[name][2]:.2f} |", flush=True)
    (dense, dense_fwd, dense_step), (sparse, sparse_fwd, sparse_step) = results.values()
    print("tile map / dense: " + ", ".join(f"{g} {sparse[g] / dense[g]:.3f}" for g in KERNELS)
          + f", kernels fwd+bwd {sum(sparse.values()) / sum(dense.values()):.3f}, wall fwd {sparse_fwd / dense_fwd:.3f}"
          + f", wall fwd+bwd {sparse_step / dense_step:.3f}")


if __name__ == "__main__":
    main()
