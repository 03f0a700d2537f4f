#!/usr/bin/env bash
# Paper 004's Fig 1 on a drive with poll queues: `pmcache bench paper 004-fig1` runs inside a
# QEMU guest whose scratch disk is an emulated NVMe drive with poll queues (run-in-guest.sh,
# ext4 on /dev/nvme0n1 at /mnt/nvme), jobs 1 to 8 on the guest's 2 CPUs. tracefs is mounted so
# that the experiment counts each engine's reads by NVMe queue: the figures' notes say which
# reads went to the poll queues (io_uring with IOPOLL) and which did not (on the guest's 6.12
# kernel ext4 submits pvsync2's synchronous RWF_HIPRI reads unpolled). The figures' JSON comes
# back on the guest's console and is written to OUT (with its SVG and PNG drawn on the host).
#
#   scripts/guest/paper004.sh [--scale smallest|small|full] [--runs N] --out DIR
#
# Builds `pmcache` (profile test-opt) and installs fio on the host when missing (its binary and
# libraries are copied into the guest). The guest is emulated (TCG): only each engine's ratio
# to fio's same engine, measured in the same run, means anything.
source "$(dirname "$0")/lib.sh"
paper_args paper004 "$@"
need_tools fio:fio python3:python3
build_pmcache test-opt
log=$(mktemp "${TMPDIR:-/tmp}/paper004.XXXXXX.log")
on_exit 'rm -f "$log"'
args=(bench paper 004-fig1 --scale "$scale" --out /tmp/paper004 --dir /mnt/nvme --pm-dir /dev/shm
  --bed guest-nvme)
[[ -z "$runs" ]] || args+=(--runs "$runs")
guest_script paper004
# The drive holds the test file (256 MiB at small, 1 GiB at full) and a 16 MiB one.
disk_mib=512
[[ "$scale" != full ]] || disk_mib=2048
cat > "$script" <<GUEST
set -eu
[ -e /sys/kernel/tracing/events ] || mount -t tracefs nodev /sys/kernel/tracing
$exe ${args[*]} || exit 1
for f in /tmp/paper004/*.json; do
  echo "PAPER004-FILE \$(basename "\$f") \$(tr -d '\n' < "\$f")"
done
GUEST
set +e
font=/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
[[ -f "$font" ]] || { echo "paper004: no $font: install fonts-dejavu-core" >&2; exit 2; }
"$here/run-in-guest.sh" --timeout 3600 --mem 2048 --disk-mib "$disk_mib" --copy "$exe" \
  --copy "$(command -v fio)" --copy "$font" --copy "$script" \
  --env "PMCACHE_BENCH_COMMIT=$(git rev-parse --short=7 HEAD)" -- sh "$script" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
((rc == 0)) || { echo "paper004: the guest run failed ($rc)" >&2; exit 1; }
grep -q 'io_poll=1' "$log" || { echo "paper004: the guest's NVMe had no poll queues" >&2; exit 1; }
files_from_log paper004 "$log" "$out"
echo "== paper004: done in $((SECONDS - start)) s"
