//! The partition-log conformance suite: what every [`PartitionLog`] (and its
//! [`DeadLetterBodies`]) must do whatever the engine, one async function per case.
//! The RocksDB log runs it in `crates/stores-local/tests/log_conformance.rs`, the
//! JetStream log in `crates/log-nats/tests/conformance.rs`. Engine-specific stories
//! (power cuts, SIGKILL of the server, retention, batch atomicity across partitions)
//! stay with each engine.
//!
//! Cases that take several handles (`logs`) append through all of them concurrently:
//! for a shared log they are separate clients (as separate processes would be), for
//! an embedded log clones of one.

use meshd_stores::log::{
    Appended, BodyRef, DeadLetterBodies, DedupEvent, DedupKey, LogError, PartitionLog,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Concurrent appenders (8 tasks spread over `logs`, 25 appends each over 3
/// partitions) get every offset once, contiguous from 0 per partition, and read back
/// exactly what they appended; reads page, cap bytes (at least one event) and return
/// nothing from beyond the end.
pub async fn concurrent_appends_get_contiguous_offsets_and_read_back_exactly(
    logs: &[Arc<dyn PartitionLog>],
) {
    assert!(!logs.is_empty());
    let topic = "orders";
    let mut tasks = Vec::new();
    for t in 0..8u32 {
        let log = logs[t as usize % logs.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            for i in 0..25u32 {
                let payload = format!("{t}-{i}").into_bytes();
                let got = log
                    .append(topic, vec![(i % 3, payload.clone())])
                    .await
                    .expect("append");
                mine.push((got[0], payload));
            }
            mine
        }));
    }
    let mut by_offset: BTreeMap<(u32, u64), Vec<u8>> = BTreeMap::new();
    for t in tasks {
        for (pos, payload) in t.await.expect("appender") {
            assert!(
                by_offset.insert(pos, payload).is_none(),
                "offset {pos:?} given twice"
            );
        }
    }
    let log = &logs[0];
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
        let b = log.bounds(topic, p).await.expect("bounds");
        assert_eq!((b.start, b.end), (0, offsets.len() as u64));
        let events = log.read(topic, p, 0, 1000, usize::MAX).await.expect("read");
        assert_eq!(events.len(), offsets.len());
        for e in events {
            assert_eq!(Some(&e.payload), by_offset.get(&(p, e.offset)));
            assert!(e.appended_at_ms > 0, "appended_at_ms is set");
        }
    }
    // Paging and the byte cap (always at least one event).
    let page = log.read(topic, 0, 3, 2, usize::MAX).await.expect("page");
    assert_eq!(
        page.iter().map(|e| e.offset).collect::<Vec<_>>(),
        vec![3, 4]
    );
    assert_eq!(
        log.read(topic, 0, 0, 100, 1).await.expect("capped").len(),
        1
    );
    let two = page[0].payload.len() + page[1].payload.len();
    assert_eq!(
        log.read(topic, 0, 3, 100, two).await.expect("capped").len(),
        2,
        "the cap counts payload bytes"
    );
    assert!(log
        .read(topic, 0, 10_000, 10, usize::MAX)
        .await
        .expect("beyond the end")
        .is_empty());
}

/// One call's events get offsets in call order per partition, interleaved across
/// partitions; a partition never written has bounds {0, 0} and reads nothing.
pub async fn batch_offsets_follow_call_order(log: &dyn PartitionLog) {
    let got = log
        .append(
            "t",
            vec![(0, b"a".to_vec()), (1, b"b".to_vec()), (0, b"c".to_vec())],
        )
        .await
        .expect("append");
    assert_eq!(got, vec![(0, 0), (1, 0), (0, 1)]);
    let got = log
        .append("t", vec![(0, b"d".to_vec())])
        .await
        .expect("append");
    assert_eq!(got, vec![(0, 2)]);
    let events = log.read("t", 0, 0, 10, usize::MAX).await.expect("read");
    assert_eq!(
        events.iter().map(|e| e.payload.clone()).collect::<Vec<_>>(),
        vec![b"a".to_vec(), b"c".to_vec(), b"d".to_vec()]
    );
    assert_eq!(log.append("t", Vec::new()).await.expect("empty"), vec![]);
    let never = log.bounds("t", 7).await.expect("bounds");
    assert_eq!((never.start, never.end), (0, 0));
    assert!(log
        .read("t", 7, 0, 10, usize::MAX)
        .await
        .expect("read")
        .is_empty());
    assert!(matches!(
        log.append("", vec![(0, b"x".to_vec())]).await,
        Err(LogError::Invalid(_))
    ));
}

