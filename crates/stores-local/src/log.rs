//! The partition log on the Local RocksDB (column families `log` and `dlq`).
//!
//! Appends assign offsets under the group-commit lock (so offsets follow the WAL's
//! order), write the events and the partition head in one batch, and return after the
//! group fsync. Readers see a partition only up to its *durable* end, which moves only
//! after that fsync: an offset a consumer has seen can never be given to another event
//! after a crash.
//!
//! Appended events also go into the tail cache ([`crate::tail`]) as they are staged,
//! in offset order; reads stop at the durable end there too. So reads of the tail
//! (what a consumer that keeps up asks for) are served in place, without the blocking
//! pool.

use crate::dedup::{self, DedupIndex};
use crate::keys::{self, CF_DLQ, CF_LOG};
use crate::store_thread::on_store_thread;
use crate::tail::{TailCache, TailStats};
use async_trait::async_trait;
use meshd_local::codec::{DecodeError, Decoder, Encoder};
use meshd_local::group::{GroupCommit, Wait};
use meshd_local::{Batch, KvEngine, LocalError};
use meshd_stores::log::{
    AppendNotifier, Appended, BodyRef, DeadLetterBodies, DedupEvent, LogError, LogEvent,
    PartitionBounds, PartitionLog, Retention, RetentionReport,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

const EVENT_V1: u8 = 1;
const HEAD_V1: u8 = 1;
const BODY_V1: u8 = 1;
const SEQ_V1: u8 = 1;

/// At most this many events are removed from one partition per retention pass, so a
/// pass never holds the append lock for long.
const RETENTION_STEP: usize = 10_000;
/// The most dedup entries an open sizes one partition's table for up front (a table
/// of 32 M slots, about 1.1 GiB); a partition with more grows its table as it loads.
const DEDUP_RESERVE_MAX: u64 = 16 << 20;

/// Memory for the tail cache of the whole log (payloads and a fixed cost per event).
pub const TAIL_CACHE_BYTES: usize = 16 << 20;

/// One stored event: when it was appended, and its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventRecord {
    pub appended_at_ms: u64,
    pub payload: Vec<u8>,
}

impl EventRecord {
    pub fn encode(&self) -> Vec<u8> {
        Self::encode_parts(self.appended_at_ms, &self.payload)
    }

    /// [`encode`](Self::encode) from its parts, without owning the payload.
    pub fn encode_parts(appended_at_ms: u64, payload: &[u8]) -> Vec<u8> {
        Encoder::new(EVENT_V1)
            .u64(appended_at_ms)
            .bytes(payload)
            .finish()
    }

    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mut d = Decoder::new(b, EVENT_V1)?;
        let r = Self {
            appended_at_ms: d.u64()?,
            payload: d.bytes()?,
        };
        d.finish()?;
        Ok(r)
    }
}

/// The head of one partition, written with every append and retention step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeadRecord {
    /// First retained offset.
    pub start: u64,
    /// Next offset to assign.
    pub end: u64,
    /// Payload bytes retained.
    pub bytes: u64,
}

impl HeadRecord {
    pub fn encode(&self) -> Vec<u8> {
        Encoder::new(HEAD_V1)
            .u64(self.start)
            .u64(self.end)
            .u64(self.bytes)
            .finish()
    }

    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mut d = Decoder::new(b, HEAD_V1)?;
        let r = Self {
            start: d.u64()?,
            end: d.u64()?,
            bytes: d.u64()?,
        };
        d.finish()?;
        if r.start > r.end {
            return Err(DecodeError::InvalidField("start above end"));
        }
        Ok(r)
    }
}

struct Head {
    record: HeadRecord,
    /// Readers stop here: every offset below it is durable.
    durable_end: u64,
}

/// The log. Cheap to clone (shared state behind an `Arc`).
#[derive(Clone)]
pub struct RocksLog {
    inner: Arc<Inner>,
}

struct Inner {
    log_id: String,
    group: Arc<GroupCommit>,
    /// Per (topic, partition). Changed only under the group-commit lock (appends,
    /// retention) or after a commit became durable (`durable_end`).
    heads: Mutex<HashMap<(String, u32), Head>>,
    /// Next dead-letter body sequence; changed only under the group-commit lock.
    next_body: Mutex<u64>,
    /// Per-partition append notifications. Lock order: `appends` before `heads`
    /// (a new sender reads the durable end under its lock); `notify` is called only
    /// after `heads` is released.
    appends: AppendNotifier,
    /// Recent events (served only below the durable end). Lock order: taken under the
    /// group-commit lock by appends, after `heads` is released; never inside `heads`.
    tail: Mutex<TailCache>,
    /// The publish dedup index, shared with the thread that loads it at open.
    dedup: Arc<Dedup>,
    /// That thread, joined when the log is dropped (so the engine it reads is
    /// released with the log: a reopen of the data dir finds it unlocked).
    loader: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Set by [`RocksLog::stop_housekeeping`]: retention and the dedup sweep stop
    /// before their next batch.
    stopping: AtomicBool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.dedup.cancel.store(true, Ordering::Relaxed);
        let loader = self.loader.get_mut().map(Option::take);
        if let Ok(Some(loader)) = loader {
            let _ = loader.join();
        }
    }
}

