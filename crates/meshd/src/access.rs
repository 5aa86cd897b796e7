//! Who may use a route (http-api.md "Access", "Quotas and browser safety"): the route
//! table (`crate::routes`) names each route's [`Caller`], and the [`gate`] middleware
//! of that route's group checks it before anything else of the route runs, so a
//! request it refuses never holds a request slot or body memory (`crate::admission`
//! runs inside it) and its body is never read.
//!
//! - `/v1`: with `--client-token-file` and/or `--admin-token-file`, every route needs
//!   `Authorization: Bearer <token>`. The client token may publish, pull, ack, nack,
//!   extend, work with sessions and tasks; the admin token may do everything. Missing
//!   or wrong: 401; a client token on an admin route: 403. Tokens are compared in
//!   constant time (every configured token is compared, whatever matches) and never
//!   logged.
//! - `/internal`: the cluster secret in the `meshd-cluster-secret` header, compared in
//!   constant time (401 otherwise); outside cluster mode every `/internal` path is 404.
//! - `/metrics`: with `--metrics-token-file`, a metrics token (or an admin token);
//!   `/healthz` and `/readyz` stay open.
//! - Browser safety (`crate::browser`): Host, Origin and content type, on every route
//!   but `/internal`.

use crate::browser::{add_cors, BrowserRules, Refusal, Scope, Verdict};
use crate::problem::Problem;
use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use meshd_runtime::cluster::forward::SECRET_HEADER;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What a route needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Client,
    Admin,
    /// `/metrics` with `--metrics-token-file` (an admin token may read it too).
    Metrics,
}

/// Who may call a route, as the route table says: which token it needs (when tokens
/// are configured) and which browser rules apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Caller {
    /// Anyone: the probes and the console's pages (browser rules of a site).
    Anyone,
    /// `/metrics`: a metrics or admin token with `--metrics-token-file`.
    Metrics,
    /// A client (or admin) token: consuming, sessions and tasks.
    Client,
    /// A client token, on the route that takes binary-mode CloudEvents (any content
    /// type with `ce-specversion`).
    Publisher,
    /// A client token, which a WebSocket upgrade may send in its first frame instead
    /// of a header (browsers cannot set `Authorization` on a WebSocket).
    Streamer,
    /// The admin token: topics, subscription settings, offsets, dead letters, cluster.
    Admin,
    /// Another member of the cluster: the cluster secret; no browser rules.
    Member,
}

impl Caller {
    /// The token role the caller needs when tokens guard its routes.
    pub fn role(self) -> Option<Role> {
        match self {
            Caller::Anyone | Caller::Member => None,
            Caller::Metrics => Some(Role::Metrics),
            Caller::Client | Caller::Publisher | Caller::Streamer => Some(Role::Client),
            Caller::Admin => Some(Role::Admin),
        }
    }

    /// The browser rules of the caller's routes; `None`: exempt (`/internal`).
    pub fn scope(self) -> Option<Scope> {
        match self {
            Caller::Anyone | Caller::Metrics => Some(Scope::Site),
            Caller::Client | Caller::Streamer | Caller::Admin => Some(Scope::Api),
            Caller::Publisher => Some(Scope::Publish),
            Caller::Member => None,
        }
    }

    /// Whether the caller's requests go through admission (request slots, body
    /// memory): every API route, `/v1` and `/internal`; never the probes.
    pub fn admitted(self) -> bool {
        !matches!(self, Caller::Anyone | Caller::Metrics)
    }
}

/// The roles a presented token holds (a token may be in several files).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Roles {
    pub client: bool,
    pub admin: bool,
    pub metrics: bool,
}

impl Roles {
    fn any(self) -> bool {
        self.client || self.admin || self.metrics
    }

    /// Whether these roles may use a route that needs `need`.
    pub fn may(self, need: Role) -> bool {
        self.admin
            || match need {
                Role::Client => self.client,
                Role::Metrics => self.metrics,
                Role::Admin => false,
            }
    }
}

