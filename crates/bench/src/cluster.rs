//! Scenario 6, "cluster": meshd in cluster mode, started by the bench on loopback: one
//! single-member etcd for Meta (`--heartbeat-interval 10 --election-timeout 100`), one
//! nats-server with JetStream for the log (file store, `sync_interval: always`, so an
//! acknowledged event is fsynced as with meshd's own log) and N `meshd serve --meta
//! etcd://… --log nats://… --instance-id bench-i --lease-ttl-ms T --checkpoint-ms 200`
//! instances, each on a fresh temp dir. Every run gets a fresh cluster.
//!
//! (a) **Takeover**: a topic of `--cluster-partitions` partitions and a subscription;
//! once ownership has settled (every partition owned, all N members, no move for 1 s)
//! and every partition has served one event through a pull, the instance owning the most
//! partitions is SIGKILLed. From the kill the bench (i) publishes one event to each lost
//! partition through the survivors (`partitionkey` chosen so it lands there), (ii) polls
//! `GET /v1/cluster` on a survivor and (iii) pulls from every survivor. The takeover
//! time is from the SIGKILL until both: every partition is owned by a survivor (the lost
//! ones under a new epoch) AND the event published to each lost partition after the kill
//! has been handed out by a pull. A publish alone says nothing here: meshd appends to
//! JetStream directly, without the partition's owner, so publishing stays available
//! throughout (the bench counts it: one connection publishes back to back to the
//! survivors during the takeover, and its failures are reported). A pull is served only
//! by the partition's owner, so a delivery of the post-kill event is the proof that a
//! new owner serves. The lease TTL bounds it from below: a killed owner's keys stay in
//! etcd until its lease runs out.
//!
//! (b) **1 vs N instances**: publish throughput with the closed-loop driver against a
//! cluster of 1 instance and one of N, alternating (1, N, 1, N, …); worker `w` keeps one
//! connection to instance `w % n`. Every process (N meshd, nats-server, etcd and this
//! driver) shares the machine's cores, so on a small machine N instances cannot be
//! expected to beat one: the point is the measurement.

#[path = "cluster_footprint.rs"]
mod footprint;

use crate::http::Conn;
use crate::load::{self, median, Op, Window};
use crate::procs::{self, JsSync, Server};
use crate::systems::Events;
use anyhow::{anyhow, bail, ensure, Context, Result};
use futures::future::BoxFuture;
use futures::FutureExt;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOPIC: &str = "bench";
const SUBSCRIPTION: &str = "takeover";
/// How long any wait may take (start-up, settling, the takeover beyond the TTL).
const DEADLINE: Duration = Duration::from_secs(60);
/// How long ownership must stay unchanged to count as settled.
const SETTLE: Duration = Duration::from_secs(1);
/// One HTTP request to an instance.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The pause between two rounds of the takeover poll (publish, owners, pulls).
const POLL: Duration = Duration::from_millis(20);

/// The binaries a cluster is made of.
pub struct Binaries<'a> {
    pub meshd: &'a Path,
    pub nats: &'a Path,
    pub etcd: &'a Path,
}

/// What the scenario runs.
pub struct Settings {
    /// The larger cluster (the takeover cluster, and N of "1 vs N"); at least 2.
    pub instances: usize,
    pub partitions: u32,
    pub lease_ttl_ms: u64,
    pub concurrency: Vec<usize>,
    pub batch: Vec<usize>,
    pub window: Window,
    pub repeat: usize,
    pub events: Events,
    /// (c): pull batches per consumer pattern; (d): events through the moves.
    pub footprint_batches: usize,
    pub moves_events: usize,
    /// Only these parts and publish systems ([`PARTS`]; empty: all of them).
    pub only: Vec<String>,
}

/// The parts of the scenario and the systems of its publish runs, by the names
/// `--systems` takes: the takeover (a), the Meta footprint (c), the duplicates per move
/// (d), and publishing through meshd (1 and N instances), through meshd with the topic's
/// publish dedup off (`dedup_window_ms: 0`, 1 instance: what dedup costs in cluster
/// mode), and to JetStream alone.
pub const PARTS: [&str; 6] = [
    "takeover",
    "footprint",
    "moves",
    "meshd",
    "meshd-nodedup",
    "jetstream",
];

impl Settings {
    fn runs(&self, part: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|p| p == part)
    }
}

// ---- the report ----------------------------------------------------------------------

#[derive(Serialize)]
pub struct ClusterReport {
    pub instances: usize,
    pub partitions: u32,
    pub lease_ttl_ms: u64,
    pub checkpoint_ms: u64,
    pub cpus: usize,
    pub log: &'static str,
    /// meshd, nats-server, etcd.
    pub binaries: [String; 3],
    pub takeover: TakeoverSummary,
    /// (c): etcd requests and bytes per delivered event, per consumer pattern.
    pub footprint: Vec<footprint::FootprintRun>,
    /// (d): duplicates per move (one pause past the lease, one SIGKILL).
    pub moves: Option<footprint::MovesRun>,
    pub throughput: Vec<ThroughputRow>,
    pub ratios: Vec<ScaleRatio>,
    /// meshd with one instance against JetStream alone.
    pub peer_ratios: Vec<PeerRatio>,
    /// meshd with one instance, publish dedup on (the default) against off.
    pub dedup_ratios: Vec<DedupRatio>,
    pub throughput_runs: Vec<ThroughputRun>,
}

#[derive(Serialize)]
pub struct TakeoverSummary {
    /// What is measured, in words.
    pub measure: &'static str,
    pub runs: Vec<TakeoverRun>,
    pub median_s: f64,
    pub min_s: f64,
    pub max_s: f64,
    /// Median of the owner keys alone (every partition owned by a survivor).
    pub owned_median_s: f64,
}

#[derive(Serialize)]
pub struct TakeoverRun {
    pub repeat_index: usize,
    pub victim: String,
    /// The partitions the killed instance owned.
    pub lost_partitions: Vec<u32>,
    /// SIGKILL → every partition owned by a survivor (the lost ones under a new epoch).
    pub owned_s: f64,
    /// SIGKILL → the post-kill event of every lost partition handed out by a pull.
    pub served_s: f64,
    /// The takeover time: the later of the two.
    pub takeover_s: f64,
    /// SIGKILL → the post-kill event of every lost partition accepted (201).
    pub published_s: f64,
    /// Publishes of the background load to the survivors during the takeover.
    pub load_publishes_ok: u64,
    pub load_publishes_failed: u64,
    /// Failed publishes of the post-kill events (each retried until accepted).
    pub probe_publish_failures: u64,
    /// Pulls that failed during the takeover (e.g. forwarded to the dead owner).
    pub pull_errors: u64,
}

