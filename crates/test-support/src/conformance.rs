//! # The Meta conformance suite
//!
//! One async function per case; every Meta backend runs all of them through
//! [`meta_conformance_tests!`](crate::meta_conformance_tests), which stamps out one
//! named `#[tokio::test]` per case in a module named after the backend, so
//! `embedded::cas_race_…` and `etcd::cas_race_…` are reported (and filterable) on
//! their own. A backend provides a [`MetaHarness`]: the client under test and a way to
//! restart the backend for real (a SIGKILLed and restarted etcd process; a closed and
//! reopened RocksDB for the embedded backend).

use crate::wait::wait_until;
use async_trait::async_trait;
use futures::StreamExt;
use meshd_meta::fence::Ownership;
use meshd_meta::{
    Compare, KeyValue, Meta, MetaError, Precondition, RangeOptions, Txn, WatchError, WatchEvent,
    WatchStream,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A backend under test.
#[async_trait]
pub trait MetaHarness: Send {
    /// The client to use now (after a restart, possibly a new one for backends whose
    /// client is the store itself).
    fn meta(&self) -> Arc<dyn Meta>;

    /// Restarts the backend for real: SIGKILL and restart of the etcd process (the
    /// client is kept and must recover), or close and reopen of the embedded store.
    async fn restart(&mut self) -> anyhow::Result<()>;
}

/// Stamps out one test per conformance case for a backend, in a module named after
/// the backend (`embedded::watch_delivers_every_change_in_order`).
///
/// ```ignore
/// meshd_test_support::meta_conformance_tests!(embedded, crate::harness());
/// ```
/// `$make` is an async expression yielding a `MetaHarness`.
#[macro_export]
macro_rules! meta_conformance_tests {
    ($backend:ident, $make:expr) => {
        $crate::meta_conformance_tests!(@cases $backend, $make,
            get_put_report_store_issued_revisions,
            absent_precondition_admits_one_creator,
            mod_revision_precondition_rejects_stale_writers,
            delete_honours_preconditions_and_absent_keys_do_not_move_the_revision,
            recreated_key_gets_a_new_create_revision,
            range_lists_a_prefix_in_pages,
            txn_applies_all_or_nothing,
            txn_conflict_names_the_failed_key,
            txn_rejects_two_operations_on_one_key,
            empty_keys_are_invalid_requests,
            cas_race_has_exactly_one_winner_per_round,
            cas_counter_under_contention_loses_no_update,
            lease_expiry_removes_attached_keys,
            keep_alive_keeps_attached_keys,
            revoke_removes_attached_keys_and_ends_the_lease,
            watch_delivers_every_change_in_order,
            watch_resumes_from_a_past_revision,
            watch_reports_a_compacted_start,
            fencing_rejects_a_stale_owner_after_takeover,
            restart_preserves_every_acknowledged_write,
            leases_survive_a_restart,
        );
    };
    (@cases $backend:ident, $make:expr, $($case:ident),+ $(,)?) => {
        $crate::paste_cases!($backend, $make, $($case),+);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! paste_cases {
    ($backend:ident, $make:expr, $($case:ident),+) => {
        mod $backend {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let mut h = $make.await;
                    $crate::conformance::$case(&mut h).await;
                }
            )+
        }
    };
}

/// A unique key prefix per case, so cases never see each other's keys.
fn ns(case: &str) -> String {
    format!("conformance/{case}/")
}

fn k(ns: &str, name: &str) -> Vec<u8> {
    format!("{ns}{name}").into_bytes()
}

/// Reads watch events until one with revision >= `until` arrived (or the deadline).
async fn collect_until(stream: &mut WatchStream, until: i64, limit: Duration) -> Vec<WatchEvent> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    while out.last().map(WatchEvent::revision).unwrap_or(0) < until {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(Ok(batch))) => out.extend(batch.events),
            Ok(Some(Err(e))) => panic!("watch ended with {e} after {} events", out.len()),
            Ok(None) => panic!("watch ended after {} events", out.len()),
            Err(_) => panic!(
                "watch did not reach revision {until} within {limit:?}; got {} events, last {:?}",
                out.len(),
                out.last()
            ),
        }
    }
    out
}

