#!/usr/bin/env bash
# On a GPU machine whose python3 already has torch, nanobind, scikit-build-core, cmake, ninja and pytest (no
# network needed): build the package with CUDA kernels and line information, then run compute-sanitizer's four
# tools over tests/python/sanitize_cases.py, which runs small cases of every CUDA kernel, forward and backward:
#   memcheck   the full matrix (every head-dim pair, both attention MMA paths, group sizes 1/3/4/8/16, packed
#              lengths 1/63/65/700 and batched inputs, bf16/fp16/fp32, every selected-attention forward and dQ),
#              split over parallel processes, each tensor its own cudaMalloc (PYTORCH_NO_CUDA_MEMORY_CACHING=1)
#              followed by a padding that any out-of-bounds access hits;
#   racecheck, synccheck, initcheck   the reduced matrix (the same operations and paths for every head-dim pair
#              and both MMA paths, shorter sequences, and the selected group forward on a sequence long enough
#              that its ring of stages wraps): these tools are 10-100x slower.
# Prints the error count per tool and exits non-zero if any tool reports an error or a case fails. Also lists
# the kernels the cases launch (torch.profiler, no sanitizer) against those in the built extension: every
# sparseattn kernel must be launched by both matrices. Logs go to $OUT (or /tmp/sparseattn-sanitize).
#
# Usage: bash scripts/sanitize.sh [--no-build]
# Environment: SANITIZE_TOOLS (default "memcheck racecheck synccheck initcheck"), SANITIZE_SHARDS (processes per
# tool, default "memcheck=6 racecheck=6 synccheck=2 initcheck=4"), SANITIZE_MATCH (only cases whose name contains
# it), SANITIZE_TIMEOUT (seconds per process, default 500), SANITIZE_TRACE=1 (the driver also prints the steps of
# a selected-attention case, to place a hang), COMPUTE_SANITIZER (the binary).
#
# Notes on the tools' options (docs/perf/2026-11-27-sanitizer.md has what they found):
#  - racecheck and synccheck track mbarriers (pipeline.cuh) up to a per-block count the compiler reports;
#    --num-cuda-barriers 64 covers the largest ring (2 x 16 in the selected group forward; the automatic count
#    gave the same reports). Racecheck's "RACECHECK SUMMARY" counts errors and warnings: both count here.
#  - initcheck: workspaces and partial buffers come from torch.empty and are written before they are read.
#    With the caching allocator off every torch.empty is fresh, never-written memory, so a kernel that reads
#    a byte nothing wrote is reported, even where it discards the value. It counts a cp.async with a smaller
#    source size (zero fill) as a read of all 16 bytes.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
out="${OUT:-/tmp/sparseattn-sanitize}"
mkdir -p "$out"
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)"
export PYTHONUNBUFFERED=1 SPARSEATTN_ARCHS="${SPARSEATTN_ARCHS:-90a}" CMAKE_BUILD_PARALLEL_LEVEL
if [[ -x /usr/bin/g++ ]]; then export CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++; fi  # as scripts/gpu_check.sh

build=1
for arg in "$@"; do
  case "$arg" in
    --no-build) build=0 ;;
    *) echo "usage: bash scripts/sanitize.sh [--no-build]" >&2; exit 2 ;;
  esac
done

