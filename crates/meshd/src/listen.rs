//! The HTTP(S) listener: meshd's own accept loop over hyper's connection builder, so
//! that what a slow or hostile client may hold is bounded by configuration rather
//! than by memory:
//!
//! - at most `max_connections` open connections: at the cap the loop stops
//!   accepting (new clients wait in the kernel's backlog) until one closes;
//! - a TLS handshake must finish within `header_timeout`;
//! - request headers must arrive within `header_timeout` (hyper's header timer);
//! - a connection on which nothing was read or written for `idle_timeout` is closed
//!   (a long poll waits at most half a second less, so a waiting pull answers
//!   before its connection counts as idle);
//! - request bodies have their own deadline and memory budget (see
//!   [`crate::admission`]).
//!
//! With `--tls-cert` and `--tls-key` it serves HTTPS (rustls, TLS 1.2 and 1.3,
//! HTTP/1.1 and HTTP/2 by ALPN); otherwise plain HTTP.

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};
use tokio_rustls::TlsAcceptor;

/// How long open connections get to finish their requests at shutdown.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What one instance lets its clients hold.
#[derive(Clone, Debug)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

/// Connection counters, rendered with the other metrics.
#[derive(Default)]
pub struct HttpCounters {
    pub open: AtomicU64,
    pub max: AtomicU64,
    /// Times the accept loop found every connection slot taken.
    pub at_cap: AtomicU64,
    pub handshake_failed: AtomicU64,
    pub handshake_timeouts: AtomicU64,
    pub header_timeouts: AtomicU64,
    pub idle_timeouts: AtomicU64,
    /// SIGHUP reloads of the token files and the TLS certificate.
    pub reloads_ok: AtomicU64,
    pub reloads_failed: AtomicU64,
}

impl HttpCounters {
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let _ = writeln!(out, "# HELP meshd_http_connections Open client connections.\n# TYPE meshd_http_connections gauge\nmeshd_http_connections {}", get(&self.open));
        let _ = writeln!(out, "# HELP meshd_http_connections_max The connection cap (--max-connections).\n# TYPE meshd_http_connections_max gauge\nmeshd_http_connections_max {}", get(&self.max));
        let _ = writeln!(out, "# HELP meshd_http_connection_cap_reached_total Times every connection slot was taken and accepting paused.\n# TYPE meshd_http_connection_cap_reached_total counter\nmeshd_http_connection_cap_reached_total {}", get(&self.at_cap));
        let _ = writeln!(out, "# HELP meshd_http_connections_closed_total Connections meshd closed, by reason.\n# TYPE meshd_http_connections_closed_total counter");
        for (reason, c) in [
            ("tls_handshake_failed", &self.handshake_failed),
            ("tls_handshake_timeout", &self.handshake_timeouts),
            ("header_timeout", &self.header_timeouts),
            ("idle_timeout", &self.idle_timeouts),
        ] {
            let _ = writeln!(
                out,
                "meshd_http_connections_closed_total{{reason=\"{reason}\"}} {}",
                get(c)
            );
        }
        let _ = writeln!(out, "# HELP meshd_config_reloads_total Reloads of the token files and TLS certificate (SIGHUP), by outcome.\n# TYPE meshd_config_reloads_total counter\nmeshd_config_reloads_total{{outcome=\"ok\"}} {}\nmeshd_config_reloads_total{{outcome=\"failed\"}} {}", get(&self.reloads_ok), get(&self.reloads_failed));
    }
}

/// A certificate or key that cannot serve HTTPS; names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {reason}")]
    Read {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{what} {path} holds no PEM {expected}")]
    Empty {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
    },
    #[error("--tls-cert {cert} and --tls-key {key} do not make a usable TLS identity: {reason}")]
    Identity {
        cert: PathBuf,
        key: PathBuf,
        reason: String,
    },
}

/// The TLS acceptor of `--tls-cert` (PEM chain, leaf first) and `--tls-key` (PEM
/// PKCS#8, PKCS#1 or SEC1 key). Read once at start-up.
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let read = |what: &'static str, path: &Path| {
        std::fs::read(path).map_err(|e| TlsError::Read {
            what,
            path: path.to_path_buf(),
            reason: e.to_string(),
        })
    };
    let cert_pem = read("--tls-cert", cert)?;
    let key_pem = read("--tls-key", key)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Read {
            what: "--tls-cert",
            path: cert.to_path_buf(),
            reason: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(TlsError::Empty {
            what: "--tls-cert",
            path: cert.to_path_buf(),
            expected: "CERTIFICATE",
        });
    }
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::Empty {
            what: "--tls-key",
            path: key.to_path_buf(),
            expected: "PRIVATE KEY",
        },
        e => TlsError::Read {
            what: "--tls-key",
            path: key.to_path_buf(),
            reason: e.to_string(),
        },
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key_der))
        .map_err(|e| TlsError::Identity {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            reason: e.to_string(),
        })?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The HTTPS identity in force: read at start-up and again on every
