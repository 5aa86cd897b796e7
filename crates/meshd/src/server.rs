//! `meshd serve`: opening the stores, recovering, starting the background work and
//! serving HTTP until a graceful stop.
//!
//! [`run`] opens the Local RocksDB (exclusively) and its stores (log, offsets,
//! deliveries), Meta (embedded on that RocksDB, or etcd) and, in cluster mode, the
//! JetStream log; recovers every subscription's partitions before `/readyz` says
//! ready; starts membership, ownership (cluster mode), requeue, compaction and
//! housekeeping; serves the public API, `/internal` and the probes; and on SIGTERM
//! answers long polls, releases owned partitions, revokes the membership lease,
//! flushes and closes the stores.

use crate::config::{Config, LogBackend, MetaBackend};
use crate::metered::MeteredMeta;
use anyhow::Context;
use meshd_local::RocksEngine;
use meshd_meta::{Backend, Meta};
use meshd_meta_embedded::{EmbeddedConfig, EmbeddedMeta};
use meshd_meta_etcd::EtcdMeta;
use meshd_runtime::metrics::Metrics;
use meshd_runtime::runtime::{Deps, Runtime};
use meshd_stores::deadletters::{DeadLetterStore, MetaDeadLetterStore};
use meshd_stores::delivery::DeliveryStateStore;
use meshd_stores::log::PartitionLog;
use meshd_stores::sessions::{MetaSessionStore, SessionStoreConfig};
use meshd_stores::subscriptions::{MetaSubscriptionStore, SubscriptionStoreConfig};
use meshd_stores::time::Timestamp;
use meshd_stores::topics::MetaTopicStore;
use meshd_stores_local::LocalStores;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long boot waits for the Meta caches before serving anyway (not ready).
const CACHE_LOAD_WAIT: Duration = Duration::from_secs(5);

/// How often log retention and dead-letter expiry run.
const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(60);

/// Runs meshd as the binary does: listens on `config.listen` once recovery is done and
/// stops gracefully at SIGTERM or ^C.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let listen = Listen::Bind(config.listen);
    boot(config, listen, Box::pin(shutdown_signal())).await
}

/// Runs meshd on `listener` (already bound, e.g. to port 0 by an embedding program or
/// a test) until `shutdown` completes, then stops gracefully (http-api.md, "Graceful
/// stop"): long polls answered, partitions released, the lease revoked, every
/// background task ended, delivery state flushed and the stores closed. When it
/// returns, the data directory is unlocked: another `serve` may open it.
pub async fn serve(
    listener: tokio::net::TcpListener,
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    boot(config, Listen::Bound(listener), Box::pin(shutdown)).await
}

/// Where the API is served: an address bound once the stores are recovered (so
/// clients are refused, not left hanging, during recovery), or a listener bound by
/// the caller.
enum Listen {
    Bind(std::net::SocketAddr),
    Bound(tokio::net::TcpListener),
}

/// The phases of an instance's life, in order, after [`Config::resolve`] has read and
/// validated the config: [`Preflight::load`], [`Stores::open`], [`start`] (recovery
/// and the background work), [`Started::serve`] and [`Stop::run`].
async fn boot(
    config: Config,
    listen: Listen,
    shutdown: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
) -> anyhow::Result<()> {
    warn_of_test_controls();
    let preflight = Preflight::load(&config).await?;
    let stores = Stores::open(&config).await?;
    let started = start(&config, &preflight, stores).await?;
    let listener = match listen {
        Listen::Bound(l) => l,
        Listen::Bind(at) => tokio::net::TcpListener::bind(at)
            .await
            .with_context(|| format!("cannot listen on {at}"))?,
    };
    let stop = started
        .serve(&config, preflight, listener, shutdown)
        .await?;
    stop.run().await;
    Ok(())
}

/// A debug build run as a test's positive control says so loudly: it breaks a
/// guarantee on purpose.
fn warn_of_test_controls() {
    if meshd_meta::fence::unfenced_for_tests() {
        tracing::error!(
            store = "owners",
            variable = meshd_meta::fence::UNFENCED_VAR,
            "FENCING IS OFF: this debug build runs as the fencing tests' positive control; a stale owner's writes are applied"
        );
    }
    if meshd_local::no_sync_for_tests() {
        tracing::error!(
            store = "local",
            backend = "rocksdb",
            variable = meshd_local::NO_SYNC_VAR,
            "SYNCS ARE OFF: this debug build runs as the power-cut tests' positive control; a power cut loses what was answered as durable"
        );
    }
}

/// Phase 1, before anything is opened: the files whose mistakes must not cost a
/// boot's worth of recovery (token files, certificates, CAs), and the address rules
/// push connects under.
struct Preflight {
    access: Option<Arc<crate::access::Access>>,
    tls: Option<Arc<crate::listen::ServerTls>>,
    push_tls: Option<tokio_rustls::TlsConnector>,
    push_egress: Arc<meshd_runtime::egress::Egress>,
    /// Cluster mode with TLS: how instances call each other.
    peer_tls: Option<tokio_rustls::TlsConnector>,
}

