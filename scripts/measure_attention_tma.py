"""Forward kernel times of the wgmma attention forward with its TMA producer (SPARSEATTN_ATTENTION_TMA=1) against
its cp.async producer (the switch at 0): NSA's compressed attention and sliding window (64/4 heads, D = 128, batch
1, at T = 64K and 8K by default) and flash_attention's dense causal forward (32/8 heads at 16K). GPU time of the
forward kernel under torch.profiler per call (mean of --reps calls after a warm-up), the two producers alternated
--rounds times and averaged; TFLOP/s from the visible (query, key) pairs (4 D flops each). The last column names the
kernel that ran with the switch on (attention_forward_wgmma_tma_kernel where the TMA producer was taken).

    python scripts/measure_attention_tma.py [--seqlens 64K,8K] [--heads 64/4] [--dim 128] [--window 512]
        [--flash-seqlen 16K] [--flash-heads 32/8] [--reps 5] [--rounds 2]
"""
import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

import sparseattn as sa
from sparseattn.bench import kernel_name, parse_seqlen

SWITCH = "SPARSEATTN_ATTENTION_TMA"


def forward_ms(fn, reps):
    """GPU ms per call of the attention forward kernels of fn (one warm-up call first), and their names."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total, names = 0.0, set()
    for event in prof.key_averages():
        if "attention_forward" in event.key:
            total += event.device_time_total / 1000 / reps
            names.add(kernel_name(event.key).split("<")[0])
    return total, sorted(names)


def compressed_pairs(t, block, stride):
    """Visible (query, compressed key) pairs of one head: query i sees the blocks that end at or before it."""
    i = torch.arange(t, dtype=torch.int64)
    return int(torch.where(i + 1 >= block, (i + 1 - block) // stride + 1, 0).sum())


def window_pairs(t, window):
    i = torch.arange(t, dtype=torch.int64)
    return int(torch.clamp(i + 1, max=window).sum())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="64K,8K")
    parser.add_argument("--heads", default="64/4")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--flash-seqlen", type=parse_seqlen, default=16384)
    parser.add_argument("--flash-heads", default="32/8")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    fq, fkv = (int(x) for x in args.flash_heads.split("/"))
    d, block, stride = args.dim, 32, 16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    cases = []  # (name, fn, flops)
    for t in (parse_seqlen(s) for s in args.seqlens.split(",")):
        q, k, v = randn(1, t, hq, d), randn(1, t, hkv, d), randn(1, t, hkv, d)
        tc = (t - block) // stride + 1
        k_cmp, v_cmp = randn(1, tc, hkv, d), randn(1, tc, hkv, d)
        label = f"{hq}/{hkv} T={t // 1024}K"
        cases.append((f"compressed {label}", lambda q=q, k=k_cmp, v=v_cmp: sa.compressed_attention(q, k, v),
                      4 * d * hq * compressed_pairs(t, block, stride)))
        cases.append((f"window {args.window} {label}",
                      lambda q=q, k=k, v=v: sa.flash_attention(q, k, v, causal=True, window=(args.window - 1, 0)),
                      4 * d * hq * window_pairs(t, args.window)))
    t = args.flash_seqlen
    q, k, v = randn(1, t, fq, d), randn(1, t, fkv, d), randn(1, t, fkv, d)
    cases.append((f"flash causal {fq}/{fkv} T={t // 1024}K", lambda: sa.flash_attention(q, k, v, causal=True),
                  4 * d * fq * (t * (t + 1) // 2)))

    print(f"{torch.cuda.get_device_name()}, bf16, D {d}, batch 1; forward kernel ms per call (mean of {args.reps} "
          f"calls, {args.rounds} alternating rounds)")
    print("| case | cp.async ms | TMA ms | TMA / cp.async | cp.async TFLOP/s | TMA TFLOP/s | kernel with the switch on |")
    print("|---|---|---|---|---|---|---|")
    previous = os.environ.get(SWITCH)
    for name, fn, flops in cases:
        sums = {"0": 0.0, "1": 0.0}
        names = []
        with torch.no_grad():
            for _ in range(args.rounds):
                for value in ("0", "1"):
                    os.environ[SWITCH] = value
                    ms, seen = forward_ms(fn, args.reps)
                    sums[value] += ms / args.rounds
                    if value == "1":
                        names = seen
        base, tma = sums["0"], sums["1"]
        print(f"| {name} | {base:.3f} | {tma:.3f} | {tma / base:.3f} | {flops / base / 1e9:.0f} | "
              f"{flops / tma / 1e9:.0f} | {', '.join(names)} |", flush=True)
    if previous is None:
        os.environ.pop(SWITCH, None)
    else:
        os.environ[SWITCH] = previous


if __name__ == "__main__":
    main()
