//! Quotas on what clients create (http-api.md "Quotas and browser safety"): topics,
//! subscriptions, live sessions, non-terminal tasks (in all and per agent) and the
//! bytes of every task record in Meta. Beyond a quota a create is 429 with `type`
//! ending `/quota-exceeded` and no `Retry-After` (nothing frees up by waiting), and
//! nothing is stored. Counts come from the stores' caches, which follow Meta's
//! changes: across instances they lag by one cache refresh. An instance counts its own
//! creates at once: a create passes the check by taking a [`Reserved`] place, held
//! while it is written and, for a task, until the usage watch has seen it (the topic,
//! subscription and session stores put their own writes in their caches before they
//! return). So creates on one instance never pass a quota, sequential or concurrent;
//! a burst across instances passes it by at most the other instances' creates in
//! flight. A create that already exists (an idempotent re-submit, a PUT of an
//! existing topic) and a session takeover are never refused.

use crate::config::Limits;
use crate::problem::Problem;
use axum::http::StatusCode;
use meshd_stores::sessions::SessionStore;
use meshd_stores::subscriptions::MetaSubscriptionStore;
use meshd_stores::tasks::usage::TaskUsageWatch;
use meshd_stores::topics::MetaTopicStore;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// The quotas by name (the `quota` label of the metrics and the problem field).
pub const TOPICS: &str = "topics";
pub const SUBSCRIPTIONS: &str = "subscriptions";
pub const SESSIONS: &str = "sessions";
pub const TASKS: &str = "tasks";
pub const TASKS_PER_AGENT: &str = "tasks_per_agent";
pub const TASK_BYTES: &str = "task_bytes";

pub struct Quotas {
    limits: Limits,
    topics: Arc<MetaTopicStore>,
    subscriptions: Arc<MetaSubscriptionStore>,
    sessions: Arc<dyn SessionStore>,
    tasks: TaskUsageWatch,
    refused: BTreeMap<&'static str, AtomicU64>,
    /// This instance's creates that its caches may not count yet.
    pending: Mutex<Pending>,
}

/// Creates of this instance that the caches may not show yet.
#[derive(Default)]
struct Pending {
    /// Being written, by quota.
    writing: HashMap<&'static str, u64>,
    /// Tasks written at a revision the usage watch had not reached when last asked:
    /// (revision, agent, bytes).
    unseen_tasks: Vec<(i64, String, u64)>,
    /// Tasks being written, per agent, and their bytes.
    writing_tasks: HashMap<String, u64>,
    task_bytes_writing: u64,
}

impl Pending {
    fn writing(&self, quota: &'static str) -> u64 {
        self.writing.get(quota).copied().unwrap_or(0)
    }

    /// Forgets the written tasks the usage watch has seen (its revision reached theirs).
    fn seen_up_to(&mut self, revision: i64) {
        self.unseen_tasks.retain(|(r, _, _)| *r > revision);
    }

    fn release(&mut self, quota: &'static str, task: Option<&(String, u64)>) {
        if let Some(n) = self.writing.get_mut(quota) {
            *n = n.saturating_sub(1);
        }
        if let Some((agent, bytes)) = task {
            if let Some(n) = self.writing_tasks.get_mut(agent) {
                *n -= 1;
                if *n == 0 {
                    self.writing_tasks.remove(agent);
                }
            }
            self.task_bytes_writing = self.task_bytes_writing.saturating_sub(*bytes);
        }
    }
}

/// A create's place under its quota, taken by the check and held while it is
/// written: dropped, it is given back (the create failed, or changed nothing); a
/// created task hands it on with [`Reserved::task_created`].
#[must_use = "the place is given back when dropped: hold it while the create is written"]
pub struct Reserved<'a> {
    quotas: &'a Quotas,
    /// `None` once handed on (nothing left for the drop to give back).
    quota: Option<&'static str>,
    /// A task's agent and bytes.
    task: Option<(String, u64)>,
}

impl Reserved<'_> {
    /// The task was created at Meta `revision`: it stays counted until the usage
    /// watch has reached that revision (and so counts it itself).
    pub fn task_created(mut self, revision: i64) {
        if let (Some(quota), Some(task)) = (self.quota, self.task.take()) {
            self.quota = None;
            let mut p = self.quotas.pending();
            p.release(quota, Some(&task));
            p.unseen_tasks.push((revision, task.0, task.1));
        }
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if let Some(quota) = self.quota {
            self.quotas.pending().release(quota, self.task.as_ref());
        }
    }
}

/// A quota that a create would pass; [`Quotas::refuse`] turns it into the answer
/// (the caller may first find that the create changes nothing, e.g. an idempotent
/// re-submit, and let it through).
#[derive(Debug)]
pub struct Over {
    quota: &'static str,
    limit: u64,
    detail: String,
}

