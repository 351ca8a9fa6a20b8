#!/usr/bin/env bash
# CI for the Debian packages on this machine: builds libepcomm0.1, libepcomm-dev and epcomm with
# `dpkg-buildpackage -us -uc -b -d` in a copy of the tree (the checkout stays clean) with the
# Rust toolchain on PATH (CARGO=...; -d because Build-Depends names Debian's cargo and rustc,
# which need trixie: the distribution-style build is scripts/debian-chroot-build.sh) and the
# crates vendored as the orig-vendor tarball provides them, installs the packages with dpkg,
# checks their contents and docs, builds and runs a C and a C++ program against them with
# pkg-config and with CMake, checks the command and its man page, and removes the packages.
# Exits non-zero on any failure. Needs the Rust toolchain on PATH, and root or sudo for apt-get
# and dpkg. Run from CI as: scripts/ci-debian.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
as_root=()
[ "$(id -u)" = 0 ] || as_root=(sudo)

say() { printf '== %s\n' "$*"; }
fail() {
  printf 'ci-debian: %s\n' "$*" >&2
  exit 1
}

need=()
command -v dh >/dev/null 2>&1 || need+=(debhelper)
command -v dpkg-buildpackage >/dev/null 2>&1 || need+=(dpkg-dev)
command -v make >/dev/null 2>&1 || need+=(make)
command -v cc >/dev/null 2>&1 || need+=(gcc)
command -v c++ >/dev/null 2>&1 || need+=(g++)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v cmake >/dev/null 2>&1 || need+=(cmake)
if [ ${#need[@]} -gt 0 ]; then
  say "apt-get install ${need[*]}"
  "${as_root[@]}" apt-get update -qq
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
command -v cargo >/dev/null 2>&1 || fail "cargo is not on PATH (the package build uses the Rust toolchain on PATH)"

version=$(dpkg-parsechangelog -l debian/changelog -S Version)
cargo_version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
[ "${version%-*}" = "$cargo_version" ] || fail "debian/changelog says $version, Cargo.toml $cargo_version"
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
arch=$(dpkg-architecture -qDEB_HOST_ARCH)
libdir=/usr/lib/$multiarch
upstream=${version%-*}
packages=(epcomm libepcomm-dev libepcomm0.1)

work=$(mktemp -d /tmp/epcomm-ci-debian.XXXXXX)
installed=0
cleanup() {
  local rc=$?
  if [ "$installed" = 1 ]; then "${as_root[@]}" dpkg -r "${packages[@]}" >/dev/null 2>&1 || true; fi
  rm -rf "$work"
  exit "$rc"
}
trap cleanup EXIT

# The tree and vendor/ from the two upstream tarballs the source package is built from
# (scripts/debian-orig.sh: tracked and untracked-but-not-ignored files as in the working tree;
# `cargo vendor --locked`), unpacked as dpkg-source would, with debian/ beside them: the package
# build runs cargo --frozen against vendor/, with no network.
say "upstream tarballs (scripts/debian-orig.sh), unpacked in $work/epcomm-$upstream"
src=$work/epcomm-$upstream
"$root/scripts/debian-orig.sh" "$work/orig" >/dev/null
tar -xJf "$work/orig/epcomm_$upstream.orig.tar.xz" -C "$work"
tar -xJf "$work/orig/epcomm_$upstream.orig-vendor.tar.xz" -C "$src"
cp -a "$root/debian" "$src/debian"

say "dpkg-buildpackage -us -uc -b -d (CARGO=$(command -v cargo))"
(cd "$src" && CARGO=$(command -v cargo) dpkg-buildpackage -us -uc -b -d) >"$work/build.log" 2>&1 \
  || { tail -n 60 "$work/build.log" >&2; fail "dpkg-buildpackage failed (log above)"; }
debs=()
for p in libepcomm0.1 libepcomm-dev epcomm; do
  deb=$work/${p}_${version}_${arch}.deb
  [ -f "$deb" ] || fail "$deb was not built"
  debs+=("$deb")
done

say "package contents"
contents() { dpkg-deb -c "$1" | awk '{print $6}' | sed 's|^\./|/|' | grep -v '/$' | sort; }
expect() {
  local deb=$1
  shift
  local want got
  want=$(printf '%s\n' "$@" | sort)
  got=$(contents "$deb")
  [ "$got" = "$want" ] || fail "$(basename "$deb") holds:
$got
expected:
$want"
}
soname=$(dpkg-deb -I "${debs[0]}" shlibs 2>/dev/null | awk '{print $1 ".so." $2}')
[ -n "$soname" ] || fail "libepcomm0.1 has no shlibs file"
# Debian policy 8.1: the package is named after the SONAME (libepcomm.so.0.1: libepcomm0.1).
[ "$soname" = libepcomm.so.0.1 ] || fail "the SONAME is $soname: rename the package after it"
docs() { # package: its README, the upstream and the Debian changelog, the copyright
  printf '%s\n' "/usr/share/doc/$1/README.md.gz" "/usr/share/doc/$1/changelog.gz" \
    "/usr/share/doc/$1/changelog.Debian.gz" "/usr/share/doc/$1/copyright"
}
mapfile -t lib_docs < <(docs libepcomm0.1)
mapfile -t dev_docs < <(docs libepcomm-dev)
mapfile -t cmd_docs < <(docs epcomm)
expect "${debs[0]}" "$libdir/$soname" "$libdir/libepcomm.so.$upstream" "${lib_docs[@]}"
expect "${debs[1]}" /usr/include/epcomm.h /usr/include/epcomm.hpp \
  "$libdir/libepcomm.so" "$libdir/libepcomm.a" "$libdir/pkgconfig/epcomm.pc" \
  "$libdir/cmake/epcomm/epcommConfig.cmake" "$libdir/cmake/epcomm/epcommConfigVersion.cmake" \
  "${dev_docs[@]}" /usr/share/doc/libepcomm-dev/api.md.gz /usr/share/doc/libepcomm-dev/design.md.gz
expect "${debs[2]}" /usr/bin/epcomm /usr/share/man/man1/epcomm.1.gz "${cmd_docs[@]}"
dev_depends=$(dpkg-deb -f "${debs[1]}" Depends)
case "$dev_depends" in
  *"libepcomm0.1 (= $version)"*) ;;
  *) fail "libepcomm-dev depends on '$dev_depends', not on libepcomm0.1 (= $version)" ;;
