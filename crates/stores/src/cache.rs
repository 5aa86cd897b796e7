//! # A Meta prefix mirrored in memory: range, then watch, re-list when compacted
//!
//! Shared by the stores on Meta that answer from memory: the
//! [`SubscriptionStore`](crate::subscriptions::SubscriptionStore), the
//! [`TopicStore`](crate::topics::TopicStore), the
//! [`SessionStore`](crate::sessions::SessionStore) and the task usage watch. A background task lists the prefix
//! (one `range`, so the snapshot is consistent at one revision), then watches it from
//! that revision + 1 and applies every change in revision order. When the watch start
//! was compacted away it re-lists (keys deleted in the gap disappear, because the new
//! list replaces the old one); on any other watch failure it backs off (bounded,
//! doubling) and resumes from the last revision it applied + 1, so no change is missed
//! and none is applied twice.
//!
//! ## Read-your-writes without waiting for the watch
//!
//! A store that has just written revision `r` applies the written record itself
//! ([`WatchedCache::apply_local`]) when the cache has not yet reached `r`. Every entry
//! remembers the revision it reflects, and a change is only applied over an *older*
//! one, so a late watch event can never roll a newer local write back. Deletions are
//! kept as tombstones until the watch has passed their revision, so an older put that
//! arrives later cannot resurrect a deleted key. A re-list keeps every entry (and
//! tombstone) newer than the list's revision for the same reason.
//!
//! The task stops when the [`WatchedCache`] is dropped.

use futures::StreamExt;
use meshd_meta::{KeyValue, Meta, RangeOptions, RangeResponse, WatchBatch, WatchError, WatchEvent};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How the cache behind a store follows Meta.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    /// The first pause after a failed list or watch; doubles per failure.
    pub initial_backoff: Duration,
    /// The longest pause between two attempts.
    pub max_backoff: Duration,
    /// How long a read waits for the cache's first load before it answers
    /// `Unavailable` (a read never answers "absent" from a cache that never loaded).
    pub load_wait: Duration,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            initial_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            load_wait: Duration::from_secs(2),
        }
    }
}

impl CacheConfig {
    /// Checks the values; the error names the bad field.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.initial_backoff.is_zero() {
            return Err(("initial_backoff", "must be greater than zero".into()));
        }
        if self.max_backoff < self.initial_backoff {
            return Err((
                "max_backoff",
                format!(
                    "{:?} is below initial_backoff {:?}",
                    self.max_backoff, self.initial_backoff
                ),
            ));
        }
        Ok(())
    }
}

/// What a store's cache reports for readiness and operators.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheHealth {
    /// The cache has loaded the prefix at least once.
    pub loaded: bool,
    /// The watch is established (changes made in Meta now reach the cache).
    pub live: bool,
    /// Every change up to this Meta revision has been applied.
    pub revision: i64,
    /// Records in the cache (corrupt ones included).
    pub entries: usize,
    /// How often the cache re-listed because its watch position was compacted.
    pub relists: u64,
    /// Records that failed to decode (reported as `Corrupt` on read, logged).
    pub corrupt_records: usize,
    /// The last list or watch failure, while not live.
    pub last_error: Option<String>,
}

impl CacheHealth {
    /// Ready to serve: loaded once and following Meta.
    pub fn is_ready(&self) -> bool {
        self.loaded && self.live
    }
}

/// A record that failed its version or validity check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CorruptRecord {
    pub key: String,
    pub reason: String,
}

impl CorruptRecord {
    /// The record at Meta key `key` is corrupt for `reason`.
    pub(crate) fn new(key: &[u8], reason: impl Into<String>) -> Self {
        Self {
            key: crate::codec::key_text(key),
            reason: reason.into(),
        }
    }
}

/// How a store's records are named and decoded.
pub(crate) trait Codec<V>: Send + Sync + 'static {
    /// The record's name in the cache, from its Meta key (`Err` for a malformed key).
    fn name(&self, key: &[u8]) -> Result<String, CorruptRecord>;
    /// The record, with what Meta knows about it (revisions, lease).
    fn decode(&self, name: &str, kv: &KeyValue) -> Result<V, CorruptRecord>;
    /// An optional second unique key to look records up by (a session id).
    fn secondary(&self, _value: &V) -> Option<String> {
        None
    }
}

/// One cached key: its value (`None` = deleted, a tombstone) at `revision`.
#[derive(Clone, Debug)]
struct Entry<V> {
    revision: i64,
    value: Option<Result<V, CorruptRecord>>,
}

