//! The DeliveryStateStore: attempts durable before the hand-out, acks made durable by
//! the flusher without being waited for, resolve atomic with the offset, one key per
//! record (an earlier release's deadline index dropped at open), and fail-stop.

mod common;

use meshd_stores::delivery::{
    DeliveryError, DeliveryRecord, DeliveryState, DeliveryStateStore, OffsetAdvance,
};
use meshd_stores::offsets::{Committed, OffsetKey, OffsetStore};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn pkey(p: u32) -> OffsetKey {
    OffsetKey {
        subscription: "sub".into(),
        incarnation: 1,
        topic: "orders".into(),
        partition: p,
    }
}

fn record(p: u32, offset: u64, attempt: u32, deadline_ms: u64) -> DeliveryRecord {
    DeliveryRecord {
        key: pkey(p),
        offset,
        attempt,
        delivery_id: format!("{p}-{offset}-{attempt}"),
        deadline_ms,
        last_reason: None,
        first_delivered_at_ms: 1,
        state: DeliveryState::InFlight,
        owner_epoch: 0,
        session: None,
    }
}

/// How many flusher ticks [`synced_by_the_flusher`] waits at most.
const FLUSHER_TICKS: u32 = 20;

/// Waits until the flusher alone has synced every buffered write: the caller makes no
/// further write, sync or read that would sync them. A liveness bound, not a speed
/// check: the flusher (`flusher` in `src/delivery.rs`) sleeps one flush interval and
/// then fsyncs whatever is dirty, so a write marked dirty is synced by its next tick;
/// failing here means it was still not durable after [`FLUSHER_TICKS`] of them.
///
/// Not "within one flush interval": the interval bounds when the flusher *starts*
/// its fsync, but the fsync is a real one (the power-cut engine wraps a real
/// RocksDB), and how long it takes on a busy disk is bounded by no setting. Holding
/// it to the interval plus a slack would be a timed assertion on the disk's speed.
async fn synced_by_the_flusher(power: &meshd_local::testing::PowerCut, what: &str) {
    let bound = common::FLUSH * FLUSHER_TICKS;
    let deadline = std::time::Instant::now() + bound;
    while power.pending_batches() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} was not synced by the flusher within {FLUSHER_TICKS} of its ticks ({bound:?})"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_attempts_recorded_when_power_is_cut_then_no_attempt_count_goes_back() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let d = Arc::new(stores.deliveries.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for p in 0..4u32 {
        let d = d.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            let mut attempt = 1;
            while !stop.load(Ordering::SeqCst) {
                for offset in 0..5 {
                    if d.record_attempt(record(p, offset, attempt, 1000 + attempt as u64))
                        .await
                        .is_ok()
                    {
                        acked.push((p, offset, attempt));
                    }
                }
                attempt += 1;
            }
            acked
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let image = power.cut();
    stop.store(true, Ordering::SeqCst);
    let mut acked = Vec::new();
    for t in tasks {
        acked.extend(t.await.unwrap());
    }
    drop(stores);
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, rebooted.path());
    let all = stores.deliveries.load_all().await.unwrap();
    for (p, offset, attempt) in acked {
        let r = all
            .iter()
            .find(|r| r.key.partition == p && r.offset == offset)
            .expect("recorded delivery lost");
        assert!(
            r.attempt >= attempt,
            "attempt count of {p}/{offset} went back from {attempt} to {}",
            r.attempt
        );
    }
}

/// An update is answered once written, not once durable; the flusher makes it durable
/// with nothing else from the caller, so it survives a power cut (see
/// [`synced_by_the_flusher`] for why this is not a timed "within the interval" check).
#[tokio::test]
async fn updates_reach_disk_by_the_flusher_without_being_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let d = &stores.deliveries;
    d.record_attempt(record(0, 1, 1, 500)).await.unwrap();
    let mut acked = record(0, 1, 1, 500);
    acked.state = DeliveryState::AckedAwaitingCommit;
    d.update(vec![acked.clone()]).await.unwrap();
    assert_eq!(
        d.get(&pkey(0), 1).await.unwrap(),
        Some(acked.clone()),
        "visible at once"
    );
    synced_by_the_flusher(&power, "the update").await;
    let image = power.cut();
    drop(stores);
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, rebooted.path());
    assert_eq!(
        stores.deliveries.get(&pkey(0), 1).await.unwrap(),
        Some(acked)
    );
}