async fn must_get(meta: &dyn Meta, key: &[u8]) -> Option<KeyValue> {
    meta.get(key).await.expect("get").kv
}

pub async fn get_put_report_store_issued_revisions(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("get_put");
    let a = k(&ns, "a");
    let before = m.get(&a).await.unwrap();
    assert_eq!(before.kv, None);
    let r1 = m.put(&a, b"1", Precondition::None, None).await.unwrap();
    assert!(r1.revision > before.revision, "a put moves the revision");
    let kv = must_get(m.as_ref(), &a).await.unwrap();
    assert_eq!(kv.value, b"1");
    assert_eq!(kv.create_revision, r1.revision);
    assert_eq!(kv.mod_revision, r1.revision);
    assert_eq!(kv.version, 1);
    assert_eq!(kv.lease, None);
    let r2 = m.put(&a, b"2", Precondition::None, None).await.unwrap();
    assert!(r2.revision > r1.revision);
    let kv = must_get(m.as_ref(), &a).await.unwrap();
    assert_eq!(
        (kv.create_revision, kv.mod_revision, kv.version),
        (r1.revision, r2.revision, 2)
    );
    let g = m.get(&a).await.unwrap();
    assert!(
        g.revision >= r2.revision,
        "a read sees at least the revision of the last write"
    );
    let status = m.status().await.unwrap();
    assert!(status.revision >= r2.revision);
}

pub async fn absent_precondition_admits_one_creator(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let key = k(&ns("absent"), "only-once");
    let first = m
        .put(&key, b"first", Precondition::Absent, None)
        .await
        .unwrap();
    let err = m
        .put(&key, b"second", Precondition::Absent, None)
        .await
        .unwrap_err();
    match err {
        MetaError::Conflict { current: Some(kv) } => {
            assert_eq!(kv.value, b"first");
            assert_eq!(kv.mod_revision, first.revision);
        }
        other => panic!("expected a conflict naming the current value, got {other:?}"),
    }
    assert_eq!(must_get(m.as_ref(), &key).await.unwrap().value, b"first");
}

pub async fn mod_revision_precondition_rejects_stale_writers(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let key = k(&ns("modrev"), "x");
    // ModRevision(0) means "absent".
    let r1 = m
        .put(&key, b"v1", Precondition::ModRevision(0), None)
        .await
        .unwrap();
    let r2 = m
        .put(&key, b"v2", Precondition::ModRevision(r1.revision), None)
        .await
        .unwrap();
    let err = m
        .put(&key, b"stale", Precondition::ModRevision(r1.revision), None)
        .await
        .unwrap_err();
    match err {
        MetaError::Conflict { current: Some(kv) } => assert_eq!(kv.mod_revision, r2.revision),
        other => panic!("expected a conflict, got {other:?}"),
    }
    let missing = k(&ns("modrev"), "missing");
    let err = m
        .put(&missing, b"v", Precondition::ModRevision(5), None)
        .await
        .unwrap_err();
    assert_eq!(err, MetaError::Conflict { current: None });
    assert_eq!(must_get(m.as_ref(), &key).await.unwrap().value, b"v2");
}

pub async fn delete_honours_preconditions_and_absent_keys_do_not_move_the_revision(
    h: &mut dyn MetaHarness,
) {
    let m = h.meta();
    let ns = ns("delete");
    let key = k(&ns, "d");
    let r1 = m.put(&key, b"v", Precondition::None, None).await.unwrap();
    let err = m
        .delete(&key, Precondition::ModRevision(r1.revision - 1))
        .await
        .unwrap_err();
    assert!(
        matches!(err, MetaError::Conflict { current: Some(_) }),
        "{err:?}"
    );
    let d = m
        .delete(&key, Precondition::ModRevision(r1.revision))
        .await
        .unwrap();
    assert!(d.deleted);
    assert!(d.revision > r1.revision);
    assert_eq!(must_get(m.as_ref(), &key).await, None);
    let before = m.get(&key).await.unwrap().revision;
    let d2 = m.delete(&key, Precondition::None).await.unwrap();
    assert!(!d2.deleted);
    let after = m.get(&key).await.unwrap().revision;
    assert_eq!(before, after, "deleting an absent key changes nothing");
    let err = m
        .delete(&key, Precondition::ModRevision(d.revision))
        .await
        .unwrap_err();
    assert_eq!(err, MetaError::Conflict { current: None });
}

