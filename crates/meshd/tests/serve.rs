//! `meshd serve` as a real process: start-up line, health, readiness that tells the
//! truth about Meta, the exclusive data dir, and config errors.

use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http;
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::wait::wait_until;
use std::path::Path;
use std::time::Duration;

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_meshd"))
}

/// The client of the meshd at `a` (`host:port`), each request bounded by 10 s.
fn client(a: &str) -> meshd_client::Client {
    meshd_client::Client::connect(&format!("http://{a}"))
        .unwrap()
        .with_timeout(Duration::from_secs(10))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_embedded_defaults_when_started_then_it_prints_its_backends_and_is_ready() {
    let dir = tempfile::tempdir().unwrap();
    let m = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let line = m.first_line();
    assert!(line.contains("meta=embedded"), "{line}");
    assert!(line.contains("log=embedded"), "{line}");
    assert!(line.contains("local=rocksdb:"), "{line}");
    assert!(line.contains("instance=meshd-"), "{line}");

    let h = http::get(m.addr(), "/healthz").await.unwrap();
    assert_eq!(h.status, 200);
    assert_eq!(h.json().unwrap()["status"], "ok");
    let r = http::get(m.addr(), "/readyz").await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let metrics = http::get(m.addr(), "/metrics").await.unwrap();
    assert!(
        metrics
            .body
            .contains("meshd_meta_healthy{backend=\"embedded\"} 1"),
        "{}",
        metrics.body
    );
    for line in metrics
        .body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        assert!(
            line.starts_with("meshd_"),
            "metric without the meshd_ prefix: {line}"
        );
    }
    let missing = http::get(m.addr(), "/v1/nope").await.unwrap();
    assert_eq!(missing.status, 404);
    assert_eq!(
        missing.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(missing.json().unwrap()["status"], 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_killed_instance_when_restarted_then_it_keeps_its_instance_id() {
    let dir = tempfile::tempdir().unwrap();
    let mut m = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let id = |line: &str| {
        line.split_whitespace()
            .find(|w| w.starts_with("instance="))
            .map(str::to_string)
    };
    let before = id(m.first_line()).unwrap();
    m.restart().await.unwrap();
    assert_eq!(id(m.first_line()).unwrap(), before);
    assert!(client(m.addr()).ready().await.unwrap(), "readyz 200");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_running_instance_when_a_second_process_opens_its_data_dir_then_it_exits_with_a_clear_error(
) {
    let dir = tempfile::tempdir().unwrap();
    let first = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let second = MeshdProcess::start_expecting_exit(bin(), dir.path(), &[])
        .await
        .unwrap();
    assert_ne!(second.code, Some(0));
    assert!(
        second.stderr.contains("locked by another meshd process"),
        "stderr: {}",
        second.stderr
    );
    // The first is unharmed.
    assert!(client(first.addr()).ready().await.unwrap(), "readyz 200");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_bad_flag_value_when_started_then_it_exits_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let out = MeshdProcess::start_expecting_exit(bin(), dir.path(), &["--meta", "zookeeper://x"])
        .await
        .unwrap();
    assert_eq!(out.code, Some(2));
    assert!(out.stderr.contains("--meta"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_etcd_meta_when_etcd_stops_then_readiness_and_metrics_show_it_and_recover_without_restart(
) {
    let mut etcd = EtcdProcess::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("etcd://{}", etcd.endpoint());
    let m = MeshdProcess::start(bin(), dir.path(), &["--meta", &url])
        .await
        .unwrap();
    assert!(m.first_line().contains("meta=etcd"), "{}", m.first_line());
    wait_until(Duration::from_secs(10), "ready with etcd up", || async {
        anyhow::ensure!(client(m.addr()).ready().await?, "readyz 503");
        Ok(())
    })
    .await
    .unwrap();

    etcd.kill();
    let r = wait_until(
        Duration::from_secs(10),
        "not ready with etcd down",
        || async {
            // Meta's status is probed at most once a second (a remote Meta): the
            // readiness check names it within that.
            let r = http::get(m.addr(), "/readyz").await?;
            anyhow::ensure!(r.status == 503, "readyz {} {}", r.status, r.body);
            anyhow::ensure!(
                r.json()?["checks"]["meta:etcd"] != "ok",
                "readyz {}",
                r.body
            );
            Ok(r)
        },
    )
    .await
    .unwrap();
    let body = r.json().unwrap();
    assert_eq!(body["status"], "unavailable");
    assert_ne!(body["checks"]["meta:etcd"], "ok", "{body}");
    let metrics = client(m.addr()).metrics().await.unwrap();
    assert!(
        metrics.contains("meshd_meta_healthy{backend=\"etcd\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("meshd_meta_errors_total{backend=\"etcd\",op=\"status\""),
        "{metrics}"
    );

    etcd.restart().await.unwrap();
    wait_until(
        Duration::from_secs(15),
        "ready again once etcd is back",
        || async {
            anyhow::ensure!(client(m.addr()).ready().await?, "readyz 503");
            Ok(())
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_orphan_dead_letter_body_when_meshd_boots_then_it_is_collected() {
    use meshd_stores::log::DeadLetterBodies;
    let dir = tempfile::tempdir().unwrap();
    let mut m = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    m.kill();
    let instance_id = std::fs::read_to_string(dir.path().join("instance-id")).unwrap();
    let open = || {
        let engine =
            meshd_local::RocksEngine::open(dir.path(), meshd_stores_local::keys::COLUMN_FAMILIES)
                .unwrap();
        meshd_stores_local::LocalStores::open(
            std::sync::Arc::new(engine),
            instance_id.trim(),
            Duration::from_millis(100),
        )
        .unwrap()
    };
    // A crash between the body append and the entry create leaves this behind.
    let orphan = {
        let local = open();
        local.log.append_body(b"orphaned event").await.unwrap()
    };
    m.restart().await.unwrap();
    wait_until(Duration::from_secs(10), "ready after boot", || async {
        anyhow::ensure!(client(m.addr()).ready().await?, "readyz 503");
        Ok(())
    })
    .await
    .unwrap();
    m.kill();
    let local = open();
    assert_eq!(
        local.log.read_body(&orphan).await.unwrap(),
        None,
        "the orphan body was collected at boot"
    );
}
