//! Ordered delivery per key (`"ordering": "key"`, http-api.md, Additions, "Parking")
//! through the real binary: among the events of one `partitionkey` at most one is in
//! flight, waiting for a retry, parked for its time or being dead-lettered; the later
//! ones are parked behind it (their bodies in the park index) and go out in offset
//! order once it is acked or dead-lettered, while other keys flow and the committed
//! offset moves past the held events. It holds across SIGKILL (embedded) and across a
//! takeover after the owner's SIGKILL (cluster: the held entries move in the park
//! journal on nats-server).

mod common;

use common::*;
use meshd_stores::time::Timestamp;
use meshd_test_support::meshd::MeshdProcess;
use serde_json::{json, Value};
use std::time::Duration;

const DRAIN: Duration = Duration::from_secs(30);

fn now_ms() -> i64 {
    Timestamp::now().as_millis()
}

/// An event of ordering key `key` (`None`: no `partitionkey`).
fn keyed(id: &str, key: Option<&str>) -> Value {
    let mut e = event(id);
    if let Some(k) = key {
        e["partitionkey"] = json!(k);
    }
    e
}

fn ordered_sub(topic: &str, max_attempts: u32) -> Value {
    json!({"topic": topic, "ordering": "key", "ack_timeout_ms": 2000,
           "max_attempts": max_attempts, "backoff": {"initial_ms": 100, "max_ms": 100}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_ordered_subscription_then_a_key_is_held_behind_a_nack_a_retry_and_sigkills_while_other_keys_flow(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = MeshdProcess::start(bin(), dir.path(), &["--park-retries-after-ms", "1000"])
        .await
        .expect("start meshd");
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    let created = create_subscription(&a, "s", ordered_sub("t", 10)).await;
    assert_eq!(created["ordering"], "key", "{created}");
    for (id, key) in [
        ("b1", Some("b")),
        ("a1", Some("a")),
        ("a2", Some("a")),
        ("a3", Some("a")),
        ("c1", None),
    ] {
        publish(&a, "t", &keyed(id, key)).await.unwrap();
    }
    // Key a's later events wait behind a1; key b and the keyless event flow.
    let first = pull_until(&a, "s", 3, DRAIN).await;
    assert_eq!(
        event_ids(&first),
        ["b1", "a1", "c1"],
        "{:?}",
        summary(&first)
    );
    assert_eq!(parked(&a, "s").await, 2, "a2 and a3 are parked behind a1");
    let (a1, others): (Vec<_>, Vec<_>) = first.into_iter().partition(|d| d.offset == 1);
    ack(&a, "s", &ids(&others)).await.unwrap();

    // A nack: a1 is retried (attempt 2) and a2 still waits.
    let r = nack(&a, "s", &ids(&a1), "not yet").await.unwrap();
    assert_eq!(set(&r["retrying"]), set_of(&ids(&a1)), "{r}");
    let retried = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&retried), [(0, 1, 2)], "only a1's retry");
    // Other keys keep flowing meanwhile.
    publish(&a, "t", &keyed("b2", Some("b"))).await.unwrap();
    let b2 = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&b2), ["b2"]);
    ack(&a, "s", &ids(&b2)).await.unwrap();

    // A long retry parks a1 (and the key with it): the committed offset moves past
    // every held event.
    let nacked_at = now_ms();
    let r = nack_delayed(&a, "s", &ids(&retried), 3000).await;
    assert_eq!(set(&r["retrying"]), set_of(&ids(&retried)), "{r}");
    wait_committed(&a, "s", 0, 6).await;
    assert_eq!(parked(&a, "s").await, 3);

    // SIGKILL: still held, a1 comes back first at its time with its next attempt.
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    assert_eq!(committed(&a, "s", 0).await.unwrap(), 6);
    assert_eq!(parked(&a, "s").await, 3);
    let again = pull_until(&a, "s", 1, DRAIN).await;
    assert!(
        now_ms() >= nacked_at + 3000,
        "the retry came before its delay"
    );
    assert_eq!(summary(&again), [(0, 1, 3)], "a1 first, attempt 3");
    assert_no_delivery(&a, "s", 1000, "a2 went out while a1 was in flight").await;

    // SIGKILL with a1 in flight: it comes again once its lease ends; a2 still waits.
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    let again = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&again), [(0, 1, 4)], "a1 again after its lease");
    // Acked, the key goes on in offset order, one at a time.
    ack(&a, "s", &ids(&again)).await.unwrap();
    for (want, offset) in [("a2", 2), ("a3", 3)] {
        let next = pull_until(&a, "s", 1, DRAIN).await;
        assert_eq!(event_ids(&next), [want], "{:?}", summary(&next));
        assert_eq!(summary(&next), [(0, offset, 1)]);
        ack(&a, "s", &ids(&next)).await.unwrap();
    }
    assert_eq!(parked(&a, "s").await, 0);
    assert_no_delivery(&a, "s", 1000, "an acked event of the key came again").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_ordered_key_then_a_delay_holds_it_and_dead_lettering_releases_it() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", ordered_sub("t", 1)).await;
    let at = now_ms() + 2000;
    let mut first = keyed("a1", Some("a"));
    first["deliverat"] = json!(Timestamp::from_millis(at).unwrap().to_rfc3339());
    publish(&a, "t", &first).await.unwrap();
    publish(&a, "t", &keyed("a2", Some("a"))).await.unwrap();
    publish(&a, "t", &keyed("b1", Some("b"))).await.unwrap();
    // a2 waits behind the delayed a1 (not due yet); b1 flows.
    let got = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&got), ["b1"]);
    ack(&a, "s", &ids(&got)).await.unwrap();
    wait_committed(&a, "s", 0, 3).await;
    let got = pull_until(&a, "s", 1, DRAIN).await;
    assert!(now_ms() >= at, "a1 came before its deliverat");
    assert_eq!(event_ids(&got), ["a1"], "{:?}", summary(&got));
    // Its only attempt fails: dead-lettered, which releases the key.
    let r = nack(&a, "s", &ids(&got), "poison").await.unwrap();
    assert_eq!(set(&r["dead_lettered"]), set_of(&ids(&got)), "{r}");
    let next = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&next), ["a2"]);
    ack(&a, "s", &ids(&next)).await.unwrap();
    let dead = dead_letters(&a, "s").await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(parked(&a, "s").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_ordered_key_when_a_dead_letter_is_redriven_then_it_goes_to_the_back_of_its_key_across_sigkill(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", ordered_sub("t", 2)).await;
    publish(&a, "t", &keyed("a1", Some("a"))).await.unwrap();
    publish(&a, "t", &keyed("a2", Some("a"))).await.unwrap();
    let got = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&got), ["a1"]);
    nack(&a, "s", &ids(&got), "poison").await.unwrap();
    let got = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&got), [(0, 0, 2)], "a1's retry, a2 still behind it");
    let r = nack(&a, "s", &ids(&got), "poison").await.unwrap();
    assert_eq!(set(&r["dead_lettered"]), set_of(&ids(&got)), "{r}");
    // a2 is out now (not acked) when a1 is redriven: a1 goes behind it.
    let a2 = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&a2), ["a2"]);
    let entry = dead_letters(&a, "s").await.remove(0);
    let id = entry["id"].as_str().unwrap().to_string();
    redrive(&a, &id).await;
    // Published after the redrive: behind a1.
    publish(&a, "t", &keyed("a3", Some("a"))).await.unwrap();
    assert_no_delivery(&a, "s", 1000, "the redrive jumped the key's line").await;
    // a2 went out from the park index (it was held behind a1): it counts until
    // settled, with a1 (redriven) and a3 waiting behind it.
    assert_eq!(parked(&a, "s").await, 3);

    // SIGKILL: a2 comes again after its lease, then a1 (afresh), then a3, one at a
    // time.
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    for (want, offset, attempt) in [("a2", 1, 2), ("a1", 0, 1), ("a3", 2, 1)] {
        let next = pull_until(&a, "s", 1, DRAIN).await;
        assert_eq!(event_ids(&next), [want], "{:?}", summary(&next));
        assert_eq!(summary(&next), [(0, offset, attempt)]);
        ack(&a, "s", &ids(&next)).await.unwrap();
    }
    // The redrive is settled in the dead-letter store, and nothing is left parked.
    assert!(dead_letters(&a, "s").await.is_empty());
    assert_eq!(parked(&a, "s").await, 0);
    assert_no_delivery(&a, "s", 1000, "a settled event of the key came again").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bad_ordering_then_the_put_is_a_400_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    let r = meshd_test_support::http::send_json(
        &a,
        "PUT",
        "/v1/subscriptions/s",
        &json!({"topic": "t", "ordering": "fifo"}),
    )
    .await
    .unwrap();
    problem_naming(&r, "ordering");
    // The default shows as "none".
    let created = create_subscription(&a, "plain", json!({"topic": "t"})).await;
    assert_eq!(created["ordering"], "none", "{created}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_when_the_owner_is_sigkilled_with_a_key_s_event_in_flight_then_the_new_owner_keeps_the_key_held(
) {
    let mut cluster = SmallCluster::start(2, Duration::from_millis(2000)).await;
    let a0 = cluster.addr(0);
    create_topic(&a0, "t", 1).await;
    create_subscription(&a0, "s", ordered_sub("t", 10)).await;
    cluster.wait_settled("t", 1).await;
    let owner = cluster.designated_owner("t", 0);
    let survivor = cluster.addr(1 - owner);
    for (id, key) in [("a1", "a"), ("a2", "a"), ("b1", "b")] {
        publish(&survivor, "t", &keyed(id, Some(key)))
            .await
            .unwrap();
    }
    let first = pull_until(&survivor, "s", 2, DRAIN).await;
    assert_eq!(event_ids(&first), ["a1", "b1"], "{:?}", summary(&first));
    assert_eq!(parked(&survivor, "s").await, 1, "a2 parked behind a1");

    // The owner dies with a1 in flight (not acked).
    cluster.nodes[owner].kill();
    // The new owner rebuilds the held entry from the journal: a1 comes again after its
    // lease (attempt 2) and a2 never before a1 is acked. b1 (not acked) may come
    // again too.
    let again = loop {
        let got = pull_until(&survivor, "s", 1, DRAIN).await;
        assert!(
            !event_ids(&got).contains(&"a2".to_string()),
            "a2 went out before a1 was acked: {:?}",
            summary(&got)
        );
        let (a1, others): (Vec<_>, Vec<_>) = got.into_iter().partition(|d| d.offset == 0);
        ack(&survivor, "s", &ids(&others)).await.unwrap();
        if !a1.is_empty() {
            break a1;
        }
    };
    assert_eq!(summary(&again), [(0, 0, 2)]);
    assert_no_delivery(&survivor, "s", 1000, "a2 went out while a1 was in flight").await;
    ack(&survivor, "s", &ids(&again)).await.unwrap();
    let next = pull_until(&survivor, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&next), ["a2"], "{:?}", summary(&next));
    ack(&survivor, "s", &ids(&next)).await.unwrap();
    assert_eq!(parked(&survivor, "s").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_when_the_owner_is_sigkilled_after_a_key_was_released_then_the_acked_event_never_comes_again(
) {
    // Checkpoints far apart: only the checkpoint a release writes makes the ack
    // durable in Meta before the next event of the key goes out.
    let mut cluster = SmallCluster::start_with(
        2,
        Duration::from_millis(2000),
        &["--checkpoint-ms", "600000"],
    )
    .await;
    let a0 = cluster.addr(0);
    create_topic(&a0, "t", 1).await;
    create_subscription(&a0, "s", ordered_sub("t", 10)).await;
    cluster.wait_settled("t", 1).await;
    let owner = cluster.designated_owner("t", 0);
    let survivor = cluster.addr(1 - owner);
    publish(&survivor, "t", &keyed("b1", Some("b")))
        .await
        .unwrap();
    publish(&survivor, "t", &keyed("a1", Some("a")))
        .await
        .unwrap();
    publish(&survivor, "t", &keyed("a2", Some("a")))
        .await
        .unwrap();
    let first = pull_until(&survivor, "s", 2, DRAIN).await;
    assert_eq!(event_ids(&first), ["b1", "a1"], "{:?}", summary(&first));
    let r = ack(&survivor, "s", &ids(&first)).await.unwrap();
    assert_eq!(set(&r["acked"]), set_of(&ids(&first)), "{r}");
    let a2 = pull_until(&survivor, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&a2), ["a2"], "{:?}", summary(&a2));

    cluster.nodes[owner].kill();
    // The new owner hands a2 out again (in flight, not acked), never b1 or a1.
    let again = pull_until(&survivor, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&again), ["a2"], "{:?}", summary(&again));
    ack(&survivor, "s", &ids(&again)).await.unwrap();
    assert_no_delivery(&survivor, "s", 1000, "an acked event came again").await;
}
