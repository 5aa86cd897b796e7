//! Group commit: many writers, one fsync.
//!
//! A writer applies its batch buffered (under a mutex, so the model of what is written
//! follows the WAL's order) and takes a ticket. The first writer that finds no fsync
//! running becomes the leader: it fsyncs everything written so far and wakes every
//! writer whose ticket that covered. The others wait. So a burst of N concurrent
//! commits costs about two fsyncs, and every commit returns only once durable.
//!
//! A failed write or fsync poisons the committer: every later call fails with the
//! first failure's reason (fail-stop: what reached disk is unknown).

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

    fn poison(&self, s: &mut State, reason: String) -> LocalError {
        tracing::error!(store = self.store, backend = "rocksdb", %reason, "local write failed; store fail-stopped");
        s.poisoned.get_or_insert(reason.clone());
        LocalError::Poisoned(reason)
    }

    /// Writes `batch` and returns once it is durable. Blocking.
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
    /// with the ticket to wait on (`None` when the batch was empty).
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
            return Err(self.poison(&mut s, e.to_string()).into());
        }
        s.written += 1;
        Ok((Some(s.written), out))
    }

    /// Makes everything written so far durable.
    pub fn sync_all(&self) -> Result<(), LocalError> {
        let ticket = self.lock().written;
        self.wait_durable(ticket)
    }

    pub fn wait_durable(&self, ticket: u64) -> Result<(), LocalError> {
        let mut s = self.lock();
        loop {
            if let Some(reason) = &s.poisoned {
                return Err(LocalError::Poisoned(reason.clone()));
            }
            if s.synced >= ticket {
                return Ok(());
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
                Err(e) => {
                    let _ = self.poison(&mut s, format!("fsync failed: {e}"));
                }
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

    #[test]
    fn a_failed_fsync_poisons_every_later_commit() {
        let dir = tempfile::tempdir().unwrap();
        let inner = RocksEngine::open(dir.path(), &["a"]).unwrap();
        let (engine, power) = PowerCutEngine::wrap(inner, &["a"]).unwrap();
        let g = GroupCommit::new(Arc::new(engine), "test");
        let mut b = Batch::new();
        b.put("a", "k", "v");
        g.commit(b.clone()).unwrap();
        power.fail_syncs(true);
        assert!(g.commit(b.clone()).is_err());
        power.fail_syncs(false);
        assert!(matches!(g.commit(b), Err(LocalError::Poisoned(_))));
        assert!(g.poisoned().is_some());
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
        assert!(g.commit(b).is_err());
        assert!(g.poisoned().is_some());
    }
}
