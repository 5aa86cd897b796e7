//! Fuzzing the decoders of the records the stores keep in Meta.
//!
//! Subscriptions, topics, sessions (owner and id records) and the attempt ledger are
//! JSON in Meta, shared by every instance and read on every cache refresh and watch
//! event: one record damaged by hand, by a bug of another version or by a torn etcd
//! restore must be reported as corrupt, never panic a cache task. Arbitrary bytes get
//! nowhere, so most cases are objects whose members are the record's own field names
//! (plus strangers and duplicates) with values near and at the edges of validity.
//! "Accepted" is checked the strong way: it re-encodes and decodes to the same value.
//! The private records (tasks, dead-letter entries and their id index) are fuzzed in
//! `mod fuzz` next to their stores.
//!
//! Case count: `MESHD_FUZZ_CASES` (default 2000, the CI pass); see docs/fuzzing.md.

use meshd_fuzz_cases::cases;
use meshd_meta::LeaseId;
use meshd_stores::attempts;
use meshd_stores::deadletters::id::is_entry_id;
use meshd_stores::sessions::record::SessionValue;
use meshd_stores::sessions::{id_record, record as session_record};
use meshd_stores::subscriptions::record as subscription_record;
use meshd_stores::subscriptions::{Filter, Push, StartPosition, SubscriptionSpec};
use meshd_stores::tasks::TaskState;
use meshd_stores::time::Timestamp;
use meshd_stores::topics::record as topic_record;
use proptest::prelude::*;
use serde_json::Value;
use std::time::Duration;

/// Names the record's key may carry; generated strings use the same alphabet so a
/// record's name sometimes matches its key.
fn key_name() -> impl Strategy<Value = String> {
    "[ab]{1,2}"
}

fn string() -> impl Strategy<Value = String> {
    prop_oneof![
        key_name(),
        "[A-Za-z0-9._-]{0,12}",
        "[0-9a-f]{32}",
        "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z",
        prop::sample::select(vec![
            "latest",
            "earliest",
            "http://127.0.0.1:9/x",
            "https://h/",
            "",
            "1",
        ])
        .prop_map(str::to_owned),
        ".{0,8}",
    ]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (0u64..4).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop::sample::select(vec![
            u64::from(u32::MAX),
            u64::from(u32::MAX) + 1,
            u64::MAX,
            100,
            1000,
            600_000,
            1024,
        ])
        .prop_map(Value::from),
        Just(Value::from(-1)),
        Just(Value::from(1.5)),
    ]
}

/// Any JSON value, with objects whose members are the given field names.
fn value(fields: &'static [&'static str]) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        string().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 5, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(fields), inner), 0..5).prop_map(|m| {
                Value::Object(m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            }),
        ]
    })
}

/// A record-like JSON object as text: `"v"` (usually 1), members named after the
/// record's fields (duplicates possible: the text is written member by member),
/// strangers, and sometimes trailing garbage or whitespace.
fn record_json(fields: &'static [&'static str]) -> impl Strategy<Value = Vec<u8>> {
    let v = prop_oneof![
        6 => Just(Some(Value::from(1))),
        1 => Just(None),
        1 => value(fields).prop_map(Some),
    ];
    let name = prop_oneof![
        8 => prop::sample::select(fields).prop_map(str::to_owned),
        1 => "[a-z_]{1,6}",
    ];
    let tail = prop::sample::select(vec!["", "", "", " ", "\n", "}", ",", "x"]);
    (v, prop::collection::vec((name, value(fields)), 0..12), tail).prop_map(|(v, members, tail)| {
        let mut parts: Vec<String> = Vec::new();
        if let Some(v) = v {
            parts.push(format!("\"v\":{v}"));
        }
        for (k, value) in members {
            parts.push(format!("{}:{value}", Value::String(k)));
        }
        format!("{{{}}}{tail}", parts.join(",")).into_bytes()
    })
}

/// Arbitrary bytes, JSON of the record's shape, or a cut of the latter.
fn record_bytes(fields: &'static [&'static str]) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        1 => prop::collection::vec(any::<u8>(), 0..48),
        6 => record_json(fields),
        1 => (record_json(fields), any::<prop::sample::Index>())
            .prop_map(|(b, at)| b[..at.index(b.len() + 1)].to_vec()),
    ]
}

