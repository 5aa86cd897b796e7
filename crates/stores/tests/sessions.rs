//! # The SessionStore conformance suite, on both Meta backends
//!
//! Every case is one async function in [`suite`]; [`common::backend_cases!`] stamps out
//! `embedded::<case>` (EmbeddedMeta on a temp dir) and `etcd::<case>` (one real etcd
//! process per test). "Two instances" are two stores on two Meta clients (two
//! `EtcdMeta` clients of one etcd, or two clients of one `EmbeddedMeta`). A backend
//! "restart" SIGKILLs and restarts etcd, or closes and reopens the embedded RocksDB;
//! the stores keep their clients, which must recover on their own.
//!
//! Stories pinned here: a taken-over session that could still heartbeat, close or
//! write; a session that outlived its TTL without heartbeats, or died although
//! heartbeated; a TTL answer that was not the granted one; an instance that kept
//! acting for a session after it could no longer be sure of its lease; a Meta outage
//! answered as "no such session"; a session lost across a Meta restart.
//!
//! Liveness bounds are the configured TTL plus a fixed slack (etcd checks lease
//! expiry every 500 ms); nothing sleeps a fixed time and hopes.

mod common;

use common::{backend_cases, Harness};
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{Meta, MetaError, RangeOptions, Txn};
use meshd_stores::failure::StoreFailure;
use meshd_stores::sessions::{
    self, id_record, record, MetaSessionStore, Session, SessionError, SessionStore,
    SessionStoreConfig,
};
use meshd_test_support::wait::wait_until;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use suite::*;

backend_cases!(
    open_heartbeat_close_round_trip,
    takeover_from_a_second_instance_fences_the_previous_session,
    a_session_without_heartbeats_expires_within_its_ttl,
    heartbeats_keep_a_session_alive_past_its_ttl,
    the_ttl_answer_is_the_effective_granted_value,
    invalid_requests_are_rejected_naming_the_field,
    given_no_keep_alive_within_the_safety_deadline_then_the_instance_stops_acting_before_the_lease_can_expire,
    given_meta_down_then_session_operations_fail_typed_and_recover,
    given_a_meta_restart_then_live_sessions_survive,
    caches_of_two_instances_converge_to_meta,
    given_a_compacted_watch_position_then_the_session_cache_relists,
);

// ---------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------

const READY: Duration = Duration::from_secs(15);
/// The shortest TTL the API allows; most cases use it to stay fast.
const TTL: Duration = Duration::from_secs(2);
/// How late after its TTL a lease may be seen to end (etcd's lessor checks every
/// 500 ms; the test machine is small and shared).
const SLACK: Duration = Duration::from_secs(5);

async fn store(meta: Arc<dyn Meta>, instance: &str) -> MetaSessionStore {
    store_with(meta, SessionStoreConfig::new(instance)).await
}

async fn store_with(meta: Arc<dyn Meta>, config: SessionStoreConfig) -> MetaSessionStore {
    let s = MetaSessionStore::start(meta, config).expect("start the store");
    assert!(s.wait_ready(READY).await, "store ready: {:?}", s.health());
    s
}

fn is_outage(e: &SessionError) -> bool {
    matches!(
        e,
        SessionError::Store(StoreFailure::Unavailable(_))
            | SessionError::Store(StoreFailure::Indeterminate(_))
    )
}

/// Live sessions in Meta: client id -> (session id, epoch).
async fn meta_sessions(meta: &dyn Meta) -> anyhow::Result<BTreeMap<String, (String, i64)>> {
    let r = meta
        .range(&record::prefix(), RangeOptions::default())
        .await?;
    let mut out = BTreeMap::new();
    for kv in r.kvs {
        let client = keys::components(KeyKind::Sessions, &kv.key)
            .and_then(|mut c| c.pop())
            .ok_or_else(|| anyhow::anyhow!("bad key {:?}", kv.key))?;
        let v = record::decode_value(&client, &kv.value).map_err(anyhow::Error::msg)?;
        anyhow::ensure!(
            kv.lease == Some(v.lease),
            "owner key on the session's lease"
        );
        out.insert(client, (v.session_id, kv.mod_revision));
    }
    Ok(out)
}

