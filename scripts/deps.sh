#!/usr/bin/env bash
# The system packages pmcache's tests and benches use (Debian's names), in one list that
# `scripts/test.sh` and `.ci/run` both read.
#
#   scripts/deps.sh missing   prints the packages not installed, one line, space-separated
#   scripts/deps.sh install   installs them all with apt-get (as root), saying so first
#   scripts/deps.sh line      prints the one command that installs them all
#
# fio (the NBD and engine tests and benches; the concurrent writer of scripts/db/kill-suite.py),
# libnbd-bin (nbdinfo, nbdcopy, nbdfuse), nbdkit (the baseline NBD server; its error filter is
# the failing backing store of scripts/db/kill-suite.py), qemu-utils (qemu-io, qemu-img);
# libssl-dev and pkg-config (the openssl crate: NBD TLS-PSK), openssl (the TLS tests' and
# bench's certificates); mount (losetup: the backing conformance tests attach loop devices);
# libclang-dev (bindgen in libublk-rs-sys: the `ublk` feature's kernel bindings);
# busybox-static, cpio and e2fsprogs for the QEMU guests; fonts-dejavu-core (the text of `bench
# paper`'s pictures); ceph-mon, ceph-osd and ceph-common (the throwaway cluster of
# scripts/ceph/cluster.sh that the RBD tests start; ceph-common brings librbd1, which the rbd:
# backing store loads at run time, and the rbd tool); postgresql and sqlite3
# (scripts/db/kill-suite.py: the databases on ext4 over pmcache).
# scripts/guest/run-in-guest.sh installs QEMU's system emulator itself, at the installed
# qemu-utils' version, and downloads its guest kernel.
set -euo pipefail

packages=(fio libnbd-bin nbdkit qemu-utils libssl-dev pkg-config openssl mount libclang-dev
  busybox-static cpio e2fsprogs fonts-dejavu-core ceph-mon ceph-osd ceph-common postgresql sqlite3)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

missing() {
  local p out=()
  if ! command -v dpkg-query >/dev/null 2>&1; then
    # Not a Debian system: nothing can be checked by package name; every name is reported.
    echo "${packages[*]}"
    return
  fi
  for p in "${packages[@]}"; do installed "$p" || out+=("$p"); done
  echo "${out[*]}"
}

case "${1:-}" in
  missing) missing ;;
  line) echo "apt-get update && apt-get install -y ${packages[*]}" ;;
  install)
    echo "deps: installing with apt-get: ${packages[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q "${packages[@]}" >/dev/null
    ;;
  *) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
