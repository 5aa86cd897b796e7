//! Group commit: many writers, one fsync.
//!
//! A writer applies its batch buffered (under a mutex, so the model of what is written
//! follows the WAL's order) and takes a ticket. The first writer that finds no fsync
//! running becomes the leader: it fsyncs everything written so far and wakes every
//! writer whose ticket that covered. The others wait. So a burst of N concurrent
//! commits costs about two fsyncs, and every commit returns only once durable.
//!
//! A failed write or fsync poisons the committer (fail-stop: what reached disk is
//! unknown). Each caller learns which side of the failure it is on, because that is
//! what its own caller may promise:
//!
//! * its batch was written but never made durable (the write failed, or an fsync
//!   meant to cover it did): [`LocalError::WriteFailed`], outcome unknown — the batch
//!   reached the OS and may be on disk after a restart;
//! * it came after the failure (of this committer or of its engine, which other
//!   users share): [`LocalError::Poisoned`], refused — nothing of it was written.
//!
//! A failure records its root reason once; every later refusal repeats that reason.
//!
//! # The store thread
//!
//! [`submit`](GroupCommit::submit) hands a write to one thread per committer instead of
//! a thread per writer. It takes every write queued since its last turn, applies them
//! in order, answers the buffered ones at once, then fsyncs once for all the ones that
//! wait for durability and answers them. A burst of writes costs one wake-up of that
//! thread and one fsync, and no writer thread sleeps on the fsync (profiles of the
//! delivery path showed a quarter of the CPU in context switches of writers parked on
//! the commit and of the blocking pool). The blocking API below stays for everything
//! else; both share the lock, the tickets and the fsync leadership.
//!
//! The fsync itself runs on a second thread (the sync thread), so the store thread goes
//! on applying writes while it runs: a buffered write (an ack's resolve) is answered
//! without waiting for an fsync it does not need, and the writes that arrive during one
//! fsync are all covered by the next (one fsync in flight at a time, back to back under
//! load). Answers keep their meaning: a durable write is answered once an fsync that
//! began after it was applied has returned (the WAL is written in ticket order, so it
//! covers every earlier ticket too).

use crate::engine::{Batch, Durability, KvEngine, LocalError};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, Weak};

struct State {
    /// Tickets issued (batches written, buffered).
    written: u64,
    /// Every ticket up to this one is durable.
    synced: u64,
    syncing: bool,
    poisoned: Option<String>,
}

pub struct GroupCommit {
    engine: Arc<dyn KvEngine>,
    state: Mutex<State>,
    synced_cv: Condvar,
    /// Who is committing, for logs ("log", "offsets", ...).
    store: &'static str,
    /// The store thread's queue, started by the first [`submit`](Self::submit).
    queue: OnceLock<Arc<Queue>>,
}

/// Whether a submitted write is answered once written or once durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    Written,
    Durable,
}

/// What a write's answer is told once its fsync is done.
type AfterSync = Box<dyn FnOnce(Result<(), LocalError>) + Send>;

/// How a write applied on the store thread is answered. Answers are given only after
/// the thread let go of the committer, so a caller that drops the stores after its
/// last answer finds the engine closed.
enum Answer {
    Now(Box<dyn FnOnce() + Send>),
    /// Once the ticket is durable.
    AfterSync(u64, AfterSync),
}

/// A submitted write, applied on the store thread.
type Job = Box<dyn FnOnce(&GroupCommit) -> Answer + Send>;

struct Queue {
    /// Queued jobs, and whether the committer is gone (the thread then exits).
    jobs: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
}

/// The sync thread's queue: the highest ticket to make durable and the answers that
/// wait for it, and whether the store thread is gone (the sync thread then finishes
/// what is queued and exits).
struct Syncs {
    due: Mutex<(u64, Vec<AfterSync>, bool)>,
    ready: Condvar,
}

impl Syncs {
    fn lock(&self) -> MutexGuard<'_, (u64, Vec<AfterSync>, bool)> {
        // Pushes and takes are single operations: consistent after a panic.
        self.due.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn close(&self) {
        self.lock().2 = true;
        self.ready.notify_one();
    }
}

