#!/usr/bin/env python3
"""SQLite or PostgreSQL on ext4 over pmcache (serve on a unix socket -> nbdfuse -> loop -> ext4), the
server killed with SIGKILL at random moments while a client commits numbered transactions.

Each transaction inserts a row (n, amount) and adds amount to a running total in another
table; the client records n once COMMIT returned (SQLite: journal_mode=WAL,
synchronous=FULL; PostgreSQL: initdb --data-checksums, fsync=on, synchronous_commit=on,
run as user postgres on a unix socket, killed with the server). After each kill: the server
is restarted on the same cache, the file system mounted again (ext4 replays its journal),
the database started (PostgreSQL recovers from its WAL) and checked with its own oracles:
PRAGMA integrity_check or pg_amcheck --heapallindexed passes, every acknowledged n is
there, and the running total equals the sum of the rows (no half-applied transaction);
fsck.ext4 -fn at the end.

  scripts/db/kill-suite.py --pmcache PATH [--db sqlite|postgres] [--kills N] [--mode MODE]
      [--data-crc]

Needs root (loop devices, mounts), nbdfuse (libnbd-bin), mkfs.ext4.
"""
import argparse, os, random, shutil, signal, sqlite3, subprocess, sys, tempfile, time

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
            os.chmod(self.mnt, 0o755)

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

def pg_bin():
    """The newest PostgreSQL server installed (Debian's /usr/lib/postgresql/N/bin)."""
    import glob
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return os.path.dirname(found[-1]) if found else None

PG_BIN = pg_bin()

class Postgres:
    """A PostgreSQL cluster on the mounted file system (initdb --data-checksums, fsync=on,
    synchronous_commit=on), run as user postgres, listening on a unix socket only."""
    def __init__(self, bed):
        self.bed = bed
        self.data = os.path.join(bed.mnt, "pgdata")
        self.sockdir = os.path.join(bed.work, "pgsock")
        os.makedirs(self.sockdir, exist_ok=True)
        shutil.chown(self.sockdir, "postgres", "postgres")
        self.log = os.path.join(bed.work, "postgres.log")
        self.proc = None

    def as_pg(self, *cmd, check=True, timeout=120):
        return subprocess.run(["runuser", "-u", "postgres", "--", *cmd], check=check,
                              capture_output=True, text=True, timeout=timeout)

    def initdb(self):
        os.makedirs(self.data)
        shutil.chown(self.data, "postgres", "postgres")
        self.as_pg(f"{PG_BIN}/initdb", "--data-checksums", "-A", "trust", "-D", self.data)
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write("fsync = on\nsynchronous_commit = on\nfull_page_writes = on\n"
                    f"listen_addresses = ''\nunix_socket_directories = '{self.sockdir}'\n")
            f.flush(); os.fsync(f.fileno())

    def start(self):
        # A postmaster killed with its disk leaves postmaster.pid; PostgreSQL removes it itself
        # unless that PID still exists, which a dead postmaster not reaped yet (a zombie) does.
        # The same for its socket's lock file.
        for lock in (os.path.join(self.data, "postmaster.pid"),
                     os.path.join(self.sockdir, ".s.PGSQL.5432.lock")):
            if not os.path.exists(lock):
                continue
            pid = open(lock).readline().strip()
            try:
                state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                state = "gone"
            if state in ("Z", "X", "gone"):
                os.unlink(lock)
        touch = open(self.log, "a"); touch.close(); shutil.chown(self.log, "postgres", "postgres")
        r = self.as_pg(f"{PG_BIN}/pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "120",
                       "start", check=False)
        if r.returncode != 0:
            raise RuntimeError("pg_ctl start: " + r.stdout + r.stderr + open(self.log).read()[-3000:])

    def kill(self):
        # The postmaster and its children, SIGKILL: the power of a machine that lost its disk.
        subprocess.run(["pkill", "-KILL", "-u", "postgres", "-f", self.data], check=False)
        for _ in range(300):
            if subprocess.run(["pgrep", "-u", "postgres", "-f", self.data], capture_output=True).returncode:
                return
            time.sleep(0.1)
        raise RuntimeError("PostgreSQL's processes did not die in 30 s")

    def psql(self, sql):
        r = self.as_pg(f"{PG_BIN}/psql", "-h", self.sockdir, "-d", "postgres", "-X", "-A", "-t",
                       "-v", "ON_ERROR_STOP=1", "-c", sql)
        return r.stdout.strip()

