#!/usr/bin/env bash
# PostgreSQL and SQLite through power cuts of a QEMU guest, on ext4 over pmcache (served by
# ublk, its medium on an emulated NVDIMM, its backing store an emulated NVMe namespace) in
# write-back, write-through, write-around and write-back with --data-crc, and beside it on the
# kernel's caches over the same kind of devices: bcache (writeback), dm-cache (writeback, smq)
# and dm-writecache (pmem mode). Every layer has an NVDIMM and an NVMe namespace of its own,
# and all run in the same boots.
#
# The databases are prepared on this host into one ext4 image (PostgreSQL: initdb
# --data-checksums, fsync=on, synchronous_commit=on, full_page_writes=on; SQLite:
# journal_mode=WAL), each with a ledger (n, amount), a running total and a filler table of
# about twice the cache, so the database is larger than the cache in front of it. The image
# is the content of every layer's NVMe namespace (behind bcache's 8 KiB superblock for
# bcache). Then boot after boot:
#
#   1. the layers are brought up on the same files (formatted, made or created on the first
#      boot; on later ones pmcache recovers its medium, bcache registers, dm-cache and
#      dm-writecache load their metadata), each ext4 is mounted (journal replay), unmounted,
#      checked with fsck.ext4 -fn and mounted again;
#   2. each PostgreSQL starts (crash recovery from its WAL) and each SQLite database opens
#      (WAL recovery), and each prints its state: rows, largest n, the running total, the sum of
#      the rows, pg_amcheck --heapallindexed / PRAGMA integrity_check;
#   3. per layer a PostgreSQL client and a SQLite client commit numbered transactions one at a
#      time (a ledger row, the total, a random filler row), each printing `ACK` on the console
#      once COMMIT returned, while fio writes randomly into a file twice the cache with
#      O_DIRECT (the cleaner or the kernel's write-back runs flat out); each layer's dirty
#      share is printed every second;
#   4. a few seconds in, QEMU is killed with SIGKILL: the power cut. What is left is what
#      reached the NVDIMM files (every store: TCG has no CPU cache) and the NVMe files (every
#      completed write).
#
# The host checks every boot against the one before: every acknowledged commit is there
# (largest n >= the last acknowledged), the rows are exactly 1..n (count = largest n: nothing
# half-applied or lost in between), the total equals the sum of the rows, the database's own
# check passes and fsck is clean. A last boot recovers and checks, stops everything cleanly,
# checks each file system once more, and for pmcache checks the backing namespace alone after
# the server's stop wrote every dirty block back. The result is a table per layer and
# database: power cuts survived, commits acknowledged and verified, commits lost, integrity
# errors, fsck failures.
#
#   scripts/guest/db-powercut.sh [--cuts N] [--layers L1,L2,...] [--cache-mib M] [--out FILE]
#       [--resume DIR]
#
# --cuts: power cuts (default 3; boots = cuts + 1). --layers: any of pm-wb, pm-wt, pm-wa,
# pm-crc, bcache, dm-cache, dm-writecache (default: all). --cache-mib: each layer's NVDIMM
# (default 16). --out: the result table as JSON. --resume DIR: go on with the campaign whose
# files (NVDIMMs, namespaces, boot logs) are in DIR, a run's work directory, from the boot
# after its last (a run that fails keeps its directory and says so); --cuts is the campaign's
# whole count, and the verdict covers every boot of it.
#
# A guest that does not reach its workload within 10 minutes of its start (TCG's emulated
# timers may stall a boot for good on a loaded host) is cut where it is: a power cut during
# boot, counted apart; the next boot is checked against every commit acknowledged before.
# Three such boots in a row fail the run.
#
# Installs on the host what it needs when missing (PostgreSQL, sqlite3, fio, ndctl,
# bcache-tools, dmsetup, e2fsprogs, util-linux's setpriv, binutils' strip) and builds pmcache
# (profile test-opt; PMCACHE_BIN=path uses that binary).
source "$(dirname "$0")/lib.sh"

cuts=3
layers="pm-wb,pm-wt,pm-wa,pm-crc,bcache,dm-cache,dm-writecache"
cache_mib=16
out=
resume=
while (($#)); do
  case "$1" in
    --resume) resume="$2"; shift 2 ;;
    --cuts) cuts="$2"; shift 2 ;;
    --layers) layers="$2"; shift 2 ;;
    --cache-mib) cache_mib="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^source/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "db-powercut: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[[ "$cuts" =~ ^[0-9]+$ && "$cache_mib" =~ ^[0-9]+$ ]] || { echo "db-powercut: --cuts and --cache-mib take numbers" >&2; exit 2; }
((cache_mib >= 16 && cache_mib % 2 == 0)) || { echo "db-powercut: --cache-mib must be even and at least 16" >&2; exit 2; }
IFS=, read -r -a layer_list <<< "$layers"
for l in "${layer_list[@]}"; do
  case "$l" in pm-wb|pm-wt|pm-wa|pm-crc|bcache|dm-cache|dm-writecache) ;;
    *) echo "db-powercut: unknown layer '$l'" >&2; exit 2 ;; esac
done

need_tools fio:fio ndctl:ndctl make-bcache:bcache-tools dmsetup:dmsetup mkfs.ext4:e2fsprogs \
  python3:python3 sqlite3:sqlite3 setpriv:util-linux strip:binutils
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
if [[ -z "$pg_bin" ]]; then
  as_root apt-get update -q && as_root apt-get install -y -q postgresql
  pg_bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
