"""Small cases of every CUDA kernel of sparseattn, forward and backward, for compute-sanitizer (scripts/sanitize.sh).

Not a pytest module (no assertions on values: the sanitizer tools are the check). Each case runs one operation
on small random inputs, forward and backward, synchronises, and prints ``case <name> ok`` so that a tool's
report can be placed between two cases of the log.

Levels:
  full     (memcheck): every head-dim pair of sparseattn.CUDA_HEAD_DIMS x both attention MMA paths (wgmma and
           mma.sync, SPARSEATTN_ATTENTION_MMA=sync) x group sizes 1, 3, 4, 8, 16, packed sequences of lengths 1,
           63, 65 and 700, batched ones too, bf16 (fp16 for group size 3, fp32 for the memory-bound ops); per
           configuration: compress_kv, compressed_attention, select_blocks, selected_attention with each forward
           (SPARSEATTN_SELECTED_FORWARD=query|group|kv) and each dQ (SPARSEATTN_SELECTED_DQ=query|group|kv),
           flash_attention (causal, sliding window, cross lengths), combine and nsa_attention (whose backward
           runs accumulate).
  reduced  (racecheck, synccheck, initcheck): the same operations and paths for every head-dim pair and both
           MMA paths, one group size per pair, shorter sequences (the selection configuration is shrunk so that
           the selected dK/dV still splits its segments into chunks and reduces them), and the group level.
  group    the selected forward's and dQ's group kernels alone, for every head-dim pair, on a sequence long enough
           that their rings of stages wrap (a stage refilled after its readers released it).

Options: --shard I/N runs every N-th case from the I-th (parallel sanitizer processes); --match SUBSTR keeps the
cases whose name contains SUBSTR; --list prints the case names; --kernels prints the names of the CUDA kernels the
cases launched (torch.profiler; run it without a sanitizer).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass

import torch

import sparseattn as sa

DEVICE = "cuda"
GROUPS = (1, 3, 4, 8, 16)
VARLEN = (1, 63, 65, 700)
# NSA configurations: the paper's defaults, and a small one whose selected dK/dV chunks are short (n * l' / 2 =
# 64 tokens), so that the reduced level's short sequences still exercise the chunk reduction.
NSA_DEFAULT = sa.NSAConfig()
NSA_SMALL = sa.NSAConfig(cmp_block=16, cmp_stride=8, sel_block=32, num_selected=4, num_init=1, num_local=1, window=48)


@contextlib.contextmanager
def env(**values):
    """Sets environment variables (None: unset) for the block; the C++ side reads them at each call."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True)
class Config:
    dqk: int
    dv: int
    group: int
    hkv: int
    dtype: torch.dtype
    mma: str          # "wgmma" (the default choice) or "sync" (SPARSEATTN_ATTENTION_MMA=sync)
    lengths: tuple    # packed sequence lengths, or () for the batched layout
    batch: int = 2    # batched layout: B x T
    seq: int = 65
    nsa: sa.NSAConfig = NSA_DEFAULT

    @property
    def name(self) -> str:
        dt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[self.dtype]
        layout = "packed" + "-".join(map(str, self.lengths)) if self.lengths else f"batched{self.batch}x{self.seq}"
        small = "-small" if self.nsa is NSA_SMALL else ""
        return f"{self.dqk}x{self.dv}-g{self.group}-hkv{self.hkv}-{dt}-{self.mma}-{layout}{small}"


class Inputs:
    """q, k, v (requires_grad), gates and the layout of one configuration."""

    def __init__(self, c: Config, seed: int):
        g = torch.Generator(device="cpu").manual_seed(seed)
        hq = c.group * c.hkv
        if c.lengths:
            n = sum(c.lengths)
            cu = [0]
            for length in c.lengths:
                cu.append(cu[-1] + length)
            self.cu = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
            self.max_len = max(c.lengths)
            lead = (n,)
        else:
            self.cu = None
            self.max_len = c.seq
            lead = (c.batch, c.seq)

        def rand(*shape, requires_grad=True):
            x = torch.randn(*shape, generator=g).to(device=DEVICE, dtype=c.dtype)
            return x.requires_grad_(requires_grad)

        self.q = rand(*lead, hq, c.dqk)
        self.k = rand(*lead, c.hkv, c.dqk)
        self.v = rand(*lead, c.hkv, c.dv)
        self.gates = [torch.sigmoid(torch.randn(*lead, hq, generator=g)).to(DEVICE, c.dtype).requires_grad_(True)
                      for _ in range(3)]
        self.gen = g
        self.c = c

    def like(self, t):
        return torch.randn(t.shape, generator=self.gen).to(device=t.device, dtype=t.dtype)


def backward(outputs, inputs, x: Inputs):
    """Gradients of random output cotangents w.r.t. the inputs that take part."""
    outputs = [o for o in outputs if o is not None and o.requires_grad]
    grads = torch.autograd.grad(outputs, inputs, [x.like(o) for o in outputs], allow_unused=True)
    return grads


# ------------------------------------------------------------------------------------------------- operations


