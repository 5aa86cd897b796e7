//! The partition's delivery records (the Local `DeliveryStateStore`), written in the
//! order the core commands them. Attempt records are write-ahead: durable before
//! anything is handed out; in standalone mode a run of pulls whose commands are only
//! attempt records submits them without waiting for the fsync and is answered once
//! they are durable ([`PendingPulls`], the exception in the module doc of
//! `partition`). Resolves and updates are buffered writes submitted without waiting,
//! consecutive resolves merged into one ([`merge_resolves`]); the answers that stand
//! for them wait until the store has applied them ([`SubmittedWrite`]), and a failed
//! write fail-stops the partition.

use super::shared::{fail_partition, Shared};
use super::task::{Effects, PartitionTask, PendingPulls, PullReply, SubmittedWrite};
use crate::metrics::Metrics;
use crate::runtime::error::RuntimeError;
use crate::runtime::types::Answers;
use meshd_dispatch::{Command, Input};
use meshd_meta::Backend;
use meshd_stores::delivery::DeliveryRecord;
use meshd_stores::offsets::OffsetKey;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// Waits for the oldest pending attempt write (forever when there is none).
pub(super) async fn oldest_durable(
    pending: &mut VecDeque<PendingPulls>,
) -> Result<(), meshd_stores::delivery::DeliveryError> {
    match pending.front_mut() {
        Some(p) => meshd_stores::delivery::submitted(&mut p.write).await,
        None => std::future::pending().await,
    }
}

/// Merges consecutive `Resolve` commands (replies between them do not separate them:
/// they write nothing) into one atomic write: the removals of all, the furthest
/// advance. Every other command keeps its place, so a record's update never moves
/// past the resolve that removes it.
pub(super) fn merge_resolves(cmds: Vec<Command>) -> Vec<Command> {
    let mut out: Vec<Command> = Vec::with_capacity(cmds.len());
    let mut replies = Vec::new();
    for cmd in cmds {
        match cmd {
            Command::Reply(r) => replies.push(Command::Reply(r)),
            Command::Resolve { remove, advance } => {
                if let Some(Command::Resolve {
                    remove: prev_remove,
                    advance: prev_advance,
                }) = out.last_mut()
                {
                    prev_remove.extend(remove);
                    match (prev_advance.as_mut(), advance) {
                        (Some(p), Some(a)) if a.to > p.to => *p = a,
                        (None, Some(a)) => *prev_advance = Some(a),
                        _ => {}
                    }
                } else {
                    out.push(Command::Resolve { remove, advance });
                }
            }
            other => {
                // A write between resolves: replies so far stay before it.
                out.append(&mut replies);
                out.push(other);
            }
        }
    }
    out.append(&mut replies);
    out
}

/// Records a DeliveryStateStore write's latency; a failed one fail-stops the
/// partition.
fn delivery_write_done(
    metrics: &Metrics,
    shared: &Shared,
    key: &OffsetKey,
    op: &'static str,
    started: Instant,
    result: Result<(), meshd_stores::delivery::DeliveryError>,
) {
    metrics.write_latency("deliveries", Backend::RocksDb, op, started.elapsed());
    if let Err(e) = result {
        metrics.store_error("deliveries", Backend::RocksDb, "write_failed");
        fail_partition(shared, key, "deliveries", e.reason());
    }
}

impl PartitionTask {
    /// Submits the attempt records of a run of pulls without waiting for their fsync
    /// (see the module doc); [`persisted`](Self::persisted) answers the pulls.
    pub(super) async fn submit_attempts(&mut self, cmds: Vec<Command>, replies: Vec<PullReply>) {
        let records: Vec<DeliveryRecord> = cmds
            .into_iter()
            .filter_map(|c| match c {
                Command::PersistAttempt { record, .. } => Some(record),
                _ => None,
            })
            .collect();
        let ids = records.iter().map(|r| (r.offset, r.attempt)).collect();
        // Queued on the store before this returns: applied before any write this
        // task makes later.
        let write = self.deps.deliveries.submit_attempts(records);
        self.pending.push_back(PendingPulls {
            write,
            ids,
            replies,
            started: Instant::now(),
        });
    }

    /// A pending attempt write finished: the core learns the outcome, and the pulls it
    /// served get their hand-outs (or the failure).
    pub(super) async fn persisted(
        &mut self,
        p: PendingPulls,
        result: Result<(), meshd_stores::delivery::DeliveryError>,
    ) {
        let inputs = self.attempts_written(p.ids, p.started, &result);
        let cmds = self.results(inputs);
        let mut fx = Effects::default();
        self.execute(cmds, &mut fx).await;
        self.answer_pulls(fx, p.replies).await;
    }

