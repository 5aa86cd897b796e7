//! # TopicStore: topic definitions in Meta, mirrored in a local cache
//!
//! A topic is one Meta key (`meshd/v1/topics/{name}`, see [`record`]) holding a
//! versioned JSON record with its partition count. Its `revision` is the key's
//! `mod_revision`; its `incarnation` is the key's `create_revision`, so a deleted and
//! re-created topic is a new incarnation.
//!
//! Reads are served from a local cache that follows Meta (list, then watch; the same
//! cache as the [`SubscriptionStore`](crate::subscriptions::SubscriptionStore)). A
//! `get` that misses the cache reads Meta before it answers "absent", so a topic
//! created on another instance is found at once.
//!
//! ## Deleting a topic that subscriptions may reference
//!
//! A subscription may only reference a topic that exists. Subscription writes read the
//! topic record and commit *conditional on the topic key's `mod_revision`* (in the same
//! Meta transaction as the subscription write), and refuse a topic that is absent or
//! marked `deleting`. A topic delete therefore runs:
//!
//! 1. **mark**: rewrite the record with `deleting: true`, conditional on its
//!    `mod_revision`. From this revision on, no subscription write that read the topic
//!    before the mark can commit (its compare fails), and every later one sees the
//!    mark and answers `TopicNotFound`: the set of subscriptions referencing the topic
//!    can only shrink.
//! 2. **check**: a linearizable range over the subscriptions prefix in Meta (never the
//!    cache), decoding each record's topic.
//! 3. if any subscription references the topic: **unmark** (rewrite with
//!    `deleting: false` conditional on the marked revision) and answer `InUse` listing
//!    them; otherwise **delete** the key conditional on the marked revision.
//!
//! While a topic is marked, `get` and `list` report it absent, and subscription
//! writes on it answer `TopicNotFound` (so a delete that ends in `InUse` can make a
//! concurrent subscription write fail with `TopicNotFound`; retrying it succeeds).
//!
//! **Recovery of an interrupted delete.** If the process dies (or Meta fails) between
//! the mark and the final step, the topic stays marked. The next `delete` of the name
//! resumes at step 2 (deleting it, or unmarking it with `InUse`). The next `ensure`
//! runs the same check: when the topic is unreferenced it finishes the delete
//! (conditional on the marked revision) and then creates the topic afresh (a new
//! incarnation, `created == true`) with the requested partition count; when it is
//! referenced it unmarks the record and answers as for an existing topic (the same
//! count: `Ok((topic, false))`, another: `PartitionMismatch`).

pub mod record;
mod types;

pub(crate) use types::StoredTopic;
pub use types::{
    validate_dedup_window, validate_partitions, Topic, DEFAULT_DEDUP_WINDOW_MS,
    MAX_DEDUP_WINDOW_MS, PARTITIONS_RANGE,
};

use crate::cache::{Codec, CorruptRecord, Lookup, WatchedCache};
use crate::failure::StoreFailure;
use crate::meta_util::{won, FromMeta, PrefixPages};
use crate::subscriptions::{record as subscription_record, validate_name};
pub use crate::subscriptions::{CacheConfig, CacheHealth};
use async_trait::async_trait;
use meshd_meta::{Compare, KeyValue, Meta, Precondition, Txn};
use std::sync::Arc;
use std::time::{Duration, Instant};

const STORE: &str = "topics";
/// How long a call keeps retrying a compare-and-set it lost before it gives up with
/// `Unavailable` (nothing applied by that attempt).
const CAS_RETRY_LIMIT: Duration = Duration::from_secs(10);
/// Subscription records read per page by a delete's reference check.
const CHECK_PAGE: usize = 500;

