//! The batch scheduler: a sequence's tokens do not depend on what else is in the batch, long
//! prompts do not stall decoding sequences, errors and full contexts end only their sequence,
//! and generation goes on past a full context by shifting it.

use std::collections::HashMap;

use powerinfer_cli::synth::Family;
use powerinfer_engine::{
    Engine, EngineError, Event, Finish, SamplingParams, Scheduler, SchedulerOptions, SeqHandle,
};
use powerinfer_gguf::GgmlType;

#[path = "support/engine.rs"]
mod common;
use common::make_family;

fn greedy(n: usize) -> SamplingParams {
    SamplingParams::greedy(n).with(|p| p.stop_at_eog = false)
}

/// Runs the scheduler to the end; each sequence's tokens and finish reason.
fn drain(s: &mut Scheduler<'_>) -> HashMap<SeqHandle, (Vec<u32>, Finish)> {
    let mut out: HashMap<SeqHandle, (Vec<u32>, Finish)> = HashMap::new();
    let mut guard = 0;
    while !s.is_idle() {
        for e in s.step().unwrap() {
            match e {
                Event::Token { seq, id, .. } => out
                    .entry(seq)
                    .or_insert((Vec::new(), Finish::Cancelled))
                    .0
                    .push(id),
                Event::Finished { seq, reason, .. } => {
                    out.entry(seq).or_insert((Vec::new(), Finish::Cancelled)).1 = reason
                }
                _ => {}
            }
        }
        guard += 1;
        assert!(guard < 10_000, "the scheduler does not finish");
    }
    out
}

const PROMPTS: [&[u32]; 3] = [
    &[1, 300, 301, 77, 120],
    &[
        1, 5, 260, 400, 33, 90, 270, 11, 19, 40, 41, 42, 43, 44, 45, 46, 47,
    ],
    &[1, 88],
];

/// Every family, a PowerInfer file (sparse) and its dense twin, quantized and F16 weights: the
/// first sequence's greedy tokens alone equal its tokens beside two others submitted at other
/// steps (so they share batches at other positions, prompt chunks beside decode tokens).
#[test]
fn tokens_do_not_depend_on_the_batch() {
    for (i, family) in [Family::Llama, Family::Bamboo, Family::Falcon, Family::Opt]
        .into_iter()
        .enumerate()
    {
        for ty in [GgmlType::Q4_0, GgmlType::F16] {
            let f = make_family(ty, family, 80 + i as u64);
            for path in [&f.sparse, &f.dense] {
                let engine = Engine::load(path, common::opts(false)).unwrap();
                let opts = {
                    let mut o = SchedulerOptions::default();
                    o.prefill_chunk = 6;
                    o
                };
                let mut alone = Scheduler::new(&engine, opts.clone());
                let a = alone.submit(PROMPTS[0].to_vec(), greedy(12)).unwrap();
                let want = drain(&mut alone).remove(&a).unwrap();
                assert_eq!(want.1, Finish::Length);
                assert_eq!(want.0.len(), 12);

                let mut together = Scheduler::new(&engine, opts);
                let b = together.submit(PROMPTS[1].to_vec(), greedy(9)).unwrap();
                together.step().unwrap();
                let a = together.submit(PROMPTS[0].to_vec(), greedy(12)).unwrap();
                together.step().unwrap();
                let c = together.submit(PROMPTS[2].to_vec(), greedy(20)).unwrap();
                let got = drain(&mut together);
                assert_eq!(got[&a], want, "{family:?} {ty:?} {path:?}");
                assert_eq!(got[&b].0.len(), 9);
                assert_eq!(got[&c].0.len(), 20);
            }
        }
    }
}