fi
pg_ver=$(basename "$(dirname "$pg_bin")")
build_pmcache test-opt

nlayers=${#layer_list[@]}
# The filler tables: about twice the cache each (rows of ~560 B in PostgreSQL, ~520 B in SQLite).
filler_rows=$((cache_mib * 2 * 1024 * 1024 / 560))
churn_mib=$((cache_mib * 2))
img_mib=$((cache_mib * 6 + 192))
ns_mib=$((img_mib + 1))
params="layers=$layers cache_mib=$cache_mib pg=$pg_ver"
if [[ -n "$resume" ]]; then
  work=$(cd "$resume" && pwd)
  [[ -f "$work/params" && -f "$work/boot0.log" ]] \
    || { echo "db-powercut: --resume $resume: not the work directory of a run (no params or boot0.log)" >&2; exit 2; }
  [[ "$(cat "$work/params")" == "$params" ]] \
    || { echo "db-powercut: --resume $resume: that campaign ran with $(cat "$work/params"), not $params" >&2; exit 2; }
else
  work=$(mktemp -d /dev/shm/db-powercut.XXXXXX)
  chmod 755 "$work"
  echo "$params" > "$work/params"
fi
# The work directory goes once the run passed; a run that fails keeps it (--resume).
passed=0
on_exit 'pkill -KILL -u postgres -f "'"$work"'" 2>/dev/null || true
  if ((passed)); then rm -rf "'"$work"'"; else
    echo "db-powercut: the campaign'"'"'s files are kept in '"$work"' (--resume '"$work"' goes on with it)"; fi'
if [[ -z "$resume" ]]; then

# --- the databases, prepared on this host ------------------------------------------------------
echo "== preparing the databases (PostgreSQL $pg_ver, SQLite $(sqlite3 --version | cut -d' ' -f1)), filler $filler_rows rows each"
stage="$work/stage"
mkdir -p "$stage/sq" "$work/sock"
install -d -o postgres -g postgres -m 700 "$stage/pg"
chown postgres:postgres "$work/sock"
runuser -u postgres -- "$pg_bin/initdb" -D "$stage/pg" --data-checksums -A trust --locale=C \
  -E UTF8 -U postgres > "$work/initdb.log" 2>&1 || { cat "$work/initdb.log"; exit 1; }
cat >> "$stage/pg/postgresql.conf" <<CONF
fsync = on
synchronous_commit = on
full_page_writes = on
listen_addresses = ''
shared_buffers = 8MB
max_connections = 10
max_wal_size = 64MB
min_wal_size = 32MB
checkpoint_timeout = 30s
jit = off
timezone = 'UTC'
log_timezone = 'UTC'
dynamic_shared_memory_type = posix
CONF
runuser -u postgres -- "$pg_bin/pg_ctl" -D "$stage/pg" -l "$work/sock/stage.log" -w \
  -o "-k $work/sock" start > /dev/null || { cat "$work/sock/stage.log"; exit 1; }
runuser -u postgres -- "$pg_bin/psql" -X -q -h "$work/sock" -d postgres -v ON_ERROR_STOP=1 <<SQL
CREATE TABLE ledger (n bigint PRIMARY KEY, amount int NOT NULL, pad text);
CREATE TABLE total (id int PRIMARY KEY, s bigint NOT NULL);
INSERT INTO total VALUES (1, 0);
CREATE TABLE filler (id int PRIMARY KEY, v bigint NOT NULL, pad text);
INSERT INTO filler SELECT g, 0, repeat(md5(g::text), 16) FROM generate_series(1, $filler_rows) g;
CREATE EXTENSION amcheck;
CHECKPOINT;
SQL
runuser -u postgres -- "$pg_bin/pg_ctl" -D "$stage/pg" -m fast -w stop > /dev/null
python3 - "$stage/sq/db.sqlite" "$filler_rows" <<'PY'
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("PRAGMA journal_mode=WAL")
con.execute("CREATE TABLE ledger (n INTEGER PRIMARY KEY, amount INTEGER NOT NULL, pad BLOB)")
con.execute("CREATE TABLE total (id INTEGER PRIMARY KEY, s INTEGER NOT NULL)")
con.execute("INSERT INTO total VALUES (1, 0)")
con.execute("CREATE TABLE filler (id INTEGER PRIMARY KEY, v INTEGER NOT NULL, pad BLOB)")
con.execute("BEGIN")
con.executemany("INSERT INTO filler VALUES (?, 0, randomblob(480))", ((i,) for i in range(1, int(sys.argv[2]) + 1)))
con.execute("COMMIT")
con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
con.close()
PY
# fio's file (sparse: its first writes allocate, as a new file's do).
truncate -s "${churn_mib}M" "$stage/churn.dat"
echo "== seed image: $(du -sm "$stage/pg" | cut -f1) MiB PostgreSQL, $(du -sm "$stage/sq" | cut -f1) MiB SQLite, in ext4 of $img_mib MiB"
truncate -s "${img_mib}M" "$work/seed.img"
mkfs.ext4 -q -F -b 4096 -E lazy_itable_init=0,lazy_journal_init=0 -d "$stage" "$work/seed.img"
rm -rf "$stage"
fi

# --- the devices: an NVDIMM and an NVMe namespace per layer, the last namespace dm-cache's
# metadata ---------------------------------------------------------------------------------------
mem_mib=2048
qemu_args="-machine nvdimm=on -m ${mem_mib},slots=$nlayers,maxmem=$((mem_mib + nlayers * cache_mib + 1024))M"
qemu_args+=" -pidfile $work/qemu.pid -device nvme,id=dbn,serial=dbcut"
for i in "${!layer_list[@]}"; do
  l=${layer_list[$i]}
  truncate -s "${cache_mib}M" "$work/nvdimm$i.img"
  qemu_args+=" -object memory-backend-file,id=nv$i,share=on,mem-path=$work/nvdimm$i.img,size=${cache_mib}M"
  qemu_args+=" -device nvdimm,id=nvdimm$i,memdev=nv$i"
  if [[ -z "$resume" ]]; then
    truncate -s "${ns_mib}M" "$work/ns$i.img"
    # bcache's data starts after its 8 KiB superblock area; the others map the device as is.
    seek=0
    [[ "$l" == bcache ]] && seek=1
    dd if="$work/seed.img" of="$work/ns$i.img" bs=8K seek=$seek conv=notrunc,sparse status=none
  fi
  # A backing store the cleaner cannot outrun: about an SSD's cost next to the NVDIMM here.
  qemu_args+=" -drive file=$work/ns$i.img,if=none,id=dbd$i,format=raw,cache=unsafe,throttling.iops-total=3000,throttling.bps-total=200000000"
  qemu_args+=" -device nvme-ns,drive=dbd$i,bus=dbn,nsid=$((i + 1))"
done
meta_ns=$((nlayers + 1))
[[ -n "$resume" ]] || truncate -s 16M "$work/ns-meta.img"
qemu_args+=" -drive file=$work/ns-meta.img,if=none,id=dbmeta,format=raw,cache=unsafe -device nvme-ns,drive=dbmeta,bus=dbn,nsid=$meta_ns"
rm -f "$work/seed.img"

# bcache refuses fewer than 1024 buckets.
bc_bucket=512
while ((bc_bucket > 4 && cache_mib * 1024 / bc_bucket < 2048)); do bc_bucket=$((bc_bucket / 2)); done

# util-linux's setpriv under a path of its own (the guest's busybox has one too), not under
# /dev/shm (the guest mounts its own /dev).
bindir=$(mktemp -d "${TMPDIR:-/tmp}/db-powercut-bin.XXXXXX")
on_exit 'rm -rf "'"$bindir"'"'
cp "$(command -v setpriv)" "$bindir/setpriv"
# pmcache without its debug information (its symbols stay, for backtraces): a fifth of the
# size, so every boot's initramfs is packed, and unpacked under TCG, that much faster.
strip --strip-debug -o "$bindir/pmcache" "$exe"
copies=(--copy "$bindir/pmcache" --copy "$(command -v fio)" --copy "$(command -v ndctl)"
  --copy "$(command -v make-bcache)" --copy "$(command -v dmsetup)" --copy "$(command -v sqlite3)"
  --copy "$bindir/setpriv" --copy "$(command -v fsck.ext4)"
  --copy "$pg_bin/postgres" --copy "$pg_bin/pg_ctl" --copy "$pg_bin/psql" --copy "$pg_bin/pg_amcheck"
  --copy "/usr/lib/postgresql/$pg_ver/lib/plpgsql.so" --copy "/usr/lib/postgresql/$pg_ver/lib/amcheck.so"
  --copy "/usr/lib/postgresql/$pg_ver/lib/dict_snowball.so" --copy "/usr/share/postgresql/$pg_ver/timezonesets"
  --copy /usr/share/zoneinfo/UTC --copy /usr/share/zoneinfo/Etc/UTC)

guest_script db-powercut
write_guest_script() { # write_guest_script BOOT FINAL
  {
    cat <<PARAMS
PM=$bindir/pmcache
SETPRIV=$bindir/setpriv
PGBIN=$pg_bin
PGUID=$(id -u postgres) PGGID=$(id -g postgres)
LAYERS="${layer_list[*]}"
BOOT=$1 FINAL=$2 META_NS=$meta_ns
BC_BUCKET=${bc_bucket}k FILLER_ROWS=$filler_rows CHURN_MIB=$churn_mib
PARAMS
    cat <<'GUEST'
set -eu
echo 1 > /proc/sys/kernel/printk # kernel messages in dmesg only: none cut into the ACK lines
export DM_DISABLE_UDEV=1
log() { echo "dbcut: $*"; }
fail() {
  {
    echo "dbcut: FAILED: $*"
    for f in /tmp/serve-*.log /tmp/pg-*.log; do [ -f "$f" ] && { echo "--- $f"; tail -n 20 "$f"; }; done
    echo "--- dmesg"; dmesg | tail -n 40
  } >&2
  exit 1
}
wait_until() { # wait_until CONDITION WHAT: up to 60 s
  tries=0
  while ! eval "$1"; do
    tries=$((tries + 1)); [ $tries -lt 600 ] || fail "$2 (waited 60 s for: $1)"; sleep 0.1
  done
}
sysw() { echo "$1" > "$2" 2>/tmp/sysw.err || fail "cannot write '$1' to $2: $(cat /tmp/sysw.err)"; }
echo "root:x:0:0:root:/root:/bin/sh" > /etc/passwd
echo "postgres:x:$PGUID:$PGGID:PostgreSQL:/tmp:/bin/sh" >> /etc/passwd
printf 'root:x:0:\npostgres:x:%s:\n' "$PGGID" > /etc/group
for m in bcache dm_mod dm_cache dm_cache_smq dm_writecache nd_pmem ublk_drv; do
  [ -d /sys/module/$m ] || fail "kernel module $m is not loaded"
done
log "boot $BOOT: layers $LAYERS"

ctrl=
for c in /sys/class/nvme/nvme*; do [ "$(tr -d ' ' < $c/serial)" = dbcut ] && ctrl=${c##*/}; done
[ -n "$ctrl" ] || fail "no NVMe controller with serial dbcut"
nsdev() { # nsdev NSID: /dev/... of namespace NSID of $ctrl
  for b in /sys/block/${ctrl}n*; do
    [ -e "$b/nsid" ] && [ "$(cat $b/nsid)" = "$1" ] && { echo "/dev/${b##*/}"; return 0; }
  done
  return 0
}
nvdimm() { # nvdimm I MODE: the device of NVDIMM I's namespace (made on the first boot)
  if [ "$BOOT" = 0 ]; then
    ndctl create-namespace -f -e namespace$1.0 -m $2 -a 2M > /tmp/ns$1.json 2>/tmp/ns$1.err \
      || { cat /tmp/ns$1.err >&2; fail "ndctl create-namespace -m $2 on namespace$1.0"; }
  fi
  wait_until "ndctl list -n namespace$1.0 2>/dev/null | grep -q '\"mode\":\"$2\"'" "namespace$1.0 is not $2"
  d=$(ndctl list -n namespace$1.0 | sed -n -e 's/.*"blockdev":"\([a-z0-9.]*\)".*/\1/p' -e 's/.*"chardev":"\([a-z0-9.]*\)".*/\1/p' | head -n 1)
  [ -n "$d" ] || fail "no device in ndctl list -n namespace$1.0: $(ndctl list -n namespace$1.0)"
  wait_until "[ -e /dev/$d ]" "no /dev/$d"
  echo /dev/$d
}
bcache_dev() {
  for b in /sys/block/bcache*; do
    [ -e "$b/bcache/backing_dev_name" ] && [ "$(cat $b/bcache/backing_dev_name)" = "${1#/dev/}" ] \
      && { echo "/dev/${b##*/}"; return 0; }
  done
  return 0
}
dm_create() { # dm_create NAME TABLE
  dmsetup create "$1" --noudevsync --table "$2" > /tmp/dm-$1.log 2>&1 \
    || { cat /tmp/dm-$1.log >&2; fail "dmsetup create $1 --table '$2'"; }
  dmsetup mknodes "$1" > /dev/null 2>&1 || true
  wait_until "[ -b /dev/mapper/$1 ]" "no /dev/mapper/$1"
}

# --- the layers ---------------------------------------------------------------------------------
i=0
for L in $LAYERS; do
  wait_until "[ -n \"\$(nsdev $((i + 1)))\" ]" "no namespace $((i + 1))"
  back=$(nsdev $((i + 1)))
  case $L in
    pm-*)
      medium=$(nvdimm $i devdax)
      echo $medium > /tmp/medium-$L
      if [ "$BOOT" = 0 ]; then
        crc=; [ $L = pm-crc ] && crc=--data-crc
        $PM format --cache $medium --backing $back $crc > /tmp/format-$L.log 2>&1 \
          || { cat /tmp/format-$L.log >&2; fail "pmcache format $medium"; }
      fi
      case $L in pm-wt) mode=writethrough ;; pm-wa) mode=writearound ;; *) mode=writeback ;; esac
      $PM serve --ublk --ublk-recovery off --ublk-queues 1 --cache $medium --backing $back \
        --mode $mode --control /tmp/$L.ctl > /tmp/serve-$L.log 2>&1 &
      echo $! > /tmp/serve-$L.pid
      wait_until "grep -q 'ublk device:' /tmp/serve-$L.log || ! kill -0 $(cat /tmp/serve-$L.pid) 2>/dev/null" "pmcache serve for $L did not start"
      dev=$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' /tmp/serve-$L.log | head -n 1)
      [ -n "$dev" ] || fail "pmcache serve for $L: $(cat /tmp/serve-$L.log)"
      log "$L: $(grep -m1 attached /tmp/serve-$L.log || grep -m1 -i format /tmp/serve-$L.log || true)"
      ;;
    bcache)
      pmem=$(nvdimm $i fsdax)
      if [ "$BOOT" = 0 ]; then
        make-bcache --bucket $BC_BUCKET -C $pmem -B $back > /tmp/make-bcache.log 2>&1 \
          || { cat /tmp/make-bcache.log >&2; fail "make-bcache"; }
      fi
      sysw $pmem /sys/fs/bcache/register
      sysw $back /sys/fs/bcache/register
      wait_until "[ -n \"\$(bcache_dev $back)\" ]" "no bcache device over $back"
      dev=$(bcache_dev $back)
      wait_until "[ -b $dev ]" "no $dev"
      b=/sys/block/${dev#/dev/}/bcache
      [ "$(cat $b/state)" != "no cache" ] || fail "$dev is not attached to its cache"
      [ "$BOOT" = 0 ] && sysw writeback $b/cache_mode
      grep -q '\[writeback\]' $b/cache_mode || fail "$dev: cache_mode $(cat $b/cache_mode)"
      sysw 0 $b/cache/congested_read_threshold_us
      sysw 0 $b/cache/congested_write_threshold_us
      sysw 0 $b/sequential_cutoff
      log "$L: $dev ($(cat $b/state), cache $pmem, backing $back)"
      ;;
    dm-cache)
      pmem=$(nvdimm $i fsdax)
      meta=$(nsdev $META_NS)
      dm_create dmc "0 $(blockdev --getsz $back) cache $meta $pmem $back 64 1 writeback smq 0"
      dev=/dev/mapper/dmc
      log "$L: $dev ($(dmsetup status dmc | cut -d' ' -f4-9))"
      ;;
    dm-writecache)
      pmem=$(nvdimm $i fsdax)
      dm_create dmwc "0 $(blockdev --getsz $back) writecache p $back $pmem 4096 0"
      dev=/dev/mapper/dmwc
      log "$L: $dev ($(dmsetup status dmwc))"
      ;;
  esac
  eval "DEV_$i=$dev PMEM_$i=\${pmem:-}"
  pmem=
  i=$((i + 1))
