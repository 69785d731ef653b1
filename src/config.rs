//! Validated configuration of the bus.
//!
//! Every setting has a documented default and is checked once, in [`BusBuilder::build`], so a
//! running bus never meets an impossible value. (The WAL's configuration lives beside the WAL.)

use std::time::Duration;

use crate::error::ConfigError;

/// Where endpoint threads run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Pinning {
    /// Threads float; the OS schedules them (the default, and the right choice when there are
    /// more busy threads than cores).
    #[default]
    Off,
    /// Each new endpoint thread is pinned to the next core, cycling over all cores.
    RoundRobin,
    /// Each new endpoint thread is pinned to the next core of this list, cycling.
    Cores(Vec<usize>),
}

/// What an endpoint thread does when its inbox is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Idle {
    /// Spin for `spin`, then yield a few times, then park until a producer rings. Lowest
    /// latency for `spin` after the last message; costs nothing while idle for long. The
    /// spinning is paid whatever the traffic: pick this to busy-poll on purpose.
    SpinThenPark {
        /// How long to spin after the last message before yielding and parking.
        spin: Duration,
    },
    /// Like `SpinThenPark`, but spin the full `max_spin` only while spinning pays off: while
    /// most of the endpoint's recent idle gaps (from the inbox running empty to the next
    /// message) were short, at most [`Idle::SHORT_GAP`]. Otherwise spin just `SHORT_GAP`
    /// before yielding and parking. A spinning thread takes the core from the threads that
    /// would produce its messages when there are more busy threads than cores, and a gap
    /// longer than a wake-up costs less CPU parked than spun (the default). The trade: a
    /// message after a gap between `SHORT_GAP` and `max_spin` finds the thread parked and
    /// waits for its wake-up (microseconds); pick `SpinThenPark` to avoid that.
    Adaptive {
        /// The longest spin, used while recent gaps were short.
        max_spin: Duration,
    },
    /// Park once the inbox stays empty for a few yields of the core (no spinning; each
    /// wake-up costs a few microseconds).
    Park,
}

impl Idle {
    /// An idle gap at most this long counts as short for [`Idle::Adaptive`]: about what a
    /// park and a wake-up cost, so spinning through a gap this short is cheaper than parking.
    pub const SHORT_GAP: Duration = Duration::from_micros(5);

    /// The longest spin a configuration may ask for (`spin`, `max_spin`): an idle thread must
    /// get to parking, and spinning longer than this saves no wake-up worth a core's time.
    pub const MAX_SPIN: Duration = Duration::from_millis(10);

    fn spin(self) -> Duration {
        match self {
            Self::SpinThenPark { spin } => spin,
            Self::Adaptive { max_spin } => max_spin,
            Self::Park => Duration::ZERO,
        }
    }
}

impl Default for Idle {
    fn default() -> Self {
        Self::Adaptive { max_spin: Duration::from_micros(50) }
    }
}

/// Settings of a [`Bus`](crate::Bus); built by [`BusBuilder`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BusConfig {
    /// Single-producer lanes per endpoint inbox (default 16; 0 ..= 1024): each of the first
    /// producer threads of the process (by a per-thread index, recycled when a thread ends)
    /// gets a lane of its own in each inbox it sends to, allocated on its first send; other
    /// threads share the inbox's rings. 0: every producer uses the rings.
    pub inbox_lanes: usize,
    /// Shared multi-producer rings per endpoint inbox, rounded up to a power of two (default 4;
    /// `1 ..= 1024`).
    pub inbox_shards: usize,
    /// Messages per lane and per ring, rounded up to a power of two (default 16384;
    /// 2 ..= 2^24). A full lane or ring makes `send` wait: with the lane and ring counts this
    /// bounds memory per endpoint, to at most 2^27 slots in all (rings plus lanes).
    pub inbox_capacity: usize,
    /// Thread placement (default [`Pinning::Off`]).
    pub pinning: Pinning,
    /// Idle strategy (default [`Idle::Adaptive`]: spin up to 50 us while idle gaps are short, then
    /// park).
    pub idle: Idle,
    /// Messages taken from one shard before moving to the next (default 256; at least 1).
    pub drain_batch: usize,
    /// Default timeout of [`Reply::wait`](crate::Reply::wait) (default 120 s, Spark's
    /// `spark.rpc.askTimeout` default), the longest an `ask` waits for room in a full
    /// inbox ([`AskError::Full`](crate::AskError::Full) after it; an ask queued after such a
    /// wait has only the rest of the timeout left for its reply), and the longest a `send` or
    /// `send_batch` from an endpoint's thread waits for room
    /// ([`SendError::Timeout`](crate::SendError::Timeout) after it).
    pub ask_timeout: Duration,
    /// How long [`Bus::shutdown`](crate::Bus::shutdown) waits for endpoint threads to finish
    /// (default 30 s; must be positive).
    pub shutdown_timeout: Duration,
}

