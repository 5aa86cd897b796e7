//! # The attempt ledger: in-flight deliveries of a partition, in Meta
//!
//! In cluster mode a partition moves between instances, and its delivery records
//! (Local, per instance) do not move with it. So that a move or a takeover neither
//! resets an attempt count, nor lets a poison event be delivered more than
//! `max_attempts` times in all, nor cuts a consumer's lease short, the owner of a
//! partition writes every delivery it hands out (offset, attempt, lease deadline,
//! session) to Meta *before* the hand-out, fenced by its owner epoch. A new owner
//! [`load`](AttemptLedger::load)s the ledger on acquisition, keeps every deadline and
//! rebuilds every delivery id (they are MACs over these fields), so an ack of the
//! current attempt is honoured whichever instance handed it out.
//!
//! ## Writes proportional to what changed (version 2)
//!
//! Version 1 kept the whole in-flight map in one key, rewritten on every pull batch:
//! with 500 deliveries in flight each pull of one event wrote ~3 KB to etcd's history.
//! Version 2 is a log of small records, one key per write:
//!
//! * `meshd/v1/attempts/{subscription}/{incarnation}/{topic}/{partition}` (the head):
//!   `{"v":2,"layout":"records"}`, written with the first record. A release that
//!   knows only version 1 reads this key, finds version 2 and refuses the partition
//!   by name ("unknown attempt ledger record version 2"), never misreads it as empty.
//! * `…/{partition}/r/{seq:020}`: one record per pull batch (or extend) with the
//!   deliveries it started,
//!   `{"v":2,"d":[[offset,attempt,deadline_ms],…],"e":epoch,"i":"instance"}`, a bound
//!   delivery followed by its session id and epoch, `e` and `i` the writing owner's
//!   epoch and instance (so etcd's history says whose tenure each record belongs
//!   to). `e` and `i` are
//!   written only while every member runs 0.2.0 or later
//!   ([`LedgerWrite::with_owner_epoch`]): 0.1.0 refuses a field it does not know as
//!   corrupt; this release reads records with and without it. The record with the
//!   highest `seq` that names an offset is that offset's current state.
//!
//! A pull batch is one fenced transaction: one put of its record, plus the deletion
//! of at most [`PRUNE_MAX`] records that no longer hold a current entry (every offset
//! they name was superseded by a later record or carried by a checkpoint).
//! [`LedgerState`] is the owner's bookkeeping of which record holds what. So the
//! bytes written per batch follow the batch, not what is in flight, and the number of
//! records in Meta never exceeds the number of deliveries in flight plus the acked
//! and dead-lettered offsets no checkpoint carries yet plus the garbage awaiting its
//! prune.
//!
//! What leaves the ledger when:
//!
//! * an **acked** delivery once a checkpoint carries it (below the committed offset
//!   or among the resolved offsets above it): a move before that delivers it again
//!   (at-least-once, a duplicate bounded by `--checkpoint-ms`) with its next attempt,
//!   never with the attempt (and delivery id) it was acked at;
//! * a **dead-lettered** one only once a checkpoint passed its offset, so a new owner
//!   that does not know it was dead-lettered still finds its last attempt and
//!   dead-letters it (the store finds the entry) instead of starting again at 1;
//! * a nacked or timed-out one stays (its count matters) until its next attempt's
//!   record supersedes it.
//!
//! Offsets that were never handed out (filtered, and later parked) have no entry:
//! nothing assumes that everything below a high-water mark went out.
//!
//! Decoding is strict: another version, a missing field, offsets out of
//! order or repeated, an attempt of 0, an empty record, or anything after the record
//! is corrupt, never guessed at. A version-1 head is still read (its map becomes the
//! first record, due at once, on the first acquisition by this release).
//!
//! ## The failures this module is built against
//!
//! Each is pinned by a test in `crates/stores/tests/attempts.rs` on both Meta backends.
//!
//! * **A stale owner writes nothing.** Every write is one transaction with the fence
//!   compare on the owner key.
//! * **Meta down is an error, not a reset.** `Unavailable` (not applied, retry) and
//!   `Indeterminate` (maybe applied) reach the caller, which does not hand the batch
//!   out; a transaction is never half-applied.
//! * **A damaged record is reported.** `load` returns `Corrupt { key, reason }`
//!   rather than leaving the record out, which would reset its counts.

use crate::codec::{decode_named, key_text};
use crate::delivery::SessionBinding;
use crate::failure::StoreFailure;
use crate::meta_util::FromMeta;
use crate::offsets::OffsetKey;
use crate::tasks::check_name_reason;
use async_trait::async_trait;
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{Meta, MetaError, RangeOptions, Txn};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// The store's name in logs and metrics.
const STORE: &str = "attempts";

/// The record version this module writes.
pub const VERSION: u64 = 2;

/// The version-1 record (one whole map per partition), still read on acquisition.
pub const VERSION_1: u64 = 1;

/// The most in-flight offsets one partition's ledger holds (version 1: in its one
/// record; version 2: in all its records together, which a new owner reads whole).
pub const MAX_ENTRIES: usize = 10_000;

/// The largest version-1 record [`MAX_ENTRIES`] entries can encode to:
/// `{"v":1,"attempts":[` + `[{20 digits},{10 digits}]` per entry, comma-separated, +
/// `]}`. A unit test checks it against the encoder and against etcd's 1.5 MiB limit.
pub const MAX_RECORD_BYTES: usize = 19 + MAX_ENTRIES * 34 - 1 + 2;

/// The most entries in one version-2 record. The largest entry (20-digit numbers and
/// a session id of 256 bytes) is under 340 bytes, so a record stays under 350 KB,
/// well inside etcd's 1.5 MiB request limit; the caller splits larger batches.
pub const MAX_RECORD_ENTRIES: usize = 1_000;

/// The most new entries the owner puts in one record: the rest of a record's room
/// ([`MAX_RECORD_ENTRIES`] minus this) is kept for entries it carries over from
/// sparse records (see [`LedgerState::stage`]), so compaction keeps up even when
/// every pull fills a record.
pub const RECORD_FRESH_ENTRIES: usize = MAX_RECORD_ENTRIES * 3 / 4;

/// The most entries (current or not) a new owner reads from one partition's records.
/// A record stays in Meta while any of its entries is current; [`LedgerState::stage`]
/// carries the current entries of records at most half current into the next
/// record, so what is stored stays within about twice the current entries (at most
/// [`MAX_ENTRIES`]) plus records waiting to be pruned.
pub const MAX_LOADED_ENTRIES: usize = MAX_ENTRIES * 4;

/// The most records one write deletes besides its own put (etcd allows 128
/// operations per transaction by default); the rest wait for the next write.
pub const PRUNE_MAX: usize = 32;

