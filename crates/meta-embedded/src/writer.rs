//! The single writer: applies requests in order, commits them in groups with one fsync,
//! and expires leases.

use crate::records::state::StateRecord;
use crate::records::{self, history::HistoryRecord, key_record::KeyRecord, lease::LeaseRecord};
use crate::shared::{read_error, read_key, LeaseEntry, Shared};
use meshd_local::{Batch, Durability, KvEngine};
use meshd_meta::{Lease, LeaseId, MetaError, Txn, TxnOp, TxnResponse, WatchEvent};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};

type Reply<T> = oneshot::Sender<Result<T, MetaError>>;

pub(crate) enum Request {
    Txn { txn: Txn, reply: Reply<TxnResponse> },
    Grant { ttl: Duration, reply: Reply<Lease> },
    Revoke { lease: LeaseId, reply: Reply<()> },
    Compact { revision: i64, reply: Reply<()> },
    Shutdown,
}

/// An answer held back until the group's fsync.
enum Answer {
    Txn(Reply<TxnResponse>, Result<TxnResponse, MetaError>),
    Grant(Reply<Lease>, Result<Lease, MetaError>),
    Unit(Reply<()>, Result<(), MetaError>),
}

impl Answer {
    /// Replaces a success by `err` (the group's fsync failed: outcome unknown).
    fn fail_if_ok(self, err: &MetaError) -> Self {
        match self {
            Answer::Txn(tx, Ok(_)) => Answer::Txn(tx, Err(err.clone())),
            Answer::Grant(tx, Ok(_)) => Answer::Grant(tx, Err(err.clone())),
            Answer::Unit(tx, Ok(_)) => Answer::Unit(tx, Err(err.clone())),
            other => other,
        }
    }

    fn send(self) {
        // A caller that gave up waiting dropped its receiver: nothing to tell.
        match self {
            Answer::Txn(tx, r) => drop(tx.send(r)),
            Answer::Grant(tx, r) => drop(tx.send(r)),
            Answer::Unit(tx, r) => drop(tx.send(r)),
        }
    }
}

pub(crate) struct Writer {
    shared: Arc<Shared>,
    /// The durable state as of the last committed group (plus the group in progress).
    state: StateRecord,
    requests: Receiver<Request>,
    revision_tx: watch::Sender<i64>,
}

/// What one group changed, applied to the shared lease map only after the fsync.
#[derive(Default)]
struct GroupEffects {
    granted: HashMap<i64, Duration>,
    wrote: bool,
}

impl Writer {
    pub fn new(
        shared: Arc<Shared>,
        state: StateRecord,
        requests: Receiver<Request>,
        revision_tx: watch::Sender<i64>,
    ) -> Self {
        Self {
            shared,
            state,
            requests,
            revision_tx,
        }
    }

    pub fn run(mut self) {
        loop {
            let wait = self.until_next_expiry();
            let first = match self.requests.recv_timeout(wait) {
                Ok(Request::Shutdown) | Err(RecvTimeoutError::Disconnected) => return,
                Ok(r) => Some(r),
                Err(RecvTimeoutError::Timeout) => None,
            };
            let mut group: Vec<Request> = first.into_iter().collect();
            let mut shutdown = false;
            while group.len() < self.shared.config.max_group {
                match self.requests.try_recv() {
                    Ok(Request::Shutdown) => {
                        shutdown = true;
                        break;
                    }
                    Ok(r) => group.push(r),
                    Err(_) => break,
                }
            }
            self.commit_group(group);
            if shutdown {
                return;
            }
        }
    }

    fn until_next_expiry(&self) -> Duration {
        let leases = self.shared.lock_leases();
        let now = Instant::now();
        leases
            .values()
            .map(|l| l.deadline.saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(1))
    }

