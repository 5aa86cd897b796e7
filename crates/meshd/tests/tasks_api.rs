//! The Tasks routes of the HTTP contract (`../shared/design/http-api.md`, "Tasks")
//! through the real binary.
//!
//! The failures these tests pin:
//!
//! * a transition the state machine forbids is applied, or a terminal state is
//!   overwritten (the table test walks every state to every target over HTTP);
//! * a repeated submit creates a second task or a conflicting one is accepted; a
//!   stale `If-Match` wins; a session of another client claims a task; a task is
//!   claimed twice; a taken-over session still moves its task;
//! * with etcd as Meta: a submit answered 201 that is not durable, a submit answered
//!   503 that was written anyway, a 201 while etcd is paused, readiness that stays
//!   green through an outage, or a meshd that needs a restart once etcd is back.

mod common;

use anyhow::{anyhow, ensure, Context};
use common::{problem, start};
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http::{self, request_with, send_json, Response};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const AGENT: &str = "agent-a";

const STATES: [&str; 7] = [
    "submitted",
    "working",
    "input-required",
    "completed",
    "failed",
    "canceled",
    "rejected",
];

const TERMINAL: [&str; 4] = ["completed", "failed", "canceled", "rejected"];

/// The contract's table, as data: every legal (from, to). `submitted` → `working` is
/// legal only by claim; every other edge by `transition`.
const LEGAL: [(&str, &str); 9] = [
    ("submitted", "working"),
    ("submitted", "rejected"),
    ("submitted", "canceled"),
    ("working", "input-required"),
    ("working", "completed"),
    ("working", "failed"),
    ("working", "canceled"),
    ("input-required", "working"),
    ("input-required", "canceled"),
];

// ---- helpers ---------------------------------------------------------------------

/// `POST /v1/tasks` with `body`.
async fn submit(a: &str, body: &Value) -> anyhow::Result<Response> {
    send_json(a, "POST", "/v1/tasks", body).await
}

/// Submits task `id` for `AGENT`; asserts 201 and the contract's answer.
async fn submit_new(a: &str, id: &str) -> Value {
    let r = submit(a, &json!({"id": id, "agent": AGENT, "input": {"n": id}}))
        .await
        .unwrap();
    assert_eq!(r.status, 201, "submit {id}: {}", r.body);
    let t = r.json().unwrap();
    assert_eq!(t["id"], id, "{t}");
    assert_eq!(t["state"], "submitted", "{t}");
    assert!(t["version"].as_i64().is_some_and(|v| v > 0), "{t}");
    t
}

/// `GET /v1/tasks/{id}`; asserts 200, the contract's shape and that the `ETag` is
/// the version.
async fn get_task(a: &str, id: &str) -> anyhow::Result<Value> {
    let r = http::get(a, &format!("/v1/tasks/{id}")).await?;
    ensure!(r.status == 200, "GET task {id}: {} {}", r.status, r.body);
    let t = r.json()?;
    for k in [
        "id", "agent", "state", "version", "input", "output", "history", "assignee",
    ] {
        ensure!(t.get(k).is_some(), "task without {k}: {t}");
    }
    let version = t["version"]
        .as_i64()
        .ok_or_else(|| anyhow!("no numeric version: {t}"))?;
    ensure!(
        r.header("etag") == Some(format!("\"{version}\"").as_str()),
        "ETag {:?} is not the version {version}",
        r.header("etag")
    );
    let history = t["history"]
        .as_array()
        .ok_or_else(|| anyhow!("history is not a list: {t}"))?;
    ensure!(
        history.last().map(|h| &h["state"]) == Some(&t["state"]),
        "the last history entry is not the current state: {t}"
    );
    ensure!(
        history.iter().all(|h| h["at"].as_str().is_some()),
        "history entry without at: {t}"
    );
    Ok(t)
}

/// Opens a session for `client_id`; returns (session id, epoch).
async fn open_session(a: &str, client_id: &str) -> (String, i64) {
    let r = send_json(
        a,
        "POST",
        "/v1/sessions",
        &json!({"client_id": client_id, "ttl_ms": 600_000}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 201, "open session for {client_id}: {}", r.body);
    let s = r.json().unwrap();
    let id = s["session_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no session_id: {s}"))
        .to_string();
    let epoch = s["epoch"]
        .as_i64()
        .unwrap_or_else(|| panic!("no epoch: {s}"));
    (id, epoch)
}

