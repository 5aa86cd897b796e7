//! What the runtime is built with: the stores, the settings of delivery, the metrics
//! and, in cluster mode, the ownership controller's view and the peers
//! ([`ClusterDeps`]). The partition tasks share it.

use crate::cluster::forward;
use crate::cluster::ownership::{Directory, Owned};
use crate::metrics::Metrics;
use meshd_meta::{Backend, Meta};
use meshd_stores::attempts::AttemptLedger;
use meshd_stores::deadletters::DeadLetterStore;
use meshd_stores::delivery::DeliveryStateStore;
use meshd_stores::log::PartitionLog;
use meshd_stores::offsets::OffsetStore;
use meshd_stores::sessions::SessionStore;
use meshd_stores::subscriptions::MetaSubscriptionStore;
use meshd_stores::topics::MetaTopicStore;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// What the runtime works with.
pub struct Deps {
    pub instance_id: String,
    pub meta: Arc<dyn Meta>,
    pub meta_backend: Backend,
    pub log: Arc<dyn PartitionLog>,
    /// The log's backend as metrics and logs name it (`rocksdb` or `nats`).
    pub log_backend: Backend,
    pub offsets: Arc<dyn OffsetStore>,
    pub deliveries: Arc<dyn DeliveryStateStore>,
    /// Where events wait for their time (`deliverat`): the Local park index, with its
    /// journal on the shared log in cluster mode.
    pub parks: Arc<dyn meshd_stores::park::ParkIndex>,
    pub deadletters: Arc<dyn DeadLetterStore>,
    pub sessions: Arc<dyn SessionStore>,
    pub topics: Arc<MetaTopicStore>,
    pub subscriptions: Arc<MetaSubscriptionStore>,
    /// In-flight deliveries per subscription and partition.
    pub max_in_flight: usize,
    /// Retries due this far ahead or more are parked (`Config::park_retries_after_ms`).
    pub park_retries_after_ms: u64,
    /// The key of delivery-id MACs (cluster mode: from the cluster secret, so every
    /// member rebuilds the ids of the partitions it takes over).
    pub id_key: meshd_dispatch::IdKey,
    pub metrics: Arc<Metrics>,
    /// Cluster mode (a shared log): which partitions run here, and their Meta state.
    pub cluster: Option<ClusterDeps>,
    /// The TLS client of `https://` push URLs (`None`: no CA could be loaded).
    pub push_tls: Option<tokio_rustls::TlsConnector>,
    /// Where push may connect (`crate::egress`).
    pub push_egress: Arc<crate::egress::Egress>,
    /// Where the runtime's tasks run (partition tasks, push workers, the ownership and
    /// subscription followers): a graceful stop cancels and waits for them.
    pub background: crate::background::Background,
}

/// What the runtime needs in cluster mode.
pub struct ClusterDeps {
    /// The partitions this instance owns now (from the ownership controller).
    pub owned: watch::Receiver<Owned>,
    /// Who owns the other partitions, and where they listen.
    pub directory: watch::Receiver<Arc<Directory>>,
    /// Calls the internal routes of the other instances (secret, TLS).
    pub peers: forward::Peers,
    pub ledger: Arc<dyn AttemptLedger>,
    pub checkpoint_every: Duration,
}
