//! The DeliveryStateStore on the Local RocksDB (column family `deliveries`).
//!
//! `record_attempt` is a durable group commit (the hand-out waits for it). `update`
//! and `resolve` write at once, buffered, and a flusher thread fsyncs every flush
//! interval when something is dirty, so acks and nacks reach disk within the interval
//! (any earlier fsync of the same log, such as the next attempt's or publish's, covers
//! them sooner). `resolve` deletes records and stages the offset advance in the same
//! batch; the advance shows in the OffsetStore's reads only once an fsync covered it,
//! so a reported committed offset never goes back. All of them go through the one
//! group committer of the Local RocksDB, so a failed write or fsync anywhere poisons
//! every Local store (the same disk).
//!
//! One key per record (`d` + partition + offset), written blind: an attempt or an
//! update replaces it, a resolve deletes it, and none reads it first. Releases before
//! this one also kept a deadline index (`x` + deadline + record key) that nothing read
//! (the partition tasks keep the deadlines of their records in memory, loaded with the
//! records); keeping it cost two more memtable entries and a point read per write,
//! about a third of the server's CPU per event on the consume path (docs/benchmarks.md).
//! [`RocksDeliveryStore::open`] drops an index left by such a release with one range
//! delete, so an upgraded data dir carries none of it; an older release reading a
//! data dir without it loses nothing (its index served no production read).

use crate::keys::{self, CF_DELIVERIES};
use crate::offsets::{OffsetErrorOrLocal, RocksOffsetStore, Staged};
use crate::store_thread::applied_so_far;
use async_trait::async_trait;
use meshd_local::codec::{DecodeError, Decoder, Encoder};
use meshd_local::group::{GroupCommit, Wait};
use meshd_local::{Batch, KvEngine, LocalError};
use meshd_stores::delivery::{
    Applied, DeliveryError, DeliveryRecord, DeliveryState, DeliveryStateStore, OffsetAdvance,
    SessionBinding,
};
use meshd_stores::offsets::{Committed, OffsetError, OffsetKey};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

const DELIVERY_V1: u8 = 1;

/// The flush interval's allowed range (milliseconds).
pub const FLUSH_MS_RANGE: std::ops::RangeInclusive<u64> = 10..=1000;

/// The stored value of a delivery record (its subscription, partition and offset are
/// in the key).
pub fn encode(r: &DeliveryRecord) -> Vec<u8> {
    let state = match r.state {
        DeliveryState::InFlight => 1,
        DeliveryState::WaitingRetry => 2,
        DeliveryState::AckedAwaitingCommit => 3,
        DeliveryState::DeadLettering => 4,
    };
    let mut e = Encoder::new(DELIVERY_V1)
        .u32(r.attempt)
        .str(&r.delivery_id)
        .u64(r.deadline_ms)
        .u64(r.first_delivered_at_ms)
        .u8(state)
        .i64(r.owner_epoch);
    e = match &r.last_reason {
        Some(reason) => e.u8(1).str(reason),
        None => e.u8(0),
    };
    e = match &r.session {
        Some(s) => e.u8(1).str(&s.session_id).i64(s.epoch),
        None => e.u8(0),
    };
    e.finish()
}

pub fn decode(key: OffsetKey, offset: u64, b: &[u8]) -> Result<DeliveryRecord, DecodeError> {
    let mut d = Decoder::new(b, DELIVERY_V1)?;
    let attempt = d.u32()?;
    let delivery_id = d.string()?;
    let deadline_ms = d.u64()?;
    let first_delivered_at_ms = d.u64()?;
    let state = match d.u8()? {
        1 => DeliveryState::InFlight,
        2 => DeliveryState::WaitingRetry,
        3 => DeliveryState::AckedAwaitingCommit,
        4 => DeliveryState::DeadLettering,
        _ => return Err(DecodeError::InvalidField("state")),
    };
    let owner_epoch = d.i64()?;
    let last_reason = match d.u8()? {
        0 => None,
        1 => Some(d.string()?),
        _ => return Err(DecodeError::InvalidField("reason flag")),
    };
    let session = match d.u8()? {
        0 => None,
        1 => Some(SessionBinding {
            session_id: d.string()?,
            epoch: d.i64()?,
        }),
        _ => return Err(DecodeError::InvalidField("session flag")),
    };
    d.finish()?;
    if attempt == 0 {
        return Err(DecodeError::InvalidField("attempt"));
    }
    Ok(DeliveryRecord {
        key,
        offset,
        attempt,
        delivery_id,
        deadline_ms,
        last_reason,
        first_delivered_at_ms,
        state,
        owner_epoch,
        session,
    })
}

