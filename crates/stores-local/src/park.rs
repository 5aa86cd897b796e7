//! # The park index on the Local RocksDB (column family `deliveries`)
//!
//! Per (subscription incarnation, topic, partition), the events that wait for their
//! time (http-api.md, Additions, "Parking"), each with its body: log retention may
//! remove the event from the log while it is parked, and the delivery reads the body
//! from here. An entry is written **durably** before the delivery core hears of it
//! (`Input::Parked`), so the committed offset never passes an event that a crash could
//! lose; it goes when the event is settled (acked, or dead-lettered with this body).
//!
//! Two keys per entry (see [`crate::keys`]): `k` + partition + due + offset holds the
//! attempts made before parking (4 bytes, big-endian) and the body, so the due entries of a partition are the front of its range and are read in
//! due order without anything in memory; `q` + partition + offset holds the due time,
//! so an entry is found (and parked at most once) by its offset. Memory: nothing per
//! entry; a million parked events cost disk only.

use crate::delivery::{local, Closure};
use crate::keys::{self, CF_DELIVERIES};
use crate::store_thread::on_store_thread;
use async_trait::async_trait;
use meshd_local::group::{GroupCommit, Wait};
use meshd_local::{Batch, KvEngine, LocalError};
use meshd_stores::delivery::DeliveryError;
use meshd_stores::offsets::OffsetKey;
pub use meshd_stores::park::{
    JournalWrite, ParkError, ParkIndex, ParkJournal, Parked, Removed, HELD,
};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// Journal entries read (and written here) at once when a partition is adopted.
const ADOPT_PAGE: usize = 500;

/// Journal puts of one `park_many` in flight at once.
const JOURNAL_PUTS_AT_ONCE: usize = 64;

#[derive(Clone)]
pub struct RocksParkStore {
    group: Arc<GroupCommit>,
}

fn due_key(key: &OffsetKey, due_ms: u64, offset: u64) -> Vec<u8> {
    let mut k = keys::parked_of_partition(key, keys::PARKED);
    k.extend_from_slice(&due_ms.to_be_bytes());
    k.extend_from_slice(&offset.to_be_bytes());
    k
}

fn offset_key(key: &OffsetKey, offset: u64) -> Vec<u8> {
    let mut k = keys::parked_of_partition(key, keys::PARKED_OFFSET);
    k.extend_from_slice(&offset.to_be_bytes());
    k
}

fn key_prefix(key: &OffsetKey, hash: u64) -> Vec<u8> {
    let mut k = keys::parked_of_partition(key, keys::PARKED_KEY);
    k.extend_from_slice(&hash.to_be_bytes());
    k
}

/// A keyed entry's marker: by key hash, its place in the key's line, and offset.
fn marker_key(key: &OffsetKey, hash: u64, p: &Parked) -> Vec<u8> {
    let mut k = key_prefix(key, hash);
    k.extend_from_slice(&p.seq.to_be_bytes());
    k.extend_from_slice(&p.offset.to_be_bytes());
    k
}

/// The lookup key's value: the due time (the rest is in the entry).
fn lookup_value(p: &Parked) -> Vec<u8> {
    p.due_ms.to_be_bytes().to_vec()
}

/// Deletes every key under `prefix` in the `deliveries` column family, durably, in
/// batches of 1000 (blocking: call it from a blocking task).
fn delete_prefix(group: &GroupCommit, prefix: &[u8]) -> Result<(), DeliveryError> {
    let end = keys::end_of(prefix);
    loop {
        let done = group
            .commit_with::<_, Closure>(|engine| {
                let rows = engine.scan(CF_DELIVERIES, prefix, Some(&end), 1000)?;
                let mut batch = Batch::new();
                for (k, _) in &rows {
                    batch.delete(CF_DELIVERIES, k.clone());
                }
                Ok((batch, rows.is_empty()))
            })
            .map_err(DeliveryError::from)?;
        if done {
            return Ok(());
        }
    }
}