/// Records 0..3 and resolves 0 and 1 with the offset moved to 2 (not waiting for it).
async fn resolve_two_of_three(d: &meshd_stores_local::delivery::RocksDeliveryStore) {
    for offset in 0..3 {
        d.record_attempt(record(0, offset, 1, 100 + offset))
            .await
            .unwrap();
    }
    d.resolve(
        vec![(pkey(0), 0), (pkey(0), 1)],
        Some(OffsetAdvance {
            key: pkey(0),
            to: 2,
        }),
    )
    .await
    .unwrap();
}

/// What a reboot from `image` holds: the offsets of the records left, and committed.
async fn left_and_committed(image: &meshd_local::testing::DurableImage) -> (Vec<u64>, Option<u64>) {
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(image, rebooted.path());
    let left = stores
        .deliveries
        .load_all()
        .await
        .unwrap()
        .iter()
        .map(|r| r.offset)
        .collect();
    let committed = stores
        .offsets
        .get(&pkey(0))
        .await
        .unwrap()
        .map(|c| c.offset);
    (left, committed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolve_is_one_batch_that_a_power_cut_keeps_whole_or_not_at_all() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    resolve_two_of_three(&stores.deliveries).await;
    // Cut at once: the flusher may or may not have run; either way all or nothing.
    let image = power.cut();
    drop(stores);
    let (left, committed) = left_and_committed(&image).await;
    assert!(
        (left == vec![2] && committed == Some(2)) || (left == vec![0, 1, 2] && committed.is_none()),
        "a torn resolve: records {left:?}, committed {committed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolve_with_updates_is_one_batch_that_a_power_cut_keeps_whole_or_not_at_all() {
    // Cut at once (the flusher may or may not have run) and after the flush: the
    // records 0 and 1 go, the offset moves to 2 and record 3 is acked, all or none.
    for flush in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let (stores, power) = common::open_with_power_cut(dir.path());
        let d = &stores.deliveries;
        let attempts = (0..4).map(|o| record(0, o, 1, 100 + o)).collect();
        d.record_attempts(attempts).await.unwrap();
        let mut acked = record(0, 3, 1, 103);
        acked.state = DeliveryState::AckedAwaitingCommit;
        d.resolve_and_update(
            vec![(pkey(0), 0), (pkey(0), 1)],
            Some(OffsetAdvance {
                key: pkey(0),
                to: 2,
            }),
            vec![acked.clone()],
        )
        .await
        .unwrap();
        assert_eq!(d.get(&pkey(0), 3).await.unwrap().as_ref(), Some(&acked));
        if flush {
            synced_by_the_flusher(&power, "the resolve and its update").await;
        }
        let image = power.cut();
        drop(stores);
        let rebooted = tempfile::tempdir().unwrap();
        let stores = common::reboot_from(&image, rebooted.path());
        let left: Vec<_> = stores.deliveries.load_all().await.unwrap();
        let committed = stores
            .offsets
            .get(&pkey(0))
            .await
            .unwrap()
            .map(|c| c.offset);
        let states: Vec<_> = left.iter().map(|r| (r.offset, r.state)).collect();
        let whole = committed == Some(2)
            && states
                == vec![
                    (2, DeliveryState::InFlight),
                    (3, DeliveryState::AckedAwaitingCommit),
                ];
        let none = committed.is_none()
            && states.len() == 4
            && states.iter().all(|(_, s)| *s == DeliveryState::InFlight);
        assert!(
            whole || (none && !flush),
            "flushed {flush}: records {states:?}, committed {committed:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolve_reaches_disk_by_the_flusher_without_being_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    resolve_two_of_three(&stores.deliveries).await;
    synced_by_the_flusher(&power, "the resolve").await;
    let image = power.cut();
    drop(stores);
    assert_eq!(left_and_committed(&image).await, (vec![2], Some(2)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_shows_a_resolve_only_once_it_is_durable_and_a_read_makes_it_so() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    resolve_two_of_three(&stores.deliveries).await;
    // The read sees the caller's own resolve: it forces the fsync first, so what it
    // shows survives a cut that follows at once.
    assert_eq!(
        stores.offsets.get(&pkey(0)).await.unwrap().unwrap().offset,
        2
    );
    assert_eq!(power.pending_batches(), 0, "shown before it was durable");
    let image = power.cut();
    drop(stores);
    assert_eq!(left_and_committed(&image).await, (vec![2], Some(2)));
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, rebooted.path());
    let left: Vec<u64> = stores
        .deliveries
        .load_all()
        .await
        .unwrap()
        .iter()
        .map(|r| r.offset)
        .collect();
    assert_eq!(left, vec![2]);
    // A backwards advance is refused and changes nothing.
    let err = stores
        .deliveries
        .resolve(
            vec![(pkey(0), 2)],
            Some(OffsetAdvance {
                key: pkey(0),
                to: 1,
            }),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::Offset(_)), "{err:?}");
    assert_eq!(stores.deliveries.load_all().await.unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adoption_replaces_a_resolve_that_was_not_durable_yet_and_a_flush_never_brings_it_back()
{
    let dir = tempfile::tempdir().unwrap();
    let (stores, _power) = common::open_with_power_cut(dir.path());
    resolve_two_of_three(&stores.deliveries).await;
    // Meta's checkpoint, behind the local value and of the same epoch.
    let meta = Committed {
        offset: 1,
        epoch: 0,
        at_ms: 42,
    };
    stores
        .deliveries
        .adopt_partition(&pkey(0), meta)
        .await
        .unwrap();
    stores.deliveries.flush().await.unwrap();
    assert_eq!(stores.offsets.get(&pkey(0)).await.unwrap(), Some(meta));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adopting_a_partition_drops_its_records_and_sets_metas_offset_in_one_durable_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let d = &stores.deliveries;
    // This instance owned partition 0 earlier: records and an offset of its own.
    for offset in 5..9 {
        d.record_attempt(record(0, offset, 2, 100 + offset))
            .await
            .unwrap();
    }
    d.record_attempt(record(1, 3, 1, 50)).await.unwrap();
    stores.offsets.commit(&pkey(0), 5).await.unwrap();
    // Meta's checkpoint (another owner moved on meanwhile; it may also be behind).
    for meta_offset in [12, 7] {
        let meta = Committed {
            offset: meta_offset,
            epoch: 3,
            at_ms: 42,
        };
        d.adopt_partition(&pkey(0), meta).await.unwrap();
        assert_eq!(stores.offsets.get(&pkey(0)).await.unwrap(), Some(meta));
    }
    let image = power.cut();
    drop(stores);
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, rebooted.path());
    let left: Vec<(u32, u64)> = stores
        .deliveries
        .load_all()
        .await
        .unwrap()
        .iter()
        .map(|r| (r.key.partition, r.offset))
        .collect();
    assert_eq!(
        left,
        vec![(1, 3)],
        "only the other partition's record is left"
    );
    assert_eq!(
        delivery_keys(&stores),
        vec![b'd'],
        "nothing but the other partition's record is left in the column family"
    );
    assert_eq!(
        stores.offsets.get(&pkey(0)).await.unwrap(),
        Some(Committed {
            offset: 7,
            epoch: 3,
            at_ms: 42
        }),
        "Meta's value exactly, durable"
    );
    // Commits go on from the adopted value.
    stores.offsets.commit(&pkey(0), 8).await.unwrap();
}

/// The first byte of every key in the `deliveries` column family (drops its
/// stores, then reads the data dir).
fn delivery_keys_in(dir: &std::path::Path) -> Vec<u8> {
    let engine =
        meshd_local::RocksEngine::open(dir, meshd_stores_local::keys::COLUMN_FAMILIES).unwrap();
    first_bytes_of_deliveries(&engine)
}

/// The first byte of every key in the `deliveries` column family of `stores`.
fn delivery_keys(stores: &meshd_stores_local::LocalStores) -> Vec<u8> {
    first_bytes_of_deliveries(stores.group.engine().as_ref())
}

fn first_bytes_of_deliveries(engine: &dyn meshd_local::KvEngine) -> Vec<u8> {
    engine
        .scan("deliveries", &[], None, 0)
        .unwrap()
        .iter()
        .map(|(k, _)| k[0])
        .collect()
}

#[tokio::test]
async fn a_reschedule_replaces_the_record_in_place_and_each_record_is_one_key() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let d = &stores.deliveries;
    d.record_attempt(record(0, 0, 1, 300)).await.unwrap();
    d.record_attempt(record(0, 1, 1, 100)).await.unwrap();
    d.record_attempt(record(1, 0, 1, 200)).await.unwrap();
    let mut later = record(0, 1, 2, 1_000);
    later.state = DeliveryState::WaitingRetry;
    later.last_reason = Some("nack: busy".into());
    d.update(vec![later.clone()]).await.unwrap();
    d.flush().await.unwrap();
    drop(stores);
    assert_eq!(
        delivery_keys_in(dir.path()),
        vec![b'd'; 3],
        "one key per record"
    );
    let stores = common::open(dir.path());
    assert_eq!(
        stores.deliveries.get(&pkey(0), 1).await.unwrap(),
        Some(later)
    );
    assert_eq!(stores.deliveries.load_all().await.unwrap().len(), 3);
    stores.deliveries.drop_subscription("sub", 1).await.unwrap();
    assert!(stores.deliveries.load_all().await.unwrap().is_empty());
    assert!(delivery_keys(&stores).is_empty());
}

#[tokio::test]
async fn an_earlier_releases_deadline_index_is_dropped_at_open_and_the_records_stay() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    for offset in 0..3 {
        stores
            .deliveries
            .record_attempt(record(0, offset, 1, 100 + offset))
            .await
            .unwrap();
    }
    let before = stores.deliveries.load_all().await.unwrap();
    // What an earlier release also wrote per record: `x` + deadline + the record's key.
    let mut index = meshd_local::Batch::new();
    for (k, _) in stores
        .group
        .engine()
        .scan("deliveries", b"d", Some(b"e"), 0)
        .unwrap()
    {
        let mut x = vec![b'x'];
        x.extend_from_slice(&100u64.to_be_bytes());
        x.extend_from_slice(&k);
        index.put("deliveries", x, Vec::new());
    }
    stores
        .group
        .engine()
        .write(index, meshd_local::Durability::Sync)
        .unwrap();
    drop(stores);
    assert_eq!(delivery_keys_in(dir.path()), b"dddxxx".to_vec());
    let stores = common::open(dir.path());
    assert_eq!(delivery_keys(&stores), b"ddd".to_vec(), "the index is gone");
    assert_eq!(stores.deliveries.load_all().await.unwrap(), before);
    drop(stores);
    // Durably: a second open finds nothing of it either.
    assert_eq!(delivery_keys_in(dir.path()), b"ddd".to_vec());
}

#[tokio::test]
async fn given_updates_of_several_records_then_they_are_one_write_all_of_them_or_none() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let d = &stores.deliveries;
    let attempts: Vec<_> = (0..3).map(|o| record(0, o, 1, 500)).collect();
    d.record_attempts(attempts.clone()).await.unwrap();
    let acked: Vec<_> = attempts
        .iter()
        .map(|r| DeliveryRecord {
            state: DeliveryState::AckedAwaitingCommit,
            ..r.clone()
        })
        .collect();
    // One invalid record (attempt 0) refuses the whole write: nothing of it applied.
    let mut bad = acked.clone();
    bad[1].attempt = 0;
    assert!(matches!(
        d.update(bad).await,
        Err(DeliveryError::Invalid(_))
    ));
    for r in &attempts {
        assert_eq!(d.get(&pkey(0), r.offset).await.unwrap().as_ref(), Some(r));
    }
    assert!(d.health().is_ok(), "a refused request does not poison");
    d.update(acked.clone()).await.unwrap();
    synced_by_the_flusher(&power, "the updates").await;
    let image = power.cut();
    drop(stores);
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, rebooted.path());
    for r in &acked {
        assert_eq!(
            stores
                .deliveries
                .get(&pkey(0), r.offset)
                .await
                .unwrap()
                .as_ref(),
            Some(r),
            "every update of the write survived the power cut"
        );
    }
}

