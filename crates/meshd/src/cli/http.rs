//! A small HTTP/1.1 client for the CLI: one request per connection (`Connection:
//! close`), `http://` or `https://` (rustls; the CA from `--ca-file`, else the
//! system's bundle). Hand-written over tokio's `TcpStream` so the binary
//! needs no client stack (hyper-util, reqwest) and the build stays fast; the CLI sends a
//! handful of requests, so connection reuse is not worth its complexity.
//!
//! Transport failures are classified here, once: a failure to connect is
//! [`CliError::Unreachable`]; a connection lost or a timeout after the request was sent
//! is also `Unreachable`, but says that the outcome is unknown (the write may or may not
//! have been applied, as with a 504).

use super::error::{CliError, Problem};
use serde_json::Value;
use std::path::Path;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsConnector;

use crate::net::Stream;

/// How long a connect may take before the server counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a request may take on top of any long-poll wait it asks for.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Where requests go: parsed once from `--server`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port`, what `TcpStream::connect` resolves.
    authority: String,
    /// A path prefix (no trailing slash), for a meshd behind a path-routing proxy.
    base_path: String,
    /// As the operator wrote it, for messages.
    shown: String,
    /// `https://`: TLS, the certificate checked for the host of `authority`.
    https: bool,
}

impl Target {
    /// Parses `http[s]://host[:port][/prefix]` (or `host[:port]`, taken as http).
    pub fn parse(server: &str) -> Result<Self, CliError> {
        let s = server.trim();
        let (rest, tls) = if let Some(r) = s.strip_prefix("http://") {
            (r, false)
        } else if let Some(r) = s.strip_prefix("https://") {
            (r, true)
        } else if s.contains("://") {
            return Err(CliError::Usage(format!(
                "--server {s}: expected http://host:port or https://host:port"
            )));
        } else {
            (s, false)
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let bad = |why: &str| CliError::Usage(format!("--server {s}: {why}"));
        if authority.is_empty() {
            return Err(bad("no host"));
        }
        if authority
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '@')
        {
            return Err(bad("not a host:port"));
        }
        // A port is present unless the authority ends in a host (or an IPv6 literal).
        let has_port = match authority.rfind(':') {
            Some(i) => !authority[i..].contains(']'),
            None => false,
        };
        let authority = if has_port {
            let port = &authority[authority.rfind(':').map_or(0, |i| i + 1)..];
            if port.parse::<u16>().is_err() {
                return Err(bad("the port is not a number from 0 to 65535"));
            }
            authority.to_string()
        } else if tls {
            format!("{authority}:443")
        } else {
            format!("{authority}:80")
        };
        if path.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("the path has whitespace or control characters"));
        }
        Ok(Self {
            authority,
            base_path: path.trim_end_matches('/').to_string(),
            shown: s.to_string(),
            https: tls,
        })
    }
}

/// One HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as text (lossy: it is shown, never re-parsed from this).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The body parsed as JSON; `Null` for an empty body (204).
    pub fn json(&self) -> Result<Value, CliError> {
        if self.body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&self.body).map_err(|e| {
            CliError::Failed(format!(
                "the server answered {} with a body that is not JSON ({e}): {}",
                self.status,
                shorten(&self.text(), 200)
            ))
        })
    }
}

/// A request to send: everything but the target.
pub struct Request<'a> {
    pub method: &'a str,
    /// Path and query, already percent-encoded (see [`segment`]).
    pub path: String,
    pub content_type: Option<&'a str>,
    pub headers: Vec<(&'a str, String)>,
    pub body: Vec<u8>,
    pub timeout: Duration,
}

impl<'a> Request<'a> {
    pub fn new(method: &'a str, path: String) -> Self {
        Self {
            method,
            path,
            content_type: None,
            headers: Vec::new(),
            body: Vec::new(),
            timeout: REQUEST_TIMEOUT,
        }
    }

    pub fn json(mut self, body: &Value) -> Self {
        self.content_type = Some("application/json");
        self.body = body.to_string().into_bytes();
        self
    }
}

/// The client: a current-thread runtime (the CLI does one thing at a time) and the
/// target. Its methods block.
pub struct Client {
    runtime: tokio::runtime::Runtime,
    target: Target,
    /// `Authorization: Bearer` value, when tokens are configured on the server.
    token: Option<String>,
    /// `https://` targets.
    tls: Option<TlsConnector>,
}

/// A TLS client trusting the CAs of `ca_file` (PEM), or the system's bundle.
fn tls_connector(ca_file: Option<&Path>) -> Result<TlsConnector, CliError> {
    crate::net::client_connector(ca_file).map_err(|why| {
        CliError::Usage(match ca_file {
            Some(_) => format!("--ca-file: {why}"),
            None => format!(
                "no --ca-file given and the system CA bundle is not usable ({why}); pass --ca-file"
            ),
        })
    })
}

