//! Configuration of the etcd backend: endpoints, timeouts, TLS and credentials.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The URL scheme of an etcd Meta address (`etcd://host:port[,host:port...]`).
pub const SCHEME: &str = "etcd://";

/// How [`EtcdMeta`](crate::EtcdMeta) reaches etcd.
///
/// * `endpoints`: the client addresses of the etcd members, `host:port` (plain HTTP/2;
///   `http://host:port` is accepted too). Requests go to one endpoint at a time and
///   move to the next when the current one is unreachable.
/// * `request_timeout`: the budget of one Meta call, failover included. A write that
///   got no answer within it is `Indeterminate`, a read `Unavailable`.
/// * `connect_timeout`: how long one TCP connect may take.
/// * `keep_alive_interval` / `keep_alive_timeout`: HTTP/2 pings on every connection,
///   idle or not, so a dead or frozen etcd breaks open watches within about
///   `interval + timeout`. The interval must not be shorter than the etcd server's
///   `--grpc-keepalive-min-time` (5 s by default): etcd answers pings that come more
///   often with a GOAWAY ("too_many_pings") and closes the connection, which broke
///   every idle watch every ~4 s while the default here was 1 s.
/// * `tls`: talk TLS (`https://`) to every endpoint, trusting the given CA; `None`
///   (the default) is plain HTTP/2. There is no fallback from one to the other.
/// * `credentials`: authenticate as this etcd user (etcd's `auth enable`); `None`
///   (the default) sends no token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub keep_alive_interval: Duration,
    pub keep_alive_timeout: Duration,
    pub tls: Option<EtcdTls>,
    pub credentials: Option<EtcdCredentials>,
}

/// TLS to etcd: the CA that signed etcd's certificate, and optionally a client
/// certificate (for etcd's `--client-cert-auth`). PEM files; `cert_file` and
/// `key_file` go together. The files are read when [`EtcdMeta`](crate::EtcdMeta)
/// connects, so a missing or unreadable one fails `connect`, naming it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca_file: PathBuf,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// The PEM contents of an [`EtcdTls`], read and checked.
#[derive(Clone)]
pub(crate) struct TlsPems {
    pub(crate) ca: Vec<u8>,
    /// `(certificate, key)`.
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl EtcdTls {
    /// Reads every file; a file that cannot be read, does not look like PEM, or a
    /// certificate without its key (or the reverse) is an error naming it.
    pub(crate) fn load(&self) -> Result<TlsPems, ConfigError> {
        let pair = match (&self.cert_file, &self.key_file) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((cert, key)),
            (Some(cert), None) => {
                return Err(ConfigError::TlsIncomplete {
                    given: "cert_file",
                    path: cert.clone(),
                    missing: "key_file",
                })
            }
            (None, Some(key)) => {
                return Err(ConfigError::TlsIncomplete {
                    given: "key_file",
                    path: key.clone(),
                    missing: "cert_file",
                })
            }
        };
        let ca = read_pem("CA", &self.ca_file)?;
        let identity = match pair {
            None => None,
            Some((cert, key)) => Some((
                read_pem("client certificate", cert)?,
                read_pem("client key", key)?,
            )),
        };
        Ok(TlsPems { ca, identity })
    }
}

fn read_pem(role: &'static str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    let bytes = std::fs::read(path).map_err(|e| ConfigError::TlsFile {
        role,
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    if !String::from_utf8_lossy(&bytes).contains("-----BEGIN ") {
        return Err(ConfigError::TlsFile {
            role,
            path: path.to_path_buf(),
            reason: "not a PEM file (no -----BEGIN line)".into(),
        });
    }
    Ok(bytes)
}

/// An etcd user and password. `Debug` never prints the password.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdCredentials {
    pub user: String,
    pub password: String,
}

impl std::fmt::Debug for EtcdCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdCredentials")
            .field("user", &self.user)
            .field("password", &"***")
            .finish()
    }
}

impl EtcdConfig {
    /// The default request timeout (2 s).
    pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
    /// The default connect timeout (1 s).
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
    /// The default HTTP/2 keep-alive interval (10 s): twice etcd's default
    /// `--grpc-keepalive-min-time` (5 s), so the server never counts a ping as abuse.
    pub const DEFAULT_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
    /// The default HTTP/2 keep-alive timeout (1 s).
    pub const DEFAULT_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(1);

