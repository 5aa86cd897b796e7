//! # TaskStore: agent-to-agent work items on Meta
//!
//! A task is submitted for an agent, claimed by one of the agent's sessions, moved
//! through an explicit state machine ([`table`]) and kept until retention after it
//! reached a terminal state. Every task is one Meta key, `meshd/v1/tasks/{id}`, whose
//! value is a versioned JSON record (`record`); the task's `version` (its ETag) is
//! that key's Meta `mod_revision`.
//!
//! The failures this module is built against, each pinned by a test in
//! `crates/stores/tests/tasks.rs` on both Meta backends:
//!
//! * **A submit is acknowledged only when durable.** The create is a conditional
//!   (absent) Meta write; `Ok` from it is the only way to get `created == true`. Meta
//!   down gives `Unavailable`, a lost answer `Indeterminate`; neither is ever turned
//!   into a success, and a retry with the same id is idempotent.
//! * **A late or stale writer never overwrites a newer state.** Every write is
//!   conditional on the version it was decided on, so a terminal state is final.
//! * **A taken-over assignee is fenced.** A write on behalf of a session compares the
//!   session key's `mod_revision` with the session's epoch in the same transaction
//!   ([`meshd_meta::fence`]); after a takeover the old session's writes fail `Fenced`.

mod record;
pub mod table;
mod types;
pub mod usage;

pub use types::{Assignee, HistoryEntry, Task, TaskState};

pub use crate::time::Timestamp;

use crate::codec::key_text;
use crate::failure::StoreFailure;
use crate::meta_util::{after, commit_at_version, FromMeta, PrefixPages, MAX_CAS_ATTEMPTS};
use async_trait::async_trait;
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{KeyValue, Meta, MetaError, Precondition, Txn};
use serde_json::Value;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;
use table::{Refusal, Via};

/// The store's name in logs and metrics.
const STORE: &str = "tasks";

/// Keys read per Meta range request while listing (task records can be large).
const SCAN_PAGE: usize = 64;

/// At most this many keys (or `limit`, when larger) are examined by one filtered
/// `list` call; a sparse filter then answers a short page with a `next_cursor`.
const SCAN_BUDGET: usize = 1000;

/// The largest `limit` of a list.
pub const MAX_LIST_LIMIT: usize = 1000;

impl FromStr for TaskState {
    type Err = TaskError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TaskState::ALL
            .into_iter()
            .find(|state| state.as_str() == s)
            .ok_or_else(|| TaskError::Invalid(format!("unknown task state {s:?}")))
    }
}

/// A session acting on a task, as the caller (the HTTP layer, which got it from the
/// SessionStore) knows it. Writes made with it are fenced: they compare
/// `session_key`'s `mod_revision` with `epoch` in the same Meta transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AssigneeRef {
    pub session_id: String,
    /// The session's Meta key (must be UTF-8).
    pub session_key: Vec<u8>,
    /// The session key's `mod_revision` when the session was opened.
    pub epoch: i64,
    /// The session's client id; it must be the task's agent to claim it.
    pub client_id: String,
}

impl AssigneeRef {
    fn ownership(&self) -> Ownership {
        Ownership::from_parts(self.session_key.clone(), self.epoch, None)
    }

    fn is(&self, assignee: &Assignee) -> bool {
        assignee.session == self.session_id && assignee.epoch == self.epoch
    }
}

/// The answer of [`TaskStore::submit`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Submitted {
    pub task: Task,
    /// `true` when this call created the task (HTTP 201), `false` when a task with the
    /// same id and content already existed (HTTP 200).
    pub created: bool,
}

/// Which tasks a [`TaskStore::list`] returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TaskFilter {
    pub agent: Option<String>,
    pub state: Option<TaskState>,
}

/// One page of tasks, in id order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskPage {
    pub tasks: Vec<Task>,
    /// Pass it back as `cursor` for the next page; `None` on the last page. A page may
    /// be shorter than `limit` (even empty) and still have a next cursor when a
    /// filter matched few of the tasks examined.
    pub next_cursor: Option<String>,
}

/// The cursor that continues a listing after `task` (what `next_cursor` holds when a
/// page ends there; a caller that stops early, e.g. at a byte bound, makes its own).
pub fn cursor_after(task: &Task) -> String {
    task.id.clone()
}

/// The answer of [`TaskStore::requeue_if_assignee`]. Only `Requeued` changed anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Requeue {
    /// The task was `working` or `input-required` for that session epoch, which is
    /// gone; it is `submitted` again, without an assignee.
    Requeued(Task),
    /// The task is not (any more) claimed by that session epoch.
    NotAssigned(Task),
    /// That session still holds that epoch: the task stays with it.
    AssigneeLive(Task),
}

