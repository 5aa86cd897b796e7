//! How deeply a request's JSON may nest (http-api.md, "Security rules (third round)"),
//! through the real binary.
//!
//! The story this pins: a 400-byte event whose `data` nested 200 arrays deep was
//! accepted (201; 100 000 deep too), since meshd reads an event as a raw value, which
//! skips nesting without a limit. Every pull answer carrying it then failed to parse
//! in a client with serde_json's limit (128): nothing was acked, and the whole batch,
//! its innocent neighbours included, ended in the dead-letter store. Now an event
//! nested deeper than 64 levels (the event object is level 1) is a 400 naming the
//! member, alone, in a batch (the batch's array does not count) and in binary mode;
//! every other JSON body is held to 64 levels too, and a 100 000-deep body of any
//! route is a 400, never a crash.

mod common;

use common::*;
use meshd_test_support::http::{self, request_with, Response};
use serde_json::{json, Value};

/// `levels` nested arrays around `1`.
fn nested(levels: usize) -> String {
    format!("{}1{}", "[".repeat(levels), "]".repeat(levels))
}

/// A structured event whose `data` is `data` (JSON text): the event object is level 1,
/// so the event nests one level more than its data.
fn event_with_data(id: &str, data: &str) -> String {
    format!(
        r#"{{"specversion":"1.0","id":"{id}","source":"/depth","type":"t.nested","data":{data}}}"#
    )
}

async fn post(a: &str, path: &str, content_type: &str, body: &str) -> Response {
    request_with(
        a,
        "POST",
        path,
        &[("content-type", content_type)],
        body.as_bytes(),
    )
    .await
    .unwrap()
}

async fn publish_structured(a: &str, body: &str) -> Response {
    post(
        a,
        "/v1/topics/t/events",
        "application/cloudevents+json",
        body,
    )
    .await
}

async fn publish_batch(a: &str, events: &[&str]) -> Response {
    let body = format!("[{}]", events.join(","));
    post(
        a,
        "/v1/topics/t/events",
        "application/cloudevents-batch+json",
        &body,
    )
    .await
}

async fn publish_binary(a: &str, id: &str, body: &str) -> Response {
    request_with(
        a,
        "POST",
        "/v1/topics/t/events",
        &[
            ("content-type", "application/json"),
            ("ce-specversion", "1.0"),
            ("ce-id", id),
            ("ce-source", "/depth"),
            ("ce-type", "t.nested"),
        ],
        body.as_bytes(),
    )
    .await
    .unwrap()
}