/// The sync thread: fsyncs up to the highest ticket queued and answers every write
/// that waited for it, one fsync at a time, while the store thread applies the next
/// writes. Exits once the store thread is gone and nothing is queued.
fn sync_thread(group: Weak<GroupCommit>, syncs: Arc<Syncs>) {
    loop {
        let (last, waiting) = {
            let mut q = syncs.lock();
            while q.1.is_empty() && !q.2 {
                q = syncs.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            if q.1.is_empty() {
                return;
            }
            (std::mem::take(&mut q.0), std::mem::take(&mut q.1))
        };
        // The committer is let go of before the answers (as on the store thread).
        let result = match group.upgrade() {
            Some(g) => g.wait_durable(last),
            None => Err(LocalError::WriteFailed(
                "the committer went away before the fsync".into(),
            )),
        };
        for after in waiting {
            after(result.as_ref().map(|_| ()).map_err(again));
        }
    }
}

impl Queue {
    fn lock(&self) -> MutexGuard<'_, (VecDeque<Job>, bool)> {
        // Pushes and takes are single operations: consistent after a panic.
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The same failure again, for one more caller (the error type is not `Clone`).
fn again(e: &LocalError) -> LocalError {
    match e {
        LocalError::Poisoned(r) => LocalError::Poisoned(r.clone()),
        other => LocalError::WriteFailed(other.reason()),
    }
}

/// The store thread: takes what queued, applies it, answers the buffered writes and
/// hands the durable ones to the sync thread. Exits when the committer is dropped.
fn store_thread(group: Weak<GroupCommit>, queue: Arc<Queue>, syncs: Arc<Syncs>) {
    struct CloseOnExit(Arc<Syncs>);
    impl Drop for CloseOnExit {
        fn drop(&mut self) {
            self.0.close();
        }
    }
    let _close = CloseOnExit(syncs.clone());
    loop {
        let jobs = {
            let mut q = queue.lock();
            while q.0.is_empty() && !q.1 {
                q = queue.ready.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            if q.0.is_empty() {
                return;
            }
            std::mem::take(&mut q.0)
        };
        let mut now = Vec::new();
        let mut waiting: Vec<AfterSync> = Vec::new();
        let mut last = 0;
        {
            // Gone: the jobs are dropped unanswered, which their callers report.
            let Some(g) = group.upgrade() else {
                return;
            };
            for job in jobs {
                // A job answers a panic of its write itself; a panic past that (its
                // answer) drops the answer and fail-stops the committer as well.
                match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&g))) {
                    Ok(Answer::Now(answer)) => now.push(answer),
                    Ok(Answer::AfterSync(ticket, after)) => {
                        last = last.max(ticket);
                        waiting.push(after);
                    }
                    Err(_) => g.fail_stop("a write panicked on the store thread"),
                }
            }
        }
        for answer in now {
            answer();
        }
        if waiting.is_empty() {
            continue;
        }
        let mut q = syncs.lock();
        q.0 = q.0.max(last);
        q.1.extend(waiting);
        drop(q);
        syncs.ready.notify_one();
    }
}

impl Drop for GroupCommit {
    fn drop(&mut self) {
        if let Some(q) = self.queue.get() {
            q.lock().1 = true;
            q.ready.notify_all();
        }
    }
}

impl GroupCommit {
    pub fn new(engine: Arc<dyn KvEngine>, store: &'static str) -> Self {
        Self {
            engine,
            state: Mutex::new(State {
                written: 0,
                synced: 0,
                syncing: false,
                poisoned: None,
            }),
            synced_cv: Condvar::new(),
            store,
            queue: OnceLock::new(),
        }
    }

    /// The store thread's queue; `None` when the thread cannot be started (then the
    /// committer is poisoned: an instance that cannot start a thread stops writing).
    fn queue(self: &Arc<Self>) -> Option<&Arc<Queue>> {
        let q = self.queue.get_or_init(|| {
            let q = Arc::new(Queue {
                jobs: Mutex::new((VecDeque::new(), false)),
                ready: Condvar::new(),
            });
            let syncs = Arc::new(Syncs {
                due: Mutex::new((0, Vec::new(), false)),
                ready: Condvar::new(),
            });
            let (weak, for_sync) = (Arc::downgrade(self), syncs.clone());
            if let Err(e) = std::thread::Builder::new()
                .name(format!("{}-sync", self.store))
                .spawn(move || sync_thread(weak, for_sync))
            {
                self.fail_stop(&format!("cannot start the sync thread: {e}"));
                q.lock().1 = true;
                return q;
            }
            let (weak, for_thread) = (Arc::downgrade(self), q.clone());
            let for_close = syncs.clone();
            if let Err(e) = std::thread::Builder::new()
                .name(format!("{}-store", self.store))
                .spawn(move || store_thread(weak, for_thread, syncs))
            {
                self.fail_stop(&format!("cannot start the store thread: {e}"));
                q.lock().1 = true;
                for_close.close();
            }
            q
        });
        (!q.lock().1).then_some(q)
    }

