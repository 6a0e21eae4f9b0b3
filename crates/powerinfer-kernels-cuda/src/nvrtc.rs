//! Compiling the kernel sources with NVRTC (a CPU-only step: no GPU and no driver needed).
//!
//! Used by the regeneration command (`scripts/build-cuda-kernels`, the `build_kernels` example)
//! and by the CI test that checks every kernel assembles for sm_80 and sm_90 without register
//! spills and that the embedded PTX is what the sources compile to now.

use std::ffi::{c_char, c_int, CString};

use cudarc::nvrtc::{result, sys};

use crate::kernels::KernelModule;

/// What NVRTC produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// Portable PTX for a virtual architecture (`compute_XY`): the driver JIT-compiles it.
    Ptx(&'static str),
    /// A CUBIN for a real architecture (`sm_XY`): runs ptxas, so register use and spills are known.
    Cubin(&'static str),
}

impl Target {
    /// The `--gpu-architecture` value.
    pub fn arch(self) -> &'static str {
        match self {
            Target::Ptx(a) | Target::Cubin(a) => a,
        }
    }
}

/// The PTX target embedded in the crate.
pub const PTX_TARGET: Target = Target::Ptx("compute_80");
/// The CUBIN targets embedded in the crate.
pub const CUBIN_TARGETS: [Target; 2] = [Target::Cubin("sm_80"), Target::Cubin("sm_90")];

/// Why compiling failed.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// libnvrtc could not be loaded.
    #[error("NVRTC not found (libnvrtc.so.12 must be on LD_LIBRARY_PATH; see scripts/test)")]
    Missing,
    /// The source does not compile; `log` is the compiler's log.
    #[error("{module}: compilation for {arch} failed ({code:?}):\n{log}")]
    Compile {
        /// Kernel module or source name.
        module: String,
        /// Architecture.
        arch: &'static str,
        /// NVRTC status.
        code: sys::nvrtcResult,
        /// Compiler log.
        log: String,
    },
    /// Another NVRTC call failed.
    #[error("NVRTC call failed: {0:?}")]
    Api(sys::nvrtcResult),
}

impl From<result::NvrtcError> for NvrtcError {
    fn from(e: result::NvrtcError) -> Self {
        NvrtcError::Api(e.0)
    }
}

/// A compiled module: the image (PTX text without its trailing NUL, or CUBIN bytes) and the log.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// PTX text bytes or CUBIN bytes.
    pub image: Vec<u8>,
    /// NVRTC's program log (with `--ptxas-options=-v`, ptxas's report for CUBIN targets).
    pub log: String,
}

/// Whether libnvrtc can be loaded.
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names; no NVRTC call is made.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), NvrtcError> {
    if !nvrtc_available() {
        return Err(NvrtcError::Missing);
    }
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: the library is present; both pointers are valid for writes.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result()?;
    Ok((major, minor))
}

/// The options every kernel is compiled with.
pub fn compile_options(target: Target) -> Vec<String> {
    vec![
        format!("--gpu-architecture={}", target.arch()),
        "--std=c++17".to_string(),
        "--ptxas-options=-v".to_string(),
        "--fmad=true".to_string(),
        "-default-device".to_string(),
    ]
}

fn log_of(prog: sys::nvrtcProgram) -> String {
    // SAFETY: prog is a live program created by create_program.
    match unsafe { result::get_program_log(prog) } {
        Ok(raw) => {
            let bytes: Vec<u8> = raw
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        }
        Err(_) => String::new(),
    }
}

struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: self.0 was created by create_program and is destroyed exactly once here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compiles one kernel module for one target with [`compile_options`].
pub fn compile(module: KernelModule, target: Target) -> Result<Compiled, NvrtcError> {
    compile_source(module.name(), &module.expanded_source(), target, &[])
}

