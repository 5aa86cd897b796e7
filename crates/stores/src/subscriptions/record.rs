//! # The subscription record: key and value codec
//!
//! Key: `meshd/v1/subscriptions/{name}` (one escaped component, from the key catalog).
//!
//! Value: versioned JSON, `"v": 1`:
//!
//! ```json
//! {"v":1,"name":"orders-audit","topic":"orders","max_attempts":5,"ack_timeout_ms":30000,
//!  "backoff":{"initial_ms":1000,"max_ms":60000},
//!  "filter":{"type":"order.created","source":"/shop"},"push":{"url":"http://..."},
//!  "start":"latest"}
//! ```
//!
//! `filter` and `push` are omitted when unset; inside `filter`, `type` and `source` are
//! omitted when unset. The revision (ETag) and incarnation are not stored: they are the
//! key's `mod_revision` and `create_revision`, issued by Meta.
//!
//! Decoding never guesses: a missing or unknown version, a missing field, a wrong
//! type, a value outside its documented range, or a name that does not match the key
//! is reported as corrupt, never turned into a default. A field this release does not
//! know is ignored: a newer release wrote it (state-plane.md, "Records"), and a
//! feature that needs older instances to honour it waits until every member runs a
//! release that does. A `PUT` replaces the whole record.

use super::filters::{Filter, FilterExpr};
use super::push::{Push, Rate};
use super::types::{Backoff, Ordering, StartPosition, Subscription, SubscriptionSpec};
use crate::cache::CorruptRecord;
use crate::codec::decode_probed;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::KeyValue;
use serde::{Deserialize, Serialize};

/// The only record version this code writes and reads.
pub const VERSION: u32 = 1;

/// The Meta key of subscription `name`.
pub fn key(name: &str) -> Vec<u8> {
    keys::key(KeyKind::Subscriptions, &[name])
}

/// The prefix of every subscription key.
pub fn prefix() -> Vec<u8> {
    keys::key(KeyKind::Subscriptions, &[])
}

/// The subscription name of a key under [`prefix`].
pub(crate) fn name_of(key: &[u8]) -> Result<String, CorruptRecord> {
    match keys::components(KeyKind::Subscriptions, key) {
        Some(mut parts) if parts.len() == 1 => Ok(parts.remove(0)),
        _ => Err(CorruptRecord::new(
            key,
            "not a subscription key (expected subscriptions/{name})",
        )),
    }
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct RecordV1 {
    v: u32,
    name: String,
    topic: String,
    max_attempts: u32,
    ack_timeout_ms: u64,
    backoff: BackoffV1,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    filter: Option<FilterV1>,
    /// Added after version 1 shipped (an older release ignores it: see the module
    /// doc). The API's JSON form, parsed and validated again on decode.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    filters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    push: Option<PushV1>,
    start: StartV1,
    /// Added after version 1 shipped, omitted at its default (`"none"`); an older
    /// release ignores it, so `"key"` waits for the end of a rolling upgrade.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ordering: Option<String>,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct BackoffV1 {
    initial_ms: u64,
    max_ms: u64,
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct FilterV1 {
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    event_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<String>,
}

/// `secrets`, `headers`, `max_concurrency` and `rate_per_s` were added after version 1
/// shipped; each is omitted at its default, so a push without them is stored exactly
/// as before. An older release ignores them: it pushes unsigned, without the headers
/// and with its own bounds (README, "Push, signed and bounded": set them once every
/// member runs a release that has them).
#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct PushV1 {
    url: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    secrets: Vec<String>,
    /// `[name, value]` pairs in the order given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    headers: Vec<(String, String)>,
    #[serde(
        default = "default_max_concurrency",
        skip_serializing_if = "is_default_max_concurrency"
    )]
    max_concurrency: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rate_per_s: Option<f64>,
}

fn default_max_concurrency() -> u32 {
    super::push::DEFAULT_MAX_CONCURRENCY
}

fn is_default_max_concurrency(n: &u32) -> bool {
    *n == super::push::DEFAULT_MAX_CONCURRENCY
}

#[derive(Serialize, Deserialize, Debug, PartialEq, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum StartV1 {
    Latest,
    Earliest,
}