/// Keys deleted per transaction by `drop_subscription` and `clear`.
const DROP_PAGE: usize = 64;

/// What can go wrong, and what the caller does about it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AttemptError {
    /// The owner's epoch is stale (the partition was taken over); nothing was written.
    /// Drop the partition.
    #[error("fenced: the owner no longer holds this epoch")]
    Fenced,
    /// Too many offsets: a record above [`MAX_RECORD_ENTRIES`], a version-1 map or a
    /// ledger above [`MAX_ENTRIES`]; nothing was written.
    #[error("attempt ledger of {entries} in-flight offsets exceeds the cap of {max}")]
    TooLarge { entries: usize, max: usize },
    /// A malformed request (a name that is not a valid name, an attempt of 0). Do not
    /// retry.
    #[error("invalid attempt ledger request: {0}")]
    Invalid(String),
    /// The backend failed; [`StoreFailure`] says what the caller may assume.
    #[error("attempt ledger {0}")]
    Store(#[from] StoreFailure),
}

impl AttemptError {
    /// A short, stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Store(f) => f.kind(),
            AttemptError::Fenced => "fenced",
            AttemptError::TooLarge { .. } => "too_large",
            AttemptError::Invalid(_) => "invalid",
        }
    }

    /// Known not applied and safe to retry as is.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Store(f) if f.is_retryable())
    }
}

impl FromMeta for AttemptError {
    fn special(e: MetaError) -> Result<Self, MetaError> {
        match e {
            MetaError::Fenced => Ok(AttemptError::Fenced),
            e => Err(e),
        }
    }
}

/// One delivery in flight, as the ledger records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LedgerEntry {
    pub offset: u64,
    /// The attempt handed out (at least 1).
    pub attempt: u32,
    /// Unix ms at which its lease ends (after an extend: the extended end).
    pub deadline_ms: u64,
    /// The session the attempt is bound to, if any.
    pub session: Option<SessionBinding>,
}

/// One fenced write: the head (when this ledger has none of version 2 yet), a record,
/// and records to delete.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct LedgerWrite {
    pub head: bool,
    pub record: Option<(u64, Vec<LedgerEntry>)>,
    pub prune: Vec<u64>,
    /// Whether the record carries the writing owner's epoch and instance (`"e"`,
    /// `"i"`). Only once every
    /// member runs a release that reads it: 0.1.0 refuses a record with a field it
    /// does not know as corrupt, and would refuse the partition on a takeover.
    pub with_owner_epoch: bool,
}

impl LedgerWrite {
    pub fn is_empty(&self) -> bool {
        !self.head && self.record.is_none() && self.prune.is_empty()
    }
}

/// What a partition's ledger holds.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Loaded {
    /// The head's version: `None` without a head, 1 for a version-1 map (its entries
    /// are in `v1`), 2 for the record log.
    pub head: Option<u64>,
    /// A version-1 head's map (offset → attempt).
    pub v1: BTreeMap<u64, u32>,
    /// The version-2 records, by ascending `seq`.
    pub records: Vec<(u64, Vec<LedgerEntry>)>,
}

/// The attempt ledger: per (subscription incarnation, topic, partition), the
/// deliveries in flight, in Meta.
///
/// # Durability
///
/// `write` returns `Ok` only after Meta acknowledged it (an etcd quorum commit or an
/// fsync of the embedded backend), so the caller hands out a batch only after its
/// attempts are durable in Meta.
///
/// # Concurrency
///
/// One writer per partition: the partition's owner, which serialises its own calls.
/// Writers of different owners are ordered by the fence: after a takeover only the
/// new owner's writes are applied, so a `load` made after acquiring the partition sees
/// the previous owner's last applied write, and no later one.
///
/// # Errors: what to do
///
/// * `Unavailable`: not applied; do not hand out, retry later.
/// * `Indeterminate`: unknown outcome; do not hand out; drop the partition and
///   re-acquire (the load then tells).
/// * `Fenced`: the partition was taken over; nothing was written; drop it.
/// * `TooLarge`, `Invalid`: the request is wrong; nothing was written.
/// * `Corrupt`: the stored ledger is damaged; the partition must not be served from a
///   guess (an operator deletes the key: attempt counts then restart at 0).
#[async_trait]
pub trait AttemptLedger: Send + Sync + 'static {
    /// Applies `w` in one Meta transaction fenced by `owner`'s epoch: puts the head
    /// (replacing a version-1 map), puts the record, deletes the pruned records.
    async fn write(
        &self,
        key: &OffsetKey,
        owner: &Ownership,
        w: &LedgerWrite,
    ) -> Result<(), AttemptError>;

    /// The partition's ledger as last written; empty when there is none.
    async fn load(&self, key: &OffsetKey) -> Result<Loaded, AttemptError>;

    /// Deletes the partition's whole ledger (an offset reset), fenced, in
    /// transactions of up to 64 keys: a failure may leave some records behind.
    async fn clear(&self, key: &OffsetKey, owner: &Ownership) -> Result<(), AttemptError>;

    /// Deletes every ledger of a subscription incarnation (the subscription was
    /// deleted), unfenced. In transactions of up to 64 keys, so a failure may leave
    /// some ledgers behind: repeat the call (it is idempotent).
    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), AttemptError>;
}

/// The [`AttemptLedger`] on Meta. No cache: the owner keeps its [`LedgerState`], and
/// reads happen once per acquisition.
pub struct MetaAttemptLedger {
    meta: Arc<dyn Meta>,
}

impl MetaAttemptLedger {
    pub fn new(meta: Arc<dyn Meta>) -> Self {
        Self { meta }
    }

    fn backend(&self) -> meshd_meta::Backend {
        self.meta.backend()
    }

    fn meta_error(&self, op: &'static str, what: &str, e: MetaError) -> AttemptError {
        let err = AttemptError::from_meta(e);
        self.log_error(op, what, &err);
        err
    }

    fn log_error(&self, op: &'static str, what: &str, err: &AttemptError) {
        match err {
            AttemptError::TooLarge { .. } | AttemptError::Invalid(_) => tracing::debug!(
                store = STORE,
                backend = %self.backend(),
                op,
                ledger = what,
                kind = err.kind(),
                error = %err,
                "attempt ledger request refused"
            ),
            _ => tracing::warn!(
                store = STORE,
                backend = %self.backend(),
                op,
                ledger = what,
                kind = err.kind(),
                error = %err,
                "attempt ledger operation failed"
            ),
        }
    }

    fn refuse(&self, op: &'static str, what: &str, err: AttemptError) -> AttemptError {
        self.log_error(op, what, &err);
        err
    }
}

