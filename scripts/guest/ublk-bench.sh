#!/usr/bin/env bash
# fio 4 KiB random reads and writes at queue depth 1 and 32 on five block devices in one QEMU
# guest (run-in-guest.sh; this host's kernel has no ublk_drv or nbd), in rounds that
# alternate between them:
#
#   null-copy      rublk's ublk null target, copying data as pmcache does (the ublk frontend
#                  alone: the driver, the io_uring commands and the copy, no target work)
#   null-usercopy  the same with UBLK_F_USER_COPY: the null target never reads the data, so
#                  this is the frontend without the copy
#   pmcache-ublk   pmcache serve --ublk (1 queue of depth 128)
#   pmcache-ublk-poll
#                  the same with --ublk-poll: the queue thread polls its ring while requests
#                  come (and 1 ms after the last), rather than sleeping on it
#   pmcache-nbd    pmcache serve on a Unix socket, through the kernel's NBD client
#
# The three caches are 256 MiB in /dev/shm, each over a 1 GiB backing file; fio works on the
# first 128 MiB, written and flushed first, so reads are hits and writes overwrite cached
# blocks. The guest is emulated (TCG): only ratios within the run mean anything. Prints the
# median IOPS of each device and case, the ratios to the null target, and the pmcache
# servers' CPU.
#
#   scripts/guest/ublk-bench.sh [ROUNDS (3)] [SECONDS per run (5)]
#
# UBLK_QUEUES=N gives the ublk devices (pmcache's and the null targets) N queues (default 1).
# A polling server keeps one vCPU per queue busy while its device is measured: with the
# guest's two vCPUs, fio and the kernel share the other.
#
# Needs rublk (`cargo install rublk`; RUBLK=path, or found in PATH, or installed under
# target/rublk), nbd-client and fio on the host (installed when missing); builds pmcache in
# release.
source "$(dirname "$0")/lib.sh"
rounds="${1:-3}"
seconds="${2:-5}"
queues="${UBLK_QUEUES:-1}"

need_tools nbd-client:nbd-client fio:fio
need_rublk

