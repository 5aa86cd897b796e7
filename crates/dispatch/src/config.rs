//! The settings one partition core runs with, and the retry backoff they imply.

use crate::io::EventMeta;
use meshd_stores::subscriptions::{
    Backoff, Ordering, Selector, SubscriptionSpec, ACK_TIMEOUT_MS_RANGE, BACKOFF_MAX_MS,
    MAX_ATTEMPTS_RANGE,
};

/// Deliveries in flight or waiting per partition when nothing else is said.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 1000;
/// Events held in memory per partition (from the committed offset on) by default.
pub const DEFAULT_MAX_WINDOW: usize = 10_000;
/// Events read ahead and waiting for their first hand-out, per partition, by
/// default: as many as the largest pull takes (`max_events` is at most 1000).
pub const DEFAULT_MAX_PENDING: usize = 1000;
/// What a pull assumes of an event whose stored size it does not know yet (a
/// redrive, or a recovered retry whose offset was not read again): the largest event
/// a publish accepts (1 MiB), so a byte budget is never passed by guessing low.
pub const DEFAULT_UNKNOWN_SIZE_BYTES: u64 = 1 << 20;
/// Events asked for by one `ReadLog` by default.
pub const DEFAULT_READ_BATCH: usize = 256;
/// How long after a failed read the core asks again, by default.
pub const DEFAULT_READ_RETRY_MS: u64 = 1_000;
/// Retries due a minute ahead or more are parked (see [`Config::park_retries_after_ms`]).
pub const DEFAULT_PARK_RETRIES_AFTER_MS: u64 = 60_000;

/// How one partition of one subscription is delivered. A plain struct with defaults
/// and [`Config::validate`] (house style 14); [`Config::from_spec`] takes the
/// subscription's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Deliveries before an event is dead-lettered (1–1000): with 3, the third failed
    /// delivery dead-letters it.
    pub max_attempts: u32,
    /// The lease of one hand-out (100–600000 ms).
    pub ack_timeout_ms: u64,
    /// Retry backoff: `initial_ms` doubled per failed attempt up to `max_ms`, with
    /// equal jitter (see [`backoff_delay`]).
    pub backoff: Backoff,
    /// At most this many deliveries are persisting, in flight, waiting for a retry or
    /// being dead-lettered (redrives included); beyond it nothing new is read or handed
    /// out. Due retries still go out: they are already counted.
    pub max_in_flight: usize,
    /// At most this many offsets from the committed offset on are read into memory
    /// (`next_to_read - committed <= max_window`), so a stuck lowest offset bounds
    /// memory instead of letting the window grow with the log.
    pub max_window: usize,
    /// No more is read while this many events wait for their first hand-out: memory
    /// follows what is in flight plus this read-ahead, not the backlog in the log
    /// (every idle subscription would otherwise hold `max_window` events).
    pub max_pending: usize,
    /// The most events one `ReadLog` asks for.
    pub read_batch: usize,
    /// After `ReadFailed`, the next `ReadLog` waits this long.
    pub read_retry_ms: u64,
    /// Events that do not match are resolved without delivery (no attempt): the
    /// subscription's `filter` and `filters`.
    pub selector: Selector,
    /// The size a pull's byte budget counts for an event whose stored size is not
    /// known (see [`DEFAULT_UNKNOWN_SIZE_BYTES`]).
    pub unknown_size_bytes: u64,
    /// A retry of the window due this far ahead or more (a nack's `delay_ms`, a long
    /// backoff) is parked instead of waiting (`Command::Park` with its attempts), so
    /// it does not hold the committed offset; `None`: retries always wait.
    pub park_retries_after_ms: Option<u64>,
    /// `"ordering": "key"`: among the events of one `partitionkey`, at most one is
    /// in flight, waiting, parked for its time or being dead-lettered; the others are
    /// parked behind it (held) and released in offset order.
    pub ordered: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self::from_spec(&SubscriptionSpec::new("default", "default"))
    }
}