#[derive(Serialize)]
pub struct ThroughputRun {
    /// `meshd` (publishing through meshd's JetStream log), `meshd-nodedup` (the same
    /// with the topic's `dedup_window_ms` 0), or `jetstream`: the same nats-server
    /// configuration alone, the driver publishing each request's events as one atomic
    /// batch per partition stream itself (`instances` is 0 then).
    pub system: &'static str,
    pub instances: usize,
    pub concurrency: usize,
    pub batch: usize,
    pub repeat_index: usize,
    pub events: u64,
    pub requests: u64,
    pub seconds: f64,
    pub events_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// CPU seconds over the measured window of all meshd instances together.
    pub meshd_cpu_s: f64,
    /// … and of nats-server and etcd.
    pub nats_cpu_s: f64,
    pub etcd_cpu_s: f64,
}

impl ThroughputRun {
    /// A run of `system` with `instances` meshd instances (0 for JetStream alone);
    /// `cpu` is the CPU seconds of meshd, nats-server and etcd over the window.
    fn new(
        (system, instances): (&'static str, usize),
        concurrency: usize,
        batch: usize,
        repeat_index: usize,
        m: &load::Measured,
        [meshd_cpu_s, nats_cpu_s, etcd_cpu_s]: [f64; 3],
    ) -> Self {
        Self {
            system,
            instances,
            concurrency,
            batch,
            repeat_index,
            events: m.events,
            requests: m.requests,
            seconds: m.seconds,
            events_per_sec: m.events as f64 / m.seconds,
            p50_us: m.p50_us,
            p99_us: m.p99_us,
            p999_us: m.p999_us,
            meshd_cpu_s,
            nats_cpu_s,
            etcd_cpu_s,
        }
    }
}

/// Medians over the runs of one (instances, concurrency, batch).
#[derive(Serialize)]
pub struct ThroughputRow {
    pub system: &'static str,
    pub instances: usize,
    pub concurrency: usize,
    pub batch: usize,
    pub runs: usize,
    pub events_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub meshd_cpu_s: f64,
    pub nats_cpu_s: f64,
    pub etcd_cpu_s: f64,
}

/// N instances over 1, ratios of medians.
#[derive(Serialize)]
pub struct ScaleRatio {
    pub concurrency: usize,
    pub batch: usize,
    pub numerator_instances: usize,
    pub denominator_instances: usize,
    pub throughput_ratio: f64,
    pub p50_ratio: f64,
    pub p99_ratio: f64,
}

/// meshd (1 instance) over JetStream itself, ratios of medians.
#[derive(Serialize)]
pub struct PeerRatio {
    pub concurrency: usize,
    pub batch: usize,
    pub throughput_ratio: f64,
    pub p50_ratio: f64,
    /// nats-server's CPU per event under meshd over its CPU per event alone.
    pub nats_cpu_per_event_ratio: f64,
}

/// meshd (1 instance) with publish dedup (the default window) over meshd without it
/// (`dedup_window_ms: 0`), ratios of medians, and the CPU each spends per event.
#[derive(Serialize)]
pub struct DedupRatio {
    pub concurrency: usize,
    pub batch: usize,
    pub throughput_ratio: f64,
    pub p50_ratio: f64,
    /// CPU microseconds per event of meshd and of nats-server, with dedup and without.
    pub meshd_cpu_us_per_event: [f64; 2],
    pub nats_cpu_us_per_event: [f64; 2],
}

const TAKEOVER_MEASURE: &str = "SIGKILL of the instance owning the most partitions -> every \
     partition owned by a survivor (lost ones under a new epoch, GET /v1/cluster) and an \
     event published to each lost partition after the kill handed out by a pull on a survivor";

const CHECKPOINT_MS: u64 = 200;

impl ClusterReport {
    fn takeover_table(&self, s: &mut String) {
        let t = &self.takeover;
        let _ = writeln!(
            s,
            "takeover after SIGKILL ({} instances): until every partition is owned by a survivor \
             and a post-kill event of each lost partition is pulled",
            self.instances
        );
        let _ = writeln!(
            s,
            "{:>4} {:<9} {:>5} {:>8} {:>9} {:>11} {:>12} {:>16}",
            "run",
            "victim",
            "lost",
            "owned s",
            "served s",
            "takeover s",
            "published s",
            "load ok/failed"
        );
        for r in &t.runs {
            let _ = writeln!(
                s,
                "{:>4} {:<9} {:>5} {:>8.3} {:>9.3} {:>11.3} {:>12.3} {:>16}",
                r.repeat_index + 1,
                r.victim,
                r.lost_partitions.len(),
                r.owned_s,
                r.served_s,
                r.takeover_s,
                r.published_s,
                format!("{}/{}", r.load_publishes_ok, r.load_publishes_failed)
            );
        }
        let _ = writeln!(
            s,
            "takeover: median {:.3} s (min {:.3}, max {:.3}) with lease TTL {:.3} s; owner keys alone: median {:.3} s",
            t.median_s,
            t.min_s,
            t.max_s,
            self.lease_ttl_ms as f64 / 1000.0,
            t.owned_median_s
        );
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let t = &self.takeover;
        let _ = writeln!(
            s,
            "meshd-bench cluster: etcd + nats-server ({}) + meshd instances on one machine ({} CPU(s)); \
             lease TTL {} ms, checkpoint {} ms, topic of {} partitions",
            self.log, self.cpus, self.lease_ttl_ms, self.checkpoint_ms, self.partitions
        );
        if !t.runs.is_empty() {
            self.takeover_table(&mut s);
        }
        if !self.footprint.is_empty() {
            let _ = writeln!(
                s,
                "\nMeta (etcd) per delivered event, one instance, etcd's own counters (Txn requests, bytes received)"
            );
            let _ = writeln!(
                s,
                "{:<26} {:>9} {:>8} {:>11} {:>12} {:>11} {:>12}",
                "pattern",
                "delivered",
                "batches",
                "txn/event",
                "bytes/event",
                "txn/batch",
                "bytes/batch"
            );
            for r in &self.footprint {
                let _ = writeln!(
                    s,
                    "{:<26} {:>9} {:>8} {:>11.3} {:>12.1} {:>11.3} {:>12.1}",
                    r.pattern,
                    r.delivered,
                    r.pull_batches,
                    r.txns_per_event,
                    r.bytes_per_event,
                    r.txns_per_batch,
                    r.bytes_per_batch
                );
            }
        }
        if let Some(m) = &self.moves {
            let _ = writeln!(
                s,
                "\nduplicates per move ({} instances, consumer acks at once): {} events, {} deliveries, \
                 {} moves ({} partitions moved), {} duplicates, {:.1} per move",
                self.instances, m.events, m.deliveries, m.moves, m.moved_partitions, m.duplicates, m.duplicates_per_move
            );
        }
        if !self.throughput.is_empty() {
            let _ = writeln!(
                s,
                "\npublish throughput, 1 vs {} instances (worker w -> instance w % n); cpu s over the window",
                self.instances
            );
            let _ = writeln!(
                s,
                "{:<13} {:>9} {:>5} {:>5} {:>11} {:>9} {:>9} {:>10} {:>8} {:>8}",
                "system",
                "instances",
                "conc",
                "batch",
                "events/s",
                "p50 ms",
                "p99 ms",
                "meshd cpu",
                "nats cpu",
                "etcd cpu"
            );
            for r in &self.throughput {
                let _ = writeln!(
                    s,
                    "{:<13} {:>9} {:>5} {:>5} {:>11.0} {:>9.3} {:>9.3} {:>10.2} {:>8.2} {:>8.2}",
                    r.system,
                    r.instances,
                    r.concurrency,
                    r.batch,
                    r.events_per_sec,
                    r.p50_us / 1000.0,
                    r.p99_us / 1000.0,
                    r.meshd_cpu_s,
                    r.nats_cpu_s,
                    r.etcd_cpu_s
                );
            }
            let _ = writeln!(
                s,
                "\nratios of medians, {} instances / 1 (all processes share {} CPU(s)):",
                self.instances, self.cpus
            );
            for r in &self.ratios {
                let _ = writeln!(
                    s,
                    "  conc {:>3} batch {:>4}: throughput x{:.2}  p50 x{:.2}  p99 x{:.2}",
                    r.concurrency, r.batch, r.throughput_ratio, r.p50_ratio, r.p99_ratio
                );
            }
            let _ = writeln!(
                s,
                "\nratios of medians, meshd (1 instance, JetStream log) / JetStream alone \
                 (one atomic batch per partition stream, same nats-server configuration):"
            );
            for r in &self.peer_ratios {
                let _ = writeln!(
                    s,
                    "  conc {:>3} batch {:>4}: throughput x{:.2}  p50 x{:.2}  nats cpu/event x{:.2}",
                    r.concurrency, r.batch, r.throughput_ratio, r.p50_ratio, r.nats_cpu_per_event_ratio
                );
            }
            if !self.dedup_ratios.is_empty() {
                let _ = writeln!(
                    s,
                    "\nwhat publish dedup costs in cluster mode (Nats-Msg-Id and the stream's duplicate window), \
                     ratios of medians, meshd (1 instance) with the default window / with dedup_window_ms 0; \
                     CPU µs per event with / without:"
                );
                for r in &self.dedup_ratios {
                    let _ = writeln!(
                        s,
                        "  conc {:>3} batch {:>4}: throughput x{:.2}  p50 x{:.2}  meshd cpu {:.1}/{:.1} µs  nats cpu {:.1}/{:.1} µs",
                        r.concurrency,
                        r.batch,
                        r.throughput_ratio,
                        r.p50_ratio,
                        r.meshd_cpu_us_per_event[0],
                        r.meshd_cpu_us_per_event[1],
                        r.nats_cpu_us_per_event[0],
                        r.nats_cpu_us_per_event[1]
                    );
                }
            }
        }
        s
    }
}

// ---- the scenario --------------------------------------------------------------------

/// Runs the takeover `repeat` times, then the 1 vs N throughput comparison.
pub async fn run(bins: &Binaries<'_>, s: &Settings) -> Result<ClusterReport> {
    if s.instances < 2 {
        bail!("--cluster-instances must be at least 2 (the takeover kills one)");
    }
    if !(1..=1024).contains(&s.partitions) {
        bail!("--cluster-partitions must be from 1 to 1024");
    }
    if !(1000..=600_000).contains(&s.lease_ttl_ms) {
        bail!("--lease-ttl-ms must be from 1000 to 600000 (meshd's range)");
    }
    let mut takeovers = Vec::new();
    for rep in (0..s.repeat).filter(|_| s.runs("takeover")) {
        eprintln!(
            "meshd-bench: cluster takeover, {} instances, {} partitions, lease TTL {} ms, run {}/{}",
            s.instances,
            s.partitions,
            s.lease_ttl_ms,
            rep + 1,
            s.repeat
        );
        let r = takeover_run(bins, s, rep).await?;
        eprintln!(
            "meshd-bench:   killed {} ({} partitions): owned after {:.3} s, served after {:.3} s",
            r.victim,
            r.lost_partitions.len(),
            r.owned_s,
            r.served_s
        );
        takeovers.push(r);
    }
    let mut fp = Vec::new();
    if s.runs("footprint") {
        eprintln!(
            "meshd-bench: cluster Meta footprint, {} pull batches per pattern",
            s.footprint_batches
        );
        fp = footprint::footprint(bins, s.lease_ttl_ms, s.footprint_batches).await?;
    }
    let mut moves = None;
    if s.runs("moves") {
        eprintln!(
            "meshd-bench: cluster duplicates per move, {} instances, {} events",
            s.instances, s.moves_events
        );
        moves = Some(
            footprint::moves(
                bins,
                s.instances,
                s.partitions,
                s.lease_ttl_ms,
                s.moves_events,
            )
            .await?,
        );
    }
    let mut runs = Vec::new();
    for &batch in &s.batch {
        for &concurrency in &s.concurrency {
            for rep in 0..s.repeat {
                let meshd = [("meshd", 1), ("meshd", s.instances), ("meshd-nodedup", 1)];
                for (system, n) in meshd.into_iter().filter(|(system, _)| s.runs(system)) {
                    eprintln!(
                        "meshd-bench: cluster publish, {system} {n} instance(s) concurrency={concurrency} batch={batch} run {}/{}",
                        rep + 1,
                        s.repeat
                    );
                    let c = PublishRun {
                        system,
                        instances: n,
                        concurrency,
                        batch,
                        rep,
                    };
                    runs.push(throughput_run(bins, s, &c).await?);
                }
                if s.runs("jetstream") {
                    eprintln!(
                        "meshd-bench: cluster publish, JetStream alone ({} streams) concurrency={concurrency} batch={batch} run {}/{}",
                        s.partitions,
                        rep + 1,
                        s.repeat
                    );
                    runs.push(jetstream_run(bins, s, concurrency, batch, rep).await?);
                }
            }
        }
    }
    let mut report = build_report(s, takeovers, runs);
    report.footprint = fp;
    report.moves = moves;
    report.binaries = [bins.meshd, bins.nats, bins.etcd].map(|p| p.display().to_string());
    Ok(report)
}

fn build_report(
    s: &Settings,
    takeovers: Vec<TakeoverRun>,
    runs: Vec<ThroughputRun>,
) -> ClusterReport {
    let times: Vec<f64> = takeovers.iter().map(|r| r.takeover_s).collect();
    let owned: Vec<f64> = takeovers.iter().map(|r| r.owned_s).collect();
    let takeover = TakeoverSummary {
        measure: TAKEOVER_MEASURE,
        median_s: median(&times),
        min_s: times.iter().copied().fold(f64::INFINITY, f64::min),
        max_s: times.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        owned_median_s: median(&owned),
        runs: takeovers,
    };
    let mut keys: Vec<(usize, usize, &'static str, usize)> = Vec::new();
    for r in &runs {
        let k = (r.batch, r.concurrency, r.system, r.instances);
        if !keys.contains(&k) {
            keys.push(k);
        }
    }
    keys.sort_unstable();
    let rows: Vec<ThroughputRow> = keys
        .iter()
        .map(|&(batch, concurrency, system, instances)| {
            let rs: Vec<&ThroughputRun> = runs
                .iter()
                .filter(|r| {
                    (r.batch, r.concurrency, r.system, r.instances)
                        == (batch, concurrency, system, instances)
                })
                .collect();
            let m =
                |f: fn(&ThroughputRun) -> f64| median(&rs.iter().map(|r| f(r)).collect::<Vec<_>>());
            ThroughputRow {
                system,
                instances,
                concurrency,
                batch,
                runs: rs.len(),
                events_per_sec: m(|r| r.events_per_sec),
                p50_us: m(|r| r.p50_us),
                p99_us: m(|r| r.p99_us),
                meshd_cpu_s: m(|r| r.meshd_cpu_s),
                nats_cpu_s: m(|r| r.nats_cpu_s),
                etcd_cpu_s: m(|r| r.etcd_cpu_s),
            }
        })
        .collect();
    let mut ratios = Vec::new();
    let mut peer_ratios = Vec::new();
    let mut dedup_ratios = Vec::new();
    let per_event_us = |cpu_s: f64, r: &ThroughputRow| cpu_s / r.events_per_sec * 1e6;
    for one in rows
        .iter()
        .filter(|r| r.system == "meshd" && r.instances == 1)
    {
        // The row of `system` at this one's concurrency and batch.
        let peer = |system: &str| {
            rows.iter().find(|r| {
                r.system == system && (r.concurrency, r.batch) == (one.concurrency, one.batch)
            })
        };
        if let Some(js) = peer("jetstream") {
            peer_ratios.push(PeerRatio {
                concurrency: one.concurrency,
                batch: one.batch,
                throughput_ratio: one.events_per_sec / js.events_per_sec,
                p50_ratio: one.p50_us / js.p50_us,
                nats_cpu_per_event_ratio: (one.nats_cpu_s / one.events_per_sec)
                    / (js.nats_cpu_s / js.events_per_sec),
            });
        }
        if let Some(off) = peer("meshd-nodedup") {
            dedup_ratios.push(DedupRatio {
                concurrency: one.concurrency,
                batch: one.batch,
                throughput_ratio: one.events_per_sec / off.events_per_sec,
                p50_ratio: one.p50_us / off.p50_us,
                meshd_cpu_us_per_event: [
                    per_event_us(one.meshd_cpu_s, one),
                    per_event_us(off.meshd_cpu_s, off),
                ],
                nats_cpu_us_per_event: [
                    per_event_us(one.nats_cpu_s, one),
                    per_event_us(off.nats_cpu_s, off),
                ],
            });
        }
        if let Some(many) = rows.iter().find(|r| {
            r.system == "meshd"
                && r.instances == s.instances
                && (r.concurrency, r.batch) == (one.concurrency, one.batch)
        }) {
            ratios.push(ScaleRatio {
                concurrency: one.concurrency,
                batch: one.batch,
                numerator_instances: many.instances,
                denominator_instances: 1,
                throughput_ratio: many.events_per_sec / one.events_per_sec,
                p50_ratio: many.p50_us / one.p50_us,
                p99_ratio: many.p99_us / one.p99_us,
            });
        }
    }
    ClusterReport {
        instances: s.instances,
        partitions: s.partitions,
        lease_ttl_ms: s.lease_ttl_ms,
        checkpoint_ms: CHECKPOINT_MS,
        cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        log: JsSync::Always.label(),
        binaries: Default::default(),
        takeover,
        footprint: Vec::new(),
        moves: None,
        throughput: rows,
        ratios,
        peer_ratios,
        dedup_ratios,
        throughput_runs: runs,
    }
}

// ---- the cluster's processes ---------------------------------------------------------

/// One etcd, one nats-server, N meshd. Field order is drop order: the meshd instances
/// go first, then the log, then Meta.
struct Cluster {
    nodes: Vec<Option<Server>>,
    ids: Vec<String>,
    nats: Server,
    etcd: Server,
}

impl Cluster {
    async fn start(n: usize, bins: &Binaries<'_>, lease_ttl_ms: u64) -> Result<Self> {
        let etcd = procs::start_etcd(bins.etcd)?;
        procs::etcd_when_serving(&etcd).await.map_err(|e| {
            anyhow!(
                "etcd did not serve within 30 s: {e:#}\n--- etcd log (last lines) ---\n{}",
                etcd.stderr_tail()
            )
        })?;
        let nats = procs::start_nats(bins.nats, JsSync::Always)?;
        let url = format!("nats://{}", nats.addr);
        procs::retry(Duration::from_secs(30), || async {
            let client = async_nats::connect(&url)
                .await
                .map_err(|e| anyhow!("connecting to {url}: {e}"))?;
            crate::systems::js_request(
                &client,
                "$JS.API.INFO".into(),
                bytes::Bytes::new(),
                "JetStream not ready",
            )
            .await
            .map(drop)
        })
        .await
        .map_err(|e| {
            anyhow!(
                "nats-server did not serve JetStream within 30 s: {e:#}\n--- nats-server stderr (last lines) ---\n{}",
                nats.stderr_tail()
            )
        })?;
        let mut c = Cluster {
            nodes: Vec::new(),
            ids: Vec::new(),
            nats,
            etcd,
        };
        for i in 0..n {
            let id = format!("bench-{i}");
            let args: Vec<String> = [
                "--meta".to_string(),
                format!("etcd://{}", c.etcd.addr),
                "--log".to_string(),
                format!("nats://{}", c.nats.addr),
                "--instance-id".to_string(),
                id.clone(),
                "--lease-ttl-ms".to_string(),
                lease_ttl_ms.to_string(),
                "--checkpoint-ms".to_string(),
                CHECKPOINT_MS.to_string(),
            ]
            .into();
            let server = procs::start_meshd_with(bins.meshd, &args)
                .with_context(|| format!("starting meshd instance {id}"))
                .map_err(|e| c.with_logs(e))?;
            c.nodes.push(Some(server));
            c.ids.push(id);
        }
        for i in 0..n {
            let addr = c.addr(i)?;
            let ready = procs::retry(DEADLINE, || async {
                let (status, body) = call(addr, "GET", "/readyz", None, b"").await?;
                ensure!(
                    status == 200,
                    "/readyz {status}: {}",
                    String::from_utf8_lossy(&body)
                );
                Ok(())
            })
            .await;
            ready
                .with_context(|| format!("{} not ready within {DEADLINE:?}", c.ids[i]))
                .map_err(|e| c.with_logs(e))?;
        }
        Ok(c)
    }

    fn addr(&self, i: usize) -> Result<SocketAddr> {
        self.nodes
            .get(i)
            .and_then(|n| n.as_ref())
            .map(|s| s.addr)
            .ok_or_else(|| anyhow!("instance {i} is not running"))
    }

    fn live(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|i| self.nodes[*i].is_some())
            .collect()
    }

    /// SIGKILLs instance `i` (its temp dir goes with it).
    fn kill(&mut self, i: usize) -> Result<()> {
        let mut server = self
            .nodes
            .get_mut(i)
            .and_then(Option::take)
            .ok_or_else(|| anyhow!("instance {i} is not running"))?;
        server.kill()
    }

    /// SIGSTOPs instance `i` (it keeps its connections, answers nothing).
    fn pause(&self, i: usize) -> Result<()> {
        self.signal(i, libc::SIGSTOP)
    }

    fn resume(&self, i: usize) -> Result<()> {
        self.signal(i, libc::SIGCONT)
    }

    fn signal(&self, i: usize, sig: libc::c_int) -> Result<()> {
        let pid = self
            .nodes
            .get(i)
            .and_then(|n| n.as_ref())
            .map(Server::pid)
            .ok_or_else(|| anyhow!("instance {i} is not running"))?;
        // SAFETY: kill(2) with a pid of a child this process started and still holds.
        let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
        ensure!(
            rc == 0,
            "signal {sig} to instance {i}: {}",
            std::io::Error::last_os_error()
        );
        Ok(())
    }

    fn pids(&self) -> (Vec<u32>, u32, u32) {
        let meshd = self.nodes.iter().flatten().map(Server::pid).collect();
        (meshd, self.nats.pid(), self.etcd.pid())
    }

    /// `e` with the last lines of every process's stderr.
    fn with_logs(&self, e: anyhow::Error) -> anyhow::Error {
        let mut s = format!("{e:#}");
        for (id, node) in self.ids.iter().zip(&self.nodes) {
            if let Some(node) = node {
                let _ = write!(
                    s,
                    "\n--- meshd {id} stderr (last lines) ---\n{}",
                    node.stderr_tail()
                );
            }
        }
        let _ = write!(
            s,
            "\n--- nats-server stderr (last lines) ---\n{}\n--- etcd log (last lines) ---\n{}",
            self.nats.stderr_tail(),
            self.etcd.stderr_tail()
        );
        anyhow!(s)
    }
}

// ---- HTTP ----------------------------------------------------------------------------

/// One request on a fresh connection, with a deadline; the status and the body.
async fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<(u16, Vec<u8>)> {
    let exchange = async {
        let mut c = Conn::connect(addr).await?;
        let r = c.request(method, path, content_type, body).await?;
        anyhow::Ok((r.status, r.body.to_vec()))
    };
    tokio::time::timeout(REQUEST_TIMEOUT, exchange)
        .await
        .map_err(|_| anyhow!("{method} {path} on {addr}: no answer within {REQUEST_TIMEOUT:?}"))?
        .with_context(|| format!("{method} {path} on {addr}"))
}

/// A JSON request that must answer one of `ok`; the answer's JSON (null when empty).
async fn call_json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    content_type: &str,
    body: &Value,
    ok: &[u16],
) -> Result<Value> {
    let bytes = serde_json::to_vec(body)?;
    let (status, answer) = call(addr, method, path, Some(content_type), &bytes).await?;
    ensure!(
        ok.contains(&status),
        "{method} {path} on {addr} answered {status}: {}",
        String::from_utf8_lossy(&answer)
    );
    if answer.is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&answer)
        .with_context(|| format!("{method} {path} on {addr}: the answer is not JSON"))
}

