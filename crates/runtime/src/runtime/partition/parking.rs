//! The shell's side of parking (http-api.md, "Parking"; the index is
//! `meshd_stores::park::ParkIndex`): writing the entries the core parks, with their
//! bodies, durable before `Parked`; looking at the index when the earliest entry is
//! due and unparking what is due while there is room; settling unparked events
//! (`ParkSettled`, `ParkDeadLetter`, `Repark`); ordered delivery's keys (which keys the
//! index holds, releasing a key, a redrive parked behind its key); in cluster mode the
//! attempts of unparked events in the park journal, and whether retries are parked at
//! all.

use super::task::{Effects, PartitionTask};
use crate::metrics::{Counted, SubCounters};
use crate::runtime::clock::now_ms;
use crate::runtime::error::{park_error, unavailable, RuntimeError};
use meshd_dispatch::{Command, EventMeta, Input};
use meshd_meta::Backend;
use meshd_stores::deadletters::DeadLetterError;
use meshd_stores::delivery::DeliveryRecord;
use meshd_stores::park::{ParkError, Parked, Removed, HELD};
use std::sync::atomic::Ordering;
use std::time::Instant;

/// Park-index entries taken per look beyond those already unparked.
const UNPARK_BATCH: usize = 256;

/// How long a due park entry that cannot be unparked yet (no room for another
/// redrive, or the committed offset has not passed it) waits before the next look,
/// unless a settled unparked event makes room sooner.
const UNPARK_RETRY_MS: u64 = 250;

/// How long a park whose event body could not be read waits before it is tried again.
const PARK_RETRY_MS: u64 = 1000;

/// The park entry a `Command::Park` asks for.
pub(super) fn parked_of(cmd: Command) -> Option<Parked> {
    match cmd {
        Command::Park {
            offset,
            due_ms,
            attempt,
            key,
            not_before_ms,
        } => Some(Parked {
            key,
            not_before_ms,
            ..Parked::new(offset, due_ms, attempt)
        }),
        _ => None,
    }
}

impl PartitionTask {
    /// Cluster mode: the attempts of unparked events go to their park journal entries
    /// (the ledger holds the window's), so a new owner continues their count. `false`
    /// when the journal did not take them (nothing is handed out; retried).
    pub(super) async fn record_unparked(&mut self, records: &[DeliveryRecord]) -> bool {
        if self.cluster.is_none() {
            return true;
        }
        let attempts: Vec<(u64, u32)> = records
            .iter()
            .filter(|r| self.core.is_unparked(r.offset))
            .map(|r| (r.offset, r.attempt))
            .collect();
        let Some(&(first, _)) = attempts.first() else {
            return true;
        };
        let started = Instant::now();
        let r = self.deps.parks.record_attempts(self.key(), attempts).await;
        self.deps.metrics.write_latency(
            "parks",
            self.deps.log_backend,
            "record_attempts",
            started.elapsed(),
        );
        match r {
            Ok(()) => true,
            Err(e) => {
                self.park_failed(&e, "record_attempts", first);
                false
            }
        }
    }

    /// Ordered delivery: marks the events whose key the park index holds (they park
    /// behind it). Looked up with the read, on the partition task, so every park and
    /// release commanded before is in the index.
    pub(super) async fn mark_parked_keys(&mut self, metas: &mut [EventMeta]) -> Result<(), String> {
        let hashes: Vec<u64> = metas.iter().filter_map(|m| m.key).collect();
        if hashes.is_empty() {
            return Ok(());
        }
        let parked = self
            .deps
            .parks
            .keys_parked(self.key(), hashes)
            .await
            .map_err(|e| e.to_string())?;
        for m in metas {
            m.key_parked = m.key.is_some_and(|k| parked.contains(&k));
        }
        Ok(())
    }

