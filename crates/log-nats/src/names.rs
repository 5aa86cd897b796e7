//! Every JetStream stream and NATS subject this log uses, in one place.
//!
//! With namespace `ns` (default `meshd`; `[A-Za-z0-9-]`, so the first `_` of a stream
//! name always ends it):
//!
//! | what | stream | subject |
//! |---|---|---|
//! | partition `p` of topic `t` | `ns_log_{esc(t)}_{p}` | `ns.log.{esc(t)}.{p}` |
//! | "stored" notices (headers only, republished by JetStream after the store) | — | `ns.appended.{esc(t)}.{p}` |
//! | dead-letter bodies | `ns_dlq` | `ns.dlq` |
//! | park journal (one entry per subject: the last message is the entry or its tombstone) | `ns_park` | `ns.park.{esc(subscription)}.{incarnation}.{esc(t)}.{p}.{offset}` |
//!
//! `esc` keeps `[A-Za-z0-9-]` and writes every other byte as `_` + two upper-case hex
//! digits (`.` → `_2E`, `_` → `_5F`), so it is injective, never contains `.`, `*`,
//! `>` or whitespace, and is a valid stream-name part and subject token. JetStream
//! limits stream names to 255 bytes (they become directory names); a longer one keeps
//! a readable prefix and ends in `_H` + 32 hex digits of the topic's SHA-256 (`H` is
//! not a hex digit, so such a name never equals an escaped one). Subjects always carry
//! the full escaped topic, so listing a topic's streams by subject is exact.
//!
//! These names reach the server and stay there: changing them orphans existing data.

use meshd_stores::offsets::OffsetKey;
use sha2::{Digest, Sha256};

/// JetStream's limit on stream names.
const MAX_STREAM_NAME: usize = 255;
/// Escaped topic bytes kept in a hashed (long) stream name.
const HASHED_PREFIX: usize = 64;

/// Escapes a topic (or any string) into a stream-name part / subject token.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' {
            out.push(b as char);
        } else {
            out.push_str(&format!("_{b:02X}"));
        }
    }
    out
}

