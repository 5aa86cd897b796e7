//! # The publish dedup index of the RocksDB log
//!
//! Per (topic, partition), the keys ([`DedupKey`]) of the events stored within their
//! topic's window, each with its offset. Looked up in memory; made durable by one
//! record per *run* (the events one append stored in one partition, at consecutive
//! offsets), written **in the same batch as the events** (so the index is durable
//! exactly as far as the events it points to: a power cut that loses an event loses
//! its entry too, and one that keeps the event keeps its entry), and reloaded from
//! those records at open (on its own thread; what reads or changes the index waits
//! for it, see `RocksLog::dedup_loaded`).
//!
//! Records (`log` column family, see [`crate::keys`]), two key spaces ([`Space`]):
//!
//! * `r` (runs, written now): key `r` + name(topic) + partition (u32 BE) + stored-at
//!   ms (u64 BE) + first offset (u64 BE), value version 1: the window (ms) in force
//!   and the 16-byte keys in offset order. A batch of 100 events is one record, not
//!   100: a hundredth of the records to write, load and sweep.
//! * `u` (one per event, what releases before runs wrote): key `u` + the same parts
//!   with the event's offset, value version 1: the 16-byte key and the window. Still
//!   loaded and swept, never written; a release before runs ignores `r` (after a
//!   downgrade, an event this release stored may be stored again inside its window).
//!
//! Keys sort by time within a partition and space, so expiry reads from the front. A
//! record expires at stored-at + window; expired records leave memory and disk in the
//! sweep that runs with retention, and an open does not load them.
//!
//! Memory: one slot per live key (the 16-byte key, the offset and the expiry: 32
//! bytes, 37–75 with the hash table's spare room; the `meshd_dedup_entries` gauge);
//! lower a busy topic's window to bound it. Time order is not held in memory: the
//! sweep reads the records from where it last stopped
//! ([`DedupIndex::remove_expired`] per key of a record it deletes). An open reads the
//! records in place and sizes each partition's table once.

use crate::keys;
use meshd_local::codec::{DecodeError, Decoder, Encoder};
use meshd_stores::log::DedupKey;
use std::collections::HashMap;

const DEDUP_V1: u8 = 1;
const RUN_V1: u8 = 1;

/// The two key spaces of dedup records: one record per event (`u`, what releases
/// before runs wrote; still loaded and swept), and one per run (`r`, written now).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    Event,
    Run,
}

impl Space {
    pub const ALL: [Space; 2] = [Space::Event, Space::Run];

    fn byte(self) -> u8 {
        match self {
            Space::Event => keys::DEDUP,
            Space::Run => keys::DEDUP_RUN,
        }
    }

    fn index(self) -> usize {
        match self {
            Space::Event => 0,
            Space::Run => 1,
        }
    }
}

/// A stored record of either space: the keys of events stored together (one for an
/// `u` record), at consecutive offsets from `first_offset`, with their time and window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub at_ms: u64,
    pub window_ms: u64,
    pub first_offset: u64,
    pub keys: Vec<DedupKey>,
}

/// When an entry stored at `at_ms` with `window_ms` stops answering.
fn expires_at(at_ms: u64, window_ms: u64) -> u64 {
    at_ms.saturating_add(window_ms)
}

impl Record {
    /// Whether its window has ended at `now_ms` (the sweep deletes it).
    pub fn expired(&self, now_ms: u64) -> bool {
        expires_at(self.at_ms, self.window_ms) < now_ms
    }

