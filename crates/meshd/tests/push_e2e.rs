//! Push delivery through the real binary: a subscription with `push.url` gets each
//! event POSTed in CloudEvents binary mode with `meshd-delivery-attempt`; 2xx acks it,
//! anything else is a failed attempt whose reason is recorded and that goes through the
//! same retry / dead-letter path as a pull. The endpoint is a tiny HTTP server inside
//! the test that answers with scripted statuses and records what it received.

mod common;

use common::webhook::{endpoint, endpoint_with};
use common::*;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

const DEADLINE: Duration = Duration::from_secs(30);

/// A TLS acceptor with the test server certificate (for 127.0.0.1).
fn tls_acceptor(certs: &meshd_test_support::certs::TestCerts) -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&certs.server_cert)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(&certs.server_key).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// A port that was free a moment ago: nothing listens there.
async fn nothing_listening() -> std::net::SocketAddr {
    let free = TcpListener::bind("127.0.0.1:0").await.unwrap();
    free.local_addr().unwrap()
}

/// Waits for the one dead letter of subscription `sub` (exactly one, bounded).
async fn the_dead_letter(a: &str, sub: &str) -> Value {
    let mut entries = wait_until(DEADLINE, "a dead letter", || async {
        let e = dead_letters(a, sub).await;
        anyhow::ensure!(e.len() == 1, "{e:?}");
        Ok(e)
    })
    .await
    .unwrap();
    entries.remove(0)
}