def run_compress(x: Inputs):
    c = x.c.nsa
    kc, vc = sa.compress_kv(x.k, x.v, block=c.cmp_block, stride=c.cmp_stride, cu_seqlens=x.cu)
    backward([kc, vc], [x.k, x.v], x)


def compressed(x: Inputs):
    c = x.c.nsa
    kc, vc = sa.compress_kv(x.k.detach(), x.v.detach(), block=c.cmp_block, stride=c.cmp_stride, cu_seqlens=x.cu)
    kc.requires_grad_(True)
    vc.requires_grad_(True)
    o, lse = sa.compressed_attention(x.q, kc, vc, block=c.cmp_block, stride=c.cmp_stride, cu_seqlens=x.cu)
    return kc, vc, o, lse


def run_compressed(x: Inputs):
    kc, vc, o, _ = compressed(x)
    backward([o], [x.q, kc, vc], x)


def indices_of(x: Inputs):
    c = x.c.nsa
    kc, _, _, lse = compressed(x)
    return sa.select_blocks(x.q.detach(), kc.detach(), lse.detach(), cmp_block=c.cmp_block, cmp_stride=c.cmp_stride,
                            sel_block=c.sel_block, num_selected=c.num_selected, num_init=c.num_init,
                            num_local=c.num_local, cu_seqlens=x.cu)


def run_select(x: Inputs):
    indices_of(x)


def run_selected(x: Inputs, forward: str, dqs=("query", "group", "kv")):
    """The forward forced to `forward`, then one backward per dQ path (the dK/dV is shared)."""
    idx = indices_of(x)
    trace("select_blocks")
    with env(SPARSEATTN_SELECTED_FORWARD=forward):
        o, _ = sa.selected_attention(x.q, x.k, x.v, idx, block=x.c.nsa.sel_block, cu_seqlens=x.cu)
    trace(f"forward {forward}")
    d_o = x.like(o)
    for dq in dqs:
        with env(SPARSEATTN_SELECTED_DQ=dq):
            torch.autograd.grad([o], [x.q, x.k, x.v], [d_o], retain_graph=True)
        trace(f"backward, dQ {dq}")


def run_flash(x: Inputs):
    w = x.c.nsa.window
    for causal, window in ((True, (-1, -1)), (True, (w, 0)), (False, (-1, -1))):
        o = sa.flash_attention(x.q, x.k, x.v, causal=causal, window=window, cu_seqlens_q=x.cu,
                               max_seqlen_q=x.max_len if x.cu is not None else None)
        backward([o], [x.q, x.k, x.v], x)


def run_flash_cross(x: Inputs):
    """Batched only: fewer queries than keys (bottom-right causal alignment) and more queries than keys."""
    c = x.c
    for t, s in ((17, c.seq), (c.seq, 23)):
        q = x.q[:, :t].detach().clone().requires_grad_(True)
        k = x.k[:, :s].detach().clone().requires_grad_(True)
        v = x.v[:, :s].detach().clone().requires_grad_(True)
        for causal in (True, False):
            o = sa.flash_attention(q, k, v, causal=causal)
            backward([o], [q, k, v], x)


def run_combine(x: Inputs):
    shape = (*x.q.shape[:-1], x.c.dv)
    outs = [torch.randn(shape, generator=x.gen).to(DEVICE, x.c.dtype).requires_grad_(True) for _ in range(3)]
    o = sa.combine(*outs, *x.gates)
    backward([o], [*outs, *x.gates], x)
    o = sa.combine(outs[0], None, outs[2], x.gates[0], None, x.gates[2])  # a skipped branch
    backward([o], [outs[0], outs[2], x.gates[0], x.gates[2]], x)


def run_nsa(x: Inputs):
    o = sa.nsa_attention(x.q, x.k, x.v, *x.gates, config=x.c.nsa, cu_seqlens=x.cu,
                         max_seqlen=x.max_len if x.cu is not None else None)
    backward([o], [x.q, x.k, x.v, *x.gates], x)


def run_nsa_given(x: Inputs):
    """nsa_attention with user block indices and compressed K/V (their gradient paths)."""
    c = x.c.nsa
    idx = indices_of(x)
    kc, vc = sa.compress_kv(x.k.detach(), x.v.detach(), block=c.cmp_block, stride=c.cmp_stride, cu_seqlens=x.cu)
    kc.requires_grad_(True)
    vc.requires_grad_(True)
    o = sa.nsa_attention(x.q, x.k, x.v, *x.gates, config=c, k_cmp=kc, v_cmp=vc, block_indices=idx, cu_seqlens=x.cu)
    backward([o], [x.q, x.k, x.v, kc, vc, *x.gates], x)


OPS = {
    "compress_kv": run_compress,
    "compressed_attention": run_compressed,
    "select_blocks": run_select,
    "selected-query": lambda x: run_selected(x, "query"),
    "selected-group": lambda x: run_selected(x, "group"),
    "selected-kv": lambda x: run_selected(x, "kv"),
    "flash_attention": run_flash,
    "combine": run_combine,
    "nsa_attention": run_nsa,
}


# ------------------------------------------------------------------------------------------------------ cases


