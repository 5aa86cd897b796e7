//! Cluster mode: what a partition task writes to Meta under its owner epoch, fenced.
//! The attempts of every pull batch (and the deadlines of extends) go to the attempt
//! ledger before anything is handed out, so a new owner continues the counts and
//! keeps the leases; the committed offset, with the offsets acked above it, is
//! checkpointed every `--checkpoint-ms` (and before a key is released), after which
//! the ledger's records that hold nothing current are pruned. A fenced or
//! indeterminate write ends the task (`PartitionCluster::lose`). Outside cluster mode
//! there is no ledger and no checkpoint in Meta: those writes are skipped.

use super::task::PartitionTask;
use crate::runtime::clock::now_ms;
use meshd_dispatch::Input;
use meshd_stores::attempts::{AttemptError, LedgerEntry, RECORD_FRESH_ENTRIES};
use meshd_stores::delivery::DeliveryRecord;
use meshd_stores::failure::StoreFailure;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// What the attempt ledger records of a delivery record.
fn ledger_entry(r: &DeliveryRecord) -> LedgerEntry {
    LedgerEntry {
        offset: r.offset,
        attempt: r.attempt,
        deadline_ms: r.deadline_ms,
        session: r.session.clone(),
    }
}

impl PartitionTask {
    /// Cluster mode: writes the committed offset to Meta, fenced by the owner epoch,
    /// when it moved since the last checkpoint.
    pub(super) async fn checkpoint(&mut self) {
        self.write_checkpoint(false).await;
    }

    /// Cluster mode: writes the committed offset and the acked offsets above it to
    /// Meta (fenced). `force`: also when the committed offset has not moved (an ack
    /// above a gap must be durable there before the next event of its key goes out).
    /// `true`: the checkpoint in Meta is current (always, standalone).
    pub(super) async fn write_checkpoint(&mut self, force: bool) -> bool {
        let committed = self.core.committed();
        let key = self.key().clone();
        let Some(c) = self.cluster.as_mut() else {
            return true;
        };
        // The acked offsets above a gap go with it (a new owner skips them).
        let resolved = self.core.resolved_above();
        if committed <= c.checkpointed && resolved == c.checkpointed_resolved && !force {
            // Nothing new: the checkpoint in Meta is current.
            self.shared
                .checkpointed_at_ms
                .store(now_ms(), Ordering::Release);
            if c.ledger_state.garbage() > 0 {
                self.write_ledger(Vec::new(), "prune").await;
            }
            return true;
        }
        match self
            .deps
            .offsets
            .checkpoint_with(self.deps.meta.as_ref(), &c.owner, &key, &resolved)
            .await
        {
            Ok(()) => {
                c.checkpointed = committed;
                // Below a durable checkpoint, and at the resolved offsets it carries,
                // every entry is resolved for good (acked and dead-lettered ones
                // stayed in the ledger until now): their records can go.
                c.ledger_state.checkpointed(committed);
                c.ledger_state.forget(resolved.iter().copied());
                c.checkpointed_resolved = resolved;
                self.shared
                    .checkpointed_at_ms
                    .store(now_ms(), Ordering::Release);
                if c.ledger_state.garbage() > 0 {
                    self.write_ledger(Vec::new(), "prune").await;
                }
                true
            }
            Err(e) => {
                let kind = match &e {
                    meshd_stores::offsets::OffsetError::Meta(m) => m.kind(),
                    _ => "failed",
                };
                self.deps
                    .metrics
                    .store_error("checkpoints", self.deps.meta_backend, kind);
                if matches!(kind, "fenced" | "indeterminate") {
                    c.lose(&format!("offset checkpoint: {e}"));
                } else {
                    tracing::warn!(store = "checkpoints", backend = %self.deps.meta_backend, subscription = %key.subscription, topic = %key.topic, partition = key.partition, error = %e, "offset checkpoint failed; retried at the next interval");
                }
                false
            }
        }
    }

    /// Extends in cluster mode: the ledger first (a failure other than a fence is
    /// logged and counted: the lease holds here, a move before the next record would
    /// end it at its earlier deadline), then the local records.
    pub(super) async fn record_extends(&mut self, records: Vec<DeliveryRecord>) -> Vec<Input> {
        let entries = records.iter().map(ledger_entry).collect();
        self.write_ledger(entries, "extend").await;
        self.update_records(records);
        vec![]
    }

    /// Cluster mode: the attempts of this pull written to the attempt ledger in Meta,
    /// fenced by the owner epoch, before anything is recorded locally or handed out,
    /// so a new owner continues the counts and keeps the leases. `false`: not written
    /// (nothing may be handed out; the core tries again later).
    pub(super) async fn record_in_ledger(&mut self, records: &[DeliveryRecord]) -> bool {
        // Redrives (below the committed offset) are not inherited by a new owner:
        // their dead-letter entry goes back to `dead` instead.
        let committed = self.core.committed();
        let entries: Vec<LedgerEntry> = records
            .iter()
            .filter(|r| r.offset >= committed)
            .map(ledger_entry)
            .collect();
        self.write_ledger(entries, "record").await
    }

    /// Cluster mode: writes `entries` to the attempt ledger (one fenced record per
    /// [`RECORD_FRESH_ENTRIES`], each carrying the stragglers of sparse records and
    /// pruning what earlier changes left empty). `true`
    /// outside cluster mode and when there is nothing to write.
    async fn write_ledger(&mut self, entries: Vec<LedgerEntry>, op: &'static str) -> bool {
        let key = self.key().clone();
        let Some(c) = self.cluster.as_mut() else {
            return true;
        };
        let mut chunks: Vec<Vec<LedgerEntry>> = entries
            .chunks(RECORD_FRESH_ENTRIES)
            .map(|c| c.to_vec())
            .collect();
        if chunks.is_empty() {
            // Nothing to record: only prune (a checkpoint made records garbage).
            chunks.push(Vec::new());
        }
        for chunk in chunks {
            let Some(mut write) = c.ledger_state.stage(chunk) else {
                continue;
            };
            write.with_owner_epoch = c.directory.borrow().ledger_epoch_allowed();
            let started = Instant::now();
            let result = c.ledger.write(&key, &c.owner, &write).await;
            self.deps.metrics.write_latency(
                "attempts",
                self.deps.meta_backend,
                op,
                started.elapsed(),
            );
            match result {
                Ok(()) => {
                    self.deps.metrics.ledger_write(
                        write.record.as_ref().map_or(0, |(_, e)| e.len()),
                        write.prune.len(),
                    );
                    c.ledger_state.applied(write);
                }
                Err(e) => {
                    self.deps
                        .metrics
                        .store_error("attempts", self.deps.meta_backend, e.kind());
                    if matches!(
                        e,
                        AttemptError::Fenced | AttemptError::Store(StoreFailure::Indeterminate(_))
                    ) {
                        // Fenced: another owner. Indeterminate: this owner no longer
                        // knows what Meta holds. Either way it stops and the partition
                        // is started again from Meta (if still owned) before it acts.
                        c.lose(&format!("attempt ledger write: {e}"));
                    } else {
                        tracing::warn!(store = "attempts", backend = %self.deps.meta_backend, subscription = %key.subscription, topic = %key.topic, partition = key.partition, op, error = %e, "attempt ledger write failed; nothing handed out, retried");
                    }
                    return false;
                }
            }
        }
        self.shared
            .ledger_records
            .store(c.ledger_state.records(), Ordering::Release);
        true
    }
}
