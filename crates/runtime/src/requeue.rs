//! Returns `working` and `input-required` tasks to `submitted` when their assignee's
//! session ended (expired or taken over). Runs whenever the session cache changes and
//! at least every [`SWEEP_EVERY`] (a session that expired while this instance could not
//! see it is caught by the sweep). The session cache is only a hint: the task store
//! re-reads the session key and requeues only when that epoch is really gone, fenced by
//! the task's version, so two instances sweeping at once cannot do harm.

use crate::metrics::Metrics;
use meshd_stores::sessions::SessionStore;
use meshd_stores::tasks::{Requeue, TaskFilter, TaskState, TaskStore};
use std::sync::Arc;
use std::time::Duration;

const SWEEP_EVERY: Duration = Duration::from_secs(5);
/// Tasks are counted by state (a full scan) this often.
const COUNT_EVERY: Duration = Duration::from_secs(30);
const PAGE: usize = 500;

pub fn spawn(
    background: &crate::background::Background,
    tasks: Arc<dyn TaskStore>,
    sessions: Arc<dyn SessionStore>,
    changes: tokio::sync::watch::Receiver<u64>,
    metrics: Arc<Metrics>,
    backend: meshd_meta::Backend,
) {
    background.spawn(async move {
        let mut changes = changes;
        let mut counted: Option<std::time::Instant> = None;
        loop {
            if sessions.health().is_ready() {
                if let Err(e) = sweep(tasks.as_ref(), sessions.as_ref(), &metrics).await {
                    metrics.store_error("tasks", backend, "requeue_sweep");
                    tracing::warn!(store = "tasks", %backend, error = %e, "requeue sweep failed; retried");
                }
            }
            if counted.is_none_or(|t| t.elapsed() >= COUNT_EVERY) {
                match count(tasks.as_ref()).await {
                    Ok(c) => {
                        metrics.task_counts(c);
                        counted = Some(std::time::Instant::now());
                    }
                    Err(e) => {
                        tracing::warn!(store = "tasks", %backend, error = %e, "counting tasks failed; retried")
                    }
                }
            }
            let _ = tokio::time::timeout(SWEEP_EVERY, changes.changed()).await;
        }
    });
}

async fn count(
    tasks: &dyn TaskStore,
) -> Result<std::collections::BTreeMap<&'static str, u64>, String> {
    let mut counts: std::collections::BTreeMap<&'static str, u64> =
        TaskState::ALL.iter().map(|s| (s.as_str(), 0)).collect();
    let filter = TaskFilter {
        agent: None,
        state: None,
    };
    let mut cursor: Option<String> = None;
    loop {
        let page = tasks
            .list(&filter, PAGE, cursor.as_deref())
            .await
            .map_err(|e| e.to_string())?;
        for t in &page.tasks {
            *counts.entry(t.state.as_str()).or_default() += 1;
        }
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return Ok(counts),
        }
    }
}

async fn sweep(
    tasks: &dyn TaskStore,
    sessions: &dyn SessionStore,
    metrics: &Metrics,
) -> Result<(), String> {
    for state in [TaskState::Working, TaskState::InputRequired] {
        let filter = TaskFilter {
            agent: None,
            state: Some(state),
        };
        let mut cursor: Option<String> = None;
        loop {
            let page = tasks
                .list(&filter, PAGE, cursor.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            for t in &page.tasks {
                let Some(a) = &t.assignee else { continue };
                let live = match sessions.get(&a.session).await {
                    Ok(Some(s)) => s.epoch == a.epoch,
                    Ok(None) => false,
                    // Unknown: leave it for the next sweep.
                    Err(_) => true,
                };
                if live {
                    continue;
                }
                match tasks.requeue_if_assignee(&t.id, &a.session, a.epoch).await {
                    Ok(Requeue::Requeued(_)) => {
                        metrics.tasks_requeued();
                        tracing::info!(store = "tasks", task = %t.id, session = %a.session, "assignee session ended; task back to submitted");
                    }
                    Ok(_) => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
    }
    Ok(())
}
