#!/usr/bin/env bash
# Instructions the engine executes per request in one `pmcache bench core` configuration,
# counted by callgrind (exact and repeatable, unlike timings on a shared VM). Only the bench's
# engine worker is counted; the raw and floor measurements run uninstrumented by the count.
#
#   scripts/instructions-per-request.sh [CONFIG]     (default: write-back-4k-qd16)
#
# Prints the requests counted, all instructions per request, and those besides the
# non-temporal block copy (`PersistPrimitives::copy_nontemporal`, which reads have none of).
# Needs valgrind (`apt-get install -y valgrind`); not part of CI. docs/PERFORMANCE.md,
# "Session 13", has what the write path's figures were and what they cost.
set -euo pipefail
cd "$(dirname "$0")/.."

config="${1:-write-back-4k-qd16}"
command -v valgrind >/dev/null || { echo "valgrind not found: apt-get install -y valgrind" >&2; exit 1; }
cargo build --release -q -p pmcache-cli
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

# --fair-sched lets the bench's timer thread run between the workers; --seconds is wall time,
# so under valgrind the workers do far fewer requests than natively (enough for a count).
valgrind --tool=callgrind --fair-sched=yes --callgrind-out-file="$out/cg" \
    --toggle-collect='*run_engine*' \
    target/release/pmcache bench core --cache-mib 64 --seconds 2 --runs 1 --only "$config" \
    >"$out/bench.log" 2>"$out/valgrind.log"

total=$(callgrind_annotate "$out/cg" | awk '/PROGRAM TOTALS/ { gsub(/,/, "", $1); print $1 }')
# Requests: the calls of the copy (one per write), else of the lookup (one per read hit).
calls() {
    callgrind_annotate --tree=calling "$out/cg" | { grep -E "> .*$1 \(" || true; } | head -1
}
copy_line=$(calls 'copy_nontemporal')
if [[ -n "$copy_line" ]]; then
    requests=$(grep -o '([0-9,]*x)' <<<"$copy_line" | tr -d '(),x')
    copy=$(awk '{ gsub(/,/, "", $1); print $1 }' <<<"$copy_line")
else
    requests=$(calls 'Index::lookup_key' | grep -o '([0-9,]*x)' | tr -d '(),x')
    copy=0
fi
if [[ -z "$requests" || "$requests" -eq 0 ]]; then
    echo "no requests counted for '$config' (see $out/valgrind.log)" >&2
    exit 1
fi
echo "$config: $requests requests counted; instructions per request: $((total / requests)) in all, $(((total - copy) / requests)) besides the block copy"