/// Which of `names` are live records of `entries`.
fn holding<V>(entries: &BTreeMap<String, Entry<V>>, names: &[String]) -> Vec<bool> {
    names
        .iter()
        .map(|n| entries.get(n).is_some_and(|e| e.value.is_some()))
        .collect()
}

struct State<V> {
    /// Name -> entry; a BTreeMap so lists come out in name order.
    entries: BTreeMap<String, Entry<V>>,
    /// Secondary key -> name, for the live, decodable entries.
    secondary: HashMap<String, String>,
    /// How many entries are tombstones (to skip the prune scan when there are none).
    tombstones: usize,
    /// Every change up to this revision has been applied (from the list or the watch).
    revision: i64,
    loaded: bool,
    live: bool,
    last_error: Option<String>,
}

struct Shared<V> {
    store: &'static str,
    backend: meshd_meta::Backend,
    prefix: Vec<u8>,
    codec: Box<dyn Codec<V>>,
    /// A std lock: every critical section is short and never awaits.
    state: RwLock<State<V>>,
    /// Bumped after every change of the state, for waiters and subscribers.
    changes: watch::Sender<u64>,
    relists: AtomicU64,
}

/// A lookup's answer.
pub(crate) enum Lookup<V> {
    /// The cache has never loaded: it cannot tell.
    NotLoaded,
    Absent,
    Present(Result<V, CorruptRecord>),
}

/// The in-memory mirror of one Meta prefix, with its follower task.
pub(crate) struct WatchedCache<V> {
    shared: Arc<Shared<V>>,
    /// The follower; aborted on drop so the task never outlives its store.
    task: JoinHandle<()>,
    load_wait: Duration,
}

