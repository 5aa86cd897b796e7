//! Security, through the real binary: what an attacker who
//! can reach the listener but holds no token or cluster secret can make meshd hold.
//!
//! The story the first test pins: `/internal` routes checked the cluster secret in the
//! handler, after admission had taken a request slot and reserved body memory for the
//! declared `Content-Length`, and waited up to the body timeout for a body that never
//! came. 24 such requests on a `--max-requests 16` instance made an admin's request
//! answer 429. Now the gate answers them (404 outside cluster mode, 401 without the
//! secret) before admission, without reading their bodies.

mod common;

use common::disk::metric;
use common::{bin, create_subscription, create_topic, event, problem, publish, pull};
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http::{self, request_with};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::nats::NatsProcess;
use serde_json::json;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ADMIN: &str = "admin-token-abcdefghijklmnop";
const CLIENT: &str = "client-token-0123456789";

/// Connections that send a request's headers with a large `Content-Length` and never
/// its body. Returns the streams (kept open by the caller).
async fn headers_without_body(a: &str, n: usize, path: &str, extra: &str) -> Vec<TcpStream> {
    let mut held = Vec::new();
    for _ in 0..n {
        let mut s = TcpStream::connect(a).await.unwrap();
        s.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n{extra}\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        held.push(s);
    }
    held
}

/// The status line each held connection was answered with, read within `limit`
/// (the body was never sent, so an answer proves the body was not waited for).
async fn answered(held: &mut [TcpStream], limit: Duration) -> Vec<String> {
    let mut lines = Vec::new();
    for s in held.iter_mut() {
        let mut buf = vec![0u8; 2048];
        let n = tokio::time::timeout(limit, s.read(&mut buf))
            .await
            .expect("a refused request is answered before its body arrives")
            .unwrap();
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        lines.push(text.lines().next().unwrap_or_default().to_string());
    }
    lines
}

async fn admin_put_topic(a: &str, topic: &str) -> http::Response {
    let auth = format!("Bearer {ADMIN}");
    request_with(
        a,
        "PUT",
        &format!("/v1/topics/{topic}"),
        &[
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ],
        br#"{"partitions":1}"#,
    )
    .await
    .unwrap()
}

/// Cluster mode's backends (an etcd, a nats-server) and a cluster secret file in `dir`.
struct ClusterBackends {
    etcd: EtcdProcess,
    nats: NatsProcess,
    secret_file: std::path::PathBuf,
}

impl ClusterBackends {
    async fn start(dir: &std::path::Path, secret: &str) -> Self {
        let secret_file = dir.join("cluster-secret");
        std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
        Self {
            etcd: EtcdProcess::start().await.unwrap(),
            nats: NatsProcess::start().await.unwrap(),
            secret_file,
        }
    }

    /// `--meta`, `--log` and `--cluster-secret-file` of a meshd on them.
    fn args(&self) -> Vec<String> {
        vec![
            "--meta".into(),
            format!("etcd://{}", self.etcd.endpoint()),
            "--log".into(),
            self.nats.url(),
            "--cluster-secret-file".into(),
            self.secret_file.to_string_lossy().into_owned(),
        ]
    }
}