const SUBSCRIPTION_FIELDS: &[&str] = &[
    "name",
    "topic",
    "max_attempts",
    "ack_timeout_ms",
    "backoff",
    "initial_ms",
    "max_ms",
    "filter",
    "type",
    "source",
    "push",
    "url",
    "start",
];
const TOPIC_FIELDS: &[&str] = &["name", "partitions", "deleting"];
const SESSION_FIELDS: &[&str] = &["session_id", "client_id", "instance", "ttl_ms", "lease"];
const SESSION_ID_FIELDS: &[&str] = &["client_id"];

/// The attempt ledger: `{"v":1,"attempts":[[offset,attempt],...]}`.
fn ledger_bytes() -> impl Strategy<Value = Vec<u8>> {
    let pair = prop_oneof![
        6 => ((0u64..8), (0u32..4)).prop_map(|(o, a)| Value::from(vec![Value::from(o), Value::from(a)])),
        1 => value(&["attempts"]),
    ];
    let list = prop_oneof![
        6 => prop::collection::vec(pair, 0..6).prop_map(Value::Array),
        1 => value(&["attempts"]),
    ];
    prop_oneof![
        6 => (list, record_json(&["attempts"])).prop_map(|(l, noise)| {
            let mut s = format!("{{\"v\":1,\"attempts\":{l}");
            if noise.len() % 3 == 0 {
                s.push_str(",\"x\":1");
            }
            s.push('}');
            s.into_bytes()
        }),
        1 => record_bytes(&["attempts"]),
        4 => prop::collection::vec(
            ((0u64..8), (0u32..4), (0u64..3), prop::option::of(("[a-z]{0,3}", -1i64..3))),
            0..6,
        )
        .prop_map(|entries| {
            let d: Vec<Value> = entries
                .into_iter()
                .map(|(o, a, dl, s)| match s {
                    Some((id, e)) => serde_json::json!([o, a, dl, id, e]),
                    None => serde_json::json!([o, a, dl]),
                })
                .collect();
            serde_json::json!({"v": 2, "d": d}).to_string().into_bytes()
        }),
    ]
}

/// Edits a record object: removes a member, replaces it with `v`, adds a stranger
/// beside it, or edits one member of a nested object.
fn edit(object: &mut serde_json::Map<String, Value>, at: prop::sample::Index, how: u8, v: Value) {
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

/// A valid record with up to three member edits (none at all a quarter of the time),
/// so the cases reach every check after the version probe.
fn mutated(
    valid: impl Strategy<Value = Vec<u8>>,
    fields: &'static [&'static str],
) -> impl Strategy<Value = Vec<u8>> {
    (
        valid,
        prop::collection::vec(
            (any::<prop::sample::Index>(), any::<u8>(), value(fields)),
            0..4,
        ),
    )
        .prop_map(|(bytes, edits)| {
            let mut v: Value = serde_json::from_slice(&bytes).unwrap();
            for (at, how, value) in edits {
                if let Value::Object(o) = &mut v {
                    edit(o, at, how, value);
                }
            }
            serde_json::to_vec(&v).unwrap()
        })
}

fn valid_subscription() -> impl Strategy<Value = Vec<u8>> {
    (
        key_name(),
        key_name(),
        proptest::option::of(("[a-z]{0,3}", "[a-z]{0,3}")),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(name, topic, filter, push, earliest)| {
            let mut spec = SubscriptionSpec::new(name, topic);
            spec.filter = filter.map(|(t, s)| Filter {
                event_type: (!t.is_empty()).then_some(t),
                source: (!s.is_empty()).then_some(s),
            });
            if push {
                spec.push = Some(Push::new("http://127.0.0.1:9/x"));
            }
            if earliest {
                spec.start = StartPosition::Earliest;
            }
            subscription_record::encode(&spec).unwrap()
        })
}

fn valid_topic() -> impl Strategy<Value = Vec<u8>> {
    (key_name(), 1u32..=1024, any::<bool>()).prop_map(|(name, p, deleting)| {
        topic_record::encode(
            &name,
            p,
            deleting,
            meshd_stores::topics::DEFAULT_DEDUP_WINDOW_MS,
        )
        .unwrap()
    })
}

