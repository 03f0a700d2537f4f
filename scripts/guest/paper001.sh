#!/usr/bin/env bash
# Paper 001's NUMA half: `pmcache bench paper 001-fig3-numa` runs inside a QEMU guest (TCG) of
# two NUMA nodes (one CPU and 1 GiB each, 21 apart), with a tmpfs mounted `mpol=bind:N` at
# /mnt/pm/nodeN for each node: a cache member per node, threads pinned to each node's CPU.
# The figures' JSON comes back on the guest's console and is written to OUT (with its SVG and
# PNG drawn on the host). Under TCG a remote access costs what a local one does: the figures
# are shares of local and remote accesses, not speeds.
#
#   scripts/guest/paper001.sh [--scale smallest|small|full] [--runs N] --out DIR
#
# Builds `pmcache` (profile test-opt) and needs python3 on the host.
source "$(dirname "$0")/lib.sh"
paper_args paper001 "$@"
need_tools python3:python3
build_pmcache test-opt
log=$(mktemp "${TMPDIR:-/tmp}/paper001.XXXXXX.log")
on_exit 'rm -f "$log"'
args=(bench paper 001-fig3-numa --scale "$scale" --out /tmp/paper001 --dir /mnt/nvme --pm-dir /mnt/pm
  --bed guest-numa)
[[ -z "$runs" ]] || args+=(--runs "$runs")
guest_script paper001
cat > "$script" <<GUEST
set -eu
for n in 0 1; do
  mkdir -p /mnt/pm/node\$n
  mount -t tmpfs -o size=400M,mpol=bind:\$n tmpfs /mnt/pm/node\$n
done
$exe ${args[*]} || exit 1
for f in /tmp/paper001/*.json; do
  echo "PAPER001-FILE \$(basename "\$f") \$(tr -d '\n' < "\$f")"
done
GUEST
set +e
font=/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf
[[ -f "$font" ]] || { echo "paper001: no $font: install fonts-dejavu-core" >&2; exit 2; }
export PMCACHE_GUEST_QEMU_ARGS="-object memory-backend-ram,id=ram0,size=1G \
  -object memory-backend-ram,id=ram1,size=1G \
  -numa node,nodeid=0,cpus=0,memdev=ram0 -numa node,nodeid=1,cpus=1,memdev=ram1 \
  -numa dist,src=0,dst=1,val=21"
"$here/run-in-guest.sh" --timeout 1800 --mem 2048 --smp 2 --copy "$exe" --copy "$font" \
  --copy "$script" --env "PMCACHE_BENCH_COMMIT=$(git rev-parse --short=7 HEAD)" \
  -- sh "$script" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
((rc == 0)) || { echo "paper001: the guest run failed ($rc)" >&2; exit 1; }
files_from_log paper001 "$log" "$out"
echo "== paper001: done in $((SECONDS - start)) s"