#[derive(Clone)]
pub struct RocksDeliveryStore {
    inner: Arc<Inner>,
}

struct Inner {
    group: Arc<GroupCommit>,
    offsets: RocksOffsetStore,
    /// Set by a buffered write; the flusher fsyncs and clears it.
    dirty: AtomicBool,
}

/// Outcome unknown when this call's batch reached the engine, refused otherwise.
pub(crate) fn local(e: LocalError) -> DeliveryError {
    if e.outcome_unknown() {
        DeliveryError::Indeterminate(e.reason())
    } else {
        DeliveryError::Poisoned(e.reason())
    }
}

impl From<OffsetErrorOrLocal> for DeliveryError {
    fn from(e: OffsetErrorOrLocal) -> Self {
        match e {
            OffsetErrorOrLocal::Local(e) => local(e),
            OffsetErrorOrLocal::Offset(e) => DeliveryError::Offset(e),
        }
    }
}

/// Errors of group-commit closures in this store and the park index: the engine's,
/// or the store's own.
pub(crate) enum Closure {
    Local(LocalError),
    Delivery(DeliveryError),
}

impl From<LocalError> for Closure {
    fn from(e: LocalError) -> Self {
        Closure::Local(e)
    }
}

impl From<Closure> for DeliveryError {
    fn from(e: Closure) -> Self {
        match e {
            Closure::Local(e) => local(e),
            Closure::Delivery(e) => e,
        }
    }
}

impl From<OffsetError> for Closure {
    fn from(e: OffsetError) -> Self {
        Closure::Delivery(DeliveryError::Offset(e))
    }
}

fn parse_key(k: &[u8]) -> Result<(OffsetKey, u64), DeliveryError> {
    let corrupt = |reason: &str| DeliveryError::Corrupt {
        key: format!("{k:?}"),
        reason: reason.to_string(),
    };
    let rest = k.get(1..).ok_or_else(|| corrupt("empty key"))?;
    let (key, rest) = keys::parse_partition_part(rest).ok_or_else(|| corrupt("malformed key"))?;
    let offset: [u8; 8] = rest.try_into().map_err(|_| corrupt("malformed offset"))?;
    Ok((key, u64::from_be_bytes(offset)))
}

fn read_record(
    engine: &dyn KvEngine,
    dkey: &[u8],
) -> Result<Option<DeliveryRecord>, DeliveryError> {
    let Some(v) = engine
        .get(CF_DELIVERIES, dkey)
        .map_err(|e| DeliveryError::Poisoned(format!("local read failed: {e}")))?
    else {
        return Ok(None);
    };
    let (key, offset) = parse_key(dkey)?;
    decode(key, offset, &v)
        .map(Some)
        .map_err(|e| DeliveryError::Corrupt {
            key: format!("{dkey:?}"),
            reason: e.to_string(),
        })
}

