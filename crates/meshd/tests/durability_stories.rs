//! Durability stories of issue 6, one test each, through the real binary killed with
//! SIGKILL and restarted on the same data dir.

mod common;

use common::*;
use meshd_test_support::http::request_with;
use serde_json::{json, Value};
use std::time::Duration;

const DRAIN: Duration = Duration::from_secs(30);

async fn publish_batch(a: &str, topic: &str, events: &[Value]) {
    let body = Value::Array(events.to_vec()).to_string();
    let r = request_with(
        a,
        "POST",
        &format!("/v1/topics/{topic}/events"),
        &[("Content-Type", "application/cloudevents-batch+json")],
        body.as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offset_store_restart_given_offset_100_committed_when_killed_then_it_is_100_and_the_next_pull_starts_there(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", json!({"topic": "t"})).await;
    let events: Vec<Value> = (0..100).map(|i| event(&format!("e{i}"))).collect();
    publish_batch(&a, "t", &events).await;
    let got = pull_until(&a, "s", 100, DRAIN).await;
    assert_eq!(got.len(), 100);
    let r = ack(&a, "s", &ids(&got)).await.unwrap();
    assert_eq!(set(&r["acked"]).len(), 100, "{r}");
    wait_committed(&a, "s", 0, 100).await;

    m.kill();
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    assert_eq!(committed(&a, "s", 0).await.unwrap(), 100);
    publish(&a, "t", &event("e100")).await.unwrap();
    let next = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(
        summary(&next),
        vec![(0, 100, 1)],
        "the next pull starts at 100: {next:?}"
    );
    assert_no_delivery(&a, "s", 500, "nothing below 100 comes back").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_store_restart_given_an_event_failed_3_times_when_killed_then_it_is_dead_lettered_once_with_attempts_3(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(
        &a,
        "s",
        json!({"topic": "t", "max_attempts": 3, "backoff": {"initial_ms": 1, "max_ms": 1}}),
    )
    .await;
    publish(&a, "t", &event("poison")).await.unwrap();
    for attempt in 1..=3u64 {
        let ds = pull_until(&a, "s", 1, DRAIN).await;
        assert_eq!(summary(&ds), vec![(0, 0, attempt)]);
        let r = nack(&a, "s", &ids(&ds), &format!("failure {attempt}"))
            .await
            .unwrap();
        let want = if attempt == 3 {
            "dead_lettered"
        } else {
            "retrying"
        };
        assert_eq!(set(&r[want]).len(), 1, "{r}");
    }
    m.kill();
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    let entries = dead_letters(&a, "s").await;
    assert_eq!(entries.len(), 1, "exactly once: {entries:?}");
    assert_eq!(entries[0]["attempts"], 3);
    assert_eq!(entries[0]["reason"], "failure 3");
    assert_eq!(committed(&a, "s", 0).await.unwrap(), 1);
    assert_no_delivery(&a, "s", 500, "not delivered again").await;
}
