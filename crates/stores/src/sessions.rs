//! # SessionStore: client sessions as leased, fenced owner keys in Meta
//!
//! A client id has at most one live session. The session *is* an owner key in Meta
//! (see the fencing model in [`meshd_meta::fence`]):
//!
//! | key | value | lifetime |
//! |---|---|---|
//! | `meshd/v1/sessions/client/{client_id}` ([`record`]) | the session record | the session's lease; written once per session |
//! | `meshd/v1/sessions/id/{session_id}` ([`id_record`]) | the client id | the same lease |
//!
//! Both keys are written in one transaction under a lease granted for the session.
//! The session's **epoch** is the owner key's `mod_revision` at open. Opening a session
//! for a client id that has one rewrites the owner key unconditionally (a takeover,
//! like [`Ownership::take_over`]), which gives it a higher `mod_revision`, so every
//! later write made for the previous session — compared against its epoch in the same
//! transaction — fails as `Fenced`, on any instance. The previous session's id key
//! stays on its own lease, which nobody renews any more: until that lease would have
//! expired the old id answers `Fenced`, afterwards `NotFound`.
//!
//! Sessions expire with their lease: when it ends in Meta both keys vanish, and every
//! instance's cache (list, then watch: see [`crate::subscriptions`]) drops the session.
//!
//! The failures the tests in `tests/sessions.rs` pin: a taken-over session that could
//! still heartbeat, close or write; a session that outlived its TTL without
//! heartbeats, or died while heartbeated; a session lost across a Meta restart; a
//! Meta outage reported as "no such session".

pub mod id_record;
pub mod record;
mod types;

pub use types::Session;

pub use crate::subscriptions::{CacheConfig, CacheHealth};

use crate::cache::{Codec, CorruptRecord, Lookup, WatchedCache};
use crate::failure::StoreFailure;
use crate::meta_util::FromMeta;
use crate::subscriptions::validate_name;
use async_trait::async_trait;
use meshd_meta::fence::{LeaseDeadline, Ownership};
use meshd_meta::{Compare, KeyValue, LeaseId, Meta, MetaError, Txn, TxnResponse};
use record::SessionValue;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The shortest session TTL (HTTP API: `ttl_ms` 2000–3600000).
pub const MIN_TTL: Duration = Duration::from_millis(2_000);
/// The longest session TTL.
pub const MAX_TTL: Duration = Duration::from_millis(3_600_000);

const STORE: &str = "sessions";

impl Session {
    /// The session's ownership, to make writes fenced by its epoch.
    pub fn ownership(&self) -> Ownership {
        Ownership::from_parts(record::key(&self.client_id), self.epoch, Some(self.lease))
    }
}

/// The answer to a heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    pub epoch: i64,
    /// The TTL the lease was renewed for (effective value).
    pub ttl: Duration,
}

/// Counters for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SessionStats {
    /// Opens on this instance that took a live session over.
    pub takeovers: u64,
    /// Operations for a session that were refused as `Fenced` (in Meta or locally).
    pub fenced: u64,
    /// Operations refused because this instance's safety deadline had passed.
    pub expired_locally: u64,
}

/// The Meta owner key of a client id's session: fence writes for a session with
/// `Ownership::from_parts(owner_key(client_id), epoch, None)` (see [`fence`]).
pub fn owner_key(client_id: &str) -> Vec<u8> {
    record::key(client_id)
}

/// Rebuilds the fence of a session known by client id and epoch (for example from a
/// record written for it): a transaction committed with it applies only while that
/// session is still the client id's live session.
pub fn fence(client_id: &str, epoch: i64) -> Ownership {
    Ownership::from_parts(record::key(client_id), epoch, None)
}

