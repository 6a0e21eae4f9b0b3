//! ARCHITECTURE.md's claims, checked against the code:
//!
//! - its dependency block says what the `Cargo.toml` files say: for every crate of the
//!   workspace, the workspace crates in its `[dependencies]` table, no more, no fewer;
//! - "no import cycle among the files of a crate": the `crate::` / `super::` paths of every
//!   library source file (the `powerinfer` command's library included) form no cycle;
//! - its table of where things are: each item is defined in the file it names;
//! - it stays a map (short);
//! - the invariants it marks checked: tests never depend on a crate above theirs, `unsafe` is
//!   forbidden outside the kernel crates, only `examples/src/env.rs` reads the environment; and
//!   the engine's files stay under 1,000 lines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Crate name -> the workspace crates it depends on, from ARCHITECTURE.md's `text` block of
/// `a -> b, c` lines.
fn documented(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let section = doc
        .split_once("## Crates and their dependencies")
        .expect("a dependency section")
        .1;
    let block = section.split_once("```text\n").expect("a text block").1;
    let block = block.split_once("```").unwrap().0;
    block
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let (name, deps) = l.split_once("->").expect("`crate -> deps`");
            let deps = deps
                .split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .map(String::from)
                .collect();
            (name.trim().to_string(), deps)
        })
        .collect()
}

/// The workspace crates named in the `[dependencies]` table of `manifest`.
fn dependencies(manifest: &str, workspace: &BTreeSet<String>) -> BTreeSet<String> {
    named_in(manifest, "[dependencies]", workspace)
}

/// The workspace crates named in the table `table` of `manifest`.
fn named_in(manifest: &str, table: &str, workspace: &BTreeSet<String>) -> BTreeSet<String> {
    let mut in_deps = false;
    let mut out = BTreeSet::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == table;
            continue;
        }
        if !in_deps {
            continue;
        }
        let name = line
            .split(|c: char| c == '=' || c == '.' || c.is_whitespace())
            .next()
            .unwrap_or("");
        if workspace.contains(name) {
            out.insert(name.to_string());
        }
    }
    out
}

/// Every workspace crate's name and manifest.
fn manifests(root: &Path) -> BTreeMap<String, String> {
    let ws = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let members: Vec<String> = ws
        .split_once("members = [")
        .unwrap()
        .1
        .split_once(']')
        .unwrap()
        .0
        .split(',')
        .map(|m| m.trim().trim_matches('"').to_string())
        .filter(|m| !m.is_empty())
        .collect();
    let mut manifests = BTreeMap::new();
    for m in &members {
        let text = std::fs::read_to_string(root.join(m).join("Cargo.toml")).unwrap();
        let name = text
            .lines()
            .find_map(|l| l.trim().strip_prefix("name = "))
            .unwrap()
            .trim_matches('"')
            .to_string();
        manifests.insert(name, text);
    }
    manifests
}

#[test]
fn dependency_block_matches_the_manifests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let manifests = manifests(&root);
    let workspace: BTreeSet<String> = manifests.keys().cloned().collect();
    let actual: BTreeMap<String, BTreeSet<String>> = manifests
        .iter()
        .map(|(name, text)| (name.clone(), dependencies(text, &workspace)))
        .collect();
    assert_eq!(
        documented(&root),
        actual,
        "ARCHITECTURE.md's dependency block and the Cargo.toml files differ"
    );
}

/// No crate's tests depend on a crate above it: every workspace crate a `[dev-dependencies]`
/// table names is one its `[dependencies]` reach, or one that does not reach it (so no
/// package is built twice, once as a dependency of its own test).
#[test]
fn dev_dependencies_point_down() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let manifests = manifests(&root);
    let workspace: BTreeSet<String> = manifests.keys().cloned().collect();
    let deps: BTreeMap<String, BTreeSet<String>> = (manifests.iter())
        .map(|(n, t)| (n.clone(), dependencies(t, &workspace)))
        .collect();
    let reaches = |from: &str, to: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_string()];
        while let Some(c) = todo.pop() {
            if c == to {
                return true;
            }
            if seen.insert(c.clone()) {
                todo.extend(deps[&c].iter().cloned());
            }
        }
        false
    };
    for (name, text) in &manifests {
        for dev in named_in(text, "[dev-dependencies]", &workspace) {
            assert!(
                dev == *name || !reaches(&dev, name),
                "{name}'s tests depend on {dev}, which depends on {name}"
            );
        }
    }
}

