#!/usr/bin/env bash
# `pmcache serve --ublk`, a kernel block device through the ublk driver, in the QEMU guest of
# run-in-guest.sh (this host's kernel has no ublk_drv). In the guest: serve a 16 MiB cache in
# /dev/shm over a backing file on the guest's ext4 disk as /dev/ublkb0; mkfs.ext4, mount, fio
# writing and verifying (crc32c) 32 MiB, more than the cache holds, so the cleaner writes back
# (checked in `stats`); unmount; `pmcache detach` (every dirty block written back, the device
# removed); e2fsck the backing file itself, mount it through a loop device and verify every
# block fio wrote in it, without pmcache; then serve it again with a fresh cache and verify
# every block fio wrote through the new device, and stop with SIGTERM. Then a cache shared by
# two backing stores (`--store a=... --store b=...`), each its own device: each reads back its
# own data; stats per store; `detach --store a` while b is served; SIGTERM writes b back; a
# restart without b's backing file refuses b by name and serves a. Then polling queue threads
# (`serve --ublk --ublk-poll`): fio writes and verifies (crc32c) 16 MiB on the device itself
# at queue depth 1 and 16, the startup line says polling is on, `stats` counts polls (and
# none without --ublk-poll), SIGTERM stops it. Last, `pmcache ublk null --ublk-poll`: its device
# reads zeroes, takes writes and is removed on SIGTERM.
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
grep -Eq '"ublk_polls":0([,}]|\$)' /tmp/stats.json || fail "polls counted without --ublk-poll"
grep -q 'polling: off' /tmp/serve.log || fail "the startup line does not say polling is off"
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
# A cache medium shared by two backing stores (serve --store a=... --store b=...): one
# device per store, which is which read from the log; each device holds its own data only;
# stats of one store and of both; "detach --store a" writes a back and removes its device
# while b is served; SIGTERM writes b back and removes its device; a restart with b's backing
# file missing refuses b by name and serves a.
C=/dev/shm/shared.pm
BA=/mnt/nvme/store-a.img
BB=/mnt/nvme/store-b.img
serve_stores() { # serve_stores LOG N STORE-ARGS...: the stores over \$C, until N devices are up
  log=\$1; n=\$2; shift 2
  \$PM serve --ublk --cache \$C --cache-size 32M "\$@" > "\$log" 2>&1 &
  SERVER=\$!
  i=0; while :; do
    up=\$(grep -c 'ublk device:' "\$log" 2>/dev/null) || up=0; [ "\$up" -lt "\$n" ] || break
    i=\$((i+1)); [ \$i -lt 600 ] && kill -0 \$SERVER 2>/dev/null || fail "\$n device(s) did not start"; sleep 0.1
  done
}
dev_of() { # dev_of LOG NAME: the device of store NAME, from its "store:" line and the next
  awk -v name="\$2" '\$1 == "store:" { s = \$2; next }
    \$1 == "ublk" && \$2 == "device:" && s == name { print \$3 } { s = "" }' "\$1"
}
wait_dev() { # wait_dev DEV: until its node is there
  i=0; while [ ! -b "\$1" ]; do i=\$((i+1)); [ \$i -lt 100 ] || fail "no node \$1"; sleep 0.1; done
}
gone() { # gone DEV WHY: fails unless DEV goes away within 5 s
  i=0; while [ -b "\$1" ]; do i=\$((i+1)); [ \$i -lt 50 ] || fail "\$1 is still there \$2"; sleep 0.1; done
}
readback() { # readback DEV DATA WHAT: the first 4 MiB of DEV (O_DIRECT) are DATA
  dd if=\$1 of=/tmp/readback.dat bs=1M count=4 iflag=direct 2>/dev/null || fail "read of \$1 (\$3)"
  cmp /tmp/readback.dat \$2 || fail "\$1 does not read back \$3"
}
rm -f \$C \$C.*.ctl /mnt/nvme/*.pmcache-state
dd if=/dev/zero of=\$BA bs=1M count=0 seek=64 2>/dev/null
dd if=/dev/zero of=\$BB bs=1M count=0 seek=64 2>/dev/null
dd if=/dev/urandom of=/tmp/a.dat bs=1M count=4 2>/dev/null
dd if=/dev/urandom of=/tmp/b.dat bs=1M count=4 2>/dev/null
serve_stores /tmp/serve-stores.log 2 --store a=\$BA --store b=\$BB
DA=\$(dev_of /tmp/serve-stores.log a); DB=\$(dev_of /tmp/serve-stores.log b)
[ -n "\$DA" ] && [ -n "\$DB" ] && [ "\$DA" != "\$DB" ] \\
  || fail "no device of its own for each store (a: '\$DA', b: '\$DB')"
wait_dev \$DA; wait_dev \$DB
for d in \$DA \$DB; do
  [ "\$(cat /sys/block/\${d#/dev/}/size)" = 131072 ] || fail "\$d is not 64 MiB"
done
echo "ublk-e2e: stores: a served as \$DA, b as \$DB (64 MiB each, over a 32 MiB cache)"
dd if=/tmp/a.dat of=\$DA bs=1M oflag=direct 2>/dev/null || fail "write to store a's device"
dd if=/tmp/b.dat of=\$DB bs=1M oflag=direct 2>/dev/null || fail "write to store b's device"
readback \$DA /tmp/a.dat "store a's data"
readback \$DB /tmp/b.dat "store b's data"
echo "ublk-e2e: stores: each device reads back its own 4 MiB"
\$PM stats --cache \$C --store a --json > /tmp/stats-a.json 2>&1 || { cat /tmp/stats-a.json; fail "stats --store a"; }
grep -Eq '"bytes_written":4194304([,}]|\$)' /tmp/stats-a.json \\
  || { cat /tmp/stats-a.json; fail "store a's stats do not count its 4 MiB written (only)"; }
\$PM stats --cache \$C > /tmp/stats-all.txt 2>&1 || { cat /tmp/stats-all.txt; fail "stats of every store"; }
grep -qx '== store a ==' /tmp/stats-all.txt && grep -qx '== store b ==' /tmp/stats-all.txt \\
  || { cat /tmp/stats-all.txt; fail "stats without --store lacks a store's heading"; }
echo "ublk-e2e: stores: stats --store a --json (4 MiB written), stats of both under their headings"
\$PM detach --cache \$C --store a > /tmp/detach-a.log 2>&1 || { cat /tmp/detach-a.log; fail "detach --store a"; }
gone \$DA "after detach of store a"
kill -0 \$SERVER 2>/dev/null || fail "the server stopped with store a's detach"
grep -q 'store "a": cache marked clean' /tmp/serve-stores.log || fail "no clean detach of store a in the log"
[ -b \$DB ] || fail "\$DB (store b) went away with store a's detach"
readback \$DB /tmp/b.dat "store b's data after store a's detach"
cmp -n 4194304 /tmp/a.dat \$BA || fail "store a's backing file lacks a's data after its detach"
\$PM stats --cache \$C > /tmp/stats-b.txt 2>&1 || { cat /tmp/stats-b.txt; fail "stats after store a's detach"; }
grep -q '== store a ==' /tmp/stats-b.txt && { cat /tmp/stats-b.txt; fail "stats still shows store a after its detach"; }
echo "ublk-e2e: stores: a detached (\$DA gone, its backing file holds its data), b still served"
kill -TERM \$SERVER; wait \$SERVER || fail "serve (stores) exited with \$? on SIGTERM"
gone \$DB "after SIGTERM"
grep -q 'store "b": cache marked clean' /tmp/serve-stores.log || fail "no clean stop of store b"
cmp -n 4194304 /tmp/b.dat \$BB || fail "store b's backing file lacks b's data after SIGTERM"
echo "ublk-e2e: stores: SIGTERM: b written back (its backing file holds its data), \$DB gone"
mv \$BB \$BB.away
serve_stores /tmp/serve-stores2.log 1 --store a=\$BA --store b=\$BB
grep -q 'pmcache: not serving store "b"' /tmp/serve-stores2.log || fail "store b (no backing file) not refused by name"
sleep 1 # a second device would be up by now
[ "\$(grep -c 'ublk device:' /tmp/serve-stores2.log)" = 1 ] || fail "not exactly one device without b's backing file"
DA=\$(dev_of /tmp/serve-stores2.log a)
[ -n "\$DA" ] || fail "store a not served without b's backing file"
wait_dev \$DA
readback \$DA /tmp/a.dat "store a's data after a restart without store b"
[ ! -e \$C.b.ctl ] || fail "a control socket for store b, which is not served"
kill -TERM \$SERVER; wait \$SERVER || fail "serve (store a alone) exited with \$? on SIGTERM"
gone \$DA "after SIGTERM (store a alone)"
grep -q 'store "a": cache marked clean' /tmp/serve-stores2.log || fail "no clean stop of store a (alone)"
mv \$BB.away \$BB
echo "ublk-e2e: stores: without b's backing file: b refused by name, a served (\$DA, its data read back)"
# Polling queue threads: a fresh cache over a backing file of its own; fio writes and
# verifies 16 MiB through the device, half at queue depth 1, half at 16 (reads of blocks the
# cache no longer holds: target reads in flight, completed through the ring's poll).
BP=/mnt/nvme/poll.img
rm -f /dev/shm/poll.pm \$BP.pmcache-state
dd if=/dev/zero of=\$BP bs=1M count=0 seek=64 2>/dev/null
\$PM serve --ublk --ublk-poll --ublk-poll-idle-us 500 --cache /dev/shm/poll.pm --cache-size 8M \\
  --backing \$BP --control /tmp/poll.ctl > /tmp/serve-poll.log 2>&1 &
SERVER=\$!
i=0; while ! grep -q "ublk device:" /tmp/serve-poll.log; do
  i=\$((i+1)); [ \$i -lt 600 ] && kill -0 \$SERVER 2>/dev/null || fail "serve --ublk-poll did not start"; sleep 0.1
done
D=\$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' /tmp/serve-poll.log)
wait_dev \$D
grep -q "polling: on, 500 µs after the last request" /tmp/serve-poll.log \\
  || fail "the startup line does not say polling is on"
fio --filename=\$D --direct=1 --rw=randwrite --bs=4k --size=8m --verify=crc32c --verify_fatal=1 \\
  --do_verify=1 --verify_state_save=0 --group_reporting \\
  --name=qd1 --ioengine=psync --offset=0 \\
  --name=qd16 --ioengine=libaio --iodepth=16 --offset=8m > /tmp/fio-poll.log 2>&1 \\
  || { cat /tmp/fio-poll.log; fail "fio through the polling device"; }
grep -E "WRITE:|READ:" /tmp/fio-poll.log
\$PM stats --json --control /tmp/poll.ctl > /tmp/stats-poll.json || fail "stats (polling)"
grep -Eq '"ublk_polls":[1-9]' /tmp/stats-poll.json || { cat /tmp/stats-poll.json; fail "no poll counted with --ublk-poll"; }
grep -Eq '"ublk_poll_idle_us":500([,}]|\$)' /tmp/stats-poll.json || fail "stats lack the polling budget"
kill -TERM \$SERVER; wait \$SERVER || fail "serve --ublk-poll exited with \$? on SIGTERM"
grep -q "cache marked clean" /tmp/serve-poll.log || fail "no clean stop (polling)"
gone \$D "after SIGTERM (polling)"
# SIGTERM wrote every block back: the backing file itself verifies.
fio --filename=\$BP --direct=1 --rw=randwrite --bs=4k --size=8m --verify=crc32c --verify_fatal=1 \\
  --verify_only --verify_state_save=0 --group_reporting \\
  --name=qd1 --ioengine=psync --offset=0 \\
  --name=qd16 --ioengine=libaio --iodepth=16 --offset=8m > /tmp/fio-poll-raw.log 2>&1 \\
  || { cat /tmp/fio-poll-raw.log; fail "fio verify of the polling device's backing file"; }
echo "ublk-e2e: --ublk-poll: fio wrote and verified 16 MiB at QD1 and QD16 through an 8 MiB" \\
  "cache, polls counted, SIGTERM wrote it all back (the backing file verifies)"
# The null device (the frontend's ceiling in benchmarks), its queue polling: reads zeroes,
# takes writes, and goes away on SIGTERM.
\$PM ublk null --size 64M --ublk-poll > /tmp/serve-null.log 2>&1 &
NULL=\$!
i=0; while ! grep -q "ublk device:" /tmp/serve-null.log; do
  i=\$((i+1)); [ \$i -lt 300 ] && kill -0 \$NULL 2>/dev/null || fail "ublk null did not start"; sleep 0.1
done
D=\$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' /tmp/serve-null.log)
grep -q "polling: on, 1000 µs after the last request" /tmp/serve-null.log \\
  || fail "ublk null --ublk-poll does not say polling is on"
[ "\$(cat /sys/block/\${D#/dev/}/size)" = 131072 ] || fail "the null device is not 64 MiB"
dd if=/dev/urandom of=\$D bs=1M count=4 oflag=direct 2>/dev/null || fail "write to the null device"
[ "\$(dd if=\$D bs=1M count=4 iflag=direct 2>/dev/null | tr -d '\\000' | wc -c)" = 0 ] \
  || fail "the null device read something other than zeroes"
kill -TERM \$NULL; wait \$NULL || fail "ublk null exited with \$? on SIGTERM"
[ ! -b \$D ] || fail "\$D is still there after SIGTERM"
echo "ublk-e2e: ublk null --ublk-poll: zeroes read, writes taken, removed on SIGTERM"
echo "ublk-e2e: OK"
GUEST

echo "== pmcache serve --ublk in the guest"
"$here/run-in-guest.sh" --timeout 900 --mem 2048 --disk-mib 1024 ${PMCACHE_GUEST_ARGS:-} \
  --copy "$exe" --copy "$(command -v fio)" \
  --copy "$(command -v mkfs.ext4)" --copy "$(command -v e2fsck)" --copy "$script" \
  -- sh "$script"
echo "ublk-e2e: passed ($((SECONDS - start)) s in all)"