    /// An attempt write finished (`started` when it was submitted): its latency and
    /// failure go where an operator looks, and each record's result goes to the core.
    fn attempts_written(
        &self,
        ids: Vec<(u64, u32)>,
        started: Instant,
        result: &Result<(), meshd_stores::delivery::DeliveryError>,
    ) -> Vec<Input> {
        self.deps.metrics.write_latency(
            "deliveries",
            Backend::RocksDb,
            "record_attempt",
            started.elapsed(),
        );
        if let Err(e) = result {
            self.deps
                .metrics
                .store_error("deliveries", Backend::RocksDb, "write_failed");
            self.fail("deliveries", e.reason());
        }
        ids.into_iter()
            .map(|(offset, attempt)| match result {
                Ok(()) => Input::AttemptPersisted { offset, attempt },
                Err(_) => Input::PersistFailed { offset, attempt },
            })
            .collect()
    }

    /// Removes the records of `remove` (offsets of this partition), advances the
    /// committed offset and writes `updates`, in one atomic write.
    pub(super) async fn resolve_records(
        &mut self,
        remove: Vec<u64>,
        advance: Option<meshd_stores::delivery::OffsetAdvance>,
        updates: Vec<DeliveryRecord>,
    ) -> Vec<Input> {
        let key = self.key();
        let remove = remove.into_iter().map(|o| (key.clone(), o)).collect();
        if advance.is_some() {
            self.submit_delivery_write("resolve", remove, advance, updates);
            return vec![];
        }
        // Without an advance it removes the record of a settled redrive: made durable
        // at once, or a power cut would bring back the record and repeat a settlement
        // Meta has already applied (an ack's resolve may wait for the flusher:
        // repeating an ack costs a redelivery at most).
        let started = Instant::now();
        let r = self
            .deps
            .deliveries
            .resolve_and_update(remove, None, updates)
            .await;
        let ok = r.is_ok();
        self.delivery_write_done("resolve", started, r);
        if ok {
            self.flush_deliveries("flush_redrive_settled").await;
        }
        vec![]
    }

    /// Writes delivery record updates (one atomic write for all of them).
    pub(super) fn update_records(&mut self, records: Vec<DeliveryRecord>) {
        self.submit_delivery_write("update", Vec::new(), None, records);
    }

    /// Submits a buffered delivery write (durable within the flush interval) without
    /// waiting for it: the store applies it in order, before any later write and any
    /// later flush, and this task goes on with its next requests (waiting for each,
    /// a busy partition spent half its time on these round trips). Its latency and
    /// a failure are recorded when the store has applied it; a failure fail-stops the
    /// store, so every later write (an attempt before a hand-out among them) fails
    /// too, and this partition stops dispatching as with a write it waited for.
    fn submit_delivery_write(
        &mut self,
        op: &'static str,
        remove: Vec<(OffsetKey, u64)>,
        advance: Option<meshd_stores::delivery::OffsetAdvance>,
        updates: Vec<DeliveryRecord>,
    ) {
        let started = Instant::now();
        let metrics = self.deps.metrics.clone();
        let shared = self.shared.clone();
        let key = self.key().clone();
        let applied = Arc::new(SubmittedWrite::default());
        self.submitted = Some(applied.clone());
        self.deps.deliveries.submit_resolve_and_update(
            remove,
            advance,
            updates,
            Box::new(move |r| {
                delivery_write_done(&metrics, &shared, &key, op, started, r);
                applied.done();
            }),
        );
    }

    /// Sends an ack's, nack's or extend's answer once the delivery writes submitted
    /// so far are applied: a store that failed on one of them answers the failure,
    /// never a success the disk did not take (an ack on a full disk is not
    /// acknowledged).
    pub(super) fn reply_after_writes(
        &self,
        reply: oneshot::Sender<Result<Answers, RuntimeError>>,
        answer: Result<Answers, RuntimeError>,
    ) {
        let shared = self.shared.clone();
        let send = move || {
            let answer = match shared.failed() {
                Some(e) => Err(RuntimeError::StoreFailed(e)),
                None => answer,
            };
            let _ = reply.send(answer);
        };
        match &self.submitted {
            Some(applied) => applied.then(Box::new(send)),
            None => send(),
        }
    }