/// The SessionStore's errors. Meta's classification stays visible.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SessionError {
    /// A value outside its documented range (HTTP 400). Nothing was written.
    #[error("invalid session request: {field} {reason}")]
    Invalid { field: &'static str, reason: String },
    /// No such live session: unknown, closed or expired (HTTP 404).
    #[error("session {session_id} not found")]
    NotFound { session_id: String },
    /// The session was taken over (or, for a write, is no longer the client id's
    /// live session). Nothing was applied (HTTP 409 fenced). Open a new session.
    #[error("session {session_id} is fenced: its client id has a newer session")]
    Fenced { session_id: String },
    /// This instance has not renewed the session's lease recently enough to be sure
    /// it is still live, so it stops acting for it (the lease may already have
    /// expired in Meta). A successful heartbeat through this instance re-arms it.
    #[error("session {session_id} expired locally: no keep-alive within its safety deadline")]
    Expired { session_id: String },
    /// A compare of the caller's own transaction ([`SessionStore::commit_for`])
    /// failed; `current` is that key's value. Nothing was applied.
    #[error("precondition failed (current mod_revision: {:?})", current.as_ref().map(|kv| kv.mod_revision))]
    Conflict { current: Option<Box<KeyValue>> },
    /// The backend failed; [`StoreFailure`] says what the caller may assume.
    #[error("session store {0}")]
    Store(#[from] StoreFailure),
}

impl SessionError {
    /// A short, stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid { .. } => "invalid",
            Self::NotFound { .. } => "not_found",
            Self::Fenced { .. } => "fenced",
            Self::Expired { .. } => "expired",
            Self::Conflict { .. } => "conflict",
            Self::Store(f) => f.kind(),
        }
    }

    /// Known not applied and retryable as is.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Store(f) if f.is_retryable())
    }
}

impl FromMeta for SessionError {
    fn special(e: MetaError) -> Result<Self, MetaError> {
        match e {
            MetaError::Conflict { current } => Ok(Self::Conflict { current }),
            e => Err(e),
        }
    }
}

impl From<CorruptRecord> for SessionError {
    fn from(c: CorruptRecord) -> Self {
        Self::Store(StoreFailure::Corrupt {
            key: c.key,
            reason: c.reason,
        })
    }
}

