//! # The sans-IO delivery core
//!
//! One [`PartitionCore`] per (subscription incarnation, topic, partition) decides
//! everything about at-least-once delivery: what to read, what to hand out, when to
//! retry, when to dead-letter, how far the committed offset moves. It does no I/O and
//! has no async (house style 10): it takes [`Input`]s (events read, pulls, acks,
//! nacks, store results, time) and returns [`Command`]s (read the log, persist an
//! attempt, hand out, update, resolve, dead-letter, reply). A thin async shell executes
//! the commands against the stores, in order, and feeds the results back. Time is an
//! input (`now_ms`); [`PartitionCore::next_wakeup`] says when to tick.
//!
//! ## The rules, and the failure each one is built against
//!
//! * **Write-ahead attempts.** A hand-out is two steps: [`Command::PersistAttempt`]
//!   with `attempt + 1`, and only after [`Input::AttemptPersisted`] the
//!   [`Command::HandOut`]. A crash between the two leaves a durable record with the
//!   higher count, so a crash can burn an attempt but never reset one. `attempt` is 1
//!   on the first hand-out and grows only with hand-outs; every attempt gets a fresh
//!   delivery id ([`IdSource`]).
//! * **Order without head-of-line blocking.** A pull takes the lowest ready offsets:
//!   pending ones and retries whose backoff has passed. A retry waiting for its backoff
//!   is not ready, so later offsets go out meanwhile.
//! * **The committed offset is the lowest unresolved offset.** An ack of the lowest
//!   moves it over the contiguous resolved prefix with one [`Command::Resolve`] (records
//!   removed and offset advanced in one store batch). An ack above a gap is recorded as
//!   `AckedAwaitingCommit` (so a crash cannot redeliver it) and removed by the `Resolve`
//!   that closes the gap. Events the filter rejects are resolved without delivery.
//! * **Failures back off, then dead-letter.** A nack or a lease that ran out is retried
//!   after `initial_ms * 2^(attempt-1)` capped at `max_ms`, with equal jitter
//!   ([`config::backoff_delay`]). The `max_attempts`-th failure emits
//!   [`Command::DeadLetter`]; the delivery stays `DeadLettering` (held: neither lost
//!   nor redelivered) until the shell reports [`Input::DeadLettered`] (then it is
//!   resolved like an ack) or [`Input::DeadLetterUnavailable`] (asked again after a
//!   backoff).
//! * **Sessions fence stale consumers.** A pull may bind its deliveries to a session
//!   (id, epoch); an ack, nack or extend of a bound delivery must come with a
//!   [`SessionCheck`] that vouches for that session at that epoch, or it is `Fenced`.
//!   The shell fills the check from its SessionStore cache; the core needs no I/O.
//! * **Bounded memory.** At most `max_in_flight` deliveries are persisting, in flight,
//!   waiting or being dead-lettered; beyond that nothing new is read or handed out. The
//!   events read ahead are bounded by `max_window` from the committed offset.
//! * **Recovery** ([`PartitionCore::recover`]) rebuilds the state from the committed
//!   offset and the delivery records: leases are due at their persisted deadline,
//!   retries at their due time, `AckedAwaitingCommit` is never redelivered,
//!   `DeadLettering` re-emits its `DeadLetter`, offsets without a record are delivered
//!   again from attempt 1, and attempt counts continue.
//! * **Redrive** ([`Input::Redrive`]) delivers a dead-lettered event again with a fresh
//!   attempt count, tied to its dead-letter entry: acked → [`Command::RedriveSucceeded`],
//!   failed `max_attempts` times → [`Command::RedriveFailed`]. It never touches the
//!   committed offset (that offset was resolved by the dead-lettering).
//! * **Parking** (http-api.md, "Parking"): an event read with a `deliverat`
//!   ([`EventMeta::deliver_at_ms`]) later than now is not handed out: the core emits
//!   [`Command::Park`] and, once the shell reports the park entry durable
//!   ([`Input::Parked`]), counts the offset as resolved, so `committed` moves past a
//!   delayed event instead of waiting for it. When it is due the shell feeds
//!   [`Input::Unpark`]; the event is then delivered below `committed` the way a
//!   redrive is (write-ahead attempts, leases, retries), or, when `committed` has
//!   not passed it yet (an earlier offset is unresolved), from its window entry,
//!   which holds `committed` again until it is settled: a due event never waits for
//!   the offsets before it. Either way it is settled in the park index:
//!   [`Command::ParkSettled`] when acked, [`Command::ParkDeadLetter`] at
//!   `max_attempts`. Recovery tells unparked deliveries from redrives by the park
//!   index (`recover`'s `parked`), and the ack of one unparked in the window from a
//!   parked retry's mark by the attempts its park entry holds. A parking event is
//!   bounded by the window, not by `max_in_flight`.
//!
//! The tests under `tests/` pin each rule as a story, and `tests/model.rs` drives
//! random input sequences (with crashes, lost unflushed updates and recoveries)
//! against a model of the durable records, checking the invariants after every step.
//!
//! ## Protocol notes for the shell
//!
//! * Execute commands in the order returned, one store write after the other per
//!   partition, and feed every result back ([`Command`] says which input answers what).
//!   The core does not need a `PersistAttempt`'s answer before its next input: a shell
//!   whose store applies writes in submission order (and makes a write durable only
//!   with every earlier one) may submit attempt records, go on feeding other inputs,
//!   and feed `AttemptPersisted` once they are durable; it hands out only then.
//! * A pull's deliveries arrive as one `PersistAttempt` per event in the output of the
//!   `Pull` input (count them), then one `HandOut` per `AttemptPersisted`. Long polls
//!   are the shell's: pull again when [`PartitionCore::ready`] turns positive.
//! * The core keeps no event bodies: read them by offset (or from the DeadLetterStore
//!   for a redrive, [`Delivery::redrive_of`]).
//! * After a store write failed (the store fail-stops), stop feeding the core; a
//!   restart recovers it from what is durable.

pub mod config;
mod core;
mod error;
mod id;
mod io;
mod sources;

pub use crate::config::{Config, ConfigError};
pub use crate::core::{Partition, PartitionCore, Stats, ACK_TIMEOUT_REASON, MAX_ATTEMPTS_REASON};
pub use crate::error::CoreError;
pub use crate::id::DeliveryId;
pub use crate::io::{
    AckOutcome, Command, DeadLetterRequest, Delivery, DeliveryRef, EventMeta, ExtendOutcome, Input,
    NackOutcome, PullId, Reply, SessionCheck,
};
pub use crate::sources::{
    FixedJitter, IdFields, IdKey, IdSource, Jitter, MacIds, RngJitter, SequentialIds, Sources,
};

/// Re-exported store types the inputs and commands carry.
pub use meshd_stores::delivery::{DeliveryRecord, DeliveryState, OffsetAdvance, SessionBinding};
pub use meshd_stores::offsets::OffsetKey;
