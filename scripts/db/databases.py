"""The databases of scripts/db/kill-suite.py: SQLite (WAL, synchronous=FULL) and PostgreSQL
(initdb --data-checksums, fsync=on, synchronous_commit=on, run as user postgres on a unix
socket), each with the same interface: set up (schema, optional filler table), the client that
commits numbered transactions, start / kill (PostgreSQL), and the check after a recovery.

Each transaction inserts a row (n, amount), adds amount to a running total in another table
and, with a filler table, rewrites a random filler row. The client appends "n time" to the acked
file (fsynced: it is on another file system) once COMMIT returned, and a line "n time error" to the
failed file for each transaction that raised an error instead; after an error it reconnects
and goes on with n + 1 (a transaction whose COMMIT failed may or may not be in the database)."""
import glob, os, pwd, random, shutil, signal, sqlite3, subprocess, time

RETRY_PAUSE = 0.2  # seconds between a failed transaction and the next attempt

def record(f, text):
    f.write(text); f.flush(); os.fsync(f.fileno())

class Sqlite:
    name = "sqlite"
    check_name = "integrity_check"

    def __init__(self, bed):
        self.bed = bed
        self.path = os.path.join(bed.mnt, "test.db")
        self.filler_rows = 0

    def connect(self):
        con = sqlite3.connect(self.path, isolation_level=None, timeout=5)
        con.execute("PRAGMA journal_mode=WAL"); con.execute("PRAGMA synchronous=FULL")
        return con

    def setup(self, filler_rows=0):
        con = self.connect()
        con.execute("CREATE TABLE rows (n INTEGER PRIMARY KEY, amount INTEGER, pad BLOB)")
        con.execute("CREATE TABLE total (id INTEGER PRIMARY KEY, sum INTEGER)")
        con.execute("INSERT INTO total VALUES (1, 0)")
        con.execute("CREATE TABLE filler (id INTEGER PRIMARY KEY, pad BLOB)")
        if filler_rows:
            con.execute("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < ?) "
                        "INSERT INTO filler SELECT x, randomblob(800) FROM c", (filler_rows,))
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        con.close()
        self.filler_rows = filler_rows

    def size(self):
        return sum(os.path.getsize(p) for p in glob.glob(self.path + "*"))

    def log_size(self):
        return 0

    def log_events(self, start, end):
        return 0, []

    def start(self):
        pass

    def kill(self):
        pass

    def stop(self):
        pass

    def client(self, acked_path, failed_path, start, seconds, filler):
        acked, failed = open(acked_path, "a"), open(failed_path, "a")
        n, t0, con = start, time.time(), None
        while time.time() - t0 < seconds:
            amount = random.randint(1, 1000)
            try:
                if con is None:
                    con = self.connect()
                con.execute("BEGIN IMMEDIATE")
                con.execute("INSERT INTO rows VALUES (?, ?, randomblob(3000))", (n, amount))
                con.execute("UPDATE total SET sum = sum + ? WHERE id = 1", (amount,))
                if filler:
                    con.execute("UPDATE filler SET pad = randomblob(800) WHERE id = ?",
                                (random.randint(1, self.filler_rows),))
                con.execute("COMMIT")
            except sqlite3.Error as e:
                record(failed, f"{n}\t{time.time():.3f}\t{type(e).__name__}: {e}\n")
                try:
                    con.close()
                except Exception:
                    pass
                con = None
                n += 1
                time.sleep(RETRY_PAUSE)
                continue
            record(acked, f"{n}\t{time.time():.3f}\n")
            n += 1

    def check(self):
        """(integrity verdict, the set of n present, total == sum of rows)"""
        con = sqlite3.connect(self.path, isolation_level=None)
        integrity = con.execute("PRAGMA integrity_check").fetchone()[0]
        have = {r[0] for r in con.execute("SELECT n FROM rows")}
        total = con.execute("SELECT sum FROM total WHERE id = 1").fetchone()[0]
        rows_sum = con.execute("SELECT coalesce(sum(amount), 0) FROM rows").fetchone()[0]
        con.close()
        return integrity, have, total == rows_sum