fn partition_components(key: &OffsetKey) -> [String; 4] {
    [
        key.subscription.clone(),
        key.incarnation.to_string(),
        key.topic.clone(),
        key.partition.to_string(),
    ]
}

/// The Meta key of a partition's ledger head:
/// `meshd/v1/attempts/{subscription}/{incarnation}/{topic}/{partition}` (where
/// version 1 kept its whole map).
pub fn ledger_key(key: &OffsetKey) -> Vec<u8> {
    let c = partition_components(key);
    keys::key(KeyKind::Attempts, &[&c[0], &c[1], &c[2], &c[3]])
}

/// The Meta key of record `seq`: `…/{partition}/r/{seq:020}` (zero-padded, so key
/// order is `seq` order).
pub fn record_key(key: &OffsetKey, seq: u64) -> Vec<u8> {
    let c = partition_components(key);
    keys::key(
        KeyKind::Attempts,
        &[&c[0], &c[1], &c[2], &c[3], "r", &format!("{seq:020}")],
    )
}

/// The prefix of every record of one partition.
pub fn records_prefix(key: &OffsetKey) -> Vec<u8> {
    let c = partition_components(key);
    keys::prefix(KeyKind::Attempts, &[&c[0], &c[1], &c[2], &c[3], "r"])
}

/// The prefix of every ledger of one subscription incarnation (ends with `/`, so
/// incarnation 1 does not cover incarnation 12).
pub fn incarnation_prefix(subscription: &str, incarnation: i64) -> Vec<u8> {
    keys::prefix(KeyKind::Attempts, &[subscription, &incarnation.to_string()])
}

fn check_key(key: &OffsetKey) -> Result<(), AttemptError> {
    check_name_reason("subscription", &key.subscription).map_err(AttemptError::Invalid)?;
    check_name_reason("topic", &key.topic).map_err(AttemptError::Invalid)
}

/// What the ledger of `key` is called in logs.
fn describe(key: &OffsetKey) -> String {
    format!(
        "{}/{}/{}/{}",
        key.subscription, key.incarnation, key.topic, key.partition
    )
}

/// The head record of version 2.
pub const HEAD: &[u8] = br#"{"v":2,"layout":"records"}"#;

#[async_trait]
impl AttemptLedger for MetaAttemptLedger {
    async fn write(
        &self,
        key: &OffsetKey,
        owner: &Ownership,
        w: &LedgerWrite,
    ) -> Result<(), AttemptError> {
        let what = describe(key);
        check_key(key).map_err(|e| self.refuse("write", &what, e))?;
        if w.is_empty() {
            return Ok(());
        }
        if w.prune.len() > PRUNE_MAX {
            return Err(self.refuse(
                "write",
                &what,
                AttemptError::Invalid(format!(
                    "{} records pruned in one write (at most {PRUNE_MAX})",
                    w.prune.len()
                )),
            ));
        }
        let mut txn = Txn::new();
        if w.head {
            txn = txn.put(&ledger_key(key), HEAD);
        }
        let mut bytes = 0;
        if let Some((seq, entries)) = &w.record {
            let writer = (owner.epoch(), owner.holder_text());
            let value = encode_record(entries, w.with_owner_epoch.then_some(writer))
                .map_err(|e| self.refuse("write", &what, e))?;
            bytes = value.len();
            txn = txn.put(&record_key(key, *seq), &value);
        }
        for seq in &w.prune {
            if w.record.as_ref().is_some_and(|(s, _)| s == seq) {
                continue;
            }
            txn = txn.delete(&record_key(key, *seq));
        }
        owner
            .commit(self.meta.as_ref(), txn)
            .await
            .map_err(|e| self.meta_error("write", &what, e))?;
        tracing::debug!(
            store = STORE,
            backend = %self.backend(),
            ledger = %what,
            epoch = owner.epoch(),
            record = ?w.record.as_ref().map(|(s, e)| (s, e.len())),
            bytes,
            pruned = w.prune.len(),
            "attempt ledger written"
        );
        Ok(())
    }

    async fn load(&self, key: &OffsetKey) -> Result<Loaded, AttemptError> {
        let what = describe(key);
        check_key(key).map_err(|e| self.refuse("load", &what, e))?;
        let head_key = ledger_key(key);
        let got = self
            .meta
            .get(&head_key)
            .await
            .map_err(|e| self.meta_error("load", &what, e))?;
        let corrupt = |k: &[u8], reason: String| {
            AttemptError::Store(StoreFailure::Corrupt {
                key: key_text(k),
                reason,
            })
        };
        let mut loaded = Loaded::default();
        if let Some(kv) = got.kv {
            match decode_head(&kv.value) {
                Ok(Head::V1(map)) => {
                    loaded.head = Some(VERSION_1);
                    loaded.v1 = map;
                }
                Ok(Head::V2) => loaded.head = Some(VERSION),
                Err(reason) => return Err(self.refuse("load", &what, corrupt(&head_key, reason))),
            }
        }
        let prefix = records_prefix(key);
        let mut start = None;
        let mut total = loaded.v1.len();
        loop {
            let page = self
                .meta
                .range(
                    &prefix,
                    RangeOptions {
                        start: start.clone(),
                        limit: 512,
                    },
                )
                .await
                .map_err(|e| self.meta_error("load", &what, e))?;
            for kv in &page.kvs {
                let seq = std::str::from_utf8(&kv.key[prefix.len()..])
                    .ok()
                    .filter(|s| s.len() == 20)
                    .and_then(|s| s.parse::<u64>().ok())
                    .ok_or_else(|| {
                        self.refuse(
                            "load",
                            &what,
                            corrupt(&kv.key, "not an attempt ledger record key".into()),
                        )
                    })?;
                let entries = decode_record(&kv.value)
                    .map_err(|reason| self.refuse("load", &what, corrupt(&kv.key, reason)))?;
                total += entries.len();
                loaded.records.push((seq, entries));
            }
            if !page.more {
                break;
            }
            match page.kvs.last() {
                Some(kv) => {
                    let mut next = kv.key.clone();
                    next.push(0);
                    start = Some(next);
                }
                None => break,
            }
        }
        if !loaded.records.is_empty() && loaded.head != Some(VERSION) {
            return Err(self.refuse(
                "load",
                &what,
                corrupt(
                    &head_key,
                    format!(
                        "attempt ledger records without a version-2 head (head: {:?})",
                        loaded.head
                    ),
                ),
            ));
        }
        if total > MAX_LOADED_ENTRIES {
            // Records may repeat an offset (superseded or carried entries), hence the
            // slack over MAX_ENTRIES.
            return Err(self.refuse(
                "load",
                &what,
                AttemptError::TooLarge {
                    entries: total,
                    max: MAX_LOADED_ENTRIES,
                },
            ));
        }
        Ok(loaded)
    }

