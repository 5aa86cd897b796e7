//! The partition log on NATS JetStream: the shared log of cluster mode, behind the same
//! [`PartitionLog`] contract as the Local RocksDB log, and the dead-letter body stream
//! ([`DeadLetterBodies`]) beside it.
//!
//! ```no_run
//! # async fn f() -> Result<(), meshd_stores::log::LogError> {
//! use meshd_log_nats::{NatsConfig, NatsLog};
//! let config = NatsConfig::parse("nats://10.0.0.1:4222,10.0.0.2:4222?replicas=3")
//!     .map_err(|e| meshd_stores::log::LogError::Invalid(e.to_string()))?;
//! let log = NatsLog::connect(config).await?;
//! # Ok(()) }
//! ```
//!
//! It needs nats-server 2.12 or newer with JetStream (atomic batch publish, ADR-50,
//! arrived in 2.12; batch direct get in 2.11); [`NatsLog::connect`] refuses an older
//! server by name. The streams and subjects are listed in [`names`].
//!
//! # Design
//!
//! * **One stream per (topic, partition)**, file storage, `limits` retention, one
//!   subject. Offsets are contiguous because the stream sequence is: offset = stream
//!   sequence − 1. Streams are created on the first append to a partition (creation is
//!   idempotent, so any number of instances may race to do it) with `allow_atomic`
//!   (atomic batches), `allow_direct` (reads), `deny_delete` (no single event can be
//!   removed, so a partition never has a hole: only retention removes, and only from
//!   the front) and a headers-only `republish` to `ns.appended.…` (see `appends`).
//!   Deleting a topic deletes its streams; a later append re-creates them from offset 0,
//!   as the RocksDB log does.
//! * **`append` returns only after JetStream acknowledged every event** (its PubAck).
//!   With the server settings below that means fsynced (`sync_interval: always`) or
//!   replicated to a quorum (`replicas` 3), never earlier.
//! * **The events of one partition in one call are atomic**: one event is one publish;
//!   several are one atomic batch (headers `Nats-Batch-Id` / `Nats-Batch-Sequence` /
//!   `Nats-Batch-Commit`; the server stages the batch and stores all of it at the
//!   commit, or none). A partition takes at most 1000 events per call (the server's
//!   batch limit), which is also meshd's batch limit.
//! * **A call that spans several partitions is *not* atomic across them**: JetStream
//!   has no transaction over several streams. Each partition's share is published
//!   concurrently and is atomic by itself. When every share is acknowledged the call
//!   returns the offsets; when none was sent or every share was refused, it is
//!   [`LogError::Unavailable`] (nothing stored, safe to retry); when some share was
//!   stored (or may have been) and another failed, it is [`LogError::Indeterminate`]
//!   naming which partitions were stored, refused or unknown — the HTTP layer answers
//!   504, never a 201 for a partial write, and a client retry may store the stored
//!   shares twice (an at-least-once duplicate, as the contract allows for 504).
//!   This is weaker than the trait's "all or none, even across partitions", which only
//!   the RocksDB log gives.
//! * **No hidden retries of writes, no `Nats-Msg-Id`**: a publish that may have reached
//!   the server is never re-sent by the log, so dedup ids would buy nothing, and inside
//!   an atomic batch a duplicate id rejects the whole batch without telling its
//!   offsets. The one retry is after "no responders" (nothing listens on the subject:
//!   nothing was stored): the stream was deleted by another instance, and is
//!   re-created once.
//! * **Reads** are batch direct gets (`$JS.API.DIRECT.GET`, up to 1000 events a request)
//!   from `offset + 1`: they return only what the stream stored, so they never run
//!   ahead of what was acknowledged. A first answered sequence above the one asked for
//!   is [`LogError::BelowRetention`] when retention moved the start past it (checked
//!   against the stream's `first_seq`), [`LogError::Corrupt`] otherwise. On a stream
//!   with replicas a direct get may be answered by a replica that lags: it returns
//!   fewer events, never others (sequences are the leader's), and the caller reads again.
//! * **`bounds`** is the stream info: `start` = `first_seq − 1`, `end` = `last_seq`
//!   (`{0, 0}` when the stream does not exist).
//! * **Retention is JetStream's**: `enforce_retention` sets `max_age` / `max_bytes` on
//!   every partition stream whose limits differ (and on streams created later), and the
//!   server removes old events itself, by its own clock (`now_ms` is not used).
//!   `max_bytes` counts what the server stores per message (payload, subject, headers
//!   and a few bytes of framing), not the payload alone. Reads below the retained start
//!   are still reported as [`LogError::BelowRetention`]. The report counts how far the
//!   retained starts moved since the previous pass; `bytes_removed` is 0 (unknown).
//!   The dead-letter stream has no limits.
//! * **`appends(topic, partition)` sees other processes' appends too**: every
//!   partition stream republishes a headers-only notice of each stored message to
//!   `ns.appended.{topic}.{partition}` (JetStream does it after the store, so a woken
//!   reader finds the event), and the log keeps one core subscription to
//!   `ns.appended.>` that routes each notice, by its subject, to that partition's
//!   receivers only, raising their value to the notice's `Nats-Sequence` (= the end
//!   after that event). This process's own appends notify the partitions they stored
//!   to once acknowledged. After a *re*connect every partition with receivers is
//!   notified (notices sent while disconnected are lost, so readers look again).
//!   Notices of other processes cost this one a subject parse and a map lookup each;
//!   only a partition somebody here listens to wakes anyone.
//! * **Every request has a deadline** (`request_timeout`, default 5 s), so nothing hangs
//!   when nats-server is paused (SIGSTOP) or unreachable. Errors: nothing was sent or
//!   the server refused it → [`LogError::Unavailable`] (HTTP 503, safe to retry); a
//!   write that went out and got no answer in time → [`LogError::Indeterminate`] (HTTP
//!   504: stored or not). Reads that fail are `Unavailable`. The client reconnects by
//!   itself; a write is sent only while the client is connected (otherwise it would be
//!   queued and sent after the caller was told 503). Unlike the RocksDB log this log
//!   never fail-stops: durability is the server's, and `Indeterminate` does not poison
//!   later writes.
//! * **Dead-letter bodies**: one stream per namespace (`ns_dlq`), no limits, shared by
//!   every instance; a [`BodyRef`]'s `seq` is its stream sequence. `log_id` is the
//!   namespace, the same for every instance sharing the log, so any instance can read
//!   a body another appended. `delete_body` deletes that message. `list_bodies` reads
//!   the bodies to list them (the API has no cheaper listing); it serves boot-time
//!   orphan collection, which on a shared stream must not remove a body another
//!   instance appended a moment ago and is about to reference: in cluster mode that
//!   collection needs a grace period (or a per-instance listing) before it deletes.
//! * **Park journal** (`meshd_stores::park::ParkJournal`): one stream per namespace
//!   (`ns_park`), one subject per parked event (subscription incarnation, topic,
//!   partition, offset; see [`names`]) with `max_msgs_per_subject: 1`, so the stream
//!   holds each entry's last state: the entry (offset, due, attempt, body) or, once
//!   settled, an empty tombstone published with `Nats-TTL: 1h` (the stream allows
//!   per-message TTLs). `load` reads a partition's subjects with batch direct gets
//!   filtered by subject (`next_by_subj`); a deleted subscription's subjects are purged.
//!
//! # JetStream settings
//!
//! The tests run one nats-server (`meshd_test_support::nats`) with file storage and
//!
//! ```text
//! jetstream { store_dir: "...", sync_interval: always }
//! max_payload: 2MB
//! ```
//!
//! `sync_interval: always` fsyncs every stored message before the PubAck, so a
//! SIGKILLed (or power-cut) single server keeps everything it acknowledged; the tests
//! kill nats-server with SIGKILL after acknowledged appends and find every one.
//! `max_payload: 2MB` lets a 1 MiB event (meshd's limit) plus headers through; the
//! NATS default is 1 MB.
//!
//! For production: a JetStream cluster of 3 (or 5) servers and `replicas=3` in the
//! `--log` URL, so a PubAck means a quorum holds the event; keep `sync_interval:
//! always` when an acknowledged event must survive the power loss of every replica at
//! once (a data centre outage) — at the price of an fsync per publish on each replica;
//! the NATS default (fsync every 2 minutes) relies on replication alone and can lose
//! the last acknowledged events if a quorum loses power together. A single server
//! without `sync_interval: always` can lose acknowledged events on SIGKILL. Set
//! `max_payload` to at least 2MB on every server.
//!
//! # Knobs
//!
//! See [`NatsConfig`]: `namespace` (several meshd clusters on one NATS), `replicas`,
//! `request_timeout` (the deadline of every request), `connect_timeout`,
//! `ping_interval` (how fast a dead connection is noticed), `retention`.

