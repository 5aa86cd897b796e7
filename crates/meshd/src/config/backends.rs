//! The backends `--meta` and `--log` name, and the TLS and credentials their
//! connections are opened with (`--etcd-*`, `--nats-*`).

use super::error::{invalid, ConfigError};
use std::path::PathBuf;

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
    pub(super) fn is_set(&self) -> bool {
        *self != Secured::default()
    }

    /// `prefix` is `etcd` or `nats`, for the flag names in errors.
    pub(super) fn validate(&self, prefix: &'static str) -> Result<(), ConfigError> {
        let flag = |f: &str| format!("--{prefix}-{f}");
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(invalid(
                &flag("cert-file"),
                format!("{:?} / {:?}", self.cert_file, self.key_file),
                format!("{} and {} go together", flag("cert-file"), flag("key-file")),
            ));
        }
        if self.cert_file.is_some() && self.ca_file.is_none() {
            return Err(invalid(
                &flag("cert-file"),
                format!("{:?}", self.cert_file),
                format!("a client certificate needs {} (TLS)", flag("ca-file")),
            ));
        }
        if self.user.is_some() != self.password_file.is_some() {
            return Err(invalid(
                &flag("user"),
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

impl MetaBackend {
    /// The etcd connection meshd opens: `--meta`'s endpoints with the `--etcd-*` TLS
    /// and credentials (the password file is read now). `None`: the embedded Meta.
    pub fn etcd_connection(
        &self,
        secured: &Secured,
    ) -> anyhow::Result<Option<meshd_meta_etcd::EtcdConfig>> {
        let MetaBackend::Etcd(etcd) = self else {
            return Ok(None);
        };
        let mut cfg = etcd.as_ref().clone();
        cfg.tls = secured
            .ca_file
            .clone()
            .map(|ca_file| meshd_meta_etcd::EtcdTls {
                ca_file,
                cert_file: secured.cert_file.clone(),
                key_file: secured.key_file.clone(),
            });
        cfg.credentials = secured
            .credentials()?
            .map(|(user, password)| meshd_meta_etcd::EtcdCredentials { user, password });
        Ok(Some(cfg))
    }
}

impl LogBackend {
    /// The JetStream connection meshd opens: `--log`'s servers with the retention
    /// flags and the `--nats-*` TLS and credentials (the password file is read now).
    /// `None`: the embedded log.
    pub fn nats_connection(
        &self,
        secured: &Secured,
        retention: meshd_stores::log::Retention,
    ) -> anyhow::Result<Option<meshd_log_nats::NatsConfig>> {
        let LogBackend::Nats(nats) = self else {
            return Ok(None);
        };
        let mut cfg = nats.as_ref().clone();
        cfg.retention = retention;
        cfg.tls = secured
            .ca_file
            .clone()
            .map(|ca_file| meshd_log_nats::NatsTls {
                ca_file,
                cert_file: secured.cert_file.clone(),
                key_file: secured.key_file.clone(),
            });
        cfg.credentials = secured
            .credentials()?
            .map(|(user, password)| meshd_log_nats::NatsCredentials { user, password });
        Ok(Some(cfg))
    }
}

pub(super) fn meta_backend(flag: &str, v: String) -> Result<MetaBackend, ConfigError> {
    match v.as_str() {
        "embedded" => Ok(MetaBackend::Embedded),
        url if url.starts_with("etcd://") => meshd_meta_etcd::EtcdConfig::parse(url)
            .map(|c| MetaBackend::Etcd(Box::new(c)))
            .map_err(|e| invalid(flag, url, e)),
        other => Err(invalid(
            flag,
            other,
            "expected `embedded` or `etcd://host:port[,host:port...]`",
        )),
    }
}

pub(super) fn log_backend(flag: &str, v: String) -> Result<LogBackend, ConfigError> {
    match v.as_str() {
        "embedded" => Ok(LogBackend::Embedded),
        url if url.starts_with("nats://") => meshd_log_nats::NatsConfig::parse(url)
            .map(|c| LogBackend::Nats(Box::new(c)))
            .map_err(|e| invalid(flag, url, e)),
        other => Err(invalid(
            flag,
            other,
            "expected `embedded` or `nats://host:port[,host:port...]`",
        )),
    }
}