impl Client {
    pub fn new(
        target: Target,
        token: Option<String>,
        ca_file: Option<&Path>,
    ) -> Result<Self, CliError> {
        let tls = match target.https {
            true => Some(tls_connector(ca_file)?),
            false => None,
        };
        if let Some(t) = &token {
            if t.is_empty() || t.chars().any(|c| c.is_control()) {
                return Err(CliError::Usage(
                    "--token is empty or has control characters".into(),
                ));
            }
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| CliError::Failed(format!("cannot start the async runtime: {e}")))?;
        Ok(Self {
            runtime,
            target,
            token,
            tls,
        })
    }

    /// Sends `req` and returns the answer, whatever its status. Only transport
    /// failures are errors.
    pub fn send(&self, req: Request<'_>) -> Result<Answer, CliError> {
        let timeout = req.timeout;
        let what = format!("{} {}", req.method, req.path);
        let fut = exchange(&self.target, self.tls.as_ref(), self.token.as_deref(), req);
        match self.runtime.block_on(async { tokio::time::timeout(timeout, fut).await }) {
            Ok(r) => r,
            Err(_) => Err(CliError::Unreachable(format!(
                "{what}: no answer from {} within {} s; the request may or may not have been applied",
                self.target.shown,
                timeout.as_secs()
            ))),
        }
    }

    /// Sends `req`; a 2xx answer is returned, anything else becomes
    /// [`CliError::Api`] with the problem's detail.
    pub fn ok(&self, req: Request<'_>) -> Result<Answer, CliError> {
        let answer = self.send(req)?;
        if (200..300).contains(&answer.status) {
            Ok(answer)
        } else {
            Err(CliError::Api(Problem::of(&answer)))
        }
    }

    pub fn get(&self, path: String) -> Result<Answer, CliError> {
        self.ok(Request::new("GET", path))
    }
}

/// A connection to the target, TLS for `https://`; a failure is `Unreachable`.
async fn connect(target: &Target, tls: Option<&TlsConnector>) -> Result<Box<dyn Stream>, CliError> {
    let (host, port) = crate::net::split_host_port(&target.authority)
        .ok_or_else(|| CliError::Usage(format!("--server {}: not host:port", target.shown)))?;
    tokio::time::timeout(CONNECT_TIMEOUT, crate::net::connect(host, port, tls))
        .await
        .map_err(|_| {
            CliError::Unreachable(format!(
                "cannot reach meshd at {}: no connection within {} s",
                target.shown,
                CONNECT_TIMEOUT.as_secs()
            ))
        })?
        .map_err(|e| CliError::Unreachable(format!("cannot reach meshd at {}: {e}", target.shown)))
}

async fn exchange(
    target: &Target,
    tls: Option<&TlsConnector>,
    token: Option<&str>,
    req: Request<'_>,
) -> Result<Answer, CliError> {
    let mut stream = connect(target, tls).await?;
    let lost = |e: std::io::Error| {
        CliError::Unreachable(format!(
            "lost the connection to {} during {} {}: {e}; the request may or may not have been applied",
            target.shown, req.method, req.path
        ))
    };
    let mut head = format!(
        "{} {}{} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nUser-Agent: meshd-cli/{}\r\nAccept: application/json, application/problem+json\r\n",
        req.method,
        target.base_path,
        req.path,
        target.authority,
        env!("CARGO_PKG_VERSION")
    );
    if let Some(ct) = req.content_type {
        head.push_str(&format!("Content-Type: {ct}\r\n"));
    }
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    for (k, v) in &req.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", req.body.len()));
    stream.write_all(head.as_bytes()).await.map_err(lost)?;
    // A server may answer (413) and close before reading a large body: the answer is
    // what counts, so a failed body write is only an error if no answer follows.
    let body_written = stream.write_all(&req.body).await;
    let mut raw = Vec::new();
    let read = read_answer(&mut stream, &mut raw).await;
    match (read, body_written) {
        (Ok(()), _) if !raw.is_empty() => {}
        (Err(e), _) if raw.is_empty() => return Err(lost(e)),
        (_, Err(e)) if raw.is_empty() => return Err(lost(e)),
        (Ok(()), Ok(())) => {
            return Err(lost(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "closed without an answer",
            )))
        }
        // A partial answer: parse what arrived; a short body is reported below.
        _ => {}
    }
    parse_answer(&raw)
}