pub mod config;
pub mod js;
pub mod names;

pub use config::{ConfigError, NatsConfig, NatsCredentials, NatsTls};

use async_trait::async_trait;
use bytes::Bytes;
use js::{Fail, Js, STREAM_NAME_IN_USE, STREAM_NOT_FOUND};
use meshd_stores::log::{
    AppendNotifier, Appended, BodyRef, DeadLetterBodies, DedupEvent, DedupKey, LogError, LogEvent,
    PartitionBounds, PartitionLog, Retention, RetentionReport,
};
use meshd_stores::offsets::OffsetKey;
use meshd_stores::park::{JournalWrite, ParkError, ParkJournal, Parked};
use names::Names;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The oldest nats-server the log works with (atomic batch publish).
pub const MIN_SERVER: (u64, u64) = (2, 12);
/// Events per partition per call: JetStream's limit on an atomic batch.
pub const MAX_BATCH: usize = 1000;
/// Events per read request.
const MAX_READ: usize = 1000;
/// Bytes a stored message may take beyond its payload (subject: at most ~800 bytes
/// for a 255-byte topic; headers; framing), for the server-side byte cap of reads.
const MESSAGE_OVERHEAD: usize = 2048;
/// Names (topics) are at most this many bytes, as in the RocksDB log.
const MAX_NAME: usize = 255;
/// JetStream's default duplicate window; never above `max_age`.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

/// The log. Cheap to clone (shared state behind an `Arc`).
#[derive(Clone)]
pub struct NatsLog {
    inner: Arc<Inner>,
}

struct Inner {
    config: NatsConfig,
    js: Js,
    names: Names,
    /// Partition streams known to exist: created or confirmed by this process. An
    /// entry is dropped when a publish finds nobody listening (deleted elsewhere).
    known: Mutex<HashSet<String>>,
    /// The `duplicate_window` (ns) this process set or confirmed per partition stream.
    windows: Mutex<HashMap<String, u64>>,
    /// Limits for streams created from now on; `enforce_retention` replaces them.
    retention: Mutex<Retention>,
    /// Retained start of each partition stream at the last retention pass (for the
    /// report: JetStream removes by itself, in between).
    retained_start: Mutex<HashMap<String, u64>>,
    /// Unique per process, so atomic batch ids of two instances never collide.
    batch_prefix: String,
    next_batch: AtomicU64,
    /// Per-partition append notifications; shared with the notice task and the
    /// connection-event callback.
    appends: Arc<AppendNotifier>,
    /// The task that routes "stored" notices to `appends`; aborted on drop.
    notices: tokio::task::JoinHandle<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.notices.abort();
    }
}

#[derive(Debug, Deserialize)]
struct StreamState {
    #[serde(default)]
    first_seq: u64,
    #[serde(default)]
    last_seq: u64,
    #[serde(default)]
    messages: u64,
}

impl StreamState {
    fn bounds(&self) -> PartitionBounds {
        let end = self.last_seq;
        let start = if self.messages == 0 {
            end
        } else {
            self.first_seq.saturating_sub(1)
        };
        PartitionBounds {
            start: start.min(end),
            end,
        }
    }
}

#[derive(Debug, Deserialize)]
struct StreamInfo {
    #[serde(default)]
    config: Value,
    state: StreamState,
}

#[derive(Debug, Deserialize)]
struct StreamList {
    #[serde(default)]
    total: usize,
    #[serde(default)]
    streams: Option<Vec<StreamInfo>>,
}