    async fn clear(&self, key: &OffsetKey, owner: &Ownership) -> Result<(), AttemptError> {
        let what = describe(key);
        check_key(key).map_err(|e| self.refuse("clear", &what, e))?;
        let prefix = records_prefix(key);
        loop {
            let page = self
                .meta
                .range(
                    &prefix,
                    RangeOptions {
                        start: None,
                        limit: DROP_PAGE,
                    },
                )
                .await
                .map_err(|e| self.meta_error("clear", &what, e))?;
            if page.kvs.is_empty() {
                break;
            }
            let txn = page.kvs.iter().fold(Txn::new(), |t, kv| t.delete(&kv.key));
            owner
                .commit(self.meta.as_ref(), txn)
                .await
                .map_err(|e| self.meta_error("clear", &what, e))?;
        }
        owner
            .commit(self.meta.as_ref(), Txn::new().delete(&ledger_key(key)))
            .await
            .map_err(|e| self.meta_error("clear", &what, e))?;
        Ok(())
    }

    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), AttemptError> {
        let what = format!("{subscription}/{incarnation}");
        check_name_reason("subscription", subscription)
            .map_err(|e| self.refuse("drop_subscription", &what, AttemptError::Invalid(e)))?;
        let deleted = crate::meta_util::delete_prefix(
            self.meta.as_ref(),
            incarnation_prefix(subscription, incarnation),
            DROP_PAGE,
        )
        .await
        .map_err(|e| self.meta_error("drop_subscription", &what, e))?;
        tracing::info!(
            store = STORE,
            backend = %self.backend(),
            subscription,
            incarnation,
            deleted,
            "attempt ledgers of a deleted subscription dropped"
        );
        Ok(())
    }
}

// ---------------------------------------------------------------------------------
// The owner's bookkeeping
// ---------------------------------------------------------------------------------

/// The owner's view of its partition's ledger: the current entry of every offset and
/// which record holds it, so each write puts one record and prunes the records that
/// hold nothing current any more. Pure data, no I/O: [`LedgerState::stage`] builds a
/// write, [`LedgerState::applied`] records that Meta took it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerState {
    /// The head of version 2 is in Meta.
    head: bool,
    next_seq: u64,
    /// offset → (seq of the record holding its current entry, the entry).
    current: BTreeMap<u64, (u64, LedgerEntry)>,
    /// seq → current entries it holds (records in Meta with at least one).
    live: BTreeMap<u64, usize>,
    /// Records in Meta that hold no current entry: deleted by the next writes.
    garbage: BTreeSet<u64>,
    /// seq → entries the record holds in Meta, current or not (what a new owner
    /// reads), for every record in Meta.
    sizes: BTreeMap<u64, usize>,
}

impl LedgerState {
    /// The state of a partition just acquired, from what `load` found, keeping only
    /// offsets at or above `committed` (the rest were resolved). A version-1 map
    /// becomes a write (`Some`) that the new owner must apply before it hands out
    /// anything: the head of version 2 and the map as the first record, its deadlines
    /// `v1_deadline_ms` (version 1 kept none: due at once).
    pub fn acquired(
        loaded: Loaded,
        committed: u64,
        v1_deadline_ms: u64,
    ) -> (Self, Option<LedgerWrite>) {
        let mut st = LedgerState {
            head: loaded.head == Some(VERSION),
            ..LedgerState::default()
        };
        for (seq, entries) in loaded.records {
            st.next_seq = st.next_seq.max(seq.saturating_add(1));
            st.garbage.insert(seq);
            st.sizes.insert(seq, entries.len());
            for e in entries {
                if e.offset < committed {
                    continue;
                }
                st.hold(seq, e);
            }
        }
        let migrate = if loaded.head == Some(VERSION_1) {
            let entries: Vec<LedgerEntry> = loaded
                .v1
                .range(committed..)
                .map(|(o, a)| LedgerEntry {
                    offset: *o,
                    attempt: *a,
                    deadline_ms: v1_deadline_ms,
                    session: None,
                })
                .collect();
            let mut w = LedgerWrite {
                head: true,
                ..LedgerWrite::default()
            };
            if !entries.is_empty() {
                w.record = Some((st.next_seq, entries));
            }
            Some(w)
        } else {
            None
        };
        (st, migrate)
    }

    /// Makes `e` the current entry of its offset, held by record `seq`.
    fn hold(&mut self, seq: u64, e: LedgerEntry) {
        if let Some((old, _)) = self.current.insert(e.offset, (seq, e)) {
            self.release(old);
        }
        self.garbage.remove(&seq);
        *self.live.entry(seq).or_insert(0) += 1;
    }

    fn release(&mut self, seq: u64) {
        if let Some(n) = self.live.get_mut(&seq) {
            *n -= 1;
            if *n == 0 {
                self.live.remove(&seq);
                self.garbage.insert(seq);
            }
        }
    }

    /// The write that records `entries` (at most [`MAX_RECORD_ENTRIES`], offsets
    /// distinct) and prunes what they and earlier changes left empty. `entries` empty:
    /// a write that only prunes (`None` when there is nothing to prune either).
    ///
    /// Compaction: a record stays in Meta while any of its entries is current, so a
    /// few stragglers (a delivery with a long lease, a nack with a long delay) could
    /// pin whole records and grow what a new owner must read past
    /// [`MAX_LOADED_ENTRIES`] (its takeover would then fail). Where the record has
    /// room, the write also carries, unchanged, the current entries of the oldest
    /// records that are at most half current; those records are left empty and are
    /// pruned in the same transaction.
    pub fn stage(&self, mut entries: Vec<LedgerEntry>) -> Option<LedgerWrite> {
        entries.extend(self.carried(MAX_RECORD_ENTRIES.saturating_sub(entries.len()), &entries));
        let mut emptied = BTreeMap::new();
        for e in &entries {
            if let Some((seq, _)) = self.current.get(&e.offset) {
                *emptied.entry(*seq).or_insert(0usize) += 1;
            }
        }
        let mut prune: Vec<u64> = emptied
            .into_iter()
            .filter(|(seq, n)| self.live.get(seq) == Some(n))
            .map(|(seq, _)| seq)
            .collect();
        for seq in &self.garbage {
            if prune.len() >= PRUNE_MAX {
                break;
            }
            prune.push(*seq);
        }
        prune.truncate(PRUNE_MAX);
        prune.sort_unstable();
        prune.dedup();
        let recording = !entries.is_empty();
        let w = LedgerWrite {
            head: !self.head && recording,
            record: recording.then_some((self.next_seq, entries)),
            prune,
            with_owner_epoch: false,
        };
        (!w.is_empty()).then_some(w)
    }

