//! The delivery state machine of one (subscription incarnation, topic, partition).

use crate::config::{backoff_delay, Config};
use crate::error::CoreError;
use crate::id::DeliveryId;
use crate::io::{
    AckOutcome, Command, DeadLetterRequest, Delivery, DeliveryRef, EventMeta, ExtendOutcome, Input,
    NackOutcome, PullId, Reply, SessionCheck,
};
use crate::sources::{IdFields, Sources};
use meshd_stores::deadletters::entry_id;
use meshd_stores::delivery::{DeliveryRecord, DeliveryState, OffsetAdvance, SessionBinding};
use meshd_stores::offsets::OffsetKey;
use meshd_stores::park::HELD;
use meshd_stores::subscriptions::ACK_TIMEOUT_MS_RANGE;
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The reason recorded when a lease runs out.
pub const ACK_TIMEOUT_REASON: &str = "ack timeout";
/// The reason of a dead-letter that has no recorded failure (a recovered delivery
/// whose attempts already reach a lowered `max_attempts`).
pub const MAX_ATTEMPTS_REASON: &str = "max_attempts reached";

/// Whom a partition core delivers for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// (subscription, incarnation, topic, partition).
    pub key: OffsetKey,
    /// The log the events are read from (instance id for an embedded log, the stream
    /// name for a shared one): part of every dead-letter entry id of this partition.
    pub log_id: String,
    /// The partition owner's epoch, written into every record (0 standalone).
    pub owner_epoch: i64,
    /// The committed offset's reset epoch (`Committed::epoch`): part of every
    /// delivery id's MAC, so an id of one reset is no id of the next.
    pub reset_epoch: u64,
}

impl Partition {
    /// The dead-letter entry id of `offset` in this partition.
    pub fn dead_letter_id(&self, offset: u64) -> String {
        entry_id(
            &self.log_id,
            self.key.incarnation,
            &self.key.topic,
            self.key.partition,
            offset,
        )
    }
}

/// Counters for metrics and readiness.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// The lowest unresolved offset.
    pub committed: u64,
    /// The next offset the core will read.
    pub next_to_read: u64,
    /// The log's end as far as the core knows.
    pub log_end: u64,
    /// `max(log_end, next_to_read) - committed`: events not resolved yet.
    pub backlog: u64,
    /// Read and matching, never handed out (or handed out only in a failed persist).
    pub pending: usize,
    /// Attempt record being written (not handed out yet).
    pub persisting: usize,
    /// Handed out, lease running.
    pub in_flight: usize,
    /// Failed, waiting for the retry time (or due and waiting for a pull).
    pub waiting: usize,
    /// Acked (or dead-lettered) above a gap, record kept until the gap closes.
    pub acked_awaiting: usize,
    /// Failed `max_attempts` times; the dead-letter (or redrive-failed) write is not
    /// durable yet.
    pub dead_lettering: usize,
    /// Redrives under way (any state), unparked events included.
    pub redrives: usize,
    /// Events whose park entry is being written ([`Command::Park`] outstanding).
    pub parking: usize,
    /// What `max_in_flight` bounds: persisting + in flight + waiting + dead-lettering
    /// + redrive acks being recorded.
    pub outstanding: usize,
}

/// Where a delivery lives. Redrives sort first, so a pull serves them before the
/// window (they are older than anything in it). Window offsets are `>= committed`,
/// redriven ones `< committed`, so one offset never has both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Loc {
    Redrive(u64),
    Window(u64),
}

