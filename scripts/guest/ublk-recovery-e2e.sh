#!/usr/bin/env bash
# Crash and take-over of `pmcache serve --ublk`, in the QEMU guest of run-in-guest.sh (this
# host's kernel has no ublk_drv). In the guest, over a backing file on the guest's ext4 disk,
# a 16 MiB cache in /dev/shm served as /dev/ublkb0 with an ext4 file system mounted on it:
#
#  0. fio writes and fsyncs a first set of files ("keep"), verified later.
#  1. Take-over: fio writes and verifies (crc32c) 32 MiB; the server is killed with SIGKILL
#     while fio runs; /dev/ublkb0 stays (user recovery) and `pmcache ublk list` shows it can be
#     taken over; a fresh `pmcache serve --ublk` of the same cache is refused, naming the
#     device; `pmcache serve --ublk --recover 0` recovers the cache from its medium and takes
#     the device over; fio finishes with every block verified and no I/O error.
#  2. Re-attach: fio writes again; the server is killed again; `pmcache ublk remove 0` deletes
#     the device (fio fails: its device is gone); the file system is unmounted; a fresh process
#     serves the same medium on a new device; the file system mounts (journal replayed),
#     every block of the fsynced files of steps 0 and 1 verifies, and e2fsck -fn finds it
#     clean.
#  3. SIGTERM with the file system still mounted, after fio wrote files without fsync: the
#     server stops (it syncs the file system first), the cache is marked clean, the
#     device goes.
#  4. --ublk-recovery off: every file so far verifies; SIGKILL under fio, whose I/O fails at
#     once instead of waiting, and the driver stops the device; a fresh process removes that
#     dead device, serves the medium on a new one, every fsynced file verifies, e2fsck clean.
#
#   scripts/guest/ublk-recovery-e2e.sh
#
# Builds `pmcache` (profile test-opt) and installs fio and e2fsprogs on the host when missing
# (their binaries and libraries are copied into the guest).
source "$(dirname "$0")/lib.sh"
need_tools fio:fio mkfs.ext4:e2fsprogs e2fsck:e2fsprogs
build_pmcache test-opt
guest_script ublk-recovery-e2e
cat > "$script" <<GUEST
set -eu
PM=$exe
B=/mnt/nvme/backing.img
M=/mnt/fs
C=/dev/shm/cache.pm
SERVE="\$PM serve --ublk --cache \$C --cache-size 16M --backing \$B --control /tmp/pm.ctl"
fail() { echo "ublk-recovery-e2e: FAILED: \$*"; tail -n 30 /tmp/serve*.log 2>/dev/null; exit 1; }
wait_for() { # wait_for TEST WHAT: up to 60 s
  i=0; while ! eval "\$1"; do i=\$((i+1)); [ \$i -lt 600 ] || fail "\$2"; sleep 0.1; done
}
# fio JOB SIZE EXTRA...: 2 jobs of 4 KiB random writes over SIZE each, verified (crc32c);
# each file is fsynced at the end of its write phase.
fio_job() {
  name=\$1 size=\$2; shift 2
  fio --name=\$name --directory=\$M --ioengine=psync --direct=1 --rw=randwrite --bs=4k \\
    --size=\$size --numjobs=2 --verify=crc32c --verify_fatal=1 --end_fsync=1 \\
    --verify_state_save=0 --group_reporting "\$@"
}
# The crash jobs write at most 500 blocks/s per job (--rate_iops=,500), so their write phase
# lasts at least 8 s on any machine and the kill after 4 s lands in it.
kill_server_under_fio() { # kill_server_under_fio FIO_PID: SIGKILL once fio has written
  sleep 4
  kill -0 \$1 2>/dev/null || fail "fio ended before the server was killed"
  kill -KILL \$SERVER; wait \$SERVER 2>/dev/null || true
  echo "ublk-recovery-e2e: server killed (SIGKILL) under fio"
}

