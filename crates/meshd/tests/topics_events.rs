//! Topics, publishing and browsing through the real binary: the contract of
//! "Topics and events" in the HTTP API, bad input answered with problem+json that
//! changes nothing, and every 201'd event still there after a SIGKILL.

use meshd_test_support::http::{self, request_with, send_json};
use meshd_test_support::meshd::MeshdProcess;
use serde_json::{json, Value};
use std::path::Path;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_meshd"))
}

async fn start(dir: &Path) -> MeshdProcess {
    MeshdProcess::start(bin(), dir, &[])
        .await
        .expect("start meshd")
}

fn problem(r: &http::Response, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    assert_eq!(
        r.header("content-type"),
        Some("application/problem+json"),
        "{}",
        r.body
    );
    let p = r.json().unwrap();
    assert_eq!(p["status"], status);
    assert!(
        p["type"].as_str().is_some()
            && p["title"].as_str().is_some()
            && p["detail"].as_str().is_some()
    );
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_are_created_idempotently_listed_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let r = send_json(a, "PUT", "/v1/topics/orders", &json!({"partitions": 3}))
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    let r = send_json(a, "PUT", "/v1/topics/orders", &json!({"partitions": 3}))
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let p = problem(
        &send_json(a, "PUT", "/v1/topics/orders", &json!({"partitions": 4}))
            .await
            .unwrap(),
        409,
    );
    assert!(p["type"].as_str().unwrap().ends_with("/conflict"));
    let list = http::get(a, "/v1/topics").await.unwrap().json().unwrap();
    assert_eq!(list["topics"], json!([{"name": "orders", "partitions": 3}]));
    let t = http::get(a, "/v1/topics/orders")
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(t["end_offsets"], json!([0, 0, 0]));
    let r = request_with(a, "DELETE", "/v1/topics/orders", &[], b"")
        .await
        .unwrap();
    assert_eq!(r.status, 204, "{}", r.body);
    problem(&http::get(a, "/v1/topics/orders").await.unwrap(), 404);
    problem(
        &request_with(a, "DELETE", "/v1/topics/orders", &[], b"")
            .await
            .unwrap(),
        404,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_topic_requests_are_problems_that_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    for (body, field) in [
        (json!({"partitions": 0}), "partitions"),
        (json!({"partitions": 1025}), "partitions"),
        (json!({"partitions": -1}), "partitions"),
        (json!({"partitions": "3"}), "partitions"),
        (json!({}), "partitions"),
    ] {
        let p = problem(
            &send_json(a, "PUT", "/v1/topics/t", &body).await.unwrap(),
            400,
        );
        assert_eq!(p["field"], field, "{body}");
    }
    problem(
        &request_with(
            a,
            "PUT",
            "/v1/topics/t",
            &[("Content-Type", "application/json")],
            b"{not json",
        )
        .await
        .unwrap(),
        400,
    );
    problem(
        &request_with(
            a,
            "PUT",
            "/v1/topics/t",
            &[("Content-Type", "text/plain")],
            b"{\"partitions\":1}",
        )
        .await
        .unwrap(),
        415,
    );
    let p = problem(
        &send_json(a, "PUT", "/v1/topics/bad%20name", &json!({"partitions": 1}))
            .await
            .unwrap(),
        400,
    );
    assert_eq!(p["field"], "topic");
    problem(
        &request_with(a, "PATCH", "/v1/topics/t", &[], b"")
            .await
            .unwrap(),
        405,
    );
    assert_eq!(
        http::get(a, "/v1/topics").await.unwrap().json().unwrap()["topics"],
        json!([]),
        "nothing was created"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_published_in_every_mode_come_back_exactly_as_published() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    send_json(a, "PUT", "/v1/topics/t", &json!({"partitions": 4}))
        .await
        .unwrap();
    // Structured: odd spacing, number formats and key order must survive.
    let structured = br#"{"specversion":"1.0","id":"e1","source":"/s","type":"t.created","partitionkey":"k1","data":{"n":1.50,"big":1e3}}"#;
    let r = request_with(
        a,
        "POST",
        "/v1/topics/t/events",
        &[("Content-Type", "application/cloudevents+json")],
        structured,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    let placed = r.json().unwrap()["events"][0].clone();
    assert_eq!(placed["id"], "e1");
    let p1 = placed["partition"].as_u64().unwrap();
    // The same partition key lands in the same partition.
    let batch = br#"[{"specversion":"1.0","id":"e2","source":"/s","type":"t","partitionkey":"k1"},{"specversion":"1.0","id":"e3","source":"/s","type":"t"}]"#;
    let r = request_with(
        a,
        "POST",
        "/v1/topics/t/events",
        &[("Content-Type", "application/cloudevents-batch+json")],
        batch,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    let placed2 = r.json().unwrap()["events"].clone();
    assert_eq!(placed2[0]["partition"].as_u64().unwrap(), p1);
    // Binary mode.
    let r = request_with(
        a,
        "POST",
        "/v1/topics/t/events",
        &[
            ("ce-specversion", "1.0"),
            ("ce-id", "e4"),
            ("ce-source", "/b"),
            ("ce-type", "bin"),
            ("Content-Type", "application/json"),
        ],
        br#"{"x":true}"#,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    // Browse partition p1: e1 then e2, byte for byte.
    let r = http::get(
        a,
        &format!("/v1/topics/t/partitions/{p1}/events?from=0&limit=10"),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.body.contains(std::str::from_utf8(structured).unwrap()),
        "stored exactly as published: {}",
        r.body
    );
    let events = r.json().unwrap()["events"].clone();
    assert_eq!(events[0]["offset"], 0);
    assert_eq!(events[1]["event"]["id"], "e2");
    let t = http::get(a, "/v1/topics/t").await.unwrap().json().unwrap();
    let total: u64 = t["end_offsets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(total, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_events_are_problems_that_name_the_field_and_store_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    send_json(a, "PUT", "/v1/topics/t", &json!({"partitions": 1}))
        .await
        .unwrap();
    let ce = [("Content-Type", "application/cloudevents+json")];
    let p = problem(
        &request_with(
            a,
            "POST",
            "/v1/topics/t/events",
            &ce,
            br#"{"specversion":"1.0","id":"1","type":"t"}"#,
        )
        .await
        .unwrap(),
        400,
    );
    assert_eq!(p["field"], "source");
    let p = problem(
        &request_with(
            a,
            "POST",
            "/v1/topics/t/events",
            &ce,
            br#"{"specversion":"0.3","id":"1","source":"/s","type":"t"}"#,
        )
        .await
        .unwrap(),
        400,
    );
    assert_eq!(p["field"], "specversion");
    let batch = [("Content-Type", "application/cloudevents-batch+json")];
    let p = problem(&request_with(a, "POST", "/v1/topics/t/events", &batch, br#"[{"specversion":"1.0","id":"1","source":"/s","type":"t"},{"specversion":"1.0","id":"","source":"/s","type":"t"}]"#).await.unwrap(), 400);
    assert_eq!(p["field"], "events[1].id");
    // deliverat: an RFC 3339 string at most 7 days ahead of the publish (the server's
    // clock; a day's margin each way).
    let at = |days_ahead: i64| {
        let now = meshd_stores::time::Timestamp::now().as_millis();
        meshd_stores::time::Timestamp::from_millis(now + days_ahead * 86_400_000)
            .unwrap()
            .to_rfc3339()
    };
    for (deliverat, field) in [
        (json!(at(8)), "deliverat"),
        (json!("next tuesday"), "deliverat"),
        (json!(1_800_000_000_000u64), "deliverat"),
    ] {
        let e =
            json!({"specversion":"1.0","id":"d","source":"/s","type":"t","deliverat":deliverat});
        let r = request_with(
            a,
            "POST",
            "/v1/topics/t/events",
            &ce,
            e.to_string().as_bytes(),
        )
        .await
        .unwrap();
        assert_eq!(problem(&r, 400)["field"], field, "{deliverat}");
    }
    let e = json!([
        {"specversion":"1.0","id":"d1","source":"/s","type":"t","deliverat":at(6)},
        {"specversion":"1.0","id":"d2","source":"/s","type":"t","deliverat":at(-30)},
        {"specversion":"1.0","id":"d3","source":"/s","type":"t","deliverat":at(9)}
    ]);
    let r = request_with(
        a,
        "POST",
        "/v1/topics/t/events",
        &batch,
        e.to_string().as_bytes(),
    )
    .await
    .unwrap();
    assert_eq!(problem(&r, 400)["field"], "events[2].deliverat");
    problem(
        &request_with(
            a,
            "POST",
            "/v1/topics/t/events",
            &[("Content-Type", "text/plain")],
            b"hello",
        )
        .await
        .unwrap(),
        415,
    );
    problem(
        &request_with(a, "POST", "/v1/topics/t/events", &ce, b"{")
            .await
            .unwrap(),
        400,
    );
    // One event over 1 MiB, and a body over 8 MiB.
    let big = format!(
        r#"{{"specversion":"1.0","id":"1","source":"/s","type":"t","data":"{}"}}"#,
        "x".repeat(1_100_000)
    );
    problem(
        &request_with(a, "POST", "/v1/topics/t/events", &ce, big.as_bytes())
            .await
            .unwrap(),
        413,
    );
    let huge = vec![b' '; 9 * 1024 * 1024];
    problem(
        &request_with(a, "POST", "/v1/topics/t/events", &ce, &huge)
            .await
            .unwrap(),
        413,
    );
    problem(
        &request_with(
            a,
            "POST",
            "/v1/topics/missing/events",
            &ce,
            br#"{"specversion":"1.0","id":"1","source":"/s","type":"t"}"#,
        )
        .await
        .unwrap(),
        404,
    );
    // Browse bounds.
    problem(
        &http::get(a, "/v1/topics/t/partitions/1/events")
            .await
            .unwrap(),
        404,
    );
    let p = problem(
        &http::get(a, "/v1/topics/t/partitions/0/events?limit=0")
            .await
            .unwrap(),
        400,
    );
    assert_eq!(p["field"], "limit");
    let p = problem(
        &http::get(a, "/v1/topics/t/partitions/0/events?from=-1")
            .await
            .unwrap(),
        400,
    );
    assert_eq!(p["field"], "from");
    let t = http::get(a, "/v1/topics/t").await.unwrap().json().unwrap();
    assert_eq!(t["end_offsets"], json!([0]), "nothing was stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_stream_of_publishes_when_meshd_is_killed_then_every_201_event_is_readable_after_restart(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    send_json(m.addr(), "PUT", "/v1/topics/t", &json!({"partitions": 2}))
        .await
        .unwrap();
    let addr = m.addr().to_string();
    let publisher = tokio::spawn(async move {
        let mut acked = Vec::new();
        for i in 0..10_000u32 {
            let body = format!(r#"{{"specversion":"1.0","id":"e{i}","source":"/s","type":"t"}}"#);
            match request_with(
                &addr,
                "POST",
                "/v1/topics/t/events",
                &[("Content-Type", "application/cloudevents+json")],
                body.as_bytes(),
            )
            .await
            {
                Ok(r) if r.status == 201 => {
                    let e = r.json().unwrap()["events"][0].clone();
                    acked.push((
                        format!("e{i}"),
                        e["partition"].as_u64().unwrap(),
                        e["offset"].as_u64().unwrap(),
                    ));
                }
                _ => break, // the process is gone
            }
        }
        acked
    });
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    m.kill();
    let acked = publisher.await.unwrap();
    assert!(
        acked.len() > 5,
        "the publisher made progress ({})",
        acked.len()
    );
    m.restart().await.unwrap();
    for p in 0..2u64 {
        let mut events = Vec::new();
        loop {
            let from = events.len();
            let r = http::get(
                m.addr(),
                &format!("/v1/topics/t/partitions/{p}/events?from={from}&limit=1000"),
            )
            .await
            .unwrap();
            let page = r.json().unwrap()["events"].as_array().unwrap().clone();
            if page.is_empty() {
                break;
            }
            events.extend(page);
        }
        for (id, partition, offset) in acked.iter().filter(|(_, q, _)| *q == p) {
            let got = events
                .iter()
                .find(|e| e["offset"].as_u64() == Some(*offset));
            assert_eq!(
                got.map(|e| e["event"]["id"].clone()),
                Some(json!(id)),
                "201'd event {id} at {partition}/{offset} lost"
            );
        }
    }
}
