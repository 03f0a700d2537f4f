#!/usr/bin/env python3
"""SQLite or PostgreSQL on ext4 over pmcache (serve on a unix socket -> nbdfuse -> loop -> ext4),
faults at random moments while a client commits numbered transactions, each round ending with
the server killed with SIGKILL; after each, the server restarted, the file system mounted again
and the database recovered and checked.

Each transaction inserts a row (n, amount) and adds amount to a running total in another
table; the client records n once COMMIT returned (SQLite: journal_mode=WAL, synchronous=FULL;
PostgreSQL: initdb --data-checksums, fsync=on, synchronous_commit=on, run as user postgres on
a unix socket, killed with the server). A transaction that fails is recorded too, and the
client reconnects and goes on with the next n. After each round: the server is restarted on
the same cache, the file system mounted again (ext4 replays its journal), the database started
(PostgreSQL recovers from its WAL) and checked with its own oracles: PRAGMA integrity_check or
pg_amcheck --heapallindexed passes, every acknowledged n is there, and the running total equals
the sum of the rows (no half-applied transaction); fsck.ext4 -fn at the end of each run.

The faults (--fault); each kind runs on a bed built for it (a run: one database, one mode, one
kind, its rounds one after the other on the same cache, file system and database):
  kill         the server is killed 0.5-2 s into the round (64 MiB cache, backing file).
  backing-eio  the backing store is nbdkit's error filter on a file, exported on a unix socket
               and mounted as a file with nbdfuse, given to `serve --backing` (which opens it
               with O_DIRECT; its default engine, io_uring, serves it as psync does). 0.5-1.5 s
               into the round the filter fails every read and write (not flushes: it cannot)
               with EIO for 1-3 s, then the store recovers; the client goes on for 0.5-1.5 s,
               `pmcache flush` writes every dirty block back, and the server is killed. The
               cleaner runs with target_pct=0, so that it writes back whatever is dirty and
               meets the failing store in every round. Printed: the requests nbdkit failed, the
               failures and failed write-back batches `pmcache stats` counted, the dirty blocks
               at the end of the window and the blocks written back after it, the flush's
               outcome, the server's and PostgreSQL's log lines, the errors ext4 met, and the
               client's commits acknowledged and failed while the store failed and after. The
               server's log must say the store failing in a round with failed operations, and
               ok again where `stats` says so after the flush (in write-through and
               write-around ext4 stops writing after its journal aborts, nothing reaches the
               store after the fault, and the store stays `failing`: its last write failed).
               What recovers, and when: in write-back the writes land in the cache and the
               cleaner retries its write-back once the store is back (the database should not
               notice); in write-through and write-around the writes fail to the file system,
               so commits fail (SQLite: disk I/O error; PostgreSQL: PANIC on its WAL's fsync,
               then its own crash recovery) and ext4 may abort its journal and refuse every
               later write until it is mounted again. The checks apply after the round's
               recovery: the server restarted, ext4 mounted again (replaying its journal), the
               database recovered.
  cleaner      a 16 MiB cache under a database of more than three times that (a filler table;
               each transaction also rewrites a random filler row), and fio writing 64 KiB
               O_DIRECT random blocks into a file of twice the cache on the same file system,
               which keeps the cache full of dirty blocks in write-back; the server is killed
               2-4 s into the round. Printed: `pmcache stats` just before the kill (the dirty
               share, the cleaner's phase, its write-back rate over the last half second, and
               its counters over the round) and the cleaner's phase sampled every 0.25 s.
  all          the three, one run after the other. KIND:N gives a kind its own round count.

At the end: a table of fault kind x database x mode (+data-crc) -> rounds, commits acknowledged,
verified, lost, integrity errors, transactions that failed to the client in the fault window
and outside it, rounds in which ext4 met errors; what the backing-eio and cleaner rounds met;
each run's fsck verdict ('clean'; 'error-flag': no problem found, but the superblock carries
the error flag ext4 set when the store failed under it, with all fsck said; or 'problems');
the same as one JSON line (and in --json FILE). The exit status is 1 if an acknowledged commit
was lost, a database check failed, fsck found a problem, the flush after a backing-store fault
failed, or a run could not go on. A run that fails keeps its directory (logs, backing file).

  scripts/db/kill-suite.py --pmcache PATH [--db sqlite|postgres|sqlite,postgres]
      [--mode MODE] [--data-crc] [--modes write-back,write-through,write-around,data-crc]
      [--fault kill|backing-eio|cleaner|all|KIND:N,...] [--rounds N] [--engine ENGINE]
      [--seed N] [--json FILE] [--keep] [--long]

--modes takes MODE, MODE+data-crc, or data-crc (write-back with --data-crc). The long suite:
  scripts/db/kill-suite.py --pmcache PATH --long
which is --db sqlite,postgres --modes write-back,write-through,write-around,data-crc
--fault all --rounds 9: 216 rounds, each ending with a kill -9 (docs/TESTING.md has its time
and figures).

Needs root (loop devices, mounts), nbdfuse (libnbd-bin), nbdkit, fio, mkfs.ext4; PostgreSQL.
"""
import sys
sys.dont_write_bytecode = True  # no __pycache__ beside the scripts

