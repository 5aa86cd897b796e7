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
    ) -> Result<(), OffsetError> {
        self.checkpoint_with(meta, owner, key, &[]).await
    }
    /// [`OffsetStore::checkpoint`] with the offsets above the committed one that are
    /// resolved already (a release hands them over, so the next owner does not
    /// deliver them again). At most [`MAX_RESOLVED_RANGES`] ranges are kept.
    async fn checkpoint_with(
        &self,
        meta: &dyn Meta,
        owner: &Ownership,
        key: &OffsetKey,
        resolved: &[u64],
    ) -> Result<(), OffsetError>;
    async fn load_checkpoint(
        &self,
        meta: &dyn Meta,
        key: &OffsetKey,
    ) -> Result<Option<Committed>, OffsetError> {
        Ok(self.load_checkpoint_with(meta, key).await?.map(|(c, _)| c))
    }
    /// The checkpoint with the resolved offsets above it, ascending.
    async fn load_checkpoint_with(
        &self,
        meta: &dyn Meta,
        key: &OffsetKey,
    ) -> Result<Option<(Committed, Vec<u64>)>, OffsetError>;
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

/// The most `[from, to)` ranges of resolved offsets a checkpoint keeps (the rest are
/// delivered again by a new owner: duplicates, never a loss).
pub const MAX_RESOLVED_RANGES: usize = 10_000;

/// `offsets` above `committed` as ascending, disjoint `[from, to)` ranges, at most
/// [`MAX_RESOLVED_RANGES`] of them (the lowest).
pub fn resolved_ranges(committed: u64, offsets: &[u64]) -> Vec<(u64, u64)> {
    let mut sorted: Vec<u64> = offsets
        .iter()
        .copied()
        .filter(|o| *o >= committed)
        .collect();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for o in sorted {
        match out.last_mut() {
            Some((_, to)) if *to == o => *to = o.saturating_add(1),
            _ => {
                if out.len() == MAX_RESOLVED_RANGES {
                    break;
                }
                out.push((o, o.saturating_add(1)));
            }
        }
    }
    out
}

/// The offsets of stored ranges; the error is why they are corrupt (a range empty,
/// out of order, overlapping, below `committed`, or more than the cap allows).
pub fn expand_resolved(committed: u64, ranges: &[(u64, u64)]) -> Result<Vec<u64>, String> {
    if ranges.len() > MAX_RESOLVED_RANGES {
        return Err(format!(
            "{} resolved ranges (at most {MAX_RESOLVED_RANGES})",
            ranges.len()
        ));
    }
    let mut out = Vec::new();
    let mut floor = committed;
    for (from, to) in ranges {
        if from >= to || *from < floor {
            return Err(format!(
                "resolved range [{from}, {to}) is empty, out of order or below {floor}"
            ));
        }
        if to - from > 1_000_000 || out.len() as u64 + (to - from) > 10_000_000 {
            return Err(format!("resolved range [{from}, {to}) is implausibly long"));
        }
        out.extend(*from..*to);
        floor = *to;
    }
    Ok(out)
}

#[cfg(test)]
mod resolved_tests {
    use super::*;

    #[test]
    fn ranges_round_trip_and_garbage_is_corrupt() {
        let offsets = [12, 10, 11, 15, 9, 20, 21, 11];
        let r = resolved_ranges(10, &offsets);
        assert_eq!(
            r,
            vec![(10, 13), (15, 16), (20, 22)],
            "below committed dropped"
        );
        assert_eq!(
            expand_resolved(10, &r).unwrap(),
            vec![10, 11, 12, 15, 20, 21]
        );
        for bad in [
            vec![(5, 6)],
            vec![(12, 12)],
            vec![(12, 14), (13, 15)],
            vec![(20, 21), (12, 13)],
            vec![(10, 10 + 2_000_000)],
        ] {
            assert!(expand_resolved(10, &bad).is_err(), "{bad:?}");
        }
        let many: Vec<u64> = (0..(MAX_RESOLVED_RANGES as u64 + 5))
            .map(|i| i * 2)
            .collect();
        assert_eq!(resolved_ranges(0, &many).len(), MAX_RESOLVED_RANGES);
    }
}
