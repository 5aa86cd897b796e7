//! # How a store's backend failed, once for every store
//!
//! Every store on Meta reports its backend's failures as one [`StoreFailure`] (inside
//! its own error type's `Store` variant), so that what a caller may assume about a
//! write is decided in one place: [`StoreFailure::Unavailable`] was not applied and
//! can be retried as is; [`StoreFailure::Indeterminate`] may or may not have been
//! applied; [`StoreFailure::FailStopped`] was not applied and nothing will be until a
//! restart; [`StoreFailure::Corrupt`] and [`StoreFailure::Failed`] cannot be trusted
//! and are reported, never guessed at. The store-specific answers (not found, fenced,
//! conflicts, invalid requests) stay variants of each store's error.

use meshd_meta::MetaError;

/// A backend failure, with what the caller may assume about the request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StoreFailure {
    /// The backend could not be reached; nothing was applied. Retry the same call
    /// later (HTTP 503).
    #[error("unavailable, not applied: {0}")]
    Unavailable(String),
    /// The request was sent but its outcome is unknown: it may or may not have been
    /// applied (HTTP 504). Re-read before acting; an owner drops what it owns.
    #[error("outcome unknown (it may or may not have been applied): {0}")]
    Indeterminate(String),
    /// A stored record failed to decode; it is reported, never decoded into a
    /// default (HTTP 500).
    #[error("corrupt record at {key}: {reason}")]
    Corrupt { key: String, reason: String },
    /// The backend has fail-stopped (the embedded Meta after a failed disk write of
    /// its own or of the Local engine it shares) and refuses every request until
    /// meshd is restarted. Nothing was applied (HTTP 503, with a slow `Retry-After`).
    #[error("fail-stopped, not applied: {0}")]
    FailStopped(String),
    /// The backend answered something this store never asks for (a bug) (HTTP 500).
    #[error("failed: {0}")]
    Failed(String),
}

impl StoreFailure {
    /// A short, stable label for metrics (`kind="…"`). A fail-stop is `failed`, as
    /// Meta's own fail-stop and the Local stores' are.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreFailure::Unavailable(_) => "unavailable",
            StoreFailure::Indeterminate(_) => "indeterminate",
            StoreFailure::Corrupt { .. } => "corrupt",
            StoreFailure::FailStopped(_) | StoreFailure::Failed(_) => "failed",
        }
    }

    /// Known not applied and safe to retry as is.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreFailure::Unavailable(_))
    }

    /// Meta's failure classes; `Err` gives back the errors that are a store's own
    /// answer (a failed compare, a fence, a lease that is gone, an invalid request).
    pub fn from_meta(e: MetaError) -> Result<Self, MetaError> {
        match e {
            MetaError::Unavailable(m) => Ok(StoreFailure::Unavailable(m)),
            MetaError::Indeterminate(m) => Ok(StoreFailure::Indeterminate(m)),
            MetaError::Corrupt { key, reason } => Ok(StoreFailure::Corrupt { key, reason }),
            MetaError::Failed(m) => Ok(StoreFailure::FailStopped(m)),
            other => Err(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_failures_keep_their_class_and_the_rest_is_given_back() {
        assert_eq!(
            StoreFailure::from_meta(MetaError::Unavailable("x".into())),
            Ok(StoreFailure::Unavailable("x".into()))
        );
        assert_eq!(
            StoreFailure::from_meta(MetaError::Indeterminate("x".into())),
            Ok(StoreFailure::Indeterminate("x".into()))
        );
        assert_eq!(
            StoreFailure::from_meta(MetaError::Failed("disk".into())),
            Ok(StoreFailure::FailStopped("disk".into()))
        );
        assert!(matches!(
            StoreFailure::from_meta(MetaError::Fenced),
            Err(MetaError::Fenced)
        ));
        assert!(StoreFailure::Unavailable("x".into()).is_retryable());
        for f in [
            StoreFailure::Indeterminate("x".into()),
            StoreFailure::FailStopped("x".into()),
            StoreFailure::Failed("x".into()),
        ] {
            assert!(!f.is_retryable(), "{f}");
        }
        assert_eq!(StoreFailure::FailStopped("x".into()).kind(), "failed");
    }
}
