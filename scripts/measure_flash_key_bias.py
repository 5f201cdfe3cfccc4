"""Kernel times of flash_attention with a key bias [B, Hkv, 1, T] (and its gradient) against the dense causal kernels
of the same build: one forward+backward of each, after a warm-up, under torch.profiler (GPU time per kernel, summed
over the calls of one step; the bias gradient's reduction separately), plus fwd+bwd wall times (CUDA events,
median) and the ratios to dense (the issue's bar: key bias fwd+bwd <= 1.25 x dense at 16K).

    python scripts/measure_flash_key_bias.py [--seqlen 16K] [--heads 32/8] [--dim 128] [--mma sync]
"""
import argparse
import os

import torch

import sparseattn as sa
from flash_kernel_timing import KERNELS, kernel_ms, wall_ms
from sparseattn.bench import parse_seqlen


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=parse_seqlen, default=16384)
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--mma", choices=["auto", "sync"], default="auto", help="sync: the mma.sync kernels")
    args = parser.parse_args()
    if args.mma == "sync":
        os.environ["SPARSEATTN_ATTENTION_MMA"] = "sync"
    hq, hkv = (int(x) for x in args.heads.split("/"))
    t, d = args.seqlen, args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
               for h in (hq, hkv, hkv))
    d_o = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    bias = torch.randn(1, hkv, 1, t, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    cases = {
        "dense causal": ((q, k, v), lambda: sa.flash_attention(q, k, v, causal=True)),
        "key bias with dbias": ((q, k, v, bias), lambda: sa.flash_attention(q, k, v, causal=True, bias=bias)),
    }
    print(f"{torch.cuda.get_device_name()}, bf16, {hq}/{hkv} heads, D {d}, T {t}, causal, batch 1, "
          f"kernels: {args.mma}")
    print("| case | forward | dQ | dK/dV | dbias reduce | kernels fwd+bwd | wall fwd | wall fwd+bwd |\n"
          "|---|---|---|---|---|---|---|---|")
    results = {}
    for name, (inputs, fn) in cases.items():
        def step(fn=fn, inputs=inputs):
            torch.autograd.grad(fn(), inputs, d_o)

        def forward(fn=fn):
            with torch.no_grad():
                fn()
        kernels = kernel_ms(step, extra={"dbias reduce": "bias_gradient_reduce"})
        results[name] = (kernels, wall_ms(forward), wall_ms(step))
        total = sum(kernels.values())
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in kernels.values())
              + f" | {total:.2f} | {results[name][1]:.2f} | {results[name][2]:.2f} |", flush=True)
    (dense, dense_fwd, dense_step), (biased, biased_fwd, biased_step) = results.values()
    print("key bias / dense: " + ", ".join(f"{g} {biased[g] / dense[g]:.3f}" for g in KERNELS)
          + f", kernels fwd+bwd {sum(biased.values()) / sum(dense.values()):.3f}"
          + f", wall fwd {biased_fwd / dense_fwd:.3f}, wall fwd+bwd {biased_step / dense_step:.3f}")


if __name__ == "__main__":
    main()