rm -f \$C \$B.pmcache-state
dd if=/dev/zero of=\$B bs=1M count=0 seek=512 2>/dev/null
\$SERVE > /tmp/serve0.log 2>&1 &
SERVER=\$!
wait_for "grep -q 'if killed' /tmp/serve0.log" "no /dev/ublkb0"
grep -q "recover 0" /tmp/serve0.log || fail "user recovery is not on"
mkfs.ext4 -q -F /dev/ublkb0 || fail "mkfs.ext4"
mkdir -p \$M && mount -t ext4 /dev/ublkb0 \$M || fail "mount"
fio_job keep 4m --do_verify=1 > /tmp/fio-keep.log 2>&1 || { cat /tmp/fio-keep.log; fail "fio keep"; }

echo "== 1. kill -9 under fio, take-over with --recover"
fio_job crash1 16m --do_verify=1 --rate_iops=,500 > /tmp/fio1.log 2>&1 &
FIO=\$!
kill_server_under_fio \$FIO
[ -b /dev/ublkb0 ] || fail "/dev/ublkb0 went with the server"
wait_for "\$PM ublk list | grep -q 'ublkb0: .*can be taken over'" "ublk list never showed device 0 as orphaned"
\$PM ublk list
if \$SERVE > /tmp/refused.log 2>&1; then fail "a fresh serve of the cache was not refused"; fi
grep -q "recover 0" /tmp/refused.log || { cat /tmp/refused.log; fail "the refusal does not name --recover 0"; }
echo "ublk-recovery-e2e: a fresh serve is refused: \$(grep -o '/dev/ublkb0 (.*) serves this cache' /tmp/refused.log)"
\$SERVE --recover 0 > /tmp/serve1.log 2>&1 &
SERVER=\$!
wait_for "grep -q 'taken over' /tmp/serve1.log" "no take-over"
grep -q "unclean shutdown" /tmp/serve1.log || { cat /tmp/serve1.log; fail "no recovery of the medium reported"; }
wait \$FIO || { cat /tmp/fio1.log; fail "fio under the take-over"; }
grep -q "err= 0" /tmp/fio1.log || { cat /tmp/fio1.log; fail "fio reported errors"; }
grep -E "WRITE:|READ:" /tmp/fio1.log
echo "ublk-recovery-e2e: fio carried on through the take-over, every block verified"

echo "== 2. kill -9 under fio, device removed, medium re-attached by a fresh process"
fio_job crash2 16m --do_verify=1 --rate_iops=,500 > /tmp/fio2.log 2>&1 &
FIO=\$!
kill_server_under_fio \$FIO
wait_for "\$PM ublk list | grep -q 'ublkb0: .*can be taken over'" "device 0 never orphaned"
\$PM ublk remove 0 || fail "ublk remove"
if wait \$FIO; then fail "fio did not see its device go"; fi
umount \$M || umount -l \$M || fail "umount after removal"
wait_for "[ ! -e /dev/ublkc0 ]" "device 0 never went"
\$SERVE > /tmp/serve2.log 2>&1 &
SERVER=\$!
wait_for "[ -b /dev/ublkb0 ]" "no /dev/ublkb0 after re-attaching"
grep -q "unclean shutdown" /tmp/serve2.log || { cat /tmp/serve2.log; fail "no recovery of the medium reported"; }
mount -t ext4 /dev/ublkb0 \$M || fail "mount after re-attaching"
for job in keep:4m crash1:16m; do
  fio_job \${job%%:*} \${job#*:} --verify_only > /tmp/fio-v.log 2>&1 || { cat /tmp/fio-v.log; fail "verify of \${job%%:*}"; }
done
echo "ublk-recovery-e2e: every fsynced block of keep and crash1 verified after re-attaching"
umount \$M
e2fsck -fn /dev/ublkb0 > /tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "e2fsck after re-attaching"; }
echo "ublk-recovery-e2e: e2fsck -fn: clean"