/// The configured tokens (one file may hold several, for rotation).
pub struct Tokens {
    client: Vec<Vec<u8>>,
    admin: Vec<Vec<u8>>,
    metrics: Vec<Vec<u8>>,
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
    pub fn load(files: &TokenFiles) -> Result<Option<Self>, AccessError> {
        if files.client.is_none() && files.admin.is_none() && files.metrics.is_none() {
            return Ok(None);
        }
        let read = |f: &Option<PathBuf>| -> Result<Vec<Vec<u8>>, AccessError> {
            Ok(f.as_deref()
                .map(read_tokens)
                .transpose()?
                .unwrap_or_default())
        };
        Ok(Some(Self {
            client: read(&files.client)?,
            admin: read(&files.admin)?,
            metrics: read(&files.metrics)?,
        }))
    }

    /// The roles of a presented token; every configured token is compared in full.
    pub fn roles_of(&self, presented: &[u8]) -> Roles {
        let any = |tokens: &[Vec<u8>]| {
            let mut hit = false;
            for t in tokens {
                hit |= ct_eq(t, presented);
            }
            hit
        };
        Roles {
            client: any(&self.client),
            admin: any(&self.admin),
            metrics: any(&self.metrics),
        }
    }

    /// Whether `/v1` needs tokens (a client or an admin token file is configured;
    /// a file is never empty, so its tokens say so).
    pub fn guard_v1(&self) -> bool {
        !self.client.is_empty() || !self.admin.is_empty()
    }

    /// Whether `/metrics` needs a token.
    pub fn guard_metrics(&self) -> bool {
        !self.metrics.is_empty()
    }
}

/// The token files of each role.
#[derive(Clone, Debug, Default)]
pub struct TokenFiles {
    pub client: Option<PathBuf>,
    pub admin: Option<PathBuf>,
    pub metrics: Option<PathBuf>,
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
    files: TokenFiles,
    current: std::sync::RwLock<Arc<Tokens>>,
}

impl Access {
    /// `None` without token files (see [`Tokens::load`]).
    pub fn load(files: TokenFiles) -> Result<Option<Self>, AccessError> {
        Ok(Tokens::load(&files)?.map(|tokens| Self {
            files,
            current: std::sync::RwLock::new(Arc::new(tokens)),
        }))
    }