/// Publishes `events` as one batch to [`TOPIC`]; the 201 answer.
async fn publish_batch(addr: SocketAddr, events: Vec<Value>) -> Result<Value> {
    call_json(
        addr,
        "POST",
        &format!("/v1/topics/{TOPIC}/events"),
        "application/cloudevents-batch+json",
        &Value::Array(events),
        &[201],
    )
    .await
}

fn keyed_event(id: &str, key: &str) -> Value {
    json!({
        "specversion": "1.0",
        "id": id,
        "source": "/meshd-bench",
        "type": "bench.takeover",
        "partitionkey": key,
        "datacontenttype": "text/plain",
        "data": "takeover",
    })
}

/// Publishes one event; the partition it landed in.
async fn publish_one(addr: SocketAddr, event: &Value) -> Result<u32> {
    let v = call_json(
        addr,
        "POST",
        &format!("/v1/topics/{TOPIC}/events"),
        "application/cloudevents+json",
        event,
        &[201],
    )
    .await?;
    v["events"][0]["partition"]
        .as_u64()
        .map(|p| p as u32)
        .ok_or_else(|| anyhow!("publish answer without a partition: {v}"))
}

/// A `partitionkey` for every partition, learnt from where probe events land.
async fn partition_keys(addr: SocketAddr, partitions: u32) -> Result<Vec<String>> {
    let mut keys: Vec<Option<String>> = vec![None; partitions as usize];
    let mut next = 0usize;
    for _ in 0..20 {
        let batch: Vec<Value> = (next..next + 4 * partitions as usize)
            .map(|j| keyed_event(&format!("probe-{j}"), &format!("k{j}")))
            .collect();
        next += batch.len();
        let v = publish_batch(addr, batch).await?;
        for e in v["events"].as_array().into_iter().flatten() {
            let (Some(id), Some(p)) = (e["id"].as_str(), e["partition"].as_u64()) else {
                bail!("publish answer row without id or partition: {e}");
            };
            let j = id
                .strip_prefix("probe-")
                .ok_or_else(|| anyhow!("unexpected id {id} in the publish answer"))?;
            if let Some(slot) = keys.get_mut(p as usize) {
                slot.get_or_insert_with(|| format!("k{j}"));
            }
        }
        if keys.iter().all(Option::is_some) {
            return Ok(keys.into_iter().flatten().collect());
        }
    }
    bail!("no partitionkey found for some of the {partitions} partitions after {next} probes")
}

