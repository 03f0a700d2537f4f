#!/usr/bin/env bash
# Instructions the engine executes per request in one `pmcache bench core` configuration,
# counted by callgrind (exact and repeatable, unlike timings on a shared VM). Only the bench's
# engine worker is counted; the raw and floor measurements run uninstrumented by the count.
#
#   scripts/instructions-per-request.sh [CONFIG]     (default: 'write-back-4k-qd16$')
#
# CONFIG is passed to `--only`, which matches a substring: end it with `$` to match the end of
# the name ('write-back-4k$' is the one-request-per-call write, not the -qd16 one). Its 1- and
# 2-thread rows are counted together; a CONFIG matching rows of two names is refused.
#
# Prints the requests counted, all instructions per request, and those besides the
# non-temporal block copy (`PersistPrimitives::copy_nontemporal`, which reads have none of).
# Needs valgrind (`apt-get install -y valgrind`); not part of CI. docs/PERFORMANCE.md,
# `bench core`, has the write path's instruction counts and what they cost.
set -euo pipefail
cd "$(dirname "$0")/.."

config="${1:-write-back-4k-qd16\$}"
command -v valgrind >/dev/null || { echo "valgrind not found: apt-get install -y valgrind" >&2; exit 1; }
cargo build --release -q -p pmcache-cli
out="$(mktemp -d)"
# CALLGRIND_OUT=path keeps the profile (for callgrind_annotate).
trap '[[ -z "${CALLGRIND_OUT:-}" ]] || cp "$out/cg" "$CALLGRIND_OUT"; rm -rf "$out"' EXIT

# --fair-sched lets the bench's timer thread run between the workers; --seconds is wall time,
# so under valgrind the workers do far fewer requests than natively (enough for a count).
valgrind --tool=callgrind --fair-sched=yes --callgrind-out-file="$out/cg" \
    --toggle-collect='*engine_worker*' \
    target/release/pmcache bench core --cache-mib 64 --seconds 2 --runs 1 --only "$config" \
    >"$out/bench.log" 2>"$out/valgrind.log"

names=$(awk 'NR > 2 && NF > 3 && $1 != "config" && $1 !~ /^recovery/ { print $1 }' "$out/bench.log" | sort -u)
if [[ $(wc -w <<<"$names") -ne 1 ]]; then
    echo "'$config' must select the rows of exactly one configuration; it ran: $(echo $names)" >&2
    exit 1
fi
total=$(callgrind_annotate --auto=no "$out/cg" | awk '/PROGRAM TOTALS/ { gsub(/,/, "", $1); print $1 }')
# Calls of a function and the instructions inside them, summed over its callers' arcs (the
# `>` lines of the call tree; `=>` lines are the source annotation's copies of them).
arcs() {
    callgrind_annotate --auto=no --tree=calling --threshold=100 "$out/cg" |
        awk -v f="$1" '/^ *[0-9,]+ \([ 0-9.]+%\)  >   / && index($0, f) {
                cost = $1; gsub(/,/, "", cost); sum += cost
                match($0, /\([0-9,]+x\)/); n = substr($0, RSTART + 1, RLENGTH - 3); gsub(/,/, "", n); calls += n
            }
            END { print calls + 0, sum + 0 }'
}
# Requests: the calls of the copy (one per write), else of the lookup (one per read hit).
read -r requests copy < <(arcs 'PersistPrimitives::copy_nontemporal (')
if [[ "$requests" -eq 0 ]]; then
    read -r requests _ < <(arcs 'Index::lookup_key (')
    copy=0
fi
if [[ -z "$requests" || "$requests" -eq 0 ]]; then
    echo "no requests counted for '$config'; valgrind said:" >&2
    tail -5 "$out/valgrind.log" >&2
    exit 1
fi
echo "$config: $requests requests counted; instructions per request: $((total / requests)) in all, $(((total - copy) / requests)) besides the block copy"
