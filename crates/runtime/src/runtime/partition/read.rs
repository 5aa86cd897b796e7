//! What a partition task reads from the log: events for the core (`Command::ReadLog`:
//! what the core learns of each, parsed only when a filter, a `deliverat` or ordered
//! delivery needs the attributes, through the shared attribute cache), and the bodies
//! of hand-outs (from the log, the dead-letter store for redrives, the park index for
//! unparked events). A body that cannot be read is not handed out: its lease runs out
//! and it is retried.

use super::task::PartitionTask;
use crate::metrics::{Counted, SubCounters};
use crate::runtime::clock::now_ms;
use crate::runtime::error::kind_of;
use crate::runtime::types::Handed;
use meshd_dispatch::{EventMeta, Input};
use meshd_meta::Backend;
use meshd_stores::log::{LogError, LogEvent};
use meshd_stores::offsets::OffsetKey;
use std::time::Duration;

/// The most payload bytes one log read brings into memory.
const READ_BYTES: usize = 4 * 1024 * 1024;

impl PartitionTask {
    /// `Command::ReadLog`: up to `max` events from `from` for the core (what it learns
    /// of them, [`Self::metas`], and which of their keys the park index holds), or
    /// `ReadFailed`.
    pub(super) async fn read_log(&mut self, from: u64, max: usize) -> Vec<Input> {
        let key = self.key().clone();
        match self
            .deps
            .log
            .read(&key.topic, key.partition, from, max, READ_BYTES)
            .await
        {
            Ok(events) => {
                let mut metas = self.metas(&key, events);
                match self.mark_parked_keys(&mut metas).await {
                    Ok(()) => vec![Input::EventsRead(metas)],
                    Err(e) => {
                        self.deps
                            .metrics
                            .store_error("parks", Backend::RocksDb, "read_failed");
                        tracing::warn!(store = "parks", backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, from, error = %e, "reading the park index for the keys of events read failed; read again");
                        vec![Input::ReadFailed]
                    }
                }
            }
            Err(e) => {
                self.deps
                    .metrics
                    .store_error("log", self.deps.log_backend, kind_of(&e));
                tracing::warn!(store = "log", backend = %self.deps.log_backend, subscription = %key.subscription, topic = %key.topic, partition = key.partition, from, error = %e, "reading the log for delivery failed; retried");
                vec![Input::ReadFailed]
            }
        }
    }

    pub(super) async fn read_event(&self, offset: u64) -> Result<Vec<u8>, LogError> {
        let key = self.key();
        let mut events = self
            .deps
            .log
            .read(&key.topic, key.partition, offset, 1, READ_BYTES)
            .await?;
        match events.pop() {
            Some(e) if e.offset == offset => Ok(e.payload),
            _ => Err(LogError::Invalid(format!(
                "offset {offset} of {}/{} is not in the log",
                key.topic, key.partition
            ))),
        }
    }