async fn cached_sessions(s: &MetaSessionStore) -> anyhow::Result<BTreeMap<String, (String, i64)>> {
    Ok(s.list()
        .await?
        .into_iter()
        .map(|x| (x.client_id, (x.session_id, x.epoch)))
        .collect())
}

async fn converged(meta: &dyn Meta, stores: &[&MetaSessionStore]) {
    wait_until(
        Duration::from_secs(20),
        "session caches equal meta",
        || async {
            let m = meta_sessions(meta).await?;
            for (i, s) in stores.iter().enumerate() {
                let c = cached_sessions(s).await?;
                anyhow::ensure!(c == m, "store {i}: cache {c:?} != meta {m:?}");
            }
            Ok(())
        },
    )
    .await
    .expect("converged");
}

async fn owner(meta: &dyn Meta, client_id: &str) -> Option<meshd_meta::KeyValue> {
    meta.get(&record::key(client_id)).await.expect("read").kv
}

async fn id_key(meta: &dyn Meta, session_id: &str) -> Option<meshd_meta::KeyValue> {
    meta.get(&id_record::key(session_id))
        .await
        .expect("read")
        .kv
}

const DATA: &[u8] = b"test/sessions/data";

async fn data(meta: &dyn Meta) -> Option<Vec<u8>> {
    meta.get(DATA).await.expect("read").kv.map(|kv| kv.value)
}

// ---------------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------------

mod suite {
    use super::*;

    pub async fn open_heartbeat_close_round_trip(h: &mut Harness) {
        let m = h.meta();
        let s = store(m.clone(), "i-a").await;
        let t0 = Instant::now();
        let a = s.open("c-1", TTL).await.expect("open");
        assert!(record::is_session_id(&a.session_id), "{}", a.session_id);
        assert_eq!((a.client_id.as_str(), a.instance.as_str()), ("c-1", "i-a"));
        assert!(a.epoch > 0 && a.ttl >= TTL, "{a:?}");
        let kv = owner(m.as_ref(), "c-1").await.expect("owner key");
        assert_eq!(
            kv.mod_revision, a.epoch,
            "the epoch is the owner key's mod_revision"
        );
        assert_eq!(kv.lease, Some(a.lease));
        let idk = id_key(m.as_ref(), &a.session_id).await.expect("id key");
        assert_eq!(idk.lease, Some(a.lease));
        assert_eq!(idk.mod_revision, a.epoch, "both keys in one transaction");
        assert_eq!(s.get(&a.session_id).await.unwrap(), Some(a.clone()));
        let hb = s.heartbeat(&a.session_id).await.expect("heartbeat");
        assert_eq!((hb.epoch, hb.ttl), (a.epoch, a.ttl));
        let deadline = s.acting_deadline(&a.session_id).expect("tracked");
        assert!(deadline > t0 && deadline < Instant::now() + a.ttl);
        let b = s.open("c-2", TTL).await.unwrap();
        assert_ne!(a.session_id, b.session_id);
        assert!(b.epoch > a.epoch);
        assert_eq!(s.list().await.unwrap(), vec![a.clone(), b.clone()]);

        s.close(&a.session_id).await.expect("close");
        assert_eq!(s.get(&a.session_id).await.unwrap(), None);
        assert_eq!(owner(m.as_ref(), "c-1").await, None);
        assert_eq!(id_key(m.as_ref(), &a.session_id).await, None);
        assert_eq!(
            m.keep_alive(a.lease).await.unwrap_err(),
            MetaError::LeaseNotFound(a.lease),
            "the lease was revoked"
        );
        for r in [
            s.heartbeat(&a.session_id).await.map(|_| ()),
            s.close(&a.session_id).await,
        ] {
            assert!(matches!(r, Err(SessionError::NotFound { .. })), "{r:?}");
        }
        assert_eq!(s.list().await.unwrap(), vec![b.clone()]);
        assert_eq!(s.stats().takeovers, 0);
        converged(m.as_ref(), &[&s]).await;
    }

