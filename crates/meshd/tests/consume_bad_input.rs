//! Bad input to the consume routes (pull, ack, nack, extend, offsets, dead letters)
//! through the real binary: every answer is the contract's problem+json, it names the
//! field where one is wrong, and it changes nothing (the event is still delivered with
//! attempt 1, the offsets are where they were). A property throws random bodies at the
//! routes of one process and asserts it never answers 5xx or drops a connection.

mod common;

use common::*;
use meshd_test_support::http::{self, request_with, send_json, Response};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

/// A topic `t` with one partition holding one event, and a subscription `s` from the
/// earliest offset that has not pulled it yet.
async fn one_event_one_subscription(a: &str) -> Value {
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t", "start": "earliest"})).await;
    let e = event("e0");
    assert_eq!(publish(a, "t", &e).await.unwrap(), (0, 0));
    e
}

async fn post(a: &str, path: &str, body: &Value) -> Response {
    send_json(a, "POST", path, body).await.unwrap()
}

async fn raw(a: &str, method: &str, path: &str, content_type: &str, body: &[u8]) -> Response {
    request_with(a, method, path, &[("Content-Type", content_type)], body)
        .await
        .unwrap()
}

/// The problem names `word` somewhere (field or detail): for an unknown member the
/// contract asks for "what was wrong", not a particular problem member.
fn mentions(p: &Value, word: &str) {
    assert!(
        p.to_string().contains(word),
        "the problem does not name {word:?}: {p}"
    );
}

