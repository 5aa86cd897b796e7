//! The fencing model, one for everything that has an owner (a partition, a client
//! session, a task assignment).
//!
//! An owner holds a Meta key under its lease. Its **epoch** is that key's
//! `mod_revision` when it was acquired, issued by the store, never by a clock. Every
//! durable write made on behalf of the owner is one transaction that also compares the
//! owner key's `mod_revision` with the epoch, so a stale owner's write fails with
//! [`MetaError::Fenced`] and is never silently applied. A takeover rewrites the owner
//! key, which gives it a higher `mod_revision`: every write of the previous holder
//! fails from that revision on, wherever it is made.
//!
//! An owner must also stop acting on its own before the server can expire its lease:
//! [`LeaseDeadline`] measures that with a monotonic clock from the *send* time of the
//! last successful keep-alive, minus a safety margin. After `Fenced` or
//! `Indeterminate` the owner drops the resource and re-acquires before acting again.

use crate::error::MetaError;
use crate::types::{Compare, LeaseId, Precondition, Txn, TxnResponse};
use crate::Meta;
use std::time::{Duration, Instant};

/// Proof of ownership: the owner key and the epoch it was acquired at.
#[derive(Clone, Debug)]
pub struct Ownership {
    key: Vec<u8>,
    epoch: i64,
    lease: Option<LeaseId>,
    /// What the owner key holds (the instance id, for a partition), when this
    /// ownership was acquired here; empty when rebuilt from its parts. Written into
    /// records beside the epoch, for whoever reads the history; never compared.
    holder: Vec<u8>,
}

/// Two ownerships are the same when their key, epoch and lease are: the holder is
/// what the key held, known or not.
impl PartialEq for Ownership {
    fn eq(&self, other: &Self) -> bool {
        (&self.key, self.epoch, self.lease) == (&other.key, other.epoch, other.lease)
    }
}

impl Eq for Ownership {}

impl Ownership {
    /// Acquires `key` if nobody holds it. `Conflict { current }` names the holder.
    pub async fn acquire(
        meta: &dyn Meta,
        key: &[u8],
        holder: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<Self, MetaError> {
        let r = meta.put(key, holder, Precondition::Absent, lease).await?;
        Ok(Self {
            key: key.to_vec(),
            epoch: r.revision,
            lease,
            holder: holder.to_vec(),
        })
    }

    /// Takes `key` over whoever holds it: the write gives the key a new, higher
    /// `mod_revision`, which fences every earlier holder.
    pub async fn take_over(
        meta: &dyn Meta,
        key: &[u8],
        holder: &[u8],
        lease: Option<LeaseId>,
    ) -> Result<Self, MetaError> {
        let r = meta.put(key, holder, Precondition::None, lease).await?;
        Ok(Self {
            key: key.to_vec(),
            epoch: r.revision,
            lease,
            holder: holder.to_vec(),
        })
    }

    /// Rebuilds a known ownership (for example one recorded with a delivery), to
    /// make fenced writes with it.
    pub fn from_parts(key: Vec<u8>, epoch: i64, lease: Option<LeaseId>) -> Self {
        Self {
            key,
            epoch,
            lease,
            holder: Vec::new(),
        }
    }

    /// What the owner key held when this ownership was acquired, as text (an
    /// instance id); `None` when rebuilt from its parts or not UTF-8.
    pub fn holder_text(&self) -> Option<&str> {
        std::str::from_utf8(&self.holder)
            .ok()
            .filter(|h| !h.is_empty())
    }

    pub fn key(&self) -> &[u8] {
        &self.key
    }

    pub fn epoch(&self) -> i64 {
        self.epoch
    }

    pub fn lease(&self) -> Option<LeaseId> {
        self.lease
    }

    /// Adds the fence compare to `txn` (none in a debug build under
    /// [`unfenced_for_tests`]).
    pub fn fence(&self, txn: Txn) -> Txn {
        if unfenced_for_tests() {
            return txn;
        }
        txn.fence(Compare::ModRevision {
            key: self.key.clone(),
            revision: self.epoch,
        })
    }

    /// Commits `txn` as this owner: applied only while the owner key still has this
    /// epoch, otherwise `Fenced`.
    pub async fn commit(&self, meta: &dyn Meta, txn: Txn) -> Result<TxnResponse, MetaError> {
        meta.txn(self.fence(txn)).await
    }

    /// Checks that this ownership is still current, without writing anything.
    pub async fn check(&self, meta: &dyn Meta) -> Result<(), MetaError> {
        self.commit(meta, Txn::new()).await.map(|_| ())
    }

    /// Gives the key up, only if it still carries this epoch (`Fenced` otherwise).
    pub async fn release(&self, meta: &dyn Meta) -> Result<(), MetaError> {
        self.commit(meta, Txn::new().delete(&self.key))
            .await
            .map(|_| ())
    }
}

/// The positive control of the fencing tests: in a **debug build** (tests build meshd
/// so) with `MESHD_TEST_UNFENCED=1` in its environment, [`Ownership::fence`] adds no
/// compare, so a stale owner's writes are applied as a design without fencing would
/// apply them. The cluster crash loop runs a short loop under it and expects its
/// oracle to name the stale writes; without that, a green loop could not tell a
/// working fence from none. A release build (`cfg(not(debug_assertions))`) has no
/// such switch: the function is a constant `false` there and the variable is never
/// read. `meshd serve` logs an error at start while it is on.
#[cfg(debug_assertions)]
pub fn unfenced_for_tests() -> bool {
    static UNFENCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNFENCED.get_or_init(|| std::env::var_os(UNFENCED_VAR).is_some_and(|v| v == "1"))
}

/// Always `false` in a release build: fencing cannot be switched off.
#[cfg(not(debug_assertions))]
pub const fn unfenced_for_tests() -> bool {
    false
}

/// The environment variable of [`unfenced_for_tests`] (read by debug builds only).
pub const UNFENCED_VAR: &str = "MESHD_TEST_UNFENCED";

/// When an owner must stop acting: the lease's TTL, counted from the moment the last
/// successful keep-alive (or the grant) was *sent*, minus a safety margin for clock
/// drift between this process and the server. Monotonic: wall-clock jumps do not
/// extend it.
#[derive(Clone, Copy, Debug)]
pub struct LeaseDeadline {
    ttl: Duration,
    margin: Duration,
    deadline: Instant,
}

impl LeaseDeadline {
    /// `sent_at` is when the grant request was sent.
    pub fn new(ttl: Duration, margin: Duration, sent_at: Instant) -> Self {
        Self {
            ttl,
            margin,
            deadline: sent_at + ttl.saturating_sub(margin),
        }
    }

