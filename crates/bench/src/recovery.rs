//! Scenario 5, recovery: how long meshd takes from start to ready with many in-flight
//! delivery records and a long log, and how much memory it takes on the way.
//!
//! For every (events, in-flight) configuration: a fresh meshd on a temp data dir gets
//! one topic (one partition), `subscriptions` subscriptions, `events` events (batches
//! of 1000 over 8 connections) and then every subscription pulls `in_flight` events
//! without acking them (`ack_timeout_ms` 600000, so none is due while the bench runs):
//! `subscriptions × in_flight` in-flight delivery records. Then meshd is SIGKILLed
//! (a crash: RocksDB replays its WAL on open) and started again on the same data dir,
//! `repeat` times: each restart is timed from spawn to the first `/readyz` 200 and its
//! peak RSS (`VmHWM`) read once ready, with meshd's own `meshd_recovery_seconds` and
//! `meshd_recovery_records` from `/metrics`. A restart that re-arms fewer records than
//! were handed out fails the run (the bench waits 5 delivery flush intervals after the
//! last pull before the kill: in-flight state is durable within the flush interval).
//!
//! Memory proportional to in-flight records and not to log size shows as peak RSS
//! following `in_flight` across configurations while `events` changes nothing: run two
//! event counts and two in-flight counts (`--recovery-events 1000000,10000000
//! --recovery-in-flight 100,1000`).

use crate::http::Conn;
use crate::load::median;
use crate::procs;
use crate::systems::{meshd_put, meshd_ready, with_stderr, Events};
use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

const TOPIC: &str = "recovery";
/// Events per publish request while filling the log (meshd's batch limit).
const FILL_BATCH: u64 = 1000;
/// Connections publishing (and pulling) in parallel while setting up.
const FILL_CONNECTIONS: u64 = 8;
/// The delivery flush interval meshd runs with (its default).
const FLUSH_MS: u64 = 100;

pub struct Params {
    pub subscriptions: u64,
    pub in_flight: Vec<u64>,
    pub events: Vec<u64>,
    pub data_bytes: usize,
    /// The topic's dedup window (meshd's default when `None`).
    pub dedup_window_ms: Option<u64>,
    /// Keep the data dir after the run (and print where).
    pub keep_data: bool,
    pub repeat: usize,
}

#[derive(Serialize)]
pub struct Restart {
    pub ready_seconds: f64,
    pub peak_rss_bytes: u64,
    /// meshd's own measure of the delivery-state recovery (`meshd_recovery_seconds`).
    pub recovery_seconds: f64,
    pub recovery_records: u64,
}

#[derive(Serialize)]
pub struct Row {
    pub events: u64,
    pub subscriptions: u64,
    pub in_flight_per_subscription: u64,
    pub in_flight_records: u64,
    pub data_dir_bytes: u64,
    pub setup_seconds: f64,
    pub restarts: Vec<Restart>,
    pub median_ready_seconds: f64,
    pub median_peak_rss_bytes: f64,
}

#[derive(Serialize)]
pub struct RecoveryReport {
    pub data_bytes: usize,
    pub event_bytes: usize,
    pub rows: Vec<Row>,
}

impl RecoveryReport {
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "meshd-bench recovery: start → /readyz 200 after SIGKILL, {} B events, one partition, median of restarts (target: ready < 5 s, memory ∝ in-flight)",
            self.event_bytes
        );
        let _ = writeln!(
            s,
            "{:>11} {:>6} {:>9} {:>10} {:>9} {:>9} {:>10} {:>9}",
            "events",
            "subs",
            "in-flight",
            "records",
            "data MiB",
            "ready s",
            "recovery s",
            "rss MiB"
        );
        for r in &self.rows {
            let rec = median(
                &r.restarts
                    .iter()
                    .map(|x| x.recovery_seconds)
                    .collect::<Vec<_>>(),
            );
            let _ = writeln!(
                s,
                "{:>11} {:>6} {:>9} {:>10} {:>9.0} {:>9.3} {:>10.3} {:>9.0}",
                r.events,
                r.subscriptions,
                r.in_flight_per_subscription,
                r.in_flight_records,
                r.data_dir_bytes as f64 / (1024.0 * 1024.0),
                r.median_ready_seconds,
                rec,
                r.median_peak_rss_bytes / (1024.0 * 1024.0)
            );
        }
        s
    }
}

