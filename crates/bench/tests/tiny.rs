//! The bench still works: `meshd-bench --tiny` runs every scenario once at tiny size
//! against real processes and writes a JSON row with non-zero throughput for each.
//! No speed is asserted: benchmarks are never timed assertions in tests.
//!
//! It needs the `meshd` binary of the same target dir (`target/debug/meshd`).
//! `cargo nextest run --workspace` builds every binary of the workspace first (meshd
//! has integration tests, so its binary is built); with `-p meshd-bench` alone, run
//! `cargo build -p meshd` first. And it needs nats-server (`source scripts/env.sh &&
//! meshd_need_nats`) and etcd on PATH for the meta and cluster scenarios
//! (`scripts/test` installs Debian's etcd-server).

use std::path::PathBuf;
use std::process::Command;

fn meshd_binary() -> PathBuf {
    let bench = PathBuf::from(env!("CARGO_BIN_EXE_meshd-bench"));
    let meshd = bench
        .parent()
        .expect("the bench binary has a directory")
        .join("meshd");
    assert!(
        meshd.is_file(),
        "no meshd binary at {} (next to meshd-bench): build it first with `cargo build -p meshd` \
         (`cargo nextest run --workspace` does so)",
        meshd.display()
    );
    meshd
}

/// The meta scenario starts a real etcd; without one the bench (rightly) fails, so say
/// what is missing before running it rather than after.
fn require_etcd_on_path() {
    let path = std::env::var_os("PATH").unwrap_or_default();
    assert!(
        std::env::split_paths(&path).any(|d| d.join("etcd").is_file()),
        "etcd is not on PATH: the meta scenario of `meshd-bench --tiny` needs it; install \
         Debian's etcd-server (`apt-get install etcd-server`) or run scripts/test"
    );
}

