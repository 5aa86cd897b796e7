//! What the tasks in Meta take, followed by a watch: non-terminal tasks (in all and
//! per agent) and the bytes of every task record, for the `--max-tasks`,
//! `--max-tasks-per-agent` and `--max-task-bytes` quotas (http-api.md "Quotas and
//! browser safety"). Holds one small summary per task, never its input or output.
//! Each instance follows Meta's changes, so counts lag across instances by the watch's
//! delay at most.

use super::{record, TaskError};
use crate::cache::{CacheConfig, CacheHealth, Codec, CorruptRecord, WatchedCache};
use crate::codec::key_text;
use crate::failure::StoreFailure;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{KeyValue, Meta};
use std::sync::Arc;

/// What the quotas count of one task record.
#[derive(Clone, Debug)]
struct Summary {
    agent: String,
    terminal: bool,
    /// Key and value as Meta keeps them.
    bytes: u64,
}

struct SummaryCodec;

impl Codec<Summary> for SummaryCodec {
    fn name(&self, key: &[u8]) -> Result<String, CorruptRecord> {
        match keys::components(KeyKind::Tasks, key).as_deref() {
            Some([id]) => Ok(id.clone()),
            _ => Err(CorruptRecord {
                key: key_text(key),
                reason: "not a task key (meshd/v1/tasks/{id})".into(),
            }),
        }
    }

    fn decode(&self, name: &str, kv: &KeyValue) -> Result<Summary, CorruptRecord> {
        let bytes = (kv.key.len() + kv.value.len()) as u64;
        // A record that does not decode still takes its bytes in Meta; it counts as
        // non-terminal of no agent (the task store reports the damage itself).
        Ok(match record::decode(name, &kv.value, kv.mod_revision) {
            Ok(t) => Summary {
                agent: t.agent,
                terminal: t.state.is_terminal(),
                bytes,
            },
            Err(_) => Summary {
                agent: String::new(),
                terminal: false,
                bytes,
            },
        })
    }
}

/// Totals over every task record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskUsage {
    pub non_terminal: u64,
    pub bytes: u64,
}

/// Follows the task records in Meta (see the module docs).
pub struct TaskUsageWatch {
    cache: WatchedCache<Summary>,
}

impl TaskUsageWatch {
    /// Starts following. Needs a Tokio runtime; does not wait for Meta.
    pub fn start(meta: Arc<dyn Meta>) -> Result<Self, TaskError> {
        let cache = WatchedCache::start(
            "tasks",
            meta,
            keys::prefix(KeyKind::Tasks, &[]),
            Box::new(SummaryCodec),
            &CacheConfig::default(),
        )
        .map_err(|m| TaskError::Store(StoreFailure::Failed(m)))?;
        Ok(Self { cache })
    }

    /// Totals now; `None` before the first load.
    pub fn usage(&self) -> Option<TaskUsage> {
        self.cache.fold(TaskUsage::default(), |mut u, s| {
            u.bytes += s.bytes;
            u.non_terminal += u64::from(!s.terminal);
            u
        })
    }

    /// Totals, the non-terminal tasks of `agent`, the Meta revision every change up to
    /// which they reflect, and which of the tasks `ids` the watch holds, read together
    /// (for the quotas, which add this instance's creates in flight: each counts once,
    /// before the watch has it and after); `None` before the first load.
    pub fn usage_of_holding(
        &self,
        agent: &str,
        ids: &[String],
    ) -> Option<(TaskUsage, u64, i64, Vec<bool>)> {
        let ((u, of_agent), revision, held) = self.cache.fold_at_holding(
            (TaskUsage::default(), 0u64),
            |(mut u, n), s| {
                u.bytes += s.bytes;
                u.non_terminal += u64::from(!s.terminal);
                (u, n + u64::from(!s.terminal && s.agent == agent))
            },
            ids,
        )?;
        Some((u, of_agent, revision, held))
    }

    /// Non-terminal tasks of `agent` now; `None` before the first load.
    pub fn non_terminal_of(&self, agent: &str) -> Option<u64> {
        self.cache
            .fold(0u64, |n, s| n + u64::from(!s.terminal && s.agent == agent))
    }

    pub fn health(&self) -> CacheHealth {
        self.cache.health()
    }
}
