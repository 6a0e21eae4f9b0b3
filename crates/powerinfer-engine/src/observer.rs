//! [`FfnObserver`]: sees what each layer's FFN computed, for profiling activations and
//! training or evaluating predictors ([`EvalOptions::observe`](crate::EvalOptions::observe),
//! [`Session::eval_observed`](crate::Session::eval_observed)).

/// Sees what each layer's FFN computed. With an observer every FFN neuron is computed (the
/// FFN runs densely, so that the true activations are known); the result is that of the dense
/// forward pass.
pub trait FfnObserver {
    /// Called once per layer per evaluated block of `t` tokens, layers in order.
    ///
    /// - `h`: the predictor input, `t × n_embd` (the pre-norm residual `ffn_inp`, spec §4; for
    ///   `falcon` the layer input);
    /// - `act`: the true FFN hidden values after the activation function, `t × n_ff`, every
    ///   neuron computed (a neuron fired for a token when its value is non-zero); for the
    ///   gate-less `falcon` and `opt`, `ReLU(up (+ bias))`;
    /// - `scores`: the predictor scores `t × n_ff` when the layer has a predictor.
    fn observe(&mut self, layer: usize, t: usize, h: &[f32], act: &[f32], scores: Option<&[f32]>);
}
