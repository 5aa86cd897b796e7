//! Fuzzing the Local stores' record decoders and key parsers.
//!
//! Every value and key these stores read back from RocksDB goes through one of these
//! functions at open (recovery) or on a read. The story: damaged or foreign bytes are
//! reported as corrupt, never a panic that would crash-loop the instance on restart,
//! and never a wrong value. "Accepted" is checked the strong way: whatever decodes
//! re-encodes to exactly the bytes it came from. The private decoders (the delivery key,
//! the dead-letter body and sequence records, the Meta checkpoint) are fuzzed in
//! `mod fuzz` next to them.
//!
//! Case count: `MESHD_FUZZ_CASES` (default 2000, the CI pass); see docs/fuzzing.md.

use meshd_fuzz_cases::cases;
use meshd_stores::delivery::{DeliveryRecord, DeliveryState, SessionBinding};
use meshd_stores::offsets::{Committed, OffsetKey};
use meshd_stores_local::log::{EventRecord, HeadRecord};
use meshd_stores_local::{delivery, keys, offsets};
use proptest::prelude::*;

/// Frames `payload` as format version `version` with a valid checksum, so fuzzed
/// payloads reach the field decoding.
fn seal(version: u8, payload: &[u8]) -> Vec<u8> {
    let mut b = vec![version];
    b.extend_from_slice(payload);
    let crc = crc32(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// CRC-32 (IEEE), bitwise: this crate's tests do not depend on crc32fast.
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

fn checksum_holds(record: &[u8]) -> bool {
    record.len() >= 5 && {
        let (body, crc) = record.split_at(record.len() - 4);
        crc32(body).to_le_bytes() == crc
    }
}

/// Payloads of plausible tokens: flags and states (0..6), length prefixes that may
/// lie, whole numbers, raw bytes.
fn payload() -> impl Strategy<Value = Vec<u8>> {
    let token = prop_oneof![
        (0u8..6).prop_map(|b| vec![b]),
        (0u32..24, prop::collection::vec(any::<u8>(), 0..24)).prop_map(|(n, b)| {
            let mut v = n.to_le_bytes().to_vec();
            v.extend(b);
            v
        }),
        (0u32..24, "[a-z0-9-]{0,24}").prop_map(|(n, s)| {
            let mut v = n.to_le_bytes().to_vec();
            v.extend(s.into_bytes());
            v
        }),
        any::<u32>().prop_map(|n| n.to_le_bytes().to_vec()),
        any::<u64>().prop_map(|n| n.to_le_bytes().to_vec()),
        prop::collection::vec(any::<u8>(), 0..8),
    ];
    prop::collection::vec(token, 0..12).prop_map(|t| t.concat())
}

/// Bytes to decode: arbitrary, or a sealed payload of version 1 (or another).
fn record_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        payload().prop_map(|p| seal(1, &p)),
        (any::<u8>(), payload()).prop_map(|(v, p)| seal(v, &p)),
    ]
}

/// Damages a valid record: flips a burst of up to 32 bits, cuts it, or extends it.
/// `None` when the damage happens to leave a valid frame (a record by definition).
fn damage(record: &[u8], how: u8, at: prop::sample::Index, bytes: &[u8]) -> Option<Vec<u8>> {
    let mut d = record.to_vec();
    match how % 3 {
        0 => {
            let start = at.index(d.len());
            for (i, x) in bytes.iter().take(4).enumerate() {
                if let Some(b) = d.get_mut(start + i) {
                    *b ^= x;
                }
            }
        }
        1 => d.truncate(at.index(d.len())),
        _ => d.extend_from_slice(bytes),
    }
    (d != record && !checksum_holds(&d)).then_some(d)
}

fn offset_key() -> impl Strategy<Value = OffsetKey> {
    ("[a-z.]{1,8}", any::<i64>(), "[a-z.]{1,8}", any::<u32>()).prop_map(
        |(subscription, incarnation, topic, partition)| OffsetKey {
            subscription,
            incarnation,
            topic,
            partition,
        },
    )
}

fn delivery_record() -> impl Strategy<Value = DeliveryRecord> {
    let state = prop_oneof![
        Just(DeliveryState::InFlight),
        Just(DeliveryState::WaitingRetry),
        Just(DeliveryState::AckedAwaitingCommit),
        Just(DeliveryState::DeadLettering),
    ];
    (
        (offset_key(), any::<u64>(), 1u32.., "[a-f0-9-]{0,32}"),
        (any::<u64>(), proptest::option::of(".{0,12}"), any::<u64>()),
        (state, any::<i64>()),
        proptest::option::of(("[a-f0-9]{0,32}", any::<i64>())),
    )
        .prop_map(
            |(
                (key, offset, attempt, delivery_id),
                (deadline_ms, last_reason, first),
                (state, owner_epoch),
                session,
            )| {
                DeliveryRecord {
                    key,
                    offset,
                    attempt,
                    delivery_id,
                    deadline_ms,
                    last_reason,
                    first_delivered_at_ms: first,
                    state,
                    owner_epoch,
                    session: session
                        .map(|(session_id, epoch)| SessionBinding { session_id, epoch }),
                }
            },
        )
}

fn key_bytes() -> impl Strategy<Value = Vec<u8>> {
    let component = prop_oneof![
        (0u8..12).prop_map(|b| vec![b]),
        "[a-z.]{0,10}".prop_map(String::into_bytes),
        any::<u32>().prop_map(|n| n.to_be_bytes().to_vec()),
        any::<u64>().prop_map(|n| n.to_be_bytes().to_vec()),
        prop::collection::vec(any::<u8>(), 0..6),
    ];
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..40),
        prop::collection::vec(component, 0..8).prop_map(|c| c.concat()),
    ]
}

