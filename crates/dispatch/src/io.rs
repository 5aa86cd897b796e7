//! What goes into the core ([`Input`]) and what comes out ([`Command`]).

use meshd_stores::delivery::{DeliveryRecord, OffsetAdvance, SessionBinding};

/// Names one pull (or one push worker's request) so hand-outs find their way back to
/// it. Chosen by the shell; the core only echoes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PullId(pub u64);

/// What the core needs of an event: its offset and what the filter looks at. The body
/// stays with the shell (it reads it by offset for a hand-out or a dead-letter).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventMeta {
    pub offset: u64,
    /// The string forms of the event's context attributes and extensions, for the
    /// subscription's selector (the shell fills them only for a subscription with a
    /// filter, shared with the other subscriptions that read the event). An attribute
    /// the event lacks is absent.
    pub attributes: meshd_stores::subscriptions::AttributeIndex,
    /// The event's stored size in bytes: what a pull's byte budget counts.
    pub size: u64,
    /// Not to be handed out before this (unix ms; the event's `deliverat`): a later
    /// time parks the event ([`Command::Park`]).
    pub deliver_at_ms: Option<u64>,
    /// Ordered delivery (`Config::ordered`): the hash of the event's `partitionkey`
    /// (`None`: it has none, and is not held). The shell fills it only for an
    /// ordered subscription.
    pub key: Option<u64>,
    /// The park index held an entry of `key` when the event was read (the shell looks
    /// it up with the read): the event parks behind it.
    pub key_parked: bool,
}

impl EventMeta {
    /// An attribute's string form, `None` when the event (or the extraction) lacks it.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes.get(name)
    }
}

/// What the shell knows *now*, from its SessionStore cache, about the session a
/// delivery is bound to (look the binding up with
/// [`crate::PartitionCore::bound_session`], or pass the session the request names).
///
/// A delivery bound to a session is acked, nacked or extended only when the check
/// names that session and reports its epoch as the one the delivery was bound under;
/// anything else is `Fenced`: a missing check, another session, a taken-over or
/// expired session (`current_epoch: None`) or a different epoch. Failing closed costs a
/// redelivery at worst; failing open would let a zombie consumer resolve work its
/// successor now owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionCheck {
    pub session_id: String,
    /// `None` when the session is fenced (taken over), expired or unknown.
    pub current_epoch: Option<i64>,
}

/// One delivery id in an ack, nack or extend, with the session check for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryRef {
    pub delivery_id: String,
    pub session: Option<SessionCheck>,
}

impl DeliveryRef {
    /// A delivery that was not bound to a session (or a check that is absent).
    pub fn unbound(delivery_id: impl Into<String>) -> Self {
        Self {
            delivery_id: delivery_id.into(),
            session: None,
        }
    }

    pub fn checked(delivery_id: impl Into<String>, session: SessionCheck) -> Self {
        Self {
            delivery_id: delivery_id.into(),
            session: Some(session),
        }
    }
}

