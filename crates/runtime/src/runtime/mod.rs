//! # The delivery runtime
//!
//! One [`partition::PartitionTask`] per (subscription incarnation, partition) drives a
//! sans-IO [`PartitionCore`]; this module starts and stops them as subscriptions come
//! and go (the SubscriptionStore's cache), routes pulls, acks, nacks, extends, redrives
//! and offset resets to them, and runs the boot recovery:
//!
//! 1. For every subscription: read the committed offsets and the delivery records of
//!    its incarnation; re-arm every in-flight or waiting delivery with its attempt
//!    count (`PartitionCore::recover`); partitions without a committed offset start at
//!    the subscription's start position.
//! 2. Re-inject every `redriving` dead-letter entry of this log (a crash between the
//!    entry's move to `redriving` and the redrive's first record would strand it).
//! 3. Only then is the runtime `recovered` (part of `/readyz`).
//!
//! Recovery starts only once the log ownership below is held.
//!
//! Dead-letter entries are written on behalf of this instance's **log ownership**: the
//! Meta key `owners/standalone/{log id}`, taken over at boot. Its `mod_revision` fences
//! the writes, so a stale process of the same log (which the data-dir lock already
//! prevents locally) cannot write entries after a newer one started.

pub mod attributes;
pub mod clock;
mod deps;
mod error;
pub mod forwarding;
pub mod handover;
pub mod partition;
pub mod push;
mod state;
pub mod stats;
pub mod stream;
mod types;

use crate::metrics::SubCounters;
use clock::now_ms;
pub use deps::{ClusterDeps, Deps};
pub use error::{kind_of, RuntimeError};
use futures::StreamExt;
use meshd_dispatch::{
    Config, DeliveryId, Input, Partition, PartitionCore, SessionBinding, Sources,
};
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{key, KeyKind};
use meshd_meta::Backend;
use meshd_stores::deadletters::{DeadLetterEntry, DeadLetterState};
use meshd_stores::delivery::DeliveryRecord;
use meshd_stores::offsets::{Committed, OffsetKey};
use meshd_stores::subscriptions::{StartPosition, Subscription, SubscriptionStore};
use meshd_stores::topics::TopicStore;
use partition::{Msg, PartitionTask, Shared};
use state::PartitionHandle;
pub use state::{Runtime, SubRuntime};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
pub use types::{offset_of, Answers, Handed, Outcome, PullBudget, Reach};

/// Requests queued per partition task before senders wait.
const QUEUE: usize = 256;
/// How often the log ownership is tried again while Meta is unreachable.
const OWNER_RETRY: Duration = Duration::from_secs(1);
/// Subscriptions started at once when the runtime reconciles (boot recovery).
const RECOVERY_PARALLELISM: usize = 4;

/// A partition's park index at its start (see `Runtime::parked_at_start`).
#[derive(Default)]
pub(super) struct ParkedAtStart {
    /// Offset → the attempts its park entry holds (read where a record names the
    /// offset; 0 otherwise: recovery looks at them only there).
    pub(super) offsets: BTreeMap<u64, u32>,
    count: u64,
    /// The keys whose first entry is held (ordered delivery; see `Input::KeysHeld`).
    held_keys: Vec<u64>,
}

impl Runtime {
    /// The share of subscription `name`'s partitions that run here (1 standalone;
    /// in cluster mode the owned share), `None` when it does not run here.
    pub fn local_share(&self, name: &str) -> Option<f64> {
        let sub = self.running(name)?;
        let total = sub.parts.len().max(1);
        Some(sub.running_parts().len() as f64 / total as f64)
    }
}

