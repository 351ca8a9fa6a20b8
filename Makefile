# Builds and installs epcomm as a system library and command:
#
#   make                      # cargo: the release library (with its SONAME) and the epcomm binary
#   sudo make install         # only copies what `make` built, so root needs no cargo on its PATH
#   sudo make uninstall       # removes what install copied (pass the same variables)
#   make install DESTDIR=/tmp/stage PREFIX=/usr LIBDIR=/usr/lib/x86_64-linux-gnu
#
# Installs, under the GNU-style directory variables below (DESTDIR stages the whole tree):
#   LIBDIR/libepcomm.so.X.Y.Z, its SONAME link (libepcomm.so.0.Y while X is 0, else .so.X) and
#   libepcomm.so; LIBDIR/libepcomm.a; INCLUDEDIR/epcomm.h and epcomm.hpp; PKGCONFIGDIR/epcomm.pc;
#   CMAKEDIR/epcommConfig.cmake and epcommConfigVersion.cmake (find_package(epcomm CONFIG));
#   BINDIR/epcomm; MANDIR/man1/epcomm.1. INSTALL, INSTALL_PROGRAM and INSTALL_DATA name the copy
#   commands, as in the GNU coding standards (e.g. INSTALL_PROGRAM='install -s' to strip).

PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
DATAROOTDIR ?= $(PREFIX)/share
MANDIR ?= $(DATAROOTDIR)/man
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
CMAKEDIR ?= $(LIBDIR)/cmake/epcomm
DESTDIR ?=
INSTALL ?= install
INSTALL_PROGRAM ?= $(INSTALL) -m 755
INSTALL_DATA ?= $(INSTALL) -m 644
CARGO ?= cargo
CARGOFLAGS ?=
# A cargo target directory of its own: builds for installation carry a SONAME (EPCOMM_SONAME=1),
# so sharing target/release with plain `cargo build --release` would rebuild on every switch.
BUILDDIR ?= target/make

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
MAJOR := $(word 1,$(subst ., ,$(VERSION)))
MINOR := $(word 2,$(subst ., ,$(VERSION)))
ifeq ($(MAJOR),0)
SONAME := libepcomm.so.0.$(MINOR)
else
SONAME := libepcomm.so.$(MAJOR)
endif
REAL := libepcomm.so.$(VERSION)

# System libraries a static link of libepcomm.a needs: what
# `cargo rustc --release --lib --crate-type staticlib -- --print native-static-libs` reports
# (-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc) less -lgcc_s, which exists only as a shared
# library (the C compiler driver links the unwinder itself: libgcc_s, or libgcc_eh with
# -static), and -lc, which every link has.
NATIVE_LIBS := util rt pthread m dl

OUT := $(BUILDDIR)/release
BUILT := $(OUT)/libepcomm.so $(OUT)/libepcomm.a $(OUT)/epcomm
MANPAGE := man/epcomm.1

# Paths of the installed tree relative to CMAKEDIR (the CMake package finds the library and
# headers from its own location, so staged and moved installations work).
relpath = $(shell realpath -m --relative-to='$(1)' '$(2)')
# A directory under PREFIX as pkg-config's ${prefix}/..., anything else as given.
pcpath = $(patsubst $(PREFIX)/%,$${prefix}/%,$(1))
empty :=
space := $(empty) $(empty)
sizeof_void_p = $(if $(filter 32,$(shell getconf LONG_BIT)),4,8)

.PHONY: all install uninstall check clean

all:
	EPCOMM_SONAME=1 $(CARGO) build --release --target-dir '$(BUILDDIR)' --lib --bin epcomm $(CARGOFLAGS)

