//! meshd-bench: meshd side by side with NATS JetStream and with the raw RocksDB engine,
//! on one machine, in one run (issue 8).
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
//! cargo run --release -p meshd-bench -- engine --compare
//! cargo run --release -p meshd-bench -- meta --concurrency 1,16,64   # needs etcd on PATH
//! cargo run --release -p meshd-bench -- all --json bench.json
//! cargo run --release -p meshd-bench -- --tiny          # every scenario once, tiny
//! ```

mod http;
mod load;
mod meta;
mod procs;
mod report;
mod systems;

use anyhow::{bail, Result};
use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;
use systems::System;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Scenario {
    /// Durable publish: meshd vs JetStream (sync always, and its relaxed default).
    Publish,
    /// The raw RocksDB synced-WriteBatch ceiling (`--compare` adds meshd's publish).
    Engine,
    /// Meta: conditional put and fenced transaction through meshd's etcd backend vs
    /// the raw etcd client, and through the embedded backend (needs `etcd` on PATH).
    Meta,
    /// publish, engine and meta; systems alternate within each scenario.
    All,
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
    /// Every scenario once at tiny size (0.5 s, concurrency 1 and 4, batch 1 and 10,
    /// repeat 1), so CI can show the tool still works. Overrides the size flags.
    #[arg(long)]
    tiny: bool,
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
    }
    let scenario = args.scenario.unwrap_or(Scenario::All);
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
        Scenario::Publish => vec![System::Meshd, System::JsAlways, System::JsDefault],
        Scenario::Engine if args.compare => vec![System::Rocksdb, System::Meshd],
        Scenario::Engine => vec![System::Rocksdb],
        Scenario::All => vec![
            System::Meshd,
            System::JsAlways,
            System::JsDefault,
            System::Rocksdb,
        ],
        Scenario::Meta => vec![],
    };
    let meta_systems = match scenario {
        Scenario::Meta | Scenario::All => System::meta_all(),
        _ => vec![],
    };
    let mut groups: Vec<(Vec<System>, Vec<usize>)> = Vec::new();
    if !publish.is_empty() {
        groups.push((publish, args.batch.clone()));
    }
    if !meta_systems.is_empty() {
        groups.push((meta_systems, vec![1]));
    }
    let systems: Vec<System> = groups.iter().flat_map(|(s, _)| s.clone()).collect();
    let meshd = if systems.contains(&System::Meshd) {
        procs::locate_meshd(args.meshd.as_deref())?
    } else {
        PathBuf::new()
    };
    let nats = if systems.contains(&System::JsAlways) {
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
                        eprintln!(
                            "meshd-bench: {} concurrency={concurrency} batch={batch} run {}/{}",
                            system.name(),
                            rep + 1,
                            args.repeat
                        );
                        let outcome = rt.block_on(systems::run(
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
    let report = report::Report::build(
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
    print!("{}", report.table());
    report.write_json(&args.json)?;
    eprintln!("meshd-bench: wrote {}", args.json.display());
    Ok(())
}
