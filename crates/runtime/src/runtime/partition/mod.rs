//! The async shell around one [`PartitionCore`]: one task per (subscription
//! incarnation, partition) that owns the core, feeds it requests, log growth and time,
//! and executes its commands against the stores **in order** (the protocol in
//! `meshd_dispatch`'s crate doc). Requests arrive over a channel, so every input of one
//! partition is serialised without locks.
//!
//! One exception to "one write after the other", for throughput: in standalone mode a
//! run of pulls whose commands are only attempt records does not wait for their fsync.
//! The write is submitted (the Local store applies writes in submission order, and an
//! fsync covers every write applied before it), the task goes on with acks and further
//! pulls, and the pulls are answered once their records are durable: still write-ahead
//! (nothing is handed out before its attempt is on disk), while the next pulls' records
//! join the next fsync instead of waiting for this one. Cluster mode keeps the strict
//! order (its ledger write in Meta comes first).

mod consume;
mod deadletter;
mod ledger;
mod parking;
mod read;
mod records;
mod shared;
mod task;

use super::clock::now_ms;
use super::error::RuntimeError;
use super::types::Outcome;
use meshd_dispatch::{Command, Input, Reply};
use meshd_stores::delivery::{DeliveryRecord, DeliveryState};
use parking::parked_of;
use records::oldest_durable;
pub use shared::{Claim, Shared};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::{Duration, Instant};
use task::Effects;
pub use task::{Msg, ParkState, PartitionCluster, PartitionTask, PendingPulls, SubmittedWrite};
use tokio::sync::{oneshot, watch};

/// How often the shared stats (metrics gauges) are recomputed.
const STATS_EVERY: Duration = Duration::from_millis(250);

/// How long a task waits before it takes a new append receiver when the log closed
/// the old one (its topic was deleted): long enough that a topic deleted over and over
/// never makes the task spin, short enough that appends to a re-created topic are
/// noticed promptly (a pull looks at the log end itself anyway).
const RESUBSCRIBE_AFTER: Duration = Duration::from_millis(250);

/// Requests served together at most (pulls or acks queued while the task was busy).
const BATCH_MAX: usize = 64;

impl PartitionTask {
    pub async fn run(mut self) {
        self.serve().await;
        // However it ended (a stop, a fence, its channel closed), the writes it
        // submitted without waiting are applied before the task is gone: a new task
        // for the partition (its adoption in cluster mode) or the drop of its
        // subscription comes after them.
        self.wait_submitted().await;
    }

    /// Returns once the buffered writes this task submitted without waiting are
    /// applied (or failed).
    async fn wait_submitted(&mut self) {
        if let Some(applied) = self.submitted.take() {
            let (tx, rx) = oneshot::channel();
            applied.then(Box::new(move || {
                let _ = tx.send(());
            }));
            // Only the store's answer holds it now: dropped unanswered (the store
            // went away with the write), the sender goes with it.
            drop(applied);
            let _ = rx.await;
        }
    }

