#!/usr/bin/env bash
# README command 2 (and CI, through .ci/run): set everything up and run every test.
#   1. Debian packages and the Python venv (scripts/setup.sh --env-only)
#   2. C++: configure build/ci-cpp with the GoogleTest suite (CUDA on when nvcc exists), build, ctest
#      (includes building examples/cpp against an installed copy of the library)
#   3. Python: build and install the package into the venv, then pytest tests/python
# Both suites run even when one fails; the exit status is non-zero if anything failed or ran no test.
# Arguments are passed to pytest (e.g. `bash scripts/test.sh -k combine`).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$SPARSEATTN_ROOT"

bash scripts/setup.sh --env-only || sparseattn_die "environment setup failed"
source scripts/_env.sh  # again: ccache may have just been installed
venv="$(sparseattn_venv_path)"
export PATH="$venv/bin:$PATH"  # the pinned cmake, ninja and python first
results="$SPARSEATTN_ROOT/build/ci-results"
rm -rf "$results"
mkdir -p "$results"
cpp_status=ok
py_status=ok
section() { printf '\n==== %s ====\n' "$*"; }

# --- C++ -------------------------------------------------------------------------------------------------
section "C++: configure and build (build/ci-cpp)"
# The same switches the package build reads from the environment (see pyproject.toml).
cuda=OFF
if command -v nvcc >/dev/null 2>&1 || [[ -n "${CUDACXX:-}" ]]; then cuda=ON; fi
cuda="${SPARSEATTN_ENABLE_CUDA:-$cuda}"
switches=()
[[ -z "${SPARSEATTN_ARCHS:-}" ]] || switches+=("-DSPARSEATTN_ARCHS=$SPARSEATTN_ARCHS")
cmake --version | head -n 1
# shellcheck disable=SC2086  # SPARSEATTN_CMAKE_ARGS is a space-separated list on purpose
build_log="$results/cpp-build.log"
if cmake -S . -B build/ci-cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSEATTN_BUILD_TESTS=ON \
      -DSPARSEATTN_ENABLE_CUDA="$cuda" "${switches[@]}" $SPARSEATTN_CMAKE_ARGS &&
   cmake --build build/ci-cpp -j "$SPARSEATTN_JOBS" 2>&1 | tee "$build_log"; then
  section "C++: ctest"
  (cd build/ci-cpp && ctest --output-on-failure --no-tests=error --timeout 1200 -j "$SPARSEATTN_JOBS" \
      --output-junit "$results/ctest.xml") || cpp_status=failed
  # Where ptxas cannot keep a kernel's wgmma asynchronous (a branch around MMAs inside its pipeline, a non-wgmma
  # instruction on their accumulators), it waits after every MMA and says so only as "ptxas info": fail here.
  serialized="wgmma.mma_async instructions are serialized"
  if grep -q "$serialized" "$build_log"; then
    grep -o "$serialized.*" "$build_log" | sort -u | head -20
    cpp_status="ptxas serialised the wgmma of a kernel (build/ci-results/cpp-build.log)"
  fi
else
  cpp_status="build failed"
fi

# --- Python ----------------------------------------------------------------------------------------------
section "Python: build and install the package"
if bash scripts/setup.sh --package-only; then
  section "Python: pytest tests/python"
  "$venv/bin/python" -m pytest tests/python -q --junitxml="$results/pytest.xml" "$@"
  rc=$?
  if ((rc == 5)); then
    py_status="no tests collected"
  elif ((rc != 0)); then
    py_status=failed
  fi
else
  py_status="package build failed"
fi

# --- Summary ---------------------------------------------------------------------------------------------
section "Summary"
"$venv/bin/python" - "$results" "$cpp_status" "$py_status" <<'PY'
import os
import sys
import xml.etree.ElementTree as ET

results, statuses = sys.argv[1], {"C++ (ctest)": sys.argv[2], "Python (pytest)": sys.argv[3]}
files = {"C++ (ctest)": "ctest.xml", "Python (pytest)": "pytest.xml"}
total = [0, 0, 0]
for suite, name in files.items():
    path = os.path.join(results, name)
    passed = failed = skipped = 0
    if os.path.exists(path):
        for case in ET.parse(path).getroot().iter("testcase"):
            tags = {child.tag for child in case}
            if tags & {"failure", "error"}:
                failed += 1
            elif "skipped" in tags:
                skipped += 1
            else:
                passed += 1
    status = statuses[suite]
    note = "" if status == "ok" else f"  <- {status}"
    print(f"{suite}: {passed} passed, {failed} failed, {skipped} skipped{note}")
    for i, n in enumerate((passed, failed, skipped)):
        total[i] += n
print(f"total: {total[0]} passed, {total[1]} failed, {total[2]} skipped")
PY

if [[ "$cpp_status" == ok && "$py_status" == ok ]]; then
  exit 0
fi
printf '[sparseattn] FAILED: C++ %s, Python %s\n' "$cpp_status" "$py_status" >&2
exit 1
