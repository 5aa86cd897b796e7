//! Streaming consume over Server-Sent Events (http-api.md "Streaming consume"):
//! [`Client::stream`](crate::Client::stream) opens `GET .../stream`, and
//! [`EventStream::next`] yields each delivery as it arrives. Acks, nacks and extends
//! go through the usual calls ([`Client::ack`](crate::Client::ack)); the stream never
//! has more than `max_in_flight` deliveries that are neither acked nor nacked nor
//! timed out.

use crate::delivery::Delivery;
use crate::transport::{Response, Streaming};
use crate::{Error, Problem};
use std::time::Duration;

/// How long a stream may say nothing before it is taken as lost: meshd writes a
/// keep-alive comment at least every 15 s.
pub const STREAM_IDLE: Duration = Duration::from_secs(45);

/// What a stream is opened with (both optional in the contract).
#[derive(Debug, Clone, Default)]
pub struct StreamOptions {
    /// 1–10000 (meshd's default 100).
    pub max_in_flight: Option<u32>,
    pub session: Option<String>,
}

/// One Server-Sent Event: its `event` name (`message` when none was given) and data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

/// Reads Server-Sent Events from pieces of text as they arrive (the WHATWG event
/// stream format: `field: value` lines, comments starting with `:`, an event ended
/// by a blank line; `\n`, `\r\n` or `\r` line ends).
#[derive(Debug, Default)]
pub struct SseParser {
    pending: Vec<u8>,
    event: Option<String>,
    data: Option<String>,
    /// The last piece ended with `\r`: a `\n` that starts the next one belongs to it.
    after_cr: bool,
}

impl SseParser {
    /// Feeds `bytes`; returns the events they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for &b in bytes {
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    continue;
                }
            }
            match b {
                b'\n' | b'\r' => {
                    self.after_cr = b == b'\r';
                    let line = std::mem::take(&mut self.pending);
                    if let Some(e) = self.line(&line) {
                        out.push(e);
                    }
                }
                _ => self.pending.push(b),
            }
        }
        out
    }

    fn line(&mut self, line: &[u8]) -> Option<SseEvent> {
        if line.is_empty() {
            let data = self.data.take();
            let event = self.event.take();
            return data.map(|data| SseEvent {
                event: event.unwrap_or_else(|| "message".into()),
                data,
            });
        }
        if line[0] == b':' {
            return None;
        }
        let text = String::from_utf8_lossy(line);
        let (field, value) = match text.split_once(':') {
            Some((f, v)) => (f.to_string(), v.strip_prefix(' ').unwrap_or(v).to_string()),
            None => (text.to_string(), String::new()),
        };
        match field.as_str() {
            "event" => self.event = Some(value),
            "data" => match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(&value);
                }
                None => self.data = Some(value),
            },
            _ => {}
        }
        None
    }
}

/// The delivery an `event: delivery` carries.
fn delivery(e: &SseEvent) -> Result<Delivery, Error> {
    serde_json::from_str(&e.data).map_err(|err| {
        Error::Malformed(format!(
            "a streamed delivery is not the JSON expected ({err})"
        ))
    })
}

/// An open stream of deliveries.
pub struct EventStream {
    answer: Streaming,
    parser: SseParser,
    ready: std::collections::VecDeque<SseEvent>,
    /// How the body ended, when [`EventStream::buffered`] saw it first.
    end: Option<Result<(), Error>>,
}

impl EventStream {
    pub(crate) fn new(answer: Streaming) -> Self {
        Self {
            answer,
            parser: SseParser::default(),
            ready: Default::default(),
            end: None,
        }
    }

    /// Deliveries that already arrived, without waiting: what was parsed, and what
    /// the connection holds already. After [`EventStream::next`], the rest of what
    /// meshd sent so far, to ack together (acking what arrived returns all of that
    /// credit at once, so meshd's next step can be as large as `max_in_flight`).
    pub fn buffered(&mut self) -> Result<Vec<Delivery>, Error> {
        use futures::FutureExt;
        let mut out = Vec::new();
        loop {
            while let Some(e) = self.ready.front() {
                if e.event != "delivery" {
                    // A problem (or another event) is for `next` to answer.
                    return Ok(out);
                }
                let Some(e) = self.ready.pop_front() else {
                    break;
                };
                out.push(delivery(&e)?);
            }
            if self.end.is_some() {
                return Ok(out);
            }
            match self.answer.chunk(STREAM_IDLE).now_or_never() {
                Some(Ok(Some(bytes))) => self.ready.extend(self.parser.push(&bytes)),
                // An end or an error is for `next` to report, after these.
                Some(Ok(None)) => self.end = Some(Ok(())),
                Some(Err(e)) => self.end = Some(Err(e)),
                None => return Ok(out),
            }
        }
    }

    /// The next delivery; `None` when meshd ended the stream (a graceful stop).
    /// A problem meshd sent before ending it is [`Error::Api`]; silence for
    /// [`STREAM_IDLE`] is [`Error::Lost`].
    pub async fn next(&mut self) -> Result<Option<Delivery>, Error> {
        loop {
            while let Some(e) = self.ready.pop_front() {
                match e.event.as_str() {
                    "delivery" => return delivery(&e).map(Some),
                    "problem" => {
                        let status = serde_json::from_str::<serde_json::Value>(&e.data)
                            .ok()
                            .and_then(|v| v["status"].as_u64())
                            .unwrap_or(500) as u16;
                        let answer = Response {
                            status,
                            headers: Default::default(),
                            body: e.data.into_bytes().into(),
                        };
                        return Err(Error::Api(Box::new(Problem::of(&answer))));
                    }
                    _ => {}
                }
            }
            if let Some(end) = self.end.take() {
                // Seen by `buffered`: reported once, then the stream stays ended.
                self.end = Some(Ok(()));
                return end.map(|()| None);
            }
            match self.answer.chunk(STREAM_IDLE).await? {
                None => return Ok(None),
                Some(bytes) => self.ready.extend(self.parser.push(&bytes)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_read_across_pieces_and_line_ends() {
        let mut p = SseParser::default();
        assert!(p.push(b": open\n\n").is_empty(), "a comment is no event");
        assert!(p.push(b"event: deli").is_empty());
        let got = p.push(b"very\r\ndata: {\"a\":1}\r\n\r\nevent: x\rdata: 1\rdata:2\r\r");
        assert_eq!(
            got,
            vec![
                SseEvent {
                    event: "delivery".into(),
                    data: "{\"a\":1}".into()
                },
                SseEvent {
                    event: "x".into(),
                    data: "1\n2".into()
                },
            ]
        );
        // A \r\n split between two pieces is one line end.
        assert!(p.push(b"data: y\r").is_empty());
        assert_eq!(
            p.push(b"\n\n"),
            vec![SseEvent {
                event: "message".into(),
                data: "y".into()
            }]
        );
        // A blank line without data is no event.
        assert!(p.push(b"event: lonely\n\n").is_empty());
    }
}
