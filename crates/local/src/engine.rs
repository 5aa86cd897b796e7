//! The engine contract ([`KvEngine`]) with its batches, durability and errors: what
//! the RocksDB engine, the group committer and the power-cut injector all build on.

use std::path::PathBuf;

/// Key-value pairs in key order, as `scan` returns them.
pub type Rows = Vec<(Vec<u8>, Vec<u8>)>;

/// Rows per read of the default [`KvEngine::scan_each`].
pub const SCAN_EACH_STEP: usize = 1024;

/// Whether a write must be on stable storage before `write` returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// fsync the write-ahead log (with every earlier write) before returning.
    Sync,
    /// Buffered: durable only after a later `Sync` write or [`KvEngine::sync`].
    Buffered,
}

/// One operation of an atomic batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchOp {
    Put {
        cf: &'static str,
        key: Vec<u8>,
        value: Vec<u8>,
    },
    Delete {
        cf: &'static str,
        key: Vec<u8>,
    },
    /// Every key `from <= key < to` (one range tombstone, however many keys).
    DeleteRange {
        cf: &'static str,
        from: Vec<u8>,
        to: Vec<u8>,
    },
}

/// Operations applied atomically: all or none, visible to readers all at once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub ops: Vec<BatchOp>,
}

impl Batch {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn put(&mut self, cf: &'static str, key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) {
        self.ops.push(BatchOp::Put {
            cf,
            key: key.into(),
            value: value.into(),
        });
    }

    pub fn delete(&mut self, cf: &'static str, key: impl Into<Vec<u8>>) {
        self.ops.push(BatchOp::Delete {
            cf,
            key: key.into(),
        });
    }

    /// Deletes every key from `from` (included) to `to` (excluded).
    pub fn delete_range(
        &mut self,
        cf: &'static str,
        from: impl Into<Vec<u8>>,
        to: impl Into<Vec<u8>>,
    ) {
        self.ops.push(BatchOp::DeleteRange {
            cf,
            from: from.into(),
            to: to.into(),
        });
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    pub fn len(&self) -> usize {
        self.ops.len()
    }
}

/// Errors of the Local engine.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// Another process (or another open in this process) holds the data dir.
    #[error("data dir {dir} is locked by another meshd process (or opened twice): {reason}")]
    Locked { dir: PathBuf, reason: String },
    /// A column family the caller asked for was not declared at open.
    #[error("unknown column family {0}")]
    UnknownColumnFamily(String),
    /// This call's write, or the fsync that was to make it durable, failed: the write
    /// may or may not be on disk (a `write()` reaches the page cache, and recovery
    /// replays whatever of the WAL is there), so its outcome is unknown. The engine has
    /// fail-stopped: it refuses every later write.
    #[error("local write outcome unknown (engine fail-stopped): {0}")]
    WriteFailed(String),
    /// Refused: the engine fail-stopped earlier. Nothing of this call was written.
    #[error("local engine is fail-stopped after an earlier write failure: {0}")]
    Poisoned(String),
    /// A read failed.
    #[error("local read failed: {0}")]
    ReadFailed(String),
    /// Stored bytes failed their checksum (RocksDB's block or WAL checksums): the
    /// data on disk was damaged. Nothing of it is returned, and the engine has
    /// fail-stopped (every later write is refused) so the instance stops serving
    /// from a store it can no longer trust.
    #[error("corrupt data in column family {cf} at key {key}: {reason}")]
    Corrupt {
        cf: &'static str,
        /// The key read (or the first key of the scan), printable.
        key: String,
        reason: String,
    },
    /// The data dir could not be opened.
    #[error("cannot open data dir {dir}: {reason}")]
    Open { dir: PathBuf, reason: String },
    /// The data dir could not be opened because what is on disk is damaged (RocksDB's
    /// `Corruption`: a WAL record or a file that fails its checksum). Nothing was
    /// dropped: the open refused.
    #[error("cannot open data dir {dir}, its data is damaged: {reason}")]
    OpenCorrupt { dir: PathBuf, reason: String },
}

