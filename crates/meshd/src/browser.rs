//! Browser safety (http-api.md "Quotas and browser safety"): what keeps a web page
//! that a user of meshd's machine happens to open from driving meshd.
//!
//! A page can send "simple" cross-origin requests without asking (a POST with a
//! `text/plain` body and no custom header), and DNS rebinding makes a page's own
//! origin resolve to 127.0.0.1, so that it reads the answers too. Three rules close
//! that, checked by the gate (`crate::access::gate`) before admission:
//!
//! - **Content type**: a write with a body needs a JSON or CloudEvents content type
//!   (`application/json`, `*+json`), which a page can only send after a CORS
//!   preflight; a binary-mode publish (it carries `ce-specversion`, a header no simple
//!   request has) may carry any. 415 otherwise.
//! - **Origin**: a request whose `Origin` is neither the server's own origin nor one of
//!   `--allowed-origins` is 403; listed origins get CORS answers (preflights included).
//! - **Host**: while meshd listens on loopback without tokens (and without
//!   `--insecure-listen`), a `Host` that is not a loopback name or address (or one of
//!   `--allowed-hosts`) is 403: a rebinding page's requests carry its own host name.
//!
//! - **Fetch metadata**: a `/v1` request whose `Sec-Fetch-Site` is `cross-site` or
//!   `same-site` is 403 unless its `Origin` is listed: a no-cors `fetch` sends no
//!   `Origin`, but a browser always says where it comes from.
//!
//! Which rules a route answers to is its [`Scope`], set by the route table
//! (`crate::routes`): `/internal` routes are exempt (the gate checks the cluster
//! secret there). Requests without `Origin` (the CLI, curl, other servers) pass the
//! Origin rule.

use crate::problem::Problem;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};

/// How long a browser may cache a preflight answer (seconds).
const PREFLIGHT_MAX_AGE: &str = "600";
/// The answer headers a listed origin's scripts may read.
const EXPOSED_HEADERS: &str = "etag, retry-after, location, www-authenticate";
const ALLOWED_METHODS: &str = "GET, POST, PUT, DELETE";

pub struct BrowserRules {
    /// Normalised (`scheme://host[:port]`, lower case, no trailing `/`).
    allowed_origins: Vec<String>,
    /// `Some` while the Host check is on: the host names accepted besides loopback.
    host_check: Option<Vec<String>>,
    /// Our own origin's scheme.
    scheme: &'static str,
}

/// Why the rules refused a request (the label of `meshd_http_refused_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    Host,
    Origin,
    ContentType,
    /// `Sec-Fetch-Site: cross-site` or `same-site` without an allowed `Origin`.
    FetchSite,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Host => "host",
            Refusal::Origin => "origin",
            Refusal::ContentType => "content_type",
            Refusal::FetchSite => "fetch_site",
        }
    }
}

/// Which rules apply to a route (the route table says, per route).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Pages, probes and `/metrics`: Host, Origin and content type.
    Site,
    /// `/v1`: the site rules and Fetch Metadata.
    Api,
    /// The publish route: the `/v1` rules, and a binary-mode body may carry any
    /// content type.
    Publish,
}

/// What the rules decided for a request.
pub enum Verdict {
    /// Go on; `Some(origin)`: a listed cross-origin request, whose answer gets CORS
    /// headers.
    Pass(Option<HeaderValue>),
    /// Answer this now: a preflight of a listed origin.
    Answer(Response),
    Refuse(Refusal, Response),
}

impl BrowserRules {
    /// `host_check`: whether meshd listens on loopback without tokens and without
    /// `--insecure-listen`.
    pub fn new(
        allowed_origins: Vec<String>,
        allowed_hosts: Vec<String>,
        host_check: bool,
        tls: bool,
    ) -> Self {
        Self {
            allowed_origins,
            host_check: host_check.then_some(allowed_hosts),
            scheme: if tls { "https" } else { "http" },
        }
    }

