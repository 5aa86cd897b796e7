//! # SubscriptionStore: subscriptions in Meta, mirrored in a local cache
//!
//! A subscription is one Meta key (`meshd/v1/subscriptions/{name}`, see [`record`])
//! holding a versioned JSON record. Its `revision` (the HTTP `ETag`) is the key's
//! `mod_revision`; its `incarnation` is the key's `create_revision`, so a deleted and
//! re-created subscription is a new incarnation whose offsets and deliveries start
//! afresh.
//!
//! Every write is a Meta transaction conditional on the key's revision, so concurrent
//! writers on any number of instances never overwrite each other blindly: a write
//! without a caller precondition re-reads and retries its own compare-and-set. A
//! create or update also compares the topic key's revision in the same transaction,
//! after checking that the topic exists and is not being deleted, so no subscription
//! can reference a topic that is gone (see [`crate::topics`]).
//!
//! Reads are served from a local cache that follows Meta (list, then watch; see
//! [`cache`]). Each instance's cache converges to Meta's state; an instance's own
//! writes are visible to its own reads as soon as the write returns.
//!
//! The failures the tests in `tests/subscriptions.rs` pin: a stale `If-Match` that
//! overwrote a newer update; an unconditional PUT that answered 409 to a concurrent
//! writer; a cache that missed a delete made while its watch was down or compacted; an
//! instance that did not see its own write; a write reported failed that had landed
//! (or the other way round) while etcd was down.

mod error;
pub mod filters;
pub mod push;
pub mod record;
mod types;

pub use error::SubscriptionError;
pub use filters::{
    check_write_bounds, AttributeIndex, Filter, FilterError, FilterExpr, Selector, MAX_FILTER_LEN,
};
pub use push::{Push, Rate, REDACTED};
pub use types::{
    Backoff, Ordering, StartPosition, Subscription, SubscriptionSpec, ACK_TIMEOUT_MS_RANGE,
    BACKOFF_MAX_MS, DEFAULT_ACK_TIMEOUT_MS, DEFAULT_BACKOFF_INITIAL_MS, DEFAULT_BACKOFF_MAX_MS,
    DEFAULT_MAX_ATTEMPTS, MAX_ATTEMPTS_RANGE, MAX_PUSH_URL_LEN,
};

pub use crate::cache::{CacheConfig, CacheHealth};

use crate::cache::{Codec, CorruptRecord, WatchedCache};
use crate::failure::StoreFailure;
use crate::meta_util::{won, FromMeta};
use async_trait::async_trait;
use meshd_meta::{Compare, KeyValue, Meta, Txn};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Names are 1–249 characters of `[A-Za-z0-9._-]`.
pub use crate::names::{validate_name, MAX_NAME_LEN};

const STORE: &str = "subscriptions";

/// A write's condition on the subscription's current revision (HTTP `If-Match` /
/// `If-None-Match: *`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precondition {
    /// Unconditional from the caller's view (the store still writes by
    /// compare-and-set and retries it internally).
    None,
    /// The subscription must not exist (`If-None-Match: *`).
    Absent,
    /// The subscription's revision must be this (`If-Match: "r"`).
    Revision(i64),
}

/// What a delete removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Deleted {
    pub name: String,
    /// The revision of the delete.
    pub revision: i64,
    /// The incarnation that was deleted (whose offsets and deliveries to drop).
    pub incarnation: i64,
}

