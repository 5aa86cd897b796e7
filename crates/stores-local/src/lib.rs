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
mod store_thread;
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
