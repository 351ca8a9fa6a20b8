//! The module map is enforced: docs/design.md's `layers` block says which top-level module may
//! import which; every `crate::` / `super::` / child-module path in src/ (test modules aside)
//! must agree with it, and no two files may import each other, directly or round a longer
//! circle (a module's own `mod.rs` and its files are one unit). Text only: no Rust parser.
//!
//! `EPCOMM_LAYERS_PRINT=1 cargo test --test layers -- --nocapture` prints every edge.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

type ModPath = Vec<String>;

/// One source file: its module path and its text without comments, strings and test modules.
struct File {
    path: PathBuf,
    module: ModPath,
    code: String,
}

/// `a::b` from src/a/b.rs or src/a/b/mod.rs; the crate root is empty.
fn module_of(rel: &Path) -> ModPath {
    let mut parts: ModPath = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Comments and string/char literals blanked out (line numbers kept).
fn strip(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                push_blank(&mut out, b[i]);
                i += 1;
            }
            i += 2;
        } else if c == b'r' && matches!(b.get(i + 1), Some(b'"') | Some(b'#')) && !ident(b, i) {
            i = skip_raw(b, i + 1, &mut out);
        } else if c == b'"' {
            i = skip_quoted(b, i, &mut out);
        } else if c == b'\'' && b.get(i + 2) == Some(&b'\'') {
            i += 3; // 'x'
        } else if c == b'\'' && b.get(i + 1) == Some(&b'\\') {
            i += 2;
            while i < b.len() && b[i] != b'\'' {
                i += 1;
            }
            i += 1;
        } else {
            out.push(c as char);
            i += 1;
        }
    }
    out
}

fn ident(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

fn push_blank(out: &mut String, c: u8) {
    if c == b'\n' {
        out.push('\n');
    }
}

fn skip_quoted(b: &[u8], mut i: usize, out: &mut String) -> usize {
    i += 1;
    while i < b.len() && b[i] != b'"' {
        i += if b[i] == b'\\' { 2 } else { 1 };
        push_blank(out, b[i - 1]);
    }
    out.push_str("\"\"");
    i + 1
}

fn skip_raw(b: &[u8], mut i: usize, out: &mut String) -> usize {
    let hashes = b[i..].iter().take_while(|&&c| c == b'#').count();
    i += hashes + 1;
    let close: Vec<u8> = std::iter::once(b'"')
        .chain(std::iter::repeat_n(b'#', hashes))
        .collect();
    while i < b.len() && !b[i..].starts_with(&close) {
        push_blank(out, b[i]);
        i += 1;
    }
    out.push_str("\"\"");
    i + close.len()
}

/// `#[cfg(test)] mod x { ... }` blocks removed: tests may reach anywhere.
fn drop_test_modules(code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        let Some(open) = after.find(['{', ';']) else {
            break;
        };
        let head = &after[..open];
        if after.as_bytes()[open] == b';' || !head.contains("mod ") {
            out.push_str(&after[..open + 1]);
            rest = &after[open + 1..];
            continue;
        }
        let mut depth = 0;
        let mut end = after.len();
        for (k, ch) in after[open..].char_indices() {
            depth += match ch {
                '{' => 1,
                '}' => -1,
                _ => 0,
            };
            if depth == 0 {
                end = open + k + 1;
                break;
            }
        }
        out.extend(after[..end].chars().filter(|&c| c == '\n'));
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn load(src: &Path) -> Vec<File> {
    let mut paths = Vec::new();
    walk(src, &mut paths);
    paths.sort();
    paths
        .into_iter()
        .filter(|p| !p.starts_with(src.join("bin")))
        .map(|path| {
            let rel = path.strip_prefix(src).unwrap().to_path_buf();
            let code = drop_test_modules(&strip(&fs::read_to_string(&path).unwrap()));
            File {
                module: module_of(&rel),
                path: rel,
                code,
            }
        })
        .collect()
}

/// Every path a `use` tree names, `a::{b, c::{d, self}}` → `a::b`, `a::c::d`, `a::c`.
fn expand(tree: &str, prefix: &[String], out: &mut Vec<ModPath>) {
    let tree = tree.trim();
    if let Some(open) = tree.find('{') {
        let head = tree[..open].trim_end_matches("::");
        let mut base = prefix.to_vec();
        base.extend(segments(head));
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        for part in split_top(inner) {
            expand(part, &base, out);
        }
        return;
    }
    let name = tree.split(" as ").next().unwrap_or("").trim();
    let mut path = prefix.to_vec();
    path.extend(
        segments(name)
            .into_iter()
            .filter(|s| s != "self" || prefix.is_empty()),
    );
    if !path.is_empty() {
        out.push(path);
    }
}

fn segments(s: &str) -> Vec<String> {
    s.split("::")
        .map(|p| p.trim().to_string())
        .filter(|p| !p.is_empty() && p != "*")
        .collect()
}

fn split_top(s: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts.into_iter().filter(|p| !p.trim().is_empty()).collect()
}

/// (line, path, re-exported?) for every `use` statement and every inline `a::b::c` path.
fn paths(code: &str, children: &BTreeSet<String>) -> Vec<(usize, ModPath, bool)> {
    let mut out = Vec::new();
    let line_at = |at: usize| code[..at].matches('\n').count() + 1;
    let b = code.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if !ident(b, i) && code[i..].starts_with("use ") {
            let end = code[i..].find(';').map_or(b.len(), |e| i + e);
            let head = &code[..i];
            let public = head.trim_end().ends_with("pub") || head.trim_end().ends_with(')');
            let mut found = Vec::new();
            expand(&code[i + 4..end], &[], &mut found);
            out.extend(found.into_iter().map(|p| (line_at(i), p, public)));
            i = end;
            continue;
        }
        if (b[i].is_ascii_alphabetic() || b[i] == b'_') && !ident(b, i) && !after_colons(b, i) {
            let len = code[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(b.len() - i);
            let word = &code[i..i + len];
            let first = word.split("::").next().unwrap_or("");
            let rooted = matches!(first, "crate" | "super" | "self") || children.contains(first);
            if word.contains("::") && rooted {
                out.push((line_at(i), segments(word), false));
            }
            i += len.max(1);
            continue;
        }
        i += 1;
    }
    out
}

fn after_colons(b: &[u8], i: usize) -> bool {
    i >= 2 && &b[i - 2..i] == b"::"
}

/// `mod x;` declarations: the children a bare `x::` path names.
fn children(code: &str) -> BTreeSet<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l
                .strip_prefix("pub(crate) ")
                .or(l.strip_prefix("pub "))
                .unwrap_or(l);
            l.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(str::to_string)
        })
        .collect()
}

