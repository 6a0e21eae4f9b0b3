//! [`Engine`]: a loaded model, its tokenizer, a thread pool and the executor that runs it.

use std::path::Path;
use std::time::{Duration, Instant};

use powerinfer_gguf::GgufFile;
use powerinfer_kernels_cpu::ops::rope::rope_shift;
use powerinfer_kernels_cpu::{AxpyCoefficients, Backend, MatMul, ThreadPool};

use crate::chat::ChatTemplate;
use crate::device::DeviceReport;
use crate::error::Result;
use crate::exec::{Batch, EvalOptions, EvalOutput, ExecOptions, Executor};
use crate::kv_cache::{KvCache, KvType, SeqId};
use crate::model::Model;
use crate::schedule::placement::{self, Opened};
use crate::schedule::{BalanceReport, DeviceOptions};
use crate::tokenizer::Tokenizer;

/// Options of [`Engine::load`]. Start from [`EngineOptions::default`] and set what differs.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct EngineOptions {
    /// Worker threads (the caller counts as one); 0 = all available cores.
    pub threads: usize,
    /// Predictor threshold θ; `None` = the file's `powerinfer.sparse_threshold`, else 0.
    /// (The `powerinfer` command maps PowerInfer's `LLAMA_SPARSE_PRED_THRESHOLD` here.)
    pub sparse_threshold: Option<f32>,
    /// Compute every FFN neuron even for PowerInfer files (for comparison with the sparse path).
    pub dense: bool,
    /// KV cache positions per sequence; 0 = the model's training context length.
    pub ctx_len: usize,
    /// Most prompt tokens evaluated per block (a session cuts a prompt into as few blocks as
    /// this allows, of equal sizes).
    pub batch: usize,
    /// Map the file (`true`, the default: loading is nearly free and the weights stay in the
    /// OS page cache) or read it into anonymous memory with transparent huge pages requested
    /// (`false`, llama.cpp's `--no-mmap`; faster decode where the page cache holds the file in
    /// small pages, at the cost of a copy at load).
    pub mmap: bool,
    /// Copy the dense Q4_0 matrices of one-token products into a layout that needs less
    /// arithmetic ([`MatMul::pack_q4_0`]; same results, bit for bit), as llama.cpp repacks Q4_0
    /// by default. Each copy is made at the matrix's first one-token product, or all at once
    /// by [`Engine::repack_now`]; costs their size in anonymous memory. Only on CPUs with the
    /// packed kernel (AVX-512).
    pub repack: bool,
    /// Run the products that share an input (Q/K/V, gate/up, a token's sparse FFN's predictor
    /// and gate/up) in one thread-pool dispatch each (`true`, the default; same results as
    /// `false`, which exists for comparisons).
    pub fuse: bool,
    /// The CPU kernels' instruction set; `None` = the best this CPU has.
    pub backend: Option<Backend>,
    /// How the sparse FFN's down axpy multiplies the hidden values: f32 (the default,
    /// PowerInfer's arithmetic) or int8 per block with integer dot instructions (faster where
    /// the arithmetic, not memory, bounds it; see [`AxpyCoefficients::Int8`]).
    pub axpy: AxpyCoefficients,
    /// A device beside the CPU (a GPU, or the simulated one) and what it holds.
    pub device: DeviceOptions,
    /// The type the KV cache stores keys in (llama.cpp's `-ctk`; F16 by default). Q8_0 and
    /// Q4_0 need heads of a multiple of 32 values.
    pub cache_type_k: KvType,
    /// The type the KV cache stores values in (`-ctv`).
    pub cache_type_v: KvType,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: 0,
            sparse_threshold: None,
            dense: false,
            ctx_len: 0,
            batch: 256,
            mmap: true,
            repack: false,
            fuse: true,
            backend: None,
            axpy: AxpyCoefficients::Float,
            device: DeviceOptions::default(),
            cache_type_k: KvType::F16,
            cache_type_v: KvType::F16,
        }
    }
}