pub async fn recreated_key_gets_a_new_create_revision(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let key = k(&ns("recreate"), "r");
    let r1 = m.put(&key, b"a", Precondition::None, None).await.unwrap();
    m.delete(&key, Precondition::None).await.unwrap();
    let r2 = m.put(&key, b"b", Precondition::Absent, None).await.unwrap();
    let kv = must_get(m.as_ref(), &key).await.unwrap();
    assert!(r2.revision > r1.revision);
    assert_eq!(
        kv.create_revision, r2.revision,
        "a re-created key is a new incarnation"
    );
    assert_eq!(kv.version, 1);
}

pub async fn range_lists_a_prefix_in_pages(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("range");
    let dir = format!("{ns}dir/");
    for i in 0..7 {
        m.put(
            &k(&dir, &format!("{i:02}")),
            format!("{i}").as_bytes(),
            Precondition::None,
            None,
        )
        .await
        .unwrap();
    }
    // Neighbours that share a textual prefix but are not below the directory.
    m.put(&k(&ns, "dir0"), b"x", Precondition::None, None)
        .await
        .unwrap();
    m.put(&k(&ns, "dia"), b"x", Precondition::None, None)
        .await
        .unwrap();
    let all = m
        .range(dir.as_bytes(), RangeOptions::default())
        .await
        .unwrap();
    assert_eq!(all.kvs.len(), 7);
    assert!(!all.more);
    let keys: Vec<_> = all.kvs.iter().map(|kv| kv.key.clone()).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(keys, sorted, "keys come in key order");
    assert!(all.revision >= all.kvs.iter().map(|kv| kv.mod_revision).max().unwrap());

    let mut seen = Vec::new();
    let mut start = None;
    loop {
        let page = m
            .range(
                dir.as_bytes(),
                RangeOptions {
                    start: start.clone(),
                    limit: 3,
                },
            )
            .await
            .unwrap();
        assert!(page.kvs.len() <= 3);
        seen.extend(page.kvs.iter().map(|kv| kv.key.clone()));
        if !page.more {
            break;
        }
        let mut next = page.kvs.last().unwrap().key.clone();
        next.push(0);
        start = Some(next);
    }
    assert_eq!(seen, keys, "paging returns every key exactly once");
}

pub async fn txn_applies_all_or_nothing(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("txn");
    let (a, b, c) = (k(&ns, "a"), k(&ns, "b"), k(&ns, "c"));
    let r0 = m.put(&a, b"a0", Precondition::None, None).await.unwrap();
    m.put(&c, b"c0", Precondition::None, None).await.unwrap();
    // A failing compare: nothing is applied.
    let err = m
        .txn(
            Txn::new()
                .when(Compare::ModRevision {
                    key: a.clone(),
                    revision: r0.revision,
                })
                .when(Compare::Absent { key: c.clone() })
                .put(&a, b"a1")
                .put(&b, b"b1")
                .delete(&c),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, MetaError::Conflict { .. }), "{err:?}");
    assert_eq!(must_get(m.as_ref(), &a).await.unwrap().value, b"a0");
    assert_eq!(must_get(m.as_ref(), &b).await, None);
    assert_eq!(must_get(m.as_ref(), &c).await.unwrap().value, b"c0");
    // All compares hold: every operation is applied, at one revision.
    let ok = m
        .txn(
            Txn::new()
                .when(Compare::ModRevision {
                    key: a.clone(),
                    revision: r0.revision,
                })
                .when(Compare::Absent { key: b.clone() })
                .when(Compare::Value {
                    key: c.clone(),
                    value: b"c0".to_vec(),
                })
                .put(&a, b"a1")
                .put(&b, b"b1")
                .delete(&c),
        )
        .await
        .unwrap();
    assert_eq!(ok.deleted, 1);
    let ka = must_get(m.as_ref(), &a).await.unwrap();
    let kb = must_get(m.as_ref(), &b).await.unwrap();
    assert_eq!(
        (ka.value.as_slice(), kb.value.as_slice()),
        (&b"a1"[..], &b"b1"[..])
    );
    assert_eq!(ka.mod_revision, ok.revision);
    assert_eq!(kb.mod_revision, ok.revision);
    assert_eq!(must_get(m.as_ref(), &c).await, None);
}

