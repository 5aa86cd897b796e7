//! What the runtime's calls take and answer: a pull's budget and its hand-outs, which
//! partitions a request reaches, and the per-id lists of an ack, nack or extend. Plain
//! data, shared by the partition tasks, the runtime and its callers (re-exported as
//! `meshd_runtime::runtime::{PullBudget, Handed, Reach, Answers, Outcome}`).

use meshd_dispatch::DeliveryId;

/// What one pull may take: events, bytes of stored events (the contract's
/// `max_bytes`), and whether the first ready delivery goes out whatever its size (so
/// an event larger than the budget is never stuck; off for the later parts of a pull
/// that already has deliveries).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PullBudget {
    pub max_events: usize,
    pub max_bytes: usize,
    pub at_least_one: bool,
}

impl PullBudget {
    pub fn new(max_events: usize, max_bytes: usize) -> Self {
        Self {
            max_events,
            max_bytes,
            at_least_one: true,
        }
    }

    /// What is left once `got` is taken; `None` when nothing more fits.
    pub fn after(&self, got: &[Handed]) -> Option<PullBudget> {
        let bytes: usize = got.iter().map(|h| h.body.len()).sum();
        let left = PullBudget {
            max_events: self.max_events.saturating_sub(got.len()),
            max_bytes: self.max_bytes.saturating_sub(bytes),
            at_least_one: self.at_least_one && got.is_empty(),
        };
        (left.max_events > 0 && (left.max_bytes > 0 || left.at_least_one)).then_some(left)
    }
}

/// One handed-out delivery with its event body (raw JSON, exactly as published).
#[derive(Debug)]
pub struct Handed {
    pub delivery_id: String,
    pub partition: u32,
    pub offset: u64,
    pub attempt: u32,
    pub body: Vec<u8>,
}

/// Which partitions a request reaches: all of them (in cluster mode the ones owned
/// elsewhere through their owners), or only this instance's (the internal routes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    Cluster,
    Local,
}

/// The offset a delivery id names.
pub fn offset_of(delivery_id: &str) -> Option<u64> {
    DeliveryId::parse(delivery_id).map(|d| d.offset)
}

/// Per-id answers of an ack, nack or extend, by the list they belong in.
#[derive(Default, Debug)]
pub struct Answers {
    pub lists: Vec<(Outcome, String)>,
}

/// Which list of an ack, nack or extend answer a delivery id is in (the contract's
/// list names, http-api.md "Consuming").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Acked,
    Unknown,
    Fenced,
    /// The ack could not be checked or recorded (a store was unavailable).
    Failed,
    Retrying,
    DeadLettered,
    /// The dead-letter entry is not durable yet; the partition keeps trying.
    DeadLettering,
    Extended,
}

impl Outcome {
    /// Every outcome, in the order an internal route's answer is read.
    pub const ALL: [Outcome; 8] = [
        Outcome::Acked,
        Outcome::Unknown,
        Outcome::Fenced,
        Outcome::Failed,
        Outcome::Retrying,
        Outcome::DeadLettered,
        Outcome::DeadLettering,
        Outcome::Extended,
    ];
    /// The lists of an ack answer.
    pub const ACK: [Outcome; 4] = [
        Outcome::Acked,
        Outcome::Unknown,
        Outcome::Fenced,
        Outcome::Failed,
    ];
    /// The lists of a nack answer.
    pub const NACK: [Outcome; 5] = [
        Outcome::Retrying,
        Outcome::DeadLettered,
        Outcome::DeadLettering,
        Outcome::Unknown,
        Outcome::Fenced,
    ];
    /// The lists of an extend answer.
    pub const EXTEND: [Outcome; 3] = [Outcome::Extended, Outcome::Unknown, Outcome::Fenced];

    /// The list's name in an answer.
    pub const fn as_str(self) -> &'static str {
        match self {
            Outcome::Acked => "acked",
            Outcome::Unknown => "unknown",
            Outcome::Fenced => "fenced",
            Outcome::Failed => "failed",
            Outcome::Retrying => "retrying",
            Outcome::DeadLettered => "dead_lettered",
            Outcome::DeadLettering => "dead_lettering",
            Outcome::Extended => "extended",
        }
    }

    /// Whether a nack answered with it was a nack that counted.
    pub fn is_nacked(self) -> bool {
        matches!(
            self,
            Outcome::Retrying | Outcome::DeadLettered | Outcome::DeadLettering
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_ids_name_their_offset() {
        assert_eq!(offset_of("42-3-17-2-00000000000000ff"), Some(17));
        assert_eq!(offset_of("42-3-17-r1-00000000000000ff"), Some(17));
        assert_eq!(offset_of("garbage"), None);
    }
}
