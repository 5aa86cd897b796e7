//! What the API, the writer thread and the watchers share: the engine with its
//! lock, the revision, the leases and the fail-stop flag ([`Shared`]), and the reads
//! of the key and state records.

use crate::config::EmbeddedConfig;
use crate::records::{self, key_record::KeyRecord, state::StateRecord};
use meshd_local::{KvEngine, LocalError};
use meshd_meta::MetaError;
use std::collections::HashMap;
use std::sync::atomic::AtomicI64;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

pub(crate) struct LeaseEntry {
    pub ttl: Duration,
    pub deadline: Instant,
}

/// State shared by the API, the writer thread and the watchers.
pub(crate) struct Shared {
    /// The engine; `None` after close. Writers hold the write lock across a whole group
    /// (buffered writes + fsync) so readers never see non-durable data.
    pub engine: RwLock<Option<Arc<dyn KvEngine>>>,
    /// The revision of the last durable change; updated under the engine write lock.
    pub revision: AtomicI64,
    /// Live leases and their in-memory deadlines (monotonic).
    pub leases: Mutex<HashMap<i64, LeaseEntry>>,
    /// Set when the store fail-stopped; every call then answers `Failed`.
    pub failed: Mutex<Option<String>>,
    pub config: EmbeddedConfig,
}

impl Shared {
    pub fn check_failed(&self) -> Result<(), MetaError> {
        match self.failed.lock() {
            Ok(f) => match f.as_ref() {
                Some(reason) => Err(MetaError::Failed(reason.clone())),
                None => Ok(()),
            },
            Err(_) => Err(MetaError::Failed("failure flag poisoned".into())),
        }
    }

    pub fn fail(&self, reason: String) {
        if let Ok(mut f) = self.failed.lock() {
            if f.is_none() {
                tracing::error!(store = "meta", backend = "embedded", %reason, "embedded meta fail-stopped");
                *f = Some(reason);
            }
        }
    }

    /// Like [`check_failed`](Self::check_failed), and also fail-stops this store when
    /// the engine it shares has failed (another user's write failed first). Call it
    /// with the engine lock held.
    pub fn check_failed_with(&self, engine: &dyn KvEngine) -> Result<(), MetaError> {
        if let Some(reason) = engine.failure() {
            self.fail(format!("the shared local engine failed: {reason}"));
        }
        self.check_failed()
    }

    /// Runs `f` with the engine under the read lock.
    pub fn read<T>(
        &self,
        f: impl FnOnce(&dyn KvEngine) -> Result<T, MetaError>,
    ) -> Result<T, MetaError> {
        self.check_failed()?;
        let guard = self
            .engine
            .read()
            .map_err(|_| MetaError::Failed("engine lock poisoned".into()))?;
        match guard.as_ref() {
            Some(engine) => {
                self.check_failed_with(engine.as_ref())?;
                f(engine.as_ref())
            }
            None => Err(MetaError::Unavailable("embedded meta is closed".into())),
        }
    }

    pub fn lock_leases(&self) -> std::sync::MutexGuard<'_, HashMap<i64, LeaseEntry>> {
        // Every mutation of the map is a single insert or remove: still consistent
        // after a panic elsewhere.
        self.leases.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub(crate) fn read_error(e: LocalError) -> MetaError {
    MetaError::Unavailable(format!("local read failed: {e}"))
}

pub(crate) fn corrupt(key: &[u8], e: records::DecodeError) -> MetaError {
    MetaError::Corrupt {
        key: String::from_utf8_lossy(key).into_owned(),
        reason: e.to_string(),
    }
}

pub(crate) fn read_key(
    engine: &dyn KvEngine,
    user_key: &[u8],
) -> Result<Option<KeyRecord>, MetaError> {
    let k = records::key_key(user_key);
    match engine.get(records::CF, &k).map_err(read_error)? {
        None => Ok(None),
        Some(b) => KeyRecord::decode(&b)
            .map(Some)
            .map_err(|e| corrupt(user_key, e)),
    }
}

pub(crate) fn read_state(engine: &dyn KvEngine) -> Result<StateRecord, MetaError> {
    match engine
        .get(records::CF, records::STATE_KEY)
        .map_err(read_error)?
    {
        None => Ok(StateRecord::initial()),
        Some(b) => StateRecord::decode(&b).map_err(|e| corrupt(records::STATE_KEY, e)),
    }
}
