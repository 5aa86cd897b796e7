//! Results: every run as measured, one row per system and configuration with the
//! medians over its runs, and the ratios of medians that the comparisons are about.

use crate::catalog::System;
use crate::load::median;
use crate::systems::{Config, Outcome};
use anyhow::{Context, Result};
use serde::Serialize;
use std::fmt::Write;
use std::path::Path;

#[derive(Serialize)]
pub struct Meta {
    pub scenario: String,
    pub seconds: f64,
    pub warmup: f64,
    /// Bytes of `data` per event.
    pub data_bytes: usize,
    /// Bytes of one stored CloudEvent document (what every system stores per event).
    pub event_bytes: usize,
    pub repeat: usize,
    pub partitions: u32,
    pub cpus: usize,
    pub tiny: bool,
    pub meshd: String,
    pub nats_server: Option<String>,
    pub etcd: Option<String>,
    /// Bytes of the value of every meta write (scenario meta).
    pub meta_value_bytes: usize,
}

#[derive(Serialize)]
pub struct Run {
    pub scenario: &'static str,
    pub system: &'static str,
    pub durability: &'static str,
    pub concurrency: usize,
    pub batch: usize,
    pub repeat_index: usize,
    pub event_bytes: usize,
    pub events: u64,
    pub requests: u64,
    pub seconds: f64,
    pub events_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// CPU seconds over the measured window: the server's for meshd, JetStream and etcd
    /// (the meta rows through etcd), this process's own (engine plus driver) for rocksdb
    /// and the embedded meta.
    pub cpu_s: Option<f64>,
    /// This process's CPU seconds over the window (driver plus client library), for
    /// runs driven by the async driver; for the meta rows through etcd it is what the
    /// client side of a Meta write costs.
    pub client_cpu_s: Option<f64>,
    pub peak_rss_bytes: Option<u64>,
}

impl Run {
    pub fn new(
        system: System,
        cfg: &Config,
        repeat_index: usize,
        event_bytes: usize,
        o: Outcome,
    ) -> Self {
        let m = o.measured;
        Self {
            scenario: system.scenario(),
            system: system.name(),
            durability: system.durability(),
            concurrency: cfg.concurrency,
            batch: cfg.batch,
            repeat_index,
            event_bytes,
            events: m.events,
            requests: m.requests,
            seconds: m.seconds,
            events_per_sec: m.events as f64 / m.seconds,
            p50_us: m.p50_us,
            p99_us: m.p99_us,
            p999_us: m.p999_us,
            cpu_s: m.cpu_s,
            client_cpu_s: m.client_cpu_s,
            peak_rss_bytes: o.peak_rss_bytes,
        }
    }
}

/// The medians over a system's runs of one configuration.
#[derive(Serialize)]
pub struct Row {
    pub scenario: &'static str,
    pub system: &'static str,
    pub durability: &'static str,
    pub concurrency: usize,
    pub batch: usize,
    pub runs: usize,
    pub events_per_sec: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub cpu_s: Option<f64>,
    /// CPU microseconds per event (median over runs).
    pub cpu_us_per_event: Option<f64>,
    /// This process's CPU microseconds per event (median over runs), see
    /// [`Run::client_cpu_s`].
    pub client_cpu_us_per_event: Option<f64>,
    pub peak_rss_bytes: Option<f64>,
}

#[derive(Serialize)]
pub struct Ratio {
    pub concurrency: usize,
    pub batch: usize,
    pub numerator: &'static str,
    pub denominator: &'static str,
    /// Median events/s of `numerator` over the median of `denominator`.
    pub throughput_ratio: f64,
    /// Median p50 latency of `numerator` over that of `denominator` (the meta
    /// overhead target: at most 1.10 for meshd's etcd backend over the raw client).
    pub p50_ratio: f64,
    pub p99_ratio: f64,
    /// Client-side CPU per event of `numerator` over that of `denominator`, when both
    /// have it (the meta comparison: what meshd's etcd backend adds on the client,
    /// steadier than throughput while etcd and the client share the cores).
    pub client_cpu_ratio: Option<f64>,
}

#[derive(Serialize)]
pub struct Report {
    pub meta: Meta,
    pub rows: Vec<Row>,
    pub ratios: Vec<Ratio>,
    pub runs: Vec<Run>,
    /// Scenario 6 (cluster mode: takeover and 1 vs N instances), when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<crate::cluster::ClusterReport>,
    /// Scenario 5 (recovery time and memory), when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery: Option<crate::recovery::RecoveryReport>,
    /// Scenario 7 (parked events: memory and restart), when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parked: Option<crate::parked::ParkedReport>,
}

