//! # The attempt ledger suite, on both Meta backends
//!
//! One async function per case; [`common::backend_cases!`] stamps out
//! `embedded::<case>` (EmbeddedMeta on a temp dir) and `etcd::<case>` (a real etcd
//! process per test). "Restart" and "Meta unavailable" are real: etcd is SIGKILLed
//! (and started again on its data dir), the embedded Meta is closed (and reopened).
//!
//! The stories the cases pin:
//! * what an owner records is what a later owner loads, per partition, and an empty
//!   map removes the key;
//! * after a takeover the old owner's writes are `Fenced` and change nothing: Meta
//!   keeps the new owner's map, so attempt counts continue across takeovers;
//! * the map survives a backend restart;
//! * Meta down is a typed, retryable error with nothing half-written, and a lost
//!   answer is `Indeterminate` (a re-read tells);
//! * deleting a subscription drops exactly its incarnation's ledgers;
//! * a map above the cap is refused by name, and a damaged record is reported.

mod common;

use common::{backend_cases, Fault, Harness};
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{Meta, MetaError, Precondition, RangeOptions};
use meshd_stores::attempts::{
    ledger_key, AttemptError, AttemptLedger, MetaAttemptLedger, MAX_ENTRIES,
};
use meshd_stores::offsets::OffsetKey;
use std::collections::BTreeMap;
use std::time::Duration;

backend_cases!(
    record_then_load_returns_the_map_per_partition,
    a_stale_owner_after_a_takeover_is_fenced_and_changes_nothing,
    the_ledger_survives_a_backend_restart,
    meta_unavailable_is_retryable_and_nothing_is_half_written,
    a_lost_answer_is_indeterminate_and_a_reread_tells,
    drop_subscription_removes_exactly_that_incarnations_ledgers,
    an_oversized_map_is_refused_with_too_large_and_nothing_is_written,
    a_damaged_ledger_is_reported_as_corrupt,
);

// ---------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------

fn ledger(h: &Harness) -> MetaAttemptLedger {
    MetaAttemptLedger::new(h.meta())
}

fn pkey(subscription: &str, incarnation: i64, partition: u32) -> OffsetKey {
    OffsetKey {
        subscription: subscription.into(),
        incarnation,
        topic: "orders".into(),
        partition,
    }
}

/// Takes the ownership of a partition (a takeover when someone holds it), as an
/// instance does on acquisition.
async fn owner(meta: &dyn Meta, instance: &str, partition: u32) -> Ownership {
    let key = keys::key(
        KeyKind::Owners,
        &["partition", "orders", &partition.to_string()],
    );
    let lease = meta.grant(Duration::from_secs(60)).await.expect("grant");
    Ownership::take_over(meta, &key, instance.as_bytes(), Some(lease.id))
        .await
        .expect("owner key")
}

fn map(pairs: &[(u64, u32)]) -> BTreeMap<u64, u32> {
    pairs.iter().copied().collect()
}

/// Every key under `attempts/`, with its value.
async fn all_ledger_keys(meta: &dyn Meta) -> Vec<(String, Vec<u8>)> {
    meta.range(
        &keys::prefix(KeyKind::Attempts, &[]),
        RangeOptions::default(),
    )
    .await
    .expect("range")
    .kvs
    .into_iter()
    .map(|kv| (String::from_utf8_lossy(&kv.key).into_owned(), kv.value))
    .collect()
}

// ---------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------