done

# --- file systems and databases: recovery and the checks ----------------------------------------
fsck_line() { # fsck_line L DEV WHEN
  if fsck.ext4 -fn "$2" > /tmp/fsck-$1.log 2>&1; then
    r=clean
  else
    r="exit-$?"
    { echo "--- $1: fsck.ext4 -fn $2 ($3)"; cat /tmp/fsck-$1.log; } >&2
    # A second opinion, with the device's page cache dropped, and whether a buffered and a
    # direct read of the device return the same bytes: a file system damaged on the device
    # fails both times and reads the same both ways.
    sync; echo 3 > /proc/sys/vm/drop_caches
    fsck.ext4 -fn "$2" > /tmp/fsck2-$1.log 2>&1 && r="$r,again-clean" || r="$r,again-exit-$?"
    b=$(dd if="$2" bs=1M 2>/dev/null | md5sum | cut -c1-12)
    d=$(dd if="$2" bs=1M iflag=direct 2>/dev/null | md5sum | cut -c1-12)
    [ "$b" = "$d" ] && r="$r,reads-agree" || r="$r,reads-differ"
  fi
  out "DBCUT-FSCK $1 $3 $r $(tail -n 1 /tmp/fsck-$1.log | tr ' ' '_')"
}
out() { echo "$*"; echo "$*" >> /tmp/state-$L.log; } # a result line: the console and the layer's file
psql_l() { $PGBIN/psql -X -A -t -q -h /tmp/pgs-$1 -U postgres -d postgres -v ON_ERROR_STOP=1 -c "$2"; }
check_layer() { # check_layer L I: its result lines also go to /tmp/state-L.log
  L=$1; eval "dev=\$DEV_$2"
  : > /tmp/state-$L.log
  mkdir -p /mnt/$L
  mount -t ext4 $dev /mnt/$L || fail "$L: mount $dev"
  umount /mnt/$L
  log "$L: journal replayed"
  fsck_line $L $dev recovered
  mount -t ext4 $dev /mnt/$L || fail "$L: mount $dev after fsck"
  # A fresh boot: no postmaster of this data directory runs, its pid file is a dead one's.
  rm -f /mnt/$L/pg/postmaster.pid
  mkdir -p /tmp/pgs-$L && chown $PGUID:$PGGID /tmp/pgs-$L
  $SETPRIV --reuid=$PGUID --regid=$PGGID --clear-groups $PGBIN/pg_ctl -D /mnt/$L/pg \
    -l /tmp/pg-$L.log -w -t 600 -o "-k /tmp/pgs-$L" start > /dev/null \
    || { out "DBCUT-STATE $L pg start-failed"; return 0; }
  log "$L: PostgreSQL started"
  st=$(psql_l $L "SELECT count(*) || ' ' || coalesce(max(n), 0) || ' ' || (SELECT s FROM total WHERE id = 1) || ' ' || coalesce(sum(amount), 0) FROM ledger") \
    || st="query-failed"
  if $PGBIN/pg_amcheck -h /tmp/pgs-$L -U postgres -d postgres --heapallindexed > /tmp/amcheck-$L.log 2>&1; then
    ok=ok
  else
    ok=amcheck-failed; cat /tmp/amcheck-$L.log >&2
  fi
  out "DBCUT-STATE $L pg $st $ok"
  st=$(sqlite3 /mnt/$L/sq/db.sqlite "SELECT count(*) || ' ' || coalesce(max(n), 0) || ' ' || (SELECT s FROM total WHERE id = 1) || ' ' || coalesce(sum(amount), 0) FROM ledger") \
    || st="query-failed"
  ic=$(sqlite3 /mnt/$L/sq/db.sqlite "PRAGMA integrity_check" 2>&1 | tr '\n' ' ')
  [ "$ic" = "ok " ] && ic=ok || { echo "$L: integrity_check: $ic" >&2; ic=integrity-failed; }
  out "DBCUT-STATE $L sq $st $ic"
}
i=0
checks=
for L in $LAYERS; do check_layer $L $i & checks="$checks $!"; i=$((i + 1)); done
for p in $checks; do wait $p; done
cat /tmp/state-*.log > /tmp/state.log

