//! What can go wrong in a call, classified once: whether anything was sent decides
//! whether a retry is safe.

/// A failed call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The target, a header or a setting is unusable: nothing was sent.
    #[error("{0}")]
    Invalid(String),
    /// No connection (refused, unresolvable, refused by the address rules, TLS
    /// handshake failed, no connection within the connect timeout): nothing was sent.
    #[error("{0}")]
    Unreachable(String),
    /// The connection was lost or the deadline passed after the request was sent: it
    /// may or may not have been applied (as with a 504).
    #[error("{0}")]
    Lost(String),
    /// The answer is not usable: not HTTP, larger than allowed, or not the JSON the
    /// call expects.
    #[error("{0}")]
    Malformed(String),
    /// The server answered with a status outside 2xx.
    #[error("{0}")]
    Api(Box<Problem>),
}

impl Error {
    /// Whether the request may have been applied although no answer says so.
    pub fn outcome_unknown(&self) -> bool {
        matches!(self, Error::Lost(_)) || matches!(self, Error::Api(p) if p.status == 504)
    }
}

/// An RFC 9457 problem answer (or whatever a non-2xx answer carried).
#[derive(Debug, Clone)]
pub struct Problem {
    pub status: u16,
    /// The problem's `type`, when the body is problem+json.
    pub kind: Option<String>,
    pub title: Option<String>,
    /// `detail`, else `title`, else the body as text (at most 300 characters).
    pub detail: String,
    /// The request field the problem names, when it names one.
    pub field: Option<String>,
    /// `Retry-After`, as sent.
    pub retry_after: Option<String>,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (HTTP {})", self.detail, self.status)
    }
}

/// At most `max` characters of `s`, with `…` when cut.
pub fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}
