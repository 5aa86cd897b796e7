//! Cluster mode: any instance serves every partition. A pull takes this instance's
//! partitions, then asks the other owners over their internal routes
//! (`crate::cluster::forward::Peers`, no wait); when that finds nothing and the pull
//! may wait, it waits on every source at once (its own partitions and one forwarded
//! long poll at each other owner), and the long polls still open are released by
//! their forward ids. Acks, nacks and extends of partitions owned elsewhere, offset
//! resets and redrives go to the owner's internal route as well.
//!
//! On the owner: the pulls served for other instances are remembered by their forward
//! id ([`ForwardedPulls`]), so the instance that asked can have their hand-outs
//! released when it did not get the answer, and so is the instance each forwarded
//! delivery went to, which is told when the delivery is settled here
//! ([`Runtime::tell_holders`]).

pub(super) mod served;

use super::clock::now_ms;
use super::error::{peer_refused, RuntimeError};
use super::state::{Runtime, SubRuntime};
use super::types::{Answers, Handed, Outcome, PullBudget};
use crate::cluster::ownership::Directory;
use meshd_dispatch::SessionBinding;
use meshd_meta::Backend;
use meshd_stores::offsets::Committed;
use served::Forwarded;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long a call to another instance may take (a forwarded pull asks with no wait).
pub(super) const PEER_TIMEOUT: Duration = Duration::from_secs(5);

