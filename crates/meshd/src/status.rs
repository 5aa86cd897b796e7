//! What operators read without a token or with the metrics one: `/healthz`,
//! `/readyz` (the truth about every store and backend, not "the process is up") and
//! `/metrics` in the Prometheus text format.

use crate::metered::MeteredMeta;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use meshd_meta::Meta;
use meshd_stores::delivery::DeliveryStateStore;
use meshd_stores::offsets::OffsetStore;
use meshd_stores::sessions::{MetaSessionStore, SessionStore};
use meshd_stores::subscriptions::SubscriptionStore;
use meshd_stores_local::LocalStores;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

/// How long a readiness probe waits for Meta before calling it unavailable.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// How long one Meta status probe serves `/readyz` and `/metrics`: they are never
/// shed, so without it every scrape would be a call to etcd.
const META_PROBE_FOR: Duration = Duration::from_secs(1);

/// Meta's status as `/readyz` and `/metrics` show it. A remote Meta (etcd) is probed
/// at most once per [`META_PROBE_FOR`], however often they are called; callers that
/// arrive while a probe runs wait for it and share its answer (the lock is held across
/// the probe for that). The embedded Meta is asked every time: its status is a local
/// read, and a fail-stop shows at once.
pub struct MetaProbe {
    meta: Arc<MeteredMeta>,
    /// Zero for the embedded Meta.
    cache_for: Duration,
    last: tokio::sync::Mutex<Option<(std::time::Instant, Probed)>>,
}

/// One probe's outcome: the status, or what went wrong (an error kind, or `timeout`).
type Probed = Result<meshd_meta::MetaStatus, String>;

impl MetaProbe {
    pub fn new(meta: Arc<MeteredMeta>, remote: bool) -> Self {
        Self {
            meta,
            cache_for: if remote {
                META_PROBE_FOR
            } else {
                Duration::ZERO
            },
            last: tokio::sync::Mutex::new(None),
        }
    }

    async fn status(&self) -> Probed {
        let mut last = self.last.lock().await;
        if let Some((at, probed)) = &*last {
            if at.elapsed() < self.cache_for {
                return probed.clone();
            }
        }
        let probed = match tokio::time::timeout(READY_TIMEOUT, self.meta.status()).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(e.kind().to_string()),
            Err(_) => Err("timeout".to_string()),
        };
        *last = Some((std::time::Instant::now(), probed.clone()));
        probed
    }
}

/// What `/readyz` and `/metrics` read besides the API's own state.
pub struct Status {
    pub api: Arc<crate::api::Api>,
    /// The concrete session store, for its counters.
    pub sessions: Arc<MetaSessionStore>,
    /// Cluster mode: the membership lease partitions are owned under.
    pub cluster_lease:
        Option<tokio::sync::watch::Receiver<Option<meshd_runtime::cluster::ownership::LeaseState>>>,
    pub meta_probe: MetaProbe,
    pub local: Arc<LocalStores>,
    pub gate: Arc<crate::access::Gate>,
    pub http: Arc<crate::listen::HttpCounters>,
    pub compaction: Arc<meshd_runtime::compaction::CompactionCounters>,
    pub compaction_retention: u64,
    /// Requests by route template, method and status, and their durations.
    pub http_requests: Arc<crate::http_metrics::HttpMetrics>,
}

pub async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

