//! The crash loop: clients publish, pull, ack, nack and drop deliveries
//! while the real `meshd` binary is SIGKILLed at random moments and restarted on the
//! same data dir, many times in a row. Afterwards the consumers drain the subscription
//! and an oracle checks what meshd did against a log of everything the clients were
//! told (with the generation of the process that told them and client-side times):
//!
//! 1. every event answered 201 was delivered (at least once over the run) or is in the
//!    dead-letter store;
//! 2. nothing appears that was never published: every delivered or dead-lettered event
//!    was answered 201 or its publish had an unknown outcome, it is exactly what was
//!    published, and it is stored once: it sits at one (partition, offset), the one its
//!    201 answer named, also when its publish was sent again after an unknown outcome
//!    (publishes deduplicate by `source` and `id` within the topic's window, see
//!    below). The one exemption is the contract's: an event whose sends span more than
//!    the dedup window less [`DEDUP_MARGIN`] (from its first send to the kill of the
//!    last process it was sent to) may sit at more positions; the report counts such
//!    events (none in a run of the default size, which lasts seconds, not minutes);
//! 3. the committed offset of a partition never goes backwards across the observed
//!    reads (and no read shows a reset epoch); after the drain it is at the log's end;
//! 4. attempt counts never go backwards: per (partition, offset) no attempt is handed
//!    out twice, a delivery that certainly came after another has a higher attempt,
//!    no attempt exceeds `max_attempts`, and a dead letter carries `max_attempts`;
//! 5. no event is in the dead-letter store twice (by partition and offset, or by id);
//! 6. an offset whose ack was answered `acked` comes back (redelivered, or dead-lettered
//!    later) only if that ack was answered less than one flush interval before the
//!    kill that ended its process **and** a power cut came at or after that kill: the
//!    contract's one window for a lost ack; a SIGKILL alone keeps every ack (the page
//!    cache keeps RocksDB's write-ahead log), so no lost ack is allowed there;
//! 7. nack answers agree with the attempt counts (`retrying` below `max_attempts`,
//!    `dead_lettered`/`dead_lettering` at it), and an offset answered `dead_lettered`
//!    is in the dead-letter store and never handed out again;
//! 8. gap-free: every offset below a committed offset that was read was named in an
//!    ack request or dead-lettered, and was delivered before that read was answered.
//!
//! A run must also clear an activity floor ([`ACKS_PER_ROUND`] acks answered `acked`
//! and as many 201s per round), or it fails: a run where every pull answered 503 proves
//! nothing. Publishes that fail (no answer, 5xx, 429) are sent again with the same
//! events until answered 201. The topic keeps the default dedup window
//! ([`DEDUP_WINDOW`], 2 minutes): a retry inside it is answered with the stored
//! event's position (`"duplicate": true`) and stores nothing, across restarts and power
//! cuts too (the dedup record is written in the same RocksDB batch as its events, so
//! a power cut keeps both or neither), so rule 2 holds retried events to one position.
//!
//! meshd's data dir is on the lazy filesystem (`meshd_test_support::lazyfs`): a seeded
//! third of the kills is followed by a power cut that drops every write the process
//! left unsynced (or keeps a torn prefix of it), so rules 1, 3, 4 and 6 are checked
//! against what a disk keeps, not what the page cache keeps.
//!
//! "Certainly came after" is decided without trusting thread timing: a request sent
//! to a later process generation, or sent after the other one's answer arrived. Two
//! overlapping requests are never ordered by the oracle.
//!
//! Every round the clients run for a seeded time, then meshd is SIGKILLed with
//! requests in flight and restarted; now and then the restarted process is killed
//! again during its recovery, before any client talks to it. A SIGKILL keeps the page
//! cache, so an ack written to RocksDB's write-ahead log survives it: rule 6's window
//! (a power cut's) is expected to stay unused here, and the report counts its uses.
//! The second test runs the oracle on made-up logs, so a green crash loop means the
//! rules were checked.
//!
//! Reproducing: the seed (printed at the start and in every failure) fixes the
//! schedule, that is every choice the clients make (batch sizes, pull sizes and waits,
//! ack, nack, drop or hold per delivery, pauses) and every round's length, so where the
//! kills land. Thread, I/O and process timing are not fixed: a rerun with the same seed
//! makes the same choices, but what each choice meets is not bit-identical.
//!
//! `MESHD_CRASH_SEED` (decimal or `0x` hex) picks the seed, otherwise it comes from
//! the clock; `MESHD_CRASH_ROUNDS` the number of kills (default 10, the CI run, about
//! 10 s). Long runs go through `cargo test`, which has no time limit (nextest ends a
//! test after 5 minutes):
//! `MESHD_CRASH_ROUNDS=1000 cargo test -p meshd --test crash_loop -- --nocapture`
//! (docs/crash-loop.md records runs and their seeds).

mod common;

use common::oracle::{dead_letter_entries, expect, placed_ids, seed_from, Failure};
use common::*;
use meshd_client::Pull;
use meshd_stores::topics::DEFAULT_DEDUP_WINDOW_MS;
use meshd_test_support::lazyfs::{LazyFs, Torn};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::rng::Rng;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::watch;

const TOPIC: &str = "t";
const SUB: &str = "s";
const PARTITIONS: u64 = 3;
/// Passed to meshd as `--delivery-flush-ms`: rule 6's window.
const FLUSH: Duration = Duration::from_millis(50);
const MAX_ATTEMPTS: u64 = 4;
/// The topic's publish dedup window: the default (the topic is created without one;
/// the test checks the topic answers no other). Rule 2 is strict for every event whose
/// sends fall inside it.
const DEDUP_WINDOW: Duration = Duration::from_millis(DEFAULT_DEDUP_WINDOW_MS);
/// Rule 2 holds an event's sends inside the window when they span at most the window
/// less this margin: a kill's time is taken just before the SIGKILL lands, and meshd
/// stamps its dedup records with its own clock, not the test's.
const DEDUP_MARGIN: Duration = Duration::from_secs(1);
/// Short, so dropped and held deliveries come back (and reach the dead-letter store)
/// within a round; long enough for a pull-then-ack on a loaded debug build.
const ACK_TIMEOUT_MS: u64 = 300;
const PUBLISHERS: usize = 2;
const CONSUMERS: usize = 3;
const DEFAULT_ROUNDS: u32 = 10;
/// The activity floor: a run with fewer acks answered `acked` (or fewer 201
/// publishes) than this per round did too little to prove anything, and fails.
const ACKS_PER_ROUND: usize = 5;
/// How long the clients run before a kill (milliseconds, drawn per round). Short
/// rounds kill meshd soon after its recovery.
const ROUND_MS: (u64, u64) = (50, 1500);
/// The final drain: every 201'd event delivered or dead-lettered, every partition
/// committed to its end. Liveness only: generous for a debug build on 2 cores.
const DRAIN: Duration = Duration::from_secs(60);
const READY: Duration = Duration::from_secs(30);
/// At most this many violations are printed.
const SHOWN: usize = 40;

