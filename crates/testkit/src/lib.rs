//! Helpers shared by the end-to-end tests of `pmcache-nbd` and `pmcache-cli` (a dev-dependency
//! only): real external clients (qemu-io, qemu-img, nbdinfo, fio, ...) run with a timeout and
//! their failures reported with their output, plus deterministic test data.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

pub mod ceph;
pub mod nbd;
pub mod tls;

/// The Debian package that provides each external program the tests run (`scripts/deps.sh`
/// installs them all).
const TOOL_PACKAGES: &[(&str, &str)] = &[
    ("fio", "fio"),
    ("nbdinfo", "libnbd-bin"),
    ("nbdcopy", "libnbd-bin"),
    ("nbdfuse", "nbdfuse"),
    ("nbdkit", "nbdkit"),
    ("qemu-io", "qemu-utils"),
    ("qemu-img", "qemu-utils"),
    ("qemu-nbd", "qemu-utils"),
    ("openssl", "openssl"),
    ("losetup", "mount"),
    ("findmnt", "util-linux"),
];

/// What to say when the program `bin` cannot be found: which package brings it.
pub fn missing_tool_message(bin: &str) -> String {
    let package = TOOL_PACKAGES.iter().find(|(tool, _)| *tool == bin).map(|(_, p)| *p);
    match package {
        Some(package) => format!(
            "`{bin}` not found on PATH: install it with `apt-get install -y {package}` \
             (scripts/test.sh installs every package the tests use)"
        ),
        None => format!("`{bin}` not found on PATH"),
    }
}

/// Fails the test unless `bin` is on PATH, naming the apt package that provides it.
pub fn require_tool(bin: &str, apt_package: &str) {
    let found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false);
    assert!(found, "`{bin}` not found on PATH: install it with `apt-get install -y {apt_package}`");
}

/// Runs a command to completion, killing it after `timeout`; panics on timeout.
pub fn run(cmd: &mut Command, timeout: Duration) -> Output {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                let bin = cmd.get_program().to_string_lossy().into_owned();
                panic!("cannot start {desc}: {}", missing_tool_message(&bin))
            }
            _ => panic!("cannot start {desc}: {e}"),
        });
    let deadline = Instant::now() + timeout;
    // Drain pipes on threads so a chatty child cannot block on a full pipe.
    let mut stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stdout, &mut v);
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut v);
        v
    });
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("timed out after {timeout:?}: {desc}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Output { status, stdout: out_t.join().expect("stdout"), stderr: err_t.join().expect("stderr") }
}

/// Runs a command and asserts it succeeded; returns stdout.
pub fn run_ok(cmd: &mut Command, timeout: Duration) -> String {
    let desc = format!("{cmd:?}");
    let out = run(cmd, timeout);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{desc} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    stdout
}

/// Runs qemu-io with `cmds` against `uri`, failing on any failed command or pattern mismatch.
pub fn qemu_io(uri: &str, cmds: &[String], timeout: Duration) -> String {
    require_tool("qemu-io", "qemu-utils");
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw", uri]);
    for c in cmds {
        cmd.args(["-c", c]);
    }
    let out = run(&mut cmd, timeout);
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "qemu-io failed ({}):\n{text}", out.status);
    for bad in ["failed", "error", "Error", "invalid", "Pattern verification"] {
        assert!(!text.contains(bad), "qemu-io reported `{bad}`:\n{text}");
    }
    text
}

/// A qemu-io script of writes with pattern checks, and the data it leaves behind.
pub struct QemuIoScript {
    /// qemu-io's `-c` commands, in order.
    pub commands: Vec<String>,
    /// What the first `span_bytes` hold once they ran (a discarded range rewritten).
    pub model: Vec<u8>,
}