/// Resolves submitted without waiting for them (as a partition task submits them).
const SUBMITTED: u64 = 2000;

/// Records attempts at 0..SUBMITTED, then submits one resolve per offset, each moving
/// the committed offset past it, and waits for none of them.
async fn submit_resolves(d: &meshd_stores_local::delivery::RocksDeliveryStore) {
    let attempts: Vec<_> = (0..SUBMITTED).map(|o| record(0, o, 1, 500)).collect();
    d.record_attempts(attempts).await.unwrap();
    for o in 0..SUBMITTED {
        d.submit_resolve_and_update(
            vec![(pkey(0), o)],
            Some(OffsetAdvance {
                key: pkey(0),
                to: o + 1,
            }),
            Vec::new(),
            Box::new(|r| r.expect("applied")),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_resolves_submitted_without_waiting_then_a_flush_covers_every_one_of_them() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    submit_resolves(&stores.deliveries).await;
    // A flush at once: it is ordered after every one of them.
    stores.deliveries.flush().await.unwrap();
    let image = power.cut();
    drop(stores);
    assert_eq!(
        left_and_committed(&image).await,
        (vec![], Some(SUBMITTED)),
        "a flush after the submits made all of them durable"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_resolves_submitted_without_waiting_then_a_read_of_committed_shows_the_last_one() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    submit_resolves(&stores.deliveries).await;
    // Read at once, as a client that was just told its ack went through: it reads its
    // own acks.
    assert_eq!(
        stores
            .offsets
            .get(&pkey(0))
            .await
            .unwrap()
            .map(|c| c.offset),
        Some(SUBMITTED)
    );
}

#[tokio::test]
async fn given_a_failed_write_submitted_without_waiting_then_it_is_told_outcome_unknown_and_later_writes_are_refused(
) {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let d = &stores.deliveries;
    d.record_attempt(record(0, 0, 1, 10)).await.unwrap();
    power.fail_writes(true);
    let (tx, rx) = tokio::sync::oneshot::channel();
    d.submit_resolve_and_update(
        vec![(pkey(0), 0)],
        Some(OffsetAdvance {
            key: pkey(0),
            to: 1,
        }),
        Vec::new(),
        Box::new(move |r| {
            let _ = tx.send(r);
        }),
    );
    assert!(matches!(
        rx.await.expect("told"),
        Err(DeliveryError::Indeterminate(_))
    ));
    power.fail_writes(false);
    assert!(d.health().is_err());
    assert!(matches!(
        d.record_attempt(record(0, 1, 1, 10)).await,
        Err(DeliveryError::Poisoned(_))
    ));
}

#[tokio::test]
async fn given_a_failed_write_then_the_store_is_poisoned_and_health_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let d = &stores.deliveries;
    d.record_attempt(record(0, 0, 1, 10)).await.unwrap();
    assert!(d.health().is_ok());
    power.fail_writes(true);
    // The write itself failed: outcome unknown. Everything after it is refused.
    assert!(matches!(
        d.record_attempt(record(0, 1, 1, 10)).await,
        Err(DeliveryError::Indeterminate(_))
    ));
    power.fail_writes(false);
    let reason = d.health().unwrap_err();
    assert!(reason.contains("injected"), "{reason}");
    assert!(matches!(
        d.update(vec![record(0, 0, 2, 10)]).await,
        Err(DeliveryError::Poisoned(_))
    ));
    assert!(matches!(
        d.record_attempt(record(0, 2, 1, 10)).await,
        Err(DeliveryError::Poisoned(_))
    ));
}

#[tokio::test]
async fn a_flush_interval_outside_its_range_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let engine =
        meshd_local::RocksEngine::open(dir.path(), meshd_stores_local::keys::COLUMN_FAMILIES)
            .unwrap();
    let err =
        meshd_stores_local::LocalStores::open(Arc::new(engine), "i", Duration::from_millis(5))
            .err()
            .unwrap();
    assert!(err.to_string().contains("10-1000"), "{err}");
}

#[tokio::test]
async fn given_the_attempts_of_one_pull_recorded_together_when_power_is_cut_then_all_of_them_survive(
) {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let d = &stores.deliveries;
    d.record_attempt(record(0, 1, 1, 500)).await.unwrap();
    // One pull: offsets 1 (a redelivery: attempt 2, a later deadline), 2 and 3.
    d.record_attempts(vec![
        record(0, 1, 2, 900),
        record(0, 2, 1, 600),
        record(0, 3, 1, 700),
    ])
    .await
    .unwrap();
    // Durable on return: nothing may be pending when the power goes.
    let image = power.cut();
    drop(stores);
    let rebooted = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, rebooted.path());
    let mut all = stores.deliveries.load_all().await.unwrap();
    all.sort_by_key(|r| r.offset);
    assert_eq!(
        all,
        vec![
            record(0, 1, 2, 900),
            record(0, 2, 1, 600),
            record(0, 3, 1, 700)
        ]
    );
}

#[tokio::test]
async fn a_pull_with_one_invalid_record_records_none_of_its_attempts() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, _power) = common::open_with_power_cut(dir.path());
    let d = &stores.deliveries;
    let err = d
        .record_attempts(vec![record(0, 1, 1, 500), record(0, 2, 0, 500)])
        .await
        .unwrap_err();
    assert!(matches!(err, DeliveryError::Invalid(_)), "{err:?}");
    assert!(d.load_all().await.unwrap().is_empty());
}
