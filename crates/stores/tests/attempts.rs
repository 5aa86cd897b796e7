//! # The attempt ledger suite, on both Meta backends
//!
//! One async function per case; [`common::backend_cases!`] stamps out
//! `embedded::<case>` (EmbeddedMeta on a temp dir) and `etcd::<case>` (a real etcd
//! process per test). "Restart" and "Meta unavailable" are real: etcd is SIGKILLed
//! (and started again on its data dir), the embedded Meta is closed (and reopened).
//!
//! The stories the cases pin:
//! * what an owner records (offset, attempt, lease deadline, session) is what a
//!   later owner loads, per partition; acked entries leave, and records holding
//!   nothing current are pruned by later writes;
//! * every write is one small record, whatever is in flight: Meta's bytes per pull
//!   batch follow the batch (a whole map rewritten per batch once filled etcd);
//! * after a takeover the old owner's writes are `Fenced` and change nothing;
//! * the ledger survives a backend restart;
//! * Meta down is a typed, retryable error with nothing half-written, and a lost
//!   answer is `Indeterminate` (a re-read tells);
//! * deleting a subscription drops exactly its incarnation's ledgers; a reset
//!   clears one partition's;
//! * a record above the cap is refused by name, a damaged record is reported, a
//!   version-1 map is rewritten as version 2, and version 2 is what a version-1
//!   reader refuses by name.

mod common;

use common::{backend_cases, Fault, Harness};
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{Meta, MetaError, Precondition, RangeOptions};
use meshd_stores::attempts::{
    decode_v1, encode_v1, ledger_key, record_key, AttemptError, AttemptLedger, LedgerEntry,
    LedgerState, MetaAttemptLedger, MAX_LOADED_ENTRIES, MAX_RECORD_ENTRIES, RECORD_FRESH_ENTRIES,
};
use meshd_stores::delivery::SessionBinding;
use meshd_stores::failure::StoreFailure;
use meshd_stores::offsets::OffsetKey;
use std::collections::BTreeMap;
use std::time::Duration;

backend_cases!(
    record_then_load_returns_the_current_entries_per_partition,
    each_write_is_one_record_of_the_batch_whatever_is_in_flight,
    stragglers_do_not_pin_their_records_and_a_new_owner_can_always_load_the_ledger,
    a_stale_owner_after_a_takeover_is_fenced_and_changes_nothing,
    the_ledger_survives_a_backend_restart,
    meta_unavailable_is_retryable_and_nothing_is_half_written,
    a_lost_answer_is_indeterminate_and_a_reread_tells,
    drop_subscription_removes_exactly_that_incarnations_ledgers,
    clear_removes_one_partitions_ledger_fenced,
    an_oversized_record_is_refused_with_too_large_and_nothing_is_written,
    a_damaged_ledger_is_reported_as_corrupt,
    a_version_1_map_is_rewritten_as_version_2_which_a_version_1_reader_refuses,
);

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

/// An entry: attempt, deadline `1000 * offset + attempt`, no session.
fn e(offset: u64, attempt: u32) -> LedgerEntry {
    LedgerEntry {
        offset,
        attempt,
        deadline_ms: 1000 * offset + u64::from(attempt),
        session: None,
    }
}

/// The owner's side as the runtime drives it: its state, staged writes applied
/// only when Meta took them.
struct Writer<'a> {
    l: &'a MetaAttemptLedger,
    key: OffsetKey,
    own: Ownership,
    state: LedgerState,
}

impl<'a> Writer<'a> {
    /// Acquires: loads what Meta holds (above `committed`).
    async fn acquire(l: &'a MetaAttemptLedger, key: OffsetKey, own: Ownership) -> Self {
        let loaded = l.load(&key).await.expect("load");
        let (state, migrate) = LedgerState::acquired(loaded, 0, 0);
        assert!(migrate.is_none());
        Self { l, key, own, state }
    }

