//! HTTP/1.1 over hyper: one connection per request ([`Transport::send`]) or a
//! keep-alive connection ([`Transport::open`]), plain TCP or TLS, with an optional
//! check of every resolved address before it is dialled (push's address rules).
//!
//! Every call is bounded by its request's timeout. Failures are classified by what was
//! sent: before the request left, [`Error::Unreachable`] (safe to retry); after,
//! [`Error::Lost`] (the outcome is unknown).

use crate::error::{shorten, Error, Problem};
use crate::Target;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, HOST};
use http::Method;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

/// A connection, plain or TLS.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Decides whether a resolved address may be dialled; the error says why not.
pub type AddressCheck = Arc<dyn Fn(SocketAddr) -> Result<(), String> + Send + Sync>;

/// How long a connect may take by default.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request may take by default.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest answer body read by default.
pub const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// A request: everything but where it goes.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: Method,
    /// Path and query, already percent-encoded (see [`crate::segment`]).
    pub path: String,
    /// Headers on top of the transport's own; checked when sent.
    pub headers: Vec<(String, String)>,
    pub body: Bytes,
    /// The whole call (connect, send, answer) ends by then.
    pub timeout: Duration,
    /// Answers with a larger body fail with [`Error::Malformed`].
    pub max_answer: usize,
}

impl Request {
    pub fn new(method: Method, path: impl Into<String>) -> Self {
        Self {
            method,
            path: path.into(),
            headers: Vec::new(),
            body: Bytes::new(),
            timeout: REQUEST_TIMEOUT,
            max_answer: MAX_ANSWER_BYTES,
        }
    }

    pub fn get(path: impl Into<String>) -> Self {
        Self::new(Method::GET, path)
    }

    pub fn post(path: impl Into<String>) -> Self {
        Self::new(Method::POST, path)
    }

    /// A JSON body (`application/json`).
    pub fn json(self, body: &serde_json::Value) -> Self {
        self.body("application/json", body.to_string())
    }

    /// A body with its content type.
    pub fn body(mut self, content_type: &str, body: impl Into<Bytes>) -> Self {
        self.headers
            .push((CONTENT_TYPE.as_str().to_string(), content_type.to_string()));
        self.body = body.into();
        self
    }

    /// A body sent with exactly the headers given (no content type added).
    pub fn raw_body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = body.into();
        self
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }

    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn max_answer(mut self, bytes: usize) -> Self {
        self.max_answer = bytes;
        self
    }

    fn what(&self) -> String {
        format!("{} {}", self.method, self.path)
    }
}

/// An answer, whatever its status.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Response {
    /// A header's value, when present and text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body as text (lossy: for showing, never for re-parsing).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as `T`; an empty body reads as JSON `null`.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, Error> {
        let body: &[u8] = if self.body.iter().all(u8::is_ascii_whitespace) {
            b"null"
        } else {
            &self.body
        };
        serde_json::from_slice(body).map_err(|e| {
            Error::Malformed(format!(
                "the server answered {} with a body that is not the JSON expected ({e}): {}",
                self.status,
                shorten(&self.text(), 200)
            ))
        })
    }

    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// `self` when 2xx, else the problem it carries.
    pub fn success(self) -> Result<Self, Error> {
        if self.is_success() {
            Ok(self)
        } else {
            Err(Error::Api(Box::new(Problem::of(&self))))
        }
    }
}

// Reading an answer into its problem is here, with `Response`, so that the error types
// do not depend on the transport (which depends on them).
impl Problem {
    /// Reads a problem+json answer; a body that is not one is kept as text.
    pub fn of(answer: &Response) -> Self {
        let parsed: Option<serde_json::Value> = serde_json::from_slice(&answer.body).ok();
        let text_of = |k: &str| {
            parsed
                .as_ref()
                .and_then(|v| v.get(k))
                .and_then(|v| v.as_str())
                .map(str::to_string)
        };
        let title = text_of("title");
        let detail = text_of("detail")
            .or_else(|| title.clone())
            .unwrap_or_else(|| {
                let body = answer.text();
                if body.trim().is_empty() {
                    "the server gave no detail".to_string()
                } else {
                    shorten(body.trim(), 300)
                }
            });
        Self {
            status: answer.status,
            kind: text_of("type"),
            title,
            detail,
            field: text_of("field"),
            retry_after: answer.header("retry-after").map(str::to_string),
        }
    }
}