    /// A configuration for `endpoints` with the default timeouts.
    pub fn new<I, S>(endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            keep_alive_interval: Self::DEFAULT_KEEP_ALIVE_INTERVAL,
            keep_alive_timeout: Self::DEFAULT_KEEP_ALIVE_TIMEOUT,
            tls: None,
            credentials: None,
        }
    }

    /// Parses `etcd://host:port[,host:port...]` (hosts may be names, IPv4 addresses
    /// or bracketed IPv6 addresses) into a configuration with the default timeouts.
    /// Rejects other schemes, an empty host list, empty entries, missing or invalid
    /// ports, and anything after the host list (paths, queries, credentials).
    pub fn parse(url: &str) -> Result<Self, ConfigError> {
        let trimmed = url.trim();
        let Some(hosts) = strip_prefix_ignore_case(trimmed, SCHEME) else {
            return Err(ConfigError::Scheme {
                url: url.to_string(),
            });
        };
        if hosts.is_empty() {
            return Err(ConfigError::NoEndpoints {
                url: url.to_string(),
            });
        }
        let mut endpoints = Vec::new();
        for entry in hosts.split(',') {
            endpoints.push(parse_endpoint(url, entry)?);
        }
        Ok(Self::new(endpoints))
    }
}

/// A malformed etcd address; each variant names the offending value.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid etcd address {url:?}: expected etcd://host:port[,host:port...]")]
    Scheme { url: String },
    #[error("invalid etcd address {url:?}: no endpoints after etcd://")]
    NoEndpoints { url: String },
    #[error("invalid etcd address {url:?}: endpoint {endpoint:?} has no host")]
    MissingHost { url: String, endpoint: String },
    #[error("invalid etcd address {url:?}: endpoint {endpoint:?} has no port (host:port)")]
    MissingPort { url: String, endpoint: String },
    #[error("invalid etcd address {url:?}: endpoint {endpoint:?} has an invalid port {port:?}")]
    InvalidPort {
        url: String,
        endpoint: String,
        port: String,
    },
    #[error(
        "invalid etcd address {url:?}: endpoint {endpoint:?} is not host:port \
         (no paths, queries, credentials or spaces)"
    )]
    InvalidEndpoint { url: String, endpoint: String },
    #[error("etcd TLS: cannot use the {role} file {path:?}: {reason}")]
    TlsFile {
        role: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("etcd TLS: {given} {path:?} is set but {missing} is not; give both or neither")]
    TlsIncomplete {
        given: &'static str,
        path: PathBuf,
        missing: &'static str,
    },
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

