//! Delayed delivery (`deliverat`, http-api.md, Additions, "Parking") through the real
//! binary in embedded mode: an event is not handed out before its time, later offsets
//! flow meanwhile and the committed offset moves past it (it is parked, with its body,
//! in the park index), it waits across SIGKILL, an unparked event that was handed out
//! and not acked comes again with its next attempt after a SIGKILL, an unparked event
//! that fails `max_attempts` times is dead-lettered with its body, a due event goes
//! out at its time while an earlier offset is still in flight, and `stats` and
//! `/metrics` count parked events.

mod common;

use common::*;
use meshd_stores::time::Timestamp;
use meshd_test_support::http::metric;
use serde_json::{json, Value};
use std::time::Duration;

const DRAIN: Duration = Duration::from_secs(30);

fn now_ms() -> i64 {
    Timestamp::now().as_millis()
}

/// An event to be delivered at `at_ms` (unix ms).
fn delayed(id: &str, at_ms: i64) -> Value {
    json!({
        "specversion": "1.0", "id": id, "source": "/d", "type": "t",
        "deliverat": Timestamp::from_millis(at_ms).unwrap().to_rfc3339(),
        "data": {"n": id}
    })
}

fn sub(topic: &str) -> Value {
    json!({"topic": topic, "ack_timeout_ms": 2000, "max_attempts": 2,
           "backoff": {"initial_ms": 100, "max_ms": 100}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_event_with_a_later_deliverat_then_it_waits_while_later_offsets_flow_and_committed_passes_it(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", sub("t")).await;
    let at = now_ms() + 3000;
    publish(&a, "t", &delayed("later", at)).await.unwrap();
    publish(&a, "t", &event("now")).await.unwrap();
    // A past deliverat means now.
    publish(&a, "t", &delayed("past", now_ms() - 60_000))
        .await
        .unwrap();

    let first = pull_until(&a, "s", 2, DRAIN).await;
    assert_eq!(
        summary(&first),
        [(0, 1, 1), (0, 2, 1)],
        "only the undelayed"
    );
    let r = ack(&a, "s", &ids(&first)).await.unwrap();
    assert_eq!(set(&r["acked"]).len(), 2, "{r}");
    // Offset 0 is parked: the committed offset moves past it.
    wait_committed(&a, "s", 0, 3).await;
    assert_eq!(parked(&a, "s").await, 1);
    assert_eq!(
        metric(&a, "meshd_parked_events{subscription=\"s\"}")
            .await
            .unwrap(),
        1.0
    );

    let later = pull_until(&a, "s", 1, DRAIN).await;
    let handed_at = now_ms();
    assert_eq!(summary(&later), [(0, 0, 1)]);
    assert!(
        handed_at >= at,
        "handed out {} ms before its deliverat",
        at - handed_at
    );
    assert_eq!(later[0].event["id"], "later");
    assert_eq!(later[0].event["data"], json!({"n": "later"}), "body kept");
    // Still in the index until it is settled.
    assert_eq!(parked(&a, "s").await, 1);
    let r = ack(&a, "s", &ids(&later)).await.unwrap();
    assert_eq!(set(&r["acked"]), set_of(&ids(&later)), "{r}");
    assert_eq!(parked(&a, "s").await, 0);
    assert_eq!(committed(&a, "s", 0).await.unwrap(), 3);
    assert_no_delivery(&a, "s", 2500, "an acked unparked event came again").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_parked_events_when_meshd_is_sigkilled_then_they_wait_and_an_unacked_unparked_one_comes_again(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", sub("t")).await;
    let soon = now_ms() + 1000;
    publish(&a, "t", &delayed("soon", soon)).await.unwrap();
    let late = now_ms() + 6000;
    publish(&a, "t", &delayed("late", late)).await.unwrap();
    publish(&a, "t", &event("now")).await.unwrap();
    let first = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&first), [(0, 2, 1)]);
    ack(&a, "s", &ids(&first)).await.unwrap();
    wait_committed(&a, "s", 0, 3).await;
    // "soon" is handed out from the park index and not acked.
    let soon_got = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&soon_got), [(0, 0, 1)]);
    assert!(now_ms() >= soon);

    m.restart().await.unwrap();
    let a = m.addr().to_string();
    assert_eq!(parked(&a, "s").await, 2, "both still parked after SIGKILL");
    assert_eq!(committed(&a, "s", 0).await.unwrap(), 3);
    // "soon" comes again once its lease ends, as attempt 2; "late" at its time.
    let again = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&again), [(0, 0, 2)]);
    assert_eq!(again[0].event["id"], "soon");
    ack(&a, "s", &ids(&again)).await.unwrap();
    let late_got = pull_until(&a, "s", 1, DRAIN).await;
    assert!(now_ms() >= late, "handed out before its deliverat");
    assert_eq!(summary(&late_got), [(0, 1, 1)]);
    assert_eq!(late_got[0].event["id"], "late");
    ack(&a, "s", &ids(&late_got)).await.unwrap();
    assert_eq!(parked(&a, "s").await, 0);

    // Settled entries stay settled across another SIGKILL.
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    assert_eq!(parked(&a, "s").await, 0);
    assert_no_delivery(
        &a,
        "s",
        3000,
        "a settled parked event came again after SIGKILL",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_earlier_event_in_flight_then_a_due_parked_event_goes_out_at_its_time_and_its_count_survives_sigkill(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    // A long lease: the first event holds `committed` below the delayed one throughout.
    create_subscription(
        &a,
        "s",
        json!({"topic": "t", "ack_timeout_ms": 4000, "max_attempts": 5,
               "backoff": {"initial_ms": 100, "max_ms": 100}}),
    )
    .await;
    publish(&a, "t", &event("slow")).await.unwrap();
    let at = now_ms() + 1500;
    publish(&a, "t", &delayed("delayed", at)).await.unwrap();
    let slow = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&slow), [(0, 0, 1)]);
    let slow_lease_ends = now_ms() + 4000;
    // Due while offset 0 is in flight: handed out at its time, not after offset 0.
    let got = pull_until(&a, "s", 1, DRAIN).await;
    assert!(now_ms() >= at, "handed out before its deliverat");
    assert!(
        now_ms() < slow_lease_ends,
        "the due event waited for the earlier offset's lease"
    );
    assert_eq!(summary(&got), [(0, 1, 1)]);
    assert_eq!(got[0].event["id"], "delayed");
    assert_eq!(committed(&a, "s", 0).await.unwrap(), 0);
    assert_eq!(parked(&a, "s").await, 1);

    // SIGKILL with both in flight: each comes again after its lease, attempt 2 (the
    // delayed one's count is its record's, not its park entry's 0).
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    assert_eq!(parked(&a, "s").await, 1);
    let again = pull_until(&a, "s", 2, DRAIN).await;
    let mut s = summary(&again);
    s.sort();
    assert_eq!(s, [(0, 0, 2), (0, 1, 2)]);
    ack(&a, "s", &ids(&again)).await.unwrap();
    wait_committed(&a, "s", 0, 2).await;
    assert_eq!(parked(&a, "s").await, 0);

    // Acked is settled: nothing comes again after another SIGKILL.
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    assert_no_delivery(&a, "s", 2500, "an acked event came again after SIGKILL").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_unparked_event_that_fails_max_attempts_then_it_is_dead_lettered_with_its_body() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", sub("t")).await;
    let at = now_ms() + 1500;
    publish(&a, "t", &delayed("poison", at)).await.unwrap();
    wait_committed(&a, "s", 0, 1).await;
    assert_eq!(parked(&a, "s").await, 1);
    for attempt in 1..=2u64 {
        let got = pull_until(&a, "s", 1, DRAIN).await;
        assert!(now_ms() >= at, "handed out before its deliverat");
        assert_eq!(summary(&got), [(0, 0, attempt)]);
        let r = nack(&a, "s", &ids(&got), "bad").await.unwrap();
        let list = if attempt == 2 {
            "dead_lettered"
        } else {
            "retrying"
        };
        assert_eq!(set(&r[list]), set_of(&ids(&got)), "{r}");
    }
    let dl = dead_letters(&a, "s").await;
    assert_eq!(dl.len(), 1, "{dl:?}");
    assert_eq!(dl[0]["offset"], 0);
    assert_eq!(dl[0]["attempts"], 2);
    assert_eq!(dl[0]["event"]["id"], "poison", "{}", dl[0]);
    assert_eq!(parked(&a, "s").await, 0);
    assert_no_delivery(&a, "s", 1500, "a dead-lettered unparked event came again").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_when_the_owner_of_a_parked_event_is_sigkilled_then_the_new_owner_delivers_it_at_its_time(
) {
    let mut cluster = SmallCluster::start(2, Duration::from_millis(2000)).await;
    let a0 = cluster.addr(0);
    create_topic(&a0, "t", 1).await;
    create_subscription(&a0, "s", sub("t")).await;
    cluster.wait_settled("t", 1).await;
    let owner = cluster.designated_owner("t", 0);
    let survivor = cluster.addr(1 - owner);
    // Far enough ahead that the takeover (lease 2 s) happens before it is due.
    let at = now_ms() + 8000;
    publish(&survivor, "t", &delayed("later", at))
        .await
        .unwrap();
    publish(&survivor, "t", &event("now")).await.unwrap();
    let first = pull_until(&survivor, "s", 1, DRAIN).await;
    assert_eq!(summary(&first), [(0, 1, 1)], "only the undelayed");
    ack(&survivor, "s", &ids(&first)).await.unwrap();
    wait_committed(&survivor, "s", 0, 2).await;
    assert_eq!(parked(&survivor, "s").await, 1);

    cluster.nodes[owner].kill();
    // The survivor takes the partition over and rebuilds its park index from the
    // journal on nats-server: the event is parked there, not delivered early.
    meshd_test_support::wait::wait_until(DRAIN, "the survivor owns the partition", || {
        let survivor = survivor.clone();
        async move {
            let r = answered(client(&survivor).stats_answer("s").await, 200, "stats")?;
            let v: Value = r.json()?;
            let p = &v["partitions"][0];
            anyhow::ensure!(p["parked"] == 1, "{v}");
            Ok(())
        }
    })
    .await
    .unwrap();
    assert!(now_ms() < at, "the takeover took until the event was due");
    // Offset 1 may come again first (acked after the last checkpoint: at least once).
    let later = loop {
        let got = pull_until(&survivor, "s", 1, DRAIN).await;
        let (parked_one, others): (Vec<_>, Vec<_>) = got.into_iter().partition(|d| d.offset == 0);
        if !parked_one.is_empty() {
            break parked_one;
        }
        ack(&survivor, "s", &ids(&others)).await.unwrap();
    };
    assert!(now_ms() >= at, "handed out before its deliverat");
    assert_eq!(summary(&later), [(0, 0, 1)]);
    assert_eq!(later[0].event["data"], json!({"n": "later"}), "body kept");
    ack(&survivor, "s", &ids(&later)).await.unwrap();
    assert_eq!(parked(&survivor, "s").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_nack_delay_beyond_park_retries_after_ms_then_the_retry_is_parked_and_comes_back_with_its_next_attempt_across_sigkill(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = meshd_test_support::meshd::MeshdProcess::start(
        bin(),
        dir.path(),
        &["--park-retries-after-ms", "1000"],
    )
    .await
    .expect("start meshd");
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(
        &a,
        "s",
        json!({"topic": "t", "ack_timeout_ms": 60000, "max_attempts": 5}),
    )
    .await;
    publish(&a, "t", &event("retried")).await.unwrap();
    publish(&a, "t", &event("next")).await.unwrap();
    let first = pull_until(&a, "s", 2, DRAIN).await;
    assert_eq!(summary(&first), [(0, 0, 1), (0, 1, 1)]);
    // A delay at or beyond --park-retries-after-ms parks the retry: committed passes
    // it once the later offset is acked, instead of waiting for the retry.
    // Taken before the nack: the owner counts the delay from when it handles it.
    let nacked_at = now_ms();
    let r = nack_delayed(&a, "s", &ids(&first[..1]), 4000).await;
    assert_eq!(set(&r["retrying"]), set_of(&ids(&first[..1])), "{r}");
    ack(&a, "s", &ids(&first[1..])).await.unwrap();
    wait_committed(&a, "s", 0, 2).await;
    assert_eq!(parked(&a, "s").await, 1);

    // Across SIGKILL it stays parked, and comes back with the next attempt.
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    assert_eq!(committed(&a, "s", 0).await.unwrap(), 2);
    assert_eq!(parked(&a, "s").await, 1);
    let again = pull_until(&a, "s", 1, DRAIN).await;
    assert!(
        now_ms() >= nacked_at + 4000,
        "the retry came before its delay"
    );
    assert_eq!(summary(&again), [(0, 0, 2)], "the attempt count continues");
    ack(&a, "s", &ids(&again)).await.unwrap();
    assert_eq!(parked(&a, "s").await, 0);
    assert_no_delivery(&a, "s", 1500, "an acked parked retry came again").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_when_the_owner_of_a_parked_retry_is_sigkilled_then_the_new_owner_delivers_it_with_the_next_attempt(
) {
    let mut cluster = SmallCluster::start_with(
        2,
        Duration::from_millis(2000),
        &["--park-retries-after-ms", "1000"],
    )
    .await;
    let a0 = cluster.addr(0);
    create_topic(&a0, "t", 1).await;
    create_subscription(
        &a0,
        "s",
        json!({"topic": "t", "ack_timeout_ms": 60000, "max_attempts": 5}),
    )
    .await;
    cluster.wait_settled("t", 1).await;
    let owner = cluster.designated_owner("t", 0);
    let survivor = cluster.addr(1 - owner);
    publish(&survivor, "t", &event("retried")).await.unwrap();
    let first = pull_until(&survivor, "s", 1, DRAIN).await;
    assert_eq!(summary(&first), [(0, 0, 1)]);
    // Parked in the owner's journal on nats-server, with its attempt.
    // Taken before the nack: the owner counts the delay from when it handles it (CI
    // failed once with the time taken after the answer, a few ms late).
    let nacked_at = now_ms();
    let r = nack_delayed(&survivor, "s", &ids(&first), 8000).await;
    assert_eq!(set(&r["retrying"]), set_of(&ids(&first)), "{r}");
    wait_committed(&survivor, "s", 0, 1).await;

    cluster.nodes[owner].kill();
    let again = pull_until(&survivor, "s", 1, DRAIN).await;
    assert!(
        now_ms() >= nacked_at + 8000,
        "the retry came before its delay"
    );
    assert_eq!(
        summary(&again),
        [(0, 0, 2)],
        "the attempt count moved with it"
    );
    ack(&survivor, "s", &ids(&again)).await.unwrap();
    assert_eq!(parked(&survivor, "s").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_when_the_owner_of_an_unparked_event_handed_out_twice_is_sigkilled_then_the_new_owner_continues_its_attempt_count(
) {
    let mut cluster = SmallCluster::start(2, Duration::from_millis(2000)).await;
    let a0 = cluster.addr(0);
    create_topic(&a0, "t", 1).await;
    create_subscription(&a0, "s", sub_attempts("t", 5)).await;
    cluster.wait_settled("t", 1).await;
    let owner = cluster.designated_owner("t", 0);
    let survivor = cluster.addr(1 - owner);
    let at = now_ms() + 500;
    publish(&survivor, "t", &delayed("later", at))
        .await
        .unwrap();
    // Unparked at its time and handed out twice (a nack between).
    let first = pull_until(&survivor, "s", 1, DRAIN).await;
    assert_eq!(summary(&first), [(0, 0, 1)]);
    nack(&survivor, "s", &ids(&first), "again").await.unwrap();
    let second = pull_until(&survivor, "s", 1, DRAIN).await;
    assert_eq!(summary(&second), [(0, 0, 2)]);

    // The journal entry carries the count: the new owner hands it out as attempt 3,
    // never again as 1 or 2 (at once: the journal keeps no lease, so the consumer of
    // attempt 2 may still hold it; at least once).
    cluster.nodes[owner].kill();
    let again = pull_until(&survivor, "s", 1, DRAIN).await;
    assert_eq!(
        summary(&again),
        [(0, 0, 3)],
        "the attempt count moved with it"
    );
    assert_eq!(again[0].event["id"], "later");
    ack(&survivor, "s", &ids(&again)).await.unwrap();
    assert_eq!(parked(&survivor, "s").await, 0);
}

fn sub_attempts(topic: &str, max_attempts: u32) -> Value {
    json!({"topic": topic, "ack_timeout_ms": 2000, "max_attempts": max_attempts,
           "backoff": {"initial_ms": 100, "max_ms": 100}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_unparked_event_nacked_far_ahead_then_it_is_parked_again_and_frees_its_slot_for_other_due_events(
) {
    let dir = tempfile::tempdir().unwrap();
    // One delivery at a time per partition: a retry waiting in memory would hold it.
    let m = meshd_test_support::meshd::MeshdProcess::start(
        bin(),
        dir.path(),
        &["--park-retries-after-ms", "1000", "--max-in-flight", "1"],
    )
    .await
    .expect("start meshd");
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", sub_attempts("t", 5)).await;
    publish(&a, "t", &delayed("first", now_ms() + 300))
        .await
        .unwrap();
    publish(&a, "t", &delayed("second", now_ms() + 600))
        .await
        .unwrap();
    let first = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&first), ["first"]);
    // Far ahead: parked again (its attempt kept), so "second" is not held behind it.
    let nacked_at = now_ms();
    let r = nack_delayed(&a, "s", &ids(&first), 6000).await;
    assert_eq!(set(&r["retrying"]), set_of(&ids(&first)), "{r}");
    let second = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(event_ids(&second), ["second"]);
    assert!(
        now_ms() < nacked_at + 6000,
        "the second waited for the first's retry"
    );
    ack(&a, "s", &ids(&second)).await.unwrap();
    assert_eq!(parked(&a, "s").await, 1, "the first is parked again");
    let again = pull_until(&a, "s", 1, DRAIN).await;
    assert!(
        now_ms() >= nacked_at + 6000,
        "the retry came before its delay"
    );
    assert_eq!(summary(&again), [(0, 0, 2)], "the count continues");
    ack(&a, "s", &ids(&again)).await.unwrap();
    assert_eq!(parked(&a, "s").await, 0);
}
