//! The runtime's clock: unix milliseconds, as the dispatch core, leases and
//! checkpoints count time.

use meshd_stores::time::Timestamp;

/// Now, in unix milliseconds (0 before 1970).
pub fn now_ms() -> u64 {
    u64::try_from(Timestamp::now().as_millis()).unwrap_or(0)
}