async fn record_then_load_returns_the_map_per_partition(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let p0 = pkey("billing", 7, 0);
    let p1 = pkey("billing", 7, 1);
    assert!(l.load(&p0).await.expect("load").is_empty(), "absent: empty");

    let first = map(&[(10, 1), (11, 1), (12, 1)]);
    l.record(&p0, &own, &first).await.expect("record");
    assert_eq!(l.load(&p0).await.expect("load"), first);
    assert!(l.load(&p1).await.expect("load").is_empty(), "per partition");

    // The whole map is rewritten: 10 acked, 11 redelivered, 13 handed out.
    let second = map(&[(11, 2), (12, 1), (13, 1)]);
    l.record(&p0, &own, &second).await.expect("record");
    assert_eq!(l.load(&p0).await.expect("load"), second);
    // A fresh store object (another instance) reads the same.
    assert_eq!(
        MetaAttemptLedger::new(h.client().await)
            .load(&p0)
            .await
            .expect("load"),
        second
    );
    // Stored under the catalogued key, in the documented format.
    let keys = all_ledger_keys(meta.as_ref()).await;
    assert_eq!(
        keys,
        vec![(
            "meshd/v1/attempts/billing/7/orders/0".to_string(),
            br#"{"v":1,"attempts":[[11,2],[12,1],[13,1]]}"#.to_vec()
        )]
    );

    // Nothing in flight: the key is gone, not an empty record.
    l.record(&p0, &own, &BTreeMap::new()).await.expect("record");
    assert!(l.load(&p0).await.expect("load").is_empty());
    assert!(all_ledger_keys(meta.as_ref()).await.is_empty());
    // Deleting an absent ledger is fine too.
    l.record(&p0, &own, &BTreeMap::new()).await.expect("record");

    // Attempt 0 is refused and nothing is written.
    let err = l
        .record(&p0, &own, &map(&[(1, 1), (2, 0)]))
        .await
        .expect_err("attempt 0");
    assert!(matches!(err, AttemptError::Invalid(_)), "{err:?}");
    assert!(all_ledger_keys(meta.as_ref()).await.is_empty());
}

async fn a_stale_owner_after_a_takeover_is_fenced_and_changes_nothing(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let k = pkey("billing", 7, 3);
    let old = owner(meta.as_ref(), "a", 3).await;
    l.record(&k, &old, &map(&[(100, 2), (101, 1)]))
        .await
        .expect("old owner records");

    // Instance b takes the partition over, continues the counts and hands 100 out
    // again (attempt 3) and 102 for the first time.
    let new = owner(meta.as_ref(), "b", 3).await;
    assert!(new.epoch() > old.epoch());
    let mut continued = l.load(&k).await.expect("load");
    assert_eq!(continued, map(&[(100, 2), (101, 1)]));
    *continued.get_mut(&100).unwrap() += 1;
    continued.insert(102, 1);
    l.record(&k, &new, &continued).await.expect("new owner");
    let revision_before = meta.get(&ledger_key(&k)).await.expect("get").kv;

    // The old owner, unaware, records its own view, and then "nothing in flight".
    for stale_map in [map(&[(100, 3), (101, 2)]), BTreeMap::new()] {
        let err = l
            .record(&k, &old, &stale_map)
            .await
            .expect_err("a stale owner is fenced");
        assert_eq!(err, AttemptError::Fenced);
        assert_eq!(err.kind(), "fenced");
        assert!(!err.is_retryable());
    }
    // Meta keeps the new owner's map, untouched (same revision).
    assert_eq!(l.load(&k).await.expect("load"), continued);
    assert_eq!(
        meta.get(&ledger_key(&k)).await.expect("get").kv,
        revision_before
    );
    // Another partition's ledger is not the stale owner's to write either.
    let other = pkey("billing", 7, 4);
    assert_eq!(
        l.record(&other, &old, &map(&[(1, 1)])).await,
        Err(AttemptError::Fenced)
    );
    assert!(l.load(&other).await.expect("load").is_empty());
}

