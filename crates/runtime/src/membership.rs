//! Cluster membership: every instance holds `members/{instance id}` in Meta under a
//! lease of `--lease-ttl-ms`, renewed at a third of it. `/v1/cluster` lists the members
//! from Meta, so an instance that died (or lost Meta) drops out within its lease TTL.
//! When the lease is lost (expired while Meta was unreachable) a new one is granted and
//! the key written again.

use meshd_meta::fence::LeaseDeadline;
use meshd_meta::keys::{key, prefix, KeyKind};
use meshd_meta::{LeaseId, Meta, Precondition, RangeOptions};
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The version of [`MemberRecord`] this release writes.
const VERSION: u64 = 1;

/// What `members/{instance id}` holds: who the member is, where it listens, since
/// when, and which release it runs (so that a feature writing new record shapes can
/// wait until every member reads them). Fields a later release adds are ignored
/// here, not "corrupt"; a record without `v`, or of a version above this one's,
/// still names its instance and address where it can.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberRecord {
    #[serde(default)]
    pub v: u64,
    pub instance: String,
    pub addr: String,
    #[serde(default)]
    pub since: String,
    /// The member's meshd release (`CARGO_PKG_VERSION`); empty from a release that
    /// did not write it.
    #[serde(default)]
    pub release: String,
}

/// A meshd release as members announce it (`major.minor.patch`). A record that names
/// none comes from before members announced their release: the oldest of all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Release(pub u64, pub u64, pub u64);

impl Release {
    /// This binary's release.
    pub fn this() -> Release {
        Release::parse(env!("CARGO_PKG_VERSION"))
    }

    /// `1.2.3` (a pre-release or build suffix is ignored); anything else is the oldest
    /// release, so a record nobody can place never switches a new shape on.
    pub fn parse(s: &str) -> Release {
        let core = s.split(['-', '+']).next().unwrap_or_default();
        let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(Some(a)), Some(Some(b)), Some(Some(c)), None) => Release(a, b, c),
            _ => Release::default(),
        }
    }
}

impl std::fmt::Display for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

/// The release that first knows the park journal (parked events move with their
/// partition): while an older one is a member, retries are not parked.
pub const PARKING_RELEASE: Release = Release(0, 2, 0);

/// The release that first reads an attempt-ledger record carrying its writer's epoch
/// (`"e"`; 0.1.0 refuses it as corrupt): the owner's epoch is written into the records
/// only while every member runs this release or a later one.
pub const LEDGER_EPOCH_RELEASE: Release = Release(0, 2, 0);

/// The oldest release among `members` (this binary's when there are none yet). A
/// record shape that release R first reads is written only while
/// `oldest_release(members) >= R`: during a rolling upgrade the old shape stays in use
/// until the last member of the previous release has left (state-plane.md,
/// "Records"). A member that joins later with an older release lowers it again, and
/// writers switch back; readers always read both shapes.
pub fn oldest_release(members: &[MemberRecord]) -> Release {
    members
        .iter()
        .map(|m| Release::parse(&m.release))
        .min()
        .unwrap_or_else(Release::this)
}

/// Member records that could not be decoded (counted; the member is left out of the
/// ownership plan and the directory, so it owns nothing until it writes a readable
/// record).
static UNDECODABLE: AtomicU64 = AtomicU64::new(0);
/// The membership lease as the owner side sees it: which lease owner keys are attached
/// to, and until when this instance may act on them.
#[derive(Clone, Copy, Debug)]
pub struct LeaseState {
    pub id: LeaseId,
    pub deadline: LeaseDeadline,
}

