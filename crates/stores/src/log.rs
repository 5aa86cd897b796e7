//! The partition log: the events of every (topic, partition), and the dead-letter
//! stream that keeps the bodies of dead-lettered events.

use async_trait::async_trait;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard};
use tokio::sync::watch;

/// Where a dead-lettered event's body is kept: the dead-letter stream of one log.
/// `log_id` is the instance id for an embedded log, the stream name for a shared one,
/// so references from two instances with their own logs never collide.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct BodyRef {
    pub log_id: String,
    /// Position in that log's dead-letter stream.
    pub seq: u64,
}

impl fmt::Display for BodyRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.log_id, self.seq)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LogError {
    /// The requested offset is below the retained start of the partition: those
    /// events were removed by retention. Never silently skipped.
    #[error("offset {requested} of {topic}/{partition} is below the retained start {start}")]
    BelowRetention {
        topic: String,
        partition: u32,
        requested: u64,
        start: u64,
    },
    #[error("unknown partition {topic}/{partition}")]
    UnknownPartition { topic: String, partition: u32 },
    /// Refused: the log (or the engine it shares) fail-stopped after an earlier failed
    /// write or fsync. Nothing of this call was written; every later write is refused
    /// too, until a restart.
    #[error("log failed (fail-stopped): {0}")]
    Failed(String),
    /// This call's write reached the log but its fsync (or the write itself) failed:
    /// the events may or may not be there after a restart, and are never readable
    /// before one. The log fail-stopped.
    #[error("log write outcome unknown (the log fail-stopped): {0}")]
    Indeterminate(String),
    /// A stored record failed its checksum or version check.
    #[error("corrupt log record at {key}: {reason}")]
    Corrupt { key: String, reason: String },
    /// A request the log cannot take (too large, empty batch, ...).
    #[error("invalid log request: {0}")]
    Invalid(String),
    /// The log (a shared one) cannot be reached; not applied.
    #[error("log unavailable: {0}")]
    Unavailable(String),
    /// A deduplicated append that would take the publish dedup index past its cap
    /// (`--max-dedup-entries`): nothing of it was written, and no entry was dropped to
    /// make room. The oldest entry expires in `retry_after_ms`.
    #[error("the publish dedup index holds {entries} entries, its cap; the oldest expires in {retry_after_ms} ms")]
    DedupFull { entries: usize, retry_after_ms: u64 },
}

impl LogError {
    /// A short, stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            LogError::BelowRetention { .. } => "below_retention",
            LogError::UnknownPartition { .. } => "unknown_partition",
            LogError::Invalid(_) => "invalid",
            LogError::Unavailable(_) => "unavailable",
            LogError::DedupFull { .. } => "dedup_full",
            LogError::Indeterminate(_) => "indeterminate",
            LogError::Corrupt { .. } => "corrupt",
            // A fail-stop, labelled as every store's is.
            LogError::Failed(_) => "failed",
        }
    }

    /// The backend failure this is, in the classes every store shares
    /// ([`StoreFailure`]); `Err` gives back the log's own answers (below retention,
    /// unknown partition, an invalid request).
    pub fn into_failure(self) -> Result<crate::failure::StoreFailure, LogError> {
        use crate::failure::StoreFailure;
        match self {
            LogError::Unavailable(d) => Ok(StoreFailure::Unavailable(d)),
            LogError::Indeterminate(d) => Ok(StoreFailure::Indeterminate(d)),
            LogError::Corrupt { key, reason } => Ok(StoreFailure::Corrupt { key, reason }),
            LogError::Failed(d) => Ok(StoreFailure::FailStopped(d)),
            other => Err(other),
        }
    }
}