async fn claim(a: &str, id: &str, session: &str) -> Response {
    send_json(
        a,
        "POST",
        &format!("/v1/tasks/{id}/claim"),
        &json!({ "session": session }),
    )
    .await
    .unwrap()
}

/// `POST /v1/tasks/{id}/transition`, with `If-Match` when `if_match` is given.
async fn transition(
    a: &str,
    id: &str,
    to: &str,
    session: &str,
    output: Option<Value>,
    if_match: Option<i64>,
) -> Response {
    let mut body = json!({"to": to, "session": session});
    if let Some(o) = output {
        body["output"] = o;
    }
    let etag = if_match.map(|v| format!("\"{v}\""));
    let mut headers = vec![("Content-Type", "application/json")];
    if let Some(e) = etag.as_deref() {
        headers.push(("If-Match", e));
    }
    request_with(
        a,
        "POST",
        &format!("/v1/tasks/{id}/transition"),
        &headers,
        body.to_string().as_bytes(),
    )
    .await
    .unwrap()
}

async fn cancel(a: &str, id: &str) -> Response {
    request_with(a, "POST", &format!("/v1/tasks/{id}/cancel"), &[], b"")
        .await
        .unwrap()
}

/// Asserts a 200 whose task is in `state`; returns it.
fn moved(r: &Response, state: &str, what: &str) -> Value {
    assert_eq!(r.status, 200, "{what}: {}", r.body);
    let t = r.json().unwrap();
    assert_eq!(t["state"], state, "{what}: {t}");
    t
}

/// Moves a fresh task (submitted) to `state` over legal edges, acting as `session`.
async fn drive_to(a: &str, id: &str, state: &str, session: &str) {
    let step = |to: &'static str| async move {
        if to == "working" && get_task(a, id).await.unwrap()["state"] == "submitted" {
            moved(&claim(a, id, session).await, to, &format!("claim {id}"));
        } else {
            moved(
                &transition(a, id, to, session, None, None).await,
                to,
                &format!("{id} -> {to}"),
            );
        }
    };
    let path: &[&'static str] = match state {
        "submitted" => &[],
        "working" => &["working"],
        "input-required" => &["working", "input-required"],
        "completed" => &["working", "completed"],
        "failed" => &["working", "failed"],
        "canceled" => &["canceled"],
        "rejected" => &["rejected"],
        other => panic!("no path to {other}"),
    };
    for to in path {
        step(to).await;
    }
    assert_eq!(get_task(a, id).await.unwrap()["state"], state, "{id}");
}

// ---- (a) the state machine ---------------------------------------------------------