fn over(quota: &'static str, limit: u64, detail: String) -> Result<(), Over> {
    Err(Over {
        quota,
        limit,
        detail,
    })
}

/// `quota` is reached when `count` (`None`: not known yet, which refuses nothing) is
/// at `limit`; `detail` says so from the count.
fn within(
    quota: &'static str,
    limit: u64,
    count: Option<u64>,
    detail: impl FnOnce(u64) -> String,
) -> Result<(), Over> {
    match count {
        Some(n) if n >= limit => over(quota, limit, detail(n)),
        _ => Ok(()),
    }
}

impl Quotas {
    pub fn new(
        limits: Limits,
        topics: Arc<MetaTopicStore>,
        subscriptions: Arc<MetaSubscriptionStore>,
        sessions: Arc<dyn SessionStore>,
        tasks: TaskUsageWatch,
    ) -> Self {
        let refused = [
            TOPICS,
            SUBSCRIPTIONS,
            SESSIONS,
            TASKS,
            TASKS_PER_AGENT,
            TASK_BYTES,
        ]
        .into_iter()
        .map(|q| (q, AtomicU64::new(0)))
        .collect();
        Self {
            limits,
            topics,
            subscriptions,
            sessions,
            tasks,
            refused,
            pending: Mutex::default(),
        }
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        // Counters only: usable after a panic elsewhere.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes a place under `quota` when `count` (the cache's, `None`: not known yet,
    /// which refuses nothing) plus this instance's creates being written is below
    /// `limit`.
    fn reserve(
        &self,
        quota: &'static str,
        limit: u64,
        count: impl FnOnce() -> Option<u64>,
        detail: impl FnOnce(u64) -> String,
    ) -> Result<Reserved<'_>, Over> {
        let mut p = self.pending();
        let count = count().map(|n| n + p.writing(quota));
        within(quota, limit, count, detail)?;
        *p.writing.entry(quota).or_default() += 1;
        Ok(Reserved {
            quotas: self,
            quota: Some(quota),
            task: None,
        })
    }

