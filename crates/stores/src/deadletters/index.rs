//! The id index record: the value of `meshd/v1/deadletters/ids/{id}`, which says
//! under which subscription entry `id` lives, so an entry can be read by id alone.
//! Written and deleted in the same Meta transaction as the entry it points to.
//!
//! JSON, versioned: `{"v":1,"subscription":"billing"}`. Anything else is corrupt.

use crate::codec::decode_named;
use serde::{Deserialize, Serialize};

/// The record version this module writes.
pub const VERSION: u64 = 1;

#[derive(Serialize, Deserialize)]
struct IndexV1 {
    v: u64,
    subscription: String,
}

pub fn encode(subscription: &str) -> Result<Vec<u8>, String> {
    serde_json::to_vec(&IndexV1 {
        v: VERSION,
        subscription: subscription.to_string(),
    })
    .map_err(|e| format!("encoding dead-letter index record: {e}"))
}

/// The subscription the index record names.
pub fn decode(bytes: &[u8]) -> Result<String, String> {
    let r: IndexV1 = decode_named(bytes, VERSION, "dead-letter index record")?;
    if r.subscription.is_empty() {
        return Err("dead-letter index record names no subscription".into());
    }
    Ok(r.subscription)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trips(sub in ".{1,40}") {
            prop_assert_eq!(decode(&encode(&sub).unwrap()).unwrap(), sub);
        }

        #[test]
        fn every_truncation_is_corrupt(sub in ".{1,40}", cut in any::<proptest::sample::Index>()) {
            let bytes = encode(&sub).unwrap();
            prop_assert!(decode(&bytes[..cut.index(bytes.len())]).is_err());
        }
    }

    #[test]
    fn pinned_format_and_corrupt_records() {
        assert_eq!(
            encode("billing").unwrap(),
            br#"{"v":1,"subscription":"billing"}"#
        );
        for bad in [
            &br#"{"v":2,"subscription":"billing"}"#[..],
            br#"{"subscription":"billing"}"#,
            br#"{"v":1}"#,
            br#"{"v":1,"subscription":""}"#,
            br#"{"v":1,"subscription":7}"#,
            b"garbage",
            b"",
        ] {
            assert!(decode(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        // A field a newer release wrote is ignored.
        assert_eq!(
            decode(br#"{"v":1,"subscription":"billing","x":1}"#),
            Ok("billing".to_string())
        );
    }
}
