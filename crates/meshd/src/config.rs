//! `meshd serve` configuration: flags, then `MESHD_*` environment variables, then an
//! optional TOML file (`--config`), then defaults. A plain struct with `validate()`
//! (house style 14); the error names the bad value.
//!
//! Every setting is declared once, in the `settings!` block below: its help text, its
//! environment variable, its default, the range it accepts and how its value is read.
//! From that one line come the flags and the file's keys ([`ServeArgs`]), the merge
//! (flag or environment over the file) and the resolved [`Config`] the server reads.
//! What involves more than one setting is checked in [`Config::validate`].

use backends::{log_backend, meta_backend};
use error::invalid;
use meshd_local::WalRecovery;
use meshd_runtime::egress::Cidr;
use read::{
    at_least_one, between, cidrs, flag, host_port, hosts, instance_name, origins, read_file,
    socket_addr, wal_recovery, Accepts, HOURS,
};
use std::net::SocketAddr;
use std::path::PathBuf;

mod backends;
mod error;
mod read;

pub use backends::{LogBackend, MetaBackend, Secured};
pub use error::ConfigError;

/// Declares the settings, one entry each:
///
/// ```text
/// /// Help text (`--help` shows it).
/// name: T [=> Resolved] [= default] [, in accepts] [, by read], env "MESHD_NAME";
/// ```
///
/// `T` is what the flag, the environment variable and the file's key `name` give (an
/// `Option`, or a `bool` flag); the flag is `--name`, with `-` for `_`. With a default,
/// `Config.name` is the `T` inside the `Option`, the default applied. `in` gives the
/// [`Accepts`] range [`Config::validate`] checks; `by` names the function that reads
/// the value into `Resolved` (given the flag, for its errors).
macro_rules! settings {
    ($(
        $(#[$attr:meta])*
        $name:ident: $t:ty $(=> $to:ty)? $(= $default:expr)? $(, in $accepts:expr)?
            $(, by $read:path)?, env $env:literal;
    )*) => {
        /// `meshd serve`'s settings as given: flags and environment variables, or the
        /// keys of the TOML file (the same names, with `_` for `-`). Everything is
        /// optional here, so that a value given neither as a flag nor in the
        /// environment can come from the file; [`Config::resolve`] applies defaults.
        #[derive(clap::Args, serde::Deserialize, Debug, Default, Clone)]
        #[serde(deny_unknown_fields, default)]
        pub struct ServeArgs {
            $( $(#[$attr])* #[arg(long, env = $env)] pub $name: $t, )*
        }

        impl ServeArgs {
            /// These settings (flags, environment) over the file's.
            fn over(self, file: ServeArgs) -> ServeArgs {
                ServeArgs { $( $name: Merge::over(self.$name, file.$name), )* }
            }
        }

        /// The effective configuration: every setting of [`ServeArgs`] with its default
        /// applied and its value read (addresses, backends, ranges of addresses).
        #[derive(Clone, Debug)]
        pub struct Config {
            $( pub $name: resolved_ty!($t $(=> $to)? $(= $default)?), )*
        }

        impl Config {
            fn read(args: ServeArgs) -> Result<Config, ConfigError> {
                // In declaration order, so a default may name a setting above it.
                $( let $name = resolve!(args.$name; $name $(= $default)? $(, by $read)?); )*
                Ok(Config { $( $name, )* })
            }

            /// Every setting with a range: its flag, its value and the range.
            fn bounded(&self) -> Vec<(String, u64, Accepts)> {
                vec![$( $( (flag(stringify!($name)), self.$name, $accepts), )? )*]
            }
        }
    };
}

macro_rules! resolved_ty {
    ($t:ty) => {
        $t
    };
    ($t:ty = $default:expr) => {
        <$t as Defaulted>::Value
    };
    ($t:ty => $to:ty $(= $default:expr)?) => {
        $to
    };
}

macro_rules! resolve {
    ($v:expr; $name:ident) => {
        $v
    };
    ($v:expr; $name:ident = $default:expr) => {
        $v.unwrap_or_else(|| $default)
    };
    ($v:expr; $name:ident, by $read:path) => {
        $read(&flag(stringify!($name)), $v)?
    };
    ($v:expr; $name:ident = $default:expr, by $read:path) => {
        $read(&flag(stringify!($name)), $v.unwrap_or_else(|| $default))?
    };
}

settings! {
    /// TOML file with the same settings (names as the flags, with `_` for `-`).
    #[serde(skip)]
    config: Option<PathBuf>, env "MESHD_CONFIG";
    /// HTTP address; port 0 picks a free port and prints it.
    listen: Option<String> => SocketAddr = "127.0.0.1:7070".into(), by socket_addr,
        env "MESHD_LISTEN";
    /// Local RocksDB directory.
    data_dir: Option<PathBuf> = "./meshd-data".into(), env "MESHD_DATA_DIR";
    /// `embedded`, or `etcd://host:port[,host:port...]`.
    meta: Option<String> => MetaBackend = "embedded".into(), by meta_backend, env "MESHD_META";
    /// The event log backend: `embedded`, or `nats://host:port[,host:port...][?...]`
    /// (NATS JetStream, shared by the instances of a cluster).
    log: Option<String> => LogBackend = "embedded".into(), by log_backend, env "MESHD_LOG";
    /// This instance's name in the cluster (default: a stable id stored in the data dir).
    instance_id: Option<String>, by instance_name, env "MESHD_INSTANCE_ID";
    /// Membership and partition-ownership lease TTL in milliseconds.
    lease_ttl_ms: Option<u64> = 10_000, in between(1000, 600_000), env "MESHD_LEASE_TTL_MS";
    /// DeliveryStateStore flush interval in milliseconds (10-1000).
    delivery_flush_ms: Option<u64> = 100, in between(10, 1000), env "MESHD_DELIVERY_FLUSH_MS";
    /// Listen on a non-loopback address without access tokens.
    insecure_listen: bool, env "MESHD_INSECURE_LISTEN";
    /// Cluster mode: a file whose first line is the secret of the routes between
    /// instances (default: a random secret the first instance stores in Meta).
    cluster_secret_file: Option<PathBuf>, env "MESHD_CLUSTER_SECRET_FILE";
    /// Bearer tokens of clients (publish, pull, ack, nack, sessions, tasks), one per
    /// line; with this or --admin-token-file every /v1 route needs a token.
    client_token_file: Option<PathBuf>, env "MESHD_CLIENT_TOKEN_FILE";
    /// Bearer tokens of operators (every /v1 route), one per line.
    admin_token_file: Option<PathBuf>, env "MESHD_ADMIN_TOKEN_FILE";
    /// In-flight deliveries per subscription and partition (1-100000).
    max_in_flight: Option<u64> = 1000, in between(1, 100_000), env "MESHD_MAX_IN_FLIGHT";
    /// A retry due this many milliseconds ahead or more (a nack's delay_ms, a long
    /// backoff) is parked instead of holding the committed offset (1-86400000).
    park_retries_after_ms: Option<u64> = meshd_dispatch::config::DEFAULT_PARK_RETRIES_AFTER_MS,
        in between(1, 86_400_000), env "MESHD_PARK_RETRIES_AFTER_MS";
    /// Events older than this many hours are removed from the log (1-876000).
    log_retention_hours: Option<u64> = 168, in HOURS, env "MESHD_LOG_RETENTION_HOURS";
    /// The oldest events of a partition are removed while it holds more bytes.
    log_retention_bytes: Option<u64>, by at_least_one, env "MESHD_LOG_RETENTION_BYTES";
    /// Cluster mode: offset checkpoint interval in milliseconds (100-600000).
    checkpoint_ms: Option<u64> = 1000, in between(100, 600_000), env "MESHD_CHECKPOINT_MS";
    /// How long terminal tasks are kept, in hours (1-876000).
    task_retention_hours: Option<u64> = 168, in HOURS, env "MESHD_TASK_RETENTION_HOURS";
    /// How long dead letters are kept, in hours (1-876000).
    deadletter_retention_hours: Option<u64> = 336, in HOURS, env "MESHD_DEADLETTER_RETENTION_HOURS";
    /// Cluster mode with --tls-cert: the PEM CA that signed the other instances'
    /// certificates (default: the system's CA bundle).
    cluster_ca_file: Option<PathBuf>, env "MESHD_CLUSTER_CA_FILE";
    /// The PEM CA that `https://` push endpoints' certificates are checked against
    /// (default: the system's CA bundle).
    push_ca_file: Option<PathBuf>, env "MESHD_PUSH_CA_FILE";
    /// How a damaged write-ahead log is treated at start-up: `strict` (refuse to
    /// start) or `point-in-time` (open up to the damage, drop the rest).
    wal_recovery: Option<String> => WalRecovery = "strict".into(), by wal_recovery,
        env "MESHD_WAL_RECOVERY";
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    tls_cert: Option<PathBuf>, env "MESHD_TLS_CERT";
    /// The PEM private key of --tls-cert.
    tls_key: Option<PathBuf>, env "MESHD_TLS_KEY";
    /// Open client connections at most; at the cap accepting pauses (1-1000000).
    max_connections: Option<u64> = 4096, in between(1, 1_000_000), env "MESHD_MAX_CONNECTIONS";
    /// Requests handled at a time; more are refused with 429 (1-100000).
    max_requests: Option<u64> = 1024, in between(1, 100_000), env "MESHD_MAX_REQUESTS";
    /// Long polls (pull with wait_ms) waiting at a time; more get 429 (1-100000,
    /// below --max-requests).
    max_long_polls: Option<u64> = 512, in between(1, 100_000), env "MESHD_MAX_LONG_POLLS";
    /// Streams (SSE and WebSocket) one client token may hold at a time; more get 429
    /// (0: off, the default; at most --max-long-polls).
    max_streams_per_token: Option<u64> = 0, env "MESHD_MAX_STREAMS_PER_TOKEN";
    /// Publish-dedup entries held at a time; at the cap a deduplicated publish gets
    /// 429 dedup-full until the oldest entry expires (1-1000000000).
    max_dedup_entries: Option<u64> = 10_000_000, in between(1, 1_000_000_000),
        env "MESHD_MAX_DEDUP_ENTRIES";
    /// Bytes of request bodies held at a time; a body that does not fit gets 429.
    max_body_memory: Option<u64> = 256 * 1024 * 1024,
        in between(crate::http::MAX_BODY_BYTES as u64, 1 << 40), env "MESHD_MAX_BODY_MEMORY";
    // At least one event of the largest size (1 MiB) and its JSON; at most what one
    // peer answer may carry between instances.
    /// Stored event bytes one answer holds at most (pull `max_bytes` default and
    /// ceiling, browse, dead-letter and task lists); at least one delivery.
    max_response_bytes: Option<u64> = 16 * 1024 * 1024, in between(1 << 20, 1 << 30),
        env "MESHD_MAX_RESPONSE_BYTES";
    /// Non-terminal tasks at most (429 quota-exceeded beyond).
    max_tasks: Option<u64> = 100_000, in between(1, 100_000_000), env "MESHD_MAX_TASKS";
    /// Non-terminal tasks per agent at most.
    max_tasks_per_agent: Option<u64> = 10_000, in between(1, 100_000_000),
        env "MESHD_MAX_TASKS_PER_AGENT";
    // At least one task of the largest size (its input and output).
    /// Bytes kept in Meta for tasks of every state at most.
    max_task_bytes: Option<u64> = 512 * 1024 * 1024, in between(4 << 20, 1 << 40),
        env "MESHD_MAX_TASK_BYTES";
    /// Live sessions at most (a takeover is never refused).
    max_sessions: Option<u64> = 10_000, in between(1, 10_000_000), env "MESHD_MAX_SESSIONS";
    /// Topics at most.
    max_topics: Option<u64> = 10_000, in between(1, 1_000_000), env "MESHD_MAX_TOPICS";
    /// Subscriptions at most.
    max_subscriptions: Option<u64> = 10_000, in between(1, 1_000_000),
        env "MESHD_MAX_SUBSCRIPTIONS";
    /// Cluster mode: how long a member must have been a member before a live owner
    /// hands it a partition (default 3 lease TTLs; orphaned partitions move at once).
    rebalance_delay_ms: Option<u64> = lease_ttl_ms.saturating_mul(3), in between(0, 3_600_000),
        env "MESHD_REBALANCE_DELAY_MS";
    // Otherwise at least 100 revisions, so watchers that fall behind by a little can
    // still resume.
    /// Revisions of Meta's history meshd keeps when it compacts it (0: meshd does
    /// not compact, for an etcd shared with others that compact it).
    meta_compaction_retention: Option<u64> = 10_000, in between(100, 1_000_000_000).or_off(),
        env "MESHD_META_COMPACTION_RETENTION";
    /// Time a client has to send its request headers (and the TLS handshake), ms.
    header_timeout_ms: Option<u64> = 10_000, in between(100, 600_000),
        env "MESHD_HEADER_TIMEOUT_MS";
    /// Time a client has to send its request body, ms (408 after it).
    body_timeout_ms: Option<u64> = 30_000, in between(100, 600_000), env "MESHD_BODY_TIMEOUT_MS";
    // A long poll waits at most half a second less than this.
    /// A connection with no traffic for this long is closed, ms; a long poll waits at
    /// most 0.5 s less.
    idle_timeout_ms: Option<u64> = 120_000, in between(1000, 3_600_000),
        env "MESHD_IDLE_TIMEOUT_MS";
    /// etcd over TLS: the PEM CA that signed etcd's certificate.
    etcd_ca_file: Option<PathBuf>, env "MESHD_ETCD_CA_FILE";
    /// etcd client certificate (PEM), with --etcd-key-file.
    etcd_cert_file: Option<PathBuf>, env "MESHD_ETCD_CERT_FILE";
    /// The PEM private key of --etcd-cert-file.
    etcd_key_file: Option<PathBuf>, env "MESHD_ETCD_KEY_FILE";
    /// etcd user (etcd auth), with --etcd-password-file.
    etcd_user: Option<String>, env "MESHD_ETCD_USER";
    /// A file whose first line is the etcd user's password.
    etcd_password_file: Option<PathBuf>, env "MESHD_ETCD_PASSWORD_FILE";
    /// NATS over TLS: the PEM CA that signed nats-server's certificate.
    nats_ca_file: Option<PathBuf>, env "MESHD_NATS_CA_FILE";
    /// NATS client certificate (PEM), with --nats-key-file.
    nats_cert_file: Option<PathBuf>, env "MESHD_NATS_CERT_FILE";
    /// The PEM private key of --nats-cert-file.
    nats_key_file: Option<PathBuf>, env "MESHD_NATS_KEY_FILE";
    /// NATS user, with --nats-password-file.
    nats_user: Option<String>, env "MESHD_NATS_USER";
    /// A file whose first line is the NATS user's password.
    nats_password_file: Option<PathBuf>, env "MESHD_NATS_PASSWORD_FILE";
    /// Bearer tokens that may read /metrics, one per line (admin tokens may too);
    /// without it /metrics is open.
    metrics_token_file: Option<PathBuf>, env "MESHD_METRICS_TOKEN_FILE";
    /// Origins (`scheme://host[:port]`) whose browser requests are allowed, with CORS
    /// answers; comma-separated. Other cross-origin requests are 403.
    #[arg(value_delimiter = ',')]
    allowed_origins: Option<Vec<String>> => Vec<String>, by origins, env "MESHD_ALLOWED_ORIGINS";
    /// Host names (besides loopback ones) accepted in `Host` while meshd listens on
    /// loopback without tokens; comma-separated.
    #[arg(value_delimiter = ',')]
    allowed_hosts: Option<Vec<String>> => Vec<String>, by hosts, env "MESHD_ALLOWED_HOSTS";
    /// The `host:port` other instances call this one at (default: the listen
    /// address; required when that is unspecified, such as 0.0.0.0).
    advertise: Option<String>, by host_port, env "MESHD_ADVERTISE";
    /// Address ranges push never connects to (`10.0.0.0/8,fd00::/8`), besides
    /// meshd's own endpoints and link-local ranges.
    #[arg(value_delimiter = ',')]
    push_deny_cidr: Option<Vec<String>> => Vec<Cidr>, by cidrs, env "MESHD_PUSH_DENY_CIDR";
    /// When given, push connects only to addresses in these ranges (deny wins).
    #[arg(value_delimiter = ',')]
    push_allow_cidr: Option<Vec<String>> => Vec<Cidr>, by cidrs, env "MESHD_PUSH_ALLOW_CIDR";
    /// Test knob, hidden: how often the Meta compaction check runs, in milliseconds
    /// (default 30 s); the footprint tests shorten it.
    #[arg(hide = true)]
    meta_compaction_check_ms: Option<u64>, env "MESHD_META_COMPACTION_CHECK_MS";
}

/// A setting with a default: given as an `Option<T>`, resolved to the `T` (public
/// because [`Config`]'s fields name it).
pub trait Defaulted {
    type Value;
}

impl<T> Defaulted for Option<T> {
    type Value = T;
}

/// How a flag given on the command line or in the environment wins over the file.
trait Merge {
    fn over(self, file: Self) -> Self;
}

impl<T> Merge for Option<T> {
    fn over(self, file: Self) -> Self {
        self.or(file)
    }
}

/// A flag is on when it is given anywhere.
impl Merge for bool {
    fn over(self, file: Self) -> Self {
        self || file
    }
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

impl Config {
    /// The settings of `args`, over those of its `--config` file, over the defaults;
    /// validated.
    pub fn resolve(args: ServeArgs) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => ServeArgs::default(),
        };
        let config = Config::read(args.over(file))?;
        config.validate()?;
        Ok(config)
    }

    /// The range of every setting that has one, then what involves more than one
    /// setting (the other values were checked as they were read).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let tokens = self.client_token_file.is_some() || self.admin_token_file.is_some();
        if !self.listen.ip().is_loopback() && !self.insecure_listen && !tokens {
            return Err(invalid(
                "--listen",
                self.listen,
                "without access tokens meshd listens on loopback only; pass --insecure-listen to override",
            ));
        }
        for (flag, value, accepts) in self.bounded() {
            accepts.check(&flag, value)?;
        }
        let ledger_cap = meshd_stores::attempts::MAX_ENTRIES as u64;
        if self.log.is_cluster() && self.max_in_flight > ledger_cap {
            return Err(invalid(
                "--max-in-flight",
                self.max_in_flight,
                format!("in cluster mode (a JetStream log) at most {ledger_cap}: a new owner reads a partition's whole attempt ledger from Meta"),
            ));
        }
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(invalid(
                "--tls-cert",
                format!("{:?} / {:?}", self.tls_cert, self.tls_key),
                "--tls-cert and --tls-key go together",
            ));
        }
        between(0, self.max_long_polls)
            .check("--max-streams-per-token", self.max_streams_per_token)?;
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
        let (etcd, nats) = (self.etcd(), self.nats());
        etcd.validate("etcd")?;
        nats.validate("nats")?;
        if etcd.is_set() && !matches!(self.meta, MetaBackend::Etcd(_)) {
            return Err(invalid(
                "--etcd-ca-file",
                "",
                "etcd TLS and user options need --meta etcd://...",
            ));
        }
        if nats.is_set() && !self.log.is_cluster() {
            return Err(invalid(
                "--nats-ca-file",
                "",
                "NATS TLS and user options need --log nats://...",
            ));
        }
        if self.advertise.is_none() && self.log.is_cluster() && self.listen.ip().is_unspecified() {
            return Err(invalid(
                "--listen",
                self.listen,
                "in cluster mode an unspecified address cannot be called by the other instances: give --advertise host:port",
            ));
        }
        Ok(())
    }

    /// Answer bounds and quotas.
    pub fn limits(&self) -> Limits {
        Limits {
            max_response_bytes: self.max_response_bytes,
            max_tasks: self.max_tasks,
            max_tasks_per_agent: self.max_tasks_per_agent,
            max_task_bytes: self.max_task_bytes,
            max_sessions: self.max_sessions,
            max_topics: self.max_topics,
            max_subscriptions: self.max_subscriptions,
        }
    }

    /// TLS and credentials of the etcd connection (`--meta etcd://...` only).
    pub fn etcd(&self) -> Secured {
        Secured {
            ca_file: self.etcd_ca_file.clone(),
            cert_file: self.etcd_cert_file.clone(),
            key_file: self.etcd_key_file.clone(),
            user: self.etcd_user.clone(),
            password_file: self.etcd_password_file.clone(),
        }
    }

    /// TLS and credentials of the NATS connection (`--log nats://...` only).
    pub fn nats(&self) -> Secured {
        Secured {
            ca_file: self.nats_ca_file.clone(),
            cert_file: self.nats_cert_file.clone(),
            key_file: self.nats_key_file.clone(),
            user: self.nats_user.clone(),
            password_file: self.nats_password_file.clone(),
        }
    }

    /// Log retention from `--log-retention-hours` and `--log-retention-bytes`.
    pub fn retention(&self) -> meshd_stores::log::Retention {
        meshd_stores::log::Retention {
            max_age_ms: Some(self.log_retention_hours.saturating_mul(3_600_000)),
            max_bytes: self.log_retention_bytes,
        }
    }

    /// The etcd connection meshd opens (`None`: the embedded Meta).
    pub fn etcd_connection(&self) -> anyhow::Result<Option<meshd_meta_etcd::EtcdConfig>> {
        self.meta.etcd_connection(&self.etcd())
    }

    /// The JetStream connection meshd opens (`None`: the embedded log).
    pub fn nats_connection(&self) -> anyhow::Result<Option<meshd_log_nats::NatsConfig>> {
        self.log.nats_connection(&self.nats(), self.retention())
    }
}

#[cfg(test)]
mod tests;