impl Runtime {
    pub fn new(deps: Deps) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            deps: Arc::new(deps),
            subs: RwLock::new(HashMap::new()),
            ops: tokio::sync::Mutex::new(()),
            recovered: AtomicBool::new(false),
            owner: Arc::new(RwLock::new(None)),
            me: me.clone(),
            forwarded: Default::default(),
            stopping: watch::channel(false).0,
            streams: Default::default(),
            attributes: Arc::default(),
        })
    }

    /// A graceful stop begins: every long poll answers now with what it has, and new
    /// ones do not wait.
    pub fn begin_stop(&self) {
        self.stopping.send_replace(true);
    }

    fn is_stopping(&self) -> bool {
        *self.stopping.borrow()
    }

    /// Waits until `deadline`, a wake-up on `woken`, or a graceful stop.
    async fn wait_for_more(
        &self,
        deadline: tokio::time::Instant,
        woken: &mut watch::Receiver<u64>,
    ) {
        let mut stopping = self.stopping.subscribe();
        if *stopping.borrow_and_update() {
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => {}
            _ = woken.changed() => {}
            _ = stopping.changed() => {}
        }
    }

    /// Recovery finished: every subscription known at boot is re-armed.
    pub fn is_recovered(&self) -> bool {
        self.recovered.load(Ordering::Acquire)
    }

    /// Whether the log ownership (needed for dead-letter writes) is held.
    pub fn holds_ownership(&self) -> bool {
        self.owner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Partitions that stopped after a store write failed.
    pub fn failures(&self) -> Vec<String> {
        self.all()
            .iter()
            .flat_map(|s| {
                s.running_parts()
                    .into_iter()
                    .filter_map(|p| p.shared.failed())
            })
            .collect()
    }

    fn all(&self) -> Vec<Arc<SubRuntime>> {
        self.subs
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    fn running(&self, name: &str) -> Option<Arc<SubRuntime>> {
        self.subs
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned()
    }

    /// Starts the background work: the log ownership, then recovery once the
    /// subscription cache is loaded, then following subscription changes. In that
    /// order: a recovered delivery that is due for the dead-letter store writes its
    /// entry at once, which needs the ownership (and `/readyz` says `recovery = ok`
    /// only after both).
    pub fn start(self: &Arc<Self>) {
        let rt = self.clone();
        if self.deps.cluster.is_some() {
            // Cluster mode: dead letters are fenced by each partition's owner key, and
            // nothing local is authoritative: partitions start from Meta as they are
            // acquired.
            let bg = &self.deps.background;
            bg.spawn(rt.clone().follow_ownership());
            bg.spawn(async move { rt.follow_subscriptions().await });
            return;
        }
        self.deps.background.spawn(async move {
            rt.acquire_ownership().await;
            rt.follow_subscriptions().await
        });
    }

    async fn acquire_ownership(&self) {
        let owner_key = key(KeyKind::Owners, &["standalone", self.deps.log.log_id()]);
        loop {
            match Ownership::take_over(
                self.deps.meta.as_ref(),
                &owner_key,
                self.deps.instance_id.as_bytes(),
                None,
            )
            .await
            {
                Ok(o) => {
                    tracing::info!(
                        store = "deadletters",
                        backend = %self.deps.meta_backend,
                        epoch = o.epoch(),
                        "log ownership taken"
                    );
                    *self.owner.write().unwrap_or_else(PoisonError::into_inner) = Some(o);
                    return;
                }
                Err(e) => {
                    tracing::warn!(store = "deadletters", backend = %self.deps.meta_backend, error = %e, "taking the log ownership failed; retrying");
                    tokio::time::sleep(OWNER_RETRY).await;
                }
            }
        }
    }

    async fn follow_subscriptions(self: Arc<Self>) {
        let mut changes = self.deps.subscriptions.changes();
        let mut topic_changes = self.deps.topics.changes();
        loop {
            if self.deps.subscriptions.health().is_ready() && self.deps.topics.health().is_ready() {
                let first = !self.is_recovered();
                let started = Instant::now();
                match self.reconcile().await {
                    Ok(records) if first => {
                        self.reinject_redrives().await;
                        self.deps.metrics.recovered(started.elapsed(), records);
                        self.recovered.store(true, Ordering::Release);
                        tracing::info!(
                            records,
                            took_ms = started.elapsed().as_millis() as u64,
                            "recovery done: delivery state re-armed"
                        );
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::error!(store = "deliveries", backend = "rocksdb", error = %e, "reconciling subscriptions failed; retrying");
                        tokio::time::sleep(OWNER_RETRY).await;
                        continue;
                    }
                }
            }
            tokio::select! {
                r = changes.changed() => if r.is_err() { return },
                r = topic_changes.changed() => if r.is_err() { return },
            }
        }
    }

    /// Starts what the cache has and this runtime does not run, stops what is gone,
    /// rebuilds what changed. Returns the delivery records re-armed.
    async fn reconcile(&self) -> Result<u64, RuntimeError> {
        let subs = self
            .deps
            .subscriptions
            .list()
            .await
            .map_err(|e| RuntimeError::Unavailable {
                store: "subscriptions",
                backend: self.deps.meta_backend,
                detail: e.to_string(),
            })?;
        let _ops = self.ops.lock().await;
        let mut records = 0;
        let wanted: HashMap<String, Subscription> = subs
            .into_iter()
            .map(|s| (s.name().to_string(), s))
            .collect();
        for running in self.all() {
            match wanted.get(running.sub.name()) {
                Some(s) if s.incarnation == running.sub.incarnation => {}
                _ => {
                    // Deleted (or deleted and re-created) elsewhere: drop its state.
                    self.stop_locked(running.sub.name()).await;
                    self.drop_state(&running.sub).await;
                }
            }
        }
        // Subscriptions start a few at a time: each one's records are read on the
        // blocking pool, so a boot with many subscriptions uses every core
        // (meshd-bench recovery). Every start runs to its end, none is cancelled
        // half-way by another's error; the first error is returned.
        let starts: Vec<_> = wanted.values().map(|sub| self.ensure_locked(sub)).collect();
        let results: Vec<Result<u64, RuntimeError>> = futures::stream::iter(starts)
            .buffer_unordered(RECOVERY_PARALLELISM)
            .collect()
            .await;
        for r in results {
            records += r?;
        }
        Ok(records)
    }

    /// Makes the runtime run `sub` as given (called by the PUT handler, so a pull
    /// right after a create is served). Returns the records re-armed.
    pub async fn ensure(&self, sub: &Subscription) -> Result<u64, RuntimeError> {
        let _ops = self.ops.lock().await;
        self.ensure_locked(sub).await
    }

    async fn ensure_locked(&self, sub: &Subscription) -> Result<u64, RuntimeError> {
        if let Some(running) = self.running(sub.name()) {
            if running.sub.incarnation == sub.incarnation && running.sub.revision >= sub.revision {
                return Ok(0);
            }
            let same = running.sub.incarnation == sub.incarnation;
            self.stop_locked(sub.name()).await;
            if !same {
                self.drop_state(&running.sub).await;
            }
        }
        self.start_locked(sub).await
    }

    /// A subscription incarnation was deleted: stops its tasks and drops its offsets
    /// and delivery records.
    pub async fn forget(&self, name: &str, incarnation: i64) {
        let _ops = self.ops.lock().await;
        if self
            .running(name)
            .is_some_and(|s| s.sub.incarnation == incarnation)
        {
            self.stop_locked(name).await;
        }
        self.drop_incarnation(name, incarnation).await;
    }

    async fn stop_locked(&self, name: &str) {
        let removed = self
            .subs
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(name);
        if let Some(sub) = removed {
            if let Some(w) = &sub.push {
                w.abort();
            }
            for p in sub.running_parts() {
                Self::stop_handle(&p).await;
            }
        }
    }

    /// Stops one partition task: it finishes the request at hand (its state is in
    /// the stores) and ends.
    /// Stops a partition task after the work it has queued; returns the offsets above
    /// its committed one that were resolved already (empty when it had ended).
    /// Stops a partition's task; the offsets it had resolved above its committed one,
    /// or `None` when the task had ended already (it cannot say).
    async fn stop_handle(p: &PartitionHandle) -> Option<Vec<u64>> {
        let (tx, rx) = oneshot::channel();
        let mut resolved = None;
        if p.tx.send(Msg::Stop { reply: tx }).await.is_ok() {
            resolved = rx.await.ok();
        }
        p.join.abort();
        resolved
    }

    async fn drop_state(&self, sub: &Subscription) {
        self.drop_incarnation(sub.name(), sub.incarnation).await
    }

    async fn drop_incarnation(&self, name: &str, incarnation: i64) {
        if let Some(cluster) = &self.deps.cluster {
            if let Err(e) = cluster.ledger.drop_subscription(name, incarnation).await {
                tracing::warn!(store = "attempts", backend = %self.deps.meta_backend, subscription = %name, error = %e, "dropping a deleted subscription's attempt ledgers failed");
            }
            if let Err(e) = self
                .deps
                .offsets
                .drop_checkpoints(self.deps.meta.as_ref(), name, incarnation)
                .await
            {
                tracing::warn!(store = "checkpoints", backend = %self.deps.meta_backend, subscription = %name, error = %e, "dropping a deleted subscription's checkpoints failed");
            }
        }
        if let Err(e) = self.deps.offsets.drop_subscription(name, incarnation).await {
            tracing::warn!(store = "offsets", backend = "rocksdb", subscription = %name, error = %e, "dropping a deleted subscription's offsets failed");
        }
        if let Err(e) = self
            .deps
            .deliveries
            .drop_subscription(name, incarnation)
            .await
        {
            tracing::warn!(store = "deliveries", backend = "rocksdb", subscription = %name, error = %e, "dropping a deleted subscription's deliveries failed");
        }
        if let Err(e) = self.deps.parks.drop_subscription(name, incarnation).await {
            tracing::warn!(store = "parks", backend = "rocksdb", subscription = %name, error = %e, "dropping a deleted subscription's park entries failed");
        }
    }

    fn key(sub: &Subscription, partition: u32) -> OffsetKey {
        OffsetKey {
            subscription: sub.name().to_string(),
            incarnation: sub.incarnation,
            topic: sub.spec.topic.clone(),
            partition,
        }
    }

    async fn partitions_of(&self, sub: &Subscription) -> Result<u32, RuntimeError> {
        match self.deps.topics.get(&sub.spec.topic).await {
            Ok(Some(t)) => Ok(t.partitions),
            Ok(None) => Err(RuntimeError::Conflict(format!(
                "topic {:?} of subscription {:?} does not exist",
                sub.spec.topic,
                sub.name()
            ))),
            Err(e) => Err(RuntimeError::Unavailable {
                store: "topics",
                backend: self.deps.meta_backend,
                detail: e.to_string(),
            }),
        }
    }

    /// The committed offset of a partition, initialising it (at the start position)
    /// when the subscription has none there yet.
    async fn committed_or_start(
        &self,
        sub: &Subscription,
        key: &OffsetKey,
    ) -> Result<Committed, RuntimeError> {
        let failed =
            |e: meshd_stores::offsets::OffsetError| RuntimeError::StoreFailed(e.to_string());
        if let Some(c) = self.deps.offsets.get(key).await.map_err(failed)? {
            return Ok(c);
        }
        let b = self
            .deps
            .log
            .bounds(&key.topic, key.partition)
            .await
            .map_err(|e| RuntimeError::StoreFailed(e.to_string()))?;
        let start = match sub.spec.start {
            StartPosition::Latest => b.end,
            StartPosition::Earliest => b.start,
        };
        self.deps.offsets.commit(key, start).await.map_err(failed)
    }

    async fn start_locked(&self, sub: &Subscription) -> Result<u64, RuntimeError> {
        let partitions = self.partitions_of(sub).await?;
        if self.deps.cluster.is_some() {
            self.init_checkpoints(sub, partitions).await?;
            let running = Arc::new(SubRuntime {
                sub: sub.clone(),
                parts: (0..partitions).map(|_| RwLock::new(None)).collect(),
                notify: watch::channel(0u64).0,
                rr: AtomicUsize::new(0),
                push: self.push_worker(sub),
            });
            self.apply_ownership(&running).await;
            self.subs
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(sub.name().to_string(), running);
            return Ok(0);
        }
        self.deps
            .deliveries
            .flush()
            .await
            .map_err(|e| RuntimeError::StoreFailed(e.to_string()))?;
        let all = self
            .deps
            .deliveries
            .load_subscription(sub.name(), sub.incarnation)
            .await
            .map_err(|e| RuntimeError::StoreFailed(e.to_string()))?;
        let total = all.len() as u64;
        let mut by_partition: BTreeMap<u32, Vec<DeliveryRecord>> = BTreeMap::new();
        for r in all {
            by_partition.entry(r.key.partition).or_default().push(r);
        }
        let counters = self.deps.metrics.subscription(sub.name());
        let (notify, _) = watch::channel(0u64);
        let mut parts = Vec::with_capacity(partitions as usize);
        for p in 0..partitions {
            let key = Self::key(sub, p);
            let committed = self.committed_or_start(sub, &key).await?;
            let records = by_partition.remove(&p).unwrap_or_default();
            let parked = self
                .parked_at_start(&key, committed.offset, &records)
                .await?;
            parts.push(RwLock::new(Some(Arc::new(self.spawn_partition(
                sub,
                key,
                committed,
                records,
                parked,
                counters.clone(),
                notify.clone(),
                None,
            )?))));
        }
        let push = self.push_worker(sub);
        let running = Arc::new(SubRuntime {
            sub: sub.clone(),
            parts,
            notify,
            rr: AtomicUsize::new(0),
            push,
        });
        self.subs
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(sub.name().to_string(), running);
        Ok(total)
    }

    /// Where work that outlives a request runs (a graceful stop ends it).
    pub fn background(&self) -> &crate::background::Background {
        &self.deps.background
    }

    /// The address rules of push (`PUT` checks a literal address with them).
    pub fn push_egress(&self) -> &crate::egress::Egress {
        &self.deps.push_egress
    }

    /// The push worker of a push subscription.
    fn push_worker(&self, sub: &Subscription) -> Option<tokio::task::JoinHandle<()>> {
        let p = sub.spec.push.as_ref()?;
        match push::Target::parse(&p.url) {
            Ok(target) => Some(self.deps.background.spawn(push::worker(
                self.me.clone(),
                sub.name().to_string(),
                push::PushSettings::of(sub, target)?,
                push::transport(self.deps.push_tls.clone(), self.deps.push_egress.clone()),
                self.deps.metrics.subscription(sub.name()),
                self.deps.background.clone(),
            ))),
            Err(e) => {
                tracing::error!(subscription = %sub.name(), error = %e, "push URL cannot be served; the subscription is not pushed (pull still works)");
                None
            }
        }
    }

    /// What recovery needs of the park index: the parked offsets that have a record
    /// (unparked, not settled; with their entries' attempts) or are at or above
    /// `committed` (parked above a gap), and how many entries the partition has.
    pub(super) async fn parked_at_start(
        &self,
        key: &OffsetKey,
        committed: u64,
        records: &[DeliveryRecord],
    ) -> Result<ParkedAtStart, RuntimeError> {
        let parks = &self.deps.parks;
        let failed = |e: meshd_stores::delivery::DeliveryError| {
            RuntimeError::StoreFailed(format!("parks: {e}"))
        };
        let count = parks.count(key).await.map_err(failed)?;
        if count == 0 {
            return Ok(ParkedAtStart::default());
        }
        let below: Vec<u64> = records
            .iter()
            .map(|r| r.offset)
            .filter(|o| *o < committed)
            .collect();
        let mut offsets: BTreeMap<u64, u32> = parks
            .parked_among(key, below)
            .await
            .map_err(failed)?
            .into_iter()
            .map(|o| (o, 0))
            .collect();
        // At most the core's window: only events read above a gap are parked there.
        offsets.extend(
            parks
                .offsets_from(key, committed, usize::MAX)
                .await
                .map_err(failed)?
                .into_iter()
                .map(|o| (o, 0)),
        );
        // The attempts of the entries a record names (at most those in flight).
        for r in records {
            if let Some(attempt) = offsets.get_mut(&r.offset) {
                if let Some(p) = parks.entry(key, r.offset).await.map_err(failed)? {
                    *attempt = p.attempt;
                }
            }
        }
        let held_keys = parks.held_keys(key).await.map_err(failed)?;
        Ok(ParkedAtStart {
            offsets,
            count,
            held_keys,
        })
    }

    /// Spawns a partition task. `owned`: in cluster mode, the ownership it runs under
    /// and its Meta state (dead letters are then fenced by that ownership instead of
    /// the log's).
    #[allow(clippy::too_many_arguments)]
    fn spawn_partition(
        &self,
        sub: &Subscription,
        key: OffsetKey,
        committed: Committed,
        records: Vec<DeliveryRecord>,
        parked: ParkedAtStart,
        counters: Arc<SubCounters>,
        notify: watch::Sender<u64>,
        owned: Option<(Ownership, partition::PartitionCluster)>,
    ) -> Result<PartitionHandle, RuntimeError> {
        let reset_epoch = committed.epoch;
        let committed = committed.offset;
        let mut config = Config::from_spec(&sub.spec);
        config.max_in_flight = self.deps.max_in_flight;
        // Retries are parked unless a cluster member could not take them over.
        let parking = owned.as_ref().is_none_or(|(_, c)| c.parking_allowed());
        config.park_retries_after_ms = parking.then_some(self.deps.park_retries_after_ms);
        let epoch = owned.as_ref().map(|(o, _)| o.epoch()).unwrap_or(0);
        let partition_no = key.partition;
        let partition = Partition {
            key,
            log_id: self.deps.log.log_id().to_string(),
            owner_epoch: epoch,
            reset_epoch,
        };
        let (mut core, mut initial) = PartitionCore::recover(
            partition,
            config,
            committed,
            records,
            &parked.offsets,
            now_ms(),
            Sources::production(self.deps.id_key.clone()),
        )
        .map_err(|e| RuntimeError::Core(e.to_string()))?;
        if !parked.held_keys.is_empty() {
            // Keys held by nobody after a crash (their release was cut off) go again.
            let more = core
                .handle(Input::KeysHeld(parked.held_keys), now_ms())
                .map_err(|e| RuntimeError::Core(e.to_string()))?;
            initial.extend(more);
        }
        let (tx, rx) = mpsc::channel(QUEUE);
        let shared = Arc::new(Shared::default());
        shared.committed.store(committed, Ordering::Release);
        shared.parked.store(parked.count, Ordering::Release);
        if let Some((_, c)) = &owned {
            shared.checkpointed_at_ms.store(now_ms(), Ordering::Release);
            shared
                .ledger_records
                .store(c.ledger_state.records(), Ordering::Release);
        }
        let (owner, cluster) = match owned {
            Some((o, c)) => (Arc::new(RwLock::new(Some(o))), Some(c)),
            None => (self.owner.clone(), None),
        };
        let lost = cluster.as_ref().map(|c| c.lost.clone()).unwrap_or_default();
        let part_counters = counters.partition(partition_no);
        let task = PartitionTask {
            core,
            deps: self.deps.clone(),
            owner,
            counters,
            part_counters,
            shared: shared.clone(),
            notify,
            rx,
            initial,
            next_pull: 1,
            stats_at: None,
            stats_dirty: false,
            cluster,
            pending: Default::default(),
            submitted: None,
            attributes: self.attributes.clone(),
            park: partition::ParkState::at_start(parked.count),
        };
        let join = self.deps.background.spawn(task.run());
        Ok(PartitionHandle {
            tx,
            shared,
            join,
            epoch,
            lost,
        })
    }

    /// Re-injects every `redriving` entry of this log whose subscription runs here.
    async fn reinject_redrives(&self) {
        for sub in self.all() {
            let mut cursor: Option<String> = None;
            loop {
                let page = match self
                    .deps
                    .deadletters
                    .list(Some(sub.sub.name()), 1000, cursor.as_deref())
                    .await
                {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!(store = "deadletters", backend = %self.deps.meta_backend, subscription = %sub.sub.name(), error = %e, "listing redriving entries at boot failed; a stranded redrive can be started again with POST .../redrive");
                        break;
                    }
                };
                for entry in &page.entries {
                    if entry.state == DeadLetterState::Redriving {
                        if let Err(e) = self.inject_redrive(entry).await {
                            tracing::warn!(store = "deadletters", entry = %entry.id, error = %e, "re-injecting a redrive failed");
                        }
                    }
                }
                match page.next_cursor {
                    Some(c) => cursor = Some(c),
                    None => break,
                }
            }
        }
    }

    /// Looks the subscription up in the runtime, starting it when the cache has it
    /// and the runtime does not yet (a create on another instance).
    async fn subscription(&self, name: &str) -> Result<Arc<SubRuntime>, RuntimeError> {
        if let Some(s) = self.running(name) {
            return Ok(s);
        }
        match self.deps.subscriptions.get(name).await {
            Ok(Some(sub)) => {
                self.ensure(&sub).await?;
                self.running(name)
                    .ok_or_else(|| RuntimeError::Restarting(name.to_string()))
            }
            Ok(None) => Err(RuntimeError::NotFound(name.to_string())),
            Err(e) => Err(RuntimeError::Unavailable {
                store: "subscriptions",
                backend: self.deps.meta_backend,
                detail: e.to_string(),
            }),
        }
    }

    /// Up to `max` deliveries from the subscription's partitions (lowest ready offsets
    /// per partition, partitions taken in rotation), waiting up to `wait` for some.
    pub async fn pull(
        &self,
        name: &str,
        budget: PullBudget,
        wait: Duration,
        session: Option<SessionBinding>,
        reach: Reach,
    ) -> Result<Vec<Handed>, RuntimeError> {
        self.subscription(name).await?;
        if self.deps.cluster.is_some() && reach == Reach::Cluster {
            return self.pull_cluster(name, budget, wait, session).await;
        }
        self.pull_running(name, budget, wait, session).await
    }

    /// The subscription as it runs now, without starting it (the push workers and
    /// the loops behind the public calls use this, so starting a subscription is
    /// never reached from inside one of its own tasks). `Restarting` while its
    /// settings are being applied.
    fn running_now(&self, name: &str) -> Result<Arc<SubRuntime>, RuntimeError> {
        match self.running(name) {
            Some(s) => Ok(s),
            None if self.deps.subscriptions.health().is_ready() => {
                Err(RuntimeError::Restarting(name.to_string()))
            }
            None => Err(RuntimeError::Unavailable {
                store: "subscriptions",
                backend: self.deps.meta_backend,
                detail: "the subscription cache is not loaded".into(),
            }),
        }
    }

    /// [`Runtime::pull`] on a subscription that runs already.
    pub async fn pull_running(
        &self,
        name: &str,
        budget: PullBudget,
        wait: Duration,
        session: Option<SessionBinding>,
    ) -> Result<Vec<Handed>, RuntimeError> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let sub = match self.running_now(name) {
                Ok(s) => s,
                Err(RuntimeError::Restarting(_)) if tokio::time::Instant::now() < deadline => {
                    // Settings are being applied; the new tasks appear shortly.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                Err(e) => return Err(e),
            };
            let mut woken = sub.notify.subscribe();
            woken.borrow_and_update();
            let mut got = Vec::new();
            // A partition that fail-stopped (a Local write failed) hands nothing out
            // until a restart: a pull that gets nothing elsewhere answers with that
            // failure, never with an empty list as if there were nothing to deliver.
            let mut failed = None;
            let n = sub.parts.len();
            let first = sub.rr.fetch_add(1, Ordering::Relaxed);
            for i in 0..n {
                let Some(left) = budget.after(&got) else {
                    break;
                };
                let p = (first + i) % n;
                // Cluster mode: a partition owned elsewhere is not served here.
                let Some(part) = sub.part(p) else {
                    continue;
                };
                if let Some(reason) = part.shared.failed() {
                    failed.get_or_insert(reason);
                    continue;
                }
                let claim = part.shared.claim(left.max_events);
                if claim.is_none() && !self.log_has_more(&sub.sub, p as u32, &part).await {
                    continue;
                }
                let (tx, rx) = oneshot::channel();
                let msg = Msg::Pull {
                    budget: left,
                    session: session.clone(),
                    reply: tx,
                };
                if part.tx.send(msg).await.is_err() {
                    continue;
                }
                if let Some(c) = claim {
                    c.sent();
                }
                match rx.await {
                    Ok(Ok(mut d)) => got.append(&mut d),
                    Ok(Err(e)) if got.is_empty() => return Err(e),
                    Ok(Err(_)) | Err(_) => {}
                }
            }
            if let (true, Some(reason)) = (got.is_empty(), failed) {
                return Err(RuntimeError::StoreFailed(reason));
            }
            if !got.is_empty() || tokio::time::Instant::now() >= deadline || self.is_stopping() {
                return Ok(got);
            }
            // A partition that becomes ready (an append, a due retry, a lease that
            // ran out) bumps `notify`; a settings change replaces the runtime, so
            // wake up now and then to find it.
            let step = deadline.min(tokio::time::Instant::now() + Duration::from_secs(1));
            self.wait_for_more(step, &mut woken).await;
        }
    }

    /// Whether the log holds events the partition task has not seen yet (it learns
    /// of appends asynchronously; a pull must not miss an event published before it).
    async fn log_has_more(
        &self,
        sub: &Subscription,
        partition: u32,
        part: &PartitionHandle,
    ) -> bool {
        match self.deps.log.bounds(&sub.spec.topic, partition).await {
            Ok(b) => b.end > part.shared.log_end.load(Ordering::Acquire),
            Err(_) => false,
        }
    }

    /// Hand-outs that never reached a consumer (see [`Msg::Release`]), on the
    /// partitions running here: due again at once, the attempt not counted. Returns
    /// how many were still in flight.
    pub async fn release(&self, name: &str, ids: Vec<String>) -> usize {
        let mut unknown = Vec::new();
        let Ok((sub, routed)) = self.route(name, ids, &mut unknown).await else {
            return 0;
        };
        let mut released = 0;
        for (p, ids) in routed {
            let Some(part) = sub.part(p as usize) else {
                continue;
            };
            let (tx, rx) = oneshot::channel();
            if part.tx.send(Msg::Release { ids, reply: tx }).await.is_ok() {
                released += rx.await.unwrap_or(0);
            }
        }
        self.deps.metrics.released(released as u64);
        released
    }

    /// Routes ids to their partitions; ids that name no current partition of this
    /// incarnation are `unknown`.
    async fn route(
        &self,
        name: &str,
        ids: Vec<String>,
        unknown: &mut Vec<String>,
    ) -> Result<(Arc<SubRuntime>, BTreeMap<u32, Vec<String>>), RuntimeError> {
        let sub = self.running_now(name)?;
        let mut by_partition: BTreeMap<u32, Vec<String>> = BTreeMap::new();
        for id in ids {
            match DeliveryId::parse(&id) {
                Some(d)
                    if d.incarnation == sub.sub.incarnation
                        && (d.partition as usize) < sub.parts.len() =>
                {
                    by_partition.entry(d.partition).or_default().push(id)
                }
                _ => unknown.push(id),
            }
        }
        Ok((sub, by_partition))
    }

    /// Sends one request per partition and merges the answers. Ids of a partition
    /// this instance does not run (cluster mode) go to its owner when `forward` says
    /// how (the internal route and the request's other fields); without it they are
    /// `unknown` here (an internal call, or the push worker, whose partition moved).
    async fn per_partition(
        &self,
        name: &str,
        ids: Vec<String>,
        make: impl Fn(Vec<String>, oneshot::Sender<Result<Answers, RuntimeError>>) -> Msg,
        forward: Option<forwarding::Forward>,
    ) -> Result<Answers, RuntimeError> {
        let mut unknown = Vec::new();
        let (sub, routed) = self.route(name, ids, &mut unknown).await?;
        let mut answers = Answers::default();
        answers
            .lists
            .extend(unknown.into_iter().map(|id| (Outcome::Unknown, id)));
        let mut waiting = Vec::new();
        let mut elsewhere: BTreeMap<u32, Vec<String>> = BTreeMap::new();
        for (p, ids) in routed {
            let Some(part) = sub.part(p as usize) else {
                elsewhere.insert(p, ids);
                continue;
            };
            let (tx, rx) = oneshot::channel();
            if part.tx.send(make(ids, tx)).await.is_err() {
                return Err(RuntimeError::Restarting(name.to_string()));
            }
            waiting.push(rx);
        }
        if !elsewhere.is_empty() {
            match &forward {
                Some(f) if self.deps.cluster.is_some() => {
                    let more = self
                        .forward_to_owners(name, &sub.sub.spec.topic, elsewhere, f)
                        .await?;
                    answers.lists.extend(more.lists);
                }
                _ => answers.lists.extend(
                    elsewhere
                        .into_values()
                        .flatten()
                        .map(|id| (Outcome::Unknown, id)),
                ),
            }
        }
        for rx in waiting {
            match rx.await {
                Ok(Ok(a)) => answers.lists.extend(a.lists),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(RuntimeError::Restarting(name.to_string())),
            }
        }
        Ok(answers)
    }

    pub async fn ack(
        &self,
        name: &str,
        ids: Vec<String>,
        reach: Reach,
    ) -> Result<Answers, RuntimeError> {
        self.subscription(name).await?;
        let forward = (reach == Reach::Cluster).then(forwarding::Forward::ack);
        let answers = self
            .per_partition(name, ids, |ids, reply| Msg::Ack { ids, reply }, forward)
            .await?;
        self.streams.answered(&answers, None);
        self.tell_holders(name, &answers);
        Ok(answers)
    }

    /// [`Runtime::ack`] on a subscription that runs already, for this instance's
    /// partitions only (the push worker, which must not start a subscription).
    pub async fn ack_running(&self, name: &str, ids: Vec<String>) -> Result<Answers, RuntimeError> {
        self.per_partition(name, ids, |ids, reply| Msg::Ack { ids, reply }, None)
            .await
    }

    /// Nacks: each delivery is retried after `delay_ms` when given (instead of the
    /// backoff), or dead-lettered at `max_attempts`.
    pub async fn nack(
        &self,
        name: &str,
        ids: Vec<String>,
        reason: String,
        delay_ms: Option<u64>,
        reach: Reach,
    ) -> Result<Answers, RuntimeError> {
        self.subscription(name).await?;
        let forward =
            (reach == Reach::Cluster).then(|| forwarding::Forward::nack(&reason, delay_ms));
        let answers = self.nack_on(name, ids, reason, delay_ms, forward).await?;
        self.streams.answered(&answers, None);
        self.tell_holders(name, &answers);
        Ok(answers)
    }

    /// [`Runtime::nack`] on a subscription that runs already, for this instance's
    /// partitions only.
    pub async fn nack_running(
        &self,
        name: &str,
        ids: Vec<String>,
        reason: String,
    ) -> Result<Answers, RuntimeError> {
        self.nack_on(name, ids, reason, None, None).await
    }

    async fn nack_on(
        &self,
        name: &str,
        ids: Vec<String>,
        reason: String,
        delay_ms: Option<u64>,
        forward: Option<forwarding::Forward>,
    ) -> Result<Answers, RuntimeError> {
        self.per_partition(
            name,
            ids,
            |ids, reply| Msg::Nack {
                ids,
                reason: reason.clone(),
                delay_ms,
                reply,
            },
            forward,
        )
        .await
    }

    pub async fn extend(
        &self,
        name: &str,
        ids: Vec<String>,
        ack_timeout_ms: Option<u64>,
        reach: Reach,
    ) -> Result<Answers, RuntimeError> {
        let sub = self.subscription(name).await?;
        let ack_timeout_ms = ack_timeout_ms.unwrap_or(sub.sub.spec.ack_timeout_ms);
        let forward =
            (reach == Reach::Cluster).then(|| forwarding::Forward::extend(ack_timeout_ms));
        let answers = self
            .per_partition(
                name,
                ids,
                |ids, reply| Msg::Extend {
                    ids,
                    ack_timeout_ms,
                    reply,
                },
                forward,
            )
            .await?;
        self.streams
            .answered(&answers, Some(Duration::from_millis(ack_timeout_ms)));
        Ok(answers)
    }

    /// Starts delivering a dead-lettered event again (the entry must already be
    /// `redriving`). `Conflict` when its subscription incarnation is gone or the entry
    /// belongs to another instance's log.
    pub async fn inject_redrive(&self, entry: &DeadLetterEntry) -> Result<(), RuntimeError> {
        let (sub, partition) = self.check_redrive_target(entry).await?;
        let part = sub
            .part(partition)
            .ok_or_else(|| RuntimeError::Restarting(entry.subscription.clone()))?;
        let (tx, rx) = oneshot::channel();
        part.tx
            .send(Msg::Redrive {
                entry_id: entry.id.clone(),
                offset: entry.offset,
                reply: tx,
            })
            .await
            .map_err(|_| RuntimeError::Restarting(entry.subscription.clone()))?;
        rx.await
            .map_err(|_| RuntimeError::Restarting(entry.subscription.clone()))?
    }

    /// Whether a redrive of `entry` can run here: its subscription incarnation runs
    /// on this instance and the entry is of this instance's log.
    pub async fn check_redrive_target(
        &self,
        entry: &DeadLetterEntry,
    ) -> Result<(Arc<SubRuntime>, usize), RuntimeError> {
        if entry.log_id != self.deps.log.log_id() {
            return Err(RuntimeError::Conflict(format!(
                "dead-letter entry {} belongs to log {:?}; redrive it on the instance that serves that log",
                entry.id, entry.log_id
            )));
        }
        let sub = match self.subscription(&entry.subscription).await {
            Ok(s) if s.sub.incarnation == entry.subscription_incarnation => s,
            Ok(_) | Err(RuntimeError::NotFound(_)) => {
                return Err(RuntimeError::Conflict(format!(
                    "subscription {:?} of dead-letter entry {} no longer exists",
                    entry.subscription, entry.id
                )))
            }
            Err(e) => return Err(e),
        };
        if entry.partition as usize >= sub.parts.len() {
            return Err(RuntimeError::NoPartition {
                name: entry.subscription.clone(),
                partition: entry.partition,
            });
        }
        let Some(part) = sub.part(entry.partition as usize) else {
            return Err(RuntimeError::Conflict(format!(
                "partition {} of subscription {:?} is owned by another instance; redrive it there",
                entry.partition, entry.subscription
            )));
        };
        // A dead-lettered offset counts as resolved, but the committed offset passes
        // it only once every lower offset is resolved too; a redrive waits for that
        // (the core tracks redrives below the committed offset only). The durable
        // value decides (reading it makes an ack's pending advance durable): a power
        // cut must not take the committed offset back below a redrive under way.
        let key = Self::key(&sub.sub, entry.partition);
        let durable = self
            .deps
            .offsets
            .get(&key)
            .await
            .map_err(|e| RuntimeError::StoreFailed(e.to_string()))?
            .map(|c| c.offset)
            .unwrap_or(0);
        let committed = part.shared.committed.load(Ordering::Acquire).min(durable);
        if entry.offset >= committed {
            return Err(RuntimeError::Conflict(format!(
                "offset {} of partition {} is not committed yet (committed offset {committed}: a lower offset is still being delivered); redrive it once that is resolved",
                entry.offset, entry.partition
            )));
        }
        Ok((sub, entry.partition as usize))
    }

    /// The committed offsets of a subscription's partitions (durable values).
    pub async fn offsets(&self, name: &str) -> Result<Vec<(u32, Committed)>, RuntimeError> {
        let sub = self.subscription(name).await?;
        let mut out = Vec::with_capacity(sub.parts.len());
        for p in 0..sub.parts.len() as u32 {
            let key = Self::key(&sub.sub, p);
            let c = if self.deps.cluster.is_some() && sub.part(p as usize).is_none() {
                // Owned elsewhere: its last checkpoint in Meta.
                self.deps
                    .offsets
                    .load_checkpoint(self.deps.meta.as_ref(), &key)
                    .await
                    .map_err(|e| RuntimeError::Unavailable {
                        store: "checkpoints",
                        backend: self.deps.meta_backend,
                        detail: e.to_string(),
                    })?
            } else {
                self.deps
                    .offsets
                    .get(&key)
                    .await
                    .map_err(|e| RuntimeError::StoreFailed(e.to_string()))?
            };
            out.push((
                p,
                c.unwrap_or(Committed {
                    offset: 0,
                    epoch: 0,
                    at_ms: 0,
                }),
            ));
        }
        Ok(out)
    }

    /// An explicit reset of one partition's committed offset (it may move backwards):
    /// the partition stops, its in-flight deliveries are dropped (their ids become
    /// `unknown`; redrives under way go back to `dead`), the offset is reset with a new
    /// epoch, and the partition restarts from it.
    /// In cluster mode the partition's owner does it (`Reach::Local`: this instance
    /// must own it; otherwise the request goes to the owner).
    pub async fn reset_offset(
        &self,
        name: &str,
        partition: u32,
        offset: u64,
        reach: Reach,
    ) -> Result<Committed, RuntimeError> {
        let sub = self.subscription(name).await?;
        if partition as usize >= sub.parts.len() {
            return Err(RuntimeError::NoPartition {
                name: name.to_string(),
                partition,
            });
        }
        let key = Self::key(&sub.sub, partition);
        let bounds = self
            .deps
            .log
            .bounds(&key.topic, partition)
            .await
            .map_err(|e| RuntimeError::StoreFailed(e.to_string()))?;
        if offset > bounds.end || offset < bounds.start {
            return Err(RuntimeError::Invalid(format!(
                "offset {offset} is outside the retained partition {}..={}",
                bounds.start, bounds.end
            )));
        }
        if self.deps.cluster.is_some() {
            return self
                .reset_in_cluster(&sub, partition, offset, reach == Reach::Local)
                .await;
        }
        let _ops = self.ops.lock().await;
        // Stop the whole subscription, reset, start it again: the other partitions
        // recover exactly where they were.
        self.stop_locked(name).await;
        let result = self.reset_locked(&sub.sub, &key, offset).await;
        let restarted = self.start_locked(&sub.sub).await;
        let committed = result?;
        restarted?;
        Ok(committed)
    }

    pub(super) async fn reset_locked(
        &self,
        sub: &Subscription,
        key: &OffsetKey,
        offset: u64,
    ) -> Result<Committed, RuntimeError> {
        let failed =
            |e: meshd_stores::delivery::DeliveryError| RuntimeError::StoreFailed(e.to_string());
        self.deps.deliveries.flush().await.map_err(failed)?;
        let records: Vec<DeliveryRecord> = self
            .deps
            .deliveries
            .load_subscription(sub.name(), sub.incarnation)
            .await
            .map_err(failed)?
            .into_iter()
            .filter(|r| r.key == *key)
            .collect();
        let committed_before = self
            .deps
            .offsets
            .get(key)
            .await
            .map_err(|e| RuntimeError::StoreFailed(e.to_string()))?
            .map(|c| c.offset)
            .unwrap_or(0);
        let log_id = self.deps.log.log_id().to_string();
        for r in records.iter().filter(|r| r.offset < committed_before) {
            // A redrive under way: its entry goes back to `dead`.
            let id = Partition {
                key: key.clone(),
                log_id: log_id.clone(),
                owner_epoch: 0,
                reset_epoch: 0,
            }
            .dead_letter_id(r.offset);
            if let Err(e) = self
                .deps
                .deadletters
                .redrive_failed(&id, "offset reset during redrive", r.attempt)
                .await
            {
                tracing::warn!(store = "deadletters", backend = %self.deps.meta_backend, entry = %id, error = %e, "returning a redrive to dead at an offset reset failed");
            }
        }
        let remove: Vec<_> = records.iter().map(|r| (key.clone(), r.offset)).collect();
        // From here on the reset writes: a write whose outcome is unknown makes the
        // whole reset's outcome unknown (504), only a refusal before any of it was
        // written is "not applied" (503).
        let dropped_deliveries = !remove.is_empty();
        self.deps
            .deliveries
            .resolve(remove, None)
            .await
            .map_err(|e| match e {
                meshd_stores::delivery::DeliveryError::Indeterminate(detail) => {
                    RuntimeError::Indeterminate {
                        store: "deliveries",
                        backend: Backend::RocksDb,
                        detail,
                    }
                }
                e => failed(e),
            })?;
        self.deps
            .offsets
            .reset(key, offset)
            .await
            .map_err(|e| match e {
                meshd_stores::offsets::OffsetError::Indeterminate(detail) => {
                    RuntimeError::Indeterminate {
                        store: "offsets",
                        backend: Backend::RocksDb,
                        detail,
                    }
                }
                e if dropped_deliveries => RuntimeError::Indeterminate {
                    store: "offsets",
                    backend: Backend::RocksDb,
                    detail: format!(
                        "the partition's in-flight deliveries were dropped, then the offset reset failed: {e}"
                    ),
                },
                e => RuntimeError::StoreFailed(e.to_string()),
            })
    }

    /// Gauges per subscription: in flight, waiting, backlog, committed.
    pub fn render(&self, out: &mut String) {
        let mut subs = self.all();
        subs.sort_by(|a, b| a.sub.name().cmp(b.sub.name()));
        if self.deps.cluster.is_some() {
            let _ = writeln!(out, "# HELP meshd_checkpoint_age_seconds Cluster mode: the oldest offset checkpoint among this instance's partitions of the subscription (how much a takeover may redeliver).\n# TYPE meshd_checkpoint_age_seconds gauge");
            let now = now_ms();
            for s in &subs {
                let oldest = s
                    .running_parts()
                    .iter()
                    .map(|p| p.shared.checkpointed_at_ms.load(Ordering::Acquire))
                    .filter(|at| *at > 0)
                    .map(|at| now.saturating_sub(at))
                    .max();
                if let Some(age) = oldest {
                    let _ = writeln!(
                        out,
                        "meshd_checkpoint_age_seconds{{subscription=\"{}\"}} {}",
                        s.sub.name(),
                        age as f64 / 1000.0
                    );
                }
            }
            let _ = writeln!(out, "# HELP meshd_attempt_ledger_records Cluster mode: attempt-ledger records in Meta of this instance's partitions of the subscription (at most one per delivery in flight, plus what awaits its prune).\n# TYPE meshd_attempt_ledger_records gauge");
            for s in &subs {
                let records: usize = s
                    .running_parts()
                    .iter()
                    .map(|p| p.shared.ledger_records.load(Ordering::Acquire))
                    .sum();
                let _ = writeln!(
                    out,
                    "meshd_attempt_ledger_records{{subscription=\"{}\"}} {records}",
                    s.sub.name()
                );
            }
        }
        let mut rows = Vec::new();
        for s in &subs {
            let mut in_flight = 0u64;
            let mut waiting = 0u64;
            let mut backlog = 0u64;
            let mut held = 0u64;
            let mut parked = 0u64;
            for p in s.running_parts() {
                let st = p.shared.stats();
                in_flight += (st.in_flight + st.persisting) as u64;
                waiting += st.waiting as u64;
                held += st.dead_lettering as u64;
                backlog += st.backlog;
                parked += p.shared.parked.load(Ordering::Acquire);
            }
            rows.push((
                s.sub.name().to_string(),
                [in_flight, waiting, backlog, held, parked],
            ));
        }
        type Pick = fn(&(String, [u64; 5])) -> u64;
        let gauges: [(&str, &str, Pick); 5] = [
            (
                "meshd_in_flight_deliveries",
                "Deliveries handed out and not yet acked, nacked or timed out.",
                |r| r.1[0],
            ),
            (
                "meshd_waiting_retries",
                "Deliveries waiting for their retry backoff.",
                |r| r.1[1],
            ),
            (
                "meshd_backlog_events",
                "Events at or above the committed offset, not yet resolved.",
                |r| r.1[2],
            ),
            (
                "meshd_dead_lettering_deliveries",
                "Deliveries held because their dead-letter entry cannot be written yet.",
                |r| r.1[3],
            ),
            (
                "meshd_parked_events",
                "Events in the park index: waiting for their deliverat, or handed out from it and not settled yet.",
                |r| r.1[4],
            ),
        ];
        for (name, help, pick) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
            for r in &rows {
                let _ = writeln!(out, "{name}{{subscription=\"{}\"}} {}", r.0, pick(r));
            }
        }
        let _ = writeln!(out, "# HELP meshd_streams_open Open streams (SSE and WebSocket).\n# TYPE meshd_streams_open gauge\nmeshd_streams_open {}", self.streams.open());
        let _ = writeln!(out, "# HELP meshd_stream_leased_deliveries Deliveries leased to open streams and not yet acked, nacked or timed out.\n# TYPE meshd_stream_leased_deliveries gauge\nmeshd_stream_leased_deliveries {}", self.streams.leased());
        let _ = writeln!(out, "# HELP meshd_dispatch_failed_partitions Partitions stopped after a store write failed.\n# TYPE meshd_dispatch_failed_partitions gauge\nmeshd_dispatch_failed_partitions {}", self.failures().len());
        let _ = writeln!(out, "# HELP meshd_log_ownership Whether this instance holds its log's ownership in Meta (needed to write dead letters).\n# TYPE meshd_log_ownership gauge\nmeshd_log_ownership {}", u8::from(self.holds_ownership()));
        let _ = writeln!(out, "# HELP meshd_recovered Whether boot recovery of delivery state is done.\n# TYPE meshd_recovered gauge\nmeshd_recovered {}", u8::from(self.is_recovered()));
        let a = self.attributes.stats();
        let _ = writeln!(out, "# HELP meshd_filter_attribute_reads_total Events whose attributes a filtered subscription needed, by whether the shared attribute cache held them (hit) or the stored event was parsed (parsed; once per event for all subscriptions of a topic while cached).\n# TYPE meshd_filter_attribute_reads_total counter\nmeshd_filter_attribute_reads_total{{result=\"hit\"}} {}\nmeshd_filter_attribute_reads_total{{result=\"parsed\"}} {}", a.hits, a.parses);
        let _ = writeln!(out, "# HELP meshd_filter_attribute_cache_bytes Memory held by the shared attribute cache of filtered subscriptions (attribute strings plus a fixed cost per event).\n# TYPE meshd_filter_attribute_cache_bytes gauge\nmeshd_filter_attribute_cache_bytes {}", a.bytes);
        let _ = writeln!(out, "# HELP meshd_filter_attribute_cache_events Events held by the shared attribute cache of filtered subscriptions.\n# TYPE meshd_filter_attribute_cache_events gauge\nmeshd_filter_attribute_cache_events {}", a.entries);
    }
}
