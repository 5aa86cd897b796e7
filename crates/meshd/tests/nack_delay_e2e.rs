//! A nack's `delay_ms` (http-api.md, Additions, "Parking") through the real binary, in
//! embedded and in cluster mode: the retry waits the delay instead of the backoff, later
//! offsets flow meanwhile, it still counts as a failed attempt, a bad value is a 400
//! naming the field, and a nack on an instance that does not own the partition carries
//! the delay to the owner.
//!
//! The subscriptions here back off for an hour, so a redelivery within the test's
//! deadline can only come from the delay.

mod common;

use common::*;
use meshd_test_support::http::send_json;
use serde_json::{json, Value};
use std::time::Duration;

const DRAIN: Duration = Duration::from_secs(30);
const HOUR_MS: u64 = 3_600_000;

fn hour_backoff(topic: &str, max_attempts: u32) -> Value {
    json!({
        "topic": topic,
        "max_attempts": max_attempts,
        "ack_timeout_ms": 60000,
        "backoff": {"initial_ms": HOUR_MS, "max_ms": HOUR_MS}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_nack_with_delay_ms_then_the_retry_waits_that_instead_of_the_backoff_and_still_counts(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", hour_backoff("t", 3)).await;
    publish(
        &a,
        "t",
        &json!({"specversion":"1.0","id":"e0","source":"/d","type":"t"}),
    )
    .await
    .unwrap();
    let first = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&first), [(0, 0, 1)]);

    // Out of range, or not a number: a 400 naming delay_ms, and nothing happens.
    for bad in [json!(86_400_001u64), json!(-1), json!("10")] {
        let r = send_json(
            &a,
            "POST",
            "/v1/subscriptions/s/nack",
            &json!({"delivery_ids": ids(&first), "delay_ms": bad}),
        )
        .await
        .unwrap();
        let p = problem_naming(&r, "delay_ms");
        assert_eq!(p["status"], 400, "{p}");
    }

    let r = nack_delayed(&a, "s", &ids(&first), 1500).await;
    assert_eq!(set(&r["retrying"]), set_of(&ids(&first)), "{r}");
    // A later offset goes out while offset 0 waits.
    publish(
        &a,
        "t",
        &json!({"specversion":"1.0","id":"e1","source":"/d","type":"t"}),
    )
    .await
    .unwrap();
    let later = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&later), [(0, 1, 1)], "only the later offset");
    ack(&a, "s", &ids(&later)).await.unwrap();
    // The retry comes after the delay, not after the hour of backoff.
    let second = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&second), [(0, 0, 2)]);
    // A delay of 0 is due at once; the third failure dead-letters whatever the delay.
    nack_delayed(&a, "s", &ids(&second), 0).await;
    let third = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&third), [(0, 0, 3)]);
    let r = nack_delayed(&a, "s", &ids(&third), 1000).await;
    let resolved = set(&r["dead_lettered"])
        .union(&set(&r["dead_lettering"]))
        .cloned()
        .collect();
    assert_eq!(set_of(&ids(&third)), resolved, "{r}");
    wait_committed(&a, "s", 0, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_when_a_non_owner_takes_a_nack_with_delay_ms_then_the_owners_honour_it() {
    let cluster = SmallCluster::start(2, Duration::from_millis(2000)).await;
    let a0 = cluster.nodes[0].addr().to_string();
    let a1 = cluster.nodes[1].addr().to_string();
    create_topic(&a0, "t", 4).await;
    create_subscription(&a0, "s", hour_backoff("t", 5)).await;
    // A partition moved between the pull and the retry would come back only when its
    // lease (a minute) runs out: start once the partitions have settled.
    cluster.wait_settled("t", 4).await;
    let members = ["inst-0", "inst-1"];
    for m in members {
        assert!(
            (0..4).any(|p| meshd_runtime::cluster::assign::owner(&members, "t", p) == Some(m)),
            "{m} owns a partition of t, so the nack on inst-1 is forwarded for some"
        );
    }
    for i in 0..8 {
        publish(
            &a0,
            "t",
            &json!({"specversion":"1.0","id":format!("c{i}"),"source":"/d","type":"t"}),
        )
        .await
        .unwrap();
    }
    // Both instances own partitions; a pull on one gathers all of them, and its nack
    // goes to each owner with the delay.
    let first = pull_until(&a1, "s", 8, DRAIN).await;
    let partitions: std::collections::BTreeSet<u64> = first.iter().map(|d| d.partition).collect();
    assert!(partitions.len() > 1, "{:?}", summary(&first));
    let r = nack_delayed(&a1, "s", &ids(&first), 1000).await;
    assert_eq!(set(&r["retrying"]), set_of(&ids(&first)), "{r}");
    // Pulled on the other instance: its own retries and its peer's fall due at the
    // same moment, so its forwarded long poll is often given up while the peer hands
    // out under it; those hand-outs must come back at once (released), not when their
    // minute-long lease runs out.
    let again = pull_until(&a0, "s", 8, DRAIN).await;
    assert!(
        again.iter().all(|d| d.attempt == 2),
        "{:?}",
        summary(&again)
    );
    let offsets = |ds: &[Delivery]| {
        let mut v: Vec<(u64, u64)> = ds.iter().map(|d| (d.partition, d.offset)).collect();
        v.sort_unstable();
        v
    };
    assert_eq!(offsets(&again), offsets(&first));
}
