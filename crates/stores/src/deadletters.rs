//! # DeadLetterStore: a ledger in Meta, bodies in the log's dead-letter stream
//!
//! A delivery that failed `max_attempts` times moves here. Meta holds small records
//! only, so an entry is a ledger record (`entry`) that references the event body,
//! which lives in the dead-letter stream of the log ([`DeadLetterBodies`]).
//!
//! ## Key layout (under `meshd/v1/deadletters/`, components escaped by
//! [`meshd_meta::keys`])
//!
//! | key | value | lifetime |
//! |---|---|---|
//! | `deadletters/entries/{subscription}/{id}` | entry record (`entry`) | until deleted, redriven successfully, or retention |
//! | `deadletters/ids/{id}` | id index record (`index`): the entry's subscription | exactly as long as its entry (same transactions) |
//!
//! The fixed first component (`entries` / `ids`) keeps the two kinds apart whatever a
//! subscription is called, so listing one subscription is one prefix range
//! (`entries/{subscription}/`) and reading by id is two point reads. (The key catalog
//! in `meshd_meta::keys` lists the older draft `deadletters/{subscription}/{id}`; this
//! layout supersedes it.)
//!
//! ## The failures this module is built against
//!
//! Each is pinned by a test in `crates/stores/tests/deadletters.rs` on both Meta
//! backends.
//!
//! * **Once per delivery.** The entry id is derived from (log id, subscription
//!   incarnation, topic, partition, offset) ([`id`]) and created conditional on its
//!   absence, so dead-lettering a delivery twice, or from many tasks at once, leaves
//!   one entry; two logs never collide.
//! * **Never an entry without its event.** The body is appended (durably) before the
//!   entry is created; a crash in between leaves an unreferenced body, which
//!   [`DeadLetterStore::collect_orphan_bodies`] removes at boot.
//! * **A stale owner writes nothing.** The create is fenced by the partition owner's
//!   epoch in the same transaction.
//! * **Meta down is an error, not a loss.** `Unavailable`/`Indeterminate` reach the
//!   caller, which keeps the delivery "dead-lettering" and retries.

mod entry;
pub mod id;
mod index;
mod types;

pub use id::entry_id;
pub use types::{DeadLetterEntry, DeadLetterState};

use crate::codec::key_text;
use crate::failure::StoreFailure;
use crate::log::{BodyRef, DeadLetterBodies, LogError};
use crate::meta_util::{after, commit_at_version, FromMeta, PrefixPages, MAX_CAS_ATTEMPTS};
use crate::tasks::{check_name_reason, is_valid_name};
use crate::time::Timestamp;
use async_trait::async_trait;
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{Compare, KeyValue, Meta, MetaError, RangeOptions, Txn};
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// The store's name in logs and metrics.
const STORE: &str = "deadletters";

/// Failure reasons are cut to this many bytes (at a character boundary): they come
/// from consumers and webhooks, and Meta holds small records only.
pub const MAX_REASON_BYTES: usize = 4096;

/// The largest `limit` of a list.
pub const MAX_LIST_LIMIT: usize = 1000;

/// Keys per Meta range request when scanning the whole ledger.
const SCAN_PAGE: usize = 256;

/// Bodies per `list_bodies` page during orphan collection.
const BODY_PAGE: usize = 1000;

const ENTRIES: &str = "entries";
const IDS: &str = "ids";

impl DeadLetterEntry {
    fn same_delivery(&self, log_id: &str, d: &NewDeadLetter) -> bool {
        self.log_id == log_id
            && self.subscription == d.subscription
            && self.subscription_incarnation == d.subscription_incarnation
            && self.topic == d.topic
            && self.partition == d.partition
            && self.offset == d.offset
    }
}

/// What the caller knows about a delivery it dead-letters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewDeadLetter {
    pub subscription: String,
    /// Tells a re-created subscription of the same name apart (e.g. its Meta
    /// `create_revision`).
    pub subscription_incarnation: i64,
    pub topic: String,
    pub partition: u32,
    pub offset: u64,
    pub attempts: u32,
    /// The last failure (cut to [`MAX_REASON_BYTES`]).
    pub reason: String,
    pub first_attempt_at: Timestamp,
    /// This instance's id.
    pub instance: String,
}

/// The answer of [`DeadLetterStore::dead_letter`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLettered {
    pub entry: DeadLetterEntry,
    /// `false` when the delivery had already been dead-lettered (nothing written).
    pub created: bool,
}

/// One page of entries, in (subscription, id) order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterPage {
    pub entries: Vec<DeadLetterEntry>,
    /// Pass it back as `cursor` for the next page; `None` on the last page.
    pub next_cursor: Option<String>,
}

