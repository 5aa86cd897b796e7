//! The partition log: contiguous durable appends, reads that never run ahead of the
//! disk, retention that reports instead of skipping, dead-letter bodies exempt from
//! it, and a power cut that loses nothing acknowledged.

mod common;

use meshd_stores::log::{
    Appended, DeadLetterBodies, DedupEvent, DedupKey, LogError, PartitionLog, Retention,
};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_appends_get_contiguous_offsets_and_read_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let log = Arc::new(stores.log.clone());
    let mut tasks = Vec::new();
    for t in 0..8u32 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for i in 0..25u32 {
                let payload = format!("{t}-{i}").into_bytes();
                let got = log
                    .append("orders", vec![(i % 3, payload.clone())])
                    .await
                    .unwrap();
                mine.push((got[0], payload));
            }
            mine
        }));
    }
    let mut by_offset: BTreeMap<(u32, u64), Vec<u8>> = BTreeMap::new();
    for t in tasks {
        for (pos, payload) in t.await.unwrap() {
            assert!(
                by_offset.insert(pos, payload).is_none(),
                "offset {pos:?} given twice"
            );
        }
    }
    for p in 0..3u32 {
        let offsets: Vec<u64> = by_offset
            .keys()
            .filter(|(q, _)| *q == p)
            .map(|(_, o)| *o)
            .collect();
        assert_eq!(
            offsets,
            (0..offsets.len() as u64).collect::<Vec<_>>(),
            "partition {p} contiguous from 0"
        );
        let b = log.bounds("orders", p).await.unwrap();
        assert_eq!((b.start, b.end), (0, offsets.len() as u64));
        let events = log.read("orders", p, 0, 1000, usize::MAX).await.unwrap();
        assert_eq!(events.len(), offsets.len());
        for e in events {
            assert_eq!(Some(&e.payload), by_offset.get(&(p, e.offset)));
        }
    }
    // Concurrent appends enter the tail cache in offset order: one run per partition,
    // so every read above was served from memory.
    let s = log.tail_stats();
    assert_eq!((s.hits, s.misses), (3, 0), "{s:?}");
    // Paging and the byte cap (always at least one event).
    let page = log.read("orders", 0, 3, 2, usize::MAX).await.unwrap();
    assert_eq!(
        page.iter().map(|e| e.offset).collect::<Vec<_>>(),
        vec![3, 4]
    );
    assert_eq!(log.read("orders", 0, 0, 100, 1).await.unwrap().len(), 1);
    assert!(log
        .read("orders", 0, 10_000, 10, usize::MAX)
        .await
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn a_batch_across_partitions_is_one_durable_write_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let stores = common::open(dir.path());
        let got = stores
            .log
            .append(
                "t",
                vec![(0, b"a".to_vec()), (1, b"b".to_vec()), (0, b"c".to_vec())],
            )
            .await
            .unwrap();
        assert_eq!(got, vec![(0, 0), (1, 0), (0, 1)]);
    }
    let stores = common::open(dir.path());
    assert_eq!(stores.log.bounds("t", 0).await.unwrap().end, 2);
    let got = stores
        .log
        .append("t", vec![(0, b"d".to_vec())])
        .await
        .unwrap();
    assert_eq!(got, vec![(0, 2)], "offsets continue after a restart");
    let events = stores.log.read("t", 0, 0, 10, usize::MAX).await.unwrap();
    assert_eq!(
        events.iter().map(|e| e.payload.clone()).collect::<Vec<_>>(),
        vec![b"a".to_vec(), b"c".to_vec(), b"d".to_vec()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_concurrent_appenders_when_power_is_cut_then_every_acknowledged_event_survives() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let log = Arc::new(stores.log.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..6u32 {
        let log = log.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut i = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let payload = format!("{t}-{i}").into_bytes();
                if let Ok(got) = log.append("pc", vec![(t % 2, payload.clone())]).await {
                    acked.push((got[0], payload));
                }
                i += 1;
            }
            acked
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let image = power.cut();
    stop.store(true, Ordering::SeqCst);
    let mut acked = Vec::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }
    assert!(
        acked.len() > 20,
        "appenders made progress ({})",
        acked.len()
    );
    drop(stores);
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, rebooted.path());
    let mut stored: HashMap<(u32, u64), Vec<u8>> = HashMap::new();
    for p in 0..2 {
        for e in stores
            .log
            .read("pc", p, 0, 100_000, usize::MAX)
            .await
            .unwrap()
        {
            stored.insert((p, e.offset), e.payload);
        }
    }
    for (pos, payload) in &acked {
        assert_eq!(
            stored.get(pos),
            Some(payload),
            "acknowledged event {pos:?} lost or changed"
        );
    }
}

