#!/usr/bin/env bash
# Runs every check pmcache's CI runs: format, lints, the whole test suite (release build, with
# assertions on), the shuttle concurrency tests, the io_uring IOPOLL conformance tests in a
# QEMU (TCG) guest whose NVMe drive has poll queues, and smoke runs of the benches.
set -euo pipefail
cd "$(dirname "$0")/.."

# Property tests draw from a fixed seed here so that CI is reproducible; run them with another
# PROPTEST_RNG_SEED (or none: `cargo test`) to explore further. A failure prints its seed.
export PROPTEST_RNG_SEED="${PROPTEST_RNG_SEED:-20261122}"

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy -p pmcache-engine --features shuttle --all-targets -- -D warnings

echo "== cargo test (release optimisation: profile test-opt, release without LTO)"
cargo test --workspace --profile test-opt

echo "== shuttle: reader / writer / evictor interleavings, admission counters"
cargo test --profile test-opt -p pmcache-engine --features shuttle --lib --test shuttle

echo "== io_uring IOPOLL conformance in a QEMU guest (NVMe with poll queues; this host has none)"
scripts/guest/iopoll-conformance.sh

echo "== the kernel's NBD client on pmcache serve in a QEMU guest: mkfs.ext4, mount, fio verify"
scripts/guest/nbd-kernel-e2e.sh

echo "== pmcache serve --ublk in a QEMU guest: mkfs.ext4, mount, fio verify, detach, fsck"
scripts/guest/ublk-e2e.sh

echo "== serve --ublk in a QEMU guest: kill -9 under fio, take-over (--recover), re-attach"
scripts/guest/ublk-recovery-e2e.sh

echo "== bench smoke runs"
cargo build --release -p pmcache-cli
./target/release/pmcache bench core --quick
./target/release/pmcache bench core --quick --separate --only -4k-qd16
./target/release/pmcache bench core --quick --serialize --only 'read-hit-4k$'
./target/release/pmcache bench lookup --quick
./target/release/pmcache bench lookup --quick --serialize --json
./target/release/pmcache bench engines --quick --plot target/bench-engines-smoke.svg
./target/release/pmcache bench writeback --quick --plot target/bench-writeback-smoke.svg
./target/release/pmcache bench nbd --quick
./target/release/pmcache bench tls --quick
./target/release/pmcache bench paper002 --quick --plot target/bench-paper002-smoke.svg
./target/release/pmcache bench media-kinds --quick
./target/release/pmcache bench memory --quick
./target/release/pmcache bench ublk-mapping --quick

echo "== fuzz smoke (cargo-fuzz needs a nightly toolchain; the decoder proptests above always run)"
if cargo +nightly fuzz --version >/dev/null 2>&1; then
  (cd fuzz && cargo +nightly fuzz run -O connection -- -seed=20261122 -max_total_time=20 \
    && cargo +nightly fuzz run -O codec -- -seed=20261122 -max_total_time=10)
else
  echo "fuzz smoke skipped: no nightly toolchain with cargo-fuzz on this machine"
fi