/// The files that say `#![forbid(unsafe_code)]`: every crate but the kernels and the
/// container (whose one `unsafe` is the memory map).
const NO_UNSAFE: [&str; 5] = [
    "crates/powerinfer-engine/src/lib.rs",
    "crates/powerinfer-predictor/src/lib.rs",
    "crates/powerinfer-placement/src/lib.rs",
    "examples/src/lib.rs",
    "examples/src/main.rs",
];

#[test]
fn unsafe_is_forbidden_outside_the_kernels() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for f in NO_UNSAFE {
        let text = std::fs::read_to_string(root.join(f)).unwrap();
        assert!(
            text.lines().any(|l| l.trim() == "#![forbid(unsafe_code)]"),
            "{f} does not forbid unsafe code"
        );
    }
}

/// Only `examples/src/env.rs` reads environment variables; every library takes options.
#[test]
fn only_the_command_reads_the_environment() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let allowed = root.join("examples/src/env.rs");
    let mut found = Vec::new();
    for dir in SOURCE_DIRS {
        let mut files = Vec::new();
        rust_files(&root.join(dir), &mut files);
        for f in files.into_iter().filter(|f| *f != allowed) {
            let text = std::fs::read_to_string(&f).unwrap();
            for (i, l) in code_lines(&text).lines().enumerate() {
                if ["env::var(", "env::var_os(", "env::vars("]
                    .iter()
                    .any(|p| l.contains(p))
                {
                    found.push(format!("{}:{}", f.display(), i + 1));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "environment read outside env.rs: {found:?}"
    );
}

/// The engine's files stay small enough to read (its rooms split by job).
#[test]
fn engine_files_stay_short() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    rust_files(&root.join("crates/powerinfer-engine/src"), &mut files);
    for f in files {
        let n = std::fs::read_to_string(&f).unwrap().lines().count();
        assert!(n <= 1000, "{}: {n} lines", f.display());
    }
}

/// The map stays a map.
#[test]
fn architecture_is_short() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    assert!(doc.lines().count() <= 200, "{} lines", doc.lines().count());
}

/// The source directories whose files must not import each other in a circle: every library
/// crate of the workspace and the command's library.
const SOURCE_DIRS: [&str; 7] = [
    "crates/powerinfer-gguf/src",
    "crates/powerinfer-kernels-cpu/src",
    "crates/powerinfer-kernels-cuda/src",
    "crates/powerinfer-predictor/src",
    "crates/powerinfer-placement/src",
    "crates/powerinfer-engine/src",
    "examples/src",
];

/// Every `.rs` file below `dir`.
fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a source file relative to its crate's `src` (`a/b.rs` and `a/b/mod.rs`
/// are `["a", "b"]`; `lib.rs` and `main.rs` the root).
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if !matches!(stem, "mod" | "lib" | "main") {
        parts.push(stem.to_string());
    }
    parts
}