#[tokio::test]
async fn given_a_failing_fsync_when_appending_then_nothing_is_acknowledged_or_readable_and_the_log_fail_stops(
) {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    stores
        .log
        .append("f", vec![(0, b"ok".to_vec())])
        .await
        .unwrap();
    power.fail_syncs(true);
    let err = stores
        .log
        .append("f", vec![(0, b"lost".to_vec())])
        .await
        .unwrap_err();
    // It reached the engine, its fsync failed: outcome unknown (HTTP 504), not "not
    // applied" — a restart may find it.
    assert!(matches!(err, LogError::Indeterminate(_)), "{err:?}");
    assert_eq!(power.pending_batches(), 1);
    assert_eq!(
        stores.log.bounds("f", 0).await.unwrap().end,
        1,
        "a non-durable event is not readable"
    );
    power.fail_syncs(false);
    // Refused unwritten (HTTP 503), the reason said once.
    let err = stores
        .log
        .append("f", vec![(0, b"x".to_vec())])
        .await
        .unwrap_err();
    assert_eq!(
        err,
        LogError::Failed("injected fsync failure".into()),
        "fail-stop"
    );
    assert!(stores.group.poisoned().is_some());
    assert!(matches!(
        stores.log.append_body(b"b").await,
        Err(LogError::Failed(_))
    ));
    assert_eq!(power.pending_batches(), 1, "nothing refused was written");
}

#[tokio::test]
async fn retention_by_size_and_age_is_reported_never_skipped_and_spares_dead_letter_bodies() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let log = &stores.log;
    for i in 0..10 {
        log.append("r", vec![(0, vec![b'x'; 10 + i])])
            .await
            .unwrap();
    }
    let body = log.append_body(b"dead event").await.unwrap();
    // By size: keep at most 40 bytes (the newest events).
    let report = log
        .enforce_retention(
            Retention {
                max_age_ms: None,
                max_bytes: Some(40),
            },
            0,
        )
        .await
        .unwrap();
    let b = log.bounds("r", 0).await.unwrap();
    assert_eq!(report.events_removed, b.start);
    assert!(b.start > 0 && b.end == 10);
    match log.read("r", 0, 0, 10, usize::MAX).await {
        Err(LogError::BelowRetention {
            requested: 0,
            start,
            ..
        }) => assert_eq!(start, b.start),
        other => panic!("a read below the retained start must be reported, got {other:?}"),
    }
    assert_eq!(
        log.read("r", 0, b.start, 100, usize::MAX)
            .await
            .unwrap()
            .len() as u64,
        10 - b.start
    );
    // By age: everything older than 1 ms at "now + 1 h".
    let later = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 3_600_000;
    log.enforce_retention(
        Retention {
            max_age_ms: Some(1),
            max_bytes: None,
        },
        later,
    )
    .await
    .unwrap();
    let b = log.bounds("r", 0).await.unwrap();
    assert_eq!((b.start, b.end), (10, 10));
    assert_eq!(
        log.read_body(&body).await.unwrap(),
        Some(b"dead event".to_vec()),
        "bodies are exempt"
    );
    // Appends continue after the retained start; a restart keeps the bounds.
    log.append("r", vec![(0, b"new".to_vec())]).await.unwrap();
    drop(stores);
    let stores = common::open(dir.path());
    let b = stores.log.bounds("r", 0).await.unwrap();
    assert_eq!((b.start, b.end), (10, 11));
}

