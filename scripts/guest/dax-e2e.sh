#!/usr/bin/env bash
# The `dax` medium kind on real DAX mappings: QEMU emulates two NVDIMMs (files on the host,
# shared), the guest's nfit, nd_pmem, dax_pmem and device_dax drivers serve them, and ndctl
# makes the first an fsdax namespace (/dev/pmem0, ext4 mounted -o dax) and the second a devdax
# one (/dev/dax1.0, 2 MiB aligned; `pmcache format` formats it, as serve formats only a file it
# creates). In the guest, for each: `pmcache serve --ublk` with its
# medium there (the startup line must name the kind `dax`: a MAP_SYNC mapping was accepted),
# fio writing and verifying (crc32c) through /dev/ublkbN, kill -9, a restart that recovers the
# cache from the medium (an unclean shutdown), and fio verifying every block again. Then
# `pmcache bench core --quick` on the DAX file system against the same bench on the guest's
# tmpfs. Then a power cut: the guest writes a region through a cache whose medium and backing
# file are both on the fsdax NVDIMM, keeps writing elsewhere, and QEMU is killed outright
# (SIGKILL: what reached the NVDIMM's host file is all that is left); a second boot on the same
# NVDIMM files finds the fsdax namespace again, mounts the file system (journal replay),
# serves the cache (recovered from the medium) and verifies every block of the region.
#
# TCG has no CPU cache model: every store reaches the NVDIMM's host file at once, so this
# proves the mapping, the kind's detection and recovery on real DAX, not the order of cache-line
# write-backs (docs/DURABILITY.md, "Medium kinds"); and TCG's speed is not PM's.
#
#   scripts/guest/dax-e2e.sh
#
# Builds `pmcache` (profile test-opt) and installs fio, e2fsprogs and ndctl on the host when
# missing (their binaries and libraries are copied into the guest).
source "$(dirname "$0")/lib.sh"
need_tools fio:fio mkfs.ext4:e2fsprogs ndctl:ndctl python3:python3
build_pmcache test-opt
work=$(mktemp -d "${TMPDIR:-/tmp}/pmcache-dax.XXXXXX")
trap 'rm -rf "$work"' EXIT
truncate -s 512M "$work/nvdimm-fsdax.img"
truncate -s 256M "$work/nvdimm-devdax.img"
qemu_nvdimm="-machine nvdimm=on -m 1536,slots=4,maxmem=4G
  -object memory-backend-file,id=nv0,share=on,mem-path=$work/nvdimm-fsdax.img,size=512M
  -device nvdimm,id=nvdimm0,memdev=nv0
  -object memory-backend-file,id=nv1,share=on,mem-path=$work/nvdimm-devdax.img,size=256M
  -device nvdimm,id=nvdimm1,memdev=nv1
  -pidfile $work/qemu.pid"

common_guest() { # the guest script's common part
  cat <<GUEST
set -eu
PM=$exe
fail() { echo "dax-e2e: FAILED: \$*"; tail -n 30 /tmp/serve*.log 2>/dev/null; exit 1; }
wait_for() { # wait_for PATH WHAT: up to 30 s
  i=0; while [ ! -e "\$1" ]; do i=\$((i+1)); [ \$i -lt 300 ] || { ndctl list -NRD; fail "no \$2 (\$1)"; }; sleep 0.1; done
}
serve() { # serve LOG CACHE BACKING [ARGS...]: /dev/ublkbN on the cache; DEV is its path
  log=\$1 cache=\$2 backing=\$3; shift 3
  \$PM serve --ublk --ublk-recovery off --cache "\$cache" --backing "\$backing" \\
    --control /tmp/pm.ctl "\$@" > "\$log" 2>&1 &
  SERVER=\$!
  i=0
  while ! grep -q "ublk device:" "\$log"; do
    i=\$((i+1)); [ \$i -lt 600 ] || fail "serve on \$cache did not start: \$(cat \$log)"; sleep 0.1
  done
  DEV=\$(sed -n 's/.*ublk device: \(\/dev\/ublkb[0-9]*\).*/\1/p' "\$log" | head -n 1)
  grep -q "medium: dax" "\$log" || fail "\$cache is not served as the dax kind: \$(head -n 3 \$log)"
}
fio_job() { # fio_job LOG ARGS...: 4 KiB random writes over \$DEV, crc32c verified
  log=\$1; shift
  fio --name=dax --filename=\$DEV --ioengine=psync --direct=1 --rw=randwrite --bs=4k \\
    --verify=crc32c --verify_fatal=1 --verify_state_save=0 "\$@" > "\$log" 2>&1 \\
    || { cat "\$log"; fail "fio \$*"; }
}
GUEST
}

