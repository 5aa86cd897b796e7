//! # The DeadLetterStore conformance suite, on both Meta backends
//!
//! One async function per case; [`common::backend_cases!`] stamps out `embedded::<case>` (EmbeddedMeta
//! on a temp dir) and `etcd::<case>` (a real etcd process per test). Every case takes
//! the backend and a [`BodyLogs`]: the dead-letter streams of the log, behind
//! `Arc<dyn DeadLetterBodies>`. Here that is [`RocksLogs`]: the real RocksDB partition
//! log of `meshd-stores-local`, one per log id.
//!
//! "Restart" is real (etcd SIGKILLed and restarted on its data dir; the embedded Meta
//! closed and reopened), as is "Meta unavailable" (a killed etcd, a closed embedded
//! Meta). Stores reach the backend through [`common::ProxyMeta`], which forwards every call to
//! the backend's current client, can inject a fault into the next transaction (to show
//! what the store does with an unknown outcome) and can journal transactions next to
//! body appends (to show the order of the two).
//!
//! The stories the cases pin:
//! * one entry per delivery, however often and however concurrently it is moved;
//! * never an entry without its body; a crash between the two leaves only an orphan
//!   body, which boot collects;
//! * a stale owner writes nothing; Meta down is a typed error with nothing half-written;
//! * list, inspect, redrive (dead → redriving → deleted, or back to dead with
//!   redrives + 1), delete and retention work as the API describes.

mod common;

use async_trait::async_trait;
use common::{backend_cases, Fault, Harness, Journal};
use futures::StreamExt;
use meshd_local::RocksEngine;
use meshd_meta::fence::Ownership;
use meshd_meta::keys::{self, KeyKind};
use meshd_meta::{Meta, MetaError, Precondition, RangeOptions, WatchEvent};
use meshd_stores::deadletters::{
    DeadLetterEntry, DeadLetterError, DeadLetterState, DeadLetterStore, MetaDeadLetterStore,
    NewDeadLetter,
};
use meshd_stores::failure::StoreFailure;
use meshd_stores::log::{BodyRef, DeadLetterBodies, LogError};
use meshd_stores::tasks::Timestamp;
use meshd_stores_local::keys::COLUMN_FAMILIES;
use meshd_stores_local::log::RocksLog;
use meshd_stores_local::LocalStores;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

backend_cases!(crate::RocksLogs::default();
    dead_letter_creates_one_entry_per_delivery,
    concurrent_dead_letters_create_exactly_one_entry,
    two_logs_never_collide,
    the_body_is_durable_before_the_entry_exists,
    a_stale_owner_is_fenced_and_writes_nothing,
    list_by_subscription_in_pages,
    redrive_lifecycle,
    delete_removes_the_entry_then_its_body,
    orphan_bodies_are_collected,
    restart_keeps_entries_and_bodies,
    meta_unavailable_is_a_typed_error_and_nothing_is_half_written,
    expire_deletes_only_old_dead_entries,
    corrupt_records_are_reported,
);

// ---------------------------------------------------------------------------------
// Body logs: the interface the suite needs, and the in-memory test double.
// ---------------------------------------------------------------------------------

/// Opens the dead-letter stream of a log by id. The same id gives the same stream
/// (its bodies outlive a store object, as a durable log's outlive a process).
pub trait BodyLogs: Send + Sync {
    fn open(&self, log_id: &str) -> Arc<dyn DeadLetterBodies>;
}

/// The real dead-letter streams: one RocksDB partition log per log id, each in its own
/// temporary data dir, kept open for the test (as a durable log outlives a store
/// object).
#[derive(Default)]
pub struct RocksLogs(Mutex<HashMap<String, (tempfile::TempDir, Arc<RocksLog>)>>);

impl BodyLogs for RocksLogs {
    fn open(&self, log_id: &str) -> Arc<dyn DeadLetterBodies> {
        let mut logs = self.0.lock().expect("logs");
        let (_, log) = logs.entry(log_id.to_string()).or_insert_with(|| {
            let dir = tempfile::tempdir().expect("temp dir");
            let engine = RocksEngine::open(dir.path(), COLUMN_FAMILIES).expect("open rocksdb");
            let stores = LocalStores::open(Arc::new(engine), log_id, Duration::from_millis(100))
                .expect("open local stores");
            (dir, Arc::new(stores.log))
        });
        log.clone()
    }
}

