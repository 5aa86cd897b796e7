//! A `working` task returns to `submitted` when its assignee's session ends: expired
//! (no heartbeat within its TTL) or taken over by a newer open of the same client id.
//! Through the real binary, over HTTP only.

mod common;

use common::*;
use meshd_test_support::http::send_json;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::time::Duration;

async fn claimed_task(a: &str, agent: &str, session: &str) -> String {
    let r = client(a)
        .submit_task_answer(None, agent, &json!({"n": 1}))
        .await;
    let r = answered(r, 201, "submit").unwrap_or_else(|e| panic!("{e:#}"));
    let id = r.json::<Value>().unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(claim_task(a, &id, session).await["state"], "working");
    id
}

async fn wait_state(a: &str, id: &str, state: &str, deadline: Duration) -> Value {
    wait_until(deadline, &format!("task {id} {state}"), || async {
        let t = client(a).task(id).await?;
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
    let t = claim_task(a, &id, new["session_id"].as_str().unwrap()).await;
    // The old holder's writes for the task are refused.
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
    let now = client(a).task(&id).await.unwrap();
    assert_eq!(now["state"], "working", "{now}");
    assert_eq!(now["version"], t["version"], "nothing was written: {now}");
}
