#!/usr/bin/env bash
# Sequential writes of large requests through `pmcache serve --mode writethrough` (fio's nbd
# engine, one connection at QD 1, 15 s per run), each of the binaries given, taking turns run by
# run; and fio on the backing file itself (psync, O_DIRECT) for the disk's own rate. Prints MB/s
# per run.
#
#   scripts/write-through-bench.sh [--rounds N] [--bs 4M,128k] [--dir /var/tmp] BINARY...
set -euo pipefail
rounds=3
sizes=4M,128k
dir=/var/tmp
while (($#)); do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --bs) sizes=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    *) break ;;
  esac
done
(($#)) || { echo "usage: $0 [--rounds N] [--bs 4M,128k] [--dir DIR] BINARY..." >&2; exit 2; }
work=$(mktemp -d)
img=$dir/pmcache-write-through-bench-$$.img
cleanup() {
  [[ -n ${pid:-} ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  rm -rf "$work" "$img" "$img".pmcache-state* /dev/shm/pmcache-write-through-bench-$$.pm
}
trap cleanup EXIT
fallocate -l 2G "$img"
mbps() { python3 -c 'import json,sys; b=json.load(open(sys.argv[1]))["jobs"][0]["write"]["bw_bytes"]; print("%.1f" % (b/1e6))' "$1"; }
run_pmcache() { # BINARY BS
  local medium=/dev/shm/pmcache-write-through-bench-$$.pm
  rm -f "$medium" "$img".pmcache-state* "$work/sock"
  "$1" serve --cache "$medium" --cache-size 256M --backing "$img" --socket "$work/sock" \
    --control "$work/ctl" --mode writethrough >"$work/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 100); do [[ -S $work/sock ]] && break; sleep 0.1; done
  fio --name=w --ioengine=nbd --uri="nbd+unix:///pmcache?socket=$work/sock" --rw=write \
    --bs="$2" --iodepth=1 --size=1G --time_based --runtime=15 --output-format=json \
    --output="$work/fio.json" >/dev/null 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
  mbps "$work/fio.json"
}
run_raw() { # BS
  fio --name=r --filename="$img" --rw=write --bs="$1" --iodepth=1 --direct=1 --ioengine=psync \
    --size=1G --time_based --runtime=15 --output-format=json --output="$work/fio.json" \
    >/dev/null 2>&1
  mbps "$work/fio.json"
}
for ((round = 1; round <= rounds; round++)); do
  for bs in ${sizes//,/ }; do
    for bin in "$@"; do
      echo "round $round bs $bs $bin: $(run_pmcache "$bin" "$bs") MB/s"
    done
    echo "round $round bs $bs raw file (fio psync O_DIRECT): $(run_raw "$bs") MB/s"
  done
done