/// Reads until the answer is complete: `Content-Length` bytes after the head, or the
/// end of the stream (chunked or unframed bodies; we asked for `Connection: close`).
async fn read_answer(stream: &mut Box<dyn Stream>, raw: &mut Vec<u8>) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if let Some(end) = head_end(raw) {
            if let Some(len) = content_length(&raw[..end]) {
                if raw.len() >= end.saturating_add(len) {
                    return Ok(());
                }
            }
        }
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        raw.extend_from_slice(&buf[..n]);
    }
}

fn head_end(raw: &[u8]) -> Option<usize> {
    raw.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

fn content_length(head: &[u8]) -> Option<usize> {
    let text = String::from_utf8_lossy(head);
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
}

fn parse_answer(raw: &[u8]) -> Result<Answer, CliError> {
    let malformed = |why: &str| CliError::Failed(format!("malformed HTTP answer: {why}"));
    let end = head_end(raw).ok_or_else(|| malformed("no end of head"))?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| malformed(&format!("status line {status_line:?}")))?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let rest = &raw[end..];
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let body = if chunked {
        dechunk(rest).ok_or_else(|| malformed("bad chunked framing"))?
    } else if let Some(len) = content_length(&raw[..end]) {
        rest.get(..len)
            .ok_or_else(|| malformed("the body is shorter than its Content-Length"))?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Answer {
        status,
        headers,
        body,
    })
}

fn dechunk(mut s: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = s.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&s[..line_end]).ok()?;
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let n = usize::from_str_radix(size_text, 16).ok()?;
        let data = s.get(line_end + 2..)?;
        if n == 0 {
            return Some(out);
        }
        out.extend_from_slice(data.get(..n)?);
        s = data.get(n.checked_add(2)?..)?;
    }
}

/// Percent-encodes one path segment or query value: everything but RFC 3986
/// unreserved characters, so no argument can change the request's shape.
pub fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `?k=v&...` from the pairs whose value is present (empty when none is).
pub fn query(pairs: &[(&str, Option<String>)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", segment(v))))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_bad_ones_are_usage_errors() {
        let t = Target::parse("http://127.0.0.1:7070").unwrap();
        assert_eq!(t.authority, "127.0.0.1:7070");
        assert_eq!(t.base_path, "");
        let t = Target::parse("localhost:1/mesh/").unwrap();
        assert_eq!(t.authority, "localhost:1");
        assert_eq!(t.base_path, "/mesh");
        assert_eq!(Target::parse("http://h").unwrap().authority, "h:80");
        assert_eq!(Target::parse("http://[::1]").unwrap().authority, "[::1]:80");
        assert_eq!(
            Target::parse("http://[::1]:9").unwrap().authority,
            "[::1]:9"
        );
        let t = Target::parse("https://meshd.example:7443/p").unwrap();
        assert_eq!(t.authority, "meshd.example:7443");
        assert!(t.https);
        assert_eq!(
            crate::net::split_host_port(&t.authority),
            Some(("meshd.example", 7443))
        );
        assert_eq!(Target::parse("https://h").unwrap().authority, "h:443");
        assert_eq!(
            crate::net::split_host_port(&Target::parse("https://[::1]").unwrap().authority),
            Some(("::1", 443))
        );
        assert!(!Target::parse("http://h").unwrap().https);
        for bad in ["ftp://h", "http://", "http://h:x", "http://a b", "h:99999"] {
            assert!(
                matches!(Target::parse(bad), Err(CliError::Usage(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn segments_cannot_smuggle_anything() {
        assert_eq!(segment("orders.v1_x-y~"), "orders.v1_x-y~");
        assert_eq!(segment("a/b c\r\n?"), "a%2Fb%20c%0D%0A%3F");
        assert_eq!(
            query(&[
                ("a", Some("x y".into())),
                ("b", None),
                ("c", Some("&".into()))
            ]),
            "?a=x%20y&c=%26"
        );
        assert_eq!(query(&[("a", None)]), "");
    }

    #[test]
    fn answers_parse_with_length_chunks_or_neither() {
        let a = parse_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}").unwrap();
        assert_eq!((a.status, a.body.as_slice()), (200, &b"{}"[..]));
        let a = parse_answer(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n1\r\nd\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((a.status, a.body.as_slice()), (404, &b"abcd"[..]));
        let a = parse_answer(b"HTTP/1.1 204 No Content\r\n\r\n").unwrap();
        assert_eq!(a.status, 204);
        assert!(a.json().unwrap().is_null());
        assert!(parse_answer(b"garbage").is_err());
        assert!(parse_answer(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{}").is_err());
        assert!(
            parse_answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n").is_err()
        );
    }
}