fn seed() -> u64 {
    seed_from("MESHD_CRASH_SEED")
}

fn rounds() -> u32 {
    match std::env::var("MESHD_CRASH_ROUNDS") {
        Ok(s) => s
            .trim()
            .parse()
            .ok()
            .filter(|n| *n >= 1)
            .unwrap_or_else(|| panic!("MESHD_CRASH_ROUNDS={s:?} is not a number >= 1")),
        Err(_) => DEFAULT_ROUNDS,
    }
}

/// Where the clients may send requests: generation `gen` of meshd (the process the
/// clients talk to after `gen` kills; one killed during its recovery is not counted)
/// at `addr`, `None` while it is being killed and restarted.
#[derive(Clone, Debug)]
struct Gate {
    gen: u32,
    addr: Option<String>,
    finished: bool,
}

/// What a publish was answered.
#[derive(Clone, Debug, PartialEq)]
enum Outcome {
    /// Sent, no answer yet (a consumer may see the event before its publisher does).
    InFlight,
    /// 201 at this (partition, offset).
    Created(u64, u64),
    /// No answer, or an error answer: meshd may or may not have stored it.
    Unknown(String),
}

struct Published {
    body: Value,
    outcome: Outcome,
    /// Sends whose outcome stayed unknown (each may have stored the event; the dedup
    /// window keeps a retry from storing it again).
    unknown_sends: u32,
    /// When its first send went out: no copy of it can have been stored earlier.
    first_sent: Duration,
    /// The generation its last send went to: no send of it can take effect after
    /// that generation's kill (`Log::kills`).
    last_gen: u32,
}

impl Published {
    /// How long after its first send a send of it may still have stored it: until the
    /// kill of the last generation it was sent to (`None` when that one was not
    /// killed: no bound).
    fn send_span(&self, kills: &[Duration]) -> Option<Duration> {
        kills
            .get(self.last_gen as usize)
            .map(|kill| kill.saturating_sub(self.first_sent))
    }
}

/// One delivery a pull answered, with the generation it was sent to and when it was
/// sent and answered (time since the start of the test).
#[derive(Clone, Debug)]
struct Seen {
    gen: u32,
    sent: Duration,
    recv: Duration,
    partition: u64,
    offset: u64,
    attempt: u64,
    event_id: String,
    event: Value,
}

impl Seen {
    /// `self` certainly happened before `later`: an earlier process, or answered
    /// before `later` was sent.
    fn before(&self, later_gen: u32, later_sent: Duration) -> bool {
        self.gen < later_gen || (self.gen == later_gen && self.recv <= later_sent)
    }
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "(p{} o{} attempt {} event {}, generation {}, pulled {:?}..{:?})",
            self.partition,
            self.offset,
            self.attempt,
            self.event_id,
            self.gen,
            self.sent,
            self.recv
        )
    }
}

/// An ack answered `acked` or a nack answer, for the delivery it named.
#[derive(Clone, Debug)]
struct Answer {
    gen: u32,
    sent: Duration,
    recv: Duration,
    partition: u64,
    offset: u64,
    attempt: u64,
    list: String,
    /// The generation that handed the delivery out (below `gen`: answered after a
    /// restart).
    delivered_gen: u32,
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} for p{} o{} attempt {} (generation {}, sent {:?}, answered {:?})",
            self.list, self.partition, self.offset, self.attempt, self.gen, self.sent, self.recv
        )
    }
}

/// One `GET .../offsets`: partition -> (committed, epoch).
#[derive(Clone, Debug)]
struct CommittedRead {
    gen: u32,
    sent: Duration,
    recv: Duration,
    values: BTreeMap<u64, (u64, u64)>,
}

/// Everything the clients were told.
#[derive(Default)]
struct Log {
    published: BTreeMap<String, Published>,
    publishes_created: usize,
    deliveries: Vec<Seen>,
    /// Delivery id (its JSON text) -> index in `deliveries`.
    by_delivery_id: HashMap<String, usize>,
    acked: Vec<Answer>,
    nacked: Vec<Answer>,
    ack_lists: BTreeMap<String, usize>,
    committed: Vec<CommittedRead>,
    /// `kills[g]`: when generation `g` was SIGKILLed.
    kills: Vec<Duration>,
    /// `cuts[g]`: whether the kill of generation `g` was followed by a power cut.
    cuts: Vec<bool>,
    cut_reports: Vec<meshd_test_support::lazyfs::CutReport>,
    /// (partition, offset) of every delivery named in an ack request (answered or
    /// not: an ack without an answer may have been applied).
    ack_sent: BTreeSet<(u64, u64)>,
    /// Kills of a restarted process before it was ready (no client saw it).
    recovery_kills: usize,
    /// Requests without an answer, and 5xx/429 answers, by request kind.
    unanswered: BTreeMap<String, usize>,
    /// Answers that break the contract on their own (shape, a 4xx to a valid request).
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

    fn rerun(&self) -> String {
        format!(
            "MESHD_CRASH_SEED={} MESHD_CRASH_ROUNDS={} cargo test -p meshd --test crash_loop -- --nocapture",
            self.seed, self.rounds
        )
    }

    fn fail(&self, msg: impl fmt::Display) -> ! {
        panic!(
            "{msg}\n(seed {}, {} rounds; rerun: {})",
            self.seed,
            self.rounds,
            self.rerun()
        )
    }