fn parse_endpoint(url: &str, entry: &str) -> Result<String, ConfigError> {
    let endpoint = entry.to_string();
    if entry.is_empty() {
        return Err(ConfigError::MissingHost {
            url: url.to_string(),
            endpoint,
        });
    }
    if entry
        .chars()
        .any(|c| c.is_whitespace() || matches!(c, '/' | '?' | '#' | '@'))
    {
        return Err(ConfigError::InvalidEndpoint {
            url: url.to_string(),
            endpoint,
        });
    }
    let (host, port) = if let Some(rest) = entry.strip_prefix('[') {
        // [v6]:port
        let Some((v6, after)) = rest.split_once(']') else {
            return Err(ConfigError::InvalidEndpoint {
                url: url.to_string(),
                endpoint,
            });
        };
        if v6.is_empty() || v6.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(ConfigError::InvalidEndpoint {
                url: url.to_string(),
                endpoint,
            });
        }
        let Some(port) = after.strip_prefix(':') else {
            return Err(if after.is_empty() {
                ConfigError::MissingPort {
                    url: url.to_string(),
                    endpoint,
                }
            } else {
                ConfigError::InvalidEndpoint {
                    url: url.to_string(),
                    endpoint,
                }
            });
        };
        (&entry[..v6.len() + 2], port)
    } else {
        let Some((host, port)) = entry.rsplit_once(':') else {
            return Err(ConfigError::MissingPort {
                url: url.to_string(),
                endpoint,
            });
        };
        if host.contains(':') || host.contains('[') || host.contains(']') {
            // An unbracketed IPv6 address or stray brackets.
            return Err(ConfigError::InvalidEndpoint {
                url: url.to_string(),
                endpoint,
            });
        }
        (host, port)
    };
    if host.is_empty() {
        return Err(ConfigError::MissingHost {
            url: url.to_string(),
            endpoint,
        });
    }
    if port.is_empty() {
        return Err(ConfigError::MissingPort {
            url: url.to_string(),
            endpoint,
        });
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => Ok(format!("{host}:{p}")),
        _ => Err(ConfigError::InvalidPort {
            url: url.to_string(),
            endpoint,
            port: port.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_one_and_several_endpoints() {
        let c = EtcdConfig::parse("etcd://127.0.0.1:2379").expect("valid");
        assert_eq!(c.endpoints, vec!["127.0.0.1:2379"]);
        assert_eq!(c.request_timeout, Duration::from_secs(2));
        assert_eq!(c.connect_timeout, Duration::from_secs(1));
        assert_eq!(c.keep_alive_interval, Duration::from_secs(10));
        assert_eq!(c.keep_alive_timeout, Duration::from_secs(1));

        let c = EtcdConfig::parse("etcd://a.example:2379,b:12379,[::1]:2379").expect("valid");
        assert_eq!(c.endpoints, vec!["a.example:2379", "b:12379", "[::1]:2379"]);

        let c = EtcdConfig::parse("ETCD://host:1").expect("scheme is case-insensitive");
        assert_eq!(c.endpoints, vec!["host:1"]);
    }

    #[test]
    fn rejects_bad_addresses_naming_the_value() {
        let cases = [
            ("http://127.0.0.1:2379", "Scheme"),
            ("127.0.0.1:2379", "Scheme"),
            ("", "Scheme"),
            ("etcd://", "NoEndpoints"),
            ("etcd://a:1,", "MissingHost"),
            ("etcd://,a:1", "MissingHost"),
            ("etcd://:2379", "MissingHost"),
            ("etcd://localhost", "MissingPort"),
            ("etcd://localhost:", "MissingPort"),
            ("etcd://[::1]", "MissingPort"),
            ("etcd://localhost:0", "InvalidPort"),
            ("etcd://localhost:65536", "InvalidPort"),
            ("etcd://localhost:+1", "InvalidPort"),
            ("etcd://localhost:http", "InvalidPort"),
            ("etcd://localhost:2379/path", "InvalidEndpoint"),
            ("etcd://u@localhost:2379", "InvalidEndpoint"),
            ("etcd://::1:2379", "InvalidEndpoint"),
            ("etcd://[nope]:2379", "InvalidEndpoint"),
            ("etcd://a:1, b:2", "InvalidEndpoint"),
        ];
        for (url, variant) in cases {
            let err = EtcdConfig::parse(url).expect_err(url);
            let debug = format!("{err:?}");
            assert!(
                debug.starts_with(&format!("{variant} ")),
                "{url:?} gave {debug}"
            );
            let msg = err.to_string();
            assert!(msg.contains(&format!("{url:?}")), "{msg} names {url:?}");
        }
        let err = EtcdConfig::parse("etcd://a:1,b:x").expect_err("bad port");
        assert!(err.to_string().contains("\"b:x\""), "{err}");
    }

    #[test]
    fn tls_files_that_cannot_be_used_are_named() {
        let missing = PathBuf::from("/nonexistent/meshd/ca.pem");
        let tls = EtcdTls {
            ca_file: missing.clone(),
            cert_file: None,
            key_file: None,
        };
        let err = tls.load().err().expect("missing CA");
        assert!(
            matches!(err, ConfigError::TlsFile { role: "CA", .. }),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("/nonexistent/meshd/ca.pem"),
            "{err}"
        );

        let err = EtcdTls {
            // The manifest, found at run time: a test binary reused from another
            // checkout's build would name that checkout's file.
            ca_file: PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo"))
                .join("Cargo.toml"),
            cert_file: None,
            key_file: None,
        }
        .load()
        .err()
        .expect("not PEM");
        assert!(err.to_string().contains("not a PEM file"), "{err}");

        let err = EtcdTls {
            ca_file: missing,
            cert_file: Some("/x/client.pem".into()),
            key_file: None,
        }
        .load()
        .err()
        .expect("cert without key");
        assert!(
            matches!(
                err,
                ConfigError::TlsIncomplete {
                    missing: "key_file",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("/x/client.pem"), "{err}");
    }

    #[test]
    fn credentials_debug_hides_the_password() {
        let c = EtcdCredentials {
            user: "meshd".into(),
            password: "hunter2".into(),
        };
        let debug = format!("{c:?}");
        assert!(debug.contains("meshd") && debug.contains("***"), "{debug}");
        assert!(!debug.contains("hunter2"), "{debug}");
        let mut config = EtcdConfig::new(["a:1"]);
        config.credentials = Some(c);
        assert!(!format!("{config:?}").contains("hunter2"));
    }
}