def pg_client(pg, acked_path, start, stop_after):
    """One psql session fed transactions; an ACK line after each COMMIT returned."""
    p = subprocess.Popen(["runuser", "-u", "postgres", "--", f"{PG_BIN}/psql", "-h", pg.sockdir,
                          "-d", "postgres", "-X", "-q", "-v", "ON_ERROR_STOP=1"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, bufsize=1)
    acked = open(acked_path, "a")
    n, t0 = start, time.time()
    try:
        while time.time() - t0 < stop_after:
            amount = random.randint(1, 1000)
            p.stdin.write(f"BEGIN; INSERT INTO rows VALUES ({n}, {amount}, repeat('x', 3000)); "
                          f"UPDATE total SET sum = sum + {amount} WHERE id = 1; COMMIT;\n\\echo ACK {n}\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if line.strip() != f"ACK {n}":
                break
            acked.write(f"{n}\n"); acked.flush(); os.fsync(acked.fileno())
            n += 1
    except (BrokenPipeError, OSError):
        pass
    p.kill(); p.wait()
    return n

def pg_check(pg, acked_path):
    have = {int(x) for x in pg.psql("SELECT n FROM rows").split()}
    total = int(pg.psql("SELECT sum FROM total WHERE id = 1"))
    rows_sum = int(pg.psql("SELECT coalesce(sum(amount), 0) FROM rows"))
    amcheck = pg.as_pg(f"{PG_BIN}/pg_amcheck", "-h", pg.sockdir, "--all", "--heapallindexed",
                       "--install-missing", check=False)
    acked = {int(l) for l in open(acked_path) if l.strip()}
    integrity = "ok" if amcheck.returncode == 0 else (amcheck.stdout + amcheck.stderr)[:500]
    return integrity, sorted(acked - have), total == rows_sum, len(acked), len(have)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pmcache", required=True)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--mode", default="write-back")
    ap.add_argument("--data-crc", action="store_true")
    ap.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    a = ap.parse_args()
    if a.db == "postgres" and PG_BIN is None:
        sys.exit("kill-suite: no PostgreSQL server (apt-get install -y postgresql)")
    work = tempfile.mkdtemp(prefix="pmcache-db-")
    os.chmod(work, 0o755)  # PostgreSQL's user reaches its directories under it
    bed = Bed(a.pmcache, work, a.mode, a.data_crc)
    acked_path = os.path.join(work, "acked.txt")
    failures, n = [], 1
    try:
        bed.start_server(); bed.attach(mkfs=True)
        db = os.path.join(bed.mnt, "test.db")
        pg = None
        if a.db == "postgres":
            pg = Postgres(bed); pg.initdb(); pg.start()
            pg.psql("CREATE TABLE rows (n bigint PRIMARY KEY, amount int, pad text); "
                    "CREATE TABLE total (id int PRIMARY KEY, sum bigint); INSERT INTO total VALUES (1, 0)")
        for k in range(1, a.kills + 1):
            # The client in a child process; the server killed while it commits.
            pid = os.fork()
            if pid == 0:
                random.seed(k)
                if pg:
                    pg_client(pg, acked_path, n, 30)
                else:
                    client(db, acked_path, n, 30)
                os._exit(0)
            time.sleep(random.uniform(0.5, 2.0))
            bed.kill9()
            # The dead server's FUSE connection ends with nbdfuse; processes blocked on it
            # (PostgreSQL, in uninterruptible I/O) can only die after that.
            bed.detach()
            if pg:
                pg.kill()
            os.waitpid(pid, 0)
            bed.start_server(); bed.attach()
            if pg:
                pg.start()
                integrity, lost, consistent, nacked, nrows = pg_check(pg, acked_path)
            else:
                integrity, lost, consistent, nacked, nrows = check(db, acked_path)
            ok = integrity == "ok" and not lost and consistent
            what = "pg_amcheck --heapallindexed" if pg else "integrity_check"
            print(f"kill {k}: {nacked} commits acknowledged, {nrows} rows; {what} {integrity}; "
                  f"lost {len(lost)}; total {'=' if consistent else '!='} sum of rows", flush=True)
            if not ok:
                failures.append(f"kill {k}: integrity {integrity}, lost {lost[:10]}, consistent {consistent}")
            n = max(nrows, nacked) + 100
        if pg:
            pg.as_pg(f"{PG_BIN}/pg_ctl", "-D", pg.data, "-m", "fast", "-w", "stop", check=False)
        bed.detach()
        bed.attach(mount=False)
        fsck = sh("fsck.ext4", "-fn", bed.loop, check=False)
        print(f"fsck.ext4 -fn: exit {fsck.returncode}: {fsck.stdout.strip().splitlines()[-1]}")
        if fsck.returncode != 0:
            failures.append(f"fsck.ext4 -fn: {fsck.stdout}{fsck.stderr}")
    finally:
        subprocess.run(["pkill", "-KILL", "-u", "postgres", "-f", work], check=False)
        bed.detach(); bed.stop()
        if os.path.exists(bed.cache):
            os.unlink(bed.cache)
    print(f"kill-suite: {a.db}, {a.kills} kills ({a.mode}{', data-crc' if a.data_crc else ''}), "
          f"{len(failures)} failures")
    for f in failures:
        print("FAILED:", f)
    sys.exit(1 if failures else 0)

if __name__ == "__main__":
    main()