/// A fresh forward id (random, so no instance can guess another's).
fn forward_id() -> String {
    use rand::RngCore;
    let mut bytes = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// An ack, nack or extend as the owner's internal route takes it.
pub struct Forward {
    op: &'static str,
    fields: serde_json::Map<String, serde_json::Value>,
}

impl Forward {
    pub fn ack() -> Self {
        Self {
            op: "ack",
            fields: Default::default(),
        }
    }

    /// A nack; `delay_ms` goes along only when given, so an owner of a release
    /// before it takes the call (the API gates the field during a rolling upgrade).
    pub fn nack(reason: &str, delay_ms: Option<u64>) -> Self {
        let mut fields = serde_json::Map::new();
        fields.insert("reason".into(), reason.into());
        if let Some(ms) = delay_ms {
            fields.insert("delay_ms".into(), ms.into());
        }
        Self { op: "nack", fields }
    }

    pub fn extend(ack_timeout_ms: u64) -> Self {
        let mut fields = serde_json::Map::new();
        fields.insert("ack_timeout_ms".into(), ack_timeout_ms.into());
        Self {
            op: "extend",
            fields,
        }
    }
}

/// One delivery as the internal pull route answers it (the event exactly as stored).
#[derive(serde::Deserialize)]
struct WireDelivery {
    delivery_id: String,
    partition: u32,
    offset: u64,
    attempt: u32,
    event: Box<serde_json::value::RawValue>,
}

#[derive(serde::Deserialize)]
struct WirePull {
    deliveries: Vec<WireDelivery>,
}

fn peer_error(peer: &str, status: u16, body: &[u8]) -> RuntimeError {
    RuntimeError::Unavailable {
        store: "owners",
        backend: Backend::Http,
        detail: peer_refused(peer, status, body),
    }
}

impl Runtime {
    /// The owner's side of a forwarded pull: remembers what it handed out under
    /// `forward_id` (or releases it at once when the asking instance already gave up).
    /// `holder`: the instance that asked (told when these deliveries are settled
    /// elsewhere, see [`Runtime::tell_holders`]).
    pub async fn forwarded(
        &self,
        name: &str,
        forward_id: &str,
        ids: Vec<String>,
        holder: Option<&str>,
    ) {
        let released_early = {
            let mut f = self.forwarded.lock();
            if let Some(h) = holder.filter(|h| *h != self.deps.instance_id) {
                f.remember_holder(&ids, h);
            }
            match f.by_id.remove(forward_id) {
                Some(Forwarded::Released) => true,
                _ => {
                    f.insert(
                        forward_id,
                        Forwarded::Served {
                            name: name.to_string(),
                            ids: ids.clone(),
                        },
                    );
                    false
                }
            }
        };
        if released_early && !ids.is_empty() {
            let n = self.release(name, ids).await;
            tracing::info!(store = "deliveries", subscription = %name, released = n, "a forwarded pull was given up by the instance that asked before it was answered; its hand-outs are due again");
        }
    }

    /// Cluster mode, on the owner: deliveries that an ack or nack answered here
    /// settled (`acked`, `unknown`, `fenced`, a nack list) and that went out through
    /// another instance's forwarded pull are announced to that instance, so a stream
    /// there gets its credit back now instead of at the lease deadline (the client
    /// may ack on any instance). Fire and forget: a notice that fails is counted and
    /// the credit comes back at the deadline as before.
    pub(super) fn tell_holders(&self, name: &str, answers: &Answers) {
        let Some(cluster) = &self.deps.cluster else {
            return;
        };
        let mut by_holder: BTreeMap<String, Vec<String>> = BTreeMap::new();
        {
            let mut f = self.forwarded.lock();
            if f.holders.is_empty() {
                return;
            }
            for (outcome, id) in &answers.lists {
                if matches!(outcome, Outcome::Failed | Outcome::Extended) {
                    continue;
                }
                if let Some(h) = f.holders.remove(id) {
                    by_holder.entry(h).or_default().push(id.clone());
                }
            }
        }
        if by_holder.is_empty() {
            return;
        }
        let directory = cluster.directory.borrow().clone();
        let path = format!(
            "/internal/v1/subscriptions/{}/settled",
            meshd_client::segment(name)
        );
        for (holder, ids) in by_holder {
            let Some(addr) = directory.addrs.get(&holder).cloned() else {
                // Gone from the cluster: its streams went with it.
                continue;
            };
            let peers = cluster.peers.clone();
            let metrics = self.deps.metrics.clone();
            let path = path.clone();
            let name = name.to_string();
            tokio::spawn(async move {
                let body = serde_json::json!({ "delivery_ids": ids }).to_string();
                let result = peers
                    .post(&addr, &path, body.as_bytes(), PEER_TIMEOUT)
                    .await;
                let ok = matches!(result, Ok((200, _)));
                metrics.settle_notice(ok);
                if !ok {
                    let detail = match result {
                        Ok((status, body)) => peer_refused(&addr, status, &body),
                        Err(e) => e.to_string(),
                    };
                    tracing::warn!(store = "deliveries", subscription = %name, instance = %holder, %addr, error = %detail, "could not tell an instance that deliveries its streams hold were settled; their credit comes back at the lease deadline");
                }
            });
        }
    }

    /// The owner's side of a release: the instance that forwarded `forward_id` did
    /// not get the answer. Returns how many hand-outs were still in flight.
    pub async fn release_forwarded(&self, name: &str, forward_id: &str) -> usize {
        let served = {
            let mut f = self.forwarded.lock();
            match f.by_id.remove(forward_id) {
                Some(Forwarded::Served { name: n, ids }) if n == name => Some(ids),
                Some(other) => {
                    f.by_id.insert(forward_id.to_string(), other);
                    None
                }
                None => {
                    // Not answered yet (or never arrived): remembered, so the pull
                    // releases what it hands out.
                    f.insert(forward_id, Forwarded::Released);
                    None
                }
            }
        };
        match served {
            Some(ids) if !ids.is_empty() => {
                let n = self.release(name, ids).await;
                tracing::info!(store = "deliveries", subscription = %name, released = n, "a forwarded pull's answer did not reach the instance that asked; its hand-outs are due again");
                n
            }
            _ => 0,
        }
    }

    /// Cluster mode: a pull takes what this instance's partitions have, then asks the
    /// owners of the others (internal route, no wait) for what is left of its budget.
    /// When that finds nothing and the pull may wait, it waits on every source at
    /// once: this instance's partitions, and a forwarded long poll at each other
    /// owner, which answers as soon as its partitions have something. The first
    /// source with deliveries answers the pull; the long polls still open are given
    /// up and released by their forward ids (what they handed out meanwhile is due
    /// again at once, the attempt not counted). A change of owners starts the round
    /// again, so a partition that moved or lost its owner is asked where it is now.
    pub(super) async fn pull_cluster(
        &self,
        name: &str,
        budget: PullBudget,
        wait: Duration,
        session: Option<SessionBinding>,
    ) -> Result<Vec<Handed>, RuntimeError> {
        let Some(cluster) = &self.deps.cluster else {
            return Err(RuntimeError::Invalid("not in cluster mode".into()));
        };
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let sub = self.running_now(name)?;
            let mut woken = sub.notify.subscribe();
            woken.borrow_and_update();
            let mut owners = cluster.directory.clone();
            owners.borrow_and_update();
            let mut got = self
                .pull_running(name, budget, Duration::ZERO, session.clone())
                .await?;
            let peers = owners
                .borrow()
                .peers_for(&sub.sub.spec.topic, &self.deps.instance_id);
            for (peer, addr) in &peers {
                let Some(left) = budget.after(&got) else {
                    break;
                };
                match self
                    .forward_pull(
                        addr,
                        name,
                        left,
                        session.as_ref(),
                        Duration::ZERO,
                        forward_id(),
                    )
                    .await
                {
                    Ok(mut d) => got.append(&mut d),
                    Err(e) => self.forward_failed(peer, name, &e),
                }
            }
            if !got.is_empty() || tokio::time::Instant::now() >= deadline || self.is_stopping() {
                return Ok(got);
            }
            if let Some(got) = self
                .wait_on_owners(
                    name,
                    &sub.sub.spec.topic,
                    budget,
                    deadline,
                    session.as_ref(),
                    &mut woken,
                    &mut owners,
                )
                .await?
            {
                return Ok(got);
            }
        }
    }

    fn forward_failed(&self, peer: &str, name: &str, e: &RuntimeError) {
        self.deps
            .metrics
            .store_error("owners", meshd_meta::Backend::Http, "forward_failed");
        tracing::warn!(store = "owners", peer = %peer, subscription = %name, error = %e, "a forwarded pull failed; that instance's partitions are asked again at the next pull");
    }

    /// The waiting half of [`Runtime::pull_cluster`]: `Some` with deliveries (or
    /// empty once the deadline passed or meshd is stopping), `None` when the owners
    /// changed and the round starts again.
    #[allow(clippy::too_many_arguments)]
    async fn wait_on_owners(
        &self,
        name: &str,
        topic: &str,
        budget: PullBudget,
        deadline: tokio::time::Instant,
        session: Option<&SessionBinding>,
        woken: &mut watch::Receiver<u64>,
        owners: &mut watch::Receiver<Arc<Directory>>,
    ) -> Result<Option<Vec<Handed>>, RuntimeError> {
        use futures::stream::{FuturesUnordered, StreamExt};
        let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
        // The owners this round asks, and the view it was built from, at once.
        let (view, peers) = {
            let d = owners.borrow_and_update();
            (
                d.topic_view(topic),
                d.peers_for(topic, &self.deps.instance_id),
            )
        };
        // Every peer's long poll, with its forward id (to give it up).
        let mut open: Vec<(String, String)> = Vec::new();
        let mut polls = FuturesUnordered::new();
        for (peer, addr) in &peers {
            let id = forward_id();
            open.push((addr.clone(), id.clone()));
            let (peer, addr) = (peer.clone(), addr.clone());
            polls.push(async move {
                let r = self
                    .forward_pull(&addr, name, budget, session, wait, id.clone())
                    .await;
                (peer, addr, id, r)
            });
        }
        let mut stopping = self.stopping.subscribe();
        let mut answer: Option<Vec<Handed>> = None;
        loop {
            if *stopping.borrow_and_update() {
                answer = Some(Vec::new());
                break;
            }
            tokio::select! {
                Some((peer, addr, id, r)) = polls.next(), if !polls.is_empty() => {
                    open.retain(|(a, i)| !(*a == addr && *i == id));
                    match r {
                        Ok(d) if !d.is_empty() => {
                            answer = Some(d);
                            break;
                        }
                        // Its wait ended empty: nothing there until the deadline.
                        Ok(_) => {}
                        Err(e) => self.forward_failed(&peer, name, &e),
                    }
                }
                _ = woken.changed() => {
                    // Something became ready here: taken without waiting (a pull
                    // that is never cancelled half-way).
                    let d = self.pull_running(name, budget, Duration::ZERO, session.cloned()).await?;
                    if !d.is_empty() {
                        answer = Some(d);
                        break;
                    }
                }
                r = owners.changed() => {
                    // The directory is published after every look at Meta; only a
                    // change of this topic's owners (or their addresses) matters.
                    if r.is_ok() && owners.borrow_and_update().topic_view(topic) != view {
                        break;
                    }
                }
                _ = tokio::time::sleep_until(deadline) => {
                    answer = Some(Vec::new());
                    break;
                }
                _ = stopping.changed() => {}
            }
        }
        drop(polls);
        // Long polls given up: whatever they hand out is released by their owner.
        for (addr, id) in open {
            self.deps.metrics.forward_release();
            self.spawn_release(&addr, name, id);
        }
        Ok(answer)
    }

    /// Asks the owner at `addr` for up to `budget` (its byte budget is what is left
    /// of the caller's). When the answer does not arrive whole (a timeout, a cut
    /// connection, a malformed answer), the owner is asked to release what it handed
    /// out under this pull's forward id, so nothing stays leased to nobody.
    async fn forward_pull(
        &self,
        addr: &str,
        name: &str,
        budget: PullBudget,
        session: Option<&SessionBinding>,
        wait: Duration,
        id: String,
    ) -> Result<Vec<Handed>, RuntimeError> {
        let Some(cluster) = &self.deps.cluster else {
            return Err(RuntimeError::Invalid("not in cluster mode".into()));
        };
        let peers = &cluster.peers;
        self.deps.metrics.forwarded_pull(!wait.is_zero());
        let mut body = serde_json::json!({
            "max_events": budget.max_events,
            "max_bytes": budget.max_bytes.max(1),
            "at_least_one": budget.at_least_one,
            "wait_ms": wait.as_millis() as u64,
            "forward_id": id,
            "from": self.deps.instance_id,
        });
        if let Some(s) = session {
            body["session"] = s.session_id.clone().into();
        }
        let path = format!(
            "/internal/v1/subscriptions/{}/pull",
            meshd_client::segment(name)
        );
        // The answer holds at most the budget (or one event of the largest size)
        // plus each delivery's JSON around it.
        let limit = budget
            .max_bytes
            .max(meshd_events::DEFAULT_MAX_EVENT_BYTES)
            .saturating_add(budget.max_events.saturating_mul(1024))
            .saturating_add(64 * 1024);
        let answer = peers
            .post_limited(
                addr,
                &path,
                body.to_string().as_bytes(),
                PEER_TIMEOUT + wait,
                limit,
            )
            .await;
        let parsed = match answer {
            Ok((200, answer)) => {
                serde_json::from_slice::<WirePull>(&answer).map_err(|e| RuntimeError::Unavailable {
                    store: "owners",
                    backend: Backend::Http,
                    detail: format!("instance {addr} answered a pull with {e}"),
                })
            }
            // A refusal hands nothing out.
            Ok((status, answer)) => return Err(peer_error(addr, status, &answer)),
            Err(detail) => Err(RuntimeError::Unavailable {
                store: "owners",
                backend: Backend::Http,
                detail: detail.to_string(),
            }),
        };
        let wire = match parsed {
            Ok(w) => w,
            Err(e) => {
                self.deps.metrics.forward_release();
                self.spawn_release(addr, name, id);
                return Err(e);
            }
        };
        Ok(wire
            .deliveries
            .into_iter()
            .map(|d| Handed {
                delivery_id: d.delivery_id,
                partition: d.partition,
                offset: d.offset,
                attempt: d.attempt,
                body: d.event.get().as_bytes().to_vec(),
            })
            .collect())
    }

    /// Asks the owner at `addr` to release forward `id` (in the background: the pull
    /// that failed answers now; a release that cannot be sent leaves the leases to
    /// run out, as for a consumer that vanished).
    fn spawn_release(&self, addr: &str, name: &str, id: String) {
        let Some(cluster) = &self.deps.cluster else {
            return;
        };
        let peers = cluster.peers.clone();
        let addr = addr.to_string();
        let path = format!(
            "/internal/v1/subscriptions/{}/release",
            meshd_client::segment(name)
        );
        let name = name.to_string();
        self.deps.background.spawn(async move {
            let body = serde_json::json!({ "forward_id": id }).to_string();
            match peers
                .post(&addr, &path, body.as_bytes(), PEER_TIMEOUT)
                .await
            {
                Ok((200, _)) => {}
                Ok((status, answer)) => {
                    tracing::warn!(store = "owners", peer = %addr, subscription = %name, status, answer = %String::from_utf8_lossy(&answer), "the owner refused to release a forwarded pull; its leases run out instead")
                }
                Err(e) => {
                    tracing::warn!(store = "owners", peer = %addr, subscription = %name, error = %e, "could not ask the owner to release a forwarded pull; its leases run out instead")
                }
            }
        });
    }

    /// Sends ids of partitions owned elsewhere to their owners; merges the answers.
    pub(super) async fn forward_to_owners(
        &self,
        name: &str,
        topic: &str,
        by_partition: BTreeMap<u32, Vec<String>>,
        f: &Forward,
    ) -> Result<Answers, RuntimeError> {
        let Some(cluster) = &self.deps.cluster else {
            return Err(RuntimeError::Invalid("not in cluster mode".into()));
        };
        let mut by_owner: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (p, ids) in by_partition {
            let owner = cluster.directory.borrow().owner_of(topic, p);
            match owner {
                Some((holder, addr)) if holder != self.deps.instance_id => {
                    by_owner.entry(addr).or_default().extend(ids)
                }
                _ => {
                    return Err(RuntimeError::Unavailable {
                        store: "owners",
                        backend: self.deps.meta_backend,
                        detail: format!(
                            "partition {p} of topic {topic:?} is changing owners; retry"
                        ),
                    })
                }
            }
        }
        let mut answers = Answers::default();
        let path = format!(
            "/internal/v1/subscriptions/{}/{}",
            meshd_client::segment(name),
            f.op
        );
        for (addr, ids) in by_owner {
            let mut body = f.fields.clone();
            body.insert("delivery_ids".into(), ids.clone().into());
            let (status, answer) = cluster
                .peers
                .post(
                    &addr,
                    &path,
                    serde_json::Value::Object(body).to_string().as_bytes(),
                    PEER_TIMEOUT,
                )
                .await
                .map_err(|detail| RuntimeError::Unavailable {
                    store: "owners",
                    backend: Backend::Http,
                    detail: detail.to_string(),
                })?;
            let v: serde_json::Value = match status {
                200 => serde_json::from_slice(&answer).map_err(|e| RuntimeError::Unavailable {
                    store: "owners",
                    backend: Backend::Http,
                    detail: format!("instance {addr} answered with {e}"),
                })?,
                // Every id sent there was fenced (the owner's all-fenced answer).
                409 => {
                    answers
                        .lists
                        .extend(ids.into_iter().map(|id| (Outcome::Fenced, id)));
                    continue;
                }
                _ => return Err(peer_error(&addr, status, &answer)),
            };
            for list in Outcome::ALL {
                for id in v[list.as_str()].as_array().into_iter().flatten() {
                    if let Some(id) = id.as_str() {
                        answers.lists.push((list, id.to_string()));
                    }
                }
            }
        }
        Ok(answers)
    }

    pub(super) async fn forward_reset(
        &self,
        sub: &SubRuntime,
        partition: u32,
        offset: u64,
    ) -> Result<Committed, RuntimeError> {
        let Some(cluster) = &self.deps.cluster else {
            return Err(RuntimeError::Invalid("not in cluster mode".into()));
        };
        let owner = cluster
            .directory
            .borrow()
            .owner_of(&sub.sub.spec.topic, partition);
        let Some((holder, addr)) = owner.filter(|(h, _)| *h != self.deps.instance_id) else {
            return Err(RuntimeError::Unavailable {
                store: "owners",
                backend: self.deps.meta_backend,
                detail: format!("partition {partition} is changing owners; retry"),
            });
        };
        let path = format!(
            "/internal/v1/subscriptions/{}/offsets/{partition}",
            meshd_client::segment(sub.sub.name())
        );
        let body = serde_json::json!({ "offset": offset }).to_string();
        let (status, answer) = cluster
            .peers
            .post(&addr, &path, body.as_bytes(), PEER_TIMEOUT)
            .await
            .map_err(|detail| RuntimeError::Unavailable {
                store: "owners",
                backend: Backend::Http,
                detail: detail.to_string(),
            })?;
        let v: serde_json::Value = serde_json::from_slice(&answer).unwrap_or_default();
        match status {
            200 => match (v["committed"].as_u64(), v["epoch"].as_u64()) {
                (Some(offset), Some(epoch)) => Ok(Committed {
                    offset,
                    epoch,
                    at_ms: now_ms(),
                }),
                _ => Err(peer_error(&holder, status, &answer)),
            },
            400 => Err(RuntimeError::Invalid(
                v["detail"].as_str().unwrap_or("invalid offset").to_string(),
            )),
            _ => Err(peer_error(&holder, status, &answer)),
        }
    }

    /// Cluster mode: a redrive of an entry whose partition another instance owns is
    /// sent there; returns its answer (status and body), or `None` when it runs here.
    pub async fn forward_redrive(
        &self,
        entry: &meshd_stores::deadletters::DeadLetterEntry,
    ) -> Result<Option<(u16, Vec<u8>)>, RuntimeError> {
        let Some(cluster) = &self.deps.cluster else {
            return Ok(None);
        };
        let here = cluster
            .owned
            .borrow()
            .contains_key(&(entry.topic.clone(), entry.partition));
        if here {
            return Ok(None);
        }
        let owner = cluster
            .directory
            .borrow()
            .owner_of(&entry.topic, entry.partition);
        let Some((_, addr)) = owner.filter(|(h, _)| *h != self.deps.instance_id) else {
            return Err(RuntimeError::Unavailable {
                store: "owners",
                backend: self.deps.meta_backend,
                detail: format!("partition {} is changing owners; retry", entry.partition),
            });
        };
        let path = format!(
            "/internal/v1/deadletters/{}/redrive",
            meshd_client::segment(&entry.id)
        );
        cluster
            .peers
            .post(&addr, &path, b"", PEER_TIMEOUT)
            .await
            .map(Some)
            .map_err(|detail| RuntimeError::Unavailable {
                store: "owners",
                backend: Backend::Http,
                detail: detail.to_string(),
            })
    }
}