import argparse, os, random, shutil, signal, subprocess, tempfile, time, traceback
from bed import Bed, Dirtier
from databases import PG_BIN, Postgres, Sqlite
from report import LEGEND, Tally

KINDS = ("kill", "backing-eio", "cleaner")
CLEANER_CACHE = 16 << 20
FILLER_ROWS = {"sqlite": 80000, "postgres": 70000}  # each > 3x the cleaner's cache

def parse_modes(text):
    """write-back, write-through, write-around; data-crc = write-back with --data-crc;
    MODE+data-crc."""
    out = []
    for item in text.split(","):
        item = item.strip()
        mode, _, crc = item.partition("+")
        if mode == "data-crc":
            mode, crc = "write-back", "data-crc"
        if crc not in ("", "data-crc"):
            sys.exit(f"kill-suite: unknown mode {item!r}")
        out.append((mode, bool(crc)))
    return out

def parse_faults(text, rounds):
    out = []
    for item in text.split(","):
        kind, _, n = item.strip().partition(":")
        kinds = KINDS if kind == "all" else (kind,)
        for k in kinds:
            if k not in KINDS:
                sys.exit(f"kill-suite: unknown fault {k!r} (kill, backing-eio, cleaner, all)")
            out.append((k, int(n) if n else rounds))
    return out

def mib(n):
    return f"{n / (1 << 20):.1f} MiB"

def read_acked(path):
    """{n: time acknowledged}"""
    out = {}
    for line in open(path):
        f = line.split()
        if f:
            out[int(f[0])] = float(f[1]) if len(f) > 1 else 0.0
    return out

def read_failed(path):
    return [(int(f[0]), float(f[1]), f[2] if len(f) > 2 else "")
            for f in (l.rstrip("\n").split("\t", 2) for l in open(path)) if f[0]]

def log_lines(text, limit=3):
    """The server's warnings and errors in a piece of its log: count and the first few."""
    lines = [l for l in text.splitlines()
             if " WARN " in l or " ERROR " in l or l.startswith("pmcache: warning:")]
    return len(lines), [l[:260] for l in lines[:limit]]

def health_lines(text):
    """What the server's log said of the backing store's health: (said it failing, said it ok
    again)."""
    lines = [l for l in text.splitlines() if l.startswith(("pmcache: warning: backing store",
                                                           "pmcache: backing store"))]
    failing = any(" is failing: " in l or " cannot be reached: " in l for l in lines)
    return failing, any(" is ok again" in l for l in lines)

# The faults: each runs while the client commits and returns what it saw; the caller kills the
# server when it returns.

def fault_kill(bed, ctx):
    time.sleep(random.uniform(0.5, 2.0))
    return {}

