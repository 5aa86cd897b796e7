//! How settings are read (`by` in `settings!`): each gets the flag, which its
//! errors name.

use super::{invalid, ConfigError, ServeArgs};
use meshd_local::WalRecovery;
use meshd_runtime::egress::Cidr;
use std::net::SocketAddr;
use std::path::Path;

pub(super) fn socket_addr(flag: &str, v: String) -> Result<SocketAddr, ConfigError> {
    v.parse().map_err(|e| invalid(flag, &v, e))
}

pub(super) fn wal_recovery(flag: &str, v: String) -> Result<WalRecovery, ConfigError> {
    match v.as_str() {
        "strict" => Ok(WalRecovery::Strict),
        "point-in-time" => Ok(WalRecovery::PointInTime),
        other => Err(invalid(flag, other, "expected `strict` or `point-in-time`")),
    }
}

pub(super) fn instance_name(flag: &str, v: Option<String>) -> Result<Option<String>, ConfigError> {
    match v {
        Some(id) if !meshd_stores::names::is_valid_name(&id) => {
            Err(invalid(flag, id, "1-249 characters of [A-Za-z0-9._-]"))
        }
        v => Ok(v),
    }
}

pub(super) fn at_least_one(flag: &str, v: Option<u64>) -> Result<Option<u64>, ConfigError> {
    match v {
        Some(0) => Err(invalid(
            flag,
            0,
            "must be at least 1 (leave it unset for no size limit)",
        )),
        v => Ok(v),
    }
}

pub(super) fn host_port(flag: &str, v: Option<String>) -> Result<Option<String>, ConfigError> {
    match v {
        Some(a)
            if !meshd_client::split_host_port(&a).is_some_and(|(h, p)| !h.is_empty() && p != 0) =>
        {
            Err(invalid(
                flag,
                a,
                "expected host:port (a name or address other instances can reach)",
            ))
        }
        v => Ok(v),
    }
}

/// Origins allowed to call from a browser, normalised: lower case, no trailing `/`.
pub(super) fn origins(flag: &str, v: Option<Vec<String>>) -> Result<Vec<String>, ConfigError> {
    let origins: Vec<String> = v
        .into_iter()
        .flatten()
        .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
        .filter(|o| !o.is_empty())
        .collect();
    for o in &origins {
        let ok = ["http://", "https://"].iter().any(|scheme| {
            o.strip_prefix(scheme)
                .is_some_and(|rest| !rest.is_empty() && !rest.contains(['/', '?', '#', '@', ' ']))
        });
        if !ok {
            return Err(invalid(
                flag,
                o,
                "each origin is scheme://host[:port] (http or https), without a path",
            ));
        }
    }
    Ok(origins)
}

/// Extra `Host` names accepted by the DNS-rebinding check (lower case, no port).
pub(super) fn hosts(flag: &str, v: Option<Vec<String>>) -> Result<Vec<String>, ConfigError> {
    let hosts: Vec<String> = v
        .into_iter()
        .flatten()
        .map(|h| h.trim().to_ascii_lowercase())
        .filter(|h| !h.is_empty())
        .collect();
    match hosts
        .iter()
        .find(|h| h.contains(['/', ':', '@', ' ']) && !h.starts_with('['))
    {
        Some(h) => Err(invalid(
            flag,
            h,
            "each entry is a host name or address, without scheme or port",
        )),
        None => Ok(hosts),
    }
}

/// Address ranges of a `--push-*-cidr` flag.
pub(super) fn cidrs(flag: &str, values: Option<Vec<String>>) -> Result<Vec<Cidr>, ConfigError> {
    values
        .unwrap_or_default()
        .iter()
        .filter(|v| !v.trim().is_empty())
        .map(|v| Cidr::parse(v).map_err(|e| invalid(flag, v, e)))
        .collect()
}

/// The `--config` file.
pub(super) fn read_file(path: &Path) -> Result<ServeArgs, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}