/// Deleting a topic removes its events and no other topic's; appends start again at
/// offset 0.
pub async fn deleting_a_topic_removes_its_events_only(log: &dyn PartitionLog) {
    log.append("gone", vec![(0, b"1".to_vec()), (1, b"2".to_vec())])
        .await
        .expect("append");
    log.append("gone2", vec![(0, b"3".to_vec())])
        .await
        .expect("append");
    // A topic whose name extends the other's is another topic.
    log.append("gone.x", vec![(0, b"4".to_vec())])
        .await
        .expect("append");
    log.delete_topic("gone").await.expect("delete");
    for p in 0..2 {
        assert_eq!(log.bounds("gone", p).await.expect("bounds").end, 0);
        assert!(log
            .read("gone", p, 0, 10, usize::MAX)
            .await
            .expect("read")
            .is_empty());
    }
    assert_eq!(
        log.read("gone2", 0, 0, 10, usize::MAX)
            .await
            .expect("read")
            .len(),
        1
    );
    assert_eq!(log.bounds("gone.x", 0).await.expect("bounds").end, 1);
    log.delete_topic("never-written").await.expect("idempotent");
    let got = log
        .append("gone", vec![(1, b"again".to_vec())])
        .await
        .expect("append");
    assert_eq!(got, vec![(1, 0)], "a deleted topic starts again at 0");
}

/// An append notifies the receivers of the partitions it appended to and no others
/// (another partition of the topic, the same partition of another topic, a topic whose
/// name extends it): a receiver taken before the append sees, within a deadline, a
/// value at least the new durable end and finds the events with `bounds`. Deleting the
/// topic closes its receivers and no other topic's.
///
/// The negative checks are deterministic: everything is appended before the positive
/// case is observed, and nothing touches the other partitions at all.
pub async fn appends_notify_only_the_partitions_appended_to(log: &dyn PartitionLog) {
    let mut a = log.appends("notify", 0);
    let b = log.appends("notify", 1);
    let other_topic = log.appends("notify2", 0);
    let longer_name = log.appends("notify.x", 0);
    a.borrow_and_update();
    let got = log
        .append("notify", vec![(0, b"1".to_vec()), (0, b"2".to_vec())])
        .await
        .expect("append");
    assert_eq!(got, vec![(0, 0), (0, 1)]);
    let end = 2;
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while *a.borrow_and_update() < end {
            a.changed().await.expect("the sender is open");
        }
    })
    .await
    .expect("the receiver of partition 0 sees the new end within 10 s");
    assert_eq!(log.bounds("notify", 0).await.expect("bounds").end, end);
    for (name, rx) in [
        ("partition 1 of the topic", &b),
        ("partition 0 of another topic", &other_topic),
        ("partition 0 of a topic whose name extends it", &longer_name),
    ] {
        assert!(
            !rx.has_changed().expect("the sender is open"),
            "{name} was notified of an append to notify/0"
        );
    }
    // Two receivers of one partition share its notifications.
    let mut a2 = log.appends("notify", 0);
    a2.borrow_and_update();
    log.append("notify", vec![(0, b"3".to_vec())])
        .await
        .expect("append");
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while *a2.borrow_and_update() < 3 {
            a2.changed().await.expect("the sender is open");
        }
    })
    .await
    .expect("a second receiver sees the new end within 10 s");
    assert!(!b.has_changed().expect("the sender is open"));

    log.delete_topic("notify").await.expect("delete");
    assert!(
        a.has_changed().is_err(),
        "deleting the topic closes its receivers"
    );
    assert!(
        b.has_changed().is_err(),
        "deleting the topic closes its receivers"
    );
    assert!(
        !other_topic
            .has_changed()
            .expect("another topic's sender stays open"),
        "deleting a topic does not wake another"
    );
    assert!(!longer_name.has_changed().expect("open"));
    // A new receiver of the deleted topic works again.
    let mut again = log.appends("notify", 0);
    again.borrow_and_update();
    log.append("notify", vec![(0, b"new".to_vec())])
        .await
        .expect("append");
    tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while *again.borrow_and_update() < 1 {
            again.changed().await.expect("the sender is open");
        }
    })
    .await
    .expect("a receiver taken after the delete is notified within 10 s");
}

