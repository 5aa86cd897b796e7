//! # A full disk through the real binary
//!
//! The promise: when the data dir's disk fills up (a write answers `ENOSPC`), the
//! Local engine fail-stops — every later write is refused with a named error (503,
//! not applied), readiness turns false and the metrics say so — nothing is
//! acknowledged that was not written, and once space is back a restart on the same
//! data dir serves again with every acknowledged write in place.
//!
//! These tests run the real `meshd` on its embedded defaults (the event log, the
//! Local stores and the embedded Meta on one RocksDB) under an `LD_PRELOAD` shim
//! ([`meshd_test_support::fault::FullDisk`]) that makes every write to a regular file
//! (`write`, `pwrite`, `writev`, `fallocate`, ...) fail with `ENOSPC` while the test
//! says so; sockets, pipes, meshd's stderr log and `fsync` keep working, as on a real
//! disk that just filled up: what was written before it filled had its space, so its
//! fsync succeeds and its 201 stands. Nothing in the binary knows about the shim.
//!
//! What RocksDB (Debian's 7.8) does with it: the WAL append of the next write fails
//! with `IO error: No space left on device: While appending to file: …/NNNNNN.log`;
//! the write returns that error (nothing of it reaches the memtable) and RocksDB
//! raises a hard background error: it refuses writes, opens a fresh WAL and, since the
//! error is "no space", polls for free space every 5 s; once there is space it flushes
//! its memtables to SST files and accepts writes again, all on its own. meshd does not
//! rely on any of that: its engine records the first failed write and refuses every
//! later one itself, so RocksDB's own recovery does not bring the store back without a
//! restart — the first story waits for that recovery (a new SST file) and shows the
//! refusal still stands. One more thing RocksDB did, before meshd set its info log to
//! fatal lines only (`crates/local/src/rocks.rs`): its `LOG` is in the data dir too,
//! and the log line after a failed `LOG` write tripped an assertion that Debian's
//! build keeps on, so meshd died with SIGABRT instead of fail-stopping; both stories
//! failed that way.
//!
//! A write whose own WAL append failed is answered 504 (`indeterminate`): meshd cannot
//! tell how much of it reached the file, just as for a failed fsync
//! (`disk_failure.rs`). Only writes already in flight when the disk filled can be
//! answered so; everything sent after the first refusal is answered 503.

mod common;

use anyhow::ensure;
use common::disk::*;
use common::*;
use meshd_test_support::fault::FullDisk;
use meshd_test_support::http::{send_json, Response};
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Concurrent publishers, and how many 201s they make together before the disk fills.
const PUBLISHERS: usize = 4;
const BEFORE_FULL: usize = 40;
/// Each publisher stops after this many refusals (503) once the disk is full.
const REFUSALS_EACH: usize = 3;
/// A publisher that is still not refused after this many publishes failed the test.
const MAX_PUBLISHES_EACH: usize = 2000;

/// The operator's words for a full disk, as the OS says it: every refusal carries the
/// root cause, not just "fail-stopped".
const NO_SPACE: &str = "No space left on device";

/// A fail-stop's refusal (see `common::disk::fail_stopped`) that names the root
/// cause: no space.
fn refused_no_space(r: &Response, store: &str, backend: &str) -> Value {
    let p = disk::fail_stopped(r, store, backend);
    let detail = p["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(NO_SPACE), "the root cause is named: {p}");
    p
}

/// The names of the SST files in RocksDB's directory.
fn sst_files(dir: &std::path::Path) -> BTreeSet<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".sst"))
        .collect()
}

/// One publish of a publisher: what was sent, when, and the answer.
struct Sent {
    id: String,
    event: Value,
    /// Taken before the request left.
    sent: Instant,
    /// Taken after the answer arrived.
    answered: Instant,
    r: Response,
}

