//! # The TaskStore conformance suite, on both Meta backends
//!
//! One async function per case; [`common::backend_cases!`] stamps out `embedded::<case>` (EmbeddedMeta
//! on a temp dir) and `etcd::<case>` (a real etcd process per test) so each is reported
//! and filterable on its own.
//!
//! "Restart" is real: the etcd process is SIGKILLed and started again on the same data
//! dir, the embedded Meta is closed and reopened on the same directory. "Meta
//! unavailable" is a killed etcd / a closed embedded Meta. Stores reach the backend
//! through [`common::ProxyMeta`], which forwards every call to the backend's current client,
//! so one store object lives through a restart (the embedded backend's client is the
//! store itself and must be reopened), and which can inject a fault into the next
//! transaction to show what the store does with an unknown outcome.
//!
//! The stories the cases pin:
//! * a submit is acknowledged only when durable, and never silently dropped while
//!   Meta is down (`meta_unavailable_…`, `restart_…`);
//! * exactly the transition table is legal, terminal states are final;
//! * stale versions and taken-over sessions never write (`fencing_…`, `stale_if_match_…`);
//! * one claimer wins; a dead assignee's task is requeued.

mod common;

use common::{backend_cases, Fault, Harness};
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{Meta, MetaError, Precondition};
use meshd_stores::failure::StoreFailure;
use meshd_stores::tasks::{
    AssigneeRef, MetaTaskStore, Requeue, Task, TaskError, TaskFilter, TaskState, TaskStore,
    TaskStoreConfig,
};
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

backend_cases!(
    submit_get_and_list_in_pages,
    submit_is_idempotent_per_id_and_content,
    input_and_output_are_capped,
    every_transition_of_the_table_and_no_other,
    claim_rules,
    stale_if_match_is_rejected_with_the_current_version,
    fencing_after_a_takeover_rejects_the_old_assignee,
    concurrent_claimers_have_exactly_one_winner,
    requeue_after_takeover_or_expiry,
    terminal_tasks_never_change,
    expire_deletes_only_old_terminal_tasks,
    indeterminate_submit_is_safe_to_retry_with_the_same_id,
    corrupt_records_are_reported,
    a_field_a_newer_release_wrote_survives_every_transition,
    restart_keeps_every_acknowledged_submit_and_transition,
    meta_unavailable_never_drops_a_submit,
);

// ---------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------

const AGENT: &str = "summarizer";

fn store(b: &Harness) -> MetaTaskStore {
    MetaTaskStore::new(b.meta(), TaskStoreConfig::default()).expect("valid config")
}

/// Opens a "session": a Meta key under a lease whose mod_revision is the epoch (what
/// the SessionStore does). Calling it again for the same `name` is a takeover.
async fn session(meta: &dyn Meta, name: &str, client_id: &str) -> AssigneeRef {
    let key = keys::key(KeyKind::Sessions, &[name]);
    let lease = meta.grant(Duration::from_secs(60)).await.expect("grant");
    let own = Ownership::take_over(meta, &key, client_id.as_bytes(), Some(lease.id))
        .await
        .expect("session key");
    AssigneeRef {
        session_id: format!("{name}-{}", own.epoch()),
        session_key: key,
        epoch: own.epoch(),
        client_id: client_id.to_string(),
    }
}

async fn stored(meta: &dyn Meta, id: &str) -> Option<(Value, i64)> {
    let kv = meta
        .get(&keys::key(KeyKind::Tasks, &[id]))
        .await
        .expect("get")
        .kv?;
    Some((
        serde_json::from_slice(&kv.value).expect("json"),
        kv.mod_revision,
    ))
}

/// Drives a fresh task `id` into `state` (through legal moves only).
async fn task_in(s: &MetaTaskStore, who: &AssigneeRef, id: &str, state: TaskState) -> Task {
    let t = s
        .submit(Some(id), AGENT, json!({"task": id}))
        .await
        .expect("submit")
        .task;
    use TaskState::*;
    let t = match state {
        Submitted => t,
        Canceled => s.cancel(id).await.expect("cancel"),
        Rejected => s
            .transition(id, Rejected, None, Some(t.version), who)
            .await
            .expect("reject"),
        Working | InputRequired | Completed | Failed => {
            let t = s.claim(id, who).await.expect("claim");
            if state == Working {
                t
            } else {
                s.transition(id, state, Some(json!({"by": "test"})), Some(t.version), who)
                    .await
                    .expect("move")
            }
        }
    };
    assert_eq!(t.state, state);
    t
}

/// The public table, written out independently of the implementation.
fn legal_by_transition(from: TaskState, to: TaskState) -> bool {
    use TaskState::*;
    matches!(
        (from, to),
        (Submitted, Rejected | Canceled)
            | (Working, InputRequired | Completed | Failed | Canceled)
            | (InputRequired, Working | Canceled)
    )
}

// ---------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------