impl Default for BusConfig {
    fn default() -> Self {
        Self {
            inbox_lanes: crate::queue::DEFAULT_LANES,
            inbox_shards: 4,
            inbox_capacity: 1 << 14,
            pinning: Pinning::Off,
            idle: Idle::default(),
            drain_batch: 256,
            ask_timeout: Duration::from_secs(120),
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

impl BusConfig {
    /// Checks every setting.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first setting out of range and its value.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(
            setting: &'static str,
            value: impl std::fmt::Debug,
            reason: &'static str,
        ) -> ConfigError {
            ConfigError::Invalid { setting, value: format!("{value:?}"), reason }
        }
        if self.inbox_lanes > crate::queue::MAX_LANES {
            return Err(invalid("inbox_lanes", self.inbox_lanes, "must be 0 ..= 1024"));
        }
        // The queue's own limits (`crate::queue::MAX_SHARDS`, `MAX_CAPACITY`).
        if !(1..=crate::queue::MAX_SHARDS).contains(&self.inbox_shards) {
            return Err(invalid("inbox_shards", self.inbox_shards, "must be 1 ..= 1024"));
        }
        if !(2..=crate::queue::MAX_CAPACITY).contains(&self.inbox_capacity) {
            return Err(invalid("inbox_capacity", self.inbox_capacity, "must be 2 ..= 2^24"));
        }
        let slots =
            crate::queue::total_slots(self.inbox_lanes, self.inbox_shards, self.inbox_capacity);
        if slots > crate::queue::MAX_TOTAL_SLOTS {
            return Err(ConfigError::Invalid {
                setting: "inbox_capacity",
                value: format!(
                    "{} x ({} shards + {} lanes) = {slots} slots",
                    self.inbox_capacity, self.inbox_shards, self.inbox_lanes
                ),
                reason: "an inbox holds at most 2^27 slots in all (its rings are allocated up \
                         front, its lanes on first use)",
            });
        }
        if self.drain_batch == 0 {
            return Err(invalid("drain_batch", self.drain_batch, "must be at least 1"));
        }
        if self.ask_timeout.is_zero() {
            return Err(invalid("ask_timeout", self.ask_timeout, "must be positive"));
        }
        if self.shutdown_timeout.is_zero() {
            // Every shutdown would detach every endpoint thread without waiting for it.
            return Err(invalid("shutdown_timeout", self.shutdown_timeout, "must be positive"));
        }
        if let Pinning::Cores(cores) = &self.pinning {
            if cores.is_empty() {
                return Err(invalid("pinning", cores, "Cores needs at least one core id"));
            }
        }
        if self.idle.spin() > Idle::MAX_SPIN {
            return Err(invalid(
                "idle",
                self.idle,
                "spins at most 10 ms (Idle::MAX_SPIN): an idle thread must get to parking",
            ));
        }
        Ok(())
    }
}

/// Builds a [`Bus`](crate::Bus); see [`BusConfig`] for each setting and its default.
#[derive(Debug, Clone, Default)]
pub struct BusBuilder {
    config: BusConfig,
}

impl BusBuilder {
    /// Single-producer lanes per endpoint inbox.
    pub fn inbox_lanes(mut self, lanes: usize) -> Self {
        self.config.inbox_lanes = lanes;
        self
    }