fn push_subscription(topic: &str, url: &str) -> Value {
    json!({"topic": topic, "max_attempts": 3, "ack_timeout_ms": 5000,
           "backoff": {"initial_ms": 1, "max_ms": 5}, "push": {"url": url}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_push_endpoint_answering_500_three_times_then_the_event_is_dead_lettered_with_the_status_in_the_reason(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let hook = endpoint(vec![500]).await;
    create_topic(a, "t", 1).await;
    create_subscription(a, "p", push_subscription("t", &hook.url)).await;
    let e = event("poison");
    publish(a, "t", &e).await.unwrap();

    let entry = the_dead_letter(a, "p").await;
    assert_eq!(entry["attempts"], 3, "{entry}");
    assert!(
        entry["reason"].as_str().is_some_and(|r| r.contains("500")),
        "the status is in the reason: {entry}"
    );
    assert_eq!(entry["event"], e, "{entry}");
    let got = hook.received.lock().unwrap().clone();
    let attempts: Vec<&str> = got
        .iter()
        .map(|r| {
            r.headers
                .get("meshd-delivery-attempt")
                .map(String::as_str)
                .unwrap_or("")
        })
        .collect();
    assert_eq!(
        attempts,
        vec!["1", "2", "3"],
        "exactly max_attempts deliveries: {got:?}"
    );
    // Binary mode: attributes in ce- headers, the data as the body.
    let first = &got[0];
    assert_eq!(
        first.headers.get("ce-id").map(String::as_str),
        Some("poison")
    );
    assert_eq!(
        first.headers.get("ce-specversion").map(String::as_str),
        Some("1.0")
    );
    assert_eq!(
        first.headers.get("ce-type").map(String::as_str),
        Some("test.consumed")
    );
    let data: Value = serde_json::from_slice(&first.body).unwrap();
    assert_eq!(data, e["data"]);
    wait_committed(a, "p", 0, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_push_endpoint_that_fails_once_then_answers_204_then_the_event_is_acked_on_attempt_2(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let hook = endpoint(vec![503, 204]).await;
    create_topic(a, "t", 1).await;
    create_subscription(a, "p", push_subscription("t", &hook.url)).await;
    for i in 0..3 {
        publish(a, "t", &event(&format!("e{i}"))).await.unwrap();
    }
    wait_committed(a, "p", 0, 3).await;
    let got = hook.received.lock().unwrap().clone();
    assert_eq!(
        got.len(),
        4,
        "one failure, then each of the three once: {got:?}"
    );
    let retried: Vec<&str> = got
        .iter()
        .filter(|r| r.headers.get("meshd-delivery-attempt").map(String::as_str) == Some("2"))
        .filter_map(|r| r.headers.get("ce-id").map(String::as_str))
        .collect();
    assert_eq!(
        retried.len(),
        1,
        "the failed one came back with attempt 2: {got:?}"
    );
    assert!(dead_letters(a, "p").await.is_empty());
}

/// A credential in the push URL's query stays out of what an operator (or the
/// console) reads: the dead-letter reason, meshd's log and its metrics show the target
/// as `scheme://host:port/path` (http-api.md, "Security rules (third round)").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_push_url_with_a_credential_in_its_query_then_reasons_logs_and_metrics_never_show_it(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let at = nothing_listening().await;
    let url = format!("http://{at}/hook?apikey=S3CRET-KEY");
    create_topic(a, "t", 1).await;
    create_subscription(a, "p", push_subscription("t", &url)).await;
    publish(a, "t", &event("nobody-home")).await.unwrap();
    let entry = the_dead_letter(a, "p").await;
    let reason = entry["reason"].as_str().unwrap_or_default().to_string();
    assert!(
        reason.contains(&format!("http://{at}/hook")) && !reason.contains("S3CRET"),
        "the reason names the target without its query: {reason}"
    );
    let metrics = client(a).metrics().await.unwrap();
    assert!(!metrics.contains("S3CRET"), "metrics show the credential");
    let log = std::fs::read_to_string(m.log_path()).unwrap();
    assert!(
        !log.contains("S3CRET"),
        "the log shows the credential: {}",
        log.lines()
            .filter(|l| l.contains("S3CRET"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_push_endpoint_that_refuses_connections_then_the_reason_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let url = format!("http://{}/hook", nothing_listening().await);
    create_topic(a, "t", 1).await;
    create_subscription(a, "p", push_subscription("t", &url)).await;
    publish(a, "t", &event("nobody-home")).await.unwrap();
    let entry = the_dead_letter(a, "p").await;
    assert!(
        entry["reason"]
            .as_str()
            .is_some_and(|r| r.contains("connection")),
        "{}",
        entry
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_https_push_endpoint_whose_certificate_the_push_ca_signed_then_every_event_is_pushed_over_tls(
) {
    let dir = tempfile::tempdir().unwrap();
    let certs = meshd_test_support::certs::TestCerts::generate(&dir.path().join("pki")).unwrap();
    let m = meshd_test_support::meshd::MeshdProcess::start(
        bin(),
        &dir.path().join("data"),
        &["--push-ca-file", certs.ca.to_str().unwrap()],
    )
    .await
    .unwrap();
    let a = m.addr();
    let hook = endpoint_with(vec![200], Some(tls_acceptor(&certs)), Duration::ZERO).await;
    assert!(hook.url.starts_with("https://"));
    create_topic(a, "t", 1).await;
    create_subscription(a, "p", push_subscription("t", &hook.url)).await;
    for i in 0..3 {
        publish(a, "t", &event(&format!("s{i}"))).await.unwrap();
    }
    wait_committed(a, "p", 0, 3).await;
    let got = hook.received.lock().unwrap().clone();
    // Pushes run concurrently (up to 16 per subscription): any order, each once.
    let mut ids: Vec<&str> = got
        .iter()
        .filter_map(|r| r.headers.get("ce-id").map(String::as_str))
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, ["s0", "s1", "s2"], "{got:?}");
    assert!(dead_letters(a, "p").await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_https_push_endpoint_with_a_certificate_meshd_does_not_trust_then_nothing_reaches_it_and_the_dead_letter_says_why(
) {
    let dir = tempfile::tempdir().unwrap();
    let certs = meshd_test_support::certs::TestCerts::generate(&dir.path().join("pki")).unwrap();
    // meshd trusts the system's CAs only; the endpoint's CA is not among them.
    let m = start(&dir.path().join("data")).await;
    let a = m.addr();
    let hook = endpoint_with(vec![200], Some(tls_acceptor(&certs)), Duration::ZERO).await;
    create_topic(a, "t", 1).await;
    create_subscription(a, "p", push_subscription("t", &hook.url)).await;
    publish(a, "t", &event("untrusted")).await.unwrap();
    let entry = the_dead_letter(a, "p").await;
    let reason = entry["reason"].as_str().unwrap_or_default().to_string();
    assert!(
        reason.contains("TLS") || reason.contains("https push without a CA"),
        "{reason}"
    );
    assert!(
        hook.received.lock().unwrap().is_empty(),
        "nothing is sent to an endpoint that is not trusted"
    );
}
