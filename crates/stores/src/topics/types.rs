//! What a topic is: its settings' ranges and checks, and the topic as stored. The
//! store and the topic record (`record`) both use them, so they live here, below both.

/// The documented partition counts (HTTP API "Conventions").
pub const PARTITIONS_RANGE: std::ops::RangeInclusive<u32> = 1..=1024;

/// `dedup_window_ms` when a topic does not say (HTTP API, Additions: on by default,
/// 2 minutes, as JetStream's duplicate window).
pub const DEFAULT_DEDUP_WINDOW_MS: u64 = 120_000;
/// The longest dedup window (a day).
pub const MAX_DEDUP_WINDOW_MS: u64 = 86_400_000;

/// Checks a dedup window against 0 (off)–86400000 ms.
pub fn validate_dedup_window(ms: u64) -> Result<(), String> {
    if ms <= MAX_DEDUP_WINDOW_MS {
        Ok(())
    } else {
        Err(format!("{ms} is above {MAX_DEDUP_WINDOW_MS} (a day)"))
    }
}

/// Checks a partition count against 1–1024; the error says what is wrong.
pub fn validate_partitions(partitions: u32) -> Result<(), String> {
    if PARTITIONS_RANGE.contains(&partitions) {
        Ok(())
    } else {
        Err(format!("{partitions} is outside 1–1024"))
    }
}

/// A stored topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topic {
    pub name: String,
    pub partitions: u32,
    /// The key's `mod_revision`. For the answer of [`TopicStore::delete`](super::TopicStore::delete): the
    /// revision of the delete.
    pub revision: i64,
    /// The key's `create_revision`: a re-created topic is a new incarnation.
    pub incarnation: i64,
    /// Publishes of an event whose (`source`, `id`) a partition stored within this
    /// many milliseconds are answered with the original (0: no dedup).
    pub dedup_window_ms: u64,
}

/// A topic as the cache holds it: with its `deleting` mark.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StoredTopic {
    pub(crate) topic: Topic,
    pub(crate) deleting: bool,
}
