//! How settings are read (`by` in `settings!`) and the ranges they accept (`in`);
//! each error names the flag.

use super::error::{invalid, ConfigError};
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

/// The `--config` file, with the same settings as the flags.
pub(super) fn read_file<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// The numbers a setting accepts: `lo..=hi` (`unit` follows them in the error), and
/// 0 as well when 0 turns the setting off.
#[derive(Clone, Copy, Debug)]
pub(super) struct Accepts {
    pub(super) lo: u64,
    pub(super) hi: u64,
    unit: &'static str,
    pub(super) zero_is_off: bool,
}

pub(super) const fn between(lo: u64, hi: u64) -> Accepts {
    Accepts {
        lo,
        hi,
        unit: "",
        zero_is_off: false,
    }
}

/// Retention hours: at most 100 years.
pub(super) const HOURS: Accepts = Accepts {
    unit: " hours",
    ..between(1, 876_000)
};

impl Accepts {
    pub(super) const fn or_off(self) -> Self {
        Accepts {
            zero_is_off: true,
            ..self
        }
    }

    pub(super) fn contains(&self, v: u64) -> bool {
        (self.zero_is_off && v == 0) || (self.lo..=self.hi).contains(&v)
    }

    pub(super) fn check(&self, flag: &str, v: u64) -> Result<(), ConfigError> {
        if self.contains(v) {
            return Ok(());
        }
        let (lo, hi, unit) = (self.lo, self.hi, self.unit);
        Err(invalid(
            flag,
            v,
            format!("must be between {lo} and {hi}{unit}"),
        ))
    }
}

/// `--lease-ttl-ms` for `lease_ttl_ms`.
pub(super) fn flag(name: &str) -> String {
    format!("--{}", name.replace('_', "-"))
}