struct Crate {
    files: Vec<File>,
    by_module: BTreeMap<ModPath, usize>,
    /// module → (name → where `pub use` says it comes from)
    reexports: BTreeMap<ModPath, BTreeMap<String, ModPath>>,
}

impl Crate {
    fn new(files: Vec<File>) -> Crate {
        let by_module = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.module.clone(), i))
            .collect();
        let mut krate = Crate {
            files,
            by_module,
            reexports: BTreeMap::new(),
        };
        for f in &krate.files {
            let kids = children(&f.code);
            let mut names = BTreeMap::new();
            for (_, p, public) in paths(&f.code, &kids) {
                if let (true, Some(abs)) = (public, krate.absolute(&f.module, &kids, &p)) {
                    names.insert(p.last().unwrap().clone(), abs);
                }
            }
            krate.reexports.insert(f.module.clone(), names);
        }
        krate
    }

    /// The path from the crate root, or None for another crate's.
    fn absolute(&self, here: &ModPath, kids: &BTreeSet<String>, p: &[String]) -> Option<ModPath> {
        let mut at = here.clone();
        let mut rest = p;
        match p.first()?.as_str() {
            "crate" => at.clear(),
            "self" => {}
            "super" => {
                while rest.first().is_some_and(|s| s == "super") {
                    at.pop()?;
                    rest = &rest[1..];
                }
                at.extend(rest.iter().cloned());
                return Some(at);
            }
            first if kids.contains(first) => {
                at.extend(p.iter().cloned());
                return Some(at);
            }
            _ => return None,
        }
        at.extend(rest[1..].iter().cloned());
        Some(at)
    }

    /// The file that defines what an absolute path names (through `pub use`, a few hops).
    fn target(&self, abs: &[String], hops: usize) -> usize {
        let mut n = abs.len();
        while !self.by_module.contains_key(&abs[..n]) {
            n -= 1;
        }
        let module = abs[..n].to_vec();
        let via = abs
            .get(n)
            .and_then(|name| self.reexports.get(&module)?.get(name));
        match via {
            Some(next) if hops < 4 && next.as_slice() != abs => self.target(next, hops + 1),
            _ => self.by_module[&module],
        }
    }

    /// (from, to) → first line, every edge between two files.
    fn edges(&self) -> BTreeMap<(usize, usize), usize> {
        let mut edges = BTreeMap::new();
        for (from, f) in self.files.iter().enumerate() {
            let kids = children(&f.code);
            for (line, p, _) in paths(&f.code, &kids) {
                let Some(abs) = self.absolute(&f.module, &kids, &p) else {
                    continue;
                };
                let to = self.target(&abs, 0);
                if to != from {
                    edges.entry((from, to)).or_insert(line);
                }
            }
        }
        edges
    }
}

