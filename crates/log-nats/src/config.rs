//! [`NatsConfig`]: where the JetStream log lives and how long it waits.

use meshd_stores::log::Retention;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Settings of a [`NatsLog`](crate::NatsLog). Build it with [`NatsConfig::parse`] or by
/// hand from [`NatsConfig::default`], then [`validate`](NatsConfig::validate) (which
/// `connect` does too).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsConfig {
    /// `host:port` of each seed server (the client also learns the cluster's others).
    pub servers: Vec<String>,
    /// Prefix of every stream and subject (`[A-Za-z0-9-]`, 1–32 bytes); instances of
    /// one meshd cluster share it, another cluster on the same NATS picks its own.
    /// Default `meshd`.
    pub namespace: String,
    /// Replicas of every stream (1–5; JetStream clusters take 3 or 5). Default 1.
    pub replicas: usize,
    /// Deadline of every request to the server (a publish until its PubAck, an API call
    /// until its answer). Default 5 s. A write that passes it is `Indeterminate`.
    pub request_timeout: Duration,
    /// Deadline of the initial connection. Default 5 s.
    pub connect_timeout: Duration,
    /// How often the client pings the server; two unanswered pings mark the connection
    /// dead and start a reconnect. Default 10 s.
    pub ping_interval: Duration,
    /// Limits put on partition streams this log creates (`max_age`, `max_bytes`);
    /// `enforce_retention` replaces it and updates existing streams. Default: none.
    pub retention: Retention,
    /// Require TLS to every server, trusting this CA (and presenting a client
    /// certificate when given). Default `None`: plain TCP, unless the server asks
    /// for TLS. There is no fallback from TLS to plaintext.
    pub tls: Option<NatsTls>,
    /// Authenticate with this user and password. Default `None`.
    pub credentials: Option<NatsCredentials>,
    /// Read the park journal from its stream's leader (`STREAM.MSG.GET`, one message
    /// per request) instead of by direct gets. Always so with `replicas` > 1, where
    /// any replica answers a direct get and one that lags answers without the latest
    /// entries (a takeover would lose parked events); tests set it to use that path
    /// on one server.
    pub park_reads_from_leader: bool,
}

/// TLS to nats-server: the CA that signed the server's certificate, and optionally
/// a client certificate (for `verify: true`). PEM files; `cert_file` and `key_file`
/// go together. [`NatsLog::connect`](crate::NatsLog::connect) reads them first and
/// fails with [`LogError::Invalid`](meshd_stores::log::LogError::Invalid) naming a
/// file it cannot use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NatsTls {
    pub ca_file: PathBuf,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

impl NatsTls {
    /// The certificate pairing (no file access): `cert_file` and `key_file` together
    /// or neither.
    fn validate(&self) -> Result<(), ConfigError> {
        match (&self.cert_file, &self.key_file) {
            (Some(cert), None) => Err(ConfigError(format!(
                "tls cert_file {} is set but key_file is not; give both or neither",
                cert.display()
            ))),
            (None, Some(key)) => Err(ConfigError(format!(
                "tls key_file {} is set but cert_file is not; give both or neither",
                key.display()
            ))),
            _ => Ok(()),
        }
    }

    /// Checks that every file can be read and looks like PEM, naming the first one
    /// that does not. The client reads them again when it connects.
    pub fn check_files(&self) -> Result<(), ConfigError> {
        self.validate()?;
        check_pem("CA", &self.ca_file)?;
        if let Some(cert) = &self.cert_file {
            check_pem("client certificate", cert)?;
        }
        if let Some(key) = &self.key_file {
            check_pem("client key", key)?;
        }
        Ok(())
    }
}

fn check_pem(role: &str, path: &Path) -> Result<(), ConfigError> {
    let bytes = std::fs::read(path).map_err(|e| {
        ConfigError(format!(
            "tls: cannot read the {role} file {}: {e}",
            path.display()
        ))
    })?;
    if !String::from_utf8_lossy(&bytes).contains("-----BEGIN ") {
        return Err(ConfigError(format!(
            "tls: the {role} file {} is not PEM (no -----BEGIN line)",
            path.display()
        )));
    }
    Ok(())
}

/// A NATS user and password. `Debug` never prints the password.
#[derive(Clone, PartialEq, Eq)]
pub struct NatsCredentials {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for NatsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsCredentials")
            .field("user", &self.user)
            .field("password", &"***")
            .finish()
    }
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            servers: vec!["127.0.0.1:4222".into()],
            namespace: "meshd".into(),
            replicas: 1,
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            ping_interval: Duration::from_secs(10),
            retention: Retention::default(),
            tls: None,
            credentials: None,
            park_reads_from_leader: false,
        }
    }
}

/// A setting that cannot be used; the message names it and the bad value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid NATS log setting: {0}")]
pub struct ConfigError(pub String);

const MAX_NAMESPACE: usize = 32;