/// Limits of the task store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TaskStoreConfig {
    /// Largest task input, in bytes of its JSON (HTTP 413 beyond). Default 256 KiB.
    pub max_input_bytes: usize,
    /// Largest task output, in bytes of its JSON (HTTP 413 beyond). Default 256 KiB.
    pub max_output_bytes: usize,
    /// History entries kept per task (the first and the latest). Default 64.
    pub max_history: usize,
}

impl TaskStoreConfig {
    /// Input plus output must leave room in etcd's ~1.5 MiB request limit.
    pub const MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

    pub fn validate(&self) -> Result<(), TaskConfigError> {
        if self.max_input_bytes == 0 {
            return Err(TaskConfigError::new(
                "max_input_bytes",
                self.max_input_bytes,
                "must be at least 1",
            ));
        }
        if self.max_output_bytes == 0 {
            return Err(TaskConfigError::new(
                "max_output_bytes",
                self.max_output_bytes,
                "must be at least 1",
            ));
        }
        let sum = self.max_input_bytes.saturating_add(self.max_output_bytes);
        if sum > Self::MAX_PAYLOAD_BYTES {
            return Err(TaskConfigError::new(
                "max_input_bytes + max_output_bytes",
                sum,
                "must be at most 1048576 (a task record must fit in one Meta request)",
            ));
        }
        if !(2..=1000).contains(&self.max_history) {
            return Err(TaskConfigError::new(
                "max_history",
                self.max_history,
                "must be 2 to 1000",
            ));
        }
        Ok(())
    }
}

impl Default for TaskStoreConfig {
    fn default() -> Self {
        Self {
            max_input_bytes: 256 * 1024,
            max_output_bytes: 256 * 1024,
            max_history: 64,
        }
    }
}

/// A bad [`TaskStoreConfig`] value, named.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid task store configuration: {field} = {value}: {reason}")]
pub struct TaskConfigError {
    pub field: &'static str,
    pub value: usize,
    pub reason: &'static str,
}

impl TaskConfigError {
    fn new(field: &'static str, value: usize, reason: &'static str) -> Self {
        Self {
            field,
            value,
            reason,
        }
    }
}

/// What can go wrong with a task operation, and what the caller does about it. The
/// HTTP status each maps to is in parentheses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TaskError {
    /// The acting session no longer holds its epoch (taken over or expired). Nothing
    /// was applied; the session must not act on the task any more. (HTTP 409 fenced)
    #[error("fenced: the session no longer holds this epoch")]
    Fenced,
    /// `If-Match` named another version than the task's current one. Re-read. (HTTP 412)
    #[error("version mismatch: the task is at version {current}")]
    VersionMismatch { current: i64 },
    /// No task with this id. (HTTP 404)
    #[error("task {id} not found")]
    NotFound { id: String },
    /// A task with this id exists with another agent or input. (HTTP 409)
    #[error("task {id} already exists with other content")]
    ConflictingContent { id: String },
    /// The state machine forbids it ([`table`]); terminal states are final. (HTTP 422)
    #[error("illegal task transition {from} -> {to}")]
    IllegalTransition { from: TaskState, to: TaskState },
    /// A claim of a task another session already holds. (HTTP 409)
    #[error("task already claimed by session {} (epoch {})", assignee.session, assignee.epoch)]
    AlreadyClaimed { assignee: Assignee },
    /// A transition of a claimed task by a session that is not its assignee. (HTTP 409)
    #[error("session {session} is not the assignee of task {id}")]
    NotAssignee { id: String, session: String },
    /// The session's client id is not the task's agent. (HTTP 403)
    #[error("client {client_id} may not act on tasks of agent {agent}")]
    Forbidden { client_id: String, agent: String },
    /// Input or output is larger than the configured limit. (HTTP 413)
    #[error("task {what} of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        what: &'static str,
        size: usize,
        limit: usize,
    },
    /// A malformed request (bad id, agent, cursor, limit). Do not retry. (HTTP 400)
    #[error("invalid task request: {0}")]
    Invalid(String),
    /// The backend failed; [`StoreFailure`] says what the caller may assume.
    #[error("task store {0}")]
    Store(#[from] StoreFailure),
}

impl TaskError {
    /// A short, stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Store(f) => f.kind(),
            TaskError::Fenced => "fenced",
            TaskError::VersionMismatch { .. } => "version_mismatch",
            TaskError::NotFound { .. } => "not_found",
            TaskError::ConflictingContent { .. } => "conflicting_content",
            TaskError::IllegalTransition { .. } => "illegal_transition",
            TaskError::AlreadyClaimed { .. } => "already_claimed",
            TaskError::NotAssignee { .. } => "not_assignee",
            TaskError::Forbidden { .. } => "forbidden",
            TaskError::TooLarge { .. } => "too_large",
            TaskError::Invalid(_) => "invalid",
        }
    }

    /// Known not applied and safe to retry as is.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Store(f) if f.is_retryable())
    }
}