impl Preflight {
    async fn load(config: &Config) -> anyhow::Result<Self> {
        let access = crate::access::Access::load(crate::access::TokenFiles {
            client: config.client_token_file.clone(),
            admin: config.admin_token_file.clone(),
            metrics: config.metrics_token_file.clone(),
        })?
        .map(Arc::new);
        let tls = match (&config.tls_cert, &config.tls_key) {
            (Some(cert), Some(key)) => Some(Arc::new(crate::listen::ServerTls::load(cert, key)?)),
            _ => None,
        };
        // `https://` push URLs: the CA of --push-ca-file (an error stops start-up),
        // else the system's bundle (without one, https pushes fail naming the flag).
        let push_tls = match &config.push_ca_file {
            Some(f) => Some(
                meshd_client::tls::connector(Some(f))
                    .map_err(|e| anyhow::anyhow!("--push-ca-file: {e}"))?,
            ),
            None => meshd_client::tls::connector(None)
                .inspect_err(|e| tracing::warn!(error = %e, "no system CA bundle: https push URLs need --push-ca-file"))
                .ok(),
        };
        // Where push may connect: never meshd's own services (the listen address is
        // added once bound), link-local ranges or operator-denied ranges
        // (meshd_runtime::egress).
        let push_egress = Arc::new(meshd_runtime::egress::Egress::new(
            config.push_deny_cidr.clone(),
            config.push_allow_cidr.clone(),
        ));
        if let MetaBackend::Etcd(etcd) = &config.meta {
            push_egress
                .add_own_named("Meta (etcd)", &etcd.endpoints)
                .await;
        }
        if let LogBackend::Nats(nats) = &config.log {
            push_egress
                .add_own_named("the log (NATS)", &nats.servers)
                .await;
        }
        if let Some(a) = &config.advertise {
            push_egress
                .add_own_named("meshd's advertise address", std::slice::from_ref(a))
                .await;
        }
        // Instances that serve HTTPS call each other over HTTPS too.
        let peer_tls = match (&tls, config.log.is_cluster()) {
            (Some(_), true) => Some(
                meshd_client::tls::connector(config.cluster_ca_file.as_deref())
                    .map_err(|e| anyhow::anyhow!("--cluster-ca-file: {e}"))?,
            ),
            _ => None,
        };
        Ok(Self {
            access,
            tls,
            push_tls,
            push_egress,
            peer_tls,
        })
    }
}

/// Phase 2: the stores, open and recovered: the Local RocksDB (partition heads,
/// committed offsets), Meta (the embedded one's lease deadlines; etcd connects lazily,
/// so meshd starts while etcd is down and reports not ready), the Meta caches (loaded,
/// or given up on after a bounded wait), and the log.
struct Stores {
    instance_id: String,
    data_dir: std::path::PathBuf,
    /// Tells when the Local engine has closed (the last step of a stop).
    engine_closed: meshd_local::Closed,
    /// The Local engine, for its upkeep (never keeps it open).
    engine: std::sync::Weak<RocksEngine>,
    local: Arc<LocalStores>,
    embedded: Option<Arc<EmbeddedMeta>>,
    meta: Arc<MeteredMeta>,
    topics: Arc<MetaTopicStore>,
    subscriptions: Arc<MetaSubscriptionStore>,
    sessions: Arc<MetaSessionStore>,
    /// Whether the topic and subscription caches loaded within [`CACHE_LOAD_WAIT`].
    caches_loaded: bool,
    log: Arc<dyn PartitionLog>,
    log_backend: Backend,
    parks: Arc<dyn meshd_stores::park::ParkIndex>,
    deadletters: Arc<dyn DeadLetterStore>,
    tasks: Arc<dyn meshd_stores::tasks::TaskStore>,
}