    pub async fn takeover_from_a_second_instance_fences_the_previous_session(h: &mut Harness) {
        let m = h.meta();
        let a = store(h.client().await, "i-a").await;
        let b = store(h.client().await, "i-b").await;
        let old = a.open("c", TTL).await.unwrap();
        a.commit_for(&old.session_id, Txn::new().put(DATA, b"old"))
            .await
            .expect("a live session writes");
        let new = b.open("c", TTL).await.unwrap();
        assert!(new.epoch > old.epoch, "a takeover has a higher epoch");
        assert_eq!(new.instance, "i-b");
        assert_eq!((b.takeovers(), b.stats().takeovers), (1, 1));
        let kv = owner(m.as_ref(), "c").await.unwrap();
        assert_eq!((kv.mod_revision, kv.lease), (new.epoch, Some(new.lease)));

        // Every operation of the old session is fenced, and nothing is applied.
        let fenced = |r: Result<(), SessionError>, what: &str| {
            assert!(
                matches!(&r, Err(SessionError::Fenced { session_id }) if *session_id == old.session_id),
                "{what}: {r:?}"
            );
        };
        fenced(a.heartbeat(&old.session_id).await.map(|_| ()), "heartbeat");
        fenced(a.close(&old.session_id).await, "close");
        fenced(
            a.commit_for(&old.session_id, Txn::new().put(DATA, b"stale"))
                .await
                .map(|_| ()),
            "commit_for",
        );
        fenced(a.check(&old.session_id, old.epoch).await, "check");
        // A write fenced with the old epoch, from anywhere, fails in Meta.
        assert_eq!(
            sessions::fence("c", old.epoch)
                .commit(m.as_ref(), Txn::new().put(DATA, b"stale"))
                .await
                .unwrap_err(),
            MetaError::Fenced
        );
        assert!(a.fenced_writes() >= 4, "{:?}", a.stats());
        assert_eq!(data(m.as_ref()).await.as_deref(), Some(&b"old"[..]));
        assert_eq!(
            owner(m.as_ref(), "c").await.unwrap().mod_revision,
            new.epoch,
            "the fenced close deleted nothing"
        );
        // The new session acts.
        b.commit_for(&new.session_id, Txn::new().put(DATA, b"new"))
            .await
            .unwrap();
        b.check(&new.session_id, new.epoch).await.unwrap();
        assert!(matches!(
            b.check(&new.session_id, old.epoch).await,
            Err(SessionError::Fenced { .. })
        ));
        assert_eq!(data(m.as_ref()).await.as_deref(), Some(&b"new"[..]));
        converged(m.as_ref(), &[&a, &b]).await;
        assert_eq!(a.get(&old.session_id).await.unwrap(), None);
        assert_eq!(a.get(&new.session_id).await.unwrap(), Some(new.clone()));

        // Once the old lease would have expired, the old session is unknown; the new
        // one, heartbeated meanwhile, lives on.
        wait_until(old.ttl + SLACK, "the old session is gone", || async {
            let hb = b.heartbeat(&new.session_id).await.expect("new heartbeats");
            assert_eq!(hb.epoch, new.epoch);
            match a.heartbeat(&old.session_id).await {
                Err(SessionError::NotFound { .. }) => Ok(()),
                Err(SessionError::Fenced { .. }) => anyhow::bail!("still fenced"),
                other => panic!("old session heartbeat: {other:?}"),
            }
        })
        .await
        .unwrap();
        assert_eq!(
            owner(m.as_ref(), "c").await.unwrap().mod_revision,
            new.epoch
        );
    }

