//! Subscription filters (HTTP API, Additions, "Filters") through the real binary, in
//! embedded and in cluster mode.
//!
//! The failures these pin: a malformed expression stored (and then taking every event
//! or none), a filter that compares anything but the attribute's string form (an
//! integer extension, an absent attribute), a filtered-out event that holds back the
//! committed offset or is handed out after a SIGKILL or a takeover, and a filter the
//! other instances of a cluster do not apply.

mod common;

use common::*;
use meshd_test_support::http::{metric, send_json};
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const DRAIN: Duration = Duration::from_secs(30);

/// Every dialect, over a context attribute, a string extension, an integer extension
/// and an optional attribute (an explicit `all` inside the list's implicit one).
fn filters() -> Value {
    json!([
        {"all": [
            {"prefix": {"type": "com.shop."}},
            {"any": [{"exact": {"region": "eu"}}, {"exact": {"priority": "7"}}]}
        ]},
        {"not": {"suffix": {"subject": ".test"}}}
    ])
}

/// An event with these attributes (`None`: left out) and whether [`filters`] takes it:
/// the expectation is written down per event, not computed by a second evaluator.
fn shop_event(
    id: &str,
    event_type: &str,
    region: Option<&str>,
    priority: Option<i64>,
    subject: Option<&str>,
) -> Value {
    let mut e = json!({
        "specversion": "1.0",
        "id": id,
        "source": "/filters-e2e",
        "type": event_type,
        "data": {"id": id}
    });
    if let Some(r) = region {
        e["region"] = json!(r);
    }
    if let Some(p) = priority {
        e["priority"] = json!(p);
    }
    if let Some(s) = subject {
        e["subject"] = json!(s);
    }
    e
}

/// (event, taken by [`filters`]).
fn events(prefix: &str) -> Vec<(Value, bool)> {
    let id = |n: u32| format!("{prefix}{n}");
    vec![
        (
            shop_event(&id(0), "com.shop.order", Some("eu"), None, None),
            true,
        ),
        (
            shop_event(&id(1), "com.bank.order", Some("eu"), None, None),
            false,
        ),
        (
            shop_event(&id(2), "com.shop.order", Some("us"), None, None),
            false,
        ),
        (
            shop_event(&id(3), "com.shop.order", Some("us"), Some(7), None),
            true,
        ),
        (
            shop_event(&id(4), "com.shop.order", Some("us"), Some(70), None),
            false,
        ),
        (
            shop_event(&id(5), "com.shop.order", Some("eu"), None, Some("a.test")),
            false,
        ),
        (
            shop_event(&id(6), "com.shop.refund", Some("eu"), None, Some("a.prod")),
            true,
        ),
        (
            shop_event(&id(7), "com.shop.order", None, None, None),
            false,
        ),
        (
            shop_event(&id(8), "com.shop.order", None, Some(7), None),
            true,
        ),
        (
            shop_event(&id(9), "Com.shop.order", Some("eu"), None, None),
            false,
        ),
        (
            shop_event(&id(10), "com.shop.", Some("EU"), Some(7), None),
            true,
        ),
        (
            shop_event(&id(11), "com.shop.order", Some("eu "), None, None),
            false,
        ),
    ]
}

fn ids_taken(evs: &[(Value, bool)]) -> BTreeSet<String> {
    evs.iter()
        .filter(|(_, take)| *take)
        .map(|(e, _)| e["id"].as_str().unwrap().to_string())
        .collect()
}

