//! # The publish dedup index of the RocksDB log
//!
//! Per (topic, partition), the keys ([`DedupKey`]) of the events stored within their
//! topic's window, each with its offset. Looked up in memory; made durable by one
//! record per stored event, written **in the same batch as the event** (so the index
//! is durable exactly as far as the events it points to: a power cut that loses an
//! event loses its entry too, and one that keeps the event keeps its entry), and
//! reloaded from those records at open.
//!
//! Record (`log` column family, see [`crate::keys`]): key `u` + name(topic) +
//! partition (u32 BE) + stored-at ms (u64 BE) + offset (u64 BE), value version 1:
//! the 16-byte key and the window (ms) in force when the event was stored. Keys sort
//! by time within a partition, so expiry reads from the front. An entry expires at
//! stored-at + window; expired entries leave memory and disk in the sweep that runs
//! with retention ([`DedupIndex::expire`]).
//!
//! Memory: about 100 bytes per event stored within its window (the
//! `meshd_dedup_entries` gauge); lower a busy topic's window to bound it.

use crate::keys;
use meshd_local::codec::{DecodeError, Decoder, Encoder};
use meshd_stores::log::DedupKey;
use std::collections::{HashMap, VecDeque};

const DEDUP_V1: u8 = 1;

/// One entry, as held in memory and on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub key: DedupKey,
    pub offset: u64,
    pub at_ms: u64,
    pub window_ms: u64,
}

impl Entry {
    fn expires_at(&self) -> u64 {
        self.at_ms.saturating_add(self.window_ms)
    }

    pub fn record_key(&self, topic: &str, partition: u32) -> Vec<u8> {
        let mut k = partition_prefix(topic, partition);
        k.extend_from_slice(&self.at_ms.to_be_bytes());
        k.extend_from_slice(&self.offset.to_be_bytes());
        k
    }

    pub fn encode_value(&self) -> Vec<u8> {
        Encoder::new(DEDUP_V1)
            .bytes(&self.key.0)
            .u64(self.window_ms)
            .finish()
    }

    /// Decodes a record (key under [`prefix`], value) into its (topic, partition)
    /// and entry.
    pub fn decode(k: &[u8], v: &[u8]) -> Result<((String, u32), Entry), DecodeError> {
        let rest = k.get(1..).ok_or(DecodeError::Truncated)?;
        let (&len, rest) = rest.split_first().ok_or(DecodeError::Truncated)?;
        let len = len as usize;
        let topic = rest.get(..len).ok_or(DecodeError::Truncated)?;
        let topic = std::str::from_utf8(topic)
            .map_err(|_| DecodeError::InvalidField("topic is not UTF-8"))?
            .to_string();
        let nums = rest.get(len..).ok_or(DecodeError::Truncated)?;
        if nums.len() != 20 {
            return Err(DecodeError::InvalidField("dedup key length"));
        }
        let be4 = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let be8 = |b: &[u8]| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_be_bytes(a)
        };
        let partition = be4(&nums[..4]);
        let at_ms = be8(&nums[4..12]);
        let offset = be8(&nums[12..20]);
        let mut d = Decoder::new(v, DEDUP_V1)?;
        let key = d.bytes()?;
        let window_ms = d.u64()?;
        d.finish()?;
        let key: [u8; 16] = key
            .try_into()
            .map_err(|_| DecodeError::InvalidField("dedup key is not 16 bytes"))?;
        Ok((
            (topic, partition),
            Entry {
                key: DedupKey(key),
                offset,
                at_ms,
                window_ms,
            },
        ))
    }
}

/// The prefix of every dedup record.
pub fn prefix() -> Vec<u8> {
    vec![keys::DEDUP]
}

/// The prefix of one topic's records.
pub fn topic_prefix(topic: &str) -> Vec<u8> {
    let mut k = prefix();
    keys::push_name(&mut k, topic);
    k
}

fn partition_prefix(topic: &str, partition: u32) -> Vec<u8> {
    let mut k = topic_prefix(topic);
    k.extend_from_slice(&partition.to_be_bytes());
    k
}

/// One partition's live entries.
#[derive(Default)]
struct Window {
    by_key: HashMap<DedupKey, Entry>,
    /// In storing order (so in time order, the log's clock permitting): what expiry
    /// reads from the front.
    order: VecDeque<Entry>,
}

/// The in-memory index (the store thread changes it, under its lock).
#[derive(Default)]
pub struct DedupIndex {
    partitions: HashMap<(String, u32), Window>,
    entries: usize,
}