    /// Shared rings per endpoint inbox.
    pub fn inbox_shards(mut self, shards: usize) -> Self {
        self.config.inbox_shards = shards;
        self
    }

    /// Messages per lane and per ring ([`BusConfig::inbox_capacity`]).
    pub fn inbox_capacity(mut self, capacity: usize) -> Self {
        self.config.inbox_capacity = capacity;
        self
    }

    /// Thread placement.
    pub fn pinning(mut self, pinning: Pinning) -> Self {
        self.config.pinning = pinning;
        self
    }

    /// Idle strategy.
    pub fn idle(mut self, idle: Idle) -> Self {
        self.config.idle = idle;
        self
    }

    /// Messages taken from one shard before moving to the next.
    pub fn drain_batch(mut self, messages: usize) -> Self {
        self.config.drain_batch = messages;
        self
    }

    /// Default timeout of `Reply::wait`, and the longest an `ask`, or a send from an
    /// endpoint's thread, waits for room ([`BusConfig::ask_timeout`]).
    pub fn ask_timeout(mut self, timeout: Duration) -> Self {
        self.config.ask_timeout = timeout;
        self
    }

    /// How long shutdown waits for endpoint threads.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.config.shutdown_timeout = timeout;
        self
    }

    /// The configuration as built so far.
    pub fn config(&self) -> &BusConfig {
        &self.config
    }

    /// Validates the settings and starts an empty bus.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] for the first setting out of range.
    pub fn build(self) -> Result<crate::Bus, ConfigError> {
        self.config.validate()?;
        Ok(crate::Bus::with_config(self.config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_range_settings_are_named_with_their_value() {
        let error = BusBuilder::default().inbox_shards(0).build().unwrap_err();
        assert_eq!(error.to_string(), "inbox_shards = 0 is invalid: must be 1 ..= 1024");
        let error = BusBuilder::default().pinning(Pinning::Cores(vec![])).build().unwrap_err();
        assert!(error.to_string().starts_with("pinning = []"));
        assert!(BusBuilder::default().inbox_capacity(1).build().is_err());
        let error = BusBuilder::default().inbox_lanes(1025).build().unwrap_err();
        assert_eq!(error.to_string(), "inbox_lanes = 1025 is invalid: must be 0 ..= 1024");
        assert!(BusBuilder::default().drain_batch(0).build().is_err());
        assert!(BusBuilder::default().ask_timeout(Duration::ZERO).build().is_err());
        let error = BusBuilder::default().shutdown_timeout(Duration::ZERO).build().unwrap_err();
        assert_eq!(error.to_string(), "shutdown_timeout = 0ns is invalid: must be positive");
        // An idle thread must get to parking: spins beyond `Idle::MAX_SPIN` are refused.
        for idle in [
            Idle::SpinThenPark { spin: Duration::MAX },
            Idle::Adaptive { max_spin: Idle::MAX_SPIN + Duration::from_nanos(1) },
        ] {
            let error = BusBuilder::default().idle(idle).build().unwrap_err();
            assert!(
                error.to_string().starts_with(&format!("idle = {idle:?} is invalid")),
                "{error}"
            );
        }
        for idle in [Idle::SpinThenPark { spin: Idle::MAX_SPIN }, Idle::Park, Idle::default()] {
            assert!(BusBuilder::default().idle(idle).build().is_ok());
        }
    }

    #[test]
    fn settings_in_range_alone_whose_inbox_would_be_too_large_together_are_refused() {
        // Each in range; together 2^34 slots, which aborted the process at registration.
        let error =
            BusBuilder::default().inbox_shards(1024).inbox_capacity(1 << 24).build().unwrap_err();
        assert!(
            error.to_string().starts_with(
                "inbox_capacity = 16777216 x (1024 shards + 16 lanes) = 17448304640 slots is"
            ),
            "{error}"
        );
        // The largest inbox the load tool builds (1023 producers and the driver) still fits.
        assert!(BusBuilder::default().inbox_shards(1024).inbox_capacity(1 << 16).build().is_ok());
    }
}
