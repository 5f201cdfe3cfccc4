"""Times context-parallel NSA (sparseattn.distributed.nsa_attention, zigzag, forward + backward, bf16) on the GPUs of
one host, next to the single-GPU sparseattn.nsa_attention on one shard's length and on the whole sequence.

    torchrun --nproc-per-node 2 scripts/measure_distributed_nsa.py [--tokens-per-gpu 64K] [--heads 16 1] [--dim 128]

Each rank holds --tokens-per-gpu tokens of a sequence of R times as many. Prints, from rank 0, the median over
--repeats steps (every rank waits at a barrier before each step) of the sharded forward and forward + backward,
the single-GPU times, and the peak memory of each.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

import sparseattn as sa
from sparseattn import distributed as sad
from sparseattn.bench import parse_seqlen, seqlen_label


def timed(step, repeats: int, barrier: bool) -> float:
    """Median milliseconds of `step` over `repeats` runs after one warm-up run."""
    times = []
    for i in range(repeats + 1):
        if barrier:
            dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-gpu", type=parse_seqlen, default=65536)
    parser.add_argument("--heads", nargs=2, type=int, default=[16, 1], metavar=("HQ", "HKV"))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--single-whole", action="store_true", help="also time one GPU on the whole sequence")
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = sa.NSAConfig()
    total = args.tokens_per_gpu * world
    hq, hkv, d = args.heads[0], args.heads[1], args.dim
    gen = torch.Generator(device="cuda").manual_seed(0)

    def inputs(tokens):
        q, k, v = (torch.randn(1, tokens, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                   for h in (hq, hkv, hkv))
        gates = [torch.sigmoid(torch.randn(1, tokens, hq, device="cuda", dtype=torch.bfloat16, generator=gen))
                 for _ in range(3)]
        leaves = [x.requires_grad_() for x in (q, k, v, *gates)]
        return leaves, torch.randn(1, tokens, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)

    rows = []

    def measure(name, fn, tokens, barrier):
        leaves, d_o = inputs(tokens)
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            forward = timed(lambda: fn(*leaves), args.repeats, barrier)
        both = timed(lambda: torch.autograd.grad(fn(*leaves), leaves, d_o), args.repeats, barrier)
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append((name, forward, both, peak))
        del leaves, d_o
        torch.cuda.empty_cache()

    tokens = sad.shard_lengths(total, world)[rank]
    measure(f"sharded, {world} GPUs, {seqlen_label(tokens)} tokens each",
            lambda *x: sad.nsa_attention(*x, config=config), tokens, True)
    if rank == 0:
        measure(f"one GPU, {seqlen_label(args.tokens_per_gpu)} tokens",
                lambda *x: sa.nsa_attention(*x, config=config), args.tokens_per_gpu, False)
        if args.single_whole:
            measure(f"one GPU, {seqlen_label(total)} tokens (the whole sequence)",
                    lambda *x: sa.nsa_attention(*x, config=config), total, False)
        print(f"{torch.cuda.get_device_name()} x {world}, bf16, T = {seqlen_label(total)}, Hq {hq}, Hkv {hkv}, "
              f"D {d}, NSA defaults, median of {args.repeats}")
        print("| call | forward ms | forward + backward ms | peak GiB (rank 0) |\n|---|---|---|---|")
        for name, forward, both, peak in rows:
            print(f"| {name} | {forward:.1f} | {both:.1f} | {peak:.1f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
