#!/usr/bin/env bash
# Databases on ext4 over each cache layer in one QEMU guest (run-in-guest.sh; this host's kernel
# has no ublk, bcache or device-mapper modules): PostgreSQL's pgbench (TPC-B-like) and SQLite's
# speedtest1 on
#
#   pmcache        pmcache serve --ublk, write-back, its medium a file on ext4 -o dax on an
#                  NVDIMM, of the size of the kernel layers' NVDIMMs
#   bcache         make-bcache, the NVDIMM as cache device, cache_mode writeback
#   dm-cache       smq, writeback, 32 KiB blocks (its smallest: the databases write 4-8 KiB
#                  pages at random), metadata on a loop device in the guest's tmpfs
#   dm-writecache  pmem mode (p), 4 KiB blocks
#   ublk-loop      rublk's ublk loop target on the namespace: the user-space block path pmcache
#                  takes, with no cache (each request forwarded to the namespace on the ublk
#                  queue's own ring), what that path costs by itself
#   nvme           the bare NVMe namespace: the baseline
#
# each cache on an emulated NVDIMM (fsdax) in front of an emulated NVMe namespace throttled to
# an SSD's cost (paper000.sh's ssd_iops and ssd_bps: 4000 IOPS, 500 MB/s), or with --backing hdd
# a disk's (paper000.sh's HDDs: 200 IOPS, 150 MB/s), one NVDIMM and one namespace per layer.
# The pgbench database (`pgbench -i -s SCALE`, about 16 MB a scale unit: 2-4x the cache) is
# made once on the host (initdb --locale=C, then pgbench -i), carried into the guest as a
# tarball and unpacked onto each layer's ext4. Then RUNS rounds, the layers' order rotating
# from round to round: for each layer, the caches dropped, PostgreSQL started, `pgbench -c C
# -j J -T SECONDS -l` (per-transaction latencies), PostgreSQL stopped; then speedtest1 --size N
# on each layer. PostgreSQL, pgbench and speedtest1 run in a memory cgroup (cgroup2) of
# DB_MEMORY MiB, page cache included, so the databases' reads reach the layers.
#
#   scripts/guest/db-bench.sh [--runs N] [--seconds S] [--scale S] [--cache-mib M]
#       [--clients C] [--threads J] [--shared-buffers SIZE] [--db-memory-mib M]
#       [--speedtest1-size N] [--backing ssd|hdd] [--perf] [--pm-args "ARGS"] --out FILE
#
# --pm-args: more arguments for `pmcache serve` (an experiment: "--mode writeonly",
# "--ublk-queues 1" in place of one queue per guest CPU, "--admission ..."); the guest's log
# says which.
#
# FILE gets the guest's result lines (parsed by `pmcache bench db --guest-log FILE`):
#   DBBENCH-BED {json}                     the guest and the settings
#   DBBENCH {json}                         one pgbench run: layer, run, tps, transactions,
#                                          latency_ms_p50, latency_ms_p99 (rank (n-1)q, rounded),
#                                          guest_busy_s, guest_idle_s (all vCPUs, /proc/stat),
#                                          server_cpu_s (pmcache's process, rublk's for
#                                          ublk-loop; null elsewhere)
#   DBBENCH-SPEEDTEST1 LAYER RUN LINE      speedtest1's output, line by line
#   DBBENCH-PMSTATS-BEFORE LAYER RUN {json}  pmcache's `stats --json` before each pgbench run
#   DBBENCH-PMSTATS LAYER RUN {json}       and after it
#   DBBENCH-NOTE TEXT                      dirty data of the kernel layers after each run, …
#   DBBENCH-PERF LAYER RUN LINE            with --perf: `perf report` of the guest's CPU samples
#                                          during each pgbench run (perf's own cost perturbs
#                                          those runs: a diagnosis, not figures)
# When the guest fails, its console is kept as FILE.guest.log.
#
# Needs root. Uses PMCACHE_BIN (or builds pmcache, profile test-opt, feature ublk), rublk
# (RUBLK, or in PATH, or `cargo install rublk` under target/rublk), scripts/db/build-speedtest1.sh's speedtest1, PostgreSQL 15 (/usr/lib/postgresql/N/bin), and
# installs ndctl, bcache-tools, dmsetup and e2fsprogs when missing. TCG makes absolute numbers
# meaningless: only ratios within the boot count.
source "$(dirname "$0")/lib.sh"
caller_pwd=$OLDPWD # lib.sh changed to the repository root