impl Loc {
    fn offset(self) -> u64 {
        match self {
            Loc::Redrive(o) | Loc::Window(o) => o,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Status {
    /// Ready and never handed out.
    Pending,
    /// `PersistAttempt` emitted for `entry.attempt`; waiting for `AttemptPersisted`.
    Persisting {
        pull_id: PullId,
        deadline: u64,
        prev_id: Option<String>,
        prev_session: Option<SessionBinding>,
    },
    /// Handed out; the lease ends at `deadline`. `recovered`: known only from a record
    /// after a crash, so when its lease ends it is due at once (no further backoff).
    InFlight { deadline: u64, recovered: bool },
    /// Failed; handed out again from `due` on.
    WaitingRetry { due: u64 },
    /// Failed `max_attempts` times. Window: `DeadLetter`; redrive: `RedriveFailed`.
    /// `outstanding`: the write is with the shell; otherwise retried at `retry_at`.
    DeadLettering {
        outstanding: bool,
        retry_at: u64,
        failures: u32,
    },
    /// A redrive was acked; `RedriveSucceeded` is being written (same retry scheme).
    Settling {
        outstanding: bool,
        retry_at: u64,
        failures: u32,
    },
    /// Window only: acked, dead-lettered, filtered or parked above a gap. `recorded`:
    /// its record says `AckedAwaitingCommit` (or it has no record).
    Resolved { recorded: bool },
    /// Window only: not to be handed out before its `deliverat` (or, `retry`, a retry
    /// due far ahead); the `Park` write is with the shell. An event read with a later
    /// `deliverat` is bounded by the window (`max_window`), not by `max_in_flight`:
    /// nothing was handed out. A parked retry keeps its `max_in_flight` slot until its
    /// entry is durable: its record still says in flight, and a crash before then
    /// brings it back as such.
    Parking { retry: bool },
}

impl Status {
    /// Counted against `max_in_flight`.
    fn outstanding(&self) -> bool {
        matches!(
            self,
            Status::Persisting { .. }
                | Status::InFlight { .. }
                | Status::WaitingRetry { .. }
                | Status::DeadLettering { .. }
                | Status::Settling { .. }
                | Status::Parking { retry: true }
        )
    }
}

/// What one pull may take (see [`Input::Pull`]).
#[derive(Clone, Copy, Debug)]
struct Budget {
    events: usize,
    bytes: u64,
    at_least_one: bool,
}

#[derive(Clone, Debug)]
struct Entry {
    /// Attempts made so far (persisted); the next hand-out is `attempt + 1`.
    attempt: u32,
    /// The current attempt's id (the one an ack must name).
    delivery_id: Option<String>,
    session: Option<SessionBinding>,
    first_at: Option<u64>,
    last_reason: Option<String>,
    /// A record may exist in the store (so a `Resolve` must remove it).
    has_record: bool,
    /// For a redrive: its dead-letter entry id.
    redrive_of: Option<String>,
    /// A redrive of a parked event ([`Input::Unpark`]): settled in the park index.
    parked: bool,
    /// The event's stored size, once the log was read there.
    size: Option<u64>,
    /// Ordered delivery: its key hash, once the log was read there (window only).
    key: Option<u64>,
    /// An unparked event retried far ahead: parked again until this time (its
    /// `Settling` write is [`Command::Repark`]).
    repark_due: Option<u64>,
    status: Status,
}

impl Entry {
    fn fresh(redrive_of: Option<String>, size: Option<u64>, status: Status) -> Self {
        Self {
            attempt: 0,
            delivery_id: None,
            session: None,
            first_at: None,
            last_reason: None,
            has_record: false,
            redrive_of,
            parked: false,
            size,
            key: None,
            repark_due: None,
            status,
        }
    }
}

/// Secondary indexes over `entries`, kept apart so they can be updated while an entry
/// is borrowed. Only [`PartitionCore::set_status`], `insert_entry` and
/// `remove_entry` touch them, so they always mirror the statuses.
#[derive(Default)]
struct Index {
    /// Ready, never handed out: pulled in `Loc` order.
    pending: BTreeSet<Loc>,
    /// Timers that act when they pass: lease ends, dead-letter and redrive retries.
    deadlines: BTreeSet<(u64, Loc)>,
    /// Retry due times: due ones are ready for a pull; future ones are wake-ups.
    retries: BTreeSet<(u64, Loc)>,
    /// Entries whose status counts against `max_in_flight`.
    outstanding: usize,
    /// Ordered delivery: per key hash, the window entries of it not resolved (at
    /// most one outside `Parking`: the others were parked behind it).
    keys: HashMap<u64, u32>,
    /// Keys whose count fell to 0 in this call: released after the call's writes.
    freed: Vec<u64>,
}

impl Index {
    /// Counts `key` for a window entry that is not resolved.
    fn add_key(&mut self, key: Option<u64>, s: &Status) {
        if let (Some(k), false) = (key, matches!(s, Status::Resolved { .. })) {
            *self.keys.entry(k).or_default() += 1;
        }
    }

    fn remove_key(&mut self, key: Option<u64>, s: &Status) {
        if let (Some(k), false) = (key, matches!(s, Status::Resolved { .. })) {
            if let Some(n) = self.keys.get_mut(&k) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.keys.remove(&k);
                    self.freed.push(k);
                }
            }
        }
    }

    fn add(&mut self, loc: Loc, s: &Status) {
        match s {
            Status::Pending => {
                self.pending.insert(loc);
            }
            Status::InFlight { deadline, .. } => {
                self.deadlines.insert((*deadline, loc));
            }
            Status::WaitingRetry { due } => {
                self.retries.insert((*due, loc));
            }
            Status::DeadLettering {
                outstanding: false,
                retry_at,
                ..
            }
            | Status::Settling {
                outstanding: false,
                retry_at,
                ..
            } => {
                self.deadlines.insert((*retry_at, loc));
            }
            _ => {}
        }
        if s.outstanding() {
            self.outstanding += 1;
        }
    }

    fn remove(&mut self, loc: Loc, s: &Status) {
        match s {
            Status::Pending => {
                self.pending.remove(&loc);
            }
            Status::InFlight { deadline, .. } => {
                self.deadlines.remove(&(*deadline, loc));
            }
            Status::WaitingRetry { due } => {
                self.retries.remove(&(*due, loc));
            }
            Status::DeadLettering {
                outstanding: false,
                retry_at,
                ..
            }
            | Status::Settling {
                outstanding: false,
                retry_at,
                ..
            } => {
                self.deadlines.remove(&(*retry_at, loc));
            }
            _ => {}
        }
        if s.outstanding() {
            self.outstanding = self.outstanding.saturating_sub(1);
        }
    }
}

/// What one `handle` produces: store commands in order, replies last (so a reply is
/// sent only after the writes it reports), and the window entries resolved during the
/// call (their `AckedAwaitingCommit` update is decided once the committed offset has
/// moved, so an entry resolved and committed in one call is never updated first).
#[derive(Default)]
struct Out {
    cmds: Vec<Command>,
    replies: Vec<Reply>,
    dirty: BTreeSet<Loc>,
}

impl Out {
    fn finish(self) -> Vec<Command> {
        let mut cmds = self.cmds;
        cmds.extend(self.replies.into_iter().map(Command::Reply));
        cmds
    }
}

/// The sans-IO delivery core of one (subscription incarnation, topic, partition).
///
/// Inputs in, commands out: see [`Input`] and [`Command`] for the protocol with the
/// shell, the crate docs for the rules. No method blocks, does I/O or panics.
pub struct PartitionCore {
    partition: Partition,
    config: Config,
    /// Ids and jitter: injected so tests are deterministic.
    sources: Sources,
    /// The lowest unresolved offset (equal to the last `Resolve` advance emitted).
    committed: u64,
    /// How far the log was read: offsets `committed..next_to_read` each have an entry.
    next_to_read: u64,
    /// The log's durable end as reported.
    log_end: u64,
    /// The outstanding `ReadLog { from, max }`, if any (one at a time).
    reading: Option<(u64, usize)>,
    /// After a failed read, no new read before this.
    read_retry_at: Option<u64>,
    /// Window entries (`>= committed`, each read offset until the committed offset
    /// passes it) and redrives; a BTreeMap because the committed offset walks it in
    /// order and pulls take the lowest offsets.
    entries: BTreeMap<Loc, Entry>,
    index: Index,
    /// Current delivery id -> where it lives: acks arrive by id. Holds only ids of
    /// in-flight or waiting attempts, so it is bounded by `max_in_flight`.
    ids: HashMap<String, Loc>,
    /// The latest time seen; time never runs backwards inside the core.
    now: u64,
    /// Ordered delivery after recovery: held keys to release once the keys of the
    /// recovered window records are known ([`Input::KeysHeld`]).
    held_after_recovery: BTreeSet<u64>,
    /// Offsets below this have their keys known (past the highest recovered window
    /// record).
    keys_known_from: u64,
}

impl PartitionCore {
    /// A core with nothing in flight, reading from `committed` (a new subscription, or
    /// a partition without delivery records).
    pub fn new(
        partition: Partition,
        config: Config,
        committed: u64,
        sources: Sources,
    ) -> Result<Self, CoreError> {
        config.validate()?;
        Ok(Self {
            partition,
            config,
            sources,
            committed,
            next_to_read: committed,
            log_end: committed,
            reading: None,
            read_retry_at: None,
            entries: BTreeMap::new(),
            index: Index::default(),
            ids: HashMap::new(),
            now: 0,
            held_after_recovery: BTreeSet::new(),
            keys_known_from: committed,
        })
    }