/// Everything that can happen to a partition core. Time comes with every input
/// (`handle(input, now_ms)`); `Tick` exists only to let time pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// The partition log's durable end (the next offset to be written). Only grows.
    LogEnd(u64),
    /// The answer to the outstanding [`Command::ReadLog`]: events from its `from` on,
    /// contiguous, at most `max` (fewer is fine; none means the log has nothing there).
    EventsRead(Vec<EventMeta>),
    /// The outstanding read failed; the core asks again after `read_retry_ms`.
    ReadFailed,
    /// Ordered delivery, once after recovery: the keys whose first park entry is held
    /// ([`meshd_stores::park::ParkIndex::held_keys`]). Each waits for an event of the
    /// delivery window or for a release a crash cut off: once the core has read past
    /// every recovered record (and so knows their keys), it releases those no window
    /// event holds ([`Command::ReleaseKey`]).
    KeysHeld(Vec<u64>),
    /// A consumer asks for up to `max_events` deliveries. The answer comes as
    /// [`Command::PersistAttempt`]s tagged with `pull_id` (count them), then one
    /// [`Command::HandOut`] per [`Input::AttemptPersisted`]. When `session` is given,
    /// the deliveries are bound to it.
    ///
    /// Deliveries are taken in order until the next one would pass `max_events` or
    /// `max_bytes` (counted over stored sizes); with `at_least_one`, the first ready
    /// delivery is taken whatever its size, so an event larger than the budget is
    /// never stuck. Only what is taken is counted as an attempt.
    Pull {
        pull_id: PullId,
        max_events: usize,
        max_bytes: u64,
        at_least_one: bool,
        session: Option<SessionBinding>,
    },
    /// The record of [`Command::PersistAttempt`] is durable: hand it out.
    AttemptPersisted { offset: u64, attempt: u32 },
    /// The record could not be written (the store failed): the attempt was not made.
    /// The offset is due again at once with its previous attempt count, still counted
    /// against `max_in_flight`. (Whatever the store holds has at most this attempt, so
    /// no count can go back.)
    PersistFailed { offset: u64, attempt: u32 },
    /// Acks, answered by one [`Reply::Ack`] each; resolutions of this batch share one
    /// [`Command::Resolve`].
    Ack(Vec<DeliveryRef>),
    /// Failed deliveries (a consumer's nack, a webhook's failure), with the reason.
    /// Each is retried after `delay_ms` when given, instead of the backoff (it still
    /// counts as a failed attempt: the `max_attempts`-th is dead-lettered).
    Nack {
        deliveries: Vec<DeliveryRef>,
        reason: String,
        delay_ms: Option<u64>,
    },
    /// Pushes the leases of these attempts out to `now + ack_timeout_ms` (never
    /// shortens one).
    Extend {
        deliveries: Vec<DeliveryRef>,
        ack_timeout_ms: u64,
    },
    /// Hand-outs that never reached a consumer (an answer forwarded between
    /// instances that could not be delivered). Each one still current and in flight
    /// is due again at once, and its attempt did not count: the next hand-out carries
    /// the same attempt number (never lower than the record the store holds, as after
    /// [`Input::PersistFailed`]), so repeated failures to deliver an answer never
    /// dead-letter an event nobody received. One [`Reply::Release`] per id.
    Release(Vec<String>),
    /// Time passed (see [`crate::PartitionCore::next_wakeup`]).
    Tick,
    /// The [`Command::DeadLetter`] for this offset is durable in the DeadLetterStore
    /// (created now, or found from an earlier try).
    DeadLettered { offset: u64 },
    /// The [`Command::DeadLetter`] could not be written (Meta unavailable, an
    /// indeterminate outcome, a failing body stream): the delivery stays held and the
    /// core asks again after a backoff.
    DeadLetterUnavailable { offset: u64 },
    /// Deliver a dead-lettered event again, with a fresh attempt count, for the entry
    /// `entry_id` (already moved to `redriving` by the shell). The offset must be below
    /// the committed offset (it was resolved by its dead-lettering) and the id must be
    /// the entry id of this partition's `(log id, incarnation, topic, partition,
    /// offset)`: that is how recovery finds the entry again from the record alone.
    /// Repeating it while the redrive is under way changes nothing (the shell may
    /// re-inject every `redriving` entry after a restart).
    Redrive { entry_id: String, offset: u64 },
    /// The [`Command::RedriveSucceeded`] or [`Command::RedriveFailed`] of this offset
    /// is durable in the DeadLetterStore (for `redrive_succeeded`, `NotFound` counts).
    RedriveSettled { offset: u64 },
    /// ... or could not be written: held, asked again after a backoff.
    RedriveUnavailable { offset: u64 },
    /// The park entry of [`Command::Park`] is durable: the offset counts as resolved
    /// (the committed offset may pass it).
    Parked { offset: u64 },
    /// A parked event is due (the shell found it in the park index): deliver it below
    /// the committed offset like a redrive, its attempt count continuing from
    /// `attempt`. Settled with [`Command::ParkSettled`] (acked) or
    /// [`Command::ParkDeadLetter`] (failed `max_attempts` times), each answered by
    /// [`Input::RedriveSettled`] or [`Input::RedriveUnavailable`]. At or above the
    /// committed offset (parked above a gap) it is handed out from its window entry,
    /// which must be resolved (by the parking); its attempts continue the larger of
    /// `attempt` and its record's. Repeating it while it is under way changes
    /// nothing.
    Unpark { offset: u64, attempt: u32 },
}

/// One hand-out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub delivery_id: String,
    pub offset: u64,
    /// 1 on the first hand-out; grows only with real hand-outs.
    pub attempt: u32,
    /// The lease ends here (unix ms) unless extended.
    pub deadline_ms: u64,
    pub session: Option<SessionBinding>,
    /// `Some(entry id)` for a redriven event: its body is read from the
    /// DeadLetterStore, not from the log.
    pub redrive_of: Option<String>,
    /// An unparked event ([`Input::Unpark`]): its body is read from the park index,
    /// not from the log (retention may have removed it there).
    pub parked: bool,
}