fn opt_median(v: Vec<Option<f64>>) -> Option<f64> {
    let v: Option<Vec<f64>> = v.into_iter().collect();
    v.map(|v| median(&v))
}

/// The median over `runs` of CPU microseconds per event, from the CPU seconds `cpu`
/// picks (`None` when a run lacks them).
fn per_event(runs: &[&Run], cpu: fn(&Run) -> Option<f64>) -> Option<f64> {
    opt_median(
        runs.iter()
            .map(|r| cpu(r).map(|c| c * 1e6 / r.events.max(1) as f64))
            .collect(),
    )
}

impl Report {
    pub fn build(meta: Meta, runs: Vec<Run>) -> Self {
        let mut keys: Vec<(&'static str, usize, usize)> = Vec::new();
        for r in &runs {
            let k = (r.system, r.concurrency, r.batch);
            if !keys.contains(&k) {
                keys.push(k);
            }
        }
        // Rows grouped by scenario group (meta last) and configuration, systems in the
        // order they ran.
        let is_meta = |system: &str| {
            runs.iter()
                .any(|r| r.system == system && r.scenario == "meta")
        };
        keys.sort_by_key(|&(system, c, b)| (is_meta(system), b, c));
        let rows: Vec<Row> = keys
            .iter()
            .map(|&(system, concurrency, batch)| {
                let rs: Vec<&Run> = runs
                    .iter()
                    .filter(|r| (r.system, r.concurrency, r.batch) == (system, concurrency, batch))
                    .collect();
                let m = |f: fn(&Run) -> f64| median(&rs.iter().map(|r| f(r)).collect::<Vec<_>>());
                Row {
                    scenario: rs[0].scenario,
                    system,
                    durability: rs[0].durability,
                    concurrency,
                    batch,
                    runs: rs.len(),
                    events_per_sec: m(|r| r.events_per_sec),
                    p50_us: m(|r| r.p50_us),
                    p99_us: m(|r| r.p99_us),
                    p999_us: m(|r| r.p999_us),
                    cpu_s: opt_median(rs.iter().map(|r| r.cpu_s).collect()),
                    cpu_us_per_event: per_event(&rs, |r| r.cpu_s),
                    client_cpu_us_per_event: per_event(&rs, |r| r.client_cpu_s),
                    peak_rss_bytes: opt_median(
                        rs.iter()
                            .map(|r| r.peak_rss_bytes.map(|b| b as f64))
                            .collect(),
                    ),
                }
            })
            .collect();
        let mut ratios = Vec::new();
        let pairs = [
            ("meshd", "jetstream"),
            ("meshd", "jetstream-atomic"),
            ("meshd", "jetstream-relaxed"),
            ("meshd", "rocksdb"),
            ("meshd-e2e", "jetstream-e2e"),
            ("meshd-e2e", "jetstream-conns-e2e"),
            ("meshd-e2e", "jetstream-relaxed-e2e"),
            ("meshd-stream-e2e", "jetstream-e2e"),
            ("meshd-stream-e2e", "jetstream-push-e2e"),
            ("meshd-stream-e2e", "meshd-e2e"),
            ("meshd-ws-e2e", "jetstream-e2e"),
            ("meshd-ws-e2e", "jetstream-push-e2e"),
            ("meshd-etcd/cas", "raw-etcd/cas"),
            ("meshd-etcd/fenced", "raw-etcd/fenced"),
        ];
        for &(_, concurrency, batch) in &keys {
            for (num, den) in pairs {
                let find = |s: &str| {
                    rows.iter()
                        .find(|r| (r.system, r.concurrency, r.batch) == (s, concurrency, batch))
                };
                if let (Some(n), Some(d)) = (find(num), find(den)) {
                    if ratios.iter().any(|r: &Ratio| {
                        (r.numerator, r.denominator, r.concurrency, r.batch)
                            == (num, den, concurrency, batch)
                    }) {
                        continue;
                    }
                    ratios.push(Ratio {
                        concurrency,
                        batch,
                        numerator: n.system,
                        denominator: d.system,
                        throughput_ratio: n.events_per_sec / d.events_per_sec,
                        p50_ratio: n.p50_us / d.p50_us,
                        p99_ratio: n.p99_us / d.p99_us,
                        client_cpu_ratio: n
                            .client_cpu_us_per_event
                            .zip(d.client_cpu_us_per_event)
                            .map(|(n, d)| n / d),
                    });
                }
            }
        }
        Self {
            meta,
            rows,
            ratios,
            runs,
            cluster: None,
            recovery: None,
            parked: None,
        }
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let m = &self.meta;
        let (meta_rows, rows): (Vec<&Row>, Vec<&Row>) =
            self.rows.iter().partition(|r| r.scenario == "meta");
        let (meta_ratios, ratios): (Vec<&Ratio>, Vec<&Ratio>) = self
            .ratios
            .iter()
            .partition(|r| meta_rows.iter().any(|m| m.system == r.numerator));
        if !rows.is_empty() {
            let _ = writeln!(
                s,
                "meshd-bench {}: {} B events ({} B data), {} s measured after {} s warm-up, median of {} run(s), {} CPU(s), meshd topic partitions {}",
                m.scenario, m.event_bytes, m.data_bytes, m.seconds, m.warmup, m.repeat, m.cpus, m.partitions
            );
            table_rows(&mut s, "events/s", 18, &rows);
            write_ratios(&mut s, &ratios, false);
        }
        if !meta_rows.is_empty() {
            if !rows.is_empty() {
                s.push('\n');
            }
            let _ = writeln!(
                s,
                "meshd-bench meta: {} B values, {} s measured after {} s warm-up, median of {} run(s), {} CPU(s)\n\
                 cas = put-if-absent on a fresh key; fenced = compare owner mod_revision + put; \
                 one request per op (batch 1)",
                m.meta_value_bytes, m.seconds, m.warmup, m.repeat, m.cpus
            );
            table_rows(&mut s, "ops/s", 21, &meta_rows);
            write_ratios(&mut s, &meta_ratios, true);
        }
        s
    }

    pub fn write_json(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_vec_pretty(self)?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))
    }
}

