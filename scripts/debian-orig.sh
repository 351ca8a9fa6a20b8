#!/usr/bin/env bash
# Makes the two upstream tarballs the Debian source package (debian/, format 3.0 (quilt)) is
# built from, and prints their paths:
#   epcomm_VERSION.orig.tar.xz         the tree (tracked and untracked-but-not-ignored files, as in
#                                      the working tree; debian/ left out)
#   epcomm_VERSION.orig-vendor.tar.xz  `cargo vendor --locked` of Cargo.lock: every crate the
#                                      build needs, unpacked by dpkg-source as vendor/
# The second needs the crates: cargo downloads them, or takes them from its cache.
#   usage: scripts/debian-orig.sh [OUTDIR]    (OUTDIR defaults to ..)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${1:-..}
mkdir -p "$out"
out=$(cd "$out" && pwd)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
# Reproducible tarballs: names sorted, owner root, every mtime the last commit's.
mtime=@$(git -C "$root" log -1 --format=%ct 2>/dev/null || date +%s)
tarx() { tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="$mtime" "$@"; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
src=$work/epcomm-$version
mkdir -p "$src"
if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git -C "$root" ls-files -z --cached --others --exclude-standard \
    | (cd "$root" && tar --null --ignore-failed-read -cf - -T - 2>/dev/null) \
    | tar -xf - -C "$src"
else
  tar -C "$root" --exclude=./target --exclude=./.git --exclude=./vendor -cf - . | tar -xf - -C "$src"
fi
rm -rf "$src/debian"
tarx -C "$work" -cf - "epcomm-$version" | xz -T0 -6 >"$out/epcomm_$version.orig.tar.xz"

cargo vendor --locked --versioned-dirs --quiet "$work/vendor" >/dev/null
tarx -C "$work" -cf - vendor | xz -T0 -6 >"$out/epcomm_$version.orig-vendor.tar.xz"
echo "$out/epcomm_$version.orig.tar.xz"
echo "$out/epcomm_$version.orig-vendor.tar.xz"