    /// Its entries, one per key.
    pub fn entries(&self) -> impl Iterator<Item = Entry> + '_ {
        self.keys
            .iter()
            .zip(self.first_offset..)
            .map(|(key, offset)| Entry {
                key: *key,
                offset,
                at_ms: self.at_ms,
                window_ms: self.window_ms,
            })
    }

    /// The key of a run record (space `r`).
    pub fn run_key(&self, topic: &str, partition: u32) -> Vec<u8> {
        let mut k = partition_prefix(Space::Run, topic, partition);
        k.extend_from_slice(&self.at_ms.to_be_bytes());
        k.extend_from_slice(&self.first_offset.to_be_bytes());
        k
    }

    /// The value of a run record: the window and the keys, 16 bytes each.
    pub fn run_value(&self) -> Vec<u8> {
        let keys: Vec<u8> = self.keys.iter().flat_map(|k| k.0).collect();
        Encoder::new(RUN_V1)
            .u64(self.window_ms)
            .bytes(&keys)
            .finish()
    }

    /// Decodes a record of `space` (key under its [`prefix`], value) into its topic
    /// (borrowed from the key), partition and record.
    pub fn decode<'k>(
        space: Space,
        k: &'k [u8],
        v: &[u8],
    ) -> Result<(&'k str, u32, Record), DecodeError> {
        match space {
            Space::Event => {
                let (topic, partition, e) = Entry::decode(k, v)?;
                Ok((
                    topic,
                    partition,
                    Record {
                        at_ms: e.at_ms,
                        window_ms: e.window_ms,
                        first_offset: e.offset,
                        keys: vec![e.key],
                    },
                ))
            }
            Space::Run => {
                let (topic, partition, at_ms, first_offset) = split_key(k)?;
                let mut d = Decoder::new(v, RUN_V1)?;
                let window_ms = d.u64()?;
                let bytes = d.bytes()?;
                d.finish()?;
                if bytes.is_empty() || bytes.len() % 16 != 0 {
                    return Err(DecodeError::InvalidField("dedup run keys"));
                }
                let keys = bytes
                    .chunks_exact(16)
                    .map(|c| {
                        let mut key = [0u8; 16];
                        key.copy_from_slice(c);
                        DedupKey(key)
                    })
                    .collect();
                Ok((
                    topic,
                    partition,
                    Record {
                        at_ms,
                        window_ms,
                        first_offset,
                        keys,
                    },
                ))
            }
        }
    }
}