    async fn record(&mut self, entries: Vec<LedgerEntry>) -> Result<(), AttemptError> {
        let Some(w) = self.state.stage(entries) else {
            return Ok(());
        };
        self.l.write(&self.key, &self.own, &w).await?;
        self.state.applied(w);
        Ok(())
    }
}

/// offset → entry, as a new owner would inherit it.
async fn current(l: &MetaAttemptLedger, k: &OffsetKey) -> BTreeMap<u64, LedgerEntry> {
    let (state, _) = LedgerState::acquired(l.load(k).await.expect("load"), 0, 0);
    state.entries().map(|e| (e.offset, e.clone())).collect()
}

fn by_offset(entries: &[LedgerEntry]) -> BTreeMap<u64, LedgerEntry> {
    entries.iter().map(|e| (e.offset, e.clone())).collect()
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

async fn record_then_load_returns_the_current_entries_per_partition(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let p0 = pkey("billing", 7, 0);
    let p1 = pkey("billing", 7, 1);
    assert_eq!(l.load(&p0).await.expect("load").head, None, "absent: empty");
    let mut w = Writer::acquire(&l, p0.clone(), own.clone()).await;

    let bound = LedgerEntry {
        session: Some(SessionBinding {
            session_id: "worker-1".into(),
            epoch: 4,
        }),
        ..e(12, 1)
    };
    w.record(vec![e(10, 1), e(11, 1), bound.clone()])
        .await
        .expect("record");
    assert_eq!(
        current(&l, &p0).await,
        by_offset(&[e(10, 1), e(11, 1), bound.clone()])
    );
    assert!(current(&l, &p1).await.is_empty(), "per partition");
    // Stored under the catalogued keys, in the documented format.
    assert_eq!(
        all_ledger_keys(meta.as_ref()).await,
        vec![
            (
                "meshd/v1/attempts/billing/7/orders/0".to_string(),
                br#"{"v":2,"layout":"records"}"#.to_vec()
            ),
            (
                "meshd/v1/attempts/billing/7/orders/0/r/00000000000000000000".to_string(),
                br#"{"v":2,"d":[[10,1,10001],[11,1,11001],[12,1,12001,"worker-1",4]]}"#.to_vec()
            ),
        ]
    );

    // 10 acked, 11 handed out again, 13 handed out: the later record wins for 11.
    w.state.forget([10]);
    w.record(vec![e(11, 2), e(13, 1)]).await.expect("record");
    // Record 0 still holds 12, so 10 is still in Meta: a new owner now would
    // deliver it again once its lease ends (at least once); it leaves with record 0.
    let want = by_offset(&[e(10, 1), e(11, 2), bound.clone(), e(13, 1)]);
    assert_eq!(current(&l, &p0).await, want);
    // A fresh store object (another instance) reads the same.
    assert_eq!(
        current(&MetaAttemptLedger::new(h.client().await), &p0).await,
        want
    );
    // An extend is a record too: 12's lease is longer now.
    let extended = LedgerEntry {
        deadline_ms: 99_999,
        ..bound
    };
    w.record(vec![extended.clone()]).await.expect("extend");
    // Record 0 now holds nothing current (10 acked, 11 and 12 superseded): the
    // extend's write pruned it.
    let keys: Vec<String> = all_ledger_keys(meta.as_ref())
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert!(
        !keys.contains(&String::from_utf8(record_key(&p0, 0)).unwrap()),
        "{keys:?}"
    );
    assert_eq!(
        current(&l, &p0).await,
        by_offset(&[e(11, 2), extended, e(13, 1)])
    );

    // Everything acked, then a checkpoint's prune: only the head is left.
    w.state.forget([11, 12, 13]);
    w.record(vec![]).await.expect("prune");
    assert_eq!(w.state.records(), 0);
    assert_eq!(all_ledger_keys(meta.as_ref()).await.len(), 1, "the head");
    assert!(current(&l, &p0).await.is_empty());

    // Attempt 0 is refused and nothing is written.
    let err = w
        .record(vec![e(1, 1), e(2, 0)])
        .await
        .expect_err("attempt 0");
    assert!(matches!(err, AttemptError::Invalid(_)), "{err:?}");
    assert_eq!(all_ledger_keys(meta.as_ref()).await.len(), 1);
}

async fn each_write_is_one_record_of_the_batch_whatever_is_in_flight(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let k = pkey("billing", 7, 0);
    let mut w = Writer::acquire(&l, k.clone(), own).await;
    // 500 deliveries held in flight (a consumer that holds many, the pattern that once filled etcd).
    for batch in 0..50u64 {
        w.record((0..10).map(|i| e(batch * 10 + i, 1)).collect())
            .await
            .expect("record");
    }
    // Then pull one, ack one, 300 times: each write puts one record of one entry,
    // and prunes the previous one (acked), so the ledger's keys stay put.
    let keys_before = all_ledger_keys(meta.as_ref()).await.len();
    for o in 500..800u64 {
        w.record(vec![e(o, 1)]).await.expect("record");
        w.state.forget([o]);
    }
    let all = all_ledger_keys(meta.as_ref()).await;
    assert!(
        all.len() <= keys_before + 1,
        "{} keys after 300 pull-ack cycles, {keys_before} before",
        all.len()
    );
    // Every record but the held ones' is small: the batch, not the 500 in flight.
    for (key, value) in &all {
        assert!(value.len() < 200, "{key}: {} bytes", value.len());
    }
    // The last acked one's record goes with the next write (here a prune).
    assert_eq!(current(&l, &k).await.len(), 501);
    w.record(vec![]).await.expect("prune");
    assert_eq!(current(&l, &k).await.len(), 500);
    assert_eq!(all_ledger_keys(meta.as_ref()).await.len(), 51, "head + 50");
}

/// Entries in Meta under the partition's records (current or not): what a new owner
/// reads.
async fn stored_entries(meta: &dyn Meta, k: &OffsetKey) -> usize {
    let prefix = record_key(k, 0);
    let prefix = &prefix[..prefix.len() - 20];
    all_ledger_keys(meta)
        .await
        .iter()
        .filter(|(key, _)| key.as_bytes().starts_with(prefix))
        .map(|(_, value)| {
            meshd_stores::attempts::decode_record(value)
                .expect("a record")
                .len()
        })
        .sum()
}

async fn stragglers_do_not_pin_their_records_and_a_new_owner_can_always_load_the_ledger(
    h: &mut Harness,
) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let k = pkey("billing", 7, 0);
    let mut w = Writer::acquire(&l, k.clone(), own).await;
    // Full pulls, each acked (and checkpointed) but one delivery: a nack with a long
    // delay, a consumer holding one. Without compaction every record stays in Meta
    // for its straggler: 60 x 750 entries, past what a new owner may read.
    let pulls = 60u64;
    let size = RECORD_FRESH_ENTRIES as u64;
    assert!(pulls * size > MAX_LOADED_ENTRIES as u64);
    let mut stragglers = BTreeMap::new();
    for p in 0..pulls {
        let batch: Vec<LedgerEntry> = (p * size..(p + 1) * size).map(|o| e(o, 1)).collect();
        w.record(batch).await.expect("record");
        let kept = p * size + p % size;
        stragglers.insert(kept, e(kept, 1));
        w.state
            .forget((p * size..(p + 1) * size).filter(|o| *o != kept));
        assert!(
            w.state.stored() <= 2 * w.state.len() + MAX_RECORD_ENTRIES,
            "pull {p}: {} entries stored for {} current",
            w.state.stored(),
            w.state.len()
        );
    }
    // What the owner believes is what Meta holds.
    assert_eq!(stored_entries(meta.as_ref(), &k).await, w.state.stored());
    // A new owner reads it and inherits every straggler, unchanged; besides them only
    // the acked entries of the last pull's record, which its straggler still holds
    // (a new owner drops those below its checkpoint, as after any crash).
    let inherited = current(&l, &k).await;
    for (o, e) in &stragglers {
        assert_eq!(inherited.get(o), Some(e), "straggler {o}");
    }
    let last = (pulls - 1) * size..pulls * size;
    let extra: Vec<u64> = inherited
        .keys()
        .filter(|o| !stragglers.contains_key(o) && !last.contains(o))
        .copied()
        .collect();
    assert!(
        extra.is_empty(),
        "inherited beyond the stragglers and the last pull: {extra:?}"
    );
    // Once the stragglers resolve, the next write leaves nothing behind.
    w.state.forget(stragglers.keys().copied());
    for _ in 0..4 {
        w.record(vec![]).await.expect("prune");
    }
    assert!(current(&l, &k).await.is_empty());
    assert_eq!(stored_entries(meta.as_ref(), &k).await, 0);
}