/// The publish dedup index ([`crate::dedup`]) and its load.
struct Dedup {
    /// Changed only on the store thread (appends, the expiry sweep), by a topic
    /// delete, or once by the load. Lock order: after `heads`.
    index: Mutex<DedupIndex>,
    /// Whether `index` is loaded: appends with dedup, the sweep and topic deletes
    /// wait for it (until then it is empty).
    load: watch::Sender<DedupLoad>,
    /// Set when the log is dropped: a load still running stops.
    cancel: AtomicBool,
    /// The most entries appends may take the index to (`--max-dedup-entries`); an open
    /// loads every live record whatever it holds.
    max_entries: AtomicUsize,
    /// Deduplicated appends refused at the cap.
    refused: AtomicU64,
    /// Whether a sweep asked for by an append at the cap is running.
    sweeping: AtomicBool,
}

impl Dedup {
    fn index(&self) -> MutexGuard<'_, DedupIndex> {
        // Each change is one insert or removal with its count: usable after a panic.
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Loads the index (on the loading thread) and says how it went.
    fn load(&self, engine: &dyn KvEngine, ends: &HashMap<(String, u32), u64>, log_id: &str) {
        let started = std::time::Instant::now();
        let state = match load_dedup(engine, ends, now_ms(), &self.cancel) {
            Ok(index) => {
                tracing::info!(
                    store = "log",
                    backend = "rocksdb",
                    partitions = ends.len(),
                    dedup_entries = index.len(),
                    took_ms = started.elapsed().as_millis() as u64,
                    log_id,
                    "log opened: publish dedup index loaded"
                );
                *self.index() = index;
                DedupLoad::Loaded
            }
            Err(e) => {
                tracing::error!(store = "log", backend = "rocksdb", error = %e, log_id, "loading the publish dedup index failed: deduplicated publishes are refused");
                DedupLoad::Failed(e)
            }
        };
        self.load.send_replace(state);
    }
}

/// The dedup index's load at open.
#[derive(Clone, Debug)]
enum DedupLoad {
    Loading,
    Loaded,
    Failed(LogError),
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A write of the log that failed: outcome unknown when this call's batch reached the
/// engine (its write or fsync failed), refused when the log had already failed.
fn write_err(e: LocalError) -> LogError {
    if e.outcome_unknown() {
        LogError::Indeterminate(e.reason())
    } else {
        LogError::Failed(e.reason())
    }
}

/// A read of the log that failed: damaged bytes on disk are a corrupt record (the
/// engine has fail-stopped), anything else a log that cannot serve now.
fn read_err(e: LocalError) -> LogError {
    match e {
        LocalError::Corrupt { cf, key, reason } => LogError::Corrupt {
            key,
            reason: format!(
                "damaged on disk (column family {cf}; the local engine has fail-stopped): {reason}"
            ),
        },
        e => LogError::Unavailable(format!("local read failed: {e}")),
    }
}

fn corrupt(key: &[u8], e: DecodeError) -> LogError {
    LogError::Corrupt {
        key: format!("{key:?}"),
        reason: e.to_string(),
    }
}

fn decode_seq(b: &[u8]) -> Result<u64, DecodeError> {
    let mut d = Decoder::new(b, SEQ_V1)?;
    let n = d.u64()?;
    d.finish()?;
    Ok(n)
}

fn decode_body(b: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let mut d = Decoder::new(b, BODY_V1)?;
    let body = d.bytes()?;
    d.finish()?;
    Ok(body)
}

/// Loads the dedup index at open: every record still inside its window at `now_ms`
/// (the sweep deletes the others from disk; they would answer nothing), read in
/// place, one partition at a time. Each partition's table is sized once from its
/// first record: at most one entry per offset from that record's to the partition's
/// end (growing a table of millions key by key rehashes it several times over).
fn load_dedup(
    engine: &dyn KvEngine,
    ends: &HashMap<(String, u32), u64>,
    now_ms: u64,
    cancel: &AtomicBool,
) -> Result<DedupIndex, LogError> {
    let mut index = DedupIndex::default();
    // The per-event records of earlier releases, then the runs (newer: a later entry
    // for a key replaces an earlier one).
    for space in dedup::Space::ALL {
        let dp = dedup::prefix(space);
        // Why the load stopped early: a damaged record, or the log closed.
        let mut stopped = None;
        let mut current: Option<((String, u32), dedup::Window)> = None;
        engine
            .scan_each(CF_LOG, &dp, &keys::end_of(&dp), &mut |k, v| {
                if cancel.load(Ordering::Relaxed) {
                    stopped = Some(LogError::Unavailable(
                        "the log closed while its dedup index loaded".into(),
                    ));
                    return false;
                }
                let (topic, partition, record) = match dedup::Record::decode(space, k, v) {
                    Ok(d) => d,
                    Err(e) => {
                        stopped = Some(corrupt(k, e));
                        return false;
                    }
                };
                let window = match &mut current {
                    Some(((t, p), w)) if t == topic && *p == partition => w,
                    _ => {
                        if let Some(((t, p), w)) = current.take() {
                            index.put_window(&t, p, w);
                        }
                        let at_most = ends
                            .get(&(topic.to_string(), partition))
                            .map_or(0, |end| end.saturating_sub(record.first_offset));
                        let w = index.take_window(
                            topic,
                            partition,
                            at_most.min(DEDUP_RESERVE_MAX) as usize,
                        );
                        &mut current.insert(((topic.to_string(), partition), w)).1
                    }
                };
                if !record.expired(now_ms) {
                    for e in record.entries() {
                        window.insert(e);
                    }
                }
                true
            })
            .map_err(read_err)?;
        if let Some(e) = stopped {
            return Err(e);
        }
        if let Some(((t, p), w)) = current.take() {
            index.put_window(&t, p, w);
        }
    }
    Ok(index)
}

impl RocksLog {
    /// What the tail cache holds and how often it served a read.
    pub fn tail_stats(&self) -> TailStats {
        self.inner.tail().stats()
    }

