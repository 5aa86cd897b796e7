//! The operator console (`GET /console/`, http-api.md "Console"): hand-written ES
//! modules and CSS under `crates/meshd/console/`, built into the binary, served with a
//! strict Content-Security-Policy (everything from this origin, nothing inline, no
//! frames). The page has no privilege of its own: it calls the public `/v1` API (and
//! `/metrics`) with the token the operator signs in with, so the gate judges every
//! call it makes exactly as it judges any other client's.

use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};

/// What the page may load and call: this origin only.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// Every asset: its path under `/console/`, its content type, its bytes.
const ASSETS: &[(&str, &str, &[u8])] = &[
    ("", HTML, INDEX),
    ("index.html", HTML, INDEX),
    ("style.css", CSS, include_bytes!("../console/style.css")),
    ("app.js", JS, include_bytes!("../console/app.js")),
    ("api.js", JS, include_bytes!("../console/api.js")),
    ("dom.js", JS, include_bytes!("../console/dom.js")),
    ("metrics.js", JS, include_bytes!("../console/metrics.js")),
    ("favicon.svg", SVG, include_bytes!("../console/favicon.svg")),
    (
        "views/cluster.js",
        JS,
        include_bytes!("../console/views/cluster.js"),
    ),
    (
        "views/topics.js",
        JS,
        include_bytes!("../console/views/topics.js"),
    ),
    (
        "views/subscriptions.js",
        JS,
        include_bytes!("../console/views/subscriptions.js"),
    ),
    (
        "views/deadletters.js",
        JS,
        include_bytes!("../console/views/deadletters.js"),
    ),
    (
        "views/tasks.js",
        JS,
        include_bytes!("../console/views/tasks.js"),
    ),
    (
        "views/sessions.js",
        JS,
        include_bytes!("../console/views/sessions.js"),
    ),
    (
        "views/live.js",
        JS,
        include_bytes!("../console/views/live.js"),
    ),
];

const INDEX: &[u8] = include_bytes!("../console/index.html");
const HTML: &str = "text/html; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";
const JS: &str = "text/javascript; charset=utf-8";
const SVG: &str = "image/svg+xml";

/// `/console`: to the page, whose relative asset paths need the trailing slash.
pub async fn redirect() -> Redirect {
    Redirect::permanent("/console/")
}

/// `/console/`: the page.
pub async fn index() -> Response {
    asset("")
}

/// `/console/{*file}`: an asset (the page itself for a view's path).
pub async fn file(Path(file): Path<String>) -> Response {
    asset(&file)
}

/// The asset at `file`, or a 404 problem naming it.
fn asset(file: &str) -> Response {
    let Some((_, content_type, body)) = ASSETS.iter().find(|(path, _, _)| *path == file) else {
        return crate::problem::Problem::not_found(format!("the console has no file {file:?}"))
            .into_response();
    };
    let mut answer = (StatusCode::OK, *body).into_response();
    let h = answer.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // The assets change with the binary: revalidate, never serve a stale module.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_module_an_asset_imports_is_served() {
        // An import of a file not in ASSETS would be a 404 and a blank view.
        for (path, content_type, body) in ASSETS {
            if *content_type != JS {
                continue;
            }
            let text = std::str::from_utf8(body).expect("utf-8 module");
            let dir = path.rsplit_once('/').map_or("", |(d, _)| d);
            for line in text.lines().filter(|l| l.starts_with("import ")) {
                let target = line
                    .rsplit_once(" from '")
                    .and_then(|(_, rest)| rest.split_once('\''))
                    .map(|(t, _)| t)
                    .unwrap_or_else(|| panic!("{path}: unparsed import {line}"));
                let resolved = resolve(dir, target);
                assert!(
                    ASSETS.iter().any(|(p, _, _)| *p == resolved),
                    "{path} imports {target} ({resolved}), which is not served"
                );
            }
        }
    }

    fn resolve(dir: &str, target: &str) -> String {
        let mut parts: Vec<&str> = if dir.is_empty() {
            Vec::new()
        } else {
            dir.split('/').collect()
        };
        for seg in target.split('/') {
            match seg {
                "." => {}
                ".." => {
                    parts.pop();
                }
                s => parts.push(s),
            }
        }
        parts.join("/")
    }

    #[test]
    fn no_asset_loads_anything_from_another_origin_or_runs_inline_code() {
        for (path, _, body) in ASSETS {
            let text = std::str::from_utf8(body).expect("utf-8 asset");
            for banned in [
                "http://",
                "https://",
                "//cdn",
                "innerHTML",
                "eval(",
                "<script>",
            ] {
                // The SVG namespace is a name, not a request.
                let hits = text
                    .match_indices(banned)
                    .filter(|(i, _)| !text[*i..].starts_with("http://www.w3.org/"))
                    .count();
                assert_eq!(hits, 0, "{path} contains {banned:?}");
            }
        }
    }
}
