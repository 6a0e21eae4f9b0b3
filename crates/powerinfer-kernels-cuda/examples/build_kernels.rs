//! Regenerates `kernels/gen/` (PTX for compute_80, CUBINs for sm_80 and sm_90) from
//! `kernels/*.cu` with NVRTC and prints ptxas's register/spill report per kernel.
//!
//! Run through `scripts/build-cuda-kernels` (which puts libnvrtc on `LD_LIBRARY_PATH`).

use std::path::PathBuf;
use std::process::ExitCode;

use powerinfer_kernels_cuda::kernels::KernelModule;
use powerinfer_kernels_cuda::nvrtc::{self, Target, CUBIN_TARGETS, PTX_TARGET};

fn main() -> ExitCode {
    let gen = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("kernels")
        .join("gen");
    match nvrtc::nvrtc_version() {
        Ok((a, b)) => println!("NVRTC {a}.{b}"),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    }
    let mut failed = false;
    println!(
        "{:<8} {:<6} {:<18} {:>5} {:>6} {:>6} {:>6}",
        "module", "arch", "kernel", "regs", "smem", "spillS", "spillL"
    );
    for m in KernelModule::ALL {
        for target in std::iter::once(PTX_TARGET).chain(CUBIN_TARGETS) {
            let out = match nvrtc::compile(m, target) {
                Ok(o) => o,
                Err(e) => {
                    eprintln!("error: {e}");
                    failed = true;
                    continue;
                }
            };
            let file = match target {
                Target::Ptx(_) => gen.join(format!("{}.ptx", m.name())),
                Target::Cubin(a) => gen.join(format!("{}.{a}.cubin", m.name())),
            };
            if let Err(e) = std::fs::write(&file, &out.image) {
                eprintln!("error: writing {}: {e}", file.display());
                failed = true;
            }
            if let Target::Cubin(a) = target {
                for r in nvrtc::parse_ptxas_log(&out.log) {
                    println!(
                        "{:<8} {:<6} {:<18} {:>5} {:>6} {:>6} {:>6}",
                        m.name(),
                        a,
                        r.function,
                        r.registers,
                        r.shared,
                        r.spill_stores,
                        r.spill_loads
                    );
                    if r.spill_stores + r.spill_loads > 0 {
                        eprintln!("error: {} spills registers on {a}", r.function);
                        failed = true;
                    }
                }
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        println!("wrote {}", gen.display());
        ExitCode::SUCCESS
    }
}