impl FromMeta for TaskError {
    fn special(e: MetaError) -> Result<Self, MetaError> {
        match e {
            MetaError::Fenced => Ok(TaskError::Fenced),
            MetaError::Conflict { current } => Ok(TaskError::VersionMismatch {
                current: current.map(|kv| kv.mod_revision).unwrap_or(0),
            }),
            e => Err(e),
        }
    }
}

/// The task store.
///
/// # Durability
///
/// Every method that changes a task returns `Ok` only after Meta acknowledged the
/// write, which makes it durable (an etcd quorum commit or an fsync of the embedded
/// backend). A returned [`Task`] carries the version of that write.
///
/// # Concurrency
///
/// Any number of callers, on any number of instances, may call any method for the
/// same task at once. Every write is a Meta transaction conditional on the version the
/// decision was made on; a loser re-reads and decides again (or, when the caller gave
/// an expected version, gets [`TaskError::VersionMismatch`]). Writes on behalf of a
/// session are also fenced by that session's epoch. So: a claim has exactly one
/// winner, a terminal state is never overwritten, and a stale session never writes.
///
/// # Errors: what to do
///
/// * `Unavailable`: not applied; retry later (HTTP 503 with `Retry-After`).
/// * `Indeterminate`: unknown outcome; re-read (a submit: retry with the same id).
/// * `Fenced`: the session lost its epoch; stop acting for it.
/// * `VersionMismatch { current }`: re-read, decide again with `current`.
/// * The others describe the request or the task and are final for this request.
#[async_trait]
pub trait TaskStore: Send + Sync + 'static {
    /// Creates task `id` (or a generated 128-bit hex id) for `agent` with `input`, in
    /// state `submitted`. Idempotent: when task `id` exists with the same agent and
    /// input it is returned with `created == false`; with other content the answer is
    /// `ConflictingContent`. `created == true` only once the task is durable.
    /// After `Indeterminate`, retry with the same id; so a caller that may need to
    /// retry passes an id (see [`new_task_id`]) instead of `None`.
    async fn submit(
        &self,
        id: Option<&str>,
        agent: &str,
        input: Value,
    ) -> Result<Submitted, TaskError>;

    /// Reads one task.
    async fn get(&self, id: &str) -> Result<Task, TaskError>;

    /// Lists tasks in id order, optionally filtered, `limit` (1–1000) at a time,
    /// continuing after `cursor` (a `next_cursor` of an earlier page).
    async fn list(
        &self,
        filter: &TaskFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<TaskPage, TaskError>;

    /// `session` takes a submitted task: `submitted` → `working`, assignee set, fenced
    /// by the session's epoch. `Forbidden` when its client id is not the task's agent,
    /// `AlreadyClaimed` when another session holds it, `IllegalTransition` when the
    /// task is terminal. Claiming a task the same session (and epoch) already holds
    /// returns it unchanged, so a claim whose outcome was unknown can be retried.
    async fn claim(&self, id: &str, session: &AssigneeRef) -> Result<Task, TaskError>;

    /// Moves the task to `to` on behalf of `session`, replacing its output when
    /// `output` is given. Conditional on `expected_version` when given (`If-Match`;
    /// otherwise the store re-reads and retries on races) and fenced by the session's
    /// epoch. A claimed task may only be moved by its assignee (`NotAssignee`); a
    /// submitted one (reject, cancel) by a session of its agent (`Forbidden`).
    async fn transition(
        &self,
        id: &str,
        to: TaskState,
        output: Option<Value>,
        expected_version: Option<i64>,
        session: &AssigneeRef,
    ) -> Result<Task, TaskError>;

    /// Cancels the task unless it is terminal (`IllegalTransition`). Not fenced (any
    /// caller may cancel); retries internally when it races with other writers.
    async fn cancel(&self, id: &str) -> Result<Task, TaskError>;

    /// Returns a `working` or `input-required` task whose assignee is session
    /// `session_id` at `epoch` to `submitted` (assignee cleared), provided that session
    /// no longer holds that epoch (its key expired or was taken over; an epoch once
    /// lost never comes back, so one read of the session key decides). Conditional on
    /// the task's version. The runtime calls it when it sees a session end.
    async fn requeue_if_assignee(
        &self,
        id: &str,
        session_id: &str,
        epoch: i64,
    ) -> Result<Requeue, TaskError>;

    /// Deletes every terminal task that entered its terminal state at least
    /// `older_than` ago (each delete conditional on the version read). Returns how
    /// many it deleted. An error leaves the deletions made so far in place.
    async fn expire_terminal(&self, older_than: Duration) -> Result<usize, TaskError>;
}