    /// `Command::Park` (a run of them: one durable write): each event's entry, with
    /// its body, durable in the park index before the core hears `Parked` (and may
    /// advance the committed offset past it). An event whose body cannot be read, or
    /// a write the journal did not take, is tried again shortly (the offset is held
    /// until then).
    pub(super) async fn park_batch(&mut self, parks: Vec<Parked>) -> Vec<Input> {
        let key = self.key().clone();
        let mut entries = Vec::with_capacity(parks.len());
        for entry in parks {
            let offset = entry.offset;
            let body = match self.park.bodies.remove(&offset) {
                Some(b) => b,
                None => match self.read_event(offset).await {
                    Ok(b) => b,
                    Err(e) => {
                        SubCounters::add(&self.counters.read_failures, 1);
                        tracing::warn!(store = "log", backend = %self.deps.log_backend, subscription = %key.subscription, topic = %key.topic, partition = key.partition, offset, error = %e, "reading an event to park failed; tried again shortly (the offset is held until then)");
                        self.park.retry.push(entry);
                        self.park.look_by(now_ms().saturating_add(PARK_RETRY_MS));
                        continue;
                    }
                },
            };
            entries.push((entry, body));
        }
        if entries.is_empty() {
            return vec![];
        }
        let wanted: Vec<Parked> = entries.iter().map(|(p, _)| p.clone()).collect();
        let started = Instant::now();
        let r = self.deps.parks.park_many(&key, entries).await;
        self.deps
            .metrics
            .write_latency("parks", Backend::RocksDb, "park", started.elapsed());
        match r {
            Ok(created) => {
                let new = created.iter().filter(|c| **c).count() as u64;
                self.shared.parked.fetch_add(new, Ordering::AcqRel);
                wanted
                    .into_iter()
                    .map(|p| {
                        self.park.look_by(p.due_ms);
                        Input::Parked { offset: p.offset }
                    })
                    .collect()
            }
            Err(e) => {
                let first = wanted.first().map_or(0, |w| w.offset);
                if self.park_failed(&e, "park", first) {
                    self.park.retry.extend(wanted);
                    self.park.look_by(now_ms().saturating_add(PARK_RETRY_MS));
                }
                vec![]
            }
        }
    }

    /// A park index write failed: counted and logged; a Local failure fail-stops the
    /// partition. `true`: the journal was unavailable (cluster mode), worth a retry.
    fn park_failed(&self, e: &ParkError, op: &'static str, offset: u64) -> bool {
        let key = self.key();
        match e {
            ParkError::Local(e) => {
                self.deps
                    .metrics
                    .store_error("parks", Backend::RocksDb, "write_failed");
                self.fail("parks", e.reason());
                false
            }
            ParkError::Unavailable(reason) => {
                self.deps
                    .metrics
                    .store_error("parks", self.deps.log_backend, "unavailable");
                tracing::warn!(store = "parks", backend = %self.deps.log_backend, subscription = %key.subscription, topic = %key.topic, partition = key.partition, offset, op, error = %reason, "park journal write failed; retried");
                true
            }
            ParkError::Fenced(reason) => {
                // A later owner wrote the entry: the partition has moved. Nothing
                // more under this epoch (as for a fenced ledger write).
                self.deps
                    .metrics
                    .store_error("parks", self.deps.log_backend, "fenced");
                if let Some(c) = &self.cluster {
                    c.lose(&format!(
                        "park journal write ({op} at offset {offset}): {reason}"
                    ));
                }
                false
            }
        }
    }

