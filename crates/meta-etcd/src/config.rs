//! Configuration of the etcd backend: endpoints and timeouts.

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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    pub endpoints: Vec<String>,
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    pub keep_alive_interval: Duration,
    pub keep_alive_timeout: Duration,
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
}
