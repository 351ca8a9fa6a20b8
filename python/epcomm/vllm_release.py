"""What a vLLM release accepts, read from its own Python source with `ast` (standard library
only; Python 3.9 or later): the all2all backend names of `ParallelConfig.all2all_backend` (or
`VLLM_ALL2ALL_BACKEND` before it), each name's status, how an unknown name is refused, the
default, and the EPLB communicator names. The one home of that reading: scripts/
gen-vllm-versions.py builds the release table (src/select/vllm-releases.json) with it, and
epcomm validates against the deployed vLLM with it (`epcomm check --vllm-src DIR`, Python
`check(..., vllm_version="auto")`), sending the description as the configuration's
`"vllm_release"`.

    python3 vllm_release.py DIR [--version V]

prints the description of the vLLM in DIR (a source tree, an sdist, site-packages or the
installed `vllm` package directory) as one JSON object. Exit status 2: the source has a shape
this reader does not know, or DIR holds no vLLM source.
"""

import ast
import json
import os
import re
import sys

# The members read from a release (absent ones are fine: layouts moved between releases).
MEMBERS = (
    "vllm/envs.py",
    "vllm/config.py",
    "vllm/config/__init__.py",
    "vllm/config/parallel.py",
    "vllm/distributed/device_communicators/cuda_communicator.py",
)


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


def tree_root(path):
    """The directory holding `vllm/` for a source tree, an sdist, site-packages or the `vllm`
    package directory itself; None when there is none."""
    path = os.path.abspath(path)
    for root in (path, os.path.dirname(path)):
        if os.path.isfile(os.path.join(root, "vllm", "envs.py")):
            if os.path.basename(path) == "vllm" and root != path:
                return root
            if root == path:
                return root
    return None


def read_tree(root):
    """{member: text} of the members present under `root`."""
    out = {}
    for name in MEMBERS:
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                out[name] = f.read()
    return out


def tree_version(root):
    """The release number the tree says it is (vllm/_version.py, an sdist's PKG-INFO, an
    installed package's dist-info), else None."""
    path = os.path.join(root, "vllm", "_version.py")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            m = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", f.read(), re.M)
        if m:
            return m.group(1)
    metas = [os.path.join(root, "PKG-INFO")]
    metas += [
        os.path.join(root, d, "METADATA")
        for d in sorted(os.listdir(root))
        if d.startswith("vllm-") and d.endswith(".dist-info")
    ]
    for meta in metas:
        if os.path.isfile(meta):
            with open(meta, encoding="utf-8") as f:
                m = re.search(r"^Version:\s*(\S+)", f.read(), re.M)
            if m:
                return m.group(1)
    return None


def describe(path, version=None):
    """The description of the vLLM at `path` (see `release_entry`; source "tree"), its version
    the one the tree says, else `version`. Raises ReviewNeeded when `path` holds no vLLM
    source, neither says the version, its
    all2all backend is not configurable, or its source has a shape this reader does not know."""
    root = tree_root(path)
    if root is None:
        raise ReviewNeeded("%s holds no vLLM source (vllm/envs.py, vllm/config...)" % path)
    version = tree_version(root) or version
    if not version:
        raise ReviewNeeded(
            "%s does not say which vLLM release it is (no vllm/_version.py, PKG-INFO or "
            "dist-info): name the release too (epcomm check: --vllm-version V)" % path
        )
    facts = analyse(read_tree(root))
    if facts is None:
        raise ReviewNeeded("vLLM %s at %s has no all2all backend setting" % (version, path))
    return release_entry(version, "tree", facts)


def main(argv):
    args = list(argv)
    version = None
    if "--version" in args:
        i = args.index("--version")
        if i + 1 >= len(args):
            print("usage: vllm_release.py DIR [--version V]", file=sys.stderr)
            return 2
        version = args[i + 1]
        del args[i : i + 2]
    if len(args) != 1:
        print("usage: vllm_release.py DIR [--version V]", file=sys.stderr)
        return 2
    try:
        entry = describe(args[0], version)
    except (ReviewNeeded, OSError, SyntaxError, UnicodeDecodeError) as e:
        print("cannot read the vLLM release in %s: %s" % (args[0], e), file=sys.stderr)
        return 2
    print(json.dumps(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