/// # The SessionStore contract
///
/// **Durability.** `open` returns once the session (both keys, under its lease) is
/// durable in Meta; `close` once both keys are deleted (the lease is then revoked,
/// best effort: it would expire anyway). `heartbeat` returns once Meta renewed the
/// lease for the returned TTL.
///
/// **One live session per client id.** `open` for a client id that has a live
/// session, on any instance, takes it over: the new session has a higher epoch, and
/// from then on the previous session's `heartbeat`, `close`, `check` and
/// `commit_for` answer `Fenced` (until its lease would have expired; then
/// `NotFound`). Every write made for a session ([`commit_for`], or a transaction
/// committed with [`fence_for`]'s ownership) compares the owner key's `mod_revision`
/// with the epoch in the same Meta transaction, so a stale session's write is never
/// applied.
///
/// **Expiry.** A session expires `ttl` after its open or its last heartbeat (Meta
/// ends the lease; both keys vanish; caches drop it). Independently, the instance
/// that opened or renewed a session stops *acting* for it (`fence_for`, `check`,
/// `commit_for` answer `Expired`) once the TTL minus a safety margin has passed since
/// the last successful keep-alive was *sent* ([`LeaseDeadline`]), so it never acts
/// on a lease Meta may already have ended. `heartbeat` itself is answered by Meta
/// (a renewal that succeeds proves the lease was still live), and re-arms the
/// deadline.
///
/// **Reads.** `get` and `list` are served from this instance's cache of live
/// sessions (read-your-writes for this instance's own opens and closes); a cache that
/// never loaded answers `Unavailable`, never "absent".
///
/// **Concurrency.** Every method may be called concurrently, on any instance.
///
/// **Errors: what the caller must do.**
/// * `Invalid`: fix the request. `NotFound`: open a new session.
/// * `Fenced`: this session was taken over; stop acting for it.
/// * `Expired`: stop acting for it on this instance; heartbeat (or open a new one).
/// * `Conflict`: the caller's own compare failed; re-read and decide.
/// * `Unavailable`: nothing applied; retry. `Indeterminate`: re-read before acting.
/// * `Corrupt`, `Failed`: alert.
///
/// [`commit_for`]: SessionStore::commit_for
/// [`fence_for`]: SessionStore::fence_for
#[async_trait]
pub trait SessionStore: Send + Sync + 'static {
    /// Opens a session for `client_id` with a lease of `ttl` (2 s – 1 h), taking over
    /// any live session of the same client id.
    async fn open(&self, client_id: &str, ttl: Duration) -> Result<Session, SessionError>;

    /// Renews the session's lease, if it is still the client id's live session.
    async fn heartbeat(&self, session_id: &str) -> Result<Heartbeat, SessionError>;

    /// Ends the session (a fenced delete of its keys, then the lease is revoked).
    async fn close(&self, session_id: &str) -> Result<(), SessionError>;

    /// One live session, from the cache.
    async fn get(&self, session_id: &str) -> Result<Option<Session>, SessionError>;

    /// Every live session, from the cache, in client id order.
    async fn list(&self) -> Result<Vec<Session>, SessionError>;

    /// The ownership to fence writes made for the session with (owner key, epoch,
    /// lease). Refused locally when this instance's safety deadline passed or its
    /// cache already shows a newer session for the client id.
    async fn fence_for(&self, session_id: &str) -> Result<Ownership, SessionError>;

    /// Checks in Meta that `session_id` is live with `epoch` (`Fenced` otherwise).
    async fn check(&self, session_id: &str, epoch: i64) -> Result<(), SessionError>;

    /// Commits `txn` for the session: applied only while it is the client id's live
    /// session with its epoch (`Fenced` otherwise; `Conflict` for the caller's own
    /// compares).
    async fn commit_for(&self, session_id: &str, txn: Txn) -> Result<TxnResponse, SessionError>;

    /// The Meta revision the cache has applied every change up to.
    fn cache_revision(&self) -> i64;

    /// The cache's state, for readiness.
    fn health(&self) -> CacheHealth;

    fn stats(&self) -> SessionStats;

    /// Live sessions (all instances) as the cache holds them, without copying them
    /// (for `meshd_sessions_live` and the `--max-sessions` quota); `None` before the
    /// cache loaded.
    fn live_count(&self) -> Option<usize>;

    /// Whether the cache holds a live session of `client_id` (an open is then a
    /// takeover, which no quota refuses); `None` before the cache loaded.
    fn has_live(&self, client_id: &str) -> Option<bool>;

    /// [`live_count`](Self::live_count), and which of `client_ids` have a live
    /// session in the cache, read together (for the quota, which adds this
    /// instance's opens in flight: each counts once).
    fn live_count_holding(&self, client_ids: &[String]) -> Option<(usize, Vec<bool>)>;
}

/// Settings of [`MetaSessionStore`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionStoreConfig {
    /// This instance's id, recorded in the sessions it opens.
    pub instance: String,
    /// How long before the TTL (from a keep-alive's send time) this instance stops
    /// acting for a session; `None`: [`LeaseDeadline::default_margin`] of the TTL.
    pub safety_margin: Option<Duration>,
    pub cache: CacheConfig,
}

impl SessionStoreConfig {
    pub fn new(instance: impl Into<String>) -> Self {
        Self {
            instance: instance.into(),
            safety_margin: None,
            cache: CacheConfig::default(),
        }
    }

    pub fn validate(&self) -> Result<(), SessionError> {
        if self.instance.is_empty() || self.instance.len() > 249 {
            return Err(SessionError::Invalid {
                field: "instance",
                reason: "must be 1–249 bytes".into(),
            });
        }
        if let Some(m) = self.safety_margin {
            if m >= MIN_TTL {
                return Err(SessionError::Invalid {
                    field: "safety_margin",
                    reason: format!("{m:?} is not below the shortest TTL {MIN_TTL:?}"),
                });
            }
        }
        self.cache
            .validate()
            .map_err(|(field, reason)| SessionError::Invalid { field, reason })
    }
}

