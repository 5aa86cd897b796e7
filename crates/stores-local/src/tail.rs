//! The tail cache of the Local log: the most recently appended events of every
//! partition, kept in memory, so a consumer that keeps up reads them
//! without a trip to the blocking pool and RocksDB (a delivery reads its event twice:
//! its size when the dispatch core reads ahead, its bytes at the hand-out).
//!
//! Per partition the cache is one contiguous run of offsets. Appends insert as they
//! stage their batch, in offset order (under the log's append lock); the log reads the
//! cache only below the partition's durable end, so nothing is served before its
//! fsync. An append whose offsets do not follow the run (a topic deleted and created
//! again) starts a new run: the cache may forget, it never serves bytes of another
//! offset. Memory is bounded for the whole log (payloads plus a fixed cost per event):
//! the oldest cached events go first, whichever partition they belong to. What the
//! cache does not hold is read from RocksDB as before, and a read never returns an
//! offset below the partition's start (retention) because the log checks the bounds
//! before asking the cache.

use meshd_stores::log::LogEvent;
use std::collections::{HashMap, VecDeque};

/// What an event costs beyond its payload (its entry, the payload's allocation, its
/// place in the insert order), counted against the budget.
const PER_EVENT: usize = 64;

/// What an event costs against the budget.
fn cost(e: &LogEvent) -> usize {
    e.payload.len() + PER_EVENT
}

/// Reads served and missed, and what is held (for the metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TailStats {
    pub bytes: u64,
    pub events: u64,
    pub hits: u64,
    pub misses: u64,
}

pub struct TailCache {
    budget_bytes: usize,
    /// Slots of the partitions ever cached, so `order` names them by a number.
    slots: HashMap<(String, u32), usize>,
    /// Per slot, its run of cached events (contiguous offsets).
    runs: Vec<VecDeque<LogEvent>>,
    /// Every insert in order: (slot, offset). The oldest is evicted first; an entry
    /// whose event already went (its run restarted) is skipped.
    order: VecDeque<(usize, u64)>,
    bytes: usize,
    events: usize,
    hits: u64,
    misses: u64,
}

