//! Security, continued, through the real binary: answers
//! bounded in bytes (http-api.md "Bounded answers"), forwarded pulls that pass on the
//! caller's byte budget and release what never reached it, and quotas on what clients
//! create ("Quotas and browser safety").
//!
//! The stories these pin: one pull of 48 events of ~1 MiB answered 47 MiB (1000 such
//! events would have been ~2 GiB in memory); browse, dead-letter and task lists had no
//! byte bound either. In cluster mode the owner counted the attempts of a forwarded
//! pull, and the forwarding instance then dropped an answer over 64 MiB (or slower than
//! its peer timeout): the events were leased to nobody and, after `max_attempts` such
//! rounds, dead-lettered without reaching anyone. Nothing bounded what clients create:
//! tasks filled etcd's quota, and every instance's Meta writes failed with it.

mod common;

use common::disk::metric;
use common::{bin, create_subscription, create_topic, problem, pull, Delivery};
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http::{get, send_json};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::nats::NatsProcess;
use meshd_test_support::proxy::TcpProxy;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;

/// A CloudEvent whose stored form is about `bytes` long.
fn sized_event(id: &str, bytes: usize) -> Value {
    json!({
        "specversion": "1.0",
        "id": id,
        "source": "/bounds",
        "type": "test.large",
        "data": {"pad": "x".repeat(bytes.saturating_sub(120))}
    })
}

async fn publish_sized(a: &str, topic: &str, n: usize, bytes: usize) {
    for i in 0..n {
        common::publish(a, topic, &sized_event(&format!("e{i}"), bytes))
            .await
            .unwrap();
    }
}

/// The stored bytes of the events of an answer (as returned: exactly as published).
fn event_bytes(ds: &[Delivery]) -> usize {
    ds.iter().map(|d| d.event.to_string().len()).sum()
}

const MIB: usize = 1024 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_large_events_then_a_pull_answers_at_most_its_byte_budget_and_leases_only_what_it_returns(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(bin(), dir.path(), &["--max-response-bytes", "2097152"])
        .await
        .unwrap();
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(
        a,
        "s",
        json!({"topic": "t", "start": "earliest", "ack_timeout_ms": 60000}),
    )
    .await;
    publish_sized(a, "t", 12, 300 * 1024).await;

    // The ceiling (2 MiB) holds whatever is asked: 6 events of 300 KiB fit, the 7th
    // would pass it. Before, one answer held all 12 (3.6 MiB).
    let first = pull(
        a,
        "s",
        &json!({"max_events": 1000, "max_bytes": 1u64 << 40}),
    )
    .await
    .unwrap();
    assert_eq!(first.len(), 6, "{}", event_bytes(&first));
    assert!(event_bytes(&first) <= 2 * MIB);
    // `max_bytes` smaller than one event: still one delivery, so nothing is stuck.
    let one = pull(a, "s", &json!({"max_events": 1000, "max_bytes": 1}))
        .await
        .unwrap();
    assert_eq!(one.len(), 1);
    // Only what was returned was leased: the rest goes out at once, each as its first
    // attempt (the 60 s lease of a leased-but-unreturned event would hold it back).
    let rest = pull(a, "s", &json!({"max_events": 1000, "max_bytes": 1_000_000}))
        .await
        .unwrap();
    assert_eq!(rest.len(), 3, "300 KiB events under a 1 MB budget");
    let last = pull(a, "s", &json!({"max_events": 1000})).await.unwrap();
    let all: Vec<&Delivery> = first.iter().chain(&one).chain(&rest).chain(&last).collect();
    let offsets: BTreeSet<u64> = all.iter().map(|d| d.offset).collect();
    assert_eq!(
        offsets,
        (0..12).collect(),
        "every event once, in order of pulls"
    );
    assert_eq!(all.len(), 12, "no event twice");
    assert!(all.iter().all(|d| d.attempt == 1));

    // `max_bytes` must be a positive integer.
    let r = send_json(
        a,
        "POST",
        "/v1/subscriptions/s/pull",
        &json!({"max_bytes": 0}),
    )
    .await
    .unwrap();
    assert_eq!(problem(&r, 400)["field"], "max_bytes");
}

