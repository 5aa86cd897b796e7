//! A minimal keep-alive HTTP/1.1 client over one tokio `TcpStream`: enough for the
//! bench's requests to meshd (one request at a time per connection, bodies framed by
//! `Content-Length` or chunked). It exists so the load generator adds no client-library
//! overhead of its own and pulls in nothing heavy.

use anyhow::{anyhow, bail, Context, Result};
use std::net::SocketAddr;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

pub struct Conn {
    stream: BufReader<TcpStream>,
    host: String,
    head: Vec<u8>,
}

pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> Result<Self> {
        let s = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        s.set_nodelay(true)?;
        Ok(Self {
            stream: BufReader::with_capacity(64 * 1024, s),
            host: addr.to_string(),
            head: Vec::with_capacity(256),
        })
    }

    /// `POST` of a JSON body whose answer must be 200 with a JSON body (meshd's pull,
    /// ack): the parsed answer, or an error naming `what` and meshd's answer.
    pub async fn post_json(
        &mut self,
        path: &str,
        body: &[u8],
        what: &str,
    ) -> Result<serde_json::Value> {
        let r = self
            .request("POST", path, Some("application/json"), body)
            .await?;
        if r.status != 200 {
            bail!(
                "meshd answered {} to {what}: {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        serde_json::from_slice(&r.body).with_context(|| format!("the answer to {what}"))
    }

    pub async fn request(
        &mut self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Result<Response> {
        use std::io::Write;
        self.head.clear();
        write!(
            self.head,
            "{method} {path} HTTP/1.1\r\nHost: {}\r\n",
            self.host
        )?;
        if let Some(ct) = content_type {
            write!(self.head, "Content-Type: {ct}\r\n")?;
        }
        write!(self.head, "Content-Length: {}\r\n\r\n", body.len())?;
        let s = self.stream.get_mut();
        s.write_all(&self.head).await.context("sending a request")?;
        if !body.is_empty() {
            s.write_all(body).await.context("sending a request body")?;
        }
        self.read_response().await
    }

    async fn read_response(&mut self) -> Result<Response> {
        let mut line = String::new();
        if self.stream.read_line(&mut line).await? == 0 {
            bail!("connection closed before a response");
        }
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| anyhow!("malformed status line {line:?}"))?;
        let mut length: Option<usize> = None;
        let mut chunked = false;
        loop {
            line.clear();
            if self.stream.read_line(&mut line).await? == 0 {
                bail!("connection closed in the response head");
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some((name, value)) = l.split_once(':') {
                let value = value.trim();
                if name.eq_ignore_ascii_case("content-length") {
                    length = Some(value.parse().context("bad Content-Length")?);
                } else if name.eq_ignore_ascii_case("transfer-encoding")
                    && value.eq_ignore_ascii_case("chunked")
                {
                    chunked = true;
                }
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                line.clear();
                self.stream.read_line(&mut line).await?;
                let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
                    .with_context(|| format!("bad chunk size {line:?}"))?;
                let start = body.len();
                body.resize(start + size, 0);
                self.stream.read_exact(&mut body[start..]).await?;
                line.clear();
                self.stream.read_line(&mut line).await?; // CRLF after the chunk
                if size == 0 {
                    break;
                }
            }
        } else if let Some(n) = length {
            body.resize(n, 0);
            self.stream.read_exact(&mut body).await?;
        }
        Ok(Response { status, body })
    }
}
