//! The dead-letter entry record: the value of
//! `meshd/v1/deadletters/entries/{subscription}/{id}`.
//!
//! JSON, versioned by a `"v"` field (this module writes and reads `1`):
//!
//! ```json
//! {"v":1,"id":"…32 hex…","log_id":"instance-1","subscription":"billing",
//!  "subscription_incarnation":17,"topic":"orders","partition":3,"offset":1000,
//!  "body":{"log_id":"instance-1","seq":5},"attempts":5,"reason":"HTTP 500",
//!  "first_attempt_at":"2025-01-02T03:04:05.678Z",
//!  "dead_lettered_at":"2025-01-02T03:09:05.678Z",
//!  "instance":"instance-1","epoch":42,"state":"dead","redrives":0}
//! ```
//!
//! The entry's `version` is not stored: it is the key's Meta `mod_revision`.
//!
//! Decoding is strict about what it knows: not JSON (truncated, garbled), another `v`,
//! a missing field, an id or subscription other than the key's, or an id that is not
//! the one derived from the delivery the record names ([`super::id`]) is corrupt. A
//! top-level field this release does not know (a newer one wrote it) is kept in the
//! entry ([`Kept`]) and written back when the entry is rewritten (a redrive).

use super::types::{DeadLetterEntry, DeadLetterState};
use crate::codec::{decode_named, Kept};
use crate::log::BodyRef;
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};

/// The record version this module writes.
pub const VERSION: u64 = 1;

#[derive(Serialize, Deserialize)]
struct EntryV1 {
    v: u64,
    id: String,
    log_id: String,
    subscription: String,
    subscription_incarnation: i64,
    topic: String,
    partition: u32,
    offset: u64,
    body: BodyV1,
    attempts: u32,
    reason: String,
    first_attempt_at: Timestamp,
    dead_lettered_at: Timestamp,
    instance: String,
    epoch: i64,
    state: DeadLetterState,
    redrives: u32,
    #[serde(flatten)]
    kept: Kept,
}

#[derive(Serialize, Deserialize)]
struct BodyV1 {
    log_id: String,
    seq: u64,
}

pub fn encode(e: &DeadLetterEntry) -> Result<Vec<u8>, String> {
    let r = EntryV1 {
        v: VERSION,
        id: e.id.clone(),
        log_id: e.log_id.clone(),
        subscription: e.subscription.clone(),
        subscription_incarnation: e.subscription_incarnation,
        topic: e.topic.clone(),
        partition: e.partition,
        offset: e.offset,
        body: BodyV1 {
            log_id: e.body.log_id.clone(),
            seq: e.body.seq,
        },
        attempts: e.attempts,
        reason: e.reason.clone(),
        first_attempt_at: e.first_attempt_at,
        dead_lettered_at: e.dead_lettered_at,
        instance: e.instance.clone(),
        epoch: e.epoch,
        state: e.state,
        redrives: e.redrives,
        kept: e.kept.clone(),
    };
    serde_json::to_vec(&r).map_err(|err| format!("encoding dead-letter entry {}: {err}", e.id))
}

