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

mod deadletter;
mod ledger;
mod parking;
mod read;
mod records;
mod shared;
mod task;

use super::clock::now_ms;
use super::error::RuntimeError;
use super::types::{offset_of, Answers, Handed, Outcome};
use crate::metrics::Counted;
use meshd_dispatch::{
    AckOutcome, Command, DeliveryRef, ExtendOutcome, Input, NackOutcome, PullId, Reply,
    SessionCheck,
};
use meshd_stores::delivery::{DeliveryRecord, DeliveryState};
use meshd_stores::failure::StoreFailure;
use meshd_stores::sessions::SessionError;
use parking::parked_of;
use records::{merge_resolves, oldest_durable};
pub use shared::{Claim, Shared};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::PoisonError;
use std::time::{Duration, Instant};
use task::{AckRequest, Effects, PullReply, PullRequest};
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

/// The delivery id a reply is about.
fn reply_id(r: &Reply) -> &str {
    match r {
        Reply::Ack { delivery_id, .. }
        | Reply::Nack { delivery_id, .. }
        | Reply::Extend { delivery_id, .. }
        | Reply::Release { delivery_id, .. } => delivery_id,
    }
}

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

    /// Pulls served together: the core picks each one's events in turn, their
    /// attempt records go to disk in one atomic write, and each pull gets its own
    /// hand-outs once that write is durable.
    async fn pulls(&mut self, pulls: Vec<PullRequest>) {
        if pulls.is_empty() {
            return;
        }
        if let Some(e) = self.failed_error() {
            for (_, _, reply) in pulls {
                let _ = reply.send(Err(e.clone()));
            }
            return;
        }
        let mut fx = Effects::default();
        // Events the log made durable before these pulls are served by them, even
        // when the append notification has not reached this task yet.
        self.refresh_log_end(&mut fx).await;
        let mut cmds = Vec::new();
        let mut replies = Vec::with_capacity(pulls.len());
        for (budget, session, reply) in pulls {
            let pull_id = PullId(self.next_pull);
            self.next_pull += 1;
            replies.push((pull_id, reply));
            if self.shared.failed().is_some() {
                continue;
            }
            let input = Input::Pull {
                pull_id,
                max_events: budget.max_events,
                max_bytes: budget.max_bytes as u64,
                at_least_one: budget.at_least_one,
                session,
            };
            match self.core.handle(input, now_ms()) {
                Ok(more) => cmds.extend(more),
                Err(e) => {
                    let key = self.key();
                    tracing::warn!(subscription = %key.subscription, topic = %key.topic, partition = key.partition, error = %e, "dispatch core refused a pull");
                }
            }
        }
        if self.cluster.is_none()
            && !cmds.is_empty()
            && cmds
                .iter()
                .all(|c| matches!(c, Command::PersistAttempt { .. }))
        {
            self.submit_attempts(cmds, replies).await;
            return;
        }
        self.execute(cmds, &mut fx).await;
        self.answer_pulls(fx, replies).await;
    }

    /// Answers each pull with its hand-outs in `fx` (bodies read here), or with the
    /// store failure when its attempt records could not be made durable.
    async fn answer_pulls(&mut self, fx: Effects, replies: Vec<PullReply>) {
        let of_pull: HashMap<String, PullId> = fx
            .handouts
            .iter()
            .map(|(p, d)| (d.delivery_id.clone(), *p))
            .collect();
        let handed = self
            .bodies(fx.handouts.into_iter().map(|(_, d)| d).collect())
            .await;
        self.sync_shared();
        let mut per_pull: HashMap<PullId, Vec<Handed>> = HashMap::new();
        for h in handed {
            if let Some(p) = of_pull.get(&h.delivery_id) {
                per_pull.entry(*p).or_default().push(h);
            }
        }
        let failed = self.failed_error();
        for (pull_id, reply) in replies {
            let handed = per_pull.remove(&pull_id).unwrap_or_default();
            // A pull whose attempt records could not be made durable hands nothing
            // out: it says why instead of answering "nothing there".
            let answer = match &failed {
                Some(e) if handed.is_empty() => Err(e.clone()),
                _ => Ok(handed),
            };
            let _ = reply.send(answer);
        }
    }

    /// Acks served together: every one's session checks, then the core, then their
    /// store writes in order, consecutive resolves merged into one atomic write; each
    /// ack is answered per id once those writes are done.
    async fn acks(&mut self, acks: Vec<AckRequest>) {
        if acks.is_empty() {
            return;
        }
        let mut cmds = Vec::new();
        let mut waiting = Vec::with_capacity(acks.len());
        // Which request each fed id answers (an id acked twice: in order).
        let mut of_id: HashMap<String, VecDeque<usize>> = HashMap::new();
        for (i, (ids, reply)) in acks.into_iter().enumerate() {
            let (refs, answers) = self.checked(ids, Outcome::Failed).await;
            if !refs.is_empty() && self.shared.failed().is_none() {
                for r in &refs {
                    of_id.entry(r.delivery_id.clone()).or_default().push_back(i);
                }
                match self.core.handle(Input::Ack(refs), now_ms()) {
                    Ok(more) => cmds.extend(more),
                    Err(e) => {
                        let key = self.key();
                        tracing::warn!(subscription = %key.subscription, topic = %key.topic, partition = key.partition, error = %e, "dispatch core refused an ack");
                    }
                }
            }
            waiting.push((answers, reply));
        }
        let mut fx = Effects::default();
        self.execute(merge_resolves(cmds), &mut fx).await;
        self.sync_shared();
        let mut per_request: Vec<Effects> = waiting.iter().map(|_| Effects::default()).collect();
        for r in fx.replies {
            // Every reply answers an id fed above (the core replies once per id).
            if let Some(i) = of_id.get_mut(reply_id(&r)).and_then(|q| q.pop_front()) {
                per_request[i].replies.push(r);
            }
        }
        for ((mut answers, reply), fx) in waiting.into_iter().zip(per_request) {
            // A failed partition answers the failure (`answer` and
            // `reply_after_writes` check).
            let answer = self.answer(fx, &mut answers).map(|()| answers);
            self.reply_after_writes(reply, answer);
        }
    }

    /// An ack, nack or extend: checks the sessions of the ids, feeds the checked ones
    /// (`input`), and answers per id once the writes they need are done.
    async fn resolve_ids(
        &mut self,
        ids: Vec<String>,
        unavailable_list: Outcome,
        input: impl FnOnce(Vec<DeliveryRef>) -> Input,
    ) -> Result<Answers, RuntimeError> {
        let (refs, mut answers) = self.checked(ids, unavailable_list).await;
        let mut fx = Effects::default();
        if !refs.is_empty() {
            self.feed(input(refs), &mut fx).await;
        }
        self.sync_shared();
        self.answer(fx, &mut answers).map(|()| answers)
    }

    /// Session checks for the ids bound to a session. An id whose session cannot be
    /// checked now (Meta unavailable) is answered with `unavailable_list` and not fed
    /// to the core: failing closed without calling it fenced.
    async fn checked(
        &self,
        ids: Vec<String>,
        unavailable_list: Outcome,
    ) -> (Vec<DeliveryRef>, Answers) {
        let mut refs = Vec::with_capacity(ids.len());
        let mut answers = Answers::default();
        for id in ids {
            let Some(binding) = self.core.bound_session(&id).cloned() else {
                refs.push(DeliveryRef::unbound(id));
                continue;
            };
            let current_epoch = match self
                .deps
                .sessions
                .check(&binding.session_id, binding.epoch)
                .await
            {
                Ok(()) => Some(binding.epoch),
                Err(e)
                    if e.is_retryable()
                        || matches!(e, SessionError::Store(StoreFailure::Indeterminate(_))) =>
                {
                    self.deps
                        .metrics
                        .store_error("sessions", self.deps.meta_backend, e.kind());
                    answers.lists.push((unavailable_list, id));
                    continue;
                }
                Err(_) => None,
            };
            refs.push(DeliveryRef::checked(
                id,
                SessionCheck {
                    session_id: binding.session_id,
                    current_epoch,
                },
            ));
        }
        (refs, answers)
    }

    /// Turns the core's replies into answer lists. A nack that dead-letters is
    /// `dead_lettered` only when its entry became durable in this request.
    fn answer(&self, fx: Effects, answers: &mut Answers) -> Result<(), RuntimeError> {
        if let Some(e) = self.failed_error() {
            return Err(e);
        }
        for r in fx.replies {
            let (list, id) = match r {
                Reply::Ack {
                    delivery_id,
                    outcome,
                } => {
                    let list = match outcome {
                        AckOutcome::Acked => Outcome::Acked,
                        AckOutcome::Unknown => Outcome::Unknown,
                        AckOutcome::Fenced => Outcome::Fenced,
                    };
                    (list, delivery_id)
                }
                Reply::Nack {
                    delivery_id,
                    outcome,
                } => {
                    let list = match outcome {
                        NackOutcome::Retrying { .. } => Outcome::Retrying,
                        NackOutcome::DeadLettering => {
                            let done = offset_of(&delivery_id)
                                .is_some_and(|o| fx.dead_lettered.contains(&o));
                            if done {
                                Outcome::DeadLettered
                            } else {
                                Outcome::DeadLettering
                            }
                        }
                        NackOutcome::Unknown => Outcome::Unknown,
                        NackOutcome::Fenced => Outcome::Fenced,
                    };
                    (list, delivery_id)
                }
                Reply::Extend {
                    delivery_id,
                    outcome,
                } => {
                    let list = match outcome {
                        ExtendOutcome::Extended { .. } => Outcome::Extended,
                        ExtendOutcome::Unknown => Outcome::Unknown,
                        ExtendOutcome::Fenced => Outcome::Fenced,
                    };
                    (list, delivery_id)
                }
                // Releases are answered by `Msg::Release`, never through here.
                Reply::Release { .. } => continue,
            };
            if list == Outcome::Acked {
                self.counters.count(&self.part_counters, Counted::Acked);
            } else if list.is_nacked() {
                self.counters.count(&self.part_counters, Counted::Nacked);
            }
            answers.lists.push((list, id));
        }
        Ok(())
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
