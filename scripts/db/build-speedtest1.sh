#!/usr/bin/env bash
# Builds SQLite's own benchmark, speedtest1 (test/speedtest1.c of SQLite's source; Debian
# packages no binary of it), for `pmcache bench db` and scripts/guest/db-bench.sh, and prints
# the path of the binary.
#
#   scripts/db/build-speedtest1.sh [--force]
#
# The source is Debian's sqlite3 source package of the suite the installed libsqlite3 comes
# from (bookworm), downloaded with `apt-get source --download-only` through a private apt
# state directory (the host's apt configuration is not touched); speedtest1.c is compiled
# against the system's libsqlite3 (libsqlite3-dev, installed when missing), the same library
# the `sqlite3` command uses. The source's version must be the library's: a newer
# speedtest1.c may call functions the library lacks. The result is kept in
# ${PMCACHE_DB_CACHE:-$HOME/.cache/pmcache-db}: speedtest1, speedtest1.c and speedtest1.version
# (the library's version it was built for); a second call only prints the path, unless the
# library changed or --force is given.
set -euo pipefail

say() { echo "build-speedtest1: $*" >&2; }
die() { say "error: $*"; exit 2; }
as_root() { if ((EUID == 0)); then "$@"; else sudo "$@"; fi; }

force=
case "${1:-}" in
  --force) force=1 ;;
  "") ;;
  *) die "unknown argument '$1' (usage: $0 [--force])" ;;
esac

cache="${PMCACHE_DB_CACHE:-$HOME/.cache/pmcache-db}"
mkdir -p "$cache"
if ! dpkg-query -W -f='${Status}' libsqlite3-dev 2>/dev/null | grep -q 'ok installed' \
    || ! command -v cc >/dev/null; then
  say "apt-get install libsqlite3-dev gcc"
  as_root apt-get update -q >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libsqlite3-dev gcc >&2
fi
version=$(dpkg-query -W -f='${Version}' libsqlite3-dev)
if [[ -z "$force" && -x "$cache/speedtest1" && "$(cat "$cache/speedtest1.version" 2>/dev/null)" == "$version" ]]; then
  echo "$cache/speedtest1"
  exit 0
fi

# The source package of the installed version, from the suite it belongs to.
suite=${PMCACHE_DB_SUITE:-$(. /etc/os-release && echo "${VERSION_CODENAME:-bookworm}")}
[[ "$suite" =~ ^[a-z0-9-]+$ ]] || die "bad suite '$suite'"
mirror=${PMCACHE_DB_DEBIAN_MIRROR:-http://deb.debian.org/debian}
adir="$cache/apt-src-$suite"
mkdir -p "$adir/lists/partial" "$adir/cache/archives/partial"
{
  echo "deb-src $mirror $suite main"
  echo "deb-src $mirror $suite-updates main"
  echo "deb-src ${mirror%/debian}/debian-security $suite-security main"
} > "$adir/sources.list"
opts=(-o "Dir::Etc::SourceList=$adir/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$adir/lists" -o "Dir::Cache=$adir/cache")
work=$(mktemp -d "${TMPDIR:-/tmp}/speedtest1.XXXXXX")
trap 'rm -rf "$work"' EXIT
((EUID != 0)) || chown _apt "$work" 2>/dev/null || true # lets apt download sandboxed
say "apt-get update (deb-src $suite, private lists in $adir)"
apt-get "${opts[@]}" update -q >&2
say "apt-get source --download-only sqlite3=$version"
(cd "$work" && apt-get "${opts[@]}" source --download-only "sqlite3=$version" >&2) \
  || die "no source package sqlite3=$version in $suite (PMCACHE_DB_SUITE picks another suite)"
orig=$(ls "$work"/sqlite3_*.orig.tar.* | grep -v -- '-www' | head -n 1)
[[ -f "$orig" ]] || die "no sqlite3 source tarball in $(ls "$work")"
member=$(tar tf "$orig" | grep -E '^[^/]+/test/speedtest1\.c$' | head -n 1)
[[ -n "$member" ]] || die "no test/speedtest1.c in $orig"
tar xf "$orig" -C "$work" "$member"
say "cc -O2 speedtest1.c -lsqlite3 -lm"
cc -O2 -o "$work/speedtest1" "$work/$member" -lsqlite3 -lm
"$work/speedtest1" --help 2>&1 | grep -q Speedtest1 || die "the built speedtest1 does not run"
cp "$work/$member" "$cache/speedtest1.c"
cp "$work/speedtest1" "$cache/speedtest1"
echo "$version" > "$cache/speedtest1.version"
say "built $cache/speedtest1 ($(head -n 1 < <("$cache/speedtest1" --help 2>&1)))"
echo "$cache/speedtest1"