/// Decodes the record stored under `entries/{key_subscription}/{key_id}`, whose Meta
/// `mod_revision` is `version`. The error is the reason it is corrupt.
pub fn decode(
    key_subscription: &str,
    key_id: &str,
    bytes: &[u8],
    version: i64,
) -> Result<DeadLetterEntry, String> {
    let r: EntryV1 = decode_named(bytes, VERSION, "dead-letter record")?;
    if r.id != key_id || r.subscription != key_subscription {
        return Err(format!(
            "record of entry {}/{} stored under the key of {key_subscription}/{key_id}",
            r.subscription, r.id
        ));
    }
    let derived = super::id::entry_id(
        &r.log_id,
        r.subscription_incarnation,
        &r.topic,
        r.partition,
        r.offset,
    );
    if derived != r.id {
        return Err(format!(
            "entry id {} is not the id of the delivery it names ({derived})",
            r.id
        ));
    }
    Ok(DeadLetterEntry {
        id: r.id,
        log_id: r.log_id,
        subscription: r.subscription,
        subscription_incarnation: r.subscription_incarnation,
        topic: r.topic,
        partition: r.partition,
        offset: r.offset,
        body: BodyRef {
            log_id: r.body.log_id,
            seq: r.body.seq,
        },
        attempts: r.attempts,
        reason: r.reason,
        first_attempt_at: r.first_attempt_at,
        dead_lettered_at: r.dead_lettered_at,
        instance: r.instance,
        epoch: r.epoch,
        state: r.state,
        redrives: r.redrives,
        version,
        kept: r.kept,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Value;

    fn arb_time() -> impl Strategy<Value = Timestamp> {
        (0i64..=253_402_300_799_999).prop_map(|m| Timestamp::from_millis(m).unwrap())
    }

    prop_compose! {
        fn arb_entry()(
            log_id in ".{1,20}",
            subscription in "[A-Za-z0-9._-]{1,30}",
            incarnation in any::<i64>(),
            topic in "[A-Za-z0-9._-]{1,30}",
            partition in any::<u32>(),
            offset in any::<u64>(),
            seq in any::<u64>(),
            attempts in any::<u32>(),
            reason in ".{0,60}",
            first in arb_time(),
            dead in arb_time(),
            instance in ".{1,20}",
            epoch in any::<i64>(),
            redriving in any::<bool>(),
            redrives in any::<u32>(),
            version in 1i64..i64::MAX,
        ) -> DeadLetterEntry {
            DeadLetterEntry {
                id: super::super::id::entry_id(&log_id, incarnation, &topic, partition, offset),
                body: BodyRef { log_id: log_id.clone(), seq },
                log_id,
                subscription,
                subscription_incarnation: incarnation,
                topic,
                partition,
                offset,
                attempts,
                reason,
                first_attempt_at: first,
                dead_lettered_at: dead,
                instance,
                epoch,
                state: if redriving { DeadLetterState::Redriving } else { DeadLetterState::Dead },
                redrives,
                version,
                kept: Kept::default(),
            }
        }
    }

    proptest! {
        #[test]
        fn round_trips(e in arb_entry()) {
            let bytes = encode(&e).unwrap();
            prop_assert_eq!(decode(&e.subscription, &e.id, &bytes, e.version).unwrap(), e);
        }

        #[test]
        fn every_truncation_is_corrupt(e in arb_entry(), cut in any::<proptest::sample::Index>()) {
            let bytes = encode(&e).unwrap();
            let cut = cut.index(bytes.len());
            prop_assert!(decode(&e.subscription, &e.id, &bytes[..cut], e.version).is_err());
        }
    }

    fn sample() -> DeadLetterEntry {
        let id = super::super::id::entry_id("i-1", 17, "orders", 3, 1000);
        DeadLetterEntry {
            id,
            log_id: "i-1".into(),
            subscription: "billing".into(),
            subscription_incarnation: 17,
            topic: "orders".into(),
            partition: 3,
            offset: 1000,
            body: BodyRef {
                log_id: "i-1".into(),
                seq: 5,
            },
            attempts: 5,
            reason: "HTTP 500".into(),
            first_attempt_at: Timestamp::from_millis(1).unwrap(),
            dead_lettered_at: Timestamp::from_millis(2).unwrap(),
            instance: "i-1".into(),
            epoch: 42,
            state: DeadLetterState::Dead,
            redrives: 0,
            version: 9,
            kept: Kept::default(),
        }
    }

    fn reencode(f: impl FnOnce(&mut serde_json::Map<String, Value>)) -> Vec<u8> {
        let mut v: Value = serde_json::from_slice(&encode(&sample()).unwrap()).unwrap();
        f(v.as_object_mut().unwrap());
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn a_field_a_newer_release_wrote_is_kept_and_written_back() {
        let newer = reencode(|m| {
            m.insert("note".into(), Value::from("from 0.3"));
        });
        let s = sample();
        let mut e = decode(&s.subscription, &s.id, &newer, 9).expect("not corrupt");
        assert_eq!(e.kept.names().collect::<Vec<_>>(), ["note"]);
        e.state = DeadLetterState::Redriving;
        e.redrives += 1;
        let again: Value = serde_json::from_slice(&encode(&e).unwrap()).unwrap();
        assert_eq!(again["note"], "from 0.3", "{again}");
        assert_eq!(again["state"], "redriving");
    }

    #[test]
    fn pinned_format() {
        let e = sample();
        let text = String::from_utf8(encode(&e).unwrap()).unwrap();
        assert_eq!(
            text,
            format!(
                r#"{{"v":1,"id":"{}","log_id":"i-1","subscription":"billing","subscription_incarnation":17,"topic":"orders","partition":3,"offset":1000,"body":{{"log_id":"i-1","seq":5}},"attempts":5,"reason":"HTTP 500","first_attempt_at":"1970-01-01T00:00:00.001Z","dead_lettered_at":"1970-01-01T00:00:00.002Z","instance":"i-1","epoch":42,"state":"dead","redrives":0}}"#,
                e.id
            )
        );
    }

    #[test]
    fn every_garbled_structural_byte_is_corrupt() {
        let e = sample();
        let good = encode(&e).unwrap();
        for (i, b) in good.iter().enumerate() {
            if b"{}[]:,\"".contains(b) {
                let mut bad = good.clone();
                bad[i] = b'#';
                assert!(
                    decode("billing", &e.id, &bad, 9).is_err(),
                    "byte {i} garbled still decodes: {}",
                    String::from_utf8_lossy(&bad)
                );
            }
        }
    }

    #[test]
    fn unknown_versions_and_inconsistent_records_are_corrupt() {
        let e = sample();
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "v2",
                reencode(|m| {
                    m.insert("v".into(), Value::from(2));
                }),
            ),
            (
                "no v",
                reencode(|m| {
                    m.remove("v");
                }),
            ),
            (
                "missing field",
                reencode(|m| {
                    m.remove("body");
                }),
            ),
            (
                "bad state",
                reencode(|m| {
                    m.insert("state".into(), Value::from("alive"));
                }),
            ),
            (
                "negative offset",
                reencode(|m| {
                    m.insert("offset".into(), Value::from(-1));
                }),
            ),
            (
                "offset of another delivery",
                reencode(|m| {
                    m.insert("offset".into(), Value::from(1001));
                }),
            ),
            ("not json", b"\xff\xfe".to_vec()),
            ("empty", Vec::new()),
        ];
        for (what, bytes) in cases {
            assert!(
                decode("billing", &e.id, &bytes, 9).is_err(),
                "{what} decoded"
            );
        }
        let good = encode(&e).unwrap();
        assert!(
            decode("other", &e.id, &good, 9).is_err(),
            "another subscription's key"
        );
        assert!(
            decode("billing", &"0".repeat(32), &good, 9).is_err(),
            "another id's key"
        );
    }
}