sanitizer="${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
[[ -x "$sanitizer" ]] || { echo "sanitize.sh: compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
"$sanitizer" --version | tail -1

if [[ $build == 1 ]]; then
  # -lineinfo: the reports name source lines; it does not change the generated code.
  python3 -m pip install -q --no-build-isolation --no-deps -C cmake.define.CMAKE_CUDA_FLAGS=-lineinfo . \
    >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
fi
python3 -c "import sparseattn, torch; assert sparseattn.built_with_cuda(); print('sparseattn', sparseattn.__version__, \
'torch', torch.__version__, torch.cuda.get_device_name())" || exit 1

tools="${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}"
shards_spec="${SANITIZE_SHARDS:-memcheck=6 racecheck=6 synccheck=2 initcheck=4}"
limit="${SANITIZE_TIMEOUT:-500}"
driver=(python3 tests/python/sanitize_cases.py)
[[ -n "${SANITIZE_MATCH:-}" ]] && driver+=(--match "$SANITIZE_MATCH")

shards_of() {  # shards_of TOOL
  local spec
  for spec in $shards_spec; do [[ ${spec%%=*} == "$1" ]] && { echo "${spec#*=}"; return; }; done
  echo 1
}

common=(--error-exitcode 99 --print-limit 200 --show-backtrace device --strip-paths yes --launch-timeout 180)
declare -A level=([memcheck]=full [racecheck]=reduced [synccheck]=reduced [initcheck]=reduced)
declare -A options=(
  [memcheck]="--tool memcheck --padding 256"
  [racecheck]="--tool racecheck --racecheck-report analysis --num-cuda-barriers 64"
  [synccheck]="--tool synccheck --num-cuda-barriers 64"
  [initcheck]="--tool initcheck"
)
pids=()
for tool in $tools; do
  [[ -n "${options[$tool]:-}" ]] || { echo "sanitize.sh: unknown tool $tool" >&2; exit 2; }
  n=$(shards_of "$tool")
  for ((i = 0; i < n; i++)); do
    log="$out/$tool.$i.log"
    # shellcheck disable=SC2086  # the options are words
    (
      export PYTORCH_NO_CUDA_MEMORY_CACHING=1
      timeout -k 10 "$limit" "$sanitizer" "${common[@]}" ${options[$tool]} \
        "${driver[@]}" --level "${level[$tool]}" --shard "$i/$n" >"$log" 2>&1
      echo "exit $?" >>"$log"
    ) &
    pids+=($!)
  done
done
# Kernel coverage, without a sanitizer: what each matrix launches against what the extension holds.
(
  for lvl in full reduced; do
    "${driver[@]}" --level "$lvl" --kernels "$out/kernels.$lvl.txt" >"$out/kernels.$lvl.log" 2>&1
  done
) &
cover_pid=$!
so="$(python3 -c 'import sparseattn._C as c; print(c.__file__)')"
cuobjdump -sass "$so" 2>/dev/null | sed -n 's/.*Function : //p' | c++filt | sort -u >"$out/kernels.built.txt"
wait "${pids[@]}" "$cover_pid"

status=0
printf '%-10s %6s %7s  %s\n' tool shards errors status
for tool in $tools; do
  n=$(shards_of "$tool")
  errors=0
  note=ok
  for ((i = 0; i < n; i++)); do
    log="$out/$tool.$i.log"
    if [[ $tool == racecheck ]]; then  # its summary: "N hazards displayed (E errors, W warnings)"; both count
      e=$(sed -n 's/.*RACECHECK SUMMARY: .*(\([0-9]*\) errors*, \([0-9]*\) warnings*).*/\1 + \2/p' "$log" | tail -1)
      [[ -n "$e" ]] && e=$((e))
    else
      e=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' "$log" | tail -1)
    fi
    code=$(sed -n 's/^exit \([0-9]*\)$/\1/p' "$log" | tail -1)
    if [[ -z "$e" ]]; then
      note="no summary in $tool.$i.log (exit ${code:-?})"
      status=1
      continue
    fi
    errors=$((errors + e))
    if ! grep -q "sanitize_cases: [0-9]* cases done" "$log"; then
      note="cases did not finish in $tool.$i.log (exit ${code:-?})"
      status=1
    fi
  done
  [[ $errors -gt 0 ]] && status=1
  printf '%-10s %6s %7s  %s\n' "$tool" "$n" "$errors" "$note"
done

# Coverage: kernel base names (the last name before the template arguments and parameters).
base_names() {
  sed -e 's/(anonymous namespace)/anon/g' -e 's/^void //' -e 's/[<(].*//' -e 's/.*:://' | sort -u
}
grep '^\(void \)\?sparseattn::' "$out/kernels.built.txt" | base_names >"$out/kernels.built.base.txt"
for lvl in full reduced; do
  if [[ ! -s "$out/kernels.$lvl.txt" ]]; then
    echo "coverage ($lvl): no kernel list (see kernels.$lvl.log)"
    status=1
    continue
  fi
  grep 'sparseattn::' "$out/kernels.$lvl.txt" | base_names >"$out/kernels.$lvl.base.txt"
  missing=$(comm -23 "$out/kernels.built.base.txt" "$out/kernels.$lvl.base.txt")
  built=$(grep -c 'sparseattn::' "$out/kernels.built.txt")
  ran=$(grep -c 'sparseattn::' "$out/kernels.$lvl.txt")
  echo "coverage ($lvl): $(wc -l <"$out/kernels.$lvl.base.txt") of $(wc -l <"$out/kernels.built.base.txt") sparseattn" \
       "kernels launched ($ran of $built instantiations)${missing:+; never launched: $(tr "\n" " " <<<"$missing")}"
  [[ -z "$missing" ]] || status=1
done
[[ $status == 0 ]] && echo "sanitize.sh: no errors" || echo "sanitize.sh: FAILED (logs in $out)"
exit $status