    pub fn check(&self, scope: Scope, req: &Request) -> Verdict {
        let headers = req.headers();
        let host = request_host(req);
        if let (Some(extra), Some(host)) = (&self.host_check, host.as_deref()) {
            if !host_allowed(host, extra) {
                return Verdict::Refuse(
                    Refusal::Host,
                    Problem::forbidden(format!(
                        "Host {host:?} is not a loopback name: meshd listens on loopback without tokens and refuses other host names (DNS rebinding); add it to --allowed-hosts if it is yours"
                    ))
                    .into_response(),
                );
            }
        }
        let mut cors = None;
        if let Some(origin) = headers.get(header::ORIGIN) {
            let text = origin.to_str().unwrap_or("").trim_end_matches('/');
            let text = text.to_ascii_lowercase();
            let own = host
                .as_deref()
                .is_some_and(|h| text == format!("{}://{}", self.scheme, h.to_ascii_lowercase()));
            if !own {
                if !self.allowed_origins.contains(&text) {
                    return Verdict::Refuse(
                        Refusal::Origin,
                        Problem::forbidden(format!(
                            "requests from origin {text:?} are not allowed: list it in --allowed-origins"
                        ))
                        .into_response(),
                    );
                }
                if req.method() == Method::OPTIONS
                    && headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
                {
                    return Verdict::Answer(preflight(origin, headers));
                }
                cors = Some(origin.clone());
            }
        }
        if cors.is_none() {
            if let Some(site) = foreign_fetch_site(scope, req) {
                return Verdict::Refuse(
                    Refusal::FetchSite,
                    Problem::forbidden(format!(
                        "a browser sent this request from a page of another site (Sec-Fetch-Site: {site}) without an allowed Origin: list the page's origin in --allowed-origins"
                    ))
                    .into_response(),
                );
            }
        }
        if let Err(p) = content_type_allowed(scope, req) {
            return Verdict::Refuse(Refusal::ContentType, p.into_response());
        }
        Verdict::Pass(cors)
    }
}

/// The `Sec-Fetch-Site` of a `/v1` request a browser sent from a page of another
/// site (`cross-site`) or of a sibling (`same-site`): a no-cors `fetch` sends no
/// `Origin` but cannot hide this header, so a page elsewhere cannot open a stream
/// (which leases events) or read on a tokenless meshd. Other clients send no
/// `Sec-Fetch-Site`; the console's own requests are `same-origin`.
fn foreign_fetch_site(scope: Scope, req: &Request) -> Option<&str> {
    if scope == Scope::Site {
        return None;
    }
    let site = req.headers().get("sec-fetch-site")?.to_str().ok()?.trim();
    (site.eq_ignore_ascii_case("cross-site") || site.eq_ignore_ascii_case("same-site"))
        .then_some(site)
}

/// The CORS headers of an answer to a listed origin.
pub fn add_cors(answer: &mut Response, origin: HeaderValue) {
    let h = answer.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(EXPOSED_HEADERS),
    );
    h.append(header::VARY, HeaderValue::from_static("origin"));
}

fn preflight(origin: &HeaderValue, headers: &HeaderMap) -> Response {
    let mut answer = StatusCode::NO_CONTENT.into_response();
    add_cors(&mut answer, origin.clone());
    let h = answer.headers_mut();
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static(ALLOWED_METHODS),
    );
    // The headers the page asked for (the origin is trusted: it is listed).
    if let Some(asked) = headers.get(header::ACCESS_CONTROL_REQUEST_HEADERS) {
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
    }
    h.insert(
        header::ACCESS_CONTROL_MAX_AGE,
        HeaderValue::from_static(PREFLIGHT_MAX_AGE),
    );
    answer
}

/// The host a request names (`Host`, or the HTTP/2 `:authority`), without its port.
fn request_host(req: &Request) -> Option<String> {
    let authority = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_string()))?;
    Some(authority)
}

