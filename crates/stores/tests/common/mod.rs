//! # The backend harness the conformance suites share
//!
//! [`backend_cases!`] stamps out `embedded::<case>` (EmbeddedMeta on a temp dir) and
//! `etcd::<case>` (one real etcd process per test) for every case of a suite, each
//! with a fresh [`Harness`].
//!
//! "Restart" is real: the etcd process is SIGKILLed and started again on the same
//! data dir; the embedded Meta is closed and reopened on the same directory. "Meta
//! unavailable" is a killed etcd / a closed embedded Meta. Stores reach the backend
//! through [`ProxyMeta`] clients, which forward every call to the backend's current
//! client, so a store keeps its client across a backend restart (the embedded
//! backend's client is the store itself and must be reopened), as it does with etcd.
//! A `ProxyMeta` can also cut and block its watches, inject a fault into the next
//! transactions and journal transactions, as a test asks.

#![allow(dead_code)]

use async_trait::async_trait;
use futures::StreamExt;
use meshd_meta::{
    GetResponse, Lease, LeaseId, Meta, MetaError, MetaStatus, RangeOptions, RangeResponse, Txn,
    TxnResponse, WatchError, WatchStream,
};
use meshd_meta_embedded::{EmbeddedConfig, EmbeddedMeta};
use meshd_meta_etcd::{EtcdConfig, EtcdMeta};
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::wait::wait_until;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

/// Stamps out `embedded::<case>` and `etcd::<case>` for every case: each test gets a
/// fresh [`Harness`] of its backend and runs `<case>`, an async fn at the root of the
/// test file taking `&mut Harness`. With a fixture first (`backend_cases!(F; a, b)`),
/// every test also makes a fresh `F` and passes `&F` as the case's second argument.
macro_rules! backend_cases {
    (@backend $backend:ident, $fixture:tt; $($case:ident),+) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let mut h = $crate::common::Harness::$backend().await;
                    $crate::common::backend_cases!(@call $case, h, $fixture);
                }
            )+
        }
    };
    (@call $case:ident, $h:ident, ()) => {
        super::$case(&mut $h).await
    };
    (@call $case:ident, $h:ident, ($fixture:expr)) => {{
        let fixture = $fixture;
        super::$case(&mut $h, &fixture).await
    }};
    ($fixture:expr; $($case:ident),+ $(,)?) => {
        $crate::common::backend_cases!(@backend embedded, ($fixture); $($case),+);
        $crate::common::backend_cases!(@backend etcd, ($fixture); $($case),+);
    };
    ($($case:ident),+ $(,)?) => {
        $crate::common::backend_cases!(@backend embedded, (); $($case),+);
        $crate::common::backend_cases!(@backend etcd, (); $($case),+);
    };
}
pub(crate) use backend_cases;

/// What an injected transaction fault does.
#[derive(Clone, Debug)]
pub enum Fault {
    /// Fail without sending: the transaction is not applied.
    Refuse(MetaError),
    /// Apply the transaction, then lose the answer.
    ApplyThenFail(MetaError),
}

/// A shared, ordered record of what happened (to check the order of, say, body
/// appends and Meta writes).
#[derive(Clone, Default)]
pub struct Journal(Arc<Mutex<Vec<String>>>);

impl Journal {
    pub fn record(&self, what: String) {
        self.0.lock().expect("journal").push(what);
    }

    pub fn entries(&self) -> Vec<String> {
        self.0.lock().expect("journal").clone()
    }
}

/// Forwards every call to the current client of a real backend. Not a test double:
/// Meta's semantics are the backend's own; this only survives the embedded backend's
/// reopen and injects what a test asks for: (a) cut and blocked watches (to force a
/// watch restart from an old revision), (b) transaction faults (to show what a store
/// does with an unknown outcome), (c) a journal of the keys transactions put.
pub struct ProxyMeta {
    backend: meshd_meta::Backend,
    /// The backend's current client; swapped when the embedded Meta is reopened.
    inner: RwLock<Arc<dyn Meta>>,
    watches_blocked: AtomicBool,
    /// Bumped to end every open watch of this client.
    cut: tokio::sync::watch::Sender<u64>,
    /// Faults for the next transactions, in order.
    txn_faults: Mutex<VecDeque<Fault>>,
    /// When set, every transaction's puts are recorded here (see [`Journal`]).
    journal: Mutex<Option<Journal>>,
}

