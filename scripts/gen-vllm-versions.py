#!/usr/bin/env python3
"""Regenerates the vLLM release table, src/select/vllm-releases.json, from PyPI.

A new vLLM release is one command plus a review:

    scripts/gen-vllm-versions.py                 # fetches what is new, rewrites the data file
    git diff src/select/vllm-releases.json       # review the new entry: names, statuses, rule

The library includes the file at build time (src/select/versions.rs parses it). `--check`
rewrites nothing and exits 1 when the file differs from what would be generated (`--only V,V`
limits the run, and the check, to those releases' entries). Exit status 2: a release's source
has a shape the script does not know (read it, extend the script); 3: PyPI cannot be reached
(and the cache lacks what is needed).

For every final release on PyPI from the first one in which the all2all backend is configurable
(the `VLLM_ALL2ALL_BACKEND` environment variable in vllm/envs.py, later
`ParallelConfig.all2all_backend`), the script reads the release's own Python source with `ast`:
from the sdist, streamed and never stored whole; where PyPI has no sdist, from a wheel, whose
needed members are fetched with HTTP range requests. Only those members are kept, under
--cache (default ./target/vllm-releases), so a second run reads no network. Per release it finds
  - the all2all names accepted, in the source's order (the `All2AllBackend` Literal, or the
    environment variable's choices),
  - how an unknown name is rejected (the Literal; envs.py's choices check and its message; or
    nothing before the communicator's `Unknown all2all backend: ...`),
  - each name's status: canonical; alias (the communicator builds another name's manager for
    it, or its own under a deprecation warning: `if name == "old": warn` beside the new name,
    or from 0.34.0 `if name != "new": warn` in a branch of several names); removed (the
    configuration warns that it was removed and rewrites it to another backend),
  - the default name (the field's default; the environment variable's where that is None),
  - the EPLB communicator names (the `EPLBCommunicatorBackend` Literal; none before it exists).
A branch of the communicator's chain may test the name `and` another condition (0.34.0:
`== "mori" and self._mori_ep_v2()`); the name is then handled there and in a later branch.
Pre-releases and dev releases are skipped. Only the Python standard library (3.9 or later:
`ast.unparse`) is used.
"""

import argparse
import http.client
import importlib.util
import json
import os
import re
import shutil
import socket
import struct
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zlib

PYPI_JSON = "https://pypi.org/pypi/vllm/json"
# What a missing or failing network raises (exit status 3, so a test can tell "offline").
NETWORK_ERRORS = (
    urllib.error.URLError,
    http.client.HTTPException,
    ConnectionError,
    socket.timeout,
)
# The scan starts here; the script checks that this release has no configurable all2all
# backend, so the first release that has one is found, not assumed.
SCAN_FROM = "0.8.0"
HERE = os.path.dirname(os.path.abspath(__file__))
DATA_FILE = os.path.join(HERE, "..", "src", "select", "vllm-releases.json")
GENERATED_BY = "scripts/gen-vllm-versions.py: do not edit by hand"

# The reading of a release's source has one home, shared with epcomm's validation against the
# deployed vLLM: python/epcomm/vllm_release.py (loaded by path: the package's __init__ would
# load the C library).
_spec = importlib.util.spec_from_file_location(
    "vllm_release", os.path.join(HERE, "..", "python", "epcomm", "vllm_release.py")
)
vllm_release = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_release)
ReviewNeeded = vllm_release.ReviewNeeded
analyse = vllm_release.analyse
release_entry = vllm_release.release_entry
MEMBERS = vllm_release.MEMBERS


def version_key(v):
    """Sort key of a final release number such as 0.9.0.1 or 0.6.1.post1."""
    main, _, post = v.partition(".post")
    return tuple(int(p) for p in main.split(".")), int(post or -1)


def is_final(v):
    """A final release (no rc/a/b/dev)."""
    return re.fullmatch(r"\d+(\.\d+)+(\.post\d+)?", v) is not None


def http_get(url, byte_range=None):
    """The body of `url` (the bytes `byte_range` = (start, end) inclusive, if given)."""
    req = urllib.request.Request(url)
    if byte_range is not None:
        req.add_header("Range", "bytes=%d-%d" % byte_range)
    with urllib.request.urlopen(req, timeout=120) as resp:
        data = resp.read()
    if byte_range is not None and len(data) != byte_range[1] - byte_range[0] + 1:
        raise RuntimeError("%s: range %s gave %d bytes" % (url, byte_range, len(data)))
    return data


def absolute(url):
    """PyPI's file URLs may be relative to the JSON API's address."""
    return urllib.parse.urljoin(PYPI_JSON, url)


