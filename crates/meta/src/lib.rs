//! # Meta: the contract of meshd's cluster state
//!
//! Meta is a linearizable key-value service with store-issued revisions, conditional
//! writes, multi-op transactions, leases and prefix watches. Everything meshd shares
//! between instances (topics, subscriptions, sessions, dead letters, tasks, membership,
//! ownership, offset checkpoints) lives in it. Two backends implement [`Meta`] and pass
//! one conformance suite (`meshd-test-support`):
//!
//! * `meshd-meta-etcd`: etcd v3, the production backend for more than one instance;
//! * `meshd-meta-embedded`: the same semantics on the instance's own RocksDB.
//!
//! This crate has no engine dependency: it holds the trait, the value types, the typed
//! errors, the fencing helper ([`fence`]) and the key catalog ([`keys`]).

pub mod error;
pub mod fence;
pub mod keys;
mod kv;
pub mod types;

pub use error::{MetaError, WatchError};
pub use types::*;

use async_trait::async_trait;
use futures::stream::BoxStream;
use std::time::Duration;

/// A stream of watch batches. Each item is every change of one or more revisions, in
/// revision order; an `Err` ends the stream (see [`WatchError`]).
pub type WatchStream = BoxStream<'static, Result<WatchBatch, WatchError>>;

/// The Meta contract every backend certifies.
///
/// # Durability
///
/// A write (`put`, `delete`, `txn`, `grant`, `revoke`, `compact`) that returns `Ok` is
/// durable: etcd has committed it through raft to a quorum's WAL; the embedded backend
/// has fsynced it. It survives a crash or restart of the backend (and of meshd).
///
/// # Revisions
///
/// The store has one global revision that only grows, issued by the store and never by
/// a client clock. Every change (a put, a delete of a present key, a lease expiry that
/// deletes keys) creates a new revision; all changes of one transaction share one
/// revision. A request that changes nothing (a delete of an absent key) does not move
/// the revision. Every key carries `create_revision`, `mod_revision` and `version`
/// (1 on create, +1 per put). An absent key compares as `mod_revision == 0`.
///
/// # Concurrency
///
/// All methods may be called concurrently from any number of tasks (and, for etcd,
/// processes). Operations are linearizable: a read started after a write returned sees
/// that write or a later one.
///
/// # Errors: what the caller must do
///
/// * [`MetaError::Conflict`]: a precondition failed, nothing was applied; `current` is
///   the current value of the key whose precondition failed. Re-read and decide.
/// * [`MetaError::Fenced`]: a fence compare failed (see [`fence`]): the caller is no
///   longer the owner. Nothing was applied. Drop the resource and re-acquire.
/// * [`MetaError::Unavailable`]: the request was not applied; safe to retry.
/// * [`MetaError::Indeterminate`]: the request may or may not have been applied
///   (a timeout after sending). Re-read before acting; an owner drops its resource.
/// * [`MetaError::LeaseNotFound`]: the lease has expired or was revoked.
/// * [`MetaError::InvalidRequest`]: the request itself is malformed; do not retry.
/// * [`MetaError::Corrupt`] / [`MetaError::Failed`]: the backend cannot be trusted;
///   the embedded backend has fail-stopped and refuses further writes.
///
/// A read never reports "absent" when the backend could not be read: it returns
/// `Unavailable` instead.
/// The system a store's data lives in, as logs, metrics (`backend="…"`), readiness
/// checks and problems (`backend`) name it. Every store names its real backend: the
/// dead-letter bodies and the log are `nats` in cluster mode, not `rocksdb`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Backend {
    /// Meta on the instance's own RocksDB (`--meta embedded`).
    Embedded,
    /// Meta on etcd.
    Etcd,
    /// The instance's RocksDB: the Local stores (offsets, delivery state) and the
    /// embedded log.
    RocksDb,
    /// The JetStream log of cluster mode.
    Nats,
    /// Another meshd instance, called over HTTP (cluster forwarding).
    Http,
}

