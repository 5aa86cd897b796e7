//! The cluster crash loop (issue 25): three real `meshd` instances on a three-member
//! etcd and nats-server, with clients publishing, pulling, acking, nacking, dropping
//! and holding deliveries through any instance while a seeded schedule of faults hits
//! every process and every link:
//!
//! - SIGKILL of a meshd (restarted on its data dir), of an etcd member (the leader half
//!   the time; restarted) or of nats-server (restarted on its store);
//! - SIGSTOP of a meshd past its lease with work in flight, then SIGCONT;
//! - partitions through TCP proxies, as blackholes (connections stay open and silent,
//!   [`TcpProxy::hold`]) in both directions or one (asymmetric), or as clean cuts:
//!   meshd↔etcd (every member), meshd↔meshd (the instance's advertised address, which
//!   the others call) and meshd↔nats;
//! - clock jumps of a meshd's wall clock, forwards and backwards (Debian's libfaketime
//!   preloaded with `DONT_FAKE_MONOTONIC`: an NTP step; it cannot move the clocks of Go
//!   binaries such as etcd and nats-server, so only meshd's jump).
//!
//! After the faults every process runs again, the clients drain the subscription, and
//! an oracle checks what the clients were told and what etcd recorded (a watch of the
//! whole key space from revision 1, and a sampler asking etcd its revision every 20 ms:
//! together they say which revision etcd was known to hold at each moment, so client
//! requests are ordered against etcd's revisions, not against when a lagging watch
//! happened to report them):
//!
//! 1. every event answered 201 was delivered or is in the dead-letter store, and every
//!    partition's committed offset reaches its end;
//! 2. nothing appears that was never published, every delivery is exactly what was
//!    published, at the one (partition, offset) its 201 named (publishes deduplicate,
//!    so a retried publish is stored once);
//! 3. no delivery names a (partition, offset) a checkpoint covers whose revision etcd
//!    was known to hold when the pull was sent (a new owner resumes from the
//!    checkpoint; nothing below it is handed out again), and every offset a checkpoint
//!    covers was named in an ack sent before etcd was known to hold the checkpoint's
//!    revision, or is dead-lettered (gap-free);
//! 4. attempts: none above `max_attempts`; before an offset's first ack no attempt is
//!    handed out twice and a delivery that certainly came after another has a higher
//!    attempt; a dead letter carries `max_attempts`; a poison event (always nacked) is
//!    dead-lettered after exactly `max_attempts` deliveries, however often its
//!    partition moved;
//! 5. no event is dead-lettered twice; an offset answered `dead_lettered` is never
//!    handed out again;
//! 6. etcd's history: every write made for a partition's owner carries the epoch its
//!    fence compared and its writer's instance (checkpoints `owner_epoch` and
//!    `owner_instance`, attempt-ledger records `e` and `i`, dead letters `epoch` and
//!    `instance`; the ledger's head and pruned records share their transaction's
//!    record), and that epoch is exactly the `mod_revision` of the partition's owner
//!    key at that revision, the instance the one that key names — so a stale owner's write during its successor's tenure is caught,
//!    not only one while nobody held the partition; a write that carries no epoch (a
//!    ledger clear, deletes only; a checkpoint's deletion) must at least find an owner;
//!    a checkpoint without an epoch is only its put-if-absent creation; a checkpoint
//!    never goes backwards;
//! 7. duplicates (a delivery of an offset after an ack of it was answered `acked`) are
//!    each explained by one fault: the ack was answered within that fault's window,
//!    from a checkpoint interval (plus slack) before it began — the last checkpoint
//!    before the partition moved could not carry it — to a lease TTL (plus slack)
//!    after it ended — an owner cut off or resumed answers acks it can no longer
//!    checkpoint, or its task restarts after an ambiguous Meta write; any other is a
//!    violation; their number per move, per fault and per fault kind is reported;
//! 8. histories of concurrent clients under the same faults, through every instance,
//!    checked with [`meshd_test_support::linearizability`]: a subscription's settings,
//!    written (`PUT`, and compare-and-set with `If-Match`) and read, and tasks,
//!    submitted, claimed, canceled and read. Writes, compare-and-sets and task
//!    operations must be linearizable; a settings read (served from the instance's
//!    cache, read-your-writes by contract) only a value that was written.
//!
//! The first fault pauses the owner of partition 0 past its lease, so every run moves
//! a partition with work in flight. A run must clear an activity floor (acks answered
//! `acked`, publishes answered 201, settings operations, compare-and-sets that applied,
//! task operations answered, fenced writes checked against their epoch, at least one
//! partition move) or it fails: each rule has had something to check.
//!
//! Positive controls (`positive_control_*` below): the oracle on a made-up run that
//! passes, the same run broken once per rule (each must be named), and runs below the
//! floor.
//!
//! `MESHD_CLUSTER_CRASH_SEED` picks the seed (printed; the schedule of faults and every
//! client choice follow from it), `MESHD_CLUSTER_CRASH_ROUNDS` the number of faults
//! (default 8, the CI run), `MESHD_CLUSTER_CRASH_NATS=3` runs three nats-servers with
//! JetStream `replicas=3` (a fault of "nats" then kills one of them). Long runs:
//! `MESHD_CLUSTER_CRASH_ROUNDS=200 MESHD_CLUSTER_CRASH_NATS=3 cargo test -p meshd --test
//! cluster_crash_loop -- --nocapture` (docs/crash-loop.md records runs and seeds).

mod common;

use common::oracle::{dead_letter_entries, env_number, expect, placed_ids, seed_from, Failure};
use common::*;
use meshd_test_support::etcd::EtcdCluster;
use meshd_test_support::http::{self, Response};
use meshd_test_support::linearizability::{
    check_by_key, Operation, RegisterInput, RegisterOf, RegisterOutput,
};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::nats::{NatsCluster, NatsProcess};
use meshd_test_support::proxy::{Hold, TcpProxy};
use meshd_test_support::rng::Rng;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

const TOPIC: &str = "t";
const SUB: &str = "s";
/// The subscription whose settings the history clients write and read.
const HSUB: &str = "h";
const PARTITIONS: u64 = 4;
const INSTANCES: usize = 3;
const ETCD_MEMBERS: usize = 3;
const LEASE_TTL: Duration = Duration::from_millis(1500);
const CHECKPOINT_MS: u64 = 200;
const MAX_ATTEMPTS: u64 = 4;
const ACK_TIMEOUT_MS: u64 = 1500;
const PUBLISHERS: usize = 2;
const CONSUMERS: usize = 3;
const HISTORY_CLIENTS: usize = 3;
const DEFAULT_ROUNDS: u32 = 8;
/// Every client request gives up after this (a paused instance answers nothing).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(4);
/// One event in this many is poison: consumers nack it every time.
const POISON_ONE_IN: u64 = 12;
/// The drain's deadline: this, plus [`DRAIN_PER_ROUND`] per fault (a long run leaves
/// thousands of events and held deliveries to drain). Liveness only.
const DRAIN: Duration = Duration::from_secs(60);
const DRAIN_PER_ROUND: Duration = Duration::from_secs(1);
/// How late etcd's watch may report a revision after it happened (the harness's watch
/// may sit on a member that was just killed and reconnect).
const WATCH_SLACK: Duration = Duration::from_secs(3);
const SHOWN: usize = 40;
/// How late a checkpoint may be written after its interval (a busy partition task on
/// a loaded 2-core machine, a Meta write in flight).
const CHECKPOINT_SLACK: Duration = Duration::from_millis(500);
/// How long after a fault's lease TTL a partition task may still answer an ack it
/// cannot checkpoint (rule 7): a restart after an ambiguous Meta write once the
/// fault healed, its Meta client reconnecting through an etcd election.
const AFTERMATH_SLACK: Duration = Duration::from_millis(1000);

fn seed() -> u64 {
    seed_from("MESHD_CLUSTER_CRASH_SEED")
}

/// libfaketime, from Debian's `faketime` (scripts/env.sh installs it for the tests).
fn libfaketime() -> PathBuf {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|arch| PathBuf::from(format!("/usr/lib/{arch}/faketime/libfaketime.so.1")))
        .find(|p| p.exists())
        .expect("libfaketime.so.1 not found: install Debian's faketime (scripts/test does)")
}

// ---------------------------------------------------------------------------------
// What the clients were told.

#[derive(Clone, Debug, PartialEq)]
enum Outcome {
    InFlight,
    Created(u64, u64),
    Unknown(String),
}

struct Published {
    body: Value,
    outcome: Outcome,
}

/// One delivery a pull answered (times since the start of the test).
#[derive(Clone, Debug)]
struct Seen {
    sent: Duration,
    recv: Duration,
    partition: u64,
    offset: u64,
    attempt: u64,
    event_id: String,
    event: Value,
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "(p{} o{} attempt {} event {}, pulled {:?}..{:?})",
            self.partition, self.offset, self.attempt, self.event_id, self.sent, self.recv
        )
    }
}

/// An ack or nack answer for one delivery.
#[derive(Clone, Debug)]
struct Answer {
    sent: Duration,
    recv: Duration,
    partition: u64,
    offset: u64,
    attempt: u64,
    list: String,
}

/// A fault the schedule applied, with when it began and ended.
#[derive(Clone, Debug)]
struct Fault {
    /// Its kind (one of [`FAULT_KINDS`]), for the duplicates per kind.
    kind: &'static str,
    what: String,
    start: Duration,
    end: Duration,
}

/// The kinds of fault, in the order of the schedule's roll.
const FAULT_KINDS: [&str; 9] = [
    "meshd SIGKILL",
    "meshd SIGSTOP",
    "etcd member SIGKILL",
    "nats-server SIGKILL",
    "meshd-etcd link",
    "meshd-meshd link",
    "meshd-nats link",
    "meshd clock jump",
    "meshd SIGSTOP with a write held",
];

/// The roll of a pause with a fenced write on the wire (see [`one_fault`]).
const HELD_WRITE: u64 = 8;

/// One revision's changes as etcd's watch reported them.
#[derive(Clone, Debug)]
struct Change {
    revision: i64,
    key: String,
    /// `None`: deleted.
    value: Option<Vec<u8>>,
    arrived: Duration,
}

type HistoryOp = Operation<RegisterInput<u64>, RegisterOutput<u64>>;

#[derive(Default)]
struct Log {
    published: BTreeMap<String, Published>,
    created: usize,
    deliveries: Vec<Seen>,
    by_delivery_id: BTreeMap<String, usize>,
    acked: Vec<Answer>,
    nacked: Vec<Answer>,
    /// (partition, offset) -> when the first ack request naming it was sent.
    first_ack_sent: BTreeMap<(u64, u64), Duration>,
    /// Every ack request naming (partition, offset): when it was sent.
    ack_sends: BTreeMap<(u64, u64), Vec<Duration>>,
    faults: Vec<Fault>,
    changes: Vec<Change>,
    /// (t, r): etcd was known to hold revision `r` at time `t` (its answer to a
    /// revision query sent before `t`), from [`revision_sampler`]. With the watch's
    /// arrivals, this orders client requests against etcd's revisions (rules 3, 7).
    held: Vec<(Duration, i64)>,
    /// The watch lost history (compacted before it was read): the check of rule 6
    /// would be blind, so the run fails.
    watch_gap: Option<String>,
    history: Vec<HistoryOp>,
    tasks: Vec<TaskOp>,
    unanswered: BTreeMap<String, usize>,
    problems: Vec<String>,
}

struct Ctx {
    t0: Instant,
    seed: u64,
    rounds: u32,
    log: Mutex<Log>,
}

impl Ctx {
    fn now(&self) -> Duration {
        self.t0.elapsed()
    }

    fn log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail(&self, msg: impl fmt::Display) -> ! {
        panic!(
            "{msg}\n(seed {}, {} rounds; rerun: MESHD_CLUSTER_CRASH_SEED={} MESHD_CLUSTER_CRASH_ROUNDS={} cargo test -p meshd --test cluster_crash_loop -- --nocapture)",
            self.seed, self.rounds, self.seed, self.rounds
        )
    }

    fn note(&self, what: &str, f: &Failure) {
        let mut log = self.log();
        match f {
            Failure::Transport(_) => {
                *log.unanswered
                    .entry(format!("{what}: no answer"))
                    .or_default() += 1
            }
            Failure::Status(s, _) if *s >= 500 || *s == 429 => {
                *log.unanswered.entry(format!("{what}: {s}")).or_default() += 1
            }
            other => log.problems.push(format!("{what}: {other}")),
        }
    }
}

/// The client of the instance at `a` as the clients of the loop use it: each request
/// sent once and bounded by [`REQUEST_TIMEOUT`].
fn loop_client(a: &str) -> meshd_client::Client {
    client(a).with_timeout(REQUEST_TIMEOUT)
}

async fn send(a: &str, method: &str, path: &str, body: &Value) -> anyhow::Result<Response> {
    http::request_with_timeout(
        a,
        method,
        path,
        &[("Content-Type", "application/json")],
        body.to_string().as_bytes(),
        REQUEST_TIMEOUT,
    )
    .await
}

fn id_of(event: &Value) -> String {
    event["id"].as_str().unwrap_or_default().to_string()
}

fn is_poison(id: &str) -> bool {
    id.starts_with("poison-")
}

// ---------------------------------------------------------------------------------
// Where clients send requests.

/// The instances' addresses (`None` while one is being restarted) and whether the run
/// is over.
#[derive(Clone, Debug, Default)]
struct Gate {
    addrs: Vec<Option<String>>,
    finished: bool,
}