if [ "$FINAL" = 1 ]; then
  # --- the end: everything stopped cleanly, each file system checked once more -------------------
  for L in $LAYERS; do
    $SETPRIV --reuid=$PGUID --regid=$PGGID --clear-groups $PGBIN/pg_ctl -D /mnt/$L/pg -m fast \
      -w -t 600 stop > /dev/null || log "$L: pg_ctl stop: exit $?"
  done
  i=0
  for L in $LAYERS; do
    eval "dev=\$DEV_$i"
    wait_until "umount /mnt/$L 2>/dev/null" "umount /mnt/$L ($(ps | grep -v grep | grep -c postgres) postgres processes left)"
    fsck_line $L $dev stopped
    case $L in
      pm-*)
        # A detach writes every dirty block back: the backing namespace alone then holds,
        # byte for byte, what the cache served.
        served=$(dd if=$dev bs=1M iflag=direct 2>/dev/null | md5sum | cut -c1-16)
        size=$(blockdev --getsize64 $dev)
        $PM detach --cache $(cat /tmp/medium-$L) --control /tmp/$L.ctl > /tmp/detach-$L.log 2>&1 \
          || { cat /tmp/detach-$L.log >&2; fail "pmcache detach for $L"; }
        wait_until "! kill -0 $(cat /tmp/serve-$L.pid) 2>/dev/null" "pmcache for $L did not stop after its detach"
        back=$(nsdev $((i + 1)))
        alone=$(dd if=$back bs=1M iflag=direct 2>/dev/null | head -c $size | md5sum | cut -c1-16)
        log "$L: $(tail -n 1 /tmp/detach-$L.log)"
        if [ "$served" = "$alone" ]; then
          fsck_line $L $back backing-alone
        else
          out "DBCUT-FSCK $L backing-alone differs served_${served}_backing_${alone}"
        fi
        ;;
    esac
    i=$((i + 1))
  done
  echo "DBCUT-DONE"
  exit 0
