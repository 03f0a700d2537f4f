#!/usr/bin/env bash
# pmcache serve --vhost-user-blk on the host serving the disk of a QEMU guest (run-in-guest.sh
# --vhost-user-blk: TCG, 1 GiB RAM shared with the server, 2 vCPUs, a 384 MiB disk as /dev/vda
# with 2 request queues), and what the guest sees when the server is killed and restarted.
#
#  1. In the guest: mkfs.ext4 /dev/vda, mount, fio writes 16 MiB of files (4 KiB random
#     writes, libaio at queue depth 4, O_DIRECT) and verifies them (crc32c); after a remount a
#     second pass verifies every block again.
#  2. fio writes 48 MiB more, at most 400 writes a second (so its write phase lasts 30 s or
#     more), with verify; the guest prints a marker line on its console when fio runs. The
#     host, watching the console, kills the server with SIGKILL, waits 1.5 s, and starts it
#     again on the same socket and cache; QEMU reconnects (its chardev retries every second)
#     and the guest's requests go on. This happens 3 times while fio writes. fio must end
#     with no error and every block verified; after a remount every block of both runs
#     verifies again, fsck.ext4 -fn finds the file system clean, and the guest's kernel log
#     names no I/O error.
#
# The host prints the kills done, the reconnections seen (the restarted server holding a
# connected socket; QEMU stopping the device and starting it again, from its trace), what
# each restarted server recovered, the bytes verified, and what QEMU printed. pmcache does
# not offer the INFLIGHT_SHMFD protocol feature: when the server goes, QEMU sets each ring's
# next request back to the ring's used index ("vhost VQ N ring restore failed"), so the new
# server is given again every request not yet answered, which is right because pmcache
# answers each ring's requests in the order they were made available (docs/VHOST.md).
#
#   scripts/guest/vhost-user-blk-e2e.sh
#
# PMCACHE_E2E_ARGS adds flags to the server (see server_cmd). Builds pmcache (the test
# suite's binary, scripts/test-binary.sh); installs fio and e2fsprogs on the host when
# missing; fio, mkfs.ext4 and fsck.ext4 are copied into the guest. Arguments for
# run-in-guest.sh can be given in PMCACHE_GUEST_ARGS. A run takes about 2 minutes.
source "$(dirname "$0")/lib.sh"
need_tools fio:fio mkfs.ext4:e2fsprogs e2fsck:e2fsprogs
build_pmcache test-opt
kills_wanted=3
queues=2
work=$(mktemp -d /dev/shm/vhost-user-blk-e2e.XXXXXX)
img=$work/disk.img
sock=$work/vub.sock
console=$work/console.log
trace=$work/qemu-trace.log
truncate -s 384M "$img"

# server_cmd: pmcache serving $img (the backing store) through a 128 MiB cache in $work
# (/dev/shm, kept across the kills) on $sock with $queues virtqueues, in the foreground, exec'd
# (the pid start_server gets is the server's own, which the kills must hit). PMCACHE_E2E_ARGS
# adds flags: CI runs it as it is (write-back) and with `--mode write-through
# --backing-latency 2ms`, so that each kill finds writes in flight to the backing store.
server_cmd() {
  # shellcheck disable=SC2086
  exec "$exe" serve --cache "$work/cache.pm" --cache-size 128M --backing "$img" \
    --vhost-user-blk "$sock" --vhost-queues "$queues" ${PMCACHE_E2E_ARGS:-}
}
server=
servers=0
# start_server: server_cmd in the background (its log in $work/server.N.log), until its socket
# is there (fails after 30 s); sets server to its pid. A socket left by a killed server is
# removed first.
start_server() {
  local i=0
  rm -f "$sock"
  servers=$((servers + 1))
  server_cmd > "$work/server.$servers.log" 2>&1 &
  server=$!
  until [[ -S "$sock" ]]; do
    if ! kill -0 "$server" 2>/dev/null || ((++i > 300)); then
      tail -n 20 "$work/server.$servers.log" >&2
      echo "vhost-user-blk-e2e: the server did not listen on $sock" >&2
      return 1
    fi
    sleep 0.1
  done
}
stop_server() {
  if [[ -n "$server" ]]; then kill -KILL "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  server=
}
on_exit "stop_server; rm -rf '$work'"
# server_connected: whether the running server holds a connected socket bound to $sock (its
# end of QEMU's connection; QEMU's end has no name).
server_connected() {
  local inodes
  inodes=$(awk -v p="$sock" '$8 == p && $6 == "03" { print "socket:[" $7 "]" }' /proc/net/unix)
  [[ -n "$inodes" ]] && ls -l "/proc/$server/fd" 2>/dev/null | grep -qF "$inodes"
}

