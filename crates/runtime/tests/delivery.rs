//! The delivery rules of the runtime, in process: a `Runtime` over embedded Meta and
//! the Local stores (RocksDB) in a temp dir, driven through its public API. These
//! prove the rules (attempts, leases, retries, dead-lettering, ordered commits, the
//! write-ahead attempt across a reopen); durability under SIGKILL and power loss is
//! proven through the binary (`crates/meshd/tests`), never here.

use meshd_local::RocksEngine;
use meshd_meta::Meta;
use meshd_meta_embedded::{EmbeddedConfig, EmbeddedMeta};
use meshd_runtime::metrics::Metrics;
use meshd_runtime::runtime::{Deps, Handed, PullBudget, Reach, Runtime};
use meshd_stores::deadletters::{DeadLetterStore, MetaDeadLetterStore};
use meshd_stores::delivery::DeliveryStateStore;
use meshd_stores::log::PartitionLog;
use meshd_stores::offsets::OffsetKey;
use meshd_stores::park::{ParkError, ParkIndex, Parked};
use meshd_stores::sessions::{MetaSessionStore, SessionStoreConfig};
use meshd_stores::subscriptions::{
    Backoff, MetaSubscriptionStore, SubscriptionSpec, SubscriptionStore, SubscriptionStoreConfig,
};
use meshd_stores::topics::{MetaTopicStore, TopicStore};
use meshd_stores_local::LocalStores;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// One instance's stores and runtime over `dir`, on a tokio runtime of its own so that
/// dropping it ends every task and closes RocksDB (a reopen in the same process).
struct Node {
    rt: Arc<Runtime>,
    log: Arc<dyn PartitionLog>,
    subs: Arc<MetaSubscriptionStore>,
    topics: Arc<MetaTopicStore>,
    deadletters: Arc<dyn DeadLetterStore>,
    local: Arc<LocalStores>,
}

impl Node {
    async fn open(dir: &Path) -> Node {
        Self::open_with_parks(dir, |p| p).await
    }