esac

say "dpkg -i"
installed=1
"${as_root[@]}" dpkg -i "${debs[@]}" >/dev/null

say "epcomm --version, man -w epcomm"
first=$(epcomm --version) || fail "epcomm --version failed"
first=${first%%$'\n'*}
[ "$first" = "epcomm $upstream" ] || fail "epcomm --version printed '$first'"
if command -v man >/dev/null 2>&1; then
  page=$(man -w epcomm) || fail "man -w epcomm found no page"
  [ "$page" = /usr/share/man/man1/epcomm.1.gz ] || fail "man -w epcomm gives $page"
fi

check_output() { # what, output, expected lines (sorted)
  local what=$1 got=$2
  shift 2
  local want
  want=$(printf '%s\n' "$@")
  [ "$(printf '%s\n' "$got" | sort)" = "$want" ] || fail "$what printed:
$got
expected:
$want"
}

t=$work/programs
mkdir -p "$t"
say "C with pkg-config (shared and -static)"
# shellcheck disable=SC2046 # pkg-config's flags are meant to split into words
cc -std=c11 -Wall -Wextra -Werror examples/c/moe_two_ranks.c $(pkg-config --cflags --libs epcomm) -o "$t/c"
out=$("$t/c" deepep_low_latency) || fail "the C program failed"
check_output "the C program" "$out" \
  "rank 0 (deepep_low_latency, EXPERT_MAJOR): combined 20 13.75 48" \
  "rank 1 (deepep_low_latency, EXPERT_MAJOR): combined 70 42"
# shellcheck disable=SC2046
cc -static -std=c11 -Wall -Wextra -Werror examples/c/moe_two_ranks.c \
  $(pkg-config --static --cflags --libs epcomm) -o "$t/c_static" 2>"$t/static.log" \
  || { cat "$t/static.log" >&2; fail "cc -static with pkg-config --static failed"; }
out=$("$t/c_static" deepep_v2) || fail "the static C program failed"
check_output "the static C program" "$out" \
  "rank 0 (deepep_v2, EXPERT_PACKED): combined 20 13.75 48" \
  "rank 1 (deepep_v2, EXPERT_PACKED): combined 70 42"

say "C++ with pkg-config"
# shellcheck disable=SC2046
c++ -std=c++17 -Wall -Wextra -Werror examples/cpp/moe_two_ranks.cpp $(pkg-config --cflags --libs epcomm) -o "$t/cpp"
out=$("$t/cpp" deepep_high_throughput) || fail "the C++ program failed"
check_output "the C++ program" "$out" \
  "rank 0 (deepep_high_throughput): 20 13.75 48" "rank 1 (deepep_high_throughput): 70 42"

say "C and C++ with CMake (find_package(epcomm CONFIG REQUIRED), shared and static)"
for lang in c cpp; do
  for static in OFF ON; do
    b=$t/cmake-$lang-$static
    cmake -S "examples/$lang" -B "$b" -DEPCOMM_EXAMPLE_STATIC=$static >"$t/cmake.log" 2>&1 \
      && cmake --build "$b" >>"$t/cmake.log" 2>&1 \
      || { cat "$t/cmake.log" >&2; fail "CMake build of examples/$lang (static=$static) failed"; }
    grep -qx "epcomm_DIR:PATH=$libdir/cmake/epcomm" "$b/CMakeCache.txt" \
      || fail "CMake found epcomm elsewhere: $(grep '^epcomm_DIR' "$b/CMakeCache.txt")"
    out=$("$b/moe_two_ranks" nixl_ep) || fail "examples/$lang built with CMake (static=$static) failed"
    if [ "$lang" = c ]; then
      check_output "examples/c built with CMake (static=$static)" "$out" \
        "rank 0 (nixl_ep, EXPERT_MAJOR): combined 20 13.75 48" \
        "rank 1 (nixl_ep, EXPERT_MAJOR): combined 70 42"
    else
      check_output "examples/cpp built with CMake (static=$static)" "$out" \
        "rank 0 (nixl_ep): 20 13.75 48" "rank 1 (nixl_ep): 70 42"
    fi
  done
done

say "dpkg-shlibdeps: a program linked with the library depends on libepcomm0.1 of this version on"
mkdir -p "$t/shlibdeps/debian"
printf 'Source: probe\n\nPackage: probe\nArchitecture: any\n' >"$t/shlibdeps/debian/control"
deps=$(cd "$t/shlibdeps" && dpkg-shlibdeps -O "$t/c" 2>&1)
case "$deps" in
  *"libepcomm0.1 (>= $upstream)"*) ;;
  *) fail "dpkg-shlibdeps gives: $deps" ;;
esac

say "dpkg -r"
"${as_root[@]}" dpkg -r "${packages[@]}" >/dev/null
installed=0
for f in /usr/bin/epcomm "$libdir/$soname" "$libdir/libepcomm.so" /usr/include/epcomm.h \
  "$libdir/cmake/epcomm" /usr/share/man/man1/epcomm.1.gz; do
  [ ! -e "$f" ] || fail "$f is still there after dpkg -r"
done
say "ci-debian: all checks passed"