impl DedupIndex {
    /// The offset of the event stored with `key` whose entry is live at `now_ms`.
    pub fn lookup(&self, topic: &str, partition: u32, key: &DedupKey, now_ms: u64) -> Option<u64> {
        let w = self.partitions.get(&(topic.to_string(), partition))?;
        w.by_key
            .get(key)
            .filter(|e| e.expires_at() >= now_ms)
            .map(|e| e.offset)
    }

    /// Adds an entry (a newer one for the same key replaces it).
    pub fn insert(&mut self, topic: &str, partition: u32, e: Entry) {
        let w = self
            .partitions
            .entry((topic.to_string(), partition))
            .or_default();
        if w.by_key.insert(e.key, e).is_none() {
            self.entries += 1;
        }
        w.order.push_back(e);
    }

    /// Removes entries expired at `now_ms`; returns the record keys to delete.
    pub fn expire(&mut self, now_ms: u64) -> Vec<Vec<u8>> {
        let mut gone = Vec::new();
        let mut removed = 0usize;
        self.partitions.retain(|(topic, partition), w| {
            // Entries are roughly in time order; one whose window outlives a later
            // one's stops the sweep at it, and both go in a later sweep (bounded by
            // the longest window).
            while w.order.front().is_some_and(|e| e.expires_at() < now_ms) {
                let Some(e) = w.order.pop_front() else { break };
                gone.push(e.record_key(topic, *partition));
                if w.by_key.get(&e.key) == Some(&e) {
                    w.by_key.remove(&e.key);
                    removed += 1;
                }
            }
            !w.order.is_empty()
        });
        self.entries -= removed;
        gone
    }

    /// Forgets a deleted topic.
    pub fn forget_topic(&mut self, topic: &str) {
        let mut removed = 0usize;
        self.partitions.retain(|(t, _), w| {
            let keep = t != topic;
            if !keep {
                removed += w.by_key.len();
            }
            keep
        });
        self.entries -= removed;
    }

    /// Live keys held.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn e(key: u8, offset: u64, at_ms: u64, window_ms: u64) -> Entry {
        Entry {
            key: DedupKey([key; 16]),
            offset,
            at_ms,
            window_ms,
        }
    }

    #[test]
    fn an_entry_answers_within_its_window_and_expires_after_it() {
        let mut ix = DedupIndex::default();
        ix.insert("t", 0, e(1, 7, 1000, 500));
        assert_eq!(ix.lookup("t", 0, &DedupKey([1; 16]), 1500), Some(7));
        assert_eq!(
            ix.lookup("t", 1, &DedupKey([1; 16]), 1500),
            None,
            "per partition"
        );
        assert_eq!(
            ix.lookup("u", 0, &DedupKey([1; 16]), 1500),
            None,
            "per topic"
        );
        assert_eq!(ix.lookup("t", 0, &DedupKey([1; 16]), 1501), None, "expired");
        assert_eq!(ix.expire(1500), Vec::<Vec<u8>>::new());
        assert_eq!(ix.len(), 1);
        let gone = ix.expire(1501);
        assert_eq!(gone, vec![e(1, 7, 1000, 500).record_key("t", 0)]);
        assert!(ix.is_empty());
    }

    #[test]
    fn a_newer_entry_for_a_key_survives_the_expiry_of_the_older() {
        let mut ix = DedupIndex::default();
        ix.insert("t", 0, e(1, 1, 1000, 100));
        ix.insert("t", 0, e(1, 5, 1200, 100));
        assert_eq!(ix.len(), 1);
        let gone = ix.expire(1150);
        assert_eq!(gone.len(), 1, "the old record goes from disk");
        assert_eq!(ix.lookup("t", 0, &DedupKey([1; 16]), 1150), Some(5));
        assert_eq!(ix.len(), 1);
        ix.forget_topic("t");
        assert!(ix.is_empty());
    }

    proptest! {
        #[test]
        fn records_round_trip(topic in "[a-z.]{1,40}", partition in any::<u32>(), key in any::<[u8; 16]>(),
                              offset in any::<u64>(), at_ms in any::<u64>(), window_ms in any::<u64>()) {
            let entry = Entry { key: DedupKey(key), offset, at_ms, window_ms };
            let k = entry.record_key(&topic, partition);
            prop_assert!(k.starts_with(&topic_prefix(&topic)));
            let got = Entry::decode(&k, &entry.encode_value()).unwrap();
            prop_assert_eq!(got, ((topic, partition), entry));
        }

        #[test]
        fn damaged_records_never_decode(k in proptest::collection::vec(any::<u8>(), 0..40),
                                        v in proptest::collection::vec(any::<u8>(), 0..40)) {
            // Random bytes either fail or decode to something; they must not panic.
            let _ = Entry::decode(&k, &v);
        }
    }
}
