#!/usr/bin/env bash
# Runs a host-built command inside a small Linux guest (QEMU, TCG: no KVM needed) whose scratch
# disk is an emulated NVMe drive (serial pmcache) with poll queues, formatted ext4 and mounted
# at /mnt/nvme, so that polled I/O (io_uring IOPOLL, fio --hipri) really works there. The guest exports
# PMCACHE_TEST_DISK_DIR=/mnt/nvme and PMCACHE_TEST_SHM_DIR=/tmp.
#
#   scripts/guest/run-in-guest.sh [--mem MiB] [--disk-mib N] [--timeout S] [--smp N]
#       [--kernel-suite SUITE] [--nvme-lbs BYTES] [--poll-queues N] [--mount-opts OPTS]
#       [--vhost-user-blk SOCKET]... [--vhost-queues N]
#       [--env NAME=VALUE]... [--copy HOSTPATH]... -- COMMAND ARGS...
#
# --kernel-suite picks the Debian suite the guest kernel comes from (see below), --nvme-lbs the
# drive's logical block size (512, or 4096 for a 4Kn drive), --poll-queues the nvme driver's
# poll_queues (2; 0 = no polling, as on a plain virtio disk), --mount-opts ext4 mount options.
#
# --vhost-user-blk SOCKET adds a virtio-blk disk served by a vhost-user-blk backend on the host
# listening on the Unix socket SOCKET (started before this script; QEMU waits for it); the
# guest sees the first as /dev/vda, the next as /dev/vdb and so on, each with --vhost-queues
# request queues (2; the backend must offer at least as many). The guest's RAM is then a
# shared memfd (memory-backend=mem of the machine), which the backend maps, so
# PMCACHE_GUEST_QEMU_ARGS cannot bring -numa nodes of their own memory backends with it. QEMU
# reconnects to the socket every second when the backend goes away (a restarted backend on
# the same path takes the disk over; the guest's requests wait meanwhile).
#
# Every --copy path (a file or a directory) appears at the same path in the guest; for an ELF
# file, the shared libraries `ldd` names (and the dynamic loader) are copied as well. COMMAND
# runs as root in /mnt/nvme with PATH=/usr/sbin:/usr/bin:/sbin:/bin; its exit code becomes this
# script's (the guest prints it on a `PMCACHE_GUEST_EXIT=<code>` line).
#
# Installs what it needs (qemu-system-x86, busybox-static, e2fsprogs, cpio) with apt-get when
# missing, and downloads (never installs) the Debian kernel package `linux-image-amd64` points
# at: the host's own apt sources by default, or with --kernel-suite (e.g. bookworm-backports)
# that Debian suite through a private apt state directory (the host's apt configuration is not
# touched). The kernel and the few modules the guest needs are kept in
# ${PMCACHE_GUEST_CACHE:-$HOME/.cache/pmcache-guest}. Set PMCACHE_GUEST_KERNEL_PKG to pick
# another linux-image-* package, PMCACHE_GUEST_KERNEL_DEB to use a downloaded linux-image .deb
# (e.g. from bookworm-backports), PMCACHE_GUEST_QEMU_ARGS to add QEMU arguments.
set -euo pipefail

say() { echo "run-in-guest: $*" >&2; }
die() { say "error: $*"; exit 2; }

mem=1024
disk_mib=512
timeout_s=900
smp=2
kernel_suite="${PMCACHE_GUEST_KERNEL_SUITE:-}"
nvme_lbs=512
poll_queues=2
mount_opts=
vhost_socks=()
vhost_queues=2
copies=()
envs=()
while (($#)); do
  case "$1" in
    --mem) mem="$2"; shift 2 ;;
    --disk-mib) disk_mib="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --smp) smp="$2"; shift 2 ;;
    --mount-opts) mount_opts="$2"; shift 2 ;;
    --kernel-suite) kernel_suite="$2"; shift 2 ;;
    --nvme-lbs) nvme_lbs="$2"; shift 2 ;;
    --poll-queues) poll_queues="$2"; shift 2 ;;
    --vhost-user-blk) vhost_socks+=("$2"); shift 2 ;;
    --vhost-queues) vhost_queues="$2"; shift 2 ;;
    --copy) copies+=("$2"); shift 2 ;;
    --env) [[ "$2" == [A-Za-z_]*=* ]] || die "--env wants NAME=VALUE, got '$2'"; envs+=("$2"); shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,37p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (the command goes after --)" ;;
  esac
