#!/usr/bin/env bash
# Runs the backing crate's io_uring-iopoll conformance tests where IOPOLL really works: in a QEMU
# guest whose ext4 scratch disk is an emulated NVMe drive with poll queues (run-in-guest.sh).
# Fails if a test fails, if no test ran, or if the tests skipped their data tests because the
# disk refused polled I/O ("skipping io_uring-iopoll data tests").
#
#   scripts/guest/iopoll-conformance.sh [TEST-BINARY ARGS...]   (default: --test-threads=1)
#
# --nocapture is always added: the skip notice is printed by a passing test, which libtest would
# otherwise swallow.
#
# Builds with cargo's usual target directory (CARGO_TARGET_DIR is honoured). Extra options for
# run-in-guest.sh can be given in PMCACHE_GUEST_ARGS (e.g. "--timeout 900 --mem 2048").
#
# The guest kernel comes from bookworm-backports (6.12) by default: with bookworm's own 6.1 the
# polled writes hang (an io-wq worker waits in __iomap_dio_rw for a polled bio nobody polls;
# only the NVMe driver's 30 s timeout handler completes it, "I/O ... timeout, completion
# polled"), fio --hipri=1 --blockalign=512 randwrite on ext4 hangs the same way. Set
# PMCACHE_GUEST_KERNEL_SUITE= (empty) to use the host's sources (6.1) anyway.
set -euo pipefail
cd "$(dirname "$0")/../.."
here=scripts/guest
export PMCACHE_GUEST_KERNEL_SUITE="${PMCACHE_GUEST_KERNEL_SUITE-bookworm-backports}"
start=$SECONDS

echo "== building the conformance test binary (profile test-opt: release without LTO)"
json=$(cargo test --profile test-opt -p pmcache-backing --test conformance --no-run \
  --message-format=json-render-diagnostics)
exe=$(grep -o '"executable":"[^"]*/conformance-[^"]*"' <<<"$json" | tail -n 1 | cut -d'"' -f4 || true)
[[ -n "$exe" && -x "$exe" ]] || { echo "iopoll-conformance: no conformance test binary" >&2; exit 2; }
echo "test binary: $exe"

(($#)) || set -- --test-threads=1
set -- "$@" --nocapture
log=$(mktemp "${TMPDIR:-/tmp}/iopoll-conformance.XXXXXX.log")
trap 'rm -f "$log"' EXIT

echo "== running io_uring_iopoll conformance tests in the guest"
set +e
# shellcheck disable=SC2086 # PMCACHE_GUEST_ARGS is split into words on purpose
"$here/run-in-guest.sh" --timeout 300 ${PMCACHE_GUEST_ARGS:-} --env RUST_BACKTRACE=1 --copy "$exe" \
  -- "$exe" io_uring_iopoll "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e

fail() { echo "iopoll-conformance: FAILED: $*" >&2; exit 1; }
((rc != 125)) || fail "the guest reported no exit code (timed out or crashed; see above)"
((rc == 0)) || fail "the tests exited with $rc"
if grep -q 'skipping io_uring-iopoll data tests' "$log"; then
  fail "IOPOLL was refused in the guest, the data tests were skipped"
fi
grep -q 'io_poll=1' "$log" || fail "the guest's NVMe drive had no poll queues (io_poll != 1)"
passed=$(sed -n 's/^test result: ok\. \([0-9][0-9]*\) passed.*/\1/p' "$log" | tail -n 1)
[[ -n "$passed" && "$passed" -gt 0 ]] || fail "no io_uring_iopoll test ran"
echo "iopoll-conformance: OK: $passed io_uring_iopoll tests passed with IOPOLL on NVMe poll queues" \
  "($((SECONDS - start)) s in all)"
