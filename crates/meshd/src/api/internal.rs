//! Routes between the instances of one cluster (`/internal/v1/...`): a pull, ack, nack
//! or extend on this instance's own partitions, for another instance that forwards a
//! client's request here (`meshd_runtime::cluster::forward`). Authenticated by the cluster
//! secret in the `meshd-cluster-secret` header before admission (`crate::access::gate`,
//! which also answers 404 outside cluster mode), so these handlers only run for a peer.

use super::consume;
use super::Api;
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use meshd_runtime::runtime::Reach;
use std::sync::Arc;

/// One pull, ack, nack or extend on this instance's partitions, the release of a
/// forwarded pull whose answer did not reach the instance that asked, or an owner's
/// notice that deliveries this instance's streams hold were settled elsewhere.
pub async fn call(
    State(api): State<Arc<Api>>,
    Path((name, op)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    match op.as_str() {
        "pull" => consume::pull_with(api, name, headers, body, Reach::Local).await,
        "ack" => consume::ack_with(api, name, headers, body, Reach::Local).await,
        "nack" => consume::nack_with(api, name, headers, body, Reach::Local).await,
        "extend" => consume::extend_with(api, name, headers, body, Reach::Local).await,
        "release" => consume::release_forwarded(api, name, headers, body).await,
        // An owner says deliveries this instance pulled through it were settled on
        // another instance: the streams holding them get their credit back.
        "settled" => {
            let ids = consume::parse_ack(&headers, body)?;
            api.runtime.streams.settled_elsewhere(&ids);
            Ok(axum::Json(serde_json::json!({})).into_response())
        }
        "stats" => super::stream::stats_with(api, name, Reach::Local).await,
        _ => Err(Problem::not_found(format!("no internal operation {op:?}"))),
    }
}

/// An offset reset of a partition this instance owns.
pub async fn reset(
    State(api): State<Arc<Api>>,
    Path((name, partition)): Path<(String, String)>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, Problem> {
    consume::put_offset_with(api, name, partition, headers, body, Reach::Local).await
}

/// A redrive of a dead letter of a partition this instance owns.
pub async fn redrive(
    State(api): State<Arc<Api>>,
    Path(id): Path<String>,
) -> Result<Response, Problem> {
    super::deadletters::redrive_with(api, id, Reach::Local).await
}