pub async fn readyz(State(state): State<Arc<Status>>) -> Response {
    let (ready, body) = readiness(&state).await;
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

/// What `/readyz` answers: ready or not, and each check (`meshd_ready` on `/metrics`
/// is the same verdict).
async fn readiness(state: &Status) -> (bool, serde_json::Value) {
    let meta = match state.meta_probe.status().await {
        // An alarm (etcd's NOSPACE: every write refused) is named: Meta answers, but
        // nothing can be written.
        Ok(s) if !s.alarms.is_empty() => format!("alarm {}", s.alarms.join(", ")),
        Ok(_) => "ok".to_string(),
        Err(e) => e,
    };
    let local = match state.local.deliveries.health() {
        Ok(()) => "ok",
        Err(_) => "failed",
    };
    let cache = |ready: bool| if ready { "ok" } else { "loading" };
    let topics = cache(state.api.topics.health().is_ready());
    let subscriptions = cache(state.api.subscriptions.health().is_ready());
    let sessions = cache(state.sessions.health().is_ready());
    let recovery = if state.api.runtime.is_recovered() && !state.local.log.dedup_loading() {
        "ok"
    } else {
        "recovering"
    };
    let dispatch = if state.api.runtime.failures().is_empty() {
        "ok"
    } else {
        "failed"
    };
    // Cluster mode: an instance without a live membership lease owns nothing.
    let cluster = state.cluster_lease.as_ref().map(|l| match *l.borrow() {
        Some(l) if l.deadline.is_live(std::time::Instant::now()) => "ok",
        _ => "no lease",
    });
    let ready = meta == "ok"
        && cluster.is_none_or(|c| c == "ok")
        && local == "ok"
        && topics == "ok"
        && subscriptions == "ok"
        && sessions == "ok"
        && recovery == "ok"
        && dispatch == "ok";
    let mut body = json!({
        "status": if ready { "ready" } else { "unavailable" },
        "instance": state.api.instance_id,
        "checks": {
            format!("meta:{}", state.api.meta_backend): meta,
            "local:rocksdb": local,
            "topics": topics,
            "subscriptions": subscriptions,
            "sessions": sessions,
            "recovery": recovery,
            "dispatch": dispatch,
        },
    });
    if let Some(c) = cluster {
        body["checks"]["cluster"] = c.into();
    }
    (ready, body)
}

pub async fn metrics_text(State(state): State<Arc<Status>>) -> Response {
    let mut out = String::new();
    out.push_str("# HELP meshd_build_info meshd version.\n# TYPE meshd_build_info gauge\n");
    out.push_str(&format!(
        "meshd_build_info{{version=\"{}\",instance=\"{}\"}} 1\n",
        env!("CARGO_PKG_VERSION"),
        state.api.instance_id
    ));
    state.api.quotas.render(&mut out);
    state.http_requests.render(&mut out);
    let (ready, _) = readiness(&state).await;
    out.push_str(&format!(
        "# HELP meshd_ready Whether /readyz answers 200 (every check ok).\n# TYPE meshd_ready gauge\nmeshd_ready {}\n",
        u8::from(ready)
    ));
    state
        .compaction
        .render(&mut out, state.compaction_retention);
    let status = state.meta_probe.status().await;
    let backend = state.api.meta_backend;
    let meta_up = status.is_ok();
    out.push_str("# HELP meshd_meta_healthy Whether Meta answered a status call.\n# TYPE meshd_meta_healthy gauge\n");
    match status {
        Ok(s) => {
            out.push_str(&format!("meshd_meta_healthy{{backend=\"{backend}\"}} 1\n"));
            out.push_str("# HELP meshd_meta_revision The Meta store revision.\n# TYPE meshd_meta_revision gauge\n");
            out.push_str(&format!(
                "meshd_meta_revision{{backend=\"{backend}\"}} {}\n",
                s.revision
            ));
            out.push_str("# HELP meshd_meta_db_size_bytes The Meta database size.\n# TYPE meshd_meta_db_size_bytes gauge\n");
            out.push_str(&format!(
                "meshd_meta_db_size_bytes{{backend=\"{backend}\"}} {}\n",
                s.db_size_bytes
            ));
            if let Some(q) = s.quota_bytes {
                out.push_str("# HELP meshd_meta_quota_bytes The size at which Meta refuses every write (etcd's --quota-backend-bytes, read from its /metrics).\n# TYPE meshd_meta_quota_bytes gauge\n");
                out.push_str(&format!(
                    "meshd_meta_quota_bytes{{backend=\"{backend}\"}} {q}\n"
                ));
            }
            out.push_str("# HELP meshd_meta_alarm An alarm Meta has raised (etcd's NOSPACE refuses every write until the operator frees space and disarms it).\n# TYPE meshd_meta_alarm gauge\n");
            for a in &s.alarms {
                out.push_str(&format!(
                    "meshd_meta_alarm{{backend=\"{backend}\",alarm=\"{a}\"}} 1\n"
                ));
            }
        }
        Err(_) => out.push_str(&format!("meshd_meta_healthy{{backend=\"{backend}\"}} 0\n")),
    }
    out.push_str("# HELP meshd_meta_up Whether Meta answered a status call (1) or not (0).\n# TYPE meshd_meta_up gauge\n");
    out.push_str(&format!(
        "meshd_meta_up{{backend=\"{backend}\"}} {}\n",
        u8::from(meta_up)
    ));
    out.push_str("# HELP meshd_meta_undecodable_records_total Meta records that did not decode and were left out, by store.\n# TYPE meshd_meta_undecodable_records_total counter\n");
    out.push_str(&format!(
        "meshd_meta_undecodable_records_total{{store=\"members\"}} {}\n",
        meshd_runtime::membership::undecodable_records()
    ));
    // Counted in the cache, never copied (a scrape must stay cheap with many).
    let live = state.api.quotas.sessions_live();
    out.push_str("# HELP meshd_sessions_live Live sessions (all instances), from the session cache.\n# TYPE meshd_sessions_live gauge\n");
    if let Some(n) = live {
        out.push_str(&format!(
            "meshd_sessions_live{{backend=\"{backend}\"}} {n}\n"
        ));
    }
    out.push_str("# HELP meshd_session_takeovers_total Session opens on this instance that took a live session over.\n# TYPE meshd_session_takeovers_total counter\n");
    out.push_str(&format!(
        "meshd_session_takeovers_total{{backend=\"{backend}\"}} {}\n",
        state.sessions.takeovers()
    ));
    out.push_str("# HELP meshd_session_fenced_writes_total Writes for a session rejected because it was taken over or expired.\n# TYPE meshd_session_fenced_writes_total counter\n");
    out.push_str(&format!(
        "meshd_session_fenced_writes_total{{backend=\"{backend}\"}} {}\n",
        state.sessions.fenced_writes()
    ));
    state.meta_probe.meta.render(&mut out);
    state.api.metrics.render(&mut out);
    state.api.runtime.render(&mut out);
    state.http.render(&mut out);
    state.api.admission.render(&mut out);
    state.gate.render(&mut out);
    out.push_str("# HELP meshd_local_healthy Whether the Local RocksDB stores accept writes (0 after a failed write or fsync, or damaged data found on read).\n# TYPE meshd_local_healthy gauge\n");
    out.push_str(&format!(
        "meshd_local_healthy{{backend=\"rocksdb\"}} {}\n",
        u8::from(state.local.deliveries.health().is_ok())
    ));
    let tail = state.local.log.tail_stats();
    const ROCKSDB: &str = r#"backend="rocksdb""#;
    render_metric(
        &mut out,
        "meshd_log_tail_cache_bytes",
        "gauge",
        "Memory held by the Local log's tail cache (recent durable events served without a disk read; payloads plus a fixed cost per event).",
        &[(ROCKSDB, tail.bytes)],
    );
    render_metric(
        &mut out,
        "meshd_log_tail_cache_events",
        "gauge",
        "Events held by the Local log's tail cache.",
        &[(ROCKSDB, tail.events)],
    );
    render_metric(
        &mut out,
        "meshd_dedup_entries",
        "gauge",
        "Keys in the Local log's publish dedup index (events stored within their topic's dedup window, 37-75 bytes of memory each; JetStream keeps its own in cluster mode).",
        &[(ROCKSDB, state.local.log.dedup_entries() as u64)],
    );
    render_metric(
        &mut out,
        "meshd_dedup_full_total",
        "counter",
        "Publishes with dedup refused 429 dedup-full because the Local log's dedup index held --max-dedup-entries entries (none is dropped early).",
        &[(ROCKSDB, state.local.log.dedup_full_refusals())],
    );
    render_metric(
        &mut out,
        "meshd_log_tail_cache_reads_total",
        "counter",
        "Reads of the Local log by whether the tail cache served them (hit) or RocksDB did (miss).",
        &[
            (r#"backend="rocksdb",result="hit""#, tail.hits),
            (r#"backend="rocksdb",result="miss""#, tail.misses),
        ],
    );
    out.push_str("# HELP meshd_offset_backwards_rejections_total Offset commits rejected for moving backwards.\n# TYPE meshd_offset_backwards_rejections_total counter\n");
    out.push_str(&format!(
        "meshd_offset_backwards_rejections_total{{backend=\"rocksdb\"}} {}\n",
        state.local.offsets.backwards_rejections()
    ));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// One metric in the text format: its HELP and TYPE lines, then a sample per
/// (labels, value).
fn render_metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(&str, u64)]) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
    for (labels, value) in samples {
        out.push_str(&format!("{name}{{{labels}}} {value}\n"));
    }
}