#[tokio::test]
async fn dead_letter_bodies_are_listed_read_and_deleted_per_log() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let log = &stores.log;
    let a = log.append_body(b"a").await.unwrap();
    let b = log.append_body(b"b").await.unwrap();
    assert_eq!(a.log_id, "test-instance");
    assert!(b.seq > a.seq);
    assert_eq!(
        log.list_bodies(None, 10).await.unwrap(),
        vec![a.clone(), b.clone()]
    );
    assert_eq!(
        log.list_bodies(Some(a.seq), 10).await.unwrap(),
        vec![b.clone()]
    );
    let foreign = meshd_stores::log::BodyRef {
        log_id: "other".into(),
        seq: a.seq,
    };
    assert_eq!(
        log.read_body(&foreign).await.unwrap(),
        None,
        "another log's reference is not ours"
    );
    log.delete_body(&a).await.unwrap();
    log.delete_body(&a).await.unwrap();
    assert_eq!(log.read_body(&a).await.unwrap(), None);
    drop(stores);
    let stores = common::open(dir.path());
    let c = stores.log.append_body(b"c").await.unwrap();
    assert!(c.seq > b.seq, "sequences are never reused after a restart");
    assert_eq!(stores.log.read_body(&b).await.unwrap(), Some(b"b".to_vec()));
}

#[tokio::test]
async fn deleting_a_topic_removes_its_events_only() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    stores
        .log
        .append("gone", vec![(0, b"1".to_vec()), (1, b"2".to_vec())])
        .await
        .unwrap();
    stores
        .log
        .append("gone2", vec![(0, b"3".to_vec())])
        .await
        .unwrap();
    stores.log.delete_topic("gone").await.unwrap();
    assert_eq!(stores.log.bounds("gone", 0).await.unwrap().end, 0);
    assert_eq!(
        stores
            .log
            .read("gone2", 0, 0, 10, usize::MAX)
            .await
            .unwrap()
            .len(),
        1
    );
    drop(stores);
    let stores = common::open(dir.path());
    assert_eq!(stores.log.bounds("gone", 1).await.unwrap().end, 0);
    assert_eq!(stores.log.bounds("gone2", 0).await.unwrap().end, 1);
}

