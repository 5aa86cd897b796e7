//! `meshd serve` configuration: flags, then `MESHD_*` environment variables, then an
//! optional TOML file (`--config`), then defaults. A plain struct with `validate()`
//! (house style 14); the error names the bad value.

use clap::Args;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Flags and environment variables. Everything is optional here so that a value given
/// neither as a flag nor in the environment can come from the TOML file.
#[derive(Args, Debug, Default, Clone)]
pub struct ServeArgs {
    /// TOML file with the same settings (names as the flags, with `_` for `-`).
    #[arg(long, env = "MESHD_CONFIG")]
    pub config: Option<PathBuf>,
    /// HTTP address; port 0 picks a free port and prints it.
    #[arg(long, env = "MESHD_LISTEN")]
    pub listen: Option<String>,
    /// Local RocksDB directory.
    #[arg(long, env = "MESHD_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// `embedded`, or `etcd://host:port[,host:port...]`.
    #[arg(long, env = "MESHD_META")]
    pub meta: Option<String>,
    /// The event log backend: `embedded`, or `nats://host:port[,host:port...][?...]`
    /// (NATS JetStream, shared by the instances of a cluster).
    #[arg(long, env = "MESHD_LOG")]
    pub log: Option<String>,
    /// This instance's name in the cluster (default: a stable id stored in the data dir).
    #[arg(long, env = "MESHD_INSTANCE_ID")]
    pub instance_id: Option<String>,
    /// Membership and partition-ownership lease TTL in milliseconds.
    #[arg(long, env = "MESHD_LEASE_TTL_MS")]
    pub lease_ttl_ms: Option<u64>,
    /// DeliveryStateStore flush interval in milliseconds (10-1000).
    #[arg(long, env = "MESHD_DELIVERY_FLUSH_MS")]
    pub delivery_flush_ms: Option<u64>,
    /// Listen on a non-loopback address without access tokens.
    #[arg(long, env = "MESHD_INSECURE_LISTEN")]
    pub insecure_listen: bool,
    /// Cluster mode: a file whose first line is the secret of the routes between
    /// instances (default: a random secret the first instance stores in Meta).
    #[arg(long, env = "MESHD_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// Bearer tokens of clients (publish, pull, ack, nack, sessions, tasks), one per
    /// line; with this or --admin-token-file every /v1 route needs a token.
    #[arg(long, env = "MESHD_CLIENT_TOKEN_FILE")]
    pub client_token_file: Option<PathBuf>,
    /// Bearer tokens of operators (every /v1 route), one per line.
    #[arg(long, env = "MESHD_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// In-flight deliveries per subscription and partition (1-100000).
    #[arg(long, env = "MESHD_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<u64>,
    /// A retry due this many milliseconds ahead or more (a nack's delay_ms, a long
    /// backoff) is parked instead of holding the committed offset (1-86400000).
    #[arg(long, env = "MESHD_PARK_RETRIES_AFTER_MS")]
    pub park_retries_after_ms: Option<u64>,
    /// Events older than this many hours are removed from the log (1-876000).
    #[arg(long, env = "MESHD_LOG_RETENTION_HOURS")]
    pub log_retention_hours: Option<u64>,
    /// The oldest events of a partition are removed while it holds more bytes.
    #[arg(long, env = "MESHD_LOG_RETENTION_BYTES")]
    pub log_retention_bytes: Option<u64>,
    /// Cluster mode: offset checkpoint interval in milliseconds (100-600000).
    #[arg(long, env = "MESHD_CHECKPOINT_MS")]
    pub checkpoint_ms: Option<u64>,
    /// How long terminal tasks are kept, in hours (1-876000).
    #[arg(long, env = "MESHD_TASK_RETENTION_HOURS")]
    pub task_retention_hours: Option<u64>,
    /// How long dead letters are kept, in hours (1-876000).
    #[arg(long, env = "MESHD_DEADLETTER_RETENTION_HOURS")]
    pub deadletter_retention_hours: Option<u64>,
    /// Cluster mode with --tls-cert: the PEM CA that signed the other instances'
    /// certificates (default: the system's CA bundle).
    #[arg(long, env = "MESHD_CLUSTER_CA_FILE")]
    pub cluster_ca_file: Option<PathBuf>,
    /// The PEM CA that `https://` push endpoints' certificates are checked against
    /// (default: the system's CA bundle).
    #[arg(long, env = "MESHD_PUSH_CA_FILE")]
    pub push_ca_file: Option<PathBuf>,
    /// How a damaged write-ahead log is treated at start-up: `strict` (refuse to
    /// start) or `point-in-time` (open up to the damage, drop the rest).
    #[arg(long, env = "MESHD_WAL_RECOVERY")]
    pub wal_recovery: Option<String>,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, env = "MESHD_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "MESHD_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Open client connections at most; at the cap accepting pauses (1-1000000).
    #[arg(long, env = "MESHD_MAX_CONNECTIONS")]
    pub max_connections: Option<u64>,
    /// Requests handled at a time; more are refused with 429 (1-100000).
    #[arg(long, env = "MESHD_MAX_REQUESTS")]
    pub max_requests: Option<u64>,
    /// Long polls (pull with wait_ms) waiting at a time; more get 429 (1-100000,
    /// below --max-requests).
    #[arg(long, env = "MESHD_MAX_LONG_POLLS")]
    pub max_long_polls: Option<u64>,
    /// Streams (SSE and WebSocket) one client token may hold at a time; more get 429
    /// (0: off, the default; at most --max-long-polls).
    #[arg(long, env = "MESHD_MAX_STREAMS_PER_TOKEN")]
    pub max_streams_per_token: Option<u64>,
    /// Publish-dedup entries held at a time; at the cap a deduplicated publish gets
    /// 429 dedup-full until the oldest entry expires (1-1000000000).
    #[arg(long, env = "MESHD_MAX_DEDUP_ENTRIES")]
    pub max_dedup_entries: Option<u64>,
    /// Bytes of request bodies held at a time; a body that does not fit gets 429.
    #[arg(long, env = "MESHD_MAX_BODY_MEMORY")]
    pub max_body_memory: Option<u64>,
    /// Stored event bytes one answer holds at most (pull `max_bytes` default and
    /// ceiling, browse, dead-letter and task lists); at least one delivery.
    #[arg(long, env = "MESHD_MAX_RESPONSE_BYTES")]
    pub max_response_bytes: Option<u64>,
    /// Non-terminal tasks at most (429 quota-exceeded beyond).
    #[arg(long, env = "MESHD_MAX_TASKS")]
    pub max_tasks: Option<u64>,
    /// Non-terminal tasks per agent at most.
    #[arg(long, env = "MESHD_MAX_TASKS_PER_AGENT")]
    pub max_tasks_per_agent: Option<u64>,
    /// Bytes kept in Meta for tasks of every state at most.
    #[arg(long, env = "MESHD_MAX_TASK_BYTES")]
    pub max_task_bytes: Option<u64>,
    /// Live sessions at most (a takeover is never refused).
    #[arg(long, env = "MESHD_MAX_SESSIONS")]
    pub max_sessions: Option<u64>,
    /// Topics at most.
    #[arg(long, env = "MESHD_MAX_TOPICS")]
    pub max_topics: Option<u64>,
    /// Subscriptions at most.
    #[arg(long, env = "MESHD_MAX_SUBSCRIPTIONS")]
    pub max_subscriptions: Option<u64>,
    /// Cluster mode: how long a member must have been a member before a live owner
    /// hands it a partition (default 3 lease TTLs; orphaned partitions move at once).
    #[arg(long, env = "MESHD_REBALANCE_DELAY_MS")]
    pub rebalance_delay_ms: Option<u64>,
    /// Revisions of Meta's history meshd keeps when it compacts it (0: meshd does
    /// not compact, for an etcd shared with others that compact it).
    #[arg(long, env = "MESHD_META_COMPACTION_RETENTION")]
    pub meta_compaction_retention: Option<u64>,
    /// Time a client has to send its request headers (and the TLS handshake), ms.
    #[arg(long, env = "MESHD_HEADER_TIMEOUT_MS")]
    pub header_timeout_ms: Option<u64>,
    /// Time a client has to send its request body, ms (408 after it).
    #[arg(long, env = "MESHD_BODY_TIMEOUT_MS")]
    pub body_timeout_ms: Option<u64>,
    /// A connection with no traffic for this long is closed, ms; a long poll waits at
    /// most 0.5 s less.
    #[arg(long, env = "MESHD_IDLE_TIMEOUT_MS")]
    pub idle_timeout_ms: Option<u64>,
    /// etcd over TLS: the PEM CA that signed etcd's certificate.
    #[arg(long, env = "MESHD_ETCD_CA_FILE")]
    pub etcd_ca_file: Option<PathBuf>,
    /// etcd client certificate (PEM), with --etcd-key-file.
    #[arg(long, env = "MESHD_ETCD_CERT_FILE")]
    pub etcd_cert_file: Option<PathBuf>,
    #[arg(long, env = "MESHD_ETCD_KEY_FILE")]
    pub etcd_key_file: Option<PathBuf>,
    /// etcd user (etcd auth), with --etcd-password-file.
    #[arg(long, env = "MESHD_ETCD_USER")]
    pub etcd_user: Option<String>,
    /// A file whose first line is the etcd user's password.
    #[arg(long, env = "MESHD_ETCD_PASSWORD_FILE")]
    pub etcd_password_file: Option<PathBuf>,
    /// NATS over TLS: the PEM CA that signed nats-server's certificate.
    #[arg(long, env = "MESHD_NATS_CA_FILE")]
    pub nats_ca_file: Option<PathBuf>,
    /// NATS client certificate (PEM), with --nats-key-file.
    #[arg(long, env = "MESHD_NATS_CERT_FILE")]
    pub nats_cert_file: Option<PathBuf>,
    #[arg(long, env = "MESHD_NATS_KEY_FILE")]
    pub nats_key_file: Option<PathBuf>,
    /// NATS user, with --nats-password-file.
    #[arg(long, env = "MESHD_NATS_USER")]
    pub nats_user: Option<String>,
    /// A file whose first line is the NATS user's password.
    #[arg(long, env = "MESHD_NATS_PASSWORD_FILE")]
    pub nats_password_file: Option<PathBuf>,
    /// Bearer tokens that may read /metrics, one per line (admin tokens may too);
    /// without it /metrics is open.
    #[arg(long, env = "MESHD_METRICS_TOKEN_FILE")]
    pub metrics_token_file: Option<PathBuf>,
    /// Origins (`scheme://host[:port]`) whose browser requests are allowed, with CORS
    /// answers; comma-separated. Other cross-origin requests are 403.
    #[arg(long, env = "MESHD_ALLOWED_ORIGINS", value_delimiter = ',')]
    pub allowed_origins: Option<Vec<String>>,
    /// Host names (besides loopback ones) accepted in `Host` while meshd listens on
    /// loopback without tokens; comma-separated.
    #[arg(long, env = "MESHD_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Option<Vec<String>>,
    /// The `host:port` other instances call this one at (default: the listen
    /// address; required when that is unspecified, such as 0.0.0.0).
    #[arg(long, env = "MESHD_ADVERTISE")]
    pub advertise: Option<String>,
    /// Address ranges push never connects to (`10.0.0.0/8,fd00::/8`), besides
    /// meshd's own endpoints and link-local ranges.
    #[arg(long, env = "MESHD_PUSH_DENY_CIDR", value_delimiter = ',')]
    pub push_deny_cidr: Option<Vec<String>>,
    /// When given, push connects only to addresses in these ranges (deny wins).
    #[arg(long, env = "MESHD_PUSH_ALLOW_CIDR", value_delimiter = ',')]
    pub push_allow_cidr: Option<Vec<String>>,
}

