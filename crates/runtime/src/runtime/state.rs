//! What the runtime holds: the [`Runtime`] itself, the subscriptions it runs
//! ([`SubRuntime`]) and their partition tasks ([`PartitionHandle`]). Its behaviour is
//! in `impl Runtime` blocks by concern: the lifecycle, routing and recovery in
//! `runtime/mod.rs`, cluster mode in `handover.rs` and `forwarding/`, streams in
//! `stream/`, statistics in `stats.rs`.

use super::attributes::AttributeCache;
use super::deps::Deps;
use super::forwarding::served::ForwardedPulls;
use super::partition::{Msg, Shared};
use super::stream::leases::Streams;
use meshd_meta::fence::Ownership;
use meshd_stores::subscriptions::Subscription;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Arc, PoisonError, RwLock};
use tokio::sync::{mpsc, watch};

/// One running partition task, as the runtime reaches it.
pub(super) struct PartitionHandle {
    pub(super) tx: mpsc::Sender<Msg>,
    pub(super) shared: Arc<Shared>,
    pub(super) join: tokio::task::JoinHandle<()>,
    /// The owner epoch it runs under (0 in standalone mode).
    pub(super) epoch: i64,
    /// Set by the task when a write under its epoch was fenced (cluster mode).
    pub(super) lost: Arc<AtomicBool>,
}

/// One partition's task when it runs here: always in standalone mode; in cluster mode
/// only while this instance owns the partition.
pub(super) type Slot = RwLock<Option<Arc<PartitionHandle>>>;

/// The running partitions of one subscription incarnation.
pub struct SubRuntime {
    pub sub: Subscription,
    pub(super) parts: Vec<Slot>,
    pub(super) notify: watch::Sender<u64>,
    pub(super) rr: AtomicUsize,
    /// The push worker of a push subscription.
    pub(super) push: Option<tokio::task::JoinHandle<()>>,
}

/// The delivery runtime of one instance (see the module doc of `runtime`).
pub struct Runtime {
    pub(super) deps: Arc<Deps>,
    pub(super) subs: RwLock<HashMap<String, Arc<SubRuntime>>>,
    /// Serialises starting, stopping and rebuilding subscriptions.
    pub(super) ops: tokio::sync::Mutex<()>,
    pub(super) recovered: AtomicBool,
    pub(super) owner: Arc<RwLock<Option<Ownership>>>,
    /// Itself, for the push workers it starts.
    pub(super) me: std::sync::Weak<Runtime>,
    /// Cluster mode: pulls served for other instances, by their forward id.
    pub(super) forwarded: ForwardedPulls,
    /// Set at a graceful stop: long polls answer at once with what they have.
    pub(super) stopping: watch::Sender<bool>,
    /// Open streams and the deliveries leased to them.
    pub streams: Streams,
    /// The attributes of events read by filtered subscriptions.
    pub(super) attributes: Arc<AttributeCache>,
}

impl SubRuntime {
    /// The task of partition `p` when it runs here.
    pub(super) fn part(&self, p: usize) -> Option<Arc<PartitionHandle>> {
        self.parts
            .get(p)?
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(super) fn running_parts(&self) -> Vec<Arc<PartitionHandle>> {
        (0..self.parts.len()).filter_map(|p| self.part(p)).collect()
    }
}