async fn the_ledger_survives_a_backend_restart(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let mut want = BTreeMap::new();
    for p in 0..3u32 {
        let m: BTreeMap<u64, u32> = (0..50u64)
            .map(|o| (o * 3 + u64::from(p), 1 + (o % 5) as u32))
            .collect();
        l.record(&pkey("billing", 7, p), &own, &m)
            .await
            .expect("record");
        want.insert(p, m);
    }
    h.restart().await;
    h.wait_ready().await;
    // The same store object (its client survived the restart) and a fresh one.
    let fresh = MetaAttemptLedger::new(h.client().await);
    for (p, m) in &want {
        assert_eq!(&l.load(&pkey("billing", 7, *p)).await.expect("load"), m);
        assert_eq!(&fresh.load(&pkey("billing", 7, *p)).await.expect("load"), m);
    }
    // The owner still holds its epoch (its lease survived) and keeps recording.
    l.record(&pkey("billing", 7, 0), &own, &map(&[(0, 2)]))
        .await
        .expect("record after restart");
    assert_eq!(
        fresh.load(&pkey("billing", 7, 0)).await.expect("load"),
        map(&[(0, 2)])
    );
}

async fn meta_unavailable_is_retryable_and_nothing_is_half_written(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let k = pkey("billing", 7, 0);
    let before = map(&[(5, 1), (6, 2)]);
    l.record(&k, &own, &before).await.expect("record");

    // Meta really down. The first write may race the kill on the open connection:
    // the client cannot tell whether it was sent, so it is `Indeterminate`; it is
    // never `Ok`.
    h.stop();
    let during = map(&[(5, 2), (6, 3), (7, 1)]);
    let first = l
        .record(&k, &own, &during)
        .await
        .expect_err("record as Meta dies");
    assert!(
        matches!(
            first,
            AttemptError::Unavailable(_) | AttemptError::Indeterminate(_)
        ),
        "{first:?}"
    );
    // With the backend known gone, a write is the retryable "not applied", and a
    // read never says "empty" (that would reset every count).
    let err = l
        .record(&k, &own, &during)
        .await
        .expect_err("record while down");
    assert!(
        matches!(err, AttemptError::Unavailable(_)) && err.is_retryable(),
        "{err:?}"
    );
    assert_eq!(err.kind(), "unavailable");
    let err = l.load(&k).await.expect_err("load while down");
    assert!(
        matches!(err, AttemptError::Unavailable(_)) && err.is_retryable(),
        "{err:?}"
    );
    let err = l
        .drop_subscription("billing", 7)
        .await
        .expect_err("drop while down");
    assert!(err.is_retryable(), "{err:?}");
    h.start().await;
    h.wait_ready().await;
    // Nothing of the refused writes reached Meta (it was dead).
    assert_eq!(l.load(&k).await.expect("load"), before);

    // Refused at the transaction by a reachable Meta (no leader): the same class.
    h.proxy
        .inject(Fault::Refuse(MetaError::Unavailable("no leader".into())));
    let err = l.record(&k, &own, &during).await.expect_err("refused");
    assert!(
        matches!(err, AttemptError::Unavailable(_)) && err.is_retryable(),
        "{err:?}"
    );
    assert_eq!(l.load(&k).await.expect("load"), before);

    // The retry on the same store, once Meta answers, applies the whole map.
    l.record(&k, &own, &during).await.expect("retry");
    assert_eq!(l.load(&k).await.expect("load"), during);
}

async fn a_lost_answer_is_indeterminate_and_a_reread_tells(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let k = pkey("billing", 7, 0);
    l.record(&k, &own, &map(&[(1, 1)])).await.expect("record");
    let next = map(&[(1, 2), (2, 1)]);
    h.proxy
        .inject(Fault::ApplyThenFail(MetaError::Indeterminate(
            "timeout after send".into(),
        )));
    let err = l.record(&k, &own, &next).await.expect_err("answer lost");
    assert!(
        matches!(err, AttemptError::Indeterminate(_)) && !err.is_retryable(),
        "{err:?}"
    );
    assert_eq!(err.kind(), "indeterminate");
    // It was applied here: a re-read tells, and repeating the record is harmless.
    assert_eq!(l.load(&k).await.expect("load"), next);
    l.record(&k, &own, &next).await.expect("repeat");
    assert_eq!(l.load(&k).await.expect("load"), next);
}