    async fn serve(&mut self) {
        // Appends to this partition only (taken before the first look at the log end,
        // so no append is missed in between).
        let mut appends = self.subscribe_appends();
        // Set while the log's sender is closed: when to take a new receiver.
        let mut resubscribe_at: Option<tokio::time::Instant> = None;
        let mut fx = Effects::default();
        let initial = std::mem::take(&mut self.initial);
        self.execute(initial, &mut fx).await;
        self.refresh_log_end(&mut fx).await;
        self.publish();
        let checkpoint_every = self
            .cluster
            .as_ref()
            .map(|c| c.checkpoint_every)
            .unwrap_or(Duration::from_secs(3600));
        let mut checkpoints = tokio::time::interval(checkpoint_every);
        checkpoints.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if self.cluster.as_ref().is_some_and(|c| c.is_lost()) {
                // Fenced: another instance owns the partition now. Nothing more is
                // done under this epoch; the runtime re-acquires before acting again.
                return;
            }
            self.refresh_parking();
            let wake = self.core.next_wakeup();
            let sleep = async {
                match wake {
                    Some(at) => {
                        let now = now_ms();
                        let d = Duration::from_millis(at.saturating_sub(now));
                        tokio::time::sleep_until(tokio::time::Instant::now() + d).await
                    }
                    None => std::future::pending().await,
                }
            };
            // Stats skipped by the throttle are refreshed when it allows.
            let stats_due = async {
                match (self.stats_dirty, self.stats_at) {
                    (true, Some(at)) => tokio::time::sleep_until((at + STATS_EVERY).into()).await,
                    _ => std::future::pending().await,
                }
            };
            let mut fx = Effects::default();
            tokio::select! {
                _ = stats_due => {}
                done = oldest_durable(&mut self.pending) => {
                    if let Some(p) = self.pending.pop_front() {
                        self.persisted(p, done).await;
                    }
                }
                msg = self.rx.recv() => match msg {
                    None => return,
                    Some(Msg::Stop { reply }) => {
                        self.drain_pending().await;
                        let _ = reply.send(self.core.resolved_above());
                        return;
                    }
                    Some(msg) => {
                        // Requests that queued up while this task was busy are taken
                        // together: consecutive pulls share one attempt write and
                        // consecutive acks one resolve (one fsync each instead of one
                        // per request, which serialised a busy partition on fsyncs).
                        let mut batch = vec![msg];
                        while batch.len() < BATCH_MAX {
                            match self.rx.try_recv() {
                                Ok(m) => batch.push(m),
                                Err(_) => break,
                            }
                        }
                        if self.requests(batch).await {
                            return;
                        }
                    }
                },
                changed = appends.changed(), if resubscribe_at.is_none() => {
                    if changed.is_err() {
                        // The log dropped the sender (the topic was deleted). This
                        // task may still be asked for; listen again after a pause.
                        resubscribe_at = Some(tokio::time::Instant::now() + RESUBSCRIBE_AFTER);
                        continue;
                    }
                    self.refresh_log_end(&mut fx).await;
                }
                _ = async {
                    match resubscribe_at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {
                    resubscribe_at = None;
                    appends = self.subscribe_appends();
                    self.refresh_log_end(&mut fx).await;
                }
                _ = sleep => self.feed(Input::Tick, &mut fx).await,
                _ = async {
                    match self.park.look_at {
                        Some(at) => {
                            let d = Duration::from_millis(at.saturating_sub(now_ms()));
                            tokio::time::sleep(d).await
                        }
                        None => std::future::pending().await,
                    }
                } => self.unpark_due(&mut fx).await,
                _ = checkpoints.tick(), if self.cluster.is_some() => self.checkpoint().await,
            }
            self.publish();
        }
    }

    fn subscribe_appends(&self) -> watch::Receiver<u64> {
        let key = self.key();
        self.deps.log.appends(&key.topic, key.partition)
    }

    /// Shares `ready` and the stats, and wakes long polls when there is work.
    /// Shares what other tasks read without asking (cheap: no walk of the window).
    fn sync_shared(&self) -> usize {
        let ready = if self.shared.failed().is_some() {
            0
        } else {
            self.core.ready(now_ms())
        };
        self.shared.ready.store(ready, Ordering::Release);
        self.shared
            .committed
            .store(self.core.committed(), Ordering::Release);
        ready
    }

