#!/usr/bin/env bash
# On a GPU machine: builds the package, then runs in one device call the NSA benchmark set that bench/results and
# the speed notes report: the 64K sweep (64/4, 32/8, 32/32, with stage times), 64/4 at 64K with drifting inputs, and
# 64/4 at 8K (no stages); where PEERS names a copy of ../shared/peers, flash-nsa beside sparseattn at 64/4, 64K
# (random and drifting inputs, with flash-nsa's stage times).
#
#   here:  cp -r ../shared/peers .peers      (.peers/ in .git/info/exclude; name it in the device call's carry)
#   there: COMMIT=<the local HEAD> PEERS=.peers bash scripts/gpu_bench.sh
#
# COMMIT names the commit in the reports (SPARSEATTN_COMMIT): the device's copy of the tree has a stale .git. The
# reports go to $OUT/bench (or /tmp/sparseattn-gpu/bench), the 8K run's named with an _8k suffix, the peers' output
# to peers.log and peers-local.log there; all of it is then packed into $OUT/bench.tar.gz (the folder removed), as a
# device call brings back only a few files. BUDGET_S (default 150) is the 64K sweep's --time-budget-s.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_build.sh"
export SPARSEATTN_COMMIT="${COMMIT:?set COMMIT to the commit the reports name (the local HEAD)}"
dir="$out/bench"
mkdir -p "$dir/8k"
status=0
bench() { python3 -m sparseattn.bench "$@" 2>&1 | tail -12; [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1; }
bench --shapes 64/4/128/128 32/8/128/128 32/32/128/128 --seqlens 64K --out "$dir" --time-budget-s "${BUDGET_S:-150}"
bench --shapes 64/4/128/128 --seqlens 64K --inputs drifting --out "$dir" --time-budget-s 60
bench --shapes 64/4/128/128 --seqlens 8K --no-stages --out "$dir/8k" --time-budget-s 30
shopt -s nullglob
for f in "$dir"/8k/*; do
  name="$(basename "$f")"
  mv "$f" "$dir/${name%.*}_8k.${name##*.}"
done
rmdir "$dir/8k"
echo "benchmark: $(( $(date +%s) - start )) s"
if [[ -n "${PEERS:-}" ]]; then
  for inputs in random local; do
    flag=(); [[ "$inputs" == local ]] && flag=(--local)
    log="$dir/peers.log"; [[ "$inputs" == local ]] && log="$dir/peers-local.log"
    python3 "$PEERS/bench_flash_nsa.py" --stages --cases 64/4@65536 ${flag[@]+"${flag[@]}"} >"$log" 2>&1 || status=1
    tail -12 "$log"
  done
  echo "peers: $(( $(date +%s) - start )) s"
fi
tar -czf "$out/bench.tar.gz" -C "$out" bench && rm -rf "$dir"
exit "$status"
