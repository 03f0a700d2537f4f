#!/usr/bin/env bash
# A read beside a write in flight, end to end, as on a network disk whose writes land late:
# the backing store is an nbdkit memory export behind the delay filter (wdelay=6ms), mounted as
# a file by nbdfuse; `pmcache serve` runs in front of it in each mode. Connection A writes a
# 4 KiB block and does not wait; connection B reads 8 KiB covering it; A's write is answered;
# B reads the block again. Prints, per mode, how many of the rounds read back old data
# (0 is right: an answered write is what every later read returns).
#
#   scripts/repro/read-beside-write.sh [ROUNDS]     (as root; needs nbdkit, nbdfuse and
#                                                    python3-libnbd; PMCACHE_BIN names the
#                                                    binary, a release build by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-40}
bin=${PMCACHE_BIN:-target/release/pmcache}
[[ -x $bin ]] || cargo build --release -p pmcache-cli
work=$(mktemp -d)
port=$((20000 + RANDOM % 10000))
cleanup() {
  [[ -n ${serve_pid:-} ]] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null
  fusermount3 -u "$work/mnt" 2>/dev/null || fusermount -u "$work/mnt" 2>/dev/null || true
  [[ -n ${kit_pid:-} ]] && kill "$kit_pid" 2>/dev/null
  rm -rf "$work" /dev/shm/pmcache-repro-$$.pm
}
trap cleanup EXIT
nbdkit --exit-with-parent -f -U "$work/kit.sock" --filter=delay memory 64M wdelay=6ms &
kit_pid=$!
mkdir "$work/mnt"
for _ in $(seq 50); do [[ -S $work/kit.sock ]] && break; sleep 0.1; done
nbdfuse "$work/mnt/disk" "nbd+unix:///?socket=$work/kit.sock" &
for _ in $(seq 50); do [[ -e $work/mnt/disk ]] && break; sleep 0.1; done
for mode in writethrough writearound writeback; do
  rm -f /dev/shm/pmcache-repro-$$.pm
  # A new backing store for each mode: zeroes.
  dd if=/dev/zero of="$work/mnt/disk" bs=1M count=64 conv=notrunc status=none
  "$bin" serve --cache /dev/shm/pmcache-repro-$$.pm --cache-size 32M \
    --backing "$work/mnt/disk" --mode "$mode" --listen "127.0.0.1:$port" \
    --control "$work/control.sock" --state-file "$work/state" >"$work/serve.log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 100); do nc -z 127.0.0.1 "$port" 2>/dev/null && break; sleep 0.1; done
  /usr/bin/python3 - "$port" "$rounds" "$mode" <<'PY'
import sys, nbd
port, rounds, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
uri = f"nbd://127.0.0.1:{port}/pmcache"
a, b = nbd.NBD(), nbd.NBD()
a.connect_uri(uri); b.connect_uri(uri)
stale = 0
for r in range(rounds):
    offset = r * 3 * 4096
    new = bytes([r % 250 + 1]) * 4096
    cookie = a.aio_pwrite(new, offset)
    b.pread(8192, offset)
    while not a.aio_command_completed(cookie):
        a.poll(-1)
    if b.pread(4096, offset) != new:
        stale += 1
print(f"{mode}: {stale} of {rounds} reads after the answered write returned old data")
PY
  kill "$serve_pid"; wait "$serve_pid" 2>/dev/null || true; serve_pid=
done