    /// The current entries of the oldest sparse records (at most half of their
    /// entries current): whole records only, at most `room` entries and
    /// `PRUNE_MAX / 2` records, none holding an offset in `fresh`.
    fn carried(&self, room: usize, fresh: &[LedgerEntry]) -> Vec<LedgerEntry> {
        let sparse: BTreeSet<u64> = self
            .live
            .iter()
            .filter(|(seq, live)| **live * 2 <= self.sizes.get(seq).copied().unwrap_or(0))
            .map(|(seq, _)| *seq)
            .collect();
        if sparse.is_empty() || room == 0 {
            return Vec::new();
        }
        let fresh: BTreeSet<u64> = fresh.iter().map(|e| e.offset).collect();
        let mut by_record: BTreeMap<u64, Vec<&LedgerEntry>> = BTreeMap::new();
        for (seq, e) in self.current.values() {
            if sparse.contains(seq) {
                by_record.entry(*seq).or_default().push(e);
            }
        }
        let mut out = Vec::new();
        // At most half of a write's prunes, so the records it empties leave Meta in
        // the same transaction.
        for held in by_record.into_values().take(PRUNE_MAX / 2) {
            if held.iter().any(|e| fresh.contains(&e.offset)) {
                // Re-recorded by this write anyway.
                continue;
            }
            if out.len() + held.len() > room {
                break;
            }
            out.extend(held.into_iter().cloned());
        }
        out
    }

    /// Meta applied `w` (a write from [`LedgerState::stage`] or
    /// [`LedgerState::acquired`]).
    pub fn applied(&mut self, w: LedgerWrite) {
        if w.head {
            self.head = true;
        }
        if let Some((seq, entries)) = w.record {
            self.next_seq = self.next_seq.max(seq.saturating_add(1));
            self.sizes.insert(seq, entries.len());
            for e in entries {
                self.hold(seq, e);
            }
        }
        for seq in w.prune {
            // Only records that hold nothing current are ever pruned.
            self.garbage.remove(&seq);
            self.sizes.remove(&seq);
        }
    }

    /// Entries in Meta, current or not: what a new owner reads.
    pub fn stored(&self) -> usize {
        self.sizes.values().sum()
    }

    /// Offsets that left the ledger (resolved, carried by a durable checkpoint): their
    /// records may become garbage.
    pub fn forget(&mut self, offsets: impl IntoIterator<Item = u64>) {
        for o in offsets {
            if let Some((seq, _)) = self.current.remove(&o) {
                self.release(seq);
            }
        }
    }

    /// A checkpoint at `committed` is durable in Meta: every entry below it is
    /// resolved for good.
    pub fn checkpointed(&mut self, committed: u64) {
        let below: Vec<u64> = self.current.range(..committed).map(|(o, _)| *o).collect();
        self.forget(below);
    }

    /// The current entries, by offset (what a new owner inherits).
    pub fn entries(&self) -> impl Iterator<Item = &LedgerEntry> {
        self.current.values().map(|(_, e)| e)
    }

    /// The current entry of `offset`.
    pub fn entry(&self, offset: u64) -> Option<&LedgerEntry> {
        self.current.get(&offset).map(|(_, e)| e)
    }

    /// Records in Meta (holding something, or garbage not pruned yet).
    pub fn records(&self) -> usize {
        self.live.len() + self.garbage.len()
    }

    /// Current entries.
    pub fn len(&self) -> usize {
        self.current.len()
    }

    pub fn is_empty(&self) -> bool {
        self.current.is_empty()
    }

    /// Records waiting to be pruned.
    pub fn garbage(&self) -> usize {
        self.garbage.len()
    }
}

// ---------------------------------------------------------------------------------
// The version-2 codec
// ---------------------------------------------------------------------------------

#[derive(Serialize, Deserialize)]
struct RecordV2 {
    v: u64,
    d: Vec<EntryV2>,
    /// The epoch of the owner that wrote the record (the fence its transaction
    /// compared), for whoever reads etcd's history: the cluster crash loop checks each
    /// record against the owner key at its revision. Nothing in meshd reads it back;
    /// records of earlier releases lack it, and a release that does not know it ignores
    /// it (an unknown field is kept and ignored, so the version stays 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    e: Option<i64>,
    /// The writing owner's instance (what its owner key held), with `e`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    i: Option<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum EntryV2 {
    Bound(u64, u32, u64, String, i64),
    Unbound(u64, u32, u64),
}

#[derive(Serialize, Deserialize)]
struct HeadV2 {
    v: u64,
    layout: String,
}

/// What the head key holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    V1(BTreeMap<u64, u32>),
    V2,
}

/// Decodes the head key: a version-1 map or the version-2 head; the error is the
/// reason it is corrupt.
pub fn decode_head(bytes: &[u8]) -> Result<Head, String> {
    let version = serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|v| v.get("v").and_then(|v| v.as_u64()));
    if version == Some(VERSION) {
        if bytes != HEAD {
            return Err(format!(
                "attempt ledger head is not {}",
                String::from_utf8_lossy(HEAD)
            ));
        }
        let h: HeadV2 = decode_named(bytes, VERSION, "attempt ledger head")?;
        return match h.layout.as_str() {
            "records" => Ok(Head::V2),
            other => Err(format!("unknown attempt ledger layout {other:?}")),
        };
    }
    decode_v1(bytes).map(Head::V1)
}

/// Encodes a version-2 record: 1 to [`MAX_RECORD_ENTRIES`] entries, offsets distinct
/// (written in ascending order), attempts at least 1, and the writing owner (`"e"` its
/// epoch, `"i"` its instance, when given).
pub fn encode_record(
    entries: &[LedgerEntry],
    owner: Option<(i64, Option<&str>)>,
) -> Result<Vec<u8>, AttemptError> {
    if entries.len() > MAX_RECORD_ENTRIES {
        return Err(AttemptError::TooLarge {
            entries: entries.len(),
            max: MAX_RECORD_ENTRIES,
        });
    }
    if entries.is_empty() {
        return Err(AttemptError::Invalid(
            "an attempt ledger record holds at least one entry".into(),
        ));
    }
    let mut sorted: Vec<&LedgerEntry> = entries.iter().collect();
    sorted.sort_by_key(|e| e.offset);
    for w in sorted.windows(2) {
        if w[0].offset == w[1].offset {
            return Err(AttemptError::Invalid(format!(
                "offset {} twice in one attempt ledger record",
                w[0].offset
            )));
        }
    }
    if let Some(e) = sorted.iter().find(|e| e.attempt == 0) {
        return Err(AttemptError::Invalid(format!(
            "offset {} has attempt 0: a delivery in flight was handed out at least once",
            e.offset
        )));
    }
    let record = RecordV2 {
        v: VERSION,
        d: sorted
            .into_iter()
            .map(|e| match &e.session {
                Some(s) => EntryV2::Bound(
                    e.offset,
                    e.attempt,
                    e.deadline_ms,
                    s.session_id.clone(),
                    s.epoch,
                ),
                None => EntryV2::Unbound(e.offset, e.attempt, e.deadline_ms),
            })
            .collect(),
        e: owner.map(|(epoch, _)| epoch),
        i: owner.and_then(|(_, instance)| instance.map(str::to_string)),
    };
    serde_json::to_vec(&record).map_err(|e| {
        AttemptError::Store(StoreFailure::Failed(format!(
            "encoding attempt ledger record: {e}"
        )))
    })
}