impl Backend {
    /// The name: `embedded`, `etcd`, `rocksdb`, `nats` or `http`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Backend::Embedded => "embedded",
            Backend::Etcd => "etcd",
            Backend::RocksDb => "rocksdb",
            Backend::Nats => "nats",
            Backend::Http => "http",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[async_trait]
pub trait Meta: Send + Sync + 'static {
    /// Which backend this is ([`Backend::Etcd`] or [`Backend::Embedded`]), for logs,
    /// metrics and readiness.
    fn backend(&self) -> Backend;

    /// Reads one key, with the store revision the read observed.
    async fn get(&self, key: &[u8]) -> Result<GetResponse, MetaError>;

    /// Reads the keys that start with `prefix`, in key order, starting at
    /// `options.start` (inclusive, must itself start with the prefix) and at most
    /// `options.limit` of them (0 = no limit). `more` says whether keys were left out.
    /// `revision` is the store revision the whole page was read at, so a caller can
    /// list and then [`watch`](Meta::watch) from `revision + 1` without a gap.
    async fn range(&self, prefix: &[u8], options: RangeOptions)
        -> Result<RangeResponse, MetaError>;

    /// Writes one key if `precondition` holds; attaches it to `lease` when given (the
    /// key is deleted when the lease ends). Returns the revision of the write, which is
    /// the key's new `mod_revision`.
    async fn put(
        &self,
        key: &[u8],
        value: &[u8],
        precondition: Precondition,
        lease: Option<LeaseId>,
    ) -> Result<PutResponse, MetaError> {
        let txn = Txn::new()
            .when_precondition(key, precondition)
            .put_with_lease(key, value, lease);
        let r = self.txn(txn).await?;
        Ok(PutResponse {
            revision: r.revision,
        })
    }

    /// Deletes one key if `precondition` holds. Deleting an absent key with no
    /// precondition succeeds with `deleted == false` and does not move the revision.
    async fn delete(
        &self,
        key: &[u8],
        precondition: Precondition,
    ) -> Result<DeleteResponse, MetaError> {
        let txn = Txn::new().when_precondition(key, precondition).delete(key);
        let r = self.txn(txn).await?;
        Ok(DeleteResponse {
            revision: r.revision,
            deleted: r.deleted > 0,
        })
    }

    /// Applies all of `txn`'s operations if every compare holds, or none of them.
    /// A failed compare marked as a fence yields `Fenced` (fences are checked first);
    /// otherwise the first failed compare yields `Conflict` with that key's value.
    async fn txn(&self, txn: Txn) -> Result<TxnResponse, MetaError>;

    /// Grants a lease. Backends may round the TTL up (etcd grants whole seconds); the
    /// answer carries the effective TTL.
    async fn grant(&self, ttl: Duration) -> Result<Lease, MetaError>;

    /// Renews a lease for its full TTL and returns that TTL. `LeaseNotFound` when it
    /// has already expired or was revoked. A caller that measures its own safety
    /// deadline starts the clock *before* sending this request.
    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, MetaError>;

    /// Ends a lease now, deleting every key attached to it (one revision).
    /// Revoking an unknown lease is `LeaseNotFound`.
    async fn revoke(&self, lease: LeaseId) -> Result<(), MetaError>;

    /// Watches every change under `prefix` from `start_revision` (>= 1) on, in
    /// revision order, none missed. When the history at `start_revision` was compacted
    /// the stream yields [`WatchError::Compacted`] and ends: re-list and watch again
    /// from the list's revision + 1. Any other error also ends the stream; resume from
    /// the last revision seen + 1.
    async fn watch(&self, prefix: &[u8], start_revision: i64) -> Result<WatchStream, MetaError>;

    /// Drops the change history before `revision` (an operator or retention action).
    /// Watches starting below it then report `Compacted`.
    async fn compact(&self, revision: i64) -> Result<(), MetaError>;

    /// The backend's current status: its revision and database size.
    async fn status(&self) -> Result<MetaStatus, MetaError>;
}
