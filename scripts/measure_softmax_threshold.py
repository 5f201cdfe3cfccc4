"""Kernel times of flash_attention's softmax threshold on CUDA against the dense kernels of the same build: one
forward+backward of each, after a warm-up, under torch.profiler (GPU time per kernel group, summed over the calls
of one step), plus fwd and fwd+bwd wall times (CUDA events, median), the fraction of the visible (query tile, key
tile) pairs the threshold kept (the forward's recorded decisions) and the largest difference of o from the dense
call's.

Inputs: random bf16 q, k, v (logits of about unit spread: the threshold skips little, which shows its cost), or
with --levels each key tile of a KV head gets its own logit level, --gap apart in a random order (q and k share a
component that sets it), so that the threshold skips most tiles below the running maximum (which shows what it
saves: the forward still computes every visible tile's scores, the backward skips the skipped ones).

    python scripts/measure_softmax_threshold.py [--seqlen 16K] [--heads 32/8] [--dim 128] [--tau 0.05]
        [--causal/--no-causal] [--levels] [--gap 4]
"""
import argparse

import torch

import sparseattn as sa
from flash_kernel_timing import KERNELS, kernel_ms, wall_ms
from sparseattn import _ops
from sparseattn.bench import parse_seqlen


def inputs(t, hq, hkv, d, levels, gap, block_k):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, t, hq, d, device="cuda", generator=gen)
    k = torch.randn(1, t, hkv, d, device="cuda", generator=gen)
    v = torch.randn(1, t, hkv, d, device="cuda", generator=gen)
    if levels:
        scale, anchor = d ** -0.5, 2.0
        q, k = 0.3 * q, 0.3 * k
        q[..., 0] = anchor
        n_tiles = -(-t // block_k)
        for h in range(hkv):
            order = torch.randperm(n_tiles, device="cuda", generator=gen).float()
            k[0, :, h, 0] = (-gap * order).repeat_interleave(block_k)[:t] / (anchor * scale)
    q, k, v = (x.to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    d_o = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v, d_o


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=parse_seqlen, default=16384)
    parser.add_argument("--heads", default="32/8")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--tau", type=float, default=0.05)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--levels", action="store_true", help="key tiles at distinct logit levels (see above)")
    parser.add_argument("--gap", type=float, default=4.0, help="--levels: logit gap between the tiles' levels")
    args = parser.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("/"))
    t, d = args.seqlen, args.dim
    probe = torch.empty(1, 1, 1, d, device="cuda", dtype=torch.bfloat16)
    tiles = tuple(sa._C.flash_attention_threshold_tiles(probe, probe))
    q, k, v, d_o = inputs(t, hq, hkv, d, args.levels, args.gap, tiles[1])
    kw = dict(causal=args.causal)
    cases = {
        "dense": lambda: sa.flash_attention(q, k, v, **kw),
        f"softmax_threshold {args.tau:g}": lambda: sa.flash_attention(q, k, v, softmax_threshold=args.tau,
                                                                      threshold_block=tiles, **kw),
    }
    with torch.no_grad():
        _, _, decisions = _ops.flash_attention_with_decisions(
            q, k, v, None, None, None, None, 0, 0, args.causal, -1, -1, None, softmax_threshold=args.tau,
            threshold_block_q=tiles[0], threshold_block_k=tiles[1])
        # visible pairs: under causal masking (T = S), key tile kt holds a key of query tile qt's last row or before
        last_row = (torch.arange(decisions.shape[-2], device="cuda")[:, None] + 1) * tiles[0] - 1
        first_key = torch.arange(decisions.shape[-1], device="cuda")[None, :] * tiles[1]
        visible = first_key <= last_row.clamp_max(t - 1) if args.causal else torch.ones_like(first_key + last_row,
                                                                                             dtype=torch.bool)
        kept = float(decisions.float().sum() / (visible.sum() * decisions.shape[0] * decisions.shape[1]))
        diff = (cases["dense"]().float() - list(cases.values())[1]().float()).abs().max().item()
    print(f"{torch.cuda.get_device_name()}, bf16, {hq}/{hkv} heads, D {d}, T {t}, "
          f"{'causal' if args.causal else 'not causal'}, batch 1, {'leveled' if args.levels else 'random'} inputs; "
          f"threshold tiles {tiles[0]}x{tiles[1]}, {kept:.4f} of the visible pairs kept, "
          f"max |o - o_dense| {diff:.3g}")
    print("| case | forward | dQ | dK/dV | kernels fwd+bwd | wall fwd | wall fwd+bwd |\n|---|---|---|---|---|---|---|")
    results = {}
    for name, fn in cases.items():
        def step(fn=fn):
            torch.autograd.grad(fn(), (q, k, v), d_o)

        def forward(fn=fn):
            with torch.no_grad():
                fn()
        kernels = kernel_ms(step)
        results[name] = (kernels, wall_ms(forward), wall_ms(step))
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in kernels.values())
              + f" | {sum(kernels.values()):.2f} | {results[name][1]:.2f} | {results[name][2]:.2f} |", flush=True)
    (dense, dense_fwd, dense_step), (thr, thr_fwd, thr_step) = results.values()
    print("threshold / dense: " + ", ".join(f"{g} {thr[g] / dense[g]:.3f}" for g in KERNELS)
          + f", kernels fwd+bwd {sum(thr.values()) / sum(dense.values()):.3f}, wall fwd {thr_fwd / dense_fwd:.3f}"
          + f", wall fwd+bwd {thr_step / dense_step:.3f}")


if __name__ == "__main__":
    main()