/// The same requests against every JSON route: bad JSON, a body that is not an object,
/// a non-JSON content type, an unknown and an invalid subscription name.
async fn generic_bad_requests(a: &str, verb: &str, valid: &Value) {
    let path = format!("/v1/subscriptions/s/{verb}");
    problem(
        &raw(a, "POST", &path, "application/json", b"{not json").await,
        400,
    );
    problem(
        &raw(a, "POST", &path, "application/json", b"{\"delivery_ids\":[").await,
        400,
    );
    for body in [json!([]), json!("x"), json!(null), json!(7)] {
        problem(&post(a, &path, &body).await, 400);
    }
    let mut unknown_field = valid.clone();
    unknown_field["bogus"] = json!(true);
    mentions(
        &problem(&post(a, &path, &unknown_field).await, 400),
        "bogus",
    );
    problem(
        &raw(a, "POST", &path, "text/plain", valid.to_string().as_bytes()).await,
        415,
    );
    problem(
        &post(a, &format!("/v1/subscriptions/missing/{verb}"), valid).await,
        404,
    );
    problem_naming(
        &post(a, &format!("/v1/subscriptions/bad%20name/{verb}"), valid).await,
        "subscription",
    );
    problem(&bare(a, "GET", &path).await, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pull_requests_are_problems_that_name_the_field_and_lease_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let e = one_event_one_subscription(a).await;
    let pull_path = "/v1/subscriptions/s/pull";
    for (body, field) in [
        (json!({"max_events": 0}), "max_events"),
        (json!({"max_events": 1001}), "max_events"),
        (json!({"max_events": -1}), "max_events"),
        (json!({"wait_ms": 30001}), "wait_ms"),
        (json!({"wait_ms": -1}), "wait_ms"),
        (json!({"max_events": 1, "wait_ms": 30001}), "wait_ms"),
    ] {
        problem_naming(&post(a, pull_path, &body).await, field);
    }
    // Wrong types: a 400 (the contract asks for "what was wrong", in any words).
    for body in [
        json!({"max_events": "10"}),
        json!({"max_events": 1.5}),
        json!({"max_events": null, "wait_ms": true}),
        json!({"wait_ms": [0]}),
        json!({"session": 5}),
    ] {
        problem(&post(a, pull_path, &body).await, 400);
    }
    generic_bad_requests(a, "pull", &json!({"max_events": 1})).await;

    // Nothing was leased: the event comes with attempt 1, and nothing moved.
    assert_eq!(
        offsets(a, "s").await.unwrap(),
        vec![json!({"partition": 0, "committed": 0, "epoch": 0})]
    );
    let ds = pull(a, "s", &json!({"max_events": 1000, "wait_ms": 5000}))
        .await
        .unwrap();
    assert_eq!(summary(&ds), vec![(0, 0, 1)]);
    assert_eq!(ds[0].event, e);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ack_nack_and_extend_requests_are_problems_that_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    one_event_one_subscription(a).await;
    let d = pull_until(a, "s", 1, Duration::from_secs(30))
        .await
        .remove(0);
    let id = d.id.clone();

    for (verb, extra) in [
        ("ack", json!({})),
        ("nack", json!({"reason": "r"})),
        ("extend", json!({"ack_timeout_ms": 60000})),
    ] {
        let path = format!("/v1/subscriptions/s/{verb}");
        // delivery_ids missing, or not a list of ids.
        problem_naming(&post(a, &path, &extra).await, "delivery_ids");
        for ids in [
            json!(id.clone()),
            json!({"id": id.clone()}),
            json!([[id.clone()]]),
            json!([null]),
        ] {
            let mut body = extra.clone();
            body["delivery_ids"] = ids;
            problem(&post(a, &path, &body).await, 400);
        }
        let mut valid = extra.clone();
        valid["delivery_ids"] = json!([id.clone()]);
        generic_bad_requests(a, verb, &valid).await;
    }
    let nack_path = "/v1/subscriptions/s/nack";
    problem(
        &post(
            a,
            nack_path,
            &json!({"delivery_ids": [id.clone()], "reason": 5}),
        )
        .await,
        400,
    );
    let extend_path = "/v1/subscriptions/s/extend";
    for ms in [json!(99), json!(600001), json!(-1)] {
        problem_naming(
            &post(
                a,
                extend_path,
                &json!({"delivery_ids": [id.clone()], "ack_timeout_ms": ms}),
            )
            .await,
            "ack_timeout_ms",
        );
    }
    problem(
        &post(
            a,
            extend_path,
            &json!({"delivery_ids": [id.clone()], "ack_timeout_ms": "60000"}),
        )
        .await,
        400,
    );

    // None of it touched the delivery: it is still the live attempt, acked now.
    let r = ack(a, "s", std::slice::from_ref(&id)).await.unwrap();
    assert_eq!(set(&r["acked"]), set_of(&[id]), "{r}");
    wait_committed(a, "s", 0, 1).await;
    assert!(dead_letters(a, "s").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_offset_resets_are_problems_that_change_nothing_and_a_valid_one_takes_a_new_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let e = one_event_one_subscription(a).await;
    let at = |p: &str| format!("/v1/subscriptions/s/offsets/{p}");
    let untouched = vec![json!({"partition": 0, "committed": 0, "epoch": 0})];
    assert_eq!(offsets(a, "s").await.unwrap(), untouched);

    // Partitions that do not exist, or are not partition numbers.
    for p in ["1", "1024", "4294967296"] {
        let r = send_json(a, "PUT", &at(p), &json!({"offset": 0}))
            .await
            .unwrap();
        assert!(
            r.status == 400 || r.status == 404,
            "partition {p}: {} {}",
            r.status,
            r.body
        );
        problem(&r, r.status);
    }
    for p in ["-1", "x", "0.5"] {
        problem(
            &send_json(a, "PUT", &at(p), &json!({"offset": 0}))
                .await
                .unwrap(),
            400,
        );
    }
    // Offsets outside 0..=end (the end is 1).
    for offset in [json!(-1), json!(2), json!(u64::MAX)] {
        problem_naming(
            &send_json(a, "PUT", &at("0"), &json!({ "offset": offset }))
                .await
                .unwrap(),
            "offset",
        );
    }
    problem_naming(
        &send_json(a, "PUT", &at("0"), &json!({})).await.unwrap(),
        "offset",
    );
    for body in [
        json!({"offset": "0"}),
        json!({"offset": 0.5}),
        json!({"offset": null}),
    ] {
        problem(&send_json(a, "PUT", &at("0"), &body).await.unwrap(), 400);
    }
    mentions(
        &problem(
            &send_json(a, "PUT", &at("0"), &json!({"offset": 0, "bogus": 1}))
                .await
                .unwrap(),
            400,
        ),
        "bogus",
    );
    problem(
        &raw(a, "PUT", &at("0"), "application/json", b"{").await,
        400,
    );
    problem(
        &raw(a, "PUT", &at("0"), "text/plain", b"{\"offset\":0}").await,
        415,
    );
    problem(
        &send_json(
            a,
            "PUT",
            "/v1/subscriptions/missing/offsets/0",
            &json!({"offset": 0}),
        )
        .await
        .unwrap(),
        404,
    );
    problem(
        &http::get(a, "/v1/subscriptions/missing/offsets")
            .await
            .unwrap(),
        404,
    );
    problem_naming(
        &send_json(
            a,
            "PUT",
            "/v1/subscriptions/bad%20name/offsets/0",
            &json!({"offset": 0}),
        )
        .await
        .unwrap(),
        "subscription",
    );
    problem_naming(
        &http::get(a, "/v1/subscriptions/bad%20name/offsets")
            .await
            .unwrap(),
        "subscription",
    );
    assert_eq!(offsets(a, "s").await.unwrap(), untouched, "nothing moved");

    // The end itself is a valid target; each reset is a new epoch, and may go back.
    let r = send_json(a, "PUT", &at("0"), &json!({"offset": 1}))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json().unwrap(),
        json!({"partition": 0, "committed": 1, "epoch": 1})
    );
    assert_no_delivery(a, "s", 300, "delivered although nothing is due").await;
    let r = send_json(a, "PUT", &at("0"), &json!({"offset": 0}))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json().unwrap(),
        json!({"partition": 0, "committed": 0, "epoch": 2})
    );
    assert_eq!(
        offsets(a, "s").await.unwrap(),
        vec![json!({"partition": 0, "committed": 0, "epoch": 2})]
    );
    let ds = pull_until(a, "s", 1, Duration::from_secs(30)).await;
    assert_eq!(summary(&ds), vec![(0, 0, 1)]);
    assert_eq!(ds[0].event, e);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_dead_letter_requests_are_problems() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    one_event_one_subscription(a).await;
    for (query, field) in [
        ("subscription=s&limit=0", "limit"),
        ("subscription=s&limit=1001", "limit"),
        ("subscription=bad%20name", "subscription"),
    ] {
        problem_naming(
            &http::get(a, &format!("/v1/deadletters?{query}"))
                .await
                .unwrap(),
            field,
        );
    }
    problem(
        &http::get(a, "/v1/deadletters?subscription=s&limit=x")
            .await
            .unwrap(),
        400,
    );
    let unknown = "0123456789abcdef0123456789abcdef";
    problem(
        &http::get(a, &format!("/v1/deadletters/{unknown}"))
            .await
            .unwrap(),
        404,
    );
    problem(
        &bare(a, "POST", &format!("/v1/deadletters/{unknown}/redrive")).await,
        404,
    );
    problem(
        &bare(a, "DELETE", &format!("/v1/deadletters/{unknown}")).await,
        404,
    );
    problem(
        &bare(a, "PATCH", &format!("/v1/deadletters/{unknown}")).await,
        405,
    );
    assert!(dead_letters(a, "s").await.is_empty());
}

