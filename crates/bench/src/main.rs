//! meshd-bench: meshd side by side with NATS JetStream and with the raw RocksDB engine,
//! on one machine, in one run.
//!
//! Every comparison runs its systems alternately (meshd, JetStream, JetStream relaxed,
//! meshd, …) so slow drift of a noisy machine lands on all of them, and reports medians
//! and the ratio of medians. Each run starts its own server on a fresh temp dir. The
//! load comes from this process, on the same cores as the server: on a small machine the
//! client's CPU competes with the server's, for every system alike.
//!
//! ```sh
//! cargo build --release -p meshd -p meshd-bench
//! cargo run --release -p meshd-bench -- publish --concurrency 1,16,64 --batch 1,100
//! cargo run --release -p meshd-bench -- e2e --concurrency 1,16,64 --batch 1,100
//! cargo run --release -p meshd-bench -- engine --compare
//! cargo run --release -p meshd-bench -- meta --concurrency 1,16,64   # needs etcd on PATH
//! cargo run --release -p meshd-bench -- recovery   # 1000 subs x 1000 in flight, 10M events
//! cargo run --release -p meshd-bench -- parked     # 1M events waiting for deliverat: memory, restart
//! cargo run --release -p meshd-bench -- cluster --concurrency 4,16 --batch 1,100 --lease-ttl-ms 2000
//! cargo run --release -p meshd-bench -- cluster --systems meshd,meshd-nodedup,jetstream   # what dedup costs
//! cargo run --release -p meshd-bench -- all --json bench.json
//! cargo run --release -p meshd-bench -- --tiny          # every scenario once, tiny
//! ```

mod catalog;
mod cluster;
mod e2e;
mod http;
mod load;
mod meta;
mod parked;
mod plot;
mod procs;
mod recovery;
mod report;
mod systems;

use anyhow::{bail, Result};
use catalog::System;
use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// Durable publish: meshd vs JetStream (sync always, and its relaxed default).
    Publish,
    /// End to end: publish → pull → ack, meshd vs a JetStream pull consumer with
    /// explicit acks (sync always, and its relaxed default).
    E2e,
    /// The raw RocksDB synced-WriteBatch ceiling (`--compare` adds meshd's publish).
    Engine,
    /// Meta: conditional put and fenced transaction through meshd's etcd backend vs
    /// the raw etcd client, and through the embedded backend (needs `etcd` on PATH).
    Meta,
    /// publish, e2e, engine and meta; systems alternate within each scenario.
    All,
    /// Cluster mode (etcd + nats-server + N meshd): takeover time after SIGKILL of a
    /// partition owner, and publish throughput with N instances vs 1. Needs etcd and
    /// nats-server; not part of `all` (but `--tiny` runs it once).
    Cluster,
    /// Recovery: start → ready after SIGKILL with many in-flight delivery records
    /// (default 1000 subscriptions × 1000) and a long log (default 10 000 000 events),
    /// and peak RSS on the way. Long set-up; not part of `all` (but `--tiny` runs it
    /// once).
    Recovery,
    /// Parked events: memory per event waiting for its `deliverat` (default 1 000 000
    /// of them), parking time, and start → ready after SIGKILL with them. Long set-up;
    /// not part of `all` (but `--tiny` runs it once).
    Parked,
}

