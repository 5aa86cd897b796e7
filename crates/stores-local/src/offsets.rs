//! The OffsetStore on the Local RocksDB (column family `offsets`), with an in-memory
//! cache of durable values and fenced checkpoints to Meta.
//!
//! Two maps: `staged` is the latest value written (possibly not yet fsynced) and is
//! what a new commit is checked against, under the group-commit lock, so two racing
//! commits are ordered like their writes. `durable` is what reads see: a value moves
//! there only after its fsync, so `committed` never shows a value a crash could take
//! back.
//!
//! A value written buffered (an ack's resolve, which need not wait for its fsync:
//! acks are durable within the flush interval) waits in `pending` with its
//! group-commit ticket and moves to `durable` once an fsync has covered that ticket
//! (any fsync of the Local log), as the delivery flusher or the next read finds. A
//! read that finds its key still pending makes the pending writes durable first, so a
//! caller reads its own acks.

use crate::keys::{self, CF_OFFSETS};
use crate::store_thread::applied_so_far;
use async_trait::async_trait;
use meshd_local::codec::{DecodeError, Decoder, Encoder};
use meshd_local::group::GroupCommit;
use meshd_local::{Batch, LocalError};
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{key as meta_key, KeyKind};
use meshd_meta::{Meta, MetaError, Txn};
use meshd_stores::offsets::{Committed, OffsetError, OffsetKey, OffsetStore};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

const OFFSET_V1: u8 = 1;

pub fn encode(c: &Committed) -> Vec<u8> {
    Encoder::new(OFFSET_V1)
        .u64(c.offset)
        .u64(c.epoch)
        .u64(c.at_ms)
        .finish()
}

pub fn decode(b: &[u8]) -> Result<Committed, DecodeError> {
    let mut d = Decoder::new(b, OFFSET_V1)?;
    let c = Committed {
        offset: d.u64()?,
        epoch: d.u64()?,
        at_ms: d.u64()?,
    };
    d.finish()?;
    Ok(c)
}

#[derive(Clone)]
pub struct RocksOffsetStore {
    inner: Arc<Inner>,
}

struct Inner {
    group: Arc<GroupCommit>,
    /// Latest written per key; changed only under the group-commit lock.
    staged: Mutex<BTreeMap<OffsetKey, Committed>>,
    /// Latest durable per key; what reads see.
    durable: Mutex<BTreeMap<OffsetKey, Committed>>,
    /// Written buffered, not yet known durable: (group-commit ticket, key, value).
    pending: Mutex<Vec<(u64, OffsetKey, Committed)>>,
    backwards: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Map updates are single inserts/removes: consistent after a panic elsewhere.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Outcome unknown when this call's batch reached the engine, refused otherwise.
fn local(e: LocalError) -> OffsetError {
    if e.outcome_unknown() {
        OffsetError::Indeterminate(e.reason())
    } else {
        OffsetError::Failed(e.reason())
    }
}

/// The result of staging a commit inside a group-commit closure.
pub(crate) enum Staged {
    /// Nothing to write (the same offset again).
    Unchanged(Committed),
    Write(OffsetKey, Committed),
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Shows `c` for `key` unless what is shown supersedes it.
fn show(durable: &mut BTreeMap<OffsetKey, Committed>, key: &OffsetKey, c: Committed) {
    if newer(&c, durable.get(key)) {
        durable.insert(key.clone(), c);
    }
}

/// Whether `new` supersedes `old` (a reset's higher epoch wins; within an epoch the
/// higher offset).
fn newer(new: &Committed, old: Option<&Committed>) -> bool {
    match old {
        None => true,
        Some(old) => (new.epoch, new.offset) > (old.epoch, old.offset),
    }
}

impl RocksOffsetStore {
    /// Loads every committed offset (recovery).
    pub fn open(group: Arc<GroupCommit>) -> Result<Self, OffsetError> {
        let prefix = [keys::OFFSET];
        let rows = group
            .engine()
            .scan(CF_OFFSETS, &prefix, Some(&keys::end_of(&prefix)), 0)
            .map_err(local)?;
        let mut map = BTreeMap::new();
        for (k, v) in rows {
            let corrupt = |reason: String| OffsetError::Corrupt {
                key: format!("{k:?}"),
                reason,
            };
            let (key, rest) = keys::parse_partition_part(&k[1..])
                .ok_or_else(|| corrupt("malformed offset key".into()))?;
            if !rest.is_empty() {
                return Err(corrupt("trailing bytes in offset key".into()));
            }
            let c = decode(&v).map_err(|e| corrupt(e.to_string()))?;
            map.insert(key, c);
        }
        tracing::info!(
            store = "offsets",
            backend = "rocksdb",
            partitions = map.len(),
            "offset store opened"
        );
        Ok(Self {
            inner: Arc::new(Inner {
                group,
                staged: Mutex::new(map.clone()),
                durable: Mutex::new(map),
                pending: Mutex::new(Vec::new()),
                backwards: AtomicU64::new(0),
            }),
        })
    }