/// The routes the property sends bodies to, with the JSON members each one knows.
#[derive(Debug, Clone, Copy)]
enum Route {
    Pull,
    Ack,
    Nack,
    Extend,
    ResetOffset,
    PutSubscription,
    Publish,
}

impl Route {
    const ALL: [Route; 7] = [
        Route::Pull,
        Route::Ack,
        Route::Nack,
        Route::Extend,
        Route::ResetOffset,
        Route::PutSubscription,
        Route::Publish,
    ];

    fn method_and_path(self) -> (&'static str, &'static str) {
        match self {
            Route::Pull => ("POST", "/v1/subscriptions/s/pull"),
            Route::Ack => ("POST", "/v1/subscriptions/s/ack"),
            Route::Nack => ("POST", "/v1/subscriptions/s/nack"),
            Route::Extend => ("POST", "/v1/subscriptions/s/extend"),
            Route::ResetOffset => ("PUT", "/v1/subscriptions/s/offsets/0"),
            // Its own subscription, so the property cannot reconfigure `s`.
            Route::PutSubscription => ("PUT", "/v1/subscriptions/fuzzed"),
            Route::Publish => ("POST", "/v1/topics/t/events"),
        }
    }

    fn members(self) -> &'static [&'static str] {
        match self {
            Route::Pull => &["max_events", "wait_ms", "session"],
            Route::Ack => &["delivery_ids"],
            Route::Nack => &["delivery_ids", "reason"],
            Route::Extend => &["delivery_ids", "ack_timeout_ms"],
            Route::ResetOffset => &["offset"],
            // No `push`: a random push URL could send meshd off loopback.
            Route::PutSubscription => &[
                "topic",
                "max_attempts",
                "ack_timeout_ms",
                "backoff",
                "filter",
                "start",
            ],
            Route::Publish => &[
                "specversion",
                "id",
                "source",
                "type",
                "data",
                "partitionkey",
            ],
        }
    }
}