/// While a long prompt is evaluated in chunks, a decoding sequence gets a token at every step.
#[test]
fn long_prompts_do_not_stall_decoding() {
    let f = make_family(GgmlType::Q8_0, Family::Llama, 90);
    let engine = Engine::load(&f.sparse, common::opts(false)).unwrap();
    let mut o = SchedulerOptions::default();
    o.prefill_chunk = 8;
    let mut s = Scheduler::new(&engine, o);
    let a = s.submit(vec![1, 2, 3], greedy(40)).unwrap();
    while s.step().unwrap().is_empty() {}
    let long: Vec<u32> = (0..100).map(|i| 10 + i).collect();
    let b = s.submit(long, greedy(3)).unwrap();
    let mut b_started = false;
    for _ in 0..14 {
        let events = s.step().unwrap();
        let a_tokens = events
            .iter()
            .filter(|e| matches!(e, Event::Token { seq, .. } if *seq == a))
            .count();
        assert_eq!(a_tokens, 1, "a decodes one token every step: {events:?}");
        b_started |= events
            .iter()
            .any(|e| matches!(e, Event::Token { seq, .. } if *seq == b));
    }
    assert!(
        b_started,
        "the 100-token prompt is done within 14 steps of 8"
    );
}

/// Bad requests are refused at once; a sequence whose context fills without shifting ends
/// alone; with shifting it goes on past the context; cancelling frees the slot.
#[test]
fn errors_full_contexts_and_cancels_end_one_sequence() {
    let f = make_family(GgmlType::Q4_0, Family::Bamboo, 91);
    let mut eo = common::opts(false);
    eo.ctx_len = 24;
    let engine = Engine::load(&f.sparse, eo).unwrap();
    let n_vocab = engine.model().hparams().n_vocab as u32;
    let mut no_shift = SchedulerOptions::default();
    no_shift.context_shift = false;
    let mut s = Scheduler::new(&engine, no_shift);
    assert!(matches!(
        s.submit(vec![1, n_vocab], greedy(4)),
        Err(EngineError::InvalidToken { .. })
    ));
    assert!(s.submit(vec![], greedy(4)).is_err());
    let e = s.submit(vec![1; 25], greedy(4)).unwrap_err().to_string();
    assert!(e.contains("25 tokens") && e.contains("24"), "{e}");
    let full = s.submit(vec![1, 2, 3], greedy(100)).unwrap();
    let short = s.submit(vec![1, 4], greedy(5)).unwrap();
    let got = drain(&mut s);
    assert_eq!(got[&full].1, Finish::ContextFull);
    assert_eq!(
        got[&full].0.len(),
        24 - 3 + 1,
        "one token per free position, the last unevaluated"
    );
    assert_eq!(got[&short].1, Finish::Length);

    let mut s = Scheduler::new(&engine, SchedulerOptions::default());
    let long = s.submit(vec![1, 2, 3], greedy(100)).unwrap();
    let gone = s.submit(vec![1, 5], greedy(100)).unwrap();
    let first = s.step().unwrap();
    assert!(first
        .iter()
        .any(|e| matches!(e, Event::Token { seq, .. } if *seq == long)));
    assert!(s.cancel(gone));
    assert!(!s.cancel(gone));
    let got = drain(&mut s);
    assert_eq!(got[&long], (got[&long].0.clone(), Finish::Length));
    assert_eq!(
        got[&long].0.len(),
        99,
        "generation goes on past the context of 24"
    );
    assert!(!got.contains_key(&gone) || got[&gone].0.len() <= 1);
}

/// A session generates past a full context by shifting it (and counts the shifts), or with
/// shifting off stops with a context-full error after the tokens that fit.
#[test]
fn sessions_shift_full_contexts() {
    let f = make_family(GgmlType::Q8_0, Family::Falcon, 92);
    let mut eo = common::opts(false);
    eo.ctx_len = 20;
    let engine = Engine::load(&f.sparse, eo).unwrap();
    let mut s = engine.session();
    let n = s
        .generate("Hello", greedy(70))
        .map(|t| t.map(|_| ()))
        .collect::<Result<Vec<_>, _>>()
        .unwrap()
        .len();
    assert_eq!(n, 70);
    assert!(s.stats().context_shifts >= 3, "{:?}", s.stats());
    let mut s = engine.session();
    s.set_context_shift(None);
    let results: Vec<_> = s.generate("Hello", greedy(70)).collect();
    let err = results.last().unwrap().as_ref().unwrap_err();
    assert!(matches!(err, EngineError::ContextFull { .. }), "{err}");
    assert!(
        results.len() > 10 && results.len() < 25,
        "{}",
        results.len()
    );
    let mut s = engine.session();
    let e = s
        .generate(&"word ".repeat(30), greedy(2))
        .next()
        .unwrap()
        .unwrap_err();
    assert!(e.to_string().contains("more than the context of 20"), "{e}");
}