/// Decodes a version-2 record; the error is the reason it is corrupt.
pub fn decode_record(bytes: &[u8]) -> Result<Vec<LedgerEntry>, String> {
    if bytes.last() != Some(&b'}') {
        return Err("attempt ledger record does not end with its closing brace".into());
    }
    let r: RecordV2 = decode_named(bytes, VERSION, "attempt ledger record")?;
    if r.d.is_empty() {
        return Err("attempt ledger record with no entries".into());
    }
    let mut out = Vec::with_capacity(r.d.len());
    let mut previous: Option<u64> = None;
    for e in r.d {
        let entry = match e {
            EntryV2::Bound(offset, attempt, deadline_ms, session_id, epoch) => LedgerEntry {
                offset,
                attempt,
                deadline_ms,
                session: Some(SessionBinding { session_id, epoch }),
            },
            EntryV2::Unbound(offset, attempt, deadline_ms) => LedgerEntry {
                offset,
                attempt,
                deadline_ms,
                session: None,
            },
        };
        if let Some(p) = previous {
            if entry.offset <= p {
                return Err(format!(
                    "attempt ledger offsets out of order: {} after {p}",
                    entry.offset
                ));
            }
        }
        if entry.attempt == 0 {
            return Err(format!(
                "attempt ledger holds attempt 0 for offset {}",
                entry.offset
            ));
        }
        previous = Some(entry.offset);
        out.push(entry);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------
// The version-1 codec (read on acquisition; written only by tests)
// ---------------------------------------------------------------------------------

#[derive(Serialize, Deserialize)]
struct RecordV1 {
    v: u64,
    /// `[offset, attempt]` pairs, strictly ascending by offset.
    attempts: Vec<(u64, u32)>,
}

/// Encodes a version-1 map: non-empty, of at most [`MAX_ENTRIES`] offsets, each attempt ≥ 1.
pub fn encode_v1(attempts: &BTreeMap<u64, u32>) -> Result<Vec<u8>, AttemptError> {
    if attempts.len() > MAX_ENTRIES {
        return Err(AttemptError::TooLarge {
            entries: attempts.len(),
            max: MAX_ENTRIES,
        });
    }
    if attempts.is_empty() {
        return Err(AttemptError::Invalid(
            "an empty attempt ledger is deleted, never stored".into(),
        ));
    }
    if let Some((offset, _)) = attempts.iter().find(|(_, a)| **a == 0) {
        return Err(AttemptError::Invalid(format!(
            "offset {offset} has attempt 0: a delivery in flight was handed out at least once"
        )));
    }
    let record = RecordV1 {
        v: VERSION_1,
        attempts: attempts.iter().map(|(o, a)| (*o, *a)).collect(),
    };
    serde_json::to_vec(&record).map_err(|e| {
        AttemptError::Store(StoreFailure::Failed(format!(
            "encoding attempt ledger record: {e}"
        )))
    })
}

/// Decodes a stored ledger record; the error is the reason it is corrupt.
pub fn decode_v1(bytes: &[u8]) -> Result<BTreeMap<u64, u32>, String> {
    // serde_json accepts trailing whitespace; a record this module wrote has none.
    if bytes.last() != Some(&b'}') {
        return Err("attempt ledger record does not end with its closing brace".into());
    }
    let r: RecordV1 = decode_named(bytes, VERSION_1, "attempt ledger record")?;
    if r.attempts.is_empty() {
        return Err("attempt ledger record with no entries (an empty ledger is no key)".into());
    }
    let mut out = BTreeMap::new();
    let mut previous: Option<u64> = None;
    for (offset, attempt) in r.attempts {
        if let Some(p) = previous {
            if offset <= p {
                return Err(format!(
                    "attempt ledger offsets out of order: {offset} after {p}"
                ));
            }
        }
        if attempt == 0 {
            return Err(format!(
                "attempt ledger holds attempt 0 for offset {offset}"
            ));
        }
        previous = Some(offset);
        out.insert(offset, attempt);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::{decode_v1 as decode, encode_v1 as encode};
    use proptest::prelude::*;

    fn arb_map() -> impl Strategy<Value = BTreeMap<u64, u32>> {
        proptest::collection::btree_map(any::<u64>(), 1u32.., 1..64)
    }

    proptest! {
        #[test]
        fn round_trips(map in arb_map()) {
            let bytes = encode(&map).unwrap();
            prop_assert_eq!(decode(&bytes).unwrap(), map);
        }

        #[test]
        fn every_truncation_is_corrupt(map in arb_map(), cut in any::<proptest::sample::Index>()) {
            let bytes = encode(&map).unwrap();
            let cut = cut.index(bytes.len());
            let r = decode(&bytes[..cut]);
            prop_assert!(r.is_err(), "a record truncated at {} decoded: {:?}", cut, r);
        }

        #[test]
        fn garbage_never_decodes_and_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(decode(&bytes).is_err());
        }
    }

    /// A model of Meta for the state: records by seq, writes applied whole.
    fn apply(meta: &mut BTreeMap<u64, Vec<LedgerEntry>>, w: &LedgerWrite) {
        if let Some((seq, entries)) = &w.record {
            meta.insert(*seq, entries.clone());
        }
        for seq in &w.prune {
            meta.remove(seq);
        }
    }

    fn loaded(meta: &BTreeMap<u64, Vec<LedgerEntry>>) -> Loaded {
        Loaded {
            head: Some(VERSION),
            v1: BTreeMap::new(),
            records: meta.iter().map(|(s, e)| (*s, e.clone())).collect(),
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Record(Vec<(u64, u32)>),
        Ack(u64),
        Checkpoint(u64),
        Prune,
        Reacquire,
    }

    fn arb_op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => proptest::collection::vec((0u64..40, 1u32..5), 1..6).prop_map(Op::Record),
            3 => (0u64..40).prop_map(Op::Ack),
            1 => (0u64..40).prop_map(Op::Checkpoint),
            1 => Just(Op::Prune),
            1 => Just(Op::Reacquire),
        ]
    }

    proptest! {
        /// Whatever the owner does, what a new owner would load from Meta is the
        /// owner's current entries plus only what it forgot (acked) and has not
        /// pruned yet; never less (no count or deadline lost), and the records in
        /// Meta are exactly those the state counts.
        #[test]
        fn the_state_mirrors_meta(ops in proptest::collection::vec(arb_op(), 1..80)) {
            let mut meta = BTreeMap::new();
            let mut st = LedgerState::default();
            let mut committed = 0u64;
            let mut acked = BTreeSet::new();
            for op in ops {
                match op {
                    Op::Record(pairs) => {
                        let mut seen = BTreeSet::new();
                        let entries: Vec<LedgerEntry> = pairs
                            .into_iter()
                            .filter(|(o, _)| *o >= committed && seen.insert(*o))
                            .map(|(o, a)| LedgerEntry { offset: o, attempt: a, deadline_ms: o + 7, session: None })
                            .collect();
                        for e in &entries {
                            acked.remove(&e.offset);
                        }
                        if let Some(w) = st.stage(entries) {
                            prop_assert!(w.prune.len() <= PRUNE_MAX);
                            apply(&mut meta, &w);
                            st.applied(w);
                        }
                    }
                    Op::Ack(o) => {
                        if st.entry(o).is_some() {
                            acked.insert(o);
                        }
                        st.forget([o]);
                    }
                    Op::Checkpoint(c) => {
                        committed = committed.max(c);
                        st.checkpointed(committed);
                    }
                    Op::Prune => {
                        if let Some(w) = st.stage(Vec::new()) {
                            apply(&mut meta, &w);
                            st.applied(w);
                        }
                    }
                    Op::Reacquire => {
                        let (again, migrate) = LedgerState::acquired(loaded(&meta), committed, 0);
                        prop_assert!(migrate.is_none());
                        // Forgotten entries may come back (at least once).
                        acked.clear();
                        st = again;
                    }
                }
                prop_assert_eq!(st.records(), meta.len());
                prop_assert_eq!(st.stored(), meta.values().map(Vec::len).sum::<usize>());
                let (fresh, _) = LedgerState::acquired(loaded(&meta), committed, 0);
                let mine: BTreeMap<u64, LedgerEntry> =
                    st.entries().map(|e| (e.offset, e.clone())).collect();
                let theirs: BTreeMap<u64, LedgerEntry> =
                    fresh.entries().map(|e| (e.offset, e.clone())).collect();
                for (o, e) in &mine {
                    prop_assert_eq!(theirs.get(o), Some(e), "offset {} lost", o);
                }
                for o in theirs.keys() {
                    prop_assert!(
                        mine.contains_key(o) || acked.contains(o),
                        "offset {} in Meta but neither current nor acked", o
                    );
                }
            }
            // Once everything is acked and pruned, nothing is left.
            let all: Vec<u64> = st.entries().map(|e| e.offset).collect();
            st.forget(all);
            while let Some(w) = st.stage(Vec::new()) {
                apply(&mut meta, &w);
                st.applied(w);
            }
            prop_assert!(meta.is_empty());
            prop_assert_eq!(st.records(), 0);
        }
    }

    #[test]
    fn a_write_prunes_at_most_prune_max_and_the_rest_follow() {
        let mut st = LedgerState::default();
        let mut meta = BTreeMap::new();
        for o in 0..100u64 {
            let w = st
                .stage(vec![LedgerEntry {
                    offset: o,
                    attempt: 1,
                    deadline_ms: 0,
                    session: None,
                }])
                .unwrap();
            assert_eq!(w.head, o == 0, "the head with the first record only");
            apply(&mut meta, &w);
            st.applied(w);
        }
        st.checkpointed(100);
        assert_eq!(st.garbage(), 100);
        let mut writes = 0;
        while let Some(w) = st.stage(Vec::new()) {
            assert!(w.prune.len() <= PRUNE_MAX && w.record.is_none() && !w.head);
            apply(&mut meta, &w);
            st.applied(w);
            writes += 1;
        }
        assert_eq!(writes, 100usize.div_ceil(PRUNE_MAX));
        assert!(meta.is_empty());
    }

    #[test]
    fn pinned_version_2_record() {
        let entries = vec![
            LedgerEntry {
                offset: 7,
                attempt: 2,
                deadline_ms: 1_700_000_000_000,
                session: None,
            },
            LedgerEntry {
                offset: 9,
                attempt: 1,
                deadline_ms: 5,
                session: Some(SessionBinding {
                    session_id: "w".into(),
                    epoch: 3,
                }),
            },
        ];
        let text = r#"{"v":2,"d":[[7,2,1700000000000],[9,1,5,"w",3]]}"#;
        assert_eq!(
            String::from_utf8(encode_record(&entries, None).unwrap()).unwrap(),
            text
        );
        assert_eq!(decode_record(text.as_bytes()).unwrap(), entries);
        // The writer's epoch rides along; the entries read the same.
        let with_owner = r#"{"v":2,"d":[[7,2,1700000000000],[9,1,5,"w",3]],"e":41,"i":"inst-0"}"#;
        assert_eq!(
            String::from_utf8(encode_record(&entries, Some((41, Some("inst-0")))).unwrap())
                .unwrap(),
            with_owner
        );
        assert_eq!(decode_record(with_owner.as_bytes()).unwrap(), entries);
        for bad in [
            r#"{"v":2,"d":[[7,2,1,"w"]]}"#,
            r#"{"v":2,"d":[[7,2]]}"#,
            r#"{"v":2,"d":[[7,2,1]]} "#,
            r#"{"v":2,"d":[[7,2,-1]]}"#,
        ] {
            assert!(decode_record(bad.as_bytes()).is_err(), "{bad}");
        }
        // A field a newer release wrote is ignored.
        assert_eq!(
            decode_record(br#"{"v":2,"d":[[7,2,1]],"x":0}"#).map(|e| e.len()),
            Ok(1)
        );
        assert_eq!(decode_head(HEAD), Ok(Head::V2));
        assert!(decode_head(br#"{"layout":"records","v":2}"#).is_err());
    }

    #[test]
    fn every_truncation_of_a_fixed_record_is_corrupt() {
        let map = BTreeMap::from([(0, 1), (7, 2), (u64::MAX, u32::MAX)]);
        let bytes = encode(&map).unwrap();
        for cut in 0..bytes.len() {
            assert!(
                decode(&bytes[..cut]).is_err(),
                "{}",
                String::from_utf8_lossy(&bytes[..cut])
            );
        }
    }

    #[test]
    fn pinned_format() {
        let map = BTreeMap::from([(1004, 2), (1000, 1), (1001, 3)]);
        assert_eq!(
            String::from_utf8(encode(&map).unwrap()).unwrap(),
            r#"{"v":1,"attempts":[[1000,1],[1001,3],[1004,2]]}"#
        );
        // This exact text keeps decoding to this map.
        assert_eq!(
            decode(br#"{"v":1,"attempts":[[1000,1],[1001,3],[1004,2]]}"#).unwrap(),
            map
        );
    }

    #[test]
    fn every_garbled_structural_byte_is_corrupt() {
        let good = encode(&BTreeMap::from([(10, 1), (11, 2)])).unwrap();
        for (i, b) in good.iter().enumerate() {
            if b"{}[]:,\"".contains(b) {
                let mut bad = good.clone();
                bad[i] = b'#';
                assert!(
                    decode(&bad).is_err(),
                    "byte {i} garbled still decodes: {}",
                    String::from_utf8_lossy(&bad)
                );
            }
        }
    }

    #[test]
    fn garbled_records_are_corrupt_with_a_reason() {
        let cases: &[(&str, &str)] = &[
            ("", "closing brace"),
            ("{", "closing brace"),
            ("{}", "without a version"),
            ("{]}", "not a JSON"),
            ("null", "closing brace"),
            ("[]", "closing brace"),
            (r#"{"v":1,"attempts":[[1,1]]} "#, "closing brace"),
            (r#"{"v":1,"attempts":[[1,1]]}}"#, "not a JSON"),
            (r#"{"v":1,"attempts":[[1,1]]}{}"#, "not a JSON"),
            (r#"{"attempts":[[1,1]]}"#, "without a version"),
            (
                r#"{"v":2,"attempts":[[1,1]]}"#,
                "unknown attempt ledger record version 2",
            ),
            (
                r#"{"v":"1","attempts":[[1,1]]}"#,
                "unknown attempt ledger record version",
            ),
            (
                r#"{"v":1.0,"attempts":[[1,1]]}"#,
                "unknown attempt ledger record version",
            ),
            (r#"{"v":1}"#, "malformed"),
            (r#"{"v":1,"attempts":[[1,1,1]]}"#, "malformed"),
            (r#"{"v":1,"attempts":[[1]]}"#, "malformed"),
            (r#"{"v":1,"attempts":[[-1,1]]}"#, "malformed"),
            (r#"{"v":1,"attempts":[[1,-1]]}"#, "malformed"),
            (r#"{"v":1,"attempts":[[1.5,1]]}"#, "malformed"),
            (r#"{"v":1,"attempts":[[1,4294967296]]}"#, "malformed"),
            (
                r#"{"v":1,"attempts":[[18446744073709551616,1]]}"#,
                "malformed",
            ),
            (r#"{"v":1,"attempts":[["1",1]]}"#, "malformed"),
            (r#"{"v":1,"attempts":{"1":1}}"#, "malformed"),
            (r#"{"v":1,"attempts":[]}"#, "no entries"),
            (r#"{"v":1,"attempts":[[2,1],[1,1]]}"#, "out of order"),
            (r#"{"v":1,"attempts":[[1,1],[1,2]]}"#, "out of order"),
            (r#"{"v":1,"attempts":[[1,0]]}"#, "attempt 0"),
        ];
        // A field a newer release wrote is ignored.
        assert!(decode(br#"{"v":1,"attempts":[[1,1]],"x":1}"#).is_ok());
        for (text, expected) in cases {
            let err = decode(text.as_bytes()).unwrap_err();
            assert!(
                err.contains(expected),
                "{text:?}: expected {expected:?} in {err:?}"
            );
        }
    }

    #[test]
    fn encode_refuses_what_decode_would_call_corrupt() {
        assert!(matches!(
            encode(&BTreeMap::new()),
            Err(AttemptError::Invalid(_))
        ));
        assert!(matches!(
            encode(&BTreeMap::from([(3, 1), (4, 0)])),
            Err(AttemptError::Invalid(m)) if m.contains("offset 4")
        ));
    }

    #[test]
    fn the_cap_keeps_the_largest_record_well_under_the_etcd_request_limit() {
        const ETCD_MAX_REQUEST_BYTES: usize = 1536 * 1024;
        let worst: BTreeMap<u64, u32> = (0..MAX_ENTRIES as u64)
            .map(|i| (u64::MAX - i, u32::MAX))
            .collect();
        let bytes = encode(&worst).unwrap();
        assert_eq!(bytes.len(), MAX_RECORD_BYTES);
        const { assert!(MAX_RECORD_BYTES * 4 < ETCD_MAX_REQUEST_BYTES) };
        assert_eq!(decode(&bytes).unwrap(), worst);
        let mut over = worst;
        over.insert(0, 1);
        assert_eq!(
            encode(&over),
            Err(AttemptError::TooLarge {
                entries: MAX_ENTRIES + 1,
                max: MAX_ENTRIES
            })
        );
    }

    #[test]
    fn keys_follow_the_catalog_and_incarnations_do_not_overlap() {
        let k = OffsetKey {
            subscription: "billing".into(),
            incarnation: 1,
            topic: "orders".into(),
            partition: 3,
        };
        assert_eq!(
            String::from_utf8(ledger_key(&k)).unwrap(),
            "meshd/v1/attempts/billing/1/orders/3"
        );
        assert!(ledger_key(&k).starts_with(&incarnation_prefix("billing", 1)));
        let twelve = OffsetKey {
            incarnation: 12,
            ..k.clone()
        };
        assert!(!ledger_key(&twelve).starts_with(&incarnation_prefix("billing", 1)));
        let other = OffsetKey {
            subscription: "billing2".into(),
            ..k
        };
        assert!(!ledger_key(&other).starts_with(&incarnation_prefix("billing", 1)));
    }

    #[test]
    fn error_classes() {
        assert!(AttemptError::Store(StoreFailure::Unavailable("x".into())).is_retryable());
        for e in [
            AttemptError::Store(StoreFailure::Indeterminate("x".into())),
            AttemptError::Fenced,
            AttemptError::TooLarge { entries: 2, max: 1 },
            AttemptError::Store(StoreFailure::FailStopped("x".into())),
        ] {
            assert!(!e.is_retryable(), "{e:?}");
        }
        assert_eq!(AttemptError::from_meta(MetaError::Fenced).kind(), "fenced");
        assert_eq!(
            AttemptError::from_meta(MetaError::Unavailable("x".into())),
            AttemptError::Store(StoreFailure::Unavailable("x".into()))
        );
        assert_eq!(
            AttemptError::from_meta(MetaError::Indeterminate("x".into())),
            AttemptError::Store(StoreFailure::Indeterminate("x".into()))
        );
        assert_eq!(
            AttemptError::from_meta(MetaError::Failed("x".into())).kind(),
            "failed"
        );
    }
}