impl RocksDeliveryStore {
    /// Opens the store and starts its flusher (stopped when the last clone is dropped).
    /// Drops a deadline index left by an earlier release first (see the module docs).
    pub fn open(
        group: Arc<GroupCommit>,
        offsets: RocksOffsetStore,
        flush_interval: Duration,
    ) -> Result<Self, DeliveryError> {
        let ms = flush_interval.as_millis() as u64;
        if !FLUSH_MS_RANGE.contains(&ms) {
            return Err(DeliveryError::Invalid(format!(
                "flush interval must be 10-1000 ms, got {ms}"
            )));
        }
        drop_deadline_index(&group)?;
        let inner = Arc::new(Inner {
            group,
            offsets,
            dirty: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("delivery-flusher".into())
            .spawn(move || flusher(weak, flush_interval))
            .map_err(|e| DeliveryError::Poisoned(format!("cannot start the flusher: {e}")))?;
        Ok(Self { inner })
    }

    /// Writes `record`, replacing the partition offset's earlier record if any.
    fn stage(record: &DeliveryRecord, batch: &mut Batch) -> Result<(), DeliveryError> {
        keys::check_name("subscription", &record.key.subscription)
            .and_then(|_| keys::check_name("topic", &record.key.topic))
            .map_err(DeliveryError::Invalid)?;
        if record.attempt == 0 {
            return Err(DeliveryError::Invalid("attempt must be at least 1".into()));
        }
        batch.put(
            CF_DELIVERIES,
            keys::delivery_key(&record.key, record.offset),
            encode(record),
        );
        Ok(())
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, DeliveryError> + Send + 'static,
    ) -> Result<T, DeliveryError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| DeliveryError::Poisoned(format!("delivery task failed: {e}")))?
    }
}

/// Deletes the deadline index of an earlier release (every `x` key), durably, when
/// there is one: one range tombstone, so the cost does not grow with its size.
fn drop_deadline_index(group: &GroupCommit) -> Result<(), DeliveryError> {
    let start = [keys::DEADLINE];
    let end = keys::end_of(&start);
    let found = group
        .engine()
        .scan(CF_DELIVERIES, &start, Some(&end), 1)
        .map_err(local)?;
    if found.is_empty() {
        return Ok(());
    }
    let mut batch = Batch::new();
    batch.delete_range(CF_DELIVERIES, start.to_vec(), end);
    group.commit(batch).map_err(local)?;
    tracing::info!(
        store = "deliveries",
        backend = "rocksdb",
        "dropped the deadline index an earlier release kept (nothing reads it)"
    );
    Ok(())
}

/// Fsyncs buffered updates every `interval` while the store lives.
fn flusher(store: Weak<Inner>, interval: Duration) {
    loop {
        std::thread::sleep(interval);
        let Some(inner) = store.upgrade() else {
            return;
        };
        if inner.dirty.swap(false, Ordering::SeqCst) {
            if let Err(e) = inner.sync() {
                // The committer is poisoned now; health() reports it.
                tracing::error!(store = "deliveries", backend = "rocksdb", error = %e, "delivery flush failed");
            }
        }
    }
}

impl Inner {
    /// Makes every buffered write durable and shows the committed offsets it covered.
    fn sync(&self) -> Result<(), LocalError> {
        self.group.sync_all()?;
        self.offsets.catch_up();
        Ok(())
    }
}

fn reject_if_poisoned(group: &GroupCommit) -> Result<(), DeliveryError> {
    match group.poisoned() {
        Some(reason) => Err(DeliveryError::Poisoned(reason)),
        None => Ok(()),
    }
}

#[async_trait]
impl DeliveryStateStore for RocksDeliveryStore {
    async fn record_attempt(&self, record: DeliveryRecord) -> Result<(), DeliveryError> {
        self.record_attempts(vec![record]).await
    }

    async fn record_attempts(&self, records: Vec<DeliveryRecord>) -> Result<(), DeliveryError> {
        meshd_stores::delivery::submitted(&mut self.submit_attempts(records)).await
    }

