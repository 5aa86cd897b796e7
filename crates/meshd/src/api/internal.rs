//! Routes between the instances of one cluster (`/internal/v1/...`): a pull, ack, nack
//! or extend on this instance's own partitions, for another instance that forwards a
//! client's request here (`crate::cluster::forward`). Authenticated by the cluster
//! secret in the `meshd-cluster-secret` header; 404 outside cluster mode.

use super::consume::{self, Reach};
use super::Api;
use crate::cluster::forward::{secret_matches, SECRET_HEADER};
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use std::sync::Arc;

pub fn routes() -> Router<Arc<Api>> {
    Router::new()
        .route("/internal/v1/subscriptions/{name}/pull", post(pull))
        .route("/internal/v1/subscriptions/{name}/ack", post(ack))
        .route("/internal/v1/subscriptions/{name}/nack", post(nack))
        .route("/internal/v1/subscriptions/{name}/extend", post(extend))
}

fn authenticate(api: &Api, headers: &HeaderMap) -> Result<(), Problem> {
    let Some(secret) = &api.cluster_secret else {
        return Err(Problem::not_found("no such route (not in cluster mode)"));
    };
    let given = headers
        .get(SECRET_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if secret_matches(secret, given) {
        Ok(())
    } else {
        Err(Problem::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "an internal route needs the cluster secret",
        ))
    }
}

async fn pull(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    authenticate(&api, &headers)?;
    consume::pull_with(api, name, headers, body, Reach::Local).await
}

async fn ack(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    authenticate(&api, &headers)?;
    consume::ack_with(api, name, headers, body, Reach::Local).await
}

async fn nack(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    authenticate(&api, &headers)?;
    consume::nack_with(api, name, headers, body, Reach::Local).await
}

async fn extend(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    authenticate(&api, &headers)?;
    consume::extend_with(api, name, headers, body, Reach::Local).await
}
