//! An F16 key/value cache for several sequences.
//!
//! Each sequence has its own slot: per layer a K and a V array in the layout the attention
//! kernel reads (`[ctx_len][n_kv_head][head_dim]`, see
//! [`powerinfer_kernels_cpu::ops::attention`]) and its current position (the number of tokens
//! stored). Memory for a slot is allocated when the sequence is added and grows with its
//! positions up to `ctx_len`.
//!
//! Where a device beside the CPU runs whole layers, those layers' rows of a sequence live in
//! the device's memory (`OnDevice`) and the host holds only the first of them: the engine
//! reads them back when the host needs them (`Engine::fork_sequence`, a context shift, an
//! evaluation on the CPU). A copy of such a cache ([`Clone`]) cannot reach those rows: its
//! sequences fail to evaluate with an error that says so.

use std::sync::Arc;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::{EngineError, Result};

/// Source of [`Slot::stamp`]s, unique in the process.
static STAMPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn new_stamp() -> u64 {
    STAMPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Identifies a sequence of a [`KvCache`].
pub type SeqId = usize;

/// Where the rows of a sequence's device layers live while a device holds them.
#[derive(Debug)]
pub(crate) struct OnDevice {
    /// The identity of the device's stores.
    pub(crate) stores: u64,
    /// The sequence's store there.
    pub(crate) store: usize,
    /// Per layer, whether the device holds its rows (the others are always whole on the host).
    pub(crate) layers: Arc<[bool]>,
    /// Rows of the device's layers the host also holds (`0 ..= pos`).
    pub(crate) host_rows: usize,
    /// Held while the store belongs to this sequence: the stores see it dropped.
    pub(crate) _lease: Arc<()>,
}

/// One sequence's cached keys and values.
#[derive(Debug)]
struct Slot {
    /// Per layer, `pos · n_embd_kv` keys (after RoPE).
    k: Vec<Vec<f16>>,
    /// Per layer, `pos · n_embd_kv` values.
    v: Vec<Vec<f16>>,
    pos: usize,
    /// Renewed whenever rows already stored change or go (appending keeps it), so that a copy
    /// of a prefix elsewhere (a device's mirror) knows whether it still holds these rows.
    stamp: u64,
    /// The device's layers' rows, when a device holds them.
    device: Option<OnDevice>,
    /// A copy of a sequence whose rows were on a device: they cannot be reached from here.
    lost: bool,
}

impl Clone for Slot {
    fn clone(&self) -> Slot {
        let on_device_only = self.device.as_ref().is_some_and(|d| d.host_rows < self.pos);
        Slot {
            k: self.k.clone(),
            v: self.v.clone(),
            pos: self.pos,
            stamp: new_stamp(),
            device: None,
            lost: self.lost || on_device_only,
        }
    }
}

/// The KV cache of a model for up to `n_seq` sequences of up to `ctx_len` positions each.
#[derive(Clone, Debug)]
pub struct KvCache {
    n_layer: usize,
    n_embd_kv: usize,
    ctx_len: usize,
    slots: Vec<Option<Slot>>,
}

impl KvCache {
    /// An empty cache for `n_layer` layers of `n_embd_kv` values per token.
    pub fn new(n_layer: usize, n_embd_kv: usize, ctx_len: usize) -> KvCache {
        KvCache {
            n_layer,
            n_embd_kv,
            ctx_len,
            slots: Vec::new(),
        }
    }

    /// Adds an empty sequence and returns its id (reusing a removed sequence's id).
    pub fn add_sequence(&mut self) -> SeqId {
        let slot = Slot {
            k: vec![Vec::new(); self.n_layer],
            v: vec![Vec::new(); self.n_layer],
            pos: 0,
            stamp: new_stamp(),
            device: None,
            lost: false,
        };
        if let Some(i) = self.slots.iter().position(Option::is_none) {
            self.slots[i] = Some(slot);
            i
        } else {
            self.slots.push(Some(slot));
            self.slots.len() - 1
        }
    }

    /// Removes a sequence and frees its memory.
    pub fn remove_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.slot_mut(seq)?;
        self.slots[seq] = None;
        Ok(())
    }

    /// Forgets every token of `seq` (keeps its id).
    pub fn clear(&mut self, seq: SeqId) -> Result<()> {
        let s = self.slot_mut(seq)?;
        s.pos = 0;
        s.stamp = new_stamp();
        s.lost = false;
        if let Some(d) = s.device.as_mut() {
            d.host_rows = 0;
        }
        s.k.iter_mut().chain(s.v.iter_mut()).for_each(Vec::clear);
        Ok(())
    }

    /// Where the device holds `seq`'s rows, if it does.
    pub(crate) fn device(&self, seq: SeqId) -> Result<Option<&OnDevice>> {
        Ok(self.slot(seq)?.device.as_ref())
    }

    /// Records where the device holds `seq`'s rows (`None`: the host holds them all).
    pub(crate) fn set_device(&mut self, seq: SeqId, d: Option<OnDevice>) -> Result<()> {
        self.slot_mut(seq)?.device = d;
        Ok(())
    }

    /// Whether `seq` is a copy of a sequence whose rows were on a device.
    pub(crate) fn lost(&self, seq: SeqId) -> Result<bool> {
        Ok(self.slot(seq)?.lost)
    }

    /// Appends F16 rows read back from a device to layer `layer` of `seq` on the host.
    pub(crate) fn append_f16(
        &mut self,
        seq: SeqId,
        layer: usize,
        k: &[f16],
        v: &[f16],
    ) -> Result<()> {
        let s = self.slot_mut(seq)?;
        s.k[layer].extend_from_slice(k);
        s.v[layer].extend_from_slice(v);
        Ok(())
    }

    /// A new sequence with `src`'s position and host rows, and no device rows (the caller copies
    /// those on the device).
    pub(crate) fn fork_host(&mut self, src: SeqId) -> Result<SeqId> {
        let s = self.slot(src)?;
        let copy = Slot {
            k: s.k.clone(),
            v: s.v.clone(),
            pos: s.pos,
            stamp: new_stamp(),
            device: None,
            lost: false,
        };
        let seq = self.add_sequence();
        self.slots[seq] = Some(copy);
        Ok(seq)
    }

    /// The error of an operation that needs every row of `seq` on the host while a device
    /// holds some of them.
    fn on_device_error(&self, seq: SeqId, what: &str) -> Result<()> {
        let s = self.slot(seq)?;
        if s.lost {
            return Err(EngineError::Invalid(format!(
                "sequence {seq} is a copy of a sequence whose KV rows are in a device's memory: \
                 they cannot be read from here"
            )));
        }
        match &s.device {
            Some(d) if d.host_rows < s.pos => Err(EngineError::Invalid(format!(
                "{what} sequence {seq}: its KV rows are in the device's memory (use the \
                 Engine's method, which reads them back)"
            ))),
            _ => Ok(()),
        }
    }

    /// The stamp of `seq`'s stored rows: unchanged while rows are only appended.
    pub(crate) fn stamp(&self, seq: SeqId) -> Result<u64> {
        Ok(self.slot(seq)?.stamp)
    }

    /// Values per token and layer in K (and in V).
    pub(crate) fn row_len(&self) -> usize {
        self.n_embd_kv
    }

    /// Number of tokens stored for `seq`.
    pub fn pos(&self, seq: SeqId) -> Result<usize> {
        Ok(self.slot(seq)?.pos)
    }

    /// Context length (positions per sequence).
    pub fn ctx_len(&self) -> usize {
        self.ctx_len
    }

    /// Number of live sequences.
    pub fn n_sequences(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    fn slot(&self, seq: SeqId) -> Result<&Slot> {
        self.slots
            .get(seq)
            .and_then(Option::as_ref)
            .ok_or(EngineError::UnknownSequence(seq))
    }

    fn slot_mut(&mut self, seq: SeqId) -> Result<&mut Slot> {
        self.slots
            .get_mut(seq)
            .and_then(Option::as_mut)
            .ok_or(EngineError::UnknownSequence(seq))
    }

    /// Checks that `n` more tokens fit in `seq`.
    pub fn reserve(&self, seq: SeqId, n: usize) -> Result<()> {
        let needed = self.slot(seq)?.pos + n;
        if needed > self.ctx_len {
            return Err(EngineError::ContextFull {
                needed,
                ctx_len: self.ctx_len,
            });
        }
        Ok(())
    }

    /// Appends `k` and `v` (`n · n_embd_kv` values each, f32) to layer `layer` of `seq`,
    /// converted to f16. The position advances only with [`advance`](Self::advance).
    pub(crate) fn append(&mut self, seq: SeqId, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let s = self.slot_mut(seq)?;
        for (dst, src) in [(&mut s.k[layer], k), (&mut s.v[layer], v)] {
            // Converted a slice at a time (half's vectorized F16C path where the CPU has it)
            // rather than value by value.
            let old = dst.len();
            dst.resize(old + src.len(), f16::ZERO);
            dst[old..].convert_from_f32_slice(src);
        }
        Ok(())
    }

    /// The filled K and V of `layer` of `seq` (including rows appended since the last advance).
    pub(crate) fn layer(&self, seq: SeqId, layer: usize) -> Result<(&[f16], &[f16])> {
        let s = self.slot(seq)?;
        Ok((&s.k[layer], &s.v[layer]))
    }

    /// A new sequence holding a copy of `src`'s tokens (several continuations of one prompt
    /// evaluated once).
    ///
    /// Errors: `src` has rows only a device holds ([`Engine::fork_sequence`](crate::Engine::fork_sequence)
    /// reads them back first).
    pub fn fork(&mut self, src: SeqId) -> Result<SeqId> {
        self.on_device_error(src, "forking")?;
        let mut copy = self.slot(src)?.clone();
        copy.stamp = new_stamp();
        let seq = self.add_sequence();
        self.slots[seq] = Some(copy);
        Ok(seq)
    }

    /// Drops positions `keep .. keep + discard` of `seq` and moves the later ones down by
    /// `discard` (llama.cpp's context shift); `rekey` re-rotates the moved keys of one layer
    /// (f32, whole tokens) by `−discard` positions for models with RoPE.
    pub(crate) fn shift(
        &mut self,
        seq: SeqId,
        keep: usize,
        discard: usize,
        mut rekey: impl FnMut(&mut [f32]) -> Result<()>,
    ) -> Result<()> {
        self.on_device_error(seq, "shifting")?;
        let n = self.n_embd_kv;
        let s = self.slot_mut(seq)?;
        if keep + discard > s.pos {
            return Err(EngineError::Invalid(format!(
                "context shift: keeping {keep} and dropping {discard} of {} positions",
                s.pos
            )));
        }
        s.stamp = new_stamp();
        let mut moved = Vec::new();
        for (k, v) in s.k.iter_mut().zip(s.v.iter_mut()) {
            k.drain(keep * n..(keep + discard) * n);
            v.drain(keep * n..(keep + discard) * n);
            let tail = &mut k[keep * n..];
            moved.clear();
            moved.resize(tail.len(), 0.0);
            tail.convert_to_f32_slice(&mut moved);
            rekey(&mut moved)?;
            tail.convert_from_f32_slice(&moved);
        }
        s.pos -= discard;
        Ok(())
    }

    /// Keeps only the first `n` positions of `seq` (no-op when it holds fewer).
    pub fn truncate(&mut self, seq: SeqId, n: usize) -> Result<()> {
        let w = self.n_embd_kv;
        let s = self.slot_mut(seq)?;
        if n < s.pos {
            s.stamp = new_stamp();
        }
        s.pos = s.pos.min(n);
        if let Some(d) = s.device.as_mut() {
            d.host_rows = d.host_rows.min(s.pos);
        }
        let len = s.pos * w;
        s.k.iter_mut()
            .chain(s.v.iter_mut())
            .for_each(|r| r.truncate(len));
        Ok(())
    }

    /// Drops the rows appended to `seq` since its last advance (an evaluation that failed).
    pub(crate) fn rollback(&mut self, seq: SeqId) {
        let n = self.n_embd_kv;
        if let Ok(s) = self.slot_mut(seq) {
            s.stamp = new_stamp();
            let len = s.pos * n;
            s.k.iter_mut()
                .chain(s.v.iter_mut())
                .for_each(|r| r.truncate(len));
        }
    }

    /// Moves the position of `seq` forward by `n` tokens.
    pub(crate) fn advance(&mut self, seq: SeqId, n: usize) -> Result<()> {
        let n_embd_kv = self.n_embd_kv;
        let s = self.slot_mut(seq)?;
        s.pos += n;
        debug_assert!(s.k.iter().enumerate().all(|(l, k)| match &s.device {
            Some(d) if d.layers[l] => k.len() == d.host_rows * n_embd_kv,
            _ => k.len() == s.pos * n_embd_kv,
        }));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_positions_and_capacity() {
        let mut c = KvCache::new(2, 4, 3);
        let a = c.add_sequence();
        let b = c.add_sequence();
        assert_ne!(a, b);
        for l in 0..2 {
            c.append(a, l, &[1.0; 8], &[2.0; 8]).unwrap();
        }
        c.advance(a, 2).unwrap();
        assert_eq!(c.pos(a).unwrap(), 2);
        assert_eq!(c.pos(b).unwrap(), 0);
        let (k, v) = c.layer(a, 1).unwrap();
        assert_eq!((k.len(), v[0].to_f32()), (8, 2.0));
        assert!(c.reserve(a, 1).is_ok());
        assert!(matches!(
            c.reserve(a, 2),
            Err(EngineError::ContextFull {
                needed: 4,
                ctx_len: 3
            })
        ));
        c.clear(a).unwrap();
        assert_eq!(c.pos(a).unwrap(), 0);
        c.remove_sequence(b).unwrap();
        assert!(matches!(c.pos(b), Err(EngineError::UnknownSequence(_))));
        assert_eq!(c.n_sequences(), 1);
        assert_eq!(c.add_sequence(), b);
    }

    /// A fork copies every layer and the position; a shift drops the middle positions, keeps
    /// the first ones and re-keys the moved ones.
    #[test]
    fn fork_and_shift() {
        let mut c = KvCache::new(2, 2, 8);
        let a = c.add_sequence();
        for l in 0..2 {
            let k: Vec<f32> = (0..10).map(|i| (i + 10 * l) as f32).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            c.append(a, l, &k, &v).unwrap();
        }
        c.advance(a, 5).unwrap();
        let b = c.fork(a).unwrap();
        assert_eq!(c.pos(b).unwrap(), 5);
        assert_eq!(c.layer(b, 1).unwrap(), c.layer(a, 1).unwrap());
        // Keep 1 position, drop 2: positions 0, 3, 4 remain; the moved keys are negated here.
        c.shift(a, 1, 2, |k| {
            k.iter_mut().for_each(|x| *x = -*x);
            Ok(())
        })
        .unwrap();
        assert_eq!(c.pos(a).unwrap(), 3);
        let (k, v) = c.layer(a, 1).unwrap();
        let k: Vec<f32> = k.iter().map(|x| x.to_f32()).collect();
        let v: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
        assert_eq!(k, [10.0, 11.0, -16.0, -17.0, -18.0, -19.0]);
        assert_eq!(v, [-10.0, -11.0, -16.0, -17.0, -18.0, -19.0]);
        assert_eq!(c.pos(b).unwrap(), 5, "the fork is untouched");
        assert!(c.shift(a, 2, 2, |_| Ok(())).is_err());
    }
}
