//! Cluster mode in the runtime, the handover of partitions (a shared JetStream log;
//! see `crate::cluster` for membership and ownership): a partition runs here only
//! while this instance owns it, under that ownership's epoch, and its state moves
//! between owners through Meta. Requests for the partitions owned elsewhere go to
//! their owners ([`super::forwarding`]).
//!
//! * **Acquiring** a partition: Meta is authoritative. The committed offset is the
//!   checkpoint (or the start written when the subscription was created); the
//!   deliveries in flight come from the attempt ledger; local records of an earlier
//!   ownership are dropped and the offset adopted in one batch. Every delivery the
//!   ledger lists stays in flight until its recorded lease deadline, and its id (a
//!   MAC over the partition, offset, attempt, reset and session epochs, keyed by the
//!   cluster secret) is rebuilt, so the consumer's ack, nack or extend of it is
//!   honoured here; when the deadline passes it goes out again with its next attempt
//!   (or to the dead-letter store when it had its last).
//! * **While owning** (the partition task, `PartitionCluster`): every pull batch (and
//!   every extend) is one small fenced record in the ledger before the hand-out; the
//!   committed offset is checkpointed, fenced, every `--checkpoint-ms`, and records
//!   that hold nothing current are pruned; dead letters are fenced by the partition's
//!   owner key.
//! * **Releasing** (the controller's drain, [`RuntimeDrain`]): the task stops, then a
//!   last checkpoint. **Losing** it (the lease's local deadline, or a `Fenced` write):
//!   the task stops at once, without writing anything more under the old epoch.

use super::clock::now_ms;
use super::error::{park_error, unavailable, RuntimeError};
use super::partition::PartitionCluster;
use super::state::{PartitionHandle, Runtime, SubRuntime};
use crate::cluster::ownership::{Drain, Owned, PartitionId};
use meshd_meta::fence::Ownership;
use meshd_stores::attempts::LedgerState;
use meshd_stores::delivery::{DeliveryRecord, DeliveryState};
use meshd_stores::offsets::{Committed, OffsetKey};
use meshd_stores::subscriptions::StartPosition;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;

/// The start of a partition for a subscription that has no checkpoint yet.
async fn start_of(
    rt: &Runtime,
    start: StartPosition,
    key: &OffsetKey,
) -> Result<u64, RuntimeError> {
    let b = rt
        .deps
        .log
        .bounds(&key.topic, key.partition)
        .await
        .map_err(|e| RuntimeError::Unavailable {
            store: "log",
            backend: rt.deps.log_backend,
            detail: e.to_string(),
        })?;
    Ok(match start {
        StartPosition::Latest => b.end,
        StartPosition::Earliest => b.start,
    })
}