/// The keys of an entry: its due time (and key hash) by offset; its attempts, key
/// and `deliverat` (`Parked::encode_tail`) then the body by due time and offset; and,
/// for a keyed entry, an empty marker by key hash and offset.
fn put_entry(batch: &mut Batch, key: &OffsetKey, p: &Parked, body: &[u8]) {
    batch.put(CF_DELIVERIES, offset_key(key, p.offset), lookup_value(p));
    let mut value = Vec::with_capacity(21 + body.len());
    p.encode_tail(&mut value);
    value.extend_from_slice(body);
    batch.put(CF_DELIVERIES, due_key(key, p.due_ms, p.offset), value);
    if let Some(h) = p.key {
        batch.put(CF_DELIVERIES, marker_key(key, h, p), Vec::new());
    }
}

/// Deletes the keys of `p`'s entry.
fn delete_entry(batch: &mut Batch, key: &OffsetKey, p: &Parked) {
    batch.delete(CF_DELIVERIES, offset_key(key, p.offset));
    batch.delete(CF_DELIVERIES, due_key(key, p.due_ms, p.offset));
    if let Some(h) = p.key {
        batch.delete(CF_DELIVERIES, marker_key(key, h, p));
    }
}

fn be8(b: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(b.try_into().ok()?))
}

fn corrupt(k: &[u8], reason: &str) -> DeliveryError {
    DeliveryError::Corrupt {
        key: format!("{k:?}"),
        reason: reason.to_string(),
    }
}

/// The due time of `offset`'s entry, `None` when it is not parked.
fn due_of(engine: &dyn KvEngine, key: &OffsetKey, offset: u64) -> Result<Option<u64>, Closure> {
    let k = offset_key(key, offset);
    match engine.get(CF_DELIVERIES, &k)? {
        None => Ok(None),
        Some(v) => v
            .get(..8)
            .and_then(be8)
            .map(Some)
            .ok_or_else(|| Closure::Delivery(corrupt(&k, "due time is not 8 bytes"))),
    }
}

/// Decodes an entry's value (by due key `k`, whose last 16 bytes are due and
/// offset): the entry and where its body starts.
fn decode_entry(k: &[u8], v: &[u8]) -> Result<(Parked, usize), DeliveryError> {
    let tail = k
        .len()
        .checked_sub(16)
        .and_then(|at| k.get(at..))
        .ok_or_else(|| corrupt(k, "park key too short"))?;
    let mut p = Parked::new(
        be8(&tail[8..]).ok_or_else(|| corrupt(k, "offset"))?,
        be8(&tail[..8]).ok_or_else(|| corrupt(k, "due"))?,
        0,
    );
    let at = p
        .decode_tail(v)
        .ok_or_else(|| corrupt(k, "park entry without its attempt count and key"))?;
    Ok((p, at))
}

/// `offset`'s entry, its stored value and where the body starts in it (`None`: not
/// parked).
fn entry_at(
    engine: &dyn KvEngine,
    key: &OffsetKey,
    offset: u64,
) -> Result<Option<(Parked, Vec<u8>, usize)>, Closure> {
    let Some(due) = due_of(engine, key, offset)? else {
        return Ok(None);
    };
    let k = due_key(key, due, offset);
    let Some(v) = engine.get(CF_DELIVERIES, &k)? else {
        return Err(Closure::Delivery(corrupt(
            &k,
            "lookup key without its entry",
        )));
    };
    let (p, at) = decode_entry(&k, &v).map_err(Closure::Delivery)?;
    Ok(Some((p, v, at)))
}

/// The offsets of key `hash`'s first `n` entries (in the key's line).
fn first_of_key(
    engine: &dyn KvEngine,
    key: &OffsetKey,
    hash: u64,
    n: usize,
) -> Result<Vec<u64>, Closure> {
    let prefix = key_prefix(key, hash);
    let rows = engine.scan(CF_DELIVERIES, &prefix, Some(&keys::end_of(&prefix)), n)?;
    rows.iter()
        .map(|(k, _)| {
            k.len()
                .checked_sub(8)
                .and_then(|at| be8(&k[at..]))
                .ok_or_else(|| Closure::Delivery(corrupt(k, "park key marker too short")))
        })
        .collect()
}

