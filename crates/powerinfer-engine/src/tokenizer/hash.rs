//! A fast non-cryptographic hasher for the tokenizer's lookup tables.
//!
//! The tables are keyed by vocabulary strings and id pairs, and looked up a few times per
//! input byte; std's SipHash dominated encoding time. The keys come from the model file and
//! a lookup of any input only probes the fixed table, so HashDoS resistance buys nothing here.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Multiply-rotate hashing of 8-byte words (the scheme of rustc's FxHasher).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FastHasher {
    hash: u64,
}

const K: u64 = 0xf135_7aea_2e62_a9c5;

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(26) ^ word).wrapping_mul(K);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // Spread the high bits (which the multiply mixes best) to the low bits that hashbrown
        // uses for bucket indices.
        self.hash.rotate_left(20)
    }
}

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, Hash};

    fn h<T: Hash>(t: T) -> u64 {
        BuildHasherDefault::<FastHasher>::default().hash_one(t)
    }

    #[test]
    fn distinct_keys_hash_apart() {
        assert_ne!(h("a"), h("b"));
        assert_ne!(h("ab"), h("ba"));
        assert_ne!(h("abcdefgh"), h("abcdefgh\0"));
        assert_ne!(h((1u32, 2u32)), h((2u32, 1u32)));
        let set: std::collections::HashSet<u64> =
            (0..10_000u32).map(|i| h(i.to_string())).collect();
        assert_eq!(set.len(), 10_000);
    }
}
