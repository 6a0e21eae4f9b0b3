//! Source tensors of a tiny Hugging Face checkpoint and the file checks of the conversion tests,
//! shared by `tests/convert.rs` and `tests/convert_falcon_opt.rs` (each includes this file with
//! `#[path]`).

use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// A source tensor: name, torch shape, dtype, the exact f32 values it holds.
#[derive(Clone)]
pub struct SrcTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    pub values: Vec<f32>,
}

/// `v` as little-endian `dtype` elements.
pub fn encode(dtype: Dtype, v: &[f32]) -> Vec<u8> {
    match dtype {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::F16 => v
            .iter()
            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
            .collect(),
        Dtype::BF16 => v
            .iter()
            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
            .collect(),
        Dtype::I32 => v.iter().flat_map(|&x| (x as i32).to_le_bytes()).collect(),
        _ => unreachable!(),
    }
}

/// The values `v` hold once stored as `dtype`.
pub fn exact(dtype: Dtype, v: Vec<f32>) -> Vec<f32> {
    match dtype {
        Dtype::F16 => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        Dtype::BF16 => v
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        _ => v,
    }
}

/// Writes `tensors` to a safetensors file with the reference writer.
pub fn write_safetensors(path: &Path, tensors: &[&SrcTensor]) {
    let data: Vec<Vec<u8>> = tensors.iter().map(|t| encode(t.dtype, &t.values)).collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&data)
        .map(|(t, b)| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Asserts that `dir` is empty (a failed conversion leaves nothing behind).
pub fn no_output_left(dir: &Path) {
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// numpy's `.T` of a row-major `rows × cols` matrix.
pub fn np_transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(w.len());
    for c in 0..cols {
        for r in 0..rows {
            out.push(w[r * cols + c]);
        }
    }
    out
}