/// Every event of `topic`/`partition` from 0, one read per event (as consumers read).
async fn read_each(log: &impl PartitionLog, topic: &str, partition: u32) -> Vec<Vec<u8>> {
    let end = log.bounds(topic, partition).await.unwrap().end;
    let mut out = Vec::new();
    for offset in 0..end {
        let got = log
            .read(topic, partition, offset, 1, usize::MAX)
            .await
            .unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].offset, offset);
        out.push(got[0].payload.clone());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tail_cache_serves_what_rocksdb_holds_and_never_bytes_of_a_deleted_topic() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let log = &stores.log;
    for i in 0..20u32 {
        log.append("t", vec![(0, format!("old-{i}").into_bytes())])
            .await
            .unwrap();
    }
    let cached = read_each(log, "t", 0).await;
    let s = log.tail_stats();
    assert_eq!((s.hits, s.misses, s.events), (20, 0, 20), "{s:?}");
    // A batch read across the cache, with a byte bound, as RocksDB answers it.
    let batch = log.read("t", 0, 3, 10, 12).await.unwrap();
    drop(stores);
    let reopened = common::open(dir.path());
    assert_eq!(
        reopened.log.tail_stats().events,
        0,
        "a fresh open caches nothing"
    );
    assert_eq!(read_each(&reopened.log, "t", 0).await, cached);
    assert_eq!(reopened.log.read("t", 0, 3, 10, 12).await.unwrap(), batch);
    assert_eq!(reopened.log.tail_stats().hits, 0);

    // The topic deleted and created again: offsets start over with other bytes.
    let log = &reopened.log;
    log.append("t", vec![(0, b"warm".to_vec())]).await.unwrap();
    log.delete_topic("t").await.unwrap();
    assert_eq!(log.tail_stats().events, 0);
    for i in 0..3u32 {
        log.append("t", vec![(0, format!("new-{i}").into_bytes())])
            .await
            .unwrap();
    }
    assert_eq!(
        read_each(log, "t", 0).await,
        vec![b"new-0".to_vec(), b"new-1".to_vec(), b"new-2".to_vec()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_below_retention_is_refused_even_when_the_tail_cache_held_it() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let log = &stores.log;
    for i in 0..10u32 {
        log.append("t", vec![(0, vec![i as u8; 100])])
            .await
            .unwrap();
    }
    let report = log
        .enforce_retention(
            Retention {
                max_bytes: Some(500),
                max_age_ms: None,
            },
            0,
        )
        .await
        .unwrap();
    assert_eq!(report.events_removed, 5);
    let err = log.read("t", 0, 2, 1, usize::MAX).await.unwrap_err();
    assert!(
        matches!(err, LogError::BelowRetention { start: 5, .. }),
        "{err:?}"
    );
    let s = log.tail_stats();
    assert_eq!(s.events, 5, "retention dropped what it removed: {s:?}");
    let kept = log.read("t", 0, 5, 100, usize::MAX).await.unwrap();
    assert_eq!(
        kept.iter().map(|e| e.offset).collect::<Vec<_>>(),
        vec![5, 6, 7, 8, 9]
    );
}

fn keyed(partition: u32, id: &str) -> DedupEvent {
    DedupEvent {
        partition,
        payload: id.as_bytes().to_vec(),
        key: DedupKey::of("/pc", id),
    }
}

/// The dedup index is durable exactly as far as the events it points to: after a power
/// cut, a retry of every key finds the events that survived (duplicate, same offset)
/// and stores the ones the cut lost (never a duplicate of a lost event, never a second
/// copy of a kept one); every acknowledged event is among the kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_deduplicated_appends_when_power_is_cut_then_the_index_holds_exactly_the_surviving_events(
) {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let log = Arc::new(stores.log.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..6u32 {
        let log = log.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let (mut acked, mut sent) = (Vec::new(), Vec::new());
            let mut i = 0u32;
            while !stop.load(Ordering::SeqCst) {
                let id = format!("{t}-{i}");
                sent.push((t % 2, id.clone()));
                if let Ok(got) = log
                    .append_dedup("pc", vec![keyed(t % 2, &id)], 60_000)
                    .await
                {
                    acked.push(((got[0].partition, got[0].offset), id));
                }
                i += 1;
            }
            (acked, sent)
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let image = power.cut();
    stop.store(true, Ordering::SeqCst);
    let (mut acked, mut sent) = (Vec::new(), Vec::new());
    for t in tasks {
        let (a, s) = t.await.unwrap();
        acked.extend(a);
        sent.extend(s);
    }
    assert!(
        acked.len() > 20,
        "appenders made progress ({})",
        acked.len()
    );
    drop(stores);
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, rebooted.path());
    let mut kept: HashMap<String, (u32, u64)> = HashMap::new();
    for p in 0..2 {
        for e in stores
            .log
            .read("pc", p, 0, 100_000, usize::MAX)
            .await
            .unwrap()
        {
            let id = String::from_utf8(e.payload).unwrap();
            assert!(kept.insert(id, (p, e.offset)).is_none(), "stored twice");
        }
    }
    for (pos, id) in &acked {
        assert_eq!(kept.get(id), Some(pos), "acknowledged {id} lost or moved");
    }
    for (partition, id) in &sent {
        let got = stores
            .log
            .append_dedup("pc", vec![keyed(*partition, id)], 60_000)
            .await
            .unwrap()[0];
        match kept.get(id) {
            Some(&(p, o)) => assert_eq!(
                (got.partition, got.offset, got.duplicate),
                (p, o, true),
                "{id} survived: its retry is a duplicate of it"
            ),
            None => assert!(!got.duplicate, "{id} was lost: its retry stores it"),
        }
    }
}

/// Across a clean restart the index answers as before; the sweep (run with retention)
/// drops entries past their window from memory and disk, after which the key stores
/// again.
#[tokio::test]
async fn given_dedup_entries_when_reopened_and_swept_then_they_answer_until_their_window_ends() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let first = stores
        .log
        .append_dedup("t", vec![keyed(0, "a"), keyed(0, "b")], 60_000)
        .await
        .unwrap();
    assert_eq!(first.iter().filter(|a| a.duplicate).count(), 0);
    drop(stores);
    let stores = common::open(dir.path());
    stores.log.dedup_loaded().await.unwrap();
    assert_eq!(stores.log.dedup_entries(), 2, "reloaded at open");
    let again = stores
        .log
        .append_dedup("t", vec![keyed(0, "b")], 60_000)
        .await
        .unwrap();
    assert_eq!((again[0].offset, again[0].duplicate), (1, true));
    // A sweep within the window keeps them; one past it drops them.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    stores
        .log
        .enforce_retention(Retention::default(), now)
        .await
        .unwrap();
    assert_eq!(stores.log.dedup_entries(), 2);
    stores
        .log
        .enforce_retention(Retention::default(), now + 120_000)
        .await
        .unwrap();
    assert_eq!(stores.log.dedup_entries(), 0);
    drop(stores);
    let stores = common::open(dir.path());
    stores.log.dedup_loaded().await.unwrap();
    assert_eq!(stores.log.dedup_entries(), 0, "gone from disk too");
    let after = stores
        .log
        .append_dedup("t", vec![keyed(0, "a")], 60_000)
        .await
        .unwrap();
    assert_eq!((after[0].offset, after[0].duplicate), (2, false));
}