/// Releases `offset`'s entry when it is held: moved to its due time in `batch`.
fn release_in(
    engine: &dyn KvEngine,
    batch: &mut Batch,
    key: &OffsetKey,
    offset: u64,
    now_ms: u64,
) -> Result<Option<Parked>, Closure> {
    let Some((p, value, _)) = entry_at(engine, key, offset)? else {
        return Ok(None);
    };
    if !p.is_held() {
        return Ok(None);
    }
    let r = p.released(now_ms);
    batch.delete(CF_DELIVERIES, due_key(key, p.due_ms, offset));
    batch.put(CF_DELIVERIES, due_key(key, r.due_ms, offset), value);
    batch.put(CF_DELIVERIES, offset_key(key, offset), lookup_value(&r));
    Ok(Some(r))
}

/// A released entry with its body (read from its old place: the batch that moves it
/// is not written).
fn released_with_body(
    engine: &dyn KvEngine,
    key: &OffsetKey,
    released: Option<Parked>,
) -> Result<Option<(Parked, Vec<u8>)>, DeliveryError> {
    let Some(r) = released else {
        return Ok(None);
    };
    let Some((_, mut value, at)) = entry_at(engine, key, r.offset)? else {
        return Ok(None);
    };
    Ok(Some((r, value.split_off(at))))
}

/// What removing `offset`'s entry writes into `batch`: its keys go, and when it is
/// the first of its key, the next one of that key is released if held.
fn remove_in(
    engine: &dyn KvEngine,
    batch: &mut Batch,
    key: &OffsetKey,
    offset: u64,
    now_ms: u64,
) -> Result<Removed, Closure> {
    let Some((p, _, _)) = entry_at(engine, key, offset)? else {
        return Ok(Removed::default());
    };
    delete_entry(batch, key, &p);
    let mut released = None;
    if let Some(h) = p.key {
        if let [first, next] = first_of_key(engine, key, h, 2)?[..] {
            if first == offset {
                released = release_in(engine, batch, key, next, now_ms)?;
            }
        }
    }
    Ok(Removed {
        removed: true,
        released,
    })
}

impl RocksParkStore {
    pub fn open(group: Arc<GroupCommit>) -> Self {
        Self { group }
    }

    fn check(key: &OffsetKey) -> Result<(), DeliveryError> {
        keys::check_name("subscription", &key.subscription)
            .and_then(|_| keys::check_name("topic", &key.topic))
            .map_err(DeliveryError::Invalid)
    }

    /// Removes every entry of the partition, durably (in batches).
    pub async fn clear_partition(&self, key: &OffsetKey) -> Result<(), DeliveryError> {
        Self::check(key)?;
        self.delete_prefixes(keys::PARK_SPACES.map(|space| keys::parked_of_partition(key, space)))
            .await
    }

    /// Writes `entries` as they are (no check for entries present), durably: a
    /// partition's index rebuilt page by page after [`clear_partition`](Self::clear_partition).
    pub async fn insert_entries(
        &self,
        key: &OffsetKey,
        entries: Vec<(Parked, Vec<u8>)>,
    ) -> Result<(), DeliveryError> {
        Self::check(key)?;
        let key = key.clone();
        on_store_thread(&self.group, Wait::Durable, move |_| {
            let mut batch = Batch::new();
            for (p, body) in &entries {
                put_entry(&mut batch, &key, p, body);
            }
            Ok::<_, Closure>((batch, ()))
        })
        .await
        .map_err(DeliveryError::from)?;
        Ok(())
    }

    /// What removing `offset`'s entry would release (with its body), without
    /// writing: the journal takes the release before the local index does.
    async fn release_after_removal(
        &self,
        key: &OffsetKey,
        offset: u64,
        now_ms: u64,
    ) -> Result<Option<(Parked, Vec<u8>)>, DeliveryError> {
        let key = key.clone();
        self.blocking(move |group| {
            let engine = group.engine().as_ref();
            let mut batch = Batch::new();
            let removed = remove_in(engine, &mut batch, &key, offset, now_ms)?;
            released_with_body(engine, &key, removed.released)
        })
        .await
    }

    /// What [`ParkIndex::release_key`] would release (with its body), without writing.
    async fn release_of_key(
        &self,
        key: &OffsetKey,
        hash: u64,
        now_ms: u64,
    ) -> Result<Option<(Parked, Vec<u8>)>, DeliveryError> {
        let key = key.clone();
        self.blocking(move |group| {
            let engine = group.engine().as_ref();
            let mut batch = Batch::new();
            let released = match first_of_key(engine, &key, hash, 1)?.first() {
                Some(&first) => release_in(engine, &mut batch, &key, first, now_ms)?,
                None => None,
            };
            released_with_body(engine, &key, released)
        })
        .await
    }

