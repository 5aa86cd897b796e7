//! # Local disk failure through the real binary
//!
//! The promise: when the local disk fails (a write or an fsync answers an error),
//! the store fail-stops — it refuses every later write with a named error,
//! readiness turns false — and nothing is reported durable that was not.
//!
//! These tests run the real `meshd` on its embedded defaults (the event log, the
//! Local stores and the embedded Meta on one RocksDB) under an `LD_PRELOAD` shim
//! ([`meshd_test_support::fault`]) that makes `fsync`, `fdatasync` and
//! `sync_file_range` fail with `EIO` while the test says so. Nothing in the binary
//! knows about it. A `write()` still reaches the page cache, so the write whose fsync
//! failed has an unknown outcome: after a restart (which replays RocksDB's WAL from
//! the page cache) it may be there or not, and it is answered 504 (`indeterminate`).
//! A write refused *after* the store fail-stopped never reached RocksDB and is never
//! there: it is answered 503 (`unavailable`, not applied) with a slow `Retry-After`
//! (30 s), since only a restart brings the store back. Each story then heals the disk, SIGKILLs
//! meshd and starts it again on the same data dir: every write that was acknowledged
//! survives and the instance serves again.

mod common;

use common::disk::*;
use common::*;
use meshd_test_support::fault::FsyncFault;
use meshd_test_support::http::send_json;
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// Story 1: the partition log. Publishes answered 201 before the disk failed survive
/// with their bytes; the publish whose fsync failed is answered 504 (outcome unknown);
/// every later publish is refused unwritten (503), also after the disk is healthy
/// again, until a restart. The embedded Meta on the same RocksDB says at once that it
/// failed too, and refuses its writes unwritten (503), never 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_published_events_when_the_disk_fails_fsync_then_publishes_are_refused_until_a_restart_and_every_201_survives_it(
) {
    let fault = FsyncFault::build().expect("build the fsync fault shim");
    let dir = tempfile::tempdir().unwrap();
    let mut m = start_faulted(dir.path(), &fault.env()).await;
    let a = m.addr().to_string();
    create_topic(&a, "orders", 3).await;
    // id → (partition, offset, event) of every 201.
    let mut acknowledged: BTreeMap<String, (u64, u64, Value)> = BTreeMap::new();
    for i in 0..20 {
        let e = event(&format!("ok-{i}"));
        let (p, o) = publish(&a, "orders", &e).await.unwrap();
        acknowledged.insert(format!("ok-{i}"), (p, o, e));
    }
    wait_ready(&a).await;
    // Meshd's own Meta writes after boot are done, so the publish below is the only
    // writer when the fault trips (no subscription: no delivery flushes either).
    wait_registered(&a).await;
    assert_eq!(
        metric(&a, "meshd_local_healthy{backend=\"rocksdb\"}")
            .await
            .unwrap(),
        1.0
    );
    let ends_before = end_offsets(&a, "orders").await;

    fault.trip().unwrap();
    // The first publish after the disk failed: its batch reached RocksDB's WAL (the
    // page cache) but its fsync failed, so its outcome is unknown — it may or may not
    // be in the log after a restart. 504, never a 201, and never a 503 ("not
    // applied"), which would invite a retry that stores it twice without saying so.
    let unknown = event("unknown-0");
    let r = try_publish(&a, "orders", &unknown).await;
    indeterminate(&r, "log", "rocksdb");

    // The log fail-stopped: every later publish is refused before it is written.
    let mut refused = Vec::new();
    for i in 0..4 {
        let e = event(&format!("refused-{i}"));
        let r = try_publish(&a, "orders", &e).await;
        fail_stopped(&r, "log", "rocksdb");
        refused.push(format!("refused-{i}"));
    }

    // The embedded Meta shares the failed engine: its health says so before it tries
    // a write, and its writes are refused unwritten (503), not "outcome unknown".
    assert_not_ready(
        &a,
        &[("local:rocksdb", "failed"), ("meta:embedded", "failed")],
    )
    .await;
    let r = send_json(
        &a,
        "PUT",
        "/v1/subscriptions/refused-sub",
        &json!({"topic": "orders"}),
    )
    .await
    .unwrap();
    fail_stopped(&r, "subscriptions", "embedded");

    // The operator sees it: not ready, naming the Local engine; the metrics say so.
    assert_not_ready(&a, &[("local:rocksdb", "failed")]).await;
    assert_eq!(
        metric(&a, "meshd_local_healthy{backend=\"rocksdb\"}")
            .await
            .unwrap(),
        0.0
    );
    let unknown_outcomes = metric(
        &a,
        "meshd_store_errors_total{store=\"log\",backend=\"rocksdb\",kind=\"indeterminate\"}",
    )
    .await
    .unwrap();
    assert_eq!(unknown_outcomes, 1.0, "the publish whose fsync failed");
    let errors = metric(
        &a,
        "meshd_store_errors_total{store=\"log\",backend=\"rocksdb\",kind=\"failed\"}",
    )
    .await
    .unwrap();
    assert_eq!(errors, 4.0, "every refused publish is counted");
    // Nothing that was not acknowledged is readable: the durable ends did not move,
    // and every acknowledged event is still served.
    assert_eq!(end_offsets(&a, "orders").await, ends_before);
    assert_eq!(browse_by_id(&a, "orders", 3).await, acknowledged);

    // Healing the disk does not bring the store back silently: what reached the disk
    // is unknown until a restart recovers from it.
    fault.heal().unwrap();
    for i in 4..6 {
        let e = event(&format!("refused-{i}"));
        let r = try_publish(&a, "orders", &e).await;
        fail_stopped(&r, "log", "rocksdb");
        refused.push(format!("refused-{i}"));
    }
    assert_not_ready(&a, &[("local:rocksdb", "failed")]).await;

    let (a, after) = restarted_with_every_201(&mut m, "orders", 3, &acknowledged).await;
    // Nothing appears that was never sent, nor anything that was refused; the event
    // with the unknown outcome may be there (once), exactly as published.
    for (id, (_, _, e)) in &after {
        if acknowledged.contains_key(id) {
            continue;
        }
        assert_eq!(
            id, "unknown-0",
            "only the unknown outcome may be added: {e}"
        );
        assert_eq!(e, &unknown, "the unknown-outcome event, if kept, is intact");
    }
    for id in &refused {
        assert!(!after.contains_key(id), "refused publish {id} was applied");
    }
    let (status, body) =
        status_and_body(client(&a).subscription_answer("refused-sub").await).unwrap();
    assert_eq!(
        status, 404,
        "a refused subscription write was applied: {body}"
    );

    // The instance serves again.
    let e = event("after-restart");
    let (p, o) = publish(&a, "orders", &e).await.unwrap();
    let again = browse_by_id(&a, "orders", 3).await;
    assert_eq!(again.get("after-restart"), Some(&(p, o, e)));
}

