#!/usr/bin/env bash
# Paper 000's experiments (docs: ../shared/PAPERS-EXPERIMENTS.md, section 2) with pmcache beside
# the kernel's cache layers, all on the same emulated NVDIMMs in one QEMU guest
# (run-in-guest.sh: this host's kernel has no bcache, device-mapper or ublk modules).
#
# The guest has ten NVDIMMs (files in /dev/shm on the host, fsdax namespaces /dev/pmemN in the
# guest) and one extra NVMe controller (serial paper000) with fourteen namespaces (sparse files
# on the host) as "SSD"s, "HDD"s (QEMU-throttled to 200 IOPS and 150 MB/s) and SSD-class cache
# devices. One of each per system, so that every stack is up at once:
#
#   NVM (raw pmem)                 fio on /dev/pmem0 itself: the normaliser
#   bcache                         make-bcache: cache /dev/pmem1, backing an SSD; cache_mode and
#                                  sequential_cutoff are switched in sysfs before each run
#   dm-cache                       smq, 256 KiB blocks (the kernel's default), writeback
#   dm-cache (32 KiB blocks)       the same with 32 KiB blocks, dm-cache's smallest
#   dm-cache (writethrough)        256 KiB blocks, the `writethrough` feature
#   dm-writecache                  pmem mode (`p`), 4 KiB blocks (write-back only)
#   pmcache (ublk)                 pmcache serve --ublk, its medium a file on ext4 -o dax,
#                                  backing an SSD, write-back
#   pmcache (ublk, write-through)  a second server, --mode writethrough
#   pmcache (ublk, poll)           a third server, --ublk-poll: its queue threads poll instead
#                                  of sleeping while requests come
#   ublk null (no cache)           pmcache ublk null: the same ublk frontend with nothing behind
#                                  it (reads return zeroes, writes are dropped), the ceiling of
#                                  any server behind ublk here (Figs 4, 5, 6); "ublk null
#                                  (poll)" the same with --poll
#   rublk null, rublk loop         rublk (a peer ublk server, `cargo install rublk`): its null
#   (raw pmem)                     target, copying data as pmcache does, and its loop target
#                                  over the raw NVDIMM (direct I/O)
#   loop (raw pmem)                the kernel's loop device over the raw NVDIMM, direct I/O: a
#                                  kernel layer that hands each request to a worker thread
#   pmcache (library)              pmcache's engine embedded in a process (`pmcache bench paper
#                                  000-library`), its medium on ext4 -o dax on an NVDIMM of its
#                                  own, against "NVM (DAX loads and stores)": the same requests
#                                  as loads and stores of the same mapping; "fio libpmem (DAX)"
#                                  cross-checks that normaliser (Figs 4a, 4b, 5, 6)
#   SSD→HDD stacks (Fig 2)         bcache and dm-cache with an NVMe namespace as cache device
#                                  in front of a throttled one
#
# dm-cache's metadata devices are loop devices on files in the guest's tmpfs.
#
# fio in the guest: ioengine=psync, direct=1, QD 1 per job, time_based, group_reporting.
#   000-fig4a  4 KiB randread, numjobs 1 2 4 8 16
#   000-fig4b  4 MiB sequential read, numjobs 1 2 4 8 16 (offset_increment: each job its part)
#   000-fig5   1 job, 4 MiB sequential rw, rwmixread 100 99 95 90 70 50 30 10
#   000-fig6   4 KiB randrw rwmixread=50, numjobs 1 2 4 8 16
#   000-fig3   1 job randread, bs 4K 16K 64K 256K 1M 4M, four working sets (fio size=): the
#              raw NVM, bcache, dm-cache and pmcache, series "<name> <working set> MiB"
#   000-fig2   1 job: 4K randread, 4M seq read, 4K randrw 50:50, 4M seq rw 50:50 on the raw
#              devices, the SSD→HDD stacks and the NVM→SSD stacks
#   000-library  pmcache (library) and its normalisers at the points of Figs 4a, 4b, 5 and 6
#   000-time   where a request's time goes: 1 job at QD 1 on the workloads of Figs 4a, 4b and 6
#              (4K randread, 4M read, 4K randrw 50:50) on every layer, fio running for the
#              run's seconds + 3 while the guest's counters are sampled over a window of the
#              run's seconds in its middle: /proc/stat (CPU ticks, context switches) and
#              /proc/PID/task/* of fio's processes and of the server's (CPU ticks, switches,
#              migrations); printed as `PAPER000-TIME {json}` lines
#   000-policy where a cache's policy decides, on bcache, dm-cache, dm-writecache and pmcache
#              with their own defaults (PAPER000-POLICY lines): the hits of each pass over a
#              working set never read before (random 64 KiB reads); the second of two
#              sequential 1 MiB reads of data never written through the cache; 4 KiB random
#              reads at QD 16, 90 % on a cached hot tenth of a throttled HDD (four more NVDIMMs
#              and HDDs: NVM→HDD stacks), each hit's latency against the layer's all-hit run;
#              4 KiB random writes at QD 16 over twice the NVDIMM for a while, IOPS second by
#              second, beside the SSD alone
# The SSDs are throttled to an SSD's cost (ssd_iops, ssd_bps below); the HDDs to 200 IOPS and
# 150 MB/s.
# Each figure starts with a warm-up of every cache it measures: random 256 KiB reads of the
# working set (bcache with sequential_cutoff 0), pass after pass until one pass misses nothing
# (dm-cache's smq promotes gradually), and for dm-writecache, which caches only writes, one
# sequential write of it; before each point every cache is topped up (at most two passes), and
# a point that only reads and found under 95 % of its reads cached is run again after a top-up,
# twice, then kept as refused (not drawn). Then, for each run, each x and each series in an order that rotates
# from one run and x to the next: one fio run, and the read hits and misses the layer counted
# during it (dm-cache: `dmsetup status`; pmcache: `pmcache stats`; bcache: read requests that
# reached its cache device and its backing device, /sys/block/*/stat, since bcache's own
# stats_total are folded in only every 13.6 s). TCG makes absolute numbers meaningless: only
# ratios to the raw NVM of the same boot count.
#
#   scripts/guest/paper000.sh [--scale smallest|small|full] [--runs N] [--seconds S]
#       [--only FIG[,FIG]...] --out FILE.json
#
#   PM_CACHE_PCT=N (default 75) gives pmcache's caches N % of their NVDIMMs, and
#   PM_CLEANER=SETTINGS (e.g. throttle_pct=90) passes `--cleaner SETTINGS` to its servers:
#   experiments, said in the figures' notes; the committed figures use the defaults.
#
#   smallest  NVDIMMs of 128 MiB, working set 32 MiB, threads 1 2 4, request sizes 4K 256K,
#             read shares 100 90 50, 1 run of 1 s, 4 warm-up passes and 20 s of writes (policy)
#   small     NVDIMMs of 384 MiB, working set 160 MiB, every point of the figures, 3 runs of 3 s,
#             10 warm-up passes and 60 s of writes
#   full      NVDIMMs of 768 MiB, working set 320 MiB, every point, 5 runs of 10 s, 15 warm-up
#             passes and 120 s of writes
#
# The JSON file: {"bed": {...}, "notes": [...], "points": [{"figure", "x", "series", "run",
# "bytes_per_s", "iops", "cache_hits", "cache_misses"}, ...], "time": [{"workload", "series",
# "run", "window_s", "iops", "hz", "system", "fio", "server"}, ...], "policy": [{"experiment",
# "series", "run", "x", "hits", "misses", ...}, ...]}; cache_hits and
# cache_misses are null where the layer counts nothing (raw devices, dm-writecache). The guest prints each point
# on its console as a `PAPER000 {json}` line; this script collects them. When the guest fails,
# its console is kept beside the output as FILE.guest.log.
#
# Builds `pmcache` (profile test-opt, feature ublk) and installs fio, ndctl, bcache-tools
# (make-bcache), dmsetup, e2fsprogs and python3 on the host when missing (their binaries and
# libraries are copied into the guest); rublk is `cargo install`ed under target/rublk unless
# RUBLK names its binary or it is in PATH. The guest kernel's bcache, dm-cache, dm-writecache and
# NVDIMM modules are loaded by run-in-guest.sh.
source "$(dirname "$0")/lib.sh"
caller_pwd=$OLDPWD # lib.sh changed to the repository root

