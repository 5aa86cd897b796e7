//! Overload through the real binary: slow clients are cut off by the configured
//! timeouts, the connection and long-poll caps hold, and a flood of publishers with a
//! slow consumer is shed with 429 + `Retry-After` while meshd's memory stays bounded
//! and every event answered 201 is delivered.

mod common;

use common::{ack, bin, create_subscription, create_topic, current_rss, ids, problem, pull};
use futures::StreamExt;
use meshd_test_support::http::{self, request_with, send_json};
use meshd_test_support::meshd::MeshdProcess;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the server closes the connection (or `limit` passes); returns what
/// arrived and whether it closed.
async fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (String, bool) {
    let mut raw = Vec::new();
    let closed = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 4096];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => raw.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .is_ok();
    (String::from_utf8_lossy(&raw).into_owned(), closed)
}

async fn metric(a: &str, sample: &str) -> u64 {
    http::metric(a, sample.trim_end())
        .await
        .unwrap_or_else(|e| panic!("{e}")) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_slow_clients_then_trickled_headers_and_bodies_and_idle_connections_are_closed_by_their_timeouts(
) {
    let dir = tempfile::tempdir().unwrap();
    let meshd = MeshdProcess::start(
        bin(),
        dir.path(),
        &[
            "--header-timeout-ms",
            "500",
            "--body-timeout-ms",
            "500",
            // Far above the others: what closes a connection below is never idleness.
            "--idle-timeout-ms",
            "600000",
        ],
    )
    .await
    .unwrap();
    let a = meshd.addr().to_string();
    create_topic(&a, "slow", 1).await;
    create_subscription(&a, "slow-sub", json!({"topic": "slow"})).await;

    // A connection that sends nothing at all (no protocol chosen yet): closed by the
    // header timeout, not kept for the idle timeout.
    let mut s = TcpStream::connect(&a).await.unwrap();
    let (got, closed) = read_until_closed(&mut s, Duration::from_secs(20)).await;
    assert!(
        closed && got.is_empty(),
        "a silent connection stayed open: {got:?}"
    );

    // An HTTP/2 request whose body (no Content-Length) never finishes: 408, and it
    // held no request slot beyond the body timeout.
    let tcp = TcpStream::connect(&a).await.unwrap();
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let first: Result<_, std::convert::Infallible> = Ok(hyper::body::Frame::data(
        hyper::body::Bytes::from_static(b"{\"specversion\""),
    ));
    let trickle = futures::stream::iter([first]).chain(futures::stream::pending());
    let req = hyper::Request::post(format!("http://{a}/v1/topics/slow/events"))
        .header("content-type", "application/cloudevents+json")
        .body(http_body_util::StreamBody::new(trickle))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(20), h2.send_request(req))
        .await
        .expect("an answer within the body timeout")
        .unwrap();
    assert_eq!(resp.status(), 408);

    // Headers that never finish: closed without an answer.
    let mut s = TcpStream::connect(&a).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .unwrap();
    let (got, closed) = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert!(closed, "a connection trickling its headers stayed open");
    assert!(!got.contains(" 200 "), "{got}");

    // A body that never finishes: 408, nothing published.
    let mut s = TcpStream::connect(&a).await.unwrap();
    s.write_all(
        b"POST /v1/topics/slow/events HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/cloudevents+json\r\nContent-Length: 200\r\n\r\n{\"specversion\"",
    )
    .await
    .unwrap();
    let (got, closed) = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert!(closed, "a connection trickling its body stayed open");
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("application/problem+json"), "{got}");
    assert_eq!(common::end_offsets(&a, "slow").await, vec![0]);

    assert!(metric(&a, &closed_by("header_timeout")).await >= 1);
    assert!(metric(&a, "meshd_http_body_timeouts_total ").await >= 1);
    drop(meshd);

    // Idle connections, with a header timeout longer than the idle timeout (a quiet
    // keep-alive connection is otherwise closed by the header timer first).
    let meshd = MeshdProcess::start(
        bin(),
        dir.path(),
        &["--header-timeout-ms", "20000", "--idle-timeout-ms", "1500"],
    )
    .await
    .unwrap();
    let a = meshd.addr().to_string();
    // A keep-alive connection that goes quiet after its answer is closed.
    let mut s = TcpStream::connect(&a).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let (got, closed) = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(closed, "an idle keep-alive connection stayed open");

    // A long poll answers (empty) before its connection counts as idle.
    let started = Instant::now();
    let r = send_json(
        &a,
        "POST",
        "/v1/subscriptions/slow-sub/pull",
        &json!({"wait_ms": 30000}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json().unwrap()["deliveries"], json!([]));
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );

    assert!(metric(&a, &closed_by("idle_timeout")).await >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_the_connection_and_long_poll_caps_when_clients_exceed_them_then_excess_connections_wait_and_excess_long_polls_get_429(
) {
    let dir = tempfile::tempdir().unwrap();
    let meshd = MeshdProcess::start(
        bin(),
        dir.path(),
        &["--max-connections", "4", "--max-long-polls", "2"],
    )
    .await
    .unwrap();
    let a = meshd.addr().to_string();
    create_topic(&a, "quiet", 1).await;
    create_subscription(&a, "waiting", json!({"topic": "quiet"})).await;

    // Two long polls wait; a third is refused at once with 429 and Retry-After.
    let polls: Vec<_> = (0..2)
        .map(|_| {
            let a = a.clone();
            tokio::spawn(async move {
                http::request(
                    &a,
                    "POST",
                    "/v1/subscriptions/waiting/pull",
                    Some(r#"{"wait_ms": 5000}"#),
                    Duration::from_secs(20),
                )
                .await
            })
        })
        .collect();
    meshd_test_support::wait::wait_until(
        Duration::from_secs(10),
        "two long polls waiting",
        || async {
            anyhow::ensure!(metric(&a, "meshd_http_long_polls ").await == 2);
            Ok(())
        },
    )
    .await
    .unwrap();
    let r = send_json(
        &a,
        "POST",
        "/v1/subscriptions/waiting/pull",
        &json!({"wait_ms": 5000}),
    )
    .await
    .unwrap();
    problem(&r, 429);
    assert!(r.header("retry-after").is_some(), "{:?}", r.headers);
    // A pull that does not wait still gets through.
    let r = send_json(&a, "POST", "/v1/subscriptions/waiting/pull", &json!({}))
        .await
        .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    for p in polls {
        assert_eq!(p.await.unwrap().unwrap().status, 200);
    }
    assert_eq!(
        metric(&a, "meshd_http_shed_total{limit=\"long_polls\"} ").await,
        1
    );

    // Four keep-alive connections take every slot...
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(&a).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .expect("a connection under the cap is served")
            .unwrap();
        assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
        held.push(s);
    }
    // ...so a fifth waits in the backlog, unserved...
    let mut fifth = TcpStream::connect(&a).await.unwrap();
    fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    assert!(
        tokio::time::timeout(Duration::from_secs(1), fifth.read(&mut buf))
            .await
            .is_err(),
        "a connection over the cap was served"
    );
    // ...until one closes.
    drop(held.pop());
    let (got, _) = read_until_closed(&mut fifth, Duration::from_secs(10)).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    drop(held);
    assert!(metric(&a, "meshd_http_connection_cap_reached_total ").await >= 1);
}

fn closed_by(reason: &str) -> String {
    format!("meshd_http_connections_closed_total{{reason=\"{reason}\"}} ")
}

/// The peak resident set of a process, in bytes (`VmHWM`).
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .expect("VmHWM")
}

