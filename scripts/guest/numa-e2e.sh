#!/usr/bin/env bash
# A cache of two members on a guest of two NUMA nodes: QEMU (TCG) gives the guest of
# run-in-guest.sh two nodes (one CPU and 1 GiB each, 21 apart), and in it one tmpfs per node
# is mounted with `mpol=bind:N` (PM emulated on each socket). `pmcache serve --ublk` runs on a
# set of one medium per node (two ublk queues, each served by a thread on its own CPU), and
# two fio jobs, one pinned to each node's CPU, write their own ranges with their own byte
# pattern. Placement is verified from outside the engine:
#   - each member's pages are on its node: /proc/PID/numa_maps of the server (N<node>= of each
#     member's mapping) and the per-node Shmem of /sys/devices/system/node/node*/meminfo;
#   - each writer's blocks are on its own node's member: the bytes of each pattern counted in
#     each member's file (tr -cd | wc -c);
#   - and the engine's own local/remote counts (`pmcache stats --json`).
# The same again with `--placement interleave`: about half of each writer's blocks land on the
# other node. TCG has no remote-access latency, so this proves placement and counts, not
# speed. Prints `numa-e2e: FIGURES placement=... local_writes_pct=...` lines.
#
#   scripts/guest/numa-e2e.sh
#
# Builds `pmcache` (profile test-opt) and installs fio on the host when missing.
source "$(dirname "$0")/lib.sh"
need_tools fio:fio
build_pmcache test-opt
guest_script numa-e2e
cat > "$script" <<GUEST
set -eu
PM=$exe
B=/mnt/nvme/backing.img
fail() { echo "numa-e2e: FAILED: \$*"; tail -n 40 /tmp/serve*.log 2>/dev/null; exit 1; }
nodes=\$(ls -d /sys/devices/system/node/node[0-9]* | wc -l)
[ "\$nodes" = 2 ] || fail "the guest has \$nodes NUMA nodes, not 2"
echo "numa-e2e: node0 cpus \$(cat /sys/devices/system/node/node0/cpulist)," \\
  "node1 cpus \$(cat /sys/devices/system/node/node1/cpulist)," \\
  "distance \$(cat /sys/devices/system/node/node0/distance)"
for n in 0 1; do
  mkdir -p /mnt/pm\$n
  mount -t tmpfs -o size=96M,mpol=bind:\$n tmpfs /mnt/pm\$n || fail "tmpfs mpol=bind:\$n"
