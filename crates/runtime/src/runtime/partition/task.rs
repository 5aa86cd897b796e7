//! What a partition task is made of: the requests it takes ([`Msg`]), the task itself
//! ([`PartitionTask`]) and the state it keeps per concern: the cluster side
//! ([`PartitionCluster`]), the effects of one request, the writes submitted without
//! waiting ([`SubmittedWrite`], [`PendingPulls`]) and the shell's side of parking
//! ([`ParkState`]). Its behaviour is in the sibling files, by concern.

use super::shared::Shared;
use crate::cluster::ownership::Directory;
use crate::metrics::{PartCounters, SubCounters};
use crate::runtime::attributes::AttributeCache;
use crate::runtime::deps::Deps;
use crate::runtime::error::RuntimeError;
use crate::runtime::types::{Answers, Handed, PullBudget};
use meshd_dispatch::{Command, PartitionCore, PullId, Reply, SessionBinding};
use meshd_meta::fence::Ownership;
use meshd_stores::attempts::{AttemptLedger, LedgerState};
use meshd_stores::offsets::OffsetKey;
use meshd_stores::park::{Parked, HELD};
use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};

/// Requests to a partition task.
pub enum Msg {
    Pull {
        budget: PullBudget,
        session: Option<SessionBinding>,
        reply: oneshot::Sender<Result<Vec<Handed>, RuntimeError>>,
    },
    /// Hand-outs that never reached a consumer (a forwarded answer that could not be
    /// delivered): due again at once, the attempt not counted. Answers how many were
    /// still in flight.
    Release {
        ids: Vec<String>,
        reply: oneshot::Sender<usize>,
    },
    Ack {
        ids: Vec<String>,
        reply: oneshot::Sender<Result<Answers, RuntimeError>>,
    },
    Nack {
        ids: Vec<String>,
        reason: String,
        /// Retry after this instead of the backoff.
        delay_ms: Option<u64>,
        reply: oneshot::Sender<Result<Answers, RuntimeError>>,
    },
    Extend {
        ids: Vec<String>,
        ack_timeout_ms: u64,
        reply: oneshot::Sender<Result<Answers, RuntimeError>>,
    },
    Redrive {
        entry_id: String,
        offset: u64,
        reply: oneshot::Sender<Result<(), RuntimeError>>,
    },
    /// Finish the current work and end the task (its state is in the stores). The
    /// answer: the offsets above the committed one resolved already (for a release's
    /// checkpoint).
    Stop { reply: oneshot::Sender<Vec<u64>> },
}

/// The effects of one request, collected while its commands run.
#[derive(Default)]
pub(super) struct Effects {
    pub(super) handouts: Vec<(PullId, meshd_dispatch::Delivery)>,
    pub(super) replies: Vec<Reply>,
    /// Offsets whose dead-letter entry (or failed-redrive write) became durable.
    pub(super) dead_lettered: HashSet<u64>,
}

/// One partition's task: it owns the core and is its only caller.
pub struct PartitionTask {
    pub core: PartitionCore,
    pub deps: Arc<Deps>,
    pub owner: Arc<RwLock<Option<Ownership>>>,
    pub counters: Arc<SubCounters>,
    /// This partition's share of `counters`.
    pub part_counters: Arc<PartCounters>,
    pub shared: Arc<Shared>,
    /// Bumped whenever this partition has something to hand out (wakes long polls).
    pub notify: watch::Sender<u64>,
    pub rx: mpsc::Receiver<Msg>,
    /// Commands recovery returned, run first.
    pub initial: Vec<Command>,
    pub next_pull: u64,
    pub stats_at: Option<Instant>,
    pub stats_dirty: bool,
    /// Cluster mode: the ownership this task runs under and its Meta state.
    pub cluster: Option<PartitionCluster>,
    /// Pulls whose attempt records were submitted and are not durable yet, in
    /// submission order (see the module doc of `partition`).
    pub pending: VecDeque<PendingPulls>,
    /// The last buffered delivery write submitted without waiting for it (an ack's
    /// resolve, a nack's update): answers that must not say "done" before the writes
    /// they stand for are applied wait for it (writes are applied in order).
    pub submitted: Option<Arc<SubmittedWrite>>,
    /// The attributes of events read, shared by the subscriptions of a topic.
    pub attributes: Arc<AttributeCache>,
    /// The shell's side of parking.
    pub park: ParkState,
}

