//! What other tasks see of a partition without asking it ([`Shared`]): how many
//! deliveries are ready (claimed by the pulls on their way, [`Claim`]), the log end
//! and committed offset the core knows, its gauges, and whether it fail-stopped.

use meshd_dispatch::Stats;
use meshd_stores::offsets::OffsetKey;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

/// What other tasks see of a partition without asking it.
#[derive(Default)]
pub struct Shared {
    /// `PartitionCore::ready` after the last input, less what waiting pulls have
    /// claimed since ([`Shared::claim`]): a pull skips a partition at 0. The task
    /// overwrites it after every input, so a claim lasts until the next turn.
    pub ready: AtomicUsize,
    /// The log end the core has been told of (a pull asks the task to look again
    /// when the log has grown beyond it).
    pub log_end: AtomicU64,
    /// The core's committed offset (exact: updated before every reply).
    pub committed: AtomicU64,
    /// Refreshed at most every [`STATS_EVERY`](super::STATS_EVERY) (computing them walks the window).
    pub stats: Mutex<Stats>,
    /// Set when a store write failed: the task stopped feeding its core.
    pub failed: Mutex<Option<String>>,
    /// Cluster mode: when the committed offset was last checkpointed to Meta (or the
    /// partition acquired), unix ms; 0 in standalone mode.
    pub checkpointed_at_ms: AtomicU64,
    /// Cluster mode: the partition's attempt-ledger records in Meta.
    pub ledger_records: AtomicUsize,
    /// Events of the partition in the park index (waiting for their time, or
    /// unparked and not settled yet).
    pub parked: AtomicU64,
}

/// Ready deliveries a pull has claimed on its way to the partition task; given back if
/// the pull is dropped before its request reached the task.
pub struct Claim<'a> {
    ready: &'a AtomicUsize,
    n: usize,
}

impl Claim<'_> {
    /// The request reached the task: its next turn recounts `ready`.
    pub fn sent(mut self) {
        self.n = 0;
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if self.n > 0 {
            self.ready.fetch_add(self.n, Ordering::AcqRel);
        }
    }
}

impl Shared {
    /// Claims up to `n` of the ready deliveries for one pull; `None` when none are
    /// ready (or all are claimed by pulls already on their way). So when one append
    /// makes a batch ready, the first waiting pulls that cover it ask the task, not
    /// every waiting pull (each of which the task would answer empty). A pull that
    /// got less than it claimed leaves the rest ready at the task's next turn, which
    /// recounts and wakes the waiting pulls again.
    pub fn claim(&self, n: usize) -> Option<Claim<'_>> {
        let mut claimed = 0;
        self.ready
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| {
                claimed = r.min(n.max(1));
                (r > 0).then(|| r - claimed)
            })
            .ok()?;
        Some(Claim {
            ready: &self.ready,
            n: claimed,
        })
    }

    pub fn stats(&self) -> Stats {
        *self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn failed(&self) -> Option<String> {
        self.failed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A partition's store write failed: logged with the store named, and the partition
/// stops dispatching until a restart.
pub(super) fn fail_partition(shared: &Shared, key: &OffsetKey, store: &'static str, error: String) {
    tracing::error!(store, backend = "rocksdb", subscription = %key.subscription, topic = %key.topic, partition = key.partition, error = %error, "store write failed; this partition stops dispatching until a restart");
    *shared.failed.lock().unwrap_or_else(PoisonError::into_inner) =
        Some(format!("{store}: {error}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pulls_claim_the_ready_deliveries_between_turns_and_a_dropped_pull_gives_its_claim_back() {
        let shared = Shared::default();
        assert!(
            shared.claim(10).is_none(),
            "nothing ready, nothing to ask for"
        );
        shared.ready.store(150, Ordering::Release);
        // One append made 150 ready: two pulls of 100 cover it, a third waits.
        let a = shared.claim(100).unwrap();
        let b = shared.claim(100).unwrap();
        assert!(shared.claim(100).is_none());
        a.sent();
        // A pull dropped before its request reached the task gives its 50 back.
        drop(b);
        assert_eq!(shared.ready.load(Ordering::Acquire), 50);
        let c = shared.claim(10).unwrap();
        c.sent();
        assert_eq!(shared.ready.load(Ordering::Acquire), 40);
        // The task's next turn recounts: whatever was claimed, the count is exact.
        shared.ready.store(7, Ordering::Release);
        assert!(shared.claim(100).is_some());
    }
}
