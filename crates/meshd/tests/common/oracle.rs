//! Shared by the crash loops (`crash_loop.rs`, `cluster_crash_loop.rs`): how a client
//! classifies an answer, the seed and round numbers from the environment, and the
//! final dead-letter listing their oracles read.

use serde_json::Value;
use std::fmt;

/// Why a request did not get the answer it expects.
#[derive(Debug)]
pub enum Failure {
    /// No answer (refused, cut by a kill, or too slow): the outcome is unknown.
    Transport(String),
    /// Another status than expected.
    Status(u16, String),
    /// The expected status with a body that is not the contract's.
    Malformed(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Transport(e) => write!(f, "no answer: {e}"),
            Failure::Status(s, body) => write!(f, "answered {s}: {body}"),
            Failure::Malformed(e) => write!(f, "malformed answer: {e}"),
        }
    }
}

/// The JSON body of an answer of [`meshd_client::Client`] (a `*_answer` method) with
/// `status`, or why not: no answer is `Transport`, a refusal (the client's
/// [`meshd_client::Error::Api`]) or another 2xx is `Status`, a body that is not JSON
/// is `Malformed`.
pub fn expect(
    r: Result<meshd_client::Response, meshd_client::Error>,
    status: u16,
) -> Result<Value, Failure> {
    match r {
        Ok(a) if a.status == status => a
            .json::<Value>()
            .map_err(|e| Failure::Malformed(e.to_string())),
        Ok(a) => Err(Failure::Status(a.status, a.text())),
        Err(meshd_client::Error::Api(p)) => Err(Failure::Status(p.status, p.to_string())),
        Err(e) => Err(Failure::Transport(e.to_string())),
    }
}

/// A number from the environment (decimal or `0x` hex); panics naming the variable
/// when it is set but not a number.
pub fn env_number(name: &str) -> Option<u64> {
    let s = std::env::var(name).ok()?;
    let s = s.trim();
    let parsed = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    Some(parsed.unwrap_or_else(|e| panic!("{name}={s:?} is not a number: {e}")))
}

/// The seed from `name`, otherwise from the clock.
pub fn seed_from(name: &str) -> u64 {
    env_number(name).unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    })
}

/// Every dead-letter entry of `sub`, over all pages of 1000
/// ([`meshd_client::Client::dead_letters_answer`]; asserts 200).
pub async fn dead_letter_entries(a: &str, sub: &str) -> anyhow::Result<Vec<Value>> {
    let meshd = super::client(a);
    let mut entries = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let what = format!("dead letters of {sub} from {cursor:?}");
        let r = meshd
            .dead_letters_answer(Some(sub), Some(1000), cursor.as_deref())
            .await;
        let page: Value = super::answered(r, 200, &what)?.json()?;
        let list = page["entries"]
            .as_array()
            .ok_or_else(|| anyhow::anyhow!("{what} answered without entries: {page}"))?;
        entries.extend(list.iter().cloned());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return Ok(entries),
        }
    }
}

/// The lists an ack answer places each id in.
pub const ACK_LISTS: &[&str] = &["acked", "unknown", "fenced", "failed"];
/// The lists a nack answer places each id in.
pub const NACK_LISTS: &[&str] = &[
    "retrying",
    "dead_lettered",
    "dead_lettering",
    "unknown",
    "fenced",
];

/// Where an ack (`verb` "ack") or nack answer placed each id it was sent: id (its JSON
/// text) -> list. What breaks the contract (an id in two lists, other ids than those
/// sent, a missing list) goes into `problems`; `None` when the answer cannot be read
/// at all (a list is missing).
pub fn placed_ids(
    verb: &str,
    answer: &Value,
    sent: &[Value],
    problems: &mut Vec<String>,
) -> Option<std::collections::BTreeMap<String, String>> {
    let lists = if verb == "ack" { ACK_LISTS } else { NACK_LISTS };
    let mut placed = std::collections::BTreeMap::new();
    for list in lists {
        let Some(members) = answer[*list].as_array() else {
            problems.push(format!("{verb} answer without a {list} list: {answer}"));
            return None;
        };
        for id in members {
            if placed.insert(id.to_string(), list.to_string()).is_some() {
                problems.push(format!("{verb} answered {id} in two lists: {answer}"));
            }
        }
    }
    let sent_ids: std::collections::BTreeSet<String> = sent.iter().map(Value::to_string).collect();
    if placed
        .keys()
        .cloned()
        .collect::<std::collections::BTreeSet<_>>()
        != sent_ids
    {
        problems.push(format!(
            "{verb} of {sent_ids:?} answered other ids: {answer}"
        ));
    }
    Some(placed)
}