    fn submit_attempts(
        &self,
        records: Vec<DeliveryRecord>,
    ) -> tokio::sync::oneshot::Receiver<Result<(), DeliveryError>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.inner.group.submit(
            Wait::Durable,
            move |_| {
                let mut batch = Batch::new();
                for record in &records {
                    RocksDeliveryStore::stage(record, &mut batch).map_err(Closure::Delivery)?;
                }
                Ok::<_, Closure>((batch, ()))
            },
            move |r: Result<(Option<u64>, ()), Closure>| {
                let _ = tx.send(r.map(|_| ()).map_err(DeliveryError::from));
            },
        );
        rx
    }

    fn submit_resolve_and_update(
        &self,
        remove: Vec<(OffsetKey, u64)>,
        advance: Option<OffsetAdvance>,
        updates: Vec<DeliveryRecord>,
        applied: Applied,
    ) {
        let inner = self.inner.clone();
        let offsets = self.inner.offsets.clone();
        self.inner.group.submit(
            Wait::Written,
            move |_| {
                // In the order of the calls this stands for: the resolve, then the
                // updates.
                let mut batch = Batch::new();
                for (key, offset) in &remove {
                    batch.delete(CF_DELIVERIES, keys::delivery_key(key, *offset));
                }
                let staged = match &advance {
                    Some(a) => Some(offsets.stage(&a.key, a.to, false, &mut batch)?),
                    None => None,
                };
                for record in &updates {
                    RocksDeliveryStore::stage(record, &mut batch).map_err(Closure::Delivery)?;
                }
                Ok::<_, Closure>((batch, staged))
            },
            move |r: Result<(Option<u64>, Option<Staged>), Closure>| {
                let r = r.map_err(DeliveryError::from).map(|(ticket, staged)| {
                    // Nothing written: nothing to remove or update, the same offset
                    // again.
                    if let Some(ticket) = ticket {
                        inner.dirty.store(true, Ordering::SeqCst);
                        if let Some(st) = staged {
                            inner.offsets.publish_when_durable(ticket, st);
                        }
                    }
                });
                applied(r)
            },
        );
    }

    async fn flush(&self) -> Result<(), DeliveryError> {
        // Every write submitted before this call (an ack's resolve that was not
        // waited for) is applied first.
        applied_so_far(&self.inner.group).await;
        self.blocking(|s| {
            s.dirty.store(false, Ordering::SeqCst);
            s.sync().map_err(local)
        })
        .await
    }

    async fn get(
        &self,
        key: &OffsetKey,
        offset: u64,
    ) -> Result<Option<DeliveryRecord>, DeliveryError> {
        let dkey = keys::delivery_key(key, offset);
        self.blocking(move |s| {
            reject_if_poisoned(&s.group)?;
            read_record(s.group.engine().as_ref(), &dkey)
        })
        .await
    }

    async fn load_all(&self) -> Result<Vec<DeliveryRecord>, DeliveryError> {
        self.load_prefix(vec![keys::DELIVERY]).await
    }

    async fn load_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<Vec<DeliveryRecord>, DeliveryError> {
        self.load_prefix(keys::deliveries_of_subscription(subscription, incarnation))
            .await
    }

    async fn adopt_partition(
        &self,
        key: &OffsetKey,
        committed: Committed,
    ) -> Result<(), DeliveryError> {
        let key = key.clone();
        let prefix = keys::deliveries_of_partition(&key);
        self.blocking(move |s| {
            let staged = s.group.commit_with::<_, Closure>(|engine| {
                let rows = engine.scan(CF_DELIVERIES, &prefix, Some(&keys::end_of(&prefix)), 0)?;
                let mut batch = Batch::new();
                for (k, _) in &rows {
                    batch.delete(CF_DELIVERIES, k.clone());
                }
                let staged = s.offsets.stage_adopt(&key, committed, &mut batch)?;
                Ok((batch, staged))
            })?;
            s.offsets.publish_adopted(&staged);
            Ok(())
        })
        .await
    }

    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), DeliveryError> {
        let prefix = keys::deliveries_of_subscription(subscription, incarnation);
        self.blocking(move |s| loop {
            let done = s.group.commit_with::<_, Closure>(|engine| {
                let rows =
                    engine.scan(CF_DELIVERIES, &prefix, Some(&keys::end_of(&prefix)), 1000)?;
                let mut batch = Batch::new();
                for (k, _) in &rows {
                    batch.delete(CF_DELIVERIES, k.clone());
                }
                Ok((batch, rows.is_empty()))
            })?;
            if done {
                return Ok(());
            }
        })
        .await
    }

    fn health(&self) -> Result<(), String> {
        match self.inner.group.poisoned() {
            Some(reason) => Err(reason),
            None => Ok(()),
        }
    }
}