done
(($#)) || die "no command given (usage: $0 [options] -- COMMAND ARGS...)"
for n in "$mem" "$disk_mib" "$timeout_s" "$smp" "$nvme_lbs" "$poll_queues" "$vhost_queues"; do
  [[ "$n" =~ ^[0-9]+$ ]] || die "not a number: '$n'"
done

as_root() { if ((EUID == 0)); then "$@"; else sudo "$@"; fi; }

# --- host tools ------------------------------------------------------------------------------
apt_updated=0
apt_update_once() {
  if ((apt_updated == 0)); then
    say "apt-get update"
    as_root apt-get update -q >&2
    apt_updated=1
  fi
}
missing=()
need() { # need COMMAND PACKAGE
  command -v "$1" >/dev/null 2>&1 || missing+=("$2")
}
# QEMU's system emulator must match an installed qemu-utils: Debian 12 machines may carry
# qemu-utils from bookworm-backports (10.x), and installing bookworm's qemu-system-x86 (7.2)
# next to it makes apt *remove* qemu-utils (qemu-img, qemu-io). So the emulator is installed at
# qemu-utils' exact version, from the suites that have it, through a private apt state
# directory (the host's apt sources stay as they are).
install_matching_qemu() {
  local ver adir
  ver=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
  if [[ -z "$ver" || "$ver" != *bpo12* ]]; then
    missing+=(qemu-system-x86)
    return
  fi
  adir="${PMCACHE_GUEST_CACHE:-$HOME/.cache/pmcache-guest}/apt-host-qemu"
  mkdir -p "$adir/lists/partial"
  local mirror="${PMCACHE_GUEST_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
  printf 'deb %s bookworm main\ndeb %s bookworm-updates main\ndeb %s bookworm-backports main\n' \
    "$mirror" "$mirror" "$mirror" > "$adir/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$adir/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$adir/lists")
  say "installing qemu-system-x86=$ver to match qemu-utils $ver (bookworm-backports)"
  as_root apt-get "${opts[@]}" update -q >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get "${opts[@]}" install -y -q \
    --no-install-recommends -t bookworm-backports "qemu-system-x86=$ver" "qemu-utils=$ver" >&2
}
command -v qemu-system-x86_64 >/dev/null 2>&1 || install_matching_qemu
need mkfs.ext4 e2fsprogs
need cpio cpio
need gzip gzip
need ldd libc-bin
need dpkg-deb dpkg
need timeout coreutils
[[ -x /bin/busybox ]] && ! ldd /bin/busybox >/dev/null 2>&1 || missing+=(busybox-static)
if ((${#missing[@]})); then
  apt_update_once
  say "apt-get install -y ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
fi
# A dynamically linked busybox (package busybox) would need its libraries in the guest too.
ldd /bin/busybox >/dev/null 2>&1 && die "/bin/busybox is not static: install busybox-static"

# --- guest kernel and modules ----------------------------------------------------------------
cache="${PMCACHE_GUEST_CACHE:-$HOME/.cache/pmcache-guest}"
mkdir -p "$cache"
# apt for the kernel: the host's sources, or only $kernel_suite through a private state dir.
kapt_opts=()
if [[ -n "$kernel_suite" ]]; then
  [[ "$kernel_suite" =~ ^[a-z0-9-]+$ ]] || die "bad --kernel-suite '$kernel_suite'"
  adir="$cache/apt-$kernel_suite"
  mkdir -p "$adir/lists/partial" "$adir/cache/archives/partial"
  echo "deb ${PMCACHE_GUEST_DEBIAN_MIRROR:-http://deb.debian.org/debian} $kernel_suite main" \
    > "$adir/sources.list"
  kapt_opts=(-o "Dir::Etc::SourceList=$adir/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$adir/lists" -o "Dir::Cache=$adir/cache")
fi
kapt_updated=0
kapt_update() {
  if ((${#kapt_opts[@]} == 0)); then apt_update_once; return; fi
  if ((kapt_updated == 0)); then
    say "apt-get update (only $kernel_suite, private lists in $adir)"
    apt-get "${kapt_opts[@]}" update -q >&2
    kapt_updated=1
  fi
}
kpkg="${PMCACHE_GUEST_KERNEL_PKG:-}"
kdeb="${PMCACHE_GUEST_KERNEL_DEB:-}"
pointer="$cache/kernel-of-${kernel_suite:-host-sources}"
if [[ -n "$kdeb" ]]; then
  [[ -f "$kdeb" ]] || die "PMCACHE_GUEST_KERNEL_DEB: no such file: $kdeb"
  kdeb=$(cd "$(dirname "$kdeb")" && pwd)/$(basename "$kdeb")
  kpkg=$(dpkg-deb -f "$kdeb" Package)
elif [[ -z "$kpkg" ]]; then
  # Reuse the kit built before for these sources (no network needed); otherwise follow the
  # linux-image-amd64 metapackage to the current versioned package. Delete the cache directory
  # (or the kernel-of-* file in it) to move to a newer kernel.
  if [[ -f "$pointer" && -f "$cache/kit-$(cat "$pointer")/ready" ]]; then
    kpkg=$(cat "$pointer")
  else
    if [[ -n "$kernel_suite" ]] || ! apt-cache show linux-image-amd64 >/dev/null 2>&1; then
      kapt_update
    fi
    kpkg=$(apt-cache ${kapt_opts[@]+"${kapt_opts[@]}"} depends linux-image-amd64 2>/dev/null \
      | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
    [[ -n "$kpkg" ]] || die "cannot resolve linux-image-amd64 to a kernel package"
    say "linux-image-amd64${kernel_suite:+ ($kernel_suite)} -> $kpkg"
  fi
fi
kit="$cache/kit-$kpkg"
# Modules loaded in the guest, each followed by its dependencies (resolved below). The crypto
# drivers are soft dependencies (by alias) of ext4/jbd2 (crc32c) and t10-pi (crct10dif,
# crc64-rocksoft): load the generic C ones explicitly, no modprobe runs in the guest.
# (Newer kernels lack some of these or build them in; only nvme and ext4 are required.) The
# block-device frontends' tests want ublk_drv (/dev/ublk-control, /dev/ublkbN) and nbd
# (/dev/nbdN), loop to mount a backing file itself, and brd (RAM disks: paper 003's stock-ext4
# bed, reloaded there with its size); the DAX tests want the NVDIMM stack
# (nfit finds QEMU's emulated NVDIMMs, nd_pmem serves /dev/pmemN for fsdax, dax_pmem and
# device_dax /dev/daxX.Y for devdax): loaded where the kernel has them (without an NVDIMM
# they find nothing). The vhost-user-blk disks are virtio-blk over PCI: virtio_pci (the
# transport: a module in Debian 12's 6.1, with virtio and virtio_ring as its dependencies;
# built into the 6.12 of bookworm-backports) and virtio_blk (a module in both).
wanted_modules=(crc32c_generic? crct10dif_generic? crc64_rocksoft_generic? nvme ext4 ublk_drv? nbd? loop? brd?
  nfit? nd_pmem? dax_pmem? device_dax? virtio_pci? virtio_blk?
  bcache? dm_mod? dm_bufio? dm_persistent_data? dm_bio_prison? dm_cache? dm_cache_smq? dm_writecache?)
# A kit prepared for another list of modules is prepared again.
if [[ -f "$kit/ready" && "$(cat "$kit/wanted" 2>/dev/null)" != "${wanted_modules[*]}" ]]; then
  rm -f "$kit/ready"
fi
if [[ ! -f "$kit/ready" ]]; then
  say "preparing guest kernel from $kpkg (downloaded, not installed) in $kit"
  work="$cache/extract.$$"
  rm -rf "$work" "$kit"
  mkdir -p "$work/deb" "$kit/modules"
  ((EUID != 0)) || chown _apt "$work/deb" 2>/dev/null || true # lets apt download sandboxed
  if [[ -n "$kdeb" ]]; then
    cp "$kdeb" "$work/deb/"
  else
    say "apt-get download $kpkg"
    if ! (cd "$work/deb" && apt-get ${kapt_opts[@]+"${kapt_opts[@]}"} download "$kpkg" >&2); then
      kapt_update
      (cd "$work/deb" && apt-get ${kapt_opts[@]+"${kapt_opts[@]}"} download "$kpkg" >&2)
    fi
  fi
  say "dpkg-deb -x $(ls "$work"/deb/*.deb)"
  dpkg-deb -x "$work"/deb/*.deb "$work/root"
  kver=$(find "$work/root/lib/modules" -mindepth 1 -maxdepth 1 -printf '%f\n' | head -n 1)
  mdir="$work/root/lib/modules/$kver"
  cp "$work/root/boot/vmlinuz-$kver" "$kit/vmlinuz"
  echo "$kver" > "$kit/kernel-version"
  # name (with '_' for '-') -> relative .ko path, for every module file of the package.
  declare -A ko_of=()
  while IFS= read -r rel; do
    base="${rel##*/}"; base="${base%%.ko*}"
    ko_of["${base//-/_}"]="$rel"
  done < <(cd "$mdir" && find kernel -name '*.ko' -o -name '*.ko.xz' -o -name '*.ko.zst' -o -name '*.ko.gz')
  declare -A done_mod=()
  order=()
  modinfo_field() { # modinfo_field FILE FIELD: read .modinfo without kmod's modinfo
    local f="$1" cat=cat
    case "$f" in
      *.xz) cat="xz -dc" ;; *.zst) cat="zstd -dc" ;; *.gz) cat="gzip -dc" ;;
    esac
    $cat "$f" | tr '\0' '\n' | sed -n "s/^$2=//p" | head -n 1
  }
  add_module() { # depth-first: dependencies before the module; NAME? = optional
    local name="${1//-/_}" rel dep optional=
    [[ "$name" == *\? ]] && { optional=1; name="${name%\?}"; }
    [[ -n "${done_mod[$name]:-}" ]] && return 0
    done_mod[$name]=1
    rel="${ko_of[$name]:-}"
    if [[ -z "$rel" ]]; then
      if grep -Eq "/${name//_/[-_]}\.ko(\..*)?$" "$mdir/modules.builtin"; then
        say "module $name is built into $kver"
        return 0
      fi
      [[ -n "$optional" ]] && { say "optional module $name is not in $kver"; return 0; }
      die "module $name not found in $kpkg"
    fi
    for dep in $(modinfo_field "$mdir/$rel" depends | tr ',' ' '); do add_module "$dep"; done
    order+=("$rel")
  }
  for m in "${wanted_modules[@]}"; do add_module "$m"; done
  : > "$kit/modules.order"
  for rel in "${order[@]}"; do
    base="${rel##*/}"
    case "$rel" in
      *.ko.xz) command -v xz >/dev/null || { apt_update_once; as_root apt-get install -y -q xz-utils >&2; }
               xz -dc "$mdir/$rel" > "$kit/modules/${base%.xz}"; base="${base%.xz}" ;;
      *.ko.zst) command -v zstd >/dev/null || { apt_update_once; as_root apt-get install -y -q zstd >&2; }
                zstd -qdc "$mdir/$rel" > "$kit/modules/${base%.zst}"; base="${base%.zst}" ;;
      *.ko.gz) gzip -dc "$mdir/$rel" > "$kit/modules/${base%.gz}"; base="${base%.gz}" ;;
      *) cp "$mdir/$rel" "$kit/modules/$base" ;;
    esac
    echo "$base" >> "$kit/modules.order"
  done
  rm -rf "$work"
  echo "${wanted_modules[*]}" > "$kit/wanted"
  touch "$kit/ready"