def fault_backing_eio(bed, ctx):
    time.sleep(random.uniform(0.5, 1.5))
    s0 = bed.stats()
    _, at = bed.injected()
    bed.fault(True); t_on = time.time()
    time.sleep(random.uniform(1.0, 3.0))
    s1 = bed.stats()
    bed.fault(False); t_off = time.time()
    injected, _ = bed.injected(at)
    time.sleep(random.uniform(0.5, 1.5))
    s2 = bed.stats(); t_flush = time.time()
    ext4 = bed.ext4_live()
    ext4_new = ext4["errors"] - ctx["ext4_at_start"]["errors"]
    rc, out, took = bed.flush()
    s3 = bed.stats()
    # The server says a change of the store's health at most once a second: its line that the
    # store is ok again may follow the flush by up to that.
    deadline = time.time() + 3
    while rc == 0 and time.time() < deadline:
        said_failing, said_ok = health_lines(bed.log_since(ctx["log_at"]))
        if not said_failing or said_ok:
            break
        time.sleep(0.1)
    d = lambda a, b, k: b[k] - a[k]
    print(f"  backing store failing {t_off - t_on:.1f} s: nbdkit failed "
          + (", ".join(f"{v} {k}" for k, v in sorted(injected.items())) or "no request")
          + f"; pmcache counted {d(s0, s1, 'backing_errors')} failed backing "
          f"operations, {d(s0, s1, 'cleaner_errors')} failed write-back batches; at its end "
          f"state {s1['backing_state']}, cleaner {s1['cleaner_phase']}, {s1['dirty_slots']} dirty "
          f"blocks ({100 * s1['dirty_slots'] / s1['slot_count']:.1f} %)"
          + (f", last error: {s1['backing_last_error']}" if s1['backing_last_error'] else ""), flush=True)
    print(f"  after it: state {s2['backing_state']}, {d(s1, s2, 'writebacks')} blocks written back "
          f"in {t_flush - t_off:.1f} s; pmcache flush: exit {rc} in {took:.1f} s"
          + (f" ({out.splitlines()[-1][:200]})" if out else "")
          + f"; then {s3['dirty_slots']} dirty, {d(s1, s3, 'writebacks')} written back since the fault, "
          f"{d(s2, s3, 'backing_errors')} failed backing operations; ext4 met "
          + (f"{ext4_new} errors (the last in {ext4['last_func']}, error code {ext4['last_errcode']}{' = EIO' if ext4['last_errcode'] == '2' else ''})"
             if ext4_new else "no error"), flush=True)
    return {"window": (t_on, t_off), "flush_rc": rc, "flush_out": out, "injected": injected,
            "backing_errors": d(s0, s1, "backing_errors"), "writeback_batch_errors": d(s0, s1, "cleaner_errors"),
            "dirty_at_fault_end": s1["dirty_slots"], "written_back_after": d(s1, s3, "writebacks"),
            "dirty_after_flush": s3["dirty_slots"], "ext4_errors_at_fault_end": ext4_new,
            "state_after_flush": s3["backing_state"]}

