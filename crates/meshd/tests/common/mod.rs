//! Shared by the consume end-to-end tests: start the real binary, and create topics and
//! subscriptions, publish, pull, ack, nack, extend and read offsets over the public HTTP
//! API, checking on the way that every answer has the shape of the contract
//! (`../shared/design/http-api.md`). Helpers return `anyhow::Result` so they can run
//! inside [`wait_until`], which reports the last shortfall on timeout.
//!
//! Every request of these helpers goes through the typed [`meshd_client::Client`]
//! ([`client`]), the one client of the public API; what a helper checks beyond what
//! the client's typed answer enforces (the exact status, lists and fields as meshd
//! wrote them) it checks on the `*_answer` twin's whole answer. Requests built by
//! hand ([`bare`], [`problem`]'s answers, [`pull_own`]'s internal route) are for the
//! raw protocol only.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

pub mod disk;
pub mod oracle;
pub mod webhook;

use anyhow::{anyhow, bail, ensure, Context};
use meshd_client::{Client, Pull};
use meshd_test_support::http::{self, request_with, Response};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_meshd"))
}

pub async fn start(dir: &Path) -> MeshdProcess {
    MeshdProcess::start(bin(), dir, &[])
        .await
        .expect("start meshd")
}

/// How long any request of a test may take, long polls included (as the tests'
/// requests always were): a long poll asking for more is answered by something else
/// (meshd's stop) or fails.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The client of the meshd at `a` (`host:port`) as the tests use it: each request sent
/// once (a publish whose answer is lost is not sent again: a test sees what it sent
/// and what came back) and bounded by [`REQUEST_TIMEOUT`].
pub fn client(a: &str) -> Client {
    let target = meshd_client::Target::peer(a, false)
        .unwrap_or_else(|e| panic!("{a} is not a host:port: {e}"));
    Client::new(target, meshd_client::Transport::new())
        .with_publish_retries(0)
        .with_timeout(REQUEST_TIMEOUT)
}

/// The answer of a client call when its status is `status`; otherwise what came back
/// instead (another status, the problem meshd answered, or no answer).
pub fn answered(
    r: Result<meshd_client::Response, meshd_client::Error>,
    status: u16,
    what: &str,
) -> anyhow::Result<meshd_client::Response> {
    match r {
        Ok(a) if a.status == status => Ok(a),
        Ok(a) => Err(anyhow!("{what} answered {}: {}", a.status, a.text())),
        Err(meshd_client::Error::Api(p)) => Err(anyhow!(
            "{what} answered {}: {} {}",
            p.status,
            p.kind.as_deref().unwrap_or("(no type)"),
            p.detail
        )),
        Err(e) => Err(anyhow!("{what}: {e}")),
    }
}

/// The JSON body of an answer.
fn body_of(a: &meshd_client::Response) -> anyhow::Result<Value> {
    a.json::<Value>().map_err(|e| anyhow!("{e}"))
}

/// Asserts `r` is an RFC 9457 problem with `status` and returns its body.
pub fn problem(r: &Response, status: u16) -> Value {
    assert_eq!(r.status, status, "{}", r.body);
    assert_eq!(
        r.header("content-type"),
        Some("application/problem+json"),
        "{}",
        r.body
    );
    let p = r.json().unwrap();
    assert_eq!(p["status"], status, "{p}");
    assert!(
        p["type"].as_str().is_some()
            && p["title"].as_str().is_some()
            && p["detail"].as_str().is_some(),
        "problem without type, title or detail: {p}"
    );
    p
}

/// Asserts a 400 problem whose `field` is `field`.
pub fn problem_naming(r: &Response, field: &str) -> Value {
    let p = problem(r, 400);
    assert_eq!(p["field"], field, "{p}");
    p
}

/// `PUT /v1/topics/{topic}` ([`Client::create_topic_answer`]); asserts 201.
pub async fn create_topic(a: &str, topic: &str, partitions: u32) {
    let r = client(a).create_topic_answer(topic, partitions).await;
    answered(r, 201, &format!("PUT topic {topic}")).unwrap_or_else(|e| panic!("{e:#}"));
}

