//! # The publish dedup index of the RocksDB log
//!
//! Per (topic, partition), the keys ([`DedupKey`]) of the events stored within their
//! topic's window, each with its offset. Looked up in memory; made durable by one
//! record per stored event, written **in the same batch as the event** (so the index
//! is durable exactly as far as the events it points to: a power cut that loses an
//! event loses its entry too, and one that keeps the event keeps its entry), and
//! reloaded from those records at open (on its own thread; what reads or changes the
//! index waits for it, see `RocksLog::dedup_loaded`).
//!
//! Record (`log` column family, see [`crate::keys`]): key `u` + name(topic) +
//! partition (u32 BE) + stored-at ms (u64 BE) + offset (u64 BE), value version 1:
//! the 16-byte key and the window (ms) in force when the event was stored. Keys sort
//! by time within a partition, so expiry reads from the front. An entry expires at
//! stored-at + window; expired entries leave memory and disk in the sweep that runs
//! with retention, and an open does not load them.
//!
//! Memory: one slot per live key (the 16-byte key, the offset and the expiry: 32
//! bytes, 37–75 with the hash table's spare room; the `meshd_dedup_entries` gauge);
//! lower a busy topic's window to bound it. Time order is not held in memory: the
//! records on disk are in time order per partition, and the sweep reads them from
//! where it last stopped ([`DedupIndex::remove_expired`] per record it deletes). An
//! open reads the records in place and sizes each partition's table once.

use crate::keys;
use meshd_local::codec::{DecodeError, Decoder, Encoder};
use meshd_stores::log::DedupKey;
use std::collections::HashMap;

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

    /// Whether the entry's window has ended at `now_ms` (the sweep deletes its record).
    pub fn expired(&self, now_ms: u64) -> bool {
        self.expires_at() < now_ms
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

    /// Decodes a record (key under [`prefix`], value) into its topic (borrowed from
    /// the key), partition and entry.
    pub fn decode<'k>(k: &'k [u8], v: &[u8]) -> Result<(&'k str, u32, Entry), DecodeError> {
        let rest = k.get(1..).ok_or(DecodeError::Truncated)?;
        let (&len, rest) = rest.split_first().ok_or(DecodeError::Truncated)?;
        let len = len as usize;
        let topic = rest.get(..len).ok_or(DecodeError::Truncated)?;
        let topic = std::str::from_utf8(topic)
            .map_err(|_| DecodeError::InvalidField("topic is not UTF-8"))?;
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
            topic,
            partition,
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

pub fn partition_prefix(topic: &str, partition: u32) -> Vec<u8> {
    let mut k = topic_prefix(topic);
    k.extend_from_slice(&partition.to_be_bytes());
    k
}

/// What a live key answers with, and until when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    offset: u64,
    expires_at: u64,
}

/// One partition's live keys, and where its sweep goes on from.
#[derive(Default)]
pub struct Window {
    keys: HashMap<DedupKey, Slot>,
    /// The first record key after the last one the sweep deleted: the next sweep
    /// starts there rather than stepping over the deleted records' tombstones again
    /// (they stay in RocksDB until compaction). Kept while the topic exists.
    swept_to: Option<Vec<u8>>,
}

impl Window {
    /// An empty window with room for `capacity` keys (an open, before it loads a
    /// partition's records: a table sized once, not grown key by key).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            keys: HashMap::with_capacity(capacity),
            swept_to: None,
        }
    }

    /// Adds an entry (a newer one for the same key replaces it); whether the key is
    /// new.
    pub fn insert(&mut self, e: Entry) -> bool {
        let slot = Slot {
            offset: e.offset,
            expires_at: e.expires_at(),
        };
        self.keys.insert(e.key, slot).is_none()
    }
}

/// The in-memory index (the store thread changes it, under its lock).
#[derive(Default)]
pub struct DedupIndex {
    /// Per topic, per partition: looked up by `&str`, no key built per call.
    topics: HashMap<String, HashMap<u32, Window>>,
    entries: usize,
}

impl DedupIndex {
    /// The offset of the event stored with `key` whose entry is live at `now_ms`.
    pub fn lookup(&self, topic: &str, partition: u32, key: &DedupKey, now_ms: u64) -> Option<u64> {
        self.topics
            .get(topic)?
            .get(&partition)?
            .keys
            .get(key)
            .filter(|s| s.expires_at >= now_ms)
            .map(|s| s.offset)
    }

    /// Adds an entry (a newer one for the same key replaces it).
    pub fn insert(&mut self, topic: &str, partition: u32, e: Entry) {
        let partitions = match self.topics.get_mut(topic) {
            Some(p) => p,
            None => self.topics.entry(topic.to_string()).or_default(),
        };
        if partitions.entry(partition).or_default().insert(e) {
            self.entries += 1;
        }
    }