    /// Runs `f` on the store thread under the write lock (as
    /// [`write_with`](Self::write_with) does), writes the batch it returns and calls
    /// `done` with its ticket (`None`: an empty batch) and output: at once for
    /// [`Wait::Written`], once durable for [`Wait::Durable`] (one fsync for every
    /// durable write the thread took in the same turn). Never blocks the caller.
    /// Errors as for [`commit_with`](Self::commit_with). A `done` that is dropped
    /// uncalled means the committer went away with the write queued (its outcome is
    /// unknown to the caller).
    pub fn submit<T, E, F, D>(self: &Arc<Self>, wait: Wait, f: F, done: D)
    where
        T: Send + 'static,
        E: From<LocalError> + Send + 'static,
        F: FnOnce(&dyn KvEngine) -> Result<(Batch, T), E> + Send + 'static,
        D: FnOnce(Result<(Option<u64>, T), E>) + Send + 'static,
    {
        let Some(queue) = self.queue() else {
            let reason = self
                .poisoned()
                .unwrap_or_else(|| "the store thread stopped".into());
            done(Err(LocalError::Poisoned(reason).into()));
            return;
        };
        let job: Job = Box::new(move |group: &GroupCommit| {
            // A write that panics may have reached the engine or not: its caller is
            // told the outcome is unknown, after the committer has fail-stopped.
            let written =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| group.write_with(f)))
                    .unwrap_or_else(|_| {
                        let reason = "a write panicked on the store thread";
                        group.fail_stop(reason);
                        Err(LocalError::WriteFailed(reason.into()).into())
                    });
            match written {
                Ok((Some(ticket), out)) if wait == Wait::Durable => Answer::AfterSync(
                    ticket,
                    Box::new(move |synced: Result<(), LocalError>| {
                        done(synced.map(|()| (Some(ticket), out)).map_err(E::from))
                    }),
                ),
                other => Answer::Now(Box::new(move || done(other))),
            }
        });
        queue.lock().0.push_back(job);
        queue.ready.notify_one();
    }

    pub fn engine(&self) -> &Arc<dyn KvEngine> {
        &self.engine
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update of the state is a single assignment: consistent after a panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reason this committer is poisoned, if it is: its own failed write or
    /// fsync, or one of its engine's (another user of the same engine, such as the
    /// embedded Meta, failed first: every write here would be refused too, so the
    /// health of the stores on this committer must say so before they try one).
    pub fn poisoned(&self) -> Option<String> {
        let own = self.lock().poisoned.clone();
        own.or_else(|| self.engine.failure())
    }

    /// [`poison`](Self::poison) from outside the lock.
    fn fail_stop(&self, reason: &str) {
        let mut s = self.lock();
        self.poison(&mut s, reason);
    }

    /// Fail-stops this committer with `reason` (the first reason sticks).
    fn poison(&self, s: &mut State, reason: &str) {
        if s.poisoned.is_none() {
            tracing::error!(
                store = self.store,
                backend = "rocksdb",
                reason,
                "local write failed; store fail-stopped"
            );
            s.poisoned = Some(reason.to_string());
        }
    }

    /// Writes `batch` and returns once it is durable. Blocking. On error see the
    /// module doc: `WriteFailed` (outcome unknown) or `Poisoned` (not written).
    pub fn commit(&self, batch: Batch) -> Result<(), LocalError> {
        self.commit_with(|_| Ok::<_, LocalError>((batch, ())))
    }

    /// Runs `f` under the write lock (so it sees every earlier write and no concurrent
    /// one), writes the batch it returns and makes it durable. For writers that must
    /// read-modify-write (assign the next offset, check a committed value). An empty
    /// batch writes nothing and waits for nothing.
    pub fn commit_with<T, E: From<LocalError>>(
        &self,
        f: impl FnOnce(&dyn KvEngine) -> Result<(Batch, T), E>,
    ) -> Result<T, E> {
        let (ticket, out) = self.write_with(f)?;
        if let Some(ticket) = ticket {
            self.wait_durable(ticket)?;
        }
        Ok(out)
    }

    /// Like [`commit_with`](Self::commit_with) but returns once written (buffered),
    /// with the ticket to wait on (`None` when the batch was empty). `Poisoned`: not
    /// written; `WriteFailed`: the write itself failed, outcome unknown.
    pub fn write_with<T, E: From<LocalError>>(
        &self,
        f: impl FnOnce(&dyn KvEngine) -> Result<(Batch, T), E>,
    ) -> Result<(Option<u64>, T), E> {
        let mut s = self.lock();
        if let Some(reason) = &s.poisoned {
            return Err(LocalError::Poisoned(reason.clone()).into());
        }
        let (batch, out) = f(self.engine.as_ref())?;
        if batch.is_empty() {
            return Ok((None, out));
        }
        if let Err(e) = self.engine.write(batch, Durability::Buffered) {
            let e = match e {
                // The engine had already failed (another of its users failed first):
                // refused, nothing written.
                LocalError::Poisoned(reason) => {
                    self.poison(&mut s, &reason);
                    LocalError::Poisoned(reason)
                }
                // The write itself failed: it may have reached the WAL.
                LocalError::WriteFailed(reason) => {
                    self.poison(&mut s, &reason);
                    LocalError::WriteFailed(reason)
                }
                // Refused before anything was written (an unknown column family: a
                // caller's bug, not a disk failure).
                other => other,
            };
            return Err(e.into());
        }
        s.written += 1;
        Ok((Some(s.written), out))
    }

    /// The highest ticket known durable (every ticket up to it is): a buffered
    /// writer holding a ticket can tell, without waiting, whether its batch is on disk.
    pub fn synced(&self) -> u64 {
        self.lock().synced
    }

    /// Makes everything written so far durable. Once poisoned it fails: with
    /// `WriteFailed` while some written batch never became durable, else `Poisoned`.
    pub fn sync_all(&self) -> Result<(), LocalError> {
        let ticket = {
            let s = self.lock();
            match &s.poisoned {
                Some(reason) if s.synced >= s.written => {
                    return Err(LocalError::Poisoned(reason.clone()))
                }
                _ => s.written,
            }
        };
        self.wait_durable(ticket)
    }

    /// Returns once the batch of `ticket` (and every earlier one) is durable. Fails
    /// with `WriteFailed` when the committer fail-stopped before that: the batch was
    /// written, so whether it is on disk is unknown.
    pub fn wait_durable(&self, ticket: u64) -> Result<(), LocalError> {
        let mut s = self.lock();
        loop {
            // Durable before a later failure: durable (checked first, so a failure
            // after this ticket's fsync never turns a durable write into an error).
            if s.synced >= ticket {
                return Ok(());
            }
            if let Some(reason) = &s.poisoned {
                return Err(LocalError::WriteFailed(reason.clone()));
            }
            if s.syncing {
                s = self.synced_cv.wait(s).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            // Lead: fsync everything written so far.
            s.syncing = true;
            let target = s.written;
            drop(s);
            let result = self.engine.sync();
            s = self.lock();
            s.syncing = false;
            match result {
                Ok(()) => s.synced = s.synced.max(target),
                Err(e) => self.poison(&mut s, &e.reason()),
            }
            self.synced_cv.notify_all();
        }
    }
}

#[cfg(all(test, feature = "testing"))]
mod tests {
    use super::*;
    use crate::testing::PowerCutEngine;
    use crate::RocksEngine;

    #[test]
    fn concurrent_commits_are_durable_when_they_return() {
        let dir = tempfile::tempdir().unwrap();
        let inner = RocksEngine::open(dir.path(), &["a"]).unwrap();
        let (engine, power) = PowerCutEngine::wrap(inner, &["a"]).unwrap();
        let g = Arc::new(GroupCommit::new(Arc::new(engine), "test"));
        let mut threads = Vec::new();
        for t in 0..8 {
            let g = g.clone();
            threads.push(std::thread::spawn(move || {
                for i in 0..50 {
                    let mut b = Batch::new();
                    b.put("a", format!("{t}-{i}"), "v");
                    g.commit(b).unwrap();
                }
            }));
        }
        for t in threads {
            t.join().unwrap();
        }
        let image = power.cut();
        assert_eq!(image.len(), 400, "every committed write is durable");
    }

    fn put(key: &str) -> Batch {
        let mut b = Batch::new();
        b.put("a", key, "v");
        b
    }

    fn committer() -> (tempfile::TempDir, GroupCommit, crate::testing::PowerCut) {
        let dir = tempfile::tempdir().unwrap();
        let inner = RocksEngine::open(dir.path(), &["a"]).unwrap();
        let (engine, power) = PowerCutEngine::wrap(inner, &["a"]).unwrap();
        (dir, GroupCommit::new(Arc::new(engine), "test"), power)
    }

    #[test]
    fn a_failed_fsync_poisons_every_later_commit() {
        let (_dir, g, power) = committer();
        g.commit(put("k")).unwrap();
        power.fail_syncs(true);
        assert!(g.commit(put("k")).is_err());
        power.fail_syncs(false);
        assert!(matches!(g.commit(put("k")), Err(LocalError::Poisoned(_))));
        assert!(g.poisoned().is_some());
    }

    /// The distinction a caller's answer rests on (HTTP 504 vs 503): a batch that was
    /// written but whose fsync failed has an unknown outcome; a batch that comes after
    /// the failure is refused unwritten.
    #[test]
    fn given_a_failed_fsync_then_the_batches_it_was_to_cover_are_outcome_unknown_and_later_ones_are_refused_unwritten(
    ) {
        let (_dir, g, power) = committer();
        let (first, ()) = g
            .write_with(|_| Ok::<_, LocalError>((put("first"), ())))
            .unwrap();
        let (second, ()) = g
            .write_with(|_| Ok::<_, LocalError>((put("second"), ())))
            .unwrap();
        power.fail_syncs(true);
        let err = g.wait_durable(second.unwrap()).unwrap_err();
        assert!(err.outcome_unknown(), "{err:?}");
        assert!(
            matches!(&err, LocalError::WriteFailed(r) if r == "injected fsync failure"),
            "{err:?}"
        );
        // The other writer of the same group: written, not durable, just as unknown.
        let err = g.wait_durable(first.unwrap()).unwrap_err();
        assert!(matches!(err, LocalError::WriteFailed(_)), "{err:?}");
        assert_eq!(power.pending_batches(), 2, "both reached the engine");

        power.fail_syncs(false);
        let err = g.commit(put("later")).unwrap_err();
        assert!(matches!(err, LocalError::Poisoned(_)), "{err:?}");
        assert!(!err.outcome_unknown());
        assert_eq!(
            power.pending_batches(),
            2,
            "a refused batch is never written"
        );
        assert!(matches!(g.sync_all(), Err(LocalError::WriteFailed(_))));
    }

    #[test]
    fn given_a_failed_write_then_it_is_outcome_unknown() {
        let (_dir, g, power) = committer();
        power.fail_writes(true);
        let err = g.commit(put("k")).unwrap_err();
        assert!(matches!(err, LocalError::WriteFailed(_)), "{err:?}");
        power.fail_writes(false);
        assert!(matches!(g.commit(put("k")), Err(LocalError::Poisoned(_))));
        assert!(matches!(g.sync_all(), Err(LocalError::Poisoned(_))));
    }

    #[test]
    fn given_a_batch_made_durable_before_a_later_fsync_failed_then_its_wait_succeeds() {
        let (_dir, g, power) = committer();
        let (durable, ()) = g
            .write_with(|_| Ok::<_, LocalError>((put("durable"), ())))
            .unwrap();
        g.wait_durable(durable.unwrap()).unwrap();
        power.fail_syncs(true);
        assert!(g.commit(put("lost")).is_err());
        g.wait_durable(durable.unwrap())
            .expect("a durable batch stays acknowledged after a later failure");
    }

    /// Submits a write of `key` and waits for its answer on a channel.
    fn submit(g: &Arc<GroupCommit>, wait: Wait, key: &str) -> Result<Option<u64>, LocalError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let key = key.to_string();
        g.submit(
            wait,
            move |_| Ok::<_, LocalError>((put(&key), ())),
            move |r: Result<(Option<u64>, ()), LocalError>| {
                let _ = tx.send(r.map(|(t, ())| t));
            },
        );
        rx.recv().expect("answered")
    }

    #[test]
    fn the_store_thread_answers_a_durable_write_once_durable_and_a_written_one_before_any_fsync() {
        let (_dir, g, power) = committer();
        let g = Arc::new(g);
        submit(&g, Wait::Written, "written").unwrap();
        assert_eq!(power.pending_batches(), 1, "answered without an fsync");
        submit(&g, Wait::Durable, "durable").unwrap();
        assert_eq!(power.pending_batches(), 0);
        // The fsync covered the earlier buffered write too.
        assert_eq!(power.cut().len(), 2);
    }

    #[test]
    fn concurrent_submits_are_each_durable_when_answered() {
        let (_dir, g, power) = committer();
        let g = Arc::new(g);
        let answered = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for t in 0..8 {
            let (g, answered) = (g.clone(), answered.clone());
            threads.push(std::thread::spawn(move || {
                for i in 0..50 {
                    let key = format!("{t}-{i}");
                    submit(&g, Wait::Durable, &key).unwrap();
                    // What a cut right after the answer keeps must include it.
                    answered.lock().unwrap().push(key);
                }
            }));
        }
        for t in threads {
            t.join().unwrap();
        }
        let image = power.cut();
        assert_eq!(image.len(), 400);
        assert_eq!(answered.lock().unwrap().len(), 400);
    }

    #[test]
    fn given_a_failed_fsync_on_the_store_thread_then_its_writes_are_outcome_unknown_and_later_ones_refused(
    ) {
        let (_dir, g, power) = committer();
        let g = Arc::new(g);
        power.fail_syncs(true);
        let err = submit(&g, Wait::Durable, "k").unwrap_err();
        assert!(err.outcome_unknown(), "{err:?}");
        power.fail_syncs(false);
        let err = submit(&g, Wait::Written, "later").unwrap_err();
        assert!(matches!(err, LocalError::Poisoned(_)), "{err:?}");
        assert_eq!(
            power.pending_batches(),
            1,
            "a refused write is never written"
        );
    }

    #[test]
    fn a_write_that_panics_on_the_store_thread_is_outcome_unknown_and_fail_stops_the_committer() {
        let (_dir, g, _power) = committer();
        let g = Arc::new(g);
        let (tx, rx) = std::sync::mpsc::channel::<Result<(Option<u64>, ()), LocalError>>();
        g.submit(
            Wait::Durable,
            |_| -> Result<(Batch, ()), LocalError> { panic!("a bug in a write") },
            move |r| {
                let _ = tx.send(r);
            },
        );
        let err = rx.recv().expect("answered").unwrap_err();
        assert!(err.outcome_unknown(), "{err:?}");
        // Fail-stopped before the answer was given.
        assert!(g.poisoned().is_some());
        // The thread lives on and refuses what comes next.
        let err = submit(&g, Wait::Durable, "next").unwrap_err();
        assert!(matches!(err, LocalError::Poisoned(_)), "{err:?}");
    }

    #[test]
    fn dropping_the_committer_stops_its_store_thread_and_lets_go_of_the_engine() {
        let (_dir, g, _power) = committer();
        let engine = g.engine().clone();
        let g = Arc::new(g);
        submit(&g, Wait::Durable, "k").unwrap();
        drop(g);
        // The answer came after the thread let go: only this test holds the engine.
        assert_eq!(Arc::strong_count(&engine), 1);
    }
}