/// How connections are made and what every request carries.
#[derive(Clone)]
pub struct Transport {
    tls: Option<TlsConnector>,
    check: Option<AddressCheck>,
    connect_timeout: Duration,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// What the target is, for messages ("meshd": "cannot reach meshd at …").
    called: Option<&'static str>,
}

impl Default for Transport {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Header values may be credentials: only their names are shown.
        let names: Vec<&str> = self.headers.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("Transport")
            .field("tls", &self.tls.is_some())
            .field("address_check", &self.check.is_some())
            .field("connect_timeout", &self.connect_timeout)
            .field("headers", &names)
            .finish()
    }
}

impl Transport {
    /// Plain connections only; `https://` targets fail until [`Transport::with_tls`].
    pub fn new() -> Self {
        Self {
            tls: None,
            check: None,
            connect_timeout: CONNECT_TIMEOUT,
            headers: Vec::new(),
            called: None,
        }
    }

    /// Names what the targets are in messages ("cannot reach meshd at …").
    pub fn calling(mut self, what: &'static str) -> Self {
        self.called = Some(what);
        self
    }

    fn name(&self, target: &Target) -> String {
        match self.called {
            Some(what) => format!("{what} at {}", target.shown),
            None => target.shown.clone(),
        }
    }

    pub fn with_tls(mut self, tls: TlsConnector) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Whether `https://` targets can be reached.
    pub fn has_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Every resolved address is checked before it is dialled; a name cannot lead the
    /// connection somewhere `check` refuses.
    pub fn with_address_check(mut self, check: AddressCheck) -> Self {
        self.check = Some(check);
        self
    }

    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// A header every request carries (credentials, user agent). The value is marked
    /// sensitive.
    pub fn with_header(mut self, name: &str, value: &str) -> Result<Self, Error> {
        let n = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| Error::Invalid(format!("{name:?} is not a header name")))?;
        let mut v = HeaderValue::from_str(value).map_err(|_| {
            Error::Invalid(format!(
                "the value of {name} has characters a header cannot carry"
            ))
        })?;
        v.set_sensitive(true);
        self.headers.push((n, v));
        Ok(self)
    }

    /// A connection to `target`, TLS for `https://`, bounded by the connect timeout.
    pub async fn connect(&self, target: &Target) -> Result<Box<dyn Stream>, Error> {
        let deadline = Instant::now() + self.connect_timeout;
        self.connect_by(target, deadline).await
    }

    async fn connect_by(
        &self,
        target: &Target,
        deadline: Instant,
    ) -> Result<Box<dyn Stream>, Error> {
        let deadline = deadline.min(Instant::now() + self.connect_timeout);
        match tokio::time::timeout_at(deadline, self.dial(target)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Unreachable(format!(
                "cannot reach {}: no connection within {} ms",
                self.name(target),
                self.connect_timeout.as_millis()
            ))),
        }
    }

    async fn dial(&self, target: &Target) -> Result<Box<dyn Stream>, Error> {
        let name = self.name(target);
        let unreachable = |why: String| Error::Unreachable(format!("cannot reach {name}: {why}"));
        let tls = match (target.https, &self.tls) {
            (false, _) => None,
            (true, Some(tls)) => Some(tls),
            (true, None) => {
                return Err(Error::Invalid(format!(
                    "{}: an https:// target needs a TLS client (a CA to trust)",
                    target.shown
                )))
            }
        };
        let (host, port) = (target.host.as_str(), target.port);
        let tcp = match &self.check {
            None => TcpStream::connect((host, port))
                .await
                .map_err(|e| unreachable(format!("connection failed: {e}")))?,
            Some(check) => {
                let addrs = tokio::net::lookup_host((host, port))
                    .await
                    .map_err(|e| unreachable(format!("resolving {host} failed: {e}")))?;
                let (mut refused, mut failed) = (None, None);
                let mut connected = None;
                for addr in addrs {
                    if let Err(why) = check(addr) {
                        refused.get_or_insert(why);
                        continue;
                    }
                    match TcpStream::connect(addr).await {
                        Ok(s) => {
                            connected = Some(s);
                            break;
                        }
                        Err(e) => failed = Some(format!("connection failed: {e}")),
                    }
                }
                match (connected, failed, refused) {
                    (Some(s), _, _) => s,
                    (None, Some(e), _) => return Err(unreachable(e)),
                    (None, None, Some(why)) => return Err(unreachable(why)),
                    (None, None, None) => {
                        return Err(unreachable(format!("{host} resolved to no address")))
                    }
                }
            }
        };
        // Latency over throughput: requests are small and answered one at a time.
        let _ = tcp.set_nodelay(true);
        let Some(tls) = tls else {
            return Ok(Box::new(tcp));
        };
        let name = rustls::pki_types::ServerName::try_from(host.to_string())
            .map_err(|e| Error::Invalid(format!("{host} is not a TLS server name: {e}")))?;
        let stream = tls
            .connect(name, tcp)
            .await
            .map_err(|e| unreachable(format!("TLS handshake failed: {e}")))?;
        Ok(Box::new(stream))
    }

    /// Sends `req` to `target` on a connection of its own and returns the answer,
    /// whatever its status.
    pub async fn send(&self, target: &Target, req: Request) -> Result<Response, Error> {
        self.one_shot(target, req, true).await
    }

    /// [`Transport::send`], but the answer's body is not read (see
    /// [`Connection::send_for_status`]).
    pub async fn send_for_status(&self, target: &Target, req: Request) -> Result<Response, Error> {
        self.one_shot(target, req, false).await
    }

    /// One request on a connection of its own, connect included in its timeout.
    async fn one_shot(
        &self,
        target: &Target,
        req: Request,
        read_body: bool,
    ) -> Result<Response, Error> {
        let deadline = Instant::now() + req.timeout;
        let mut conn = self.open_by(target, deadline).await?;
        let left = deadline.saturating_duration_since(Instant::now());
        conn.exchange(req.timeout(left), read_body).await
    }

    /// A keep-alive connection to `target`: requests go one at a time.
    pub async fn open(&self, target: &Target) -> Result<Connection, Error> {
        self.open_by(target, Instant::now() + self.connect_timeout)
            .await
    }

    /// Sends `req` on a connection of its own and returns the answer's head with its
    /// body unread, to be read piece by piece ([`Streaming::chunk`]): a stream of
    /// Server-Sent Events. `req`'s timeout bounds the connect and the head.
    pub async fn send_streaming(&self, target: &Target, req: Request) -> Result<Streaming, Error> {
        let deadline = Instant::now() + req.timeout;
        let conn = self.open_by(target, deadline).await?;
        let left = deadline.saturating_duration_since(Instant::now());
        conn.send_streaming(req.timeout(left)).await
    }

    async fn open_by(&self, target: &Target, deadline: Instant) -> Result<Connection, Error> {
        let stream = self.connect_by(target, deadline).await?;
        let stream = AnswerFirst {
            inner: stream,
            broken: false,
        };
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| Error::Unreachable(format!("cannot reach {}: {e}", self.name(target))))?;
        let driver = tokio::spawn(async move {
            // Its end (a close, an error) is seen by the request that needed it.
            let _ = conn.await;
        });
        let mut headers = self.headers.clone();
        if let Ok(host) = HeaderValue::from_str(&target.authority()) {
            headers.push((HOST, host));
        }
        Ok(Connection {
            sender,
            driver,
            headers,
            shown: self.name(target),
        })
    }
}