/// Any stream, with its appends journaled.
struct Journaled {
    inner: Arc<dyn DeadLetterBodies>,
    journal: Journal,
}

#[async_trait]
impl DeadLetterBodies for Journaled {
    fn log_id(&self) -> &str {
        self.inner.log_id()
    }
    async fn append_body(&self, body: &[u8]) -> Result<BodyRef, LogError> {
        let r = self.inner.append_body(body).await?;
        // Recorded once the append returned, i.e. once it is durable.
        self.journal.record(format!("body appended {r}"));
        Ok(r)
    }
    async fn read_body(&self, body: &BodyRef) -> Result<Option<Vec<u8>>, LogError> {
        self.inner.read_body(body).await
    }
    async fn delete_body(&self, body: &BodyRef) -> Result<(), LogError> {
        self.inner.delete_body(body).await
    }
    async fn list_bodies(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<BodyRef>, LogError> {
        self.inner.list_bodies(after, limit).await
    }
}

// ---------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------

const LOG: &str = "instance-1";

fn dl_store(b: &Harness, bodies: Arc<dyn DeadLetterBodies>) -> MetaDeadLetterStore {
    MetaDeadLetterStore::new(b.meta(), bodies)
}

/// Takes the ownership of partition `name` (a takeover when someone holds it).
async fn owner(meta: &dyn Meta, name: &str) -> Ownership {
    let key = keys::key(KeyKind::Owners, &["partition", name]);
    let lease = meta.grant(Duration::from_secs(60)).await.expect("grant");
    Ownership::take_over(meta, &key, LOG.as_bytes(), Some(lease.id))
        .await
        .expect("owner key")
}

fn delivery(subscription: &str, offset: u64) -> NewDeadLetter {
    NewDeadLetter {
        subscription: subscription.to_string(),
        subscription_incarnation: 7,
        topic: "orders".into(),
        partition: 1,
        offset,
        attempts: 5,
        reason: "HTTP 500 from the webhook".into(),
        first_attempt_at: Timestamp::now(),
        instance: LOG.into(),
    }
}

fn body_of(offset: u64) -> Vec<u8> {
    format!("{{\"event\":{offset}}}").into_bytes()
}

async fn all_bodies(bodies: &dyn DeadLetterBodies) -> Vec<BodyRef> {
    bodies
        .list_bodies(None, 100_000)
        .await
        .expect("list bodies")
}

async fn all_entries(s: &MetaDeadLetterStore, subscription: Option<&str>) -> Vec<DeadLetterEntry> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let page = s
            .list(subscription, 1000, cursor.as_deref())
            .await
            .expect("list");
        out.extend(page.entries);
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return out,
        }
    }
}

/// Every entry of this log has its body, and there is no other body.
async fn assert_ledger_matches_bodies(s: &MetaDeadLetterStore, bodies: &dyn DeadLetterBodies) {
    let entries: Vec<_> = all_entries(s, None)
        .await
        .into_iter()
        .filter(|e| e.body.log_id == bodies.log_id())
        .collect();
    for e in &entries {
        assert_eq!(
            s.read_body(e).await.expect("an entry always has its body"),
            body_of(e.offset)
        );
    }
    let mut referenced: Vec<_> = entries.iter().map(|e| e.body.clone()).collect();
    referenced.sort_by_key(|b| b.seq);
    assert_eq!(
        all_bodies(bodies).await,
        referenced,
        "bodies = referenced bodies"
    );
}

// ---------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------