async fn a_stale_owner_after_a_takeover_is_fenced_and_changes_nothing(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let k = pkey("billing", 7, 3);
    let old = owner(meta.as_ref(), "a", 3).await;
    let mut a = Writer::acquire(&l, k.clone(), old).await;
    a.record(vec![e(100, 2), e(101, 1)])
        .await
        .expect("old owner records");

    // Instance b takes the partition over, inherits both, hands 100 out again
    // (attempt 3) and 102 for the first time.
    let new = owner(meta.as_ref(), "b", 3).await;
    assert!(new.epoch() > a.own.epoch());
    let mut b = Writer::acquire(&l, k.clone(), new).await;
    assert_eq!(current(&l, &k).await, by_offset(&[e(100, 2), e(101, 1)]));
    b.record(vec![e(100, 3), e(102, 1)])
        .await
        .expect("new owner");
    let before = all_ledger_keys(meta.as_ref()).await;

    // The old owner, unaware, records its own next attempts, and prunes.
    let err = a
        .record(vec![e(100, 3), e(101, 2)])
        .await
        .expect_err("a stale owner is fenced");
    assert_eq!(err, AttemptError::Fenced);
    assert_eq!(err.kind(), "fenced");
    assert!(!err.is_retryable());
    a.state.forget([100, 101]);
    assert_eq!(a.record(vec![]).await, Err(AttemptError::Fenced));
    assert_eq!(
        l.clear(&k, &a.own).await,
        Err(AttemptError::Fenced),
        "nor may it clear"
    );
    // Meta keeps the new owner's ledger, untouched.
    assert_eq!(all_ledger_keys(meta.as_ref()).await, before);
    assert_eq!(
        current(&l, &k).await,
        by_offset(&[e(100, 3), e(101, 1), e(102, 1)])
    );
    // Another partition's ledger is not the stale owner's to write either.
    let mut other = Writer::acquire(&l, pkey("billing", 7, 4), a.own.clone()).await;
    assert_eq!(other.record(vec![e(1, 1)]).await, Err(AttemptError::Fenced));
    assert!(current(&l, &pkey("billing", 7, 4)).await.is_empty());
}