    fn commit_group(&mut self, group: Vec<Request>) {
        let shared = self.shared.clone();
        let guard = match shared.engine.write() {
            Ok(g) => g,
            Err(_) => {
                shared.fail("engine lock poisoned".into());
                return;
            }
        };
        let Some(engine) = guard.as_ref().cloned() else {
            // Closed: dropping the replies tells callers nothing was applied.
            return;
        };
        // Refused before anything is written: this store, or the engine it shares with
        // the Local stores, has already failed.
        if let Err(e) = shared.check_failed_with(engine.as_ref()) {
            for r in group {
                answer_error(r, &e);
            }
            return;
        }
        let before = self.state;
        let mut effects = GroupEffects::default();
        let mut answers = Vec::with_capacity(group.len());

        // Leases past their deadline end first, so a put in this group cannot attach
        // to a lease that has already expired.
        let expired = self.take_expired();
        for lease in expired {
            if let Err(e) = self.revoke(engine.as_ref(), lease, &mut effects) {
                tracing::warn!(store = "meta", backend = "embedded", lease, error = %e, "lease expiry failed");
            }
        }
        for r in group {
            let answer = match r {
                Request::Txn { txn, reply } => {
                    Answer::Txn(reply, self.apply_txn(engine.as_ref(), &txn, &mut effects))
                }
                Request::Grant { ttl, reply } => {
                    Answer::Grant(reply, self.grant(engine.as_ref(), ttl, &mut effects))
                }
                Request::Revoke { lease, reply } => {
                    let known = effects.granted.contains_key(&lease.0)
                        || self.shared.lock_leases().remove(&lease.0).is_some();
                    let res = if known {
                        effects.granted.remove(&lease.0);
                        self.revoke(engine.as_ref(), lease.0, &mut effects)
                    } else {
                        Err(MetaError::LeaseNotFound(lease))
                    };
                    Answer::Unit(reply, res)
                }
                Request::Compact { revision, reply } => {
                    Answer::Unit(reply, self.compact(engine.as_ref(), revision, &mut effects))
                }
                Request::Shutdown => continue,
            };
            answers.push(answer);
        }

        if effects.wrote {
            if let Err(e) = engine.sync() {
                // Every write of the group reached the engine: outcome unknown.
                let reason = e.reason();
                shared.fail(reason.clone());
                let err = MetaError::Indeterminate(may_be_on_disk(&reason));
                drop(guard);
                for a in answers {
                    a.fail_if_ok(&err).send();
                }
                return;
            }
        }
        shared.revision.store(self.state.revision, Ordering::SeqCst);
        drop(guard);

        {
            let mut leases = shared.lock_leases();
            let now = Instant::now();
            for (id, ttl) in effects.granted {
                leases.insert(
                    id,
                    LeaseEntry {
                        ttl,
                        deadline: now + ttl,
                    },
                );
            }
        }
        if self.state.revision != before.revision {
            self.revision_tx.send_replace(self.state.revision);
        }
        for a in answers {
            a.send();
        }
    }

    fn take_expired(&self) -> Vec<i64> {
        let mut leases = self.shared.lock_leases();
        let now = Instant::now();
        let expired: Vec<i64> = leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in &expired {
            leases.remove(id);
        }
        expired
    }

    /// Writes one request's batch (buffered; the group's fsync makes it durable).
    fn write(
        &mut self,
        engine: &dyn KvEngine,
        mut batch: Batch,
        next: StateRecord,
        effects: &mut GroupEffects,
    ) -> Result<(), MetaError> {
        batch.put(records::CF, records::STATE_KEY.to_vec(), next.encode());
        match engine.write(batch, Durability::Buffered) {
            Ok(()) => {
                self.state = next;
                effects.wrote = true;
                Ok(())
            }
            Err(e) => {
                let reason = e.reason();
                self.shared.fail(reason.clone());
                if e.outcome_unknown() {
                    Err(MetaError::Indeterminate(may_be_on_disk(&reason)))
                } else {
                    // Refused by an engine that had already failed (under another of
                    // its users, since this group began): nothing written.
                    Err(MetaError::Failed(reason))
                }
            }
        }
    }

    /// Adds the history record of `revision` and trims the history to its bound.
    fn record_history(&self, batch: &mut Batch, next: &mut StateRecord, events: Vec<WatchEvent>) {
        let revision = next.revision;
        batch.put(
            records::CF,
            records::history_key(revision),
            HistoryRecord { revision, events }.encode(),
        );
        let keep_from = revision - self.shared.config.history_limit + 1;
        while next.history_start < keep_from {
            batch.delete(records::CF, records::history_key(next.history_start));
            next.history_start += 1;
        }
    }

    fn lease_is_live(&self, lease: i64, effects: &GroupEffects) -> bool {
        effects.granted.contains_key(&lease) || self.shared.lock_leases().contains_key(&lease)
    }