/// The same settings as read from `--config`.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: Option<String>,
    data_dir: Option<PathBuf>,
    meta: Option<String>,
    log: Option<String>,
    instance_id: Option<String>,
    lease_ttl_ms: Option<u64>,
    delivery_flush_ms: Option<u64>,
    insecure_listen: Option<bool>,
    cluster_secret_file: Option<PathBuf>,
    client_token_file: Option<PathBuf>,
    admin_token_file: Option<PathBuf>,
    max_in_flight: Option<u64>,
    park_retries_after_ms: Option<u64>,
    log_retention_hours: Option<u64>,
    log_retention_bytes: Option<u64>,
    checkpoint_ms: Option<u64>,
    task_retention_hours: Option<u64>,
    deadletter_retention_hours: Option<u64>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    cluster_ca_file: Option<PathBuf>,
    push_ca_file: Option<PathBuf>,
    wal_recovery: Option<String>,
    max_connections: Option<u64>,
    max_requests: Option<u64>,
    max_long_polls: Option<u64>,
    max_streams_per_token: Option<u64>,
    max_dedup_entries: Option<u64>,
    max_body_memory: Option<u64>,
    max_response_bytes: Option<u64>,
    max_tasks: Option<u64>,
    max_tasks_per_agent: Option<u64>,
    max_task_bytes: Option<u64>,
    max_sessions: Option<u64>,
    max_topics: Option<u64>,
    max_subscriptions: Option<u64>,
    meta_compaction_retention: Option<u64>,
    rebalance_delay_ms: Option<u64>,
    header_timeout_ms: Option<u64>,
    body_timeout_ms: Option<u64>,
    idle_timeout_ms: Option<u64>,
    etcd_ca_file: Option<PathBuf>,
    etcd_cert_file: Option<PathBuf>,
    etcd_key_file: Option<PathBuf>,
    etcd_user: Option<String>,
    etcd_password_file: Option<PathBuf>,
    nats_ca_file: Option<PathBuf>,
    nats_cert_file: Option<PathBuf>,
    nats_key_file: Option<PathBuf>,
    nats_user: Option<String>,
    nats_password_file: Option<PathBuf>,
    metrics_token_file: Option<PathBuf>,
    allowed_origins: Option<Vec<String>>,
    allowed_hosts: Option<Vec<String>>,
    advertise: Option<String>,
    push_deny_cidr: Option<Vec<String>>,
    push_allow_cidr: Option<Vec<String>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaBackend {
    Embedded,
    /// Parsed from `--meta` once; TLS and credentials are added from their own flags.
    Etcd(Box<meshd_meta_etcd::EtcdConfig>),
}