scale=smallest
# Experiments on pmcache's servers (the figures are made with the defaults): the share of
# each NVDIMM its cache takes, and cleaner settings (`--cleaner`, e.g. throttle_pct=90).
pm_cache_pct=${PM_CACHE_PCT:-75}
pm_cleaner=${PM_CLEANER:-}
runs=
seconds=
only=
out=
usage() { sed -n '/^#   scripts\/guest\/paper000.sh/,/^#   full/p' "$0" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --scale) scale="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --only) only="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "paper000: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ -n "$out" ]] || { echo "paper000: --out FILE.json is required" >&2; exit 2; }
[[ "$out" == /* ]] || out="$caller_pwd/$out"
[[ -d "$(dirname "$out")" ]] || { echo "paper000: no directory for --out: $(dirname "$out")" >&2; exit 2; }

# Per scale: NVDIMM size, working set (MiB), Fig 3's working sets, thread counts, Fig 3's
# request sizes, Fig 5's read shares, runs, seconds per fio run, run-in-guest timeout.
case "$scale" in
  smallest)
    nv_mib=128 ws_mib=32 sets="4 12 20 32" threads="1 2 4" sizes="4k 256k" shares="100 90 50"
    passes=4 dirty_s=20 def_runs=1 def_seconds=1 timeout_s=1800 ;;
  small)
    nv_mib=384 ws_mib=160 sets="16 48 80 160" threads="1 2 4 8 16" sizes="4k 16k 64k 256k 1m 4m"
    shares="100 99 95 90 70 50 30 10" passes=10 dirty_s=60 def_runs=3 def_seconds=3 timeout_s=14400 ;;
  full)
    nv_mib=768 ws_mib=320 sets="32 96 160 320" threads="1 2 4 8 16" sizes="4k 16k 64k 256k 1m 4m"
    shares="100 99 95 90 70 50 30 10" passes=15 dirty_s=120 def_runs=5 def_seconds=10 timeout_s=43200 ;;
  *) echo "paper000: --scale must be smallest, small or full, not '$scale'" >&2; exit 2 ;;
esac
runs="${runs:-$def_runs}"
seconds="${seconds:-$def_seconds}"
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "paper000: --runs wants a positive number" >&2; exit 2; }
[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || { echo "paper000: --seconds wants a positive number" >&2; exit 2; }
all_figs="000-time 000-library 000-fig4a 000-fig4b 000-fig3 000-fig2 000-fig5 000-fig6 000-policy"
figs=
if [[ -n "$only" ]]; then
  for f in ${only//,/ }; do
    [[ " $all_figs " == *" $f "* ]] || { echo "paper000: unknown figure '$f' (one of: $all_figs)" >&2; exit 2; }
    figs+="$f "
  done
else
  figs="$all_figs"
fi
# A longer run needs a longer guest: scale the timeout with the runs and seconds asked for.
timeout_s=$((timeout_s * runs * (seconds + 2) / (def_runs * (def_seconds + 2))))
((timeout_s >= 1800)) || timeout_s=1800
# 000-policy: six series' dirty writes, each up to 240 s cleaning after, and the rest.
[[ " $figs " == *" 000-policy "* ]] && timeout_s=$((timeout_s + 6 * (dirty_s + 240) + 2400))

need_tools fio:fio ndctl:ndctl make-bcache:bcache-tools dmsetup:dmsetup mkfs.ext4:e2fsprogs \
  python3:python3
build_pmcache test-opt
rublk="${RUBLK:-$(command -v rublk || true)}"
if [[ -z "$rublk" ]]; then
  rublk="$PWD/${CARGO_TARGET_DIR:-target}/rublk/bin/rublk"
  [[ -x "$rublk" ]] || cargo install rublk --locked --root "$(dirname "$(dirname "$rublk")")"
fi

# Each ublk server holds a buffer per tag (1 MiB, touched as requests use it): 2 queues of 128
# tags are up to 256 MiB a server, and five servers run at once.
mem_mib=3072
nvdimms=10
namespaces=14
# 000-policy adds four NVM→HDD stacks: an NVDIMM and a throttled "HDD" namespace each.
policy=0
[[ " $figs " == *" 000-policy "* ]] && policy=1
nvdimms=$((nvdimms + 4 * policy))
namespaces=$((namespaces + 4 * policy))
shm=$(mktemp -d /dev/shm/paper000.XXXXXX)
work=$(mktemp -d "${TMPDIR:-/tmp}/paper000.XXXXXX")
on_exit 'rm -rf "$shm" "$work"'
((mem_mib + nvdimms * nv_mib <= 14336)) || { echo "paper000: guest memory and NVDIMMs exceed 14 GiB" >&2; exit 2; }
shm_free_mib=$(df -Pm /dev/shm | awk 'NR == 2 {print $4}')
((shm_free_mib > nvdimms * nv_mib + 256)) \
  || { echo "paper000: /dev/shm has ${shm_free_mib} MiB free, the NVDIMMs need $((nvdimms * nv_mib))" >&2; exit 1; }

# bcache refuses a cache device of fewer than 1024 buckets: buckets of NVDIMM / 2048 (a power
# of two, at most make-bcache's 512 KiB default).
bc_bucket=512
while ((bc_bucket > 4 && nv_mib * 1024 / bc_bucket < 2048)); do bc_bucket=$((bc_bucket / 2)); done
bc_bucket="${bc_bucket}k"
qemu_args="-machine nvdimm=on -m ${mem_mib},slots=$nvdimms,maxmem=$((mem_mib + nvdimms * nv_mib + 1024))M"
for ((i = 0; i < nvdimms; i++)); do
  truncate -s "${nv_mib}M" "$shm/nvdimm$i.img"
  qemu_args+=" -object memory-backend-file,id=nv$i,share=on,mem-path=$shm/nvdimm$i.img,size=${nv_mib}M"
  qemu_args+=" -device nvdimm,id=nvdimm$i,memdev=nv$i"
done
# Namespaces 1-8: SSDs (raw, bcache, dm-cache, dm-cache 32K, dm-cache WT, dm-writecache, pmcache,
# pmcache WT); 9-11: HDDs (raw, bcache, dm-cache); 12-13: SSD cache devices (bcache, dm-cache);
# 14: the SSD of the polling pmcache server; with 000-policy, 15-18: HDDs (bcache, dm-cache,
# dm-writecache, pmcache in front of them).
# 000-policy's regions of the SSDs, after the working set: a working set never read before
# (warm-up), one never written through the cache (scan), and twice the NVDIMM (dirty writes).
policy_ws_mib=$((ws_mib / 2))
disk_mib=$((ws_mib * 2 > 256 ? ws_mib * 2 : 256))
((policy)) && disk_mib=$((ws_mib + 2 * policy_ws_mib + 2 * nv_mib + 64))
# The HDDs hold 000-policy's hot set (a tenth of the device, cached) and the cold rest.
hdd_policy_mib=$((policy_ws_mib * 10))
hdd_throttle="throttling.iops-total=200,throttling.bps-total=150000000"
# An SSD's cost: the namespaces behind QEMU's NVMe emulation are files in the host's page cache,
# as fast as the emulated NVDIMM at 4 MiB; throttled to a request cost and bandwidth about a
# quarter of the NVDIMM's in this guest (an NVMe SSD's 3 GB/s beside an NVDIMM's ~12 GB/s).
ssd_iops=4000 ssd_bps=500000000
ssd_throttle="throttling.iops-total=$ssd_iops,throttling.bps-total=$ssd_bps"
qemu_args+=" -device nvme,id=nvp,serial=paper000"
for ((n = 1; n <= namespaces; n++)); do
  size=$disk_mib
  ((n == 12 || n == 13)) && size=$nv_mib
  ((n >= 15)) && size=$hdd_policy_mib
  truncate -s "${size}M" "$work/ns$n.img"
  drive="file=$work/ns$n.img,if=none,id=pd$n,format=raw,cache=unsafe"
  if ((n >= 9 && n <= 11 || n >= 15)); then drive+=",$hdd_throttle"; else drive+=",$ssd_throttle"; fi
  qemu_args+=" -drive $drive -device nvme-ns,drive=pd$n,bus=nvp,nsid=$n"
done

guest_script paper000
# util-linux's losetup (direct I/O), under a path of its own: the guest's busybox has one too.
cp "$(command -v losetup)" "$work/losetup"
{
  cat <<PARAMS
PM=$exe
RUBLK=$rublk
LOSETUP=$work/losetup
SCALE=$scale RUNS=$runs SECS=$seconds WS=$ws_mib NV=$nv_mib
POLICY=$policy PWS=$policy_ws_mib PASSES=$passes DSECS=$dirty_s HDDP=$hdd_policy_mib NVDIMMS=$nvdimms NAMESPACES=$namespaces
PM_CACHE_MIB=$((nv_mib * pm_cache_pct / 100)) PM_CLEANER="$pm_cleaner" BC_BUCKET=$bc_bucket
SETS="$sets" THREADS="$threads" SIZES="$sizes" SHARES="$shares" FIGS="$figs"
PARAMS
  cat <<'GUEST'
set -eu
echo 1 > /proc/sys/kernel/printk # kernel messages in dmesg only: none cut into the result lines
export DM_DISABLE_UDEV=1 # no udev in the guest: libdevmapper makes the /dev/mapper nodes
log() { echo "paper000: $*"; }
fail() { # on stderr: also from within a command substitution
  {
    echo "paper000: FAILED: $*"
    for f in /tmp/serve-*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 20 "$f"; }; done
    echo "--- dmesg"; dmesg | tail -n 40
  } >&2
  exit 1
}
wait_until() { # wait_until CONDITION WHAT: up to 30 s
  local tries=0
  while ! eval "$1"; do
    tries=$((tries + 1)); [ $tries -lt 300 ] || fail "$2 (waited 30 s for: $1)"; sleep 0.1
  done
}
sysw() { # sysw VALUE FILE: a sysfs write, checked
  echo "$1" > "$2" 2>/tmp/sysw.err || fail "cannot write '$1' to $2: $(cat /tmp/sysw.err)"
}
CPUS=$(grep -c ^processor /proc/cpuinfo)
printf 'PAPER000-BED {"kernel":"%s","guest_cpus":%d}\n' "$(uname -r)" "$CPUS"
for m in bcache dm_mod dm_cache dm_cache_smq dm_writecache nd_pmem ublk_drv; do
  [ -d /sys/module/$m ] || fail "kernel module $m is not loaded (missing from the guest kernel?)"
done

# --- NVDIMMs: an fsdax namespace each -------------------------------------------------------
i=0
while [ $i -lt $NVDIMMS ]; do
  ndctl create-namespace -f -e namespace$i.0 -m fsdax -a 2M > /tmp/ns$i.json 2>/tmp/ns$i.err \
    || { cat /tmp/ns$i.err; ndctl list -NR; fail "ndctl create-namespace -m fsdax on namespace$i.0"; }
  dev=$(sed -n 's/.*"blockdev":"\(pmem[0-9]*\)".*/\1/p' /tmp/ns$i.json | head -n 1)
  [ -n "$dev" ] || { cat /tmp/ns$i.json; fail "no block device in ndctl's answer for namespace$i.0"; }
  wait_until "[ -b /dev/$dev ]" "no /dev/$dev"
  [ "$(cat /sys/block/$dev/queue/dax)" = 1 ] || fail "/dev/$dev does not support DAX"
  # pmem is bio-based: its request counts (bcache's hits) need iostats on.
  sysw 1 /sys/block/$dev/queue/iostats
  eval "PMEM$i=$dev"
  i=$((i + 1))
done
log "NVDIMMs: $PMEM0 $PMEM1 $PMEM2 $PMEM3 $PMEM4 $PMEM5 $PMEM6 $PMEM7 $PMEM8 $PMEM9 ($(($(cat /sys/block/$PMEM0/size) / 2048)) MiB each as fsdax)"

# --- NVMe namespaces of the controller with serial paper000 ---------------------------------
ctrl=
for c in /sys/class/nvme/nvme*; do
  [ "$(tr -d ' ' < $c/serial)" = paper000 ] && ctrl=${c##*/}
done
[ -n "$ctrl" ] || { ls /sys/class/nvme; fail "no NVMe controller with serial paper000"; }
nsdev() { # nsdev NSID: the block device of namespace NSID of $ctrl (empty if not there yet)
  for b in /sys/block/${ctrl}n*; do
    [ -e "$b/nsid" ] && [ "$(cat $b/nsid)" = "$1" ] && { echo "${b##*/}"; return 0; }
  done
  return 0
}
n=1
while [ $n -le $NAMESPACES ]; do
  wait_until "[ -n \"\$(nsdev $n)\" ]" "no namespace $n on $ctrl ($(ls -d /sys/block/${ctrl}n* 2>/dev/null | tr '\n' ' '))"
  d=$(nsdev $n)
  eval "NS$n=$d"
  wait_until "[ -b /dev/$d ]" "no /dev/$d"
  n=$((n + 1))
done
SSD_RAW=$NS1 SSD_BC=$NS2 SSD_DMC=$NS3 SSD_DMC32K=$NS4 SSD_DMCWT=$NS5 SSD_WC=$NS6 SSD_PM=$NS7 SSD_PMWT=$NS8
HDD_RAW=$NS9 HDD_BC=$NS10 HDD_DMC=$NS11 SSDC_BC=$NS12 SSDC_DMC=$NS13 SSD_PMP=$NS14
log "NVMe $ctrl: SSDs $NS1 $NS2 $NS3 $NS4 $NS5 $NS6 $NS7 $NS8 $NS14, HDDs (throttled) $NS9 $NS10 $NS11, SSD caches $NS12 $NS13"

# --- bcache: NVM→SSD and SSD→HDD -------------------------------------------------------------
bcache_dev() { # bcache_dev BACKING: the bcacheN device over BACKING (empty if none yet)
  for b in /sys/block/bcache*; do
    [ -e "$b/bcache/backing_dev_name" ] && [ "$(cat $b/bcache/backing_dev_name)" = "$1" ] \
      && { echo "${b##*/}"; return 0; }
  done
  return 0
}
make_bcache() { # make_bcache CACHE BACKING: sets BC to the bcacheN device
  make-bcache --bucket $BC_BUCKET -C /dev/$1 -B /dev/$2 > /tmp/make-bcache-$2.log 2>&1 \
    || { cat /tmp/make-bcache-$2.log; fail "make-bcache --bucket $BC_BUCKET -C /dev/$1 -B /dev/$2"; }
  sysw /dev/$1 /sys/fs/bcache/register
  sysw /dev/$2 /sys/fs/bcache/register
  wait_until "[ -n \"\$(bcache_dev $2)\" ]" "no bcache device over /dev/$2 after registering it"
  BC=$(bcache_dev $2)
  wait_until "[ -b /dev/$BC ]" "no /dev/$BC"
  state=$(cat /sys/block/$BC/bcache/state)
  [ "$state" != "no cache" ] || fail "/dev/$BC (over /dev/$2) is not attached to its cache /dev/$1"
  # bcache sends reads to the backing device when the cache device's latency passes these
  # thresholds (TCG is slow): 0 turns that off.
  sysw 0 /sys/block/$BC/bcache/cache/congested_read_threshold_us
  sysw 0 /sys/block/$BC/bcache/cache/congested_write_threshold_us
}
make_bcache $PMEM1 $SSD_BC; BC0=$BC
make_bcache $SSDC_BC $HDD_BC; BC1=$BC
log "bcache: /dev/$BC0 (cache /dev/$PMEM1, backing /dev/$SSD_BC), /dev/$BC1 (cache /dev/$SSDC_BC, backing /dev/$HDD_BC)"
bc_set() { # bc_set BCACHEN MODE CUTOFF
  sysw "$2" /sys/block/$1/bcache/cache_mode
  sysw "$3" /sys/block/$1/bcache/sequential_cutoff
  grep -q "\[$2\]" /sys/block/$1/bcache/cache_mode || fail "/dev/$1: cache_mode is $(cat /sys/block/$1/bcache/cache_mode), not $2"
}

# --- dm-cache (metadata on loop devices in tmpfs), dm-writecache -----------------------------
dm_create() { # dm_create NAME TABLE
  dmsetup create "$1" --noudevsync --table "$2" > /tmp/dm-$1.log 2>&1 \
    || { cat /tmp/dm-$1.log; fail "dmsetup create $1 --table '$2'"; }
  dmsetup mknodes "$1" > /dev/null 2>&1 || true
  wait_until "[ -b /dev/mapper/$1 ]" "no /dev/mapper/$1"
}
loopn=0
make_dmcache() { # make_dmcache NAME CACHE ORIGIN BLOCK_SECTORS FEATURES...
  name=$1 cache=$2 origin=$3 blk=$4; shift 4
  dd if=/dev/zero of=/dev/shm/meta-$name bs=1M count=0 seek=32 2>/dev/null
  wait_until "[ -b /dev/loop$loopn ]" "no /dev/loop$loopn"
  losetup /dev/loop$loopn /dev/shm/meta-$name || fail "losetup /dev/loop$loopn for $name's metadata"
  dm_create $name "0 $(blockdev --getsz /dev/$origin) cache /dev/loop$loopn /dev/$cache /dev/$origin $blk $# $* smq 0"
  loopn=$((loopn + 1))
}
make_dmcache dmc $PMEM2 $SSD_DMC 512
make_dmcache dmc32k $PMEM3 $SSD_DMC32K 64
make_dmcache dmcwt $PMEM4 $SSD_DMCWT 512 writethrough
make_dmcache dmchdd $SSDC_DMC $HDD_DMC 512
dm_create wc "0 $(blockdev --getsz /dev/$SSD_WC) writecache p /dev/$SSD_WC /dev/$PMEM5 4096 0"
for d in dmc dmc32k dmcwt dmchdd wc; do
  log "$d: $(dmsetup table $d)"
done

# --- pmcache: write-back and write-through servers, media on ext4 -o dax ---------------------
serve_pm() { # serve_pm N PMEM BACKING ARGS...: sets UBLK
  k=$1 pmem=$2 backing=$3; shift 3
  mkfs.ext4 -q -F -b 4096 /dev/$pmem || fail "mkfs.ext4 /dev/$pmem"
  mkdir -p /mnt/pm$k
  mount -t ext4 -o dax /dev/$pmem /mnt/pm$k || fail "mount -o dax /dev/$pmem"
  grep " /mnt/pm$k " /proc/mounts | grep -q dax || fail "/mnt/pm$k is not mounted with dax"
  case " $* " in *" --ublk-queues "*) queues= ;; *) queues="--ublk-queues $CPUS" ;; esac
  $PM serve --ublk --ublk-recovery off $queues --cache /mnt/pm$k/cache.pm \
    --cache-size ${PM_CACHE_MIB}M --backing /dev/$backing --control /tmp/pm$k.ctl \
    ${PM_CLEANER:+--cleaner $PM_CLEANER} "$@" \
    > /tmp/serve-pm$k.log 2>&1 &
  PID=$!
  wait_until "grep -q 'ublk device:' /tmp/serve-pm$k.log || ! kill -0 $! 2>/dev/null" \
    "pmcache serve on /mnt/pm$k did not start"
  UBLK=$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' /tmp/serve-pm$k.log | head -n 1)
  [ -n "$UBLK" ] && [ -b "$UBLK" ] || fail "pmcache serve on /mnt/pm$k: no ublk device"
  grep -q "medium: dax" /tmp/serve-pm$k.log || fail "pmcache on /mnt/pm$k is not served as the dax kind: $(head -n 3 /tmp/serve-pm$k.log)"
}
serve_pm 6 $PMEM6 $SSD_PM; UB_WB=$UBLK PID_WB=$PID
serve_pm 7 $PMEM7 $SSD_PMWT --mode writethrough; UB_WT=$UBLK PID_WT=$PID
# Polling servers get one queue, its thread free to run on any CPU: with a queue per CPU each
# queue's thread is pinned to the CPU that submits to it, and a thread polling there
# time-shares that CPU with the submitter (measured: 0.5x the sleeping server at QD 1).
serve_pm 9 $PMEM9 $SSD_PMP --ublk-poll --ublk-queues 1; UB_POLL=$UBLK PID_POLL=$PID
# The ublk frontend alone: pmcache's null device (reads return zeroes, writes are dropped),
# the ceiling of any server behind ublk in this guest; sleeping and polling.
null_dev() { # null_dev NAME ARGS...: sets UBLK and PID
  name=$1; shift
  case " $* " in *" --queues "*) queues= ;; *) queues="--queues $CPUS" ;; esac
  $PM ublk null --size ${WS}M $queues "$@" > /tmp/serve-$name.log 2>&1 &
  PID=$!
  wait_until "grep -q 'ublk device:' /tmp/serve-$name.log || ! kill -0 $PID 2>/dev/null" \
    "pmcache ublk null $* did not start"
  UBLK=$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' /tmp/serve-$name.log | head -n 1)
  [ -n "$UBLK" ] && [ -b "$UBLK" ] || fail "pmcache ublk null $*: no ublk device"
}
null_dev null; UB_NULL=$UBLK PID_NULL=$PID
null_dev nullpoll --poll --queues 1; UB_NULLP=$UBLK PID_NULLP=$PID
log "pmcache: $UB_WB (write-back, medium on /dev/$PMEM6, backing /dev/$SSD_PM), $UB_WT (write-through, /dev/$PMEM7, /dev/$SSD_PMWT), $UB_POLL (write-back, polling, /dev/$PMEM9, /dev/$SSD_PMP), $UB_NULL (null), $UB_NULLP (null, polling), $CPUS ublk queues each"
for p in $PID_WB $PID_POLL $PID_NULL; do
  for t in /proc/$p/task/*; do
    case "$(cat $t/comm)" in *ublk*|*queue*|pmcache) ;; *) continue ;; esac
    log "  pid $p thread ${t##*/} ($(cat $t/comm)): $(grep Cpus_allowed_list $t/status | tr -s '\t' ' ')"
  done