    /// Checks and stages a commit (or reset) into `batch`. Must run inside a
    /// group-commit closure (under the write lock).
    pub(crate) fn stage(
        &self,
        key: &OffsetKey,
        offset: u64,
        reset: bool,
        batch: &mut Batch,
    ) -> Result<Staged, OffsetError> {
        keys::check_name("subscription", &key.subscription)
            .and_then(|_| keys::check_name("topic", &key.topic))
            .map_err(|e| OffsetError::Failed(format!("invalid offset key: {e}")))?;
        let mut staged = lock(&self.inner.staged);
        let current = staged.get(key).copied();
        let next = if reset {
            Committed {
                offset,
                epoch: current.map(|c| c.epoch + 1).unwrap_or(1),
                at_ms: now_ms(),
            }
        } else {
            match current {
                Some(c) if offset < c.offset => {
                    self.inner.backwards.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(store = "offsets", backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, current = c.offset, requested = offset, "backwards commit rejected");
                    return Err(OffsetError::Backwards {
                        current: c.offset,
                        requested: offset,
                    });
                }
                Some(c) if offset == c.offset => return Ok(Staged::Unchanged(c)),
                _ => Committed {
                    offset,
                    epoch: current.map(|c| c.epoch).unwrap_or(0),
                    at_ms: now_ms(),
                },
            }
        };
        batch.put(CF_OFFSETS, keys::offset_key(key), encode(&next));
        staged.insert(key.clone(), next);
        Ok(Staged::Write(key.clone(), next))
    }

    /// Stages `committed` exactly as given (Meta's checkpoint, which is authoritative on
    /// acquiring a partition in cluster mode): the local value may be ahead or behind.
    /// Must run inside a group-commit closure. Publish with [`Self::publish_adopted`].
    pub(crate) fn stage_adopt(
        &self,
        key: &OffsetKey,
        committed: Committed,
        batch: &mut Batch,
    ) -> Result<Staged, OffsetError> {
        keys::check_name("subscription", &key.subscription)
            .and_then(|_| keys::check_name("topic", &key.topic))
            .map_err(|e| OffsetError::Failed(format!("invalid offset key: {e}")))?;
        batch.put(CF_OFFSETS, keys::offset_key(key), encode(&committed));
        lock(&self.inner.staged).insert(key.clone(), committed);
        Ok(Staged::Write(key.clone(), committed))
    }

    /// Publishes an adopted value once its batch is durable, replacing whatever the
    /// cache shows (it may move backwards: Meta is authoritative). Values of the key
    /// still pending were overwritten by the adopted one and never show.
    pub(crate) fn publish_adopted(&self, staged: &Staged) {
        if let Staged::Write(key, c) = staged {
            let mut pending = lock(&self.inner.pending);
            pending.retain(|(_, k, _)| k != key);
            lock(&self.inner.durable).insert(key.clone(), *c);
        }
    }

    /// Publishes a staged value written buffered with group-commit `ticket` once an
    /// fsync covers that ticket (see [`Self::catch_up`]).
    pub(crate) fn publish_when_durable(&self, ticket: u64, staged: Staged) {
        if let Staged::Write(key, c) = staged {
            lock(&self.inner.pending).push((ticket, key, c));
        }
        self.catch_up();
    }

