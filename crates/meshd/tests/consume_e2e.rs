//! Consuming through the real binary: the "Consuming" and "Dead letters" sections of
//! the HTTP API as stories. Each test spawns `meshd serve` on its own data dir and
//! talks to it only over loopback HTTP.
//!
//! The failures these pin: an ack that moves the committed offset over an event still
//! in flight (lost on a crash), an acked event delivered again after a SIGKILL, attempt
//! counts that restart at 1 after a crash, a stale attempt's ack resolving a newer
//! attempt, a dead letter that differs from what was published, a redrive delivered
//! twice, and a long poll that does not wake on a publish. No test sleeps to wait for
//! state: they long-poll (`wait_ms`) or poll with a deadline that reports what it last
//! saw.

mod common;

use common::*;
use meshd_client::Pull;
use meshd_test_support::http;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const DRAIN: Duration = Duration::from_secs(30);

/// A dead-letter id in the store's format (32 hex digits) that names nothing.
const UNKNOWN_DEAD_LETTER: &str = "0123456789abcdef0123456789abcdef";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_published_events_when_pulled_and_acked_then_they_are_exact_and_the_committed_offset_advances(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t"})).await;
    assert_eq!(
        offsets(a, "s").await.unwrap(),
        vec![json!({"partition": 0, "committed": 0, "epoch": 0})]
    );
    let published: Vec<Value> = (0..3).map(|i| event(&format!("e{i}"))).collect();
    for (i, e) in published.iter().enumerate() {
        assert_eq!(publish(a, "t", e).await.unwrap(), (0, i as u64));
    }

    let ds = pull_until(a, "s", 3, DRAIN).await;
    assert_eq!(summary(&ds), vec![(0, 0, 1), (0, 1, 1), (0, 2, 1)]);
    for (d, e) in ds.iter().zip(&published) {
        assert_eq!(&d.event, e, "delivered exactly as published");
    }
    assert_eq!(
        set_of(&ids(&ds)).len(),
        3,
        "every delivery has its own id: {ds:?}"
    );

    // Ack the lowest alone: committed moves to 1, not past the two still in flight.
    let r = ack(a, "s", std::slice::from_ref(&ds[0].id)).await.unwrap();
    assert_eq!(
        set(&r["acked"]),
        set_of(std::slice::from_ref(&ds[0].id)),
        "{r}"
    );
    for k in ["unknown", "fenced", "failed"] {
        assert_eq!(r[k], json!([]), "{r}");
    }
    wait_committed(a, "s", 0, 1).await;
    let rest = [ds[1].id.clone(), ds[2].id.clone()];
    let r = ack(a, "s", &rest).await.unwrap();
    assert_eq!(set(&r["acked"]), set_of(&rest), "{r}");
    wait_committed(a, "s", 0, 3).await;
    assert_eq!(offsets(a, "s").await.unwrap()[0]["epoch"], 0, "no reset");

    assert_no_delivery(a, "s", 300, "acked events came back").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_events_published_before_a_subscription_when_it_has_no_start_then_it_skips_them_and_earliest_gets_them(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 2).await;
    let before: Vec<Value> = (0..4).map(|i| event(&format!("before{i}"))).collect();
    for e in &before {
        publish(a, "t", e).await.unwrap();
    }
    create_subscription(a, "latest", json!({"topic": "t"})).await;
    create_subscription(a, "earliest", json!({"topic": "t", "start": "earliest"})).await;
    let after = event("after");
    publish(a, "t", &after).await.unwrap();
    let ends = end_offsets(a, "t").await;

    let got = pull_until(a, "latest", 1, DRAIN).await;
    assert_eq!(got.len(), 1, "{:?}", summary(&got));
    assert_eq!(
        got[0].event, after,
        "only the event published after creation"
    );
    assert_eq!(got[0].attempt, 1);
    let r = ack(a, "latest", std::slice::from_ref(&got[0].id))
        .await
        .unwrap();
    assert_eq!(r["acked"].as_array().unwrap().len(), 1, "{r}");
    assert_no_delivery(
        a,
        "latest",
        300,
        "events from before the subscription were delivered",
    )
    .await;
    for (p, end) in ends.iter().enumerate() {
        wait_committed(a, "latest", p as u64, *end).await;
    }

    let got = pull_until(a, "earliest", 5, DRAIN).await;
    let mut want: Vec<Value> = before.clone();
    want.push(after.clone());
    let key = |e: &Value| e["id"].as_str().unwrap().to_string();
    let got_ids: BTreeSet<String> = got.iter().map(|d| key(&d.event)).collect();
    let want_ids: BTreeSet<String> = want.iter().map(key).collect();
    assert_eq!(got_ids, want_ids, "{:?}", summary(&got));
    assert_eq!(got.len(), 5, "each once: {:?}", summary(&got));
    for d in &got {
        assert_eq!(d.attempt, 1);
        assert_eq!(
            Some(&d.event),
            want.iter().find(|e| key(e) == key(&d.event)),
            "exactly as published"
        );
    }
    let r = ack(a, "earliest", &ids(&got)).await.unwrap();
    assert_eq!(r["acked"].as_array().unwrap().len(), 5, "{r}");
    for (p, end) in ends.iter().enumerate() {
        wait_committed(a, "earliest", p as u64, *end).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_acks_above_an_unacked_offset_when_meshd_is_killed_then_only_that_offset_is_redelivered_with_attempt_2(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    // A short lease so the in-flight offset is due again soon after the restart; long
    // enough that the acks below land inside it.
    create_subscription(
        &a,
        "s",
        json!({"topic": "t", "ack_timeout_ms": 2000, "max_attempts": 10,
               "backoff": {"initial_ms": 1, "max_ms": 1}}),
    )
    .await;
    let published: Vec<Value> = (0..8).map(|i| event(&format!("e{i}"))).collect();
    for (i, e) in published.iter().enumerate() {
        assert_eq!(publish(&a, "t", e).await.unwrap(), (0, i as u64));
    }
    let ds = pull_until(&a, "s", 8, DRAIN).await;
    assert_eq!(
        summary(&ds),
        (0..8).map(|o| (0, o, 1)).collect::<Vec<_>>(),
        "every offset once"
    );
    // 7 and 6 first, so they are acked while 5 (and, for a moment, 0..4) are in flight.
    let updates =
        r#"meshd_store_write_seconds_count{store="deliveries",backend="rocksdb",op="update"}"#;
    let before = metric(&a, updates).await.unwrap_or(0.0);
    let high = [ds[7].id.clone(), ds[6].id.clone()];
    let r = ack(&a, "s", &high).await.unwrap();
    assert_eq!(set(&r["acked"]), set_of(&high), "{r}");
    assert_eq!(
        metric(&a, updates).await,
        Some(before + 1.0),
        "the two acks above the gap are recorded in one write, not one each"
    );
    let low: Vec<Value> = ds[..5].iter().map(|d| d.id.clone()).collect();
    let r = ack(&a, "s", &low).await.unwrap();
    assert_eq!(set(&r["acked"]), set_of(&low), "{r}");
    wait_committed(&a, "s", 0, 5).await;

    m.kill();
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    assert_eq!(
        committed(&a, "s", 0).await.unwrap(),
        5,
        "the committed offset survived the SIGKILL"
    );

    // Collect everything handed out after the restart until offset 5 shows up: acked
    // offsets 6 and 7 would be ready at once, before 5's lease runs out.
    let seen: Arc<Mutex<Vec<Delivery>>> = Arc::default();
    wait_until(DRAIN, "offset 5 redelivered after the restart", || {
        let seen = seen.clone();
        let a = a.clone();
        async move {
            let batch = pull(&a, "s", &json!({"max_events": 100, "wait_ms": 1000})).await?;
            let mut seen = seen.lock().unwrap();
            seen.extend(batch);
            anyhow::ensure!(
                seen.iter().any(|d| d.offset == 5),
                "so far {:?}",
                summary(&seen)
            );
            Ok(())
        }
    })
    .await
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        summary(&seen),
        vec![(0, 5, 2)],
        "only the unacked offset comes back, and its attempt count continues"
    );
    assert_eq!(seen[0].event, published[5]);
    let r = ack(&a, "s", std::slice::from_ref(&seen[0].id))
        .await
        .unwrap();
    assert_eq!(
        set(&r["acked"]),
        set_of(std::slice::from_ref(&seen[0].id)),
        "{r}"
    );
    wait_committed(&a, "s", 0, 8).await;
    assert_no_delivery(&a, "s", 300, "redelivered").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_delivery_that_timed_out_and_was_redelivered_when_the_old_attempt_is_acked_then_it_is_unknown_and_changes_nothing(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    // The shortest lease the contract allows, and retries with (almost) no backoff.
    create_subscription(
        a,
        "s",
        json!({"topic": "t", "ack_timeout_ms": 100, "max_attempts": 1000,
               "backoff": {"initial_ms": 1, "max_ms": 1}}),
    )
    .await;
    let e = event("e0");
    publish(a, "t", &e).await.unwrap();
    let first = pull_until(a, "s", 1, DRAIN).await.remove(0);
    assert_eq!((first.offset, first.attempt), (0, 1));

    let redelivered = |after: u64| async move {
        wait_until(
            DRAIN,
            &format!("a redelivery with an attempt above {after}"),
            || async move {
                let ds = pull(a, "s", &json!({"max_events": 10, "wait_ms": 1000})).await?;
                ds.into_iter()
                    .find(|d| d.attempt > after)
                    .ok_or_else(|| anyhow::anyhow!("no attempt above {after} yet"))
            },
        )
        .await
        .unwrap()
    };
    let second = redelivered(1).await;
    assert_eq!(second.offset, 0);
    assert_eq!(second.event, e);
    assert_ne!(second.id, first.id, "each attempt has its own delivery id");

    // The stale attempt, and ids that never named anything.
    let garbage = [
        first.id.clone(),
        json!("garbage"),
        json!(format!("{}x", second.id.as_str().unwrap_or("id"))),
        json!("d\u{1F600}"),
        json!("x".repeat(300)),
    ];
    let r = ack(a, "s", &garbage).await.unwrap();
    assert_eq!(r["acked"], json!([]), "{r}");
    assert_eq!(set(&r["unknown"]), set_of(&garbage), "{r}");
    assert_eq!(r["fenced"], json!([]), "{r}");
    assert_eq!(r["failed"], json!([]), "{r}");
    let r = nack(a, "s", &[json!("garbage")], "nope").await.unwrap();
    assert_eq!(set(&r["unknown"]), set_of(&[json!("garbage")]), "{r}");
    assert_eq!(committed(a, "s", 0).await.unwrap(), 0, "nothing resolved");

    // The stale ack did not resolve the event: it keeps coming back.
    let third = redelivered(second.attempt).await;
    assert_eq!(third.offset, 0);

    // A live attempt's ack does resolve it (retried: a slow machine may let the 100 ms
    // lease run out between a pull and its ack).
    wait_until(DRAIN, "an ack of a live attempt", || async move {
        let ds = pull(a, "s", &json!({"max_events": 10, "wait_ms": 1000})).await?;
        anyhow::ensure!(!ds.is_empty(), "nothing pulled");
        let r = ack(a, "s", &ids(&ds)).await?;
        anyhow::ensure!(r["acked"] != json!([]), "not acked: {r}");
        Ok(())
    })
    .await
    .unwrap();
    wait_committed(a, "s", 0, 1).await;
    assert!(dead_letters(a, "s").await.is_empty());
}

/// Pulls `n` deliveries and nacks them, `max_attempts` (3) times; the last nack must
/// dead-letter all of them. Returns the last attempts.
async fn nack_until_dead(a: &str, sub: &str, n: usize, reason: &str) -> Vec<Delivery> {
    let mut last = Vec::new();
    for attempt in 1..=3u64 {
        let ds = pull_until(a, sub, n, DRAIN).await;
        assert_eq!(ds.len(), n, "{:?}", summary(&ds));
        assert!(
            ds.iter().all(|d| d.attempt == attempt),
            "round {attempt}: {:?}",
            summary(&ds)
        );
        let all = ids(&ds);
        let why = if attempt == 3 {
            reason.to_string()
        } else {
            format!("attempt {attempt} failed")
        };
        let r = nack(a, sub, &all, &why).await.unwrap();
        let (done, rest) = if attempt == 3 {
            ("dead_lettered", "retrying")
        } else {
            ("retrying", "dead_lettered")
        };
        assert_eq!(set(&r[done]), set_of(&all), "round {attempt}: {r}");
        for k in [rest, "dead_lettering", "unknown", "fenced"] {
            assert_eq!(r[k], json!([]), "round {attempt}: {r}");
        }
        last = ds;
    }
    last
}

fn subscription_with_3_attempts(topic: &str) -> Value {
    json!({"topic": topic, "max_attempts": 3, "ack_timeout_ms": 30000,
           "backoff": {"initial_ms": 1, "max_ms": 1}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_max_attempts_3_when_a_delivery_is_nacked_three_times_then_it_is_dead_lettered_exactly_as_published(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", subscription_with_3_attempts("t")).await;
    let e = event("doomed");
    assert_eq!(publish(a, "t", &e).await.unwrap(), (0, 0));

    nack_until_dead(a, "s", 1, "boom: the final reason").await;

    let entries = dead_letters(a, "s").await;
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = &entries[0];
    assert!(
        entry["id"].as_str().is_some_and(|s| !s.is_empty()),
        "{entry}"
    );
    assert_eq!(entry["subscription"], "s", "{entry}");
    assert_eq!(entry["topic"], "t", "{entry}");
    assert_eq!(entry["partition"], 0, "{entry}");
    assert_eq!(entry["offset"], 0, "{entry}");
    assert_eq!(entry["attempts"], 3, "{entry}");
    assert_eq!(entry["reason"], "boom: the final reason", "{entry}");
    assert_eq!(entry["state"], "dead", "{entry}");
    assert_eq!(entry["redrives"], 0, "{entry}");
    assert_eq!(
        entry["event"], e,
        "the dead letter is the event exactly as published"
    );
    for k in ["first_attempt_at", "dead_lettered_at"] {
        assert!(
            entry[k].as_str().is_some_and(|t| t.contains('T')),
            "{k} is an RFC 3339 timestamp: {entry}"
        );
    }
    let id = entry["id"].as_str().unwrap();
    assert_eq!(
        &dead_letter(a, id).await,
        entry,
        "by id: the same entry as in the list"
    );

    wait_committed(a, "s", 0, 1).await;
    assert_no_delivery(a, "s", 300, "dead-lettered but delivered").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_dead_letter_when_redriven_twice_then_it_is_delivered_once_afresh_and_its_ack_removes_the_entry(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", subscription_with_3_attempts("t")).await;
    let published = [event("r0"), event("r1")];
    for e in &published {
        publish(a, "t", e).await.unwrap();
    }
    nack_until_dead(a, "s", 2, "dead").await;
    wait_committed(a, "s", 0, 2).await;
    let entries = dead_letters(a, "s").await;
    assert_eq!(entries.len(), 2, "{entries:?}");
    let id_at = |offset: u64| {
        entries
            .iter()
            .find(|e| e["offset"] == offset)
            .and_then(|e| e["id"].as_str())
            .unwrap_or_else(|| panic!("no entry for offset {offset}: {entries:?}"))
            .to_string()
    };
    let (redriven, deleted) = (id_at(0), id_at(1));

    redrive(a, &redriven).await;
    let entry = dead_letter(a, &redriven).await;
    assert_eq!(entry["state"], "redriving", "{entry}");
    let r = client(a).redrive_answer(&redriven).await;
    answered(r, 202, "redrive").unwrap_or_else(|e| panic!("a repeated redrive is accepted: {e:#}"));

    let got = pull_until(a, "s", 1, DRAIN).await;
    assert_eq!(summary(&got), vec![(0, 0, 1)], "a fresh attempt count");
    assert_eq!(got[0].event, published[0], "exactly as published");
    assert_no_delivery(a, "s", 500, "the second redrive delivered it again").await;
    let entry = dead_letter(a, &redriven).await;
    assert_eq!(entry["state"], "redriving", "{entry}");

    let r = ack(a, "s", std::slice::from_ref(&got[0].id)).await.unwrap();
    assert_eq!(
        set(&r["acked"]),
        set_of(std::slice::from_ref(&got[0].id)),
        "{r}"
    );
    wait_until(
        Duration::from_secs(15),
        "the redriven entry removed after its ack",
        || async {
            let r = http::get(a, &format!("/v1/deadletters/{redriven}")).await?;
            anyhow::ensure!(r.status == 404, "{} {}", r.status, r.body);
            Ok(r)
        },
    )
    .await
    .map(|r| problem(&r, 404))
    .unwrap();
    assert_eq!(
        committed(a, "s", 0).await.unwrap(),
        2,
        "a redrive never moves it"
    );

    // Delete, then it is gone for every route.
    let r = bare(a, "DELETE", &format!("/v1/deadletters/{deleted}")).await;
    assert_eq!(r.status, 204, "{}", r.body);
    problem(
        &http::get(a, &format!("/v1/deadletters/{deleted}"))
            .await
            .unwrap(),
        404,
    );
    problem(
        &bare(a, "DELETE", &format!("/v1/deadletters/{deleted}")).await,
        404,
    );
    problem(
        &bare(a, "POST", &format!("/v1/deadletters/{deleted}/redrive")).await,
        404,
    );
    problem(
        &bare(
            a,
            "POST",
            &format!("/v1/deadletters/{UNKNOWN_DEAD_LETTER}/redrive"),
        )
        .await,
        404,
    );
    assert!(dead_letters(a, "s").await.is_empty());
    assert_no_delivery(a, "s", 300, "delivered although nothing is due").await;
}

/// What the client tasks of the crash test observed before the kill.
#[derive(Default)]
struct Observed {
    /// Every 201'd event: (id, partition, offset).
    published: Vec<(String, u64, u64)>,
    /// (partition, offset) → the highest attempt pulled.
    pulled: BTreeMap<(u64, u64), u64>,
    /// (partition, offset) whose ack answered `acked`.
    acked: BTreeSet<(u64, u64)>,
    /// (partition, offset) of the ack the kill cut off: it may or may not have been
    /// recorded, so these may or may not come back.
    ack_in_doubt: BTreeSet<(u64, u64)>,
    /// partition → the highest committed offset read.
    committed: BTreeMap<u64, u64>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_stream_of_publishes_and_acks_when_meshd_is_killed_then_nothing_acknowledged_is_lost_and_committed_never_goes_back(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 2).await;
    create_subscription(
        &a,
        "s",
        json!({"topic": "t", "ack_timeout_ms": 2000, "max_attempts": 1000,
               "backoff": {"initial_ms": 1, "max_ms": 1}}),
    )
    .await;
    let seen: Arc<Mutex<Observed>> = Arc::default();

    let publisher = {
        let (a, seen) = (a.clone(), seen.clone());
        tokio::spawn(async move {
            for i in 0..100_000u32 {
                let id = format!("e{i}");
                match publish(&a, "t", &event(&id)).await {
                    Ok((p, o)) => seen.lock().unwrap().published.push((id, p, o)),
                    Err(_) => break, // the process is gone
                }
            }
        })
    };
    let consumer = {
        let (a, seen) = (a.clone(), seen.clone());
        tokio::spawn(async move {
            loop {
                let Ok(ds) = pull(&a, "s", &json!({"max_events": 10, "wait_ms": 200})).await else {
                    break;
                };
                let mut to_ack = Vec::new();
                {
                    let mut seen = seen.lock().unwrap();
                    for d in &ds {
                        let top = seen.pulled.entry((d.partition, d.offset)).or_default();
                        *top = (*top).max(d.attempt);
                        // Leave some later first attempts unacked, so that deliveries
                        // are in flight at the kill after the committed offset has
                        // moved.
                        if d.offset < 12 || d.offset % 4 != 3 || d.attempt > 1 {
                            to_ack.push(d.clone());
                        }
                    }
                }
                if !to_ack.is_empty() {
                    let Ok(r) = ack(&a, "s", &ids(&to_ack)).await else {
                        let mut seen = seen.lock().unwrap();
                        seen.ack_in_doubt =
                            to_ack.iter().map(|d| (d.partition, d.offset)).collect();
                        break;
                    };
                    let acked = set(&r["acked"]);
                    let mut seen = seen.lock().unwrap();
                    for d in to_ack.iter().filter(|d| acked.contains(&d.id.to_string())) {
                        seen.acked.insert((d.partition, d.offset));
                    }
                }
                let Ok(all) = offsets(&a, "s").await else {
                    break;
                };
                let mut seen = seen.lock().unwrap();
                for o in all {
                    if let (Some(p), Some(c)) = (o["partition"].as_u64(), o["committed"].as_u64()) {
                        let top = seen.committed.entry(p).or_default();
                        *top = (*top).max(c);
                    }
                }
            }
        })
    };

    wait_until(
        DRAIN,
        "the stream under way (60 events published, 30 acked, a committed offset of 10 \
         seen, one left in flight)",
        || {
            let seen = seen.clone();
            async move {
                let s = seen.lock().unwrap();
                let in_flight = s.pulled.keys().any(|k| !s.acked.contains(k));
                let committed = s.committed.values().copied().max().unwrap_or(0);
                anyhow::ensure!(
                    s.published.len() >= 60 && s.acked.len() >= 30 && committed >= 10 && in_flight,
                    "published {}, acked {}, pulled {}, committed {:?}",
                    s.published.len(),
                    s.acked.len(),
                    s.pulled.len(),
                    s.committed
                );
                Ok(())
            }
        },
    )
    .await
    .unwrap();
    m.kill();
    publisher.await.unwrap();
    consumer.await.unwrap();
    let before = std::mem::take(&mut *seen.lock().unwrap());
    eprintln!(
        "before the kill: {} published, {} pulled, {} acked, {} acks cut off, committed {:?}",
        before.published.len(),
        before.pulled.len(),
        before.acked.len(),
        before.ack_in_doubt.len(),
        before.committed
    );

    m.restart().await.unwrap();
    let a = m.addr().to_string();

    // Committed offsets never go back.
    for (p, c) in &before.committed {
        let now = committed(&a, "s", *p).await.unwrap();
        assert!(
            now >= *c,
            "partition {p}: committed {now} after the restart, {c} seen before the kill"
        );
    }
    // Every 201'd event is in the log.
    for p in 0..2u64 {
        let events = browse_all(&a, "t", p).await;
        for (id, _, offset) in before.published.iter().filter(|(_, q, _)| *q == p) {
            let got = events.iter().find(|(o, _)| o == offset);
            assert_eq!(
                got.map(|(_, e)| e.clone()),
                Some(event(id)),
                "201'd event {id} at {p}/{offset}"
            );
        }
    }

    // Drain: every 201'd event not confirmed acked is delivered again; nothing
    // confirmed acked is. (Events whose 201 or whose ack answer the kill cut off may
    // go either way.)
    let owed: BTreeSet<(u64, u64)> = before
        .published
        .iter()
        .map(|(_, p, o)| (*p, *o))
        .filter(|k| !before.acked.contains(k) && !before.ack_in_doubt.contains(k))
        .collect();
    let after: Arc<Mutex<BTreeMap<(u64, u64), Delivery>>> = Arc::default();
    let resolved: Arc<Mutex<BTreeSet<(u64, u64)>>> = Arc::default();
    let drained = wait_until(
        Duration::from_secs(60),
        "every unacked 201'd event delivered and acked after the restart",
        || {
            let (a, after, resolved, owed) =
                (a.clone(), after.clone(), resolved.clone(), owed.clone());
            async move {
                let ds = pull(&a, "s", &json!({"max_events": 100, "wait_ms": 1000})).await?;
                {
                    let mut after = after.lock().unwrap();
                    for d in &ds {
                        after.entry((d.partition, d.offset)).or_insert(d.clone());
                    }
                }
                if !ds.is_empty() {
                    let r = ack(&a, "s", &ids(&ds)).await?;
                    let acked = set(&r["acked"]);
                    let mut resolved = resolved.lock().unwrap();
                    for d in ds.iter().filter(|d| acked.contains(&d.id.to_string())) {
                        resolved.insert((d.partition, d.offset));
                    }
                }
                let resolved = resolved.lock().unwrap();
                let missing: Vec<_> = owed.difference(&resolved).take(20).collect();
                anyhow::ensure!(
                    missing.is_empty(),
                    "not yet delivered and acked: {missing:?}"
                );
                Ok(())
            }
        },
    )
    .await;
    if let Err(e) = drained {
        // The last attempt may have been cut off by the deadline: say what was missing.
        let resolved = resolved.lock().unwrap().clone();
        let missing: Vec<_> = owed
            .difference(&resolved)
            .map(|k| (*k, before.pulled.get(k).copied()))
            .collect();
        let after: Vec<_> = after
            .lock()
            .unwrap()
            .values()
            .map(|d| (d.partition, d.offset, d.attempt))
            .collect();
        let offsets = offsets(&a, "s").await;
        let metrics = client(&a).metrics().await.map(|r| {
            r.lines()
                .filter(|l| {
                    !l.starts_with('#')
                        && [
                            "in_flight",
                            "waiting",
                            "backlog",
                            "dead_letter",
                            "deliveries",
                        ]
                        .iter()
                        .any(|w| l.contains(w))
                })
                .collect::<Vec<_>>()
                .join("\n")
        });
        panic!(
            "{e:#}\nmissing ((partition, offset), attempt pulled before the kill): \
             {missing:?}\ndelivered after the restart (partition, offset, attempt): \
             {after:?}\nconfirmed acked before the kill: {:?}\noffsets now: {offsets:?}\n\
             metrics:\n{}",
            before.acked,
            metrics.unwrap_or_else(|e| format!("{e:#}"))
        );
    }
    let after = after.lock().unwrap().clone();
    eprintln!(
        "after the restart: {} owed, {} delivered, of which {} pulled before the kill",
        owed.len(),
        after.len(),
        before
            .pulled
            .keys()
            .filter(|k| after.contains_key(k))
            .count()
    );
    let redelivered_acked: Vec<_> = after.keys().filter(|k| before.acked.contains(k)).collect();
    assert!(
        redelivered_acked.is_empty(),
        "acked before the kill, delivered again after it: {redelivered_acked:?}"
    );
    for (id, p, o) in &before.published {
        if let Some(d) = after.get(&(*p, *o)) {
            assert_eq!(d.event, event(id), "{p}/{o}");
        }
    }
    for (k, attempt_before) in before.pulled.iter().filter(|(k, _)| owed.contains(k)) {
        let d = &after[k];
        assert!(
            d.attempt > *attempt_before,
            "{k:?}: pulled with attempt {attempt_before} before the kill, attempt {} after",
            d.attempt
        );
    }
    let ends = end_offsets(&a, "t").await;
    for (p, end) in ends.iter().enumerate() {
        wait_committed(&a, "s", p as u64, *end).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_empty_subscription_when_a_long_poll_waits_then_a_publish_wakes_it_and_a_short_poll_returns_empty(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", json!({"topic": "t"})).await;

    let short = Pull {
        max_events: Some(10),
        wait_ms: Some(200),
        ..Pull::default()
    };
    let r = answered(client(&a).pull_answer("s", &short).await, 200, "pull").unwrap();
    assert_eq!(r.json::<Value>().unwrap(), json!({"deliveries": []}));

    // The pull is sent before the publish; whichever the server sees first, the pull
    // must answer with the event (well before its 5 s wait, but that is not asserted).
    let waiter = {
        let a = a.clone();
        tokio::spawn(
            async move { pull(&a, "s", &json!({"max_events": 10, "wait_ms": 5000})).await },
        )
    };
    tokio::task::yield_now().await;
    let e = event("wake-up");
    let publisher = {
        let (a, e) = (a.clone(), e.clone());
        tokio::spawn(async move { publish(&a, "t", &e).await })
    };
    publisher.await.unwrap().unwrap();
    let got = waiter.await.unwrap().unwrap();
    assert_eq!(summary(&got), vec![(0, 0, 1)]);
    assert_eq!(got[0].event, e);
}

/// Many long polls wait on one partition and one batch makes six events ready: the
/// first waiters to look claim them (each asks for ten), but `max_bytes` 1 holds an
/// answer to one delivery, so what a claim did not take must reach the waiters still
/// waiting. A claim that kept ready events from them would leave some waiter to
/// answer empty when its wait ran out, and events undelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_six_long_polls_waiting_when_one_batch_makes_six_events_ready_then_each_waiter_gets_one(
) {
    const WAITERS: usize = 6;
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", json!({"topic": "t"})).await;
    let waiters: Vec<_> = (0..WAITERS)
        .map(|_| {
            let a = a.clone();
            tokio::spawn(async move {
                pull(
                    &a,
                    "s",
                    &json!({"max_events": 10, "max_bytes": 1, "wait_ms": 20000}),
                )
                .await
            })
        })
        .collect();
    // Every waiter is in meshd (counted in flight) before the batch is published.
    wait_until(DRAIN, "six pulls in flight", || async {
        let n = metric(&a, "meshd_http_requests_in_flight").await;
        anyhow::ensure!(n == Some(WAITERS as f64), "in flight: {n:?}");
        Ok(())
    })
    .await
    .unwrap();
    let batch: Vec<Value> = (0..WAITERS).map(|i| event(&format!("b{i}"))).collect();
    publish_batch(&a, "t", &batch).await.unwrap();
    let mut got = BTreeSet::new();
    for w in waiters {
        let ds = w.await.unwrap().unwrap();
        assert_eq!(ds.len(), 1, "each waiter gets one: {:?}", summary(&ds));
        got.insert(ds[0].offset);
    }
    assert_eq!(got, (0..WAITERS as u64).collect::<BTreeSet<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_leased_delivery_when_extended_then_it_outlives_its_ack_timeout_and_unknown_ids_are_reported(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(
        a,
        "s",
        json!({"topic": "t", "ack_timeout_ms": 1000, "max_attempts": 10,
               "backoff": {"initial_ms": 1, "max_ms": 1}}),
    )
    .await;
    publish(a, "t", &event("e0")).await.unwrap();
    let d = pull_until(a, "s", 1, DRAIN).await.remove(0);
    let r = extend(a, "s", &[d.id.clone(), json!("garbage")], 60_000)
        .await
        .unwrap();
    assert_eq!(
        set(&r["extended"]),
        set_of(std::slice::from_ref(&d.id)),
        "{r}"
    );
    assert_eq!(set(&r["unknown"]), set_of(&[json!("garbage")]), "{r}");

    // The original 1 s lease runs out during this poll; the extended one does not.
    assert_no_delivery(a, "s", 3000, "redelivered despite the extension").await;
    let r = ack(a, "s", std::slice::from_ref(&d.id)).await.unwrap();
    assert_eq!(
        set(&r["acked"]),
        set_of(std::slice::from_ref(&d.id)),
        "still the live attempt: {r}"
    );
    let r = extend(a, "s", std::slice::from_ref(&d.id), 60_000)
        .await
        .unwrap();
    assert_eq!(
        r["extended"],
        json!([]),
        "an acked delivery has no lease: {r}"
    );
    assert_eq!(
        set(&r["unknown"]),
        set_of(std::slice::from_ref(&d.id)),
        "{r}"
    );
    wait_committed(a, "s", 0, 1).await;
}

/// One sample of `/metrics`, `None` when absent.
async fn metric(a: &str, sample: &str) -> Option<f64> {
    http::metric(a, sample).await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_type_filter_when_other_types_are_published_then_only_matches_are_delivered_and_the_rest_resolve(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t", "filter": {"type": "keep"}})).await;
    for i in 0..6 {
        let mut e = event(&format!("e{i}"));
        e["type"] = json!(if i % 2 == 0 { "keep" } else { "drop" });
        publish(a, "t", &e).await.unwrap();
    }
    let got = pull_until(a, "s", 3, DRAIN).await;
    let offsets: Vec<u64> = got.iter().map(|d| d.offset).collect();
    assert_eq!(offsets, vec![0, 2, 4], "only the matching events: {got:?}");
    assert!(got.iter().all(|d| d.event["type"] == "keep"), "{got:?}");
    let r = ack(a, "s", &ids(&got)).await.unwrap();
    assert_eq!(set(&r["acked"]).len(), 3, "{r}");
    // The non-matching events are resolved without delivery, so the committed offset
    // passes them: all six are resolved.
    wait_committed(a, "s", 0, 6).await;
    assert_no_delivery(a, "s", 300, "nothing else is delivered").await;
    let sample = |n: &str| format!("{n}{{subscription=\"s\"}}");
    assert_eq!(
        metric(a, &sample("meshd_deliveries_total")).await,
        Some(3.0)
    );
    assert_eq!(metric(a, &sample("meshd_acks_total")).await, Some(3.0));
    assert_eq!(
        metric(a, &sample("meshd_backlog_events")).await,
        Some(0.0),
        "everything is resolved"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_leases_that_run_out_when_max_attempts_is_1_then_each_is_dead_lettered_as_ack_timeout_and_listed_page_by_page(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(
        a,
        "s",
        json!({"topic": "t", "max_attempts": 1, "ack_timeout_ms": 100}),
    )
    .await;
    for i in 0..3 {
        publish(a, "t", &event(&format!("e{i}"))).await.unwrap();
    }
    let got = pull_until(a, "s", 3, DRAIN).await;
    assert_eq!(got.len(), 3, "{got:?}");
    // Nobody acks: each lease runs out, and with max_attempts 1 that first failure
    // dead-letters the event without any further pull.
    let entries = wait_until(DRAIN, "3 dead letters", || async {
        let e = dead_letters(a, "s").await;
        anyhow::ensure!(e.len() == 3, "{} so far: {e:?}", e.len());
        Ok(e)
    })
    .await
    .unwrap();
    for e in &entries {
        assert_eq!(e["reason"], "ack timeout", "{e}");
        assert_eq!(e["attempts"], 1, "{e}");
    }
    wait_committed(a, "s", 0, 3).await;
    // Two pages: limit 2, then the cursor.
    let meshd = client(a);
    let first = meshd.dead_letters(Some("s"), Some(2), None).await.unwrap();
    assert_eq!(
        first["entries"].as_array().map(Vec::len),
        Some(2),
        "{first}"
    );
    let cursor = first["next_cursor"]
        .as_str()
        .expect("a next_cursor")
        .to_string();
    let second = meshd
        .dead_letters(Some("s"), Some(2), Some(&cursor))
        .await
        .unwrap();
    assert_eq!(
        second["entries"].as_array().map(Vec::len),
        Some(1),
        "{second}"
    );
    assert!(second.get("next_cursor").is_none(), "last page: {second}");
    let mut seen: BTreeSet<u64> = BTreeSet::new();
    for e in first["entries"]
        .as_array()
        .into_iter()
        .chain(second["entries"].as_array())
        .flatten()
    {
        seen.extend(e["offset"].as_u64());
    }
    assert_eq!(seen.len(), 3, "every entry once across the pages: {seen:?}");
    assert_eq!(
        metric(a, "meshd_dead_letters_total{subscription=\"s\"}").await,
        Some(3.0)
    );
    // The other subscription filter lists nothing.
    let none = meshd.dead_letters(Some("other"), None, None).await.unwrap();
    assert_eq!(none["entries"], json!([]), "{none}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_ack_above_a_gap_when_meshd_gets_sigterm_at_once_then_it_exits_cleanly_and_the_ack_is_not_redelivered(
) {
    let dir = tempfile::tempdir().unwrap();
    // A long flush interval, so the ack is not fsynced by the flusher before the
    // SIGTERM (it reaches the RocksDB WAL at once; the shutdown flush fsyncs it).
    let mut m = meshd_test_support::meshd::MeshdProcess::start(
        bin(),
        dir.path(),
        &["--delivery-flush-ms", "1000"],
    )
    .await
    .unwrap();
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", json!({"topic": "t", "ack_timeout_ms": 500})).await;
    for i in 0..2 {
        publish(&a, "t", &event(&format!("e{i}"))).await.unwrap();
    }
    let got = pull_until(&a, "s", 2, DRAIN).await;
    let second: Vec<Delivery> = got.iter().filter(|d| d.offset == 1).cloned().collect();
    // Offset 1 acked while 0 is in flight: recorded as an update (buffered), not a
    // resolve, so the committed offset stays at 0.
    let r = ack(&a, "s", &ids(&second)).await.unwrap();
    assert_eq!(set(&r["acked"]).len(), 1, "{r}");
    let code = m.terminate(Duration::from_secs(30)).await.unwrap();
    assert_eq!(code, Some(0), "a graceful shutdown exits 0");
    // Every background task ended and the Local engine closed before the exit.
    let log = m.log_tail(200);
    assert!(log.contains("stores closed"), "{log}");

    m.start_again().await.unwrap();
    let a = m.addr().to_string();
    // Offset 0 comes back once its lease (500 ms) has run out; offset 1 never does.
    let again = pull_until(&a, "s", 1, DRAIN).await;
    assert_eq!(summary(&again), vec![(0, 0, 2)], "{again:?}");
    ack(&a, "s", &ids(&again)).await.unwrap();
    wait_committed(&a, "s", 0, 2).await;
    assert_no_delivery(&a, "s", 1000, "the acked offset 1 is not redelivered").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_consumer_that_keeps_up_then_the_tail_cache_serves_it_and_after_a_restart_the_disk_serves_the_same_events(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", json!({"topic": "t"})).await;
    let published: Vec<Value> = (0..5).map(|i| event(&format!("c{i}"))).collect();
    for e in &published {
        publish(&a, "t", e).await.unwrap();
    }
    let ds = pull_until(&a, "s", 5, DRAIN).await;
    for (d, e) in ds.iter().zip(&published) {
        assert_eq!(&d.event, e);
    }
    let hit = r#"meshd_log_tail_cache_reads_total{backend="rocksdb",result="hit"}"#;
    let miss = r#"meshd_log_tail_cache_reads_total{backend="rocksdb",result="miss"}"#;
    assert!(
        metric(&a, hit).await.unwrap_or(0.0) > 0.0,
        "served from memory"
    );
    assert_eq!(metric(&a, miss).await, Some(0.0));
    assert!(
        metric(&a, r#"meshd_log_tail_cache_events{backend="rocksdb"}"#)
            .await
            .unwrap_or(0.0)
            >= 5.0
    );

    // A restart starts with an empty cache: a new subscription from the start reads
    // the same bytes from RocksDB.
    m.kill();
    m.start_again().await.unwrap();
    let a = m.addr().to_string();
    create_subscription(&a, "s2", json!({"topic": "t", "start": "earliest"})).await;
    let again = pull_until(&a, "s2", 5, DRAIN).await;
    for (d, e) in again.iter().zip(&published) {
        assert_eq!(&d.event, e, "read back from disk exactly as published");
    }
    assert!(
        metric(&a, miss).await.unwrap_or(0.0) > 0.0,
        "served from disk"
    );
}