/// `PUT /v1/topics/{topic}` with `settings` ([`Client::put_topic_answer`]); asserts
/// 201; the topic as stored.
pub async fn create_topic_with(a: &str, topic: &str, settings: Value) -> Value {
    let r = client(a).put_topic_answer(topic, &settings).await;
    let r = answered(r, 201, &format!("PUT topic {topic}"))
        .unwrap_or_else(|e| panic!("{settings}: {e:#}"));
    body_of(&r).unwrap()
}

/// `PUT /v1/subscriptions/{name}` with `body` ([`Client::put_subscription_answer`]);
/// asserts 201.
pub async fn create_subscription(a: &str, name: &str, body: Value) -> Value {
    let r = client(a).put_subscription_answer(name, &body).await;
    let r = answered(r, 201, &format!("PUT subscription {name}"))
        .unwrap_or_else(|e| panic!("{body}: {e:#}"));
    body_of(&r).unwrap()
}

/// A CloudEvent with an extension attribute and structured data, so that "exactly as
/// published" covers more than the required attributes.
pub fn event(id: &str) -> Value {
    json!({
        "specversion": "1.0",
        "id": id,
        "source": "/consume-e2e",
        "type": "test.consumed",
        "subject": format!("subject-{id}"),
        "datacontenttype": "application/json",
        "traceref": format!("trace-{id}"),
        "data": {"id": id, "n": [1, 2.5, -3], "nested": {"ok": true, "none": null}, "text": "héllo"}
    })
}

/// Publishes one event in structured mode ([`Client::publish_event_answer`]); asserts
/// 201 placing that event; returns its (partition, offset).
pub async fn publish(a: &str, topic: &str, event: &Value) -> anyhow::Result<(u64, u64)> {
    let r = answered(
        client(a).publish_event_answer(topic, event).await,
        201,
        "publish",
    )?;
    let placed = &body_of(&r)?["events"][0];
    ensure!(placed["id"] == event["id"], "publish answered {}", r.text());
    match (placed["partition"].as_u64(), placed["offset"].as_u64()) {
        (Some(p), Some(o)) => Ok((p, o)),
        _ => Err(anyhow!(
            "publish answer without partition/offset: {}",
            r.text()
        )),
    }
}

/// Publishes `events` as one batch ([`Client::publish_answer`]); asserts 201 placing
/// each of them, in order; returns their (partition, offset).
pub async fn publish_batch(
    a: &str,
    topic: &str,
    events: &[Value],
) -> anyhow::Result<Vec<(u64, u64)>> {
    let r = answered(
        client(a).publish_answer(topic, events).await,
        201,
        "publish",
    )?;
    let answer = body_of(&r)?;
    let placed = answer["events"]
        .as_array()
        .ok_or_else(|| anyhow!("publish answer without an events list: {answer}"))?;
    ensure!(
        placed.len() == events.len(),
        "publish of {} events answered {answer}",
        events.len()
    );
    placed
        .iter()
        .zip(events)
        .map(|(p, e)| {
            ensure!(p["id"] == e["id"], "publish answered {answer}");
            match (p["partition"].as_u64(), p["offset"].as_u64()) {
                (Some(p), Some(o)) => Ok((p, o)),
                _ => bail!("publish answer without partition/offset: {answer}"),
            }
        })
        .collect()
}

/// One delivery of a pull answer.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Sent back exactly as received (the contract does not fix its JSON type).
    pub id: Value,
    pub partition: u64,
    pub offset: u64,
    pub attempt: u64,
    pub event: Value,
}

/// The pull request `body` names (its `max_events`, `wait_ms`, `max_bytes`,
/// `session`); anything else in it is an error, never dropped.
fn pull_of(body: &Value) -> anyhow::Result<Pull> {
    let fields = body
        .as_object()
        .ok_or_else(|| anyhow!("a pull body is an object: {body}"))?;
    let mut pull = Pull::default();
    for (k, v) in fields {
        let count = || {
            v.as_u64()
                .ok_or_else(|| anyhow!("pull's {k} is not a count: {body}"))
        };
        match k.as_str() {
            "max_events" => pull.max_events = Some(count()?),
            "wait_ms" => pull.wait_ms = Some(count()?),
            "max_bytes" => pull.max_bytes = Some(count()?),
            "session" => {
                let s = v
                    .as_str()
                    .ok_or_else(|| anyhow!("pull's session is not text: {body}"))?;
                pull.session = Some(s.to_string());
            }
            _ => bail!("{k} is not a field of a pull (meshd_client::Pull): {body}"),
        }
    }
    Ok(pull)
}

