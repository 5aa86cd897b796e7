//! # The topic record: key and value codec
//!
//! Key: `meshd/v1/topics/{name}` (one escaped component, from the key catalog).
//!
//! Value: versioned JSON, `"v": 1`:
//!
//! ```json
//! {"v":1,"name":"orders","partitions":3}
//! {"v":1,"name":"orders","partitions":3,"deleting":true}
//! ```
//!
//! `deleting` is written only while a delete is in progress (see the delete protocol
//! in [`super`]); absent means `false`. The revision and incarnation are not stored:
//! they are the key's `mod_revision` and `create_revision`, issued by Meta.
//!
//! Decoding never guesses: a missing or unknown version, a missing field, a wrong
//! type, a partition count outside 1–1024, an invalid name or a name that does not
//! match the key is reported as corrupt, never turned into a default. A field this
//! release does not know is ignored: a newer release wrote it (state-plane.md,
//! "Records"), and a feature that needs older instances to honour it waits until every
//! member runs a release that does.

use super::types::{
    validate_dedup_window, validate_partitions, StoredTopic, Topic, DEFAULT_DEDUP_WINDOW_MS,
};
use crate::cache::CorruptRecord;
use crate::codec::decode_probed;
use crate::names::validate_name;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::KeyValue;
use serde::{Deserialize, Serialize};

/// The only record version this code writes and reads.
pub const VERSION: u32 = 1;

/// The Meta key of topic `name`.
pub fn key(name: &str) -> Vec<u8> {
    keys::key(KeyKind::Topics, &[name])
}

/// The prefix of every topic key.
pub fn prefix() -> Vec<u8> {
    keys::key(KeyKind::Topics, &[])
}

