#!/usr/bin/env python3
"""SQLite on ext4 over pmcache (serve on a unix socket -> nbdfuse -> loop -> ext4), the
server killed with SIGKILL at random moments while a client commits numbered transactions.

Each transaction inserts a row (n, amount) and adds amount to a running total in another
table; the client records n once COMMIT returned (journal_mode=WAL, synchronous=FULL). After
each kill: the server is restarted on the same cache, the file system mounted again (ext4
replays its journal), and the database checked with its own oracles: PRAGMA
integrity_check is ok, every acknowledged n is there, and the running total equals the sum
of the rows (no half-applied transaction).

  scripts/db/kill-suite.py --pmcache PATH [--kills N] [--mode MODE] [--data-crc]

Needs root (loop devices, mounts), nbdfuse (libnbd-bin), mkfs.ext4.
"""
import argparse, os, random, signal, sqlite3, subprocess, sys, tempfile, time

def sh(*cmd, check=True, **kw):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)

class Bed:
    def __init__(self, pmcache, work, mode, data_crc):
        self.pmcache, self.work, self.mode, self.data_crc = pmcache, work, mode, data_crc
        self.cache = f"/dev/shm/pmcache-db-{os.getpid()}.pm"
        self.backing = os.path.join(work, "backing.img")
        self.sock = os.path.join(work, "nbd.sock")
        self.fuse_dir = os.path.join(work, "fuse")
        self.mnt = os.path.join(work, "mnt")
        os.makedirs(self.fuse_dir); os.makedirs(self.mnt)
        with open(self.backing, "wb") as f:
            f.truncate(256 << 20)
        self.server = self.nbdfuse = None
        self.loop = None

    def start_server(self):
        args = [self.pmcache, "serve", "--cache", self.cache, "--cache-size", "64M",
                "--backing", self.backing, "--socket", self.sock, "--mode", self.mode]
        if self.data_crc:
            args.append("--data-crc")
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        self.log = open(os.path.join(self.work, "server.log"), "a")
        self.server = subprocess.Popen(args, stdout=self.log, stderr=self.log)
        for _ in range(300):
            if os.path.exists(self.sock):
                return
            if self.server.poll() is not None:
                sys.exit("server exited: " + open(self.log.name).read()[-2000:])
            time.sleep(0.1)
        sys.exit("server did not listen")

    def attach(self, mkfs=False, mount=True):
        disk = os.path.join(self.fuse_dir, "disk")
        self.nbdfuse = subprocess.Popen(["nbdfuse", disk, f"nbd+unix:///pmcache?socket={self.sock}"])
        for _ in range(300):
            if os.path.exists(disk):
                break
            time.sleep(0.1)
        self.loop = sh("losetup", "--direct-io=on", "-f", "--show", disk).stdout.strip()
        if mkfs:
            sh("mkfs.ext4", "-q", "-F", self.loop)
        if mount:
            sh("mount", "-t", "ext4", self.loop, self.mnt)

    def detach(self):
        sh("umount", "-l", self.mnt, check=False)
        if self.loop:
            sh("losetup", "-d", self.loop, check=False)
            self.loop = None
        if self.nbdfuse:
            sh("umount", "-l", self.fuse_dir, check=False)
            self.nbdfuse.kill(); self.nbdfuse.wait()
            self.nbdfuse = None

    def kill9(self):
        self.server.send_signal(signal.SIGKILL); self.server.wait()

    def stop(self):
        if self.server and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM); self.server.wait(60)

def client(db_path, acked_path, start, stop_after):
    """Commits transactions start.. until stop_after seconds or an error; appends each
    acknowledged n to acked_path (fsynced: that file is on another file system)."""
    con = sqlite3.connect(db_path, isolation_level=None, timeout=5)
    con.execute("PRAGMA journal_mode=WAL"); con.execute("PRAGMA synchronous=FULL")
    con.execute("CREATE TABLE IF NOT EXISTS rows (n INTEGER PRIMARY KEY, amount INTEGER, pad BLOB)")
    con.execute("CREATE TABLE IF NOT EXISTS total (id INTEGER PRIMARY KEY, sum INTEGER)")
    con.execute("INSERT OR IGNORE INTO total VALUES (1, 0)")
    acked = open(acked_path, "a")
    n, t0 = start, time.time()
    try:
        while time.time() - t0 < stop_after:
            amount = random.randint(1, 1000)
            con.execute("BEGIN IMMEDIATE")
            con.execute("INSERT INTO rows VALUES (?, ?, randomblob(3000))", (n, amount))
            con.execute("UPDATE total SET sum = sum + ? WHERE id = 1", (amount,))
            con.execute("COMMIT")
            acked.write(f"{n}\n"); acked.flush(); os.fsync(acked.fileno())
            n += 1
    except sqlite3.Error as e:
        return n, str(e)
    return n, None

def check(db_path, acked_path):
    con = sqlite3.connect(db_path, isolation_level=None)
    integrity = con.execute("PRAGMA integrity_check").fetchone()[0]
    have = {r[0] for r in con.execute("SELECT n FROM rows")}
    total = con.execute("SELECT sum FROM total WHERE id = 1").fetchone()[0]
    rows_sum = con.execute("SELECT coalesce(sum(amount), 0) FROM rows").fetchone()[0]
    acked = {int(l) for l in open(acked_path) if l.strip()}
    lost = sorted(acked - have)
    con.close()
    return integrity, lost, total == rows_sum, len(acked), len(have)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pmcache", required=True)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--mode", default="write-back")
    ap.add_argument("--data-crc", action="store_true")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="pmcache-db-")
    bed = Bed(a.pmcache, work, a.mode, a.data_crc)
    acked_path = os.path.join(work, "acked.txt")
    failures, n = [], 1
    try:
        bed.start_server(); bed.attach(mkfs=True)
        db = os.path.join(bed.mnt, "test.db")
        for k in range(1, a.kills + 1):
            # The client in a child process; the server killed while it commits.
            pid = os.fork()
            if pid == 0:
                random.seed(k)
                last, err = client(db, acked_path, n, 30)
                os._exit(0)
            time.sleep(random.uniform(0.5, 2.0))
            bed.kill9()
            os.waitpid(pid, 0)
            bed.detach()
            bed.start_server(); bed.attach()
            integrity, lost, consistent, nacked, nrows = check(db, acked_path)
            ok = integrity == "ok" and not lost and consistent
            print(f"kill {k}: {nacked} commits acknowledged, {nrows} rows; integrity_check {integrity}; "
                  f"lost {len(lost)}; total {'=' if consistent else '!='} sum of rows", flush=True)
            if not ok:
                failures.append(f"kill {k}: integrity {integrity}, lost {lost[:10]}, consistent {consistent}")
            n = max(nrows, nacked) + 100
        bed.detach()
        bed.attach(mount=False)
        fsck = sh("fsck.ext4", "-fn", bed.loop, check=False)
        print(f"fsck.ext4 -fn: exit {fsck.returncode}: {fsck.stdout.strip().splitlines()[-1]}")
        if fsck.returncode != 0:
            failures.append(f"fsck.ext4 -fn: {fsck.stdout}{fsck.stderr}")
    finally:
        bed.detach(); bed.stop()
        if os.path.exists(bed.cache):
            os.unlink(bed.cache)
    print(f"kill-suite: {a.kills} kills ({a.mode}{', data-crc' if a.data_crc else ''}), "
          f"{len(failures)} failures")
    for f in failures:
        print("FAILED:", f)
    sys.exit(1 if failures else 0)

if __name__ == "__main__":
    main()