/// The cursor that continues a listing after `entry` (what `next_cursor` holds when a
/// page ends there; a caller that stops early, e.g. at a byte bound, makes its own).
pub fn cursor_after(entry: &DeadLetterEntry) -> String {
    format!("{}/{}", entry.subscription, entry.id)
}

/// What can go wrong, and what the caller does about it (HTTP status in parentheses).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeadLetterError {
    /// The partition owner's epoch is stale; nothing was written. Drop the partition.
    /// (HTTP 409 fenced)
    #[error("fenced: the owner no longer holds this epoch")]
    Fenced,
    /// No entry with this id. (HTTP 404)
    #[error("dead-letter entry {id} not found")]
    NotFound { id: String },
    /// An entry with this id exists for another delivery (a 128-bit id collision, or
    /// incarnations reused across subscriptions). Nothing was written. (HTTP 409)
    #[error("dead-letter entry {id} already exists for another delivery")]
    ConflictingContent { id: String },
    /// The entry's state forbids the operation (e.g. `redrive_failed` of a `dead`
    /// entry). (HTTP 422)
    #[error("dead-letter entry is {from}: cannot move it to {to}")]
    IllegalTransition {
        from: DeadLetterState,
        to: &'static str,
    },
    /// The entry's body is not in this store's log (deleted, or another log's). (HTTP 500)
    #[error("dead-letter body {body} is missing")]
    BodyMissing { body: BodyRef },
    /// The dead-letter stream of the log failed (its own classification inside).
    #[error("dead-letter stream: {0}")]
    Log(#[from] LogError),
    /// A malformed request. Do not retry. (HTTP 400)
    #[error("invalid dead-letter request: {0}")]
    Invalid(String),
    /// The backend failed; [`StoreFailure`] says what the caller may assume.
    #[error("dead-letter store {0}")]
    Store(#[from] StoreFailure),
}

impl DeadLetterError {
    /// A short, stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Store(f) => f.kind(),
            DeadLetterError::Fenced => "fenced",
            DeadLetterError::NotFound { .. } => "not_found",
            DeadLetterError::ConflictingContent { .. } => "conflicting_content",
            DeadLetterError::IllegalTransition { .. } => "illegal_transition",
            DeadLetterError::BodyMissing { .. } => "body_missing",
            DeadLetterError::Log(_) => "log",
            DeadLetterError::Invalid(_) => "invalid",
        }
    }

    /// Known not applied and safe to retry as is.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            DeadLetterError::Store(StoreFailure::Unavailable(_))
                | DeadLetterError::Log(LogError::Unavailable(_))
        )
    }
}

impl FromMeta for DeadLetterError {
    fn special(e: MetaError) -> Result<Self, MetaError> {
        match e {
            MetaError::Fenced => Ok(DeadLetterError::Fenced),
            e => Err(e),
        }
    }
}