    /// Rebuilds the core after a restart from the OffsetStore's committed offset and
    /// the DeliveryStateStore's records of this partition, and returns the commands
    /// recovery implies (dead-letter and redrive writes that were not durable, the
    /// first read, a `Resolve` when records above the offset are already resolved).
    ///
    /// * `InFlight`: due again at its persisted deadline, or at once if it passed; its
    ///   delivery id stays valid until then (a consumer may still ack it).
    /// * `WaitingRetry`: due at its persisted due time.
    /// * `AckedAwaitingCommit`: resolved, never redelivered; removed when the committed
    ///   offset passes it.
    /// * `DeadLettering`: its `DeadLetter` is emitted again (the store finds an entry
    ///   written before the crash).
    /// * Offsets `>= committed` without a record are read and delivered again, from
    ///   attempt 1. Attempt counts continue from the records.
    /// * Records below `committed` are redrives (dead-lettered offsets are resolved);
    ///   their entry id is derived from the partition and offset. Those whose offset is
    ///   in `parked` (the park index holds an entry for it) are unparked events.
    /// * Offsets in `parked` at or above `committed` (parked, but the advance past them
    ///   was not durable yet) are resolved, never read and handed out again; their
    ///   records' attempt counts are kept for when they are unparked (in the window).
    ///   Except a record with more attempts than the park entry holds: it was written
    ///   by a hand-out of the event unparked in the window, so it is that delivery
    ///   (in flight with its lease, waiting, being dead-lettered, or acked and settled
    ///   again in the park index, never handed out).
    ///   The shell passes the parked offsets (with the attempts their park entries
    ///   hold) that have a record, and those at or above `committed`.
    pub fn recover(
        partition: Partition,
        config: Config,
        committed: u64,
        records: Vec<DeliveryRecord>,
        parked: &BTreeMap<u64, u32>,
        now_ms: u64,
        sources: Sources,
    ) -> Result<(Self, Vec<Command>), CoreError> {
        let mut core = Self::new(partition, config, committed, sources)?;
        let now = core.clock(now_ms);
        let mut seen = BTreeSet::new();
        for r in &records {
            if r.key != core.partition.key {
                return Err(CoreError::ForeignRecord {
                    offset: r.offset,
                    key: format!("{:?}", r.key),
                });
            }
            if !seen.insert(r.offset) {
                return Err(CoreError::DuplicateRecord { offset: r.offset });
            }
            if r.attempt == 0 {
                return Err(CoreError::InvalidRecord {
                    offset: r.offset,
                    reason: "attempt 0".into(),
                });
            }
        }
        let mut out = Out::default();
        for r in records {
            let loc = if r.offset < committed {
                Loc::Redrive(r.offset)
            } else {
                Loc::Window(r.offset)
            };
            // Written by a hand-out of an event unparked in the window: more attempts
            // than its park entry holds (a purely local index does not count
            // hand-outs). A parked retry's record has exactly the entry's count.
            let unparked_in_window = matches!(
                loc,
                Loc::Window(o) if parked.get(&o).is_some_and(|&a| r.attempt > a)
            );
            let was_parked =
                unparked_in_window || matches!(loc, Loc::Redrive(o) if parked.contains_key(&o));
            let redrive_of = match loc {
                Loc::Redrive(o) if !was_parked => Some(core.partition.dead_letter_id(o)),
                _ => None,
            };
            let status = match (r.state, loc) {
                // Parked after this record was written (a retry due far ahead): the
                // park entry is newer, so the event is resolved here and goes out
                // from the index when due.
                (_, Loc::Window(o)) if parked.contains_key(&o) && !unparked_in_window => {
                    Status::Resolved { recorded: true }
                }
                // Acked after it was unparked in the window, its park entry not
                // settled yet: settled again, never handed out.
                (DeliveryState::AckedAwaitingCommit, _) if unparked_in_window => Status::Settling {
                    outstanding: true,
                    retry_at: now,
                    failures: 0,
                },
                (DeliveryState::InFlight, _) => Status::InFlight {
                    deadline: r.deadline_ms,
                    recovered: true,
                },
                (DeliveryState::WaitingRetry, _) => Status::WaitingRetry { due: r.deadline_ms },
                (DeliveryState::AckedAwaitingCommit, Loc::Window(_)) => {
                    Status::Resolved { recorded: true }
                }
                (DeliveryState::AckedAwaitingCommit, Loc::Redrive(_)) => Status::Settling {
                    outstanding: true,
                    retry_at: now,
                    failures: 0,
                },
                (DeliveryState::DeadLettering, _) => Status::DeadLettering {
                    outstanding: true,
                    retry_at: now,
                    failures: 0,
                },
            };
            // An in-flight record without an id was handed out by another owner (the
            // attempt ledger holds no ids): its id is rebuilt from the same fields,
            // so the consumer's ack of it is honoured here.
            let id = match (r.delivery_id.is_empty(), &status) {
                (false, _) => Some(r.delivery_id),
                (true, Status::InFlight { .. }) => {
                    Some(core.delivery_id(loc, r.attempt, r.session.as_ref()))
                }
                (true, _) => None,
            };
            if let (Some(id), Status::InFlight { .. } | Status::WaitingRetry { .. }) =
                (&id, &status)
            {
                core.ids.insert(id.clone(), loc);
            }
            let entry = Entry {
                attempt: r.attempt,
                delivery_id: id,
                session: r.session,
                first_at: Some(r.first_delivered_at_ms),
                last_reason: r.last_reason,
                has_record: true,
                redrive_of,
                parked: was_parked,
                size: None,
                key: None,
                repark_due: None,
                status,
            };
            let rewrite = matches!(
                entry.status,
                Status::DeadLettering { .. } | Status::Settling { .. }
            );
            core.insert_entry(loc, entry);
            if rewrite {
                core.emit_meta_write(loc, &mut out);
            }
        }
        // Parked at or above `committed`: the park entry was durable before the crash
        // but the offset's advance was not. It stays resolved (it must not be handed
        // out from the log as well: the park entry delivers it when due).
        for &o in parked.range(committed..).map(|(o, _)| o) {
            let loc = Loc::Window(o);
            if !core.entries.contains_key(&loc) {
                core.insert_entry(
                    loc,
                    Entry::fresh(None, None, Status::Resolved { recorded: true }),
                );
            }
        }
        core.keys_known_from = core
            .entries
            .keys()
            .filter_map(|l| match l {
                Loc::Window(o) => o.checked_add(1),
                Loc::Redrive(_) => None,
            })
            .max()
            .unwrap_or(committed)
            .max(committed);
        core.fire_timers(now, &mut out);
        core.settle(&mut out);
        core.release_keys(&mut out);
        core.maybe_read(now, &mut out);
        Ok((core, out.finish()))
    }

    /// Applies one input at `now_ms` (unix ms; a value below an earlier one counts as
    /// the earlier one) and returns what the shell must do, in order. Timers that have
    /// passed act first, so results do not depend on how often the shell ticks.
    pub fn handle(&mut self, input: Input, now_ms: u64) -> Result<Vec<Command>, CoreError> {
        self.validate(&input)?;
        let now = self.clock(now_ms);
        let mut out = Out::default();
        self.fire_timers(now, &mut out);
        self.apply(input, now, &mut out);
        self.settle(&mut out);
        self.release_keys(&mut out);
        self.maybe_read(now, &mut out);
        Ok(out.finish())
    }

    /// Redrives under way, unparked events included (each counts against the room
    /// [`Input::Redrive`] and [`Input::Unpark`] need: at most `max_in_flight`).
    pub fn redrives_under_way(&self) -> usize {
        self.entries
            .range(Loc::Redrive(0)..=Loc::Redrive(u64::MAX))
            .count()
    }

    /// Changes [`Config::park_retries_after_ms`] from now on (the shell turns parking
    /// of retries off while a cluster member could not take parked events over). A
    /// value of `Some(0)` is taken as `Some(1)`.
    pub fn set_park_retries_after_ms(&mut self, ms: Option<u64>) {
        self.config.park_retries_after_ms = ms.map(|m| m.max(1));
    }

    /// Ordered delivery: whether an event of the window holds `key` (in flight,
    /// waiting, being dead-lettered or parked, or not handed out yet).
    pub fn key_taken(&self, key: u64) -> bool {
        self.index.keys.contains_key(&key)
    }

    /// Whether a redrive of `offset` is under way here (not one of a parked event).
    pub fn redrive_under_way(&self, offset: u64) -> bool {
        self.entries
            .get(&Loc::Redrive(offset))
            .is_some_and(|e| !e.parked)
    }

    /// Whether the parked event at `offset` was unparked and is not settled yet (the
    /// shell feeds [`Input::Unpark`] once per due entry).
    pub fn is_unparked(&self, offset: u64) -> bool {
        self.entries
            .get(&self.loc_of(offset))
            .is_some_and(|e| e.parked)
    }

    /// Parked events unparked and not settled yet, below `committed` and in the
    /// window (the shell reads past them in the park index).
    pub fn unparked(&self) -> usize {
        self.entries.values().filter(|e| e.parked).count()
    }

