//! Signed and bounded push (HTTP API, Additions, "Push, signed and bounded") through
//! the real binary, in embedded and cluster mode. Every delivery is checked with the
//! Standard Webhooks reference library (`standardwebhooks`), as a receiver would.
//!
//! The failures these pin: a signature a receiver's library rejects (wrong content,
//! wrong encoding, a header missing), a `webhook-id` that changes between attempts of
//! one event (so receivers cannot deduplicate a redelivery after a SIGKILL or a
//! takeover), a secret or header value shown by `GET` or written to the log, a `PUT`
//! that drops a stored secret it was told to keep, reserved headers accepted, and a
//! receiver sent more requests at once, or faster, than the subscription allows.

mod common;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use common::webhook::{endpoint, endpoint_with, Endpoint, Received};
use common::*;
use meshd_test_support::http::send_json;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use standardwebhooks::Webhook;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(30);
/// The specification's example secret (24 bytes) and a second one for rotation.
const OLD: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const NEW: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const TOKEN: &str = "Bearer s3cr3t-static-token";

fn headers_of(r: &Received) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in &r.headers {
        h.insert(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    h
}

/// Whether the reference library accepts `r` under `secret`.
fn verifies(secret: &str, r: &Received) -> bool {
    Webhook::new(secret)
        .unwrap()
        .verify(&r.body, &headers_of(r))
        .is_ok()
}

async fn wait_received(hook: &Endpoint, n: usize) -> Vec<Received> {
    wait_until(DEADLINE, &format!("{n} pushes"), || async {
        let got = hook.received();
        anyhow::ensure!(got.len() >= n, "{} so far", got.len());
        Ok(got)
    })
    .await
    .unwrap()
}

fn signed_push(url: &str, secrets: &[&str]) -> Value {
    json!({
        "url": url,
        "secrets": secrets,
        "headers": {"Authorization": TOKEN, "x-tenant": "acme"}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_bad_push_settings_then_the_put_is_a_400_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    let url = "http://127.0.0.1:9/hook";
    let cases = [
        (
            json!({"url": url, "headers": {"host": "x"}}),
            "push.headers",
        ),
        (
            json!({"url": url, "headers": {"Content-Type": "x"}}),
            "push.headers",
        ),
        (
            json!({"url": url, "headers": {"ce-id": "x"}}),
            "push.headers",
        ),
        (
            json!({"url": url, "headers": {"webhook-id": "x"}}),
            "push.headers",
        ),
        (
            json!({"url": url, "headers": {"meshd-x": "x"}}),
            "push.headers",
        ),
        (
            json!({"url": url, "headers": {"transfer-encoding": "x"}}),
            "push.headers",
        ),
        (
            json!({"url": url, "headers": {"Content-Length": "1"}}),
            "push.headers",
        ),
        (json!({"url": url, "headers": {"x-a": 5}}), "push.headers"),
        (
            json!({"url": url, "secrets": ["not-a-secret"]}),
            "push.secrets",
        ),
        (json!({"url": url, "secrets": ["whsec_"]}), "push.secrets"),
        (
            json!({"url": url, "secrets": [format!("whsec_{}", "a2tr".repeat(342))]}),
            "push.secrets",
        ),
        (
            json!({"url": url, "secrets": [OLD, NEW, OLD]}),
            "push.secrets",
        ),
        (json!({"url": url, "secrets": ["***"]}), "push.secrets"),
        (
            json!({"url": url, "max_concurrency": 0}),
            "push.max_concurrency",
        ),
        (
            json!({"url": url, "max_concurrency": 257}),
            "push.max_concurrency",
        ),
        (json!({"url": url, "rate_per_s": 0}), "push.rate_per_s"),
        (json!({"url": url, "rate_per_s": 100001}), "push.rate_per_s"),
    ];
    for (push, field) in cases {
        let r = send_json(
            a,
            "PUT",
            "/v1/subscriptions/s",
            &json!({"topic": "t", "push": push}),
        )
        .await
        .unwrap();
        problem_naming(&r, field);
    }
    assert_eq!(bare(a, "GET", "/v1/subscriptions/s").await.status, 404);
    // The contract sets no key length: a short one (5 bytes) is taken.
    create_subscription(
        a,
        "s",
        json!({"topic": "t", "push": {"url": url, "secrets": ["whsec_c2hvcnQ="]}}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_signed_push_when_meshd_is_sigkilled_mid_request_then_every_push_verifies_and_a_redelivery_keeps_its_webhook_id(
) {
    let dir = tempfile::tempdir().unwrap();
    let mut m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    // The first request fails, so one event is pushed twice; every request is held
    // 300 ms, so one is in flight when meshd is killed below.
    let hook = endpoint_with(vec![500, 204], None, Duration::from_millis(300)).await;
    let created = create_subscription(
        &a,
        "s",
        json!({"topic": "t", "ack_timeout_ms": 2000,
               "backoff": {"initial_ms": 10, "max_ms": 20},
               "push": signed_push(&hook.url, &[OLD])}),
    )
    .await;
    // Shown redacted, never as stored.
    assert_eq!(created["push"]["secrets"], json!(["***"]), "{created}");
    assert_eq!(
        created["push"]["headers"],
        json!({"authorization": "***", "x-tenant": "***"}),
        "{created}"
    );
    let shown = client(&a).subscription_answer("s").await.unwrap().text();
    assert!(
        !shown.contains("C2FVsBQ") && !shown.contains("s3cr3t"),
        "{shown}"
    );
    let listed = client(&a).subscriptions_answer().await.unwrap().text();
    assert!(!listed.contains("C2FVsBQ"), "{listed}");

    let published: Vec<Value> = (0..3).map(|i| event(&format!("e{i}"))).collect();
    for e in &published {
        publish(&a, "t", e).await.unwrap();
    }
    let got = wait_received(&hook, 4).await;
    for r in &got {
        assert!(
            verifies(OLD, r),
            "the reference library rejects {:?}",
            r.headers
        );
        assert!(!verifies(NEW, r), "a wrong secret must not verify");
        assert_eq!(
            r.headers["content-type"], "application/cloudevents+json",
            "structured mode"
        );
        assert_eq!(r.headers["authorization"], TOKEN);
        assert_eq!(r.headers["x-tenant"], "acme");
        assert!(!r.headers.contains_key("ce-id"), "not binary mode");
    }
    // The body is the event exactly as published; one webhook-id per event, the same
    // for its retry.
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for r in &got {
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert!(published.contains(&body), "{body}");
        ids.entry(body["id"].as_str().unwrap().to_string())
            .or_default()
            .insert(r.headers["webhook-id"].clone());
    }
    assert_eq!(ids.len(), 3, "{ids:?}");
    assert!(ids.values().all(|s| s.len() == 1), "{ids:?}");
    let distinct: BTreeSet<&String> = ids.values().flatten().collect();
    assert_eq!(distinct.len(), 3, "{ids:?}");

    // Rotation: the stored secret kept with "***", a new one first.
    let r = client(&a)
        .put_subscription_answer(
            "s",
            &json!({"topic": "t", "ack_timeout_ms": 2000,
                    "backoff": {"initial_ms": 10, "max_ms": 20},
                    "push": {"url": hook.url, "secrets": [NEW, "***"],
                             "headers": {"authorization": "***", "x-tenant": "***"}}}),
        )
        .await;
    let r = answered(r, 200, "PUT subscription s").unwrap();
    assert_eq!(
        r.json::<Value>().unwrap()["push"]["secrets"],
        json!(["***", "***"])
    );
    let before = hook.received().len();
    publish(&a, "t", &event("rotated")).await.unwrap();
    let got = wait_received(&hook, before + 1).await;
    let rotated = got.last().unwrap();
    assert!(
        verifies(NEW, rotated) && verifies(OLD, rotated),
        "both secrets verify"
    );
    assert_eq!(rotated.headers["webhook-signature"].split(' ').count(), 2);
    assert_eq!(
        rotated.headers["authorization"], TOKEN,
        "the kept header value"
    );

    // SIGKILL while a push is in flight: after the restart the same event is pushed
    // again, with its webhook-id unchanged and a fresh valid signature.
    let before = hook.received().len();
    publish(&a, "t", &event("killed")).await.unwrap();
    wait_until(DEADLINE, "the push in flight", || async {
        anyhow::ensure!(
            hook.in_flight.load(Ordering::SeqCst) >= 1 && hook.received().len() == before,
            "not yet in flight"
        );
        Ok(())
    })
    .await
    .unwrap();
    m.kill();
    m.restart().await.unwrap();
    let got = wait_received(&hook, before + 2).await;
    let killed: Vec<&Received> = got[before..]
        .iter()
        .filter(|r| String::from_utf8_lossy(&r.body).contains("\"killed\""))
        .collect();
    assert!(killed.len() >= 2, "pushed before and after the SIGKILL");
    assert!(killed.iter().all(|r| verifies(NEW, r) && verifies(OLD, r)));
    let kid: BTreeSet<&String> = killed.iter().map(|r| &r.headers["webhook-id"]).collect();
    assert_eq!(kid.len(), 1, "one webhook-id across the SIGKILL: {kid:?}");
    let attempts: BTreeSet<&String> = killed
        .iter()
        .map(|r| &r.headers["meshd-delivery-attempt"])
        .collect();
    assert!(attempts.len() >= 2, "{attempts:?}");

    // No credential reached the log.
    let log = std::fs::read_to_string(m.log_path()).unwrap();
    for secret in ["C2FVsBQIhrscChlQIMV", "MfKQ9r8GKYqrTwjUPD8", "s3cr3t"] {
        assert!(!log.contains(secret), "{secret} in the log");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_max_concurrency_and_a_rate_then_the_receiver_never_sees_more_at_once_or_faster() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 2).await;
    // A slow receiver: every request is held 200 ms.
    let slow = endpoint_with(vec![204], None, Duration::from_millis(200)).await;
    create_subscription(
        a,
        "bounded",
        json!({"topic": "t", "push": {"url": slow.url, "max_concurrency": 2}}),
    )
    .await;
    // A paced one: 5 per second.
    let paced = endpoint(vec![204]).await;
    create_subscription(
        a,
        "paced",
        json!({"topic": "t", "push": {"url": paced.url, "rate_per_s": 5}}),
    )
    .await;
    let got = client(a).subscription("paced").await.unwrap();
    assert_eq!(got["push"]["rate_per_s"], json!(5.0), "{got}");
    assert_eq!(got["push"]["max_concurrency"], json!(16), "{got}");
    for i in 0..12 {
        publish(a, "t", &event(&format!("e{i}"))).await.unwrap();
    }
    wait_received(&slow, 12).await;
    assert_eq!(
        slow.max_in_flight.load(Ordering::SeqCst),
        2,
        "two at once, never more (and the receiver was slow enough to see two)"
    );
    let got = wait_received(&paced, 12).await;
    // Starts are 200 ms apart; the receiver sees each head a little after its start,
    // so allow 10 % for scheduling on both sides.
    let span = got[11].at.duration_since(got[0].at);
    assert!(
        span >= Duration::from_millis(2000),
        "12 requests at 5/s span at least 11 intervals (2.2 s): {span:?}"
    );
    for w in got.windows(2) {
        let gap = w[1].at.duration_since(w[0].at);
        assert!(
            gap >= Duration::from_millis(150),
            "{gap:?} between two starts"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_when_the_owner_is_sigkilled_then_the_survivor_pushes_signed_with_the_same_webhook_ids(
) {
    let mut cluster = SmallCluster::start(2, Duration::from_millis(2000)).await;
    let nodes = &mut cluster.nodes;
    let a0 = nodes[0].addr().to_string();
    let a1 = nodes[1].addr().to_string();
    create_topic(&a0, "t", 4).await;
    // The receiver fails everything at first (so every event stays in flight or
    // waiting), then accepts.
    let hook = endpoint(vec![500, 500, 500, 500, 500, 500, 500, 500, 204]).await;
    create_subscription(
        &a1,
        "s",
        json!({"topic": "t", "ack_timeout_ms": 1000, "max_attempts": 50,
               "backoff": {"initial_ms": 500, "max_ms": 500},
               "push": signed_push(&hook.url, &[OLD])}),
    )
    .await;
    let published: Vec<Value> = (0..8).map(|i| event(&format!("c{i}"))).collect();
    for e in &published {
        publish(&a0, "t", e).await.unwrap();
    }
    wait_received(&hook, 8).await;
    nodes[0].kill();
    // Until every event got a 2xx: all pushes verify, each event keeps one id.
    let got = wait_until(DEADLINE, "every event pushed with a 2xx", || async {
        let got = hook.received();
        let accepted = got.len().saturating_sub(8);
        anyhow::ensure!(accepted >= 8, "{accepted} of 8 after the failures");
        let bodies: BTreeSet<String> = got[8..]
            .iter()
            .map(|r| serde_json::from_slice::<Value>(&r.body).unwrap()["id"].to_string())
            .collect();
        anyhow::ensure!(
            bodies.len() == 8,
            "{} distinct events accepted",
            bodies.len()
        );
        Ok(got)
    })
    .await
    .unwrap();
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for r in &got {
        assert!(verifies(OLD, r), "{:?}", r.headers);
        let body: Value = serde_json::from_slice(&r.body).unwrap();
        assert!(published.contains(&body), "{body}");
        ids.entry(body["id"].to_string())
            .or_default()
            .insert(r.headers["webhook-id"].clone());
    }
    assert_eq!(ids.len(), 8);
    assert!(
        ids.values().all(|s| s.len() == 1),
        "one webhook-id per event, on both instances and across the takeover: {ids:?}"
    );
}

/// Ids of `n` events per partition of a topic of `partitions`, in turn.
fn ids_spread(prefix: &str, partitions: u32, n: usize) -> Vec<String> {
    let mut per: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    let mut i = 0;
    while per.values().map(Vec::len).sum::<usize>() < n * partitions as usize {
        let id = format!("{prefix}{i}");
        let p = meshd_events::partition_for_key(id.as_bytes(), partitions);
        let of = per.entry(p).or_default();
        if of.len() < n {
            of.push(id);
        }
        i += 1;
    }
    let mut out = Vec::new();
    for k in 0..n {
        out.extend(per.values().map(|v| v[k].clone()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_cluster_then_the_instances_share_the_rate_and_each_keeps_max_concurrency_across_an_owner_s_sigkill(
) {
    let mut cluster = SmallCluster::start(2, Duration::from_millis(2000)).await;
    let a0 = cluster.nodes[0].addr().to_string();
    let a1 = cluster.nodes[1].addr().to_string();
    create_topic(&a0, "t", 4).await;
    cluster.wait_settled("t", 4).await;
    // 4 per second in total: each instance paces its share (its share of the
    // partitions), not the whole rate.
    let paced = endpoint(vec![204]).await;
    create_subscription(
        &a0,
        "paced",
        json!({"topic": "t", "push": {"url": paced.url, "rate_per_s": 4}}),
    )
    .await;
    // One request at a time per instance, to a receiver that holds each 200 ms.
    let slow = endpoint_with(vec![204], None, Duration::from_millis(200)).await;
    create_subscription(
        &a1,
        "bounded",
        json!({"topic": "t", "push": {"url": slow.url, "max_concurrency": 1}}),
    )
    .await;
    // Three events per partition: six per instance whatever the owners.
    let ids = ids_spread("r", 4, 3);
    for id in &ids {
        publish(&a0, "t", &event(id)).await.unwrap();
    }
    let got = wait_received(&paced, 12).await;
    let span = got[11].at.duration_since(got[0].at);
    // At 4/s in total the 12 starts take 2.75 s; an instance pacing at the whole
    // rate would push its six in 1.25 s, both at once in about that.
    assert!(
        span >= Duration::from_millis(2200),
        "12 pushes at 4/s in total took only {span:?}"
    );
    wait_received(&slow, 12).await;
    let most = slow.max_in_flight.load(Ordering::SeqCst);
    assert!(
        (1..=2).contains(&most),
        "at most one at a time per instance, two instances: {most}"
    );

    // One instance is SIGKILLed: the survivor owns every partition and takes the
    // whole rate; everything published before and after reaches both receivers.
    cluster.nodes[0].kill();
    // What the killed instance had at the receiver is answered first.
    wait_until(DEADLINE, "the slow receiver idle", || async {
        anyhow::ensure!(slow.in_flight.load(Ordering::SeqCst) == 0);
        Ok(())
    })
    .await
    .unwrap();
    slow.max_in_flight.store(0, Ordering::SeqCst);
    let later = ids_spread("s", 4, 2);
    for id in &later {
        publish(&a1, "t", &event(id)).await.unwrap();
    }
    for hook in [&paced, &slow] {
        wait_until(DEADLINE, "every event pushed", || async {
            // Unsigned push is binary mode: the id is a header.
            let seen: BTreeSet<String> = hook
                .received()
                .iter()
                .filter_map(|r| r.headers.get("ce-id").cloned())
                .collect();
            let missing = ids
                .iter()
                .chain(&later)
                .filter(|id| !seen.contains(*id))
                .count();
            anyhow::ensure!(missing == 0, "{missing} not pushed yet");
            Ok(())
        })
        .await
        .unwrap();
    }
    assert_eq!(
        slow.max_in_flight.load(Ordering::SeqCst),
        1,
        "one at a time on the survivor"
    );
    let after: Vec<_> = paced.received().into_iter().skip(12).collect();
    for w in after.windows(2) {
        let gap = w[1].at.duration_since(w[0].at);
        assert!(
            gap >= Duration::from_millis(200),
            "{gap:?} between two starts on the survivor (4/s: 250 ms)"
        );
    }
}

/// Stored push credentials stay with their receiver (http-api.md, "Security rules
/// (third round)"): a PUT that moves the push URL to another scheme, host or port
/// while sending `"***"` for a secret or a header value is a 400 naming the field,
/// and changes nothing; the same origin keeps them; fresh values go to the new
/// receiver, which never sees the old ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_stored_push_credentials_when_a_put_moves_the_url_to_another_receiver_then_redacted_values_are_refused(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    let hook = endpoint(vec![204]).await;
    let other = endpoint(vec![204]).await;
    create_subscription(
        &a,
        "s",
        json!({"topic": "t", "push": signed_push(&hook.url, &[OLD])}),
    )
    .await;
    let put = |push: Value| {
        let a = a.clone();
        async move {
            send_json(
                &a,
                "PUT",
                "/v1/subscriptions/s",
                &json!({"topic": "t", "push": push}),
            )
            .await
            .unwrap()
        }
    };
    for (push, field) in [
        (
            json!({"url": other.url, "secrets": ["***"],
                   "headers": {"authorization": TOKEN, "x-tenant": "acme"}}),
            "push.secrets",
        ),
        (
            json!({"url": other.url, "secrets": [NEW],
                   "headers": {"authorization": "***", "x-tenant": "acme"}}),
            "push.headers",
        ),
    ] {
        let r = put(push).await;
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains(field), "{field}: {}", r.body);
        assert!(r.body.contains("send the value again"), "{}", r.body);
    }
    let shown = client(&a).subscription("s").await.unwrap();
    assert_eq!(
        shown["push"]["url"],
        json!(hook.url),
        "nothing changed: {shown}"
    );

    // The same receiver at another path keeps them.
    let same = format!("{}?v=2", hook.url);
    let r = put(json!({"url": same, "secrets": ["***"],
                       "headers": {"authorization": "***", "x-tenant": "***"}}))
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    publish(&a, "t", &event("kept")).await.unwrap();
    let got = wait_received(&hook, 1).await;
    assert!(verifies(OLD, &got[0]) && got[0].headers["authorization"] == TOKEN);

    // Fresh values to the new receiver: it gets only those.
    let r = put(json!({"url": other.url, "secrets": [NEW],
                       "headers": {"authorization": "Bearer other"}}))
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    publish(&a, "t", &event("moved")).await.unwrap();
    let got = wait_received(&other, 1).await;
    assert!(verifies(NEW, &got[0]) && !verifies(OLD, &got[0]));
    assert_eq!(got[0].headers["authorization"], "Bearer other");
    assert!(
        !got[0].headers.contains_key("x-tenant"),
        "{:?}",
        got[0].headers
    );
}
