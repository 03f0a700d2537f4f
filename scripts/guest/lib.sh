# Shared by the guest test and bench scripts (sourced, not run): the repository root as the
# working directory, the guest kernel's suite, and helpers to install the host tools copied
# into the guest, build pmcache, and write the script the guest runs.
#
#   source "$(dirname "$0")/lib.sh"

set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
here=scripts/guest
export PMCACHE_GUEST_KERNEL_SUITE="${PMCACHE_GUEST_KERNEL_SUITE-bookworm-backports}"
start=$SECONDS

as_root() { if ((EUID == 0)); then "$@"; else sudo "$@"; fi; }

# need_tools TOOL:PACKAGE...: installs the packages of the tools missing on the host.
need_tools() {
  local missing=() tool
  for tool in "$@"; do
    command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
  done
  if ((${#missing[@]})); then
    as_root apt-get update -q
    as_root apt-get install -y -q "${missing[@]}"
  fi
}

# build_pmcache PROFILE: builds the pmcache binary with the ublk frontend (cargo feature
# `ublk`); sets exe to its absolute path. In profile test-opt it is the binary the test suite
# builds and runs (scripts/test-binary.sh), so CI builds it once. PMCACHE_BIN=path uses that
# binary instead of building one.
build_pmcache() {
  if [[ -n "${PMCACHE_BIN:-}" ]]; then
    exe=$(cd "$(dirname "$PMCACHE_BIN")" && pwd)/$(basename "$PMCACHE_BIN")
    echo "== pmcache: $exe (PMCACHE_BIN)"
    return
  fi
  echo "== building pmcache (profile $1, feature ublk)"
  if [[ "$1" == test-opt ]]; then
    exe=$(bash scripts/test-binary.sh)
  else
    cargo build --profile "$1" -p pmcache-cli --features ublk
    exe="${CARGO_TARGET_DIR:-target}/$1/pmcache"
  fi
  exe=$(cd "$(dirname "$exe")" && pwd)/$(basename "$exe")
}

# need_rublk: sets rublk to the path of rublk (RUBLK=path, or found in PATH, or installed under
# target/rublk with `cargo install rublk` when missing), the ublk server whose null and loop
# targets the guest benches set beside pmcache.
need_rublk() {
  rublk="${RUBLK:-$(command -v rublk || true)}"
  if [[ -z "$rublk" ]]; then
    rublk="$PWD/target/rublk/bin/rublk"
    [[ -x "$rublk" ]] || cargo install rublk --locked --root target/rublk
  fi
}

# on_exit COMMAND: runs COMMAND when the script exits, after those registered before it
# (a plain `trap ... EXIT` would replace them: the NVDIMM files paper000.sh keeps in /dev/shm
# were left behind that way).
exit_commands=()
on_exit() {
  exit_commands+=("$1")
  trap 'for c in "${exit_commands[@]}"; do eval "$c"; done' EXIT
}

# paper_args NAME [--with-seconds] ARGS...: the arguments of a paper's guest script,
# `[--scale S] [--runs N] --out DIR` (and `[--seconds S]` where the script takes it), into
# scale (default small), runs, seconds and out; exits 2 with NAME's message on anything else
# or without --out.
paper_args() {
  local name=$1 with_seconds=
  shift
  if [[ "${1:-}" == --with-seconds ]]; then with_seconds=1; shift; fi
  scale=small runs= seconds= out=
  while (($#)); do
    case "$1" in
      --scale) scale="$2"; shift 2 ;;
      --runs) runs="$2"; shift 2 ;;
      --seconds)
        [[ -n "$with_seconds" ]] || { echo "$name: unknown argument '$1'" >&2; exit 2; }
        seconds="$2"; shift 2 ;;
      --out) out="$2"; shift 2 ;;
      *) echo "$name: unknown argument '$1'" >&2; exit 2 ;;
    esac
  done
  [[ -n "$out" ]] || { echo "$name: --out DIR is required" >&2; exit 2; }
}

# guest_script NAME: a new temporary file for the guest's script, removed at exit; sets
# script to its path.
guest_script() {
  script=$(mktemp "${TMPDIR:-/tmp}/$1.XXXXXX.sh")
  on_exit "rm -f '$script'"
}

# files_from_log NAME LOG OUT: writes to directory OUT every file the guest printed on its
# console as a `NAME-FILE <file name> <JSON on one line>` line (NAME upper-cased), each
# checked to be JSON; fails if there is none.
files_from_log() {
  mkdir -p "$3"
  python3 - "$1" "$2" "$3" <<'PY'
import json, os, sys
name, log, out = sys.argv[1], sys.argv[2], sys.argv[3]
marker = name.upper() + "-FILE "
written = 0
for line in open(log, encoding="utf-8", errors="replace"):
    if line.startswith(marker):
        _, file, text = line.rstrip("\n").split(" ", 2)
        json.loads(text)
        with open(os.path.join(out, file), "w") as f:
            f.write(text + "\n")
        written += 1
if written == 0:
    sys.exit(f"{name}: the guest printed no figure")
print(f"{name}: {written} figure(s) written to {out}")
PY
}