async fn dead_letter_creates_one_entry_per_delivery(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let bodies = logs.open(LOG);
    let s = dl_store(b, bodies.clone());
    let own = owner(meta.as_ref(), "p1").await;
    let d = delivery("billing", 10);
    let first = s
        .dead_letter(d.clone(), &body_of(10), &own)
        .await
        .expect("dead-letter");
    assert!(first.created);
    let e = &first.entry;
    assert_eq!(e.id, s.id_of(&d));
    assert_eq!(
        e.id,
        meshd_stores::deadletters::entry_id(LOG, 7, "orders", 1, 10)
    );
    assert_eq!(
        (
            e.subscription.as_str(),
            e.subscription_incarnation,
            e.topic.as_str(),
            e.partition,
            e.offset
        ),
        ("billing", 7, "orders", 1, 10)
    );
    assert_eq!(
        (e.attempts, e.reason.as_str()),
        (5, "HTTP 500 from the webhook")
    );
    assert_eq!((e.state, e.redrives), (DeadLetterState::Dead, 0));
    assert_eq!(
        (e.instance.as_str(), e.epoch, e.log_id.as_str()),
        (LOG, own.epoch(), LOG)
    );
    assert_eq!(e.first_attempt_at, d.first_attempt_at);
    assert!(e.dead_lettered_at >= e.first_attempt_at);
    assert_eq!(s.get(&e.id).await.expect("get"), *e);

    let second = s
        .dead_letter(d.clone(), &body_of(10), &own)
        .await
        .expect("again");
    assert!(!second.created, "the same delivery again is a no-op");
    assert_eq!(second.entry, *e);
    // Another attempt count or reason does not make it another delivery.
    let mut later = d.clone();
    later.attempts = 9;
    later.reason = "other".into();
    let third = s
        .dead_letter(later, b"other body", &own)
        .await
        .expect("again");
    assert!(!third.created);
    assert_eq!(third.entry, *e);
    // A different offset, incarnation, partition or topic is a different delivery.
    let mut n = 0;
    for change in 0..4 {
        let mut other = d.clone();
        match change {
            0 => other.offset = 11,
            1 => other.subscription_incarnation = 8,
            2 => other.partition = 2,
            _ => other.topic = "payments".into(),
        }
        let r = s
            .dead_letter(other, &body_of(10), &own)
            .await
            .expect("other delivery");
        assert!(r.created);
        assert_ne!(r.entry.id, e.id);
        n += 1;
    }
    assert_eq!(all_entries(&s, None).await.len(), 1 + n);
    assert_eq!(
        all_bodies(bodies.as_ref()).await.len(),
        1 + n,
        "no orphan bodies"
    );
    assert!(matches!(
        s.dead_letter(delivery("bad/sub", 1), b"x", &own).await,
        Err(DeadLetterError::Invalid(_))
    ));
    assert!(matches!(
        s.get("not-an-id").await,
        Err(DeadLetterError::Invalid(_))
    ));
    assert!(matches!(
        s.get(&"0".repeat(32)).await,
        Err(DeadLetterError::NotFound { .. })
    ));
}

async fn concurrent_dead_letters_create_exactly_one_entry(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let bodies = logs.open(LOG);
    // Two store objects on the same log, as after a failover inside one instance.
    let stores = [
        Arc::new(dl_store(b, bodies.clone())),
        Arc::new(dl_store(b, bodies.clone())),
    ];
    let own = owner(meta.as_ref(), "p1").await;
    // While it runs, every entry that appears in Meta must already have its body.
    let start = meta.status().await.expect("status").revision + 1;
    let prefix = keys::prefix(KeyKind::DeadLetters, &["entries"]);
    let mut watch = meta.watch(&prefix, start).await.expect("watch");
    for round in 0..3u64 {
        let d = delivery("billing", round);
        let barrier = Arc::new(tokio::sync::Barrier::new(16));
        let mut handles = Vec::new();
        for i in 0..16 {
            let (s, d, own, barrier) = (
                stores[i % 2].clone(),
                d.clone(),
                own.clone(),
                barrier.clone(),
            );
            handles.push(tokio::spawn(async move {
                barrier.wait().await;
                s.dead_letter(d, &body_of(round), &own).await
            }));
        }
        let mut created = 0;
        let mut ids = HashSet::new();
        for h in handles {
            let r = h.await.expect("join").expect("dead-letter");
            created += usize::from(r.created);
            ids.insert(r.entry.id.clone());
        }
        assert_eq!(created, 1, "round {round}: {created} creates");
        assert_eq!(
            ids.len(),
            1,
            "round {round}: every caller got the same entry"
        );
    }
    let entries = all_entries(&stores[0], None).await;
    assert_eq!(entries.len(), 3);
    assert_ledger_matches_bodies(&stores[0], bodies.as_ref()).await;
    let last = entries.iter().map(|e| e.version).max().expect("entries");
    let mut seen = 0;
    while seen < 3 {
        let batch = tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("watch events")
            .expect("stream open")
            .expect("watch batch");
        for ev in batch.events {
            if let WatchEvent::Put(kv) = ev {
                let v: serde_json::Value = serde_json::from_slice(&kv.value).expect("json");
                let body = BodyRef {
                    log_id: v["body"]["log_id"].as_str().expect("log id").to_string(),
                    seq: v["body"]["seq"].as_u64().expect("seq"),
                };
                assert!(
                    bodies.read_body(&body).await.expect("read").is_some(),
                    "entry written at {} without its body",
                    kv.mod_revision
                );
                seen += 1;
                assert!(kv.mod_revision <= last);
            }
        }
    }
}