/// The TopicStore's errors. Meta's classification stays visible.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    /// A name or partition count outside its documented range (HTTP 400).
    #[error("invalid topic: {field} {reason}")]
    Invalid { field: &'static str, reason: String },
    /// No such topic (HTTP 404).
    #[error("topic {name:?} not found")]
    NotFound { name: String },
    /// The topic exists with another partition count (HTTP 409). Nothing was written.
    #[error("topic {name:?} exists with {existing} partitions, not {requested}")]
    PartitionMismatch {
        name: String,
        existing: u32,
        requested: u32,
    },
    /// Subscriptions reference the topic, so it was not deleted (HTTP 409).
    #[error("topic {name:?} is referenced by subscriptions {subscriptions:?}")]
    InUse {
        name: String,
        subscriptions: Vec<String>,
    },
    /// The backend failed; [`StoreFailure`] says what the caller may assume.
    #[error("topic store {0}")]
    Store(#[from] StoreFailure),
}

impl TopicError {
    /// A short, stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid { .. } => "invalid",
            Self::NotFound { .. } => "not_found",
            Self::PartitionMismatch { .. } => "partition_mismatch",
            Self::InUse { .. } => "in_use",
            Self::Store(f) => f.kind(),
        }
    }

    /// Known not applied and retryable as is.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Store(f) if f.is_retryable())
    }
}

impl FromMeta for TopicError {}

impl From<CorruptRecord> for TopicError {
    fn from(c: CorruptRecord) -> Self {
        Self::Store(StoreFailure::Corrupt {
            key: c.key,
            reason: c.reason,
        })
    }
}

/// # The TopicStore contract
///
/// **Durability.** A write (`ensure` that creates, `delete`) that returns `Ok` is
/// durable in Meta at the returned revision.
///
/// **Reads.** `get` answers from this instance's cache; on a miss (or a topic the
/// cache holds as being deleted) it reads Meta before answering `None`, so a topic
/// created on another instance is found at once. `list` answers from the cache, which
/// converges to Meta's state. Topics marked `deleting` are reported absent. After a
/// write of this instance, its own reads see it. A read answers `Unavailable` (never
/// "absent") when it cannot tell.
///
/// **Deletes and subscriptions.** A topic is never deleted while a subscription
/// references it, and no subscription can be created on a topic that is deleted or
/// being deleted (see the module documentation for the protocol and its recovery).
///
/// **Concurrency.** Every method may be called concurrently from any number of tasks
/// and instances.
#[async_trait]
pub trait TopicStore: Send + Sync + 'static {
    /// PUT semantics: creates the topic (`Ok((topic, true))`), or returns it when it
    /// exists with the same partition count (`Ok((topic, false))`);
    /// `PartitionMismatch` when it exists with another count.
    async fn ensure(&self, name: &str, partitions: u32) -> Result<(Topic, bool), TopicError> {
        self.ensure_with(name, partitions, None).await
    }

    /// [`ensure`](Self::ensure) that also sets the dedup window: a new topic gets
    /// `dedup_window_ms` (default [`DEFAULT_DEDUP_WINDOW_MS`]); an existing one with
    /// the same partition count and another window is updated to it (`Ok((topic,
    /// false))`, conditional on its revision like every write).
    async fn ensure_with(
        &self,
        name: &str,
        partitions: u32,
        dedup_window_ms: Option<u64>,
    ) -> Result<(Topic, bool), TopicError>;

    /// From the local cache; on a miss, read Meta before answering None (a topic
    /// created on another instance is found at once).
    async fn get(&self, name: &str) -> Result<Option<Topic>, TopicError>;

    /// Every topic from the cache, in name order. Corrupt records are left out (and
    /// counted in [`CacheHealth::corrupt_records`]).
    async fn list(&self) -> Result<Vec<Topic>, TopicError>;

    /// Deletes the topic; InUse (listing them) while any subscription references it;
    /// NotFound when absent. The answer is the deleted topic, its `revision` being the
    /// revision of the delete.
    async fn delete(&self, name: &str) -> Result<Topic, TopicError>;
}

