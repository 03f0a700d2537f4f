#!/usr/bin/env bash
# Mutation check of the backing store's ordering rules: each mutation below removes one
# safeguard from the engine (the cleaner's in-flight wait on one path, a stripe hold, a
# generation check), and the engine's tests and shuttle tests must fail for every one.
# docs/TESTING.md ("Mutations") lists them with the tests that catch each.
#
#   scripts/mutants.sh [NAME...]     (default: every mutation; a few minutes each)
#
# Works in a git worktree of HEAD under target/mutants (its own target directory), so the
# working tree is never touched; prints one line per mutation: the failing tests, or SURVIVED.
# Exits non-zero if a mutation survives.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tree="$root/target/mutants/tree"
rm -rf "$tree"
git worktree prune
git worktree add --detach -q "$tree" HEAD
trap 'git -C "$root" worktree remove --force "$tree" >/dev/null 2>&1 || true' EXIT
export CARGO_TARGET_DIR="$root/target/mutants/target"
export PROPTEST_RNG_SEED="${PROPTEST_RNG_SEED:-20261122}"

# The helpers mutations call: the ordering rule's two entry points with their waits (or
# their locks) taken out.
helpers='
impl<M: Medium, B: BackingStore, C: Clock> Engine<M, B, C> {
    pub(super) fn backing_turn_unordered<'"'"'g>(&self, lba: u64, _held: &'"'"'g impl HoldsStripe) -> BackingTurn<'"'"'g> {
        BackingTurn { first: lba, end: lba + 1, _held: PhantomData }
    }
    pub(super) fn hold_range_unordered(&self, first: u64, end: u64, max: u64) -> RangeHold<'"'"'_> {
        self.lock_range(first, end, max)
    }
    pub(super) fn hold_range_unlocked(&self, first: u64, end: u64, max: u64) -> RangeHold<'"'"'_> {
        let last = end.min(first + max);
        for lba in first..last {
            self.wait_cleaner_writes(self.stripe_index(lba));
        }
        RangeHold { first, end: last, stripes: SmallVec::new(), guards: SmallVec::new() }
    }
}
'

# name|file|from|to (python literal replacement of the first occurrence after an anchor)
mutations=(
  "no-wait-anywhere|crates/engine/src/cache/ordering.rs|while self.stripes[stripe].cleaning.load(Ordering::Acquire) != 0 {|while false \&\& self.stripes[stripe].cleaning.load(Ordering::Acquire) != 0 {"
  "no-wait-write-through|crates/engine/src/cache/write.rs|engine.backing_turn(lba, \&guard)|engine.backing_turn_unordered(lba, \&guard)"
  "no-wait-inline-write-back|crates/engine/src/cache/inline_writeback.rs|engine.backing_turn(entry.lba, \&guard)|engine.backing_turn_unordered(entry.lba, \&guard)"
  "no-wait-trim|crates/engine/src/cache/write.rs|engine.hold_range(lba, end, RANGE_HOLD_BLOCKS_MAX)|engine.hold_range_unordered(lba, end, RANGE_HOLD_BLOCKS_MAX)"
  "no-wait-zero-through|crates/engine/src/cache/zeroes.rs|engine.hold_range(lba, end, ZERO_RUN_BLOCKS_MAX)|engine.hold_range_unordered(lba, end, ZERO_RUN_BLOCKS_MAX)"
  "no-wait-range-holds|crates/engine/src/cache/ordering.rs|            self.wait_cleaner_writes(stripe);\n        }\n        hold|        }\n        hold"
  "no-stripe-hold-zero-through|crates/engine/src/cache/zeroes.rs|engine.hold_range(lba, end, ZERO_RUN_BLOCKS_MAX)|engine.hold_range_unlocked(lba, end, ZERO_RUN_BLOCKS_MAX)"
  "no-stripe-hold-trim|crates/engine/src/cache/write.rs|engine.hold_range(lba, end, RANGE_HOLD_BLOCKS_MAX)|engine.hold_range_unlocked(lba, end, RANGE_HOLD_BLOCKS_MAX)"
  "no-generation-check-cleaner|crates/engine/src/cache/cleaner/batch.rs|if now.same_incarnation(seen) \&\& now.state() == SlotState::Dirty {\n                    self.lane|if now.state() == SlotState::Dirty {\n                    self.lane"
  "no-generation-check-inline|crates/engine/src/cache/inline_writeback.rs|if now.same_incarnation(seen) \&\& now.state() == SlotState::Dirty {\n                self.rewrite_entry_state|if now.state() == SlotState::Dirty {\n                self.rewrite_entry_state"
)

want=("$@")
survived=0
for entry in "${mutations[@]}"; do
  IFS='|' read -r name file from to <<<"$entry"
  if ((${#want[@]})) && [[ ! " ${want[*]} " == *" $name "* ]]; then continue; fi
  git -C "$tree" checkout -q -- .
  MUT_FROM="$from" MUT_TO="$to" MUT_HELPERS="$helpers" python3 - "$tree/$file" "$tree/crates/engine/src/cache/ordering.rs" <<'EOF'
import os, sys
path, ordering = sys.argv[1], sys.argv[2]
unescape = lambda s: s.replace("\\n", "\n").replace("\\&", "&")
src, dst = unescape(os.environ["MUT_FROM"]), unescape(os.environ["MUT_TO"])
text = open(path).read()
if src not in text:
    sys.exit(f"mutation anchor not found in {path}: {src!r}")
open(path, "w").write(text.replace(src, dst, 1))
helpers = open(ordering).read() + os.environ["MUT_HELPERS"]
open(ordering, "w").write(helpers)
EOF
  log="$root/target/mutants/$name.log"
  (
    cd "$tree"
    # A test the mutation makes hang counts as failed (killed after 10 minutes).
    timeout -k 10 600 cargo test -q --profile test-opt -p pmcache-engine --no-fail-fast 2>&1 \
      || echo "    (the engine tests ended with status $?: 124 is the timeout)"
    timeout -k 10 600 cargo test -q --profile test-opt -p pmcache-engine --features shuttle \
      --lib --test shuttle --no-fail-fast 2>&1
  ) >"$log" 2>&1 || true
  failed=$( (grep -E '^test .* \.\.\. FAILED$|^    [a-z_:]+$' "$log" || true) \
    | sed -E 's/^test (.*) \.\.\. FAILED$/\1/; s/^ +//' | sort -u | tr '\n' ' ')
  if grep -q "ended with status 124" "$log"; then
    failed="$failed(and a test hung: killed) "
  fi
  if grep -q "error\[E" "$log"; then
    echo "$name: DOES NOT COMPILE (see $log)"
    survived=1
  elif [[ -z "$failed" ]]; then
    echo "$name: SURVIVED (no test failed; $log)"
    survived=1
  else
    echo "$name: caught by $failed"
  fi
done
exit "$survived"
