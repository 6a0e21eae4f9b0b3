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
}

impl Isa {
    /// The path for `backend`: AVX2+FMA+F16C code for [`Backend::Avx2`] and [`Backend::Avx512`]
    /// (the operators have no AVX-512 code), scalar code for [`Backend::Scalar`] and
    /// [`Backend::Neon`]. Errors if this CPU cannot run `backend`.
    pub(crate) fn new(backend: Backend) -> Result<Isa, KernelError> {
        if !backend.is_available() {
            return Err(KernelError::BackendUnavailable(backend.name()));
        }
        Ok(match backend {
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 | Backend::Avx512 => Isa(Level::Avx2Fma),
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
        }
    }
}