/// A stream whose writes stop failing once the peer stopped reading: a server may
/// answer (413) and close before it read a large body, and the answer is what counts.
/// What was left unwritten is dropped; if no answer follows, reading fails and the
/// request is reported lost.
struct AnswerFirst {
    inner: Box<dyn Stream>,
    broken: bool,
}

impl AnswerFirst {
    /// `r`, or `written` when `r` says the peer stopped reading.
    fn forgive<T>(&mut self, r: std::io::Result<T>, written: T) -> std::io::Result<T> {
        match r {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                self.broken = true;
                Ok(written)
            }
            other => other,
        }
    }
}

impl AsyncRead for AnswerFirst {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for AnswerFirst {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.broken {
            return std::task::Poll::Ready(Ok(buf.len()));
        }
        match std::pin::Pin::new(&mut self.inner).poll_write(cx, buf) {
            std::task::Poll::Ready(r) => std::task::Poll::Ready(self.forgive(r, buf.len())),
            pending => pending,
        }
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.broken {
            return std::task::Poll::Ready(Ok(()));
        }
        match std::pin::Pin::new(&mut self.inner).poll_flush(cx) {
            std::task::Poll::Ready(r) => std::task::Poll::Ready(self.forgive(r, ())),
            pending => pending,
        }
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.broken {
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// An answer whose body is read as it arrives (see [`Transport::send_streaming`]).
pub struct Streaming {
    pub status: u16,
    pub headers: http::HeaderMap,
    body: hyper::body::Incoming,
    what: String,
    _conn: Connection,
}

impl Streaming {
    /// The next piece of the body; `None` at its end. A piece that does not arrive
    /// within `idle` is [`Error::Lost`].
    pub async fn chunk(&mut self, idle: Duration) -> Result<Option<Bytes>, Error> {
        loop {
            let frame = match tokio::time::timeout(idle, self.body.frame()).await {
                Err(_) => {
                    return Err(Error::Lost(format!(
                        "{}: nothing arrived for {} ms",
                        self.what,
                        idle.as_millis()
                    )))
                }
                Ok(None) => return Ok(None),
                Ok(Some(Err(e))) => {
                    return Err(Error::Lost(format!(
                        "{}: the answer was cut off ({e})",
                        self.what
                    )))
                }
                Ok(Some(Ok(f))) => f,
            };
            if let Ok(data) = frame.into_data() {
                return Ok(Some(data));
            }
        }
    }

    /// The rest of the body (at most `max` bytes), as an ordinary answer (an error
    /// answer to a streaming request carries a problem).
    pub async fn rest(mut self, max: usize, idle: Duration) -> Result<Response, Error> {
        let mut body = Vec::new();
        while let Some(c) = self.chunk(idle).await? {
            body.extend_from_slice(&c);
            if body.len() > max {
                break;
            }
        }
        Ok(Response {
            status: self.status,
            headers: std::mem::take(&mut self.headers),
            body: Bytes::from(body),
        })
    }
}

/// A connection: one request at a time; after an error it is unusable.
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    driver: tokio::task::JoinHandle<()>,
    /// The transport's headers and `Host`.
    headers: Vec<(HeaderName, HeaderValue)>,
    shown: String,
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

impl Connection {
    /// Sends `req` and returns the answer, whatever its status.
    pub async fn send(&mut self, req: Request) -> Result<Response, Error> {
        self.exchange(req, true).await
    }

    /// Sends `req` and returns the answer's status and headers once they arrive; the
    /// body is not read (a webhook's answer body means nothing to meshd). The
    /// connection is unusable afterwards.
    pub async fn send_for_status(&mut self, req: Request) -> Result<Response, Error> {
        self.exchange(req, false).await
    }

    /// Sends `req` and returns the answer's head; the body is read with
    /// [`Streaming::chunk`]. The connection goes with it.
    pub async fn send_streaming(mut self, req: Request) -> Result<Streaming, Error> {
        let what = req.what();
        let shown = self.shown.clone();
        let timeout = req.timeout;
        let request = self.build(req)?;
        let head = async {
            self.sender.ready().await.map_err(|e| {
                Error::Unreachable(format!("{what} on {shown}: the connection is closed ({e})"))
            })?;
            self.sender.send_request(request).await.map_err(|e| {
                Error::Lost(format!("{what} on {shown}: the connection was lost ({e})"))
            })
        };
        let answer = match tokio::time::timeout(timeout, head).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Lost(format!(
                    "{what} on {shown}: no answer within {} ms",
                    timeout.as_millis()
                )))
            }
        };
        let (parts, body) = answer.into_parts();
        Ok(Streaming {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
            what: format!("{what} on {shown}"),
            _conn: self,
        })
    }

