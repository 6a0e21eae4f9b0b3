//! The kernel launches of a program on a GPU with this project's CUDA kernels: which ops fuse
//! (one conversion per shared activation, a norm writing its products' conversion, the gated
//! products of one token) and how many launches each op makes. The CUDA device queues by these
//! rules; the simulated device counts by them, so that both charge the same launches.

use powerinfer_gguf::GgmlType;
use powerinfer_kernels_cpu::ffn::FfnAct;

use crate::device::op::{HotId, MatId, Op};

/// Whether a product with a matrix of type `ty` first converts its activations in a launch of
/// its own (quantized to Q8_0 for the quantized types, rounded to f16 for F16).
pub(crate) fn converts_activation(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::F16)
}

/// What the launches of a hot FFN depend on, besides the op ([`launches_of`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct HotKind {
    /// Its enabled mask applies.
    pub(crate) masked: bool,
    /// It has gate rows.
    pub(crate) gated: bool,
    /// Its up (and gate) products convert their activation.
    pub(crate) converts: bool,
    /// It adds an up bias (gate-less FFNs).
    pub(crate) up_bias: bool,
    /// Its down rows are F16 (the activation is rounded to f16 first).
    pub(crate) f16_down: bool,
}

/// Kernel launches of `op` on a GPU with this project's kernels: what every device counts
/// (`conv`: how a matrix's products convert their activations first; `hot`: what a
/// hot slice's FFN launches depend on). Memsets count as launches.
pub(crate) fn launches_of(
    op: &Op,
    conv: impl Fn(MatId) -> Conversion,
    hot: impl Fn(HotId) -> HotKind,
) -> u64 {
    let mm = |m: MatId| 1 + u64::from(conv(m).is_some());
    match op {
        Op::MatMul { m, .. } => mm(*m),
        // fc1, the ReLU, fc2; an F16 fc2's rounding is the ReLU's launch.
        Op::Predictor(p) => match conv(p.fc2) {
            Some((GgmlType::F16, _)) => mm(p.fc1) + 2,
            _ => mm(p.fc1) + 1 + mm(p.fc2),
        },
        // What the CUDA device queues: the scores copied and masked when a mask applies (else
        // read where they are); the activation converted once; for one token of a gated FFN
        // the fused gate/up products and activation, else the up (and gate) products, the up
        // bias, the activation; the f16 rounding for F16 down rows; the output zeroed unless
        // the axpy adds to it; the axpy; the count.
        Op::HotFfn(f) => {
            let k = hot(f.hot);
            let products = match (k.gated, f.t == 1) {
                (true, true) => 1,
                (true, false) => 3,
                (false, _) => 2 + u64::from(k.up_bias),
            };
            // The fused products count the neurons too.
            let fused = k.gated && f.t == 1;
            2 * u64::from(k.masked)
                + u64::from(k.converts)
                + products
                + u64::from(k.f16_down)
                + u64::from(!f.accumulate)
                + 1
                + u64::from(f.count.is_some() && !fused)
        }
        // The rows stored, then the attention.
        Op::Attention(_) => 2,
        // A gated activation into the scratch, copied back over the gate.
        Op::Activate { act, .. } if *act != FfnAct::Relu => 2,
        Op::Mark { .. } => 0,
        _ => 1,
    }
}

/// How a matrix's products convert their activation: its type and width when they convert it
/// (quantize or round), `None` when they read it as it is.
pub(crate) type Conversion = Option<(GgmlType, usize)>;

/// How many ops from `ops[0]` on are products that share one converted activation: consecutive
/// [`Op::MatMul`]s of one `x` and `t` whose matrices convert it alike (`conv`), each writing a
/// buffer of its own (neither `x`'s nor another's of the run). Q, K and V of an attention, gate
/// and up of a dense FFN. 0 when `ops[0]` is not a converting product.
pub(crate) fn shared_activation_run(ops: &[Op], conv: impl Fn(MatId) -> Conversion) -> usize {
    let Some(&Op::MatMul { m, x, y, t }) = ops.first() else {
        return 0;
    };
    let Some(c) = conv(m) else {
        return 0;
    };
    let mut outs = vec![y.buf];
    if y.buf == x.buf {
        return 1;
    }
    for op in &ops[1..] {
        match *op {
            Op::MatMul {
                m: m2,
                x: x2,
                y: y2,
                t: t2,
            } if x2 == x
                && t2 == t
                && conv(m2) == Some(c)
                && y2.buf != x.buf
                && !outs.contains(&y2.buf) =>
            {
                outs.push(y2.buf)
            }
            _ => break,
        }
    }
    outs.len()
}