async fn two_logs_never_collide(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let (b1, b2) = (logs.open("instance-1"), logs.open("instance-2"));
    let (s1, s2) = (dl_store(b, b1.clone()), dl_store(b, b2.clone()));
    let own = owner(meta.as_ref(), "p1").await;
    let d = delivery("billing", 42);
    let e1 = s1
        .dead_letter(d.clone(), b"from 1", &own)
        .await
        .expect("1")
        .entry;
    let e2 = s2.dead_letter(d.clone(), b"from 2", &own).await.expect("2");
    assert!(
        e2.created,
        "the same coordinates in another log are another delivery"
    );
    let e2 = e2.entry;
    assert_ne!(e1.id, e2.id);
    assert_eq!(
        (e1.log_id.as_str(), e2.log_id.as_str()),
        ("instance-1", "instance-2")
    );
    assert_eq!(all_entries(&s1, Some("billing")).await.len(), 2);
    assert_eq!(s1.read_body(&e1).await.expect("body"), b"from 1");
    assert_eq!(s2.read_body(&e2).await.expect("body"), b"from 2");
    // A store reads bodies of its own log only.
    assert!(matches!(
        s1.read_body(&e2).await,
        Err(DeadLetterError::BodyMissing { .. })
    ));
    // Collecting orphans in one log never touches the other's bodies.
    assert_eq!(s1.collect_orphan_bodies().await.expect("collect"), 0);
    assert_eq!(all_bodies(b2.as_ref()).await, vec![e2.body.clone()]);
}

async fn the_body_is_durable_before_the_entry_exists(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let journal = Journal::default();
    b.proxy.journal_to(journal.clone());
    let bodies: Arc<dyn DeadLetterBodies> = Arc::new(Journaled {
        inner: logs.open(LOG),
        journal: journal.clone(),
    });
    let s = dl_store(b, bodies.clone());
    let own = owner(meta.as_ref(), "p1").await;
    let e = s
        .dead_letter(delivery("billing", 3), &body_of(3), &own)
        .await
        .expect("dead-letter")
        .entry;
    let j = journal.entries();
    let appended = j
        .iter()
        .position(|x| x == &format!("body appended {}", e.body))
        .unwrap_or_else(|| panic!("no append in {j:?}"));
    let entry_write = j
        .iter()
        .position(|x| x.starts_with("meta txn put meshd/v1/deadletters/entries/billing/"))
        .unwrap_or_else(|| panic!("no entry write in {j:?}"));
    assert!(
        appended < entry_write,
        "the entry was sent before its body was durable: {j:?}"
    );
    assert_eq!(s.read_body(&e).await.expect("body"), body_of(3));
}