/// The dead-letter store.
///
/// # Durability
///
/// A call that changes an entry returns `Ok` only after Meta acknowledged the write
/// (an etcd quorum commit or an fsync of the embedded backend). `dead_letter` appends
/// the body durably *before* it creates the entry, so an entry always has its event;
/// a crash in between leaves an unreferenced body for `collect_orphan_bodies`.
/// Deleting removes the entry first and the body after, for the same reason.
///
/// # Concurrency
///
/// Any number of callers on any number of instances may call any method at once.
/// Creates are conditional on absence (one entry per delivery, however many callers);
/// every later change is conditional on the version it was decided on and re-decided
/// after a lost race. `collect_orphan_bodies` is the exception: it must not run
/// concurrently with `dead_letter` on the same log (run it at boot, before dispatch),
/// because a body appended but not yet referenced is indistinguishable from an orphan.
///
/// # Errors: what to do
///
/// * `Unavailable`: not applied; retry later. For `dead_letter` nothing remains (the
///   appended body is deleted again); the delivery stays "dead-lettering".
/// * `Indeterminate`: unknown outcome; retry the same call (a dead-letter retry finds
///   the entry if it was written; an orphaned body is collected at boot).
/// * `Fenced`: the owner lost the partition; nothing was written.
/// * `Log(_)`: the dead-letter stream failed; see [`LogError`].
/// * The others describe the request or the entry and are final for this request.
#[async_trait]
pub trait DeadLetterStore: Send + Sync + 'static {
    /// Moves a delivery here on behalf of the partition owner `owner`: appends `body`
    /// to the dead-letter stream, then creates the entry conditional on its absence and
    /// fenced by the owner's epoch (one Meta transaction). When the delivery already has
    /// an entry it is returned with `created == false` and nothing is written.
    async fn dead_letter(
        &self,
        delivery: NewDeadLetter,
        body: &[u8],
        owner: &Ownership,
    ) -> Result<DeadLettered, DeadLetterError>;

    /// Reads one entry by id.
    async fn get(&self, id: &str) -> Result<DeadLetterEntry, DeadLetterError>;

    /// Lists entries (of one subscription, or all), `limit` (1–1000) at a time,
    /// continuing after `cursor` (a `next_cursor` of an earlier page of the same
    /// listing).
    async fn list(
        &self,
        subscription: Option<&str>,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<DeadLetterPage, DeadLetterError>;

    /// The event body of an entry.
    async fn read_body(&self, entry: &DeadLetterEntry) -> Result<Vec<u8>, DeadLetterError>;

    /// Deletes an entry, then its body (a body left behind by a failure there is an
    /// orphan, collected at boot).
    async fn delete(&self, id: &str) -> Result<(), DeadLetterError>;

    /// `dead` → `redriving`. Repeating it while `redriving` changes nothing and returns
    /// the entry.
    async fn redrive(&self, id: &str) -> Result<DeadLetterEntry, DeadLetterError>;

    /// The redriven event was acked: deletes the entry and its body. `NotFound` when it
    /// is already gone (treat as done); `IllegalTransition` unless `redriving`.
    async fn redrive_succeeded(&self, id: &str) -> Result<(), DeadLetterError>;

    /// The redriven event failed `max_attempts` times again: `redriving` → `dead`, with
    /// `redrives` + 1, the new `reason` and `attempts`, and a new `dead_lettered_at`.
    async fn redrive_failed(
        &self,
        id: &str,
        reason: &str,
        attempts: u32,
    ) -> Result<DeadLetterEntry, DeadLetterError>;

    /// Deletes every `dead` entry dead-lettered at least `older_than` ago (conditional
    /// on the version read), then its body. Returns how many entries it deleted.
    async fn expire(&self, older_than: Duration) -> Result<usize, DeadLetterError>;

    /// Deletes the bodies of this store's log that no entry references (left by a
    /// crash between append and create). Returns how many it deleted. Boot only: see
    /// the concurrency section.
    async fn collect_orphan_bodies(&self) -> Result<usize, DeadLetterError>;
}

/// The [`DeadLetterStore`] on Meta, with bodies in one log's dead-letter stream.
pub struct MetaDeadLetterStore {
    /// The ledger: every entry and index record; no cache.
    meta: Arc<dyn Meta>,
    /// This instance's log: bodies are appended here, and entries of this log id have
    /// their bodies read and deleted here.
    bodies: Arc<dyn DeadLetterBodies>,
}

impl MetaDeadLetterStore {
    pub fn new(meta: Arc<dyn Meta>, bodies: Arc<dyn DeadLetterBodies>) -> Self {
        Self { meta, bodies }
    }

    /// The id the entry of `delivery` has (or will have) in this store.
    pub fn id_of(&self, delivery: &NewDeadLetter) -> String {
        entry_id(
            self.bodies.log_id(),
            delivery.subscription_incarnation,
            &delivery.topic,
            delivery.partition,
            delivery.offset,
        )
    }

    fn backend(&self) -> meshd_meta::Backend {
        self.meta.backend()
    }

    fn meta_error(&self, op: &'static str, id: &str, e: MetaError) -> DeadLetterError {
        let err = DeadLetterError::from_meta(e);
        self.log_error(op, id, &err);
        err
    }

    fn log_error(&self, op: &'static str, id: &str, err: &DeadLetterError) {
        match err {
            DeadLetterError::Store(_)
            | DeadLetterError::Fenced
            | DeadLetterError::BodyMissing { .. }
            | DeadLetterError::Log(_) => tracing::warn!(
                store = STORE,
                backend = %self.backend(),
                op,
                entry = id,
                kind = err.kind(),
                error = %err,
                "dead-letter operation failed"
            ),
            _ => tracing::debug!(
                store = STORE,
                backend = %self.backend(),
                op,
                entry = id,
                kind = err.kind(),
                error = %err,
                "dead-letter operation refused"
            ),
        }
    }

    fn corrupt(&self, key: &[u8], id: &str, reason: String) -> DeadLetterError {
        let err = DeadLetterError::Store(StoreFailure::Corrupt {
            key: key_text(key),
            reason,
        });
        self.log_error("decode", id, &err);
        err
    }

    fn decode_entry(&self, kv: &KeyValue) -> Result<DeadLetterEntry, DeadLetterError> {
        match keys::components(KeyKind::DeadLetters, &kv.key).as_deref() {
            Some([kind, subscription, id]) if kind == ENTRIES => {
                entry::decode(subscription, id, &kv.value, kv.mod_revision)
                    .map_err(|reason| self.corrupt(&kv.key, id, reason))
            }
            _ => Err(self.corrupt(
                &kv.key,
                "",
                "not a dead-letter entry key (deadletters/entries/{subscription}/{id})".into(),
            )),
        }
    }

