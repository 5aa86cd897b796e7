//! [`KvEngine`] on RocksDB.

use crate::engine::{Batch, BatchOp, Durability, KvEngine, LocalError, Rows};
use crate::no_sync::no_sync_for_tests;
use rocksdb::{
    ColumnFamilyDescriptor, FlushOptions, IteratorMode, Options, WriteBatch, WriteOptions, DB,
};
use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const LOCK_FILE: &str = "meshd.lock";
/// The WAL bound (see `RocksEngine::open`): what a crash recovery replays at most,
/// beyond the memtables.
const MAX_TOTAL_WAL_BYTES: u64 = 256 * 1024 * 1024;

/// How an open treats a write-ahead-log record that fails its checksum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WalRecovery {
    /// Refuse to open (only an incomplete last record, a write torn by a crash, is
    /// tolerated): never drop acknowledged writes in silence. The default.
    #[default]
    Strict,
    /// Open with everything up to the first damaged record and drop the rest: the
    /// operator's choice after a power loss left an unsynced tail damaged (RocksDB's
    /// default mode).
    PointInTime,
}

pub struct RocksEngine {
    db: DB,
    dir: PathBuf,
    column_families: Vec<&'static str>,
    /// Set after the first failed write; every later write is refused with it
    /// (fail-stop: what reached disk is unknown).
    poisoned: Mutex<Option<String>>,
    /// Held for the engine's lifetime: the OS releases it when the process dies.
    _lock: File,
    /// Entries in each column family's active memtable at the last
    /// [`flush_quiet`](RocksEngine::flush_quiet), in `column_families` order.
    last_entries: Mutex<Vec<u64>>,
    /// Last, so that it is dropped after the database and the lock: set once both are
    /// released ([`RocksEngine::closed`]).
    closed: SignalOnDrop,
}

/// Tells when an engine has been closed: its database shut down and its directory
/// unlocked, so that it can be opened again (by this process too). An engine closes
/// when the last reference to it goes.
#[derive(Clone, Debug, Default)]
pub struct Closed(std::sync::Arc<(Mutex<bool>, std::sync::Condvar)>);

impl Closed {
    /// Blocks until the engine has closed, at most `limit`; whether it has.
    pub fn wait(&self, limit: std::time::Duration) -> bool {
        let (done, changed) = &*self.0;
        let guard = done
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (guard, _) = changed
            .wait_timeout_while(guard, limit, |closed| !*closed)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *guard
    }