async fn the_ledger_survives_a_backend_restart(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let mut want = BTreeMap::new();
    for p in 0..3u32 {
        let mut w = Writer::acquire(&l, pkey("billing", 7, p), own.clone()).await;
        let entries: Vec<LedgerEntry> = (0..50u64)
            .map(|o| e(o * 3 + u64::from(p), 1 + (o % 5) as u32))
            .collect();
        for chunk in entries.chunks(7) {
            w.record(chunk.to_vec()).await.expect("record");
        }
        want.insert(p, by_offset(&entries));
    }
    h.restart().await;
    h.wait_ready().await;
    // The same store object (its client survived the restart) and a fresh one.
    let fresh = MetaAttemptLedger::new(h.client().await);
    for (p, m) in &want {
        assert_eq!(&current(&l, &pkey("billing", 7, *p)).await, m);
        assert_eq!(&current(&fresh, &pkey("billing", 7, *p)).await, m);
    }
    // The owner still holds its epoch (its lease survived) and keeps recording.
    let mut w = Writer::acquire(&l, pkey("billing", 7, 0), own).await;
    w.record(vec![e(0, 2)]).await.expect("record after restart");
    assert_eq!(
        current(&fresh, &pkey("billing", 7, 0)).await.get(&0),
        Some(&e(0, 2))
    );
}

