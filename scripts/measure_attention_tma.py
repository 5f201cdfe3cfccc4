"""Kernel times of the wgmma attention forward (and, with --backward, of the dQ and dK/dV kernels) with their TMA
producers (SPARSEATTN_ATTENTION_TMA=1) against their cp.async producers (the switch at 0): NSA's compressed attention
and sliding window (64/4 heads, D = 128, batch 1, at T = 64K and 8K by default) and flash_attention's dense causal
call (32/8 heads at 16K). GPU time under torch.profiler per call (mean of --reps calls after a warm-up) of the forward
kernel (profiler names holding "attention_forward"), of the dQ kernel (names holding "attention_dq", timed in a
forward and backward call) or of the dK/dV kernel (names holding "attention_dkv" but not the head splits' reduction,
"reduce"; timed in a forward and backward call at each head-dim pair of --dkv-dims: at 128/128 its TMA variant's
consumers take turns instead of overlapping their own update, WgmmaDkvTmaTile::kOverlapsUpdate), the two producers
alternated --rounds times and averaged; TFLOP/s from the visible (query, key) pairs (forward 4 D flops each: Q K^T
and P V; dQ 6 D: Q K^T, dO V^T and dS K; dK/dV 8 D: K Q^T, V dO^T, P^T dO and dS^T Q, with D the mean of Dqk and
Dv). The last column names the kernel that ran with the switch on (attention_forward_wgmma_tma_kernel,
attention_dq_wgmma_tma_kernel, attention_dkv_wgmma_tma_kernel where the TMA producer was taken).

    python scripts/measure_attention_tma.py [--seqlens 64K,8K] [--heads 64/4] [--dim 128] [--window 512]
        [--flash-seqlen 16K] [--flash-heads 32/8] [--reps 5] [--rounds 2] [--backward]
        [--dkv-dims 128/128,64/64,192/128]
"""
import argparse
import os

import torch
from torch.profiler import ProfilerActivity, profile

import sparseattn as sa
from sparseattn.bench import kernel_name, parse_seqlen

SWITCH = "SPARSEATTN_ATTENTION_TMA"


def kernel_ms(fn, reps, part, exclude=None):
    """GPU ms per call of fn's kernels whose name holds `part` and not `exclude` (one warm-up call first), and their
    names."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total, names = 0.0, set()
    for event in prof.key_averages():
        if part in event.key and (exclude is None or exclude not in event.key):
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


def forward_and_backward(op, q, k, v):
    """A call that runs op's forward and backward (gradients of q, k and v against a fixed d_o)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    d_o = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)

    def call():
        torch.autograd.grad(op(*leaves), leaves, d_o)
    return call


def forward_only(op, q, k, v):
    def call():
        with torch.no_grad():
            op(q, k, v)
    return call


def print_table(title, cases, part, reps, rounds, exclude=None):
    """One table: per case, the kernels holding `part` (and not `exclude`) with the switch at 0 and at 1 (cases: name,
    fn, flops)."""
    print(title)
    print("| case | cp.async ms | TMA ms | TMA / cp.async | cp.async TFLOP/s | TMA TFLOP/s | kernel with the switch on |")
    print("|---|---|---|---|---|---|---|")
    for name, fn, flops in cases:
        sums = {"0": 0.0, "1": 0.0}
        names = []
        for _ in range(rounds):
            for value in ("0", "1"):
                os.environ[SWITCH] = value
                ms, seen = kernel_ms(fn, reps, part, exclude)
                sums[value] += ms / rounds
                if value == "1":
                    names = seen
        base, tma = sums["0"], sums["1"]
        print(f"| {name} | {base:.3f} | {tma:.3f} | {tma / base:.3f} | {flops / base / 1e9:.0f} | "
              f"{flops / tma / 1e9:.0f} | {', '.join(names)} |", flush=True)


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
    parser.add_argument("--backward", action="store_true",
                        help="also time the dQ kernel (a second table) and the dK/dV kernel (a third)")
    parser.add_argument("--dkv-dims", default="128/128,64/64,192/128", help="Dqk/Dv pairs of the dK/dV table")
    args = parser.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    fq, fkv = (int(x) for x in args.flash_heads.split("/"))
    d, block, stride = args.dim, 32, 16
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)

    def make_cases(dqk, dv, suffix=""):
        """(name, op, (q, k, v), visible pairs of one head) of every case at head dims dqk and dv."""
        cases = []
        for t in (parse_seqlen(s) for s in args.seqlens.split(",")):
            q, k, v = randn(1, t, hq, dqk), randn(1, t, hkv, dqk), randn(1, t, hkv, dv)
            tc = (t - block) // stride + 1
            k_cmp, v_cmp = randn(1, tc, hkv, dqk), randn(1, tc, hkv, dv)
            label = f"{hq}/{hkv} T={t // 1024}K{suffix}"
            cases.append((f"compressed {label}", lambda q, k, v: sa.compressed_attention(q, k, v)[0],
                          (q, k_cmp, v_cmp), hq * compressed_pairs(t, block, stride)))
            cases.append((f"window {args.window} {label}",
                          lambda q, k, v: sa.flash_attention(q, k, v, causal=True, window=(args.window - 1, 0)),
                          (q, k, v), hq * window_pairs(t, args.window)))
        t = args.flash_seqlen
        q, k, v = randn(1, t, fq, dqk), randn(1, t, fkv, dqk), randn(1, t, fkv, dv)
        cases.append((f"flash causal {fq}/{fkv} T={t // 1024}K{suffix}",
                      lambda q, k, v: sa.flash_attention(q, k, v, causal=True), (q, k, v), fq * (t * (t + 1) // 2)))
        return cases

    cases = make_cases(d, d)

    previous = os.environ.get(SWITCH)
    print_table(f"{torch.cuda.get_device_name()}, bf16, D {d}, batch 1; forward kernel ms per call (mean of "
                f"{args.reps} calls, {args.rounds} alternating rounds)",
                [(name, forward_only(op, *tensors), 4 * d * pairs) for name, op, tensors, pairs in cases],
                "attention_forward", args.reps, args.rounds)
    if args.backward:
        print()
        print_table(f"{torch.cuda.get_device_name()}, bf16, D {d}, batch 1; dQ kernel ms per forward and backward "
                    f"call (mean of {args.reps} calls, {args.rounds} alternating rounds)",
                    [(name, forward_and_backward(op, *tensors), 6 * d * pairs) for name, op, tensors, pairs in cases],
                    "attention_dq", args.reps, args.rounds)
        del cases  # the dK/dV table's tensors take their place
        dkv_cases = []
        for dims in args.dkv_dims.split(","):
            dqk, dv = (int(x) for x in dims.split("/"))
            dkv_cases += [(name, forward_and_backward(op, *tensors), 4 * (dqk + dv) * pairs)
                          for name, op, tensors, pairs in make_cases(dqk, dv, f" {dqk}/{dv}")]
        print()
        print_table(f"{torch.cuda.get_device_name()}, bf16, batch 1; dK/dV kernel ms per forward and backward call "
                    f"(mean of {args.reps} calls, {args.rounds} alternating rounds)",
                    dkv_cases, "attention_dkv", args.reps, args.rounds, exclude="reduce")
    if previous is None:
        os.environ.pop(SWITCH, None)
    else:
        os.environ[SWITCH] = previous


if __name__ == "__main__":
    main()