/// Encodes a (validated) spec.
pub fn encode(spec: &SubscriptionSpec) -> Result<Vec<u8>, String> {
    let record = RecordV1 {
        v: VERSION,
        name: spec.name.clone(),
        topic: spec.topic.clone(),
        max_attempts: spec.max_attempts,
        ack_timeout_ms: spec.ack_timeout_ms,
        backoff: BackoffV1 {
            initial_ms: spec.backoff.initial_ms,
            max_ms: spec.backoff.max_ms,
        },
        filter: spec.filter.as_ref().map(|f| FilterV1 {
            event_type: f.event_type.clone(),
            source: f.source.clone(),
        }),
        filters: (!spec.filters.is_empty()).then(|| FilterExpr::list_to_json(&spec.filters)),
        push: spec.push.as_ref().map(|p| PushV1 {
            url: p.url.clone(),
            secrets: p.secrets().to_vec(),
            headers: p.headers().to_vec(),
            max_concurrency: p.max_concurrency,
            rate_per_s: p.rate_per_s.map(|r| r.0),
        }),
        start: match spec.start {
            StartPosition::Latest => StartV1::Latest,
            StartPosition::Earliest => StartV1::Earliest,
        },
        ordering: (spec.ordering != Ordering::None).then(|| spec.ordering.as_str().to_string()),
    };
    serde_json::to_vec(&record).map_err(|e| format!("encoding subscription record: {e}"))
}

/// Decodes the value stored under `key` for subscription `name`.
pub fn decode_value(name: &str, value: &[u8]) -> Result<SubscriptionSpec, String> {
    let r: RecordV1 = decode_probed(value, VERSION)?;
    let filters = match &r.filters {
        None => Vec::new(),
        Some(v) => FilterExpr::parse_list(v).map_err(|e| format!("the record's filters: {e}"))?,
    };
    let spec = SubscriptionSpec {
        name: r.name,
        topic: r.topic,
        max_attempts: r.max_attempts,
        ack_timeout_ms: r.ack_timeout_ms,
        backoff: Backoff {
            initial_ms: r.backoff.initial_ms,
            max_ms: r.backoff.max_ms,
        },
        filter: r.filter.map(|f| Filter {
            event_type: f.event_type,
            source: f.source,
        }),
        filters,
        push: r.push.map(|p| Push {
            url: p.url,
            secrets: Some(p.secrets),
            headers: Some(p.headers),
            max_concurrency: p.max_concurrency,
            rate_per_s: p.rate_per_s.map(Rate),
        }),
        start: match r.start {
            StartV1::Latest => StartPosition::Latest,
            StartV1::Earliest => StartPosition::Earliest,
        },
        ordering: match r.ordering.as_deref() {
            None => Ordering::None,
            Some(o) => Ordering::parse(o).ok_or_else(|| {
                format!("the record's ordering {o:?} is not one this meshd knows")
            })?,
        },
    };
    if spec.name != name {
        return Err(format!(
            "the record names subscription {:?} but is stored under {:?}",
            spec.name, name
        ));
    }
    spec.validate()
        .map_err(|e| format!("the record holds an invalid value: {e}"))?;
    Ok(spec)
}