fn event_ids(ds: &[Delivery]) -> BTreeSet<String> {
    ds.iter()
        .map(|d| d.event["id"].as_str().unwrap_or("?").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_malformed_filters_then_the_put_is_a_400_naming_the_expression_and_nothing_is_stored()
{
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    let cases = [
        (
            json!([{"exact": {"type": "a"}}, {"any": [{"regex": {"type": "."}}]}]),
            "filters[1].any[0]",
        ),
        (json!([{"exact": {}}]), "filters[0]"),
        (json!([{"exact": {"type": 5}}]), "filters[0]"),
        (
            json!([{"prefix": {"type": "a"}, "suffix": {"type": "b"}}]),
            "filters[0]",
        ),
        (json!([{"not": {"all": []}}]), "filters[0].not"),
        (json!({"exact": {"type": "a"}}), "filters"),
    ];
    for (filters, path) in cases {
        refused_naming(a, filters, path).await;
    }
    let r = bare(a, "GET", "/v1/subscriptions/s").await;
    assert_eq!(r.status, 404, "nothing was stored: {}", r.body);
}

/// PUTs subscription `s` with `filters`; asserts the 400 names `path` as its field and
/// in its detail, and returns the problem.
async fn refused_naming(a: &str, filters: Value, path: &str) -> Value {
    let r = send_json(
        a,
        "PUT",
        "/v1/subscriptions/s",
        &json!({"topic": "t", "filters": filters}),
    )
    .await
    .unwrap();
    let p = problem_naming(&r, path);
    assert!(
        p["detail"].as_str().unwrap_or("").contains(path),
        "the detail names {path}: {p}"
    );
    p
}

/// `{"x0": "v", "x1": "v", ...}`: `n` attribute pairs.
fn pairs(n: usize) -> serde_json::Map<String, Value> {
    (0..n).map(|i| (format!("x{i}"), json!("v"))).collect()
}

/// A `filters` list whose compact JSON (as meshd stores it) is exactly `len` bytes:
/// 17 one-pair expressions, each value at most 1024 bytes.
fn filters_of_bytes(len: usize) -> Value {
    const N: usize = 17;
    let empty = Value::Array(vec![json!({"exact": {"a": ""}}); N])
        .to_string()
        .len();
    let mut left = len - empty;
    let list: Vec<Value> = (0..N)
        .map(|i| {
            let take = left.div_ceil(N - i);
            left -= take;
            json!({"exact": {"a": "x".repeat(take)}})
        })
        .collect();
    let v = Value::Array(list);
    assert_eq!(v.to_string().len(), len);
    v
}

/// The cost bound (http-api.md, "Security rules (third round)"): one `exact` held any
/// number of pairs, and 20 000 of them took 1.6 s to filter one event, every event.
/// Now an expression holds at most 64 pairs, nested ones counted, and the filters at
/// most 16 KiB; 64 pairs still filter exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_filters_past_64_pairs_or_16_kib_then_the_put_is_a_400_naming_the_path_and_64_pairs_filter_exactly(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    let mut nested_left = pairs(40);
    nested_left.insert("type".into(), json!("t.cost"));
    let refused = [
        (json!([{"exact": pairs(65)}]), "filters[0]"),
        (
            json!([{"prefix": {"type": "t."}}, {"any": [{"exact": nested_left}, {"not": {"exact": pairs(24)}}]}]),
            "filters[1].any[1].not",
        ),
        (filters_of_bytes(16 * 1024 + 1), "filters"),
    ];
    for (filters, path) in refused {
        let p = refused_naming(a, filters, path).await;
        let detail = p["detail"].as_str().unwrap_or("");
        assert!(
            detail.contains("64 attribute pairs") || detail.contains("16384"),
            "the detail gives the bound: {p}"
        );
    }
    // The shorthand `filter` counts toward the 16 KiB: `{"type":"t"}` is 12 bytes.
    let r = send_json(
        a,
        "PUT",
        "/v1/subscriptions/s",
        &json!({"topic": "t", "filter": {"type": "t"}, "filters": filters_of_bytes(16 * 1024 - 11)}),
    )
    .await
    .unwrap();
    problem_naming(&r, "filters");
    let r = bare(a, "GET", "/v1/subscriptions/s").await;
    assert_eq!(r.status, 404, "nothing was stored: {}", r.body);
    // Exactly at the bounds: taken.
    create_subscription(
        a,
        "sized",
        json!({"topic": "t", "filter": {"type": "t"}, "filters": filters_of_bytes(16 * 1024 - 12)}),
    )
    .await;

    // 64 pairs: type, source and 62 extensions, all of which must match.
    let mut want = pairs(62);
    want.insert("type".into(), json!("t.cost"));
    want.insert("source".into(), json!("/cost"));
    let created = create_subscription(
        a,
        "s",
        json!({"topic": "t", "filters": [{"exact": want.clone()}]}),
    )
    .await;
    assert_eq!(created["filters"], json!([{"exact": want}]), "{created}");
    let event = |id: &str, edit: &dyn Fn(&mut Value)| {
        let mut e = json!({"specversion": "1.0", "id": id, "source": "/cost", "type": "t.cost"});
        for i in 0..62 {
            e[format!("x{i}")] = json!("v");
        }
        edit(&mut e);
        e
    };
    let published = [
        (event("all", &|_| {}), true),
        (event("one-differs", &|e| e["x61"] = json!("w")), false),
        (
            event("one-missing", &|e| {
                e.as_object_mut().unwrap().remove("x0");
            }),
            false,
        ),
        (
            event("other-type", &|e| e["type"] = json!("t.other")),
            false,
        ),
        (event("all-again", &|e| e["extra"] = json!(7)), true),
    ];
    for (e, _) in &published {
        publish(a, "t", e).await.unwrap();
    }
    let taken: BTreeSet<String> = published
        .iter()
        .filter(|(_, take)| *take)
        .map(|(e, _)| e["id"].as_str().unwrap().to_string())
        .collect();
    let got = pull_until(a, "s", taken.len(), DRAIN).await;
    assert_eq!(event_ids(&got), taken, "{:?}", summary(&got));
    ack(a, "s", &ids(&got)).await.unwrap();
    wait_committed(a, "s", 0, published.len() as u64).await;
    assert_no_delivery(a, "s", 300, "an event that does not match was delivered").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_filters_when_meshd_is_sigkilled_mid_delivery_then_only_matches_are_ever_delivered_and_committed_passes_the_rest(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    let created = create_subscription(
        &a,
        "s",
        json!({"topic": "t", "filters": filters(), "ack_timeout_ms": 3000}),
    )
    .await;
    assert_eq!(created["filters"], filters(), "{created}");
    let got = client(&a).subscription("s").await.unwrap();
    assert_eq!(got["filters"], filters(), "GET shows the filters: {got}");

    let evs = events("a");
    for (e, _) in &evs {
        publish(&a, "t", e).await.unwrap();
    }
    let want = ids_taken(&evs);
    let first = pull_until(&a, "s", want.len(), DRAIN).await;
    assert_eq!(event_ids(&first), want, "{:?}", summary(&first));
    assert!(
        first.iter().all(|d| d.attempt == 1),
        "{:?}",
        summary(&first)
    );
    // All but the last match are acked; the last one is in flight at the SIGKILL.
    let (acked, open) = first.split_at(first.len() - 1);
    let r = ack(&a, "s", &ids(acked)).await.unwrap();
    assert_eq!(set(&r["acked"]).len(), acked.len(), "{r}");
    wait_committed(&a, "s", 0, open[0].offset).await;

    m.kill();
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    let got = client(&a).subscription("s").await.unwrap();
    assert_eq!(got["filters"], filters(), "the filters survived: {got}");
    // Events published after the restart are filtered by the recovered subscription.
    let later = events("b");
    for (e, _) in &later {
        publish(&a, "t", e).await.unwrap();
    }
    let mut want_after = ids_taken(&later);
    want_after.insert(open[0].event["id"].as_str().unwrap().to_string());
    let second = pull_until(&a, "s", want_after.len(), DRAIN).await;
    assert_eq!(event_ids(&second), want_after, "{:?}", summary(&second));
    let again = second.iter().find(|d| d.offset == open[0].offset).unwrap();
    assert_eq!(again.attempt, 2, "the open delivery came back as attempt 2");
    assert!(
        second
            .iter()
            .all(|d| d.offset == open[0].offset || d.attempt == 1),
        "{:?}",
        summary(&second)
    );
    ack(&a, "s", &ids(&second)).await.unwrap();
    // Every filtered-out event counts as resolved: committed reaches the end.
    let end = (evs.len() + later.len()) as u64;
    wait_committed(&a, "s", 0, end).await;
    assert_no_delivery(&a, "s", 300, "a filtered-out event was delivered").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_three_filtered_subscriptions_of_one_topic_then_each_event_is_parsed_once_for_all_of_them(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    let eu = json!([{"exact": {"region": "eu"}}]);
    create_subscription(
        &a,
        "all-dialects",
        json!({"topic": "t", "filters": filters()}),
    )
    .await;
    create_subscription(&a, "eu", json!({"topic": "t", "filters": eu})).await;
    create_subscription(
        &a,
        "shorthand",
        json!({"topic": "t", "filter": {"type": "com.shop.order"}}),
    )
    .await;
    create_subscription(&a, "unfiltered", json!({"topic": "t"})).await;
    let evs = events("p");
    for (e, _) in &evs {
        publish(&a, "t", e).await.unwrap();
    }
    let taken = |pick: &dyn Fn(&Value) -> bool| -> BTreeSet<String> {
        evs.iter()
            .filter(|(e, _)| pick(e))
            .map(|(e, _)| e["id"].as_str().unwrap().to_string())
            .collect()
    };
    let expected = [
        ("all-dialects", ids_taken(&evs)),
        ("eu", taken(&|e| e["region"] == "eu")),
        ("shorthand", taken(&|e| e["type"] == "com.shop.order")),
        ("unfiltered", taken(&|_| true)),
    ];
    for (sub, want) in &expected {
        assert!(!want.is_empty() && want.len() < evs.len() || *sub == "unfiltered");
        let got = pull_until(&a, sub, want.len(), DRAIN).await;
        assert_eq!(&event_ids(&got), want, "{sub}: {:?}", summary(&got));
        ack(&a, sub, &ids(&got)).await.unwrap();
        wait_committed(&a, sub, 0, evs.len() as u64).await;
    }
    // Three filtered subscriptions read every event; it was parsed once, the others
    // were served the same attributes; the unfiltered one never asked.
    let sample =
        |result: &str| format!("meshd_filter_attribute_reads_total{{result=\"{result}\"}}");
    let parsed = metric(&a, &sample("parsed")).await.unwrap();
    let hits = metric(&a, &sample("hit")).await.unwrap();
    assert_eq!(parsed, evs.len() as f64, "each event parsed once");
    assert_eq!(
        hits,
        2.0 * evs.len() as f64,
        "the two other filtered subscriptions were served the cached attributes, and the \
         unfiltered one (no new options) paid nothing: it never asked"
    );
    let held = metric(&a, "meshd_filter_attribute_cache_events")
        .await
        .unwrap();
    assert_eq!(held, evs.len() as f64);
    assert!(
        metric(&a, "meshd_filter_attribute_cache_bytes")
            .await
            .unwrap()
            > 0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_when_an_owner_is_sigkilled_then_the_survivor_applies_the_same_filters() {
    let mut cluster = SmallCluster::start(2, Duration::from_millis(2000)).await;
    let nodes = &mut cluster.nodes;
    let a0 = nodes[0].addr().to_string();
    let a1 = nodes[1].addr().to_string();
    create_topic(&a0, "t", 4).await;
    // Created on one instance, applied by the partition owners on both.
    create_subscription(
        &a1,
        "s",
        json!({"topic": "t", "filters": filters(), "ack_timeout_ms": 3000}),
    )
    .await;
    let evs = events("c");
    for (e, _) in &evs {
        publish(&a0, "t", e).await.unwrap();
    }
    let want = ids_taken(&evs);
    // A pull on either instance gathers every partition; nothing is acked, so the
    // owner's SIGKILL leaves every match in flight (leases of 3 s: none runs out
    // before all are in hand, so no match is counted twice here).
    let first = pull_until(&a1, "s", want.len(), DRAIN).await;
    assert_eq!(event_ids(&first), want, "{:?}", summary(&first));

    nodes[0].kill();
    // The survivor takes over node 0's partitions (lease TTL) and hands the matches
    // out again once their leases run out: never a filtered-out event.
    let seen: Arc<Mutex<Vec<Delivery>>> = Arc::default();
    wait_until(DRAIN, "every match delivered again by the survivor", || {
        let (a1, seen, want) = (a1.clone(), seen.clone(), want.clone());
        async move {
            let batch = pull(&a1, "s", &json!({"max_events": 100, "wait_ms": 500})).await?;
            if !batch.is_empty() {
                let r = ack(&a1, "s", &ids(&batch)).await?;
                anyhow::ensure!(set(&r["acked"]).len() == batch.len(), "ack: {r}");
            }
            let mut seen = seen.lock().unwrap();
            seen.extend(batch);
            let got = event_ids(&seen);
            anyhow::ensure!(got.is_subset(&want), "a filtered-out event: {got:?}");
            anyhow::ensure!(got == want, "{} of {} so far", got.len(), want.len());
            Ok(())
        }
    })
    .await
    .unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(seen.iter().all(|d| d.attempt >= 2), "{:?}", summary(&seen));
    // Every partition's committed offset reaches its end: filtered events resolved.
    let ends = end_offsets(&a1, "t").await;
    for (p, end) in ends.iter().enumerate() {
        wait_committed(&a1, "s", p as u64, *end).await;
    }
}