runs=3 seconds=20 scale=8 cache_mib=64 clients=4 threads=2 shared_buffers=16MB db_memory_mib=96
st1_size=20 backing=ssd perf= out= pm_args=
usage() { sed -n '/^#   scripts\/guest\/db-bench.sh/,/^#       \[--speedtest1-size/p' "$0" | sed 's/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --scale) scale="$2"; shift 2 ;;
    --cache-mib) cache_mib="$2"; shift 2 ;;
    --clients) clients="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --shared-buffers) shared_buffers="$2"; shift 2 ;;
    --db-memory-mib) db_memory_mib="$2"; shift 2 ;;
    --speedtest1-size) st1_size="$2"; shift 2 ;;
    --backing) backing="$2"; shift 2 ;;
    --perf) perf=$(command -v perf) || { echo "db-bench: --perf needs perf (apt-get install linux-perf)" >&2; exit 2; }; shift ;;
    --out) out="$2"; shift 2 ;;
    --pm-args) pm_args="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "db-bench: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
[[ -n "$out" ]] || { echo "db-bench: --out FILE is required" >&2; exit 2; }
[[ "$out" == /* ]] || out="$caller_pwd/$out"
for n in "$runs" "$seconds" "$scale" "$cache_mib" "$clients" "$threads" "$db_memory_mib" "$st1_size"; do
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "db-bench: not a positive number: '$n'" >&2; exit 2; }
done
[[ "$shared_buffers" =~ ^[0-9]+(kB|MB|GB)$ ]] || { echo "db-bench: --shared-buffers like 16MB" >&2; exit 2; }
((EUID == 0)) || { echo "db-bench: needs root (PostgreSQL's cluster is made as user postgres)" >&2; exit 2; }

need_tools ndctl:ndctl make-bcache:bcache-tools dmsetup:dmsetup mkfs.ext4:e2fsprogs
need_rublk
build_pmcache test-opt
speedtest1=$(bash scripts/db/build-speedtest1.sh)
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
[[ -x "$pg_bin/postgres" ]] || { echo "db-bench: no PostgreSQL (apt-get install -y postgresql)" >&2; exit 2; }
pg_lib=$(dirname "$pg_bin")/lib
pg_share=/usr/share/postgresql/$(basename "$(dirname "$pg_bin")")
pg_uid=$(id -u postgres) pg_gid=$(id -g postgres)

work=$(mktemp -d "${TMPDIR:-/var/tmp}/db-bench.XXXXXX")
shm=$(mktemp -d /dev/shm/db-bench.XXXXXX)
chmod 755 "$work"
on_exit 'rm -rf "$work" "$shm"'

# --- the database, made on the host ----------------------------------------------------------
echo "== db-bench: pgbench -i -s $scale on the host"
seed=$work/seed
mkdir -p "$seed/pgdata" "$seed/sock"
chown postgres:postgres "$seed/pgdata" "$seed/sock"
as_pg() { (cd / && runuser -u postgres -- "$@"); }
as_pg "$pg_bin/initdb" -A trust --locale=C -E UTF8 -D "$seed/pgdata" > "$work/initdb.log"
cat >> "$seed/pgdata/postgresql.conf" <<CONF
listen_addresses = ''
unix_socket_directories = '/tmp/pgsock'
shared_buffers = $shared_buffers
max_wal_size = 256MB
fsync = on
synchronous_commit = on
timezone = 'UTC'
log_timezone = 'UTC'
jit = off
CONF
as_pg "$pg_bin/pg_ctl" -D "$seed/pgdata" -l "$seed/sock/postgres.log" -o "-k $seed/sock" -w start > /dev/null
as_pg "$pg_bin/pgbench" -h "$seed/sock" -i -q -s "$scale" postgres 2>&1 | tail -n 1
db_bytes=$(as_pg "$pg_bin/psql" -h "$seed/sock" -X -A -t -c "SELECT pg_database_size('postgres')" postgres)
as_pg "$pg_bin/pg_ctl" -D "$seed/pgdata" -m fast -w stop > /dev/null
tar czf "$work/pgdata.tar.gz" -C "$seed" pgdata
rm -rf "$seed"
echo "== db-bench: database $((db_bytes >> 20)) MiB, tarball $(du -h "$work/pgdata.tar.gz" | cut -f1)"

# --- NVDIMMs and NVMe namespaces -------------------------------------------------------------
# NVDIMMs 0-2: bcache, dm-cache, dm-writecache (the whole fsdax device is the cache); 3:
# pmcache's, 32 MiB larger for ext4 -o dax around its medium, which takes the size of the others'.
# Namespaces 1-6 (throttled as --backing says): the bare store, then the backing stores
# of pmcache, bcache, dm-cache, dm-writecache and ublk-loop.
case "$backing" in
  ssd) ssd_iops=4000 ssd_bps=500000000 ;;
  hdd) ssd_iops=200 ssd_bps=150000000 ;;
  *) echo "db-bench: --backing must be ssd or hdd, not '$backing'" >&2; exit 2 ;;
esac
fs_mib=1024
mem_mib=1536
nvdimms=4
qemu_args="-machine nvdimm=on -m ${mem_mib},slots=$nvdimms,maxmem=$((mem_mib + 4 * cache_mib + 32 + 1024))M"
for ((i = 0; i < nvdimms; i++)); do
  size=$cache_mib
  ((i == 3)) && size=$((cache_mib + 32))
  truncate -s "${size}M" "$shm/nvdimm$i.img"
  qemu_args+=" -object memory-backend-file,id=nv$i,share=on,mem-path=$shm/nvdimm$i.img,size=${size}M"
  qemu_args+=" -device nvdimm,id=nvdimm$i,memdev=nv$i"
done
qemu_args+=" -device nvme,id=nvd,serial=dbbench"
for ((n = 1; n <= 6; n++)); do
  truncate -s "${fs_mib}M" "$work/ns$n.img"
  qemu_args+=" -drive file=$work/ns$n.img,if=none,id=dd$n,format=raw,cache=unsafe"
  qemu_args+=",throttling.iops-total=$ssd_iops,throttling.bps-total=$ssd_bps"
  qemu_args+=" -device nvme-ns,drive=dd$n,bus=nvd,nsid=$n"
done
bucket=64
while ((bucket > 4 && cache_mib * 1024 / bucket < 2048)); do bucket=$((bucket / 2)); done

guest_script db-bench
{
  cat <<PARAMS
PM=$exe RUBLK=$rublk ST1=$speedtest1 PGBIN=$pg_bin PGUID=$pg_uid PGGID=$pg_gid TAR=$work/pgdata.tar.gz
RUNS=$runs SECS=$seconds SCALE=$scale CACHE_MIB=$cache_mib CLIENTS=$clients THREADS=$threads
SHARED_BUFFERS=$shared_buffers DB_MEMORY_MIB=$db_memory_mib ST1_SIZE=$st1_size DB_BYTES=$db_bytes
FS_MIB=$fs_mib SSD_IOPS=$ssd_iops SSD_BPS=$ssd_bps BUCKET=${bucket}k BACKING=$backing PERF=$perf
PM_ARGS="$pm_args"
PARAMS
  cat <<'GUEST'
set -eu
echo 1 > /proc/sys/kernel/printk # kernel messages in dmesg only: none cut into the result lines
export DM_DISABLE_UDEV=1
log() { echo "db-bench: $*"; }
fail() {
  {
    echo "db-bench: FAILED: $*"
    for f in /tmp/serve-pm.log /tmp/pgsock/postgres.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 30 "$f"; }; done
    echo "--- dmesg"; dmesg | tail -n 40
  } >&2
  exit 1
}
wait_until() { # wait_until CONDITION WHAT: up to 30 s
  tries=0
  while ! eval "$1"; do
    tries=$((tries + 1)); [ $tries -lt 300 ] || fail "$2 (waited 30 s for: $1)"; sleep 0.1
  done
}
sysw() { echo "$1" > "$2" 2>/tmp/sysw.err || fail "cannot write '$1' to $2: $(cat /tmp/sysw.err)"; }
for m in bcache dm_cache dm_writecache nd_pmem ublk_drv; do
  [ -d /sys/module/$m ] || fail "kernel module $m is not loaded"
done

# --- NVDIMMs (fsdax) and the NVMe namespaces --------------------------------------------------
i=0
while [ $i -lt 4 ]; do
  ndctl create-namespace -f -e namespace$i.0 -m fsdax -a 2M > /tmp/ns$i.json 2>/tmp/ns$i.err \
    || { cat /tmp/ns$i.err; fail "ndctl create-namespace -m fsdax on namespace$i.0"; }
  dev=$(sed -n 's/.*"blockdev":"\(pmem[0-9]*\)".*/\1/p' /tmp/ns$i.json | head -n 1)
  [ -n "$dev" ] || fail "no block device for namespace$i.0"
  wait_until "[ -b /dev/$dev ]" "no /dev/$dev"
  eval "PMEM$i=$dev"
  i=$((i + 1))
done
ctrl=
for c in /sys/class/nvme/nvme*; do
  [ "$(tr -d ' ' < $c/serial)" = dbbench ] && ctrl=${c##*/}
done
[ -n "$ctrl" ] || fail "no NVMe controller with serial dbbench"
nsdev() {
  for b in /sys/block/${ctrl}n*; do
    [ -e "$b/nsid" ] && [ "$(cat $b/nsid)" = "$1" ] && { echo "${b##*/}"; return 0; }
  done
  return 0
}
n=1
while [ $n -le 6 ]; do
  wait_until "[ -n \"\$(nsdev $n)\" ]" "no namespace $n on $ctrl"
  d=$(nsdev $n); eval "NS$n=$d"
  wait_until "[ -b /dev/$d ]" "no /dev/$d"
  n=$((n + 1))
done
# The kernel layers' caches are their whole fsdax devices; pmcache's takes the same size.
CACHE_BYTES=$(blockdev --getsize64 /dev/$PMEM0)
PM_CACHE_MIB=$((CACHE_BYTES >> 20))
log "NVDIMMs $PMEM0 $PMEM1 $PMEM2 ($PM_CACHE_MIB MiB each as fsdax) $PMEM3; NVMe $ctrl: $NS1 $NS2 $NS3 $NS4 $NS5 $NS6"

# --- the layers --------------------------------------------------------------------------------
mkfs.ext4 -q -F -b 4096 /dev/$PMEM3 || fail "mkfs.ext4 /dev/$PMEM3"
mkdir -p /mnt/pm
mount -t ext4 -o dax /dev/$PMEM3 /mnt/pm || fail "mount -o dax /dev/$PMEM3"
CPUS=$(grep -c ^processor /proc/cpuinfo)
QUEUES="--ublk-queues $CPUS"
case " $PM_ARGS " in *" --ublk-queues "*) QUEUES= ;; esac
$PM serve --ublk --ublk-recovery off $QUEUES --cache /mnt/pm/cache.pm \
  --cache-size ${PM_CACHE_MIB}M --backing /dev/$NS2 --control /tmp/pm.ctl $PM_ARGS > /tmp/serve-pm.log 2>&1 &
PM_PID=$!
wait_until "grep -q 'ublk device:' /tmp/serve-pm.log || ! kill -0 $PM_PID 2>/dev/null" "pmcache serve did not start"
UBLK=$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' /tmp/serve-pm.log | head -n 1)
[ -n "$UBLK" ] && [ -b "$UBLK" ] || fail "pmcache serve: no ublk device"
grep -q "medium: dax" /tmp/serve-pm.log || fail "pmcache's medium is not served as dax: $(head -n 3 /tmp/serve-pm.log)"

make-bcache --bucket $BUCKET -C /dev/$PMEM0 -B /dev/$NS3 > /tmp/make-bcache.log 2>&1 \
  || { cat /tmp/make-bcache.log; fail "make-bcache"; }
sysw /dev/$PMEM0 /sys/fs/bcache/register
sysw /dev/$NS3 /sys/fs/bcache/register
bcache_dev() {
  for b in /sys/block/bcache*; do
    [ -e "$b/bcache/backing_dev_name" ] && [ "$(cat $b/bcache/backing_dev_name)" = "$NS3" ] && { echo "${b##*/}"; return 0; }
  done
  return 0
}
wait_until "[ -n \"\$(bcache_dev)\" ]" "no bcache device over /dev/$NS3"
BC=$(bcache_dev)
wait_until "[ -b /dev/$BC ]" "no /dev/$BC"
sysw writeback /sys/block/$BC/bcache/cache_mode
sysw 0 /sys/block/$BC/bcache/cache/congested_read_threshold_us
sysw 0 /sys/block/$BC/bcache/cache/congested_write_threshold_us

dd if=/dev/zero of=/dev/shm/dmc-meta bs=1M count=0 seek=32 2>/dev/null
wait_until "[ -b /dev/loop0 ]" "no /dev/loop0"
losetup /dev/loop0 /dev/shm/dmc-meta || fail "losetup /dev/loop0 for dm-cache's metadata"
dm_create() {
  dmsetup create "$1" --noudevsync --table "$2" > /tmp/dm-$1.log 2>&1 || { cat /tmp/dm-$1.log; fail "dmsetup create $1 '$2'"; }
  dmsetup mknodes "$1" > /dev/null 2>&1 || true
  wait_until "[ -b /dev/mapper/$1 ]" "no /dev/mapper/$1"
}
dm_create dmc "0 $(blockdev --getsz /dev/$NS4) cache /dev/loop0 /dev/$PMEM1 /dev/$NS4 64 1 writeback smq 0"
dm_create wc "0 $(blockdev --getsz /dev/$NS5) writecache p /dev/$NS5 /dev/$PMEM2 4096 0"
# The ublk path with no cache: rublk's loop target on namespace 6, direct I/O, a queue per CPU.
$RUBLK add loop -n 9 -q $CPUS -f /dev/$NS6 --quiet > /tmp/rublk.log 2>&1 || { cat /tmp/rublk.log; fail "rublk add loop"; }
wait_until "[ -b /dev/ublkb9 ]" "no /dev/ublkb9 from rublk"
log "pmcache $UBLK (medium /mnt/pm/cache.pm on /dev/$PMEM3, ${PM_CACHE_MIB} MiB, backing /dev/$NS2); bcache /dev/$BC ($(cat /sys/block/$BC/bcache/cache_mode)); dmc: $(dmsetup table dmc); wc: $(dmsetup table wc)"

LAYERS="pmcache bcache dm-cache dm-writecache ublk-loop nvme"
NLAYERS=$(echo $LAYERS | wc -w)
dev_of() {
  case "$1" in
    pmcache) echo $UBLK ;; bcache) echo /dev/$BC ;; dm-cache) echo /dev/mapper/dmc ;;
    dm-writecache) echo /dev/mapper/wc ;; ublk-loop) echo /dev/ublkb9 ;; nvme) echo /dev/$NS1 ;;
  esac
}
ns_of() { # the layer's NVMe namespace (its backing store; the bare one for nvme)
  case "$1" in
    pmcache) echo $NS2 ;; bcache) echo $NS3 ;; dm-cache) echo $NS4 ;;
    dm-writecache) echo $NS5 ;; ublk-loop) echo $NS6 ;; nvme) echo $NS1 ;;
  esac
}
ns_io() { # reads, sectors read, writes, sectors written, flushes completed on the namespace
  awk '{print $1, $3, $5, $7, $15}' /sys/block/$(ns_of $1)/stat
}