/// JSON values around the documented edges. No integer lies in 2000..=30000, so a
/// generated `wait_ms` never holds a pull long enough to hit the client's timeout.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-3i64..4).prop_map(Value::from),
        prop::sample::select(vec![
            99i64,
            100,
            1000,
            1001,
            30001,
            600001,
            1 << 53,
            i64::MIN,
            i64::MAX
        ])
        .prop_map(Value::from),
        Just(json!(u64::MAX)),
        prop::sample::select(vec![0.5f64, -1.5, 1e300]).prop_map(Value::from),
        Just(json!("1.0")),
        Just(json!("t")),
        "[a-z0-9._ -]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A value of the type and range a member takes, so that some requests are valid
/// (no `wait_ms` above 50 ms, no push URL).
fn plausible(member: &'static str) -> BoxedStrategy<Value> {
    let text = "[a-z0-9._-]{1,8}";
    match member {
        "max_events" => (1u64..20).prop_map(Value::from).boxed(),
        "wait_ms" => (0u64..50).prop_map(Value::from).boxed(),
        "delivery_ids" => prop::collection::vec(text.prop_map(Value::from), 0..3)
            .prop_map(Value::from)
            .boxed(),
        "ack_timeout_ms" => (100u64..60_000).prop_map(Value::from).boxed(),
        "offset" => (0u64..3).prop_map(Value::from).boxed(),
        "topic" => Just(json!("t")).boxed(),
        "max_attempts" => (1u64..10).prop_map(Value::from).boxed(),
        "start" => prop::sample::select(vec!["earliest", "latest"])
            .prop_map(Value::from)
            .boxed(),
        "backoff" => (1u64..100, 100u64..1000)
            .prop_map(|(i, m)| json!({"initial_ms": i, "max_ms": m}))
            .boxed(),
        "filter" => text.prop_map(|t| json!({ "type": t })).boxed(),
        "specversion" => Just(json!("1.0")).boxed(),
        "data" => json_value().boxed(),
        _ => text.prop_map(Value::from).boxed(),
    }
}

