#!/usr/bin/env bash
# On a GPU machine (as scripts/gpu_check.sh: python3 with torch, transformers, nanobind, scikit-build-core, cmake,
# ninja, pytest, pytest-xdist): checks and times nsa_decode's select kernel. Optionally first builds and profiles a
# baseline source tree (BASE_DIR, e.g. main's tree staged beside this one) so both profiles come from the same
# card; then builds this tree, runs the CUDA nsa_decode tests (the selection's exact ties and long candidate lists
# included) and the transformers integration's CUDA tests, the per-kernel profile of a decode step with dependent
# launches off (select kernel's time at 32K and 128K, batches 1 and 64), and the graph-replay decode benchmark.
# Logs and the benchmark's JSON/markdown go to $OUT (or /tmp/sparseattn-gpu). Time limits per step (seconds):
# TEST_S, PROFILE_S, BENCH_S; SKIP_TESTS=1, SKIP_PROFILE=1 or SKIP_BENCH=1 leaves a step out (to split the work
# over two device calls); DECODE_CONTEXTS (default "32K 128K") sets the benchmark's contexts, batches 1 and 64.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-/tmp/sparseattn-gpu}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 SPARSEATTN_ARCHS="${SPARSEATTN_ARCHS:-90a}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
if [[ -x /usr/bin/g++ ]]; then export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
here="$(pwd)"
profile() {  # $1: log name
  (cd /tmp && SPARSEATTN_DEPENDENT_LAUNCH=0 timeout "${PROFILE_S:-240}" python3 "$here/scripts/profile_decode.py" \
    --contexts 32K 128K --batches 1 64 --steps 3 >"$out/$1.log" 2>&1)
  echo "$1: rc $? at $(( $(date +%s) - start )) s"; cat "$out/$1.log" | tail -40
}
if [[ -n "${BASE_DIR:-}" && -z "${SKIP_PROFILE:-}" ]]; then
  (cd "$BASE_DIR" && python3 -m pip install -q --no-build-isolation --no-deps . >"$out/build_base.log" 2>&1) || {
    tail -60 "$out/build_base.log"; exit 1; }
  echo "baseline build: $(( $(date +%s) - start )) s"
  profile profile_base
fi
python3 -m pip install -q --no-build-isolation --no-deps . >"$out/build.log" 2>&1 || {
  tail -60 "$out/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
if [[ -z "${SKIP_TESTS:-}" ]]; then
  (cd tests/python && timeout "${TEST_S:-300}" python3 -m pytest -n 8 -v -rf test_cuda_nsa_decode.py \
    test_cuda_hf.py >"$out/tests.log" 2>&1)
  echo "tests: rc $? at $(( $(date +%s) - start )) s"; grep -E 'passed|failed|error' "$out/tests.log" | tail -3
  grep -E 'FAILED|ERROR' "$out/tests.log" | head -30
  grep -B5 -A40 '^_____' "$out/tests.log" | head -120
fi
if [[ -z "${SKIP_PROFILE:-}" ]]; then
  profile profile
fi
if [[ -z "${SKIP_BENCH:-}" ]]; then
  (cd /tmp && timeout "${BENCH_S:-300}" python3 -m sparseattn.bench_inference --sections decode \
    --decode-contexts ${DECODE_CONTEXTS:-32K 128K} --decode-batches 1 64 --out "$out/decode" \
    >"$out/bench_decode.log" 2>&1)
  echo "bench decode: rc $? at $(( $(date +%s) - start )) s"
  tail -30 "$out/bench_decode.log"
fi