async fn submit_get_and_list_in_pages(b: &mut Harness) {
    let s = store(b);
    let meta = b.meta();
    let mut ids = Vec::new();
    for i in 0..5 {
        let id = format!("t-{i}");
        let sub = s
            .submit(
                Some(&id),
                if i % 2 == 0 { AGENT } else { "translator" },
                json!({"n": i}),
            )
            .await
            .expect("submit");
        assert!(sub.created);
        assert_eq!(sub.task.state, TaskState::Submitted);
        assert_eq!(sub.task.history.len(), 1);
        assert!(sub.task.assignee.is_none());
        let (_, version) = stored(meta.as_ref(), &id).await.expect("durable");
        assert_eq!(
            sub.task.version, version,
            "version is the Meta mod_revision"
        );
        assert_eq!(s.get(&id).await.expect("get"), sub.task);
        ids.push(id);
    }
    let generated = s.submit(None, AGENT, json!(null)).await.expect("submit");
    assert_eq!(generated.task.id.len(), 32);
    assert!(generated.task.id.bytes().all(|c| c.is_ascii_hexdigit()));
    ids.push(generated.task.id.clone());
    ids.sort();

    // Pages of 2 return every task once, in id order.
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = s
            .list(&TaskFilter::default(), 2, cursor.as_deref())
            .await
            .expect("list");
        assert!(page.tasks.len() <= 2);
        seen.extend(page.tasks.iter().map(|t| t.id.clone()));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, ids);

    let by_agent = s
        .list(
            &TaskFilter {
                agent: Some("translator".into()),
                state: None,
            },
            100,
            None,
        )
        .await
        .expect("list");
    let names: Vec<_> = by_agent.tasks.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(names, ["t-1", "t-3"]);
    assert_eq!(by_agent.next_cursor, None);

    let who = session(meta.as_ref(), "list-s", AGENT).await;
    s.claim("t-2", &who).await.expect("claim");
    let working = s
        .list(
            &TaskFilter {
                agent: None,
                state: Some(TaskState::Working),
            },
            100,
            None,
        )
        .await
        .expect("list");
    assert_eq!(working.tasks.len(), 1);
    assert_eq!(working.tasks[0].id, "t-2");

    assert!(matches!(
        s.get("nope").await,
        Err(TaskError::NotFound { .. })
    ));
    assert!(matches!(s.get("a/b").await, Err(TaskError::Invalid(_))));
    assert!(matches!(
        s.list(&TaskFilter::default(), 0, None).await,
        Err(TaskError::Invalid(_))
    ));
    assert!(matches!(
        s.list(&TaskFilter::default(), 1001, None).await,
        Err(TaskError::Invalid(_))
    ));
    assert!(matches!(
        s.submit(Some("bad id"), AGENT, json!(1)).await,
        Err(TaskError::Invalid(_))
    ));
    assert!(matches!(
        s.submit(Some("ok"), "bad/agent", json!(1)).await,
        Err(TaskError::Invalid(_))
    ));
}

async fn submit_is_idempotent_per_id_and_content(b: &mut Harness) {
    let s = store(b);
    let input = json!({"doc": "x", "n": [1, 2.5, "z"]});
    let first = s
        .submit(Some("same"), AGENT, input.clone())
        .await
        .expect("submit");
    assert!(first.created);
    let again = s
        .submit(Some("same"), AGENT, input.clone())
        .await
        .expect("repeat");
    assert!(!again.created, "a repeat is not a create");
    assert_eq!(
        again.task, first.task,
        "the repeat returns the existing task"
    );

    // It is the same task even after it moved on.
    let who = session(b.meta().as_ref(), "idem-s", AGENT).await;
    let claimed = s.claim("same", &who).await.expect("claim");
    let later = s
        .submit(Some("same"), AGENT, input.clone())
        .await
        .expect("repeat");
    assert!(!later.created);
    assert_eq!(later.task, claimed);

    for (agent, other) in [(AGENT, json!({"doc": "y"})), ("translator", input.clone())] {
        match s.submit(Some("same"), agent, other).await {
            Err(TaskError::ConflictingContent { id }) => assert_eq!(id, "same"),
            other => panic!("expected ConflictingContent, got {other:?}"),
        }
    }
    assert_eq!(s.get("same").await.expect("get"), claimed, "unchanged");
}

