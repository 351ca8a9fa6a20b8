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
import ast
import http.client
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

# The members read from each release (absent ones are fine: layouts moved between releases).
MEMBERS = (
    "vllm/envs.py",
    "vllm/config.py",
    "vllm/config/__init__.py",
    "vllm/config/parallel.py",
    "vllm/distributed/device_communicators/cuda_communicator.py",
)


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


class ReviewNeeded(Exception):
    """The release's source has a shape this script does not know: read it, then extend me."""


def strings(node):
    """The string constants of a list/tuple/set literal, in order."""
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        out = [e.value for e in node.elts if isinstance(e, ast.Constant)]
        if len(out) == len(node.elts) and all(isinstance(s, str) for s in out):
            return out
    raise ReviewNeeded("not a literal list of strings: %s" % ast.unparse(node))


def is_backend(node):
    """`all2all_backend` or `<x>.all2all_backend`."""
    return (isinstance(node, ast.Name) and node.id == "all2all_backend") or (
        isinstance(node, ast.Attribute) and node.attr == "all2all_backend"
    )


def tested_names(test):
    """The names an `if` on the all2all backend tests (`== "x"`, `in (...)`, or-ed), else None."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        parts = [tested_names(v) for v in test.values]
        return None if None in parts else [n for p in parts for n in p]
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and is_backend(test.left)):
        return None
    op, right = test.ops[0], test.comparators[0]
    if isinstance(op, ast.Eq) and isinstance(right, ast.Constant) and isinstance(right.value, str):
        return [right.value]
    if isinstance(op, ast.In):
        return strings(right)
    return None


def mentions_backend(node):
    """Whether `node` reads the all2all backend anywhere."""
    return any(is_backend(n) for n in ast.walk(node))


def branch_names(test):
    """The names a branch of the manager chain handles: as `tested_names`, and for
    `<test on the backend> and <other condition>` (0.34.0's `== "mori" and self._mori_ep_v2()`)
    the names of the backend test, the other condition not reading the backend."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        parts = [v for v in test.values if mentions_backend(v)]
        if len(parts) == 1:
            return tested_names(parts[0])
        return None
    return tested_names(test)


def excluded_name(test):
    """The name of `<backend> != "x"`, else None."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and is_backend(test.left)):
        return None
    op, right = test.ops[0], test.comparators[0]
    if isinstance(op, ast.NotEq) and isinstance(right, ast.Constant) and isinstance(right.value, str):
        return right.value
    return None


def log_texts(body):
    """The string constants of the logger calls directly in `body`."""
    out = []
    for stmt in body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            func = stmt.value.func
            if isinstance(func, ast.Attribute) and func.attr.startswith("warning"):
                out += [
                    c.value
                    for a in stmt.value.args
                    for c in ast.walk(a)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                ]
    return " ".join(out)


def message_template(joined, names):
    """An f-string's text with the rejected value as `{name}`; `names` maps the other names."""
    if isinstance(joined, ast.Constant):
        return joined.value
    out = []
    for part in joined.values:
        if isinstance(part, ast.Constant):
            out.append(part.value)
            continue
        key = ast.unparse(part.value)
        if key not in names:
            raise ReviewNeeded("f-string field {%s}" % key)
        value = names[key]
        if value != "{name}":
            value = repr(value) if part.conversion == ord("r") else str(value)
        out.append(value)
    return "".join(out)


def const_str(node):
    """The value of a string constant."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    raise ReviewNeeded("not a string constant: %s" % ast.unparse(node))


def call_name(call):
    """The called function's name (`f` of `f(...)` or `x.f(...)`)."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)


def env_rule(src):
    """How envs.py reads VLLM_ALL2ALL_BACKEND: None (absent), ("free", default) (a plain
    getenv), or ("choices", names, message, default) (env_with_choices, with its message)."""
    tree = ast.parse(src)
    entry = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "VLLM_ALL2ALL_BACKEND":
                    entry = v
    if entry is None:
        return None
    if isinstance(entry, ast.Lambda) and isinstance(entry.body, ast.Call):
        if call_name(entry.body) == "getenv":
            return ("free", const_str(entry.body.args[1]))
    if isinstance(entry, ast.Call) and call_name(entry) == "env_with_choices":
        kw = {k.arg: k.value for k in entry.keywords}
        if "case_sensitive" in kw or len(entry.args) > 3:
            raise ReviewNeeded("env_with_choices with case_sensitive")
        choices = strings(entry.args[2] if len(entry.args) > 2 else kw["choices"])
        default = entry.args[1] if len(entry.args) > 1 else kw["default"]
        if not (isinstance(default, ast.Constant) and default.value is None):
            default = const_str(default)
        else:
            default = None
        return ("choices", choices, choices_message(tree, choices), default)
    raise ReviewNeeded("VLLM_ALL2ALL_BACKEND is read by %s" % ast.unparse(entry))


def raised_value_errors(node):
    """The f-string (or string) messages of the `raise ValueError(...)` statements in `node`."""
    out = []
    for n in ast.walk(node):
        if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and n.exc.args:
            if call_name(n.exc) != "ValueError":
                continue
            msg = n.exc.args[0]
            if isinstance(msg, (ast.JoinedStr, ast.Constant)):
                out.append(msg)
    return out


def choices_message(tree, choices):
    """env_with_choices' ValueError text for VLLM_ALL2ALL_BACKEND, the value as `{name}`."""
    funcs = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "env_with_choices"
    ]
    if len(funcs) != 1:
        raise ReviewNeeded("env_with_choices is not defined once in envs.py")
    msgs = raised_value_errors(funcs[0])
    if len(msgs) != 1:
        raise ReviewNeeded("env_with_choices raises %d ValueErrors" % len(msgs))
    fields = {"value": "{name}", "env_name": "VLLM_ALL2ALL_BACKEND", "actual_choices": choices}
    return message_template(msgs[0], fields)


