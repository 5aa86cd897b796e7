//! Shared by the disk fault tests (`disk_failure.rs`, `disk_full.rs`): start meshd
//! under a fault shim, publish, and check readiness, metrics and the answers of a
//! fail-stopped store.

use super::{bin, browse_all, client, problem};
use anyhow::{anyhow, ensure};
use meshd_test_support::http::{self, request_with, Response};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::time::Duration;

/// How long a restarted instance may take to report ready (a debug build, 2 cores).
pub const READY: Duration = Duration::from_secs(30);

/// Starts meshd under a fault shim (its `env()`).
pub async fn start_faulted(dir: &std::path::Path, env: &[(String, String)]) -> MeshdProcess {
    MeshdProcess::start_with_env(bin(), dir, &[], env)
        .await
        .expect("start meshd under the fault shim")
}

/// Publishes one event in structured mode and returns the raw answer (built by hand: the
/// fault tests assert a refusal's every header and field, [`fail_stopped`]).
pub async fn try_publish(a: &str, topic: &str, event: &Value) -> Response {
    request_with(
        a,
        "POST",
        &format!("/v1/topics/{topic}/events"),
        &[("Content-Type", "application/cloudevents+json")],
        event.to_string().as_bytes(),
    )
    .await
    .unwrap()
}

/// `GET /readyz` → (status, body).
pub async fn readyz(a: &str) -> (u16, Value) {
    let r = http::get(a, "/readyz").await.unwrap();
    let body = r.json().unwrap();
    (r.status, body)
}

/// Waits until `/readyz` answers 200 ([`meshd_client::Client::ready`]).
pub async fn wait_ready(a: &str) {
    wait_until(READY, &format!("/readyz 200 on {a}"), || async move {
        let ready = client(a).ready().await?;
        ensure!(ready, "readyz 503");
        Ok(())
    })
    .await
    .unwrap();
}

/// Waits until this instance's membership is in Meta: its registration is the last
/// Meta write meshd makes by itself after boot, so the next one is the test's.
pub async fn wait_registered(a: &str) {
    wait_until(READY, "membership registered", || async move {
        let c = client(a).cluster().await?;
        let me = &c["instance"];
        let members = c["members"]
            .as_array()
            .ok_or_else(|| anyhow!("no members list: {c}"))?;
        ensure!(
            members.iter().any(|m| &m["instance"] == me),
            "{me} not among {members:?}"
        );
        Ok(())
    })
    .await
    .unwrap();
}

/// Asserts `/readyz` is 503 `unavailable` with each of `checks` in the given state.
pub async fn assert_not_ready(a: &str, checks: &[(&str, &str)]) -> Value {
    let (status, body) = readyz(a).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "unavailable", "{body}");
    for (check, state) in checks {
        assert_eq!(body["checks"][*check], *state, "check {check}: {body}");
    }
    body
}

pub use meshd_test_support::http::metric;

/// A fail-stop's refusal: 503 `unavailable` (not applied) naming `store` on
/// `backend`, saying that a restart is needed, with the slow `Retry-After` every
/// fail-stop 503 carries (only a restart cures it), and naming the failure once.
pub fn fail_stopped(r: &Response, store: &str, backend: &str) -> Value {
    let p = problem(r, 503);
    assert_eq!(p["type"], "https://meshd.dev/problems/unavailable", "{p}");
    assert_eq!(
        (&p["store"], &p["backend"]),
        (&json!(store), &json!(backend)),
        "{p}"
    );
    assert_eq!(
        r.header("retry-after"),
        Some("30"),
        "a fail-stop does not end by waiting soon: {p}"
    );
    let detail = p["detail"].as_str().unwrap();
    assert!(detail.contains("until meshd is restarted"), "{p}");
    assert_eq!(
        detail.matches("fail-stopped").count(),
        1,
        "the failure is said once: {p}"
    );
    p
}

/// The write whose own fsync failed: 504 `indeterminate` (it may or may not have
/// been applied) naming `store` on `backend`.
pub fn indeterminate(r: &Response, store: &str, backend: &str) -> Value {
    let p = problem(r, 504);
    assert_eq!(p["type"], "https://meshd.dev/problems/indeterminate", "{p}");
    assert_eq!(
        (&p["store"], &p["backend"]),
        (&json!(store), &json!(backend)),
        "{p}"
    );
    p
}

/// Every event of `topic` via browse, by id: (partition, offset, event). Asserts no id
/// appears twice.
pub async fn browse_by_id(
    a: &str,
    topic: &str,
    partitions: u64,
) -> BTreeMap<String, (u64, u64, Value)> {
    let mut all = BTreeMap::new();
    for p in 0..partitions {
        for (offset, e) in browse_all(a, topic, p).await {
            let id = e["id"].as_str().expect("an event id").to_string();
            let before = all.insert(id.clone(), (p, offset, e));
            assert!(before.is_none(), "event {id} is in the log twice");
        }
    }
    all
}

/// SIGKILLs and restarts `m` on its data dir (the disk healthy again), waits until it
/// is ready with healthy Local stores, and asserts that every acknowledged event of
/// `topic` is there once, at its partition and offset, exactly as published. Returns
/// the new address and every event by id.
pub async fn restarted_with_every_201(
    m: &mut MeshdProcess,
    topic: &str,
    partitions: u64,
    acknowledged: &BTreeMap<String, (u64, u64, Value)>,
) -> (String, BTreeMap<String, (u64, u64, Value)>) {
    m.kill();
    m.restart().await.unwrap();
    let a = m.addr().to_string();
    wait_ready(&a).await;
    assert_eq!(
        metric(&a, "meshd_local_healthy{backend=\"rocksdb\"}")
            .await
            .unwrap(),
        1.0
    );
    let after = browse_by_id(&a, topic, partitions).await;
    for (id, want) in acknowledged {
        assert_eq!(
            after.get(id),
            Some(want),
            "acknowledged event {id} after restart"
        );
    }
    (a, after)
}
