//! The leases of open streams: per stream, the deliveries handed to it and not
//! settled ([`Leases`], its credit), and every open stream's leases by delivery id
//! ([`Streams`], held by the runtime), so the answer of an ack, nack or extend, or an
//! owner's notice of a settlement elsewhere, finds the stream that holds the delivery.

use crate::runtime::types::{Answers, Outcome};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The deliveries leased to one stream and not settled, with their lease deadlines.
#[derive(Default)]
pub(super) struct Leases {
    pub(super) held: Mutex<HashMap<String, Instant>>,
    /// Woken when a held delivery is settled or credit is granted.
    pub(super) settled: Notify,
    /// Hand-outs the client still takes (the WebSocket's `credit` frames); `None`
    /// for a stream without credits (SSE): only `max_in_flight` bounds it.
    pub(super) granted: Mutex<Option<usize>>,
}

/// Grants a stream credit from another task (the WebSocket's reader).
#[derive(Clone)]
pub struct Credit(pub(super) Arc<Leases>);

impl Credit {
    /// The client takes `n` more deliveries.
    pub fn grant(&self, n: usize) {
        let mut g = self
            .0
            .granted
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let c = g.get_or_insert(0);
        *c = c.saturating_add(n);
        drop(g);
        self.0.settled.notify_one();
    }
}

impl Leases {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Every open stream's leases, by delivery id, so an ack answer finds its stream.
#[derive(Default)]
pub struct Streams {
    by_id: Mutex<HashMap<String, Weak<Leases>>>,
    pub(super) open: AtomicU64,
}

impl Streams {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Weak<Leases>>> {
        self.by_id.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An ack, nack or extend was answered: settled ids give their stream its credit
    /// back; extended ones get the new deadline `now + ack_timeout`.
    pub(crate) fn answered(&self, answers: &Answers, ack_timeout: Option<Duration>) {
        if self.open.load(Ordering::Relaxed) == 0 {
            return;
        }
        let now = Instant::now();
        let mut by_id = self.lock();
        for (outcome, id) in &answers.lists {
            match outcome {
                // Not recorded: still leased to the stream.
                Outcome::Failed => {}
                Outcome::Extended => {
                    let (Some(t), Some(leases)) = (ack_timeout, by_id.get(id)) else {
                        continue;
                    };
                    if let Some(l) = leases.upgrade() {
                        if let Some(at) = l.lock().get_mut(id) {
                            *at = now + t;
                        }
                    }
                }
                _ => settle(&mut by_id, id),
            }
        }
    }

    /// Deliveries an owner says were settled on another instance: their streams
    /// get the credit back. Ids no open stream holds are ignored.
    pub fn settled_elsewhere(&self, ids: &[String]) {
        if self.open.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut by_id = self.lock();
        for id in ids {
            settle(&mut by_id, id);
        }
    }

    /// Streams open now.
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Deliveries leased to open streams and not settled.
    pub fn leased(&self) -> usize {
        self.lock().len()
    }
}

/// Delivery `id` no longer counts against the stream holding it (if one does).
fn settle(by_id: &mut HashMap<String, Weak<Leases>>, id: &str) {
    let Some(leases) = by_id.remove(id).and_then(|w| w.upgrade()) else {
        return;
    };
    if leases.lock().remove(id).is_some() {
        leases.settled.notify_one();
    }
}
