//! # EmbeddedMeta: etcd's semantics on the instance's own RocksDB
//!
//! For a single instance with no external service. It implements the same
//! [`Meta`] contract as etcd and passes the same conformance suite:
//!
//! * one persistent global revision, written atomically with every change (the `s`
//!   record is in the same RocksDB batch as the keys and history it describes);
//! * per-key create/mod revision and version;
//! * leases with TTL: deadlines live in memory (monotonic clock) and are re-armed with
//!   the full TTL on open, like etcd after a leader change;
//! * watch from a revision, backed by a bounded change history (`history_limit`
//!   revisions); a start below the kept history is reported as compacted;
//! * the directory is locked exclusively by the Local engine.
//!
//! ## Durability: group commit
//!
//! All writes go through one writer thread. It drains the queue, applies each request
//! as a buffered RocksDB batch while holding the engine's write lock, then fsyncs once
//! for the whole group, releases the lock and only then answers. Readers take the read
//! lock, so they never see a write that is not yet durable. If the fsync fails, every
//! request of the group is answered `Indeterminate` and the store fail-stops: every
//! later call answers `Failed` (what reached disk is unknown; restart to recover).
//!
//! The engine is shared with the Local stores, so it can fail under this store too
//! (a failed fsync of the partition log). The store then fail-stops as if its own write
//! had failed (none of its writes could become durable): its health check
//! ([`Meta::status`]) and every read answer `Failed` at once, and a write is refused
//! with `Failed` (not applied) before anything is written — never `Indeterminate`.

mod config;
mod records;
mod shared;
mod watch;
mod writer;

pub use config::EmbeddedConfig;
pub use records::CF as COLUMN_FAMILY;

use async_trait::async_trait;
use meshd_local::{KvEngine, LocalError, RocksEngine};
use meshd_meta::{
    GetResponse, Lease, LeaseId, Meta, MetaError, MetaStatus, RangeOptions, RangeResponse, Txn,
    TxnResponse, WatchStream,
};
use records::key_record::KeyRecord;
use shared::{corrupt, read_error, read_key, read_state, LeaseEntry, Shared};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch as tokio_watch};

/// The embedded Meta backend. Cheap to share behind an `Arc`; `close` (or drop)
/// stops the writer and releases the engine.
pub struct EmbeddedMeta {
    shared: Arc<Shared>,
    requests: std::sync::mpsc::Sender<writer::Request>,
    revision_rx: tokio_watch::Receiver<i64>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl EmbeddedMeta {
    /// Opens the embedded Meta in its own RocksDB at `dir` (exclusive).
    pub fn open_dir(dir: &Path, config: EmbeddedConfig) -> Result<Self, MetaError> {
        let engine = RocksEngine::open(dir, &[records::CF]).map_err(|e| match e {
            LocalError::Locked { .. } => MetaError::Failed(e.to_string()),
            LocalError::OpenCorrupt { ref dir, .. } => MetaError::Corrupt {
                key: dir.display().to_string(),
                reason: e.to_string(),
            },
            other => MetaError::Unavailable(other.to_string()),
        })?;
        Self::open(Arc::new(engine), config)
    }

    /// Opens the embedded Meta on an engine that has the [`COLUMN_FAMILY`] column
    /// family. Recovery: reads the state record and re-arms every lease with its
    /// full TTL.
    pub fn open(engine: Arc<dyn KvEngine>, config: EmbeddedConfig) -> Result<Self, MetaError> {
        config.validate()?;
        let state = read_state(engine.as_ref())?;
        let mut leases = HashMap::new();
        let now = Instant::now();
        let end = [records::LEASE_PREFIX + 1];
        for (k, v) in engine
            .scan(records::CF, &[records::LEASE_PREFIX], Some(&end), 0)
            .map_err(read_error)?
        {
            let id = records::lease_id_of(&k).ok_or_else(|| MetaError::Corrupt {
                key: format!("{k:?}"),
                reason: "malformed lease key".into(),
            })?;
            let rec = records::lease::LeaseRecord::decode(&v).map_err(|e| corrupt(&k, e))?;
            let ttl = Duration::from_millis(rec.ttl_ms);
            leases.insert(
                id,
                LeaseEntry {
                    ttl,
                    deadline: now + ttl,
                },
            );
        }
        tracing::info!(
            store = "meta",
            backend = "embedded",
            revision = state.revision,
            leases = leases.len(),
            "embedded meta opened"
        );
        let shared = Arc::new(Shared {
            engine: RwLock::new(Some(engine)),
            revision: AtomicI64::new(state.revision),
            leases: Mutex::new(leases),
            failed: Mutex::new(None),
            config,
        });
        let (revision_tx, revision_rx) = tokio_watch::channel(state.revision);
        let (requests, rx) = std::sync::mpsc::channel();
        let w = writer::Writer::new(shared.clone(), state, rx, revision_tx);
        let handle = std::thread::Builder::new()
            .name("meta-writer".into())
            .spawn(move || w.run())
            .map_err(|e| MetaError::Failed(format!("cannot start the meta writer: {e}")))?;
        Ok(Self {
            shared,
            requests,
            revision_rx,
            writer: Mutex::new(Some(handle)),
        })
    }

    /// Stops the writer (after it answered what it had taken) and releases the engine.
    /// Later calls answer `Unavailable`; open watches end.
    pub fn close(&self) {
        let _ = self.requests.send(writer::Request::Shutdown);
        let handle = self.writer.lock().ok().and_then(|mut h| h.take());
        if let Some(h) = handle {
            let _ = h.join();
        }
        if let Ok(mut e) = self.shared.engine.write() {
            *e = None;
        }
    }

    async fn submit<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, MetaError>>) -> writer::Request,
    ) -> Result<T, MetaError> {
        self.shared.check_failed()?;
        let (tx, rx) = oneshot::channel();
        self.requests
            .send(make(tx))
            .map_err(|_| MetaError::Unavailable("embedded meta is closed".into()))?;
        match rx.await {
            Ok(r) => r,
            // The writer dropped the request without answering: it was shut down
            // before taking it, so nothing was applied.
            Err(_) => Err(MetaError::Unavailable("embedded meta is closed".into())),
        }
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Shared) -> Result<T, MetaError> + Send + 'static,
    ) -> Result<T, MetaError> {
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || f(&shared))
            .await
            .map_err(|e| MetaError::Unavailable(format!("read task failed: {e}")))?
    }
}

