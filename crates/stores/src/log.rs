//! The partition log: the events of every (topic, partition), and the dead-letter
//! stream that keeps the bodies of dead-lettered events.

use async_trait::async_trait;
use std::fmt;

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

    /// A counter that grows with every durable append, for long polls: wait for it to
    /// change, then read.
    fn appends(&self) -> tokio::sync::watch::Receiver<u64>;
}
