//! Dead-letter entry ids: derived from what identifies one delivery, so dead-lettering
//! the same delivery twice finds the same entry, and two instances with their own logs
//! never produce the same id.
//!
//! `id = hex(sha256(encoding)[..16])` (128 bits, 32 lowercase hex digits) over an
//! encoding that is unambiguous because every variable-length field carries its length
//! and every number has a fixed width:
//!
//! ```text
//! "meshd.deadletter.id.v1" 0x00
//! u64 BE len(log_id)  log_id
//! i64 BE subscription incarnation
//! u64 BE len(topic)   topic
//! u32 BE partition
//! u64 BE offset
//! ```

use sha2::{Digest, Sha256};

const DOMAIN: &[u8] = b"meshd.deadletter.id.v1\0";

/// The length of an entry id in hex digits.
pub const ID_LEN: usize = 32;

/// The id of the dead-letter entry of one delivery.
pub fn entry_id(
    log_id: &str,
    incarnation: i64,
    topic: &str,
    partition: u32,
    offset: u64,
) -> String {
    let mut h = Sha256::new();
    h.update(DOMAIN);
    h.update((log_id.len() as u64).to_be_bytes());
    h.update(log_id.as_bytes());
    h.update(incarnation.to_be_bytes());
    h.update((topic.len() as u64).to_be_bytes());
    h.update(topic.as_bytes());
    h.update(partition.to_be_bytes());
    h.update(offset.to_be_bytes());
    hex::encode(&h.finalize()[..ID_LEN / 2])
}

/// Whether `id` has the form of an entry id.
pub fn is_entry_id(id: &str) -> bool {
    id.len() == ID_LEN && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pinned_value() {
        // Ids reach Meta keys and the API: they must never change for a delivery.
        let id = entry_id("instance-1", 42, "orders", 3, 1000);
        assert!(is_entry_id(&id), "{id}");
        assert_eq!(id, entry_id("instance-1", 42, "orders", 3, 1000));
        assert_eq!(id, "bc3ae6a9e3f5858846cd6d00538b0c98");
    }

    #[test]
    fn shifting_bytes_between_fields_changes_the_id() {
        assert_ne!(entry_id("ab", 1, "c", 0, 0), entry_id("a", 1, "bc", 0, 0));
        assert_ne!(entry_id("a", 1, "b", 0, 0), entry_id("b", 1, "a", 0, 0));
        assert_ne!(entry_id("a", 1, "t", 0, 1), entry_id("a", 1, "t", 1, 0));
        assert_ne!(entry_id("a", 1, "t", 0, 0), entry_id("a", 2, "t", 0, 0));
    }

    proptest! {
        #[test]
        fn distinct_deliveries_get_distinct_ids(
            a in ("[a-c]{0,3}", -2i64..3, "[a-c]{0,3}", 0u32..3, 0u64..3),
            b in ("[a-c]{0,3}", -2i64..3, "[a-c]{0,3}", 0u32..3, 0u64..3),
        ) {
            let ia = entry_id(&a.0, a.1, &a.2, a.3, a.4);
            let ib = entry_id(&b.0, b.1, &b.2, b.3, b.4);
            prop_assert!(is_entry_id(&ia));
            prop_assert_eq!(a == b, ia == ib);
        }
    }
}