/// A random instance that runs (paused ones included: their requests time out).
async fn pick(gate: &mut watch::Receiver<Gate>, rng: &mut Rng) -> Option<String> {
    loop {
        let g = gate.borrow_and_update().clone();
        if g.finished {
            return None;
        }
        let up: Vec<String> = g.addrs.iter().flatten().cloned().collect();
        if !up.is_empty() {
            return Some(up[rng.below(up.len() as u64) as usize].clone());
        }
        if gate.changed().await.is_err() {
            return None;
        }
    }
}

async fn publish_and_record(ctx: &Ctx, a: &str, events: &[Value]) -> Result<(), Failure> {
    {
        let mut log = ctx.log();
        for e in events {
            log.published.entry(id_of(e)).or_insert(Published {
                body: e.clone(),
                outcome: Outcome::InFlight,
            });
        }
    }
    let r = loop_client(a).publish_answer(TOPIC, events).await;
    let placed = expect(r, 201).and_then(|answer| {
        let placed: Option<Vec<(String, u64, u64)>> = answer["events"].as_array().map(|l| {
            l.iter()
                .filter_map(|p| {
                    Some((
                        p["id"].as_str()?.to_string(),
                        p["partition"].as_u64()?,
                        p["offset"].as_u64()?,
                    ))
                })
                .collect()
        });
        match placed {
            Some(p) if p.len() == events.len() => Ok(p),
            _ => Err(Failure::Malformed(format!("publish answered {answer}"))),
        }
    });
    let mut log = ctx.log();
    match placed {
        Ok(placed) => {
            log.created += 1;
            for (id, partition, offset) in placed {
                let problem = match log.published.get_mut(&id) {
                    Some(p) => match &p.outcome {
                        Outcome::Created(pp, oo) if (*pp, *oo) != (partition, offset) => Some(
                            format!("event {id} answered 201 at p{pp} o{oo} and later at p{partition} o{offset}"),
                        ),
                        _ => {
                            p.outcome = Outcome::Created(partition, offset);
                            None
                        }
                    },
                    None => Some(format!("publish answered an id it was not sent: {id}")),
                };
                log.problems.extend(problem);
            }
            Ok(())
        }
        Err(f) => {
            drop(log);
            ctx.note("publish", &f);
            let mut log = ctx.log();
            for e in events {
                if let Some(p) = log.published.get_mut(&id_of(e)) {
                    if !matches!(p.outcome, Outcome::Created(..)) {
                        p.outcome = Outcome::Unknown(f.to_string());
                    }
                }
            }
            Err(f)
        }
    }
}

/// One pull; records every delivery and returns (delivery id, event id) of each.
async fn pull_and_record(
    ctx: &Ctx,
    a: &str,
    max_events: u64,
    wait_ms: u64,
) -> Result<Vec<(Value, String)>, Failure> {
    let sent = ctx.now();
    let pull = meshd_client::Pull {
        max_events: Some(max_events),
        wait_ms: Some(wait_ms),
        ..Default::default()
    };
    let r = loop_client(a).pull_answer(SUB, &pull).await;
    let answer = expect(r, 200);
    let recv = ctx.now();
    let answer = answer.inspect_err(|f| ctx.note("pull", f))?;
    let Some(list) = answer["deliveries"].as_array() else {
        let f = Failure::Malformed(format!("pull answered {answer}"));
        ctx.note("pull", &f);
        return Err(f);
    };
    let mut log = ctx.log();
    let mut out = Vec::with_capacity(list.len());
    for d in list {
        let parsed = (|| {
            Some(Seen {
                sent,
                recv,
                partition: d["partition"].as_u64()?,
                offset: d["offset"].as_u64()?,
                attempt: d["attempt"].as_u64()?,
                event_id: d["event"]["id"].as_str()?.to_string(),
                event: d["event"].clone(),
            })
        })();
        match (parsed, d["delivery_id"].is_string()) {
            (Some(seen), true) => {
                let key = d["delivery_id"].to_string();
                if log.by_delivery_id.contains_key(&key) {
                    log.problems
                        .push(format!("delivery id {key} handed out twice: {seen}"));
                    continue;
                }
                let i = log.deliveries.len();
                out.push((d["delivery_id"].clone(), seen.event_id.clone()));
                log.deliveries.push(seen);
                log.by_delivery_id.insert(key, i);
            }
            _ => log.problems.push(format!("malformed delivery {d}")),
        }
    }
    Ok(out)
}

/// Acks (`verb` "ack") or nacks `ids` and records the answer for each.
async fn settle_and_record(ctx: &Ctx, a: &str, verb: &str, ids: Vec<Value>) -> Result<(), Failure> {
    // Sent as received: every id recorded is text (pull_and_record).
    let texts: Vec<String> = ids
        .iter()
        .map(|id| id.as_str().unwrap_or_default().to_string())
        .collect();
    let sent = ctx.now();
    if verb == "ack" {
        let mut log = ctx.log();
        for id in &ids {
            if let Some(at) = log
                .by_delivery_id
                .get(&id.to_string())
                .map(|i| (log.deliveries[*i].partition, log.deliveries[*i].offset))
            {
                log.first_ack_sent.entry(at).or_insert(sent);
                log.ack_sends.entry(at).or_default().push(sent);
            }
        }
    }
    let r = if verb == "ack" {
        loop_client(a).ack_answer(SUB, &texts).await
    } else {
        loop_client(a)
            .nack_answer(SUB, &texts, "cluster crash loop nack")
            .await
    };
    let answer = expect(r, 200);
    let recv = ctx.now();
    let answer = answer.inspect_err(|f| ctx.note(verb, f))?;
    let mut log = ctx.log();
    // Each id we sent is in exactly one list, and nothing else is.
    let Some(placed) = placed_ids(verb, &answer, &ids, &mut log.problems) else {
        return Ok(());
    };
    for (id, list) in placed {
        let Some(d) = log
            .by_delivery_id
            .get(&id)
            .map(|i| log.deliveries[*i].clone())
        else {
            continue;
        };
        let answer = Answer {
            sent,
            recv,
            partition: d.partition,
            offset: d.offset,
            attempt: d.attempt,
            list: list.clone(),
        };
        if verb == "ack" {
            if list == "acked" {
                log.acked.push(answer);
            }
        } else {
            log.nacked.push(answer);
        }
    }
    Ok(())
}

async fn publisher(n: usize, mut rng: Rng, mut gate: watch::Receiver<Gate>, ctx: Arc<Ctx>) {
    let mut next = 0u64;
    while let Some(a) = pick(&mut gate, &mut rng).await {
        let size = if rng.range(0, 1) == 0 {
            1
        } else {
            rng.range(2, 6)
        };
        let events: Vec<Value> = (0..size)
            .map(|_| {
                next += 1;
                let kind = if rng.below(POISON_ONE_IN) == 0 {
                    "poison"
                } else {
                    "e"
                };
                event(&format!("{kind}-{n}-{next}"))
            })
            .collect();
        // Sent again (to any instance) until answered 201: publishes deduplicate by
        // id, so the resend is stored once.
        let mut a = a;
        while let Err(f) = publish_and_record(&ctx, &a, &events).await {
            if !matches!(f, Failure::Transport(_)) {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            match pick(&mut gate, &mut rng).await {
                Some(next) => a = next,
                None => break,
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.range(10, 60))).await;
    }
}

/// Pulls from any instance and, per delivery: a poison event is nacked; others are
/// acked (60%), nacked (10%), dropped so the lease runs out (15%) or held up to two
/// ack timeouts and then acked (15%). Acks and nacks go to any instance.
async fn consumer(mut rng: Rng, mut gate: watch::Receiver<Gate>, ctx: Arc<Ctx>) {
    let mut held: Vec<(Instant, Value)> = Vec::new();
    while let Some(a) = pick(&mut gate, &mut rng).await {
        let (max, wait) = (rng.range(1, 12), rng.range(0, 300));
        let got = match pull_and_record(&ctx, &a, max, wait).await {
            Ok(got) => got,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(30)).await;
                continue;
            }
        };
        let (mut acks, mut nacks) = (Vec::new(), Vec::new());
        for (id, event_id) in got {
            if is_poison(&event_id) {
                nacks.push(id);
                continue;
            }
            match rng.range(0, 99) {
                0..=59 => acks.push(id),
                60..=69 => nacks.push(id),
                70..=84 => {}
                _ => {
                    let later = Duration::from_millis(rng.range(0, 2 * ACK_TIMEOUT_MS));
                    held.push((Instant::now() + later, id));
                }
            }
        }
        let now = Instant::now();
        acks.extend(
            held.extract_if(.., |(due, _)| *due <= now)
                .map(|(_, id)| id),
        );
        for (verb, ids) in [("ack", acks), ("nack", nacks)] {
            if ids.is_empty() {
                continue;
            }
            let Some(b) = pick(&mut gate, &mut rng).await else {
                return;
            };
            let _ = settle_and_record(&ctx, &b, verb, ids).await;
        }
    }
}

/// Writes and reads subscription `h`'s `ack_timeout_ms` through any instance: plain
/// writes, compare-and-set writes (`If-Match` with the ETag of a read) and reads, each
/// value written once. Recorded as register operations.
async fn history_client(c: usize, mut rng: Rng, mut gate: watch::Receiver<Gate>, ctx: Arc<Ctx>) {
    let mut i = 0u64;
    // The last read's value and ETag, for the next compare-and-set.
    let mut last: Option<(u64, String)> = None;
    while let Some(a) = pick(&mut gate, &mut rng).await {
        i += 1;
        let value = 1_000 + (c as u64) * 150_000 + i;
        let call = ctx.now().as_nanos() as u64;
        let roll = rng.range(0, 2);
        let (input, answer) = if roll == 0 || (roll == 2 && last.is_none()) {
            let r = send(
                &a,
                "PUT",
                &format!("/v1/subscriptions/{HSUB}"),
                &json!({"topic": TOPIC, "ack_timeout_ms": value}),
            )
            .await;
            let out = match &r {
                Ok(r) if r.status == 200 || r.status == 201 => Some(Ok(RegisterOutput::Written)),
                Ok(r) if r.status >= 500 || r.status == 429 => None,
                Err(_) => None,
                Ok(r) => Some(Err(format!("PUT answered {} {}", r.status, r.body))),
            };
            (RegisterInput::Write(value), out)
        } else if roll == 1 {
            let r = http::request(
                &a,
                "GET",
                &format!("/v1/subscriptions/{HSUB}"),
                None,
                REQUEST_TIMEOUT,
            )
            .await;
            let out = match &r {
                Ok(r) if r.status == 200 => match (
                    r.json().ok().and_then(|v| v["ack_timeout_ms"].as_u64()),
                    r.header("etag"),
                ) {
                    (Some(v), Some(tag)) => {
                        last = Some((v, tag.to_string()));
                        Some(Ok(RegisterOutput::Read(Some(v))))
                    }
                    _ => Some(Err(format!("GET answered {}", r.body))),
                },
                _ => {
                    // A failed read changes nothing: left out.
                    continue;
                }
            };
            (RegisterInput::Read, out)
        } else {
            let (expect, tag) = last.clone().expect("a read before a compare-and-set");
            let r = http::request_with_timeout(
                &a,
                "PUT",
                &format!("/v1/subscriptions/{HSUB}"),
                &[
                    ("Content-Type", "application/json"),
                    ("If-Match", tag.as_str()),
                ],
                json!({"topic": TOPIC, "ack_timeout_ms": value})
                    .to_string()
                    .as_bytes(),
                REQUEST_TIMEOUT,
            )
            .await;
            let out = match &r {
                Ok(r) if r.status == 200 => Some(Ok(RegisterOutput::Cas(true))),
                Ok(r) if r.status == 412 => Some(Ok(RegisterOutput::Cas(false))),
                Ok(r) if r.status >= 500 || r.status == 429 => None,
                Err(_) => None,
                Ok(r) => Some(Err(format!(
                    "PUT If-Match answered {} {}",
                    r.status, r.body
                ))),
            };
            (
                RegisterInput::Cas {
                    expect: Some(expect),
                    new: value,
                },
                out,
            )
        };
        let ret = ctx.now().as_nanos() as u64;
        {
            let mut log = ctx.log();
            match answer {
                Some(Ok(out)) => log
                    .history
                    .push(Operation::answered(c, input, call, ret, out)),
                None => log.history.push(Operation::unanswered(c, input, call)),
                Some(Err(p)) => log.problems.push(p),
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.range(20, 150))).await;
    }
}

/// A task as the history clients see it: absent, `submitted`, `working` (claimed) or
/// `canceled`; every change is conditional in Meta (create if absent, claim if
/// submitted, cancel unless terminal), so the history of each task must be
/// linearizable. The session the claims use lives far longer than the run, so no
/// requeue (`working` back to `submitted`) happens behind the clients' backs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum TaskState {
    Submitted,
    Working,
    Canceled,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum TaskCall {
    Submit(String),
    Claim(String),
    Cancel(String),
    Read(String),
}

impl TaskCall {
    fn id(&self) -> &str {
        match self {
            TaskCall::Submit(id)
            | TaskCall::Claim(id)
            | TaskCall::Cancel(id)
            | TaskCall::Read(id) => id,
        }
    }
}

/// The answer, by status: `Done` (201/200 that changed it), `Existing` (a submit of
/// an existing task, 200), `Conflict` (claim of a task another session holds, 409:
/// never expected here, every claim comes from one session), `Terminal`
/// (422), `Absent` (404), `Read(state)`.
#[derive(Clone, Debug, PartialEq, Eq)]
enum TaskAnswer {
    Done,
    Existing,
    Conflict,
    Terminal,
    Absent,
    Read(TaskState),
}

