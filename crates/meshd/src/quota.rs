//! Quotas on what clients create (http-api.md "Quotas and browser safety"): topics,
//! subscriptions, live sessions, non-terminal tasks (in all and per agent) and the
//! bytes of every task record in Meta. Beyond a quota a create is 429 with `type`
//! ending `/quota-exceeded` and no `Retry-After` (nothing frees up by waiting), and
//! nothing is stored. Counts come from the stores' caches, which follow Meta's
//! changes: across instances they lag by one cache refresh. An instance counts its own
//! creates at once: a create passes the check by taking a [`Reserved`] place, held
//! while it is written and, for a task, until the usage watch has seen it (the topic,
//! subscription and session stores put their own writes in their caches before they
//! return). Each create in flight is known by its name and counts once: the cache's
//! count (read together with which of those names it holds) plus the names it does
//! not hold yet. So creates on one instance never pass a quota, nor are refused below
//! it, sequential or concurrent;
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

/// Creates of this instance that the caches may not show yet. Each is known by name
/// (topic, subscription, client id, task id), so that a count adds only those the
/// cache does not hold yet: a store puts its own write in its cache before it returns,
/// and until the place is given back the create would otherwise count twice (a burst
/// was refused below the quota so).
#[derive(Default)]
struct Pending {
    /// Being written, by quota (tasks aside): the names.
    writing: HashMap<&'static str, Vec<String>>,
    /// Tasks being written: (id, agent, bytes).
    writing_tasks: Vec<(String, String, u64)>,
    /// Tasks written at a revision the usage watch had not reached when last asked:
    /// (revision, agent, bytes).
    unseen_tasks: Vec<(i64, String, u64)>,
}

impl Pending {
    fn writing(&self, quota: &'static str) -> &[String] {
        self.writing.get(quota).map_or(&[], Vec::as_slice)
    }

    /// Forgets the written tasks the usage watch has seen (its revision reached theirs).
    fn seen_up_to(&mut self, revision: i64) {
        self.unseen_tasks.retain(|(r, _, _)| *r > revision);
    }

    /// Gives back `name`'s place under `quota`.
    fn release(&mut self, quota: &'static str, name: &str) {
        if quota == TASKS {
            if let Some(i) = self.writing_tasks.iter().position(|t| t.0 == name) {
                self.writing_tasks.swap_remove(i);
            }
        } else if let Some(names) = self.writing.get_mut(quota) {
            if let Some(i) = names.iter().position(|n| n == name) {
                names.swap_remove(i);
            }
        }
    }
}

/// How many of `names` the cache does not hold (`held` tells, name by name).
fn not_held(held: &[bool]) -> u64 {
    held.iter().filter(|h| !**h).count() as u64
}

/// A create's place under its quota, taken by the check and held while it is
/// written: dropped, it is given back (the create failed, or changed nothing); a
/// created task hands it on with [`Reserved::task_created`].
#[must_use = "the place is given back when dropped: hold it while the create is written"]
pub struct Reserved<'a> {
    quotas: &'a Quotas,
    /// `None` once handed on (nothing left for the drop to give back).
    quota: Option<&'static str>,
    /// What is created (topic, subscription, client id, task id).
    name: String,
}

