#!/usr/bin/env bash
# On a GPU machine (as scripts/gpu_check.sh: python3 with torch, transformers, nanobind, scikit-build-core, cmake,
# ninja, pytest, pytest-xdist): build the package with CUDA kernels, run the transformers integration's CUDA tests
# (SparseAttnCache and SparseAttnStaticCache: generate() through transformers' compile path, a decode step captured
# in a CUDA graph), then the generate benchmark in both modes (eager: SparseAttnCache / DynamicCache; graph:
# SparseAttnStaticCache / transformers' StaticCache, compiled steps replayed as CUDA graphs) at batch 16 and 64K
# prompts. Logs and the benchmark's JSON/markdown go to $OUT (or /tmp/sparseattn-gpu). Time limits per step
# (seconds): TEST_S, BENCH_S; SKIP_TESTS=1 or SKIP_BENCH=1 leaves a step out (to split it over two device calls).
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
if [[ -z "${SKIP_TESTS:-}" ]]; then
  (cd tests/python && timeout "${TEST_S:-240}" python3 -m pytest -n 4 -v -rf test_cuda_hf.py \
    test_hf_static_cache.py >"$out/tests.log" 2>&1)
  echo "tests: rc $? at $(( $(date +%s) - start )) s"; grep -E 'PASSED|FAILED|ERROR' "$out/tests.log" | tail -30
  grep -B5 -A40 '^_____' "$out/tests.log" | head -120
fi
if [[ -z "${SKIP_BENCH:-}" ]]; then
  cd /tmp
  timeout "${BENCH_S:-420}" python3 -m sparseattn.bench_inference --sections generate --generate-prompts 64K \
    --generate-batch 16 --generate-new-tokens 32 --generate-modes eager graph --out "$out/generate" \
    >"$out/bench_generate.log" 2>&1
  echo "bench generate: rc $? at $(( $(date +%s) - start )) s"
  grep -h '^bar generate\|^\[' "$out/bench_generate.log" | tail -8
  grep -h 'B=16, P=64K' "$out"/generate/*_inference.md | head -8
fi