    /// Records a request that did not get its expected answer.
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

/// The clients' wait for an open gate; `None` once the run is over.
async fn open(gate: &mut watch::Receiver<Gate>) -> Option<(u32, String)> {
    loop {
        let g = gate.borrow_and_update().clone();
        if g.finished {
            return None;
        }
        if let Some(a) = g.addr {
            return Some((g.gen, a));
        }
        if gate.changed().await.is_err() {
            return None;
        }
    }
}

/// After a failed request: no answer means the process is (being) killed, so wait for
/// the next generation; after an error answer back off briefly and go on.
async fn after_failure(gate: &mut watch::Receiver<Gate>, gen: u32, f: &Failure) {
    match f {
        Failure::Transport(_) => {
            let _ = gate.wait_for(|g| g.finished || g.gen != gen).await;
        }
        _ => tokio::time::sleep(Duration::from_millis(20)).await,
    }
}

fn id_of(event: &Value) -> String {
    event["id"].as_str().unwrap_or_default().to_string()
}

/// Publishes `events` (one in structured mode, more as a batch) and records the
/// outcome of each.
async fn publish_and_record(ctx: &Ctx, a: &str, gen: u32, events: &[Value]) -> Result<(), Failure> {
    {
        let mut log = ctx.log();
        let now = ctx.now();
        for e in events {
            let (unknown_sends, first_sent) = log
                .published
                .get(&id_of(e))
                .map_or((0, now), |p| (p.unknown_sends, p.first_sent));
            log.published.insert(
                id_of(e),
                Published {
                    body: e.clone(),
                    outcome: Outcome::InFlight,
                    unknown_sends,
                    first_sent,
                    last_gen: gen,
                },
            );
        }
    }
    // One event in structured mode, more as a batch.
    let r = match events {
        [one] => client(a).publish_event_answer(TOPIC, one).await,
        _ => client(a).publish_answer(TOPIC, events).await,
    };
    let placed = expect(r, 201).and_then(|answer| {
        let placed: Option<Vec<(String, u64, u64)>> = answer["events"].as_array().map(|list| {
            list.iter()
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
            Some(placed)
                if placed.len() == events.len()
                    && placed.iter().zip(events).all(|(p, e)| p.0 == id_of(e)) =>
            {
                Ok(placed)
            }
            _ => Err(Failure::Malformed(format!(
                "publish of {:?} answered {answer}",
                events.iter().map(id_of).collect::<Vec<_>>()
            ))),
        }
    });
    match placed {
        Ok(placed) => {
            let mut log = ctx.log();
            log.publishes_created += 1;
            for (id, partition, offset) in placed {
                if let Some(p) = log.published.get_mut(&id) {
                    p.outcome = Outcome::Created(partition, offset);
                }
            }
            Ok(())
        }
        Err(f) => {
            ctx.note("publish", &f);
            let mut log = ctx.log();
            for e in events {
                if let Some(p) = log.published.get_mut(&id_of(e)) {
                    p.outcome = Outcome::Unknown(f.to_string());
                    p.unknown_sends += 1;
                }
            }
            Err(f)
        }
    }
}

/// One pull; records every delivery and returns their ids (to send back as received).
async fn pull_and_record(
    ctx: &Ctx,
    a: &str,
    gen: u32,
    max_events: u64,
    wait_ms: u64,
) -> Result<Vec<Value>, Failure> {
    let sent = ctx.now();
    let pull = Pull {
        max_events: Some(max_events),
        wait_ms: Some(wait_ms),
        ..Pull::default()
    };
    let r = client(a).pull_answer(SUB, &pull).await;
    let answer = expect(r, 200);
    let recv = ctx.now();
    let answer = answer.inspect_err(|f| ctx.note("pull", f))?;
    let Some(list) = answer["deliveries"].as_array() else {
        let f = Failure::Malformed(format!("pull answered {answer}"));
        ctx.note("pull", &f);
        return Err(f);
    };
    let mut log = ctx.log();
    let mut ids = Vec::with_capacity(list.len());
    for d in list {
        let parsed = (|| {
            Some(Seen {
                gen,
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
                log.deliveries.push(seen);
                log.by_delivery_id.insert(key, i);
                ids.push(d["delivery_id"].clone());
            }
            _ => log.problems.push(format!("malformed delivery {d}")),
        }
    }
    Ok(ids)
}

/// Acks (`verb` "ack") or nacks `ids` and records the answer for each.
async fn settle_and_record(
    ctx: &Ctx,
    a: &str,
    gen: u32,
    verb: &str,
    ids: Vec<Value>,
) -> Result<(), Failure> {
    // Sent as received: every id recorded is text (pull_and_record).
    let texts: Vec<String> = ids
        .iter()
        .map(|id| id.as_str().unwrap_or_default().to_string())
        .collect();
    if verb == "ack" {
        let mut log = ctx.log();
        for id in &ids {
            if let Some(d) = log
                .by_delivery_id
                .get(&id.to_string())
                .map(|i| &log.deliveries[*i])
            {
                let at = (d.partition, d.offset);
                log.ack_sent.insert(at);
            }
        }
    }
    let sent = ctx.now();
    let r = if verb == "ack" {
        client(a).ack_answer(SUB, &texts).await
    } else {
        client(a).nack_answer(SUB, &texts, "crash loop nack").await
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
            gen,
            sent,
            recv,
            partition: d.partition,
            offset: d.offset,
            attempt: d.attempt,
            list: list.clone(),
            delivered_gen: d.gen,
        };
        if verb == "ack" {
            *log.ack_lists.entry(list.clone()).or_default() += 1;
            if list == "acked" {
                log.acked.push(answer);
            }
        } else {
            log.nacked.push(answer);
        }
    }
    Ok(())
}

/// Reads the committed offsets into the log.
async fn read_committed(ctx: &Ctx, a: &str, gen: u32) -> Result<(), Failure> {
    let sent = ctx.now();
    let r = client(a).offsets_answer(SUB).await;
    let answer = expect(r, 200);
    let recv = ctx.now();
    let parsed = answer.and_then(|answer| {
        let values: Option<BTreeMap<u64, (u64, u64)>> =
            answer["offsets"].as_array().and_then(|list| {
                list.iter()
                    .map(|o| {
                        Some((
                            o["partition"].as_u64()?,
                            (o["committed"].as_u64()?, o["epoch"].as_u64()?),
                        ))
                    })
                    .collect()
            });
        values.ok_or_else(|| Failure::Malformed(format!("offsets answered {answer}")))
    });
    match parsed {
        Ok(values) => {
            ctx.log().committed.push(CommittedRead {
                gen,
                sent,
                recv,
                values,
            });
            Ok(())
        }
        Err(f) => {
            ctx.note("offsets", &f);
            Err(f)
        }
    }
}

async fn publisher(n: usize, mut rng: Rng, mut gate: watch::Receiver<Gate>, ctx: Arc<Ctx>) {
    let mut next = 0u64;
    while let Some((gen, a)) = open(&mut gate).await {
        let size = if rng.range(0, 1) == 0 {
            1
        } else {
            rng.range(2, 8)
        };
        let events: Vec<Value> = (0..size)
            .map(|_| {
                next += 1;
                event(&format!("p{n}-{next}"))
            })
            .collect();
        // A publish that failed (no answer, 5xx, 429) is sent again, as a client
        // that must not lose it would, until it is answered 201 or the run ends.
        let (mut gen, mut a) = (gen, a);
        while let Err(f) = publish_and_record(&ctx, &a, gen, &events).await {
            after_failure(&mut gate, gen, &f).await;
            match open(&mut gate).await {
                Some(next) => (gen, a) = next,
                None => break,
            }
        }
        // Pacing, so the consumers keep up and the drain stays short.
        tokio::time::sleep(Duration::from_millis(rng.range(0, 25))).await;
    }
}

/// Pulls and, per delivery, acks (55%), nacks (15%), drops it so its lease runs out
/// (15%) or holds it for up to two ack timeouts and then acks or nacks it (15%):
/// a late answer may find its lease ended (still current until the next hand-out) or
/// the process killed and restarted (a recovered delivery keeps its id).
async fn consumer(mut rng: Rng, mut gate: watch::Receiver<Gate>, ctx: Arc<Ctx>) {
    // (when to answer, "ack" or "nack", delivery id)
    let mut held: Vec<(Instant, &str, Value)> = Vec::new();
    while let Some((gen, a)) = open(&mut gate).await {
        let (max, wait) = (rng.range(1, 16), rng.range(0, 400));
        let got = match pull_and_record(&ctx, &a, gen, max, wait).await {
            Ok(got) => got,
            Err(f) => {
                after_failure(&mut gate, gen, &f).await;
                continue;
            }
        };
        let (mut acks, mut nacks) = (Vec::new(), Vec::new());
        for id in got {
            match rng.range(0, 99) {
                0..=54 => acks.push(id),
                55..=69 => nacks.push(id),
                70..=84 => {}
                roll => {
                    let later = Duration::from_millis(rng.range(0, 2 * ACK_TIMEOUT_MS));
                    let verb = if roll < 95 { "ack" } else { "nack" };
                    held.push((Instant::now() + later, verb, id));
                }
            }
        }
        let now = Instant::now();
        for (_, verb, id) in held.extract_if(.., |(due, _, _)| *due <= now) {
            match verb {
                "ack" => acks.push(id),
                _ => nacks.push(id),
            }
        }
        let mut turns = [("ack", acks), ("nack", nacks)];
        if rng.range(0, 1) == 0 {
            turns.reverse();
        }
        for (verb, ids) in turns {
            if ids.is_empty() {
                continue;
            }
            if let Err(f) = settle_and_record(&ctx, &a, gen, verb, ids).await {
                after_failure(&mut gate, gen, &f).await;
                break;
            }
        }
    }
}

/// Reads the committed offsets now and then, so their sequence is observed inside
/// rounds as well as around the kills.
async fn offset_watcher(mut rng: Rng, mut gate: watch::Receiver<Gate>, ctx: Arc<Ctx>) {
    while let Some((gen, a)) = open(&mut gate).await {
        if let Err(f) = read_committed(&ctx, &a, gen).await {
            after_failure(&mut gate, gen, &f).await;
            continue;
        }
        tokio::time::sleep(Duration::from_millis(rng.range(20, 120))).await;
    }
}

async fn wait_ready(a: &str) -> anyhow::Result<()> {
    wait_until(READY, &format!("/readyz 200 on {a}"), || async move {
        anyhow::ensure!(client(a).ready().await?, "readyz answered 503");
        Ok(())
    })
    .await
}

async fn end_offsets_now(a: &str) -> anyhow::Result<Vec<u64>> {
    let r = answered(client(a).topic_answer(TOPIC).await, 200, "topic")?;
    let t: Value = r.json()?;
    t["end_offsets"]
        .as_array()
        .and_then(|l| l.iter().map(Value::as_u64).collect())
        .ok_or_else(|| anyhow::anyhow!("topic answer without end_offsets: {t}"))
}

/// What the drain still waits for, or `None` when done: a 201'd event neither delivered
/// nor dead-lettered, or a partition whose committed offset is below its end.
async fn shortfall(ctx: &Ctx, a: &str) -> anyhow::Result<Option<String>> {
    let dead = dead_letter_entries(a, SUB).await?;
    let ends = end_offsets_now(a).await?;
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
        "{} 201'd events neither delivered nor dead-lettered (first: {:?}); {behind:?}; offsets {offsets:?}, ends {ends:?}",
        missing.len(),
        missing.iter().take(10).collect::<Vec<_>>()
    )))
}

