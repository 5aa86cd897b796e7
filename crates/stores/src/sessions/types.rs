//! What a session is. The store and its owner key's record (`record`) both use it,
//! so it lives here, below both ([`Session::ownership`], which needs the record's
//! key, stays with the store).

use meshd_meta::LeaseId;
use std::time::Duration;

/// A live session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    /// 128 random bits, 32 lowercase hex digits.
    pub session_id: String,
    pub client_id: String,
    /// The owner key's `mod_revision` at open; a takeover always has a higher one.
    pub epoch: i64,
    /// The instance that opened it.
    pub instance: String,
    /// The effective TTL, as granted (etcd grants whole seconds).
    pub ttl: Duration,
    pub lease: LeaseId,
}

impl Session {
    pub fn ttl_ms(&self) -> u64 {
        u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX)
    }
}
