//! The four filebench personalities of paper 003, as data: their filesets and their threads'
//! loops of flowops, written from filebench's definitions (`fileserver.f`, `webserver.f`,
//! `varmail.f`, `oltp.f`; `../shared/PAPERS-EXPERIMENTS.md`, section 7) with the paper's
//! counts, sizes and threads (its Table 2), scaled.

use clap::ValueEnum;
use serde::Serialize;

/// A filebench personality.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Personality {
    /// "File Server": create, write whole, append, read whole, delete, stat (R:W 1:2).
    Fileserver,
    /// "Web Server": ten whole-file reads, one append to a shared log (R:W 10:1).
    Webserver,
    /// "Mail Server": delete, create + append + fsync, read + append + fsync, read (R:W 1:1).
    Varmail,
    /// "OLTP": 2 KiB random reads, O_DSYNC random writes throttled by them, a log writer.
    Oltp,
}

impl Personality {
    /// All four, in the paper's order.
    pub const ALL: [Personality; 4] =
        [Personality::Fileserver, Personality::Webserver, Personality::Varmail, Personality::Oltp];

    /// Its name, as filebench's file names it.
    pub fn name(self) -> &'static str {
        match self {
            Personality::Fileserver => "fileserver",
            Personality::Webserver => "webserver",
            Personality::Varmail => "varmail",
            Personality::Oltp => "oltp",
        }
    }
}

/// KiB.
const KIB: u64 = 1024;
/// MiB.
const MIB: u64 = 1024 * KIB;

/// Filebench's `$iosize` of the whole-file flowops (1 MiB).
pub const WHOLE_FILE_IOSIZE: u64 = MIB;
/// Filebench's `$meanappendsize` (16 KiB): appends draw up to this many bytes.
pub const APPEND_IOSIZE_MAX: u64 = 16 * KIB;
/// OLTP's `$iosize` of the shadows' reads and the DB writers' writes.
pub const OLTP_IOSIZE: u64 = 2 * KIB;
/// OLTP's log writer's write size.
pub const OLTP_LOG_IOSIZE: u64 = 256 * KIB;
/// OLTP's DB writers (`$ndbwriters`).
pub const OLTP_DB_WRITERS: usize = 10;
/// The writes a DB writer queues per loop (`iters=100`).
pub const OLTP_DB_WRITES_PER_LOOP: u64 = 100;
/// Tokens a DB writer waits for per loop (`semblock value=1000`).
pub const OLTP_DB_TOKENS_PER_LOOP: u64 = 1000;
/// Posts the shadows may run ahead of a DB writer (`highwater=2000`).
pub const OLTP_DB_HIGHWATER: u64 = 2000;
/// Tokens the log writer waits for per loop (`semblock value=3200`).
pub const OLTP_LOG_TOKENS_PER_LOOP: u64 = 3200;
/// Posts the shadows may run ahead of the log writer (`highwater=1000`).
pub const OLTP_LOG_HIGHWATER: u64 = 1000;
/// A shadow's `hog` iterations per transaction (`$usermode`).
pub const OLTP_SHADOW_HOG: u64 = 200_000;
/// A DB writer's `hog` iterations per loop.
pub const OLTP_DB_HOG: u64 = 10_000;

/// The paper's sizes (Table 2) divided by this: a scale of the experiment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Sizing {
    /// File counts (and OLTP's data-file size) are the paper's over this.
    pub divisor: u64,
}

impl Sizing {
    /// The paper's counts and sizes.
    pub const PAPER: Sizing = Sizing { divisor: 1 };
}

/// How many threads a personality runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Threads {
    /// The paper's: 50; OLTP 200 shadows, 10 DB writers and the log writer.
    Paper,
    /// This many (OLTP: this many shadows, beside its 10 DB writers and log writer, which
    /// keep its read-to-write ratio).
    Count(usize),
}

impl Threads {
    /// `paper` or the count.
    pub fn label(self) -> String {
        match self {
            Threads::Paper => "paper".into(),
            Threads::Count(n) => n.to_string(),
        }
    }
}