# --- PostgreSQL's user, the memory cgroup, the database on each layer --------------------------
echo "root:x:0:0:root:/root:/bin/sh" > /etc/passwd
echo "postgres:x:$PGUID:$PGGID:PostgreSQL:/tmp:/bin/sh" >> /etc/passwd
printf 'root:x:0:\npostgres:x:%s:\n' "$PGGID" > /etc/group
mkdir -p /tmp/pgsock && chown postgres:postgres /tmp/pgsock
mkdir -p /sys/fs/cgroup
mount -t cgroup2 none /sys/fs/cgroup || fail "mount cgroup2"
sysw +memory /sys/fs/cgroup/cgroup.subtree_control
mkdir -p /sys/fs/cgroup/db
sysw $((DB_MEMORY_MIB << 20)) /sys/fs/cgroup/db/memory.max
in_cg() { sh -c 'echo $$ > /sys/fs/cgroup/db/cgroup.procs && exec "$@"' sh "$@"; }
as_pg() { su -s /bin/sh postgres -c "$*"; }
for l in $LAYERS; do
  dev=$(dev_of $l)
  mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 $dev || fail "mkfs.ext4 on $l ($dev)"
  mkdir -p /mnt/$l
  mount -t ext4 $dev /mnt/$l || fail "mount $l ($dev)"
  tar xzf $TAR -C /mnt/$l || fail "unpacking the database onto $l"
  chown -R postgres:postgres /mnt/$l/pgdata
  chmod 700 /mnt/$l/pgdata
  sync
  log "$l: $dev, database unpacked ($(du -sm /mnt/$l/pgdata | cut -f1) MiB)"
