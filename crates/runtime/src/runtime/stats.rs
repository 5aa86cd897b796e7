//! Subscription statistics per partition (`GET /v1/subscriptions/{name}/stats`): the
//! gauges the partition task publishes for `/metrics` (refreshed at most every 250 ms),
//! the exact committed offset, the log's end, and the subscription's counters split by
//! partition. In cluster mode the partitions owned elsewhere are asked of their owners
//! (internal route, one call per owner); a partition whose owner cannot be asked is
//! listed as unavailable with the reason, never left out or shown as zeros.

use super::error::{peer_refused, RuntimeError};
use super::forwarding::PEER_TIMEOUT;
use super::state::{Runtime, SubRuntime};
use super::types::Reach;
use meshd_meta::Backend;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

/// One partition's figures, as the contract names them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartitionStats {
    pub partition: u32,
    /// The lowest unresolved offset (acks recorded; durable within the flush interval).
    pub committed: u64,
    /// The log's end (the next offset a publish gets).
    pub end_offset: u64,
    /// `end_offset - committed`: events not resolved yet.
    pub backlog: u64,
    /// Handed out (or being recorded for a hand-out), lease running.
    pub in_flight: u64,
    pub waiting_retries: u64,
    /// In the park index: waiting for their time, or handed out from it and not
    /// settled yet.
    pub parked: u64,
    pub dead_lettering: u64,
    pub delivered_total: u64,
    /// Hand-outs with attempt > 1 (absent from an owner of an older release: 0).
    #[serde(default)]
    pub redelivered_total: u64,
    pub acked_total: u64,
    pub nacked_total: u64,
    pub dead_lettered_total: u64,
    /// Cluster mode: the instance that answered for the partition (its owner).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
}

/// A partition of the answer: its figures, or why they could not be had.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartitionView {
    Known(PartitionStats),
    Unavailable { partition: u32, detail: String },
}

impl PartitionView {
    pub fn partition(&self) -> u32 {
        match self {
            PartitionView::Known(s) => s.partition,
            PartitionView::Unavailable { partition, .. } => *partition,
        }
    }
}

#[derive(Deserialize)]
struct WireStats {
    partitions: Vec<PartitionStats>,
}

impl Runtime {
    /// The statistics of every partition of subscription `name`; with `Reach::Local`
    /// only the partitions running here (what the internal route answers).
    pub async fn stats(
        &self,
        name: &str,
        reach: Reach,
    ) -> Result<Vec<PartitionView>, RuntimeError> {
        let sub = self.subscription(name).await?;
        let mut out: BTreeMap<u32, PartitionView> = BTreeMap::new();
        for s in self.stats_here(&sub).await? {
            out.insert(s.partition, PartitionView::Known(s));
        }
        if self.deps.cluster.is_some() && reach == Reach::Cluster {
            let missing: Vec<u32> = (0..sub.parts.len() as u32)
                .filter(|p| !out.contains_key(p))
                .collect();
            for v in self.stats_elsewhere(&sub, missing).await {
                out.insert(v.partition(), v);
            }
        }
        Ok(out.into_values().collect())
    }

    /// The partitions running here.
    async fn stats_here(&self, sub: &SubRuntime) -> Result<Vec<PartitionStats>, RuntimeError> {
        let counters = self.deps.metrics.subscription(sub.sub.name());
        let mut out = Vec::new();
        for p in 0..sub.parts.len() {
            let Some(part) = sub.part(p) else {
                continue;
            };
            let partition = p as u32;
            let bounds = self
                .deps
                .log
                .bounds(&sub.sub.spec.topic, partition)
                .await
                .map_err(|e| RuntimeError::Unavailable {
                    store: "log",
                    backend: self.deps.log_backend,
                    detail: e.to_string(),
                })?;
            let st = part.shared.stats();
            let committed = part.shared.committed.load(Ordering::Acquire);
            let end_offset = bounds.end.max(st.log_end).max(committed);
            let c = counters.partition(partition);
            out.push(PartitionStats {
                partition,
                committed,
                end_offset,
                backlog: end_offset - committed,
                in_flight: (st.in_flight + st.persisting) as u64,
                waiting_retries: st.waiting as u64,
                parked: part.shared.parked.load(Ordering::Acquire),
                dead_lettering: st.dead_lettering as u64,
                delivered_total: c.delivered.load(Ordering::Relaxed),
                redelivered_total: c.redelivered.load(Ordering::Relaxed),
                acked_total: c.acked.load(Ordering::Relaxed),
                nacked_total: c.nacked.load(Ordering::Relaxed),
                dead_lettered_total: c.dead_lettered.load(Ordering::Relaxed),
                owner: self
                    .deps
                    .cluster
                    .as_ref()
                    .map(|_| self.deps.instance_id.clone()),
            });
        }
        Ok(out)
    }

    /// Cluster mode: asks the owners of `partitions` (one call per owner).
    async fn stats_elsewhere(&self, sub: &SubRuntime, partitions: Vec<u32>) -> Vec<PartitionView> {
        let Some(cluster) = &self.deps.cluster else {
            return vec![];
        };
        let topic = &sub.sub.spec.topic;
        let mut out = Vec::new();
        let mut by_owner: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for p in partitions {
            let owner = cluster.directory.borrow().owner_of(topic, p);
            match owner {
                Some((holder, addr)) if holder != self.deps.instance_id => {
                    by_owner.entry(addr).or_default().push(p)
                }
                _ => out.push(PartitionView::Unavailable {
                    partition: p,
                    detail: format!("partition {p} of topic {topic:?} has no owner right now"),
                }),
            }
        }
        let path = format!(
            "/internal/v1/subscriptions/{}/stats",
            meshd_client::segment(sub.sub.name())
        );
        for (addr, wanted) in by_owner {
            let answer = cluster.peers.post(&addr, &path, b"{}", PEER_TIMEOUT).await;
            let got = match answer {
                Ok((200, body)) => serde_json::from_slice::<WireStats>(&body)
                    .map_err(|e| format!("instance {addr} answered stats with {e}")),
                Ok((status, body)) => Err(peer_refused(&addr, status, &body)),
                Err(e) => Err(format!("instance {addr}: {e}")),
            };
            match got {
                Ok(w) => {
                    let mut answered: BTreeMap<u32, PartitionStats> =
                        w.partitions.into_iter().map(|s| (s.partition, s)).collect();
                    for p in wanted {
                        out.push(match answered.remove(&p) {
                            Some(s) => PartitionView::Known(s),
                            // It moved between our look at the directory and its answer.
                            None => PartitionView::Unavailable {
                                partition: p,
                                detail: format!("partition {p} is changing owners; retry"),
                            },
                        });
                    }
                }
                Err(detail) => {
                    self.deps
                        .metrics
                        .store_error("owners", Backend::Http, "forward_failed");
                    tracing::warn!(store = "owners", peer = %addr, subscription = %sub.sub.name(), error = %detail, "asking an owner for subscription statistics failed");
                    out.extend(wanted.into_iter().map(|p| PartitionView::Unavailable {
                        partition: p,
                        detail: detail.clone(),
                    }));
                }
            }
        }
        out
    }
}
