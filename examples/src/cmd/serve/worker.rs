//! The decoding thread of `powerinfer serve`: owns the [`Scheduler`] (continuous batching over
//! the shared engine), takes requests and cancellations from the HTTP handlers over a channel,
//! and streams each sequence's tokens back over its own channel. A request whose receiver is
//! gone (the client disconnected) is cancelled before the next step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use powerinfer_engine::{
    Engine, Event, Finish, SamplingParams, Scheduler, SchedulerOptions, SeqHandle,
};
use tokio::sync::{mpsc, oneshot};

use super::metrics::Metrics;

/// What a request receives while it runs.
#[derive(Debug)]
pub enum Update {
    /// Generated text (may be empty mid-character).
    Text(String),
    /// The sequence ended.
    Done {
        /// Why.
        reason: Finish,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        generated: usize,
    },
}

/// Why a request was not taken.
#[derive(Debug)]
pub enum Refused {
    /// The queue is full.
    Busy,
    /// The scheduler refused it (bad tokens, too long).
    Invalid(String),
}

/// A command to the decoding thread.
pub enum Command {
    /// Starts a sequence.
    Submit {
        /// Prompt tokens.
        tokens: Vec<u32>,
        /// Sampling and stop rules.
        params: SamplingParams,
        /// Where its updates go.
        updates: mpsc::UnboundedSender<Update>,
        /// Its handle, or why not.
        reply: oneshot::Sender<Result<SeqHandle, Refused>>,
    },
}

/// Runs the decoding loop until every command sender is gone.
pub fn run(
    engine: Arc<Engine>,
    opts: SchedulerOptions,
    max_queue: usize,
    commands: Receiver<Command>,
    metrics: Arc<Metrics>,
) {
    let limit = opts.max_sequences + max_queue;
    let mut sched = Scheduler::new(&engine, opts);
    let mut routes: HashMap<SeqHandle, mpsc::UnboundedSender<Update>> = HashMap::new();
    let started = Instant::now();
    let generated = AtomicU64::new(0);
    loop {
        // Wait for work when idle; otherwise take whatever arrived since the last step.
        if sched.is_idle() {
            match commands.recv() {
                Ok(c) => take(c, &mut sched, &mut routes, limit, &metrics),
                Err(_) => return,
            }
        }
        loop {
            match commands.try_recv() {
                Ok(c) => take(c, &mut sched, &mut routes, limit, &metrics),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) if sched.is_idle() => return,
                Err(TryRecvError::Disconnected) => break,
            }
        }
        // Clients that went away free their slots before the step.
        let gone: Vec<SeqHandle> = routes
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(&h, _)| h)
            .collect();
        for h in gone {
            sched.cancel(h);
            routes.remove(&h);
            metrics.cancelled.fetch_add(1, Ordering::Relaxed);
        }
        if sched.is_idle() {
            metrics.set_load(0, 0);
            continue;
        }
        let t0 = Instant::now();
        let stepped = sched.step();
        let (seqs, toks) = sched.last_batch();
        if seqs > 0 {
            metrics.step(seqs, toks, t0.elapsed());
        }
        let events = match stepped {
            Ok(e) => e,
            Err(e) => {
                // A failure outside any one sequence: every sequence ends with it.
                for (_, tx) in routes.drain() {
                    let _ = tx.send(Update::Done {
                        reason: Finish::Error(e.to_string()),
                        prompt_tokens: 0,
                        generated: 0,
                    });
                }
                sched = Scheduler::new(&engine, SchedulerOptions::default());
                continue;
            }
        };
        for ev in events {
            match ev {
                Event::Token { seq, text, .. } => {
                    generated.fetch_add(1, Ordering::Relaxed);
                    metrics.tokens_out.fetch_add(1, Ordering::Relaxed);
                    let sent = routes.get(&seq).map(|tx| tx.send(Update::Text(text)));
                    if matches!(sent, Some(Err(_))) {
                        sched.cancel(seq);
                        routes.remove(&seq);
                        metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Event::Finished {
                    seq,
                    reason,
                    prompt_tokens,
                    generated,
                } => {
                    metrics
                        .tokens_in
                        .fetch_add(prompt_tokens as u64, Ordering::Relaxed);
                    if let Some(tx) = routes.remove(&seq) {
                        let _ = tx.send(Update::Done {
                            reason,
                            prompt_tokens,
                            generated,
                        });
                    }
                }
                _ => {}
            }
        }
        metrics.set_load(sched.live() - sched.queued(), sched.queued());
        metrics.set_density(sched.ffn_density());
        let secs = started.elapsed().as_secs_f64();
        metrics.set_rate(generated.load(Ordering::Relaxed) as f64 / secs.max(1e-9));
    }
}

fn take(
    c: Command,
    sched: &mut Scheduler<'_>,
    routes: &mut HashMap<SeqHandle, mpsc::UnboundedSender<Update>>,
    limit: usize,
    metrics: &Metrics,
) {
    match c {
        Command::Submit {
            tokens,
            params,
            updates,
            reply,
        } => {
            // The slots and the queue behind them are full.
            if sched.live() >= limit {
                let _ = reply.send(Err(Refused::Busy));
                return;
            }
            match sched.submit(tokens, params) {
                Ok(h) => {
                    routes.insert(h, updates);
                    let _ = reply.send(Ok(h));
                }
                Err(e) => {
                    let _ = reply.send(Err(Refused::Invalid(e.to_string())));
                }
            }
            metrics.set_load(sched.live() - sched.queued(), sched.queued());
        }
    }
}
