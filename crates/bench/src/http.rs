//! The bench's connections to meshd: [`meshd_client`]'s keep-alive connection (one
//! request at a time), so the load generator measures meshd through the same client as
//! everything else.

use anyhow::{bail, Context, Result};
use meshd_client::{Method, Request};
use std::net::SocketAddr;

pub struct Conn {
    conn: meshd_client::transport::Connection,
}

pub struct Response {
    pub status: u16,
    pub body: bytes::Bytes,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> Result<Self> {
        let target = meshd_client::Target::peer(&addr.to_string(), false)?;
        let conn = meshd_client::Transport::new()
            .open(&target)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        Ok(Self { conn })
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
        let method = Method::from_bytes(method.as_bytes())?;
        let req = Request::new(method, path);
        let req = match content_type {
            Some(ct) => req.body(ct, body.to_vec()),
            None => req.raw_body(body.to_vec()),
        };
        let a = self.conn.send(req).await?;
        Ok(Response {
            status: a.status,
            body: a.body,
        })
    }
}
