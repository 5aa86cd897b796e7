//! HTTP request metrics (issue 26): `meshd_http_requests_total{route,method,status}`
//! and `meshd_http_request_duration_seconds{route}`, labelled by the route *template*
//! (`/v1/subscriptions/{name}/pull`), never by the raw path, so a label's values are
//! bounded by the routes meshd has, whatever names clients use.
//!
//! Two layers work together. The outer one ([`record`], outermost of the stack) times
//! every request and counts it with its answer, including those the gate or admission
//! refused before any route was chosen; the inner one ([`note_route`], a route layer,
//! so it runs only once a route matched) writes the matched template into a slot the
//! outer one put in the request. A request no route matched, or one refused before
//! routing, is counted under `route="none"`. Durations run until the response head is
//! ready (a stream's or long poll's body may go on after it).

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use meshd_runtime::metrics::Histogram;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// The route label of a request no route matched (or refused before routing).
pub const NO_ROUTE: &str = "none";

/// Upper bounds of the duration histogram's buckets, in seconds (`+Inf` besides).
const BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 30.0,
];

/// Methods counted by name; any other is counted as `other` (the label stays bounded).
const METHODS: [&str; 7] = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];

#[derive(Default)]
struct Inner {
    requests: BTreeMap<(String, &'static str, u16), u64>,
    durations: BTreeMap<String, Histogram>,
}

/// The counters; rendered on `/metrics`.
#[derive(Default)]
pub struct HttpMetrics {
    inner: Mutex<Inner>,
}

impl HttpMetrics {
    /// One answered request.
    pub fn record(&self, route: &str, method: &str, status: u16, took: Duration) {
        let method = METHODS
            .iter()
            .find(|m| m.eq_ignore_ascii_case(method))
            .copied()
            .unwrap_or("other");
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        *inner
            .requests
            .entry((route.to_string(), method, status))
            .or_default() += 1;
        inner
            .durations
            .entry(route.to_string())
            .or_insert_with(|| Histogram::new(&BUCKETS))
            .observe(took);
    }

    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = writeln!(out, "# HELP meshd_http_requests_total HTTP requests answered, by route template (\"none\": no route matched, or refused before routing), method and status.\n# TYPE meshd_http_requests_total counter");
        for ((route, method, status), n) in &inner.requests {
            let _ = writeln!(
                out,
                "meshd_http_requests_total{{route=\"{}\",method=\"{method}\",status=\"{status}\"}} {n}",
                escape(route)
            );
        }
        let _ = writeln!(out, "# HELP meshd_http_request_duration_seconds Time from a request's arrival to its response head, by route template.\n# TYPE meshd_http_request_duration_seconds histogram");
        for (route, h) in &inner.durations {
            let labels = format!("route=\"{}\"", escape(route));
            h.render(out, "meshd_http_request_duration_seconds", &labels);
        }
    }
}

/// A label value as the text format wants it (route templates hold `{`, `}` and `/`
/// only, but a backslash or quote must never break the page).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"")
}

/// Where the inner layer writes the matched route for the outer one.
#[derive(Clone, Default)]
struct RouteSlot(Arc<OnceLock<String>>);

/// The outer layer: times and counts every request.
pub async fn record(
    State(metrics): State<Arc<HttpMetrics>>,
    mut req: Request,
    next: Next,
) -> Response {
    let slot = RouteSlot::default();
    req.extensions_mut().insert(slot.clone());
    let method = req.method().as_str().to_string();
    let started = Instant::now();
    let response = next.run(req).await;
    let route = slot.0.get().map(String::as_str).unwrap_or(NO_ROUTE);
    metrics.record(
        route,
        &method,
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}

/// The inner (route) layer: notes the matched route template.
pub async fn note_route(req: Request, next: Next) -> Response {
    if let (Some(slot), Some(path)) = (
        req.extensions().get::<RouteSlot>(),
        req.extensions().get::<MatchedPath>(),
    ) {
        let _ = slot.0.set(path.as_str().to_string());
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_methods_bounded() {
        let m = HttpMetrics::default();
        m.record("/v1/topics", "GET", 200, Duration::from_millis(3));
        m.record("/v1/topics", "get", 200, Duration::from_millis(40));
        m.record("/v1/topics", "BREW", 405, Duration::from_secs(60));
        let mut out = String::new();
        m.render(&mut out);
        assert!(out.contains(
            "meshd_http_requests_total{route=\"/v1/topics\",method=\"GET\",status=\"200\"} 2"
        ));
        assert!(out.contains(
            "meshd_http_requests_total{route=\"/v1/topics\",method=\"other\",status=\"405\"} 1"
        ));
        assert!(out.contains(
            "meshd_http_request_duration_seconds_bucket{route=\"/v1/topics\",le=\"0.005\"} 1"
        ));
        assert!(out.contains(
            "meshd_http_request_duration_seconds_bucket{route=\"/v1/topics\",le=\"0.05\"} 2"
        ));
        assert!(out.contains(
            "meshd_http_request_duration_seconds_bucket{route=\"/v1/topics\",le=\"30\"} 2"
        ));
        assert!(out.contains(
            "meshd_http_request_duration_seconds_bucket{route=\"/v1/topics\",le=\"+Inf\"} 3"
        ));
        assert!(out.contains("meshd_http_request_duration_seconds_count{route=\"/v1/topics\"} 3"));
    }
}