async fn input_and_output_are_capped(b: &mut Harness) {
    let small = MetaTaskStore::new(
        b.meta(),
        TaskStoreConfig {
            max_input_bytes: 64,
            max_output_bytes: 32,
            ..TaskStoreConfig::default()
        },
    )
    .expect("config");
    // "x" * 62 in quotes is exactly 64 bytes of JSON.
    let at_limit = json!("x".repeat(62));
    small
        .submit(Some("fits"), AGENT, at_limit)
        .await
        .expect("at the limit");
    match small
        .submit(Some("big"), AGENT, json!("x".repeat(63)))
        .await
    {
        Err(TaskError::TooLarge { what, size, limit }) => {
            assert_eq!((what, size, limit), ("input", 65, 64))
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(
        stored(b.meta().as_ref(), "big").await.is_none(),
        "nothing written"
    );

    let who = session(b.meta().as_ref(), "cap-s", AGENT).await;
    let t = small.claim("fits", &who).await.expect("claim");
    match small
        .transition(
            "fits",
            TaskState::Completed,
            Some(json!("y".repeat(40))),
            Some(t.version),
            &who,
        )
        .await
    {
        Err(TaskError::TooLarge { what, limit, .. }) => assert_eq!((what, limit), ("output", 32)),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(small.get("fits").await.expect("get"), t, "unchanged");

    // The default limits hold on the real backend: a full 256 KiB input and output fit
    // in one Meta record (etcd caps requests near 1.5 MiB).
    let s = store(b);
    let limit = TaskStoreConfig::default().max_input_bytes;
    let input = json!("i".repeat(limit - 2));
    s.submit(Some("full"), AGENT, input.clone())
        .await
        .expect("256 KiB input");
    let t = s.claim("full", &who).await.expect("claim");
    let output = json!("o".repeat(limit - 2));
    let done = s
        .transition(
            "full",
            TaskState::Completed,
            Some(output.clone()),
            Some(t.version),
            &who,
        )
        .await
        .expect("256 KiB output");
    let read = s.get("full").await.expect("get");
    assert_eq!((read.input, read.output), (input, Some(output)));
    assert_eq!(read.version, done.version);
    assert!(matches!(
        s.submit(Some("too-big"), AGENT, json!("i".repeat(limit - 1)))
            .await,
        Err(TaskError::TooLarge { .. })
    ));
}

async fn every_transition_of_the_table_and_no_other(b: &mut Harness) {
    let s = store(b);
    let meta = b.meta();
    let who = session(meta.as_ref(), "table-s", AGENT).await;
    for (i, from) in TaskState::ALL.into_iter().enumerate() {
        for (j, to) in TaskState::ALL.into_iter().enumerate() {
            let id = format!("t-{i}-{j}");
            let before = task_in(&s, &who, &id, from).await;
            let result = s
                .transition(&id, to, None, Some(before.version), &who)
                .await;
            if legal_by_transition(from, to) {
                let after = result.unwrap_or_else(|e| panic!("{from} -> {to}: {e}"));
                assert_eq!(after.state, to);
                assert!(after.version > before.version);
                assert_eq!(after.history.last().map(|h| h.state), Some(to));
                assert_eq!(after.history.len(), before.history.len() + 1);
                assert_eq!(s.get(&id).await.expect("get"), after);
            } else {
                match result {
                    Err(TaskError::IllegalTransition { from: f, to: t }) => {
                        assert_eq!((f, t), (from, to))
                    }
                    other => panic!("{from} -> {to}: expected IllegalTransition, got {other:?}"),
                }
                assert_eq!(
                    s.get(&id).await.expect("get"),
                    before,
                    "{from} -> {to} changed it"
                );
            }
        }
        // cancel: legal from every non-terminal state.
        let id = format!("c-{i}");
        let before = task_in(&s, &who, &id, from).await;
        match s.cancel(&id).await {
            Ok(t) => {
                assert!(!from.is_terminal(), "canceled a {from} task");
                assert_eq!(t.state, TaskState::Canceled);
            }
            Err(TaskError::IllegalTransition { from: f, to }) => {
                assert!(from.is_terminal(), "could not cancel a {from} task");
                assert_eq!((f, to), (from, TaskState::Canceled));
                assert_eq!(s.get(&id).await.expect("get"), before);
            }
            Err(e) => panic!("cancel of {from}: {e}"),
        }
    }
}

async fn claim_rules(b: &mut Harness) {
    let s = store(b);
    let meta = b.meta();
    let agent = session(meta.as_ref(), "claim-a", AGENT).await;
    let other_agent = session(meta.as_ref(), "claim-o", "translator").await;
    let second = session(meta.as_ref(), "claim-b", AGENT).await;

    let t = s
        .submit(Some("c"), AGENT, json!(1))
        .await
        .expect("submit")
        .task;
    match s.claim("c", &other_agent).await {
        Err(TaskError::Forbidden { client_id, agent }) => {
            assert_eq!((client_id.as_str(), agent.as_str()), ("translator", AGENT))
        }
        other => panic!("expected Forbidden, got {other:?}"),
    }
    assert_eq!(s.get("c").await.expect("get"), t);

    let claimed = s.claim("c", &agent).await.expect("claim");
    assert_eq!(claimed.state, TaskState::Working);
    let a = claimed.assignee.clone().expect("assignee");
    assert_eq!(
        (a.session.as_str(), a.epoch),
        (agent.session_id.as_str(), agent.epoch)
    );
    // The same session claiming again (a retry after an unknown outcome) is no change.
    assert_eq!(s.claim("c", &agent).await.expect("re-claim"), claimed);
    match s.claim("c", &second).await {
        Err(TaskError::AlreadyClaimed { assignee }) => assert_eq!(assignee, a),
        other => panic!("expected AlreadyClaimed, got {other:?}"),
    }
    // Only the assignee moves a claimed task.
    match s
        .transition("c", TaskState::Completed, None, None, &second)
        .await
    {
        Err(TaskError::NotAssignee { .. }) => {}
        other => panic!("expected NotAssignee, got {other:?}"),
    }
    let ir = s
        .transition("c", TaskState::InputRequired, None, None, &agent)
        .await
        .expect("input-required");
    match s.claim("c", &second).await {
        Err(TaskError::AlreadyClaimed { .. }) => {}
        other => panic!("expected AlreadyClaimed, got {other:?}"),
    }
    s.transition("c", TaskState::Completed, None, Some(ir.version), &agent)
        .await
        .expect_err("input-required -> completed is not in the table");
    s.transition("c", TaskState::Working, None, Some(ir.version), &agent)
        .await
        .expect("input-required -> working");
    s.transition("c", TaskState::Completed, None, None, &agent)
        .await
        .expect("complete");
    match s.claim("c", &second).await {
        Err(TaskError::IllegalTransition { from, to }) => {
            assert_eq!((from, to), (TaskState::Completed, TaskState::Working))
        }
        other => panic!("expected IllegalTransition, got {other:?}"),
    }
    assert!(matches!(
        s.claim("missing", &agent).await,
        Err(TaskError::NotFound { .. })
    ));
    // A submitted task is rejected only by its agent's session.
    s.submit(Some("r"), AGENT, json!(1)).await.expect("submit");
    assert!(matches!(
        s.transition("r", TaskState::Rejected, None, None, &other_agent)
            .await,
        Err(TaskError::Forbidden { .. })
    ));
    s.transition("r", TaskState::Rejected, None, None, &second)
        .await
        .expect("any session of the agent rejects");
}

async fn stale_if_match_is_rejected_with_the_current_version(b: &mut Harness) {
    let s = store(b);
    let who = session(b.meta().as_ref(), "ifm", AGENT).await;
    let submitted = s
        .submit(Some("v"), AGENT, json!(1))
        .await
        .expect("submit")
        .task;
    let working = s.claim("v", &who).await.expect("claim");
    match s
        .transition(
            "v",
            TaskState::Completed,
            Some(json!("late")),
            Some(submitted.version),
            &who,
        )
        .await
    {
        Err(TaskError::VersionMismatch { current }) => assert_eq!(current, working.version),
        other => panic!("expected VersionMismatch, got {other:?}"),
    }
    let (_, version) = stored(b.meta().as_ref(), "v").await.expect("stored");
    assert_eq!(version, working.version, "nothing written");
    assert_eq!(s.get("v").await.expect("get"), working);
    s.transition("v", TaskState::Completed, None, Some(working.version), &who)
        .await
        .expect("the current version is accepted");
}

async fn fencing_after_a_takeover_rejects_the_old_assignee(b: &mut Harness) {
    let s = store(b);
    let meta = b.meta();
    let old = session(meta.as_ref(), "fence", AGENT).await;
    s.submit(Some("f"), AGENT, json!(1)).await.expect("submit");
    s.submit(Some("g"), AGENT, json!(2)).await.expect("submit");
    let working = s.claim("f", &old).await.expect("claim");

    // The same client opens its session elsewhere: a takeover of the session key.
    let new = session(meta.as_ref(), "fence", AGENT).await;
    assert!(new.epoch > old.epoch);

    for (to, expected) in [
        (TaskState::Completed, Some(working.version)),
        (TaskState::Failed, None),
    ] {
        match s
            .transition("f", to, Some(json!("stale")), expected, &old)
            .await
        {
            Err(TaskError::Fenced) => {}
            other => panic!("expected Fenced for -> {to}, got {other:?}"),
        }
    }
    let (record, version) = stored(meta.as_ref(), "f").await.expect("stored");
    assert_eq!(version, working.version, "Meta holds the previous state");
    assert_eq!(record["state"], "working");
    assert!(record.get("output").is_none());
    // The stale session cannot claim either.
    assert!(matches!(s.claim("g", &old).await, Err(TaskError::Fenced)));
    assert_eq!(s.get("g").await.expect("get").state, TaskState::Submitted);
    // The new session is not the assignee of the old one's task until it is requeued.
    assert!(matches!(
        s.transition("f", TaskState::Completed, None, None, &new)
            .await,
        Err(TaskError::NotAssignee { .. })
    ));
    s.claim("g", &new).await.expect("the new session claims");
}

async fn concurrent_claimers_have_exactly_one_winner(b: &mut Harness) {
    let s = Arc::new(store(b));
    let meta = b.meta();
    for round in 0..3 {
        let id = format!("race-{round}");
        s.submit(Some(&id), AGENT, json!(round))
            .await
            .expect("submit");
        let mut sessions = Vec::new();
        for i in 0..8 {
            sessions.push(session(meta.as_ref(), &format!("claimer-{round}-{i}"), AGENT).await);
        }
        let barrier = Arc::new(tokio::sync::Barrier::new(sessions.len()));
        let mut handles = Vec::new();
        for who in sessions {
            let (s, id, barrier) = (s.clone(), id.clone(), barrier.clone());
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                (who.clone(), s.claim(&id, &who).await)
            }));
        }
        let mut winners = Vec::new();
        for h in handles {
            match h.await.expect("join") {
                (who, Ok(t)) => winners.push((who, t)),
                (_, Err(TaskError::AlreadyClaimed { .. })) => {}
                (_, Err(e)) => panic!("unexpected claim error {e}"),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: {} winners", winners.len());
        let (who, t) = &winners[0];
        let stored = s.get(&id).await.expect("get");
        assert_eq!(&stored, t);
        assert_eq!(stored.assignee.expect("assignee").session, who.session_id);
        assert_eq!(stored.history.len(), 2, "claimed once");
    }
}

async fn requeue_after_takeover_or_expiry(b: &mut Harness) {
    let s = store(b);
    let meta = b.meta();
    let a = session(meta.as_ref(), "rq", AGENT).await;
    s.submit(Some("q"), AGENT, json!(1)).await.expect("submit");
    let working = s.claim("q", &a).await.expect("claim");

    match s.requeue_if_assignee("q", &a.session_id, a.epoch).await {
        Ok(Requeue::AssigneeLive(t)) => assert_eq!(t, working),
        other => panic!("expected AssigneeLive, got {other:?}"),
    }
    let b2 = session(meta.as_ref(), "rq", AGENT).await; // takeover
    let requeued = match s.requeue_if_assignee("q", &a.session_id, a.epoch).await {
        Ok(Requeue::Requeued(t)) => t,
        other => panic!("expected Requeued, got {other:?}"),
    };
    assert_eq!(requeued.state, TaskState::Submitted);
    assert!(requeued.assignee.is_none());
    assert!(requeued.version > working.version);
    let states: Vec<_> = requeued.history.iter().map(|h| h.state).collect();
    assert_eq!(
        states,
        [
            TaskState::Submitted,
            TaskState::Working,
            TaskState::Submitted
        ]
    );
    assert_eq!(s.get("q").await.expect("get"), requeued);

    let again = s.claim("q", &b2).await.expect("the new session claims");
    // The old epoch's requeue is a no-op now.
    match s.requeue_if_assignee("q", &a.session_id, a.epoch).await {
        Ok(Requeue::NotAssigned(t)) => assert_eq!(t, again),
        other => panic!("expected NotAssigned, got {other:?}"),
    }
    // An input-required task whose session expired (lease gone) is requeued too.
    let c = {
        let key = keys::key(KeyKind::Sessions, &["rq-expiring"]);
        let lease = meta.grant(Duration::from_secs(60)).await.expect("grant");
        let own = Ownership::take_over(meta.as_ref(), &key, AGENT.as_bytes(), Some(lease.id))
            .await
            .expect("session");
        (
            AssigneeRef {
                session_id: "expiring".into(),
                session_key: key,
                epoch: own.epoch(),
                client_id: AGENT.into(),
            },
            lease,
        )
    };
    s.submit(Some("e"), AGENT, json!(2)).await.expect("submit");
    s.claim("e", &c.0).await.expect("claim");
    s.transition("e", TaskState::InputRequired, None, None, &c.0)
        .await
        .expect("input-required");
    meta.revoke(c.1.id).await.expect("revoke: the session ends");
    match s.requeue_if_assignee("e", "expiring", c.0.epoch).await {
        Ok(Requeue::Requeued(t)) => assert_eq!(t.state, TaskState::Submitted),
        other => panic!("expected Requeued, got {other:?}"),
    }
    // The ended session can neither re-claim nor reject it: it is fenced.
    assert!(matches!(s.claim("e", &c.0).await, Err(TaskError::Fenced)));
    assert!(matches!(
        s.transition("e", TaskState::Rejected, None, None, &c.0)
            .await,
        Err(TaskError::Fenced)
    ));
    assert_eq!(s.get("e").await.expect("get").state, TaskState::Submitted);
}

async fn terminal_tasks_never_change(b: &mut Harness) {
    let s = store(b);
    let meta = b.meta();
    let who = session(meta.as_ref(), "term", AGENT).await;
    let terminal = [
        TaskState::Completed,
        TaskState::Failed,
        TaskState::Canceled,
        TaskState::Rejected,
    ];
    for state in terminal {
        let id = format!("term-{state}");
        let t = task_in(&s, &who, &id, state).await;
        for to in TaskState::ALL {
            assert!(
                matches!(
                    s.transition(&id, to, Some(json!("late")), Some(t.version), &who)
                        .await,
                    Err(TaskError::IllegalTransition { .. })
                ),
                "{state} -> {to}"
            );
            assert!(matches!(
                s.transition(&id, to, None, None, &who).await,
                Err(TaskError::IllegalTransition { .. })
            ));
        }
        assert!(matches!(
            s.claim(&id, &who).await,
            Err(TaskError::IllegalTransition { .. })
        ));
        assert!(matches!(
            s.cancel(&id).await,
            Err(TaskError::IllegalTransition { .. })
        ));
        assert!(!matches!(
            s.requeue_if_assignee(&id, &who.session_id, who.epoch).await,
            Ok(Requeue::Requeued(_))
        ));
        let (_, version) = stored(meta.as_ref(), &id).await.expect("stored");
        assert_eq!(version, t.version, "{state} was rewritten");
        assert_eq!(s.get(&id).await.expect("get"), t);
    }
    // A late writer racing a cancel: whichever lands first, the terminal state stays.
    let t = task_in(&s, &who, "late", TaskState::Working).await;
    s.cancel("late").await.expect("cancel");
    assert!(matches!(
        s.transition("late", TaskState::Completed, None, Some(t.version), &who)
            .await,
        Err(TaskError::VersionMismatch { .. })
    ));
    assert_eq!(s.get("late").await.expect("get").state, TaskState::Canceled);
}

async fn expire_deletes_only_old_terminal_tasks(b: &mut Harness) {
    let s = store(b);
    let who = session(b.meta().as_ref(), "exp", AGENT).await;
    for state in TaskState::ALL {
        task_in(&s, &who, &format!("x-{state}"), state).await;
    }
    assert_eq!(
        s.expire_terminal(Duration::from_secs(3600))
            .await
            .expect("expire"),
        0
    );
    assert_eq!(s.expire_terminal(Duration::ZERO).await.expect("expire"), 4);
    for state in TaskState::ALL {
        let got = s.get(&format!("x-{state}")).await;
        if state.is_terminal() {
            assert!(
                matches!(got, Err(TaskError::NotFound { .. })),
                "{state} kept"
            );
        } else {
            assert_eq!(got.expect("kept").state, state);
        }
    }
    assert_eq!(s.expire_terminal(Duration::ZERO).await.expect("expire"), 0);
}

async fn indeterminate_submit_is_safe_to_retry_with_the_same_id(b: &mut Harness) {
    let s = store(b);
    // The answer was lost after the write was applied: the retry finds the task.
    b.proxy
        .inject(Fault::ApplyThenFail(MetaError::Indeterminate(
            "answer lost".into(),
        )));
    match s.submit(Some("i1"), AGENT, json!({"a": 1})).await {
        Err(TaskError::Store(StoreFailure::Indeterminate(_))) => {}
        other => panic!("expected Indeterminate, got {other:?}"),
    }
    let retry = s
        .submit(Some("i1"), AGENT, json!({"a": 1}))
        .await
        .expect("retry");
    assert!(!retry.created, "it had been written");
    // The request never landed: the retry creates it.
    b.proxy
        .inject(Fault::Refuse(MetaError::Indeterminate("timed out".into())));
    assert!(matches!(
        s.submit(Some("i2"), AGENT, json!({"a": 2})).await,
        Err(TaskError::Store(StoreFailure::Indeterminate(_)))
    ));
    assert!(stored(b.meta().as_ref(), "i2").await.is_none());
    let retry = s
        .submit(Some("i2"), AGENT, json!({"a": 2}))
        .await
        .expect("retry");
    assert!(retry.created);
    // Unavailable is reported as such and nothing is written.
    b.proxy
        .inject(Fault::Refuse(MetaError::Unavailable("down".into())));
    let err = s
        .submit(Some("i3"), AGENT, json!(3))
        .await
        .expect_err("unavailable");
    assert!(matches!(err, TaskError::Store(StoreFailure::Unavailable(_))) && err.is_retryable());
    assert!(stored(b.meta().as_ref(), "i3").await.is_none());
    // A transition whose outcome is unknown: re-read tells.
    let who = session(b.meta().as_ref(), "ind", AGENT).await;
    let t = s.claim("i1", &who).await.expect("claim");
    b.proxy
        .inject(Fault::ApplyThenFail(MetaError::Indeterminate(
            "lost".into(),
        )));
    assert!(matches!(
        s.transition("i1", TaskState::Completed, None, Some(t.version), &who)
            .await,
        Err(TaskError::Store(StoreFailure::Indeterminate(_)))
    ));
    assert_eq!(s.get("i1").await.expect("get").state, TaskState::Completed);
}

async fn corrupt_records_are_reported(b: &mut Harness) {
    let s = store(b);
    let meta = b.meta();
    s.submit(Some("good"), AGENT, json!(1))
        .await
        .expect("submit");
    let cases: [(&str, &[u8]); 4] = [
        ("truncated", br#"{"v":1,"id":"truncated","agent":"#),
        ("garbled", b"\x00\x9f garbage"),
        ("future", br#"{"v":2,"id":"future"}"#),
        ("moved", br#"{"v":1,"id":"other","agent":"a","state":"submitted","input":1,"history":[{"state":"submitted","at":"1970-01-01T00:00:00.000Z"}],"assignee":null,"created_at":"1970-01-01T00:00:00.000Z"}"#),
    ];
    for (id, bytes) in cases {
        meta.put(
            &keys::key(KeyKind::Tasks, &[id]),
            bytes,
            Precondition::None,
            None,
        )
        .await
        .expect("put");
        match s.get(id).await {
            Err(TaskError::Store(StoreFailure::Corrupt { key, .. })) => {
                assert!(key.ends_with(id), "{key}")
            }
            other => panic!("{id}: expected Corrupt, got {other:?}"),
        }
        // Never "absent": a submit with that id does not overwrite it.
        assert!(matches!(
            s.submit(Some(id), AGENT, json!(1)).await,
            Err(TaskError::Store(StoreFailure::Corrupt { .. }))
        ));
    }
    assert!(matches!(
        s.list(&TaskFilter::default(), 100, None).await,
        Err(TaskError::Store(StoreFailure::Corrupt { .. }))
    ));
    assert_eq!(s.get("good").await.expect("get").id, "good");
}

/// Rolling upgrades (state-plane.md, "Records"): a task record that a newer release
/// wrote with a field this one does not know is read (not corrupt), and claims and
/// transitions by this release write the field back unchanged.
async fn a_field_a_newer_release_wrote_survives_every_transition(b: &mut Harness) {
    let s = store(b);
    let meta = b.meta();
    let t = s
        .submit(Some("newer"), AGENT, json!({"q": 1}))
        .await
        .expect("submit")
        .task;
    let (mut record, _) = stored(meta.as_ref(), "newer").await.expect("stored");
    record["deadline"] = json!({"at": "2030-01-01T00:00:00Z"});
    let key = keys::key(KeyKind::Tasks, &["newer"]);
    meta.put(
        &key,
        &serde_json::to_vec(&record).unwrap(),
        Precondition::ModRevision(t.version),
        None,
    )
    .await
    .expect("the newer release's write");
    let read = s.get("newer").await.expect("not corrupt");
    assert_eq!(read.kept.names().collect::<Vec<_>>(), ["deadline"]);
    let who = session(meta.as_ref(), "newer-session", AGENT).await;
    let claimed = s.claim("newer", &who).await.expect("claim");
    let done = s
        .transition(
            "newer",
            TaskState::Completed,
            Some(json!({"ok": true})),
            Some(claimed.version),
            &who,
        )
        .await
        .expect("complete");
    let (after, version) = stored(meta.as_ref(), "newer").await.expect("stored");
    assert_eq!(version, done.version);
    assert_eq!(after["state"], "completed", "{after}");
    assert_eq!(
        after["deadline"],
        json!({"at": "2030-01-01T00:00:00Z"}),
        "kept through claim and transition: {after}"
    );
}

async fn restart_keeps_every_acknowledged_submit_and_transition(b: &mut Harness) {
    let s = Arc::new(store(b));
    let meta = b.meta();
    let who = session(meta.as_ref(), "restart", AGENT).await;
    // Writers run while the backend is restarted under them.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let acks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut writers = Vec::new();
    for w in 0..2 {
        let (s, who, stop, acks) = (s.clone(), who.clone(), stop.clone(), acks.clone());
        writers.push(tokio::spawn(async move {
            // The last acknowledged (state, version) of every task.
            let mut acked: HashMap<String, (TaskState, i64)> = HashMap::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let id = format!("w{w}-{i}");
                i += 1;
                let Ok(sub) = s.submit(Some(&id), AGENT, json!({"i": i})).await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                acked.insert(id.clone(), (sub.task.state, sub.task.version));
                acks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Ok(t) = s.claim(&id, &who).await else {
                    continue;
                };
                acked.insert(id.clone(), (t.state, t.version));
                if let Ok(t) = s
                    .transition(
                        &id,
                        TaskState::Completed,
                        Some(json!(i)),
                        Some(t.version),
                        &who,
                    )
                    .await
                {
                    acked.insert(id.clone(), (t.state, t.version));
                }
            }
            acked
        }));
    }
    // Acknowledged writes before the restart, and again after it.
    let acked_past = |n: usize| {
        let acks = acks.clone();
        move || {
            let acks = acks.clone();
            async move {
                let now = acks.load(std::sync::atomic::Ordering::SeqCst);
                anyhow::ensure!(now >= n, "{now} acknowledged submits, waiting for {n}");
                Ok(())
            }
        }
    };
    wait_until(
        Duration::from_secs(20),
        "submits before the restart",
        acked_past(5),
    )
    .await
    .expect("writers make progress");
    b.restart().await;
    b.wait_ready().await;
    let after = acks.load(std::sync::atomic::Ordering::SeqCst) + 5;
    wait_until(
        Duration::from_secs(20),
        "submits after the restart",
        acked_past(after),
    )
    .await
    .expect("writers make progress after the restart");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut acked = HashMap::new();
    for w in writers {
        acked.extend(w.await.expect("join"));
    }
    assert!(!acked.is_empty());
    // A fresh store (as after a meshd restart) sees every acknowledged write.
    let fresh = store(b);
    for (id, (state, version)) in &acked {
        let t = fresh
            .get(id)
            .await
            .unwrap_or_else(|e| panic!("acknowledged task {id}: {e}"));
        assert!(t.version >= *version, "{id}: version went back");
        if t.version == *version {
            assert_eq!(t.state, *state, "{id}");
        }
        let rank = |s: TaskState| match s {
            TaskState::Submitted => 0,
            TaskState::Working => 1,
            _ => 2,
        };
        assert!(
            rank(t.state) >= rank(*state),
            "{id}: {} after acked {state}",
            t.state
        );
    }
}

async fn meta_unavailable_never_drops_a_submit(b: &mut Harness) {
    let s = Arc::new(store(b));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // (succeeded, failed) so far.
    let counts = Arc::new((
        std::sync::atomic::AtomicUsize::new(0),
        std::sync::atomic::AtomicUsize::new(0),
    ));
    let submitter = {
        let (s, stop, counts) = (s.clone(), stop.clone(), counts.clone());
        tokio::spawn(async move {
            let mut outcomes: Vec<(String, Result<bool, TaskError>)> = Vec::new();
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let id = format!("u-{i}");
                i += 1;
                let r = s.submit(Some(&id), AGENT, json!({"i": i})).await;
                let failed = r.is_err();
                let counter = if failed { &counts.1 } else { &counts.0 };
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                outcomes.push((id, r.map(|sub| sub.created)));
                if failed {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            outcomes
        })
    };
    let counted = |which: usize, n: usize| {
        let counts = counts.clone();
        move || {
            let counts = counts.clone();
            async move {
                let c = if which == 0 { &counts.0 } else { &counts.1 };
                let now = c.load(std::sync::atomic::Ordering::SeqCst);
                anyhow::ensure!(now >= n, "{now} of {n}");
                Ok(())
            }
        }
    };
    wait_until(
        Duration::from_secs(20),
        "a submit before the stop",
        counted(0, 1),
    )
    .await
    .expect("submits work");
    b.stop();
    // While Meta is down, submits fail with a typed error (checked below) ...
    wait_until(
        Duration::from_secs(20),
        "submits failing while Meta is down",
        counted(1, 3),
    )
    .await
    .expect("submits fail while Meta is down");
    b.start().await;
    // ... and work again on the same store once it is back.
    let s2 = s.clone();
    wait_until(
        Duration::from_secs(20),
        "a submit after the restart",
        || {
            let s = s2.clone();
            async move { Ok(s.submit(Some("after"), AGENT, json!("after")).await?) }
        },
    )
    .await
    .expect("submits work again");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let outcomes = submitter.await.expect("join");
    let ok = outcomes.iter().filter(|(_, r)| r.is_ok()).count();
    let failed = outcomes.len() - ok;
    assert!(ok > 0, "some submits succeeded");
    assert!(failed > 0, "some submits failed while Meta was down");
    for (id, r) in &outcomes {
        match r {
            Ok(created) => {
                assert!(created, "{id}: a fresh id is a create");
                assert!(
                    stored(b.meta().as_ref(), id).await.is_some(),
                    "{id} was acknowledged but is not in Meta"
                );
            }
            Err(TaskError::Store(StoreFailure::Unavailable(_))) => {
                assert!(
                    stored(b.meta().as_ref(), id).await.is_none(),
                    "{id}: Unavailable but written"
                );
            }
            Err(TaskError::Store(StoreFailure::Indeterminate(_))) => {
                // Retrying with the same id is safe: it returns the task if it was
                // written, creates it otherwise.
                let again = s.submit(Some(id), AGENT, json!({"i": id_number(id)})).await;
                assert!(again.is_ok(), "{id}: retry after Indeterminate: {again:?}");
            }
            Err(e) => panic!(
                "{id}: submit failed with {e:?} (only Unavailable/Indeterminate are allowed)"
            ),
        }
    }
}

fn id_number(id: &str) -> i64 {
    // Ids are "u-{i-1}" for input {"i": i}.
    id.trim_start_matches("u-").parse::<i64>().expect("number") + 1
}
