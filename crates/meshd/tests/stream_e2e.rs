//! Streaming consume and subscription statistics through the real binary
//! (http-api.md "Streaming consume", "Subscription statistics"): Server-Sent Events
//! and the WebSocket form deliver every event, `max_in_flight` and WebSocket credits
//! bound what a stream holds, acks in-band and over POST advance the committed
//! offset, a SIGKILL mid-stream brings back exactly the unacked deliveries (attempt
//! 2), a reader that stops reading holds no more than its flow control allows, a
//! graceful stop ends streams at once, and the statistics agree with `/metrics`.
//!
//! Flow control is checked where it lives: the subscription's in-flight count (its
//! statistics and `/metrics`) while the stream holds what it may, never by waiting to
//! see that nothing more arrives.

mod common;

use common::*;
use futures::{SinkExt, StreamExt};
use meshd_client::{Client, StreamOptions};
use meshd_test_support::http::{self, metric, request_with};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::Message;

const DRAIN: Duration = Duration::from_secs(30);
/// The admin token [`start_with_tokens`] writes.
const ADMIN_TOKEN: &str = "admin-token-0123456789";

fn client(a: &str) -> Client {
    Client::connect(&format!("http://{a}")).unwrap()
}

/// The subscription's statistics (`GET .../stats`, [`Client::stats_answer`]; asserts
/// 200), checked for the contract's fields.
async fn stats(a: &str, sub: &str) -> anyhow::Result<Vec<Value>> {
    let r = answered(common::client(a).stats_answer(sub).await, 200, "stats")?;
    let v: Value = r.json()?;
    let parts = v["partitions"].as_array().cloned().unwrap_or_default();
    for p in &parts {
        for k in [
            "partition",
            "committed",
            "end_offset",
            "backlog",
            "in_flight",
            "waiting_retries",
            "parked",
            "dead_lettering",
            "delivered_total",
            "redelivered_total",
            "acked_total",
            "nacked_total",
            "dead_lettered_total",
        ] {
            anyhow::ensure!(p[k].is_u64(), "stats partition without a numeric {k}: {p}");
        }
    }
    Ok(parts)
}

fn sum(parts: &[Value], k: &str) -> u64 {
    parts.iter().map(|p| p[k].as_u64().unwrap_or(0)).sum()
}

/// Waits until the subscription has exactly `n` deliveries in flight (statistics and
/// `/metrics` agree), then checks it stays at `n` while the stream could take more.
async fn in_flight_is(a: &str, sub: &str, n: u64) {
    wait_until(DRAIN, &format!("{n} in flight on {sub}"), || async move {
        let parts = stats(a, sub).await?;
        let got = sum(&parts, "in_flight");
        anyhow::ensure!(got == n, "stats say {got} in flight: {parts:?}");
        let m = metric(
            a,
            &format!("meshd_in_flight_deliveries{{subscription=\"{sub}\"}}"),
        )
        .await?;
        anyhow::ensure!(m as u64 == n, "/metrics says {m} in flight");
        Ok(())
    })
    .await
    .unwrap();
}