async fn a_stale_owner_is_fenced_and_writes_nothing(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let bodies = logs.open(LOG);
    let s = dl_store(b, bodies.clone());
    let stale = owner(meta.as_ref(), "p1").await;
    let current = owner(meta.as_ref(), "p1").await; // takeover
    assert!(current.epoch() > stale.epoch());
    for offset in [1, 2] {
        match s
            .dead_letter(delivery("billing", offset), &body_of(offset), &stale)
            .await
        {
            Err(DeadLetterError::Fenced) => {}
            other => panic!("expected Fenced, got {other:?}"),
        }
    }
    assert!(all_entries(&s, None).await.is_empty(), "no entry");
    let range = meta
        .range(
            &keys::prefix(KeyKind::DeadLetters, &[]),
            RangeOptions::default(),
        )
        .await
        .expect("range");
    assert!(range.kvs.is_empty(), "no key at all: {:?}", range.kvs);
    assert!(
        all_bodies(bodies.as_ref()).await.is_empty(),
        "the appended bodies were removed"
    );
    let e = s
        .dead_letter(delivery("billing", 1), &body_of(1), &current)
        .await
        .expect("the current owner dead-letters");
    assert_eq!(e.entry.epoch, current.epoch());
    assert_ledger_matches_bodies(&s, bodies.as_ref()).await;
}