/// The [`TaskStore`] on Meta.
pub struct MetaTaskStore {
    /// The only place tasks live: there is no cache, every read goes to Meta.
    meta: Arc<dyn Meta>,
    config: TaskStoreConfig,
}

impl MetaTaskStore {
    pub fn new(meta: Arc<dyn Meta>, config: TaskStoreConfig) -> Result<Self, TaskConfigError> {
        config.validate()?;
        Ok(Self { meta, config })
    }

    pub fn config(&self) -> &TaskStoreConfig {
        &self.config
    }

    fn backend(&self) -> meshd_meta::Backend {
        self.meta.backend()
    }

    /// Maps a Meta error that the caller did not handle itself, and logs it.
    fn meta_error(&self, op: &'static str, id: &str, e: MetaError) -> TaskError {
        let err = TaskError::from_meta(e);
        self.log_error(op, id, &err);
        err
    }

    fn log_error(&self, op: &'static str, id: &str, err: &TaskError) {
        match err {
            TaskError::Store(_) => tracing::warn!(
                store = STORE,
                backend = %self.backend(),
                op,
                task = id,
                kind = err.kind(),
                error = %err,
                "task operation failed"
            ),
            _ => tracing::debug!(
                store = STORE,
                backend = %self.backend(),
                op,
                task = id,
                kind = err.kind(),
                error = %err,
                "task operation refused"
            ),
        }
    }

    fn decode(&self, id: &str, kv: &KeyValue) -> Result<Task, TaskError> {
        record::decode(id, &kv.value, kv.mod_revision).map_err(|reason| {
            let err = TaskError::Store(StoreFailure::Corrupt {
                key: key_text(&kv.key),
                reason,
            });
            self.log_error("decode", id, &err);
            err
        })
    }

    fn encode(&self, task: &Task) -> Result<Vec<u8>, TaskError> {
        record::encode(task).map_err(TaskError::Invalid)
    }

    async fn read(&self, op: &'static str, id: &str) -> Result<Task, TaskError> {
        let key = task_key(id);
        let got = self
            .meta
            .get(&key)
            .await
            .map_err(|e| self.meta_error(op, id, e))?;
        match got.kv {
            Some(kv) => self.decode(id, &kv),
            None => Err(TaskError::NotFound { id: id.to_string() }),
        }
    }

    /// Writes `next` over `current` (conditional on `current.version`), fenced by
    /// `session` when given. `Ok(None)`: lost a race (re-read and decide again).
    async fn write_over(
        &self,
        op: &'static str,
        current: &Task,
        mut next: Task,
        session: Option<&AssigneeRef>,
    ) -> Result<Option<Task>, TaskError> {
        let key = task_key(&current.id);
        let value = self.encode(&next)?;
        let fence = session.map(AssigneeRef::ownership);
        let txn = Txn::new().put(&key, &value);
        let result = commit_at_version(
            self.meta.as_ref(),
            &key,
            current.version,
            txn,
            fence.as_ref(),
        )
        .await;
        match result {
            Ok(Some(revision)) => {
                next.version = revision;
                tracing::info!(
                    store = STORE,
                    backend = %self.backend(),
                    op,
                    task = %next.id,
                    from = %current.state,
                    to = %next.state,
                    version = next.version,
                    "task moved"
                );
                Ok(Some(next))
            }
            Ok(None) => Ok(None),
            Err(e) => Err(self.meta_error(op, &current.id, e)),
        }
    }

    fn contended(&self, op: &'static str, id: &str) -> TaskError {
        let err = TaskError::Store(StoreFailure::Unavailable(format!(
            "task {id}: lost {MAX_CAS_ATTEMPTS} compare-and-set races in a row"
        )));
        self.log_error(op, id, &err);
        err
    }

    /// Serializes `value` (checking its size) and returns the value as the record
    /// decoder will read it back, so later comparisons see exactly what is stored.
    fn normalize(
        &self,
        what: &'static str,
        value: Value,
        limit: usize,
    ) -> Result<Value, TaskError> {
        let bytes = serde_json::to_vec(&value)
            .map_err(|e| TaskError::Invalid(format!("task {what}: {e}")))?;
        if bytes.len() > limit {
            return Err(TaskError::TooLarge {
                what,
                size: bytes.len(),
                limit,
            });
        }
        serde_json::from_slice(&bytes).map_err(|e| TaskError::Invalid(format!("task {what}: {e}")))
    }
}

