#!/usr/bin/env bash
# Builds the Debian packages as a distribution's builder would: in a clean Debian unstable chroot
# (mmdebstrap, buildd variant) with only the Build-Depends from debian/control installed
# (Debian's own cargo and rustc), the crates from the vendor tarball, and the network cut
# (`unshare --net` around dpkg-buildpackage); then runs lintian inside the chroot and fails on
# any error. The chroot is removed afterwards; the source and binary packages and the logs are
# left in OUTDIR.
#   usage: sudo scripts/debian-chroot-build.sh [OUTDIR]   (OUTDIR defaults to ./target/debian)
# Needs root (mmdebstrap, chroot, unshare), network access to deb.debian.org for the chroot and
# the Build-Depends, and cargo with network or a filled cache for the vendor tarball
# (scripts/debian-orig.sh). Installs mmdebstrap and dpkg-dev with apt-get when missing.
# Environment: EPCOMM_DEBIAN_SUITE (default unstable, where Debian builds an upload; its rustc
# must meet debian/control's Build-Depends), EPCOMM_DEBIAN_MIRROR (default
# http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
suite=${EPCOMM_DEBIAN_SUITE:-unstable}
mirror=${EPCOMM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
out=${1:-$root/target/debian}
say() { printf '== %s (%s)\n' "$*" "$(date -u +%T)"; }
fail() {
  printf 'debian-chroot-build: %s\n' "$*" >&2
  exit 1
}
[ "$(id -u)" = 0 ] || fail "run as root (mmdebstrap, chroot and unshare need it)"
need=()
command -v mmdebstrap >/dev/null 2>&1 || need+=(mmdebstrap)
command -v dpkg-source >/dev/null 2>&1 || need+=(dpkg-dev)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
  say "apt-get install ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi

version=$(dpkg-parsechangelog -l debian/changelog -S Version)
upstream=${version%-*}
cargo_version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
[ "$upstream" = "$cargo_version" ] || fail "debian/changelog says $version, Cargo.toml $cargo_version"
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d /var/tmp/epcomm-chroot-build.XXXXXX)
cleanup() {
  local rc=$?
  # Whatever an interrupted mmdebstrap left mounted, deepest first; then the tree, never
  # crossing into a mount that is still there.
  set +e
  grep -o " $work/[^ ]*" /proc/mounts | sort -r | while read -r m; do umount -l "$m"; done
  rm -rf --one-file-system "$work"
  exit "$rc"
}
trap cleanup EXIT
started=$(date +%s)

say "upstream tarballs (scripts/debian-orig.sh)"
scripts/debian-orig.sh "$work/src" >/dev/null
say "source package (dpkg-source -b, 3.0 (quilt) with the vendor component)"
(
  cd "$work/src"
  tar -xf "epcomm_$upstream.orig.tar.xz"
  mkdir "epcomm-$upstream/vendor"
  tar -xf "epcomm_$upstream.orig-vendor.tar.xz" -C "epcomm-$upstream/vendor" --strip-components=1
  cp -a "$root/debian" "epcomm-$upstream/debian"
  dpkg-source -b "epcomm-$upstream" >/dev/null
  rm -rf "epcomm-$upstream"
)
dsc=epcomm_$version.dsc

say "clean $suite chroot (mmdebstrap --variant=buildd)"
chroot=$work/chroot
# Check-Valid-Until off: a mirror that is a snapshot of the archive (snapshot.debian.org, or a
# frozen copy of it) serves unstable's Release file past its Valid-Until date.
mmdebstrap --quiet --variant=buildd --include=lintian --aptopt='Acquire::Check-Valid-Until "false"' \
  "$suite" "$chroot" "$mirror"
cp /etc/resolv.conf "$chroot/etc/resolv.conf"
mkdir -p "$chroot/build"
cp "$work/src"/* "$chroot/build/"
in_chroot() { unshare --mount --pid --fork --mount-proc="$chroot/proc" chroot "$chroot" "$@"; }

say "Build-Depends (apt-get build-dep on the .dsc)"
# mmdebstrap leaves no package lists behind.
in_chroot sh -c "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get build-dep -y -qq /build/$dsc" \
  >"$out/build-dep.log" 2>&1 || { tail -n 30 "$out/build-dep.log" >&2; fail "apt-get build-dep failed"; }
in_chroot dpkg-query -W -f '${Package} ${Version}\n' cargo rustc debhelper | sed 's/^/   /'

say "dpkg-buildpackage with no network (unshare --net), as an unprivileged user"
in_chroot useradd --create-home builder
in_chroot chown -R builder: /build
if ! unshare --net --mount --pid --fork --mount-proc="$chroot/proc" chroot "$chroot" \
  su builder -c "set -e; cd /build; echo \"   network interfaces: \$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | tr '\\n' ' ')\"; \
    dpkg-source -x $dsc epcomm >/dev/null; cd epcomm; dpkg-buildpackage -us -uc" \
  >"$out/build.log" 2>&1; then
  tail -n 60 "$out/build.log" >&2
  fail "dpkg-buildpackage failed in the chroot (log: $out/build.log)"
fi
grep -E '^dpkg-deb: building' "$out/build.log" | sed 's/^/   /'

say "lintian (in the chroot, $suite's), failing on errors"
changes=$(cd "$chroot/build" && ls epcomm_"$version"_*.changes)
set +e
in_chroot su builder -c "cd /build && lintian --fail-on error --display-info --tag-display-limit 0 $changes" \
  >"$out/lintian.log" 2>&1
lintian_rc=$?
set -e
sed 's/^/   /' "$out/lintian.log"
grep -rl 'lintian-overrides' "$chroot/build/epcomm/debian" 2>/dev/null && fail "lintian overrides present"
cp "$chroot/build"/*.deb "$chroot/build"/*.dsc "$chroot/build"/*.tar.* "$chroot/build"/*.changes \
  "$chroot/build"/*.buildinfo "$out/"
[ "$lintian_rc" = 0 ] || fail "lintian reports errors (above)"
say "debian-chroot-build: built in a clean $suite chroot with no network, lintian clean of errors, in $(($(date +%s) - started)) s; packages in $out"
