//! etcd's backend quota, read from its metrics endpoint.
//!
//! etcd's `Status` RPC reports the database size but not the quota it is measured
//! against (`--quota-backend-bytes`, 2 GiB by default). etcd 3.4+ exports the quota as
//! the gauge `etcd_server_quota_backend_bytes` on `/metrics`, which it serves on its
//! client URLs (over TLS with the same certificates when the client URLs are TLS). This
//! module reads that one value: a plain HTTP/1.0 GET (so the answer is not chunked),
//! the body read to its end within a deadline and a size cap.

use crate::config::TlsPems;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// The gauge etcd exports its quota as.
const GAUGE: &str = "etcd_server_quota_backend_bytes";
/// More than etcd's whole metrics page; a longer answer is refused.
const MAX_BYTES: usize = 4 * 1024 * 1024;

/// How to reach one endpoint's metrics.
#[derive(Clone)]
pub(crate) struct QuotaProbe {
    host: String,
    port: u16,
    tls: Option<Arc<tokio_rustls::rustls::ClientConfig>>,
}

impl QuotaProbe {
    /// From an endpoint as configured (`host:port`, `http://host:port`,
    /// `https://host:port`) and the TLS files when etcd serves TLS.
    pub(crate) fn new(endpoint: &str, tls: Option<&TlsPems>) -> Result<Self, String> {
        let lower = endpoint.to_ascii_lowercase();
        let rest = if lower.starts_with("https://") || lower.starts_with("http://") {
            &endpoint[endpoint.find("://").map_or(0, |i| i + 3)..]
        } else {
            endpoint
        };
        let rest = rest.trim_end_matches('/');
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| format!("etcd endpoint {endpoint:?} has no port"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("etcd endpoint {endpoint:?} has no valid port"))?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let tls = match tls {
            Some(pems) => Some(Arc::new(client_config(pems)?)),
            None => None,
        };
        Ok(Self { host, port, tls })
    }

    /// The quota in bytes, or why it could not be read.
    pub(crate) async fn read(&self, timeout: Duration) -> Result<u64, String> {
        tokio::time::timeout(timeout, self.fetch())
            .await
            .map_err(|_| format!("no answer from etcd's /metrics within {timeout:?}"))?
    }

    async fn fetch(&self) -> Result<u64, String> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("connecting to etcd's /metrics: {e}"))?;
        let body = match &self.tls {
            None => get(tcp, &self.host).await?,
            Some(config) => {
                let name = tokio_rustls::rustls::pki_types::ServerName::try_from(self.host.clone())
                    .map_err(|e| format!("etcd host {:?}: {e}", self.host))?;
                let stream = tokio_rustls::TlsConnector::from(config.clone())
                    .connect(name, tcp)
                    .await
                    .map_err(|e| format!("TLS to etcd's /metrics: {e}"))?;
                get(stream, &self.host).await?
            }
        };
        parse(&body)
    }
}

fn client_config(pems: &TlsPems) -> Result<tokio_rustls::rustls::ClientConfig, String> {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pems.ca) {
        let cert = cert.map_err(|e| format!("etcd CA: {e}"))?;
        roots.add(cert).map_err(|e| format!("etcd CA: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .with_root_certificates(roots);
    match &pems.identity {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => {
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
                .collect::<Result<_, _>>()
                .map_err(|e| format!("etcd client certificate: {e}"))?;
            let key =
                PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("etcd client key: {e}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("etcd client certificate: {e}"))
        }
    }
}

async fn get<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, host: &str) -> Result<Vec<u8>, String> {
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n");
    s.write_all(request.as_bytes())
        .await
        .map_err(|e| format!("asking etcd's /metrics: {e}"))?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match s.read(&mut buf).await {
            Ok(n) => n,
            // A TLS peer that closes without close_notify: what was read is whole
            // when the headers said so; the parse tells.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => 0,
            Err(e) => return Err(format!("reading etcd's /metrics: {e}")),
        };
        if n == 0 {
            return Ok(out);
        }
        if out.len() + n > MAX_BYTES {
            return Err(format!(
                "etcd's /metrics answer is larger than {MAX_BYTES} bytes"
            ));
        }
        out.extend_from_slice(&buf[..n]);
    }
}

/// The gauge's value in an HTTP/1.x answer with status 200.
fn parse(answer: &[u8]) -> Result<u64, String> {
    let text = String::from_utf8_lossy(answer);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or("etcd's /metrics answer has no header end")?;
    let status = head.lines().next().unwrap_or_default();
    if !status.starts_with("HTTP/1.") || status.split(' ').nth(1) != Some("200") {
        return Err(format!("etcd's /metrics answered {status:?}"));
    }
    for line in body.lines() {
        let Some(rest) = line.strip_prefix(GAUGE) else {
            continue;
        };
        // `name value` (no labels) or `name{labels} value`.
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            continue;
        }
        let value = rest.rsplit(' ').next().unwrap_or_default();
        let v: f64 = value
            .parse()
            .map_err(|_| format!("{GAUGE} is not a number: {value:?}"))?;
        if !(v.is_finite() && v >= 0.0) {
            return Err(format!("{GAUGE} is {v}"));
        }
        return Ok(v as u64);
    }
    Err(format!(
        "etcd's /metrics has no {GAUGE} (etcd older than 3.4?)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_gauge_and_refuses_what_is_not_it() {
        let ok = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n# HELP etcd_server_quota_backend_bytes x\n# TYPE etcd_server_quota_backend_bytes gauge\netcd_server_quota_backend_bytes_x 1\netcd_server_quota_backend_bytes 2.147483648e+09\n";
        assert_eq!(parse(ok), Ok(2_147_483_648));
        for (bad, why) in [
            (&b"HTTP/1.0 404 Not Found\r\n\r\n"[..], "answered"),
            (b"HTTP/1.0 200 OK\r\n\r\nother 1\n", "has no"),
            (
                b"HTTP/1.0 200 OK\r\n\r\netcd_server_quota_backend_bytes x\n",
                "not a number",
            ),
            (
                b"HTTP/1.0 200 OK\r\n\r\netcd_server_quota_backend_bytes -1\n",
                "is -1",
            ),
            (b"garbage", "header end"),
        ] {
            let e = parse(bad).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn endpoints_in_every_configured_form() {
        for e in [
            "127.0.0.1:2379",
            "http://127.0.0.1:2379",
            "HTTPS://127.0.0.1:2379/",
        ] {
            let p = QuotaProbe::new(e, None).unwrap();
            assert_eq!((p.host.as_str(), p.port), ("127.0.0.1", 2379), "{e}");
        }
        let p = QuotaProbe::new("[::1]:2379", None).unwrap();
        assert_eq!(p.host, "::1");
        assert!(QuotaProbe::new("localhost", None).is_err());
        assert!(QuotaProbe::new("localhost:x", None).is_err());
    }
}
