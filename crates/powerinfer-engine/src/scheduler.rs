//! [`Scheduler`]: many sequences decoded together (continuous batching).
//!
//! Sequences are submitted ([`Scheduler::submit`]) and cancelled at any time, each with its own
//! KV slot, sampler, stop rules and token budget. Each [`Scheduler::step`] evaluates one batch:
//! the next token of every decoding sequence, and chunks of the prompts waiting to start (at
//! most [`SchedulerOptions::prefill_chunk`] prompt tokens a step, so that a long prompt does not
//! stall the sequences already decoding), every weight read once for all of them. A sequence's
//! tokens do not depend on what else is in the batch (each has its own cache and sampler; for
//! quantized weights its logits are bit-identical to running it alone, for float weights
//! equal up to the summation order of the batched products). An error in one sequence ends
//! that sequence only. When a sequence's context is full it is shifted (llama.cpp's context
//! shift: the first `keep` tokens stay, half of the rest is dropped), unless
//! [`SchedulerOptions::context_shift`] is off: then it ends with [`Finish::ContextFull`].

use std::collections::VecDeque;

use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::exec::{Batch, EvalOptions};
use crate::kv_cache::{KvCache, SeqId};
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::StreamDecoder;

/// Identifies a submitted sequence.
pub type SeqHandle = u64;

/// Options of a [`Scheduler`].
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SchedulerOptions {
    /// Sequences decoded at once (KV slots); more wait in a queue.
    pub max_sequences: usize,
    /// Prompt tokens evaluated per step, over all prompts waiting.
    pub prefill_chunk: usize,
    /// Shift a full context instead of ending the sequence.
    pub context_shift: bool,
    /// Tokens kept at the start of a shifted context (a BOS is always kept).
    pub keep: usize,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        SchedulerOptions {
            max_sequences: 8,
            prefill_chunk: 64,
            context_shift: true,
            keep: 0,
        }
    }
}

/// Why a sequence ended.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Finish {
    /// An end-of-generation token.
    Eog,
    /// The generated text contains this stop string.
    Stop(String),
    /// `max_tokens` tokens were generated.
    Length,
    /// The context is full and shifting is off.
    ContextFull,
    /// [`Scheduler::cancel`].
    Cancelled,
    /// Evaluating it failed.
    Error(String),
}

/// What a step produced for one sequence.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// A generated token and the text it completes (may be empty mid-character).
    Token {
        /// The sequence.
        seq: SeqHandle,
        /// The token.
        id: u32,
        /// Its text.
        text: String,
    },
    /// The sequence ended (it is gone from the scheduler).
    Finished {
        /// The sequence.
        seq: SeqHandle,
        /// Why.
        reason: Finish,
        /// Prompt tokens it evaluated.
        prompt_tokens: usize,
        /// Tokens it generated.
        generated: usize,
    },
}

/// Where a sequence is.
enum Phase {
    /// Waiting for a KV slot.
    Queued,
    /// Its prompt is being evaluated; `done` tokens so far.
    Prefill { done: usize },
    /// Its next token to evaluate.
    Decode { next: u32 },
}

struct Seq<'e> {
    handle: SeqHandle,
    slot: Option<SeqId>,
    prompt: Vec<u32>,
    phase: Phase,
    sampler: Sampler,
    decoder: StreamDecoder<'e>,
    text: String,
    generated: usize,
    /// Context shifts so far.
    shifts: usize,
}

/// Continuous batching over an [`Engine`]: sequences are submitted and cancelled at any time;
/// each [`step`](Scheduler::step) evaluates the next token of every decoding sequence and
/// chunks of waiting prompts in one batch. A sequence's tokens do not depend on what else is
/// in the batch; an error ends only its sequence; a full context is shifted (or ends the
/// sequence, [`SchedulerOptions::context_shift`]).
///
/// ```no_run
/// use powerinfer_engine::{Engine, EngineOptions, Event, SamplingParams, Scheduler};
///
/// let engine = Engine::load("model.powerinfer.gguf", EngineOptions::default())?;
/// let mut s = Scheduler::new(&engine, Default::default());
/// for prompt in ["Once upon a time", "The capital of France is"] {
///     let tokens = engine.tokenizer().encode(prompt, true, false);
///     s.submit(tokens, SamplingParams::greedy(16))?;
/// }
/// while !s.is_idle() {
///     for event in s.step()? {
///         if let Event::Token { seq, text, .. } = event {
///             print!("[{seq}]{text}");
///         }
///     }
/// }
/// # Ok::<(), powerinfer_engine::EngineError>(())
/// ```
pub struct Scheduler<'e> {
    engine: &'e Engine,
    opts: SchedulerOptions,
    cache: KvCache,
    seqs: VecDeque<Seq<'e>>,
    next_handle: SeqHandle,
    /// Steps evaluated, and tokens in them.
    steps: u64,
    tokens: u64,
    /// Sequences and tokens of the last evaluated batch.
    last: (usize, usize),
    /// Sum over evaluated tokens of their mean FFN density.
    density: f64,
}

