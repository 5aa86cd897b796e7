//! Cells of the failure matrix (`docs/state-store-failure-matrix.md`) that no story of
//! another file covers, through the real binary: sessions and tasks across a SIGKILL
//! and restart on both Meta backends, tasks written concurrently through two instances
//! on one etcd, and the cross-store case of a dead letter due while the instance is cut
//! off from etcd (held, then written exactly once) with consumption of the rest going
//! on meanwhile.

mod common;

use common::*;
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http;
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::proxy::TcpProxy;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(30);

/// Submits task `id` for agent-1 ([`meshd_client::Client::submit_task_answer`]): the
/// answer's status and body.
async fn submit(a: &str, id: &str) -> (u16, Value) {
    let r = client(a)
        .submit_task_answer(Some(id), "agent-1", &json!({"id": id}))
        .await;
    status_and_body(r).unwrap()
}

/// Sessions and tasks live in Meta: a SIGKILL of meshd loses neither. The session's
/// lease outlives the process (embedded: re-armed with its full TTL at boot; etcd: kept
/// by etcd), so the client heartbeats it after the restart with the same epoch, and a
/// claimed task is still `working` with its assignee.
async fn sessions_and_tasks_survive_a_kill(mut m: MeshdProcess) {
    let a = m.addr().to_string();
    let s = open_session(&a, "agent-1", 60_000).await;
    let sid = s["session_id"].as_str().unwrap().to_string();
    assert_eq!(submit(&a, "job-1").await.0, 201);
    claim_task(&a, "job-1", &sid).await;
    assert_eq!(submit(&a, "job-2").await.0, 201);

    m.kill();
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    let r = client(&a).heartbeat_answer(&sid).await;
    let r = answered(r, 200, "heartbeat")
        .unwrap_or_else(|e| panic!("the session outlived the process: {e:#}"));
    assert_eq!(r.json::<Value>().unwrap()["epoch"], s["epoch"]);
    let t = task(&a, "job-1").await;
    assert_eq!(t["state"], "working", "{t}");
    assert_eq!(t["assignee"]["session"], sid.as_str(), "{t}");
    assert_eq!(task(&a, "job-2").await["state"], "submitted");
    // The same id again is the same task, not a new one.
    assert_eq!(submit(&a, "job-2").await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_embedded_meta_when_meshd_is_killed_and_restarted_then_sessions_and_tasks_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    sessions_and_tasks_survive_a_kill(start(dir.path()).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_etcd_meta_when_meshd_is_killed_and_restarted_then_sessions_and_tasks_are_kept() {
    let etcd = EtcdProcess::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(
        bin(),
        dir.path(),
        &["--meta", &format!("etcd://{}", etcd.endpoint())],
    )
    .await
    .unwrap();
    sessions_and_tasks_survive_a_kill(m).await;
}

/// Two instances on one etcd submit the same task ids concurrently and cancel them
/// concurrently: per id exactly one 201 (the rest 200 with the same version), exactly
/// one successful cancel (the other 422), and both instances read the same task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_two_instances_on_one_etcd_when_they_submit_and_cancel_the_same_tasks_concurrently_then_each_write_wins_once(
) {
    let etcd = EtcdProcess::start().await.unwrap();
    let meta = format!("etcd://{}", etcd.endpoint());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = MeshdProcess::start(bin(), da.path(), &["--meta", &meta])
        .await
        .unwrap();
    let b = MeshdProcess::start(bin(), db.path(), &["--meta", &meta])
        .await
        .unwrap();
    let addrs = [a.addr().to_string(), b.addr().to_string()];
    let ids: Vec<String> = (0..20).map(|i| format!("race-{i}")).collect();

    let mut submits = Vec::new();
    for id in &ids {
        for (k, addr) in addrs.iter().chain(addrs.iter()).enumerate() {
            let (addr, id) = (addr.clone(), id.clone());
            submits.push(tokio::spawn(async move {
                let r = submit(&addr, &id).await;
                (id, k, r)
            }));
        }
    }
    let mut answers: std::collections::BTreeMap<String, Vec<(u16, Value)>> = Default::default();
    for s in submits {
        let (id, _, r) = s.await.unwrap();
        answers.entry(id).or_default().push(r);
    }
    for (id, got) in &answers {
        let created = got.iter().filter(|(s, _)| *s == 201).count();
        let again = got.iter().filter(|(s, _)| *s == 200).count();
        assert_eq!((created, again), (1, 3), "{id}: {got:?}");
        let versions: std::collections::BTreeSet<String> =
            got.iter().map(|(_, v)| v["version"].to_string()).collect();
        assert_eq!(versions.len(), 1, "one task, one version: {id} {got:?}");
    }

    let mut cancels = Vec::new();
    for id in &ids {
        for addr in &addrs {
            let (addr, id) = (addr.clone(), id.clone());
            cancels.push(tokio::spawn(async move {
                let (status, _) =
                    status_and_body(client(&addr).cancel_task_answer(&id).await).unwrap();
                (id, status)
            }));
        }
    }
    let mut outcomes: std::collections::BTreeMap<String, Vec<u16>> = Default::default();
    for c in cancels {
        let (id, status) = c.await.unwrap();
        outcomes.entry(id).or_default().push(status);
    }
    for (id, mut got) in outcomes {
        got.sort();
        assert_eq!(
            got,
            vec![200, 422],
            "{id}: one cancel wins, the other finds it terminal"
        );
        let (ta, tb) = (task(&addrs[0], &id).await, task(&addrs[1], &id).await);
        assert_eq!(ta["state"], "canceled", "{ta}");
        assert_eq!(ta["version"], tb["version"], "{ta} {tb}");
        let cancels = ta["history"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|h| h["state"] == "canceled")
            .count();
        assert_eq!(cancels, 1, "{ta}");
    }
}

/// Cross-store: a consumer fails an event for the last time while this instance is cut
/// off from etcd. The dead letter cannot be written: the delivery is held
/// (`dead_lettering`, shown in a gauge), neither lost nor redelivered, while the Local
/// stores go on serving the other events (pull, ack, committed offset). When etcd is
/// reachable again the entry is written exactly once and the offset moves past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_instance_cut_off_from_etcd_when_a_dead_letter_is_due_then_it_is_held_while_consumption_goes_on_and_written_once_on_reconnect(
) {
    let etcd = EtcdProcess::start().await.unwrap();
    let proxy = TcpProxy::start(etcd.endpoint().parse().unwrap())
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(
        bin(),
        dir.path(),
        &["--meta", &format!("etcd://{}", proxy.addr())],
    )
    .await
    .unwrap();
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(
        &a,
        "s",
        json!({"topic": "t", "max_attempts": 1, "ack_timeout_ms": 60000}),
    )
    .await;
    publish(&a, "t", &event("poison")).await.unwrap();
    for i in 0..5 {
        publish(&a, "t", &event(&format!("ok-{i}"))).await.unwrap();
    }
    let poison = pull(&a, "s", &json!({"max_events": 1, "wait_ms": 5000}))
        .await
        .unwrap();
    assert_eq!(summary(&poison), vec![(0, 0, 1)]);

    proxy.cut();
    let r = nack(&a, "s", &ids(&poison), "cannot parse").await.unwrap();
    assert_eq!(
        set(&r["dead_lettering"]).len(),
        1,
        "held while the dead-letter store is unreachable: {r}"
    );
    wait_until(DEADLINE, "the held delivery in the gauge", || async {
        let held = http::metric(&a, r#"meshd_dead_lettering_deliveries{subscription="s"}"#).await?;
        anyhow::ensure!(held == 1.0, "{held}");
        Ok(())
    })
    .await
    .unwrap();
    // The Local stores serve the rest meanwhile.
    let rest = pull_until(&a, "s", 5, DEADLINE).await;
    assert_eq!(
        rest.iter().map(|d| d.offset).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5]
    );
    let r = ack(&a, "s", &ids(&rest)).await.unwrap();
    assert_eq!(set(&r["acked"]).len(), 5, "{r}");
    assert_eq!(
        committed(&a, "s", 0).await.unwrap(),
        0,
        "the held event keeps the offset"
    );

    proxy.restore();
    wait_committed(&a, "s", 0, 6).await;
    let entries = dead_letters(&a, "s").await;
    assert_eq!(entries.len(), 1, "exactly once: {entries:?}");
    assert_eq!(entries[0]["reason"], "cannot parse");
    assert_eq!(entries[0]["offset"], 0);
    // The gauges are recomputed every 250 ms (STATS_EVERY in runtime/partition/mod.rs),
    // so the held count reaches 0 within that after the entry is written, not at once.
    wait_until(DEADLINE, "no held delivery in the gauge", || async {
        let held = http::metric(&a, r#"meshd_dead_lettering_deliveries{subscription="s"}"#).await?;
        anyhow::ensure!(held == 0.0, "{held}");
        Ok(())
    })
    .await
    .unwrap();
    assert_no_delivery(
        &a,
        "s",
        500,
        "the dead-lettered event is not delivered again",
    )
    .await;
}
