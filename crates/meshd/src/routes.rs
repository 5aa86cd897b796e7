//! The route table: every route meshd answers, and who may call it. It is the one
//! place that says so: the gate of each route's group checks its [`Caller`] (token
//! role, browser rules, the cluster secret), and the OpenAPI document is read from
//! it. Routes are grouped by caller into sub-routers, each with its own layers,
//! innermost first:
//!
//! 1. the route template is noted for the HTTP metrics (only on a matched route, and
//!    only once the gate let the request in: a refusal counts as `route="none"`);
//! 2. API routes: the body cap, the problem+json 405, admission (request slots, body
//!    memory);
//! 3. the gate of the group's caller, so a refused request never holds a slot or has
//!    its body read.
//!
//! A path under `/v1` or `/internal` that no route has is 404 once its group's gate
//! let it in (an unknown `/v1` path needs the admin token, as every admin route does,
//! so a client token learns nothing of the admin routes); any other unknown path is a
//! plain 404 under the site's browser rules. Outermost of all, every request is
//! counted and timed.

use crate::access::{Caller, Gate};
use crate::admission::Admission;
use crate::api::{cluster, consume, deadletters, internal, sessions, stream};
use crate::api::{subscribe, subscriptions, tasks, topics, Api};
use crate::http::MAX_BODY_BYTES;
use crate::http_metrics::HttpMetrics;
use crate::problem::Problem;
use crate::status::Status;
use axum::extract::DefaultBodyLimit;
use axum::handler::Handler;
use axum::http::Method;
use axum::middleware::{from_fn, from_fn_with_state};
use axum::routing::{any, on, MethodFilter, MethodRouter};
use axum::Router;
use std::collections::BTreeMap;
use std::sync::Arc;

/// One route: a method on a path template, who may call it, and its handler (with
/// the state `S` it reads).
pub struct Route<S> {
    pub caller: Caller,
    // Read by the tests today; the OpenAPI document (issue 48) reads it next.
    #[allow(dead_code)]
    pub method: Method,
    /// An absolute path template (`/v1/topics/{topic}`).
    pub path: &'static str,
    endpoint: MethodRouter<S>,
}