fi

# --- the workload, until the power is cut -------------------------------------------------------
dirty_line() { # dirty_line L I: the layer's dirty share of its cache, as a percentage
  case $1 in
    pm-*) $PM stats --control /tmp/$1.ctl 2>/dev/null | sed -n 's/.*dirty [0-9,]* (\([0-9.]*\) %).*/\1/p' ;;
    bcache) eval "d=\$DEV_$2 p=\$PMEM_$2"
      # dirty_data is human-readable (512 B units with a k, M or G suffix)
      awk -v d="$(cat /sys/block/${d#/dev/}/bcache/dirty_data)" -v s="$(blockdev --getsize64 $p)" 'BEGIN {
        m = 1; u = substr(d, length(d)); if (u == "k") m = 1024; else if (u == "M") m = 1048576; else if (u == "G") m = 1073741824
        printf "%.1f", 100 * (d + 0) * m / s }' ;;
    dm-cache) dmsetup status dmc | awk '{ split($7, u, "/"); printf "%.1f", 100 * $14 / u[2] }' ;;
    dm-writecache) dmsetup status dmwc | awk '{ printf "%.1f", 100 * ($5 - $6) / $5 }' ;;
  esac
}
for L in $LAYERS; do mkfifo /tmp/pgc-$L.fifo /tmp/sqc-$L.fifo; done
# Each client continues the numbering after the largest n its database holds (from the state
# line); all are started before any commits, so no layer's clients start on a busy guest.
i=0
for L in $LAYERS; do
  pg_next=$(( $(sed -n "s/^DBCUT-STATE $L pg [0-9]* \([0-9]*\) .*/\1/p" /tmp/state.log) + 1 ))
  sq_next=$(( $(sed -n "s/^DBCUT-STATE $L sq [0-9]* \([0-9]*\) .*/\1/p" /tmp/state.log) + 1 ))
  awk -v s=$pg_next -v L=$L -v rows=$FILLER_ROWS -v seed=$((BOOT * 100 + i)) 'BEGIN {
    srand(seed)
    for (n = s; ; n++) {
      a = int(rand() * 1000) + 1; f = int(rand() * rows) + 1
      printf "BEGIN; INSERT INTO ledger VALUES (%d, %d, repeat(md5(%d::text), 8)); UPDATE total SET s = s + %d WHERE id = 1; UPDATE filler SET v = v + 1 WHERE id = %d; COMMIT;\n\\echo DBCUT-ACK %s pg %d\n", n, a, n, a, f, L, n
    } }' > /tmp/pgc-$L.fifo &
  awk -v s=$sq_next -v L=$L -v rows=$FILLER_ROWS -v seed=$((BOOT * 100 + i + 50)) 'BEGIN {
    srand(seed)
    print "PRAGMA synchronous=FULL;"; print ".timeout 60000"
    for (n = s; ; n++) {
      a = int(rand() * 1000) + 1; f = int(rand() * rows) + 1
      printf "BEGIN IMMEDIATE; INSERT INTO ledger VALUES (%d, %d, randomblob(256)); UPDATE total SET s = s + %d WHERE id = 1; UPDATE filler SET v = v + 1 WHERE id = %d; COMMIT;\n.print DBCUT-ACK %s sq %d\n", n, a, a, f, L, n
    } }' > /tmp/sqc-$L.fifo &
  i=$((i + 1))
