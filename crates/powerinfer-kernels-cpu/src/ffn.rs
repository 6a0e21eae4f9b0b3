//! The FFN arithmetic of a set of neuron rows for one token: the gate and up rows of the
//! listed neurons, the activation ([`FfnAct`]), and the sparse axpy over their down rows
//! ([`token_ffn`]). An engine's sparse FFN and a device computing its hot neurons on the CPU
//! kernels both run it, so a neuron gives the same bits wherever it is computed.

use crate::ops::activation::{drelu, reglu, relu, swiglu};
use crate::{KernelError, MatMul, Weights};

/// The activation of a gated (or gate-less) FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FfnAct {
    /// ReLU(gate) ⊙ up.
    Reglu,
    /// ReLU(gate) ⊙ ReLU(up).
    Drelu,
    /// SiLU(gate) ⊙ up.
    Swiglu,
    /// ReLU(up (+ up bias)), no gate (`falcon`, `opt`).
    Relu,
}

/// A set of neuron rows: whole matrices, or a device's rows of its hot neurons.
#[derive(Clone, Copy)]
pub struct NeuronRows<'a> {
    /// `ffn_gate` rows, if the FFN has a gate.
    pub gate: Option<&'a Weights<'a>>,
    /// `ffn_up` rows.
    pub up: &'a Weights<'a>,
    /// `ffn_down_t` rows.
    pub down: &'a Weights<'a>,
    /// `ffn_up.bias` of these rows (gate-less FFNs of `opt`).
    pub up_bias: Option<&'a [f32]>,
    /// The activation.
    pub act: FfnAct,
}

/// A token's buffers over a set of neuron rows: `g` and `u` are row-indexed (one value per
/// row; only listed entries are meaningful afterwards: `g` holds the activations the axpy
/// reads; `u` may be empty for gate-less FFNs); `fired` is scratch.
pub struct TokenBufs<'a> {
    /// Gate products, then the activations.
    pub g: &'a mut [f32],
    /// Up products.
    pub u: &'a mut [f32],
    /// The listed neurons whose gate fired.
    pub fired: &'a mut Vec<u32>,
}

/// One token: `y += down_rowsᵀ · act(gate·x, up·x)` over the neurons (row indices) in
/// `active`. Returns the number of `up` rows read (see [`gate_fired`]).
pub fn token_ffn(
    mm: &MatMul<'_>,
    rows: &NeuronRows<'_>,
    x: &[f32],
    active: &[u32],
    b: &mut TokenBufs<'_>,
    y: &mut [f32],
) -> Result<usize, KernelError> {
    let n_up = hidden(mm, rows, x, active, b)?;
    mm.sparse_axpy_indexed(rows.down, b.g, active, y)?;
    Ok(n_up)
}

/// The hidden values of the listed neurons into `b.g`: `act(gate·x, up·x)`, or for a
/// gate-less FFN `ReLU(up·x + b)`. Returns the number of `up` rows read.
pub fn hidden(
    mm: &MatMul<'_>,
    rows: &NeuronRows<'_>,
    x: &[f32],
    active: &[u32],
    b: &mut TokenBufs<'_>,
) -> Result<usize, KernelError> {
    let (g, u) = (&mut *b.g, &mut *b.u);
    let fired = &mut *b.fired;
    match rows.gate {
        Some(gw) => {
            mm.sparse_gemv_indexed(gw, x, active, g)?;
            let up_rows = gate_fired(rows.act, g, active, fired);
            mm.sparse_gemv_indexed(rows.up, x, up_rows, u)?;
            for &i in up_rows {
                let i = i as usize;
                activate(rows.act, &mut g[i..i + 1], &u[i..i + 1])?;
            }
            Ok(up_rows.len())
        }
        None => {
            mm.sparse_gemv_indexed(rows.up, x, active, g)?;
            relu_bias_active(g, active, rows.up_bias);
            Ok(active.len())
        }
    }
}

