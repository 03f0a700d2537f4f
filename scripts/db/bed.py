"""The test bed of scripts/db/kill-suite.py: pmcache serve on a unix socket -> nbdfuse -> a loop
device (direct I/O) -> ext4, over a backing file or, for the backing-eio fault, over a backing
store that fails on demand (nbdkit's error filter on the file, on a unix socket, mounted as a
file with nbdfuse); the server's statistics, the concurrent writer of the cleaner fault, and
the file system's check."""
import json, os, signal, subprocess, time

def sh(*cmd, check=True, **kw):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)

def wait_for(path, proc=None, what="", seconds=30):
    for _ in range(int(seconds * 10)):
        if os.path.exists(path):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before {path} appeared")
        time.sleep(0.1)
    raise RuntimeError(f"{what}: {path} did not appear in {seconds} s")

class Bed:
    """One cache, one backing store and one ext4 for a run of rounds.

    failing_backing: the backing store is backing.img behind nbdkit's error filter, which fails
    every request (reads, writes, trims, zeroes; not flushes: the filter cannot) with EIO while
    the file `trigger` exists."""

    def __init__(self, pmcache, work, mode, data_crc, cache_size="64M", backing_size=512 << 20,
                 failing_backing=False, engine=None, cleaner=()):
        self.pmcache, self.work, self.mode, self.data_crc = pmcache, work, mode, data_crc
        self.cache_size, self.engine, self.cleaner = cache_size, engine, cleaner
        self.cache = f"/dev/shm/pmcache-db-{os.getpid()}-{os.path.basename(work)}.pm"
        self.image = os.path.join(work, "backing.img")
        self.sock = os.path.join(work, "nbd.sock")
        self.fuse_dir = os.path.join(work, "fuse")
        self.mnt = os.path.join(work, "mnt")
        self.trigger = os.path.join(work, "trigger")
        self.state = os.path.join(work, "pmcache-state")
        self.server_log = os.path.join(work, "server.log")
        os.makedirs(self.fuse_dir); os.makedirs(self.mnt)
        with open(self.image, "wb") as f:
            f.truncate(backing_size)
        self.server = self.nbdfuse = self.loop = None
        self.nbdkit = self.backing_fuse = None
        self.ext4_errors = 0  # what the superblock recorded after the last round
        self.backing = self.image
        if failing_backing:
            self.start_failing_backing()

    def start_failing_backing(self):
        ksock = os.path.join(self.work, "nbdkit.sock")
        bdir = os.path.join(self.work, "backing-fuse")
        os.makedirs(bdir)
        log = open(os.path.join(self.work, "nbdkit.log"), "a")
        self.nbdkit = subprocess.Popen(
            ["nbdkit", "-f", "--exit-with-parent", "-U", ksock, "--filter=error", "file",
             self.image, "error-rate=100%", f"error-file={self.trigger}"], stdout=log, stderr=log)
        wait_for(ksock, self.nbdkit, "nbdkit")
        self.backing = os.path.join(bdir, "disk")
        log = open(os.path.join(self.work, "backing-nbdfuse.log"), "a")
        self.backing_fuse = subprocess.Popen(["nbdfuse", self.backing, "--unix", ksock],
                                             stdout=log, stderr=log)
        wait_for(self.backing, self.backing_fuse, "nbdfuse (backing store)")

    def injected(self, offset=0):
        """The errors nbdkit's filter injected, from its log after offset: ({op: count}, end)."""
        with open(os.path.join(self.work, "nbdkit.log"), "rb") as f:
            f.seek(offset)
            data = f.read()
        text, ops = data.decode(errors="replace"), {}
        for line in text.splitlines():
            if "injecting" in line:
                op = line.rsplit(" ", 1)[-1]
                ops[op] = ops.get(op, 0) + 1
        return ops, offset + len(data)

    def fault(self, on):
        if on:
            open(self.trigger, "w").close()
        elif os.path.exists(self.trigger):
            os.unlink(self.trigger)

    def start_server(self):
        args = [self.pmcache, "serve", "--cache", self.cache, "--cache-size", self.cache_size,
                "--backing", self.backing, "--socket", self.sock, "--mode", self.mode,
                "--state-file", self.state]
        if self.data_crc:
            args.append("--data-crc")
        if self.engine:
            args += ["--engine", self.engine]
        for setting in self.cleaner:
            args += ["--cleaner", setting]
        if os.path.exists(self.sock):
            os.unlink(self.sock)
        log = open(self.server_log, "a")
        self.server = subprocess.Popen(args, stdout=log, stderr=log)
        try:
            wait_for(self.sock, self.server, "pmcache serve")
        except RuntimeError as e:
            raise RuntimeError(f"{e}: {open(self.server_log).read()[-2000:]}")

    def ext4_live(self):
        """ext4's count of errors on the mounted file system and where the last one was, as it
        keeps them in memory (/sys/fs/ext4/DEV/): what it met, whether or not it could write
        the record to the superblock. (A journal aborted by a failed write makes it read-only,
        which this kernel does not show in /proc/mounts.)"""
        d = f"/sys/fs/ext4/{os.path.basename(self.loop)}"

        def read(name):
            path = os.path.join(d, name)
            return open(path).read().strip() if os.path.exists(path) else ""
        return {"errors": int(read("errors_count") or 0), "last_func": read("last_error_func"),
                "last_errcode": read("last_error_errcode")}

    def log_size(self):
        return os.path.getsize(self.server_log) if os.path.exists(self.server_log) else 0

    def log_since(self, offset):
        with open(self.server_log, errors="replace") as f:
            f.seek(offset)
            return f.read()

    def attach(self, mkfs=False, mount=True):
        disk = os.path.join(self.fuse_dir, "disk")
        log = open(os.path.join(self.work, "nbdfuse.log"), "a")
        self.nbdfuse = subprocess.Popen(["nbdfuse", disk, f"nbd+unix:///pmcache?socket={self.sock}"],
                                        stdout=log, stderr=log)
        wait_for(disk, self.nbdfuse, "nbdfuse")
        self.loop = sh("losetup", "--direct-io=on", "-f", "--show", disk).stdout.strip()
        if mkfs:
            # 4 KiB blocks, the cache's (mke2fs would pick 1 KiB on a device this small, and a
            # write smaller than a cache block of a block not cached reads the backing store);
            # the inode tables and journal written now rather than by ext4lazyinit later.
            sh("mkfs.ext4", "-q", "-F", "-b", "4096", "-E", "lazy_itable_init=0,lazy_journal_init=0",
               self.loop)
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
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(120)
            except subprocess.TimeoutExpired:
                self.server.kill(); self.server.wait()

    def teardown(self):
        self.fault(False)
        self.detach(); self.stop()
        if self.backing_fuse:
            sh("umount", "-l", os.path.dirname(self.backing), check=False)
            self.backing_fuse.kill(); self.backing_fuse.wait()
        if self.nbdkit:
            self.nbdkit.kill(); self.nbdkit.wait()
        for p in (self.cache, self.cache + ".ctl"):
            if os.path.exists(p):
                os.unlink(p)

    def stats(self):
        """`pmcache stats --json` of the running server (its control socket)."""
        r = sh(self.pmcache, "stats", "--cache", self.cache, "--json", check=False, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"pmcache stats: {r.stdout}{r.stderr}")
        return json.loads(r.stdout)

    def flush(self):
        """`pmcache flush`: every dirty block written back (exit status, what it printed)."""
        t = time.time()
        r = sh(self.pmcache, "flush", "--cache", self.cache, check=False, timeout=300)
        return r.returncode, (r.stdout + r.stderr).strip(), time.time() - t

    def superblock(self):
        """ext4's own record of errors in the superblock (dumpe2fs -h of the device)."""
        out = sh("dumpe2fs", "-h", self.loop, check=False).stdout
        sb = {}
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key in ("Filesystem state", "FS Error count", "First error function",
                       "First error time", "Last error function", "Last error time", "Last error err"):
                sb[key] = value.strip()
        sb["errors"] = int(sb.get("FS Error count", "0") or 0)
        sb["error_flag"] = "with errors" in sb.get("Filesystem state", "")
        return sb

    def fsck(self):
        """fsck.ext4 -fn of the unmounted file system: (verdict, its summary line, all it said).
        The verdict is 'clean', 'error-flag' (no problem found, but the superblock carries the
        error flag ext4 set when it met an I/O error: -n leaves it there, and e2fsck -f does
        not mention it), or 'problems'."""
        r = sh("fsck.ext4", "-fn", self.loop, check=False)
        sb = self.superblock()
        lines = r.stdout.strip().splitlines()
        text = (f"fsck.ext4 -fn: exit {r.returncode}\n{r.stdout.strip()}\n{r.stderr.strip()}\n"
                f"superblock: " + ", ".join(f"{k}: {v}" for k, v in sb.items()
                                            if k not in ("errors", "error_flag")))
        summary = f"exit {r.returncode}: {lines[-1] if lines else r.stderr.strip()}"
        if r.returncode != 0:
            return "problems", summary, text
        return ("error-flag" if sb["error_flag"] else "clean"), summary, text

class Dirtier:
    """A writer beside the database on the same file system: fio, O_DIRECT 64 KiB random writes
    into a file twice the cache, queue depth 16, as fast as it goes."""

    def __init__(self, bed, size):
        self.bed, self.size = bed, size
        self.path = os.path.join(bed.mnt, "dirtier.dat")
        self.proc = None

    def create(self):
        sh("dd", "if=/dev/zero", f"of={self.path}", "bs=1M", f"count={self.size >> 20}",
           "oflag=direct", "conv=fsync")

    def start(self):
        log = open(os.path.join(self.bed.work, "fio.log"), "a")
        self.proc = subprocess.Popen(
            ["fio", "--name=dirtier", f"--filename={self.path}", f"--size={self.size}",
             "--rw=randwrite", "--bs=64k", "--direct=1", "--ioengine=libaio", "--iodepth=16",
             "--randrepeat=0", "--time_based", "--runtime=600"],
            stdout=log, stderr=log, start_new_session=True)

    def stop(self):
        if self.proc:
            self.proc.kill(); self.proc.wait()
            self.proc = None