def proc_state(pid):
    """A process's state letter (R, S, D, Z, ...), or 'gone'."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError, ValueError):
        return "gone"

def pg_bin():
    """The newest PostgreSQL server installed (Debian's /usr/lib/postgresql/N/bin)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return os.path.dirname(found[-1]) if found else None

PG_BIN = pg_bin()

class Postgres:
    """A PostgreSQL cluster on the mounted file system (initdb --data-checksums, fsync=on,
    synchronous_commit=on), run as user postgres, listening on a unix socket only."""
    name = "postgres"
    check_name = "pg_amcheck --heapallindexed"

    def __init__(self, bed):
        self.bed = bed
        self.data = os.path.join(bed.mnt, "pgdata")
        self.sockdir = os.path.join(bed.work, "pgsock")
        os.makedirs(self.sockdir, exist_ok=True)
        shutil.chown(self.sockdir, "postgres", "postgres")
        self.log = os.path.join(bed.work, "postgres.log")
        self.filler_rows = 0

    def as_pg(self, *cmd, check=True, timeout=300):
        return subprocess.run(["runuser", "-u", "postgres", "--", *cmd], check=check,
                              capture_output=True, text=True, timeout=timeout)

    def psql(self, sql):
        r = self.as_pg(f"{PG_BIN}/psql", "-h", self.sockdir, "-d", "postgres", "-X", "-A", "-t",
                       "-v", "ON_ERROR_STOP=1", "-c", sql)
        return r.stdout.strip()

    def setup(self, filler_rows=0):
        os.makedirs(self.data)
        shutil.chown(self.data, "postgres", "postgres")
        self.as_pg(f"{PG_BIN}/initdb", "--data-checksums", "-A", "trust", "-D", self.data)
        with open(os.path.join(self.data, "postgresql.conf"), "a") as f:
            f.write("fsync = on\nsynchronous_commit = on\nfull_page_writes = on\n"
                    "max_wal_size = 128MB\nmin_wal_size = 32MB\n"
                    f"listen_addresses = ''\nunix_socket_directories = '{self.sockdir}'\n")
            f.flush(); os.fsync(f.fileno())
        self.start()
        self.psql("CREATE TABLE rows (n bigint PRIMARY KEY, amount int, pad text); "
                  "CREATE TABLE total (id int PRIMARY KEY, sum bigint); INSERT INTO total VALUES (1, 0); "
                  "CREATE TABLE filler (id int PRIMARY KEY, pad text)")
        if filler_rows:
            # 800 characters a row: stored as they are (TOAST compresses only above ~2 KB).
            self.psql(f"INSERT INTO filler SELECT g, repeat(md5(g::text), 25) "
                      f"FROM generate_series(1, {filler_rows}) g")
            self.psql("CHECKPOINT")
        self.filler_rows = filler_rows

    def size(self):
        return int(self.psql("SELECT pg_database_size('postgres')"))

    def start(self):
        # A postmaster killed with its disk leaves postmaster.pid; PostgreSQL removes it itself
        # unless that PID still exists, which a dead postmaster not reaped yet (a zombie) does.
        # The same for its socket's lock file.
        for lock in (os.path.join(self.data, "postmaster.pid"),
                     os.path.join(self.sockdir, ".s.PGSQL.5432.lock")):
            if not os.path.exists(lock):
                continue
            if proc_state(open(lock).readline().strip()) in ("Z", "X", "gone"):
                os.unlink(lock)
        touch = open(self.log, "a"); touch.close(); shutil.chown(self.log, "postgres", "postgres")
        r = self.as_pg(f"{PG_BIN}/pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "300",
                       "start", check=False)
        st = os.stat(self.data)
        self.data_id = (st.st_dev, st.st_ino)
        if r.returncode != 0:
            raise RuntimeError("pg_ctl start: " + r.stdout + r.stderr + open(self.log).read()[-3000:])

    def processes(self):
        """The cluster's processes: every PostgreSQL process works in its data directory, found
        by the directory's device and inode (they stay the same once the file system is detached
        under it). The postmaster's command line would miss its children, and a process that is
        exiting has none."""
        out, uid = [], pwd.getpwnam("postgres").pw_uid
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                st, owner = os.stat(f"/proc/{pid}/cwd"), os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            if owner == uid and (st.st_dev, st.st_ino) == getattr(self, "data_id", None):
                out.append(int(pid))
        return out

    def log_size(self):
        return os.path.getsize(self.log) if os.path.exists(self.log) else 0

    def log_events(self, start, end, limit=2):
        """PANIC, FATAL and ERROR lines of the server's log between two offsets: count, the
        first few."""
        with open(self.log, "rb") as f:
            f.seek(start)
            text = f.read(max(0, end - start)).decode(errors="replace")
        lines = [l.strip() for l in text.splitlines() if any(w in l for w in ("PANIC:", "FATAL:", "ERROR:"))]
        return len(lines), [l[:260] for l in lines[:limit]]

    def kill(self):
        """The postmaster and its children, SIGKILL: the power of a machine that lost its disk;
        returns once each is gone (or a zombie)."""
        pids = self.processes()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for _ in range(300):
            alive = [p for p in pids if proc_state(p) not in ("Z", "X", "gone")]
            if not alive:
                return
            time.sleep(0.1)
        raise RuntimeError(f"PostgreSQL's processes {alive} did not die in 30 s")

    def stop(self):
        self.as_pg(f"{PG_BIN}/pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop", check=False)

    def session(self):
        return subprocess.Popen(["runuser", "-u", "postgres", "--", f"{PG_BIN}/psql", "-h", self.sockdir,
                                 "-d", "postgres", "-X", "-q", "-v", "ON_ERROR_STOP=1"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, bufsize=1)

    def client(self, acked_path, failed_path, start, seconds, filler):
        """psql sessions fed transactions, an ACK line echoed after each COMMIT returned; a
        session that stops (ON_ERROR_STOP) is replaced by a new one."""
        acked, failed = open(acked_path, "a"), open(failed_path, "a")
        n, t0, p = start, time.time(), None
        while time.time() - t0 < seconds:
            amount = random.randint(1, 1000)
            extra = ""
            if filler:
                extra = (f"UPDATE filler SET pad = repeat(md5(random()::text), 25) "
                         f"WHERE id = {random.randint(1, self.filler_rows)}; ")
            if p is None:
                p = self.session()
            try:
                p.stdin.write(f"BEGIN; INSERT INTO rows VALUES ({n}, {amount}, repeat('x', 3000)); "
                              f"UPDATE total SET sum = sum + {amount} WHERE id = 1; {extra}COMMIT;\n"
                              f"\\echo ACK {n}\n")
                p.stdin.flush()
                line = p.stdout.readline()
            except OSError:
                line = ""
            if line.strip() == f"ACK {n}":
                record(acked, f"{n}\t{time.time():.3f}\n")
            else:
                # psql stopped at the error (or could not connect); its message is on stderr.
                try:
                    p.stdin.close()
                except OSError:
                    pass
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill(); p.wait()
                err = p.stderr.read()
                p = None
                err = " | ".join(l.strip() for l in err.splitlines() if l.strip())[:300]
                record(failed, f"{n}\t{time.time():.3f}\t{err or 'session ended'}\n")
                time.sleep(RETRY_PAUSE)
            n += 1
        if p:
            p.kill(); p.wait()

    def check(self):
        have = {int(x) for x in self.psql("SELECT n FROM rows").split()}
        total = int(self.psql("SELECT sum FROM total WHERE id = 1"))
        rows_sum = int(self.psql("SELECT coalesce(sum(amount), 0) FROM rows"))
        amcheck = self.as_pg(f"{PG_BIN}/pg_amcheck", "-h", self.sockdir, "--all", "--heapallindexed",
                             "--install-missing", check=False)
        integrity = "ok" if amcheck.returncode == 0 else (amcheck.stdout + amcheck.stderr)[:500]
        return integrity, have, total == rows_sum