/// Whether `authority` (`host[:port]`) names a loopback host or one of `extra`.
fn host_allowed(authority: &str, extra: &[String]) -> bool {
    let authority = authority.trim().to_ascii_lowercase();
    let host = match meshd_client::split_host_port(&authority) {
        Some((h, _)) => h.to_string(),
        None => authority
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string(),
    };
    let host = host.trim_end_matches('.');
    if host == "localhost" || host.ends_with(".localhost") {
        return true;
    }
    if let Ok(ip) = host.parse::<std::net::IpAddr>() {
        if ip.is_loopback() {
            return true;
        }
    }
    extra
        .iter()
        .any(|e| e.trim_start_matches('[').trim_end_matches(']') == host)
}

/// A write with a body needs a JSON content type, except a binary-mode publish.
fn content_type_allowed(scope: Scope, req: &Request) -> Result<(), Problem> {
    if !matches!(
        *req.method(),
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    ) || !has_body(req)
    {
        return Ok(());
    }
    let headers = req.headers();
    let essence = crate::http::media_type(headers).unwrap_or_default();
    if crate::http::is_json(&essence) {
        return Ok(());
    }
    if scope == Scope::Publish && headers.contains_key("ce-specversion") {
        return Ok(());
    }
    Err(Problem::unsupported_media_type(if essence.is_empty() {
        "a request body needs a content type: application/json (or application/cloudevents+json, application/cloudevents-batch+json; a binary-mode publish with ce-specversion may carry any)".to_string()
    } else {
        format!("content type {essence:?} is not accepted for a request body: send application/json or a CloudEvents JSON type (a binary-mode publish with ce-specversion may carry any)")
    }))
}