done

# --- rublk (a peer ublk server) and the kernel's loop device over the raw NVDIMM -------------
# rublk's null target copies data as pmcache does (no -u); its loop target does direct I/O to
# the raw NVDIMM; both with pmcache's queues, depth and largest request.
$RUBLK add null -n 20 -q $CPUS -d 128 -b 1MiB --quiet > /tmp/serve-rublk-null.log 2>&1 \
  || { cat /tmp/serve-rublk-null.log; fail "rublk add null"; }
$RUBLK add loop -n 21 -q $CPUS -d 128 -b 1MiB -f /dev/$PMEM0 --quiet > /tmp/serve-rublk-loop.log 2>&1 \
  || { cat /tmp/serve-rublk-loop.log; fail "rublk add loop -f /dev/$PMEM0"; }
wait_until "[ -b /dev/ublkb20 ] && [ -b /dev/ublkb21 ]" "no rublk devices /dev/ublkb20, /dev/ublkb21"
RB_NULL=/dev/ublkb20 RB_LOOP=/dev/ublkb21
rublk_pid() { # rublk_pid N: the rublk process serving device N
  for d in /proc/[0-9]*; do
    [ "$(cat $d/comm 2>/dev/null)" = rublk ] || continue
    case " $(tr '\0' ' ' < $d/cmdline) " in *" -n $1 "*) echo ${d#/proc/}; return 0 ;; esac
  done
  fail "no rublk process serving device $1"
}
PID_RBNULL=$(rublk_pid 20) PID_RBLOOP=$(rublk_pid 21)
wait_until "[ -b /dev/loop$loopn ]" "no /dev/loop$loopn"
$LOSETUP --direct-io=on /dev/loop$loopn /dev/$PMEM0 || fail "losetup --direct-io=on /dev/loop$loopn /dev/$PMEM0"
LOOP_RAW=/dev/loop$loopn
[ "$(cat /sys/block/loop$loopn/loop/dio)" = 1 ] || fail "$LOOP_RAW does not do direct I/O"
loopn=$((loopn + 1))
log "rublk: $RB_NULL (null, pid $PID_RBNULL), $RB_LOOP (loop over /dev/$PMEM0, pid $PID_RBLOOP); kernel loop: $LOOP_RAW over /dev/$PMEM0 (direct I/O)"

