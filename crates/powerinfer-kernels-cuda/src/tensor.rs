//! Device weight tensors, GPU slices of neuron rows, and the host-side checks and gathers behind
//! them (pure functions, tested without a GPU).

use powerinfer_gguf::GgmlType;

use crate::device::{check_len, DeviceBuffer, Gpu, Stream};
use crate::error::{CudaError, Result};

/// Weight types the matrix kernels read.
pub const SUPPORTED_TYPES: [GgmlType; 4] =
    [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0];

/// Bytes of one row of `cols` elements of type `ty`, if the kernels support `ty` and `cols` is a
/// whole number of blocks.
pub fn row_bytes(ty: GgmlType, cols: usize) -> Result<usize> {
    if !SUPPORTED_TYPES.contains(&ty) {
        return Err(CudaError::UnsupportedType(ty));
    }
    let bs = ty.block_size();
    if cols % bs != 0 {
        return Err(CudaError::Shape(format!(
            "row length {cols} is not a multiple of {bs} for {ty}"
        )));
    }
    Ok(cols / bs * ty.type_size())
}

/// Checks a bucket: every neuron id below `n_neurons` and none repeated (a repeat would make two
/// GPU rows write the same output).
pub fn validate_bucket(bucket: &[u32], n_neurons: usize) -> Result<()> {
    let mut seen = vec![false; n_neurons];
    for &b in bucket {
        let i = b as usize;
        if i >= n_neurons || seen[i] {
            return Err(CudaError::Index {
                what: "bucket",
                index: i,
                len: n_neurons,
            });
        }
        seen[i] = true;
    }
    Ok(())
}

/// Copies rows `rows` (each `row_len` bytes) of `src` into a new contiguous buffer, in order.
pub fn gather_rows(src: &[u8], row_len: usize, rows: &[u32]) -> Result<Vec<u8>> {
    let n_rows = src.len().checked_div(row_len).unwrap_or(0);
    let mut out = Vec::with_capacity(rows.len() * row_len);
    for &r in rows {
        let r = r as usize;
        if r >= n_rows {
            return Err(CudaError::Index {
                what: "row",
                index: r,
                len: n_rows,
            });
        }
        out.extend_from_slice(&src[r * row_len..(r + 1) * row_len]);
    }
    Ok(out)
}

/// A row-major weight matrix on the device: `rows` rows of `cols` elements of type `ty`.
#[derive(Debug)]
pub struct DeviceTensor {
    pub(crate) data: DeviceBuffer<u8>,
    ty: GgmlType,
    rows: usize,
    cols: usize,
}

impl DeviceTensor {
    /// Uploads a whole host matrix (`host.len()` must be rows × row bytes).
    pub fn upload(
        gpu: &Gpu,
        stream: &Stream,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        host: &[u8],
    ) -> Result<Self> {
        let rb = row_bytes(ty, cols)?;
        check_len("weight bytes", rows * rb, host.len())?;
        let data = gpu.upload(stream, host)?;
        Ok(DeviceTensor {
            data,
            ty,
            rows,
            cols,
        })
    }

    /// Uploads rows `rows` of a host matrix (`host` holds whole rows of `cols` elements), gathered
    /// through a pinned staging buffer.
    pub fn upload_rows(
        gpu: &Gpu,
        stream: &Stream,
        ty: GgmlType,
        cols: usize,
        host: &[u8],
        rows: &[u32],
    ) -> Result<Self> {
        let rb = row_bytes(ty, cols)?;
        if rb > 0 && host.len() % rb != 0 {
            return Err(CudaError::Shape(format!(
                "{} bytes is not a whole number of {rb}-byte rows",
                host.len()
            )));
        }
        let gathered = gather_rows(host, rb, rows)?;
        let mut data = gpu.alloc_zeros::<u8>(stream, gathered.len())?;
        if !gathered.is_empty() {
            let mut pinned = gpu.alloc_pinned::<u8>(gathered.len())?;
            pinned.as_mut_slice()?.copy_from_slice(&gathered);
            data.copy_from_pinned(stream, &pinned)?;
            // Dropping `pinned` waits for the copy that reads it.
        }
        Ok(DeviceTensor {
            data,
            ty,
            rows: rows.len(),
            cols,
        })
    }

    /// Element type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Elements per row.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.data.len().checked_div(self.rows).unwrap_or(0)
    }
}

/// The GPU part of a sparse FFN matrix: rows of some neurons, and the bucket that says which:
/// row j is neuron `bucket[j]` of `n_neurons`. Without a bucket ("full GPU"), row j is neuron j.
#[derive(Debug)]
pub struct GpuSlice {
    pub(crate) weight: DeviceTensor,
    pub(crate) bucket: Option<DeviceBuffer<u32>>,
    n_neurons: usize,
}