fn route<S, H, T>(caller: Caller, method: Method, path: &'static str, handler: H) -> Route<S>
where
    S: Clone + Send + Sync + 'static,
    H: Handler<T, S>,
    T: 'static,
{
    // Every method the table uses has a filter.
    let filter = MethodFilter::try_from(method.clone()).unwrap_or(MethodFilter::GET);
    Route {
        caller,
        method,
        path,
        endpoint: on(filter, handler),
    }
}

/// The routes of the HTTP API (`/v1`) and of the cluster's members (`/internal`).
pub fn api_routes() -> Vec<Route<Arc<Api>>> {
    use Caller::{Admin, Client, Member, Publisher, Streamer};
    use Method as M;
    vec![
        route(Admin, M::GET, "/v1/topics", topics::list_topics),
        route(Admin, M::PUT, "/v1/topics/{topic}", topics::put_topic),
        route(Admin, M::GET, "/v1/topics/{topic}", topics::get_topic),
        route(Admin, M::DELETE, "/v1/topics/{topic}", topics::delete_topic),
        route(
            Publisher,
            M::POST,
            "/v1/topics/{topic}/events",
            topics::publish,
        ),
        route(
            Admin,
            M::GET,
            "/v1/topics/{topic}/partitions/{partition}/events",
            topics::browse,
        ),
        route(
            Admin,
            M::GET,
            "/v1/subscriptions",
            subscriptions::list_subscriptions,
        ),
        route(
            Admin,
            M::PUT,
            "/v1/subscriptions/{name}",
            subscriptions::put_subscription,
        ),
        route(
            Admin,
            M::GET,
            "/v1/subscriptions/{name}",
            subscriptions::get_subscription,
        ),
        route(
            Admin,
            M::DELETE,
            "/v1/subscriptions/{name}",
            subscriptions::delete_subscription,
        ),
        route(
            Client,
            M::POST,
            "/v1/subscriptions/{name}/pull",
            consume::pull,
        ),
        route(
            Client,
            M::POST,
            "/v1/subscriptions/{name}/ack",
            consume::ack,
        ),
        route(
            Client,
            M::POST,
            "/v1/subscriptions/{name}/nack",
            consume::nack,
        ),
        route(
            Client,
            M::POST,
            "/v1/subscriptions/{name}/extend",
            consume::extend,
        ),
        route(
            Streamer,
            M::GET,
            "/v1/subscriptions/{name}/stream",
            subscribe::stream,
        ),
        // The statistics a consumer (or the console with a client token) reads: no
        // settings, no secrets.
        route(
            Client,
            M::GET,
            "/v1/subscriptions/{name}/stats",
            stream::stats,
        ),
        route(
            Admin,
            M::GET,
            "/v1/subscriptions/{name}/offsets",
            consume::get_offsets,
        ),
        route(
            Admin,
            M::PUT,
            "/v1/subscriptions/{name}/offsets/{partition}",
            consume::put_offset,
        ),
        route(Admin, M::GET, "/v1/deadletters", deadletters::list),
        route(Admin, M::GET, "/v1/deadletters/{id}", deadletters::get),
        route(
            Admin,
            M::DELETE,
            "/v1/deadletters/{id}",
            deadletters::delete,
        ),
        route(
            Admin,
            M::POST,
            "/v1/deadletters/{id}/redrive",
            deadletters::redrive,
        ),
        route(Admin, M::GET, "/v1/cluster", cluster::cluster),
        route(Client, M::POST, "/v1/sessions", sessions::open),
        route(Client, M::GET, "/v1/sessions", sessions::list),
        route(Client, M::GET, "/v1/sessions/{id}", sessions::get_one),
        route(Client, M::DELETE, "/v1/sessions/{id}", sessions::close),
        route(
            Client,
            M::POST,
            "/v1/sessions/{id}/heartbeat",
            sessions::heartbeat,
        ),
        route(Client, M::POST, "/v1/tasks", tasks::submit),
        route(Client, M::GET, "/v1/tasks", tasks::list),
        route(Client, M::GET, "/v1/tasks/{id}", tasks::get_task),
        route(Client, M::POST, "/v1/tasks/{id}/claim", tasks::claim),
        route(
            Client,
            M::POST,
            "/v1/tasks/{id}/transition",
            tasks::transition,
        ),
        route(Client, M::POST, "/v1/tasks/{id}/cancel", tasks::cancel),
        route(
            Member,
            M::POST,
            "/internal/v1/subscriptions/{name}/{op}",
            internal::call,
        ),
        route(
            Member,
            M::POST,
            "/internal/v1/subscriptions/{name}/offsets/{partition}",
            internal::reset,
        ),
        route(
            Member,
            M::POST,
            "/internal/v1/deadletters/{id}/redrive",
            internal::redrive,
        ),
    ]
}

/// The probes, the metrics and the console.
pub fn site_routes() -> Vec<Route<Arc<Status>>> {
    use Caller::{Anyone, Metrics};
    vec![
        route(Anyone, Method::GET, "/healthz", crate::status::healthz),
        route(Anyone, Method::GET, "/readyz", crate::status::readyz),
        route(
            Metrics,
            Method::GET,
            "/metrics",
            crate::status::metrics_text,
        ),
        route(Anyone, Method::GET, "/console", crate::console::redirect),
        route(Anyone, Method::GET, "/console/", crate::console::index),
        route(
            Anyone,
            Method::GET,
            "/console/{*file}",
            crate::console::file,
        ),
    ]
}

/// What the layers of the groups need.
pub struct Layers {
    pub gate: Arc<Gate>,
    pub admission: Arc<Admission>,
    pub http_requests: Arc<HttpMetrics>,
}

/// The whole application: the table's routes grouped by caller, each group behind
/// its gate (see the module docs).
pub fn app(api: Arc<Api>, status: Arc<Status>, layers: Layers) -> Router {
    let mut groups: BTreeMap<Caller, Router> = BTreeMap::new();
    let mut add = |caller: Caller, path: &'static str, endpoint: MethodRouter| {
        let group = groups.remove(&caller).unwrap_or_default();
        groups.insert(caller, group.route(path, endpoint));
    };
    for r in api_routes() {
        add(r.caller, r.path, r.endpoint.with_state(api.clone()));
    }
    for r in site_routes() {
        add(r.caller, r.path, r.endpoint.with_state(status.clone()));
    }
    let mut app = Router::new().fallback(not_found).layer(from_fn_with_state(
        (layers.gate.clone(), Caller::Anyone),
        crate::access::gate,
    ));
    for (caller, group) in groups {
        app = app.merge(seal(caller, group, &layers));
    }
    // Outermost of all: every request is counted and timed, refusals included.
    app.layer(from_fn_with_state(
        layers.http_requests,
        crate::http_metrics::record,
    ))
}

