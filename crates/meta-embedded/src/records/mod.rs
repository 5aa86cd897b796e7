//! The embedded Meta's persisted records and their keys, one module per record
//! (house style 9). Everything lives in the `meta` column family of the Local RocksDB.
//!
//! | key | record | lifetime |
//! |---|---|---|
//! | `s` | [`state::StateRecord`]: revision, history start, next lease id | forever; rewritten with every change |
//! | `k` + user key | [`key_record::KeyRecord`]: value, create/mod revision, version, lease | until deleted |
//! | `h` + revision (u64 BE) | [`history::HistoryRecord`]: the events of one revision | until compacted (bounded history) |
//! | `l` + lease id (u64 BE) | [`lease::LeaseRecord`]: the TTL | until revoked or expired |
//! | `a` + lease id (u64 BE) + user key | empty: "this key is attached to this lease" | with the attachment |
//!
//! Prefixes are single bytes and are never reused for another meaning.

pub mod history;
pub mod key_record;
pub mod lease;
pub mod state;

pub use meshd_local::codec::DecodeError;

/// The column family of the embedded Meta in the Local RocksDB.
pub const CF: &str = "meta";

pub const STATE_KEY: &[u8] = b"s";
pub const KEY_PREFIX: u8 = b'k';
pub const HISTORY_PREFIX: u8 = b'h';
pub const LEASE_PREFIX: u8 = b'l';
pub const ATTACH_PREFIX: u8 = b'a';

pub fn key_key(user_key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + user_key.len());
    k.push(KEY_PREFIX);
    k.extend_from_slice(user_key);
    k
}

pub fn history_key(revision: i64) -> Vec<u8> {
    let mut k = vec![HISTORY_PREFIX];
    k.extend_from_slice(&(revision as u64).to_be_bytes());
    k
}

pub fn lease_key(lease: i64) -> Vec<u8> {
    let mut k = vec![LEASE_PREFIX];
    k.extend_from_slice(&(lease as u64).to_be_bytes());
    k
}

pub fn attach_prefix(lease: i64) -> Vec<u8> {
    let mut k = vec![ATTACH_PREFIX];
    k.extend_from_slice(&(lease as u64).to_be_bytes());
    k
}

pub fn attach_key(lease: i64, user_key: &[u8]) -> Vec<u8> {
    let mut k = attach_prefix(lease);
    k.extend_from_slice(user_key);
    k
}

/// Decodes the lease id of a `l` key.
pub fn lease_id_of(key: &[u8]) -> Option<i64> {
    let b: [u8; 8] = key.get(1..9)?.try_into().ok()?;
    Some(u64::from_be_bytes(b) as i64)
}

/// The on-disk format is pinned: these bytes were written by format version 1 and
/// must decode to the same values in every later version (house style 19).
#[cfg(test)]
mod pinned_format {
    use super::history::HistoryRecord;
    use super::key_record::KeyRecord;
    use super::lease::LeaseRecord;
    use super::state::StateRecord;
    use meshd_meta::{KeyValue, LeaseId, WatchEvent};

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    const STATE_V1: &str = include_str!("../../tests/fixtures/state_v1.hex");
    const KEY_V1: &str = include_str!("../../tests/fixtures/key_record_v1.hex");
    const LEASE_V1: &str = include_str!("../../tests/fixtures/lease_v1.hex");
    const HISTORY_V1: &str = include_str!("../../tests/fixtures/history_v1.hex");

    fn state() -> StateRecord {
        StateRecord {
            revision: 42,
            history_start: 7,
            next_lease: 3,
        }
    }
    fn key() -> KeyRecord {
        KeyRecord {
            value: b"hello".to_vec(),
            create_revision: 5,
            mod_revision: 9,
            version: 2,
            lease: 3,
        }
    }
    fn history() -> HistoryRecord {
        HistoryRecord {
            revision: 9,
            events: vec![
                WatchEvent::Put(KeyValue {
                    key: b"a".to_vec(),
                    value: b"b".to_vec(),
                    create_revision: 5,
                    mod_revision: 9,
                    version: 2,
                    lease: Some(LeaseId(3)),
                }),
                WatchEvent::Delete {
                    key: b"c".to_vec(),
                    revision: 9,
                },
            ],
        }
    }

    #[test]
    fn version_1_records_still_decode() {
        assert_eq!(StateRecord::decode(&hex(STATE_V1.trim())), Ok(state()));
        assert_eq!(KeyRecord::decode(&hex(KEY_V1.trim())), Ok(key()));
        assert_eq!(
            LeaseRecord::decode(&hex(LEASE_V1.trim())),
            Ok(LeaseRecord { ttl_ms: 1500 })
        );
        assert_eq!(
            HistoryRecord::decode(&hex(HISTORY_V1.trim())),
            Ok(history())
        );
    }