struct TaskModel;

impl meshd_test_support::linearizability::Model for TaskModel {
    type State = Option<TaskState>;
    type Input = TaskCall;
    type Output = TaskAnswer;

    fn init(&self) -> Self::State {
        None
    }

    fn step(
        &self,
        state: &Self::State,
        input: &TaskCall,
        output: Option<&TaskAnswer>,
    ) -> Option<Self::State> {
        use TaskState::*;
        let (next, answer) = match (input, state) {
            (TaskCall::Submit(_), None) => (Some(Submitted), TaskAnswer::Done),
            (TaskCall::Submit(_), s) => (*s, TaskAnswer::Existing),
            (TaskCall::Claim(_), Some(Submitted)) => (Some(Working), TaskAnswer::Done),
            // Every claim comes from the one session: a claim of a task it holds
            // already is answered like the first (idempotent).
            (TaskCall::Claim(_), Some(Working)) => (Some(Working), TaskAnswer::Done),
            (TaskCall::Claim(_), Some(Canceled)) => (Some(Canceled), TaskAnswer::Terminal),
            (TaskCall::Cancel(_), Some(Submitted | Working)) => (Some(Canceled), TaskAnswer::Done),
            (TaskCall::Cancel(_), Some(Canceled)) => (Some(Canceled), TaskAnswer::Terminal),
            (TaskCall::Claim(_) | TaskCall::Cancel(_) | TaskCall::Read(_), None) => {
                (None, TaskAnswer::Absent)
            }
            (TaskCall::Read(_), Some(s)) => (Some(*s), TaskAnswer::Read(*s)),
        };
        match output {
            Some(o) if *o != answer => None,
            _ => Some(next),
        }
    }
}

type TaskOp = Operation<TaskCall, TaskAnswer>;

const TASK_AGENT: &str = "crash-agent";

/// Submits, claims, cancels and reads a few tasks at a time through any instance;
/// claims use `session` (of the agent's client id). Recorded as task operations.
async fn task_client(
    c: usize,
    session: String,
    mut rng: Rng,
    mut gate: watch::Receiver<Gate>,
    ctx: Arc<Ctx>,
) {
    while let Some(a) = pick(&mut gate, &mut rng).await {
        // Six tasks live at a time; every client moves through the same ids.
        let generation = ctx.now().as_secs() / 4;
        let id = format!("task-{generation}-{}", rng.below(6));
        let call = match rng.range(0, 5) {
            0 | 1 => TaskCall::Submit(id.clone()),
            2 => TaskCall::Claim(id.clone()),
            3 => TaskCall::Cancel(id.clone()),
            _ => TaskCall::Read(id.clone()),
        };
        let sent = ctx.now().as_nanos() as u64;
        let r = match &call {
            TaskCall::Submit(id) => {
                send(
                    &a,
                    "POST",
                    "/v1/tasks",
                    &json!({"id": id, "agent": TASK_AGENT, "input": {"n": 1}}),
                )
                .await
            }
            TaskCall::Claim(id) => {
                send(
                    &a,
                    "POST",
                    &format!("/v1/tasks/{id}/claim"),
                    &json!({"session": session}),
                )
                .await
            }
            TaskCall::Cancel(id) => {
                send(&a, "POST", &format!("/v1/tasks/{id}/cancel"), &json!({})).await
            }
            TaskCall::Read(id) => {
                http::request(&a, "GET", &format!("/v1/tasks/{id}"), None, REQUEST_TIMEOUT).await
            }
        };
        let ret = ctx.now().as_nanos() as u64;
        let answer = match (&call, &r) {
            (_, Err(_)) => None,
            (_, Ok(r)) if r.status >= 500 || r.status == 429 => None,
            (TaskCall::Submit(_), Ok(r)) if r.status == 201 => Some(Ok(TaskAnswer::Done)),
            (TaskCall::Submit(_), Ok(r)) if r.status == 200 => Some(Ok(TaskAnswer::Existing)),
            (TaskCall::Claim(_) | TaskCall::Cancel(_), Ok(r)) if r.status == 200 => {
                Some(Ok(TaskAnswer::Done))
            }
            (TaskCall::Claim(_), Ok(r)) if r.status == 409 => Some(Ok(TaskAnswer::Conflict)),
            (TaskCall::Claim(_) | TaskCall::Cancel(_), Ok(r)) if r.status == 422 => {
                Some(Ok(TaskAnswer::Terminal))
            }
            (TaskCall::Claim(_) | TaskCall::Cancel(_) | TaskCall::Read(_), Ok(r))
                if r.status == 404 =>
            {
                Some(Ok(TaskAnswer::Absent))
            }
            (TaskCall::Read(_), Ok(r)) if r.status == 200 => {
                match r
                    .json()
                    .ok()
                    .and_then(|v| v["state"].as_str().map(str::to_string))
                    .as_deref()
                {
                    Some("submitted") => Some(Ok(TaskAnswer::Read(TaskState::Submitted))),
                    Some("working") => Some(Ok(TaskAnswer::Read(TaskState::Working))),
                    Some("canceled") => Some(Ok(TaskAnswer::Read(TaskState::Canceled))),
                    _ => Some(Err(format!("GET task answered {}", r.body))),
                }
            }
            (call, Ok(r)) => Some(Err(format!("{call:?} answered {} {}", r.status, r.body))),
        };
        {
            let mut log = ctx.log();
            match answer {
                Some(Ok(out)) => log.tasks.push(Operation::answered(c, call, sent, ret, out)),
                None => log.tasks.push(Operation::unanswered(c, call, sent)),
                Some(Err(p)) => log.problems.push(p),
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.range(20, 150))).await;
    }
}

/// Keeps the agent's session alive through any instance (its TTL outlasts the run;
/// this only guards long runs).
async fn session_keeper(session: String, mut rng: Rng, mut gate: watch::Receiver<Gate>) {
    while let Some(a) = pick(&mut gate, &mut rng).await {
        let _ = send(
            &a,
            "POST",
            &format!("/v1/sessions/{session}/heartbeat"),
            &json!({}),
        )
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
}

// ---------------------------------------------------------------------------------
// etcd's history, watched live.

/// Watches every meshd key from revision 1 and records each change with the time it
/// arrived, reconnecting to any member when the one it watches on fails, until `stop`.
async fn etcd_watcher(endpoints: Vec<String>, ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    let mut next_revision = 1i64;
    let mut turn = 0usize;
    loop {
        if *stop.borrow() {
            return;
        }
        let endpoint = format!("http://{}", endpoints[turn % endpoints.len()]);
        turn += 1;
        let options = etcd_client::ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(2))
            .with_keep_alive(Duration::from_secs(1), Duration::from_secs(1));
        let Ok(Ok(mut client)) = tokio::time::timeout(
            Duration::from_secs(2),
            etcd_client::Client::connect([endpoint.as_str()], Some(options)),
        )
        .await
        else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let watch = client
            .watch(
                "meshd/",
                Some(
                    etcd_client::WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(next_revision)
                        .with_progress_notify(),
                ),
            )
            .await;
        let Ok(mut stream) = watch else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        loop {
            let msg = tokio::select! {
                m = tokio::time::timeout(Duration::from_secs(2), stream.message()) => m,
                _ = stop.changed() => return,
            };
            let resp = match msg {
                Ok(Ok(Some(resp))) => resp,
                // Silence (progress notifications come every few minutes only), an
                // error or the end: watch again on the next member.
                _ => break,
            };
            if resp.compact_revision() > 0 {
                ctx.log().watch_gap = Some(format!(
                    "the watch from revision {next_revision} found history compacted to {}",
                    resp.compact_revision()
                ));
                return;
            }
            if resp.canceled() {
                break;
            }
            let arrived = ctx.now();
            let mut log = ctx.log();
            for e in resp.events() {
                let Some(kv) = e.kv() else { continue };
                let revision = kv.mod_revision();
                let deleted = e.event_type() == etcd_client::EventType::Delete;
                log.changes.push(Change {
                    revision,
                    key: String::from_utf8_lossy(kv.key()).into_owned(),
                    value: (!deleted).then(|| kv.value().to_vec()),
                    arrived,
                });
                next_revision = next_revision.max(revision + 1);
            }
        }
    }
}

