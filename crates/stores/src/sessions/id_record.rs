//! # The session-id record: key and value codec
//!
//! Key: `meshd/v1/sessions/id/{session_id}`, attached to the session's lease and
//! written in the same transaction as the owner key ([`super::record`]). It maps a
//! session id to its client id, so any instance can find a session by id without a
//! cache. It outlives a takeover (it stays on the *old* lease, which nobody renews
//! any more), which is how a fenced session is told apart from an unknown one until
//! its lease would have expired.
//!
//! The `client` and `id` first components keep the two key families apart: keys are
//! built from escaped components, so no client id or session id can produce a key of
//! the other family.
//!
//! Value: `{"v":1,"client_id":"c-1"}`.

use crate::cache::CorruptRecord;
use crate::codec::decode_probed;
use crate::subscriptions::validate_name;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::KeyValue;
use serde::{Deserialize, Serialize};

pub const VERSION: u32 = 1;

/// The first key component of session-id keys.
pub const ID_COMPONENT: &str = "id";

/// The session-id key of `session_id`.
pub fn key(session_id: &str) -> Vec<u8> {
    keys::key(KeyKind::Sessions, &[ID_COMPONENT, session_id])
}

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct RecordV1 {
    v: u32,
    client_id: String,
}

pub fn encode(client_id: &str) -> Result<Vec<u8>, String> {
    serde_json::to_vec(&RecordV1 {
        v: VERSION,
        client_id: client_id.to_string(),
    })
    .map_err(|e| format!("encoding session id record: {e}"))
}

/// The client id stored in a session-id value.
pub fn decode_value(value: &[u8]) -> Result<String, String> {
    let r: RecordV1 = decode_probed(value, VERSION)?;
    validate_name(&r.client_id).map_err(|e| format!("invalid client id: {e}"))?;
    Ok(r.client_id)
}

pub(crate) fn decode(kv: &KeyValue) -> Result<String, CorruptRecord> {
    decode_value(&kv.value).map_err(|reason| CorruptRecord::new(&kv.key, reason))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trips(client in "[A-Za-z0-9._-]{1,249}") {
            prop_assert_eq!(decode_value(&encode(&client).unwrap()).unwrap(), client);
        }

        #[test]
        fn every_truncation_is_corrupt(client in "[A-Za-z0-9._-]{1,40}", cut in 0usize..100) {
            let bytes = encode(&client).unwrap();
            let cut = cut % bytes.len();
            prop_assert!(decode_value(&bytes[..cut]).is_err());
        }

        #[test]
        fn garbage_is_corrupt(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            prop_assert!(decode_value(&bytes).is_err());
        }

        #[test]
        fn the_two_key_families_never_collide(a in ".{0,20}", b in ".{0,20}") {
            prop_assert_ne!(key(&a), super::super::record::key(&b));
        }
    }

    #[test]
    fn pinned_version_1_record_and_layout() {
        assert_eq!(
            decode_value(br#"{"v":1,"client_id":"c-1"}"#).unwrap(),
            "c-1"
        );
        assert_eq!(
            key("000102030405060708090a0b0c0d0e0f"),
            b"meshd/v1/sessions/id/000102030405060708090a0b0c0d0e0f".to_vec()
        );
    }

    #[test]
    fn corrupt_records_are_reported() {
        for (text, expected) in [
            (&br#"{"client_id":"c"}"#[..], "no version"),
            (br#"{"v":2,"client_id":"c"}"#, "unknown record version"),
            (br#"{"v":1}"#, "malformed"),
            (br#"{"v":1,"client_id":"a/b"}"#, "invalid client id"),
            (b"{\"v\":1,\"client_id\":\"c\"", "not a JSON record"),
        ] {
            let err = decode_value(text).unwrap_err();
            assert!(err.contains(expected), "{err}");
        }
        // A field a newer release wrote is ignored.
        assert_eq!(
            decode_value(br#"{"v":1,"client_id":"c","x":1}"#),
            Ok("c".to_string())
        );
    }
}
