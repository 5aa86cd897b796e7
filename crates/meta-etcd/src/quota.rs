//! etcd's backend quota, read from its metrics endpoint.
//!
//! etcd's `Status` RPC reports the database size but not the quota it is measured
//! against (`--quota-backend-bytes`, 2 GiB by default). etcd 3.4+ exports the quota as
//! the gauge `etcd_server_quota_backend_bytes` on `/metrics`, which it serves on its
//! client URLs (over TLS with the same certificates when the client URLs are TLS). This
//! module reads that one value through `meshd_client`'s transport, within a deadline
//! and a size cap.

use crate::config::TlsPems;
use std::sync::Arc;
use std::time::Duration;

/// The gauge etcd exports its quota as.
const GAUGE: &str = "etcd_server_quota_backend_bytes";
/// More than etcd's whole metrics page; a longer answer is refused.
const MAX_BYTES: usize = 4 * 1024 * 1024;

/// How to reach one endpoint's metrics.
#[derive(Clone)]
pub(crate) struct QuotaProbe {
    target: meshd_client::Target,
    transport: meshd_client::Transport,
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
        let mut transport = meshd_client::Transport::new();
        if let Some(pems) = tls {
            let config = Arc::new(client_config(pems)?);
            transport = transport.with_tls(tokio_rustls::TlsConnector::from(config));
        }
        let authority = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        let target = meshd_client::Target::peer(&authority, tls.is_some())
            .map_err(|e| format!("etcd endpoint {endpoint:?}: {e}"))?;
        Ok(Self { target, transport })
    }

    /// The quota in bytes, or why it could not be read.
    pub(crate) async fn read(&self, timeout: Duration) -> Result<u64, String> {
        let req = meshd_client::Request::get("/metrics")
            .header("accept", "text/plain")
            .timeout(timeout)
            .max_answer(MAX_BYTES);
        let answer = self
            .transport
            .send(&self.target, req)
            .await
            .map_err(|e| format!("etcd's /metrics: {e}"))?;
        if answer.status != 200 {
            return Err(format!("etcd's /metrics answered {}", answer.status));
        }
        parse(&answer.body)
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

/// The gauge's value in etcd's metrics page.
fn parse(page: &[u8]) -> Result<u64, String> {
    let body = String::from_utf8_lossy(page);
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
        let ok = b"# HELP etcd_server_quota_backend_bytes x\n# TYPE etcd_server_quota_backend_bytes gauge\netcd_server_quota_backend_bytes_x 1\netcd_server_quota_backend_bytes 2.147483648e+09\n";
        assert_eq!(parse(ok), Ok(2_147_483_648));
        for (bad, why) in [
            (&b"other 1\n"[..], "has no"),
            (b"etcd_server_quota_backend_bytes x\n", "not a number"),
            (b"etcd_server_quota_backend_bytes -1\n", "is -1"),
            (b"garbage", "has no"),
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
            assert_eq!(
                (p.target.host.as_str(), p.target.port),
                ("127.0.0.1", 2379),
                "{e}"
            );
        }
        let p = QuotaProbe::new("[::1]:2379", None).unwrap();
        assert_eq!(p.target.host, "::1");
        assert!(QuotaProbe::new("localhost", None).is_err());
        assert!(QuotaProbe::new("localhost:x", None).is_err());
    }
}
