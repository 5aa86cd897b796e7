//! Calls between the instances of one cluster: a consumer on any instance gets the
//! events of every partition, and its acks reach their partition's owner.
//!
//! The internal routes (`/internal/v1/...`) serve only this instance's own partitions
//! and are authenticated by the cluster secret in the `meshd-cluster-secret` header
//! (compared in constant time, never logged): from `--cluster-secret-file` (its first
//! non-empty line), or else a random secret that the first instance writes to Meta
//! (`secrets/cluster`, put-if-absent) and every later one reads.

use meshd_meta::keys::{key, KeyKind};
use meshd_meta::{Meta, MetaError, Precondition};
use std::path::Path;
use std::time::Duration;

/// The header that carries the cluster secret.
pub const SECRET_HEADER: &str = "meshd-cluster-secret";

/// The largest answer read from a peer by default (a forwarded pull sets its own
/// bound from its byte budget).
const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// The shortest cluster secret meshd accepts (http-api.md "Quotas and browser safety"):
/// a short one could be guessed over the internal routes.
pub const MIN_SECRET_BYTES: usize = 32;

/// The secret from `file` (its first non-empty line), or Meta's (created when absent);
/// either must be at least [`MIN_SECRET_BYTES`] long.
pub async fn load_secret(file: Option<&Path>, meta: &dyn Meta) -> anyhow::Result<String> {
    let secret = read_secret(file, meta).await?;
    if secret.len() < MIN_SECRET_BYTES {
        let source = match file {
            Some(path) => format!("--cluster-secret-file {}", path.display()),
            None => "the cluster secret stored in Meta".to_string(),
        };
        anyhow::bail!(
            "{source}: the cluster secret is {} bytes, it must be at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)",
            secret.len()
        );
    }
    Ok(secret)
}

async fn read_secret(file: Option<&Path>, meta: &dyn Meta) -> anyhow::Result<String> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--cluster-secret-file {}: {e}", path.display()))?;
        let secret = text
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "--cluster-secret-file {}: the file is empty",
                    path.display()
                )
            })?;
        return Ok(secret.to_string());
    }
    let k = key(KeyKind::Secrets, &["cluster"]);
    let fresh: String = {
        use rand::RngCore;
        let mut bytes = [0u8; 32];
        rand::thread_rng().fill_bytes(&mut bytes);
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    };
    match meta
        .put(&k, fresh.as_bytes(), Precondition::Absent, None)
        .await
    {
        Ok(_) => Ok(fresh),
        Err(MetaError::Conflict { .. }) => {
            let got = meta.get(&k).await?;
            let kv = got
                .kv
                .ok_or_else(|| anyhow::anyhow!("the cluster secret vanished from Meta"))?;
            Ok(String::from_utf8(kv.value)
                .map_err(|_| anyhow::anyhow!("the cluster secret in Meta is not text"))?)
        }
        Err(e) => Err(anyhow::anyhow!("reading the cluster secret from Meta: {e}")),
    }
}

/// How this instance calls the others: with the cluster secret, and over TLS when
/// the instances serve HTTPS (`--tls-cert`), trusting `--cluster-ca-file` (or the
/// system's CAs). A peer is dialled at the address it advertises (its listen
/// address), so its certificate must name that IP address.
#[derive(Clone, Debug)]
pub struct Peers {
    transport: meshd_client::Transport,
    https: bool,
}

impl Peers {
    pub fn new(secret: &str, tls: Option<tokio_rustls::TlsConnector>) -> anyhow::Result<Self> {
        let mut transport = meshd_client::Transport::new()
            .with_header(SECRET_HEADER, secret)
            .map_err(|e| anyhow::anyhow!("the cluster secret: {e}"))?;
        let https = tls.is_some();
        if let Some(tls) = tls {
            transport = transport.with_tls(tls);
        }
        Ok(Self { transport, https })
    }

    /// POSTs `body` (JSON) to `path` on the peer at `addr` with the secret; returns
    /// the status and the body, or the client's error (which says whether the request
    /// may have reached the peer: [`meshd_client::Error::outcome_unknown`]). One
    /// connection per call.
    pub async fn post(
        &self,
        addr: &str,
        path: &str,
        body: &[u8],
        timeout: Duration,
    ) -> Result<(u16, Vec<u8>), meshd_client::Error> {
        self.post_limited(addr, path, body, timeout, MAX_ANSWER_BYTES)
            .await
    }

    /// [`Peers::post`] reading at most `max_answer` bytes of answer.
    pub async fn post_limited(
        &self,
        addr: &str,
        path: &str,
        body: &[u8],
        timeout: Duration,
        max_answer: usize,
    ) -> Result<(u16, Vec<u8>), meshd_client::Error> {
        let target = meshd_client::Target::peer(addr, self.https)?;
        let req = meshd_client::Request::post(path)
            .body("application/json", body.to_vec())
            .timeout(timeout)
            .max_answer(max_answer);
        let answer = self.transport.send(&target, req).await?;
        Ok((answer.status, answer.body.to_vec()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_secret_in_meta_is_everyones() {
        let dir = tempfile::tempdir().unwrap();
        let meta =
            meshd_meta_embedded::EmbeddedMeta::open_dir(dir.path(), Default::default()).unwrap();
        let a = load_secret(None, &meta).await.unwrap();
        let b = load_secret(None, &meta).await.unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 64);
        let f = dir.path().join("secret");
        let long = "from-file-0123456789abcdef0123456789";
        std::fs::write(&f, format!("\n  {long} \nother\n")).unwrap();
        assert_eq!(load_secret(Some(&f), &meta).await.unwrap(), long);
        std::fs::write(&f, "short-secret\n").unwrap();
        let e = load_secret(Some(&f), &meta).await.unwrap_err().to_string();
        assert!(e.contains("at least 32"), "{e}");
    }
}
