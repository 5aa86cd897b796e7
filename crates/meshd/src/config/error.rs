//! The error a bad setting stops `meshd serve` with: it names the flag and the value.

use std::path::PathBuf;

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

pub(super) fn invalid(flag: &str, value: impl ToString, reason: impl ToString) -> ConfigError {
    ConfigError::Invalid {
        name: flag.to_string().into(),
        value: value.to_string(),
        reason: reason.to_string(),
    }
}