    fn encode_entry(&self, e: &DeadLetterEntry) -> Result<Vec<u8>, DeadLetterError> {
        entry::encode(e).map_err(DeadLetterError::Invalid)
    }

    /// Reads an entry by id; `None` when there is none.
    async fn find(
        &self,
        op: &'static str,
        id: &str,
    ) -> Result<Option<DeadLetterEntry>, DeadLetterError> {
        let ikey = index_key(id);
        let Some(ikv) = self
            .meta
            .get(&ikey)
            .await
            .map_err(|e| self.meta_error(op, id, e))?
            .kv
        else {
            return Ok(None);
        };
        let subscription =
            index::decode(&ikv.value).map_err(|reason| self.corrupt(&ikey, id, reason))?;
        let ekey = entry_key(&subscription, id);
        match self
            .meta
            .get(&ekey)
            .await
            .map_err(|e| self.meta_error(op, id, e))?
            .kv
        {
            Some(kv) => self.decode_entry(&kv).map(Some),
            None => {
                // Entry and index are deleted together: the index is gone too, unless
                // the ledger is damaged.
                let again = self
                    .meta
                    .get(&ikey)
                    .await
                    .map_err(|e| self.meta_error(op, id, e))?;
                match again.kv {
                    Some(kv) if kv.create_revision == ikv.create_revision => Err(self.corrupt(
                        &ikey,
                        id,
                        format!(
                            "index names subscription {subscription:?} but the entry is missing"
                        ),
                    )),
                    // Deleted (or deleted and re-created) in between: report what was
                    // asked about as gone; a caller re-reads for the new one.
                    _ => Ok(None),
                }
            }
        }
    }

    async fn read(&self, op: &'static str, id: &str) -> Result<DeadLetterEntry, DeadLetterError> {
        if !id::is_entry_id(id) {
            return Err(DeadLetterError::Invalid(format!(
                "{id:?} is not a dead-letter entry id (32 lowercase hex digits)"
            )));
        }
        self.find(op, id).await?.ok_or_else(|| {
            let err = DeadLetterError::NotFound { id: id.to_string() };
            self.log_error(op, id, &err);
            err
        })
    }