/// The code of a file without comments and without its inline test module (`#[cfg(test)]`
/// then `mod tests {`, where `super` means the file's own module).
fn code_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| {
            w[0].trim() == "#[cfg(test)]"
                && w[1].trim_start().starts_with("mod ")
                && w[1].trim_end().ends_with('{')
        })
        .unwrap_or(lines.len());
    lines[..end]
        .iter()
        .map(|l| {
            let t = l.trim_start();
            if t.starts_with("//") {
                ""
            } else if let Some(i) = l.find(" //") {
                &l[..i]
            } else {
                l
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module paths a path tree starting at `s` names (`a::b::{c, d::E}` gives `a::b::c`,
/// `a::b::d::E`), as segments.
fn expand_tree(s: &str) -> Vec<Vec<String>> {
    fn tree(chars: &[char], i: &mut usize) -> Vec<Vec<String>> {
        let mut prefix = Vec::new();
        loop {
            while *i < chars.len() && chars[*i].is_whitespace() {
                *i += 1;
            }
            if *i < chars.len() && chars[*i] == '{' {
                *i += 1;
                let mut out = Vec::new();
                loop {
                    let subs = tree(chars, i);
                    for sub in subs {
                        let mut p = prefix.clone();
                        p.extend(sub);
                        out.push(p);
                    }
                    while *i < chars.len() && chars[*i].is_whitespace() {
                        *i += 1;
                    }
                    match chars.get(*i) {
                        Some(',') => *i += 1,
                        Some('}') => {
                            *i += 1;
                            return out;
                        }
                        _ => return out,
                    }
                    while *i < chars.len() && chars[*i].is_whitespace() {
                        *i += 1;
                    }
                    if chars.get(*i) == Some(&'}') {
                        *i += 1;
                        return out;
                    }
                }
            }
            let start = *i;
            while *i < chars.len() && (chars[*i].is_alphanumeric() || chars[*i] == '_') {
                *i += 1;
            }
            if start == *i {
                return vec![prefix];
            }
            prefix.push(chars[start..*i].iter().collect());
            if chars.get(*i) == Some(&':') && chars.get(*i + 1) == Some(&':') {
                *i += 2;
            } else {
                return vec![prefix];
            }
        }
    }
    let chars: Vec<char> = s.chars().collect();
    tree(&chars, &mut 0)
}

/// A module path, as its segments.
type ModPath = Vec<String>;

/// The paths a file names, each with whether it is a re-export.
type Named = Vec<(ModPath, bool)>;

/// Re-exports: (module, name) -> the module the name comes from.
type Reexports = BTreeMap<(Vec<String>, String), Vec<String>>;

/// Where a path names something: walk its segments through modules; the first segment that
/// is not a module is an item of the module reached, or a name that module re-exports (then
/// the module it comes from, followed through chains of re-exports).
fn resolve(path: &[String], modules: &BTreeSet<Vec<String>>, reexports: &Reexports) -> Vec<String> {
    let mut at: Vec<String> = Vec::new();
    for seg in path {
        let mut next = at.clone();
        next.push(seg.clone());
        if modules.contains(&next) {
            at = next;
            continue;
        }
        let mut key = (at.clone(), seg.clone());
        let mut hops = 0;
        while let Some(src) = reexports.get(&key) {
            at = src.clone();
            key = (at.clone(), seg.clone());
            hops += 1;
            if hops > 16 {
                break;
            }
        }
        break;
    }
    at
}

/// The paths a file names, as absolute segment lists: `crate::`, `super::` and `self::` paths
/// anywhere in its code, and `use` of a child module by its bare name; each with whether it
/// is a `pub` re-export (`pub use` / `pub(crate) use`).
fn named_paths(
    m: &[String],
    code: &str,
    modules: &BTreeSet<Vec<String>>,
) -> Vec<(Vec<String>, bool)> {
    let bytes = code.as_bytes();
    let boundary =
        |i: usize| i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
    let mut out = Vec::new();
    let mut i = 0;
    while i < code.len() {
        if !code.is_char_boundary(i) || !boundary(i) {
            i += 1;
            continue;
        }
        let rest = &code[i..];
        let before = code[..i].trim_end();
        let reexport = before.ends_with("pub use") || before.ends_with("pub(crate) use");
        let in_use = before.ends_with("use");
        let target = if rest.starts_with("crate::") {
            Some((Vec::new(), "crate::".len()))
        } else if rest.starts_with("super::") || rest.starts_with("self::") {
            let mut base = m.to_vec();
            let mut k = 0;
            loop {
                if code[i + k..].starts_with("super::") {
                    base.pop();
                    k += "super::".len();
                } else if code[i + k..].starts_with("self::") {
                    k += "self::".len();
                } else {
                    break;
                }
            }
            Some((base, k))
        } else if in_use {
            // `use child::...` of a child module by its bare name.
            let first: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let mut child = m.to_vec();
            child.push(first);
            modules.contains(&child).then(|| (m.to_vec(), 0))
        } else {
            None
        };
        match target {
            Some((base, skip)) => {
                for tail in expand_tree(&code[i + skip..]) {
                    let mut path = base.clone();
                    path.extend(tail);
                    out.push((path, reexport));
                }
                i += skip.max(1);
            }
            None => i += 1,
        }
    }
    out
}

/// Edges from each file's module to the modules that define what its code uses (re-exports
/// followed to their source; a file's own `pub use` is its surface, not a use); `modules` are
/// the crate's module paths. Edges between a module and its own ancestors or descendants are
/// left out (a folder's `mod.rs` and the files inside it are one room); a `mod child;`
/// declaration is not an import.
fn import_edges(
    files: &[(Vec<String>, String)],
    modules: &BTreeSet<Vec<String>>,
) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let named: Vec<(ModPath, Named)> = files
        .iter()
        .map(|(m, code)| (m.clone(), named_paths(m, code, modules)))
        .collect();
    let mut reexports = Reexports::new();
    for (m, paths) in &named {
        for (path, _) in paths.iter().filter(|(_, r)| *r) {
            if let Some(name) = path.last() {
                let mut src = path.clone();
                src.pop();
                let src = module_prefix(src, modules);
                if !modules.contains(path) && src != *m {
                    reexports.insert((m.clone(), name.clone()), src);
                }
            }
        }
    }
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for (m, paths) in &named {
        let from = edges.entry(m.clone()).or_default();
        // A re-export is the module's surface, not something its code uses.
        for (path, _) in paths.iter().filter(|(_, r)| !*r) {
            let to = resolve(path, modules, &reexports);
            // A folder's module and the files inside it are one room.
            if !to.starts_with(m) && !m.starts_with(&to) {
                from.insert(to);
            }
        }
    }
    edges
}

/// The longest prefix of `path` that is one of `modules`.
fn module_prefix(mut path: Vec<String>, modules: &BTreeSet<Vec<String>>) -> Vec<String> {
    while !path.is_empty() && !modules.contains(&path) {
        path.pop();
    }
    path
}

/// A cycle of `edges`, if any (as the modules along it).
fn find_cycle(edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<Vec<Vec<String>>> {
    fn visit(
        n: &Vec<String>,
        edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut BTreeMap<Vec<String>, u8>,
        stack: &mut Vec<Vec<String>>,
    ) -> Option<Vec<Vec<String>>> {
        match state.get(n) {
            Some(2) => return None,
            Some(1) => {
                let at = stack.iter().position(|s| s == n).unwrap_or(0);
                return Some(stack[at..].to_vec());
            }
            _ => {}
        }
        state.insert(n.clone(), 1);
        stack.push(n.clone());
        for m in edges.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, edges, state, stack) {
                return Some(c);
            }
        }
        stack.pop();
        state.insert(n.clone(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in edges.keys() {
        if let Some(c) = visit(n, edges, &mut state, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

/// Files declared behind `#[cfg(test)]` (`#[cfg(test)] mod name;`), by module path.
fn test_modules(files: &[(Vec<String>, String)]) -> BTreeSet<Vec<String>> {
    let mut out = BTreeSet::new();
    for (m, code) in files {
        let lines: Vec<&str> = code.lines().map(str::trim).collect();
        for w in lines.windows(2) {
            if w[0].starts_with("#[cfg(test)]") || w[0].starts_with("#[cfg(all(test") {
                if let Some(name) = w[1].strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
                    let mut p = m.clone();
                    p.push(name.to_string());
                    out.insert(p);
                }
            }
        }
    }
    out
}

#[test]
fn no_import_cycle_among_the_files_of_a_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for dir in SOURCE_DIRS {
        let src = root.join(dir);
        let mut paths = Vec::new();
        rust_files(&src, &mut paths);
        let mut files: Vec<(Vec<String>, String)> = paths
            .iter()
            .filter(|p| !p.ends_with("main.rs"))
            .map(|p| {
                let text = std::fs::read_to_string(p).unwrap();
                (module_of(p.strip_prefix(&src).unwrap()), code_lines(&text))
            })
            .collect();
        let tests = test_modules(&files);
        files.retain(|(m, _)| !tests.iter().any(|t| m.starts_with(t)));
        let modules: BTreeSet<Vec<String>> = files.iter().map(|(m, _)| m.clone()).collect();
        let edges = import_edges(&files, &modules);
        let edge_count: usize = edges.values().map(BTreeSet::len).sum();
        assert!(
            dir.contains("gguf") || edge_count > 0,
            "{dir}: no imports found; the reader is broken"
        );
        if let Some(cycle) = find_cycle(&edges) {
            let names: Vec<String> = cycle
                .iter()
                .map(|m| format!("crate::{}", m.join("::")))
                .collect();
            panic!("{dir}: import cycle {}", names.join(" -> "));
        }
    }
}

/// The reader of paths finds a circle when there is one (so that the test above can fail).
#[test]
fn a_cycle_is_found() {
    let files = vec![
        (
            vec!["a".to_string()],
            "use crate::b::{X, c::Y};".to_string(),
        ),
        (
            vec!["b".to_string()],
            "fn f() { super::a::g() }".to_string(),
        ),
        (vec!["b".to_string(), "c".to_string()], String::new()),
    ];
    let modules = files.iter().map(|(m, _)| m.clone()).collect();
    let edges = import_edges(&files, &modules);
    assert!(edges[&vec!["a".to_string()]].contains(&vec!["b".to_string(), "c".to_string()]));
    assert!(find_cycle(&edges).is_some());
    let through_a_child = vec![
        (vec!["a".to_string()], "use crate::b::c::Z;".to_string()),
        (vec!["b".to_string()], "pub use c::Z;".to_string()),
        (
            vec!["b".to_string(), "c".to_string()],
            "use crate::a::W;".to_string(),
        ),
    ];
    let modules = through_a_child.iter().map(|(m, _)| m.clone()).collect();
    // a -> b::c -> a: a file inside a folder and one outside it.
    assert!(find_cycle(&import_edges(&through_a_child, &modules)).is_some());
    let fine = vec![
        (vec!["a".to_string()], "use crate::b::Y;".to_string()),
        (vec!["b".to_string()], "pub use c::Y;".to_string()),
        (
            vec!["b".to_string(), "c".to_string()],
            "pub struct Y;".to_string(),
        ),
    ];
    let modules = fine.iter().map(|(m, _)| m.clone()).collect();
    // `crate::b::Y` is defined in b::c: a's edge goes there, through the re-export.
    let e = import_edges(&fine, &modules);
    assert!(e[&vec!["a".to_string()]].contains(&vec!["b".to_string(), "c".to_string()]));
    let modules = fine.iter().map(|(m, _)| m.clone()).collect();
    assert!(find_cycle(&import_edges(&fine, &modules)).is_none());
}

/// The rows of ARCHITECTURE.md's table of where things are: `| `Name` | `path` | ... |`.
fn located_items(doc: &str) -> Vec<(String, String)> {
    let section = doc
        .split_once("## Where things are")
        .expect("a section `## Where things are`")
        .1;
    section
        .lines()
        .take_while(|l| !l.starts_with("## "))
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            let path = cells.get(2)?.strip_prefix('`')?.strip_suffix('`')?;
            Some((name.to_string(), path.to_string()))
        })
        .collect()
}

#[test]
fn items_are_where_the_map_says() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    let items = located_items(&doc);
    assert!(items.len() >= 20, "only {} located items", items.len());
    for (name, path) in items {
        let text = std::fs::read_to_string(root.join(&path))
            .unwrap_or_else(|e| panic!("{path} (for `{name}`): {e}"));
        let short = name.rsplit("::").next().unwrap_or(&name);
        let defined = ["struct", "enum", "trait", "fn", "type", "const", "mod"]
            .iter()
            .any(|kw| {
                text.lines().any(|l| {
                    let l = l.trim_start();
                    let l = l
                        .strip_prefix("pub(crate) ")
                        .or_else(|| l.strip_prefix("pub(super) "))
                        .or_else(|| l.strip_prefix("pub "))
                        .unwrap_or(l);
                    let l = l.strip_prefix("async ").unwrap_or(l);
                    l.strip_prefix(kw)
                        .and_then(|r| r.strip_prefix(' '))
                        .is_some_and(|r| {
                            r.starts_with(short)
                                && !r[short.len()..]
                                    .starts_with(|c: char| c.is_alphanumeric() || c == '_')
                        })
                })
            });
        assert!(defined, "`{name}` is not defined in {path}");
    }
}