/// Story 2, the Meta path: a subscription write on the embedded Meta whose group fsync
/// fails is not acknowledged (504: outcome unknown); Meta fail-stops and refuses later
/// writes unwritten (503), and so do the Local stores that share its RocksDB
/// (readiness names both); after a heal and a restart every acknowledged subscription
/// is there and writes work again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_embedded_meta_when_a_subscription_write_fails_fsync_then_it_is_not_acknowledged_meshd_fail_stops_and_a_restart_keeps_every_201(
) {
    let fault = FsyncFault::build().expect("build the fsync fault shim");
    let dir = tempfile::tempdir().unwrap();
    let mut m = start_faulted(dir.path(), &fault.env()).await;
    let a = m.addr().to_string();
    create_topic(&a, "orders", 2).await;
    let kept = create_subscription(&a, "kept", json!({"topic": "orders", "max_attempts": 3})).await;
    publish(&a, "orders", &event("before")).await.unwrap();
    wait_ready(&a).await;
    wait_registered(&a).await;

    fault.trip().unwrap();
    // The group's fsync fails: the outcome is unknown (504), never a 201.
    let r = send_json(
        &a,
        "PUT",
        "/v1/subscriptions/unknown",
        &json!({"topic": "orders"}),
    )
    .await
    .unwrap();
    indeterminate(&r, "subscriptions", "embedded");

    // Meta fail-stopped: later writes are refused before they are applied (503, not
    // applied; a slow Retry-After: only a restart cures it), never a 2xx.
    let r = send_json(
        &a,
        "PUT",
        "/v1/subscriptions/refused",
        &json!({"topic": "orders"}),
    )
    .await
    .unwrap();
    fail_stopped(&r, "subscriptions", "embedded");
    let r = bare(&a, "DELETE", "/v1/subscriptions/kept").await;
    fail_stopped(&r, "subscriptions", "embedded");
    // Readiness names both Meta and the Local engine they share, before any Local
    // store has tried (and failed) a write of its own.
    assert_not_ready(
        &a,
        &[("meta:embedded", "failed"), ("local:rocksdb", "failed")],
    )
    .await;
    assert_eq!(
        metric(&a, "meshd_meta_up{backend=\"embedded\"}")
            .await
            .unwrap(),
        0.0
    );
    assert_eq!(
        metric(&a, "meshd_local_healthy{backend=\"rocksdb\"}")
            .await
            .unwrap(),
        0.0
    );
    let indeterminate = metric(
        &a,
        "meshd_meta_errors_total{backend=\"embedded\",op=\"txn\",kind=\"indeterminate\"}",
    )
    .await
    .unwrap();
    assert!(indeterminate >= 1.0, "{indeterminate}");
    // The Local stores refuse their writes too.
    let r = try_publish(&a, "orders", &event("refused-publish")).await;
    fail_stopped(&r, "log", "rocksdb");

    // Healed, but still fail-stopped until a restart.
    fault.heal().unwrap();
    let r = send_json(
        &a,
        "PUT",
        "/v1/subscriptions/refused",
        &json!({"topic": "orders"}),
    )
    .await
    .unwrap();
    fail_stopped(&r, "subscriptions", "embedded");
    assert_not_ready(
        &a,
        &[("meta:embedded", "failed"), ("local:rocksdb", "failed")],
    )
    .await;

    m.kill();
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    wait_ready(&a).await;
    // The acknowledged subscription is there, unchanged (its DELETE was refused).
    let r = answered(
        client(&a).subscription_answer("kept").await,
        200,
        "GET subscription kept",
    )
    .unwrap();
    let got: Value = r.json().unwrap();
    assert_eq!(got["revision"], kept["revision"], "{got}");
    assert_eq!(got["topic"], "orders");
    assert_eq!(got["max_attempts"], 3);
    // The unknown outcome may or may not have been applied; if it was, it is whole.
    let (status, body) = status_and_body(client(&a).subscription_answer("unknown").await).unwrap();
    match status {
        404 => {}
        200 => assert_eq!(body["topic"], "orders", "{body}"),
        s => panic!("GET of the unknown-outcome subscription answered {s}: {body}"),
    }
    // A refused write was never applied.
    let (status, body) = status_and_body(client(&a).subscription_answer("refused").await).unwrap();
    assert_eq!(
        status, 404,
        "a refused subscription write was applied: {body}"
    );
    let names: Vec<Value> = client(&a)
        .subscriptions_answer()
        .await
        .unwrap()
        .json::<Value>()
        .unwrap()["subscriptions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].clone())
        .collect();
    assert!(
        names.iter().all(|n| n == "kept" || n == "unknown"),
        "only sent subscriptions exist: {names:?}"
    );
    // The event published before the failure is there; the refused one is not.
    let events = browse_by_id(&a, "orders", 2).await;
    assert!(events.contains_key("before"), "{events:?}");
    assert!(!events.contains_key("refused-publish"), "{events:?}");

    // Writes work again.
    create_subscription(&a, "after-restart", json!({"topic": "orders"})).await;
}

/// Story 2, the delivery path: a pull must make each attempt record durable before
/// it hands the event out. When that fsync fails the pull hands nothing out and
/// answers 503 (the pull was not applied: nothing was handed out, even though the
/// attempt record may have reached the disk); the partitions stop dispatching (readiness `dispatch` and
/// `local:rocksdb` failed) until a restart, after which every event is delivered
/// exactly as published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_subscription_with_events_when_a_pull_cannot_make_its_attempts_durable_then_nothing_is_handed_out_until_a_restart_delivers_every_event(
) {
    let fault = FsyncFault::build().expect("build the fsync fault shim");
    let dir = tempfile::tempdir().unwrap();
    let mut m = start_faulted(dir.path(), &fault.env()).await;
    let a = m.addr().to_string();
    create_topic(&a, "orders", 2).await;
    // A short lease, so an attempt record that reached the disk although its fsync
    // failed (it is in flight after the restart) is due again soon.
    create_subscription(
        &a,
        "billing",
        json!({"topic": "orders", "start": "earliest", "ack_timeout_ms": 3000}),
    )
    .await;
    let mut published = BTreeMap::new();
    for i in 0..6 {
        let e = event(&format!("e{i}"));
        publish(&a, "orders", &e).await.unwrap();
        published.insert(format!("e{i}"), e);
    }
    wait_ready(&a).await;

    fault.trip().unwrap();
    let r = send_json(
        &a,
        "POST",
        "/v1/subscriptions/billing/pull",
        &json!({"max_events": 10}),
    )
    .await
    .unwrap();
    fail_stopped(&r, "deliveries", "rocksdb");
    // A long poll does not wait on a stopped partition or answer "nothing there".
    let r = send_json(
        &a,
        "POST",
        "/v1/subscriptions/billing/pull",
        &json!({"max_events": 10, "wait_ms": 5000}),
    )
    .await
    .unwrap();
    fail_stopped(&r, "deliveries", "rocksdb");

    assert_not_ready(&a, &[("dispatch", "failed"), ("local:rocksdb", "failed")]).await;
    assert_eq!(
        metric(&a, "meshd_local_healthy{backend=\"rocksdb\"}")
            .await
            .unwrap(),
        0.0
    );
    let stopped = metric(&a, "meshd_dispatch_failed_partitions")
        .await
        .unwrap();
    assert!(stopped >= 1.0, "{stopped}");
    let errors = metric(
        &a,
        "meshd_store_errors_total{store=\"deliveries\",backend=\"rocksdb\",kind=\"write_failed\"}",
    )
    .await
    .unwrap();
    assert!(errors >= 1.0, "{errors}");

    // Healed, still stopped until a restart.
    fault.heal().unwrap();
    let r = send_json(
        &a,
        "POST",
        "/v1/subscriptions/billing/pull",
        &json!({"max_events": 10}),
    )
    .await
    .unwrap();
    fail_stopped(&r, "deliveries", "rocksdb");
    assert_not_ready(&a, &[("dispatch", "failed"), ("local:rocksdb", "failed")]).await;

    m.kill();
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    wait_ready(&a).await;
    let got = pull_until(&a, "billing", published.len(), READY).await;
    let mut delivered = BTreeMap::new();
    for d in &got {
        let id = d.event["id"].as_str().unwrap().to_string();
        assert_eq!(
            Some(&d.event),
            published.get(&id),
            "delivered exactly as published"
        );
        // Nothing was handed out before the restart, so this is the first hand-out:
        // attempt 1, or 2 when the attempt record whose fsync failed reached the disk
        // anyway (a counted attempt is never taken back).
        assert!(
            d.attempt == 1 || d.attempt == 2,
            "attempt {} of {id}: {:?}",
            d.attempt,
            summary(&got)
        );
        assert!(
            delivered.insert(id.clone(), d.attempt).is_none(),
            "{id} delivered twice"
        );
    }
    assert_eq!(
        delivered.keys().collect::<Vec<_>>(),
        published.keys().collect::<Vec<_>>()
    );
    let r = ack(&a, "billing", &ids(&got)).await.unwrap();
    assert_eq!(set(&r["acked"]).len(), published.len(), "{r}");
    assert_no_delivery(&a, "billing", 1500, "every event was acked").await;
}