/// A fileset: filebench's `define fileset`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FilesetSpec {
    /// Its name (and its directory's).
    pub name: &'static str,
    /// `entries`: files in it.
    pub entries: u64,
    /// `dirwidth`: files per leaf directory, and directories per directory.
    pub dir_width: u64,
    /// `size`: the files' mean size in bytes.
    pub mean_size: u64,
    /// The gamma distribution's shape of the sizes (filebench's 1.5), or `None`: every file
    /// exactly `mean_size` (`filesizegamma=0`).
    pub size_gamma: Option<f64>,
    /// `prealloc`: the share of entries (percent) created before the run.
    pub prealloc_percent: u64,
    /// `readonly`: the run never creates or deletes in it.
    pub readonly: bool,
}

/// The semaphores of OLTP's throttling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Semaphore {
    /// The log writer's `lg-block`.
    LogWriter,
    /// Each DB writer's `dbwr-block` (a post goes to every DB writer's).
    DbWriters,
}

/// What a flowop does (filebench's flowop types, those the four personalities use). `fileset`
/// is an index into the workload's filesets; `iosize` a size in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Op {
    /// `createfile`: a non-existent entry of the fileset, created and opened (on fd 1).
    CreateFile {
        /// The fileset.
        fileset: usize,
    },
    /// `openfile`: an existing entry of the fileset, opened (on fd 1).
    OpenFile {
        /// The fileset.
        fileset: usize,
    },
    /// `closefile` of fd 1 (the entry is free for others again).
    CloseFile,
    /// `deletefile`: an existing entry, not open, unlinked.
    DeleteFile {
        /// The fileset.
        fileset: usize,
    },
    /// `statfile`: an existing entry, `stat`ed.
    StatFile {
        /// The fileset.
        fileset: usize,
    },
    /// `writewholefile`: fd 1's entry's planned size, written in `iosize` pieces.
    WriteWholeFile {
        /// The largest write.
        iosize: u64,
    },
    /// `readwholefile`: fd 1's file read to its end in `iosize` pieces.
    ReadWholeFile {
        /// The largest read.
        iosize: u64,
    },
    /// `appendfilerand`: 1 … `iosize_max` bytes (uniform) appended to fd 1's file, or to
    /// the one file of fileset `shared_log`, which every thread keeps open.
    AppendFileRand {
        /// The largest append.
        iosize_max: u64,
        /// The fileset of the shared log, or `None`: fd 1.
        shared_log: Option<usize>,
    },
    /// `fsync` of fd 1.
    Fsync,
    /// `read`: `iosize` bytes at a random `iosize`-aligned offset of the next file of the
    /// fileset (`random, opennext`).
    ReadRandom {
        /// The fileset.
        fileset: usize,
        /// The read's size.
        iosize: u64,
    },
    /// `aiowrite`, `iters` times: `iosize` bytes at a random aligned offset of the next file
    /// of the fileset, queued to the thread's asynchronous writer.
    AioWriteRandom {
        /// The fileset.
        fileset: usize,
        /// Each write's size.
        iosize: u64,
        /// Writes per loop.
        iters: u64,
        /// The files are open `O_DSYNC`.
        dsync: bool,
    },
    /// `aiowait`: until every write the thread queued is done.
    AioWait,
    /// `hog`: a busy loop of stores to the thread's memory.
    Hog {
        /// Stores per call.
        iterations: u64,
    },
    /// `semblock`: until `value` posts have arrived; `highwater` posts may wait unconsumed
    /// before posters block.
    SemBlock {
        /// Whose.
        semaphore: Semaphore,
        /// Posts consumed per call.
        value: u64,
        /// Posts the posters may run ahead.
        highwater: u64,
    },
    /// `sempost value=1, blocking` to every instance of the semaphore.
    SemPost {
        /// Whose.
        semaphore: Semaphore,
    },
    /// `eventlimit` with filebench's default event rate 0: unlimited, a no-op.
    EventLimit,
}

impl Op {
    /// Whether filebench counts it in its summary's ops (I/O and AIO flowops; not `hog`, the
    /// semaphores or `eventlimit`).
    pub fn counted(self) -> bool {
        !matches!(self, Op::Hog { .. } | Op::SemBlock { .. } | Op::SemPost { .. } | Op::EventLimit)
    }

    /// Whether filebench calls it a read (its summary's r/w split).
    pub fn is_read(self) -> bool {
        matches!(self, Op::ReadWholeFile { .. } | Op::ReadRandom { .. })
    }

    /// Whether filebench calls it a write.
    pub fn is_write(self) -> bool {
        matches!(
            self,
            Op::WriteWholeFile { .. } | Op::AppendFileRand { .. } | Op::AioWriteRandom { .. }
        )
    }
}

