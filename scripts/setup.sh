#!/usr/bin/env bash
# Sets up everything sparseattn needs on a Debian/Ubuntu machine and installs the package into a venv.
# Idempotent and non-interactive: a second run installs nothing new and rebuilds only the package.
#
#   bash scripts/setup.sh                 Debian packages + Python venv + build/install the package
#   bash scripts/setup.sh --env-only      Debian packages + Python venv
#   bash scripts/setup.sh --package-only  build/install the package into the (existing) venv
#   bash scripts/setup.sh --print-venv    print the venv path and exit
#
# Knobs: see scripts/_env.sh (SPARSEATTN_VENV, SPARSEATTN_PYTHON, SPARSEATTN_CMAKE_ARGS, ...).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$SPARSEATTN_ROOT"

do_env=1
do_package=1
case "${1:-}" in
  "") ;;
  --env-only) do_package=0 ;;
  --package-only) do_env=0 ;;
  --print-venv) sparseattn_venv_path; exit 0 ;;
  *) sparseattn_die "unknown option '$1' (see the comment at the top of scripts/setup.sh)" ;;
esac

# --- Debian packages: install only what is missing, `apt-get update` at most once. ---------------------
setup_apt() {
  local packages=(build-essential cmake ninja-build libgtest-dev python3-dev python3-venv git ccache)
  local missing=() p
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    sparseattn_log "Debian packages: all present"
    return
  fi
  command -v apt-get >/dev/null || sparseattn_die "missing ${missing[*]} and no apt-get; install them by hand or set SPARSEATTN_SKIP_APT=1"
  local sudo=()
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null || sparseattn_die "missing ${missing[*]}; run as root or install them by hand"
    sudo=(sudo -n)
  fi
  sparseattn_log "Debian packages: installing ${missing[*]}"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" </dev/null
}

check_tools() {
  local tool
  for tool in g++ git "$SPARSEATTN_PYTHON"; do
    command -v "$tool" >/dev/null || sparseattn_die "'$tool' not found on PATH"
  done
}

# --- Python venv with the pinned requirements, reused across runs. --------------------------------------
setup_venv() {
  local venv stamp
  venv="$(sparseattn_venv_path)"
  stamp="$venv/.sparseattn-requirements"
  mkdir -p "$(dirname "$venv")"
  exec 9>"$venv.lock"
  flock 9  # two scripts setting up the same venv at once wait for each other
  if [[ -f "$stamp" ]] && cmp -s "$stamp" "$SPARSEATTN_REQUIREMENTS" && [[ -x "$venv/bin/python" ]]; then
    sparseattn_log "venv: reusing $venv"
  else
    sparseattn_log "venv: creating $venv"
    [[ -x "$venv/bin/python" ]] || "$SPARSEATTN_PYTHON" -m venv "$venv"
    PIP_NO_INPUT=1 "$venv/bin/python" -m pip install -r "$SPARSEATTN_REQUIREMENTS"
    cp "$SPARSEATTN_REQUIREMENTS" "$stamp"  # written last: an interrupted install is redone next time
  fi
  exec 9>&-
  "$venv/bin/python" - <<'PY' || sparseattn_die "the venv's interpreter has no C headers (install python3-dev or use SPARSEATTN_PYTHON)"
import os, sysconfig
assert os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
PY
}

# --- Build and install the package (nanobind extension + Python front end) into the venv. -------------
install_package() {
  local venv
  venv="$(sparseattn_venv_path)"
  [[ -x "$venv/bin/python" ]] || sparseattn_die "no venv at $venv; run scripts/setup.sh first"
  [[ -f pyproject.toml ]] || sparseattn_die "no pyproject.toml in $SPARSEATTN_ROOT"
  sparseattn_log "package: building and installing into $venv"
  # scikit-build-core reads extra CMake arguments from CMAKE_ARGS; the venv's cmake and ninja go first.
  PATH="$venv/bin:$PATH" CMAKE_ARGS="${CMAKE_ARGS:-} $SPARSEATTN_CMAKE_ARGS" PIP_NO_INPUT=1 \
    "$venv/bin/python" -m pip install --no-build-isolation --no-deps "$SPARSEATTN_ROOT"
  # Dependencies come from requirements-dev.txt (--no-deps above); say so if the package wants more.
  "$venv/bin/python" -m pip check >&2 || sparseattn_log "warning: pip check reports missing or conflicting dependencies"
  (cd / && "$venv/bin/python" -c 'import sparseattn, sparseattn._C; print("[sparseattn] package: import ok, version", getattr(sparseattn, "__version__", "?"))') ||
    sparseattn_die "the installed package does not import"
}

if ((do_env)); then
  [[ -n "${SPARSEATTN_SKIP_APT:-}" ]] || setup_apt
  source "$SPARSEATTN_ROOT/scripts/_env.sh"  # again: picks up ccache if apt just installed it
  check_tools
  setup_venv
fi
if ((do_package)); then
  install_package
fi