    /// Writes `next` over `current`, conditional on `current.version`. `Ok(None)`: lost
    /// a race.
    async fn write_over(
        &self,
        op: &'static str,
        current: &DeadLetterEntry,
        mut next: DeadLetterEntry,
    ) -> Result<Option<DeadLetterEntry>, DeadLetterError> {
        let key = entry_key(&current.subscription, &current.id);
        let value = self.encode_entry(&next)?;
        let txn = Txn::new().put(&key, &value);
        match commit_at_version(self.meta.as_ref(), &key, current.version, txn, None).await {
            Ok(Some(revision)) => {
                next.version = revision;
                tracing::info!(
                    store = STORE,
                    backend = %self.backend(),
                    op,
                    entry = %next.id,
                    subscription = %next.subscription,
                    state = %next.state,
                    redrives = next.redrives,
                    "dead-letter entry updated"
                );
                Ok(Some(next))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(self.meta_error(op, &current.id, e)),
        }
    }

    /// Deletes entry and index, conditional on `current.version`. `Ok(false)`: lost a
    /// race.
    async fn remove(
        &self,
        op: &'static str,
        current: &DeadLetterEntry,
    ) -> Result<bool, DeadLetterError> {
        let key = entry_key(&current.subscription, &current.id);
        let txn = Txn::new().delete(&key).delete(&index_key(&current.id));
        match commit_at_version(self.meta.as_ref(), &key, current.version, txn, None).await {
            Ok(Some(_)) => {
                tracing::info!(
                    store = STORE,
                    backend = %self.backend(),
                    op,
                    entry = %current.id,
                    subscription = %current.subscription,
                    "dead-letter entry deleted"
                );
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) => Err(self.meta_error(op, &current.id, e)),
        }
    }

    /// Deletes a body no entry references any more. A failure only leaves an orphan
    /// (collected at boot), so it is logged, not returned.
    async fn discard_body(&self, op: &'static str, id: &str, body: &BodyRef) {
        if body.log_id != self.bodies.log_id() {
            tracing::info!(
                store = STORE,
                backend = %self.backend(),
                op,
                entry = id,
                %body,
                "body is in another log; its owner collects it as an orphan"
            );
            return;
        }
        if let Err(e) = self.bodies.delete_body(body).await {
            tracing::warn!(
                store = STORE,
                backend = %self.backend(),
                op,
                entry = id,
                %body,
                error = %e,
                "deleting a dead-letter body failed; left for orphan collection"
            );
        }
    }

    fn contended(&self, op: &'static str, id: &str) -> DeadLetterError {
        let err = DeadLetterError::Store(StoreFailure::Unavailable(format!(
            "dead-letter entry {id}: lost {MAX_CAS_ATTEMPTS} compare-and-set races in a row"
        )));
        self.log_error(op, id, &err);
        err
    }

    /// Scans every entry of the ledger, page by page.
    async fn scan_all(
        &self,
        op: &'static str,
        mut each: impl FnMut(DeadLetterEntry),
    ) -> Result<(), DeadLetterError> {
        let prefix = keys::prefix(KeyKind::DeadLetters, &[ENTRIES]);
        let mut pages = PrefixPages::new(prefix, None, SCAN_PAGE);
        while let Some(page) = pages
            .next(self.meta.as_ref())
            .await
            .map_err(|e| self.meta_error(op, "", e))?
        {
            for kv in &page.kvs {
                each(self.decode_entry(kv)?);
            }
        }
        Ok(())
    }
}

fn entry_key(subscription: &str, id: &str) -> Vec<u8> {
    keys::key(KeyKind::DeadLetters, &[ENTRIES, subscription, id])
}

fn index_key(id: &str) -> Vec<u8> {
    keys::key(KeyKind::DeadLetters, &[IDS, id])
}

fn truncate_reason(reason: &str) -> String {
    if reason.len() <= MAX_REASON_BYTES {
        return reason.to_string();
    }
    let mut end = MAX_REASON_BYTES;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_string()
}

fn check_name(what: &str, name: &str) -> Result<(), DeadLetterError> {
    check_name_reason(what, name).map_err(DeadLetterError::Invalid)
}

#[async_trait]
impl DeadLetterStore for MetaDeadLetterStore {
    async fn dead_letter(
        &self,
        delivery: NewDeadLetter,
        body: &[u8],
        owner: &Ownership,
    ) -> Result<DeadLettered, DeadLetterError> {
        check_name("subscription", &delivery.subscription)?;
        check_name("topic", &delivery.topic)?;
        if delivery.instance.is_empty() {
            return Err(DeadLetterError::Invalid("empty instance id".into()));
        }
        let log_id = self.bodies.log_id().to_string();
        if log_id.is_empty() {
            return Err(DeadLetterError::Invalid(
                "the dead-letter log has an empty id".into(),
            ));
        }
        let id = self.id_of(&delivery);
        let existing_or_conflict = |existing: DeadLetterEntry| {
            if existing.same_delivery(&log_id, &delivery) {
                Ok(DeadLettered {
                    entry: existing,
                    created: false,
                })
            } else {
                let err = DeadLetterError::ConflictingContent { id: id.clone() };
                self.log_error("dead_letter", &id, &err);
                Err(err)
            }
        };
        // Already moved (a retry after an unknown outcome, or a second mover): nothing
        // to write, and no body to append and delete again.
        if let Some(existing) = self.find("dead_letter", &id).await? {
            return existing_or_conflict(existing);
        }
        // 1. The body, durably, before anything references it.
        let body_ref = self.bodies.append_body(body).await.map_err(|e| {
            let err = DeadLetterError::Log(e);
            self.log_error("dead_letter", &id, &err);
            err
        })?;
        let now = Timestamp::now();
        let mut entry = DeadLetterEntry {
            id: id.clone(),
            log_id: log_id.clone(),
            subscription: delivery.subscription.clone(),
            subscription_incarnation: delivery.subscription_incarnation,
            topic: delivery.topic.clone(),
            partition: delivery.partition,
            offset: delivery.offset,
            body: body_ref.clone(),
            attempts: delivery.attempts,
            reason: truncate_reason(&delivery.reason),
            first_attempt_at: delivery.first_attempt_at,
            dead_lettered_at: now,
            instance: delivery.instance.clone(),
            epoch: owner.epoch(),
            state: DeadLetterState::Dead,
            redrives: 0,
            version: 0,
            kept: Default::default(),
        };
        let ekey = entry_key(&entry.subscription, &id);
        let ikey = index_key(&id);
        let value = self.encode_entry(&entry)?;
        let ivalue = index::encode(&entry.subscription).map_err(DeadLetterError::Invalid)?;
        // 2. The entry and its index, only if absent, only while `owner` holds its epoch.
        // A second round only when the entry that won vanished before it could be read.
        for _ in 0..2 {
            let txn = Txn::new()
                .when(Compare::Absent { key: ikey.clone() })
                .when(Compare::Absent { key: ekey.clone() })
                .put(&ekey, &value)
                .put(&ikey, &ivalue);
            match owner.commit(self.meta.as_ref(), txn).await {
                Ok(r) => {
                    entry.version = r.revision;
                    tracing::info!(
                        store = STORE,
                        backend = %self.backend(),
                        entry = %id,
                        subscription = %entry.subscription,
                        topic = %entry.topic,
                        partition = entry.partition,
                        offset = entry.offset,
                        attempts = entry.attempts,
                        body = %entry.body,
                        epoch = entry.epoch,
                        "delivery dead-lettered"
                    );
                    return Ok(DeadLettered {
                        entry,
                        created: true,
                    });
                }
                Err(MetaError::Conflict { .. }) => {
                    // Another mover won: its entry references its own body.
                    if let Some(existing) = self.find("dead_letter", &id).await? {
                        self.discard_body("dead_letter", &id, &body_ref).await;
                        return existing_or_conflict(existing);
                    }
                }
                Err(e) => {
                    let err = self.meta_error("dead_letter", &id, e);
                    match err {
                        // Known not applied: the body is unreferenced.
                        DeadLetterError::Store(StoreFailure::Unavailable(_))
                        | DeadLetterError::Fenced => {
                            self.discard_body("dead_letter", &id, &body_ref).await
                        }
                        // Possibly applied: the entry may reference it. Anything left
                        // unreferenced is collected at boot.
                        _ => {}
                    }
                    return Err(err);
                }
            }
        }
        self.discard_body("dead_letter", &id, &body_ref).await;
        Err(self.contended("dead_letter", &id))
    }