/// `POST /v1/subscriptions/{sub}/pull` with `body` ([`Client::pull_answer`]); asserts
/// 200 and the answer's shape: a list of deliveries, each with a delivery id, numeric
/// partition, offset and attempt (the client's typed decoding), and an event object.
pub async fn pull(a: &str, sub: &str, body: &Value) -> anyhow::Result<Vec<Delivery>> {
    let r = answered(
        client(a).pull_answer(sub, &pull_of(body)?).await,
        200,
        "pull",
    )?;
    let list = meshd_client::deliveries_of(&r)
        .map_err(|e| anyhow!("pull answer without a list of deliveries ({e})"))?;
    list.into_iter()
        .map(|d| {
            let event = match d.event {
                Ok(e) if e.is_object() => e,
                other => bail!(
                    "delivery {} without an event object: {other:?}",
                    d.delivery_id
                ),
            };
            Ok(Delivery {
                id: Value::String(d.delivery_id),
                partition: d.partition.into(),
                offset: d.offset,
                attempt: d.attempt.into(),
                event,
            })
        })
        .collect()
}

/// Long-polls once for `wait_ms` and asserts that nothing is delivered (`why` says
/// what a delivery would mean).
pub async fn assert_no_delivery(a: &str, sub: &str, wait_ms: u64, why: &str) {
    let got = pull(a, sub, &json!({"max_events": 100, "wait_ms": wait_ms}))
        .await
        .unwrap();
    assert!(got.is_empty(), "{why}: {:?}", summary(&got));
}

/// Waits (bounded) until the meshd at `a` shows exactly `n` long polls waiting on its
/// `meshd_http_long_polls` gauge: the long-poll slots held by pulls with `wait_ms` >
/// 0, taken once the request is read and admitted and held until it is answered. A
/// long poll spawned before this call is then in meshd's hands, not on its way.
pub async fn wait_long_polls(a: &str, n: u64) {
    wait_until(
        Duration::from_secs(10),
        &format!("{n} long polls waiting on {a}"),
        || async {
            let now = http::metric(a, "meshd_http_long_polls").await?;
            ensure!(now == n as f64, "meshd_http_long_polls {now}");
            Ok(())
        },
    )
    .await
    .unwrap();
}

/// Long-polls until at least `n` deliveries arrived in total (bounded by `deadline`).
pub async fn pull_until(a: &str, sub: &str, n: usize, deadline: Duration) -> Vec<Delivery> {
    let got: Arc<Mutex<Vec<Delivery>>> = Arc::default();
    let done = wait_until(deadline, &format!("{n} deliveries from {sub}"), || {
        let got = got.clone();
        async move {
            let batch = pull(a, sub, &json!({"max_events": 100, "wait_ms": 1000})).await?;
            let mut got = got.lock().unwrap();
            got.extend(batch);
            ensure!(
                got.len() >= n,
                "{} of {n} so far: {:?}",
                got.len(),
                summary(&got)
            );
            Ok(())
        }
    })
    .await;
    let mut all = got.lock().unwrap().clone();
    // The last attempt may have been cut off by the deadline: say what did arrive.
    if let Err(e) = done {
        panic!(
            "{e:#}; (partition, offset, attempt) received: {:?}",
            summary(&all)
        );
    }
    all.sort_by_key(|d| (d.partition, d.offset, d.attempt));
    all
}

/// (partition, offset, attempt) of each delivery, for messages.
pub fn summary(ds: &[Delivery]) -> Vec<(u64, u64, u64)> {
    ds.iter()
        .map(|d| (d.partition, d.offset, d.attempt))
        .collect()
}

pub fn ids<'a>(ds: impl IntoIterator<Item = &'a Delivery>) -> Vec<Value> {
    ds.into_iter().map(|d| d.id.clone()).collect()
}