    /// `offset`'s entry and its body, with one read (`None`: not parked).
    pub async fn entry_with_body(
        &self,
        key: &OffsetKey,
        offset: u64,
    ) -> Result<Option<(Parked, Vec<u8>)>, DeliveryError> {
        let key = key.clone();
        self.blocking(move |group| {
            let Some((p, mut value, at)) = entry_at(group.engine().as_ref(), &key, offset)? else {
                return Ok(None);
            };
            Ok(Some((p, value.split_off(at))))
        })
        .await
    }

    /// Runs `f` with the store's group on a blocking thread.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&GroupCommit) -> Result<T, DeliveryError> + Send + 'static,
    ) -> Result<T, DeliveryError> {
        let group = self.group.clone();
        tokio::task::spawn_blocking(move || f(&group))
            .await
            .map_err(|e| DeliveryError::Poisoned(format!("park index task failed: {e}")))?
    }

    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn KvEngine) -> Result<T, LocalError> + Send + 'static,
    ) -> Result<T, DeliveryError> {
        self.blocking(move |group| f(group.engine().as_ref()).map_err(local))
            .await
    }

    /// Deletes every key under each of `prefixes`, durably.
    async fn delete_prefixes(&self, prefixes: [Vec<u8>; 3]) -> Result<(), DeliveryError> {
        self.blocking(move |group| {
            prefixes
                .iter()
                .try_for_each(|prefix| delete_prefix(group, prefix))
        })
        .await
    }
}

#[async_trait]
impl ParkIndex for RocksParkStore {
    async fn adopt(&self, _key: &OffsetKey, _epoch: i64) -> Result<(), ParkError> {
        Ok(())
    }

    async fn park_many(
        &self,
        key: &OffsetKey,
        entries: Vec<(Parked, Vec<u8>)>,
    ) -> Result<Vec<bool>, ParkError> {
        Self::check(key)?;
        let key = key.clone();
        let (_, created) = on_store_thread(&self.group, Wait::Durable, move |engine| {
            let mut batch = Batch::new();
            let mut created = Vec::with_capacity(entries.len());
            let mut seen = BTreeSet::new();
            for (p, body) in &entries {
                let new = seen.insert(p.offset) && due_of(engine, &key, p.offset)?.is_none();
                if new {
                    put_entry(&mut batch, &key, p, body);
                }
                created.push(new);
            }
            Ok::<_, Closure>((batch, created))
        })
        .await
        .map_err(DeliveryError::from)?;
        Ok(created)
    }

    async fn remove(
        &self,
        key: &OffsetKey,
        offset: u64,
        now_ms: u64,
    ) -> Result<Removed, ParkError> {
        Self::check(key)?;
        let key = key.clone();
        let (_, removed) = on_store_thread(&self.group, Wait::Durable, move |engine| {
            let mut batch = Batch::new();
            let removed = remove_in(engine, &mut batch, &key, offset, now_ms)?;
            Ok::<_, Closure>((batch, removed))
        })
        .await
        .map_err(DeliveryError::from)?;
        Ok(removed)
    }

    async fn repark(
        &self,
        key: &OffsetKey,
        offset: u64,
        due_ms: u64,
        attempt: u32,
    ) -> Result<bool, ParkError> {
        Self::check(key)?;
        let key = key.clone();
        let (_, found) = on_store_thread(&self.group, Wait::Durable, move |engine| {
            let mut batch = Batch::new();
            let Some((p, value, at)) = entry_at(engine, &key, offset)? else {
                return Ok::<_, Closure>((batch, false));
            };
            let again = Parked {
                due_ms,
                attempt,
                ..p.clone()
            };
            batch.delete(CF_DELIVERIES, due_key(&key, p.due_ms, offset));
            put_entry(&mut batch, &key, &again, &value[at..]);
            Ok((batch, true))
        })
        .await
        .map_err(DeliveryError::from)?;
        Ok(found)
    }

