//! Cluster membership: every instance holds `members/{instance id}` in Meta under a
//! lease of `--lease-ttl-ms`, renewed at a third of it. `/v1/cluster` lists the members
//! from Meta, so an instance that died (or lost Meta) drops out within its lease TTL.
//! When the lease is lost (expired while Meta was unreachable) a new one is granted and
//! the key written again.

use crate::cluster::ownership::LeaseState;
use meshd_meta::fence::LeaseDeadline;
use meshd_meta::keys::{key, prefix, KeyKind};
use meshd_meta::{LeaseId, Meta, Precondition, RangeOptions};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub struct Membership {
    meta: Arc<dyn Meta>,
    instance_id: String,
    addr: String,
    ttl: Duration,
    /// The current lease and the local deadline to stop acting under it (partition
    /// owner keys hang on this lease in cluster mode).
    lease: tokio::sync::watch::Sender<Option<LeaseState>>,
}

impl Membership {
    pub fn new(meta: Arc<dyn Meta>, instance_id: String, addr: String, ttl: Duration) -> Self {
        Self {
            meta,
            instance_id,
            addr,
            ttl,
            lease: tokio::sync::watch::channel(None).0,
        }
    }

    /// Follows the membership lease (partition owner keys hang on it in cluster
    /// mode).
    pub fn lease(&self) -> tokio::sync::watch::Receiver<Option<LeaseState>> {
        self.lease.subscribe()
    }

    /// Registers and keeps the membership alive until `stop` is set: then the lease
    /// is revoked (the member key and every owner key on it go at once, so the other
    /// instances take what is left without waiting for the TTL) and the task ends.
    pub fn spawn(self, stop: tokio::sync::watch::Receiver<bool>) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move { self.run(stop).await })
    }

    async fn register(&self) -> Result<LeaseId, meshd_meta::MetaError> {
        let sent_at = Instant::now();
        let lease = self.meta.grant(self.ttl).await?;
        let value = json!({
            "instance": self.instance_id,
            "addr": self.addr,
            "since": meshd_stores::time::Timestamp::now().to_rfc3339(),
        })
        .to_string();
        self.meta
            .put(
                &key(KeyKind::Members, &[&self.instance_id]),
                value.as_bytes(),
                Precondition::None,
                Some(lease.id),
            )
            .await?;
        self.lease.send_replace(Some(LeaseState {
            id: lease.id,
            deadline: LeaseDeadline::new(
                lease.ttl,
                LeaseDeadline::default_margin(lease.ttl),
                sent_at,
            ),
        }));
        Ok(lease.id)
    }

    async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        let renew = self.ttl / 3;
        let mut lease: Option<LeaseId> = None;
        loop {
            if *stop.borrow_and_update() {
                self.leave(lease).await;
                return;
            }
            match lease {
                None => match self.register().await {
                    Ok(id) => {
                        tracing::info!(store = "members", backend = self.meta.backend(), instance = %self.instance_id, "membership registered");
                        lease = Some(id);
                    }
                    Err(e) => {
                        tracing::warn!(store = "members", backend = self.meta.backend(), error = %e, "membership registration failed; retrying");
                    }
                },
                Some(id) => {
                    let sent_at = Instant::now();
                    match self.meta.keep_alive(id).await {
                        Ok(ttl) => self.lease.send_modify(|l| {
                            if let Some(l) = l.as_mut().filter(|l| l.id == id) {
                                l.deadline.renewed(sent_at, ttl);
                            }
                        }),
                        Err(e) => {
                            tracing::warn!(store = "members", backend = self.meta.backend(), error = %e, "membership keep-alive failed");
                            if matches!(e, meshd_meta::MetaError::LeaseNotFound(_)) {
                                self.lease.send_replace(None);
                                lease = None;
                                continue;
                            }
                        }
                    }
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(renew) => {}
                r = stop.changed() => if r.is_err() {
                    return;
                },
            }
        }
    }

    /// Revokes the lease at a graceful stop (bounded by the Meta request timeout).
    async fn leave(&self, lease: Option<LeaseId>) {
        self.lease.send_replace(None);
        let Some(id) = lease else { return };
        match self.meta.revoke(id).await {
            Ok(()) => {
                tracing::info!(store = "members", backend = self.meta.backend(), instance = %self.instance_id, "membership lease revoked: this instance left the cluster")
            }
            Err(e) => {
                tracing::warn!(store = "members", backend = self.meta.backend(), error = %e, "revoking the membership lease failed; it ends with its TTL")
            }
        }
    }
}

/// The members Meta knows (instances holding a membership lease), by instance id.
pub async fn members(meta: &dyn Meta) -> Result<Vec<Value>, meshd_meta::MetaError> {
    let r = meta
        .range(&prefix(KeyKind::Members, &[]), RangeOptions::default())
        .await?;
    Ok(r.kvs
        .iter()
        .filter_map(|kv| serde_json::from_slice::<Value>(&kv.value).ok())
        .collect())
}