done
printf 'DBBENCH-BED {"kernel":"%s","guest_cpus":%d,"cache_mib":%d,"scale":%d,"clients":%d,"threads":%d,"seconds":%d,"shared_buffers":"%s","db_memory_mib":%d,"speedtest1_size":%d,"db_bytes":%d,"fs_mib":%d,"ssd_iops":%d,"ssd_bytes_per_s":%d,"dm_cache_block_kib":32,"bcache_bucket":"%s","backing":"%s"}\n' \
  "$(uname -r)" $CPUS $PM_CACHE_MIB $SCALE $CLIENTS $THREADS $SECS "$SHARED_BUFFERS" $DB_MEMORY_MIB $ST1_SIZE $DB_BYTES $FS_MIB $SSD_IOPS $SSD_BPS $BUCKET $BACKING

[ -z "$PM_ARGS" ] || echo "DBBENCH-NOTE pmcache serve with $QUEUES $PM_ARGS"
# The server at rest, before any run: what it spends with nothing to do.
idle0=$(sed 's/.*) //' /proc/$PM_PID/stat | awk '{print $12 + $13}')
sleep 10
idle1=$(sed 's/.*) //' /proc/$PM_PID/stat | awk '{print $12 + $13}')
echo "DBBENCH-NOTE pmcache at rest (its cleaner writing back the unpacked database, if it still is): $((idle1 - idle0)) CPU ticks (1/100 s) in 10 s"

