//! The embedded Meta's settings.

use meshd_meta::MetaError;

/// Settings of the embedded Meta.
#[derive(Clone, Debug)]
pub struct EmbeddedConfig {
    /// How many revisions of change history are kept for watches.
    pub history_limit: i64,
    /// The largest request (keys plus values of one transaction), as etcd's default
    /// request cap, so code that works on embedded also works on etcd.
    pub max_request_bytes: usize,
    /// At most this many requests share one fsync.
    pub max_group: usize,
}

impl Default for EmbeddedConfig {
    fn default() -> Self {
        Self {
            history_limit: 10_000,
            max_request_bytes: 1536 * 1024,
            max_group: 256,
        }
    }
}

impl EmbeddedConfig {
    pub fn validate(&self) -> Result<(), MetaError> {
        if self.history_limit < 1 {
            return Err(MetaError::InvalidRequest(format!(
                "history_limit must be at least 1, got {}",
                self.history_limit
            )));
        }
        if self.max_group < 1 {
            return Err(MetaError::InvalidRequest(
                "max_group must be at least 1".into(),
            ));
        }
        Ok(())
    }
}
