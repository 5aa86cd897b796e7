//! Outgoing connections of meshd's small HTTP clients (the CLI, calls between cluster
//! instances, push delivery): plain TCP, or TLS trusting a CA file or the system's
//! bundle.

use std::path::Path;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// A connection, plain or TLS.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// Where Debian (and most Linux systems) keep the trusted CA bundle.
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A TLS client (the CLI, calls between cluster instances) trusting the CAs of
/// `ca_file` (PEM), or the system's bundle. The error says which file failed and why.
pub fn client_connector(ca_file: Option<&Path>) -> Result<TlsConnector, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;
    let path = ca_file.unwrap_or(Path::new(SYSTEM_CA_BUNDLE));
    let bad = |why: String| format!("CA file {}: {why}", path.display());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<_, _>>()
        .map_err(|e| bad(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(bad("no CA certificate in it".into()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// Connects to `host:port`; with `tls`, completes a handshake for `host` (a DNS
/// name or an IP address, without brackets). Errors are for messages: they say
/// which step failed.
pub async fn connect(
    host: &str,
    port: u16,
    tls: Option<&TlsConnector>,
) -> Result<Box<dyn Stream>, String> {
    connect_to(host, port, tls, None).await
}

/// [`connect`], but with `egress` the name is resolved here and only the addresses
/// the rules allow are tried (push: `crate::egress`), so a name cannot lead the
/// connection somewhere the rules refuse.
pub async fn connect_to(
    host: &str,
    port: u16,
    tls: Option<&TlsConnector>,
    egress: Option<&crate::egress::Egress>,
) -> Result<Box<dyn Stream>, String> {
    let tcp = match egress {
        None => TcpStream::connect((host, port))
            .await
            .map_err(|e| format!("connection failed: {e}"))?,
        Some(rules) => {
            let addrs = tokio::net::lookup_host((host, port))
                .await
                .map_err(|e| format!("resolving {host} failed: {e}"))?;
            let mut refused = None;
            let mut failed = None;
            let mut connected = None;
            for addr in addrs {
                if let Err(why) = rules.check(addr) {
                    refused.get_or_insert(why);
                    continue;
                }
                match TcpStream::connect(addr).await {
                    Ok(s) => {
                        connected = Some(s);
                        break;
                    }
                    Err(e) => {
                        failed = Some(format!("connection failed: {e}"));
                    }
                }
            }
            match (connected, failed, refused) {
                (Some(s), _, _) => s,
                (None, Some(e), _) => return Err(e),
                (None, None, Some(why)) => {
                    return Err(format!("refused by the push address rules: {why}"))
                }
                (None, None, None) => return Err(format!("{host} resolved to no address")),
            }
        }
    };
    let _ = tcp.set_nodelay(true);
    let Some(tls) = tls else {
        return Ok(Box::new(tcp));
    };
    let name = rustls::pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host} is not a TLS server name: {e}"))?;
    let stream = tls
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS handshake failed: {e}"))?;
    Ok(Box::new(stream))
}

/// Splits `host:port` (an IPv6 host in brackets) into the host without brackets and
/// the port; `None` when there is no valid port.
pub fn split_host_port(authority: &str) -> Option<(&str, u16)> {
    let (host, port) = authority.rsplit_once(':')?;
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return None;
    }
    let port = port.parse().ok()?;
    Some((host.trim_start_matches('[').trim_end_matches(']'), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_ports_split_with_ipv6_in_brackets() {
        assert_eq!(split_host_port("127.0.0.1:7070"), Some(("127.0.0.1", 7070)));
        assert_eq!(split_host_port("[::1]:9"), Some(("::1", 9)));
        assert_eq!(split_host_port("h:x"), None);
        assert_eq!(split_host_port("::1:9"), None);
        assert_eq!(split_host_port("h"), None);
    }

    #[test]
    fn a_ca_file_without_certificates_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ca.pem");
        std::fs::write(&f, "nothing").unwrap();
        let e = client_connector(Some(&f)).err().unwrap();
        assert!(
            e.contains("ca.pem") && e.contains("no CA certificate"),
            "{e}"
        );
    }
}
