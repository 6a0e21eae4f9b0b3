//! The attention half of a layer.
//!
//! `llama`/`bamboo`: RMSNorm → Q/K/V products → RoPE (mode 0) → append K/V to the cache →
//! causal attention (GQA) → `attn_output`. `opt`: LayerNorm, biases on every product, no RoPE.
//! `falcon`: LayerNorm (`attn_norm_2` for the attention where the layer has one), fused QKV,
//! NeoX RoPE.

use std::time::Instant;

use powerinfer_kernels_cpu::ops::attention::{attention_part, merge_parts, AttentionPart};
use powerinfer_kernels_cpu::ops::attention_kv::{attention_kv_with, kv_bytes_read};
use powerinfer_kernels_cpu::ops::rope::rope_block;

use super::step::{add_bias, norm, LayerRun, Step};
use super::weights::{product, products, QkvMats};
use crate::device::AttentionJob;
use crate::error::Result;
use crate::kv_cache::KvCache;
use crate::model::Qkv;
use crate::profile::OpKind;
use crate::schedule::balance::Balance;

/// The attention half of layer `l` over the batch: reads the layer input `x` and returns the
/// attention's output (`attn_output` and its bias applied; the buffer is `step.buf.tmp`,
/// handed back there by the caller). Leaves `attn_norm(x)` in `step.buf.cur` (`falcon`'s FFN
/// reads it).
pub(crate) fn attention(
    step: &mut Step<'_>,
    cache: &mut KvCache,
    run: &LayerRun<'_, '_>,
    x: &[f32],
) -> Result<Vec<f32>> {
    let (l, layer, mats) = (run.index, run.layer, run.mats);
    let (t, hp, mm, mirror) = (step.t, step.hp, step.mm, step.mirror);
    let laps = &mut step.laps;
    let (ne, nkv, hd) = (hp.n_embd, hp.n_embd_kv(), hp.head_dim());
    let b = &mut step.buf;
    // Every buffer is overwritten whole below (norms, products, attention), so it keeps its
    // old values where its length stays: clearing a prompt block's buffers cost as much as a
    // norm.
    let fit = |v: &mut Vec<f32>, n: usize| v.resize(n, 0.0);
    fit(&mut b.cur, t * ne);
    fit(&mut b.q, t * ne);
    fit(&mut b.k, t * nkv);
    fit(&mut b.v, t * nkv);
    fit(&mut b.heads, t * ne);
    fit(&mut b.tmp, t * ne);
    norm(mm, x, &layer.attn_norm, hp.rms_eps, &mut b.cur)?;
    let attn_in: &[f32] = match &layer.attn_norm_2 {
        Some(n2) => {
            fit(&mut b.cur2, t * ne);
            norm(mm, x, n2, hp.rms_eps, &mut b.cur2)?;
            &b.cur2
        }
        None => &b.cur,
    };
    laps.lap(OpKind::Norm, || 0);
    match (&mats.qkv, &layer.qkv) {
        (QkvMats::Separate([wq, wk, wv]), Qkv::Separate { bq, bk, bv, .. }) => {
            if step.opts.fuse {
                // The three products in one dispatch.
                products(
                    mm,
                    &mut [
                        (wq, attn_in, &mut b.q),
                        (wk, attn_in, &mut b.k),
                        (wv, attn_in, &mut b.v),
                    ],
                    t,
                )?;
            } else {
                product(mm, wq, attn_in, t, &mut b.q)?;
                product(mm, wk, attn_in, t, &mut b.k)?;
                product(mm, wv, attn_in, t, &mut b.v)?;
            }
            add_bias(&mut b.q, bq.as_deref())?;
            add_bias(&mut b.k, bk.as_deref())?;
            add_bias(&mut b.v, bv.as_deref())?;
            laps.lap(OpKind::Qkv, || wq.bytes() + wk.bytes() + wv.bytes());
        }
        (QkvMats::Fused(w), _) => {
            let width = ne + 2 * nkv;
            fit(&mut b.qkv, t * width);
            product(mm, w, attn_in, t, &mut b.qkv)?;
            for (i, row) in b.qkv.chunks_exact(width).enumerate() {
                b.q[i * ne..(i + 1) * ne].copy_from_slice(&row[..ne]);
                b.k[i * nkv..(i + 1) * nkv].copy_from_slice(&row[ne..ne + nkv]);
                b.v[i * nkv..(i + 1) * nkv].copy_from_slice(&row[ne + nkv..]);
            }
            laps.lap(OpKind::Qkv, || w.bytes());
        }
        (QkvMats::Separate(_), Qkv::Fused(_)) => unreachable!("views follow the model"),
    }
    if let Some(rope) = &step.rope {
        rope_block(&mut b.q, hp.n_head, hd, &step.positions, rope)?;
        rope_block(&mut b.k, hp.n_head_kv, hd, &step.positions, rope)?;
    }
    let mut kv_bytes = 0u64;
    // One sequence's one token: its positions may be split with the device.
    let (bal_opts, mut split) = match step.balance.as_deref_mut() {
        Some(Balance {
            options,
            attention: Some(a),
            ..
        }) if t == 1 && step.segments.len() == 1 => (Some(&*options), Some(a)),
        _ => (None, None),
    };
    for (sg, &s0) in step.segments.iter().zip(&step.starts) {
        let n = sg.tokens.len();
        if n == 0 {
            continue;
        }
        cache.append(
            sg.seq,
            l,
            &b.k[s0 * nkv..][..n * nkv],
            &b.v[s0 * nkv..][..n * nkv],
        )?;
        let (q_s, out_s) = (&b.q[s0 * ne..][..n * ne], &mut b.heads[s0 * ne..][..n * ne]);
        // The attention split (F16 caches only: the load refuses it for others).
        let split_f16 = cache.layer_f16(sg.seq, l)?.is_some();
        if let (Some(a), Some(d), Some(o), true) =
            (split.as_deref_mut(), mirror, bal_opts, split_f16)
        {
            let n_pos = cache.layer_rows(sg.seq, l)?;
            let s = a.device_positions(l, n_pos);
            if s > 0 {
                a.sync(d, cache, sg.seq, l, s)?;
                let Some((kc, vc)) = cache.layer_f16(sg.seq, l)? else {
                    unreachable!("an F16 cache")
                };
                kv_bytes += ((kc.len() + vc.len()) * 2) as u64;
                let job = AttentionJob {
                    layer: l,
                    q: q_s,
                    n: s,
                    params: &step.ap,
                };
                let ticket = d.submit_attention(&job)?;
                let t0 = Instant::now();
                let mut cpu_part = AttentionPart::default();
                attention_part(q_s, &kc[s * nkv..], &vc[s * nkv..], &step.ap, &mut cpu_part)?;
                let cpu_time = t0.elapsed();
                let (dev_part, dev_time) = d.finish_attention(ticket)?;
                merge_parts(&dev_part, &cpu_part, &step.ap, out_s)?;
                a.measured(
                    l,
                    n_pos,
                    s,
                    cpu_time,
                    dev_time,
                    o.dead_band,
                    o.attention_step,
                );
                continue;
            }
        }
        let (kc, vc) = cache.layer(sg.seq, l)?;
        kv_bytes += kv_bytes_read(kc.ty(), vc.ty(), kc.n_pos(nkv), nkv) as u64;
        attention_kv_with(mm.backend(), mm.pool(), q_s, kc, vc, n, &step.ap, out_s)?;
    }
    laps.lap(OpKind::Attention, || kv_bytes);
    product(mm, &mats.wo, &b.heads, t, &mut b.tmp)?;
    add_bias(&mut b.tmp, layer.bo.as_deref())?;
    laps.lap(OpKind::AttnOutput, || mats.wo.bytes());
    Ok(std::mem::take(&mut b.tmp))
}
