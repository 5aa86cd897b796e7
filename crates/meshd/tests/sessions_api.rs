//! Sessions through the real binary (`POST/GET/DELETE /v1/sessions...`).
//!
//! The failure these tests pin, above all: a session holder that stalls (here: SIGSTOP)
//! while another instance takes its client id over, and then wakes up believing it
//! still holds the session. Its next heartbeat must be refused as 409 fenced, and that
//! refused write must leave Meta as the takeover wrote it: the new holder's session,
//! with its higher epoch, seen the same on every instance. Around it: the contract's
//! shapes and bad input, a takeover on one instance, and a session that nobody
//! heartbeats expiring with its TTL (and not a moment later than TTL plus slack).

mod common;

use anyhow::{anyhow, ensure};
use common::{bare, problem, problem_naming};
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http::{self, request_with, send_json, Response};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::path::Path;
use std::time::Duration;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_meshd"))
}

/// The instance id from the start-up line (`instance=...`).
fn instance_of(m: &MeshdProcess) -> String {
    m.first_line()
        .split_whitespace()
        .find_map(|w| w.strip_prefix("instance="))
        .unwrap_or_else(|| panic!("no instance= in {:?}", m.first_line()))
        .to_string()
}

/// A session as the API shows it.
#[derive(Debug, Clone, PartialEq)]
struct Sess {
    id: String,
    client_id: String,
    epoch: i64,
    instance: String,
    ttl_ms: u64,
}

/// Checks the shape of a session object (open, get, list entry).
fn sess(v: &Value) -> anyhow::Result<Sess> {
    let s = Sess {
        id: v["session_id"]
            .as_str()
            .ok_or_else(|| anyhow!("no session_id: {v}"))?
            .to_string(),
        client_id: v["client_id"]
            .as_str()
            .ok_or_else(|| anyhow!("no client_id: {v}"))?
            .to_string(),
        epoch: v["epoch"]
            .as_i64()
            .ok_or_else(|| anyhow!("no integer epoch: {v}"))?,
        instance: v["instance"]
            .as_str()
            .ok_or_else(|| anyhow!("no instance: {v}"))?
            .to_string(),
        ttl_ms: v["ttl_ms"]
            .as_u64()
            .ok_or_else(|| anyhow!("no integer ttl_ms: {v}"))?,
    };
    ensure!(
        s.id.len() == 32 && s.id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')),
        "session_id is not 32 lowercase hex digits: {v}"
    );
    ensure!(s.epoch > 0, "epoch is not positive: {v}");
    Ok(s)
}

/// `POST /v1/sessions`; asserts 201, the shape and the `Location`.
async fn open(a: &str, body: Value) -> Sess {
    let r = send_json(a, "POST", "/v1/sessions", &body).await.unwrap();
    assert_eq!(r.status, 201, "open {body}: {}", r.body);
    let s = sess(&r.json().unwrap()).unwrap();
    assert_eq!(
        r.header("location"),
        Some(format!("/v1/sessions/{}", s.id).as_str()),
        "{}",
        r.body
    );
    s
}

async fn open_raw(a: &str, body: &Value) -> Response {
    send_json(a, "POST", "/v1/sessions", body).await.unwrap()
}

async fn heartbeat(a: &str, id: &str) -> Response {
    bare(a, "POST", &format!("/v1/sessions/{id}/heartbeat")).await
}

/// Asserts a 200 heartbeat answer; returns (epoch, ttl_ms).
fn beat(r: &Response) -> (i64, u64) {
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json().unwrap();
    (
        v["epoch"]
            .as_i64()
            .unwrap_or_else(|| panic!("no epoch: {v}")),
        v["ttl_ms"]
            .as_u64()
            .unwrap_or_else(|| panic!("no ttl_ms: {v}")),
    )
}

async fn get_session(a: &str, id: &str) -> Response {
    http::get(a, &format!("/v1/sessions/{id}")).await.unwrap()
}

async fn list(a: &str) -> anyhow::Result<Vec<Sess>> {
    let r = http::get(a, "/v1/sessions").await?;
    ensure!(r.status == 200, "list answered {}: {}", r.status, r.body);
    let v = r.json()?;
    v["sessions"]
        .as_array()
        .ok_or_else(|| anyhow!("no sessions list: {v}"))?
        .iter()
        .map(sess)
        .collect()
}

/// The sessions of `client_id` in the list.
async fn listed(a: &str, client_id: &str) -> anyhow::Result<Vec<Sess>> {
    Ok(list(a)
        .await?
        .into_iter()
        .filter(|s| s.client_id == client_id)
        .collect())
}