impl Runtime {
    /// Cluster mode: an offset reset runs on the partition's owner: its task stops, the
    /// reset is made locally (new epoch; in-flight deliveries dropped), the attempt
    /// ledger is emptied and the checkpoint written (both fenced), and the partition
    /// starts again from Meta. Elsewhere the request goes to the owner.
    pub(super) async fn reset_in_cluster(
        &self,
        sub: &SubRuntime,
        partition: u32,
        offset: u64,
        local: bool,
    ) -> Result<Committed, RuntimeError> {
        let Some(cluster) = &self.deps.cluster else {
            return Err(RuntimeError::Invalid("not in cluster mode".into()));
        };
        let id: PartitionId = (sub.sub.spec.topic.clone(), partition);
        let owner = cluster.owned.borrow().get(&id).cloned();
        let Some(owner) = owner else {
            if local {
                return Err(RuntimeError::Unavailable {
                    store: "owners",
                    backend: self.deps.meta_backend,
                    detail: format!("partition {partition} moved to another instance; retry"),
                });
            }
            return self.forward_reset(sub, partition, offset).await;
        };
        let _ops = self.ops.lock().await;
        let key = Self::key(&sub.sub, partition);
        let running = sub.parts[partition as usize]
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = running {
            Self::stop_handle(&h).await;
        }
        let result = async {
            let committed = self.reset_locked(&sub.sub, &key, offset).await?;
            let meta_err = |store: &'static str| {
                move |e: String| RuntimeError::Indeterminate {
                    store,
                    backend: self.deps.meta_backend,
                    detail: e,
                }
            };
            cluster
                .ledger
                .clear(&key, &owner)
                .await
                .map_err(|e| meta_err("attempts")(e.to_string()))?;
            self.deps
                .offsets
                .checkpoint(self.deps.meta.as_ref(), &owner, &key)
                .await
                .map_err(|e| meta_err("checkpoints")(e.to_string()))?;
            Ok(committed)
        }
        .await;
        self.apply_ownership(sub).await;
        result
    }

    /// Cluster mode: writes every partition's start to Meta where there is no
    /// checkpoint yet (the instance that creates the subscription does it before its
    /// PUT answers, so an owner acquiring a partition later skips nothing).
    pub(super) async fn init_checkpoints(
        &self,
        sub: &meshd_stores::subscriptions::Subscription,
        partitions: u32,
    ) -> Result<(), RuntimeError> {
        for p in 0..partitions {
            let key = Self::key(sub, p);
            let start = start_of(self, sub.spec.start, &key).await?;
            self.deps
                .offsets
                .init_checkpoint(self.deps.meta.as_ref(), &key, start)
                .await
                .map_err(|e| unavailable("checkpoints", self.deps.meta_backend)(e.to_string()))?;
        }
        Ok(())
    }

    /// The state of a partition just acquired, from Meta, adopted locally; spawns its
    /// task.
    async fn start_owned(
        &self,
        sub: &SubRuntime,
        partition: u32,
        owner: Ownership,
    ) -> Result<Arc<PartitionHandle>, RuntimeError> {
        let Some(cluster) = &self.deps.cluster else {
            return Err(RuntimeError::Invalid("not in cluster mode".into()));
        };
        let key = Self::key(&sub.sub, partition);
        let meta = self.deps.meta.as_ref();
        let (committed, resolved) = match self
            .deps
            .offsets
            .load_checkpoint_with(meta, &key)
            .await
            .map_err(|e| {
            unavailable("checkpoints", self.deps.meta_backend)(e.to_string())
        })? {
            Some(c) => c,
            None => {
                let start = start_of(self, sub.sub.spec.start, &key).await?;
                let c = self
                    .deps
                    .offsets
                    .init_checkpoint(meta, &key, start)
                    .await
                    .map_err(|e| {
                        unavailable("checkpoints", self.deps.meta_backend)(e.to_string())
                    })?;
                (c, Vec::new())
            }
        };
        let loaded = cluster
            .ledger
            .load(&key)
            .await
            .map_err(|e| unavailable("attempts", self.deps.meta_backend)(e.to_string()))?;
        let now = now_ms();
        let (mut ledger_state, migrate) = LedgerState::acquired(loaded, committed.offset, now);
        if let Some(mut w) = migrate {
            // A version-1 map: rewritten in this release's form before anything
            // is handed out (a release that reads only version 1 then refuses it).
            w.with_owner_epoch = cluster.directory.borrow().ledger_epoch_allowed();
            cluster
                .ledger
                .write(&key, &owner, &w)
                .await
                .map_err(|e| unavailable("attempts", self.deps.meta_backend)(e.to_string()))?;
            tracing::info!(store = "attempts", backend = %self.deps.meta_backend, subscription = %sub.sub.name(), topic = %key.topic, partition, "attempt ledger of version 1 rewritten as version 2");
            ledger_state.applied(w);
        }
        // Resolved above the checkpoint (a release handed them over): never delivered
        // again, whatever the ledger still says of them.
        ledger_state.forget(resolved.iter().copied());
        self.deps
            .deliveries
            .adopt_partition(
                &key,
                Committed {
                    at_ms: now,
                    ..committed
                },
            )
            .await
            .map_err(|e| RuntimeError::StoreFailed(e.to_string()))?;
        let records: Vec<DeliveryRecord> = ledger_state
            .entries()
            .map(|e| DeliveryRecord {
                key: key.clone(),
                offset: e.offset,
                attempt: e.attempt,
                // Rebuilt by the core from the fields its MAC covers, so the
                // consumer's ack of this attempt is honoured here.
                delivery_id: String::new(),
                // The lease the previous owner gave: redelivered when it ends, as
                // after a crash.
                deadline_ms: e.deadline_ms,
                last_reason: None,
                first_delivered_at_ms: now,
                state: DeliveryState::InFlight,
                owner_epoch: owner.epoch(),
                session: e.session.clone(),
            })
            .chain(resolved.iter().map(|offset| DeliveryRecord {
                key: key.clone(),
                offset: *offset,
                attempt: 1,
                delivery_id: String::new(),
                deadline_ms: u64::MAX,
                last_reason: None,
                first_delivered_at_ms: now,
                state: DeliveryState::AckedAwaitingCommit,
                owner_epoch: owner.epoch(),
                session: None,
            }))
            .collect();
        // The park index of the partition as its journal on the shared log has it
        // (whatever an earlier ownership of this instance left locally is replaced).
        self.deps
            .parks
            .adopt(&key, owner.epoch())
            .await
            .map_err(|e| park_error(e, self.deps.log_backend))?;
        let parked = self
            .parked_at_start(&key, committed.offset, &records)
            .await?;
        // Resolved above the checkpoint because it was parked there: its park entry
        // delivers it (an acked record at a parked offset would read as the ack of
        // an event unparked in the window). An unparked event's ack reaches the
        // checkpoint only once its entry is settled.
        let records: Vec<DeliveryRecord> = records
            .into_iter()
            .filter(|r| {
                !(r.state == DeliveryState::AckedAwaitingCommit
                    && parked.offsets.contains_key(&r.offset))
            })
            .collect();
        tracing::info!(store = "owners", subscription = %sub.sub.name(), topic = %key.topic, partition, epoch = owner.epoch(), committed = committed.offset, in_flight = records.len(), parked = parked.count, "partition acquired: state taken from Meta");
        let lost = Arc::new(AtomicBool::new(false));
        let part = PartitionCluster {
            owner: owner.clone(),
            ledger: cluster.ledger.clone(),
            ledger_state,
            checkpoint_every: cluster.checkpoint_every,
            checkpointed: committed.offset,
            checkpointed_resolved: resolved.clone(),
            lost: lost.clone(),
            directory: cluster.directory.clone(),
        };
        let counters = self.deps.metrics.subscription(sub.sub.name());
        let handle = self.spawn_partition(
            &sub.sub,
            key,
            committed,
            records,
            parked,
            counters,
            sub.notify.clone(),
            Some((owner, part)),
        )?;
        Ok(Arc::new(handle))
    }

    /// Starts what this instance owns and does not run, stops what it runs and no
    /// longer owns (or runs under an older epoch, or lost). Callers hold `ops`.
    pub(super) async fn apply_ownership(&self, sub: &SubRuntime) {
        let Some(cluster) = &self.deps.cluster else {
            return;
        };
        let owned: Owned = cluster.owned.borrow().clone();
        for p in 0..sub.parts.len() {
            let id: PartitionId = (sub.sub.spec.topic.clone(), p as u32);
            let want = owned.get(&id).cloned();
            let have = sub.part(p);
            let current = |h: &PartitionHandle, o: &Ownership| {
                h.epoch == o.epoch() && !h.lost.load(Ordering::Acquire) && !h.join.is_finished()
            };
            match (want, have) {
                (Some(o), Some(h)) if current(&h, &o) => {}
                (Some(o), have) => {
                    if let Some(h) = have {
                        Self::stop_handle(&h).await;
                        *sub.parts[p].write().unwrap_or_else(PoisonError::into_inner) = None;
                    }
                    match self.start_owned(sub, p as u32, o).await {
                        Ok(h) => {
                            *sub.parts[p].write().unwrap_or_else(PoisonError::into_inner) = Some(h)
                        }
                        Err(e) => {
                            tracing::warn!(store = "owners", subscription = %sub.sub.name(), partition = p, error = %e, "starting an owned partition failed; retried")
                        }
                    }
                }
                (None, Some(h)) => {
                    Self::stop_handle(&h).await;
                    *sub.parts[p].write().unwrap_or_else(PoisonError::into_inner) = None;
                }
                (None, None) => {}
            }
        }
    }

    /// Follows the ownership controller (and looks again every second for tasks
    /// that lost their epoch).
    pub(super) async fn follow_ownership(self: Arc<Self>) {
        let Some(cluster) = &self.deps.cluster else {
            return;
        };
        let mut owned = cluster.owned.clone();
        let mut every = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                r = owned.changed() => if r.is_err() { return },
                _ = every.tick() => {}
            }
            let _ops = self.ops.lock().await;
            for sub in self.all() {
                self.apply_ownership(&sub).await;
            }
        }
    }
}

