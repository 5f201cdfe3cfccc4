#!/usr/bin/env bash
# On a GPU machine (as scripts/gpu_check.sh): build the package with CUDA kernels, run nsa_decode's CUDA tests (the
# compressed kernel's cases with 4 and 8 warps), then the GPU time of each decode kernel (scripts/profile_decode.py,
# nsa_decode only, ordinary launches) with SPARSEATTN_NSA_DECODE_WARPS=4 and =8 at 32K and 128K, batches 1 and 64,
# and the compressed kernel's time per case side by side. Fits one 7-minute device call on one H100/H200. Logs go to
# $OUT (or /tmp/sparseattn-gpu). Time limits per step (seconds): TEST_S, PROFILE_S (each of the two profiles).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
(cd tests/python && timeout "${TEST_S:-200}" python3 -m pytest -n 8 -q -rf test_cuda_nsa_decode.py \
  >"$out/tests.log" 2>&1)
echo "tests: rc $? at $(( $(date +%s) - start )) s"; tail -25 "$out/tests.log"
for warps in 4 8; do
  SPARSEATTN_DEPENDENT_LAUNCH=0 SPARSEATTN_NSA_DECODE_WARPS=$warps timeout "${PROFILE_S:-60}" \
    python3 scripts/profile_decode.py --contexts 32K 128K --batches 1 64 --steps 3 --methods nsa_decode \
    >"$out/profile_w$warps.log" 2>&1
  echo "profile, $warps warps: rc $? at $(( $(date +%s) - start )) s"
done
python3 - "$out/profile_w4.log" "$out/profile_w8.log" <<'PY'
"""The compressed kernel's time and the step's kernel sum per case, 4 warps against 8 (profile_decode.py's tables)."""
import re
import sys


names = set()  # the kernels' names: their last template argument is the warp count


def parse(path):
    """{case header: (compressed kernel us, sum us)} from one profile log."""
    cases, header = {}, None
    for line in open(path, errors="replace"):
        if line.startswith("## "):
            header = line[3:].strip()
            cases[header] = [None, None]
        elif header and line.startswith("nsa_decode: sum"):
            cases[header][1] = float(re.search(r"sum ([\d.]+)", line).group(1))
        elif header and "nsa_decode_compressed_kernel" in line:
            cases[header][0] = float(line.split()[0])
            names.add(line.split("us", 1)[1].strip())
    return cases


four, eight = parse(sys.argv[1]), parse(sys.argv[2])
print(f"{'case':40s} {'cmp 4w us':>10s} {'cmp 8w us':>10s} {'ratio':>6s} {'sum 4w':>8s} {'sum 8w':>8s}")
for header in four | eight:
    a, b = four.get(header, [None, None]), eight.get(header, [None, None])
    ratio = f"{b[0] / a[0]:.2f}" if a[0] and b[0] else "-"
    cells = [f"{x:.1f}" if x is not None else "-" for x in (a[0], b[0])]
    sums = [f"{x:.1f}" if x is not None else "-" for x in (a[1], b[1])]
    print(f"{header:40s} {cells[0]:>10s} {cells[1]:>10s} {ratio:>6s} {sums[0]:>8s} {sums[1]:>8s}")
print("compressed kernels seen:", ", ".join(sorted(names)))
PY