    /// The earliest time at which time alone changes something (a lease ends, a retry
    /// becomes due, a held dead-letter or a failed read is tried again): tick then.
    /// `None`: nothing is timed. Retries already due are not wake-ups: they wait for a
    /// pull (see [`PartitionCore::ready`]).
    pub fn next_wakeup(&self) -> Option<u64> {
        let mut t = self.index.deadlines.first().map(|(t, _)| *t);
        let future_retry = self
            .index
            .retries
            .range((self.now.saturating_add(1), Loc::Redrive(0))..)
            .next()
            .map(|(t, _)| *t);
        for c in [future_retry, self.read_retry_at] {
            t = match (t, c) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        t
    }

    /// How many deliveries a pull at `now_ms` could start (a long-polling shell waits
    /// while this is 0).
    pub fn ready(&self, now_ms: u64) -> usize {
        let room = self
            .config
            .max_in_flight
            .saturating_sub(self.index.outstanding);
        let due = self
            .index
            .retries
            .iter()
            .take_while(|(t, _)| *t <= now_ms)
            .count();
        due + self.index.pending.len().min(room)
    }

    /// The session the current attempt named by `delivery_id` is bound to, so the shell
    /// can look it up and pass a [`SessionCheck`] with the ack.
    pub fn bound_session(&self, delivery_id: &str) -> Option<&SessionBinding> {
        let loc = self.current(delivery_id)?;
        self.entries.get(&loc)?.session.as_ref()
    }

    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// Offsets above the committed one that are resolved already (acked,
    /// dead-lettered or filtered above a gap), ascending: what a release hands over
    /// with its checkpoint so that the next owner does not deliver them again.
    pub fn resolved_above(&self) -> Vec<u64> {
        self.entries
            .range(Loc::Window(self.committed)..)
            .filter(|(_, e)| matches!(e.status, Status::Resolved { .. }))
            .map(|(loc, _)| loc.offset())
            .collect()
    }

    pub fn partition(&self) -> &Partition {
        &self.partition
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn stats(&self) -> Stats {
        let mut s = Stats {
            committed: self.committed,
            next_to_read: self.next_to_read,
            log_end: self.log_end,
            backlog: self
                .log_end
                .max(self.next_to_read)
                .saturating_sub(self.committed),
            outstanding: self.index.outstanding,
            ..Stats::default()
        };
        for (loc, e) in &self.entries {
            if matches!(loc, Loc::Redrive(_)) {
                s.redrives += 1;
            }
            match e.status {
                Status::Pending => s.pending += 1,
                Status::Persisting { .. } => s.persisting += 1,
                Status::InFlight { .. } => s.in_flight += 1,
                Status::WaitingRetry { .. } => s.waiting += 1,
                Status::DeadLettering { .. } => s.dead_lettering += 1,
                Status::Settling { .. } if e.repark_due.is_some() => s.waiting += 1,
                Status::Settling { .. } => s.acked_awaiting += 1,
                Status::Parking { .. } => s.parking += 1,
                Status::Resolved { .. } if e.has_record => s.acked_awaiting += 1,
                Status::Resolved { .. } => {}
            }
        }
        s
    }

    /// Checks the core's internal indexes against its entries (O(entries)): every
    /// timer, pending mark and current delivery id mirrors a status, the outstanding
    /// count is right, window entries lie at or above the committed offset and
    /// redrives below it. For tests and debug assertions in the shell.
    pub fn check_consistency(&self) -> Result<(), String> {
        let mut expected = Index::default();
        for (loc, e) in &self.entries {
            expected.add(*loc, &e.status);
            expected.add_key(e.key, &e.status);
            match loc {
                Loc::Window(o) if *o < self.committed => {
                    return Err(format!(
                        "window entry {o} below committed {}",
                        self.committed
                    ))
                }
                Loc::Redrive(o) if *o >= self.committed => {
                    return Err(format!(
                        "redrive {o} at or above committed {}",
                        self.committed
                    ))
                }
                // Exactly one of an entry id and a park entry.
                Loc::Redrive(_) if e.redrive_of.is_some() == e.parked => {
                    return Err(format!(
                        "redrive {loc:?} needs exactly one of an entry id and a park entry"
                    ))
                }
                Loc::Redrive(_) if matches!(e.status, Status::Parking { .. }) => {
                    return Err(format!("redrive {loc:?} parking"))
                }
                _ => {}
            }
            if matches!(e.status, Status::Resolved { .. }) && matches!(loc, Loc::Redrive(_)) {
                return Err(format!("redrive {loc:?} resolved but not removed"));
            }
            if e.attempt > 0 && !e.has_record {
                return Err(format!("{loc:?} has attempts without a record"));
            }
        }
        let same = expected.pending == self.index.pending
            && expected.deadlines == self.index.deadlines
            && expected.retries == self.index.retries
            && expected.outstanding == self.index.outstanding
            && expected.keys == self.index.keys;
        if !same {
            return Err("indexes do not mirror the statuses".into());
        }
        for (id, loc) in &self.ids {
            let Some(e) = self.entries.get(loc) else {
                return Err(format!("id {id} points at a missing entry"));
            };
            if e.delivery_id.as_deref() != Some(id.as_str())
                || !matches!(
                    e.status,
                    Status::InFlight { .. } | Status::WaitingRetry { .. }
                )
            {
                return Err(format!("id {id} is not the current attempt of {loc:?}"));
            }
        }
        if self.next_to_read < self.committed {
            return Err("next_to_read below committed".into());
        }
        // Ordered: one event per key out of the park's hands (the rest wait parked).
        let mut taken = BTreeSet::new();
        for (loc, e) in &self.entries {
            let active = !matches!(
                e.status,
                Status::Resolved { .. } | Status::Parking { retry: false }
            );
            if let (Some(k), true) = (e.key, active) {
                if !taken.insert(k) {
                    return Err(format!("{loc:?}: a second event of key {k:#x} is active"));
                }
            }
        }
        Ok(())
    }

    // ---- internals -------------------------------------------------------------

    fn clock(&mut self, now_ms: u64) -> u64 {
        self.now = self.now.max(now_ms);
        self.now
    }

    /// Where `offset` lives (window offsets are `>= committed`, redrives below).
    fn loc_of(&self, offset: u64) -> Loc {
        if offset < self.committed {
            Loc::Redrive(offset)
        } else {
            Loc::Window(offset)
        }
    }

    /// The entry of a current (in flight or waiting) attempt with this id.
    fn current(&self, delivery_id: &str) -> Option<Loc> {
        let loc = *self.ids.get(delivery_id)?;
        let e = self.entries.get(&loc)?;
        let current = e.delivery_id.as_deref() == Some(delivery_id)
            && matches!(
                e.status,
                Status::InFlight { .. } | Status::WaitingRetry { .. }
            );
        current.then_some(loc)
    }

    fn insert_entry(&mut self, loc: Loc, entry: Entry) {
        self.index.add(loc, &entry.status);
        self.index.add_key(entry.key, &entry.status);
        if let Some(old) = self.entries.insert(loc, entry) {
            self.index.remove(loc, &old.status);
            self.index.remove_key(old.key, &old.status);
        }
    }

    fn remove_entry(&mut self, loc: Loc) {
        if let Some(e) = self.entries.remove(&loc) {
            self.index.remove(loc, &e.status);
            self.index.remove_key(e.key, &e.status);
            if let Some(id) = e.delivery_id {
                if self.ids.get(&id) == Some(&loc) {
                    self.ids.remove(&id);
                }
            }
        }
    }

    fn set_status(&mut self, loc: Loc, status: Status) {
        if let Some(e) = self.entries.get_mut(&loc) {
            self.index.remove(loc, &e.status);
            self.index.add(loc, &status);
            // Added first: a key whose entry stays unresolved is not freed.
            self.index.add_key(e.key, &status);
            self.index.remove_key(e.key, &e.status);
            e.status = status;
        }
    }

    /// A recovered entry's key, learned when the log is read there.
    fn learn_key(&mut self, loc: Loc, key: Option<u64>) {
        if let Some(e) = self.entries.get_mut(&loc) {
            if e.key.is_none() && key.is_some() {
                e.key = key;
                self.index.add_key(key, &e.status);
            }
        }
    }

    /// Ordered delivery: `ReleaseKey` for each key freed in this call, and, once the
    /// keys of every recovered record are known, for each held key from recovery
    /// that no window entry holds.
    fn release_keys(&mut self, out: &mut Out) {
        let mut freed = std::mem::take(&mut self.index.freed);
        if !self.held_after_recovery.is_empty() && self.next_to_read >= self.keys_known_from {
            for k in std::mem::take(&mut self.held_after_recovery) {
                if !self.index.keys.contains_key(&k) {
                    freed.push(k);
                }
            }
        }
        let mut seen = BTreeSet::new();
        for key in freed {
            // Freed and taken again in one call (parked behind itself) is not free.
            if !self.index.keys.contains_key(&key) && seen.insert(key) {
                out.cmds.push(Command::ReleaseKey { key });
            }
        }
    }

    /// Drops the entry's current id from the ack index (superseded or finished).
    fn forget_id(&mut self, loc: Loc) {
        if let Some(id) = self.entries.get(&loc).and_then(|e| e.delivery_id.as_ref()) {
            if self.ids.get(id) == Some(&loc) {
                self.ids.remove(id);
            }
        }
    }

    fn record(&self, loc: Loc, state: DeliveryState, deadline_ms: u64) -> Option<DeliveryRecord> {
        let e = self.entries.get(&loc)?;
        Some(DeliveryRecord {
            key: self.partition.key.clone(),
            offset: loc.offset(),
            attempt: e.attempt,
            delivery_id: e.delivery_id.clone().unwrap_or_default(),
            deadline_ms,
            last_reason: e.last_reason.clone(),
            first_delivered_at_ms: e.first_at.unwrap_or(0),
            state,
            owner_epoch: self.partition.owner_epoch,
            session: e.session.clone(),
        })
    }

    fn update(&self, loc: Loc, state: DeliveryState, deadline_ms: u64, out: &mut Out) {
        if let Some(r) = self.record(loc, state, deadline_ms) {
            out.cmds.push(Command::Update(r));
        }
    }

    fn delivery_id(&mut self, loc: Loc, attempt: u32, session: Option<&SessionBinding>) -> String {
        let k = &self.partition.key;
        let redrive = matches!(loc, Loc::Redrive(_));
        let tag = self.sources.ids.tag(&IdFields {
            subscription: &k.subscription,
            incarnation: k.incarnation,
            reset_epoch: self.partition.reset_epoch,
            topic: &k.topic,
            partition: k.partition,
            offset: loc.offset(),
            attempt,
            session_epoch: session.map(|s| s.epoch),
            redrive,
        });
        DeliveryId {
            incarnation: k.incarnation,
            partition: k.partition,
            offset: loc.offset(),
            attempt,
            redrive,
            tag,
        }
        .to_string()
    }

    fn validate(&self, input: &Input) -> Result<(), CoreError> {
        match input {
            Input::EventsRead(events) => {
                let Some((from, max)) = self.reading else {
                    return Err(CoreError::NoReadOutstanding);
                };
                let mismatch = |reason: String| CoreError::ReadMismatch { from, max, reason };
                if events.len() > max {
                    return Err(mismatch(format!("{} events", events.len())));
                }
                for (i, e) in events.iter().enumerate() {
                    let expected = from.checked_add(i as u64);
                    if expected != Some(e.offset) {
                        return Err(mismatch(format!(
                            "event {i} has offset {}, expected {expected:?}",
                            e.offset
                        )));
                    }
                }
            }
            Input::ReadFailed if self.reading.is_none() => {
                return Err(CoreError::NoReadOutstanding);
            }
            Input::Pull { max_events: 0, .. } => {
                return Err(CoreError::InvalidPull { max_events: 0 });
            }
            Input::AttemptPersisted { offset, attempt }
            | Input::PersistFailed { offset, attempt }
                if self.persisting(*offset, *attempt).is_none() =>
            {
                return Err(CoreError::NotPersisting {
                    offset: *offset,
                    attempt: *attempt,
                });
            }
            Input::Extend { ack_timeout_ms, .. }
                if !ACK_TIMEOUT_MS_RANGE.contains(ack_timeout_ms) =>
            {
                return Err(CoreError::InvalidAckTimeout {
                    ms: *ack_timeout_ms,
                });
            }
            Input::DeadLettered { offset } | Input::DeadLetterUnavailable { offset } => {
                let ok = matches!(
                    self.entries.get(&Loc::Window(*offset)).map(|e| &e.status),
                    Some(Status::DeadLettering {
                        outstanding: true,
                        ..
                    })
                );
                if !ok {
                    return Err(CoreError::NotDeadLettering { offset: *offset });
                }
            }
            Input::RedriveSettled { offset } | Input::RedriveUnavailable { offset } => {
                let loc = self.loc_of(*offset);
                let entry = self
                    .entries
                    .get(&loc)
                    .filter(|e| matches!(loc, Loc::Redrive(_)) || e.parked);
                let ok = matches!(
                    entry.map(|e| &e.status),
                    Some(
                        Status::DeadLettering {
                            outstanding: true,
                            ..
                        } | Status::Settling {
                            outstanding: true,
                            ..
                        }
                    )
                );
                if !ok {
                    return Err(CoreError::NotSettling { offset: *offset });
                }
            }
            Input::Parked { offset }
                if !matches!(
                    self.entries.get(&Loc::Window(*offset)).map(|e| &e.status),
                    Some(Status::Parking { .. })
                ) =>
            {
                return Err(CoreError::NotParking { offset: *offset });
            }
            Input::Unpark { offset, attempt } if *offset >= self.committed => {
                // Parked above a gap: unparked in place, in the window (its entry
                // there is resolved by the parking).
                let Some(e) = self.entries.get(&Loc::Window(*offset)) else {
                    return Err(CoreError::RedriveOfUnresolvedOffset {
                        offset: *offset,
                        committed: self.committed,
                    });
                };
                if !e.parked {
                    if !matches!(e.status, Status::Resolved { .. }) {
                        return Err(CoreError::RedriveOfUnresolvedOffset {
                            offset: *offset,
                            committed: self.committed,
                        });
                    }
                    self.room_to_dead_letter_at_once(e.attempt.max(*attempt))?;
                }
            }
            Input::Unpark { offset, attempt } => match self.entries.get(&Loc::Redrive(*offset)) {
                Some(e) if !e.parked => return Err(CoreError::UnparkOfRedrive { offset: *offset }),
                Some(_) => {}
                None => {
                    self.redrive_room()?;
                    self.room_to_dead_letter_at_once(*attempt)?;
                }
            },
            Input::Redrive { entry_id, offset } => {
                if self
                    .entries
                    .get(&Loc::Redrive(*offset))
                    .is_some_and(|e| e.parked)
                {
                    return Err(CoreError::RedriveOfParked { offset: *offset });
                }
                if *offset >= self.committed {
                    return Err(CoreError::RedriveOfUnresolvedOffset {
                        offset: *offset,
                        committed: self.committed,
                    });
                }
                let expected = self.partition.dead_letter_id(*offset);
                if *entry_id != expected {
                    return Err(CoreError::ForeignDeadLetterEntry {
                        entry_id: entry_id.clone(),
                        expected,
                    });
                }
                if !self.entries.contains_key(&Loc::Redrive(*offset)) {
                    self.redrive_room()?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// Room for one more redrive (unparked events count): at most `max_in_flight`.
    fn redrive_room(&self) -> Result<(), CoreError> {
        if self.redrives_under_way() >= self.config.max_in_flight {
            return Err(CoreError::RedriveBacklogFull {
                limit: self.config.max_in_flight,
            });
        }
        Ok(())
    }

    /// An unparked event with `attempts` made is dead-lettered at once when it had
    /// them all: that counts against `max_in_flight` like any dead-lettering.
    fn room_to_dead_letter_at_once(&self, attempts: u32) -> Result<(), CoreError> {
        if attempts >= self.config.max_attempts
            && self.index.outstanding >= self.config.max_in_flight
        {
            return Err(CoreError::RedriveBacklogFull {
                limit: self.config.max_in_flight,
            });
        }
        Ok(())
    }

    /// The entry persisting this attempt of this offset.
    fn persisting(&self, offset: u64, attempt: u32) -> Option<Loc> {
        let loc = self.loc_of(offset);
        let e = self.entries.get(&loc)?;
        (matches!(e.status, Status::Persisting { .. }) && e.attempt == attempt).then_some(loc)
    }

    fn fire_timers(&mut self, now: u64, out: &mut Out) {
        while let Some(&(t, loc)) = self.index.deadlines.first() {
            if t > now {
                break;
            }
            // Removed here so the loop always ends, whatever the status says.
            self.index.deadlines.remove(&(t, loc));
            let Some(status) = self.entries.get(&loc).map(|e| e.status.clone()) else {
                continue;
            };
            match status {
                Status::InFlight {
                    deadline,
                    recovered,
                } if deadline == t => {
                    self.fail(loc, ACK_TIMEOUT_REASON, now, recovered.then_some(0), out);
                }
                Status::DeadLettering {
                    outstanding: false,
                    retry_at,
                    failures,
                } if retry_at == t => {
                    self.set_status(
                        loc,
                        Status::DeadLettering {
                            outstanding: true,
                            retry_at,
                            failures,
                        },
                    );
                    self.emit_meta_write(loc, out);
                }
                Status::Settling {
                    outstanding: false,
                    retry_at,
                    failures,
                } if retry_at == t => {
                    self.set_status(
                        loc,
                        Status::Settling {
                            outstanding: true,
                            retry_at,
                            failures,
                        },
                    );
                    self.emit_meta_write(loc, out);
                }
                _ => {}
            }
        }
    }

    /// The DeadLetterStore write an entry in `DeadLettering`/`Settling` waits for.
    fn emit_meta_write(&self, loc: Loc, out: &mut Out) {
        let Some(e) = self.entries.get(&loc) else {
            return;
        };
        let reason = e
            .last_reason
            .clone()
            .unwrap_or_else(|| MAX_ATTEMPTS_REASON.to_string());
        let request = |offset| DeadLetterRequest {
            offset,
            attempts: e.attempt,
            reason: reason.clone(),
            first_attempt_at_ms: e.first_at.unwrap_or(0),
        };
        let cmd = match (&e.status, loc, &e.redrive_of) {
            // An unparked event (below `committed` or in the window) is settled in
            // the park index.
            (Status::DeadLettering { .. }, loc, _) if e.parked => {
                Command::ParkDeadLetter(request(loc.offset()))
            }
            (Status::Settling { .. }, loc, _) if e.parked => match e.repark_due {
                Some(due_ms) => Command::Repark {
                    offset: loc.offset(),
                    due_ms,
                    attempt: e.attempt,
                },
                None => Command::ParkSettled {
                    offset: loc.offset(),
                },
            },
            (Status::DeadLettering { .. }, Loc::Window(offset), _) => {
                Command::DeadLetter(request(offset))
            }
            (Status::DeadLettering { .. }, Loc::Redrive(offset), Some(id)) => {
                Command::RedriveFailed {
                    entry_id: id.clone(),
                    offset,
                    reason,
                    attempts: e.attempt,
                }
            }
            (Status::Settling { .. }, Loc::Redrive(offset), Some(id)) => {
                Command::RedriveSucceeded {
                    entry_id: id.clone(),
                    offset,
                }
            }
            _ => return,
        };
        out.cmds.push(cmd);
    }

    /// A failed attempt (nack, lease end): retry with backoff, or dead-letter at
    /// `max_attempts`. `delay_ms`: the retry is due after this instead of the backoff
    /// (0 for a recovered lease: due at once; a nack's `delay_ms`).
    fn fail(
        &mut self,
        loc: Loc,
        reason: &str,
        now: u64,
        delay_ms: Option<u64>,
        out: &mut Out,
    ) -> NackOutcome {
        let Some(e) = self.entries.get_mut(&loc) else {
            return NackOutcome::Unknown;
        };
        e.last_reason = Some(reason.to_string());
        let attempt = e.attempt;
        if attempt >= self.config.max_attempts {
            self.start_dead_letter(loc, now, out);
            return NackOutcome::DeadLettering;
        }
        let delay = match delay_ms {
            Some(ms) => ms,
            None => backoff_delay(self.config.backoff, attempt, self.sources.jitter.as_mut()),
        };
        let due = now.saturating_add(delay);
        if let (Some(after), true) = (self.config.park_retries_after_ms, e.parked) {
            if delay >= after {
                // An unparked event retried far ahead goes back to the park index
                // (its entry there takes the due time and the attempts), so it does
                // not hold a redrive slot and memory until then. Its record says
                // waiting first: a crash before the entry is rewritten keeps the delay.
                e.repark_due = Some(due);
                self.forget_id(loc);
                self.set_status(
                    loc,
                    Status::Settling {
                        outstanding: true,
                        retry_at: now,
                        failures: 0,
                    },
                );
                self.update(loc, DeliveryState::WaitingRetry, due, out);
                self.emit_meta_write(loc, out);
                return NackOutcome::Retrying { due_ms: due };
            }
        }
        // Ordered: a recovered record not read from the log again has no known key,
        // and a park entry without its key would let the key's next event go first:
        // it waits in the window instead.
        let key_unknown = self.config.ordered && e.size.is_none();
        if let (Loc::Window(offset), Some(after)) = (loc, self.config.park_retries_after_ms) {
            if delay >= after && !key_unknown {
                // Due far ahead: parked, so it does not hold the committed offset. Its
                // id ends here (an ack of it is `unknown`); the park entry keeps the
                // attempts, and the unparked delivery continues the count.
                let key = self.entries.get(&loc).and_then(|e| e.key);
                self.forget_id(loc);
                self.set_status(loc, Status::Parking { retry: true });
                out.cmds.push(Command::Park {
                    offset,
                    due_ms: due,
                    attempt,
                    key,
                    not_before_ms: 0,
                });
                return NackOutcome::Retrying { due_ms: due };
            }
        }
        self.set_status(loc, Status::WaitingRetry { due });
        self.update(loc, DeliveryState::WaitingRetry, due, out);
        NackOutcome::Retrying { due_ms: due }
    }

    fn start_dead_letter(&mut self, loc: Loc, now: u64, out: &mut Out) {
        self.forget_id(loc);
        self.set_status(
            loc,
            Status::DeadLettering {
                outstanding: true,
                retry_at: now,
                failures: 0,
            },
        );
        self.update(loc, DeliveryState::DeadLettering, now, out);
        self.emit_meta_write(loc, out);
    }

    fn apply(&mut self, input: Input, now: u64, out: &mut Out) {
        match input {
            Input::LogEnd(end) => self.log_end = self.log_end.max(end),
            Input::EventsRead(events) => self.events_read(events, now, out),
            Input::ReadFailed => {
                self.reading = None;
                self.read_retry_at = Some(now.saturating_add(self.config.read_retry_ms));
            }
            Input::KeysHeld(keys) => self.held_after_recovery.extend(keys),
            Input::Pull {
                pull_id,
                max_events,
                max_bytes,
                at_least_one,
                session,
            } => {
                let budget = Budget {
                    events: max_events,
                    bytes: max_bytes,
                    at_least_one,
                };
                self.pull(pull_id, budget, session, now, out)
            }
            Input::Release(ids) => {
                for delivery_id in ids {
                    let released = self.release(&delivery_id, now);
                    out.replies.push(Reply::Release {
                        delivery_id,
                        released,
                    });
                }
            }
            Input::AttemptPersisted { offset, attempt } => self.persisted(offset, attempt, out),
            Input::PersistFailed { offset, attempt } => self.persist_failed(offset, attempt, now),
            Input::Ack(refs) => {
                for r in refs {
                    let outcome = self.ack(&r, now, out);
                    out.replies.push(Reply::Ack {
                        delivery_id: r.delivery_id,
                        outcome,
                    });
                }
            }
            Input::Nack {
                deliveries,
                reason,
                delay_ms,
            } => {
                for r in deliveries {
                    let outcome = self.nack(&r, &reason, delay_ms, now, out);
                    out.replies.push(Reply::Nack {
                        delivery_id: r.delivery_id,
                        outcome,
                    });
                }
            }
            Input::Extend {
                deliveries,
                ack_timeout_ms,
            } => {
                for r in deliveries {
                    let outcome = self.extend(&r, ack_timeout_ms, now, out);
                    out.replies.push(Reply::Extend {
                        delivery_id: r.delivery_id,
                        outcome,
                    });
                }
            }
            Input::Tick => {}
            Input::DeadLettered { offset } => {
                let loc = Loc::Window(offset);
                self.set_status(loc, Status::Resolved { recorded: false });
                out.dirty.insert(loc);
            }
            Input::DeadLetterUnavailable { offset } => {
                self.meta_write_unavailable(Loc::Window(offset), now)
            }
            Input::Redrive { entry_id, offset } => {
                let loc = Loc::Redrive(offset);
                if !self.entries.contains_key(&loc) {
                    self.insert_entry(loc, Entry::fresh(Some(entry_id), None, Status::Pending));
                }
            }
            Input::RedriveSettled { offset } => match self.loc_of(offset) {
                Loc::Redrive(_) => {
                    self.remove_entry(Loc::Redrive(offset));
                    out.cmds.push(Command::Resolve {
                        remove: vec![offset],
                        advance: None,
                    });
                }
                loc @ Loc::Window(_) => {
                    // Unparked in the window and settled in the park index (acked,
                    // dead-lettered, or parked again): resolved here like an ack;
                    // its record goes when `committed` passes it.
                    if let Some(e) = self.entries.get_mut(&loc) {
                        e.parked = false;
                        e.repark_due = None;
                    }
                    self.set_status(loc, Status::Resolved { recorded: false });
                    out.dirty.insert(loc);
                }
            },
            Input::RedriveUnavailable { offset } => {
                self.meta_write_unavailable(self.loc_of(offset), now)
            }
            Input::Parked { offset } => {
                // The park entry holds it from now on. A parked retry's record is
                // marked acked (or removed with the advance), as an ack's is.
                let loc = Loc::Window(offset);
                let has_record = self.entries.get(&loc).is_some_and(|e| e.has_record);
                self.set_status(
                    loc,
                    Status::Resolved {
                        recorded: !has_record,
                    },
                );
                if has_record {
                    out.dirty.insert(loc);
                }
            }
            Input::Unpark { offset, attempt } if offset >= self.committed => {
                self.unpark_in_window(offset, attempt, now, out)
            }
            Input::Unpark { offset, attempt } => {
                let loc = Loc::Redrive(offset);
                if !self.entries.contains_key(&loc) {
                    let mut e = Entry::fresh(None, None, Status::Pending);
                    e.parked = true;
                    e.attempt = attempt;
                    // Attempts made before it was parked have their record in the park
                    // entry; the next hand-out writes one here.
                    e.has_record = attempt > 0;
                    self.insert_entry(loc, e);
                    self.dead_letter_if_spent(loc, now, out);
                }
            }
        }
    }

    /// [`Input::Unpark`] of an event parked above a gap (`committed` has not passed
    /// it): its window entry, resolved by the parking, is ready again and handed out
    /// from the park index like an unparked redrive (attempts continuing the larger
    /// of its park entry's and its record's), so a due event never waits for the
    /// offsets before it. Until it is settled in the park index it holds `committed`
    /// like any event of the window.
    fn unpark_in_window(&mut self, offset: u64, attempt: u32, now: u64, out: &mut Out) {
        let loc = Loc::Window(offset);
        let Some(mut e) = self.entries.get(&loc).cloned() else {
            return;
        };
        if e.parked {
            return; // under way already
        }
        self.remove_entry(loc);
        e.parked = true;
        // Its key is held by its park entry until that is settled (as for an
        // unparked redrive), not by the window.
        e.key = None;
        e.attempt = e.attempt.max(attempt);
        e.has_record = e.has_record || e.attempt > 0;
        e.delivery_id = None;
        e.session = None;
        e.repark_due = None;
        e.status = Status::Pending;
        self.insert_entry(loc, e);
        self.dead_letter_if_spent(loc, now, out);
    }

    /// An unparked event that has had its attempts (its last one failed before a
    /// crash, as its record says, or `max_attempts` was lowered below its count) is
    /// dead-lettered, not handed out again.
    fn dead_letter_if_spent(&mut self, loc: Loc, now: u64, out: &mut Out) {
        let max = self.config.max_attempts;
        let Some(e) = self.entries.get_mut(&loc) else {
            return;
        };
        let attempts = e.attempt;
        if attempts < max {
            return;
        }
        e.last_reason.get_or_insert_with(|| {
            format!("max_attempts lowered to {max} below the {attempts} attempts made")
        });
        self.start_dead_letter(loc, now, out);
    }

    fn events_read(&mut self, events: Vec<EventMeta>, now: u64, out: &mut Out) {
        let Some((from, _)) = self.reading.take() else {
            return;
        };
        let Some(last) = events.last().map(|e| e.offset) else {
            // The log has nothing at `from`: our idea of its end was ahead of it.
            self.log_end = self.log_end.min(from).max(self.next_to_read);
            return;
        };
        for ev in events {
            let loc = Loc::Window(ev.offset);
            if ev.offset < self.committed {
                continue; // resolved already
            }
            let matches = self.config.matches(&ev);
            let key = ev.key.filter(|_| matches && self.config.ordered);
            if let Some(e) = self.entries.get_mut(&loc) {
                // Known from a recovered record: now its size (and key) is known too.
                e.size.get_or_insert(ev.size);
                // An event unparked in the window holds its key in the park index.
                if !e.parked {
                    self.learn_key(loc, key);
                }
                continue;
            }
            // Ordered: a key taken by an earlier event (here, or in the park index)
            // parks this one behind it, with its own `deliverat` kept for later.
            let held = key.is_some_and(|k| ev.key_parked || self.index.keys.contains_key(&k));
            let park = |due_ms: u64, not_before_ms: u64| Command::Park {
                offset: ev.offset,
                due_ms,
                attempt: 0,
                key,
                not_before_ms,
            };
            let status = match ev.deliver_at_ms {
                // Filtered: resolved without delivery, no attempt, no record.
                _ if !matches => Status::Resolved { recorded: true },
                at if held => {
                    out.cmds.push(park(HELD, at.unwrap_or(0)));
                    Status::Parking { retry: false }
                }
                Some(due_ms) if due_ms > now => {
                    out.cmds.push(park(due_ms, 0));
                    Status::Parking { retry: false }
                }
                _ => Status::Pending,
            };
            let mut entry = Entry::fresh(None, Some(ev.size), status);
            entry.key = key;
            self.insert_entry(loc, entry);
        }
        self.next_to_read = self.next_to_read.max(last.saturating_add(1));
        self.log_end = self.log_end.max(self.next_to_read);
    }

    fn pull(
        &mut self,
        pull_id: PullId,
        budget: Budget,
        session: Option<SessionBinding>,
        now: u64,
        out: &mut Out,
    ) {
        let max = budget.events;
        // Due retries and pending offsets, merged in (redrives first, then) offset
        // order: a retry waiting for its backoff is simply not in the list, so it never
        // holds back later offsets.
        let mut ready: Vec<Loc> = self
            .index
            .retries
            .iter()
            .take_while(|(due, _)| *due <= now)
            .map(|(_, loc)| *loc)
            .collect();
        ready.extend(self.index.pending.iter().take(max).copied());
        ready.sort_unstable();
        let mut started = 0;
        let mut bytes: u64 = 0;
        for loc in ready {
            if started == max {
                break;
            }
            let Some(e) = self.entries.get(&loc) else {
                continue;
            };
            match e.status {
                Status::Pending => {
                    if self.index.outstanding >= self.config.max_in_flight {
                        continue; // back-pressure: nothing new beyond the bound
                    }
                }
                Status::WaitingRetry { .. } => {
                    if e.attempt >= self.config.max_attempts {
                        // Only after a lowered max_attempts: never a hand-out beyond it.
                        self.start_dead_letter(loc, now, out);
                        continue;
                    }
                }
                _ => continue,
            }
            // The next delivery that would pass the byte budget ends the pull (later
            // ones are not taken past it: offsets go out in order).
            let size = e.size.unwrap_or(self.config.unknown_size_bytes);
            let first = started == 0 && budget.at_least_one;
            if !first && bytes.saturating_add(size) > budget.bytes {
                break;
            }
            bytes = bytes.saturating_add(size);
            self.start_attempt(loc, pull_id, session.clone(), now, out);
            started += 1;
        }
    }

    /// [`Input::Release`] of one id: `true` when it was in flight.
    fn release(&mut self, delivery_id: &str, now: u64) -> bool {
        let Some(loc) = self.current(delivery_id) else {
            return false;
        };
        if !matches!(
            self.entries.get(&loc).map(|e| &e.status),
            Some(Status::InFlight { .. })
        ) {
            return false;
        }
        self.forget_id(loc);
        let Some(e) = self.entries.get_mut(&loc) else {
            return false;
        };
        // As after a failed persist: back to the previous count, so the next
        // hand-out is this attempt again (the store's record says this attempt, never
        // more). Due at once: `WaitingRetry` with a due time in the past.
        e.attempt = e.attempt.saturating_sub(1);
        e.delivery_id = None;
        e.session = None;
        self.set_status(loc, Status::WaitingRetry { due: now });
        true
    }

    /// Write-ahead: the record of attempt n+1 goes to the store first; the hand-out
    /// waits for `AttemptPersisted`.
    fn start_attempt(
        &mut self,
        loc: Loc,
        pull_id: PullId,
        session: Option<SessionBinding>,
        now: u64,
        out: &mut Out,
    ) {
        self.forget_id(loc);
        let Some(attempt) = self.entries.get(&loc).map(|e| e.attempt.saturating_add(1)) else {
            return;
        };
        let id = self.delivery_id(loc, attempt, session.as_ref());
        let deadline = now.saturating_add(self.config.ack_timeout_ms);
        let Some(e) = self.entries.get_mut(&loc) else {
            return;
        };
        e.attempt = attempt;
        let prev_id = e.delivery_id.replace(id);
        let prev_session = std::mem::replace(&mut e.session, session);
        e.first_at.get_or_insert(now);
        e.has_record = true;
        self.set_status(
            loc,
            Status::Persisting {
                pull_id,
                deadline,
                prev_id,
                prev_session,
            },
        );
        if let Some(record) = self.record(loc, DeliveryState::InFlight, deadline) {
            out.cmds.push(Command::PersistAttempt { pull_id, record });
        }
    }

    fn persisted(&mut self, offset: u64, attempt: u32, out: &mut Out) {
        let Some(loc) = self.persisting(offset, attempt) else {
            return;
        };
        let Some(e) = self.entries.get(&loc) else {
            return;
        };
        let Status::Persisting {
            pull_id, deadline, ..
        } = e.status
        else {
            return;
        };
        let delivery = Delivery {
            delivery_id: e.delivery_id.clone().unwrap_or_default(),
            offset,
            attempt,
            deadline_ms: deadline,
            session: e.session.clone(),
            redrive_of: e.redrive_of.clone(),
            parked: e.parked,
        };
        self.ids.insert(delivery.delivery_id.clone(), loc);
        self.set_status(
            loc,
            Status::InFlight {
                deadline,
                recovered: false,
            },
        );
        out.cmds.push(Command::HandOut { pull_id, delivery });
    }

    fn persist_failed(&mut self, offset: u64, attempt: u32, now: u64) {
        let Some(loc) = self.persisting(offset, attempt) else {
            return;
        };
        let Some(e) = self.entries.get_mut(&loc) else {
            return;
        };
        let Status::Persisting {
            prev_id,
            prev_session,
            ..
        } = e.status.clone()
        else {
            return;
        };
        // The attempt was never handed out: back to the previous count. Whatever the
        // store holds for it says at most `attempt`, so the next try (attempt again)
        // never goes below it. It stays due at once and counted against
        // `max_in_flight` (not pending): the store may hold its record, and recovery
        // would count that record as outstanding.
        e.attempt = attempt.saturating_sub(1);
        e.delivery_id = prev_id;
        e.session = prev_session;
        let status = Status::WaitingRetry { due: now };
        self.set_status(loc, status);
    }

    fn fenced(&self, loc: Loc, check: Option<&SessionCheck>) -> bool {
        let Some(bound) = self.entries.get(&loc).and_then(|e| e.session.as_ref()) else {
            return false;
        };
        !matches!(check, Some(c) if c.session_id == bound.session_id
            && c.current_epoch == Some(bound.epoch))
    }

    fn ack(&mut self, r: &DeliveryRef, now: u64, out: &mut Out) -> AckOutcome {
        let Some(loc) = self.current(&r.delivery_id) else {
            return AckOutcome::Unknown;
        };
        if self.fenced(loc, r.session.as_ref()) {
            return AckOutcome::Fenced;
        }
        self.forget_id(loc);
        let parked = self.entries.get(&loc).is_some_and(|e| e.parked);
        match loc {
            Loc::Window(_) if !parked => {
                self.set_status(loc, Status::Resolved { recorded: false });
                out.dirty.insert(loc);
            }
            // A redrive, or an event unparked in the window: its settlement is
            // written first.
            _ => {
                self.set_status(
                    loc,
                    Status::Settling {
                        outstanding: true,
                        retry_at: now,
                        failures: 0,
                    },
                );
                self.update(loc, DeliveryState::AckedAwaitingCommit, u64::MAX, out);
                self.emit_meta_write(loc, out);
            }
        }
        AckOutcome::Acked
    }

    fn nack(
        &mut self,
        r: &DeliveryRef,
        reason: &str,
        delay_ms: Option<u64>,
        now: u64,
        out: &mut Out,
    ) -> NackOutcome {
        let Some(loc) = self.current(&r.delivery_id) else {
            return NackOutcome::Unknown;
        };
        if self.fenced(loc, r.session.as_ref()) {
            return NackOutcome::Fenced;
        }
        match self.entries.get(&loc).map(|e| e.status.clone()) {
            Some(Status::InFlight { .. }) => self.fail(loc, reason, now, delay_ms, out),
            // Failed already (lease ran out): the retry stands.
            Some(Status::WaitingRetry { due }) => NackOutcome::Retrying { due_ms: due },
            _ => NackOutcome::Unknown,
        }
    }

    fn extend(&mut self, r: &DeliveryRef, ms: u64, now: u64, out: &mut Out) -> ExtendOutcome {
        let Some(loc) = self.current(&r.delivery_id) else {
            return ExtendOutcome::Unknown;
        };
        if self.fenced(loc, r.session.as_ref()) {
            return ExtendOutcome::Fenced;
        }
        let Some(Status::InFlight { deadline, .. }) =
            self.entries.get(&loc).map(|e| e.status.clone())
        else {
            // The lease already ended: there is nothing to extend.
            return ExtendOutcome::Unknown;
        };
        let deadline = deadline.max(now.saturating_add(ms));
        // A consumer holds it, so its end is an ordinary ack timeout (with backoff).
        self.set_status(
            loc,
            Status::InFlight {
                deadline,
                recovered: false,
            },
        );
        self.update(loc, DeliveryState::InFlight, deadline, out);
        ExtendOutcome::Extended {
            deadline_ms: deadline,
        }
    }

    fn meta_write_unavailable(&mut self, loc: Loc, now: u64) {
        let Some(status) = self.entries.get(&loc).map(|e| e.status.clone()) else {
            return;
        };
        let next = |failures: u32, jitter: &mut dyn crate::Jitter, backoff| {
            let failures = failures.saturating_add(1);
            let retry_at = now.saturating_add(backoff_delay(backoff, failures, jitter));
            (failures, retry_at)
        };
        let backoff = self.config.backoff;
        let status = match status {
            Status::DeadLettering { failures, .. } => {
                let (failures, retry_at) = next(failures, self.sources.jitter.as_mut(), backoff);
                Status::DeadLettering {
                    outstanding: false,
                    retry_at,
                    failures,
                }
            }
            Status::Settling { failures, .. } => {
                let (failures, retry_at) = next(failures, self.sources.jitter.as_mut(), backoff);
                Status::Settling {
                    outstanding: false,
                    retry_at,
                    failures,
                }
            }
            _ => return,
        };
        self.set_status(loc, status);
    }

    /// Moves the committed offset over the contiguous resolved prefix (one `Resolve`
    /// with the records it passes), then records `AckedAwaitingCommit` for what this
    /// call resolved above the gap.
    fn settle(&mut self, out: &mut Out) {
        let start = self.committed;
        let mut remove = Vec::new();
        while let Some(e) = self.entries.get(&Loc::Window(self.committed)) {
            if !matches!(e.status, Status::Resolved { .. }) {
                break;
            }
            if e.has_record {
                remove.push(self.committed);
            }
            self.remove_entry(Loc::Window(self.committed));
            match self.committed.checked_add(1) {
                Some(c) => self.committed = c,
                None => break,
            }
        }
        if self.committed != start {
            self.next_to_read = self.next_to_read.max(self.committed);
            self.log_end = self.log_end.max(self.next_to_read);
            out.cmds.push(Command::Resolve {
                remove,
                advance: Some(OffsetAdvance {
                    key: self.partition.key.clone(),
                    to: self.committed,
                }),
            });
        }
        for loc in std::mem::take(&mut out.dirty) {
            let needs = matches!(
                self.entries.get(&loc),
                Some(Entry {
                    status: Status::Resolved { recorded: false },
                    has_record: true,
                    ..
                })
            );
            if needs {
                self.update(loc, DeliveryState::AckedAwaitingCommit, u64::MAX, out);
                self.set_status(loc, Status::Resolved { recorded: true });
            }
        }
    }

    /// Asks for more of the log when there is room: no read outstanding, something to
    /// read, fewer than `max_in_flight` outstanding, and the window below its bound.
    fn maybe_read(&mut self, now: u64, out: &mut Out) {
        if self.reading.is_some() {
            return;
        }
        if let Some(t) = self.read_retry_at {
            if t > now {
                return;
            }
            self.read_retry_at = None;
        }
        if self.next_to_read >= self.log_end
            || self.index.outstanding >= self.config.max_in_flight
            || self.index.pending.len() >= self.config.max_pending
        {
            return;
        }
        let limit = self.committed.saturating_add(self.config.max_window as u64);
        if self.next_to_read >= limit {
            return;
        }
        let max = (limit - self.next_to_read)
            .min(self.log_end - self.next_to_read)
            .min(self.config.read_batch as u64) as usize;
        self.reading = Some((self.next_to_read, max));
        out.cmds.push(Command::ReadLog {
            from: self.next_to_read,
            max,
        });
    }
}