/// Publishes `p{n}-{i}` one after the other until `REFUSALS_EACH` of them were
/// refused (503), counting each 201 in `created`.
async fn publisher(a: String, n: usize, created: Arc<AtomicUsize>) -> Vec<Sent> {
    let mut log = Vec::new();
    let mut refusals = 0;
    for i in 0..MAX_PUBLISHES_EACH {
        let id = format!("p{n}-{i}");
        let event = event(&id);
        let sent = Instant::now();
        let r = try_publish(&a, "orders", &event).await;
        let answered = Instant::now();
        match r.status {
            201 => {
                created.fetch_add(1, Ordering::SeqCst);
            }
            503 => refusals += 1,
            _ => {}
        }
        log.push(Sent {
            id,
            event,
            sent,
            answered,
            r,
        });
        if refusals >= REFUSALS_EACH {
            return log;
        }
    }
    panic!("publisher {n} was not refused {REFUSALS_EACH} times in {MAX_PUBLISHES_EACH} publishes");
}

/// Story: publishers keep publishing while the disk fills up. Every publish answered
/// 201 — before the disk filled or in flight when it did — survives a restart, at its
/// partition and offset and exactly as published; the publishes whose own write hit
/// the full disk are answered 504 (never 201); every publish sent after the first
/// refusal is refused unwritten (503, naming the log and the full disk), also after
/// space is back, until a restart; readiness and the metrics name the failed Local
/// engine; after the restart the instance is ready and publishes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_concurrent_publishers_when_the_disk_fills_up_then_publishes_are_refused_until_a_restart_with_space_and_every_201_survives_it(
) {
    let full = FullDisk::build().expect("build the full-disk shim");
    let dir = tempfile::tempdir().unwrap();
    let mut m = start_faulted(dir.path(), &full.env()).await;
    let a = m.addr().to_string();
    create_topic(&a, "orders", 3).await;
    wait_ready(&a).await;
    // Meshd's own Meta writes after boot are done, so the publishes are the writers
    // when the disk fills (no subscription: no delivery flushes either).
    wait_registered(&a).await;
    assert_eq!(
        metric(&a, "meshd_local_healthy{backend=\"rocksdb\"}")
            .await
            .unwrap(),
        1.0
    );

    let created = Arc::new(AtomicUsize::new(0));
    let publishers: Vec<_> = (0..PUBLISHERS)
        .map(|n| tokio::spawn(publisher(a.clone(), n, created.clone())))
        .collect();
    wait_until(
        READY,
        &format!("{BEFORE_FULL} publishes answered 201"),
        || {
            let created = created.clone();
            async move {
                let n = created.load(Ordering::SeqCst);
                ensure!(n >= BEFORE_FULL, "{n} so far");
                Ok(())
            }
        },
    )
    .await
    .unwrap();
    let ssts_before = sst_files(dir.path());
    full.trip().unwrap();
    let mut sent = Vec::new();
    for p in publishers {
        sent.extend(p.await.expect("a publisher panicked"));
    }

    // Every answer is one of the three the contract allows, each with its shape.
    let mut acknowledged: BTreeMap<String, (u64, u64, Value)> = BTreeMap::new();
    let mut unknown: BTreeMap<String, Value> = BTreeMap::new();
    let mut refused = Vec::new();
    for s in &sent {
        match s.r.status {
            201 => {
                let placed = &s.r.json().unwrap()["events"][0];
                assert_eq!(placed["id"], s.event["id"], "{}", s.r.body);
                let (p, o) = (
                    placed["partition"].as_u64().unwrap(),
                    placed["offset"].as_u64().unwrap(),
                );
                acknowledged.insert(s.id.clone(), (p, o, s.event.clone()));
            }
            504 => {
                indeterminate(&s.r, "log", "rocksdb");
                unknown.insert(s.id.clone(), s.event.clone());
            }
            _ => {
                refused_no_space(&s.r, "log", "rocksdb");
                refused.push(s.id.clone());
            }
        }
    }
    eprintln!(
        "{} publishes: {} answered 201, {} 504 (their own write failed), {} 503",
        sent.len(),
        acknowledged.len(),
        unknown.len(),
        refused.len()
    );
    assert!(acknowledged.len() >= BEFORE_FULL);
    assert_eq!(refused.len(), PUBLISHERS * REFUSALS_EACH);
    // Once any publisher was told the disk failed, the store had fail-stopped: every
    // publish sent after that is refused, none is acknowledged or left unknown.
    let first_failure = sent
        .iter()
        .filter(|s| s.r.status != 201)
        .map(|s| s.answered)
        .min()
        .expect("a failure answer");
    for s in sent.iter().filter(|s| s.sent > first_failure) {
        assert_eq!(
            s.r.status, 503,
            "{} was sent after the first failure answer: {}",
            s.id, s.r.body
        );
    }

    // The operator sees it: not ready, naming the Local engine and the embedded Meta
    // that shares it; the metrics count each answer by kind.
    assert_not_ready(
        &a,
        &[("local:rocksdb", "failed"), ("meta:embedded", "failed")],
    )
    .await;
    assert_eq!(
        metric(&a, "meshd_local_healthy{backend=\"rocksdb\"}")
            .await
            .unwrap(),
        0.0
    );
    let failed = metric(
        &a,
        "meshd_store_errors_total{store=\"log\",backend=\"rocksdb\",kind=\"failed\"}",
    )
    .await
    .unwrap();
    assert_eq!(
        failed,
        refused.len() as f64,
        "every refused publish is counted"
    );
    if !unknown.is_empty() {
        let n = metric(
            &a,
            "meshd_store_errors_total{store=\"log\",backend=\"rocksdb\",kind=\"indeterminate\"}",
        )
        .await
        .unwrap();
        assert_eq!(n, unknown.len() as f64, "every unknown outcome is counted");
    }
    // Nothing that was not acknowledged is readable.
    assert_eq!(browse_by_id(&a, "orders", 3).await, acknowledged);

    // Space is back, and RocksDB recovers on its own: its "no space" error handler
    // polls for free space every 5 s, then flushes the memtables to a new SST file
    // and accepts writes again. meshd does not: what reached the disk is unknown
    // until a restart recovers from it, so it keeps refusing after RocksDB is back.
    full.heal().unwrap();
    wait_until(READY, "RocksDB's own recovery (a new SST file)", || {
        let dir = dir.path().to_path_buf();
        let before = ssts_before.clone();
        async move {
            let now = sst_files(&dir);
            ensure!(now.difference(&before).next().is_some(), "SSTs: {now:?}");
            Ok(())
        }
    })
    .await
    .unwrap();
    for i in 0..3 {
        let id = format!("after-heal-{i}");
        let r = try_publish(&a, "orders", &event(&id)).await;
        refused_no_space(&r, "log", "rocksdb");
        refused.push(id);
    }
    assert_not_ready(&a, &[("local:rocksdb", "failed")]).await;

    let (a, after) = restarted_with_every_201(&mut m, "orders", 3, &acknowledged).await;
    // Nothing appears that was never sent, nor anything that was refused; an event
    // with an unknown outcome may be there (once), exactly as published.
    for (id, (_, _, e)) in &after {
        if acknowledged.contains_key(id) {
            continue;
        }
        let Some(sent) = unknown.get(id) else {
            panic!("{id} is in the log but was not acknowledged nor left unknown: {e}");
        };
        assert_eq!(
            e, sent,
            "the unknown-outcome event {id}, if kept, is intact"
        );
    }
    for id in &refused {
        assert!(!after.contains_key(id), "refused publish {id} was applied");
    }

    // The instance serves again.
    let e = event("after-restart");
    let (p, o) = publish(&a, "orders", &e).await.unwrap();
    let again = browse_by_id(&a, "orders", 3).await;
    assert_eq!(again.get("after-restart"), Some(&(p, o, e)));
}

