//! The park index: entries durable before `park` returns (a power cut keeps them),
//! read in due order per partition with their bodies, parked at most once per offset,
//! removed durably, and fail-stop with the other Local stores.

mod common;

use meshd_stores::delivery::DeliveryError;
use meshd_stores::offsets::OffsetKey;
use meshd_stores_local::park::{ParkError, ParkIndex, Parked, Removed, HELD};

fn pkey(subscription: &str, p: u32) -> OffsetKey {
    OffsetKey {
        subscription: subscription.into(),
        incarnation: 1,
        topic: "orders".into(),
        partition: p,
    }
}

fn parked(list: &[(u64, u64)]) -> Vec<Parked> {
    list.iter()
        .map(|&(offset, due_ms)| Parked::new(offset, due_ms, 0))
        .collect()
}

#[tokio::test]
async fn parked_events_are_read_in_due_order_per_partition_with_their_bodies_and_parked_once() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let parks = &stores.parks;
    let (a, b) = (pkey("sub", 0), pkey("sub", 1));
    assert!(parks.park(&a, 7, 3000, 0, b"seven".to_vec()).await.unwrap());
    // An event parked after two attempts (a long nack delay) keeps its count.
    assert!(parks.park(&a, 2, 5000, 2, b"two".to_vec()).await.unwrap());
    parks.park(&a, 9, 1000, 0, b"nine".to_vec()).await.unwrap();
    parks
        .park(&b, 7, 10, 0, b"other partition".to_vec())
        .await
        .unwrap();
    parks
        .park(&pkey("sub-2", 0), 1, 10, 0, b"other subscription".to_vec())
        .await
        .unwrap();
    // Parked again (a repeat after a crash): the first entry stands.
    assert!(!parks
        .park(&a, 7, 99_000, 0, b"again".to_vec())
        .await
        .unwrap());
    assert_eq!(parks.count(&a).await.unwrap(), 3);
    assert_eq!(parks.count(&b).await.unwrap(), 1);

    assert_eq!(
        parks.earliest(&a, 10).await.unwrap(),
        [
            parked(&[(9, 1000), (7, 3000)]),
            vec![Parked::new(2, 5000, 2)]
        ]
        .concat()
    );
    assert_eq!(
        parks.body(&a, 2).await.unwrap().as_deref(),
        Some(&b"two"[..])
    );
    assert_eq!(
        parks.parked_among(&a, vec![9, 8, 2, 100]).await.unwrap(),
        [2, 9]
    );
    assert_eq!(
        parks.earliest(&a, 2).await.unwrap(),
        parked(&[(9, 1000), (7, 3000)])
    );
    assert_eq!(parks.earliest(&b, 10).await.unwrap(), parked(&[(7, 10)]));
    assert_eq!(
        parks.body(&a, 7).await.unwrap().as_deref(),
        Some(&b"seven"[..])
    );
    assert_eq!(parks.body(&a, 8).await.unwrap(), None);
    assert_eq!(parks.offsets_from(&a, 3, 10).await.unwrap(), [7, 9]);
    assert_eq!(parks.offsets_from(&a, 0, 10).await.unwrap(), [2, 7, 9]);

    assert!(parks.remove(&a, 7, 0).await.unwrap().removed);
    assert!(!parks.remove(&a, 7, 0).await.unwrap().removed); // gone already: nothing changes
    assert_eq!(
        parks
            .earliest(&a, 10)
            .await
            .unwrap()
            .iter()
            .map(|p| p.offset)
            .collect::<Vec<_>>(),
        [9, 2]
    );
    assert_eq!(parks.count(&a).await.unwrap(), 2);
    assert_eq!(parks.body(&a, 7).await.unwrap(), None);
    assert_eq!(parks.earliest(&b, 10).await.unwrap(), parked(&[(7, 10)]));

    // A deleted subscription incarnation takes its entries along, and only its own.
    parks.drop_subscription("sub", 1).await.unwrap();
    assert!(parks.earliest(&a, 10).await.unwrap().is_empty());
    assert!(parks.offsets_from(&b, 0, 10).await.unwrap().is_empty());
    assert_eq!(
        parks.earliest(&pkey("sub-2", 0), 10).await.unwrap(),
        parked(&[(1, 10)])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_parked_events_when_power_is_cut_then_every_park_that_returned_survives_and_removals_too(
) {
    let key = pkey("sub", 0);
    let want = |offsets: std::ops::Range<u64>| -> Vec<Parked> {
        offsets
            .map(|offset| Parked::new(offset, 1000 + offset, 0))
            .collect()
    };
    // Parks, then the cut: nothing after them made them durable but themselves.
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    for offset in 0..20u64 {
        stores
            .parks
            .park(
                &key,
                offset,
                1000 + offset,
                0,
                format!("body {offset}").into_bytes(),
            )
            .await
            .unwrap();
    }
    let image = power.cut();
    drop(stores);
    let rebooted = tempfile::tempdir().unwrap();
    let (stores, power) = {
        let fresh = meshd_local::RocksEngine::open(
            rebooted.path(),
            meshd_stores_local::keys::COLUMN_FAMILIES,
        )
        .unwrap();
        image.restore_into(&fresh).unwrap();
        drop(fresh);
        common::open_with_power_cut(rebooted.path())
    };
    assert_eq!(stores.parks.earliest(&key, 100).await.unwrap(), want(0..20));
    for offset in 0..20u64 {
        assert_eq!(
            stores.parks.body(&key, offset).await.unwrap(),
            Some(format!("body {offset}").into_bytes())
        );
    }
    // Removals, then the cut: they are gone after it too.
    for offset in 0..5u64 {
        stores.parks.remove(&key, offset, 0).await.unwrap();
    }
    let image = power.cut();
    drop(stores);
    let again = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, again.path());
    assert_eq!(stores.parks.earliest(&key, 100).await.unwrap(), want(5..20));
    assert_eq!(
        stores.parks.offsets_from(&key, 0, 100).await.unwrap(),
        (5..20).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn given_a_failed_write_then_parking_is_refused_like_every_local_write() {
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let key = pkey("sub", 0);
    stores
        .parks
        .park(&key, 0, 1, 0, b"x".to_vec())
        .await
        .unwrap();
    power.fail_writes(true);
    assert!(matches!(
        stores.parks.park(&key, 1, 1, 0, b"y".to_vec()).await,
        Err(ParkError::Local(DeliveryError::Indeterminate(_)))
    ));
    power.fail_writes(false);
    assert!(matches!(
        stores.parks.remove(&key, 0, 0).await,
        Err(ParkError::Local(DeliveryError::Poisoned(_)))
    ));
    let bad = OffsetKey {
        topic: String::new(),
        ..key
    };
    assert!(matches!(
        stores.parks.park(&bad, 0, 1, 0, Vec::new()).await,
        Err(ParkError::Local(DeliveryError::Invalid(_)))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counting_a_partition_goes_past_one_read_page() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let (a, b) = (pkey("sub", 0), pkey("sub", 1));
    // More entries than one counting read takes (4096), parked concurrently so their
    // fsyncs are shared.
    let n = 5000u64;
    let parks = (0..n).map(|o| {
        let parks = stores.parks.clone();
        let a = a.clone();
        tokio::spawn(async move { parks.park(&a, o, 1000 + o % 7, 0, vec![1]).await })
    });
    for p in parks {
        assert!(p.await.unwrap().unwrap());
    }
    stores.parks.park(&b, 0, 1, 0, vec![1]).await.unwrap();
    assert_eq!(stores.parks.count(&a).await.unwrap(), n);
    assert_eq!(stores.parks.count(&b).await.unwrap(), 1);
    assert_eq!(stores.parks.count(&pkey("sub", 2)).await.unwrap(), 0);
}

#[tokio::test]
async fn park_many_writes_a_batch_at_once_and_answers_which_entries_are_new() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let parks = &stores.parks;
    let a = pkey("sub", 0);
    assert!(parks.park(&a, 5, 50, 0, b"five".to_vec()).await.unwrap());
    let e = |offset: u64, due_ms: u64| Parked::new(offset, due_ms, 0);
    let created = parks
        .park_many(
            &a,
            vec![
                (e(4, 40), b"four".to_vec()),
                (e(5, 99), b"again".to_vec()), // parked before: unchanged
                (e(6, 60), b"six".to_vec()),
                (e(6, 61), b"twice".to_vec()), // twice in one batch: the first stands
            ],
        )
        .await
        .unwrap();
    assert_eq!(created, [true, false, true, false]);
    assert_eq!(
        parks.earliest(&a, 10).await.unwrap(),
        parked(&[(4, 40), (5, 50), (6, 60)])
    );
    assert_eq!(
        parks.body(&a, 6).await.unwrap().as_deref(),
        Some(&b"six"[..])
    );
    assert_eq!(parks.count(&a).await.unwrap(), 3);
}

/// An entry of ordering key `key`: held behind it (`HELD`), or due at `due_ms`.
fn keyed(offset: u64, due_ms: u64, key: u64, not_before_ms: u64) -> Parked {
    Parked {
        key: Some(key),
        not_before_ms,
        ..Parked::new(offset, due_ms, 0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_events_held_behind_their_key_then_the_first_one_s_removal_releases_the_next_in_the_same_durable_write(
) {
    let key = pkey("sub", 0);
    let dir = tempfile::tempdir().unwrap();
    let (stores, power) = common::open_with_power_cut(dir.path());
    let parks = &stores.parks;
    let redriven = Parked {
        seq: 20,
        redrive: true,
        ..keyed(1, HELD, 7, 0)
    };
    // Key 7: offset 3 parked for its time (it holds the key), 5 and 9 held behind it
    // (9 with its own deliverat); key 8: offset 4 held behind an event of the window.
    parks
        .park_many(
            &key,
            vec![
                (keyed(3, 2000, 7, 0), b"three".to_vec()),
                (keyed(5, HELD, 7, 0), b"five".to_vec()),
                (keyed(9, HELD, 7, 50_000), b"nine".to_vec()),
                (keyed(4, HELD, 8, 0), b"four".to_vec()),
                (Parked::new(6, 3000, 0), b"six".to_vec()),
                // A redriven dead letter of offset 1 at the back of key 7's line.
                (redriven.clone(), b"one".to_vec()),
            ],
        )
        .await
        .unwrap();
    assert_eq!(
        parks.keys_parked(&key, vec![7, 8, 10]).await.unwrap(),
        [7, 8].into()
    );
    assert_eq!(parks.held_keys(&key).await.unwrap(), [8]);
    // Held entries are never due: they sort after every time.
    assert_eq!(
        parks.earliest(&key, 2).await.unwrap(),
        [keyed(3, 2000, 7, 0), Parked::new(6, 3000, 0)]
    );
    // The key's head is not held: a release changes nothing.
    assert_eq!(parks.release_key(&key, 7, 10_000).await.unwrap(), None);
    // Key 8's first entry is held (its event ahead is in the window): released.
    assert_eq!(
        parks.release_key(&key, 8, 10_000).await.unwrap(),
        Some(keyed(4, 10_000, 8, 0))
    );
    // Settling the head releases the next of its key, durably, in the same write.
    let removed = parks.remove(&key, 3, 20_000).await.unwrap();
    assert_eq!(
        removed,
        Removed {
            removed: true,
            released: Some(keyed(5, 20_000, 7, 0)),
        }
    );
    let image = power.cut();
    drop(stores);
    let again = tempfile::tempdir().unwrap();
    let stores = common::reboot_from(&image, again.path());
    let parks = &stores.parks;
    assert_eq!(
        parks.earliest(&key, 10).await.unwrap(),
        [
            Parked::new(6, 3000, 0),
            keyed(4, 10_000, 8, 0),
            keyed(5, 20_000, 7, 0),
            // Held ones last, by offset (their key's line is kept apart).
            redriven.clone(),
            keyed(9, HELD, 7, 50_000),
        ]
    );
    assert_eq!(parks.entry(&key, 1).await.unwrap(), Some(redriven.clone()));
    assert_eq!(parks.body(&key, 5).await.unwrap(), Some(b"five".to_vec()));
    assert!(parks.held_keys(&key).await.unwrap().is_empty());
    // A released entry keeps its own deliverat: due at the later of it and the release.
    let removed = parks.remove(&key, 5, 30_000).await.unwrap();
    assert_eq!(removed.released, Some(keyed(9, 50_000, 7, 50_000)));
    assert_eq!(parks.body(&key, 9).await.unwrap(), Some(b"nine".to_vec()));
    // The redriven one waits behind 9 though its offset is lower: its place decides.
    let removed = parks.remove(&key, 9, 60_000).await.unwrap();
    assert_eq!(removed.released, Some(redriven.released(60_000)));
    assert_eq!(parks.body(&key, 1).await.unwrap(), Some(b"one".to_vec()));
    // The subscription's deletion takes the key markers too.
    parks.drop_subscription("sub", 1).await.unwrap();
    assert!(parks
        .keys_parked(&key, vec![7, 8])
        .await
        .unwrap()
        .is_empty());
    assert_eq!(parks.count(&key).await.unwrap(), 0);
}

#[tokio::test]
async fn a_reparked_entry_takes_its_new_time_and_count_and_keeps_its_body_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let parks = &stores.parks;
    let key = pkey("sub", 0);
    parks
        .park_many(
            &key,
            vec![
                (Parked::new(3, 1000, 0), b"three".to_vec()),
                (keyed(4, 1500, 7, 0), b"four".to_vec()),
            ],
        )
        .await
        .unwrap();
    assert!(parks.repark(&key, 3, 9000, 2).await.unwrap());
    assert!(parks.repark(&key, 4, 8000, 1).await.unwrap());
    assert!(
        !parks.repark(&key, 5, 8000, 1).await.unwrap(),
        "never parked"
    );
    assert_eq!(
        parks.earliest(&key, 10).await.unwrap(),
        [
            Parked {
                attempt: 1,
                ..keyed(4, 8000, 7, 0)
            },
            Parked::new(3, 9000, 2)
        ]
    );
    assert_eq!(parks.body(&key, 3).await.unwrap(), Some(b"three".to_vec()));
    assert_eq!(parks.count(&key).await.unwrap(), 2);
    // Still the first of its key: its removal is what releases the key.
    assert_eq!(parks.keys_parked(&key, vec![7]).await.unwrap(), [7].into());
}
