//! Rotary position embedding (RoPE), in place over `n_heads × head_dim` values per token.
//!
//! For pair index `i` in `0..n_dims/2` the angle is
//! `theta_i = pos · freq_scale · freq_base^(-2i / n_dims)` and the pair `(a, b)` becomes
//! `(a·cos − b·sin, a·sin + b·cos)`. The pairs are
//! - [`RopeMode::Normal`] (llama.cpp mode 0, LLaMA/Bamboo GGUFs, whose Q/K rows are permuted at
//!   conversion): elements `(2i, 2i+1)`;
//! - [`RopeMode::NeoX`] (llama.cpp mode 2, Falcon, GPT-NeoX): elements `(i, i + n_dims/2)`.
//!
//! Elements `n_dims..head_dim` of each head are left untouched (partial rotary), in both modes.
//! (Upstream llama.cpp does the same today; the older ggml inside PowerInfer rotated the whole head
//! in mode 0 and also applied `freq_scale` twice in mode 2. Neither matters for the supported
//! models, which have `n_dims == head_dim` and `freq_scale == 1`.)
//!
//! Angles are computed as ggml does, so results agree with llama.cpp's to f32 rounding:
//! `theta_scale = powf(freq_base, -2/n_dims)` in f32, then `t_0 = pos as f32`,
//! `t_{i+1} = t_i · theta_scale` (f32), `theta_i = freq_scale · t_i`, and `cos`/`sin` in f32.
//! The repeated product drifts from the exact angle by about `(i + 2)` f32 roundings of
//! `theta_i`, i.e. up to ~1e-3 rad at positions in the thousands; the tests bound the difference
//! to the exact f64 definition ([`crate::reference::ops::rope`]) accordingly.

use super::check_len;
use crate::KernelError;

/// Which elements of a head form the rotated pairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopeMode {
    /// Adjacent pairs `(2i, 2i+1)` (llama.cpp mode 0).
    Normal,
    /// Split halves `(i, i + n_dims/2)` (llama.cpp mode 2, GPT-NeoX).
    NeoX,
}

/// Parameters of a RoPE.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    /// Number of leading elements of each head that are rotated: even, `2 ≤ n_dims ≤ head_dim`.
    pub n_dims: usize,
    /// Pairing of the elements.
    pub mode: RopeMode,
    /// Frequency base (`rope.freq_base`, 10000 for LLaMA).
    pub freq_base: f32,
    /// Linear scaling: positions are multiplied by this (`1 / rope.scaling.factor`; 1 for none).
    pub freq_scale: f32,
}

impl RopeParams {
    /// Full rotary over `head_dim` with base 10000 and no scaling.
    pub fn new(head_dim: usize, mode: RopeMode) -> Self {
        RopeParams {
            n_dims: head_dim,
            mode,
            freq_base: 10000.0,
            freq_scale: 1.0,
        }
    }

    fn validate(&self, head_dim: usize) -> Result<(), KernelError> {
        if self.n_dims < 2 || self.n_dims % 2 != 0 || self.n_dims > head_dim {
            return Err(KernelError::Shape(format!(
                "rope: n_dims {} must be even, at least 2 and at most head_dim {}",
                self.n_dims, head_dim
            )));
        }
        if !(self.freq_base.is_finite() && self.freq_base > 0.0 && self.freq_scale.is_finite()) {
            return Err(KernelError::Shape(format!(
                "rope: freq_base {} must be finite and positive, freq_scale {} finite",
                self.freq_base, self.freq_scale
            )));
        }
        Ok(())
    }
}

/// Applies RoPE at position `pos` to one token: `x` holds `n_heads × head_dim` values (head after
/// head), rotated in place.
///
/// Errors: `x.len() != n_heads · head_dim`, or invalid `params` (see [`RopeParams::n_dims`]).
pub fn rope(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    pos: usize,
    params: &RopeParams,
) -> Result<(), KernelError> {
    rope_block(x, n_heads, head_dim, &[pos], params)
}

