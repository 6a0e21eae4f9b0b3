//! A key/value cache for several sequences, its K and V rows each in a [`KvType`] (F16 by
//! default; llama.cpp's `-ctk`/`-ctv`: F32, BF16, Q8_0, Q4_0).
//!
//! Each sequence has its own slot: per layer a K and a V buffer in the layout the attention
//! kernel reads ([`powerinfer_kernels_cpu::ops::kv`]: row-major F16, head-major blocks for the
//! other types) and its current position (the number of tokens stored). Rows are converted
//! to their type once, when they are stored; they move between a cache and a device's store
//! bit for bit. Memory for a slot is allocated when the sequence is added and grows with its
//! positions up to `ctx_len`.
//!
//! Where a device beside the CPU runs whole layers, those layers' rows of a sequence live in
//! the device's memory (`OnDevice`) and the host holds only the first of them: the engine
//! reads them back when the host needs them (`Engine::fork_sequence`, a context shift, an
//! evaluation on the CPU). A copy of such a cache ([`Clone`]) cannot reach those rows: its
//! sequences fail to evaluate with an error that says so.

use std::sync::Arc;

use half::f16;
pub use powerinfer_kernels_cpu::ops::kv::KvType;
use powerinfer_kernels_cpu::ops::kv::{KvBuf, KvView};

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
    /// Per layer, the keys (after RoPE): `pos` rows (more while an evaluation appends).
    k: Vec<KvBuf>,
    /// Per layer, the values.
    v: Vec<KvBuf>,
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
    /// An empty layer buffer of K and of V (their type and shape).
    empty: (KvBuf, KvBuf),
    slots: Vec<Option<Slot>>,
}

impl KvCache {
    /// An empty F16 cache for `n_layer` layers of `n_embd_kv` values per token.
    pub fn new(n_layer: usize, n_embd_kv: usize, ctx_len: usize) -> KvCache {
        let f16 = KvBuf::new(KvType::F16, 1, n_embd_kv.max(1)).expect("F16 holds any row");
        KvCache {
            n_layer,
            n_embd_kv,
            ctx_len,
            empty: (f16.clone(), f16),
            slots: Vec::new(),
        }
    }

    /// An empty cache for `n_layer` layers of `n_kv_head` heads of `head_dim` values per
    /// token, K stored as `types.0` and V as `types.1`.
    ///
    /// Errors: `head_dim` is not whole blocks of a type (a quantized type's blocks never span
    /// two heads).
    pub fn with_types(
        n_layer: usize,
        n_kv_head: usize,
        head_dim: usize,
        ctx_len: usize,
        types: (KvType, KvType),
    ) -> Result<KvCache> {
        let buf = |ty: KvType, what: &str| {
            KvBuf::new(ty, n_kv_head, head_dim)
                .map_err(|e| EngineError::Invalid(format!("{what} cache: {e}")))
        };
        Ok(KvCache {
            n_layer,
            n_embd_kv: n_kv_head * head_dim,
            ctx_len,
            empty: (buf(types.0, "the K")?, buf(types.1, "the V")?),
            slots: Vec::new(),
        })
    }

    /// The types K and V are stored in.
    pub fn types(&self) -> (KvType, KvType) {
        (self.empty.0.ty(), self.empty.1.ty())
    }

    /// Bytes of one position's K and V rows over every layer.
    pub fn bytes_per_position(&self) -> usize {
        self.n_layer * (self.empty.0.row_bytes() + self.empty.1.row_bytes())
    }