pub async fn txn_conflict_names_the_failed_key(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("txn_conflict");
    let (a, b) = (k(&ns, "a"), k(&ns, "b"));
    m.put(&a, b"a", Precondition::None, None).await.unwrap();
    let rb = m.put(&b, b"b", Precondition::None, None).await.unwrap();
    let err = m
        .txn(
            Txn::new()
                .when(Compare::Present { key: a.clone() })
                .when(Compare::ModRevision {
                    key: b.clone(),
                    revision: rb.revision + 100,
                })
                .put(&a, b"x"),
        )
        .await
        .unwrap_err();
    match err {
        MetaError::Conflict { current: Some(kv) } => {
            assert_eq!(kv.key, b);
            assert_eq!(kv.mod_revision, rb.revision);
        }
        other => panic!("expected a conflict on b, got {other:?}"),
    }
}

pub async fn txn_rejects_two_operations_on_one_key(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let a = k(&ns("txn_dup"), "a");
    let err = m
        .txn(Txn::new().put(&a, b"1").delete(&a))
        .await
        .unwrap_err();
    assert!(matches!(err, MetaError::InvalidRequest(_)), "{err:?}");
    assert_eq!(must_get(m.as_ref(), &a).await, None);
}

pub async fn empty_keys_are_invalid_requests(h: &mut dyn MetaHarness) {
    let m = h.meta();
    assert!(matches!(
        m.get(b"").await,
        Err(MetaError::InvalidRequest(_))
    ));
    assert!(matches!(
        m.put(b"", b"v", Precondition::None, None).await,
        Err(MetaError::InvalidRequest(_))
    ));
    assert!(matches!(
        m.watch(b"x", 0).await.err(),
        Some(MetaError::InvalidRequest(_))
    ));
}

