//! Bearer-token access to the `/v1` routes (http-api.md "Access").
//!
//! With `--client-token-file` and/or `--admin-token-file`, every `/v1` route needs
//! `Authorization: Bearer <token>`. The client token may publish, pull, ack, nack,
//! extend, work with sessions and tasks; the admin token may do everything. Missing or
//! wrong: 401; a client token on an admin route: 403. Tokens are compared in constant
//! time (every configured token is compared, whatever matches) and never logged.
//! `/healthz`, `/readyz` and `/metrics` stay open; `/internal` routes authenticate with
//! the cluster secret instead.

use crate::problem::Problem;
use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Client,
    Admin,
}

/// The configured tokens (one file may hold several, for rotation).
pub struct Tokens {
    client: Vec<Vec<u8>>,
    admin: Vec<Vec<u8>>,
}

#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("cannot read the token file {path}: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    #[error("the token file {path} holds no token (one per line; blank lines are ignored)")]
    Empty { path: PathBuf },
}

/// One token per line, whitespace trimmed, blank lines ignored.
fn read_tokens(path: &Path) -> Result<Vec<Vec<u8>>, AccessError> {
    let text = std::fs::read_to_string(path).map_err(|e| AccessError::Unreadable {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let tokens: Vec<Vec<u8>> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(|l| l.as_bytes().to_vec())
        .collect();
    if tokens.is_empty() {
        return Err(AccessError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(tokens)
}

impl Tokens {
    /// `None` when no token file is configured (access is open: loopback only unless
    /// `--insecure-listen`).
    pub fn load(client: Option<&Path>, admin: Option<&Path>) -> Result<Option<Self>, AccessError> {
        if client.is_none() && admin.is_none() {
            return Ok(None);
        }
        Ok(Some(Self {
            client: client.map(read_tokens).transpose()?.unwrap_or_default(),
            admin: admin.map(read_tokens).transpose()?.unwrap_or_default(),
        }))
    }

    /// The role of a presented token; every configured token is compared in full.
    pub fn role_of(&self, presented: &[u8]) -> Option<Role> {
        let mut admin = false;
        let mut client = false;
        for t in &self.admin {
            admin |= ct_eq(t, presented);
        }
        for t in &self.client {
            client |= ct_eq(t, presented);
        }
        if admin {
            Some(Role::Admin)
        } else if client {
            Some(Role::Client)
        } else {
            None
        }
    }
}

/// Constant-time equality: the time depends on the lengths only, never on where the
/// bytes differ.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() != b.len()) as u8;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// The role a request needs; `None`: open (not a `/v1` route).
pub fn required(method: &Method, path: &str) -> Option<Role> {
    let rest = path.strip_prefix("/v1/")?;
    let parts: Vec<&str> = rest.split('/').collect();
    let client = match parts.as_slice() {
        ["sessions", ..] | ["tasks", ..] => true,
        ["topics", _, "events"] => method == Method::POST,
        ["subscriptions", _, "pull" | "ack" | "nack" | "extend"] => method == Method::POST,
        _ => false,
    };
    Some(if client { Role::Client } else { Role::Admin })
}

fn bearer(req: &Request) -> Option<&[u8]> {
    let v = req.headers().get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = v.split_at(v.iter().position(|b| *b == b' ')?);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| token.trim_ascii())
}

/// The tokens in force: read from their files at start-up and again on every
/// [`reload`](Access::reload) (SIGHUP), replaced whole, so a rotation needs no
/// restart. A reload that fails keeps the tokens in force.
pub struct Access {
    client_file: Option<PathBuf>,
    admin_file: Option<PathBuf>,
    current: std::sync::RwLock<Arc<Tokens>>,
}

impl Access {
    /// `None` without token files (see [`Tokens::load`]).
    pub fn load(client: Option<&Path>, admin: Option<&Path>) -> Result<Option<Self>, AccessError> {
        Ok(Tokens::load(client, admin)?.map(|tokens| Self {
            client_file: client.map(Path::to_path_buf),
            admin_file: admin.map(Path::to_path_buf),
            current: std::sync::RwLock::new(Arc::new(tokens)),
        }))
    }

    /// Reads the token files again; on success the new tokens replace the old ones at
    /// once (requests in progress finish with the old).
    pub fn reload(&self) -> Result<(), AccessError> {
        let fresh = Tokens::load(self.client_file.as_deref(), self.admin_file.as_deref())?;
        if let Some(fresh) = fresh {
            let mut current = self
                .current
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            *current = Arc::new(fresh);
        }
        Ok(())
    }

    fn tokens(&self) -> Arc<Tokens> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// The middleware: 401 / 403 before the handler, never naming the token.
pub async fn check(State(access): State<Arc<Access>>, req: Request, next: Next) -> Response {
    let Some(need) = required(req.method(), req.uri().path()) else {
        return next.run(req).await;
    };
    let tokens = access.tokens();
    let role = bearer(&req).and_then(|t| tokens.role_of(t));
    match (need, role) {
        (_, Some(Role::Admin)) | (Role::Client, Some(Role::Client)) => next.run(req).await,
        (Role::Admin, Some(Role::Client)) => Problem::forbidden(
            "this route needs the admin token; the client token may publish, pull, ack, nack, extend, and use sessions and tasks",
        )
        .into_response(),
        (_, None) => {
            let mut r = Problem::unauthorized(
                "missing or wrong bearer token: send Authorization: Bearer <token>",
            )
            .into_response();
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            r
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_equality_is_equality() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
        assert!(!ct_eq(b"", b"a"));
        assert!(ct_eq(b"", b""));
    }

    #[test]
    fn routes_need_the_documented_role() {
        let p = Method::POST;
        let g = Method::GET;
        assert_eq!(required(&g, "/healthz"), None);
        assert_eq!(required(&g, "/metrics"), None);
        assert_eq!(required(&p, "/internal/v1/subscriptions/s/pull"), None);
        assert_eq!(required(&p, "/v1/topics/t/events"), Some(Role::Client));
        assert_eq!(required(&g, "/v1/topics/t/events"), Some(Role::Admin));
        assert_eq!(required(&Method::PUT, "/v1/topics/t"), Some(Role::Admin));
        for op in ["pull", "ack", "nack", "extend"] {
            assert_eq!(
                required(&p, &format!("/v1/subscriptions/s/{op}")),
                Some(Role::Client)
            );
        }
        assert_eq!(
            required(&Method::PUT, "/v1/subscriptions/s/offsets/0"),
            Some(Role::Admin)
        );
        assert_eq!(required(&p, "/v1/sessions"), Some(Role::Client));
        assert_eq!(required(&p, "/v1/tasks/x/claim"), Some(Role::Client));
        assert_eq!(required(&p, "/v1/deadletters/x/redrive"), Some(Role::Admin));
        assert_eq!(required(&g, "/v1/cluster"), Some(Role::Admin));
    }

    #[test]
    fn every_line_of_a_token_file_is_a_token_and_admin_wins() {
        let dir = tempfile::tempdir().unwrap();
        let c = dir.path().join("client");
        let a = dir.path().join("admin");
        std::fs::write(&c, "  old-client \n\nnew-client\n").unwrap();
        std::fs::write(&a, "root\n").unwrap();
        let t = Tokens::load(Some(&c), Some(&a)).unwrap().unwrap();
        assert_eq!(t.role_of(b"old-client"), Some(Role::Client));
        assert_eq!(t.role_of(b"new-client"), Some(Role::Client));
        assert_eq!(t.role_of(b"root"), Some(Role::Admin));
        assert_eq!(t.role_of(b"nope"), None);
        assert_eq!(t.role_of(b""), None);
        std::fs::write(&c, "\n \n").unwrap();
        assert!(matches!(
            Tokens::load(Some(&c), None),
            Err(AccessError::Empty { .. })
        ));
        assert!(Tokens::load(None, None).unwrap().is_none());
    }
}