#[cfg(test)]
mod fake_engine_tests {
    use super::*;
    use crate::Rows;
    use std::sync::mpsc;
    use std::time::Duration;

    const REASON: &str = "fsync failed: a write of the embedded Meta";

    /// Engines that fail or block where a test needs them to.
    enum Fake {
        /// Another user of it (the embedded Meta) has fail-stopped it.
        FailedElsewhere,
        /// Its fsync reports that it began and then waits to be let go.
        GatedSync {
            began: Mutex<mpsc::Sender<()>>,
            release: Mutex<mpsc::Receiver<()>>,
        },
    }

    impl KvEngine for Fake {
        fn get(&self, _: &'static str, _: &[u8]) -> Result<Option<Vec<u8>>, LocalError> {
            Ok(None)
        }

        fn scan(
            &self,
            _: &'static str,
            _: &[u8],
            _: Option<&[u8]>,
            _: usize,
        ) -> Result<Rows, LocalError> {
            Ok(Vec::new())
        }

        fn write(&self, _: Batch, _: Durability) -> Result<(), LocalError> {
            match self {
                Fake::FailedElsewhere => Err(LocalError::Poisoned(REASON.into())),
                Fake::GatedSync { .. } => Ok(()),
            }
        }

        fn sync(&self) -> Result<(), LocalError> {
            match self {
                Fake::FailedElsewhere => Err(LocalError::Poisoned(REASON.into())),
                Fake::GatedSync { began, release } => {
                    let _ = began.lock().unwrap().send(());
                    release
                        .lock()
                        .unwrap()
                        .recv()
                        .map_err(|_| LocalError::WriteFailed("gate dropped".into()))
                }
            }
        }

