#!/usr/bin/env bash
# Paper 003's Fig 2 on the paper's own kinds of device: `pmcache bench paper 003-fig2` runs
# inside a QEMU guest (TCG; run-in-guest.sh: this host's kernel has no brd, ublk or NVDIMMs)
# on three ext4 file systems, each in one of the figure's roles:
#
#   /mnt/fs-dax      ext4 -o dax on an emulated NVDIMM (fsdax): the PM-native file system
#                    (PMFS's role)
#   /mnt/fs-pmcache  ext4 on pmcache serve --ublk (/dev/ublkbN): its medium a file on ext4 -o
#                    dax on a second NVDIMM, its backing store a file on the guest's NVMe
#                    disk, its cache as large as the backing store (PMAL's role: a
#                    persist-on-write layer under a legacy file system)
#   /mnt/fs-brd      ext4 on brd, the kernel's RAM disk (stock ext4 on the paper's RAM disk)
#
# All three are made with mkfs.ext4's defaults and mounted with noinit_itable (no lazy
# inode-table initialisation beside the measurement). The figures' JSON comes back on the
# guest's console and is written to OUT (with its SVG and PNG drawn on the host).
#
#   scripts/guest/paper003.sh [--scale smallest|small|full] [--runs N] [--seconds S] --out DIR
#
#   smallest  devices of 256 MiB, 1 run of 2 s per personality and bed (CI)
#   small     devices of 640 MiB, 3 runs of 10 s
#   full      devices of 3 GiB, 5 runs of 60 s (filebench's `run 60`)
#
# Builds `pmcache` (profile test-opt, feature ublk) and installs ndctl, e2fsprogs and python3
# on the host when missing (their binaries and libraries are copied into the guest).
source "$(dirname "$0")/lib.sh"
paper_args paper003 --with-seconds "$@"
case "$scale" in
  smallest) bed_mib=256 mem_mib=1536 def_runs=1 def_seconds=2 timeout_s=2400 ;;
  small) bed_mib=640 mem_mib=2048 def_runs=3 def_seconds=10 timeout_s=10800 ;;
  full) bed_mib=3072 mem_mib=5120 def_runs=5 def_seconds=60 timeout_s=36000 ;;
  *) echo "paper003: --scale must be smallest, small or full, not '$scale'" >&2; exit 2 ;;
