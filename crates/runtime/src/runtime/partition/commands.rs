//! Feeding the core and running its commands, strictly in order (the protocol in
//! `meshd_dispatch`'s crate doc): each command's store call, then its result fed back
//! to the core, whose commands queue behind. Runs of the same write are joined (the
//! attempt records of a pull, a turn's updates, the extends of cluster mode, the
//! parks of one read), and [`PartitionTask::run_one`] hands each other command to the
//! method of its concern (records, ledger, parking, dead-lettering, reads).

use super::parking::parked_of;
use super::task::{Effects, PartitionTask};
use crate::runtime::clock::now_ms;
use meshd_dispatch::{Command, Input};
use meshd_stores::delivery::{DeliveryRecord, DeliveryState};
use std::collections::VecDeque;

impl PartitionTask {
    pub(super) async fn feed(&mut self, input: Input, fx: &mut Effects) {
        if self.shared.failed().is_some() {
            return;
        }
        match self.core.handle(input, now_ms()) {
            Ok(cmds) => self.execute(cmds, fx).await,
            Err(e) => {
                let key = self.key();
                tracing::warn!(subscription = %key.subscription, topic = %key.topic, partition = key.partition, error = %e, "dispatch core refused an input");
            }
        }
    }

    /// Runs commands in order; results feed the core and their commands queue behind.
    pub(super) async fn execute(&mut self, cmds: Vec<Command>, fx: &mut Effects) {
        let mut queue: VecDeque<Command> = cmds.into();
        while let Some(cmd) = queue.pop_front() {
            if self.shared.failed().is_some() {
                return;
            }
            let inputs = match cmd {
                Command::PersistAttempt { record, .. } => {
                    let mut records = vec![record];
                    while let Some(Command::PersistAttempt { .. }) = queue.front() {
                        if let Some(Command::PersistAttempt { record, .. }) = queue.pop_front() {
                            records.push(record);
                        }
                    }
                    self.persist(records).await
                }
                Command::Update(record) if self.is_extend(&record) => {
                    // Extends: their new deadlines go to the ledger (one record for
                    // the run of them), so a new owner keeps the extended leases.
                    let mut records = vec![record];
                    records.extend(self.take_updates(&mut queue, true));
                    self.record_extends(records).await
                }
                Command::Update(record) => {
                    // The updates of one turn (acks above a gap come a batch at a
                    // time): one write.
                    let mut records = vec![record];
                    records.extend(self.take_updates(&mut queue, false));
                    self.update_records(records);
                    vec![]
                }
                Command::Resolve {
                    remove,
                    advance: Some(advance),
                } => {
                    // An ack turn: the committed prefix moves, and the acks above the
                    // new gap that follow are recorded in the same write.
                    let updates = self.take_updates(&mut queue, false);
                    self.resolve_records(remove, Some(advance), updates).await
                }
                Command::Park { .. } => {
                    // The delayed (or held) events of one read: one durable write.
                    let mut parks = parked_of(cmd).into_iter().collect::<Vec<_>>();
                    while let Some(Command::Park { .. }) = queue.front() {
                        parks.extend(queue.pop_front().and_then(parked_of));
                    }
                    self.park_batch(parks).await
                }
                other => self.run_one(other, fx).await,
            };
            queue.extend(self.results(inputs));
        }
    }

    /// Feeds store results to the core; the commands they lead to.
    pub(super) fn results(&mut self, inputs: Vec<Input>) -> Vec<Command> {
        let mut cmds = Vec::new();
        for input in inputs {
            match self.core.handle(input, now_ms()) {
                Ok(more) => cmds.extend(more),
                Err(e) => {
                    let key = self.key();
                    tracing::warn!(subscription = %key.subscription, partition = key.partition, error = %e, "dispatch core refused a store result");
                }
            }
        }
        cmds
    }

    /// Whether an update is an extend of cluster mode (its new deadline goes to the
    /// ledger before the delivery store).
    fn is_extend(&self, r: &DeliveryRecord) -> bool {
        r.state == DeliveryState::InFlight && self.cluster.is_some()
    }

    /// The run of updates at the front of `queue` that are extends of cluster mode
    /// (`extends`), or that go to the delivery store alone (not `extends`).
    fn take_updates(&self, queue: &mut VecDeque<Command>, extends: bool) -> Vec<DeliveryRecord> {
        let mut records = Vec::new();
        while let Some(Command::Update(r)) = queue.front() {
            if self.is_extend(r) != extends {
                break;
            }
            if let Some(Command::Update(r)) = queue.pop_front() {
                records.push(r);
            }
        }
        records
    }

    async fn run_one(&mut self, cmd: Command, fx: &mut Effects) -> Vec<Input> {
        match cmd {
            Command::ReadLog { from, max } => self.read_log(from, max).await,
            Command::PersistAttempt { record, .. } => self.persist(vec![record]).await,
            Command::Park { .. } => self.park_batch(parked_of(cmd).into_iter().collect()).await,
            Command::ReleaseKey { key: hash } => {
                self.release_key(hash).await;
                vec![]
            }
            Command::ParkSettled { offset } => self.park_settled(offset).await,
            Command::Repark {
                offset,
                due_ms,
                attempt,
            } => self.repark(offset, due_ms, attempt).await,
            Command::ParkDeadLetter(req) => self.park_dead_letter(req, fx).await,
            Command::HandOut { pull_id, delivery } => {
                fx.handouts.push((pull_id, delivery));
                vec![]
            }
            Command::Update(record) => {
                self.update_records(vec![record]);
                vec![]
            }
            Command::Resolve { remove, advance } => {
                self.resolve_records(remove, advance, Vec::new()).await
            }
            Command::DeadLetter(req) => self.write_dead_letter(req, fx).await,
            Command::RedriveSucceeded { entry_id, offset } => {
                self.settle_redrive_succeeded(entry_id, offset).await
            }
            Command::RedriveFailed {
                entry_id,
                offset,
                reason,
                attempts,
            } => {
                self.settle_redrive_failed(entry_id, offset, reason, attempts, fx)
                    .await
            }
            Command::Reply(r) => {
                // Cluster mode: an acked delivery stays in the attempt ledger until a
                // checkpoint carries it (below `committed` or among the resolved
                // offsets above it, see `write_checkpoint`). A move before that
                // delivers it again, as at-least-once allows, with its next attempt
                // (never the same attempt and id again); an ack of its last attempt
                // lost that way ends in the dead-letter store, as an ack lost within
                // the flush interval does standalone.
                fx.replies.push(r);
                vec![]
            }
        }
    }
}