/// Dedup records on disk, of both spaces (per event, per run).
fn dedup_records(stores: &meshd_stores_local::LocalStores) -> usize {
    use meshd_stores_local::dedup::{prefix, Space};
    Space::ALL
        .iter()
        .map(|space| {
            let prefix = prefix(*space);
            let end = meshd_stores_local::keys::end_of(&prefix);
            stores
                .group
                .engine()
                .scan(meshd_stores_local::keys::CF_LOG, &prefix, Some(&end), 0)
                .unwrap()
                .len()
        })
        .sum()
}

/// `runs` deduplicated appends to topic "t", partition 0, of `per_run` keys each
/// (`{prefix}-0`, `{prefix}-1`, … across the runs) with a 1 ms window: one dedup record
/// per run, expired a moment later.
async fn append_expiring_runs(
    log: &meshd_stores_local::log::RocksLog,
    prefix: &str,
    runs: usize,
    per_run: usize,
) {
    for run in 0..runs {
        let events = (0..per_run)
            .map(|i| keyed(0, &format!("{prefix}-{}", run * per_run + i)))
            .collect();
        log.append_dedup("t", events, 1).await.unwrap();
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The sweep reads the records from disk in time order, in several durable batches
/// when there are many: every expired key leaves (memory and disk, more than one batch
/// of them), the live ones stay across sweeps and a reopen, and a key stored again
/// after its window ended keeps answering with its new offset when the old record goes.
#[tokio::test]
async fn given_more_expired_dedup_records_than_one_sweep_batch_then_all_go_and_live_ones_stay() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    // 25 000 keys with a 1 ms window (more than two sweep batches), then ten with a
    // long one.
    append_expiring_runs(&stores.log, "short", 25, 1000).await;
    let long: Vec<DedupEvent> = (0..10).map(|i| keyed(0, &format!("long-{i}"))).collect();
    let first = stores
        .log
        .append_dedup("t", long.clone(), 600_000)
        .await
        .unwrap();
    // "short-0" again, stored after its window ended: a new event, a new entry.
    std::thread::sleep(std::time::Duration::from_millis(5));
    let again = stores
        .log
        .append_dedup("t", vec![keyed(0, "short-0")], 600_000)
        .await
        .unwrap();
    assert!(!again[0].duplicate);
    assert_eq!(again[0].offset, 25_010);
    assert_eq!(
        stores.log.dedup_entries(),
        25_010,
        "25 000 short (one replaced) + 10 long"
    );
    // A reopen loads only what is inside its window; the rest stays on disk for the
    // sweep.
    drop(stores);
    let stores = common::open(dir.path());
    stores.log.dedup_loaded().await.unwrap();
    assert_eq!(stores.log.dedup_entries(), 11);
    // One run per append: 25 short, the long one, short-0's again.
    assert_eq!(dedup_records(&stores), 27);

    let sweep_at = now_ms() + 1000;
    for _ in 0..2 {
        stores
            .log
            .enforce_retention(Retention::default(), sweep_at)
            .await
            .unwrap();
        assert_eq!(
            stores.log.dedup_entries(),
            11,
            "the long ones and short-0's new entry"
        );
    }
    // The long keys answer with their first offsets, short-0 with its new one.
    async fn check(
        log: &meshd_stores_local::log::RocksLog,
        long: &[DedupEvent],
        first: &[Appended],
    ) {
        let answers = log.append_dedup("t", long.to_vec(), 600_000).await.unwrap();
        for (a, f) in answers.iter().zip(first) {
            assert_eq!((a.offset, a.duplicate), (f.offset, true));
        }
        let a = log
            .append_dedup("t", vec![keyed(0, "short-0")], 600_000)
            .await
            .unwrap();
        assert_eq!((a[0].offset, a[0].duplicate), (25_010, true));
    }
    check(&stores.log, &long, &first).await;
    drop(stores);
    let stores = common::open(dir.path());
    stores.log.dedup_loaded().await.unwrap();
    assert_eq!(
        stores.log.dedup_entries(),
        11,
        "the swept records are gone from disk"
    );
    assert_eq!(dedup_records(&stores), 2);
    check(&stores.log, &long, &first).await;
    let a = stores
        .log
        .append_dedup("t", vec![keyed(0, "short-1")], 600_000)
        .await
        .unwrap();
    assert_eq!(
        (a[0].offset, a[0].duplicate),
        (25_011, false),
        "expired: stored again"
    );
}

/// A stop ends retention and the dedup sweep before their next batch, so a long sweep
/// (millions of expired records are hundreds of batches on the blocking pool, where
/// cancelling the task does not reach) cannot hold the engine open past the stop: a
/// pass after `stop_housekeeping` removes nothing, and the next open's pass goes on
/// and removes it all.
#[tokio::test]
async fn given_housekeeping_stopped_when_retention_runs_then_nothing_goes_until_the_next_open() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    // Three runs of 10 000 keys with a 1 ms window: more than one sweep batch each.
    append_expiring_runs(&stores.log, "k", 3, 10_000).await;
    drop(stores);
    let stores = common::open(dir.path());
    stores.log.dedup_loaded().await.unwrap();
    assert_eq!(dedup_records(&stores), 3);
    let by_age = Retention {
        max_age_ms: Some(1),
        max_bytes: None,
    };
    let later = now_ms() + 3_600_000;

    stores.log.stop_housekeeping();
    let report = stores.log.enforce_retention(by_age, later).await.unwrap();
    assert_eq!(
        report.events_removed, 0,
        "no retention batch after the stop"
    );
    assert_eq!(dedup_records(&stores), 3, "no sweep batch after the stop");
    let b = stores.log.bounds("t", 0).await.unwrap();
    assert_eq!((b.start, b.end), (0, 30_000));

    drop(stores);
    let stores = common::open(dir.path());
    stores.log.dedup_loaded().await.unwrap();
    let mut removed = 0;
    // Retention takes one batch per partition per pass.
    for _ in 0..3 {
        let report = stores.log.enforce_retention(by_age, later).await.unwrap();
        removed += report.events_removed;
    }
    assert_eq!(removed, 30_000);
    assert_eq!(
        dedup_records(&stores),
        0,
        "the next open's sweep removes them all"
    );
    let b = stores.log.bounds("t", 0).await.unwrap();
    assert_eq!((b.start, b.end), (30_000, 30_000));
}