/// # The SubscriptionStore contract
///
/// **Durability.** A write (`create`, `put`, `delete`) that returns `Ok` is durable in
/// Meta (etcd: committed by a quorum; embedded: fsynced) at the returned revision.
///
/// **Conditional writes.** Every write is one Meta transaction conditional on the
/// subscription's revision, so no write is applied over a state its caller did not
/// see. With [`Precondition::Revision`] or [`Precondition::Absent`] a mismatch is
/// `PreconditionFailed` with the current revision. With [`Precondition::None`] the
/// store re-reads and retries its compare-and-set until it wins, so a concurrent
/// writer never causes a conflict error; the final state is one of the written ones
/// (the last to commit).
///
/// **Topic existence.** `create` and `put` (every precondition) read the topic's
/// record in Meta and answer `TopicNotFound` when it is absent or marked as being
/// deleted; otherwise the subscription write is committed in one Meta transaction
/// with a compare on the topic key's `mod_revision`. When the topic changed
/// meanwhile, the store re-reads it and decides again. So a subscription never
/// references a topic that is deleted or being deleted (see [`crate::topics`] for the
/// delete side).
///
/// **Reads** (`get`, `list`) are served from this instance's cache, which follows
/// Meta and converges to its state. After a write of this instance returned revision
/// `r`, this instance's reads show that subscription at `r` or later
/// (read-your-writes); other instances see it once their watch delivers it. A read
/// answers `Unavailable` (never "absent") while the cache has never loaded; after
/// that it serves the last known state even while Meta is down ([`health`] says
/// whether the cache is live).
///
/// **Concurrency.** Every method may be called concurrently from any number of tasks
/// and instances.
///
/// **Errors: what the caller must do.**
/// * `Invalid`, `TopicChange`: fix the request; nothing was written.
/// * `NotFound`, `PreconditionFailed`: re-read and decide; nothing was written.
/// * `TopicNotFound`: create the topic first (or retry: a topic whose delete ended
///   in "in use" is back at once); nothing was written.
/// * `Unavailable`: nothing was written; retry later.
/// * `Indeterminate`: the write may or may not have landed; re-read before acting.
/// * `Corrupt`: the stored record is unreadable; an operator deletes or rewrites it.
/// * `Failed`: the backend cannot be trusted; alert.
///
/// [`health`]: SubscriptionStore::health
#[async_trait]
pub trait SubscriptionStore: Send + Sync + 'static {
    /// Creates a subscription that must not exist yet (`If-None-Match: *`).
    async fn create(&self, spec: SubscriptionSpec) -> Result<Subscription, SubscriptionError>;

    /// Creates or updates a subscription; `true` when it was created. An update
    /// cannot change the topic (`TopicChange`).
    async fn put(
        &self,
        spec: SubscriptionSpec,
        precondition: Precondition,
    ) -> Result<(Subscription, bool), SubscriptionError>;

    /// Deletes a subscription: `NotFound` when it does not exist (unconditional),
    /// `PreconditionFailed` when `If-Match` does not hold; `Absent` is not a delete
    /// condition (`Invalid`). A corrupt record can be deleted. The answer names the
    /// deleted incarnation, whose offsets and deliveries the caller drops.
    async fn delete(
        &self,
        name: &str,
        precondition: Precondition,
    ) -> Result<Deleted, SubscriptionError>;

    /// One subscription from the cache.
    async fn get(&self, name: &str) -> Result<Option<Subscription>, SubscriptionError>;

    /// Every subscription from the cache, in name order. A corrupt record is left
    /// out of the list (and logged and counted in [`CacheHealth::corrupt_records`]);
    /// `get` of its name answers `Corrupt`.
    async fn list(&self) -> Result<Vec<Subscription>, SubscriptionError>;

    /// The Meta revision the cache has applied every change up to.
    fn cache_revision(&self) -> i64;

    /// The cache's state, for readiness (`is_ready`: loaded and watching).
    fn health(&self) -> CacheHealth;
}

/// Settings of [`MetaSubscriptionStore`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscriptionStoreConfig {
    pub cache: CacheConfig,
    /// How long an unconditional write keeps retrying its compare-and-set under
    /// contention before it gives up with `Unavailable` (nothing applied).
    pub cas_retry_limit: Duration,
}

impl Default for SubscriptionStoreConfig {
    fn default() -> Self {
        Self {
            cache: CacheConfig::default(),
            cas_retry_limit: Duration::from_secs(10),
        }
    }
}

impl SubscriptionStoreConfig {
    pub fn validate(&self) -> Result<(), SubscriptionError> {
        self.cache
            .validate()
            .map_err(|(field, reason)| SubscriptionError::Invalid { field, reason })?;
        if self.cas_retry_limit.is_zero() {
            return Err(SubscriptionError::Invalid {
                field: "cas_retry_limit",
                reason: "must be greater than zero".into(),
            });
        }
        Ok(())
    }
}

struct SubscriptionCodec;

impl Codec<Subscription> for SubscriptionCodec {
    fn name(&self, key: &[u8]) -> Result<String, CorruptRecord> {
        record::name_of(key)
    }

    fn decode(&self, name: &str, kv: &KeyValue) -> Result<Subscription, CorruptRecord> {
        record::decode(name, kv)
    }
}