def configs(level: str):
    pairs = [tuple(p) for p in sa.CUDA_HEAD_DIMS]
    out = []
    if level == "full":
        for dqk, dv in pairs:
            for mma in ("wgmma", "sync"):
                for g in GROUPS:
                    hkv = 2 if g <= 4 else 1
                    dtype = torch.float16 if g == 3 else torch.bfloat16
                    out.append(Config(dqk, dv, g, hkv, dtype, mma, VARLEN))
                out.append(Config(dqk, dv, 4, 2, torch.bfloat16, mma, ()))  # batched
                out.append(Config(dqk, dv, 8, 1, torch.bfloat16, mma, (5, 130, 64), nsa=NSA_SMALL))
    elif level == "reduced":
        for i, (dqk, dv) in enumerate(pairs):
            for j, mma in enumerate(("wgmma", "sync")):
                g = GROUPS[(2 * i + j) % len(GROUPS)]
                dtype = torch.float16 if (i + j) % 4 == 3 else torch.bfloat16
                out.append(Config(dqk, dv, g, 1, dtype, mma, (1, 63, 130), nsa=NSA_SMALL))
        out.append(Config(64, 64, 2, 2, torch.bfloat16, "wgmma", (), batch=2, seq=40, nsa=NSA_SMALL))
        out.append(Config(64, 64, 2, 2, torch.bfloat16, "sync", (), batch=2, seq=40, nsa=NSA_SMALL))
    elif level == "group":
        for dqk, dv in pairs:
            out.append(Config(dqk, dv, 4, 1, torch.bfloat16, "wgmma", (1, 1100)))
    else:
        raise SystemExit(f"unknown level {level!r}")
    return out


def cases(level: str):
    """(name, function, configuration) triples, in a fixed order."""
    out = []
    for c in configs(level):
        if level == "group":
            out.append((f"{c.name}/selected-group-fwd", lambda x: run_selected(x, "group", dqs=()), c))
            out.append((f"{c.name}/selected-group-dq", lambda x: run_selected(x, "query", dqs=("group",)), c))
            continue
        for op, fn in OPS.items():
            out.append((f"{c.name}/{op}", fn, c))
        if not c.lengths:
            out.append((f"{c.name}/flash_cross", run_flash_cross, c))
        if c.group == 8 or level == "reduced":
            out.append((f"{c.name}/nsa_attention-given", run_nsa_given, c))
    if level == "reduced":
        out += cases("group")
    if level == "full":
        # The memory-bound ops in fp32 (their only fp32 kernels).
        c = Config(64, 64, 4, 2, torch.float32, "wgmma", VARLEN)
        out.append((f"{c.name}/compress_kv", run_compress, c))
        out.append((f"{c.name}/combine", run_combine, c))
    return out


def trace(what: str):
    """With SANITIZE_TRACE set: a step inside a case, after the GPU finished it (where a hang is)."""
    if os.environ.get("SANITIZE_TRACE"):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        print(f"  {what} done", flush=True)


def run_case(name, fn, c: Config, seed: int):
    print(f"begin {name}", flush=True)
    with env(SPARSEATTN_ATTENTION_MMA="sync" if c.mma == "sync" else None):
        x = Inputs(c, seed)
        fn(x)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print(f"case {name} ok", flush=True)


def kernel_names(level, selected):
    """Runs the cases under torch.profiler and returns the names of the CUDA kernels launched."""
    from torch.profiler import ProfilerActivity, profile

    names = set()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i, (name, fn, c) in enumerate(selected):
            run_case(name, fn, c, seed=i)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names.add(e.name)
    return names


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--level", default="full", choices=("full", "reduced", "group"))
    p.add_argument("--shard", default="0/1", help="I/N: run cases I, I+N, I+2N, ...")
    p.add_argument("--match", default="", help="only cases whose name contains this")
    p.add_argument("--list", action="store_true", help="print the case names and exit")
    p.add_argument("--kernels", default="", help="write the launched CUDA kernels' names to this file")
    p.add_argument("--device", default="cuda", help="cpu: run the cases on the CPU reference (checks this script)")
    a = p.parse_args()
    global DEVICE
    DEVICE = a.device
    shard, shards = (int(s) for s in a.shard.split("/"))
    selected = [(i, *t) for i, t in enumerate(cases(a.level)) if a.match in t[0]]
    selected = [t for t in selected if t[0] % shards == shard]
    if a.list:
        for _, name, _, _ in selected:
            print(name)
        return 0
    if DEVICE == "cuda" and (not torch.cuda.is_available() or not sa.built_with_cuda()):
        print("sanitize_cases: needs a CUDA GPU and a CUDA build of sparseattn", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"sanitize_cases: level {a.level}, shard {a.shard}: {len(selected)} cases on {where}", flush=True)
    if a.kernels:
        names = kernel_names(a.level, [(n, f, c) for _, n, f, c in selected])
        with open(a.kernels, "w") as f:
            f.write("\n".join(sorted(names)) + "\n")
        return 0
    for i, name, fn, c in selected:
        run_case(name, fn, c, seed=i)
    print(f"sanitize_cases: {len(selected)} cases done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
