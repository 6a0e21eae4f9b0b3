//! Byte accounting for device memory, separate from the driver so it is testable without a GPU.
//!
//! A [`MemoryBudget`] holds a limit; [`MemoryBudget::try_reserve`] either grants a
//! [`Reservation`] (released when dropped) or refuses with [`BudgetError`] and changes nothing.
//! Device buffers hold their reservation, so a failed driver allocation or a dropped buffer
//! returns its bytes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::BudgetError;

#[derive(Debug)]
struct Inner {
    limit: u64,
    used: AtomicU64,
    peak: AtomicU64,
}

/// A shared byte budget. Cloning gives another handle to the same budget.
#[derive(Clone, Debug)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        MemoryBudget {
            inner: Arc::new(Inner {
                limit,
                used: AtomicU64::new(0),
                peak: AtomicU64::new(0),
            }),
        }
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Bytes currently reserved.
    pub fn used(&self) -> u64 {
        self.inner.used.load(Ordering::Acquire)
    }

    /// Bytes still available.
    pub fn available(&self) -> u64 {
        self.limit().saturating_sub(self.used())
    }

    /// The most bytes ever reserved at once.
    pub fn peak(&self) -> u64 {
        self.inner.peak.load(Ordering::Acquire)
    }

    /// Reserves `bytes`, or refuses if that would exceed the limit (then nothing changes).
    pub fn try_reserve(&self, bytes: u64) -> Result<Reservation, BudgetError> {
        let mut used = self.inner.used.load(Ordering::Acquire);
        loop {
            let new = match used.checked_add(bytes) {
                Some(n) if n <= self.inner.limit => n,
                _ => {
                    return Err(BudgetError {
                        requested: bytes,
                        used,
                        limit: self.inner.limit,
                    })
                }
            };
            match self.inner.used.compare_exchange_weak(
                used,
                new,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.inner.peak.fetch_max(new, Ordering::AcqRel);
                    return Ok(Reservation {
                        budget: self.clone(),
                        bytes,
                    });
                }
                Err(now) => used = now,
            }
        }
    }
}

/// Bytes held against a [`MemoryBudget`]; returned when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: MemoryBudget,
    bytes: u64,
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget
            .inner
            .used
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn refuses_past_the_limit_and_changes_nothing() {
        let b = MemoryBudget::new(1000);
        let r1 = b.try_reserve(600).unwrap();
        let err = b.try_reserve(401).unwrap_err();
        assert_eq!(
            err,
            BudgetError {
                requested: 401,
                used: 600,
                limit: 1000
            }
        );
        assert_eq!(b.used(), 600);
        let r2 = b.try_reserve(400).unwrap();
        assert_eq!(b.available(), 0);
        assert!(b.try_reserve(1).is_err());
        assert!(b.try_reserve(0).is_ok());
        drop(r1);
        assert_eq!(b.used(), 400);
        drop(r2);
        assert_eq!(b.used(), 0);
        assert_eq!(b.peak(), 1000);
    }

    #[test]
    fn overflowing_requests_are_refused() {
        let b = MemoryBudget::new(u64::MAX);
        let _r = b.try_reserve(u64::MAX - 1).unwrap();
        assert!(b.try_reserve(u64::MAX).is_err());
        assert_eq!(b.used(), u64::MAX - 1);
    }

    #[test]
    fn concurrent_reservations_never_exceed_the_limit() {
        let b = MemoryBudget::new(10_000);
        std::thread::scope(|s| {
            for _ in 0..4 {
                let b = b.clone();
                s.spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..2000u64 {
                        if let Ok(r) = b.try_reserve(1 + i % 97) {
                            held.push(r);
                        }
                        assert!(b.used() <= b.limit());
                        if i % 3 == 0 {
                            held.pop();
                        }
                    }
                });
            }
        });
        assert_eq!(b.used(), 0);
        assert!(b.peak() <= 10_000);
    }

    proptest! {
        #[test]
        fn accounting_matches_a_model(ops in proptest::collection::vec((0u64..300, any::<bool>()), 0..64)) {
            let b = MemoryBudget::new(1000);
            let mut held: Vec<Reservation> = Vec::new();
            let mut model = 0u64;
            for (bytes, release) in ops {
                if release && !held.is_empty() {
                    let r = held.remove(0);
                    model -= r.bytes();
                } else {
                    match b.try_reserve(bytes) {
                        Ok(r) => { model += bytes; held.push(r); }
                        Err(e) => { prop_assert!(model + bytes > 1000); prop_assert_eq!(e.used, model); }
                    }
                }
                prop_assert_eq!(b.used(), model);
            }
            drop(held);
            prop_assert_eq!(b.used(), 0);
        }
    }
}