/// [`reload`](ServerTls::reload) (SIGHUP), so a renewed certificate needs no
/// restart. New connections use the new one; a reload that fails keeps the old.
pub struct ServerTls {
    cert: PathBuf,
    key: PathBuf,
    current: std::sync::RwLock<TlsAcceptor>,
}

impl ServerTls {
    pub fn load(cert: &Path, key: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: std::sync::RwLock::new(tls_acceptor(cert, key)?),
        })
    }

    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = tls_acceptor(&self.cert, &self.key)?;
        *self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
        Ok(())
    }

    fn acceptor(&self) -> TlsAcceptor {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Serves `app` on `listener` until `shutdown` completes, then gives open connections
/// [`SHUTDOWN_GRACE`] to finish.
pub async fn serve(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    app: Router,
    limits: Limits,
    counters: Arc<HttpCounters>,
    shutdown: impl Future<Output = ()>,
) {
    counters
        .max
        .store(limits.max_connections as u64, Ordering::Relaxed);
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut connections = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        if slots.available_permits() == 0 {
            counters.at_cap.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                max_connections = limits.max_connections,
                "connection cap reached; accepting paused until a connection closes"
            );
        }
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break, // the semaphore is never closed
            },
            _ = &mut shutdown => break,
        };
        let (stream, _peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let watcher = graceful.watcher();
        let tls = tls.as_ref().map(|t| t.acceptor());
        let (app, limits, counters) = (app.clone(), limits.clone(), counters.clone());
        // Reap finished connection tasks so the set does not grow.
        while connections.try_join_next().is_some() {}
        connections.spawn(async move {
            // The connection's place under --max-connections goes with its socket, so
            // an upgraded connection (a WebSocket, which outlives this task) keeps it.
            let held = Held::new(slot, counters.clone());
            let activity = Arc::new(Activity::default());
            let io = IdleIo::new(stream, limits.idle_timeout, activity.clone()).holding(held);
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_timeout);
            builder.http2().timer(TokioTimer::new());
            // Every request marks the connection busy while it is handled, so the
            // idle timer never cuts a request that is being served (a long poll).
            let in_service = activity.clone();
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let busy = Busy::enter(in_service.clone());
                let app = app.clone();
                let (req, leftover) = {
                    let (parts, body) = req.into_parts();
                    let (body, leftover) = crate::unread::Tracked::new(body);
                    (hyper::Request::from_parts(parts, body), leftover)
                };
                async move {
                    let answer = tower::ServiceExt::oneshot(app, req).await;
                    // A body the handler did not read is read before the answer
                    // leaves (see `crate::unread`).
                    leftover.drain().await;
                    drop(busy);
                    answer
                }
            });
            let conn = async {
                match tls {
                    None => {
                        let conn =
                            builder.serve_connection_with_upgrades(TokioIo::new(io), service);
                        Some(watcher.watch(conn.into_owned()).await)
                    }
                    Some(acceptor) => {
                        match tokio::time::timeout(limits.header_timeout, acceptor.accept(io)).await
                        {
                            Err(_) => {
                                counters.handshake_timeouts.fetch_add(1, Ordering::Relaxed);
                                None
                            }
                            Ok(Err(e)) => {
                                counters.handshake_failed.fetch_add(1, Ordering::Relaxed);
                                tracing::debug!(error = %e, "TLS handshake failed");
                                None
                            }
                            Ok(Ok(tls)) => {
                                let conn = builder
                                    .serve_connection_with_upgrades(TokioIo::new(tls), service);
                                Some(watcher.watch(conn.into_owned()).await)
                            }
                        }
                    }
                }
            };
            // The first request must begin within the header timeout, whatever the
            // protocol: hyper's header timer covers HTTP/1 requests but not the
            // protocol detection nor HTTP/2.
            let mut conn = std::pin::pin!(conn);
            let result = tokio::select! {
                r = &mut conn => r,
                _ = tokio::time::sleep(limits.header_timeout) => {
                    if activity.started.load(Ordering::Relaxed) {
                        conn.await
                    } else {
                        counters.header_timeouts.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            };
            let Some(result) = result else { return };
            // hyper ends a connection that fails while idle between requests
            // without an error, so the idle flag is checked either way.
            if activity.expired.load(Ordering::Relaxed) {
                counters.idle_timeouts.fetch_add(1, Ordering::Relaxed);
            } else if let Err(e) = &result {
                if is_header_timeout(e.as_ref()) {
                    counters.header_timeouts.fetch_add(1, Ordering::Relaxed);
                }
            }
            if let Err(e) = result {
                tracing::debug!(error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            open = connections.len(),
            "connections still open after the shutdown grace period; closing them"
        );
    }
    // Whatever is left (a long poll, a client that never reads) is cut here, before
    // meshd flushes and closes its stores.
    connections.shutdown().await;
}

/// What one connection's requests tell its idle timer.
#[derive(Default)]
struct Activity {
    /// Requests being handled now.
    busy: std::sync::atomic::AtomicUsize,
    /// Whether any request began.
    started: std::sync::atomic::AtomicBool,
    /// Set when the idle timer closed the connection.
    expired: std::sync::atomic::AtomicBool,
}

/// Marks a request in progress on its connection.
struct Busy(Arc<Activity>);

impl Busy {
    fn enter(a: Arc<Activity>) -> Self {
        a.started.store(true, Ordering::Relaxed);
        a.busy.fetch_add(1, Ordering::Relaxed);
        Self(a)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

fn is_header_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(h) = err.downcast_ref::<hyper::Error>() {
            if h.is_timeout() {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

/// A connection's place under `max_connections` and in the open count, given back
/// when its socket is dropped.
struct Held {
    _slot: tokio::sync::OwnedSemaphorePermit,
    counters: Arc<HttpCounters>,
}

impl Held {
    fn new(slot: tokio::sync::OwnedSemaphorePermit, counters: Arc<HttpCounters>) -> Self {
        counters.open.fetch_add(1, Ordering::Relaxed);
        Self {
            _slot: slot,
            counters,
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.counters.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A stream that fails with `TimedOut` once nothing was read or written on it for
/// `idle` while no request was being handled on it. Progress only records an instant; the timer is re-armed lazily when it
/// fires early, so busy connections cost no timer updates.
struct IdleIo<S> {
    inner: S,
    idle: Duration,
    last: Instant,
    timer: Pin<Box<Sleep>>,
    activity: Arc<Activity>,
    /// The connection's place, held as long as the socket (see [`Held`]).
    _held: Option<Held>,
}

impl<S> IdleIo<S> {
    fn new(inner: S, idle: Duration, activity: Arc<Activity>) -> Self {
        let now = Instant::now();
        Self {
            inner,
            idle,
            last: now,
            timer: Box::pin(tokio::time::sleep_until(now + idle)),
            activity,
            _held: None,
        }
    }

    fn holding(mut self, held: Held) -> Self {
        self._held = Some(held);
        self
    }

    /// `Ready(err)` once the connection has been idle for too long.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        loop {
            if self.timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            if self.activity.busy.load(Ordering::Relaxed) > 0 {
                // A request is being handled: not idle.
                self.last = Instant::now();
            }
            let due = self.last + self.idle;
            if Instant::now() >= due {
                self.activity.expired.store(true, Ordering::Relaxed);
                return Poll::Ready(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "connection idle for too long",
                ));
            }
            self.timer.as_mut().reset(due);
        }
    }
}

impl<S> IdleIo<S> {
    /// A write's outcome: progress counts as activity; a write that cannot proceed (a
    /// client that stops reading) is idle time like any other.
    fn after_write(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match written {
            Poll::Ready(Ok(n)) => {
                if n > 0 {
                    self.last = Instant::now();
                }
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match self.poll_idle(cx) {
                Poll::Ready(e) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.last = Instant::now();
                }
                Poll::Ready(r)
            }
            Poll::Pending => match self.poll_idle(cx) {
                Poll::Ready(e) => Poll::Ready(Err(e)),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleIo<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.after_write(cx, written)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.after_write(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn an_idle_stream_times_out_and_a_busy_one_does_not() {
        let (a, mut b) = tokio::io::duplex(64);
        let activity = Arc::new(Activity::default());
        let mut io = IdleIo::new(a, Duration::from_secs(5), activity.clone());
        // Traffic every 3 s keeps it open past 5 s.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_secs(3)).await;
            b.write_all(b"x").await.unwrap();
            let mut one = [0u8; 1];
            io.read_exact(&mut one).await.unwrap();
        }
        assert!(!activity.expired.load(Ordering::Relaxed));
        // A request in progress keeps a quiet connection open past the timeout.
        let busy = Busy::enter(activity.clone());
        let mut one = [0u8; 1];
        let quiet = tokio::time::timeout(Duration::from_secs(12), io.read_exact(&mut one)).await;
        assert!(quiet.is_err(), "cut while a request was being handled");
        assert!(!activity.expired.load(Ordering::Relaxed));
        drop(busy);
        let err = io.read_exact(&mut one).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(activity.expired.load(Ordering::Relaxed));
    }

    #[test]
    fn a_missing_or_empty_certificate_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        let e = tls_acceptor(&cert, &key).err().unwrap().to_string();
        assert!(e.contains("--tls-cert") && e.contains("cert.pem"), "{e}");
        std::fs::write(&cert, "no pem here").unwrap();
        std::fs::write(&key, "").unwrap();
        let e = tls_acceptor(&cert, &key).err().unwrap().to_string();
        assert!(e.contains("no PEM CERTIFICATE"), "{e}");
    }
}
