//! The operator console in a real browser (issue 26): Debian's Chromium and
//! chromedriver driven over WebDriver by `tests/console/browser.py` (Debian's
//! python3-selenium), against a two-instance cluster (etcd + nats-server) with
//! admin and client tokens, and an embedded meshd without tokens. The script prepares
//! topics, a poison subscription, dead letters, tasks and a session through the API,
//! then checks every view against what the API answers, redrives a dead letter from
//! the page and sees it delivered, deletes a selection, resets an offset through its
//! confirmation, tails a subscription with acks, and checks that a client token
//! cannot press admin buttons, SIGKILLs the other instance and sees its partitions
//! move in the cluster view, that errors show as problems, that the page works from
//! the keyboard and in a narrow window, and that the browser logged no script error
//! and no load blocked by the Content-Security-Policy.
//!
//! Screenshots of every view go to `$MESHD_CONSOLE_SHOTS` when set (docs/console.md
//! is made that way; see it), else to a temporary directory.

mod common;

use common::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const PYTHON: &str = "/usr/bin/python3";

/// What the browser test needs, or which Debian package gives what is missing.
fn browser_kit() -> (String, String) {
    let chromium = ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("chromium is missing (Debian package chromium; scripts/env.sh installs it with MESHD_NEEDS=test)");
    let driver = ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect(
            "chromedriver is missing (Debian package chromium-driver; scripts/env.sh installs it)",
        );
    let selenium = Command::new(PYTHON)
        .args(["-c", "import selenium"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        selenium,
        "python3-selenium is missing (Debian package python3-selenium; scripts/env.sh installs it)"
    );
    (chromium.to_string(), driver.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_what_the_api_says_and_its_actions_reach_meshd_in_a_real_browser() {
    let (chromium, driver) = browser_kit();
    let dir = tempfile::tempdir().unwrap();
    let (clients, admins) = (dir.path().join("clients"), dir.path().join("admins"));
    std::fs::write(&clients, "console-client-token\n").unwrap();
    std::fs::write(&admins, "console-admin-token\n").unwrap();
    let cluster = SmallCluster::start_with(
        2,
        Duration::from_millis(2000),
        &[
            "--client-token-file",
            clients.to_str().unwrap(),
            "--admin-token-file",
            admins.to_str().unwrap(),
        ],
    )
    .await;
    let open = start(&dir.path().join("tokenless")).await;
    let shots = match std::env::var_os("MESHD_CONSOLE_SHOTS") {
        Some(d) => std::path::PathBuf::from(d),
        None => dir.path().join("shots"),
    };
    std::fs::create_dir_all(&shots).unwrap();
    let script = Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo"))
        .join("tests/console/browser.py");
    let other = cluster.nodes[1].pid().expect("instance 1 runs").to_string();
    let (base, tokenless) = (
        format!("http://{}", cluster.addr(0)),
        format!("http://{}", open.addr()),
    );
    let out = tokio::task::spawn_blocking(move || {
        Command::new(PYTHON)
            .arg(script)
            .args(["--base", &base, "--tokenless", &tokenless])
            .args(["--admin-token", "console-admin-token"])
            .args(["--client-token", "console-client-token"])
            .args(["--chromium", &chromium, "--chromedriver", &driver])
            .args(["--kill-pid", &other])
            .arg("--shots")
            .arg(&shots)
            .output()
    })
    .await
    .unwrap()
    .expect("run tests/console/browser.py");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "the browser checks failed:\n{stdout}\n{stderr}\n--- meshd 0\n{}\n--- meshd 1\n{}",
        cluster.nodes[0].log_tail(40),
        cluster.nodes[1].log_tail(40)
    );
}