def sdist_members(url, version):
    """The wanted members of an sdist, streamed (the archive is never stored)."""
    found = {}
    with urllib.request.urlopen(absolute(url), timeout=300) as resp:
        with tarfile.open(fileobj=resp, mode="r|gz") as tar:
            for m in tar:
                name = m.name.split("/", 1)[-1]
                if m.isfile() and name in MEMBERS:
                    found[name] = tar.extractfile(m).read()
    return found


def zip_directory(url, size):
    """{name: (local header offset, compressed size, method)} of a remote zip."""
    tail_len = min(size, 1 << 16)
    tail = http_get(url, (size - tail_len, size - 1))
    eocd = tail.rfind(b"PK\x05\x06")
    if eocd < 0:
        raise RuntimeError("%s: no end of central directory" % url)
    cd_size, cd_off = struct.unpack("<II", tail[eocd + 12 : eocd + 20])
    if cd_off == 0xFFFFFFFF:  # zip64: the real offsets are in the zip64 record
        loc = tail.rfind(b"PK\x06\x07", 0, eocd)
        (z64_off,) = struct.unpack("<Q", tail[loc + 8 : loc + 16])
        rec = http_get(url, (z64_off, z64_off + 55))
        cd_size, cd_off = struct.unpack("<QQ", rec[40:56])
    cd = http_get(url, (cd_off, cd_off + cd_size - 1))
    entries, pos = {}, 0
    while cd[pos : pos + 4] == b"PK\x01\x02":
        method, = struct.unpack("<H", cd[pos + 10 : pos + 12])
        csize, usize = struct.unpack("<II", cd[pos + 20 : pos + 28])
        nlen, elen, clen = struct.unpack("<HHH", cd[pos + 28 : pos + 34])
        (off,) = struct.unpack("<I", cd[pos + 42 : pos + 46])
        name = cd[pos + 46 : pos + 46 + nlen].decode()
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + elen]
        csize, off = zip64_sizes(extra, usize, csize, off)
        entries[name] = (off, csize, method)
        pos += 46 + nlen + elen + clen
    return entries


def zip64_sizes(extra, usize, csize, off):
    """Compressed size and offset from a zip64 extra field where the 32-bit ones overflow."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, ln = struct.unpack("<HH", extra[pos : pos + 4])
        if tag == 1:
            vals = list(struct.unpack("<%dQ" % (ln // 8), extra[pos + 4 : pos + 4 + ln]))
            if usize == 0xFFFFFFFF:
                vals.pop(0)
            if csize == 0xFFFFFFFF:
                csize = vals.pop(0)
            if off == 0xFFFFFFFF:
                off = vals.pop(0)
        pos += 4 + ln
    return csize, off


def wheel_members(url, size):
    """The wanted members of a wheel, each fetched by a range request."""
    url = absolute(url)
    entries = zip_directory(url, size)
    found = {}
    for name in MEMBERS:
        if name not in entries:
            continue
        off, csize, method = entries[name]
        head = http_get(url, (off, off + 29))
        nlen, elen = struct.unpack("<HH", head[26:30])
        start = off + 30 + nlen + elen
        raw = http_get(url, (start, start + csize - 1)) if csize else b""
        found[name] = zlib.decompress(raw, -15) if method == 8 else raw
    return found


def pick_file(files):
    """The sdist, else the smallest wheel (every wheel holds the same Python files)."""
    sdists = [f for f in files if f["packagetype"] == "sdist"]
    if sdists:
        return "sdist", sdists[0]
    wheels = sorted(
        (f for f in files if f["packagetype"] == "bdist_wheel"),
        key=lambda f: (f["size"], f["filename"]),
    )
    if not wheels:
        raise RuntimeError("no sdist or wheel")
    return "wheel", wheels[0]


def release_files(version, files, cache):
    """{member: text} of one release, from the cache or PyPI; and "sdist" or "wheel"."""
    where = os.path.join(cache, version)
    manifest = os.path.join(where, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            meta = json.load(f)
        if meta["members"] == list(MEMBERS):
            return read_cached(where, meta), meta["source"]
    source, info = pick_file(files)
    if source == "sdist":
        found = sdist_members(info["url"], version)
    else:
        found = wheel_members(info["url"], info["size"])
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=version + ".", suffix=".partial", dir=cache)
    for name, data in found.items():
        path = os.path.join(tmp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    meta = {
        "source": source,
        "file": info["filename"],
        "members": list(MEMBERS),
        "found": sorted(found),
    }
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(meta, f, indent=1)
    # Another run may have put the same files in place meanwhile: either copy will do.
    if os.path.exists(where):
        shutil.rmtree(where, ignore_errors=True)
    try:
        os.rename(tmp, where)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return read_cached(where, meta), source


def read_cached(where, meta):
    out = {}
    for name in meta["found"]:
        with open(os.path.join(where, name), encoding="utf-8") as f:
            out[name] = f.read()
    return out


def pypi_releases():
    """[(version, files)] of every final release, oldest first."""
    with urllib.request.urlopen(PYPI_JSON, timeout=120) as resp:
        data = json.load(resp)
    rel = [(v, fs) for v, fs in data["releases"].items() if is_final(v) and fs]
    return sorted(rel, key=lambda r: version_key(r[0]))




def render_entry(entry):
    """An entry's text: one key a line, so that a new release or a changed name is a readable
    diff."""
    keys = ["   %s: %s" % (json.dumps(k), json.dumps(v)) for k, v in entry.items()]
    return "  {\n" + ",\n".join(keys) + "\n  }"


def render_table(entries):
    """The whole data file."""
    body = ",\n".join(render_entry(e) for e in entries)
    return '{\n "generated_by": %s,\n "releases": [\n%s\n ]\n}\n' % (
        json.dumps(GENERATED_BY),
        body,
    )


def file_entries(text):
    """{version: entry} of a data file's text."""
    try:
        data = json.loads(text)
        return {e["version"]: e for e in data["releases"]}
    except (ValueError, KeyError, TypeError) as e:
        raise ReviewNeeded("the data file is not the generator's JSON: %s" % e)