    /// Puts a partition's window loaded at open (replacing any it had).
    pub fn put_window(&mut self, topic: &str, partition: u32, w: Window) {
        self.entries += w.keys.len();
        if let Some(old) = self
            .topics
            .entry(topic.to_string())
            .or_default()
            .insert(partition, w)
        {
            self.entries -= old.keys.len();
        }
    }

    /// The sweep deleted the record `e`: its key leaves memory unless a newer entry
    /// (stored after this one's window ended) answers for it now.
    pub fn remove_expired(&mut self, topic: &str, partition: u32, e: &Entry) {
        let Some(window) = self
            .topics
            .get_mut(topic)
            .and_then(|p| p.get_mut(&partition))
        else {
            return;
        };
        if window
            .keys
            .get(&e.key)
            .is_some_and(|s| s.offset == e.offset)
        {
            window.keys.remove(&e.key);
            self.entries -= 1;
        }
    }

    /// The partitions the sweep reads, each with the record key it starts from.
    pub fn sweep_starts(&self) -> Vec<(String, u32, Vec<u8>)> {
        self.topics
            .iter()
            .flat_map(|(t, ps)| {
                ps.iter().map(move |(p, w)| {
                    let from = w
                        .swept_to
                        .clone()
                        .unwrap_or_else(|| partition_prefix(t, *p));
                    (t.clone(), *p, from)
                })
            })
            .collect()
    }

    /// The sweep deleted records of a partition up to `last` (a record key).
    pub fn swept(&mut self, topic: &str, partition: u32, last: &[u8]) {
        if let Some(w) = self
            .topics
            .get_mut(topic)
            .and_then(|p| p.get_mut(&partition))
        {
            let mut next = last.to_vec();
            next.push(0);
            w.swept_to = Some(next);
        }
    }

    /// Forgets a deleted topic.
    pub fn forget_topic(&mut self, topic: &str) {
        if let Some(partitions) = self.topics.remove(topic) {
            self.entries -= partitions.values().map(|w| w.keys.len()).sum::<usize>();
        }
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
        assert!(!e(1, 7, 1000, 500).expired(1500));
        assert!(e(1, 7, 1000, 500).expired(1501));
        assert_eq!(ix.len(), 1, "held until the sweep removes it");
        let start = partition_prefix("t", 0);
        assert_eq!(ix.sweep_starts(), vec![("t".to_string(), 0, start.clone())]);
        ix.remove_expired("t", 0, &e(1, 7, 1000, 500));
        assert!(ix.is_empty());
        let last = e(1, 7, 1000, 500).record_key("t", 0);
        ix.swept("t", 0, &last);
        let (_, _, from) = ix.sweep_starts().remove(0);
        assert!(
            from > last && from.starts_with(&last),
            "just after the deleted record"
        );
        assert!(
            e(2, 8, 1000, 500).record_key("t", 0) > from,
            "before the next one"
        );
    }

    #[test]
    fn a_newer_entry_for_a_key_survives_the_expiry_of_the_older() {
        let mut ix = DedupIndex::default();
        ix.insert("t", 0, e(1, 1, 1000, 100));
        ix.insert("t", 0, e(1, 5, 1200, 100));
        assert_eq!(ix.len(), 1);
        // The sweep deletes the old record; the key keeps answering with the new one.
        ix.remove_expired("t", 0, &e(1, 1, 1000, 100));
        assert_eq!(ix.lookup("t", 0, &DedupKey([1; 16]), 1150), Some(5));
        assert_eq!(ix.len(), 1);
        ix.insert("t", 3, e(2, 9, 1200, 100));
        ix.insert("u", 0, e(2, 9, 1200, 100));
        assert_eq!(ix.len(), 3);
        ix.forget_topic("t");
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.lookup("u", 0, &DedupKey([2; 16]), 1250), Some(9));
    }

    proptest! {
        #[test]
        fn records_round_trip(topic in "[a-z.]{1,40}", partition in any::<u32>(), key in any::<[u8; 16]>(),
                              offset in any::<u64>(), at_ms in any::<u64>(), window_ms in any::<u64>()) {
            let entry = Entry { key: DedupKey(key), offset, at_ms, window_ms };
            let k = entry.record_key(&topic, partition);
            prop_assert!(k.starts_with(&topic_prefix(&topic)));
            let got = Entry::decode(&k, &entry.encode_value()).unwrap();
            prop_assert_eq!(got, (topic.as_str(), partition, entry));
        }

        #[test]
        fn damaged_records_never_decode(k in proptest::collection::vec(any::<u8>(), 0..40),
                                        v in proptest::collection::vec(any::<u8>(), 0..40)) {
            // Random bytes either fail or decode to something; they must not panic.
            let _ = Entry::decode(&k, &v);
        }
    }
}
