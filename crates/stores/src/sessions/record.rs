//! # The session record (owner key of a client id): key and value codec
//!
//! Key: `meshd/v1/sessions/client/{client_id}`, attached to the session's lease. It
//! is the session's **owner key**: written exactly once per session, at open, so its
//! `mod_revision` is the session's epoch for as long as the session lives. Opening a
//! session for the same client id rewrites it (a takeover: a new, higher epoch);
//! nothing else ever writes it.
//!
//! Value: versioned JSON, `"v": 1`:
//!
//! ```json
//! {"v":1,"session_id":"6f1c...(32 hex)","client_id":"c-1","instance":"meshd-a","ttl_ms":2000,"lease":7587}
//! ```
//!
//! The epoch is not stored (it is the key's `mod_revision`, issued by Meta). The
//! stored `lease` must be the lease the key is attached to; a record that disagrees
//! with its key, its lease or its documented ranges is reported as corrupt.

use super::types::Session;
use crate::cache::CorruptRecord;
use crate::codec::decode_probed;
use crate::subscriptions::validate_name;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{KeyValue, LeaseId};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// The only record version this code writes and reads.
pub const VERSION: u32 = 1;

/// The first key component of owner keys.
pub const CLIENT_COMPONENT: &str = "client";

/// The owner key of client id `client_id`.
pub fn key(client_id: &str) -> Vec<u8> {
    keys::key(KeyKind::Sessions, &[CLIENT_COMPONENT, client_id])
}

/// The prefix of every owner key (the session cache watches it).
pub fn prefix() -> Vec<u8> {
    keys::prefix(KeyKind::Sessions, &[CLIENT_COMPONENT])
}

/// The client id of an owner key.
pub(crate) fn client_of(key: &[u8]) -> Result<String, CorruptRecord> {
    match keys::components(KeyKind::Sessions, key) {
        Some(mut parts) if parts.len() == 2 && parts[0] == CLIENT_COMPONENT => Ok(parts.remove(1)),
        _ => Err(CorruptRecord::new(
            key,
            "not a session owner key (expected sessions/client/{client_id})",
        )),
    }
}

/// Whether `id` has the shape of a session id: 32 lowercase hex digits (128 bits).
pub fn is_session_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct RecordV1 {
    v: u32,
    session_id: String,
    client_id: String,
    instance: String,
    ttl_ms: u64,
    lease: i64,
}

/// What the owner key stores (everything of a [`Session`] but its epoch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionValue {
    pub session_id: String,
    pub client_id: String,
    pub instance: String,
    pub ttl: Duration,
    pub lease: LeaseId,
}

pub fn encode(value: &SessionValue) -> Result<Vec<u8>, String> {
    let ttl_ms = u64::try_from(value.ttl.as_millis()).map_err(|_| "ttl out of range")?;
    serde_json::to_vec(&RecordV1 {
        v: VERSION,
        session_id: value.session_id.clone(),
        client_id: value.client_id.clone(),
        instance: value.instance.clone(),
        ttl_ms,
        lease: value.lease.0,
    })
    .map_err(|e| format!("encoding session record: {e}"))
}

/// Decodes the value stored under the owner key of `client_id`.
pub fn decode_value(client_id: &str, value: &[u8]) -> Result<SessionValue, String> {
    let r: RecordV1 = decode_probed(value, VERSION)?;
    if r.client_id != client_id {
        return Err(format!(
            "the record names client id {:?} but is stored under {client_id:?}",
            r.client_id
        ));
    }
    if !is_session_id(&r.session_id) {
        return Err(format!("invalid session id {:?}", r.session_id));
    }
    if r.instance.is_empty() {
        return Err("empty instance".into());
    }
    if r.ttl_ms == 0 {
        return Err("ttl_ms is 0".into());
    }
    if r.lease == 0 {
        return Err("lease is 0".into());
    }
    validate_name(&r.client_id).map_err(|e| format!("invalid client id: {e}"))?;
    Ok(SessionValue {
        session_id: r.session_id,
        client_id: r.client_id,
        instance: r.instance,
        ttl: Duration::from_millis(r.ttl_ms),
        lease: LeaseId(r.lease),
    })
}