pub async fn cas_race_has_exactly_one_winner_per_round(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("cas_race");
    const WRITERS: usize = 8;
    const ROUNDS: usize = 15;
    for round in 0..ROUNDS {
        let key = k(&ns, &format!("round-{round}"));
        let mut tasks = Vec::new();
        for w in 0..WRITERS {
            let m = m.clone();
            let key = key.clone();
            tasks.push(tokio::spawn(async move {
                m.put(&key, format!("w{w}").as_bytes(), Precondition::Absent, None)
                    .await
                    .map(|r| (w, r.revision))
            }));
        }
        let mut winners = Vec::new();
        for t in tasks {
            match t.await.unwrap() {
                Ok(win) => winners.push(win),
                Err(MetaError::Conflict { current: Some(_) }) => {}
                Err(e) => panic!("round {round}: unexpected error {e:?}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        let kv = must_get(m.as_ref(), &key).await.unwrap();
        assert_eq!(kv.value, format!("w{}", winners[0].0).into_bytes());
        assert_eq!(kv.mod_revision, winners[0].1);
    }
}

pub async fn cas_counter_under_contention_loses_no_update(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let key = k(&ns("cas_counter"), "n");
    m.put(&key, b"0", Precondition::None, None).await.unwrap();
    const WRITERS: usize = 6;
    const INCREMENTS: usize = 15;
    let mut tasks = Vec::new();
    for _ in 0..WRITERS {
        let m = m.clone();
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let mut conflicts = 0;
            for _ in 0..INCREMENTS {
                loop {
                    let kv = m.get(&key).await.unwrap().kv.unwrap();
                    let n: u64 = String::from_utf8(kv.value).unwrap().parse().unwrap();
                    match m
                        .put(
                            &key,
                            (n + 1).to_string().as_bytes(),
                            Precondition::ModRevision(kv.mod_revision),
                            None,
                        )
                        .await
                    {
                        Ok(_) => break,
                        Err(MetaError::Conflict { .. }) => conflicts += 1,
                        Err(e) => panic!("unexpected {e:?}"),
                    }
                }
            }
            conflicts
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let kv = must_get(m.as_ref(), &key).await.unwrap();
    assert_eq!(kv.value, (WRITERS * INCREMENTS).to_string().into_bytes());
    assert_eq!(kv.version as usize, WRITERS * INCREMENTS + 1);
}

pub async fn lease_expiry_removes_attached_keys(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("lease_expiry");
    let lease = m.grant(Duration::from_secs(1)).await.unwrap();
    assert!(lease.ttl >= Duration::from_secs(1));
    let (a, b, keep) = (k(&ns, "a"), k(&ns, "b"), k(&ns, "keep"));
    m.put(&a, b"1", Precondition::None, Some(lease.id))
        .await
        .unwrap();
    m.put(&b, b"1", Precondition::None, Some(lease.id))
        .await
        .unwrap();
    m.put(&keep, b"1", Precondition::None, None).await.unwrap();
    assert_eq!(
        must_get(m.as_ref(), &a).await.unwrap().lease,
        Some(lease.id)
    );
    let start = m.get(&a).await.unwrap().revision + 1;
    let mut w = m.watch(ns.as_bytes(), start).await.unwrap();
    let limit = lease.ttl + Duration::from_secs(5);
    wait_until(limit, "leased keys deleted after expiry", || {
        let m = m.clone();
        let (a, b) = (a.clone(), b.clone());
        async move {
            let (ga, gb) = (m.get(&a).await?, m.get(&b).await?);
            if ga.kv.is_none() && gb.kv.is_none() {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "a {:?} b {:?}",
                    ga.kv.is_some(),
                    gb.kv.is_some()
                ))
            }
        }
    })
    .await
    .expect("condition reached in time");
    assert!(
        must_get(m.as_ref(), &keep).await.is_some(),
        "unleased keys stay"
    );
    // Both deletions are watch events (one revision for the whole expiry).
    let mut events = Vec::new();
    while events.len() < 2 {
        match tokio::time::timeout(Duration::from_secs(5), w.next()).await {
            Ok(Some(Ok(batch))) => events.extend(batch.events),
            other => panic!("watch after expiry: {other:?}"),
        }
    }
    assert!(
        events
            .iter()
            .all(|e| matches!(e, WatchEvent::Delete { .. })),
        "{events:?}"
    );
    assert_eq!(events[0].revision(), events[1].revision());
    let err = m.keep_alive(lease.id).await.unwrap_err();
    assert_eq!(err, MetaError::LeaseNotFound(lease.id));
    let err = m
        .put(&a, b"again", Precondition::None, Some(lease.id))
        .await
        .unwrap_err();
    assert_eq!(err, MetaError::LeaseNotFound(lease.id));
}

pub async fn keep_alive_keeps_attached_keys(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let key = k(&ns("keep_alive"), "held");
    let lease = m.grant(Duration::from_secs(2)).await.unwrap();
    m.put(&key, b"1", Precondition::None, Some(lease.id))
        .await
        .unwrap();
    // Hold it for twice its TTL.
    let until = Instant::now() + lease.ttl * 2;
    while Instant::now() < until {
        let ttl = m.keep_alive(lease.id).await.unwrap();
        assert!(ttl >= Duration::from_secs(1));
        assert!(
            must_get(m.as_ref(), &key).await.is_some(),
            "key lost while kept alive"
        );
        tokio::time::sleep(lease.ttl / 4).await;
    }
    assert!(must_get(m.as_ref(), &key).await.is_some());
    m.revoke(lease.id).await.unwrap();
    assert_eq!(must_get(m.as_ref(), &key).await, None);
}

pub async fn revoke_removes_attached_keys_and_ends_the_lease(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("revoke");
    let lease = m.grant(Duration::from_secs(30)).await.unwrap();
    let (a, moved) = (k(&ns, "a"), k(&ns, "moved"));
    m.put(&a, b"1", Precondition::None, Some(lease.id))
        .await
        .unwrap();
    m.put(&moved, b"1", Precondition::None, Some(lease.id))
        .await
        .unwrap();
    // Re-putting without the lease detaches the key.
    m.put(&moved, b"2", Precondition::None, None).await.unwrap();
    m.revoke(lease.id).await.unwrap();
    assert_eq!(must_get(m.as_ref(), &a).await, None);
    assert_eq!(must_get(m.as_ref(), &moved).await.unwrap().value, b"2");
    assert_eq!(
        m.keep_alive(lease.id).await.unwrap_err(),
        MetaError::LeaseNotFound(lease.id)
    );
    assert_eq!(
        m.revoke(lease.id).await.unwrap_err(),
        MetaError::LeaseNotFound(lease.id)
    );
}

pub async fn watch_delivers_every_change_in_order(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("watch_order");
    let start = m.get(b"x").await.unwrap().revision + 1;
    let mut w = m.watch(ns.as_bytes(), start).await.unwrap();
    // Concurrent writers; each change's revision is recorded from its answer.
    let mut tasks = Vec::new();
    for t in 0..4 {
        let m = m.clone();
        let ns = ns.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            for i in 0..25 {
                let key = k(&ns, &format!("t{t}-{}", i % 5));
                if i % 7 == 6 {
                    let d = m.delete(&key, Precondition::None).await.unwrap();
                    if d.deleted {
                        done.push((d.revision, key, None));
                    }
                } else {
                    let v = format!("{t}-{i}").into_bytes();
                    let r = m.put(&key, &v, Precondition::None, None).await.unwrap();
                    done.push((r.revision, key, Some(v)));
                }
                // A change outside the prefix must not be seen.
                m.put(
                    format!("other/{t}").as_bytes(),
                    b"x",
                    Precondition::None,
                    None,
                )
                .await
                .unwrap();
            }
            done
        }));
    }
    let mut expected = BTreeMap::new();
    for t in tasks {
        for (rev, key, value) in t.await.unwrap() {
            expected.insert(rev, (key, value));
        }
    }
    let last = *expected.keys().last().unwrap();
    let events = collect_until(&mut w, last, Duration::from_secs(10)).await;
    let revisions: Vec<i64> = events.iter().map(WatchEvent::revision).collect();
    assert!(
        revisions.windows(2).all(|p| p[0] < p[1]),
        "in revision order: {revisions:?}"
    );
    let got: BTreeMap<i64, (Vec<u8>, Option<Vec<u8>>)> = events
        .into_iter()
        .map(|e| match e {
            WatchEvent::Put(kv) => (kv.mod_revision, (kv.key, Some(kv.value))),
            WatchEvent::Delete { key, revision } => (revision, (key, None)),
        })
        .collect();
    assert_eq!(got, expected, "every change, none missed, none extra");
}

