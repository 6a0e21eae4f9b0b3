//! Programs: the ops a step queues and sends to a device as one ([`Program`]), and which of
//! them a device with graphs captures and replays ([`GraphCache`]).

use super::op::{HotId, Op, Span};
use super::{Device, ReadId};
use crate::error::Result;

/// The ops a step has queued for a device and not sent yet. A step pushes ops as it builds
/// them; the program goes to the device as one ([`Device::enqueue`]) when the host next needs
/// the device (before it reads, copies in, or times a run) and at the step's end, so that a
/// step the device holds whole is one program (one launch with graphs). Everything the step
/// sends to the device goes through here, so nothing overtakes the ops queued before it.
#[derive(Debug, Default)]
pub(crate) struct Program {
    ops: Vec<Op>,
}

impl Program {
    /// Queues `op` after the others.
    pub(crate) fn push(&mut self, op: Op) {
        self.ops.push(op);
    }

    /// Queues `ops` after the others.
    pub(crate) fn extend(&mut self, ops: impl IntoIterator<Item = Op>) {
        self.ops.extend(ops);
    }

    /// Sends the queued ops as one program (nothing when none is queued).
    pub(crate) fn flush(&mut self, dev: &dyn Device) -> Result<()> {
        if !self.ops.is_empty() {
            dev.enqueue(&self.ops)?;
            self.ops.clear();
        }
        Ok(())
    }

    /// Sends the queued ops, then queues a copy of `src` to the host ([`Device::read`]).
    pub(crate) fn read(&mut self, dev: &dyn Device, src: Span) -> Result<ReadId> {
        self.flush(dev)?;
        dev.read(src)
    }

    /// Sends the queued ops, then queues a copy of `src` into `dst` ([`Device::write`]).
    pub(crate) fn write(&mut self, dev: &dyn Device, dst: Span, src: &[f32]) -> Result<()> {
        self.flush(dev)?;
        dev.write(dst, src)
    }

    /// Sends the queued ops, then `op` as a program of its own between marks `2·slot` and
    /// `2·slot + 1` (its device time: [`Device::elapsed`]).
    pub(crate) fn timed(&mut self, dev: &dyn Device, slot: usize, op: Op) -> Result<()> {
        self.flush(dev)?;
        dev.enqueue(&[
            Op::Mark { slot: 2 * slot },
            op,
            Op::Mark { slot: 2 * slot + 1 },
        ])
    }
}

/// The programs a device with graphs captures once and replays with one launch each: the
/// runs of `ops` between marks (a mark records a timed event on the stream itself).
pub(crate) fn graph_segments(ops: &[Op]) -> impl Iterator<Item = &[Op]> {
    (ops.split(|op| matches!(op, Op::Mark { .. }))).filter(|s| !s.is_empty())
}

/// A program as a device with graphs knows it: its ops, and per hot FFN in them whether its
/// enabled mask applies (that adds kernels). Buffers never move after load, so the ops' ids
/// stand for the memory a graph points at.
pub(crate) type GraphKey = (Vec<Op>, Vec<bool>);

/// Per hot FFN of `ops`, whether its enabled mask applies (`masked`).
pub(crate) fn masked_flags(ops: &[Op], masked: impl Fn(HotId) -> bool) -> Vec<bool> {
    (ops.iter())
        .filter_map(|op| match op {
            Op::HotFfn(f) => Some(masked(f.hot)),
            _ => None,
        })
        .collect()
}

/// Captured programs kept (least recently used dropped first): a server's batches make new
/// programs for a while, and each lookup compares ops.
const MAX_GRAPHS: usize = 64;

/// Programs seen once and not captured, remembered.
const MAX_SIGHTED: usize = 64;

/// What a device with graphs does with a program ([`GraphCache::sight`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Sighting {
    /// The first time: run as it is (a prompt's last chunk, a batch layout seen once).
    First,
    /// The second time: capture it, then launch the graph.
    Capture,
    /// Captured before: launch the graph ([`GraphCache::last`]).
    Replay,
}

/// Which programs a device with graphs captures and replays: a program is captured the second
/// time it is seen, and the [`MAX_GRAPHS`] most recently used are kept. Both devices use it,
/// so that the simulated one counts the launches the CUDA one makes (`G`: the captured graph,
/// `()` on sim).
pub(crate) struct GraphCache<G> {
    sighted: Vec<GraphKey>,
    kept: Vec<(GraphKey, G)>,
}

impl<G> Default for GraphCache<G> {
    fn default() -> Self {
        GraphCache {
            sighted: Vec::new(),
            kept: Vec::new(),
        }
    }
}

impl<G> GraphCache<G> {
    /// What to do with program `ops` (`masked`: [`masked_flags`]). For [`Sighting::Replay`]
    /// its graph is now [`GraphCache::last`].
    pub(crate) fn sight(&mut self, ops: &[Op], masked: &[bool]) -> Sighting {
        let is = |k: &GraphKey| k.0[..] == *ops && k.1[..] == *masked;
        if let Some(i) = self.kept.iter().position(|(k, _)| is(k)) {
            let e = self.kept.remove(i);
            self.kept.push(e);
            return Sighting::Replay;
        }
        if let Some(i) = self.sighted.iter().position(is) {
            self.sighted.remove(i);
            return Sighting::Capture;
        }
        if self.sighted.len() >= MAX_SIGHTED {
            self.sighted.remove(0);
        }
        self.sighted.push((ops.to_vec(), masked.to_vec()));
        Sighting::First
    }

    /// Keeps the graph captured for program `ops` as the most recently used (dropping the least
    /// recently used beyond [`MAX_GRAPHS`]; a graph still running is freed when it completes).
    pub(crate) fn keep(&mut self, ops: &[Op], masked: &[bool], graph: G) {
        if self.kept.len() >= MAX_GRAPHS {
            self.kept.remove(0);
        }
        self.kept.push(((ops.to_vec(), masked.to_vec()), graph));
    }

    /// The most recently used graph.
    pub(crate) fn last(&self) -> Option<&G> {
        self.kept.last().map(|(_, g)| g)
    }

    /// Forgets every program (their memory moved or was freed).
    pub(crate) fn clear(&mut self) {
        self.sighted.clear();
        self.kept.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::BufId;

    fn span(buf: usize, len: usize) -> Span {
        BufId(buf).span(0, len)
    }

    #[test]
    fn a_program_is_captured_the_second_time_and_kept_while_used() {
        let mut c = GraphCache::<u32>::default();
        let prog = |i: usize| {
            vec![Op::Copy {
                x: span(0, i + 1),
                y: span(1, i + 1),
            }]
        };
        assert_eq!(c.sight(&prog(0), &[]), Sighting::First);
        assert_eq!(c.sight(&prog(0), &[true]), Sighting::First, "another mask");
        assert_eq!(c.sight(&prog(0), &[]), Sighting::Capture);
        c.keep(&prog(0), &[], 7);
        assert_eq!(c.sight(&prog(0), &[]), Sighting::Replay);
        assert_eq!(c.last(), Some(&7));
        // 64 more programs captured push the least recently used out.
        for i in 1..=MAX_GRAPHS {
            assert_eq!(c.sight(&prog(i), &[]), Sighting::First);
            assert_eq!(c.sight(&prog(i), &[]), Sighting::Capture);
            c.keep(&prog(i), &[], i as u32);
        }
        assert_eq!(c.sight(&prog(1), &[]), Sighting::Replay);
        assert_eq!(c.sight(&prog(0), &[]), Sighting::First, "dropped");
        c.clear();
        assert_eq!(c.sight(&prog(1), &[]), Sighting::First);
    }
}
