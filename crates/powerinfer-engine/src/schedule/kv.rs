//! Sequences' KV rows in the device's memory: a fixed number of stores reserved at load, each
//! holding one sequence's rows of the layers the device runs.
//!
//! A sequence takes a free store at its first evaluation on the device (its host rows are
//! copied in once) and keeps it until the sequence is removed or its cache dropped (a lease the
//! cache's slot holds; the stores see it dropped). From then on only the device appends those
//! layers' rows: they never cross the link per token. When the host needs them (an evaluation
//! on the CPU, a context shift, a fork), [`KvStores::unbind`] reads them back and frees the
//! store. When every store is taken, the evaluation runs on the CPU.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use crate::device::{Device, KvId, KvShape};
use crate::error::{EngineError, Result};
use crate::kv_cache::KvType;
use crate::kv_cache::{KvCache, OnDevice, SeqId};

/// Source of [`KvStores`] identities.
static STORES: AtomicU64 = AtomicU64::new(1);

/// The device's KV stores (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct KvStores {
    uid: u64,
    /// Per model layer, whether the device holds its rows.
    layers: Arc<[bool]>,
    /// Per model layer, its index in a store.
    layer_of: Vec<Option<usize>>,
    stores: Vec<KvId>,
    leases: Mutex<Vec<Weak<()>>>,
    positions: usize,
}

impl KvStores {
    /// No stores: every sequence stays on the host.
    pub(crate) fn none(n_layer: usize) -> KvStores {
        KvStores {
            uid: STORES.fetch_add(1, Ordering::Relaxed),
            layers: vec![false; n_layer].into(),
            layer_of: vec![None; n_layer],
            stores: Vec::new(),
            leases: Mutex::new(Vec::new()),
            positions: 0,
        }
    }

    /// Bytes of `n` stores of `layers` layers of `positions` rows of `row` values, K and V of
    /// `types`.
    pub(crate) fn bytes(
        n: usize,
        layers: usize,
        positions: usize,
        row: usize,
        types: (KvType, KvType),
    ) -> u64 {
        (n * layers * positions * (types.0.bytes_of(row) + types.1.bytes_of(row))) as u64
    }