guest_script vhost-user-blk-e2e
cat > "$script" <<'GUEST'
set -eu
M=/mnt/vda
fail() { echo "vhost-user-blk-e2e: FAILED: $*"; dmesg | tail -n 20; exit 1; }
# fio_job NAME SIZE ARGS...: 2 jobs of 4 KiB random writes (libaio, queue depth 4, O_DIRECT)
# over a file of SIZE each, crc32c in every block, fsynced at the end; its JSON summary in
# /tmp/fio-NAME.json.
fio_job() {
  name=$1 size=$2; shift 2
  fio --name=$name --directory=$M --ioengine=libaio --iodepth=4 --direct=1 --rw=randwrite \
    --bs=4k --size=$size --numjobs=2 --verify=crc32c --verify_fatal=1 --end_fsync=1 \
    --verify_state_save=0 --group_reporting --output-format=json --output=/tmp/fio-$name.json \
    "$@" > /tmp/fio-$name.err 2>&1
}
io_bytes() { # io_bytes NAME read|write: the bytes fio's job NAME moved that way
  awk -v d="\"$2\"" '$1 == d { f = 1 } f && $1 == "\"io_bytes\"" { gsub(/[^0-9]/, "", $3); print $3; exit }' /tmp/fio-$1.json
}
max_write_ms() { # max_write_ms NAME: the longest write of fio's job NAME, in ms
  awk '$1 == "\"write\"" { w = 1 } w && $1 == "\"lat_ns\"" { l = 1 }
    l && $1 == "\"max\"" { gsub(/[^0-9]/, "", $3); print int($3 / 1000000); exit }' /tmp/fio-$1.json
}
fio_ok() { # fio_ok NAME WROTE VERIFIED: job NAME had no error, wrote (- for a verify pass,
  # which counts the writes it replays without doing them) and read these bytes
  grep -q '"error" : 0,' /tmp/fio-$1.json || { cat /tmp/fio-$1.err /tmp/fio-$1.json; fail "fio $1 reported an error"; }
  [ "$2" = - ] || [ "$(io_bytes $1 write)" = "$2" ] || fail "fio $1 wrote $(io_bytes $1 write) bytes, not $2"
  [ "$(io_bytes $1 read)" = "$3" ] || fail "fio $1 verified $(io_bytes $1 read) bytes, not $3"
}
remount() {
  umount $M || fail "umount"
  mount -t ext4 /dev/vda $M || fail "mount again"
}
i=0; while [ ! -b /dev/vda ]; do i=$((i+1)); [ $i -lt 300 ] || fail "no /dev/vda"; sleep 0.1; done
echo "vhost-user-blk-e2e: /dev/vda: $(($(cat /sys/block/vda/size) / 2048)) MiB," \
  "$(ls /sys/block/vda/mq | wc -l) request queues, $(cat /sys/block/vda/queue/logical_block_size) B blocks," \
  "write cache: $(cat /sys/block/vda/queue/write_cache)"
mkfs.ext4 -q -F /dev/vda || fail "mkfs.ext4"
mkdir -p $M && mount -t ext4 /dev/vda $M || fail "mount"

echo "== 1. fio writes and verifies 16 MiB on /dev/vda"
fio_job basic 8m --do_verify=1 || { cat /tmp/fio-basic.err; fail "fio basic"; }
fio_ok basic 16777216 16777216
remount
fio_job basic 8m --verify_only || { cat /tmp/fio-basic.err; fail "fio verify of basic after a remount"; }
fio_ok basic - 16777216
echo "vhost-user-blk-e2e: 16 MiB written and verified, verified again after a remount"

echo "== 2. fio writes 48 MiB (400 writes/s) while the host kills and restarts the server"
fio_job crash 24m --do_verify=1 --rate_iops=,200 &
FIO=$!
sleep 1
echo "VHOST-USER-BLK-E2E-FIO-RUNNING"
# A request the backends lose for good leaves fio waiting: give up after 300 s.
i=0
while kill -0 $FIO 2>/dev/null; do
  i=$((i+1))
  if [ $i -gt 3000 ]; then
    echo "vhost-user-blk-e2e: requests in flight on vda (reads writes): $(cat /sys/block/vda/inflight)"
    fail "fio still runs after 300 s: a request never completed"
  fi
  sleep 0.1
