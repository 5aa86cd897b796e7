//! meshd compacts the Meta history it creates (state-plane.md "Meta's footprint"):
//! etcd keeps every revision until something compacts it, and an operator's etcd may
//! run without auto-compaction. Every [`CHECK_EVERY`] each instance reads Meta's
//! revision; once it is more than `--meta-compaction-retention` revisions past the
//! last compaction, the instance that wins a compare-and-set on
//! `maintenance/compaction` compacts to `revision - retention` (so one instance at a
//! time does it, and a lost race costs one read). `0` turns it off, for an etcd shared
//! with users that compact it themselves.

use crate::metrics::Metrics;
use meshd_meta::keys::{key, KeyKind};
use meshd_meta::{Meta, MetaError, Precondition};
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often each instance looks (http-api.md: every 30 s).
const CHECK_EVERY: Duration = Duration::from_secs(30);

/// What the compaction loop did, for `/metrics`.
#[derive(Default)]
pub struct CompactionCounters {
    /// The revision this instance last compacted to (0: never).
    pub compacted_to: AtomicI64,
    pub compactions: AtomicU64,
    pub failures: AtomicU64,
}

impl CompactionCounters {
    pub fn render(&self, out: &mut String, retention: u64) {
        use std::fmt::Write;
        let _ = writeln!(out, "# HELP meshd_meta_compaction_retention Revisions of Meta history meshd keeps (--meta-compaction-retention; 0: meshd does not compact).\n# TYPE meshd_meta_compaction_retention gauge\nmeshd_meta_compaction_retention {retention}");
        let _ = writeln!(out, "# HELP meshd_meta_compacted_revision The revision this instance last compacted Meta's history to (0: it has not).\n# TYPE meshd_meta_compacted_revision gauge\nmeshd_meta_compacted_revision {}", self.compacted_to.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP meshd_meta_compactions_total Compactions of Meta's history this instance made.\n# TYPE meshd_meta_compactions_total counter\nmeshd_meta_compactions_total {}", self.compactions.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP meshd_meta_compaction_failures_total Compaction checks that failed (Meta unavailable or refusing).\n# TYPE meshd_meta_compaction_failures_total counter\nmeshd_meta_compaction_failures_total {}", self.failures.load(Ordering::Relaxed));
    }
}

/// The record under `maintenance/compaction`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Record {
    v: u32,
    revision: i64,
}

/// Starts the loop (nothing with `retention` 0). `every` is [`CHECK_EVERY`] unless a
/// test asks for less.
pub fn spawn(
    background: &crate::background::Background,
    meta: Arc<dyn Meta>,
    retention: u64,
    every: Option<Duration>,
    counters: Arc<CompactionCounters>,
    metrics: Arc<Metrics>,
) {
    if retention == 0 {
        tracing::info!(
            store = "meta",
            backend = %meta.backend(),
            "--meta-compaction-retention 0: meshd does not compact Meta's history"
        );
        return;
    }
    let every = every.unwrap_or(CHECK_EVERY);
    background.spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            match check(meta.as_ref(), retention).await {
                Ok(Some(to)) => {
                    counters.compacted_to.store(to, Ordering::Relaxed);
                    counters.compactions.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        store = "meta",
                        backend = %meta.backend(),
                        revision = to,
                        retention,
                        "compacted Meta's history"
                    );
                }
                Ok(None) => {}
                Err(e) => {
                    counters.failures.fetch_add(1, Ordering::Relaxed);
                    metrics.store_error("meta", meta.backend(), e.kind());
                    tracing::warn!(store = "meta", backend = %meta.backend(), error = %e, "compacting Meta's history failed; tried again at the next check");
                }
            }
        }
    });
}

/// One check: `Some(revision)` when this instance compacted to it.
async fn check(meta: &dyn Meta, retention: u64) -> Result<Option<i64>, MetaError> {
    let k = key(KeyKind::Maintenance, &["compaction"]);
    let current = meta.get(&k).await?;
    let retention = i64::try_from(retention).unwrap_or(i64::MAX);
    let target = current.revision.saturating_sub(retention);
    let (last, seen) = match &current.kv {
        Some(kv) => match serde_json::from_slice::<Record>(&kv.value) {
            Ok(r) => (r.revision, kv.mod_revision),
            // A record this release cannot read: start over from it (the compaction
            // itself is idempotent, and etcd refuses to go back).
            Err(_) => (0, kv.mod_revision),
        },
        None => (0, 0),
    };
    // Compact once the history is a whole retention past the last compaction, so a
    // busy Meta is compacted about once per `retention` revisions, not every check.
    if target <= 0 || target <= last.saturating_add(retention / 2) {
        return Ok(None);
    }
    let record = serde_json::to_vec(&Record {
        v: 1,
        revision: target,
    })
    .map_err(|e| MetaError::InvalidRequest(e.to_string()))?;
    let pre = if seen == 0 {
        Precondition::Absent
    } else {
        Precondition::ModRevision(seen)
    };
    match meta.put(&k, &record, pre, None).await {
        Ok(_) => {}
        // Another instance took this round.
        Err(MetaError::Conflict { .. }) => return Ok(None),
        Err(e) => return Err(e),
    }
    meta.compact(target).await?;
    Ok(Some(target))
}
