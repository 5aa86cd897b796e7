//! Running the systems under test (the list is `catalog`): the publish and engine
//! runners, and what every scenario's runner shares. Each measured run starts its own
//! server on a fresh temp dir (so no run inherits another's data, caches or peak
//! memory), sets it up, drives load, reads the server's costs and stops it.
//!
//! Every system stores the same bytes per event: one structured-mode CloudEvent JSON
//! document whose `data` is `size` bytes (see [`Events`]). meshd receives it over HTTP,
//! JetStream as the message payload, RocksDB as the value.

use crate::load::{self, Measured, Op, Window};
use crate::procs::{self, JsSync, Server};
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use futures::future::{join_all, BoxFuture};
use futures::FutureExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Builds event documents: `{"specversion":"1.0","id":"<id>",...,"data":"xxx…"}` with
/// `size` bytes of data.
#[derive(Clone)]
pub struct Events {
    data: Arc<str>,
}

impl Events {
    pub fn new(size: usize) -> Self {
        Self {
            data: "x".repeat(size).into(),
        }
    }

    pub fn write(&self, out: &mut Vec<u8>, id: &str) {
        out.extend_from_slice(br#"{"specversion":"1.0","id":""#);
        out.extend_from_slice(id.as_bytes());
        out.extend_from_slice(
            br#"","source":"/meshd-bench","type":"bench.event","datacontenttype":"text/plain","data":""#,
        );
        out.extend_from_slice(self.data.as_bytes());
        out.extend_from_slice(br#""}"#);
    }

    pub fn one(&self, id: &str) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.data.len() + 160);
        self.write(&mut v, id);
        v
    }

    /// The size of one document (ids of this bench are at most a few bytes longer).
    pub fn doc_bytes(&self) -> usize {
        self.one("0-0").len()
    }
}

pub struct Config {
    pub concurrency: usize,
    pub batch: usize,
    pub window: Window,
    pub events: Events,
    pub partitions: u32,
    /// The value of every meta write (scenario 4).
    pub meta_value: Arc<[u8]>,
}

/// A measured run plus the server's peak memory.
pub struct Outcome {
    pub measured: Measured,
    pub peak_rss_bytes: Option<u64>,
}

// ---- meshd -------------------------------------------------------------------------

pub(crate) const TOPIC: &str = "bench";

pub(crate) struct MeshdOp {
    conn: crate::http::Conn,
    events: Events,
    worker: usize,
    seq: u64,
    batch: usize,
    body: Vec<u8>,
    id: String,
}

impl MeshdOp {
    pub(crate) fn new(
        conn: crate::http::Conn,
        events: Events,
        worker: usize,
        batch: usize,
    ) -> Self {
        Self {
            conn,
            events,
            worker,
            seq: 0,
            batch,
            body: Vec::new(),
            id: String::new(),
        }
    }

    /// Events per publish request.
    pub(crate) fn batch(&self) -> usize {
        self.batch
    }

    pub(crate) fn conn(&mut self) -> &mut crate::http::Conn {
        &mut self.conn
    }

    /// One publish request of `batch` events (a batch request when more than one).
    pub(crate) async fn publish(&mut self) -> Result<()> {
        use std::fmt::Write;
        self.body.clear();
        if self.batch > 1 {
            self.body.push(b'[');
        }
        for i in 0..self.batch {
            if i > 0 {
                self.body.push(b',');
            }
            self.id.clear();
            write!(self.id, "{}-{}", self.worker, self.seq)?;
            self.seq += 1;
            self.events.write(&mut self.body, &self.id);
        }
        let ct = if self.batch > 1 {
            self.body.push(b']');
            "application/cloudevents-batch+json"
        } else {
            "application/cloudevents+json"
        };
        let path = format!("/v1/topics/{TOPIC}/events");
        let r = self
            .conn
            .request("POST", &path, Some(ct), &self.body)
            .await?;
        if r.status != 201 {
            bail!(
                "meshd answered {} to a publish: {}",
                r.status,
                String::from_utf8_lossy(&r.body)
            );
        }
        Ok(())
    }
}

impl Op for MeshdOp {
    fn call(&mut self) -> BoxFuture<'_, Result<()>> {
        self.publish().boxed()
    }
}