    fn publish(&mut self) {
        let ready = self.sync_shared();
        self.stats_dirty = true;
        if self.stats_at.is_none_or(|t| t.elapsed() >= STATS_EVERY) {
            self.stats_at = Some(Instant::now());
            self.stats_dirty = false;
            *self
                .shared
                .stats
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = self.core.stats();
        }
        if ready > 0 {
            self.notify.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    fn failed_error(&self) -> Option<RuntimeError> {
        self.shared.failed().map(RuntimeError::StoreFailed)
    }

    async fn request(&mut self, msg: Msg) {
        match msg {
            Msg::Pull {
                budget,
                session,
                reply,
            } => self.pulls(vec![(budget, session, reply)]).await,
            Msg::Release { ids, reply } => {
                let released = match self.core.handle(Input::Release(ids), now_ms()) {
                    Ok(cmds) => cmds
                        .iter()
                        .filter(|c| {
                            matches!(c, Command::Reply(Reply::Release { released: true, .. }))
                        })
                        .count(),
                    Err(e) => {
                        let key = self.key();
                        tracing::warn!(subscription = %key.subscription, topic = %key.topic, partition = key.partition, error = %e, "dispatch core refused a release");
                        0
                    }
                };
                self.sync_shared();
                let _ = reply.send(released);
            }
            Msg::Ack { ids, reply } => self.acks(vec![(ids, reply)]).await,
            Msg::Nack {
                ids,
                reason,
                delay_ms,
                reply,
            } => {
                let answer = self
                    .resolve_ids(ids, Outcome::Unknown, |deliveries| Input::Nack {
                        deliveries,
                        reason,
                        delay_ms,
                    })
                    .await;
                self.reply_after_writes(reply, answer);
            }
            Msg::Extend {
                ids,
                ack_timeout_ms,
                reply,
            } => {
                let answer = self
                    .resolve_ids(ids, Outcome::Unknown, |deliveries| Input::Extend {
                        deliveries,
                        ack_timeout_ms,
                    })
                    .await;
                self.reply_after_writes(reply, answer);
            }
            Msg::Redrive {
                entry_id,
                offset,
                reply,
            } => {
                if let Some(e) = self.failed_error() {
                    let _ = reply.send(Err(e));
                    return;
                }
                if self.core.config().ordered {
                    match self.redrive_behind_key(&entry_id, offset).await {
                        Ok(true) => {
                            let _ = reply.send(Ok(()));
                            return;
                        }
                        Ok(false) => {}
                        Err(e) => {
                            let _ = reply.send(Err(e));
                            return;
                        }
                    }
                }
                let input = Input::Redrive { entry_id, offset };
                let result = match self.core.handle(input, now_ms()) {
                    Ok(cmds) => {
                        let mut fx = Effects::default();
                        self.execute(cmds, &mut fx).await;
                        Ok(())
                    }
                    Err(e @ meshd_dispatch::CoreError::RedriveBacklogFull { .. }) => {
                        Err(RuntimeError::Core(e.to_string()))
                    }
                    Err(e) => Err(RuntimeError::Conflict(e.to_string())),
                };
                let _ = reply.send(result);
            }
            Msg::Stop { reply } => {
                self.drain_pending().await;
                let _ = reply.send(self.core.resolved_above());
            }
        }
    }

    /// Answers every pending pull (waiting for its attempt write): before a `Stop`
    /// is answered, so a stopped partition leaves no pull unanswered.
    async fn drain_pending(&mut self) {
        while let Some(mut p) = self.pending.pop_front() {
            let done = meshd_stores::delivery::submitted(&mut p.write).await;
            self.persisted(p, done).await;
        }
        self.wait_submitted().await;
    }

    /// Requests taken from the queue together, in order; runs of pulls and of acks
    /// are served as one. `true`: a `Stop` was among them (answered after the
    /// requests before it).
    async fn requests(&mut self, batch: Vec<Msg>) -> bool {
        let mut pulls = Vec::new();
        let mut acks = Vec::new();
        for msg in batch {
            match msg {
                Msg::Pull {
                    budget,
                    session,
                    reply,
                } if acks.is_empty() => pulls.push((budget, session, reply)),
                Msg::Ack { ids, reply } if pulls.is_empty() => acks.push((ids, reply)),
                other => {
                    self.pulls(std::mem::take(&mut pulls)).await;
                    self.acks(std::mem::take(&mut acks)).await;
                    match other {
                        Msg::Pull {
                            budget,
                            session,
                            reply,
                        } => pulls.push((budget, session, reply)),
                        Msg::Ack { ids, reply } => acks.push((ids, reply)),
                        Msg::Stop { reply } => {
                            self.drain_pending().await;
                            let _ = reply.send(self.core.resolved_above());
                            return true;
                        }
                        other => self.request(other).await,
                    }
                }
            }
        }
        self.pulls(pulls).await;
        self.acks(acks).await;
        false
    }

    async fn refresh_log_end(&mut self, fx: &mut Effects) {
        let key = self.key().clone();
        match self.deps.log.bounds(&key.topic, key.partition).await {
            Ok(b) if b.end > self.shared.log_end.load(Ordering::Acquire) => {
                self.feed(Input::LogEnd(b.end), fx).await;
                self.shared.log_end.store(b.end, Ordering::Release);
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(store = "log", backend = %self.deps.log_backend, topic = %key.topic, partition = key.partition, error = %e, "reading partition bounds failed");
            }
        }
    }

    async fn feed(&mut self, input: Input, fx: &mut Effects) {
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
    async fn execute(&mut self, cmds: Vec<Command>, fx: &mut Effects) {
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
    fn results(&mut self, inputs: Vec<Input>) -> Vec<Command> {
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