#[derive(Parser, Debug)]
#[command(
    name = "meshd-bench",
    about = "meshd vs NATS JetStream vs raw RocksDB, one machine, one run"
)]
struct Args {
    /// The scenario (default: all).
    scenario: Option<Scenario>,
    /// Concurrent in-flight requests (one connection each for meshd), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    concurrency: Vec<usize>,
    /// Events per request, comma-separated: 1 is a single-event request, more is one
    /// batch request to meshd / that many JetStream publishes awaited together.
    #[arg(long, value_delimiter = ',', default_value = "1,100")]
    batch: Vec<usize>,
    /// Measured seconds per run.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Unmeasured warm-up seconds per run (load runs, nothing is recorded).
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// Bytes of `data` per event (the stored CloudEvent is about 130 bytes more).
    #[arg(long, default_value_t = 1024)]
    size: usize,
    /// meta: bytes of the value of every meta write (meshd's records, such as a
    /// subscription or an offset checkpoint, are a few hundred bytes).
    #[arg(long, default_value_t = 128)]
    meta_value_size: usize,
    /// Runs per system and configuration, alternating between systems.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
    /// meshd topic partitions (JetStream gets one stream).
    #[arg(long, default_value_t = 1)]
    partitions: u32,
    /// engine: also run meshd's publish alternately and report it as a fraction.
    #[arg(long)]
    compare: bool,
    /// The meshd binary (default: $CARGO_TARGET_DIR/release/meshd, target/release/meshd,
    /// or next to this binary).
    #[arg(long)]
    meshd: Option<PathBuf>,
    /// Where to write the JSON results.
    #[arg(long, default_value = "meshd-bench.json")]
    json: PathBuf,
    /// Also write a PNG plot of the results (throughput and p99 latency against
    /// concurrency). Text needs a TTF font: DejaVu Sans (Debian's fonts-dejavu-core)
    /// or the file named by MESHD_BENCH_FONT.
    #[arg(long)]
    plot: Option<PathBuf>,
    /// cluster: meshd instances of the larger cluster (the one an owner is killed in,
    /// and N of "N vs 1").
    #[arg(long, default_value_t = 3)]
    cluster_instances: usize,
    /// cluster: partitions of the topic (takeover and throughput).
    #[arg(long, default_value_t = 6)]
    cluster_partitions: u32,
    /// cluster: meshd's `--lease-ttl-ms` (membership and partition-ownership lease;
    /// the takeover time follows it). 2000 as in meshd's cluster tests; at least 1000.
    #[arg(long, default_value_t = 2000)]
    lease_ttl_ms: u64,
    /// recovery: subscriptions, each with `--recovery-in-flight` unacked deliveries.
    #[arg(long, default_value_t = 1000)]
    recovery_subscriptions: u64,
    /// recovery: in-flight deliveries per subscription, comma-separated (one
    /// configuration each).
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    recovery_in_flight: Vec<u64>,
    /// recovery: events in the log, comma-separated (one configuration each).
    #[arg(long, value_delimiter = ',', default_value = "10000000")]
    recovery_events: Vec<u64>,
    /// recovery: bytes of `data` per event (small by default: 10 000 000 events of
    /// 1 KiB would need 11 GB of disk).
    #[arg(long, default_value_t = 64)]
    recovery_data_bytes: usize,
    /// recovery: the topic's publish dedup window in ms (meshd's default when unset;
    /// 0 turns dedup off, so a restart reloads no dedup index: what the index costs).
    #[arg(long)]
    recovery_dedup_window_ms: Option<u64>,
    /// recovery: keep each configuration's data dir after the run (its path is
    /// printed), to start meshd on it again by hand (profiles of one restart).
    #[arg(long)]
    recovery_keep_data: bool,
    /// parked: events waiting for their `deliverat`, comma-separated (one
    /// configuration each).
    #[arg(long, value_delimiter = ',', default_value = "1000000")]
    parked_events: Vec<u64>,
    /// Every scenario once at tiny size (0.5 s, concurrency 1 and 4, batch 1 and 10,
    /// repeat 1), so CI can show the tool still works. Overrides the size flags.
    #[arg(long)]
    tiny: bool,
    /// Only these systems of the scenario, by the names the report prints
    /// (comma-separated, e.g. `meshd-stream-e2e,jetstream-e2e`): for profiling one
    /// system, or for a pair's ratio without the others' runs. The cluster scenario
    /// takes its parts and publish systems: takeover, footprint, moves, meshd,
    /// meshd-nodedup, jetstream (e.g. `meshd,meshd-nodedup` for what dedup costs).
    #[arg(long, value_delimiter = ',')]
    systems: Vec<String>,
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    if args.tiny {
        args.scenario = Some(Scenario::All);
        args.concurrency = vec![1, 4];
        // Batches of 10, not 100: a JetStream batch of 100 synced publishes can take
        // longer than the whole tiny window on a slow disk.
        args.batch = vec![1, 10];
        args.seconds = 0.5;
        args.warmup = 0.1;
        args.repeat = 1;
        args.cluster_partitions = 3;
        args.lease_ttl_ms = 2000;
        args.recovery_subscriptions = 10;
        args.recovery_in_flight = vec![10];
        args.recovery_events = vec![1000];
        args.parked_events = vec![1000];
    }
    let scenario = args.scenario.unwrap_or(Scenario::All);
    if args.plot.is_some() {
        // Fail before the measurements, not after, when no font can be read.
        plot::ensure_font()?;
    }
    if args.concurrency.is_empty() || args.concurrency.contains(&0) {
        bail!("--concurrency: give one or more values of at least 1");
    }
    if args.batch.is_empty() || args.batch.contains(&0) || args.batch.iter().any(|b| *b > 1000) {
        bail!("--batch: give one or more values from 1 to 1000 (meshd's batch limit)");
    }
    if !(args.seconds > 0.0 && args.warmup >= 0.0) || args.repeat == 0 {
        bail!("--seconds must be > 0, --warmup >= 0 and --repeat >= 1");
    }
    // Groups of systems that alternate with each other, and the batch sizes they run
    // at: a meta write is one transaction, so the meta group runs at batch 1 only.
    let publish: Vec<System> = match scenario {
        Scenario::Publish => vec![
            System::Meshd,
            System::MeshdNoDedup,
            System::MeshdHttpFloor,
            System::JsAlways,
            System::JsAtomic,
            System::JsDefault,
        ],
        Scenario::Engine if args.compare => vec![System::Rocksdb, System::Meshd],
        Scenario::Engine => vec![System::Rocksdb],
        Scenario::All => vec![
            System::Meshd,
            System::MeshdNoDedup,
            System::MeshdHttpFloor,
            System::JsAlways,
            System::JsAtomic,
            System::JsDefault,
            System::Rocksdb,
        ],
        Scenario::Meta
        | Scenario::E2e
        | Scenario::Cluster
        | Scenario::Recovery
        | Scenario::Parked => vec![],
    };
    let e2e = match scenario {
        Scenario::E2e | Scenario::All => {
            vec![
                System::E2eMeshd,
                System::E2eMeshdStream,
                System::E2eMeshdWs,
                System::E2eJsAlways,
                System::E2eJsConns,
                System::E2eJsPush,
                System::E2eJsDefault,
            ]
        }
        _ => vec![],
    };
    let meta_systems = match scenario {
        Scenario::Meta | Scenario::All => System::meta_all(),
        _ => vec![],
    };
    let mut groups: Vec<(Vec<System>, Vec<usize>)> = Vec::new();
    for (group, batches) in [
        (publish, args.batch.clone()),
        (e2e, args.batch.clone()),
        (meta_systems, vec![1]),
    ] {
        let group = selected(group, &args.systems);
        if !group.is_empty() {
            groups.push((group, batches));
        }
    }
    let systems: Vec<System> = groups.iter().flat_map(|(s, _)| s.clone()).collect();
    let runs_cluster = scenario == Scenario::Cluster || args.tiny;
    let known = |n: &str| {
        systems.iter().any(|s| s.name() == n) || (runs_cluster && cluster::PARTS.contains(&n))
    };
    if let Some(unknown) = args.systems.iter().find(|n| !known(n)) {
        bail!("--systems: {unknown:?} is not a system of this scenario");
    }
    let meshd = if systems
        .iter()
        .any(|s| !matches!(s, System::Meta(..)) && s.name().starts_with("meshd"))
    {
        procs::locate_meshd(args.meshd.as_deref())?
    } else {
        PathBuf::new()
    };
    let nats = if systems.iter().any(|s| s.name().starts_with("jetstream")) {
        Some(procs::locate_nats()?)
    } else {
        None
    };
    let etcd = if systems.iter().any(|s| matches!(s, System::Meta(..))) {
        Some(procs::locate_etcd()?)
    } else {
        None
    };
    let rt = tokio::runtime::Runtime::new()?;
    let meta_value: std::sync::Arc<[u8]> = vec![b'v'; args.meta_value_size].into();
    let events = systems::Events::new(args.size);
    let window = load::Window {
        warmup: Duration::from_secs_f64(args.warmup),
        measure: Duration::from_secs_f64(args.seconds),
    };
    let mut runs = Vec::new();
    for (systems, batches) in &groups {
        for &batch in batches {
            for &concurrency in &args.concurrency {
                let cfg = systems::Config {
                    concurrency,
                    batch,
                    window,
                    events: events.clone(),
                    partitions: args.partitions,
                    meta_value: meta_value.clone(),
                };
                for rep in 0..args.repeat {
                    for &system in systems {
                        if system == System::JsAtomic && batch == 1 {
                            continue; // a batch of one is a plain publish: the jetstream row
                        }
                        if system == System::MeshdHttpFloor && batch != 1 {
                            continue; // one request is one call: a floor per request
                        }
                        eprintln!(
                            "meshd-bench: {} concurrency={concurrency} batch={batch} run {}/{}",
                            system.name(),
                            rep + 1,
                            args.repeat
                        );
                        let outcome = rt.block_on(catalog::run(
                            system,
                            &cfg,
                            &meshd,
                            nats.as_deref(),
                            etcd.as_deref(),
                        ))?;
                        let bytes = match system {
                            System::Meta(..) => args.meta_value_size,
                            _ => events.doc_bytes(),
                        };
                        runs.push(report::Run::new(system, &cfg, rep, bytes, outcome));
                    }
                }
            }
        }
    }
    // Scenario 6 runs after the others, on its own processes.
    let cluster_report = if runs_cluster {
        let bins = (
            procs::locate_meshd(args.meshd.as_deref())?,
            procs::locate_nats()?,
            procs::locate_etcd()?,
        );
        let largest = |v: &[usize]| v.iter().copied().max().unwrap_or(1);
        let settings = cluster::Settings {
            instances: args.cluster_instances,
            partitions: args.cluster_partitions,
            lease_ttl_ms: args.lease_ttl_ms,
            // --tiny: one configuration (the largest), 1 vs N once.
            concurrency: if args.tiny {
                vec![largest(&args.concurrency)]
            } else {
                args.concurrency.clone()
            },
            batch: if args.tiny {
                vec![largest(&args.batch)]
            } else {
                args.batch.clone()
            },
            window,
            repeat: args.repeat,
            events: events.clone(),
            footprint_batches: if args.tiny { 50 } else { 500 },
            moves_events: if args.tiny { 300 } else { 3000 },
            only: args
                .systems
                .iter()
                .filter(|n| cluster::PARTS.contains(&n.as_str()))
                .cloned()
                .collect(),
        };
        let bins = cluster::Binaries {
            meshd: &bins.0,
            nats: &bins.1,
            etcd: &bins.2,
        };
        Some(rt.block_on(cluster::run(&bins, &settings))?)
    } else {
        None
    };
    // Scenario 5, on its own meshd and data dirs.
    let recovery_report = if scenario == Scenario::Recovery || args.tiny {
        let params = recovery::Params {
            subscriptions: args.recovery_subscriptions,
            in_flight: args.recovery_in_flight.clone(),
            events: args.recovery_events.clone(),
            data_bytes: args.recovery_data_bytes,
            dedup_window_ms: args.recovery_dedup_window_ms,
            keep_data: args.recovery_keep_data,
            repeat: args.repeat,
        };
        let meshd = procs::locate_meshd(args.meshd.as_deref())?;
        Some(rt.block_on(recovery::run(&meshd, &params))?)
    } else {
        None
    };
    // Scenario 7, on its own meshd and data dirs.
    let parked_report = if scenario == Scenario::Parked || args.tiny {
        let params = parked::Params {
            events: args.parked_events.clone(),
            data_bytes: args.recovery_data_bytes,
            repeat: args.repeat,
        };
        let meshd = procs::locate_meshd(args.meshd.as_deref())?;
        Some(rt.block_on(parked::run(&meshd, &params))?)
    } else {
        None
    };
    let mut report = report::Report::build(
        report::Meta {
            scenario: format!("{scenario:?}").to_lowercase(),
            seconds: args.seconds,
            warmup: args.warmup,
            data_bytes: args.size,
            event_bytes: events.doc_bytes(),
            repeat: args.repeat,
            partitions: args.partitions,
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0),
            tiny: args.tiny,
            meshd: meshd.display().to_string(),
            nats_server: nats.map(|p| p.display().to_string()),
            etcd: etcd.map(|p| p.display().to_string()),
            meta_value_bytes: args.meta_value_size,
        },
        runs,
    );
    report.cluster = cluster_report;
    report.recovery = recovery_report;
    report.parked = parked_report;
    print!("{}", report.table());
    if let Some(c) = &report.cluster {
        if !report.rows.is_empty() {
            println!();
        }
        print!("{}", c.table());
    }
    if let Some(r) = &report.recovery {
        println!();
        print!("{}", r.table());
    }
    if let Some(r) = &report.parked {
        println!();
        print!("{}", r.table());
    }
    report.write_json(&args.json)?;
    eprintln!("meshd-bench: wrote {}", args.json.display());
    if let Some(path) = &args.plot {
        plot::write_png(&report, path)?;
        eprintln!("meshd-bench: wrote {}", path.display());
    }
    Ok(())
}

/// The systems of `group` that `only` names (all of them when `only` is empty).
fn selected(group: Vec<System>, only: &[String]) -> Vec<System> {
    if only.is_empty() {
        return group;
    }
    group
        .into_iter()
        .filter(|s| only.iter().any(|n| n == s.name()))
        .collect()
}