done
for L in $LAYERS; do
  $PGBIN/psql -X -q -h /tmp/pgs-$L -U postgres -d postgres -v ON_ERROR_STOP=1 < /tmp/pgc-$L.fifo 2>/tmp/pgc-$L.err &
  sqlite3 -bail /mnt/$L/sq/db.sqlite < /tmp/sqc-$L.fifo 2>/tmp/sqc-$L.err &
  fio --name=churn --filename=/mnt/$L/churn.dat --size=${CHURN_MIB}M --rw=randwrite --bs=16k \
    --direct=1 --ioengine=psync --time_based --runtime=3600 --randseed=$((BOOT + 1)) > /dev/null 2>&1 &
done
echo "DBCUT-RUNNING"
while :; do
  i=0
  line=
  for L in $LAYERS; do line="$line $L=$(dirty_line $L $i)"; i=$((i + 1)); done
  echo "DBCUT-DIRTY$line"
  # What the write-back is doing: pmcache's cleaner, bcache's rate (every 10 s).
  t=$((${t:-0} + 1))
  if [ $((t % 10)) = 1 ]; then
    i=0
    for L in $LAYERS; do
      case $L in
        pm-*) log "$L: $($PM stats --control /tmp/$L.ctl 2>/dev/null | sed -n 's/^cleaner *//p' | cut -d';' -f1)" ;;
        bcache) eval "d=\$DEV_$i"; log "$L: $(tr '\n' ' ' < /sys/block/${d#/dev/}/bcache/writeback_rate_debug)" ;;
      esac
      i=$((i + 1))
    done
  fi
  sleep 1