fi
[[ -n "$kdeb" || -n "${PMCACHE_GUEST_KERNEL_PKG:-}" ]] || echo "$kpkg" > "$pointer"
kver=$(cat "$kit/kernel-version")
say "guest kernel $kver; modules: $(tr '\n' ' ' < "$kit/modules.order")"

# --- initramfs -------------------------------------------------------------------------------
tmp=$(mktemp -d "${TMPDIR:-/tmp}/pmcache-guest.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
root="$tmp/root"
mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,mnt/nvme,etc,root,modules}
cp /bin/busybox "$root/bin/busybox"
cp "$kit"/modules/*.ko "$kit/modules.order" "$root/modules/"

copy_path() { # copy a host path to the same path in the guest (dereferencing symlinks)
  local src="$1" dst="$root$1"
  mkdir -p "$(dirname "$dst")"
  if [[ -d "$src" ]]; then
    mkdir -p "$dst"
    cp -aL "$src/." "$dst/"
  else
    cp -L "$src" "$dst"
  fi
}
copy_with_libs() {
  local f="$1" lib
  [[ -e "$f" ]] || die "--copy: no such file: $f"
  f=$(cd "$(dirname "$f")" && pwd)/$(basename "$f")
  say "copy $f"
  copy_path "$f"
  if [[ -f "$f" ]] && ldd "$f" >/dev/null 2>&1; then
    for lib in $(ldd "$f" | awk '{for (i = 1; i <= NF; i++) if ($i ~ /^\//) print $i}'); do
      [[ -e "$root$lib" ]] || copy_path "$lib"
    done
  fi
}
for c in ${copies[@]+"${copies[@]}"}; do copy_with_libs "$c"; done

sq() { printf "'%s'" "${1//\'/\'\\\'\'}"; } # single-quote for the guest's sh
{
  echo "cd /mnt/nvme"
  for e in ${envs[@]+"${envs[@]}"}; do echo "export ${e%%=*}=$(sq "${e#*=}")"; done
  printf 'exec'
  for a in "$@"; do printf ' %s' "$(sq "$a")"; done
  echo
} > "$root/command.sh"

{
  echo '#!/bin/busybox sh'
  echo "MOUNT_OPTS=$(sq "$mount_opts") POLL_QUEUES=$poll_queues"
} > "$root/init"
cat >> "$root/init" <<'EOF'
/bin/busybox --install -s
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
log() { echo "[guest] $*"; }
finish() { # finish CODE: report and power off
  echo "PMCACHE_GUEST_EXIT=$1"
  sync
  umount /mnt/nvme 2>/dev/null
  poweroff -f
  sleep 5
  echo o > /proc/sysrq-trigger
}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
chmod 1777 /tmp # the initramfs root is a tmpfs already (and may hold --copy files in /tmp)
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
log "kernel $(uname -r), $(grep -c ^processor /proc/cpuinfo) CPUs, $(sed -n 's/MemTotal: *//p' /proc/meminfo) RAM"
for m in $(cat /modules/modules.order); do
  args=
  [ "$m" = nvme.ko ] && args=poll_queues=$POLL_QUEUES
  insmod /modules/$m $args || { log "insmod $m $args failed"; finish 90; }