def release_list(cache):
    """PyPI's final releases; the copy under `cache` when PyPI cannot be reached."""
    saved = os.path.join(cache, "pypi-vllm.json")
    try:
        rel = pypi_releases()
    except NETWORK_ERRORS as e:
        if not os.path.exists(saved):
            raise
        print("gen-vllm-versions: PyPI unreachable (%s): using %s" % (e, saved), file=sys.stderr)
        with open(saved) as f:
            return json.load(f)
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="pypi-vllm.", suffix=".partial", dir=cache)
    with os.fdopen(fd, "w") as f:
        json.dump(rel, f)
    os.replace(tmp, saved)
    return rel


def generate(cache, only, verbose):
    """The entries of every configurable release (of `only`, if given), oldest first."""
    entries, seen_configurable = [], False
    for version, files in release_list(cache):
        if version_key(version) < version_key(SCAN_FROM) or (only and version not in only):
            continue
        sources, source = release_files(version, files, cache)
        try:
            facts = analyse(sources)
        except ReviewNeeded as e:
            raise ReviewNeeded("vLLM %s: %s" % (version, e)) from None
        if version == SCAN_FROM and facts is not None:
            raise ReviewNeeded("vLLM %s is configurable already: lower SCAN_FROM" % version)
        if facts is None:
            if seen_configurable:
                raise ReviewNeeded("vLLM %s has no all2all backend setting" % version)
            continue
        seen_configurable = True
        if verbose:
            line = "gen-vllm-versions: %s (%s): %s" % (version, source, facts["rule"])
            print(line, file=sys.stderr)
        entries.append(release_entry(version, source, facts))
    missing = sorted(set(only or ()) - {e["version"] for e in entries})
    if missing:
        raise ReviewNeeded("no such configurable release on PyPI: %s" % ", ".join(missing))
    return entries


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=os.path.join("target", "vllm-releases"))
    ap.add_argument("--check", action="store_true", help="exit 1 if the file would change")
    ap.add_argument("--only", help="comma-separated releases (--check compares only their rows)")
    ap.add_argument("--file", default=os.path.normpath(DATA_FILE), help="the data file to write")
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    if only and not args.check:
        ap.error("--only needs --check (the table holds every release)")
    try:
        entries = generate(args.cache, only, not args.check)
        text = None
        if args.check:
            with open(args.file, encoding="utf-8") as f:
                text = f.read()
            committed = file_entries(text)
    except ReviewNeeded as e:
        print("gen-vllm-versions: review needed: %s" % e, file=sys.stderr)
        return 2
    except NETWORK_ERRORS as e:
        print("gen-vllm-versions: cannot reach PyPI: %s" % e, file=sys.stderr)
        return 3
    if args.check:
        stale = [e["version"] for e in entries if committed.get(e["version"]) != e] if only else []
        if (not only and text != render_table(entries)) or stale:
            print("gen-vllm-versions: %s is out of date%s: run scripts/gen-vllm-versions.py"
                  % (args.file, (" (" + ", ".join(stale) + ")") if stale else ""), file=sys.stderr)
            return 1
        print("gen-vllm-versions: %s matches %d releases" % (args.file, len(entries)),
              file=sys.stderr)
        return 0
    with open(args.file + ".partial", "w", encoding="utf-8") as f:
        f.write(render_table(entries))
    os.replace(args.file + ".partial", args.file)
    print("gen-vllm-versions: wrote %d releases to %s" % (len(entries), args.file), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
