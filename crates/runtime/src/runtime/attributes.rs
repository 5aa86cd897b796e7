//! The attributes of recently read events, shared by every subscription of a topic.
//!
//! A filtered subscription needs each event's context attributes and extensions, which
//! live inside the stored JSON. Parsing it once per subscription would cost N parses
//! for N filtered subscriptions of a topic; the partition tasks instead ask this cache,
//! which parses an event the first time any of them reads it and hands the same
//! attributes (one `Arc`) to the others. A subscription without a filter never asks.
//!
//! Entries are keyed by (topic, partition, offset) *and* a keyed hash of the stored
//! bytes: a topic deleted and created again starts its offsets over, and an entry of
//! the old incarnation must never answer for the new one's event at the same offset.
//! Two tasks asking for the same event at once parse it once (the second waits for the
//! first's parse, a few microseconds). Memory is bounded: the oldest entries go first
//! once the attributes held pass the budget.

use meshd_events::Event;
use meshd_stores::subscriptions::AttributeIndex;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// The attributes of one event in their string forms (context attributes and
/// extensions, `specversion` included), indexed by name for the filters' lookups;
/// empty for a stored event that does not parse (it was validated at publish, so only
/// damage does this): a filter then treats every attribute as absent and skips or
/// delivers it accordingly, it is not dead-lettered (a known gap).
pub type Attributes = AttributeIndex;

/// What the cache holds by default (attribute strings plus a fixed cost per entry).
pub const DEFAULT_BUDGET_BYTES: usize = 16 << 20;
/// What an entry costs beyond its strings (map slot, order slot, `Arc`, vector).
const PER_ENTRY: usize = 96;
/// What one attribute costs beyond its strings (two `String` headers).
const PER_ATTRIBUTE: usize = 48;
/// Independent locks, so partitions of different topics rarely wait for each other.
const SHARDS: usize = 16;

/// (hash of topic, partition and offset; hash of the stored bytes).
type Key = (u64, u64);

#[derive(Default)]
struct Shard {
    /// Each entry with what it costs (0 until parsed).
    map: HashMap<Key, (Arc<OnceLock<Attributes>>, usize)>,
    /// Keys in insertion order: the oldest go first.
    order: VecDeque<Key>,
    bytes: usize,
}

/// Hits, parses and what is held (for the metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttributeStats {
    pub hits: u64,
    pub parses: u64,
    pub entries: u64,
    pub bytes: u64,
}

pub struct AttributeCache {
    shards: Vec<Mutex<Shard>>,
    hasher: RandomState,
    budget_per_shard: usize,
    hits: AtomicU64,
    parses: AtomicU64,
}

impl Default for AttributeCache {
    fn default() -> Self {
        Self::new(DEFAULT_BUDGET_BYTES)
    }
}

impl AttributeCache {
    /// A cache holding at most about `budget_bytes` of attributes (0: holds nothing,
    /// every read parses).
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::default()).collect(),
            hasher: RandomState::new(),
            budget_per_shard: budget_bytes / SHARDS,
            hits: AtomicU64::new(0),
            parses: AtomicU64::new(0),
        }
    }

    /// The attributes of the event stored at `offset` of `topic`/`partition` with
    /// bytes `stored`: parsed here unless a task already did.
    pub fn get(&self, topic: &str, partition: u32, offset: u64, stored: &[u8]) -> Attributes {
        if self.budget_per_shard == 0 {
            self.parses.fetch_add(1, Ordering::Relaxed);
            return parse(stored);
        }
        let place = self.hasher.hash_one((topic, partition, offset));
        let key = (place, self.hasher.hash_one(stored));
        let shard = &self.shards[(place % SHARDS as u64) as usize];
        let cell = {
            let mut s = shard.lock().unwrap_or_else(PoisonError::into_inner);
            match s.map.get(&key) {
                Some((cell, _)) => cell.clone(),
                None => {
                    let cell = Arc::new(OnceLock::new());
                    s.map.insert(key, (cell.clone(), 0));
                    s.order.push_back(key);
                    cell
                }
            }
        };
        let mut parsed = false;
        let attributes = cell
            .get_or_init(|| {
                parsed = true;
                parse(stored)
            })
            .clone();
        if parsed {
            self.parses.fetch_add(1, Ordering::Relaxed);
            let cost = PER_ENTRY
                + attributes
                    .iter()
                    .map(|(k, v)| PER_ATTRIBUTE + k.len() + v.len())
                    .sum::<usize>();
            let mut guard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            let s = &mut *guard;
            // Unless it was evicted while parsing.
            if let Some(entry) = s.map.get_mut(&key).filter(|e| Arc::ptr_eq(&e.0, &cell)) {
                entry.1 = cost;
                s.bytes += cost;
            }
            self.evict(s);
        } else {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
        attributes
    }

    /// Drops the oldest entries until the shard is within its budget (entries still
    /// being parsed count by their number, so the order cannot grow without bound).
    fn evict(&self, s: &mut Shard) {
        let max_entries = (self.budget_per_shard / PER_ENTRY).max(1);
        while s.bytes > self.budget_per_shard || s.order.len() > max_entries {
            let Some(key) = s.order.pop_front() else {
                return;
            };
            if let Some((_, cost)) = s.map.remove(&key) {
                s.bytes -= cost;
            }
        }
    }

    pub fn stats(&self) -> AttributeStats {
        let (mut entries, mut bytes) = (0, 0);
        for shard in &self.shards {
            let s = shard.lock().unwrap_or_else(PoisonError::into_inner);
            entries += s.map.len() as u64;
            bytes += s.bytes as u64;
        }
        AttributeStats {
            hits: self.hits.load(Ordering::Relaxed),
            parses: self.parses.load(Ordering::Relaxed),
            entries,
            bytes,
        }
    }
}