/// The topic, partition, stored-at ms and offset of a record key of either space.
fn split_key(k: &[u8]) -> Result<(&str, u32, u64, u64), DecodeError> {
    let rest = k.get(1..).ok_or(DecodeError::Truncated)?;
    let (&len, rest) = rest.split_first().ok_or(DecodeError::Truncated)?;
    let len = len as usize;
    let topic = rest.get(..len).ok_or(DecodeError::Truncated)?;
    let topic =
        std::str::from_utf8(topic).map_err(|_| DecodeError::InvalidField("topic is not UTF-8"))?;
    let nums = rest.get(len..).ok_or(DecodeError::Truncated)?;
    if nums.len() != 20 {
        return Err(DecodeError::InvalidField("dedup key length"));
    }
    let be8 = |b: &[u8]| {
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        u64::from_be_bytes(a)
    };
    let partition = u32::from_be_bytes([nums[0], nums[1], nums[2], nums[3]]);
    Ok((topic, partition, be8(&nums[4..12]), be8(&nums[12..20])))
}

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
        expires_at(self.at_ms, self.window_ms)
    }

    /// Whether the entry's window has ended at `now_ms` (the sweep deletes its record).
    pub fn expired(&self, now_ms: u64) -> bool {
        self.expires_at() < now_ms
    }

    /// The key of its per-event record (space `u`, as releases before runs wrote).
    pub fn record_key(&self, topic: &str, partition: u32) -> Vec<u8> {
        let mut k = partition_prefix(Space::Event, topic, partition);
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

    /// Decodes a per-event record (key under [`prefix`] of [`Space::Event`], value)
    /// into its topic (borrowed from the key), partition and entry.
    pub fn decode<'k>(k: &'k [u8], v: &[u8]) -> Result<(&'k str, u32, Entry), DecodeError> {
        let (topic, partition, at_ms, offset) = split_key(k)?;
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

/// The prefix of every dedup record of `space`.
pub fn prefix(space: Space) -> Vec<u8> {
    vec![space.byte()]
}

/// The prefix of one topic's records of `space`.
pub fn topic_prefix(space: Space, topic: &str) -> Vec<u8> {
    let mut k = prefix(space);
    keys::push_name(&mut k, topic);
    k
}

pub fn partition_prefix(space: Space, topic: &str, partition: u32) -> Vec<u8> {
    let mut k = topic_prefix(space, topic);
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
    swept_to: [Option<Vec<u8>>; 2],
}

impl Window {
    /// An empty window with room for `capacity` keys (an open, before it loads a
    /// partition's records: a table sized once, not grown key by key).
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            keys: HashMap::with_capacity(capacity),
            swept_to: [None, None],
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
    /// When the oldest entry expires, once asked ([`oldest_expiry`](Self::oldest_expiry),
    /// only at the cap): kept through inserts, forgotten by anything that removes.
    oldest: Option<u64>,
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
        self.insert_all(topic, partition, std::iter::once(e));
    }

    /// Adds the entries of one partition (a record's), finding its window once.
    pub fn insert_all(
        &mut self,
        topic: &str,
        partition: u32,
        entries: impl IntoIterator<Item = Entry>,
    ) {
        let partitions = match self.topics.get_mut(topic) {
            Some(p) => p,
            None => self.topics.entry(topic.to_string()).or_default(),
        };
        let window = partitions.entry(partition).or_default();
        for e in entries {
            if let Some(oldest) = &mut self.oldest {
                *oldest = (*oldest).min(e.expires_at());
            }
            if window.insert(e) {
                self.entries += 1;
            } else {
                // It replaced an expired entry, which may have been the oldest.
                self.oldest = None;
            }
        }
    }

    /// When the oldest entry held expires (it may have already: expired entries stay
    /// until the sweep). A scan of every entry the first time after a removal, so it
    /// is asked only at the cap.
    pub fn oldest_expiry(&mut self) -> Option<u64> {
        if self.oldest.is_none() {
            self.oldest = self
                .topics
                .values()
                .flat_map(|ps| ps.values())
                .flat_map(|w| w.keys.values())
                .map(|s| s.expires_at)
                .min();
        }
        self.oldest
    }

    /// Takes a partition's window out to load more records into it (an open reads
    /// each space in turn): the one it has, or a new one with room for `capacity`.
    pub fn take_window(&mut self, topic: &str, partition: u32, capacity: usize) -> Window {
        match self
            .topics
            .get_mut(topic)
            .and_then(|p| p.remove(&partition))
        {
            Some(mut w) => {
                self.oldest = None;
                self.entries -= w.keys.len();
                w.keys.reserve(capacity);
                w
            }
            None => Window::with_capacity(capacity),
        }
    }

    /// Puts back a window taken with [`take_window`](Self::take_window).
    pub fn put_window(&mut self, topic: &str, partition: u32, w: Window) {
        self.oldest = None;
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
            self.oldest = None;
        }
    }

    /// What the sweep reads: per partition and space, the record key it starts from.
    pub fn sweep_starts(&self) -> Vec<(String, u32, Space, Vec<u8>)> {
        let mut out = Vec::new();
        for (t, ps) in &self.topics {
            for (p, w) in ps {
                for space in Space::ALL {
                    let from = w.swept_to[space.index()]
                        .clone()
                        .unwrap_or_else(|| partition_prefix(space, t, *p));
                    out.push((t.clone(), *p, space, from));
                }
            }
        }
        out
    }

    /// The sweep deleted records of a partition's `space` up to `last` (a key);
    /// returns where the sweep goes on from (the smallest key after `last`).
    pub fn swept(&mut self, topic: &str, partition: u32, space: Space, last: &[u8]) -> Vec<u8> {
        let mut next = last.to_vec();
        next.push(0);
        if let Some(w) = self
            .topics
            .get_mut(topic)
            .and_then(|p| p.get_mut(&partition))
        {
            w.swept_to[space.index()] = Some(next.clone());
        }
        next
    }

    /// Forgets a deleted topic.
    pub fn forget_topic(&mut self, topic: &str) {
        if let Some(partitions) = self.topics.remove(topic) {
            self.oldest = None;
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
    fn the_oldest_expiry_follows_inserts_and_is_found_again_after_removals() {
        let mut ix = DedupIndex::default();
        assert_eq!(ix.oldest_expiry(), None);
        ix.insert("t", 0, e(1, 0, 1000, 500));
        ix.insert("u", 3, e(2, 0, 900, 1000));
        assert_eq!(ix.oldest_expiry(), Some(1500));
        // Kept through an insert: an older expiry lowers it.
        ix.insert("t", 1, e(3, 0, 100, 100));
        assert_eq!(ix.oldest_expiry(), Some(200));
        ix.remove_expired("t", 1, &e(3, 0, 100, 100));
        assert_eq!(ix.oldest_expiry(), Some(1500));
        ix.forget_topic("t");
        assert_eq!(ix.oldest_expiry(), Some(1900));
        assert_eq!(ix.len(), 1);
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
        let start = partition_prefix(Space::Event, "t", 0);
        let run_start = partition_prefix(Space::Run, "t", 0);
        assert_eq!(
            ix.sweep_starts(),
            vec![
                ("t".to_string(), 0, Space::Event, start.clone()),
                ("t".to_string(), 0, Space::Run, run_start.clone())
            ]
        );
        ix.remove_expired("t", 0, &e(1, 7, 1000, 500));
        assert!(ix.is_empty());
        let last = e(1, 7, 1000, 500).record_key("t", 0);
        ix.swept("t", 0, Space::Event, &last);
        let (_, _, _, from) = ix.sweep_starts().remove(0);
        assert!(
            from > last && from.starts_with(&last),
            "just after the deleted record"
        );
        assert_eq!(ix.sweep_starts()[1].3, run_start, "each space has its own");
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
            prop_assert!(k.starts_with(&topic_prefix(Space::Event, &topic)));
            let got = Entry::decode(&k, &entry.encode_value()).unwrap();
            prop_assert_eq!(got, (topic.as_str(), partition, entry));
        }

        #[test]
        fn runs_round_trip(topic in "[a-z.]{1,40}", partition in any::<u32>(),
                           keys in proptest::collection::vec(any::<[u8; 16]>(), 1..50),
                           first_offset in 0..u64::MAX / 2, at_ms in any::<u64>(), window_ms in any::<u64>()) {
            let run = Record { at_ms, window_ms, first_offset, keys: keys.into_iter().map(DedupKey).collect() };
            let k = run.run_key(&topic, partition);
            prop_assert!(k.starts_with(&topic_prefix(Space::Run, &topic)));
            let got = Record::decode(Space::Run, &k, &run.run_value()).unwrap();
            prop_assert_eq!(&got, &(topic.as_str(), partition, run.clone()));
            let entries: Vec<Entry> = got.2.entries().collect();
            prop_assert_eq!(entries.len(), run.keys.len());
            for (i, e) in entries.iter().enumerate() {
                prop_assert_eq!(e.offset, first_offset + i as u64);
                prop_assert_eq!(e.key, run.keys[i]);
            }
        }

        #[test]
        fn damaged_records_never_decode(k in proptest::collection::vec(any::<u8>(), 0..40),
                                        v in proptest::collection::vec(any::<u8>(), 0..40)) {
            // Random bytes either fail or decode to something; they must not panic.
            let _ = Entry::decode(&k, &v);
            let _ = Record::decode(Space::Run, &k, &v);
        }
    }
}