async fn drop_subscription_removes_exactly_that_incarnations_ledgers(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    // More partitions than one delete transaction takes (64).
    let dropped: Vec<OffsetKey> = (0..150).map(|p| pkey("billing", 1, p)).collect();
    let kept = vec![
        pkey("billing", 12, 0), // another incarnation whose digits extend "1"
        pkey("billing", 2, 0),  // another incarnation
        pkey("billing2", 1, 0), // a subscription whose name extends "billing"
        pkey("audit", 1, 0),    // another subscription
        OffsetKey {
            topic: "payments".into(),
            ..pkey("audit", 1, 1)
        },
    ];
    for (i, k) in dropped.iter().chain(&kept).enumerate() {
        l.record(k, &own, &map(&[(i as u64, 1)]))
            .await
            .expect("record");
    }
    l.drop_subscription("billing", 1).await.expect("drop");
    for k in &dropped {
        assert!(l.load(k).await.expect("load").is_empty(), "{k:?} dropped");
    }
    let offset = dropped.len() as u64;
    for (i, k) in kept.iter().enumerate() {
        assert_eq!(
            l.load(k).await.expect("load"),
            map(&[(offset + i as u64, 1)]),
            "{k:?} kept"
        );
    }
    let mut want: Vec<String> = kept
        .iter()
        .map(|k| String::from_utf8(ledger_key(k)).unwrap())
        .collect();
    want.sort();
    let got: Vec<String> = all_ledger_keys(meta.as_ref())
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(got, want, "exactly the other ledgers are left");
    // Idempotent.
    l.drop_subscription("billing", 1).await.expect("drop again");
    assert_eq!(all_ledger_keys(meta.as_ref()).await.len(), kept.len());
}

async fn an_oversized_map_is_refused_with_too_large_and_nothing_is_written(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let k = pkey("billing", 7, 0);
    // At the cap, with the largest numbers: accepted by both backends (under etcd's
    // request limit).
    let full: BTreeMap<u64, u32> = (0..MAX_ENTRIES as u64)
        .map(|i| (u64::MAX - i, u32::MAX))
        .collect();
    l.record(&k, &own, &full).await.expect("a full ledger");
    assert_eq!(l.load(&k).await.expect("load"), full);

    let mut over = full.clone();
    over.insert(0, 1);
    let err = l.record(&k, &own, &over).await.expect_err("over the cap");
    assert_eq!(
        err,
        AttemptError::TooLarge {
            entries: MAX_ENTRIES + 1,
            max: MAX_ENTRIES
        }
    );
    assert_eq!(err.kind(), "too_large");
    assert!(!err.is_retryable());
    assert_eq!(l.load(&k).await.expect("load"), full, "unchanged");
    assert!(l
        .load(&pkey("billing", 7, 1))
        .await
        .expect("load")
        .is_empty());
}

async fn a_damaged_ledger_is_reported_as_corrupt(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let k = pkey("billing", 7, 0);
    let key = ledger_key(&k);
    for bad in [
        &br#"{"v":1,"attempts":[[2,1],[1,1]]}"#[..],
        br#"{"v":2,"attempts":[[1,1]]}"#,
        br#"{"v":1,"attempts":[[1,1]"#,
        b"garbage",
    ] {
        meta.put(&key, bad, Precondition::None, None)
            .await
            .expect("put");
        match l.load(&k).await {
            Err(AttemptError::Corrupt { key: at, reason }) => {
                assert_eq!(at, "meshd/v1/attempts/billing/7/orders/0");
                assert!(!reason.is_empty());
            }
            other => panic!(
                "{}: expected Corrupt, got {other:?}",
                String::from_utf8_lossy(bad)
            ),
        }
    }
}
