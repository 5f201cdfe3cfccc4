"""Checks that two builds of sparseattn compute the same thing on a CUDA GPU (a refactor's "no behaviour change").

    python scripts/compare_outputs.py --save old.pt    # with one build importable
    python scripts/compare_outputs.py --save new.pt    # with the other
    python scripts/compare_outputs.py --compare old.pt new.pt

`--save` runs every operation forward and backward on fixed random inputs (seeded; every head-dim pair of
sparseattn.CUDA_HEAD_DIMS, group sizes 1 to 16, batched and packed, each selected-attention forward and dQ path
forced through the environment switches) and stores the outputs and gradients. `--compare` prints, per entry,
whether the two are bitwise equal, else the largest absolute difference relative to the largest magnitude, and
exits non-zero when an entry differs by more than `--tolerance` (default 0: bitwise).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _grads(out, inputs, seed):
    gen = torch.Generator(device=out.device).manual_seed(seed)
    d_out = torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, d_out, allow_unused=True)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _inputs(gen, batch, lengths, hq, hkv, dqk, dv, dtype, device):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    if lengths is None:
        return rnd(batch[0], batch[1], hq, dqk), rnd(batch[0], batch[1], hkv, dqk), rnd(batch[0], batch[1], hkv, dv), None
    n = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=device)
    return rnd(n, hq, dqk), rnd(n, hkv, dqk), rnd(n, hkv, dv), cu


def run_all(device: str, quick: bool) -> dict[str, torch.Tensor]:
    import sparseattn

    results: dict[str, torch.Tensor] = {}
    gen = torch.Generator(device=device).manual_seed(1234)
    cases = []
    # The fallback serves builds from before sparseattn.CUDA_HEAD_DIMS existed.
    for dqk, dv in getattr(sparseattn, "CUDA_HEAD_DIMS", ((64, 64), (128, 128), (192, 128), (256, 256))):
        cases.append((f"d{dqk}v{dv}-16x1-batched", (1, 1000), None, 16, 1, dqk, dv))
        cases.append((f"d{dqk}v{dv}-8x2-packed", None, [700, 1, 65, 300], 8, 2, dqk, dv))
    cases += [("d128-4x4-batched", (2, 777), None, 4, 4, 128, 128),
              ("d128-12x4-packed", None, [63, 1200], 12, 4, 128, 128),
              ("d128-64x4-batched", (1, 4096), None, 64, 4, 128, 128)]
    if quick:  # a dry run of the script itself (e.g. on the CPU reference)
        cases = [("quick-batched", (1, 200), None, 4, 2, 64, 64), ("quick-packed", None, [1, 130, 65], 2, 1, 64, 64)]
    config = sparseattn.NSAConfig(window=128)
    for name, batch, lengths, hq, hkv, dqk, dv in cases:
        q, k, v, cu = _inputs(gen, batch, lengths, hq, hkv, dqk, dv, torch.bfloat16, device)
        shape = q.shape[:-1]
        gates = [torch.rand(shape, generator=gen, device=device).to(torch.bfloat16) for _ in range(3)]
        kw = {} if cu is None else {"cu_seqlens": cu}
        max_len = None if cu is None else int((cu[1:] - cu[:-1]).max())
        if cu is not None:
            kw["max_seqlen"] = max_len
        # The whole pipeline.
        ql, kl, vl = _leaves(q, k, v)
        o = sparseattn.nsa_attention(ql, kl, vl, *gates, config=config, **kw)
        results[f"{name}/nsa/o"] = o.detach()
        for label, g in zip("qkv", _grads(o, (ql, kl, vl), 1)):
            results[f"{name}/nsa/d{label}"] = g
        # Dense windowed attention.
        fkw = {} if cu is None else {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": max_len,
                                     "max_seqlen_k": max_len}
        ql, kl, vl = _leaves(q, k, v)
        o = sparseattn.flash_attention(ql, kl, vl, causal=True, window=(127, 0), **fkw)
        results[f"{name}/flash/o"] = o.detach()
        for label, g in zip("qkv", _grads(o, (ql, kl, vl), 2)):
            results[f"{name}/flash/d{label}"] = g
        # Compression, compressed attention and selection.
        ckw = {} if cu is None else {"cu_seqlens": cu}
        k_cmp, v_cmp = sparseattn.compress_kv(k, v, block=32, stride=16, **ckw)
        cmp_kw = {} if cu is None else {"cu_seqlens": cu, "cu_seqlens_cmp": sparseattn.compressed_cu_seqlens(cu, 32, 16)}
        ql, kcl, vcl = _leaves(q, k_cmp, v_cmp)
        o_cmp, lse_cmp = sparseattn.compressed_attention(ql, kcl, vcl, block=32, stride=16, **cmp_kw)
        results[f"{name}/cmp/o"] = o_cmp.detach()
        results[f"{name}/cmp/lse"] = lse_cmp.detach()
        for label, g in zip(("q", "k_cmp", "v_cmp"), _grads(o_cmp, (ql, kcl, vcl), 3)):
            results[f"{name}/cmp/d{label}"] = g
        idx = sparseattn.select_blocks(q, k_cmp, lse_cmp.detach(), cmp_block=32, cmp_stride=16, sel_block=64,
                                       num_selected=16, num_init=1, num_local=2, **cmp_kw)
        results[f"{name}/select/idx"] = idx
        skw = {} if cu is None else {"cu_seqlens": cu}
        for forward in ("query", "group", "kv"):
            for dq in ("query", "kv"):
                os.environ["SPARSEATTN_SELECTED_FORWARD"] = forward
                os.environ["SPARSEATTN_SELECTED_DQ"] = dq
                try:
                    ql, kl, vl = _leaves(q, k, v)
                    o_slc, lse_slc = sparseattn.selected_attention(ql, kl, vl, idx, block=64, **skw)
                    grads = _grads(o_slc, (ql, kl, vl), 4)
                except sparseattn.SparseAttnError as error:  # a path this shape does not take
                    print(f"{name} forward={forward} dq={dq}: {error}", file=sys.stderr)
                    continue
                finally:
                    os.environ.pop("SPARSEATTN_SELECTED_FORWARD", None)
                    os.environ.pop("SPARSEATTN_SELECTED_DQ", None)
                key = f"{name}/selected-{forward}-{dq}"
                results[f"{key}/o"] = o_slc.detach()
                results[f"{key}/lse"] = lse_slc.detach()
                for label, g in zip("qkv", grads):
                    results[f"{key}/d{label}"] = g
    if device == "cuda":
        torch.cuda.synchronize()
    return {key: value.cpu() for key, value in results.items()}


def compare(old: dict, new: dict, tolerance: float) -> int:
    worst = 0.0
    failures = 0
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            print(f"{key}: only in {'old' if key in old else 'new'}")
            failures += 1
            continue
        a, b = old[key], new[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            print(f"{key}: shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}")
            failures += 1
            continue
        if torch.equal(a, b):
            continue
        af, bf = a.double(), b.double()
        diff = ((af - bf).abs().max() / af.abs().max().clamp_min(1e-30)).item()
        worst = max(worst, diff)
        status = "differs" if diff > tolerance else "within tolerance"
        print(f"{key}: {status}, max |old - new| / max |old| = {diff:.3e}")
        failures += diff > tolerance
    equal = sum(1 for key in old if key in new and torch.equal(old[key], new[key]))
    print(f"{equal} of {len(set(old) | set(new))} entries bitwise equal; worst relative difference {worst:.3e}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save", metavar="FILE")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--tolerance", type=float, default=0.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="two small cases only")
    args = parser.parse_args()
    if args.save:
        torch.save(run_all(args.device, args.quick), args.save)
        return 0
    if args.compare:
        return compare(torch.load(args.compare[0]), torch.load(args.compare[1]), args.tolerance)
    parser.error("give --save or --compare")
    return 2


if __name__ == "__main__":
    sys.exit(main())