impl LocalError {
    /// Whether the failed call may have written something: [`WriteFailed`]
    /// (outcome unknown) as opposed to a refusal or an error raised before anything
    /// was written (`false`: not applied).
    ///
    /// [`WriteFailed`]: LocalError::WriteFailed
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, LocalError::WriteFailed(_))
    }

    /// Why the engine failed, without this error's own prefix: what a fail-stop
    /// records once and every later refusal repeats, so a message never stacks
    /// "fail-stopped after ..." prefixes.
    pub fn reason(&self) -> String {
        match self {
            LocalError::WriteFailed(reason) | LocalError::Poisoned(reason) => reason.clone(),
            LocalError::Corrupt { .. } => self.to_string(),
            other => other.to_string(),
        }
    }
}

/// The engine the Local stores are written against.
///
/// # Contract
///
/// * `write` applies a batch atomically. With [`Durability::Sync`] it returns only after
///   the batch and every earlier write are on stable storage.
/// * A failed write or sync returns [`LocalError::WriteFailed`] (outcome unknown) and
///   fail-stops the engine: it returns [`LocalError::Poisoned`] (refused, nothing
///   written) for every later write or sync (reads still work).
/// * A read that finds damaged bytes returns [`LocalError::Corrupt`] and fail-stops
///   the engine the same way.
/// * Reads see every write that returned before they started.
/// * All methods may be called from any thread; they block (call them from a blocking
///   context, not directly on an async executor thread).
pub trait KvEngine: Send + Sync + 'static {
    fn get(&self, cf: &'static str, key: &[u8]) -> Result<Option<Vec<u8>>, LocalError>;

    /// Keys in `[start, end)` (`end == None`: to the end of the column family), in key
    /// order, at most `limit` of them (0 = no limit).
    fn scan(
        &self,
        cf: &'static str,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Rows, LocalError>;

    /// Calls `f` with every key and value in `[start, end)`, in key order, until it
    /// returns `false`: a range too large to hold at once (an open that reloads an
    /// index), without copying each row. The default reads [`SCAN_EACH_STEP`] rows
    /// per [`scan`](Self::scan), each chunk starting just after the last key of the
    /// one before (so a concurrent writer's keys may or may not be seen); RocksDB
    /// reads it through one iterator.
    fn scan_each(
        &self,
        cf: &'static str,
        start: &[u8],
        end: &[u8],
        f: &mut dyn FnMut(&[u8], &[u8]) -> bool,
    ) -> Result<(), LocalError> {
        let mut from = start.to_vec();
        loop {
            let rows = self.scan(cf, &from, Some(end), SCAN_EACH_STEP)?;
            let full = rows.len() == SCAN_EACH_STEP;
            for (k, v) in &rows {
                if !f(k, v) {
                    return Ok(());
                }
            }
            match rows.into_iter().last() {
                Some((mut last, _)) if full => {
                    // The smallest key after `last`.
                    last.push(0);
                    from = last;
                }
                _ => return Ok(()),
            }
        }
    }

    fn write(&self, batch: Batch, durability: Durability) -> Result<(), LocalError>;

    /// Makes every earlier write durable.
    fn sync(&self) -> Result<(), LocalError>;

    /// Approximate size on disk of the whole engine, in bytes.
    fn size_bytes(&self) -> u64;

    /// Why the engine fail-stopped (its first failed write or fsync, whoever made
    /// it: the Local stores and the embedded Meta share one engine), or `None` while
    /// it accepts writes.
    fn failure(&self) -> Option<String> {
        None
    }

    /// Fail-stops the engine because a store found damaged data in a record it read
    /// (its own checksum or framing failed): every later write is refused, as after
    /// a failed write. `reason` names the store and key.
    fn fail_stop(&self, reason: &str) {
        let _ = reason;
    }
}