/// The SubscriptionStore on Meta (etcd or embedded) with a watched local cache.
/// Dropping it stops the cache's background task.
pub struct MetaSubscriptionStore {
    meta: Arc<dyn Meta>,
    cache: WatchedCache<Subscription>,
    config: SubscriptionStoreConfig,
}

impl MetaSubscriptionStore {
    /// Starts the store and its cache follower. Must be called inside a Tokio
    /// runtime. Does not wait for Meta: the store starts while Meta is down (see
    /// [`wait_ready`](Self::wait_ready) and [`SubscriptionStore::health`]).
    pub fn start(
        meta: Arc<dyn Meta>,
        config: SubscriptionStoreConfig,
    ) -> Result<Self, SubscriptionError> {
        config.validate()?;
        let cache = WatchedCache::start(
            STORE,
            meta.clone(),
            record::prefix(),
            Box::new(SubscriptionCodec),
            &config.cache,
        )
        .map_err(|m| SubscriptionError::Store(StoreFailure::Failed(m)))?;
        Ok(Self {
            meta,
            cache,
            config,
        })
    }

    /// Waits at most `limit` for the cache to load and its watch to be live.
    pub async fn wait_ready(&self, limit: Duration) -> bool {
        self.cache.wait_ready(limit).await
    }

    /// How many subscriptions the cache holds (for the `--max-subscriptions` quota);
    /// `None` before it loaded.
    pub fn count(&self) -> Option<usize> {
        self.cache.count()
    }

    /// [`count`](Self::count), and which of `names` the cache holds, read together
    /// (for a quota that adds this instance's creates in flight: each counts once).
    pub fn count_holding(&self, names: &[String]) -> Option<(usize, Vec<bool>)> {
        self.cache.count_holding(names)
    }

