//! Typed Meta errors. The variant tells the caller what to do (see the trait docs).

use crate::kv::{KeyValue, LeaseId};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetaError {
    /// A precondition failed; nothing was applied. `current` is the key's current value
    /// (`None` when absent).
    #[error("precondition failed (current: {})", describe(current))]
    Conflict { current: Option<Box<KeyValue>> },
    /// A fence compare failed: the owner's epoch is stale. Nothing was applied.
    #[error("fenced: the owner key no longer has this epoch")]
    Fenced,
    /// The request was not applied (connection refused, no leader, backend closed).
    /// Safe to retry.
    #[error("meta unavailable: {0}")]
    Unavailable(String),
    /// The request was sent but its outcome is unknown (timeout, broken connection).
    /// Re-read before acting.
    #[error("meta outcome unknown: {0}")]
    Indeterminate(String),
    /// The lease has expired or was revoked.
    #[error("lease {0} not found")]
    LeaseNotFound(LeaseId),
    /// The request is malformed (duplicate key in a transaction, empty key, a start
    /// revision below 1, ...). Do not retry.
    #[error("invalid meta request: {0}")]
    InvalidRequest(String),
    /// A stored record failed its checksum or version check.
    #[error("corrupt meta record at {key}: {reason}")]
    Corrupt { key: String, reason: String },
    /// The backend has fail-stopped after a lost write; it refuses further writes.
    #[error("meta backend failed: {0}")]
    Failed(String),
}

fn describe(current: &Option<Box<KeyValue>>) -> String {
    match current {
        None => "absent".to_string(),
        Some(kv) => format!("mod_revision {}", kv.mod_revision),
    }
}

impl MetaError {
    /// A short, stable label for metrics (`meshd_meta_errors_total{kind=...}`).
    pub fn kind(&self) -> &'static str {
        match self {
            MetaError::Conflict { .. } => "conflict",
            MetaError::Fenced => "fenced",
            MetaError::Unavailable(_) => "unavailable",
            MetaError::Indeterminate(_) => "indeterminate",
            MetaError::LeaseNotFound(_) => "lease_not_found",
            MetaError::InvalidRequest(_) => "invalid_request",
            MetaError::Corrupt { .. } => "corrupt",
            MetaError::Failed(_) => "failed",
        }
    }

    /// Whether the request is known not to have been applied and may be retried as is.
    pub fn is_retryable(&self) -> bool {
        matches!(self, MetaError::Unavailable(_))
    }

    pub fn conflict(current: Option<KeyValue>) -> Self {
        MetaError::Conflict {
            current: current.map(Box::new),
        }
    }
}

/// Why a watch stream ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WatchError {
    /// The history at the start revision is gone; everything from `compact_revision`
    /// on is still available. Re-list, then watch from the list's revision + 1.
    #[error("watch start revision was compacted (history starts at {compact_revision})")]
    Compacted { compact_revision: i64 },
    /// The connection to the backend broke or the backend closed. Resume from the last
    /// revision seen + 1.
    #[error("watch interrupted: {0}")]
    Unavailable(String),
    /// A history record failed its checksum or version check.
    #[error("corrupt watch history: {0}")]
    Corrupt(String),
    /// The Meta handle was closed by its owner (the process is stopping): the stream
    /// ends and there is nothing to resume. Not a failure.
    #[error("watch ended: meta closed")]
    Closed,
}