pub async fn run(binary: &Path, p: &Params) -> Result<RecoveryReport> {
    if p.in_flight.iter().any(|f| *f == 0 || *f > 100_000) || p.subscriptions == 0 {
        bail!("--recovery-in-flight must be 1..=100000 and --recovery-subscriptions at least 1");
    }
    let events = Events::new(p.data_bytes);
    let mut rows = Vec::new();
    for &n in &p.events {
        for &f in &p.in_flight {
            if n < f {
                bail!("--recovery-events {n} is fewer than --recovery-in-flight {f}: every subscription pulls {f} events");
            }
            eprintln!(
                "meshd-bench: recovery setup: {n} events, {} subscriptions × {f} in flight",
                p.subscriptions
            );
            rows.push(one(binary, p, &events, n, f).await?);
        }
    }
    Ok(RecoveryReport {
        data_bytes: p.data_bytes,
        event_bytes: events.doc_bytes(),
        rows,
    })
}

async fn one(binary: &Path, p: &Params, events: &Events, n: u64, f: u64) -> Result<Row> {
    let dir = tempfile::Builder::new()
        .prefix("meshd-bench-recovery-")
        .tempdir()
        .context("creating a temp dir for meshd's data")?;
    let data = dir.path().join("data");
    let flags = vec!["--max-in-flight".to_string(), f.max(1000).to_string()];
    let started = Instant::now();
    let mut server = procs::start_meshd_on(binary, &data, &flags)?;
    let addr = server.addr;
    let fill = async {
        meshd_ready(addr).await?;
        let topic = match p.dedup_window_ms {
            Some(ms) => format!(r#"{{"partitions":1,"dedup_window_ms":{ms}}}"#),
            None => r#"{"partitions":1}"#.to_string(),
        };
        meshd_put(addr, &format!("/v1/topics/{TOPIC}"), &topic).await?;
        let subs: Vec<u64> = (0..p.subscriptions).collect();
        let body = format!(r#"{{"topic":"{TOPIC}","ack_timeout_ms":600000}}"#);
        parallel(&subs, |s| {
            let body = body.clone();
            async move { meshd_put(addr, &format!("/v1/subscriptions/r{s}"), &body).await }
        })
        .await?;
        publish_all(addr, TOPIC, n, |out, id| events.write(out, id)).await?;
        parallel(&subs, |s| async move { pull_n(addr, s, f).await }).await?;
        anyhow::Ok(())
    };
    with_stderr(&server, fill.await)?;
    let setup_seconds = started.elapsed().as_secs_f64();
    // In-flight state is durable within the delivery flush interval.
    tokio::time::sleep(Duration::from_millis(5 * FLUSH_MS)).await;
    server.kill()?;
    drop(server);
    let data_dir_bytes = dir_bytes(&data)?;
    let expected = p.subscriptions * f;
    let mut restarts = Vec::new();
    for i in 0..p.repeat {
        eprintln!(
            "meshd-bench: recovery restart {}/{} ({expected} in-flight records, {n} events)",
            i + 1,
            p.repeat
        );
        let t0 = Instant::now();
        let mut server = procs::start_meshd_on(binary, &data, &flags)?;
        let ready = with_stderr(&server, wait_ready(server.addr).await)?;
        let ready_seconds = (ready - t0).as_secs_f64();
        let peak_rss_bytes = procs::peak_rss_bytes(server.pid())?;
        let (recovery_seconds, recovery_records) =
            with_stderr(&server, recovery_metrics(server.addr).await)?;
        if recovery_records < expected {
            bail!(
                "meshd re-armed {recovery_records} delivery records at restart, {expected} were handed out: in-flight state was lost\n{}",
                server.stderr_tail()
            );
        }
        server.kill()?;
        restarts.push(Restart {
            ready_seconds,
            peak_rss_bytes,
            recovery_seconds,
            recovery_records,
        });
    }
    if p.keep_data {
        let kept = dir.keep();
        eprintln!(
            "meshd-bench: recovery data dir kept: {} (meshd serve --data-dir {} --max-in-flight {})",
            kept.display(),
            data.display(),
            f.max(1000)
        );
    }
    Ok(Row {
        events: n,
        subscriptions: p.subscriptions,
        in_flight_per_subscription: f,
        in_flight_records: expected,
        data_dir_bytes,
        setup_seconds,
        median_ready_seconds: median(&restarts.iter().map(|r| r.ready_seconds).collect::<Vec<_>>()),
        median_peak_rss_bytes: median(
            &restarts
                .iter()
                .map(|r| r.peak_rss_bytes as f64)
                .collect::<Vec<_>>(),
        ),
        restarts,
    })
}

/// Runs `f` for every item, on [`FILL_CONNECTIONS`] items at a time.
pub(crate) async fn parallel<F, Fut>(items: &[u64], f: F) -> Result<()>
where
    F: Fn(u64) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    use futures::stream::{self, StreamExt, TryStreamExt};
    stream::iter(items.iter().map(|&i| f(i)))
        .buffer_unordered(FILL_CONNECTIONS as usize)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

/// Publishes `n` events to `topic` in batches of [`FILL_BATCH`], each written by
/// `write` (into the batch, with its id).
pub(crate) async fn publish_all(
    addr: SocketAddr,
    topic: &str,
    n: u64,
    write: impl Fn(&mut Vec<u8>, &str) + Sync,
) -> Result<()> {
    let requests: Vec<u64> = (0..n.div_ceil(FILL_BATCH)).collect();
    let last_report = std::sync::Mutex::new(Instant::now());
    parallel(&requests, |r| {
        let last_report = &last_report;
        let write = &write;
        async move {
            let count = FILL_BATCH.min(n - r * FILL_BATCH);
            let mut body = Vec::new();
            body.push(b'[');
            for i in 0..count {
                if i > 0 {
                    body.push(b',');
                }
                write(&mut body, &format!("{r}-{i}"));
            }
            body.push(b']');
            let mut c = Conn::connect(addr).await?;
            let resp = c
                .request(
                    "POST",
                    &format!("/v1/topics/{topic}/events"),
                    Some("application/cloudevents-batch+json"),
                    &body,
                )
                .await?;
            if resp.status != 201 {
                bail!(
                    "meshd answered {} to a publish: {}",
                    resp.status,
                    String::from_utf8_lossy(&resp.body)
                );
            }
            if let Ok(mut t) = last_report.lock() {
                if t.elapsed() > Duration::from_secs(10) {
                    *t = Instant::now();
                    eprintln!(
                        "meshd-bench: setup: published batch {r} of {}",
                        n.div_ceil(FILL_BATCH)
                    );
                }
            }
            Ok(())
        }
    })
    .await
}

/// Pulls `f` events on subscription `r{s}` without acking them.
async fn pull_n(addr: SocketAddr, s: u64, f: u64) -> Result<()> {
    let mut c = Conn::connect(addr).await?;
    let mut got = 0u64;
    while got < f {
        let want = (f - got).min(1000);
        let body = format!(r#"{{"max_events":{want},"wait_ms":1000}}"#);
        let v = c
            .post_json(
                &format!("/v1/subscriptions/r{s}/pull"),
                body.as_bytes(),
                "a pull",
            )
            .await?;
        let n = crate::e2e::deliveries(&v)?.len() as u64;
        if n == 0 {
            bail!("subscription r{s}: a pull got nothing after {got} of {f} in-flight events");
        }
        got += n;
    }
    Ok(())
}

/// Polls `/readyz` every 5 ms until 200; the instant it answered.
pub(crate) async fn wait_ready(addr: SocketAddr) -> Result<Instant> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if let Ok(mut c) = Conn::connect(addr).await {
            if let Ok(r) = c.request("GET", "/readyz", None, b"").await {
                if r.status == 200 {
                    return Ok(Instant::now());
                }
            }
        }
        if Instant::now() > deadline {
            bail!("meshd was not ready within 600 s of its start");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// `meshd_recovery_seconds` and `meshd_recovery_records` from `/metrics`.
async fn recovery_metrics(addr: SocketAddr) -> Result<(f64, u64)> {
    let mut c = Conn::connect(addr).await?;
    let r = c.request("GET", "/metrics", None, b"").await?;
    let text = String::from_utf8_lossy(&r.body);
    let value = |name: &str| -> Result<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| anyhow!("no {name} in /metrics"))
    };
    Ok((
        value("meshd_recovery_seconds")?,
        value("meshd_recovery_records")? as u64,
    ))
}

/// Bytes of every file under `dir`.
pub(crate) fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let e = e?;
        let m = e.metadata()?;
        total += if m.is_dir() {
            dir_bytes(&e.path())?
        } else {
            m.len()
        };
    }
    Ok(total)
}