/// Reverses [`escape`]; `None` for anything `escape` cannot produce.
pub fn unescape(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'_' {
            let hex = s.get(i + 1..i + 3)?;
            if hex.bytes().any(|c| c.is_ascii_lowercase()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else if b[i].is_ascii_alphanumeric() || b[i] == b'-' {
            out.push(b[i]);
            i += 1;
        } else {
            return None;
        }
    }
    let text = String::from_utf8(out).ok()?;
    (escape(&text) == s).then_some(text)
}

/// The names of one namespace.
#[derive(Clone, Debug)]
pub struct Names {
    ns: String,
}

impl Names {
    /// `ns` must already be validated (`[A-Za-z0-9-]`, 1–32 bytes).
    pub fn new(ns: &str) -> Self {
        Self { ns: ns.to_string() }
    }

    pub fn namespace(&self) -> &str {
        &self.ns
    }

    /// The stream of one partition.
    pub fn partition_stream(&self, topic: &str, partition: u32) -> String {
        let esc = escape(topic);
        let full = format!("{}_log_{esc}_{partition}", self.ns);
        if full.len() <= MAX_STREAM_NAME {
            return full;
        }
        // Cut at a character boundary of the escaped form (it is ASCII).
        let mut keep = HASHED_PREFIX.min(esc.len());
        // Never cut an escape in half: a trailing `_X` or `_` is dropped.
        while keep > 0 && esc[..keep].rfind('_').is_some_and(|i| i + 3 > keep) {
            keep -= 1;
        }
        let hash = hex::encode(&Sha256::digest(topic.as_bytes())[..16]);
        format!("{}_log_{}_H{hash}_{partition}", self.ns, &esc[..keep])
    }

    /// The subject every event of one partition is published on.
    pub fn partition_subject(&self, topic: &str, partition: u32) -> String {
        format!("{}.log.{}.{partition}", self.ns, escape(topic))
    }

    /// Matches the subjects of every partition of `topic`.
    pub fn topic_filter(&self, topic: &str) -> String {
        format!("{}.log.{}.*", self.ns, escape(topic))
    }

    /// Matches the subjects of every partition of every topic.
    pub fn all_partitions_filter(&self) -> String {
        format!("{}.log.>", self.ns)
    }

    /// Where JetStream republishes (headers only) what a partition stream stored.
    pub fn appended_subject(&self, topic: &str, partition: u32) -> String {
        format!("{}.appended.{}.{partition}", self.ns, escape(topic))
    }

    /// Matches every "stored" notice of this namespace.
    pub fn appended_filter(&self) -> String {
        format!("{}.appended.>", self.ns)
    }

    /// (topic, partition) of a partition subject of this namespace.
    pub fn parse_partition_subject(&self, subject: &str) -> Option<(String, u32)> {
        self.parse(subject, ".log.")
    }

    /// (topic, partition) of a "stored" notice subject of this namespace.
    pub fn parse_appended_subject(&self, subject: &str) -> Option<(String, u32)> {
        self.parse(subject, ".appended.")
    }

    fn parse(&self, subject: &str, kind: &str) -> Option<(String, u32)> {
        let rest = subject.strip_prefix(&self.ns)?.strip_prefix(kind)?;
        let (esc, partition) = rest.rsplit_once('.')?;
        Some((unescape(esc)?, partition.parse().ok()?))
    }

    pub fn dlq_stream(&self) -> String {
        format!("{}_dlq", self.ns)
    }

    pub fn dlq_subject(&self) -> String {
        format!("{}.dlq", self.ns)
    }

    pub fn park_stream(&self) -> String {
        format!("{}_park", self.ns)
    }

    /// Matches every park journal subject of this namespace.
    pub fn park_filter(&self) -> String {
        format!("{}.park.>", self.ns)
    }

    /// The park journal subjects of one subscription incarnation's partition.
    pub fn park_partition_filter(&self, key: &OffsetKey) -> String {
        format!("{}.*", self.park_partition(key))
    }

    /// The park journal subject of one entry.
    pub fn park_subject(&self, key: &OffsetKey, offset: u64) -> String {
        format!("{}.{offset}", self.park_partition(key))
    }

    /// The subject tokens of a partition's park journal, without the offset.
    fn park_partition(&self, key: &OffsetKey) -> String {
        format!(
            "{}.park.{}.{}.{}.{}",
            self.ns,
            escape(&key.subscription),
            key.incarnation,
            escape(&key.topic),
            key.partition
        )
    }

    /// Every park journal subject of one subscription incarnation.
    pub fn park_subscription_filter(&self, subscription: &str, incarnation: i64) -> String {
        format!("{}.park.{}.{incarnation}.>", self.ns, escape(subscription))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    proptest! {
        #[test]
        fn escaping_round_trips_and_is_a_clean_token(s in "[A-Za-z0-9._-]{1,40}|\\PC{1,10}") {
            let e = escape(&s);
            prop_assert_eq!(unescape(&e), Some(s.clone()));
            prop_assert!(!e.contains(['.', '*', '>', ' ', '/', '\\']));
        }

        #[test]
        fn different_partitions_get_different_streams(a in "[a-z._]{1,6}", b in "[a-z._]{1,6}", p in 0u32..4, q in 0u32..4) {
            let n = Names::new("meshd");
            if (a.clone(), p) != (b.clone(), q) {
                prop_assert_ne!(n.partition_stream(&a, p), n.partition_stream(&b, q));
                prop_assert_ne!(n.partition_subject(&a, p), n.partition_subject(&b, q));
            }
        }
    }

    #[test]
    fn names_look_as_documented() {
        let n = Names::new("meshd");
        assert_eq!(
            n.partition_stream("orders.eu_1", 3),
            "meshd_log_orders_2Eeu_5F1_3"
        );
        assert_eq!(
            n.partition_subject("orders.eu_1", 3),
            "meshd.log.orders_2Eeu_5F1.3"
        );
        assert_eq!(n.appended_subject("o", 0), "meshd.appended.o.0");
        assert_eq!(
            n.parse_partition_subject("meshd.log.orders_2Eeu_5F1.3"),
            Some(("orders.eu_1".to_string(), 3))
        );
        assert_eq!(n.parse_partition_subject("other.log.a.1"), None);
        assert_eq!(
            n.parse_appended_subject(&n.appended_subject("orders.eu_1", 3)),
            Some(("orders.eu_1".to_string(), 3))
        );
        assert_eq!(n.parse_appended_subject("meshd.log.o.0"), None);
        assert_eq!(n.parse_appended_subject("meshd.appended.o.x"), None);
        assert_eq!(n.dlq_stream(), "meshd_dlq");
        assert_eq!(n.park_stream(), "meshd_park");
        let key = OffsetKey {
            subscription: "billing.eu".into(),
            incarnation: 7,
            topic: "orders".into(),
            partition: 2,
        };
        assert_eq!(
            n.park_subject(&key, 42),
            "meshd.park.billing_2Eeu.7.orders.2.42"
        );
        assert_eq!(
            n.park_partition_filter(&key),
            "meshd.park.billing_2Eeu.7.orders.2.*"
        );
        assert_eq!(
            n.park_subscription_filter("billing.eu", 7),
            "meshd.park.billing_2Eeu.7.>"
        );
    }

    #[test]
    fn long_topics_get_bounded_distinct_stream_names() {
        let n = Names::new("meshd");
        let dots = ".".repeat(249);
        let mut seen = HashSet::new();
        for topic in [
            dots.clone(),
            format!("{}a", ".".repeat(248)),
            "x".repeat(249),
        ] {
            for p in [0, 1023] {
                let name = n.partition_stream(&topic, p);
                assert!(name.len() <= MAX_STREAM_NAME, "{name}");
                assert!(!name.contains('.'));
                assert!(seen.insert(name));
            }
        }
        assert!(n.partition_stream(&dots, 0).contains("_H"));
        // A hashed name keeps whole escapes only.
        let name = n.partition_stream(&dots, 0);
        let prefix = name
            .strip_prefix("meshd_log_")
            .and_then(|s| s.split("_H").next())
            .unwrap();
        assert_eq!(unescape(prefix).map(|s| s.len()), Some(prefix.len() / 3));
    }
}