    /// Opens the log on an engine with the `log` and `dlq` column families. Loads every
    /// partition head (recovery); everything on disk at open counts as durable.
    pub fn open(group: Arc<GroupCommit>, log_id: &str) -> Result<Self, LogError> {
        let engine = group.engine().clone();
        let mut heads = HashMap::new();
        let head_prefix = [keys::HEAD];
        for (k, v) in engine
            .scan(CF_LOG, &head_prefix, Some(&keys::end_of(&head_prefix)), 0)
            .map_err(read_err)?
        {
            let (topic, partition) = keys::parse_head_key(&k).ok_or_else(|| LogError::Corrupt {
                key: format!("{k:?}"),
                reason: "malformed partition head key".into(),
            })?;
            let record = HeadRecord::decode(&v).map_err(|e| corrupt(&k, e))?;
            heads.insert(
                (topic, partition),
                Head {
                    record,
                    durable_end: record.end,
                },
            );
        }
        let next_body = match engine.get(CF_DLQ, keys::BODY_SEQ).map_err(read_err)? {
            None => 0,
            Some(b) => decode_seq(&b).map_err(|e| corrupt(keys::BODY_SEQ, e))?,
        };
        // The dedup index loads on its own thread, next to the rest of a start (the
        // delivery state's recovery); what reads or changes it waits for it.
        let ends: HashMap<(String, u32), u64> = heads
            .iter()
            .map(|(k, h)| (k.clone(), h.record.end))
            .collect();
        let dedup = Arc::new(Dedup {
            index: Mutex::new(DedupIndex::default()),
            load: watch::channel(DedupLoad::Loading).0,
            cancel: AtomicBool::new(false),
            max_entries: AtomicUsize::new(usize::MAX),
            refused: AtomicU64::new(0),
            sweeping: AtomicBool::new(false),
        });
        let load = {
            let (dedup, engine, log_id) = (dedup.clone(), engine.clone(), log_id.to_string());
            move || dedup.load(&*engine, &ends, &log_id)
        };
        let loader = match std::thread::Builder::new()
            .name("dedup-load".into())
            .spawn(load.clone())
        {
            Ok(handle) => Some(handle),
            Err(e) => {
                // No thread to be had: load in place (a slower open, the same index).
                tracing::warn!(store = "log", backend = "rocksdb", error = %e, "no thread for loading the publish dedup index; loading it before the open returns");
                load();
                None
            }
        };
        Ok(Self {
            inner: Arc::new(Inner {
                log_id: log_id.to_string(),
                group,
                heads: Mutex::new(heads),
                next_body: Mutex::new(next_body),
                appends: AppendNotifier::default(),
                tail: Mutex::new(TailCache::new(TAIL_CACHE_BYTES)),
                dedup,
                loader: Mutex::new(loader),
                stopping: AtomicBool::new(false),
            }),
        })
    }

    /// Ends a retention pass or dedup sweep that is running before its next batch
    /// (what it removed so far is durable; the next open's pass goes on from there),
    /// and makes later passes return at once. Called when the instance stops, so a
    /// long sweep does not hold the engine open past the stop: a sweep of millions of
    /// expired dedup records is hundreds of batches.
    pub fn stop_housekeeping(&self) {
        self.inner.stopping.store(true, Ordering::Relaxed);
    }

    /// One deduplicated append on the store thread: the outer error is the write's,
    /// the inner one a refusal at the cap (nothing written).
    #[allow(clippy::type_complexity)]
    async fn stage_dedup(
        &self,
        topic: &str,
        events: Vec<DedupEvent>,
        window_ms: u64,
    ) -> Result<Result<(Vec<Appended>, Vec<(u32, u64)>), (LogError, Vec<DedupEvent>)>, LogError>
    {
        let at = now_ms();
        let inner = self.inner.clone();
        let owned = topic.to_string();
        let (_, staged) = on_store_thread(&self.inner.group, Wait::Durable, move |_| {
            Ok::<_, LocalError>(
                match inner.stage_append_dedup(&owned, events, window_ms, at) {
                    Ok((batch, answers, assigned)) => (batch, Ok((answers, assigned))),
                    Err(refused) => (Batch::new(), Err(refused)),
                },
            )
        })
        .await
        .map_err(write_err)?;
        Ok(staged)
    }

    /// Waits until the publish dedup index is loaded (an open loads it on its own
    /// thread); its error if loading failed (a damaged record).
    pub async fn dedup_loaded(&self) -> Result<(), LogError> {
        let mut rx = self.inner.dedup.load.subscribe();
        let state = rx
            .wait_for(|s| !matches!(s, DedupLoad::Loading))
            .await
            .map_err(|_| LogError::Unavailable("the log closed while loading".into()))?
            .clone();
        match state {
            DedupLoad::Failed(e) => Err(e),
            _ => Ok(()),
        }
    }

    /// Whether the publish dedup index is still loading (readiness waits for it).
    pub fn dedup_loading(&self) -> bool {
        matches!(*self.inner.dedup.load.borrow(), DedupLoad::Loading)
    }

    /// Live keys in the publish dedup index (the `meshd_dedup_entries` gauge).
    pub fn dedup_entries(&self) -> usize {
        self.inner.dedup().len()
    }

    /// Caps the publish dedup index (`--max-dedup-entries`): a deduplicated append
    /// that would store keys past `max` is refused ([`LogError::DedupFull`]) until
    /// entries expire; none is ever dropped to make room.
    pub fn set_max_dedup_entries(&self, max: usize) {
        self.inner.dedup.max_entries.store(max, Ordering::Relaxed);
    }

