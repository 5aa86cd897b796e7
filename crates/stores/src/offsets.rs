//! The OffsetStore: per (subscription incarnation, topic, partition), the committed
//! offset: every offset below it is resolved (acked or dead-lettered).

use async_trait::async_trait;
use meshd_meta::fence::Ownership;
use meshd_meta::{Meta, MetaError};

/// Which partition of which subscription. `incarnation` is the subscription's
/// creation revision in Meta, so a deleted and re-created subscription starts afresh.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OffsetKey {
    pub subscription: String,
    pub incarnation: i64,
    pub topic: String,
    pub partition: u32,
}

/// A committed offset with the epoch of its last explicit reset and the commit time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Committed {
    pub offset: u64,
    /// Counts explicit resets (0 until the first).
    pub epoch: u64,
    /// Unix milliseconds of the commit.
    pub at_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OffsetError {
    /// A commit below the committed offset: offsets never move backwards except by an
    /// explicit reset. Nothing was written; the rejection is counted.
    #[error("commit of {requested} is below the committed offset {current}")]
    Backwards { current: u64, requested: u64 },
    /// Refused: the store fail-stopped after an earlier failed write or fsync.
    /// Nothing of this call was written.
    #[error("offset store failed (fail-stopped): {0}")]
    Failed(String),
    /// This call's write or fsync failed: the new value may or may not be on disk
    /// after a restart (it is never shown before). The store fail-stopped.
    #[error("offset write outcome unknown (the store fail-stopped): {0}")]
    Indeterminate(String),
    #[error("corrupt offset record at {key}: {reason}")]
    Corrupt { key: String, reason: String },
    /// A fenced checkpoint failed in Meta (see the error for what to do).
    #[error("offset checkpoint: {0}")]
    Meta(#[from] MetaError),
}

/// # Contract
///
/// * `commit` returns only after the new value is fsynced (concurrent commits share
///   fsyncs). A lower value than the committed one is `Backwards` (and counted); the
///   same value is a no-op.
/// * `reset` is the only way backwards: it records a new epoch.
/// * `get`/`list` serve durable values from an in-memory cache.
/// * `checkpoint` writes the partition's committed offset to Meta fenced by the owner's
///   epoch (cluster mode); `load_checkpoint` reads it back; `init_checkpoint` writes a
///   start only where there is none.
#[async_trait]
pub trait OffsetStore: Send + Sync + 'static {
    async fn get(&self, key: &OffsetKey) -> Result<Option<Committed>, OffsetError>;
    async fn list(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<Vec<(OffsetKey, Committed)>, OffsetError>;
    async fn commit(&self, key: &OffsetKey, offset: u64) -> Result<Committed, OffsetError>;
    async fn reset(&self, key: &OffsetKey, offset: u64) -> Result<Committed, OffsetError>;
    /// Drops every offset of a subscription incarnation (the subscription was deleted).
    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), OffsetError>;
    /// How many backwards commits were rejected.
    fn backwards_rejections(&self) -> u64;

    async fn checkpoint(
        &self,
        meta: &dyn Meta,
        owner: &Ownership,
        key: &OffsetKey,
    ) -> Result<(), OffsetError>;
    async fn load_checkpoint(
        &self,
        meta: &dyn Meta,
        key: &OffsetKey,
    ) -> Result<Option<Committed>, OffsetError>;
    /// Cluster mode: the partition's start, written to Meta only if it has no
    /// checkpoint yet (put-if-absent, so the instance that creates a subscription and
    /// the first owner of each partition agree on one start); returns the checkpoint
    /// Meta holds afterwards.
    async fn init_checkpoint(
        &self,
        meta: &dyn Meta,
        key: &OffsetKey,
        offset: u64,
    ) -> Result<Committed, OffsetError>;
    /// Cluster mode: deletes the checkpoints of a deleted subscription incarnation.
    async fn drop_checkpoints(
        &self,
        meta: &dyn Meta,
        subscription: &str,
        incarnation: i64,
    ) -> Result<u64, OffsetError>;
}
