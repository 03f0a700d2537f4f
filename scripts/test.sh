#!/usr/bin/env bash
# Runs every check pmcache's CI runs: format, lints, the whole test suite (release build, with
# assertions on), the shuttle concurrency tests, and smoke runs of the benches.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy (all targets, warnings are errors)"
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy -p pmcache-engine --features shuttle --all-targets -- -D warnings

echo "== cargo test (release)"
cargo test --workspace --release

echo "== shuttle: reader / writer / evictor interleavings"
cargo test --release -p pmcache-engine --features shuttle --test shuttle

echo "== bench smoke runs"
cargo build --release -p pmcache-cli
./target/release/pmcache bench core --quick
