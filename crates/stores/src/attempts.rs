//! # The attempt ledger: in-flight attempt counts of a partition, in Meta
//!
//! In cluster mode a partition moves between instances, and its delivery records
//! (Local, per instance) do not move with it. So that a takeover neither resets an
//! attempt count nor lets a poison event be delivered more than `max_attempts` times
//! in all, the owner of a partition writes the attempt count of every delivery it
//! hands out to Meta *before* the hand-out, in one transaction per pull batch, fenced
//! by its owner epoch. A new owner [`load`](AttemptLedger::load)s the map on
//! acquisition and continues the counts from there.
//!
//! ## Key and value
//!
//! One key per (subscription incarnation, topic, partition), from the key catalog
//! ([`KeyKind::Attempts`]):
//!
//! `meshd/v1/attempts/{subscription}/{incarnation}/{topic}/{partition}`
//!
//! The value is the whole in-flight map of the partition, rewritten on every
//! [`record`](AttemptLedger::record) (an empty map deletes the key), as a versioned,
//! compact JSON record sorted by offset:
//!
//! ```json
//! {"v":1,"attempts":[[1000,1],[1001,3],[1004,2]]}
//! ```
//!
//! Decoding is strict ([`decode`]): another version, a missing or unknown field, an
//! offset out of order or repeated, an attempt of 0 (a delivery in flight has been
//! handed out at least once), an empty list (an empty map is stored as no key), or
//! anything after the record is corrupt, never guessed at.
//!
//! ## Size
//!
//! Meta holds small records only: etcd refuses requests above 1.5 MiB by default (the
//! embedded Meta applies the same cap). A map of more than [`MAX_ENTRIES`] offsets is
//! refused with [`AttemptError::TooLarge`] before anything is sent; at that cap the
//! largest possible record is [`MAX_RECORD_BYTES`] (every offset 20 digits, every
//! attempt 10), under a quarter of etcd's limit. The runtime keeps one partition's
//! in-flight deliveries (`--max-in-flight`) at or below the cap in cluster mode.
//!
//! ## The failures this module is built against
//!
//! Each is pinned by a test in `crates/stores/tests/attempts.rs` on both Meta backends.
//!
//! * **A stale owner writes nothing.** Every write is one transaction with the fence
//!   compare on the owner key: after a takeover the old owner's record is `Fenced`
//!   and Meta keeps the new owner's map.
//! * **Meta down is an error, not a reset.** `Unavailable` (not applied, retry) and
//!   `Indeterminate` (maybe applied) reach the caller, which does not hand the batch
//!   out; a single-key rewrite is never half-applied.
//! * **A damaged record is reported.** `load` returns `Corrupt { key, reason }`
//!   rather than an empty map, which would reset every count.

use crate::codec::{decode_named, key_text};
use crate::meta_util::{meta_classes, FromMeta};
use crate::offsets::OffsetKey;
use crate::tasks::check_name_reason;
use async_trait::async_trait;
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{Meta, MetaError, Txn};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The store's name in logs and metrics.
const STORE: &str = "attempts";

/// The record version this module writes and reads.
pub const VERSION: u64 = 1;

/// The most in-flight offsets one partition's ledger holds. Above it `record` refuses
/// with [`AttemptError::TooLarge`] and writes nothing.
pub const MAX_ENTRIES: usize = 10_000;

/// The largest record [`MAX_ENTRIES`] entries can encode to:
/// `{"v":1,"attempts":[` + `[{20 digits},{10 digits}]` per entry, comma-separated, +
/// `]}`. A unit test checks it against the encoder and against etcd's 1.5 MiB limit.
pub const MAX_RECORD_BYTES: usize = 19 + MAX_ENTRIES * 34 - 1 + 2;

/// Keys deleted per transaction by `drop_subscription` (etcd allows 128 operations
/// per transaction by default).
const DROP_PAGE: usize = 64;