pub async fn watch_resumes_from_a_past_revision(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("watch_resume");
    let mut revs = Vec::new();
    for i in 0..10 {
        revs.push(
            m.put(&k(&ns, &format!("{i}")), b"v", Precondition::None, None)
                .await
                .unwrap()
                .revision,
        );
    }
    // Resume from the 4th change: exactly the changes from there on.
    let mut w = m.watch(ns.as_bytes(), revs[3]).await.unwrap();
    let events = collect_until(&mut w, revs[9], Duration::from_secs(10)).await;
    let got: Vec<i64> = events.iter().map(WatchEvent::revision).collect();
    assert_eq!(got, revs[3..].to_vec());
    // And live changes keep coming on the same stream.
    let r = m
        .put(&k(&ns, "live"), b"v", Precondition::None, None)
        .await
        .unwrap();
    let more = collect_until(&mut w, r.revision, Duration::from_secs(10)).await;
    assert_eq!(
        more.iter().map(WatchEvent::revision).collect::<Vec<_>>(),
        vec![r.revision]
    );
}

pub async fn watch_reports_a_compacted_start(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("watch_compacted");
    let first = m
        .put(&k(&ns, "a"), b"1", Precondition::None, None)
        .await
        .unwrap();
    for i in 0..5 {
        m.put(
            &k(&ns, "a"),
            format!("{i}").as_bytes(),
            Precondition::None,
            None,
        )
        .await
        .unwrap();
    }
    let last = m
        .put(&k(&ns, "b"), b"1", Precondition::None, None)
        .await
        .unwrap();
    m.compact(last.revision).await.unwrap();
    let mut w = m.watch(ns.as_bytes(), first.revision).await.unwrap();
    match tokio::time::timeout(Duration::from_secs(5), w.next()).await {
        Ok(Some(Err(WatchError::Compacted { compact_revision }))) => {
            assert!(
                compact_revision > first.revision,
                "compacted at {compact_revision}"
            );
        }
        other => panic!("expected a compacted watch, got {other:?}"),
    }
    // From after the compaction point the watch works.
    let mut w = m.watch(ns.as_bytes(), last.revision + 1).await.unwrap();
    let r = m
        .put(&k(&ns, "c"), b"1", Precondition::None, None)
        .await
        .unwrap();
    let events = collect_until(&mut w, r.revision, Duration::from_secs(10)).await;
    assert_eq!(events.len(), 1);
}