        fn size_bytes(&self) -> u64 {
            0
        }

        fn failure(&self) -> Option<String> {
            match self {
                Fake::FailedElsewhere => Some(REASON.into()),
                Fake::GatedSync { .. } => None,
            }
        }
    }

    #[test]
    fn given_an_engine_failed_by_another_user_then_the_committer_reports_it_before_writing() {
        let g = GroupCommit::new(Arc::new(Fake::FailedElsewhere), "test");
        assert_eq!(
            g.poisoned().as_deref(),
            Some(REASON),
            "health says so at once"
        );
        let mut b = Batch::new();
        b.put("a", "k", "v");
        // Refused, not unknown: the engine wrote nothing. And the reason is said once.
        let expected =
            format!("local engine is fail-stopped after an earlier write failure: {REASON}");
        for _ in 0..2 {
            let err = g.commit(b.clone()).unwrap_err();
            assert!(matches!(err, LocalError::Poisoned(_)), "{err:?}");
            assert_eq!(err.to_string(), expected);
        }
        assert_eq!(g.poisoned().as_deref(), Some(REASON));
    }

    fn submit_to(
        g: &Arc<GroupCommit>,
        wait: Wait,
        key: &str,
    ) -> mpsc::Receiver<Result<Option<u64>, LocalError>> {
        let (tx, rx) = mpsc::channel();
        let mut b = Batch::new();
        b.put("a", key, "v");
        g.submit(
            wait,
            move |_| Ok::<_, LocalError>((b, ())),
            move |r: Result<(Option<u64>, ()), LocalError>| {
                let _ = tx.send(r.map(|(t, ())| t));
            },
        );
        rx
    }