impl ProxyMeta {
    pub fn new(inner: Arc<dyn Meta>) -> Arc<Self> {
        Arc::new(Self {
            backend: inner.backend(),
            inner: RwLock::new(inner),
            watches_blocked: AtomicBool::new(false),
            cut: tokio::sync::watch::channel(0).0,
            txn_faults: Mutex::new(VecDeque::new()),
            journal: Mutex::new(None),
        })
    }

    fn current(&self) -> Arc<dyn Meta> {
        self.inner.read().expect("proxy lock").clone()
    }

    fn swap(&self, inner: Arc<dyn Meta>) {
        *self.inner.write().expect("proxy lock") = inner;
    }

    /// Ends this client's open watches (as a broken connection would) and refuses
    /// new ones until [`unblock_watches`](Self::unblock_watches).
    pub fn block_watches(&self) {
        self.watches_blocked.store(true, Ordering::SeqCst);
        self.cut.send_modify(|g| *g += 1);
    }

    pub fn unblock_watches(&self) {
        self.watches_blocked.store(false, Ordering::SeqCst);
    }

    /// Queues a fault for the next transaction without one.
    pub fn inject(&self, fault: Fault) {
        self.txn_faults.lock().expect("faults").push_back(fault);
    }

    /// From now on, records every key a transaction puts in `journal`.
    pub fn journal_to(&self, journal: Journal) {
        *self.journal.lock().expect("journal") = Some(journal);
    }
}

#[async_trait]
impl Meta for ProxyMeta {
    fn backend(&self) -> meshd_meta::Backend {
        self.backend
    }
    async fn get(&self, key: &[u8]) -> Result<GetResponse, MetaError> {
        self.current().get(key).await
    }
    async fn range(
        &self,
        prefix: &[u8],
        options: RangeOptions,
    ) -> Result<RangeResponse, MetaError> {
        self.current().range(prefix, options).await
    }
    async fn txn(&self, txn: Txn) -> Result<TxnResponse, MetaError> {
        let fault = self.txn_faults.lock().expect("faults").pop_front();
        if let Some(journal) = self.journal.lock().expect("journal").as_ref() {
            for op in &txn.ops {
                if let meshd_meta::TxnOp::Put { key, .. } = op {
                    journal.record(format!("meta txn put {}", String::from_utf8_lossy(key)));
                }
            }
        }
        match fault {
            None => self.current().txn(txn).await,
            Some(Fault::Refuse(e)) => Err(e),
            Some(Fault::ApplyThenFail(e)) => {
                self.current().txn(txn).await?;
                Err(e)
            }
        }
    }
    async fn grant(&self, ttl: Duration) -> Result<Lease, MetaError> {
        self.current().grant(ttl).await
    }
    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, MetaError> {
        self.current().keep_alive(lease).await
    }
    async fn revoke(&self, lease: LeaseId) -> Result<(), MetaError> {
        self.current().revoke(lease).await
    }
    async fn watch(&self, prefix: &[u8], start_revision: i64) -> Result<WatchStream, MetaError> {
        if self.watches_blocked.load(Ordering::SeqCst) {
            return Err(MetaError::Unavailable("watches blocked by the test".into()));
        }
        let mut cut = self.cut.subscribe();
        cut.borrow_and_update();
        let inner = self.current().watch(prefix, start_revision).await?;
        Ok(futures::stream::unfold(
            (inner, cut, false),
            |(mut inner, mut cut, done)| async move {
                if done {
                    return None;
                }
                tokio::select! {
                    item = inner.next() => item.map(|i| (i, (inner, cut, false))),
                    _ = cut.changed() => Some((
                        Err(WatchError::Unavailable("watch cut by the test".into())),
                        (inner, cut, true),
                    )),
                }
            },
        )
        .boxed())
    }
    async fn compact(&self, revision: i64) -> Result<(), MetaError> {
        self.current().compact(revision).await
    }
    async fn status(&self) -> Result<MetaStatus, MetaError> {
        self.current().status().await
    }
}

enum Engine {
    Embedded {
        dir: tempfile::TempDir,
        /// `None` while stopped.
        db: Option<Arc<EmbeddedMeta>>,
    },
    Etcd {
        process: Box<EtcdProcess>,
    },
}

