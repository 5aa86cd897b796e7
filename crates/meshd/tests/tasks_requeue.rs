//! A `working` task returns to `submitted` when its assignee's session ends: expired
//! (no heartbeat within its TTL) or taken over by a newer open of the same client id.
//! Through the real binary, over HTTP only.

mod common;

use common::*;
use meshd_test_support::http::{get, send_json};
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::time::Duration;

async fn open_session(a: &str, client: &str, ttl_ms: u64) -> Value {
    let r = send_json(
        a,
        "POST",
        "/v1/sessions",
        &json!({"client_id": client, "ttl_ms": ttl_ms}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    r.json().unwrap()
}

async fn claimed_task(a: &str, agent: &str, session: &str) -> String {
    let r = send_json(
        a,
        "POST",
        "/v1/tasks",
        &json!({"agent": agent, "input": {"n": 1}}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "{}", r.body);
    let id = r.json().unwrap()["id"].as_str().unwrap().to_string();
    let r = send_json(
        a,
        "POST",
        &format!("/v1/tasks/{id}/claim"),
        &json!({"session": session}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json().unwrap()["state"], "working");
    id
}

async fn wait_state(a: &str, id: &str, state: &str, deadline: Duration) -> Value {
    wait_until(deadline, &format!("task {id} {state}"), || async {
        let r = get(a, &format!("/v1/tasks/{id}")).await?;
        let t = r.json()?;
        anyhow::ensure!(t["state"] == state, "{t}");
        Ok(t)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_working_task_when_its_assignee_session_expires_then_it_returns_to_submitted() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let s = open_session(a, "agent-a", 2000).await;
    let id = claimed_task(a, "agent-a", s["session_id"].as_str().unwrap()).await;
    // No heartbeat: the session expires after its TTL; the sweep requeues the task.
    let t = wait_state(a, &id, "submitted", Duration::from_secs(20)).await;
    assert!(t["assignee"].is_null(), "the assignee is cleared: {t}");
    let states: Vec<&Value> = t["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| &h["state"])
        .collect();
    assert_eq!(states, vec!["submitted", "working", "submitted"], "{t}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_working_task_when_its_assignee_session_is_taken_over_then_it_returns_to_submitted_and_the_new_session_can_claim_it(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    // A long TTL: only the takeover can end the old session in time.
    let old = open_session(a, "agent-b", 600_000).await;
    let id = claimed_task(a, "agent-b", old["session_id"].as_str().unwrap()).await;
    let new = open_session(a, "agent-b", 600_000).await;
    assert!(new["epoch"].as_i64() > old["epoch"].as_i64(), "{old} {new}");
    wait_state(a, &id, "submitted", Duration::from_secs(20)).await;
    let r = send_json(
        a,
        "POST",
        &format!("/v1/tasks/{id}/claim"),
        &json!({"session": new["session_id"]}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    // The old holder's writes for the task are refused.
    let t = r.json().unwrap();
    let r = send_json(
        a,
        "POST",
        &format!("/v1/tasks/{id}/transition"),
        &json!({"to": "completed", "session": old["session_id"], "output": {}}),
    )
    .await
    .unwrap();
    assert!(
        matches!(r.status, 404 | 409),
        "the stale session cannot move it: {} {}",
        r.status,
        r.body
    );
    let now = get(a, &format!("/v1/tasks/{id}"))
        .await
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(now["state"], "working", "{now}");
    assert_eq!(now["version"], t["version"], "nothing was written: {now}");
}