/// Pulls and acks everything until the drain is done (see [`shortfall`]); fails with
/// the last shortfall after [`DRAIN`].
async fn drain(ctx: &Ctx, a: &str, gen: u32) {
    let start = Instant::now();
    let mut last = String::from("nothing checked yet");
    loop {
        if start.elapsed() > DRAIN {
            ctx.fail(format!("the drain did not finish within {DRAIN:?}: {last}"));
        }
        match pull_and_record(ctx, a, gen, 100, 250).await {
            Ok(ids) if !ids.is_empty() => {
                if let Err(f) = settle_and_record(ctx, a, gen, "ack", ids).await {
                    last = format!("ack failed: {f}");
                }
                continue;
            }
            Ok(_) => {}
            Err(f) => {
                last = format!("pull failed: {f}");
                // No kills now: an error answer is retried after a short pause.
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

/// Counts for the report.
#[derive(Default, Debug)]
struct Tally {
    lost_acks_allowed: usize,
    /// Events sent more than once, all of whose sends fell inside the dedup window
    /// (held to one position), and those whose did not (rule 2's exemption).
    retried_inside_window: usize,
    retried_outside_window: usize,
    /// The longest send span of a retried event (see [`Published::send_span`]).
    longest_retry_span: Duration,
}

/// The oracle: every violation of rules 1-7 (see the module doc) in `log`, given the
/// final dead-letter listing.
fn violations(log: &Log, dead: &[Value], tally: &mut Tally) -> Vec<String> {
    let mut v: Vec<String> = log
        .problems
        .iter()
        .map(|p| format!("answer breaks the contract: {p}"))
        .collect();
    let created: BTreeMap<&str, (u64, u64)> = log
        .published
        .iter()
        .filter_map(|(id, p)| match p.outcome {
            Outcome::Created(partition, offset) => Some((id.as_str(), (partition, offset))),
            _ => None,
        })
        .collect();
    // Where each event was seen: deliveries and dead letters.
    let mut seen_at: BTreeMap<&str, BTreeSet<(u64, u64)>> = BTreeMap::new();

    // Rule 2: deliveries are of published events, exactly as published.
    for d in &log.deliveries {
        seen_at
            .entry(d.event_id.as_str())
            .or_default()
            .insert((d.partition, d.offset));
        match log.published.get(&d.event_id) {
            None => v.push(format!("rule 2: delivery {d} of an event never published")),
            Some(p) if p.body != d.event => v.push(format!(
                "rule 2: delivery {d} differs from what was published: {} vs {}",
                d.event, p.body
            )),
            Some(_) => {}
        }
    }

    // Rule 5 (and the dead letters' side of rules 2 and 4).
    let mut dead_at: BTreeMap<(u64, u64), u64> = BTreeMap::new();
    let mut dead_ids: BTreeSet<String> = BTreeSet::new();
    for e in dead {
        let (Some(partition), Some(offset), Some(attempts), Some(id)) = (
            e["partition"].as_u64(),
            e["offset"].as_u64(),
            e["attempts"].as_u64(),
            e["event"]["id"].as_str(),
        ) else {
            v.push(format!(
                "dead-letter entry without partition, offset, attempts or event id: {e}"
            ));
            continue;
        };
        if e["subscription"] != SUB || e["topic"] != TOPIC || e["state"] != "dead" {
            v.push(format!(
                "dead-letter entry of another subscription, topic or state: {e}"
            ));
        }
        if dead_at.insert((partition, offset), attempts).is_some() {
            v.push(format!(
                "rule 5: p{partition} o{offset} is in the dead-letter store twice"
            ));
        }
        if !dead_ids.insert(id.to_string()) {
            v.push(format!(
                "rule 5: event {id} is in the dead-letter store twice"
            ));
        }
        seen_at.entry(id).or_default().insert((partition, offset));
        match log.published.get(id) {
            None => v.push(format!("rule 2: dead letter p{partition} o{offset} of event {id}, never published")),
            Some(p) if p.body != e["event"] => v.push(format!(
                "rule 2: dead letter p{partition} o{offset} differs from what was published: {} vs {}",
                e["event"], p.body
            )),
            Some(_) => {}
        }
        if attempts != MAX_ATTEMPTS {
            v.push(format!(
                "rule 4: dead letter p{partition} o{offset} has attempts {attempts}, not max_attempts {MAX_ATTEMPTS}"
            ));
        }
    }

    // Rule 2: one position per event, the one its 201 answer named. An event sent
    // once is stored at most once; one sent again after an unknown outcome is stored
    // once too (publish dedup), unless its sends spanned more than the dedup window
    // (less the margin).
    let mut outside_window: BTreeSet<&str> = BTreeSet::new();
    for (id, p) in &log.published {
        if p.unknown_sends == 0 {
            continue;
        }
        match p.send_span(&log.kills) {
            Some(span) if span + DEDUP_MARGIN <= DEDUP_WINDOW => {
                tally.retried_inside_window += 1;
                tally.longest_retry_span = tally.longest_retry_span.max(span);
            }
            span => {
                tally.retried_outside_window += 1;
                if let Some(span) = span {
                    tally.longest_retry_span = tally.longest_retry_span.max(span);
                }
                outside_window.insert(id.as_str());
            }
        }
    }
    for (id, at) in &seen_at {
        if at.len() > 1 && !outside_window.contains(id) {
            let sends = log.published.get(*id).map(|p| {
                format!(
                    "{} sends without an answer, the first at {:?}, the last to generation {}",
                    p.unknown_sends, p.first_sent, p.last_gen
                )
            });
            v.push(format!(
                "rule 2: event {id} stored at several positions {at:?} ({}; dedup window {DEDUP_WINDOW:?})",
                sends.unwrap_or_else(|| "never published".into())
            ));
        }
        if let Some(placed) = created.get(id) {
            if !at.contains(placed) {
                v.push(format!(
                    "rule 2: event {id} was answered 201 at {placed:?} but seen at {at:?}"
                ));
            }
        }
    }

    // Rule 1: every 201'd event was delivered or dead-lettered.
    let missing: Vec<&&str> = created
        .keys()
        .filter(|id| !seen_at.contains_key(**id))
        .collect();
    if !missing.is_empty() {
        v.push(format!(
            "rule 1: {} events answered 201 were neither delivered nor dead-lettered: {:?}",
            missing.len(),
            missing.iter().take(20).collect::<Vec<_>>()
        ));
    }

    // Rule 3: committed offsets never go backwards between reads that are certainly
    // ordered; no read shows a reset.
    for (i, x) in log.committed.iter().enumerate() {
        for (p, (_, epoch)) in &x.values {
            if *epoch != 0 {
                v.push(format!(
                    "rule 3: partition {p} shows epoch {epoch} without a reset ({x:?})"
                ));
            }
            for y in &log.committed[i + 1..] {
                let (first, second) = if x.gen < y.gen || (x.gen == y.gen && x.recv <= y.sent) {
                    (x, y)
                } else if y.gen < x.gen || (y.gen == x.gen && y.recv <= x.sent) {
                    (y, x)
                } else {
                    continue;
                };
                let (a, b) = (first.values.get(p), second.values.get(p));
                if let (Some((a, _)), Some((b, _))) = (a, b) {
                    if b < a {
                        v.push(format!(
                            "rule 3: partition {p} committed went back from {a} (generation {}, read {:?}) to {b} (generation {}, read {:?})",
                            first.gen, first.recv, second.gen, second.recv
                        ));
                    }
                }
            }
        }
    }

    // Rule 4: attempt counts never go backwards.
    let mut by_offset: BTreeMap<(u64, u64), Vec<&Seen>> = BTreeMap::new();
    for d in &log.deliveries {
        by_offset
            .entry((d.partition, d.offset))
            .or_default()
            .push(d);
    }
    for (loc, ds) in &by_offset {
        for (i, x) in ds.iter().enumerate() {
            if x.attempt == 0 || x.attempt > MAX_ATTEMPTS {
                v.push(format!(
                    "rule 4: delivery {x} has an attempt outside 1..={MAX_ATTEMPTS}"
                ));
            }
            for y in &ds[i + 1..] {
                if x.attempt == y.attempt {
                    v.push(format!("rule 4: attempt handed out twice: {x} and {y}"));
                } else if x.before(y.gen, y.sent) && y.attempt < x.attempt {
                    v.push(format!("rule 4: attempt went back: {x}, then {y}"));
                } else if y.before(x.gen, x.sent) && x.attempt < y.attempt {
                    v.push(format!("rule 4: attempt went back: {y}, then {x}"));
                }
            }
        }
        if let Some(attempts) = dead_at.get(loc) {
            let highest = ds.iter().map(|d| d.attempt).max().unwrap_or(0);
            if *attempts < highest {
                v.push(format!(
                    "rule 4: dead letter p{} o{} has attempts {attempts} below delivered attempt {highest}",
                    loc.0, loc.1
                ));
            }
        }
    }

    // Rule 6: an acked offset comes back only after a kill that followed its ack
    // within one flush interval.
    for a in &log.acked {
        let later: Vec<&&Seen> = by_offset
            .get(&(a.partition, a.offset))
            .map(|ds| ds.iter().filter(|d| d.attempt > a.attempt).collect())
            .unwrap_or_default();
        let dead_lettered = dead_at.contains_key(&(a.partition, a.offset));
        if later.is_empty() && !dead_lettered {
            continue;
        }
        let what = match later.first() {
            Some(d) => format!("was delivered again: {d}"),
            None => "was dead-lettered".to_string(),
        };
        // A higher attempt from the ack's own process (or an earlier one) would have
        // made the ack `unknown`: only a later process may have lost it.
        if let Some(same) = later.iter().find(|d| d.gen <= a.gen) {
            v.push(format!(
                "rule 6: the ack {a} was answered, yet that process (or an earlier one) handed out a higher attempt: {same}"
            ));
            continue;
        }
        // Only a power cut loses writes a SIGKILL keeps: the cut after this kill or
        // any later one (what the killed process left unsynced stays unsynced).
        let cut_after = log.cuts.iter().skip(a.gen as usize).any(|c| *c);
        match log.kills.get(a.gen as usize) {
            // Answered after the kill was sent, or within a flush interval before it.
            Some(kill) if *kill < a.recv + FLUSH && cut_after => tally.lost_acks_allowed += 1,
            Some(kill) if *kill < a.recv + FLUSH => v.push(format!(
                "rule 6: the ack {a} was answered {:?} before a SIGKILL with no power cut after it (the page cache keeps it), yet the offset {what}",
                kill.saturating_sub(a.recv)
            )),
            Some(kill) => v.push(format!(
                "rule 6: the ack {a} was answered {:?} before the kill at {kill:?} (more than the {FLUSH:?} flush interval), yet the offset {what}",
                kill.saturating_sub(a.recv)
            )),
            None => v.push(format!(
                "rule 6: the ack {a} was answered by the last process (never killed), yet the offset {what}"
            )),
        }
    }

    // Rule 8: gap-free. Every offset below a committed offset was acked (an ack
    // request named one of its deliveries) or dead-lettered, and was delivered before
    // the read that showed it committed was answered.
    let mut first_delivery: BTreeMap<(u64, u64), (u32, Duration)> = BTreeMap::new();
    for d in &log.deliveries {
        let e = first_delivery
            .entry((d.partition, d.offset))
            .or_insert((d.gen, d.sent));
        *e = (*e).min((d.gen, d.sent));
    }
    let mut highest: BTreeMap<u64, u64> = BTreeMap::new();
    for r in &log.committed {
        for (p, (c, _)) in &r.values {
            let h = highest.entry(*p).or_default();
            *h = (*h).max(*c);
        }
    }
    // Per partition: the latest first delivery over offsets 0..=o (None once one is
    // missing), so each read is checked against one value.
    let mut latest_first: BTreeMap<u64, Vec<Option<(u32, Duration)>>> = BTreeMap::new();
    for (p, h) in &highest {
        let mut acc = Some((0u32, Duration::ZERO));
        let mut gaps = Vec::new();
        let list = latest_first.entry(*p).or_default();
        for o in 0..*h {
            if !log.ack_sent.contains(&(*p, o)) && !dead_at.contains_key(&(*p, o)) {
                gaps.push(o);
            }
            acc = match (acc, first_delivery.get(&(*p, o))) {
                (Some(a), Some(f)) => Some(a.max(*f)),
                _ => None,
            };
            list.push(acc);
        }
        if !gaps.is_empty() {
            v.push(format!(
                "rule 8: partition {p} committed {h}, but {} offsets below it were never acked or dead-lettered: {:?}",
                gaps.len(),
                gaps.iter().take(20).collect::<Vec<_>>()
            ));
        }
    }
    for r in &log.committed {
        for (p, (c, _)) in &r.values {
            if *c == 0 {
                continue;
            }
            let Some(Some(latest)) = latest_first.get(p).and_then(|l| l.get(*c as usize - 1))
            else {
                v.push(format!(
                    "rule 8: partition {p} committed {c} (read in generation {} at {:?}) but an offset below it was never delivered",
                    r.gen, r.recv
                ));
                continue;
            };
            if latest.0 > r.gen || (latest.0 == r.gen && latest.1 >= r.recv) {
                v.push(format!(
                    "rule 8: partition {p} was read committed at {c} (generation {}, {:?}) before an offset below it was first delivered (generation {}, {:?})",
                    r.gen, r.recv, latest.0, latest.1
                ));
            }
        }
    }

    // Rule 7: nack answers agree with the attempt counts; dead_lettered is final.
    for n in &log.nacked {
        let ok = match n.list.as_str() {
            "retrying" => n.attempt < MAX_ATTEMPTS,
            "dead_lettered" | "dead_lettering" => n.attempt == MAX_ATTEMPTS,
            _ => true,
        };
        if !ok {
            v.push(format!(
                "rule 7: nack answered {n} with max_attempts {MAX_ATTEMPTS}"
            ));
        }
        if n.list != "dead_lettered" {
            continue;
        }
        if !dead_at.contains_key(&(n.partition, n.offset)) {
            v.push(format!(
                "rule 7: nack answered {n}, but no such dead letter exists"
            ));
        }
        if let Some(d) = by_offset
            .get(&(n.partition, n.offset))
            .and_then(|ds| ds.iter().find(|d| d.attempt > n.attempt))
        {
            v.push(format!(
                "rule 7: nack answered {n}, yet it was delivered again: {d}"
            ));
        }
    }
    v
}

/// The crash loop: see the module doc.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_loop_given_random_publishes_pulls_acks_nacks_and_sigkills_then_the_oracle_holds() {
    let ctx = Arc::new(Ctx {
        t0: Instant::now(),
        seed: seed(),
        rounds: rounds(),
        log: Mutex::default(),
    });
    eprintln!(
        "crash loop: seed {}, {} rounds; rerun with: {}",
        ctx.seed,
        ctx.rounds,
        ctx.rerun()
    );
    let mut rng = Rng(ctx.seed);
    // The data dir is on the lazy filesystem, so a round can end in a power cut
    // (unsynced writes and directory changes dropped) as well as a SIGKILL.
    let mut fs = LazyFs::mount().unwrap_or_else(|e| ctx.fail(format!("lazy filesystem: {e:#}")));
    let dir = fs.path().join("data");
    std::fs::create_dir(&dir).unwrap();
    std::fs::File::open(fs.path()).unwrap().sync_all().unwrap();
    let flush_ms = FLUSH.as_millis().to_string();
    let mut m = MeshdProcess::start(bin(), &dir, &["--delivery-flush-ms", &flush_ms])
        .await
        .unwrap_or_else(|e| ctx.fail(format!("start meshd: {e:#}")));
    let mut a = m.addr().to_string();
    create_topic(&a, TOPIC, PARTITIONS as u32).await;
    // Rule 2 holds retries to the window it assumes: the topic must have no other.
    let topic: Value = client(&a)
        .topic_answer(TOPIC)
        .await
        .and_then(|r| r.json())
        .unwrap_or_else(|e| ctx.fail(format!("topic: {e:#}")));
    let window = topic["dedup_window_ms"]
        .as_u64()
        .unwrap_or(DEFAULT_DEDUP_WINDOW_MS);
    if Duration::from_millis(window) != DEDUP_WINDOW {
        ctx.fail(format!(
            "the topic's dedup window is {window} ms, not {DEDUP_WINDOW:?}: {topic}"
        ));
    }
    create_subscription(
        &a,
        SUB,
        json!({"topic": TOPIC, "start": "earliest", "max_attempts": MAX_ATTEMPTS,
               "ack_timeout_ms": ACK_TIMEOUT_MS, "backoff": {"initial_ms": 10, "max_ms": 100}}),
    )
    .await;

    let (gate, gate_rx) = watch::channel(Gate {
        gen: 0,
        addr: Some(a.clone()),
        finished: false,
    });
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
    clients.push(tokio::spawn(offset_watcher(
        rng.fork(),
        gate_rx.clone(),
        ctx.clone(),
    )));

    for round in 0..ctx.rounds {
        // The schedule, not a wait for state: the kill lands at a seeded moment while
        // the clients have requests in flight.
        tokio::time::sleep(Duration::from_millis(rng.range(ROUND_MS.0, ROUND_MS.1))).await;
        let _ = read_committed(&ctx, &a, round).await;
        let cut = rng.range(0, 2) == 0;
        {
            let mut log = ctx.log();
            let now = ctx.now();
            log.kills.push(now);
            log.cuts.push(cut);
        }
        m.kill();
        gate.send_modify(|g| g.addr = None);
        if cut {
            // Every write the killed process left unsynced is gone, or a seeded torn
            // prefix of it survives.
            let torn = if rng.range(0, 1) == 0 {
                Torn::Lost
            } else {
                Torn::Prefix(rng.next_u64())
            };
            let report = fs
                .power_cut(torn)
                .unwrap_or_else(|e| ctx.fail(format!("power cut {}: {e:#}", round + 1)));
            ctx.log().cut_reports.push(report);
        }
        if let Err(e) = m.start_again().await {
            ctx.fail(format!(
                "restart after kill {} (power cut: {cut}): {e:#}",
                round + 1
            ));
        }
        // Now and then kill it again while it recovers, before any client sees it: a
        // recovery cut short must leave what the next one needs.
        while rng.range(0, 3) == 0 {
            tokio::time::sleep(Duration::from_millis(rng.range(0, 200))).await;
            ctx.log().recovery_kills += 1;
            m.kill();
            m.restart().await.unwrap_or_else(|e| {
                ctx.fail(format!("restart after a kill during recovery: {e:#}"))
            });
        }
        a = m.addr().to_string();
        if let Err(e) = wait_ready(&a).await {
            ctx.fail(format!("after kill {}: {e:#}", round + 1));
        }
        let gen = round + 1;
        if let Err(e) = read_committed(&ctx, &a, gen).await {
            ctx.fail(format!("offsets after kill {}: {e}", round + 1));
        }
        let last = gen == ctx.rounds;
        gate.send_modify(|g| {
            g.gen = gen;
            g.addr = Some(a.clone());
            g.finished = last;
        });
    }
    for c in clients {
        match tokio::time::timeout(Duration::from_secs(30), c).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => ctx.fail(format!("a client failed: {e}")),
            Err(_) => ctx.fail("a client did not stop within 30 s"),
        }
    }

    drain(&ctx, &a, ctx.rounds).await;
    let _ = read_committed(&ctx, &a, ctx.rounds).await;
    let dead = dead_letter_entries(&a, SUB)
        .await
        .unwrap_or_else(|e| ctx.fail(format!("dead letters: {e:#}")));

    // What meshd itself warned about over all its processes (for whoever reads the
    // output; the oracle judges only what clients were told).
    // Keyed by the message (the words before the first field), with one example line.
    let mut warnings: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for line in m.log_tail(usize::MAX).lines() {
        if line.contains(" WARN ") || line.contains(" ERROR ") {
            let message: Vec<&str> = line
                .split_whitespace()
                .skip(1)
                .take_while(|w| !w.contains('='))
                .collect();
            let seen = warnings
                .entry(message.join(" "))
                .or_insert_with(|| (0, line.to_string()));
            seen.0 += 1;
        }
    }
    if !warnings.is_empty() {
        eprintln!("meshd logged warnings or errors (count, first line): {warnings:#?}");
    }

    let log = ctx.log();
    let mut tally = Tally::default();
    let mut found = violations(&log, &dead, &mut tally);
    let floor = ACKS_PER_ROUND * ctx.rounds as usize;
    if log.acked.len() < floor || log.publishes_created < floor {
        found.push(format!(
            "activity floor: {} acks answered acked and {} publishes answered 201 over {} rounds; at least {floor} of each are needed for the run to prove anything",
            log.acked.len(),
            log.publishes_created,
            ctx.rounds
        ));
    }
    let unknown = log
        .published
        .values()
        .filter(|p| !matches!(p.outcome, Outcome::Created(..)))
        .count();
    let mut nack_lists: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &log.nacked {
        *nack_lists.entry(n.list.as_str()).or_default() += 1;
    }
    let offsets_delivered: BTreeSet<(u64, u64)> = log
        .deliveries
        .iter()
        .map(|d| (d.partition, d.offset))
        .collect();
    let counts = format!(
        "{} events answered 201 in {} publishes, {} with an unknown outcome ({} sends without an answer, retried); {} deliveries of {} offsets ({} redeliveries); ack answers {:?} ({} acked after a restart); nack answers {:?}; {} kills, {} of them followed by a power cut dropping {} unsynced bytes (and {} kills during recovery); {} dead letters; {} lost acks allowed by rule 6 (power cuts only); {} events sent again after an unknown outcome, {} of them within the dedup window of {:?} (held to one position by rule 2; longest span from first send to last kill {:?}) and {} beyond it (exempt); {} committed-offset reads; unanswered requests {:?}",
        log.published.len() - unknown,
        log.publishes_created,
        unknown,
        log.published.values().map(|p| p.unknown_sends as usize).sum::<usize>(),
        log.deliveries.len(),
        offsets_delivered.len(),
        log.deliveries.iter().filter(|d| d.attempt > 1).count(),
        log.ack_lists,
        log.acked.iter().filter(|a| a.delivered_gen < a.gen).count(),
        nack_lists,
        log.kills.len(),
        log.cuts.iter().filter(|c| **c).count(),
        log.cut_reports.iter().map(|r| r.unsynced_bytes).sum::<u64>(),
        log.recovery_kills,
        dead.len(),
        tally.lost_acks_allowed,
        tally.retried_inside_window + tally.retried_outside_window,
        tally.retried_inside_window,
        DEDUP_WINDOW,
        tally.longest_retry_span,
        tally.retried_outside_window,
        log.committed.len(),
        log.unanswered,
    );
    eprintln!("crash loop counts: {counts}");
    if !found.is_empty() {
        let shown: Vec<&String> = found.iter().take(SHOWN).collect();
        ctx.fail(format!(
            "the crash-loop oracle found {} violations (first {}):\n  {}\ncounts: {counts}",
            found.len(),
            shown.len(),
            shown
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n  ")
        ));
    }
}

/// A made-up delivery for the oracle's tests: pulled at `at` ms, answered 5 ms later.
fn made_up_seen(gen: u32, at: u64, partition: u64, offset: u64, attempt: u64, id: &str) -> Seen {
    Seen {
        gen,
        sent: Duration::from_millis(at),
        recv: Duration::from_millis(at + 5),
        partition,
        offset,
        attempt,
        event_id: id.to_string(),
        event: event(id),
    }
}

/// A made-up publish for the oracle's tests: sent once, at the start, to generation 0.
fn made_up_published(log: &mut Log, id: &str, outcome: Outcome) {
    log.published.insert(
        id.to_string(),
        Published {
            body: event(id),
            outcome,
            unknown_sends: 0,
            first_sent: Duration::ZERO,
            last_gen: 0,
        },
    );
}

/// The oracle itself, on made-up logs: a clean one passes, an ack lost within the flush
/// window is allowed, and a log that breaks each rule is reported under each rule (so
/// a green crash loop means the rules were checked, not skipped).
#[test]
fn positive_control_the_crash_loop_oracle_given_a_log_that_breaks_each_rule_then_it_names_each_rule(
) {
    let ms = Duration::from_millis;
    let seen = made_up_seen;
    let answer = |gen, at: u64, partition, offset, attempt, list: &str| Answer {
        gen,
        sent: ms(at),
        recv: ms(at + 5),
        partition,
        offset,
        attempt,
        list: list.to_string(),
        delivered_gen: gen,
    };
    let read = |gen, at: u64, committed| CommittedRead {
        gen,
        sent: ms(at),
        recv: ms(at + 5),
        values: BTreeMap::from([(0, (committed, 0))]),
    };
    let published = made_up_published;
    let dead_letter = |partition: u64, offset: u64, id: &str| {
        json!({"subscription": SUB, "topic": TOPIC, "state": "dead", "partition": partition,
               "offset": offset, "attempts": MAX_ATTEMPTS, "event": event(id)})
    };

    // Clean: published, delivered twice (a nack between), acked; one event
    // dead-lettered; the committed offset moves forward over a kill. One ack is
    // answered 10 ms before the kill and its offset comes back: allowed.
    let mut clean = Log {
        kills: vec![ms(1000)],
        cuts: vec![true],
        ack_sent: BTreeSet::from([(0, 0), (0, 2), (1, 0)]),
        ..Log::default()
    };
    published(&mut clean, "a", Outcome::Created(0, 0));
    published(&mut clean, "b", Outcome::Created(0, 1));
    published(&mut clean, "c", Outcome::Unknown("no answer".into()));
    published(&mut clean, "d", Outcome::Created(1, 0));
    clean.deliveries = vec![
        seen(0, 100, 0, 0, 1, "a"),
        seen(0, 200, 0, 0, 2, "a"),
        seen(0, 120, 0, 1, 4, "b"),
        seen(0, 300, 0, 2, 1, "c"),
        seen(0, 400, 1, 0, 1, "d"),
        seen(1, 1100, 1, 0, 2, "d"),
    ];
    clean.nacked = vec![answer(0, 150, 0, 0, 1, "retrying")];
    clean.acked = vec![
        answer(0, 250, 0, 0, 2, "acked"),
        answer(0, 985, 1, 0, 1, "acked"),
    ];
    clean.committed = vec![read(0, 50, 0), read(0, 500, 1), read(1, 1050, 3)];
    let clean_dead = [dead_letter(0, 1, "b")];
    let mut tally = Tally::default();
    let found = violations(&clean, &clean_dead, &mut tally);
    assert!(found.is_empty(), "{found:#?}");
    assert_eq!(tally.lost_acks_allowed, 1);

    // The same lost ack with only a SIGKILL after it: the page cache keeps acks, so
    // it is a violation.
    clean.cuts = vec![false];
    let found = violations(&clean, &clean_dead, &mut Tally::default());
    assert!(
        found.iter().any(|v| v.contains("no power cut after it")),
        "{found:#?}"
    );

    // Each rule broken once.
    let mut bad = Log {
        kills: vec![ms(1000)],
        ..Log::default()
    };
    published(&mut bad, "lost", Outcome::Created(0, 0)); // 1: never delivered
    published(&mut bad, "x", Outcome::Created(0, 1));
    published(&mut bad, "y", Outcome::Created(0, 2));
    published(&mut bad, "z", Outcome::Created(0, 3));
    bad.deliveries = vec![
        seen(0, 100, 0, 9, 1, "ghost"), // 2: never published
        seen(0, 100, 0, 1, 2, "x"),
        seen(1, 1100, 0, 1, 1, "x"), // 4: attempt went back over a kill
        seen(0, 100, 0, 2, 1, "y"),
        seen(0, 500, 0, 2, 2, "y"), // 6: after an ack long before the kill
        seen(0, 100, 0, 3, 4, "z"),
        seen(1, 1100, 0, 3, 5, "z"), // 7: after dead_lettered (and beyond max)
    ];
    bad.acked = vec![answer(0, 200, 0, 2, 1, "acked")];
    bad.nacked = vec![answer(0, 200, 0, 3, 4, "dead_lettered")];
    // 3: backwards; 8: committed 5 with nothing acked below it, read before any
    // delivery.
    bad.committed = vec![read(0, 50, 5), read(1, 1050, 3)];
    let bad_dead = [dead_letter(0, 3, "z"), dead_letter(0, 3, "z")]; // 5: twice
    let found = violations(&bad, &bad_dead, &mut Tally::default());
    for rule in 1..=8 {
        assert!(
            found
                .iter()
                .any(|v| v.starts_with(&format!("rule {rule}:"))),
            "rule {rule} not reported: {found:#?}"
        );
    }
}

/// Rule 2 on made-up logs: an event stored at two positions is a violation whether or
/// not its publish was sent again after an unknown outcome (publish dedup stores a
/// retry once), as long as its sends fall inside the dedup window; beyond it (the
/// contract's bound) it is exempt, and counted.
#[test]
fn positive_control_rule_2_given_an_event_stored_twice_then_it_is_a_violation_also_when_its_publish_was_retried_within_the_dedup_window(
) {
    let ms = Duration::from_millis;
    let rule_2 = |log: &Log, tally: &mut Tally| {
        violations(log, &[], tally)
            .into_iter()
            .filter(|v| v.starts_with("rule 2:"))
            .collect::<Vec<_>>()
    };
    // "r": first sent at 90 ms to generation 0, unanswered, sent again to generation
    // 0 and answered 201 at p0 o1; generation 0 was killed at 1 s.
    let mut log = Log {
        kills: vec![ms(1000)],
        ..Log::default()
    };
    made_up_published(&mut log, "r", Outcome::Created(0, 1));
    let r = log.published.get_mut("r").unwrap();
    (r.unknown_sends, r.first_sent) = (1, ms(90));

    // Stored once: clean, and counted as a retry inside the window.
    log.deliveries = vec![made_up_seen(0, 100, 0, 1, 1, "r")];
    let mut tally = Tally::default();
    assert_eq!(rule_2(&log, &mut tally), Vec::<String>::new());
    assert_eq!(
        (tally.retried_inside_window, tally.retried_outside_window),
        (1, 0)
    );
    assert_eq!(tally.longest_retry_span, ms(910));

    // Stored twice: a violation, retried or not.
    log.deliveries.push(made_up_seen(0, 100, 0, 0, 1, "r"));
    let found = rule_2(&log, &mut Tally::default());
    assert!(
        found.len() == 1 && found[0].contains("event r stored at several positions"),
        "{found:#?}"
    );
    log.published.get_mut("r").unwrap().unknown_sends = 0;
    assert_eq!(rule_2(&log, &mut Tally::default()).len(), 1);

    // Retried with sends spanning more than the window less the margin (its last
    // send's process killed that and a millisecond after the first send): exempt, and
    // counted.
    log.published.get_mut("r").unwrap().unknown_sends = 1;
    log.kills = vec![ms(90) + DEDUP_WINDOW - DEDUP_MARGIN + ms(1)];
    let mut tally = Tally::default();
    assert_eq!(rule_2(&log, &mut tally), Vec::<String>::new());
    assert_eq!(
        (tally.retried_inside_window, tally.retried_outside_window),
        (0, 1)
    );
    // Exactly the window less the margin: still strict.
    log.kills = vec![ms(90) + DEDUP_WINDOW - DEDUP_MARGIN];
    assert_eq!(rule_2(&log, &mut Tally::default()).len(), 1);
}