    fn apply_txn(
        &mut self,
        engine: &dyn KvEngine,
        txn: &Txn,
        effects: &mut GroupEffects,
    ) -> Result<TxnResponse, MetaError> {
        // Compares, against the current (durable or earlier-in-group) state.
        let mut current: HashMap<Vec<u8>, Option<meshd_meta::KeyValue>> = HashMap::new();
        let mut all_hold = true;
        for c in &txn.conditions {
            let key = c.compare.key();
            if !current.contains_key(key) {
                let kv = read_key(engine, key)?.map(|r| r.to_kv(key));
                current.insert(key.to_vec(), kv);
            }
            if !c.compare.holds(current.get(key).and_then(Option::as_ref)) {
                all_hold = false;
            }
        }
        if !all_hold {
            return Err(txn.failure(|k| current.get(k).and_then(Option::as_ref)));
        }
        for op in &txn.ops {
            if let TxnOp::Put { lease: Some(l), .. } = op {
                if !self.lease_is_live(l.0, effects) {
                    return Err(MetaError::LeaseNotFound(*l));
                }
            }
        }

        let mut next = self.state;
        let revision = next.revision + 1;
        let mut batch = Batch::new();
        let mut events = Vec::new();
        let mut deleted = 0u64;
        for op in &txn.ops {
            match op {
                TxnOp::Put { key, value, lease } => {
                    let existing = read_key(engine, key)?;
                    let lease_id = lease.map(|l| l.0).unwrap_or(0);
                    if let Some(old) = &existing {
                        if old.lease != 0 && old.lease != lease_id {
                            batch.delete(records::CF, records::attach_key(old.lease, key));
                        }
                    }
                    if lease_id != 0 {
                        batch.put(records::CF, records::attach_key(lease_id, key), Vec::new());
                    }
                    let rec = KeyRecord {
                        value: value.clone(),
                        create_revision: existing
                            .as_ref()
                            .map(|o| o.create_revision)
                            .unwrap_or(revision),
                        mod_revision: revision,
                        version: existing.as_ref().map(|o| o.version + 1).unwrap_or(1),
                        lease: lease_id,
                    };
                    batch.put(records::CF, records::key_key(key), rec.encode());
                    events.push(WatchEvent::Put(rec.to_kv(key)));
                }
                TxnOp::Delete { key } => {
                    if let Some(old) = read_key(engine, key)? {
                        if old.lease != 0 {
                            batch.delete(records::CF, records::attach_key(old.lease, key));
                        }
                        batch.delete(records::CF, records::key_key(key));
                        events.push(WatchEvent::Delete {
                            key: key.clone(),
                            revision,
                        });
                        deleted += 1;
                    }
                }
            }
        }
        if events.is_empty() {
            // Nothing changed (deletes of absent keys, or no operations): like etcd,
            // the revision does not move.
            return Ok(TxnResponse {
                revision: self.state.revision,
                deleted: 0,
            });
        }
        next.revision = revision;
        self.record_history(&mut batch, &mut next, events);
        self.write(engine, batch, next, effects)?;
        Ok(TxnResponse { revision, deleted })
    }

    fn grant(
        &mut self,
        engine: &dyn KvEngine,
        ttl: Duration,
        effects: &mut GroupEffects,
    ) -> Result<Lease, MetaError> {
        let mut next = self.state;
        let id = next.next_lease;
        next.next_lease += 1;
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut batch = Batch::new();
        batch.put(
            records::CF,
            records::lease_key(id),
            LeaseRecord { ttl_ms }.encode(),
        );
        self.write(engine, batch, next, effects)?;
        let ttl = Duration::from_millis(ttl_ms);
        effects.granted.insert(id, ttl);
        Ok(Lease {
            id: LeaseId(id),
            ttl,
        })
    }

    /// Deletes the lease record and every key still attached to it, at one revision.
    /// The caller has already removed the lease from the live map.
    fn revoke(
        &mut self,
        engine: &dyn KvEngine,
        lease: i64,
        effects: &mut GroupEffects,
    ) -> Result<(), MetaError> {
        let prefix = records::attach_prefix(lease);
        let end = meshd_meta::prefix_end(&prefix);
        let attached = engine
            .scan(records::CF, &prefix, Some(&end), 0)
            .map_err(read_error)?;
        let mut next = self.state;
        let revision = next.revision + 1;
        let mut batch = Batch::new();
        let mut events = Vec::new();
        for (k, _) in attached {
            let user_key = &k[prefix.len()..];
            batch.delete(records::CF, k.clone());
            if let Some(rec) = read_key(engine, user_key)? {
                if rec.lease == lease {
                    batch.delete(records::CF, records::key_key(user_key));
                    events.push(WatchEvent::Delete {
                        key: user_key.to_vec(),
                        revision,
                    });
                }
            }
        }
        batch.delete(records::CF, records::lease_key(lease));
        if !events.is_empty() {
            next.revision = revision;
            self.record_history(&mut batch, &mut next, events);
        }
        tracing::debug!(store = "meta", backend = "embedded", lease, "lease ended");
        self.write(engine, batch, next, effects)
    }

    fn compact(
        &mut self,
        engine: &dyn KvEngine,
        revision: i64,
        effects: &mut GroupEffects,
    ) -> Result<(), MetaError> {
        if revision > self.state.revision {
            return Err(MetaError::InvalidRequest(format!(
                "cannot compact at {revision}: the store is at revision {}",
                self.state.revision
            )));
        }
        if revision <= self.state.history_start {
            return Ok(());
        }
        let mut next = self.state;
        let mut batch = Batch::new();
        while next.history_start < revision {
            batch.delete(records::CF, records::history_key(next.history_start));
            next.history_start += 1;
        }
        self.write(engine, batch, next, effects)
    }
}

/// The detail of a write that reached the engine but was not made durable.
fn may_be_on_disk(reason: &str) -> String {
    format!("the write reached the disk cache but was not made durable, so it may or may not be applied (embedded meta fail-stopped): {reason}")
}

fn answer_error(r: Request, e: &MetaError) {
    match r {
        Request::Txn { reply, .. } => drop(reply.send(Err(e.clone()))),
        Request::Grant { reply, .. } => drop(reply.send(Err(e.clone()))),
        Request::Revoke { reply, .. } => drop(reply.send(Err(e.clone()))),
        Request::Compact { reply, .. } => drop(reply.send(Err(e.clone()))),
        Request::Shutdown => {}
    }
}