/// How many products after `ops[0]` read its output converted by its own launch: when `ops[0]`
/// is a norm without a residual add whose output is the activation of the run of products
/// after it ([`shared_activation_run`]), its input in a buffer of its own (neither its output's
/// nor a product's). The attention norm and Q, K, V; the output norm and the head. 0 otherwise.
pub(crate) fn norm_conversion_run(ops: &[Op], conv: impl Fn(MatId) -> Conversion) -> usize {
    let Some(&Op::Norm {
        x: nx,
        add: None,
        y: ny,
        ..
    }) = ops.first()
    else {
        return 0;
    };
    let rest = &ops[1..];
    let run = shared_activation_run(rest, conv);
    let fits = rest[..run].iter().all(|op| match *op {
        Op::MatMul { x, y, .. } => x == ny && y.buf != nx.buf,
        _ => false,
    });
    if run > 0 && fits && nx.buf != ny.buf {
        run
    } else {
        0
    }
}

/// Kernel launches of a program: [`launches_of`] every op, less the conversions that products
/// sharing an activation ([`shared_activation_run`]) do not repeat and those a norm writes in
/// its own launch ([`norm_conversion_run`]).
pub(crate) fn program_launches(
    ops: &[Op],
    conv: impl Fn(MatId) -> Conversion,
    hot: impl Fn(HotId) -> HotKind,
) -> u64 {
    let mut n: u64 = ops.iter().map(|op| launches_of(op, &conv, &hot)).sum();
    let mut i = 0;
    while i < ops.len() {
        let fused = norm_conversion_run(&ops[i..], &conv);
        if fused > 0 {
            n -= fused as u64;
            i += 1 + fused;
            continue;
        }
        let run = shared_activation_run(&ops[i..], &conv).max(1);
        n -= run as u64 - 1;
        i += run;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{BufId, Span};

    fn span(buf: usize, len: usize) -> Span {
        BufId(buf).span(0, len)
    }

    fn mm(m: usize, x: Span, y: Span, t: usize) -> Op {
        Op::MatMul {
            m: MatId(m),
            x,
            y,
            t,
        }
    }

    #[test]
    fn products_of_one_activation_convert_it_once() {
        // Matrices 0-2: Q4_0 of width 8; 3: F16 of width 8; 4: F32 (no conversion).
        let conv = |m: MatId| match m.0 {
            0..=2 => Some((GgmlType::Q4_0, 8)),
            3 => Some((GgmlType::F16, 8)),
            _ => None,
        };
        let x = span(0, 16);
        let (q, k, v) = (span(1, 16), span(2, 8), span(3, 8));
        let qkv = [mm(0, x, q, 2), mm(1, x, k, 2), mm(2, x, v, 2)];
        let mut ops = qkv.to_vec();
        ops.push(Op::AddRows { y: q, b: BufId(9) });
        assert_eq!(shared_activation_run(&ops, conv), 3);
        // Three conversions before: 3 × 2 + 1; one now.
        assert_eq!(
            program_launches(&ops, conv, |_| HotKind::default()),
            3 + 1 + 1
        );
        // What breaks a run: another activation, token count or conversion, an output in the
        // activation's buffer or in another output's buffer, any other op between.
        for (i, other) in [
            mm(1, span(4, 16), k, 2),
            mm(1, x, k, 1),
            mm(3, x, k, 2),
            mm(1, x, span(0, 8), 2),
            mm(1, x, span(1, 8), 2),
        ]
        .into_iter()
        .enumerate()
        {
            let ops = [qkv[0].clone(), other];
            assert_eq!(shared_activation_run(&ops, conv), 1, "case {i}");
            assert_eq!(
                program_launches(&ops, conv, |_| HotKind::default()),
                4,
                "case {i}"
            );
        }
        let ops = [
            qkv[0].clone(),
            Op::Copy { x, y: span(5, 16) },
            qkv[1].clone(),
        ];
        assert_eq!(program_launches(&ops, conv, |_| HotKind::default()), 5);
        // Products that read the activation as it is share nothing.
        let ops = [mm(4, x, q, 2), mm(4, x, k, 2)];
        assert_eq!(shared_activation_run(&ops, conv), 0);
        assert_eq!(program_launches(&ops, conv, |_| HotKind::default()), 2);
        // A product writing into its own activation's buffer stands alone.
        assert_eq!(shared_activation_run(&[mm(0, x, span(0, 8), 2)], conv), 1);
        // A norm whose output the products read writes their conversion too: one launch for
        // the norm and the conversion, one per product.
        let norm = |input: Span, add: Option<Span>| Op::Norm {
            x: input,
            add,
            w: BufId(8),
            b: None,
            eps: 1e-5,
            y: x,
        };
        let mut ops = vec![norm(span(6, 16), None)];
        ops.extend(qkv.iter().cloned());
        assert_eq!(norm_conversion_run(&ops, conv), 3);
        assert_eq!(program_launches(&ops, conv, |_| HotKind::default()), 1 + 3);
        // Not with a residual add, nor when the norm's input is a product's output or its own.
        for first in [
            norm(span(6, 16), Some(span(7, 16))),
            norm(span(1, 16), None),
            norm(span(0, 16), None),
        ] {
            ops[0] = first;
            assert_eq!(norm_conversion_run(&ops, conv), 0);
            assert_eq!(
                program_launches(&ops, conv, |_| HotKind::default()),
                1 + 1 + 3
            );
        }
    }
}