done
GUEST
  } > "$script"
}

# --- boots and cuts ------------------------------------------------------------------------------
logs=()
first_boot=0
if [[ -n "$resume" ]]; then
  while [[ -f "$work/boot$first_boot.log" ]]; do logs+=("$work/boot$first_boot.log"); first_boot=$((first_boot + 1)); done
  ((first_boot <= cuts)) || { echo "db-powercut: --resume: the campaign has $first_boot boots already, --cuts $cuts" >&2; exit 2; }
  echo "== resuming the campaign in $work at boot $first_boot of $cuts"
fi
boot_cuts_in_a_row=0
for ((boot = first_boot; boot <= cuts; boot++)); do
  final=0
  ((boot == cuts)) && final=1
  write_guest_script "$boot" "$final"
  log="$work/boot$boot.log"
  logs+=("$log")
  echo "== boot $boot of $cuts$( ((final)) && echo ' (the last: recovery, checks, clean stop)')"
  PMCACHE_GUEST_QEMU_ARGS="$qemu_args ${PMCACHE_GUEST_QEMU_ARGS:-}" \
    "$here/run-in-guest.sh" --timeout 3600 --mem "$mem_mib" --disk-mib 256 ${PMCACHE_GUEST_ARGS:-} \
    "${copies[@]}" --copy "$script" -- sh "$script" > "$log" 2>&1 &
  runner=$!
  if ((final)); then
    wait "$runner" || { grep -E '^dbcut|FAILED' -A 40 "$log" | tail -n 80; echo "db-powercut: FAILED: the last boot exited with an error"; exit 1; }
  else
    # Cut at a random moment 5-30 s into the workload (the guest prints a DBCUT-DIRTY line a
    # second), once every client has committed a few times (or 10 minutes in).
    cut_after_s=$(python3 -c 'import random; print(random.randint(5, 30))')
    t0=$SECONDS t_run=0 during_boot=0
    while kill -0 "$runner" 2>/dev/null; do
      if ((!t_run && SECONDS - t0 > 600)); then
        # Not at its workload 10 minutes in: cut where it is (during boot or recovery).
        during_boot=1
        break
      fi
      if grep -q '^DBCUT-RUNNING' "$log"; then
        ((t_run)) || t_run=$SECONDS
        ready=1
        for l in "${layer_list[@]}"; do
          for db in pg sq; do
            (($(grep -c "^DBCUT-ACK $l $db " "$log") >= 3)) || ready=0
          done
        done
        (($(grep -c '^DBCUT-DIRTY' "$log") >= cut_after_s)) || ready=0
        ((ready || SECONDS - t_run > 600)) && break
      fi
      sleep 0.$((RANDOM % 10))
    done
    if ! kill -0 "$runner" 2>/dev/null; then
      grep -E '^dbcut|FAILED' -A 40 "$log" | tail -n 80
      echo "db-powercut: FAILED: boot $boot ended before its power cut"
      exit 1
    fi
    if ((during_boot)); then
      echo "db-powercut: power cut $((boot + 1)): kill -9 of QEMU (pid $(cat "$work/qemu.pid")) during boot: no workload after 600 s; the guest's last lines:"
      grep -v '^DBCUT-' "$log" | tail -n 5
    else
      echo "db-powercut: power cut $((boot + 1)): kill -9 of QEMU (pid $(cat "$work/qemu.pid"))"
    fi
    kill -9 "$(cat "$work/qemu.pid")"
    wait "$runner" || true
    if ((during_boot)); then
      echo "DBCUT-CUT-DURING-BOOT" >> "$log"
      boot_cuts_in_a_row=$((boot_cuts_in_a_row + 1))
      ((boot_cuts_in_a_row < 3)) || { echo "db-powercut: FAILED: 3 boots in a row did not reach their workload"; exit 1; }
    else
      boot_cuts_in_a_row=0
    fi
  fi
  grep -E '^dbcut: ' "$log" || true
done

