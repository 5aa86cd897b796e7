//! Dead-lettering: the entry of a delivery that failed `max_attempts` times, written
//! with its body (read from the log) and fenced by the log's ownership (standalone)
//! or the partition's owner key (cluster mode); and the settlement of redrives in the
//! dead-letter store, after the local delivery writes are durable. A Meta failure
//! holds the event (`dead_lettering`) and the core retries.

use super::task::{Effects, PartitionTask};
use crate::metrics::{Counted, SubCounters};
use meshd_dispatch::Input;
use meshd_stores::deadletters::{DeadLetterError, NewDeadLetter};
use meshd_stores::time::Timestamp;
use std::sync::PoisonError;
use std::time::Instant;

impl PartitionTask {
    /// `Command::DeadLetter`: the entry written (see [`Self::dead_letter`]), then
    /// `DeadLettered`; while it cannot be, the event is held (`DeadLetterUnavailable`)
    /// and the core retries.
    pub(super) async fn write_dead_letter(
        &self,
        req: meshd_dispatch::DeadLetterRequest,
        fx: &mut Effects,
    ) -> Vec<Input> {
        let key = self.key().clone();
        let offset = req.offset;
        match self.dead_letter(req).await {
            Ok(created) => {
                if created {
                    self.counters
                        .count(&self.part_counters, Counted::DeadLettered);
                }
                fx.dead_lettered.insert(offset);
                vec![Input::DeadLettered { offset }]
            }
            Err(reason) => {
                tracing::warn!(store = "deadletters", backend = %self.deps.meta_backend, subscription = %key.subscription, topic = %key.topic, partition = key.partition, offset, error = %reason, "dead-letter write failed; the event is held and retried");
                vec![Input::DeadLetterUnavailable { offset }]
            }
        }
    }

    /// `Command::RedriveSucceeded`: the redriven event was acked; its entry is settled
    /// in the dead-letter store (after the delivery writes are made durable).
    pub(super) async fn settle_redrive_succeeded(
        &self,
        entry_id: String,
        offset: u64,
    ) -> Vec<Input> {
        if !self.flush_deliveries("flush_before_redrive").await {
            return vec![Input::RedriveUnavailable { offset }];
        }
        match self.deps.deadletters.redrive_succeeded(&entry_id).await {
            Ok(()) | Err(DeadLetterError::NotFound { .. }) => {
                vec![Input::RedriveSettled { offset }]
            }
            Err(e) => {
                self.meta_failure("redrive_succeeded", &entry_id, &e);
                vec![Input::RedriveUnavailable { offset }]
            }
        }
    }

    /// `Command::RedriveFailed`: the redriven event failed again; its entry goes back
    /// to `dead` (after the delivery writes are made durable).
    pub(super) async fn settle_redrive_failed(
        &self,
        entry_id: String,
        offset: u64,
        reason: String,
        attempts: u32,
        fx: &mut Effects,
    ) -> Vec<Input> {
        if !self.flush_deliveries("flush_before_redrive").await {
            return vec![Input::RedriveUnavailable { offset }];
        }
        match self
            .deps
            .deadletters
            .redrive_failed(&entry_id, &reason, attempts)
            .await
        {
            Ok(_) => {
                fx.dead_lettered.insert(offset);
                self.counters
                    .count(&self.part_counters, Counted::DeadLettered);
                vec![Input::RedriveSettled { offset }]
            }
            Err(DeadLetterError::NotFound { .. }) => vec![Input::RedriveSettled { offset }],
            Err(e) => {
                self.meta_failure("redrive_failed", &entry_id, &e);
                vec![Input::RedriveUnavailable { offset }]
            }
        }
    }

    pub(super) fn meta_failure(&self, op: &str, entry_id: &str, e: &DeadLetterError) {
        self.deps
            .metrics
            .store_error("deadletters", self.deps.meta_backend, e.kind());
        tracing::warn!(store = "deadletters", backend = %self.deps.meta_backend, op, entry = entry_id, error = %e, "dead-letter write failed; retried");
    }

    /// Writes the dead-letter entry (body first, then the fenced entry), the body read
    /// from the log. `Ok(created)`.
    async fn dead_letter(&self, req: meshd_dispatch::DeadLetterRequest) -> Result<bool, String> {
        let body = match self.read_event(req.offset).await {
            Ok(b) => b,
            Err(e) => {
                SubCounters::add(&self.counters.read_failures, 1);
                return Err(format!("reading the event body: {e}"));
            }
        };
        self.dead_letter_with(req, body).await
    }

    /// Writes the dead-letter entry of `req` with `body`. `Ok(created)`.
    pub(super) async fn dead_letter_with(
        &self,
        req: meshd_dispatch::DeadLetterRequest,
        body: Vec<u8>,
    ) -> Result<bool, String> {
        let key = self.key().clone();
        let owner = self
            .owner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(owner) = owner else {
            return Err("this instance does not hold its log's ownership in Meta yet".into());
        };
        let first = i64::try_from(req.first_attempt_at_ms)
            .ok()
            .and_then(Timestamp::from_millis)
            .unwrap_or_else(Timestamp::now);
        let new = NewDeadLetter {
            subscription: key.subscription.clone(),
            subscription_incarnation: key.incarnation,
            topic: key.topic.clone(),
            partition: key.partition,
            offset: req.offset,
            attempts: req.attempts,
            reason: req.reason,
            first_attempt_at: first,
            instance: self.deps.instance_id.clone(),
        };
        let started = Instant::now();
        let r = self.deps.deadletters.dead_letter(new, &body, &owner).await;
        self.deps.metrics.write_latency(
            "deadletters",
            self.deps.meta_backend,
            "dead_letter",
            started.elapsed(),
        );
        match r {
            Ok(d) => Ok(d.created),
            Err(e) => {
                self.deps
                    .metrics
                    .store_error("deadletters", self.deps.meta_backend, e.kind());
                Err(e.to_string())
            }
        }
    }
}