def literal_names(annotation, assigns):
    """The strings of a `Literal[...]` annotation (through `| None`, Optional and aliases)."""
    a = annotation
    if isinstance(a, ast.BinOp) and isinstance(a.op, ast.BitOr):
        sides = [
            s for s in (a.left, a.right) if not (isinstance(s, ast.Constant) and s.value is None)
        ]
        if len(sides) == 1:
            return literal_names(sides[0], assigns)
    if isinstance(a, ast.Subscript) and isinstance(a.value, ast.Name):
        if a.value.id == "Optional":
            return literal_names(a.slice, assigns)
        if a.value.id == "Literal":
            elts = a.slice.elts if isinstance(a.slice, ast.Tuple) else [a.slice]
            return strings(ast.Tuple(elts=elts))
    if isinstance(a, ast.Name) and a.id in assigns:
        return literal_names(assigns[a.id], assigns)
    raise ReviewNeeded("annotation %s is not a Literal" % ast.unparse(annotation))


def class_field(cls, name):
    """The annotation of field `name` of class `cls`, or None."""
    stmt = class_field_stmt(cls, name)
    return None if stmt is None else stmt.annotation


def class_field_stmt(cls, name):
    """The declaration of field `name` of class `cls`, or None."""
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", None) == name:
            return stmt
    return None


def field_default(stmt, env):
    """The default all2all name: the field's own (`= "x"`, `Field(default="x")`), else, where
    it defaults to None, the environment variable's."""
    value = stmt.value if stmt is not None else None
    if isinstance(value, ast.Call) and call_name(value) == "Field":
        value = {k.arg: k.value for k in value.keywords}.get("default")
    if value is not None and not (isinstance(value, ast.Constant) and value.value is None):
        return const_str(value)
    if env is None or env[-1] is None:
        raise ReviewNeeded("all2all_backend has no default")
    return env[-1]


