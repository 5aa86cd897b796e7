//! The OffsetStore: never backwards except by a recorded reset, durable before it
//! answers, per subscription incarnation, and fenced checkpoints to Meta.

mod common;

use meshd_meta::fence::Ownership;
use meshd_meta::MetaError;
use meshd_meta_embedded::{EmbeddedConfig, EmbeddedMeta};
use meshd_stores::offsets::{OffsetError, OffsetKey, OffsetStore};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

fn key(sub: &str, inc: i64, p: u32) -> OffsetKey {
    OffsetKey {
        subscription: sub.into(),
        incarnation: inc,
        topic: "orders".into(),
        partition: p,
    }
}

#[tokio::test]
async fn commits_never_move_backwards_and_resets_record_a_new_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let o = &stores.offsets;
    let k = key("s", 1, 0);
    assert_eq!(o.get(&k).await.unwrap(), None);
    assert_eq!(o.commit(&k, 10).await.unwrap().offset, 10);
    assert_eq!(
        o.commit(&k, 10).await.unwrap().offset,
        10,
        "the same value is a no-op"
    );
    let err = o.commit(&k, 9).await.unwrap_err();
    assert_eq!(
        err,
        OffsetError::Backwards {
            current: 10,
            requested: 9
        }
    );
    assert_eq!(o.backwards_rejections(), 1);
    assert_eq!(o.get(&k).await.unwrap().unwrap().offset, 10);
    let r = o.reset(&k, 3).await.unwrap();
    assert_eq!((r.offset, r.epoch), (3, 1));
    assert_eq!(
        o.commit(&k, 5).await.unwrap().epoch,
        1,
        "commits keep the reset's epoch"
    );
    // Another incarnation of the same name starts afresh.
    assert_eq!(o.get(&key("s", 2, 0)).await.unwrap(), None);
    o.commit(&key("s", 2, 0), 1).await.unwrap();
    assert_eq!(o.list("s", 1).await.unwrap().len(), 1);
    o.drop_subscription("s", 1).await.unwrap();
    assert!(o.list("s", 1).await.unwrap().is_empty());
    assert_eq!(o.list("s", 2).await.unwrap().len(), 1);
    drop(stores);
    let stores = common::open(dir.path());
    assert_eq!(
        stores.offsets.get(&k).await.unwrap(),
        None,
        "dropped offsets stay dropped"
    );
    assert_eq!(
        stores
            .offsets
            .get(&key("s", 2, 0))
            .await
            .unwrap()
            .unwrap()
            .offset,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_concurrent_committers_when_power_is_cut_then_every_acknowledged_commit_survives() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let offsets = Arc::new(stores.offsets.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for p in 0..6u32 {
        let offsets = offsets.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let k = key("pc", 1, p);
            let mut acked = 0;
            let mut next = 1;
            while !stop.load(Ordering::SeqCst) {
                if offsets.commit(&k, next).await.is_ok() {
                    acked = next;
                }
                next += 1;
            }
            (k, acked)
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let image = power.cut();
    stop.store(true, Ordering::SeqCst);
    let mut acked = Vec::new();
    for t in tasks {
        acked.push(t.await.unwrap());
    }
    drop(stores);
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, rebooted.path());
    for (k, offset) in acked {
        assert!(offset > 0);
        let got = stores
            .offsets
            .get(&k)
            .await
            .unwrap()
            .map(|c| c.offset)
            .unwrap_or(0);
        assert!(
            got >= offset,
            "partition {}: acknowledged {offset}, recovered {got}",
            k.partition
        );
    }
}

#[tokio::test]
async fn given_a_failed_fsync_then_the_commit_is_not_shown_and_the_store_fail_stops() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let k = key("f", 1, 0);
    stores.offsets.commit(&k, 4).await.unwrap();
    power.fail_syncs(true);
    // Written but not durable: its outcome is unknown, not "not applied".
    assert!(matches!(
        stores.offsets.commit(&k, 8).await,
        Err(OffsetError::Indeterminate(_))
    ));
    power.fail_syncs(false);
    assert!(
        matches!(stores.offsets.get(&k).await, Err(OffsetError::Failed(_))),
        "a fail-stopped store serves nothing"
    );
    // Refused, unwritten.
    assert!(matches!(
        stores.offsets.commit(&k, 9).await,
        Err(OffsetError::Failed(_))
    ));
    assert_eq!(
        power.pending_batches(),
        1,
        "only the unknown commit was written"
    );
}