pub async fn fencing_rejects_a_stale_owner_after_takeover(h: &mut dyn MetaHarness) {
    let m = h.meta();
    let ns = ns("fencing");
    let owner_key = k(&ns, "owner");
    let data = k(&ns, "data");
    let lease_a = m.grant(Duration::from_secs(30)).await.unwrap();
    let a = Ownership::acquire(m.as_ref(), &owner_key, b"A", Some(lease_a.id))
        .await
        .unwrap();
    // A second acquire while A holds it is a conflict naming A.
    match Ownership::acquire(m.as_ref(), &owner_key, b"B", None).await {
        Err(MetaError::Conflict { current: Some(kv) }) => assert_eq!(kv.value, b"A"),
        other => panic!("expected a conflict, got {other:?}"),
    }
    a.commit(m.as_ref(), Txn::new().put(&data, b"from A"))
        .await
        .unwrap();
    let lease_b = m.grant(Duration::from_secs(30)).await.unwrap();
    let b = Ownership::take_over(m.as_ref(), &owner_key, b"B", Some(lease_b.id))
        .await
        .unwrap();
    assert!(b.epoch() > a.epoch(), "a takeover has a higher epoch");
    // Every write of the stale owner is fenced and not applied, even when its own
    // compares hold.
    let err = a
        .commit(
            m.as_ref(),
            Txn::new()
                .when(Compare::Present { key: data.clone() })
                .put(&data, b"stale A"),
        )
        .await
        .unwrap_err();
    assert_eq!(err, MetaError::Fenced);
    assert_eq!(a.check(m.as_ref()).await.unwrap_err(), MetaError::Fenced);
    assert_eq!(a.release(m.as_ref()).await.unwrap_err(), MetaError::Fenced);
    assert_eq!(must_get(m.as_ref(), &data).await.unwrap().value, b"from A");
    // The current owner writes.
    b.commit(m.as_ref(), Txn::new().put(&data, b"from B"))
        .await
        .unwrap();
    let owner = must_get(m.as_ref(), &owner_key).await.unwrap();
    assert_eq!(
        (owner.value.as_slice(), owner.mod_revision),
        (&b"B"[..], b.epoch())
    );
    // A fence failure wins over the caller's own conflict.
    let err = a
        .commit(
            m.as_ref(),
            Txn::new()
                .when(Compare::Absent { key: data.clone() })
                .put(&data, b"x"),
        )
        .await
        .unwrap_err();
    assert_eq!(err, MetaError::Fenced);
    b.release(m.as_ref()).await.unwrap();
    assert_eq!(must_get(m.as_ref(), &owner_key).await, None);
}