/// The topic name of a key under [`prefix`].
pub(crate) fn name_of(key: &[u8]) -> Result<String, CorruptRecord> {
    match keys::components(KeyKind::Topics, key) {
        Some(mut parts) if parts.len() == 1 => Ok(parts.remove(0)),
        _ => Err(CorruptRecord::new(
            key,
            "not a topic key (expected topics/{name})",
        )),
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct RecordV1 {
    v: u32,
    name: String,
    partitions: u32,
    #[serde(default, skip_serializing_if = "is_false")]
    deleting: bool,
    /// Added after version 1 shipped; omitted at the default (so a topic that never
    /// set it is stored as before), and a record without it has the default, which
    /// is on (HTTP API, Additions: dedup is on by default). An older release ignores
    /// the field (it does not deduplicate).
    #[serde(default = "default_window", skip_serializing_if = "is_default_window")]
    dedup_window_ms: u64,
}

fn default_window() -> u64 {
    DEFAULT_DEDUP_WINDOW_MS
}

fn is_default_window(ms: &u64) -> bool {
    *ms == DEFAULT_DEDUP_WINDOW_MS
}

/// A decoded topic record (what the value holds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicRecord {
    pub name: String,
    pub partitions: u32,
    /// A delete is in progress (or was interrupted): the topic reads as absent.
    pub deleting: bool,
    pub dedup_window_ms: u64,
}

/// Encodes a topic record.
pub fn encode(
    name: &str,
    partitions: u32,
    deleting: bool,
    dedup_window_ms: u64,
) -> Result<Vec<u8>, String> {
    let record = RecordV1 {
        v: VERSION,
        name: name.to_string(),
        partitions,
        deleting,
        dedup_window_ms,
    };
    serde_json::to_vec(&record).map_err(|e| format!("encoding topic record: {e}"))
}

/// Decodes the value stored for topic `name`.
pub fn decode_value(name: &str, value: &[u8]) -> Result<TopicRecord, String> {
    let r: RecordV1 = decode_probed(value, VERSION)?;
    if r.name != name {
        return Err(format!(
            "the record names topic {:?} but is stored under {:?}",
            r.name, name
        ));
    }
    validate_name(&r.name).map_err(|e| format!("the record holds an invalid value: name {e}"))?;
    validate_partitions(r.partitions)
        .map_err(|e| format!("the record holds an invalid value: partitions {e}"))?;
    validate_dedup_window(r.dedup_window_ms)
        .map_err(|e| format!("the record holds an invalid value: dedup_window_ms {e}"))?;
    Ok(TopicRecord {
        name: r.name,
        partitions: r.partitions,
        deleting: r.deleting,
        dedup_window_ms: r.dedup_window_ms,
    })
}

/// Decodes a stored key-value (revision = `mod_revision`, incarnation =
/// `create_revision`).
pub(crate) fn decode(name: &str, kv: &KeyValue) -> Result<StoredTopic, CorruptRecord> {
    let r = decode_value(name, &kv.value).map_err(|reason| CorruptRecord::new(&kv.key, reason))?;
    Ok(StoredTopic {
        topic: Topic {
            name: r.name,
            partitions: r.partitions,
            revision: kv.mod_revision,
            incarnation: kv.create_revision,
            dedup_window_ms: r.dedup_window_ms,
        },
        deleting: r.deleting,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kv(name: &str, value: &[u8]) -> KeyValue {
        KeyValue {
            key: key(name),
            value: value.to_vec(),
            create_revision: 3,
            mod_revision: 7,
            version: 2,
            lease: None,
        }
    }

    proptest! {
        #[test]
        fn round_trips(name in "[A-Za-z0-9._-]{1,249}", partitions in 1u32..=1024, deleting in any::<bool>()) {
            let bytes = encode(&name, partitions, deleting, super::super::DEFAULT_DEDUP_WINDOW_MS).unwrap();
            let got = decode(&name, &kv(&name, &bytes)).unwrap();
            prop_assert_eq!(got.deleting, deleting);
            prop_assert_eq!(got.topic, Topic { name: name.clone(), partitions, revision: 7, incarnation: 3, dedup_window_ms: super::super::DEFAULT_DEDUP_WINDOW_MS });
        }

        #[test]
        fn every_truncation_is_corrupt(name in "[A-Za-z0-9._-]{1,40}", partitions in 1u32..=1024, deleting in any::<bool>(), cut in 0usize..1000) {
            let bytes = encode(&name, partitions, deleting, super::super::DEFAULT_DEDUP_WINDOW_MS).unwrap();
            let cut = cut % bytes.len();
            let r = decode(&name, &kv(&name, &bytes[..cut]));
            prop_assert!(r.is_err(), "a record truncated at {} decoded: {:?}", cut, r);
        }

        #[test]
        fn garbage_never_decodes_into_a_value(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(decode("n", &kv("n", &bytes)).is_err());
        }

        #[test]
        fn key_names_round_trip(name in ".{1,30}") {
            prop_assert_eq!(name_of(&key(&name)).unwrap(), name);
        }
    }

    /// Pins the version 1 format.
    #[test]
    fn pinned_version_1_record() {
        assert_eq!(
            String::from_utf8(
                encode("orders", 3, false, super::super::DEFAULT_DEDUP_WINDOW_MS).unwrap()
            )
            .unwrap(),
            r#"{"v":1,"name":"orders","partitions":3}"#
        );
        assert_eq!(
            String::from_utf8(
                encode("orders", 3, true, super::super::DEFAULT_DEDUP_WINDOW_MS).unwrap()
            )
            .unwrap(),
            r#"{"v":1,"name":"orders","partitions":3,"deleting":true}"#
        );
        let r = decode_value("orders", br#"{"v":1,"name":"orders","partitions":3}"#).unwrap();
        assert_eq!(
            r,
            TopicRecord {
                name: "orders".into(),
                partitions: 3,
                deleting: false,
                dedup_window_ms: super::super::DEFAULT_DEDUP_WINDOW_MS,
            }
        );
        // The window, when set, and its default when absent (dedup is on by default).
        assert_eq!(
            String::from_utf8(encode("orders", 3, false, 0).unwrap()).unwrap(),
            r#"{"v":1,"name":"orders","partitions":3,"dedup_window_ms":0}"#
        );
        let r = decode_value(
            "orders",
            br#"{"v":1,"name":"orders","partitions":3,"dedup_window_ms":5000}"#,
        )
        .unwrap();
        assert_eq!(r.dedup_window_ms, 5000);
        assert!(decode_value(
            "orders",
            br#"{"v":1,"name":"orders","partitions":3,"dedup_window_ms":86400001}"#,
        )
        .is_err());
        let r = decode_value(
            "orders",
            br#"{"v":1,"name":"orders","partitions":1024,"deleting":false}"#,
        )
        .unwrap();
        assert!(!r.deleting);
        assert_eq!(r.partitions, 1024);
    }

    #[test]
    fn a_field_a_newer_release_wrote_is_ignored() {
        let good =
            String::from_utf8(encode("a", 3, true, super::super::DEFAULT_DEDUP_WINDOW_MS).unwrap())
                .unwrap();
        let newer = good.replace(
            r#""deleting":true"#,
            r#""deleting":true,"retention":{"h":1}"#,
        );
        assert_ne!(newer, good);
        assert_eq!(
            decode_value("a", newer.as_bytes()),
            decode_value("a", good.as_bytes())
        );
    }

    #[test]
    fn corrupt_records_are_reported_with_a_reason() {
        let good =
            String::from_utf8(encode("a", 3, true, super::super::DEFAULT_DEDUP_WINDOW_MS).unwrap())
                .unwrap();
        let cases: Vec<(String, &str)> = vec![
            (String::new(), "not a JSON record"),
            ("{".into(), "not a JSON record"),
            ("[]".into(), "not a JSON record"),
            ("null".into(), "not a JSON record"),
            (good.replace(r#""v":1,"#, ""), "no version"),
            (
                good.replace(r#""v":1"#, r#""v":2"#),
                "unknown record version 2",
            ),
            (
                good.replace(r#""v":1"#, r#""v":"1""#),
                "unknown record version",
            ),
            (good.replace(r#""partitions":3,"#, ""), "malformed"),
            (
                good.replace(r#""partitions":3"#, r#""partitions":-3"#),
                "malformed",
            ),
            (
                good.replace(r#""partitions":3"#, r#""partitions":"3""#),
                "malformed",
            ),
            (
                good.replace(r#""deleting":true"#, r#""deleting":"yes""#),
                "malformed",
            ),
            (
                good.replace(r#""partitions":3"#, r#""partitions":0"#),
                "invalid value",
            ),
            (
                good.replace(r#""partitions":3"#, r#""partitions":1025"#),
                "invalid value",
            ),
            (
                good.replace(r#""name":"a""#, r#""name":"b""#),
                "stored under",
            ),
        ];
        for (text, expected) in cases {
            let err = decode("a", &kv("a", text.as_bytes())).unwrap_err();
            assert!(
                err.reason.contains(expected),
                "{text:?}: expected {expected:?} in {:?}",
                err.reason
            );
            assert_eq!(err.key, "meshd/v1/topics/a");
        }
        // A record whose (matching) name is itself invalid.
        let text = r#"{"v":1,"name":"a b","partitions":1}"#;
        let err = decode("a b", &kv("a b", text.as_bytes())).unwrap_err();
        assert!(err.reason.contains("invalid value"), "{}", err.reason);
    }

    #[test]
    fn keys_that_are_not_one_component_are_rejected() {
        assert!(name_of(b"meshd/v1/topics/a/b").is_err());
        assert!(name_of(b"meshd/v1/topics/a%zz").is_err());
        assert!(name_of(b"meshd/v1/subscriptions/a").is_err());
        assert_eq!(name_of(&key("a/b")).unwrap(), "a/b");
    }
}
