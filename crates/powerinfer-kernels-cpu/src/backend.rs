//! Run-time choice of the instruction set used by the matrix kernels.

use std::sync::OnceLock;

/// The answer of [`Backend::detect`], fixed at its first call (or by [`Backend::prefer`]).
static DETECTED: OnceLock<Backend> = OnceLock::new();

/// An instruction set the matrix kernels ([`crate::matmul`]) can use.
///
/// [`Backend::Scalar`] is portable Rust, always compiled and available. The others are used only
/// when [`Backend::is_available`] says this CPU has them; the kernel entry points refuse an
/// unavailable backend with [`KernelError::BackendUnavailable`](crate::KernelError).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Portable scalar code (the compiler may still auto-vectorise it for the baseline target).
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/VL/VNNI on top of [`Backend::Avx2`]: the quantized dot products use
    /// VNNI's `vpdpbusd` on 256-bit vectors; dense GEMMs of F32/F16/BF16/Q8_0 weights use
    /// cache-blocked AVX-512 kernels (with Rust ≥ 1.89); everything else runs the AVX2 code.
    Avx512,
    /// aarch64 NEON. At present the matrix kernels run the scalar code for this backend.
    Neon,
}

impl Backend {
    /// Every backend, in order of preference (best last).
    pub const ALL: [Backend; 4] = [
        Backend::Scalar,
        Backend::Neon,
        Backend::Avx2,
        Backend::Avx512,
    ];

    /// Whether this CPU can run the backend (detected once per process, then cached).
    pub fn is_available(self) -> bool {
        let f = features();
        match self {
            Backend::Scalar => true,
            Backend::Avx2 => f.avx2,
            Backend::Avx512 => f.avx512,
            Backend::Neon => f.neon,
        }
    }

    /// The best available backend of this CPU, or the one [`Backend::prefer`] chose before
    /// the first call (cached for the process).
    pub fn detect() -> Backend {
        *DETECTED.get_or_init(|| {
            if Backend::Avx512.is_available() {
                Backend::Avx512
            } else if Backend::Avx2.is_available() {
                Backend::Avx2
            } else if Backend::Neon.is_available() {
                Backend::Neon
            } else {
                Backend::Scalar
            }
        })
    }

    /// Makes [`Backend::detect`] (and so every kernel that picks its own instruction set,
    /// the layer operators included) use `self` for the rest of the process, e.g. the scalar
    /// code for a comparison. Refused when `self` is not available on this CPU, or when
    /// `detect` already answered another backend (its answer never changes once given).
    pub fn prefer(self) -> Result<(), crate::KernelError> {
        if !self.is_available() {
            return Err(crate::KernelError::BackendUnavailable(self.name()));
        }
        match DETECTED.get_or_init(|| self) {
            b if *b == self => Ok(()),
            _ => Err(crate::KernelError::BackendUnavailable(self.name())),
        }
    }

    /// Every backend this CPU can run, scalar first (what the tests iterate over).
    pub fn available() -> Vec<Backend> {
        Backend::ALL
            .into_iter()
            .filter(|b| b.is_available())
            .collect()
    }

    /// A short name for logs and benchmark labels.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Scalar => "scalar",
            Backend::Avx2 => "avx2",
            Backend::Avx512 => "avx512",
            Backend::Neon => "neon",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Who designed this CPU, for the few tuning constants (prefetch distances) whose best value
/// differs between microarchitectures. It never changes a result, only speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuVendor {
    /// `GenuineIntel`.
    Intel,
    /// `AuthenticAMD`.
    Amd,
    /// Any other vendor string, or a CPU that is not x86-64.
    Other,
}

impl CpuVendor {
    /// This CPU's vendor, from CPUID leaf 0 (read once per process, then cached).
    pub fn detect() -> CpuVendor {
        static VENDOR: OnceLock<CpuVendor> = OnceLock::new();
        *VENDOR.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                // SAFETY: CPUID exists on every x86-64 CPU; leaf 0 only reads the vendor
                // string and the highest leaf.
                #[allow(unused_unsafe)]
                let r = unsafe { std::arch::x86_64::__cpuid(0) };
                let mut id = [0u8; 12];
                id[..4].copy_from_slice(&r.ebx.to_le_bytes());
                id[4..8].copy_from_slice(&r.edx.to_le_bytes());
                id[8..].copy_from_slice(&r.ecx.to_le_bytes());
                match &id {
                    b"GenuineIntel" => CpuVendor::Intel,
                    b"AuthenticAMD" => CpuVendor::Amd,
                    _ => CpuVendor::Other,
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                CpuVendor::Other
            }
        })
    }
}

#[derive(Clone, Copy, Default)]
struct Features {
    avx2: bool,
    avx512: bool,
    neon: bool,
}

fn features() -> Features {
    static F: OnceLock<Features> = OnceLock::new();
    *F.get_or_init(|| {
        #[allow(unused_mut)]
        let mut f = Features::default();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            f.avx2 = has!("avx2") && has!("fma") && has!("f16c");
            f.avx512 = f.avx2
                && has!("avx512f")
                && has!("avx512bw")
                && has!("avx512vl")
                && has!("avx512vnni");
        }
        #[cfg(target_arch = "aarch64")]
        {
            f.neon = std::arch::is_aarch64_feature_detected!("neon");
        }
        f
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_is_always_available_and_detect_is_available() {
        assert!(Backend::Scalar.is_available());
        assert!(Backend::detect().is_available());
        assert_eq!(Backend::available()[0], Backend::Scalar);
    }

    #[test]
    fn vendor_matches_proc_cpuinfo() {
        let v = CpuVendor::detect();
        assert_eq!(v, CpuVendor::detect());
        let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
            println!("skipped: no /proc/cpuinfo");
            return;
        };
        let Some(line) = info.lines().find(|l| l.starts_with("vendor_id")) else {
            println!("skipped: /proc/cpuinfo has no vendor_id");
            return;
        };
        let want = match line.split(':').nth(1).map(str::trim) {
            Some("GenuineIntel") => CpuVendor::Intel,
            Some("AuthenticAMD") => CpuVendor::Amd,
            _ => CpuVendor::Other,
        };
        assert_eq!(v, want, "{line}");
    }
}
