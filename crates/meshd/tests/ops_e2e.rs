//! What an operator reads (issue 26, the operations kit): HTTP request metrics by
//! route template, publish and delivery latency by topic and subscription, and a
//! normal stop that logs no warning.

mod common;

use common::*;
use meshd_test_support::http::{self, send_json};
use serde_json::json;
use std::time::Duration;

/// The `meshd_http_*` lines of a `/metrics` page.
fn http_lines(page: &str) -> Vec<&str> {
    page.lines()
        .filter(|l| {
            l.starts_with("meshd_http_requests_total")
                || l.starts_with("meshd_http_request_duration")
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_requests_of_every_kind_then_the_http_metrics_count_them_by_route_template_never_by_raw_path(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "orders-7f3", 2).await;
    create_subscription(&a, "billing-x9", json!({"topic": "orders-7f3"})).await;
    for i in 0..3 {
        publish(&a, "orders-7f3", &event(&format!("e{i}")))
            .await
            .unwrap();
    }
    let ds = pull_until(&a, "billing-x9", 3, Duration::from_secs(10)).await;
    ack(&a, "billing-x9", &ids(&ds)).await.unwrap();
    let r = http::get(&a, "/v1/no-such-route/orders-7f3").await.unwrap();
    assert_eq!(r.status, 404);
    let r = send_json(
        &a,
        "PUT",
        "/v1/topics/orders-7f3",
        &json!({"partitions": "many"}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 400, "{}", r.body);

    let page = client(&a).metrics().await.unwrap();
    let lines = http_lines(&page);
    let count = |sample: &str| {
        meshd_test_support::http::sample_of(&page, sample)
            .unwrap_or_else(|| panic!("no {sample} in:\n{}", lines.join("\n")))
    };
    assert_eq!(
        count(
            r#"meshd_http_requests_total{route="/v1/topics/{topic}/events",method="POST",status="201"}"#
        ),
        3.0
    );
    assert_eq!(
        count(
            r#"meshd_http_requests_total{route="/v1/subscriptions/{name}/ack",method="POST",status="200"}"#
        ),
        1.0
    );
    assert!(
        count(
            r#"meshd_http_requests_total{route="/v1/subscriptions/{name}/pull",method="POST",status="200"}"#
        ) >= 1.0
    );
    assert_eq!(
        count(r#"meshd_http_requests_total{route="/v1/topics/{topic}",method="PUT",status="400"}"#),
        1.0,
        "an error answer is counted with its status"
    );
    assert_eq!(
        count(r#"meshd_http_requests_total{route="none",method="GET",status="404"}"#),
        1.0,
        "a path no route matches is counted once, without its path"
    );
    // Every request so far is in the histogram of its route.
    assert_eq!(
        count(r#"meshd_http_request_duration_seconds_count{route="/v1/topics/{topic}/events"}"#),
        3.0
    );
    assert_eq!(
        count(
            r#"meshd_http_request_duration_seconds_bucket{route="/v1/topics/{topic}/events",le="+Inf"}"#
        ),
        3.0
    );
    // Per-topic publish and per-subscription delivery latency: every publish and
    // every first hand-out observed once, under the topic's and the subscription's
    // names.
    assert_eq!(
        count(r#"meshd_publish_seconds_count{topic="orders-7f3"}"#),
        3.0
    );
    assert_eq!(
        count(r#"meshd_publish_seconds_bucket{topic="orders-7f3",le="+Inf"}"#),
        3.0
    );
    assert_eq!(
        count(r#"meshd_delivery_latency_seconds_count{subscription="billing-x9"}"#),
        3.0
    );
    assert!(count(r#"meshd_delivery_latency_seconds_sum{subscription="billing-x9"}"#) >= 0.0);
    // Never a raw path or a client's name in a label.
    for l in &lines {
        assert!(
            !l.contains("orders-7f3") && !l.contains("billing-x9") && !l.contains("no-such-route"),
            "a raw path in a label: {l}"
        );
    }
}

/// Every warning or error line of a log from the stop on (the line meshd logs when
/// the signal arrives).
fn alarms(log: &str) -> Vec<&str> {
    let from = log
        .find("meshd stopping")
        .unwrap_or_else(|| panic!("no stop in the log:\n{log}"));
    log[from..]
        .lines()
        .filter(|l| {
            l.contains(" WARN ")
                || l.contains(" ERROR ")
                || l.contains("\"level\":\"WARN\"")
                || l.contains("\"level\":\"ERROR\"")
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_normal_sigterm_on_embedded_defaults_then_meshd_stops_without_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 2).await;
    create_subscription(&a, "s", json!({"topic": "t"})).await;
    for i in 0..5 {
        publish(&a, "t", &event(&format!("e{i}"))).await.unwrap();
    }
    let ds = pull_until(&a, "s", 5, Duration::from_secs(10)).await;
    ack(&a, "s", &ids(&ds[..3])).await.unwrap();
    // Two deliveries still in flight, and a long poll waiting, at the stop.
    let waiting = tokio::spawn({
        let a = a.clone();
        async move { pull(&a, "s", &json!({"max_events": 1, "wait_ms": 20000})).await }
    });
    wait_long_polls(&a, 1).await;
    let code = m.terminate(Duration::from_secs(20)).await.unwrap();
    assert_eq!(code, Some(0));
    // A graceful stop ends a waiting long poll at once with what it has (http-api.md,
    // "Graceful stop"; the pull loop returns when meshd is stopping): 200 with no
    // delivery, both in-flight deliveries being leased. Its own wait (20 s) is longer
    // than the client's timeout (10 s), so only the stop can have answered it.
    let answer = waiting
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("the waiting long poll got no answer at the stop: {e:#}"));
    assert!(
        answer.is_empty(),
        "the stop answered the long poll with deliveries: {:?}",
        summary(&answer)
    );
    let log = std::fs::read_to_string(m.log_path()).unwrap();
    assert!(log.contains("stores closed"), "{log}");
    let found = alarms(&log);
    assert!(
        found.is_empty(),
        "a normal stop logged:\n{}",
        found.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_normal_sigterm_of_each_cluster_instance_then_none_logs_a_warning() {
    let mut c = SmallCluster::start(2, Duration::from_millis(2000)).await;
    let a = c.addr(0);
    create_topic(&a, "t", 4).await;
    create_subscription(&a, "s", json!({"topic": "t"})).await;
    c.wait_settled("t", 4).await;
    for i in 0..8 {
        publish(&a, "t", &event(&format!("e{i}"))).await.unwrap();
    }
    let ds = pull_until(&a, "s", 8, Duration::from_secs(10)).await;
    ack(&a, "s", &ids(&ds)).await.unwrap();
    for i in (0..2).rev() {
        let code = c.nodes[i].terminate(Duration::from_secs(30)).await.unwrap();
        assert_eq!(code, Some(0), "instance {i}");
        let log = std::fs::read_to_string(c.nodes[i].log_path()).unwrap();
        assert!(log.contains("stores closed"), "{log}");
        let found = alarms(&log);
        assert!(
            found.is_empty(),
            "a normal stop of instance {i} logged:\n{}",
            found.join("\n")
        );
    }
}