impl Stores {
    async fn open(config: &Config) -> anyhow::Result<Self> {
        std::fs::create_dir_all(&config.data_dir)
            .with_context(|| format!("cannot create data dir {}", config.data_dir.display()))?;
        let engine = Arc::new(
            RocksEngine::open_with(
                &config.data_dir,
                meshd_stores_local::keys::COLUMN_FAMILIES,
                config.wal_recovery,
            )
            .map_err(|e| {
                let corrupt = matches!(e, meshd_local::LocalError::OpenCorrupt { .. });
                let e = anyhow::Error::new(e);
                if corrupt {
                    e.context(format!(
                        "the write-ahead log in {} is damaged and meshd does not drop acknowledged writes in silence: restore the data dir, or, if this follows a power loss (an unsynced tail torn), start once with --wal-recovery point-in-time to open it up to the damage (everything after it is dropped)",
                        config.data_dir.display()
                    ))
                } else {
                    e
                }
            })?,
        );
        let engine_closed = engine.closed();
        let engine_weak = Arc::downgrade(&engine);
        let instance_id = match &config.instance_id {
            Some(id) => id.clone(),
            None => stable_instance_id(&config.data_dir)?,
        };
        // Recovery of the Local stores (partition heads, committed offsets) runs here,
        // before anything is served. The embedded log's id is the instance id.
        let local = LocalStores::open(
            engine.clone(),
            &instance_id,
            Duration::from_millis(config.delivery_flush_ms),
        )?;
        local
            .log
            .set_max_dedup_entries(usize::try_from(config.max_dedup_entries).unwrap_or(usize::MAX));
        let mut embedded = None;
        let meta: Arc<dyn Meta> = match config.etcd_connection()? {
            None => {
                // Recovery (state record, lease deadlines) runs inside open.
                let m = Arc::new(EmbeddedMeta::open(engine, EmbeddedConfig::default())?);
                embedded = Some(m.clone());
                m
            }
            Some(etcd) => Arc::new(EtcdMeta::connect(etcd).await?),
        };
        let meta = Arc::new(MeteredMeta::new(meta));
        // In cluster mode the bodies live in the shared log, where another instance
        // may have appended a body it has not referenced yet: no collection there.
        if !config.log.is_cluster() {
            collect_orphan_bodies(meta.clone(), &local).await;
        }
        let topics = Arc::new(
            MetaTopicStore::start(meta.clone())
                .await
                .map_err(|e| anyhow::anyhow!("starting the topic store: {e}"))?,
        );
        let subscriptions = Arc::new(
            MetaSubscriptionStore::start(meta.clone(), SubscriptionStoreConfig::default())
                .map_err(|e| anyhow::anyhow!("starting the subscription store: {e}"))?,
        );
        let sessions = Arc::new(
            MetaSessionStore::start(meta.clone(), SessionStoreConfig::new(instance_id.clone()))
                .map_err(|e| anyhow::anyhow!("starting the session store: {e}"))?,
        );
        // Boot waits (bounded) for the caches to load, so a started instance is ready
        // at once when Meta answers; with Meta down it serves and reports not ready.
        let caches_loaded = topics.wait_ready(CACHE_LOAD_WAIT).await
            && subscriptions.wait_ready(CACHE_LOAD_WAIT).await;
        if !caches_loaded {
            tracing::warn!(
                meta = %meta.backend(),
                "topic/subscription caches not loaded yet (Meta unreachable?); serving, not ready"
            );
        }
        let local = Arc::new(local);
        // The log (and the dead-letter bodies): this instance's RocksDB, or a
        // JetStream shared by the instances of a cluster.
        // The park index: the Local one, and in cluster mode its journal on the
        // JetStream beside the log, so that it moves with its partition.
        let (log, bodies, log_backend, parks): LogParts = match config.nats_connection()? {
            None => {
                let l = Arc::new(local.log.clone());
                let parks = Arc::new(local.parks.clone());
                (l.clone(), l, Backend::RocksDb, parks)
            }
            Some(nats) => {
                let servers = nats.servers.join(",");
                let l = Arc::new(meshd_log_nats::NatsLog::connect(nats).await.map_err(|e| {
                    anyhow::anyhow!("cannot open the JetStream log at {servers}: {e}")
                })?);
                let parks = Arc::new(meshd_stores_local::park::JournaledParks::new(
                    local.parks.clone(),
                    l.clone(),
                ));
                (l.clone(), l, Backend::Nats, parks)
            }
        };
        let deadletters: Arc<dyn DeadLetterStore> =
            Arc::new(MetaDeadLetterStore::new(meta.clone(), bodies));
        let tasks: Arc<dyn meshd_stores::tasks::TaskStore> = Arc::new(
            meshd_stores::tasks::MetaTaskStore::new(
                meta.clone(),
                meshd_stores::tasks::TaskStoreConfig::default(),
            )
            .map_err(|e| anyhow::anyhow!("starting the task store: {e}"))?,
        );
        Ok(Self {
            instance_id,
            data_dir: config.data_dir.clone(),
            engine_closed,
            engine: engine_weak,
            local,
            embedded,
            meta,
            topics,
            subscriptions,
            sessions,
            caches_loaded,
            log,
            log_backend,
            parks,
            deadletters,
            tasks,
        })
    }
}

/// The log, where dead-letter bodies go, the log's backend, and the park index.
type LogParts = (
    Arc<dyn PartitionLog>,
    Arc<dyn meshd_stores::log::DeadLetterBodies>,
    Backend,
    Arc<dyn meshd_stores::park::ParkIndex>,
);

/// What a started instance holds between phases.
struct Started {
    stores: Stores,
    background: meshd_runtime::background::Background,
    runtime: Arc<Runtime>,
    metrics: Arc<Metrics>,
    cluster_secret: Option<String>,
    /// Cluster mode: where the ownership controller publishes what it owns.
    owned_tx: tokio::sync::watch::Sender<meshd_runtime::cluster::ownership::Owned>,
    directory_tx: tokio::sync::watch::Sender<Arc<meshd_runtime::cluster::ownership::Directory>>,
}

