//! The DeliveryStateStore: one record per in-flight delivery.

use crate::offsets::OffsetKey;
use async_trait::async_trait;

/// Where a delivery stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryState {
    /// Handed out; due again at `deadline_ms` unless acked.
    InFlight,
    /// Failed; to be handed out again at `deadline_ms`.
    WaitingRetry,
    /// Acked above a gap: kept until the committed offset passes it, so a crash cannot
    /// redeliver it.
    AckedAwaitingCommit,
    /// Failed `max_attempts` times; its dead-letter entry could not be written yet
    /// (Meta unavailable): held, neither lost nor redelivered.
    DeadLettering,
}

/// The session a pull bound a delivery to.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SessionBinding {
    pub session_id: String,
    pub epoch: i64,
}

/// One in-flight delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryRecord {
    pub key: OffsetKey,
    pub offset: u64,
    /// 1 on the first hand-out; grows only on a real hand-out.
    pub attempt: u32,
    /// Names the current attempt; an ack for an older attempt is "unknown".
    pub delivery_id: String,
    /// Unix milliseconds when it is due (ack timeout or retry time).
    pub deadline_ms: u64,
    pub last_reason: Option<String>,
    pub first_delivered_at_ms: u64,
    pub state: DeliveryState,
    /// The owner epoch it was written under (0 for a standalone instance).
    pub owner_epoch: i64,
    pub session: Option<SessionBinding>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeliveryError {
    /// Refused: the store fail-stopped after an earlier failed write or fsync (or
    /// could not read): no new deliveries until a restart. Nothing of this call was
    /// written.
    #[error("delivery state store failed (fail-stopped): {0}")]
    Poisoned(String),
    /// This call's write or fsync failed: it may or may not be on disk after a
    /// restart. The store fail-stopped.
    #[error("delivery write outcome unknown (the store fail-stopped): {0}")]
    Indeterminate(String),
    #[error("corrupt delivery record at {key}: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("invalid delivery store request: {0}")]
    Invalid(String),
    #[error("offset: {0}")]
    Offset(#[from] crate::offsets::OffsetError),
}

impl DeliveryError {
    /// What failed, without this error's own "fail-stopped" / "outcome unknown"
    /// prefix: for a message that says the store stopped in its own words.
    pub fn reason(&self) -> String {
        match self {
            DeliveryError::Poisoned(reason) | DeliveryError::Indeterminate(reason) => {
                reason.clone()
            }
            other => other.to_string(),
        }
    }
}

/// What one `resolve` does to the committed offset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffsetAdvance {
    pub key: OffsetKey,
    pub to: u64,
}