#[tokio::test]
async fn checkpoints_are_fenced_by_the_owner_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let meta_dir = tempfile::tempdir().unwrap();
    let meta = EmbeddedMeta::open_dir(meta_dir.path(), EmbeddedConfig::default()).unwrap();
    let k = key("cp", 7, 3);
    stores.offsets.commit(&k, 42).await.unwrap();
    let owner_key = b"meshd/v1/owners/partitions/orders/3";
    let a = Ownership::acquire(&meta, owner_key, b"A", None)
        .await
        .unwrap();
    stores.offsets.checkpoint(&meta, &a, &k).await.unwrap();
    assert_eq!(
        stores
            .offsets
            .load_checkpoint(&meta, &k)
            .await
            .unwrap()
            .unwrap()
            .offset,
        42
    );
    let _b = Ownership::take_over(&meta, owner_key, b"B", None)
        .await
        .unwrap();
    stores.offsets.commit(&k, 50).await.unwrap();
    let err = stores.offsets.checkpoint(&meta, &a, &k).await.unwrap_err();
    assert_eq!(err, OffsetError::Meta(MetaError::Fenced));
    assert_eq!(
        stores
            .offsets
            .load_checkpoint(&meta, &k)
            .await
            .unwrap()
            .unwrap()
            .offset,
        42,
        "a stale owner's checkpoint is not applied"
    );
}

#[tokio::test]
async fn the_first_start_written_to_meta_wins_and_a_checkpoint_replaces_it() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let meta_dir = tempfile::tempdir().unwrap();
    let meta = EmbeddedMeta::open_dir(meta_dir.path(), EmbeddedConfig::default()).unwrap();
    let k = key("init", 9, 0);
    // The creator writes the start (the log's end when it created the subscription);
    // a later owner computing another start gets the first one back.
    let first = stores.offsets.init_checkpoint(&meta, &k, 17).await.unwrap();
    assert_eq!((first.offset, first.epoch), (17, 0));
    let again = stores.offsets.init_checkpoint(&meta, &k, 40).await.unwrap();
    assert_eq!(again, first, "put-if-absent: one start for everyone");
    // An owner's checkpoint moves it on; init never moves it back.
    stores.offsets.commit(&k, 30).await.unwrap();
    let owner = Ownership::acquire(&meta, b"meshd/v1/owners/partition/t/0", b"A", None)
        .await
        .unwrap();
    stores.offsets.checkpoint(&meta, &owner, &k).await.unwrap();
    let after = stores.offsets.init_checkpoint(&meta, &k, 0).await.unwrap();
    assert_eq!(after.offset, 30);
}

#[tokio::test]
async fn dropping_checkpoints_removes_exactly_that_incarnations() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let meta_dir = tempfile::tempdir().unwrap();
    let meta = EmbeddedMeta::open_dir(meta_dir.path(), EmbeddedConfig::default()).unwrap();
    // 150 partitions: more than one delete transaction.
    for p in 0..150 {
        stores
            .offsets
            .init_checkpoint(&meta, &key("gone", 1, p), 5)
            .await
            .unwrap();
    }
    let kept = [key("gone", 12, 0), key("gone2", 1, 0), key("other", 1, 0)];
    for k in &kept {
        stores.offsets.init_checkpoint(&meta, k, 7).await.unwrap();
    }
    let n = stores
        .offsets
        .drop_checkpoints(&meta, "gone", 1)
        .await
        .unwrap();
    assert_eq!(n, 150);
    for p in [0, 77, 149] {
        assert_eq!(
            stores
                .offsets
                .load_checkpoint(&meta, &key("gone", 1, p))
                .await
                .unwrap(),
            None
        );
    }
    for k in &kept {
        assert!(
            stores
                .offsets
                .load_checkpoint(&meta, k)
                .await
                .unwrap()
                .is_some(),
            "{k:?}"
        );
    }
}
