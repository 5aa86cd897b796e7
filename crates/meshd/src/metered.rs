//! A [`Meta`] wrapper that counts every call's failures by operation and error kind,
//! so a Meta outage shows in `/metrics` (`meshd_meta_errors_total`) and in logs with
//! the backend named.

use async_trait::async_trait;
use meshd_meta::{
    GetResponse, Lease, LeaseId, Meta, MetaError, MetaStatus, RangeOptions, RangeResponse, Txn,
    TxnResponse, WatchStream,
};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct MeteredMeta {
    inner: Arc<dyn Meta>,
    /// (operation, error kind) → count. A mutex over a small map: errors are rare.
    errors: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    calls: AtomicU64,
}

impl MeteredMeta {
    pub fn new(inner: Arc<dyn Meta>) -> Self {
        Self {
            inner,
            errors: Mutex::new(BTreeMap::new()),
            calls: AtomicU64::new(0),
        }
    }

    fn record<T>(&self, op: &'static str, r: Result<T, MetaError>) -> Result<T, MetaError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = &r {
            // Conflicts and fences are answers, not failures of the backend.
            if !matches!(
                e,
                MetaError::Conflict { .. } | MetaError::Fenced | MetaError::LeaseNotFound(_)
            ) {
                tracing::warn!(store = "meta", backend = %self.inner.backend(), op, error = %e, "meta call failed");
            }
            let mut m = self.errors.lock().unwrap_or_else(|p| p.into_inner());
            *m.entry((op, e.kind())).or_default() += 1;
        }
        r
    }

    /// Prometheus text for the counters.
    pub fn render(&self, out: &mut String) {
        let backend = self.inner.backend();
        out.push_str("# HELP meshd_meta_calls_total Meta calls made by this instance.\n");
        out.push_str("# TYPE meshd_meta_calls_total counter\n");
        out.push_str(&format!(
            "meshd_meta_calls_total{{backend=\"{backend}\"}} {}\n",
            self.calls.load(Ordering::Relaxed)
        ));
        out.push_str("# HELP meshd_meta_errors_total Meta calls that returned an error, by operation and kind.\n");
        out.push_str("# TYPE meshd_meta_errors_total counter\n");
        let m = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        for ((op, kind), n) in m.iter() {
            out.push_str(&format!(
                "meshd_meta_errors_total{{backend=\"{backend}\",op=\"{op}\",kind=\"{kind}\"}} {n}\n"
            ));
        }
    }
}

#[async_trait]
impl Meta for MeteredMeta {
    fn backend(&self) -> meshd_meta::Backend {
        self.inner.backend()
    }
    async fn get(&self, key: &[u8]) -> Result<GetResponse, MetaError> {
        self.record("get", self.inner.get(key).await)
    }
    async fn range(
        &self,
        prefix: &[u8],
        options: RangeOptions,
    ) -> Result<RangeResponse, MetaError> {
        self.record("range", self.inner.range(prefix, options).await)
    }
    async fn txn(&self, txn: Txn) -> Result<TxnResponse, MetaError> {
        self.record("txn", self.inner.txn(txn).await)
    }
    async fn grant(&self, ttl: Duration) -> Result<Lease, MetaError> {
        self.record("grant", self.inner.grant(ttl).await)
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, MetaError> {
        self.record("keep_alive", self.inner.keep_alive(lease).await)
    }
    async fn revoke(&self, lease: LeaseId) -> Result<(), MetaError> {
        self.record("revoke", self.inner.revoke(lease).await)
    }
    async fn watch(&self, prefix: &[u8], start_revision: i64) -> Result<WatchStream, MetaError> {
        self.record("watch", self.inner.watch(prefix, start_revision).await)
    }
    async fn compact(&self, revision: i64) -> Result<(), MetaError> {
        self.record("compact", self.inner.compact(revision).await)
    }
    async fn status(&self) -> Result<MetaStatus, MetaError> {
        self.record("status", self.inner.status().await)
    }
}