/// Where the event log lives. A JetStream log is shared: instances on it run in
/// cluster mode and split its partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogBackend {
    Embedded,
    /// Parsed from `--log` once; retention, TLS and credentials come from their flags.
    Nats(Box<meshd_log_nats::NatsConfig>),
}

impl LogBackend {
    pub fn is_cluster(&self) -> bool {
        matches!(self, LogBackend::Nats(_))
    }
}

/// The effective configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub listen: SocketAddr,
    pub data_dir: PathBuf,
    pub meta: MetaBackend,
    pub log: LogBackend,
    pub instance_id: Option<String>,
    pub lease_ttl_ms: u64,
    pub delivery_flush_ms: u64,
    pub insecure_listen: bool,
    pub cluster_secret_file: Option<PathBuf>,
    pub client_token_file: Option<PathBuf>,
    pub admin_token_file: Option<PathBuf>,
    pub max_in_flight: u64,
    pub park_retries_after_ms: u64,
    pub log_retention_hours: u64,
    pub log_retention_bytes: Option<u64>,
    pub checkpoint_ms: u64,
    pub task_retention_hours: u64,
    pub deadletter_retention_hours: u64,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub cluster_ca_file: Option<PathBuf>,
    pub push_ca_file: Option<PathBuf>,
    pub wal_recovery: meshd_local::WalRecovery,
    pub max_connections: u64,
    pub max_requests: u64,
    pub max_long_polls: u64,
    /// 0: off.
    pub max_streams_per_token: u64,
    pub max_dedup_entries: u64,
    pub max_body_memory: u64,
    /// Answer bounds and quotas on what clients create.
    pub limits: Limits,
    pub meta_compaction_retention: u64,
    pub rebalance_delay_ms: u64,
    pub header_timeout_ms: u64,
    pub body_timeout_ms: u64,
    pub idle_timeout_ms: u64,
    /// TLS and credentials of the etcd connection (`--meta etcd://...` only).
    pub etcd: Secured,
    /// TLS and credentials of the NATS connection (`--log nats://...` only).
    pub nats: Secured,
    pub metrics_token_file: Option<PathBuf>,
    /// Origins allowed to call from a browser (normalised: lower case, no trailing `/`).
    pub allowed_origins: Vec<String>,
    /// Extra `Host` names accepted by the DNS-rebinding check (lower case, no port).
    pub allowed_hosts: Vec<String>,
    /// What other instances call (`host:port`); `None`: the listen address.
    pub advertise: Option<String>,
    pub push_deny_cidr: Vec<meshd_runtime::egress::Cidr>,
    pub push_allow_cidr: Vec<meshd_runtime::egress::Cidr>,
}