fn valid_session() -> impl Strategy<Value = Vec<u8>> {
    (key_name(), "[0-9a-f]{32}", 1u64..100_000, any::<i64>()).prop_map(
        |(client, id, ttl, lease)| {
            session_record::encode(&SessionValue {
                session_id: id,
                client_id: client,
                instance: "i-1".into(),
                ttl: Duration::from_millis(ttl),
                lease: LeaseId(if lease == 0 { 1 } else { lease }),
            })
            .unwrap()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn fuzz_subscription_record_decode(name in key_name(), bytes in prop_oneof![record_bytes(SUBSCRIPTION_FIELDS), mutated(valid_subscription(), SUBSCRIPTION_FIELDS)]) {
        if let Ok(spec) = subscription_record::decode_value(&name, &bytes) {
            prop_assert_eq!(&spec.name, &name);
            prop_assert!(spec.validate().is_ok());
            let again = subscription_record::encode(&spec).unwrap();
            prop_assert_eq!(subscription_record::decode_value(&name, &again), Ok(spec));
        }
    }

    #[test]
    fn fuzz_topic_record_decode(name in key_name(), bytes in prop_oneof![record_bytes(TOPIC_FIELDS), mutated(valid_topic(), TOPIC_FIELDS)]) {
        if let Ok(r) = topic_record::decode_value(&name, &bytes) {
            prop_assert_eq!(&r.name, &name);
            let again = topic_record::encode(&r.name, r.partitions, r.deleting, r.dedup_window_ms).unwrap();
            prop_assert_eq!(topic_record::decode_value(&name, &again), Ok(r));
        }
    }

    #[test]
    fn fuzz_session_record_decode(client in key_name(), bytes in prop_oneof![record_bytes(SESSION_FIELDS), mutated(valid_session(), SESSION_FIELDS)]) {
        if let Ok(v) = session_record::decode_value(&client, &bytes) {
            prop_assert_eq!(&v.client_id, &client);
            prop_assert!(session_record::is_session_id(&v.session_id));
            let again = session_record::encode(&v).unwrap();
            prop_assert_eq!(session_record::decode_value(&client, &again), Ok(v));
        }
    }

    #[test]
    fn fuzz_session_id_record_decode(bytes in prop_oneof![
        record_bytes(SESSION_ID_FIELDS),
        mutated(key_name().prop_map(|c| id_record::encode(&c).unwrap()), SESSION_ID_FIELDS),
    ]) {
        if let Ok(client) = id_record::decode_value(&bytes) {
            let again = id_record::encode(&client).unwrap();
            prop_assert_eq!(id_record::decode_value(&again), Ok(client));
        }
    }

    #[test]
    fn fuzz_attempt_ledger_decode(bytes in ledger_bytes()) {
        if let Ok(map) = attempts::decode_v1(&bytes) {
            prop_assert!(!map.is_empty() && map.values().all(|a| *a >= 1));
            let again = attempts::encode_v1(&map).unwrap();
            prop_assert_eq!(attempts::decode_v1(&again), Ok(map));
        }
        if let Ok(entries) = attempts::decode_record(&bytes) {
            prop_assert!(!entries.is_empty() && entries.iter().all(|e| e.attempt >= 1));
            let again = attempts::encode_record(&entries, None).unwrap();
            prop_assert_eq!(attempts::decode_record(&again), Ok(entries));
        }
    }

    /// Record timestamps: only the exact form that is written parses, and it prints
    /// back identically.
    #[test]
    fn fuzz_timestamp_parse(s in prop_oneof![
        string(),
        "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z",
        "[0-9:TZ.+-]{24}",
        (any::<i64>()).prop_map(|n| Timestamp::from_millis(n.rem_euclid(253_402_300_800_000))
            .map(Timestamp::to_rfc3339).unwrap_or_default()),
    ]) {
        if let Some(t) = Timestamp::parse_rfc3339(&s) {
            prop_assert_eq!(t.to_rfc3339(), s.clone());
            prop_assert_eq!(Some(t), Timestamp::from_millis(t.as_millis()));
        }
        let json = serde_json::to_vec(&s).unwrap();
        let _ = serde_json::from_slice::<Timestamp>(&json);
    }

    /// Ids and states that arrive in URLs and records.
    #[test]
    fn fuzz_ids_and_states_parse(s in string()) {
        if session_record::is_session_id(&s) {
            prop_assert!(s.len() == 32 && s.bytes().all(|b| b.is_ascii_hexdigit()));
        }
        let _ = is_entry_id(&s);
        if let Ok(state) = s.parse::<TaskState>() {
            prop_assert_eq!(state.as_str(), s.as_str());
        }
    }
}
