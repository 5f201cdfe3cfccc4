#!/usr/bin/env bash
# On a GPU machine (as scripts/gpu_check.sh: python3 with torch, nanobind, scikit-build-core, cmake, ninja, pytest,
# pytest-xdist): build the package with CUDA kernels, run nsa_decode's CUDA tests and flash_decode's, then the
# decode benchmark (batch 1 at 8K..128K, batch 64 at 32K; the bars of nsa_decode against flash_decode over the same
# pages). Fits one 8-minute device call on one H100/H200. Logs and the benchmark's JSON/markdown go to $OUT (or
# /tmp/sparseattn-gpu). Time limits per step (seconds): TEST_S, BENCH1_S, BENCH2_S.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
(cd tests/python && timeout "${TEST_S:-150}" python3 -m pytest -n 8 -q -rf test_cuda_nsa_decode.py \
  test_cuda_decode.py >"$out/tests.log" 2>&1)
echo "tests: rc $? at $(( $(date +%s) - start )) s"; tail -25 "$out/tests.log"
cd /tmp
timeout "${BENCH1_S:-100}" python3 -m sparseattn.bench_inference --sections decode --decode-batches 1 \
  --decode-contexts 8K 32K 64K 128K --out "$out/b1" --time-budget-s $(( ${BENCH1_S:-100} - 30 )) >"$out/bench_b1.log" 2>&1
echo "bench B=1: rc $? at $(( $(date +%s) - start )) s"
timeout "${BENCH2_S:-80}" python3 -m sparseattn.bench_inference --sections decode --decode-batches 64 \
  --decode-contexts 32K --out "$out/b64" --time-budget-s $(( ${BENCH2_S:-80} - 30 )) >"$out/bench_b64.log" 2>&1
echo "bench B=64: rc $? at $(( $(date +%s) - start )) s"
grep -h '^bar ' "$out/bench_b1.log" "$out/bench_b64.log" | grep -v 'no case'
grep -h 'NSA decode, paged\|flash_decode, paged' "$out"/b1/*_inference.md "$out"/b64/*_inference.md | head -20