build_pmcache release
commit=$(git rev-parse --short HEAD)
guest_script ublk-bench
out="$script.out"
on_exit 'rm -f "$out"'
cat > "$script" <<GUEST
set -eu
PM=$exe
RUBLK=$rublk
fail() { echo "ublk-bench: FAILED: \$*"; tail -n 20 /tmp/*.log 2>/dev/null; exit 1; }
wait_for() { i=0; while ! eval "\$1"; do i=\$((i+1)); [ \$i -lt 600 ] || fail "\$2"; sleep 0.1; done; }
for b in u p n; do dd if=/dev/zero of=/mnt/nvme/\$b.img bs=1M count=0 seek=1024 2>/dev/null; done
\$PM serve --ublk --ublk-queues $queues --cache /dev/shm/u.pm --cache-size 256M --backing /mnt/nvme/u.img \\
  --control /tmp/u.ctl > /tmp/serve-ublk.log 2>&1 &
UPID=\$!
wait_for "[ -b /dev/ublkb0 ]" "no /dev/ublkb0"
\$PM serve --cache /dev/shm/n.pm --cache-size 256M --backing /mnt/nvme/n.img \\
  --socket /tmp/nbd.sock --control /tmp/n.ctl > /tmp/serve-nbd.log 2>&1 &
NPID=\$!
wait_for "[ -S /tmp/nbd.sock ]" "no NBD socket"
nbd-client -u /tmp/nbd.sock /dev/nbd0 -N pmcache -b 4096 > /dev/null || fail "nbd-client"
\$RUBLK add null -n 1 -q $queues -d 128 --quiet > /tmp/rublk1.log 2>&1 || fail "rublk null"
\$RUBLK add null -n 2 -q $queues -d 128 -u --quiet > /tmp/rublk2.log 2>&1 || fail "rublk null -u"
wait_for "[ -b /dev/ublkb1 ] && [ -b /dev/ublkb2 ]" "no rublk devices"
\$PM serve --ublk --ublk-poll --ublk-queues $queues --cache /dev/shm/p.pm --cache-size 256M \\
  --backing /mnt/nvme/p.img --control /tmp/p.ctl > /tmp/serve-ublk-poll.log 2>&1 &
POLLPID=\$!
wait_for "grep -q 'ublk device:' /tmp/serve-ublk-poll.log" "no polling pmcache device"
PDEV=\$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' /tmp/serve-ublk-poll.log)
wait_for "[ -b \$PDEV ]" "no \$PDEV"
# cpu PID: clock ticks (user + system) of the whole process, and of its cleaner thread.
cpu() {
  all=\$(awk '{print \$14 + \$15}' /proc/\$1/stat)
  cleaner=0
  for t in /proc/\$1/task/*; do
    [ "\$(cat \$t/comm)" = pmcache-cleaner ] && cleaner=\$(awk '{print \$14 + \$15}' \$t/stat)
  done
  echo "\$all \$cleaner \$(awk '{print \$1 * 100}' /proc/uptime)"
}
for dev in /dev/ublkb0 \$PDEV /dev/nbd0; do
  fio --name=fill --filename=\$dev --rw=write --bs=1M --size=128M --direct=1 \\
    --ioengine=libaio --iodepth=4 > /tmp/fill.log 2>&1 || fail "filling \$dev"
done
for c in u p n; do \$PM flush --control /tmp/\$c.ctl > /dev/null 2>&1; done
echo "ublk-bench: 5 devices up (pmcache-ublk-poll: \$PDEV) (ublk: $queues queues of depth 128); \$(nproc) vCPUs; $rounds rounds of $seconds s runs"
for round in \$(seq 1 $rounds); do
  for case in randread:1 randread:32 randwrite:1 randwrite:32; do
    rw=\${case%%:*} qd=\${case#*:}
    for target in null-copy:/dev/ublkb1 null-usercopy:/dev/ublkb2 pmcache-ublk:/dev/ublkb0 \\
        pmcache-ublk-poll:\$PDEV pmcache-nbd:/dev/nbd0; do
      name=\${target%%:*} dev=\${target#*:}
      pid=; [ \$name = pmcache-ublk ] && pid=\$UPID; [ \$name = pmcache-nbd ] && pid=\$NPID
      [ \$name = pmcache-ublk-poll ] && pid=\$POLLPID
      [ -n "\$pid" ] && before=\$(cpu \$pid)
      line=\$(fio --name=b --filename=\$dev --rw=\$rw --bs=4k --size=128M --direct=1 \\
        --ioengine=libaio --iodepth=\$qd --time_based --runtime=$seconds --ramp_time=1 \\
        --minimal) || fail "fio \$rw QD\$qd on \$name"
      if [ \$rw = randread ]; then iops=\$(echo "\$line" | cut -d';' -f8); else iops=\$(echo "\$line" | cut -d';' -f49); fi
      echo "BENCH \$rw QD\$qd \$name \$round \$iops"
      if [ -n "\$pid" ]; then
        echo "\$before \$(cpu \$pid)" | awk -v c="\$rw QD\$qd \$name \$round" \
          '{ t = \$6 - \$3; printf "CPU %s %.2f %.2f\\n", c, (\$4 - \$1) / t, (\$5 - \$2) / t }'
      fi
    done
  done
done
nbd-client -d /dev/nbd0 > /dev/null
\$RUBLK del -n 1 > /dev/null 2>&1; \$RUBLK del -n 2 > /dev/null 2>&1
kill -TERM \$UPID \$NPID \$POLLPID 2>/dev/null || true
wait
echo "ublk-bench: done"
GUEST

echo "== ublk and NBD devices under fio in the guest (commit $commit)"
"$here/run-in-guest.sh" --timeout 2400 --mem 3072 --disk-mib 3072 ${PMCACHE_GUEST_ARGS:-} \
  --copy "$exe" --copy "$rublk" --copy "$(command -v nbd-client)" --copy "$(command -v fio)" \
  --copy "$script" -- sh "$script" | tee "$out"
grep -q "^ublk-bench: done" "$out" || { echo "ublk-bench: the guest run failed"; exit 1; }

# Medians per case and device, then ratios to the null target (copying) of the same case.
grep "^BENCH " "$out" | awk -v rounds="$rounds" '
  { key = $2 " " $3; dev = $4; v[key, dev, ++n[key, dev]] = $6; cases[key] = 1; devs[dev] = 1 }
  function median(key, dev,   i, j, k, t, a) {
    k = n[key, dev]
    for (i = 1; i <= k; i++) a[i] = v[key, dev, i]
    for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return (k % 2) ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
  }
  END {
    printf "%-14s %-17s %12s %10s   %s\n", "case", "device", "IOPS (median)", "vs null", "runs"
    split("randread QD1,randread QD32,randwrite QD1,randwrite QD32", order, ",")
    split("null-copy,null-usercopy,pmcache-ublk,pmcache-ublk-poll,pmcache-nbd", names, ",")
    for (c = 1; c <= 4; c++) {
      key = order[c]; base = median(key, "null-copy")
      for (d = 1; d <= 5; d++) {
        dev = names[d]; m = median(key, dev); runs = ""
        for (i = 1; i <= n[key, dev]; i++) runs = runs (i > 1 ? ", " : "") v[key, dev, i]
        printf "%-14s %-17s %12.0f %10.3f   %s\n", key, dev, m, m / base, runs
      }
      printf "%-14s %-17s %12s %10.3f   (pmcache-ublk / pmcache-nbd)\n", key, "ublk vs nbd", "", median(key, "pmcache-ublk") / median(key, "pmcache-nbd")
      printf "%-14s %-17s %12s %10.3f   (pmcache-ublk-poll / pmcache-ublk)\n", key, "poll vs sleep", "", median(key, "pmcache-ublk-poll") / median(key, "pmcache-ublk")
    }
  }'

# The servers' CPU over each run (ramp included), in cores busy: the whole process and its
# cleaner thread; medians of the rounds.
echo
grep "^CPU " "$out" | awk '
  { key = $2 " " $3 " " $4; k = ++n[key]; all[key, k] = $6; cl[key, k] = $7; keys[key] = 1 }
  function median(arr, key, count,   i, j, t, a) {
    for (i = 1; i <= count; i++) a[i] = arr[key, i]
    for (i = 1; i <= count; i++) for (j = i + 1; j <= count; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return (count % 2) ? a[(count + 1) / 2] : (a[count / 2] + a[count / 2 + 1]) / 2
  }
  END {
    printf "%-14s %-17s %18s %16s\n", "case", "server", "CPU (cores busy)", "of it, cleaner"
    split("randread QD1,randread QD32,randwrite QD1,randwrite QD32", order, ",")
    split("pmcache-ublk,pmcache-ublk-poll,pmcache-nbd", names, ",")
    for (c = 1; c <= 4; c++) for (d = 1; d <= 3; d++) {
      key = order[c] " " names[d]
      if (n[key]) printf "%-14s %-17s %18.2f %16.2f\n", order[c], names[d], median(all, key, n[key]), median(cl, key, n[key])
    }
  }'