/// A meshd with topic `t` (one partition) holding 5 events of 100 KiB, and
/// subscription `s` on it that dead-letters at the first nack.
async fn large_events() -> (tempfile::TempDir, MeshdProcess) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(
        a,
        "s",
        json!({"topic": "t", "start": "earliest", "max_attempts": 1}),
    )
    .await;
    publish_sized(a, "t", 5, 100 * 1024).await;
    (dir, m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_large_events_then_browse_stops_at_max_bytes_with_a_cursor_that_goes_on() {
    let (_dir, m) = large_events().await;
    let a = m.addr();
    // Browse: 2 events of 100 KiB fit 250 000 bytes; the cursor goes on from offset 2.
    let r = get(
        a,
        "/v1/topics/t/partitions/0/events?from=0&max_bytes=250000",
    )
    .await
    .unwrap();
    let page = r.json().unwrap();
    let got: Vec<u64> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["offset"].as_u64().unwrap())
        .collect();
    assert_eq!(got, [0, 1], "{}", r.body.len());
    assert_eq!(page["next_cursor"], "2");
    let r = get(
        a,
        "/v1/topics/t/partitions/0/events?from=2&max_bytes=100000000",
    )
    .await
    .unwrap();
    let page = r.json().unwrap();
    assert_eq!(page["events"].as_array().unwrap().len(), 3);
    assert!(
        page.get("next_cursor").is_none(),
        "the end: {}",
        page["next_cursor"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_large_dead_letters_then_the_list_stops_at_max_bytes_and_its_cursor_walks_every_entry_once(
) {
    let (_dir, m) = large_events().await;
    let a = m.addr();
    // Dead letters: each nacked event is dead-lettered at once (max_attempts 1).
    let ds = common::pull_until(a, "s", 5, Duration::from_secs(20)).await;
    let r = common::nack(a, "s", &common::ids(&ds), "poison")
        .await
        .unwrap();
    assert_eq!(r["dead_lettered"].as_array().unwrap().len(), 5, "{r}");
    let mut seen = BTreeSet::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/deadletters?max_bytes=250000&cursor={c}"),
            None => "/v1/deadletters?max_bytes=250000".to_string(),
        };
        let page = get(a, &path).await.unwrap().json().unwrap();
        let entries = page["entries"].as_array().unwrap();
        assert!(
            !entries.is_empty() && entries.len() <= 2,
            "{}",
            entries.len()
        );
        for e in entries {
            assert!(seen.insert(e["offset"].as_u64().unwrap()), "an entry twice");
        }
        pages += 1;
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, (0..5).collect());
    assert_eq!(pages, 3, "2 + 2 + 1 entries of 100 KiB under 250 000 bytes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_large_task_inputs_then_the_list_stops_at_max_bytes_and_its_cursor_walks_every_task_once(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let a = m.addr();
    // Tasks: inputs of 100 KiB, listed 2 at a time under 250 000 bytes.
    for i in 0..5 {
        let id = format!("task-{i}");
        let input = json!({"pad": "y".repeat(100 * 1024)});
        let r = common::client(a)
            .submit_task_answer(Some(&id), "ag", &input)
            .await;
        common::answered(r, 201, "submit").unwrap();
    }
    let mut listed = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/tasks?max_bytes=250000&cursor={c}"),
            None => "/v1/tasks?max_bytes=250000".to_string(),
        };
        let page = get(a, &path).await.unwrap().json().unwrap();
        let tasks = page["tasks"].as_array().unwrap();
        assert!(!tasks.is_empty() && tasks.len() <= 2, "{}", tasks.len());
        listed.extend(tasks.iter().map(|t| t["id"].as_str().unwrap().to_string()));
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    assert_eq!(
        listed,
        (0..5).map(|i| format!("task-{i}")).collect::<Vec<_>>()
    );
}

/// Two instances on one etcd and one JetStream; instance `a` is reached by its peer
/// only through a proxy (its `--advertise` address), so the test can swallow the
/// answers of the pulls forwarded to it.
struct TwoInstances {
    a: MeshdProcess,
    b: MeshdProcess,
    proxy: TcpProxy,
    _etcd: EtcdProcess,
    _nats: NatsProcess,
    _dirs: [tempfile::TempDir; 2],
}

impl TwoInstances {
    async fn start() -> Self {
        let etcd = EtcdProcess::start().await.unwrap();
        let nats = NatsProcess::start().await.unwrap();
        let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
        let secret = dirs[0].path().join("secret");
        std::fs::write(&secret, "bounds-secret-0123456789abcdef0123456789abcdef\n").unwrap();
        let common = [
            "--meta".to_string(),
            format!("etcd://{}", etcd.endpoint()),
            "--log".to_string(),
            nats.url(),
            "--cluster-secret-file".to_string(),
            secret.to_string_lossy().into_owned(),
            "--lease-ttl-ms".to_string(),
            "2000".to_string(),
        ];
        // The proxy's upstream is set once `a` listens (its port is picked at start).
        let proxy = TcpProxy::start("127.0.0.1:1".parse().unwrap())
            .await
            .unwrap();
        let advertise = proxy.addr().to_string();
        let mut args: Vec<&str> = common.iter().map(String::as_str).collect();
        args.extend(["--instance-id", "inst-a", "--advertise", &advertise]);
        let a = MeshdProcess::start(bin(), dirs[0].path(), &args)
            .await
            .unwrap();
        proxy.set_upstream(a.addr().parse().unwrap());
        let mut args: Vec<&str> = common.iter().map(String::as_str).collect();
        args.extend(["--instance-id", "inst-b"]);
        let b = MeshdProcess::start(bin(), dirs[1].path(), &args)
            .await
            .unwrap();
        Self {
            a,
            b,
            proxy,
            _etcd: etcd,
            _nats: nats,
            _dirs: dirs,
        }
    }

    /// A one-partition topic that `inst-a` owns (topics are tried until rendezvous
    /// hashing gives one to `a`), with subscription `s` on it.
    async fn topic_owned_by_a(&self, sub: Value) -> String {
        for i in 0..16 {
            let topic = format!("t{i}");
            create_topic(self.a.addr(), &topic, 1).await;
            let owner = wait_until(Duration::from_secs(30), "an owner", || async {
                let v = common::client(self.b.addr()).cluster().await?;
                let row = v["partitions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|p| p["topic"] == topic.as_str())
                    .cloned();
                match row.as_ref().and_then(|p| p["owner"].as_str()) {
                    Some(o) => Ok(o.to_string()),
                    None => anyhow::bail!("no owner yet: {row:?}"),
                }
            })
            .await
            .unwrap();
            if owner == "inst-a" {
                let mut body = sub.clone();
                body["topic"] = Value::from(topic.as_str());
                create_subscription(self.a.addr(), "s", body).await;
                return topic;
            }
        }
        panic!("no topic of 16 went to inst-a");
    }

    /// Waits until `b` forwards pulls of `topic` to its owner `a` (`b` learns owners
    /// from Meta asynchronously): a probe event published and pulled through `b`,
    /// then acked. It takes offset 0.
    async fn probe_forwarding(&self, topic: &str) {
        common::publish(self.b.addr(), topic, &sized_event("probe", 200))
            .await
            .unwrap();
        let d = common::pull_until(self.b.addr(), "s", 1, Duration::from_secs(30)).await;
        let r = common::ack(self.b.addr(), "s", &common::ids(&d))
            .await
            .unwrap();
        assert_eq!(r["acked"].as_array().unwrap().len(), 1, "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_large_events_pulled_through_a_non_owner_then_every_answer_fits_the_budget_and_every_event_arrives_once_as_attempt_1(
) {
    let c = TwoInstances::start().await;
    let topic = c
        .topic_owned_by_a(json!({"start": "earliest", "ack_timeout_ms": 60000, "max_attempts": 2}))
        .await;
    c.probe_forwarding(&topic).await;
    // 70 events of ~1 MB: 70 MB in all. Before, the owner handed all of them to one
    // forwarded pull, whose answer passed the 64 MiB read limit of the instance that
    // asked: leased to nobody, then dead-lettered after two such rounds.
    publish_sized(c.b.addr(), &topic, 70, 1_000_000).await;
    let mut got: Vec<Delivery> = Vec::new();
    for _ in 0..10 {
        let batch = pull(c.b.addr(), "s", &json!({"max_events": 1000}))
            .await
            .unwrap();
        assert!(
            batch.len() <= 1 || event_bytes(&batch) <= 16 * MIB,
            "{} events, {} bytes",
            batch.len(),
            event_bytes(&batch)
        );
        got.extend(batch);
    }
    let offsets: BTreeSet<u64> = got.iter().map(|d| d.offset).collect();
    assert_eq!(offsets, (1..=70).collect(), "every event arrived");
    assert_eq!(got.len(), 70, "none twice");
    assert!(
        got.iter().all(|d| d.attempt == 1),
        "nothing was leased to nobody"
    );
    assert_eq!(
        metric(c.b.addr(), "meshd_forwarded_pull_releases_total")
            .await
            .unwrap(),
        0.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_forwarded_pull_whose_answer_is_lost_then_the_owner_releases_it_and_it_is_delivered_at_once_with_the_same_attempt(
) {
    let c = TwoInstances::start().await;
    let topic = c
        .topic_owned_by_a(json!({"start": "earliest", "ack_timeout_ms": 60000, "max_attempts": 1}))
        .await;
    c.probe_forwarding(&topic).await;
    common::publish(c.b.addr(), &topic, &sized_event("lost", 500))
        .await
        .unwrap();
    // The owner learns of an append by another instance through the log's notices:
    // wait until it counts the event, so that the forwarded pull below finds it (a
    // forwarded pull does not wait, and the next one would come only after `b` gave
    // up on the first).
    wait_until(
        Duration::from_secs(15),
        "the owner sees the event",
        || async {
            let n = metric(c.a.addr(), r#"meshd_backlog_events{subscription="s"}"#).await?;
            anyhow::ensure!(n >= 1.0, "backlog {n}");
            Ok(())
        },
    )
    .await
    .unwrap();
    // The pull reaches the owner (which leases the event and answers), but no answer
    // comes back to `b`: `b` gives up on it and asks the owner to release what it
    // handed out (that request still gets through).
    c.proxy.swallow_replies();
    let lost = pull(c.b.addr(), "s", &json!({"max_events": 10, "wait_ms": 2000}))
        .await
        .unwrap();
    assert!(lost.is_empty(), "{lost:?}");
    wait_until(Duration::from_secs(15), "the owner released it", || async {
        let n = metric(c.a.addr(), "meshd_deliveries_released_total").await?;
        anyhow::ensure!(n >= 1.0, "released {n}");
        Ok(())
    })
    .await
    .unwrap();
    c.proxy.restore();
    assert!(
        metric(c.b.addr(), "meshd_forwarded_pull_releases_total")
            .await
            .unwrap()
            >= 1.0
    );
    // Due again at once (its 60 s lease does not hold it back), as attempt 1 again:
    // with max_attempts 1 a counted attempt would have dead-lettered it unseen.
    let again = wait_until(Duration::from_secs(15), "the released event", || async {
        let d = pull(c.b.addr(), "s", &json!({"max_events": 10})).await?;
        anyhow::ensure!(!d.is_empty(), "nothing yet");
        Ok(d)
    })
    .await
    .unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].offset, again[0].attempt), (1, 1));
    let r = common::ack(c.b.addr(), "s", &common::ids(&again))
        .await
        .unwrap();
    assert_eq!(r["acked"].as_array().unwrap().len(), 1, "{r}");
}

/// Issue 46 item 8: quotas counted from a cache that follows Meta's watch let an
/// instance's own creates through while the watch lagged (a fourth task of an agent
/// with `--max-tasks-per-agent 3`, submitted right after the third, was 201 in one
/// run of four). An instance now counts its own creates at once: sequential creates
/// never pass a quota, and neither does a concurrent burst on one instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_quotas_then_one_instances_own_creates_never_pass_them_sequential_or_concurrent() {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(
        bin(),
        dir.path(),
        &[
            "--max-tasks-per-agent",
            "3",
            "--max-topics",
            "12",
            "--max-sessions",
            "6",
        ],
    )
    .await
    .unwrap();
    let a = m.addr();
    let submit = |id: String, agent: String| async move {
        send_json(
            a,
            "POST",
            "/v1/tasks",
            &json!({"id": id, "agent": agent, "input": {}}),
        )
        .await
        .unwrap()
    };
    // In sequence, right after each other: the fourth of every agent is refused.
    for agent in 0..20 {
        for i in 0..3 {
            let r = submit(format!("a{agent}-{i}"), format!("agent-{agent}")).await;
            assert_eq!(r.status, 201, "{}", r.body);
        }
        quota_problem(
            &submit(format!("a{agent}-3"), format!("agent-{agent}")).await,
            "tasks_per_agent",
        );
    }
    // A burst of 12 at once for one agent: exactly 3 are created.
    let burst = futures::future::join_all(
        (0..12).map(|i| submit(format!("burst-{i}"), "burst-agent".to_string())),
    )
    .await;
    let created = burst.iter().filter(|r| r.status == 201).count();
    assert_eq!(
        created,
        3,
        "{:?}",
        burst.iter().map(|r| r.status).collect::<Vec<_>>()
    );
    for r in burst.iter().filter(|r| r.status != 201) {
        quota_problem(r, "tasks_per_agent");
    }
    // Topics and sessions in a burst: never more than the quota.
    let topics = futures::future::join_all((0..20).map(|i| async move {
        send_json(
            a,
            "PUT",
            &format!("/v1/topics/t{i}"),
            &json!({"partitions": 1}),
        )
        .await
        .unwrap()
        .status
    }))
    .await;
    assert_eq!(
        topics.iter().filter(|s| **s == 201).count(),
        12,
        "{topics:?}"
    );
    let sessions = futures::future::join_all((0..10).map(|i| async move {
        send_json(
            a,
            "POST",
            "/v1/sessions",
            &json!({"client_id": format!("c{i}")}),
        )
        .await
        .unwrap()
        .status
    }))
    .await;
    assert_eq!(
        sessions.iter().filter(|s| **s == 201).count(),
        6,
        "{sessions:?}"
    );
}

fn quota_problem(r: &meshd_test_support::http::Response, quota: &str) {
    let p = problem(r, 429);
    assert!(
        p["type"].as_str().unwrap().ends_with("/quota-exceeded"),
        "{p}"
    );
    assert_eq!(p["quota"], quota, "{p}");
    assert!(r.header("retry-after").is_none(), "no Retry-After: {p}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_quotas_then_creates_beyond_them_are_429_quota_exceeded_and_nothing_is_stored_while_existing_records_and_takeovers_pass(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(
        bin(),
        dir.path(),
        &[
            "--max-topics",
            "2",
            "--max-subscriptions",
            "1",
            "--max-sessions",
            "2",
            "--max-tasks",
            "3",
            "--max-tasks-per-agent",
            "2",
            "--max-task-bytes",
            "4194304",
        ],
    )
    .await
    .unwrap();
    let a = m.addr();
    let put =
        |path: String, body: Value| async move { send_json(a, "PUT", &path, &body).await.unwrap() };

    // Topics and subscriptions: the create beyond is refused, a PUT of an existing
    // one is not, and nothing was stored.
    create_topic(a, "t1", 1).await;
    create_topic(a, "t2", 1).await;
    quota_problem(
        &put("/v1/topics/t3".into(), json!({"partitions": 1})).await,
        "topics",
    );
    assert_eq!(get(a, "/v1/topics/t3").await.unwrap().status, 404);
    assert_eq!(
        put("/v1/topics/t1".into(), json!({"partitions": 1}))
            .await
            .status,
        200
    );
    create_subscription(a, "s1", json!({"topic": "t1"})).await;
    quota_problem(
        &put("/v1/subscriptions/s2".into(), json!({"topic": "t1"})).await,
        "subscriptions",
    );
    assert_eq!(get(a, "/v1/subscriptions/s2").await.unwrap().status, 404);
    assert_eq!(
        put("/v1/subscriptions/s1".into(), json!({"topic": "t1"}))
            .await
            .status,
        200
    );

    // Sessions: a third client is refused; a takeover of a live client id is not.
    let open = |client: &'static str| async move {
        send_json(a, "POST", "/v1/sessions", &json!({"client_id": client}))
            .await
            .unwrap()
    };
    assert_eq!(open("c1").await.status, 201);
    assert_eq!(open("c2").await.status, 201);
    quota_problem(&open("c3").await, "sessions");
    assert_eq!(open("c1").await.status, 201, "a takeover is never refused");

    // Tasks: per agent, then in all; an idempotent re-submit at the quota passes.
    let submit = |id: &'static str, agent: &'static str, pad: usize| async move {
        send_json(
            a,
            "POST",
            "/v1/tasks",
            &json!({"id": id, "agent": agent, "input": {"pad": "z".repeat(pad)}}),
        )
        .await
        .unwrap()
    };
    assert_eq!(submit("k1", "x", 10).await.status, 201);
    assert_eq!(submit("k2", "x", 10).await.status, 201);
    // No wait for the usage cache: this instance counts its own creates at once.
    quota_problem(&submit("k3", "x", 10).await, "tasks_per_agent");
    assert_eq!(
        submit("k1", "x", 10).await.status,
        200,
        "idempotent re-submit"
    );
    assert_eq!(submit("k4", "y", 10).await.status, 201);
    // No wait for the usage cache: this instance counts its own creates at once.
    quota_problem(&submit("k5", "z", 10).await, "tasks");
    assert_eq!(
        get(a, "/v1/tasks/k5").await.unwrap().status,
        404,
        "nothing stored"
    );

    // Bytes of tasks of every state: a submit-then-cancel loop of ~250 KB tasks stops
    // at --max-task-bytes (4 MiB), although none of them is left unfinished.
    for id in ["k1", "k2", "k4"] {
        let r = send_json(a, "POST", &format!("/v1/tasks/{id}/cancel"), &json!({}))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let mut stored = 0;
    let mut refused = None;
    for i in 0..30 {
        let id = format!("big-{i}");
        let r = send_json(
            a,
            "POST",
            "/v1/tasks",
            &json!({"id": id, "agent": "w", "input": {"pad": "q".repeat(250_000)}}),
        )
        .await
        .unwrap();
        if r.status == 429 {
            refused = Some(r);
            break;
        }
        assert_eq!(r.status, 201, "{}", r.body);
        stored += 1;
        let r = send_json(a, "POST", &format!("/v1/tasks/{id}/cancel"), &json!({}))
            .await
            .unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        // Each counted before the next (the cache follows Meta's changes).
        wait_until(
            Duration::from_secs(10),
            "the task cache counts it",
            || async {
                let n = metric(a, "meshd_quota_used{quota=\"task_bytes\"}").await?;
                anyhow::ensure!(n >= (stored * 250_000) as f64, "{n}");
                Ok(())
            },
        )
        .await
        .unwrap();
    }
    quota_problem(
        &refused.expect("the byte quota refused a submit"),
        "task_bytes",
    );
    assert!(
        (15..=17).contains(&stored),
        "{stored} tasks of ~250 KB under 4 MiB"
    );
    for (quota, n) in [
        ("topics", 1.0),
        ("subscriptions", 1.0),
        ("sessions", 1.0),
        ("tasks", 1.0),
        ("tasks_per_agent", 1.0),
        ("task_bytes", 1.0),
    ] {
        assert_eq!(
            metric(
                a,
                &format!("meshd_quota_refused_total{{quota=\"{quota}\"}}")
            )
            .await
            .unwrap(),
            n,
            "{quota}"
        );
    }
}