impl<'e> Scheduler<'e> {
    /// A scheduler over `engine` with a KV cache of `opts.max_sequences` slots.
    pub fn new(engine: &'e Engine, opts: SchedulerOptions) -> Scheduler<'e> {
        Scheduler {
            cache: engine.new_cache(),
            engine,
            opts: SchedulerOptions {
                max_sequences: opts.max_sequences.max(1),
                prefill_chunk: opts.prefill_chunk.max(1),
                ..opts
            },
            seqs: VecDeque::new(),
            next_handle: 0,
            steps: 0,
            tokens: 0,
            last: (0, 0),
            density: 0.0,
        }
    }

    /// The engine.
    pub fn engine(&self) -> &'e Engine {
        self.engine
    }

    /// Queues a sequence: `prompt` tokens (BOS included as wanted), then up to
    /// `params.max_tokens` generated ones. Refused at once (nothing queued) for an empty
    /// prompt, a token outside the vocabulary, or a prompt that does not fit the context.
    pub fn submit(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<SeqHandle> {
        let n_vocab = self.engine.model().hparams().n_vocab;
        if prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt has no tokens".into()));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::InvalidToken { id: bad, n_vocab });
        }
        let ctx = self.engine.ctx_len();
        if prompt.len() > ctx {
            return Err(EngineError::Invalid(format!(
                "the prompt has {} tokens, more than the context of {ctx}",
                prompt.len()
            )));
        }
        let handle = self.next_handle;
        self.next_handle += 1;
        let mut sampler = Sampler::new(params);
        prompt.iter().for_each(|&t| sampler.accept(t));
        self.seqs.push_back(Seq {
            handle,
            slot: None,
            prompt,
            phase: Phase::Queued,
            sampler,
            decoder: self.engine.tokenizer().stream_decoder(false),
            text: String::new(),
            generated: 0,
            shifts: 0,
        });
        Ok(handle)
    }

    /// Ends sequence `seq` now (its slot is freed before the next step); `false` if it is not
    /// live.
    pub fn cancel(&mut self, seq: SeqHandle) -> bool {
        match self.seqs.iter().position(|s| s.handle == seq) {
            Some(i) => {
                let s = self.seqs.remove(i).expect("index in range");
                self.free(&s);
                true
            }
            None => false,
        }
    }

    /// Sequences submitted and not finished.
    pub fn live(&self) -> usize {
        self.seqs.len()
    }

    /// Whether no sequence is left.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Sequences waiting for a KV slot.
    pub fn queued(&self) -> usize {
        self.seqs
            .iter()
            .filter(|s| matches!(s.phase, Phase::Queued))
            .count()
    }

    /// Steps evaluated so far, and the tokens in them.
    pub fn counts(&self) -> (u64, u64) {
        (self.steps, self.tokens)
    }

    /// Sequences and tokens in the batch the last [`step`](Self::step) evaluated ((0, 0) when it
    /// had nothing to do): how full the decoding slots are.
    pub fn last_batch(&self) -> (usize, usize) {
        self.last
    }