/// Asserts a 409 whose `type` ends in `/fenced`.
fn fenced(r: &Response) {
    let p = problem(r, 409);
    assert!(
        p["type"].as_str().is_some_and(|t| t.ends_with("/fenced")),
        "409 but not fenced: {p}"
    );
}

async fn ready(m: &MeshdProcess) {
    wait_until(Duration::from_secs(30), "meshd ready", || async {
        let r = http::get(m.addr(), "/readyz").await?;
        ensure!(r.status == 200, "readyz {}: {}", r.status, r.body);
        Ok(())
    })
    .await
    .unwrap();
}

/// A meshd on its embedded defaults.
async fn embedded() -> (tempfile::TempDir, MeshdProcess) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    (dir, m)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_embedded_defaults_when_sessions_are_opened_and_heartbeated_then_ttls_are_granted_and_get_and_list_show_what_open_answered(
) {
    let (_dir, m) = embedded().await;
    let a = m.addr();
    let me = instance_of(&m);

    // Open with the default TTL.
    let s = open(a, json!({"client_id": "client-a"})).await;
    assert_eq!(s.client_id, "client-a");
    assert_eq!(s.instance, me);
    assert_eq!(s.ttl_ms, 10_000, "the default ttl_ms");

    // Both ends of the TTL range are accepted, and answered with the granted value.
    let short = open(a, json!({"client_id": "client.b_1", "ttl_ms": 2000})).await;
    assert_eq!(short.ttl_ms, 2000);
    // Closed at once: it would expire in the middle of the comparisons below.
    let r = bare(a, "DELETE", &format!("/v1/sessions/{}", short.id)).await;
    assert_eq!(r.status, 204, "{}", r.body);
    let long = open(a, json!({"client_id": "client-c", "ttl_ms": 3_600_000})).await;
    assert_eq!(long.ttl_ms, 3_600_000);
    assert_ne!(s.id, long.id);

    // Heartbeat: the same epoch, the effective TTL.
    assert_eq!(beat(&heartbeat(a, &s.id).await), (s.epoch, 10_000));
    // `{}` as a body is fine too.
    let r = send_json(
        a,
        "POST",
        &format!("/v1/sessions/{}/heartbeat", s.id),
        &json!({}),
    )
    .await
    .unwrap();
    assert_eq!(beat(&r), (s.epoch, 10_000));

    // Get and list show what open answered.
    let r = get_session(a, &s.id).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(sess(&r.json().unwrap()).unwrap(), s);
    let all = list(a).await.unwrap();
    let clients: Vec<&str> = all.iter().map(|s| s.client_id.as_str()).collect();
    assert!(
        clients.contains(&"client-a") && clients.contains(&"client-c"),
        "{all:?}"
    );
    let mut sorted = clients.clone();
    sorted.sort();
    assert_eq!(clients, sorted, "the list is in client id order");
    assert_eq!(
        all.iter().find(|x| x.client_id == "client-a"),
        Some(&s),
        "{all:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_sessions_when_the_list_is_read_in_pages_then_limit_1_walks_it_once_and_bad_paging_is_refused_naming_the_field(
) {
    let (_dir, m) = embedded().await;
    let a = m.addr();
    for c in ["client-a", "client-b", "client-c"] {
        open(a, json!({"client_id": c, "ttl_ms": 3_600_000})).await;
    }

    // Pages: limit 1 walks the list one session at a time.
    let mut walked = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..10 {
        let path = match &cursor {
            None => "/v1/sessions?limit=1".to_string(),
            Some(c) => format!("/v1/sessions?limit=1&cursor={c}"),
        };
        let page = http::get(a, &path).await.unwrap();
        assert_eq!(page.status, 200, "{}", page.body);
        let v = page.json().unwrap();
        let entries = v["sessions"].as_array().unwrap();
        assert!(entries.len() <= 1, "{v}");
        walked.extend(entries.iter().map(|e| sess(e).unwrap().client_id));
        match v.get("next_cursor").and_then(Value::as_str) {
            Some(c) => cursor = Some(c.to_string()),
            None => break,
        }
    }
    let listed_now: Vec<String> = list(a)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.client_id)
        .collect();
    assert_eq!(walked, listed_now, "paging covers the list exactly once");
    problem_naming(
        &http::get(a, "/v1/sessions?limit=0").await.unwrap(),
        "limit",
    );
    problem_naming(
        &http::get(a, "/v1/sessions?limit=1001").await.unwrap(),
        "limit",
    );
    problem_naming(
        &http::get(a, "/v1/sessions?cursor=no%20way").await.unwrap(),
        "cursor",
    );
    assert_eq!(walked.len(), 3, "{walked:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_open_session_when_it_is_closed_then_it_is_gone_on_every_route() {
    let (_dir, m) = embedded().await;
    let a = m.addr();
    let s = open(a, json!({"client_id": "client-a"})).await;
    assert!(!listed(a, "client-a").await.unwrap().is_empty());

    // Close: 204, then it is gone everywhere.
    let r = bare(a, "DELETE", &format!("/v1/sessions/{}", s.id)).await;
    assert_eq!(r.status, 204, "{}", r.body);
    problem(&get_session(a, &s.id).await, 404);
    problem(&heartbeat(a, &s.id).await, 404);
    problem(
        &bare(a, "DELETE", &format!("/v1/sessions/{}", s.id)).await,
        404,
    );
    assert!(
        listed(a, "client-a").await.unwrap().is_empty(),
        "a closed session is not listed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_live_session_when_opens_and_heartbeats_are_malformed_or_name_unknown_sessions_then_they_are_refused_and_change_nothing(
) {
    let (_dir, m) = embedded().await;
    let a = m.addr();
    let long = open(a, json!({"client_id": "client-c", "ttl_ms": 3_600_000})).await;

    // Bad input: a 400 naming the field, and nothing opened.
    let before = list(a).await.unwrap();
    for (body, field) in [
        (json!({"client_id": "x", "ttl_ms": 1999}), "ttl_ms"),
        (json!({"client_id": "x", "ttl_ms": 3_600_001}), "ttl_ms"),
        (json!({"client_id": "x", "ttl_ms": 0}), "ttl_ms"),
        (json!({"client_id": "x", "ttl_ms": -5}), "ttl_ms"),
        (json!({"client_id": "x", "ttl_ms": 2500.5}), "ttl_ms"),
        (json!({"client_id": "x", "ttl_ms": "10000"}), "ttl_ms"),
        (json!({"client_id": "bad id"}), "client_id"),
        (json!({"client_id": "bad/id"}), "client_id"),
        (json!({"client_id": "é"}), "client_id"),
        (json!({"client_id": ""}), "client_id"),
        (json!({"client_id": "a".repeat(250)}), "client_id"),
        (json!({"client_id": 7}), "client_id"),
        (json!({"ttl_ms": 10000}), "client_id"),
        (json!({}), "client_id"),
        (json!({"client_id": "x", "nope": 1}), "nope"),
        (json!({"client_id": "x", "session_id": "y"}), "session_id"),
    ] {
        let r = open_raw(a, &body).await;
        let p = problem_naming(&r, field);
        assert!(
            p["detail"].as_str().unwrap().contains(field),
            "{body}: the detail says what was wrong: {p}"
        );
    }
    // 249 characters is still a name.
    let longest = "a".repeat(249);
    let l = open(a, json!({"client_id": longest})).await;
    assert_eq!(l.client_id.len(), 249);
    assert_eq!(
        bare(a, "DELETE", &format!("/v1/sessions/{}", l.id))
            .await
            .status,
        204
    );

    for raw in [
        &b"{not json"[..],
        b"[1,2]",
        b"\"client-a\"",
        b"{\"client_id\": \"x\"",
    ] {
        let r = request_with(
            a,
            "POST",
            "/v1/sessions",
            &[("Content-Type", "application/json")],
            raw,
        )
        .await
        .unwrap();
        problem(&r, 400);
    }
    let r = request_with(
        a,
        "POST",
        "/v1/sessions",
        &[("Content-Type", "text/plain")],
        br#"{"client_id": "x"}"#,
    )
    .await
    .unwrap();
    problem(&r, 415);
    let r = request_with(
        a,
        "POST",
        &format!("/v1/sessions/{}/heartbeat", long.id),
        &[("Content-Type", "text/plain")],
        b"beat",
    )
    .await
    .unwrap();
    problem(&r, 415);
    let r = send_json(
        a,
        "POST",
        &format!("/v1/sessions/{}/heartbeat", long.id),
        &json!({"ttl_ms": 5000}),
    )
    .await
    .unwrap();
    problem_naming(&r, "ttl_ms");
    assert_eq!(
        list(a).await.unwrap(),
        before,
        "rejected requests opened or changed nothing"
    );

    // Unknown ids: well-formed or not, 404 on every route.
    for id in [
        "0123456789abcdef0123456789abcdef",
        "nope",
        "ABCDEF0123456789ABCDEF0123456789",
    ] {
        problem(&get_session(a, id).await, 404);
        problem(&heartbeat(a, id).await, 404);
        problem(&bare(a, "DELETE", &format!("/v1/sessions/{id}")).await, 404);
    }
    problem(&bare(a, "PUT", "/v1/sessions").await, 405);
    problem(
        &bare(a, "PATCH", &format!("/v1/sessions/{}", long.id)).await,
        405,
    );

    // The long one is still live and untouched by all of the above.
    assert_eq!(beat(&heartbeat(a, &long.id).await), (long.epoch, 3_600_000));
    assert_eq!(
        bare(a, "DELETE", &format!("/v1/sessions/{}", long.id))
            .await
            .status,
        204
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_one_instance_when_a_client_id_is_opened_again_then_the_first_session_is_fenced_and_the_second_is_the_only_one_listed(
) {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let a = m.addr();
    let first = open(a, json!({"client_id": "worker-1", "ttl_ms": 60_000})).await;
    let second = open(a, json!({"client_id": "worker-1", "ttl_ms": 60_000})).await;
    assert_ne!(first.id, second.id);
    assert!(
        second.epoch > first.epoch,
        "a takeover has a higher epoch: {first:?} then {second:?}"
    );

    fenced(&heartbeat(a, &first.id).await);
    fenced(&bare(a, "DELETE", &format!("/v1/sessions/{}", first.id)).await);
    problem(&get_session(a, &first.id).await, 404);
    assert_eq!(listed(a, "worker-1").await.unwrap(), vec![second.clone()]);
    assert_eq!(beat(&heartbeat(a, &second.id).await).0, second.epoch);
    assert_eq!(
        bare(a, "DELETE", &format!("/v1/sessions/{}", second.id))
            .await
            .status,
        204
    );
    // The old session is still fenced (its id key lives on its own lease), not revived.
    fenced(&heartbeat(a, &first.id).await);
    assert!(listed(a, "worker-1").await.unwrap().is_empty());
}

/// A heartbeat answer once the instance can reach Meta again (a 503 means nothing was
/// applied and is retried; anything else is the answer).
async fn heartbeat_answer(a: &str, id: &str, what: &str) -> Response {
    wait_until(Duration::from_secs(20), what, || async move {
        let r = http::request(
            a,
            "POST",
            &format!("/v1/sessions/{id}/heartbeat"),
            None,
            Duration::from_secs(5),
        )
        .await?;
        ensure!(r.status != 503, "503: {}", r.body);
        Ok(r)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_two_instances_on_one_etcd_when_a_paused_holder_is_taken_over_then_its_heartbeat_is_fenced_and_etcd_keeps_the_new_epoch(
) {
    let etcd = EtcdProcess::start().await.unwrap();
    let meta = format!("etcd://{}", etcd.endpoint());
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = MeshdProcess::start(bin(), dir_a.path(), &["--meta", &meta])
        .await
        .unwrap();
    let b = MeshdProcess::start(bin(), dir_b.path(), &["--meta", &meta])
        .await
        .unwrap();
    ready(&a).await;
    ready(&b).await;
    let (id_a, id_b) = (instance_of(&a), instance_of(&b));
    assert_ne!(id_a, id_b, "two instances, two ids");

    // A holds client X. The TTL is long so that A's old session is still within its
    // lease when A wakes up: the answer must be "fenced", not "expired".
    let sa = open(a.addr(), json!({"client_id": "client-x", "ttl_ms": 60_000})).await;
    assert_eq!(sa.instance, id_a);
    assert_eq!(sa.ttl_ms, 60_000, "etcd grants whole seconds; 60 s is one");
    // B sees A's session through the shared Meta.
    wait_until(Duration::from_secs(10), "B lists A's session", || async {
        let l = listed(b.addr(), "client-x").await?;
        ensure!(l == vec![sa.clone()], "B lists {l:?}");
        Ok(())
    })
    .await
    .unwrap();

    // A stalls; B takes X over meanwhile.
    a.pause();
    let sb = open(b.addr(), json!({"client_id": "client-x", "ttl_ms": 60_000})).await;
    assert_eq!(sb.instance, id_b);
    assert_ne!(sb.id, sa.id);
    assert!(
        sb.epoch > sa.epoch,
        "the takeover has a higher epoch: A {sa:?}, B {sb:?}"
    );
    a.resume();

    // A wakes up and heartbeats the session it believes it holds: fenced.
    let r = heartbeat_answer(a.addr(), &sa.id, "A's heartbeat after the resume").await;
    fenced(&r);
    // Again, and through B: still fenced, on any instance; a fenced close deletes
    // nothing either.
    fenced(&heartbeat(a.addr(), &sa.id).await);
    fenced(&heartbeat(b.addr(), &sa.id).await);
    fenced(&bare(a.addr(), "DELETE", &format!("/v1/sessions/{}", sa.id)).await);

    // The refused writes changed nothing: B's session, with B's epoch, is what etcd
    // holds, as B reads it, as B renews it, and as A comes to list it.
    let r = get_session(b.addr(), &sb.id).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(sess(&r.json().unwrap()).unwrap(), sb);
    assert_eq!(
        listed(b.addr(), "client-x").await.unwrap(),
        vec![sb.clone()]
    );
    assert_eq!(beat(&heartbeat(b.addr(), &sb.id).await), (sb.epoch, 60_000));
    problem(&get_session(b.addr(), &sa.id).await, 404);
    wait_until(
        Duration::from_secs(15),
        "A lists B's session (and only it) for client-x",
        || async {
            let l = listed(a.addr(), "client-x").await?;
            ensure!(l == vec![sb.clone()], "A lists {l:?}");
            let r = get_session(a.addr(), &sb.id).await;
            ensure!(
                r.status == 200,
                "A's GET of B's session: {} {}",
                r.status,
                r.body
            );
            ensure!(
                sess(&r.json()?)? == sb,
                "A's GET of B's session: {}",
                r.body
            );
            let r = get_session(a.addr(), &sa.id).await;
            ensure!(
                r.status == 404,
                "A's GET of its old session: {} {}",
                r.status,
                r.body
            );
            Ok(())
        },
    )
    .await
    .unwrap();
    // B's view did not move while A caught up.
    assert_eq!(
        listed(b.addr(), "client-x").await.unwrap(),
        vec![sb.clone()]
    );
    fenced(&heartbeat(a.addr(), &sa.id).await);

    // B can still end its session, and then nobody lists X.
    assert_eq!(
        bare(b.addr(), "DELETE", &format!("/v1/sessions/{}", sb.id))
            .await
            .status,
        204
    );
    wait_until(Duration::from_secs(15), "client-x gone on both", || async {
        for m in [&a, &b] {
            let l = listed(m.addr(), "client-x").await?;
            ensure!(l.is_empty(), "{} still lists {l:?}", m.addr());
        }
        Ok(())
    })
    .await
    .unwrap();
}

/// Opens a session with the shortest TTL and never heartbeats it: within TTL plus
/// slack it is gone from the list, and then heartbeat and get answer 404. The wait
/// polls the list only: a heartbeat would renew the lease.
async fn expires_without_heartbeats(m: &MeshdProcess) {
    let a = m.addr();
    let s = open(a, json!({"client_id": "forgetful", "ttl_ms": 2000})).await;
    assert_eq!(s.ttl_ms, 2000);
    let r = get_session(a, &s.id).await;
    assert_eq!(r.status, 200, "live right after the open: {}", r.body);
    assert_eq!(listed(a, "forgetful").await.unwrap(), vec![s.clone()]);
    // A neighbour that is heartbeated is not affected by the expiry.
    let other = open(a, json!({"client_id": "steady", "ttl_ms": 3_600_000})).await;

    let slack = Duration::from_secs(10);
    wait_until(
        Duration::from_millis(s.ttl_ms) + slack,
        "the unheartbeated session to expire",
        || async {
            let l = listed(a, "forgetful").await?;
            ensure!(l.is_empty(), "still listed: {l:?}");
            Ok(())
        },
    )
    .await
    .unwrap();
    problem(&heartbeat(a, &s.id).await, 404);
    problem(&get_session(a, &s.id).await, 404);
    problem(
        &bare(a, "DELETE", &format!("/v1/sessions/{}", s.id)).await,
        404,
    );
    assert_eq!(beat(&heartbeat(a, &other.id).await).0, other.epoch);
    assert_eq!(listed(a, "steady").await.unwrap(), vec![other]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_embedded_meta_when_a_session_is_not_heartbeated_then_it_expires_with_its_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    expires_without_heartbeats(&m).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_etcd_meta_when_a_session_is_not_heartbeated_then_it_expires_with_its_ttl() {
    let etcd = EtcdProcess::start().await.unwrap();
    let meta = format!("etcd://{}", etcd.endpoint());
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(bin(), dir.path(), &["--meta", &meta])
        .await
        .unwrap();
    ready(&m).await;
    expires_without_heartbeats(&m).await;
}