/// The dead-letter stream: event bodies referenced by dead-letter entries in Meta.
///
/// # Contract
///
/// * `append_body` returns only once the body is durable; the DeadLetterStore appends
///   the body *before* it creates the entry that references it, so a crash between the
///   two leaves at most an unreferenced body, never an entry without its event.
/// * Bodies are exempt from retention: they stay until `delete_body`.
/// * `list_bodies` lets boot collect orphans (bodies no entry references).
#[async_trait]
pub trait DeadLetterBodies: Send + Sync + 'static {
    /// The id of this log (instance id for an embedded log).
    fn log_id(&self) -> &str;
    async fn append_body(&self, body: &[u8]) -> Result<BodyRef, LogError>;
    /// `Ok(None)` when the body does not exist (deleted, or another log's reference).
    async fn read_body(&self, body: &BodyRef) -> Result<Option<Vec<u8>>, LogError>;
    /// Deleting an absent body is not an error.
    async fn delete_body(&self, body: &BodyRef) -> Result<(), LogError>;
    /// Every body of this log, in sequence order, from `after` (exclusive), at most `limit`.
    async fn list_bodies(&self, after: Option<u64>, limit: usize)
        -> Result<Vec<BodyRef>, LogError>;
}

/// Bounds of one partition: `start` is the first retained offset, `end` the next offset
/// to be written (so `end - start` events are readable).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PartitionBounds {
    pub start: u64,
    pub end: u64,
}

/// One stored event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEvent {
    pub offset: u64,
    /// When the log accepted it (unix milliseconds, wall clock; used by retention).
    pub appended_at_ms: u64,
    pub payload: Vec<u8>,
}

/// Retention limits per partition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Retention {
    /// Events older than this are removed (None: kept by age).
    pub max_age_ms: Option<u64>,
    /// The oldest events are removed while a partition holds more bytes than this.
    pub max_bytes: Option<u64>,
}

/// What one retention pass removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetentionReport {
    pub events_removed: u64,
    pub bytes_removed: u64,
}

/// The identity of an event for publish deduplication: a hash of its CloudEvents
/// `source` and `id` (HTTP API, Additions, "Idempotent publish"). 128 bits of SHA-256
/// over both, length-prefixed, so no two (source, id) pairs share an input and a
/// collision is as likely as a random 128-bit one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DedupKey(pub [u8; 16]);

impl DedupKey {
    pub fn of(source: &str, id: &str) -> Self {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update((source.len() as u64).to_be_bytes());
        h.update(source.as_bytes());
        h.update((id.len() as u64).to_be_bytes());
        h.update(id.as_bytes());
        let digest = h.finalize();
        let mut k = [0u8; 16];
        k.copy_from_slice(&digest[..16]);
        DedupKey(k)
    }

    /// The key as 32 hex digits (JetStream's `Nats-Msg-Id`, logs).
    pub fn hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// One event of [`PartitionLog::append_dedup`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DedupEvent {
    pub partition: u32,
    pub payload: Vec<u8>,
    pub key: DedupKey,
}

/// Where an event of [`PartitionLog::append_dedup`] is: stored now, or (`duplicate`)
/// the offset of the event with its key stored within the window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Appended {
    pub partition: u32,
    pub offset: u64,
    pub duplicate: bool,
}