    /// Deduplicated appends refused at the cap (`meshd_dedup_full_total`).
    pub fn dedup_full_refusals(&self) -> u64 {
        self.inner.dedup.refused.load(Ordering::Relaxed)
    }

    /// A read (or anything that writes nothing) on the blocking pool: a task that
    /// panicked or was cancelled wrote nothing, so it is `Unavailable`.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, LogError> + Send + 'static,
    ) -> Result<T, LogError> {
        self.on_pool(f, |e| {
            LogError::Unavailable(format!("log task failed: {e}"))
        })
        .await
    }

    /// A write on the blocking pool: a task that panicked or was cancelled may have
    /// written part of what it was given (a batch reached the engine, or not), so its
    /// outcome is unknown, never "not applied".
    async fn blocking_write<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, LogError> + Send + 'static,
    ) -> Result<T, LogError> {
        self.on_pool(f, |e| {
            LogError::Indeterminate(format!("log write task failed, outcome unknown: {e}"))
        })
        .await
    }

    async fn on_pool<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T, LogError> + Send + 'static,
        failed: impl FnOnce(tokio::task::JoinError) -> LogError,
    ) -> Result<T, LogError> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(failed)?
    }
}

impl Inner {
    fn heads(&self) -> MutexGuard<'_, HashMap<(String, u32), Head>> {
        // Head updates are single assignments: consistent after a panic elsewhere.
        self.heads.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn engine(&self) -> &Arc<dyn KvEngine> {
        self.group.engine()
    }

