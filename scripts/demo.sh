#!/usr/bin/env bash
# README command 1: set everything up, then run the demo (NSA forward + backward on an example, on the GPU
# if there is one, else on the CPU, checked against the float64 reference). Arguments go to the demo.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
bash "$SPARSEATTN_ROOT/scripts/setup.sh"
venv="$(sparseattn_venv_path)"
exec "$venv/bin/python" -m sparseattn.demo "$@"
