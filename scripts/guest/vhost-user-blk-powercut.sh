#!/usr/bin/env bash
# Power cuts of a VM whose disk is pmcache's vhost-user-blk disk: QEMU is killed with SIGKILL
# while the guest writes, the server on the host keeps running, and the next VM, booted on
# the same socket, finds every write the server answered.
#
# The host runs `pmcache serve --vhost-user-blk` (a 64 MiB cache in /dev/shm in front of a
# 256 MiB backing file, 2 virtqueues) for the whole run, and boots 4 guests on its socket
# one after the other (run-in-guest.sh --vhost-user-blk: TCG, 512 MiB RAM shared with the
# server, 2 vCPUs; the disk is /dev/vda):
#
#   boot 1        writes, then the power cut
#   boots 2, 3    verify the cut before, write, then the power cut
#   boot 4        verifies the third cut and shuts down
#
# Writes: 4 writers in the guest, each over its own 16 of the disk's first 64 blocks of
# 4 KiB, one write at a time (busybox dd oflag=direct) at a random block of its range, so
# blocks are overwritten and 4 requests may be in flight at once; one write in four covers
# 2 to 4 blocks. Every block written holds one 32-byte line naming the block and the write's
# sequence number (unique in the run), 128 times over. Before each write the writer prints
# `START <block> <seq> <blocks>` on the console and waits for the console to have sent it
# (stty's TCSADRAIN), so the host has seen it before the request can reach the server; after
# the write returns it prints `ACK <block> <seq> <blocks>`. The console log is on the host.
#
# The cut: the host watches the console and, after a random number of ACKs (100 to 199),
# kills qemu-system-x86_64 with SIGKILL (its pid from QEMU's -pidfile). The server must still
# run, must have logged no error or warning, and `pmcache stats --json` must count at least
# the blocks of the writes ACKed and no request answered with an error.
#
# Verify: the next guest reads each of the 64 blocks (O_DIRECT) and prints its md5sum and its
# distinct lines. The host checks each against its model of boot 1 to the cut: a block must
# hold the last write ACKed there (zeroes if none), or a write to it whose START was printed
# after that ACK (in flight at the cut: it may or may not have landed), whole, and nothing
# else (a torn block, mixing writes, fails). What it found is then the block's only accepted
# content until it is written again (a read after recovery is stable).
#
# Last: SIGTERM stops the server, which must exit 0 and say the cache is marked clean (its
# medium is volatile: the stop writes every dirty block back), and the host reads the 64
# blocks from the backing file itself: each must hold what the last guest found.
#
#   scripts/guest/vhost-user-blk-powercut.sh
#
# Builds `pmcache` (profile test-opt; PMCACHE_BIN=path runs that binary instead) and installs
# python3 on the host when missing. Arguments for run-in-guest.sh can be given in
# PMCACHE_GUEST_ARGS. A run takes about a minute (4 TCG boots of about 10 s, and a few
# seconds of writes in each of the first 3). It exits 1 on a failure, naming what failed,
# and keeps the consoles, the server's log and the model of the disk in a directory it names.
source "$(dirname "$0")/lib.sh"
need_tools python3:python3
build_pmcache test-opt
cuts=3
queues=2
work=$(mktemp -d /dev/shm/vhost-user-blk-powercut.XXXXXX)
cache=$work/cache.pm
img=$work/backing.img
sock=$work/vub.sock
ctl=$work/cache.pm.ctl
qemu_pid_file=$work/qemu.pid
model=$work/model.json
truncate -s 256M "$img"