    fn tail(&self) -> MutexGuard<'_, TailCache> {
        // Cache updates keep its counts consistent step by step: usable after a panic.
        self.tail.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn dedup(&self) -> MutexGuard<'_, DedupIndex> {
        self.dedup.index()
    }

    /// [`stage_append`](Self::stage_append) with deduplication (on the store thread):
    /// events whose key is live in the index, or repeated earlier in this call, are
    /// answered with the stored offset; the rest are staged with their index records
    /// in the same batch. When only duplicates remain and one of their originals may
    /// not be durable yet, the batch rewrites a partition head unchanged, so this
    /// call's answer waits for an fsync that covers the original.
    ///
    /// Refused whole ([`LogError::DedupFull`], nothing staged) when its new keys would
    /// take the index past its cap; an append of duplicates only is always answered.
    #[allow(clippy::type_complexity)]
    fn stage_append_dedup(
        &self,
        topic: &str,
        events: Vec<DedupEvent>,
        window_ms: u64,
        at: u64,
    ) -> Result<(Batch, Vec<Appended>, Vec<(u32, u64)>), (LogError, Vec<DedupEvent>)> {
        let mut fresh_keys = Vec::new();
        // Whether each event is stored now (its payload moves into the batch).
        let mut is_fresh = vec![false; events.len()];
        // Per event: Ok(index into fresh) or Err(the original's offset).
        let mut plan: Vec<(u32, Result<usize, u64>)> = Vec::with_capacity(events.len());
        let mut in_call: HashMap<(u32, meshd_stores::log::DedupKey), usize> = HashMap::new();
        {
            let mut ix = self.dedup();
            for (n, e) in events.iter().enumerate() {
                if let Some(offset) = ix.lookup(topic, e.partition, &e.key, at) {
                    plan.push((e.partition, Err(offset)));
                } else if let Some(&i) = in_call.get(&(e.partition, e.key)) {
                    plan.push((e.partition, Ok(i)));
                } else {
                    in_call.insert((e.partition, e.key), fresh_keys.len());
                    plan.push((e.partition, Ok(fresh_keys.len())));
                    fresh_keys.push(e.key);
                    is_fresh[n] = true;
                }
            }
            let max = self.dedup.max_entries.load(Ordering::Relaxed);
            if !fresh_keys.is_empty() && ix.len().saturating_add(fresh_keys.len()) > max {
                self.dedup.refused.fetch_add(1, Ordering::Relaxed);
                let oldest = ix.oldest_expiry().unwrap_or(at);
                let full = LogError::DedupFull {
                    entries: ix.len(),
                    retry_after_ms: oldest.saturating_sub(at),
                };
                return Err((full, events));
            }
        }
        let fresh: Vec<(u32, Vec<u8>)> = events
            .into_iter()
            .zip(is_fresh)
            .filter(|(_, fresh)| *fresh)
            .map(|(e, _)| (e.partition, e.payload))
            .collect();
        let (mut batch, assigned) = if fresh.is_empty() {
            (Batch::new(), Vec::new())
        } else {
            self.stage_append(topic, fresh, at)
        };
        {
            // One run record per partition for the keys stored at consecutive offsets
            // (every partition's share of one append is), in the events' batch.
            let mut runs: Vec<(u32, dedup::Record)> = Vec::new();
            for (&(partition, offset), key) in assigned.iter().zip(&fresh_keys) {
                let extends = runs
                    .iter_mut()
                    .rev()
                    .find(|(p, _)| *p == partition)
                    .filter(|(_, r)| r.first_offset + r.keys.len() as u64 == offset);
                match extends {
                    Some((_, run)) => run.keys.push(*key),
                    None => runs.push((
                        partition,
                        dedup::Record {
                            at_ms: at,
                            window_ms,
                            first_offset: offset,
                            keys: vec![*key],
                        },
                    )),
                }
            }
            let mut ix = self.dedup();
            for (partition, run) in &runs {
                batch.put(CF_LOG, run.run_key(topic, *partition), run.run_value());
                ix.insert_all(topic, *partition, run.entries());
            }
        }
        let mut answers = Vec::with_capacity(plan.len());
        let mut seen = vec![false; assigned.len()];
        for (partition, p) in plan {
            answers.push(match p {
                Ok(i) => Appended {
                    partition,
                    offset: assigned[i].1,
                    duplicate: std::mem::replace(&mut seen[i], true),
                },
                Err(offset) => Appended {
                    partition,
                    offset,
                    duplicate: true,
                },
            });
        }
        if batch.is_empty() {
            // Only duplicates: the index holds an entry only for a staged event, so
            // every answer's partition has a head.
            let heads = self.heads();
            let pending = answers.iter().find_map(|a| {
                heads
                    .get(&(topic.to_string(), a.partition))
                    .filter(|h| h.durable_end <= a.offset)
                    .map(|h| (a.partition, h.record))
            });
            if let Some((partition, record)) = pending {
                batch.put(CF_LOG, keys::head_key(topic, partition), record.encode());
            }
        }
        Ok((batch, answers, assigned))
    }

    /// A read served by the tail cache (`None`: not held there, read from disk).
    fn read_cached(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> Option<Vec<LogEvent>> {
        let b = self.bounds(topic, partition);
        if from < b.start || from >= b.end || max_events == 0 {
            // Below retention (an error) or nothing there: the full path says which.
            return None;
        }
        self.tail()
            .read(topic, partition, from, b.end, max_events, max_bytes)
    }

    /// Assigns offsets to `events` and stages them with the partition heads; the
    /// events go into the tail cache here, in offset order (concurrent appends are
    /// ordered by the group-commit lock this runs under), and readers see them once
    /// the durable end passes them. Runs under the group-commit lock (offsets follow
    /// the WAL's order).
    fn stage_append(
        &self,
        topic: &str,
        events: Vec<(u32, Vec<u8>)>,
        at: u64,
    ) -> (Batch, Vec<(u32, u64)>) {
        let mut batch = Batch::new();
        let mut assigned = Vec::with_capacity(events.len());
        let mut cached: HashMap<u32, Vec<LogEvent>> = HashMap::new();
        {
            let mut heads = self.heads();
            let mut touched: HashMap<u32, HeadRecord> = HashMap::new();
            for (partition, payload) in events {
                let head = touched.entry(partition).or_insert_with(|| {
                    heads
                        .get(&(topic.to_string(), partition))
                        .map(|h| h.record)
                        .unwrap_or_default()
                });
                let offset = head.end;
                head.end += 1;
                head.bytes += payload.len() as u64;
                batch.put(
                    CF_LOG,
                    keys::event_key(topic, partition, offset),
                    EventRecord::encode_parts(at, &payload),
                );
                assigned.push((partition, offset));
                cached.entry(partition).or_default().push(LogEvent {
                    offset,
                    appended_at_ms: at,
                    payload,
                });
            }
            for (partition, record) in &touched {
                batch.put(CF_LOG, keys::head_key(topic, *partition), record.encode());
                let h = heads
                    .entry((topic.to_string(), *partition))
                    .or_insert(Head {
                        record: HeadRecord::default(),
                        durable_end: 0,
                    });
                h.record = *record;
            }
        }
        let mut tail = self.tail();
        for (partition, events) in cached {
            tail.insert(topic, partition, events);
        }
        (batch, assigned)
    }

    /// After the fsync of an append: moves the durable ends and wakes the readers of
    /// the partitions appended to.
    fn appended(&self, topic: &str, assigned: &[(u32, u64)]) {
        // Durable now (and so is every earlier append: fsyncs cover the WAL in order).
        let mut ends: HashMap<u32, u64> = HashMap::new();
        {
            let mut heads = self.heads();
            for (partition, offset) in assigned {
                if let Some(h) = heads.get_mut(&(topic.to_string(), *partition)) {
                    h.durable_end = h.durable_end.max(offset + 1);
                    ends.insert(*partition, h.durable_end);
                }
            }
        }
        // Only the partitions this call appended to, once durable (and `heads`
        // released: see the lock order on `appends`).
        for (partition, end) in ends {
            self.appends.notify(topic, partition, Some(end));
        }
    }

    fn bounds(&self, topic: &str, partition: u32) -> PartitionBounds {
        self.heads()
            .get(&(topic.to_string(), partition))
            .map(|h| PartitionBounds {
                start: h.record.start.min(h.durable_end),
                end: h.durable_end,
            })
            .unwrap_or_default()
    }

    fn read(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> Result<Vec<LogEvent>, LogError> {
        let b = self.bounds(topic, partition);
        if from < b.start {
            return Err(LogError::BelowRetention {
                topic: topic.to_string(),
                partition,
                requested: from,
                start: b.start,
            });
        }
        if from >= b.end || max_events == 0 {
            return Ok(Vec::new());
        }
        let upto = b.end.min(from.saturating_add(max_events as u64));
        let rows = self
            .engine()
            .scan(
                CF_LOG,
                &keys::event_key(topic, partition, from),
                Some(&keys::event_key(topic, partition, upto)),
                0,
            )
            .map_err(read_err)?;
        let below_retention = |start: u64| LogError::BelowRetention {
            topic: topic.to_string(),
            partition,
            requested: from,
            start,
        };
        let mut out = Vec::with_capacity(rows.len());
        let mut bytes = 0usize;
        for (expected, (k, v)) in (from..).zip(rows) {
            let offset = k
                .len()
                .checked_sub(8)
                .and_then(|i| k.get(i..))
                .and_then(|b| <[u8; 8]>::try_from(b).ok())
                .map(u64::from_be_bytes)
                .ok_or_else(|| corrupt(&k, DecodeError::Truncated))?;
            if offset != expected {
                let now = self.bounds(topic, partition);
                if out.is_empty() && from < now.start {
                    // Retention moved the start while we read.
                    return Err(below_retention(now.start));
                }
                // A hole below the durable end is damage, never a silent skip.
                return Err(LogError::Corrupt {
                    key: format!("{topic}/{partition}@{expected}"),
                    reason: "event missing below the durable end".into(),
                });
            }
            let rec = EventRecord::decode(&v).map_err(|e| self.damaged(&k, e))?;
            if !out.is_empty() && bytes + rec.payload.len() > max_bytes {
                break;
            }
            bytes += rec.payload.len();
            out.push(LogEvent {
                offset,
                appended_at_ms: rec.appended_at_ms,
                payload: rec.payload,
            });
        }
        if out.is_empty() {
            let now = self.bounds(topic, partition);
            if from < now.start {
                return Err(below_retention(now.start));
            }
            return Err(LogError::Corrupt {
                key: format!("{topic}/{partition}@{from}"),
                reason: "event missing below the durable end".into(),
            });
        }
        Ok(out)
    }
}

impl Inner {
    fn enforce_retention(
        &self,
        retention: Retention,
        now_ms: u64,
    ) -> Result<RetentionReport, LogError> {
        // Expired dedup entries go first.
        self.expire_dedup(now_ms)?;
        let partitions: Vec<(String, u32)> = self.heads().keys().cloned().collect();
        let mut report = RetentionReport::default();
        for (topic, partition) in partitions {
            if self.stopping.load(Ordering::Relaxed) {
                break;
            }
            let (events, bytes) = self
                .group
                .commit_with(|engine| {
                    let mut heads = self.heads();
                    let Some(head) = heads.get_mut(&(topic.clone(), partition)) else {
                        return Ok((Batch::new(), (0, 0)));
                    };
                    let mut record = head.record;
                    // Only durable events are ever removed.
                    let limit = head.durable_end;
                    let rows = engine.scan(
                        CF_LOG,
                        &keys::event_key(&topic, partition, record.start),
                        Some(&keys::event_key(&topic, partition, limit)),
                        RETENTION_STEP,
                    )?;
                    let mut batch = Batch::new();
                    let (mut n, mut b) = (0u64, 0u64);
                    for (k, v) in rows {
                        let Ok(rec) = EventRecord::decode(&v) else {
                            // A damaged event stays for the reader to report.
                            break;
                        };
                        let too_old = retention
                            .max_age_ms
                            .is_some_and(|age| rec.appended_at_ms.saturating_add(age) < now_ms);
                        let too_big = retention.max_bytes.is_some_and(|max| record.bytes > max);
                        if !too_old && !too_big {
                            break;
                        }
                        batch.delete(CF_LOG, k);
                        record.start += 1;
                        record.bytes = record.bytes.saturating_sub(rec.payload.len() as u64);
                        n += 1;
                        b += rec.payload.len() as u64;
                    }
                    if n > 0 {
                        batch.put(CF_LOG, keys::head_key(&topic, partition), record.encode());
                        head.record = record;
                    }
                    Ok((batch, (n, b)))
                })
                .map_err(write_err)?;
            if events > 0 {
                let start = self.bounds(&topic, partition).start;
                self.tail().trim_below(&topic, partition, start);
                tracing::info!(
                    store = "log",
                    backend = "rocksdb",
                    topic,
                    partition,
                    events,
                    bytes,
                    "retention removed events"
                );
            }
            report.events_removed += events;
            report.bytes_removed += bytes;
        }
        Ok(report)
    }

    /// Deletes the dedup records whose window ended before `now_ms`, and their keys
    /// from memory, reading each partition's records (of both key spaces) in time
    /// order from where the last sweep stopped up to the first still live: records
    /// of about [`RETENTION_STEP`] keys per durable batch, so appends wait for one
    /// short batch at a time, never for the whole sweep. A record that no longer
    /// decodes stops its partition's sweep (the next open reports it). A record stored with a clock that stepped back sorts
    /// before where the sweep goes on from: it stays on disk until the next open's
    /// sweep, answering nothing once its window ended.
    fn expire_dedup(&self, now_ms: u64) -> Result<(), LogError> {
        if !matches!(*self.dedup.load.borrow(), DedupLoad::Loaded) {
            // Still loading (the next sweep does it) or failed (nothing to sweep).
            return Ok(());
        }
        // Bound first: a guard in the `for` head would live through the loop.
        let starts = self.dedup().sweep_starts();
        for (topic, partition, space, mut from) in starts {
            let end = keys::end_of(&dedup::partition_prefix(space, &topic, partition));
            loop {
                if self.stopping.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let next = self
                    .group
                    .commit_with(|engine| {
                        let mut batch = Batch::new();
                        let mut ix = self.dedup();
                        let mut last: Option<Vec<u8>> = None;
                        let mut removed = 0usize;
                        // Whether this batch stopped for its size (the sweep goes on).
                        let mut more = false;
                        engine.scan_each(CF_LOG, &from, &end, &mut |k, v| {
                            let record = match dedup::Record::decode(space, k, v) {
                                Ok((_, _, r)) => r,
                                Err(e) => {
                                    tracing::warn!(store = "log", backend = "rocksdb", topic, partition, key = ?k, error = %e, "a damaged dedup record stops the sweep of its partition");
                                    return false;
                                }
                            };
                            if !record.expired(now_ms) {
                                return false;
                            }
                            for e in record.entries() {
                                ix.remove_expired(&topic, partition, &e);
                            }
                            removed += record.keys.len();
                            batch.delete(CF_LOG, k.to_vec());
                            last = Some(k.to_vec());
                            // Enough keys for one batch (a run holds many).
                            more = removed >= RETENTION_STEP;
                            !more
                        })?;
                        let next = last.map(|last| ix.swept(&topic, partition, space, &last));
                        Ok((batch, next.filter(|_| more)))
                    })
                    .map_err(write_err)?;
                match next {
                    Some(k) => from = k,
                    None => break,
                }
            }
        }
        Ok(())
    }

    fn delete_topic(&self, topic: &str) -> Result<(), LogError> {
        keys::check_name("topic", topic).map_err(LogError::Invalid)?;
        // The dedup index first (an event without its entry is harmless; an entry
        // of a deleted topic would answer a re-created one's publishes).
        self.dedup().forget_topic(topic);
        // In chunks, each durable; the heads go last so a crash leaves a topic that is
        // still listed and gets deleted again.
        for prefix in [
            dedup::topic_prefix(dedup::Space::Event, topic),
            dedup::topic_prefix(dedup::Space::Run, topic),
            keys::topic_prefix(topic),
        ] {
            let end = keys::end_of(&prefix);
            loop {
                let rows = self
                    .engine()
                    .scan(CF_LOG, &prefix, Some(&end), RETENTION_STEP)
                    .map_err(read_err)?;
                if rows.is_empty() {
                    break;
                }
                let mut batch = Batch::new();
                for (k, _) in rows {
                    batch.delete(CF_LOG, k);
                }
                self.group.commit(batch).map_err(write_err)?;
            }
        }
        self.group
            .commit_with(|_| {
                let mut heads = self.heads();
                let mut batch = Batch::new();
                heads.retain(|(t, p), _| {
                    if t == topic {
                        batch.delete(CF_LOG, keys::head_key(t, *p));
                        false
                    } else {
                        true
                    }
                });
                Ok((batch, ()))
            })
            .map_err(write_err)?;
        self.tail().forget_topic(topic);
        // Receivers of the deleted partitions see their sender closed.
        self.appends.forget_topic(topic);
        Ok(())
    }

    fn next_body(&self) -> MutexGuard<'_, u64> {
        self.next_body.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn append_body(&self, body: &[u8]) -> Result<u64, LogError> {
        self.group
            .commit_with(|_| {
                let mut next = self.next_body();
                let seq = *next;
                *next += 1;
                let mut batch = Batch::new();
                batch.put(
                    CF_DLQ,
                    keys::body_key(seq),
                    Encoder::new(BODY_V1).bytes(body).finish(),
                );
                batch.put(
                    CF_DLQ,
                    keys::BODY_SEQ.to_vec(),
                    Encoder::new(SEQ_V1).u64(seq + 1).finish(),
                );
                Ok((batch, seq))
            })
            .map_err(write_err)
    }

    /// A stored record that fails its own checksum or framing: damage RocksDB's
    /// checksums could not see (it happened before the write). The engine stops like
    /// on damage RocksDB finds itself. (A hole below the durable end is reported as
    /// corrupt too, but does not stop the engine: a read racing a topic's deletion
    /// sees one.)
    fn damaged(&self, key: &[u8], e: DecodeError) -> LogError {
        let err = corrupt(key, e);
        if let LogError::Corrupt { key, reason } = &err {
            self.engine()
                .fail_stop(&format!("corrupt log record {key}: {reason}"));
        }
        err
    }

    fn read_body(&self, seq: u64) -> Result<Option<Vec<u8>>, LogError> {
        let key = keys::body_key(seq);
        match self.engine().get(CF_DLQ, &key).map_err(read_err)? {
            None => Ok(None),
            Some(b) => decode_body(&b).map(Some).map_err(|e| self.damaged(&key, e)),
        }
    }
}

#[async_trait]
impl PartitionLog for RocksLog {
    fn log_id(&self) -> &str {
        &self.inner.log_id
    }

    async fn append(
        &self,
        topic: &str,
        events: Vec<(u32, Vec<u8>)>,
    ) -> Result<Vec<(u32, u64)>, LogError> {
        keys::check_name("topic", topic).map_err(LogError::Invalid)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let at = now_ms();
        let inner = self.inner.clone();
        let owned = topic.to_string();
        // On the store thread: one wake-up and one fsync for a burst of appends.
        let (_, assigned) = on_store_thread(&self.inner.group, Wait::Durable, move |_| {
            Ok::<_, LocalError>(inner.stage_append(&owned, events, at))
        })
        .await
        .map_err(write_err)?;
        self.inner.appended(topic, &assigned);
        Ok(assigned)
    }

    async fn append_dedup(
        &self,
        topic: &str,
        events: Vec<DedupEvent>,
        window_ms: u64,
    ) -> Result<Vec<Appended>, LogError> {
        keys::check_name("topic", topic).map_err(LogError::Invalid)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        self.dedup_loaded().await?;
        let (answers, assigned) = match self.stage_dedup(topic, events, window_ms).await? {
            Ok(staged) => staged,
            // At the cap with the oldest entry expired but not swept yet: sweep now
            // (what the housekeeping would do at its next pass) and try once more.
            Err((
                LogError::DedupFull {
                    retry_after_ms: 0, ..
                },
                events,
            )) if !self.inner.dedup.sweeping.swap(true, Ordering::AcqRel) => {
                let swept = self.blocking_write(move |l| l.expire_dedup(now_ms())).await;
                self.inner.dedup.sweeping.store(false, Ordering::Release);
                swept?;
                self.stage_dedup(topic, events, window_ms)
                    .await?
                    .map_err(|(full, _)| full)?
            }
            Err((full, _)) => return Err(full),
        };
        if !assigned.is_empty() {
            self.inner.appended(topic, &assigned);
        }
        Ok(answers)
    }

    async fn read(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> Result<Vec<LogEvent>, LogError> {
        if let Some(events) = self
            .inner
            .read_cached(topic, partition, from, max_events, max_bytes)
        {
            return Ok(events);
        }
        let topic = topic.to_string();
        self.blocking(move |l| l.read(&topic, partition, from, max_events, max_bytes))
            .await
    }

    async fn bounds(&self, topic: &str, partition: u32) -> Result<PartitionBounds, LogError> {
        Ok(self.inner.bounds(topic, partition))
    }

    async fn delete_topic(&self, topic: &str) -> Result<(), LogError> {
        // Its dedup entries leave memory: not before the load has put them there.
        self.dedup_loaded().await?;
        let topic = topic.to_string();
        self.blocking_write(move |l| l.delete_topic(&topic)).await
    }

    async fn enforce_retention(
        &self,
        retention: Retention,
        now_ms: u64,
    ) -> Result<RetentionReport, LogError> {
        self.blocking_write(move |l| l.enforce_retention(retention, now_ms))
            .await
    }

    fn appends(&self, topic: &str, partition: u32) -> watch::Receiver<u64> {
        let inner = &self.inner;
        inner
            .appends
            .subscribe(topic, partition, || inner.bounds(topic, partition).end)
    }
}

#[async_trait]
impl DeadLetterBodies for RocksLog {
    fn log_id(&self) -> &str {
        &self.inner.log_id
    }

    async fn append_body(&self, body: &[u8]) -> Result<BodyRef, LogError> {
        let body = body.to_vec();
        let seq = self.blocking_write(move |l| l.append_body(&body)).await?;
        Ok(BodyRef {
            log_id: self.inner.log_id.clone(),
            seq,
        })
    }

    async fn read_body(&self, body: &BodyRef) -> Result<Option<Vec<u8>>, LogError> {
        if body.log_id != self.inner.log_id {
            return Ok(None);
        }
        let seq = body.seq;
        self.blocking(move |l| l.read_body(seq)).await
    }

    async fn delete_body(&self, body: &BodyRef) -> Result<(), LogError> {
        if body.log_id != self.inner.log_id {
            return Ok(());
        }
        let mut batch = Batch::new();
        batch.delete(CF_DLQ, keys::body_key(body.seq));
        self.blocking_write(move |l| l.group.commit(batch).map_err(write_err))
            .await
    }

    async fn list_bodies(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<BodyRef>, LogError> {
        let start = keys::body_key(after.map(|a| a.saturating_add(1)).unwrap_or(0));
        let end = keys::end_of(&[keys::BODY]);
        let log_id = self.inner.log_id.clone();
        self.blocking(move |l| {
            let rows = l
                .engine()
                .scan(CF_DLQ, &start, Some(&end), limit)
                .map_err(read_err)?;
            rows.into_iter()
                .map(|(k, _)| {
                    let seq = k
                        .get(1..9)
                        .and_then(|b| <[u8; 8]>::try_from(b).ok())
                        .map(u64::from_be_bytes)
                        .ok_or_else(|| corrupt(&k, DecodeError::Truncated))?;
                    Ok(BodyRef {
                        log_id: log_id.clone(),
                        seq,
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

    proptest! {
        #[test]
        fn event_records_round_trip(at in any::<u64>(), payload in proptest::collection::vec(any::<u8>(), 0..64)) {
            let r = EventRecord { appended_at_ms: at, payload };
            prop_assert_eq!(EventRecord::decode(&r.encode()), Ok(r));
        }

        #[test]
        fn head_records_round_trip(start in 0u64..1000, len in 0u64..1000, bytes in any::<u64>()) {
            let r = HeadRecord { start, end: start + len, bytes };
            prop_assert_eq!(HeadRecord::decode(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn damaged_records_are_detected() {
        assert_damage_is_detected(
            &EventRecord {
                appended_at_ms: 5,
                payload: b"ev".to_vec(),
            }
            .encode(),
            EventRecord::decode,
        );
        assert_damage_is_detected(
            &HeadRecord {
                start: 1,
                end: 4,
                bytes: 9,
            }
            .encode(),
            HeadRecord::decode,
        );
    }
}

/// Fuzzing the private dead-letter stream records (docs/fuzzing.md):
/// a body or sequence record read back damaged is reported, never a panic or a value.
#[cfg(test)]
mod fuzz {
    use super::*;
    use meshd_fuzz_cases::cases;
    use proptest::prelude::*;

    /// Arbitrary bytes, or a payload sealed with a valid frame so it reaches the fields.
    fn record_bytes() -> impl Strategy<Value = Vec<u8>> {
        let sealed =
            (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..24)).prop_map(|(n, tail)| {
                let mut b = vec![1u8];
                b.extend_from_slice(&(n % 32).to_le_bytes());
                b.extend_from_slice(&tail);
                let crc = crc32(&b);
                b.extend_from_slice(&crc.to_le_bytes());
                b
            });
        prop_oneof![proptest::collection::vec(any::<u8>(), 0..48), sealed]
    }

    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn body_record_decode(bytes in record_bytes()) {
            if let Ok(body) = decode_body(&bytes) {
                prop_assert_eq!(Encoder::new(BODY_V1).bytes(&body).finish(), bytes);
            }
        }

        #[test]
        fn seq_record_decode(bytes in record_bytes()) {
            if let Ok(n) = decode_seq(&bytes) {
                prop_assert_eq!(Encoder::new(SEQ_V1).u64(n).finish(), bytes);
            }
        }
    }
}