async fn meta_unavailable_is_retryable_and_nothing_is_half_written(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let k = pkey("billing", 7, 0);
    let mut w = Writer::acquire(&l, k.clone(), own).await;
    w.record(vec![e(5, 1), e(6, 2)]).await.expect("record");
    let before = current(&l, &k).await;

    // Meta really down. The first write may race the kill on the open connection:
    // the client cannot tell whether it was sent, so it is `Indeterminate`; it is
    // never `Ok`.
    h.stop();
    let during = vec![e(5, 2), e(6, 3), e(7, 1)];
    let first = w
        .record(during.clone())
        .await
        .expect_err("record as Meta dies");
    assert!(
        matches!(
            first,
            AttemptError::Store(StoreFailure::Unavailable(_))
                | AttemptError::Store(StoreFailure::Indeterminate(_))
        ),
        "{first:?}"
    );
    // With the backend known gone, a write is the retryable "not applied", and a
    // read never says "empty" (that would reset every count).
    let err = w
        .record(during.clone())
        .await
        .expect_err("record while down");
    assert!(
        matches!(err, AttemptError::Store(StoreFailure::Unavailable(_))) && err.is_retryable(),
        "{err:?}"
    );
    assert_eq!(err.kind(), "unavailable");
    let err = l.load(&k).await.expect_err("load while down");
    assert!(
        matches!(err, AttemptError::Store(StoreFailure::Unavailable(_))) && err.is_retryable(),
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
    assert_eq!(current(&l, &k).await, before);

    // Refused at the transaction by a reachable Meta (no leader): the same class.
    h.proxy
        .inject(Fault::Refuse(MetaError::Unavailable("no leader".into())));
    let err = w.record(during.clone()).await.expect_err("refused");
    assert!(
        matches!(err, AttemptError::Store(StoreFailure::Unavailable(_))) && err.is_retryable(),
        "{err:?}"
    );
    assert_eq!(current(&l, &k).await, before);

    // The retry on the same store, once Meta answers, applies the whole record.
    w.record(during.clone()).await.expect("retry");
    assert_eq!(current(&l, &k).await, by_offset(&during));
}

async fn a_lost_answer_is_indeterminate_and_a_reread_tells(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let k = pkey("billing", 7, 0);
    let mut w = Writer::acquire(&l, k.clone(), own.clone()).await;
    w.record(vec![e(1, 1)]).await.expect("record");
    h.proxy
        .inject(Fault::ApplyThenFail(MetaError::Indeterminate(
            "timeout after send".into(),
        )));
    let next = vec![e(1, 2), e(2, 1)];
    let err = w.record(next.clone()).await.expect_err("answer lost");
    assert!(
        matches!(err, AttemptError::Store(StoreFailure::Indeterminate(_))) && !err.is_retryable(),
        "{err:?}"
    );
    assert_eq!(err.kind(), "indeterminate");
    // It was applied here: a re-read (the re-acquisition an owner makes) tells.
    assert_eq!(current(&l, &k).await, by_offset(&next));
    let mut again = Writer::acquire(&l, k.clone(), own).await;
    again.record(vec![e(3, 1)]).await.expect("continues");
    assert_eq!(
        current(&l, &k).await,
        by_offset(&[e(1, 2), e(2, 1), e(3, 1)])
    );
}

async fn drop_subscription_removes_exactly_that_incarnations_ledgers(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    // More keys than one delete transaction takes (64).
    let dropped: Vec<OffsetKey> = (0..50).map(|p| pkey("billing", 1, p)).collect();
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
        let mut w = Writer::acquire(&l, k.clone(), own.clone()).await;
        w.record(vec![e(i as u64, 1)]).await.expect("record");
    }
    l.drop_subscription("billing", 1).await.expect("drop");
    for k in &dropped {
        assert!(current(&l, k).await.is_empty(), "{k:?} dropped");
        assert_eq!(l.load(k).await.expect("load").head, None);
    }
    let offset = dropped.len() as u64;
    for (i, k) in kept.iter().enumerate() {
        assert_eq!(
            current(&l, k).await,
            by_offset(&[e(offset + i as u64, 1)]),
            "{k:?} kept"
        );
    }
    let mut want: Vec<String> = kept
        .iter()
        .flat_map(|k| [ledger_key(k), record_key(k, 0)])
        .map(|k| String::from_utf8(k).unwrap())
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
    assert_eq!(all_ledger_keys(meta.as_ref()).await.len(), want.len());
}