/// Patterns written at `writes` pseudo-random offsets of the first `span_bytes` (at least
/// 16 MiB), each read back with pattern verification: lengths from 1 byte to 8 MiB, offsets
/// 4 KiB-aligned, 512-aligned and unaligned in turn, one write in seven with FUA; then 16
/// pipelined 64 KiB writes, write-zeroes aligned and not, a discard rewritten, and a flush.
pub fn qemu_io_patterns(span_bytes: u64, writes: u64) -> QemuIoScript {
    assert!(span_bytes >= 16 << 20, "the script writes up to 11 MiB in");
    let lens: [u64; 12] =
        [1, 511, 512, 1536, 4096, 4097, 7680, 65536, 100_000, 1 << 20, (3 << 20) + 7, 8 << 20];
    let mut model = vec![0u8; span_bytes as usize];
    let mut commands = Vec::new();
    let mut x: u64 = 0x1234_5678;
    for i in 0..writes {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let len = lens[(i % lens.len() as u64) as usize];
        let offset = (x >> 20) % (span_bytes - len);
        let offset = match i % 3 {
            0 => offset & !4095,
            1 => offset & !511,
            _ => offset,
        };
        let pattern = (i % 255 + 1) as u8;
        let fua = if i % 7 == 0 { "-f " } else { "" };
        commands.push(format!("write {fua}-P {pattern} {offset} {len}"));
        commands.push(format!("read -P {pattern} {offset} {len}"));
        model[offset as usize..(offset + len) as usize].fill(pattern);
    }
    // Pipelined writes, zeroes (aligned and not), a discard (contents unspecified until
    // rewritten), and a flush.
    let pipelined = span_bytes * 5 / 8 + 512;
    for j in 0..16u64 {
        let offset = pipelined + j * 65536;
        commands.push(format!("aio_write -P 77 {offset} 65536"));
        model[offset as usize..(offset + 65536) as usize].fill(77);
    }
    commands.push("aio_flush".into());
    commands.push("write -z 1000000 300000".into());
    model[1_000_000..1_300_000].fill(0);
    commands.push("read -P 0 1000000 300000".into());
    commands.push("write -z 8388608 2097152".into());
    model[8 << 20..10 << 20].fill(0);
    commands.push("read -P 0 8388608 2097152".into());
    commands.push("discard 0 1048576".into());
    commands.push("write -P 9 0 1048576".into());
    model[..1 << 20].fill(9);
    commands.push("flush".into());
    QemuIoScript { commands, model }
}

/// An image of `size_bytes` (pseudo-random but for a zero region, `seed`) written in `dir`,
/// converted into the NBD export at `uri` with `qemu-img convert -n`, out again into a new
/// file, and compared (`qemu-img compare` against the export too); returns the image.
pub fn qemu_img_roundtrip(dir: &Path, uri: &str, size_bytes: usize, timeout: Duration) -> Vec<u8> {
    require_tool("qemu-img", "qemu-utils");
    let src = dir.join("src.img");
    let data = image_with_zero_region(size_bytes, 42);
    std::fs::write(&src, &data).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    let src_s = src.to_str().expect("a UTF-8 path");
    qemu_img_convert(src_s, uri, true, timeout);
    let out = dir.join("out.img");
    qemu_img_convert(uri, out.to_str().expect("a UTF-8 path"), false, timeout);
    assert!(read_file(&out) == data, "qemu-img convert out of {uri} differs from the source");
    run_ok(
        Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw", src_s, uri]),
        timeout,
    );
    data
}

/// `qemu-img convert -f raw -O raw FROM TO` (`into_existing`: `-n`, TO is not created), each
/// an NBD URI or a file; fails the test when qemu-img does.
pub fn qemu_img_convert(from: &str, to: &str, into_existing: bool, timeout: Duration) {
    require_tool("qemu-img", "qemu-utils");
    let mut cmd = Command::new("qemu-img");
    cmd.arg("convert");
    if into_existing {
        cmd.arg("-n");
    }
    cmd.args(["-f", "raw", "-O", "raw", from, to]);
    run_ok(&mut cmd, timeout);
}

/// `len` pseudo-random bytes with 8–12 MiB zeroed (when `len` reaches that far): an image
/// whose zero region exercises a client's zero detection (write zeroes, trim).
pub fn image_with_zero_region(len: usize, seed: u64) -> Vec<u8> {
    let mut data = pseudo_random(len, seed);
    let zeroes = (8 << 20).min(len)..(12 << 20).min(len);
    data[zeroes].fill(0);
    data
}

/// Deterministic pseudo-random bytes.
pub fn pseudo_random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Reads a whole file.
pub fn read_file(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}
