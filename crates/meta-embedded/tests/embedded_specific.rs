//! What only the embedded backend has to show: acknowledged writes survive a power
//! cut (not just a process kill), damaged records are reported and never decoded, the
//! history is bounded, a failed fsync fail-stops the store (and so does a failure of
//! the engine it shares with the Local stores), and the directory is exclusive.

use meshd_local::testing::PowerCutEngine;
use meshd_local::{Batch, Durability, KvEngine, RocksEngine};
use meshd_meta::{Meta, MetaError, Precondition, RangeOptions, Txn, WatchError};
use meshd_meta_embedded::{EmbeddedConfig, EmbeddedMeta, COLUMN_FAMILY};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_concurrent_writers_when_power_is_cut_then_every_acknowledged_write_survives() {
    let live_dir = tempfile::tempdir().unwrap();
    let engine = RocksEngine::open(live_dir.path(), &[COLUMN_FAMILY]).unwrap();
    let (engine, power) = PowerCutEngine::wrap(engine, &[COLUMN_FAMILY]).unwrap();
    let meta = Arc::new(EmbeddedMeta::open(Arc::new(engine), EmbeddedConfig::default()).unwrap());

    let cut = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for t in 0..8 {
        let meta = meta.clone();
        let cut = cut.clone();
        writers.push(tokio::spawn(async move {
            let mut acked: HashMap<Vec<u8>, (Vec<u8>, i64)> = HashMap::new();
            let mut leases = Vec::new();
            let mut i = 0u64;
            while !cut.load(Ordering::SeqCst) {
                let key = format!("pc/{t}/{}", i % 8).into_bytes();
                let value = format!("{t}-{i}").into_bytes();
                let res = if i.is_multiple_of(3) {
                    // Multi-key transactions too: both keys or neither.
                    let twin = format!("pc/{t}/twin-{}", i % 8).into_bytes();
                    meta.txn(Txn::new().put(&key, &value).put(&twin, &value))
                        .await
                        .map(|r| {
                            acked.insert(twin, (value.clone(), r.revision));
                            r.revision
                        })
                } else {
                    meta.put(&key, &value, Precondition::None, None)
                        .await
                        .map(|r| r.revision)
                };
                if let Ok(revision) = res {
                    acked.insert(key, (value, revision));
                }
                if i.is_multiple_of(10) {
                    if let Ok(lease) = meta.grant(Duration::from_secs(600)).await {
                        leases.push(lease.id);
                    }
                }
                i += 1;
            }
            (acked, leases)
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let image = power.cut();
    cut.store(true, Ordering::SeqCst);
    let mut acked = HashMap::new();
    let mut leases = Vec::new();
    for w in writers {
        let (a, l) = w.await.unwrap();
        acked.extend(a);
        leases.extend(l);
    }
    assert!(
        acked.len() > 50,
        "the writers made progress: {} keys",
        acked.len()
    );
    meta.close();

    // Boot a fresh store from what was on stable storage at the cut.
    let restored_dir = tempfile::tempdir().unwrap();
    {
        let fresh = RocksEngine::open(restored_dir.path(), &[COLUMN_FAMILY]).unwrap();
        image.restore_into(&fresh).unwrap();
    }
    let meta = EmbeddedMeta::open_dir(restored_dir.path(), EmbeddedConfig::default()).unwrap();
    let stored: HashMap<Vec<u8>, _> = meta
        .range(b"pc/", RangeOptions::default())
        .await
        .unwrap()
        .kvs
        .into_iter()
        .map(|kv| (kv.key.clone(), kv))
        .collect();
    let max_acked = acked.values().map(|(_, r)| *r).max().unwrap();
    for (key, (value, revision)) in &acked {
        let kv = stored.get(key).unwrap_or_else(|| {
            panic!(
                "acknowledged {} lost in the power cut",
                String::from_utf8_lossy(key)
            )
        });
        assert!(
            kv.mod_revision >= *revision,
            "{} went back in time",
            String::from_utf8_lossy(key)
        );
        if kv.mod_revision == *revision {
            assert_eq!(&kv.value, value);
        }
    }
    let status = meta.status().await.unwrap();
    assert!(
        status.revision >= max_acked,
        "revision {} < acknowledged {max_acked}",
        status.revision
    );
    for lease in leases {
        meta.keep_alive(lease)
            .await
            .expect("an acknowledged grant survives the power cut");
    }
    let next = meta
        .put(b"pc/after", b"x", Precondition::None, None)
        .await
        .unwrap();
    assert!(next.revision > max_acked);
}

#[tokio::test]
async fn given_a_damaged_key_record_when_read_then_it_is_reported_as_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    {
        let meta = EmbeddedMeta::open_dir(dir.path(), EmbeddedConfig::default()).unwrap();
        meta.put(b"victim", b"precious", Precondition::None, None)
            .await
            .unwrap();
        meta.put(b"victim-neighbour", b"fine", Precondition::None, None)
            .await
            .unwrap();
        meta.close();
    }
    {
        // The on-disk layout: key records live at b"k" + the user key.
        let engine = RocksEngine::open(dir.path(), &[COLUMN_FAMILY]).unwrap();
        let mut record = engine
            .get(COLUMN_FAMILY, b"kvictim")
            .unwrap()
            .expect("record present");
        let last_value_byte = record.len() - 5;
        record[last_value_byte] ^= 0x20;
        let mut b = Batch::new();
        b.put(COLUMN_FAMILY, b"kvictim".to_vec(), record);
        engine.write(b, Durability::Sync).unwrap();
    }
    let meta = EmbeddedMeta::open_dir(dir.path(), EmbeddedConfig::default()).unwrap();
    match meta.get(b"victim").await {
        Err(MetaError::Corrupt { key, reason }) => {
            assert_eq!(key, "victim");
            assert!(reason.contains("checksum"), "{reason}");
        }
        other => panic!("a damaged record must be reported, got {other:?}"),
    }
    assert!(matches!(
        meta.range(b"victim", RangeOptions::default()).await,
        Err(MetaError::Corrupt { .. })
    ));
    assert_eq!(
        meta.get(b"victim-neighbour")
            .await
            .unwrap()
            .kv
            .unwrap()
            .value,
        b"fine"
    );
}

#[tokio::test]
async fn given_a_small_history_bound_when_watching_from_before_it_then_compacted() {
    let dir = tempfile::tempdir().unwrap();
    let config = EmbeddedConfig {
        history_limit: 5,
        ..EmbeddedConfig::default()
    };
    let meta = EmbeddedMeta::open_dir(dir.path(), config).unwrap();
    let mut revs = Vec::new();
    for i in 0..10 {
        revs.push(
            meta.put(format!("h/{i}").as_bytes(), b"v", Precondition::None, None)
                .await
                .unwrap()
                .revision,
        );
    }
    let mut w = meta.watch(b"h/", revs[0]).await.unwrap();
    match w.next().await {
        Some(Err(WatchError::Compacted { compact_revision })) => {
            assert_eq!(compact_revision, revs[5])
        }
        other => panic!("expected compacted, got {other:?}"),
    }
    let mut w = meta.watch(b"h/", revs[5]).await.unwrap();
    let mut got = Vec::new();
    while got.len() < 5 {
        let batch = tokio::time::timeout(Duration::from_secs(5), w.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        got.extend(batch.events.iter().map(|e| e.revision()));
    }
    assert_eq!(got, revs[5..].to_vec());
}

#[tokio::test]
async fn given_a_failed_fsync_when_writing_then_outcome_unknown_and_the_store_fail_stops() {
    let dir = tempfile::tempdir().unwrap();
    let engine = RocksEngine::open(dir.path(), &[COLUMN_FAMILY]).unwrap();
    let (engine, disk) = PowerCutEngine::wrap(engine, &[COLUMN_FAMILY]).unwrap();
    let meta = EmbeddedMeta::open(Arc::new(engine), EmbeddedConfig::default()).unwrap();
    meta.put(b"before", b"ok", Precondition::None, None)
        .await
        .unwrap();
    disk.fail_syncs(true);
    let err = meta
        .put(b"during", b"?", Precondition::None, None)
        .await
        .unwrap_err();
    assert!(matches!(err, MetaError::Indeterminate(_)), "{err:?}");
    // The disk is "fine" again, but what reached it is unknown: the store stays down.
    disk.fail_syncs(false);
    assert!(matches!(
        meta.put(b"after", b"x", Precondition::None, None).await,
        Err(MetaError::Failed(_))
    ));
    assert!(
        matches!(meta.get(b"before").await, Err(MetaError::Failed(_))),
        "no reads of possibly non-durable data"
    );
    assert!(matches!(
        meta.grant(Duration::from_secs(5)).await,
        Err(MetaError::Failed(_))
    ));
    meta.close();
    // A restart recovers from what is on disk.
    let meta = EmbeddedMeta::open_dir(dir.path(), EmbeddedConfig::default()).unwrap();
    assert_eq!(meta.get(b"before").await.unwrap().kv.unwrap().value, b"ok");
}

/// The Local engine the embedded Meta shares with the Local stores, which can fail
/// under it: once `fail` is called, its `failure()` says why, and writes and syncs are
/// refused as a real engine refuses them after a failed fsync (nothing written).
struct SharedEngine {
    inner: RocksEngine,
    failure: std::sync::Mutex<Option<String>>,
    /// Writes that reached the engine (refused ones are not counted).
    writes: AtomicUsize,
}

impl SharedEngine {
    fn fail(&self, reason: &str) {
        *self.failure.lock().unwrap() = Some(reason.to_string());
    }

    fn refuse(&self) -> Result<(), meshd_local::LocalError> {
        match self.failure() {
            Some(reason) => Err(meshd_local::LocalError::Poisoned(reason)),
            None => Ok(()),
        }
    }
}

impl KvEngine for SharedEngine {
    fn get(
        &self,
        cf: &'static str,
        key: &[u8],
    ) -> Result<Option<Vec<u8>>, meshd_local::LocalError> {
        self.inner.get(cf, key)
    }

    fn scan(
        &self,
        cf: &'static str,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<meshd_local::Rows, meshd_local::LocalError> {
        self.inner.scan(cf, start, end, limit)
    }

    fn write(&self, batch: Batch, durability: Durability) -> Result<(), meshd_local::LocalError> {
        self.refuse()?;
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.inner.write(batch, durability)
    }

    fn sync(&self) -> Result<(), meshd_local::LocalError> {
        self.refuse()?;
        self.inner.sync()
    }

    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }

    fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap().clone()
    }
}

/// The engine failed under Meta (a Local store's fsync failed first): Meta's health
/// says so before Meta tries a write, and its writes are refused as not applied
/// (`Failed`, HTTP 503), never answered "outcome unknown" (`Indeterminate`, 504) for a
/// write that was never made.
#[tokio::test]
async fn given_the_shared_engine_failed_under_it_then_meta_reports_failed_at_once_and_refuses_writes_unwritten(
) {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(SharedEngine {
        inner: RocksEngine::open(dir.path(), &[COLUMN_FAMILY]).unwrap(),
        failure: std::sync::Mutex::new(None),
        writes: AtomicUsize::new(0),
    });
    let meta = EmbeddedMeta::open(engine.clone(), EmbeddedConfig::default()).unwrap();
    meta.put(b"before", b"ok", Precondition::None, None)
        .await
        .unwrap();
    meta.status().await.expect("healthy before the failure");

    engine.fail("fsync failed: the partition log's group");
    let written = engine.writes.load(Ordering::SeqCst);
    let err = meta.status().await.unwrap_err();
    assert!(
        matches!(&err, MetaError::Failed(r) if r.contains("the partition log's group")),
        "{err:?}"
    );
    let err = meta
        .put(b"after", b"x", Precondition::None, None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, MetaError::Failed(_)),
        "refused, not unknown: {err:?}"
    );
    assert!(matches!(
        meta.grant(Duration::from_secs(5)).await,
        Err(MetaError::Failed(_))
    ));
    assert_eq!(
        engine.writes.load(Ordering::SeqCst),
        written,
        "nothing reached the engine"
    );
}

/// The same, when the engine fails before Meta's first call after it is a write: the
/// write is still refused unwritten.
#[tokio::test]
async fn given_the_shared_engine_failed_under_it_when_the_next_call_is_a_write_then_it_is_refused_unwritten(
) {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(SharedEngine {
        inner: RocksEngine::open(dir.path(), &[COLUMN_FAMILY]).unwrap(),
        failure: std::sync::Mutex::new(None),
        writes: AtomicUsize::new(0),
    });
    let meta = EmbeddedMeta::open(engine.clone(), EmbeddedConfig::default()).unwrap();
    engine.fail("fsync failed: the partition log's group");
    let err = meta.txn(Txn::new().put(b"k", b"v")).await.unwrap_err();
    assert!(matches!(err, MetaError::Failed(_)), "{err:?}");
    assert_eq!(engine.writes.load(Ordering::SeqCst), 0);
    assert!(matches!(meta.status().await, Err(MetaError::Failed(_))));
}

#[tokio::test]
async fn given_an_open_store_when_the_directory_is_opened_again_then_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let first = EmbeddedMeta::open_dir(dir.path(), EmbeddedConfig::default()).unwrap();
    let err = EmbeddedMeta::open_dir(dir.path(), EmbeddedConfig::default())
        .err()
        .expect("second open must fail");
    assert!(
        err.to_string().contains("locked by another meshd process"),
        "{err}"
    );
    first.close();
    EmbeddedMeta::open_dir(dir.path(), EmbeddedConfig::default()).expect("open after close");
}