    pub async fn a_session_without_heartbeats_expires_within_its_ttl(h: &mut Harness) {
        let m = h.meta();
        let a = store(h.client().await, "i-a").await;
        let b = store(h.client().await, "i-b").await;
        let t0 = Instant::now();
        let x = a.open("c", TTL).await.unwrap();
        converged(m.as_ref(), &[&a, &b]).await;
        assert_eq!(b.get(&x.session_id).await.unwrap(), Some(x.clone()));
        wait_until(x.ttl + SLACK, "the lease ended in meta", || async {
            let (o, i) = (
                m.get(&record::key("c")).await?.kv,
                m.get(&id_record::key(&x.session_id)).await?.kv,
            );
            anyhow::ensure!(
                o.is_none() && i.is_none(),
                "owner {} id {}",
                o.is_some(),
                i.is_some()
            );
            Ok(())
        })
        .await
        .unwrap();
        assert!(
            t0.elapsed() >= x.ttl,
            "expired after {:?}, before its TTL {:?}",
            t0.elapsed(),
            x.ttl
        );
        converged(m.as_ref(), &[&a, &b]).await;
        assert_eq!(a.list().await.unwrap(), vec![]);
        assert_eq!(b.get(&x.session_id).await.unwrap(), None);
        for s in [&a, &b] {
            let r = s.heartbeat(&x.session_id).await;
            assert!(matches!(r, Err(SessionError::NotFound { .. })), "{r:?}");
            let r = s
                .commit_for(&x.session_id, Txn::new().put(DATA, b"late"))
                .await;
            assert!(
                matches!(
                    r,
                    Err(SessionError::NotFound { .. } | SessionError::Expired { .. })
                ),
                "{r:?}"
            );
        }
        assert_eq!(data(m.as_ref()).await, None);
    }

    pub async fn heartbeats_keep_a_session_alive_past_its_ttl(h: &mut Harness) {
        let m = h.meta();
        let s = store(m.clone(), "i-a").await;
        let x = s.open("c", TTL).await.unwrap();
        let until = Instant::now() + x.ttl * 2 + Duration::from_secs(1);
        let mut beats = 0;
        while Instant::now() < until {
            let hb = s.heartbeat(&x.session_id).await.expect("heartbeat");
            assert_eq!((hb.epoch, hb.ttl), (x.epoch, x.ttl));
            assert!(
                owner(m.as_ref(), "c").await.is_some(),
                "lost while heartbeated"
            );
            s.fence_for(&x.session_id)
                .await
                .expect("acting while heartbeated");
            beats += 1;
            tokio::time::sleep(x.ttl / 4).await;
        }
        assert!(beats >= 8);
        assert_eq!(
            owner(m.as_ref(), "c").await.unwrap().mod_revision,
            x.epoch,
            "heartbeats never rewrite the owner key"
        );
        assert_eq!(s.get(&x.session_id).await.unwrap(), Some(x));
    }

    pub async fn the_ttl_answer_is_the_effective_granted_value(h: &mut Harness) {
        let m = h.meta();
        let s = store(m.clone(), "i-a").await;
        let x = s.open("c", Duration::from_millis(2500)).await.unwrap();
        let expected = match h.name {
            // etcd grants whole seconds.
            "etcd" => Duration::from_secs(3),
            _ => Duration::from_millis(2500),
        };
        assert_eq!(x.ttl, expected);
        assert_eq!(x.ttl_ms(), expected.as_millis() as u64);
        assert_eq!(s.heartbeat(&x.session_id).await.unwrap().ttl, expected);
        assert_eq!(s.get(&x.session_id).await.unwrap().unwrap().ttl, expected);
        let stored =
            record::decode_value("c", &owner(m.as_ref(), "c").await.unwrap().value).unwrap();
        assert_eq!(stored.ttl, expected);
        // The range edges.
        assert_eq!(
            s.open("min", sessions::MIN_TTL).await.unwrap().ttl,
            sessions::MIN_TTL
        );
        assert_eq!(
            s.open("max", sessions::MAX_TTL).await.unwrap().ttl,
            sessions::MAX_TTL
        );
    }