/// Bodies for one route: JSON-ish text, raw bytes, and objects with the route's own
/// members holding plausible values or values of any type.
fn body(route: Route) -> BoxedStrategy<Vec<u8>> {
    let shaped = || {
        prop::collection::btree_map(
            prop::sample::select(route.members()),
            Just(()),
            0..=route.members().len(),
        )
        .prop_flat_map(|members| {
            members
                .into_keys()
                .map(|k| (Just(k), prop_oneof![3 => plausible(k), 1 => json_value()]))
                .collect::<Vec<_>>()
        })
        .prop_map(|m| {
            Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
                .to_string()
                .into_bytes()
        })
    };
    prop_oneof![
        1 => r#"[\[\]{}",:0-9a-z_. -]{0,48}"#.prop_map(String::into_bytes),
        1 => prop::collection::vec(any::<u8>(), 0..32),
        4 => shaped(),
        // A batch of such objects, for the publish route's batch mode.
        1 => shaped().prop_map(|b| [b"[".as_slice(), &b, b"]"].concat()),
        1 => json_value().prop_map(|v| v.to_string().into_bytes()),
    ]
    .boxed()
}

fn content_type() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "application/json",
        "application/json",
        "application/cloudevents+json",
        "application/cloudevents-batch+json",
        "text/plain",
        "", // no Content-Type header
    ])
}

/// Every answer is 2xx, or 4xx problem+json whose `status` is the HTTP status; never
/// 5xx, never a dropped connection.
async fn answer_is_well_formed(
    a: &str,
    route: Route,
    content_type: &str,
    body: &[u8],
) -> anyhow::Result<u16> {
    let (method, path) = route.method_and_path();
    let headers: Vec<(&str, &str)> = if content_type.is_empty() {
        vec![]
    } else {
        vec![("Content-Type", content_type)]
    };
    let r = request_with(a, method, path, &headers, body)
        .await
        .map_err(|e| anyhow::anyhow!("{method} {path}: no well-formed answer: {e:#}"))?;
    anyhow::ensure!(
        (200..300).contains(&r.status) || (400..500).contains(&r.status),
        "{method} {path} answered {}: {}",
        r.status,
        r.body
    );
    if r.status >= 400 {
        anyhow::ensure!(
            r.header("content-type") == Some("application/problem+json"),
            "{method} {path} answered {} without problem+json: {:?} {}",
            r.status,
            r.header("content-type"),
            r.body
        );
        let p = r.json()?;
        anyhow::ensure!(
            p["status"] == r.status && p["type"].is_string() && p["title"].is_string(),
            "{method} {path}: problem does not match status {}: {p}",
            r.status
        );
    }
    Ok(r.status)
}

#[test]
fn random_bodies_to_the_consume_routes_get_2xx_or_a_problem_never_a_5xx_or_a_dropped_connection() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let m = rt.block_on(start(dir.path()));
    let a = m.addr().to_string();
    rt.block_on(one_event_one_subscription(&a));

    let cases = prop::sample::select(Route::ALL.to_vec())
        .prop_flat_map(|route| (Just(route), content_type(), body(route)));
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    // (route, status) → how often: printed, so a run shows what the property reached.
    let answers: Mutex<BTreeMap<String, usize>> = Mutex::default();
    let result = runner.run(&cases, |(route, content_type, body)| {
        let status = rt
            .block_on(answer_is_well_formed(&a, route, content_type, &body))
            .map_err(|e| TestCaseError::fail(format!("{e:#}")))?;
        *answers
            .lock()
            .unwrap()
            .entry(format!("{route:?} {status}"))
            .or_default() += 1;
        Ok(())
    });
    eprintln!("answers: {:?}", answers.lock().unwrap());
    if let Err(e) = result {
        panic!("{e}");
    }

    rt.block_on(async {
        let h = http::get(&a, "/healthz").await.unwrap();
        assert_eq!(h.status, 200, "{}", h.body);
        let r = http::get(&a, "/readyz").await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        // The consume routes still work.
        pull(&a, "s", &json!({"max_events": 10})).await.unwrap();
        offsets(&a, "s").await.unwrap();
    });
}