#[test]
fn given_tiny_flag_when_bench_runs_then_every_scenario_has_a_row_with_throughput() {
    let meshd = meshd_binary();
    require_etcd_on_path();
    let dir = tempfile::tempdir().expect("a temp dir");
    let json = dir.path().join("bench.json");
    let plot = dir.path().join("bench.png");
    let out = Command::new(env!("CARGO_BIN_EXE_meshd-bench"))
        .arg("--tiny")
        .arg("--meshd")
        .arg(&meshd)
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&plot)
        .output()
        .expect("meshd-bench starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "meshd-bench --tiny failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(stdout.contains("events/s"), "a table on stdout:\n{stdout}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the JSON file")).expect("JSON");
    let rows = report["rows"].as_array().expect("rows");
    for (scenario, system) in [
        ("publish", "meshd"),
        ("publish", "meshd-nodedup"),
        ("publish", "jetstream"),
        ("publish", "jetstream-atomic"),
        ("publish", "jetstream-relaxed"),
        ("e2e", "meshd-e2e"),
        ("e2e", "jetstream-e2e"),
        ("e2e", "jetstream-conns-e2e"),
        ("e2e", "jetstream-relaxed-e2e"),
        ("e2e", "meshd-stream-e2e"),
        ("e2e", "meshd-ws-e2e"),
        ("e2e", "jetstream-push-e2e"),
        ("engine", "rocksdb"),
        ("meta", "meshd-etcd/cas"),
        ("meta", "raw-etcd/cas"),
        ("meta", "meshd-embedded/cas"),
        ("meta", "meshd-etcd/fenced"),
        ("meta", "raw-etcd/fenced"),
        ("meta", "meshd-embedded/fenced"),
    ] {
        let mine: Vec<_> = rows
            .iter()
            .filter(|r| r["scenario"] == scenario && r["system"] == system)
            .collect();
        assert!(!mine.is_empty(), "no {scenario}/{system} row in {rows:#?}");
        for r in mine {
            let tput = r["events_per_sec"].as_f64().unwrap_or(0.0);
            assert!(tput > 0.0, "zero throughput in {r:#}");
        }
    }
    let ratios = report["ratios"].as_array().expect("ratios");
    assert!(
        ratios
            .iter()
            .any(|r| r["numerator"] == "meshd" && r["denominator"] == "rocksdb"),
        "meshd as a fraction of the engine: {ratios:#?}"
    );
    for (num, den) in [
        ("meshd-e2e", "jetstream-conns-e2e"),
        ("meshd-stream-e2e", "jetstream-e2e"),
        ("meshd-stream-e2e", "jetstream-push-e2e"),
    ] {
        assert!(
            ratios
                .iter()
                .any(|r| r["numerator"] == num && r["denominator"] == den),
            "the ratio {num} / {den}: {ratios:#?}"
        );
    }
    for (num, den) in [
        ("meshd-etcd/cas", "raw-etcd/cas"),
        ("meshd-etcd/fenced", "raw-etcd/fenced"),
    ] {
        assert!(
            ratios.iter().any(|r| r["numerator"] == num
                && r["denominator"] == den
                && r["client_cpu_ratio"].as_f64().unwrap_or(0.0) > 0.0),
            "the meta overhead ratio {num} / {den} with the client's CPU: {ratios:#?}"
        );
    }
    assert!(
        stdout.contains("ops/s"),
        "a meta table on stdout:\n{stdout}"
    );
    // Scenario 6 (cluster mode: etcd + nats-server + 3 meshd): one takeover after a
    // SIGKILL and publish throughput with 1 and with 3 instances.
    let cluster = &report["cluster"];
    assert!(cluster.is_object(), "a cluster section in the JSON");
    let takeovers = cluster["takeover"]["runs"]
        .as_array()
        .expect("takeover runs");
    assert!(!takeovers.is_empty(), "a takeover run: {cluster:#}");
    for t in takeovers {
        let s = t["takeover_s"].as_f64().unwrap_or(0.0);
        assert!(s > 0.0, "a measured takeover in {t:#}");
    }
    let throughput = cluster["throughput"]
        .as_array()
        .expect("cluster throughput rows");
    for (system, n) in [("meshd", 1), ("meshd", 3), ("jetstream", 0)] {
        assert!(
            throughput.iter().any(|r| r["system"] == system
                && r["instances"] == n
                && r["events_per_sec"].as_f64().unwrap_or(0.0) > 0.0),
            "a {system} throughput row with {n} instance(s): {throughput:#?}"
        );
    }
    assert!(
        !cluster["peer_ratios"]
            .as_array()
            .map(Vec::is_empty)
            .unwrap_or(true),
        "meshd / JetStream ratios: {cluster:#}"
    );
    assert!(
        stdout.contains("takeover after SIGKILL"),
        "a cluster table on stdout:\n{stdout}"
    );
    // Meta per delivered event for both consumer patterns, and duplicates per move.
    let footprint = cluster["footprint"].as_array().expect("footprint rows");
    assert_eq!(footprint.len(), 2, "{footprint:#?}");
    for r in footprint {
        assert!(r["delivered"].as_u64().unwrap_or(0) > 0, "{r:#}");
        assert!(r["txns_per_batch"].as_f64().unwrap_or(0.0) > 0.0, "{r:#}");
        assert!(r["bytes_per_batch"].as_f64().unwrap_or(0.0) > 0.0, "{r:#}");
    }
    let moves = &cluster["moves"];
    assert_eq!(moves["moves"], 2, "{moves:#}");
    assert!(
        moves["deliveries"].as_u64().unwrap_or(0) >= moves["events"].as_u64().unwrap_or(1),
        "every event delivered: {moves:#}"
    );
    assert!(
        stdout.contains("duplicates per move") && stdout.contains("per delivered event"),
        "the footprint and move tables on stdout:\n{stdout}"
    );
    let png = std::fs::read(&plot).expect("the PNG plot");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG file");
    // Scenario 5: a restart after SIGKILL re-arms every in-flight record.
    let recovery = report["recovery"]["rows"]
        .as_array()
        .expect("a recovery section in the JSON");
    assert!(!recovery.is_empty(), "a recovery row");
    for r in recovery {
        let expected = r["in_flight_records"].as_u64().unwrap_or(0);
        assert!(expected > 0, "in-flight records were set up: {r:#}");
        for restart in r["restarts"].as_array().expect("restarts") {
            assert_eq!(
                restart["recovery_records"].as_u64(),
                Some(expected),
                "every in-flight record re-armed: {restart:#}"
            );
            assert!(restart["ready_seconds"].as_f64().unwrap_or(0.0) > 0.0);
        }
    }
    // Scenario 7: every event parked, and still parked after a SIGKILL.
    let parked = report["parked"]["rows"]
        .as_array()
        .expect("a parked section in the JSON");
    assert_eq!(parked.len(), 2, "a delayed row and its control");
    for r in parked {
        let n = r["events"].as_u64().unwrap_or(0);
        assert!(n > 0, "{r:#}");
        assert!(r["parked_rss_bytes"].as_u64().unwrap_or(0) > 0, "{r:#}");
        let want = if r["delayed"] == true { n } else { 0 };
        for restart in r["restarts"].as_array().expect("restarts") {
            assert_eq!(restart["parked"].as_u64(), Some(want), "{restart:#}");
        }
    }
    assert!(
        stdout.contains("meshd-bench parked"),
        "the parked table:\n{stdout}"
    );
}