/// A loaded model ready to evaluate tokens.
///
/// ```no_run
/// use powerinfer_engine::{Engine, EngineOptions, SamplingParams};
///
/// let engine = Engine::load("model.powerinfer.gguf", EngineOptions::default())?;
/// let mut session = engine.session();
/// for token in session.generate("Once upon a time", SamplingParams::greedy(32)) {
///     print!("{}", token?.text);
/// }
/// eprintln!("decode: {:.1} tokens/s", session.stats().decode_tps());
/// # Ok::<(), powerinfer_engine::EngineError>(())
/// ```
pub struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    pool: ThreadPool,
    exec: Executor,
    ctx_len: usize,
    batch: usize,
    load_time: Duration,
    /// Why no device runs anything although one was asked for.
    device_note: Option<String>,
    /// The KV cache's types (K, V).
    kv_types: (KvType, KvType),
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the tokenizer: its vocabulary would fill the screen.
        f.debug_struct("Engine")
            .field("model", &self.model)
            .field("threads", &self.pool.n_threads())
            .field("exec", &self.exec.options())
            .field("ctx_len", &self.ctx_len)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Reads or maps the model file ([`EngineOptions::mmap`]), binds its tensors, builds its
    /// tokenizer and starts the thread pool.
    pub fn load(path: impl AsRef<Path>, options: EngineOptions) -> Result<Engine> {
        let start = Instant::now();
        let path = path.as_ref();
        let file = if options.mmap {
            GgufFile::open(path)?
        } else {
            GgufFile::open_in_memory(path)?
        };
        let model = Model::from_file(file)?;
        let tokenizer = Tokenizer::from_gguf(model.file())?;
        let threads = if options.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            options.threads
        };
        let pool = ThreadPool::new(threads);
        let mm = match options.backend {
            Some(b) => MatMul::with_backend(&pool, b)?,
            None => MatMul::new(&pool),
        };
        let threshold = options
            .sparse_threshold
            .or(model.hparams.file_sparse_threshold)
            .unwrap_or(0.0);
        let ctx_len = if options.ctx_len == 0 {
            model.hparams.n_ctx_train
        } else {
            options.ctx_len
        };
        let exec_opts = ExecOptions {
            threshold,
            dense: options.dense,
            fuse: options.fuse,
            axpy: options.axpy,
        };
        let batch = options.batch.max(1);
        let kv_types = (options.cache_type_k, options.cache_type_v);
        // A head size the types cannot hold is an error now, not at the first token.
        let hp = &model.hparams;
        KvCache::with_types(hp.n_layer, hp.n_head_kv, hp.head_dim(), ctx_len, kv_types)?;
        let opened = placement::open(&options.device, &model, ctx_len, kv_types)?;
        let (hybrid, device_note) = match opened {
            Opened::Device(d) => (
                Some(placement::place(
                    &model,
                    path,
                    &options.device,
                    d,
                    batch,
                    (ctx_len, kv_types),
                    &mm,
                    threshold,
                )?),
                None,
            ),
            Opened::Cpu(note) => (None, note),
        };
        let exec = Executor::new(&model, &mm, exec_opts, options.repack, hybrid);
        Ok(Engine {
            kv_types,
            device_note,
            tokenizer,
            exec,
            ctx_len,
            batch,
            load_time: start.elapsed(),
            model,
            pool,
        })
    }

    /// Makes now the repacked copies that [`EngineOptions::repack`] would otherwise make at
    /// each matrix's first one-token product, so that the first decode steps take no longer
    /// than the others (e.g. before timing them, or before serving). Does nothing when
    /// repacking is off or the CPU has no packed kernel.
    pub fn repack_now(&self) -> Result<()> {
        self.exec.repack_now(&self.model, &self.pool)
    }

    /// Bytes of repacked copies held ([`EngineOptions::repack`]).
    pub fn packed_bytes(&self) -> usize {
        self.exec.packed_bytes()
    }

    /// The device beside the CPU: what it holds and has computed (`kind` `none` without one,
    /// with a `note` saying why when one was asked for).
    pub fn device_report(&self) -> DeviceReport {
        self.exec.device_report().unwrap_or_else(|| DeviceReport {
            kind: "none".into(),
            note: self.device_note.clone(),
            ..DeviceReport::default()
        })
    }

    /// The executor (tests drive its device's schedule).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn executor(&self) -> &Executor {
        &self.exec
    }

    /// What the run-time scheduling of the device and the CPU did: per layer, the two sides'
    /// times, the recall of the device's neurons, moves of the split and of the hot-neuron
    /// cache (`None` without a device).
    pub fn balance_report(&self) -> Option<BalanceReport> {
        self.exec.balance_report()
    }

    /// The chat template: `source` (a template name such as `chatml`, or Jinja text) when
    /// given, else the model's `tokenizer.chat_template`, else ChatML.
    pub fn chat_template(&self, source: Option<&str>) -> Result<ChatTemplate> {
        let md = self.model.file().metadata();
        let file = md.get("tokenizer.chat_template").and_then(|v| v.as_str());
        ChatTemplate::for_model(&self.tokenizer, file, source)
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The predictor threshold in effect.
    pub fn threshold(&self) -> f32 {
        self.exec.options().threshold
    }

    /// Whether the FFN runs sparsely (a PowerInfer file without [`EngineOptions::dense`]).
    pub fn is_sparse(&self) -> bool {
        self.model.is_sparse() && !self.exec.options().dense
    }

    /// Threads in use.
    pub fn threads(&self) -> usize {
        self.pool.n_threads()
    }

    /// KV cache positions per sequence.
    pub fn ctx_len(&self) -> usize {
        self.ctx_len
    }

    /// Prompt tokens evaluated per block ([`EngineOptions::batch`]).
    pub fn batch_size(&self) -> usize {
        self.batch
    }

    /// Time [`load`](Self::load) took.
    pub fn load_time(&self) -> Duration {
        self.load_time
    }

    /// An empty KV cache sized for this model, of the types [`EngineOptions::cache_type_k`] and
    /// [`EngineOptions::cache_type_v`] chose.
    pub fn new_cache(&self) -> KvCache {
        let hp = &self.model.hparams;
        KvCache::with_types(
            hp.n_layer,
            hp.n_head_kv,
            hp.head_dim(),
            self.ctx_len,
            self.kv_types,
        )
        .expect("the types were checked at load")
    }

    /// The types the KV cache stores keys and values in.
    pub fn kv_types(&self) -> (KvType, KvType) {
        self.kv_types
    }

    /// Makes room in sequence `seq` of `cache`: drops the `discard` positions after the first
    /// `keep` and moves the later ones down, their keys re-rotated to their new positions
    /// (llama.cpp's context shift). Generation then continues with the older text forgotten.
    pub fn shift_context(
        &self,
        cache: &mut KvCache,
        seq: SeqId,
        keep: usize,
        discard: usize,
    ) -> Result<()> {
        self.exec.unbind(cache, seq)?;
        let hp = &self.model.hparams;
        let (n_head_kv, head_dim) = (hp.n_head_kv, hp.head_dim());
        let rope = crate::exec::step::rope_of(hp);
        cache.shift(seq, keep, discard, |k| match &rope {
            Some(p) => Ok(rope_shift(k, n_head_kv, head_dim, -(discard as i64), p)?),
            None => Ok(()),
        })
    }

    /// A new sequence of `cache` holding a copy of `src`'s tokens (several continuations of one
    /// prompt evaluated once), as [`KvCache::fork`]; rows a device holds are copied there.
    pub fn fork_sequence(&self, cache: &mut KvCache, src: SeqId) -> Result<SeqId> {
        self.exec.fork(cache, src)
    }

    /// Evaluates `batch`: each segment's tokens become the next positions of its sequence in
    /// `cache`. Every weight is read once for the whole batch; RoPE, the KV cache and attention
    /// are per sequence. Returns one [`EvalOutput`] per segment, in order.
    ///
    /// A token's result equals that of evaluating its sequence alone up to rounding (for
    /// quantized weights bit for bit). Errors (a sequence twice in the batch, an unknown
    /// sequence, a segment that does not fit its context, a token outside the vocabulary, a
    /// device failure) leave the cache as it was.
    ///
    /// ```no_run
    /// use powerinfer_engine::{Batch, Engine, EngineOptions, EvalOptions};
    ///
    /// let engine = Engine::load("model.powerinfer.gguf", EngineOptions::default())?;
    /// let mut cache = engine.new_cache();
    /// let (a, b) = (cache.add_sequence(), cache.add_sequence());
    /// let mut batch = Batch::new();
    /// batch.push(a, &[1, 15043]).push(b, &[1, 3439, 263]);
    /// let out = engine.eval(&mut cache, &batch, EvalOptions::new())?;
    /// assert_eq!(out.len(), 2);
    /// # Ok::<(), powerinfer_engine::EngineError>(())
    /// ```
    pub fn eval(
        &self,
        cache: &mut KvCache,
        batch: &Batch<'_>,
        opts: EvalOptions<'_>,
    ) -> Result<Vec<EvalOutput>> {
        let out = self.exec.eval(&self.model, &self.pool, cache, batch, opts);
        if out.is_err() {
            // Nothing of a failed evaluation stays in the cache.
            for sg in batch.segments() {
                cache.rollback(sg.seq);
            }
        }
        out
    }
}

#[cfg(test)]
mod send_sync {
    fn is_send_sync<T: Send + Sync>() {}

    /// One engine can be shared by threads (a server's handlers tokenize while a worker thread
    /// decodes).
    #[test]
    fn engine_is_send_and_sync() {
        is_send_sync::<super::Engine>();
    }
}
