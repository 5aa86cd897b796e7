//! The SubscriptionStore's errors, in a module of their own: the store, the settings'
//! checks (`types`) and the push settings' checks (`push`) all answer with them.

use crate::cache::CorruptRecord;
use crate::failure::StoreFailure;
use crate::meta_util::FromMeta;

/// The SubscriptionStore's errors. Meta's classification stays visible.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubscriptionError {
    /// A value outside its documented range (HTTP 400). Nothing was written.
    #[error("invalid subscription: {field} {reason}")]
    Invalid { field: &'static str, reason: String },
    /// No such subscription (HTTP 404).
    #[error("subscription {name:?} not found")]
    NotFound { name: String },
    /// `If-Match` / `If-None-Match` did not hold (HTTP 412). Nothing was written.
    /// `current_revision` is the subscription's revision now (`None`: absent).
    #[error(
        "precondition failed for subscription {name:?} (current revision: {current_revision:?})"
    )]
    PreconditionFailed {
        name: String,
        current_revision: Option<i64>,
    },
    /// The subscription's topic does not exist or is being deleted (HTTP 404).
    /// Nothing was written.
    #[error("topic {topic:?} not found")]
    TopicNotFound { topic: String },
    /// An update tried to change the topic (HTTP 409). Nothing was written.
    #[error(
        "subscription {name:?} is on topic {current:?}; its topic cannot change to {requested:?}"
    )]
    TopicChange {
        name: String,
        current: String,
        requested: String,
    },
    /// The backend failed; [`StoreFailure`] says what the caller may assume.
    #[error("subscription store {0}")]
    Store(#[from] StoreFailure),
}

impl SubscriptionError {
    /// A short, stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Invalid { .. } => "invalid",
            Self::NotFound { .. } => "not_found",
            Self::PreconditionFailed { .. } => "precondition_failed",
            Self::TopicNotFound { .. } => "topic_not_found",
            Self::TopicChange { .. } => "topic_change",
            Self::Store(f) => f.kind(),
        }
    }

    /// Known not applied and retryable as is.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Store(f) if f.is_retryable())
    }
}

/// Maps a Meta error that is not a precondition failure.
impl FromMeta for SubscriptionError {}

impl From<CorruptRecord> for SubscriptionError {
    fn from(c: CorruptRecord) -> Self {
        Self::Store(StoreFailure::Corrupt {
            key: c.key,
            reason: c.reason,
        })
    }
}
