//! The bench still works: `meshd-bench --tiny` runs every scenario once at tiny size
//! against real processes and writes a JSON row with non-zero throughput for each.
//! No speed is asserted: benchmarks are never timed assertions in tests.
//!
//! It needs the `meshd` binary of the same target dir (`target/debug/meshd`).
//! `cargo nextest run --workspace` builds every binary of the workspace first (meshd
//! has integration tests, so its binary is built); with `-p meshd-bench` alone, run
//! `cargo build -p meshd` first. And it needs nats-server (`source scripts/env.sh &&
//! meshd_need_nats`).

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

#[test]
fn given_tiny_flag_when_bench_runs_then_every_scenario_has_a_row_with_throughput() {
    let meshd = meshd_binary();
    let dir = tempfile::tempdir().expect("a temp dir");
    let json = dir.path().join("bench.json");
    let out = Command::new(env!("CARGO_BIN_EXE_meshd-bench"))
        .arg("--tiny")
        .arg("--meshd")
        .arg(&meshd)
        .arg("--json")
        .arg(&json)
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
        ("publish", "jetstream"),
        ("publish", "jetstream-relaxed"),
        ("engine", "rocksdb"),
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
}
