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
//!
//! By concern: this file is the task's loop (requests, log growth, timers, stop);
//! `task.rs` the task and the state it keeps, `shared.rs` what other tasks see of it;
//! `consume.rs` serves pulls, acks, nacks and extends; `commands.rs` runs the core's
//! commands, each through the file of its store: `records.rs` (the delivery records),
//! `ledger.rs` (cluster mode: the attempt ledger and checkpoints in Meta),
//! `parking.rs` (the park index), `deadletter.rs` (the dead-letter store) and
//! `read.rs` (the log).

mod commands;
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
use records::oldest_durable;
pub use shared::{Claim, Shared};
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
}
