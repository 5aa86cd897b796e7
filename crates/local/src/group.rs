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

use crate::{Batch, Durability, KvEngine, LocalError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

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
        }
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
}

#[cfg(test)]
mod engine_failure_tests {
    use super::*;
    use crate::Rows;

    const REASON: &str = "fsync failed: a write of the embedded Meta";

    /// An engine another user of it (the embedded Meta) has fail-stopped.
    struct FailedElsewhere;

    impl KvEngine for FailedElsewhere {
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
            Err(LocalError::Poisoned(REASON.into()))
        }

        fn sync(&self) -> Result<(), LocalError> {
            Err(LocalError::Poisoned(REASON.into()))
        }

        fn size_bytes(&self) -> u64 {
            0
        }

        fn failure(&self) -> Option<String> {
            Some(REASON.into())
        }
    }

    #[test]
    fn given_an_engine_failed_by_another_user_then_the_committer_reports_it_before_writing() {
        let g = GroupCommit::new(Arc::new(FailedElsewhere), "test");
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
}