impl RocksDeliveryStore {
    /// Every record under `prefix`, decoded, in key order.
    async fn load_prefix(&self, prefix: Vec<u8>) -> Result<Vec<DeliveryRecord>, DeliveryError> {
        self.blocking(move |s| {
            let rows = s
                .group
                .engine()
                .scan(CF_DELIVERIES, &prefix, Some(&keys::end_of(&prefix)), 0)
                .map_err(local)?;
            rows.into_iter()
                .map(|(k, v)| {
                    let (key, offset) = parse_key(&k)?;
                    decode(key, offset, &v).map_err(|e| DeliveryError::Corrupt {
                        key: format!("{k:?}"),
                        reason: e.to_string(),
                    })
                })
                .collect()
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshd_local::testing::assert_damage_is_detected;
    use proptest::prelude::*;

    fn key() -> OffsetKey {
        OffsetKey {
            subscription: "s".into(),
            incarnation: 3,
            topic: "t".into(),
            partition: 1,
        }
    }

    fn state() -> impl Strategy<Value = DeliveryState> {
        prop_oneof![
            Just(DeliveryState::InFlight),
            Just(DeliveryState::WaitingRetry),
            Just(DeliveryState::AckedAwaitingCommit),
            Just(DeliveryState::DeadLettering),
        ]
    }

    proptest! {
        #[test]
        fn delivery_records_round_trip(
            offset in any::<u64>(), attempt in 1u32.., id in "[a-f0-9]{0,32}", deadline in any::<u64>(),
            reason in proptest::option::of(".{0,20}"), first in any::<u64>(), state in state(),
            epoch in any::<i64>(), session in proptest::option::of(("[a-z0-9]{1,8}", any::<i64>())),
        ) {
            let r = DeliveryRecord {
                key: key(), offset, attempt, delivery_id: id, deadline_ms: deadline, last_reason: reason,
                first_delivered_at_ms: first, state, owner_epoch: epoch,
                session: session.map(|(session_id, epoch)| SessionBinding { session_id, epoch }),
            };
            prop_assert_eq!(decode(key(), offset, &encode(&r)), Ok(r));
        }
    }

    #[test]
    fn damaged_delivery_records_are_detected() {
        let r = DeliveryRecord {
            key: key(),
            offset: 4,
            attempt: 2,
            delivery_id: "d1".into(),
            deadline_ms: 99,
            last_reason: Some("nack".into()),
            first_delivered_at_ms: 7,
            state: DeliveryState::WaitingRetry,
            owner_epoch: 0,
            session: None,
        };
        assert_damage_is_detected(&encode(&r), |b| decode(key(), 4, b));
    }
}

/// Fuzzing the delivery key parser (docs/fuzzing.md): a key read back
/// from the `deliveries` column family parses only into the record it is the key of.
#[cfg(test)]
mod fuzz {
    use super::*;
    use meshd_fuzz_cases::cases;
    use proptest::prelude::*;

    fn key_bytes() -> impl Strategy<Value = Vec<u8>> {
        let component = prop_oneof![
            (0u8..12).prop_map(|b| vec![b]),
            "[a-z.]{0,10}".prop_map(String::into_bytes),
            any::<u64>().prop_map(|n| n.to_be_bytes().to_vec()),
            proptest::collection::vec(any::<u8>(), 0..6),
        ];
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..48),
            proptest::collection::vec(component, 0..8).prop_map(|c| {
                let mut k = vec![keys::DELIVERY];
                k.extend(c.concat());
                k
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn delivery_key_parse(k in key_bytes()) {
            match parse_key(&k) {
                Ok((key, offset)) => {
                    let mut again = keys::delivery_key(&key, offset);
                    again[0] = k[0];
                    prop_assert_eq!(again, k);
                }
                Err(e) => prop_assert!(matches!(e, DeliveryError::Corrupt { .. }), "{e:?}"),
            }
        }
    }
}
