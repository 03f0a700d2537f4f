#!/usr/bin/env bash
# pmcache in front of an RBD image against the RBD image alone, on one throwaway single-host
# cluster (scripts/ceph/cluster.sh), in one run:
#
#   rbd          fio's own rbd engine, librbd's cache off (rbd_cache=false): no cache
#   rbd-cache    fio's rbd engine with librbd's in-memory write-back cache (rbd_cache=true,
#                write-back from the first write)
#   pmcache      fio's nbd engine against `pmcache serve` (write-back, a /dev/shm medium) over
#                the same image
#
# 4 KiB random reads and writes at QD1 and QD16 over a 128 MiB working set (a 512 MiB cache:
# pmcache's reads are hits after one warming pass), then the sustained write: 4 KiB random
# writes at QD16 over 512 MiB through a 64 MiB cache (8x the cache), for twice as long. Each
# cell is the median IOPS of --runs runs, the series taken in turn within each run; the ratios
# are pmcache's median over each baseline's, from the same run.
#
#   scripts/ceph/bench.sh [--runs N] [--seconds S] [--pmcache PATH]
#
# Needs root (the cluster), fio with its rbd and nbd engines, and a release build of pmcache
# (default: target/release/pmcache).
set -euo pipefail
cd "$(dirname "$0")/../.."

runs=3
seconds=8
pmcache=target/release/pmcache
while (($#)); do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --pmcache) pmcache=$2; shift 2 ;;
    *) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
[[ -x "$pmcache" ]] || { echo "bench.sh: no $pmcache (cargo build --release -p pmcache-cli)" >&2; exit 1; }

work=$(mktemp -d /tmp/pmcache-rbd-bench.XXXXXX)
shm=/dev/shm/pmcache-rbd-bench.$$
mkdir -p "$shm"
server_pid=
cleanup() {
  [[ -n "$server_pid" ]] && kill -INT "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null || true
  bash scripts/ceph/cluster.sh stop "$work/cluster" >/dev/null 2>&1 || true
  rm -rf "$work" "$shm"
}
trap cleanup EXIT

conf=$(bash scripts/ceph/cluster.sh start "$work/cluster" | sed -n 's/^CEPH_CONF=//p')
# Two client configurations over the same cluster: librbd's cache off, and on.
cp "$conf" "$work/nocache.conf"
printf '[client]\nrbd_cache = false\n' >>"$work/nocache.conf"
cp "$conf" "$work/cache.conf"
printf '[client]\nrbd_cache = true\nrbd_cache_writethrough_until_flush = false\n' >>"$work/cache.conf"
rbd -c "$conf" create --size 1G rbd/bench
# Every object written once, so that reads of the image read data, not absent objects.
CEPH_CONF="$work/nocache.conf" fio --name=fill --ioengine=rbd --clientname=admin --pool=rbd \
  --rbdname=bench --rw=write --bs=4m --iodepth=8 --size=1g >/dev/null

# Starts pmcache serve over the image with a cache of $1 (the medium made at the first start,
# attached after); sets server_pid and uri.
serve() {
  "$pmcache" serve --cache "$shm/cache.pm" --cache-size "$1" \
    --backing "rbd:rbd/bench:conf=$conf" --listen 127.0.0.1:0 --control "$shm/ctl" \
    --state-dir "$work/state" >"$work/serve.out" 2>"$work/serve.err" &
  server_pid=$!
  for _ in $(seq 300); do
    uri=$(sed -n 's/^ *NBD URI: *//p' "$work/serve.out")
    [[ -n "$uri" ]] && return 0
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/serve.err" >&2; exit 1; }
    sleep 0.1
  done
  echo "bench.sh: pmcache serve did not start" >&2; cat "$work/serve.err" >&2; exit 1
}

stop_server() {
  kill -INT "$server_pid"; wait "$server_pid" || true; server_pid=
}

# fio_iops SERIES RW QD SIZE SECONDS: prints the job's IOPS.
fio_iops() {
  local series=$1 rw=$2 qd=$3 size=$4 secs=$5 engine=() env=()
  case "$series" in
    rbd) env=(CEPH_CONF="$work/nocache.conf"); engine=(--ioengine=rbd --clientname=admin --pool=rbd --rbdname=bench) ;;
    rbd-cache) env=(CEPH_CONF="$work/cache.conf"); engine=(--ioengine=rbd --clientname=admin --pool=rbd --rbdname=bench) ;;
    pmcache) engine=(--ioengine=nbd "--uri=$uri") ;;
  esac
  if ! env "${env[@]}" fio --name=b "${engine[@]}" --rw="$rw" --bs=4k --iodepth="$qd" \
    --size="$size" --time_based --runtime="$secs" --ramp_time=1 --randrepeat=0 \
    --output-format=json >"$work/fio.json" 2>"$work/fio.err"; then
    echo "bench.sh: fio $series $rw QD$qd failed:" >&2; cat "$work/fio.err" >&2; exit 1
  fi
  # fio's rbd engine may print a note ("rbd: failed to issue initial flush") before the JSON.
  python3 -c 'import json,sys; t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])["jobs"][0]; print(round(j["read"]["iops"]+j["write"]["iops"]))' "$work/fio.json" \
    || { head -c 600 "$work/fio.json" "$work/fio.err" >&2; exit 1; }
}