/// What the shell hands to [`meshd_stores::deadletters::DeadLetterStore::dead_letter`]
/// (with the body it reads from the log at `offset`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterRequest {
    pub offset: u64,
    pub attempts: u32,
    pub reason: String,
    pub first_attempt_at_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AckOutcome {
    Acked,
    /// Not a current attempt (never handed out, superseded, already resolved, being
    /// dead-lettered): nothing changed.
    Unknown,
    /// Bound to a session the check does not vouch for: nothing changed.
    Fenced,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NackOutcome {
    /// Handed out again from `due_ms` on.
    Retrying {
        due_ms: u64,
    },
    /// The last attempt failed: a [`Command::DeadLetter`] (or, for a redrive,
    /// [`Command::RedriveFailed`]) is under way. The HTTP answer says `dead_lettered`
    /// once the shell has written it, `dead_lettering` while it cannot.
    DeadLettering,
    Unknown,
    Fenced,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtendOutcome {
    Extended { deadline_ms: u64 },
    Unknown,
    Fenced,
}

/// The answer for one delivery id of an ack, nack or extend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    Ack {
        delivery_id: String,
        outcome: AckOutcome,
    },
    Nack {
        delivery_id: String,
        outcome: NackOutcome,
    },
    Extend {
        delivery_id: String,
        outcome: ExtendOutcome,
    },
    /// `released`: the id was in flight and is due again; otherwise nothing changed.
    Release { delivery_id: String, released: bool },
}

/// What the shell must do. **Execute them in the order given**, each store write
/// finished before the next begins (one writer per partition): a record's `Update`
/// may precede the `Resolve` that removes it, and reordering the two would leave a
/// stale record behind. Replies come after the store writes they depend on, so
/// answering them in order answers only what has been written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Read up to `max` events from `from` and answer with [`Input::EventsRead`] (or
    /// [`Input::ReadFailed`]). At most one read is outstanding.
    ReadLog { from: u64, max: usize },
    /// `DeliveryStateStore::record_attempt(record)` (durable before it returns), then
    /// [`Input::AttemptPersisted`]. Records of one `pull_id` may share one batch.
    PersistAttempt {
        pull_id: PullId,
        record: DeliveryRecord,
    },
    /// Give this delivery to the pull `pull_id` (a pull that is gone by now just drops
    /// it: the lease runs out and the event is retried).
    HandOut { pull_id: PullId, delivery: Delivery },
    /// `DeliveryStateStore::update(record)`.
    Update(DeliveryRecord),
    /// `DeliveryStateStore::resolve(remove (with the partition's key), advance)`: one
    /// atomic batch.
    Resolve {
        remove: Vec<u64>,
        advance: Option<OffsetAdvance>,
    },
    /// `DeadLetterStore::dead_letter(...)`, then [`Input::DeadLettered`] or
    /// [`Input::DeadLetterUnavailable`].
    DeadLetter(DeadLetterRequest),
    /// `DeadLetterStore::redrive_succeeded(entry_id)`, then [`Input::RedriveSettled`] or
    /// [`Input::RedriveUnavailable`].
    RedriveSucceeded { entry_id: String, offset: u64 },
    /// `DeadLetterStore::redrive_failed(entry_id, reason, attempts)`, then
    /// [`Input::RedriveSettled`] or [`Input::RedriveUnavailable`].
    RedriveFailed {
        entry_id: String,
        offset: u64,
        reason: String,
        attempts: u32,
    },
    /// Park the event at `offset` (window) until `due_ms`: write its park entry, with
    /// the body read from the log and `attempt` (the attempts made so far: 0 for an
    /// event read with a later `deliverat`, more for a retry due far ahead), durably,
    /// then [`Input::Parked`]. The shell feeds [`Input::Unpark`] once it is due.
    ///
    /// Ordered delivery: `key` is the event's key hash (its entry holds the key);
    /// `due_ms` is [`meshd_stores::park::HELD`] for an event parked behind its key,
    /// with its own `deliverat` in `not_before_ms` (0: none).
    Park {
        offset: u64,
        due_ms: u64,
        attempt: u32,
        key: Option<u64>,
        not_before_ms: u64,
    },
    /// Ordered delivery: the window holds no event of `key` any more (acked,
    /// dead-lettered or parked). Once every delivery record written so far is durable,
    /// `ParkIndex::release_key`: the next event of the key, when it is held in the
    /// park index, becomes due.
    ReleaseKey { key: u64 },
    /// An unparked event failed and is retried at `due_ms`, far ahead
    /// (`park_retries_after_ms`): once the delivery records written so far are
    /// durable, its park entry takes `due_ms` and `attempt` (the attempts made), then
    /// [`Input::RedriveSettled`] (the core lets it go until the shell unparks it
    /// again), or [`Input::RedriveUnavailable`] (tried again after a backoff).
    Repark {
        offset: u64,
        due_ms: u64,
        attempt: u32,
    },
    /// An unparked event was acked: remove its park entry, then
    /// [`Input::RedriveSettled`] (or [`Input::RedriveUnavailable`]).
    ParkSettled { offset: u64 },
    /// An unparked event failed `max_attempts` times: write its dead-letter entry with
    /// the body of its park entry and remove that entry, then [`Input::RedriveSettled`]
    /// (or [`Input::RedriveUnavailable`] when the dead-letter write failed).
    ParkDeadLetter(DeadLetterRequest),
    /// An answer to the caller of an ack, nack or extend.
    Reply(Reply),
}
