//! The two ends of an evaluation, on either side of the layers: the batch laid out and its
//! tokens embedded; the rows whose logits are returned, the output head on the CPU, and the
//! outputs per segment.

use powerinfer_kernels_cpu::ops::activation::add;

use super::batch::{EvalOutput, Logits, Segment};
use super::step::{norm, Step};
use super::weights::{product, ModelMats};
use crate::error::{EngineError, Result};
use crate::kv_cache::KvCache;
use crate::model::{Model, OPT_POSITION_OFFSET};
use crate::profile::OpKind;

/// Where a batch's tokens are: each segment's first token, each token's position, the tokens.
pub(crate) struct Layout {
    pub(crate) starts: Vec<usize>,
    pub(crate) positions: Vec<usize>,
    pub(crate) tokens: Vec<u32>,
}

/// Checks `segments` against `cache` (no sequence twice, each known and fitting its context)
/// and lays them out.
pub(crate) fn layout(cache: &KvCache, segments: &[Segment<'_>]) -> Result<Layout> {
    let mut lay = Layout {
        starts: Vec::with_capacity(segments.len()),
        positions: Vec::new(),
        tokens: Vec::new(),
    };
    for (i, sg) in segments.iter().enumerate() {
        if segments[..i].iter().any(|o| o.seq == sg.seq) {
            return Err(EngineError::Invalid(format!(
                "sequence {} appears twice in one batch",
                sg.seq
            )));
        }
        cache.reserve(sg.seq, sg.tokens.len())?;
        let p0 = cache.pos(sg.seq)?;
        lay.starts.push(lay.tokens.len());
        lay.positions.extend(p0..p0 + sg.tokens.len());
        lay.tokens.extend_from_slice(sg.tokens);
    }
    Ok(lay)
}

/// The rows (batch token indices) whose logits an evaluation returns: every token, each
/// segment's last, or none.
pub(crate) fn logit_rows(
    which: Logits,
    segments: &[Segment<'_>],
    starts: &[usize],
    t: usize,
) -> Vec<usize> {
    match which {
        Logits::All => (0..t).collect(),
        Logits::Last => segments
            .iter()
            .zip(starts)
            .filter(|(sg, _)| !sg.tokens.is_empty())
            .map(|(sg, &s0)| s0 + sg.tokens.len() - 1)
            .collect(),
        Logits::None => Vec::new(),
    }
}

/// The logits of `rows` of the hidden states `x` on the CPU: output norm, then the head.
pub(crate) fn host_logits(
    step: &mut Step<'_>,
    model: &Model,
    mats: &ModelMats<'_>,
    x: &[f32],
    rows: &[usize],
) -> Result<Vec<f32>> {
    let hp = &model.hparams;
    let (ne, nv, mm) = (hp.n_embd, hp.n_vocab, step.mm);
    let n_out = rows.len();
    let mut logits = vec![0f32; n_out * nv];
    if n_out == 0 {
        return Ok(logits);
    }
    let mut normed = vec![0f32; n_out * ne];
    if n_out * ne == x.len() {
        norm(mm, x, &model.output_norm, hp.rms_eps, &mut normed)?;
    } else {
        let mut picked = vec![0f32; n_out * ne];
        for (dst, &r) in picked.chunks_exact_mut(ne).zip(rows) {
            dst.copy_from_slice(&x[r * ne..][..ne]);
        }
        norm(mm, &picked, &model.output_norm, hp.rms_eps, &mut normed)?;
    }
    step.laps.lap(OpKind::Norm, || 0);
    product(mm, &mats.output, &normed, n_out, &mut logits)?;
    step.laps.lap(OpKind::OutputHead, || mats.output.bytes());
    Ok(logits)
}

/// One [`EvalOutput`] per segment from the logits of the rows [`logit_rows`] chose and every
/// token's density.
pub(crate) fn outputs(
    which: Logits,
    segments: &[Segment<'_>],
    starts: &[usize],
    nv: usize,
    logits: &[f32],
    density: &[f32],
) -> Vec<EvalOutput> {
    let mut outs = Vec::with_capacity(segments.len());
    let mut row = 0;
    for (sg, &s0) in segments.iter().zip(starts) {
        let n = sg.tokens.len();
        if n == 0 {
            outs.push(EvalOutput::empty());
            continue;
        }
        let k = match which {
            Logits::All => n,
            Logits::Last => 1,
            Logits::None => 0,
        };
        outs.push(EvalOutput {
            logits: logits[row * nv..(row + k) * nv].to_vec(),
            density: density[s0..s0 + n].to_vec(),
        });
        row += k;
    }
    outs
}

/// The embeddings of `tokens` into `x` (`n_embd` each): rows of `token_embd`, plus, for `opt`,
/// the learned position embedding of each token's position.
pub(crate) fn embed(
    model: &Model,
    tokens: &[u32],
    positions: &[usize],
    x: &mut [f32],
) -> Result<()> {
    let ne = model.hparams.n_embd;
    let file = model.file();
    let row_of = |t: &crate::model::TensorRef, row: usize, out: &mut [f32]| -> Result<()> {
        let data = file.data_of(&t.info);
        let row_bytes = data.len() / t.rows;
        let bytes = &data[row * row_bytes..][..row_bytes];
        powerinfer_gguf::quants::dequantize(t.ty, bytes, out)?;
        Ok(())
    };
    let te = &model.tok_embd;
    for (out, &tok) in x.chunks_exact_mut(ne).zip(tokens) {
        if tok as usize >= te.rows {
            return Err(EngineError::InvalidToken {
                id: tok,
                n_vocab: te.rows,
            });
        }
        row_of(te, tok as usize, out)?;
    }
    if let Some(pe) = &model.pos_embd {
        let mut scratch = vec![0f32; ne];
        for (out, &pos) in x.chunks_exact_mut(ne).zip(positions) {
            let row = pos + OPT_POSITION_OFFSET;
            if row >= pe.rows {
                return Err(EngineError::ContextFull {
                    needed: pos + 1,
                    ctx_len: pe.rows - OPT_POSITION_OFFSET,
                });
            }
            row_of(pe, row, &mut scratch)?;
            add(out, &scratch)?;
        }
    }
    Ok(())
}
