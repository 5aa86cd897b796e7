//! The JetStream log against a real nats-server (`sync_interval: always`): what the
//! conformance suite cannot say about a shared log — atomic batches per partition and
//! the weaker promise across partitions, appends seen by other clients (per partition;
//! a reconnect wakes every receiver), retention by JetStream limits reported as
//! `BelowRetention`, a SIGKILLed server that keeps every acknowledged event, and a
//! paused server that gets answers within the deadline and a client that recovers by
//! itself.

mod common;

use meshd_log_nats::{NatsConfig, NatsLog};
use meshd_stores::log::{DeadLetterBodies, LogError, PartitionLog, Retention};
use meshd_test_support::wait::wait_until;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn events(partition: u32, n: usize, tag: &str) -> Vec<(u32, Vec<u8>)> {
    (0..n)
        .map(|i| (partition, format!("{tag}-{i}").into_bytes()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_within_one_partition_is_stored_whole_in_one_contiguous_block() {
    let nats = common::server().await;
    let a = common::connect(&nats).await;
    let b = common::connect(&nats).await;
    // Another client keeps appending single events to the same partition meanwhile.
    let stop = Arc::new(AtomicBool::new(false));
    let singles = {
        let (b, stop) = (b.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                b.append("batch", vec![(0, b"single".to_vec())])
                    .await
                    .expect("single append");
                n += 1;
            }
            n
        })
    };
    for round in 0..5 {
        let batch = events(0, 200, &format!("r{round}"));
        let got = a
            .append("batch", batch.clone())
            .await
            .expect("batch append");
        let first = got[0].1;
        assert_eq!(
            got,
            (0..200).map(|i| (0, first + i)).collect::<Vec<_>>(),
            "a batch is one contiguous block, whatever else is appended"
        );
        let back = a
            .read("batch", 0, first, 200, usize::MAX)
            .await
            .expect("read");
        assert_eq!(
            back.into_iter().map(|e| e.payload).collect::<Vec<_>>(),
            batch.into_iter().map(|(_, p)| p).collect::<Vec<_>>()
        );
    }
    stop.store(true, Ordering::SeqCst);
    assert!(singles.await.unwrap() > 0);

    // Above JetStream's batch limit: refused before anything is sent.
    let end = a.bounds("batch", 0).await.unwrap().end;
    let err = a.append("batch", events(0, 1001, "big")).await.unwrap_err();
    assert!(matches!(err, LogError::Invalid(_)), "{err:?}");
    assert_eq!(
        a.bounds("batch", 0).await.unwrap().end,
        end,
        "nothing stored"
    );
}

/// JetStream has no transaction across streams: a call spanning partitions whose share
/// in one partition is refused while another's is stored must not be reported as
/// success (HTTP 201) nor as "not applied" (503): it is `Indeterminate` (504).
#[tokio::test]
async fn given_one_partition_refuses_when_a_batch_spans_partitions_then_the_answer_is_indeterminate_never_success(
) {
    let nats = common::server().await;
    let log = common::connect(&nats).await;
    // Partition 1's stream exists with a 16-byte message limit (as if an operator
    // had set it): the log adopts it, and the server refuses bigger events.
    let stream = log.stream_of("split", 1);
    let create = serde_json::json!({
        "name": stream,
        "subjects": ["meshd.log.split.1"],
        "storage": "file",
        "max_msg_size": 16,
        "allow_direct": true,
        "allow_atomic": true,
    });
    let answer = log
        .client()
        .request(
            format!("$JS.API.STREAM.CREATE.{stream}"),
            create.to_string().into(),
        )
        .await
        .expect("create stream");
    assert!(
        !String::from_utf8_lossy(&answer.payload).contains("\"error\""),
        "{:?}",
        answer.payload
    );

    let big = vec![b'x'; 100];
    let err = log
        .append(
            "split",
            vec![
                (0, b"fits".to_vec()),
                (1, big.clone()),
                (0, b"fits too".to_vec()),
            ],
        )
        .await
        .unwrap_err();
    match &err {
        LogError::Indeterminate(detail) => {
            assert!(detail.contains("stored: partitions [0]"), "{detail}");
            assert!(detail.contains("refused: [1]"), "{detail}");
        }
        other => panic!("a partial write must be Indeterminate, got {other:?}"),
    }
    // What was stored is readable (a retry would store it again: at least once).
    assert_eq!(log.bounds("split", 0).await.unwrap().end, 2);
    assert_eq!(log.bounds("split", 1).await.unwrap().end, 0);

    // Refused everywhere: nothing stored, safe to retry.
    let err = log.append("split", vec![(1, big)]).await.unwrap_err();
    assert!(matches!(err, LogError::Unavailable(_)), "{err:?}");
    assert_eq!(log.bounds("split", 1).await.unwrap().end, 0);
}

#[tokio::test]
async fn appends_notices_an_append_made_by_another_client() {
    let nats = common::server().await;
    let reader = common::connect(&nats).await;
    let writer = common::connect(&nats).await;
    let mut appends = reader.appends("shared", 2);
    let mut own = reader.appends("shared", 0);
    let mut at = Vec::new();
    for i in 0..3u8 {
        at = writer
            .append("shared", vec![(2, vec![b'e', i])])
            .await
            .unwrap();
    }
    assert_eq!(at, vec![(2, 2)]);
    tokio::time::timeout(Duration::from_secs(5), async {
        // Each notice carries its stream sequence: the partition's end after it.
        while *appends.borrow_and_update() < 3 {
            appends.changed().await.expect("sender alive");
        }
    })
    .await
    .expect("the reader is told of all three within 5 s");
    // Woken, the reader finds the event (the notice comes after the store).
    let events = reader.read("shared", 2, 0, 10, usize::MAX).await.unwrap();
    assert_eq!(events.len(), 3);
    assert_eq!(events[2].payload, b"e\x02");
    // The writer's appends to partition 2 did not wake the reader's partition 0.
    assert!(!own.has_changed().unwrap());
    // Its own appends notify their partition as soon as they are acknowledged.
    own.borrow_and_update();
    reader
        .append("shared", vec![(0, b"own".to_vec())])
        .await
        .unwrap();
    assert!(own.has_changed().unwrap());
    assert!(*own.borrow_and_update() >= 1);
}

#[tokio::test]
async fn retention_by_size_and_age_is_enforced_by_jetstream_reported_never_skipped_and_spares_dead_letter_bodies(
) {
    let nats = common::server().await;
    let log = common::connect(&nats).await;
    for i in 0..10 {
        log.append("r", vec![(0, vec![b'x'; 100 + i])])
            .await
            .unwrap();
    }
    let body = log.append_body(b"dead event").await.unwrap();
    // By size: JetStream counts whole stored messages (~150 bytes each here).
    let report = log
        .enforce_retention(
            Retention {
                max_age_ms: None,
                max_bytes: Some(600),
            },
            0,
        )
        .await
        .unwrap();
    let b = log.bounds("r", 0).await.unwrap();
    assert!(b.start > 0 && b.start < 10 && b.end == 10, "{b:?}");
    assert_eq!(report.events_removed, b.start);
    match log.read("r", 0, 0, 10, usize::MAX).await {
        Err(LogError::BelowRetention {
            requested: 0,
            start,
            ..
        }) => assert_eq!(start, b.start),
        other => panic!("a read below the retained start must be reported, got {other:?}"),
    }
    let rest = log.read("r", 0, b.start, 100, usize::MAX).await.unwrap();
    assert_eq!(rest.len() as u64, 10 - b.start);
    assert_eq!(rest[0].offset, b.start);
    // The same limits again: nothing to change, nothing removed.
    let again = log
        .enforce_retention(
            Retention {
                max_age_ms: None,
                max_bytes: Some(600),
            },
            0,
        )
        .await
        .unwrap();
    assert_eq!(again.events_removed, 0);

    // By age (JetStream's clock: wait it out).
    let by_age = log
        .enforce_retention(
            Retention {
                max_age_ms: Some(1000),
                max_bytes: None,
            },
            0,
        )
        .await
        .unwrap();
    // A stream created from now on gets the limits too.
    log.append("r2", vec![(0, b"young".to_vec())])
        .await
        .unwrap();
    let log2 = log.clone();
    wait_until(
        Duration::from_secs(10),
        "age retention empties both partitions",
        || {
            let log = log2.clone();
            async move {
                let (b1, b2) = (log.bounds("r", 0).await?, log.bounds("r2", 0).await?);
                anyhow::ensure!(b1.start == 10 && b2.start == 1, "{b1:?} {b2:?}");
                Ok(())
            }
        },
    )
    .await
    .unwrap();
    assert!(matches!(
        log.read("r", 0, 9, 10, usize::MAX).await,
        Err(LogError::BelowRetention { start: 10, .. })
    ));
    assert!(log
        .read("r", 0, 10, 10, usize::MAX)
        .await
        .unwrap()
        .is_empty());
    let report = log
        .enforce_retention(
            Retention {
                max_age_ms: Some(1000),
                max_bytes: None,
            },
            0,
        )
        .await
        .unwrap();
    // Reported: how far the retained start of every stream known at the previous
    // pass moved ("r2" was created after it).
    assert_eq!(report.events_removed + by_age.events_removed, 10 - b.start);
    assert_eq!(
        log.read_body(&body).await.unwrap(),
        Some(b"dead event".to_vec()),
        "bodies are exempt"
    );
    // Appends continue after the retained start.
    assert_eq!(
        log.append("r", vec![(0, b"new".to_vec())]).await.unwrap(),
        vec![(0, 10)]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_acknowledged_appends_when_nats_server_is_sigkilled_then_every_one_is_there_after_restart(
) {
    let mut nats = common::server().await;
    let log = common::connect(&nats).await;
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..4u32 {
        let (log, stop) = (log.clone(), stop.clone());
        tasks.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut i = 0u32;
            while !stop.load(Ordering::SeqCst) {
                // Single events and small batches, over two partitions.
                let batch: Vec<(u32, Vec<u8>)> = (0..=(i % 3))
                    .map(|k| ((t + k) % 2, format!("{t}-{i}-{k}").into_bytes()))
                    .collect();
                match log.append("kill", batch.clone()).await {
                    Ok(got) => acked.extend(got.into_iter().zip(batch.into_iter().map(|e| e.1))),
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
                i += 1;
            }
            acked
        }));
    }
    // A partition nobody appends to: only the reconnect can wake it.
    let mut quiet = log.appends("quiet", 0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    nats.kill();
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    let mut acked: BTreeMap<(u32, u64), Vec<u8>> = BTreeMap::new();
    for t in tasks {
        for (pos, payload) in t.await.unwrap() {
            assert!(
                acked.insert(pos, payload).is_none(),
                "{pos:?} acknowledged twice"
            );
        }
    }
    assert!(
        acked.len() > 20,
        "appenders made progress ({})",
        acked.len()
    );

    nats.restart().await.unwrap();
    // The same client reconnects by itself; a fresh one sees the same.
    let fresh = common::connect(&nats).await;
    for reader in [&log, &fresh] {
        let reader = reader.clone();
        let acked = acked.clone();
        wait_until(
            Duration::from_secs(15),
            "every acknowledged event is back",
            || {
                let (reader, acked) = (reader.clone(), acked.clone());
                async move {
                    for p in 0..2u32 {
                        let stored = reader.read("kill", p, 0, 100_000, usize::MAX).await?;
                        let stored: BTreeMap<u64, Vec<u8>> =
                            stored.into_iter().map(|e| (e.offset, e.payload)).collect();
                        for ((q, o), payload) in acked.iter().filter(|((q, _), _)| *q == p) {
                            anyhow::ensure!(
                                stored.get(o) == Some(payload),
                                "acknowledged event {q}/{o} lost or changed"
                            );
                        }
                    }
                    Ok(())
                }
            },
        )
        .await
        .unwrap();
    }
    // Notices sent while disconnected are lost: the reconnect wakes every receiver.
    tokio::time::timeout(Duration::from_secs(15), quiet.changed())
        .await
        .expect("the reconnect wakes a receiver within 15 s")
        .expect("the sender is open");
    // Offsets continue after what survived; none is given twice.
    for p in 0..2u32 {
        let end = fresh.bounds("kill", p).await.unwrap().end;
        let max_acked = acked.keys().filter(|(q, _)| *q == p).map(|(_, o)| *o).max();
        assert!(max_acked.is_none_or(|m| m < end));
        let got = log
            .append("kill", vec![(p, b"after".to_vec())])
            .await
            .unwrap();
        assert_eq!(got, vec![(p, end)]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_paused_nats_server_when_appending_then_it_answers_within_its_timeout_and_recovers_after_sigcont_without_a_new_client(
) {
    let nats = common::server().await;
    let log = common::connect(&nats).await;
    log.append("pause", vec![(0, b"before".to_vec())])
        .await
        .unwrap();
    nats.pause();
    let limit = common::TIMEOUT + Duration::from_secs(1);

    let started = Instant::now();
    let err = log
        .append("pause", vec![(0, b"during".to_vec())])
        .await
        .unwrap_err();
    assert!(
        started.elapsed() < limit,
        "answered in {:?}",
        started.elapsed()
    );
    // It went out (the socket is open) and nobody answered: stored or not (504).
    assert!(matches!(err, LogError::Indeterminate(_)), "{err:?}");
    let started = Instant::now();
    let batch = log
        .append("pause", vec![(0, b"b1".to_vec()), (0, b"b2".to_vec())])
        .await;
    assert!(started.elapsed() < limit);
    assert!(batch.is_err());
    let started = Instant::now();
    assert!(matches!(
        log.bounds("pause", 0).await,
        Err(LogError::Unavailable(_))
    ));
    assert!(matches!(
        log.read("pause", 0, 0, 10, usize::MAX).await,
        Err(LogError::Unavailable(_))
    ));
    assert!(matches!(
        log.append_body(b"body").await,
        Err(LogError::Indeterminate(_) | LogError::Unavailable(_))
    ));
    assert!(started.elapsed() < limit * 3);

    nats.resume();
    let log2 = log.clone();
    let got = wait_until(Duration::from_secs(15), "appends succeed again", || {
        let log = log2.clone();
        async move { Ok(log.append("pause", vec![(0, b"after".to_vec())]).await?) }
    })
    .await
    .unwrap();
    // Whatever the unknown writes did, offsets stay contiguous and nothing is lost.
    let events = log.read("pause", 0, 0, 100, usize::MAX).await.unwrap();
    assert_eq!(
        events.iter().map(|e| e.offset).collect::<Vec<_>>(),
        (0..events.len() as u64).collect::<Vec<_>>()
    );
    assert_eq!(events[0].payload, b"before");
    assert_eq!(events.last().unwrap().payload, b"after");
    assert_eq!(got, vec![(0, events.len() as u64 - 1)]);
}

#[tokio::test]
async fn connecting_to_no_server_is_unavailable_within_the_connect_timeout() {
    let port = meshd_test_support::etcd::free_port();
    let mut config = NatsConfig::parse(&format!("nats://127.0.0.1:{port}")).unwrap();
    config.connect_timeout = Duration::from_secs(1);
    let started = Instant::now();
    let err = NatsLog::connect(config).await.err().expect("no server");
    assert!(matches!(err, LogError::Unavailable(_)), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn large_events_and_long_topic_names_work_and_oversized_events_are_invalid() {
    let nats = common::server().await;
    let log = common::connect(&nats).await;
    let mib: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    log.append("big", vec![(0, mib.clone())]).await.unwrap();
    assert_eq!(
        log.read("big", 0, 0, 1, usize::MAX).await.unwrap()[0].payload,
        mib
    );
    let err = log
        .append("big", vec![(0, vec![0; 3 << 20])])
        .await
        .unwrap_err();
    assert!(matches!(err, LogError::Invalid(_)), "{err:?}");
    assert_eq!(log.bounds("big", 0).await.unwrap().end, 1);

    let long = ".".repeat(249);
    let other = format!("{}_", ".".repeat(248));
    log.append(&long, vec![(1023, b"dots".to_vec())])
        .await
        .unwrap();
    log.append(&other, vec![(1023, b"other".to_vec())])
        .await
        .unwrap();
    assert_eq!(
        log.read(&long, 1023, 0, 5, usize::MAX).await.unwrap()[0].payload,
        b"dots"
    );
    log.delete_topic(&long).await.unwrap();
    assert_eq!(log.bounds(&long, 1023).await.unwrap().end, 0);
    assert_eq!(log.bounds(&other, 1023).await.unwrap().end, 1);
}