async fn publish_n(a: &str, topic: &str, n: usize, prefix: &str) -> BTreeSet<String> {
    let mut ids = BTreeSet::new();
    for i in 0..n {
        let id = format!("{prefix}{i}");
        publish(a, topic, &event(&id)).await.unwrap();
        ids.insert(id);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sse_stream_delivers_every_event_within_max_in_flight_and_post_acks_give_credit_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    let a = a.as_str();
    create_topic(a, "t", 3).await;
    create_subscription(a, "s", json!({"topic": "t", "start": "earliest"})).await;
    let published = publish_n(a, "t", 30, "e").await;

    let c = client(a);
    let opts = StreamOptions {
        max_in_flight: Some(4),
        session: None,
    };
    let mut stream = c.stream("s", &opts).await.unwrap();
    let mut first = Vec::new();
    for _ in 0..4 {
        first.push(stream.next().await.unwrap().expect("a delivery"));
    }
    // The stream holds 4 and takes no more until one is settled.
    in_flight_is(a, "s", 4).await;
    assert_eq!(
        metric(a, "meshd_stream_leased_deliveries").await.unwrap(),
        4.0
    );
    assert_eq!(metric(a, "meshd_streams_open").await.unwrap(), 1.0);

    let mut seen = BTreeSet::new();
    let mut pending: Vec<meshd_client::Delivery> = first;
    while seen.len() < published.len() {
        // Ack what was received over POST; the stream gets that much credit back.
        let ids: Vec<String> = pending.iter().map(|d| d.delivery_id.clone()).collect();
        let acked = c.ack("s", &ids).await.unwrap();
        assert_eq!(acked.acked.len(), ids.len(), "{acked:?}");
        for d in pending.drain(..) {
            assert_eq!(d.attempt, 1, "{d:?}");
            let e = d.event.as_ref().unwrap();
            let id = e["id"].as_str().unwrap().to_string();
            assert_eq!(*e, event(&id), "delivered exactly as published");
            assert!(seen.insert(id), "delivered twice: {d:?}");
        }
        if seen.len() < published.len() {
            pending.push(stream.next().await.unwrap().expect("a delivery"));
        }
    }
    assert_eq!(seen, published);
    let parts = stats(a, "s").await.unwrap();
    for p in &parts {
        assert_eq!(
            p["committed"], p["end_offset"],
            "every event acked: {parts:?}"
        );
        assert_eq!(p["backlog"], 0, "{p}");
        assert_eq!(p["delivered_total"], p["acked_total"], "{p}");
        assert_eq!(p["redelivered_total"], 0, "{p}");
    }
    assert_eq!(sum(&parts, "delivered_total"), 30);
    assert_eq!(sum(&parts, "end_offset"), 30);
    assert_eq!(
        metric(a, "meshd_acks_total{subscription=\"s\"}")
            .await
            .unwrap() as u64,
        sum(&parts, "acked_total"),
        "the statistics' counters are the metrics' split by partition"
    );

    // A graceful stop ends the stream at once (the stream ends rather than waiting
    // for its keep-alive or the 10 s request drain).
    let (ended, code) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(5), stream.next()),
        m.terminate(Duration::from_secs(30))
    );
    let ended = ended.expect("the stream ends within 5 s of SIGTERM");
    assert!(matches!(ended, Ok(None)), "{ended:?}");
    assert_eq!(code.unwrap(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_refused_with_a_problem_before_anything_is_leased() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t"})).await;
    let sse = [("Accept", "text/event-stream")];
    let r = request_with(a, "GET", "/v1/subscriptions/s/stream", &[], b"")
        .await
        .unwrap();
    problem(&r, 406);
    let r = request_with(
        a,
        "GET",
        "/v1/subscriptions/s/stream",
        &[("Accept", "application/json")],
        b"",
    )
    .await
    .unwrap();
    problem(&r, 406);
    for q in ["max_in_flight=0", "max_in_flight=10001", "max_in_flight=x"] {
        let r = request_with(
            a,
            "GET",
            &format!("/v1/subscriptions/s/stream?{q}"),
            &sse,
            b"",
        )
        .await
        .unwrap();
        problem_naming(&r, "max_in_flight");
    }
    let r = request_with(a, "GET", "/v1/subscriptions/nope/stream", &sse, b"")
        .await
        .unwrap();
    problem(&r, 404);
    let r = request_with(
        a,
        "GET",
        "/v1/subscriptions/s/stream?session=gone",
        &sse,
        b"",
    )
    .await
    .unwrap();
    assert_eq!(problem(&r, 404)["field"], "session");
    let r = http::get(a, "/v1/subscriptions/nope/stats").await.unwrap();
    problem(&r, 404);
    let r = http::get(a, "/v1/subscriptions/b%20d/stats").await.unwrap();
    problem(&r, 400);
    assert_eq!(metric(a, "meshd_streams_open").await.unwrap(), 0.0);
}

/// A WebSocket client of meshd.
type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

async fn ws_connect(a: &str, query: &str, auth: Option<&str>) -> Ws {
    let mut req = format!("ws://{a}/v1/subscriptions/s/stream?{query}")
        .into_client_request()
        .unwrap();
    if let Some(t) = auth {
        req.headers_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    tokio_tungstenite::connect_async(req).await.unwrap().0
}

async fn ws_send(ws: &mut Ws, v: Value) {
    ws.send(Message::Text(v.to_string().into())).await.unwrap();
}

/// The next text frame as JSON (pings are answered by the library and skipped).
async fn ws_next(ws: &mut Ws) -> Value {
    loop {
        let m = tokio::time::timeout(DRAIN, ws.next())
            .await
            .expect("a frame within the drain time")
            .expect("the socket is open")
            .expect("a frame");
        match m {
            Message::Text(t) => return serde_json::from_str(&t).unwrap(),
            Message::Ping(_) | Message::Pong(_) => continue,
            other => panic!("unexpected frame {other:?}"),
        }
    }
}

/// Reads frames until `n` deliveries came; answers to acks are returned too.
async fn ws_deliveries(ws: &mut Ws, n: usize) -> Vec<Value> {
    let mut got = Vec::new();
    while got.len() < n {
        let f = ws_next(ws).await;
        let list = f["deliveries"]
            .as_array()
            .unwrap_or_else(|| panic!("not a deliveries frame: {f}"));
        got.extend(list.iter().cloned());
    }
    assert_eq!(got.len(), n, "more than asked for: {got:?}");
    got
}

fn ids_of(ds: &[Value]) -> Vec<Value> {
    ds.iter().map(|d| d["delivery_id"].clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_stream_honours_credits_and_answers_in_band_acks_nacks_and_extends() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 2).await;
    create_subscription(
        a,
        "s",
        json!({"topic": "t", "start": "earliest", "backoff": {"initial_ms": 1, "max_ms": 1}}),
    )
    .await;
    publish_n(a, "t", 10, "w").await;

    let mut ws = ws_connect(a, "max_in_flight=6", None).await;
    // Nothing before credit; then 3 deliveries, no more, although max_in_flight is 6.
    in_flight_is(a, "s", 0).await;
    assert_eq!(metric(a, "meshd_streams_open").await.unwrap(), 1.0);
    ws_send(&mut ws, json!({"credit": 3})).await;
    let first = ws_deliveries(&mut ws, 3).await;
    in_flight_is(a, "s", 3).await;

    // In-band ack with a ref; the answer carries the ref and the ack lists.
    ws_send(&mut ws, json!({"ref": "r1", "ack": ids_of(&first[..2])})).await;
    let answer = ws_next(&mut ws).await;
    assert_eq!(answer["ref"], "r1", "{answer}");
    assert_eq!(
        set(&answer["acked"]),
        set_of(&ids_of(&first[..2])),
        "{answer}"
    );
    for k in ["unknown", "fenced", "failed"] {
        assert_eq!(answer[k], json!([]), "{answer}");
    }
    // Credits were used up: acks alone do not open the stream again.
    in_flight_is(a, "s", 1).await;

    // Extend in band, then nack: the nacked event comes back with attempt 2.
    ws_send(
        &mut ws,
        json!({"ref": 7, "extend": ids_of(&first[2..]), "ack_timeout_ms": 60000}),
    )
    .await;
    let answer = ws_next(&mut ws).await;
    assert_eq!(answer["ref"], 7);
    assert_eq!(
        set(&answer["extended"]),
        set_of(&ids_of(&first[2..])),
        "{answer}"
    );
    ws_send(
        &mut ws,
        json!({"ref": "n", "nack": ids_of(&first[2..]), "reason": "try again"}),
    )
    .await;
    let answer = ws_next(&mut ws).await;
    assert_eq!(answer["ref"], "n");
    assert_eq!(
        set(&answer["retrying"]),
        set_of(&ids_of(&first[2..])),
        "{answer}"
    );

    // A bad frame is answered with a problem naming the field; the stream goes on.
    ws_send(&mut ws, json!({"ref": "bad", "credit": 0})).await;
    let answer = ws_next(&mut ws).await;
    assert_eq!(answer["ref"], "bad");
    assert_eq!(answer["problem"]["status"], 400, "{answer}");
    assert_eq!(answer["problem"]["field"], "credit", "{answer}");

    // More credit: the rest comes, 8 events (7 left + the nacked one), at most
    // max_in_flight unsettled at a time.
    ws_send(&mut ws, json!({"credit": 100})).await;
    let mut rest = ws_deliveries(&mut ws, 6).await;
    in_flight_is(a, "s", 6).await;
    ws_send(&mut ws, json!({"ref": "a2", "ack": ids_of(&rest)})).await;
    let answer = ws_next(&mut ws).await;
    assert_eq!(set(&answer["acked"]).len(), 6, "{answer}");
    rest.extend(ws_deliveries(&mut ws, 2).await);
    let retried: Vec<&Value> = rest.iter().filter(|d| d["attempt"] == 2).collect();
    assert_eq!(
        retried.len(),
        1,
        "the nacked event came back once with attempt 2: {rest:?}"
    );
    assert_eq!(retried[0]["offset"], first[2]["offset"]);
    assert_eq!(retried[0]["partition"], first[2]["partition"]);
    // An ack over POST settles a WebSocket's delivery too.
    let r = ack(a, "s", &ids_of(&rest[6..])).await.unwrap();
    assert_eq!(set(&r["acked"]).len(), 2, "{r}");
    let parts = stats(a, "s").await.unwrap();
    for p in &parts {
        assert_eq!(p["committed"], p["end_offset"], "{parts:?}");
    }
    assert_eq!(sum(&parts, "nacked_total"), 1);
    assert_eq!(sum(&parts, "acked_total"), 10);
    assert_eq!(sum(&parts, "delivered_total"), 11);
    assert_eq!(
        sum(&parts, "redelivered_total"),
        1,
        "the nacked one: {parts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tokens_a_websocket_authenticates_with_its_first_frame() {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with_tokens(dir.path(), &[]).await;
    let a = m.addr();
    let admin = common::client(a).with_token(ADMIN_TOKEN).unwrap();
    let r = admin.publish_event_answer("t", &event("x")).await;
    answered(r, 201, "publish").unwrap();

    // A wrong token in the first frame: a problem, then the socket closes; nothing is
    // handed out.
    let mut ws = ws_connect(a, "", None).await;
    ws_send(&mut ws, json!({"token": "wrong"})).await;
    let answer = ws_next(&mut ws).await;
    assert_eq!(answer["problem"]["status"], 401, "{answer}");
    let end = tokio::time::timeout(DRAIN, ws.next()).await.unwrap();
    assert!(
        matches!(&end, Some(Ok(Message::Close(Some(f)))) if u16::from(f.code) == 4401)
            || end.is_none(),
        "{end:?}"
    );
    // An SSE stream without a token is 401 at once.
    let r = request_with(
        a,
        "GET",
        "/v1/subscriptions/s/stream",
        &[("Accept", "text/event-stream")],
        b"",
    )
    .await
    .unwrap();
    problem(&r, 401);
    // The client token in the first frame streams; so does the header.
    let mut ws = ws_connect(a, "", None).await;
    ws_send(&mut ws, json!({"token": "client-token-0123456789"})).await;
    ws_send(&mut ws, json!({"credit": 10})).await;
    let got = ws_deliveries(&mut ws, 1).await;
    assert_eq!(got[0]["event"], event("x"));
    drop(ws);
    let mut ws = ws_connect(a, "", Some("client-token-0123456789")).await;
    ws_send(&mut ws, json!({"ref": 1, "ack": ids_of(&got)})).await;
    let answer = ws_next(&mut ws).await;
    assert_eq!(set(&answer["acked"]), set_of(&ids_of(&got)), "{answer}");
}

/// meshd on `dir` with topic `t` (one partition) and subscription `s` from its start
/// with 1 s leases (so what a restart leaves in flight is due again soon).
async fn one_partition_with_short_leases(dir: &std::path::Path) -> (MeshdProcess, String) {
    let m = start(dir).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(
        &a,
        "s",
        json!({"topic": "t", "start": "earliest", "ack_timeout_ms": 1000}),
    )
    .await;
    (m, a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_sigkill_mid_stream_unacked_deliveries_come_back_with_attempt_2_and_acked_ones_never(
) {
    let dir = tempfile::tempdir().unwrap();
    let (mut m, a) = one_partition_with_short_leases(dir.path()).await;
    publish_n(&a, "t", 4, "k").await;
    let c = client(&a);
    let mut stream = c.stream("s", &StreamOptions::default()).await.unwrap();
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(stream.next().await.unwrap().unwrap());
    }
    got.sort_by_key(|d| d.offset);
    let acked = c
        .ack(
            "s",
            &[got[0].delivery_id.clone(), got[1].delivery_id.clone()],
        )
        .await
        .unwrap();
    assert_eq!(acked.acked.len(), 2);
    // Shown once durable.
    wait_committed(&a, "s", 0, 2).await;

    m.kill();
    let err = tokio::time::timeout(DRAIN, stream.next()).await.unwrap();
    assert!(err.is_err(), "the stream is cut by the SIGKILL: {err:?}");
    m.start_again().await.unwrap();
    let a = m.addr().to_string();
    publish(&a, "t", &event("after")).await.unwrap();
    let c = client(&a);
    let mut stream = c.stream("s", &StreamOptions::default()).await.unwrap();
    let mut again = Vec::new();
    while again.len() < 3 {
        let d = stream.next().await.unwrap().unwrap();
        assert!(d.offset >= 2, "an acked delivery came back: {d:?}");
        again.push((d.offset, d.attempt));
    }
    again.sort();
    assert_eq!(again, vec![(2, 2), (3, 2), (4, 1)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stops_reading_holds_its_flow_control_and_no_more_memory() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", json!({"topic": "t", "start": "earliest"})).await;
    // 1500 events of 64 KiB (~96 MiB) ready for the stream.
    let big = "x".repeat(64 * 1024);
    for batch in 0..15 {
        let events: Vec<Value> = (0..100)
            .map(|i| {
                let mut e = event(&format!("b{batch}-{i}"));
                e["data"] = json!(big);
                e
            })
            .collect();
        publish_batch(&a, "t", &events).await.unwrap();
    }
    let pid = m.pid().unwrap();
    let before = current_rss(pid);
    // A reader that sends its request and never reads: the stream may lease up to
    // 10000, but it is paced by the socket, so it leases what it could write.
    use tokio::io::AsyncWriteExt;
    let mut sock = tokio::net::TcpStream::connect(&a).await.unwrap();
    sock.write_all(
        format!(
            "GET /v1/subscriptions/s/stream?max_in_flight=10000 HTTP/1.1\r\nHost: {a}\r\nAccept: text/event-stream\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    // It got some (a first pull's worth) and then stops taking more.
    wait_until(DRAIN, "the stream leased something", || {
        let a = a.clone();
        async move {
            let n = metric(&a, "meshd_stream_leased_deliveries").await?;
            anyhow::ensure!(n > 0.0, "nothing leased yet");
            Ok(())
        }
    })
    .await
    .unwrap();
    let mut last = metric(&a, "meshd_stream_leased_deliveries").await.unwrap();
    // Leases settle once the writes block: the same count twice, a second apart.
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = metric(&a, "meshd_stream_leased_deliveries").await.unwrap();
        if now == last {
            break;
        }
        last = now;
    }
    let leased = last as u64;
    // A stream takes 1 MiB of events per step (~16 of these) and a blocked write
    // holds it; what the kernel's socket buffers took (a few MiB) is leased too. Far
    // from the 1500 ready and the 10000 allowed.
    assert!(
        leased <= 260,
        "a reader that reads nothing leased {leased} deliveries"
    );
    let grown = current_rss(pid).saturating_sub(before);
    eprintln!(
        "a reader that reads nothing: {leased} leased, meshd grew by {} KiB",
        grown >> 10
    );
    assert!(
        grown < 32 * 1024 * 1024,
        "meshd grew by {} MiB for a reader that reads nothing",
        grown >> 20
    );
    drop(sock);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_stream_outlives_the_idle_timeout_by_its_keep_alives_and_streams_take_long_poll_slots(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(
        bin(),
        dir.path(),
        &["--idle-timeout-ms", "1000", "--max-long-polls", "1"],
    )
    .await
    .unwrap();
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t"})).await;
    let c = client(a);
    let mut stream = c.stream("s", &StreamOptions::default()).await.unwrap();
    // The one long-poll slot is the stream's: a second stream, and a waiting pull,
    // are refused with 429 and Retry-After.
    let sse = [("Accept", "text/event-stream")];
    let r = request_with(a, "GET", "/v1/subscriptions/s/stream", &sse, b"")
        .await
        .unwrap();
    problem(&r, 429);
    assert!(r.header("retry-after").is_some(), "{}", r.body);
    let r = http::send_json(
        a,
        "POST",
        "/v1/subscriptions/s/pull",
        &json!({"wait_ms": 100}),
    )
    .await
    .unwrap();
    problem(&r, 429);
    // Three idle timeouts with nothing to deliver: the keep-alives hold the connection.
    tokio::time::sleep(Duration::from_secs(3)).await;
    publish(a, "t", &event("late")).await.unwrap();
    let d = tokio::time::timeout(DRAIN, stream.next())
        .await
        .unwrap()
        .expect("the stream is still open")
        .unwrap();
    assert_eq!(d.event.unwrap()["id"], "late");
    // The slot comes back when the stream ends.
    drop(stream);
    wait_until(DRAIN, "the stream's slot is free", || async move {
        let pull = meshd_client::Pull {
            wait_ms: Some(1),
            ..Default::default()
        };
        answered(common::client(a).pull_answer("s", &pull).await, 200, "pull")?;
        Ok(())
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_bound_to_a_session_is_fenced_when_the_session_is_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t", "start": "earliest"})).await;
    publish_n(a, "t", 2, "f").await;
    let open = |a: String| async move {
        open_session(&a, "worker-1", 10000).await["session_id"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let first = open(a.to_string()).await;
    let c = client(a);
    let opts = StreamOptions {
        max_in_flight: Some(1),
        session: Some(first),
    };
    let mut stream = c.stream("s", &opts).await.unwrap();
    let d = stream.next().await.unwrap().unwrap();
    // Bound to the session: acked while it is current.
    assert_eq!(c.ack("s", &[d.delivery_id]).await.unwrap().acked.len(), 1);
    let d = stream.next().await.unwrap().unwrap();
    // Another process takes the client id over: the stream's deliveries are fenced.
    open(a.to_string()).await;
    let r = ack(a, "s", &[json!(d.delivery_id)]).await;
    let e = r.expect_err("an ack of a fenced session's delivery is a 409");
    assert!(e.to_string().contains("409"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_closes_a_websocket_stream_at_once_and_its_unacked_deliveries_come_back_after_the_restart(
) {
    let dir = tempfile::tempdir().unwrap();
    let (mut m, a) = one_partition_with_short_leases(dir.path()).await;
    publish_n(&a, "t", 3, "g").await;
    let mut ws = ws_connect(&a, "", None).await;
    ws_send(&mut ws, json!({"credit": 3})).await;
    let mut got = ws_deliveries(&mut ws, 3).await;
    got.sort_by_key(|d| d["offset"].as_u64());
    ws_send(&mut ws, json!({"ref": "a", "ack": ids_of(&got[..1])})).await;
    let answer = ws_next(&mut ws).await;
    assert_eq!(set(&answer["acked"]).len(), 1, "{answer}");
    // Shown once durable (a graceful stop flushes anyway; this pins the ack).
    wait_committed(&a, "s", 0, 1).await;

    let closed = async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(f))) => return f.map(|f| u16::from(f.code)),
                Some(Ok(_)) => continue,
                other => panic!("the socket ended without a close frame: {other:?}"),
            }
        }
    };
    let (code, exit) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(5), closed),
        m.terminate(Duration::from_secs(30))
    );
    assert_eq!(code.expect("closed within 5 s of SIGTERM"), Some(1001));
    assert_eq!(exit.unwrap(), Some(0));

    m.start_again().await.unwrap();
    let a = m.addr().to_string();
    let mut ws = ws_connect(&a, "", None).await;
    ws_send(&mut ws, json!({"credit": 10})).await;
    let mut again: Vec<(u64, u64)> = ws_deliveries(&mut ws, 2)
        .await
        .iter()
        .map(|d| {
            (
                d["offset"].as_u64().unwrap(),
                d["attempt"].as_u64().unwrap(),
            )
        })
        .collect();
    again.sort();
    assert_eq!(
        again,
        vec![(1, 2), (2, 2)],
        "the unacked two, with attempt 2"
    );
}

/// A WebSocket upgrade to `sub`'s stream, with `Authorization` when `auth` is given:
/// the socket, or the HTTP status the upgrade was refused with.
async fn ws_open(a: &str, sub: &str, auth: Option<&str>) -> Result<Ws, u16> {
    let mut req = format!("ws://{a}/v1/subscriptions/{sub}/stream")
        .into_client_request()
        .unwrap();
    if let Some(t) = auth {
        req.headers_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    match tokio_tungstenite::connect_async(req).await {
        Ok((ws, _)) => Ok(ws),
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => Err(r.status().as_u16()),
        Err(e) => panic!("the upgrade failed below HTTP: {e}"),
    }
}

/// Reads a socket to its end: the problem frame meshd sent before closing and the
/// close code.
async fn ws_refusal(ws: &mut Ws) -> (Value, u16) {
    let problem = ws_next(ws).await;
    let end = tokio::time::timeout(DRAIN, ws.next()).await.unwrap();
    let code = match &end {
        Some(Ok(Message::Close(Some(f)))) => u16::from(f.code),
        other => panic!("expected a close frame after {problem}, got {other:?}"),
    };
    (problem["problem"].clone(), code)
}

/// meshd on `dir` with client tokens (two) and an admin token, and `extra` flags;
/// topic `t` and subscription `s` created through the admin token.
async fn start_with_tokens(dir: &std::path::Path, extra: &[&str]) -> MeshdProcess {
    let client = dir.join("client-tokens");
    let admin = dir.join("admin-tokens");
    std::fs::write(
        &client,
        "client-token-0123456789\nclient-token-other-98765\n",
    )
    .unwrap();
    std::fs::write(&admin, "admin-token-0123456789\n").unwrap();
    let mut args = vec![
        "--client-token-file",
        client.to_str().unwrap(),
        "--admin-token-file",
        admin.to_str().unwrap(),
    ];
    args.extend(extra);
    let m = MeshdProcess::start(bin(), &dir.join("data"), &args)
        .await
        .unwrap();
    admin_topic_and_subscription(m.addr()).await;
    m
}

/// Topic `t` and subscription `s` through the admin token (asserts 201 for each).
async fn admin_topic_and_subscription(a: &str) {
    let admin = common::client(a).with_token(ADMIN_TOKEN).unwrap();
    answered(admin.create_topic_answer("t", 1).await, 201, "PUT topic t").unwrap();
    let r = admin
        .put_subscription_answer("s", &json!({"topic": "t", "start": "earliest"}))
        .await;
    answered(r, 201, "PUT subscription s").unwrap();
}

/// http-api.md "Security rules (third round)": a WebSocket waiting for its token frame
/// holds no long-poll slot and resolves no name, so a flood of them cannot starve
/// authenticated streams or tell which subscriptions exist; each is closed 3 s after
/// its upgrade, and at most 64 wait at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_tokens_when_websockets_never_send_their_token_then_they_hold_no_slot_name_nothing_and_close_within_3_s(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with_tokens(dir.path(), &["--max-long-polls", "2"]).await;
    let a = m.addr();

    // Sockets to a subscription that exists and to one that does not upgrade alike,
    // and hold nothing.
    let opened = std::time::Instant::now();
    let mut waiting = Vec::new();
    for sub in ["s", "s", "no-such-subscription"] {
        waiting.push(ws_open(a, sub, None).await.unwrap_or_else(|status| {
            panic!("an unauthenticated upgrade to {sub} was answered {status} before its token")
        }));
    }
    assert_eq!(metric(a, "meshd_http_long_polls").await.unwrap(), 0.0);
    assert_eq!(
        metric(a, "meshd_http_websockets_awaiting_token")
            .await
            .unwrap(),
        3.0
    );
    // Both slots remain for authenticated streams.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(
            ws_open(a, "s", Some("client-token-0123456789"))
                .await
                .unwrap(),
        );
    }
    wait_long_polls(a, 2).await;
    // Each waiting socket is told and closed by the deadline.
    for ws in &mut waiting {
        let (p, code) = ws_refusal(ws).await;
        assert_eq!((p["status"].as_u64(), code), (Some(401), 4401), "{p}");
    }
    let took = opened.elapsed();
    assert!(
        took < Duration::from_secs(3) + Duration::from_secs(2),
        "the sockets waiting for a token were closed only after {took:?}"
    );
    assert_eq!(
        metric(a, "meshd_http_websocket_closes_total{reason=\"no_token\"}")
            .await
            .unwrap(),
        3.0
    );
    assert_eq!(
        metric(a, "meshd_http_websockets_awaiting_token")
            .await
            .unwrap(),
        0.0
    );
    // Once authenticated, an unknown name is told as such (a problem frame and 4404),
    // when a slot is free (the slot is taken before the name is looked up).
    let one = held.pop().unwrap();
    drop(one);
    wait_long_polls(a, 1).await;
    let mut ws = ws_open(a, "no-such-subscription", None).await.unwrap();
    ws_send(&mut ws, json!({"token": "client-token-0123456789"})).await;
    let (p, code) = ws_refusal(&mut ws).await;
    assert_eq!((p["status"].as_u64(), code), (Some(404), 4404), "{p}");
    // With both slots held, an authenticated socket is refused in band (429), not
    // left waiting.
    held.push(
        ws_open(a, "s", Some("client-token-0123456789"))
            .await
            .unwrap(),
    );
    wait_long_polls(a, 2).await;
    let mut ws = ws_open(a, "s", None).await.unwrap();
    ws_send(&mut ws, json!({"token": "client-token-0123456789"})).await;
    let (p, code) = ws_refusal(&mut ws).await;
    assert_eq!((p["status"].as_u64(), code), (Some(429), 4429), "{p}");

    // At most 64 wait for their token; the 65th upgrade is 429 before it upgrades.
    let mut flood = Vec::new();
    for _ in 0..64 {
        flood.push(
            ws_open(a, "s", None)
                .await
                .expect("one of 64 waiting sockets"),
        );
    }
    assert_eq!(ws_open(a, "s", None).await.err(), Some(429));
    assert_eq!(
        metric(a, "meshd_http_shed_total{limit=\"websocket_auth\"}")
            .await
            .unwrap(),
        1.0
    );
    drop(flood);
    drop(held);
}

/// `--max-streams-per-token`: one client token holds at most that many streams (SSE
/// and WebSocket, header or first frame); another token is unaffected, and a closed
/// stream gives its place back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_max_streams_per_token_then_one_token_cannot_take_every_stream_slot() {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with_tokens(dir.path(), &["--max-streams-per-token", "1"]).await;
    let a = m.addr();
    let one = "client-token-0123456789";
    let first = ws_open(a, "s", Some(one)).await.unwrap();
    wait_long_polls(a, 1).await;
    assert_eq!(ws_open(a, "s", Some(one)).await.err(), Some(429));
    let r = request_with(
        a,
        "GET",
        "/v1/subscriptions/s/stream",
        &[
            ("Accept", "text/event-stream"),
            ("Authorization", "Bearer client-token-0123456789"),
        ],
        b"",
    )
    .await
    .unwrap();
    let p = problem(&r, 429);
    assert!(
        p["detail"]
            .as_str()
            .unwrap()
            .contains("--max-streams-per-token"),
        "{p}"
    );
    let mut ws = ws_open(a, "s", None).await.unwrap();
    ws_send(&mut ws, json!({"token": one})).await;
    let (p, code) = ws_refusal(&mut ws).await;
    assert_eq!((p["status"].as_u64(), code), (Some(429), 4429), "{p}");
    assert_eq!(
        metric(a, "meshd_http_shed_total{limit=\"streams_per_token\"}")
            .await
            .unwrap(),
        3.0
    );
    // Another client token streams.
    let other = ws_open(a, "s", Some("client-token-other-98765"))
        .await
        .unwrap();
    wait_long_polls(a, 2).await;
    // A closed stream gives its place back.
    drop(first);
    wait_long_polls(a, 1).await;
    let again = ws_open(a, "s", Some(one)).await.unwrap();
    wait_long_polls(a, 2).await;
    drop((other, again));
}

/// meshd with `flags`, topic `t` of one partition and subscription `s` from its
/// start.
async fn start_with_one_partition(dir: &std::path::Path, flags: &[&str]) -> MeshdProcess {
    let m = MeshdProcess::start(bin(), dir, flags).await.unwrap();
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", json!({"topic": "t", "start": "earliest"})).await;
    m
}

/// A client that keeps sending frames but never reads what meshd sends holds its
/// stream no longer than the idle timeout: the frame meshd cannot hand over closes the
/// stream, its slot comes back, and its leases run out as any dropped stream's do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_client_that_sends_but_never_reads_is_closed_after_the_idle_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with_one_partition(dir.path(), &["--idle-timeout-ms", "1500"]).await;
    let a = m.addr().to_string();
    let a = a.as_str();
    // 100 events of 128 KiB: more than the socket buffers of a reader that never reads.
    let big = "x".repeat(128 * 1024);
    for batch in 0..4 {
        let events: Vec<Value> = (0..25)
            .map(|i| {
                let mut e = event(&format!("b{batch}-{i}"));
                e["data"] = json!(big);
                e
            })
            .collect();
        publish_batch(a, "t", &events).await.unwrap();
    }
    // A small receive buffer, so what meshd writes backs up soon.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let tcp = sock.connect(a.parse().unwrap()).await.unwrap();
    let req = format!("ws://{a}/v1/subscriptions/s/stream")
        .into_client_request()
        .unwrap();
    let (ws, _) = tokio_tungstenite::client_async(req, tcp).await.unwrap();
    let (mut tx, _never_read) = ws.split();
    tx.send(Message::Text(json!({"credit": 10000}).to_string().into()))
        .await
        .unwrap();
    wait_long_polls(a, 1).await;
    // Keep sending (so the connection is never idle on its reads) and never read.
    let sender = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            let credit = Message::Text(json!({"credit": 1}).to_string().into());
            if tx.send(credit).await.is_err() {
                return;
            }
        }
    });
    // Idle timeout plus slack.
    wait_until(
        Duration::from_secs(10),
        "the stream of a client that never reads is closed",
        || async move {
            let n = metric(a, "meshd_http_long_polls").await?;
            anyhow::ensure!(n == 0.0, "meshd_http_long_polls {n}");
            Ok(())
        },
    )
    .await
    .unwrap();
    assert_eq!(
        metric(
            a,
            "meshd_http_websocket_closes_total{reason=\"write_stalled\"}"
        )
        .await
        .unwrap(),
        1.0
    );
    sender.abort();
}

/// An upgraded WebSocket is a connection like any other: it keeps its place under
/// `--max-connections` for its life (hyper hands its socket over at the upgrade, and
/// the place used to go back then, so streams could open past the cap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgraded_websockets_keep_counting_against_max_connections() {
    let dir = tempfile::tempdir().unwrap();
    let m = start_with_one_partition(dir.path(), &["--max-connections", "4"]).await;
    let a = m.addr().to_string();
    let a = a.as_str();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(ws_open(a, "s", None).await.unwrap());
    }
    wait_long_polls(a, 3).await;
    // Three WebSockets and the scrape's own connection.
    wait_until(DRAIN, "4 connections open", || async move {
        let n = metric(a, "meshd_http_connections").await?;
        anyhow::ensure!(n == 4.0, "meshd_http_connections {n}");
        Ok(())
    })
    .await
    .unwrap();
    held.pop();
    wait_until(DRAIN, "a closed WebSocket's place back", || async move {
        let n = metric(a, "meshd_http_connections").await?;
        anyhow::ensure!(n == 3.0, "meshd_http_connections {n}");
        Ok(())
    })
    .await
    .unwrap();
}