done
# The scratch disk is the NVMe controller with serial "pmcache" (a command's own extra NVMe
# drives may be probed first and take nvme0).
i=0
scratch=
while [ -z "$scratch" ]; do
  for c in /sys/class/nvme/nvme*; do
    [ "$(cat "$c/serial" 2>/dev/null | tr -d ' ')" = pmcache ] && [ -b "/dev/${c##*/}n1" ] && scratch=${c##*/}
  done
  [ -n "$scratch" ] && break
  i=$((i + 1))
  [ $i -le 600 ] || { log "no NVMe drive with serial pmcache after 60 s"; dmesg | tail -n 30; finish 91; }
  sleep 0.1
done
log "${scratch}n1: io_poll=$(cat /sys/block/${scratch}n1/queue/io_poll)" \
  "poll_queues=$(cat /sys/module/nvme/parameters/poll_queues)" \
  "queues: $(dmesg | sed -n "s/.*nvme $scratch: \(.*queues.*\)/\1/p" | tail -n 1)"
mount -t ext4 ${MOUNT_OPTS:+-o "$MOUNT_OPTS"} /dev/${scratch}n1 /mnt/nvme || { log "mount ext4 failed"; dmesg | tail -n 30; finish 92; }
log "ext4 on /dev/${scratch}n1 mounted at /mnt/nvme (${MOUNT_OPTS:-default options}); running: $(tail -n 1 /command.sh)"
export PMCACHE_TEST_DISK_DIR=/mnt/nvme PMCACHE_TEST_SHM_DIR=/tmp
sh /command.sh
rc=$?
cd /
log "command exited with $rc"
finish $rc
EOF
chmod +x "$root/init" "$root/command.sh"

initrd="$tmp/initrd.gz"
(cd "$root" && find . -print0 | cpio --null -o -H newc --quiet | gzip -1) > "$initrd"
say "initramfs: $(du -h "$initrd" | cut -f1) compressed, $(du -sh "$root" | cut -f1) unpacked"

# --- NVMe image ------------------------------------------------------------------------------
# Formatted on the host (same mke2fs defaults as in the guest, far faster than under TCG), with
# the inode tables and journal initialised now so that no ext4lazyinit thread runs in the guest.
img="$tmp/nvme.img"
truncate -s "${disk_mib}M" "$img"
say "mkfs.ext4 on a sparse ${disk_mib} MiB image"
mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 -L pmcache "$img" >&2

# --- boot ------------------------------------------------------------------------------------
log="$tmp/console.log"
# shellcheck disable=SC2206
extra=(${PMCACHE_GUEST_QEMU_ARGS:-})
machine=q35
vhost=()
if ((${#vhost_socks[@]})); then
  # A vhost-user backend reads and writes the guest's buffers itself: the guest's RAM is a
  # memfd shared with it (its fd is passed over the socket).
  machine+=",memory-backend=mem"
  vhost+=(-object "memory-backend-memfd,id=mem,size=${mem}M,share=on")
  for i in "${!vhost_socks[@]}"; do
    [[ "${vhost_socks[$i]}" != *,* ]] || die "--vhost-user-blk: a comma in '${vhost_socks[$i]}'"
    vhost+=(-chardev "socket,id=vub$i,path=${vhost_socks[$i]},reconnect-ms=1000"
      -device "vhost-user-blk-pci,chardev=vub$i,num-queues=$vhost_queues")
  done
fi
qemu=(qemu-system-x86_64 -machine "$machine" -accel tcg -smp "$smp" -m "$mem"
  -display none -monitor none -serial stdio -no-reboot
  -kernel "$kit/vmlinuz" -initrd "$initrd"
  -append "console=ttyS0 quiet panic=-1 rdinit=/init"
  -drive "file=$img,if=none,id=nvm,format=raw,cache=unsafe"
  -device "nvme,serial=pmcache,drive=nvm,logical_block_size=$nvme_lbs,physical_block_size=$nvme_lbs"
  ${vhost[@]+"${vhost[@]}"} ${extra[@]+"${extra[@]}"})
say "booting (timeout ${timeout_s} s): ${qemu[*]}"
start=$SECONDS
set +e
timeout --foreground -k 10 "$timeout_s" "${qemu[@]}" < /dev/null 2>&1 | sed -u 's/\r$//' | tee "$log"
qemu_rc=${PIPESTATUS[0]}
set -e
elapsed=$((SECONDS - start))
code=$(sed -n 's/^PMCACHE_GUEST_EXIT=\([0-9][0-9]*\)$/\1/p' "$log" | tail -n 1)
if [[ -z "$code" ]]; then
  if ((qemu_rc == 124)); then
    say "error: guest timed out after ${timeout_s} s without reporting an exit code"
  else
    say "error: guest stopped (qemu exit code $qemu_rc) without reporting an exit code"
  fi
  exit 125
fi
say "guest command exited with $code (${elapsed} s in the guest, qemu exit code $qemu_rc)"
exit "$code"