struct TopicCodec;

impl Codec<StoredTopic> for TopicCodec {
    fn name(&self, key: &[u8]) -> Result<String, CorruptRecord> {
        record::name_of(key)
    }

    fn decode(&self, name: &str, kv: &KeyValue) -> Result<StoredTopic, CorruptRecord> {
        record::decode(name, kv)
    }
}

/// The TopicStore on Meta (etcd or embedded) with a watched local cache. Dropping it
/// stops the cache's background task.
pub struct MetaTopicStore {
    meta: Arc<dyn Meta>,
    cache: WatchedCache<StoredTopic>,
}

/// What one pass of a write loop decided.
enum Step<T> {
    Done(T),
    /// Lost a compare-and-set: re-read and decide again.
    Retry,
}

impl MetaTopicStore {
    /// Starts the store and its cache follower. Must be called inside a Tokio
    /// runtime. Does not wait for Meta (see [`wait_ready`](Self::wait_ready)).
    pub async fn start(meta: Arc<dyn Meta>) -> Result<Self, TopicError> {
        let cache = WatchedCache::start(
            STORE,
            meta.clone(),
            record::prefix(),
            Box::new(TopicCodec),
            &CacheConfig::default(),
        )
        .map_err(|m| TopicError::Store(StoreFailure::Failed(m)))?;
        Ok(Self { meta, cache })
    }

    /// Waits at most `d` for the cache to load and its watch to be live.
    pub async fn wait_ready(&self, d: Duration) -> bool {
        self.cache.wait_ready(d).await
    }

    /// The cache's state, for readiness (`is_ready`: loaded and watching).
    pub fn health(&self) -> CacheHealth {
        self.cache.health()
    }

    /// How many topics the cache holds (for the `--max-topics` quota); `None`
    /// before it loaded.
    pub fn count(&self) -> Option<usize> {
        self.cache.count()
    }

    /// [`count`](Self::count), and which of `names` the cache holds, read together
    /// (for a quota that adds this instance's creates in flight: each counts once).
    pub fn count_holding(&self, names: &[String]) -> Option<(usize, Vec<bool>)> {
        self.cache.count_holding(names)
    }

