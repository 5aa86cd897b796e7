//! Access control through the real binary (http-api.md "Access"): with token files,
//! every `/v1` route needs a bearer token, a client token on an admin route is 403,
//! health, readiness and metrics stay open, every line of a token file is valid, the
//! tokens never reach the log, and without token files meshd refuses a non-loopback
//! listen address unless `--insecure-listen`.

mod common;

use common::{bin, problem};
use meshd_test_support::http::{self, request_with};
use meshd_test_support::meshd::MeshdProcess;

const CLIENT_OLD: &str = "client-token-old-0123456789";
const CLIENT_NEW: &str = "client-token-new-9876543210";
const ADMIN: &str = "admin-token-abcdefghijklmnop";

async fn call(
    addr: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> http::Response {
    let auth = token.map(|t| format!("Bearer {t}"));
    let ct = if path.ends_with("/events") {
        "application/cloudevents+json"
    } else {
        "application/json"
    };
    let mut headers = vec![("content-type", ct)];
    if let Some(a) = &auth {
        headers.push(("authorization", a.as_str()));
    }
    request_with(addr, method, path, &headers, body.as_bytes())
        .await
        .expect("request")
}

/// meshd with a client token file holding `client` and an admin token file holding
/// [`ADMIN`], its data and the files in `dir`.
async fn start_with_token_files(dir: &std::path::Path, client: &str) -> MeshdProcess {
    let client_file = dir.join("client-tokens");
    let admin_file = dir.join("admin-tokens");
    std::fs::write(&client_file, client).unwrap();
    std::fs::write(&admin_file, format!("{ADMIN}\n")).unwrap();
    MeshdProcess::start(
        bin(),
        &dir.join("data"),
        &[
            "--client-token-file",
            client_file.to_str().unwrap(),
            "--admin-token-file",
            admin_file.to_str().unwrap(),
        ],
    )
    .await
    .expect("start meshd with token files")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_token_files_then_routes_need_the_right_token_and_health_stays_open() {
    let dir = tempfile::tempdir().unwrap();
    // Two client tokens (rotation), padded with whitespace and a blank line.
    let m =
        start_with_token_files(dir.path(), &format!("  {CLIENT_OLD}  \n\n{CLIENT_NEW}\n")).await;
    let a = m.addr();

    for open in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(http::get(a, open).await.unwrap().status, 200, "{open}");
    }

    // Admin routes: nothing without a token, wrong token or client token.
    let topic = r#"{"partitions":1}"#;
    problem(&call(a, "PUT", "/v1/topics/orders", None, topic).await, 401);
    let r = call(a, "PUT", "/v1/topics/orders", Some("nope"), topic).await;
    problem(&r, 401);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    problem(
        &call(a, "PUT", "/v1/topics/orders", Some(CLIENT_OLD), topic).await,
        403,
    );
    // Refused requests changed nothing.
    let r = call(a, "GET", "/v1/topics", Some(ADMIN), "").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json().unwrap()["topics"], serde_json::json!([]));
    let r = call(a, "PUT", "/v1/topics/orders", Some(ADMIN), topic).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let r = call(
        a,
        "PUT",
        "/v1/subscriptions/audit",
        Some(ADMIN),
        r#"{"topic":"orders"}"#,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);

    // Client routes: either client token (and the admin token) works.
    let event = r#"{"specversion":"1.0","id":"e1","source":"/t","type":"t"}"#;
    problem(
        &call(a, "POST", "/v1/topics/orders/events", None, event).await,
        401,
    );
    // Two events (one id each: the same event twice would be one, deduplicated).
    for (token, id) in [(CLIENT_OLD, "e1"), (CLIENT_NEW, "e2")] {
        let event = event.replace("\"e1\"", &format!("\"{id}\""));
        let r = call(a, "POST", "/v1/topics/orders/events", Some(token), &event).await;
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let r = call(
        a,
        "POST",
        "/v1/subscriptions/audit/pull",
        Some(CLIENT_NEW),
        r#"{"max_events":10}"#,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let deliveries = r.json().unwrap()["deliveries"].as_array().unwrap().len();
    assert_eq!(deliveries, 2);
    // A client may not reset offsets or read the dead letters.
    problem(
        &call(
            a,
            "PUT",
            "/v1/subscriptions/audit/offsets/0",
            Some(CLIENT_OLD),
            r#"{"offset":0}"#,
        )
        .await,
        403,
    );
    problem(
        &call(a, "GET", "/v1/deadletters", Some(CLIENT_OLD), "").await,
        403,
    );
    assert_eq!(
        call(a, "GET", "/v1/deadletters", Some(ADMIN), "")
            .await
            .status,
        200
    );

    // No token ever reaches the log.
    let log = m.log_tail(10_000);
    for t in [CLIENT_OLD, CLIENT_NEW, ADMIN, "nope"] {
        assert!(!log.contains(t), "token {t} in the log:\n{log}");
    }
}

/// The route table decides who may call what; a path no route has, and a method a
/// route does not take, answer only a caller its group's gate let in: an unknown
/// `/v1` path needs the admin token (a client token learns nothing of the admin
/// routes), and an unknown method is 405 once the route's token was presented.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_token_files_then_unknown_paths_and_methods_answer_only_behind_the_gate() {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with_token_files(dir.path(), &format!("{CLIENT_NEW}\n")).await;
    let a = m.addr();
    for path in [
        "/v1/",
        "/v1/nope",
        "/v1/sessions/s/nope",
        "/v1/topics/t/x/y/z",
    ] {
        problem(&call(a, "GET", path, None, "").await, 401);
        problem(&call(a, "GET", path, Some(CLIENT_NEW), "").await, 403);
        problem(&call(a, "GET", path, Some(ADMIN), "").await, 404);
    }
    // A client route with a method it does not take.
    let events = "/v1/topics/t/events";
    problem(&call(a, "DELETE", events, None, "").await, 401);
    problem(&call(a, "DELETE", events, Some(CLIENT_NEW), "").await, 405);
    // An admin route with a method it does not take.
    problem(
        &call(a, "POST", "/v1/cluster", Some(CLIENT_NEW), "{}").await,
        403,
    );
    problem(
        &call(a, "POST", "/v1/cluster", Some(ADMIN), "{}").await,
        405,
    );
    // Outside cluster mode every /internal path is 404, whatever it names.
    for path in [
        "/internal",
        "/internal/v1/deadletters/x/redrive",
        "/internal/nope",
    ] {
        problem(&call(a, "POST", path, None, "").await, 404);
    }
    // Other unknown paths need no token.
    problem(&call(a, "GET", "/nope", None, "").await, 404);
    // The probes take GET only.
    assert_eq!(call(a, "POST", "/healthz", None, "").await.status, 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tokens_a_non_loopback_listen_is_refused_and_an_empty_token_file_too() {
    let dir = tempfile::tempdir().unwrap();
    // (start_expecting_exit passes its own loopback --listen: run the binary here.)
    let out = std::process::Command::new(bin())
        .args(["serve", "--listen", "0.0.0.0:0", "--data-dir"])
        .arg(dir.path().join("a"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0));
    assert!(stderr.contains("--insecure-listen"), "{stderr}");
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n  \n").unwrap();
    let out = MeshdProcess::start_expecting_exit(
        bin(),
        &dir.path().join("b"),
        &["--client-token-file", empty.to_str().unwrap()],
    )
    .await
    .unwrap();
    assert_ne!(out.code, Some(0));
    assert!(out.stderr.contains("holds no token"), "{}", out.stderr);
}