/// Answer bounds and quotas on client-created records (http-api.md "Bounded answers",
/// "Quotas and browser safety").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_response_bytes: u64,
    pub max_tasks: u64,
    pub max_tasks_per_agent: u64,
    pub max_task_bytes: u64,
    pub max_sessions: u64,
    pub max_topics: u64,
    pub max_subscriptions: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            max_tasks: DEFAULT_MAX_TASKS,
            max_tasks_per_agent: DEFAULT_MAX_TASKS_PER_AGENT,
            max_task_bytes: DEFAULT_MAX_TASK_BYTES,
            max_sessions: DEFAULT_MAX_SESSIONS,
            max_topics: DEFAULT_MAX_TOPICS,
            max_subscriptions: DEFAULT_MAX_SUBSCRIPTIONS,
        }
    }
}

/// TLS and user/password options of a backend connection (etcd or NATS).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Secured {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    pub user: Option<String>,
    pub password_file: Option<PathBuf>,
}

impl Secured {
    fn is_set(&self) -> bool {
        *self != Secured::default()
    }

    /// `prefix` is `etcd` or `nats`, for the flag names in errors.
    fn validate(&self, prefix: &'static str) -> Result<(), ConfigError> {
        let flag = |f: &str| format!("--{prefix}-{f}");
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(invalid_owned(
                flag("cert-file"),
                format!("{:?} / {:?}", self.cert_file, self.key_file),
                format!("{} and {} go together", flag("cert-file"), flag("key-file")),
            ));
        }
        if self.cert_file.is_some() && self.ca_file.is_none() {
            return Err(invalid_owned(
                flag("cert-file"),
                format!("{:?}", self.cert_file),
                format!("a client certificate needs {} (TLS)", flag("ca-file")),
            ));
        }
        if self.user.is_some() != self.password_file.is_some() {
            return Err(invalid_owned(
                flag("user"),
                self.user.clone().unwrap_or_default(),
                format!("{} and {} go together", flag("user"), flag("password-file")),
            ));
        }
        Ok(())
    }

    /// The user and the password, when both are configured.
    fn credentials(&self) -> anyhow::Result<Option<(String, String)>> {
        Ok(match (&self.user, self.password()?) {
            (Some(user), Some(password)) => Some((user.clone(), password)),
            _ => None,
        })
    }

    /// The password: the first line of the password file, trimmed. Read at start-up.
    pub fn password(&self) -> anyhow::Result<Option<String>> {
        let Some(path) = &self.password_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read password file {}: {e}", path.display()))?;
        let line = text.lines().next().unwrap_or("").trim().to_string();
        if line.is_empty() {
            anyhow::bail!("password file {} is empty", path.display());
        }
        Ok(Some(line))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("invalid value {value:?} for {name}: {reason}")]
    Invalid {
        name: std::borrow::Cow<'static, str>,
        value: String,
        reason: String,
    },
}