echo "== 3. SIGTERM with the file system still mounted"
mount -t ext4 /dev/ublkb0 \$M || fail "mount before the stop"
fio_job term 4m --do_verify=0 --end_fsync=0 > /tmp/fio-term.log 2>&1 || { cat /tmp/fio-term.log; fail "fio term"; }
kill -TERM \$SERVER
wait_for "! kill -0 \$SERVER 2>/dev/null" "the server did not stop on SIGTERM with a file system mounted"
wait \$SERVER || fail "serve exited with \$? on SIGTERM"
grep -q "cache marked clean" /tmp/serve2.log || fail "no clean stop"
umount \$M 2>/dev/null || umount -l \$M
wait_for "[ ! -e /dev/ublkc0 ]" "device 0 never went after the stop"
echo "ublk-recovery-e2e: SIGTERM stopped the server and removed the device with the file system mounted"

echo "== 4. --ublk-recovery off: kill -9 under fio fails its I/O at once"
\$SERVE --ublk-recovery off > /tmp/serve3.log 2>&1 &
SERVER=\$!
wait_for "grep -q 'if killed' /tmp/serve3.log" "no /dev/ublkb0 with --ublk-recovery off"
grep -q "user recovery off" /tmp/serve3.log || { cat /tmp/serve3.log; fail "the startup does not say recovery is off"; }
mount -t ext4 /dev/ublkb0 \$M || fail "mount with recovery off"
for job in keep:4m crash1:16m term:4m; do
  fio_job \${job%%:*} \${job#*:} --verify_only > /tmp/fio-v.log 2>&1 || { cat /tmp/fio-v.log; fail "verify of \${job%%:*}"; }
done
echo "ublk-recovery-e2e: keep, crash1 and term (written before the SIGTERM, not fsynced) verified"
fio_job crash3 16m --do_verify=1 --rate_iops=,500 > /tmp/fio3.log 2>&1 &
FIO=\$!
kill_server_under_fio \$FIO
wait_for "! kill -0 \$FIO 2>/dev/null" "fio hangs on a device without user recovery whose server died"
if wait \$FIO; then fail "fio did not see its server die"; fi
\$PM ublk list | tee /tmp/list3.log
grep -q "ublkb0: dead" /tmp/list3.log || fail "the driver did not stop device 0 after its server died"
umount \$M 2>/dev/null || umount -l \$M
\$SERVE > /tmp/serve4.log 2>&1 &
SERVER=\$!
wait_for "grep -q 'ublk device:' /tmp/serve4.log" "no device after the crash without recovery"
grep -q "removed /dev/ublkb0, stopped" /tmp/serve4.log || { cat /tmp/serve4.log; fail "the dead device 0 was not removed"; }
DEV=\$(sed -n 's|.*ublk device: \(/dev/ublkb[0-9]*\).*|\1|p' /tmp/serve4.log)
grep -q "unclean shutdown" /tmp/serve4.log || { cat /tmp/serve4.log; fail "no recovery of the medium reported"; }
mount -t ext4 \$DEV \$M || fail "mount of \$DEV after the crash without recovery"
for job in keep:4m crash1:16m term:4m; do
  fio_job \${job%%:*} \${job#*:} --verify_only > /tmp/fio-v.log 2>&1 || { cat /tmp/fio-v.log; fail "verify of \${job%%:*}"; }
done
umount \$M
e2fsck -fn \$DEV > /tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "e2fsck after the crash without recovery"; }
echo "ublk-recovery-e2e: without recovery, fio failed at once; the restart removed the dead device, every fsynced block verified on \$DEV, e2fsck clean"
kill -TERM \$SERVER; wait \$SERVER || fail "serve exited with \$? on SIGTERM"
[ ! -b \$DEV ] || fail "\$DEV is still there after SIGTERM"
echo "ublk-recovery-e2e: OK"
GUEST

echo "== pmcache serve --ublk: crash and take-over in the guest"
"$here/run-in-guest.sh" --timeout 900 --mem 2048 --disk-mib 1024 ${PMCACHE_GUEST_ARGS:-} \
  --copy "$exe" --copy "$(command -v fio)" \
  --copy "$(command -v mkfs.ext4)" --copy "$(command -v e2fsck)" --copy "$script" \
  -- sh "$script"
echo "ublk-recovery-e2e: passed ($((SECONDS - start)) s in all)"
