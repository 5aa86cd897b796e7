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
    log_retention_hours: Option<u64>,
    log_retention_bytes: Option<u64>,
    checkpoint_ms: Option<u64>,
    task_retention_hours: Option<u64>,
    deadletter_retention_hours: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaBackend {
    Embedded,
    Etcd(String),
}

/// Where the event log lives. A JetStream log is shared: instances on it run in
/// cluster mode and split its partitions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogBackend {
    Embedded,
    Nats(String),
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
    pub log_retention_hours: u64,
    pub log_retention_bytes: Option<u64>,
    pub checkpoint_ms: u64,
    pub task_retention_hours: u64,
    pub deadletter_retention_hours: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("invalid value {value:?} for {name}: {reason}")]
    Invalid {
        name: &'static str,
        value: String,
        reason: String,
    },
}

fn invalid(name: &'static str, value: impl ToString, reason: impl ToString) -> ConfigError {
    ConfigError::Invalid {
        name,
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
/// Retention hours: at most 100 years.
const HOURS: std::ops::RangeInclusive<u64> = 1..=876_000;

impl Config {
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
            meshd_meta_etcd::EtcdConfig::parse(&meta).map_err(|e| invalid("--meta", &meta, e))?;
            MetaBackend::Etcd(meta)
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
            meshd_log_nats::NatsConfig::parse(&log).map_err(|e| invalid("--log", &log, e))?;
            LogBackend::Nats(log)
        } else {
            return Err(invalid(
                "--log",
                &log,
                "expected `embedded` or `nats://host:port[,host:port...]`",
            ));
        };
        let config = Config {
            listen,
            data_dir: args
                .data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR)),
            meta,
            log,
            instance_id: args.instance_id.or(file.instance_id),
            lease_ttl_ms: args
                .lease_ttl_ms
                .or(file.lease_ttl_ms)
                .unwrap_or(DEFAULT_LEASE_TTL_MS),
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
                format!("in cluster mode (a JetStream log) at most {ledger_cap}: every in-flight attempt count of a partition is kept in one Meta record"),
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
        if let Some(id) = &self.instance_id {
            if !valid_name(id) {
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

/// Names (topics, subscriptions, client ids, instances): 1–249 of `[A-Za-z0-9._-]`.
pub fn valid_name(s: &str) -> bool {
    (1..=249).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
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