    /// Reads the token files again; on success the new tokens replace the old ones at
    /// once (requests in progress finish with the old).
    pub fn reload(&self) -> Result<(), AccessError> {
        if let Some(fresh) = Tokens::load(&self.files)? {
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

/// What the gate knows: the tokens (none: `/v1` is open) and, in cluster mode, the
/// secret of the internal routes.
pub struct Gate {
    access: Option<Arc<Access>>,
    cluster_secret: Option<String>,
    browser: BrowserRules,
    refused: Refused,
}

/// Requests the gate refused, by reason (`meshd_http_refused_total`).
#[derive(Default)]
struct Refused {
    unauthorized: AtomicU64,
    forbidden: AtomicU64,
    internal_unauthorized: AtomicU64,
    internal_not_cluster: AtomicU64,
    host: AtomicU64,
    origin: AtomicU64,
    content_type: AtomicU64,
    fetch_site: AtomicU64,
}

impl Gate {
    pub fn new(
        access: Option<Arc<Access>>,
        cluster_secret: Option<String>,
        browser: BrowserRules,
    ) -> Self {
        Self {
            access,
            cluster_secret,
            browser,
            refused: Refused::default(),
        }
    }

    /// What to do with a request: go on (with the CORS origin of a listed
    /// cross-origin request), or answer now (a refusal or a preflight).
    fn decide(&self, caller: Caller, req: &Request) -> Verdict {
        let Some(scope) = caller.scope() else {
            return match self.internal(req) {
                Some(refused) => Verdict::Answer(refused),
                None => Verdict::Pass(None),
            };
        };
        let cors = match self.browser.check(scope, req) {
            Verdict::Pass(cors) => cors,
            Verdict::Answer(answer) => return Verdict::Answer(answer),
            Verdict::Refuse(why, answer) => {
                let counter = match why {
                    Refusal::Host => &self.refused.host,
                    Refusal::Origin => &self.refused.origin,
                    Refusal::ContentType => &self.refused.content_type,
                    Refusal::FetchSite => &self.refused.fetch_site,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                return Verdict::Answer(answer);
            }
        };
        match self.tokens(caller, req) {
            Some(refused) => Verdict::Answer(refused),
            None => Verdict::Pass(cors),
        }
    }

    /// Whether `req`, to a stream route, is a WebSocket upgrade without
    /// `Authorization` that must authenticate with its first frame instead (browsers
    /// cannot send the header on a WebSocket; http-api.md "Streaming consume").
    fn defers_to_first_frame(&self, req: &Request) -> bool {
        let Some(access) = &self.access else {
            return false;
        };
        let upgrade = req
            .headers()
            .get(header::UPGRADE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
        access.tokens().guard_v1()
            && req.method() == Method::GET
            && upgrade
            && !req.headers().contains_key(header::AUTHORIZATION)
    }

    /// A WebSocket's first-frame token: who it is, when it may stream (the client
    /// role); a wrong token counts as an unauthorized refusal.
    pub fn first_frame_token(&self, token: &str) -> Option<StreamToken> {
        let token = token.trim().as_bytes();
        let ok = self
            .access
            .as_ref()
            .is_some_and(|a| a.tokens().roles_of(token).may(Role::Client));
        if !ok {
            self.refused.unauthorized.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(StreamToken::of(token))
    }

    /// Who a stream that passed the gate with its `Authorization` header is: `None`
    /// when `/v1` needs no token (nothing to tell clients apart by).
    fn stream_token(&self, req: &Request) -> Option<StreamToken> {
        if !self.access.as_ref()?.tokens().guard_v1() {
            return None;
        }
        bearer(req).map(StreamToken::of)
    }

    /// The token check of `/v1` and `/metrics`; `None` when the request may go on.
    fn tokens(&self, caller: Caller, req: &Request) -> Option<Response> {
        if req.extensions().get::<FirstFrameAuth>().is_some() {
            // Marked by `gate`: the stream checks the token of its first frame.
            return None;
        }
        let tokens = self.access.as_ref()?.tokens();
        let need = caller.role()?;
        let guarded = match need {
            Role::Metrics => tokens.guard_metrics(),
            Role::Client | Role::Admin => tokens.guard_v1(),
        };
        if !guarded {
            return None;
        }
        let roles = bearer(req).map(|t| tokens.roles_of(t)).unwrap_or_default();
        if roles.may(need) {
            return None;
        }
        if roles.any() {
            self.refused.forbidden.fetch_add(1, Ordering::Relaxed);
            return Some(
                Problem::forbidden(match need {
                    Role::Metrics => "/metrics needs a metrics or admin token",
                    _ => "this route needs the admin token; the client token may publish, pull, ack, nack, extend, and use sessions and tasks",
                })
                .into_response(),
            );
        }
        self.refused.unauthorized.fetch_add(1, Ordering::Relaxed);
        let mut r = Problem::unauthorized(
            "missing or wrong bearer token: send Authorization: Bearer <token>",
        )
        .into_response();
        r.headers_mut().insert(
            header::WWW_AUTHENTICATE,
            header::HeaderValue::from_static("Bearer"),
        );
        Some(r)
    }

    /// An `/internal` route: 404 outside cluster mode, 401 without the secret.
    fn internal(&self, req: &Request) -> Option<Response> {
        let Some(secret) = &self.cluster_secret else {
            self.refused
                .internal_not_cluster
                .fetch_add(1, Ordering::Relaxed);
            return Some(Problem::not_found("no such route (not in cluster mode)").into_response());
        };
        let given = req
            .headers()
            .get(SECRET_HEADER)
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if ct_eq(secret.as_bytes(), given) {
            return None;
        }
        self.refused
            .internal_unauthorized
            .fetch_add(1, Ordering::Relaxed);
        Some(Problem::unauthorized("an internal route needs the cluster secret").into_response())
    }

    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(out, "# HELP meshd_http_refused_total Requests refused before admission (no request slot, no body read), by reason.\n# TYPE meshd_http_refused_total counter");
        let r = &self.refused;
        for (reason, n) in [
            ("unauthorized", &r.unauthorized),
            ("forbidden", &r.forbidden),
            ("internal_unauthorized", &r.internal_unauthorized),
            ("internal_not_cluster", &r.internal_not_cluster),
            (Refusal::Host.label(), &r.host),
            (Refusal::Origin.label(), &r.origin),
            (Refusal::ContentType.label(), &r.content_type),
            (Refusal::FetchSite.label(), &r.fetch_site),
        ] {
            let _ = writeln!(
                out,
                "meshd_http_refused_total{{reason=\"{reason}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
    }
}

/// Set on a WebSocket stream upgrade that must authenticate with its first frame.
#[derive(Clone)]
pub struct FirstFrameAuth(pub Arc<Gate>);

/// Which client token opened a stream, for `--max-streams-per-token`: a SHA-256 of
/// the token, so the token itself is not kept beside the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamToken([u8; 32]);

impl StreamToken {
    fn of(token: &[u8]) -> Self {
        use sha2::Digest;
        Self(sha2::Sha256::digest(token).into())
    }
}

/// The middleware of a group of routes with the same [`Caller`] (see the module
/// docs): refusals are answered here, before admission, never naming a token or the
/// secret.
pub async fn gate(
    State((gate, caller)): State<(Arc<Gate>, Caller)>,
    mut req: Request,
    next: Next,
) -> Response {
    let stream = caller == Caller::Streamer;
    if stream && gate.defers_to_first_frame(&req) {
        req.extensions_mut().insert(FirstFrameAuth(gate.clone()));
    }
    match gate.decide(caller, &req) {
        Verdict::Refuse(_, answer) | Verdict::Answer(answer) => answer,
        Verdict::Pass(cors) => {
            if let Some(token) = stream.then(|| gate.stream_token(&req)).flatten() {
                req.extensions_mut().insert(token);
            }
            let Some(origin) = cors else {
                return next.run(req).await;
            };
            let mut answer = next.run(req).await;
            add_cors(&mut answer, origin);
            answer
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
    fn callers_need_their_role_and_browser_rules() {
        assert_eq!(Caller::Anyone.role(), None);
        assert_eq!(Caller::Member.role(), None);
        assert_eq!(Caller::Member.scope(), None);
        assert_eq!(Caller::Metrics.role(), Some(Role::Metrics));
        for c in [Caller::Client, Caller::Publisher, Caller::Streamer] {
            assert_eq!(c.role(), Some(Role::Client), "{c:?}");
            assert!(c.admitted(), "{c:?}");
        }
        assert_eq!(Caller::Admin.role(), Some(Role::Admin));
        assert_eq!(Caller::Publisher.scope(), Some(Scope::Publish));
        assert_eq!(Caller::Admin.scope(), Some(Scope::Api));
        assert_eq!(Caller::Metrics.scope(), Some(Scope::Site));
        assert!(!Caller::Anyone.admitted() && !Caller::Metrics.admitted());
        assert!(Caller::Member.admitted());
    }

    #[test]
    fn every_line_of_a_token_file_is_a_token_and_admin_wins() {
        let dir = tempfile::tempdir().unwrap();
        let c = dir.path().join("client");
        let a = dir.path().join("admin");
        std::fs::write(&c, "  old-client \n\nnew-client\n").unwrap();
        std::fs::write(&a, "root\n").unwrap();
        let m = dir.path().join("metrics");
        std::fs::write(&m, "scraper\n").unwrap();
        let files = TokenFiles {
            client: Some(c.clone()),
            admin: Some(a),
            metrics: Some(m.clone()),
        };
        let t = Tokens::load(&files).unwrap().unwrap();
        let client = Roles {
            client: true,
            ..Roles::default()
        };
        assert_eq!(t.roles_of(b"old-client"), client);
        assert_eq!(t.roles_of(b"new-client"), client);
        assert!(t.roles_of(b"root").may(Role::Admin));
        assert!(t.roles_of(b"root").may(Role::Metrics));
        assert!(t.roles_of(b"scraper").may(Role::Metrics));
        assert!(!t.roles_of(b"scraper").may(Role::Client));
        assert!(!t.roles_of(b"old-client").may(Role::Metrics));
        assert_eq!(t.roles_of(b"nope"), Roles::default());
        assert_eq!(t.roles_of(b""), Roles::default());
        assert!(t.guard_v1() && t.guard_metrics());
        // A metrics token file alone guards /metrics, not /v1.
        let only_metrics = TokenFiles {
            metrics: Some(m),
            ..TokenFiles::default()
        };
        let t = Tokens::load(&only_metrics).unwrap().unwrap();
        assert!(!t.guard_v1() && t.guard_metrics());
        std::fs::write(&c, "\n \n").unwrap();
        let only_client = TokenFiles {
            client: Some(c),
            ..TokenFiles::default()
        };
        assert!(matches!(
            Tokens::load(&only_client),
            Err(AccessError::Empty { .. })
        ));
        assert!(Tokens::load(&TokenFiles::default()).unwrap().is_none());
    }
}