/// The members and the owners of `TOPIC`'s partitions (partition → owner, epoch), as
/// the instance at `addr` reads them from Meta.
struct View {
    members: usize,
    owners: BTreeMap<u32, Option<(String, i64)>>,
}

async fn view(addr: SocketAddr) -> Result<View> {
    let (status, body) = call(addr, "GET", "/v1/cluster", None, b"").await?;
    ensure!(
        status == 200,
        "GET /v1/cluster answered {status}: {}",
        String::from_utf8_lossy(&body)
    );
    let v: Value = serde_json::from_slice(&body).context("GET /v1/cluster: not JSON")?;
    let members = v["members"].as_array().map_or(0, Vec::len);
    let mut owners = BTreeMap::new();
    for p in v["partitions"].as_array().into_iter().flatten() {
        if p["topic"] != TOPIC {
            continue;
        }
        let n = p["partition"]
            .as_u64()
            .ok_or_else(|| anyhow!("GET /v1/cluster: bad partition row {p}"))?;
        let owner = match (p["owner"].as_str(), p["epoch"].as_i64()) {
            (Some(o), Some(e)) => Some((o.to_string(), e)),
            _ => None,
        };
        owners.insert(n as u32, owner);
    }
    Ok(View { members, owners })
}

/// partition → (owner, epoch), every partition owned.
type Owners = BTreeMap<u32, (String, i64)>;