/// Every state to every target over HTTP: 200 exactly for the contract's edges, 422
/// (and nothing changed) for every other one; a terminal task stays as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_task_in_each_state_when_moved_to_each_target_then_only_the_table_is_legal() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let (session, epoch) = open_session(a, AGENT).await;

    let mut checked = 0;
    for from in STATES {
        for to in STATES {
            let id = format!("t-{from}-to-{to}");
            submit_new(a, &id).await;
            drive_to(a, &id, from, &session).await;
            let before = get_task(a, &id).await.unwrap();
            let legal = LEGAL.contains(&(from, to));
            // submitted -> working is the claim; every other edge is a transition.
            let r = if from == "submitted" && to == "working" {
                claim(a, &id, &session).await
            } else {
                transition(a, &id, to, &session, Some(json!({"by": "table"})), None).await
            };
            let after = get_task(a, &id).await.unwrap();
            if legal {
                let t = moved(&r, to, &format!("{from} -> {to}"));
                assert_eq!(after["state"], to, "{from} -> {to}: {after}");
                assert!(
                    after["version"].as_i64() > before["version"].as_i64(),
                    "{from} -> {to}: the version did not grow: {before} then {after}"
                );
                assert_eq!(t["version"], after["version"], "{from} -> {to}");
                if to == "working" || to == "input-required" {
                    assert_eq!(
                        after["assignee"],
                        json!({"session": session, "epoch": epoch}),
                        "{from} -> {to}: {after}"
                    );
                }
            } else {
                let p = problem(&r, 422);
                assert!(
                    p["type"]
                        .as_str()
                        .is_some_and(|t| t.ends_with("/illegal-transition")),
                    "{from} -> {to}: {p}"
                );
                assert_eq!(
                    after, before,
                    "{from} -> {to} was refused but changed the task"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, STATES.len() * STATES.len());

    // Edges that exist only by claim are not transitions.
    let id = "t-transition-to-working";
    submit_new(a, id).await;
    problem(
        &transition(a, id, "working", &session, None, None).await,
        422,
    );
    assert_eq!(get_task(a, id).await.unwrap()["state"], "submitted");

    // Cancel from every state; claim of a terminal task. A terminal task is never
    // overwritten, by any route.
    for from in STATES {
        let id = format!("c-{from}");
        submit_new(a, &id).await;
        drive_to(a, &id, from, &session).await;
        let before = get_task(a, &id).await.unwrap();
        let r = cancel(a, &id).await;
        if TERMINAL.contains(&from) {
            problem(&r, 422);
            problem(&claim(a, &id, &session).await, 422);
            for to in STATES {
                problem(&transition(a, &id, to, &session, None, None).await, 422);
            }
            assert_eq!(
                get_task(a, &id).await.unwrap(),
                before,
                "terminal {from} was changed"
            );
        } else {
            moved(&r, "canceled", &format!("cancel from {from}"));
            let after = get_task(a, &id).await.unwrap();
            assert_eq!(after["state"], "canceled");
            let states: Vec<&str> = after["history"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h["state"].as_str().unwrap())
                .collect();
            assert_eq!(states.first(), Some(&"submitted"), "{after}");
            assert_eq!(states.last(), Some(&"canceled"), "{after}");
        }
    }

    // An output given with a transition is kept.
    let id = "t-output";
    submit_new(a, id).await;
    drive_to(a, id, "working", &session).await;
    moved(
        &transition(
            a,
            id,
            "completed",
            &session,
            Some(json!({"answer": 42})),
            None,
        )
        .await,
        "completed",
        "complete with output",
    );
    let t = get_task(a, id).await.unwrap();
    assert_eq!(t["output"], json!({"answer": 42}), "{t}");
    assert_eq!(t["input"], json!({"n": id}), "{t}");
    assert_eq!(t["agent"], AGENT, "{t}");
}

// ---- (b) submit, If-Match, claims ----------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_submitted_task_when_the_same_id_is_submitted_again_then_same_body_is_200_and_other_body_409(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let body = json!({"id": "job-1", "agent": AGENT, "input": {"text": "hello", "n": [1, 2]}});
    let created = submit(a, &body).await.unwrap();
    assert_eq!(created.status, 201, "{}", created.body);
    let first = created.json().unwrap();
    assert_eq!(first["state"], "submitted");

    let again = submit(a, &body).await.unwrap();
    assert_eq!(again.status, 200, "{}", again.body);
    let second = again.json().unwrap();
    assert_eq!(second["id"], "job-1");
    assert_eq!(second["version"], first["version"], "a repeat wrote again");

    let other_input = json!({"id": "job-1", "agent": AGENT, "input": {"text": "bye"}});
    let p = problem(&submit(a, &other_input).await.unwrap(), 409);
    assert!(p["type"].as_str().unwrap().ends_with("/conflict"), "{p}");
    let other_agent = json!({"id": "job-1", "agent": "agent-b", "input": body["input"]});
    problem(&submit(a, &other_agent).await.unwrap(), 409);

    let t = get_task(a, "job-1").await.unwrap();
    assert_eq!(t["input"], body["input"]);
    assert_eq!(t["agent"], AGENT);
    assert_eq!(t["version"], first["version"]);
    assert_eq!(t["output"], Value::Null);
    assert_eq!(t["assignee"], Value::Null);

    // Without an id, each submit is a new task with a generated id.
    let anon = json!({"agent": AGENT, "input": {"x": 1}});
    let a1 = submit(a, &anon).await.unwrap();
    let a2 = submit(a, &anon).await.unwrap();
    assert_eq!(
        (a1.status, a2.status),
        (201, 201),
        "{} {}",
        a1.body,
        a2.body
    );
    assert_ne!(a1.json().unwrap()["id"], a2.json().unwrap()["id"]);

    // Input over 256 KiB is 413; bad bodies are 400 naming the field; unknown 404.
    let big = json!({"id": "big", "agent": AGENT, "input": {"blob": "x".repeat(256 * 1024)}});
    problem(&submit(a, &big).await.unwrap(), 413);
    problem(&http::get(a, "/v1/tasks/big").await.unwrap(), 404);
    common::problem_naming(&submit(a, &json!({"input": {}})).await.unwrap(), "agent");
    common::problem_naming(&submit(a, &json!({"agent": AGENT})).await.unwrap(), "input");
    common::problem_naming(
        &submit(a, &json!({"agent": "no/slash", "input": 1}))
            .await
            .unwrap(),
        "agent",
    );
    common::problem_naming(
        &submit(a, &json!({"id": "a b", "agent": AGENT, "input": 1}))
            .await
            .unwrap(),
        "id",
    );
    common::problem_naming(
        &submit(a, &json!({"agent": AGENT, "input": 1, "colour": "red"}))
            .await
            .unwrap(),
        "colour",
    );
    problem(&http::get(a, "/v1/tasks/nope").await.unwrap(), 404);
    problem(&cancel(a, "nope").await, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_task_that_moved_on_when_a_transition_names_the_old_version_then_412_and_the_current_one_wins(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let (session, _) = open_session(a, AGENT).await;
    let submitted = submit_new(a, "etag-1").await;
    let v0 = submitted["version"].as_i64().unwrap();
    moved(&claim(a, "etag-1", &session).await, "working", "claim");
    let v1 = get_task(a, "etag-1").await.unwrap()["version"]
        .as_i64()
        .unwrap();
    assert!(v1 > v0);

    let p = problem(
        &transition(a, "etag-1", "completed", &session, None, Some(v0)).await,
        412,
    );
    assert_eq!(p["version"], v1, "{p}");
    assert_eq!(get_task(a, "etag-1").await.unwrap()["state"], "working");

    let t = moved(
        &transition(a, "etag-1", "input-required", &session, None, Some(v1)).await,
        "input-required",
        "If-Match with the current version",
    );
    let v2 = t["version"].as_i64().unwrap();
    assert!(v2 > v1);
    // The version v1 was current a moment ago; it is stale now.
    problem(
        &transition(a, "etag-1", "working", &session, None, Some(v1)).await,
        412,
    );
    // A malformed If-Match is a 400 naming it.
    let r = request_with(
        a,
        "POST",
        "/v1/tasks/etag-1/transition",
        &[("Content-Type", "application/json"), ("If-Match", "soon")],
        json!({"to": "working", "session": session})
            .to_string()
            .as_bytes(),
    )
    .await
    .unwrap();
    common::problem_naming(&r, "If-Match");
    common::problem_naming(
        &transition(a, "etag-1", "done", &session, None, None).await,
        "to",
    );
    assert_eq!(get_task(a, "etag-1").await.unwrap()["version"], v2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_task_for_an_agent_when_another_client_or_a_second_session_claims_it_then_403_and_409(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    submit_new(a, "claim-1").await;

    // A session of another client may not take the agent's task.
    let (intruder, _) = open_session(a, "agent-b").await;
    let p = problem(&claim(a, "claim-1", &intruder).await, 403);
    assert!(p["type"].as_str().unwrap().ends_with("/forbidden"), "{p}");
    problem(
        &transition(a, "claim-1", "rejected", &intruder, None, None).await,
        403,
    );
    assert_eq!(get_task(a, "claim-1").await.unwrap()["state"], "submitted");

    // Unknown sessions and tasks are 404; a claim without a session is a 400.
    problem(
        &claim(a, "claim-1", "0123456789abcdef0123456789abcdef").await,
        404,
    );
    problem(&claim(a, "claim-1", "not-a-session").await, 404);
    let (s1, e1) = open_session(a, AGENT).await;
    problem(&claim(a, "no-such-task", &s1).await, 404);
    let r = send_json(a, "POST", "/v1/tasks/claim-1/claim", &json!({}))
        .await
        .unwrap();
    common::problem_naming(&r, "session");

    // The agent's session takes it; claiming again with it changes nothing.
    let t = moved(&claim(a, "claim-1", &s1).await, "working", "first claim");
    assert_eq!(t["assignee"], json!({"session": s1, "epoch": e1}));
    let again = moved(&claim(a, "claim-1", &s1).await, "working", "same session");
    assert_eq!(
        again["version"], t["version"],
        "a repeated claim wrote again"
    );

    // A second session of the agent takes the first one over. The first is fenced
    // from then on: a cancel on its behalf (legal from `working` and, once the task
    // was requeued, from `submitted`, so the answer does not depend on when the
    // requeue runs) is a 409 whose type ends in /fenced, and changes nothing.
    let (s2, e2) = open_session(a, AGENT).await;
    assert!(e2 > e1, "a takeover has a higher epoch: {e1} then {e2}");
    let p = problem(
        &transition(a, "claim-1", "canceled", &s1, None, None).await,
        409,
    );
    assert!(p["type"].as_str().unwrap().ends_with("/fenced"), "{p}");
    assert_ne!(get_task(a, "claim-1").await.unwrap()["state"], "canceled");

    // The task returns to `submitted` (its assignee's session was taken over) and
    // the new session claims it.
    wait_until(Duration::from_secs(20), "claim-1 requeued", || async {
        let t = get_task(a, "claim-1").await?;
        ensure!(t["state"] == "submitted", "{t}");
        Ok(())
    })
    .await
    .unwrap();
    let t = moved(&claim(a, "claim-1", &s2).await, "working", "claim by s2");
    assert_eq!(t["assignee"], json!({"session": s2, "epoch": e2}));

    // A claim of the claimed task by another session is a 409 (the only other
    // session of the agent is the taken-over one, so the refusal is either "already
    // claimed" or "fenced", depending on whether this instance's session cache has
    // seen the takeover yet), and it changes nothing.
    let p = problem(&claim(a, "claim-1", &s1).await, 409);
    let kind = p["type"].as_str().unwrap();
    assert!(
        kind.ends_with("/conflict") || kind.ends_with("/fenced"),
        "{p}"
    );
    if kind.ends_with("/conflict") {
        assert_eq!(p["assignee"]["session"], s2, "{p}");
    }
    let after = get_task(a, "claim-1").await.unwrap();
    assert_eq!(
        after["version"], t["version"],
        "a refused claim wrote: {after}"
    );
    assert_eq!(after["assignee"], json!({"session": s2, "epoch": e2}));

    // Terminal tasks cannot be claimed.
    submit_new(a, "claim-2").await;
    moved(&cancel(a, "claim-2").await, "canceled", "cancel");
    problem(&claim(a, "claim-2", &s2).await, 422);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_tasks_of_two_agents_when_listed_with_filters_then_pages_cover_exactly_the_matches() {
    let dir = tempfile::tempdir().unwrap();
    let m = start(dir.path()).await;
    let a = m.addr();
    let (session, _) = open_session(a, AGENT).await;
    for i in 0..7 {
        submit_new(a, &format!("l-{i}")).await;
    }
    for i in 0..3 {
        let r = submit(
            a,
            &json!({"id": format!("l-b-{i}"), "agent": "agent-b", "input": i}),
        )
        .await
        .unwrap();
        assert_eq!(r.status, 201, "{}", r.body);
    }
    moved(&claim(a, "l-3", &session).await, "working", "claim l-3");

    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("/v1/tasks?agent={AGENT}&limit=3");
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={c}"));
        }
        let r = http::get(a, &path).await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let page = r.json().unwrap();
        let tasks = page["tasks"].as_array().unwrap();
        assert!(tasks.len() <= 3, "{page}");
        for t in tasks {
            assert_eq!(t["agent"], AGENT, "{t}");
            seen.push(t["id"].as_str().unwrap().to_string());
        }
        match page.get("next_cursor").and_then(Value::as_str) {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    let want: Vec<String> = (0..7).map(|i| format!("l-{i}")).collect();
    assert_eq!(seen, want);

    let r = http::get(a, "/v1/tasks?state=working").await.unwrap();
    let page = r.json().unwrap();
    let ids: Vec<&str> = page["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["l-3"], "{page}");
    assert!(page.get("next_cursor").is_none(), "{page}");

    common::problem_naming(
        &http::get(a, "/v1/tasks?state=done").await.unwrap(),
        "state",
    );
    common::problem_naming(&http::get(a, "/v1/tasks?limit=0").await.unwrap(), "limit");
    common::problem_naming(
        &http::get(a, "/v1/tasks?limit=1001").await.unwrap(),
        "limit",
    );
    common::problem_naming(
        &http::get(a, "/v1/tasks?agent=a%2Fb").await.unwrap(),
        "agent",
    );
}

// ---- (c) submits through an etcd outage ----------------------------------------------

/// One submit of the background stream.
#[derive(Debug, Clone)]
struct Attempt {
    id: String,
    status: u16,
    sent: Instant,
    answered: Instant,
    body: String,
}

fn stream_body(id: &str) -> Value {
    json!({"id": id, "agent": AGENT, "input": {"seq": id}})
}

async fn ready_is(a: &str, status: u16) -> anyhow::Result<()> {
    let r = http::get(a, "/readyz").await?;
    ensure!(r.status == status, "readyz {} {}", r.status, r.body);
    Ok(())
}

/// The attempts sent after `from` and answered before `to` (entirely inside).
fn inside(log: &[Attempt], from: Instant, to: Instant) -> Vec<Attempt> {
    log.iter()
        .filter(|x| x.sent >= from && x.answered <= to)
        .cloned()
        .collect()
}

fn statuses(log: &[Attempt]) -> Vec<u16> {
    log.iter().map(|x| x.status).collect()
}

/// Waits until the stream has answered `n` submits sent after `since` that match `ok`.
async fn stream_answers(
    log: &Arc<Mutex<Vec<Attempt>>>,
    since: Instant,
    n: usize,
    what: &str,
    ok: fn(u16) -> bool,
) {
    wait_until(Duration::from_secs(30), what, || {
        let log = log.clone();
        async move {
            let log = log.lock().unwrap();
            let got: Vec<u16> = log
                .iter()
                .filter(|x| x.sent >= since)
                .map(|x| x.status)
                .collect();
            ensure!(
                got.iter().filter(|s| ok(**s)).count() >= n,
                "statuses since: {got:?}"
            );
            Ok(())
        }
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_etcd_meta_when_etcd_is_killed_and_paused_under_a_stream_of_submits_then_every_201_is_durable_and_no_503_is_written(
) {
    let mut etcd = EtcdProcess::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("etcd://{}", etcd.endpoint());
    let m = MeshdProcess::start(common::bin(), dir.path(), &["--meta", &url])
        .await
        .unwrap();
    let a = m.addr().to_string();
    wait_until(Duration::from_secs(15), "ready with etcd up", || {
        ready_is(&a, 200)
    })
    .await
    .unwrap();

    // A stream of submits, one at a time, through the whole story.
    let log: Arc<Mutex<Vec<Attempt>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let stream = tokio::spawn({
        let (a, log, stop) = (a.clone(), log.clone(), stop.clone());
        async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let id = format!("s-{i:05}");
                i += 1;
                let sent = Instant::now();
                // The HTTP client gives up after 10 s; meshd answers within its Meta
                // request timeout, so a client timeout is itself a finding.
                let r = submit(&a, &stream_body(&id)).await;
                let answered = Instant::now();
                let (status, body) = match r {
                    Ok(r) => (r.status, r.body),
                    Err(e) => (0, format!("{e:#}")),
                };
                log.lock().unwrap().push(Attempt {
                    id,
                    status,
                    sent,
                    answered,
                    body,
                });
            }
        }
    });
    let started = Instant::now();
    stream_answers(&log, started, 5, "submits with etcd up", |s| s == 201).await;

    // Killed: readiness drops, submits are refused with 503 (known not written).
    etcd.kill();
    let killed = Instant::now();
    wait_until(
        Duration::from_secs(15),
        "not ready with etcd killed",
        || ready_is(&a, 503),
    )
    .await
    .unwrap();
    stream_answers(&log, killed, 3, "503s with etcd killed", |s| s == 503).await;
    let r = submit(&a, &stream_body("probe-killed")).await.unwrap();
    let p = problem(&r, 503);
    assert!(r.header("retry-after").is_some(), "503 without Retry-After");
    assert_eq!(p["store"], "tasks", "{p}");
    assert_eq!(p["id"], "probe-killed", "{p}");
    // Taken before the restart: a submit answered after this may have reached the
    // new etcd.
    let restarting = Instant::now();
    etcd.restart().await.unwrap();
    let restarted = Instant::now();

    // Back without restarting meshd.
    wait_until(
        Duration::from_secs(20),
        "ready again after the restart",
        || ready_is(&a, 200),
    )
    .await
    .unwrap();
    stream_answers(&log, restarted, 3, "201s after the restart", |s| s == 201).await;

    // Paused (SIGSTOP): connections stay open but nothing answers; never a 201.
    etcd.pause();
    let paused = Instant::now();
    wait_until(
        Duration::from_secs(20),
        "not ready with etcd paused",
        || ready_is(&a, 503),
    )
    .await
    .unwrap();
    stream_answers(&log, paused, 2, "answers with etcd paused", |s| {
        s == 503 || s == 504
    })
    .await;
    // Taken before SIGCONT: a submit answered after this may have reached etcd.
    let resuming = Instant::now();
    etcd.resume();
    let resumed = Instant::now();
    wait_until(
        Duration::from_secs(20),
        "ready again after the pause",
        || ready_is(&a, 200),
    )
    .await
    .unwrap();
    stream_answers(&log, resumed, 3, "201s after the pause", |s| s == 201).await;

    stop.store(true, Ordering::Relaxed);
    stream.await.unwrap();
    let log = log.lock().unwrap().clone();

    // Every answer is one the contract allows, as problem+json when it is an error.
    for x in &log {
        assert!(
            matches!(x.status, 201 | 503 | 504),
            "{} answered {}: {}",
            x.id,
            x.status,
            x.body
        );
    }
    for x in inside(&log, killed, restarting) {
        assert_ne!(x.status, 201, "{} answered 201 while etcd was dead", x.id);
    }
    let during_pause = inside(&log, paused, resuming);
    assert!(
        !during_pause.is_empty(),
        "no submit ran while etcd was paused"
    );
    for x in &during_pause {
        assert!(
            matches!(x.status, 503 | 504),
            "{} answered {} while etcd was paused: {}",
            x.id,
            x.status,
            x.body
        );
    }

    // Afterwards, from etcd: every 201 is there with its content, every 503 is not,
    // and a 504 is settled by retrying the same id and body (201 or 200, never 409).
    let mut missing = BTreeSet::new();
    let mut written_after_503 = BTreeSet::new();
    for x in &log {
        let r = http::get(&a, &format!("/v1/tasks/{}", x.id)).await.unwrap();
        match x.status {
            201 => {
                if r.status != 200 {
                    missing.insert(x.id.clone());
                    continue;
                }
                let t = r.json().unwrap();
                assert_eq!(t["input"], stream_body(&x.id)["input"], "{t}");
                assert_eq!(t["agent"], AGENT, "{t}");
            }
            503 => {
                if r.status != 404 {
                    written_after_503.insert((x.id.clone(), r.status));
                }
            }
            _ => {
                assert!(matches!(r.status, 200 | 404), "{}: {}", x.id, r.body);
                let retry = submit(&a, &stream_body(&x.id)).await.unwrap();
                assert!(
                    matches!(retry.status, 200 | 201),
                    "retrying {} after a 504 answered {}: {}",
                    x.id,
                    retry.status,
                    retry.body
                );
                get_task(&a, &x.id)
                    .await
                    .with_context(|| format!("{} after its retry", x.id))
                    .unwrap();
            }
        }
    }
    assert!(
        missing.is_empty(),
        "answered 201 but not in etcd: {missing:?}"
    );
    assert!(
        written_after_503.is_empty(),
        "answered 503 but written: {written_after_503:?}"
    );
    problem(&http::get(&a, "/v1/tasks/probe-killed").await.unwrap(), 404);
    let summary: Vec<(String, u16)> = log.iter().map(|x| (x.id.clone(), x.status)).collect();
    eprintln!(
        "stream of {} submits; while killed: {:?}; while paused: {:?}",
        log.len(),
        statuses(&inside(&log, killed, restarting)),
        statuses(&during_pause)
    );
    assert!(
        log.iter().any(|x| x.status == 503),
        "no 503 in the whole outage: {summary:?}"
    );
}
