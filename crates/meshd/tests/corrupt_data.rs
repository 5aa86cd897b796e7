//! Damaged bytes in a copy of a data dir, through the real binary. meshd fail-stops
//! (see docs/state-store-failure-matrix.md): a damaged write-ahead log stops the
//! start with a message naming the corruption; a damaged SST is detected when read,
//! answered 500 naming the store and key, and the engine stops (not ready, writes
//! refused 503) instead of serving around it. Nothing damaged is ever served.

mod common;

use common::{answered, bin, client, create_topic, event, problem, publish};
use meshd_local::RocksEngine;
use meshd_test_support::http::{self, request_with};
use meshd_test_support::meshd::MeshdProcess;
use std::path::{Path, PathBuf};

const EVENTS: usize = 200;

fn largest_with_ext(dir: &Path, ext: &str) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap_or_else(|| panic!("no .{ext} file in {}", dir.display()))
}

fn flip(file: &Path, at: f64) {
    let mut bytes = std::fs::read(file).unwrap();
    let i = ((bytes.len() as f64) * at) as usize;
    bytes[i] ^= 0x10;
    std::fs::write(file, bytes).unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// A data dir with a topic of one partition holding EVENTS events, meshd stopped.
async fn data_dir_with_events(dir: &Path) {
    let mut meshd = MeshdProcess::start(bin(), dir, &[]).await.unwrap();
    let a = meshd.addr().to_string();
    create_topic(&a, "t", 1).await;
    for i in 0..EVENTS {
        publish(&a, "t", &event(&format!("e{i}"))).await.unwrap();
    }
    meshd.kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_copy_of_a_data_dir_with_a_damaged_write_ahead_log_when_meshd_starts_on_it_then_it_refuses_naming_the_corruption(
) {
    let dir = tempfile::tempdir().unwrap();
    let original = dir.path().join("original");
    data_dir_with_events(&original).await;
    let copy = dir.path().join("copy");
    copy_dir(&original, &copy);
    flip(&largest_with_ext(&copy, "log"), 0.5);

    let out = MeshdProcess::start_expecting_exit(bin(), &copy, &[])
        .await
        .unwrap();
    assert_ne!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("Corruption"), "{}", out.stderr);
    assert!(
        out.stderr.contains(copy.to_str().unwrap()),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("--wal-recovery"), "{}", out.stderr);
    // The operator's override (after a power loss): open up to the damage. What is
    // served is a prefix of what was published, never a damaged event.
    let meshd = MeshdProcess::start(bin(), &copy, &["--wal-recovery", "point-in-time"])
        .await
        .unwrap();
    let served = common::browse_all(meshd.addr(), "t", 0).await;
    assert!(served.len() < EVENTS, "the damaged tail is dropped");
    for (i, (offset, e)) in served.iter().enumerate() {
        assert_eq!(
            (*offset, &e["id"]),
            (i as u64, &serde_json::json!(format!("e{i}")))
        );
    }
    drop(meshd);
    // The undamaged original still starts and serves every event.
    let meshd = MeshdProcess::start(bin(), &original, &[]).await.unwrap();
    assert_eq!(common::browse_all(meshd.addr(), "t", 0).await.len(), EVENTS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_copy_of_a_data_dir_with_a_damaged_sst_when_its_events_are_read_then_500_names_the_store_and_key_and_meshd_fail_stops(
) {
    let dir = tempfile::tempdir().unwrap();
    let original = dir.path().join("original");
    data_dir_with_events(&original).await;
    // Move everything from the write-ahead log into SST files, then damage the
    // largest (the log's events) early, inside its first data block.
    {
        let engine =
            RocksEngine::open(&original, meshd_stores_local::keys::COLUMN_FAMILIES).unwrap();
        engine.flush_all().unwrap();
    }
    let copy = dir.path().join("copy");
    copy_dir(&original, &copy);
    flip(&largest_with_ext(&copy, "sst"), 0.01);

    let meshd = MeshdProcess::start(bin(), &copy, &[]).await.unwrap();
    let a = meshd.addr().to_string();
    let r = http::get(&a, "/v1/topics/t/partitions/0/events?from=0&limit=1000")
        .await
        .unwrap();
    let p = problem(&r, 500);
    assert_eq!(p["store"], "log", "{p}");
    let detail = p["detail"].as_str().unwrap();
    assert!(detail.contains("corrupt"), "{detail}");
    assert!(detail.contains("column family"), "{detail}");
    assert!(
        !r.body.contains("\"e0\""),
        "damaged data was served: {}",
        r.body
    );

    // Fail-stop: not ready, naming the corruption; publishes refused with 503.
    let ready = http::get(&a, "/readyz").await.unwrap();
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(
        ready.body.contains(r#""local:rocksdb":"failed""#),
        "{}",
        ready.body
    );
    let r = request_with(
        &a,
        "POST",
        "/v1/topics/t/events",
        &[("Content-Type", "application/cloudevents+json")],
        event("after").to_string().as_bytes(),
    )
    .await
    .unwrap();
    problem(&r, 503);
    let metrics = client(&a).metrics().await.unwrap();
    assert!(
        metrics.contains(r#"meshd_local_healthy{backend="rocksdb"} 0"#),
        "{metrics}"
    );
    // The log names the store, the column family and the key.
    let log = meshd.log_tail(200);
    assert!(
        log.contains("corrupt data on disk") && log.contains("rocksdb"),
        "{log}"
    );
    drop(meshd);

    // The undamaged original serves every event.
    let meshd = MeshdProcess::start(bin(), &original, &[]).await.unwrap();
    let events = common::browse_all(meshd.addr(), "t", 0).await;
    assert_eq!(events.len(), EVENTS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_event_record_that_fails_its_own_checksum_when_read_then_500_names_its_key_and_meshd_fail_stops(
) {
    use meshd_local::{Batch, Durability, KvEngine};
    use meshd_stores_local::keys;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    data_dir_with_events(&data).await;
    // Damage that RocksDB's checksums cannot see (it happened before the write):
    // one event record rewritten with a flipped byte in its payload.
    {
        let engine = RocksEngine::open(&data, keys::COLUMN_FAMILIES).unwrap();
        let key = keys::event_key("t", 0, 7);
        let mut value = engine.get(keys::CF_LOG, &key).unwrap().expect("event 7");
        let mid = value.len() / 2;
        value[mid] ^= 0x01;
        let mut b = Batch::default();
        b.put(keys::CF_LOG, key, value);
        engine.write(b, Durability::Sync).unwrap();
    }
    let meshd = MeshdProcess::start(bin(), &data, &[]).await.unwrap();
    let a = meshd.addr().to_string();
    // Events before the damaged one are served; the damaged one never is.
    let r = client(&a).browse_answer("t", 0, 0, 7).await;
    answered(r, 200, "browse").unwrap();
    let r = http::get(&a, "/v1/topics/t/partitions/0/events?from=0&limit=1000")
        .await
        .unwrap();
    let p = problem(&r, 500);
    assert_eq!(p["store"], "log", "{p}");
    let detail = p["detail"].as_str().unwrap();
    assert!(detail.contains("checksum"), "{detail}");
    let ready = http::get(&a, "/readyz").await.unwrap();
    assert_eq!(ready.status, 503, "{}", ready.body);
    let r = request_with(
        &a,
        "POST",
        "/v1/topics/t/events",
        &[("Content-Type", "application/cloudevents+json")],
        event("after").to_string().as_bytes(),
    )
    .await
    .unwrap();
    problem(&r, 503);
    let log = meshd.log_tail(200);
    assert!(log.contains("damaged record"), "{log}");
}

/// A publish dedup record that no longer decodes (written in place of a run of the
/// data dir's own): the index loads on its own thread, and `meshd serve` waits for
/// it before it listens, so the start stops naming the record, as any damaged
/// record read at a start does, instead of serving publishes an index missing
/// entries would store twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_damaged_dedup_record_when_meshd_starts_then_it_refuses_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    data_dir_with_events(dir.path()).await;
    {
        use meshd_local::KvEngine;
        use meshd_stores_local::keys::{end_of, CF_LOG, COLUMN_FAMILIES, DEDUP_RUN};
        let engine = RocksEngine::open(dir.path(), COLUMN_FAMILIES).unwrap();
        let runs = engine
            .scan(CF_LOG, &[DEDUP_RUN], Some(&end_of(&[DEDUP_RUN])), 0)
            .unwrap();
        assert_eq!(runs.len(), EVENTS, "one run per single-event publish");
        let (key, _) = runs[EVENTS / 2].clone();
        let mut batch = meshd_local::Batch::default();
        batch.put(CF_LOG, key, b"not a run".to_vec());
        engine.write(batch, meshd_local::Durability::Sync).unwrap();
    }
    let out = MeshdProcess::start_expecting_exit(bin(), dir.path(), &[])
        .await
        .unwrap();
    assert_ne!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stderr.contains("publish dedup index") && out.stderr.contains("corrupt log record"),
        "{}",
        out.stderr
    );
}