    async fn release_key(
        &self,
        key: &OffsetKey,
        hash: u64,
        now_ms: u64,
    ) -> Result<Option<Parked>, ParkError> {
        Self::check(key)?;
        let key = key.clone();
        let (_, released) = on_store_thread(&self.group, Wait::Durable, move |engine| {
            let mut batch = Batch::new();
            let released = match first_of_key(engine, &key, hash, 1)?.first() {
                Some(&first) => release_in(engine, &mut batch, &key, first, now_ms)?,
                None => None,
            };
            Ok::<_, Closure>((batch, released))
        })
        .await
        .map_err(DeliveryError::from)?;
        Ok(released)
    }

    async fn keys_parked(
        &self,
        key: &OffsetKey,
        hashes: Vec<u64>,
    ) -> Result<BTreeSet<u64>, DeliveryError> {
        let key = key.clone();
        self.blocking(move |group| {
            let engine = group.engine();
            let mut out = BTreeSet::new();
            for h in hashes {
                if !out.contains(&h) && !first_of_key(engine.as_ref(), &key, h, 1)?.is_empty() {
                    out.insert(h);
                }
            }
            Ok(out)
        })
        .await
    }

    async fn held_keys(&self, key: &OffsetKey) -> Result<Vec<u64>, DeliveryError> {
        let key = key.clone();
        self.blocking(move |group| {
            let engine = group.engine();
            let prefix = keys::parked_of_partition(&key, keys::PARKED_KEY);
            let end = keys::end_of(&prefix);
            let mut start = prefix.clone();
            let mut out = Vec::new();
            // One seek per key: from each key's first marker to the next key's.
            loop {
                let rows = engine
                    .scan(CF_DELIVERIES, &start, Some(&end), 1)
                    .map_err(local)?;
                let Some((k, _)) = rows.first() else {
                    return Ok(out);
                };
                let tail = k
                    .len()
                    .checked_sub(24)
                    .and_then(|at| k.get(at..))
                    .ok_or_else(|| corrupt(k, "park key marker too short"))?;
                let (hash, offset) = (be8(&tail[..8]), be8(&tail[16..]));
                let (Some(hash), Some(offset)) = (hash, offset) else {
                    return Err(corrupt(k, "park key marker"));
                };
                if let Some((p, _, _)) = entry_at(engine.as_ref(), &key, offset)? {
                    if p.is_held() {
                        out.push(hash);
                    }
                }
                let Some(next) = hash.checked_add(1) else {
                    return Ok(out);
                };
                start = prefix.clone();
                start.extend_from_slice(&next.to_be_bytes());
            }
        })
        .await
    }

    async fn earliest(&self, key: &OffsetKey, limit: usize) -> Result<Vec<Parked>, DeliveryError> {
        let prefix = keys::parked_of_partition(key, keys::PARKED);
        let rows = self
            .read(move |engine| {
                let end = keys::end_of(&prefix);
                engine.scan(CF_DELIVERIES, &prefix, Some(&end), limit.max(1))
            })
            .await?;
        rows.into_iter()
            .map(|(k, v)| decode_entry(&k, &v).map(|(p, _)| p))
            .collect()
    }

    async fn entry(&self, key: &OffsetKey, offset: u64) -> Result<Option<Parked>, DeliveryError> {
        let key = key.clone();
        self.blocking(move |group| {
            Ok(entry_at(group.engine().as_ref(), &key, offset)?.map(|(p, _, _)| p))
        })
        .await
    }

    async fn body(&self, key: &OffsetKey, offset: u64) -> Result<Option<Vec<u8>>, DeliveryError> {
        Ok(self
            .entry_with_body(key, offset)
            .await?
            .map(|(_, body)| body))
    }

    async fn parked_among(
        &self,
        key: &OffsetKey,
        offsets: Vec<u64>,
    ) -> Result<Vec<u64>, DeliveryError> {
        let key = key.clone();
        let wanted: BTreeSet<u64> = offsets.into_iter().collect();
        self.read(move |engine| {
            let mut out = Vec::new();
            for o in wanted {
                if engine.get(CF_DELIVERIES, &offset_key(&key, o))?.is_some() {
                    out.push(o);
                }
            }
            Ok(out)
        })
        .await
    }