# --- the library bed's DAX file system -------------------------------------------------------
mkfs.ext4 -q -F -b 4096 /dev/$PMEM8 || fail "mkfs.ext4 /dev/$PMEM8"
mkdir -p /mnt/lib
mount -t ext4 -o dax /dev/$PMEM8 /mnt/lib || fail "mount -o dax /dev/$PMEM8"
grep " /mnt/lib " /proc/mounts | grep -q dax || fail "/mnt/lib is not mounted with dax"

# --- 000-policy's NVM→HDD stacks: each layer on an NVDIMM of its own, a throttled HDD behind ---
if [ "$POLICY" = 1 ]; then
  make_bcache $PMEM10 $NS15; BCH=$BC
  make_dmcache dmch $PMEM11 $NS16 512
  dm_create wch "0 $(blockdev --getsz /dev/$NS17) writecache p /dev/$NS17 /dev/$PMEM12 4096 0"
  serve_pm 13 $PMEM13 $NS18; UB_H=$UBLK
  log "000-policy: NVM→HDD stacks /dev/$BCH, dmch, wch, $UB_H over HDDs $NS15 $NS16 $NS17 $NS18"
fi

# --- series: device, counters, mode ----------------------------------------------------------
# use BASE: sets DEV, SYS (the cache to warm; "" for a raw device) and CTR (how its read hits
# and misses are counted), and switches bcache's mode and cutoff for the series.
use() {
  case "$1" in
    "NVM (raw pmem)"|NVM) DEV=/dev/$PMEM0 SYS= CTR=none ;;
    "SSD (raw nvme)") DEV=/dev/$SSD_RAW SYS= CTR=none ;;
    "HDD (throttled nvme)") DEV=/dev/$HDD_RAW SYS= CTR=none ;;
    bcache|"bcache NVM→SSD") bc_set $BC0 writethrough 4194304; DEV=/dev/$BC0 SYS=bc0 CTR="bcache $PMEM1 $SSD_BC" ;;
    "bcache (cutoff 0)") bc_set $BC0 writethrough 0; DEV=/dev/$BC0 SYS=bc0 CTR="bcache $PMEM1 $SSD_BC" ;;
    "bcache (writeback)") bc_set $BC0 writeback 4194304; DEV=/dev/$BC0 SYS=bc0 CTR="bcache $PMEM1 $SSD_BC" ;;
    "bcache SSD→HDD") bc_set $BC1 writethrough 4194304; DEV=/dev/$BC1 SYS=bc1 CTR="bcache $SSDC_BC $HDD_BC" ;;
    dm-cache|"dm-cache NVM→SSD") DEV=/dev/mapper/dmc SYS=dmc CTR="dm dmc" ;;
    "dm-cache (32 KiB blocks)") DEV=/dev/mapper/dmc32k SYS=dmc32k CTR="dm dmc32k" ;;
    "dm-cache (writethrough)") DEV=/dev/mapper/dmcwt SYS=dmcwt CTR="dm dmcwt" ;;
    "dm-cache SSD→HDD") DEV=/dev/mapper/dmchdd SYS=dmchdd CTR="dm dmchdd" ;;
    dm-writecache) DEV=/dev/mapper/wc SYS=wc CTR=none ;;
    "pmcache (ublk)"|pmcache|"pmcache NVM→SSD") DEV=$UB_WB SYS=pm CTR="pm /tmp/pm6.ctl" ;;
    "pmcache (ublk, write-through)") DEV=$UB_WT SYS=pmwt CTR="pm /tmp/pm7.ctl" ;;
    "pmcache (ublk, poll)") DEV=$UB_POLL SYS=pmpoll CTR="pm /tmp/pm9.ctl" ;;
    "ublk null (no cache)") DEV=$UB_NULL SYS= CTR=none ;;
    "ublk null (poll)") DEV=$UB_NULLP SYS= CTR=none ;;
    "rublk null") DEV=$RB_NULL SYS= CTR=none ;;
    "rublk loop (raw pmem)") DEV=$RB_LOOP SYS= CTR=none ;;
    "loop (raw pmem)") DEV=$LOOP_RAW SYS= CTR=none ;;
    *) fail "unknown series '$1'" ;;
  esac
}
# server_pid BASE: the process of the user-space server behind the series (empty: in the kernel)
server_pid() {
  case "$1" in
    "pmcache (ublk)") echo $PID_WB ;;
    "pmcache (ublk, write-through)") echo $PID_WT ;;
    "pmcache (ublk, poll)") echo $PID_POLL ;;
    "ublk null (no cache)") echo $PID_NULL ;;
    "ublk null (poll)") echo $PID_NULLP ;;
    "rublk null") echo $PID_RBNULL ;;
    "rublk loop (raw pmem)") echo $PID_RBLOOP ;;
    *) echo ;;
  esac
}
jnum() { sed -n "s/.*\"$1\":\([0-9]*\).*/\1/p" /tmp/stats.json | head -n 1; }
counters() { # counters KIND ARGS: "READ_HITS READ_MISSES" so far, or "null null"
  case "$1" in
    none) echo "null null" ;;
    bcache) echo "$(awk '{print $1}' /sys/block/$2/stat) $(awk '{print $1}' /sys/block/$3/stat)" ;;
    dm) dmsetup status "$2" > /tmp/dm-status 2>&1 || { cat /tmp/dm-status >&2; fail "dmsetup status $2"; }
        awk '{print $8, $9}' /tmp/dm-status ;;
    pm) $PM stats --json --control "$2" > /tmp/stats.json 2>&1 || { cat /tmp/stats.json >&2; fail "pmcache stats --control $2"; }
        h=$(jnum read_hits) a=$(jnum read_misses_admitted) b=$(jnum read_misses_bypassed) s=$(jnum read_misses_sequential)
        [ -n "$h" ] && [ -n "$a" ] && [ -n "$b" ] && [ -n "$s" ] || { cat /tmp/stats.json >&2; fail "no read counters in pmcache stats"; }
        echo "$h $((a + b + s))" ;;
    *) fail "unknown counters '$1'" ;;
  esac
}
delta() { # delta "H0 M0" "H1 M1": sets HITS and MISSES (or null)
  set -- $1 $2
  if [ "$1" = null ]; then HITS=null MISSES=null; else HITS=$(($3 - $1)) MISSES=$(($4 - $2)); fi
}
# fio_run DEV ARGS...: one fio run; sets BPS (bytes/s, reads + writes) and IOPS
fio_run() {
  dev=$1; shift
  fio --name=p --filename=$dev --ioengine=psync --direct=1 --group_reporting --minimal "$@" \
    < /dev/null > /tmp/fio.out 2> /tmp/fio.err || { cat /tmp/fio.err /tmp/fio.out; fail "fio on $dev: $*"; }
  line=$(grep '^3;' /tmp/fio.out | tail -n 1)
  [ -n "$line" ] || { cat /tmp/fio.out /tmp/fio.err; fail "no terse line from fio on $dev: $*"; }
  BPS=$(echo "$line" | awk -F';' '{printf "%.1f", ($7 + $48) * 1024}')
  RKB=$(echo "$line" | cut -d';' -f6)
  IOPS=$(echo "$line" | awk -F';' '{printf "%.1f", $8 + $49}')
  err=$(echo "$line" | cut -d';' -f5)
  [ "$err" = 0 ] || fail "fio on $dev reported error $err: $*"
}

# warm FIG SYS DEV CTR [MAX]: the cache of SYS holds the working set (see the header); with
# MAX, a top-up before a point: at most MAX passes, dm-writecache left as it is, a line
# printed only when the cache had lost part of the working set
warm() {
  fig=$1 sys=$2 dev=$3 ctr=$4 topup=${5:-}
  case $sys in
    wc)
      [ -n "$topup" ] && return 0
      fio_run $dev --rw=write --bs=1m --size=${WS}m
      printf 'PAPER000-WARM {"figure":"%s","system":"%s","passes":1,"hits":null,"misses":null}\n' $fig $sys
      return 0 ;;
    bc0) bc_set $BC0 writethrough 0 ;;
    bc1) bc_set $BC1 writethrough 0 ;;
  esac
  max=8
  case $sys in dmc*) max=30 ;; esac
  [ -n "$topup" ] && max=$topup
  pass=0
  while :; do
    pass=$((pass + 1))
    c0=$(counters $ctr)
    fio_run $dev --rw=randread --bs=256k --size=${WS}m
    c1=$(counters $ctr)
    delta "$c0" "$c1"
    { [ "$MISSES" = 0 ] || [ $pass -ge $max ]; } && break
  done
  [ -n "$topup" ] && [ $pass = 1 ] && return 0
  printf 'PAPER000-WARM {"figure":"%s","system":"%s","passes":%d,"hits":%s,"misses":%s,"topup":%s}\n' \
    $fig $sys $pass $HITS $MISSES "$([ -n "$topup" ] && echo true || echo false)"
}
# reads_only FIG X: whether the point's workload only reads (a miss there is the cache's loss,
# not the workload's own writes)
reads_only() {
  case "$1|$2" in
    000-fig3\|*|000-fig4a\|*|000-fig4b\|*|"000-fig2|rr"|"000-fig2|sr"|"000-fig5|100") return 0 ;;
  esac
  return 1
}