    /// Removes a settled event's park entry, durably. `false`: the write failed (the
    /// partition has fail-stopped, or the journal was unavailable: the core tries the
    /// settlement again).
    async fn unpark_done(&mut self, offset: u64, op: &'static str) -> bool {
        let started = Instant::now();
        let r = self.deps.parks.remove(self.key(), offset, now_ms()).await;
        self.deps
            .metrics
            .write_latency("parks", Backend::RocksDb, op, started.elapsed());
        match r {
            Ok(Removed { removed, released }) => {
                if let Some(next) = released {
                    // The next event of its key (ordered delivery) is due now.
                    self.park.look_by(next.due_ms);
                }
                if removed {
                    let _ =
                        self.shared
                            .parked
                            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                                Some(n.saturating_sub(1))
                            });
                }
                if self.park.stalled {
                    // Room for the next due entry.
                    self.park.look_by(now_ms());
                }
                true
            }
            Err(e) => {
                self.park_failed(&e, op, offset);
                false
            }
        }
    }

    /// Ordered delivery: a redriven dead letter goes to the back of its key (http-api.md,
    /// "Parking"): parked held, with its body, in the key's line after every event of
    /// the key read so far, then released at once when no event of the window holds
    /// the key. `false`: it has no `partitionkey` (redriven like any other). A redrive
    /// injected again after a restart finds its entry parked already.
    pub(super) async fn redrive_behind_key(
        &mut self,
        entry_id: &str,
        offset: u64,
    ) -> Result<bool, RuntimeError> {
        let key = self.key().clone();
        if self.core.redrive_under_way(offset) {
            return Ok(false);
        }
        let parked = self
            .deps
            .parks
            .parked_among(&key, vec![offset])
            .await
            .map_err(|e| unavailable("parks", Backend::RocksDb)(e.to_string()))?;
        if !parked.is_empty() {
            return Ok(true);
        }
        let meta = self.deps.meta_backend;
        let body = match self.deps.deadletters.get(entry_id).await {
            Ok(entry) => self.deps.deadletters.read_body(&entry).await,
            Err(e) => Err(e),
        }
        .map_err(|e| unavailable("deadletters", meta)(e.to_string()))?;
        let attributes = self
            .attributes
            .get(&key.topic, key.partition, offset, &body);
        let Some(hash) = attributes
            .get("partitionkey")
            .map(|v| meshd_events::fnv1a64(v.as_bytes()))
        else {
            return Ok(false);
        };
        let entry = Parked {
            key: Some(hash),
            seq: self.core.stats().next_to_read,
            redrive: true,
            ..Parked::new(offset, HELD, 0)
        };
        let started = Instant::now();
        let r = self.deps.parks.park_many(&key, vec![(entry, body)]).await;
        self.deps.metrics.write_latency(
            "parks",
            Backend::RocksDb,
            "park_redrive",
            started.elapsed(),
        );
        match r {
            Ok(created) => {
                if created.first().copied().unwrap_or(false) {
                    self.shared.parked.fetch_add(1, Ordering::AcqRel);
                }
            }
            Err(e) => {
                self.park_failed(&e, "park_redrive", offset);
                return Err(park_error(e, self.deps.log_backend));
            }
        }
        if !self.core.key_taken(hash) {
            self.release_key(hash).await;
        }
        Ok(true)
    }

    /// The dead-letter entry of a redriven dead letter that was parked behind its key
    /// (`None`: an event parked for its time or its key). Read before the park entry
    /// goes, so a failed dead-letter write is retried with the entry still there.
    async fn parked_redrive(&self, offset: u64) -> Result<Option<String>, String> {
        match self.deps.parks.entry(self.key(), offset).await {
            Ok(Some(p)) if p.redrive => Ok(Some(self.core.partition().dead_letter_id(offset))),
            Ok(_) => Ok(None),
            Err(e) => {
                self.deps
                    .metrics
                    .store_error("parks", Backend::RocksDb, "read_failed");
                Err(e.to_string())
            }
        }
    }

    /// `Command::Repark`: an unparked event retried far ahead goes back to the park
    /// index with its due time and attempts, once its waiting record is durable (a
    /// crash in between keeps the retry's time).
    pub(super) async fn repark(&mut self, offset: u64, due_ms: u64, attempt: u32) -> Vec<Input> {
        if !self.flush_deliveries("flush_before_repark").await {
            return vec![];
        }
        let started = Instant::now();
        let r = self
            .deps
            .parks
            .repark(self.key(), offset, due_ms, attempt)
            .await;
        self.deps
            .metrics
            .write_latency("parks", Backend::RocksDb, "repark", started.elapsed());
        match r {
            Ok(_) => {
                self.park.look_by(due_ms);
                vec![Input::RedriveSettled { offset }]
            }
            Err(e) => {
                if self.park_failed(&e, "repark", offset) {
                    return vec![Input::RedriveUnavailable { offset }];
                }
                vec![]
            }
        }
    }

    /// `Command::ParkSettled`: an unparked event was acked. Its record (acked) is made
    /// durable before the park entry goes, so a crash in between finds an acked record
    /// and never hands the event out again. A redriven dead letter's entry is settled
    /// in the dead-letter store first.
    pub(super) async fn park_settled(&mut self, offset: u64) -> Vec<Input> {
        if !self.flush_deliveries("flush_before_unpark").await {
            return vec![];
        }
        match self.parked_redrive(offset).await {
            Ok(None) => {}
            Ok(Some(entry_id)) => match self.deps.deadletters.redrive_succeeded(&entry_id).await {
                Ok(()) | Err(DeadLetterError::NotFound { .. }) => {}
                Err(e) => {
                    self.meta_failure("redrive_succeeded", &entry_id, &e);
                    return vec![Input::RedriveUnavailable { offset }];
                }
            },
            Err(e) => {
                let key = self.key();
                tracing::warn!(store = "parks", backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, offset, error = %e, "reading a parked entry to settle it failed; retried");
                return vec![Input::RedriveUnavailable { offset }];
            }
        }
        if !self.unpark_done(offset, "remove").await {
            return vec![Input::RedriveUnavailable { offset }];
        }
        vec![Input::RedriveSettled { offset }]
    }

    /// `Command::ParkDeadLetter`: an unparked event failed `max_attempts` times: its
    /// dead-letter entry is written with the park entry's body, then the entry goes.
    pub(super) async fn park_dead_letter(
        &mut self,
        req: meshd_dispatch::DeadLetterRequest,
        fx: &mut Effects,
    ) -> Vec<Input> {
        let offset = req.offset;
        let key = self.key().clone();
        if !self.flush_deliveries("flush_before_unpark").await {
            return vec![];
        }
        match self.parked_redrive(offset).await {
            Ok(None) => {}
            Ok(Some(entry_id)) => {
                // A redriven dead letter failed again: its entry goes back to `dead`.
                let r = self
                    .deps
                    .deadletters
                    .redrive_failed(&entry_id, &req.reason, req.attempts)
                    .await;
                return match r {
                    Ok(_) | Err(DeadLetterError::NotFound { .. }) => {
                        if r.is_ok() {
                            self.counters
                                .count(&self.part_counters, Counted::DeadLettered);
                        }
                        if !self.unpark_done(offset, "remove_redrive_failed").await {
                            return vec![Input::RedriveUnavailable { offset }];
                        }
                        fx.dead_lettered.insert(offset);
                        vec![Input::RedriveSettled { offset }]
                    }
                    Err(e) => {
                        self.meta_failure("redrive_failed", &entry_id, &e);
                        vec![Input::RedriveUnavailable { offset }]
                    }
                };
            }
            Err(e) => {
                tracing::warn!(store = "parks", backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, offset, error = %e, "reading a parked entry to dead-letter it failed; retried");
                return vec![Input::RedriveUnavailable { offset }];
            }
        }
        let body = match self.parked_body(offset).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(store = "parks", backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, offset, error = %e, "reading a parked event to dead-letter it failed; retried");
                return vec![Input::RedriveUnavailable { offset }];
            }
        };
        match self.dead_letter_with(req, body).await {
            Ok(created) => {
                if created {
                    self.counters
                        .count(&self.part_counters, Counted::DeadLettered);
                }
                if !self.unpark_done(offset, "remove_dead_lettered").await {
                    return vec![Input::RedriveUnavailable { offset }];
                }
                fx.dead_lettered.insert(offset);
                vec![Input::RedriveSettled { offset }]
            }
            Err(reason) => {
                tracing::warn!(store = "deadletters", backend = %self.deps.meta_backend, subscription = %key.subscription, topic = %key.topic, partition = key.partition, offset, error = %reason, "dead-letter write of an unparked event failed; it is held and retried");
                vec![Input::RedriveUnavailable { offset }]
            }
        }
    }

    /// The body of a parked event, from the park index.
    pub(super) async fn parked_body(&self, offset: u64) -> Result<Vec<u8>, String> {
        let key = self.key();
        match self.deps.parks.body(key, offset).await {
            Ok(Some(b)) => Ok(b),
            Ok(None) => Err(format!("offset {offset} is not in the park index")),
            Err(e) => {
                self.deps
                    .metrics
                    .store_error("parks", Backend::RocksDb, "read_failed");
                Err(e.to_string())
            }
        }
    }

    /// Looks at the park index: parks whose body could not be read are tried again,
    /// and due entries are unparked (fed to the core like redrives) while there is
    /// room; the next look is set to the earliest entry not due yet.
    pub(super) async fn unpark_due(&mut self, fx: &mut Effects) {
        self.park.look_at = None;
        self.park.stalled = false;
        let key = self.key().clone();
        let retry = std::mem::take(&mut self.park.retry);
        if !retry.is_empty() {
            let inputs = self.park_batch(retry).await;
            let cmds = self.results(inputs);
            self.execute(cmds, fx).await;
        }
        for hash in std::mem::take(&mut self.park.release_retry) {
            self.release_key(hash).await;
        }
        // Entries unparked already come first in due order: take past them.
        let limit = self.core.unparked() + UNPARK_BATCH;
        let entries = match self.deps.parks.earliest(&key, limit).await {
            Ok(e) => e,
            Err(e) => {
                self.deps
                    .metrics
                    .store_error("parks", Backend::RocksDb, "read_failed");
                tracing::warn!(store = "parks", backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, error = %e, "reading the park index failed; looked at again shortly");
                self.park.look_by(now_ms().saturating_add(UNPARK_RETRY_MS));
                return;
            }
        };
        let full = entries.len() >= limit;
        let now = now_ms();
        let mut cmds = Vec::new();
        let mut blocked = false;
        for p in entries {
            if p.due_ms > now {
                // Held behind their keys from here on (`HELD` sorts last): released
                // by a settlement, never by the clock.
                self.park.look_by(p.due_ms);
                break;
            }
            if self.core.is_unparked(p.offset) {
                continue;
            }
            if blocked {
                // Due, but no room.
                self.park.stalled = true;
                continue;
            }
            let input = Input::Unpark {
                offset: p.offset,
                attempt: p.attempt,
            };
            match self.core.handle(input, now) {
                Ok(more) => cmds.extend(more),
                Err(meshd_dispatch::CoreError::RedriveBacklogFull { .. }) => {
                    blocked = true;
                    self.park.stalled = true;
                }
                Err(e) => {
                    // Looked at again after a pause, never in a tight loop.
                    self.park.stalled = true;
                    tracing::error!(store = "parks", backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, offset = p.offset, error = %e, "dispatch core refused a due park entry; it stays parked");
                }
            }
        }
        if self.park.stalled {
            self.park.look_by(now.saturating_add(UNPARK_RETRY_MS));
        } else if full && self.park.look_at.is_none() {
            // Every entry read was due and taken: more may be.
            self.park.look_by(now);
        }
        self.execute(cmds, fx).await;
    }

    /// Cluster mode: retries are parked only while every member knows the park
    /// journal (looked at once per turn of the task's loop).
    pub(super) fn refresh_parking(&mut self) {
        let allowed = self.cluster.as_ref().is_none_or(|c| c.parking_allowed());
        let want = allowed.then_some(self.deps.park_retries_after_ms);
        if self.core.config().park_retries_after_ms != want {
            let key = self.key();
            tracing::info!(store = "parks", subscription = %key.subscription, topic = %key.topic, partition = key.partition, parking = allowed, "parking of long retries {} (a member running an older release does not know the park journal)", if allowed { "on" } else { "off" });
            self.core.set_park_retries_after_ms(want);
        }
    }

    /// `Command::ReleaseKey`: the window holds no event of the key any more. When the
    /// park index holds the key, the delivery records written so far are made durable
    /// first (an ack lost to a crash after the next event went out would deliver the
    /// key out of order), then the first held entry becomes due.
    pub(super) async fn release_key(&mut self, hash: u64) {
        let key = self.key().clone();
        match self.deps.parks.keys_parked(&key, vec![hash]).await {
            Ok(parked) if parked.is_empty() => return,
            Ok(_) => {}
            Err(e) => {
                self.deps
                    .metrics
                    .store_error("parks", Backend::RocksDb, "read_failed");
                tracing::warn!(store = "parks", backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, error = %e, "reading the park index to release a key failed; tried again shortly");
                self.retry_release(hash);
                return;
            }
        }
        if !self.flush_deliveries("flush_before_release").await {
            self.retry_release(hash);
            return;
        }
        // Cluster mode: the ack must also be in the checkpoint, or a new owner would
        // hand the event out again after the next one of its key.
        if !self.write_checkpoint(true).await {
            self.retry_release(hash);
            return;
        }
        let started = Instant::now();
        let r = self.deps.parks.release_key(&key, hash, now_ms()).await;
        self.deps.metrics.write_latency(
            "parks",
            Backend::RocksDb,
            "release_key",
            started.elapsed(),
        );
        match r {
            Ok(Some(next)) => self.park.look_by(next.due_ms),
            Ok(None) => {}
            Err(e) => {
                if self.park_failed(&e, "release_key", 0) {
                    self.retry_release(hash);
                }
            }
        }
    }

    fn retry_release(&mut self, hash: u64) {
        self.park.release_retry.insert(hash);
        self.park.look_by(now_ms().saturating_add(PARK_RETRY_MS));
    }
}
