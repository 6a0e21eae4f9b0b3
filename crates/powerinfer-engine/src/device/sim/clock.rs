//! The simulated device's clocks: the modelled card's timeline when it plays a card
//! ([`SimSpeed`]), else this machine's wall clock.
//!
//! On the card's timeline the device's stream is a queue: a command the host issued at its
//! time `at` starts when both the stream is free and `at` has come, and takes what the card
//! charges for it (launches, bytes read, copies); its timing marks fall inside it. The host's
//! time advances by its real work between two device calls (what this machine took to emulate
//! the card inside a call is not the host's work) and, when it waits, to the end of what it
//! waits for plus the card's wake-up. So the balancer reads the card's time for the device's
//! share beside the real time of the CPU's, and an evaluation's time on this timeline is what
//! it would take on that card beside this machine's CPU.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::device::SimSpeed;

/// What a command cost in the card's terms.
#[derive(Default)]
pub(super) struct Cost {
    pub(super) launches: u64,
    pub(super) read: u64,
    /// Bytes over the link, and copies (each paying the link's latency).
    pub(super) copied: u64,
    pub(super) copies: u32,
}

impl Cost {
    /// What card `s` charges for it.
    pub(super) fn on(&self, s: &SimSpeed) -> Duration {
        s.time_of(self.launches, self.read, self.copies, self.copied)
    }

    /// One copy of `bytes` over the host link.
    pub(super) fn copy(bytes: u64) -> Cost {
        Cost {
            copied: bytes,
            copies: 1,
            ..Cost::default()
        }
    }
}

/// The host's side of the timeline.
#[derive(Debug)]
pub(super) struct HostClock {
    origin: Instant,
    card: Option<HostOnCard>,
}

/// The host's time on a card's timeline.
#[derive(Debug)]
struct HostOnCard {
    now: Duration,
    /// When the host last left a device call (wall clock).
    left: Instant,
    host_wait: Duration,
}

impl HostClock {
    /// The clock of a device started at `origin`, playing `speed` if any.
    pub(super) fn new(origin: Instant, speed: Option<SimSpeed>) -> HostClock {
        HostClock {
            origin,
            card: speed.map(|s| HostOnCard {
                now: Duration::ZERO,
                left: origin,
                host_wait: s.host_wait,
            }),
        }
    }

    /// The host enters a device call: its work since it left the last one is added to its
    /// time, which is returned (when the call's commands are issued).
    pub(super) fn enter(&mut self) -> Duration {
        match &mut self.card {
            Some(c) => {
                let now = Instant::now();
                c.now += now.saturating_duration_since(c.left);
                c.left = now;
                c.now
            }
            None => self.origin.elapsed(),
        }
    }

    /// The host leaves a device call: what the call took on this machine is not its work.
    pub(super) fn leave(&mut self) {
        if let Some(c) = &mut self.card {
            c.left = Instant::now();
        }
    }

    /// The host waited for work that ends at `done` on the timeline, and woke up.
    pub(super) fn waited(&mut self, done: Duration) {
        if let Some(c) = &mut self.card {
            c.now = c.now.max(done) + c.host_wait;
            c.left = Instant::now();
        }
    }
}

/// The device's side of the timeline (the worker's).
#[derive(Debug)]
pub(super) struct DeviceClock {
    origin: Instant,
    card: Option<(SimSpeed, Duration)>,
}

impl DeviceClock {
    /// The clock of a device started at `origin`, playing `speed` if any.
    pub(super) fn new(origin: Instant, speed: Option<SimSpeed>) -> DeviceClock {
        DeviceClock {
            origin,
            card: speed.map(|s| (s, Duration::ZERO)),
        }
    }

    /// When a command the host issued at `at` starts.
    pub(super) fn start(&self, at: Duration) -> Duration {
        match &self.card {
            Some((_, free)) => (*free).max(at),
            None => self.origin.elapsed(),
        }
    }

    /// The time `cost` after `start`: on the card, what it charges; on the wall clock, now.
    pub(super) fn after(&self, start: Duration, cost: &Cost) -> Duration {
        match &self.card {
            Some((s, _)) => start + cost.on(s),
            None => self.origin.elapsed(),
        }
    }

    /// A command that started at `start` and cost `cost` ends: the stream is free from the
    /// returned time on.
    pub(super) fn end(&mut self, start: Duration, cost: &Cost) -> Duration {
        let t = self.after(start, cost);
        if let Some((_, free)) = &mut self.card {
            *free = t;
        }
        t
    }
}

/// When the worker may run: on a card's clock it emulates the card only while the host waits
/// for it, so that the CPU's work, which the timeline takes at its real time, does not share
/// this machine's cores with the emulation (on a machine with a GPU it has them to itself).
/// On the wall clock (or paced) it runs whenever it has work, beside the host.
#[derive(Debug, Default)]
pub(super) struct Gate {
    /// `(hosts waiting, stopped)`.
    state: Mutex<(u32, bool)>,
    changed: Condvar,
}

impl Gate {
    fn state(&self) -> std::sync::MutexGuard<'_, (u32, bool)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A host waits for the device from now on.
    pub(super) fn open(&self) {
        self.state().0 += 1;
        self.changed.notify_all();
    }

    /// That host's wait is over.
    pub(super) fn close(&self) {
        let mut s = self.state();
        s.0 = s.0.saturating_sub(1);
    }

    /// The device is dropped: the worker runs out its queue.
    pub(super) fn stop(&self) {
        self.state().1 = true;
        self.changed.notify_all();
    }

    /// The worker waits here before each command until a host waits or the device stops.
    pub(super) fn pass(&self) {
        let mut s = self.state();
        while s.0 == 0 && !s.1 {
            s = self.changed.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }
}