/// Asks etcd its revision every few milliseconds (any member that answers) and
/// records each answer with the time it came, until `stop`: at that time etcd held at
/// least that revision. The watch's arrivals say the same, but a watch that
/// reconnects after a member's death reports seconds late; these answers bound how
/// late a checkpoint may be taken to have been written.
async fn revision_sampler(endpoints: Vec<String>, ctx: Arc<Ctx>, mut stop: watch::Receiver<bool>) {
    let eps: Vec<String> = endpoints.iter().map(|e| format!("http://{e}")).collect();
    let options = etcd_client::ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(Duration::from_millis(500))
        .with_keep_alive(Duration::from_secs(1), Duration::from_secs(1));
    let mut client = None;
    loop {
        if *stop.borrow() {
            return;
        }
        if client.is_none() {
            client = tokio::time::timeout(
                Duration::from_secs(2),
                etcd_client::Client::connect(eps.clone(), Some(options.clone())),
            )
            .await
            .ok()
            .and_then(Result::ok);
        }
        if let Some(c) = client.as_mut() {
            let asked = tokio::time::timeout(
                Duration::from_millis(500),
                c.get(
                    "meshd/",
                    Some(etcd_client::GetOptions::new().with_count_only()),
                ),
            )
            .await;
            match asked {
                Ok(Ok(r)) => {
                    if let Some(h) = r.header() {
                        let at = ctx.now();
                        ctx.log().held.push((at, h.revision()));
                    }
                }
                _ => client = None,
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// The revision etcd is at now (asked of any member that answers).
async fn current_revision(endpoints: &[String]) -> anyhow::Result<i64> {
    let eps: Vec<String> = endpoints.iter().map(|e| format!("http://{e}")).collect();
    let mut client = etcd_client::Client::connect(eps, None).await?;
    let r = client
        .get(
            "meshd/",
            Some(etcd_client::GetOptions::new().with_count_only()),
        )
        .await?;
    Ok(r.header().map(|h| h.revision()).unwrap_or(0))
}

// ---------------------------------------------------------------------------------
// The cluster.

struct Node {
    id: String,
    proc: Option<MeshdProcess>,
    dir: tempfile::TempDir,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// meshd → each etcd member.
    etcd: Vec<TcpProxy>,
    /// meshd → each nats-server.
    nats: Vec<TcpProxy>,
    /// The others → this instance (its advertised address).
    peer: TcpProxy,
    clock: PathBuf,
}

impl Node {
    async fn start(&mut self) {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        // meshd refuses to start while JetStream cannot answer (a three-server
        // cluster that just started may not have elected its meta leader yet): the
        // way an operator's supervisor would, start it again, for a while.
        let mut tries = 0;
        let p = loop {
            match MeshdProcess::start_with_env(bin(), self.dir.path(), &args, &self.env).await {
                Ok(p) => break p,
                Err(e)
                    if tries < 10 && format!("{e:#}").contains("cannot open the JetStream log") =>
                {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("starting {}: {e:#}", self.id),
            }
        };
        self.peer
            .set_upstream(p.addr().parse::<SocketAddr>().expect("meshd's address"));
        self.proc = Some(p);
    }

    fn proc(&self) -> &MeshdProcess {
        self.proc.as_ref().expect("the instance runs")
    }

    fn set_clock(&self, offset_s: i64) {
        std::fs::write(&self.clock, format!("{offset_s:+}\n")).expect("write the clock file");
    }
}

/// The log's servers: one nats-server (CI) or three with `replicas=3` (long runs).
enum NatsServers {
    One(Box<NatsProcess>),
    Three(NatsCluster),
}

impl NatsServers {
    fn endpoints(&self) -> Vec<SocketAddr> {
        let urls: Vec<String> = match self {
            NatsServers::One(n) => vec![n.endpoint()],
            NatsServers::Three(c) => c.nodes.iter().map(|m| m.endpoint()).collect(),
        };
        urls.iter()
            .map(|u| u.parse().expect("a nats endpoint"))
            .collect()
    }
}

async fn wait_all_ready(ctx: &Ctx, nodes: &[Node]) {
    for n in nodes {
        let a = n.proc().addr().to_string();
        if let Err(e) = wait_until(
            Duration::from_secs(60),
            &format!("{} ready", n.id),
            || async {
                anyhow::ensure!(client(&a).ready().await?, "readyz 503");
                Ok(())
            },
        )
        .await
        {
            ctx.fail(format!(
                "{e:#}\nlog tail of {}:\n{}",
                n.id,
                n.proc().log_tail(40)
            ));
        }
    }
}

fn publish_gate(tx: &watch::Sender<Gate>, nodes: &[Node]) {
    tx.send_modify(|g| {
        g.addrs = nodes
            .iter()
            .map(|n| n.proc.as_ref().map(|p| p.addr().to_string()))
            .collect()
    });
}

/// Applies one seeded fault (or, with `forced`, that kind to that instance), waits
/// its time and heals it. Returns its kind and what it did.
async fn one_fault(
    rng: &mut Rng,
    nodes: &mut [Node],
    etcd: &mut EtcdCluster,
    log: &mut NatsServers,
    gate: &watch::Sender<Gate>,
    ctx: &Ctx,
    forced: Option<(u64, usize)>,
) -> (&'static str, String) {
    let mut i = rng.below(INSTANCES as u64) as usize;
    let past_lease = LEASE_TTL + Duration::from_millis(rng.range(200, 1200));
    let short = Duration::from_millis(rng.range(200, 1200));
    let hold = match rng.range(0, 3) {
        0 => Some(Hold::Requests),
        1 => Some(Hold::Replies),
        2 => Some(Hold::Both),
        _ => None, // a clean cut
    };
    let hold_name = |h: Option<Hold>| match h {
        Some(Hold::Requests) => "blackhole of requests",
        Some(Hold::Replies) => "blackhole of replies",
        Some(Hold::Both) => "blackhole both ways",
        None => "clean cut",
    };
    let apply = |proxies: &[&TcpProxy], h: Option<Hold>| {
        for p in proxies {
            match h {
                Some(h) => p.hold(h),
                None => p.cut(),
            }
        }
    };
    let mut roll = rng.range(0, 8);
    if roll == HELD_WRITE {
        // An owner: an instance that owns nothing would hold no fenced write.
        let p = rng.below(PARTITIONS);
        i = owner_now(ctx, p).unwrap_or(i);
    }
    if let Some((kind, instance)) = forced {
        (roll, i) = (kind, instance);
    }
    let what = match roll {
        0 => {
            nodes[i].proc.take().expect("runs").kill();
            publish_gate(gate, nodes);
            tokio::time::sleep(short).await;
            nodes[i].start().await;
            publish_gate(gate, nodes);
            format!("SIGKILL {} for {short:?}", nodes[i].id)
        }
        1 => {
            nodes[i].proc().pause();
            tokio::time::sleep(past_lease).await;
            nodes[i].proc().resume();
            format!("SIGSTOP {} for {past_lease:?}", nodes[i].id)
        }
        2 => {
            let m = if rng.range(0, 1) == 0 {
                etcd.leader().await.unwrap_or(0)
            } else {
                rng.below(ETCD_MEMBERS as u64) as usize
            };
            etcd.members[m].kill();
            tokio::time::sleep(short).await;
            if let Err(e) = etcd.restart(m).await {
                panic!("restarting etcd member {m}: {e:#}");
            }
            format!("SIGKILL etcd member {m} for {short:?}")
        }
        3 => {
            let what = match log {
                NatsServers::One(n) => {
                    n.kill();
                    tokio::time::sleep(short).await;
                    n.restart().await.expect("restart nats-server");
                    "nats-server".to_string()
                }
                NatsServers::Three(c) => {
                    let k = rng.below(c.nodes.len() as u64) as usize;
                    c.nodes[k].kill();
                    tokio::time::sleep(short).await;
                    c.nodes[k].restart().await.expect("restart a nats-server");
                    format!("nats-server {k}")
                }
            };
            format!("SIGKILL {what} for {short:?}")
        }
        4 => {
            let ps: Vec<&TcpProxy> = nodes[i].etcd.iter().collect();
            apply(&ps, hold);
            tokio::time::sleep(past_lease).await;
            ps.iter().for_each(|p| p.restore());
            format!(
                "{} between {} and etcd for {past_lease:?}",
                hold_name(hold),
                nodes[i].id
            )
        }
        5 => {
            apply(&[&nodes[i].peer], hold);
            tokio::time::sleep(past_lease).await;
            nodes[i].peer.restore();
            format!(
                "{} of the other instances' calls to {} for {past_lease:?}",
                hold_name(hold),
                nodes[i].id
            )
        }
        6 => {
            let ps: Vec<&TcpProxy> = nodes[i].nats.iter().collect();
            apply(&ps, hold);
            tokio::time::sleep(past_lease).await;
            ps.iter().for_each(|p| p.restore());
            format!(
                "{} between {} and nats for {past_lease:?}",
                hold_name(hold),
                nodes[i].id
            )
        }
        HELD_WRITE => {
            // The fence reached for real (as fencing_e2e.rs does): the instance's
            // requests to etcd stop on the wire, one of its writes goes out into the
            // blackhole, then it is paused (so no timeout of its own cancels the
            // write), its lease runs out and the others take its partitions; only then
            // does the held write reach etcd, carrying the old epoch. A fenced etcd
            // refuses it; an unfenced one applies it, and rule 6 names it.
            let owned: Vec<u64> = (0..PARTITIONS)
                .filter(|p| owner_now(ctx, *p) == Some(i))
                .collect();
            let ps: Vec<&TcpProxy> = nodes[i].etcd.iter().collect();
            let sent = |ps: &[&TcpProxy]| ps.iter().map(|p| p.bytes_sent()).sum::<u64>();
            let before = sent(&ps);
            ps.iter().for_each(|p| p.hold(Hold::Requests));
            // A transaction with a record is a few hundred bytes; a lease keep-alive
            // a few dozen.
            let on_wire = wait_until(Duration::from_secs(3), "a write on the wire", || {
                let now = sent(&ps);
                async move {
                    anyhow::ensure!(now - before >= 200, "{} bytes", now - before);
                    Ok(())
                }
            })
            .await
            .is_ok();
            nodes[i].proc().pause();
            let paused = Instant::now();
            let moved = wait_until(Duration::from_secs(15), "its partitions moved", || {
                let left: Vec<u64> = owned
                    .iter()
                    .copied()
                    .filter(|p| owner_now(ctx, *p).is_none_or(|o| o == i))
                    .collect();
                async move {
                    anyhow::ensure!(left.is_empty(), "still held: {left:?}");
                    Ok(())
                }
            })
            .await
            .is_ok();
            ps.iter().for_each(|p| p.restore());
            nodes[i].proc().resume();
            format!(
                "SIGSTOP {} for {:?} with {} held on the wire to etcd, {}",
                nodes[i].id,
                paused.elapsed(),
                if on_wire { "a write" } else { "no write" },
                if moved {
                    format!("after partitions {owned:?} moved")
                } else {
                    format!("partitions {owned:?} not all moved within 15 s")
                }
            )
        }
        _ => {
            let jump = rng.range(3, 40) as i64 * if rng.range(0, 1) == 0 { 1 } else { -1 };
            nodes[i].set_clock(jump);
            tokio::time::sleep(past_lease).await;
            nodes[i].set_clock(0);
            format!(
                "clock of {} jumped {jump:+} s for {past_lease:?}, then back",
                nodes[i].id
            )
        }
    };
    (
        FAULT_KINDS[(roll as usize).min(FAULT_KINDS.len() - 1)],
        what,
    )
}

/// The instance that holds `partition` of TOPIC in etcd's history as watched so far
/// (the owner key's value names it), if any.
fn owner_now(ctx: &Ctx, partition: u64) -> Option<usize> {
    let key = owner_key(TOPIC, partition);
    let log = ctx.log();
    let change = log.changes.iter().rev().find(|c| c.key == key)?;
    let holder = String::from_utf8_lossy(change.value.as_ref()?).into_owned();
    (0..INSTANCES).find(|i| holder.contains(&format!("inst-{i}")))
}

// ---------------------------------------------------------------------------------
// The drain.

async fn shortfall(ctx: &Ctx, a: &str) -> anyhow::Result<Option<String>> {
    let dead = dead_letter_entries(a, SUB).await?;
    let ends = end_offsets(a, TOPIC).await;
    let offsets = offsets(a, SUB).await?;
    let dead_ids: BTreeSet<String> = dead.iter().map(|e| id_of(&e["event"])).collect();
    let log = ctx.log();
    let delivered: BTreeSet<&str> = log.deliveries.iter().map(|d| d.event_id.as_str()).collect();
    let missing: Vec<&String> = log
        .published
        .iter()
        .filter(|(id, p)| {
            matches!(p.outcome, Outcome::Created(..))
                && !delivered.contains(id.as_str())
                && !dead_ids.contains(*id)
        })
        .map(|(id, _)| id)
        .collect();
    let behind: Vec<String> = offsets
        .iter()
        .filter_map(|o| {
            let p = o["partition"].as_u64()?;
            let c = o["committed"].as_u64()?;
            let end = *ends.get(p as usize)?;
            (c != end).then(|| format!("partition {p} committed {c} of {end}"))
        })
        .collect();
    if missing.is_empty() && behind.is_empty() && offsets.len() == ends.len() {
        return Ok(None);
    }
    Ok(Some(format!(
        "{} 201'd events neither delivered nor dead-lettered (first: {:?}); {behind:?}",
        missing.len(),
        missing.iter().take(10).collect::<Vec<_>>()
    )))
}

/// What every instance says of the subscription when the drain gives up: its offsets
/// (the owner's committed, or the checkpoint) and its stats (forwarded to each
/// partition's owner: in flight, waiting, dead-lettering, parked), so a partition that
/// stopped moving shows where its gap is held.
async fn drain_views(addrs: &[String]) -> String {
    let mut out = String::new();
    for a in addrs {
        for what in ["offsets", "stats"] {
            let r = match what {
                "offsets" => client(a).offsets_answer(SUB).await,
                _ => client(a).stats_answer(SUB).await,
            };
            let got = match r {
                Ok(r) => format!("{} {}", r.status, r.text()),
                Err(meshd_client::Error::Api(p)) => format!("{} {}", p.status, p.detail),
                Err(e) => format!("no answer: {e:#}"),
            };
            out.push_str(&format!("{a} {what}: {got}\n"));
        }
    }
    out
}

/// Pulls through every instance in turn, acks everything but poison (nacked), until
/// every 201'd event is delivered or dead-lettered and every partition is committed
/// to its end (read on each partition's owner: a non-owner shows the checkpoint,
/// which follows within the checkpoint interval).
async fn drain(ctx: &Ctx, nodes: &[Node], addrs: &[String]) {
    let start = Instant::now();
    let deadline = DRAIN + DRAIN_PER_ROUND * ctx.rounds;
    let mut last = String::from("nothing checked yet");
    let mut turn = 0;
    let mut drained = 0;
    loop {
        if start.elapsed() > deadline {
            let views = drain_views(addrs).await;
            ctx.fail(format!(
                "the drain did not finish within {deadline:?} ({drained} deliveries drained): {last}\n{views}each instance's whole log: {}",
                keep_logs(nodes, ctx.seed)
            ));
        }
        let a = &addrs[turn % addrs.len()];
        turn += 1;
        match pull_and_record(ctx, a, 100, 250).await {
            Ok(got) if !got.is_empty() => {
                drained += got.len();
                let (poison, rest): (Vec<_>, Vec<_>) =
                    got.into_iter().partition(|(_, id)| is_poison(id));
                for (verb, list) in [("ack", rest), ("nack", poison)] {
                    let ids: Vec<Value> = list.into_iter().map(|(d, _)| d).collect();
                    if !ids.is_empty() {
                        if let Err(f) = settle_and_record(ctx, a, verb, ids).await {
                            last = format!("{verb} failed: {f}");
                        }
                    }
                }
                continue;
            }
            Ok(_) => {}
            Err(f) => {
                last = format!("pull failed: {f}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        }
        match shortfall(ctx, a).await {
            Ok(None) => return,
            Ok(Some(s)) => last = s,
            Err(e) => last = format!("{e:#}"),
        }
    }
}

// ---------------------------------------------------------------------------------
// The oracle.

/// (topic, partition) a checkpoint or attempt-ledger key belongs to, and the
/// subscription: `meshd/v1/{checkpoints|attempts}/{sub}/{incarnation}/{topic}/{p}[...]`.
fn partition_of_key(key: &str) -> Option<(String, String, u64)> {
    let rest = key
        .strip_prefix("meshd/v1/checkpoints/")
        .or_else(|| key.strip_prefix("meshd/v1/attempts/"))?;
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() < 4 {
        return None;
    }
    Some((
        parts[0].to_string(),
        parts[2].to_string(),
        parts[3].parse().ok()?,
    ))
}

fn owner_key(topic: &str, partition: u64) -> String {
    format!("meshd/v1/owners/partition/{topic}/{partition}")
}

/// One checkpoint of SUB: its revision, its committed offset and the resolved `[from, to)` ranges above it.
#[derive(Clone, Debug)]
struct Checkpoint {
    revision: i64,
    committed: u64,
    resolved: Vec<(u64, u64)>,
}

impl Checkpoint {
    /// Whether a new owner resuming from this checkpoint skips `offset`.
    fn covers(&self, offset: u64) -> bool {
        offset < self.committed
            || self
                .resolved
                .iter()
                .any(|(a, b)| (*a..*b).contains(&offset))
    }
}

/// What rule 6 found, with the moves and checkpoints it saw (for rules 3 and 7).
#[derive(Default)]
struct History {
    /// Per partition of TOPIC: SUB's checkpoints in revision order.
    checkpoints: BTreeMap<u64, Vec<Checkpoint>>,
    /// Per partition: arrival times of owner changes after the first acquisition.
    moves: BTreeMap<u64, Vec<Duration>>,
    /// Writes made for an owner that rule 6 checked.
    writes_checked: usize,
    /// Of those, the ones checked against the epoch they carry (dead letters,
    /// checkpoints, attempt-ledger records and what their transaction wrote with
    /// them), not only against an owner's existence.
    epochs_checked: usize,
}

/// When etcd was known to hold which revision: the revision sampler's answers and the
/// watch's arrivals, by time, each with the highest revision known by then.
struct Held(Vec<(Duration, i64)>);

impl Held {
    fn new(log: &Log) -> Self {
        let mut known: Vec<(Duration, i64)> = log.held.clone();
        known.extend(log.changes.iter().map(|c| (c.arrived, c.revision)));
        known.sort();
        let mut highest = 0;
        for (_, r) in known.iter_mut() {
            highest = highest.max(*r);
            *r = highest;
        }
        Held(known)
    }

    /// The highest revision etcd is known to have held at `t` (0: none known).
    fn at(&self, t: Duration) -> i64 {
        let i = self.0.partition_point(|(at, _)| *at <= t);
        if i == 0 {
            0
        } else {
            self.0[i - 1].1
        }
    }
}

/// Whether the owner key of `topic`/`p` held exactly `epoch` (and, when given, names
/// `instance`); otherwise what it held.
fn check_fence(
    owners: &BTreeMap<String, (Vec<u8>, i64)>,
    topic: &str,
    p: u64,
    epoch: Option<i64>,
    instance: Option<&str>,
) -> Result<(), String> {
    let owner = owners.get(&owner_key(topic, p));
    let ok = owner.is_some_and(|(holder, held)| {
        Some(*held) == epoch
            && instance.is_none_or(|i| holder.windows(i.len()).any(|w| w == i.as_bytes()))
    });
    if ok {
        return Ok(());
    }
    Err(format!(
        "while the owner of {topic}/{p} was {:?}",
        owner.map(|(holder, epoch)| (String::from_utf8_lossy(holder).into_owned(), *epoch))
    ))
}

/// Rule 6 over etcd's history, revision by revision: every write made for a
/// partition's owner is checked against the owner key as it was at that revision.
/// Dead letters, checkpoints and attempt-ledger records carry their writer's epoch
/// (a dead letter its instance too), which must be exactly the owner key's
/// `mod_revision` then, so a stale owner's write during its successor's tenure is
/// caught, not only one while nobody held the partition. The attempt ledger's head
/// and pruned records go in one transaction with a record, whose epoch they share; a
/// write with no record (a clear at an offset reset: deletes only) is checked only
/// for an owner's existence, as is a checkpoint's deletion.
fn check_etcd_history(changes: &[Change], v: &mut Vec<String>) -> History {
    let mut h = History::default();
    // The owner keys' state: key -> (value, mod_revision).
    let mut owners: BTreeMap<String, (Vec<u8>, i64)> = BTreeMap::new();
    // Last checkpoint offset (and reset epoch) per checkpoint key.
    let mut last_checkpoint: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut acquired: BTreeSet<String> = BTreeSet::new();
    let mut by_revision: BTreeMap<i64, Vec<&Change>> = BTreeMap::new();
    for c in changes {
        by_revision.entry(c.revision).or_default().push(c);
    }
    let mut expected = changes.first().map(|c| c.revision).unwrap_or(1);
    for (revision, group) in &by_revision {
        if *revision < expected {
            v.push(format!("rule 6: revision {revision} reported out of order"));
        }
        expected = revision + 1;
        // The epoch (and instance) each partition's ledger record in this
        // transaction carries.
        let mut ledger_epoch: BTreeMap<(String, String, u64), (i64, Option<String>)> =
            BTreeMap::new();
        for c in group {
            if let (Some(subject), Some(bytes), true) =
                (partition_of_key(&c.key), &c.value, c.key.contains("/r/"))
            {
                let record: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);
                match record["e"].as_i64() {
                    Some(e) => {
                        let instance = record["i"].as_str().map(str::to_string);
                        ledger_epoch.insert(subject, (e, instance));
                    }
                    None => v.push(format!(
                        "rule 6: attempt-ledger record {} at revision {revision} carries no owner epoch: {record}",
                        c.key
                    )),
                }
            }
        }
        // Checked against the owners as they were before this revision (a fenced
        // transaction compares the owner key and does not change it).
        for c in group {
            if c.key.starts_with("meshd/v1/deadletters/entries/") {
                // Deleting an entry (redrive, retention) is not the owner's.
                let Some(bytes) = &c.value else { continue };
                let e: Value = serde_json::from_slice(bytes).unwrap_or(Value::Null);
                let (Some(topic), Some(p)) = (e["topic"].as_str(), e["partition"].as_u64()) else {
                    v.push(format!("rule 6: dead letter {} at revision {revision} without topic/partition: {e}", c.key));
                    continue;
                };
                h.writes_checked += 1;
                h.epochs_checked += 1;
                if let Err(owner) = check_fence(
                    &owners,
                    topic,
                    p,
                    e["epoch"].as_i64(),
                    Some(e["instance"].as_str().unwrap_or("(none)")),
                ) {
                    v.push(format!(
                        "rule 6: dead letter {} written at revision {revision} by {} epoch {} {owner}",
                        c.key, e["instance"], e["epoch"]
                    ));
                }
                continue;
            }
            let Some((sub, topic, p)) = partition_of_key(&c.key) else {
                continue;
            };
            let is_checkpoint = c.key.starts_with("meshd/v1/checkpoints/");
            let cp: Option<Value> = match (&c.value, is_checkpoint) {
                (Some(bytes), true) => Some(serde_json::from_slice(bytes).unwrap_or(Value::Null)),
                _ => None,
            };
            let carried = match &cp {
                Some(cp) => cp["owner_epoch"]
                    .as_i64()
                    .map(|e| (e, cp["owner_instance"].as_str().map(str::to_string))),
                None => ledger_epoch.get(&(sub.clone(), topic.clone(), p)).cloned(),
            };
            h.writes_checked += 1;
            let written = if c.value.is_some() {
                "written"
            } else {
                "deleted"
            };
            match carried {
                Some((epoch, instance)) => {
                    h.epochs_checked += 1;
                    if let Err(owner) =
                        check_fence(&owners, &topic, p, Some(epoch), instance.as_deref())
                    {
                        v.push(format!(
                            "rule 6: {} {written} at revision {revision} by {} epoch {epoch} {owner}",
                            c.key,
                            instance.as_deref().unwrap_or("(instance not recorded)")
                        ));
                    }
                }
                // A checkpoint's creation is a put-if-absent by whoever needs it first
                // (the subscription's creator, or an owner), with no owner: it can
                // never overwrite an owner's. Any later put carries its writer.
                None if cp.is_some() && !last_checkpoint.contains_key(&c.key) => {}
                None if cp.is_some() => v.push(format!(
                    "rule 6: checkpoint {} written at revision {revision} carries no owner epoch",
                    c.key
                )),
                None => {
                    if !owners.contains_key(&owner_key(&topic, p)) {
                        v.push(format!(
                            "rule 6: {} {written} at revision {revision} while {topic}/{p} had no owner",
                            c.key
                        ));
                    }
                }
            }
            let Some(cp) = cp else { continue };
            let (Some(offset), Some(epoch)) = (
                cp["committed"]["offset"].as_u64(),
                cp["committed"]["epoch"].as_u64(),
            ) else {
                v.push(format!(
                    "rule 6: checkpoint {} at revision {revision} unreadable: {cp}",
                    c.key
                ));
                continue;
            };
            if let Some((before, before_epoch)) =
                last_checkpoint.insert(c.key.clone(), (offset, epoch))
            {
                if epoch == before_epoch && offset < before {
                    v.push(format!(
                        "rule 6: checkpoint {} went back from {before} to {offset} at revision {revision}",
                        c.key
                    ));
                }
            }
            if sub == SUB && topic == TOPIC {
                let resolved: Vec<(u64, u64)> = cp["resolved"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|r| Some((r[0].as_u64()?, r[1].as_u64()?)))
                    .collect();
                h.checkpoints.entry(p).or_default().push(Checkpoint {
                    revision: *revision,
                    committed: offset,
                    resolved,
                });
            }
        }
        for c in group {
            let Some(rest) = c.key.strip_prefix("meshd/v1/owners/partition/") else {
                continue;
            };
            match &c.value {
                Some(value) => {
                    owners.insert(c.key.clone(), (value.clone(), *revision));
                    let first = acquired.insert(c.key.clone());
                    if let (false, Some((topic, p))) = (first, rest.rsplit_once('/')) {
                        if topic == TOPIC {
                            if let Ok(p) = p.parse::<u64>() {
                                h.moves.entry(p).or_default().push(c.arrived);
                            }
                        }
                    }
                }
                None => {
                    owners.remove(&c.key);
                }
            }
        }
    }
    h
}

#[derive(Default, Debug)]
struct Tally {
    duplicates: usize,
    duplicates_by_partition: BTreeMap<u64, usize>,
    /// Duplicates by the kind of the first fault whose window holds their ack.
    duplicates_by_fault_kind: BTreeMap<&'static str, usize>,
    poison_dead_lettered: usize,
    /// Duplicates with a move of their partition (an owner key changed in etcd)
    /// between the ack and the redelivery; the others came from a partition task that
    /// restarted on the same owner after an ambiguous Meta write.
    after_a_move: usize,
}

/// The window of acks a fault may explain a duplicate of (rule 7): from a checkpoint
/// interval (plus slack) before it began, which the last checkpoint before the
/// partition moved could not carry, to a lease TTL (plus slack) after it ended, while
/// an owner cut off from etcd or resumed from a pause may still answer acks it can no
/// longer checkpoint, or its task restarts after an ambiguous Meta write.
fn duplicate_window(f: &Fault) -> (Duration, Duration) {
    (
        f.start
            .saturating_sub(Duration::from_millis(CHECKPOINT_MS) + CHECKPOINT_SLACK),
        f.end + LEASE_TTL + AFTERMATH_SLACK,
    )
}

fn violations(log: &Log, dead: &[Value], hist: &History, tally: &mut Tally) -> Vec<String> {
    let mut v: Vec<String> = log
        .problems
        .iter()
        .map(|p| format!("answer breaks the contract: {p}"))
        .collect();
    let created: BTreeMap<&str, (u64, u64)> = log
        .published
        .iter()
        .filter_map(|(id, p)| match p.outcome {
            Outcome::Created(pa, o) => Some((id.as_str(), (pa, o))),
            _ => None,
        })
        .collect();
    // (partition, offset) -> event id, from deliveries and dead letters.
    let mut at: BTreeMap<(u64, u64), String> = BTreeMap::new();
    let mut positions: BTreeMap<&str, BTreeSet<(u64, u64)>> = BTreeMap::new();

    // Rule 2.
    for d in &log.deliveries {
        positions
            .entry(d.event_id.as_str())
            .or_default()
            .insert((d.partition, d.offset));
        if let Some(other) = at.insert((d.partition, d.offset), d.event_id.clone()) {
            if other != d.event_id {
                v.push(format!(
                    "rule 2: p{} o{} delivered as {other} and as {}",
                    d.partition, d.offset, d.event_id
                ));
            }
        }
        match log.published.get(&d.event_id) {
            None => v.push(format!("rule 2: delivery {d} of an event never published")),
            Some(p) if p.body != d.event => v.push(format!(
                "rule 2: delivery {d} differs from what was published"
            )),
            Some(_) => {}
        }
        if d.attempt == 0 || d.attempt > MAX_ATTEMPTS {
            v.push(format!(
                "rule 4: delivery {d} has attempt outside 1..={MAX_ATTEMPTS}"
            ));
        }
    }
    let mut dead_at: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    let mut dead_ids: BTreeSet<String> = BTreeSet::new();
    for e in dead {
        let (Some(p), Some(o), Some(attempts), Some(id)) = (
            e["partition"].as_u64(),
            e["offset"].as_u64(),
            e["attempts"].as_u64(),
            e["event"]["id"].as_str(),
        ) else {
            v.push(format!("rule 5: malformed dead letter {e}"));
            continue;
        };
        positions.entry(id).or_default().insert((p, o));
        if dead_at.insert((p, o), attempts).is_some() || !dead_ids.insert(id.to_string()) {
            v.push(format!("rule 5: dead-lettered twice: p{p} o{o} {id}"));
        }
        if attempts != MAX_ATTEMPTS {
            v.push(format!("rule 4: dead letter p{p} o{o} {id} carries {attempts} attempts, not {MAX_ATTEMPTS}"));
        }
        match log.published.get(id) {
            None => v.push(format!(
                "rule 2: dead letter of an event never published: {id}"
            )),
            Some(pb) if pb.body != e["event"] => v.push(format!(
                "rule 2: dead letter {id} differs from what was published"
            )),
            _ => {}
        }
    }
    for (id, places) in &positions {
        if places.len() > 1 {
            v.push(format!("rule 2: event {id} stored at {places:?}"));
        }
        if let (Some(want), Some(got)) = (created.get(id), places.iter().next()) {
            if want != got {
                v.push(format!(
                    "rule 2: event {id} answered 201 at {want:?}, seen at {got:?}"
                ));
            }
        }
    }

    // Rule 1.
    for id in created.keys() {
        if !positions.contains_key(id) {
            v.push(format!(
                "rule 1: event {id} answered 201 was never delivered nor dead-lettered"
            ));
        }
    }

    // Rule 4: attempts before an offset's first ack; poison events.
    let mut by_offset: BTreeMap<(u64, u64), Vec<&Seen>> = BTreeMap::new();
    for d in &log.deliveries {
        by_offset
            .entry((d.partition, d.offset))
            .or_default()
            .push(d);
    }
    for ((p, o), ds) in &by_offset {
        let cutoff = log
            .first_ack_sent
            .get(&(*p, *o))
            .copied()
            .unwrap_or(Duration::MAX);
        let before: Vec<&&Seen> = ds.iter().filter(|d| d.recv < cutoff).collect();
        for (i, a) in before.iter().enumerate() {
            for b in &before[i + 1..] {
                if a.attempt == b.attempt {
                    v.push(format!(
                        "rule 4: attempt {} of p{p} o{o} handed out twice: {a} and {b}",
                        a.attempt
                    ));
                } else if (a.recv <= b.sent && a.attempt > b.attempt)
                    || (b.recv <= a.sent && b.attempt > a.attempt)
                {
                    v.push(format!(
                        "rule 4: attempts went backwards at p{p} o{o}: {a} then {b}"
                    ));
                }
            }
        }
        let id = &ds[0].event_id;
        if is_poison(id) && dead_at.contains_key(&(*p, *o)) {
            tally.poison_dead_lettered += 1;
        }
    }
    for (id, (p, o)) in &created {
        if is_poison(id) && !dead_at.contains_key(&(*p, *o)) {
            v.push(format!(
                "rule 4: poison event {id} (p{p} o{o}) was not dead-lettered"
            ));
        }
    }

    // Rule 5: nothing handed out after `dead_lettered`.
    for n in log.nacked.iter().filter(|n| n.list == "dead_lettered") {
        if n.attempt != MAX_ATTEMPTS {
            v.push(format!(
                "rule 4: nack of attempt {} of p{} o{} answered dead_lettered",
                n.attempt, n.partition, n.offset
            ));
        }
        if !dead_at.contains_key(&(n.partition, n.offset)) {
            v.push(format!(
                "rule 5: p{} o{} answered dead_lettered is not in the dead-letter store",
                n.partition, n.offset
            ));
        }
        for d in by_offset
            .get(&(n.partition, n.offset))
            .into_iter()
            .flatten()
        {
            if d.sent >= n.recv {
                v.push(format!(
                    "rule 5: {d} handed out after its nack was answered dead_lettered at {:?}",
                    n.recv
                ));
            }
        }
    }

    // Rule 3, in etcd's revision order: nothing delivered that a checkpoint etcd held
    // when the pull was sent covers; gap-free checkpoints (an ack of each offset sent
    // before etcd held the checkpoint's revision).
    let held = Held::new(log);
    for d in &log.deliveries {
        let Some(cps) = hist.checkpoints.get(&d.partition) else {
            continue;
        };
        let at_send = held.at(d.sent);
        if let Some(cp) = cps
            .iter()
            .find(|cp| cp.revision <= at_send && cp.covers(d.offset))
        {
            v.push(format!(
                "rule 3: {d} pulled when etcd held revision {at_send}, after checkpoint {cp:?}"
            ));
        }
    }
    for (p, cps) in &hist.checkpoints {
        let mut checked: BTreeSet<u64> = BTreeSet::new();
        for cp in cps {
            let covered = (0..cp.committed).chain(cp.resolved.iter().flat_map(|(a, b)| *a..*b));
            for o in covered {
                if !checked.insert(o) {
                    continue;
                }
                let acked_before = log
                    .ack_sends
                    .get(&(*p, o))
                    .is_some_and(|sends| sends.iter().any(|s| held.at(*s) < cp.revision));
                if !acked_before && !dead_at.contains_key(&(*p, o)) {
                    v.push(format!(
                        "rule 3: checkpoint {cp:?} of p{p} covers o{o}, which no ack named before and is not dead-lettered"
                    ));
                }
            }
        }
    }

    // Rule 7: duplicates only near a fault.
    for a in &log.acked {
        for d in by_offset
            .get(&(a.partition, a.offset))
            .into_iter()
            .flatten()
        {
            if d.sent <= a.recv {
                continue;
            }
            tally.duplicates += 1;
            *tally
                .duplicates_by_partition
                .entry(a.partition)
                .or_default() += 1;
            if hist
                .moves
                .get(&a.partition)
                .is_some_and(|ms| ms.iter().any(|m| *m > a.sent && *m <= d.recv + WATCH_SLACK))
            {
                tally.after_a_move += 1;
            }
            // The bound: a fault whose window holds the ack's answer explains it; none
            // other does.
            let explained = log.faults.iter().find(|f| {
                let (from, to) = duplicate_window(f);
                from <= a.recv && a.recv <= to
            });
            match explained {
                Some(f) => *tally.duplicates_by_fault_kind.entry(f.kind).or_default() += 1,
                None => v.push(format!(
                    "rule 7: {d} delivered again after its ack (attempt {}) was answered acked at {:?}, outside every fault's window (a checkpoint interval before its start to a lease TTL after its end)",
                    a.attempt, a.recv
                )),
            }
            break;
        }
    }
    v
}

/// What a run did, for the activity floor.
#[derive(Debug, Default)]
struct Activity {
    acked: usize,
    cas_applied: usize,
    task_answers: usize,
    moves: usize,
}

/// The oracle's verdict on a run.
struct Judgement {
    violations: Vec<String>,
    hist: History,
    tally: Tally,
    activity: Activity,
}

fn faults_by_kind(faults: &[Fault]) -> BTreeMap<&'static str, usize> {
    let mut by: BTreeMap<&'static str, usize> = BTreeMap::new();
    for f in faults {
        *by.entry(f.kind).or_default() += 1;
    }
    by
}

/// Every rule over what the clients were told, etcd's history and the dead-letter
/// store, and the activity floor: a run of `rounds` faults must have given each rule
/// something to check (acks, publishes, settings operations, compare-and-sets that
/// applied, task operations answered, fenced writes checked against their epoch, and
/// at least one partition move), or it fails.
fn judge(log: &Log, dead: &[Value], rounds: u32) -> Judgement {
    let mut v = Vec::new();
    let hist = check_etcd_history(&log.changes, &mut v);
    let mut tally = Tally::default();
    v.extend(violations(log, dead, &hist, &mut tally));
    // Rule 8.
    v.extend(check_settings_history(&log.history));
    if let Err((id, verdict)) = check_by_key(&TaskModel, &log.tasks, |c| c.id().to_string()) {
        let ops: Vec<&TaskOp> = log.tasks.iter().filter(|op| op.input.id() == id).collect();
        v.push(format!(
            "rule 8: the history of task {id} is not linearizable: {verdict:?}\n{ops:#?}"
        ));
    }
    let activity = Activity {
        acked: log.acked.len(),
        cas_applied: log
            .history
            .iter()
            .filter(|op| matches!(op.ret, Some((_, RegisterOutput::Cas(true)))))
            .count(),
        task_answers: log.tasks.iter().filter(|op| op.ret.is_some()).count(),
        moves: hist.moves.values().map(Vec::len).sum(),
    };
    let floor = rounds as usize * 5;
    // A run of 8 faults applies about 5 (three clients, each reading before its
    // compare-and-set, while the others write): one is asked for.
    let cas_floor = 1;
    if activity.acked < floor
        || log.created < floor
        || log.history.len() < floor
        || activity.task_answers < floor
        || hist.epochs_checked < floor
        || activity.cas_applied < cas_floor
        || activity.moves == 0
    {
        v.push(format!(
            "activity floor: {} acks, {} publishes, {} settings operations, {} task operations answered, {} etcd writes checked against their epoch (each must be at least {floor}), {} compare-and-sets applied (at least {cas_floor}), {} partition moves (at least 1)",
            activity.acked,
            log.created,
            log.history.len(),
            activity.task_answers,
            hist.epochs_checked,
            activity.cas_applied,
            activity.moves
        ));
    }
    Judgement {
        violations: v,
        hist,
        tally,
        activity,
    }
}

/// Rule 8. Writes and compare-and-sets go to Meta (conditional on revision), so
/// their history must be linearizable. Reads come from each instance's cache, which
/// the contract keeps read-your-writes and convergent, not linearizable (a GET on an
/// instance cut off from etcd answers its last view), so a read is checked for
/// what a cache may show: a value that was written, by a write sent before the read
/// was answered.
fn check_settings_history(history: &[HistoryOp]) -> Vec<String> {
    let mut v = Vec::new();
    let writes: Vec<HistoryOp> = history
        .iter()
        .filter(|op| !matches!(op.input, RegisterInput::Read))
        .cloned()
        .collect();
    if let Err((_, verdict)) = check_by_key(&RegisterOf::<u64>::default(), &writes, |_| ()) {
        v.push(format!(
            "rule 8: the writes and compare-and-sets of the settings are not linearizable: {verdict:?}"
        ));
    }
    // A value counts as written by a plain write, or by a compare-and-set that applied
    // or whose answer never came; one that answered 412 wrote nothing.
    let written: BTreeMap<u64, u64> = writes
        .iter()
        .filter_map(|op| match (&op.input, &op.ret) {
            (RegisterInput::Write(x), _)
            | (RegisterInput::Cas { new: x, .. }, None | Some((_, RegisterOutput::Cas(true)))) => {
                Some((*x, op.call))
            }
            _ => None,
        })
        .collect();
    for op in history {
        if let (RegisterInput::Read, Some((ret, RegisterOutput::Read(Some(x))))) =
            (&op.input, &op.ret)
        {
            if written.get(x).is_none_or(|call| call > ret) {
                v.push(format!(
                    "rule 8: a read answered {x}, which no write sent before it wrote: {op:?}"
                ));
            }
        }
    }
    v
}

/// Copies each running instance's whole log next to the dump, for a failed run's
/// analysis (the failure message shows only their last lines); says where.
fn keep_logs(nodes: &[Node], seed: u64) -> String {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    for n in nodes {
        if let Some(p) = &n.proc {
            let to = dir.join(format!("cluster-crash-loop-{seed}-{}.log", n.id));
            let _ = std::fs::copy(p.log_path(), to);
        }
    }
    format!("{}/cluster-crash-loop-{seed}-<instance>.log", dir.display())
}

/// Writes what the clients were told and etcd's history to a file for a failed run's
/// analysis; returns its path (or why it could not).
fn dump(log: &Log, dead: &[Value], seed: u64) -> String {
    let path =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cluster-crash-loop-{seed}.txt"));
    let mut out = String::new();
    use std::fmt::Write;
    for f in &log.faults {
        let _ = writeln!(out, "fault {:?}..{:?} {}", f.start, f.end, f.what);
    }
    for d in &log.deliveries {
        let _ = writeln!(out, "delivery {d}");
    }
    for a in &log.acked {
        let _ = writeln!(
            out,
            "ack p{} o{} attempt {} {} sent {:?} answered {:?}",
            a.partition, a.offset, a.attempt, a.list, a.sent, a.recv
        );
    }
    for a in &log.nacked {
        let _ = writeln!(
            out,
            "nack p{} o{} attempt {} {} sent {:?} answered {:?}",
            a.partition, a.offset, a.attempt, a.list, a.sent, a.recv
        );
    }
    for e in dead {
        let _ = writeln!(
            out,
            "dead p{} o{} attempts {} {}",
            e["partition"], e["offset"], e["attempts"], e["event"]["id"]
        );
    }
    for h in &log.history {
        let _ = writeln!(out, "history {h:?}");
    }
    for c in &log.changes {
        let value = c
            .value
            .as_ref()
            .map(|v| String::from_utf8_lossy(v).into_owned());
        let _ = writeln!(
            out,
            "etcd {} {:?} {} {:?}",
            c.revision, c.arrived, c.key, value
        );
    }
    match std::fs::write(&path, out) {
        Ok(()) => path.display().to_string(),
        Err(e) => format!("not written ({}: {e})", path.display()),
    }
}

// ---------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn given_faults_of_every_process_and_link_in_a_cluster_then_nothing_acknowledged_is_lost_and_every_write_was_fenced(
) {
    let rounds =
        env_number("MESHD_CLUSTER_CRASH_ROUNDS").map_or(DEFAULT_ROUNDS, |n| n.max(1) as u32);
    let three_nats = env_number("MESHD_CLUSTER_CRASH_NATS") == Some(3);
    cluster_crash_loop(seed(), rounds, three_nats, false).await;
}

/// The positive control of the fence (issue 45): the same loop on a debug build with
/// fencing switched off (`meshd_meta::fence::unfenced_for_tests`), two pauses of
/// partition 0's owner with a write held on the wire. Its oracle must name the stale
/// owner's writes that etcd then applied (rule 6); with fencing on, the same faults
/// pass (the first fault of every run above is one of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn positive_control_an_unfenced_build_fails_the_cluster_crash_loop_on_rule_6() {
    let found = cluster_crash_loop(seed(), UNFENCED_ROUNDS, false, true).await;
    assert!(
        found.iter().any(|v| v.starts_with("rule 6:")),
        "the unfenced loop passed rule 6: {found:#?}"
    );
    eprintln!(
        "unfenced control: {} violations of rule 6, the first: {}",
        found.iter().filter(|v| v.starts_with("rule 6:")).count(),
        found.first().map(String::as_str).unwrap_or_default()
    );
}

/// Faults of the unfenced control.
const UNFENCED_ROUNDS: u32 = 2;

/// One run of the loop. With `unfenced`, every meshd runs with fencing switched off
/// and every fault is a pause of partition 0's owner with a write held on the wire;
/// the run ends after the faults and returns rule 6's violations over etcd's history
/// (no drain: without a fence nothing else need hold). Otherwise every rule is
/// checked and any violation fails the test here.
async fn cluster_crash_loop(
    seed: u64,
    rounds: u32,
    three_nats: bool,
    unfenced: bool,
) -> Vec<String> {
    eprintln!(
        "cluster crash loop: seed {seed} ({seed:#x}), {rounds} rounds, {} nats-server(s){}",
        if three_nats { 3 } else { 1 },
        if unfenced { ", UNFENCED" } else { "" }
    );
    let ctx = Arc::new(Ctx {
        t0: Instant::now(),
        seed,
        rounds,
        log: Mutex::new(Log::default()),
    });
    let mut rng = Rng(seed);
    let faketime = libfaketime();

    let mut etcd = EtcdCluster::start(ETCD_MEMBERS)
        .await
        .expect("start the etcd cluster");
    let mut log = if three_nats {
        NatsServers::Three(
            NatsCluster::start(3)
                .await
                .expect("start three nats-servers"),
        )
    } else {
        NatsServers::One(Box::new(
            NatsProcess::start().await.expect("start nats-server"),
        ))
    };
    let secret_dir = tempfile::tempdir().expect("temp dir");
    let secret = secret_dir.path().join("secret");
    std::fs::write(&secret, "cluster-crash-loop-secret-0123456789abcdef0123\n")
        .expect("write the secret");

    let etcd_addrs: Vec<SocketAddr> = etcd
        .members
        .iter()
        .map(|m| m.endpoint().parse().expect("an etcd endpoint"))
        .collect();
    let mut nodes = Vec::new();
    for i in 0..INSTANCES {
        let mut etcd_proxies = Vec::new();
        for a in &etcd_addrs {
            etcd_proxies.push(TcpProxy::start(*a).await.expect("proxy"));
        }
        let mut nats_proxies = Vec::new();
        for a in log.endpoints() {
            nats_proxies.push(TcpProxy::start(a).await.expect("proxy"));
        }
        // Upstream set once the instance runs.
        let peer = TcpProxy::start("127.0.0.1:9".parse().expect("addr"))
            .await
            .expect("proxy");
        let dir = tempfile::tempdir().expect("temp dir");
        let clock = dir.path().join("clock");
        let meta: Vec<String> = etcd_proxies.iter().map(|p| p.addr().to_string()).collect();
        let nats: Vec<String> = nats_proxies.iter().map(|p| p.addr().to_string()).collect();
        let mut nats_url = format!("nats://{}", nats.join(","));
        if three_nats {
            nats_url.push_str("?replicas=3");
        }
        let args = vec![
            "--meta".to_string(),
            format!("etcd://{}", meta.join(",")),
            "--log".to_string(),
            nats_url,
            "--cluster-secret-file".to_string(),
            secret.to_string_lossy().into_owned(),
            "--lease-ttl-ms".to_string(),
            LEASE_TTL.as_millis().to_string(),
            "--checkpoint-ms".to_string(),
            CHECKPOINT_MS.to_string(),
            "--instance-id".to_string(),
            format!("inst-{i}"),
            "--advertise".to_string(),
            peer.addr().to_string(),
        ];
        let mut env = vec![
            (
                "LD_PRELOAD".to_string(),
                faketime.to_string_lossy().into_owned(),
            ),
            (
                "FAKETIME_TIMESTAMP_FILE".to_string(),
                clock.to_string_lossy().into_owned(),
            ),
            ("FAKETIME_CACHE_DURATION".to_string(), "1".to_string()),
            ("DONT_FAKE_MONOTONIC".to_string(), "1".to_string()),
        ];
        if unfenced {
            env.push((meshd_meta::fence::UNFENCED_VAR.to_string(), "1".to_string()));
        }
        let mut node = Node {
            id: format!("inst-{i}"),
            proc: None,
            dir,
            args,
            env,
            etcd: etcd_proxies,
            nats: nats_proxies,
            peer,
            clock,
        };
        node.set_clock(0);
        node.start().await;
        nodes.push(node);
    }
    wait_all_ready(&ctx, &nodes).await;
    let endpoints: Vec<String> = etcd.members.iter().map(|m| m.endpoint()).collect();
    let (stop_watch, stop_rx) = watch::channel(false);
    let watcher = tokio::spawn(etcd_watcher(
        endpoints.clone(),
        ctx.clone(),
        stop_rx.clone(),
    ));
    let sampler = tokio::spawn(revision_sampler(endpoints.clone(), ctx.clone(), stop_rx));

    let a0 = nodes[0].proc().addr().to_string();
    create_topic(&a0, TOPIC, PARTITIONS as u32).await;
    create_subscription(
        &a0,
        SUB,
        json!({"topic": TOPIC, "ack_timeout_ms": ACK_TIMEOUT_MS, "max_attempts": MAX_ATTEMPTS, "start": "earliest"}),
    )
    .await;
    // The history's register starts with this write (before any client runs).
    let call = ctx.now().as_nanos() as u64;
    create_subscription(
        &a0,
        HSUB,
        json!({"topic": TOPIC, "ack_timeout_ms": 100_000}),
    )
    .await;
    let ret = ctx.now().as_nanos() as u64;
    ctx.log().history.push(Operation::answered(
        usize::MAX,
        RegisterInput::Write(100_000),
        call,
        ret,
        RegisterOutput::Written,
    ));

    let (gate_tx, gate_rx) = watch::channel(Gate::default());
    publish_gate(&gate_tx, &nodes);
    let mut clients = Vec::new();
    for n in 0..PUBLISHERS {
        clients.push(tokio::spawn(publisher(
            n,
            rng.fork(),
            gate_rx.clone(),
            ctx.clone(),
        )));
    }
    for _ in 0..CONSUMERS {
        clients.push(tokio::spawn(consumer(
            rng.fork(),
            gate_rx.clone(),
            ctx.clone(),
        )));
    }
    let r = send(
        &a0,
        "POST",
        "/v1/sessions",
        &json!({"client_id": TASK_AGENT, "ttl_ms": 600_000}),
    )
    .await
    .expect("open the agent's session");
    assert_eq!(r.status, 201, "{}", r.body);
    let session = r.json().expect("session")["session_id"]
        .as_str()
        .expect("session id")
        .to_string();
    clients.push(tokio::spawn(session_keeper(
        session.clone(),
        rng.fork(),
        gate_rx.clone(),
    )));
    for c in 0..HISTORY_CLIENTS {
        clients.push(tokio::spawn(task_client(
            c,
            session.clone(),
            rng.fork(),
            gate_rx.clone(),
            ctx.clone(),
        )));
    }
    for c in 0..HISTORY_CLIENTS {
        clients.push(tokio::spawn(history_client(
            c,
            rng.fork(),
            gate_rx.clone(),
            ctx.clone(),
        )));
    }

    for round in 0..rounds {
        tokio::time::sleep(Duration::from_millis(rng.range(300, 1500))).await;
        // The first fault pauses the owner of partition 0 past its lease with a write
        // held on the wire, so every run moves a partition with work in flight (rules
        // 3 and 7 have moves to check; the floor asks for one) and reaches the fence.
        // The unfenced control does only that, to partition 0's owner of the moment.
        let forced = (round == 0 || unfenced)
            .then(|| owner_now(&ctx, 0))
            .flatten()
            .map(|i| (HELD_WRITE, i));
        let start = ctx.now();
        let (kind, what) = one_fault(
            &mut rng, &mut nodes, &mut etcd, &mut log, &gate_tx, &ctx, forced,
        )
        .await;
        let end = ctx.now();
        eprintln!("round {round}: {what} ({start:?}..{end:?})");
        ctx.log().faults.push(Fault {
            kind,
            what,
            start,
            end,
        });
    }
    // Let the clients run on a healed cluster for a while, then stop them and drain.
    tokio::time::sleep(Duration::from_secs(2)).await;
    gate_tx.send_modify(|g| g.finished = true);
    for c in clients {
        let _ = c.await;
    }
    let mut dead = Vec::new();
    if !unfenced {
        wait_all_ready(&ctx, &nodes).await;
        let addrs: Vec<String> = nodes.iter().map(|n| n.proc().addr().to_string()).collect();
        drain(&ctx, &nodes, &addrs).await;
        dead = dead_letter_entries(&addrs[0], SUB)
            .await
            .unwrap_or_else(|e| ctx.fail(format!("listing dead letters: {e:#}")));
    }

    // etcd's history up to now.
    let now_rev = current_revision(&endpoints)
        .await
        .unwrap_or_else(|e| ctx.fail(format!("reading etcd's revision: {e:#}")));
    wait_until(
        Duration::from_secs(30),
        "the watch caught up with etcd",
        || async {
            let log = ctx.log();
            anyhow::ensure!(log.watch_gap.is_none(), "{:?}", log.watch_gap);
            let seen = log.changes.last().map_or(0, |c| c.revision);
            anyhow::ensure!(seen >= now_rev, "watched to {seen} of {now_rev}");
            Ok(())
        },
    )
    .await
    .unwrap_or_else(|e| ctx.fail(format!("{e:#}")));
    let _ = stop_watch.send(true);
    let _ = watcher.await;
    let _ = sampler.await;

    let log_ = ctx.log();
    if unfenced {
        let mut v = Vec::new();
        check_etcd_history(&log_.changes, &mut v);
        for f in &log_.faults {
            eprintln!("unfenced control fault: {}", f.what);
        }
        return v;
    }
    let Judgement {
        violations: v,
        hist,
        tally,
        activity,
    } = judge(&log_, &dead, rounds);
    let moves: usize = hist.moves.values().map(Vec::len).sum();
    eprintln!(
        "cluster crash loop: seed {seed}: {} publishes 201 ({} events), {} deliveries, {} acked, {} nacks, {} dead letters ({} poison), {} settings operations ({} compare-and-sets applied), {} task operations answered, {} etcd writes checked ({} against their writer's epoch), {moves} moves, {} duplicates ({} after a move; {:.1} per move, {:.1} per fault; by partition {:?}; by fault kind {:?}); faults by kind {:?}; unanswered {:?}",
        log_.created,
        log_.published.len(),
        log_.deliveries.len(),
        activity.acked,
        log_.nacked.len(),
        dead.len(),
        tally.poison_dead_lettered,
        log_.history.len(),
        activity.cas_applied,
        activity.task_answers,
        hist.writes_checked,
        hist.epochs_checked,
        tally.duplicates,
        tally.after_a_move,
        tally.duplicates as f64 / moves.max(1) as f64,
        tally.duplicates as f64 / log_.faults.len().max(1) as f64,
        tally.duplicates_by_partition,
        tally.duplicates_by_fault_kind,
        faults_by_kind(&log_.faults),
        log_.unanswered,
    );
    if !v.is_empty() {
        let n = v.len();
        // The first few of each kind (by rule).
        let mut kinds: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for x in v {
            let kind = x.split(':').next().unwrap_or_default().to_string();
            kinds.entry(kind).or_default().push(x);
        }
        let shown: Vec<String> = kinds
            .iter()
            .flat_map(|(kind, xs)| {
                std::iter::once(format!("-- {kind}: {}", xs.len()))
                    .chain(xs.iter().take(SHOWN / 4).cloned())
            })
            .collect();
        let dump = dump(&log_, &dead, seed);
        keep_logs(&nodes, seed);
        let faults: Vec<String> = log_
            .faults
            .iter()
            .map(|f| format!("{:?}..{:?} {}", f.start, f.end, f.what))
            .collect();
        drop(log_);
        ctx.fail(format!(
            "{n} violations:\n{}\nfaults:\n{}\neverything the clients were told and etcd's history: {dump}",
            shown.join("\n"),
            faults.join("\n")
        ));
    }
    Vec::new()
}

// ---------------------------------------------------------------------------------
// Positive controls: the oracle on made-up runs.

/// A made-up change in etcd's history: `value` at `key` (`None`: deleted) at
/// `revision`, reported by the watch at `at_ms`.
fn change(revision: i64, key: &str, value: Option<Value>, at_ms: u64) -> Change {
    Change {
        revision,
        key: key.to_string(),
        value: value.map(|v| v.to_string().into_bytes()),
        arrived: Duration::from_millis(at_ms),
    }
}

/// The made-up run's checkpoint key of partition 0.
fn made_up_checkpoint_key() -> String {
    format!("meshd/v1/checkpoints/{SUB}/1/{TOPIC}/0")
}

/// A made-up run that passes every rule and the floor (one fault): partition 0 of
/// TOPIC held by inst-0 (epoch 2), six events acked and checkpointed, inst-0 paused
/// past its lease, inst-1 taking over (epoch 6), a poison event dead-lettered by it,
/// one ack answered just before the pause delivered again by inst-1 (a duplicate the
/// pause explains), settings and task histories that are linearizable.
fn clean_run() -> (Log, Vec<Value>) {
    let ms = Duration::from_millis;
    let mut log = Log::default();
    let body = |id: &str| json!({"id": id, "type": "t", "source": "s"});
    let publish = |log: &mut Log, id: &str, offset: u64| {
        log.published.insert(
            id.to_string(),
            Published {
                body: body(id),
                outcome: Outcome::Created(0, offset),
            },
        );
        log.created += 1;
    };
    let deliver = |log: &mut Log, id: &str, offset: u64, attempt: u64, at: u64| {
        log.deliveries.push(Seen {
            sent: ms(at),
            recv: ms(at + 5),
            partition: 0,
            offset,
            attempt,
            event_id: id.to_string(),
            event: body(id),
        });
    };
    let settle = |log: &mut Log, offset: u64, attempt: u64, at: u64, list: &str| {
        let a = Answer {
            sent: ms(at),
            recv: ms(at + 5),
            partition: 0,
            offset,
            attempt,
            list: list.to_string(),
        };
        if list == "acked" {
            log.first_ack_sent.entry((0, offset)).or_insert(a.sent);
            log.ack_sends.entry((0, offset)).or_default().push(a.sent);
            log.acked.push(a);
        } else {
            log.nacked.push(a);
        }
    };
    for o in 0..6 {
        let id = format!("e{o}");
        publish(&mut log, &id, o);
        deliver(&mut log, &id, o, 1, 100);
    }
    for o in 0..5 {
        settle(&mut log, o, 1, 200, "acked");
    }
    // Acked 45 ms before the pause, after the last checkpoint: delivered again.
    settle(&mut log, 5, 1, 950, "acked");
    deliver(&mut log, "e5", 5, 2, 3100);
    settle(&mut log, 5, 2, 3200, "acked");
    publish(&mut log, "poison-1", 6);
    for (attempt, at) in [(1, 500), (2, 700), (3, 900), (4, 2650)] {
        deliver(&mut log, "poison-1", 6, attempt, at);
        let list = if attempt == MAX_ATTEMPTS {
            "dead_lettered"
        } else {
            "retrying"
        };
        settle(&mut log, 6, attempt, at + 6, list);
    }
    log.faults.push(Fault {
        kind: FAULT_KINDS[1],
        what: "SIGSTOP inst-0 for 2s".into(),
        start: ms(1000),
        end: ms(3000),
    });
    let owner = owner_key(TOPIC, 0);
    let checkpoint = made_up_checkpoint_key();
    let head = format!("meshd/v1/attempts/{SUB}/1/{TOPIC}/0");
    log.changes = vec![
        change(2, &owner, Some(json!({"instance": "inst-0"})), 50),
        change(
            3,
            &checkpoint,
            Some(json!({"v": 1, "committed": {"offset": 0, "epoch": 0, "at_ms": 1}})),
            60,
        ),
        change(4, &head, Some(json!({"v": 2, "layout": "records"})), 90),
        change(
            4,
            &format!("{head}/r/00000000000000000001"),
            Some(json!({"v": 2, "d": [[0, 1, 9], [1, 1, 9]], "e": 2, "i": "inst-0"})),
            90,
        ),
        change(
            5,
            &checkpoint,
            Some(
                json!({"v": 1, "committed": {"offset": 5, "epoch": 0, "at_ms": 2}, "owner_epoch": 2, "owner_instance": "inst-0"}),
            ),
            400,
        ),
        change(6, &owner, Some(json!({"instance": "inst-1"})), 2600),
        change(
            7,
            "meshd/v1/deadletters/entries/x",
            Some(json!({"topic": TOPIC, "partition": 0, "epoch": 6, "instance": "inst-1"})),
            2700,
        ),
        change(
            8,
            &checkpoint,
            Some(
                json!({"v": 1, "committed": {"offset": 7, "epoch": 0, "at_ms": 3}, "owner_epoch": 6, "owner_instance": "inst-1"}),
            ),
            3300,
        ),
    ];
    log.held = vec![(ms(20), 1), (ms(3290), 8)];
    let ns = |at: u64| at * 1_000_000;
    log.history = vec![
        Operation::answered(
            0,
            RegisterInput::Write(1),
            ns(1),
            ns(2),
            RegisterOutput::Written,
        ),
        Operation::answered(
            1,
            RegisterInput::Read,
            ns(3),
            ns(4),
            RegisterOutput::Read(Some(1)),
        ),
        Operation::answered(
            1,
            RegisterInput::Cas {
                expect: Some(1),
                new: 2,
            },
            ns(5),
            ns(6),
            RegisterOutput::Cas(true),
        ),
        Operation::answered(
            0,
            RegisterInput::Read,
            ns(7),
            ns(8),
            RegisterOutput::Read(Some(2)),
        ),
        Operation::answered(
            0,
            RegisterInput::Write(3),
            ns(9),
            ns(10),
            RegisterOutput::Written,
        ),
    ];
    let task = |input, at: u64, out| Operation::answered(2, input, ns(at), ns(at + 1), out);
    let t = || "task-0".to_string();
    log.tasks = vec![
        task(TaskCall::Submit(t()), 1, TaskAnswer::Done),
        task(
            TaskCall::Read(t()),
            3,
            TaskAnswer::Read(TaskState::Submitted),
        ),
        task(TaskCall::Claim(t()), 5, TaskAnswer::Done),
        task(TaskCall::Cancel(t()), 7, TaskAnswer::Done),
        task(
            TaskCall::Read(t()),
            9,
            TaskAnswer::Read(TaskState::Canceled),
        ),
    ];
    let dead = vec![
        json!({"partition": 0, "offset": 6, "attempts": MAX_ATTEMPTS, "event": body("poison-1")}),
    ];
    (log, dead)
}

/// An operation answered after everything in [`clean_run`] (by a fourth client).
fn late<I, O>(input: I, output: O) -> Operation<I, O> {
    Operation::answered(2, input, 20_000_000, 21_000_000, output)
}

/// The rules named in `found`, as "rule N" / "activity floor".
fn rules_named(found: &[String]) -> BTreeSet<String> {
    found
        .iter()
        .filter_map(|v| v.split(':').next().map(str::to_string))
        .collect()
}

#[test]
fn positive_control_the_cluster_oracle_passes_a_clean_run_and_explains_its_duplicate() {
    let (log, dead) = clean_run();
    let j = judge(&log, &dead, 1);
    assert!(j.violations.is_empty(), "{:#?}", j.violations);
    assert_eq!(j.tally.duplicates, 1);
    assert_eq!(
        j.tally.duplicates_by_fault_kind,
        BTreeMap::from([(FAULT_KINDS[1], 1)])
    );
    assert_eq!(
        j.hist.epochs_checked, 5,
        "record, head, 2 checkpoints, dead letter"
    );
    assert_eq!(j.activity.moves, 1);
}

/// Each rule broken on its own in the clean run: the oracle names that rule.
#[test]
fn positive_control_the_cluster_oracle_names_each_rule_a_made_up_run_breaks() {
    let ms = Duration::from_millis;
    type Break = Box<dyn Fn(&mut Log, &mut Vec<Value>)>;
    let seen = move |id: &str, offset, attempt, at: u64| Seen {
        sent: ms(at),
        recv: ms(at + 5),
        partition: 0,
        offset,
        attempt,
        event_id: id.to_string(),
        event: json!({"id": id, "type": "t", "source": "s"}),
    };
    let cases: Vec<(&str, &str, Break)> = vec![
        (
            "rule 1",
            "an event answered 201 that nobody ever saw",
            Box::new(move |log, _| {
                log.published.insert(
                    "lost".into(),
                    Published {
                        body: json!({"id": "lost"}),
                        outcome: Outcome::Created(1, 0),
                    },
                );
            }),
        ),
        (
            "rule 2",
            "a delivery of an event never published",
            Box::new(move |log, _| log.deliveries.push(seen("ghost", 40, 1, 100))),
        ),
        (
            "rule 3",
            "a delivery of an offset a checkpoint etcd already held covers",
            Box::new(move |log, _| log.deliveries.push(seen("e1", 1, 2, 3150))),
        ),
        (
            "rule 3",
            "a checkpoint covering an offset no ack named before it",
            Box::new(move |log, _| {
                log.ack_sends.remove(&(0, 3));
            }),
        ),
        (
            "rule 4",
            "one attempt handed out twice",
            Box::new(move |log, _| log.deliveries.push(seen("e2", 2, 1, 150))),
        ),
        (
            "rule 4",
            "a poison event that was not dead-lettered",
            Box::new(move |log, dead| {
                dead.clear();
                // Its nack answered dead_lettered is then rule 5's too.
                log.nacked.retain(|n| n.list != "dead_lettered");
            }),
        ),
        (
            "rule 5",
            "an event dead-lettered twice",
            Box::new(move |_, dead| {
                let again = dead[0].clone();
                dead.push(again);
            }),
        ),
        (
            "rule 5",
            "a delivery after dead_lettered",
            Box::new(move |log, _| log.deliveries.push(seen("poison-1", 6, 4, 2900))),
        ),
        (
            "rule 6",
            "the old owner's checkpoint during its successor's tenure",
            Box::new(move |log, _| {
                log.changes.push(change(
                    9,
                    &made_up_checkpoint_key(),
                    Some(
                        json!({"v": 1, "committed": {"offset": 7, "epoch": 0, "at_ms": 4}, "owner_epoch": 2, "owner_instance": "inst-0"}),
                    ),
                    3400,
                ));
            }),
        ),
        (
            "rule 6",
            "the old owner's attempt-ledger record during its successor's tenure",
            Box::new(move |log, _| {
                log.changes.push(change(
                    9,
                    &format!("meshd/v1/attempts/{SUB}/1/{TOPIC}/0/r/00000000000000000002"),
                    Some(json!({"v": 2, "d": [[7, 1, 9]], "e": 2, "i": "inst-0"})),
                    3400,
                ));
            }),
        ),
        (
            "rule 6",
            "a dead letter by an instance that did not own the partition",
            Box::new(move |log, _| {
                let c = log
                    .changes
                    .iter_mut()
                    .find(|c| c.key.starts_with("meshd/v1/deadletters/"))
                    .expect("the dead letter");
                *c = change(
                    c.revision,
                    &c.key,
                    Some(json!({"topic": TOPIC, "partition": 0, "epoch": 6, "instance": "inst-0"})),
                    2700,
                );
            }),
        ),
        (
            "rule 6",
            "a checkpoint in the right epoch naming another instance",
            Box::new(move |log, _| {
                let c = log
                    .changes
                    .iter_mut()
                    .find(|c| c.revision == 8)
                    .expect("the new owner's checkpoint");
                *c = change(
                    8,
                    &made_up_checkpoint_key(),
                    Some(
                        json!({"v": 1, "committed": {"offset": 7, "epoch": 0, "at_ms": 3}, "owner_epoch": 6, "owner_instance": "inst-0"}),
                    ),
                    3300,
                );
            }),
        ),
        (
            "rule 6",
            "a checkpoint going backwards",
            Box::new(move |log, _| {
                log.changes.push(change(
                    9,
                    &made_up_checkpoint_key(),
                    Some(
                        json!({"v": 1, "committed": {"offset": 6, "epoch": 0, "at_ms": 4}, "owner_epoch": 6, "owner_instance": "inst-1"}),
                    ),
                    3400,
                ));
            }),
        ),
        (
            "rule 7",
            "a duplicate of an ack answered long after every fault's window",
            Box::new(move |log, _| {
                log.published.insert(
                    "late".into(),
                    Published {
                        body: json!({"id": "late", "type": "t", "source": "s"}),
                        outcome: Outcome::Created(0, 7),
                    },
                );
                log.deliveries.push(seen("late", 7, 1, 9000));
                log.acked.push(Answer {
                    sent: ms(9100),
                    recv: ms(9105),
                    partition: 0,
                    offset: 7,
                    attempt: 1,
                    list: "acked".into(),
                });
                log.deliveries.push(seen("late", 7, 2, 9500));
            }),
        ),
        (
            "rule 7",
            "a duplicate of an ack answered before the fault's window",
            Box::new(move |log, _| {
                // The pause began 1 000 ms after o5's ack was answered at 955 ms,
                // more than a checkpoint interval plus slack.
                log.faults[0].start = Duration::from_millis(1700);
            }),
        ),
        (
            "rule 8",
            "a compare-and-set applied against a value the register never held",
            Box::new(move |log, _| {
                log.history.push(late(
                    RegisterInput::Cas {
                        expect: Some(9),
                        new: 4,
                    },
                    RegisterOutput::Cas(true),
                ));
            }),
        ),
        (
            "rule 8",
            "a settings read of a value nobody wrote",
            Box::new(move |log, _| {
                log.history
                    .push(late(RegisterInput::Read, RegisterOutput::Read(Some(77))));
            }),
        ),
        (
            "rule 8",
            "a settings read of the value of a compare-and-set answered 412",
            Box::new(move |log, _| {
                log.history.push(late(
                    RegisterInput::Cas {
                        expect: Some(1),
                        new: 55,
                    },
                    RegisterOutput::Cas(false),
                ));
                log.history.push(Operation::answered(
                    2,
                    RegisterInput::Read,
                    22_000_000,
                    23_000_000,
                    RegisterOutput::Read(Some(55)),
                ));
            }),
        ),
        (
            "rule 8",
            "a claim of a canceled task answered as done",
            Box::new(move |log, _| {
                log.tasks
                    .push(late(TaskCall::Claim("task-0".into()), TaskAnswer::Done));
            }),
        ),
        (
            "rule 8",
            "a submit answered as created twice",
            Box::new(move |log, _| {
                log.tasks
                    .push(late(TaskCall::Submit("task-0".into()), TaskAnswer::Done));
            }),
        ),
    ];
    for (rule, what, break_it) in cases {
        let (mut log, mut dead) = clean_run();
        break_it(&mut log, &mut dead);
        let found = judge(&log, &dead, 1).violations;
        assert!(
            rules_named(&found).contains(rule),
            "{what}: {rule} not named: {found:#?}"
        );
    }
}

/// The floor: a run with too little of anything fails, however clean.
#[test]
fn positive_control_the_cluster_oracle_fails_a_run_below_its_activity_floor() {
    let (log, dead) = clean_run();
    let found = judge(&log, &dead, 2).violations;
    assert!(rules_named(&found).contains("activity floor"), "{found:#?}");
    let (mut log, dead) = clean_run();
    log.changes
        .retain(|c| !(c.key == owner_key(TOPIC, 0) && c.revision == 6));
    let found = judge(&log, &dead, 1).violations;
    assert!(
        found
            .iter()
            .any(|v| v.starts_with("activity floor") && v.contains("0 partition moves")),
        "no move: {found:#?}"
    );
}
