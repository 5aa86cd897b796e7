//! # The Local backend: one embedded RocksDB per instance
//!
//! Every Local store (and the embedded Meta) lives in one RocksDB under the instance's
//! data dir, one column family per store. This crate is the only one that links
//! RocksDB. It exposes a small engine trait, [`KvEngine`], so the stores above it can
//! be tested against a fault-injecting wrapper ([`testing::PowerCutEngine`], feature
//! `testing`) that models what survives a power cut.
//!
//! The directory is locked exclusively (an OS file lock on `meshd.lock`, plus RocksDB's
//! own `LOCK`): a second process, or a second open in the same process, fails with
//! [`LocalError::Locked`], which names the directory.

pub mod codec;
mod engine;
pub mod group;
mod no_sync;
mod rocks;
#[cfg(feature = "testing")]
pub mod testing;

pub use engine::{Batch, BatchOp, Durability, KvEngine, LocalError, Rows, SCAN_EACH_STEP};
pub use no_sync::{no_sync_for_tests, NO_SYNC_VAR};
pub use rocks::{Closed, RocksEngine, WalRecovery};