    async fn get(&self, id: &str) -> Result<DeadLetterEntry, DeadLetterError> {
        self.read("get", id).await
    }

    async fn list(
        &self,
        subscription: Option<&str>,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<DeadLetterPage, DeadLetterError> {
        if !(1..=MAX_LIST_LIMIT).contains(&limit) {
            return Err(DeadLetterError::Invalid(format!(
                "limit {limit} is not 1-{MAX_LIST_LIMIT}"
            )));
        }
        if let Some(s) = subscription {
            check_name("subscription", s)?;
        }
        let prefix = match subscription {
            Some(s) => keys::prefix(KeyKind::DeadLetters, &[ENTRIES, s]),
            None => keys::prefix(KeyKind::DeadLetters, &[ENTRIES]),
        };
        // A cursor is `{subscription}/{id}` of the last entry of the previous page.
        let start = match cursor {
            None => None,
            Some(c) => {
                let bad = || DeadLetterError::Invalid(format!("malformed cursor {c:?}"));
                let (sub, id) = c.split_once('/').ok_or_else(bad)?;
                if !is_valid_name(sub) || !id::is_entry_id(id) {
                    return Err(bad());
                }
                let key = entry_key(sub, id);
                if !key.starts_with(&prefix) {
                    return Err(bad());
                }
                Some(after(key))
            }
        };
        let page = self
            .meta
            .range(&prefix, RangeOptions { start, limit })
            .await
            .map_err(|e| self.meta_error("list", "", e))?;
        let entries = page
            .kvs
            .iter()
            .map(|kv| self.decode_entry(kv))
            .collect::<Result<Vec<_>, _>>()?;
        let next_cursor = match entries.last() {
            Some(last) if page.more => Some(cursor_after(last)),
            _ => None,
        };
        Ok(DeadLetterPage {
            entries,
            next_cursor,
        })
    }

    async fn read_body(&self, entry: &DeadLetterEntry) -> Result<Vec<u8>, DeadLetterError> {
        let missing = || {
            let err = DeadLetterError::BodyMissing {
                body: entry.body.clone(),
            };
            self.log_error("read_body", &entry.id, &err);
            err
        };
        if entry.body.log_id != self.bodies.log_id() {
            return Err(missing());
        }
        match self.bodies.read_body(&entry.body).await {
            Ok(Some(body)) => Ok(body),
            Ok(None) => Err(missing()),
            Err(e) => {
                let err = DeadLetterError::Log(e);
                self.log_error("read_body", &entry.id, &err);
                Err(err)
            }
        }
    }

    async fn delete(&self, id: &str) -> Result<(), DeadLetterError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let current = self.read("delete", id).await?;
            if self.remove("delete", &current).await? {
                self.discard_body("delete", id, &current.body).await;
                return Ok(());
            }
        }
        Err(self.contended("delete", id))
    }