pub(crate) async fn run_meshd(cfg: &Config, binary: &Path, dedup: bool) -> Result<Outcome> {
    let server = procs::start_meshd(binary)?;
    let addr = server.addr;
    let setup = async {
        meshd_with_topic(addr, cfg.partitions).await?;
        if !dedup {
            meshd_put(
                addr,
                &format!("/v1/topics/{TOPIC}"),
                &format!(r#"{{"partitions":{},"dedup_window_ms":0}}"#, cfg.partitions),
            )
            .await?;
        }
        let mut ops: Vec<Box<dyn Op>> = Vec::new();
        for worker in 0..cfg.concurrency {
            ops.push(Box::new(MeshdOp::new(
                crate::http::Conn::connect(addr).await?,
                cfg.events.clone(),
                worker,
                cfg.batch,
            )));
        }
        anyhow::Ok(ops)
    };
    let ops = with_stderr(&server, setup.await)?;
    measure(&server, ops, cfg).await
}

/// One `GET /healthz` per call over a keep-alive connection.
struct HttpFloorOp {
    conn: crate::http::Conn,
}

impl HttpFloorOp {
    async fn request(&mut self) -> Result<()> {
        let r = self.conn.request("GET", "/healthz", None, &[]).await?;
        if r.status != 200 {
            bail!("meshd answered {} to GET /healthz", r.status);
        }
        Ok(())
    }
}

impl Op for HttpFloorOp {
    fn call(&mut self) -> BoxFuture<'_, Result<()>> {
        self.request().boxed()
    }
}

pub(crate) async fn run_http_floor(cfg: &Config, binary: &Path) -> Result<Outcome> {
    if cfg.batch != 1 {
        bail!("meshd-http-floor runs at batch 1 only");
    }
    let server = procs::start_meshd(binary)?;
    let addr = server.addr;
    let setup = async {
        meshd_ready(addr).await?;
        let mut ops: Vec<Box<dyn Op>> = Vec::new();
        for _ in 0..cfg.concurrency {
            ops.push(Box::new(HttpFloorOp {
                conn: crate::http::Conn::connect(addr).await?,
            }));
        }
        anyhow::Ok(ops)
    };
    let ops = with_stderr(&server, setup.await)?;
    measure(&server, ops, cfg).await
}

/// Waits until meshd's `/readyz` answers 200.
pub async fn meshd_ready(addr: std::net::SocketAddr) -> Result<()> {
    procs::retry(Duration::from_secs(30), || async {
        let mut c = crate::http::Conn::connect(addr).await?;
        let r = c.request("GET", "/readyz", None, b"").await?;
        if r.status != 200 {
            bail!("/readyz {}: {}", r.status, String::from_utf8_lossy(&r.body));
        }
        Ok(())
    })
    .await
}