/// Decodes an owner key-value into a session (epoch = `mod_revision`).
pub(crate) fn decode(client_id: &str, kv: &KeyValue) -> Result<Session, CorruptRecord> {
    let corrupt = |reason: String| CorruptRecord::new(&kv.key, reason);
    let v = decode_value(client_id, &kv.value).map_err(corrupt)?;
    if kv.lease != Some(v.lease) {
        return Err(corrupt(format!(
            "the record names lease {} but the key is attached to {:?}",
            v.lease, kv.lease
        )));
    }
    Ok(Session {
        session_id: v.session_id,
        client_id: v.client_id,
        epoch: kv.mod_revision,
        instance: v.instance,
        ttl: v.ttl,
        lease: v.lease,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kv(client: &str, value: &[u8], lease: i64) -> KeyValue {
        KeyValue {
            key: key(client),
            value: value.to_vec(),
            create_revision: 4,
            mod_revision: 9,
            version: 1,
            lease: Some(LeaseId(lease)),
        }
    }

    prop_compose! {
        fn value_strategy()(
            session_id in "[0-9a-f]{32}",
            client_id in "[A-Za-z0-9._-]{1,40}",
            instance in "[a-z0-9-]{1,20}",
            ttl_ms in 1u64..10_000_000,
            lease in (1i64..i64::MAX).prop_union(i64::MIN..0),
        ) -> SessionValue {
            SessionValue { session_id, client_id, instance, ttl: Duration::from_millis(ttl_ms), lease: LeaseId(lease) }
        }
    }

    proptest! {
        #[test]
        fn round_trips(v in value_strategy()) {
            let bytes = encode(&v).unwrap();
            let s = decode(&v.client_id, &kv(&v.client_id, &bytes, v.lease.0)).unwrap();
            prop_assert_eq!(s.epoch, 9);
            prop_assert_eq!(
                SessionValue { session_id: s.session_id, client_id: s.client_id, instance: s.instance, ttl: s.ttl, lease: s.lease },
                v
            );
        }

        #[test]
        fn every_truncation_is_corrupt(v in value_strategy(), cut in 0usize..1000) {
            let bytes = encode(&v).unwrap();
            let cut = cut % bytes.len();
            prop_assert!(decode(&v.client_id, &kv(&v.client_id, &bytes[..cut], v.lease.0)).is_err());
        }

        #[test]
        fn garbage_is_corrupt(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(decode("c", &kv("c", &bytes, 1)).is_err());
        }

        #[test]
        fn owner_keys_round_trip(client in ".{1,30}") {
            prop_assert_eq!(client_of(&key(&client)).unwrap(), client);
        }
    }

    #[test]
    fn pinned_version_1_record() {
        let text = br#"{"v":1,"session_id":"000102030405060708090a0b0c0d0e0f","client_id":"c-1","instance":"meshd-a","ttl_ms":2000,"lease":7587}"#;
        let s = decode("c-1", &kv("c-1", text, 7587)).unwrap();
        assert_eq!(
            s,
            Session {
                session_id: "000102030405060708090a0b0c0d0e0f".into(),
                client_id: "c-1".into(),
                epoch: 9,
                instance: "meshd-a".into(),
                ttl: Duration::from_secs(2),
                lease: LeaseId(7587),
            }
        );
        assert_eq!(
            key("c-1"),
            b"meshd/v1/sessions/client/c-1".to_vec(),
            "the owner key layout is pinned"
        );
    }

    #[test]
    fn corrupt_records_are_reported_with_a_reason() {
        let good = String::from_utf8(
            encode(&SessionValue {
                session_id: "000102030405060708090a0b0c0d0e0f".into(),
                client_id: "c".into(),
                instance: "i".into(),
                ttl: Duration::from_secs(2),
                lease: LeaseId(5),
            })
            .unwrap(),
        )
        .unwrap();
        let cases: Vec<(String, i64, &str)> = vec![
            (String::new(), 5, "not a JSON record"),
            (good.replace(r#""v":1,"#, ""), 5, "no version"),
            (
                good.replace(r#""v":1"#, r#""v":7"#),
                5,
                "unknown record version 7",
            ),
            (
                good.replace(r#""lease":5"#, r#""lease":"5""#),
                5,
                "malformed",
            ),
            (good.replace(r#""instance":"i","#, ""), 5, "malformed"),
            (
                good.replace(r#""client_id":"c""#, r#""client_id":"d""#),
                5,
                "stored under",
            ),
            (good.replace("0e0f", "0e0F"), 5, "invalid session id"),
            (
                good.replace(r#""ttl_ms":2000"#, r#""ttl_ms":0"#),
                5,
                "ttl_ms is 0",
            ),
            (good.clone(), 6, "attached to"),
        ];
        // A field a newer release wrote is ignored.
        let newer = good.replace(r#""ttl_ms""#, r#""x":0,"ttl_ms""#);
        assert_eq!(
            decode("c", &kv("c", newer.as_bytes(), 5)).map_err(|e| e.reason),
            decode("c", &kv("c", good.as_bytes(), 5)).map_err(|e| e.reason)
        );
        for (text, lease, expected) in cases {
            let err = decode("c", &kv("c", text.as_bytes(), lease)).unwrap_err();
            assert!(
                err.reason.contains(expected),
                "{text:?}: expected {expected:?} in {:?}",
                err.reason
            );
        }
        let mut unleased = kv("c", good.as_bytes(), 5);
        unleased.lease = None;
        assert!(decode("c", &unleased).is_err());
    }

    #[test]
    fn session_id_shape() {
        assert!(is_session_id("000102030405060708090a0b0c0d0e0f"));
        assert!(!is_session_id("000102030405060708090a0b0c0d0e0"));
        assert!(!is_session_id("000102030405060708090A0B0C0D0E0F"));
        assert!(!is_session_id("../../../../../../../../../../.."));
    }
}
