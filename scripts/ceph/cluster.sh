#!/usr/bin/env bash
# A throwaway single-host Ceph cluster for pmcache's RBD tests and benches: one monitor, one
# OSD (BlueStore on a sparse file), pool `rbd` of size 1, no authentication, bound to loopback,
# everything under one directory. No containers, no systemd, no manager daemon (RBD I/O does
# not need one). Debian's ceph-mon, ceph-osd and ceph-common provide the programs
# (scripts/deps.sh lists them).
#
#   scripts/ceph/cluster.sh start DIR   makes DIR (which must not exist), starts the cluster
#                                       there, waits until pool `rbd` takes I/O, and prints
#                                       `CEPH_CONF=DIR/ceph.conf`
#   scripts/ceph/cluster.sh stop DIR    stops the daemons started in DIR and removes DIR
#   scripts/ceph/cluster.sh osd-stop DIR | osd-start DIR
#                                       stops (SIGSTOP-free: the process exits) or restarts the
#                                       OSD, for the fault tests
#
# The monitor listens on a free port of 127.0.0.1 picked at start, so clusters in several
# directories run side by side. Memory: the OSD's target is 1 GiB (Ceph's default is 4 GiB)
# and the sparse block file is 8 GiB by default (PMCACHE_CEPH_OSD_GIB), holding only what is
# written.
set -euo pipefail

die() { echo "ceph/cluster.sh: $*" >&2; exit 1; }

free_port() {
  python3 - <<'EOF'
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
EOF
}

pid_alive() { [[ -f "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Waits up to $2 seconds for the command in $1 to succeed.
wait_for() {
  local what=$1 secs=$2 i
  for ((i = 0; i < secs * 10; i++)); do
    if eval "$what" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  return 1
}

stop_daemon() {
  local pidfile=$1 i
  pid_alive "$pidfile" || return 0
  local pid
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
}

start_osd() {
  local dir=$1
  ceph-osd -c "$dir/ceph.conf" -i 0 2>>"$dir/log/osd.0.stderr" \
    || die "ceph-osd did not start (see $dir/log/osd.0.log)"
  wait_for "[[ -f $dir/run/osd.0.pid ]]" 30 || die "ceph-osd wrote no pid file"
  wait_for "ceph -c $dir/ceph.conf osd dump --format json | grep -q '\"up\":1'" 60 \
    || die "osd.0 did not come up (see $dir/log/osd.0.log)"
}

start() {
  local dir=$1
  [[ -e "$dir" ]] && die "$dir exists: give a directory to create"
  for p in ceph-mon ceph-osd monmaptool ceph rbd python3; do
    command -v "$p" >/dev/null || die "$p is not installed: $(bash "$(dirname "$0")/../deps.sh" line)"
  done
  mkdir -p "$dir"/{mon,osd/0,run,log}
  dir=$(cd "$dir" && pwd)
  local fsid port osd_uuid
  fsid=$(cat /proc/sys/kernel/random/uuid)
  osd_uuid=$(cat /proc/sys/kernel/random/uuid)
  port=$(free_port)
  cat >"$dir/ceph.conf" <<EOF
[global]
fsid = $fsid
mon_host = v2:127.0.0.1:$port
public_addr = 127.0.0.1
ms_bind_msgr1 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
run_dir = $dir/run
pid_file = $dir/run/\$name.pid
crash_dir = $dir/crash
mon_data = $dir/mon/\$name
osd_data = $dir/osd/\$id
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_warn_on_pool_no_redundancy = false
# The monitor's store is a few MiB; a host disk at 95 % must not stop a throwaway cluster.
mon_data_avail_crit = 1
mon_data_avail_warn = 2
osd_objectstore = bluestore
bluestore_block_path = $dir/osd/0/block.file
bluestore_block_create = true
bluestore_block_size = $(( ${PMCACHE_CEPH_OSD_GIB:-8} << 30 ))
bluestore_fsck_on_mkfs = false
osd_memory_target = 1073741824
osd_op_num_shards = 2
osd_op_num_threads_per_shard = 1
mon_osd_down_out_interval = 0
mon_osd_report_timeout = 600
osd_heartbeat_grace = 600
rbd_default_features = 61
osd_client_watch_timeout = 10
[mon]
admin_socket = $dir/run/\$name.asok
log_file = $dir/log/\$name.log
mon_cluster_log_file = $dir/log/\$cluster.\$channel.log
[osd]
admin_socket = $dir/run/\$name.asok
log_file = $dir/log/\$name.log
[client]
admin_socket =
log_file = $dir/log/\$name.\$pid.log
EOF
  monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$port]" "$dir/monmap" >/dev/null
  ceph-mon -c "$dir/ceph.conf" --mkfs -i a --monmap "$dir/monmap" \
    || die "ceph-mon --mkfs failed"
  ceph-mon -c "$dir/ceph.conf" -i a || die "ceph-mon did not start (see $dir/log/mon.a.log)"
  wait_for "ceph -c $dir/ceph.conf --connect-timeout 2 mon stat" 30 \
    || die "the monitor does not answer (see $dir/log/mon.a.log)"
  local id
  id=$(ceph -c "$dir/ceph.conf" osd new "$osd_uuid") || die "ceph osd new failed"
  [[ "$id" == 0 ]] || die "ceph osd new gave id $id, not 0"
  ceph-osd -c "$dir/ceph.conf" -i 0 --mkfs --osd-uuid "$osd_uuid" >"$dir/log/osd-mkfs.log" 2>&1 \
    || die "ceph-osd --mkfs failed (see $dir/log/osd-mkfs.log)"
  start_osd "$dir"
  ceph -c "$dir/ceph.conf" osd pool create rbd 8 8 >/dev/null 2>&1 || die "pool create failed"
  rbd -c "$dir/ceph.conf" pool init rbd || die "rbd pool init failed"
  # I/O works once the pool's placement groups are active.
  wait_for "rbd -c $dir/ceph.conf create --size 1M rbd/probe && rbd -c $dir/ceph.conf rm rbd/probe" 60 \
    || die "pool rbd takes no I/O (see $dir/log)"
  echo "CEPH_CONF=$dir/ceph.conf"
}

stop() {
  local dir=$1
  [[ -f "$dir/ceph.conf" ]] || die "$dir holds no cluster (no ceph.conf)"
  stop_daemon "$dir/run/osd.0.pid"
  stop_daemon "$dir/run/mon.a.pid"
  rm -rf "$dir"
}

case "${1:-}" in
  start) [[ $# == 2 ]] || die "usage: $0 start DIR"; start "$2" ;;
  stop) [[ $# == 2 ]] || die "usage: $0 stop DIR"; stop "$2" ;;
  osd-stop) [[ $# == 2 ]] || die "usage: $0 osd-stop DIR"; stop_daemon "$2/run/osd.0.pid" ;;
  osd-start) [[ $# == 2 ]] || die "usage: $0 osd-start DIR"; start_osd "$2" ;;
  *) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
