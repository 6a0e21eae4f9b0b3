//! Criterion benchmarks of powerinfer-rs live in `benches/benches/`; this library holds what
//! several of them share.

/// Deterministic pseudo-random 64-bit values (SplitMix64) from `seed`: benchmark inputs that
/// are the same in every run.
pub fn splitmix64(seed: u64) -> impl Iterator<Item = u64> {
    let mut state = seed;
    std::iter::repeat_with(move || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}