/// Bodies are appended, listed in order from a position, read (`None` for another
/// log's reference or a deleted body) and deleted (twice is fine).
pub async fn dead_letter_bodies_are_listed_read_and_deleted(bodies: &dyn DeadLetterBodies) {
    let a = bodies.append_body(b"a").await.expect("append");
    let b = bodies.append_body(b"b").await.expect("append");
    assert_eq!(a.log_id, bodies.log_id());
    assert!(b.seq > a.seq);
    assert_eq!(
        bodies.list_bodies(None, 10).await.expect("list"),
        vec![a.clone(), b.clone()]
    );
    assert_eq!(
        bodies.list_bodies(Some(a.seq), 10).await.expect("list"),
        vec![b.clone()]
    );
    assert_eq!(
        bodies.list_bodies(None, 1).await.expect("list"),
        vec![a.clone()]
    );
    let foreign = BodyRef {
        log_id: format!("not-{}", bodies.log_id()),
        seq: a.seq,
    };
    assert_eq!(
        bodies.read_body(&foreign).await.expect("read"),
        None,
        "another log's reference is not ours"
    );
    assert_eq!(
        bodies.read_body(&b).await.expect("read"),
        Some(b"b".to_vec())
    );
    bodies.delete_body(&a).await.expect("delete");
    bodies.delete_body(&a).await.expect("delete twice");
    assert_eq!(bodies.read_body(&a).await.expect("read"), None);
    assert_eq!(
        bodies.list_bodies(None, 10).await.expect("list"),
        vec![b.clone()]
    );
    let c = bodies.append_body(b"c").await.expect("append");
    assert!(c.seq > b.seq, "sequences are never reused");
}

fn dedup_event(partition: u32, id: &str, payload: &str) -> DedupEvent {
    DedupEvent {
        partition,
        payload: payload.as_bytes().to_vec(),
        key: DedupKey::of("/conformance", id),
    }
}

fn answers(got: &[Appended]) -> Vec<(u32, u64, bool)> {
    got.iter()
        .map(|a| (a.partition, a.offset, a.duplicate))
        .collect()
}

/// Publish dedup through several handles: a key stored within the window is answered
/// with its stored offset and `duplicate` (the first stored version wins), per
/// partition, also for a repeat inside one call and inside a batch that also stores
/// new events; concurrent appenders of the same key store it once. Only the first
/// versions are in the log.
pub async fn dedup_answers_the_stored_offset_for_a_key_within_the_window(
    logs: &[Arc<dyn PartitionLog>],
) {
    let topic = "dedup";
    let window = 60_000;
    let log = &logs[0];
    let got = log
        .append_dedup(
            topic,
            vec![
                dedup_event(0, "a", "a1"),
                dedup_event(0, "b", "b1"),
                dedup_event(0, "a", "a2"),
                dedup_event(1, "a", "a-on-1"),
            ],
            window,
        )
        .await
        .expect("append");
    assert_eq!(
        answers(&got),
        [(0, 0, false), (0, 1, false), (0, 0, true), (1, 0, false)],
        "a repeat inside the call is a duplicate; dedup is per partition"
    );
    // A retry of the whole call, through another handle: every event a duplicate.
    let again = logs[logs.len() - 1]
        .append_dedup(
            topic,
            vec![
                dedup_event(0, "a", "a3"),
                dedup_event(0, "b", "b2"),
                dedup_event(1, "a", "x"),
            ],
            window,
        )
        .await
        .expect("retry");
    assert_eq!(answers(&again), [(0, 0, true), (0, 1, true), (1, 0, true)]);
    // A batch mixing new events and duplicates stores only the new ones, in order.
    let mixed = log
        .append_dedup(
            topic,
            vec![
                dedup_event(0, "c", "c1"),
                dedup_event(0, "a", "a4"),
                dedup_event(0, "d", "d1"),
            ],
            window,
        )
        .await
        .expect("mixed");
    assert_eq!(
        answers(&mixed),
        [(0, 2, false), (0, 0, true), (0, 3, false)]
    );
    // Concurrent appenders of one key: stored once, every answer names that offset.
    let mut tasks = Vec::new();
    for t in 0..6usize {
        let log = logs[t % logs.len()].clone();
        tasks.push(tokio::spawn(async move {
            log.append_dedup(
                topic,
                vec![dedup_event(2, "race", &format!("r{t}"))],
                window,
            )
            .await
            .expect("race")[0]
        }));
    }
    let mut raced = Vec::new();
    for t in tasks {
        raced.push(t.await.expect("racer"));
    }
    assert_eq!(
        raced.iter().filter(|a| !a.duplicate).count(),
        1,
        "{raced:?}"
    );
    assert!(
        raced.iter().all(|a| a.offset == 0 && a.partition == 2),
        "{raced:?}"
    );
    // The log holds the first versions only.
    let payloads = |p: u32| {
        let log = log.clone();
        async move {
            log.read(topic, p, 0, 100, usize::MAX)
                .await
                .expect("read")
                .into_iter()
                .map(|e| String::from_utf8(e.payload).unwrap())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(payloads(0).await, ["a1", "b1", "c1", "d1"]);
    assert_eq!(payloads(1).await, ["a-on-1"]);
    assert_eq!(payloads(2).await.len(), 1);
    // Another topic has its own index.
    let other = log
        .append_dedup("dedup-other", vec![dedup_event(0, "a", "o")], window)
        .await
        .expect("other topic");
    assert_eq!(answers(&other), [(0, 0, false)]);
}