    /// Adds an empty sequence and returns its id (reusing a removed sequence's id).
    pub fn add_sequence(&mut self) -> SeqId {
        let slot = Slot {
            k: vec![self.empty.0.clone(); self.n_layer],
            v: vec![self.empty.1.clone(); self.n_layer],
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
        s.k.iter_mut()
            .chain(s.v.iter_mut())
            .for_each(|b| b.truncate(0));
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

    /// Appends rows read back from a device (the canonical bytes of the cache's types) to
    /// layer `layer` of `seq` on the host.
    pub(crate) fn append_rows(
        &mut self,
        seq: SeqId,
        layer: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<()> {
        let s = self.slot_mut(seq)?;
        s.k[layer].push_bytes(k).map_err(kv_error)?;
        s.v[layer].push_bytes(v).map_err(kv_error)?;
        Ok(())
    }

    /// Rows `from .. from + n` of layer `layer` of `seq` (K, V), in the canonical bytes of the
    /// cache's types (what a device's store takes).
    pub(crate) fn rows(
        &self,
        seq: SeqId,
        layer: usize,
        from: usize,
        n: usize,
    ) -> Result<(Vec<u8>, Vec<u8>)> {
        let s = self.slot(seq)?;
        Ok((
            s.k[layer].rows_bytes(from, n).map_err(kv_error)?,
            s.v[layer].rows_bytes(from, n).map_err(kv_error)?,
        ))
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
    /// converted to the cache's types. The position advances only with
    /// [`advance`](Self::advance).
    pub(crate) fn append(&mut self, seq: SeqId, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        let s = self.slot_mut(seq)?;
        s.k[layer].push_f32(k).map_err(kv_error)?;
        s.v[layer].push_f32(v).map_err(kv_error)?;
        Ok(())
    }

    /// The filled K and V of `layer` of `seq` (including rows appended since the last advance),
    /// as the attention reads them.
    pub(crate) fn layer(&self, seq: SeqId, layer: usize) -> Result<(KvView<'_>, KvView<'_>)> {
        let s = self.slot(seq)?;
        Ok((s.k[layer].view(), s.v[layer].view()))
    }

    /// Rows stored in `layer` of `seq` (including rows appended since the last advance).
    pub(crate) fn layer_rows(&self, seq: SeqId, layer: usize) -> Result<usize> {
        Ok(self.slot(seq)?.k[layer].len())
    }

    /// [`KvCache::layer`] of an F16 cache as f16 values (`None` for the other types).
    pub(crate) fn layer_f16(&self, seq: SeqId, layer: usize) -> Result<Option<(&[f16], &[f16])>> {
        let s = self.slot(seq)?;
        Ok(s.k[layer].as_f16().zip(s.v[layer].as_f16()))
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
        let _ = n;
        let tail = s.pos - keep - discard;
        for (k, v) in s.k.iter_mut().zip(s.v.iter_mut()) {
            k.remove(keep, discard).map_err(kv_error)?;
            v.remove(keep, discard).map_err(kv_error)?;
            // The moved keys re-rotated in f32 and stored again in the cache's type.
            let mut moved = k.rows_f32(keep, tail).map_err(kv_error)?;
            rekey(&mut moved)?;
            k.overwrite_f32(keep, &moved).map_err(kv_error)?;
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
        let _ = w;
        let pos = s.pos;
        s.k.iter_mut()
            .chain(s.v.iter_mut())
            .for_each(|r| r.truncate(pos));
        Ok(())
    }

    /// Drops the rows appended to `seq` since its last advance (an evaluation that failed).
    pub(crate) fn rollback(&mut self, seq: SeqId) {
        let n = self.n_embd_kv;
        if let Ok(s) = self.slot_mut(seq) {
            s.stamp = new_stamp();
            let _ = n;
            let pos = s.pos;
            s.k.iter_mut()
                .chain(s.v.iter_mut())
                .for_each(|r| r.truncate(pos));
        }
    }

    /// Moves the position of `seq` forward by `n` tokens.
    pub(crate) fn advance(&mut self, seq: SeqId, n: usize) -> Result<()> {
        let n_embd_kv = self.n_embd_kv;
        let s = self.slot_mut(seq)?;
        s.pos += n;
        let _ = n_embd_kv;
        debug_assert!(s.k.iter().enumerate().all(|(l, k)| match &s.device {
            Some(d) if d.layers[l] => k.len() == d.host_rows,
            _ => k.len() == s.pos,
        }));
        Ok(())
    }
}

/// A KV buffer's error as the engine's.
fn kv_error(e: powerinfer_kernels_cpu::KernelError) -> EngineError {
    EngineError::Invalid(format!("KV cache: {e}"))
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
        let (k, v) = c.layer_f16(a, 1).unwrap().unwrap();
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
        assert_eq!(c.layer_f16(b, 1).unwrap(), c.layer_f16(a, 1).unwrap());
        // Keep 1 position, drop 2: positions 0, 3, 4 remain; the moved keys are negated here.
        c.shift(a, 1, 2, |k| {
            k.iter_mut().for_each(|x| *x = -*x);
            Ok(())
        })
        .unwrap();
        assert_eq!(c.pos(a).unwrap(), 3);
        let (k, v) = c.layer_f16(a, 1).unwrap().unwrap();
        let k: Vec<f32> = k.iter().map(|x| x.to_f32()).collect();
        let v: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
        assert_eq!(k, [10.0, 11.0, -16.0, -17.0, -18.0, -19.0]);
        assert_eq!(v, [-10.0, -11.0, -16.0, -17.0, -18.0, -19.0]);
        assert_eq!(c.pos(b).unwrap(), 5, "the fork is untouched");
        assert!(c.shift(a, 2, 2, |_| Ok(())).is_err());
    }

    /// A quantized cache stores rows in its type (half F16's bytes for Q8_0) and moves them
    /// as F16 does: a fork copies them bit for bit, a shift drops whole rows and stores the
    /// re-keyed ones in the type again; a head size that is not whole blocks is refused.
    #[test]
    fn quantized_caches_fork_and_shift_whole_rows() {
        assert!(KvCache::with_types(1, 2, 48, 8, (KvType::Q8_0, KvType::F16)).is_err());
        let mut c = KvCache::with_types(2, 2, 32, 8, (KvType::Q8_0, KvType::Q4_0)).unwrap();
        assert_eq!(c.types(), (KvType::Q8_0, KvType::Q4_0));
        assert_eq!(c.bytes_per_position(), 2 * (2 * 34 + 2 * 18));
        let a = c.add_sequence();
        for l in 0..2 {
            let k: Vec<f32> = (0..5 * 64).map(|i| (i % 13) as f32 - 6.0).collect();
            let v: Vec<f32> = k.iter().map(|x| 0.5 * x).collect();
            c.append(a, l, &k, &v).unwrap();
        }
        c.advance(a, 5).unwrap();
        let b = c.fork(a).unwrap();
        assert_eq!(c.rows(b, 1, 0, 5).unwrap(), c.rows(a, 1, 0, 5).unwrap());
        let before = c.rows(a, 0, 0, 5).unwrap();
        c.shift(a, 1, 2, |_| Ok(())).unwrap();
        assert_eq!(c.pos(a).unwrap(), 3);
        let after = c.rows(a, 0, 0, 3).unwrap();
        let (kr, vr) = (34 * 2, 18 * 2);
        // Rows 0, 3, 4 remain; an unchanged key stored again in its type is the same bits.
        assert_eq!(after.0[..kr], before.0[..kr]);
        assert_eq!(after.0[kr..], before.0[3 * kr..]);
        assert_eq!(after.1[vr..], before.1[3 * vr..]);
        assert!(c.rows(a, 0, 0, 4).is_err());
        assert_eq!(c.pos(b).unwrap(), 5, "the fork is untouched");
    }
}