fn table_rows(s: &mut String, unit: &str, width: usize, rows: &[&Row]) {
    let per = if unit == "ops/s" {
        "cpu us/op"
    } else {
        "cpu us/ev"
    };
    let _ = writeln!(
        s,
        "{:<width$} {:>5} {:>5} {:>11} {:>9} {:>9} {:>9} {:>7} {:>8} {:>8}  durability",
        "system", "conc", "batch", unit, "p50 ms", "p99 ms", "p999 ms", "cpu s", per, "rss MiB"
    );
    for r in rows {
        let opt = |v: Option<f64>, prec: usize| {
            v.map(|x| format!("{x:.prec$}"))
                .unwrap_or_else(|| "-".into())
        };
        let _ = writeln!(
            s,
            "{:<width$} {:>5} {:>5} {:>11.0} {:>9.3} {:>9.3} {:>9.3} {:>7} {:>8} {:>8}  {}",
            r.system,
            r.concurrency,
            r.batch,
            r.events_per_sec,
            r.p50_us / 1000.0,
            r.p99_us / 1000.0,
            r.p999_us / 1000.0,
            opt(r.cpu_s, 2),
            opt(r.cpu_us_per_event, 1),
            opt(r.peak_rss_bytes.map(|b| b / (1024.0 * 1024.0)), 0),
            r.durability
        );
    }
}

fn write_ratios(s: &mut String, ratios: &[&Ratio], meta: bool) {
    if ratios.is_empty() {
        return;
    }
    if meta {
        let _ = writeln!(
            s,
            "\nratios of medians, meshd's etcd backend / raw etcd-client (target: overhead at most 5%; \
             client cpu = this process's CPU per op, the client side of each write):"
        );
    } else {
        let _ = writeln!(s, "\nratios of medians (throughput; p50 and p99 latency):");
    }
    let width = if meta { 15 } else { 18 };
    for r in ratios {
        let client = match (meta, r.client_cpu_ratio) {
            (true, Some(c)) => format!("  client cpu/op x{c:.2}"),
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "  conc {:>3} batch {:>4}: {} / {:<width$} throughput x{:.2}  p50 x{:.2}  p99 x{:.2}{client}",
            r.concurrency,
            r.batch,
            r.numerator,
            r.denominator,
            r.throughput_ratio,
            r.p50_ratio,
            r.p99_ratio
        );
    }
}