/// # Contract
///
/// * `record_attempt` is durable (fsynced, group commit) before it returns: hand an
///   event out only after it, so a crash never resets an attempt count.
/// * `update` (ack, nack, reschedule, dead-lettering) is applied at once and made
///   durable within the flush interval (a background flusher; `flush` forces it).
/// * `resolve` removes records and advances the committed offset in one atomic batch
///   (the OffsetStore shares the RocksDB), applied at once and durable within the flush
///   interval like `update`; the OffsetStore reports the advance only once it is
///   durable (a read of a key with an advance still pending forces the fsync), so a
///   reported committed offset never goes back across a crash.
/// * `submit_resolve_and_update` queues both in one write without waiting: writes
///   are applied in submission order, and `flush` and the OffsetStore's reads cover
///   every write submitted before them (a client reads its own acks).
/// * A write whose own write or fsync fails answers [`DeliveryError::Indeterminate`];
///   the store is then poisoned: every later write fails with
///   [`DeliveryError::Poisoned`] (nothing written), and `health` says so.
/// * `load_all` reads every record in one pass (recovery); the partition tasks keep
///   the deadlines in memory from there, so the store keeps no deadline index.
#[async_trait]
pub trait DeliveryStateStore: Send + Sync + 'static {
    async fn record_attempt(&self, record: DeliveryRecord) -> Result<(), DeliveryError>;

    /// [`record_attempt`](Self::record_attempt) for the attempts of one pull, in one
    /// atomic durable write: all of them or none.
    async fn record_attempts(&self, records: Vec<DeliveryRecord>) -> Result<(), DeliveryError>;

    /// [`record_attempts`](Self::record_attempts) submitted before this returns and
    /// answered on the receiver once durable (or failed): the write is ordered before
    /// every write this store is given afterwards, so a caller may go on writing while
    /// it is made durable (and must not hand out before the answer). A dropped sender
    /// means the outcome is unknown.
    fn submit_attempts(
        &self,
        records: Vec<DeliveryRecord>,
    ) -> tokio::sync::oneshot::Receiver<Result<(), DeliveryError>>;
    /// Writes `records` (each replacing the record of its offset) in one atomic
    /// write, applied at once and durable within the flush interval: the updates of
    /// one turn of a partition task (the acks above a gap in the committed prefix
    /// come a hundred at a time) cost one write, not one each.
    async fn update(&self, records: Vec<DeliveryRecord>) -> Result<(), DeliveryError> {
        self.resolve_and_update(Vec::new(), None, records).await
    }
    async fn resolve(
        &self,
        remove: Vec<(OffsetKey, u64)>,
        advance: Option<OffsetAdvance>,
    ) -> Result<(), DeliveryError> {
        self.resolve_and_update(remove, advance, Vec::new()).await
    }
    /// [`resolve`](Self::resolve) and [`update`](Self::update) in one atomic write
    /// (an ack turn moves the committed prefix and records the acks above the new
    /// gap: one write for both).
    async fn resolve_and_update(
        &self,
        remove: Vec<(OffsetKey, u64)>,
        advance: Option<OffsetAdvance>,
        updates: Vec<DeliveryRecord>,
    ) -> Result<(), DeliveryError> {
        let (tx, mut rx) = tokio::sync::oneshot::channel();
        self.submit_resolve_and_update(
            remove,
            advance,
            updates,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        submitted(&mut rx).await
    }
    /// [`resolve_and_update`](Self::resolve_and_update) submitted before this
    /// returns: ordered before every write this store is given afterwards and before
    /// a later [`flush`](Self::flush), so a caller need not wait for it (a partition
    /// task goes on with its next requests). `applied` is told the outcome once the
    /// write is applied (buffered), on a thread of the store: keep it short. Dropped
    /// uncalled, the store went away with the write queued (outcome unknown).
    fn submit_resolve_and_update(
        &self,
        remove: Vec<(OffsetKey, u64)>,
        advance: Option<OffsetAdvance>,
        updates: Vec<DeliveryRecord>,
        applied: Applied,
    );
    async fn flush(&self) -> Result<(), DeliveryError>;
    async fn get(
        &self,
        key: &OffsetKey,
        offset: u64,
    ) -> Result<Option<DeliveryRecord>, DeliveryError>;
    async fn load_all(&self) -> Result<Vec<DeliveryRecord>, DeliveryError>;
    /// Every record of one subscription incarnation (rebuilding its cores after a
    /// settings change or an offset reset). Call `flush` first to include buffered
    /// updates.
    async fn load_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<Vec<DeliveryRecord>, DeliveryError>;
    /// Cluster mode, on acquiring a partition: Meta is authoritative. In one atomic,
    /// durable batch, drops every local record of the partition (from an earlier
    /// ownership of this instance) and sets its committed offset to `committed`
    /// exactly (Meta's checkpoint; it may be below or above the local value). Call it
    /// only while no partition task runs for `key`.
    async fn adopt_partition(
        &self,
        key: &OffsetKey,
        committed: crate::offsets::Committed,
    ) -> Result<(), DeliveryError>;
    /// Drops every record of a subscription incarnation.
    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), DeliveryError>;
    /// `Err` with the reason once poisoned.
    fn health(&self) -> Result<(), String>;
}

/// What a [`DeliveryStateStore::submit_resolve_and_update`] is told once its write
/// is applied, or failed.
pub type Applied = Box<dyn FnOnce(Result<(), DeliveryError>) + Send>;

/// The outcome a [`DeliveryStateStore::submit_attempts`] receiver (or one of a
/// submitted write) brings; a sender dropped unanswered (the store went away, meshd
/// is stopping) is an unknown outcome.
pub async fn submitted(
    answer: &mut tokio::sync::oneshot::Receiver<Result<(), DeliveryError>>,
) -> Result<(), DeliveryError> {
    answer.await.unwrap_or_else(|_| {
        Err(DeliveryError::Indeterminate(
            "the store went away with this write queued".into(),
        ))
    })
}