install:
	@for f in $(BUILT); do \
	  test -f "$$f" || { echo "make install: $$f is missing; run 'make' first (install only copies)" >&2; exit 1; }; \
	done
	$(INSTALL) -d '$(DESTDIR)$(LIBDIR)' '$(DESTDIR)$(INCLUDEDIR)' '$(DESTDIR)$(PKGCONFIGDIR)' \
	    '$(DESTDIR)$(CMAKEDIR)' '$(DESTDIR)$(BINDIR)' '$(DESTDIR)$(MANDIR)/man1'
	$(INSTALL_DATA) '$(OUT)/libepcomm.so' '$(DESTDIR)$(LIBDIR)/$(REAL)'
	ln -sf '$(REAL)' '$(DESTDIR)$(LIBDIR)/$(SONAME)'
	ln -sf '$(SONAME)' '$(DESTDIR)$(LIBDIR)/libepcomm.so'
	$(INSTALL_DATA) '$(OUT)/libepcomm.a' '$(DESTDIR)$(LIBDIR)/libepcomm.a'
	$(INSTALL_DATA) include/epcomm.h include/epcomm.hpp '$(DESTDIR)$(INCLUDEDIR)/'
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(call pcpath,$(LIBDIR))|' \
	    -e 's|@INCLUDEDIR@|$(call pcpath,$(INCLUDEDIR))|' -e 's|@VERSION@|$(VERSION)|' \
	    -e 's|@LIBS_PRIVATE@|$(addprefix -l,$(NATIVE_LIBS))|' \
	    epcomm.pc.in > '$(DESTDIR)$(PKGCONFIGDIR)/epcomm.pc'
	sed -e 's|@VERSION@|$(VERSION)|' -e 's|@REAL@|$(REAL)|' -e 's|@SONAME@|$(SONAME)|' \
	    -e 's|@CMAKE_TO_LIBDIR@|$(call relpath,$(CMAKEDIR),$(LIBDIR))|' \
	    -e 's|@CMAKE_TO_INCLUDEDIR@|$(call relpath,$(CMAKEDIR),$(INCLUDEDIR))|' \
	    -e 's|@NATIVE_LIBS@|$(subst $(space),;,$(NATIVE_LIBS))|' \
	    cmake/epcommConfig.cmake.in > '$(DESTDIR)$(CMAKEDIR)/epcommConfig.cmake'
	sed -e 's|@VERSION@|$(VERSION)|' -e 's|@MAJOR@|$(MAJOR)|' -e 's|@MINOR@|$(MINOR)|' \
	    -e 's|@SONAME@|$(SONAME)|' -e 's|@SIZEOF_VOID_P@|$(sizeof_void_p)|' \
	    cmake/epcommConfigVersion.cmake.in > '$(DESTDIR)$(CMAKEDIR)/epcommConfigVersion.cmake'
	$(INSTALL_PROGRAM) '$(OUT)/epcomm' '$(DESTDIR)$(BINDIR)/epcomm'
	$(INSTALL_DATA) '$(MANPAGE)' '$(DESTDIR)$(MANDIR)/man1/epcomm.1'

uninstall:
	rm -f '$(DESTDIR)$(LIBDIR)/$(REAL)' '$(DESTDIR)$(LIBDIR)/$(SONAME)' \
	      '$(DESTDIR)$(LIBDIR)/libepcomm.so' '$(DESTDIR)$(LIBDIR)/libepcomm.a' \
	      '$(DESTDIR)$(INCLUDEDIR)/epcomm.h' '$(DESTDIR)$(INCLUDEDIR)/epcomm.hpp' \
	      '$(DESTDIR)$(PKGCONFIGDIR)/epcomm.pc' \
	      '$(DESTDIR)$(CMAKEDIR)/epcommConfig.cmake' '$(DESTDIR)$(CMAKEDIR)/epcommConfigVersion.cmake' \
	      '$(DESTDIR)$(BINDIR)/epcomm' '$(DESTDIR)$(MANDIR)/man1/epcomm.1'
	rmdir '$(DESTDIR)$(CMAKEDIR)' 2>/dev/null || true

check:
	$(CARGO) test

clean:
	rm -rf '$(BUILDDIR)'