/// A group's layers (see the module docs).
fn seal(caller: Caller, group: Router, layers: &Layers) -> Router {
    let api = caller.admitted();
    let group = if api {
        group.method_not_allowed_fallback(method_not_allowed)
    } else {
        group
    };
    let mut group = group.route_layer(from_fn(crate::http_metrics::note_route));
    // Unknown paths of the group's prefix: 404 behind its gate.
    let unknown: &[&'static str] = match caller {
        Caller::Admin => &["/v1/", "/v1/{*rest}"],
        Caller::Member => &["/internal", "/internal/", "/internal/{*rest}"],
        _ => &[],
    };
    for path in unknown {
        group = group.route(path, any(not_found));
    }
    let group = if api {
        group
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .layer(from_fn_with_state(
                layers.admission.clone(),
                crate::admission::admit,
            ))
    } else {
        group
    };
    group.layer(from_fn_with_state(
        (layers.gate.clone(), caller),
        crate::access::gate,
    ))
}

async fn not_found() -> Problem {
    Problem::not_found("no such route")
}

async fn method_not_allowed() -> Problem {
    Problem::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "this route does not take that method",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller_of(method: Method, path: &str) -> Option<Caller> {
        api_routes()
            .into_iter()
            .chain(site_routes().into_iter().map(|r| Route {
                caller: r.caller,
                method: r.method,
                path: r.path,
                endpoint: MethodRouter::new(),
            }))
            .find(|r| r.method == method && r.path == path)
            .map(|r| r.caller)
    }

    #[test]
    fn routes_need_the_documented_caller() {
        use Caller::*;
        let (g, p) = (Method::GET, Method::POST);
        assert_eq!(caller_of(g.clone(), "/healthz"), Some(Anyone));
        assert_eq!(caller_of(g.clone(), "/metrics"), Some(Metrics));
        assert_eq!(
            caller_of(p.clone(), "/internal/v1/subscriptions/{name}/{op}"),
            Some(Member)
        );
        assert_eq!(
            caller_of(p.clone(), "/v1/topics/{topic}/events"),
            Some(Publisher)
        );
        assert_eq!(caller_of(Method::PUT, "/v1/topics/{topic}"), Some(Admin));
        for op in ["pull", "ack", "nack", "extend"] {
            let path = format!("/v1/subscriptions/{{name}}/{op}");
            assert_eq!(caller_of(p.clone(), &path), Some(Client), "{op}");
        }
        assert_eq!(
            caller_of(g.clone(), "/v1/subscriptions/{name}/stream"),
            Some(Streamer)
        );
        assert_eq!(
            caller_of(Method::PUT, "/v1/subscriptions/{name}/offsets/{partition}"),
            Some(Admin)
        );
        assert_eq!(caller_of(p.clone(), "/v1/sessions"), Some(Client));
        assert_eq!(caller_of(p.clone(), "/v1/tasks/{id}/claim"), Some(Client));
        assert_eq!(
            caller_of(p.clone(), "/v1/deadletters/{id}/redrive"),
            Some(Admin)
        );
        assert_eq!(caller_of(g, "/v1/cluster"), Some(Admin));
    }

    #[test]
    fn every_route_is_in_the_table_once_and_under_its_prefix() {
        let mut seen = std::collections::BTreeSet::new();
        for r in api_routes() {
            assert!(
                seen.insert((r.method.to_string(), r.path)),
                "{} {} twice",
                r.method,
                r.path
            );
            let prefix = if r.caller == Caller::Member {
                "/internal/v1/"
            } else {
                "/v1/"
            };
            assert!(r.path.starts_with(prefix), "{} {}", r.method, r.path);
        }
    }
}