    pub async fn invalid_requests_are_rejected_naming_the_field(h: &mut Harness) {
        let m = h.meta();
        let s = store(m.clone(), "i-a").await;
        let cases: Vec<(&str, String, Duration)> = vec![
            ("ttl_ms", "c".into(), Duration::from_millis(1999)),
            ("ttl_ms", "c".into(), Duration::from_millis(3_600_001)),
            ("client_id", String::new(), TTL),
            ("client_id", "a/b".into(), TTL),
            ("client_id", "a b".into(), TTL),
            ("client_id", "x".repeat(250), TTL),
        ];
        for (field, client, ttl) in cases {
            match s.open(&client, ttl).await {
                Err(SessionError::Invalid { field: f, reason }) => {
                    assert_eq!(f, field, "{client:?} {ttl:?}: {reason}")
                }
                other => panic!("{field}: expected Invalid, got {other:?}"),
            }
        }
        let all = m
            .range(&keys::key(KeyKind::Sessions, &[]), RangeOptions::default())
            .await
            .unwrap();
        assert!(all.kvs.is_empty(), "nothing was written");
        for id in [
            "nope",
            "../../x",
            "0123456789ABCDEF0123456789ABCDEF",
            &"0".repeat(32),
        ] {
            assert!(
                matches!(s.heartbeat(id).await, Err(SessionError::NotFound { .. })),
                "{id}"
            );
            assert!(
                matches!(s.close(id).await, Err(SessionError::NotFound { .. })),
                "{id}"
            );
            assert!(
                matches!(s.check(id, 1).await, Err(SessionError::NotFound { .. })),
                "{id}"
            );
            assert!(matches!(
                s.commit_for(id, Txn::new().put(DATA, b"x")).await,
                Err(SessionError::NotFound { .. })
            ));
            assert_eq!(s.get(id).await.unwrap(), None);
        }
        assert_eq!(data(m.as_ref()).await, None);
        for (field, config) in [
            ("instance", SessionStoreConfig::new("")),
            (
                "safety_margin",
                SessionStoreConfig {
                    safety_margin: Some(sessions::MIN_TTL),
                    ..SessionStoreConfig::new("i")
                },
            ),
        ] {
            match MetaSessionStore::start(m.clone(), config) {
                Err(SessionError::Invalid { field: f, .. }) => assert_eq!(f, field),
                Err(e) => panic!("{field}: {e:?}"),
                Ok(_) => panic!("{field}: accepted"),
            }
        }
    }