    /// A receiver that changes whenever the cached topics do.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.cache.subscribe()
    }

    fn backend(&self) -> meshd_meta::Backend {
        self.meta.backend()
    }

    fn check_name(name: &str) -> Result<(), TopicError> {
        validate_name(name).map_err(|reason| TopicError::Invalid {
            field: "name",
            reason,
        })
    }

    /// The topic's record in Meta (a linearizable read).
    async fn read(&self, name: &str) -> Result<Option<StoredTopic>, TopicError> {
        let kv = self
            .meta
            .get(&record::key(name))
            .await
            .map_err(TopicError::from_meta)?
            .kv;
        match kv {
            None => Ok(None),
            Some(kv) => Ok(Some(record::decode(name, &kv)?)),
        }
    }

    /// Writes the record conditional on the key's `mod_revision` (`0`: absent).
    /// `Ok(None)`: the compare failed.
    async fn cas_put(
        &self,
        name: &str,
        partitions: u32,
        deleting: bool,
        dedup_window_ms: u64,
        expected: i64,
    ) -> Result<Option<StoredTopic>, TopicError> {
        let key = record::key(name);
        let value = record::encode(name, partitions, deleting, dedup_window_ms)
            .map_err(|m| TopicError::Store(StoreFailure::Failed(m)))?;
        let txn = Txn::new()
            .when(Compare::ModRevision {
                key: key.clone(),
                revision: expected,
            })
            .put(&key, &value);
        let r = won(self.meta.txn(txn).await).map_err(TopicError::from_meta)?;
        let Ok(r) = r else { return Ok(None) };
        let stored = StoredTopic {
            topic: Topic {
                name: name.to_string(),
                partitions,
                dedup_window_ms,
                revision: r.revision,
                incarnation: if expected == 0 {
                    r.revision
                } else {
                    // Filled in by the caller, who knows the current record.
                    0
                },
            },
            deleting,
        };
        Ok(Some(stored))
    }

    /// Rewrites `current` with `deleting`, conditional on its revision.
    async fn set_mark(
        &self,
        current: &Topic,
        deleting: bool,
    ) -> Result<Option<StoredTopic>, TopicError> {
        let Some(mut s) = self
            .cas_put(
                &current.name,
                current.partitions,
                deleting,
                current.dedup_window_ms,
                current.revision,
            )
            .await?
        else {
            return Ok(None);
        };
        s.topic.incarnation = current.incarnation;
        self.cache
            .apply_local(&current.name, s.topic.revision, Some(s.clone()));
        Ok(Some(s))
    }

    /// Deletes the marked topic conditional on its (marked) revision; `Ok(None)` when
    /// the compare failed.
    async fn delete_marked(&self, marked: &Topic) -> Result<Option<Topic>, TopicError> {
        let key = record::key(&marked.name);
        let txn = Txn::new()
            .when_precondition(&key, Precondition::ModRevision(marked.revision))
            .delete(&key);
        let r = won(self.meta.txn(txn).await).map_err(TopicError::from_meta)?;
        let Ok(r) = r else { return Ok(None) };
        self.cache.apply_local(&marked.name, r.revision, None);
        Ok(Some(Topic {
            revision: r.revision,
            ..marked.clone()
        }))
    }

    /// The subscriptions that reference topic `name`, read linearizably from Meta (in
    /// name order). A subscription record whose topic cannot be read is `Corrupt`:
    /// the check cannot prove the topic unreferenced.
    async fn referencing(&self, name: &str) -> Result<Vec<String>, TopicError> {
        let mut pages = PrefixPages::new(subscription_record::prefix(), None, CHECK_PAGE);
        let mut found = Vec::new();
        while let Some(page) = pages
            .next(self.meta.as_ref())
            .await
            .map_err(TopicError::from_meta)?
        {
            for kv in page.kvs {
                let Ok(sub) = subscription_record::name_of(&kv.key) else {
                    continue; // not a subscription key (the subscription cache logs it)
                };
                let topic = match subscription_record::decode_value(&sub, &kv.value) {
                    Ok(spec) => spec.topic,
                    Err(reason) => match topic_field(&kv.value) {
                        Some(topic) => topic,
                        None => {
                            return Err(TopicError::Store(StoreFailure::Corrupt {
                                key: crate::codec::key_text(&kv.key),
                                reason: format!(
                                    "cannot tell whether this subscription references topic \
                                     {name:?}: {reason}"
                                ),
                            }))
                        }
                    },
                };
                if topic == name {
                    found.push(sub);
                }
            }
        }
        Ok(found)
    }

    /// A short, growing, jittered pause between compare-and-set attempts.
    async fn contention_pause(attempt: u32) {
        let cap_ms = 1u64 << attempt.min(6);
        let ms = rand::random::<u64>() % cap_ms;
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    /// Runs `step` until it is done, bounded like every store's compare-and-set loop.
    async fn retrying<T, F, Fut>(&self, op: &str, name: &str, mut step: F) -> Result<T, TopicError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Step<T>, TopicError>>,
    {
        let started = Instant::now();
        let mut attempt = 0u32;
        loop {
            if let Step::Done(t) = step().await? {
                return Ok(t);
            }
            attempt += 1;
            if started.elapsed() >= CAS_RETRY_LIMIT {
                return Err(TopicError::Store(StoreFailure::Unavailable(format!(
                    "gave up after {attempt} compare-and-set attempts to {op} topic {name:?} \
                     under contention"
                ))));
            }
            tracing::debug!(
                store = STORE,
                backend = %self.backend(),
                op,
                name,
                attempt,
                "lost a compare-and-set; retrying"
            );
            Self::contention_pause(attempt).await;
        }
    }

    /// Steps 2 and 3 of the delete protocol on a marked topic: deletes it when no
    /// subscription references it (`Ok(Ok(deleted))`), or unmarks it and answers the
    /// referencing subscriptions (`Ok(Err(names, unmarked))`). `Step::Retry` when a
    /// compare-and-set was lost.
    #[allow(clippy::type_complexity)]
    async fn finish_marked(
        &self,
        marked: &Topic,
    ) -> Result<Step<Result<Topic, (Vec<String>, Topic)>>, TopicError> {
        let refs = match self.referencing(&marked.name).await {
            Ok(refs) => refs,
            Err(e) => {
                // Leave nothing marked that we can unmark; the error is the answer.
                if let Err(u) = self.set_mark(marked, false).await {
                    tracing::warn!(store = STORE, backend = %self.backend(), name = %marked.name, error = %u,
                        "could not unmark the topic after a failed reference check; the next delete or ensure finishes it");
                }
                return Err(e);
            }
        };
        if refs.is_empty() {
            return Ok(match self.delete_marked(marked).await? {
                Some(deleted) => Step::Done(Ok(deleted)),
                None => Step::Retry,
            });
        }
        match self.set_mark(marked, false).await? {
            Some(unmarked) => Ok(Step::Done(Err((refs, unmarked.topic)))),
            None => Ok(Step::Retry),
        }
    }

    async fn ensure_inner(
        &self,
        name: &str,
        partitions: u32,
        window: Option<u64>,
    ) -> Result<(Topic, bool), TopicError> {
        Self::check_name(name)?;
        validate_partitions(partitions).map_err(|reason| TopicError::Invalid {
            field: "partitions",
            reason,
        })?;
        if let Some(ms) = window {
            validate_dedup_window(ms).map_err(|reason| TopicError::Invalid {
                field: "dedup_window_ms",
                reason,
            })?;
        }
        // An existing topic: as it is, or to be updated to the requested window.
        let existing = |t: Topic| -> Result<(Topic, Option<u64>), TopicError> {
            if t.partitions != partitions {
                return Err(TopicError::PartitionMismatch {
                    name: name.to_string(),
                    existing: t.partitions,
                    requested: partitions,
                });
            }
            let update = window.filter(|ms| *ms != t.dedup_window_ms);
            Ok((t, update))
        };
        self.retrying("ensure", name, move || async move {
            let found = match self.read(name).await? {
                None => {
                    let window = window.unwrap_or(DEFAULT_DEDUP_WINDOW_MS);
                    return match self.cas_put(name, partitions, false, window, 0).await? {
                        Some(s) => {
                            self.cache
                                .apply_local(name, s.topic.revision, Some(s.clone()));
                            Ok(Step::Done((s.topic, true)))
                        }
                        None => Ok(Step::Retry),
                    };
                }
                Some(s) if !s.deleting => existing(s.topic)?,
                Some(marked) => {
                    // An interrupted delete: finish it (then create afresh on the next
                    // pass), or unmark the topic when it is still referenced.
                    tracing::info!(
                        store = STORE,
                        backend = %self.backend(),
                        name,
                        revision = marked.topic.revision,
                        "ensure found a topic marked for deletion; finishing the delete protocol"
                    );
                    match self.finish_marked(&marked.topic).await? {
                        Step::Retry | Step::Done(Ok(_)) => return Ok(Step::Retry),
                        Step::Done(Err((_, unmarked))) => existing(unmarked)?,
                    }
                }
            };
            match found {
                (t, None) => Ok(Step::Done((t, false))),
                (t, Some(ms)) => {
                    match self
                        .cas_put(name, t.partitions, false, ms, t.revision)
                        .await?
                    {
                        Some(mut s) => {
                            s.topic.incarnation = t.incarnation;
                            self.cache
                                .apply_local(name, s.topic.revision, Some(s.clone()));
                            Ok(Step::Done((s.topic, false)))
                        }
                        None => Ok(Step::Retry),
                    }
                }
            }
        })
        .await
    }

    async fn delete_inner(&self, name: &str) -> Result<Topic, TopicError> {
        Self::check_name(name)?;
        self.retrying("delete", name, move || async move {
            let Some(current) = self.read(name).await? else {
                return Err(TopicError::NotFound {
                    name: name.to_string(),
                });
            };
            let marked = if current.deleting {
                current.topic
            } else {
                match self.set_mark(&current.topic, true).await? {
                    Some(m) => m.topic,
                    None => return Ok(Step::Retry),
                }
            };
            match self.finish_marked(&marked).await? {
                Step::Retry => Ok(Step::Retry),
                Step::Done(Ok(deleted)) => Ok(Step::Done(deleted)),
                Step::Done(Err((subscriptions, _))) => Err(TopicError::InUse {
                    name: name.to_string(),
                    subscriptions,
                }),
            }
        })
        .await
    }

    fn log_failure(&self, op: &'static str, name: &str, e: &TopicError) {
        match e {
            TopicError::Store(_) => tracing::warn!(
                store = STORE, backend = %self.backend(), op, name, kind = e.kind(), error = %e,
                "topic operation failed"
            ),
            _ => tracing::debug!(
                store = STORE, backend = %self.backend(), op, name, kind = e.kind(), error = %e,
                "topic operation rejected"
            ),
        }
    }
}

