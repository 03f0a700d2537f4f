#!/usr/bin/env bash
# What the run-time settings of `pmcache set` cost and buy, measured with fio over NBD against
# `pmcache serve` (a /dev/shm medium, a sparse backing file under /var/tmp):
#
#   mode switch   N dirty blocks (the cleaner off), then `pmcache set mode=write-through`:
#                 seconds and blocks/s, beside `pmcache flush` of the same N blocks in the
#                 same run (each run: the switch, then back to write-back, the same blocks
#                 written again, the flush)
#   seq cutoff    a cache full of a random working set, then a 4 GiB sequential read through
#                 it, then the working set read again: its hit ratio after the scan, with
#                 `--admission seq-cutoff=4M` and with `--admission always`
#
#   scripts/settings-bench.sh [--runs N] [--dirty-mib M] [--pmcache PATH]
set -euo pipefail
cd "$(dirname "$0")/.."

runs=3
dirty_mib=256
pmcache=target/release/pmcache
while (($#)); do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --dirty-mib) dirty_mib=$2; shift 2 ;;
    --pmcache) pmcache=$2; shift 2 ;;
    *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[[ -x "$pmcache" ]] || { echo "settings-bench.sh: no $pmcache (cargo build --release -p pmcache-cli)" >&2; exit 1; }

work=$(mktemp -d /var/tmp/pmcache-settings-bench.XXXXXX)
shm=$(mktemp -d /dev/shm/pmcache-settings-bench.XXXXXX)
server_pid=
cleanup() {
  [[ -n "$server_pid" ]] && kill -INT "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null || true
  rm -rf "$work" "$shm"
}
trap cleanup EXIT
truncate -s 8G "$work/backing.img"

# serve CACHE_SIZE ARGS...: starts pmcache serve on a new medium; sets server_pid and uri.
serve() {
  local size=$1; shift
  rm -f "$shm/cache.pm"
  "$pmcache" serve --cache "$shm/cache.pm" --cache-size "$size" --backing "$work/backing.img" \
    --listen 127.0.0.1:0 --control "$shm/ctl" --state-dir "$work/state" "$@" \
    >"$work/serve.out" 2>"$work/serve.err" &
  server_pid=$!
  for _ in $(seq 300); do
    uri=$(sed -n 's/^ *NBD URI: *//p' "$work/serve.out")
    [[ -n "$uri" ]] && return 0
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/serve.err" >&2; exit 1; }
    sleep 0.1
  done
  echo "settings-bench.sh: pmcache serve did not start" >&2; exit 1
}
stop_server() { kill -INT "$server_pid"; wait "$server_pid" || true; server_pid=; }
stat() { "$pmcache" stats --json --control "$shm/ctl" | python3 -c "import json,sys; print(json.load(sys.stdin)['$1'])"; }
now() { date +%s.%N; }
fio_nbd() { fio --name=b --ioengine=nbd "--uri=$uri" --bs=4k --output-format=terse "$@" >/dev/null; }

echo "== mode switch: $dirty_mib MiB of dirty blocks, then set mode=write-through vs flush" >&2
serve 1G --cleaner order=none
switch=() flush=()
for run in $(seq "$runs"); do
  fio_nbd --rw=randwrite --iodepth=16 --size="${dirty_mib}m"
  dirty=$(stat dirty_slots)
  t0=$(now); "$pmcache" set --control "$shm/ctl" mode=write-through >/dev/null 2>&1; t1=$(now)
  [[ $(stat dirty_slots) == 0 && $(stat mode) == writethrough ]] || { echo "the switch left dirty blocks" >&2; exit 1; }
  switch+=("$(python3 -c "print($t1 - $t0)")")
  "$pmcache" set --control "$shm/ctl" mode=write-back >/dev/null
  fio_nbd --rw=randwrite --iodepth=16 --size="${dirty_mib}m"
  [[ $(stat dirty_slots) == "$dirty" ]] || echo "note: $(stat dirty_slots) dirty before the flush, $dirty before the switch" >&2
  t0=$(now); "$pmcache" flush --control "$shm/ctl" >/dev/null 2>&1; t1=$(now)
  flush+=("$(python3 -c "print($t1 - $t0)")")
  echo "run $run: $dirty dirty blocks; switch ${switch[-1]} s, flush ${flush[-1]} s" >&2
done
stop_server
python3 - "$dirty" "${switch[*]}" "${flush[*]}" <<'EOF'
import statistics, sys
blocks = int(sys.argv[1])
switch = statistics.median(map(float, sys.argv[2].split()))
flush = statistics.median(map(float, sys.argv[3].split()))
print(f"mode switch write-back -> write-through with {blocks} dirty blocks: {switch:.2f} s "
      f"({blocks / switch:,.0f} blocks/s); pmcache flush of the same blocks: {flush:.2f} s "
      f"({blocks / flush:,.0f} blocks/s); switch / flush time {switch / flush:.2f} "
      f"(medians of {len(sys.argv[2].split())} runs)")
EOF

echo "== sequential cutoff: a 192 MiB random working set, a 4 GiB scan, the set again" >&2
for admission in seq-cutoff=4M always; do
  ratios=()
  for run in $(seq "$runs"); do
    serve 256M --admission "$admission"
    # The working set, read twice at random: admitted, then hits.
    fio_nbd --rw=randread --iodepth=16 --size=192m --offset=6g
    fio_nbd --rw=randread --iodepth=16 --size=192m --offset=6g
    fio --name=scan --ioengine=nbd "--uri=$uri" --rw=read --bs=1m --iodepth=4 --size=4g >/dev/null
    h0=$(stat read_hits)
    fio_nbd --rw=randread --iodepth=16 --size=192m --offset=6g
    h1=$(stat read_hits)
    ratios+=("$(python3 -c "print(($h1 - $h0) / (192 * 256))")")
    stop_server
  done
  python3 - "$admission" "${ratios[*]}" <<'EOF'
import statistics, sys
r = [float(x) for x in sys.argv[2].split()]
print(f"--admission {sys.argv[1]}: the working set's hit ratio after a 4 GiB scan: "
      f"{statistics.median(r) * 100:.1f} % (median of {len(r)} runs; {', '.join(f'{x*100:.1f}' for x in r)})")
EOF
done