/// The runtime's part of a release: stop the partition's tasks, then checkpoint them
/// as the (still current) owner.
pub struct RuntimeDrain(pub Weak<Runtime>);

#[async_trait::async_trait]
impl Drain for RuntimeDrain {
    async fn drain(&self, partition: &PartitionId, owner: &Ownership) {
        let Some(rt) = self.0.upgrade() else {
            return;
        };
        let _ops = rt.ops.lock().await;
        for sub in rt.all() {
            if sub.sub.spec.topic != partition.0 || partition.1 as usize >= sub.parts.len() {
                continue;
            }
            let p = partition.1 as usize;
            let taken = sub.parts[p]
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            let key = Runtime::key(&sub.sub, partition.1);
            let resolved = match taken {
                Some(h) => Runtime::stop_handle(&h).await,
                None => None,
            };
            let Some(resolved) = resolved else {
                // No task to ask (it ended on its own, e.g. after an ambiguous Meta
                // write): what it resolved above `committed` since the last checkpoint
                // is unknown, and a checkpoint without it would drop the resolved
                // offsets the last one carried (the next owner would deliver them
                // again, from attempt 1). The last checkpoint stands; the ledger
                // still holds every acked delivery it does not carry.
                tracing::info!(store = "checkpoints", backend = %rt.deps.meta_backend, subscription = %sub.sub.name(), topic = %key.topic, partition = key.partition, "no running partition task at release: the last checkpoint stands");
                continue;
            };
            // The acked offsets above the committed one go with the checkpoint: the
            // next owner does not deliver them again (a release causes no duplicates).
            if let Err(e) = rt
                .deps
                .offsets
                .checkpoint_with(rt.deps.meta.as_ref(), owner, &key, &resolved)
                .await
            {
                tracing::warn!(store = "checkpoints", backend = %rt.deps.meta_backend, subscription = %sub.sub.name(), topic = %key.topic, partition = key.partition, error = %e, "the checkpoint at release failed; the next owner resumes from the previous one");
            }
        }
    }
}