    async fn offsets_from(
        &self,
        key: &OffsetKey,
        from: u64,
        limit: usize,
    ) -> Result<Vec<u64>, DeliveryError> {
        let prefix = keys::parked_of_partition(key, keys::PARKED_OFFSET);
        let rows = self
            .read(move |engine| {
                let mut start = prefix.clone();
                start.extend_from_slice(&from.to_be_bytes());
                let end = keys::end_of(&prefix);
                engine.scan(CF_DELIVERIES, &start, Some(&end), limit.max(1))
            })
            .await?;
        rows.into_iter()
            .map(|(k, _)| {
                k.len()
                    .checked_sub(8)
                    .and_then(|at| be8(&k[at..]))
                    .ok_or_else(|| corrupt(&k, "park offset key too short"))
            })
            .collect()
    }

    async fn count(&self, key: &OffsetKey) -> Result<u64, DeliveryError> {
        let prefix = keys::parked_of_partition(key, keys::PARKED_OFFSET);
        self.read(move |engine| {
            let mut n = 0u64;
            engine.scan_each(
                CF_DELIVERIES,
                &prefix,
                &keys::end_of(&prefix),
                &mut |_, _| {
                    n += 1;
                    true
                },
            )?;
            Ok(n)
        })
        .await
    }

    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), ParkError> {
        let prefixes = keys::PARK_SPACES
            .map(|space| keys::parked_of_subscription(subscription, incarnation, space));
        self.delete_prefixes(prefixes).await?;
        Ok(())
    }
}

/// Cluster mode: the Local index as the working copy of a [`ParkJournal`] on the
/// shared log's server (see `meshd_stores::park`, "Cluster mode"): every entry is put
/// in the journal before it is parked here and settled there before it goes here;
/// [`adopt`](ParkIndex::adopt) rebuilds a partition's local copy from the journal.
pub struct JournaledParks {
    local: RocksParkStore,
    journal: Arc<dyn ParkJournal>,
    /// The owner epoch of each partition's last [`adopt`](ParkIndex::adopt): its
    /// journal writes carry it (one entry per partition and subscription, not per
    /// event).
    epochs: Mutex<HashMap<OffsetKey, i64>>,
}

impl JournaledParks {
    pub fn new(local: RocksParkStore, journal: Arc<dyn ParkJournal>) -> Self {
        Self {
            local,
            journal,
            epochs: Mutex::new(HashMap::new()),
        }
    }

    /// The epoch this instance writes `key`'s journal entries under: that of its
    /// acquisition; 0 before any (every entry of an owner is then newer: fenced).
    fn epoch(&self, key: &OffsetKey) -> i64 {
        self.epochs
            .lock()
            .map(|e| e.get(key).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    fn write(&self, key: &OffsetKey, fresh: bool) -> JournalWrite {
        JournalWrite {
            epoch: self.epoch(key),
            fresh,
        }
    }

    /// Puts `entries` in the journal, durably, [`JOURNAL_PUTS_AT_ONCE`] overlapping.
    async fn put_all<'a>(
        &self,
        key: &OffsetKey,
        entries: impl Iterator<Item = &'a (Parked, Vec<u8>)>,
        fresh: bool,
    ) -> Result<(), ParkError> {
        let entries: Vec<&(Parked, Vec<u8>)> = entries.collect();
        let write = self.write(key, fresh);
        for chunk in entries.chunks(JOURNAL_PUTS_AT_ONCE) {
            let puts = chunk
                .iter()
                .map(|(p, body)| self.journal.put(key, p, body, write));
            for r in futures::future::join_all(puts).await {
                r?;
            }
        }
        Ok(())
    }
}

#[async_trait]
impl ParkIndex for JournaledParks {
    async fn adopt(&self, key: &OffsetKey, epoch: i64) -> Result<(), ParkError> {
        if let Ok(mut epochs) = self.epochs.lock() {
            epochs.insert(key.clone(), epoch);
        }
        // Page by page: a partition with a million parked events is never in memory
        // at once. A failure part-way leaves a partial copy that the next `adopt`
        // (the acquisition is retried) clears again.
        self.local.clear_partition(key).await?;
        let mut from = Some(1);
        while let Some(at) = from {
            let (page, next) = self.journal.load_page(key, at, ADOPT_PAGE).await?;
            if !page.is_empty() {
                self.local.insert_entries(key, page).await?;
            }
            from = next;
        }
        Ok(())
    }