async fn list_by_subscription_in_pages(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let s = dl_store(b, logs.open(LOG));
    let own = owner(meta.as_ref(), "p1").await;
    let mut want: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (sub, n) in [("a", 7u64), ("ab", 2), ("b", 3)] {
        for i in 0..n {
            let mut d = delivery(sub, i);
            d.topic = format!("topic-{sub}");
            let e = s.dead_letter(d, &body_of(i), &own).await.expect("dl").entry;
            want.entry(sub).or_default().push(e.id);
        }
    }
    for ids in want.values_mut() {
        ids.sort();
    }
    // One subscription, 3 at a time: exactly its entries, in id order, each once.
    let mut got = Vec::new();
    let mut cursor = None;
    let mut pages = 0;
    loop {
        let page = s.list(Some("a"), 3, cursor.as_deref()).await.expect("list");
        assert!(page.entries.len() <= 3);
        assert!(page.entries.iter().all(|e| e.subscription == "a"));
        got.extend(page.entries.into_iter().map(|e| e.id));
        pages += 1;
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(got, want["a"]);
    assert_eq!(pages, 3);
    // Everything, 5 at a time, in (subscription, id) order.
    let mut all = Vec::new();
    let mut cursor = None;
    loop {
        let page = s.list(None, 5, cursor.as_deref()).await.expect("list");
        all.extend(page.entries.into_iter().map(|e| (e.subscription, e.id)));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    let expected: Vec<_> = want
        .iter()
        .flat_map(|(sub, ids)| ids.iter().map(move |id| (sub.to_string(), id.clone())))
        .collect();
    assert_eq!(all, expected);
    assert!(s
        .list(Some("none"), 10, None)
        .await
        .expect("list")
        .entries
        .is_empty());
    // A cursor of another subscription's listing, or a made-up one, is rejected.
    let b_cursor = s
        .list(Some("b"), 1, None)
        .await
        .expect("list")
        .next_cursor
        .expect("more");
    for bad in [b_cursor.as_str(), "a", "a/xyz", "../x"] {
        assert!(
            matches!(
                s.list(Some("a"), 3, Some(bad)).await,
                Err(DeadLetterError::Invalid(_))
            ),
            "{bad}"
        );
    }
    for limit in [0, 1001] {
        assert!(matches!(
            s.list(None, limit, None).await,
            Err(DeadLetterError::Invalid(_))
        ));
    }
}

async fn redrive_lifecycle(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let bodies = logs.open(LOG);
    let s = dl_store(b, bodies.clone());
    let own = owner(meta.as_ref(), "p1").await;
    let e = s
        .dead_letter(delivery("billing", 1), &body_of(1), &own)
        .await
        .expect("dl")
        .entry;

    let r = s.redrive(&e.id).await.expect("redrive");
    assert_eq!((r.state, r.redrives), (DeadLetterState::Redriving, 0));
    assert!(r.version > e.version);
    let again = s.redrive(&e.id).await.expect("redrive again");
    assert_eq!(again, r, "a repeated redrive changes nothing");
    assert!(matches!(
        s.redrive_succeeded(&"0".repeat(32)).await,
        Err(DeadLetterError::NotFound { .. })
    ));

    let failed = s
        .redrive_failed(&e.id, "timeout after 30s", 3)
        .await
        .expect("failed");
    assert_eq!(
        (failed.state, failed.redrives, failed.attempts),
        (DeadLetterState::Dead, 1, 3)
    );
    assert_eq!(failed.reason, "timeout after 30s");
    assert!(failed.dead_lettered_at >= e.dead_lettered_at);
    assert_eq!(s.get(&e.id).await.expect("get"), failed);
    match s.redrive_failed(&e.id, "x", 1).await {
        Err(DeadLetterError::IllegalTransition { from, .. }) => {
            assert_eq!(from, DeadLetterState::Dead)
        }
        other => panic!("expected IllegalTransition, got {other:?}"),
    }
    assert!(matches!(
        s.redrive_succeeded(&e.id).await,
        Err(DeadLetterError::IllegalTransition {
            from: DeadLetterState::Dead,
            ..
        })
    ));
    assert_eq!(
        s.get(&e.id).await.expect("get"),
        failed,
        "refusals change nothing"
    );

    let r2 = s.redrive(&e.id).await.expect("redrive");
    assert_eq!((r2.state, r2.redrives), (DeadLetterState::Redriving, 1));
    s.redrive_succeeded(&e.id).await.expect("acked");
    assert!(matches!(
        s.get(&e.id).await,
        Err(DeadLetterError::NotFound { .. })
    ));
    assert!(matches!(
        s.read_body(&r2).await,
        Err(DeadLetterError::BodyMissing { .. })
    ));
    assert!(
        all_bodies(bodies.as_ref()).await.is_empty(),
        "the body went with it"
    );
    assert!(matches!(
        s.redrive_succeeded(&e.id).await,
        Err(DeadLetterError::NotFound { .. })
    ));
    assert!(matches!(
        s.redrive(&e.id).await,
        Err(DeadLetterError::NotFound { .. })
    ));
    // The same delivery can be dead-lettered again afterwards (a new entry).
    let again = s
        .dead_letter(delivery("billing", 1), &body_of(1), &own)
        .await
        .expect("dl");
    assert!(again.created);
    assert!(again.entry.version > r2.version);
}

async fn delete_removes_the_entry_then_its_body(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let bodies = logs.open(LOG);
    let s = dl_store(b, bodies.clone());
    let own = owner(meta.as_ref(), "p1").await;
    let e1 = s
        .dead_letter(delivery("billing", 1), &body_of(1), &own)
        .await
        .expect("dl")
        .entry;
    let e2 = s
        .dead_letter(delivery("billing", 2), &body_of(2), &own)
        .await
        .expect("dl")
        .entry;
    let e3 = s
        .dead_letter(delivery("billing", 3), &body_of(3), &own)
        .await
        .expect("dl")
        .entry;
    s.redrive(&e3.id).await.expect("redrive");
    s.delete(&e1.id).await.expect("delete");
    s.delete(&e3.id).await.expect("delete a redriving entry");
    for gone in [&e1, &e3] {
        assert!(matches!(
            s.get(&gone.id).await,
            Err(DeadLetterError::NotFound { .. })
        ));
        assert!(matches!(
            s.delete(&gone.id).await,
            Err(DeadLetterError::NotFound { .. })
        ));
        let index = meta
            .get(&keys::key(KeyKind::DeadLetters, &["ids", &gone.id]))
            .await
            .expect("get");
        assert!(index.kv.is_none(), "the id index went with the entry");
    }
    assert_eq!(s.get(&e2.id).await.expect("kept"), e2);
    assert_eq!(all_bodies(bodies.as_ref()).await, vec![e2.body.clone()]);
    assert_ledger_matches_bodies(&s, bodies.as_ref()).await;
}

async fn orphan_bodies_are_collected(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let bodies = logs.open(LOG);
    let s = dl_store(b, bodies.clone());
    let own = owner(meta.as_ref(), "p1").await;
    let kept: Vec<_> = [1, 2]
        .into_iter()
        .map(|o| (delivery("billing", o), body_of(o)))
        .collect();
    for (d, body) in &kept {
        s.dead_letter(d.clone(), body, &own).await.expect("dl");
    }
    // A crash between the append and the create leaves bodies nothing references.
    for i in 0..3 {
        bodies
            .append_body(format!("orphan {i}").as_bytes())
            .await
            .expect("append");
    }
    // ... and so does an unknown outcome whose write never landed.
    b.proxy
        .inject(Fault::Refuse(MetaError::Indeterminate("timed out".into())));
    assert!(matches!(
        s.dead_letter(delivery("billing", 3), &body_of(3), &own)
            .await,
        Err(DeadLetterError::Store(StoreFailure::Indeterminate(_)))
    ));
    assert_eq!(all_bodies(bodies.as_ref()).await.len(), 6);
    assert_eq!(s.collect_orphan_bodies().await.expect("collect"), 4);
    assert_ledger_matches_bodies(&s, bodies.as_ref()).await;
    assert_eq!(s.collect_orphan_bodies().await.expect("collect"), 0);
}

async fn restart_keeps_entries_and_bodies(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let bodies = logs.open(LOG);
    let s = dl_store(b, bodies.clone());
    let own = owner(meta.as_ref(), "p1").await;
    for o in 0..5 {
        s.dead_letter(delivery("billing", o), &body_of(o), &own)
            .await
            .expect("dl");
    }
    let first = all_entries(&s, None).await[0].id.clone();
    s.redrive(&first).await.expect("redrive");
    let before = all_entries(&s, None).await;
    b.restart().await;
    b.wait_ready().await;
    // A fresh store on the same log, as after a meshd restart.
    let fresh = dl_store(b, logs.open(LOG));
    assert_eq!(all_entries(&fresh, None).await, before);
    for e in &before {
        assert_eq!(fresh.get(&e.id).await.expect("get"), *e);
    }
    assert_ledger_matches_bodies(&fresh, bodies.as_ref()).await;
    // The owner still holds its epoch (its lease survived), and a repeat is a no-op.
    let again = fresh
        .dead_letter(delivery("billing", 0), &body_of(0), &own)
        .await
        .expect("dl");
    assert!(!again.created);
}

async fn meta_unavailable_is_a_typed_error_and_nothing_is_half_written(
    b: &mut Harness,
    logs: &dyn BodyLogs,
) {
    let meta = b.meta();
    let bodies = logs.open(LOG);
    let s = dl_store(b, bodies.clone());
    let own = owner(meta.as_ref(), "p1").await;
    let kept = s
        .dead_letter(delivery("billing", 0), &body_of(0), &own)
        .await
        .expect("dl")
        .entry;

    // Meta really down.
    b.stop();
    let d = delivery("billing", 1);
    match s.dead_letter(d.clone(), &body_of(1), &own).await {
        Err(DeadLetterError::Store(StoreFailure::Unavailable(_))) => {}
        other => panic!("expected Unavailable, got {other:?}"),
    }
    // Reads never say "absent" when Meta could not be read.
    assert!(matches!(
        s.get(&kept.id).await,
        Err(DeadLetterError::Store(StoreFailure::Unavailable(_)))
    ));
    assert!(matches!(
        s.list(None, 10, None).await,
        Err(DeadLetterError::Store(StoreFailure::Unavailable(_)))
    ));
    assert!(matches!(
        s.redrive(&kept.id).await,
        Err(DeadLetterError::Store(StoreFailure::Unavailable(_)))
    ));
    b.start().await;
    b.wait_ready().await;
    assert!(matches!(
        s.get(&s.id_of(&d)).await,
        Err(DeadLetterError::NotFound { .. })
    ));
    assert_ledger_matches_bodies(&s, bodies.as_ref()).await;
    // The held delivery is moved once Meta is back, by the same store.
    let held = s
        .dead_letter(d.clone(), &body_of(1), &own)
        .await
        .expect("dl after restart");
    assert!(held.created);

    // Refused at the transaction: the appended body is removed again.
    b.proxy
        .inject(Fault::Refuse(MetaError::Unavailable("no leader".into())));
    let d2 = delivery("billing", 2);
    let err = s
        .dead_letter(d2.clone(), &body_of(2), &own)
        .await
        .expect_err("unavailable");
    assert!(
        matches!(err, DeadLetterError::Store(StoreFailure::Unavailable(_))) && err.is_retryable()
    );
    assert!(matches!(
        s.get(&s.id_of(&d2)).await,
        Err(DeadLetterError::NotFound { .. })
    ));
    assert_ledger_matches_bodies(&s, bodies.as_ref()).await;

    // Applied but the answer was lost: the retry finds the entry; its body is the one
    // appended by the first call, and nothing is left over.
    b.proxy
        .inject(Fault::ApplyThenFail(MetaError::Indeterminate(
            "answer lost".into(),
        )));
    assert!(matches!(
        s.dead_letter(d2.clone(), &body_of(2), &own).await,
        Err(DeadLetterError::Store(StoreFailure::Indeterminate(_)))
    ));
    let retry = s
        .dead_letter(d2.clone(), &body_of(2), &own)
        .await
        .expect("retry");
    assert!(!retry.created);
    assert_ledger_matches_bodies(&s, bodies.as_ref()).await;
}

async fn expire_deletes_only_old_dead_entries(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let bodies = logs.open(LOG);
    let s = dl_store(b, bodies.clone());
    let own = owner(meta.as_ref(), "p1").await;
    let mut ids = Vec::new();
    for o in 0..3 {
        ids.push(
            s.dead_letter(delivery("billing", o), &body_of(o), &own)
                .await
                .expect("dl")
                .entry
                .id,
        );
    }
    assert_eq!(
        s.expire(Duration::from_secs(3600)).await.expect("expire"),
        0
    );
    let redriving = s.redrive(&ids[0]).await.expect("redrive");
    assert_eq!(s.expire(Duration::ZERO).await.expect("expire"), 2);
    assert_eq!(all_entries(&s, None).await, vec![redriving.clone()]);
    assert_eq!(
        all_bodies(bodies.as_ref()).await,
        vec![redriving.body.clone()]
    );
    assert_eq!(s.expire(Duration::ZERO).await.expect("expire"), 0);
}

async fn corrupt_records_are_reported(b: &mut Harness, logs: &dyn BodyLogs) {
    let meta = b.meta();
    let s = dl_store(b, logs.open(LOG));
    let own = owner(meta.as_ref(), "p1").await;
    let good = s
        .dead_letter(delivery("billing", 1), &body_of(1), &own)
        .await
        .expect("dl")
        .entry;
    let entry_key = |sub: &str, id: &str| keys::key(KeyKind::DeadLetters, &["entries", sub, id]);
    let index_key = |id: &str| keys::key(KeyKind::DeadLetters, &["ids", id]);
    let put = |key: Vec<u8>, value: Vec<u8>| {
        let meta = meta.clone();
        async move {
            meta.put(&key, &value, Precondition::None, None)
                .await
                .expect("put");
        }
    };
    // A truncated entry.
    let id1 = "1".repeat(32);
    put(
        index_key(&id1),
        br#"{"v":1,"subscription":"billing"}"#.to_vec(),
    )
    .await;
    put(entry_key("billing", &id1), br#"{"v":1,"id":"111"#.to_vec()).await;
    // An entry of another version.
    let id2 = "2".repeat(32);
    put(
        index_key(&id2),
        br#"{"v":1,"subscription":"billing"}"#.to_vec(),
    )
    .await;
    put(entry_key("billing", &id2), br#"{"v":9}"#.to_vec()).await;
    // A garbled index.
    let id3 = "3".repeat(32);
    put(index_key(&id3), b"\x01\x02".to_vec()).await;
    // An index whose entry is missing.
    let id4 = "4".repeat(32);
    put(
        index_key(&id4),
        br#"{"v":1,"subscription":"billing"}"#.to_vec(),
    )
    .await;
    for id in [&id1, &id2, &id3, &id4] {
        match s.get(id).await {
            Err(DeadLetterError::Store(StoreFailure::Corrupt { key, .. })) => {
                assert!(key.contains(id.as_str()), "{key}")
            }
            other => panic!("{id}: expected Corrupt, got {other:?}"),
        }
    }
    assert!(matches!(
        s.list(None, 100, None).await,
        Err(DeadLetterError::Store(StoreFailure::Corrupt { .. }))
    ));
    assert_eq!(s.get(&good.id).await.expect("the good entry"), good);
}