/// A setting outside its range; names the field.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid dispatch config: {field}: {reason}")]
pub struct ConfigError {
    pub field: &'static str,
    pub reason: String,
}

impl Config {
    /// The subscription's settings with the default bounds.
    pub fn from_spec(spec: &SubscriptionSpec) -> Self {
        Self {
            max_attempts: spec.max_attempts,
            ack_timeout_ms: spec.ack_timeout_ms,
            backoff: spec.backoff,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_window: DEFAULT_MAX_WINDOW,
            max_pending: DEFAULT_MAX_PENDING,
            read_batch: DEFAULT_READ_BATCH,
            read_retry_ms: DEFAULT_READ_RETRY_MS,
            park_retries_after_ms: Some(DEFAULT_PARK_RETRIES_AFTER_MS),
            selector: Selector::of(spec),
            ordered: spec.ordering == Ordering::Key,
            unknown_size_bytes: DEFAULT_UNKNOWN_SIZE_BYTES,
        }
    }

    /// Checks every value against its documented range (HTTP API "Conventions").
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field: &'static str, reason: String| Err(ConfigError { field, reason });
        if !MAX_ATTEMPTS_RANGE.contains(&self.max_attempts) {
            return bad(
                "max_attempts",
                format!("{} is outside 1–1000", self.max_attempts),
            );
        }
        if !ACK_TIMEOUT_MS_RANGE.contains(&self.ack_timeout_ms) {
            return bad(
                "ack_timeout_ms",
                format!("{} is outside 100–600000", self.ack_timeout_ms),
            );
        }
        let b = self.backoff;
        if b.initial_ms < 1 || b.initial_ms > b.max_ms || b.max_ms > BACKOFF_MAX_MS {
            return bad(
                "backoff",
                format!(
                    "needs 1 ≤ initial_ms ≤ max_ms ≤ {BACKOFF_MAX_MS}, got {}..{}",
                    b.initial_ms, b.max_ms
                ),
            );
        }
        for (field, v) in [
            ("max_in_flight", self.max_in_flight),
            ("max_window", self.max_window),
            ("max_pending", self.max_pending),
            ("read_batch", self.read_batch),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        if self.park_retries_after_ms == Some(0) {
            return bad("park_retries_after_ms", "must be at least 1".into());
        }
        if self.read_retry_ms == 0 {
            return bad("read_retry_ms", "must be at least 1".into());
        }
        Ok(())
    }

    /// Whether an event with these attributes is delivered (see [`Selector`]).
    pub fn matches(&self, event: &EventMeta) -> bool {
        self.selector.matches_index(&event.attributes)
    }
}

/// The cap of the exponential backoff after `failures` failures (1 = the first):
/// `initial_ms * 2^(failures-1)`, at most `max_ms`; saturating, never overflowing.
pub fn backoff_cap(backoff: Backoff, failures: u32) -> u64 {
    let exp = failures.saturating_sub(1);
    let factor = if exp >= 63 { u64::MAX } else { 1u64 << exp };
    backoff
        .initial_ms
        .saturating_mul(factor)
        .min(backoff.max_ms)
        .max(1)
}

/// The delay before the next try after `failures` failures, with **equal jitter**:
/// `cap - cap/2 + j` where `j` is drawn from `0..=cap/2`. So the delay lies in
/// `[ceil(cap/2), cap]`: it keeps half of the exponential growth as a floor (a failing
/// consumer is not hammered, and doubling is visible) while the other half spreads
/// retries of many deliveries apart. A jitter source answering above `cap/2` is
/// clamped, so a wrong source cannot stretch a delay beyond `cap`.
pub fn backoff_delay(backoff: Backoff, failures: u32, jitter: &mut dyn crate::Jitter) -> u64 {
    let cap = backoff_cap(backoff, failures);
    let half = cap / 2;
    let j = jitter.sample(half).min(half);
    cap - half + j
}
