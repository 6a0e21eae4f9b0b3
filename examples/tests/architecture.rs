//! ARCHITECTURE.md's dependency block says what the `Cargo.toml` files say: for every crate of
//! the workspace, the workspace crates in its `[dependencies]` table, no more, no fewer.

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
    let mut in_deps = false;
    let mut out = BTreeSet::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
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

#[test]
fn dependency_block_matches_the_manifests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
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

/// The map stays a map.
#[test]
fn architecture_is_short() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let doc = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    assert!(doc.lines().count() <= 250, "{} lines", doc.lines().count());
}