    /// A receiver that changes whenever the cached subscriptions do (for the
    /// dispatcher to pick up new, changed and deleted subscriptions).
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.cache.subscribe()
    }

    fn backend(&self) -> meshd_meta::Backend {
        self.meta.backend()
    }

    async fn read_current(&self, key: &[u8]) -> Result<Option<KeyValue>, SubscriptionError> {
        self.meta
            .get(key)
            .await
            .map(|r| r.kv)
            .map_err(SubscriptionError::from_meta)
    }

    fn precondition_failed(name: &str, current: Option<Box<KeyValue>>) -> SubscriptionError {
        SubscriptionError::PreconditionFailed {
            name: name.to_string(),
            current_revision: current.map(|kv| kv.mod_revision),
        }
    }

    /// Checks that an update keeps the topic of the stored record.
    fn check_update(
        name: &str,
        spec: &SubscriptionSpec,
        kv: &KeyValue,
    ) -> Result<Subscription, SubscriptionError> {
        let current = record::decode(name, kv)?;
        if current.spec.topic != spec.topic {
            return Err(SubscriptionError::TopicChange {
                name: name.to_string(),
                current: current.spec.topic,
                requested: spec.topic.clone(),
            });
        }
        Ok(current)
    }

    async fn cas_delete(
        &self,
        key: &[u8],
        expected: i64,
    ) -> Result<Result<i64, Option<Box<KeyValue>>>, SubscriptionError> {
        let txn = Txn::new()
            .when_precondition(key, meshd_meta::Precondition::ModRevision(expected))
            .delete(key);
        let r = won(self.meta.txn(txn).await).map_err(SubscriptionError::from_meta)?;
        Ok(r.map(|r| r.revision))
    }

    /// A short, growing, jittered pause between compare-and-set attempts, so
    /// contending writers spread out.
    async fn contention_pause(attempt: u32) {
        let cap_ms = 1u64 << attempt.min(6); // 2..64 ms
        let ms = rand::random::<u64>() % cap_ms;
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    /// The topic a subscription write needs: its key and `mod_revision`, or
    /// `TopicNotFound` when it is absent or marked as being deleted.
    async fn read_topic(&self, topic: &str) -> Result<(Vec<u8>, i64), SubscriptionError> {
        let key = crate::topics::record::key(topic);
        let not_found = || SubscriptionError::TopicNotFound {
            topic: topic.to_string(),
        };
        let kv = self.read_current(&key).await?.ok_or_else(not_found)?;
        let stored = crate::topics::record::decode(topic, &kv)?;
        if stored.deleting {
            return Err(not_found());
        }
        Ok((key, kv.mod_revision))
    }

    /// Every write path: read the subscription and check the caller's precondition
    /// (and that the topic does not change), read the topic, then commit the write
    /// conditional on both the subscription's and the topic's revisions. A lost
    /// compare re-reads both and decides again (bounded by `cas_retry_limit`); a
    /// caller's precondition that no longer holds is `PreconditionFailed`.
    async fn put_inner(
        &self,
        spec: &SubscriptionSpec,
        precondition: Precondition,
    ) -> Result<(Subscription, bool), SubscriptionError> {
        // Bad input is refused before Meta is asked (markers that keep stored push
        // credentials are checked once they are resolved, below).
        spec.with_redacted_as_placeholders().validate()?;
        // A write's filter bounds (records older than them still load: not in
        // `validate`, which decoding runs too).
        check_write_bounds(spec.filter.as_ref(), &spec.filters).map_err(|e| {
            SubscriptionError::Invalid {
                field: "filters",
                reason: e.to_string(),
            }
        })?;
        let name = spec.name.as_str();
        let key = record::key(name);
        let started = Instant::now();
        let mut attempt = 0u32;
        loop {
            let current = self.read_current(&key).await?;
            // The record this write replaces (when it may): what kept credentials come from.
            let mut stored_push = None;
            let (expected, incarnation) = match (precondition, current) {
                (Precondition::Absent, None) => (0, None),
                (Precondition::Absent, Some(kv)) => {
                    return Err(Self::precondition_failed(name, Some(Box::new(kv))))
                }
                // An `If-Match` of a revision that cannot exist must not turn into a
                // create (`mod_revision == 0` means absent in Meta).
                (Precondition::Revision(r), Some(kv)) if r >= 1 && kv.mod_revision == r => {
                    let existing = Self::check_update(name, spec, &kv)?;
                    stored_push = existing.spec.push;
                    (r, Some(existing.incarnation))
                }
                (Precondition::Revision(_), other) => {
                    return Err(Self::precondition_failed(name, other.map(Box::new)))
                }
                (Precondition::None, None) => (0, None),
                (Precondition::None, Some(kv)) => {
                    let existing = Self::check_update(name, spec, &kv)?;
                    stored_push = existing.spec.push;
                    (kv.mod_revision, Some(existing.incarnation))
                }
            };
            let mut spec = spec.clone();
            if let Some(p) = &mut spec.push {
                p.resolve(stored_push.as_ref())?;
            }
            spec.validate()?;
            let value = record::encode(&spec)
                .map_err(|m| SubscriptionError::Store(StoreFailure::Failed(m)))?;
            let (topic_key, topic_revision) = self.read_topic(&spec.topic).await?;
            let pre = if expected == 0 {
                meshd_meta::Precondition::Absent
            } else {
                meshd_meta::Precondition::ModRevision(expected)
            };
            let txn = Txn::new()
                .when_precondition(&key, pre)
                .when(Compare::ModRevision {
                    key: topic_key,
                    revision: topic_revision,
                })
                .put(&key, &value);
            let r = won(self.meta.txn(txn).await).map_err(SubscriptionError::from_meta)?;
            if let Ok(r) = r {
                let s = Subscription {
                    spec,
                    revision: r.revision,
                    incarnation: incarnation.unwrap_or(r.revision),
                };
                return Ok((s, incarnation.is_none()));
            }
            attempt += 1;
            if started.elapsed() >= self.config.cas_retry_limit {
                return Err(SubscriptionError::Store(StoreFailure::Unavailable(
                    format!(
                        "gave up after {attempt} compare-and-set attempts on subscription \
                     {name:?} under contention; nothing was written by this request"
                    ),
                )));
            }
            tracing::debug!(
                store = STORE,
                backend = %self.backend(),
                name,
                attempt,
                "put lost a compare-and-set (subscription or topic changed); re-reading"
            );
            Self::contention_pause(attempt).await;
        }
    }

    async fn delete_inner(
        &self,
        name: &str,
        precondition: Precondition,
    ) -> Result<Deleted, SubscriptionError> {
        if let Err(reason) = validate_name(name) {
            return Err(SubscriptionError::Invalid {
                field: "name",
                reason,
            });
        }
        let key = record::key(name);
        let deleted = |revision: i64, kv: &KeyValue| Deleted {
            name: name.to_string(),
            revision,
            incarnation: kv.create_revision,
        };
        match precondition {
            Precondition::Absent => Err(SubscriptionError::Invalid {
                field: "precondition",
                reason: "a delete cannot require the subscription to be absent".into(),
            }),
            Precondition::Revision(expected) => {
                let kv = match self.read_current(&key).await? {
                    Some(kv) if expected >= 1 && kv.mod_revision == expected => kv,
                    other => return Err(Self::precondition_failed(name, other.map(Box::new))),
                };
                match self.cas_delete(&key, expected).await? {
                    Ok(revision) => Ok(deleted(revision, &kv)),
                    Err(current) => Err(Self::precondition_failed(name, current)),
                }
            }
            Precondition::None => {
                let started = Instant::now();
                let mut attempt = 0u32;
                loop {
                    // No decode needed: a corrupt record can still be deleted.
                    let Some(kv) = self.read_current(&key).await? else {
                        return Err(SubscriptionError::NotFound {
                            name: name.to_string(),
                        });
                    };
                    if let Ok(revision) = self.cas_delete(&key, kv.mod_revision).await? {
                        return Ok(deleted(revision, &kv));
                    }
                    attempt += 1;
                    if started.elapsed() >= self.config.cas_retry_limit {
                        return Err(SubscriptionError::Store(StoreFailure::Unavailable(
                            format!(
                                "gave up after {attempt} compare-and-set attempts deleting \
                             subscription {name:?} under contention; nothing was deleted"
                            ),
                        )));
                    }
                    Self::contention_pause(attempt).await;
                }
            }
        }
    }

    fn log_failure(&self, op: &'static str, name: &str, e: &SubscriptionError) {
        match e {
            SubscriptionError::Store(_) => tracing::warn!(
                store = STORE,
                backend = %self.backend(),
                op,
                name,
                kind = e.kind(),
                error = %e,
                "subscription write failed"
            ),
            _ => tracing::debug!(
                store = STORE,
                backend = %self.backend(),
                op,
                name,
                kind = e.kind(),
                error = %e,
                "subscription write rejected"
            ),
        }
    }
}