async fn clear_removes_one_partitions_ledger_fenced(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    // Partition 1's keys do not start with partition 10's prefix, nor the reverse.
    let k = pkey("billing", 7, 1);
    let neighbour = pkey("billing", 7, 10);
    let mut w = Writer::acquire(&l, k.clone(), own.clone()).await;
    // More records than one delete transaction takes (64).
    for o in 0..100u64 {
        w.record(vec![e(o, 1)]).await.expect("record");
    }
    let mut n = Writer::acquire(&l, neighbour.clone(), own.clone()).await;
    n.record(vec![e(1, 1)]).await.expect("record");
    l.clear(&k, &own).await.expect("clear");
    assert!(current(&l, &k).await.is_empty());
    assert_eq!(l.load(&k).await.expect("load").head, None);
    assert_eq!(current(&l, &neighbour).await, by_offset(&[e(1, 1)]));
}

async fn an_oversized_record_is_refused_with_too_large_and_nothing_is_written(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let k = pkey("billing", 7, 0);
    let mut w = Writer::acquire(&l, k.clone(), own).await;
    // At the cap, with the largest numbers and long session ids: accepted by both
    // backends (under etcd's request limit).
    let full: Vec<LedgerEntry> = (0..MAX_RECORD_ENTRIES as u64)
        .map(|i| LedgerEntry {
            offset: u64::MAX - i,
            attempt: u32::MAX,
            deadline_ms: u64::MAX,
            session: Some(SessionBinding {
                session_id: "s".repeat(256),
                epoch: i64::MAX,
            }),
        })
        .collect();
    w.record(full.clone()).await.expect("a full record");
    assert_eq!(current(&l, &k).await, by_offset(&full));

    let over: Vec<LedgerEntry> = (0..=MAX_RECORD_ENTRIES as u64).map(|o| e(o, 1)).collect();
    let err = w.record(over).await.expect_err("over the cap");
    assert_eq!(
        err,
        AttemptError::TooLarge {
            entries: MAX_RECORD_ENTRIES + 1,
            max: MAX_RECORD_ENTRIES
        }
    );
    assert_eq!(err.kind(), "too_large");
    assert!(!err.is_retryable());
    assert_eq!(current(&l, &k).await, by_offset(&full), "unchanged");
}