/// A dedup record that no longer decodes: the index's load (on its own thread) names
/// it, deduplicated appends are refused with that error rather than answered from an
/// index missing entries, and appends without dedup go on.
#[tokio::test]
async fn given_a_damaged_dedup_record_when_opened_then_deduplicated_appends_are_refused_naming_it()
{
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    stores
        .log
        .append_dedup("t", vec![keyed(0, "a")], 60_000)
        .await
        .unwrap();
    // A record under the dedup prefix whose value is not a dedup entry.
    let mut key =
        meshd_stores_local::dedup::topic_prefix(meshd_stores_local::dedup::Space::Event, "t");
    key.extend_from_slice(&0u32.to_be_bytes());
    key.extend_from_slice(&[0u8; 16]);
    let mut batch = meshd_local::Batch::default();
    batch.put(meshd_stores_local::keys::CF_LOG, key, b"garbage".to_vec());
    stores.group.commit(batch).unwrap();
    drop(stores);

    let stores = common::open(dir.path());
    let err = stores.log.dedup_loaded().await.unwrap_err();
    assert!(matches!(err, LogError::Corrupt { .. }), "{err:?}");
    let refused = stores
        .log
        .append_dedup("t", vec![keyed(0, "b")], 60_000)
        .await
        .unwrap_err();
    assert_eq!(refused, err);
    let plain = stores
        .log
        .append("t", vec![(0, b"c".to_vec())])
        .await
        .unwrap();
    assert_eq!(plain.len(), 1);
}