const MIB: u64 = 1024 * 1024;
const PUBLISHERS: usize = 96;
const BATCH: usize = 1000;
const FLOOD: Duration = Duration::from_secs(8);
/// --max-body-memory of the flood test.
const BODY_BUDGET: u64 = 16 * MIB;
/// What meshd may add over its resident set before the flood. The body budget,
/// parsing (a batch is parsed into events, ~3x its bytes), RocksDB memtables and the
/// consumer's read-ahead fit in it; the flood itself offers PUBLISHERS x ~4 MiB
/// bodies at every moment, more than this before any parsing, so unbounded
/// buffering would not.
const GROWTH_BOUND: u64 = 320 * MIB;

fn batch_body(publisher: usize, round: u64) -> (String, Vec<String>) {
    let filler = "x".repeat(4000);
    let mut ids = Vec::with_capacity(BATCH);
    let mut events = Vec::with_capacity(BATCH);
    for i in 0..BATCH {
        let id = format!("p{publisher}-r{round}-e{i}");
        events.push(json!({
            "specversion": "1.0", "id": id, "source": "/flood", "type": "flood.v1",
            "data": {"fill": filler}
        }));
        ids.push(id);
    }
    (Value::Array(events).to_string(), ids)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_flood_of_publishers_and_a_slow_consumer_then_excess_is_shed_with_429_memory_stays_bounded_and_every_201_is_delivered(
) {
    let dir = tempfile::tempdir().unwrap();
    let budget = BODY_BUDGET.to_string();
    let meshd = MeshdProcess::start(
        bin(),
        dir.path(),
        &[
            "--max-requests",
            "32",
            "--max-long-polls",
            "8",
            "--max-body-memory",
            &budget,
        ],
    )
    .await
    .unwrap();
    let a = meshd.addr().to_string();
    let pid = meshd.pid().unwrap();
    create_topic(&a, "flood", 4).await;
    create_subscription(
        &a,
        "slow",
        json!({"topic": "flood", "ack_timeout_ms": 60000}),
    )
    .await;
    let before = current_rss(pid);

    let accepted: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let shed = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut publishers = Vec::new();
    for p in 0..PUBLISHERS {
        let (a, accepted, shed, stop) = (a.clone(), accepted.clone(), shed.clone(), stop.clone());
        publishers.push(tokio::spawn(async move {
            let mut round = 0;
            while !stop.load(Ordering::Relaxed) {
                round += 1;
                let (body, ids) = batch_body(p, round);
                let r = request_with(
                    &a,
                    "POST",
                    "/v1/topics/flood/events",
                    &[("Content-Type", "application/cloudevents-batch+json")],
                    body.as_bytes(),
                )
                .await;
                match r {
                    Ok(r) if r.status == 201 => accepted.lock().unwrap().extend(ids),
                    Ok(r) if r.status == 429 => {
                        assert!(r.header("retry-after").is_some(), "{:?}", r.headers);
                        shed.fetch_add(1, Ordering::Relaxed);
                        // A flood: retry at once, ignoring Retry-After.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Ok(r) => panic!("publish answered {}: {}", r.status, r.body),
                    // No answer: the outcome is unknown, so it is not counted.
                    Err(e) => eprintln!("publish without an answer: {e}"),
                }
            }
        }));
    }
    // The slow consumer: a few events at a time, acked after a pause.
    let mut delivered = BTreeSet::new();
    let until = Instant::now() + FLOOD;
    while Instant::now() < until {
        // Refused (429 under the flood) or unanswered: the consumer tries again.
        if let Ok(ds) = pull(&a, "slow", &json!({"max_events": 10})).await {
            tokio::time::sleep(Duration::from_millis(100)).await;
            for d in &ds {
                delivered.insert(d.event["id"].as_str().unwrap().to_string());
            }
            if !ds.is_empty() {
                let _ = ack(&a, "slow", &ids(&ds)).await;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for p in publishers {
        p.await.unwrap();
    }
    let peak = peak_rss(pid);
    let accepted = accepted.lock().unwrap().clone();
    let shed = shed.load(Ordering::Relaxed);
    eprintln!(
        "flood: {} events accepted, {shed} batches shed; rss before {} MiB, peak {} MiB",
        accepted.len(),
        before / MIB,
        peak / MIB
    );
    assert!(
        shed > 0,
        "the flood never exceeded the limits: the test shows nothing"
    );
    assert!(!accepted.is_empty(), "nothing was accepted under the flood");
    assert!(
        peak <= before + GROWTH_BOUND,
        "meshd grew from {} MiB to a peak of {} MiB under the flood (bound +{} MiB)",
        before / MIB,
        peak / MIB,
        GROWTH_BOUND / MIB
    );
    assert!(
        metric(&a, "meshd_http_shed_total{limit=\"body_memory\"} ").await
            + metric(&a, "meshd_http_shed_total{limit=\"requests\"} ").await
            >= shed
    );

    // Drain: every event answered 201 is delivered.
    let deadline = Instant::now() + Duration::from_secs(240);
    while !accepted.is_subset(&delivered) {
        assert!(
            Instant::now() < deadline,
            "{} of {} accepted events not delivered",
            accepted.difference(&delivered).count(),
            accepted.len()
        );
        let ds = pull(&a, "slow", &json!({"max_events": 1000, "wait_ms": 1000}))
            .await
            .unwrap();
        for d in &ds {
            delivered.insert(d.event["id"].as_str().unwrap().to_string());
        }
        if !ds.is_empty() {
            ack(&a, "slow", &ids(&ds)).await.unwrap();
        }
    }
}
