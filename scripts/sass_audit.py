"""Per kernel of a CUDA binary, what its SASS says about the tensor cores: HGMMA (wgmma) and HMMA (mma.sync)
instructions, R2UR moves, and the HGMMAs issued right after an R2UR (within two instructions), which wait on a
descriptor moved from an ordinary register into a uniform one (docs/architecture.md: descriptors belong in uniform
registers; a value the compiler does not know to be warp-uniform keeps them out).

    python scripts/sass_audit.py [BINARY] [--filter REGEX] [--all]

BINARY: a cubin, object or shared library (default: the installed sparseattn._C). Needs cuobjdump (with nvdisasm)
on PATH. Kernels without tensor-core instructions are left out unless --all. Run it on two builds' binaries and
compare the lines to see what a change did to the SASS.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

_ARCH = re.compile(r"code for (sm_\w+)")
_FUNCTION = re.compile(r"^\s+Function : (\S+)")
_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


@dataclass
class KernelCounts:
    hgmma: int = 0
    hmma: int = 0
    r2ur: int = 0
    hgmma_after_r2ur: int = 0


def opcode(instruction: str) -> str:
    """'@!P0 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24' -> 'HGMMA.64x64x16.F32.BF16'."""
    parts = _PREDICATE.sub("", instruction.strip()).split()
    return parts[0] if parts else ""


def audit(sass: str) -> dict[tuple[str, str], KernelCounts]:
    """Counts per (architecture, mangled function name) of cuobjdump -sass output, in the order they appear."""
    kernels: dict[tuple[str, str], KernelCounts] = {}
    counts, recent, arch = None, [], "?"
    for line in sass.splitlines():
        code = _ARCH.search(line)
        if code:
            arch = code.group(1)
            continue
        function = _FUNCTION.match(line)
        if function:
            counts, recent = kernels.setdefault((arch, function.group(1)), KernelCounts()), []
            continue
        instruction = _INSTRUCTION.match(line)
        if counts is None or not instruction:
            continue
        op = opcode(instruction.group(1))
        if op.startswith("HGMMA"):
            counts.hgmma += 1
            counts.hgmma_after_r2ur += any(r.startswith("R2UR") for r in recent[-2:])
        elif op.startswith("HMMA"):
            counts.hmma += 1
        elif op.startswith("R2UR"):
            counts.r2ur += 1
        recent.append(op)
    return kernels


def demangle(names: list[str]) -> list[str]:
    if not names or shutil.which("c++filt") is None:
        return names
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def default_binary() -> str:
    import sparseattn._C as extension

    return extension.__file__


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("binary", nargs="?", help="cubin, object or shared library (default: sparseattn._C)")
    parser.add_argument("--filter", default="", help="only kernels whose demangled name matches this regex")
    parser.add_argument("--all", action="store_true", help="also kernels without tensor-core instructions")
    args = parser.parse_args(argv)
    if shutil.which("cuobjdump") is None:
        print("sass_audit: cuobjdump is not on PATH", file=sys.stderr)
        return 1
    binary = args.binary or default_binary()
    sass = subprocess.run(["cuobjdump", "-sass", binary], capture_output=True, text=True, check=True).stdout
    kernels = audit(sass)
    pattern = re.compile(args.filter)
    print(f"{'arch':8} {'HGMMA':>5} {'after R2UR':>10} {'R2UR':>5} {'HMMA':>5}  kernel")
    names = demangle([name for _, name in kernels])
    for name, ((arch, _), counts) in zip(names, kernels.items()):
        if (counts.hgmma or counts.hmma or args.all) and pattern.search(name):
            print(f"{arch:8} {counts.hgmma:5d} {counts.hgmma_after_r2ur:10d} {counts.r2ur:5d} {counts.hmma:5d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
