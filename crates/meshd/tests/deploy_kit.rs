//! The operations kit in `deploy/` (issue 26) cannot drift from meshd: every metric the
//! alert rules and the Grafana dashboard use is one meshd renders, the rules pass
//! `promtool check rules` (Debian's `prometheus` package; scripts/test installs it),
//! and the dashboard is a Grafana dashboard whose panels all query something.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

fn workspace() -> PathBuf {
    // At run time: a test binary reused from another checkout's build would name
    // that checkout.
    Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

fn sources(dir: &Path, out: &mut String) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if !p.ends_with("target") && !p.ends_with("tests") {
                sources(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push_str(&std::fs::read_to_string(&p).unwrap_or_default());
        }
    }
}

/// Every `meshd_*` metric name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("meshd_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn every_metric_the_alert_rules_and_the_dashboard_use_is_one_meshd_renders() {
    let root = workspace();
    let mut src = String::new();
    sources(&root.join("crates"), &mut src);
    let mut missing = Vec::new();
    let mut checked = 0;
    for file in [
        "deploy/prometheus/meshd-alerts.yml",
        "deploy/grafana/meshd-dashboard.json",
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        for name in metric_names(&text) {
            // A histogram's series are rendered from its base name.
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| name.strip_suffix(s))
                .unwrap_or(&name);
            checked += 1;
            let rendered = src.contains(&format!("{base} "))
                || src.contains(&format!("{base}{{"))
                || src.contains(&format!("\"{base}\""));
            if !rendered {
                missing.push(format!("{file}: {name}"));
            }
        }
    }
    assert!(
        checked >= 20,
        "only {checked} metric names found: is the parser broken?"
    );
    assert!(
        missing.is_empty(),
        "metrics meshd does not render:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_alert_rules_pass_promtool() {
    let rules = workspace().join("deploy/prometheus/meshd-alerts.yml");
    let out = Command::new("promtool")
        .arg("check")
        .arg("rules")
        .arg(&rules)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "promtool not found ({e}): install Debian's prometheus package (scripts/test does)"
            )
        });
    assert!(
        out.status.success(),
        "promtool check rules failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("SUCCESS"), "{said}");
}

#[test]
fn the_dashboard_is_grafana_json_whose_panels_all_query_meshd() {
    let text =
        std::fs::read_to_string(workspace().join("deploy/grafana/meshd-dashboard.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    assert!(
        dash["title"].is_string() && dash["uid"].is_string(),
        "{}",
        dash["title"]
    );
    let panels = dash["panels"].as_array().expect("panels");
    let mut queried = 0;
    for p in panels.iter().filter(|p| p["type"] != "row") {
        let targets = p["targets"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        assert!(!targets.is_empty(), "panel {} queries nothing", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or("");
            assert!(expr.contains("meshd_"), "panel {}: {expr}", p["title"]);
        }
        queried += 1;
    }
    assert!(queried >= 12, "{queried} panels");
}

#[test]
fn the_cluster_example_starts_three_instances_with_tls_and_tokens_checks_them_and_stops() {
    let (nats, _) = meshd_test_support::nats::nats_server_binary().expect("nats-server");
    let out = Command::new(workspace().join("deploy/cluster-example/run.sh"))
        .env("MESHD_BIN", env!("CARGO_BIN_EXE_meshd"))
        .env("MESHD_NATS_SERVER", nats)
        .output()
        .expect("running deploy/cluster-example/run.sh");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the cluster example failed:\n{said}");
    assert!(said.contains("cluster-example: passed"), "{said}");
}
