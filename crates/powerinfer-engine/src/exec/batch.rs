//! The public types of one evaluation: what goes in ([`Batch`] of [`Segment`]s, with
//! [`EvalOptions`]) and what comes out ([`EvalOutput`]).

use crate::kv_cache::SeqId;
use crate::observer::FfnObserver;
use crate::profile::OpProfile;

/// A block of consecutive new tokens of one sequence: one entry of a [`Batch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment<'a> {
    /// The sequence the tokens continue.
    pub seq: SeqId,
    /// The tokens, evaluated as the next positions of `seq`.
    pub tokens: &'a [u32],
}

/// The work of one evaluation: new tokens of one or several sequences (prompt blocks and
/// decode tokens side by side), each weight read once for all of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch<'a> {
    segments: Vec<Segment<'a>>,
}

impl<'a> Batch<'a> {
    /// An empty batch.
    pub fn new() -> Batch<'a> {
        Batch::default()
    }

    /// A batch of `tokens` of one sequence.
    pub fn one(seq: SeqId, tokens: &'a [u32]) -> Batch<'a> {
        Batch {
            segments: vec![Segment { seq, tokens }],
        }
    }

    /// One decode step: one token of each listed sequence.
    pub fn decode(step: &'a [(SeqId, u32)]) -> Batch<'a> {
        Batch {
            segments: step
                .iter()
                .map(|(seq, tok)| Segment {
                    seq: *seq,
                    tokens: std::slice::from_ref(tok),
                })
                .collect(),
        }
    }

    /// Adds `tokens` of sequence `seq`.
    pub fn push(&mut self, seq: SeqId, tokens: &'a [u32]) -> &mut Self {
        self.segments.push(Segment { seq, tokens });
        self
    }

    /// The segments, in order.
    pub fn segments(&self) -> &[Segment<'a>] {
        &self.segments
    }

    /// Tokens in all segments.
    pub fn n_tokens(&self) -> usize {
        self.segments.iter().map(|s| s.tokens.len()).sum()
    }
}

/// Which logits an evaluation returns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Logits {
    /// Each segment's last token's (what sampling needs).
    #[default]
    Last,
    /// Every token's (scoring a text, perplexity).
    All,
    /// None: the output head is skipped (a prompt's blocks before its last, whose logits
    /// nobody reads); every [`EvalOutput::logits`] is empty.
    None,
}

/// How one evaluation runs and what it reports ([`Engine::eval`](crate::Engine::eval)).
#[derive(Default)]
#[non_exhaustive]
pub struct EvalOptions<'a> {
    /// Which logits to return.
    pub logits: Logits,
    /// Sees every layer's FFN (which is then computed densely): profiling activations,
    /// training and evaluating predictors.
    pub observer: Option<&'a mut dyn FfnObserver>,
    /// Receives each operation's time, calls and bytes read.
    pub profile: Option<&'a mut OpProfile>,
}

impl<'a> EvalOptions<'a> {
    /// The defaults: the last token's logits, nothing observed or profiled.
    pub fn new() -> EvalOptions<'a> {
        EvalOptions::default()
    }

    /// Returns every token's logits.
    pub fn all_logits(mut self) -> Self {
        self.logits = Logits::All;
        self
    }

    /// Returns no logits and skips the output head ([`Logits::None`]).
    pub fn no_logits(mut self) -> Self {
        self.logits = Logits::None;
        self
    }

    /// Reports every layer's FFN to `observer` (computed densely).
    pub fn observe(mut self, observer: &'a mut dyn FfnObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Adds each operation's time, calls and bytes read to `profile`.
    pub fn profile(mut self, profile: &'a mut OpProfile) -> Self {
        self.profile = Some(profile);
        self
    }
}

impl std::fmt::Debug for EvalOptions<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EvalOptions")
            .field("logits", &self.logits)
            .field("observer", &self.observer.is_some())
            .field("profile", &self.profile.is_some())
            .finish()
    }
}

/// The result of evaluating one segment.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct EvalOutput {
    /// Logits, `n_vocab` per row: one row per token of the segment, or only the last token's.
    pub logits: Vec<f32>,
    /// Per token, the mean over layers of the share of FFN neurons computed (1 for dense FFNs).
    pub density: Vec<f32>,
}

impl EvalOutput {
    pub(crate) fn empty() -> EvalOutput {
        EvalOutput {
            logits: Vec::new(),
            density: Vec::new(),
        }
    }
}