/// The ids in one list of an ack/nack/extend answer, as a set of JSON texts.
pub fn set(list: &Value) -> BTreeSet<String> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(Value::to_string)
        .collect()
}

pub fn set_of(ids: &[Value]) -> BTreeSet<String> {
    ids.iter().map(Value::to_string).collect()
}

/// Delivery ids as the client sends them (text, as meshd hands them out).
fn id_texts(ids: &[Value]) -> anyhow::Result<Vec<String>> {
    ids.iter()
        .map(|id| {
            id.as_str()
                .map(str::to_string)
                .ok_or_else(|| anyhow!("delivery id {id} is not text"))
        })
        .collect()
}

/// The answer of an ack, nack or extend (`verb`); asserts 200 and that the answer has
/// each of the lists `keys`.
fn outcome(
    r: Result<meshd_client::Response, meshd_client::Error>,
    verb: &str,
    keys: &[&str],
) -> anyhow::Result<Value> {
    let answer = body_of(&answered(r, 200, verb)?)?;
    for k in keys {
        ensure!(
            answer[*k].is_array(),
            "{verb} answer without a {k} list: {answer}"
        );
    }
    Ok(answer)
}

/// [`Client::ack_answer`]: the answer, with each of its lists.
pub async fn ack(a: &str, sub: &str, ids: &[Value]) -> anyhow::Result<Value> {
    let r = client(a).ack_answer(sub, &id_texts(ids)?).await;
    outcome(r, "ack", &["acked", "unknown", "fenced", "failed"])
}

/// [`Client::nack_answer`]: the answer, with each of its lists.
pub async fn nack(a: &str, sub: &str, ids: &[Value], reason: &str) -> anyhow::Result<Value> {
    let r = client(a).nack_answer(sub, &id_texts(ids)?, reason).await;
    outcome(
        r,
        "nack",
        &[
            "retrying",
            "dead_lettered",
            "dead_lettering",
            "unknown",
            "fenced",
        ],
    )
}

/// [`Client::extend_answer`]: the answer, with each of its lists.
pub async fn extend(
    a: &str,
    sub: &str,
    ids: &[Value],
    ack_timeout_ms: u64,
) -> anyhow::Result<Value> {
    let r = client(a)
        .extend_answer(sub, &id_texts(ids)?, ack_timeout_ms)
        .await;
    outcome(r, "extend", &["extended", "unknown"])
}

/// `GET /v1/subscriptions/{sub}/offsets` ([`Client::offsets_answer`]; asserts 200) →
/// the `offsets` list as meshd wrote it.
pub async fn offsets(a: &str, sub: &str) -> anyhow::Result<Vec<Value>> {
    let r = answered(client(a).offsets_answer(sub).await, 200, "offsets")?;
    let answer = body_of(&r)?;
    answer["offsets"]
        .as_array()
        .cloned()
        .ok_or_else(|| anyhow!("offsets answer without an offsets list: {answer}"))
}

/// The committed offset of one partition.
pub async fn committed(a: &str, sub: &str, partition: u64) -> anyhow::Result<u64> {
    let all = offsets(a, sub).await?;
    all.iter()
        .find(|o| o["partition"].as_u64() == Some(partition))
        .and_then(|o| o["committed"].as_u64())
        .ok_or_else(|| anyhow!("no committed offset for partition {partition} in {all:?}"))
}

/// Waits until the committed offset of `partition` is `want` (it is shown once durable).
pub async fn wait_committed(a: &str, sub: &str, partition: u64, want: u64) {
    wait_until(
        Duration::from_secs(15),
        &format!("{sub} committed offset {want} on partition {partition}"),
        || async move {
            let got = committed(a, sub, partition).await?;
            ensure!(got == want, "committed is {got}");
            Ok(())
        },
    )
    .await
    .unwrap();
}