    /// Publishes every pending value whose ticket an fsync has covered.
    pub(crate) fn catch_up(&self) {
        let synced = self.inner.group.synced();
        let mut pending = lock(&self.inner.pending);
        if pending.is_empty() {
            return;
        }
        let mut durable = lock(&self.inner.durable);
        pending.retain(|(ticket, key, c)| {
            if *ticket > synced {
                return true;
            }
            show(&mut durable, key, *c);
            false
        });
    }

    /// Before a read of the keys `which` selects: any of them still pending is made
    /// durable (one fsync for everything written so far) and published.
    async fn settle(&self, which: impl Fn(&OffsetKey) -> bool) -> Result<(), OffsetError> {
        // An advance submitted before this read and not yet applied (an ack's resolve
        // is answered without waiting for its write) is applied first, so a client
        // reads its own acks.
        applied_so_far(&self.inner.group).await;
        self.catch_up();
        if !lock(&self.inner.pending).iter().any(|(_, k, _)| which(k)) {
            return Ok(());
        }
        self.blocking(|s| {
            s.inner.group.sync_all().map_err(local)?;
            s.catch_up();
            Ok(())
        })
        .await
    }

    /// Publishes a staged value once its batch is durable.
    pub(crate) fn publish(&self, staged: &Staged) -> Committed {
        match staged {
            Staged::Unchanged(c) => *c,
            Staged::Write(key, c) => {
                show(&mut lock(&self.inner.durable), key, *c);
                *c
            }
        }
    }

    fn write(&self, key: &OffsetKey, offset: u64, reset: bool) -> Result<Committed, OffsetError> {
        let staged = self
            .inner
            .group
            .commit_with::<_, OffsetErrorOrLocal>(|_| {
                let mut batch = Batch::new();
                let s = self.stage(key, offset, reset, &mut batch)?;
                Ok((batch, s))
            })
            .map_err(OffsetError::from)?;
        Ok(self.publish(&staged))
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&RocksOffsetStore) -> Result<T, OffsetError> + Send + 'static,
    ) -> Result<T, OffsetError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || f(&this))
            .await
            .map_err(|e| OffsetError::Failed(format!("offset task failed: {e}")))?
    }

    /// The Meta key of a partition's checkpoint.
    fn checkpoint_key(key: &OffsetKey) -> Vec<u8> {
        meta_key(
            KeyKind::Checkpoints,
            &[
                &key.subscription,
                &key.incarnation.to_string(),
                &key.topic,
                &key.partition.to_string(),
            ],
        )
    }
}

/// The error of a group-commit closure that stages offsets: a domain error or a
/// Local engine failure.
pub(crate) enum OffsetErrorOrLocal {
    Offset(OffsetError),
    Local(LocalError),
}

impl From<LocalError> for OffsetErrorOrLocal {
    fn from(e: LocalError) -> Self {
        OffsetErrorOrLocal::Local(e)
    }
}

impl From<OffsetError> for OffsetErrorOrLocal {
    fn from(e: OffsetError) -> Self {
        OffsetErrorOrLocal::Offset(e)
    }
}

impl From<OffsetErrorOrLocal> for OffsetError {
    fn from(e: OffsetErrorOrLocal) -> Self {
        match e {
            OffsetErrorOrLocal::Offset(e) => e,
            OffsetErrorOrLocal::Local(e) => local(e),
        }
    }
}

#[async_trait]
impl OffsetStore for RocksOffsetStore {
    async fn get(&self, key: &OffsetKey) -> Result<Option<Committed>, OffsetError> {
        if let Some(reason) = self.inner.group.poisoned() {
            return Err(OffsetError::Failed(reason));
        }
        self.settle(|k| k == key).await?;
        Ok(lock(&self.inner.durable).get(key).copied())
    }