struct SessionCodec;

impl Codec<Session> for SessionCodec {
    fn name(&self, key: &[u8]) -> Result<String, CorruptRecord> {
        record::client_of(key)
    }

    fn decode(&self, name: &str, kv: &KeyValue) -> Result<Session, CorruptRecord> {
        record::decode(name, kv)
    }

    fn secondary(&self, value: &Session) -> Option<String> {
        Some(value.session_id.clone())
    }
}

/// A session this instance opened or renewed: what it needs to act for it.
struct Local {
    client_id: String,
    epoch: i64,
    lease: LeaseId,
    /// When this instance must stop acting for the session.
    deadline: LeaseDeadline,
}

/// Where a session stands in Meta.
enum Resolved {
    Live(Session),
    /// The id key lives (its lease has not expired) but the client id has another
    /// session (or none after that one closed).
    TakenOver,
    /// Unknown, closed or expired.
    Gone,
}

/// The SessionStore on Meta with a watched cache of live sessions. Dropping it stops
/// the cache's background task.
pub struct MetaSessionStore {
    meta: Arc<dyn Meta>,
    cache: WatchedCache<Session>,
    config: SessionStoreConfig,
    /// Sessions this instance opened or renewed, by session id (a std mutex: short
    /// critical sections, never held across an await).
    local: Mutex<HashMap<String, Local>>,
    takeovers: AtomicU64,
    fenced: AtomicU64,
    expired_locally: AtomicU64,
}

fn new_session_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

impl MetaSessionStore {
    /// Starts the store and its cache follower. Must be called inside a Tokio
    /// runtime; does not wait for Meta.
    pub fn start(meta: Arc<dyn Meta>, config: SessionStoreConfig) -> Result<Self, SessionError> {
        config.validate()?;
        let cache = WatchedCache::start(
            STORE,
            meta.clone(),
            record::prefix(),
            Box::new(SessionCodec),
            &config.cache,
        )
        .map_err(|m| SessionError::Store(StoreFailure::Failed(m)))?;
        Ok(Self {
            meta,
            cache,
            config,
            local: Mutex::new(HashMap::new()),
            takeovers: AtomicU64::new(0),
            fenced: AtomicU64::new(0),
            expired_locally: AtomicU64::new(0),
        })
    }

    /// Waits at most `limit` for the cache to load and its watch to be live.
    pub async fn wait_ready(&self, limit: Duration) -> bool {
        self.cache.wait_ready(limit).await
    }