fn task_key(id: &str) -> Vec<u8> {
    keys::key(KeyKind::Tasks, &[id])
}

/// A fresh task id: 128 random bits as 32 lowercase hex digits. A caller that wants to
/// be able to retry a submit whose outcome was unknown picks the id with this up front
/// (a submit without an id generates one the caller only learns on success).
pub fn new_task_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

pub(crate) use crate::names::check_name_reason;
pub use crate::names::is_valid_name;

fn check_name(what: &str, name: &str) -> Result<(), TaskError> {
    check_name_reason(what, name).map_err(TaskError::Invalid)
}

fn check_session(session: &AssigneeRef) -> Result<(), TaskError> {
    if session.session_id.is_empty() {
        return Err(TaskError::Invalid("empty session id".into()));
    }
    if session.session_key.is_empty() || std::str::from_utf8(&session.session_key).is_err() {
        return Err(TaskError::Invalid(
            "a session key must be non-empty UTF-8".into(),
        ));
    }
    if session.epoch <= 0 {
        return Err(TaskError::Invalid(format!(
            "session epoch {} is not a Meta revision",
            session.epoch
        )));
    }
    Ok(())
}

fn refusal(from: TaskState, to: TaskState, r: Refusal, task: &Task) -> TaskError {
    match (r, &task.assignee) {
        (Refusal::AlreadyClaimed, Some(a)) => TaskError::AlreadyClaimed {
            assignee: a.clone(),
        },
        _ => TaskError::IllegalTransition { from, to },
    }
}

#[async_trait]
impl TaskStore for MetaTaskStore {
    async fn submit(
        &self,
        id: Option<&str>,
        agent: &str,
        input: Value,
    ) -> Result<Submitted, TaskError> {
        let id = match id {
            Some(id) => {
                check_name("task id", id)?;
                id.to_string()
            }
            None => new_task_id(),
        };
        check_name("agent", agent)?;
        let input = self.normalize("input", input, self.config.max_input_bytes)?;
        let now = Timestamp::now();
        let mut task = Task {
            id: id.clone(),
            agent: agent.to_string(),
            state: TaskState::Submitted,
            input,
            output: None,
            history: vec![HistoryEntry {
                state: TaskState::Submitted,
                at: now,
            }],
            assignee: None,
            created_at: now,
            version: 0,
            kept: Default::default(),
        };
        let key = task_key(&id);
        let value = self.encode(&task)?;
        // A second round only when the existing task vanished (retention) between the
        // failed compare and its read-back.
        for _ in 0..2 {
            let created = self
                .meta
                .put(&key, &value, Precondition::Absent, None)
                .await;
            match created {
                Ok(r) => {
                    task.version = r.revision;
                    tracing::info!(
                        store = STORE,
                        backend = %self.backend(),
                        task = %id,
                        agent,
                        version = r.revision,
                        "task submitted"
                    );
                    return Ok(Submitted {
                        task,
                        created: true,
                    });
                }
                Err(MetaError::Conflict { current: Some(kv) }) => {
                    let existing = self.decode(&id, &kv)?;
                    if existing.agent == task.agent && existing.input == task.input {
                        tracing::debug!(
                            store = STORE,
                            backend = %self.backend(),
                            task = %id,
                            version = existing.version,
                            "repeated submit returns the existing task"
                        );
                        return Ok(Submitted {
                            task: existing,
                            created: false,
                        });
                    }
                    let err = TaskError::ConflictingContent { id: id.clone() };
                    self.log_error("submit", &id, &err);
                    return Err(err);
                }
                Err(MetaError::Conflict { current: None }) => continue,
                Err(e) => return Err(self.meta_error("submit", &id, e)),
            }
        }
        Err(self.contended("submit", &id))
    }

    async fn get(&self, id: &str) -> Result<Task, TaskError> {
        check_name("task id", id)?;
        self.read("get", id).await
    }

