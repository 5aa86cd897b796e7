//! What a task is: its states, its history, its assignee and the task itself. The
//! store, its record (`record`) and its state machine ([`table`](super::table)) all
//! use them, so they live here, below all three.

use crate::time::Timestamp;
use serde_json::Value;
use std::fmt;

/// The states of a task (`kebab-case` on the wire and in records).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TaskState {
    Submitted,
    Working,
    InputRequired,
    Completed,
    Failed,
    Canceled,
    Rejected,
}

impl TaskState {
    pub const ALL: [TaskState; 7] = [
        TaskState::Submitted,
        TaskState::Working,
        TaskState::InputRequired,
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Canceled,
        TaskState::Rejected,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Submitted => "submitted",
            TaskState::Working => "working",
            TaskState::InputRequired => "input-required",
            TaskState::Completed => "completed",
            TaskState::Failed => "failed",
            TaskState::Canceled => "canceled",
            TaskState::Rejected => "rejected",
        }
    }

    /// `completed`, `failed`, `canceled`, `rejected`: final.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Completed | TaskState::Failed | TaskState::Canceled | TaskState::Rejected
        )
    }

    /// `working` or `input-required`: the task has an assignee.
    pub fn is_claimed(self) -> bool {
        matches!(self, TaskState::Working | TaskState::InputRequired)
    }
}

impl fmt::Display for TaskState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One entry of a task's history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryEntry {
    pub state: TaskState,
    pub at: Timestamp,
}

/// The session a task is assigned to, as recorded in the task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignee {
    pub session: String,
    /// The session's epoch when it claimed the task.
    pub epoch: i64,
    pub client_id: String,
    /// The session's Meta key (UTF-8), so the runtime can tell whether the session
    /// still holds `epoch` without knowing the session store's key layout.
    pub session_key: String,
}

/// A task as stored, with its version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Task {
    pub id: String,
    pub agent: String,
    pub state: TaskState,
    pub input: Value,
    pub output: Option<Value>,
    /// Every state the task entered, oldest first; the first entry (`submitted`) and
    /// the most recent [`TaskStoreConfig::max_history`](super::TaskStoreConfig::max_history) − 1 are kept.
    pub history: Vec<HistoryEntry>,
    /// Set by a claim; cleared by a requeue; kept (for the record) in terminal states.
    pub assignee: Option<Assignee>,
    pub created_at: Timestamp,
    /// The record's Meta `mod_revision`: the task's ETag.
    pub version: i64,
    /// Fields of the record a newer release wrote; written back by every transition.
    pub kept: crate::Kept,
}

impl Task {
    /// When the task entered its current state.
    pub fn updated_at(&self) -> Timestamp {
        self.history.last().map(|h| h.at).unwrap_or(self.created_at)
    }

    /// This task moved to `to` at `at` (history capped at `max_history` entries).
    pub(super) fn moved(&self, to: TaskState, at: Timestamp, max_history: usize) -> Task {
        let mut next = self.clone();
        next.state = to;
        next.history.push(HistoryEntry { state: to, at });
        let len = next.history.len();
        if len > max_history {
            // Keep the first entry (when it was submitted) and the latest ones.
            next.history.drain(1..=len - max_history);
        }
        next
    }
}