    /// What a create's quota check (`check`) comes to: its place, or at the quota
    /// `None` when `exists` finds the record there already (a PUT of an existing topic
    /// or subscription, an idempotent re-submit of a task: nothing the quota counts
    /// changes), else the 429. `exists` is asked only at the quota.
    pub async fn admit<'q>(
        &'q self,
        check: Result<Reserved<'q>, Over>,
        exists: impl std::future::Future<Output = Result<bool, Problem>>,
    ) -> Result<Option<Reserved<'q>>, Problem> {
        match check {
            Ok(reserved) => Ok(Some(reserved)),
            Err(_) if exists.await? => Ok(None),
            Err(over) => Err(self.refuse(over)),
        }
    }

    /// The 429 of a quota (counted and logged): no `Retry-After`, since waiting frees
    /// nothing; only a delete (or a task ending) does.
    pub fn refuse(&self, o: Over) -> Problem {
        if let Some(c) = self.refused.get(o.quota) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        tracing::warn!(quota = o.quota, limit = o.limit, detail = %o.detail, "a create was refused by a quota");
        let mut p = Problem::new(StatusCode::TOO_MANY_REQUESTS, "quota-exceeded", o.detail)
            .with("quota", o.quota)
            .with("limit", o.limit);
        p.retry_after = None;
        p
    }

    /// Before a topic that does not exist yet is created. (A count the cache does not
    /// know yet refuses nothing: the store answers for Meta then.)
    pub fn topic(&self) -> Result<Reserved<'_>, Over> {
        let limit = self.limits.max_topics;
        self.reserve(
            TOPICS,
            limit,
            || self.topics.count().map(|n| n as u64),
            |n| format!("{n} topics exist; --max-topics is {limit}: delete one first"),
        )
    }

    /// Before a subscription that does not exist yet is created.
    pub fn subscription(&self) -> Result<Reserved<'_>, Over> {
        let limit = self.limits.max_subscriptions;
        self.reserve(
            SUBSCRIPTIONS,
            limit,
            || self.subscriptions.count().map(|n| n as u64),
            |n| {
                format!("{n} subscriptions exist; --max-subscriptions is {limit}: delete one first")
            },
        )
    }

    /// Before a session is opened for `client_id` (a takeover of its live session is
    /// never refused).
    pub fn session(&self, client_id: &str) -> Result<Option<Reserved<'_>>, Over> {
        if self.sessions.has_live(client_id) != Some(false) {
            return Ok(None);
        }
        let limit = self.limits.max_sessions;
        self.reserve(
            SESSIONS,
            limit,
            || self.sessions.live_count().map(|n| n as u64),
            |n| format!("{n} sessions are live; --max-sessions is {limit}: close one or let one expire first"),
        )
        .map(Some)
    }

    /// Before a task of `agent` whose record takes about `bytes` is created (the
    /// caller lets an idempotent re-submit of an existing task through first).
    pub fn task(&self, agent: &str, bytes: u64) -> Result<Reserved<'_>, Over> {
        let mut p = self.pending();
        if let Some((u, of_agent, revision)) = self.tasks.usage_of(agent) {
            p.seen_up_to(revision);
            let unseen_of_agent = p.unseen_tasks.iter().filter(|t| t.1 == agent).count() as u64;
            let unseen_bytes: u64 = p.unseen_tasks.iter().map(|t| t.2).sum();
            let non_terminal = u.non_terminal + p.writing(TASKS) + p.unseen_tasks.len() as u64;
            let limit = self.limits.max_tasks;
            within(TASKS, limit, Some(non_terminal), |n| {
                format!("{n} tasks are not finished; --max-tasks is {limit}: finish, cancel or delete some first")
            })?;
            self.task_bytes(u.bytes + p.task_bytes_writing + unseen_bytes, bytes)?;
            let limit = self.limits.max_tasks_per_agent;
            let of_agent =
                of_agent + p.writing_tasks.get(agent).copied().unwrap_or(0) + unseen_of_agent;
            within(TASKS_PER_AGENT, limit, Some(of_agent), |n| {
                format!(
                    "agent {agent:?} has {n} unfinished tasks; --max-tasks-per-agent is {limit}"
                )
            })?;
        }
        *p.writing.entry(TASKS).or_default() += 1;
        *p.writing_tasks.entry(agent.to_string()).or_default() += 1;
        p.task_bytes_writing += bytes;
        Ok(Reserved {
            quotas: self,
            quota: Some(TASKS),
            task: Some((agent.to_string(), bytes)),
        })
    }

    /// Before a task write that adds `more` bytes to what tasks keep in Meta.
    pub fn task_growth(&self, more: u64) -> Result<(), Over> {
        match self.tasks.usage() {
            Some(u) => self.task_bytes(u.bytes, more),
            None => Ok(()),
        }
    }

    fn task_bytes(&self, used: u64, more: u64) -> Result<(), Over> {
        let limit = self.limits.max_task_bytes;
        if used.saturating_add(more) > limit {
            return over(
                TASK_BYTES,
                limit,
                format!("tasks keep {used} bytes in Meta; {more} more would pass --max-task-bytes {limit}: delete finished tasks (or wait for --task-retention-hours)"),
            );
        }
        Ok(())
    }

    /// `meshd_quota_used`, `meshd_quota_limit` and `meshd_quota_refused_total`.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let tasks = self.tasks.usage();
        let used: [(&str, Option<u64>, u64); 5] = [
            (
                TOPICS,
                self.topics.count().map(|n| n as u64),
                self.limits.max_topics,
            ),
            (
                SUBSCRIPTIONS,
                self.subscriptions.count().map(|n| n as u64),
                self.limits.max_subscriptions,
            ),
            (
                SESSIONS,
                self.sessions.live_count().map(|n| n as u64),
                self.limits.max_sessions,
            ),
            (TASKS, tasks.map(|u| u.non_terminal), self.limits.max_tasks),
            (
                TASK_BYTES,
                tasks.map(|u| u.bytes),
                self.limits.max_task_bytes,
            ),
        ];
        let _ = writeln!(out, "# HELP meshd_quota_used What a client quota counts now, from the caches (all instances; may lag by one cache refresh).\n# TYPE meshd_quota_used gauge");
        for (q, n, _) in &used {
            if let Some(n) = n {
                let _ = writeln!(out, "meshd_quota_used{{quota=\"{q}\"}} {n}");
            }
        }
        let _ = writeln!(
            out,
            "# HELP meshd_quota_limit A client quota's limit.\n# TYPE meshd_quota_limit gauge"
        );
        for (q, _, limit) in &used {
            let _ = writeln!(out, "meshd_quota_limit{{quota=\"{q}\"}} {limit}");
        }
        let _ = writeln!(
            out,
            "meshd_quota_limit{{quota=\"{TASKS_PER_AGENT}\"}} {}",
            self.limits.max_tasks_per_agent
        );
        let _ = writeln!(out, "# HELP meshd_quota_refused_total Creates refused by a client quota (429 quota-exceeded), on this instance.\n# TYPE meshd_quota_refused_total counter");
        for (q, c) in &self.refused {
            let _ = writeln!(
                out,
                "meshd_quota_refused_total{{quota=\"{q}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
    }

    /// Live sessions from the cache, without copying them.
    pub fn sessions_live(&self) -> Option<usize> {
        self.sessions.live_count()
    }
}