# --- figures ---------------------------------------------------------------------------------
label_size() {
  case $1 in 4k) echo "4 KiB" ;; 16k) echo "16 KiB" ;; 64k) echo "64 KiB" ;; 256k) echo "256 KiB" ;;
    1m) echo "1 MiB" ;; 4m) echo "4 MiB" ;; *) fail "unknown request size $1" ;; esac
}
# fig_point FIG X WORKING_SET: sets XL (the x label) and FA (fio's arguments)
fig_point() {
  case $1 in
    000-fig4a) XL=$2 FA="--rw=randread --bs=4k --numjobs=$2 --size=${WS}m" ;;
    000-fig4b) per=$((WS / $2)); XL=$2 FA="--rw=read --bs=4m --numjobs=$2 --size=${per}m --offset_increment=${per}m" ;;
    000-fig5) XL="$2 %" FA="--rw=rw --rwmixread=$2 --bs=4m --size=${WS}m" ;;
    000-fig6) XL=$2 FA="--rw=randrw --rwmixread=50 --bs=4k --numjobs=$2 --size=${WS}m" ;;
    000-fig3) XL=$(label_size $2) FA="--rw=randread --bs=$2 --size=${3}m" ;;
    000-fig2)
      case $2 in
        rr) XL="4K rand read" FA="--rw=randread --bs=4k --size=${WS}m" ;;
        sr) XL="4M seq read" FA="--rw=read --bs=4m --size=${WS}m" ;;
        rm) XL="4K rand 50:50" FA="--rw=randrw --rwmixread=50 --bs=4k --size=${WS}m" ;;
        sm) XL="4M seq 50:50" FA="--rw=rw --rwmixread=50 --bs=4m --size=${WS}m" ;;
      esac ;;
  esac
}
# Beside the caches, on every point of Figs 4, 5 and 6: the user-space frontends with nothing
# (null) or a plain remapper (loop) behind them, and the kernel's loop device.
REFERENCES="ublk null (no cache)
ublk null (poll)
rublk null
rublk loop (raw pmem)
loop (raw pmem)"
READ_SERIES="NVM (raw pmem)
bcache
dm-cache
dm-cache (32 KiB blocks)
dm-writecache
pmcache (ublk)
pmcache (ublk, poll)
$REFERENCES"
MIXED_SERIES="NVM (raw pmem)
bcache
bcache (writeback)
dm-cache
dm-cache (writethrough)
dm-cache (32 KiB blocks)
dm-writecache
pmcache (ublk)
pmcache (ublk, poll)
pmcache (ublk, write-through)
$REFERENCES"
POINTS=0
# figure FIG XS SERIES: series lines are "NAME|BASE|SET" (SET: Fig 3's working set in MiB)
figure() {
  fig=$1 xs=$2 series=$3
  log "$fig: warming up"
  warmed=" "
  while IFS='|' read -r name base wset; do
    use "$base"
    if [ -n "$SYS" ] && [ "${warmed#* $SYS }" = "$warmed" ]; then
      warm $fig $SYS $DEV "$CTR"
      warmed="$warmed$SYS "
    fi
  done <<EOF
$series
EOF
  nseries=$(echo "$series" | wc -l)
  log "$fig: $RUNS run(s) x {$xs} x $nseries series, $SECS s each"
  run=0
  while [ $run -lt $RUNS ]; do
    xi=0
    for x in $xs; do
      rot=$(((run + xi) % nseries))
      echo "$series" | awk -v r=$rot '{ line[NR - 1] = $0 } END { for (i = 0; i < NR; i++) print line[(i + r) % NR] }' > /tmp/order
      while IFS='|' read -r name base wset; do
        fig_point $fig $x "${wset:-$WS}"
        tries=0
        while :; do
          use "$base"
          # Every cache is topped up before each point: another series' writes (bcache's
          # sequential cutoff invalidating what a large write bypassed) may have taken part
          # of the working set out.
          if [ -n "$SYS" ]; then
            warm $fig $SYS $DEV "$CTR" 2
            use "$base"
          fi
          c0=$(counters $CTR)
          fio_run $DEV --time_based --runtime=$SECS $FA
          c1=$(counters $CTR)
          delta "$c0" "$c1"
          refused=false
          # A point that only reads and found less than 95 % of its reads cached measures
          # misses, not the layer's hits: run again after a top-up, twice, then refused.
          if reads_only $fig $x && [ "$HITS" != null ] && [ $((HITS + MISSES)) -gt 0 ] \
            && [ $((HITS * 100)) -lt $(((HITS + MISSES) * 95)) ]; then
            tries=$((tries + 1))
            if [ $tries -lt 3 ]; then
              log "$fig $XL $name run $run: $HITS hits, $MISSES misses; topped up and run again"
              continue
            fi
            refused=true
          fi
          break
        done
        printf 'PAPER000 {"figure":"%s","x":"%s","series":"%s","run":%d,"bytes_per_s":%s,"iops":%s,"cache_hits":%s,"cache_misses":%s,"refused":%s}\n' \
          "$fig" "$XL" "$name" $run $BPS $IOPS $HITS $MISSES $refused
        POINTS=$((POINTS + 1))
      done < /tmp/order
      xi=$((xi + 1))
    done
    run=$((run + 1))
  done
}
# --- where a request's time goes (000-time) --------------------------------------------------
HZ=100 # USER_HZ: the unit of /proc's tick counts
# sysstat: "USER NICE SYSTEM IDLE IOWAIT IRQ SOFTIRQ CTXT" of the whole guest so far
sysstat() {
  awk '/^cpu / { v = $2 " " $3 " " $4 " " $5 " " $6 " " $7 " " $8 } /^ctxt / { c = $2 }
    END { print v, c }' /proc/stat
}
# acct PID...: "USER SYSTEM CTX MIGRATIONS" of those processes so far: CPU ticks of the
# processes (their threads that ended and their children reaped included), switches and
# migrations of their live threads (MIGRATIONS "null" where the kernel has no
# /proc/PID/task/TID/sched); "0 0 0 0" for none
acct() {
  [ $# -gt 0 ] || { echo "0 0 0 0"; return 0; }
  ticks=$(for p in "$@"; do cat /proc/$p/stat 2>/dev/null; done \
    | awk '{ sub(/.*\) /, ""); u += $12 + $14; s += $13 + $15 } END { print u + 0, s + 0 }')
  ctx=$(for p in "$@"; do cat /proc/$p/task/*/status 2>/dev/null; done \
    | awk '/ctxt_switches/ { c += $2 } END { print c + 0 }')
  if ls /proc/$1/task/*/sched > /dev/null 2>&1; then
    mig=$(for p in "$@"; do cat /proc/$p/task/*/sched 2>/dev/null; done \
      | awk '/se.nr_migrations/ { m += $3 } END { print m + 0 }')
  else
    mig=null
  fi
  echo "$ticks $ctx $mig"
}
fio_pids() {
  for d in /proc/[0-9]*; do [ "$(cat $d/comm 2>/dev/null)" = fio ] && echo ${d#/proc/}; done
  return 0
}
# time_point WORKLOAD FIO_ARGS SERIES RUN: one fio run of SECS + 8 s; the counters over SECS s
# from its third second on, while every fio process lives (a window that outlived one is
# measured again, up to three times)
time_point() {
  label=$1 fa=$2 name=$3 run=$4
  use "$name"
  spid=$(server_pid "$name")
  tries=0
  while :; do
    tries=$((tries + 1))
    fio --name=p --filename=$DEV --ioengine=psync --direct=1 --group_reporting --minimal \
      --time_based --runtime=$((SECS + 8)) $fa < /dev/null > /tmp/fio.out 2> /tmp/fio.err &
    fpid=$!
    sleep 2
    fios=$(fio_pids)
    [ -n "$fios" ] || { cat /tmp/fio.err; fail "fio on $DEV did not start: $fa"; }
    s0=$(sysstat) f0=$(acct $fios) v0=$(acct $spid) u0=$(cut -d' ' -f1 /proc/uptime)
    sleep $SECS
    s1=$(sysstat) f1=$(acct $fios) v1=$(acct $spid) u1=$(cut -d' ' -f1 /proc/uptime)
    alive=1
    for p in $fios; do kill -0 $p 2>/dev/null || alive=0; done
    wait $fpid || { cat /tmp/fio.err /tmp/fio.out; fail "fio on $DEV: $fa"; }
    [ $alive = 1 ] && break
    [ $tries -lt 3 ] || fail "$name, $label: fio ended before the counters' window did, three times"
    log "$name, $label: fio ended before the counters' window did; measured again"
  done
  line=$(grep '^3;' /tmp/fio.out | tail -n 1)
  [ -n "$line" ] || { cat /tmp/fio.out /tmp/fio.err; fail "no terse line from fio on $DEV: $fa"; }
  iops=$(echo "$line" | awk -F';' '{printf "%.1f", $8 + $49}')
  awk -v s0="$s0" -v s1="$s1" -v f0="$f0" -v f1="$f1" -v v0="$v0" -v v1="$v1" -v u0="$u0" \
    -v u1="$u1" -v iops="$iops" -v hz=$HZ -v w="$label" -v n="$name" -v r=$run -v srv="$spid" '
    function acc(x, y) {
      return sprintf("{\"user\":%d,\"system\":%d,\"ctx\":%d,\"migrations\":%s}", y[1] - x[1],
        y[2] - x[2], y[3] - x[3], x[4] == "null" ? "null" : y[4] - x[4])
    }
    BEGIN {
      split(s0, a, " "); split(s1, b, " "); split(f0, c, " "); split(f1, d, " ")
      split(v0, e, " "); split(v1, f, " ")
      printf "PAPER000-TIME {\"workload\":\"%s\",\"series\":\"%s\",\"run\":%d,\"window_s\":%.2f,", w, n, r, u1 - u0
      printf "\"iops\":%s,\"hz\":%d,\"system\":{\"user\":%d,\"nice\":%d,\"system\":%d,", iops, hz, b[1] - a[1], b[2] - a[2], b[3] - a[3]
      printf "\"idle\":%d,\"iowait\":%d,\"irq\":%d,\"softirq\":%d,\"ctxt\":%d},", b[4] - a[4], b[5] - a[5], b[6] - a[6], b[7] - a[7], b[8] - a[8]
      printf "\"fio\":%s,\"server\":%s}\n", acc(c, d), srv == "" ? "null" : acc(e, f)
    }'
  TIMES=$((TIMES + 1))
}
TIME_SERIES="NVM (raw pmem)
loop (raw pmem)
bcache
dm-cache
dm-writecache
rublk null
rublk loop (raw pmem)
ublk null (no cache)
ublk null (poll)
pmcache (ublk)
pmcache (ublk, poll)"
TIMES=0
time_figure() {
  fig=000-time
  log "$fig: warming up"
  warmed=" "
  echo "$TIME_SERIES" > /tmp/time-series
  while IFS= read -r name; do
    use "$name"
    if [ -n "$SYS" ] && [ "${warmed#* $SYS }" = "$warmed" ]; then
      warm $fig $SYS $DEV "$CTR"
      warmed="$warmed$SYS "
    fi
  done < /tmp/time-series
  nseries=$(wc -l < /tmp/time-series)
  log "$fig: $RUNS run(s) x 3 workloads x $nseries layers, $((SECS + 8)) s each"
  run=0
  while [ $run -lt $RUNS ]; do
    wi=0
    for w in rr sr rm; do
      case $w in
        rr) label="4K rand read" fa="--rw=randread --bs=4k --size=${WS}m" ;;
        sr) label="4M seq read" fa="--rw=read --bs=4m --size=${WS}m" ;;
        rm) label="4K rand 50:50" fa="--rw=randrw --rwmixread=50 --bs=4k --size=${WS}m" ;;
      esac
      rot=$(((run + wi) % nseries))
      awk -v r=$rot '{ line[NR - 1] = $0 } END { for (i = 0; i < NR; i++) print line[(i + r) % NR] }' /tmp/time-series > /tmp/order
      while IFS= read -r name; do
        time_point "$label" "$fa" "$name" $run
      done < /tmp/order
      wi=$((wi + 1))
    done
    run=$((run + 1))
  done
}

# --- pmcache embedded as a library (000-library) ---------------------------------------------
library_figure() {
  log "000-library: pmcache embedded in a process, its medium on /mnt/lib (ext4 -o dax on /dev/$PMEM8)"
  $PM bench paper 000-library --scale $SCALE --runs $RUNS --seconds $SECS --pm-dir /mnt/lib \
    --dir /mnt/nvme --out /tmp/lib > /tmp/lib.log 2>&1 || { cat /tmp/lib.log; fail "pmcache bench paper 000-library"; }
  points=/tmp/lib/raw/000-library.jsonl
  grep -q '"medium":"dax"' $points || fail "the library's medium is not dax: $(head -c 300 $points)"
  while IFS= read -r line; do
    echo "PAPER000 $line"
    POINTS=$((POINTS + 1))
  done < $points
  # fio's libpmem engine on a file of the same file system: a cross-check of the raw loads and
  # stores (with direct=1 libpmem copies with non-temporal stores and drains).
  dd if=/dev/zero of=/mnt/lib/fio.pmem bs=1M count=$WS 2>/dev/null || fail "creating /mnt/lib/fio.pmem"
  log "000-library: fio libpmem on /mnt/lib/fio.pmem"
  run=0
  while [ $run -lt $RUNS ]; do
    for fig in 000-fig4a 000-fig4b 000-fig5 000-fig6; do
      xs=$THREADS
      [ $fig = 000-fig5 ] && xs=$SHARES
      for x in $xs; do
        fig_point $fig $x $WS
        fio_run /mnt/lib/fio.pmem --ioengine=libpmem --time_based --runtime=$SECS $FA
        printf 'PAPER000 {"figure":"%s","x":"%s","series":"fio libpmem (DAX)","run":%d,"bytes_per_s":%s,"iops":%s,"cache_hits":null,"cache_misses":null}\n' \
          "$fig" "$XL" $run $BPS $IOPS
        POINTS=$((POINTS + 1))
      done
    done
    run=$((run + 1))
  done
}

# --- where a cache's policy decides (000-policy) ---------------------------------------------
# The layers in front of the SSDs (bcache, dm-cache, dm-writecache, pmcache: each layer's own
# defaults) on regions of their devices that no other figure touches, and the same layers in
# front of the throttled HDDs. Printed as `PAPER000-POLICY {json}` lines.
PPOINTS=0
ppoint() { printf 'PAPER000-POLICY %s\n' "$1"; PPOINTS=$((PPOINTS + 1)); }
POLICY_LAYERS="bcache
dm-cache
dm-writecache
pmcache (ublk)"
# puse NAME [hdd]: sets DEV, PCTR (how its reads' hits and misses are counted, in the layer's
# own unit), BACK (its backing device) and, for the write figure, the mode
puse() {
  case "$1|${2:-}" in
    "bcache|") bc_set $BC0 writethrough 4194304; DEV=/dev/$BC0 PCTR="bcache $PMEM1 $SSD_BC" BACK=$SSD_BC ;;
    "bcache (writeback)|") bc_set $BC0 writeback 4194304; DEV=/dev/$BC0 PCTR="bcache $PMEM1 $SSD_BC" BACK=$SSD_BC ;;
    "dm-cache|") DEV=/dev/mapper/dmc PCTR="dm dmc" BACK=$SSD_DMC ;;
    "dm-writecache|") DEV=/dev/mapper/wc PCTR="under $SSD_WC" BACK=$SSD_WC ;;
    "pmcache (ublk)|") DEV=$UB_WB PCTR="pm /tmp/pm6.ctl" BACK=$SSD_PM ;;
    "pmcache (ublk, poll)|") DEV=$UB_POLL PCTR="pm /tmp/pm9.ctl" BACK=$SSD_PMP ;;
    "SSD (raw nvme)|") DEV=/dev/$SSD_RAW PCTR=none BACK=$SSD_RAW ;;
    "bcache|hdd") DEV=/dev/$BCH PCTR="bcache $PMEM10 $NS15" BACK=$NS15 ;;
    "dm-cache|hdd") DEV=/dev/mapper/dmch PCTR="dm dmch" BACK=$NS16 ;;
    "dm-writecache|hdd") DEV=/dev/mapper/wch PCTR="under $NS17" BACK=$NS17 ;;
    "pmcache (ublk)|hdd") DEV=$UB_H PCTR="pm /tmp/pm13.ctl" BACK=$NS18 ;;
    *) fail "000-policy: unknown layer '$1' ${2:-}" ;;
  esac
}
# pcounters KIND ARGS: "HITS MISSES" so far. bcache: sectors read from its cache and its backing
# device; dm-cache and pmcache: their own read counters; under DEV (a layer that counts
# nothing): "0 SECTORS" read from its backing device, the hits worked out from fio's reads
sectors_read() { awk '{print $3}' /sys/block/$1/stat; }
pcounters() {
  case "$1" in
    bcache) echo "$(sectors_read $2) $(sectors_read $3)" ;;
    under) echo "0 $(sectors_read $2)" ;;
    *) counters "$@" ;;
  esac
}
# pdelta KIND "H0 M0" "H1 M1": sets HITS and MISSES of the run fio just made (RKB: its reads)
pdelta() {
  kind=$1
  delta "$2" "$3"
  if [ "$kind" = under ]; then
    HITS=$((RKB * 2 - MISSES))
    [ $HITS -ge 0 ] || HITS=0
  fi
}
# wait_quiet DEV: until DEV has written nothing for 3 s (a write-back layer done cleaning), at
# most 240 s; sets QUIET_S
wait_quiet() {
  last=-1 still=0 QUIET_S=0
  while [ $still -lt 3 ] && [ $QUIET_S -lt 240 ]; do
    now=$(awk '{print $7}' /sys/block/$1/stat)
    if [ "$now" = "$last" ]; then still=$((still + 1)); else still=0; fi
    last=$now
    sleep 1
    QUIET_S=$((QUIET_S + 1))
  done
}
policy_figure() {
  region_warm=$WS region_scan=$((WS + PWS)) region_dirty=$((WS + 2 * PWS))
  # 1. Warm-up from cold: passes of random 64 KiB reads over a working set never read before,
  # each pass reading every block once; the hits of each pass.
  log "000-policy: warm-up from cold, $PASSES passes over $PWS MiB at $region_warm MiB"
  echo "$POLICY_LAYERS" > /tmp/players
  while IFS= read -r name; do
    puse "$name"
    pass=1
    while [ $pass -le $PASSES ]; do
      kind=${PCTR%% *}
      c0=$(pcounters $PCTR)
      fio_run $DEV --rw=randread --bs=64k --offset=${region_warm}m --size=${PWS}m
      c1=$(pcounters $PCTR)
      pdelta $kind "$c0" "$c1"
      ppoint "{\"experiment\":\"warm-up\",\"series\":\"$name\",\"run\":0,\"x\":$pass,\"hits\":$HITS,\"misses\":$MISSES,\"bytes_per_s\":$BPS}"
      pass=$((pass + 1))
    done
  done < /tmp/players
  # 2. Data never written through the cache, read sequentially twice (1 MiB requests): the
  # hits and the bandwidth of the second read.
  log "000-policy: a sequential read, twice, of $PWS MiB never written through the caches"
  while IFS= read -r name; do
    puse "$name"
    kind=${PCTR%% *}
    for pass in 1 2; do
      c0=$(pcounters $PCTR)
      fio_run $DEV --rw=read --bs=1m --offset=${region_scan}m --size=${PWS}m
      c1=$(pcounters $PCTR)
      pdelta $kind "$c0" "$c1"
      ppoint "{\"experiment\":\"scan\",\"series\":\"$name\",\"run\":0,\"x\":$pass,\"hits\":$HITS,\"misses\":$MISSES,\"bytes_per_s\":$BPS}"
    done
  done < /tmp/players
  # 3. Hits beside misses to the throttled HDD: 4 KiB random reads at QD 16, 90 % of them over
  # a hot tenth of the device that is cached (warmed first), 10 % over the cold rest; every
  # request's latency logged with its offset, the hits' percentiles taken from the hot
  # tenth's requests; against the same layer's run with every read on the hot tenth.
  log "000-policy: hits beside misses to the throttled HDDs, hot set $PWS MiB of $HDDP MiB"
  while IFS= read -r name; do
    puse "$name" hdd
    case "$name" in
      bcache) sys=bch ;; dm-cache) sys=dmch ;; dm-writecache) sys=wch ;; *) sys=pmh ;;
    esac
    if [ $sys = wch ]; then
      fio_run $DEV --rw=write --bs=1m --size=${PWS}m
    else
      [ $sys = bch ] && bc_set $BCH writethrough 0
      pass=0
      while :; do
        pass=$((pass + 1))
        kind=${PCTR%% *}
        c0=$(pcounters $PCTR)
        fio_run $DEV --rw=randread --bs=256k --size=${PWS}m
        c1=$(pcounters $PCTR)
        pdelta $kind "$c0" "$c1"
        { [ "$MISSES" = 0 ] || [ $pass -ge 30 ]; } && break
      done
      [ $sys = bch ] && bc_set $BCH writethrough 4194304
      log "000-policy: $name (HDD) warmed in $pass passes, $MISSES misses in the last"
    fi
    run=0
    while [ $run -lt $RUNS ]; do
      for case in all 90; do
        if [ $case = all ]; then span="--size=${PWS}m"; else span="--size=${HDDP}m --random_distribution=zoned:90/10:10/90"; fi
        rm -f /tmp/plat_*.log
        kind=${PCTR%% *}
        c0=$(pcounters $PCTR)
        fio --name=p --filename=$DEV --ioengine=libaio --iodepth=16 --direct=1 --rw=randread \
          --bs=4k $span --time_based --runtime=$SECS --write_lat_log=/tmp/plat --log_offset=1 \
          --minimal < /dev/null > /tmp/fio.out 2> /tmp/fio.err || { cat /tmp/fio.err; fail "fio (QD 16) on $DEV"; }
        line=$(grep '^3;' /tmp/fio.out | tail -n 1)
        RKB=$(echo "$line" | cut -d';' -f6)
        iops=$(echo "$line" | awk -F';' '{printf "%.1f", $8}')
        c1=$(pcounters $PCTR)
        pdelta $kind "$c0" "$c1"
        hot=$((PWS * 1048576))
        awk -F', ' -v hot=$hot '$5 < hot { print $2 }' /tmp/plat_lat.1.log | sort -n > /tmp/hits.lat
        n=$(wc -l < /tmp/hits.lat)
        [ "$n" -gt 0 ] || fail "000-policy: no request on the hot set of $DEV"
        p50=$(awk -v n=$n 'NR == int(n * 0.50) + 1 { printf "%.1f", $1 / 1000 }' /tmp/hits.lat)
        p99=$(awk -v n=$n 'NR == int(n * 0.99) + 1 { printf "%.1f", $1 / 1000 }' /tmp/hits.lat)
        all=$(wc -l < /tmp/plat_lat.1.log)
        ppoint "{\"experiment\":\"hits-beside-misses\",\"series\":\"$name\",\"run\":$run,\"x\":\"$case\",\"hits\":$HITS,\"misses\":$MISSES,\"iops\":$iops,\"hot_requests\":$n,\"requests\":$all,\"hit_p50_us\":$p50,\"hit_p99_us\":$p99}"
      done
      run=$((run + 1))
    done
  done < /tmp/players
  # 4. Full of dirty data: 4 KiB random writes at QD 16 over twice the NVDIMM for DSECS s, the
  # IOPS of each second and the p99.9 latency; beside the same SSD alone. pmcache runs twice:
  # its default server, and the polling one (the ublk round trip without the sleeps). Each layer is left to
  # finish cleaning (its SSD quiet) before the next starts.
  log "000-policy: $DSECS s of random writes over $((2 * NV)) MiB per write-back layer"
  printf '%s\n' "SSD (raw nvme)" "bcache (writeback)" dm-cache dm-writecache "pmcache (ublk)" \
    "pmcache (ublk, poll)" > /tmp/dlayers
  # pcleaner CTL: pmcache's cleaner counters so far, in the order of CLEANER_KEYS
  # (keys of `pmcache stats --json`; the point names them without the `cleaner_` prefix)
  CLEANER_KEYS="cleaner_blocks_cleaned cleaner_writes_issued stalls stall_ns_total throttled_writes throttle_ns_total"
  pcleaner() {
    $PM stats --json --control "$1" > /tmp/stats.json 2>&1 || { cat /tmp/stats.json >&2; fail "pmcache stats --control $1"; }
    for k in $CLEANER_KEYS; do
      v=$(jnum $k)
      [ -n "$v" ] || { cat /tmp/stats.json >&2; fail "no $k in pmcache stats"; }
      printf '%s ' "$v"
    done
  }
  while IFS= read -r name; do
    puse "$name"
    rm -f /tmp/piops_*.log
    ctl=
    case "$PCTR" in pm\ *) ctl=${PCTR#pm }; c0=$(pcleaner $ctl) || exit 1 ;; esac
    # the layer's SSD during the run: writes completed and sectors written (/sys/block stat
    # fields 5 and 7), for the size of what its write-back sends
    s0=$(awk '{print $5, $7}' /sys/block/$BACK/stat)
    fio --name=p --filename=$DEV --ioengine=libaio --iodepth=16 --direct=1 --rw=randwrite \
      --bs=4k --offset=${region_dirty}m --size=$((2 * NV))m --time_based --runtime=$DSECS \
      --write_iops_log=/tmp/piops --log_avg_msec=1000 --percentile_list=99.9 \
      --output-format=json < /dev/null > /tmp/fio.json 2> /tmp/fio.err || { cat /tmp/fio.err; fail "fio randwrite on $DEV"; }
    s1=$(awk '{print $5, $7}' /sys/block/$BACK/stat)
    backing=$(echo "$s0" "$s1" | awk '{ printf ",\"backing\":{\"writes\":%.0f,\"bytes\":%.0f}", $3 - $1, ($4 - $2) * 512 }')
    p999=$(grep -o '"99.900000" : [0-9]*' /tmp/fio.json | awk '{ if ($3 > m) m = $3 } END { printf "%.1f", m / 1000 }')
    persec=$(awk -F', ' '{ printf "%s%s", (NR > 1 ? "," : ""), $2 }' /tmp/piops_iops.1.log)
    [ -n "$persec" ] || fail "000-policy: no IOPS log from fio on $DEV"
    # pmcache: what its cleaner did during the run (deltas of its counters), and the dirty
    # blocks and slots it had when fio ended
    cleaner=
    if [ -n "$ctl" ]; then
      c1=$(pcleaner $ctl) || exit 1
      dirty=$(jnum dirty_slots) slots=$(jnum slot_count)
      cleaner=$(echo "$c0" "$c1" | awk -v keys="$CLEANER_KEYS" -v d="$dirty" -v s="$slots" '{
        n = split(keys, k, " "); out = ""
        for (i = 1; i <= n; i++) { name = k[i]; sub(/^cleaner_/, "", name); out = out sprintf("\"%s\":%.0f,", name, $(i + n) - $i) }
        printf ",\"cleaner\":{%s\"dirty_slots\":%d,\"slot_count\":%d}", out, d, s }')
    fi
    wait_quiet $BACK
    ppoint "{\"experiment\":\"dirty\",\"series\":\"$name\",\"run\":0,\"x\":\"\",\"p999_us\":$p999,\"quiet_after_s\":$QUIET_S,\"iops_per_s\":[$persec]$backing$cleaner}"
    log "000-policy: $name: p99.9 $p999 us, its SSD quiet $QUIET_S s after"
  done < /tmp/dlayers
}

lines() { echo "$1" | awk '{ print $0 "|" $0 "|" }'; }
for fig in $FIGS; do
  case $fig in
    000-time) time_figure ;;
    000-library) library_figure ;;
    000-policy) policy_figure ;;
    000-fig4a) figure $fig "$THREADS" "$(lines "$READ_SERIES")" ;;
    000-fig4b) figure $fig "$THREADS" "$(lines "$READ_SERIES
bcache (cutoff 0)")" ;;
    000-fig5) figure $fig "$SHARES" "$(lines "$MIXED_SERIES
bcache (cutoff 0)")" ;;
    000-fig6) figure $fig "$THREADS" "$(lines "$MIXED_SERIES")" ;;
    000-fig3)
      s3=$(for ws in $SETS; do
        for base in NVM bcache dm-cache pmcache; do echo "$base $ws MiB|$base|$ws"; done
      done)
      figure $fig "$SIZES" "$s3" ;;
    000-fig2) figure $fig "rr sr rm sm" "$(lines "NVM (raw pmem)
SSD (raw nvme)
HDD (throttled nvme)
bcache SSD→HDD
dm-cache SSD→HDD
bcache NVM→SSD
dm-cache NVM→SSD
pmcache NVM→SSD")" ;;
    *) fail "unknown figure $fig" ;;
  esac
done
echo "PAPER000-DONE $POINTS $TIMES $PPOINTS"
GUEST
} > "$script"

echo "== paper 000 in one guest: scale $scale, $runs run(s) of $seconds s, figures: $figs"
log="$work/guest.log"
: > "$log"
set +e
PMCACHE_GUEST_QEMU_ARGS="$qemu_args ${PMCACHE_GUEST_QEMU_ARGS:-}" \
  "$here/run-in-guest.sh" --timeout "$timeout_s" --mem "$mem_mib" --disk-mib 256 \
  ${PMCACHE_GUEST_ARGS:-} --copy "$exe" --copy "$(command -v fio)" \
  --copy "$(command -v ndctl)" --copy "$(command -v make-bcache)" \
  --copy "$(command -v dmsetup)" --copy "$(command -v mkfs.ext4)" --copy "$rublk" \
  --copy "$work/losetup" --copy "$script" \
  -- sh "$script" > "$log" 2>&1 &
runner=$!
# Progress: the guest's own lines, as they come.
tail -n +1 -f "$log" --pid "$runner" | grep --line-buffered -E '^(paper000|\[guest\])' || true
wait "$runner"
rc=$?
set -e
if ((rc != 0)); then
  cp "$log" "${out%.json}.guest.log"
  grep -E '^paper000: FAILED' -A 80 "$log" | tail -n 100 || tail -n 60 "$log"
  echo "paper000: the guest's console is in ${out%.json}.guest.log"
  echo "paper000: FAILED: the guest exited with $rc"
  exit 1
fi

qemu_version=$(qemu-system-x86_64 --version | head -n 1)
rublk_version=$("$rublk" --version 2>/dev/null | head -n 1)
if ! python3 - "$log" "$out" "$scale" "$runs" "$seconds" "$nv_mib" "$ws_mib" "$qemu_version" \
  "$sets" "$bc_bucket" "$rublk_version" "$ssd_iops" "$ssd_bps" "$passes" "$dirty_s" "$pm_cache_pct" "$pm_cleaner" <<'EOF'
import json, sys

log, out, scale, runs, seconds, nv_mib, ws_mib, qemu, sets, bc_bucket, rublk, ssd_iops, ssd_bps, policy_passes, policy_dirty_s, pm_cache_pct, pm_cleaner = sys.argv[1:]
runs, seconds, nv_mib, ws_mib = int(runs), int(seconds), int(nv_mib), int(ws_mib)
ssd_iops, ssd_bps = int(ssd_iops), int(ssd_bps)
bed, points, warm, times, policy, done = None, [], [], [], [], None


def payload(line, tag):
    text = line[len(tag):].strip()
    try:
        return json.loads(text)
    except ValueError:
        sys.exit(f"paper000: FAILED: a garbled line on the guest's console: {line!r}")


for line in open(log, encoding="utf-8", errors="replace"):
    line = line.rstrip("\n")
    if line.startswith("PAPER000-BED "):
        bed = payload(line, "PAPER000-BED ")
    elif line.startswith("PAPER000-WARM "):
        warm.append(payload(line, "PAPER000-WARM "))
    elif line.startswith("PAPER000-DONE "):
        done = [int(n) for n in line.split()[1:4]]
    elif line.startswith("PAPER000-POLICY "):
        policy.append(payload(line, "PAPER000-POLICY "))
    elif line.startswith("PAPER000-TIME "):
        times.append(payload(line, "PAPER000-TIME "))
    elif line.startswith("PAPER000 "):
        points.append(payload(line, "PAPER000 "))
if bed is None or done is None:
    sys.exit("paper000: FAILED: the guest did not report its kernel or its end")
if done != [len(points), len(times), len(policy)]:
    sys.exit(f"paper000: FAILED: the guest made {done} points, time windows and policy points, the console shows {[len(points), len(times), len(policy)]}")
for t in times:
    if t["iops"] <= 0 or t["window_s"] <= 0:
        sys.exit(f"paper000: FAILED: a time window without requests: {t}")
for p in points:
    if p["bytes_per_s"] <= 0:
        sys.exit(f"paper000: FAILED: a point without throughput: {p}")

cpus = bed["guest_cpus"]
notes = [
    f"One QEMU TCG guest ({cpus} vCPUs) runs every series in the same boot; absolute numbers are TCG's, only ratios to the raw NVM of the same boot mean anything.",
    f"Each system has its own emulated NVDIMM of {nv_mib} MiB (a file in the host's /dev/shm, an fsdax namespace in the guest) and its own NVMe namespace as backing store, so every stack is up at once.",
    f"fio runs with ioengine=psync, direct=1, queue depth 1 per job, time_based ({seconds} s per run), group_reporting, on the block devices themselves; the working set is the first {ws_mib} MiB of each device (Fig 3: the first {', '.join(sets.split())} MiB).",
    "Fig 4b's jobs each read their own part of the working set (size and offset_increment of working set / jobs).",
    "Rounds: for each run and each x, every series once, in an order that rotates by one from one run and x to the next.",
    f"bcache: make-bcache with its defaults but buckets of {bc_bucket} (it refuses a cache device of fewer than 1024 buckets; cache on the NVDIMM, backing on an NVMe namespace), congested_read/write_threshold_us set to 0 so that the slow emulated devices do not make it bypass the cache.",
    "bcache runs write-through (its default) with sequential_cutoff at its 4 MiB default unless the series says otherwise: 'bcache (cutoff 0)' sets it to 0 (Figs 4b and 5), 'bcache (writeback)' sets cache_mode writeback (Figs 5 and 6); one bcache device serves all three, switched in sysfs before each run.",
    "dm-cache: smq policy, 256 KiB blocks (the default the paper ran), writeback (the default); 'dm-cache (32 KiB blocks)' (the smallest block dm-cache accepts: it refuses 4 KiB) and 'dm-cache (writethrough)' are separate dm-cache devices, each on its own NVDIMM; the metadata devices are loop devices on files in the guest's tmpfs.",
    "dm-writecache: pmem mode ('p') on its NVDIMM, 4 KiB blocks, default watermarks; it caches writes only, so its warm-up writes the working set, and its reads of data not written through it go to the SSD.",
    "pmcache: pmcache serve --ublk with one ublk queue per vCPU, its medium a file on ext4 mounted -o dax on its NVDIMM (the kind 'dax'), cache size " + ("three quarters" if pm_cache_pct == "75" else f"{pm_cache_pct} %") + " of the NVDIMM, 4 KiB blocks, write-back" + (f", cleaner settings {pm_cleaner}" if pm_cleaner else "") + "; 'pmcache (ublk, write-through)' is a second server with --mode writethrough on its own NVDIMM.",
    "Read-only figures (3, 4a, 4b) run bcache write-through, dm-cache writeback and pmcache write-back, each layer's default; Fig 2 runs the same defaults with its mixes.",
    "Warm-up at the start of each figure: random 256 KiB reads over the working set (bcache with sequential_cutoff 0), pass after pass until a pass misses nothing or 8 passes (30 for dm-cache, whose smq promotes gradually; back-to-back passes promote faster than passes a second apart); dm-writecache gets one sequential 1 MiB write pass.",
    "cache_hits and cache_misses count reads during the measured run: dm-cache's read hits and misses from dmsetup status (requests), pmcache's read_hits and read misses from pmcache stats (4 KiB blocks), and for bcache the read requests that reached its cache device and its backing device (/sys/block/*/stat), since bcache's stats_total are folded in only every 13.6 s; null for raw devices and dm-writecache.",
    "The 'HDD' is an NVMe namespace QEMU throttles to 200 IOPS and 150 MB/s (throttling.iops-total, throttling.bps-total); the SSD→HDD stacks' cache device is another (unthrottled) NVMe namespace of the NVDIMM's size.",
    f"The 'SSD's are NVMe namespaces (sparse files on the host, cache=unsafe, so the host's page cache) that QEMU throttles to {ssd_iops} IOPS and {ssd_bps / 1e6:.0f} MB/s (throttling.iops-total, throttling.bps-total), so that a miss, a write-through write or a bypass costs what a device's would: unthrottled, the emulated NVMe path is as fast as the emulated NVDIMM at 4 MiB.",
    "pmcache runs in user space behind ublk: every request crosses from the kernel to the server and back, which TCG emulates at a high cost, while bcache and dm-* run in the kernel. 'ublk null (no cache)' is `pmcache ublk null` with one queue per vCPU: the same frontend with nothing behind it (reads return zeroes, writes are dropped), the ceiling of any ublk server in this guest.",
    "Write-back layers (bcache writeback, dm-cache, dm-writecache, pmcache) write dirty data back in the background, possibly during other series' runs; write figures (2, 5, 6) stay within the working set, so the caches keep holding it.",
    "'pmcache (ublk, poll)' is a third write-back server with --ublk-poll (its queue thread polls its ring instead of sleeping while requests come, up to 1 ms after the last one), on its own NVDIMM and NVMe namespace; 'ublk null (poll)' is the null device with --poll. Both have one queue, whose thread may run on any CPU: with a queue per CPU, each queue's thread is pinned to the CPU that submits to it, and polling there time-shares that CPU with the submitter.",
    f"'rublk null' and 'rublk loop (raw pmem)' are {rublk or 'rublk'} (a peer ublk server written on the same library, libublk): its null target copying data as pmcache's does, and its loop target over the raw NVDIMM with direct I/O; one queue per vCPU, depth 128 and 1 MiB requests as pmcache's, rublk's default single-CPU queue affinity.",
    "'loop (raw pmem)' is the kernel's loop device over the raw NVDIMM with direct I/O: a kernel layer that hands each request to a worker thread, as a user-space server does.",
]
def rate(fig, x, series):
    v = [p["bytes_per_s"] for p in points if p["figure"] == fig and p["x"] == x and p["series"] == series]
    return sum(v) / len(v) if v else None


for x in ("4K rand read", "4M seq read"):
    ssd, nvm = rate("000-fig2", x, "SSD (raw nvme)"), rate("000-fig2", x, "NVM (raw pmem)")
    if ssd and nvm:
        notes.append(f"In this guest the raw 'SSD' does {x} at {ssd / nvm:.2f} of the raw NVM's rate (Fig 2): what a miss or a write-through write costs against a hit.")
if cpus < 16:
    notes.append(f"Thread counts above {cpus} oversubscribe the guest's {cpus} vCPUs (which share the host's cores under TCG).")
topups = [w for w in warm if w.get("topup")]
warm = [w for w in warm if not w.get("topup")]
for w in warm:
    if w["misses"] not in (0, None):
        notes.append(f"{w['figure']}: the warm-up of {w['system']} still missed {w['misses']} reads in its last of {w['passes']} passes.")
if topups:
    lost = {}
    for w in topups:
        lost.setdefault(f"{w['figure']} {w['system']}", []).append(w["passes"])
    notes.append("Each cache is topped up before each point (random 256 KiB reads over the working set, at most 2 passes); top-ups that found part of the working set gone, by figure and system: " + "; ".join(f"{k} {len(v)}" for k, v in lost.items()) + ".")
refused = [p for p in points if p.get("refused")]
if refused:
    notes.append("Refused (a point that only reads and found under 95 % of its reads cached after two top-ups and re-runs; not drawn): " + "; ".join(f"{p['figure']} {p['x']} {p['series']} run {p['run']} ({p['cache_hits']} hits, {p['cache_misses']} misses)" for p in refused) + ".")
passes = {}
for w in warm:
    passes.setdefault(w["system"], []).append(str(w["passes"]))
notes.append("Warm-up passes per system, figure by figure: " + "; ".join(
    f"{s} {', '.join(p)}" for s, p in passes.items()) + ".")

doc = {
    "bed": {
        "kernel": bed["kernel"],
        "guest_cpus": cpus,
        "scale": scale,
        "runs": runs,
        "seconds": seconds,
        "nvdimm_mib": nv_mib,
        "working_set_mib": ws_mib,
        "ssd_iops": ssd_iops,
        "ssd_bytes_per_s": ssd_bps,
        "policy_working_set_mib": ws_mib // 2,
        "policy_hdd_mib": ws_mib // 2 * 10,
        "policy_passes": int(policy_passes),
        "policy_dirty_s": int(policy_dirty_s),
        "policy_seconds": seconds,
        "qemu": qemu,
    },
    "notes": notes,
    "points": points,
    "time": times,
    "policy": policy,
}
with open(out, "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=1, ensure_ascii=False)
    f.write("\n")
figures = sorted({p["figure"] for p in points})
print(f"paper000: {len(points)} points of {', '.join(figures)}, {len(times)} time windows and {len(policy)} policy points in {out}")
EOF
then
  cp "$log" "${out%.json}.guest.log"
  echo "paper000: FAILED: the guest's output could not be read; its console is in ${out%.json}.guest.log"
  exit 1
fi
echo "paper000: done ($((SECONDS - start)) s in all)"
