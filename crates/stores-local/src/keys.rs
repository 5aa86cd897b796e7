//! The Local key catalog: every column family of the instance's RocksDB and every key
//! layout in it. Prefixes are single bytes, chosen once, never reused.
//!
//! | cf | key | value | lifetime |
//! |---|---|---|---|
//! | `meta` | see `meshd-meta-embedded` (`records/mod.rs`): `s`, `k`+key, `h`+rev, `l`+lease, `a`+lease+key | embedded Meta records | as Meta says |
//! | `log` | `e` + name(topic) + partition (u32 BE) + offset (u64 BE) | [`crate::log`] event record | until retention or topic deletion |
//! | `log` | `p` + name(topic) + partition (u32 BE) | partition head: start, end, bytes | with the topic |
//! | `log` | `u` + name(topic) + partition (u32 BE) + stored-at ms (u64 BE) + offset (u64 BE) | [`crate::dedup`] record of one event: dedup key, window (written by releases before runs; loaded and swept) | until its window ends, or topic deletion |
//! | `log` | `r` + name(topic) + partition (u32 BE) + stored-at ms (u64 BE) + first offset (u64 BE) | [`crate::dedup`] run: window, the dedup keys (16 bytes each) of the events one append stored at consecutive offsets from the first | until its window ends, or topic deletion |
//! | `dlq` | `b` + seq (u64 BE) | dead-letter body record | until its entry is deleted (exempt from retention) |
//! | `dlq` | `n` | next body seq | forever |
//! | `offsets` | `o` + name(subscription) + incarnation (u64 BE) + name(topic) + partition (u32 BE) | committed offset record | until the subscription is deleted |
//! | `deliveries` | `d` + the same subscription/topic/partition part + offset (u64 BE) | delivery record | until resolved |
//! | `deliveries` | `x` + deadline ms (u64 BE) + the `d` key | empty: the deadline index earlier releases kept (nothing read it) | dropped at open ([`crate::delivery`]); never written now, the prefix never reused |
//! | `deliveries` | `k` + the same subscription/topic/partition part + due ms (u64 BE) + offset (u64 BE) | [`crate::park`] entry: attempts made before parking (u32 BE) + the parked event's body | until settled (acked or dead-lettered) or the subscription is deleted |
//! | `deliveries` | `q` + the same subscription/topic/partition part + offset (u64 BE) | the parked entry's due ms (u64 BE): lookup by offset | with its `k` entry |
//!
//! `name(s)` is one length byte followed by the bytes of `s` (names are at most 249
//! bytes), so a name can never run into the next component and no two component lists
//! share a key. Big-endian numbers sort in numeric order.

use meshd_stores::offsets::OffsetKey;

pub const CF_META: &str = "meta";
pub const CF_LOG: &str = "log";
pub const CF_DLQ: &str = "dlq";
pub const CF_OFFSETS: &str = "offsets";
pub const CF_DELIVERIES: &str = "deliveries";

/// Every column family the Local RocksDB is opened with.
pub const COLUMN_FAMILIES: &[&str] = &[CF_META, CF_LOG, CF_DLQ, CF_OFFSETS, CF_DELIVERIES];

pub const EVENT: u8 = b'e';
pub const HEAD: u8 = b'p';
pub const BODY: u8 = b'b';
pub const BODY_SEQ: &[u8] = b"n";
pub const OFFSET: u8 = b'o';
pub const DELIVERY: u8 = b'd';
/// Retired: the deadline index of earlier releases, dropped at open.
pub const DEADLINE: u8 = b'x';
pub const DEDUP: u8 = b'u';
pub const DEDUP_RUN: u8 = b'r';
pub const PARKED: u8 = b'k';
pub const PARKED_OFFSET: u8 = b'q';
pub const PARKED_KEY: u8 = b'h';
/// The three key spaces of the park index (see `park.rs`).
pub const PARK_SPACES: [u8; 3] = [PARKED, PARKED_OFFSET, PARKED_KEY];

/// The longest name a key can hold.
pub const MAX_NAME: usize = 255;

pub fn push_name(k: &mut Vec<u8>, name: &str) {
    // Callers validate names (`check_name`); a longer one is cut at the length byte's
    // range rather than wrapping around.
    let bytes = &name.as_bytes()[..name.len().min(MAX_NAME)];
    k.push(bytes.len() as u8);
    k.extend_from_slice(bytes);
}

pub fn check_name(what: &str, name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(format!(
            "{what} name must be 1-{MAX_NAME} bytes, got {}",
            name.len()
        ));
    }
    Ok(())
}

pub fn topic_prefix(topic: &str) -> Vec<u8> {
    let mut k = vec![EVENT];
    push_name(&mut k, topic);
    k
}

pub fn event_key(topic: &str, partition: u32, offset: u64) -> Vec<u8> {
    let mut k = topic_prefix(topic);
    k.extend_from_slice(&partition.to_be_bytes());
    k.extend_from_slice(&offset.to_be_bytes());
    k
}

pub fn head_key(topic: &str, partition: u32) -> Vec<u8> {
    let mut k = vec![HEAD];
    push_name(&mut k, topic);
    k.extend_from_slice(&partition.to_be_bytes());
    k
}