done
echo "VHOST-USER-BLK-E2E-FIO-DONE"
wait $FIO || { cat /tmp/fio-crash.err; fail "fio under the kills"; }
fio_ok crash 50331648 50331648
echo "vhost-user-blk-e2e: fio wrote 48 MiB through the kills with no error and verified every block;" \
  "its longest write took $(max_write_ms crash) ms"
remount
fio_job basic 8m --verify_only || { cat /tmp/fio-basic.err; fail "verify of basic"; }
fio_ok basic - 16777216
fio_job crash 24m --verify_only || { cat /tmp/fio-crash.err; fail "verify of crash"; }
fio_ok crash - 50331648
echo "VHOST-USER-BLK-E2E-VERIFIED $((16777216 + 50331648))"
umount $M || fail "umount"
fsck.ext4 -fn /dev/vda > /tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "fsck.ext4 -fn"; }
echo "vhost-user-blk-e2e: fsck.ext4 -fn: clean ($(tail -n 1 /tmp/fsck.log))"
errors=$(dmesg | grep -iE 'I/O error|blk_update_request|critical (medium|target)|EXT4-fs (error|warning)|virtio.*(error|broken|not a head)|blocked for more than' || true)
if [ -n "$errors" ]; then
  echo "$errors" | sed 's/^/vhost-user-blk-e2e: dmesg: /'
  fail "the guest's kernel logged I/O errors"
fi
echo "vhost-user-blk-e2e: dmesg: no I/O error"
echo "vhost-user-blk-e2e: guest OK"
GUEST

start_server || exit 1
echo "== vhost-user-blk in the guest, served from the host (pid $server, socket $sock)"
# QEMU's trace (timestamped, in $trace): the device's starts and stops and the vhost-user
# requests it sends (by number: 31 and 32 are GET_INFLIGHT_FD and SET_INFLIGHT_FD).
: > "$console"
PMCACHE_GUEST_QEMU_ARGS="-msg timestamp=on -trace vhost_dev_start -trace vhost_dev_stop \
  -trace vhost_user_write -D $trace ${PMCACHE_GUEST_QEMU_ARGS:-}" \
  "$here/run-in-guest.sh" --timeout 900 --mem 1024 --smp 2 --disk-mib 64 ${PMCACHE_GUEST_ARGS:-} \
  --vhost-user-blk "$sock" --vhost-queues "$queues" \
  --copy "$(command -v fio)" --copy "$(command -v mkfs.ext4)" --copy "$(command -v fsck.ext4)" \
  --copy "$script" -- sh "$script" > "$console" 2>&1 &
guest=$!
tail -n +1 -f --pid="$guest" "$console" &
shown=$!

# The host's side of step 2: once the guest's fio runs, kill -9 the server every few seconds
# and start it again, each time until the new process holds QEMU's connection.
failures=()
kills=0 reconnects=0
kill_times=()
wait_console() { # wait_console PATTERN: until the console shows PATTERN; fails if the guest ends
  until grep -q "$1" "$console"; do
    kill -0 "$guest" 2>/dev/null || return 1
    sleep 0.1
  done
}
if wait_console VHOST-USER-BLK-E2E-FIO-RUNNING; then
  server_connected || failures+=("QEMU was not connected to the server when fio started")
  for ((k = 1; k <= kills_wanted; k++)); do
    sleep 3
    if grep -q VHOST-USER-BLK-E2E-FIO-DONE "$console"; then
      failures+=("fio ended before kill $k")
      break
    fi
    kill_times+=("$(date +%s.%N)")
    kill -KILL "$server"
    wait "$server" 2>/dev/null || true
    kills=$((kills + 1))
    echo "vhost-user-blk-e2e: host: kill -9 of the server (pid $server), $k of $kills_wanted" >&2
    sleep 1.5
    if ! start_server; then
      failures+=("the server did not start again after kill $k")
      break
    fi
    # Counted when first seen: QEMU may drop a fresh connection and make another (its log
    # then says "Failed to set msg fds"), so a second look can fall between the two.
    t0=$(date +%s%N) connected=0
    until server_connected && connected=1; do
      if (($(date +%s%N) - t0 > 30000000000)); then
        failures+=("QEMU did not connect to the server restarted after kill $k within 30 s")
        break
      fi
      sleep 0.05
    done
    if ((connected)); then
      reconnects=$((reconnects + 1))
      echo "vhost-user-blk-e2e: host: server restarted (pid $server), QEMU connected to it" \
        "$((($(date +%s%N) - t0) / 1000000)) ms later" >&2
    fi
  done