    /// A receiver that changes whenever the cached sessions do.
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.cache.subscribe()
    }

    /// Until when this instance may act for `session_id` (`None`: it has not opened
    /// or renewed it).
    pub fn acting_deadline(&self, session_id: &str) -> Option<Instant> {
        self.locals().get(session_id).map(|l| l.deadline.deadline())
    }

    /// How many opens on this instance took a live session over.
    pub fn takeovers(&self) -> u64 {
        self.takeovers.load(Ordering::Relaxed)
    }

    /// How many operations for a session were refused as fenced.
    pub fn fenced_writes(&self) -> u64 {
        self.fenced.load(Ordering::Relaxed)
    }

    fn backend(&self) -> meshd_meta::Backend {
        self.meta.backend()
    }

    fn locals(&self) -> MutexGuard<'_, HashMap<String, Local>> {
        // Every mutation is one insert, update or remove: consistent after a panic.
        self.local.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn forget(&self, session_id: &str) {
        self.locals().remove(session_id);
    }

    fn margin(&self, ttl: Duration) -> Duration {
        self.config
            .safety_margin
            .unwrap_or_else(|| LeaseDeadline::default_margin(ttl))
    }

    fn renewed(&self, session: &Session, sent_at: Instant, ttl: Duration) {
        let margin = self.margin(ttl);
        let mut locals = self.locals();
        match locals.get_mut(&session.session_id) {
            Some(l) if l.epoch == session.epoch => l.deadline.renewed(sent_at, ttl),
            _ => {
                locals.insert(
                    session.session_id.clone(),
                    Local {
                        client_id: session.client_id.clone(),
                        epoch: session.epoch,
                        lease: session.lease,
                        deadline: LeaseDeadline::new(ttl, margin, sent_at),
                    },
                );
            }
        }
    }

    /// Drops local entries whose lease has certainly ended in Meta by now.
    fn prune_locals(&self) {
        let now = Instant::now();
        self.locals()
            .retain(|_, l| now < l.deadline.deadline() + l.deadline.ttl() * 2);
    }

    fn count_fenced(&self, op: &'static str, session_id: &str) -> SessionError {
        self.fenced.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            store = STORE,
            backend = %self.backend(),
            op,
            session_id,
            "session fenced: its client id has a newer session"
        );
        SessionError::Fenced {
            session_id: session_id.to_string(),
        }
    }

    fn not_found(session_id: &str) -> SessionError {
        SessionError::NotFound {
            session_id: session_id.to_string(),
        }
    }

    async fn read(&self, key: &[u8]) -> Result<Option<KeyValue>, SessionError> {
        self.meta
            .get(key)
            .await
            .map(|r| r.kv)
            .map_err(SessionError::from_meta)
    }

    /// Where `session_id` stands in Meta (linearizable reads, no cache).
    async fn resolve(&self, session_id: &str) -> Result<Resolved, SessionError> {
        if !record::is_session_id(session_id) {
            return Ok(Resolved::Gone);
        }
        let hint = self.locals().get(session_id).map(|l| l.client_id.clone());
        let client_id = match hint {
            Some(c) => c,
            None => match self.read(&id_record::key(session_id)).await? {
                None => return Ok(Resolved::Gone),
                Some(kv) => id_record::decode(&kv)?,
            },
        };
        if let Some(kv) = self.read(&record::key(&client_id)).await? {
            let s = record::decode(&client_id, &kv)?;
            if s.session_id == session_id {
                return Ok(Resolved::Live(s));
            }
        }
        // The client id has another session or none: ours was taken over while its
        // id key (on its own lease) lives, or it is gone.
        Ok(match self.read(&id_record::key(session_id)).await? {
            Some(_) => Resolved::TakenOver,
            None => Resolved::Gone,
        })
    }

    /// Classifies a fence failure in Meta: taken over, or gone.
    async fn fenced_or_gone(&self, op: &'static str, session_id: &str) -> SessionError {
        match self.read(&id_record::key(session_id)).await {
            Ok(None) => {
                self.forget(session_id);
                Self::not_found(session_id)
            }
            // Present, or unreadable: Meta said fenced, which is what we know.
            _ => self.count_fenced(op, session_id),
        }
    }

    async fn open_inner(&self, client_id: &str, ttl: Duration) -> Result<Session, SessionError> {
        if let Err(reason) = validate_name(client_id) {
            return Err(SessionError::Invalid {
                field: "client_id",
                reason,
            });
        }
        if ttl < MIN_TTL || ttl > MAX_TTL {
            return Err(SessionError::Invalid {
                field: "ttl_ms",
                reason: format!("{} is outside 2000–3600000", ttl.as_millis()),
            });
        }
        self.prune_locals();
        let session_id = new_session_id();
        // The safety deadline counts from the grant's send time.
        let sent_at = Instant::now();
        let lease = self
            .meta
            .grant(ttl)
            .await
            .map_err(SessionError::from_meta)?;
        let value = SessionValue {
            session_id: session_id.clone(),
            client_id: client_id.to_string(),
            instance: self.config.instance.clone(),
            ttl: lease.ttl,
            lease: lease.id,
        };
        let written = self.write_session(&value).await;
        let (epoch, previous) = match written {
            Ok(w) => w,
            Err(e) => {
                // Nothing (or, when indeterminate, perhaps the keys) under the new
                // lease: end it so no half-open session lingers.
                if let Err(re) = self.meta.revoke(lease.id).await {
                    tracing::warn!(
                        store = STORE,
                        backend = %self.backend(),
                        lease = %lease.id,
                        error = %re,
                        "revoking the lease of a failed open; it expires on its own"
                    );
                }
                return Err(e);
            }
        };
        let session = Session {
            session_id,
            client_id: client_id.to_string(),
            epoch,
            instance: value.instance,
            ttl: lease.ttl,
            lease: lease.id,
        };
        self.locals().insert(
            session.session_id.clone(),
            Local {
                client_id: session.client_id.clone(),
                epoch,
                lease: lease.id,
                deadline: LeaseDeadline::new(lease.ttl, self.margin(lease.ttl), sent_at),
            },
        );
        self.cache
            .apply_local(client_id, epoch, Some(session.clone()));
        if let Some(previous) = previous {
            self.takeovers.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                store = STORE,
                backend = %self.backend(),
                client_id,
                session_id = %session.session_id,
                epoch,
                previous_session = previous.as_ref().map(|p| p.session_id.as_str()).unwrap_or("(unreadable)"),
                previous_epoch = previous.as_ref().map(|p| p.epoch).unwrap_or(0),
                previous_instance = previous.as_ref().map(|p| p.instance.as_str()).unwrap_or(""),
                "session taken over"
            );
        }
        tracing::info!(
            store = STORE,
            backend = %self.backend(),
            client_id,
            session_id = %session.session_id,
            epoch,
            ttl_ms = session.ttl_ms(),
            "session opened"
        );
        Ok(session)
    }

    /// Writes both keys under the lease. Returns the epoch and, for a takeover, the
    /// previous session (`Some(None)` when its record was unreadable).
    #[allow(clippy::type_complexity)]
    async fn write_session(
        &self,
        value: &SessionValue,
    ) -> Result<(i64, Option<Option<Session>>), SessionError> {
        let owner = record::key(&value.client_id);
        let id = id_record::key(&value.session_id);
        let owner_value =
            record::encode(value).map_err(|m| SessionError::Store(StoreFailure::Failed(m)))?;
        let id_value = id_record::encode(&value.client_id)
            .map_err(|m| SessionError::Store(StoreFailure::Failed(m)))?;
        let writes = || {
            Txn::new()
                .put_with_lease(&owner, &owner_value, Some(value.lease))
                .put_with_lease(&id, &id_value, Some(value.lease))
        };
        // First as a fresh open, so a takeover is known (and counted) for sure.
        let fresh = writes().when(Compare::Absent { key: owner.clone() });
        match self.meta.txn(fresh).await {
            Ok(r) => Ok((r.revision, None)),
            Err(MetaError::Conflict { current }) => {
                let previous = current.and_then(|kv| record::decode(&value.client_id, &kv).ok());
                // The takeover: an unconditional rewrite of the owner key, which gives
                // it a new, higher mod_revision (as `Ownership::take_over`).
                let r = self
                    .meta
                    .txn(writes())
                    .await
                    .map_err(SessionError::from_meta)?;
                Ok((r.revision, Some(previous)))
            }
            Err(e) => Err(SessionError::from_meta(e)),
        }
    }

    async fn heartbeat_inner(&self, session_id: &str) -> Result<Heartbeat, SessionError> {
        let session = match self.resolve(session_id).await? {
            Resolved::Live(s) => s,
            Resolved::TakenOver => {
                self.forget(session_id);
                return Err(self.count_fenced("heartbeat", session_id));
            }
            Resolved::Gone => {
                self.forget(session_id);
                return Err(Self::not_found(session_id));
            }
        };
        let sent_at = Instant::now();
        match self.meta.keep_alive(session.lease).await {
            Ok(ttl) => {
                self.renewed(&session, sent_at, ttl);
                tracing::debug!(
                    store = STORE,
                    backend = %self.backend(),
                    session_id,
                    epoch = session.epoch,
                    ttl_ms = ttl.as_millis() as u64,
                    "session heartbeat"
                );
                Ok(Heartbeat {
                    epoch: session.epoch,
                    ttl,
                })
            }
            Err(MetaError::LeaseNotFound(_)) => {
                self.forget(session_id);
                Err(Self::not_found(session_id))
            }
            Err(e) => Err(SessionError::from_meta(e)),
        }
    }

    async fn close_inner(&self, session_id: &str) -> Result<(), SessionError> {
        let session = match self.resolve(session_id).await? {
            Resolved::Live(s) => s,
            Resolved::TakenOver => return Err(self.count_fenced("close", session_id)),
            Resolved::Gone => {
                self.forget(session_id);
                return Err(Self::not_found(session_id));
            }
        };
        let txn = Txn::new()
            .delete(&record::key(&session.client_id))
            .delete(&id_record::key(session_id));
        let r = match session.ownership().commit(self.meta.as_ref(), txn).await {
            Ok(r) => r,
            Err(MetaError::Fenced) => return Err(self.fenced_or_gone("close", session_id).await),
            Err(e) => return Err(SessionError::from_meta(e)),
        };
        self.forget(session_id);
        self.cache.apply_local(&session.client_id, r.revision, None);
        match self.meta.revoke(session.lease).await {
            Ok(()) | Err(MetaError::LeaseNotFound(_)) => {}
            Err(e) => tracing::warn!(
                store = STORE,
                backend = %self.backend(),
                session_id,
                lease = %session.lease,
                error = %e,
                "session closed but its lease was not revoked; it expires on its own"
            ),
        }
        tracing::info!(
            store = STORE,
            backend = %self.backend(),
            session_id,
            client_id = %session.client_id,
            epoch = session.epoch,
            revision = r.revision,
            "session closed"
        );
        Ok(())
    }

    fn log_failure(&self, op: &'static str, subject: &str, e: &SessionError) {
        match e {
            SessionError::Store(_) => tracing::warn!(
                store = STORE,
                backend = %self.backend(),
                op,
                subject,
                kind = e.kind(),
                error = %e,
                "session operation failed"
            ),
            _ => tracing::debug!(
                store = STORE,
                backend = %self.backend(),
                op,
                subject,
                kind = e.kind(),
                error = %e,
                "session operation refused"
            ),
        }
    }

    fn logged<T>(
        &self,
        op: &'static str,
        subject: &str,
        r: Result<T, SessionError>,
    ) -> Result<T, SessionError> {
        if let Err(e) = &r {
            self.log_failure(op, subject, e);
        }
        r
    }

    async fn fence_for_inner(&self, session_id: &str) -> Result<Ownership, SessionError> {
        let local = self
            .locals()
            .get(session_id)
            .map(|l| (l.client_id.clone(), l.epoch, l.lease, l.deadline));
        if let Some((client_id, epoch, lease, deadline)) = local {
            if !deadline.is_live(Instant::now()) {
                self.expired_locally.fetch_add(1, Ordering::Relaxed);
                return Err(SessionError::Expired {
                    session_id: session_id.to_string(),
                });
            }
            // An early, local refusal when the cache already knows a newer session;
            // Meta's compare is what guarantees it either way.
            if let Lookup::Present(Ok(current)) = self.cache.lookup(&client_id) {
                if current.epoch > epoch {
                    return Err(self.count_fenced("fence_for", session_id));
                }
            }
            return Ok(Ownership::from_parts(
                record::key(&client_id),
                epoch,
                Some(lease),
            ));
        }
        if !record::is_session_id(session_id) {
            return Err(Self::not_found(session_id));
        }
        if let Lookup::Present(Ok(s)) = self.cache.lookup_secondary(session_id) {
            return Ok(s.ownership());
        }
        match self.resolve(session_id).await? {
            Resolved::Live(s) => Ok(s.ownership()),
            Resolved::TakenOver => Err(self.count_fenced("fence_for", session_id)),
            Resolved::Gone => Err(Self::not_found(session_id)),
        }
    }

    async fn commit_inner(&self, session_id: &str, txn: Txn) -> Result<TxnResponse, SessionError> {
        let owner = self.fence_for_inner(session_id).await?;
        match owner.commit(self.meta.as_ref(), txn).await {
            Ok(r) => Ok(r),
            Err(MetaError::Fenced) => Err(self.count_fenced("commit_for", session_id)),
            Err(e) => Err(SessionError::from_meta(e)),
        }
    }
}