/// The partition log.
///
/// # Contract
///
/// * `append` assigns contiguous offsets from 0 per (topic, partition), in call order,
///   and returns only once every event of the call is durable (fsynced; concurrent
///   appenders share fsyncs). The events of one call are written atomically: all or
///   none, even across partitions.
/// * Readers never see an event before it is durable: `read` and `bounds` stop at the
///   durable end, so an offset handed to a consumer can never be reassigned to another
///   event after a crash.
/// * `read` from an offset below the retained start is [`LogError::BelowRetention`],
///   never a silent skip; from the end or beyond it returns nothing.
/// * A write whose own write or fsync fails answers [`LogError::Indeterminate`] (its
///   events may or may not survive a restart); the log then fail-stops and refuses
///   every later write with [`LogError::Failed`] (nothing written).
/// * All methods may be called concurrently.
///
/// The trait leaves room for a shared log (JetStream) in cluster mode: offsets are
/// per (topic, partition), and `log_id` names the log for dead-letter references.
#[async_trait]
pub trait PartitionLog: Send + Sync + 'static {
    fn log_id(&self) -> &str;

    /// Appends `events` (partition, payload) of one topic; returns their offsets in the
    /// same order.
    async fn append(
        &self,
        topic: &str,
        events: Vec<(u32, Vec<u8>)>,
    ) -> Result<Vec<(u32, u64)>, LogError>;

    /// [`append`](Self::append) with publish deduplication, per partition: an event
    /// whose key the partition stored within the last `window_ms` (by the log's clock)
    /// is not stored again and is answered with the stored event's offset and
    /// `duplicate`; so is a repeat of a key earlier in the same call. The index is
    /// durable exactly as far as the events it points to (written with them, lost
    /// with them), survives restarts, and holds an entry for `window_ms` after its
    /// event was stored (the window in force when it was stored). Returns only once
    /// every event answered, duplicates' originals included, is durable.
    async fn append_dedup(
        &self,
        topic: &str,
        events: Vec<DedupEvent>,
        window_ms: u64,
    ) -> Result<Vec<Appended>, LogError>;
    /// Up to `max_events` events from `from` on (and at most `max_bytes` of payload,
    /// but always at least one event when one is available).
    async fn read(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> Result<Vec<LogEvent>, LogError>;

    /// Retained start and durable end of a partition ({0, 0} when never written).
    async fn bounds(&self, topic: &str, partition: u32) -> Result<PartitionBounds, LogError>;

    /// Removes every event of `topic`.
    async fn delete_topic(&self, topic: &str) -> Result<(), LogError>;

    /// Applies retention to every partition.
    async fn enforce_retention(
        &self,
        retention: Retention,
        now_ms: u64,
    ) -> Result<RetentionReport, LogError>;

    /// Notifications of durable appends to one partition, for the task that serves it:
    /// take the receiver, read [`bounds`](Self::bounds), then wait for `changed()` and
    /// read `bounds` again. Appends to other partitions (of this topic or another)
    /// never mark it, so a reader wakes for its own partition only.
    ///
    /// * **Durable only**: the receiver is marked changed after an append to
    ///   (`topic`, `partition`) only once its events are durable (after the group fsync;
    ///   for a shared log after the server's acknowledgement or its "stored" notice), so
    ///   a woken reader finds them with `bounds` and `read`.
    /// * **Never misses the last change, may coalesce**: every durable append that
    ///   completes after the receiver was taken marks it changed (`watch` semantics:
    ///   several appends may make one change, nothing after the last `changed()` is
    ///   lost). Appends made *before* it was taken are found by the `bounds` read that
    ///   follows taking it.
    /// * **Spurious changes are allowed**: a shared log marks every receiver changed
    ///   after a reconnect (notices may have been lost meanwhile).
    /// * **The value** is the highest durable end of the partition the log has learned
    ///   of since this notifier was created (never decreasing; at creation the durable
    ///   end if known cheaply, else 0). It is a hint: `bounds` is the truth (a
    ///   partition deleted and re-created elsewhere may be below it).
    /// * **Closed**: after `delete_topic(topic)` on this log, and when the log is
    ///   dropped, the topic's receivers see the sender closed (`changed()` is `Err`). A
    ///   caller that still serves the partition takes a new receiver after a short
    ///   pause (never in a tight loop) and reads `bounds` again.
    /// * **Memory**: one sender per (topic, partition) that has had a receiver, made on
    ///   the first call; dropped by `delete_topic`, and by the next append (or
    ///   reconnect) that finds it without receivers. See [`AppendNotifier`].
    fn appends(&self, topic: &str, partition: u32) -> watch::Receiver<u64>;
}

/// The per-partition senders behind [`PartitionLog::appends`], shared by the log
/// engines so they keep that contract the same way.
///
/// The engine calls [`notify`](Self::notify) only once an append is durable,
/// [`notify_all`](Self::notify_all) when it may have missed appends (a reconnect), and
/// [`forget_topic`](Self::forget_topic) when a topic is deleted.
#[derive(Default)]
pub struct AppendNotifier {
    /// topic → partition → sender. Nested so a lookup by `&str` allocates nothing and
    /// `forget_topic` drops a topic at once. Holds only partitions that have had a
    /// receiver; a sender without receivers is removed by the next `notify` of its
    /// partition or the next `notify_all`.
    senders: Mutex<Senders>,
}

type Senders = HashMap<String, HashMap<u32, watch::Sender<u64>>>;