/// What can go wrong, and what the caller does about it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AttemptError {
    /// Meta could not be reached; nothing was applied. Do not hand the batch out;
    /// retry the same call later.
    #[error("meta unavailable, not applied: {0}")]
    Unavailable(String),
    /// The write was sent but its outcome is unknown. Do not hand the batch out; the
    /// same `record` may be repeated (it rewrites the whole map), or the partition is
    /// dropped and re-acquired, as after any unknown outcome of an owner's write.
    #[error("outcome unknown (the write may or may not have been applied): {0}")]
    Indeterminate(String),
    /// The owner's epoch is stale (the partition was taken over); nothing was written.
    /// Drop the partition.
    #[error("fenced: the owner no longer holds this epoch")]
    Fenced,
    /// The map has more offsets than a ledger may hold; nothing was written. Hand out
    /// fewer deliveries (keep `--max-in-flight` at or below [`MAX_ENTRIES`]).
    #[error("attempt ledger of {entries} in-flight offsets exceeds the cap of {max}")]
    TooLarge { entries: usize, max: usize },
    /// A malformed request (a name that is not a valid name, an attempt of 0). Do not
    /// retry.
    #[error("invalid attempt ledger request: {0}")]
    Invalid(String),
    /// The stored record failed to decode; it is reported, never guessed at.
    #[error("corrupt attempt ledger at {key}: {reason}")]
    Corrupt { key: String, reason: String },
    /// Meta refused the request in a way this store never asks for (a bug).
    #[error("meta failed: {0}")]
    Failed(String),
    /// Meta has fail-stopped (the embedded backend after a failed disk write) and
    /// refuses every request until meshd is restarted. Nothing was applied.
    #[error("meta fail-stopped, not applied: {0}")]
    FailStopped(String),
}

impl AttemptError {
    /// A short, stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            AttemptError::Unavailable(_) => "unavailable",
            AttemptError::Indeterminate(_) => "indeterminate",
            AttemptError::Fenced => "fenced",
            AttemptError::TooLarge { .. } => "too_large",
            AttemptError::Invalid(_) => "invalid",
            AttemptError::Corrupt { .. } => "corrupt",
            AttemptError::Failed(_) => "failed",
            // The label of Meta's own fail-stop, and of the Local stores'.
            AttemptError::FailStopped(_) => "failed",
        }
    }

    /// Known not applied and safe to retry as is.
    pub fn is_retryable(&self) -> bool {
        matches!(self, AttemptError::Unavailable(_))
    }
}

impl FromMeta for AttemptError {
    meta_classes!(AttemptError);
    fn special(e: MetaError) -> Result<Self, MetaError> {
        match e {
            MetaError::Fenced => Ok(AttemptError::Fenced),
            e => Err(e),
        }
    }
}

/// The attempt ledger: per (subscription incarnation, topic, partition), the attempt
/// count of every delivery in flight, in Meta.
///
/// # Durability
///
/// `record` returns `Ok` only after Meta acknowledged the write (an etcd quorum commit
/// or an fsync of the embedded backend), so the caller hands out a batch only after
/// its attempt counts are durable in Meta.
///
/// # Concurrency
///
/// One writer per partition: the partition's owner, which serialises its own calls
/// (its partition task makes them one after the other). Two `record` calls for one
/// key that run concurrently are not ordered by the store: the later commit wins.
/// Writers of different owners are ordered by the fence: after a takeover only the
/// new owner's calls are applied, so a `load` made after acquiring the partition sees
/// the previous owner's last applied map, and no later write of it.
///
/// # Errors: what to do
///
/// * `Unavailable`: not applied; do not hand out, retry later.
/// * `Indeterminate`: unknown outcome; do not hand out; repeat the same `record` (it
///   is idempotent) or drop the partition and re-acquire.
/// * `Fenced`: the partition was taken over; nothing was written; drop it.
/// * `TooLarge`, `Invalid`: the request is wrong; nothing was written.
/// * `Corrupt`: the stored ledger is damaged; the partition must not be served from a
///   guess (an operator deletes the key: attempt counts then restart at 0).
#[async_trait]
pub trait AttemptLedger: Send + Sync + 'static {
    /// Replaces the partition's in-flight map with `attempts` (offset → attempt count,
    /// each at least 1) in one Meta transaction fenced by `owner`'s epoch. An empty map
    /// deletes the key (fenced as well).
    async fn record(
        &self,
        key: &OffsetKey,
        owner: &Ownership,
        attempts: &BTreeMap<u64, u32>,
    ) -> Result<(), AttemptError>;

    /// The partition's in-flight map as last recorded; empty when there is none.
    async fn load(&self, key: &OffsetKey) -> Result<BTreeMap<u64, u32>, AttemptError>;

    /// Deletes every ledger of a subscription incarnation (the subscription was
    /// deleted), unfenced. In transactions of up to 64 keys, so a failure may leave
    /// some ledgers behind: repeat the call (it is idempotent).
    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), AttemptError>;
}

/// The [`AttemptLedger`] on Meta. No cache: the owner keeps the map it writes, and
/// reads happen once per acquisition.
pub struct MetaAttemptLedger {
    meta: Arc<dyn Meta>,
}

impl MetaAttemptLedger {
    pub fn new(meta: Arc<dyn Meta>) -> Self {
        Self { meta }
    }