fn top(m: &ModPath) -> &str {
    m.first().map_or("lib", String::as_str)
}

fn nested(a: &ModPath, b: &ModPath) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// docs/design.md's ```layers block: `module: what it may import`.
fn allowed(design: &str) -> BTreeMap<String, BTreeSet<String>> {
    let block = design
        .split("```layers\n")
        .nth(1)
        .and_then(|s| s.split("```").next())
        .expect("docs/design.md has a ```layers block");
    block
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        .map(|l| {
            let (m, deps) = l.split_once(':').expect("`module: deps` lines");
            let deps = deps.split_whitespace().map(str::to_string).collect();
            (m.trim().to_string(), deps)
        })
        .collect()
}

/// Strongly connected components with more than one file (Tarjan, recursive: the graph is small).
fn circles(n: usize, edges: &BTreeSet<(usize, usize)>) -> Vec<Vec<usize>> {
    struct T<'a> {
        adj: Vec<Vec<usize>>,
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        stack: Vec<usize>,
        on: Vec<bool>,
        next: usize,
        out: &'a mut Vec<Vec<usize>>,
    }
    fn visit(t: &mut T, v: usize) {
        t.index[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on[v] = true;
        for w in t.adj[v].clone() {
            match t.index[w] {
                None => {
                    visit(t, w);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(i) if t.on[w] => t.low[v] = t.low[v].min(i),
                Some(_) => {}
            }
        }
        if Some(t.low[v]) == t.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on[w] = false;
                scc.push(w);
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                t.out.push(scc);
            }
        }
    }
    let mut adj = vec![Vec::new(); n];
    for &(a, b) in edges {
        adj[a].push(b);
    }
    let mut out = Vec::new();
    let mut t = T {
        adj,
        index: vec![None; n],
        low: vec![0; n],
        stack: Vec::new(),
        on: vec![false; n],
        next: 0,
        out: &mut out,
    };
    for v in 0..n {
        if t.index[v].is_none() {
            visit(&mut t, v);
        }
    }
    out
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn krate() -> Crate {
    let krate = Crate::new(load(&root().join("src")));
    if std::env::var_os("EPCOMM_LAYERS_PRINT").is_some() {
        for (&(a, b), line) in &krate.edges() {
            let (fa, fb) = (&krate.files[a].path, &krate.files[b].path);
            println!("{}:{line} -> {}", fa.display(), fb.display());
        }
    }
    krate
}

#[test]
fn no_module_imports_one_above_it() {
    let design = fs::read_to_string(root().join("docs/design.md")).unwrap();
    let map = allowed(&design);
    let krate = krate();
    let mut wrong = Vec::new();
    for (&(a, b), line) in &krate.edges() {
        let (from, to) = (&krate.files[a], &krate.files[b]);
        let (ta, tb) = (top(&from.module), top(&to.module));
        let ok =
            ta == tb || ta == "lib" || tb == "lib" || map.get(ta).is_some_and(|d| d.contains(tb));
        if !ok {
            wrong.push(format!(
                "src/{}:{line} imports src/{} ({ta} may not import {tb})",
                from.path.display(),
                to.path.display()
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "imports the layers block in docs/design.md does not allow:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn no_import_circles() {
    let krate = krate();
    let edges = krate.edges();
    let files = &krate.files;
    let kept = edges
        .keys()
        .filter(|&&(a, b)| !nested(&files[a].module, &files[b].module))
        .copied()
        .collect();
    let found: Vec<String> = circles(files.len(), &kept)
        .into_iter()
        .map(|scc| {
            let names: Vec<String> = scc
                .iter()
                .map(|&i| format!("src/{}", files[i].path.display()))
                .collect();
            names.join(" <-> ")
        })
        .collect();
    assert!(
        found.is_empty(),
        "{} import circle(s):\n{}",
        found.len(),
        found.join("\n")
    );
}

#[test]
fn design_lists_every_module_and_layer() {
    let design = fs::read_to_string(root().join("docs/design.md")).unwrap();
    let map = allowed(&design);
    let lib = fs::read_to_string(root().join("src/lib.rs")).unwrap();
    let modules = children(&strip(&lib));
    let listed: BTreeSet<String> = map.keys().cloned().collect();
    assert_eq!(
        listed, modules,
        "the layers block in docs/design.md lists every module in src/lib.rs"
    );
    for deps in map.values() {
        assert!(
            deps.is_subset(&modules),
            "layers names only modules: {deps:?}"
        );
    }
    let arch = design.split("## 1. Architecture").nth(1).unwrap();
    let arch = arch.split("```").nth(1).unwrap();
    for m in &modules {
        let named = arch.contains(&format!("src/{m}/")) || arch.contains(&format!("src/{m}.rs"));
        assert!(named, "docs/design.md's module map names src/{m}");
    }
}
