//! Subscriptions over HTTP through the real binary: ETags, `If-Match`,
//! `If-None-Match: *`, validation naming the field, the topic check, and state that
//! survives a SIGKILL.

use meshd_test_support::http::{self, request_with, send_json};
use meshd_test_support::meshd::MeshdProcess;
use serde_json::{json, Value};
use std::path::Path;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_meshd"))
}

fn problem(r: &http::Response, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    assert_eq!(
        r.header("content-type"),
        Some("application/problem+json"),
        "{}",
        r.body
    );
    r.json().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscriptions_honour_etags_and_preconditions_and_survive_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let a = m.addr().to_string();
    send_json(&a, "PUT", "/v1/topics/orders", &json!({"partitions": 2}))
        .await
        .unwrap();

    let r = send_json(
        &a,
        "PUT",
        "/v1/subscriptions/billing",
        &json!({"topic": "orders", "max_attempts": 3}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    let etag = r.header("etag").unwrap().to_string();
    let body = r.json().unwrap();
    assert_eq!(etag, format!("\"{}\"", body["revision"]));
    assert_eq!(body["max_attempts"], 3);
    assert_eq!(body["ack_timeout_ms"], 30000, "documented default");
    assert_eq!(
        body["backoff"],
        json!({"initial_ms": 1000, "max_ms": 60000})
    );

    // If-None-Match: * on an existing subscription.
    let r = request_with(
        &a,
        "PUT",
        "/v1/subscriptions/billing",
        &[("Content-Type", "application/json"), ("If-None-Match", "*")],
        br#"{"topic":"orders"}"#,
    )
    .await
    .unwrap();
    problem(&r, 412);
    // A matching If-Match updates; a stale one is 412 and changes nothing.
    let r = request_with(
        &a,
        "PUT",
        "/v1/subscriptions/billing",
        &[("Content-Type", "application/json"), ("If-Match", &etag)],
        br#"{"topic":"orders","max_attempts":4}"#,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let new_etag = r.header("etag").unwrap().to_string();
    assert_ne!(new_etag, etag);
    let r = request_with(
        &a,
        "PUT",
        "/v1/subscriptions/billing",
        &[("Content-Type", "application/json"), ("If-Match", &etag)],
        br#"{"topic":"orders","max_attempts":9}"#,
    )
    .await
    .unwrap();
    problem(&r, 412);
    let got = http::get(&a, "/v1/subscriptions/billing").await.unwrap();
    assert_eq!(got.header("etag"), Some(new_etag.as_str()));
    assert_eq!(got.json().unwrap()["max_attempts"], 4);

    // The topic cannot change; invalid values name their field; unknown topics are 404.
    let p = problem(
        &send_json(
            &a,
            "PUT",
            "/v1/subscriptions/billing",
            &json!({"topic": "other"}),
        )
        .await
        .unwrap(),
        409,
    );
    assert_eq!(p["field"], "topic");
    send_json(&a, "PUT", "/v1/topics/other", &json!({"partitions": 1}))
        .await
        .unwrap();
    problem(
        &send_json(
            &a,
            "PUT",
            "/v1/subscriptions/billing",
            &json!({"topic": "other"}),
        )
        .await
        .unwrap(),
        409,
    );
    for (body, field) in [
        (
            json!({"topic": "orders", "max_attempts": 0}),
            "max_attempts",
        ),
        (
            json!({"topic": "orders", "ack_timeout_ms": 50}),
            "ack_timeout_ms",
        ),
        (
            json!({"topic": "orders", "backoff": {"initial_ms": 10, "max_ms": 5}}),
            "backoff",
        ),
        (json!({"topic": "orders", "start": "middle"}), "start"),
        (json!({"max_attempts": 3}), "topic"),
    ] {
        let p = problem(
            &send_json(&a, "PUT", "/v1/subscriptions/s2", &body)
                .await
                .unwrap(),
            400,
        );
        assert!(
            p["field"].as_str().unwrap_or("").starts_with(field),
            "{body}: {p}"
        );
    }
    problem(
        &send_json(&a, "PUT", "/v1/subscriptions/s2", &json!({"topic": "nope"}))
            .await
            .unwrap(),
        404,
    );
    // A topic with a subscription cannot be deleted.
    let p = problem(
        &request_with(&a, "DELETE", "/v1/topics/orders", &[], b"")
            .await
            .unwrap(),
        409,
    );
    assert!(p["type"].as_str().unwrap().ends_with("/conflict"));

    // Survives a SIGKILL.
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    let list = http::get(&a, "/v1/subscriptions")
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(list["subscriptions"].as_array().unwrap().len(), 1);
    assert_eq!(list["subscriptions"][0]["name"], "billing");

    // Delete with a stale If-Match is 412; with the current one 204; then 404.
    problem(
        &request_with(
            &a,
            "DELETE",
            "/v1/subscriptions/billing",
            &[("If-Match", &etag)],
            b"",
        )
        .await
        .unwrap(),
        412,
    );
    let r = request_with(
        &a,
        "DELETE",
        "/v1/subscriptions/billing",
        &[("If-Match", &new_etag)],
        b"",
    )
    .await
    .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    problem(
        &http::get(&a, "/v1/subscriptions/billing").await.unwrap(),
        404,
    );
    let r = request_with(&a, "DELETE", "/v1/topics/orders", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
}