impl Reserved<'_> {
    /// The task was created at Meta `revision`: it stays counted until the usage
    /// watch has reached that revision (and so counts it itself).
    pub fn task_created(mut self, revision: i64) {
        if self.quota.take().is_none() {
            return;
        }
        let mut p = self.quotas.pending();
        if let Some(i) = p.writing_tasks.iter().position(|t| t.0 == self.name) {
            let (_, agent, bytes) = p.writing_tasks.swap_remove(i);
            p.unseen_tasks.push((revision, agent, bytes));
        }
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if let Some(quota) = self.quota {
            self.quotas.pending().release(quota, &self.name);
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

    /// Takes a place under `quota` for `name` when `count` (the cache's, with which of
    /// the names being written it holds; `None`: not known yet, which refuses nothing)
    /// plus the names being written it does not hold is below `limit`.
    fn reserve(
        &self,
        quota: &'static str,
        name: &str,
        limit: u64,
        count: impl FnOnce(&[String]) -> Option<(usize, Vec<bool>)>,
        detail: impl FnOnce(u64) -> String,
    ) -> Result<Reserved<'_>, Over> {
        let mut p = self.pending();
        let count = count(p.writing(quota)).map(|(n, held)| n as u64 + not_held(&held));
        within(quota, limit, count, detail)?;
        p.writing.entry(quota).or_default().push(name.to_string());
        Ok(Reserved {
            quotas: self,
            quota: Some(quota),
            name: name.to_string(),
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
    pub fn topic(&self, name: &str) -> Result<Reserved<'_>, Over> {
        let limit = self.limits.max_topics;
        self.reserve(
            TOPICS,
            name,
            limit,
            |writing| self.topics.count_holding(writing),
            |n| format!("{n} topics exist; --max-topics is {limit}: delete one first"),
        )
    }

    /// Before a subscription that does not exist yet is created.
    pub fn subscription(&self, name: &str) -> Result<Reserved<'_>, Over> {
        let limit = self.limits.max_subscriptions;
        self.reserve(
            SUBSCRIPTIONS,
            name,
            limit,
            |writing| self.subscriptions.count_holding(writing),
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
            client_id,
            limit,
            |writing| self.sessions.live_count_holding(writing),
            |n| format!("{n} sessions are live; --max-sessions is {limit}: close one or let one expire first"),
        )
        .map(Some)
    }

    /// Before the task `id` of `agent` whose record takes about `bytes` is created
    /// (the caller lets an idempotent re-submit of an existing task through first).
    pub fn task(&self, id: &str, agent: &str, bytes: u64) -> Result<Reserved<'_>, Over> {
        let mut p = self.pending();
        let ids: Vec<String> = p.writing_tasks.iter().map(|t| t.0.clone()).collect();
        if let Some((u, of_agent, revision, held)) = self.tasks.usage_of_holding(agent, &ids) {
            p.seen_up_to(revision);
            // The tasks being written that the watch does not count yet.
            let unheld = || p.writing_tasks.iter().zip(&held).filter(|(_, h)| !**h);
            let writing = unheld().count() as u64;
            let writing_of_agent = unheld().filter(|(t, _)| t.1 == agent).count() as u64;
            let writing_bytes: u64 = unheld().map(|(t, _)| t.2).sum();
            let unseen_of_agent = p.unseen_tasks.iter().filter(|t| t.1 == agent).count() as u64;
            let unseen_bytes: u64 = p.unseen_tasks.iter().map(|t| t.2).sum();
            let non_terminal = u.non_terminal + writing + p.unseen_tasks.len() as u64;
            let limit = self.limits.max_tasks;
            within(TASKS, limit, Some(non_terminal), |n| {
                format!("{n} tasks are not finished; --max-tasks is {limit}: finish, cancel or delete some first")
            })?;
            self.task_bytes(u.bytes + writing_bytes + unseen_bytes, bytes)?;
            let limit = self.limits.max_tasks_per_agent;
            let of_agent = of_agent + writing_of_agent + unseen_of_agent;
            within(TASKS_PER_AGENT, limit, Some(of_agent), |n| {
                format!(
                    "agent {agent:?} has {n} unfinished tasks; --max-tasks-per-agent is {limit}"
                )
            })?;
        }
        p.writing_tasks
            .push((id.to_string(), agent.to_string(), bytes));
        Ok(Reserved {
            quotas: self,
            quota: Some(TASKS),
            name: id.to_string(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use meshd_stores::sessions::{MetaSessionStore, SessionStoreConfig};
    use meshd_stores::subscriptions::SubscriptionStoreConfig;
    use meshd_stores::tasks::{MetaTaskStore, TaskStore, TaskStoreConfig};
    use meshd_stores::topics::TopicStore;
    use std::time::Duration;

    struct Setup {
        quotas: Quotas,
        topics: Arc<MetaTopicStore>,
        tasks: MetaTaskStore,
        _dir: tempfile::TempDir,
    }

    /// Quotas over the real stores on an embedded Meta, with `limits`.
    async fn setup(limits: Limits) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let meta: Arc<dyn meshd_meta::Meta> = Arc::new(
            meshd_meta_embedded::EmbeddedMeta::open_dir(dir.path(), Default::default()).unwrap(),
        );
        let topics = Arc::new(MetaTopicStore::start(meta.clone()).await.unwrap());
        assert!(topics.wait_ready(Duration::from_secs(5)).await);
        let subscriptions = Arc::new(
            MetaSubscriptionStore::start(meta.clone(), SubscriptionStoreConfig::default()).unwrap(),
        );
        let sessions = Arc::new(
            MetaSessionStore::start(meta.clone(), SessionStoreConfig::new("i".to_string()))
                .unwrap(),
        );
        let watch = TaskUsageWatch::start(meta.clone()).unwrap();
        let tasks = MetaTaskStore::new(meta, TaskStoreConfig::default()).unwrap();
        Setup {
            quotas: Quotas::new(limits, topics.clone(), subscriptions, sessions, watch),
            topics,
            tasks,
            _dir: dir,
        }
    }

    /// A create whose store has put it in its cache while its place is still held
    /// counts once: a burst was refused below the quota while both counted it.
    #[tokio::test]
    async fn a_create_in_flight_counts_once_before_and_after_the_cache_holds_it() {
        let s = setup(Limits {
            max_response_bytes: 1 << 20,
            max_tasks: 100,
            max_tasks_per_agent: 2,
            max_task_bytes: 1 << 30,
            max_sessions: 100,
            max_topics: 2,
            max_subscriptions: 100,
        })
        .await;
        let a = s.quotas.topic("a").unwrap();
        s.topics.ensure("a", 1).await.unwrap();
        // "a" is in the cache and still being written: one topic, so "b" fits.
        let b = s.quotas.topic("b").unwrap();
        // "a" and "b" (in flight, not in the cache): the quota of 2 is reached.
        assert!(s.quotas.topic("c").is_err());
        drop((a, b));
        assert!(s.quotas.topic("c").is_ok());

        let t1 = s.quotas.task("t1", "x", 10).unwrap();
        s.tasks
            .submit(Some("t1"), "x", serde_json::json!({}))
            .await
            .unwrap();
        // Until the usage watch holds t1 it counts as written; then as watched, once.
        let ids = ["t1".to_string()];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !s
            .quotas
            .tasks
            .usage_of_holding("x", &ids)
            .is_some_and(|(_, _, _, held)| held[0])
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the watch never saw t1"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let t2 = s.quotas.task("t2", "x", 10).unwrap();
        assert!(s.quotas.task("t3", "x", 10).is_err());
        drop((t1, t2));
    }
}
