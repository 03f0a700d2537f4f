#!/usr/bin/env bash
# What a VM host serves a guest's disk with today, beside pmcache's vhost-user-blk, in one
# QEMU guest (TCG) with six disks, measured by the same fio in rounds that alternate between
# them:
#
#   pmcache      pmcache serve --vhost-user-blk: a 256 MiB cache in /dev/shm in front of a
#                1 GiB backing file on this host's disk
#   qsd          qemu-storage-daemon's own vhost-user-blk export of a raw 1 GiB file in
#                /dev/shm: the medium alone through the same path (the normaliser)
#   virtio-blk   QEMU's built-in virtio-blk on such a raw file in /dev/shm (aio=io_uring):
#                the VM's own raw disk path
#   rbd          QEMU's rbd driver on an image of a throwaway Ceph cluster (scripts/ceph/),
#                cache=none: librbd's cache off (rbd_cache=false)
#   rbd-cache    the same with cache=writeback: librbd's in-memory cache on (rbd_cache=true)
#   pmcache-rbd  pmcache serve --vhost-user-blk in front of another image of that cluster
#                (--backing rbd:), with a 256 MiB cache in /dev/shm
#
# The cases: 4 KiB random reads at QD1 and QD32 over the first 128 MiB (written first, so a
# cache's reads are hits), 4 MiB sequential reads and writes at QD4 over that region, and
# 4 KiB random writes at QD16 over 512 MiB (twice the caches) for WRITE_SECONDS: sustained
# writes, the caches' write-back to their backing stores included (run after every round of
# the other cases: they evict the region the reads hit). Each case runs on each disk once a
# round; the table gives the median of the rounds and each ratio round by round
# (the median of the per-round ratios). The guest is emulated: only ratios within the run
# mean anything.
#
#   scripts/guest/vhost-bench.sh [ROUNDS (3)] [SECONDS per run (5)] [WRITE_SECONDS (20)]
#
# PMCACHE_BIN=path uses that pmcache binary instead of building one in release. Needs root
# (the Ceph cluster), fio on the host (copied into the guest), and QEMU's rbd driver
# (qemu-block-extra at the emulator's version; installed when missing, as run-in-guest.sh
# installs the emulator). Prints the table and writes it, with every run's figures, to
# $OUT (default target/vhost-bench.json).
source "$(dirname "$0")/lib.sh"
rounds="${1:-3}"
seconds="${2:-5}"
write_seconds="${3:-20}"
out_json="${OUT:-target/vhost-bench.json}"

need_tools fio:fio qemu-storage-daemon:qemu-system-x86 rbd:ceph-common
# QEMU's rbd driver is a module of qemu-block-extra, which must match the emulator's version
# (a Debian 12 host carries QEMU from bookworm-backports: see run-in-guest.sh).
if ! { qemu-system-x86_64 -drive driver=rbd,help 2>&1 || true; } | grep -q "'pool'"; then
  ver=$(dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null || dpkg-query -W -f='${Version}' qemu-utils)
  adir="${PMCACHE_GUEST_CACHE:-$HOME/.cache/pmcache-guest}/apt-host-qemu"
  mkdir -p "$adir/lists/partial"
  mirror="${PMCACHE_GUEST_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  printf 'deb %s bookworm main\ndeb %s bookworm-backports main\n' "$mirror" "$mirror" > "$adir/sources.list"
  opts=(-o "Dir::Etc::SourceList=$adir/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$adir/lists")
  as_root apt-get "${opts[@]}" update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get "${opts[@]}" install -y -q \
    --no-install-recommends "qemu-block-extra=$ver"
fi

build_pmcache release
commit=$(git rev-parse --short HEAD)
[[ -z "$(git status --porcelain -- crates Cargo.toml Cargo.lock)" ]] || commit="$commit-dirty"

