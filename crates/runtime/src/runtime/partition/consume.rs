//! Pulls, acks, nacks and extends as a partition task serves them. Pulls taken
//! together share one attempt write and each gets its own hand-outs once that write
//! is durable; acks taken together share one resolve. An ack, nack or extend checks
//! the sessions of its ids first (an id whose session cannot be checked is answered
//! without reaching the core) and is answered per id, by the lists of the contract,
//! once the writes it stands for are applied.

use super::records::merge_resolves;
use super::task::{AckRequest, Effects, PartitionTask, PullReply, PullRequest};
use crate::metrics::Counted;
use crate::runtime::clock::now_ms;
use crate::runtime::error::RuntimeError;
use crate::runtime::types::{offset_of, Answers, Handed, Outcome};
use meshd_dispatch::{
    AckOutcome, Command, DeliveryRef, ExtendOutcome, Input, NackOutcome, PullId, Reply,
    SessionCheck,
};
use meshd_stores::failure::StoreFailure;
use meshd_stores::sessions::SessionError;
use std::collections::{HashMap, VecDeque};

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
    /// Pulls served together: the core picks each one's events in turn, their
    /// attempt records go to disk in one atomic write, and each pull gets its own
    /// hand-outs once that write is durable.
    pub(super) async fn pulls(&mut self, pulls: Vec<PullRequest>) {
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
    pub(super) async fn answer_pulls(&mut self, fx: Effects, replies: Vec<PullReply>) {
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
    pub(super) async fn acks(&mut self, acks: Vec<AckRequest>) {
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
    pub(super) async fn resolve_ids(
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
}
