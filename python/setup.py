"""Builds the epcomm package so that it carries libepcomm.so and works on its own.

The library copied into the package comes from, in order:

1. ``EPCOMM_LIBRARY``, the path of a libepcomm.so;
2. the repository this directory sits in: ``target/release/libepcomm.so``, else
   ``target/debug/libepcomm.so`` (under ``CARGO_TARGET_DIR`` when that is set);
3. ``cargo build --release --lib`` in that repository, when cargo is on PATH.

When none of these gives a library, or ``EPCOMM_BUNDLE_LIBRARY=0`` is set, the package is built
without one and loads the system's libepcomm at import (e.g. after ``make install``). A wheel
that carries the library is tagged for this platform (``py3-none-<platform>``): the library is
native code, but ctypes loads it, so it does not depend on the Python version.
"""

import glob
import os
import shutil
import subprocess
import sys

import setuptools
from setuptools import Distribution, setup
from setuptools.command.build_py import build_py as _build_py

try:  # setuptools >= 70.1 has bdist_wheel; before that it is the wheel package's.
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:
        _bdist_wheel = None

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
LIB_NAME = "libepcomm.so"


def _say(message):
    # pip shows a build's output only with -v, or when the build fails.
    print(f"epcomm setup: {message}", file=sys.stderr)


def _target_dir():
    return os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")


def _built_library():
    for profile in ("release", "debug"):
        path = os.path.join(_target_dir(), profile, LIB_NAME)
        if os.path.isfile(path):
            return path
    return None


def _cargo_build():
    if not os.path.isfile(os.path.join(REPO, "Cargo.toml")):
        return None
    cargo = shutil.which("cargo")
    if cargo is None:
        return None
    _say(f"building the library: cargo build --release --lib (in {REPO})")
    done = subprocess.run([cargo, "build", "--release", "--lib"], cwd=REPO, check=False)
    if done.returncode != 0:
        _say(f"cargo build failed with exit code {done.returncode}")
        return None
    path = os.path.join(_target_dir(), "release", LIB_NAME)
    return path if os.path.isfile(path) else None


_FOUND = []


def library():
    """The libepcomm.so to carry, or None; looked up once per setup.py run."""
    if _FOUND:
        return _FOUND[0]
    if os.environ.get("EPCOMM_BUNDLE_LIBRARY") == "0":
        _say("EPCOMM_BUNDLE_LIBRARY=0: building a package without the library")
        lib = None
    else:
        env = os.environ.get("EPCOMM_LIBRARY")
        if env:
            if not os.path.isfile(env):
                raise SystemExit(f"epcomm setup: EPCOMM_LIBRARY={env} is not a file")
            lib = env
        else:
            lib = _built_library() or _cargo_build()
        if lib is None:
            _say(
                "no libepcomm.so found (EPCOMM_LIBRARY unset, no target/release or target/debug "
                "build, no cargo to build one): building a package without the library; it will "
                "load the system's libepcomm (make install) at import"
            )
        else:
            _say(f"carrying {lib}")
    _FOUND.append(lib)
    return lib


class build_py(_build_py):
    """Copies the library into the built package, replacing whatever an earlier build left."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "epcomm")
        for stale in glob.glob(os.path.join(dest, "libepcomm.so*")):
            os.remove(stale)
        lib = library()
        if lib is not None:
            os.makedirs(dest, exist_ok=True)
            target = os.path.join(dest, LIB_NAME)
            shutil.copyfile(lib, target)  # follows a symlink to the real file
            os.chmod(target, 0o755)


class EpcommDistribution(Distribution):
    """Counts as having native code when it carries the library: installed into platlib, and
    the wheel is not pure."""

    def has_ext_modules(self):
        return library() is not None


cmdclass = {"build_py": build_py}

if _bdist_wheel is not None:

    class bdist_wheel(_bdist_wheel):
        """A wheel carrying the library is platform-specific but not tied to a Python ABI."""

        def get_tag(self):
            python, abi, plat = super().get_tag()
            if self.root_is_pure:
                return python, abi, plat
            return "py3", "none", plat

    cmdclass["bdist_wheel"] = bdist_wheel

# The licence, from setup.py so that both old and new setuptools take it: setuptools 77 and
# later want an SPDX expression (License-Expression), which older ones reject in pyproject.toml.
try:
    _SETUPTOOLS_MAJOR = int(setuptools.__version__.split(".")[0])
except ValueError:
    _SETUPTOOLS_MAJOR = 0
if _SETUPTOOLS_MAJOR >= 77:
    _LICENSE = {"license_expression": "MIT OR Apache-2.0"}
else:
    _LICENSE = {"license": "MIT OR Apache-2.0"}

setup(cmdclass=cmdclass, distclass=EpcommDistribution, **_LICENSE)