async fn a_damaged_ledger_is_reported_as_corrupt(h: &mut Harness) {
    let meta = h.meta();
    let l = ledger(h);
    let k = pkey("billing", 7, 0);
    let head = ledger_key(&k);
    let record = record_key(&k, 3);
    let cases: &[(&[u8], &[u8], &str)] = &[
        (&head, br#"{"v":1,"attempts":[[2,1],[1,1]]}"#, "head"),
        (&head, br#"{"v":3,"layout":"records"}"#, "head"),
        (&head, br#"{"v":2,"layout":"maps"}"#, "head"),
        (&head, b"garbage", "head"),
        (&record, br#"{"v":2,"d":[[2,1,0],[1,1,0]]}"#, "record"),
        (&record, br#"{"v":2,"d":[[1,0,0]]}"#, "record"),
        (&record, br#"{"v":2,"d":[]}"#, "record"),
        (&record, br#"{"v":1,"attempts":[[1,1]]}"#, "record"),
        (&record, br#"{"v":2,"d":[[1,1,0]]"#, "record"),
    ];
    for (key, bad, which) in cases {
        // A record is only read under a version-2 head.
        let head_value: &[u8] = if *which == "record" {
            br#"{"v":2,"layout":"records"}"#
        } else {
            bad
        };
        meta.put(&head, head_value, Precondition::None, None)
            .await
            .expect("put");
        meta.put(key, bad, Precondition::None, None)
            .await
            .expect("put");
        match l.load(&k).await {
            Err(AttemptError::Store(StoreFailure::Corrupt { key: at, reason })) => {
                assert_eq!(at.as_bytes(), *key, "{reason}");
                assert!(!reason.is_empty());
            }
            other => panic!(
                "{}: expected Corrupt, got {other:?}",
                String::from_utf8_lossy(bad)
            ),
        }
        meta.delete(&record, Precondition::None)
            .await
            .expect("delete");
    }
    // Records without a version-2 head are not guessed at either.
    meta.delete(&head, Precondition::None)
        .await
        .expect("delete");
    meta.put(
        &record,
        br#"{"v":2,"d":[[1,1,0]]}"#,
        Precondition::None,
        None,
    )
    .await
    .expect("put");
    assert!(
        matches!(
            l.load(&k).await,
            Err(AttemptError::Store(StoreFailure::Corrupt { .. }))
        ),
        "records without a head"
    );
}

async fn a_version_1_map_is_rewritten_as_version_2_which_a_version_1_reader_refuses(
    h: &mut Harness,
) {
    let meta = h.meta();
    let l = ledger(h);
    let own = owner(meta.as_ref(), "a", 0).await;
    let k = pkey("billing", 7, 0);
    let v1: BTreeMap<u64, u32> = [(4, 1), (9, 3), (12, 2)].into_iter().collect();
    meta.put(
        &ledger_key(&k),
        &encode_v1(&v1).unwrap(),
        Precondition::None,
        None,
    )
    .await
    .expect("put");
    // Acquired at committed 5: the map above it is rewritten, due at once (version
    // 1 kept no deadline).
    let loaded = l.load(&k).await.expect("load");
    assert_eq!(loaded.head, Some(1));
    let (mut state, migrate) = LedgerState::acquired(loaded, 5, 777);
    let w = migrate.expect("a version-1 map is rewritten");
    l.write(&k, &own, &w).await.expect("write");
    state.applied(w);
    let want = vec![
        LedgerEntry {
            offset: 9,
            attempt: 3,
            deadline_ms: 777,
            session: None,
        },
        LedgerEntry {
            offset: 12,
            attempt: 2,
            deadline_ms: 777,
            session: None,
        },
    ];
    assert_eq!(current(&l, &k).await, by_offset(&want));
    assert_eq!(state.entries().cloned().collect::<Vec<_>>(), want);
    // What a release that reads only version 1 finds at the key it reads: a
    // version it does not know, refused by name (never an empty map).
    let head = meta.get(&ledger_key(&k)).await.expect("get").kv.unwrap();
    let err = decode_v1(&head.value).expect_err("a version-1 reader");
    assert!(
        err.contains("unknown attempt ledger record version 2"),
        "{err}"
    );
}