/// `gate = act(gate, up)` element-wise (gate-less FFNs are activated by their callers).
pub fn activate(act: FfnAct, gate: &mut [f32], up: &[f32]) -> std::result::Result<(), KernelError> {
    match act {
        FfnAct::Reglu => reglu(gate, up)?,
        FfnAct::Drelu => drelu(gate, up)?,
        FfnAct::Swiglu => swiglu(gate, up)?,
        FfnAct::Relu => relu(gate),
    }
    Ok(())
}

/// The rows of `active` whose `up` product is needed once `gate` holds their gate products.
/// Where the activation is ReLU on the gate (ReGLU, dReLU), a neuron whose gate is not
/// positive has output 0 whatever its `up`: its gate value becomes 0 here, and only the others
/// are returned (collected in `fired`), so the `up` rows of the predictor's false positives
/// are never read. The outputs are those of computing every listed `up` row, but for the sign
/// of a zero (which no later step reads: the axpy skips zeros) and for a non-finite `up`
/// product of a neuron whose gate did not fire (0 here, NaN from the full product). Other
/// activations need every listed row: `active` itself.
pub fn gate_fired<'a>(
    act: FfnAct,
    gate: &mut [f32],
    active: &'a [u32],
    fired: &'a mut Vec<u32>,
) -> &'a [u32] {
    if !matches!(act, FfnAct::Reglu | FfnAct::Drelu) {
        return active;
    }
    fired.clear();
    for &i in active {
        let g = &mut gate[i as usize];
        if *g > 0.0 {
            fired.push(i);
        } else {
            *g = 0.0;
        }
    }
    fired
}

/// `h[i] = ReLU(h[i] + b[i])` for the listed neurons (the gate-less FFN's activation; `bias`
/// indexed like `h`).
pub fn relu_bias_active(h: &mut [f32], active: &[u32], bias: Option<&[f32]>) {
    for &i in active {
        let i = i as usize;
        let v = h[i] + bias.map_or(0.0, |b| b[i]);
        h[i] = if v > 0.0 { v } else { 0.0 };
    }
}

/// How many of the listed neurons have a non-zero activation (the rows the axpy reads).
pub fn nonzero(act: &[f32], active: &[u32]) -> u64 {
    active.iter().filter(|&&i| act[i as usize] != 0.0).count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under ReLU-gated activations only the listed neurons whose gate is positive need their
    /// `up` row; the others get an exact 0, and the activation over the fired rows gives what
    /// it gives over every listed row. Other activations need every listed row.
    #[test]
    fn up_rows_only_where_the_gate_fired() {
        let gate0 = [0.5f32, -1.0, 0.0, 2.0, f32::NAN, -0.0, 3.0];
        let up = [2.0f32, 5.0, -7.0, -1.5, 4.0, 1.0, 0.25];
        let active = [0u32, 1, 2, 3, 4, 5];
        for act in [FfnAct::Reglu, FfnAct::Drelu] {
            let mut gate = gate0;
            let mut fired = vec![99];
            let rows = gate_fired(act, &mut gate, &active, &mut fired).to_vec();
            assert_eq!(rows, [0, 3], "{act:?}");
            for i in [1usize, 2, 4, 5] {
                assert_eq!(gate[i].to_bits(), 0f32.to_bits(), "{act:?} neuron {i}");
            }
            assert_eq!(gate[6], 3.0, "unlisted neurons untouched");
            // The activation of the fired rows, against the activation of every listed row.
            let mut all = gate0;
            activate(act, &mut all, &up).unwrap();
            for &i in &rows {
                let i = i as usize;
                activate(act, &mut gate[i..i + 1], &up[i..i + 1]).unwrap();
            }
            for &i in &active {
                let i = i as usize;
                assert_eq!(gate[i], all[i], "{act:?} neuron {i}");
            }
        }
        let mut gate = gate0;
        let mut fired = Vec::new();
        let rows = gate_fired(FfnAct::Swiglu, &mut gate, &active, &mut fired);
        assert_eq!(rows, active);
        assert_eq!(gate[1], -1.0);
    }
}
