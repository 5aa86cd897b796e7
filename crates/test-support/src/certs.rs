//! Throwaway certificates for TLS tests: a CA, a server certificate for `127.0.0.1`
//! and `localhost` and a client certificate, both signed by the CA, written as PEM
//! files into a directory the test owns. etcd, nats-server and meshd's own HTTPS
//! listener all take these files, so one [`TestCerts`] serves every TLS test.
//!
//! Keys are ECDSA P-256 in PKCS#8 PEM (`-----BEGIN PRIVATE KEY-----`), which Go
//! (etcd, nats-server) and rustls both read. Nothing here is secret: the keys live
//! as long as the test's temp directory.

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use std::path::{Path, PathBuf};

/// The common name of the client certificate. etcd (with `--client-cert-auth`)
/// would take it as the user name of a request that carries no token, so it is
/// deliberately not an etcd user.
pub const CLIENT_COMMON_NAME: &str = "meshd-test-client";

/// The PEM files of one throwaway PKI, all in `dir`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestCerts {
    /// The directory holding every file below.
    pub dir: PathBuf,
    /// `ca.pem`: the self-signed CA that signed both certificates.
    pub ca: PathBuf,
    /// `server.pem`: for `127.0.0.1` (IP SAN) and `localhost` (DNS SAN); usable for
    /// server and client authentication (etcd's gateway dials itself with it).
    pub server_cert: PathBuf,
    /// `server-key.pem`.
    pub server_key: PathBuf,
    /// `client.pem`: client authentication, common name [`CLIENT_COMMON_NAME`].
    pub client_cert: PathBuf,
    /// `client-key.pem`.
    pub client_key: PathBuf,
}

impl TestCerts {
    /// Generates a fresh CA, server and client certificate and writes them into `dir`
    /// (created if missing), overwriting earlier files of the same names.
    pub fn generate(dir: &Path) -> anyhow::Result<TestCerts> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;

        let ca_key = KeyPair::generate().context("generating the CA key")?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "meshd test CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = ca_params
            .self_signed(&ca_key)
            .context("self-signing the CA")?;

        // `CertificateParams::new` turns "127.0.0.1" into an IP SAN, "localhost" into
        // a DNS SAN.
        let server_key = KeyPair::generate().context("generating the server key")?;
        let mut server_params =
            CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])?;
        server_params
            .distinguished_name
            .push(DnType::CommonName, "meshd test server");
        server_params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        server_params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let server = server_params
            .signed_by(&server_key, &ca, &ca_key)
            .context("signing the server certificate")?;

        let client_key = KeyPair::generate().context("generating the client key")?;
        let mut client_params = CertificateParams::new(Vec::<String>::new())?;
        client_params
            .distinguished_name
            .push(DnType::CommonName, CLIENT_COMMON_NAME);
        client_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        client_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client = client_params
            .signed_by(&client_key, &ca, &ca_key)
            .context("signing the client certificate")?;

        let certs = TestCerts {
            dir: dir.to_path_buf(),
            ca: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server-key.pem"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client-key.pem"),
        };
        for (path, pem) in [
            (&certs.ca, ca.pem()),
            (&certs.server_cert, server.pem()),
            (&certs.server_key, server_key.serialize_pem()),
            (&certs.client_cert, client.pem()),
            (&certs.client_key, client_key.serialize_pem()),
        ] {
            std::fs::write(path, pem).with_context(|| format!("writing {}", path.display()))?;
        }
        Ok(certs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_every_file_as_pem() {
        let dir = tempfile::tempdir().expect("temp dir");
        let certs = TestCerts::generate(&dir.path().join("pki")).expect("generate");
        for (path, header) in [
            (&certs.ca, "-----BEGIN CERTIFICATE-----"),
            (&certs.server_cert, "-----BEGIN CERTIFICATE-----"),
            (&certs.server_key, "-----BEGIN PRIVATE KEY-----"),
            (&certs.client_cert, "-----BEGIN CERTIFICATE-----"),
            (&certs.client_key, "-----BEGIN PRIVATE KEY-----"),
        ] {
            let text = std::fs::read_to_string(path).expect("readable");
            assert!(text.starts_with(header), "{}: {text}", path.display());
            assert!(path.starts_with(&certs.dir));
        }
    }
}