# --- the verdict ---------------------------------------------------------------------------------
python3 - "$out" "$cuts" "$layers" "${logs[@]}" <<'PY'
import json, re, sys
out, cuts, layers, logs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), sys.argv[4:]
acks, states, fscks, dirty, in_boot = [], [], [], [], []
for path in logs:
    a, s, f, d, cut_in_boot = {}, {}, [], None, False
    for line in open(path, errors="replace"):
        line = line.rstrip("\n")
        if line == "DBCUT-CUT-DURING-BOOT":
            cut_in_boot = True
            continue
        m = re.fullmatch(r"DBCUT-ACK (\S+) (pg|sq) (\d+)", line)
        if m:
            k = (m[1], m[2]); a[k] = max(a.get(k, 0), int(m[3])); a.setdefault(("n",) + k, 0)
            a[("n",) + k] += 1
            continue
        m = re.fullmatch(r"DBCUT-STATE (\S+) (pg|sq) (.*)", line)
        if m:
            s[(m[1], m[2])] = m[3].split()
            continue
        m = re.fullmatch(r"DBCUT-FSCK (\S+) (\S+) (\S+) (.*)", line)
        if m:
            f.append((m[1], m[2], m[3], m[4].replace("_", " ")))
            continue
        if line.startswith("DBCUT-DIRTY "):
            d = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    acks.append(a); states.append(s); fscks.append(f); dirty.append(d); in_boot.append(cut_in_boot)
rows, failures = {}, []
def row(layer, db):
    return rows.setdefault((layer, db), {"layer": layer, "db": db, "cuts": 0, "cuts_in_boot": 0,
        "acked": 0, "verified": 0, "lost": 0, "integrity_errors": 0, "fsck_failures": 0, "dirty_at_cut": []})
for b in range(1, len(logs)):
    if in_boot[b] and not states[b]:
        continue  # cut before it reported anything: the next boot is checked against every ack before
    for layer in layers:
        for db in ("pg", "sq"):
            if (layer, db) not in states[b]:
                failures.append(f"boot {b}: {layer} {db}: no state reported (the layer or the database did not come up)")
    for (layer, db), st in states[b].items():
        r = row(layer, db)
        # Every commit acknowledged in any earlier boot must be there; the cuts since the last
        # boot that reported are counted here (those during boot apart).
        last_acked = max((acks[p].get((layer, db), 0) for p in range(b)), default=0)
        since = b - 1
        while since > 0 and in_boot[since] and not states[since]:
            since -= 1
        nacked = acks[since].get(("n", layer, db), 0)
        r["cuts"] += b - since
        r["cuts_in_boot"] += sum(1 for p in range(since, b) if in_boot[p])
        r["acked"] += nacked
        r["dirty_at_cut"] += [(dirty[p] or {}).get(layer, "boot" if in_boot[p] else "?") for p in range(since, b)]
        if len(st) != 5:
            r["integrity_errors"] += 1
            failures.append(f"boot {b}: {layer} {db}: {' '.join(st)}")
            continue
        count, top, total, rsum, ok = int(st[0]), int(st[1]), int(st[2]), int(st[3]), st[4]
        lost = max(0, last_acked - top)
        r["lost"] += lost
        r["verified"] += nacked - min(nacked, lost)
        problems = []
        if lost:
            problems.append(f"{lost} acknowledged commits missing (last acknowledged {last_acked}, largest n {top})")
        if count != top:
            problems.append(f"{count} rows for n up to {top}: a gap")
        if total != rsum:
            problems.append(f"total {total} != sum of rows {rsum}: a half-applied transaction")
        if ok != "ok":
            problems.append(ok)
            r["integrity_errors"] += 1
        if problems:
            failures.append(f"boot {b}: {layer} {db}: " + "; ".join(problems))
for b, f in enumerate(fscks):
    for layer, when, result, last in f:
        for db in ("pg", "sq"):
            if (layer, db) in rows and result != "clean":
                rows[(layer, db)]["fsck_failures"] += 1
        if result != "clean":
            failures.append(f"boot {b}: {layer}: fsck.ext4 -fn ({when}): {result}: {last}")
names = {"pg": "PostgreSQL", "sq": "SQLite"}
print(f"db-powercut: {cuts} power cuts of the guest; per layer and database:")
print(f"{'layer':<15} {'database':<11} {'cuts':>5} {'in boot':>7} {'acked':>7} {'verified':>9} {'lost':>5} {'integrity':>10} {'fsck':>5}  dirty % at each cut")
for r in rows.values():
    print(f"{r['layer']:<15} {names[r['db']]:<11} {r['cuts']:>5} {r['cuts_in_boot']:>7} {r['acked']:>7} {r['verified']:>9} "
          f"{r['lost']:>5} {r['integrity_errors']:>10} {r['fsck_failures']:>5}  {' '.join(r['dirty_at_cut'])}")
fsck_count = sum(len(f) for f in fscks)
print(f"fsck.ext4 -fn runs: {fsck_count}, not clean: {sum(1 for f in fscks for x in f if x[2] != 'clean')}")
if out:
    json.dump({"cuts": cuts, "rows": list(rows.values()), "failures": failures}, open(out, "w"), indent=1)
for f in failures:
    print("FAILED:", f)
sys.exit(1 if failures or not rows else 0)
PY
passed=1
echo "db-powercut: passed ($((SECONDS - start)) s)"