/// One flowop of a thread's loop.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Flowop {
    /// Its name in filebench's file (`createfile1`, `shadowread`, …).
    pub name: &'static str,
    /// What it does.
    pub op: Op,
}

/// Threads running the same loop: filebench's `define process … instances=N` of one thread.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ThreadGroup {
    /// `filereader`, `shadow`, `dbwr`, `lgwr`.
    pub name: &'static str,
    /// How many threads run it.
    pub instances: usize,
    /// The loop.
    pub flowops: Vec<Flowop>,
}

impl ThreadGroup {
    /// Whether its loop blocks on `semaphore` (its threads are that semaphore's owners).
    pub fn blocks_on(&self, semaphore: Semaphore) -> bool {
        self.flowops
            .iter()
            .any(|f| matches!(f.op, Op::SemBlock { semaphore: s, .. } if s == semaphore))
    }
}

/// A personality at a size and thread count: what `bench fs` runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Workload {
    /// Which.
    pub personality: Personality,
    /// Its filesets.
    pub filesets: Vec<FilesetSpec>,
    /// Its threads.
    pub groups: Vec<ThreadGroup>,
}

impl Workload {
    /// Threads in all.
    pub fn threads_total(&self) -> usize {
        self.groups.iter().map(|g| g.instances).sum()
    }

    /// `50`, or OLTP's `200+10+1`.
    pub fn threads_label(&self) -> String {
        let counts: Vec<String> = self.groups.iter().map(|g| g.instances.to_string()).collect();
        counts.join("+")
    }

    /// The bytes its filesets hold when created (preallocated entries at their mean size).
    pub fn preallocated_bytes(&self) -> u64 {
        self.filesets.iter().map(|f| f.entries * f.prealloc_percent / 100 * f.mean_size).sum()
    }
}

/// What a personality's fileset is unless it says otherwise: `bigfileset`, directories 20
/// wide, sizes gamma-distributed about the mean (filebench's shape 1.5), every file created
/// before the run, read and written.
const FILESET: FilesetSpec = FilesetSpec {
    name: "bigfileset",
    entries: 1,
    dir_width: 20,
    mean_size: 0,
    size_gamma: Some(1.5),
    prealloc_percent: 100,
    readonly: false,
};

/// An append of 1 … `APPEND_IOSIZE_MAX` bytes to the open file.
const APPEND: Op = Op::AppendFileRand { iosize_max: APPEND_IOSIZE_MAX, shared_log: None };

const fn op(name: &'static str, op: Op) -> Flowop {
    Flowop { name, op }
}

/// The paper's file count over the divisor, at least `floor`.
fn scaled(count: u64, sizing: Sizing, floor: u64) -> u64 {
    (count / sizing.divisor.max(1)).max(floor)
}