fn parse(stored: &[u8]) -> Attributes {
    match Event::from_stored(stored) {
        Ok(e) => e
            .attributes()
            .map(|(k, v)| (k.to_string(), v.into_owned()))
            .collect(),
        Err(_) => AttributeIndex::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: &str, event_type: &str) -> Vec<u8> {
        format!(r#"{{"specversion":"1.0","id":"{id}","source":"/s","type":"{event_type}","region":"eu"}}"#).into_bytes()
    }

    fn attribute<'a>(a: &'a Attributes, name: &str) -> Option<&'a str> {
        a.get(name)
    }

    #[test]
    fn the_second_reader_of_an_event_gets_the_first_ones_parse() {
        let cache = AttributeCache::default();
        let e = event("1", "order.created");
        let a = cache.get("t", 0, 7, &e);
        let b = cache.get("t", 0, 7, &e);
        assert!(AttributeIndex::ptr_eq(&a, &b));
        assert_eq!(attribute(&a, "type"), Some("order.created"));
        assert_eq!(attribute(&a, "region"), Some("eu"));
        assert_eq!(attribute(&a, "specversion"), Some("1.0"));
        let s = cache.stats();
        assert_eq!((s.parses, s.hits, s.entries), (1, 1, 1));
        assert!(s.bytes > 0);
    }

    #[test]
    fn other_bytes_at_the_same_offset_are_parsed_again_never_answered_from_the_old_ones() {
        // A topic deleted and created again starts its offsets over.
        let cache = AttributeCache::default();
        let old = cache.get("t", 0, 0, &event("1", "old"));
        let new = cache.get("t", 0, 0, &event("1", "new"));
        assert_eq!(attribute(&old, "type"), Some("old"));
        assert_eq!(attribute(&new, "type"), Some("new"));
        // And another topic or partition at that offset is another event.
        let other = cache.get("u", 0, 0, &event("1", "old"));
        assert!(!AttributeIndex::ptr_eq(&old, &other));
        assert_eq!(cache.stats().parses, 3);
    }

    #[test]
    fn memory_stays_within_the_budget_and_the_oldest_go_first() {
        let cache = AttributeCache::new(SHARDS * 4096);
        for offset in 0..10_000 {
            cache.get("t", 0, offset, &event(&offset.to_string(), "x"));
        }
        let s = cache.stats();
        assert!(s.bytes <= 4096 * SHARDS as u64, "{s:?}");
        assert!(s.entries < 10_000, "{s:?}");
        // The newest is still held, the oldest is parsed again.
        cache.get("t", 0, 9_999, &event("9999", "x"));
        assert_eq!(cache.stats().hits, 1);
        cache.get("t", 0, 0, &event("0", "x"));
        assert_eq!(cache.stats().parses, 10_001);
    }

    #[test]
    fn a_stored_event_that_does_not_parse_has_no_attributes_and_no_budget_parses_every_time() {
        let cache = AttributeCache::new(0);
        assert!(cache.get("t", 0, 0, b"not json").is_empty());
        cache.get("t", 0, 1, &event("1", "x"));
        cache.get("t", 0, 1, &event("1", "x"));
        let s = cache.stats();
        assert_eq!((s.parses, s.hits, s.entries), (3, 0, 0));
    }

    #[test]
    fn concurrent_readers_of_one_event_parse_it_once() {
        let cache = Arc::new(AttributeCache::default());
        let e = Arc::new(event("1", "x"));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (cache, e) = (cache.clone(), e.clone());
                std::thread::spawn(move || {
                    for offset in 0..1000 {
                        cache.get("t", 0, offset, &e);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("reader thread");
        }
        let s = cache.stats();
        assert_eq!((s.parses, s.hits), (1000, 7000));
    }
}
