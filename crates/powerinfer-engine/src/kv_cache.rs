//! An F16 key/value cache for several sequences.
//!
//! Each sequence has its own slot: per layer a K and a V array in the layout the attention
//! kernel reads (`[ctx_len][n_kv_head][head_dim]`, see
//! [`powerinfer_kernels_cpu::ops::attention`]) and its current position (the number of tokens
//! stored). Memory for a slot is allocated when the sequence is added and grows with its
//! positions up to `ctx_len`.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::error::{EngineError, Result};

/// Identifies a sequence of a [`KvCache`].
pub type SeqId = usize;

/// One sequence's cached keys and values.
#[derive(Clone, Debug)]
struct Slot {
    /// Per layer, `pos · n_embd_kv` keys (after RoPE).
    k: Vec<Vec<f16>>,
    /// Per layer, `pos · n_embd_kv` values.
    v: Vec<Vec<f16>>,
    pos: usize,
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
        s.k.iter_mut().chain(s.v.iter_mut()).for_each(Vec::clear);
        Ok(())
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

    /// Moves the position of `seq` forward by `n` tokens.
    pub(crate) fn advance(&mut self, seq: SeqId, n: usize) -> Result<()> {
        let n_embd_kv = self.n_embd_kv;
        let s = self.slot_mut(seq)?;
        s.pos += n;
        debug_assert!(s.k.iter().all(|k| k.len() == s.pos * n_embd_kv));
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
}
