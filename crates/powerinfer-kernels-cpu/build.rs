//! Build probe: sets `cfg(powerinfer_avx512)` when the compiler is Rust 1.89 or newer, whose
//! stable `std::arch` has the AVX-512 intrinsics and target features that the blocked GEMM
//! kernels (`src/matmul/x86/gemm.rs`) use. Older compilers (down to the crate's MSRV) build the
//! crate without those kernels.

use std::process::Command;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(powerinfer_avx512)");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=RUSTC");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok());
    // "rustc 1.95.0 (…)" → (1, 95).
    let parsed = version.as_deref().and_then(|v| {
        let mut it = v.split_whitespace().nth(1)?.split('.');
        let major: u32 = it.next()?.parse().ok()?;
        let minor: u32 = it.next()?.parse().ok()?;
        Some((major, minor))
    });
    if parsed.is_some_and(|v| v >= (1, 89)) {
        println!("cargo:rustc-cfg=powerinfer_avx512");
    }
}
