//! The Python interpreter of `scripts/setup-python` for tests that drive a Python package;
//! each test file includes this file with `#[path]`.
#![allow(dead_code)]

use std::process::Command;

/// The interpreter (`POWERINFER_PYTHON`, else `python3`) when it has `module`; `None` (the
/// test is skipped, saying why) otherwise, unless `CI` is set.
pub fn python_with(module: &str) -> Option<String> {
    let py = std::env::var("POWERINFER_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(py);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{py} has no `{module}` (scripts/setup-python installs it)"
    );
    println!("skipped: {py} has no `{module}`");
    None
}