    async fn park_many(
        &self,
        key: &OffsetKey,
        entries: Vec<(Parked, Vec<u8>)>,
    ) -> Result<Vec<bool>, ParkError> {
        // Parked here already means in the journal too (it is written first).
        let here: BTreeSet<u64> = self
            .local
            .parked_among(key, entries.iter().map(|(p, _)| p.offset).collect())
            .await?
            .into_iter()
            .collect();
        let new: Vec<usize> = (0..entries.len())
            .filter(|&i| !here.contains(&entries[i].0.offset))
            .collect();
        // Every put acknowledged before any is used.
        self.put_all(key, new.iter().map(|&i| &entries[i]), true)
            .await?;
        self.local.park_many(key, entries).await
    }

    async fn remove(
        &self,
        key: &OffsetKey,
        offset: u64,
        now_ms: u64,
    ) -> Result<Removed, ParkError> {
        // The journal first, the release too: a new owner rebuilds from it.
        self.journal.settle(key, offset, self.epoch(key)).await?;
        if let Some((next, body)) = self
            .local
            .release_after_removal(key, offset, now_ms)
            .await?
        {
            self.journal
                .put(key, &next, &body, self.write(key, false))
                .await?;
        }
        self.local.remove(key, offset, now_ms).await
    }

    async fn release_key(
        &self,
        key: &OffsetKey,
        hash: u64,
        now_ms: u64,
    ) -> Result<Option<Parked>, ParkError> {
        if let Some((next, body)) = self.local.release_of_key(key, hash, now_ms).await? {
            self.journal
                .put(key, &next, &body, self.write(key, false))
                .await?;
        }
        self.local.release_key(key, hash, now_ms).await
    }

    async fn keys_parked(
        &self,
        key: &OffsetKey,
        hashes: Vec<u64>,
    ) -> Result<BTreeSet<u64>, DeliveryError> {
        self.local.keys_parked(key, hashes).await
    }

    async fn repark(
        &self,
        key: &OffsetKey,
        offset: u64,
        due_ms: u64,
        attempt: u32,
    ) -> Result<bool, ParkError> {
        let Some((p, body)) = self.local.entry_with_body(key, offset).await? else {
            return Ok(false);
        };
        let again = Parked {
            due_ms,
            attempt,
            ..p
        };
        self.journal
            .put(key, &again, &body, self.write(key, false))
            .await?;
        self.local.repark(key, offset, due_ms, attempt).await
    }

    async fn record_attempts(
        &self,
        key: &OffsetKey,
        attempts: Vec<(u64, u32)>,
    ) -> Result<(), ParkError> {
        // The journal entry again, with the count (the local copy is rebuilt from
        // the journal by whoever adopts the partition next).
        let mut entries = Vec::with_capacity(attempts.len());
        for (offset, attempt) in attempts {
            let Some((p, body)) = self.local.entry_with_body(key, offset).await? else {
                continue; // settled meanwhile
            };
            entries.push((Parked { attempt, ..p }, body));
        }
        self.put_all(key, entries.iter(), false).await
    }

    async fn held_keys(&self, key: &OffsetKey) -> Result<Vec<u64>, DeliveryError> {
        self.local.held_keys(key).await
    }

    async fn earliest(&self, key: &OffsetKey, limit: usize) -> Result<Vec<Parked>, DeliveryError> {
        self.local.earliest(key, limit).await
    }

    async fn entry(&self, key: &OffsetKey, offset: u64) -> Result<Option<Parked>, DeliveryError> {
        self.local.entry(key, offset).await
    }

    async fn body(&self, key: &OffsetKey, offset: u64) -> Result<Option<Vec<u8>>, DeliveryError> {
        self.local.body(key, offset).await
    }

    async fn parked_among(
        &self,
        key: &OffsetKey,
        offsets: Vec<u64>,
    ) -> Result<Vec<u64>, DeliveryError> {
        self.local.parked_among(key, offsets).await
    }

    async fn offsets_from(
        &self,
        key: &OffsetKey,
        from: u64,
        limit: usize,
    ) -> Result<Vec<u64>, DeliveryError> {
        self.local.offsets_from(key, from, limit).await
    }

    async fn count(&self, key: &OffsetKey) -> Result<u64, DeliveryError> {
        self.local.count(key).await
    }

    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), ParkError> {
        self.journal
            .drop_subscription(subscription, incarnation)
            .await?;
        self.local
            .drop_subscription(subscription, incarnation)
            .await
    }
}