impl AppendNotifier {
    fn senders(&self) -> MutexGuard<'_, Senders> {
        // Every change is one insert or remove: consistent after a panic elsewhere.
        self.senders.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A receiver for (`topic`, `partition`). When the partition has no sender yet one
    /// is made with the value `durable_end()`, called under this notifier's lock: an
    /// engine that reads its durable end there and calls `notify` only after updating
    /// it (never holding its own lock across `notify`) cannot lose an append that
    /// completes while the sender is being made.
    pub fn subscribe(
        &self,
        topic: &str,
        partition: u32,
        durable_end: impl FnOnce() -> u64,
    ) -> watch::Receiver<u64> {
        let mut senders = self.senders();
        if let Some(s) = senders.get(topic).and_then(|m| m.get(&partition)) {
            return s.subscribe();
        }
        let (tx, rx) = watch::channel(durable_end());
        senders
            .entry(topic.to_string())
            .or_default()
            .insert(partition, tx);
        rx
    }

    /// Marks the receivers of (`topic`, `partition`) changed, the value raised to `end`
    /// when that is higher (`None`: end unknown, wake only). Call only once the append
    /// is durable. A partition nobody listens to costs one lookup.
    pub fn notify(&self, topic: &str, partition: u32, end: Option<u64>) {
        let mut senders = self.senders();
        let Some(topic_senders) = senders.get_mut(topic) else {
            return;
        };
        let Some(s) = topic_senders.get(&partition) else {
            return;
        };
        if s.receiver_count() == 0 {
            topic_senders.remove(&partition);
            if topic_senders.is_empty() {
                senders.remove(topic);
            }
            return;
        }
        s.send_modify(|v| *v = (*v).max(end.unwrap_or(0)));
    }

    /// Marks every receiver changed (values unchanged): appends may have been missed.
    pub fn notify_all(&self) {
        let mut senders = self.senders();
        senders.retain(|_, partitions| {
            partitions.retain(|_, s| {
                let live = s.receiver_count() > 0;
                if live {
                    s.send_modify(|_| {});
                }
                live
            });
            !partitions.is_empty()
        });
    }

    /// Drops the senders of `topic`: its receivers see the channel closed.
    pub fn forget_topic(&self, topic: &str) {
        self.senders().remove(topic);
    }

    /// Partitions that have a sender (for tests of the memory bound).
    pub fn len(&self) -> usize {
        self.senders().values().map(|m| m.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::AppendNotifier;

    #[test]
    fn notify_wakes_one_partition_and_raises_its_value() {
        let n = AppendNotifier::default();
        let mut a = n.subscribe("t", 0, || 4);
        let b = n.subscribe("t", 1, || 0);
        let c = n.subscribe("u", 0, || 0);
        assert_eq!(*a.borrow(), 4);
        n.notify("t", 0, Some(6));
        assert!(a.has_changed().unwrap());
        assert_eq!(*a.borrow_and_update(), 6);
        assert!(!b.has_changed().unwrap());
        assert!(!c.has_changed().unwrap());
        // A lower or unknown end wakes without lowering the value.
        n.notify("t", 0, Some(2));
        n.notify("t", 0, None);
        assert!(a.has_changed().unwrap());
        assert_eq!(*a.borrow_and_update(), 6);
        // A second receiver shares the sender (the closure is not called).
        let a2 = n.subscribe("t", 0, || unreachable!("sender exists"));
        assert_eq!(*a2.borrow(), 6);
        n.notify_all();
        assert!(a.has_changed().unwrap() && b.has_changed().unwrap() && c.has_changed().unwrap());
    }

    #[test]
    fn forgetting_a_topic_closes_its_receivers_and_unused_senders_are_dropped() {
        let n = AppendNotifier::default();
        let a = n.subscribe("t", 0, || 0);
        let other = n.subscribe("u", 0, || 0);
        n.forget_topic("t");
        assert!(a.has_changed().is_err(), "closed");
        assert!(!other.has_changed().unwrap());
        assert_eq!(n.len(), 1);
        drop(other);
        n.notify("u", 0, Some(1));
        assert!(n.is_empty(), "a sender without receivers is dropped");
        drop(n.subscribe("v", 3, || 0));
        n.notify_all();
        assert!(n.is_empty());
    }
}