/// The dedup index loads on its own thread, which reads the engine: dropping the log
/// while it loads stops and joins that thread, so the data dir is free for the next
/// open at once (no `Locked`), and that open loads every entry.
#[tokio::test]
async fn given_a_log_dropped_while_its_dedup_index_loads_then_the_data_dir_reopens_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    for chunk in 0..50 {
        let events = (0..1000)
            .map(|i| keyed(chunk % 4, &format!("k-{}", chunk * 1000 + i)))
            .collect();
        stores.log.append_dedup("t", events, 600_000).await.unwrap();
    }
    drop(stores);
    let mut dropped_while_loading = 0;
    for _ in 0..5 {
        let stores = common::open(dir.path());
        // 50 000 entries take milliseconds to load: this drop comes before the end
        // of nearly every load.
        dropped_while_loading += usize::from(stores.log.dedup_loading());
        drop(stores);
    }
    assert!(dropped_while_loading > 0, "no drop came during a load");
    let stores = common::open(dir.path());
    stores.log.dedup_loaded().await.unwrap();
    assert_eq!(stores.log.dedup_entries(), 50_000);
}

/// Per-event records of earlier releases (`u`) load next to this release's runs
/// (`r`), answer until their window ends, and are swept with them.
#[tokio::test]
async fn given_per_event_records_of_an_earlier_release_then_they_load_answer_and_are_swept_with_runs(
) {
    use meshd_stores_local::dedup::Entry;
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let runs = stores
        .log
        .append_dedup(
            "t",
            vec![keyed(0, "a"), keyed(0, "b"), keyed(1, "c")],
            60_000,
        )
        .await
        .unwrap();
    assert_eq!(dedup_records(&stores), 2, "one run per partition");
    let at_ms = now_ms();
    let mut batch = meshd_local::Batch::default();
    for (i, id) in ["old-1", "old-2"].iter().enumerate() {
        let e = Entry {
            key: DedupKey::of("/pc", id),
            offset: 90 + i as u64,
            at_ms,
            window_ms: 60_000,
        };
        batch.put(
            meshd_stores_local::keys::CF_LOG,
            e.record_key("t", 0),
            e.encode_value(),
        );
    }
    stores.group.commit(batch).unwrap();
    drop(stores);

    let stores = common::open(dir.path());
    stores.log.dedup_loaded().await.unwrap();
    assert_eq!(stores.log.dedup_entries(), 5);
    let again = stores
        .log
        .append_dedup(
            "t",
            vec![
                keyed(0, "old-2"),
                keyed(0, "a"),
                keyed(1, "c"),
                keyed(0, "old-1"),
            ],
            60_000,
        )
        .await
        .unwrap();
    let got: Vec<(u64, bool)> = again.iter().map(|a| (a.offset, a.duplicate)).collect();
    assert_eq!(
        got,
        vec![
            (91, true),
            (runs[0].offset, true),
            (runs[2].offset, true),
            (90, true)
        ]
    );
    stores
        .log
        .enforce_retention(Retention::default(), now_ms() + 120_000)
        .await
        .unwrap();
    assert_eq!(stores.log.dedup_entries(), 0);
    assert_eq!(dedup_records(&stores), 0, "both spaces swept");
}
