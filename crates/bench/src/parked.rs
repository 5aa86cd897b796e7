//! Scenario 7, parked events (http-api.md, "Parking"): what a million events waiting
//! for their `deliverat` cost meshd in memory, how fast they are parked, and how long a
//! restart after SIGKILL takes with them.
//!
//! For every event count: a fresh meshd on a temp data dir gets one topic (one
//! partition) and one subscription from the earliest offset; its resident memory is
//! read (the baseline); then the events are published (batches of 1000 over 8
//! connections), each with a `deliverat` six days ahead, and the bench waits until the
//! subscription's `stats` count every one as parked and `committed` has passed them
//! all (parking time: first publish to that moment). Resident memory is read again.
//! A control run publishes the same events without `deliverat` (nothing parks; the
//! subscription reads only its window ahead): the difference between the two is what
//! parking costs, apart from what publishing that many events costs by itself (the
//! publish dedup index, RocksDB's memtables). Then meshd is SIGKILLed and started
//! again on the same data dir `repeat` times: start → `/readyz` 200, peak RSS, and the
//! parked count after the restart (a run whose count differs fails).

use crate::http::Conn;
use crate::load::median;
use crate::procs;
use crate::recovery::{dir_bytes, publish_all, wait_ready};
use crate::systems::{meshd_put, meshd_ready, with_stderr};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

const TOPIC: &str = "parked";
const SUBSCRIPTION: &str = "p";
/// How far ahead the events are due (within the contract's 7 days).
const AHEAD_SECONDS: u64 = 6 * 86_400;

pub struct Params {
    pub events: Vec<u64>,
    pub data_bytes: usize,
    pub repeat: usize,
}

#[derive(Serialize)]
pub struct ParkedRestart {
    pub ready_seconds: f64,
    pub peak_rss_bytes: u64,
    pub parked: u64,
}

#[derive(Serialize)]
pub struct ParkedRow {
    pub events: u64,
    /// `false`: the control run (the same events without `deliverat`).
    pub delayed: bool,
    pub baseline_rss_bytes: u64,
    pub parked_rss_bytes: u64,
    /// (parked − baseline) / events.
    pub rss_bytes_per_parked: f64,
    /// First publish → every event parked and passed by `committed`.
    pub park_seconds: f64,
    pub data_dir_bytes: u64,
    pub restarts: Vec<ParkedRestart>,
    pub median_ready_seconds: f64,
    pub median_peak_rss_bytes: f64,
}

#[derive(Serialize)]
pub struct ParkedReport {
    pub data_bytes: usize,
    pub rows: Vec<ParkedRow>,
}

impl ParkedReport {
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "meshd-bench parked: events waiting for deliverat (6 days ahead), {} B of data each, one partition, one subscription",
            self.data_bytes
        );
        let _ = writeln!(
            s,
            "{:>9} {:>8} {:>9} {:>12} {:>12} {:>9} {:>9} {:>9} {:>12}",
            "events",
            "delayed",
            "park s",
            "base MiB",
            "after MiB",
            "B/event",
            "data MiB",
            "ready s",
            "restart MiB"
        );
        let mib = |b: f64| b / (1024.0 * 1024.0);
        for r in &self.rows {
            let _ = writeln!(
                s,
                "{:>9} {:>8} {:>9.1} {:>12.0} {:>12.0} {:>9.1} {:>9.0} {:>9.3} {:>12.0}",
                r.events,
                if r.delayed { "yes" } else { "control" },
                r.park_seconds,
                mib(r.baseline_rss_bytes as f64),
                mib(r.parked_rss_bytes as f64),
                r.rss_bytes_per_parked,
                mib(r.data_dir_bytes as f64),
                r.median_ready_seconds,
                mib(r.median_peak_rss_bytes)
            );
        }
        s
    }
}

pub async fn run(binary: &Path, p: &Params) -> Result<ParkedReport> {
    if p.events.contains(&0) {
        bail!("--parked-events: give counts of at least 1");
    }
    let mut rows = Vec::new();
    for &n in &p.events {
        for delayed in [true, false] {
            eprintln!("meshd-bench: parked: {n} events, delayed: {delayed}");
            rows.push(one(binary, p, n, delayed).await?);
        }
    }
    Ok(ParkedReport {
        data_bytes: p.data_bytes,
        rows,
    })
}