    pub async fn given_no_keep_alive_within_the_safety_deadline_then_the_instance_stops_acting_before_the_lease_can_expire(
        h: &mut Harness,
    ) {
        let m = h.meta();
        let margin = Duration::from_millis(1500);
        let s = store_with(
            m.clone(),
            SessionStoreConfig {
                safety_margin: Some(margin),
                ..SessionStoreConfig::new("i-a")
            },
        )
        .await;
        let before = Instant::now();
        let x = s.open("c", Duration::from_secs(3)).await.unwrap();
        let deadline = s.acting_deadline(&x.session_id).unwrap();
        assert!(deadline >= before + x.ttl - margin && deadline <= Instant::now() + x.ttl - margin);
        s.commit_for(&x.session_id, Txn::new().put(DATA, b"1"))
            .await
            .expect("acting before the deadline");
        tokio::time::sleep_until((deadline + Duration::from_millis(20)).into()).await;
        let expired = |r: Result<(), SessionError>, what: &str| {
            assert!(
                matches!(r, Err(SessionError::Expired { .. })),
                "{what}: {r:?}"
            );
        };
        expired(s.fence_for(&x.session_id).await.map(|_| ()), "fence_for");
        expired(
            s.commit_for(&x.session_id, Txn::new().put(DATA, b"2"))
                .await
                .map(|_| ()),
            "commit_for",
        );
        expired(s.check(&x.session_id, x.epoch).await, "check");
        assert!(s.stats().expired_locally >= 3);
        // Meta still holds the session: the instance stopped first.
        let kv = owner(m.as_ref(), "c").await;
        assert!(
            kv.is_some(),
            "the lease had already ended {:?} after the open",
            before.elapsed()
        );
        assert_eq!(data(m.as_ref()).await.as_deref(), Some(&b"1"[..]));
        // A heartbeat proves the lease live again and re-arms the deadline.
        let hb = s.heartbeat(&x.session_id).await.expect("heartbeat");
        assert_eq!(hb.epoch, x.epoch);
        assert!(s.acting_deadline(&x.session_id).unwrap() > deadline);
        s.commit_for(&x.session_id, Txn::new().put(DATA, b"3"))
            .await
            .expect("acting again");
        assert_eq!(data(m.as_ref()).await.as_deref(), Some(&b"3"[..]));
    }

    pub async fn given_meta_down_then_session_operations_fail_typed_and_recover(h: &mut Harness) {
        let s = store(h.client().await, "i-a").await;
        let ttl = Duration::from_secs(5);
        let x = s.open("c", ttl).await.unwrap();
        h.stop();
        let r = s.open("d", TTL).await;
        assert!(matches!(&r, Err(e) if is_outage(e)), "open: {r:?}");
        let r = s.heartbeat(&x.session_id).await;
        assert!(
            matches!(&r, Err(e) if is_outage(e)),
            "heartbeat, never NotFound: {r:?}"
        );
        let r = s.close(&x.session_id).await;
        assert!(matches!(&r, Err(e) if is_outage(e)), "close: {r:?}");
        let r = s
            .commit_for(&x.session_id, Txn::new().put(DATA, b"x"))
            .await;
        assert!(matches!(&r, Err(e) if is_outage(e)), "commit_for: {r:?}");
        let r = s.check(&x.session_id, x.epoch).await;
        assert!(matches!(&r, Err(e) if is_outage(e)), "check: {r:?}");
        // The cache still answers with the last known state.
        assert_eq!(s.get(&x.session_id).await.unwrap(), Some(x.clone()));
        wait_until(
            Duration::from_secs(10),
            "the cache reports not live",
            || async {
                anyhow::ensure!(!s.health().live, "{:?}", s.health());
                Ok(())
            },
        )
        .await
        .unwrap();

        h.start().await;
        let hb = wait_until(Duration::from_secs(20), "heartbeats work again", || async {
            Ok(s.heartbeat(&x.session_id).await?)
        })
        .await
        .unwrap();
        assert_eq!(hb.epoch, x.epoch);
        let m = h.meta();
        // Nothing half-written by the failed open: both keys or none.
        if let Some(kv) = owner(m.as_ref(), "d").await {
            let v = record::decode_value("d", &kv.value).unwrap();
            assert!(id_key(m.as_ref(), &v.session_id).await.is_some());
        }
        assert_eq!(data(m.as_ref()).await, None);
        let d = s.open("d", TTL).await.expect("open after recovery");
        assert!(s.wait_ready(READY).await, "{:?}", s.health());
        converged(m.as_ref(), &[&s]).await;
        assert_eq!(s.get(&d.session_id).await.unwrap(), Some(d));
    }