/// Compiles CUDA C source `src` (named `name` in messages) for `target`, with
/// [`compile_options`] followed by `extra` options.
pub fn compile_source(
    name: &str,
    src: &str,
    target: Target,
    extra: &[&str],
) -> Result<Compiled, NvrtcError> {
    if !nvrtc_available() {
        return Err(NvrtcError::Missing);
    }
    let invalid = || NvrtcError::Api(sys::nvrtcResult::NVRTC_ERROR_INVALID_INPUT);
    let c_src = CString::new(src).map_err(|_| invalid())?;
    let c_name = CString::new(name).map_err(|_| invalid())?;
    let prog = Program(result::create_program(&c_src, Some(&c_name))?);
    let mut opts = compile_options(target);
    opts.extend(extra.iter().map(|s| s.to_string()));
    // SAFETY: prog.0 is live; the options are plain strings without NUL.
    let status = unsafe { result::compile_program(prog.0, &opts) };
    let log = log_of(prog.0);
    if let Err(e) = status {
        return Err(NvrtcError::Compile {
            module: name.to_string(),
            arch: target.arch(),
            code: e.0,
            log,
        });
    }
    let image = match target {
        Target::Ptx(_) => {
            // SAFETY: prog.0 is live and compiled.
            let raw = unsafe { result::get_ptx(prog.0) }?;
            raw.iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect()
        }
        Target::Cubin(_) => {
            let mut size = 0usize;
            // SAFETY: prog.0 is live and compiled for a real architecture; size is writable.
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }.result()?;
            let mut buf = vec![0u8; size];
            // SAFETY: buf has exactly the size NVRTC reported.
            unsafe { sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr() as *mut c_char) }.result()?;
            buf
        }
    };
    Ok(Compiled { image, log })
}

/// ptxas's report on one kernel, read from a `--ptxas-options=-v` log.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxasReport {
    /// Kernel (entry) name.
    pub function: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes of spill stores.
    pub spill_stores: u32,
    /// Bytes of spill loads.
    pub spill_loads: u32,
    /// Stack frame bytes.
    pub stack_frame: u32,
    /// Static shared memory bytes.
    pub shared: u32,
}

fn number_before(line: &str, marker: &str) -> Option<u32> {
    let end = line.find(marker)?;
    line[..end].split_whitespace().last()?.parse().ok()
}

/// Parses ptxas's verbose report (`Compiling entry function 'X'`, `Function properties for X`,
/// `N bytes stack frame, N bytes spill stores, N bytes spill loads`, `Used N registers, ...`).
pub fn parse_ptxas_log(log: &str) -> Vec<PtxasReport> {
    let mut out: Vec<PtxasReport> = Vec::new();
    let mut current: Option<usize> = None;
    for line in log.lines() {
        let quoted = |l: &str| l.split('\'').nth(1).map(str::to_string);
        if line.contains("Compiling entry function") {
            if let Some(name) = quoted(line) {
                out.push(PtxasReport {
                    function: name,
                    ..Default::default()
                });
                current = Some(out.len() - 1);
            }
        } else if line.contains("Function properties for") {
            let name = line
                .rsplit("Function properties for")
                .next()
                .unwrap_or("")
                .trim();
            current = out.iter().position(|r| r.function == name).or_else(|| {
                out.push(PtxasReport {
                    function: name.to_string(),
                    ..Default::default()
                });
                Some(out.len() - 1)
            });
        }
        let Some(i) = current else { continue };
        if let Some(v) = number_before(line, "bytes spill stores") {
            out[i].spill_stores = v;
        }
        if let Some(v) = number_before(line, "bytes spill loads") {
            out[i].spill_loads = v;
        }
        if let Some(v) = number_before(line, "bytes stack frame") {
            out[i].stack_frame = v;
        }
        if let Some(v) = number_before(line, "registers") {
            out[i].registers = v;
        }
        if let Some(v) = number_before(line, "bytes smem") {
            out[i].shared = v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_ptxas_report() {
        let log = "ptxas info    : 0 bytes gmem\n\
ptxas info    : Compiling entry function 'axpy_f16_t1' for 'sm_80'\n\
ptxas info    : Function properties for axpy_f16_t1\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 40 registers, 1024 bytes smem, 412 bytes cmem[0]\n\
ptxas info    : Compiling entry function 'relu' for 'sm_80'\n\
ptxas info    : Function properties for relu\n\
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
ptxas info    : Used 8 registers, 376 bytes cmem[0]\n";
        let r = parse_ptxas_log(log);
        assert_eq!(r.len(), 2);
        assert_eq!(
            r[0],
            PtxasReport {
                function: "axpy_f16_t1".into(),
                registers: 40,
                spill_stores: 4,
                spill_loads: 12,
                stack_frame: 8,
                shared: 1024
            }
        );
        assert_eq!(r[1].function, "relu");
        assert_eq!(r[1].registers, 8);
        assert_eq!(r[1].spill_stores + r[1].spill_loads, 0);
    }
}
