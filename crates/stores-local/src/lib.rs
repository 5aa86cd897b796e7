//! # The stores on the Local RocksDB
//!
//! The partition log ([`log::RocksLog`], which is also the dead-letter body stream),
//! the OffsetStore ([`offsets::RocksOffsetStore`]) and the DeliveryStateStore
//! ([`delivery::RocksDeliveryStore`]). All share the instance's one RocksDB (column
//! families in [`keys::COLUMN_FAMILIES`]) and one group committer for all three, so
//! concurrent writers share fsyncs. Every key layout is in [`keys`].

pub mod dedup;
pub mod delivery;
pub mod keys;
pub mod log;
pub mod offsets;
pub mod park;
pub mod tail;

use meshd_local::group::GroupCommit;
use meshd_local::KvEngine;
use std::sync::Arc;
use std::time::Duration;

/// The Local stores of one instance, opened on its RocksDB with one group committer,
/// so every Local write shares fsyncs and one failed fsync fail-stops them all.
pub struct LocalStores {
    pub group: Arc<GroupCommit>,
    pub log: log::RocksLog,
    pub offsets: offsets::RocksOffsetStore,
    pub deliveries: delivery::RocksDeliveryStore,
    /// The park index (http-api.md "Parking"; the runtime does not use it yet).
    pub parks: park::RocksParkStore,
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("log: {0}")]
    Log(#[from] meshd_stores::log::LogError),
    #[error("offsets: {0}")]
    Offsets(#[from] meshd_stores::offsets::OffsetError),
    #[error("deliveries: {0}")]
    Deliveries(#[from] meshd_stores::delivery::DeliveryError),
}

impl LocalStores {
    /// Opens every Local store (recovery: partition heads, committed offsets). The
    /// engine must have [`keys::COLUMN_FAMILIES`].
    pub fn open(
        engine: Arc<dyn KvEngine>,
        log_id: &str,
        delivery_flush: Duration,
    ) -> Result<Self, OpenError> {
        let group = Arc::new(GroupCommit::new(engine, "local"));
        let log = log::RocksLog::open(group.clone(), log_id)?;
        let offsets = offsets::RocksOffsetStore::open(group.clone())?;
        let deliveries =
            delivery::RocksDeliveryStore::open(group.clone(), offsets.clone(), delivery_flush)?;
        let parks = park::RocksParkStore::open(group.clone());
        Ok(Self {
            group,
            log,
            offsets,
            deliveries,
            parks,
        })
    }
}

/// Returns once every write submitted to the Local committer's store thread before
/// this call is applied (they are applied in order, and so is the empty one this
/// queues): a flush or a read that must see the buffered writes a caller submitted
/// without waiting for them (an ack's resolve) starts here. Its answer, whatever it
/// is (a fail-stopped committer refuses even an empty write), comes after theirs.
pub(crate) async fn applied_so_far(group: &Arc<GroupCommit>) {
    let _ = on_store_thread(group, meshd_local::group::Wait::Written, |_| {
        Ok::<_, meshd_local::LocalError>((meshd_local::Batch::new(), ()))
    })
    .await;
}

/// Runs a write on the Local committer's store thread
/// ([`GroupCommit::submit`](meshd_local::group::GroupCommit::submit)) and awaits its
/// answer: `(ticket, output)`, the ticket `None` for an empty batch.
pub(crate) async fn on_store_thread<T, E, F>(
    group: &Arc<GroupCommit>,
    wait: meshd_local::group::Wait,
    f: F,
) -> Result<(Option<u64>, T), E>
where
    T: Send + 'static,
    E: From<meshd_local::LocalError> + Send + 'static,
    F: FnOnce(&dyn KvEngine) -> Result<(meshd_local::Batch, T), E> + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    group.submit(wait, f, move |r| {
        let _ = tx.send(r);
    });
    match rx.await {
        Ok(r) => r,
        Err(_) => Err(meshd_local::LocalError::WriteFailed(
            "the Local store thread went away with this write queued".into(),
        )
        .into()),
    }
}
