//! Partition ownership in cluster mode.
//!
//! Each instance holds `members/{instance}` under its membership lease. The designated
//! owner of every (topic, partition) follows from the member list ([`super::assign`]).
//! An instance *acquires* a partition by creating `owners/partition/{topic}/{partition}`
//! with put-if-absent under its membership lease; the key's `mod_revision` is the
//! ownership's epoch, and every Meta write made as owner compares it
//! ([`meshd_meta::fence::Ownership`]). A partition whose designated owner changed is
//! handed over by **release → drain → acquire**: the old owner stops dispatching it,
//! checkpoints its state and deletes its owner key (fenced); only then can the new
//! owner's put-if-absent succeed. An owner that dies simply lets its lease expire,
//! which deletes its keys.
//!
//! An owner stops acting before the server can expire its lease: when the membership
//! lease's local deadline ([`meshd_meta::fence::LeaseDeadline`]) passes without a
//! successful keep-alive, every ownership is dropped locally at once. After `Fenced` or
//! `Indeterminate` on an owner key the partition is dropped and re-acquired before it is
//! acted on again.
//!
//! [`plan`] is the pure decision; [`Controller`] runs it against Meta.

use super::assign;
use std::collections::{BTreeMap, BTreeSet};

/// A partition of a topic.
pub type PartitionId = (String, u32);

/// What to do next, from what is known now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Held here but designated to another member: drain, then release.
    pub release: Vec<PartitionId>,
    /// Designated here and free: acquire.
    pub acquire: Vec<PartitionId>,
    /// Designated here but still held by another instance (draining, or dead with a
    /// lease that has not expired yet): wait.
    pub waiting: Vec<PartitionId>,
}

/// Decides releases and acquisitions for instance `me`.
///
/// * `members`: the instances holding a membership lease (`me` among them, or nothing
///   is acquired: an instance that is not a member must not own anything).
/// * `partitions`: every partition of every topic.
/// * `holders`: the current holder of each owner key that exists.
#[cfg(test)]
pub fn plan(
    me: &str,
    members: &[String],
    partitions: &[PartitionId],
    holders: &BTreeMap<PartitionId, String>,
) -> Plan {
    plan_moves(
        me,
        members,
        partitions,
        holders,
        &Moves {
            ready: &|_| true,
            max: usize::MAX,
        },
    )
}

/// When a live owner hands a partition to the member now designated for it (sticky
/// moves, http-api.md "Cluster: moves, takeovers and Meta's footprint").
pub struct Moves<'a> {
    /// Whether that member has been a member long enough (`--rebalance-delay-ms`): a
    /// member that rejoins does not take partitions back from a live owner at once.
    pub ready: &'a dyn Fn(&str) -> bool,
    /// Hand-overs per step at most (moves are paced). Partitions of a topic that is
    /// gone, and everything when this instance is no longer a member, are released
    /// whatever the count.
    pub max: usize,
}

