//! A fault-injecting engine for tests: SIGKILL is not power loss.
//!
//! A killed process leaves its writes in the OS page cache, so a kill test cannot show
//! that a store fsyncs before it acknowledges. [`PowerCutEngine`] wraps a real engine
//! and keeps a model of what is on stable storage: a write becomes durable only when
//! it is written with [`Durability::Sync`] or a later sync covers it (a synced WAL
//! write persists every earlier write). [`PowerCut::cut`] stops the world and returns
//! the durable image, which a test restores into a fresh directory and reopens: every
//! write the store acknowledged before the cut must be there.

use crate::engine::{Batch, BatchOp, Durability, KvEngine, LocalError, Rows};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

type Image = BTreeMap<(&'static str, Vec<u8>), Vec<u8>>;

#[derive(Default)]
struct State {
    /// What a power cut now would leave on disk.
    durable: Image,
    /// Written but not yet covered by a sync, in write order.
    pending: Vec<Batch>,
    /// After the cut every write fails: the machine is off.
    cut: bool,
    /// Injected faults: every write / every fsync fails while set.
    fail_writes: bool,
    fail_syncs: bool,
}

pub struct PowerCutEngine<E> {
    inner: E,
    state: Arc<Mutex<State>>,
}

/// The switch of a [`PowerCutEngine`].
#[derive(Clone)]
pub struct PowerCut {
    state: Arc<Mutex<State>>,
}

/// What survived a power cut.
#[derive(Clone, Debug, Default)]
pub struct DurableImage {
    entries: Image,
}

impl State {
    /// A successful sync: every pending write is now durable, in write order.
    fn settle(&mut self) {
        for b in std::mem::take(&mut self.pending) {
            apply(&mut self.durable, &b);
        }
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock poisons it; the model is still consistent
    // (every mutation is a single step), so keep using it.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

fn apply(image: &mut Image, batch: &Batch) {
    for op in &batch.ops {
        match op {
            BatchOp::Put { cf, key, value } => {
                image.insert((*cf, key.clone()), value.clone());
            }
            BatchOp::Delete { cf, key } => {
                image.remove(&(*cf, key.clone()));
            }
            BatchOp::DeleteRange { cf, from, to } => {
                image.retain(|(c, k), _| !(c == cf && k >= from && k < to));
            }
        }
    }
}

impl<E: KvEngine> PowerCutEngine<E> {
    /// Wraps `inner`; its current contents (of `column_families`) count as durable.
    pub fn wrap(
        inner: E,
        column_families: &[&'static str],
    ) -> Result<(Self, PowerCut), LocalError> {
        let mut durable = Image::new();
        for cf in column_families {
            for (k, v) in inner.scan(cf, b"", None, 0)? {
                durable.insert((*cf, k), v);
            }
        }
        let state = Arc::new(Mutex::new(State {
            durable,
            ..State::default()
        }));
        Ok((
            Self {
                inner,
                state: state.clone(),
            },
            PowerCut { state },
        ))
    }
}

impl PowerCut {
    /// Cuts the power: every later write fails, and the returned image is exactly what
    /// was covered by a successful sync.
    pub fn cut(&self) -> DurableImage {
        let mut s = lock(&self.state);
        s.cut = true;
        DurableImage {
            entries: s.durable.clone(),
        }
    }

    /// While set, every write fails (a failing disk). Nothing reaches the inner engine.
    pub fn fail_writes(&self, on: bool) {
        lock(&self.state).fail_writes = on;
    }

    /// While set, every fsync fails (a synced write or `sync`); buffered writes still
    /// go through but stay non-durable.
    pub fn fail_syncs(&self, on: bool) {
        lock(&self.state).fail_syncs = on;
    }

    /// How many batches were written but are not durable yet.
    pub fn pending_batches(&self) -> usize {
        lock(&self.state).pending.len()
    }
}

impl DurableImage {
    /// Writes the image into `engine` (a fresh one), synced.
    pub fn restore_into(&self, engine: &dyn KvEngine) -> Result<(), LocalError> {
        let mut batch = Batch::new();
        for ((cf, k), v) in &self.entries {
            batch.put(cf, k.clone(), v.clone());
        }
        engine.write(batch, Durability::Sync)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl<E: KvEngine> KvEngine for PowerCutEngine<E> {
    fn get(&self, cf: &'static str, key: &[u8]) -> Result<Option<Vec<u8>>, LocalError> {
        self.inner.get(cf, key)
    }

    fn scan(
        &self,
        cf: &'static str,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Rows, LocalError> {
        self.inner.scan(cf, start, end, limit)
    }

    fn write(&self, batch: Batch, durability: Durability) -> Result<(), LocalError> {
        // The model lock is held across the inner write so the model's order is the
        // WAL's order.
        let mut s = lock(&self.state);
        if s.cut {
            return Err(LocalError::WriteFailed("power cut".into()));
        }
        if s.fail_writes {
            return Err(LocalError::WriteFailed("injected write failure".into()));
        }
        if s.fail_syncs && durability == Durability::Sync {
            // The write reached the WAL but its fsync failed: not durable.
            self.inner.write(batch.clone(), Durability::Buffered)?;
            s.pending.push(batch);
            return Err(LocalError::WriteFailed("injected fsync failure".into()));
        }
        self.inner.write(batch.clone(), durability)?;
        match durability {
            Durability::Sync => {
                s.pending.push(batch);
                s.settle();
            }
            Durability::Buffered => s.pending.push(batch),
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), LocalError> {
        let mut s = lock(&self.state);
        if s.cut {
            return Err(LocalError::WriteFailed("power cut".into()));
        }
        if s.fail_syncs {
            return Err(LocalError::WriteFailed("injected fsync failure".into()));
        }
        self.inner.sync()?;
        s.settle();
        Ok(())
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn failure(&self) -> Option<String> {
        self.inner.failure()
    }
}

/// Every strict prefix and every single-bit flip of `record` must fail to decode with
/// an error (never decode into some value). For codec tests of every Local record.
pub fn assert_damage_is_detected<T: std::fmt::Debug>(
    record: &[u8],
    decode: impl Fn(&[u8]) -> Result<T, crate::codec::DecodeError>,
) {
    for len in 0..record.len() {
        assert!(
            decode(&record[..len]).is_err(),
            "truncated to {len} decoded"
        );
    }
    for i in 0..record.len() {
        for bit in 0..8 {
            let mut damaged = record.to_vec();
            damaged[i] ^= 1 << bit;
            assert!(
                decode(&damaged).is_err(),
                "flip of bit {bit} in byte {i} decoded"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RocksEngine;

    #[test]
    fn only_synced_writes_survive_a_cut() {
        let dir = tempfile::tempdir().unwrap();
        let inner = RocksEngine::open(dir.path(), &["a"]).unwrap();
        let (e, power) = PowerCutEngine::wrap(inner, &["a"]).unwrap();
        let mut b = Batch::new();
        b.put("a", "buffered-then-synced", "1");
        e.write(b, Durability::Buffered).unwrap();
        let mut b = Batch::new();
        b.put("a", "synced", "2");
        e.write(b, Durability::Sync).unwrap();
        let mut b = Batch::new();
        b.put("a", "lost", "3");
        e.write(b, Durability::Buffered).unwrap();
        assert_eq!(power.pending_batches(), 1);
        let image = power.cut();
        assert!(e.write(Batch::new(), Durability::Sync).is_err());

        let dir2 = tempfile::tempdir().unwrap();
        let fresh = RocksEngine::open(dir2.path(), &["a"]).unwrap();
        image.restore_into(&fresh).unwrap();
        assert!(fresh.get("a", b"buffered-then-synced").unwrap().is_some());
        assert!(fresh.get("a", b"synced").unwrap().is_some());
        assert!(fresh.get("a", b"lost").unwrap().is_none());
    }
}
