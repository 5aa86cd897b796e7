//! One instance cut off from etcd while another still reaches it (a TCP proxy between
//! the first instance and etcd, closed and reopened by the test): the cut-off instance
//! reports not ready and refuses Meta writes with 503/504 instead of pretending, the
//! other keeps working, and once the proxy is restored the first instance is ready
//! again and sees what was written meanwhile, without a restart. The cut is a clean
//! close or a blackhole (connections open and silent, held bytes delivered on heal).

mod common;

use common::*;
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http::{get, send_json};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::proxy::{Hold, TcpProxy};
use meshd_test_support::wait::wait_until;
use serde_json::json;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(30);

async fn readiness(a: &str) -> anyhow::Result<(u16, serde_json::Value)> {
    let r = get(a, "/readyz").await?;
    Ok((r.status, r.json()?))
}

async fn wait_ready(a: &str, want: u16) -> serde_json::Value {
    wait_until(DEADLINE, &format!("/readyz {want} on {a}"), || async {
        let (status, body) = readiness(a).await?;
        anyhow::ensure!(status == want, "{status}: {body}");
        Ok(body)
    })
    .await
    .unwrap()
}

/// Waits until `/readyz` is 503 with `meta:etcd` not ok. Meta's status is probed at
/// most once a second (a remote Meta), so readiness names it within that, possibly
/// after the caches have already said "loading".
async fn wait_not_ready_naming_meta(a: &str) -> serde_json::Value {
    wait_until(
        DEADLINE,
        &format!("/readyz 503 naming meta:etcd on {a}"),
        || async {
            let (status, body) = readiness(a).await?;
            anyhow::ensure!(
                status == 503 && body["checks"]["meta:etcd"] != "ok",
                "{status}: {body}"
            );
            Ok(body)
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_one_instance_cut_off_from_etcd_then_it_is_not_ready_and_refuses_writes_while_the_other_serves_and_it_recovers_when_reconnected(
) {
    one_instance_cut_off(Cut::Clean).await;
}

/// The same through a blackhole (connections stay open and silent, as a real network
/// partition leaves them): only keep-alives and timeouts can tell the instance, and
/// what it sent is delivered to etcd when the partition heals. So a write it answered
/// 503 ("not applied") must still be absent afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_one_instance_blackholed_from_etcd_then_it_is_not_ready_and_refuses_writes_truthfully_and_it_recovers_when_the_partition_heals(
) {
    one_instance_cut_off(Cut::Blackhole).await;
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Cut {
    Clean,
    Blackhole,
}

async fn one_instance_cut_off(how: Cut) {
    let etcd = EtcdProcess::start().await.unwrap();
    let proxy = TcpProxy::start(etcd.endpoint().parse().unwrap())
        .await
        .unwrap();
    let via_proxy = format!("etcd://{}", proxy.addr());
    let direct = format!("etcd://{}", etcd.endpoint());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = MeshdProcess::start(bin(), da.path(), &["--meta", &via_proxy])
        .await
        .unwrap();
    let b = MeshdProcess::start(bin(), db.path(), &["--meta", &direct])
        .await
        .unwrap();
    wait_ready(a.addr(), 200).await;
    wait_ready(b.addr(), 200).await;
    create_topic(b.addr(), "t", 1).await;
    let before = create_subscription(b.addr(), "s", json!({"topic": "t"})).await;
    wait_until(DEADLINE, "instance A sees the subscription", || async {
        answered(
            client(a.addr()).subscription_answer("s").await,
            200,
            "GET s",
        )?;
        Ok(())
    })
    .await
    .unwrap();

    match how {
        Cut::Clean => proxy.cut(),
        Cut::Blackhole => proxy.hold(Hold::Both),
    }
    wait_not_ready_naming_meta(a.addr()).await;
    let (status, body) = readiness(b.addr()).await.unwrap();
    assert_eq!(status, 200, "the other instance still reaches etcd: {body}");

    // The other instance writes; the cut-off one cannot, and says so: a topic, a new
    // subscription, and a conditional update of an existing one.
    create_subscription(b.addr(), "s-b", json!({"topic": "t"})).await;
    let revision = before["revision"].to_string();
    let writes = [
        send_json(a.addr(), "PUT", "/v1/topics/u", &json!({"partitions": 1})).await,
        send_json(
            a.addr(),
            "PUT",
            "/v1/subscriptions/s-a",
            &json!({"topic": "t"}),
        )
        .await,
        meshd_test_support::http::request_with(
            a.addr(),
            "PUT",
            "/v1/subscriptions/s",
            &[
                ("Content-Type", "application/json"),
                ("If-Match", &revision),
            ],
            json!({"topic": "t", "max_attempts": 9})
                .to_string()
                .as_bytes(),
        )
        .await,
    ];
    let mut refused = Vec::new();
    for r in writes {
        let r = r.unwrap();
        assert!(
            matches!(r.status, 503 | 504),
            "a write without Meta is refused honestly: {} {}",
            r.status,
            r.body
        );
        if r.status == 503 {
            assert!(
                r.headers
                    .iter()
                    .any(|(k, _)| k.eq_ignore_ascii_case("retry-after")),
                "{r:?}"
            );
        }
        refused.push(r.status);
    }

    proxy.restore();
    wait_ready(a.addr(), 200).await;
    wait_until(DEADLINE, "instance A sees B's subscription", || async {
        answered(
            client(a.addr()).subscription_answer("s-b").await,
            200,
            "GET s-b",
        )?;
        Ok(())
    })
    .await
    .unwrap();
    // What was answered 503 was not applied, even after the partition healed and
    // whatever the blackhole held reached etcd (asked of B, which never lost etcd).
    let b_meshd = client(b.addr());
    let after = [
        status_and_body(b_meshd.topic_answer("u").await).unwrap(),
        status_and_body(b_meshd.subscription_answer("s-a").await).unwrap(),
        status_and_body(b_meshd.subscription_answer("s").await).unwrap(),
    ];
    for (status, (what, (got, body))) in refused.iter().zip(
        ["topic u", "subscription s-a", "subscription s"]
            .iter()
            .zip(&after),
    ) {
        if *status != 503 {
            continue;
        }
        let applied = match *what {
            "subscription s" => body["max_attempts"] == 9,
            _ => *got == 200,
        };
        assert!(!applied, "{what} was answered 503 and yet applied: {body}");
    }
    // And it writes again, without a restart.
    create_topic(a.addr(), "u2", 1).await;
    let r = client(a.addr())
        .put_subscription_answer("s", &json!({"topic": "t", "max_attempts": 7}))
        .await;
    answered(r, 200, "PUT subscription s").unwrap();
}

/// The ambiguous outcome: instance A's writes reach etcd (which applies them) but etcd's
/// answers never come back (the proxy swallows them), so A cannot know. It must say 504
/// (outcome unknown), never 201 nor 503; a retry with the same task id after the link
/// heals returns the task that was written (200), once. A subscription PUT, which reads
/// before it writes, fails at the read: 503, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_etcd_applies_writes_but_its_answers_are_lost_then_the_writes_answer_504_and_a_retry_with_the_same_id_finds_the_task_once(
) {
    let etcd = EtcdProcess::start().await.unwrap();
    let proxy = TcpProxy::start(etcd.endpoint().parse().unwrap())
        .await
        .unwrap();
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = MeshdProcess::start(
        bin(),
        da.path(),
        &["--meta", &format!("etcd://{}", proxy.addr())],
    )
    .await
    .unwrap();
    let b = MeshdProcess::start(
        bin(),
        db.path(),
        &["--meta", &format!("etcd://{}", etcd.endpoint())],
    )
    .await
    .unwrap();
    wait_ready(a.addr(), 200).await;
    create_topic(a.addr(), "t", 1).await;
    let task = json!({"id": "job-1", "agent": "agent-1", "input": {"n": 1}});

    proxy.swallow_replies();
    let r = send_json(a.addr(), "POST", "/v1/tasks", &task)
        .await
        .unwrap();
    assert_eq!(r.status, 504, "outcome unknown: {}", r.body);
    let p = problem(&r, 504);
    assert!(
        p["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("/indeterminate")),
        "{p}"
    );
    let r = send_json(
        a.addr(),
        "PUT",
        "/v1/subscriptions/s",
        &json!({"topic": "t", "max_attempts": 7}),
    )
    .await
    .unwrap();
    let p = problem(&r, 503);
    assert_eq!(p["store"], "subscriptions", "{p}");
    // Meanwhile etcd applied the task: the other instance reads it.
    let r = answered(
        client(b.addr()).task_answer("job-1").await,
        200,
        "task job-1",
    )
    .unwrap_or_else(|e| panic!("the write reached etcd: {e:#}"));
    let version = r.json::<serde_json::Value>().unwrap()["version"].clone();
    wait_not_ready_naming_meta(a.addr()).await;
    let metrics = client(a.addr()).metrics().await.unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("meshd_meta_errors_total")
                && l.contains("kind=\"indeterminate\"")),
        "the unknown outcomes are counted:\n{metrics}"
    );

    proxy.restore();
    wait_ready(a.addr(), 200).await;
    // The client retries with the same id: the task that was written, not a second one.
    let r = client(a.addr())
        .submit_task_answer(Some("job-1"), "agent-1", &task["input"])
        .await;
    let r = answered(r, 200, "submit").unwrap_or_else(|e| panic!("the same task: {e:#}"));
    assert_eq!(r.json::<serde_json::Value>().unwrap()["version"], version);
    let listed = client(b.addr())
        .tasks(Some("agent-1"), None, None, None)
        .await
        .unwrap();
    let n = listed["tasks"]
        .as_array()
        .map(|t| t.iter().filter(|t| t["id"] == "job-1").count());
    assert_eq!(n, Some(1), "exactly one task job-1: {listed}");
    for m in [&a, &b] {
        let (status, body) =
            status_and_body(client(m.addr()).subscription_answer("s").await).unwrap();
        assert_eq!(status, 404, "the refused PUT wrote nothing: {body}");
    }
}
