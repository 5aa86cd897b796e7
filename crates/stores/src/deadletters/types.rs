//! What a dead-letter entry is: its state and the entry itself. The store and the
//! entry record (`entry`) both use them, so they live here, below both.

use crate::log::BodyRef;
use crate::time::Timestamp;
use std::fmt;

/// The state of an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadLetterState {
    /// Waiting for an operator: list, inspect, redrive or delete.
    Dead,
    /// Being delivered again; acked → deleted, failed again → `dead`.
    Redriving,
}

impl DeadLetterState {
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterState::Dead => "dead",
            DeadLetterState::Redriving => "redriving",
        }
    }
}

impl fmt::Display for DeadLetterState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One dead-lettered delivery, with its version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetterEntry {
    /// Derived from (log id, incarnation, topic, partition, offset): [`entry_id`](super::id::entry_id).
    pub id: String,
    /// The log the event was read from (instance id for an embedded log, the stream
    /// name for a shared one).
    pub log_id: String,
    pub subscription: String,
    pub subscription_incarnation: i64,
    pub topic: String,
    pub partition: u32,
    pub offset: u64,
    /// Where the event body is: the dead-letter stream of a log.
    pub body: BodyRef,
    pub attempts: u32,
    /// The last failure.
    pub reason: String,
    pub first_attempt_at: Timestamp,
    /// When it (last) became `dead`; retention counts from here.
    pub dead_lettered_at: Timestamp,
    /// The instance that dead-lettered it.
    pub instance: String,
    /// The partition owner's epoch that dead-lettered it.
    pub epoch: i64,
    pub state: DeadLetterState,
    pub redrives: u32,
    /// The entry record's Meta `mod_revision`.
    pub version: i64,
    /// Fields of the record a newer release wrote; written back by a rewrite.
    pub kept: crate::Kept,
}
