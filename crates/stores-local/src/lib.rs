//! # The stores on the Local RocksDB
//!
//! The partition log ([`log::RocksLog`], which is also the dead-letter body stream),
//! the OffsetStore ([`offsets::RocksOffsetStore`]) and the DeliveryStateStore
//! ([`delivery::RocksDeliveryStore`]). All share the instance's one RocksDB (column
//! families in [`keys::COLUMN_FAMILIES`]) and one group committer per store, so
//! concurrent writers share fsyncs. Every key layout is in [`keys`].

pub mod keys;
pub mod log;
