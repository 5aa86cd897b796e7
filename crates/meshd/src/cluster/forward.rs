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
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
#[derive(Clone)]
pub struct Peers {
    pub secret: String,
    pub tls: Option<tokio_rustls::TlsConnector>,
}

impl Peers {
    /// POSTs `body` (JSON) to `path` on the peer at `addr` with the secret; returns
    /// the status and the body. One connection per call.
    pub async fn post(
        &self,
        addr: &str,
        path: &str,
        body: &[u8],
        timeout: Duration,
    ) -> Result<(u16, Vec<u8>), String> {
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
    ) -> Result<(u16, Vec<u8>), String> {
        let call = Call {
            addr,
            path,
            secret: &self.secret,
            tls: self.tls.as_ref(),
            max_answer,
        };
        post(call, body, timeout).await
    }
}

/// One call to a peer.
struct Call<'a> {
    addr: &'a str,
    path: &'a str,
    secret: &'a str,
    tls: Option<&'a tokio_rustls::TlsConnector>,
    max_answer: usize,
}

/// A connection to the peer at `addr` (`host:port`, its listen address).
async fn connect(
    addr: &str,
    tls: Option<&tokio_rustls::TlsConnector>,
) -> Result<Box<dyn crate::net::Stream>, String> {
    let (host, port) =
        crate::net::split_host_port(addr).ok_or_else(|| format!("{addr} is not host:port"))?;
    crate::net::connect(host, port, tls)
        .await
        .map_err(|e| format!("connecting to {addr}: {e}"))
}

async fn post(call: Call<'_>, body: &[u8], timeout: Duration) -> Result<(u16, Vec<u8>), String> {
    let Call {
        addr,
        path,
        secret,
        tls,
        max_answer,
    } = call;
    let exchange = async {
        let mut s = connect(addr, tls).await?;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{SECRET_HEADER}: {secret}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes())
            .await
            .map_err(|e| format!("sending to {addr}: {e}"))?;
        s.write_all(body)
            .await
            .map_err(|e| format!("sending to {addr}: {e}"))?;
        let mut answer = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = s
                .read(&mut buf)
                .await
                .map_err(|e| format!("reading from {addr}: {e}"))?;
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
            if answer.len() > max_answer {
                return Err(format!(
                    "the answer of {addr} is larger than {max_answer} bytes"
                ));
            }
        }
        parse_answer(&answer).ok_or_else(|| format!("{addr} did not answer HTTP"))
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(format!(
            "{addr} did not answer within {} ms",
            timeout.as_millis()
        )),
    }
}

/// Status and body of a complete HTTP/1.1 answer (`Connection: close`; a
/// `Content-Length` when present bounds the body, chunked bodies are decoded).
fn parse_answer(raw: &[u8]) -> Option<(u16, Vec<u8>)> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let mut length = None;
    let mut chunked = false;
    for l in lines {
        let (k, v) = l.split_once(':')?;
        if k.trim().eq_ignore_ascii_case("content-length") {
            length = v.trim().parse::<usize>().ok();
        }
        if k.trim().eq_ignore_ascii_case("transfer-encoding")
            && v.trim().eq_ignore_ascii_case("chunked")
        {
            chunked = true;
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked {
        let mut out = Vec::new();
        let mut r = rest;
        loop {
            let line_end = r.windows(2).position(|w| w == b"\r\n")?;
            let size =
                usize::from_str_radix(std::str::from_utf8(&r[..line_end]).ok()?.trim(), 16).ok()?;
            r = &r[line_end + 2..];
            if size == 0 {
                break;
            }
            out.extend_from_slice(r.get(..size)?);
            r = r.get(size + 2..)?;
        }
        out
    } else {
        match length {
            Some(n) => rest.get(..n)?.to_vec(),
            None => rest.to_vec(),
        }
    };
    Some((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_with_length_or_chunks() {
        let raw = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_answer(raw), Some((200, b"{}".to_vec())));
        let raw = b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n";
        assert_eq!(parse_answer(raw), Some((503, b"{}".to_vec())));
        assert_eq!(parse_answer(b"garbage"), None);
    }

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
