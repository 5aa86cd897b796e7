//! Choosing an event's partition: a hash that must never change.
//!
//! The same `partitionkey` must land in the same partition forever: across restarts,
//! upgrades, platforms and Rust releases (per-key ordering depends on it). So the hash
//! is written out here, not taken from `std::hash` (whose `DefaultHasher` output is
//! explicitly unstable). The `pinned_*` tests fix its output; changing it is a breaking
//! change to every topic's data.

use crate::event::Event;

const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64 bit.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(FNV_OFFSET_BASIS, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(FNV_PRIME)
    })
}

/// MurmurHash3's 64-bit finalizer. FNV-1a's low bits depend only on the low bits of
/// each input byte (multiplication carries upward only), so `hash % 4` would put
/// `order-1` and `order-5` together; mixing the high bits down fixes that.
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^= k >> 33;
    k
}

/// The partition of `key` among `partitions` (a `partitions` of 0 is treated as 1).
pub fn partition_for_key(key: &[u8], partitions: u32) -> u32 {
    let n = u64::from(partitions.max(1));
    // The remainder is below `partitions`, so it fits in a u32.
    (fmix64(fnv1a64(key)) % n) as u32
}

/// The partition of `event`: by its `partitionkey` extension when present, otherwise by
/// its `id`. Always `< partitions` (for `partitions >= 1`).
pub fn partition_for(event: &Event, partitions: u32) -> u32 {
    let key = event.partition_key().unwrap_or(event.id());
    partition_for_key(key.as_bytes(), partitions)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_published_test_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    /// The partition function, pinned. If this fails, the change would move existing
    /// keys to other partitions: do not "fix" the expected values.
    #[test]
    fn pinned_partitions_never_change() {
        let pins: [(&str, u64, [u32; 7]); 6] = [
            ("", 0xefd01f60ba992926, [0, 0, 2, 2, 1, 6, 294]),
            ("a", 0x82a2a958a9bece5b, [0, 1, 2, 3, 1, 11, 603]),
            ("order-1", 0x491b422e3af0d9a5, [0, 1, 1, 1, 1, 5, 421]),
            ("order-5", 0x1e834ec252b0beb7, [0, 1, 2, 3, 5, 7, 695]),
            ("customer/42", 0x3761be1a49dc0939, [0, 1, 1, 1, 0, 9, 313]),
            ("€", 0x970485f2258ff304, [0, 0, 0, 0, 5, 4, 772]),
        ];
        for (key, hash, expected) in pins {
            assert_eq!(fmix64(fnv1a64(key.as_bytes())), hash, "{key:?}");
            let got = [1, 2, 3, 4, 7, 16, 1024].map(|n| partition_for_key(key.as_bytes(), n));
            assert_eq!(got, expected, "{key:?}");
        }
    }

    #[test]
    fn zero_partitions_is_treated_as_one() {
        assert_eq!(partition_for_key(b"x", 0), 0);
    }

    /// Sequential keys spread evenly even over a power-of-two count (plain FNV-1a
    /// modulo 4 would not: its low bits see only the low bits of each byte).
    #[test]
    fn sequential_keys_spread_over_partitions() {
        for partitions in [2u32, 4, 8, 12] {
            let mut counts = vec![0u32; partitions as usize];
            for i in 0..10_000 {
                counts[partition_for_key(format!("order-{i}").as_bytes(), partitions) as usize] +=
                    1;
            }
            let expected = 10_000 / partitions;
            for c in &counts {
                assert!(
                    c.abs_diff(expected) < expected / 10,
                    "{partitions} partitions: {counts:?}"
                );
            }
        }
    }

    #[test]
    fn partitionkey_wins_over_id() {
        let parse = |body: &str| {
            crate::parse_publish(
                Some(crate::STRUCTURED_CONTENT_TYPE),
                &[],
                body.as_bytes(),
                &crate::Limits::default(),
            )
            .unwrap()
            .remove(0)
        };
        let keyed = |id: &str| {
            parse(&format!(
                r#"{{"specversion":"1.0","id":"{id}","source":"/s","type":"t","partitionkey":"customer/42"}}"#
            ))
        };
        let unkeyed = parse(r#"{"specversion":"1.0","id":"a","source":"/s","type":"t"}"#);
        assert_eq!(partition_for(&unkeyed, 1024), 603);
        for id in ["a", "b", "c", "order-5"] {
            assert_eq!(partition_for(&keyed(id), 1024), 313);
        }
    }
}