# --- boot 1 ----------------------------------------------------------------------------------
script="$work/boot1.sh"
{
  common_guest
  cat <<GUEST
ndctl create-namespace -f -e namespace0.0 -m fsdax -a 2M > /tmp/ns0.json || { ndctl list -NR; fail "fsdax namespace"; }
ndctl create-namespace -f -e namespace1.0 -m devdax -a 2M > /tmp/ns1.json || { ndctl list -NR; fail "devdax namespace"; }
wait_for /dev/pmem0 "fsdax block device"
wait_for /dev/dax1.0 "devdax character device"
echo "dax-e2e: /dev/pmem0 (fsdax, \$(cat /sys/block/pmem0/size) sectors, dax=\$(cat /sys/block/pmem0/queue/dax)), /dev/dax1.0 (devdax, \$(cat /sys/bus/dax/devices/dax1.0/size) B, align \$(cat /sys/bus/dax/devices/dax1.0/align 2>/dev/null || echo ?))"
mkfs.ext4 -q -F -b 4096 /dev/pmem0 || fail "mkfs.ext4 /dev/pmem0"
mkdir -p /mnt/pmem && mount -t ext4 -o dax /dev/pmem0 /mnt/pmem || fail "mount -o dax"
grep " /mnt/pmem " /proc/mounts | grep -q dax || fail "/mnt/pmem is not mounted with dax"
dd if=/dev/zero of=/mnt/pmem/backing.img bs=1M count=0 seek=256 2>/dev/null
dd if=/dev/zero of=/mnt/nvme/backing.img bs=1M count=0 seek=256 2>/dev/null

for medium in fsdax devdax; do
  if [ \$medium = fsdax ]; then
    cache=/mnt/pmem/cache.pm; backing=/mnt/pmem/backing.img; size="--cache-size 16M"
  else
    # A device is formatted by \`pmcache format\` (serve formats only a file it creates).
    cache=/dev/dax1.0; backing=/mnt/nvme/backing.img; size=
    \$PM format --cache \$cache --backing \$backing > /tmp/format.log 2>&1 || { cat /tmp/format.log; fail "format /dev/dax1.0"; }
    cat /tmp/format.log
  fi
  serve /tmp/serve-\$medium.log \$cache \$backing \$size
  fio_job /tmp/fio-\$medium.log --size=48m --do_verify=1
  grep -E "WRITE:|READ:" /tmp/fio-\$medium.log
  kill -9 \$SERVER; wait \$SERVER 2>/dev/null || true
  serve /tmp/serve-\$medium-2.log \$cache \$backing \$size
  grep -q "unclean shutdown" /tmp/serve-\$medium-2.log || fail "\$medium: no recovery after kill -9: \$(cat /tmp/serve-\$medium-2.log)"
  grep "attached" /tmp/serve-\$medium-2.log
  fio_job /tmp/fio-\$medium-2.log --size=48m --verify_only
  grep -E "READ:" /tmp/fio-\$medium-2.log
  kill -TERM \$SERVER; wait \$SERVER || fail "\$medium: serve exited with \$? on SIGTERM"
  echo "dax-e2e: \$medium: served as dax, fio verified, kill -9, recovered, verified again"
done

for dir in /mnt/pmem /dev/shm; do
  \$PM bench core --quick --json --dir \$dir > /tmp/bench.json 2>/tmp/bench.err || { cat /tmp/bench.err; fail "bench core --dir \$dir"; }
  sed "s|^|BENCH-CORE \$dir |" /tmp/bench.json
done

# The power cut: a region written (acknowledged), then more writes elsewhere while QEMU is
# killed.
serve /tmp/serve-cut.log /mnt/pmem/cache.pm /mnt/pmem/backing.img --cache-size 16M
fio_job /tmp/fio-cut.log --size=24m --do_verify=0
grep -E "WRITE:" /tmp/fio-cut.log
fio --name=busy --filename=\$DEV --ioengine=psync --direct=1 --rw=randwrite --bs=4k \\
  --offset=128m --size=64m --time_based --runtime=600 > /dev/null 2>&1 &
sleep 3
echo "DAX-E2E-POWER-CUT-NOW"
sleep 600
GUEST
} > "$script"
script1=$script