    /// `n` stores for the layers `held` says, of `positions` rows of `n_kv_head` heads of
    /// `head_dim` values, K and V of `types`.
    pub(crate) fn new(
        device: &dyn Device,
        held: Vec<bool>,
        n: usize,
        positions: usize,
        (n_kv_head, head_dim): (usize, usize),
        types: (KvType, KvType),
    ) -> Result<KvStores> {
        let mut layer_of = Vec::with_capacity(held.len());
        let mut k = 0;
        for &h in &held {
            layer_of.push(h.then(|| {
                k += 1;
                k - 1
            }));
        }
        let stores = if k == 0 {
            Vec::new()
        } else {
            (0..n)
                .map(|_| {
                    device.alloc_kv(KvShape {
                        layers: k,
                        positions,
                        n_kv_head,
                        head_dim,
                        types,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        Ok(KvStores {
            uid: STORES.fetch_add(1, Ordering::Relaxed),
            layers: held.into(),
            layer_of,
            leases: Mutex::new((0..stores.len()).map(|_| Weak::new()).collect()),
            stores,
            positions,
        })
    }

    /// Layer `l`'s index in a store.
    pub(crate) fn layer_in_store(&self, l: usize) -> Option<usize> {
        self.layer_of.get(l).copied().flatten()
    }

    /// Whether every one of `seqs` has a store here or can take a free one, so that binding
    /// them all never copies a sequence's rows in only to read them back.
    pub(crate) fn fit(&self, cache: &KvCache, seqs: impl Iterator<Item = SeqId>) -> Result<bool> {
        let mut need = 0;
        for seq in seqs {
            if cache.lost(seq)? {
                // `bind` refuses it with the reason.
                return Ok(true);
            }
            match cache.device(seq)? {
                // Another engine's rows: `bind` says so.
                Some(_) => {}
                None if cache.pos(seq)? > self.positions => return Ok(false),
                None => need += 1,
            }
        }
        let leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        Ok(need <= leases.iter().filter(|w| w.upgrade().is_none()).count())
    }

    /// The store of `seq`, taking a free one (and copying the host's rows in) when it has
    /// none; `None` when every store is taken (or there are none).
    pub(crate) fn bind(
        &self,
        device: &dyn Device,
        cache: &mut KvCache,
        seq: SeqId,
    ) -> Result<Option<KvId>> {
        if cache.lost(seq)? {
            return Err(EngineError::Invalid(format!(
                "sequence {seq} is a copy of a sequence whose KV rows are in a device's memory: \
                 they cannot be read from here"
            )));
        }
        if let Some(d) = cache.device(seq)? {
            if d.stores != self.uid {
                return Err(EngineError::Invalid(format!(
                    "sequence {seq}'s KV rows are in the memory of another engine's device"
                )));
            }
            return Ok(self.stores.get(d.store).copied());
        }
        if self.stores.is_empty() {
            return Ok(None);
        }
        let pos = cache.pos(seq)?;
        if pos > self.positions {
            return Ok(None);
        }
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        let Some(i) = leases.iter().position(|w| w.upgrade().is_none()) else {
            return Ok(None);
        };
        for (l, s) in self.layer_of.iter().enumerate() {
            if let (Some(s), true) = (s, pos > 0) {
                let (k, v) = cache.rows(seq, l, 0, pos)?;
                device.write_kv(self.stores[i], *s, 0, &k, &v)?;
            }
        }
        self.lend(&mut leases[i], i, cache, seq, pos)?;
        Ok(Some(self.stores[i]))
    }

    /// Gives store `i` (its lease slot `slot`) to `seq`, whose first `host_rows` rows the host
    /// holds too.
    fn lend(
        &self,
        slot: &mut Weak<()>,
        i: usize,
        cache: &mut KvCache,
        seq: SeqId,
        host_rows: usize,
    ) -> Result<()> {
        let lease = Arc::new(());
        *slot = Arc::downgrade(&lease);
        cache.set_device(
            seq,
            Some(OnDevice {
                stores: self.uid,
                store: i,
                layers: self.layers.clone(),
                host_rows,
                _lease: lease,
            }),
        )
    }

    /// A new sequence holding a copy of `src`'s tokens: its rows on the device copied there into
    /// a free store when there is one, else every row read back and the copy made on the host.
    pub(crate) fn fork(
        &self,
        device: &dyn Device,
        cache: &mut KvCache,
        src: SeqId,
    ) -> Result<SeqId> {
        let from = match cache.device(src)? {
            Some(d) if d.stores == self.uid => (d.store, d.host_rows),
            _ => return cache.fork(src),
        };
        let pos = cache.pos(src)?;
        let mut leases = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        let Some(i) = leases.iter().position(|w| w.upgrade().is_none()) else {
            drop(leases);
            self.unbind(device, cache, src)?;
            return cache.fork(src);
        };
        device.copy_kv(self.stores[from.0], self.stores[i], pos)?;
        let seq = cache.fork_host(src)?;
        self.lend(&mut leases[i], i, cache, seq, from.1)?;
        Ok(seq)
    }

    /// Makes the host hold every row of `seq` again: reads the rows only the device holds and
    /// frees its store.
    pub(crate) fn unbind(
        &self,
        device: &dyn Device,
        cache: &mut KvCache,
        seq: SeqId,
    ) -> Result<()> {
        let Some(d) = cache.device(seq)? else {
            return Ok(());
        };
        if d.stores != self.uid {
            return Err(EngineError::Invalid(format!(
                "sequence {seq}'s KV rows are in the memory of another engine's device"
            )));
        }
        let (store, from) = (self.stores[d.store], d.host_rows);
        let n = cache.pos(seq)? - from;
        if n > 0 {
            for (l, s) in self.layer_of.iter().enumerate() {
                if let Some(s) = s {
                    let (k, v) = device.read_kv(store, *s, from, n)?;
                    cache.append_rows(seq, l, &k, &v)?;
                }
            }
        }
        cache.set_device(seq, None)
    }
}
