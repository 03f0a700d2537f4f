#!/usr/bin/env bash
# NBD figures: fio ioengine=nbd, 4 KiB random reads (hits: the export is prefilled) and
# random writes, at QD1 and QD16, over 1 and 2 connections, against the target export and
# against `nbdkit memory` measured the same way in the same run. Prints the median IOPS of
# RUNS runs per cell and the ratio target / nbdkit.
#
# Usage: scripts/nbd-bench.sh [TARGET_URI | pmcache]
#   TARGET_URI   NBD URI to measure (e.g. nbd+unix:///pm?socket=/run/pmcache.sock). Default:
#                start crates/nbd/examples/memserve (MemExport) on a unix socket.
#   pmcache      build and start `pmcache serve` (write-back, a CACHE_SIZE cache medium in
#                /dev/shm, a sparse SIZE backing file in a temp dir). The prefill writes the
#                whole working set through the cache before the read runs, so every read is a
#                hit (the script prints the server's read_hits / read misses at the end).
# Environment:
#   RUNS=5         runs per cell (median reported)
#   RUNTIME=5      seconds per fio run
#   SIZE=256M      export size for memserve / nbdkit, and the fio working set
#   TRANSPORT=unix unix or tcp, for the servers this script starts
#   CACHE_SIZE=512M  cache medium size for `pmcache` (must exceed SIZE for all-hit reads)
#   CARGO_TARGET_DIR (default /work/target-nbd) where memserve / pmcache are built
# Needs: fio (with the nbd engine), nbdkit, python3, cargo.
set -euo pipefail

RUNS=${RUNS:-5}
RUNTIME=${RUNTIME:-5}
SIZE=${SIZE:-256M}
TRANSPORT=${TRANSPORT:-unix}
TARGET_URI=${1:-}
CACHE_SIZE=${CACHE_SIZE:-512M}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/work/target-nbd}

for tool in fio nbdkit python3; do
  command -v "$tool" >/dev/null || { echo "missing $tool (apt-get install -y $tool)" >&2; exit 1; }
done
fio --enghelp | grep -qx '[[:space:]]*nbd' || { echo "fio lacks the nbd engine" >&2; exit 1; }

tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT

wait_for() { # path-or-port
  for _ in $(seq 1 200); do
    if [[ $1 == /* ]]; then [[ -S $1 ]] && return 0
    else (exec 3<>/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return 0; fi
    sleep 0.05
  done
  echo "server did not come up on $1" >&2; exit 1
}

if [[ $TRANSPORT == unix ]]; then
  mem_listen=$tmp/memserve.sock; kit_listen=(-U "$tmp/nbdkit.sock")
  mem_uri="nbd+unix:///pm?socket=$tmp/memserve.sock"; kit_uri="nbd+unix:///?socket=$tmp/nbdkit.sock"
  mem_wait=$tmp/memserve.sock; kit_wait=$tmp/nbdkit.sock
else
  mem_listen=127.0.0.1:10911; kit_listen=(-i 127.0.0.1 -p 10912)
  mem_uri="nbd://127.0.0.1:10911/pm"; kit_uri="nbd://127.0.0.1:10912/"
  mem_wait=10911; kit_wait=10912
fi

pm_control=""
if [[ $TARGET_URI == pmcache ]]; then
  root=$(cd "$(dirname "$0")/.." && pwd)
  (cd "$root" && cargo build -q --release -p pmcache-cli)
  shm=$(mktemp -d /dev/shm/nbd-bench.XXXXXX)
  pm_control=$shm/pmcache.ctl
  truncate -s "$SIZE" "$tmp/backing.img"
  if [[ $TRANSPORT == unix ]]; then pm_listen=(--socket "$tmp/pmcache.sock"); pm_wait=$tmp/pmcache.sock
    TARGET_URI="nbd+unix:///pmcache?socket=$tmp/pmcache.sock"
  else pm_listen=(--listen 127.0.0.1:10913); pm_wait=10913; TARGET_URI="nbd://127.0.0.1:10913/pmcache"; fi
  "$CARGO_TARGET_DIR/release/pmcache" serve --cache "$shm/cache.pm" --cache-size "$CACHE_SIZE" \
    --backing "$tmp/backing.img" --mode writeback --control "$pm_control" "${pm_listen[@]}" \
    >"$tmp/pmcache.log" 2>&1 &
  pids+=($!)
  trap 'cleanup; rm -rf "$shm"' EXIT
  wait_for "$pm_wait"
  target_name="pmcache serve (write-back, $CACHE_SIZE cache in /dev/shm, $SIZE sparse backing file)"
elif [[ -z $TARGET_URI ]]; then
  root=$(cd "$(dirname "$0")/.." && pwd)
  (cd "$root" && cargo build -q --release -p pmcache-nbd --example memserve)
  "$CARGO_TARGET_DIR/release/examples/memserve" "$SIZE" "$mem_listen" --name pm >"$tmp/memserve.log" 2>&1 &
  pids+=($!)
  wait_for "$mem_wait"
  TARGET_URI=$mem_uri
  target_name="memserve (MemExport)"
else
  target_name="$TARGET_URI"
fi

nbdkit --foreground --exit-with-parent "${kit_listen[@]}" memory "size=$SIZE" >"$tmp/nbdkit.log" 2>&1 &
pids+=($!)
wait_for "$kit_wait"

fio_iops() { # uri rw qd conns
  fio --name=bench --ioengine=nbd --uri="$1" --rw="$2" --bs=4k --iodepth="$3" --numjobs="$4" \
      --size="$SIZE" --time_based --runtime="$RUNTIME" --ramp_time=1 --group_reporting \
      --randrepeat=0 --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; t=sys.stdin.read(); j=json.loads(t[t.index("{"):])["jobs"][0]; print(int(j["read"]["iops"]+j["write"]["iops"]))'
}

prefill() { # uri
  fio --name=prefill --ioengine=nbd --uri="$1" --rw=write --bs=1m --iodepth=8 --size="$SIZE" \
      --output-format=terse >/dev/null 2>&1
}

median() { tr ' ' '\n' | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print (NR%2) ? a[(NR+1)/2] : int((a[NR/2]+a[NR/2+1])/2)}'; }

echo "# nbd-bench $(date -u +%Y-%m-%dT%H:%M:%SZ)"
echo "# host: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), kernel $(uname -r)"
echo "# $(fio --version), $(nbdkit --version | head -1), transport=$TRANSPORT size=$SIZE runtime=${RUNTIME}s runs=$RUNS (median)"
echo "# target: $target_name ($TARGET_URI)"
echo "# baseline: nbdkit memory ($kit_uri)"
prefill "$TARGET_URI"
prefill "$kit_uri"

printf '%-10s %3s %5s %12s %12s %7s\n' workload qd conns target_iops nbdkit_iops ratio
for rw in randread randwrite; do
  for qd in 1 16; do
    for conns in 1 2; do
      a=""; b=""
      for _ in $(seq 1 "$RUNS"); do # interleaved so drift hits both alike
        a+=" $(fio_iops "$TARGET_URI" "$rw" "$qd" "$conns")"
        b+=" $(fio_iops "$kit_uri" "$rw" "$qd" "$conns")"
      done
      ma=$(echo "$a" | median); mb=$(echo "$b" | median)
      printf '%-10s %3s %5s %12s %12s %7s\n' "$rw" "$qd" "$conns" "$ma" "$mb" \
        "$(python3 -c "print(f'{$ma/$mb:.2f}x' if $mb else 'n/a')")"
    done
  done
done
if [[ -n $pm_control ]]; then
  "$CARGO_TARGET_DIR/release/pmcache" stats --json --control "$pm_control" | python3 -c 'import json,sys; j=json.load(sys.stdin); print("# pmcache: read_hits=%d read_misses=%d writebacks=%d evictions=%d" % (j["read_hits"], j["read_misses_admitted"]+j["read_misses_bypassed"], j["writebacks"], j["evictions"]))'
fi