/// Waits until meshd is ready and creates the bench topic with `partitions`.
pub async fn meshd_with_topic(addr: std::net::SocketAddr, partitions: u32) -> Result<()> {
    meshd_ready(addr).await?;
    meshd_put(
        addr,
        &format!("/v1/topics/{TOPIC}"),
        &format!(r#"{{"partitions":{partitions}}}"#),
    )
    .await
}

/// A `PUT` of a JSON body (a topic, a subscription) that must answer 201 or 200.
pub async fn meshd_put(addr: std::net::SocketAddr, path: &str, body: &str) -> Result<()> {
    let mut c = crate::http::Conn::connect(addr).await?;
    let r = c
        .request("PUT", path, Some("application/json"), body.as_bytes())
        .await?;
    if r.status != 201 && r.status != 200 {
        bail!(
            "PUT {path}: {} {}",
            r.status,
            String::from_utf8_lossy(&r.body)
        );
    }
    Ok(())
}

/// Drives `ops` against `server` for the run's window and adds the server's peak
/// memory.
pub async fn measure(server: &Server, ops: Vec<Box<dyn Op>>, cfg: &Config) -> Result<Outcome> {
    let measured = with_stderr(
        server,
        load::drive_async(ops, cfg.batch as u64, cfg.window, Some(server.pid())).await,
    )?;
    Ok(Outcome {
        measured,
        peak_rss_bytes: Some(procs::peak_rss_bytes(server.pid())?),
    })
}

pub fn with_stderr<T>(server: &Server, r: Result<T>) -> Result<T> {
    r.map_err(|e| {
        anyhow!(
            "{e:#}\n--- server stderr (last lines) ---\n{}",
            server.stderr_tail()
        )
    })
}

// ---- NATS JetStream ------------------------------------------------------------------

const SUBJECT: &str = "bench.events";

/// Publish with ack through the core client: a JetStream publish is a request to a
/// stream's subject, answered by a PubAck once stored (and, with `sync_interval:
/// always`, fsynced). A batch is `batch` such requests awaited together, which is how
/// a JetStream client pipelines; all workers share one connection, as a NATS
/// application would.
pub(crate) struct JsOp {
    pub(crate) client: async_nats::Client,
    pub(crate) events: Events,
    pub(crate) worker: usize,
    pub(crate) seq: u64,
    pub(crate) batch: usize,
    /// A batch is one atomic batch publish (stored whole at its commit, one PubAck)
    /// instead of `batch` publishes awaited together.
    pub(crate) atomic: bool,
}

/// A request to JetStream (an API call, or a publish awaiting its PubAck); an answer
/// carrying `"error":` is an error naming `what`.
pub(crate) async fn js_request(
    client: &async_nats::Client,
    subject: String,
    body: Bytes,
    what: &str,
) -> Result<async_nats::Message> {
    let m = client
        .request(subject, body)
        .await
        .map_err(|e| anyhow!("{what}: {e}"))?;
    if m.payload.windows(8).any(|w| w == b"\"error\":") {
        bail!("{what}: {}", String::from_utf8_lossy(&m.payload));
    }
    Ok(m)
}

async fn js_publish(client: &async_nats::Client, subject: &str, payload: Bytes) -> Result<()> {
    js_request(
        client,
        subject.into(),
        payload,
        "JetStream refused a publish",
    )
    .await
    .map(drop)
}

impl JsOp {
    /// `batch` publishes awaited together, each until its PubAck.
    pub(crate) async fn publish(&mut self) -> Result<()> {
        let mut payloads = Vec::with_capacity(self.batch);
        for _ in 0..self.batch {
            let id = format!("{}-{}", self.worker, self.seq);
            self.seq += 1;
            payloads.push(Bytes::from(self.events.one(&id)));
        }
        if self.atomic {
            let id = format!("bench-{}-{}", self.worker, self.seq);
            js_atomic_batch(&self.client, SUBJECT, payloads, &id).await
        } else {
            let client = &self.client;
            for r in join_all(payloads.into_iter().map(|p| js_publish(client, SUBJECT, p))).await {
                r?;
            }
            Ok(())
        }
    }
}

/// An atomic batch publish (nats-server 2.12+, ADR-50): every message but the last is
/// a plain publish the server stages, the last carries the commit and is answered by
/// one PubAck once the whole batch is stored (fsynced with `sync_interval: always`).
/// The same protocol meshd's JetStream log uses for a batch (`crates/log-nats`).
/// A batch of one is a plain publish. `id` names the batch (unique per batch).
pub(crate) async fn js_atomic_batch(
    client: &async_nats::Client,
    subject: &str,
    mut payloads: Vec<Bytes>,
    id: &str,
) -> Result<()> {
    let n = payloads.len();
    let last = payloads
        .pop()
        .ok_or_else(|| anyhow!("an empty atomic batch"))?;
    if n == 1 {
        return js_publish(client, subject, last).await;
    }
    let headers = |i: usize| {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Batch-Id", id);
        h.insert("Nats-Batch-Sequence", i.to_string().as_str());
        h
    };
    for (i, p) in payloads.into_iter().enumerate() {
        client
            .publish_with_headers(subject.to_string(), headers(i + 1), p)
            .await
            .context("staging an atomic batch message")?;
    }
    let mut h = headers(n);
    h.insert("Nats-Batch-Commit", "1");
    let m = client
        .request_with_headers(subject.to_string(), h, last)
        .await
        .context("committing an atomic batch")?;
    let ack: serde_json::Value =
        serde_json::from_slice(&m.payload).context("the PubAck of an atomic batch")?;
    if ack.get("error").is_some() || ack.get("count").and_then(|c| c.as_u64()) != Some(n as u64) {
        bail!("JetStream refused an atomic batch of {n}: {ack}");
    }
    Ok(())
}

impl Op for JsOp {
    fn call(&mut self) -> BoxFuture<'_, Result<()>> {
        self.publish().boxed()
    }
}

