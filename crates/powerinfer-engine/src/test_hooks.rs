//! Hooks for the engine's tests in other packages (`examples/tests/engine_schedule.rs`): not
//! part of the API, compiled only with the `test-hooks` feature, which the command's package
//! turns on for its tests alone.

use crate::error::Result;
use crate::schedule::hybrid::layer_spec;
use crate::Engine;

/// A tiny xorshift for the schedule's choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Moves the run-time schedule at random, from the seed `state` (advanced): each layer the
/// device holds gets a random enabled set and, sometimes (always with `migrate`), a random
/// migration (random held neurons swapped for random outside ones, rows copied to the
/// device). An engine without a device is left as it is.
pub fn shuffle_schedule(engine: &Engine, state: &mut u64, migrate: bool) -> Result<()> {
    let Some(h) = engine.executor().hybrid() else {
        return Ok(());
    };
    let mut rng = Rng(*state | 1);
    let mut b = h.balance.lock().unwrap_or_else(|e| e.into_inner());
    let keep = rng.below(101);
    for (l, state) in b.layers.iter_mut().enumerate() {
        let Some(state) = state else { continue };
        let n_ff = state.on_device.len();
        if migrate || rng.below(3) == 0 {
            let held: Vec<u32> = state.slots().to_vec();
            let mut outside: Vec<u32> = (0..n_ff as u32).filter(|j| !held.contains(j)).collect();
            let k = 1 + rng.below(held.len().min(outside.len()).min(64));
            let mut outs = Vec::new();
            let mut ins = Vec::new();
            let mut pool = held.clone();
            for _ in 0..k {
                outs.push(pool.swap_remove(rng.below(pool.len())));
                ins.push(outside.swap_remove(rng.below(outside.len())));
            }
            if let Some(spec) = layer_spec(engine.model(), l)? {
                state.replace(h.device.as_ref(), &spec, &outs, &ins)?;
            }
        }
        let mut r = Rng(rng.next() | 1);
        state.set_enabled(|_| r.below(100) < keep);
        // The device computes what the split says from its next program on.
        h.device
            .set_enabled(state.hot, state.enabled_slots().as_deref())?;
    }
    *state = rng.0;
    Ok(())
}