/// One real Meta backend for one test, its clients, stop/start/restart.
pub struct Harness {
    /// "embedded" or "etcd".
    pub name: &'static str,
    engine: Engine,
    /// Every client handed out (embedded: re-pointed after a reopen).
    clients: Vec<Arc<ProxyMeta>>,
    /// The client stores are built on by default, and the test's own reads and writes.
    pub proxy: Arc<ProxyMeta>,
}

impl Harness {
    pub async fn embedded() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = Arc::new(
            EmbeddedMeta::open_dir(dir.path(), EmbeddedConfig::default()).expect("open embedded"),
        );
        Self::with(
            Engine::Embedded {
                dir,
                db: Some(db.clone()),
            },
            db,
        )
    }

    pub async fn etcd() -> Self {
        let process = EtcdProcess::start().await.expect("start etcd");
        let client = connect(&process).await;
        Self::with(
            Engine::Etcd {
                process: Box::new(process),
            },
            client,
        )
    }

    fn with(engine: Engine, client: Arc<dyn Meta>) -> Self {
        let proxy = ProxyMeta::new(client);
        Self {
            name: proxy.backend.as_str(),
            engine,
            clients: vec![proxy.clone()],
            proxy,
        }
    }

    /// The stable handle stores are built on.
    pub fn meta(&self) -> Arc<dyn Meta> {
        self.proxy.clone()
    }

    /// A new, independent client (etcd: its own connections; embedded: a client of
    /// the same store).
    pub async fn client(&mut self) -> Arc<ProxyMeta> {
        let inner: Arc<dyn Meta> = match &self.engine {
            Engine::Embedded { db, .. } => db.clone().expect("the embedded store is running"),
            Engine::Etcd { process } => connect(process).await,
        };
        let c = ProxyMeta::new(inner);
        self.clients.push(c.clone());
        c
    }

    /// Makes Meta unavailable: SIGKILL of etcd, close of the embedded store.
    pub fn stop(&mut self) {
        match &mut self.engine {
            Engine::Embedded { db, .. } => {
                if let Some(db) = db.take() {
                    db.close();
                }
            }
            Engine::Etcd { process } => process.kill(),
        }
    }

    /// Brings Meta back on the same data (the embedded store is closed first if it
    /// still runs).
    pub async fn start(&mut self) {
        match &mut self.engine {
            Engine::Embedded { dir, db } => {
                if let Some(db) = db.take() {
                    db.close();
                }
                let path = dir.path().to_path_buf();
                let reopened = wait_until(Duration::from_secs(10), "embedded reopen", || {
                    let path = path.clone();
                    async move { Ok(EmbeddedMeta::open_dir(&path, EmbeddedConfig::default())?) }
                })
                .await
                .expect("reopen embedded");
                let reopened = Arc::new(reopened);
                for c in &self.clients {
                    c.swap(reopened.clone());
                }
                *db = Some(reopened);
            }
            Engine::Etcd { process } => process.restart().await.expect("restart etcd"),
        }
    }

    pub async fn restart(&mut self) {
        self.stop();
        self.start().await;
    }

    /// Waits until Meta answers reads again.
    pub async fn wait_ready(&self) {
        let meta = self.meta();
        wait_until(Duration::from_secs(20), "meta answers", || {
            let meta = meta.clone();
            async move { Ok(meta.get(b"probe").await?) }
        })
        .await
        .expect("meta back");
    }
}

async fn connect(process: &EtcdProcess) -> Arc<dyn Meta> {
    Arc::new(
        EtcdMeta::connect(EtcdConfig::new([process.endpoint()]))
            .await
            .expect("connect"),
    )
}

/// Creates topic `name` (if it is not there yet) through a `MetaTopicStore` on `meta`:
/// subscriptions can only be written on an existing topic.
pub async fn ensure_topic(meta: Arc<dyn Meta>, name: &str, partitions: u32) {
    use meshd_stores::topics::{MetaTopicStore, TopicStore};
    let topics = MetaTopicStore::start(meta)
        .await
        .expect("start the topic store");
    topics
        .ensure(name, partitions)
        .await
        .unwrap_or_else(|e| panic!("ensure topic {name}: {e}"));
}