def config_module(files):
    """(tree, {module-level name: value}, {class name: ClassDef}) of the module that defines
    ParallelConfig (vllm/config.py before vllm/config/ was a package)."""
    for path in ("vllm/config/parallel.py", "vllm/config/__init__.py", "vllm/config.py"):
        if path not in files:
            continue
        tree = ast.parse(files[path])
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        if "ParallelConfig" in classes:
            assigns = {
                t.id: n.value
                for n in tree.body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            return tree, assigns, classes
    raise ReviewNeeded("no ParallelConfig in %s" % sorted(files))


def config_rewrites(cls):
    """{name: (target, status)} for the names ParallelConfig rewrites with a warning: removed
    ("... has been removed. Falling back to ...") or deprecated (an alias)."""
    out = {}
    for node in ast.walk(cls):
        if not isinstance(node, ast.If):
            continue
        names = tested_names(node.test)
        targets = [
            s.value.value
            for s in node.body
            if isinstance(s, ast.Assign)
            and len(s.targets) == 1
            and is_backend(s.targets[0])
            and isinstance(s.value, ast.Constant)
        ]
        if names is None or not targets:
            continue
        text = log_texts(node.body)
        status = "Removed" if "removed" in text else "Alias" if "deprecated" in text else None
        if status is None or len(targets) != 1:
            raise ReviewNeeded("ParallelConfig rewrites %s without a known warning" % names)
        out.update({n: (targets[0], status) for n in names if n != targets[0]})
    return out


CUDA_COMMUNICATOR = "vllm/distributed/device_communicators/cuda_communicator.py"
UNKNOWN_PREFIX = "Unknown all2all backend: "


def if_chain(node):
    """The branches of an if/elif chain and its final else body."""
    branches = []
    while True:
        branches.append(node)
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            node = node.orelse[0]
        else:
            return branches, node.orelse


def unknown_message(body):
    """The `Unknown all2all backend: ...` f-string raised in `body`, or None."""
    for msg in raised_value_errors(ast.Module(body=body, type_ignores=[])):
        head = msg.values[0] if isinstance(msg, ast.JoinedStr) else msg
        if isinstance(head, ast.Constant) and str(head.value).startswith(UNKNOWN_PREFIX):
            return msg
    return None


def communicator_facts(src):
    """From cuda_communicator.py's if/elif chain that builds the all2all manager: the names it
    handles (in order), {alias: name it resolves to}, and its message for any other name."""
    tree = ast.parse(src)
    best = None
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and tested_names(node.test) is not None:
            branches, rest = if_chain(node)
            msg = unknown_message(rest)
            if msg is not None and (best is None or len(branches) > len(best[0])):
                best = (branches, msg)
    if best is None:
        raise ReviewNeeded("no all2all manager chain in cuda_communicator.py")
    names, aliases = [], {}
    for branch in best[0]:
        handled = branch_names(branch.test)
        if handled is None:
            raise ReviewNeeded("branch %s" % ast.unparse(branch.test))
        for inner in branch.body:
            if not (isinstance(inner, ast.If) and "deprecated" in log_texts(inner.body)):
                continue
            inner_names = tested_names(inner.test)
            kept = excluded_name(inner.test)
            if inner_names and len(inner_names) == 1:
                # `if backend == "old": warn(deprecated)`: "old" is an alias of the other name.
                others = [n for n in handled if n != inner_names[0]]
                aliases[inner_names[0]] = others[0]
            elif kept in handled:
                # `if backend != "new": warn(deprecated)` (0.34.0's MoRI names): every other
                # name of the branch is a deprecated alias of "new".
                aliases.update({n: kept for n in handled if n != kept})
            else:
                raise ReviewNeeded("deprecation under %s" % ast.unparse(inner.test))
        names += [n for n in handled if n not in names]
    fields = {"all2all_backend": "{name}", "self.all2all_backend": "{name}"}
    return names, aliases, message_template(best[1], fields)


def analyse(files):
    """The row of one release, or None where its all2all backend is not configurable."""
    env = env_rule(files["vllm/envs.py"])
    tree, assigns, classes = config_module(files)
    field_stmt = class_field_stmt(classes["ParallelConfig"], "all2all_backend")
    field = None if field_stmt is None else field_stmt.annotation
    if field is None and env is None:
        return None
    cc_names, aliases, cc_message = communicator_facts(files[CUDA_COMMUNICATOR])
    if field is not None:
        pydantic = [
            n
            for n in tree.body
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("pydantic")
        ]
        if not pydantic:
            raise ReviewNeeded("ParallelConfig's Literal without pydantic")
        rule, names, message = "Literal", literal_names(field, assigns), None
    elif env[0] == "choices":
        rule, names, message = "EnvChoices", env[1], env[2]
    else:
        rule, names, message = "Communicator", cc_names, cc_message
    rewrites = config_rewrites(classes["ParallelConfig"]) if field is not None else {}
    status, resolves = [], []
    for n in names:
        if n in rewrites:
            target, kind = rewrites[n]
        elif n in aliases:
            target, kind = aliases[n], "Alias"
        elif n in cc_names:
            target, kind = n, "Canonical"
        else:
            raise ReviewNeeded("'%s' is accepted but neither built nor rewritten" % n)
        status.append(kind)
        resolves.append(target)
    eplb = []
    if "EPLBConfig" in classes:
        ann = class_field(classes["EPLBConfig"], "communicator")
        eplb = literal_names(ann, assigns) if ann is not None else []
    default = field_default(field_stmt, env)
    if default not in names:
        raise ReviewNeeded("the default '%s' is not an accepted name" % default)
    return {
        "rule": rule,
        "default": default,
        "message": message,
        "names": names,
        "status": status,
        "resolves": resolves,
        "eplb": eplb,
    }


RULES = {"Literal": "literal", "EnvChoices": "env_choices", "Communicator": "communicator"}
STATUSES = {"Canonical": "canonical", "Alias": "alias", "Removed": "removed"}


def release_entry(version, source, facts):
    """One release of the data file, as src/select/versions.rs reads it."""
    return {
        "version": version,
        "source": source,
        "rule": RULES[facts["rule"]],
        "error": facts["message"],
        "default": facts["default"],
        "names": facts["names"],
        "status": [STATUSES[s] for s in facts["status"]],
        "resolves": facts["resolves"],
        "eplb": facts["eplb"],
    }


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