    async fn exchange(&mut self, req: Request, read_body: bool) -> Result<Response, Error> {
        let what = req.what();
        let shown = self.shown.clone();
        let timeout = req.timeout;
        let max = req.max_answer;
        let request = self.build(req)?;
        let lost = |why: String| {
            Error::Lost(format!(
                "{what} on {shown}: {why}; the request may or may not have been applied"
            ))
        };
        let exchange = async {
            self.sender.ready().await.map_err(|e| {
                Error::Unreachable(format!("{what} on {shown}: the connection is closed ({e})"))
            })?;
            let answer = self
                .sender
                .send_request(request)
                .await
                .map_err(|e| lost(format!("the connection was lost ({e})")))?;
            let (parts, body) = answer.into_parts();
            if !read_body {
                return Ok(Response {
                    status: parts.status.as_u16(),
                    headers: parts.headers,
                    body: Bytes::new(),
                });
            }
            let body = Limited::new(body, max)
                .collect()
                .await
                .map_err(|e| {
                    if e.is::<http_body_util::LengthLimitError>() {
                        Error::Malformed(format!(
                            "{what} on {shown}: the answer is larger than {max} bytes"
                        ))
                    } else {
                        lost(format!("the answer was cut off ({e})"))
                    }
                })?
                .to_bytes();
            Ok(Response {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body,
            })
        };
        match tokio::time::timeout(timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(lost(format!("no answer within {} ms", timeout.as_millis()))),
        }
    }