fn token_files(dir: &std::path::Path) -> (String, String) {
    let client = dir.join("client-tokens");
    let admin = dir.join("admin-tokens");
    std::fs::write(&client, format!("{CLIENT}\n")).unwrap();
    std::fs::write(&admin, format!("{ADMIN}\n")).unwrap();
    (
        client.to_str().unwrap().to_string(),
        admin.to_str().unwrap().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_requests_without_credentials_holding_their_bodies_when_they_outnumber_the_request_slots_then_they_are_refused_before_admission_and_an_admin_is_served(
) {
    let dir = tempfile::tempdir().unwrap();
    let (client, admin) = token_files(dir.path());
    let m = MeshdProcess::start(
        bin(),
        &dir.path().join("data"),
        &[
            "--client-token-file",
            &client,
            "--admin-token-file",
            &admin,
            "--max-requests",
            "16",
            "--max-long-polls",
            "8",
            "--max-body-memory",
            "8388608",
        ],
    )
    .await
    .unwrap();
    let a = m.addr();

    // Outside cluster mode every /internal path is 404 at once, routed or not...
    let mut internal = headers_without_body(a, 24, "/internal/v1/subscriptions/s/pull", "").await;
    internal.extend(headers_without_body(a, 4, "/internal/nothing-here", "").await);
    // ...and /v1 without a token (or with a wrong one) is 401 at once.
    let mut v1 = headers_without_body(a, 12, "/v1/topics/t/events", "").await;
    v1.extend(headers_without_body(a, 12, "/v1/tasks", "Authorization: Bearer wrong\r\n").await);

    // While all of them are held open, an admin is served.
    let r = admin_put_topic(a, "t").await;
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(
        metric(a, "meshd_http_requests_in_flight").await.unwrap(),
        0.0
    );
    assert_eq!(
        metric(a, "meshd_http_body_bytes_reserved").await.unwrap(),
        0.0
    );
    assert_eq!(
        metric(a, "meshd_http_shed_total{limit=\"requests\"}")
            .await
            .unwrap()
            + metric(a, "meshd_http_shed_total{limit=\"body_memory\"}")
                .await
                .unwrap(),
        0.0
    );

    for line in answered(&mut internal, Duration::from_secs(5)).await {
        assert!(line.starts_with("HTTP/1.1 404"), "{line}");
    }
    for line in answered(&mut v1, Duration::from_secs(5)).await {
        assert!(line.starts_with("HTTP/1.1 401"), "{line}");
    }
    assert_eq!(
        metric(
            a,
            "meshd_http_refused_total{reason=\"internal_not_cluster\"}"
        )
        .await
        .unwrap(),
        28.0
    );
    assert_eq!(
        metric(a, "meshd_http_refused_total{reason=\"unauthorized\"}")
            .await
            .unwrap(),
        24.0
    );
    // A refused request is a problem+json answer like any other.
    let r = request_with(a, "POST", "/internal/v1/subscriptions/s/pull", &[], b"{}")
        .await
        .unwrap();
    problem(&r, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_cluster_mode_when_internal_requests_carry_a_wrong_secret_then_they_are_refused_before_admission(
) {
    let dir = tempfile::tempdir().unwrap();
    let (client, admin) = token_files(dir.path());
    let secret = "cluster-secret-0123456789abcdef0123456789abcdef";
    let backends = ClusterBackends::start(dir.path(), secret).await;
    let mut args = backends.args();
    args.extend(
        [
            "--client-token-file",
            &client,
            "--admin-token-file",
            &admin,
            "--max-requests",
            "16",
            "--max-long-polls",
            "8",
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let m = MeshdProcess::start(bin(), &dir.path().join("data"), &args)
        .await
        .unwrap();
    let a = m.addr();

    let mut held = headers_without_body(
        a,
        24,
        "/internal/v1/subscriptions/s/pull",
        "meshd-cluster-secret: not-the-secret\r\n",
    )
    .await;
    held.extend(headers_without_body(a, 4, "/internal/v1/subscriptions/s/ack", "").await);
    let r = admin_put_topic(a, "t").await;
    assert_eq!(r.status, 201, "{}", r.body);
    for line in answered(&mut held, Duration::from_secs(5)).await {
        assert!(line.starts_with("HTTP/1.1 401"), "{line}");
    }
    assert_eq!(
        metric(
            a,
            "meshd_http_refused_total{reason=\"internal_unauthorized\"}"
        )
        .await
        .unwrap(),
        28.0
    );
    // The secret still opens the internal routes (the peers' forwarding is covered by
    // cluster_e2e): an unknown subscription is the handler's 404, not the gate's.
    let r = request_with(
        a,
        "POST",
        "/internal/v1/subscriptions/nope/pull",
        &[
            ("content-type", "application/json"),
            ("meshd-cluster-secret", secret),
        ],
        b"{}",
    )
    .await
    .unwrap();
    let p = problem(&r, 404);
    assert!(
        !p["detail"].as_str().unwrap().contains("cluster mode"),
        "{p}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_secret_shorter_than_32_bytes_then_meshd_refuses_to_start_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let backends = ClusterBackends::start(dir.path(), "short").await;
    let args = backends.args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let exited = MeshdProcess::start_expecting_exit(bin(), &dir.path().join("data"), &args)
        .await
        .unwrap();
    assert_ne!(exited.code, Some(0));
    let stderr = &exited.stderr;
    assert!(stderr.contains("--cluster-secret-file"), "{stderr}");
    assert!(stderr.contains("at least 32"), "{stderr}");
}

/// Sends `body` with exactly `headers` (plus Host when given), raw.
async fn raw(
    a: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> http::Response {
    request_with(a, method, path, headers, body).await.unwrap()
}

/// A tokenless meshd on loopback (the default): what a web page in the user's browser
/// could reach. Before these rules a page could POST a task with `mode: "no-cors"`
/// (a text/plain body) and, through DNS rebinding, read and write everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_tokenless_loopback_meshd_then_simple_cross_origin_writes_foreign_origins_and_rebound_hosts_are_refused(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(
        bin(),
        dir.path(),
        &[
            "--allowed-origins",
            "https://console.example,http://localhost:9999",
        ],
    )
    .await
    .unwrap();
    let a = m.addr();
    let own_host = a.to_string();
    let task = br#"{"agent":"planner","input":{}}"#;

    // A no-cors page: text/plain (or no content type) body, foreign Origin.
    let r = raw(
        a,
        "POST",
        "/v1/tasks",
        &[("content-type", "text/plain")],
        task,
    )
    .await;
    problem(&r, 415);
    let r = raw(a, "POST", "/v1/tasks", &[], task).await;
    problem(&r, 415);
    let r = raw(
        a,
        "POST",
        "/v1/tasks",
        &[
            ("content-type", "application/json"),
            ("origin", "http://evil.example"),
        ],
        task,
    )
    .await;
    problem(&r, 403);
    // DNS rebinding: the page's origin is its own, Host its own name.
    let r = raw(
        a,
        "GET",
        "/v1/tasks",
        &[
            ("host", "evil.example:7070"),
            ("origin", "http://evil.example:7070"),
        ],
        b"",
    )
    .await;
    problem(&r, 403);
    let r = raw(a, "GET", "/metrics", &[("host", "evil.example")], b"").await;
    problem(&r, 403);
    // Nothing was stored.
    let r = raw(a, "GET", "/v1/tasks", &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.json().unwrap()["tasks"],
        serde_json::json!([]),
        "{}",
        r.body
    );

    // What keeps working: JSON writes, the own origin, listed origins (with CORS),
    // binary-mode publishes of any content type, bodiless writes.
    let own_origin = format!("http://{own_host}");
    let r = raw(
        a,
        "POST",
        "/v1/tasks",
        &[
            ("content-type", "application/json"),
            ("origin", &own_origin),
        ],
        task,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json().unwrap()["id"].as_str().unwrap().to_string();
    let r = raw(a, "POST", &format!("/v1/tasks/{id}/cancel"), &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = raw(
        a,
        "OPTIONS",
        "/v1/tasks",
        &[
            ("origin", "https://console.example"),
            ("access-control-request-method", "POST"),
            (
                "access-control-request-headers",
                "authorization, content-type",
            ),
        ],
        b"",
    )
    .await;
    assert_eq!(r.status, 204, "{}", r.body);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://console.example")
    );
    assert_eq!(
        r.header("access-control-allow-headers"),
        Some("authorization, content-type")
    );
    let r = raw(
        a,
        "POST",
        "/v1/tasks",
        &[
            ("content-type", "application/json"),
            ("origin", "https://console.example"),
        ],
        task,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://console.example")
    );
    let r = raw(
        a,
        "PUT",
        "/v1/topics/t",
        &[("content-type", "application/json")],
        br#"{"partitions":1}"#,
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let r = raw(
        a,
        "POST",
        "/v1/topics/t/events",
        &[
            ("content-type", "text/plain"),
            ("ce-specversion", "1.0"),
            ("ce-id", "b-1"),
            ("ce-source", "/s"),
            ("ce-type", "t"),
        ],
        b"plain text data",
    )
    .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let r = raw(a, "GET", "/v1/topics", &[("host", "localhost")], b"").await;
    assert_eq!(r.status, 200, "{}", r.body);

    for (reason, n) in [("content_type", 2.0), ("origin", 1.0), ("host", 2.0)] {
        assert_eq!(
            metric(
                a,
                &format!("meshd_http_refused_total{{reason=\"{reason}\"}}")
            )
            .await
            .unwrap(),
            n,
            "{reason}"
        );
    }
}

/// A page of another site on a tokenless meshd: a no-cors `fetch` sends no `Origin`
/// and may ask for `text/event-stream`, so before the Fetch Metadata rule it opened a
/// stream that leased events to nobody (they ended dead-lettered after their ack
/// timeouts). A browser says where a request comes from in `Sec-Fetch-Site`; a
/// `cross-site` or `same-site` one is 403 unless its `Origin` is listed, and nothing
/// is leased. Requests without the header (curl, SDKs), `same-origin` (the console)
/// and `none` (typed in the address bar) are served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_tokenless_meshd_when_a_page_of_another_site_fetches_without_an_origin_then_it_is_refused_and_nothing_is_leased(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(
        bin(),
        dir.path(),
        &["--allowed-origins", "https://console.example"],
    )
    .await
    .unwrap();
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t", "start": "earliest"})).await;
    publish(a, "t", &event("e1")).await.unwrap();

    for site in ["cross-site", "same-site", "Cross-Site"] {
        let stream = tokio::time::timeout(
            Duration::from_secs(10),
            raw(
                a,
                "GET",
                "/v1/subscriptions/s/stream",
                &[("accept", "text/event-stream"), ("sec-fetch-site", site)],
                b"",
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("a {site} stream request was served (a stream opened)"));
        let p = problem(&stream, 403);
        assert!(
            p["detail"].as_str().unwrap().contains("Sec-Fetch-Site"),
            "{p}"
        );
        let r = raw(a, "GET", "/v1/topics", &[("sec-fetch-site", site)], b"").await;
        problem(&r, 403);
    }
    // Nothing was leased: the event is still there for the first pull.
    let got = pull(a, "s", &json!({"max_events": 10})).await.unwrap();
    assert_eq!(got.len(), 1, "a refused stream leased the event");
    assert_eq!(got[0].attempt, 1);
    // A listed origin may read cross-site (with CORS); other clients are unaffected.
    let r = raw(
        a,
        "GET",
        "/v1/topics",
        &[
            ("sec-fetch-site", "cross-site"),
            ("origin", "https://console.example"),
        ],
        b"",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("https://console.example")
    );
    for site in [None, Some("same-origin"), Some("none")] {
        let headers: Vec<(&str, &str)> = site.map(|s| ("sec-fetch-site", s)).into_iter().collect();
        let r = raw(a, "GET", "/v1/topics", &headers, b"").await;
        assert_eq!(r.status, 200, "{site:?}: {}", r.body);
    }
    // The console page itself (not /v1) loads from anywhere.
    let r = raw(a, "GET", "/", &[("sec-fetch-site", "cross-site")], b"").await;
    assert_ne!(r.status, 403, "{}", r.body);
    assert_eq!(
        metric(a, "meshd_http_refused_total{reason=\"fetch_site\"}")
            .await
            .unwrap(),
        6.0
    );
}

/// With tokens the Host check is off (a rebinding page has no token), the Origin and
/// content-type rules stay; `/internal` is exempt from all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_tokens_then_other_host_names_are_served_and_metrics_need_a_metrics_or_admin_token() {
    let dir = tempfile::tempdir().unwrap();
    let (client, admin) = token_files(dir.path());
    let metrics_file = dir.path().join("metrics-tokens");
    std::fs::write(&metrics_file, "scraper-token-0123456789\n").unwrap();
    let m = MeshdProcess::start(
        bin(),
        &dir.path().join("data"),
        &[
            "--client-token-file",
            &client,
            "--admin-token-file",
            &admin,
            "--metrics-token-file",
            metrics_file.to_str().unwrap(),
        ],
    )
    .await
    .unwrap();
    let a = m.addr();
    let admin_auth = format!("Bearer {ADMIN}");
    let client_auth = format!("Bearer {CLIENT}");
    let r = raw(
        a,
        "GET",
        "/v1/topics",
        &[
            ("host", "meshd.example:7070"),
            ("authorization", &admin_auth),
        ],
        b"",
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = raw(
        a,
        "POST",
        "/v1/tasks",
        &[
            ("content-type", "text/plain"),
            ("authorization", &client_auth),
        ],
        br#"{"agent":"a","input":{}}"#,
    )
    .await;
    problem(&r, 415);

    problem(&raw(a, "GET", "/metrics", &[], b"").await, 401);
    problem(
        &raw(
            a,
            "GET",
            "/metrics",
            &[("authorization", &client_auth)],
            b"",
        )
        .await,
        403,
    );
    for auth in ["Bearer scraper-token-0123456789", admin_auth.as_str()] {
        let r = raw(a, "GET", "/metrics", &[("authorization", auth)], b"").await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.body.contains("meshd_http_refused_total"), "{}", r.body);
    }
    // A metrics token opens nothing else.
    problem(
        &raw(
            a,
            "GET",
            "/v1/topics",
            &[("authorization", "Bearer scraper-token-0123456789")],
            b"",
        )
        .await,
        403,
    );
    for open in ["/healthz", "/readyz"] {
        assert_eq!(raw(a, "GET", open, &[], b"").await.status, 200, "{open}");
    }

    // The CLI reads its token from a file (a --token flag shows in `ps`).
    let token_file = dir.path().join("cli-token");
    std::fs::write(&token_file, format!("\n{ADMIN}\n")).unwrap();
    let server = format!("http://{a}");
    let out = tokio::process::Command::new(bin())
        .args(["topic", "list", "--server", &server, "--token-file"])
        .arg(&token_file)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&token_file, "wrong-token\n").unwrap();
    let out = tokio::process::Command::new(bin())
        .args(["topic", "list", "--server", &server, "--token-file"])
        .arg(&token_file)
        .output()
        .await
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("wrong-token"),
        "the CLI printed its token"
    );
}

/// The story: a push subscription whose URL was etcd's v3 gateway and an event whose
/// data was an etcd put request wrote a key into the etcd meshd itself uses. Push now
/// refuses meshd's own services, link-local and operator-denied addresses: a literal
/// address at `PUT` (400), a name at every connect (the attempts fail naming the rule,
/// and the event is dead-lettered), and nothing reaches etcd.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_push_urls_aimed_at_meshds_own_backends_then_they_are_refused_and_nothing_reaches_etcd(
) {
    use common::{create_subscription, create_topic, dead_letters, problem_naming, publish};
    use meshd_test_support::http::send_json;
    use serde_json::json;

    let etcd = EtcdProcess::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let etcd_url = format!("etcd://{}", etcd.endpoint());
    let m = MeshdProcess::start(
        bin(),
        dir.path(),
        &["--meta", &etcd_url, "--push-deny-cidr", "192.0.2.0/24"],
    )
    .await
    .unwrap();
    let a = m.addr();
    let etcd_port = etcd.client_port();
    create_topic(a, "t", 1).await;

    // The vector is real: etcd's gateway takes a JSON put from plain HTTP.
    // etcd's gateway takes keys and values in base64.
    let b64 = |s: &str| match s {
        "control" => "Y29udHJvbA==",
        "x" => "eA==",
        "planted" => "cGxhbnRlZA==",
        "owned" => "b3duZWQ=",
        other => panic!("no base64 for {other}"),
    };
    let gateway = format!("127.0.0.1:{etcd_port}");
    let r = send_json(
        &gateway,
        "POST",
        "/v3/kv/put",
        &json!({"key": b64("control"), "value": b64("x")}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);

    // Literal addresses: refused at PUT, naming push.url and why.
    for (url, why) in [
        (
            format!("http://127.0.0.1:{etcd_port}/v3/kv/put"),
            "Meta (etcd)",
        ),
        (
            format!("http://127.0.0.2:{etcd_port}/v3/kv/put"),
            "Meta (etcd)",
        ),
        (format!("http://{a}/v1/topics/t/events"), "listen address"),
        (
            "http://169.254.169.254/latest/meta-data".to_string(),
            "link-local",
        ),
        (
            "http://192.0.2.10:8080/hook".to_string(),
            "--push-deny-cidr",
        ),
        // Literals in the forms the resolver reads too (127.1, one 32-bit number,
        // hexadecimal, octal): the same addresses, refused alike.
        (format!("http://127.1:{etcd_port}/v3/kv/put"), "Meta (etcd)"),
        (
            format!("http://2130706433:{etcd_port}/v3/kv/put"),
            "Meta (etcd)",
        ),
        (
            format!("http://0x7f000001:{etcd_port}/v3/kv/put"),
            "Meta (etcd)",
        ),
        (
            "http://0251.0376.0251.0376/latest/meta-data".to_string(),
            "link-local",
        ),
    ] {
        let r = send_json(
            a,
            "PUT",
            "/v1/subscriptions/literal",
            &json!({"topic": "t", "push": {"url": url}}),
        )
        .await
        .unwrap();
        let p = problem_naming(&r, "push.url");
        assert!(p["detail"].as_str().unwrap().contains(why), "{url}: {p}");
    }

    // A name that resolves to etcd: accepted at PUT, refused at every connect.
    create_subscription(
        a,
        "sneaky",
        json!({
            "topic": "t",
            "max_attempts": 2,
            "ack_timeout_ms": 1000,
            "backoff": {"initial_ms": 10, "max_ms": 10},
            "push": {"url": format!("http://localhost:{etcd_port}/v3/kv/put")}
        }),
    )
    .await;
    let event = json!({
        "specversion": "1.0", "id": "plant-1", "source": "/attacker", "type": "put",
        "datacontenttype": "application/json",
        "data": {"key": b64("planted"), "value": b64("owned")}
    });
    publish(a, "t", &event).await.unwrap();
    let entry = meshd_test_support::wait::wait_until(
        Duration::from_secs(20),
        "the event dead-lettered after its refused attempts",
        || async {
            let entries = dead_letters(a, "sneaky").await;
            anyhow::ensure!(entries.len() == 1, "{entries:?}");
            Ok(entries[0].clone())
        },
    )
    .await
    .unwrap();
    let reason = entry["reason"].as_str().unwrap();
    assert!(
        reason.contains("refused by the push address rules") && reason.contains("Meta (etcd)"),
        "{entry}"
    );
    assert_eq!(entry["attempts"], 2, "{entry}");
    let r = send_json(
        &gateway,
        "POST",
        "/v3/kv/range",
        &json!({"key": b64("planted")}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(
        r.json().unwrap().get("kvs").is_none(),
        "a key was planted: {}",
        r.body
    );
}