/// Phase 3: the runtime recovered (every subscription's partitions re-armed before
/// `/readyz` says ready; boot waits for it, bounded like the caches, so an instance
/// whose stores answer is ready once it prints its start-up line) and the background
/// work started (housekeeping, the task requeuer).
async fn start(config: &Config, preflight: &Preflight, stores: Stores) -> anyhow::Result<Started> {
    let background = meshd_runtime::background::Background::new();
    let meta_backend = stores.meta.backend();
    let (owned_tx, owned_rx) =
        tokio::sync::watch::channel(meshd_runtime::cluster::ownership::Owned::default());
    let (directory_tx, directory_rx) = tokio::sync::watch::channel(Arc::new(
        meshd_runtime::cluster::ownership::Directory::default(),
    ));
    let cluster_secret = match config.log.is_cluster() {
        true => Some(
            meshd_runtime::cluster::forward::load_secret(
                config.cluster_secret_file.as_deref(),
                stores.meta.as_ref(),
            )
            .await?,
        ),
        false => None,
    };
    let cluster = match &cluster_secret {
        Some(secret) => Some(meshd_runtime::runtime::ClusterDeps {
            owned: owned_rx,
            directory: directory_rx,
            peers: meshd_runtime::cluster::forward::Peers::new(secret, preflight.peer_tls.clone())?,
            ledger: Arc::new(meshd_stores::attempts::MetaAttemptLedger::new(
                stores.meta.clone(),
            )),
            checkpoint_every: Duration::from_millis(config.checkpoint_ms),
        }),
        None => None,
    };
    let metrics = Arc::new(Metrics::default());
    let runtime = Runtime::new(Deps {
        instance_id: stores.instance_id.clone(),
        meta: stores.meta.clone(),
        meta_backend,
        log: stores.log.clone(),
        log_backend: stores.log_backend,
        offsets: Arc::new(stores.local.offsets.clone()),
        deliveries: Arc::new(stores.local.deliveries.clone()),
        parks: stores.parks.clone(),
        deadletters: stores.deadletters.clone(),
        sessions: stores.sessions.clone(),
        topics: stores.topics.clone(),
        subscriptions: stores.subscriptions.clone(),
        max_in_flight: config.max_in_flight as usize,
        park_retries_after_ms: config.park_retries_after_ms,
        id_key: match &cluster_secret {
            Some(secret) => meshd_dispatch::IdKey::from_secret(secret.as_bytes()),
            None => meshd_dispatch::IdKey::random(),
        },
        metrics: metrics.clone(),
        cluster,
        push_tls: preflight.push_tls.clone(),
        push_egress: preflight.push_egress.clone(),
        background: background.clone(),
    });
    runtime.start();
    if stores.caches_loaded {
        let until = tokio::time::Instant::now() + CACHE_LOAD_WAIT;
        while !runtime.is_recovered() && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // The Local log's publish dedup index loads on its own thread next to the
    // recovery above; a damaged record stops the start, as it did when the log's open
    // loaded it.
    stores
        .local
        .log
        .dedup_loaded()
        .await
        .map_err(|e| anyhow::anyhow!("loading the publish dedup index of the Local log: {e}"))?;
    spawn_quiet_flushes(&background, stores.engine.clone(), metrics.clone());
    spawn_housekeeping(
        &background,
        config,
        stores.log.clone(),
        stores.log_backend,
        stores.deadletters.clone(),
        stores.tasks.clone(),
    );
    meshd_runtime::requeue::spawn(
        &background,
        stores.tasks.clone(),
        stores.sessions.clone(),
        stores.sessions.changes(),
        metrics.clone(),
        meta_backend,
    );
    Ok(Started {
        stores,
        background,
        runtime,
        metrics,
        cluster_secret,
        owned_tx,
        directory_tx,
    })
}

impl Started {
    /// Phase 4: serves the API, `/internal` and the probes on `listener`, with
    /// membership and (cluster mode) partition ownership running, until `shutdown`;
    /// then answers long polls, refuses new connections, releases the partitions and
    /// gives open connections their grace. What is left to do is the [`Stop`].
    async fn serve(
        self,
        config: &Config,
        preflight: Preflight,
        listener: tokio::net::TcpListener,
        shutdown: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    ) -> anyhow::Result<Stop> {
        let Started {
            stores,
            background,
            runtime,
            metrics,
            cluster_secret,
            owned_tx,
            directory_tx,
        } = self;
        let Preflight {
            access,
            tls,
            push_egress,
            ..
        } = preflight;
        let addr = listener.local_addr()?;
        push_egress.add_own("meshd's listen address", [addr]);
        announce(config, &stores, addr, tls.is_some())?;
        let membership = membership(config, &stores, addr);
        let lease = membership.lease();
        let front = Front::open(config, addr, access.clone(), cluster_secret, tls.is_some());
        let api = build_api(config, &stores, &runtime, &metrics, front.admission.clone())?;
        let compaction = start_compaction(config, &stores, &background, &metrics);
        let status = build_status(config, &stores, &api, &front, compaction, &lease);
        // A graceful stop (SIGTERM, ^C): `stopping` ends long polls and makes the
        // ownership controller release every partition; `leaving` then revokes the
        // membership lease (http-api.md, "Graceful stop").
        let (stopping_tx, stopping_rx) = tokio::sync::watch::channel(false);
        let (leaving_tx, leaving_rx) = tokio::sync::watch::channel(false);
        let membership_task = membership.spawn(&background, leaving_rx);
        let controller_task = if config.log.is_cluster() {
            let channels = (owned_tx, directory_tx);
            let controller = ownership_controller(
                config,
                &stores,
                &runtime,
                &metrics,
                lease,
                channels,
                stopping_rx,
            );
            Some(controller.spawn(&background))
        } else {
            None
        };
        let app = crate::routes::app(
            api,
            status,
            crate::routes::Layers {
                gate: front.gate,
                admission: front.admission,
                http_requests: front.http_requests,
            },
        );
        spawn_reload_on_hangup(&background, access, tls.clone(), front.http.clone());
        // This handle on the runtime moves into `stopping`, which begins its stop.
        let stopping = stop_on(shutdown, runtime, stopping_tx);
        crate::listen::serve(
            listener,
            tls,
            app,
            crate::listen::Limits {
                max_connections: config.max_connections as usize,
                header_timeout: Duration::from_millis(config.header_timeout_ms),
                idle_timeout: Duration::from_millis(config.idle_timeout_ms),
            },
            front.http,
            stopping,
        )
        .await;
        Ok(Stop {
            stores,
            background,
            controller_task,
            leaving_tx,
            membership_task,
        })
    }
}

/// Serve step: the one start-up line (address, instance, effective backend of every
/// store) on stdout, and its log record.
fn announce(
    config: &Config,
    stores: &Stores,
    addr: std::net::SocketAddr,
    https: bool,
) -> anyhow::Result<()> {
    let meta_backend = stores.meta.backend();
    let instance_id = &stores.instance_id;
    let scheme = if https { "https" } else { "http" };
    {
        let mut out = std::io::stdout().lock();
        writeln!(
            out,
            "meshd listening on {scheme}://{addr} instance={instance_id} meta={meta_backend} log={} local=rocksdb:{}",
            if stores.log_backend == Backend::Nats { "nats" } else { "embedded" },
            config.data_dir.display()
        )?;
        out.flush()?;
    }
    tracing::info!(%addr, scheme, instance = %instance_id, meta = %meta_backend, data_dir = %config.data_dir.display(), "meshd serving");
    Ok(())
}

/// Serve step: this instance's membership (spawned once the API is wired), with the
/// address the other instances dial: --advertise, else the listen address (config
/// refuses an unspecified listen address without --advertise in cluster mode).
fn membership(
    config: &Config,
    stores: &Stores,
    addr: std::net::SocketAddr,
) -> meshd_runtime::membership::Membership {
    let advertised = config.advertise.clone().unwrap_or_else(|| addr.to_string());
    meshd_runtime::membership::Membership::new(
        stores.meta.clone(),
        stores.instance_id.clone(),
        advertised,
        Duration::from_millis(config.lease_ttl_ms),
    )
}

/// The membership lease, as the ownership controller and `/readyz` watch it.
type Lease = tokio::sync::watch::Receiver<Option<meshd_runtime::membership::LeaseState>>;

/// What stands between a request and the API: admission (request slots, body memory,
/// long polls), the gate (tokens, the cluster secret, browser rules) and the HTTP
/// counters.
struct Front {
    admission: Arc<crate::admission::Admission>,
    gate: Arc<crate::access::Gate>,
    /// Connections and reloads (the listener's).
    http: Arc<crate::listen::HttpCounters>,
    /// Requests by route (the router's).
    http_requests: Arc<crate::http_metrics::HttpMetrics>,
}

impl Front {
    /// Serve step: admission and the gate, from the config.
    fn open(
        config: &Config,
        addr: std::net::SocketAddr,
        access: Option<Arc<crate::access::Access>>,
        cluster_secret: Option<String>,
        https: bool,
    ) -> Self {
        let admission = Arc::new(crate::admission::Admission::new(
            crate::admission::AdmissionConfig {
                max_requests: config.max_requests as usize,
                body_budget: config.max_body_memory as usize,
                body_timeout: Duration::from_millis(config.body_timeout_ms),
                max_long_polls: config.max_long_polls as usize,
                max_wait: Duration::from_millis(config.idle_timeout_ms.saturating_sub(500)),
                max_streams_per_token: (config.max_streams_per_token > 0)
                    .then_some(config.max_streams_per_token as usize),
            },
        ));
        // The DNS-rebinding Host check guards the one mode a browser page can reach
        // without credentials: loopback, no client or admin tokens, no
        // --insecure-listen.
        let host_check = addr.ip().is_loopback()
            && config.client_token_file.is_none()
            && config.admin_token_file.is_none()
            && !config.insecure_listen;
        let gate = Arc::new(crate::access::Gate::new(
            access,
            cluster_secret,
            crate::browser::BrowserRules::new(
                config.allowed_origins.clone(),
                config.allowed_hosts.clone(),
                host_check,
                https,
            ),
        ));
        Front {
            admission,
            gate,
            http: Arc::new(crate::listen::HttpCounters::default()),
            http_requests: Arc::new(crate::http_metrics::HttpMetrics::default()),
        }
    }
}

/// Serve step: the API's handlers' state, with the quotas (whose task watch starts
/// here).
fn build_api(
    config: &Config,
    stores: &Stores,
    runtime: &Arc<Runtime>,
    metrics: &Arc<Metrics>,
    admission: Arc<crate::admission::Admission>,
) -> anyhow::Result<Arc<crate::api::Api>> {
    let quotas = Arc::new(crate::quota::Quotas::new(
        config.limits(),
        stores.topics.clone(),
        stores.subscriptions.clone(),
        stores.sessions.clone(),
        meshd_stores::tasks::usage::TaskUsageWatch::start(stores.meta.clone())
            .context("starting the task quota watch")?,
    ));
    Ok(Arc::new(crate::api::Api {
        topics: stores.topics.clone(),
        subscriptions: stores.subscriptions.clone(),
        log: stores.log.clone(),
        log_backend: stores.log_backend,
        meta_backend: stores.meta.backend(),
        runtime: runtime.clone(),
        deadletters: stores.deadletters.clone(),
        sessions: stores.sessions.clone(),
        metrics: metrics.clone(),
        meta: stores.meta.clone(),
        instance_id: stores.instance_id.clone(),
        tasks: stores.tasks.clone(),
        admission,
        limits: config.limits(),
        quotas,
        idle_timeout: Duration::from_millis(config.idle_timeout_ms),
        log_retention_ms: config.retention().max_age_ms,
    }))
}

/// Serve step: the compaction of Meta's history, in the background (nothing with
/// `--meta-compaction-retention 0`); its counters go to `/metrics`.
fn start_compaction(
    config: &Config,
    stores: &Stores,
    background: &meshd_runtime::background::Background,
    metrics: &Arc<Metrics>,
) -> Arc<meshd_runtime::compaction::CompactionCounters> {
    let compaction = Arc::new(meshd_runtime::compaction::CompactionCounters::default());
    meshd_runtime::compaction::spawn(
        background,
        stores.meta.clone(),
        config.meta_compaction_retention,
        config.meta_compaction_check_ms.map(Duration::from_millis),
        compaction.clone(),
        metrics.clone(),
    );
    compaction
}

/// Serve step: what the probes, `/metrics` and `/v1/cluster` read.
fn build_status(
    config: &Config,
    stores: &Stores,
    api: &Arc<crate::api::Api>,
    front: &Front,
    compaction: Arc<meshd_runtime::compaction::CompactionCounters>,
    lease: &Lease,
) -> Arc<crate::status::Status> {
    Arc::new(crate::status::Status {
        http_requests: front.http_requests.clone(),
        api: api.clone(),
        sessions: stores.sessions.clone(),
        cluster_lease: config.log.is_cluster().then(|| lease.clone()),
        meta_probe: crate::status::MetaProbe::new(
            stores.meta.clone(),
            matches!(config.meta, MetaBackend::Etcd(_)),
        ),
        local: stores.local.clone(),
        gate: front.gate.clone(),
        http: front.http.clone(),
        compaction,
        compaction_retention: config.meta_compaction_retention,
    })
}

/// Serve step, cluster mode: partitions are owned under the membership lease. The
/// controller publishes what it owns on `channels` (the runtime routes by them) and
/// releases every partition when `stop` turns true.
fn ownership_controller(
    config: &Config,
    stores: &Stores,
    runtime: &Arc<Runtime>,
    metrics: &Arc<Metrics>,
    lease: Lease,
    channels: OwnershipChannels,
    stop: tokio::sync::watch::Receiver<bool>,
) -> meshd_runtime::cluster::ownership::Controller {
    metrics
        .ownership
        .cluster
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let (owned, directory) = channels;
    meshd_runtime::cluster::ownership::Controller {
        meta: stores.meta.clone(),
        me: stores.instance_id.clone(),
        lease,
        topics: stores.topics.clone(),
        drain: Arc::new(meshd_runtime::runtime::handover::RuntimeDrain(
            Arc::downgrade(runtime),
        )),
        owned,
        directory,
        metrics: metrics.clone(),
        waiting_since: Default::default(),
        rebalance_delay: Duration::from_millis(config.rebalance_delay_ms),
        member_since: Default::default(),
        tick: (Duration::from_millis(config.lease_ttl_ms) / 10).max(Duration::from_millis(100)),
        stop,
    }
}

/// Where the ownership controller publishes what it owns, and the directory of owners.
type OwnershipChannels = (
    tokio::sync::watch::Sender<meshd_runtime::cluster::ownership::Owned>,
    tokio::sync::watch::Sender<Arc<meshd_runtime::cluster::ownership::Directory>>,
);

/// Serve step: the future that ends serving. When `shutdown` completes, the runtime
/// ends its long polls and streams and `stopping` turns true (the controller then
/// releases the partitions).
async fn stop_on(
    shutdown: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    runtime: Arc<Runtime>,
    stopping: tokio::sync::watch::Sender<bool>,
) {
    shutdown.await;
    tracing::info!(
        "meshd stopping: new connections refused, long polls answered, partitions released"
    );
    runtime.begin_stop();
    stopping.send_replace(true);
}

/// How long a graceful stop waits for the partitions to be released.
const RELEASE_WITHIN: Duration = Duration::from_secs(20);

/// How long a graceful stop waits for the membership lease to be revoked.
const LEAVE_WITHIN: Duration = Duration::from_secs(5);

/// How long a graceful stop waits for the background tasks to end once cancelled
/// (they end at their next `await`; a store call in a blocking thread finishes first).
const BACKGROUND_STOP_WITHIN: Duration = Duration::from_secs(10);

/// How long a graceful stop waits for the Local engine to close once everything that
/// used it has ended.
const CLOSE_WITHIN: Duration = Duration::from_secs(10);

/// Phase 5, after the listener has stopped: what a graceful stop does last.
struct Stop {
    stores: Stores,
    background: meshd_runtime::background::Background,
    controller_task: Option<tokio::task::JoinHandle<()>>,
    leaving_tx: tokio::sync::watch::Sender<bool>,
    membership_task: tokio::task::JoinHandle<()>,
}

impl Stop {
    /// Waits for the partitions' release (it ran while the last requests finished),
    /// revokes the membership lease, ends every background task, flushes the delivery
    /// state and closes the stores, the Local engine last.
    async fn run(self) {
        let Stop {
            stores,
            background,
            controller_task,
            leaving_tx,
            membership_task,
        } = self;
        if let Some(task) = controller_task {
            if tokio::time::timeout(RELEASE_WITHIN, task).await.is_err() {
                tracing::warn!(store = "owners", "releasing the partitions took longer than {RELEASE_WITHIN:?}; the membership lease ends the rest");
            }
        }
        leaving_tx.send_replace(true);
        if tokio::time::timeout(LEAVE_WITHIN, membership_task)
            .await
            .is_err()
        {
            tracing::warn!(
                store = "members",
                "leaving the cluster took longer than {LEAVE_WITHIN:?}"
            );
        }
        // A retention pass or dedup sweep on the blocking pool is not cancelled with
        // its task: it stops before its next batch, so it does not hold the engine open.
        stores.local.log.stop_housekeeping();
        if let Err(running) = background.stop(BACKGROUND_STOP_WITHIN).await {
            tracing::warn!(
                tasks = running,
                "background tasks still running {BACKGROUND_STOP_WITHIN:?} after the stop; closing the stores under them"
            );
        }
        tracing::info!("meshd shutting down: flushing delivery state");
        if let Err(e) = stores.local.deliveries.flush().await {
            tracing::error!(store = "deliveries", backend = "rocksdb", error = %e, "final flush failed");
        }
        if let Some(m) = &stores.embedded {
            m.close();
        }
        let closed = stores.engine_closed.clone();
        let data_dir = stores.data_dir.clone();
        drop(stores);
        let is_closed = tokio::task::spawn_blocking(move || closed.wait(CLOSE_WITHIN))
            .await
            .unwrap_or(false);
        if is_closed {
            tracing::info!(store = "local", backend = "rocksdb", data_dir = %data_dir.display(), "stores closed");
        } else {
            tracing::warn!(store = "local", backend = "rocksdb", data_dir = %data_dir.display(), "the Local engine is still in use {CLOSE_WITHIN:?} after the stop; it closes when the process ends");
        }
    }
}

/// Boot step: a crash between appending a dead-letter body and creating its entry
/// leaves an unreferenced body; collect those before anything can dead-letter. With
/// Meta unreachable this is skipped (and retried at the next boot): an orphan costs
/// disk, never correctness.
async fn collect_orphan_bodies(meta: Arc<MeteredMeta>, local: &LocalStores) {
    let store = MetaDeadLetterStore::new(meta, Arc::new(local.log.clone()));
    match tokio::time::timeout(Duration::from_secs(10), store.collect_orphan_bodies()).await {
        Ok(Ok(0)) => {}
        Ok(Ok(n)) => {
            tracing::info!(
                store = "deadletters",
                backend = "rocksdb",
                bodies = n,
                "collected orphan dead-letter bodies"
            )
        }
        Ok(Err(e)) => {
            tracing::warn!(store = "deadletters", error = %e, "orphan dead-letter bodies not collected; retried at the next boot")
        }
        Err(_) => {
            tracing::warn!(
                store = "deadletters",
                "orphan dead-letter body collection timed out; retried at the next boot"
            )
        }
    }
}

/// Log retention, dead-letter and task expiry, in the background.
/// How often the Local engine's quiet column families are flushed
/// ([`RocksEngine::flush_quiet`]), and below what memtable size a column family still
/// being written counts as quiet. This bounds the write-ahead log a first start after
/// a crash replays to about the memtables of the busy column families.
const QUIET_FLUSH_EVERY: Duration = Duration::from_secs(10);
const QUIET_MEMTABLE_BYTES: u64 = 8 << 20;

fn spawn_quiet_flushes(
    background: &meshd_runtime::background::Background,
    engine: std::sync::Weak<RocksEngine>,
    metrics: Arc<Metrics>,
) {
    background.spawn(async move {
        let mut every = tokio::time::interval(QUIET_FLUSH_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        every.tick().await;
        loop {
            every.tick().await;
            let engine = engine.clone();
            let flushed = tokio::task::spawn_blocking(move || {
                engine.upgrade().map(|e| e.flush_quiet(QUIET_MEMTABLE_BYTES))
            })
            .await;
            match flushed {
                Ok(Some(Ok(cfs))) => {
                    metrics.quiet_flushes(cfs.len() as u64);
                    if !cfs.is_empty() {
                        tracing::debug!(store = "local", backend = "rocksdb", column_families = ?cfs, "flushed quiet column families");
                    }
                }
                Ok(Some(Err(e))) => {
                    tracing::warn!(store = "local", backend = "rocksdb", error = %e, "flushing quiet column families failed; the write-ahead log a restart replays may grow");
                }
                // The engine closed (a stop), or the task was cancelled.
                Ok(None) | Err(_) => return,
            }
        }
    });
}

fn spawn_housekeeping(
    background: &meshd_runtime::background::Background,
    config: &Config,
    log: Arc<dyn PartitionLog>,
    log_backend: Backend,
    deadletters: Arc<dyn DeadLetterStore>,
    tasks: Arc<dyn meshd_stores::tasks::TaskStore>,
) {
    let retention = config.retention();
    let keep_dead = Duration::from_secs(config.deadletter_retention_hours.saturating_mul(3600));
    let keep_tasks = Duration::from_secs(config.task_retention_hours.saturating_mul(3600));
    background.spawn(async move {
        let mut every = tokio::time::interval(HOUSEKEEPING_EVERY);
        loop {
            every.tick().await;
            let now = u64::try_from(Timestamp::now().as_millis()).unwrap_or(0);
            match log.enforce_retention(retention, now).await {
                Ok(r) if r.events_removed > 0 => {
                    tracing::info!(
                        store = "log",
                        backend = %log_backend,
                        events = r.events_removed,
                        bytes = r.bytes_removed,
                        "log retention removed events"
                    )
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(store = "log", backend = %log_backend, error = %e, "log retention failed")
                }
            }
            match deadletters.expire(keep_dead).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(store = "deadletters", entries = n, "expired dead letters"),
                Err(e) => {
                    tracing::warn!(store = "deadletters", error = %e, "dead-letter expiry failed")
                }
            }
            match tasks.expire_terminal(keep_tasks).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(store = "tasks", tasks = n, "expired terminal tasks"),
                Err(e) => tracing::warn!(store = "tasks", error = %e, "task expiry failed"),
            }
        }
    });
}