/// The cluster side of one partition task.
pub struct PartitionCluster {
    pub owner: Ownership,
    pub ledger: Arc<dyn AttemptLedger>,
    /// What the ledger in Meta holds, and which record holds it.
    pub ledger_state: LedgerState,
    pub checkpoint_every: Duration,
    /// The committed offset of the last checkpoint.
    pub checkpointed: u64,
    /// The offsets resolved above it that the last checkpoint carried: a checkpoint
    /// is written when either changed, so an ack above a gap is in Meta within the
    /// checkpoint interval (a new owner skips it) even while the gap holds
    /// `committed`.
    pub checkpointed_resolved: Vec<u64>,
    /// Set when a write under this epoch was fenced: the task ends.
    pub lost: Arc<AtomicBool>,
    /// The members as the controller last saw them: retries are parked only while
    /// every member runs a release that knows the park journal
    /// ([`crate::membership::PARKING_RELEASE`]).
    pub directory: watch::Receiver<Arc<Directory>>,
}

impl PartitionCluster {
    /// Whether every member reads the park journal (an older member taking the
    /// partition over would not know what was parked: a parked retry would be lost).
    pub fn parking_allowed(&self) -> bool {
        self.directory.borrow().oldest_release >= crate::membership::PARKING_RELEASE
    }

    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    pub fn lose(&self, why: &str) {
        if !self.lost.swap(true, Ordering::AcqRel) {
            tracing::warn!(
                store = "owners",
                epoch = self.owner.epoch(),
                reason = why,
                "partition ownership lost; this partition stops here until it is acquired again"
            );
        }
    }
}

/// Whether a write submitted without waiting is applied yet, and what waits for it.
#[derive(Default)]
pub struct SubmittedWrite(std::sync::Mutex<SubmittedState>);

#[derive(Default)]
enum SubmittedState {
    #[default]
    Pending,
    Waiting(Vec<Box<dyn FnOnce() + Send>>),
    Done,
}

impl SubmittedWrite {
    /// The write is applied (or failed): runs what waited for it.
    pub(super) fn done(&self) {
        let state = std::mem::replace(
            &mut *self.0.lock().unwrap_or_else(PoisonError::into_inner),
            SubmittedState::Done,
        );
        if let SubmittedState::Waiting(then) = state {
            for f in then {
                f();
            }
        }
    }

    /// Runs `f` once the write is applied: now if it is.
    pub(super) fn then(&self, f: Box<dyn FnOnce() + Send>) {
        let mut state = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match &mut *state {
            SubmittedState::Done => {
                drop(state);
                f();
            }
            SubmittedState::Waiting(then) => then.push(f),
            SubmittedState::Pending => *state = SubmittedState::Waiting(vec![f]),
        }
    }
}

/// The shell's side of parking (http-api.md, "Parking"): the park index holds the
/// entries; this only knows when to look at it next.
#[derive(Default)]
pub struct ParkState {
    /// When to look for due entries next (unix ms); `None`: nothing parked is known.
    pub(super) look_at: Option<u64>,
    /// Whether the last look left due entries behind (no room, or not below the
    /// committed offset yet): a settled unparked event brings the next look forward.
    pub(super) stalled: bool,
    /// Bodies of the events just read that the core may park (`Command::Park` follows
    /// the read that found them; the next read drops what was not taken).
    pub(super) bodies: HashMap<u64, Vec<u8>>,
    /// Parks whose event body could not be read, or that the journal did not take:
    /// tried again later.
    pub(super) retry: Vec<Parked>,
    /// Ordered delivery: key releases the journal did not take, tried again later (a
    /// release lost here would hold its key until the next start).
    pub(super) release_retry: BTreeSet<u64>,
}

impl ParkState {
    /// At a partition's start: with entries in the index, look at once (some may be
    /// due already).
    pub fn at_start(parked: u64) -> Self {
        Self {
            look_at: (parked > 0).then_some(0),
            ..Default::default()
        }
    }

    /// Look no later than `at` (an entry held behind its key is not a time).
    pub(super) fn look_by(&mut self, at: u64) {
        if at == HELD {
            return;
        }
        self.look_at = Some(self.look_at.map_or(at, |t| t.min(at)));
    }
}

/// The durability of one submitted attempt write.
type AttemptWrite = oneshot::Receiver<Result<(), meshd_stores::delivery::DeliveryError>>;

/// Pulls answered once their attempt records are durable.
pub struct PendingPulls {
    pub(super) write: AttemptWrite,
    /// (offset, attempt) of every record in the write.
    pub(super) ids: Vec<(u64, u32)>,
    pub(super) replies: Vec<PullReply>,
    pub(super) started: Instant,
}

pub(super) type PullRequest = (
    PullBudget,
    Option<SessionBinding>,
    oneshot::Sender<Result<Vec<Handed>, RuntimeError>>,
);

pub(super) type AckRequest = (Vec<String>, oneshot::Sender<Result<Answers, RuntimeError>>);

pub(super) type PullReply = (PullId, oneshot::Sender<Result<Vec<Handed>, RuntimeError>>);

impl PartitionTask {
    pub(super) fn key(&self) -> &OffsetKey {
        &self.core.partition().key
    }
}