/// Decodes a stored key-value into a subscription (revision = `mod_revision`,
/// incarnation = `create_revision`).
pub(crate) fn decode(name: &str, kv: &KeyValue) -> Result<Subscription, CorruptRecord> {
    let corrupt = |reason: String| CorruptRecord::new(&kv.key, reason);
    let spec = decode_value(name, &kv.value).map_err(corrupt)?;
    Ok(Subscription {
        spec,
        revision: kv.mod_revision,
        incarnation: kv.create_revision,
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

    fn name_strategy() -> impl Strategy<Value = String> {
        "[A-Za-z0-9._-]{1,40}"
    }

    fn filter_strategy() -> impl Strategy<Value = FilterExpr> {
        let pairs = proptest::collection::btree_map("x[a-z0-9]{0,8}", ".{0,12}", 1..3)
            .prop_map(|m| m.into_iter().collect::<Vec<_>>());
        let leaf = prop_oneof![
            pairs.clone().prop_map(FilterExpr::Exact),
            pairs.clone().prop_map(FilterExpr::Prefix),
            pairs.prop_map(FilterExpr::Suffix),
        ];
        leaf.prop_recursive(3, 12, 3, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 1..3).prop_map(FilterExpr::All),
                proptest::collection::vec(inner.clone(), 1..3).prop_map(FilterExpr::Any),
                inner.prop_map(|f| FilterExpr::Not(Box::new(f))),
            ]
        })
    }

    prop_compose! {
        fn spec_strategy()(
            name in name_strategy(),
            topic in name_strategy(),
            max_attempts in 1u32..=1000,
            ack_timeout_ms in 100u64..=600_000,
            (initial_ms, max_ms) in (1u64..=3_600_000).prop_flat_map(|i| (Just(i), i..=3_600_000u64)),
            filter in proptest::option::of((proptest::option::of("[a-z.]{1,20}"), proptest::option::of("/[a-z/]{0,20}"))
                .prop_filter("a filter names something", |(t, s)| t.is_some() || s.is_some())),
            push in proptest::option::of((
                "https?://[a-z]{1,10}(:[0-9]{2,5})?/[a-z/]{0,20}",
                any::<bool>(),
                1u32..=256,
                proptest::option::of(1u32..=1_000_000),
            )),
            earliest in any::<bool>(),
            ordered in any::<bool>(),
            filters in proptest::collection::vec(filter_strategy(), 0..3),
        ) -> SubscriptionSpec {
            SubscriptionSpec {
                name,
                topic,
                max_attempts,
                ack_timeout_ms,
                backoff: Backoff { initial_ms, max_ms },
                filter: filter.map(|(event_type, source)| Filter { event_type, source }),
                filters,
                push: push.map(|(url, signed, concurrency, rate)| Push {
                    secrets: Some(if signed { vec!["whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD".into()] } else { vec![] }),
                    headers: Some(if signed { vec![("authorization".into(), "Bearer x".into())] } else { vec![] }),
                    max_concurrency: concurrency,
                    rate_per_s: rate.map(|r| Rate(f64::from(r) / 10.0)),
                    ..Push::new(url)
                }),
                start: if earliest { StartPosition::Earliest } else { StartPosition::Latest },
                ordering: if ordered { Ordering::Key } else { Ordering::None },
            }
        }
    }

    proptest! {
        #[test]
        fn round_trips(spec in spec_strategy()) {
            let bytes = encode(&spec).unwrap();
            let got = decode(&spec.name, &kv(&spec.name, &bytes)).unwrap();
            prop_assert_eq!(&got.spec, &spec);
            prop_assert_eq!(got.revision, 7);
            prop_assert_eq!(got.incarnation, 3);
        }

        #[test]
        fn every_truncation_is_corrupt(spec in spec_strategy(), cut in 0usize..1000) {
            let bytes = encode(&spec).unwrap();
            let cut = cut % bytes.len();
            let r = decode(&spec.name, &kv(&spec.name, &bytes[..cut]));
            prop_assert!(r.is_err(), "a record truncated at {} decoded: {:?}", cut, r);
        }

        #[test]
        fn garbage_never_decodes_into_a_value(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            // Random bytes are not a valid record (and must not panic).
            prop_assert!(decode("n", &kv("n", &bytes)).is_err());
        }

        #[test]
        fn key_names_round_trip(name in ".{1,30}") {
            prop_assert_eq!(name_of(&key(&name)).unwrap(), name);
        }
    }

    /// Pins the `filters` field (added to version 1 later; a release before it ignores
    /// the field, see the module doc).
    #[test]
    fn pinned_filters_field() {
        let text = br#"{"v":1,"name":"eu","topic":"orders","max_attempts":5,"ack_timeout_ms":30000,"backoff":{"initial_ms":1000,"max_ms":60000},"filters":[{"prefix":{"type":"com.shop."}},{"not":{"exact":{"region":"us"}}}],"start":"latest"}"#;
        let s = decode("eu", &kv("eu", text)).unwrap();
        assert_eq!(
            s.spec.filters,
            vec![
                FilterExpr::Prefix(vec![("type".into(), "com.shop.".into())]),
                FilterExpr::Not(Box::new(FilterExpr::Exact(vec![(
                    "region".into(),
                    "us".into()
                )]))),
            ]
        );
        assert_eq!(encode(&s.spec).unwrap(), text.to_vec());
        // A malformed stored expression is corrupt, never a filter that takes all.
        let bad = br#"{"v":1,"name":"eu","topic":"orders","max_attempts":5,"ack_timeout_ms":30000,"backoff":{"initial_ms":1000,"max_ms":60000},"filters":[{"regex":{"type":"."}}],"start":"latest"}"#;
        let e = decode("eu", &kv("eu", bad)).unwrap_err();
        assert!(e.reason.contains("filters[0]"), "{e:?}");
    }

    /// A record written before the write bounds on filters (64 pairs per expression,
    /// 16 KiB) still decodes, to what it said: a stored subscription is never lost to
    /// a tighter rule for new writes.
    #[test]
    fn a_record_with_filters_past_the_write_bounds_still_decodes() {
        let pairs: Vec<String> = (0..200)
            .map(|i| format!(r#""a{i:03}":"{}""#, "v".repeat(100)))
            .collect();
        let text = format!(
            r#"{{"v":1,"name":"eu","topic":"orders","max_attempts":5,"ack_timeout_ms":30000,"backoff":{{"initial_ms":1000,"max_ms":60000}},"filters":[{{"exact":{{{}}}}}],"start":"latest"}}"#,
            pairs.join(",")
        );
        assert!(text.len() > crate::subscriptions::filters::MAX_FILTERS_BYTES);
        let s = decode("eu", &kv("eu", text.as_bytes())).unwrap();
        let FilterExpr::Exact(got) = &s.spec.filters[0] else {
            panic!("{:?}", s.spec.filters)
        };
        assert_eq!(got.len(), 200);
        assert!(crate::subscriptions::check_write_bounds(None, &s.spec.filters).is_err());
        assert_eq!(encode(&s.spec).unwrap(), text.into_bytes());
    }

    /// Pins the version 1 format: this exact text must keep decoding to this value.
    #[test]
    fn pinned_version_1_record() {
        let text = br#"{"v":1,"name":"audit","topic":"orders","max_attempts":3,"ack_timeout_ms":1500,"backoff":{"initial_ms":10,"max_ms":20},"filter":{"type":"order.created"},"push":{"url":"http://hook/x"},"start":"earliest"}"#;
        let s = decode("audit", &kv("audit", text)).unwrap();
        assert_eq!(
            s.spec,
            SubscriptionSpec {
                name: "audit".into(),
                topic: "orders".into(),
                max_attempts: 3,
                ack_timeout_ms: 1500,
                backoff: Backoff {
                    initial_ms: 10,
                    max_ms: 20
                },
                filter: Some(Filter {
                    event_type: Some("order.created".into()),
                    source: None
                }),
                filters: Vec::new(),
                push: Some(Push::new("http://hook/x")),
                start: StartPosition::Earliest,
                ordering: Ordering::None,
            }
        );
        // And a spec with the defaults encodes to the documented shape.
        let spec = SubscriptionSpec::new("a", "t");
        assert_eq!(
            String::from_utf8(encode(&spec).unwrap()).unwrap(),
            r#"{"v":1,"name":"a","topic":"t","max_attempts":5,"ack_timeout_ms":30000,"backoff":{"initial_ms":1000,"max_ms":60000},"start":"latest"}"#
        );
    }

    #[test]
    fn fields_a_newer_release_wrote_are_ignored_at_every_level() {
        let good = String::from_utf8(encode(&SubscriptionSpec::new("a", "t")).unwrap()).unwrap();
        let newer = good
            .replace(r#""start""#, r#""priority":"high","start""#)
            .replace(r#""max_ms":60000"#, r#""max_ms":60000,"jitter":0.1"#);
        assert_ne!(newer, good);
        assert_eq!(
            decode_value("a", newer.as_bytes()),
            decode_value("a", good.as_bytes())
        );
    }

    #[test]
    fn corrupt_records_are_reported_with_a_reason() {
        let good = encode(&SubscriptionSpec::new("a", "t")).unwrap();
        let good = String::from_utf8(good).unwrap();
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
            (
                good.replace(r#""v":1"#, r#""v":1.0"#),
                "unknown record version",
            ),
            (good.replace(r#""topic":"t","#, ""), "malformed"),
            (
                good.replace(r#""start":"latest""#, r#""start":"middle""#),
                "malformed",
            ),
            (
                good.replace(r#""max_attempts":5"#, r#""max_attempts":-5"#),
                "malformed",
            ),
            (
                good.replace(r#""max_attempts":5"#, r#""max_attempts":"5""#),
                "malformed",
            ),
            (
                good.replace(r#""max_attempts":5"#, r#""max_attempts":0"#),
                "invalid value",
            ),
            (
                good.replace(r#""initial_ms":1000"#, r#""initial_ms":70000"#),
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
            assert_eq!(err.key, "meshd/v1/subscriptions/a");
        }
    }

    #[test]
    fn keys_that_are_not_one_component_are_rejected() {
        assert!(name_of(b"meshd/v1/subscriptions/a/b").is_err());
        assert!(name_of(b"meshd/v1/subscriptions/a%zz").is_err());
        assert!(name_of(b"meshd/v1/sessions/a").is_err());
        assert_eq!(name_of(&key("a/b")).unwrap(), "a/b");
    }
}