    fn build(&self, req: Request) -> Result<http::Request<Full<Bytes>>, Error> {
        let what = req.what();
        let mut builder = http::Request::builder().method(req.method).uri(&req.path);
        let given = |n: &HeaderName| {
            req.headers
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case(n.as_str()))
        };
        for (k, v) in &self.headers {
            if !given(k) {
                builder = builder.header(k, v);
            }
        }
        for (k, v) in &req.headers {
            let n = HeaderName::from_bytes(k.as_bytes())
                .map_err(|_| Error::Invalid(format!("{what}: {k:?} is not a header name")))?;
            let v = HeaderValue::from_str(v).map_err(|_| {
                Error::Invalid(format!(
                    "{what}: the value of {k} has characters a header cannot carry"
                ))
            })?;
            builder = builder.header(n, v);
        }
        builder
            .body(Full::new(req.body))
            .map_err(|e| Error::Invalid(format!("{what}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A server that reads the request head, then writes `answer` raw and closes.
    async fn answering(answer: &'static [u8]) -> Target {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if s.read(&mut b).await.unwrap_or(0) == 0 {
                        break;
                    }
                    head.push(b[0]);
                }
                let _ = s.write_all(answer).await;
            }
        });
        Target::parse(&format!("http://{addr}")).unwrap()
    }

    #[tokio::test]
    async fn answers_framed_by_length_or_chunks_are_read() {
        let t = answering(b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n1\r\nd\r\n0\r\n\r\n").await;
        let a = Transport::new().send(&t, Request::get("/x")).await.unwrap();
        assert_eq!((a.status, &a.body[..]), (404, &b"abcd"[..]));
        let t = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n\r\n{}").await;
        let a = Transport::new().send(&t, Request::get("/")).await.unwrap();
        assert_eq!((a.status, a.header("x-a")), (200, Some("b")));
        assert!(a.json::<serde_json::Value>().unwrap().is_object());
    }

    #[tokio::test]
    async fn an_early_answer_to_a_large_body_is_the_answer() {
        // The server answers 413 after the head and closes without reading the body.
        let t = answering(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        .await;
        let big = vec![b'x'; 8 * 1024 * 1024];
        let a = Transport::new()
            .send(&t, Request::post("/").raw_body(big))
            .await
            .unwrap();
        assert_eq!(a.status, 413);
    }

    #[tokio::test]
    async fn failures_say_whether_anything_was_sent() {
        // Nothing listens: unreachable, nothing sent.
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let t = Target::parse(&format!("http://{addr}")).unwrap();
        let e = Transport::new()
            .send(&t, Request::get("/"))
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::Unreachable(_)) && !e.outcome_unknown(),
            "{e}"
        );
        // Closed after the request: lost, outcome unknown.
        let t = answering(b"").await;
        let e = Transport::new()
            .send(&t, Request::post("/"))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Lost(_)) && e.outcome_unknown(), "{e}");
        assert!(e.to_string().contains("may or may not"), "{e}");
        // An answer larger than allowed.
        let t = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789").await;
        let e = Transport::new()
            .send(&t, Request::get("/").max_answer(4))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Malformed(_)), "{e}");
        // Refused by the address check before dialling.
        let t = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").await;
        let e = Transport::new()
            .with_address_check(Arc::new(|a| Err(format!("{a} is ours"))))
            .send(&t, Request::get("/"))
            .await
            .unwrap_err();
        assert!(
            matches!(e, Error::Unreachable(_)) && e.to_string().contains("is ours"),
            "{e}"
        );
        // https without a TLS client.
        let e = Transport::new()
            .send(
                &Target::parse("https://127.0.0.1:1").unwrap(),
                Request::get("/"),
            )
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Invalid(_)), "{e}");
        // A header value that cannot be sent.
        let e = Transport::new()
            .send(&t, Request::get("/").header("x", "a\r\nb"))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Invalid(_)), "{e}");
    }

    #[tokio::test]
    async fn a_keep_alive_connection_carries_requests_one_after_another() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut b = [0u8; 1024];
            for i in 0..3 {
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    let n = s.read(&mut b).await.unwrap();
                    buf.extend_from_slice(&b[..n]);
                }
                let end = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
                buf.drain(..end);
                let body = format!("{i}");
                let a = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                s.write_all(a.as_bytes()).await.unwrap();
            }
        });
        let t = Target::parse(&format!("http://{addr}")).unwrap();
        let mut c = Transport::new().open(&t).await.unwrap();
        for i in 0..3 {
            let a = c.send(Request::get("/")).await.unwrap();
            assert_eq!(a.text(), i.to_string());
        }
    }
}