results="$work/results"
: >"$results"

# The image takes one writer at a time (pmcache holds its exclusive lock while attached), so
# within each run the baselines go first, then pmcache is attached again to the cache it left
# (warm: a stop writes its dirty blocks back and keeps them cached) and detached after.
echo "== 4 KiB random I/O over a 128 MiB working set (pmcache: 512 MiB cache, warmed)" >&2
jobs=(randread:1 randread:16 randwrite:1 randwrite:16)
serve 512M
# Random reads, each block once: admitted (a sequential pass past 4 MiB would bypass the cache).
fio --name=warm --ioengine=nbd "--uri=$uri" --rw=randread --bs=4k --iodepth=16 --size=128m >/dev/null
stop_server
for run in $(seq "$runs"); do
  for s in rbd rbd-cache pmcache; do
    [[ $s == pmcache ]] && serve 512M
    for job in "${jobs[@]}"; do
      rw=${job%:*} qd=${job#*:}
      iops=$(fio_iops "$s" "$rw" "$qd" 128m "$seconds")
      echo "$rw-qd$qd $s $run $iops" | tee -a "$results" >&2
    done
    if [[ $s == pmcache ]]; then
      "$pmcache" stats --control "$shm/ctl" --json | python3 -c 'import json,sys; s=json.load(sys.stdin); print("pmcache run: read hits", s["read_hits"], "read misses", s["read_misses_admitted"] + s["read_misses_bypassed"])' >&2
      stop_server
    fi
  done
done

echo "== sustained 4 KiB random writes at QD16 over 512 MiB (pmcache: 64 MiB cache, 8x)" >&2
rm -f "$shm/cache.pm"
for run in $(seq "$runs"); do
  for s in rbd rbd-cache pmcache; do
    [[ $s == pmcache ]] && serve 64M
    iops=$(fio_iops "$s" randwrite 16 512m $((seconds * 2)))
    echo "sustained-randwrite-qd16 $s $run $iops" | tee -a "$results" >&2
    if [[ $s == pmcache ]]; then
      "$pmcache" stats --control "$shm/ctl" --json | python3 -c 'import json,sys; s=json.load(sys.stdin); print("pmcache run: dirty", s["dirty_slots"], "of", s["slot_count"], "slots; stalls", s["stalls"], "; throttled writes", s["throttled_writes"], "; backing", s["backing_state"])' >&2
      stop_server
    fi
  done
done

python3 - "$results" "$runs" <<'EOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
cells = {}
for job, series, _run, iops in rows:
    cells.setdefault(job, {}).setdefault(series, []).append(int(iops))
print(f"median IOPS of {sys.argv[2]} runs (4 KiB); ratios: pmcache over each baseline")
print(f"{'job':<26}{'rbd':>10}{'rbd-cache':>11}{'pmcache':>10}{'x rbd':>9}{'x rbd-cache':>13}")
for job, by in cells.items():
    m = {s: statistics.median(v) for s, v in by.items()}
    print(f"{job:<26}{m['rbd']:>10.0f}{m['rbd-cache']:>11.0f}{m['pmcache']:>10.0f}"
          f"{m['pmcache'] / m['rbd']:>9.2f}{m['pmcache'] / m['rbd-cache']:>13.2f}")
EOF
