//! `GET /v1/cluster`: this instance, the Meta backend and its health, the members
//! (instances holding a membership lease in Meta) and every partition of every topic
//! with its owner and epoch, read from the partition owner keys in Meta
//! (`owners/partition/{topic}/{partition}`). An instance serving its own embedded log
//! owns no partition cluster-wide, so there `owner` and `epoch` are null.

use super::Api;
use crate::problem::Problem;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use meshd_stores::topics::TopicStore;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;

/// How long the handler waits for Meta before reporting it unhealthy.
const META_TIMEOUT: Duration = Duration::from_secs(2);

pub async fn cluster(State(api): State<Arc<Api>>) -> Result<Response, Problem> {
    let status = tokio::time::timeout(META_TIMEOUT, api.meta.status()).await;
    let (healthy, db_size, quota, alarms) = match status {
        Ok(Ok(s)) => (true, Some(s.db_size_bytes), s.quota_bytes, s.alarms),
        _ => (false, None, None, Vec::new()),
    };
    let members = match tokio::time::timeout(
        META_TIMEOUT,
        meshd_runtime::membership::members(api.meta.as_ref()),
    )
    .await
    {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            return Err(Problem::unavailable(
                "members",
                api.meta_backend,
                e.to_string(),
            ))
        }
        Err(_) => {
            return Err(Problem::unavailable(
                "members",
                api.meta_backend,
                "Meta did not answer in time",
            ))
        }
    };
    let topics = api
        .topics
        .list()
        .await
        .map_err(|e| super::topics::topic_problem(e, api.meta_backend))?;
    let owners = match tokio::time::timeout(
        META_TIMEOUT,
        meshd_runtime::cluster::ownership::owners(api.meta.as_ref()),
    )
    .await
    {
        Ok(Ok(o)) => o,
        Ok(Err(e)) => {
            return Err(Problem::unavailable(
                "owners",
                api.meta_backend,
                e.to_string(),
            ))
        }
        Err(_) => {
            return Err(Problem::unavailable(
                "owners",
                api.meta_backend,
                "Meta did not answer in time",
            ))
        }
    };
    let mut partitions: Vec<Value> = Vec::new();
    for t in &topics {
        for p in 0..t.partitions {
            let (owner, epoch) = match owners.get(&(t.name.clone(), p)) {
                Some((holder, epoch)) => (json!(holder), json!(epoch)),
                None => (Value::Null, Value::Null),
            };
            partitions
                .push(json!({"topic": t.name, "partition": p, "owner": owner, "epoch": epoch}));
        }
    }
    Ok(Json(json!({
        "instance": api.instance_id,
        "meta": {"backend": api.meta_backend.as_str(), "healthy": healthy, "db_size_bytes": db_size, "quota_bytes": quota, "alarms": alarms},
        "log": {
            "backend": if api.log_backend == meshd_meta::Backend::Nats { "nats" } else { "embedded" },
            "id": api.log.log_id(),
        },
        "release": meshd_runtime::membership::Release::this().to_string(),
        "oldest_release": meshd_runtime::membership::oldest_release(&members).to_string(),
        "members": members,
        "partitions": partitions,
    }))
    .into_response())
}