    fn backend(&self) -> &'static str {
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
                backend = self.backend(),
                op,
                ledger = what,
                kind = err.kind(),
                error = %err,
                "attempt ledger request refused"
            ),
            _ => tracing::warn!(
                store = STORE,
                backend = self.backend(),
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

/// The Meta key of a partition's ledger:
/// `meshd/v1/attempts/{subscription}/{incarnation}/{topic}/{partition}`.
pub fn ledger_key(key: &OffsetKey) -> Vec<u8> {
    keys::key(
        KeyKind::Attempts,
        &[
            &key.subscription,
            &key.incarnation.to_string(),
            &key.topic,
            &key.partition.to_string(),
        ],
    )
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

#[async_trait]
impl AttemptLedger for MetaAttemptLedger {
    async fn record(
        &self,
        key: &OffsetKey,
        owner: &Ownership,
        attempts: &BTreeMap<u64, u32>,
    ) -> Result<(), AttemptError> {
        let what = describe(key);
        check_key(key).map_err(|e| self.refuse("record", &what, e))?;
        let k = ledger_key(key);
        let txn = if attempts.is_empty() {
            Txn::new().delete(&k)
        } else {
            let value = encode(attempts).map_err(|e| self.refuse("record", &what, e))?;
            Txn::new().put(&k, &value)
        };
        owner
            .commit(self.meta.as_ref(), txn)
            .await
            .map_err(|e| self.meta_error("record", &what, e))?;
        tracing::debug!(
            store = STORE,
            backend = self.backend(),
            ledger = %what,
            epoch = owner.epoch(),
            in_flight = attempts.len(),
            "attempt ledger recorded"
        );
        Ok(())
    }

    async fn load(&self, key: &OffsetKey) -> Result<BTreeMap<u64, u32>, AttemptError> {
        let what = describe(key);
        check_key(key).map_err(|e| self.refuse("load", &what, e))?;
        let k = ledger_key(key);
        let got = self
            .meta
            .get(&k)
            .await
            .map_err(|e| self.meta_error("load", &what, e))?;
        match got.kv {
            None => Ok(BTreeMap::new()),
            Some(kv) => decode(&kv.value).map_err(|reason| {
                self.refuse(
                    "load",
                    &what,
                    AttemptError::Corrupt {
                        key: key_text(&k),
                        reason,
                    },
                )
            }),
        }
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
            backend = self.backend(),
            subscription,
            incarnation,
            deleted,
            "attempt ledgers of a deleted subscription dropped"
        );
        Ok(())
    }
}

// ---------------------------------------------------------------------------------
// The record codec
// ---------------------------------------------------------------------------------

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordV1 {
    v: u64,
    /// `[offset, attempt]` pairs, strictly ascending by offset.
    attempts: Vec<(u64, u32)>,
}

/// Encodes a non-empty map of at most [`MAX_ENTRIES`] offsets, each attempt ≥ 1.
pub fn encode(attempts: &BTreeMap<u64, u32>) -> Result<Vec<u8>, AttemptError> {
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
        v: VERSION,
        attempts: attempts.iter().map(|(o, a)| (*o, *a)).collect(),
    };
    serde_json::to_vec(&record)
        .map_err(|e| AttemptError::Failed(format!("encoding attempt ledger record: {e}")))
}

/// Decodes a stored ledger record; the error is the reason it is corrupt.
pub fn decode(bytes: &[u8]) -> Result<BTreeMap<u64, u32>, String> {
    // serde_json accepts trailing whitespace; a record this module wrote has none.
    if bytes.last() != Some(&b'}') {
        return Err("attempt ledger record does not end with its closing brace".into());
    }
    let r: RecordV1 = decode_named(bytes, VERSION, "attempt ledger record")?;
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
            (r#"{"v":1,"attempts":[[1,1]],"x":1}"#, "malformed"),
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
        assert!(AttemptError::Unavailable("x".into()).is_retryable());
        for e in [
            AttemptError::Indeterminate("x".into()),
            AttemptError::Fenced,
            AttemptError::TooLarge { entries: 2, max: 1 },
            AttemptError::FailStopped("x".into()),
        ] {
            assert!(!e.is_retryable(), "{e:?}");
        }
        assert_eq!(AttemptError::from_meta(MetaError::Fenced).kind(), "fenced");
        assert_eq!(
            AttemptError::from_meta(MetaError::Unavailable("x".into())),
            AttemptError::Unavailable("x".into())
        );
        assert_eq!(
            AttemptError::from_meta(MetaError::Indeterminate("x".into())),
            AttemptError::Indeterminate("x".into())
        );
        assert_eq!(
            AttemptError::from_meta(MetaError::Failed("x".into())).kind(),
            "failed"
        );
    }
}