    async fn redrive(&self, id: &str) -> Result<DeadLetterEntry, DeadLetterError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let current = self.read("redrive", id).await?;
            if current.state == DeadLetterState::Redriving {
                return Ok(current);
            }
            let mut next = current.clone();
            next.state = DeadLetterState::Redriving;
            if let Some(done) = self.write_over("redrive", &current, next).await? {
                return Ok(done);
            }
        }
        Err(self.contended("redrive", id))
    }

    async fn redrive_succeeded(&self, id: &str) -> Result<(), DeadLetterError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let current = self.read("redrive_succeeded", id).await?;
            if current.state != DeadLetterState::Redriving {
                let err = DeadLetterError::IllegalTransition {
                    from: current.state,
                    to: "deleted (redrive succeeded)",
                };
                self.log_error("redrive_succeeded", id, &err);
                return Err(err);
            }
            if self.remove("redrive_succeeded", &current).await? {
                self.discard_body("redrive_succeeded", id, &current.body)
                    .await;
                return Ok(());
            }
        }
        Err(self.contended("redrive_succeeded", id))
    }

    async fn redrive_failed(
        &self,
        id: &str,
        reason: &str,
        attempts: u32,
    ) -> Result<DeadLetterEntry, DeadLetterError> {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let current = self.read("redrive_failed", id).await?;
            if current.state != DeadLetterState::Redriving {
                let err = DeadLetterError::IllegalTransition {
                    from: current.state,
                    to: "dead (redrive failed)",
                };
                self.log_error("redrive_failed", id, &err);
                return Err(err);
            }
            let mut next = current.clone();
            next.state = DeadLetterState::Dead;
            next.redrives = current.redrives.saturating_add(1);
            next.reason = truncate_reason(reason);
            next.attempts = attempts;
            next.dead_lettered_at = Timestamp::now();
            if let Some(done) = self.write_over("redrive_failed", &current, next).await? {
                return Ok(done);
            }
        }
        Err(self.contended("redrive_failed", id))
    }

    async fn expire(&self, older_than: Duration) -> Result<usize, DeadLetterError> {
        let cutoff = Timestamp::now().saturating_sub(older_than);
        let mut candidates = Vec::new();
        self.scan_all("expire", |e| {
            if e.state == DeadLetterState::Dead && e.dead_lettered_at <= cutoff {
                candidates.push(e);
            }
        })
        .await?;
        let mut deleted = 0;
        for e in candidates {
            // A lost race means it changed (e.g. a redrive started): keep it.
            if self.remove("expire", &e).await? {
                self.discard_body("expire", &e.id, &e.body).await;
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    async fn collect_orphan_bodies(&self) -> Result<usize, DeadLetterError> {
        let log_id = self.bodies.log_id().to_string();
        let mut referenced = HashSet::new();
        self.scan_all("collect_orphan_bodies", |e| {
            if e.body.log_id == log_id {
                referenced.insert(e.body.seq);
            }
        })
        .await?;
        let mut after_seq = None;
        let mut deleted = 0;
        loop {
            let page = self
                .bodies
                .list_bodies(after_seq, BODY_PAGE)
                .await
                .map_err(DeadLetterError::Log)?;
            for body in &page {
                if body.log_id == log_id && !referenced.contains(&body.seq) {
                    self.bodies
                        .delete_body(body)
                        .await
                        .map_err(DeadLetterError::Log)?;
                    deleted += 1;
                    tracing::info!(
                        store = STORE,
                        backend = %self.backend(),
                        %body,
                        "orphaned dead-letter body deleted"
                    );
                }
            }
            match page.last() {
                Some(last) if page.len() == BODY_PAGE => after_seq = Some(last.seq),
                _ => return Ok(deleted),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_and_index_keys_cannot_collide_whatever_the_subscription_is_called() {
        let id = entry_id("log", 1, "t", 0, 0);
        // A subscription called "ids" lists below entries/, never among the index keys.
        let as_entry = entry_key(IDS, &id);
        assert!(as_entry.starts_with(&keys::prefix(KeyKind::DeadLetters, &[ENTRIES])));
        assert!(!as_entry.starts_with(&keys::prefix(KeyKind::DeadLetters, &[IDS])));
        assert_eq!(
            String::from_utf8(entry_key("billing", &id)).unwrap(),
            format!("meshd/v1/deadletters/entries/billing/{id}")
        );
        assert_eq!(
            String::from_utf8(index_key(&id)).unwrap(),
            format!("meshd/v1/deadletters/ids/{id}")
        );
        // One subscription's prefix does not cover another's that extends its name.
        assert!(!entry_key("billing2", &id)
            .starts_with(&keys::prefix(KeyKind::DeadLetters, &[ENTRIES, "billing"])));
    }

    #[test]
    fn reasons_are_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_REASON_BYTES);
        let cut = truncate_reason(&long);
        assert!(cut.len() <= MAX_REASON_BYTES);
        assert!(cut.len() >= MAX_REASON_BYTES - 1);
        assert_eq!(truncate_reason("short"), "short");
    }
}

/// Fuzzing the dead-letter records (docs/fuzzing.md): an entry or an
/// id index record read back from Meta decodes exactly or is corrupt, never a panic.
/// Valid entries are mutated member by member (removed, replaced by any JSON value,
/// joined by strangers) so the cases get past the version probe and the id check.
#[cfg(test)]
mod fuzz {
    use super::*;
    use meshd_fuzz_cases::cases;
    use proptest::prelude::*;
    use serde_json::Value;

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (0u64..3).prop_map(Value::from),
            Just(Value::from(1.5)),
            prop::sample::select(vec![
                "dead",
                "redriving",
                "2025-01-02T03:04:05.678Z",
                "",
                "b"
            ])
            .prop_map(Value::from),
            ".{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(2, 12, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
                prop::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn entry() -> impl Strategy<Value = DeadLetterEntry> {
        (
            (
                "[a-z0-9-]{1,6}",
                any::<i64>(),
                "[a-z]{1,6}",
                any::<u32>(),
                any::<u64>(),
            ),
            (
                any::<u64>(),
                1u32..,
                ".{0,12}",
                0i64..253_402_300_799_999,
                any::<i64>(),
            ),
            (any::<bool>(), any::<u32>(), any::<i64>()),
        )
            .prop_map(
                |(
                    (log_id, inc, topic, partition, offset),
                    (seq, attempts, reason, at, epoch),
                    (redriving, redrives, version),
                )| {
                    DeadLetterEntry {
                        id: id::entry_id(&log_id, inc, &topic, partition, offset),
                        log_id: log_id.clone(),
                        subscription: "b".into(),
                        subscription_incarnation: inc,
                        topic,
                        partition,
                        offset,
                        body: BodyRef { log_id, seq },
                        attempts,
                        reason,
                        first_attempt_at: Timestamp::from_millis(at).unwrap(),
                        dead_lettered_at: Timestamp::from_millis(at).unwrap(),
                        instance: "i".into(),
                        epoch,
                        state: if redriving {
                            DeadLetterState::Redriving
                        } else {
                            DeadLetterState::Dead
                        },
                        redrives,
                        version,
                        kept: Default::default(),
                    }
                },
            )
    }

    /// Edits to a record object: remove a member, replace it, add a stranger, or
    /// edit one member of a nested object.
    fn edit(
        object: &mut serde_json::Map<String, Value>,
        at: prop::sample::Index,
        how: u8,
        v: Value,
    ) {
        let keys: Vec<String> = object.keys().cloned().collect();
        if keys.is_empty() {
            return;
        }
        let k = keys[at.index(keys.len())].clone();
        match how % 4 {
            0 => {
                object.remove(&k);
            }
            1 => {
                object.insert(k, v);
            }
            2 => {
                object.insert(format!("{k}_x"), v);
            }
            _ => {
                if let Some(Value::Object(inner)) = object.get_mut(&k) {
                    edit(inner, at, how / 4, v);
                }
            }
        }
    }

    fn mutated(
        e: &DeadLetterEntry,
        edits: Vec<(prop::sample::Index, u8, Value)>,
        cut: Option<prop::sample::Index>,
    ) -> Vec<u8> {
        let mut v: Value = serde_json::from_slice(&entry::encode(e).unwrap()).unwrap();
        for (at, how, value) in edits {
            if let Value::Object(o) = &mut v {
                edit(o, at, how, value);
            }
        }
        let b = serde_json::to_vec(&v).unwrap();
        match cut {
            Some(at) => b[..at.index(b.len() + 1)].to_vec(),
            None => b,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn entry_record_decode(
            e in entry(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), json()), 0..4),
            cut in proptest::option::weighted(0.2, any::<prop::sample::Index>()),
            garbage in prop::collection::vec(any::<u8>(), 0..32),
            use_garbage in proptest::bool::weighted(0.1),
        ) {
            let bytes = if use_garbage { garbage } else { mutated(&e, edits, cut) };
            if let Ok(d) = entry::decode("b", &e.id, &bytes, 5) {
                prop_assert_eq!(&d.id, &e.id);
                prop_assert_eq!(d.version, 5);
                let again = entry::encode(&d).unwrap();
                prop_assert_eq!(entry::decode("b", &e.id, &again, 5), Ok(d));
            }
        }

        #[test]
        fn index_record_decode(
            subscription in ".{0,8}",
            noise in prop::collection::vec(("[a-z]{1,12}", json()), 0..3),
            garbage in prop::collection::vec(any::<u8>(), 0..32),
            use_garbage in proptest::bool::weighted(0.2),
        ) {
            let bytes = if use_garbage {
                garbage
            } else {
                let mut v: Value = serde_json::from_slice(&index::encode(&subscription).unwrap()).unwrap();
                for (k, n) in noise {
                    v[k] = n;
                }
                serde_json::to_vec(&v).unwrap()
            };
            if let Ok(s) = index::decode(&bytes) {
                prop_assert!(!s.is_empty());
                prop_assert_eq!(index::decode(&index::encode(&s).unwrap()), Ok(s));
            }
        }
    }
}