    /// [`open`](Self::open) with the park index `wrap` makes of the Local one.
    async fn open_with_parks(
        dir: &Path,
        wrap: impl FnOnce(Arc<dyn ParkIndex>) -> Arc<dyn ParkIndex>,
    ) -> Node {
        let engine = Arc::new(
            RocksEngine::open(dir, meshd_stores_local::keys::COLUMN_FAMILIES)
                .expect("open RocksDB"),
        );
        let local = Arc::new(
            LocalStores::open(engine.clone(), "node-a", Duration::from_millis(10))
                .expect("open the Local stores"),
        );
        let meta: Arc<dyn Meta> =
            Arc::new(EmbeddedMeta::open(engine, EmbeddedConfig::default()).expect("open Meta"));
        let topics = Arc::new(MetaTopicStore::start(meta.clone()).await.expect("topics"));
        let subs = Arc::new(
            MetaSubscriptionStore::start(meta.clone(), SubscriptionStoreConfig::default())
                .expect("subscriptions"),
        );
        let sessions = Arc::new(
            MetaSessionStore::start(meta.clone(), SessionStoreConfig::new("node-a"))
                .expect("sessions"),
        );
        assert!(topics.wait_ready(Duration::from_secs(10)).await);
        assert!(subs.wait_ready(Duration::from_secs(10)).await);
        let log: Arc<dyn PartitionLog> = Arc::new(local.log.clone());
        let deadletters: Arc<dyn DeadLetterStore> = Arc::new(MetaDeadLetterStore::new(
            meta.clone(),
            Arc::new(local.log.clone()),
        ));
        let rt = Runtime::new(Deps {
            instance_id: "node-a".into(),
            meta: meta.clone(),
            meta_backend: meshd_meta::Backend::Embedded,
            log: log.clone(),
            log_backend: meshd_meta::Backend::RocksDb,
            offsets: Arc::new(local.offsets.clone()),
            deliveries: Arc::new(local.deliveries.clone()),
            parks: wrap(Arc::new(local.parks.clone())),
            deadletters: deadletters.clone(),
            sessions,
            topics: topics.clone(),
            subscriptions: subs.clone(),
            max_in_flight: 1000,
            park_retries_after_ms: meshd_dispatch::config::DEFAULT_PARK_RETRIES_AFTER_MS,
            id_key: meshd_dispatch::IdKey::random(),
            metrics: Arc::new(Metrics::default()),
            cluster: None,
            push_tls: None,
            push_egress: Arc::new(meshd_runtime::egress::Egress::new(vec![], vec![])),
            background: Default::default(),
        });
        rt.start();
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        while !rt.is_recovered() {
            assert!(
                tokio::time::Instant::now() < until,
                "recovery did not finish"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Node {
            rt,
            log,
            subs,
            topics,
            deadletters,
            local,
        }
    }

    /// A topic of one partition with `n` events, and a subscription from its start.
    async fn topic_with(&self, n: u64, spec: SubscriptionSpec) {
        self.topics.ensure(&spec.topic, 1).await.expect("topic");
        let mut spec = spec;
        spec.start = meshd_stores::subscriptions::StartPosition::Earliest;
        self.subs.create(spec).await.expect("subscription");
        let events = (0..n)
            .map(|i| {
                let e = format!(r#"{{"specversion":"1.0","id":"{i}","source":"/t","type":"t"}}"#);
                (0, e.into_bytes())
            })
            .collect();
        self.log.append("t", events).await.expect("append");
    }

    async fn pull(&self, max: usize, wait_ms: u64) -> Vec<Handed> {
        self.rt
            .pull(
                "s",
                PullBudget::new(max, usize::MAX),
                Duration::from_millis(wait_ms),
                None,
                Reach::Local,
            )
            .await
            .expect("pull")
    }

    /// The ids in each outcome list of an ack or nack.
    async fn ack(&self, ids: &[&Handed]) -> Vec<(&'static str, String)> {
        let ids = ids.iter().map(|h| h.delivery_id.clone()).collect();
        named(self.rt.ack("s", ids, Reach::Local).await.expect("ack"))
    }

    async fn nack(&self, h: &Handed) -> Vec<(&'static str, String)> {
        let ids = vec![h.delivery_id.clone()];
        named(
            self.rt
                .nack("s", ids, "no".into(), None, Reach::Local)
                .await
                .expect("nack"),
        )
    }

    async fn committed(&self) -> u64 {
        self.rt.offsets("s").await.expect("offsets")[0].1.offset
    }
}

/// The answer lists as the API names them.
fn named(answers: meshd_runtime::runtime::Answers) -> Vec<(&'static str, String)> {
    answers
        .lists
        .into_iter()
        .map(|(list, id)| (list.as_str(), id))
        .collect()
}

fn spec() -> SubscriptionSpec {
    let mut s = SubscriptionSpec::new("s", "t");
    s.backoff = Backoff {
        initial_ms: 1,
        max_ms: 1,
    };
    s
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(f)
}

#[test]
fn acks_commit_in_offset_order_and_acked_events_are_never_handed_out_again() {
    let dir = tempfile::tempdir().unwrap();
    block_on(async {
        let n = Node::open(dir.path()).await;
        n.topic_with(3, spec()).await;
        let d = n.pull(10, 1000).await;
        let offsets: Vec<u64> = d.iter().map(|h| h.offset).collect();
        assert_eq!(offsets, [0, 1, 2]);
        assert!(d.iter().all(|h| h.attempt == 1));
        // Acks above a gap wait for it.
        assert_eq!(n.ack(&[&d[1], &d[2]]).await.len(), 2);
        assert_eq!(n.committed().await, 0);
        let answer = n.ack(&[&d[0]]).await;
        assert_eq!(answer, [("acked", d[0].delivery_id.clone())]);
        assert_eq!(n.committed().await, 3);
        // An ack repeated is acked again or unknown, never an error; nothing is due.
        let again = n.ack(&[&d[0]]).await;
        assert!(matches!(again[0].0, "acked" | "unknown"), "{again:?}");
        assert!(n.pull(10, 50).await.is_empty());
    });
}

#[test]
fn a_nacked_event_comes_back_with_the_next_attempt_and_is_dead_lettered_after_max_attempts() {
    let dir = tempfile::tempdir().unwrap();
    block_on(async {
        let n = Node::open(dir.path()).await;
        let mut s = spec();
        s.max_attempts = 2;
        n.topic_with(1, s).await;
        let d = n.pull(1, 1000).await;
        assert_eq!((d[0].offset, d[0].attempt), (0, 1));
        assert_eq!(n.nack(&d[0]).await[0].0, "retrying");
        // A long poll wakes when the backoff has passed.
        let d = n.pull(1, 5000).await;
        assert_eq!((d[0].offset, d[0].attempt), (0, 2));
        let answer = n.nack(&d[0]).await;
        assert!(
            matches!(answer[0].0, "dead_lettered" | "dead_lettering"),
            "{answer:?}"
        );
        // The entry exists with both attempts and the last reason; the offset is
        // resolved, so acking the next event commits past both.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let entry = loop {
            let page = n.deadletters.list(Some("s"), 10, None).await.expect("list");
            if let Some(e) = page.entries.into_iter().next() {
                break e;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no dead-letter entry"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(
            (entry.offset, entry.attempts, entry.reason.as_str()),
            (0, 2, "no")
        );
        let next = br#"{"specversion":"1.0","id":"next","source":"/t","type":"t"}"#;
        n.log
            .append("t", vec![(0, next.to_vec())])
            .await
            .expect("append");
        let d = n.pull(1, 1000).await;
        assert_eq!((d[0].offset, d[0].attempt), (1, 1));
        n.ack(&[&d[0]]).await;
        assert_eq!(n.committed().await, 2);
    });
}

#[test]
fn a_lease_that_runs_out_hands_the_event_out_again_and_the_old_id_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    block_on(async {
        let n = Node::open(dir.path()).await;
        let mut s = spec();
        s.ack_timeout_ms = 100;
        n.topic_with(1, s).await;
        let first = n.pull(1, 1000).await;
        assert_eq!(first[0].attempt, 1);
        // A long poll wakes when the lease runs out.
        let second = n.pull(1, 5000).await;
        assert_eq!((second[0].offset, second[0].attempt), (0, 2));
        assert_ne!(first[0].delivery_id, second[0].delivery_id);
        // The first attempt's id no longer acks anything.
        let stale = n.ack(&[&first[0]]).await;
        assert_ne!(stale[0].0, "acked", "{stale:?}");
        assert_eq!(n.committed().await, 0);
        assert_eq!(n.ack(&[&second[0]]).await[0].0, "acked");
        assert_eq!(n.committed().await, 1);
    });
}

#[test]
fn an_attempt_handed_out_before_a_reopen_counts_after_it() {
    let dir = tempfile::tempdir().unwrap();
    // First life: one event handed out and not acked, one acked.
    let acked = block_on(async {
        let n = Node::open(dir.path()).await;
        let mut s = spec();
        s.ack_timeout_ms = 200;
        n.topic_with(2, s).await;
        let d = n.pull(2, 1000).await;
        assert_eq!(d.len(), 2);
        n.ack(&[&d[1]]).await;
        n.local.deliveries.flush().await.expect("flush");
        d[1].offset
    });
    // Second life over the same directory: the attempt was recorded before the
    // hand-out, so the event comes back as attempt 2; the acked one never does.
    block_on(async {
        let n = Node::open(dir.path()).await;
        // Its lease may still run: a long poll waits for it.
        let d = n.pull(10, 5000).await;
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!((d[0].offset, d[0].attempt), (0, 2));
        assert_ne!(d[0].offset, acked);
        n.ack(&[&d[0]]).await;
        assert_eq!(n.committed().await, 2);
    });
}

/// Pulls that arrive while an earlier pull's attempt write is still being made
/// durable are served meanwhile (their records join the next fsync): each event is
/// still handed out once, with attempt 1, and everything commits.
#[test]
fn concurrent_pulls_and_acks_hand_every_event_out_once_and_commit_them_all() {
    let dir = tempfile::tempdir().unwrap();
    let total = 400u64;
    block_on(async {
        let n = Arc::new(Node::open(dir.path()).await);
        n.topic_with(total, spec()).await;
        let mut workers = Vec::new();
        for _ in 0..8 {
            let n = n.clone();
            workers.push(tokio::spawn(async move {
                let mut seen = Vec::new();
                loop {
                    let d = n.pull(3, 100).await;
                    if d.is_empty() {
                        return seen;
                    }
                    let refs: Vec<&Handed> = d.iter().collect();
                    let answer = n.ack(&refs).await;
                    assert!(answer.iter().all(|(l, _)| *l == "acked"), "{answer:?}");
                    seen.extend(d.iter().map(|h| (h.offset, h.attempt)));
                }
            }));
        }
        let mut all = Vec::new();
        for w in workers {
            all.extend(w.await.expect("worker"));
        }
        all.sort_unstable();
        let expected: Vec<(u64, u32)> = (0..total).map(|o| (o, 1)).collect();
        assert_eq!(all, expected, "each event once, at attempt 1");
        assert_eq!(n.committed().await, total);
    });
}

/// A park index whose first `park_many` and `remove` calls fail as a journal on an
/// unreachable nats-server would (a double for the retry logic; the journal itself is
/// tested on a real nats-server in `meshd-log-nats`).
struct Flaky {
    inner: Arc<dyn ParkIndex>,
    parks_to_fail: std::sync::atomic::AtomicUsize,
    removes_to_fail: std::sync::atomic::AtomicUsize,
}

impl Flaky {
    fn fails(counter: &std::sync::atomic::AtomicUsize) -> bool {
        use std::sync::atomic::Ordering;
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
    }
}

#[async_trait::async_trait]
impl ParkIndex for Flaky {
    async fn adopt(&self, key: &OffsetKey, epoch: i64) -> Result<(), ParkError> {
        self.inner.adopt(key, epoch).await
    }
    async fn park_many(
        &self,
        key: &OffsetKey,
        entries: Vec<(Parked, Vec<u8>)>,
    ) -> Result<Vec<bool>, ParkError> {
        if Self::fails(&self.parks_to_fail) {
            return Err(ParkError::Unavailable("journal unreachable (test)".into()));
        }
        self.inner.park_many(key, entries).await
    }
    async fn remove(
        &self,
        key: &OffsetKey,
        offset: u64,
        now_ms: u64,
    ) -> Result<meshd_stores::park::Removed, ParkError> {
        if Self::fails(&self.removes_to_fail) {
            return Err(ParkError::Unavailable("journal unreachable (test)".into()));
        }
        self.inner.remove(key, offset, now_ms).await
    }
    async fn release_key(
        &self,
        key: &OffsetKey,
        hash: u64,
        now_ms: u64,
    ) -> Result<Option<Parked>, ParkError> {
        self.inner.release_key(key, hash, now_ms).await
    }
    async fn keys_parked(
        &self,
        key: &OffsetKey,
        hashes: Vec<u64>,
    ) -> Result<std::collections::BTreeSet<u64>, meshd_stores::delivery::DeliveryError> {
        self.inner.keys_parked(key, hashes).await
    }
    async fn held_keys(
        &self,
        key: &OffsetKey,
    ) -> Result<Vec<u64>, meshd_stores::delivery::DeliveryError> {
        self.inner.held_keys(key).await
    }
    async fn earliest(
        &self,
        key: &OffsetKey,
        limit: usize,
    ) -> Result<Vec<Parked>, meshd_stores::delivery::DeliveryError> {
        self.inner.earliest(key, limit).await
    }
    async fn repark(
        &self,
        key: &OffsetKey,
        offset: u64,
        due_ms: u64,
        attempt: u32,
    ) -> Result<bool, ParkError> {
        self.inner.repark(key, offset, due_ms, attempt).await
    }
    async fn record_attempts(
        &self,
        key: &OffsetKey,
        attempts: Vec<(u64, u32)>,
    ) -> Result<(), ParkError> {
        self.inner.record_attempts(key, attempts).await
    }
    async fn entry(
        &self,
        key: &OffsetKey,
        offset: u64,
    ) -> Result<Option<Parked>, meshd_stores::delivery::DeliveryError> {
        self.inner.entry(key, offset).await
    }
    async fn body(
        &self,
        key: &OffsetKey,
        offset: u64,
    ) -> Result<Option<Vec<u8>>, meshd_stores::delivery::DeliveryError> {
        self.inner.body(key, offset).await
    }
    async fn parked_among(
        &self,
        key: &OffsetKey,
        offsets: Vec<u64>,
    ) -> Result<Vec<u64>, meshd_stores::delivery::DeliveryError> {
        self.inner.parked_among(key, offsets).await
    }
    async fn offsets_from(
        &self,
        key: &OffsetKey,
        from: u64,
        limit: usize,
    ) -> Result<Vec<u64>, meshd_stores::delivery::DeliveryError> {
        self.inner.offsets_from(key, from, limit).await
    }
    async fn count(&self, key: &OffsetKey) -> Result<u64, meshd_stores::delivery::DeliveryError> {
        self.inner.count(key).await
    }
    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), ParkError> {
        self.inner
            .drop_subscription(subscription, incarnation)
            .await
    }
}

#[test]
fn given_a_park_journal_that_fails_then_parking_and_settling_are_retried_and_the_event_waits_and_goes_out_once(
) {
    let dir = tempfile::tempdir().unwrap();
    block_on(async {
        let flaky = Arc::new(std::sync::OnceLock::<Arc<Flaky>>::new());
        let keep = flaky.clone();
        let n = Node::open_with_parks(dir.path(), move |inner| {
            let f = Arc::new(Flaky {
                inner,
                parks_to_fail: 2.into(),
                removes_to_fail: 1.into(),
            });
            let _ = keep.set(f.clone());
            f
        })
        .await;
        n.topics.ensure("t", 1).await.expect("topic");
        let mut s = spec();
        s.start = meshd_stores::subscriptions::StartPosition::Earliest;
        n.subs.create(s).await.expect("subscription");
        let now = meshd_stores::time::Timestamp::now().as_millis();
        // Later than the two failed parks take (a second apart).
        let due = now + 4000;
        let at = meshd_stores::time::Timestamp::from_millis(due)
            .unwrap()
            .to_rfc3339();
        let delayed = format!(
            r#"{{"specversion":"1.0","id":"d","source":"/t","type":"t","deliverat":"{at}"}}"#
        );
        let plain = r#"{"specversion":"1.0","id":"p","source":"/t","type":"t"}"#;
        n.log
            .append(
                "t",
                vec![(0, delayed.into_bytes()), (0, plain.as_bytes().to_vec())],
            )
            .await
            .expect("append");
        let first = n.pull(10, 1000).await;
        assert_eq!(first.iter().map(|h| h.offset).collect::<Vec<_>>(), [1]);
        n.ack(&[&first[0]]).await;
        // Parked once the journal takes it (two failed tries, a second apart): then
        // committed passes it, and it is not handed out before its time.
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while n.committed().await < 2 {
            assert!(std::time::Instant::now() < until, "never parked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let f = flaky.get().expect("the park index");
        assert_eq!(
            f.parks_to_fail.load(std::sync::atomic::Ordering::Acquire),
            0,
            "both failures were met and retried"
        );
        let mut later = Vec::new();
        while later.is_empty() {
            assert!(std::time::Instant::now() < until, "never delivered");
            later = n.pull(10, 500).await;
        }
        assert!(
            meshd_stores::time::Timestamp::now().as_millis() >= due,
            "handed out before its deliverat"
        );
        assert_eq!(
            later
                .iter()
                .map(|h| (h.offset, h.attempt))
                .collect::<Vec<_>>(),
            [(0, 1)]
        );
        // The ack's settlement fails once in the journal and is retried: the entry goes.
        assert_eq!(n.ack(&[&later[0]]).await[0].0, "acked");
        let key = OffsetKey {
            subscription: "s".into(),
            incarnation: n.subs.get("s").await.unwrap().unwrap().incarnation,
            topic: "t".into(),
            partition: 0,
        };
        while n.local.parks.count(&key).await.unwrap() > 0 {
            assert!(
                std::time::Instant::now() < until,
                "the settled entry stayed"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            f.removes_to_fail.load(std::sync::atomic::Ordering::Acquire),
            0
        );
        assert!(
            n.pull(10, 300).await.is_empty(),
            "a settled event came again"
        );
    });
}