impl TailCache {
    /// A cache holding at most `budget_bytes` of payloads (0: caches nothing).
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            budget_bytes,
            slots: HashMap::new(),
            runs: Vec::new(),
            order: VecDeque::new(),
            bytes: 0,
            events: 0,
            hits: 0,
            misses: 0,
        }
    }

    fn slot(&mut self, topic: &str, partition: u32) -> usize {
        if let Some(s) = self.slots.get(&(topic.to_string(), partition)) {
            return *s;
        }
        let s = self.runs.len();
        self.runs.push(VecDeque::new());
        self.slots.insert((topic.to_string(), partition), s);
        s
    }

    /// Adds events of one partition, in offset order.
    pub fn insert(&mut self, topic: &str, partition: u32, events: Vec<LogEvent>) {
        if self.budget_bytes == 0 || events.is_empty() {
            return;
        }
        let slot = self.slot(topic, partition);
        for e in events {
            let size = cost(&e);
            if size > self.budget_bytes {
                // Never cached; the run it would break is ended.
                self.clear_slot(slot);
                continue;
            }
            if self.runs[slot]
                .back()
                .is_some_and(|last| last.offset + 1 != e.offset)
            {
                // A gap, an offset below the run, or offsets starting over: a new run.
                self.clear_slot(slot);
            }
            self.order.push_back((slot, e.offset));
            self.runs[slot].push_back(e);
            self.bytes += size;
            self.events += 1;
            self.evict();
        }
    }

    fn front(&self, slot: usize) -> Option<u64> {
        self.runs[slot].front().map(|e| e.offset)
    }

    /// Drops the oldest event of a slot's run.
    fn pop_front(&mut self, slot: usize) {
        if let Some(e) = self.runs[slot].pop_front() {
            self.bytes -= cost(&e);
            self.events -= 1;
        }
    }

    fn clear_slot(&mut self, slot: usize) {
        while !self.runs[slot].is_empty() {
            self.pop_front(slot);
        }
    }

    /// Drops the oldest events until the budget holds (bytes, and entries of `order`,
    /// which also counts events that already went).
    fn evict(&mut self) {
        let max_entries = (self.budget_bytes / PER_EVENT).max(1024);
        while self.bytes > self.budget_bytes || self.order.len() > max_entries {
            let Some((slot, offset)) = self.order.pop_front() else {
                return;
            };
            if self.front(slot) == Some(offset) {
                self.pop_front(slot);
            }
        }
    }

    /// Events from `from` (at most `max_events`, at most `max_bytes` after the first),
    /// below `end`, when the cache holds `from`; `None` otherwise (read from disk).
    pub fn read(
        &mut self,
        topic: &str,
        partition: u32,
        from: u64,
        end: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> Option<Vec<LogEvent>> {
        let held = self
            .slots
            .get(&(topic.to_string(), partition))
            .map(|s| &self.runs[*s])
            .and_then(|run| {
                let first = run.front()?.offset;
                if from < first || from >= first + run.len() as u64 {
                    return None;
                }
                let mut out = Vec::new();
                let mut bytes = 0usize;
                for e in run.range((from - first) as usize..) {
                    if e.offset >= end || out.len() >= max_events {
                        break;
                    }
                    if !out.is_empty() && bytes + e.payload.len() > max_bytes {
                        break;
                    }
                    bytes += e.payload.len();
                    out.push(e.clone());
                }
                Some(out)
            });
        match held {
            Some(out) => {
                self.hits += 1;
                Some(out)
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    /// Drops a partition's events below `start` (retention removed them).
    pub fn trim_below(&mut self, topic: &str, partition: u32, start: u64) {
        let Some(slot) = self.slots.get(&(topic.to_string(), partition)).copied() else {
            return;
        };
        while self.front(slot).is_some_and(|f| f < start) {
            self.pop_front(slot);
        }
    }

    /// Forgets every partition of a deleted topic.
    pub fn forget_topic(&mut self, topic: &str) {
        let slots: Vec<usize> = self
            .slots
            .iter()
            .filter(|((t, _), _)| t == topic)
            .map(|(_, s)| *s)
            .collect();
        for s in slots {
            self.clear_slot(s);
        }
    }

    pub fn stats(&self) -> TailStats {
        TailStats {
            bytes: self.bytes as u64,
            events: self.events as u64,
            hits: self.hits,
            misses: self.misses,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(offset: u64, appended_at_ms: u64, payload: Vec<u8>) -> LogEvent {
        LogEvent {
            offset,
            appended_at_ms,
            payload,
        }
    }

    fn ev(offset: u64, size: usize) -> LogEvent {
        event(offset, 7, vec![offset as u8; size])
    }

    fn offsets(r: Option<Vec<LogEvent>>) -> Option<Vec<u64>> {
        r.map(|v| v.into_iter().map(|e| e.offset).collect())
    }

    #[test]
    fn serves_a_contiguous_run_below_the_end_and_misses_outside_it() {
        let mut c = TailCache::new(1 << 20);
        c.insert("t", 0, (5..10).map(|o| ev(o, 10)).collect());
        assert_eq!(
            offsets(c.read("t", 0, 6, 10, 100, 1 << 20)),
            Some(vec![6, 7, 8, 9])
        );
        assert_eq!(
            offsets(c.read("t", 0, 6, 8, 100, 1 << 20)),
            Some(vec![6, 7])
        );
        assert_eq!(offsets(c.read("t", 0, 6, 10, 2, 1 << 20)), Some(vec![6, 7]));
        // The byte bound, with at least one event.
        assert_eq!(offsets(c.read("t", 0, 6, 10, 100, 15)), Some(vec![6]));
        assert_eq!(offsets(c.read("t", 0, 6, 10, 100, 0)), Some(vec![6]));
        assert_eq!(offsets(c.read("t", 0, 4, 10, 100, 1 << 20)), None);
        assert_eq!(offsets(c.read("t", 0, 10, 11, 100, 1 << 20)), None);
        assert_eq!(offsets(c.read("t", 1, 6, 10, 100, 1 << 20)), None);
        assert_eq!(offsets(c.read("u", 0, 6, 10, 100, 1 << 20)), None);
        let s = c.stats();
        assert_eq!(
            (s.hits, s.misses, s.events, s.bytes),
            (5, 4, 5, 5 * (10 + PER_EVENT as u64))
        );
        let got = c.read("t", 0, 9, 10, 1, 100).unwrap();
        assert_eq!(got, vec![event(9, 7, vec![9u8; 10])]);
    }

    #[test]
    fn a_gap_or_a_restart_begins_a_new_run_and_an_older_append_is_left_to_disk() {
        let mut c = TailCache::new(1 << 20);
        c.insert("t", 0, vec![ev(10, 1), ev(11, 1)]);
        // Offsets below the run (not what the log does, but never served wrongly).
        c.insert("t", 0, vec![ev(8, 1), ev(9, 1)]);
        assert_eq!(offsets(c.read("t", 0, 8, 12, 100, 100)), Some(vec![8, 9]));
        assert_eq!(offsets(c.read("t", 0, 10, 12, 100, 100)), None);
        // A gap: the run starts again at 20.
        c.insert("t", 0, vec![ev(20, 1)]);
        assert_eq!(offsets(c.read("t", 0, 8, 21, 100, 100)), None);
        assert_eq!(offsets(c.read("t", 0, 20, 21, 100, 100)), Some(vec![20]));
        // Offsets starting over (the topic was created again): never the old bytes.
        c.insert("t", 0, vec![event(0, 1, vec![42])]);
        assert_eq!(
            c.read("t", 0, 0, 1, 100, 100),
            Some(vec![event(0, 1, vec![42])])
        );
        assert_eq!(c.stats().events, 1);
    }

    #[test]
    fn the_budget_holds_for_the_whole_log_and_the_oldest_go_first() {
        let per = 10 + PER_EVENT;
        let mut c = TailCache::new(10 * per);
        c.insert("a", 0, (0..5).map(|o| ev(o, 10)).collect());
        c.insert("b", 0, (0..5).map(|o| ev(o, 10)).collect());
        assert_eq!(c.stats().bytes, 10 * per as u64);
        c.insert("b", 0, vec![ev(5, 30 + 2 * PER_EVENT)]);
        let s = c.stats();
        assert!(s.bytes <= 10 * per as u64, "{s:?}");
        // The three oldest of `a` went; `b` is whole.
        assert_eq!(offsets(c.read("a", 0, 0, 5, 100, 1000)), None);
        assert_eq!(offsets(c.read("a", 0, 3, 5, 100, 1000)), Some(vec![3, 4]));
        assert_eq!(
            offsets(c.read("b", 0, 0, 6, 100, 1000)),
            Some(vec![0, 1, 2, 3, 4, 5])
        );
        // An event larger than the budget is never cached and ends its run.
        c.insert("b", 0, vec![ev(6, 10 * per)]);
        assert_eq!(offsets(c.read("b", 0, 0, 7, 100, 1000)), None);
        assert_eq!(c.stats().bytes, 2 * per as u64);
        // A budget of 0 caches nothing.
        let mut none = TailCache::new(0);
        none.insert("a", 0, vec![ev(0, 1)]);
        assert_eq!(none.stats().events, 0);
    }

    #[test]
    fn many_short_lived_runs_never_grow_the_insert_order_without_bound() {
        let mut c = TailCache::new(64 * 1024);
        for round in 0..10_000u64 {
            // Every insert breaks the run: the old entries of `order` go stale.
            c.insert("t", 0, vec![ev(round * 2, 1)]);
        }
        assert!(c.order.len() <= 1024, "{}", c.order.len());
        assert_eq!(c.stats().events, 1);
    }

    #[test]
    fn retention_and_topic_deletion_drop_what_they_removed() {
        let mut c = TailCache::new(1 << 20);
        c.insert("t", 0, (0..10).map(|o| ev(o, 1)).collect());
        c.insert("t", 1, (0..3).map(|o| ev(o, 1)).collect());
        c.insert("u", 0, (0..3).map(|o| ev(o, 1)).collect());
        c.trim_below("t", 0, 4);
        assert_eq!(offsets(c.read("t", 0, 3, 10, 100, 100)), None);
        assert_eq!(offsets(c.read("t", 0, 4, 6, 100, 100)), Some(vec![4, 5]));
        c.forget_topic("t");
        assert_eq!(offsets(c.read("t", 0, 4, 10, 100, 100)), None);
        assert_eq!(offsets(c.read("t", 1, 0, 3, 100, 100)), None);
        assert_eq!(offsets(c.read("u", 0, 0, 3, 100, 100)), Some(vec![0, 1, 2]));
        assert_eq!(c.stats().events, 3);
    }
}
