//! The code path an operator runs, derived from a [`Backend`].

use std::sync::OnceLock;

use crate::{Backend, KernelError};

/// A checked code path: values are only built from an available [`Backend`], so a kernel never
/// runs instructions the machine lacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Isa(Level);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Level {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    /// AVX2+FMA+F16C, and AVX-512 F for the operators that have such code (attention).
    #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
    Avx512,
}

impl Isa {
    /// The path for `backend`: AVX2+FMA+F16C code for [`Backend::Avx2`] and [`Backend::Avx512`],
    /// with AVX-512 code where an operator has some (attention; compilers with the AVX-512
    /// intrinsics), scalar code for [`Backend::Scalar`] and [`Backend::Neon`]. Errors if this
    /// CPU cannot run `backend`.
    pub(crate) fn new(backend: Backend) -> Result<Isa, KernelError> {
        if !backend.is_available() {
            return Err(KernelError::BackendUnavailable(backend.name()));
        }
        Ok(match backend {
            #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
            Backend::Avx512 => Isa(Level::Avx512),
            #[cfg(all(target_arch = "x86_64", not(powerinfer_avx512)))]
            Backend::Avx512 => Isa(Level::Avx2Fma),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => Isa(Level::Avx2Fma),
            _ => Isa(Level::Scalar),
        })
    }

    /// The path for [`Backend::detect`] (cached).
    pub(crate) fn detect() -> Isa {
        static BEST: OnceLock<Isa> = OnceLock::new();
        *BEST.get_or_init(|| Isa::new(Backend::detect()).unwrap_or(Isa(Level::Scalar)))
    }

    /// Whether this is the AVX2+FMA+F16C path (always false off x86-64).
    #[inline]
    pub(crate) fn is_avx2(self) -> bool {
        match self.0 {
            Level::Scalar => false,
            #[cfg(target_arch = "x86_64")]
            Level::Avx2Fma => true,
            #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
            Level::Avx512 => true,
        }
    }

    /// Whether this path may also run AVX-512 F code (always false without it).
    #[inline]
    pub(crate) fn is_avx512(self) -> bool {
        #[cfg(all(target_arch = "x86_64", powerinfer_avx512))]
        if self.0 == Level::Avx512 {
            return true;
        }
        false
    }
}