work=$(mktemp -d /var/tmp/vhost-bench.XXXXXX)
shm=/dev/shm/vhost-bench.$$
mkdir -p "$shm"
pids=()
cleanup() {
  for p in ${pids[@]+"${pids[@]}"}; do kill -INT "$p" 2>/dev/null || true; done
  for p in ${pids[@]+"${pids[@]}"}; do wait "$p" 2>/dev/null || true; done
  bash scripts/ceph/cluster.sh stop "$work/cluster" >/dev/null 2>&1 || true
  rm -rf "$work" "$shm"
}
on_exit cleanup

echo "== Ceph cluster, images"
conf=$(bash scripts/ceph/cluster.sh start "$work/cluster" | sed -n 's/^CEPH_CONF=//p')
# 1040 MiB images (the backing file is 1024 MiB): the guest tells the disks apart by size too.
for image in vb-off vb-on vb-pm; do
  rbd -c "$conf" create --size 1040M "rbd/$image"
done
for f in qsd virtio; do truncate -s 1G "$shm/$f.img"; done
truncate -s 1G "$work/pm-backing.img"

echo "== servers"
wait_socket() { local i; for ((i = 0; i < 300; i++)); do [[ -S "$1" ]] && return 0; sleep 0.1; done; echo "no socket $1" >&2; tail -n 20 "$2" >&2; exit 1; }
"$exe" serve --cache "$shm/pm.pm" --cache-size 256M --backing "$work/pm-backing.img" \
  --vhost-user-blk "$work/pm.sock" > "$work/pm.log" 2>&1 &
pids+=($!)
"$exe" serve --cache "$shm/pmr.pm" --cache-size 256M --backing "rbd:rbd/vb-pm:conf=$conf" \
  --vhost-user-blk "$work/pmr.sock" > "$work/pmr.log" 2>&1 &
pids+=($!)
qemu-storage-daemon \
  --blockdev "driver=file,node-name=f,filename=$shm/qsd.img,aio=io_uring" \
  --export "type=vhost-user-blk,id=e,node-name=f,addr.type=unix,addr.path=$work/qsd.sock,writable=on,num-queues=1" \
  > "$work/qsd.log" 2>&1 &
pids+=($!)
wait_socket "$work/pm.sock" "$work/pm.log"
wait_socket "$work/pmr.sock" "$work/pmr.log"
wait_socket "$work/qsd.sock" "$work/qsd.log"

