#!/usr/bin/env bash
# `pmcache serve --ublk`, a kernel block device through the ublk driver, in the QEMU guest of
# run-in-guest.sh (this host's kernel has no ublk_drv). In the guest: serve a 16 MiB cache in
# /dev/shm over a backing file on the guest's ext4 disk as /dev/ublkb0; mkfs.ext4, mount, fio
# writing and verifying (crc32c) 32 MiB, more than the cache holds, so the cleaner writes back
# (checked in `stats`); unmount; `pmcache detach` (every dirty block written back, the device
# removed); e2fsck the backing file itself, mount it through a loop device and verify every
# block fio wrote in it, without pmcache; then serve it again with a fresh cache and verify
# every block fio wrote through the new device, and stop with SIGTERM. Last, `pmcache ublk null`:
# its device reads zeroes, takes writes and is removed on SIGTERM.
#
#   scripts/guest/ublk-e2e.sh
#
# Builds `pmcache` (profile test-opt) and installs fio and e2fsprogs on the host when missing
# (their binaries and libraries are copied into the guest).
source "$(dirname "$0")/lib.sh"
need_tools fio:fio mkfs.ext4:e2fsprogs e2fsck:e2fsprogs
build_pmcache test-opt
guest_script ublk-e2e
cat > "$script" <<GUEST
set -eu
PM=$exe
B=/mnt/nvme/backing.img
M=/mnt/fs
fail() { echo "ublk-e2e: FAILED: \$*"; tail -n 30 /tmp/serve*.log 2>/dev/null; exit 1; }
serve() { # serve LOG: a fresh cache medium in /dev/shm (16 MiB) over the backing file
  rm -f /dev/shm/cache.pm \$B.pmcache-state
  \$PM serve --ublk --cache /dev/shm/cache.pm --cache-size 16M --backing \$B \\
    --control /tmp/pm.ctl > "\$1" 2>&1 &
  SERVER=\$!
  i=0; while [ ! -b /dev/ublkb0 ]; do i=\$((i+1)); [ \$i -lt 600 ] || fail "no /dev/ublkb0"; sleep 0.1; done
}
dd if=/dev/zero of=\$B bs=1M count=0 seek=512 2>/dev/null
serve /tmp/serve.log
echo "ublk-e2e: /dev/ublkb0 is \$(cat /sys/block/ublkb0/size) sectors of" \\
  "\$(cat /sys/block/ublkb0/queue/logical_block_size) B, rotational=\$(cat /sys/block/ublkb0/queue/rotational)"
mkfs.ext4 -q -F /dev/ublkb0 || fail "mkfs.ext4"
mkdir -p \$M && mount -t ext4 /dev/ublkb0 \$M || fail "mount"
fio --name=verify --directory=\$M --ioengine=psync --direct=1 --rw=randwrite --bs=4k \\
  --size=16m --numjobs=2 --verify=crc32c --verify_fatal=1 --do_verify=1 \\
  --verify_state_save=0 --group_reporting > /tmp/fio.log 2>&1 || { cat /tmp/fio.log; fail "fio"; }
grep -E "WRITE:|READ:" /tmp/fio.log
\$PM stats --json --control /tmp/pm.ctl > /tmp/stats.json || fail "stats"
grep -q '"cleaner_blocks_cleaned":0,' /tmp/stats.json && fail "the cleaner wrote nothing back"
umount \$M || fail "umount"
\$PM detach --cache /dev/shm/cache.pm --control /tmp/pm.ctl > /tmp/detach.log 2>&1 || { cat /tmp/detach.log; fail "detach"; }
wait \$SERVER || fail "serve exited with \$? after detach"
[ ! -b /dev/ublkb0 ] || fail "/dev/ublkb0 is still there after detach"
e2fsck -fn \$B > /tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "e2fsck of the backing file"; }
echo "ublk-e2e: detached; e2fsck -fn of the backing file: clean"
# The backing file's own bytes, without pmcache: mounted through a loop device, every block
# fio wrote verified.
mkdir -p /mnt/raw && mount -t ext4 -o loop \$B /mnt/raw || fail "loop mount of the backing file"
fio --name=verify --directory=/mnt/raw --ioengine=psync --direct=1 --rw=randwrite --bs=4k \\
  --size=16m --numjobs=2 --verify=crc32c --verify_fatal=1 --verify_only \\
  --verify_state_save=0 --group_reporting > /tmp/fio-raw.log 2>&1 || { cat /tmp/fio-raw.log; fail "fio verify of the backing file"; }
umount /mnt/raw
echo "ublk-e2e: every block fio wrote is in the backing file itself (loop mount, fio verify)"
serve /tmp/serve2.log
mount -t ext4 /dev/ublkb0 \$M || fail "mount (again)"
fio --name=verify --directory=\$M --ioengine=psync --direct=1 --rw=randwrite --bs=4k \\
  --size=16m --numjobs=2 --verify=crc32c --verify_fatal=1 --verify_only \\
  --verify_state_save=0 --group_reporting > /tmp/fio2.log 2>&1 || { cat /tmp/fio2.log; fail "fio verify after a fresh start"; }
grep -E "READ:" /tmp/fio2.log
umount \$M
kill -TERM \$SERVER; wait \$SERVER || fail "serve exited with \$? on SIGTERM"
grep -q "cache marked clean" /tmp/serve2.log || fail "no clean stop"
[ ! -b /dev/ublkb0 ] || fail "/dev/ublkb0 is still there after SIGTERM"
# The null device (the frontend's ceiling in benchmarks): reads zeroes, takes writes, and
# goes away on SIGTERM.
\$PM ublk null --size 64M > /tmp/serve-null.log 2>&1 &
NULL=\$!
i=0; while ! grep -q "ublk device:" /tmp/serve-null.log; do
  i=\$((i+1)); [ \$i -lt 300 ] && kill -0 \$NULL 2>/dev/null || fail "ublk null did not start"; sleep 0.1
done
D=\$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' /tmp/serve-null.log)
[ "\$(cat /sys/block/\${D#/dev/}/size)" = 131072 ] || fail "the null device is not 64 MiB"
dd if=/dev/urandom of=\$D bs=1M count=4 oflag=direct 2>/dev/null || fail "write to the null device"
[ "\$(dd if=\$D bs=1M count=4 iflag=direct 2>/dev/null | tr -d '\\000' | wc -c)" = 0 ] \
  || fail "the null device read something other than zeroes"
kill -TERM \$NULL; wait \$NULL || fail "ublk null exited with \$? on SIGTERM"
[ ! -b \$D ] || fail "\$D is still there after SIGTERM"
echo "ublk-e2e: ublk null: zeroes read, writes taken, removed on SIGTERM"
echo "ublk-e2e: OK"
GUEST

echo "== pmcache serve --ublk in the guest"
"$here/run-in-guest.sh" --timeout 900 --mem 2048 --disk-mib 1024 ${PMCACHE_GUEST_ARGS:-} \
  --copy "$exe" --copy "$(command -v fio)" \
  --copy "$(command -v mkfs.ext4)" --copy "$(command -v e2fsck)" --copy "$script" \
  -- sh "$script"
echo "ublk-e2e: passed ($((SECONDS - start)) s in all)"