/// Connects to a fresh nats-server and creates the file-storage stream `BENCH` on
/// `bench.events` (retrying while JetStream starts).
pub(crate) async fn js_connect_with_stream(url: &str) -> Result<async_nats::Client> {
    let client = js_connect(url).await?;
    js_create_stream(&client, "BENCH", SUBJECT).await?;
    Ok(client)
}

/// Connects to a nats-server (retrying while it starts).
pub(crate) async fn js_connect(url: &str) -> Result<async_nats::Client> {
    procs::retry(Duration::from_secs(30), || async {
        async_nats::connect(url)
            .await
            .map_err(|e| anyhow!("connecting to {url}: {e}"))
    })
    .await
}

/// Creates the file-storage stream `name` on `subject`, one replica, atomic batches
/// allowed (retrying while JetStream starts).
pub(crate) async fn js_create_stream(
    client: &async_nats::Client,
    name: &str,
    subject: &str,
) -> Result<()> {
    let stream = serde_json::json!({
        "name": name,
        "subjects": [subject],
        "storage": "file",
        "num_replicas": 1,
        "retention": "limits",
        "discard": "old",
        "allow_atomic": true,
    });
    let body = Bytes::from(serde_json::to_vec(&stream)?);
    // JetStream may still be starting: retry until the stream exists.
    procs::retry(Duration::from_secs(30), || {
        js_request(
            client,
            format!("$JS.API.STREAM.CREATE.{name}"),
            body.clone(),
            "creating the stream",
        )
    })
    .await
    .map(drop)
}

pub(crate) async fn run_jetstream(
    cfg: &Config,
    binary: &Path,
    sync: JsSync,
    atomic: bool,
) -> Result<Outcome> {
    let server = procs::start_nats(binary, sync)?;
    let url = format!("nats://{}", server.addr);
    let setup = async {
        let client = js_connect_with_stream(&url).await?;
        let ops: Vec<Box<dyn Op>> = (0..cfg.concurrency)
            .map(|worker| {
                Box::new(JsOp {
                    client: client.clone(),
                    events: cfg.events.clone(),
                    worker,
                    seq: 0,
                    batch: cfg.batch,
                    atomic,
                }) as Box<dyn Op>
            })
            .collect();
        anyhow::Ok((client, ops))
    };
    let (client, ops) = with_stderr(&server, setup.await)?;
    let outcome = measure(&server, ops, cfg).await;
    drop(client);
    outcome
}

// ---- raw RocksDB ---------------------------------------------------------------------

/// The engine ceiling: `concurrency` threads each writing a WriteBatch of `batch`
/// values with `sync=true`, on the options meshd's Local engine opens RocksDB with
/// (`crates/local/src/rocks.rs`: default options, `use_fsync(false)`, so a sync is
/// fdatasync). RocksDB joins concurrent synced writers into one write group with one
/// sync, the same trick as meshd's group commit.
pub(crate) fn run_rocksdb(
    concurrency: usize,
    batch: usize,
    window: Window,
    events: Events,
) -> Result<Measured> {
    let dir = tempfile::Builder::new()
        .prefix("meshd-bench-rocksdb-")
        .tempdir()
        .context("creating a temp dir for RocksDB")?;
    let mut opts = rocksdb::Options::default();
    opts.create_if_missing(true);
    opts.set_use_fsync(false);
    let db = Arc::new(
        rocksdb::DB::open(&opts, dir.path()).map_err(|e| anyhow!("opening RocksDB: {e}"))?,
    );
    let measured = load::drive_threads(concurrency, batch as u64, window, |worker| {
        let db = Arc::clone(&db);
        let events = events.clone();
        let mut seq: u64 = 0;
        let mut wo = rocksdb::WriteOptions::default();
        wo.set_sync(true);
        Box::new(move || {
            let mut wb = rocksdb::WriteBatch::default();
            for _ in 0..batch {
                let mut key = Vec::with_capacity(16);
                key.extend_from_slice(&(worker as u64).to_be_bytes());
                key.extend_from_slice(&seq.to_be_bytes());
                let id = format!("{worker}-{seq}");
                seq += 1;
                wb.put(&key, events.one(&id));
            }
            db.write_opt(wb, &wo)
                .map_err(|e| anyhow!("synced RocksDB write: {e}"))
        })
    })?;
    drop(db);
    Ok(measured)
}