/// Whether the request carries a body: a non-zero `Content-Length`, a chunked one, or
/// an HTTP/2 body without a length.
fn has_body(req: &Request) -> bool {
    let headers = req.headers();
    if let Some(len) = headers.get(header::CONTENT_LENGTH) {
        return len.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok()) != Some(0);
    }
    headers.contains_key(header::TRANSFER_ENCODING)
        || !axum::body::HttpBody::is_end_stream(req.body())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;

    fn req(method: &str, path: &str, headers: &[(&str, &str)], body: &'static str) -> Request {
        let mut b = Request::builder().method(method).uri(path);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        if !body.is_empty() {
            b = b.header("content-length", body.len().to_string());
        }
        b.body(Body::from(body)).unwrap()
    }

    fn refusal(v: Verdict) -> Option<Refusal> {
        match v {
            Verdict::Refuse(r, _) => Some(r),
            _ => None,
        }
    }

    #[test]
    fn loopback_hosts_pass_the_rebinding_check_and_others_do_not() {
        let extra = vec!["meshd.internal".to_string()];
        for ok in [
            "127.0.0.1:7070",
            "localhost:7070",
            "LOCALHOST",
            "app.localhost:1",
            "[::1]:7070",
            "127.1.2.3",
            "meshd.internal:7070",
        ] {
            assert!(host_allowed(ok, &extra), "{ok}");
        }
        for bad in [
            "evil.example:7070",
            "10.0.0.1:7070",
            "localhost.evil.example",
            "[::2]:1",
            "",
        ] {
            assert!(!host_allowed(bad, &extra), "{bad}");
        }
    }

    #[test]
    fn origins_are_own_listed_or_refused_and_listed_ones_get_cors_and_preflights() {
        let rules = BrowserRules::new(vec!["https://console.example".into()], vec![], true, false);
        let h = |o: &'static str| [("host", "127.0.0.1:7070"), ("origin", o)];
        assert!(matches!(
            rules.check(
                Scope::Api,
                &req("GET", "/v1/topics", &h("http://127.0.0.1:7070"), "")
            ),
            Verdict::Pass(None)
        ));
        assert!(matches!(
            rules.check(
                Scope::Api,
                &req("GET", "/v1/topics", &h("https://console.example"), "")
            ),
            Verdict::Pass(Some(_))
        ));
        assert_eq!(
            refusal(rules.check(
                Scope::Api,
                &req("GET", "/v1/topics", &h("http://evil.example"), "")
            )),
            Some(Refusal::Origin)
        );
        assert_eq!(
            refusal(rules.check(Scope::Api, &req("POST", "/v1/tasks", &h("null"), ""))),
            Some(Refusal::Origin)
        );
        let pre = req(
            "OPTIONS",
            "/v1/tasks",
            &[
                ("host", "127.0.0.1:7070"),
                ("origin", "https://console.example"),
                ("access-control-request-method", "POST"),
                (
                    "access-control-request-headers",
                    "authorization, content-type",
                ),
            ],
            "",
        );
        let Verdict::Answer(a) = rules.check(Scope::Api, &pre) else {
            panic!("no preflight answer")
        };
        assert_eq!(a.status(), StatusCode::NO_CONTENT);
        assert_eq!(
            a.headers()[header::ACCESS_CONTROL_ALLOW_ORIGIN],
            "https://console.example"
        );
        assert_eq!(
            a.headers()[header::ACCESS_CONTROL_ALLOW_HEADERS],
            "authorization, content-type"
        );
        // A rebinding page: its own origin and Host, both not loopback.
        let rebound = [
            ("host", "evil.example:7070"),
            ("origin", "http://evil.example:7070"),
        ];
        assert_eq!(
            refusal(rules.check(Scope::Api, &req("GET", "/v1/topics", &rebound, ""))),
            Some(Refusal::Host)
        );
        // Without the Host check (tokens or --insecure-listen) the same is own-origin.
        let open = BrowserRules::new(vec![], vec![], false, false);
        assert!(matches!(
            open.check(Scope::Api, &req("GET", "/v1/topics", &rebound, "")),
            Verdict::Pass(None)
        ));
    }

    #[test]
    fn writes_with_a_body_need_a_json_type_but_binary_publishes_and_bodiless_writes_do_not() {
        let rules = BrowserRules::new(vec![], vec![], false, false);
        let host = ("host", "127.0.0.1:7070");
        assert_eq!(
            refusal(rules.check(Scope::Api, &req("POST", "/v1/tasks", &[host], "{}"))),
            Some(Refusal::ContentType)
        );
        assert_eq!(
            refusal(rules.check(
                Scope::Api,
                &req(
                    "POST",
                    "/v1/tasks",
                    &[host, ("content-type", "text/plain")],
                    "{}"
                )
            )),
            Some(Refusal::ContentType)
        );
        for ok in [
            "application/json",
            "application/JSON; charset=utf-8",
            "application/cloudevents+json",
            "application/cloudevents-batch+json",
        ] {
            assert!(
                matches!(
                    rules.check(
                        Scope::Api,
                        &req("POST", "/v1/tasks", &[host, ("content-type", ok)], "{}")
                    ),
                    Verdict::Pass(_)
                ),
                "{ok}"
            );
        }
        let binary = [
            host,
            ("content-type", "text/plain"),
            ("ce-specversion", "1.0"),
        ];
        assert!(matches!(
            rules.check(
                Scope::Publish,
                &req("POST", "/v1/topics/t/events", &binary, "x")
            ),
            Verdict::Pass(_)
        ));
        assert_eq!(
            refusal(rules.check(Scope::Api, &req("POST", "/v1/tasks", &binary, "x"))),
            Some(Refusal::ContentType)
        );
        for bodiless in [
            "/v1/sessions/s/heartbeat",
            "/v1/tasks/t/cancel",
            "/v1/deadletters/d/redrive",
        ] {
            assert!(
                matches!(
                    rules.check(
                        Scope::Api,
                        &req("POST", bodiless, &[host, ("content-length", "0")], "")
                    ),
                    Verdict::Pass(_)
                ),
                "{bodiless}"
            );
        }
        assert!(matches!(
            rules.check(Scope::Api, &req("DELETE", "/v1/topics/t", &[host], "")),
            Verdict::Pass(_)
        ));
    }
}