    /// Whether the engine has closed.
    pub fn is_closed(&self) -> bool {
        *self
            .0
             .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The engine's own copy of its [`Closed`]: sets it when dropped.
#[derive(Debug, Default)]
struct SignalOnDrop(Closed);

impl Drop for SignalOnDrop {
    fn drop(&mut self) {
        let (done, changed) = &*self.0 .0;
        *done
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = true;
        changed.notify_all();
    }
}

impl RocksEngine {
    /// Opens (creating if needed) the engine in `dir` with the given column families.
    /// Fails with [`LocalError::Locked`] when another process or another open in this
    /// process holds the directory.
    pub fn open(dir: &Path, column_families: &[&'static str]) -> Result<Self, LocalError> {
        Self::open_with(dir, column_families, WalRecovery::Strict)
    }

    /// [`open`](Self::open), choosing how a damaged write-ahead log is treated.
    pub fn open_with(
        dir: &Path,
        column_families: &[&'static str],
        wal_recovery: WalRecovery,
    ) -> Result<Self, LocalError> {
        std::fs::create_dir_all(dir).map_err(|e| LocalError::Open {
            dir: dir.to_path_buf(),
            reason: e.to_string(),
        })?;
        let lock = lock_dir(dir)?;
        let mut opts = Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        // Writes are synced explicitly by the callers that promise durability; the
        // manifest is fsynced by RocksDB itself.
        opts.set_use_fsync(false);
        // A WAL file stays until every column family that wrote to it has flushed; a
        // quiet one (offsets, meta) would keep the log's whole history in the WAL, and
        // an open after a crash replays all of it (13 s instead of 4 s with 10 M
        // events: meshd-bench recovery). Past this size RocksDB flushes the column
        // families that hold the oldest WAL, so the replay stays bounded. (64 MiB cost
        // a quarter of the batched publish throughput in extra flushes; 256 MiB none.)
        // Below this bound, `flush_quiet` on a timer keeps the quiet ones from
        // holding the WAL at all.
        opts.set_max_total_wal_size(MAX_TOTAL_WAL_BYTES);
        // A WAL record that fails its checksum stops the open with `Corruption`
        // (meshd refuses to start, naming it) instead of RocksDB's default
        // point-in-time recovery, which would stop replaying there and open without
        // every later write: acknowledged events lost in silence. Only an incomplete
        // record at the end of a log file (a write torn by a crash) is tolerated. A
        // power loss can also tear an unsynced (never acknowledged) tail in a way this
        // refuses: the operator then opens once with `WalRecovery::PointInTime`.
        opts.set_wal_recovery_mode(match wal_recovery {
            WalRecovery::Strict => rocksdb::DBRecoveryMode::TolerateCorruptedTailRecords,
            WalRecovery::PointInTime => rocksdb::DBRecoveryMode::PointInTime,
        });
        if wal_recovery == WalRecovery::PointInTime {
            tracing::warn!(store = "local", backend = "rocksdb", dir = %dir.display(), "opening with point-in-time WAL recovery: a damaged WAL record and every write after it are dropped");
        }
        // RocksDB's info `LOG` lives in the data dir, so a full disk fails its writes
        // too, and RocksDB before 8.1 asserts that a file writer is never used after
        // a failed write; Debian's librocksdb 7.8 keeps assertions on, so the next
        // log line after a failed `LOG` flush aborts the process (SIGABRT in
        // `WritableFileWriter::AssertFalseAndGetStatusForPrevError`, from
        // `EnvLogger::Logv`, within one write error: tests/disk_full.rs) instead of
        // letting the engine fail-stop. Upstream lifted that assertion for the info
        // log in facebook/rocksdb#11314 (8.1). Until meshd links such a RocksDB, it
        // writes only the header (options, at open) and fatal lines to `LOG`;
        // failures reach the operator through meshd's own logs and metrics.
        opts.set_log_level(rocksdb::LogLevel::Fatal);
        let cfs = column_families
            .iter()
            .map(|name| ColumnFamilyDescriptor::new(*name, Options::default()));
        let db = DB::open_cf_descriptors(&opts, dir, cfs).map_err(|e| {
            let reason = e.to_string();
            if e.kind() == rocksdb::ErrorKind::Corruption {
                LocalError::OpenCorrupt {
                    dir: dir.to_path_buf(),
                    reason,
                }
            } else if reason.contains("lock") {
                LocalError::Locked {
                    dir: dir.to_path_buf(),
                    reason,
                }
            } else {
                LocalError::Open {
                    dir: dir.to_path_buf(),
                    reason,
                }
            }
        })?;
        tracing::info!(store = "local", backend = "rocksdb", dir = %dir.display(), "opened local engine");
        Ok(Self {
            db,
            dir: dir.to_path_buf(),
            column_families: column_families.to_vec(),
            poisoned: Mutex::new(None),
            _lock: lock,
            last_entries: Mutex::new(vec![0; column_families.len()]),
            closed: SignalOnDrop::default(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A handle that tells when this engine has closed (the last reference dropped,
    /// the database shut down, the directory unlocked).
    pub fn closed(&self) -> Closed {
        self.closed.0.clone()
    }

    /// Writes every column family's memtable to SST files (and lets RocksDB drop
    /// the WAL files that only held them).
    pub fn flush_all(&self) -> Result<(), LocalError> {
        for name in &self.column_families {
            self.db
                .flush_cf(self.cf(name)?)
                .map_err(|e| LocalError::WriteFailed(format!("flush of {name} failed: {e}")))?;
        }
        Ok(())
    }

    /// Flushes the memtables of quiet column families: those written since the last
    /// call that hold less than `small_bytes`, and those not written since the last
    /// call at all. A WAL file stays until every column family with data in it has
    /// flushed, so one quiet column family (offsets, the embedded Meta, deliveries
    /// after a burst) would keep the whole history of a busy one in the WAL, and the
    /// first open after a crash replays all of it. Busy column families flush by size
    /// on their own, as before (flushing them early costs batched throughput). Called
    /// on a timer; the flushes run in RocksDB's background (not waited for). Returns
    /// the column families flushed.
    pub fn flush_quiet(&self, small_bytes: u64) -> Result<Vec<&'static str>, LocalError> {
        self.check_poisoned()?;
        let mut last = self
            .last_entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut flushed = Vec::new();
        for (i, name) in self.column_families.iter().enumerate() {
            let cf = self.cf(name)?;
            let int = |property: &str| {
                self.db
                    .property_int_value_cf(cf, property)
                    .map_err(|e| LocalError::ReadFailed(format!("{property} of {name}: {e}")))
            };
            let entries = int("rocksdb.num-entries-active-mem-table")?.unwrap_or(0);
            let bytes = int("rocksdb.cur-size-active-mem-table")?.unwrap_or(u64::MAX);
            let idle = entries == last[i];
            last[i] = entries;
            if entries == 0 || !(idle || bytes < small_bytes) {
                continue;
            }
            let mut options = FlushOptions::default();
            options.set_wait(false);
            self.db
                .flush_cf_opt(cf, &options)
                .map_err(|e| LocalError::WriteFailed(format!("flush of {name} failed: {e}")))?;
            // Flushed: its next memtable starts from nothing.
            last[i] = 0;
            flushed.push(*name);
        }
        Ok(flushed)
    }

    fn cf(&self, name: &str) -> Result<&rocksdb::ColumnFamily, LocalError> {
        self.db
            .cf_handle(name)
            .ok_or_else(|| LocalError::UnknownColumnFamily(name.to_string()))
    }

    fn check_poisoned(&self) -> Result<(), LocalError> {
        match self.poisoned.lock() {
            Ok(p) => match p.as_ref() {
                Some(reason) => Err(LocalError::Poisoned(reason.clone())),
                None => Ok(()),
            },
            Err(_) => Err(LocalError::Poisoned("poison lock".into())),
        }
    }

    /// A failed read. Damaged bytes (RocksDB's `Corruption`: a block or WAL checksum
    /// mismatch) fail-stop the engine: fail-stop rather than quarantine, because a
    /// damaged block may hold any record of any store on this engine (offsets,
    /// deliveries, the embedded Meta), and serving around it could hand out wrong
    /// state. The operator restores the data dir (or removes the damaged instance)
    /// and restarts.
    fn read_error(&self, cf: &'static str, key: &[u8], e: rocksdb::Error) -> LocalError {
        if e.kind() != rocksdb::ErrorKind::Corruption {
            return LocalError::ReadFailed(e.to_string());
        }
        let key = key.escape_ascii().to_string();
        let err = LocalError::Corrupt {
            cf,
            key: key.clone(),
            reason: e.to_string(),
        };
        self.poison(&err.to_string(), "corrupt data on disk");
        err
    }

    /// Fail-stops the engine (the first reason is kept), logging it once with its
    /// `cause`.
    fn poison(&self, reason: &str, cause: &str) {
        tracing::error!(store = "local", backend = "rocksdb", dir = %self.dir.display(), reason, "{cause}; engine fail-stopped");
        if let Ok(mut p) = self.poisoned.lock() {
            p.get_or_insert_with(|| reason.to_string());
        }
    }
}

fn lock_dir(dir: &Path) -> Result<File, LocalError> {
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| LocalError::Open {
            dir: dir.to_path_buf(),
            reason: format!("{}: {e}", path.display()),
        })?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::WouldBlock) => {
            return Err(LocalError::Locked {
                dir: dir.to_path_buf(),
                reason: format!("{} is held", path.display()),
            })
        }
        Err(TryLockError::Error(e)) => {
            return Err(LocalError::Open {
                dir: dir.to_path_buf(),
                reason: format!("locking {}: {e}", path.display()),
            })
        }
    }
    // Record who holds it, for the operator (best effort: the lock is what matters).
    let _ = file.set_len(0);
    let _ = writeln!(file, "pid {}", std::process::id());
    Ok(file)
}

/// Read-ahead of [`KvEngine::scan_each`] on RocksDB.
const SCAN_EACH_READAHEAD: usize = 2 << 20;

impl KvEngine for RocksEngine {
    fn get(&self, cf: &'static str, key: &[u8]) -> Result<Option<Vec<u8>>, LocalError> {
        let handle = self.cf(cf)?;
        self.db
            .get_cf(handle, key)
            .map_err(|e| self.read_error(cf, key, e))
    }

    fn scan(
        &self,
        cf: &'static str,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Rows, LocalError> {
        let handle = self.cf(cf)?;
        let iter = self.db.iterator_cf(
            handle,
            IteratorMode::From(start, rocksdb::Direction::Forward),
        );
        let mut out = Vec::new();
        for item in iter {
            let (k, v) = item.map_err(|e| self.read_error(cf, start, e))?;
            if let Some(end) = end {
                if k.as_ref() >= end {
                    break;
                }
            }
            out.push((k.to_vec(), v.to_vec()));
            if limit != 0 && out.len() >= limit {
                break;
            }
        }
        Ok(out)
    }

    fn scan_each(
        &self,
        cf: &'static str,
        start: &[u8],
        end: &[u8],
        f: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), LocalError> {
        let handle = self.cf(cf)?;
        // A long read from start to end: read ahead, and keep the blocks it passes
        // once out of the block cache (they would evict what the stores read often).
        let mut opts = rocksdb::ReadOptions::default();
        opts.fill_cache(false);
        opts.set_readahead_size(SCAN_EACH_READAHEAD);
        opts.set_iterate_upper_bound(end.to_vec());
        let mut iter = self.db.raw_iterator_cf_opt(handle, opts);
        iter.seek(start);
        while iter.valid() {
            let (Some(k), Some(v)) = (iter.key(), iter.value()) else {
                break;
            };
            if k >= end || !f(k, v) {
                return Ok(());
            }
            iter.next();
        }
        iter.status().map_err(|e| self.read_error(cf, start, e))
    }

    fn write(&self, batch: Batch, durability: Durability) -> Result<(), LocalError> {
        self.check_poisoned()?;
        let mut wb = WriteBatch::default();
        for op in &batch.ops {
            match op {
                BatchOp::Put { cf, key, value } => wb.put_cf(self.cf(cf)?, key, value),
                BatchOp::Delete { cf, key } => wb.delete_cf(self.cf(cf)?, key),
                BatchOp::DeleteRange { cf, from, to } => wb.delete_range_cf(self.cf(cf)?, from, to),
            }
        }
        let mut wo = WriteOptions::default();
        wo.set_sync(durability == Durability::Sync && !no_sync_for_tests());
        self.db.write_opt(wb, &wo).map_err(|e| {
            let reason = match durability {
                Durability::Sync => format!("synced write failed: {e}"),
                Durability::Buffered => format!("write failed: {e}"),
            };
            self.poison(&reason, "local write failed");
            LocalError::WriteFailed(reason)
        })
    }

    fn sync(&self) -> Result<(), LocalError> {
        self.check_poisoned()?;
        if no_sync_for_tests() {
            return Ok(());
        }
        self.db.flush_wal(true).map_err(|e| {
            let reason = format!("fsync failed: {e}");
            self.poison(&reason, "local write failed");
            LocalError::WriteFailed(reason)
        })
    }

    fn size_bytes(&self) -> u64 {
        dir_size(&self.dir)
    }

    fn fail_stop(&self, reason: &str) {
        self.poison(reason, "damaged record");
    }

    fn failure(&self) -> Option<String> {
        match self.poisoned.lock() {
            Ok(p) => p.clone(),
            Err(_) => Some("poison lock".into()),
        }
    }
}

fn dir_size(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(e: &RocksEngine, cf: &'static str, n: usize, size: usize) {
        let mut b = Batch::new();
        for i in 0..n {
            b.put(cf, format!("k{i}"), vec![7u8; size]);
        }
        e.write(b, Durability::Buffered).unwrap();
    }

    #[test]
    fn quiet_column_families_are_flushed_and_a_busy_one_only_once_it_goes_quiet() {
        let dir = tempfile::tempdir().unwrap();
        let e = RocksEngine::open(dir.path(), &["busy", "small", "empty"]).unwrap();
        put(&e, "busy", 2000, 1024);
        put(&e, "small", 3, 10);
        // Written since the last call: the small one is flushed, the big one is not.
        assert_eq!(e.flush_quiet(1 << 20).unwrap(), vec!["small"]);
        put(&e, "busy", 10, 1024);
        assert_eq!(e.flush_quiet(1 << 20).unwrap(), Vec::<&str>::new());
        // Not written since: quiet now, whatever its size.
        assert_eq!(e.flush_quiet(1 << 20).unwrap(), vec!["busy"]);
        assert_eq!(e.flush_quiet(1 << 20).unwrap(), Vec::<&str>::new());
        // What was flushed reads back, and survives a reopen.
        drop(e);
        let e = RocksEngine::open(dir.path(), &["busy", "small", "empty"]).unwrap();
        assert_eq!(e.get("small", b"k2").unwrap(), Some(vec![7u8; 10]));
        assert_eq!(e.get("busy", b"k1999").unwrap(), Some(vec![7u8; 1024]));
    }

    #[test]
    fn a_second_open_of_the_same_dir_is_refused_with_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let first = RocksEngine::open(dir.path(), &["a"]).unwrap();
        let err = RocksEngine::open(dir.path(), &["a"]).err().unwrap();
        assert!(matches!(err, LocalError::Locked { .. }), "{err}");
        assert!(err.to_string().contains("locked by another meshd process"));
        drop(first);
        RocksEngine::open(dir.path(), &["a"]).unwrap();
    }

    #[test]
    fn closed_tells_when_the_last_reference_is_gone_and_the_dir_can_be_opened_again() {
        let dir = tempfile::tempdir().unwrap();
        let engine = std::sync::Arc::new(RocksEngine::open(dir.path(), &["a"]).unwrap());
        let closed = engine.closed();
        let other = engine.clone();
        drop(engine);
        assert!(!closed.is_closed(), "a reference is left");
        assert!(!closed.wait(std::time::Duration::from_millis(10)));
        let dropper = std::thread::spawn(move || drop(other));
        assert!(closed.wait(std::time::Duration::from_secs(10)));
        dropper.join().unwrap();
        RocksEngine::open(dir.path(), &["a"]).expect("unlocked once closed");
    }

    #[test]
    fn batches_apply_atomically_and_scan_respects_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let e = RocksEngine::open(dir.path(), &["a"]).unwrap();
        let mut b = Batch::new();
        for k in ["k1", "k2", "k3", "l1"] {
            b.put("a", k, k.to_uppercase());
        }
        e.write(b, Durability::Sync).unwrap();
        let got = e.scan("a", b"k", Some(b"l"), 0).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(e.scan("a", b"k", None, 2).unwrap().len(), 2);
        let mut b = Batch::new();
        b.delete("a", "k2");
        e.write(b, Durability::Buffered).unwrap();
        assert_eq!(e.get("a", b"k2").unwrap(), None);
        assert_eq!(e.get("a", b"k1").unwrap(), Some(b"K1".to_vec()));
        assert!(matches!(
            e.get("nope", b"k1"),
            Err(LocalError::UnknownColumnFamily(_))
        ));
    }
}