    async fn list(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<Vec<(OffsetKey, Committed)>, OffsetError> {
        if let Some(reason) = self.inner.group.poisoned() {
            return Err(OffsetError::Failed(reason));
        }
        self.settle(|k| k.subscription == subscription && k.incarnation == incarnation)
            .await?;
        Ok(lock(&self.inner.durable)
            .iter()
            .filter(|(k, _)| k.subscription == subscription && k.incarnation == incarnation)
            .map(|(k, c)| (k.clone(), *c))
            .collect())
    }

    async fn commit(&self, key: &OffsetKey, offset: u64) -> Result<Committed, OffsetError> {
        let key = key.clone();
        self.blocking(move |s| s.write(&key, offset, false)).await
    }

    async fn reset(&self, key: &OffsetKey, offset: u64) -> Result<Committed, OffsetError> {
        let key = key.clone();
        self.blocking(move |s| s.write(&key, offset, true)).await
    }

    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), OffsetError> {
        let subscription = subscription.to_string();
        self.blocking(move |s| {
            s.inner
                .group
                .commit_with::<_, OffsetErrorOrLocal>(|_| {
                    let mut batch = Batch::new();
                    lock(&s.inner.pending).retain(|(_, k, _)| {
                        !(k.subscription == subscription && k.incarnation == incarnation)
                    });
                    let mut staged = lock(&s.inner.staged);
                    staged.retain(|k, _| {
                        let gone = k.subscription == subscription && k.incarnation == incarnation;
                        if gone {
                            batch.delete(CF_OFFSETS, keys::offset_key(k));
                        }
                        !gone
                    });
                    Ok((batch, ()))
                })
                .map_err(OffsetError::from)?;
            lock(&s.inner.durable)
                .retain(|k, _| !(k.subscription == subscription && k.incarnation == incarnation));
            Ok(())
        })
        .await
    }

    fn backwards_rejections(&self) -> u64 {
        self.inner.backwards.load(Ordering::Relaxed)
    }

    async fn checkpoint_with(
        &self,
        meta: &dyn Meta,
        owner: &Ownership,
        key: &OffsetKey,
        resolved: &[u64],
    ) -> Result<(), OffsetError> {
        let Some(c) = self.get(key).await? else {
            return Ok(());
        };
        let resolved = meshd_stores::offsets::resolved_ranges(c.offset, resolved);
        let value = serde_json::to_vec(&CheckpointRecord {
            v: 1,
            committed: c,
            resolved,
            owner_epoch: Some(owner.epoch()),
            owner_instance: owner.holder_text().map(str::to_string),
        })
        .map_err(|e| OffsetError::Failed(format!("encoding checkpoint: {e}")))?;
        owner
            .commit(meta, Txn::new().put(&Self::checkpoint_key(key), &value))
            .await?;
        Ok(())
    }

    async fn load_checkpoint_with(
        &self,
        meta: &dyn Meta,
        key: &OffsetKey,
    ) -> Result<Option<(Committed, Vec<u64>)>, OffsetError> {
        let k = Self::checkpoint_key(key);
        let Some(kv) = meta.get(&k).await?.kv else {
            return Ok(None);
        };
        let rec: CheckpointRecord =
            serde_json::from_slice(&kv.value).map_err(|e| OffsetError::Corrupt {
                key: String::from_utf8_lossy(&k).into_owned(),
                reason: e.to_string(),
            })?;
        if rec.v != 1 {
            return Err(OffsetError::Corrupt {
                key: String::from_utf8_lossy(&k).into_owned(),
                reason: format!("unknown checkpoint version {}", rec.v),
            });
        }
        let resolved = meshd_stores::offsets::expand_resolved(rec.committed.offset, &rec.resolved)
            .map_err(|reason| OffsetError::Corrupt {
                key: String::from_utf8_lossy(&k).into_owned(),
                reason,
            })?;
        Ok(Some((rec.committed, resolved)))
    }

    async fn init_checkpoint(
        &self,
        meta: &dyn Meta,
        key: &OffsetKey,
        offset: u64,
    ) -> Result<Committed, OffsetError> {
        let start = Committed {
            offset,
            epoch: 0,
            at_ms: now_ms(),
        };
        let value = serde_json::to_vec(&CheckpointRecord {
            v: 1,
            committed: start,
            resolved: Vec::new(),
            owner_epoch: None,
            owner_instance: None,
        })
        .map_err(|e| OffsetError::Failed(format!("encoding checkpoint: {e}")))?;
        match meta
            .put(
                &Self::checkpoint_key(key),
                &value,
                meshd_meta::Precondition::Absent,
                None,
            )
            .await
        {
            Ok(_) => Ok(start),
            Err(MetaError::Conflict { .. }) => self
                .load_checkpoint(meta, key)
                .await?
                .ok_or_else(|| OffsetError::Failed("checkpoint vanished while being read".into())),
            Err(e) => Err(e.into()),
        }
    }

