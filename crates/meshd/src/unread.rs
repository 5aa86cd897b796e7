//! Request bodies a handler answered without reading.
//!
//! A refusal (401, 403, 429, 503, 404…) is often decided from the headers alone, and
//! the request body is dropped unread. Over HTTP/2 the server then ends the stream with
//! `RST_STREAM(NO_ERROR)` right after the answer, which RFC 9113 §8.1 allows but which
//! clients still uploading may take as a failure of the whole exchange: curl 7.88
//! reports "Stream error in the HTTP/2 framing layer" and loses the 403 about one
//! time in nine. Over HTTP/1 an unread body costs the connection.
//!
//! So the listener gives every request a body that hands its unread rest back when
//! the handler drops it, and reads (and discards) that rest before the answer leaves,
//! when it is small: at most [`DRAIN_LIMIT`] bytes within [`DRAIN_DEADLINE`]. A larger
//! or slower body is not read (that would be the attack a 413 or a shed request
//! refuses); its stream is reset as before.

use hyper::body::{Body, Bytes, Frame, Incoming, SizeHint};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

/// The largest unread rest meshd reads before answering.
pub const DRAIN_LIMIT: u64 = 64 * 1024;
/// How long meshd waits for that rest.
pub const DRAIN_DEADLINE: Duration = Duration::from_secs(1);

/// Where a dropped body leaves what it did not read.
#[derive(Clone, Default)]
pub struct Leftover(Arc<Mutex<Option<Incoming>>>);

impl Leftover {
    /// Reads what the handler left of the body, if it is small enough, so that the
    /// answer goes out on a stream the client finished. Returns the bytes read, or
    /// `None` when nothing was left or the rest was too large or too slow.
    pub async fn drain(&self) -> Option<u64> {
        let rest = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        if rest.size_hint().lower() > DRAIN_LIMIT {
            return None;
        }
        tokio::time::timeout(DRAIN_DEADLINE, read_up_to(rest, DRAIN_LIMIT))
            .await
            .ok()
            .flatten()
    }
}

/// Reads and discards `body` to its end; `None` past `limit` bytes or on an error.
async fn read_up_to(mut body: Incoming, limit: u64) -> Option<u64> {
    use http_body_util::BodyExt;
    let mut read = 0u64;
    while let Some(frame) = body.frame().await {
        if let Some(data) = frame.ok()?.data_ref() {
            read += data.len() as u64;
            if read > limit {
                return None;
            }
        }
    }
    Some(read)
}

/// A request body that puts its unread rest into a [`Leftover`] when dropped.
pub struct Tracked {
    inner: Option<Incoming>,
    leftover: Leftover,
}

impl Tracked {
    pub fn new(body: Incoming) -> (Self, Leftover) {
        let leftover = Leftover::default();
        let tracked = Self {
            inner: Some(body),
            leftover: leftover.clone(),
        };
        (tracked, leftover)
    }
}

impl Body for Tracked {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.inner.as_mut() {
            Some(inner) => Pin::new(inner).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            if !inner.is_end_stream() {
                *self
                    .leftover
                    .0
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(inner);
            }
        }
    }
}
