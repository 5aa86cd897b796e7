//! The owner's memory of the pulls it served for other instances: by forward id, so
//! the instance that asked can have their hand-outs released when it did not get the
//! answer, and by delivery id, the instance each forwarded delivery went to (told
//! when it is settled here). Bounded in time and size; held by the runtime.

use std::sync::PoisonError;
use std::time::Duration;

/// How long a forwarded pull's hand-outs can be released by the instance that asked
/// (well past its [`super::PEER_TIMEOUT`]); after that their leases run out as usual.
const FORWARD_MEMORY: Duration = Duration::from_secs(60);
/// Forwarded pulls remembered at most (the oldest are forgotten first).
const FORWARD_MAX: usize = 10_000;

/// Pulls this owner served for other instances, by the forward id they named, so an
/// instance whose call failed (a timeout, a cut connection) can have their hand-outs
/// released: due again at once, the attempt not counted (http-api.md "Bounded
/// answers"). A release that arrives before the pull's answer is remembered, and the
/// pull's hand-outs are released as soon as it has them.
#[derive(Default)]
pub struct ForwardedPulls {
    inner: std::sync::Mutex<ForwardedInner>,
}

#[derive(Default)]
pub(super) struct ForwardedInner {
    pub(super) by_id: std::collections::HashMap<String, Forwarded>,
    order: std::collections::VecDeque<(tokio::time::Instant, String)>,
    /// Deliveries handed out through a forwarded pull, by delivery id: the instance
    /// that asked (it may hold them in a stream, whose credit an ack elsewhere must
    /// give back). Forgotten when settled, or after [`HOLDER_MEMORY`] /
    /// [`HOLDER_MAX`] (then a stream gets its credit back at the lease deadline).
    pub(super) holders: std::collections::HashMap<String, String>,
    holder_order: std::collections::VecDeque<(tokio::time::Instant, String)>,
}

/// How long the owner remembers which instance a forwarded delivery went to.
const HOLDER_MEMORY: Duration = Duration::from_secs(600);
/// Forwarded deliveries remembered at most (the oldest are forgotten first).
const HOLDER_MAX: usize = 100_000;

pub(super) enum Forwarded {
    Served { name: String, ids: Vec<String> },
    Released,
}

/// Forgets the oldest entries of `map` (in `order`, oldest first) until every one
/// left is younger than `memory` and at most `keep` are left.
fn forget_oldest<V>(
    order: &mut std::collections::VecDeque<(tokio::time::Instant, String)>,
    map: &mut std::collections::HashMap<String, V>,
    memory: Duration,
    keep: usize,
) {
    let now = tokio::time::Instant::now();
    while let Some((at, _)) = order.front() {
        if now.duration_since(*at) < memory && order.len() <= keep {
            break;
        }
        if let Some((_, id)) = order.pop_front() {
            map.remove(&id);
        }
    }
}

impl ForwardedInner {
    fn expire(&mut self) {
        forget_oldest(
            &mut self.order,
            &mut self.by_id,
            FORWARD_MEMORY,
            FORWARD_MAX,
        );
    }

    pub(super) fn remember_holder(&mut self, ids: &[String], holder: &str) {
        // Room for one more below the bound before these are added.
        forget_oldest(
            &mut self.holder_order,
            &mut self.holders,
            HOLDER_MEMORY,
            HOLDER_MAX - 1,
        );
        let now = tokio::time::Instant::now();
        for id in ids {
            self.holders.insert(id.clone(), holder.to_string());
            self.holder_order.push_back((now, id.clone()));
        }
    }

    pub(super) fn insert(&mut self, forward_id: &str, f: Forwarded) {
        self.expire();
        if self.by_id.insert(forward_id.to_string(), f).is_none() {
            self.order
                .push_back((tokio::time::Instant::now(), forward_id.to_string()));
        }
    }
}

impl ForwardedPulls {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, ForwardedInner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
