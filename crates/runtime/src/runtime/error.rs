//! The runtime's errors: [`RuntimeError`] (what a request answers when it fails), the
//! helpers that build it from a store's failure, and the kind a log error is counted
//! under (`meshd_store_errors_total{kind}`).

use meshd_meta::Backend;
use meshd_stores::log::LogError;

#[derive(Clone, Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("subscription {0:?} does not exist")]
    NotFound(String),
    #[error("subscription {name:?} has no partition {partition}")]
    NoPartition { name: String, partition: u32 },
    /// A Local store fail-stopped (a write failed); the request was refused before
    /// anything of it was written, and the partition stopped until a restart.
    #[error("store failed (fail-stopped): {0}")]
    StoreFailed(String),
    /// A store write of this request failed after it was sent: it may or may not have
    /// been applied (a Local store has fail-stopped; a Meta write is re-read).
    #[error("{store} write outcome unknown: {detail}")]
    Indeterminate {
        store: &'static str,
        backend: Backend,
        detail: String,
    },
    /// A store could not be reached (Meta, the log, another instance); nothing was
    /// changed.
    #[error("{store} unavailable: {detail}")]
    Unavailable {
        store: &'static str,
        backend: Backend,
        detail: String,
    },
    /// The dispatch core refused the request (for example a redrive backlog is full).
    #[error("{0}")]
    Core(String),
    /// The request conflicts with the resource's state.
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Invalid(String),
    /// The partition task is restarting (a settings change); retry.
    #[error("subscription {0:?} is restarting; retry")]
    Restarting(String),
}

pub(super) fn unavailable(
    store: &'static str,
    backend: Backend,
) -> impl Fn(String) -> RuntimeError {
    move |detail| RuntimeError::Unavailable {
        store,
        backend,
        detail,
    }
}

/// A park index call that failed, as the request that made it answers: the Local
/// store fail-stopped; or the journal (on the log's `backend`) did not take the write
/// or fenced it (the partition moved): unavailable, to be retried.
pub(super) fn park_error(e: meshd_stores::park::ParkError, backend: Backend) -> RuntimeError {
    use meshd_stores::park::ParkError;
    match e {
        ParkError::Local(e) => RuntimeError::StoreFailed(format!("parks: {e}")),
        ParkError::Unavailable(detail) | ParkError::Fenced(detail) => {
            unavailable("parks", backend)(detail)
        }
    }
}

/// What another instance's refusal says: its status and the start of its answer.
pub(super) fn peer_refused(peer: &str, status: u16, body: &[u8]) -> String {
    format!(
        "instance {peer} answered {status}: {}",
        String::from_utf8_lossy(body)
            .chars()
            .take(300)
            .collect::<String>()
    )
}

/// The kind a log error is counted under (`meshd_store_errors_total{kind}`).
pub fn kind_of(e: &LogError) -> &'static str {
    match e {
        LogError::BelowRetention { .. } => "below_retention",
        LogError::UnknownPartition { .. } => "unknown_partition",
        LogError::Failed(_) => "failed",
        LogError::Indeterminate(_) => "indeterminate",
        LogError::Corrupt { .. } => "corrupt",
        LogError::Invalid(_) => "invalid",
        LogError::Unavailable(_) => "unavailable",
        LogError::DedupFull { .. } => "dedup_full",
    }
}