    /// Mean FFN density (share of neurons computed) over every token evaluated so far.
    pub fn ffn_density(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.density / self.tokens as f64
        }
    }

    fn free(&mut self, s: &Seq<'_>) {
        if let Some(slot) = s.slot {
            let _ = self.cache.remove_sequence(slot);
        }
    }

    /// Evaluates one batch (every decoding sequence's next token, and prompt chunks) and
    /// returns what it produced. Nothing to do: no event.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        self.admit();
        self.make_room(&mut events)?;
        // The batch: decode tokens first, then prompt chunks in arrival order.
        let mut plan: Vec<(usize, Vec<u32>)> = Vec::new();
        self.last = (0, 0);
        for (i, s) in self.seqs.iter().enumerate() {
            if let Phase::Decode { next } = s.phase {
                plan.push((i, vec![next]));
            }
        }
        let mut budget = self.opts.prefill_chunk;
        for (i, s) in self.seqs.iter().enumerate() {
            if budget == 0 {
                break;
            }
            if let Phase::Prefill { done } = s.phase {
                let n = (s.prompt.len() - done).min(budget);
                budget -= n;
                plan.push((i, s.prompt[done..done + n].to_vec()));
            }
        }
        if plan.is_empty() {
            return Ok(events);
        }
        let outputs = self.evaluate(&plan, &mut events);
        self.steps += 1;
        self.last = (plan.len(), plan.iter().map(|(_, t)| t.len()).sum());
        let mut ended = Vec::new();
        for ((i, tokens), out) in plan.iter().zip(outputs) {
            let Some((mut logits, density)) = out else {
                ended.push(*i);
                continue;
            };
            self.tokens += tokens.len() as u64;
            self.density += density;
            let s = &mut self.seqs[*i];
            if let Phase::Prefill { done } = &mut s.phase {
                *done += tokens.len();
                if *done < s.prompt.len() {
                    continue;
                }
            }
            // Logits for the next token: sample it.
            if s.generated >= s.sampler.params().max_tokens {
                events.push(finished(s, Finish::Length));
                ended.push(*i);
                continue;
            }
            let id = s.sampler.sample(&mut logits);
            s.sampler.accept(id);
            if s.sampler.params().stop_at_eog && self.engine.tokenizer().is_eog(id) {
                events.push(finished(s, Finish::Eog));
                ended.push(*i);
                continue;
            }
            let text = match s.decoder.push(id) {
                Ok(t) => t,
                Err(e) => {
                    events.push(finished(s, Finish::Error(e.to_string())));
                    ended.push(*i);
                    continue;
                }
            };
            s.text.push_str(&text);
            s.generated += 1;
            events.push(Event::Token {
                seq: s.handle,
                id,
                text,
            });
            let stop = s
                .sampler
                .params()
                .stop
                .iter()
                .find(|st| !st.is_empty() && s.text.contains(st.as_str()))
                .cloned();
            if let Some(st) = stop {
                events.push(finished(s, Finish::Stop(st)));
                ended.push(*i);
            } else if s.generated >= s.sampler.params().max_tokens {
                events.push(finished(s, Finish::Length));
                ended.push(*i);
            } else {
                s.phase = Phase::Decode { next: id };
            }
        }
        ended.sort_unstable();
        ended.dedup();
        for i in ended.into_iter().rev() {
            let s = self.seqs.remove(i).expect("index in range");
            self.free(&s);
        }
        Ok(events)
    }

    /// Gives queued sequences free KV slots, in arrival order.
    fn admit(&mut self) {
        let live = self.seqs.iter().filter(|s| s.slot.is_some()).count();
        let mut free = self.opts.max_sequences.saturating_sub(live);
        for s in self.seqs.iter_mut() {
            if free == 0 {
                break;
            }
            if matches!(s.phase, Phase::Queued) {
                s.slot = Some(self.cache.add_sequence());
                s.phase = Phase::Prefill { done: 0 };
                free -= 1;
            }
        }
    }

    /// Shifts (or ends) decoding sequences whose context has no room for their next token.
    fn make_room(&mut self, events: &mut Vec<Event>) -> Result<()> {
        let ctx = self.engine.ctx_len();
        let mut ended = Vec::new();
        for (i, s) in self.seqs.iter_mut().enumerate() {
            let (Phase::Decode { .. }, Some(slot)) = (&s.phase, s.slot) else {
                continue;
            };
            let pos = self.cache.pos(slot)?;
            if pos < ctx {
                continue;
            }
            let bos = self.engine.tokenizer().bos();
            let keep = self
                .opts
                .keep
                .max(usize::from(
                    s.prompt.first().copied() == bos && bos.is_some(),
                ))
                .min(pos);
            let discard = (pos - keep) / 2;
            if !self.opts.context_shift || discard == 0 {
                events.push(finished(s, Finish::ContextFull));
                ended.push(i);
                continue;
            }
            self.engine
                .shift_context(&mut self.cache, slot, keep, discard)?;
            s.shifts += 1;
        }
        for i in ended.into_iter().rev() {
            let s = self.seqs.remove(i).expect("index in range");
            self.free(&s);
        }
        Ok(())
    }

    /// Evaluates the planned segments together; if that fails, each alone, so that an error
    /// ends only the sequences whose segment fails (`None`, with a `Finished` event).
    fn evaluate(
        &mut self,
        plan: &[(usize, Vec<u32>)],
        events: &mut Vec<Event>,
    ) -> Vec<Option<(Vec<f32>, f64)>> {
        let mut batch = Batch::new();
        for (i, tokens) in plan {
            batch.push(
                self.seqs[*i].slot.expect("a planned sequence has a slot"),
                tokens,
            );
        }
        match self
            .engine
            .eval(&mut self.cache, &batch, EvalOptions::new())
        {
            Ok(outs) => outs.into_iter().map(|o| Some(split(o))).collect(),
            Err(_) => {
                // A failed evaluation leaves the cache as it was: each segment is tried alone.
                let mut out = Vec::with_capacity(plan.len());
                for (i, tokens) in plan {
                    let slot = self.seqs[*i].slot.expect("a planned sequence has a slot");
                    let one = Batch::one(slot, tokens);
                    match self.engine.eval(&mut self.cache, &one, EvalOptions::new()) {
                        Ok(mut o) => out.push(o.pop().map(split)),
                        Err(e) => {
                            events.push(finished(&self.seqs[*i], Finish::Error(e.to_string())));
                            out.push(None);
                        }
                    }
                }
                out
            }
        }
    }
}

/// An output's logits and the sum of its tokens' FFN densities.
fn split(o: crate::exec::EvalOutput) -> (Vec<f32>, f64) {
    let d = o.density.iter().map(|&d| f64::from(d)).sum();
    (o.logits, d)
}

fn finished(s: &Seq<'_>, reason: Finish) -> Event {
    let prompt_tokens = match s.phase {
        Phase::Queued => 0,
        Phase::Prefill { done } => done,
        Phase::Decode { .. } => s.prompt.len(),
    };
    Event::Finished {
        seq: s.handle,
        reason,
        prompt_tokens,
        generated: s.generated,
    }
}