else
  failures+=("the guest never showed its fio running")
fi
set +e
wait "$guest"
guest_rc=$?
set -e
wait "$shown" 2>/dev/null || true

echo "== vhost-user-blk-e2e: results"
echo "vhost-user-blk-e2e: kills done: $kills of $kills_wanted"
echo "vhost-user-blk-e2e: reconnects seen: $reconnects (a restarted server holding QEMU's connection)"
# Each kill in QEMU's trace: the device stopped (the connection closed) and started again (on
# the new connection), in seconds after the kill.
restarts=0
for ((k = 0; k < kills; k++)); do
  read -r stop_s start_s < <(awk -F'[@: ]' -v a="${kill_times[k]}" -v b="${kill_times[k + 1]:-1e12}" '
    $2 >= a && $2 < b && $3 == "vhost_dev_stop" && stop == "" { stop = sprintf("%.3f", $2 - a) }
    $2 >= a && $2 < b && $3 == "vhost_dev_start" && start == "" { start = sprintf("%.3f", $2 - a) }
    END { print (stop == "" ? "-" : stop), (start == "" ? "-" : start) }' "$trace")
  echo "vhost-user-blk-e2e: kill $((k + 1)): QEMU stopped the device ${stop_s} s after it," \
    "started it again ${start_s} s after it"
  [[ "$start_s" == - ]] || restarts=$((restarts + 1))
done
echo "vhost-user-blk-e2e: device restarts by QEMU after the kills: $restarts"
for ((n = 2; n <= servers; n++)); do
  attached=$(grep -m 1 'attached' "$work/server.$n.log" || true)
  echo "vhost-user-blk-e2e: server $n: ${attached#pmcache: }"
  [[ "$attached" == *"unclean shutdown"* ]] || failures+=("server $n did not recover the cache the killed one left")
done
inflight_gets=$(grep -c ':vhost_user_write req:31 ' "$trace" || true)
inflight_sets=$(grep -c ':vhost_user_write req:32 ' "$trace" || true)
echo "vhost-user-blk-e2e: inflight region: VHOST_USER_GET_INFLIGHT_FD sent $inflight_gets times," \
  "VHOST_USER_SET_INFLIGHT_FD $inflight_sets times"
if ((inflight_gets > 0)); then
  echo "vhost-user-blk-e2e: the server offers INFLIGHT_SHMFD: each restarted one was handed the region"
else
  echo "vhost-user-blk-e2e: the server does not offer INFLIGHT_SHMFD: after each kill QEMU gave the" \
    "new one every request past each ring's used index again"
fi
qemu_said=$(grep -E '^([0-9T:.-]+Z )?qemu-system-x86_64: ' "$console" || true)
if [[ -n "$qemu_said" ]]; then
  echo "vhost-user-blk-e2e: QEMU said (times said):"
  echo "$qemu_said" | sed 's/^[0-9T:.-]*Z //' | sort | uniq -c | sed 's/^ */  /'
fi
verified=$(sed -n 's/^VHOST-USER-BLK-E2E-VERIFIED \([0-9]*\)$/\1/p' "$console" | tail -n 1)
echo "vhost-user-blk-e2e: bytes verified after the kills: ${verified:-none}"
((kills == kills_wanted)) || failures+=("$kills kills of $kills_wanted")
((reconnects == kills)) || failures+=("$reconnects reconnects after $kills kills")
((restarts == kills)) || failures+=("QEMU started the device again $restarts times after $kills kills")
((guest_rc == 0)) || failures+=("the guest's test exited with $guest_rc")
[[ -n "$verified" ]] || failures+=("the guest verified nothing after the kills")
if ((${#failures[@]})); then
  for f in "${failures[@]}"; do echo "vhost-user-blk-e2e: FAILED: $f"; done
  for ((n = 1; n <= servers; n++)); do
    [[ -s "$work/server.$n.log" ]] && { echo "-- server.$n.log"; tail -n 20 "$work/server.$n.log"; }
  done
  exit 1
fi
echo "vhost-user-blk-e2e: passed ($((SECONDS - start)) s in all)"
