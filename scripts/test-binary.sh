#!/usr/bin/env bash
# Builds the test suite (profile test-opt, every feature) unless it is built already, and
# prints the path of the `pmcache` binary its end-to-end tests run. The guest scripts and the
# bench smoke runs use that binary rather than a `cargo build` of their own: a build of the cli
# alone unifies other features (the test targets' dev-dependencies enable some), so it would
# compile the upper crates a second time.
set -euo pipefail
cd "$(dirname "$0")/.."
json=$(cargo test --workspace --profile test-opt --features pmcache-cli/ublk --no-run \
  --message-format=json-render-diagnostics)
exe=$(python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "pmcache" \
            and m["target"]["kind"] == ["bin"] and not m["profile"]["test"] \
            and m.get("executable"):
        print(m["executable"])
' <<<"$json" | tail -n 1)
[[ -n "$exe" && -x "$exe" ]] || { echo "test-binary.sh: cargo built no pmcache binary" >&2; exit 1; }
echo "$exe"
