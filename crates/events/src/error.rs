//! The one error type of this crate, shaped for an RFC 9457 problem+json answer.

/// Why an event (or a publish request) was refused, or why a stored event could not be
/// read back.
///
/// It maps 1:1 to a problem+json answer: `status` is the HTTP status, `detail` the
/// human-readable sentence, and `field` (when known) the offending member, prefixed with
/// the batch index (`events[3].source`) for a batch. The HTTP layer adds `type` and
/// `title` (see [`EventError::title`]).
///
/// Statuses: 400 malformed or invalid event, 413 an event or batch over a [`Limits`]
/// bound, 415 no usable content mode. 500 is used only by [`Event::from_stored`] for a
/// stored event that no longer decodes ([`EventError::is_corrupt`]): that is meshd's
/// fault, never the client's.
///
/// [`Limits`]: crate::Limits
/// [`Event::from_stored`]: crate::Event::from_stored
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct EventError {
    /// 400, 413, 415, or 500 for a corrupt stored event.
    pub status: u16,
    /// The offending member, e.g. `source` or `events[3].source`; `None` when the error
    /// is about the request as a whole (bad JSON, unsupported content type).
    pub field: Option<String>,
    /// What was wrong, in one sentence that also names the field.
    pub detail: String,
}

impl EventError {
    /// 400: a malformed or invalid event.
    pub fn bad_request(field: Option<&str>, detail: impl Into<String>) -> Self {
        Self {
            status: 400,
            field: field.map(str::to_owned),
            detail: detail.into(),
        }
    }

    /// 400 naming `field`.
    pub fn invalid(field: &str, detail: impl Into<String>) -> Self {
        Self::bad_request(Some(field), detail)
    }

    /// 413: an event or a batch over its limit.
    pub fn too_large(field: Option<&str>, detail: impl Into<String>) -> Self {
        Self {
            status: 413,
            field: field.map(str::to_owned),
            detail: detail.into(),
        }
    }

    /// 415: the request is in no content mode this crate understands.
    pub fn unsupported_media_type(detail: impl Into<String>) -> Self {
        Self {
            status: 415,
            field: None,
            detail: detail.into(),
        }
    }

    /// 500: a stored event that does not decode (torn or corrupt log data, or data
    /// written by an incompatible version). Never produced for client input.
    pub fn corrupt(detail: impl Into<String>) -> Self {
        Self {
            status: 500,
            field: None,
            detail: format!("corrupt stored event: {}", detail.into()),
        }
    }

    /// Whether this is a stored event that failed to decode (see [`EventError::corrupt`]).
    pub fn is_corrupt(&self) -> bool {
        self.status == 500
    }

    /// The problem+json `title` for `status`.
    pub fn title(&self) -> &'static str {
        match self.status {
            400 => "Bad Request",
            413 => "Content Too Large",
            415 => "Unsupported Media Type",
            _ => "Internal Server Error",
        }
    }

    /// Places the error inside a batch: `source` becomes `events[3].source` and the
    /// detail starts with `events[3]: `.
    pub(crate) fn in_batch(mut self, index: usize) -> Self {
        let prefix = format!("events[{index}]");
        self.field = Some(match self.field.take() {
            Some(field) => format!("{prefix}.{field}"),
            None => prefix.clone(),
        });
        self.detail = format!("{prefix}: {}", self.detail);
        self
    }
}