#[derive(Debug, Deserialize)]
struct StreamNames {
    #[serde(default)]
    total: usize,
    #[serde(default)]
    streams: Option<Vec<String>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every guarded value is replaced in single assignments: consistent after a panic.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn check_topic(topic: &str) -> Result<(), LogError> {
    if topic.is_empty() || topic.len() > MAX_NAME {
        return Err(LogError::Invalid(format!(
            "topic name must be 1-{MAX_NAME} bytes, got {}",
            topic.len()
        )));
    }
    Ok(())
}

/// A read (or a listing) that failed: nothing to apply, so always "unavailable".
fn read_err(what: &str, f: Fail) -> LogError {
    LogError::Unavailable(format!("nats: {what}: {f}"))
}

/// A write that failed: unknown outcome when it went out, refused otherwise.
fn write_err(what: &str, f: Fail) -> LogError {
    match f {
        Fail::Unknown(r) => LogError::Indeterminate(format!(
            "nats: {what}: {r}; it may or may not have been stored"
        )),
        f => LogError::Unavailable(format!("nats: {what}: {f}")),
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The per-partition shares of one append by outcome: stored (with what each
/// answered), refused (nothing stored) or unknown.
struct Split<T> {
    stored: BTreeMap<u32, T>,
    refused: Vec<u32>,
    unknown: Vec<u32>,
    reasons: Vec<String>,
}

impl<T> Split<T> {
    fn of(results: Vec<(u32, Result<T, Fail>)>) -> Self {
        let mut split = Split {
            stored: BTreeMap::new(),
            refused: Vec::new(),
            unknown: Vec::new(),
            reasons: Vec::new(),
        };
        for (partition, r) in results {
            match r {
                Ok(t) => {
                    split.stored.insert(partition, t);
                }
                Err(Fail::Unknown(reason)) => {
                    split.unknown.push(partition);
                    split
                        .reasons
                        .push(format!("partition {partition}: {reason}"));
                }
                Err(f) => {
                    split.refused.push(partition);
                    split.reasons.push(format!("partition {partition}: {f}"));
                }
            }
        }
        split
    }

    /// `None` when every share was stored; else the whole call's error (logged):
    /// `Unavailable` when nothing was or may have been stored, `Indeterminate`
    /// naming the partitions otherwise. `note` is added to the latter.
    fn failure(&self, topic: &str, note: &str) -> Option<LogError> {
        if self.refused.is_empty() && self.unknown.is_empty() {
            return None;
        }
        let (stored, refused, unknown) = (
            self.stored.keys().collect::<Vec<_>>(),
            &self.refused,
            &self.unknown,
        );
        let detail = self.reasons.join("; ");
        tracing::warn!(
            store = "log",
            backend = "nats",
            topic,
            ?stored,
            ?refused,
            ?unknown,
            detail,
            "append failed"
        );
        Some(if stored.is_empty() && unknown.is_empty() {
            LogError::Unavailable(format!("nats: append to {topic} not stored: {detail}"))
        } else {
            LogError::Indeterminate(format!(
                "nats: append to {topic} partly or possibly stored (stored: partitions \
                 {stored:?}; unknown: {unknown:?}; refused: {refused:?}){note}: {detail}"
            ))
        })
    }
}

/// `max_age`, `max_bytes` and `duplicate_window` of a stream under `r`.
fn limits(r: &Retention) -> (u64, i64, u64) {
    let max_age = r
        .max_age_ms
        .map(|ms| Duration::from_millis(ms.max(1000)))
        .unwrap_or_default();
    let max_bytes = r
        .max_bytes
        .map(|b| i64::try_from(b).unwrap_or(i64::MAX))
        .unwrap_or(-1);
    let dup = if max_age.is_zero() {
        DUPLICATE_WINDOW
    } else {
        DUPLICATE_WINDOW.min(max_age)
    };
    (nanos(max_age), max_bytes, nanos(dup))
}

fn parse_version(v: &str) -> Option<(u64, u64)> {
    let mut it = v.trim_start_matches('v').split(['.', '-']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

impl NatsLog {
    /// Connects to nats-server, checks it (version, JetStream), makes sure the
    /// dead-letter stream exists and starts listening for "stored" notices.
    ///
    /// Errors: a bad config, a TLS file that cannot be read (named) or a server too
    /// old → [`LogError::Invalid`]; no server reachable in `connect_timeout`, a
    /// refused user/password or TLS handshake (the message says which), JetStream
    /// off or not answering → [`LogError::Unavailable`].
    pub async fn connect(config: NatsConfig) -> Result<Self, LogError> {
        config
            .validate()
            .map_err(|e| LogError::Invalid(e.to_string()))?;
        if let Some(tls) = &config.tls {
            tls.check_files()
                .map_err(|e| LogError::Invalid(e.to_string()))?;
        }
        let names = Names::new(&config.namespace);
        let appends = Arc::new(AppendNotifier::default());
        let on_event = appends.clone();
        // Set by a disconnect, so the next `Connected` (a reconnect, not the first
        // connect) wakes every reader.
        let lost = Arc::new(AtomicBool::new(false));
        let mut options = async_nats::ConnectOptions::new();
        if let Some(tls) = &config.tls {
            // `require_tls`: the client refuses a server that does not offer TLS
            // instead of talking plaintext to it.
            options = options
                .require_tls(true)
                .add_root_certificates(tls.ca_file.clone());
            if let (Some(cert), Some(key)) = (&tls.cert_file, &tls.key_file) {
                options = options.add_client_certificate(cert.clone(), key.clone());
            }
        }
        if let Some(c) = &config.credentials {
            options = options.user_and_password(c.user.clone(), c.password.clone());
        }
        let options = options
            .name(format!("meshd log ({})", config.namespace))
            .connection_timeout(config.connect_timeout)
            .request_timeout(Some(config.request_timeout))
            .ping_interval(config.ping_interval)
            .event_callback(move |event| {
                let appends = on_event.clone();
                let lost = lost.clone();
                async move {
                    match event {
                        async_nats::Event::Connected => {
                            if lost.swap(false, Ordering::AcqRel) {
                                // Notices sent while we were away are lost: wake readers.
                                appends.notify_all();
                            }
                            tracing::info!(store = "log", backend = "nats", "connected to nats-server");
                        }
                        async_nats::Event::Disconnected => {
                            lost.store(true, Ordering::Release);
                            tracing::warn!(store = "log", backend = "nats", "disconnected from nats-server")
                        }
                        other => tracing::info!(store = "log", backend = "nats", event = %other, "nats client event"),
                    }
                }
            });
        let urls = config.urls();
        let client = tokio::time::timeout(
            config.connect_timeout + Duration::from_secs(1),
            options.connect(urls.clone()),
        )
        .await
        .map_err(|_| LogError::Unavailable(format!("nats: connecting to {urls:?} timed out")))?
        .map_err(|e| {
            use async_nats::ConnectErrorKind as K;
            // A failed handshake (unknown CA, bad certificate) reaches us as an I/O
            // error carrying rustls' message.
            let text = e.to_string().to_ascii_lowercase();
            let handshake = ["certificate", "tls", "handshake"]
                .iter()
                .any(|w| text.contains(w));
            let why = match e.kind() {
                K::AuthorizationViolation | K::Authentication => {
                    "authorization refused (check the NATS user and password)"
                }
                K::Tls => "TLS failed (check the CA, the client certificate and that the server speaks TLS)",
                K::Io if handshake => "TLS failed (check the CA, the client certificate and that the server speaks TLS)",
                _ => "cannot connect",
            };
            LogError::Unavailable(format!("nats: {why}: {urls:?}: {e}"))
        })?;
        let version = client.server_info().version;
        match parse_version(&version) {
            Some(v) if v >= MIN_SERVER => {}
            _ => {
                return Err(LogError::Invalid(format!(
                    "nats-server {version} is too old: the JetStream log needs {}.{} or newer (atomic batch publish)",
                    MIN_SERVER.0, MIN_SERVER.1
                )))
            }
        }
        let js = Js { client };
        let deadline = Instant::now() + config.request_timeout;
        js.api::<Value>("INFO", &Value::Null, deadline)
            .await
            .map_err(|f| match f {
                Fail::NoResponders => LogError::Unavailable(
                    "nats: JetStream is not enabled on nats-server (run it with -js or a jetstream block)".into(),
                ),
                f => read_err("JetStream account info", f),
            })?;
        let mut sub = js
            .client
            .subscribe(names.appended_filter())
            .await
            .map_err(|e| LogError::Unavailable(format!("nats: subscribing to notices: {e}")))?;
        let routes = appends.clone();
        let notice_names = names.clone();
        let notices = tokio::spawn(async move {
            use futures::StreamExt;
            while let Some(m) = sub.next().await {
                let Some((topic, partition)) = notice_names.parse_appended_subject(&m.subject)
                else {
                    continue;
                };
                // The stream sequence of the stored event = the partition's end after it.
                let end = m
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(async_nats::header::NATS_SEQUENCE))
                    .and_then(|v| v.as_str().parse::<u64>().ok());
                routes.notify(&topic, partition, end);
            }
        });
        let retention = config.retention;
        let log = Self {
            inner: Arc::new(Inner {
                js,
                names,
                known: Mutex::new(HashSet::new()),
                windows: Mutex::new(HashMap::new()),
                retention: Mutex::new(retention),
                retained_start: Mutex::new(HashMap::new()),
                batch_prefix: format!("{:016x}", rand::random::<u64>()),
                next_batch: AtomicU64::new(0),
                appends,
                notices,
                config,
            }),
        };
        log.inner.ensure_dlq().await?;
        tracing::info!(
            store = "log",
            backend = "nats",
            servers = ?log.inner.config.servers,
            version,
            namespace = log.inner.config.namespace,
            "log opened"
        );
        Ok(log)
    }

    /// The client, for tests that need to look at the server directly.
    pub fn client(&self) -> &async_nats::Client {
        &self.inner.js.client
    }

    /// The stream that holds one partition.
    pub fn stream_of(&self, topic: &str, partition: u32) -> String {
        self.inner.names.partition_stream(topic, partition)
    }
}

impl Inner {
    fn deadline(&self) -> Instant {
        Instant::now() + self.config.request_timeout
    }

    async fn create_stream(&self, config: Value) -> Result<(), Fail> {
        let name = config["name"].as_str().unwrap_or_default().to_string();
        match self
            .js
            .api::<Value>(&format!("STREAM.CREATE.{name}"), &config, self.deadline())
            .await
        {
            Ok(_) => Ok(()),
            // It exists with other settings (another instance's retention, a newer
            // meshd): it is our stream all the same.
            Err(f) if f.api_code() == Some(STREAM_NAME_IN_USE) => Ok(()),
            Err(f) => Err(f),
        }
    }

    /// The settings of a stream shared by every instance, kept without limits: file
    /// storage, the log's replicas, direct gets; `per_subject` messages kept per
    /// subject (-1: all); `what` describes it.
    fn shared_stream(
        &self,
        name: String,
        subject: String,
        per_subject: i64,
        (kind, what): (&str, &str),
    ) -> Value {
        json!({
            "name": name,
            "subjects": [subject],
            "retention": "limits",
            "storage": "file",
            "discard": "old",
            "num_replicas": self.config.replicas,
            "max_consumers": -1,
            "max_msgs": -1,
            "max_bytes": -1,
            "max_age": 0,
            "max_msgs_per_subject": per_subject,
            "max_msg_size": -1,
            "allow_direct": true,
            "description": what,
            "metadata": { "meshd.kind": kind },
        })
    }

    async fn ensure_dlq(&self) -> Result<(), LogError> {
        let config = self.shared_stream(
            self.names.dlq_stream(),
            self.names.dlq_subject(),
            -1,
            ("deadletter-bodies", "meshd dead-letter bodies"),
        );
        self.create_stream(config)
            .await
            .map_err(|f| write_err("creating the dead-letter stream", f))
    }

    async fn ensure_partition(&self, topic: &str, partition: u32) -> Result<(), Fail> {
        let name = self.names.partition_stream(topic, partition);
        if lock(&self.known).contains(&name) {
            return Ok(());
        }
        let subject = self.names.partition_subject(topic, partition);
        let (max_age, max_bytes, dup) = limits(&lock(&self.retention));
        let config = json!({
            "name": name,
            "subjects": [subject],
            "retention": "limits",
            "storage": "file",
            "discard": "old",
            "num_replicas": self.config.replicas,
            "max_consumers": -1,
            "max_msgs": -1,
            "max_bytes": max_bytes,
            "max_age": max_age,
            "max_msgs_per_subject": -1,
            "max_msg_size": -1,
            "duplicate_window": dup,
            "allow_direct": true,
            "allow_atomic": true,
            "deny_delete": true,
            "republish": {
                "src": subject,
                "dest": self.names.appended_subject(topic, partition),
                "headers_only": true,
            },
            "description": format!("meshd log {topic}/{partition}"),
            "metadata": {
                "meshd.kind": "partition",
                "meshd.topic": topic,
                "meshd.partition": partition.to_string(),
            },
        });
        self.create_stream(config).await?;
        lock(&self.known).insert(name);
        Ok(())
    }

    fn forget(&self, stream: &str) {
        lock(&self.known).remove(stream);
    }

    fn batch_id(&self) -> String {
        let n = self.next_batch.fetch_add(1, Ordering::Relaxed);
        format!("meshd-{}-{n}", self.batch_prefix)
    }

    /// One partition's share of an append: its first offset.
    async fn append_partition(
        &self,
        topic: &str,
        partition: u32,
        payloads: &[Bytes],
    ) -> Result<u64, Fail> {
        let ack = self
            .publish_share(topic, partition, payloads, None, None)
            .await?;
        Ok(ack.seq - payloads.len() as u64)
    }

    /// Publishes one partition's share (one message, or one atomic batch), with a
    /// `Nats-Msg-Id` per message when `ids` are given, once its stream exists (with
    /// the dedup window `window_ms` when given): the PubAck of the stream it belongs
    /// to.
    async fn publish_share(
        &self,
        topic: &str,
        partition: u32,
        payloads: &[Bytes],
        ids: Option<&[String]>,
        window_ms: Option<u64>,
    ) -> Result<js::PubAck, Fail> {
        let stream = self.names.partition_stream(topic, partition);
        let subject = self.names.partition_subject(topic, partition);
        let mut retried = false;
        loop {
            // Nothing of the append is sent before the stream exists: a failure here,
            // even a timeout of the creation, stores no event.
            let prepared = match self.ensure_partition(topic, partition).await {
                Ok(()) => match window_ms {
                    Some(ms) => self.ensure_window(&stream, ms).await,
                    None => Ok(()),
                },
                Err(f) => Err(f),
            };
            prepared.map_err(|f| match f {
                Fail::Unknown(r) => Fail::NotApplied(format!("preparing stream {stream}: {r}")),
                f => f,
            })?;
            let id = self.batch_id();
            match self
                .js
                .publish_with_ids(&subject, payloads, ids, &id, self.deadline())
                .await
            {
                Ok(ack) if ack.stream == stream => return Ok(ack),
                Ok(ack) => {
                    return Err(Fail::Unknown(format!(
                        "stored by stream {:?}, not {stream:?}",
                        ack.stream
                    )))
                }
                // Nothing listens: the stream was deleted (by another instance's
                // delete_topic). Nothing was stored; re-create it once.
                Err(Fail::NoResponders) if !retried => {
                    retried = true;
                    self.forget(&stream);
                }
                Err(f) => return Err(f),
            }
        }
    }

    /// Refuses a share JetStream cannot take: more than [`MAX_BATCH`] events, or an
    /// event that with `room` bytes of headers passes the server's `max_payload`.
    fn check_share<'a>(
        &self,
        partition: u32,
        payloads: impl ExactSizeIterator<Item = &'a Bytes>,
        room: usize,
    ) -> Result<(), LogError> {
        if payloads.len() > MAX_BATCH {
            return Err(LogError::Invalid(format!(
                "{} events for partition {partition} in one append; JetStream takes at most {MAX_BATCH}",
                payloads.len()
            )));
        }
        let max_payload = self.js.client.server_info().max_payload;
        if let Some(p) = payloads.into_iter().find(|p| p.len() + room > max_payload) {
            return Err(LogError::Invalid(format!(
                "an event of {} bytes is above nats-server's max_payload ({max_payload} bytes)",
                p.len()
            )));
        }
        Ok(())
    }

    async fn stream_info(&self, stream: &str) -> Result<Option<StreamInfo>, Fail> {
        match self
            .js
            .api::<StreamInfo>(
                &format!("STREAM.INFO.{stream}"),
                &Value::Null,
                self.deadline(),
            )
            .await
        {
            Ok(info) => Ok(Some(info)),
            Err(f) if f.api_code() == Some(STREAM_NOT_FOUND) => Ok(None),
            Err(f) => Err(f),
        }
    }

    async fn bounds(&self, topic: &str, partition: u32) -> Result<PartitionBounds, LogError> {
        check_topic(topic)?;
        let stream = self.names.partition_stream(topic, partition);
        Ok(self
            .stream_info(&stream)
            .await
            .map_err(|f| read_err("stream info", f))?
            .map(|i| i.state.bounds())
            .unwrap_or_default())
    }

    fn below(&self, topic: &str, partition: u32, from: u64, start: u64) -> LogError {
        LogError::BelowRetention {
            topic: topic.to_string(),
            partition,
            requested: from,
            start,
        }
    }

    async fn read(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> Result<Vec<LogEvent>, LogError> {
        check_topic(topic)?;
        let check_start = || async {
            let b = self.bounds(topic, partition).await?;
            if from < b.start {
                Err(self.below(topic, partition, from, b.start))
            } else {
                Ok(b)
            }
        };
        if max_events == 0 {
            check_start().await?;
            return Ok(Vec::new());
        }
        let stream = self.names.partition_stream(topic, partition);
        let Some(seq) = from.checked_add(1) else {
            return Ok(Vec::new());
        };
        let batch = max_events.min(MAX_READ);
        // The server counts whole messages (subject, headers, payload) against its
        // `max_bytes`; the cap here is on payloads, enforced below. Allow each message
        // its subject and headers so the server never stops short of the cap.
        let hint = max_bytes
            .checked_add(batch.saturating_mul(MESSAGE_OVERHEAD))
            .filter(|b| *b < usize::MAX / 2);
        let got = match self
            .js
            .direct_batch(&stream, seq, batch, hint, self.deadline())
            .await
        {
            Ok(got) => got,
            // No stream (never written, or deleted): nothing to read.
            Err(Fail::NoResponders) => Vec::new(),
            Err(f) => return Err(read_err("reading events", f)),
        };
        let Some(first) = got.first() else {
            check_start().await?;
            return Ok(Vec::new());
        };
        if first.seq != seq {
            let b = check_start().await?;
            return Err(LogError::Corrupt {
                key: format!("{stream}@{seq}"),
                reason: format!(
                    "event missing inside the retained range {}..{} (next stored is sequence {})",
                    b.start, b.end, first.seq
                ),
            });
        }
        let mut out = Vec::with_capacity(got.len());
        let mut bytes = 0usize;
        for (expected, m) in (seq..).zip(got) {
            if m.seq != expected {
                return Err(LogError::Corrupt {
                    key: format!("{stream}@{expected}"),
                    reason: format!("event missing (next stored is sequence {})", m.seq),
                });
            }
            if !out.is_empty() && bytes.saturating_add(m.payload.len()) > max_bytes {
                break;
            }
            bytes = bytes.saturating_add(m.payload.len());
            out.push(LogEvent {
                offset: m.seq - 1,
                appended_at_ms: m.at_ms,
                payload: m.payload.to_vec(),
            });
        }
        Ok(out)
    }

    async fn append(
        &self,
        topic: &str,
        events: Vec<(u32, Vec<u8>)>,
    ) -> Result<Vec<(u32, u64)>, LogError> {
        check_topic(topic)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        // Per partition, in call order; remember each event's place in the call.
        let mut shares: BTreeMap<u32, Vec<(usize, Bytes)>> = BTreeMap::new();
        for (i, (partition, payload)) in events.into_iter().enumerate() {
            shares
                .entry(partition)
                .or_default()
                .push((i, Bytes::from(payload)));
        }
        for (partition, share) in &shares {
            // Headers (batch id, sequence, commit) need a little room.
            self.check_share(*partition, share.iter().map(|(_, p)| p), 256)?;
        }
        let total: usize = shares.values().map(Vec::len).sum();
        let results = futures::future::join_all(shares.iter().map(|(partition, share)| {
            let payloads: Vec<Bytes> = share.iter().map(|(_, p)| p.clone()).collect();
            async move {
                let r = self.append_partition(topic, *partition, &payloads).await;
                (*partition, r)
            }
        }))
        .await;
        let split = Split::of(results);
        let mut placed = vec![(0u32, 0u64); total];
        for (partition, first) in &split.stored {
            for (k, (i, _)) in shares[partition].iter().enumerate() {
                placed[*i] = (*partition, first + k as u64);
            }
            // Acknowledged, so durable: readers of those partitions may look (the
            // republished notices follow, possibly later).
            let end = first + shares[partition].len() as u64;
            self.appends.notify(topic, *partition, Some(end));
        }
        match split.failure(topic, "") {
            None => Ok(placed),
            Some(e) => Err(e),
        }
    }

    /// [`PartitionLog::append_dedup`] on JetStream: each event carries its key as
    /// `Nats-Msg-Id` and the partition stream's `duplicate_window` is the topic's
    /// window, so the server deduplicates (durably with the stream, for every
    /// instance). A partition's share goes as one atomic batch; when the server refuses
    /// it (a batch holding a duplicate is refused whole, telling no offsets), the share
    /// is sent again one event at a time, each answered stored or duplicate with the
    /// stored sequence. Repeats of a key inside the call are sent once. The call is
    /// atomic per partition only when no event is a duplicate (with dedup a retry of
    /// what was stored is harmless, which is the point).
    async fn append_dedup(
        &self,
        topic: &str,
        events: Vec<DedupEvent>,
        window_ms: u64,
    ) -> Result<Vec<Appended>, LogError> {
        check_topic(topic)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        // Per partition: the distinct keys in call order; each event's place.
        let mut shares: BTreeMap<u32, Vec<(DedupKey, Bytes)>> = BTreeMap::new();
        let mut first: HashMap<(u32, DedupKey), usize> = HashMap::new();
        let mut place: Vec<(u32, usize, bool)> = Vec::with_capacity(events.len());
        for e in events {
            let share = shares.entry(e.partition).or_default();
            match first.get(&(e.partition, e.key)) {
                Some(&i) => place.push((e.partition, i, true)),
                None => {
                    first.insert((e.partition, e.key), share.len());
                    place.push((e.partition, share.len(), false));
                    share.push((e.key, Bytes::from(e.payload)));
                }
            }
        }
        for (partition, share) in &shares {
            // The batch headers and a `Nats-Msg-Id` need room.
            self.check_share(*partition, share.iter().map(|(_, p)| p), 512)?;
        }
        let results =
            futures::future::join_all(shares.iter().map(|(partition, share)| async move {
                (
                    *partition,
                    self.append_partition_dedup(topic, *partition, share, window_ms)
                        .await,
                )
            }))
            .await;
        let split = Split::of(results);
        for (partition, list) in &split.stored {
            if let Some(end) = list.iter().map(|(o, _)| o + 1).max() {
                self.appends.notify(topic, *partition, Some(end));
            }
        }
        if let Some(e) = split.failure(topic, "; a retry with the same events is deduplicated") {
            return Err(e);
        }
        let answered = split.stored;
        Ok(place
            .into_iter()
            .map(|(partition, i, repeat)| {
                let (offset, duplicate) = answered[&partition][i];
                Appended {
                    partition,
                    offset,
                    duplicate: duplicate || repeat,
                }
            })
            .collect())
    }

    /// One partition's share of a deduplicated append: (offset, duplicate) per event.
    async fn append_partition_dedup(
        &self,
        topic: &str,
        partition: u32,
        share: &[(DedupKey, Bytes)],
        window_ms: u64,
    ) -> Result<Vec<(u64, bool)>, Fail> {
        let payloads: Vec<Bytes> = share.iter().map(|(_, p)| p.clone()).collect();
        let ids: Vec<String> = share.iter().map(|(k, _)| k.hex()).collect();
        let sent = self
            .publish_share(topic, partition, &payloads, Some(&ids), Some(window_ms))
            .await;
        match sent {
            Ok(ack) if payloads.len() == 1 => Ok(vec![(ack.seq - 1, ack.duplicate)]),
            Ok(ack) => {
                let first = ack.seq - payloads.len() as u64;
                Ok((0..payloads.len() as u64)
                    .map(|k| (first + k, false))
                    .collect())
            }
            // Refused whole (a duplicate inside, or any other refusal): nothing
            // stored; one at a time, in order, each stored or a duplicate.
            Err(Fail::Api(e)) if payloads.len() > 1 => {
                tracing::debug!(store = "log", backend = "nats", topic, partition, error = %e, "atomic batch refused; sending its events one at a time");
                let mut out = Vec::with_capacity(payloads.len());
                for (p, id) in payloads.iter().zip(&ids) {
                    let ack = self
                        .publish_share(
                            topic,
                            partition,
                            std::slice::from_ref(p),
                            Some(std::slice::from_ref(id)),
                            Some(window_ms),
                        )
                        .await
                        .map_err(|f| match (f, out.is_empty()) {
                            (f, true) => f,
                            // Part of the share is stored: the outcome of the
                            // whole share is not "refused".
                            (f, false) => Fail::Unknown(format!(
                                "after {} of {} events: {f}",
                                out.len(),
                                payloads.len()
                            )),
                        })?;
                    out.push((ack.seq - 1, ack.duplicate));
                }
                Ok(out)
            }
            Err(f) => Err(f),
        }
    }

    /// Sets a partition stream's `duplicate_window` to the topic's dedup window (once
    /// per window change in this process; capped by `max_age` as the server demands).
    async fn ensure_window(&self, stream: &str, window_ms: u64) -> Result<(), Fail> {
        let (max_age, _, _) = limits(&lock(&self.retention));
        let mut want = nanos(Duration::from_millis(window_ms.max(1)));
        if max_age > 0 {
            want = want.min(max_age);
        }
        if lock(&self.windows).get(stream) == Some(&want) {
            return Ok(());
        }
        let Some(info) = self.stream_info(stream).await? else {
            return Err(Fail::NoResponders);
        };
        if info.config["duplicate_window"].as_u64() != Some(want) {
            let mut config = info.config.clone();
            config["duplicate_window"] = json!(want);
            let _: StreamInfo = self
                .js
                .api(&format!("STREAM.UPDATE.{stream}"), &config, self.deadline())
                .await?;
            tracing::info!(
                store = "log",
                backend = "nats",
                stream,
                duplicate_window_ns = want,
                "stream dedup window set"
            );
        }
        lock(&self.windows).insert(stream.to_string(), want);
        Ok(())
    }

    /// Every stream of this log's partitions, with config and state.
    async fn partition_streams(&self) -> Result<Vec<StreamInfo>, LogError> {
        let mut out = Vec::new();
        loop {
            let page: StreamList = self
                .js
                .api(
                    "STREAM.LIST",
                    &json!({ "offset": out.len(), "subject": self.names.all_partitions_filter() }),
                    self.deadline(),
                )
                .await
                .map_err(|f| read_err("listing streams", f))?;
            let streams = page.streams.unwrap_or_default();
            if streams.is_empty() {
                return Ok(out);
            }
            out.extend(streams);
            if out.len() >= page.total {
                return Ok(out);
            }
        }
    }

    async fn delete_topic(&self, topic: &str) -> Result<(), LogError> {
        check_topic(topic)?;
        let filter = self.names.topic_filter(topic);
        let mut names = Vec::new();
        loop {
            let page: StreamNames = self
                .js
                .api(
                    "STREAM.NAMES",
                    &json!({ "offset": names.len(), "subject": filter }),
                    self.deadline(),
                )
                .await
                .map_err(|f| read_err("listing the topic's streams", f))?;
            let streams = page.streams.unwrap_or_default();
            if streams.is_empty() {
                break;
            }
            names.extend(streams);
            if names.len() >= page.total {
                break;
            }
        }
        for name in names {
            self.forget(&name);
            lock(&self.retained_start).remove(&name);
            match self
                .js
                .api::<Value>(
                    &format!("STREAM.DELETE.{name}"),
                    &Value::Null,
                    self.deadline(),
                )
                .await
            {
                Ok(_) => {}
                Err(f) if f.api_code() == Some(STREAM_NOT_FOUND) => {}
                Err(f) => return Err(write_err(&format!("deleting stream {name}"), f)),
            }
            tracing::info!(
                store = "log",
                backend = "nats",
                topic,
                stream = name,
                "stream deleted"
            );
        }
        // Receivers of the deleted partitions see their sender closed.
        self.appends.forget_topic(topic);
        Ok(())
    }

    async fn enforce_retention(&self, retention: Retention) -> Result<RetentionReport, LogError> {
        *lock(&self.retention) = retention;
        let (max_age, max_bytes, dup) = limits(&retention);
        let streams = self.partition_streams().await?;
        let mut report = RetentionReport::default();
        let mut seen = HashMap::new();
        for info in streams {
            let Some(name) = info.config["name"].as_str().map(str::to_string) else {
                continue;
            };
            let before = info.state.bounds().start;
            let mut after = before;
            let differs = info.config["max_age"].as_u64().unwrap_or(0) != max_age
                || info.config["max_bytes"].as_i64().unwrap_or(-1) != max_bytes;
            if differs {
                let mut config = info.config.clone();
                config["max_age"] = json!(max_age);
                config["max_bytes"] = json!(max_bytes);
                // A topic's dedup window stays (within max_age, as the server asks).
                let current = info.config["duplicate_window"].as_u64().unwrap_or(dup);
                let window = if max_age > 0 {
                    current.min(max_age)
                } else {
                    current
                };
                config["duplicate_window"] = json!(window);
                lock(&self.windows).remove(&name);
                let updated: StreamInfo = self
                    .js
                    .api(&format!("STREAM.UPDATE.{name}"), &config, self.deadline())
                    .await
                    .map_err(|f| write_err(&format!("setting retention on {name}"), f))?;
                after = updated.state.bounds().start;
                tracing::info!(
                    store = "log",
                    backend = "nats",
                    stream = name,
                    max_age_ns = max_age,
                    max_bytes,
                    "stream retention updated"
                );
            }
            let last = lock(&self.retained_start).get(&name).copied();
            report.events_removed += after.saturating_sub(last.unwrap_or(before).min(after));
            seen.insert(name, after);
        }
        *lock(&self.retained_start) = seen;
        Ok(report)
    }

    async fn append_body(&self, body: &[u8]) -> Result<u64, LogError> {
        let subject = self.names.dlq_subject();
        let payload = [Bytes::copy_from_slice(body)];
        let mut retried = false;
        loop {
            let id = self.batch_id();
            match self
                .js
                .publish(&subject, &payload, &id, self.deadline())
                .await
            {
                Ok(ack) => return Ok(ack.seq),
                Err(Fail::NoResponders) if !retried => {
                    retried = true;
                    // The body was not stored, whatever the creation did.
                    self.ensure_dlq().await.map_err(|e| match e {
                        LogError::Indeterminate(r) => LogError::Unavailable(r),
                        e => e,
                    })?;
                }
                Err(f) => return Err(write_err("appending a dead-letter body", f)),
            }
        }
    }
}

#[async_trait]
impl PartitionLog for NatsLog {
    fn log_id(&self) -> &str {
        &self.inner.config.namespace
    }

    async fn append(
        &self,
        topic: &str,
        events: Vec<(u32, Vec<u8>)>,
    ) -> Result<Vec<(u32, u64)>, LogError> {
        self.inner.append(topic, events).await
    }

    async fn append_dedup(
        &self,
        topic: &str,
        events: Vec<DedupEvent>,
        window_ms: u64,
    ) -> Result<Vec<Appended>, LogError> {
        self.inner.append_dedup(topic, events, window_ms).await
    }

    async fn read(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> Result<Vec<LogEvent>, LogError> {
        self.inner
            .read(topic, partition, from, max_events, max_bytes)
            .await
    }

    async fn bounds(&self, topic: &str, partition: u32) -> Result<PartitionBounds, LogError> {
        self.inner.bounds(topic, partition).await
    }

    async fn delete_topic(&self, topic: &str) -> Result<(), LogError> {
        self.inner.delete_topic(topic).await
    }

    /// Sets `retention` as the JetStream limits of every partition stream (see the
    /// crate doc); `now_ms` is not used: the server removes by its own clock.
    async fn enforce_retention(
        &self,
        retention: Retention,
        _now_ms: u64,
    ) -> Result<RetentionReport, LogError> {
        self.inner.enforce_retention(retention).await
    }

    /// The value starts at 0 (the end is not known without a request) and is raised
    /// by this process's appends and by "stored" notices.
    fn appends(&self, topic: &str, partition: u32) -> watch::Receiver<u64> {
        self.inner.appends.subscribe(topic, partition, || 0)
    }
}

#[async_trait]
impl DeadLetterBodies for NatsLog {
    fn log_id(&self) -> &str {
        &self.inner.config.namespace
    }

    async fn append_body(&self, body: &[u8]) -> Result<BodyRef, LogError> {
        let seq = self.inner.append_body(body).await?;
        Ok(BodyRef {
            log_id: self.inner.config.namespace.clone(),
            seq,
        })
    }

    async fn read_body(&self, body: &BodyRef) -> Result<Option<Vec<u8>>, LogError> {
        if body.log_id != self.inner.config.namespace || body.seq == 0 {
            return Ok(None);
        }
        let i = &self.inner;
        match i
            .js
            .direct_get(&i.names.dlq_stream(), body.seq, i.deadline())
            .await
        {
            Ok(Some(m)) if m.seq == body.seq => Ok(Some(m.payload.to_vec())),
            Ok(_) => Ok(None),
            Err(f) => Err(read_err("reading a dead-letter body", f)),
        }
    }

    async fn delete_body(&self, body: &BodyRef) -> Result<(), LogError> {
        if body.log_id != self.inner.config.namespace || body.seq == 0 {
            return Ok(());
        }
        let i = &self.inner;
        match i
            .js
            .api::<Value>(
                &format!("STREAM.MSG.DELETE.{}", i.names.dlq_stream()),
                &json!({ "seq": body.seq, "no_erase": true }),
                i.deadline(),
            )
            .await
        {
            Ok(_) => Ok(()),
            // Absent already: not an error.
            Err(f)
                if matches!(
                    f.api_code(),
                    Some(js::SEQUENCE_NOT_FOUND) | Some(js::NO_MESSAGE_FOUND)
                ) =>
            {
                Ok(())
            }
            Err(f) => Err(write_err("deleting a dead-letter body", f)),
        }
    }

    async fn list_bodies(
        &self,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Vec<BodyRef>, LogError> {
        let i = &self.inner;
        let mut out = Vec::new();
        let mut next = after.map_or(1, |a| a.saturating_add(1));
        while out.len() < limit {
            let want = (limit - out.len()).min(MAX_READ);
            let got = match i
                .js
                .direct_batch(&i.names.dlq_stream(), next, want, None, i.deadline())
                .await
            {
                Ok(got) => got,
                Err(Fail::NoResponders) => Vec::new(),
                Err(f) => return Err(read_err("listing dead-letter bodies", f)),
            };
            let Some(last) = got.last().map(|m| m.seq) else {
                break;
            };
            out.extend(got.into_iter().map(|m| BodyRef {
                log_id: i.config.namespace.clone(),
                seq: m.seq,
            }));
            next = last + 1;
        }
        Ok(out)
    }
}

/// A park journal entry's payload: a version byte (2), then offset and due (u64 BE),
/// `Parked::encode_tail` (attempt, ordering key, `deliverat`) and the body. Version 1
/// (no key) is still read. An empty payload is a settled entry's tombstone.
const PARK_ENTRY_V1: u8 = 1;
const PARK_ENTRY_V2: u8 = 2;
/// How long a tombstone stays (it replaces the entry at once; it only has to outlive
/// a stale owner's late write of the same entry, which would then be a duplicate
/// delivery at worst).
const PARK_TOMBSTONE_TTL: &str = "1h";
/// The header a park journal message carries its writer's owner epoch in
/// (`meshd_stores::park::ParkJournal`, "Fencing").
const PARK_EPOCH_HEADER: &str = "Meshd-Epoch";
/// JetStream's refusal of a publish whose expected last subject sequence is not the
/// subject's.
const WRONG_LAST_SEQUENCE: u64 = 10071;
/// Puts of one entry that lose to another writer in a row before the put gives up
/// (unavailable: retried later).
const PARK_PUT_TRIES: usize = 4;
/// JetStream's answer to a message get that finds nothing at or after the sequence.
const NO_MESSAGE_FOUND: u64 = 10037;

fn park_payload(entry: &Parked, body: &[u8]) -> Bytes {
    let mut v = Vec::with_capacity(1 + 16 + 21 + body.len());
    v.push(PARK_ENTRY_V2);
    v.extend_from_slice(&entry.offset.to_be_bytes());
    v.extend_from_slice(&entry.due_ms.to_be_bytes());
    entry.encode_tail(&mut v);
    v.extend_from_slice(body);
    Bytes::from(v)
}

/// `None` for a tombstone; an error for a payload this version cannot read.
fn parse_park_payload(p: &[u8]) -> Result<Option<(Parked, Vec<u8>)>, String> {
    if p.is_empty() {
        return Ok(None);
    }
    let unreadable = || {
        format!(
            "park journal entry of {} bytes, version {}: not one this meshd reads",
            p.len(),
            p[0]
        )
    };
    let u64_at = |at: usize| -> Option<u64> {
        Some(u64::from_be_bytes(p.get(at..at + 8)?.try_into().ok()?))
    };
    let (Some(offset), Some(due)) = (u64_at(1), u64_at(9)) else {
        return Err(unreadable());
    };
    let mut entry = Parked::new(offset, due, 0);
    let body_at = match p[0] {
        PARK_ENTRY_V1 => {
            let attempt = p.get(17..21).and_then(|b| b.try_into().ok());
            entry.attempt = u32::from_be_bytes(attempt.ok_or_else(unreadable)?);
            21
        }
        PARK_ENTRY_V2 => 17 + entry.decode_tail(&p[17..]).ok_or_else(unreadable)?,
        _ => return Err(unreadable()),
    };
    Ok(Some((entry, p[body_at..].to_vec())))
}

fn park_err(what: &str, f: Fail) -> ParkError {
    ParkError::Unavailable(format!("nats: {what}: {f}"))
}

impl Inner {
    async fn ensure_parks(&self) -> Result<(), Fail> {
        // The last message of an entry's subject is the entry (or its tombstone, which
        // expires: per-message TTLs).
        let mut config = self.shared_stream(
            self.names.park_stream(),
            self.names.park_filter(),
            1,
            ("park-journal", "meshd park journal"),
        );
        config["allow_msg_ttl"] = json!(true);
        self.create_stream(config).await
    }

    /// Publishes one journal message; creates the stream when nothing listens (no
    /// message was stored then) and tries once more.
    async fn park_publish(
        &self,
        subject: &str,
        headers: async_nats::HeaderMap,
        payload: Bytes,
    ) -> Result<(), Fail> {
        let mut retried = false;
        loop {
            let sent = self
                .js
                .request(
                    subject.to_string(),
                    Some(headers.clone()),
                    payload.clone(),
                    self.deadline(),
                )
                .await
                .and_then(|m| js::parse_api::<js::PubAck>(&m.payload));
            match sent {
                Ok(_) => return Ok(()),
                Err(Fail::NoResponders) if !retried => {
                    retried = true;
                    self.ensure_parks().await?;
                }
                Err(f) => return Err(f),
            }
        }
    }

    /// The sequence of `subject`'s last journal message (0: none), for a put by an
    /// owner of `epoch` to expect; [`ParkError::Fenced`] when that message was
    /// written under a higher epoch.
    async fn park_last(&self, subject: &str, epoch: i64) -> Result<u64, ParkError> {
        let stream = self.names.park_stream();
        let last = match self
            .js
            .direct_last_of(&stream, subject, self.deadline())
            .await
        {
            Ok(last) => last,
            // No journal yet (or nobody answers reads): the put expects nothing, and
            // the server refuses it if that is wrong.
            Err(Fail::NoResponders) => None,
            Err(f) => return Err(park_err("reading a park journal entry", f)),
        };
        let Some((seq, headers)) = last else {
            return Ok(0);
        };
        let theirs = park_epoch(headers.as_ref());
        if theirs > epoch {
            return Err(ParkError::Fenced(format!(
                "{subject} was written under epoch {theirs} (this owner's is {epoch}): \
                 the partition has a later owner"
            )));
        }
        Ok(seq)
    }

    /// Up to `max` messages of `filter` from sequence `from` on, read from the
    /// stream's leader (`STREAM.MSG.GET` with `next_by_subj`, which only the leader
    /// answers, one message per request): every acknowledged write is there, where a
    /// direct get may be answered by a replica that has not applied the latest ones.
    async fn park_page_from_leader(
        &self,
        stream: &str,
        filter: &str,
        from: u64,
        max: usize,
    ) -> Result<Vec<js::Stored>, Fail> {
        let mut out = Vec::new();
        let mut seq = from;
        while out.len() < max {
            let answer = self
                .js
                .api::<Value>(
                    &format!("STREAM.MSG.GET.{stream}"),
                    &json!({ "seq": seq, "next_by_subj": filter }),
                    self.deadline(),
                )
                .await;
            let m = match answer {
                Ok(v) => js::stored_of_msg_get(&v)?,
                Err(f) if f.api_code() == Some(NO_MESSAGE_FOUND) => break,
                // No journal: nothing was ever parked.
                Err(f) if f.api_code() == Some(STREAM_NOT_FOUND) => break,
                Err(f) => return Err(f),
            };
            seq = m.seq + 1;
            out.push(m);
        }
        Ok(out)
    }
}

/// The owner epoch a park journal message was written under (0: none, as an older
/// release writes them).
fn park_epoch(headers: Option<&async_nats::HeaderMap>) -> i64 {
    headers
        .and_then(|h| h.get(PARK_EPOCH_HEADER))
        .and_then(|v| v.as_str().parse::<i64>().ok())
        .unwrap_or(0)
}

fn park_headers(epoch: i64) -> async_nats::HeaderMap {
    let mut h = async_nats::HeaderMap::new();
    h.insert(PARK_EPOCH_HEADER, epoch.to_string().as_str());
    h
}

#[async_trait]
impl ParkJournal for NatsLog {
    async fn put(
        &self,
        key: &OffsetKey,
        entry: &Parked,
        body: &[u8],
        write: JournalWrite,
    ) -> Result<(), ParkError> {
        let i = &self.inner;
        let subject = i.names.park_subject(key, entry.offset);
        let payload = park_payload(entry, body);
        // Conditional on the subject's last message, checked by the server: a later
        // owner's write in between makes it fail, and the re-read names the epoch.
        let mut expected = if write.fresh {
            0
        } else {
            i.park_last(&subject, write.epoch).await?
        };
        for _ in 0..PARK_PUT_TRIES {
            let mut h = park_headers(write.epoch);
            h.insert(
                "Nats-Expected-Last-Subject-Sequence",
                expected.to_string().as_str(),
            );
            match i.park_publish(&subject, h, payload.clone()).await {
                Ok(()) => return Ok(()),
                Err(f) if f.api_code() == Some(WRONG_LAST_SEQUENCE) => {
                    expected = i.park_last(&subject, write.epoch).await?;
                }
                Err(f) => return Err(park_err("parking an event", f)),
            }
        }
        Err(ParkError::Unavailable(format!(
            "nats: {subject} changed under {PARK_PUT_TRIES} puts in a row"
        )))
    }

    async fn settle(&self, key: &OffsetKey, offset: u64, epoch: i64) -> Result<(), ParkError> {
        let i = &self.inner;
        let subject = i.names.park_subject(key, offset);
        let mut h = park_headers(epoch);
        h.insert("Nats-TTL", PARK_TOMBSTONE_TTL);
        i.park_publish(&subject, h, Bytes::new())
            .await
            .map_err(|f| park_err("settling a parked event", f))
    }

    async fn load_page(
        &self,
        key: &OffsetKey,
        from: u64,
        max: usize,
    ) -> Result<(Vec<(Parked, Vec<u8>)>, Option<u64>), ParkError> {
        let i = &self.inner;
        let filter = i.names.park_partition_filter(key);
        let stream = i.names.park_stream();
        let max = max.clamp(1, MAX_READ);
        let got = if i.config.replicas > 1 || i.config.park_reads_from_leader {
            match i
                .park_page_from_leader(&stream, &filter, from.max(1), max)
                .await
            {
                Ok(got) => got,
                Err(f) => return Err(park_err("reading the park journal from its leader", f)),
            }
        } else {
            match i
                .js
                .direct_batch_of(&stream, from.max(1), max, None, Some(&filter), i.deadline())
                .await
            {
                Ok(got) => got,
                // Nobody answers direct gets: the journal does not exist (nothing was
                // ever parked), or no server answers for it right now. Only the stream's
                // leader can tell which; an answer cut short would lose parked events.
                Err(Fail::NoResponders) => match i.stream_info(&stream).await {
                    Ok(None) => return Ok((Vec::new(), None)),
                    Ok(Some(_)) => {
                        return Err(ParkError::Unavailable(format!(
                            "nats: no server answers direct gets of {stream}"
                        )))
                    }
                    Err(f) => return Err(park_err("reading the park journal", f)),
                },
                Err(f) => return Err(park_err("reading the park journal", f)),
            }
        };
        let Some(last) = got.last().map(|m| m.seq) else {
            return Ok((Vec::new(), None));
        };
        let mut out = Vec::with_capacity(got.len());
        for m in got {
            match parse_park_payload(&m.payload) {
                Ok(Some(entry)) => out.push(entry),
                Ok(None) => {}
                Err(e) => {
                    return Err(ParkError::Unavailable(format!(
                        "nats: park journal message {} of {filter}: {e}",
                        m.seq
                    )))
                }
            }
        }
        Ok((out, Some(last + 1)))
    }

    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), ParkError> {
        let i = &self.inner;
        let filter = i.names.park_subscription_filter(subscription, incarnation);
        match i
            .js
            .api::<Value>(
                &format!("STREAM.PURGE.{}", i.names.park_stream()),
                &json!({ "filter": filter }),
                i.deadline(),
            )
            .await
        {
            Ok(_) => Ok(()),
            Err(Fail::NoResponders) => Ok(()),
            Err(f) if f.api_code() == Some(STREAM_NOT_FOUND) => Ok(()),
            Err(f) => Err(park_err("dropping a subscription's park journal", f)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn park_payloads_of_both_versions_are_read_and_others_refused() {
        // Version 1 (before ordering keys): offset, due, attempt, body.
        let mut v1 = vec![PARK_ENTRY_V1];
        v1.extend_from_slice(&5u64.to_be_bytes());
        v1.extend_from_slice(&900u64.to_be_bytes());
        v1.extend_from_slice(&2u32.to_be_bytes());
        v1.extend_from_slice(b"body");
        assert_eq!(
            parse_park_payload(&v1).unwrap(),
            Some((Parked::new(5, 900, 2), b"body".to_vec()))
        );
        let keyed = Parked {
            key: Some(42),
            not_before_ms: 7,
            ..Parked::new(5, meshd_stores::park::HELD, 0)
        };
        let v2 = park_payload(&keyed, b"body");
        assert_eq!(
            parse_park_payload(&v2).unwrap(),
            Some((keyed, b"body".to_vec()))
        );
        assert_eq!(parse_park_payload(b"").unwrap(), None);
        for bad in [&v2[..20], &[9u8; 40][..], &v1[..10]] {
            assert!(parse_park_payload(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn stream_state_maps_to_bounds() {
        let b = |first_seq, last_seq, messages| {
            StreamState {
                first_seq,
                last_seq,
                messages,
            }
            .bounds()
        };
        assert_eq!(b(0, 0, 0), PartitionBounds { start: 0, end: 0 });
        assert_eq!(b(1, 5, 5), PartitionBounds { start: 0, end: 5 });
        assert_eq!(b(4, 5, 2), PartitionBounds { start: 3, end: 5 });
        // Everything removed by retention: start = end.
        assert_eq!(b(6, 5, 0), PartitionBounds { start: 5, end: 5 });
    }

    #[test]
    fn versions_below_2_12_are_told_apart() {
        assert!(parse_version("2.15.1").unwrap() >= MIN_SERVER);
        assert!(parse_version("2.12.0-RC.1").unwrap() >= MIN_SERVER);
        assert!(parse_version("2.9.25").unwrap() < MIN_SERVER);
        assert!(parse_version("v2.11.4").unwrap() < MIN_SERVER);
        assert_eq!(parse_version("x"), None);
    }

    #[test]
    fn limits_keep_the_duplicate_window_within_max_age() {
        let (age, bytes, dup) = limits(&Retention::default());
        assert_eq!((age, bytes, dup), (0, -1, nanos(DUPLICATE_WINDOW)));
        let (age, bytes, dup) = limits(&Retention {
            max_age_ms: Some(5_000),
            max_bytes: Some(100),
        });
        assert_eq!((age, bytes, dup), (5_000_000_000, 100, 5_000_000_000));
    }
}
