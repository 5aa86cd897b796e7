//! Idempotent publish (HTTP API, Additions, "Idempotent publish") through the real
//! binary, in embedded and cluster mode.
//!
//! The failures these pin: a retried publish stored twice (after a 504, a SIGKILL, or
//! on another instance), a duplicate answered with an offset that is not the
//! original's, a repeat inside one batch stored twice, a window that cannot be set or
//! is not validated, and a client that gives up on a request whose outcome it does
//! not know.

mod common;

use common::*;
use meshd_test_support::http::{request_with, send_json};
use meshd_test_support::meshd::MeshdProcess;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn ev(id: &str) -> Value {
    json!({"specversion": "1.0", "id": id, "source": "/dedup-e2e", "type": "t", "data": {"id": id}})
}

/// Publishes `events` as one batch ([`meshd_client::Client::publish_answer`], sent
/// once); the answer's status and body (a refusal's: the problem as the client read
/// it); an error when no answer came.
async fn publish_batch(a: &str, topic: &str, events: &[Value]) -> anyhow::Result<(u16, Value)> {
    status_and_body(client(a).publish_answer(topic, events).await)
}

/// Every event id in the topic's partitions, with how often it is there.
async fn stored_ids(a: &str, topic: &str) -> BTreeMap<String, usize> {
    let ends = end_offsets(a, topic).await;
    let mut out = BTreeMap::new();
    for p in 0..ends.len() {
        for (_, e) in browse_all(a, topic, p as u64).await {
            *out.entry(e["id"].as_str().unwrap().to_string())
                .or_default() += 1;
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_topic_then_its_dedup_window_is_shown_updated_and_validated() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let r = send_json(a, "PUT", "/v1/topics/t", &json!({"partitions": 2}))
        .await
        .unwrap();
    assert_eq!(r.status, 201);
    // On by default at 120000 ms; shown only when set to something else, so a topic
    // that never set it answers as before dedup existed.
    assert_eq!(r.json().unwrap(), json!({"name": "t", "partitions": 2}));
    let r = send_json(
        a,
        "PUT",
        "/v1/topics/t",
        &json!({"partitions": 2, "dedup_window_ms": 5000}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "an update: {}", r.body);
    assert_eq!(r.json().unwrap()["dedup_window_ms"], 5000);
    let got = bare(a, "GET", "/v1/topics/t").await.json().unwrap();
    assert_eq!(got["dedup_window_ms"], 5000, "{got}");
    // A PUT without the field keeps it.
    let r = send_json(a, "PUT", "/v1/topics/t", &json!({"partitions": 2}))
        .await
        .unwrap();
    assert_eq!(r.json().unwrap()["dedup_window_ms"], 5000);
    for bad in [json!(86_400_001), json!(-1), json!("5s"), json!(1.5)] {
        let r = send_json(
            a,
            "PUT",
            "/v1/topics/t",
            &json!({"partitions": 2, "dedup_window_ms": bad}),
        )
        .await
        .unwrap();
        problem_naming(&r, "dedup_window_ms");
    }
    // Off: the same event is stored twice, as before dedup existed.
    let r = send_json(
        a,
        "PUT",
        "/v1/topics/off",
        &json!({"partitions": 1, "dedup_window_ms": 0}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201);
    publish(a, "off", &ev("x")).await.unwrap();
    assert_eq!(publish(a, "off", &ev("x")).await.unwrap(), (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_repeats_inside_a_batch_and_across_requests_then_each_event_is_stored_once_and_answered_with_its_offset(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 3).await;
    let batch = [ev("a"), ev("b"), ev("a"), ev("c")];
    let (status, first) = publish_batch(&a, "t", &batch).await.unwrap();
    assert_eq!(status, 201, "{first}");
    let placed = first["events"].as_array().unwrap().clone();
    assert_eq!(placed.len(), 4, "one answer per event: {first}");
    assert_eq!(placed[2]["duplicate"], true, "{first}");
    assert_eq!(
        (&placed[2]["partition"], &placed[2]["offset"]),
        (&placed[0]["partition"], &placed[0]["offset"]),
        "the repeat names the first: {first}"
    );
    for i in [0, 1, 3] {
        assert!(placed[i].get("duplicate").is_none(), "{first}");
    }
    // The same request again, and again after a SIGKILL: every event a duplicate of
    // the first answer, content not compared (the first stored version wins).
    let mut changed = batch.clone();
    changed[1]["data"] = json!("other content");
    for round in 0..2 {
        let (status, again) = publish_batch(&a_of(&m), "t", &changed).await.unwrap();
        assert_eq!(status, 201, "{again}");
        for (i, e) in again["events"].as_array().unwrap().iter().enumerate() {
            assert_eq!(e["duplicate"], true, "round {round}: {again}");
            let j = if i == 2 { 0 } else { i };
            assert_eq!(
                (&e["partition"], &e["offset"]),
                (&placed[j]["partition"], &placed[j]["offset"]),
                "round {round}: {again}"
            );
        }
        m.kill();
        m.restart().await.unwrap();
    }
    let a = a_of(&m);
    let ids = stored_ids(&a, "t").await;
    assert_eq!(
        ids,
        BTreeMap::from([("a".into(), 1), ("b".into(), 1), ("c".into(), 1)])
    );
    let b = browse_all(&a, "t", placed[1]["partition"].as_u64().unwrap()).await;
    let stored_b = b.iter().find(|(_, e)| e["id"] == "b").unwrap();
    assert_eq!(
        stored_b.1["data"],
        json!({"id": "b"}),
        "the first version is kept"
    );
    let (status, _) = publish_batch(&a, "t", &batch).await.unwrap();
    assert_eq!(status, 201);
    let dups = metric(&a, "meshd_publish_duplicates_total{topic=\"t\"}").await;
    assert_eq!(dups, Some(4.0), "counted since this process started");
    let entries = metric(&a, r#"meshd_dedup_entries{backend="rocksdb"}"#).await;
    assert_eq!(
        entries,
        Some(3.0),
        "three keys, reloaded after the restarts"
    );
}

fn a_of(m: &MeshdProcess) -> String {
    m.addr().to_string()
}

async fn metric(a: &str, sample: &str) -> Option<f64> {
    meshd_test_support::http::metric(a, sample).await.ok()
}

/// Publishers that resend every request not answered 201 (the same events, to
/// whichever address serves now) until it is: what the contract promises such a
/// client after a 504 or a lost connection.
struct Publishers {
    addrs: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<(Vec<String>, usize)>>,
}

impl Publishers {
    fn start(addrs: Vec<String>, topic: &'static str, n: usize) -> Self {
        let addrs = Arc::new(Mutex::new(addrs));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..n)
            .map(|t| {
                let (addrs, stop) = (addrs.clone(), stop.clone());
                tokio::spawn(async move {
                    let (mut sent, mut retries) = (Vec::new(), 0usize);
                    let mut i = 0usize;
                    while !stop.load(Ordering::SeqCst) {
                        let batch: Vec<Value> =
                            (0..5).map(|k| ev(&format!("p{t}-{i}-{k}"))).collect();
                        i += 1;
                        let mut attempt = 0usize;
                        loop {
                            let a = {
                                let list = addrs.lock().unwrap();
                                list[(t + attempt) % list.len()].clone()
                            };
                            match publish_batch(&a, topic, &batch).await {
                                Ok((201, _)) => break,
                                _ => {
                                    attempt += 1;
                                    retries += 1;
                                    assert!(attempt < 600, "a publish never succeeded");
                                    tokio::time::sleep(Duration::from_millis(50)).await;
                                }
                            }
                        }
                        sent.extend(batch.iter().map(|e| e["id"].as_str().unwrap().to_string()));
                    }
                    (sent, retries)
                })
            })
            .collect();
        Self { addrs, stop, tasks }
    }

    async fn finish(self) -> (BTreeSet<String>, usize) {
        self.stop.store(true, Ordering::SeqCst);
        let (mut all, mut retries) = (BTreeSet::new(), 0);
        for t in self.tasks {
            let (sent, r) = t.await.unwrap();
            all.extend(sent);
            retries += r;
        }
        (all, retries)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_meshd_sigkilled_during_a_publish_stream_when_clients_resend_every_request_not_answered_201_then_every_event_is_in_the_log_once(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    create_topic(&a_of(&m), "t", 3).await;
    let publishers = Publishers::start(vec![a_of(&m)], "t", 4);
    for _ in 0..2 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        m.kill();
        m.restart().await.unwrap();
        *publishers.addrs.lock().unwrap() = vec![a_of(&m)];
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (sent, retries) = publishers.finish().await;
    assert!(
        retries > 0,
        "the SIGKILLs cut requests off (else this proves nothing)"
    );
    let stored = stored_ids(&a_of(&m), "t").await;
    let twice: Vec<_> = stored.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "stored more than once: {twice:?}");
    let missing: Vec<_> = sent.iter().filter(|id| !stored.contains_key(*id)).collect();
    assert!(
        missing.is_empty(),
        "answered 201 but not stored: {missing:?}"
    );
    assert!(sent.len() > 40, "{} events", sent.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_when_an_instance_is_sigkilled_mid_stream_and_requests_are_resent_to_the_other_then_every_event_is_stored_once(
) {
    let mut cluster = SmallCluster::start(2, Duration::from_millis(2000)).await;
    let nodes = &mut cluster.nodes;
    let a0 = a_of(&nodes[0]);
    let a1 = a_of(&nodes[1]);
    create_topic(&a0, "t", 3).await;
    // The same batch on both instances: stored once.
    let batch = [ev("x"), ev("y"), ev("x")];
    let (s0, first) = publish_batch(&a0, "t", &batch).await.unwrap();
    let (s1, again) = publish_batch(&a1, "t", &batch).await.unwrap();
    assert_eq!((s0, s1), (201, 201), "{first} {again}");
    assert_eq!(first["events"][2]["duplicate"], true, "{first}");
    for (i, e) in again["events"].as_array().unwrap().iter().enumerate() {
        assert_eq!(e["duplicate"], true, "{again}");
        assert_eq!(e["offset"], first["events"][i]["offset"], "{again}");
    }
    // A publish stream over both; one instance is SIGKILLed and its requests go to
    // the other.
    let publishers = Publishers::start(vec![a0.clone(), a1.clone()], "t", 4);
    tokio::time::sleep(Duration::from_millis(500)).await;
    nodes[0].kill();
    *publishers.addrs.lock().unwrap() = vec![a1.clone()];
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (sent, retries) = publishers.finish().await;
    assert!(
        retries > 0,
        "the SIGKILL cut requests off (else this proves nothing)"
    );
    let stored = stored_ids(&a1, "t").await;
    let twice: Vec<_> = stored.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "stored more than once: {twice:?}");
    let missing: Vec<_> = sent.iter().filter(|id| !stored.contains_key(*id)).collect();
    assert!(
        missing.is_empty(),
        "answered 201 but not stored: {missing:?}"
    );
    assert!(stored.contains_key("x") && stored.contains_key("y"));
}

/// Waits until `id` is stored in `topic` (read from meshd directly, not through the
/// proxy whose answers are being swallowed).
async fn wait_stored(a: &str, topic: &str, id: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !stored_ids(a, topic).await.contains_key(id) {
        assert!(
            std::time::Instant::now() < deadline,
            "{id} never reached meshd"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A topic `t` of 2 partitions on `a`, and a proxy in front of `a` that passes
/// requests and drops every answer until `restore` (which then cuts those
/// connections): a publish that reaches meshd and whose outcome the client never
/// learns, as after a lost network path or a 504.
async fn answers_lost_in_front_of(a: &str) -> meshd_test_support::proxy::TcpProxy {
    create_topic(a, "t", 2).await;
    let proxy = meshd_test_support::proxy::TcpProxy::start(a.parse().unwrap())
        .await
        .unwrap();
    proxy.swallow_replies();
    proxy
}

async fn assert_stored_once(a: &str, ids: &[&str]) {
    let stored = stored_ids(a, "t").await;
    for id in ids {
        assert_eq!(stored.get(*id), Some(&1), "{id}: {stored:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_publish_whose_answer_is_lost_then_the_client_crate_sends_it_again_by_itself_and_each_event_is_stored_once(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = a_of(&m);
    let proxy = answers_lost_in_front_of(&a).await;
    let client = meshd_client::Client::connect(&format!("http://{}", proxy.addr())).unwrap();
    let publish = tokio::spawn(async move { client.publish("t", &[ev("a1"), ev("a2")]).await });
    wait_stored(&a, "t", "a2").await;
    proxy.restore();
    let answer = tokio::time::timeout(Duration::from_secs(30), publish)
        .await
        .expect("the client gave up waiting")
        .unwrap()
        .expect("the client's own retry got the answer");
    // The answer came from a second request: it found both events stored already.
    assert!(
        answer.iter().all(|s| s.duplicate),
        "answered by the first request? {answer:?}"
    );
    assert_stored_once(&a, &["a1", "a2"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_publish_whose_answer_is_lost_then_meshd_publish_sends_the_batch_again_by_itself_and_each_event_is_stored_once(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = a_of(&m);
    let proxy = answers_lost_in_front_of(&a).await;
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_meshd"));
    let server = format!("http://{}", proxy.addr());
    cmd.args(["publish", "t"])
        .args([ev("c1").to_string(), ev("c2").to_string()])
        .args(["--server", &server])
        .env_remove("MESHD_SERVER")
        .env_remove("MESHD_TOKEN")
        .env("RUST_LOG", "off")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().expect("spawn the CLI");
    wait_stored(&a, "t", "c2").await;
    proxy.restore();
    let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
        .await
        .expect("the CLI did not finish")
        .expect("wait for the CLI");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "stderr: {stderr}");
    assert!(stderr.contains("sending it again"), "stderr: {stderr}");
    assert_stored_once(&a, &["c1", "c2"]).await;
}

/// `--max-dedup-entries` (http-api.md "Security rules (third round)"): the dedup
/// index's memory is bounded without ever dropping an entry early. At the cap a
/// publish that would add keys is 429 `dedup-full` with `Retry-After` (the time until
/// the oldest entry expires) and stores nothing; a duplicate is still answered as one
/// (the guarantee holds at the cap); once the oldest entries expire, publishing goes
/// on. A topic with dedup off is unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_the_dedup_index_at_its_cap_then_new_keys_wait_for_expiry_and_duplicates_are_still_answered(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(bin(), dir.path(), &["--max-dedup-entries", "3"])
        .await
        .unwrap();
    let a = m.addr();
    for (topic, window) in [("t", 3000), ("plain", 0)] {
        create_topic_with(
            a,
            topic,
            json!({"partitions": 1, "dedup_window_ms": window}),
        )
        .await;
    }
    let (status, body) = publish_batch(a, "t", &[ev("e1"), ev("e2")]).await.unwrap();
    assert_eq!(status, 201, "{body}");
    // Two new keys do not fit beside two: the whole batch is refused, nothing stored.
    let r = request_with(
        a,
        "POST",
        "/v1/topics/t/events",
        &[("Content-Type", "application/cloudevents-batch+json")],
        json!([ev("e3"), ev("e4")]).to_string().as_bytes(),
    )
    .await
    .unwrap();
    let p = problem(&r, 429);
    assert!(p["type"].as_str().unwrap().ends_with("/dedup-full"), "{p}");
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=3).contains(&retry), "Retry-After {retry}");
    let (status, body) = publish_batch(a, "t", &[ev("e3")]).await.unwrap();
    assert_eq!(status, 201, "one more fits: {body}");
    // At the cap: a new key waits, a duplicate is answered as a duplicate, and a
    // topic without dedup publishes.
    let (status, body) = publish_batch(a, "t", &[ev("e4")]).await.unwrap();
    assert_eq!(status, 429, "{body}");
    let (status, body) = publish_batch(a, "t", &[ev("e1"), ev("e3")]).await.unwrap();
    assert_eq!(status, 201, "{body}");
    assert!(
        body["events"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["duplicate"] == true),
        "{body}"
    );
    let (status, body) = publish_batch(a, "plain", &[ev("x")]).await.unwrap();
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        stored_ids(a, "t").await,
        BTreeMap::from([("e1".into(), 1), ("e2".into(), 1), ("e3".into(), 1)])
    );
    // Once the oldest entries' window ends, new keys are taken again (before the
    // periodic sweep: the append at the cap sweeps what expired).
    let stored = meshd_test_support::wait::wait_until(
        Duration::from_secs(15),
        "e4 published once the oldest dedup entries expired",
        || async {
            let (status, body) = publish_batch(a, "t", &[ev("e4")]).await?;
            anyhow::ensure!(status == 201, "{status}: {body}");
            Ok(body)
        },
    )
    .await
    .unwrap();
    assert!(stored["events"][0].get("duplicate").is_none(), "{stored}");
    let refused = metric(a, r#"meshd_dedup_full_total{backend="rocksdb"}"#)
        .await
        .unwrap();
    assert!(refused >= 2.0, "meshd_dedup_full_total {refused}");
}