    pub async fn given_a_meta_restart_then_live_sessions_survive(h: &mut Harness) {
        let a = store(h.client().await, "i-a").await;
        let x = a.open("c", Duration::from_secs(5)).await.unwrap();
        h.restart().await;
        let hb = wait_until(
            Duration::from_secs(20),
            "heartbeat after restart",
            || async { Ok(a.heartbeat(&x.session_id).await?) },
        )
        .await
        .unwrap();
        assert_eq!(hb.epoch, x.epoch);
        let fresh = store(h.client().await, "i-c").await;
        assert_eq!(fresh.get(&x.session_id).await.unwrap(), Some(x.clone()));
        fresh
            .heartbeat(&x.session_id)
            .await
            .expect("from another instance");
        fresh
            .commit_for(&x.session_id, Txn::new().put(DATA, b"after"))
            .await
            .expect("a write for the session");
        let m = h.meta();
        assert_eq!(owner(m.as_ref(), "c").await.unwrap().mod_revision, x.epoch);
        converged(m.as_ref(), &[&a, &fresh]).await;
    }

    pub async fn caches_of_two_instances_converge_to_meta(h: &mut Harness) {
        let m = h.meta();
        let a = store(h.client().await, "i-a").await;
        let b = store(h.client().await, "i-b").await;
        let ttl = Duration::from_secs(30);
        let mut opened: Vec<Session> = Vec::new();
        for c in ["c1", "c2", "c3"] {
            opened.push(a.open(c, ttl).await.unwrap());
        }
        let c2 = b.open("c2", ttl).await.unwrap();
        // A session opened on one instance can be closed through another.
        b.close(&opened[2].session_id)
            .await
            .expect("close elsewhere");
        converged(m.as_ref(), &[&a, &b]).await;
        let expected: BTreeMap<String, (String, i64)> = [
            (
                "c1".to_string(),
                (opened[0].session_id.clone(), opened[0].epoch),
            ),
            ("c2".to_string(), (c2.session_id.clone(), c2.epoch)),
        ]
        .into();
        assert_eq!(cached_sessions(&a).await.unwrap(), expected);
        assert!(matches!(
            a.heartbeat(&opened[1].session_id).await,
            Err(SessionError::Fenced { .. })
        ));
        assert!(matches!(
            a.heartbeat(&opened[2].session_id).await,
            Err(SessionError::NotFound { .. })
        ));
        for x in [&opened[0], &c2] {
            a.close(&x.session_id).await.unwrap();
        }
        converged(m.as_ref(), &[&a, &b]).await;
        assert!(b.list().await.unwrap().is_empty());
    }

    pub async fn given_a_compacted_watch_position_then_the_session_cache_relists(h: &mut Harness) {
        let m = h.meta();
        let client = h.client().await;
        let b = store(client.clone(), "i-b").await;
        let a = store(h.client().await, "i-a").await;
        let ttl = Duration::from_secs(30);
        let gone = a.open("gone", ttl).await.unwrap();
        a.open("stays", ttl).await.unwrap();
        converged(m.as_ref(), &[&a, &b]).await;
        client.block_watches();
        wait_until(Duration::from_secs(10), "the watch is down", || async {
            anyhow::ensure!(!b.health().live, "still live");
            Ok(())
        })
        .await
        .unwrap();
        a.close(&gone.session_id).await.unwrap();
        let added = a.open("added", ttl).await.unwrap();
        let taken = a.open("stays", ttl).await.unwrap();
        let revision = m.status().await.unwrap().revision;
        m.compact(revision).await.expect("compact");
        assert_eq!(
            b.get(&gone.session_id).await.unwrap(),
            Some(gone.clone()),
            "stale while blocked"
        );
        client.unblock_watches();
        converged(m.as_ref(), &[&a, &b]).await;
        assert!(b.health().relists >= 1, "{:?}", b.health());
        assert_eq!(b.get(&gone.session_id).await.unwrap(), None);
        assert_eq!(b.get(&added.session_id).await.unwrap(), Some(added));
        assert_eq!(b.get(&taken.session_id).await.unwrap(), Some(taken));
    }
}