impl NatsConfig {
    /// Parses `nats://host:port[,host:port...][?key=value&...]`, the form `meshd serve
    /// --log` takes. Keys: `namespace`, `replicas`, `request_timeout_ms`,
    /// `connect_timeout_ms`, `ping_interval_ms`; anything else is an error. A missing
    /// port is 4222.
    pub fn parse(url: &str) -> Result<Self, ConfigError> {
        let rest = url
            .strip_prefix("nats://")
            .ok_or_else(|| ConfigError(format!("{url:?} does not start with nats://")))?;
        let (hosts, query) = match rest.split_once('?') {
            Some((h, q)) => (h, Some(q)),
            None => (rest, None),
        };
        let mut config = NatsConfig {
            servers: Vec::new(),
            ..NatsConfig::default()
        };
        for host in hosts.split(',') {
            let host = host.trim().trim_start_matches("nats://");
            if host.is_empty() {
                return Err(ConfigError(format!("{url:?} has an empty server address")));
            }
            config.servers.push(if host.contains(':') {
                host.to_string()
            } else {
                format!("{host}:4222")
            });
        }
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| ConfigError(format!("{pair:?} in {url:?} is not key=value")))?;
            let ms = || -> Result<Duration, ConfigError> {
                value
                    .parse::<u64>()
                    .ok()
                    .filter(|ms| (100..=600_000).contains(ms))
                    .map(Duration::from_millis)
                    .ok_or_else(|| ConfigError(format!("{key}={value:?}: 100-600000 ms")))
            };
            match key {
                "namespace" => config.namespace = value.to_string(),
                "replicas" => {
                    config.replicas = value
                        .parse()
                        .map_err(|_| ConfigError(format!("replicas={value:?} is not a number")))?
                }
                "request_timeout_ms" => config.request_timeout = ms()?,
                "connect_timeout_ms" => config.connect_timeout = ms()?,
                "ping_interval_ms" => config.ping_interval = ms()?,
                other => return Err(ConfigError(format!("unknown setting {other:?} in {url:?}"))),
            }
        }
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.servers.is_empty() {
            return Err(ConfigError("no server address".into()));
        }
        for s in &self.servers {
            let port = s.rsplit_once(':').map(|(_, p)| p);
            if !port.is_some_and(|p| p.parse::<u16>().is_ok_and(|p| p > 0)) {
                return Err(ConfigError(format!("server {s:?} is not host:port")));
            }
        }
        let ns = &self.namespace;
        if ns.is_empty()
            || ns.len() > MAX_NAMESPACE
            || !ns.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(ConfigError(format!(
                "namespace {ns:?}: 1-{MAX_NAMESPACE} characters of [A-Za-z0-9-]"
            )));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(ConfigError(format!(
                "replicas {}: JetStream takes 1-5",
                self.replicas
            )));
        }
        for (name, d) in [
            ("request_timeout", self.request_timeout),
            ("connect_timeout", self.connect_timeout),
            ("ping_interval", self.ping_interval),
        ] {
            if d < Duration::from_millis(100) {
                return Err(ConfigError(format!("{name} {d:?} is below 100 ms")));
            }
        }
        if self.retention.max_age_ms.is_some_and(|ms| ms < 1000) {
            return Err(ConfigError("retention max_age below 1 s".into()));
        }
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        if let Some(c) = &self.credentials {
            if c.user.is_empty() {
                return Err(ConfigError("credentials: the user is empty".into()));
            }
        }
        Ok(())
    }

    /// The server URLs handed to the client.
    pub(crate) fn urls(&self) -> Vec<String> {
        self.servers.iter().map(|s| format!("nats://{s}")).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_serve_flag_form() {
        let c = NatsConfig::parse("nats://a:4222,b").unwrap();
        assert_eq!(c.servers, vec!["a:4222", "b:4222"]);
        assert_eq!(c.namespace, "meshd");
        let c = NatsConfig::parse(
            "nats://127.0.0.1:1?namespace=prod-1&replicas=3&request_timeout_ms=2000",
        )
        .unwrap();
        assert_eq!(c.namespace, "prod-1");
        assert_eq!(c.replicas, 3);
        assert_eq!(c.request_timeout, Duration::from_secs(2));
    }

    #[test]
    fn tls_files_that_cannot_be_used_are_named_and_the_password_never_printed() {
        let missing = PathBuf::from("/nonexistent/meshd/ca.pem");
        let tls = NatsTls {
            ca_file: missing,
            cert_file: None,
            key_file: None,
        };
        let e = tls.check_files().unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/meshd/ca.pem") && e.contains("CA"),
            "{e}"
        );
        let not_pem = NatsTls {
            // The manifest, found at run time: a test binary reused from another
            // checkout's build would name that checkout's file.
            ca_file: PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo"))
                .join("Cargo.toml"),
            cert_file: None,
            key_file: None,
        };
        let e = not_pem.check_files().unwrap_err().to_string();
        assert!(e.contains("not PEM"), "{e}");
        let mut c = NatsConfig {
            tls: Some(NatsTls {
                ca_file: "/x/ca.pem".into(),
                cert_file: Some("/x/client.pem".into()),
                key_file: None,
            }),
            ..NatsConfig::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("/x/client.pem") && e.contains("key_file"), "{e}");

        c.tls = None;
        c.credentials = Some(NatsCredentials {
            user: "meshd".into(),
            password: "hunter2".into(),
        });
        c.validate().expect("valid");
        let debug = format!("{c:?}");
        assert!(
            debug.contains("***") && !debug.contains("hunter2"),
            "{debug}"
        );
    }

    #[test]
    fn refuses_what_it_cannot_use_and_names_it() {
        for (url, names) in [
            ("http://a:1", "nats://"),
            ("nats://", "empty"),
            ("nats://a:x", "host:port"),
            ("nats://a:1?namespace=a_b", "namespace"),
            ("nats://a:1?namespace=a.b", "namespace"),
            ("nats://a:1?replicas=7", "replicas"),
            ("nats://a:1?request_timeout_ms=5", "request_timeout_ms"),
            ("nats://a:1?color=red", "color"),
            ("nats://a:1?replicas", "key=value"),
        ] {
            let e = NatsConfig::parse(url).unwrap_err().to_string();
            assert!(e.contains(names), "{url}: {e}");
        }
    }
}