server=
guest=
shown=
# qemu_pid: the pid of the running guest's qemu-system-x86_64 (from its -pidfile), or nothing.
qemu_pid() {
  local pid
  pid=$(cat "$qemu_pid_file" 2>/dev/null) || return 0
  [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == qemu-system-x86* ]] && echo "$pid"
  return 0
}
cleanup() {
  local pid i=0
  # A guest still booting: its QEMU, once it has written its pid file (60 s at most).
  while [[ -n "$guest" ]] && kill -0 "$guest" 2>/dev/null && ((i++ < 300)); do
    pid=$(qemu_pid)
    [[ -z "$pid" ]] || kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
  done
  if [[ -n "$guest" ]]; then wait "$guest" 2>/dev/null || true; fi
  if [[ -n "$shown" ]]; then wait "$shown" 2>/dev/null || true; fi
  if [[ -n "$server" ]]; then kill -KILL "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
on_exit cleanup

failures=()
# finish: prints the failures (and the server's log) and exits 1, or says it passed.
finish() {
  if ((${#failures[@]})); then
    for f in "${failures[@]}"; do echo "vhost-user-blk-powercut: FAILED: $f"; done
    echo "-- server log"; tail -n 30 "$work/server.log"
    keep=$(mktemp -d "${TMPDIR:-/tmp}/vhost-user-blk-powercut.XXXXXX")
    cp "$work"/*.log "$work"/*.err "$work"/*.json "$keep"/ 2>/dev/null || true
    echo "vhost-user-blk-powercut: the consoles, the server's log and the model are kept in $keep"
    exit 1
  fi
  echo "vhost-user-blk-powercut: passed ($((SECONDS - start)) s in all)"
}

# The server, exec'd so that $server is its own pid.
server_cmd() {
  exec "$exe" serve --cache "$cache" --cache-size 64M --backing "$img" \
    --vhost-user-blk "$sock" --vhost-queues "$queues" --control "$ctl"
}
server_cmd > "$work/server.log" 2>&1 &
server=$!
i=0
until [[ -S "$sock" ]]; do
  if ! kill -0 "$server" 2>/dev/null || ((++i > 300)); then
    tail -n 20 "$work/server.log" >&2
    echo "vhost-user-blk-powercut: the server did not listen on $sock" >&2
    exit 1
  fi
  sleep 0.1
done
echo "== pmcache serve --vhost-user-blk (pid $server, socket $sock)"
sed 's/^/  /' "$work/server.log"

guest_script vhost-user-blk-powercut
cat > "$script" <<'GUEST'
set -eu
# Set by the host: VERIFY=1 to check the blocks first; SEQ, the first sequence number of this
# boot's writes (none: no writes).
NBLK=64 WRITERS=4 SPAN=16
fail() { echo "vhost-user-blk-powercut: FAILED: $*"; dmesg | tail -n 20; exit 1; }
i=0; while [ ! -b /dev/vda ]; do i=$((i+1)); [ $i -lt 300 ] || fail "no /dev/vda"; sleep 0.1; done
echo "vhost-user-blk-powercut: /dev/vda: $(($(cat /sys/block/vda/size) / 2048)) MiB," \
  "$(ls /sys/block/vda/mq | wc -l) request queues, $(cat /sys/block/vda/queue/logical_block_size) B blocks," \
  "write cache: $(cat /sys/block/vda/queue/write_cache)"
if [ "${VERIFY:-0}" = 1 ]; then
  # BLOCK <block> <md5sum> <its distinct lines, counted; a run of NULs shown as @>
  b=0
  while [ $b -lt $NBLK ]; do
    dd if=/dev/vda of=/tmp/block bs=4096 skip=$b count=1 iflag=direct 2>/tmp/dd.err || { cat /tmp/dd.err; fail "read of block $b"; }
    sum=$(md5sum < /tmp/block)
    lines=$(tr -s '\000' @ < /tmp/block | sort | uniq -c | sed 's/^ *//' | tr '\n' ';')
    echo "BLOCK $b ${sum%% *} $lines"
    b=$((b+1))
  done
  echo "POWERCUT-VERIFIED"
fi
[ -n "${SEQ:-}" ] || exit 0

# writer W: writes forever (until the power cut) over blocks W*SPAN .. W*SPAN+SPAN-1; its
# sequence numbers are SEQ+W, SEQ+W+WRITERS, ...
ones=$(seq 128)
writer() {
  w=$1 s=$((SEQ + $1))
  RANDOM=$(($(date +%s) + SEQ + w)) # a sequence of its own
  while :; do
    n=1
    [ $((RANDOM % 4)) != 0 ] || n=$((2 + RANDOM % 3))
    b=$((w * SPAN + RANDOM % (SPAN - n + 1)))
    : > /tmp/data$w
    j=0
    while [ $j -lt $n ]; do
      line=$(printf 'blk%06d seq%09d powercut' $((b + j)) $s)
      printf "$line\\n%.0s" $ones >> /tmp/data$w
      j=$((j+1))
    done
    echo "START $b $s $n"
    stty -F /dev/console -ixon # returns once the console has sent every byte (TCSADRAIN)
    dd if=/tmp/data$w of=/dev/vda bs=4096 seek=$b count=$n oflag=direct conv=notrunc 2>/tmp/dd$w.err ||
      { cat /tmp/dd$w.err; fail "write of $n blocks at $b (seq $s)"; }
    echo "ACK $b $s $n"
    s=$((s + WRITERS))
  done
}
echo "POWERCUT-WRITING"
w=0
while [ $w -lt $WRITERS ]; do writer $w & w=$((w+1)); done
wait
fail "the writers stopped"
GUEST

# check_boot N: checks boot N's console log against the model of the disk ($model) and
# updates it: the blocks it verified, then the writes it started and those it ACKed. Prints
# the counts; fails on a block that holds anything else than the model accepts.
check_boot() {
  python3 - "$model" "$work/console.$1.log" "$1" <<'PY'
import hashlib, json, os, re, sys
model_path, log, boot = sys.argv[1], sys.argv[2], int(sys.argv[3])
NBLK = 64

def content(block, cand):
    if cand == "zero":
        return bytes(4096)
    line = b"blk%06d seq%09d powercut\n" % (block, cand)
    assert len(line) == 32
    return line * 128

def md5(block, cand):
    return hashlib.md5(content(block, cand)).hexdigest()

def name(block, cand):
    return "zeroes" if cand == "zero" else f"seq {cand}"

if os.path.exists(model_path):
    model = json.load(open(model_path))
else:
    # Per block: its accepted contents, the first the last ACKed write (or what the last
    # verify found), the others writes STARTed after it.
    model = {"blocks": [["zero"] for _ in range(NBLK)], "acked": 0, "acked_block_writes": 0,
             "acked_blocks": [],
             "checked": 0, "last": 0, "later": 0, "failed": 0}
blocks = model["blocks"]
acked_blocks = set(model["acked_blocks"])
failures = []
verified = started = acked = 0
checked = last = later = 0
pending = {}
text = open(log, encoding="utf-8", errors="replace").read().split("\n")
# The last line, unless empty, is one the power cut stopped on its way: a START not sent
# whole, so its write was never issued (the writer waits for the console to send it first).
if text[-1]:
    print(f"vhost-user-blk-powercut: boot {boot}: a line cut short by the power cut: {text[-1]!r}")
for line in text[:-1]:
    if line.startswith("BLOCK "):
        m = re.fullmatch(r"BLOCK (\d+) ([0-9a-f]{32}) (.*)", line)
        if not m:
            failures.append(f"malformed line: {line!r}")
            continue
        b, found, lines = int(m[1]), m[2], m[3]
        verified += 1
        checked += 1
        hit = [c for c in blocks[b] if md5(b, c) == found]
        if not hit:
            failures.append(f"block {b} holds none of the writes it may hold: expected "
                            + " or ".join(name(b, c) for c in blocks[b])
                            + f" (md5 " + ", ".join(md5(b, c) for c in blocks[b])
                            + f"), found md5 {found}, lines (count text;) {lines}")
            continue
        if hit[0] == blocks[b][0]:
            last += 1
        else:
            later += 1
            print(f"vhost-user-blk-powercut: block {b}: the write in flight at the cut "
                  f"({name(b, hit[0])}) landed, after the last ACKed ({name(b, blocks[b][0])})")
        blocks[b] = [hit[0]]
    elif line.startswith(("START ", "ACK ")):
        m = re.fullmatch(r"(START|ACK) (\d+) (\d+) (\d+)", line)
        if not m:
            failures.append(f"malformed line: {line!r}")
            continue
        what, b, s, n = m[1], int(m[2]), int(m[3]), int(m[4])
        if not (0 <= b and n >= 1 and b + n <= NBLK):
            failures.append(f"a write out of range: {line!r}")
            continue
        if what == "START":
            started += 1
            pending[s] = (b, n)
            for x in range(b, b + n):
                blocks[x].append(s)
        else:
            if pending.pop(s, None) != (b, n):
                failures.append(f"an ACK without its START: {line!r}")
                continue
            acked += 1
            model["acked_block_writes"] += n
            for x in range(b, b + n):
                blocks[x] = [s]
                acked_blocks.add(x)
if verified and verified != NBLK:
    failures.append(f"boot {boot} verified {verified} blocks, not {NBLK}")
if verified:
    print(f"vhost-user-blk-powercut: boot {boot} verified the cut before it: {checked} blocks "
          f"checked ({sum(1 for b in range(NBLK) if b in model['acked_blocks'])} ever ACKed), "
          f"{last} holding the last write ACKed there (or, not written since, what they held "
          f"before), {later} holding a later write in flight at the cut, {len(failures)} failures")
if started:
    print(f"vhost-user-blk-powercut: boot {boot} started {started} writes, {acked} ACKed; "
          f"{len(pending)} in flight at the cut (START, no ACK): "
          + (", ".join(f"seq {s} at block {b} ({n} blocks)" for s, (b, n) in sorted(pending.items()))
             or "none"))
model["acked"] += acked
model["acked_blocks"] = sorted(acked_blocks)
model["checked"] += checked
model["last"] += last
model["later"] += later
model["failed"] += len(failures)
json.dump(model, open(model_path, "w"))
for f in failures:
    print(f"vhost-user-blk-powercut: FAILED: {f}")
sys.exit(1 if failures else 0)
PY
}

# boot N VERIFY SEQ: boots guest N on the server's socket in the background; sets guest. Its
# console is $work/console.N.log, what run-in-guest.sh and QEMU say $work/console.N.err (so
# that the console's last line, cut short by a power cut, stays as the guest sent it); both
# shown here, but for the console's START, ACK and BLOCK lines.
boot() {
  local n=$1
  rm -f "$qemu_pid_file"
  : > "$work/console.$n.log"
  : > "$work/console.$n.err"
  PMCACHE_GUEST_QEMU_ARGS="-pidfile $qemu_pid_file ${PMCACHE_GUEST_QEMU_ARGS:-}" \
    "$here/run-in-guest.sh" --timeout 300 --mem 512 --smp 2 --disk-mib 64 ${PMCACHE_GUEST_ARGS:-} \
    --vhost-user-blk "$sock" --vhost-queues "$queues" --env "VERIFY=$2" --env "SEQ=$3" \
    --copy "$script" -- sh "$script" > "$work/console.$n.log" 2> "$work/console.$n.err" &
  guest=$!
  tail -q -n +1 -f --pid="$guest" "$work/console.$n.err" "$work/console.$n.log" |
    grep --line-buffered -vE '^(START|ACK|BLOCK) ' &
  shown=$!
}
# wait_guest: waits for the guest's run-in-guest.sh (and the console shown); sets guest_rc.
wait_guest() {
  set +e
  wait "$guest"
  guest_rc=$?
  set -e
  wait "$shown" 2>/dev/null || true
  guest= shown=
}
server_alive() { # server_alive WHEN: fails unless the server runs and has logged no error
  local said
  kill -0 "$server" 2>/dev/null || { failures+=("the server is gone $1"); return 1; }
  said=$(grep -iE 'error|warn|panic' "$work/server.log" || true)
  [[ -z "$said" ]] || { failures+=("the server logged errors or warnings $1: $said"); return 1; }
}
stats_line() { # stats_line: some of the server's counters (`pmcache stats --json`); fails
  # on a request answered with an error, or fewer blocks written than the guests saw ACKed
  "$exe" stats --control "$ctl" --json | python3 -c '
import json, sys
s, acked = json.load(sys.stdin), json.load(open(sys.argv[1]))["acked_block_writes"]
print(", ".join(f"{k} {s[k]}" for k in ("writes", "dirty_slots", "vhost_connections",
                                       "vhost_requests", "vhost_request_errors"))
      + f" (blocks of the writes ACKed so far: {acked})")
if s["vhost_request_errors"]:
    sys.exit("the server answered requests with an error")
written = s["writes"]
if written < acked:
    sys.exit(f"the server counts {written} blocks written, fewer than the {acked} ACKed")' "$model"
}

for ((round = 1; round <= cuts + 1; round++)); do
  if ((round <= cuts)); then
    what="write until power cut $round"
    ((round == 1)) || what="verify cut $((round - 1)), then $what"
    echo "== boot $round: $what"
    boot "$round" "$((round > 1 ? 1 : 0))" "$((round * 1000000))"
  else
    echo "== boot $round: verify cut $cuts"
    boot "$round" 1 ""
  fi
  if ((round <= cuts)); then
    acks_wanted=$((100 + RANDOM % 100))
    console=$work/console.$round.log
    cut=
    while kill -0 "$guest" 2>/dev/null; do
      if (($(grep -c '^ACK ' "$console") >= acks_wanted)); then
        sleep "0.$((RANDOM % 10))"
        pid=$(qemu_pid)
        if [[ -z "$pid" ]]; then failures+=("boot $round: no qemu-system-x86_64 to kill"); break; fi
        kill -KILL "$pid"
        cut=1
        echo "vhost-user-blk-powercut: host: power cut $round: kill -KILL of qemu-system-x86_64" \
          "(pid $pid) after $(grep -c '^ACK ' "$console") ACKs (wanted $acks_wanted or more)"
        break
      fi
      sleep 0.05
    done
    wait_guest
    [[ -n "$cut" ]] || failures+=("boot $round ended (exit code $guest_rc) before the power cut")
    ((guest_rc != 0)) || failures+=("boot $round exited 0 after its power cut")
  else
    wait_guest
    ((guest_rc == 0)) || failures+=("boot $round exited with $guest_rc")
  fi
  grep -q '^vhost-user-blk-powercut: FAILED' "$work/console.$round.log" &&
    failures+=("boot $round: $(grep '^vhost-user-blk-powercut: FAILED' "$work/console.$round.log" | head -n 1)")
  ((round == 1)) || grep -q '^POWERCUT-VERIFIED$' "$work/console.$round.log" ||
    failures+=("boot $round did not verify the blocks")
  check_boot "$round" || failures+=("boot $round: blocks of the disk do not hold what was written (above)")
  if server_alive "after boot $round"; then
    if stats=$(stats_line 2>&1); then
      echo "vhost-user-blk-powercut: host: the server still runs (pid $server), no error logged; stats: $stats"
    else
      failures+=("pmcache stats after boot $round: $stats")
    fi
  fi
  ((${#failures[@]} == 0)) || finish
done

echo "== SIGTERM of the server, then the backing file checked on the host"
kill -TERM "$server"
set +e
wait "$server"
server_rc=$?
set -e
server=
echo "vhost-user-blk-powercut: the server exited with $server_rc: $(grep -o 'cache marked clean.*' "$work/server.log" | head -n 1)"
((server_rc == 0)) || failures+=("the server exited with $server_rc after SIGTERM")
grep -q 'cache marked clean' "$work/server.log" || failures+=("the server did not say the cache is marked clean")
[[ ! -e "$sock" ]] || failures+=("the server left its socket $sock")
python3 - "$model" "$img" <<'PY' || failures+=("the backing file does not hold what the last guest found")
import json, sys
model, img = json.load(open(sys.argv[1])), sys.argv[2]
bad = 0
with open(img, "rb") as f:
    for b, cands in enumerate(model["blocks"]):
        assert len(cands) == 1, (b, cands)
        c = cands[0]
        want = bytes(4096) if c == "zero" else b"blk%06d seq%09d powercut\n" % (b, c) * 128
        f.seek(b * 4096)
        got = f.read(4096)
        if got != want:
            bad += 1
            lines = sorted(set(got.split(b"\n")))[:4]
            print(f"vhost-user-blk-powercut: FAILED: backing file block {b}: expected "
                  f"{'zeroes' if c == 'zero' else f'seq {c}'}, found lines {lines}")
print(f"vhost-user-blk-powercut: backing file: {len(model['blocks']) - bad} of "
      f"{len(model['blocks'])} blocks hold what the last guest read")
sys.exit(1 if bad else 0)
PY
python3 - "$model" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
print(f"vhost-user-blk-powercut: totals: {m['acked']} writes ACKed, {m['checked']} blocks "
      f"checked, {m['last']} holding the last write ACKed there (or, not written since, what "
      f"they held before), {m['later']} holding a later write in flight at a cut, "
      f"{m['failed']} failures")
PY
finish