/// `GET /v1/topics/{topic}` ([`Client::topic_answer`]) → `end_offsets`.
pub async fn end_offsets(a: &str, topic: &str) -> Vec<u64> {
    let t = client(a)
        .topic_answer(topic)
        .await
        .map_err(anyhow::Error::from)
        .and_then(|r| body_of(&r))
        .unwrap_or_else(|e| panic!("GET topic {topic}: {e:#}"));
    t["end_offsets"]
        .as_array()
        .unwrap_or_else(|| panic!("no end_offsets: {t}"))
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

/// Every event of one partition via browse ([`Client::browse_answer`], pages of 1000;
/// asserts 200): (offset, event).
pub async fn browse_all(a: &str, topic: &str, partition: u64) -> Vec<(u64, Value)> {
    let meshd = client(a);
    let mut events = Vec::new();
    loop {
        let from = events.len() as u64;
        let r = meshd
            .browse_answer(topic, partition as u32, from, 1000)
            .await;
        let r = answered(r, 200, "browse").unwrap_or_else(|e| panic!("{e:#}"));
        let page = body_of(&r).unwrap()["events"].as_array().unwrap().clone();
        if page.is_empty() {
            return events;
        }
        events.extend(
            page.into_iter()
                .map(|e| (e["offset"].as_u64().unwrap(), e["event"].clone())),
        );
    }
}

/// `GET /v1/deadletters?subscription={sub}` ([`Client::dead_letters_answer`]) → the
/// entries (asserts 200, one page).
pub async fn dead_letters(a: &str, sub: &str) -> Vec<Value> {
    let r = client(a).dead_letters_answer(Some(sub), None, None).await;
    let r = answered(r, 200, "dead letters").unwrap_or_else(|e| panic!("{e:#}"));
    let list = body_of(&r).unwrap();
    assert!(
        list.get("next_cursor").is_none() || list["next_cursor"].is_null(),
        "one small page has no next_cursor: {list}"
    );
    list["entries"]
        .as_array()
        .unwrap_or_else(|| panic!("no entries list: {list}"))
        .clone()
}

/// The status and JSON body of a client call's answer, whatever its status (a
/// refusal's body is its problem as the client read it: type, title, detail, field);
/// an error when no answer came.
pub fn status_and_body(
    r: Result<meshd_client::Response, meshd_client::Error>,
) -> anyhow::Result<(u16, Value)> {
    match r {
        Ok(a) => Ok((a.status, a.json().unwrap_or(Value::Null))),
        Err(meshd_client::Error::Api(p)) => Ok((
            p.status,
            json!({"type": p.kind, "title": p.title, "detail": p.detail, "field": p.field}),
        )),
        Err(e) => Err(e.into()),
    }
}

/// `POST /v1/sessions` ([`Client::open_session_answer`]); asserts 201; the session.
pub async fn open_session(a: &str, client_id: &str, ttl_ms: u64) -> Value {
    let r = client(a).open_session_answer(client_id, ttl_ms).await;
    let r = answered(r, 201, &format!("open a session of {client_id}"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    body_of(&r).unwrap()
}

/// `GET /v1/tasks/{id}` ([`Client::task_answer`]); asserts 200; the task.
pub async fn task(a: &str, id: &str) -> Value {
    let r = answered(client(a).task_answer(id).await, 200, &format!("task {id}"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    body_of(&r).unwrap()
}

/// `POST /v1/tasks/{id}/claim` for `session` ([`Client::claim_task_answer`]); asserts
/// 200; the task.
pub async fn claim_task(a: &str, id: &str, session: &str) -> Value {
    let r = client(a).claim_task_answer(id, session).await;
    let r = answered(r, 200, &format!("claim {id}")).unwrap_or_else(|e| panic!("{e:#}"));
    body_of(&r).unwrap()
}

/// `POST /v1/deadletters/{id}/redrive` ([`Client::redrive_answer`]); asserts 202.
pub async fn redrive(a: &str, id: &str) {
    let r = client(a).redrive_answer(id).await;
    answered(r, 202, &format!("redrive {id}")).unwrap_or_else(|e| panic!("{e:#}"));
}

/// `GET /v1/deadletters/{id}` ([`Client::dead_letter_answer`]; asserts 200) → the
/// entry as meshd wrote it.
pub async fn dead_letter(a: &str, id: &str) -> Value {
    let r = client(a).dead_letter_answer(id).await;
    let r = answered(r, 200, &format!("dead letter {id}")).unwrap_or_else(|e| panic!("{e:#}"));
    body_of(&r).unwrap()
}

/// Sends an empty-bodied request (no content type).
pub async fn bare(a: &str, method: &str, path: &str) -> Response {
    request_with(a, method, path, &[], b"")
        .await
        .with_context(|| format!("{method} {path}"))
        .unwrap()
}

/// The `meshd serve` flags of a cluster instance on `etcd` and `nats` (without
/// `--instance-id`): the shared secret file, the lease TTL, checkpoints every 200 ms.
pub fn cluster_args(
    etcd: &meshd_test_support::etcd::EtcdProcess,
    nats: &meshd_test_support::nats::NatsProcess,
    secret_file: &Path,
    lease_ttl: Duration,
) -> Vec<String> {
    vec![
        "--meta".to_string(),
        format!("etcd://{}", etcd.endpoint()),
        "--log".to_string(),
        nats.url(),
        "--cluster-secret-file".to_string(),
        secret_file.to_string_lossy().into_owned(),
        "--lease-ttl-ms".to_string(),
        lease_ttl.as_millis().to_string(),
        "--checkpoint-ms".to_string(),
        "200".to_string(),
    ]
}

/// The resident set of a process, in bytes (`VmRSS`).
pub fn current_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .expect("VmRSS")
}

/// A small cluster for end-to-end tests: `n` meshd instances (ids `inst-0`, ...) on one
/// etcd and one nats-server with [`cluster_args`]. Fields drop in order: the instances
/// stop before their backends.
pub struct SmallCluster {
    pub nodes: Vec<MeshdProcess>,
    _dirs: Vec<tempfile::TempDir>,
    _secret_dir: tempfile::TempDir,
    pub etcd: meshd_test_support::etcd::EtcdProcess,
    pub nats: meshd_test_support::nats::NatsProcess,
}

impl SmallCluster {
    pub async fn start(n: usize, lease_ttl: Duration) -> Self {
        Self::start_with(n, lease_ttl, &[]).await
    }

    /// [`start`](Self::start) with `extra` arguments for every instance.
    pub async fn start_with(n: usize, lease_ttl: Duration, extra: &[&str]) -> Self {
        let etcd = meshd_test_support::etcd::EtcdProcess::start()
            .await
            .expect("start etcd");
        let nats = meshd_test_support::nats::NatsProcess::start()
            .await
            .expect("start nats-server");
        let secret_dir = tempfile::tempdir().expect("temp dir");
        let secret_file = secret_dir.path().join("secret");
        std::fs::write(
            &secret_file,
            "small-cluster-secret-0123456789abcdef0123456789\n",
        )
        .expect("write the cluster secret");
        let args = cluster_args(&etcd, &nats, &secret_file, lease_ttl);
        let mut nodes = Vec::new();
        let mut dirs = Vec::new();
        for i in 0..n {
            let dir = tempfile::tempdir().expect("temp dir");
            let id = format!("inst-{i}");
            let mut a: Vec<&str> = args.iter().map(String::as_str).collect();
            if let Some(at) = a.iter().position(|x| *x == "--checkpoint-ms") {
                if extra.contains(&"--checkpoint-ms") {
                    // The test's own interval replaces the default one.
                    a.drain(at..at + 2);
                }
            }
            a.extend(["--instance-id", &id]);
            a.extend(extra);
            nodes.push(
                MeshdProcess::start(bin(), dir.path(), &a)
                    .await
                    .expect("start meshd"),
            );
            dirs.push(dir);
        }
        Self {
            nodes,
            _dirs: dirs,
            _secret_dir: secret_dir,
            etcd,
            nats,
        }
    }

    /// The address of instance `i`.
    pub fn addr(&self, i: usize) -> String {
        self.nodes[i].addr().to_string()
    }

    /// Waits until every partition of `topic` is owned by the instance the assignment
    /// designates for it among all of this cluster's instances: a cluster that just
    /// started still moves partitions to its later members, and a move in the middle
    /// of a test brings back what was in flight only when its lease runs out.
    /// The index of the instance the assignment designates as `topic`'s
    /// `partition`'s owner (after [`wait_settled`](Self::wait_settled), its owner).
    pub fn designated_owner(&self, topic: &str, partition: u32) -> usize {
        let members: Vec<String> = (0..self.nodes.len()).map(|i| format!("inst-{i}")).collect();
        let owner = meshd_runtime::cluster::assign::owner(&members, topic, partition)
            .expect("a cluster with members designates an owner");
        members
            .iter()
            .position(|m| *m == owner)
            .expect("the owner is a member")
    }

    pub async fn wait_settled(&self, topic: &str, partitions: u32) {
        let members: Vec<String> = (0..self.nodes.len()).map(|i| format!("inst-{i}")).collect();
        let a = self.addr(0);
        wait_until(
            Duration::from_secs(30),
            &format!("every partition of {topic} with its designated owner"),
            || async {
                let r = answered(client(&a).cluster_answer().await, 200, "GET /v1/cluster")?;
                let v = body_of(&r)?;
                let mut settled = 0;
                for p in v["partitions"].as_array().into_iter().flatten() {
                    let Some(n) = p["partition"].as_u64().filter(|_| p["topic"] == topic) else {
                        continue;
                    };
                    let want = meshd_runtime::cluster::assign::owner(&members, topic, n as u32);
                    ensure!(
                        p["owner"].as_str() == want,
                        "partition {n}: {p}, designated {want:?}"
                    );
                    settled += 1;
                }
                ensure!(
                    settled == partitions,
                    "{settled} of {partitions} partitions listed"
                );
                Ok(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e:#}"));
    }
}

/// A nack of `ids` on `sub` with `delay_ms` ([`Client::nack_delayed_answer`], reason
/// "later"; asserts 200); the answer.
pub async fn nack_delayed(a: &str, sub: &str, ids: &[Value], delay_ms: u64) -> Value {
    let ids = id_texts(ids).unwrap();
    let r = client(a)
        .nack_delayed_answer(sub, &ids, "later", delay_ms)
        .await;
    let r = answered(r, 200, "nack").unwrap_or_else(|e| panic!("{e:#}"));
    body_of(&r).unwrap()
}

/// The `parked` figure of every partition of `sub`'s stats ([`Client::stats_answer`];
/// asserts 200), summed.
pub async fn parked(a: &str, sub: &str) -> u64 {
    let r = client(a).stats_answer(sub).await;
    let r = answered(r, 200, "stats").unwrap_or_else(|e| panic!("{e:#}"));
    let v = body_of(&r).unwrap();
    v["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["parked"].as_u64().expect("parked in stats"))
        .sum()
}

/// The event ids of deliveries, in order.
pub fn event_ids(ds: &[Delivery]) -> Vec<String> {
    ds.iter()
        .map(|d| d.event["id"].as_str().unwrap_or("").to_string())
        .collect()
}

/// A pull of instance `a`'s own partitions only, through its internal route as a peer
/// calls it (with the cluster `secret`): what that instance itself hands out. Built by
/// hand: the internal routes are the instances' protocol among themselves (spoken by
/// meshd_runtime's cluster code), not the public API the client speaks.
pub async fn pull_own(
    a: &str,
    secret: &str,
    max_events: u64,
    timeout: Duration,
) -> anyhow::Result<Vec<Delivery>> {
    let r = http::request_with_timeout(
        a,
        "POST",
        "/internal/v1/subscriptions/s/pull",
        &[
            ("content-type", "application/json"),
            ("meshd-cluster-secret", secret),
        ],
        json!({"max_events": max_events, "wait_ms": 0})
            .to_string()
            .as_bytes(),
        timeout,
    )
    .await?;
    ensure!(
        r.status == 200,
        "internal pull answered {}: {}",
        r.status,
        r.body
    );
    let v = r.json()?;
    Ok(v["deliveries"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| {
            Some(Delivery {
                id: d["delivery_id"].clone(),
                partition: d["partition"].as_u64()?,
                offset: d["offset"].as_u64()?,
                attempt: d["attempt"].as_u64()?,
                event: d["event"].clone(),
            })
        })
        .collect())
}
