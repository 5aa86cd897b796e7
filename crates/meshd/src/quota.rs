//! Quotas on what clients create (http-api.md "Quotas and browser safety"): topics,
//! subscriptions, live sessions, non-terminal tasks (in all and per agent) and the
//! bytes of every task record in Meta. Beyond a quota a create is 429 with `type`
//! ending `/quota-exceeded` and no `Retry-After` (nothing frees up by waiting), and
//! nothing is stored. Counts come from the stores' caches, which follow Meta's
//! changes: across instances they lag by one cache refresh. A create that already
//! exists (an idempotent re-submit, a PUT of an existing topic) and a session takeover
//! are never refused.

use crate::config::Limits;
use crate::problem::Problem;
use axum::http::StatusCode;
use meshd_stores::sessions::SessionStore;
use meshd_stores::subscriptions::MetaSubscriptionStore;
use meshd_stores::tasks::usage::TaskUsageWatch;
use meshd_stores::topics::MetaTopicStore;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
    pub fn topic(&self) -> Result<(), Over> {
        let limit = self.limits.max_topics;
        within(TOPICS, limit, self.topics.count().map(|n| n as u64), |n| {
            format!("{n} topics exist; --max-topics is {limit}: delete one first")
        })
    }

    /// Before a subscription that does not exist yet is created.
    pub fn subscription(&self) -> Result<(), Over> {
        let limit = self.limits.max_subscriptions;
        let count = self.subscriptions.count().map(|n| n as u64);
        within(SUBSCRIPTIONS, limit, count, |n| {
            format!("{n} subscriptions exist; --max-subscriptions is {limit}: delete one first")
        })
    }

    /// Before a session is opened for `client_id` (a takeover of its live session is
    /// never refused).
    pub fn session(&self, client_id: &str) -> Result<(), Over> {
        if self.sessions.has_live(client_id) != Some(false) {
            return Ok(());
        }
        let limit = self.limits.max_sessions;
        let count = self.sessions.live_count().map(|n| n as u64);
        within(SESSIONS, limit, count, |n| {
            format!("{n} sessions are live; --max-sessions is {limit}: close one or let one expire first")
        })
    }

    /// Before a task of `agent` whose record takes about `bytes` is created (the
    /// caller lets an idempotent re-submit of an existing task through first).
    pub fn task(&self, agent: &str, bytes: u64) -> Result<(), Over> {
        let Some(u) = self.tasks.usage() else {
            return Ok(());
        };
        let limit = self.limits.max_tasks;
        within(TASKS, limit, Some(u.non_terminal), |n| {
            format!("{n} tasks are not finished; --max-tasks is {limit}: finish, cancel or delete some first")
        })?;
        self.task_bytes(u.bytes, bytes)?;
        let limit = self.limits.max_tasks_per_agent;
        within(
            TASKS_PER_AGENT,
            limit,
            self.tasks.non_terminal_of(agent),
            |n| {
                format!(
                    "agent {agent:?} has {n} unfinished tasks; --max-tasks-per-agent is {limit}"
                )
            },
        )
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