/// How many member records could not be decoded so far.
pub fn undecodable_records() -> u64 {
    UNDECODABLE.load(Ordering::Relaxed)
}

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
    pub fn spawn(
        self,
        background: &crate::background::Background,
        stop: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        background.spawn(async move { self.run(stop).await })
    }

    async fn register(&self) -> Result<LeaseId, meshd_meta::MetaError> {
        let sent_at = Instant::now();
        let lease = self.meta.grant(self.ttl).await?;
        let value = serde_json::to_string(&MemberRecord {
            v: VERSION,
            instance: self.instance_id.clone(),
            addr: self.addr.clone(),
            since: meshd_stores::time::Timestamp::now().to_rfc3339(),
            release: env!("CARGO_PKG_VERSION").to_string(),
        })
        .map_err(|e| {
            meshd_meta::MetaError::InvalidRequest(format!("encoding the member record: {e}"))
        })?;
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
                        tracing::info!(store = "members", backend = %self.meta.backend(), instance = %self.instance_id, "membership registered");
                        lease = Some(id);
                    }
                    Err(e) => {
                        tracing::warn!(store = "members", backend = %self.meta.backend(), error = %e, "membership registration failed; retrying");
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
                            tracing::warn!(store = "members", backend = %self.meta.backend(), error = %e, "membership keep-alive failed");
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
                tracing::info!(store = "members", backend = %self.meta.backend(), instance = %self.instance_id, "membership lease revoked: this instance left the cluster")
            }
            Err(e) => {
                tracing::warn!(store = "members", backend = %self.meta.backend(), error = %e, "revoking the membership lease failed; it ends with its TTL")
            }
        }
    }
}

/// The members Meta knows (instances holding a membership lease), by instance id.
/// A record that does not decode is left out, counted
/// (`meshd_meta_undecodable_records_total{store="members"}`) and logged at most once
/// a minute.
pub async fn members(meta: &dyn Meta) -> Result<Vec<MemberRecord>, meshd_meta::MetaError> {
    let r = meta
        .range(&prefix(KeyKind::Members, &[]), RangeOptions::default())
        .await?;
    let mut out = Vec::with_capacity(r.kvs.len());
    for kv in &r.kvs {
        match serde_json::from_slice::<MemberRecord>(&kv.value) {
            Ok(m) => out.push(m),
            Err(e) => {
                UNDECODABLE.fetch_add(1, Ordering::Relaxed);
                static LOGGED: std::sync::Mutex<Option<Instant>> = std::sync::Mutex::new(None);
                let mut last = LOGGED
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    *last = Some(Instant::now());
                    tracing::warn!(store = "members", backend = %meta.backend(), key = %String::from_utf8_lossy(&kv.key), error = %e, "a member record does not decode; that member is left out of the cluster view and owns nothing");
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_announced_release_gates_new_record_shapes() {
        let member = |release: &str| MemberRecord {
            v: VERSION,
            instance: format!("i-{release}"),
            addr: "h:1".into(),
            since: String::new(),
            release: release.into(),
        };
        assert_eq!(Release::parse("0.2.0"), Release(0, 2, 0));
        assert_eq!(Release::parse("1.10.3-rc.1+abc"), Release(1, 10, 3));
        for unplaceable in ["", "1.2", "1.2.3.4", "x.y.z", "1.-2.3"] {
            assert_eq!(
                Release::parse(unplaceable),
                Release::default(),
                "{unplaceable}"
            );
        }
        assert!(Release(0, 10, 0) > Release(0, 9, 9));
        let mixed = [member("0.2.0"), member("0.1.0"), member("0.3.1")];
        assert_eq!(oldest_release(&mixed), Release(0, 1, 0));
        // A member of a release that did not announce one holds every new shape back.
        assert_eq!(
            oldest_release(&[member("0.2.0"), member("")]),
            Release::default()
        );
        assert_eq!(oldest_release(&[]), Release::this());
        assert_eq!(Release(0, 2, 0).to_string(), "0.2.0");
    }

    #[test]
    fn records_of_other_releases_decode_and_garbage_does_not() {
        // The record of the release before this one (no `v`, no `release`).
        let old: MemberRecord = serde_json::from_str(
            r#"{"instance":"a","addr":"127.0.0.1:1","since":"2026-11-01T00:00:00.000Z"}"#,
        )
        .unwrap();
        assert_eq!(
            (old.instance.as_str(), old.v, old.release.as_str()),
            ("a", 0, "")
        );
        // A later release's record with a field this one does not know.
        let later: MemberRecord = serde_json::from_str(
            r#"{"v":2,"instance":"b","addr":"h:2","since":"","release":"9.0.0","reads":["ledger-v3"]}"#,
        )
        .unwrap();
        assert_eq!(
            (later.instance.as_str(), later.release.as_str()),
            ("b", "9.0.0")
        );
        for bad in [&b"{}"[..], b"garbage", br#"{"instance":1,"addr":"x"}"#] {
            assert!(serde_json::from_slice::<MemberRecord>(bad).is_err());
        }
    }
}
