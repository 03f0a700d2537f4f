#!/usr/bin/env bash
# Runs every check pmcache's CI runs: format, lints, the whole test suite (release build, with
# assertions on) with every feature (the ublk frontend too) and the default build's own tests,
# the shuttle concurrency tests, the io_uring IOPOLL conformance tests and the kernel-client
# tests in QEMU (TCG) guests, and smoke runs of the benches.
#
# The system packages the tests use (scripts/deps.sh lists them) are installed first when some
# are missing and this runs as root with apt-get; otherwise it stops at once with the command
# that installs them.
set -euo pipefail

# Each section's heading carries the time since the start, so that a CI log shows where the
# minutes go.
section() { printf '== [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

cd "$(dirname "$0")/.."

missing=$(bash scripts/deps.sh missing)
if [[ -n "$missing" ]]; then
  if ((EUID == 0)) && command -v apt-get >/dev/null 2>&1; then
    section "installing the system packages the tests use (missing: $missing)"
    bash scripts/deps.sh install
  else
    echo "test.sh: the tests need system packages that are missing: $missing" >&2
    echo "test.sh: install them (as root) with: $(bash scripts/deps.sh line)" >&2
    exit 1
  fi
fi

# The ublk frontend (cargo feature `ublk` of pmcache-cli) is built, linted and tested here;
# the default build (without it) is linted and its own tests run too, so neither rots.
all_features=(--features pmcache-cli/ublk)


# Property tests draw from a fixed seed here so that CI is reproducible; run them with another
# PROPTEST_RNG_SEED (or none: `cargo test`) to explore further. A failure prints its seed.
export PROPTEST_RNG_SEED="${PROPTEST_RNG_SEED:-20261122}"

section "cargo fmt --check"
cargo fmt --all -- --check

section "cargo clippy (all targets, warnings are errors; with the ublk feature, then without)"
cargo clippy --workspace --all-targets "${all_features[@]}" -- -D warnings
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy -p pmcache-engine --features shuttle --all-targets -- -D warnings

section "cargo test (release optimisation: profile test-opt, release without LTO; every feature)"
cargo test --workspace --profile test-opt "${all_features[@]}"

section "the default build (no ublk feature): its own tests of what --ublk says"
# The whole workspace, as above but without the feature: only the crates the feature changes
# (serve, bench, cli) are compiled again.
cargo test --workspace --profile test-opt --test e2e ublk

section "shuttle: reader / writer / evictor interleavings, admission counters"
cargo test --profile test-opt -p pmcache-engine --features shuttle --lib --test shuttle

section "io_uring IOPOLL conformance in a QEMU guest (NVMe with poll queues; this host has none)"
scripts/guest/iopoll-conformance.sh

section "the kernel's NBD client on pmcache serve in a QEMU guest: mkfs.ext4, mount, fio verify"
scripts/guest/nbd-kernel-e2e.sh

section "pmcache serve --ublk in a QEMU guest: mkfs.ext4, mount, fio verify, detach, fsck"
scripts/guest/ublk-e2e.sh

section "serve --ublk in a QEMU guest: kill -9 under fio, take-over (--recover), re-attach"
scripts/guest/ublk-recovery-e2e.sh

section "serve --vhost-user-blk as a QEMU guest's disk: mkfs, fio verify, kill -9 x3, QEMU reconnects"
scripts/guest/vhost-user-blk-e2e.sh
section "the same in write-through over a backing store 2 ms slow: writes in flight at each kill"
PMCACHE_E2E_ARGS="--mode write-through --backing-latency 2ms" scripts/guest/vhost-user-blk-e2e.sh
section "serve --vhost-user-blk in a QEMU guest: power cuts of the VM (SIGKILL of QEMU), every acknowledged write verified"
scripts/guest/vhost-user-blk-powercut.sh

section "SQLite and PostgreSQL on ext4 over pmcache (NBD, nbdfuse, loop): kill -9, a failing backing store, a busy cleaner; every mode"
pmcache=$(bash scripts/test-binary.sh)
# Each round ends with a kill -9 of the server: every fault kind in write-back; kill and the
# failing backing store in write-through and write-around; kill and the cleaner with
# --data-crc. 20 rounds; the long suite (--long) runs 216: docs/TESTING.md.
python3 scripts/db/kill-suite.py --pmcache "$pmcache" --db sqlite,postgres --modes write-back \
  --fault kill:2,backing-eio:1,cleaner:1
python3 scripts/db/kill-suite.py --pmcache "$pmcache" --db sqlite,postgres \
  --modes write-through,write-around --fault kill:1,backing-eio:1
python3 scripts/db/kill-suite.py --pmcache "$pmcache" --db sqlite,postgres --modes data-crc \
  --fault kill:1,cleaner:1

section "SQLite and PostgreSQL in a QEMU guest on ext4 over serve --ublk (medium on an emulated NVDIMM): power cuts, every mode"
# pmcache's four modes in one guest, three power cuts (four boots); the kernel's caches beside
# them and the long suite (--cuts 50) are campaigns: docs/DURABILITY.md.
scripts/guest/db-powercut.sh --cuts 3 --layers pm-wb,pm-wt,pm-wa,pm-crc

section "the dax medium on emulated NVDIMMs in a QEMU guest: fsdax, devdax, kill -9, power cut"
scripts/guest/dax-e2e.sh

section "a cache of two members on a QEMU guest of two NUMA nodes: placement on and interleaved"
scripts/guest/numa-e2e.sh

section "bench smoke runs"
# The test suite's binary (release optimisation without the whole-program link, every
# feature): the smoke runs check the benches' harnesses, not their figures, and a fat-LTO
# release build of its own would cost CI minutes.
pmcache=$(bash scripts/test-binary.sh)
bench() {
  local t=$SECONDS
  "$pmcache" bench "$@"
  echo "-- bench $* took $((SECONDS - t)) s"
}
# One run of each, a second long where the experiment takes --seconds: a smoke run checks
# that the harness measures and reports, and its figures are not kept.
bench engine-core --quick --runs 1
bench engine-core --quick --runs 1 --separate --only -4k-qd16
bench engine-core --quick --runs 1 --serialize --only 'read-hit-4k$'
bench lookup --quick
bench lookup --quick --serialize --json
bench engines --quick --plot target/bench-engines-smoke.svg
bench writeback --quick --seconds 1 --plot target/bench-writeback-smoke.svg
bench nbd --quick --seconds 1
bench tls --quick
bench media-kinds --quick
bench memory --quick
bench ublk-mapping --quick
bench mixed --quick --seconds 1
# The papers' experiments measured here (002's among them); those that boot a QEMU guest are
# campaigns (scripts/guest/paper00N.sh), their figures in docs/papers.
bench paper host --scale smallest --out target/papers-smoke
bench paper report --out target/papers-smoke

section "fuzz smoke (cargo-fuzz needs a nightly toolchain; the decoder proptests above always run)"
if cargo +nightly fuzz --version >/dev/null 2>&1; then
  (cd fuzz && cargo +nightly fuzz run -O connection -- -seed=20261122 -max_total_time=20 \
    && cargo +nightly fuzz run -O codec -- -seed=20261122 -max_total_time=10)
else
  echo "fuzz smoke skipped: no nightly toolchain with cargo-fuzz on this machine"
fi

section "done"
