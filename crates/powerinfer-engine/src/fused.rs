//! Single-token decode helpers that put several row-parallel products into one thread-pool
//! dispatch (`ThreadPool::run`): the Q/K/V products and the gate and up products of a dense
//! FFN ([`MatMul::gemv_multi`]), and the predictor's second layer together with the sparse
//! gate/up products of a PowerInfer FFN (each thread runs the ordinary kernels on a one-thread
//! pool over a row-range view of each matrix, its own contiguous range of neurons). Every
//! output row is computed by the same kernel code as the separate multi-threaded calls
//! (results are bit-identical to them); only the number of dispatches changes.
//!
//! Setting the environment variable `POWERINFER_NOFUSE` turns these paths off (one dispatch per
//! product, as for a block of tokens), for A/B measurements.

use std::sync::Mutex;

use powerinfer_kernels_cpu::{KernelError, MatMul, ThreadPool};

use crate::error::Result;

/// Whether the fused single-token paths are used (`POWERINFER_NOFUSE` unset; A/B switch).
pub(crate) fn enabled() -> bool {
    #[cfg(test)]
    if tests::FORCE_OFF.with(|c| c.get()) {
        return false;
    }
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("POWERINFER_NOFUSE").is_none())
}

/// Runs `f(tid, &single_thread_matmul)` on every thread of `mm`'s pool in one dispatch and
/// returns the first error any call returned.
pub(crate) fn run_threads<F>(mm: &MatMul<'_>, f: F) -> Result<()>
where
    F: Fn(usize, &MatMul<'_>) -> std::result::Result<(), KernelError> + Sync,
{
    let backend = mm.backend();
    let err: Mutex<Option<KernelError>> = Mutex::new(None);
    mm.pool().run(|tid| {
        let single = ThreadPool::single();
        let r = MatMul::with_backend(&single, backend).and_then(|m| f(tid, &m));
        if let Err(e) = r {
            let mut g = err.lock().unwrap_or_else(|e| e.into_inner());
            g.get_or_insert(e);
        }
    });
    match err.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use crate::engine::{Engine, EngineOptions};
    use crate::synth::{self, Arch, LnArch, Shape, SynthConfig, SynthOutputs};
    use powerinfer_gguf::GgmlType;

    thread_local! {
        /// Turns the fused paths off on this thread (the pool's workers only run jobs).
        pub(super) static FORCE_OFF: Cell<bool> = const { Cell::new(false) };
    }

    /// Logits of a prompt block followed by single-token decode steps.
    fn decode(path: &std::path::Path, dense: bool, threads: usize, fused: bool) -> Vec<Vec<f32>> {
        FORCE_OFF.with(|c| c.set(!fused));
        let engine = Engine::load(
            path,
            EngineOptions {
                threads,
                sparse_threshold: Some(0.0),
                dense,
                ctx_len: 64,
                batch: 64,
                mmap: false,
                repack: false,
            },
        )
        .unwrap();
        let mut s = engine.session();
        let mut out = vec![s.eval(&[1, 300, 301, 77]).unwrap()];
        for t in [5u32, 260, 400, 33, 90, 270] {
            out.push(s.eval(&[t]).unwrap());
        }
        FORCE_OFF.with(|c| c.set(false));
        out
    }

    #[test]
    fn fused_decode_is_bit_identical() {
        for (ty, arch, ln) in [
            (GgmlType::Q4_0, Arch::Llama, None),
            (GgmlType::F16, Arch::Bamboo, None),
            (GgmlType::Q8_0, Arch::Llama, Some(LnArch::Opt)),
            (GgmlType::Q4_0, Arch::Llama, Some(LnArch::Falcon)),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let sparse = dir.path().join("m.powerinfer.gguf");
            let dense = dir.path().join("m.gguf");
            let mut cfg = SynthConfig::new(Shape::preset("tiny").unwrap());
            cfg.ty = ty;
            cfg.arch = arch;
            cfg.ln_arch = ln;
            cfg.seed = 5;
            let out = SynthOutputs {
                model: sparse.clone(),
                dense: Some(dense.clone()),
                activation_dir: None,
                predictor_dir: None,
            };
            synth::synthesize(&cfg, &out, &mut |_, _| {}).unwrap();
            for threads in [1, 2, 3] {
                for (path, dense_mode) in [(&sparse, false), (&sparse, true), (&dense, false)] {
                    let a = decode(path, dense_mode, threads, true);
                    let b = decode(path, dense_mode, threads, false);
                    let bits = |v: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
                        v.iter()
                            .map(|r| r.iter().map(|x| x.to_bits()).collect())
                            .collect()
                    };
                    assert_eq!(
                        bits(&a),
                        bits(&b),
                        "{ty:?} {arch:?} {ln:?} threads {threads} {path:?} dense {dense_mode}"
                    );
                }
            }
        }
    }
}