esac
runs="${runs:-$def_runs}"
seconds="${seconds:-$def_seconds}"
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "paper003: --runs wants a positive number" >&2; exit 2; }
[[ "$seconds" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "paper003: --seconds wants a number" >&2; exit 2; }
# A longer run needs a longer guest.
timeout_s=$(awk -v t="$timeout_s" -v r="$runs" -v s="$seconds" -v dr="$def_runs" -v ds="$def_seconds" \
  'BEGIN { v = t * r * (s + 10) / (dr * (ds + 10)); if (v < t) v = t; printf "%d", v }')
need_tools ndctl:ndctl mkfs.ext4:e2fsprogs python3:python3
build_pmcache test-opt

# Two NVDIMMs: the pmcache medium's (its ext4 and the medium file) and the DAX bed's.
nv_mib=$((bed_mib + 256))
shm=$(mktemp -d /dev/shm/paper003.XXXXXX)
log=$(mktemp "${TMPDIR:-/tmp}/paper003.XXXXXX.log")
on_exit 'rm -rf "$shm" "$log"'
shm_free_mib=$(df -Pm /dev/shm | awk 'NR == 2 {print $4}')
((shm_free_mib > 2 * nv_mib + 256)) \
  || { echo "paper003: /dev/shm has ${shm_free_mib} MiB free, the NVDIMMs need $((2 * nv_mib))" >&2; exit 1; }
qemu_args="-machine nvdimm=on -m ${mem_mib},slots=2,maxmem=$((mem_mib + 2 * nv_mib + 1024))M"
for i in 0 1; do
  truncate -s "${nv_mib}M" "$shm/nvdimm$i.img"
  qemu_args+=" -object memory-backend-file,id=nv$i,share=on,mem-path=$shm/nvdimm$i.img,size=${nv_mib}M"
  qemu_args+=" -device nvdimm,id=nvdimm$i,memdev=nv$i"
done

args=(bench paper 003-fig2 --bed guest-fs --scale "$scale" --runs "$runs" --seconds "$seconds"
  --out /tmp/paper003 --pm-dir /dev/shm --dir /mnt/nvme)
guest_script paper003
{
  echo "PM=$exe BED_MIB=$bed_mib"
  echo "ARGS='${args[*]}'"
  cat <<'GUEST'
set -eu
echo 1 > /proc/sys/kernel/printk
log() { echo "paper003: $*"; }
fail() {
  { echo "paper003: FAILED: $*"; [ -f /tmp/serve.log ] && tail -n 20 /tmp/serve.log
    dmesg | tail -n 30; } >&2
  exit 1
}
wait_until() { # wait_until CONDITION WHAT: up to 30 s
  tries=0
  while ! eval "$1"; do
    tries=$((tries + 1)); [ $tries -lt 300 ] || fail "$2"; sleep 0.1
  done
}
CPUS=$(grep -c ^processor /proc/cpuinfo)
for m in nd_pmem ublk_drv; do
  [ -d /sys/module/$m ] || fail "kernel module $m is not loaded"
done
for i in 0 1; do
  ndctl create-namespace -f -e namespace$i.0 -m fsdax -a 2M > /tmp/ns$i.json 2>/tmp/ns$i.err \
    || { cat /tmp/ns$i.err; fail "ndctl create-namespace -m fsdax on namespace$i.0"; }
  dev=$(sed -n 's/.*"blockdev":"\(pmem[0-9]*\)".*/\1/p' /tmp/ns$i.json | head -n 1)
  [ -n "$dev" ] || fail "no block device for namespace$i.0"
  wait_until "[ -b /dev/$dev ]" "no /dev/$dev"
  eval "PMEM$i=$dev"
done
# brd, reloaded with one RAM disk of the bed's size.
if [ -d /sys/module/brd ] && [ -f /modules/brd.ko ]; then
  rmmod brd || fail "rmmod brd"
fi
if [ -f /modules/brd.ko ]; then
  insmod /modules/brd.ko rd_nr=1 rd_size=$((BED_MIB * 1024)) max_part=0 || fail "insmod brd"
fi
wait_until "[ -b /dev/ram0 ]" "no /dev/ram0 (brd)"
[ "$(cat /sys/block/ram0/size)" -ge $((BED_MIB * 2048)) ] \
  || fail "/dev/ram0 has $(($(cat /sys/block/ram0/size) / 2048)) MiB, not $BED_MIB (brd built in?)"
mkdir -p /mnt/fs-brd /mnt/fs-dax /mnt/fs-pmcache /mnt/pm
mkfs.ext4 -q -F /dev/ram0 || fail "mkfs.ext4 /dev/ram0"
mount -t ext4 -o noinit_itable /dev/ram0 /mnt/fs-brd || fail "mount /dev/ram0"
mkfs.ext4 -q -F -b 4096 /dev/$PMEM1 || fail "mkfs.ext4 /dev/$PMEM1"
mount -t ext4 -o dax,noinit_itable /dev/$PMEM1 /mnt/fs-dax || fail "mount -o dax /dev/$PMEM1"
grep " /mnt/fs-dax " /proc/mounts | grep -q dax || fail "/mnt/fs-dax is not mounted with dax"
mkfs.ext4 -q -F -b 4096 /dev/$PMEM0 || fail "mkfs.ext4 /dev/$PMEM0"
mount -t ext4 -o dax /dev/$PMEM0 /mnt/pm || fail "mount -o dax /dev/$PMEM0"
truncate -s ${BED_MIB}M /mnt/nvme/backing.img
$PM serve --ublk --ublk-recovery off --ublk-queues $CPUS --cache /mnt/pm/cache.pm \
  --cache-size ${BED_MIB}M --backing /mnt/nvme/backing.img --control /tmp/pm.ctl \
  > /tmp/serve.log 2>&1 &
SERVER=$!
wait_until "grep -q 'ublk device:' /tmp/serve.log || ! kill -0 $SERVER 2>/dev/null" \
  "pmcache serve did not start"
UBLK=$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' /tmp/serve.log | head -n 1)
[ -n "$UBLK" ] && [ -b "$UBLK" ] || fail "pmcache serve: no ublk device"
grep -q "medium: dax" /tmp/serve.log || fail "the medium is not served as the dax kind"
mkfs.ext4 -q -F $UBLK || fail "mkfs.ext4 $UBLK"
mount -t ext4 -o noinit_itable $UBLK /mnt/fs-pmcache || fail "mount $UBLK"
log "beds: ext4 -o dax on /dev/$PMEM1, ext4 on $UBLK (pmcache, medium on /dev/$PMEM0), ext4 on /dev/ram0; $BED_MIB MiB each"
$PM $ARGS || fail "bench paper 003-fig2"
for f in /tmp/paper003/*.json; do
  echo "PAPER003-FILE $(basename "$f") $(tr -d '\n' < "$f")"
done
umount /mnt/fs-pmcache /mnt/fs-dax /mnt/fs-brd
kill -TERM $SERVER
wait $SERVER || fail "pmcache serve did not shut down cleanly"
log "done"
GUEST
} > "$script"
set +e
font=/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
[[ -f "$font" ]] || { echo "paper003: no $font: install fonts-dejavu-core" >&2; exit 2; }
PMCACHE_GUEST_QEMU_ARGS="$qemu_args ${PMCACHE_GUEST_QEMU_ARGS:-}" \
  "$here/run-in-guest.sh" --timeout "$timeout_s" --mem "$mem_mib" \
  --disk-mib $((bed_mib + 512)) --copy "$exe" --copy "$(command -v ndctl)" \
  --copy "$(command -v mkfs.ext4)" --copy "$font" --copy "$script" \
  --env "PMCACHE_BENCH_COMMIT=$(git rev-parse --short=7 HEAD)" \
  -- sh "$script" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
((rc == 0)) || { echo "paper003: the guest run failed ($rc)" >&2; exit 1; }
files_from_log paper003 "$log" "$out"
echo "== paper003: done in $((SECONDS - start)) s"