dirty_note() { # what each kernel layer holds dirty after run $1
  bcd=$(cat /sys/block/$BC/bcache/dirty_data 2>/dev/null || echo ?)
  dmc=$(dmsetup status dmc | awk '{print $14}')
  wc=$(dmsetup status wc)
  echo "DBBENCH-NOTE run $1: dirty: bcache $bcd; dm-cache $dmc blocks; dm-writecache status: $wc"
}

cpu_ticks() { # busy (user nice system irq softirq) and idle (idle iowait) ticks of all CPUs
  awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat
}
server_ticks() { # user + system ticks of the layer's server processes (pmcache, rublk's)
  case $1 in
    pmcache) sed 's/.*) //' /proc/$PM_PID/stat | awk '{print $12 + $13}' ;;
    ublk-loop)
      for p in /proc/[0-9]*; do
        [ "$(cat $p/comm 2>/dev/null)" = rublk ] && sed 's/.*) //' $p/stat 2>/dev/null
      done | awk '{t += $12 + $13} END {print t + 0}' ;;
  esac
}

# A kernel layer whose database fails (PostgreSQL refuses to start, pgbench stops on an error)
# is said in a note with PostgreSQL's log, and left out of the later pgbench runs; the bench
# goes on with the others. pmcache's database failing fails the bench.
broken=""
layer_broken() { # layer_broken LAYER RUN WHY
  [ -z "$PERF" ] || { kill -INT $PERF_PID 2>/dev/null; wait $PERF_PID 2>/dev/null || true; rm -f /tmp/perf.data; }
  [ $1 != pmcache ] || { cat /tmp/pgbench.out /tmp/pgbench.err 2>/dev/null; fail "$3 on pmcache"; }
  echo "DBBENCH-NOTE run $2: $1: $3; its database is left out of the later pgbench runs. PostgreSQL's log:"
  for f in /tmp/pgbench.err /tmp/pgsock/postgres.log; do
    [ -f $f ] && grep -v '^ *$' $f | grep -iv 'LOG: *\(checkpoint\|listening\|starting\|database system\)' \
      | tail -n 12 | sed "s|^|DBBENCH-NOTE run $2: $1:   |"
  done
  as_pg "$PGBIN/pg_ctl -D /mnt/$1/pgdata -m immediate -w -t 600 stop" > /dev/null 2>&1 || true
  broken="$broken $1"
}