/// Asserts a 400 naming `field` whose detail gives the bound.
fn too_deep(r: &Response, field: &str) {
    let p = problem_naming(r, field);
    assert!(
        p["detail"].as_str().unwrap_or("").contains("64 levels"),
        "the detail gives the bound: {p}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_events_nested_past_64_levels_then_publish_refuses_them_alone_in_a_batch_and_in_binary_mode_and_takes_64(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t"})).await;

    // 64 deep (data 63): taken, alone, in a batch and in binary mode.
    let ok = |id: &str| event_with_data(id, &nested(63));
    let deep = |id: &str| event_with_data(id, &nested(64));
    let r = publish_structured(a, &ok("ok-alone")).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let r = publish_batch(a, &[&ok("ok-b0"), &ok("ok-b1")]).await;
    assert_eq!(
        r.status, 201,
        "the batch's own array does not count: {}",
        r.body
    );
    let r = publish_binary(a, "ok-binary", &nested(63)).await;
    assert_eq!(r.status, 201, "{}", r.body);

    // 65 deep (data 64): refused the same way in every mode, naming the member.
    too_deep(&publish_structured(a, &deep("deep-alone")).await, "data");
    let r = publish_batch(a, &[&ok("x0"), &deep("x1"), &ok("x2")]).await;
    too_deep(&r, "events[1].data");
    too_deep(&publish_binary(a, "deep-binary", &nested(64)).await, "data");
    // Any member is named, not only `data`.
    let ext = format!(
        r#"{{"specversion":"1.0","id":"e","source":"/depth","type":"t","ext":{}}}"#,
        nested(64)
    );
    too_deep(&publish_structured(a, &ext).await, "ext");

    // Nothing of a refused request was stored: exactly the four accepted events.
    assert_eq!(end_offsets(a, "t").await, vec![4]);
    let got = pull_until(a, "s", 4, std::time::Duration::from_secs(20)).await;
    assert_eq!(
        event_ids(&got),
        ["ok-alone", "ok-b0", "ok-b1", "ok-binary"],
        "{:?}",
        summary(&got)
    );
    let want: Value = serde_json::from_str(&nested(63)).unwrap();
    assert!(
        got.iter().all(|d| d.event["data"] == want),
        "delivered exactly as published"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bodies_100000_levels_deep_on_every_json_route_then_each_is_a_400_and_meshd_stays_healthy(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t"})).await;
    let deep = nested(100_000);

    // Publish, every mode: refused without recursion, naming the member.
    too_deep(
        &publish_structured(a, &event_with_data("d", &deep)).await,
        "data",
    );
    let r = publish_batch(
        a,
        &[&event_with_data("a", "1"), &event_with_data("d", &deep)],
    )
    .await;
    too_deep(&r, "events[1].data");
    too_deep(&publish_binary(a, "d", &deep).await, "data");
    // A batch body that is itself the deep array: its first element is no event.
    let r = post(
        a,
        "/v1/topics/t/events",
        "application/cloudevents-batch+json",
        &deep,
    )
    .await;
    problem(&r, 400);

    // Every other JSON body: a 400 naming the top-level member holding the depth.
    let cases: [(&str, &str, String, Option<&str>); 6] = [
        (
            "PUT",
            "/v1/topics/u",
            format!(r#"{{"partitions":{deep}}}"#),
            Some("partitions"),
        ),
        (
            "PUT",
            "/v1/subscriptions/s2",
            format!(r#"{{"topic":"t","filters":{deep}}}"#),
            Some("filters"),
        ),
        (
            "POST",
            "/v1/tasks",
            format!(r#"{{"agent":"a","input":{deep}}}"#),
            Some("input"),
        ),
        ("POST", "/v1/sessions", deep.clone(), None),
        (
            "POST",
            "/v1/subscriptions/s/pull",
            format!(r#"{{"max_events":{deep}}}"#),
            Some("max_events"),
        ),
        (
            "POST",
            "/v1/subscriptions/s/ack",
            format!(r#"{{"delivery_ids":{deep}}}"#),
            Some("delivery_ids"),
        ),
    ];
    for (method, path, body, field) in cases {
        let r = request_with(
            a,
            method,
            path,
            &[("content-type", "application/json")],
            body.as_bytes(),
        )
        .await
        .unwrap();
        match field {
            Some(f) => too_deep(&r, f),
            None => {
                let p = problem(&r, 400);
                assert!(p["detail"].as_str().unwrap().contains("64 levels"), "{p}");
            }
        }
    }

    // 64 levels is the bound for those too: a task's `input` may nest 63 (the body
    // is level 1), not 64 (it would come back inside answers one level deeper).
    let task = |input: &str| format!(r#"{{"agent":"a","input":{input}}}"#);
    let r = post(a, "/v1/tasks", "application/json", &task(&nested(64))).await;
    too_deep(&r, "input");
    let r = post(a, "/v1/tasks", "application/json", &task(&nested(63))).await;
    assert_eq!(r.status, 201, "{}", r.body);

    // Still healthy and serving.
    let r = http::get(a, "/healthz").await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let r = bare(a, "GET", "/v1/subscriptions/s2").await;
    assert_eq!(r.status, 404, "nothing was stored: {}", r.body);
    publish(a, "t", &event("after")).await.unwrap();
    let got = pull_until(a, "s", 1, std::time::Duration::from_secs(20)).await;
    assert_eq!(event_ids(&got), ["after"]);
}
