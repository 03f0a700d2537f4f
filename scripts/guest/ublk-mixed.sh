#!/usr/bin/env bash
# Cache hits beside misses on a kernel block device, in one QEMU guest (run-in-guest.sh; this
# host's kernel has no ublk_drv): `pmcache serve --ublk` (1 queue of depth 128) with a 256 MiB
# cache in /dev/shm in front of a 1 GiB backing file given `--backing-latency` (2ms unless
# LATENCY is set). The first 64 MiB (the hot zone) are read once at QD 32, so they are cached;
# then fio reads 4 KiB at random at QD 16 (libaio, O_DIRECT) in rounds of three runs each:
#
#   all-hit  the hot zone only
#   mixed    90 % of the reads in the hot zone, 10 % in the cold rest (random_distribution)
#   store    the same mix on a second device, in --mode passthrough (every read a miss)
#
# fio logs every request's latency with its offset; the guest splits them into hot-zone
# reads (hits) and cold-zone reads (misses) and prints their percentiles. The guest is
# emulated (TCG): only ratios within the run mean anything. Prints the medians of the rounds:
# IOPS, hot p50/p90, cold p50, and the mixed run's hot p50 and p90 over the all-hit run's.
#
#   scripts/guest/ublk-mixed.sh [ROUNDS (3)] [SECONDS per run (10)]
#
# Needs fio on the host (installed when missing); builds pmcache in release with ublk.
source "$(dirname "$0")/lib.sh"
rounds="${1:-3}"
seconds="${2:-10}"
latency="${LATENCY:-2ms}"

need_tools fio:fio
build_pmcache release
commit=$(git rev-parse --short HEAD)
guest_script ublk-mixed
out="$script.out"
on_exit 'rm -f "$out"'
cat > "$script" <<GUEST
set -eu
PM=$exe
fail() { echo "ublk-mixed: FAILED: \$*"; tail -n 20 /tmp/*.log 2>/dev/null; exit 1; }
wait_for() { i=0; while ! eval "\$1"; do i=\$((i+1)); [ \$i -lt 600 ] || fail "\$2"; sleep 0.1; done; }
for b in u s; do dd if=/dev/zero of=/mnt/nvme/\$b.img bs=1M count=0 seek=1024 2>/dev/null; done
\$PM serve --ublk --cache /dev/shm/u.pm --cache-size 256M --backing /mnt/nvme/u.img \\
  --backing-latency $latency --control /tmp/u.ctl > /tmp/serve-ublk.log 2>&1 &
wait_for "[ -b /dev/ublkb0 ]" "no /dev/ublkb0"
\$PM serve --ublk --cache /dev/shm/s.pm --cache-size 256M --backing /mnt/nvme/s.img \\
  --backing-latency $latency --mode passthrough --control /tmp/s.ctl > /tmp/serve-store.log 2>&1 &
wait_for "[ -b /dev/ublkb1 ]" "no /dev/ublkb1"
fio --name=warm --filename=/dev/ublkb0 --rw=randread --bs=4k --size=64M --direct=1 \\
  --ioengine=libaio --iodepth=32 > /tmp/warm.log 2>&1 || fail "warming the hot zone"
# pct FILE Q: the Q-quantile of the sorted numbers in FILE (µs from ns).
pct() { n=\$(wc -l < \$1); [ \$n -gt 0 ] || { echo nan; return; }
  awk -v q=\$2 -v n=\$n 'NR == int((n - 1) * q + 0.5) + 1 { printf "%.0f", \$1 / 1000; exit }' \$1; }
echo "ublk-mixed: backing latency $latency, \$(nproc) vCPUs, $rounds rounds of $seconds s runs"
for round in \$(seq 1 $rounds); do
  for case in all-hit:/dev/ublkb0 mixed:/dev/ublkb0 store:/dev/ublkb1; do
    name=\${case%%:*} dev=\${case#*:}
    if [ \$name = all-hit ]; then span="--size=64M"; else
      span="--size=1G --random_distribution=zoned:90/6.25:10/93.75"; fi
    rm -f /tmp/lat_lat.*.log
    line=\$(fio --name=m --filename=\$dev --rw=randread --bs=4k \$span --direct=1 --norandommap \\
      --randrepeat=0 --ioengine=libaio --iodepth=16 --time_based --runtime=$seconds \\
      --write_lat_log=/tmp/lat --log_offset=1 --minimal) || fail "fio \$name"
    iops=\$(echo "\$line" | cut -d';' -f8)
    awk -F', ' '\$5 < 67108864 { print \$2 > "/tmp/hot.txt" } \$5 >= 67108864 { print \$2 > "/tmp/cold.txt" }' /tmp/lat_lat.*.log
    touch /tmp/hot.txt /tmp/cold.txt
    sort -n -o /tmp/hot.txt /tmp/hot.txt; sort -n -o /tmp/cold.txt /tmp/cold.txt
    echo "MIXED \$name \$round \$iops \$(pct /tmp/hot.txt 0.5) \$(pct /tmp/hot.txt 0.9) \$(pct /tmp/cold.txt 0.5) \$(pct /tmp/cold.txt 0.9)"
    rm -f /tmp/hot.txt /tmp/cold.txt
  done
done
\$PM stats --all --control /tmp/u.ctl | grep -E "read_(hit|miss)_latency|read_hits|read_misses" || true
kill -TERM %1 %2 2>/dev/null || true
wait
echo "ublk-mixed: done"
GUEST

echo "== ublk: hits beside misses in front of a $latency store (commit $commit)"
"$here/run-in-guest.sh" --timeout 2400 --mem 3072 --disk-mib 3072 ${PMCACHE_GUEST_ARGS:-} \
  --copy "$exe" --copy "$(command -v fio)" --copy "$script" -- sh "$script" | tee "$out"
grep -q "^ublk-mixed: done" "$out" || { echo "ublk-mixed: the guest run failed"; exit 1; }

grep "^MIXED " "$out" | awk '
  { name = $2; k = ++n[name]; for (f = 4; f <= 8; f++) v[name, f, k] = $f }
  function median(name, f,   i, j, t, a, k) {
    k = n[name]
    for (i = 1; i <= k; i++) a[i] = v[name, f, i]
    for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
    return (k % 2) ? a[(k + 1) / 2] : (a[k / 2] + a[k / 2 + 1]) / 2
  }
  END {
    printf "%-8s %10s %12s %12s %13s %13s\n", "run", "IOPS", "hot p50 µs", "hot p90 µs", "cold p50 µs", "cold p90 µs"
    split("all-hit,mixed,store", names, ",")
    for (d = 1; d <= 3; d++) {
      name = names[d]
      printf "%-8s %10.0f %12s %12s %13s %13s\n", name, median(name, 4), median(name, 5), median(name, 6), median(name, 7), median(name, 8)
    }
    printf "mixed (90%% hits) vs all-hit: hot p50 %.2fx, hot p90 %.2fx\n", median("mixed", 5) / median("all-hit", 5), median("mixed", 6) / median("all-hit", 6)
  }'