fn invalid_owned(name: String, value: impl ToString, reason: impl ToString) -> ConfigError {
    ConfigError::Invalid {
        name: name.into(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

fn invalid(name: &'static str, value: impl ToString, reason: impl ToString) -> ConfigError {
    ConfigError::Invalid {
        name: name.into(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
pub const DEFAULT_DATA_DIR: &str = "./meshd-data";
pub const DEFAULT_LEASE_TTL_MS: u64 = 10_000;
pub const DEFAULT_DELIVERY_FLUSH_MS: u64 = 100;
pub const DEFAULT_MAX_IN_FLIGHT: u64 = 1000;
pub const DEFAULT_LOG_RETENTION_HOURS: u64 = 168;
pub const DEFAULT_CHECKPOINT_MS: u64 = 1000;
pub const DEFAULT_TASK_RETENTION_HOURS: u64 = 168;
pub const DEFAULT_DEADLETTER_RETENTION_HOURS: u64 = 336;
pub const DEFAULT_MAX_CONNECTIONS: u64 = 4096;
pub const DEFAULT_MAX_REQUESTS: u64 = 1024;
pub const DEFAULT_MAX_LONG_POLLS: u64 = 512;
/// Publish-dedup entries held at most by default (http-api.md "Security rules (third
/// round)").
pub const DEFAULT_MAX_DEDUP_ENTRIES: u64 = 10_000_000;
pub const DEFAULT_MAX_BODY_MEMORY: u64 = 256 * 1024 * 1024;
pub const DEFAULT_MAX_RESPONSE_BYTES: u64 = 16 * 1024 * 1024;
pub const DEFAULT_MAX_TASKS: u64 = 100_000;
pub const DEFAULT_MAX_TASKS_PER_AGENT: u64 = 10_000;
pub const DEFAULT_MAX_TASK_BYTES: u64 = 512 * 1024 * 1024;
pub const DEFAULT_MAX_SESSIONS: u64 = 10_000;
pub const DEFAULT_MAX_TOPICS: u64 = 10_000;
pub const DEFAULT_MAX_SUBSCRIPTIONS: u64 = 10_000;
pub const DEFAULT_META_COMPACTION_RETENTION: u64 = 10_000;
pub const DEFAULT_HEADER_TIMEOUT_MS: u64 = 10_000;
pub const DEFAULT_BODY_TIMEOUT_MS: u64 = 30_000;
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 120_000;
/// Retention hours: at most 100 years.
const HOURS: std::ops::RangeInclusive<u64> = 1..=876_000;

impl Config {
    /// Log retention from `--log-retention-hours` and `--log-retention-bytes`.
    pub fn retention(&self) -> meshd_stores::log::Retention {
        meshd_stores::log::Retention {
            max_age_ms: Some(self.log_retention_hours.saturating_mul(3_600_000)),
            max_bytes: self.log_retention_bytes,
        }
    }

    /// The etcd connection meshd opens: `--meta`'s endpoints with the `--etcd-*` TLS
    /// and credentials (the password file is read now). `None`: the embedded Meta.
    pub fn etcd_connection(&self) -> anyhow::Result<Option<meshd_meta_etcd::EtcdConfig>> {
        let MetaBackend::Etcd(etcd) = &self.meta else {
            return Ok(None);
        };
        let mut cfg = etcd.as_ref().clone();
        cfg.tls = self
            .etcd
            .ca_file
            .clone()
            .map(|ca_file| meshd_meta_etcd::EtcdTls {
                ca_file,
                cert_file: self.etcd.cert_file.clone(),
                key_file: self.etcd.key_file.clone(),
            });
        cfg.credentials = self
            .etcd
            .credentials()?
            .map(|(user, password)| meshd_meta_etcd::EtcdCredentials { user, password });
        Ok(Some(cfg))
    }

    /// The JetStream connection meshd opens: `--log`'s servers with the retention
    /// flags and the `--nats-*` TLS and credentials (the password file is read now).
    /// `None`: the embedded log.
    pub fn nats_connection(&self) -> anyhow::Result<Option<meshd_log_nats::NatsConfig>> {
        let LogBackend::Nats(nats) = &self.log else {
            return Ok(None);
        };
        let mut cfg = nats.as_ref().clone();
        cfg.retention = self.retention();
        cfg.tls = self
            .nats
            .ca_file
            .clone()
            .map(|ca_file| meshd_log_nats::NatsTls {
                ca_file,
                cert_file: self.nats.cert_file.clone(),
                key_file: self.nats.key_file.clone(),
            });
        cfg.credentials = self
            .nats
            .credentials()?
            .map(|(user, password)| meshd_log_nats::NatsCredentials { user, password });
        Ok(Some(cfg))
    }

    pub fn resolve(args: ServeArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let listen = args
            .listen
            .or(file.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.to_string());
        let listen: SocketAddr = listen
            .parse()
            .map_err(|e| invalid("--listen", &listen, e))?;
        let meta = args.meta.or(file.meta).unwrap_or_else(|| "embedded".into());
        let meta = if meta == "embedded" {
            MetaBackend::Embedded
        } else if meta.starts_with("etcd://") {
            MetaBackend::Etcd(Box::new(
                meshd_meta_etcd::EtcdConfig::parse(&meta)
                    .map_err(|e| invalid("--meta", &meta, e))?,
            ))
        } else {
            return Err(invalid(
                "--meta",
                &meta,
                "expected `embedded` or `etcd://host:port[,host:port...]`",
            ));
        };
        let log = args.log.or(file.log).unwrap_or_else(|| "embedded".into());
        let log = if log == "embedded" {
            LogBackend::Embedded
        } else if log.starts_with("nats://") {
            LogBackend::Nats(Box::new(
                meshd_log_nats::NatsConfig::parse(&log).map_err(|e| invalid("--log", &log, e))?,
            ))
        } else {
            return Err(invalid(
                "--log",
                &log,
                "expected `embedded` or `nats://host:port[,host:port...]`",
            ));
        };
        let lease_ttl_ms = args
            .lease_ttl_ms
            .or(file.lease_ttl_ms)
            .unwrap_or(DEFAULT_LEASE_TTL_MS);
        let config = Config {
            rebalance_delay_ms: args
                .rebalance_delay_ms
                .or(file.rebalance_delay_ms)
                .unwrap_or(lease_ttl_ms.saturating_mul(3)),
            listen,
            data_dir: args
                .data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR)),
            meta,
            log,
            instance_id: args.instance_id.or(file.instance_id),
            lease_ttl_ms,
            delivery_flush_ms: args
                .delivery_flush_ms
                .or(file.delivery_flush_ms)
                .unwrap_or(DEFAULT_DELIVERY_FLUSH_MS),
            insecure_listen: args.insecure_listen || file.insecure_listen.unwrap_or(false),
            cluster_secret_file: args.cluster_secret_file.or(file.cluster_secret_file),
            client_token_file: args.client_token_file.or(file.client_token_file),
            admin_token_file: args.admin_token_file.or(file.admin_token_file),
            max_in_flight: args
                .max_in_flight
                .or(file.max_in_flight)
                .unwrap_or(DEFAULT_MAX_IN_FLIGHT),
            park_retries_after_ms: args
                .park_retries_after_ms
                .or(file.park_retries_after_ms)
                .unwrap_or(meshd_dispatch::config::DEFAULT_PARK_RETRIES_AFTER_MS),
            log_retention_hours: args
                .log_retention_hours
                .or(file.log_retention_hours)
                .unwrap_or(DEFAULT_LOG_RETENTION_HOURS),
            log_retention_bytes: args.log_retention_bytes.or(file.log_retention_bytes),
            checkpoint_ms: args
                .checkpoint_ms
                .or(file.checkpoint_ms)
                .unwrap_or(DEFAULT_CHECKPOINT_MS),
            task_retention_hours: args
                .task_retention_hours
                .or(file.task_retention_hours)
                .unwrap_or(DEFAULT_TASK_RETENTION_HOURS),
            deadletter_retention_hours: args
                .deadletter_retention_hours
                .or(file.deadletter_retention_hours)
                .unwrap_or(DEFAULT_DEADLETTER_RETENTION_HOURS),
            tls_cert: args.tls_cert.or(file.tls_cert),
            tls_key: args.tls_key.or(file.tls_key),
            cluster_ca_file: args.cluster_ca_file.or(file.cluster_ca_file),
            push_ca_file: args.push_ca_file.or(file.push_ca_file),
            wal_recovery: match args.wal_recovery.or(file.wal_recovery).as_deref() {
                None | Some("strict") => meshd_local::WalRecovery::Strict,
                Some("point-in-time") => meshd_local::WalRecovery::PointInTime,
                Some(other) => {
                    return Err(invalid(
                        "--wal-recovery",
                        other,
                        "expected `strict` or `point-in-time`",
                    ))
                }
            },
            max_connections: args
                .max_connections
                .or(file.max_connections)
                .unwrap_or(DEFAULT_MAX_CONNECTIONS),
            max_requests: args
                .max_requests
                .or(file.max_requests)
                .unwrap_or(DEFAULT_MAX_REQUESTS),
            max_long_polls: args
                .max_long_polls
                .or(file.max_long_polls)
                .unwrap_or(DEFAULT_MAX_LONG_POLLS),
            max_streams_per_token: args
                .max_streams_per_token
                .or(file.max_streams_per_token)
                .unwrap_or(0),
            max_dedup_entries: args
                .max_dedup_entries
                .or(file.max_dedup_entries)
                .unwrap_or(DEFAULT_MAX_DEDUP_ENTRIES),
            max_body_memory: args
                .max_body_memory
                .or(file.max_body_memory)
                .unwrap_or(DEFAULT_MAX_BODY_MEMORY),
            meta_compaction_retention: args
                .meta_compaction_retention
                .or(file.meta_compaction_retention)
                .unwrap_or(DEFAULT_META_COMPACTION_RETENTION),
            limits: Limits {
                max_response_bytes: args
                    .max_response_bytes
                    .or(file.max_response_bytes)
                    .unwrap_or(DEFAULT_MAX_RESPONSE_BYTES),
                max_tasks: args
                    .max_tasks
                    .or(file.max_tasks)
                    .unwrap_or(DEFAULT_MAX_TASKS),
                max_tasks_per_agent: args
                    .max_tasks_per_agent
                    .or(file.max_tasks_per_agent)
                    .unwrap_or(DEFAULT_MAX_TASKS_PER_AGENT),
                max_task_bytes: args
                    .max_task_bytes
                    .or(file.max_task_bytes)
                    .unwrap_or(DEFAULT_MAX_TASK_BYTES),
                max_sessions: args
                    .max_sessions
                    .or(file.max_sessions)
                    .unwrap_or(DEFAULT_MAX_SESSIONS),
                max_topics: args
                    .max_topics
                    .or(file.max_topics)
                    .unwrap_or(DEFAULT_MAX_TOPICS),
                max_subscriptions: args
                    .max_subscriptions
                    .or(file.max_subscriptions)
                    .unwrap_or(DEFAULT_MAX_SUBSCRIPTIONS),
            },
            header_timeout_ms: args
                .header_timeout_ms
                .or(file.header_timeout_ms)
                .unwrap_or(DEFAULT_HEADER_TIMEOUT_MS),
            body_timeout_ms: args
                .body_timeout_ms
                .or(file.body_timeout_ms)
                .unwrap_or(DEFAULT_BODY_TIMEOUT_MS),
            idle_timeout_ms: args
                .idle_timeout_ms
                .or(file.idle_timeout_ms)
                .unwrap_or(DEFAULT_IDLE_TIMEOUT_MS),
            etcd: Secured {
                ca_file: args.etcd_ca_file.or(file.etcd_ca_file),
                cert_file: args.etcd_cert_file.or(file.etcd_cert_file),
                key_file: args.etcd_key_file.or(file.etcd_key_file),
                user: args.etcd_user.or(file.etcd_user),
                password_file: args.etcd_password_file.or(file.etcd_password_file),
            },
            nats: Secured {
                ca_file: args.nats_ca_file.or(file.nats_ca_file),
                cert_file: args.nats_cert_file.or(file.nats_cert_file),
                key_file: args.nats_key_file.or(file.nats_key_file),
                user: args.nats_user.or(file.nats_user),
                password_file: args.nats_password_file.or(file.nats_password_file),
            },
            metrics_token_file: args.metrics_token_file.or(file.metrics_token_file),
            allowed_origins: args
                .allowed_origins
                .or(file.allowed_origins)
                .unwrap_or_default()
                .iter()
                .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
                .filter(|o| !o.is_empty())
                .collect(),
            allowed_hosts: args
                .allowed_hosts
                .or(file.allowed_hosts)
                .unwrap_or_default()
                .iter()
                .map(|h| h.trim().to_ascii_lowercase())
                .filter(|h| !h.is_empty())
                .collect(),
            advertise: args.advertise.or(file.advertise),
            push_deny_cidr: cidrs(
                "--push-deny-cidr",
                args.push_deny_cidr.or(file.push_deny_cidr),
            )?,
            push_allow_cidr: cidrs(
                "--push-allow-cidr",
                args.push_allow_cidr.or(file.push_allow_cidr),
            )?,
        };
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let tokens = self.client_token_file.is_some() || self.admin_token_file.is_some();
        if !self.listen.ip().is_loopback() && !self.insecure_listen && !tokens {
            return Err(invalid(
                "--listen",
                self.listen,
                "without access tokens meshd listens on loopback only; pass --insecure-listen to override",
            ));
        }
        if !(1000..=600_000).contains(&self.lease_ttl_ms) {
            return Err(invalid(
                "--lease-ttl-ms",
                self.lease_ttl_ms,
                "must be between 1000 and 600000",
            ));
        }
        if !(10..=1000).contains(&self.delivery_flush_ms) {
            return Err(invalid(
                "--delivery-flush-ms",
                self.delivery_flush_ms,
                "must be between 10 and 1000",
            ));
        }
        if !(1..=86_400_000).contains(&self.park_retries_after_ms) {
            return Err(invalid(
                "--park-retries-after-ms",
                self.park_retries_after_ms,
                "must be between 1 and 86400000",
            ));
        }
        if !(1..=100_000).contains(&self.max_in_flight) {
            return Err(invalid(
                "--max-in-flight",
                self.max_in_flight,
                "must be between 1 and 100000",
            ));
        }
        let ledger_cap = meshd_stores::attempts::MAX_ENTRIES as u64;
        if self.log.is_cluster() && self.max_in_flight > ledger_cap {
            return Err(invalid(
                "--max-in-flight",
                self.max_in_flight,
                format!("in cluster mode (a JetStream log) at most {ledger_cap}: a new owner reads a partition's whole attempt ledger from Meta"),
            ));
        }
        if !(100..=600_000).contains(&self.checkpoint_ms) {
            return Err(invalid(
                "--checkpoint-ms",
                self.checkpoint_ms,
                "must be between 100 and 600000",
            ));
        }
        for (name, v) in [
            ("--log-retention-hours", self.log_retention_hours),
            ("--task-retention-hours", self.task_retention_hours),
            (
                "--deadletter-retention-hours",
                self.deadletter_retention_hours,
            ),
        ] {
            if !HOURS.contains(&v) {
                return Err(invalid(name, v, "must be between 1 and 876000 hours"));
            }
        }
        if self.log_retention_bytes == Some(0) {
            return Err(invalid(
                "--log-retention-bytes",
                0,
                "must be at least 1 (leave it unset for no size limit)",
            ));
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(invalid(
                "--tls-cert",
                format!("{:?} / {:?}", self.tls_cert, self.tls_key),
                "--tls-cert and --tls-key go together",
            ));
        }
        for (name, v, range) in [
            ("--max-connections", self.max_connections, 1..=1_000_000),
            ("--max-requests", self.max_requests, 1..=100_000),
            ("--max-long-polls", self.max_long_polls, 1..=100_000),
            (
                "--max-streams-per-token",
                self.max_streams_per_token,
                0..=self.max_long_polls,
            ),
            (
                "--max-dedup-entries",
                self.max_dedup_entries,
                1..=1_000_000_000,
            ),
            (
                "--max-body-memory",
                self.max_body_memory,
                crate::http::MAX_BODY_BYTES as u64..=(1 << 40),
            ),
            // At least one event of the largest size (1 MiB) and its JSON; at most
            // what one peer answer may carry between instances.
            (
                "--max-response-bytes",
                self.limits.max_response_bytes,
                (1 << 20)..=(1 << 30),
            ),
            ("--max-tasks", self.limits.max_tasks, 1..=100_000_000),
            (
                "--max-tasks-per-agent",
                self.limits.max_tasks_per_agent,
                1..=100_000_000,
            ),
            // At least one task of the largest size (its input and output).
            (
                "--max-task-bytes",
                self.limits.max_task_bytes,
                (4 << 20)..=(1 << 40),
            ),
            ("--max-sessions", self.limits.max_sessions, 1..=10_000_000),
            (
                "--rebalance-delay-ms",
                self.rebalance_delay_ms,
                0..=3_600_000,
            ),
            // 0 is off; otherwise at least 100 revisions, so watchers that fall behind
            // by a little can still resume.
            (
                "--meta-compaction-retention",
                if self.meta_compaction_retention == 0 {
                    100
                } else {
                    self.meta_compaction_retention
                },
                100..=1_000_000_000,
            ),
            ("--max-topics", self.limits.max_topics, 1..=1_000_000),
            (
                "--max-subscriptions",
                self.limits.max_subscriptions,
                1..=1_000_000,
            ),
            ("--header-timeout-ms", self.header_timeout_ms, 100..=600_000),
            ("--body-timeout-ms", self.body_timeout_ms, 100..=600_000),
            // A long poll waits at most half a second less than this.
            ("--idle-timeout-ms", self.idle_timeout_ms, 1000..=3_600_000),
        ] {
            if !range.contains(&v) {
                return Err(invalid(
                    name,
                    v,
                    format!("must be between {} and {}", range.start(), range.end()),
                ));
            }
        }
        if self.max_long_polls >= self.max_requests {
            return Err(invalid(
                "--max-long-polls",
                self.max_long_polls,
                format!(
                    "must be below --max-requests ({}), so waiting pulls cannot take every request slot",
                    self.max_requests
                ),
            ));
        }
        self.etcd.validate("etcd")?;
        self.nats.validate("nats")?;
        if self.etcd.is_set() && !matches!(self.meta, MetaBackend::Etcd(_)) {
            return Err(invalid(
                "--etcd-ca-file",
                "",
                "etcd TLS and user options need --meta etcd://...",
            ));
        }
        if self.nats.is_set() && !self.log.is_cluster() {
            return Err(invalid(
                "--nats-ca-file",
                "",
                "NATS TLS and user options need --log nats://...",
            ));
        }
        for o in &self.allowed_origins {
            let ok = ["http://", "https://"].iter().any(|scheme| {
                o.strip_prefix(scheme).is_some_and(|rest| {
                    !rest.is_empty() && !rest.contains(['/', '?', '#', '@', ' '])
                })
            });
            if !ok {
                return Err(invalid(
                    "--allowed-origins",
                    o,
                    "each origin is scheme://host[:port] (http or https), without a path",
                ));
            }
        }
        for h in &self.allowed_hosts {
            if h.contains(['/', ':', '@', ' ']) && !h.starts_with('[') {
                return Err(invalid(
                    "--allowed-hosts",
                    h,
                    "each entry is a host name or address, without scheme or port",
                ));
            }
        }
        match &self.advertise {
            Some(a)
                if !meshd_client::split_host_port(a)
                    .is_some_and(|(h, p)| !h.is_empty() && p != 0) =>
            {
                return Err(invalid(
                    "--advertise",
                    a,
                    "expected host:port (a name or address other instances can reach)",
                ));
            }
            None if self.log.is_cluster() && self.listen.ip().is_unspecified() => {
                return Err(invalid(
                    "--listen",
                    self.listen,
                    "in cluster mode an unspecified address cannot be called by the other instances: give --advertise host:port",
                ));
            }
            _ => {}
        }
        if let Some(id) = &self.instance_id {
            if !meshd_stores::names::is_valid_name(id) {
                return Err(invalid(
                    "--instance-id",
                    id,
                    "1-249 characters of [A-Za-z0-9._-]",
                ));
            }
        }
        Ok(())
    }
}

/// Address ranges of a `--push-*-cidr` flag; the error names the flag.
fn cidrs(
    flag: &'static str,
    values: Option<Vec<String>>,
) -> Result<Vec<meshd_runtime::egress::Cidr>, ConfigError> {
    values
        .unwrap_or_default()
        .iter()
        .filter(|v| !v.trim().is_empty())
        .map(|v| meshd_runtime::egress::Cidr::parse(v).map_err(|e| invalid(flag, v, e)))
        .collect()
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = Config::resolve(ServeArgs::default()).unwrap();
        assert_eq!(c.listen.to_string(), DEFAULT_LISTEN);
        assert_eq!(c.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert_eq!(c.meta, MetaBackend::Embedded);
        assert_eq!(c.lease_ttl_ms, 10_000);
    }

    #[test]
    fn flags_win_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meshd.toml");
        std::fs::write(&path, "listen = \"127.0.0.1:9999\"\nlease_ttl_ms = 5000\n").unwrap();
        let c = Config::resolve(ServeArgs {
            config: Some(path),
            listen: Some("127.0.0.1:1234".into()),
            ..ServeArgs::default()
        })
        .unwrap();
        assert_eq!(c.listen.port(), 1234);
        assert_eq!(c.lease_ttl_ms, 5000);
    }

    #[test]
    fn bad_values_are_named() {
        let err = Config::resolve(ServeArgs {
            meta: Some("zookeeper://x".into()),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("--meta"), "{err}");
        let err = Config::resolve(ServeArgs {
            listen: Some("0.0.0.0:7070".into()),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("--insecure-listen"), "{err}");
        let err = Config::resolve(ServeArgs {
            lease_ttl_ms: Some(5),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("--lease-ttl-ms"), "{err}");
    }

    #[test]
    fn the_log_is_embedded_or_a_jetstream_url_and_cluster_mode_caps_in_flight() {
        let c = Config::resolve(ServeArgs::default()).unwrap();
        assert_eq!(c.log, LogBackend::Embedded);
        let c = Config::resolve(ServeArgs {
            log: Some("nats://127.0.0.1:4222".into()),
            ..ServeArgs::default()
        })
        .unwrap();
        assert!(c.log.is_cluster());
        for bad in ["kafka://x", "nats://", "nats://h:1?replicas=9"] {
            let err = Config::resolve(ServeArgs {
                log: Some(bad.into()),
                ..ServeArgs::default()
            })
            .unwrap_err();
            assert!(err.to_string().contains("--log"), "{bad}: {err}");
        }
        let err = Config::resolve(ServeArgs {
            log: Some("nats://127.0.0.1:4222".into()),
            max_in_flight: Some(50_000),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("--max-in-flight"), "{err}");
    }

    #[test]
    fn unknown_file_keys_are_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meshd.toml");
        std::fs::write(&path, "lisen = \"x\"\n").unwrap();
        let err = Config::resolve(ServeArgs {
            config: Some(path),
            ..ServeArgs::default()
        })
        .unwrap_err();
        assert!(err.to_string().contains("lisen"), "{err}");
    }
}