/// Parses a head key back into (topic, partition).
pub fn parse_head_key(k: &[u8]) -> Option<(String, u32)> {
    let (&tag, rest) = k.split_first()?;
    if tag != HEAD {
        return None;
    }
    let (&len, rest) = rest.split_first()?;
    let topic = rest.get(..len as usize)?;
    let p: [u8; 4] = rest.get(len as usize..)?.try_into().ok()?;
    Some((
        String::from_utf8(topic.to_vec()).ok()?,
        u32::from_be_bytes(p),
    ))
}

pub fn body_key(seq: u64) -> Vec<u8> {
    let mut k = vec![BODY];
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

/// The subscription + incarnation part shared by offsets and deliveries.
fn subscription_part(k: &mut Vec<u8>, subscription: &str, incarnation: i64) {
    push_name(k, subscription);
    k.extend_from_slice(&(incarnation as u64).to_be_bytes());
}

fn partition_part(k: &mut Vec<u8>, key: &OffsetKey) {
    subscription_part(k, &key.subscription, key.incarnation);
    push_name(k, &key.topic);
    k.extend_from_slice(&key.partition.to_be_bytes());
}

pub fn offset_key(key: &OffsetKey) -> Vec<u8> {
    let mut k = vec![OFFSET];
    partition_part(&mut k, key);
    k
}

pub fn offsets_of_subscription(subscription: &str, incarnation: i64) -> Vec<u8> {
    let mut k = vec![OFFSET];
    subscription_part(&mut k, subscription, incarnation);
    k
}

/// Parses an offset (or delivery, after its tag) key back into its [`OffsetKey`] and
/// the rest of the key.
pub fn parse_partition_part(k: &[u8]) -> Option<(OffsetKey, &[u8])> {
    let (&len, rest) = k.split_first()?;
    let subscription = String::from_utf8(rest.get(..len as usize)?.to_vec()).ok()?;
    let rest = rest.get(len as usize..)?;
    let inc: [u8; 8] = rest.get(..8)?.try_into().ok()?;
    let rest = rest.get(8..)?;
    let (&tlen, rest) = rest.split_first()?;
    let topic = String::from_utf8(rest.get(..tlen as usize)?.to_vec()).ok()?;
    let rest = rest.get(tlen as usize..)?;
    let p: [u8; 4] = rest.get(..4)?.try_into().ok()?;
    Some((
        OffsetKey {
            subscription,
            incarnation: u64::from_be_bytes(inc) as i64,
            topic,
            partition: u32::from_be_bytes(p),
        },
        rest.get(4..)?,
    ))
}

pub fn delivery_key(key: &OffsetKey, offset: u64) -> Vec<u8> {
    let mut k = vec![DELIVERY];
    partition_part(&mut k, key);
    k.extend_from_slice(&offset.to_be_bytes());
    k
}

/// The prefix of one partition's keys in one park key space (`space`: [`PARKED`],
/// entries by due time; [`PARKED_OFFSET`], by offset; [`PARKED_KEY`], by ordering
/// key).
pub fn parked_of_partition(key: &OffsetKey, space: u8) -> Vec<u8> {
    let mut k = vec![space];
    partition_part(&mut k, key);
    k
}

/// The prefix of a subscription incarnation's keys in one park key space.
pub fn parked_of_subscription(subscription: &str, incarnation: i64, space: u8) -> Vec<u8> {
    let mut k = vec![space];
    subscription_part(&mut k, subscription, incarnation);
    k
}

/// Every delivery record of one partition of a subscription incarnation.
pub fn deliveries_of_partition(key: &OffsetKey) -> Vec<u8> {
    let mut k = vec![DELIVERY];
    partition_part(&mut k, key);
    k
}

pub fn deliveries_of_subscription(subscription: &str, incarnation: i64) -> Vec<u8> {
    let mut k = vec![DELIVERY];
    subscription_part(&mut k, subscription, incarnation);
    k
}

/// The smallest key after every key that starts with `prefix`.
pub fn end_of(prefix: &[u8]) -> Vec<u8> {
    meshd_meta::prefix_end(prefix)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn offset_keys_round_trip_and_never_collide(
            a in "[a-z.]{1,8}", b in "[a-z.]{1,8}", inc in 1i64..1000, p in 0u32..1024,
            a2 in "[a-z.]{1,8}", b2 in "[a-z.]{1,8}",
        ) {
            let k1 = OffsetKey { subscription: a.clone(), incarnation: inc, topic: b.clone(), partition: p };
            let k2 = OffsetKey { subscription: a2, incarnation: inc, topic: b2, partition: p };
            let enc = offset_key(&k1);
            let (back, rest) = parse_partition_part(&enc[1..]).unwrap();
            prop_assert_eq!(&back, &k1);
            prop_assert!(rest.is_empty());
            prop_assert_eq!(k1 == k2, enc == offset_key(&k2));
        }
    }

    #[test]
    fn head_keys_round_trip() {
        assert_eq!(
            parse_head_key(&head_key("orders", 7)),
            Some(("orders".into(), 7))
        );
    }

    #[test]
    fn a_topic_prefix_does_not_cover_a_longer_topic() {
        assert!(!event_key("ab", 0, 0).starts_with(&topic_prefix("a")));
    }
}