/// (parked, committed, end offset) of the subscription's only partition.
async fn parked_and_committed(addr: SocketAddr) -> Result<(u64, u64, u64)> {
    let mut c = Conn::connect(addr).await?;
    let r = c
        .request(
            "GET",
            &format!("/v1/subscriptions/{SUBSCRIPTION}/stats"),
            None,
            b"",
        )
        .await?;
    if r.status != 200 {
        bail!("stats answered {}", r.status);
    }
    let v: serde_json::Value = serde_json::from_slice(&r.body).context("the stats answer")?;
    let p = &v["partitions"][0];
    Ok((
        p["parked"].as_u64().unwrap_or(0),
        p["committed"].as_u64().unwrap_or(0),
        p["end_offset"].as_u64().unwrap_or(0),
    ))
}

async fn one(binary: &Path, p: &Params, n: u64, delayed: bool) -> Result<ParkedRow> {
    let dir = tempfile::Builder::new()
        .prefix("meshd-bench-parked-")
        .tempdir()
        .context("creating a temp dir for meshd's data")?;
    let data = dir.path().join("data");
    let mut server = procs::start_meshd_on(binary, &data, &[])?;
    let addr = server.addr;
    let setup = async {
        meshd_ready(addr).await?;
        meshd_put(addr, &format!("/v1/topics/{TOPIC}"), r#"{"partitions":1}"#).await?;
        let body = format!(r#"{{"topic":"{TOPIC}","start":"earliest"}}"#);
        meshd_put(addr, &format!("/v1/subscriptions/{SUBSCRIPTION}"), &body).await?;
        anyhow::Ok(())
    };
    with_stderr(&server, setup.await)?;
    let baseline_rss_bytes = procs::rss_bytes(server.pid())?;
    let at = if delayed {
        let now = meshd_stores::time::Timestamp::now();
        let due = meshd_stores::time::Timestamp::from_millis(
            now.as_millis() + AHEAD_SECONDS as i64 * 1000,
        )
        .unwrap_or(now);
        format!(r#""deliverat":"{}","#, due.to_rfc3339())
    } else {
        String::new()
    };
    let data_text = "x".repeat(p.data_bytes);
    let started = Instant::now();
    let fill = async {
        publish_all(addr, TOPIC, n, |out, id| {
            let _ = write!(
                StrOut(out),
                r#"{{"specversion":"1.0","id":"{id}","source":"/meshd-bench","type":"bench.delayed",{at}"datacontenttype":"text/plain","data":"{data_text}"}}"#
            );
        })
        .await?;
        // Every event parked, and `committed` past all of them (the control: every
        // event stored).
        let deadline = Instant::now() + Duration::from_secs(3600);
        loop {
            let (parked, committed, end) = parked_and_committed(addr).await?;
            if (delayed && parked == n && committed == n) || (!delayed && end == n) {
                return anyhow::Ok(());
            }
            if Instant::now() > deadline {
                bail!("after an hour {parked} of {n} events are parked, committed is {committed}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    with_stderr(&server, fill.await)?;
    let park_seconds = started.elapsed().as_secs_f64();
    let parked_rss_bytes = procs::rss_bytes(server.pid())?;
    server.kill()?;
    drop(server);
    let data_dir_bytes = dir_bytes(&data)?;
    let mut restarts = Vec::new();
    for i in 0..p.repeat {
        eprintln!(
            "meshd-bench: parked restart {}/{} ({n} parked)",
            i + 1,
            p.repeat
        );
        let t0 = Instant::now();
        let mut server = procs::start_meshd_on(binary, &data, &[])?;
        let ready = with_stderr(&server, wait_ready(server.addr).await)?;
        let ready_seconds = (ready - t0).as_secs_f64();
        let peak_rss_bytes = procs::peak_rss_bytes(server.pid())?;
        let (parked, _, _) = with_stderr(&server, parked_and_committed(server.addr).await)?;
        let want = if delayed { n } else { 0 };
        if parked != want {
            bail!(
                "after a restart meshd counts {parked} parked events, {want} were parked\n{}",
                server.stderr_tail()
            );
        }
        server.kill()?;
        restarts.push(ParkedRestart {
            ready_seconds,
            peak_rss_bytes,
            parked,
        });
    }
    Ok(ParkedRow {
        events: n,
        delayed,
        baseline_rss_bytes,
        parked_rss_bytes,
        rss_bytes_per_parked: parked_rss_bytes.saturating_sub(baseline_rss_bytes) as f64 / n as f64,
        park_seconds,
        data_dir_bytes,
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

/// `write!` into a byte buffer.
struct StrOut<'a>(&'a mut Vec<u8>);

impl std::fmt::Write for StrOut<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        self.0.extend_from_slice(s.as_bytes());
        Ok(())
    }
}
