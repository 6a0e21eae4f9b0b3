//! Reused per-thread buffers for the temporaries of one product call (prepared activations,
//! the GEMM's paired and packed copies).
//!
//! A fresh allocation of a few MiB is memory the OS hands over page by page on first touch,
//! zeroed (with transparent huge pages, 2 MiB at a time), in every call. A [`ScratchVec`] comes
//! from its thread's pool and goes back there when dropped, so after the first call of a size
//! the memory is already mapped (measurements: `docs/tuning.md`).
//!
//! Each thread keeps at most [`KEPT`] buffers per element type, the largest it has returned,
//! none over [`MAX_KEPT_BYTES`]; they live as long as the thread (the caller's thread: products prepare their temporaries
//! before they hand work to the pool).

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};

/// Buffers kept per thread and element type.
const KEPT: usize = 8;

/// Larger buffers are freed when dropped, not kept (a long prompt's one-off copies of a 7B
/// model's 11008-wide activations would otherwise stay with the thread).
const MAX_KEPT_BYTES: usize = 64 << 20;

/// Element types with a per-thread pool of buffers.
pub(crate) trait Pooled: Copy + Default + 'static {
    /// Runs `f` on this thread's pool of free buffers of this type; `None` (and `f` not run)
    /// while the thread's pools are being destroyed.
    fn with_pool<R>(f: impl FnOnce(&mut Vec<Vec<Self>>) -> R) -> Option<R>;
}

macro_rules! pooled {
    ($($t:ty => $name:ident),* $(,)?) => {$(
        thread_local! {
            static $name: RefCell<Vec<Vec<$t>>> = const { RefCell::new(Vec::new()) };
        }
        impl Pooled for $t {
            fn with_pool<R>(f: impl FnOnce(&mut Vec<Vec<Self>>) -> R) -> Option<R> {
                $name.try_with(|p| f(&mut p.borrow_mut())).ok()
            }
        }
    )*};
}
pooled!(f32 => POOL_F32, u16 => POOL_U16, i8 => POOL_I8, u8 => POOL_U8, i16 => POOL_I16, i32 => POOL_I32);

/// A vector of `T` borrowed from this thread's pool; back to the pool on drop (whichever thread
/// drops it).
pub(crate) struct ScratchVec<T: Pooled>(Vec<T>);

impl<T: Pooled> ScratchVec<T> {
    /// An empty vector that holds no memory (not taken from the pool).
    pub(crate) fn empty() -> Self {
        ScratchVec(Vec::new())
    }

    /// `len` zeros (`T::default()`), in a pooled buffer where one is free: the smallest free
    /// one that is large enough, else the largest (which then grows).
    pub(crate) fn zeroed(len: usize) -> Self {
        let mut v = Self::take(len);
        v.clear();
        v.resize(len, T::default());
        ScratchVec(v)
    }

    /// `len` values for the caller to overwrite: a pooled buffer as [`zeroed`](Self::zeroed)
    /// picks it, keeping whatever values it held (zeros where it grows), so no time goes to
    /// clearing memory that is written next.
    pub(crate) fn overwritten(len: usize) -> Self {
        let mut v = Self::take(len);
        v.resize(len, T::default());
        ScratchVec(v)
    }

    /// A free pooled buffer for `len` values: the smallest one that is large enough, else the
    /// largest; a new one when the pool has none.
    fn take(len: usize) -> Vec<T> {
        T::with_pool(|pool| {
            let fits = (0..pool.len())
                .filter(|&i| pool[i].capacity() >= len)
                .min_by_key(|&i| pool[i].capacity());
            let pick = fits.or_else(|| (0..pool.len()).max_by_key(|&i| pool[i].capacity()));
            pick.map(|i| pool.swap_remove(i))
        })
        .flatten()
        .unwrap_or_default()
    }
}

impl<T: Pooled> Drop for ScratchVec<T> {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() == 0 || v.capacity() * std::mem::size_of::<T>() > MAX_KEPT_BYTES {
            return;
        }
        // A buffer dropped while its thread's pools are being destroyed is freed.
        T::with_pool(|pool| {
            pool.push(v);
            if pool.len() > KEPT {
                // Drop the smallest.
                let i = (0..pool.len())
                    .min_by_key(|&i| pool[i].capacity())
                    .unwrap_or(0);
                pool.swap_remove(i);
            }
        });
    }
}

impl<T: Pooled> Deref for ScratchVec<T> {
    type Target = Vec<T>;
    fn deref(&self) -> &Vec<T> {
        &self.0
    }
}

impl<T: Pooled> DerefMut for ScratchVec<T> {
    fn deref_mut(&mut self) -> &mut Vec<T> {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_and_reused() {
        let mut a = ScratchVec::<f32>::zeroed(1000);
        a.iter_mut().for_each(|v| *v = 7.0);
        let p = a.as_ptr();
        drop(a);
        // Same thread, smaller request: the same memory, zeroed again.
        let b = ScratchVec::<f32>::zeroed(500);
        assert_eq!(b.as_ptr(), p);
        assert_eq!(b.len(), 500);
        assert!(b.iter().all(|&v| v == 0.0));
        // A second buffer while the first is out: another one.
        let c = ScratchVec::<f32>::zeroed(10);
        assert_ne!(c.as_ptr(), p);
        drop((b, c));
        // At most KEPT buffers stay pooled.
        let many: Vec<_> = (0..KEPT + 4)
            .map(|i| ScratchVec::<u8>::zeroed(64 + i))
            .collect();
        drop(many);
        assert_eq!(u8::with_pool(|p| p.len()), Some(KEPT));
        assert!(ScratchVec::<i8>::empty().is_empty());
        // Too large to keep.
        drop(ScratchVec::<i16>::zeroed(MAX_KEPT_BYTES / 2 + 1));
        assert_eq!(i16::with_pool(|p| p.len()), Some(0));
    }
}