done
shmem() { sed -n 's/.*Shmem: *\([0-9]*\) kB/\1/p' /sys/devices/system/node/node\$1/meminfo; }
dd if=/dev/zero of=\$B bs=1M count=0 seek=256 2>/dev/null
# run PLACEMENT: a fresh set, both writers, every check; prints the figures.
run() {
  placement=\$1
  rm -f /mnt/pm0/cache.pm /mnt/pm1/cache.pm \$B.pmcache-state
  shm0=\$(shmem 0); shm1=\$(shmem 1)
  \$PM serve --ublk --ublk-queues 2 --cache /mnt/pm0/cache.pm@0 --cache /mnt/pm1/cache.pm@1 \\
    --cache-size 64M --backing \$B --control /tmp/pm.ctl --placement \$placement \\
    > /tmp/serve-\$placement.log 2>&1 &
  SERVER=\$!
  i=0; while [ ! -b /dev/ublkb0 ]; do i=\$((i+1)); [ \$i -lt 900 ] || fail "no /dev/ublkb0"; sleep 0.1; done
  grep "NUMA node" /tmp/serve-\$placement.log || true
  # Each member's pages on its node: the server's mappings, and the nodes' shared memory.
  for n in 0 1; do
    line=\$(grep "/mnt/pm\$n/cache.pm" /proc/\$SERVER/numa_maps) || fail "no mapping of member \$n"
    other=\$((1 - n))
    echo "\$line" | grep -q " N\$n=" || fail "member \$n has no page on node \$n: \$line"
    echo "\$line" | grep -q " N\$other=" && fail "member \$n has pages on node \$other: \$line"
    echo "numa-e2e: member \$n mapping: \$(echo "\$line" | grep -o 'N[0-9]*=[0-9]*' | tr '\n' ' ')"
  done
  grew0=\$(( \$(shmem 0) - shm0 )); grew1=\$(( \$(shmem 1) - shm1 ))
  echo "numa-e2e: Shmem grew by \$grew0 kB on node 0 and \$grew1 kB on node 1"
  [ \$grew0 -ge 60000 ] && [ \$grew1 -ge 60000 ] || fail "each node's Shmem should grow by a 64 MiB member"
  # Two writers, one per node, each its own 16 MiB with its own byte ('A' from node 0, 'B'
  # from node 1), at the same time.
  fio --ioengine=psync --direct=1 --rw=write --bs=4k --size=16m --filename=/dev/ublkb0 \\
    --name=node0 --cpus_allowed=0 --offset=0 --buffer_pattern=0x41 \\
    --name=node1 --cpus_allowed=1 --offset=64m --buffer_pattern=0x42 \\
    > /tmp/fio-\$placement.log 2>&1 || { cat /tmp/fio-\$placement.log; fail "fio"; }
  \$PM stats --json --control /tmp/pm.ctl > /tmp/stats-\$placement.json || fail "stats"
  \$PM stats --control /tmp/pm.ctl | tail -n 3
  # Counted on the media themselves: pattern bytes per member, in 4 KiB blocks.
  a0=\$(( \$(tr -cd A < /mnt/pm0/cache.pm | wc -c) / 4096 ))
  a1=\$(( \$(tr -cd A < /mnt/pm1/cache.pm | wc -c) / 4096 ))
  b0=\$(( \$(tr -cd B < /mnt/pm0/cache.pm | wc -c) / 4096 ))
  b1=\$(( \$(tr -cd B < /mnt/pm1/cache.pm | wc -c) / 4096 ))
  local_pct=\$(( 100 * (a0 + b1) / (a0 + a1 + b0 + b1) ))
  echo "numa-e2e: FIGURES placement=\$placement node0_writer_blocks_on_member0=\$a0 on_member1=\$a1" \\
    "node1_writer_blocks_on_member0=\$b0 on_member1=\$b1 local_writes_pct=\$local_pct"
  echo "numa-e2e: engine counts: \$(grep -o '"members":\[[^]]*\]' /tmp/stats-\$placement.json)"
  kill -TERM \$SERVER; wait \$SERVER || fail "serve exited with \$? on SIGTERM"
  [ \$((a0 + a1)) -ge 4000 ] && [ \$((b0 + b1)) -ge 4000 ] || fail "fewer blocks on the media than fio wrote"
  case \$placement in
    local) [ \$((1000 * (a0 + b1) / (a0 + a1 + b0 + b1))) -ge 990 ] || fail "local placement put only \$local_pct % on the writer's node" ;;
    interleave) [ \$local_pct -ge 30 ] && [ \$local_pct -le 70 ] || fail "interleaving put \$local_pct % on the writer's node" ;;
  esac
}
run local
run interleave
echo "numa-e2e: OK"
GUEST

echo "== a cache of two members on a guest of two NUMA nodes"
export PMCACHE_GUEST_QEMU_ARGS="-object memory-backend-ram,id=ram0,size=1G \
  -object memory-backend-ram,id=ram1,size=1G \
  -numa node,nodeid=0,cpus=0,memdev=ram0 -numa node,nodeid=1,cpus=1,memdev=ram1 \
  -numa dist,src=0,dst=1,val=21"
"$here/run-in-guest.sh" --timeout 1200 --mem 2048 --smp 2 --disk-mib 512 ${PMCACHE_GUEST_ARGS:-} \
  --copy "$exe" --copy "$(command -v fio)" --copy "$script" \
  -- sh "$script"
echo "numa-e2e: passed ($((SECONDS - start)) s in all)"