/// The `topic` field of a subscription record that does not fully decode.
fn topic_field(value: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(value).ok()?;
    v.get("topic")?.as_str().map(str::to_string)
}

#[async_trait]
impl TopicStore for MetaTopicStore {
    async fn ensure_with(
        &self,
        name: &str,
        partitions: u32,
        dedup_window_ms: Option<u64>,
    ) -> Result<(Topic, bool), TopicError> {
        let r = self.ensure_inner(name, partitions, dedup_window_ms).await;
        match &r {
            Ok((t, created)) => tracing::info!(
                store = STORE,
                backend = %self.backend(),
                name,
                partitions = t.partitions,
                revision = t.revision,
                incarnation = t.incarnation,
                created,
                "topic ensured"
            ),
            Err(e) => self.log_failure("ensure", name, e),
        }
        r
    }

    async fn get(&self, name: &str) -> Result<Option<Topic>, TopicError> {
        Self::check_name(name)?;
        match self.cache.lookup(name) {
            Lookup::Present(Ok(s)) if !s.deleting => return Ok(Some(s.topic)),
            Lookup::Present(Err(c)) => return Err(c.into()),
            // A miss (or a topic being deleted, or a cache not loaded yet): Meta
            // decides, so a topic just created elsewhere is found at once.
            _ => {}
        }
        let found = self.read(name).await?;
        if let Some(s) = &found {
            self.cache
                .apply_local(name, s.topic.revision, Some(s.clone()));
        }
        Ok(found.filter(|s| !s.deleting).map(|s| s.topic))
    }

    async fn list(&self) -> Result<Vec<Topic>, TopicError> {
        let all = self
            .cache
            .list("topic")
            .await
            .map_err(|m| TopicError::Store(StoreFailure::Unavailable(m)))?;
        Ok(all
            .into_iter()
            .filter(|s| !s.deleting)
            .map(|s| s.topic)
            .collect())
    }

    async fn delete(&self, name: &str) -> Result<Topic, TopicError> {
        let r = self.delete_inner(name).await;
        match &r {
            Ok(t) => tracing::info!(
                store = STORE,
                backend = %self.backend(),
                name,
                revision = t.revision,
                incarnation = t.incarnation,
                "topic deleted"
            ),
            Err(e) => self.log_failure("delete", name, e),
        }
        r
    }
}
