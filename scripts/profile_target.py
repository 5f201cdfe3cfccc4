"""The calls that scripts/gpu_profile.sh profiles: one warm-up call, then one call between cudaProfilerStart and
cudaProfilerStop (so `ncu --profile-from-start off` records that call's kernels only).

    python scripts/profile_target.py attention HQ/HKV@T [--window LEFT] [--no-causal] [--dims DQK/DV] [--forward]
    python scripts/profile_target.py nsa HQ/HKV@T [--inputs random|drifting] [--forward]

`attention`: flash_attention forward and backward (bf16, batch 1; causal unless --no-causal, window (LEFT, 0) with
--window: 511 is NSA's sliding window); `nsa`: nsa_attention forward and backward with NSA defaults, D = 128, on
the inputs of scripts/ab_kernels.py (drifting: smoothly drifting q and k). --forward profiles the forward alone.
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_case(text: str) -> tuple[int, int, int]:
    """'64/4@65536' -> (64, 4, 65536)."""
    heads, seqlen = text.split("@")
    heads_q, heads_kv = (int(x) for x in heads.split("/"))
    return heads_q, heads_kv, int(seqlen)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("op", choices=["attention", "nsa"])
    parser.add_argument("case", type=parse_case, help="HQ/HKV@T, e.g. 64/4@65536")
    parser.add_argument("--window", type=int, default=-1, help="attention: the window's left extent (-1: none)")
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--dims", default="128/128", help="attention: DQK/DV")
    parser.add_argument("--inputs", choices=["random", "drifting"], default="random", help="nsa: q and k")
    parser.add_argument("--forward", action="store_true", help="the forward alone")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    import sparseattn

    heads_q, heads_kv, seqlen = args.case
    if args.op == "attention":
        generator = torch.Generator(device="cuda")
        generator.manual_seed(1234)

        def normal(heads, dim):
            return torch.randn(1, seqlen, heads, dim, device="cuda", generator=generator).bfloat16()

        dqk, dv = (int(x) for x in args.dims.split("/"))
        q, k, v, d_o = normal(heads_q, dqk), normal(heads_kv, dqk), normal(heads_kv, dv), normal(heads_q, dv)
        leaves = [t.requires_grad_() for t in (q, k, v)]

        window = (args.window, 0) if args.window >= 0 else (-1, -1)

        def forward():
            return sparseattn.flash_attention(*leaves, causal=args.causal, window=window)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ab_kernels import nsa_inputs  # the A/B's inputs, so that a profile sees the tensors an A/B times

        leaves, d_o = nsa_inputs(heads_q, heads_kv, seqlen, args.inputs)

        def forward():
            return sparseattn.nsa_attention(*leaves, config=sparseattn.NSAConfig())

    def call():
        if args.forward:
            with torch.no_grad():
                forward()
        else:
            torch.autograd.grad(forward(), leaves, d_o)

    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