impl Drop for EmbeddedMeta {
    fn drop(&mut self) {
        self.close();
    }
}

#[async_trait]
impl Meta for EmbeddedMeta {
    fn backend(&self) -> meshd_meta::Backend {
        meshd_meta::Backend::Embedded
    }

    async fn get(&self, key: &[u8]) -> Result<GetResponse, MetaError> {
        if key.is_empty() {
            return Err(MetaError::InvalidRequest("empty key".into()));
        }
        let key = key.to_vec();
        self.blocking(move |s| {
            s.read(|engine| {
                let revision = s.revision.load(Ordering::SeqCst);
                let kv = read_key(engine, &key)?.map(|r| r.to_kv(&key));
                Ok(GetResponse { revision, kv })
            })
        })
        .await
    }

    async fn range(
        &self,
        prefix: &[u8],
        options: RangeOptions,
    ) -> Result<RangeResponse, MetaError> {
        let prefix = prefix.to_vec();
        self.blocking(move |s| {
            s.read(|engine| {
                let revision = s.revision.load(Ordering::SeqCst);
                let start_user = match &options.start {
                    Some(start) if !start.starts_with(&prefix) => {
                        return Err(MetaError::InvalidRequest(
                            "range start must begin with the prefix".into(),
                        ))
                    }
                    Some(start) => start.clone(),
                    None => prefix.clone(),
                };
                let start = records::key_key(&start_user);
                let end_user = meshd_meta::prefix_end(&prefix);
                let end = if end_user.is_empty() {
                    vec![records::KEY_PREFIX + 1]
                } else {
                    records::key_key(&end_user)
                };
                let fetch = if options.limit == 0 {
                    0
                } else {
                    options.limit + 1
                };
                let rows = engine
                    .scan(records::CF, &start, Some(&end), fetch)
                    .map_err(read_error)?;
                let more = options.limit != 0 && rows.len() > options.limit;
                let mut kvs = Vec::with_capacity(rows.len());
                for (k, v) in rows
                    .into_iter()
                    .take(if more { options.limit } else { usize::MAX })
                {
                    let user_key = &k[1..];
                    let rec = KeyRecord::decode(&v).map_err(|e| corrupt(user_key, e))?;
                    kvs.push(rec.to_kv(user_key));
                }
                Ok(RangeResponse {
                    revision,
                    kvs,
                    more,
                })
            })
        })
        .await
    }

    async fn txn(&self, txn: Txn) -> Result<TxnResponse, MetaError> {
        txn.validate()?;
        let size: usize = txn
            .ops
            .iter()
            .map(|op| match op {
                meshd_meta::TxnOp::Put { key, value, .. } => key.len() + value.len(),
                meshd_meta::TxnOp::Delete { key } => key.len(),
            })
            .sum();
        if size > self.shared.config.max_request_bytes {
            return Err(MetaError::InvalidRequest(format!(
                "request of {size} bytes exceeds the {} byte limit",
                self.shared.config.max_request_bytes
            )));
        }
        self.submit(|reply| writer::Request::Txn { txn, reply })
            .await
    }

    async fn grant(&self, ttl: Duration) -> Result<Lease, MetaError> {
        if ttl.is_zero() {
            return Err(MetaError::InvalidRequest(
                "lease TTL must be positive".into(),
            ));
        }
        self.submit(|reply| writer::Request::Grant { ttl, reply })
            .await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, MetaError> {
        self.shared.check_failed()?;
        let mut leases = self.shared.lock_leases();
        match leases.get_mut(&lease.0) {
            Some(entry) if entry.deadline > Instant::now() => {
                entry.deadline = Instant::now() + entry.ttl;
                Ok(entry.ttl)
            }
            _ => Err(MetaError::LeaseNotFound(lease)),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), MetaError> {
        self.submit(|reply| writer::Request::Revoke { lease, reply })
            .await
    }

    async fn watch(&self, prefix: &[u8], start_revision: i64) -> Result<WatchStream, MetaError> {
        if start_revision < 1 {
            return Err(MetaError::InvalidRequest(format!(
                "watch start revision must be at least 1, got {start_revision}"
            )));
        }
        self.shared.check_failed()?;
        Ok(watch::spawn(
            self.shared.clone(),
            self.revision_rx.clone(),
            prefix.to_vec(),
            start_revision,
        ))
    }

    async fn compact(&self, revision: i64) -> Result<(), MetaError> {
        self.submit(|reply| writer::Request::Compact { revision, reply })
            .await
    }

    async fn status(&self) -> Result<MetaStatus, MetaError> {
        self.blocking(|s| {
            s.read(|engine| {
                Ok(MetaStatus {
                    revision: s.revision.load(Ordering::SeqCst),
                    db_size_bytes: engine.size_bytes(),
                    quota_bytes: None,
                    alarms: Vec::new(),
                })
            })
        })
        .await
    }
}