    async fn list(
        &self,
        filter: &TaskFilter,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<TaskPage, TaskError> {
        if !(1..=MAX_LIST_LIMIT).contains(&limit) {
            return Err(TaskError::Invalid(format!(
                "limit {limit} is not 1-{MAX_LIST_LIMIT}"
            )));
        }
        if let Some(c) = cursor {
            if !is_valid_name(c) {
                return Err(TaskError::Invalid(format!("malformed cursor {c:?}")));
            }
        }
        let start = cursor.map(|c| after(task_key(c)));
        let mut pages = PrefixPages::new(keys::prefix(KeyKind::Tasks, &[]), start, SCAN_PAGE);
        let mut tasks = Vec::new();
        let mut examined = 0usize;
        let budget = SCAN_BUDGET.max(limit);
        while let Some(page) = pages
            .next(self.meta.as_ref())
            .await
            .map_err(|e| self.meta_error("list", "", e))?
        {
            let n = page.kvs.len();
            for (i, kv) in page.kvs.iter().enumerate() {
                let id = task_id_of(kv)?;
                let task = self.decode(&id, kv)?;
                examined += 1;
                let wanted = filter.agent.as_deref().is_none_or(|a| a == task.agent)
                    && filter.state.is_none_or(|s| s == task.state);
                if wanted {
                    tasks.push(task);
                }
                let more_after_this = i + 1 < n || page.more;
                if tasks.len() == limit || examined >= budget {
                    return Ok(TaskPage {
                        tasks,
                        next_cursor: more_after_this.then_some(id),
                    });
                }
            }
        }
        Ok(TaskPage {
            tasks,
            next_cursor: None,
        })
    }

    async fn claim(&self, id: &str, session: &AssigneeRef) -> Result<Task, TaskError> {
        check_name("task id", id)?;
        check_session(session)?;
        for _ in 0..MAX_CAS_ATTEMPTS {
            let task = self.read("claim", id).await?;
            if task.agent != session.client_id {
                let err = TaskError::Forbidden {
                    client_id: session.client_id.clone(),
                    agent: task.agent.clone(),
                };
                self.log_error("claim", id, &err);
                return Err(err);
            }
            if task.state.is_claimed() && task.assignee.as_ref().is_some_and(|a| session.is(a)) {
                return Ok(task);
            }
            if let Err(r) = table::check(task.state, TaskState::Working, Via::Claim) {
                let err = refusal(task.state, TaskState::Working, r, &task);
                self.log_error("claim", id, &err);
                return Err(err);
            }
            let mut next = task.moved(
                TaskState::Working,
                Timestamp::now(),
                self.config.max_history,
            );
            next.assignee = Some(Assignee {
                session: session.session_id.clone(),
                epoch: session.epoch,
                client_id: session.client_id.clone(),
                session_key: String::from_utf8_lossy(&session.session_key).into_owned(),
            });
            if let Some(done) = self.write_over("claim", &task, next, Some(session)).await? {
                return Ok(done);
            }
        }
        Err(self.contended("claim", id))
    }

    async fn transition(
        &self,
        id: &str,
        to: TaskState,
        output: Option<Value>,
        expected_version: Option<i64>,
        session: &AssigneeRef,
    ) -> Result<Task, TaskError> {
        check_name("task id", id)?;
        check_session(session)?;
        let output = match output {
            Some(o) => Some(self.normalize("output", o, self.config.max_output_bytes)?),
            None => None,
        };
        for _ in 0..MAX_CAS_ATTEMPTS {
            let task = self.read("transition", id).await?;
            let refused = |err: TaskError| {
                self.log_error("transition", id, &err);
                Err(err)
            };
            if let Some(expected) = expected_version {
                if expected != task.version {
                    return refused(TaskError::VersionMismatch {
                        current: task.version,
                    });
                }
            }
            if let Err(r) = table::check(task.state, to, Via::Transition) {
                return refused(refusal(task.state, to, r, &task));
            }
            if task.state.is_claimed() {
                if !task.assignee.as_ref().is_some_and(|a| session.is(a)) {
                    return refused(TaskError::NotAssignee {
                        id: id.to_string(),
                        session: session.session_id.clone(),
                    });
                }
            } else if task.agent != session.client_id {
                return refused(TaskError::Forbidden {
                    client_id: session.client_id.clone(),
                    agent: task.agent.clone(),
                });
            }
            let mut next = task.moved(to, Timestamp::now(), self.config.max_history);
            if output.is_some() {
                next.output = output.clone();
            }
            if let Some(done) = self
                .write_over("transition", &task, next, Some(session))
                .await?
            {
                return Ok(done);
            }
            if expected_version.is_some() {
                // Someone else wrote since: report the version it is at now.
                let current = self.read("transition", id).await?;
                return refused(TaskError::VersionMismatch {
                    current: current.version,
                });
            }
        }
        Err(self.contended("transition", id))
    }

    async fn cancel(&self, id: &str) -> Result<Task, TaskError> {
        check_name("task id", id)?;
        for _ in 0..MAX_CAS_ATTEMPTS {
            let task = self.read("cancel", id).await?;
            if let Err(r) = table::check(task.state, TaskState::Canceled, Via::Cancel) {
                let err = refusal(task.state, TaskState::Canceled, r, &task);
                self.log_error("cancel", id, &err);
                return Err(err);
            }
            let next = task.moved(
                TaskState::Canceled,
                Timestamp::now(),
                self.config.max_history,
            );
            if let Some(done) = self.write_over("cancel", &task, next, None).await? {
                return Ok(done);
            }
        }
        Err(self.contended("cancel", id))
    }

    async fn requeue_if_assignee(
        &self,
        id: &str,
        session_id: &str,
        epoch: i64,
    ) -> Result<Requeue, TaskError> {
        check_name("task id", id)?;
        for _ in 0..MAX_CAS_ATTEMPTS {
            let task = self.read("requeue", id).await?;
            let assignee = match &task.assignee {
                Some(a)
                    if task.state.is_claimed() && a.session == session_id && a.epoch == epoch =>
                {
                    a.clone()
                }
                _ => return Ok(Requeue::NotAssigned(task)),
            };
            // The epoch is lost once the session key's mod_revision differs from it
            // (absent = 0): revisions only grow, so it can never hold it again.
            let holder = self
                .meta
                .get(assignee.session_key.as_bytes())
                .await
                .map_err(|e| self.meta_error("requeue", id, e))?;
            if holder.kv.is_some_and(|kv| kv.mod_revision == epoch) {
                return Ok(Requeue::AssigneeLive(task));
            }
            if let Err(r) = table::check(task.state, TaskState::Submitted, Via::Requeue) {
                return Err(refusal(task.state, TaskState::Submitted, r, &task));
            }
            let mut next = task.moved(
                TaskState::Submitted,
                Timestamp::now(),
                self.config.max_history,
            );
            next.assignee = None;
            if let Some(done) = self.write_over("requeue", &task, next, None).await? {
                return Ok(Requeue::Requeued(done));
            }
        }
        Err(self.contended("requeue", id))
    }

    async fn expire_terminal(&self, older_than: Duration) -> Result<usize, TaskError> {
        let cutoff = Timestamp::now().saturating_sub(older_than);
        let mut pages = PrefixPages::new(keys::prefix(KeyKind::Tasks, &[]), None, SCAN_PAGE);
        let mut deleted = 0;
        while let Some(page) = pages
            .next(self.meta.as_ref())
            .await
            .map_err(|e| self.meta_error("expire", "", e))?
        {
            for kv in &page.kvs {
                let id = task_id_of(kv)?;
                let task = self.decode(&id, kv)?;
                if !task.state.is_terminal() || task.updated_at() > cutoff {
                    continue;
                }
                match self
                    .meta
                    .delete(&kv.key, Precondition::ModRevision(kv.mod_revision))
                    .await
                {
                    Ok(_) => {
                        deleted += 1;
                        tracing::info!(
                            store = STORE,
                            backend = %self.backend(),
                            task = %id,
                            state = %task.state,
                            "terminal task expired"
                        );
                    }
                    // Changed or deleted since it was read: another expirer got there.
                    Err(MetaError::Conflict { .. }) => {}
                    Err(e) => return Err(self.meta_error("expire", &id, e)),
                }
            }
        }
        Ok(deleted)
    }
}

fn task_id_of(kv: &KeyValue) -> Result<String, TaskError> {
    match keys::components(KeyKind::Tasks, &kv.key).as_deref() {
        Some([id]) => Ok(id.clone()),
        _ => Err(TaskError::Store(StoreFailure::Corrupt {
            key: key_text(&kv.key),
            reason: "not a task key (meshd/v1/tasks/{id})".into(),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_api_rules() {
        assert!(is_valid_name("a"));
        assert!(is_valid_name("Agent-1.x_y"));
        assert!(is_valid_name(&"a".repeat(249)));
        assert!(!is_valid_name(""));
        assert!(!is_valid_name(&"a".repeat(250)));
        for bad in ["a/b", "a b", "a%b", "é", "a\0"] {
            assert!(!is_valid_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn states_parse_and_print_as_on_the_wire() {
        for s in TaskState::ALL {
            assert_eq!(s.as_str().parse::<TaskState>().unwrap(), s);
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.as_str())
            );
        }
        assert!("done".parse::<TaskState>().is_err());
    }

    #[test]
    fn history_keeps_the_first_and_the_latest_entries() {
        let t0 = Timestamp::from_millis(0).unwrap();
        let mut task = Task {
            id: "t".into(),
            agent: "a".into(),
            state: TaskState::Submitted,
            input: Value::Null,
            output: None,
            history: vec![HistoryEntry {
                state: TaskState::Submitted,
                at: t0,
            }],
            assignee: None,
            created_at: t0,
            version: 1,
            kept: Default::default(),
        };
        for i in 1..=10 {
            let to = if i % 2 == 1 {
                TaskState::Working
            } else {
                TaskState::InputRequired
            };
            task = task.moved(to, Timestamp::from_millis(i).unwrap(), 4);
            assert!(task.history.len() <= 4);
        }
        let at: Vec<i64> = task.history.iter().map(|h| h.at.as_millis()).collect();
        assert_eq!(at, vec![0, 8, 9, 10]);
        assert_eq!(task.history[0].state, TaskState::Submitted);
        assert_eq!(task.history.last().unwrap().state, task.state);
    }

    #[test]
    fn config_validation_names_the_bad_value() {
        assert!(TaskStoreConfig::default().validate().is_ok());
        let err = TaskStoreConfig {
            max_input_bytes: 0,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(err.field, "max_input_bytes");
        let err = TaskStoreConfig {
            max_input_bytes: 1024 * 1024,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(err.field.contains("max_output_bytes"), "{err}");
        let err = TaskStoreConfig {
            max_history: 1,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert_eq!(err.field, "max_history");
    }
}

/// Fuzzing the task record (docs/fuzzing.md): whatever Meta holds
/// under a task key decodes exactly or is corrupt, never a panic. Valid records are
/// mutated member by member so the cases get past the version probe.
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::time::Timestamp;
    use meshd_fuzz_cases::cases;
    use proptest::prelude::*;

    fn state() -> impl Strategy<Value = TaskState> {
        prop::sample::select(TaskState::ALL.to_vec())
    }

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            (0u64..3).prop_map(Value::from),
            Just(Value::from(1.5)),
            state().prop_map(|s| Value::from(s.as_str())),
            prop::sample::select(vec!["2025-01-02T03:04:05.678Z", "", "t"]).prop_map(Value::from),
            ".{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(2, 12, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
                prop::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn task() -> impl Strategy<Value = Task> {
        (
            (
                state(),
                prop::collection::vec(state(), 0..3),
                json(),
                proptest::option::of(json()),
            ),
            (0i64..253_402_300_799_999, any::<i64>(), any::<bool>()),
        )
            .prop_map(
                |((state, mut earlier, input, output), (at, epoch, assigned))| {
                    earlier.push(state);
                    let at = Timestamp::from_millis(at).unwrap();
                    Task {
                        id: "t".into(),
                        agent: "a".into(),
                        state,
                        input,
                        output,
                        history: earlier
                            .into_iter()
                            .map(|state| HistoryEntry { state, at })
                            .collect(),
                        assignee: (assigned || state.is_claimed()).then(|| Assignee {
                            session: "s".into(),
                            epoch,
                            client_id: "a".into(),
                            session_key: "k".into(),
                        }),
                        created_at: at,
                        version: 3,
                        kept: Default::default(),
                    }
                },
            )
    }

    fn edit(
        object: &mut serde_json::Map<String, Value>,
        at: prop::sample::Index,
        how: u8,
        v: Value,
    ) {
        let keys: Vec<String> = object.keys().cloned().collect();
        if keys.is_empty() {
            return;
        }
        let k = keys[at.index(keys.len())].clone();
        match how % 4 {
            0 => {
                object.remove(&k);
            }
            1 => {
                object.insert(k, v);
            }
            2 => {
                object.insert(format!("{k}_x"), v);
            }
            _ => match object.get_mut(&k) {
                Some(Value::Object(inner)) => edit(inner, at, how / 4, v),
                Some(Value::Array(items)) if !items.is_empty() => {
                    let i = at.index(items.len());
                    match &mut items[i] {
                        Value::Object(inner) => edit(inner, at, how / 4, v),
                        other => *other = v,
                    }
                }
                _ => {}
            },
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(cases()))]

        #[test]
        fn task_record_decode(
            t in task(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), json()), 0..4),
            cut in proptest::option::weighted(0.2, any::<prop::sample::Index>()),
            garbage in prop::collection::vec(any::<u8>(), 0..32),
            use_garbage in proptest::bool::weighted(0.1),
        ) {
            let bytes = if use_garbage {
                garbage
            } else {
                let mut v: Value = serde_json::from_slice(&record::encode(&t).unwrap()).unwrap();
                for (at, how, value) in edits {
                    if let Value::Object(o) = &mut v {
                        edit(o, at, how, value);
                    }
                }
                let b = serde_json::to_vec(&v).unwrap();
                match cut {
                    Some(at) => b[..at.index(b.len() + 1)].to_vec(),
                    None => b,
                }
            };
            if let Ok(d) = record::decode("t", &bytes, 3) {
                prop_assert_eq!(d.history.last().map(|h| h.state), Some(d.state));
                let again = record::encode(&d).unwrap();
                prop_assert_eq!(record::decode("t", &again, 3), Ok(d));
            }
        }
    }
}
