//! TLS for outgoing connections: rustls with the ring provider, trusting a CA file or
//! the system's bundle.

use std::path::Path;
use std::sync::Arc;
use tokio_rustls::TlsConnector;

/// Where Debian (and most Linux systems) keep the trusted CA bundle.
pub const SYSTEM_CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A TLS client trusting the CAs of `ca_file` (PEM), or the system's bundle. The error
/// says which file failed and why.
pub fn connector(ca_file: Option<&Path>) -> Result<TlsConnector, String> {
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

#[cfg(test)]
mod tests {
    #[test]
    fn a_ca_file_without_certificates_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ca.pem");
        std::fs::write(&f, "nothing").unwrap();
        let e = super::connector(Some(&f)).err().unwrap();
        assert!(
            e.contains("ca.pem") && e.contains("no CA certificate"),
            "{e}"
        );
    }
}
