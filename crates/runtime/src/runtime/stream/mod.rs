//! Streaming consume (http-api.md "Streaming consume"): a stream is a loop of pulls
//! whose size is its credit, `max_in_flight` minus the deliveries leased to it and not
//! yet settled. Leases, attempts, sessions and the write-ahead rule are the pull's:
//! every hand-out of a stream is a pull hand-out.
//!
//! A delivery stops counting against its stream when an ack, nack or extend answer
//! names it (`acked`, `unknown`, `fenced`, any nack list; `extended` pushes its
//! deadline out), or when its lease deadline passes (it is due again for everyone).
//! The answers are seen where the ack arrives: on the stream's own instance (the
//! POST routes or the WebSocket's in-band frames) or on the owner it is forwarded to.
//! In a cluster, an ack that reaches the owner through another instance (or the owner
//! itself) is announced by the owner to the instance whose forwarded pull handed the
//! delivery out ([`Runtime::tell_holders`]), which settles it here
//! ([`Streams::settled_elsewhere`]); only when that notice fails does the stream get
//! its credit back at the lease deadline.
//!
//! Memory per stream is bounded by its credit: nothing is pulled while
//! `max_in_flight` deliveries are unsettled, and a reader that does not read holds
//! the stream at its next write (the transport's buffer), never a queue.

pub(super) mod leases;

use super::error::RuntimeError;
use super::state::Runtime;
use super::types::{Handed, PullBudget, Reach};
use leases::Leases;
pub use leases::{Credit, Streams};
use meshd_dispatch::SessionBinding;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;
use tokio::time::Instant;

/// At most this many deliveries per pull of a stream (the pull's own ceiling).
const PULL_MAX_EVENTS: usize = 1000;

/// What a stream yields.
#[derive(Debug)]
pub enum StreamItem {
    /// New hand-outs (at least one).
    Deliveries(Vec<Handed>),
    /// Nothing for `idle`: time for a keep-alive.
    Idle,
}

/// One open stream of a subscription. Dropping it leaves its leases to run out.
pub struct Stream {
    rt: Arc<Runtime>,
    name: String,
    max_in_flight: usize,
    max_bytes: usize,
    session: Option<SessionBinding>,
    leases: Arc<Leases>,
}

impl Runtime {
    /// Opens a stream of subscription `name` (which must exist) with at most
    /// `max_in_flight` unsettled deliveries, each pull bounded by `max_bytes`.
    pub async fn open_stream(
        self: &Arc<Self>,
        name: &str,
        max_in_flight: usize,
        max_bytes: usize,
        session: Option<SessionBinding>,
    ) -> Result<Stream, RuntimeError> {
        self.subscription(name).await?;
        self.streams.open.fetch_add(1, Ordering::Relaxed);
        Ok(Stream {
            rt: self.clone(),
            name: name.to_string(),
            max_in_flight: max_in_flight.max(1),
            max_bytes: max_bytes.max(1),
            session,
            leases: Arc::default(),
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.rt.streams.open.fetch_sub(1, Ordering::Relaxed);
        let held: Vec<String> = self.leases.lock().drain().map(|(id, _)| id).collect();
        let mut by_id = self.rt.streams.lock();
        for id in held {
            by_id.remove(&id);
        }
    }
}

impl Stream {
    /// From now on the stream hands out only what the client granted through the
    /// returned handle (none yet), besides the `max_in_flight` bound: a WebSocket,
    /// whose client sends `credit` frames.
    pub fn credit_handle(&self) -> Credit {
        *self
            .leases
            .granted
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(0);
        Credit(self.leases.clone())
    }

    /// Deliveries leased to this stream and not settled.
    pub fn unsettled(&self) -> usize {
        self.leases.lock().len()
    }

    /// Drops the deliveries whose lease ran out; returns the earliest deadline left.
    fn expire(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut held = self.leases.lock();
        let mut gone = Vec::new();
        held.retain(|id, at| {
            let keep = *at > now;
            if !keep {
                gone.push(id.clone());
            }
            keep
        });
        let next = held.values().min().copied();
        drop(held);
        if !gone.is_empty() {
            let mut by_id = self.rt.streams.lock();
            for id in gone {
                by_id.remove(&id);
            }
        }
        next
    }

    fn credit(&self) -> usize {
        let room = self.max_in_flight.saturating_sub(self.unsettled());
        let granted = *self
            .leases
            .granted
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        granted.map_or(room, |c| room.min(c))
    }

    /// The next hand-outs, waiting up to `idle` for some; `None` once meshd is
    /// stopping (the stream ends).
    pub async fn next(&mut self, idle: Duration) -> Result<Option<StreamItem>, RuntimeError> {
        let until = Instant::now() + idle;
        let mut stopping = self.rt.stopping.subscribe();
        loop {
            if *stopping.borrow_and_update() {
                return Ok(None);
            }
            let next_expiry = self.expire();
            let credit = self.credit();
            if credit == 0 {
                // Wait for credit: a settlement, a lease that runs out, or a grant
                // (the caller's select on its own input ends this future).
                let wake = next_expiry.map_or(until, |at| at.min(until));
                tokio::select! {
                    _ = self.leases.settled.notified() => {}
                    _ = tokio::time::sleep_until(wake) => {}
                    _ = stopping.changed() => {}
                }
                if Instant::now() >= until {
                    return Ok(Some(StreamItem::Idle));
                }
                continue;
            }
            let budget = PullBudget::new(credit.min(PULL_MAX_EVENTS), self.max_bytes);
            let wait = until.saturating_duration_since(Instant::now());
            let got = self
                .rt
                .pull(
                    &self.name,
                    budget,
                    wait,
                    self.session.clone(),
                    Reach::Cluster,
                )
                .await?;
            if got.is_empty() {
                if Instant::now() >= until || self.rt.is_stopping() {
                    return Ok(Some(StreamItem::Idle));
                }
                continue;
            }
            self.hold(&got);
            return Ok(Some(StreamItem::Deliveries(got)));
        }
    }

    /// Records `got` as leased to this stream until its lease deadline.
    fn hold(&mut self, got: &[Handed]) {
        let timeout = self
            .rt
            .running(&self.name)
            .map(|s| Duration::from_millis(s.sub.spec.ack_timeout_ms))
            .unwrap_or(Duration::from_secs(30));
        let at = Instant::now() + timeout;
        if let Some(c) = self
            .leases
            .granted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_mut()
        {
            *c = c.saturating_sub(got.len());
        }
        // The registry's lock before the stream's, as in `Streams::answered`.
        let mut by_id = self.rt.streams.lock();
        let mut held = self.leases.lock();
        for h in got {
            held.insert(h.delivery_id.clone(), at);
            by_id.insert(h.delivery_id.clone(), Arc::downgrade(&self.leases));
        }
    }
}
