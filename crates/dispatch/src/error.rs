//! Misuse of the core: inputs that do not fit its state. On an error nothing changed
//! (inputs are checked before anything is applied), so the shell may log it and go on.

use crate::config::ConfigError;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CoreError {
    #[error(transparent)]
    Config(#[from] ConfigError),

    /// A recovered record belongs to another (subscription incarnation, topic,
    /// partition).
    #[error("record at offset {offset} belongs to another partition: {key}")]
    ForeignRecord { offset: u64, key: String },
    #[error("two recovered records for offset {offset}")]
    DuplicateRecord { offset: u64 },
    #[error("recovered record at offset {offset} is invalid: {reason}")]
    InvalidRecord { offset: u64, reason: String },

    /// `EventsRead` or `ReadFailed` without a `ReadLog` outstanding.
    #[error("no read is outstanding")]
    NoReadOutstanding,
    /// `EventsRead` that is not the answer to the outstanding `ReadLog { from, max }`.
    #[error("read answer does not fit ReadLog {{ from: {from}, max: {max} }}: {reason}")]
    ReadMismatch {
        from: u64,
        max: usize,
        reason: String,
    },

    #[error("pull asks for {max_events} events; at least 1")]
    InvalidPull { max_events: usize },
    #[error("ack_timeout_ms {ms} is outside 100–600000")]
    InvalidAckTimeout { ms: u64 },

    /// `AttemptPersisted` / `PersistFailed` for an attempt that is not being persisted.
    #[error("attempt {attempt} of offset {offset} is not being persisted")]
    NotPersisting { offset: u64, attempt: u32 },
    /// `DeadLettered` / `DeadLetterUnavailable` without a `DeadLetter` outstanding.
    #[error("no dead-letter write is outstanding for offset {offset}")]
    NotDeadLettering { offset: u64 },
    /// `RedriveSettled` / `RedriveUnavailable` without a redrive write outstanding.
    #[error("no redrive write is outstanding for offset {offset}")]
    NotSettling { offset: u64 },

    /// A redrive of an offset at or above the committed offset: that event is still
    /// being delivered normally (or the offset was reset below it).
    #[error("offset {offset} is not resolved (committed offset {committed}); cannot redrive")]
    RedriveOfUnresolvedOffset { offset: u64, committed: u64 },
    /// The entry id is not the one this partition derives for the offset.
    #[error(
        "dead-letter entry {entry_id} is not this partition's entry {expected} for the offset"
    )]
    ForeignDeadLetterEntry { entry_id: String, expected: String },
    /// As many redrives are under way as `max_in_flight`; try again later.
    #[error("{limit} redrives are under way on this partition; try again later")]
    RedriveBacklogFull { limit: usize },
    /// `Parked` for an offset whose `Park` is not outstanding.
    #[error("offset {offset} is not being parked")]
    NotParking { offset: u64 },
    /// `Unpark` for an offset that is being redriven from the dead-letter store.
    #[error("offset {offset} is being redriven, not unparked")]
    UnparkOfRedrive { offset: u64 },
    /// `Redrive` for an offset that is being unparked.
    #[error("offset {offset} is being unparked, not redriven")]
    RedriveOfParked { offset: u64 },
}