/// Story, the consume path: events handed out before the disk filled are acked while
/// it is full. The ack cannot be written, so it is not acknowledged (no `acked` id);
/// later pulls hand nothing out (503); readiness names the stopped dispatch and the
/// Local engine. After space is back and a restart, every event whose ack was refused
/// is delivered again, with its attempt count intact (2), exactly as published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_events_handed_out_when_they_are_acked_on_a_full_disk_then_no_ack_is_acknowledged_and_after_a_restart_with_space_they_are_delivered_again(
) {
    let full = FullDisk::build().expect("build the full-disk shim");
    let dir = tempfile::tempdir().unwrap();
    let mut m = start_faulted(dir.path(), &full.env()).await;
    let a = m.addr().to_string();
    create_topic(&a, "orders", 2).await;
    // A short lease, so the recovered in-flight deliveries are due again soon after
    // the restart.
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
    let got = pull_until(&a, "billing", published.len(), READY).await;
    assert!(got.iter().all(|d| d.attempt == 1), "{:?}", summary(&got));

    full.trip().unwrap();
    let r = send_json(
        &a,
        "POST",
        "/v1/subscriptions/billing/ack",
        &json!({ "delivery_ids": ids(&got) }),
    )
    .await
    .unwrap();
    // Not acknowledged: a problem (the ack's write failed: 504, or it was refused:
    // 503), never a 200 listing an id as acked.
    // Which of the two depends on whether the ack's write or a concurrent one of
    // meshd's own (the membership keep-alive on the embedded Meta) hit the full disk
    // first.
    let p = match r.status {
        503 => refused_no_space(&r, "deliveries", "rocksdb"),
        504 => indeterminate(&r, "deliveries", "rocksdb"),
        s => panic!("an ack on a full disk answered {s}: {}", r.body),
    };
    eprintln!("the ack on a full disk: {p}");
    let ack_unknown = r.status == 504;
    // Later pulls hand nothing out.
    let r = send_json(
        &a,
        "POST",
        "/v1/subscriptions/billing/pull",
        &json!({"max_events": 10}),
    )
    .await
    .unwrap();
    refused_no_space(&r, "deliveries", "rocksdb");
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

    // Space is back; still stopped until a restart.
    full.heal().unwrap();
    let r = send_json(
        &a,
        "POST",
        "/v1/subscriptions/billing/pull",
        &json!({"max_events": 10}),
    )
    .await
    .unwrap();
    refused_no_space(&r, "deliveries", "rocksdb");

    m.kill();
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    wait_ready(&a).await;
    let again = if ack_unknown {
        // The ack's outcome was unknown: an event may be gone (acked) or delivered
        // again, never both, never changed. Collect what comes within a few leases.
        let mut again = Vec::new();
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until && again.len() < published.len() {
            again.extend(
                pull(&a, "billing", &json!({"max_events": 100, "wait_ms": 1000}))
                    .await
                    .unwrap(),
            );
        }
        eprintln!("ack outcome unknown: redelivered {:?}", summary(&again));
        again
    } else {
        pull_until(&a, "billing", published.len(), READY).await
    };
    let mut delivered = BTreeMap::new();
    for d in &again {
        let id = d.event["id"].as_str().unwrap().to_string();
        assert_eq!(
            Some(&d.event),
            published.get(&id),
            "delivered exactly as published"
        );
        assert_eq!(
            d.attempt,
            2,
            "the attempt count survived: {:?}",
            summary(&again)
        );
        assert!(
            delivered.insert(id.clone(), d.attempt).is_none(),
            "{id} delivered twice"
        );
    }
    if !ack_unknown {
        assert_eq!(
            delivered.keys().collect::<Vec<_>>(),
            published.keys().collect::<Vec<_>>(),
            "a refused ack acknowledged nothing"
        );
    }
    let r = ack(&a, "billing", &ids(&again)).await.unwrap();
    assert_eq!(set(&r["acked"]).len(), again.len(), "{r}");
    assert_no_delivery(&a, "billing", 1500, "every event was acked").await;
}
