//! Two stories that cross features: deliveries bound to a session are fenced once the
//! session is taken over, and `/v1/cluster` shows every instance that holds a
//! membership lease in a shared etcd, and drops one that is killed.

mod common;

use common::*;
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http::send_json;
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_deliveries_bound_to_a_session_when_it_is_taken_over_then_its_acks_are_fenced_and_change_nothing(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t", "ack_timeout_ms": 60000})).await;
    publish(a, "t", &event("bound")).await.unwrap();
    let old = open_session(a, "consumer-1", 60000).await;
    let got = pull(
        a,
        "s",
        &json!({"max_events": 10, "wait_ms": 5000, "session": old["session_id"]}),
    )
    .await
    .unwrap();
    assert_eq!(got.len(), 1, "{got:?}");
    let new = open_session(a, "consumer-1", 60000).await;
    assert!(new["epoch"].as_i64() > old["epoch"].as_i64(), "{old} {new}");

    let r = send_json(
        a,
        "POST",
        "/v1/subscriptions/s/ack",
        &json!({"delivery_ids": ids(&got)}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 409, "every id fenced: {}", r.body);
    let p = problem(&r, 409);
    assert!(
        p["type"].as_str().is_some_and(|t| t.ends_with("/fenced")),
        "{p}"
    );
    assert_eq!(
        committed(a, "s", 0).await.unwrap(),
        0,
        "the fenced ack changed nothing"
    );
    // A pull naming an unknown session is refused before anything is leased.
    let r = send_json(
        a,
        "POST",
        "/v1/subscriptions/s/pull",
        &json!({"session": "00000000000000000000000000000000"}),
    )
    .await
    .unwrap();
    let p = problem(&r, 404);
    assert_eq!(p["field"], "session", "{p}");
}

async fn members(a: &str) -> anyhow::Result<Vec<String>> {
    let r = answered(client(a).cluster_answer().await, 200, "cluster")?;
    let v: Value = r.json()?;
    let mut m: Vec<String> = v["members"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no members list: {v}"))?
        .iter()
        .filter_map(|m| m["instance"].as_str().map(str::to_string))
        .collect();
    m.sort();
    Ok(m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_two_instances_on_one_etcd_when_one_is_killed_then_cluster_lists_both_then_only_the_survivor(
) {
    let etcd = EtcdProcess::start().await.unwrap();
    let meta = format!("etcd://{}", etcd.endpoint());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let args = |id: &'static str| vec!["--meta", "", "--instance-id", id, "--lease-ttl-ms", "2000"];
    let mut a_args = args("inst-a");
    a_args[1] = &meta;
    let mut b_args = args("inst-b");
    b_args[1] = &meta;
    let a = MeshdProcess::start(bin(), da.path(), &a_args)
        .await
        .unwrap();
    let mut b = MeshdProcess::start(bin(), db.path(), &b_args)
        .await
        .unwrap();
    create_topic(a.addr(), "t", 2).await;

    let both = vec!["inst-a".to_string(), "inst-b".to_string()];
    wait_until(Duration::from_secs(20), "both members", || async {
        let m = members(b.addr()).await?;
        anyhow::ensure!(m == both, "{m:?}");
        Ok(())
    })
    .await
    .unwrap();
    let v = client(a.addr()).cluster().await.unwrap();
    assert_eq!(v["instance"], "inst-a", "{v}");
    assert_eq!(v["meta"]["backend"], "etcd", "{v}");
    assert_eq!(v["meta"]["healthy"], true, "{v}");
    assert_eq!(v["partitions"].as_array().map(Vec::len), Some(2), "{v}");

    b.kill();
    // B's lease (2 s) runs out; A lists only itself.
    wait_until(Duration::from_secs(20), "only inst-a", || async {
        let m = members(a.addr()).await?;
        anyhow::ensure!(m == vec!["inst-a".to_string()], "{m:?}");
        Ok(())
    })
    .await
    .unwrap();
}