    async fn drop_checkpoints(
        &self,
        meta: &dyn Meta,
        subscription: &str,
        incarnation: i64,
    ) -> Result<u64, OffsetError> {
        let prefix = meshd_meta::keys::prefix(
            KeyKind::Checkpoints,
            &[subscription, &incarnation.to_string()],
        );
        Ok(meshd_stores::delete_prefix(meta, prefix, 64).await?)
    }
}

/// A partition's committed offset in Meta (cluster mode), with the offsets above it
/// that are resolved already (acked or dead-lettered above a gap) as
/// `[from, to)` ranges, so a new owner does not deliver them again. A release that
/// does not know `resolved` ignores it (it delivers those again: duplicates, never a
/// loss), and this one reads a record without it as none.
///
/// `owner_epoch` is the epoch of the owner that wrote it (the owner key's
/// `mod_revision` at its acquisition, which the write's fence compared) and
/// `owner_instance` the instance (what the owner key held), so etcd's history shows
/// which tenure each checkpoint belongs to: the cluster crash loop checks
/// every checkpoint against the owner key at its revision. Absent in the put-if-absent
/// creation (no owner) and in records of earlier releases; nothing reads it back, and
/// a release that does not know it ignores it (serde keeps no unknown-field rule here),
/// so the version stays 1.
#[derive(serde::Serialize, serde::Deserialize)]
struct CheckpointRecord {
    v: u32,
    committed: Committed,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    resolved: Vec<(u64, u64)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    owner_epoch: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    owner_instance: Option<String>,
}

impl From<MetaError> for OffsetErrorOrLocal {
    fn from(e: MetaError) -> Self {
        OffsetErrorOrLocal::Offset(OffsetError::Meta(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshd_local::testing::assert_damage_is_detected;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn offset_records_round_trip(offset in any::<u64>(), epoch in any::<u64>(), at_ms in any::<u64>()) {
            let c = Committed { offset, epoch, at_ms };
            prop_assert_eq!(decode(&encode(&c)), Ok(c));
        }
    }

    #[test]
    fn damaged_offset_records_are_detected() {
        assert_damage_is_detected(
            &encode(&Committed {
                offset: 9,
                epoch: 1,
                at_ms: 5,
            }),
            decode,
        );
    }
}

/// Fuzzing the Meta checkpoint record (docs/fuzzing.md): whatever
/// Meta holds under a checkpoint key decodes or fails, and a decode is exact.
#[cfg(test)]
mod fuzz {
    use super::*;
    use meshd_fuzz_cases::cases;
    use proptest::prelude::*;

    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<u64>().prop_map(|n| n.to_string()),
            any::<i64>().prop_map(|n| n.to_string()),
            Just("1.5".to_string()),
            Just("1e3".to_string()),
            Just("18446744073709551616".to_string()),
            Just("null".to_string()),
            Just("\"1\"".to_string()),
        ]
    }

    fn checkpoint_json() -> impl Strategy<Value = Vec<u8>> {
        let field = prop_oneof![Just("offset"), Just("epoch"), Just("at_ms"), Just("other")];
        (
            number(),
            proptest::collection::vec((field, number()), 0..5),
            any::<bool>(),
        )
            .prop_map(|(v, fields, nested)| {
                let inner: Vec<String> =
                    fields.iter().map(|(k, n)| format!("\"{k}\":{n}")).collect();
                let committed = if nested {
                    format!("{{{}}}", inner.join(","))
                } else {
                    "[]".into()
                };
                format!("{{\"v\":{v},\"committed\":{committed}}}").into_bytes()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn checkpoint_record_decode(
            bytes in prop_oneof![proptest::collection::vec(any::<u8>(), 0..48), checkpoint_json()],
        ) {
            if let Ok(rec) = serde_json::from_slice::<CheckpointRecord>(&bytes) {
                let again = serde_json::to_vec(&rec).unwrap();
                let back: CheckpointRecord = serde_json::from_slice(&again).unwrap();
                prop_assert_eq!((back.v, back.committed), (rec.v, rec.committed));
            }
        }
    }
}