    /// Reads the bodies of handed-out deliveries (the log for normal ones, the
    /// dead-letter store for redrives). A delivery whose body cannot be read is not
    /// handed out: its lease runs out and it is retried (and counted).
    pub(super) async fn bodies(&self, handouts: Vec<meshd_dispatch::Delivery>) -> Vec<Handed> {
        let key = self.key().clone();
        let mut out = Vec::with_capacity(handouts.len());
        // Contiguous offsets are read with one call.
        let mut normal: Vec<&meshd_dispatch::Delivery> = handouts
            .iter()
            .filter(|d| d.redrive_of.is_none() && !d.parked)
            .collect();
        normal.sort_by_key(|d| d.offset);
        let mut i = 0;
        while i < normal.len() {
            let mut j = i + 1;
            while j < normal.len() && normal[j].offset == normal[j - 1].offset + 1 {
                j += 1;
            }
            let from = normal[i].offset;
            let n = j - i;
            let mut got: Vec<(u64, u64, Vec<u8>)> = Vec::with_capacity(n);
            let mut next = from;
            while got.len() < n {
                match self
                    .deps
                    .log
                    .read(&key.topic, key.partition, next, n - got.len(), READ_BYTES)
                    .await
                {
                    Ok(events) if !events.is_empty() => {
                        next = events.last().map(|e| e.offset + 1).unwrap_or(next);
                        got.extend(
                            events
                                .into_iter()
                                .map(|e| (e.offset, e.appended_at_ms, e.payload)),
                        );
                    }
                    Ok(_) => break,
                    Err(e) => {
                        self.deps
                            .metrics
                            .store_error("log", self.deps.log_backend, kind_of(&e));
                        tracing::warn!(store = "log", backend = %self.deps.log_backend, topic = %key.topic, partition = key.partition, offset = next, error = %e, "reading a handed-out event failed; it is retried when its lease runs out");
                        break;
                    }
                }
            }
            let now = now_ms();
            let mut first_waits = Vec::new();
            for d in &normal[i..j] {
                match got.iter().position(|(o, _, _)| *o == d.offset) {
                    Some(p) => {
                        if d.attempt == 1 {
                            first_waits.push(Duration::from_millis(now.saturating_sub(got[p].1)));
                        }
                        out.push(self.handed(d, std::mem::take(&mut got[p].2)))
                    }
                    None => SubCounters::add(&self.counters.read_failures, 1),
                }
            }
            self.counters.delivery_latency.observe(first_waits);
            i = j;
        }
        for d in handouts.iter().filter(|d| d.redrive_of.is_some()) {
            let entry_id = d.redrive_of.as_deref().unwrap_or_default();
            let body = match self.deps.deadletters.get(entry_id).await {
                Ok(entry) => self.deps.deadletters.read_body(&entry).await,
                Err(e) => Err(e),
            };
            match body {
                Ok(b) => out.push(self.handed(d, b)),
                Err(e) => {
                    SubCounters::add(&self.counters.read_failures, 1);
                    tracing::warn!(store = "deadletters", backend = %self.deps.meta_backend, entry = entry_id, error = %e, "reading a redriven event failed; it is retried when its lease runs out");
                }
            }
        }
        for d in handouts.iter().filter(|d| d.parked) {
            match self.parked_body(d.offset).await {
                Ok(b) => out.push(self.handed(d, b)),
                Err(e) => {
                    SubCounters::add(&self.counters.read_failures, 1);
                    tracing::warn!(store = "parks", backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, offset = d.offset, error = %e, "reading an unparked event failed; it is retried when its lease runs out");
                }
            }
        }
        out.sort_by_key(|h| h.offset);
        out
    }

    /// What the core learns of events read from the log. Only a filter, or a
    /// `deliverat` (found by its bytes, `meshd_events::may_deliver_later`), needs the
    /// attributes: other payloads are not parsed here, and the attribute cache parses
    /// each event once for every subscription of the topic. The bodies of events with
    /// a later `deliverat` are kept for the `Park` that follows.
    fn metas(&mut self, key: &OffsetKey, events: Vec<LogEvent>) -> Vec<EventMeta> {
        let filtered = !self.core.config().selector.takes_all();
        // Ordered delivery needs every event's `partitionkey` (parsed once per event
        // for all subscriptions of the topic, through the cache).
        let ordered = self.core.config().ordered;
        let now = now_ms();
        self.park.bodies.clear();
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            let delayed = meshd_events::may_deliver_later(&e.payload);
            let attributes = (filtered || delayed || ordered).then(|| {
                self.attributes
                    .get(&key.topic, key.partition, e.offset, &e.payload)
            });
            let deliver_at_ms = match (&attributes, delayed) {
                (Some(a), true) => a
                    .get(meshd_events::DELIVER_AT)
                    .and_then(meshd_events::deliver_at_of)
                    .map(|ms| u64::try_from(ms).unwrap_or(0)),
                _ => None,
            };
            let size = e.payload.len() as u64;
            let ordering_key = match (&attributes, ordered) {
                (Some(a), true) => a
                    .get("partitionkey")
                    .map(|v| meshd_events::fnv1a64(v.as_bytes())),
                _ => None,
            };
            if deliver_at_ms.is_some_and(|at| at > now) || ordering_key.is_some() {
                // Kept for a `Park` that may follow (a delay, or a key taken).
                self.park.bodies.insert(e.offset, e.payload);
            }
            out.push(EventMeta {
                offset: e.offset,
                attributes: if filtered {
                    attributes.unwrap_or_default()
                } else {
                    Default::default()
                },
                size,
                deliver_at_ms,
                key: ordering_key,
                key_parked: false,
            });
        }
        out
    }

    fn handed(&self, d: &meshd_dispatch::Delivery, body: Vec<u8>) -> Handed {
        self.counters
            .count(&self.part_counters, Counted::Delivered(d.attempt > 1));
        Handed {
            delivery_id: d.delivery_id.clone(),
            partition: self.key().partition,
            offset: d.offset,
            attempt: d.attempt,
            body,
        }
    }
}