/// Waits until all `members` have joined, every partition is owned and nothing moved
/// for [`SETTLE`]; the owners then.
async fn settle(addr: SocketAddr, members: usize, partitions: u32) -> Result<Owners> {
    let deadline = Instant::now() + DEADLINE;
    let mut stable: Option<(Instant, Owners)> = None;
    loop {
        let now = view(addr).await.and_then(|v| {
            ensure!(
                v.members == members,
                "{} of {members} members joined",
                v.members
            );
            let mut owned = BTreeMap::new();
            for p in 0..partitions {
                match v.owners.get(&p) {
                    Some(Some(o)) => {
                        owned.insert(p, o.clone());
                    }
                    _ => bail!("partition {p} has no owner"),
                }
            }
            Ok(owned)
        });
        match now {
            Ok(owned) => match &stable {
                Some((since, prev)) if *prev == owned => {
                    if since.elapsed() >= SETTLE {
                        return Ok(owned);
                    }
                }
                _ => stable = Some((Instant::now(), owned)),
            },
            Err(e) => {
                stable = None;
                if Instant::now() >= deadline {
                    return Err(e.context(format!(
                        "partition ownership did not settle within {DEADLINE:?}"
                    )));
                }
            }
        }
        if Instant::now() >= deadline {
            bail!("partition ownership kept moving for {DEADLINE:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

struct Delivery {
    id: Value,
    partition: u32,
    event_id: String,
}

async fn pull(addr: SocketAddr) -> Result<Vec<Delivery>> {
    pull_with(addr, &json!({"max_events": 100, "wait_ms": 0})).await
}

async fn pull_with(addr: SocketAddr, body: &Value) -> Result<Vec<Delivery>> {
    let v = call_json(
        addr,
        "POST",
        &format!("/v1/subscriptions/{SUBSCRIPTION}/pull"),
        "application/json",
        body,
        &[200],
    )
    .await?;
    v["deliveries"]
        .as_array()
        .ok_or_else(|| anyhow!("pull answer without deliveries: {v}"))?
        .iter()
        .map(|d| {
            Ok(Delivery {
                id: d["delivery_id"].clone(),
                partition: d["partition"]
                    .as_u64()
                    .ok_or_else(|| anyhow!("delivery without a partition: {d}"))?
                    as u32,
                event_id: d["event"]["id"].as_str().unwrap_or_default().to_string(),
            })
        })
        .collect()
}

async fn ack(addr: SocketAddr, ds: &[Delivery]) -> Result<()> {
    if ds.is_empty() {
        return Ok(());
    }
    let ids: Vec<Value> = ds.iter().map(|d| d.id.clone()).collect();
    call_json(
        addr,
        "POST",
        &format!("/v1/subscriptions/{SUBSCRIPTION}/ack"),
        "application/json",
        &json!({ "delivery_ids": ids }),
        &[200],
    )
    .await
    .map(|_| ())
}

// ---- (a) takeover --------------------------------------------------------------------

async fn takeover_run(bins: &Binaries<'_>, s: &Settings, rep: usize) -> Result<TakeoverRun> {
    let mut c = Cluster::start(s.instances, bins, s.lease_ttl_ms).await?;
    let r = takeover_on(&mut c, s, rep).await;
    r.map_err(|e| c.with_logs(e))
}

async fn takeover_on(c: &mut Cluster, s: &Settings, rep: usize) -> Result<TakeoverRun> {
    let n = s.instances;
    let a0 = c.addr(0)?;
    crate::systems::meshd_put(
        a0,
        &format!("/v1/topics/{TOPIC}"),
        &json!({ "partitions": s.partitions }).to_string(),
    )
    .await?;
    let keys = partition_keys(a0, s.partitions).await?;
    call_json(
        a0,
        "PUT",
        &format!("/v1/subscriptions/{SUBSCRIPTION}"),
        "application/json",
        &json!({"topic": TOPIC, "ack_timeout_ms": 60000}),
        &[200, 201],
    )
    .await?;
    settle(a0, n, s.partitions)
        .await
        .context("before the kill")?;
    // Every partition serves before the kill: one event each, pulled and acked.
    for (p, key) in keys.iter().enumerate() {
        let at = c.addr(p % n)?;
        let landed = publish_one(at, &keyed_event(&format!("pre-{p}"), key)).await?;
        ensure!(landed == p as u32, "pre-{p} landed in partition {landed}");
    }
    let mut seen = BTreeSet::new();
    let deadline = Instant::now() + DEADLINE;
    while seen.len() < s.partitions as usize {
        ensure!(
            Instant::now() < deadline,
            "before the kill, only partitions {seen:?} of {} served an event within {DEADLINE:?}",
            s.partitions
        );
        for i in c.live() {
            let at = c.addr(i)?;
            let ds = pull(at).await?;
            for d in &ds {
                if d.event_id.starts_with("pre-") {
                    seen.insert(d.partition);
                }
            }
            ack(at, &ds).await?;
        }
        tokio::time::sleep(POLL).await;
    }
    let before = settle(a0, n, s.partitions)
        .await
        .context("after every partition served")?;
    // The victim: the instance owning the most partitions (ties: the lowest index).
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for (owner, _) in before.values() {
        *count.entry(owner.as_str()).or_default() += 1;
    }
    let victim = (0..n)
        .max_by_key(|i| (count.get(c.ids[*i].as_str()).copied().unwrap_or(0), n - i))
        .ok_or_else(|| anyhow!("no instance"))?;
    let victim_id = c.ids[victim].clone();
    let lost: Vec<u32> = before
        .iter()
        .filter(|(_, (o, _))| *o == victim_id)
        .map(|(p, _)| *p)
        .collect();
    let survivors: Vec<SocketAddr> = c
        .live()
        .into_iter()
        .filter(|i| *i != victim)
        .map(|i| c.addr(i))
        .collect::<Result<_>>()?;

    // A light publish load to the survivors through the takeover (stopped on every
    // way out of this function).
    let stop = StopOnDrop(Arc::new(AtomicBool::new(false)));
    let load = tokio::spawn(publish_load(
        survivors.clone(),
        s.events.clone(),
        Arc::clone(&stop.0),
    ));

    let killed_at = Instant::now();
    c.kill(victim)?;
    let ttl = Duration::from_millis(s.lease_ttl_ms);
    let deadline = killed_at + ttl + DEADLINE;
    let mut accepted: BTreeMap<u32, Duration> = BTreeMap::new();
    let mut served: BTreeMap<u32, Duration> = BTreeMap::new();
    let mut owned_at: Option<Duration> = None;
    let (mut probe_failures, mut pull_errors) = (0u64, 0u64);
    let mut last_err: Option<anyhow::Error> = None;
    let mut last_view = String::new();
    let mut round = 0usize;
    loop {
        round += 1;
        for &p in &lost {
            if accepted.contains_key(&p) {
                continue;
            }
            let at = survivors[(p as usize + round) % survivors.len()];
            let ev = keyed_event(&format!("post-{p}"), &keys[p as usize]);
            match publish_one(at, &ev).await {
                Ok(landed) if landed == p => {
                    accepted.insert(p, killed_at.elapsed());
                }
                Ok(landed) => bail!("post-{p} landed in partition {landed}"),
                Err(e) => {
                    probe_failures += 1;
                    last_err = Some(e);
                }
            }
        }
        if owned_at.is_none() {
            match view(survivors[round % survivors.len()]).await {
                Ok(v) => {
                    let moved = (0..s.partitions).all(|p| match v.owners.get(&p) {
                        Some(Some((o, e))) => {
                            *o != victim_id && (!lost.contains(&p) || *e > before[&p].1)
                        }
                        _ => false,
                    });
                    if moved {
                        owned_at = Some(killed_at.elapsed());
                    } else {
                        last_view = format!("{:?}", v.owners);
                    }
                }
                Err(e) => last_err = Some(e),
            }
        }
        for &at in &survivors {
            match pull(at).await {
                Ok(ds) => {
                    let now = killed_at.elapsed();
                    for d in &ds {
                        if d.event_id.starts_with("post-") && lost.contains(&d.partition) {
                            served.entry(d.partition).or_insert(now);
                        }
                    }
                    if let Err(e) = ack(at, &ds).await {
                        last_err = Some(e);
                    }
                }
                Err(e) => {
                    pull_errors += 1;
                    last_err = Some(e);
                }
            }
        }
        if owned_at.is_some() && served.len() == lost.len() && accepted.len() == lost.len() {
            break;
        }
        if Instant::now() >= deadline {
            bail!(
                "no takeover within {:?} of the SIGKILL of {victim_id} (lease TTL {ttl:?}): lost partitions {lost:?}, \
                 owned: {}, post-kill events accepted {:?}, served {:?}; last owners {last_view}; last error: {}",
                deadline - killed_at,
                owned_at.is_some(),
                accepted.keys().collect::<Vec<_>>(),
                served.keys().collect::<Vec<_>>(),
                last_err.map(|e| format!("{e:#}")).unwrap_or_else(|| "none".into())
            );
        }
        tokio::time::sleep(POLL).await;
    }
    stop.0.store(true, Ordering::Relaxed);
    let (load_ok, load_failed) = load.await.context("the publish load task panicked")?;
    let secs = |d: Duration| d.as_secs_f64();
    let owned_s = owned_at.map_or(f64::NAN, secs);
    let served_s = served.values().copied().max().map_or(0.0, secs);
    Ok(TakeoverRun {
        repeat_index: rep,
        victim: victim_id,
        lost_partitions: lost,
        owned_s,
        served_s,
        takeover_s: owned_s.max(served_s),
        published_s: accepted.values().copied().max().map_or(0.0, secs),
        load_publishes_ok: load_ok,
        load_publishes_failed: load_failed,
        probe_publish_failures: probe_failures,
        pull_errors,
    })
}

struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// One connection's back-to-back single-event publishes, round-robin over `to`, until
/// `stop`; (accepted, failed).
async fn publish_load(to: Vec<SocketAddr>, events: Events, stop: Arc<AtomicBool>) -> (u64, u64) {
    let (mut ok, mut failed) = (0u64, 0u64);
    let mut conns: Vec<Option<Conn>> = to.iter().map(|_| None).collect();
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let k = i % to.len();
        let body = events.one(&format!("load-{i}"));
        i += 1;
        if conns[k].is_none() {
            match tokio::time::timeout(REQUEST_TIMEOUT, Conn::connect(to[k])).await {
                Ok(Ok(c)) => conns[k] = Some(c),
                _ => {
                    failed += 1;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            }
        }
        let Some(conn) = conns[k].as_mut() else {
            continue;
        };
        let path = format!("/v1/topics/{TOPIC}/events");
        let r = tokio::time::timeout(
            REQUEST_TIMEOUT,
            conn.request("POST", &path, Some("application/cloudevents+json"), &body),
        )
        .await;
        match r {
            Ok(Ok(resp)) if resp.status == 201 => ok += 1,
            _ => {
                failed += 1;
                conns[k] = None;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
    (ok, failed)
}

// ---- (b) 1 vs N ----------------------------------------------------------------------

struct PublishOp {
    conn: Conn,
    events: Events,
    worker: usize,
    seq: u64,
    batch: usize,
    body: Vec<u8>,
    path: String,
}

impl Op for PublishOp {
    fn call(&mut self) -> BoxFuture<'_, Result<()>> {
        async move {
            self.body.clear();
            if self.batch > 1 {
                self.body.push(b'[');
            }
            for i in 0..self.batch {
                if i > 0 {
                    self.body.push(b',');
                }
                let id = format!("{}-{}", self.worker, self.seq);
                self.seq += 1;
                self.events.write(&mut self.body, &id);
            }
            let ct = if self.batch > 1 {
                self.body.push(b']');
                "application/cloudevents-batch+json"
            } else {
                "application/cloudevents+json"
            };
            let r = self
                .conn
                .request("POST", &self.path, Some(ct), &self.body)
                .await?;
            if r.status != 201 {
                bail!(
                    "meshd answered {} to a publish: {}",
                    r.status,
                    String::from_utf8_lossy(&r.body)
                );
            }
            Ok(())
        }
        .boxed()
    }
}

fn cpu_sum(pids: &[u32]) -> Result<f64> {
    pids.iter().map(|p| procs::cpu_seconds(*p)).sum()
}

/// Drives `ops` over `window` and reads the CPU seconds of each group of processes
/// over the measured part (the driver starts it `warmup` after the call).
async fn drive_with_cpu(
    ops: Vec<Box<dyn Op>>,
    batch: usize,
    window: Window,
    groups: [Vec<u32>; 3],
) -> Result<(load::Measured, [f64; 3])> {
    let start = tokio::time::Instant::now();
    let cpu = tokio::spawn(async move {
        tokio::time::sleep_until(start + window.warmup).await;
        let read = || -> Result<[f64; 3]> {
            Ok([
                cpu_sum(&groups[0])?,
                cpu_sum(&groups[1])?,
                cpu_sum(&groups[2])?,
            ])
        };
        let a = read()?;
        tokio::time::sleep_until(start + window.warmup + window.measure).await;
        let b = read()?;
        anyhow::Ok([b[0] - a[0], b[1] - a[1], b[2] - a[2]])
    });
    let m = load::drive_async(ops, batch as u64, window, None).await?;
    let cpu = cpu.await.context("the CPU reader panicked")??;
    Ok((m, cpu))
}

/// The peer of the publish runs: the cluster's nats-server configuration alone (file
/// store, `sync_interval: always`), one stream per partition, and the driver
/// publishing each request's events itself, split over the streams as meshd splits a
/// request over partitions (round robin here, a hash of `id` in meshd: the same share
/// sizes on average), one atomic batch per stream share, the shares concurrently.
/// With one partition this is JetStream's own atomic batch publish.
async fn jetstream_run(
    bins: &Binaries<'_>,
    s: &Settings,
    concurrency: usize,
    batch: usize,
    rep: usize,
) -> Result<ThroughputRun> {
    let nats = procs::start_nats(bins.nats, JsSync::Always)?;
    let url = format!("nats://{}", nats.addr);
    let run = async {
        let client = crate::systems::js_connect(&url).await?;
        let subjects: Vec<String> = (0..s.partitions).map(|p| format!("bench.p.{p}")).collect();
        for (p, subject) in subjects.iter().enumerate() {
            crate::systems::js_create_stream(&client, &format!("BENCH-{p}"), subject).await?;
        }
        let ops: Vec<Box<dyn Op>> = (0..concurrency)
            .map(|worker| {
                Box::new(JsSplitOp {
                    client: client.clone(),
                    events: s.events.clone(),
                    subjects: subjects.clone(),
                    worker,
                    seq: 0,
                    batch,
                }) as Box<dyn Op>
            })
            .collect();
        drive_with_cpu(ops, batch, s.window, [vec![], vec![nats.pid()], vec![]]).await
    };
    let (m, cpu) = crate::systems::with_stderr(&nats, run.await)?;
    Ok(ThroughputRun::new(
        ("jetstream", 0),
        concurrency,
        batch,
        rep,
        &m,
        cpu,
    ))
}

/// One request of the JetStream peer: `batch` events over the partition streams.
struct JsSplitOp {
    client: async_nats::Client,
    events: Events,
    subjects: Vec<String>,
    worker: usize,
    seq: u64,
    batch: usize,
}

impl Op for JsSplitOp {
    fn call(&mut self) -> BoxFuture<'_, Result<()>> {
        async move {
            let mut shares: Vec<Vec<bytes::Bytes>> = vec![Vec::new(); self.subjects.len()];
            for _ in 0..self.batch {
                let id = format!("{}-{}", self.worker, self.seq);
                let share = (self.seq % self.subjects.len() as u64) as usize;
                self.seq += 1;
                shares[share].push(bytes::Bytes::from(self.events.one(&id)));
            }
            let client = &self.client;
            let (worker, seq) = (self.worker, self.seq);
            let sends = shares
                .into_iter()
                .zip(&self.subjects)
                .enumerate()
                .filter(|(_, (share, _))| !share.is_empty())
                .map(|(p, (share, subject))| async move {
                    let id = format!("bench-{worker}-{seq}-{p}");
                    crate::systems::js_atomic_batch(client, subject, share, &id).await
                });
            for r in futures::future::join_all(sends).await {
                r?;
            }
            Ok(())
        }
        .boxed()
    }
}

/// One publish run through meshd.
#[derive(Clone, Copy)]
struct PublishRun {
    /// `meshd`, or `meshd-nodedup` (the topic's `dedup_window_ms` 0).
    system: &'static str,
    instances: usize,
    concurrency: usize,
    batch: usize,
    rep: usize,
}

async fn throughput_run(
    bins: &Binaries<'_>,
    s: &Settings,
    c: &PublishRun,
) -> Result<ThroughputRun> {
    let cluster = Cluster::start(c.instances, bins, s.lease_ttl_ms).await?;
    let r = throughput_on(&cluster, s, c).await;
    r.map_err(|e| cluster.with_logs(e))
}

async fn throughput_on(c: &Cluster, s: &Settings, run: &PublishRun) -> Result<ThroughputRun> {
    let PublishRun {
        system,
        instances: n,
        concurrency,
        batch,
        rep,
    } = *run;
    let a0 = c.addr(0)?;
    let mut topic = json!({ "partitions": s.partitions });
    if system == "meshd-nodedup" {
        topic["dedup_window_ms"] = json!(0);
    }
    crate::systems::meshd_put(a0, &format!("/v1/topics/{TOPIC}"), &topic.to_string()).await?;
    // Publishing needs no owner, but the partition tasks starting and moving cost CPU:
    // measure once that is over.
    settle(a0, n, s.partitions).await?;
    let mut ops: Vec<Box<dyn Op>> = Vec::with_capacity(concurrency);
    for worker in 0..concurrency {
        ops.push(Box::new(PublishOp {
            conn: Conn::connect(c.addr(worker % n)?).await?,
            events: s.events.clone(),
            worker,
            seq: 0,
            batch,
            body: Vec::new(),
            path: format!("/v1/topics/{TOPIC}/events"),
        }));
    }
    let (meshd_pids, nats_pid, etcd_pid) = c.pids();
    let (m, cpu) = drive_with_cpu(
        ops,
        batch,
        s.window,
        [meshd_pids, vec![nats_pid], vec![etcd_pid]],
    )
    .await?;
    Ok(ThroughputRun::new(
        (system, n),
        concurrency,
        batch,
        rep,
        &m,
        cpu,
    ))
}
