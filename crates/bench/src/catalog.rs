//! The systems under test ([`System`]): each one's name, scenario and durability, and
//! which runner measures it (publish and engine in `systems`, end to end in `e2e`,
//! Meta writes in `meta`).

use crate::meta::{MetaOp, MetaPath};
use crate::procs::JsSync;
use crate::systems::{run_http_floor, run_jetstream, run_meshd, run_rocksdb, Config, Outcome};
use anyhow::{anyhow, Context, Result};
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum System {
    Meshd,
    /// meshd with the topic's publish dedup off (`dedup_window_ms: 0`): what dedup
    /// costs is the difference to [`System::Meshd`].
    MeshdNoDedup,
    /// No write: `GET /healthz` over keep-alive, one request per call. What meshd's
    /// HTTP stack (hyper, the middleware, routing) costs per request on its own: the
    /// floor under every single-event request.
    MeshdHttpFloor,
    JsAlways,
    /// JetStream at equal durability, a batch as one atomic batch publish.
    JsAtomic,
    JsDefault,
    Rocksdb,
    /// Scenario 2, end to end (publish → pull → ack): meshd, JetStream at equal
    /// durability, JetStream relaxed.
    E2eMeshd,
    E2eJsAlways,
    E2eJsDefault,
    /// [`System::E2eJsAlways`] with each worker on a connection of its own, as each
    /// meshd worker has (the NATS client otherwise multiplexes every worker on one
    /// connection, whose reads and writes then carry several workers' messages).
    E2eJsConns,
    /// Scenario 2 through streams: meshd's SSE stream (acks over POST), and a
    /// JetStream push consumer at equal durability.
    E2eMeshdStream,
    E2eJsPush,
    /// meshd's WebSocket stream with in-band acks.
    E2eMeshdWs,
    /// Scenario 4: one Meta write through one path.
    Meta(MetaPath, MetaOp),
}

impl System {
    pub fn name(self) -> &'static str {
        match self {
            System::Meshd => "meshd",
            System::MeshdNoDedup => "meshd-nodedup",
            System::MeshdHttpFloor => "meshd-http-floor",
            System::JsAlways => "jetstream",
            System::JsAtomic => "jetstream-atomic",
            System::JsDefault => "jetstream-relaxed",
            System::Rocksdb => "rocksdb",
            System::E2eMeshd => "meshd-e2e",
            System::E2eJsAlways => "jetstream-e2e",
            System::E2eJsDefault => "jetstream-relaxed-e2e",
            System::E2eJsConns => "jetstream-conns-e2e",
            System::E2eMeshdStream => "meshd-stream-e2e",
            System::E2eMeshdWs => "meshd-ws-e2e",
            System::E2eJsPush => "jetstream-push-e2e",
            System::Meta(path, op) => match (path, op) {
                (MetaPath::MeshdEtcd, MetaOp::Cas) => "meshd-etcd/cas",
                (MetaPath::RawEtcd, MetaOp::Cas) => "raw-etcd/cas",
                (MetaPath::MeshdEmbedded, MetaOp::Cas) => "meshd-embedded/cas",
                (MetaPath::MeshdEtcd, MetaOp::Fenced) => "meshd-etcd/fenced",
                (MetaPath::RawEtcd, MetaOp::Fenced) => "raw-etcd/fenced",
                (MetaPath::MeshdEmbedded, MetaOp::Fenced) => "meshd-embedded/fenced",
            },
        }
    }

    pub fn scenario(self) -> &'static str {
        match self {
            System::Rocksdb => "engine",
            System::Meta(..) => "meta",
            System::E2eMeshd
            | System::E2eJsAlways
            | System::E2eJsDefault
            | System::E2eJsConns
            | System::E2eMeshdStream
            | System::E2eMeshdWs
            | System::E2eJsPush => "e2e",
            _ => "publish",
        }
    }

    /// The meta scenario's systems, in the order they alternate: for each operation,
    /// meshd's etcd backend next to the raw client it is compared with, then embedded.
    pub fn meta_all() -> Vec<System> {
        let mut v = Vec::new();
        for op in [MetaOp::Cas, MetaOp::Fenced] {
            for path in [
                MetaPath::MeshdEtcd,
                MetaPath::RawEtcd,
                MetaPath::MeshdEmbedded,
            ] {
                v.push(System::Meta(path, op));
            }
        }
        v
    }

    pub fn durability(self) -> &'static str {
        match self {
            System::Meshd => "fsync per group commit (201 after fsync); dedup on (2 min)",
            System::MeshdNoDedup => "fsync per group commit (201 after fsync); dedup off",
            System::MeshdHttpFloor => {
                "no write: GET /healthz over keep-alive (the HTTP stack's cost per request)"
            }
            System::JsAlways => JsSync::Always.label(),
            System::JsAtomic => {
                "fsync every ack (sync_interval: always); a batch is one atomic batch publish"
            }
            System::JsDefault => JsSync::Default.label(),
            System::Rocksdb => "WriteBatch sync=true (RocksDB write group)",
            System::E2eMeshd => crate::e2e::MESHD_DURABILITY,
            System::E2eJsAlways => crate::e2e::js_durability(JsSync::Always),
            System::E2eJsDefault => crate::e2e::js_durability(JsSync::Default),
            System::E2eJsConns => crate::e2e::JS_CONNS_DURABILITY,
            System::E2eMeshdStream => crate::e2e::MESHD_STREAM_DURABILITY,
            System::E2eMeshdWs => crate::e2e::MESHD_WS_DURABILITY,
            System::E2eJsPush => crate::e2e::JS_PUSH_DURABILITY,
            System::Meta(MetaPath::MeshdEmbedded, _) => crate::meta::EMBEDDED_DURABILITY,
            System::Meta(..) => crate::meta::ETCD_DURABILITY,
        }
    }
}

