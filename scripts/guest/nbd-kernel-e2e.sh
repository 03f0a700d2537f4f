#!/usr/bin/env bash
# The path users of kernels without ublk take: the kernel's NBD client (`nbd-client`, the nbd
# module) on `pmcache serve`, in the QEMU guest of run-in-guest.sh (this host's kernel has no
# nbd module). In the guest: serve a 16 MiB cache in /dev/shm over a backing file on the guest's
# ext4 disk; attach /dev/nbd0; mkfs.ext4, mount, fio writing and verifying (crc32c) 32 MiB,
# more than the cache holds, so the cleaner writes back (checked in `stats`); unmount, detach,
# SIGTERM (a volatile medium: every dirty block is written back first); e2fsck the backing file
# itself; then serve it again with a fresh cache and verify every block fio wrote, through the
# kernel client once more.
#
#   scripts/guest/nbd-kernel-e2e.sh
#
# Builds `pmcache` (profile test-opt) and installs nbd-client, fio and e2fsprogs on the host
# when missing (their binaries and libraries are copied into the guest).
source "$(dirname "$0")/lib.sh"
need_tools nbd-client:nbd-client fio:fio mkfs.ext4:e2fsprogs e2fsck:e2fsprogs
build_pmcache test-opt
guest_script nbd-kernel-e2e
cat > "$script" <<GUEST
set -eu
PM=$exe
B=/mnt/nvme/backing.img
M=/mnt/fs
fail() { echo "nbd-kernel-e2e: FAILED: \$*"; cat /tmp/serve.log 2>/dev/null | tail -n 30; exit 1; }
serve() { # serve LOG: a fresh cache medium in /dev/shm (16 MiB) over the backing file
  rm -f /dev/shm/cache.pm /tmp/nbd.sock \$B.pmcache-state
  \$PM serve --cache /dev/shm/cache.pm --cache-size 16M --backing \$B --socket /tmp/nbd.sock \\
    --control /tmp/pm.ctl > "\$1" 2>&1 &
  SERVER=\$!
  i=0; while [ ! -S /tmp/nbd.sock ]; do i=\$((i+1)); [ \$i -lt 600 ] || fail "no socket"; sleep 0.1; done
}
stop() {
  kill -TERM \$SERVER; wait \$SERVER || fail "serve exited with \$?"
  grep -q "cache marked clean" "\$1" || fail "no clean stop in \$1"
}
dd if=/dev/zero of=\$B bs=1M count=0 seek=512 2>/dev/null
serve /tmp/serve.log
nbd-client -u /tmp/nbd.sock /dev/nbd0 -N pmcache -b 4096 || fail "nbd-client"
echo "nbd-kernel-e2e: /dev/nbd0 is \$(cat /sys/block/nbd0/size) sectors"
mkfs.ext4 -q -F /dev/nbd0 || fail "mkfs.ext4"
mkdir -p \$M && mount -t ext4 /dev/nbd0 \$M || fail "mount"
fio --name=verify --directory=\$M --ioengine=psync --direct=1 --rw=randwrite --bs=4k \\
  --size=16m --numjobs=2 --verify=crc32c --verify_fatal=1 --do_verify=1 \\
  --verify_state_save=0 --group_reporting > /tmp/fio.log 2>&1 || { cat /tmp/fio.log; fail "fio"; }
grep -E "WRITE:|READ:" /tmp/fio.log
\$PM stats --json --control /tmp/pm.ctl > /tmp/stats.json || fail "stats"
grep -q '"cleaner_blocks_cleaned":0,' /tmp/stats.json && fail "the cleaner wrote nothing back"
umount \$M || fail "umount"
nbd-client -d /dev/nbd0 || fail "nbd-client -d"
stop /tmp/serve.log
e2fsck -fn \$B > /tmp/fsck.log 2>&1 || { cat /tmp/fsck.log; fail "e2fsck of the backing file"; }
echo "nbd-kernel-e2e: e2fsck -fn of the backing file after the stop: clean"
serve /tmp/serve2.log
nbd-client -u /tmp/nbd.sock /dev/nbd0 -N pmcache -b 4096 || fail "nbd-client (again)"
mount -t ext4 /dev/nbd0 \$M || fail "mount (again)"
fio --name=verify --directory=\$M --ioengine=psync --direct=1 --rw=randwrite --bs=4k \\
  --size=16m --numjobs=2 --verify=crc32c --verify_fatal=1 --verify_only \\
  --verify_state_save=0 --group_reporting > /tmp/fio2.log 2>&1 || { cat /tmp/fio2.log; fail "fio verify after a fresh start"; }
grep -E "READ:" /tmp/fio2.log
umount \$M && nbd-client -d /dev/nbd0
stop /tmp/serve2.log
echo "nbd-kernel-e2e: OK"
GUEST

echo "== kernel NBD client on pmcache serve, in the guest"
"$here/run-in-guest.sh" --timeout 900 --mem 2048 --disk-mib 1024 ${PMCACHE_GUEST_ARGS:-} \
  --copy "$exe" --copy "$(command -v nbd-client)" --copy "$(command -v fio)" \
  --copy "$(command -v mkfs.ext4)" --copy "$(command -v e2fsck)" --copy "$script" \
  -- sh "$script"
echo "nbd-kernel-e2e: passed ($((SECONDS - start)) s in all)"