    #[test]
    fn version_1_is_still_what_we_write() {
        let enc = |b: Vec<u8>| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(enc(state().encode()), STATE_V1.trim());
        assert_eq!(enc(key().encode()), KEY_V1.trim());
        assert_eq!(enc(LeaseRecord { ttl_ms: 1500 }.encode()), LEASE_V1.trim());
        assert_eq!(enc(history().encode()), HISTORY_V1.trim());
    }
}

/// Fuzzing the embedded Meta's records (docs/fuzzing.md). They are
/// read at open (recovery) and on every get and watch, so damaged bytes must be a
/// reported error, never a panic that crash-loops the instance, and never a value:
/// whatever decodes re-encodes to exactly the bytes it came from.
#[cfg(test)]
mod fuzz {
    use super::history::HistoryRecord;
    use super::key_record::KeyRecord;
    use super::lease::LeaseRecord;
    use super::state::StateRecord;
    use super::*;
    use meshd_fuzz_cases::cases;
    use proptest::prelude::*;

    fn crc32(bytes: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &b in bytes {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0xEDB8_8320
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    /// Plausible tokens: event kinds and small counts, length prefixes that may lie,
    /// small and extreme whole numbers, raw bytes.
    fn payload() -> impl Strategy<Value = Vec<u8>> {
        let token = prop_oneof![
            (0u8..4).prop_map(|b| vec![b]),
            (0u32..6).prop_map(|n| n.to_le_bytes().to_vec()),
            (0u32..16, proptest::collection::vec(any::<u8>(), 0..16)).prop_map(|(n, b)| {
                let mut v = n.to_le_bytes().to_vec();
                v.extend(b);
                v
            }),
            any::<u32>().prop_map(|n| n.to_le_bytes().to_vec()),
            (-2i64..12).prop_map(|n| n.to_le_bytes().to_vec()),
            any::<i64>().prop_map(|n| n.to_le_bytes().to_vec()),
            proptest::collection::vec(any::<u8>(), 0..8),
        ];
        proptest::collection::vec(token, 0..12).prop_map(|t| t.concat())
    }

    /// Arbitrary bytes, or a payload sealed as version 1 (or another) with a valid
    /// checksum, so it reaches the field decoding.
    fn record_bytes() -> impl Strategy<Value = Vec<u8>> {
        let seal = |version: u8, payload: Vec<u8>| {
            let mut b = vec![version];
            b.extend(payload);
            let crc = crc32(&b);
            b.extend_from_slice(&crc.to_le_bytes());
            b
        };
        prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..64),
            payload().prop_map(move |p| seal(1, p)),
            (any::<u8>(), payload()).prop_map(move |(v, p)| seal(v, p)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn state_record_decode(bytes in record_bytes()) {
            if let Ok(r) = StateRecord::decode(&bytes) {
                prop_assert!(r.revision >= 0 && r.history_start >= 1 && r.next_lease >= 1);
                prop_assert_eq!(r.encode(), bytes);
            }
        }

        #[test]
        fn key_record_decode(bytes in record_bytes(), key in proptest::collection::vec(any::<u8>(), 0..8)) {
            if let Ok(r) = KeyRecord::decode(&bytes) {
                prop_assert!(r.create_revision >= 1 && r.mod_revision >= r.create_revision && r.version >= 1);
                prop_assert_eq!(r.encode(), bytes.clone());
                let kv = r.to_kv(&key);
                prop_assert_eq!(kv.lease.is_some(), r.lease != 0);
            }
        }

        #[test]
        fn lease_record_decode(bytes in record_bytes()) {
            if let Ok(r) = LeaseRecord::decode(&bytes) {
                prop_assert!(r.ttl_ms >= 1);
                prop_assert_eq!(r.encode(), bytes);
            }
        }

        /// History records carry a count the decoder must not trust for allocation.
        #[test]
        fn history_record_decode(bytes in record_bytes()) {
            if let Ok(r) = HistoryRecord::decode(&bytes) {
                prop_assert!(r.revision >= 1);
                prop_assert_eq!(r.encode(), bytes);
            }
        }

        #[test]
        fn lease_key_parse(key in proptest::collection::vec(any::<u8>(), 0..16)) {
            if let Some(id) = lease_id_of(&key) {
                prop_assert_eq!(&lease_key(id)[1..], &key[1..9]);
            }
        }
    }
}