pub async fn run(
    system: System,
    cfg: &Config,
    meshd: &Path,
    nats: Option<&Path>,
    etcd: Option<&Path>,
) -> Result<Outcome> {
    match system {
        System::Meta(path, op) => crate::meta::run(path, op, cfg, etcd).await,
        System::Meshd => run_meshd(cfg, meshd, true).await,
        System::MeshdNoDedup => run_meshd(cfg, meshd, false).await,
        System::MeshdHttpFloor => run_http_floor(cfg, meshd).await,
        System::JsAlways | System::JsAtomic | System::JsDefault => {
            let nats = nats.ok_or_else(|| anyhow!("no nats-server binary"))?;
            let sync = if system == System::JsDefault {
                JsSync::Default
            } else {
                JsSync::Always
            };
            run_jetstream(cfg, nats, sync, system == System::JsAtomic).await
        }
        System::E2eMeshd => crate::e2e::run_meshd(cfg, meshd).await,
        System::E2eMeshdStream => crate::e2e::run_meshd_stream(cfg, meshd).await,
        System::E2eMeshdWs => crate::e2e::run_meshd_ws(cfg, meshd).await,
        System::E2eJsPush => {
            let nats = nats.ok_or_else(|| anyhow!("no nats-server binary"))?;
            crate::e2e::run_jetstream_push(cfg, nats).await
        }
        System::E2eJsAlways | System::E2eJsDefault | System::E2eJsConns => {
            let nats = nats.ok_or_else(|| anyhow!("no nats-server binary"))?;
            let sync = if system == System::E2eJsDefault {
                JsSync::Default
            } else {
                JsSync::Always
            };
            crate::e2e::run_jetstream(cfg, nats, sync, system == System::E2eJsConns).await
        }
        System::Rocksdb => {
            let (c, b, w, e) = (cfg.concurrency, cfg.batch, cfg.window, cfg.events.clone());
            let measured = tokio::task::spawn_blocking(move || run_rocksdb(c, b, w, e))
                .await
                .context("the engine run panicked")??;
            Ok(Outcome {
                measured,
                peak_rss_bytes: None,
            })
        }
    }
}
