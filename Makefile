# Builds and installs libepcomm as a system library:
#   make && make install PREFIX=/usr/local DESTDIR=/tmp/stage && make uninstall PREFIX=...
# Installs lib/libepcomm.so.X.Y.Z (SONAME libepcomm.so.0.Y) with its symlinks, lib/libepcomm.a,
# include/epcomm.h, include/epcomm.hpp and lib/pkgconfig/epcomm.pc.

PREFIX ?= /usr/local
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
PKGCONFIGDIR ?= $(LIBDIR)/pkgconfig
DESTDIR ?=
CARGO ?= cargo
CARGOFLAGS ?=

VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n 1)
MAJOR := $(word 1,$(subst ., ,$(VERSION)))
MINOR := $(word 2,$(subst ., ,$(VERSION)))
ifeq ($(MAJOR),0)
SONAME := libepcomm.so.0.$(MINOR)
else
SONAME := libepcomm.so.$(MAJOR)
endif
REAL := libepcomm.so.$(VERSION)

.PHONY: all install uninstall check clean

all:
	EPCOMM_SONAME=1 $(CARGO) build --release --lib $(CARGOFLAGS)

install: all
	install -d $(DESTDIR)$(LIBDIR) $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(PKGCONFIGDIR)
	install -m 755 target/release/libepcomm.so $(DESTDIR)$(LIBDIR)/$(REAL)
	ln -sf $(REAL) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libepcomm.so
	install -m 644 target/release/libepcomm.a $(DESTDIR)$(LIBDIR)/libepcomm.a
	install -m 644 include/epcomm.h $(DESTDIR)$(INCLUDEDIR)/epcomm.h
	if [ -f include/epcomm.hpp ]; then install -m 644 include/epcomm.hpp $(DESTDIR)$(INCLUDEDIR)/epcomm.hpp; fi
	sed -e 's|@PREFIX@|$(PREFIX)|' -e 's|@LIBDIR@|$(LIBDIR)|' -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|' \
	    -e 's|@VERSION@|$(VERSION)|' epcomm.pc.in > $(DESTDIR)$(PKGCONFIGDIR)/epcomm.pc

uninstall:
	rm -f $(DESTDIR)$(LIBDIR)/$(REAL) $(DESTDIR)$(LIBDIR)/$(SONAME) $(DESTDIR)$(LIBDIR)/libepcomm.so \
	      $(DESTDIR)$(LIBDIR)/libepcomm.a $(DESTDIR)$(INCLUDEDIR)/epcomm.h \
	      $(DESTDIR)$(INCLUDEDIR)/epcomm.hpp $(DESTDIR)$(PKGCONFIGDIR)/epcomm.pc

check:
	$(CARGO) test

clean:
	$(CARGO) clean
