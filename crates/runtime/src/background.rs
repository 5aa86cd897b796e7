//! The work an instance does besides answering requests, tracked so that a graceful
//! stop can end it and knows when it has ended.
//!
//! Every loop and helper task of the runtime (partition tasks, push workers,
//! membership, ownership, requeue, compaction, housekeeping) is spawned through one
//! [`Background`]. [`Background::stop`] cancels them all at their next `await` and
//! waits for them to finish, so that once it returns nothing but the caller holds the
//! stores any more: they can be flushed, closed and (RocksDB) unlocked, and a second
//! instance can open the same data directory in the same process.
//!
//! Cancelling at an `await` is what a crash does to a task, at a point where the task
//! had to be ready for one: what it had written is durable, what it had not is as if
//! it never happened, and every store is built to recover from that. Work whose stop
//! has a protocol of its own (releasing partitions, revoking the membership lease) is
//! asked to stop that way first; [`Background::stop`] ends what is left.

use std::future::Future;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The tracked background tasks of one instance. Clones share the same set.
#[derive(Clone, Debug, Default)]
pub struct Background {
    tracker: TaskTracker,
    cancel: CancellationToken,
}

impl Background {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `task` until it completes or the background is stopped, whichever comes
    /// first. A task spawned after [`stop`](Self::stop) began ends at once.
    pub fn spawn<F>(&self, task: F) -> JoinHandle<()>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let cancel = self.cancel.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => {}
                _ = task => {}
            }
        })
    }

    /// Whether [`stop`](Self::stop) has begun.
    pub fn is_stopped(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// How many tasks are still running.
    pub fn running(&self) -> usize {
        self.tracker.len()
    }

    /// Cancels every task and waits, at most `within`, for all of them to end.
    /// `Err(n)`: `n` tasks were still running at the deadline (a task that blocks a
    /// thread without awaiting cannot be cancelled).
    pub async fn stop(&self, within: Duration) -> Result<(), usize> {
        self.cancel.cancel();
        self.tracker.close();
        match tokio::time::timeout(within, self.tracker.wait()).await {
            Ok(()) => Ok(()),
            Err(_) => Err(self.tracker.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn stop_cancels_a_waiting_task_and_drops_what_it_holds() {
        let bg = Background::new();
        let held = Arc::new(());
        let h = held.clone();
        bg.spawn(async move {
            let _h = h;
            std::future::pending::<()>().await
        });
        assert_eq!(bg.running(), 1);
        assert_eq!(Arc::strong_count(&held), 2);
        bg.stop(Duration::from_secs(5)).await.unwrap();
        assert_eq!(bg.running(), 0);
        assert_eq!(Arc::strong_count(&held), 1, "the task's future was dropped");
        assert!(bg.is_stopped());
    }

    #[tokio::test]
    async fn a_task_that_ends_by_itself_is_not_waited_for_and_one_spawned_after_stop_never_runs() {
        let bg = Background::new();
        bg.spawn(async {}).await.unwrap();
        assert_eq!(bg.running(), 0);
        bg.stop(Duration::from_secs(5)).await.unwrap();
        let ran = Arc::new(AtomicBool::new(false));
        let r = ran.clone();
        bg.spawn(async move {
            tokio::task::yield_now().await;
            r.store(true, Ordering::SeqCst);
        })
        .await
        .unwrap();
        assert!(!ran.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn stop_reports_a_task_that_does_not_end_within_the_bound() {
        let bg = Background::new();
        // Tracked but deaf to cancellation, as a section that blocks would be.
        bg.tracker.spawn(std::future::pending::<()>());
        assert_eq!(bg.stop(Duration::from_millis(50)).await, Err(1));
    }
}
