# Sourced (not run) by setup.sh, demo.sh and test.sh: paths and settings they share.
#
# Environment knobs (all optional):
#   SPARSEATTN_PYTHON      interpreter the venv is made from (default: python3 on PATH)
#   SPARSEATTN_VENV        venv directory (default: $HOME/.cache/sparseattn/venv-<hash>)
#   SPARSEATTN_ENABLE_CUDA, SPARSEATTN_ARCHS
#                          build switches for both the C++ test build and the package build, e.g.
#                          SPARSEATTN_ARCHS=90a (default: CMakeLists.txt's)
#   SPARSEATTN_CMAKE_ARGS  extra CMake arguments for every build (space separated)
#   SPARSEATTN_JOBS        parallel build jobs (default: number of cores)
#   SPARSEATTN_SKIP_APT=1  do not look at or install Debian packages
#   SPARSEATTN_NO_CCACHE=1 do not use ccache even when it is installed

SPARSEATTN_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SPARSEATTN_REQUIREMENTS="$SPARSEATTN_ROOT/scripts/requirements-dev.txt"
SPARSEATTN_PYTHON="${SPARSEATTN_PYTHON:-python3}"
SPARSEATTN_JOBS="${SPARSEATTN_JOBS:-$(nproc 2>/dev/null || echo 2)}"
SPARSEATTN_CMAKE_ARGS="${SPARSEATTN_CMAKE_ARGS:-}"

sparseattn_log() { printf '[sparseattn] %s\n' "$*" >&2; }
sparseattn_die() { printf '[sparseattn] error: %s\n' "$*" >&2; exit 1; }

# The venv path: SPARSEATTN_VENV, else one per (requirements file, interpreter version, machine), so
# repeated runs reuse it and a change of pins gets a new one. Needs the interpreter (after apt).
sparseattn_venv_path() {
  if [[ -n "${SPARSEATTN_VENV:-}" ]]; then
    printf '%s\n' "$SPARSEATTN_VENV"
    return
  fi
  local id hash
  id="$("$SPARSEATTN_PYTHON" -c 'import platform, sys; print(sys.version, platform.machine())')" ||
    sparseattn_die "cannot run $SPARSEATTN_PYTHON"
  hash="$({ cat "$SPARSEATTN_REQUIREMENTS"; printf '%s\n' "$id"; } | sha256sum | cut -c1-16)"
  printf '%s\n' "$HOME/.cache/sparseattn/venv-$hash"
}

# Compiler cache for every CMake build started from these scripts (CMake reads these variables when it
# configures a fresh build directory; the pip build of the package configures one every time).
if [[ -z "${SPARSEATTN_NO_CCACHE:-}" ]] && command -v ccache >/dev/null 2>&1; then
  export CMAKE_CXX_COMPILER_LAUNCHER="${CMAKE_CXX_COMPILER_LAUNCHER:-ccache}"
  export CMAKE_CUDA_COMPILER_LAUNCHER="${CMAKE_CUDA_COMPILER_LAUNCHER:-ccache}"
  export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$SPARSEATTN_ROOT}"  # hits across fresh clones at other paths
  export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
fi
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$SPARSEATTN_JOBS}"
export PIP_PROGRESS_BAR="${PIP_PROGRESS_BAR:-off}"