/// On every SIGHUP: reads the token files and the TLS certificate again. What fails
/// to load is reported (log and `meshd_config_reloads_total{outcome="failed"}`) and
/// the settings in force stay.
fn spawn_reload_on_hangup(
    background: &meshd_runtime::background::Background,
    access: Option<Arc<crate::access::Access>>,
    tls: Option<Arc<crate::listen::ServerTls>>,
    counters: Arc<crate::listen::HttpCounters>,
) {
    use std::sync::atomic::Ordering;
    // Installed even with nothing to reload: SIGHUP's default action would end the
    // process (a closed terminal, a careless `kill -HUP`).
    let mut hangups = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP: token files and certificate are read at start-up only");
            return;
        }
    };
    background.spawn(async move {
        while hangups.recv().await.is_some() {
            if access.is_none() && tls.is_none() {
                tracing::info!("SIGHUP: no token files or TLS certificate to reload");
                continue;
            }
            let mut failed = false;
            if let Some(a) = &access {
                match a.reload() {
                    Ok(()) => tracing::info!("SIGHUP: token files reloaded"),
                    Err(e) => {
                        failed = true;
                        tracing::error!(error = %e, "SIGHUP: token files not reloaded; the tokens in force stay");
                    }
                }
            }
            if let Some(t) = &tls {
                match t.reload() {
                    Ok(()) => tracing::info!("SIGHUP: TLS certificate reloaded"),
                    Err(e) => {
                        failed = true;
                        tracing::error!(error = %e, "SIGHUP: TLS certificate not reloaded; the one in force stays");
                    }
                }
            }
            let c = if failed {
                &counters.reloads_failed
            } else {
                &counters.reloads_ok
            };
            c.fetch_add(1, Ordering::Relaxed);
        }
    });
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// The instance id stored in the data dir, created on first start.
fn stable_instance_id(data_dir: &Path) -> anyhow::Result<String> {
    let path = data_dir.join("instance-id");
    match std::fs::read_to_string(&path) {
        Ok(s) if meshd_stores::names::is_valid_name(s.trim()) => return Ok(s.trim().to_string()),
        Ok(s) => anyhow::bail!(
            "{} holds an invalid instance id {:?}",
            path.display(),
            s.trim()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
    let id = format!("meshd-{:016x}", rand::random::<u64>());
    // Written to a temp file, fsynced and renamed, so a crash never leaves half an id.
    let tmp = data_dir.join("instance-id.tmp");
    {
        let mut f = std::fs::File::create(&tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        f.write_all(id.as_bytes())?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, &path)?;
    std::fs::File::open(data_dir)?.sync_all()?;
    Ok(id)
}