    /// A default margin: a third of the TTL, at least 500 ms, never all of it.
    pub fn default_margin(ttl: Duration) -> Duration {
        (ttl / 3).max(Duration::from_millis(500)).min(ttl / 2)
    }

    /// Records a successful keep-alive that was sent at `sent_at` and granted `ttl`.
    pub fn renewed(&mut self, sent_at: Instant, ttl: Duration) {
        self.ttl = ttl;
        let candidate = sent_at + ttl.saturating_sub(self.margin);
        if candidate > self.deadline {
            self.deadline = candidate;
        }
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the owner may still act at `now`.
    pub fn is_live(&self, now: Instant) -> bool {
        now < self.deadline
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_is_measured_from_the_send_time_minus_margin() {
        let t0 = Instant::now();
        let mut d = LeaseDeadline::new(Duration::from_secs(3), Duration::from_secs(1), t0);
        assert!(d.is_live(t0 + Duration::from_millis(1999)));
        assert!(!d.is_live(t0 + Duration::from_secs(2)));
        d.renewed(t0 + Duration::from_secs(1), Duration::from_secs(3));
        assert!(d.is_live(t0 + Duration::from_millis(2999)));
        assert!(!d.is_live(t0 + Duration::from_secs(3)));
    }

    #[test]
    fn an_older_keep_alive_never_shortens_or_extends_wrongly() {
        let t0 = Instant::now();
        let mut d = LeaseDeadline::new(Duration::from_secs(3), Duration::from_secs(1), t0);
        d.renewed(t0 + Duration::from_secs(2), Duration::from_secs(3));
        let after = d.deadline();
        // A keep-alive answer that arrives late for an earlier send must not move the
        // deadline back.
        d.renewed(t0 + Duration::from_secs(1), Duration::from_secs(3));
        assert_eq!(d.deadline(), after);
    }

    #[test]
    fn default_margin_is_bounded() {
        assert_eq!(
            LeaseDeadline::default_margin(Duration::from_secs(10)),
            Duration::from_nanos(3_333_333_333)
        );
        assert_eq!(
            LeaseDeadline::default_margin(Duration::from_millis(800)),
            Duration::from_millis(400)
        );
    }
}
