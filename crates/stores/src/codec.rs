//! # What the record codecs share: versioned JSON, corrupt-record reports, kept fields
//!
//! Every record in Meta is JSON with a version field `"v"`. Decoding checks the
//! version before anything else, so a record of another version is reported as such
//! (never half-read as this one), and every failure is a reason string the store
//! reports as `Corrupt`. A field this release does not know is not a failure: a newer
//! release wrote it (state-plane.md, "Records"); it is ignored, and in the records any
//! instance rewrites (tasks, dead-letter entries) kept and written back ([`Kept`]). Two phrasings exist, each pinned by its records' tests: the
//! session and subscription records ([`decode_probed`]) and the records that name
//! themselves in their reasons ([`decode_named`]: tasks, dead letters).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The top-level fields of a stored record that this release does not know (a newer
/// release wrote them). Decoding keeps them and encoding writes them back, so a
/// rewrite by this release (a task transition, a redrive) carries on what the newer
/// one wrote during a rolling upgrade. New fields go at a record's top level: inside a
/// nested object an unknown field is ignored, and a rewrite drops it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Kept(serde_json::Map<String, Value>);

impl Kept {
    /// Whether the record had no field this release does not know.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The names of the kept fields.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.keys().map(String::as_str)
    }
}

/// Decodes a record of `version`: probes `"v"`, then decodes the whole record as `T`.
pub(crate) fn decode_probed<T: DeserializeOwned>(value: &[u8], version: u32) -> Result<T, String> {
    #[derive(Deserialize)]
    struct Probe {
        v: Option<Value>,
    }
    let probe: Probe =
        serde_json::from_slice(value).map_err(|e| format!("not a JSON record: {e}"))?;
    match probe.v {
        None => return Err("the record has no version field \"v\"".into()),
        Some(Value::Number(n)) if n.as_u64() == Some(u64::from(version)) => {}
        Some(other) => return Err(format!("unknown record version {other}")),
    }
    serde_json::from_slice(value).map_err(|e| format!("malformed version {version} record: {e}"))
}

/// Decodes a record of `version` whose reasons name it as `what` (e.g. "task record").
pub(crate) fn decode_named<T: DeserializeOwned>(
    bytes: &[u8],
    version: u64,
    what: &str,
) -> Result<T, String> {
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not a JSON {what}: {e}"))?;
    match value.get("v") {
        Some(Value::Number(n)) if n.as_u64() == Some(version) => {}
        Some(other) => return Err(format!("unknown {what} version {other}")),
        None => return Err(format!("{what} without a version (\"v\")")),
    }
    serde_json::from_value(value).map_err(|e| format!("malformed {what}: {e}"))
}

/// A Meta key as text, for corrupt-record reports.
pub(crate) fn key_text(key: &[u8]) -> String {
    String::from_utf8_lossy(key).into_owned()
}