guest_script vhost-bench
cat > "$script" <<GUEST
set -eu
fail() { echo "vhost-bench: FAILED: \$*"; exit 1; }
# The disks in PCI order (run-in-guest.sh adds the vhost-user-blk ones first), checked by
# size and serial.
disk() { # disk NAME DEV MIB SERIAL-PREFIX
  [ -b /dev/\$2 ] || fail "no /dev/\$2 for \$1"
  mib=\$((\$(cat /sys/block/\$2/size) / 2048))
  [ "\$mib" = "\$3" ] || fail "/dev/\$2 (\$1) is \$mib MiB, not \$3"
  case "\$(cat /sys/block/\$2/serial 2>/dev/null)" in \$4*) ;; *) fail "/dev/\$2 (\$1): serial '\$(cat /sys/block/\$2/serial)'" ;; esac
  echo "\$1 /dev/\$2 \$mib MiB serial \$(cat /sys/block/\$2/serial)"
}
disk pmcache vda 1024 pmcache-
disk qsd vdb 1024 ""
disk pmcache-rbd vdc 1040 pmcache-
disk virtio-blk vdd 1024 virtio-file
disk rbd vde 1040 rbd-off
disk rbd-cache vdf 1040 rbd-on
devs="pmcache:vda qsd:vdb pmcache-rbd:vdc virtio-blk:vdd rbd:vde rbd-cache:vdf"
# One run: VB <round> <case> <disk> and fio's terse line (version 3).
run() { # run ROUND CASE DISK DEV FIO-ARGS...
  r=\$1 c=\$2 n=\$3 d=\$4; shift 4
  line=\$(fio --name=\$c --filename=/dev/\$d --direct=1 --ioengine=io_uring --output-format=terse --terse-version=3 "\$@" 2>&1 | tail -n 1)
  echo "VB \$r \$c \$n \$line"
}
echo "== the first 128 MiB of each disk written"
for nd in \$devs; do
  fio --name=fill --filename=/dev/\${nd#*:} --direct=1 --ioengine=io_uring --rw=write --bs=1M --iodepth=4 --size=128M --output=/dev/null || fail "fill \${nd%%:*}"
done
for r in \$(seq 1 $rounds); do
  echo "== round \$r"
  for nd in \$devs; do run \$r randread-qd1 \${nd%%:*} \${nd#*:} --rw=randread --bs=4k --iodepth=1 --size=128M --time_based --runtime=$seconds --ramp_time=1; done
  for nd in \$devs; do run \$r randread-qd32 \${nd%%:*} \${nd#*:} --rw=randread --bs=4k --iodepth=32 --size=128M --time_based --runtime=$seconds --ramp_time=1; done
  for nd in \$devs; do run \$r seqread-4m \${nd%%:*} \${nd#*:} --rw=read --bs=4M --iodepth=4 --size=128M --time_based --runtime=$seconds --ramp_time=1; done
  for nd in \$devs; do run \$r seqwrite-4m \${nd%%:*} \${nd#*:} --rw=write --bs=4M --iodepth=4 --size=128M --time_based --runtime=$seconds --ramp_time=1; done
done
# The sustained writes last: over twice a cache, they would evict the region the reads hit.
for r in \$(seq 1 $rounds); do
  echo "== sustained writes, round \$r"
  for nd in \$devs; do run \$r randwrite-sustained \${nd%%:*} \${nd#*:} --rw=randwrite --bs=4k --iodepth=16 --size=512M --time_based --runtime=$write_seconds; done
done
echo "vhost-bench: done"
GUEST

log="$work/console.log"
qemu_args="-drive file=$shm/virtio.img,format=raw,if=none,id=vf,aio=io_uring,cache.direct=off"
qemu_args+=" -device virtio-blk-pci,drive=vf,serial=virtio-file,num-queues=1"
qemu_args+=" -drive file=rbd:rbd/vb-off:conf=$conf,format=raw,if=none,id=ro,cache=none"
qemu_args+=" -device virtio-blk-pci,drive=ro,serial=rbd-off,num-queues=1"
qemu_args+=" -drive file=rbd:rbd/vb-on:conf=$conf,format=raw,if=none,id=rc,cache=writeback"
qemu_args+=" -device virtio-blk-pci,drive=rc,serial=rbd-on,num-queues=1"
echo "== guest (rounds $rounds, ${seconds} s a run, ${write_seconds} s of sustained writes)"
started=$SECONDS
PMCACHE_GUEST_QEMU_ARGS="$qemu_args" bash "$here/run-in-guest.sh" --mem 1024 --timeout 5400 \
  --vhost-user-blk "$work/pm.sock" --vhost-user-blk "$work/qsd.sock" \
  --vhost-user-blk "$work/pmr.sock" --vhost-queues 1 \
  --copy "$(command -v fio)" --copy "$script" -- sh "$script" 2>&1 | tee "$log" | grep --line-buffered -v '^VB '
guest_seconds=$((SECONDS - started))
grep -q '^vhost-bench: done' "$log" || { echo "vhost-bench: the guest did not finish" >&2; exit 1; }
for l in pm pmr; do "$exe" stats --control "$shm/$l.pm.ctl" > "$work/$l.stats" 2>&1 || true; done

python3 - "$log" "$out_json" "$commit" "$rounds" "$seconds" "$write_seconds" "$guest_seconds" <<'PY'
import json, statistics, sys
log, out, commit, rounds, seconds, write_seconds, guest_seconds = sys.argv[1:]
runs = {}
for line in open(log, errors="replace"):
    if not line.startswith("VB "):
        continue
    _, rnd, case, disk, terse = line.rstrip("\n").split(" ", 4)
    f = terse.split(";")
    if len(f) < 90 or f[0] != "3":
        sys.exit(f"vhost-bench: not a fio terse line for {case} {disk} round {rnd}: {terse[:200]}")
    def pct(field, label):
        key, _, value = f[field].partition("=")
        if not key.startswith(label):
            sys.exit(f"vhost-bench: field {field} of fio's terse line is {f[field]!r}, not {label}")
        return int(value)
    writes = case.startswith(("seqwrite", "randwrite"))
    base = 46 if writes else 5
    iops = float(f[base + 2])
    bw_kib = float(f[base + 1])
    p50 = pct(base + 18, "50.000000%")
    p99 = pct(base + 24, "99.000000%")
    runs[(case, disk, int(rnd))] = {"iops": iops, "mib_s": bw_kib / 1024, "clat_us_p50": p50, "clat_us_p99": p99}
cases = ["randread-qd1", "randread-qd32", "seqread-4m", "seqwrite-4m", "randwrite-sustained"]
disks = ["pmcache", "qsd", "virtio-blk", "pmcache-rbd", "rbd", "rbd-cache"]
n = int(rounds)
def median_of(case, disk, key):
    vals = [runs[(case, disk, r)][key] for r in range(1, n + 1) if (case, disk, r) in runs]
    return statistics.median(vals) if vals else None
def ratio(case, a, b, key):
    vals = [runs[(case, a, r)][key] / runs[(case, b, r)][key] for r in range(1, n + 1)
            if (case, a, r) in runs and (case, b, r) in runs and runs[(case, b, r)][key] > 0]
    return statistics.median(vals) if vals else None
print(f"\nvhost-bench: commit {commit}, {n} rounds, {seconds} s a run, {write_seconds} s of sustained writes, guest {guest_seconds} s")
key_of = {c: ("mib_s" if c.startswith("seq") else "iops") for c in cases}
print(f"{'case':<22}" + "".join(f"{d:>13}" for d in disks) + "   unit")
for c in cases:
    k = key_of[c]
    cells = []
    for d in disks:
        m = median_of(c, d, k)
        cells.append(f"{m:>13,.0f}" if m is not None else f"{'-':>13}")
    print(f"{c:<22}" + "".join(cells) + f"   {'MiB/s' if k == 'mib_s' else 'IOPS'} (median)")
print(f"{'p99 completion µs':<22}")
for c in cases:
    print(f"  {c:<20}" + "".join(f"{median_of(c, d, 'clat_us_p99') or 0:>13,.0f}" for d in disks))
pairs = [("pmcache", "qsd"), ("pmcache", "virtio-blk"), ("pmcache-rbd", "rbd-cache"), ("pmcache-rbd", "rbd")]
print("\nratios, round by round (median):")
print(f"{'case':<22}" + "".join(f"{a + '/' + b:>24}" for a, b in pairs))
ratios = {}
for c in cases:
    row = []
    for a, b in pairs:
        r = ratio(c, a, b, key_of[c])
        ratios[f"{c} {a}/{b}"] = r
        row.append(f"{r:>24.2f}" if r is not None else f"{'-':>24}")
    print(f"{c:<22}" + "".join(row))
json.dump({"commit": commit, "rounds": n, "seconds": int(seconds), "write_seconds": int(write_seconds),
           "guest_seconds": int(guest_seconds),
           "runs": [{"case": c, "disk": d, "round": r, **v} for (c, d, r), v in sorted(runs.items())],
           "ratios": ratios}, open(out, "w"), indent=1)
print(f"\nwritten to {out}")
PY
for l in pm pmr; do echo "== pmcache ($l): $(grep -E '^(reads|writes|vhost) ' "$work/$l.stats" 2>/dev/null | tr '\n' ' ')"; done