/// A valid record with its payload edited (bytes set, removed, inserted, the payload
/// cut) and then sealed again with a valid checksum: the cases that reach every field
/// check, as a bug in a writer (not the disk) would produce them.
fn resealed(valid: impl Strategy<Value = Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    (
        valid,
        prop::collection::vec((any::<prop::sample::Index>(), 0u8..4, any::<u8>()), 0..4),
    )
        .prop_map(|(record, edits)| {
            let mut payload = record[1..record.len() - 4].to_vec();
            for (at, how, b) in edits {
                let i = at.index(payload.len() + 1);
                match how {
                    0 if i < payload.len() => payload[i] = b % 8,
                    1 if i < payload.len() => {
                        payload.remove(i);
                    }
                    2 => payload.insert(i, b),
                    _ => payload.truncate(i),
                }
            }
            seal(record[0], &payload)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn fuzz_delivery_record_decode(
        bytes in prop_oneof![record_bytes(), resealed(delivery_record().prop_map(|r| delivery::encode(&r)))],
        key in offset_key(), offset in any::<u64>()) {
        if let Ok(r) = delivery::decode(key.clone(), offset, &bytes) {
            prop_assert_eq!(&r.key, &key);
            prop_assert_eq!(r.offset, offset);
            prop_assert!(r.attempt >= 1);
            prop_assert_eq!(delivery::encode(&r), bytes);
        }
    }

    #[test]
    fn fuzz_damaged_delivery_records_never_decode(
        r in delivery_record(), how in any::<u8>(), at in any::<prop::sample::Index>(),
        bytes in prop::collection::vec(1u8.., 1..8),
    ) {
        let enc = delivery::encode(&r);
        prop_assert_eq!(delivery::decode(r.key.clone(), r.offset, &enc), Ok(r.clone()));
        if let Some(d) = damage(&enc, how, at, &bytes) {
            prop_assert!(delivery::decode(r.key.clone(), r.offset, &d).is_err());
        }
    }

    #[test]
    fn fuzz_offset_record_decode(bytes in prop_oneof![
        record_bytes(),
        resealed(any::<(u64, u64, u64)>().prop_map(|(offset, epoch, at_ms)| offsets::encode(&Committed { offset, epoch, at_ms }))),
    ]) {
        if let Ok(c) = offsets::decode(&bytes) {
            prop_assert_eq!(offsets::encode(&c), bytes);
        }
    }

    #[test]
    fn fuzz_damaged_offset_records_never_decode(
        offset in any::<u64>(), epoch in any::<u64>(), at_ms in any::<u64>(),
        how in any::<u8>(), at in any::<prop::sample::Index>(),
        bytes in prop::collection::vec(1u8.., 1..8),
    ) {
        let enc = offsets::encode(&Committed { offset, epoch, at_ms });
        if let Some(d) = damage(&enc, how, at, &bytes) {
            prop_assert!(offsets::decode(&d).is_err());
        }
    }

    #[test]
    fn fuzz_event_record_decode(bytes in prop_oneof![
        record_bytes(),
        resealed((any::<u64>(), prop::collection::vec(any::<u8>(), 0..32)).prop_map(|(appended_at_ms, payload)| EventRecord { appended_at_ms, payload }.encode())),
    ]) {
        if let Ok(r) = EventRecord::decode(&bytes) {
            prop_assert_eq!(r.encode(), bytes);
        }
    }

    #[test]
    fn fuzz_damaged_event_records_never_decode(
        at_ms in any::<u64>(), payload in prop::collection::vec(any::<u8>(), 0..48),
        how in any::<u8>(), at in any::<prop::sample::Index>(),
        bytes in prop::collection::vec(1u8.., 1..8),
    ) {
        let enc = EventRecord { appended_at_ms: at_ms, payload }.encode();
        if let Some(d) = damage(&enc, how, at, &bytes) {
            prop_assert!(EventRecord::decode(&d).is_err());
        }
    }

    #[test]
    fn fuzz_head_record_decode(bytes in prop_oneof![
        record_bytes(),
        resealed(any::<(u64, u64, u64)>().prop_map(|(start, end, bytes)| HeadRecord { start, end, bytes }.encode())),
    ]) {
        if let Ok(r) = HeadRecord::decode(&bytes) {
            prop_assert!(r.start <= r.end);
            prop_assert_eq!(r.encode(), bytes);
        }
    }

    #[test]
    fn fuzz_damaged_head_records_never_decode(
        start in any::<u64>(), len in any::<u64>(), size in any::<u64>(),
        how in any::<u8>(), at in any::<prop::sample::Index>(),
        bytes in prop::collection::vec(1u8.., 1..8),
    ) {
        let enc = HeadRecord { start, end: start.saturating_add(len), bytes: size }.encode();
        if let Some(d) = damage(&enc, how, at, &bytes) {
            prop_assert!(HeadRecord::decode(&d).is_err());
        }
    }

    /// A head key parses only when it is exactly the key of what it parses to.
    #[test]
    fn fuzz_head_key_parse(tail in key_bytes()) {
        let mut k = vec![keys::HEAD];
        k.extend_from_slice(&tail);
        for k in [k, tail] {
            if let Some((topic, partition)) = keys::parse_head_key(&k) {
                prop_assert_eq!(keys::head_key(&topic, partition), k);
            }
        }
    }

    /// The subscription/topic/partition part of offset and delivery keys: a parse
    /// splits the key exactly, into a part that re-encodes and the rest.
    #[test]
    fn fuzz_partition_part_parse(k in key_bytes()) {
        if let Some((key, rest)) = keys::parse_partition_part(&k) {
            let mut again = keys::offset_key(&key);
            again.remove(0);
            again.extend_from_slice(rest);
            prop_assert_eq!(again, k.clone());
        }
    }
}
