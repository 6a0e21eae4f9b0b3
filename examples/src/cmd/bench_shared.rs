//! What the benchmarks share: the median of their rounds, the greedy token and the device budget that holds a
//! given share of a model's FFN.

use std::path::Path;

use powerinfer_engine::{Engine, EngineOptions};
use powerinfer_gguf::GgufFile;

/// The median of `values` (the mean of the middle two for an even count; NaN when empty).
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Bytes of the FFN rows (`ffn_up`, `ffn_gate`, `ffn_down_t`) of `path`.
fn ffn_bytes(path: &Path) -> Result<u64, String> {
    let file = GgufFile::open(path).map_err(|e| super::file_error(path, e))?;
    Ok(file
        .tensors()
        .iter()
        .filter(|t| {
            let n = t.name();
            n.ends_with("ffn_up.weight")
                || n.ends_with("ffn_gate.weight")
                || n.ends_with("ffn_down_t.weight")
        })
        .map(|t| t.n_bytes())
        .sum())
}

/// The device budget that holds everything but `1 − share` of the FFN's bytes of `path`: the
/// memory the device used holding everything (with `o`'s device), less that share of the FFN
/// rows.
pub fn budget_for(path: &Path, o: &EngineOptions, share: f64) -> Result<u64, String> {
    let mut o = o.clone();
    o.device.vram_budget = None;
    let e = Engine::load(path, o).map_err(|e| super::file_error(path, e))?;
    let r = e.device_report();
    if r.kind == "none" {
        return Err(format!(
            "a share of the FFN on the device needs a device (--gpu sim or a GPU){}",
            r.note.map_or_else(String::new, |n| format!(": {n}"))
        ));
    }
    let ffn = ffn_bytes(path)?;
    let base = r
        .peak_bytes
        .saturating_sub((ffn as f64 * r.resident_share()) as u64);
    Ok(base + (ffn as f64 * share.clamp(0.0, 1.0)) as u64)
}

/// The index of the greatest of `v` (the first of equals; 0 when empty): a greedy token.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_even_and_empty_inputs() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[0.5]), 0.5);
        assert!(median(&[]).is_nan());
    }
}