# --- the rounds ----------------------------------------------------------------------------------
r=1
while [ $r -le $RUNS ]; do
  # The order rotates: round r starts at the layer r-1 places on.
  order=$(echo $LAYERS $LAYERS | awk -v s=$(( (r - 1) % NLAYERS )) -v n=$NLAYERS '{for (i = s + 1; i <= s + n; i++) printf "%s ", $i}')
  for l in $order; do
    case " $broken " in *" $l "*) continue ;; esac
    log "round $r/$RUNS: pgbench on $l"
    sync; echo 3 > /proc/sys/vm/drop_caches
    rm -f /tmp/pgsock/postgres.log /tmp/pgbench.out /tmp/pgbench.err
    PERF_PID=
    if ! in_cg su -s /bin/sh postgres -c "$PGBIN/pg_ctl -D /mnt/$l/pgdata -l /tmp/pgsock/postgres.log -w -t 600 start" > /dev/null; then
      layer_broken $l $r "PostgreSQL did not start"
      continue
    fi
    rm -rf /tmp/pgl; mkdir -p /tmp/pgl; chown postgres /tmp/pgl
    if [ $l = pmcache ]; then
      echo "DBBENCH-PMSTATS-BEFORE pmcache $r $($PM stats --json --control /tmp/pm.ctl | tr -d '\n')"
    fi
    if [ -n "$PERF" ]; then
      $PERF record -a -g -F 200 -o /tmp/perf.data > /tmp/perf.log 2>&1 &
      PERF_PID=$!
    fi
    cpu0=$(cpu_ticks) srv0=$(server_ticks $l) io0=$(ns_io $l)
    if ! in_cg su -s /bin/sh postgres -c "$PGBIN/pgbench -h /tmp/pgsock -c $CLIENTS -j $THREADS -T $SECS -l --log-prefix=/tmp/pgl/pgbench_log postgres" \
      > /tmp/pgbench.out 2>/tmp/pgbench.err; then
      layer_broken $l $r "pgbench stopped on an error"
      continue
    fi
    cpu1=$(cpu_ticks) srv1=$(server_ticks $l) io1=$(ns_io $l)
    if [ -n "$PERF" ]; then
      kill -INT $PERF_PID; wait $PERF_PID || true
      # Where the guest's CPU went: by process and object, then the symbols (all processes).
      $PERF report -i /tmp/perf.data --stdio --no-children -g none --percent-limit 1 \
        --sort comm,dso 2>/dev/null | grep -v '^#' | grep -v '^ *$' | head -n 30 | sed "s/^/DBBENCH-PERF $l $r /"
      $PERF report -i /tmp/perf.data --stdio --no-children -g none --percent-limit 0.7 \
        --sort comm,sym 2>/dev/null | grep -v '^#' | grep -v '^ *$' | head -n 60 | sed "s/^/DBBENCH-PERF $l $r /"
      rm -f /tmp/perf.data
    fi
    as_pg "$PGBIN/pg_ctl -D /mnt/$l/pgdata -m fast -w -t 600 stop" > /dev/null || fail "PostgreSQL did not stop on $l"
    tps=$(sed -n 's/^tps = \([0-9.]*\) .*/\1/p' /tmp/pgbench.out | tail -n 1)
    [ -n "$tps" ] || { cat /tmp/pgbench.out; fail "no tps in pgbench's output on $l"; }
    cat /tmp/pgl/pgbench_log* | awk '$3 ~ /^[0-9]+$/ {print $3}' | sort -n > /tmp/lat
    count=$(wc -l < /tmp/lat)
    [ "$count" -gt 0 ] || fail "pgbench logged no transaction on $l"
    pct() { awk -v q=$1 -v n=$count 'NR == int((n - 1) * q + 0.5) + 1 {printf "%.3f", $1 / 1000; exit}' /tmp/lat; }
    # CPU over the run (ticks of USER_HZ = 100): the guest's busy and idle time, and the
    # server's (pmcache; the kernel layers' work is in the guest's busy time).
    set -- $cpu0 $cpu1
    busy=$(($3 - $1)) idle=$(($4 - $2))
    srv=null
    [ -n "$srv0" ] && srv=$(awk -v t=$((srv1 - srv0)) 'BEGIN {printf "%.2f", t / 100}')
    printf 'DBBENCH {"bench":"pgbench","layer":"%s","run":%d,"tps":%s,"transactions":%d,"latency_ms_p50":%s,"latency_ms_p99":%s,"guest_busy_s":%s,"guest_idle_s":%s,"server_cpu_s":%s}\n' \
      $l $r $tps $count $(pct 0.5) $(pct 0.99) $(awk -v t=$busy 'BEGIN {printf "%.2f", t / 100}') \
      $(awk -v t=$idle 'BEGIN {printf "%.2f", t / 100}') $srv
    # The commands the layer sent its NVMe namespace over the run (each a doorbell: under TCG
    # a trap into QEMU's NVMe emulation on the submitting vCPU).
    echo "$io0 $io1" | awk -v l=$l -v r=$r -v n=$count '{
      printf "DBBENCH-NOTE run %d: %s namespace I/O over the run: %d reads (%.1f KiB each), %d writes (%.1f KiB each), %d flushes; %.2f commands a transaction\n",
        r, l, $6 - $1, ($6 - $1) ? ($7 - $2) / 2 / ($6 - $1) : 0, $8 - $3, ($8 - $3) ? ($9 - $4) / 2 / ($8 - $3) : 0, $10 - $5,
        ($6 - $1 + $8 - $3 + $10 - $5) / n }'
    if [ $l = pmcache ]; then
      echo "DBBENCH-PMSTATS pmcache $r $($PM stats --json --control /tmp/pm.ctl | tr -d '\n')"
      # Where the server's CPU went, thread by thread (ticks since it started).
      threads=$(for t in /proc/$PM_PID/task/*; do
        printf '%s=%s ' "$(cat $t/comm)" "$(sed 's/.*) //' $t/stat | awk '{print $12 + $13}')"
      done)
      echo "DBBENCH-NOTE run $r: pmcache's threads, CPU ticks (1/100 s) since it started: $threads"
    fi
  done
  dirty_note $r
  for l in $order; do
    log "round $r/$RUNS: speedtest1 on $l"
    rm -f /mnt/$l/st1.db /mnt/$l/st1.db-journal
    sync; echo 3 > /proc/sys/vm/drop_caches
    in_cg $ST1 --size $ST1_SIZE /mnt/$l/st1.db > /tmp/st1.out 2>&1 || { cat /tmp/st1.out; fail "speedtest1 on $l"; }
    sed "s/^/DBBENCH-SPEEDTEST1 $l $r /" /tmp/st1.out
  done
  r=$((r + 1))
done
log "pmcache at the end: $($PM stats --control /tmp/pm.ctl | tr '\n' ';')"
echo "DBBENCH-DONE"
GUEST
} > "$script"

echo "== db-bench in one guest: $runs round(s), pgbench $seconds s, scale $scale, caches $cache_mib MiB"
log="$work/guest.log"
: > "$log"
timeout_s=$((1800 + runs * 6 * (seconds + 240)))
set +e
PMCACHE_GUEST_QEMU_ARGS="$qemu_args ${PMCACHE_GUEST_QEMU_ARGS:-}" \
  "$here/run-in-guest.sh" --timeout "$timeout_s" --mem "$mem_mib" --disk-mib 256 \
  ${PMCACHE_GUEST_ARGS:-} --copy "$exe" --copy "$speedtest1" \
  --copy "$pg_bin/postgres" --copy "$pg_bin/pg_ctl" --copy "$pg_bin/pgbench" --copy "$pg_bin/psql" \
  --copy "$pg_lib/plpgsql.so" --copy "$pg_lib/dict_snowball.so" --copy "$pg_share" \
  ${perf:+--copy "$perf"} --copy /usr/share/zoneinfo/UTC --copy "$(command -v ndctl)" --copy "$(command -v make-bcache)" \
  --copy "$(command -v dmsetup)" --copy "$(command -v mkfs.ext4)" --copy "$work/pgdata.tar.gz" --copy "$rublk" \
  --copy "$script" -- sh "$script" > "$log" 2>&1 &
runner=$!
tail -n +1 -f "$log" --pid "$runner" | grep --line-buffered -E '^(db-bench|\[guest\]|DBBENCH )' || true
wait "$runner"
rc=$?
set -e
mkdir -p "$(dirname "$out")"
grep -E '^DBBENCH' "$log" | sed 's/\r$//' > "$out" || true
echo "DBBENCH-NOTE qemu: $(qemu-system-x86_64 --version | head -n 1)" >> "$out"
if ((rc != 0)) || ! grep -q '^DBBENCH-DONE' "$out"; then
  cp "$log" "$out.guest.log"
  grep -E '^db-bench: FAILED' -A 80 "$log" | tail -n 100 || tail -n 60 "$log"
  echo "db-bench: FAILED (guest exit $rc); the console is in $out.guest.log"
  exit 1
fi
echo "db-bench: $(grep -c '^DBBENCH {' "$out") pgbench runs in $out ($((SECONDS - start)) s)"