def fault_cleaner(bed, ctx):
    # The cleaner's phase sampled every 0.25 s, the last sample just before the kill.
    deadline, phases, samples = time.time() + random.uniform(2.0, 4.0), {}, []
    while True:
        samples.append((time.time(), bed.stats()))
        phases[samples[-1][1]["cleaner_phase"]] = phases.get(samples[-1][1]["cleaner_phase"], 0) + 1
        if time.time() >= deadline:
            break
        time.sleep(min(0.25, max(0.0, deadline - time.time())))
    t, s = samples[-1]
    t1, s1 = next(((u, x) for u, x in reversed(samples) if u <= t - 0.5), samples[0])
    s0 = ctx["stats_at_start"]
    d = lambda k: s[k] - s0[k]
    last = (s["writebacks"] - s1["writebacks"]) / (t - t1) if t > t1 else 0.0
    print(f"  at the kill: dirty {s['dirty_slots']} of {s['slot_count']} blocks "
          f"({100 * s['dirty_slots'] / s['slot_count']:.1f} %), cleaner {s['cleaner_phase']}"
          f"{' (boosted)' if s['cleaner_boosted'] else ''}, {last:.0f} blocks/s written back in the last "
          f"{t - t1:.2f} s; the cleaner's phase in {len(samples)} samples: "
          + ", ".join(f"{k} {v}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])), flush=True)
    print(f"  this round: {d('writebacks')} blocks written back in {d('cleaner_batches')} batches "
          f"({d('cleaner_writes_issued')} writes), {d('evictions')} evictions, {d('stalls')} writer "
          f"stalls, {d('inline_write_back_fallbacks')} inline write-backs, {d('throttled_writes')} "
          f"paced writes, {d('cleaner_errors')} failed batches", flush=True)
    return {"dirty_share": s["dirty_slots"] / s["slot_count"], "written_back": d("writebacks"),
            "written_back_per_s_at_kill": round(last), "cleaner_phase": s["cleaner_phase"],
            "phases": phases, "stalls": d("stalls")}

FAULTS = {"kill": fault_kill, "backing-eio": fault_backing_eio, "cleaner": fault_cleaner}

def one_round(k, kind, bed, db, dirtier, paths, n, seed):
    acked_before = read_acked(paths["acked"])
    failed_before = len(read_failed(paths["failed"]))
    log_at = bed.log_size()
    ctx = {"stats_at_start": bed.stats(), "ext4_at_start": bed.ext4_live(), "log_at": log_at}
    db_log_at = db.log_size()
    if dirtier:
        dirtier.start()
    t0 = time.time()
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        random.seed(seed * 1000 + k)
        try:
            db.client(paths["acked"], paths["failed"], n, 120, filler=dirtier is not None)
        finally:
            os._exit(0)
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    info = FAULTS[kind](bed, ctx)
    ext4 = bed.ext4_live()
    db_log_at_kill = db.log_size()  # what the database logged after its disk went is not shown
    t_kill = time.time()
    bed.kill9()
    # The dead server's FUSE connection ends with nbdfuse; processes blocked on it (the client,
    # PostgreSQL, fio, in uninterruptible I/O) can only die after that.
    bed.detach()
    if dirtier:
        dirtier.stop()
    os.killpg(pid, signal.SIGKILL)
    db.kill()
    os.waitpid(pid, 0)
    server_log = bed.log_since(log_at)
    warnings, first = log_lines(server_log)
    for line in first:
        print(f"  server log: {line}")
    if warnings > len(first):
        print(f"  server log: ... {warnings} warnings and errors in all this round")
    events, first = db.log_events(db_log_at, db_log_at_kill)
    for line in first:
        print(f"  {db.name} log: {line}")
    if events > len(first):
        print(f"  {db.name} log: ... {events} PANIC, FATAL and ERROR lines in all this round")
    bed.start_server(); bed.attach()
    sb = bed.superblock()
    db.start()
    integrity, have, consistent = db.check()
    acked = read_acked(paths["acked"])
    this_round = {m: t for m, t in acked.items() if m not in acked_before}
    lost = sorted(set(acked) - have)
    failed_all = read_failed(paths["failed"])[failed_before:]
    failed = [f for f in failed_all if f[1] < t_kill]
    t_on, t_off = info.get("window", (None, None))
    in_fault = [f for f in failed if t_on is not None and t_on <= f[1] <= t_off]
    outside = [f for f in failed if f not in in_fault]
    r = {"round": k, "acked": len(this_round), "verified": len(set(this_round) & have),
         "lost": len(lost), "lost_first": lost[:20], "integrity": integrity, "consistent": consistent,
         "db_ok": integrity == "ok" and consistent, "failed_in_fault": len(in_fault),
         "failed_outside": len(outside), "ext4_errors_met": ext4["errors"] - ctx["ext4_at_start"]["errors"],
         "ext4_errors_recorded": sb["errors"] - bed.ext4_errors,
         "seconds": round(t_kill - t0, 2), **{k2: v for k2, v in info.items() if k2 != "window"}}
    if kind == "backing-eio":
        r["log_said_failing"], r["log_said_ok_again"] = health_lines(server_log)
        print(f"  server log: the backing store said {'failing' if r['log_said_failing'] else 'NOT failing'}"
              f"{', then ok again' if r['log_said_ok_again'] else ', not ok again before the kill'}")
    if t_on is not None:
        r["acked_in_fault"] = sum(1 for t in this_round.values() if t_on <= t <= t_off)
        r["acked_after_fault"] = sum(1 for t in this_round.values() if t > t_off)
        print(f"  client: {r['acked_in_fault']} commits acknowledged while the backing store failed, "
              f"{r['acked_after_fault']} after it; {len(in_fault)} failed while it failed, "
              f"{len(outside)} outside that window before the kill"
              + (f"; first failure: {in_fault[0][2][:200] if in_fault else outside[0][2][:200]}"
                 if failed else ""))
    elif failed:
        print(f"  client: {len(failed)} transactions failed before the kill; first: {failed[0][2][:200]}")
    if r["ext4_errors_met"] and kind != "backing-eio":
        print(f"  ext4 met {r['ext4_errors_met']} errors before the kill (the last in {ext4['last_func']})")
    if sb["errors"] != bed.ext4_errors or sb["error_flag"]:
        print(f"  ext4 superblock after the remount: state {sb.get('Filesystem state')}, {sb['errors']} errors recorded "
              f"(first {sb.get('First error function', '-')}, last {sb.get('Last error function', '-')})")
    bed.ext4_errors = sb["errors"]
    print(f"round {k} ({kind}): {len(acked)} commits acknowledged ({len(this_round)} this round, "
          f"{r['verified']} of them present), {len(have)} rows; {db.check_name} {integrity}; "
          f"lost {len(lost)}; total {'=' if consistent else '!='} sum of rows", flush=True)
    return r, max(list(have) + list(acked) + [f[0] for f in failed_all] + [n]) + 1000

def run(a, dbname, mode, crc, kind, rounds, tally, failures):
    label = mode + ("+data-crc" if crc else "")
    work = tempfile.mkdtemp(prefix=f"pmcache-db-{dbname}-{label}-{kind}-")
    os.chmod(work, 0o755)  # PostgreSQL's user reaches its directories under it
    cleaner = kind == "cleaner"
    eio = kind == "backing-eio"
    # With the backing store failing, a cleaner resting below its target (25 % dirty) would not
    # touch it: target_pct=0 has it write back whatever is dirty, at least 64 blocks/s.
    bed = Bed(a.pmcache, work, mode, crc, cache_size=f"{(CLEANER_CACHE if cleaner else 64 << 20) >> 20}M",
              failing_backing=eio, engine=a.engine, cleaner=("target_pct=0",) if eio else ())
    paths = {"acked": os.path.join(work, "acked.txt"), "failed": os.path.join(work, "failed.txt")}
    for p in paths.values():
        open(p, "w").close()
    print(f"== {dbname}, {label}, fault {kind}: {rounds} rounds (bed {work})", flush=True)
    rec = {"db": dbname, "mode": label, "kind": kind, "work": work, "setup": "", "fsck": "", "error": None}
    ok_before, in_round, db = len(failures), None, None
    try:
        bed.start_server(); bed.attach(mkfs=True)
        db = Postgres(bed) if dbname == "postgres" else Sqlite(bed)
        t = time.time()
        db.setup(FILLER_ROWS[dbname] if cleaner else 0)
        dirtier = None
        rec["setup"] = f"cache {bed.cache_size}"
        if cleaner:
            dirtier = Dirtier(bed, 2 * CLEANER_CACHE); dirtier.create()
            size = db.size()
            rec["setup"] += f", database {mib(size)} ({size / CLEANER_CACHE:.1f}x the cache)"
            print(f"  database {mib(size)} after the filler ({time.time() - t:.0f} s), "
                  f"{size / CLEANER_CACHE:.1f}x the {mib(CLEANER_CACHE)} cache; fio's file {mib(dirtier.size)}")
            if size < 3 * CLEANER_CACHE:
                raise RuntimeError(f"the database ({mib(size)}) is not 3x the cache")
        n = 1
        for k in range(1, rounds + 1):
            in_round = k
            r, n = one_round(k, kind, bed, db, dirtier, paths, n, a.seed)
            in_round = None
            tally.add_round(dbname, label, kind, r)
            where = f"{dbname} {label} {kind} round {k}"
            if not r["db_ok"] or r["lost"]:
                failures.append(f"{where}: {db.check_name} {r['integrity']}, lost {r['lost']} "
                                f"(first {r['lost_first']}), total {'=' if r['consistent'] else '!='} sum")
            if kind == "backing-eio" and r["backing_errors"] and not r["log_said_failing"]:
                failures.append(f"{where}: {r['backing_errors']} failed backing operations, and the "
                                f"server's log did not say the backing store was failing")
            if kind == "backing-eio" and r["state_after_flush"] == "ok" and r["log_said_failing"] \
                    and not r["log_said_ok_again"]:
                failures.append(f"{where}: stats said the backing store ok again after the fault, "
                                f"and the server's log did not say so")
            if kind == "backing-eio" and r["flush_rc"] != 0:
                failures.append(f"{where}: pmcache flush after the backing store recovered: exit "
                                f"{r['flush_rc']}: {r['flush_out'][-300:]}")
        db.stop()
        bed.detach()
        bed.attach(mount=False)
        verdict, summary, text = bed.fsck()
        rec["fsck"], rec["fsck_text"] = f"{verdict} ({summary})", text
        print(f"  fsck.ext4 -fn: {verdict}: {summary}" if verdict == "clean"
              else f"  fsck.ext4 -fn: {verdict}; what it said:\n    " + text.replace("\n", "\n    "))
        if verdict == "problems":
            failures.append(f"{dbname} {label} {kind}: fsck.ext4 -fn found problems:\n{text}")
    except Exception as e:
        rec["error"] = traceback.format_exc()
        print(f"  run stopped: {type(e).__name__}: {e}", flush=True)
        failures.append(f"{dbname} {label} {kind}: run stopped: {type(e).__name__}: {str(e)[:1500]}")
        if in_round:  # the round happened (the server was killed) but its checks could not end
            print(f"round {in_round} ({kind}): the database or the bed did not come back", flush=True)
            tally.add_round(dbname, label, kind, {"acked": 0, "verified": 0, "lost": 0, "failed_in_fault": 0,
                                                  "failed_outside": 0, "db_ok": False, "ext4_errors_met": 0})
    finally:
        if db is not None:
            try:
                db.kill()
            except RuntimeError as e:
                print(f"  {e}")
        bed.teardown()
    tally.add_run(rec)
    if len(failures) == ok_before and not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"  kept for the evidence: {work}")

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pmcache", required=True)
    ap.add_argument("--db", default="sqlite", help="sqlite, postgres or both: sqlite,postgres")
    ap.add_argument("--mode", default="write-back")
    ap.add_argument("--data-crc", action="store_true")
    ap.add_argument("--modes", help="several modes in one invocation: write-back,write-through,"
                    "write-around,data-crc (data-crc: write-back with --data-crc; also MODE+data-crc)")
    ap.add_argument("--fault", default="kill", help="kill, backing-eio, cleaner, all; KIND:N,...")
    ap.add_argument("--rounds", "--kills", type=int, default=4, help="rounds per fault kind")
    ap.add_argument("--engine", help="pmcache serve --engine (default: pmcache's)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--json", help="also write the JSON summary to this file, with every round's record")
    ap.add_argument("--keep", action="store_true", help="keep every bed's directory (logs, backing "
                    "file), not only those of runs that failed")
    ap.add_argument("--long", action="store_true", help="the long suite: --db sqlite,postgres --modes "
                    "write-back,write-through,write-around,data-crc --fault all --rounds 9")
    a = ap.parse_args()
    if a.long:
        a.db, a.modes, a.fault, a.rounds = "sqlite,postgres", "write-back,write-through,write-around,data-crc", "all", 9
    dbs = [d.strip() for d in a.db.split(",")]
    if any(d not in ("sqlite", "postgres") for d in dbs):
        sys.exit("kill-suite: --db is sqlite, postgres or sqlite,postgres")
    if "postgres" in dbs and PG_BIN is None:
        sys.exit("kill-suite: no PostgreSQL server (apt-get install -y postgresql)")
    modes = parse_modes(a.modes) if a.modes else [(a.mode, a.data_crc)]
    faults = parse_faults(a.fault, a.rounds)
    if a.seed is None:
        a.seed = random.randrange(1 << 30)
    random.seed(a.seed)
    a.pmcache = os.path.abspath(a.pmcache)
    rev = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "describe", "--always",
                          "--dirty", "--abbrev=12"], capture_output=True, text=True).stdout.strip()
    version = subprocess.run([a.pmcache, "--version"], capture_output=True, text=True).stdout.strip()
    print(f"kill-suite: {','.join(dbs)} x {','.join(m + ('+data-crc' if c else '') for m, c in modes)} x "
          f"{','.join(f'{k}:{n}' for k, n in faults)}; seed {a.seed}; {a.pmcache} ({version}); tree {rev}",
          flush=True)
    tally, failures, t0 = Tally(), [], time.time()
    for dbname in dbs:
        for mode, crc in modes:
            for kind, rounds in faults:
                run(a, dbname, mode, crc, kind, rounds, tally, failures)
    rounds = sum(c["rounds"] for c in tally.rows.values())
    print(f"\nkill-suite: {rounds} rounds (each ending with a kill -9 of the server) in "
          f"{time.time() - t0:.0f} s, {len(failures)} failures; seed {a.seed}, tree {rev}")
    print(tally.table())
    print(LEGEND)
    kinds = tally.kind_lines()
    if kinds:
        print("faults:\n" + kinds)
    print("runs:\n" + tally.runs_table())
    meta = dict(suite="kill-suite", seed=a.seed, tree=rev, pmcache=version,
                seconds=round(time.time() - t0), failures=failures)
    print("kill-suite JSON: " + tally.json(**meta))
    if a.json:  # the same, with each round's record and what fsck said in full
        with open(a.json, "w") as f:
            f.write(tally.json(full=True, **meta) + "\n")
    for f in failures:
        print("FAILED:", f)
    sys.exit(1 if failures else 0)

if __name__ == "__main__":
    main()