pub async fn restart_preserves_every_acknowledged_write(h: &mut dyn MetaHarness) {
    let ns = ns("restart");
    let m = h.meta();
    let before = m
        .put(&k(&ns, "marker"), b"m", Precondition::None, None)
        .await
        .unwrap();
    // Writers run while the backend is restarted under them; every write that was
    // acknowledged must survive, whatever happened to the others.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..4 {
        let m = m.clone();
        let ns = ns.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut acked: HashMap<Vec<u8>, (Vec<u8>, i64)> = HashMap::new();
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let key = k(&ns, &format!("w{t}-{}", i % 16));
                let value = format!("{t}-{i}").into_bytes();
                // A failed attempt keeps the key's earlier acknowledgement: if its
                // outcome is unknown it may have landed, which can only make the
                // stored revision newer (checked below).
                match m.put(&key, &value, Precondition::None, None).await {
                    Ok(r) => {
                        acked.insert(key, (value, r.revision));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
                i += 1;
            }
            acked
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.restart().await.expect("restart");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut acked = HashMap::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }
    assert!(!acked.is_empty(), "some writes were acknowledged");
    let m = h.meta();
    let max_acked = acked.values().map(|(_, r)| *r).max().unwrap();
    // The backend may need a moment to elect a leader after restart.
    let marker = wait_until(
        Duration::from_secs(15),
        "backend answers after restart",
        || {
            let m = m.clone();
            let key = k(&ns, "marker");
            async move { Ok(m.get(&key).await?) }
        },
    )
    .await
    .expect("condition reached in time");
    assert_eq!(marker.kv.unwrap().mod_revision, before.revision);
    assert!(
        marker.revision >= max_acked,
        "the revision never goes backwards"
    );
    let all = m
        .range(ns.as_bytes(), RangeOptions::default())
        .await
        .unwrap();
    let stored: HashMap<Vec<u8>, KeyValue> =
        all.kvs.into_iter().map(|kv| (kv.key.clone(), kv)).collect();
    for (key, (value, revision)) in &acked {
        let kv = stored
            .get(key)
            .unwrap_or_else(|| panic!("acknowledged key {} lost", String::from_utf8_lossy(key)));
        // A later unacknowledged attempt on the same key may have landed; it can only
        // be newer.
        assert!(
            kv.mod_revision >= *revision,
            "{}: stored revision {} is older than the acknowledged {}",
            String::from_utf8_lossy(key),
            kv.mod_revision,
            revision
        );
        if kv.mod_revision == *revision {
            assert_eq!(&kv.value, value);
        }
    }
    let after = m
        .put(&k(&ns, "after"), b"a", Precondition::None, None)
        .await
        .unwrap();
    assert!(
        after.revision > max_acked,
        "new revisions continue above every acknowledged one"
    );
}

pub async fn leases_survive_a_restart(h: &mut dyn MetaHarness) {
    let ns = ns("lease_restart");
    let key = k(&ns, "held");
    let m = h.meta();
    let lease = m.grant(Duration::from_secs(4)).await.unwrap();
    m.put(&key, b"1", Precondition::None, Some(lease.id))
        .await
        .unwrap();
    h.restart().await.expect("restart");
    let m = h.meta();
    let kv = wait_until(
        Duration::from_secs(15),
        "backend answers after restart",
        || {
            let m = m.clone();
            let key = key.clone();
            async move { Ok(m.get(&key).await?) }
        },
    )
    .await
    .expect("condition reached in time");
    assert_eq!(
        kv.kv.map(|kv| kv.lease),
        Some(Some(lease.id)),
        "leased key kept over restart"
    );
    m.keep_alive(lease.id)
        .await
        .expect("the lease is still live after restart");
    // Not kept alive any more: it expires.
    wait_until(
        lease.ttl + Duration::from_secs(8),
        "lease expires after restart",
        || {
            let m = m.clone();
            let key = key.clone();
            async move {
                match m.get(&key).await {
                    Ok(g) if g.kv.is_none() => Ok(()),
                    other => Err(anyhow::anyhow!("{other:?}")),
                }
            }
        },
    )
    .await
    .expect("condition reached in time");
}