/// The personality's workload at `sizing` with `threads`.
pub fn workload(personality: Personality, sizing: Sizing, threads: Threads) -> Workload {
    let count = |paper: usize| match threads {
        Threads::Paper => paper,
        Threads::Count(n) => n.max(1),
    };
    match personality {
        Personality::Fileserver => Workload {
            personality,
            filesets: vec![FilesetSpec {
                entries: scaled(100_000, sizing, 16),
                mean_size: 128 * KIB,
                prealloc_percent: 80,
                ..FILESET
            }],
            groups: vec![ThreadGroup {
                name: "filereader",
                instances: count(50),
                flowops: vec![
                    op("createfile1", Op::CreateFile { fileset: 0 }),
                    op("wrtfile1", Op::WriteWholeFile { iosize: WHOLE_FILE_IOSIZE }),
                    op("closefile1", Op::CloseFile),
                    op("openfile1", Op::OpenFile { fileset: 0 }),
                    op("appendfilerand1", APPEND),
                    op("closefile2", Op::CloseFile),
                    op("openfile2", Op::OpenFile { fileset: 0 }),
                    op("readfile1", Op::ReadWholeFile { iosize: WHOLE_FILE_IOSIZE }),
                    op("closefile3", Op::CloseFile),
                    op("deletefile1", Op::DeleteFile { fileset: 0 }),
                    op("statfile1", Op::StatFile { fileset: 0 }),
                ],
            }],
        },
        Personality::Webserver => {
            /// `(open, read, close)` flowop names of each of webserver's ten files.
            macro_rules! triples {
                ($($i:literal)*) => {
                    [$((concat!("openfile", $i), concat!("readfile", $i), concat!("closefile", $i))),*]
                };
            }
            let mut flowops = vec![];
            for (open, read, close) in triples!(1 2 3 4 5 6 7 8 9 10) {
                flowops.push(op(open, Op::OpenFile { fileset: 0 }));
                flowops.push(op(read, Op::ReadWholeFile { iosize: WHOLE_FILE_IOSIZE }));
                flowops.push(op(close, Op::CloseFile));
            }
            flowops.push(op(
                "appendlog",
                Op::AppendFileRand { iosize_max: APPEND_IOSIZE_MAX, shared_log: Some(1) },
            ));
            Workload {
                personality,
                filesets: vec![
                    FilesetSpec {
                        entries: scaled(500_000, sizing, 16),
                        mean_size: 32 * KIB,
                        readonly: true,
                        ..FILESET
                    },
                    FilesetSpec { name: "logfiles", entries: 1, mean_size: 32 * KIB, ..FILESET },
                ],
                groups: vec![ThreadGroup { name: "filereader", instances: count(50), flowops }],
            }
        }
        Personality::Varmail => Workload {
            personality,
            filesets: vec![FilesetSpec {
                entries: scaled(800_000, sizing, 16),
                dir_width: 1_000_000,
                mean_size: 16 * KIB,
                prealloc_percent: 80,
                ..FILESET
            }],
            groups: vec![ThreadGroup {
                name: "filereader",
                instances: count(50),
                flowops: vec![
                    op("deletefile1", Op::DeleteFile { fileset: 0 }),
                    op("createfile2", Op::CreateFile { fileset: 0 }),
                    op("appendfilerand2", APPEND),
                    op("fsyncfile2", Op::Fsync),
                    op("closefile2", Op::CloseFile),
                    op("openfile3", Op::OpenFile { fileset: 0 }),
                    op("readfile3", Op::ReadWholeFile { iosize: WHOLE_FILE_IOSIZE }),
                    op("appendfilerand3", APPEND),
                    op("fsyncfile3", Op::Fsync),
                    op("closefile3", Op::CloseFile),
                    op("openfile4", Op::OpenFile { fileset: 0 }),
                    op("readfile4", Op::ReadWholeFile { iosize: WHOLE_FILE_IOSIZE }),
                    op("closefile4", Op::CloseFile),
                ],
            }],
        },
        Personality::Oltp => {
            // 1.5 GB data files in the paper; at least 1 MiB, a whole number of 256 KiB.
            let data_size = (1536 * MIB / sizing.divisor.max(1)).max(MIB) / (256 * KIB) * 256 * KIB;
            let log_size = (10 * MIB).min(data_size);
            Workload {
                personality,
                filesets: vec![
                    FilesetSpec {
                        name: "datafiles",
                        entries: 10,
                        dir_width: 1024,
                        mean_size: data_size,
                        size_gamma: None,
                        ..FILESET
                    },
                    FilesetSpec {
                        name: "logfile",
                        entries: 1,
                        dir_width: 1024,
                        mean_size: log_size,
                        size_gamma: None,
                        ..FILESET
                    },
                ],
                groups: vec![
                    ThreadGroup {
                        name: "lgwr",
                        instances: 1,
                        flowops: vec![
                            op(
                                "lg-write",
                                Op::AioWriteRandom {
                                    fileset: 1,
                                    iosize: OLTP_LOG_IOSIZE,
                                    iters: 1,
                                    dsync: true,
                                },
                            ),
                            op("lg-aiowait", Op::AioWait),
                            op(
                                "lg-block",
                                Op::SemBlock {
                                    semaphore: Semaphore::LogWriter,
                                    value: OLTP_LOG_TOKENS_PER_LOOP,
                                    highwater: OLTP_LOG_HIGHWATER,
                                },
                            ),
                        ],
                    },
                    ThreadGroup {
                        name: "dbwr",
                        instances: OLTP_DB_WRITERS,
                        flowops: vec![
                            op(
                                "dbwrite-a",
                                Op::AioWriteRandom {
                                    fileset: 0,
                                    iosize: OLTP_IOSIZE,
                                    iters: OLTP_DB_WRITES_PER_LOOP,
                                    dsync: true,
                                },
                            ),
                            op("dbwr-hog", Op::Hog { iterations: OLTP_DB_HOG }),
                            op(
                                "dbwr-block",
                                Op::SemBlock {
                                    semaphore: Semaphore::DbWriters,
                                    value: OLTP_DB_TOKENS_PER_LOOP,
                                    highwater: OLTP_DB_HIGHWATER,
                                },
                            ),
                            op("dbwr-aiowait", Op::AioWait),
                        ],
                    },
                    ThreadGroup {
                        name: "shadow",
                        instances: count(200),
                        flowops: vec![
                            op("shadowread", Op::ReadRandom { fileset: 0, iosize: OLTP_IOSIZE }),
                            op("shadowhog", Op::Hog { iterations: OLTP_SHADOW_HOG }),
                            op("shadow-post-lg", Op::SemPost { semaphore: Semaphore::LogWriter }),
                            op("shadow-post-dbwr", Op::SemPost { semaphore: Semaphore::DbWriters }),
                            op("random-rate", Op::EventLimit),
                        ],
                    },
                ],
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(w: &Workload, group: usize) -> Vec<&'static str> {
        w.groups[group].flowops.iter().map(|f| f.name).collect()
    }

    /// (reads, writes) per loop of a group, as filebench's r/w split counts them.
    fn reads_writes(group: &ThreadGroup) -> (u64, u64) {
        let per = |f: &Flowop| match f.op {
            Op::AioWriteRandom { iters, .. } => iters,
            _ => 1,
        };
        let reads = group.flowops.iter().filter(|f| f.op.is_read()).map(per).sum();
        let writes = group.flowops.iter().filter(|f| f.op.is_write()).map(per).sum();
        (reads, writes)
    }

    #[test]
    fn fileserver_is_eleven_flowops_one_read_two_writes_no_fsync() {
        let w = workload(Personality::Fileserver, Sizing::PAPER, Threads::Paper);
        assert_eq!(
            names(&w, 0),
            [
                "createfile1",
                "wrtfile1",
                "closefile1",
                "openfile1",
                "appendfilerand1",
                "closefile2",
                "openfile2",
                "readfile1",
                "closefile3",
                "deletefile1",
                "statfile1"
            ]
        );
        assert_eq!(reads_writes(&w.groups[0]), (1, 2), "Table 2's R:W 1:2");
        assert!(!w.groups[0].flowops.iter().any(|f| f.op == Op::Fsync));
        let set = &w.filesets[0];
        assert_eq!((set.entries, set.mean_size, set.dir_width), (100_000, 128 * KIB, 20));
        assert_eq!((set.prealloc_percent, set.size_gamma), (80, Some(1.5)));
        assert_eq!(w.threads_total(), 50);
    }

    #[test]
    fn webserver_reads_ten_files_and_appends_once_to_the_shared_log() {
        let w = workload(Personality::Webserver, Sizing::PAPER, Threads::Paper);
        let loop_ = &w.groups[0].flowops;
        assert_eq!(loop_.len(), 31);
        for i in 0..10 {
            assert_eq!(loop_[3 * i].op, Op::OpenFile { fileset: 0 });
            assert_eq!(loop_[3 * i + 1].op, Op::ReadWholeFile { iosize: WHOLE_FILE_IOSIZE });
            assert_eq!(loop_[3 * i + 2].op, Op::CloseFile);
        }
        assert_eq!(
            loop_[30].op,
            Op::AppendFileRand { iosize_max: APPEND_IOSIZE_MAX, shared_log: Some(1) }
        );
        assert_eq!(reads_writes(&w.groups[0]), (10, 1), "Table 2's R:W 10:1");
        assert_eq!((w.filesets[0].entries, w.filesets[0].mean_size), (500_000, 32 * KIB));
        assert!(w.filesets[0].readonly && w.filesets[0].prealloc_percent == 100);
        assert_eq!(w.filesets[1].entries, 1, "one log file for every thread");
        assert!(!loop_.iter().any(|f| f.op == Op::Fsync));
    }

    #[test]
    fn varmail_fsyncs_after_each_of_its_two_appends() {
        let w = workload(Personality::Varmail, Sizing::PAPER, Threads::Paper);
        let loop_ = &w.groups[0].flowops;
        assert_eq!(loop_.len(), 13);
        let fsyncs: Vec<usize> =
            loop_.iter().enumerate().filter(|(_, f)| f.op == Op::Fsync).map(|(i, _)| i).collect();
        assert_eq!(fsyncs, [3, 8]);
        for i in fsyncs {
            assert!(matches!(loop_[i - 1].op, Op::AppendFileRand { shared_log: None, .. }));
            assert_eq!(loop_[i + 1].op, Op::CloseFile);
        }
        assert_eq!(loop_[0].op, Op::DeleteFile { fileset: 0 });
        assert_eq!(reads_writes(&w.groups[0]), (2, 2), "Table 2's R:W 1:1");
        let set = &w.filesets[0];
        assert_eq!((set.entries, set.mean_size, set.prealloc_percent), (800_000, 16 * KIB, 80));
        assert!(set.dir_width >= set.entries, "one flat directory");
    }

    #[test]
    fn oltp_writes_o_dsync_and_throttles_by_the_shadows_posts() {
        let w = workload(Personality::Oltp, Sizing::PAPER, Threads::Paper);
        let group = |name: &str| w.groups.iter().find(|g| g.name == name).expect("group");
        let (lgwr, dbwr, shadow) = (group("lgwr"), group("dbwr"), group("shadow"));
        assert_eq!((lgwr.instances, dbwr.instances, shadow.instances), (1, 10, 200));
        assert_eq!(w.threads_label(), "1+10+200");
        // Every write is O_DSYNC; no read is.
        for g in &w.groups {
            for f in &g.flowops {
                if let Op::AioWriteRandom { dsync, .. } = f.op {
                    assert!(dsync, "{} writes O_DSYNC", f.name);
                }
            }
        }
        assert_eq!(
            dbwr.flowops[0].op,
            Op::AioWriteRandom { fileset: 0, iosize: 2 * KIB, iters: 100, dsync: true }
        );
        assert_eq!(
            dbwr.flowops[2].op,
            Op::SemBlock { semaphore: Semaphore::DbWriters, value: 1000, highwater: 2000 }
        );
        assert_eq!(
            lgwr.flowops[0].op,
            Op::AioWriteRandom { fileset: 1, iosize: 256 * KIB, iters: 1, dsync: true }
        );
        assert_eq!(
            lgwr.flowops[2].op,
            Op::SemBlock { semaphore: Semaphore::LogWriter, value: 3200, highwater: 1000 }
        );
        assert_eq!(shadow.flowops[0].op, Op::ReadRandom { fileset: 0, iosize: 2 * KIB });
        let posts: Vec<Op> = shadow.flowops[2..4].iter().map(|f| f.op).collect();
        assert_eq!(
            posts,
            [
                Op::SemPost { semaphore: Semaphore::LogWriter },
                Op::SemPost { semaphore: Semaphore::DbWriters }
            ]
        );
        // A shadow's transaction is one read; per 1000 of them each DB writer writes 100:
        // ten writers make R:W 1:1.
        let (reads, _) = reads_writes(shadow);
        let (_, writes) = reads_writes(dbwr);
        assert_eq!(reads * OLTP_DB_TOKENS_PER_LOOP, 1000);
        assert_eq!(writes * dbwr.instances as u64, 1000);
        assert_eq!(w.filesets[0].mean_size, 1536 * MIB);
        assert_eq!(w.filesets[0].size_gamma, None, "filesizegamma=0: every file its size");
        // Only I/O flowops count as ops.
        assert!(!shadow.flowops[1].op.counted() && shadow.flowops[0].op.counted());
        assert!(Op::AioWait.counted() && !Op::EventLimit.counted());
    }

    #[test]
    fn scaling_divides_the_counts_and_a_thread_count_replaces_the_papers() {
        let s = Sizing { divisor: 8 };
        let two = Threads::Count(2);
        assert_eq!(workload(Personality::Fileserver, s, two).filesets[0].entries, 12_500);
        assert_eq!(workload(Personality::Webserver, s, two).filesets[0].entries, 62_500);
        assert_eq!(workload(Personality::Varmail, s, two).filesets[0].entries, 100_000);
        let oltp = workload(Personality::Oltp, s, two);
        assert_eq!(oltp.filesets[0].mean_size, 192 * MIB);
        assert_eq!(oltp.threads_label(), "1+10+2", "the writers stay: R:W stays 1:1");
        assert_eq!(workload(Personality::Varmail, s, two).threads_total(), 2);
        let tiny = Sizing { divisor: 1 << 20 };
        assert_eq!(workload(Personality::Fileserver, tiny, two).filesets[0].entries, 16);
        assert_eq!(workload(Personality::Oltp, tiny, two).filesets[0].mean_size, MIB);
    }
}