/// Applies RoPE to a block of tokens: `x` holds `positions.len()` tokens of
/// `n_heads × head_dim` values, token `t` rotated for position `positions[t]`.
///
/// Errors: `x.len() != positions.len() · n_heads · head_dim`, or invalid `params`.
pub fn rope_block(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    positions: &[usize],
    params: &RopeParams,
) -> Result<(), KernelError> {
    params.validate(head_dim)?;
    let token_len = n_heads
        .checked_mul(head_dim)
        .ok_or_else(|| KernelError::Shape("rope: n_heads · head_dim overflows".into()))?;
    let expected = positions
        .len()
        .checked_mul(token_len)
        .ok_or_else(|| KernelError::Shape("rope: block size overflows".into()))?;
    check_len("rope: x", expected, x.len())?;
    if token_len == 0 {
        return Ok(());
    }
    let mut angles = Angles::new(params);
    for (tok, &pos) in x.chunks_exact_mut(token_len).zip(positions) {
        angles.at(pos as f32);
        angles.rotate(tok, head_dim);
    }
    Ok(())
}

/// Rotates a block of tokens that were rotated at some positions to those positions plus
/// `delta` (negative: back): the keys of a KV cache whose positions moved (llama.cpp's context
/// shift). `x` holds whole tokens of `n_heads × head_dim` values. Rotations compose, so this
/// equals RoPE at the new position up to f32 rounding.
///
/// Errors: `x.len()` not a multiple of `n_heads · head_dim`, or invalid `params`.
pub fn rope_shift(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    delta: i64,
    params: &RopeParams,
) -> Result<(), KernelError> {
    params.validate(head_dim)?;
    let token_len = n_heads
        .checked_mul(head_dim)
        .ok_or_else(|| KernelError::Shape("rope: n_heads · head_dim overflows".into()))?;
    if token_len == 0 {
        return Ok(());
    }
    if x.len() % token_len != 0 {
        return Err(KernelError::Shape(format!(
            "rope_shift: {} values are not whole tokens of {token_len}",
            x.len()
        )));
    }
    let mut angles = Angles::new(params);
    angles.at(delta as f32);
    for tok in x.chunks_exact_mut(token_len) {
        angles.rotate(tok, head_dim);
    }
    Ok(())
}

/// The cosines and sines of one position's angles, as ggml computes them.
struct Angles<'p> {
    params: &'p RopeParams,
    theta_scale: f32,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl<'p> Angles<'p> {
    fn new(params: &'p RopeParams) -> Self {
        let half = params.n_dims / 2;
        Angles {
            params,
            theta_scale: params.freq_base.powf(-2.0f32 / params.n_dims as f32),
            cos: vec![0f32; half],
            sin: vec![0f32; half],
        }
    }

    /// The angles of position `pos`.
    fn at(&mut self, pos: f32) {
        let mut t = pos;
        for (c, s) in self.cos.iter_mut().zip(self.sin.iter_mut()) {
            let theta = self.params.freq_scale * t;
            *c = theta.cos();
            *s = theta.sin();
            t *= self.theta_scale;
        }
    }

    /// Rotates every head of one token by the current angles.
    fn rotate(&self, tok: &mut [f32], head_dim: usize) {
        let (n_dims, half) = (self.params.n_dims, self.params.n_dims / 2);
        let (cos, sin) = (&self.cos, &self.sin);
        for head in tok.chunks_exact_mut(head_dim) {
            match self.params.mode {
                RopeMode::Normal => {
                    for (pair, (&c, &s)) in
                        head[..n_dims].chunks_exact_mut(2).zip(cos.iter().zip(sin))
                    {
                        let (a, b) = (pair[0], pair[1]);
                        pair[0] = a * c - b * s;
                        pair[1] = a * s + b * c;
                    }
                }
                RopeMode::NeoX => {
                    let (lo, hi) = head[..n_dims].split_at_mut(half);
                    for ((a, b), (&c, &s)) in
                        lo.iter_mut().zip(hi.iter_mut()).zip(cos.iter().zip(sin))
                    {
                        let (x0, x1) = (*a, *b);
                        *a = x0 * c - x1 * s;
                        *b = x0 * s + x1 * c;
                    }
                }
            }
        }
    }
}