/// [`plan`] with sticky, paced hand-overs. Orphaned partitions (no holder: a crash, a
/// release) are still acquired at once by their designated owner.
pub fn plan_moves(
    me: &str,
    members: &[String],
    partitions: &[PartitionId],
    holders: &BTreeMap<PartitionId, String>,
    moves: &Moves<'_>,
) -> Plan {
    let member = members.iter().any(|m| m == me);
    let mut out = Plan::default();
    let known: BTreeSet<&PartitionId> = partitions.iter().collect();
    let mut handed = 0;
    for p in partitions {
        let designated = assign::owner(members, &p.0, p.1);
        let holder = holders.get(p).map(String::as_str);
        let mine = member && designated == Some(me);
        match (holder, mine) {
            // Leaving: everything goes.
            (Some(h), false) if h == me && !member => out.release.push(p.clone()),
            (Some(h), false) if h == me => {
                let to_ready = designated.is_none_or(|d| (moves.ready)(d));
                if to_ready && handed < moves.max {
                    handed += 1;
                    out.release.push(p.clone());
                }
            }
            (Some(h), true) if h != me => out.waiting.push(p.clone()),
            (None, true) => out.acquire.push(p.clone()),
            _ => {}
        }
    }
    // Owner keys of partitions that no longer exist (a deleted topic) are released.
    for (p, h) in holders {
        if h == me && !known.contains(p) {
            out.release.push(p.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_live_owner_hands_partitions_to_a_new_member_only_once_it_is_ready_and_a_few_at_a_time() {
        let ps = parts("t", 64);
        let both = members(&["a", "b"]);
        let all_a: BTreeMap<PartitionId, String> =
            ps.iter().map(|p| (p.clone(), "a".to_string())).collect();
        let not_yet = Moves {
            ready: &|m| m != "b",
            max: usize::MAX,
        };
        assert!(plan_moves("a", &both, &ps, &all_a, &not_yet)
            .release
            .is_empty());
        let paced = Moves {
            ready: &|_| true,
            max: 3,
        };
        let p = plan_moves("a", &both, &ps, &all_a, &paced);
        assert_eq!(p.release.len(), 3, "paced");
        // Leaving: everything goes at once, ready or not.
        let p = plan_moves("a", &members(&["b"]), &ps, &all_a, &not_yet);
        assert_eq!(p.release.len(), 64);
        // An orphan is taken at once by its designated owner.
        let p = plan_moves("b", &both, &ps, &BTreeMap::new(), &not_yet);
        assert!(!p.acquire.is_empty());
    }

    fn parts(topic: &str, n: u32) -> Vec<PartitionId> {
        (0..n).map(|p| (topic.to_string(), p)).collect()
    }

    fn members(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_lone_member_acquires_everything_free() {
        let ps = parts("t", 8);
        let p = plan("a", &members(&["a"]), &ps, &BTreeMap::new());
        assert_eq!(p.acquire, ps);
        assert!(p.release.is_empty() && p.waiting.is_empty());
    }

    #[test]
    fn an_instance_that_is_not_a_member_acquires_nothing_and_releases_what_it_holds() {
        let ps = parts("t", 4);
        let holders: BTreeMap<_, _> = ps.iter().map(|p| (p.clone(), "a".to_string())).collect();
        let p = plan("a", &members(&["b"]), &ps, &holders);
        assert!(p.acquire.is_empty());
        assert_eq!(p.release, ps);
    }

    #[test]
    fn a_new_member_waits_for_the_old_owner_to_release_and_then_acquires() {
        let ps = parts("t", 64);
        let all_a: BTreeMap<_, _> = ps.iter().map(|p| (p.clone(), "a".to_string())).collect();
        let both = members(&["a", "b"]);
        let at_a = plan("a", &both, &ps, &all_a);
        let at_b = plan("b", &both, &ps, &all_a);
        assert!(!at_a.release.is_empty());
        assert_eq!(
            at_a.release, at_b.waiting,
            "b waits for exactly what a releases"
        );
        assert!(at_b.acquire.is_empty(), "nothing is taken while held");
        // a released them: b acquires exactly those.
        let mut after = all_a.clone();
        for p in &at_a.release {
            after.remove(p);
        }
        let at_b = plan("b", &both, &ps, &after);
        assert_eq!(at_b.acquire, at_a.release);
        assert!(
            plan("a", &both, &ps, &after).release.is_empty(),
            "a is done"
        );
    }

    #[test]
    fn partitions_of_a_deleted_topic_are_released() {
        let mut holders = BTreeMap::new();
        holders.insert(("gone".to_string(), 0), "a".to_string());
        let p = plan("a", &members(&["a"]), &parts("t", 1), &holders);
        assert_eq!(p.release, vec![("gone".to_string(), 0)]);
        assert_eq!(p.acquire, parts("t", 1));
    }

    #[test]
    fn every_partition_has_exactly_one_designated_taker_among_members() {
        let ps = parts("t", 100);
        let ms = members(&["a", "b", "c"]);
        let mut taken = BTreeMap::new();
        for m in &ms {
            for p in plan(m, &ms, &ps, &BTreeMap::new()).acquire {
                assert!(taken.insert(p, m.clone()).is_none(), "two takers");
            }
        }
        assert_eq!(taken.len(), ps.len());
    }
}

/// The membership lease, kept by [`crate::membership`] and read here.
pub use crate::membership::LeaseState;

/// What the runtime does with a partition it is about to give up: stop dispatching
/// it and checkpoint its state as `owner` (fenced), before the owner key is deleted.
#[async_trait::async_trait]
pub trait Drain: Send + Sync + 'static {
    async fn drain(&self, partition: &PartitionId, owner: &meshd_meta::fence::Ownership);
}

/// The partitions this instance owns now, with their ownership (epoch) — what the
/// runtime may act on.
pub type Owned = std::sync::Arc<BTreeMap<PartitionId, meshd_meta::fence::Ownership>>;

/// Who holds which partition and where the members listen, as of the controller's last
/// look at Meta: where a pull or an ack for a partition owned elsewhere goes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Directory {
    pub holders: BTreeMap<PartitionId, String>,
    /// Instance id → `host:port` of its HTTP listener.
    pub addrs: BTreeMap<String, String>,
    /// The oldest release any member announces: which record shapes every member
    /// reads ([`crate::membership::oldest_release`]).
    pub oldest_release: crate::membership::Release,
}

impl Directory {
    /// Whether attempt-ledger records may carry their writer's epoch and instance:
    /// every member reads them ([`crate::membership::LEDGER_EPOCH_RELEASE`]).
    pub fn ledger_epoch_allowed(&self) -> bool {
        self.oldest_release >= crate::membership::LEDGER_EPOCH_RELEASE
    }

    /// Who holds each partition of `topic` (and where they listen): what a waiting
    /// pull of that topic depends on.
    pub fn topic_view(&self, topic: &str) -> Vec<(u32, String, Option<String>)> {
        self.holders
            .iter()
            .filter(|((t, _), _)| t == topic)
            .map(|((_, p), h)| (*p, h.clone(), self.addrs.get(h).cloned()))
            .collect()
    }

    /// The other instances holding partitions of `topic`, with their addresses.
    pub fn peers_for(&self, topic: &str, me: &str) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for ((t, _), holder) in &self.holders {
            if t == topic && holder != me && !out.iter().any(|(h, _)| h == holder) {
                if let Some(addr) = self.addrs.get(holder) {
                    out.push((holder.clone(), addr.clone()));
                }
            }
        }
        out
    }

    /// The holder of a partition and its address.
    pub fn owner_of(&self, topic: &str, partition: u32) -> Option<(String, String)> {
        let holder = self.holders.get(&(topic.to_string(), partition))?;
        Some((holder.clone(), self.addrs.get(holder)?.clone()))
    }
}

/// The owner key of a partition: `owners/partition/{topic}/{partition}`.
pub fn owner_key(p: &PartitionId) -> Vec<u8> {
    use meshd_meta::keys::{key, KeyKind};
    key(KeyKind::Owners, &["partition", &p.0, &p.1.to_string()])
}

/// Runs [`plan`] against Meta: reads members, topics and owner keys, releases
/// (after [`Drain`]) and acquires, and publishes what is owned. Drops everything at
/// once when the membership lease's local deadline passes.
pub struct Controller {
    pub meta: std::sync::Arc<dyn meshd_meta::Meta>,
    pub me: String,
    pub lease: tokio::sync::watch::Receiver<Option<LeaseState>>,
    pub topics: std::sync::Arc<dyn meshd_stores::topics::TopicStore>,
    pub drain: std::sync::Arc<dyn Drain>,
    pub owned: tokio::sync::watch::Sender<Owned>,
    /// Published after every look at Meta.
    pub directory: tokio::sync::watch::Sender<std::sync::Arc<Directory>>,
    /// How often Meta is read again without another reason to.
    pub tick: std::time::Duration,
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    /// When each partition designated here but still held elsewhere was first seen.
    pub waiting_since: std::sync::Mutex<BTreeMap<PartitionId, std::time::Instant>>,
    /// How long a member must have been seen before this instance hands it a
    /// partition it holds (`--rebalance-delay-ms`).
    pub rebalance_delay: std::time::Duration,
    /// When this instance first saw each current member.
    pub member_since: std::sync::Mutex<BTreeMap<String, std::time::Instant>>,
    /// Set at a graceful stop: every owned partition is released (drained,
    /// checkpointed, its owner key deleted), then the controller ends.
    pub stop: tokio::sync::watch::Receiver<bool>,
}

/// Hand-overs to other members per step at most.
const MOVES_PER_STEP: usize = 8;

impl Controller {
    /// Runs until a graceful stop has released everything (or the membership ends).
    pub fn spawn(self, background: &crate::background::Background) -> tokio::task::JoinHandle<()> {
        background.spawn(async move { self.run().await })
    }

    async fn run(self) {
        let mut lease = self.lease.clone();
        let mut stop = self.stop.clone();
        loop {
            if *stop.borrow_and_update() {
                self.release_all().await;
                return;
            }
            let current = *lease.borrow_and_update();
            match current {
                Some(l) if l.deadline.is_live(std::time::Instant::now()) => {
                    if let Err(e) = self.step(l).await {
                        tracing::warn!(store = "owners", backend = %self.meta.backend(), error = %e, "partition ownership step failed; retrying");
                    }
                }
                _ => self.drop_all("the membership lease is not live"),
            }
            let wake = current.map(|l| l.deadline.deadline());
            tokio::select! {
                r = lease.changed() => if r.is_err() {
                    self.drop_all("the membership stopped");
                    return;
                },
                r = stop.changed() => if r.is_err() {
                    // The server is gone without a graceful stop.
                    return;
                },
                _ = tokio::time::sleep(self.tick) => {}
                // Stop acting the moment the local deadline passes.
                _ = async {
                    match wake {
                        Some(d) => tokio::time::sleep_until(d.into()).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }

    /// Stops acting on `p` (publishing `rest` as what is owned), drains it (its tasks
    /// stop, its checkpoint is written with the resolved offsets) and deletes its
    /// owner key, fenced.
    async fn release_one(
        &self,
        p: &PartitionId,
        o: meshd_meta::fence::Ownership,
        rest: &BTreeMap<PartitionId, meshd_meta::fence::Ownership>,
    ) {
        // Stop acting on it before anything else.
        self.owned.send_replace(std::sync::Arc::new(rest.clone()));
        self.drain.drain(p, &o).await;
        match o.release(self.meta.as_ref()).await {
            Ok(()) => {
                self.metrics
                    .ownership
                    .released
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::info!(store = "owners", backend = %self.meta.backend(), topic = %p.0, partition = p.1, epoch = o.epoch(), "partition released")
            }
            Err(e) => {
                tracing::warn!(store = "owners", backend = %self.meta.backend(), topic = %p.0, partition = p.1, error = %e, "releasing a partition failed; its lease ends it")
            }
        }
    }

    /// A graceful stop: every owned partition released, one after the other.
    async fn release_all(&self) {
        let mut owned: BTreeMap<_, _> = (**self.owned.borrow()).clone();
        let n = owned.len();
        tracing::info!(
            store = "owners",
            backend = %self.meta.backend(),
            owned = n,
            "graceful stop: releasing every owned partition"
        );
        while let Some((p, o)) = owned.pop_first() {
            self.release_one(&p, o, &owned).await;
        }
        self.metrics
            .ownership
            .owned
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }

    fn drop_all(&self, why: &str) {
        let n = self.owned.borrow().len();
        if n > 0 {
            tracing::warn!(
                store = "owners",
                backend = %self.meta.backend(),
                owned = n,
                reason = why,
                "dropping every partition ownership"
            );
            self.owned
                .send_replace(std::sync::Arc::new(BTreeMap::new()));
            let counters = &self.metrics.ownership;
            counters
                .lost
                .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            counters
                .owned
                .store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }

    async fn step(&self, lease: LeaseState) -> Result<(), String> {
        let listed = crate::membership::members(self.meta.as_ref())
            .await
            .map_err(|e| e.to_string())?;
        let members: Vec<String> = listed.iter().map(|m| m.instance.clone()).collect();
        let oldest_release = crate::membership::oldest_release(&listed);
        let addrs: BTreeMap<String, String> =
            listed.into_iter().map(|m| (m.instance, m.addr)).collect();
        let partitions: Vec<PartitionId> = self
            .topics
            .list()
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .flat_map(|t| (0..t.partitions).map(move |p| (t.name.clone(), p)))
            .collect();
        let mut holders = BTreeMap::new();
        let mut epochs = BTreeMap::new();
        for (p, (holder, epoch)) in owners(self.meta.as_ref())
            .await
            .map_err(|e| e.to_string())?
        {
            if holder == self.me {
                epochs.insert(p.clone(), epoch);
            }
            holders.insert(p, holder);
        }
        // What Meta no longer shows as ours (expired lease, taken) is dropped first.
        let mut owned: BTreeMap<_, _> = (**self.owned.borrow()).clone();
        let before = owned.len();
        owned.retain(|p, o| epochs.get(p) == Some(&o.epoch()));
        let counters = &self.metrics.ownership;
        counters.lost.fetch_add(
            (before - owned.len()) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        // Keys under our name that this process did not acquire (an earlier run of
        // this instance, under a lease that is ending) are deleted, fenced by their
        // epoch, and acquired again under the current lease in the next step.
        for (p, epoch) in &epochs {
            if owned.contains_key(p) {
                continue;
            }
            let stale = meshd_meta::fence::Ownership::from_parts(owner_key(p), *epoch, None);
            match stale.release(self.meta.as_ref()).await {
                Ok(()) => {
                    tracing::info!(store = "owners", backend = %self.meta.backend(), topic = %p.0, partition = p.1, epoch, "released an owner key of an earlier run");
                    holders.remove(p);
                }
                Err(e) => {
                    tracing::warn!(store = "owners", backend = %self.meta.backend(), topic = %p.0, partition = p.1, error = %e, "releasing an owner key of an earlier run failed")
                }
            }
        }
        let since = {
            let mut since = self
                .member_since
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            since.retain(|m, _| members.contains(m));
            let now = std::time::Instant::now();
            for m in &members {
                since.entry(m.clone()).or_insert(now);
            }
            since.clone()
        };
        let ready = |m: &str| {
            since
                .get(m)
                .is_some_and(|t| t.elapsed() >= self.rebalance_delay)
        };
        let todo = plan_moves(
            &self.me,
            &members,
            &partitions,
            &holders,
            &Moves {
                ready: &ready,
                max: MOVES_PER_STEP,
            },
        );
        {
            let mut waiting = self
                .waiting_since
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            waiting.retain(|p, _| todo.waiting.contains(p) || todo.acquire.contains(p));
            for p in &todo.waiting {
                waiting
                    .entry(p.clone())
                    .or_insert_with(std::time::Instant::now);
            }
        }
        for p in &todo.release {
            let Some(o) = owned.remove(p) else { continue };
            self.release_one(p, o, &owned).await;
            holders.remove(p);
        }
        for p in &todo.acquire {
            match meshd_meta::fence::Ownership::acquire(
                self.meta.as_ref(),
                &owner_key(p),
                self.me.as_bytes(),
                Some(lease.id),
            )
            .await
            {
                Ok(o) => {
                    counters
                        .acquired
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let since = self
                        .waiting_since
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .remove(p);
                    if let Some(since) = since {
                        counters.takeover(since.elapsed());
                    }
                    tracing::info!(store = "owners", backend = %self.meta.backend(), topic = %p.0, partition = p.1, epoch = o.epoch(), "partition acquired");
                    holders.insert(p.clone(), self.me.clone());
                    owned.insert(p.clone(), o);
                }
                Err(e) => {
                    tracing::info!(store = "owners", backend = %self.meta.backend(), topic = %p.0, partition = p.1, error = %e, "partition not acquired yet")
                }
            }
        }
        self.directory.send_replace(std::sync::Arc::new(Directory {
            holders,
            addrs,
            oldest_release,
        }));
        if std::time::Instant::now() >= lease.deadline.deadline() {
            // Publish what is held so far, then drop it: it is counted as lost.
            self.owned.send_replace(std::sync::Arc::new(owned));
            self.drop_all("the membership lease deadline passed during the step");
        } else {
            counters
                .owned
                .store(owned.len() as u64, std::sync::atomic::Ordering::Relaxed);
            self.owned.send_replace(std::sync::Arc::new(owned));
        }
        Ok(())
    }
}

/// Every partition owner key in Meta: holder and epoch (`mod_revision`).
pub async fn owners(
    meta: &dyn meshd_meta::Meta,
) -> Result<BTreeMap<PartitionId, (String, i64)>, meshd_meta::MetaError> {
    use meshd_meta::keys::{prefix, KeyKind};
    let r = meta
        .range(
            &prefix(KeyKind::Owners, &["partition"]),
            meshd_meta::RangeOptions::default(),
        )
        .await?;
    Ok(r.kvs
        .iter()
        .filter_map(|kv| {
            let p = parse_owner_key(&kv.key)?;
            Some((
                p,
                (
                    String::from_utf8_lossy(&kv.value).into_owned(),
                    kv.mod_revision,
                ),
            ))
        })
        .collect())
}

/// The partition of an owner key, `None` for other owner kinds.
fn parse_owner_key(k: &[u8]) -> Option<PartitionId> {
    let base = meshd_meta::keys::prefix(meshd_meta::keys::KeyKind::Owners, &["partition"]);
    let rest = std::str::from_utf8(k.strip_prefix(base.as_slice())?).ok()?;
    let (topic, partition) = rest.rsplit_once('/')?;
    Some((meshd_meta::keys::unescape(topic)?, partition.parse().ok()?))
}

#[cfg(test)]
mod controller_tests {
    //! Two controllers with real memberships on one embedded Meta in one process: a
    //! test of the controller's logic (the cluster properties themselves are proven
    //! with real processes on etcd).
    use super::*;
    use crate::membership::Membership;
    use meshd_meta::Meta;
    use meshd_stores::topics::{MetaTopicStore, TopicStore};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    #[derive(Default)]
    struct Drains(Mutex<Vec<(PartitionId, i64)>>);

    #[async_trait::async_trait]
    impl Drain for Drains {
        async fn drain(&self, p: &PartitionId, o: &meshd_meta::fence::Ownership) {
            self.0.lock().unwrap().push((p.clone(), o.epoch()));
        }
    }

    struct Node {
        owned: tokio::sync::watch::Receiver<Owned>,
        drains: Arc<Drains>,
        membership: tokio::task::JoinHandle<()>,
        controller: tokio::task::JoinHandle<()>,
        stop: tokio::sync::watch::Sender<bool>,
        leave: tokio::sync::watch::Sender<bool>,
    }

    fn node(meta: &Arc<dyn Meta>, topics: &Arc<MetaTopicStore>, me: &str) -> Node {
        node_with_ttl(meta, topics, me, Duration::from_secs(1))
    }

    fn node_with_ttl(
        meta: &Arc<dyn Meta>,
        topics: &Arc<MetaTopicStore>,
        me: &str,
        ttl: Duration,
    ) -> Node {
        let m = Membership::new(meta.clone(), me.into(), "127.0.0.1:1".into(), ttl);
        let lease = m.lease();
        let (leave, leaving) = tokio::sync::watch::channel(false);
        let bg = crate::background::Background::new();
        let membership = m.spawn(&bg, leaving);
        let (tx, owned) = tokio::sync::watch::channel(Owned::default());
        let drains = Arc::new(Drains::default());
        let (stop, stopping) = tokio::sync::watch::channel(false);
        let controller = Controller {
            meta: meta.clone(),
            me: me.into(),
            lease,
            topics: topics.clone(),
            drain: drains.clone(),
            owned: tx,
            directory: tokio::sync::watch::channel(Default::default()).0,
            tick: Duration::from_millis(50),
            metrics: Default::default(),
            waiting_since: Default::default(),
            rebalance_delay: Duration::ZERO,
            member_since: Default::default(),
            stop: stopping,
        }
        .spawn(&bg);
        Node {
            owned,
            drains,
            membership,
            controller,
            stop,
            leave,
        }
    }

    fn set(n: &Node) -> BTreeSet<PartitionId> {
        n.owned.borrow().keys().cloned().collect()
    }

    async fn until(what: &str, mut f: impl FnMut() -> bool) {
        let end = tokio::time::Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(tokio::time::Instant::now() < end, "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn partitions_move_by_release_then_acquire_and_a_lost_lease_drops_them() {
        let dir = tempfile::tempdir().unwrap();
        let meta: Arc<dyn Meta> = Arc::new(
            meshd_meta_embedded::EmbeddedMeta::open_dir(dir.path(), Default::default()).unwrap(),
        );
        let topics = Arc::new(MetaTopicStore::start(meta.clone()).await.unwrap());
        topics.ensure("t", 16).await.unwrap();
        let all: BTreeSet<PartitionId> = (0..16).map(|p| ("t".to_string(), p)).collect();

        let a = node(&meta, &topics, "a");
        until("a owns every partition", || set(&a) == all).await;
        let b = node(&meta, &topics, "b");
        until("a and b split the partitions", || {
            let (sa, sb) = (set(&a), set(&b));
            !sb.is_empty()
                && sa.is_disjoint(&sb)
                && sa.union(&sb).cloned().collect::<BTreeSet<_>>() == all
        })
        .await;
        // What moved was drained by a first, with a's epoch, and b's epoch is newer.
        let drained = a.drains.0.lock().unwrap().clone();
        let moved: BTreeSet<PartitionId> = drained.iter().map(|(p, _)| p.clone()).collect();
        assert_eq!(moved, set(&b));
        for (p, old) in &drained {
            assert!(b.owned.borrow()[p].epoch() > *old);
        }
        // The designated split is the rendezvous one.
        let members = vec!["a".to_string(), "b".to_string()];
        for p in &all {
            let want = assign::owner(&members, &p.0, p.1).unwrap();
            assert_eq!(set(&a).contains(p), want == "a", "{p:?}");
        }

        // b stops renewing its membership: it drops everything at its local deadline
        // (before the lease can expire), then a takes it all back.
        b.membership.abort();
        until("b drops its partitions", || set(&b).is_empty()).await;
        until("a owns every partition again", || set(&a) == all).await;
    }

    /// A graceful stop releases every partition (drained with its epoch, owner key
    /// deleted) and revokes the membership lease: the other member owns everything at
    /// once, long before the stopped one's lease TTL (30 s here) could run out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_graceful_stop_hands_every_partition_over_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let meta: Arc<dyn Meta> = Arc::new(
            meshd_meta_embedded::EmbeddedMeta::open_dir(dir.path(), Default::default()).unwrap(),
        );
        let topics = Arc::new(MetaTopicStore::start(meta.clone()).await.unwrap());
        topics.ensure("t", 8).await.unwrap();
        let all: BTreeSet<PartitionId> = (0..8).map(|p| ("t".to_string(), p)).collect();
        let ttl = Duration::from_secs(30);
        let mut a = node_with_ttl(&meta, &topics, "a", ttl);
        let b = node_with_ttl(&meta, &topics, "b", ttl);
        until("a and b split the partitions", || {
            let (sa, sb) = (set(&a), set(&b));
            !sa.is_empty()
                && !sb.is_empty()
                && sa.union(&sb).cloned().collect::<BTreeSet<_>>() == all
        })
        .await;
        let held = set(&a);
        let started = std::time::Instant::now();
        a.stop.send_replace(true);
        tokio::time::timeout(Duration::from_secs(5), &mut a.controller)
            .await
            .expect("the controller ends after releasing")
            .unwrap();
        assert!(set(&a).is_empty(), "a acts on nothing any more");
        let drained: BTreeSet<PartitionId> = a
            .drains
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|(p, _)| p.clone())
            .collect();
        assert!(
            held.is_subset(&drained),
            "every partition drained: {drained:?}"
        );
        a.leave.send_replace(true);
        tokio::time::timeout(Duration::from_secs(5), &mut a.membership)
            .await
            .expect("the membership ends after revoking")
            .unwrap();
        assert!(
            crate::membership::members(meta.as_ref())
                .await
                .unwrap()
                .iter()
                .all(|m| m.instance != "a"),
            "a left the member list"
        );
        until("b owns every partition", || set(&b) == all).await;
        // A liveness bound from the configuration: far below the 30 s TTL that a
        // stop without a release would have to wait for.
        assert!(
            started.elapsed() < ttl / 6,
            "handed over in {:?}",
            started.elapsed()
        );
    }
}