    pub(super) fn fail(&self, store: &'static str, error: String) {
        fail_partition(&self.shared, self.key(), store, error);
    }

    /// Write-ahead: the attempt records of one pull, durable (they share fsyncs)
    /// before any of them is handed out.
    pub(super) async fn persist(&mut self, records: Vec<DeliveryRecord>) -> Vec<Input> {
        if !self.record_in_ledger(&records).await || !self.record_unparked(&records).await {
            return records
                .iter()
                .map(|r| Input::PersistFailed {
                    offset: r.offset,
                    attempt: r.attempt,
                })
                .collect();
        }
        // One atomic write (and one fsync wait) for the whole pull: the profile of
        // a batched pull showed one blocking task, write and wake-up per record.
        let ids: Vec<(u64, u32)> = records.iter().map(|r| (r.offset, r.attempt)).collect();
        let started = Instant::now();
        let result = self.deps.deliveries.record_attempts(records).await;
        self.attempts_written(ids, started, &result)
    }

    /// Makes the buffered delivery writes (an ack's resolve, a redrive's state) durable
    /// around the Meta writes that settle a redrive: a power cut must not bring back a
    /// local record of a redrive that disagrees with its dead-letter entry in Meta.
    /// `false`: the flush failed (the partition has fail-stopped).
    pub(super) async fn flush_deliveries(&self, op: &'static str) -> bool {
        let started = Instant::now();
        let r = self.deps.deliveries.flush().await;
        let ok = r.is_ok();
        self.delivery_write_done(op, started, r);
        ok
    }

    /// Records a DeliveryStateStore write's latency; a failed one fail-stops the
    /// partition.
    fn delivery_write_done(
        &self,
        op: &'static str,
        started: Instant,
        result: Result<(), meshd_stores::delivery::DeliveryError>,
    ) {
        delivery_write_done(
            &self.deps.metrics,
            &self.shared,
            self.key(),
            op,
            started,
            result,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshd_dispatch::{AckOutcome, DeliveryRecord, DeliveryState, OffsetAdvance, Reply};

    fn key() -> OffsetKey {
        OffsetKey {
            subscription: "s".into(),
            incarnation: 1,
            topic: "t".into(),
            partition: 0,
        }
    }

    fn resolve(remove: Vec<u64>, to: Option<u64>) -> Command {
        Command::Resolve {
            remove,
            advance: to.map(|to| OffsetAdvance { key: key(), to }),
        }
    }

    fn acked(id: &str) -> Command {
        Command::Reply(Reply::Ack {
            delivery_id: id.into(),
            outcome: AckOutcome::Acked,
        })
    }

    fn update(offset: u64) -> Command {
        Command::Update(DeliveryRecord {
            key: key(),
            offset,
            attempt: 1,
            delivery_id: format!("0-{offset}-1"),
            deadline_ms: 0,
            last_reason: None,
            first_delivered_at_ms: 0,
            state: DeliveryState::AckedAwaitingCommit,
            owner_epoch: 0,
            session: None,
        })
    }

    #[test]
    fn consecutive_resolves_become_one_with_every_removal_and_the_furthest_advance() {
        let merged = merge_resolves(vec![
            resolve(vec![1], Some(2)),
            acked("a"),
            resolve(vec![2, 3], Some(4)),
            acked("b"),
            resolve(vec![5], None),
        ]);
        assert_eq!(
            merged,
            vec![resolve(vec![1, 2, 3, 5], Some(4)), acked("a"), acked("b")]
        );
    }

    #[test]
    fn an_advance_never_goes_back_when_merged() {
        let merged = merge_resolves(vec![resolve(vec![], Some(9)), resolve(vec![1], Some(4))]);
        assert_eq!(merged, vec![resolve(vec![1], Some(9))]);
        let merged = merge_resolves(vec![resolve(vec![], None), resolve(vec![1], Some(4))]);
        assert_eq!(merged, vec![resolve(vec![1], Some(4))]);
    }

    #[test]
    fn a_write_between_resolves_keeps_its_place() {
        // The update of offset 7 must stay between the two resolves: moving the
        // second resolve before it would let the update rewrite a removed record.
        let cmds = vec![
            resolve(vec![1], Some(2)),
            acked("a"),
            update(7),
            resolve(vec![7], Some(8)),
        ];
        let merged = merge_resolves(cmds.clone());
        assert_eq!(merged, cmds);
    }
}