impl GpuSlice {
    /// Uploads the rows `bucket` of a host matrix of `n_neurons` rows (`host`: whole rows of
    /// `cols` elements of type `ty`). The bucket must be unique and in range.
    pub fn upload(
        gpu: &Gpu,
        stream: &Stream,
        ty: GgmlType,
        cols: usize,
        host: &[u8],
        n_neurons: usize,
        bucket: &[u32],
    ) -> Result<Self> {
        validate_bucket(bucket, n_neurons)?;
        let rb = row_bytes(ty, cols)?;
        check_len("weight bytes", n_neurons * rb, host.len())?;
        let weight = DeviceTensor::upload_rows(gpu, stream, ty, cols, host, bucket)?;
        let bucket = if bucket.is_empty() {
            None
        } else {
            Some(gpu.upload(stream, bucket)?)
        };
        Ok(GpuSlice {
            weight,
            bucket,
            n_neurons,
        })
    }

    /// A slice holding every neuron of `weight` in order (full-GPU layer).
    pub fn full(weight: DeviceTensor) -> Self {
        let n_neurons = weight.rows();
        GpuSlice {
            weight,
            bucket: None,
            n_neurons,
        }
    }

    /// The rows on the device.
    pub fn weight(&self) -> &DeviceTensor {
        &self.weight
    }

    /// Neurons in the whole matrix.
    pub fn n_neurons(&self) -> usize {
        self.n_neurons
    }

    /// Rows on the device.
    pub fn len(&self) -> usize {
        self.weight.rows()
    }

    /// Whether the slice has no row.
    pub fn is_empty(&self) -> bool {
        self.weight.rows() == 0
    }

    /// Overwrites device rows `slots` with the host matrix's rows of their neurons in
    /// `bucket` (the slice's whole new bucket, same length, unique and in range): a dynamic
    /// neuron cache moving neurons in and out without reallocating. Copies one row per slot
    /// and the new bucket; refused for a full slice (it has no bucket).
    pub fn replace_rows(
        &mut self,
        stream: &Stream,
        host: &[u8],
        slots: &[u32],
        bucket: &[u32],
    ) -> Result<()> {
        let Some(dev_bucket) = self.bucket.as_mut() else {
            return Err(CudaError::Shape(
                "a full-GPU slice has no bucket to replace rows of".into(),
            ));
        };
        check_len("bucket", self.weight.rows(), bucket.len())?;
        validate_bucket(bucket, self.n_neurons)?;
        let rb = self.weight.row_bytes();
        check_len("weight bytes", self.n_neurons * rb, host.len())?;
        for &s in slots {
            let s = s as usize;
            if s >= bucket.len() {
                return Err(CudaError::Index {
                    what: "slot",
                    index: s,
                    len: bucket.len(),
                });
            }
            let n = bucket[s] as usize;
            let mut dst = self.weight.data.slice.slice_mut(s * rb..(s + 1) * rb);
            stream
                .inner
                .memcpy_htod(&host[n * rb..(n + 1) * rb], &mut dst)?;
        }
        dev_bucket.copy_from(stream, bucket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_bytes_of_supported_types() {
        assert_eq!(row_bytes(GgmlType::F32, 7).unwrap(), 28);
        assert_eq!(row_bytes(GgmlType::F16, 7).unwrap(), 14);
        assert_eq!(row_bytes(GgmlType::Q8_0, 64).unwrap(), 68);
        assert_eq!(row_bytes(GgmlType::Q4_0, 96).unwrap(), 54);
        assert!(matches!(
            row_bytes(GgmlType::Q4_0, 48),
            Err(CudaError::Shape(_))
        ));
        assert!(matches!(
            row_bytes(GgmlType::Q6_K, 256),
            Err(CudaError::UnsupportedType(GgmlType::Q6_K))
        ));
    }

    #[test]
    fn buckets_must_be_unique_and_in_range() {
        assert!(validate_bucket(&[], 0).is_ok());
        assert!(validate_bucket(&[3, 0, 2], 4).is_ok());
        assert!(matches!(
            validate_bucket(&[1, 4], 4),
            Err(CudaError::Index { index: 4, .. })
        ));
        assert!(matches!(
            validate_bucket(&[1, 2, 1], 4),
            Err(CudaError::Index { index: 1, .. })
        ));
    }

    #[test]
    fn gathers_rows_in_bucket_order() {
        let src: Vec<u8> = (0..12).collect();
        assert_eq!(
            gather_rows(&src, 3, &[2, 0]).unwrap(),
            vec![6, 7, 8, 0, 1, 2]
        );
        assert_eq!(gather_rows(&src, 3, &[]).unwrap(), Vec::<u8>::new());
        assert!(gather_rows(&src, 3, &[4]).is_err());
    }
}