impl<V> Drop for WatchedCache<V> {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl<V: Clone + Send + Sync + 'static> WatchedCache<V> {
    /// Starts following `prefix`. Needs a Tokio runtime; does not wait for the first
    /// load (so a store can start while Meta is down).
    pub(crate) fn start(
        store: &'static str,
        meta: Arc<dyn Meta>,
        prefix: Vec<u8>,
        codec: Box<dyn Codec<V>>,
        config: &CacheConfig,
    ) -> Result<Self, String> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| format!("the {store} store needs a Tokio runtime: {e}"))?;
        let (changes, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            store,
            backend: meta.backend(),
            prefix,
            codec,
            state: RwLock::new(State {
                entries: BTreeMap::new(),
                secondary: HashMap::new(),
                tombstones: 0,
                revision: 0,
                loaded: false,
                live: false,
                last_error: None,
            }),
            changes,
            relists: AtomicU64::new(0),
        });
        let task = runtime.spawn(follow(shared.clone(), meta, config.clone()));
        Ok(Self {
            shared,
            task,
            load_wait: config.load_wait,
        })
    }

    /// The revision every change up to which has been applied.
    pub(crate) fn revision(&self) -> i64 {
        self.shared.read().revision
    }

    pub(crate) fn health(&self) -> CacheHealth {
        let s = self.shared.read();
        CacheHealth {
            loaded: s.loaded,
            live: s.live,
            revision: s.revision,
            entries: s.entries.len().saturating_sub(s.tombstones),
            relists: self.shared.relists.load(Ordering::Relaxed),
            corrupt_records: s
                .entries
                .values()
                .filter(|e| matches!(e.value, Some(Err(_))))
                .count(),
            last_error: s.last_error.clone(),
        }
    }

    /// A receiver that changes whenever the cache does.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }

    /// Waits (at most the configured `load_wait`) until the cache has loaded once.
    /// `false` when it has not.
    pub(crate) async fn wait_loaded(&self) -> bool {
        self.wait_loaded_for(self.load_wait).await
    }

    pub(crate) async fn wait_loaded_for(&self, limit: Duration) -> bool {
        let mut rx = self.shared.changes.subscribe();
        let wait = async {
            loop {
                if self.shared.read().loaded {
                    return;
                }
                if rx.changed().await.is_err() {
                    // The sender lives in `shared`, which we hold: cannot happen.
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }

    /// The last list/watch failure, for error messages.
    pub(crate) fn last_error(&self) -> Option<String> {
        self.shared.read().last_error.clone()
    }

    /// Waits at most `limit` for the cache to load and its watch to be live.
    pub(crate) async fn wait_ready(&self, limit: Duration) -> bool {
        let mut rx = self.subscribe();
        let wait = async {
            loop {
                if self.health().is_ready() {
                    return;
                }
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        tokio::time::timeout(limit, wait).await.is_ok()
    }

    /// Waits (at most the configured `load_wait`) until the cache has loaded once;
    /// the error says why the `what` cache cannot answer yet.
    pub(crate) async fn loaded(&self, what: &str) -> Result<(), String> {
        if self.wait_loaded().await {
            return Ok(());
        }
        Err(format!(
            "the {what} cache has not loaded from meta yet (last error: {})",
            self.last_error().unwrap_or_else(|| "none".to_string())
        ))
    }

    /// The answer of `lookup` once the cache has loaded (see [`loaded`](Self::loaded));
    /// `Ok(Err(_))` for a corrupt record.
    #[allow(clippy::type_complexity)]
    pub(crate) async fn get(
        &self,
        what: &str,
        lookup: impl Fn(&Self) -> Lookup<V>,
    ) -> Result<Result<Option<V>, CorruptRecord>, String> {
        loop {
            match lookup(self) {
                Lookup::Present(v) => return Ok(v.map(Some)),
                Lookup::Absent => return Ok(Ok(None)),
                Lookup::NotLoaded => self.loaded(what).await?,
            }
        }
    }

    /// Every live, decodable record in name order, once the cache has loaded (see
    /// [`loaded`](Self::loaded)).
    pub(crate) async fn list(&self, what: &str) -> Result<Vec<V>, String> {
        loop {
            if let Some(values) = self.values() {
                return Ok(values.into_iter().filter_map(|(_, v)| v.ok()).collect());
            }
            self.loaded(what).await?;
        }
    }

    pub(crate) fn lookup(&self, name: &str) -> Lookup<V> {
        let s = self.shared.read();
        match s.entries.get(name) {
            Some(Entry {
                value: Some(v),
                revision: _,
            }) => Lookup::Present(v.clone()),
            _ if !s.loaded => Lookup::NotLoaded,
            _ => Lookup::Absent,
        }
    }

    pub(crate) fn lookup_secondary(&self, key: &str) -> Lookup<V> {
        let s = self.shared.read();
        let found = s
            .secondary
            .get(key)
            .and_then(|name| s.entries.get(name))
            .and_then(|e| e.value.clone());
        match found {
            Some(v) => Lookup::Present(v),
            None if !s.loaded => Lookup::NotLoaded,
            None => Lookup::Absent,
        }
    }

    /// How many live records there are (corrupt ones included: they take space in
    /// Meta too); `None` when the cache never loaded. Copies nothing.
    pub(crate) fn count(&self) -> Option<usize> {
        self.count_holding(&[]).map(|(count, _)| count)
    }

    /// [`count`](Self::count), and which of `names` are live records, read under one
    /// lock: a caller that adds its own writes in flight to the count counts each of
    /// them once, before the cache holds it and after.
    pub(crate) fn count_holding(&self, names: &[String]) -> Option<(usize, Vec<bool>)> {
        let s = self.shared.read();
        if !s.loaded {
            return None;
        }
        let count = s.entries.values().filter(|e| e.value.is_some()).count();
        Some((count, holding(&s.entries, names)))
    }

    /// [`fold_at`](Self::fold_at), and which of `names` are live records, read under
    /// the same lock (see [`count_holding`](Self::count_holding)).
    pub(crate) fn fold_at_holding<A>(
        &self,
        init: A,
        mut f: impl FnMut(A, &V) -> A,
        names: &[String],
    ) -> Option<(A, i64, Vec<bool>)> {
        let s = self.shared.read();
        if !s.loaded {
            return None;
        }
        let mut acc = init;
        for e in s.entries.values() {
            if let Some(Ok(v)) = &e.value {
                acc = f(acc, v);
            }
        }
        Some((acc, s.revision, holding(&s.entries, names)))
    }

    /// Folds `f` over every live, decodable record (under the read lock, copying
    /// nothing); `None` when the cache never loaded.
    pub(crate) fn fold<A>(&self, init: A, f: impl FnMut(A, &V) -> A) -> Option<A> {
        self.fold_at(init, f).map(|(acc, _)| acc)
    }

    /// [`fold`](Self::fold) with the revision it reflects (every change up to it),
    /// read under the same lock.
    pub(crate) fn fold_at<A>(&self, init: A, f: impl FnMut(A, &V) -> A) -> Option<(A, i64)> {
        self.fold_at_holding(init, f, &[])
            .map(|(acc, revision, _)| (acc, revision))
    }

    /// Every live record in name order; `None` when the cache never loaded.
    pub(crate) fn values(&self) -> Option<Vec<(String, Result<V, CorruptRecord>)>> {
        let s = self.shared.read();
        if !s.loaded {
            return None;
        }
        Some(
            s.entries
                .iter()
                .filter_map(|(k, e)| e.value.clone().map(|v| (k.clone(), v)))
                .collect(),
        )
    }

    /// Applies this instance's own write at `revision` (`None` = a delete) so its
    /// reads see it at once. Ignored when the watch has already passed `revision`
    /// (the cache then reflects it or something newer) or the entry is newer.
    pub(crate) fn apply_local(&self, name: &str, revision: i64, value: Option<V>) {
        let mut s = self.shared.write();
        if revision <= s.revision {
            return;
        }
        let changed = s.set(
            self.shared.codec.as_ref(),
            name.to_string(),
            revision,
            value.map(Ok),
        );
        drop(s);
        if changed {
            self.shared.changes.send_modify(|n| *n += 1);
        }
    }
}

impl<V: Clone + 'static> State<V> {
    /// Sets `name` to `value` at `revision` when that is newer than what is cached.
    fn set(
        &mut self,
        codec: &dyn Codec<V>,
        name: String,
        revision: i64,
        value: Option<Result<V, CorruptRecord>>,
    ) -> bool {
        if let Some(old) = self.entries.get(&name) {
            if old.revision >= revision {
                return false;
            }
        }
        let new_secondary = match &value {
            Some(Ok(v)) => codec.secondary(v),
            _ => None,
        };
        let is_tombstone = value.is_none();
        let old = self.entries.insert(name.clone(), Entry { revision, value });
        if let Some(old) = old {
            match old.value {
                None => self.tombstones -= 1,
                Some(Ok(v)) => {
                    if let Some(k) = codec.secondary(&v) {
                        if self.secondary.get(&k) == Some(&name) {
                            self.secondary.remove(&k);
                        }
                    }
                }
                Some(Err(_)) => {}
            }
        }
        if is_tombstone {
            self.tombstones += 1;
        }
        if let Some(k) = new_secondary {
            self.secondary.insert(k, name);
        }
        true
    }

    /// Drops tombstones the watch has passed: no older change can arrive any more.
    fn prune(&mut self) {
        if self.tombstones == 0 {
            return;
        }
        let upto = self.revision;
        self.entries
            .retain(|_, e| e.value.is_some() || e.revision > upto);
        self.tombstones = self.entries.values().filter(|e| e.value.is_none()).count();
    }
}

impl<V: Clone + Send + Sync + 'static> Shared<V> {
    fn read(&self) -> RwLockReadGuard<'_, State<V>> {
        // Every mutation keeps the state consistent step by step, and none panics
        // midway, so a poisoned lock still holds a usable state.
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State<V>> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    fn notify(&self) {
        self.changes.send_modify(|n| *n += 1);
    }

    fn decode(&self, kv: &KeyValue) -> Option<(String, Result<V, CorruptRecord>)> {
        let name = match self.codec.name(&kv.key) {
            Ok(name) => name,
            Err(c) => {
                tracing::error!(
                    store = self.store,
                    backend = %self.backend,
                    key = %c.key,
                    reason = %c.reason,
                    "ignoring a key that is not a record of this store"
                );
                return None;
            }
        };
        let value = self.codec.decode(&name, kv);
        if let Err(c) = &value {
            tracing::error!(
                store = self.store,
                backend = %self.backend,
                key = %c.key,
                reason = %c.reason,
                revision = kv.mod_revision,
                "corrupt record in meta; reads of it answer Corrupt"
            );
        }
        Some((name, value))
    }

    /// Replaces the cache with a fresh list at `resp.revision`, keeping local writes
    /// newer than it.
    fn replace(&self, resp: RangeResponse) {
        let decoded: Vec<_> = resp
            .kvs
            .iter()
            .filter_map(|kv| self.decode(kv).map(|(n, v)| (n, kv.mod_revision, v)))
            .collect();
        let mut s = self.write();
        let mut fresh = State {
            entries: BTreeMap::new(),
            secondary: HashMap::new(),
            tombstones: 0,
            revision: resp.revision.max(s.revision),
            loaded: true,
            live: s.live,
            last_error: s.last_error.take(),
        };
        for (name, revision, value) in decoded {
            fresh.set(self.codec.as_ref(), name, revision, Some(value));
        }
        // Entries (and tombstones) newer than the list were written by this instance
        // after the list was read: keep them.
        let old = std::mem::take(&mut s.entries);
        for (name, e) in old {
            if e.revision > resp.revision {
                fresh.set(self.codec.as_ref(), name, e.revision, e.value);
            }
        }
        fresh.prune();
        *s = fresh;
        drop(s);
        self.notify();
    }

    fn apply(&self, batch: WatchBatch) {
        let mut decoded = Vec::with_capacity(batch.events.len());
        let mut last = 0;
        for event in &batch.events {
            last = last.max(event.revision());
            match event {
                WatchEvent::Put(kv) => {
                    if let Some((name, value)) = self.decode(kv) {
                        decoded.push((name, kv.mod_revision, Some(value)));
                    }
                }
                WatchEvent::Delete { key, revision } => match self.codec.name(key) {
                    Ok(name) => decoded.push((name, *revision, None)),
                    Err(_) => continue,
                },
            }
        }
        let mut s = self.write();
        for (name, revision, value) in decoded {
            s.set(self.codec.as_ref(), name, revision, value);
        }
        if last > s.revision {
            s.revision = last;
        }
        s.prune();
        drop(s);
        self.notify();
    }

    fn set_live(&self, live: bool, error: Option<String>) {
        let mut s = self.write();
        let changed = s.live != live;
        s.live = live;
        if error.is_some() || live {
            s.last_error = error;
        }
        drop(s);
        if changed {
            self.notify();
        }
    }
}

/// The follower: list, watch, apply; re-list after a compaction; back off and resume
/// after any other failure. Runs until aborted.
async fn follow<V: Clone + Send + Sync + 'static>(
    shared: Arc<Shared<V>>,
    meta: Arc<dyn Meta>,
    config: CacheConfig,
) {
    let (store, backend) = (shared.store, shared.backend);
    let mut delay = config.initial_backoff;
    // Set once Meta said it was closed: failures are expected until it answers again
    // and are logged at debug level, so a normal stop logs no warning.
    let mut quiet = false;
    let mut relist = true;
    loop {
        if relist {
            match meta.range(&shared.prefix, RangeOptions::default()).await {
                Ok(resp) if !resp.more => {
                    tracing::debug!(
                        store,
                        %backend,
                        revision = resp.revision,
                        keys = resp.kvs.len(),
                        "cache listed"
                    );
                    shared.replace(resp);
                    relist = false;
                }
                Ok(_) => {
                    let e = "an unlimited range answered a partial page".to_string();
                    tracing::error!(store, %backend, error = %e, "cache list failed");
                    shared.set_live(false, Some(e));
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(config.max_backoff);
                    continue;
                }
                Err(e) => {
                    if quiet {
                        tracing::debug!(store, %backend, error = %e, retry_in = ?delay, "cache list failed (meta closed)");
                    } else {
                        tracing::warn!(store, %backend, error = %e, retry_in = ?delay, "cache list failed");
                    }
                    shared.set_live(false, Some(format!("list: {e}")));
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(config.max_backoff);
                    continue;
                }
            }
        }
        let from = shared.read().revision + 1;
        let mut stream = match meta.watch(&shared.prefix, from).await {
            Ok(stream) => stream,
            Err(e) => {
                if quiet {
                    tracing::debug!(store, %backend, error = %e, from, retry_in = ?delay, "cache watch failed (meta closed)");
                } else {
                    tracing::warn!(store, %backend, error = %e, from, retry_in = ?delay, "cache watch failed");
                }
                shared.set_live(false, Some(format!("watch: {e}")));
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(config.max_backoff);
                continue;
            }
        };
        shared.set_live(true, None);
        quiet = false;
        delay = config.initial_backoff;
        tracing::debug!(store, %backend, from, "cache watching");
        let failure = loop {
            match stream.next().await {
                Some(Ok(batch)) => shared.apply(batch),
                Some(Err(WatchError::Compacted { compact_revision })) => {
                    shared.relists.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(
                        store,
                        %backend,
                        from = shared.read().revision + 1,
                        compact_revision,
                        "cache watch position was compacted; re-listing"
                    );
                    relist = true;
                    break None;
                }
                Some(Err(WatchError::Closed)) => {
                    // Meta was closed by its owner: the process is stopping (the cache
                    // is dropped next) or the backend is being restarted under it. Go
                    // on trying, without a warning until Meta answers again.
                    quiet = true;
                    break Some("meta closed".to_string());
                }
                Some(Err(e)) => {
                    if matches!(e, WatchError::Corrupt(_)) {
                        // The history cannot be replayed; a fresh list does not need it.
                        relist = true;
                    }
                    break Some(e.to_string());
                }
                None => break Some("the watch stream ended".to_string()),
            }
        };
        drop(stream);
        match failure {
            None => shared.set_live(false, Some("re-listing after compaction".into())),
            Some(e) => {
                if quiet {
                    tracing::debug!(store, %backend, error = %e, retry_in = ?delay, "cache watch interrupted");
                } else {
                    tracing::warn!(store, %backend, error = %e, retry_in = ?delay, "cache watch interrupted");
                }
                shared.set_live(false, Some(format!("watch: {e}")));
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(config.max_backoff);
            }
        }
    }
}