#[async_trait]
impl SessionStore for MetaSessionStore {
    async fn open(&self, client_id: &str, ttl: Duration) -> Result<Session, SessionError> {
        let r = self.open_inner(client_id, ttl).await;
        self.logged("open", client_id, r)
    }

    async fn heartbeat(&self, session_id: &str) -> Result<Heartbeat, SessionError> {
        let r = self.heartbeat_inner(session_id).await;
        self.logged("heartbeat", session_id, r)
    }

    async fn close(&self, session_id: &str) -> Result<(), SessionError> {
        let r = self.close_inner(session_id).await;
        self.logged("close", session_id, r)
    }

    async fn get(&self, session_id: &str) -> Result<Option<Session>, SessionError> {
        if !record::is_session_id(session_id) {
            return Ok(None);
        }
        self.cache
            .get("session", |c| c.lookup_secondary(session_id))
            .await
            .map_err(|m| SessionError::Store(StoreFailure::Unavailable(m)))?
            .map_err(Into::into)
    }

    async fn list(&self) -> Result<Vec<Session>, SessionError> {
        self.cache
            .list("session")
            .await
            .map_err(|m| SessionError::Store(StoreFailure::Unavailable(m)))
    }

    async fn fence_for(&self, session_id: &str) -> Result<Ownership, SessionError> {
        let r = self.fence_for_inner(session_id).await;
        self.logged("fence_for", session_id, r)
    }