    /// The bound on an answer that must come without the fsync: generous, so only a
    /// store thread parked on the fsync (the behaviour this test rules out) misses it.
    const PROMPT: Duration = Duration::from_secs(10);

    #[test]
    fn given_an_fsync_in_progress_then_a_buffered_write_is_applied_and_answered_without_waiting_for_it(
    ) {
        let (began_tx, began) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        let g = Arc::new(GroupCommit::new(
            Arc::new(Fake::GatedSync {
                began: Mutex::new(began_tx),
                release: Mutex::new(release_rx),
            }),
            "test",
        ));
        let durable = submit_to(&g, Wait::Durable, "durable");
        began.recv_timeout(PROMPT).expect("the fsync began");
        let written = submit_to(&g, Wait::Written, "written")
            .recv_timeout(PROMPT)
            .expect("a buffered write is answered while the fsync runs");
        assert_eq!(written.unwrap(), Some(2), "applied after the first write");
        assert!(
            durable.try_recv().is_err(),
            "the durable write waits for its fsync"
        );
        // A durable write that arrives during the fsync needs one that begins after it.
        let later = submit_to(&g, Wait::Durable, "later");
        release.send(()).unwrap();
        assert_eq!(durable.recv_timeout(PROMPT).unwrap().unwrap(), Some(1));
        assert!(
            later.try_recv().is_err(),
            "not covered by the fsync that began before it was written"
        );
        began.recv_timeout(PROMPT).expect("a second fsync began");
        release.send(()).unwrap();
        assert_eq!(later.recv_timeout(PROMPT).unwrap().unwrap(), Some(3));
        assert_eq!(g.synced(), 3);
    }
}