echo "== boot 1: fsdax and devdax media, kill -9 and recovery, bench core, then a power cut"
log1="$work/boot1.log"
PMCACHE_GUEST_QEMU_ARGS="$qemu_nvdimm ${PMCACHE_GUEST_QEMU_ARGS:-}" \
  "$here/run-in-guest.sh" --timeout 1500 --mem 1536 --disk-mib 1024 ${PMCACHE_GUEST_ARGS:-} \
  --copy "$exe" --copy "$(command -v fio)" --copy "$(command -v mkfs.ext4)" \
  --copy "$(command -v ndctl)" --copy "$script1" -- sh "$script1" > "$log1" 2>&1 &
runner=$!
cut=0
while kill -0 "$runner" 2>/dev/null; do
  if grep -q "^DAX-E2E-POWER-CUT-NOW" "$log1"; then
    sleep 1
    echo "dax-e2e: killing QEMU (pid $(cat "$work/qemu.pid")) outright: the power cut"
    kill -9 "$(cat "$work/qemu.pid")"
    cut=1
    break
  fi
  sleep 1
done
wait "$runner" || true
grep -E "^dax-e2e|^\[guest\]|WRITE:|READ:|attached" "$log1" || true
if ((cut == 0)); then
  tail -n 60 "$log1"
  echo "dax-e2e: FAILED: boot 1 ended before the power cut"
  exit 1
fi

# bench core: the DAX file system against tmpfs, row by row (ratio of the engine's rate).
python3 - "$log1" <<'EOF'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    if line.startswith("BENCH-CORE "):
        _, where, rest = line.split(" ", 2)
        try:
            row = json.loads(rest)
        except ValueError:
            continue
        rows.setdefault(row.get("name"), {})[where] = row
print("dax-e2e: bench core --quick in the guest (TCG: not PM speed), engine ops/s on the DAX file system against tmpfs")
print(f"{'configuration':<28} {'dax ops/s':>12} {'tmpfs ops/s':>12} {'dax/tmpfs':>10}")
for name, by in rows.items():
    dax, tmpfs = by.get("/mnt/pmem"), by.get("/dev/shm")
    if not dax or not tmpfs:
        continue
    d, t = dax.get("ops_per_sec"), tmpfs.get("ops_per_sec")
    if d and t:
        print(f"{name:<28} {d:>12,.0f} {t:>12,.0f} {d / t:>10.2f}")
EOF

# --- boot 2 ----------------------------------------------------------------------------------
script="$work/boot2.sh"
{
  common_guest
  cat <<GUEST
wait_for /dev/pmem0 "fsdax block device after the power cut"
mkdir -p /mnt/pmem && mount -t ext4 -o dax /dev/pmem0 /mnt/pmem || fail "mount -o dax after the power cut"
serve /tmp/serve-after.log /mnt/pmem/cache.pm /mnt/pmem/backing.img --cache-size 16M
grep -q "unclean shutdown" /tmp/serve-after.log || fail "no recovery after the power cut: \$(cat /tmp/serve-after.log)"
grep "attached" /tmp/serve-after.log
fio_job /tmp/fio-after.log --size=24m --verify_only
grep -E "READ:" /tmp/fio-after.log
\$PM check --cache /mnt/pmem/cache.pm > /tmp/check.log 2>&1 || { cat /tmp/check.log; fail "pmcache check"; }
kill -TERM \$SERVER; wait \$SERVER || fail "serve exited with \$? on SIGTERM"
echo "dax-e2e: after the power cut: fsdax found again, cache recovered, every block fio wrote verified"
GUEST
} > "$script"
echo "== boot 2: the same NVDIMMs after the power cut"
PMCACHE_GUEST_QEMU_ARGS="$qemu_nvdimm ${PMCACHE_GUEST_QEMU_ARGS:-}" \
  "$here/run-in-guest.sh" --timeout 900 --mem 1536 --disk-mib 512 ${PMCACHE_GUEST_ARGS:-} \
  --copy "$exe" --copy "$(command -v fio)" --copy "$(command -v ndctl)" --copy "$script" \
  -- sh "$script"
echo "dax-e2e: passed ($((SECONDS - start)) s in all)"