    async fn check(&self, session_id: &str, epoch: i64) -> Result<(), SessionError> {
        let r = async {
            let owner = self.fence_for_inner(session_id).await?;
            if owner.epoch() != epoch {
                return Err(self.count_fenced("check", session_id));
            }
            match owner.check(self.meta.as_ref()).await {
                Ok(()) => Ok(()),
                Err(MetaError::Fenced) => Err(self.fenced_or_gone("check", session_id).await),
                Err(e) => Err(SessionError::from_meta(e)),
            }
        }
        .await;
        self.logged("check", session_id, r)
    }

    async fn commit_for(&self, session_id: &str, txn: Txn) -> Result<TxnResponse, SessionError> {
        let r = self.commit_inner(session_id, txn).await;
        self.logged("commit_for", session_id, r)
    }

    fn cache_revision(&self) -> i64 {
        self.cache.revision()
    }

    fn health(&self) -> CacheHealth {
        self.cache.health()
    }

    fn live_count(&self) -> Option<usize> {
        self.cache.count()
    }

    fn live_count_holding(&self, client_ids: &[String]) -> Option<(usize, Vec<bool>)> {
        self.cache.count_holding(client_ids)
    }

    fn has_live(&self, client_id: &str) -> Option<bool> {
        match self.cache.lookup(client_id) {
            Lookup::Present(_) => Some(true),
            Lookup::Absent => Some(false),
            Lookup::NotLoaded => None,
        }
    }

    fn stats(&self) -> SessionStats {
        SessionStats {
            takeovers: self.takeovers.load(Ordering::Relaxed),
            fenced: self.fenced.load(Ordering::Relaxed),
            expired_locally: self.expired_locally.load(Ordering::Relaxed),
        }
    }
}