#[async_trait]
impl SubscriptionStore for MetaSubscriptionStore {
    async fn create(&self, spec: SubscriptionSpec) -> Result<Subscription, SubscriptionError> {
        self.put(spec, Precondition::Absent).await.map(|(s, _)| s)
    }

    async fn put(
        &self,
        spec: SubscriptionSpec,
        precondition: Precondition,
    ) -> Result<(Subscription, bool), SubscriptionError> {
        match self.put_inner(&spec, precondition).await {
            Ok((s, created)) => {
                self.cache
                    .apply_local(&s.spec.name, s.revision, Some(s.clone()));
                tracing::info!(
                    store = STORE,
                    backend = %self.backend(),
                    name = %s.spec.name,
                    topic = %s.spec.topic,
                    revision = s.revision,
                    incarnation = s.incarnation,
                    created,
                    "subscription written"
                );
                Ok((s, created))
            }
            Err(e) => {
                self.log_failure("put", &spec.name, &e);
                Err(e)
            }
        }
    }

    async fn delete(
        &self,
        name: &str,
        precondition: Precondition,
    ) -> Result<Deleted, SubscriptionError> {
        match self.delete_inner(name, precondition).await {
            Ok(d) => {
                self.cache.apply_local(name, d.revision, None);
                tracing::info!(
                    store = STORE,
                    backend = %self.backend(),
                    name,
                    revision = d.revision,
                    incarnation = d.incarnation,
                    "subscription deleted"
                );
                Ok(d)
            }
            Err(e) => {
                self.log_failure("delete", name, &e);
                Err(e)
            }
        }
    }

    async fn get(&self, name: &str) -> Result<Option<Subscription>, SubscriptionError> {
        if let Err(reason) = validate_name(name) {
            return Err(SubscriptionError::Invalid {
                field: "name",
                reason,
            });
        }
        self.cache
            .get("subscription", |c| c.lookup(name))
            .await
            .map_err(|m| SubscriptionError::Store(StoreFailure::Unavailable(m)))?
            .map_err(Into::into)
    }

    async fn list(&self) -> Result<Vec<Subscription>, SubscriptionError> {
        self.cache
            .list("subscription")
            .await
            .map_err(|m| SubscriptionError::Store(StoreFailure::Unavailable(m)))
    }

    fn cache_revision(&self) -> i64 {
        self.cache.revision()
    }

    fn health(&self) -> CacheHealth {
        self.cache.health()
    }
}
