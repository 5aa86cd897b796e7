//! Scenario 2, end to end: publish → pull → ack, with durable delivery state.
//!
//! Every worker runs one closed loop: publish `batch` events (and wait until the
//! publish is acknowledged), pull up to `batch` events from the one subscription, ack
//! what it got (and wait until the acks are confirmed). The events that count are the
//! ones acked inside the window; latency is one whole cycle. Workers share the
//! subscription, so a pull may hand a worker events another one published: the
//! throughput is of the pipeline, not of any worker's own events.
//!
//! meshd: `POST /v1/topics/bench/events`, `POST /v1/subscriptions/bench-e2e/pull`
//! (`max_events` = batch, `wait_ms` 100: a pull whose events were taken by another
//! worker waits for the next append instead of spinning), `POST .../ack`.
//!
//! Through streams (issue "Streaming consume"): each meshd worker holds an SSE stream
//! (`max_in_flight` = batch, so a worker holds at most what a pull of its would) and
//! acks over POST what one step of its stream brought; each JetStream worker is a
//! member of the deliver group of one durable push consumer (explicit acks, AckSync)
//! and acks what arrived.
//!
//! JetStream: a batch is published as one atomic batch (one PubAck); a durable pull
//! consumer with explicit acks; the fetch is a
//! `$JS.API.CONSUMER.MSG.NEXT` request for `batch` messages with `no_wait` (answered by
//! the messages there are, then a status), each message acked with an ack that waits
//! for the server's reply (AckSync, what a client does when the ack must be known to
//! have landed). Its workers share one connection, as a NATS application's do (the
//! client multiplexes them, so one socket read or write carries several workers'
//! messages); `jetstream-conns-e2e` gives each its own, as every meshd worker has.

use crate::load::Op;
use crate::procs::{self, JsSync};
use crate::systems::{
    js_connect_with_stream, js_request, measure, meshd_put, meshd_with_topic, with_stderr, Config,
    JsOp, MeshdOp, Outcome, TOPIC,
};
use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use futures::future::{join_all, BoxFuture};
use futures::{FutureExt, StreamExt};
use std::path::Path;
use std::time::Duration;

const SUBSCRIPTION: &str = "bench-e2e";
const CONSUMER: &str = "E2E";
/// How long a meshd pull waits for an event when none is there yet.
const PULL_WAIT_MS: u64 = 100;
const PULL_WAIT: Duration = Duration::from_millis(PULL_WAIT_MS);
/// How long a JetStream fetch may take before the bench calls it stuck.
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Unacked deliveries allowed per subscription (meshd's `--max-in-flight`, JetStream's
/// `max_ack_pending`, whose default of 1000 stalls a fetch at 16 workers × 100): both
/// get the same cap, above what the largest configuration holds at once.
const MAX_IN_FLIGHT: u64 = 10_000;

/// [`Op`] for the end-to-end workers: a call is one `cycle`, and it completed the
/// events its ack confirmed (`acked`).
macro_rules! cycle_ops {
    ($($worker:ty),+) => {$(
        impl Op for $worker {
            fn call(&mut self) -> BoxFuture<'_, Result<()>> {
                self.cycle().boxed()
            }

            fn completed(&self) -> Option<u64> {
                Some(self.acked)
            }
        }
    )+};
}

cycle_ops!(MeshdE2e, MeshdStreamE2e, MeshdWsE2e, JsE2e, JsPushE2e);

pub const MESHD_DURABILITY: &str = "publish fsynced before 201; attempt fsynced before hand-out; ack durable within 100 ms (flush interval)";

pub fn js_durability(sync: JsSync) -> &'static str {
    match sync {
        JsSync::Always => {
            "publish fsynced (sync_interval: always), a batch as one atomic batch; AckSync"
        }
        JsSync::Default => {
            "relaxed: fsync every 2 min (default sync_interval), a batch as one atomic batch; AckSync"
        }
    }
}

// ---- meshd -------------------------------------------------------------------------

struct MeshdE2e {
    publish: MeshdOp,
    pull_body: Vec<u8>,
    acked: u64,
}

/// The delivery ids of a pull answer.
fn delivery_ids(v: &serde_json::Value) -> Result<Vec<String>> {
    deliveries(v)?
        .iter()
        .map(|d| {
            d.get("delivery_id")
                .and_then(|i| i.as_str())
                .map(str::to_owned)
                .ok_or_else(|| anyhow!("a delivery without delivery_id: {d}"))
        })
        .collect()
}

/// The deliveries of a pull answer.
pub fn deliveries(v: &serde_json::Value) -> Result<&Vec<serde_json::Value>> {
    v.get("deliveries")
        .and_then(|d| d.as_array())
        .ok_or_else(|| anyhow!("a pull answer without deliveries: {v}"))
}

/// Acks `ids` over POST on the worker's connection; how many were acked (all of
/// them, or an error: a bench worker acks within the lease).
async fn ack_over_post(publish: &mut MeshdOp, ids: &[String]) -> Result<u64> {
    let body = serde_json::to_vec(&serde_json::json!({ "delivery_ids": ids }))?;
    let ack = format!("/v1/subscriptions/{SUBSCRIPTION}/ack");
    let v = publish.conn().post_json(&ack, &body, "an ack").await?;
    acked_all(&v, ids.len())
}

/// The `acked` count of an ack answer (over POST or in band), which must be all
/// `sent` ids.
fn acked_all(answer: &serde_json::Value, sent: usize) -> Result<u64> {
    let acked = answer
        .get("acked")
        .and_then(|a| a.as_array())
        .map(|a| a.len())
        .ok_or_else(|| anyhow!("an ack answer without acked: {answer}"))?;
    if acked != sent {
        bail!("meshd acked {acked} of {sent} deliveries (a bench worker acks within the lease): {answer}");
    }
    Ok(acked as u64)
}

/// Acks JetStream messages by their reply subjects, each waiting for the server's
/// reply (AckSync), all at once.
async fn ack_sync(client: &async_nats::Client, replies: &[async_nats::Subject]) -> Result<()> {
    let acks = join_all(replies.iter().map(|reply| async move {
        client
            .request(reply.clone(), Bytes::from_static(b"+ACK"))
            .await
            .context("AckSync")
    }))
    .await;
    for a in acks {
        a?;
    }
    Ok(())
}

impl MeshdE2e {
    async fn cycle(&mut self) -> Result<()> {
        self.acked = 0;
        self.publish.publish().await?;
        let pull = format!("/v1/subscriptions/{SUBSCRIPTION}/pull");
        let answer = self
            .publish
            .conn()
            .post_json(&pull, &self.pull_body, "a pull")
            .await?;
        let ids = delivery_ids(&answer)?;
        if ids.is_empty() {
            return Ok(());
        }
        self.acked = ack_over_post(&mut self.publish, &ids).await?;
        Ok(())
    }
}

/// An end-to-end run on meshd: starts it (the subscription's in-flight cap as
/// JetStream's), creates the topic and the subscription, gives each worker its
/// publishing connection and what `worker` builds around it, and measures.
async fn meshd_run<W, F>(cfg: &Config, binary: &Path, mut worker: W) -> Result<Outcome>
where
    W: FnMut(std::net::SocketAddr, MeshdOp) -> F,
    F: std::future::Future<Output = Result<Box<dyn Op>>>,
{
    let server = procs::start_meshd_with(
        binary,
        &["--max-in-flight".to_string(), MAX_IN_FLIGHT.to_string()],
    )?;
    let addr = server.addr;
    let setup = async {
        meshd_with_topic(addr, cfg.partitions).await?;
        meshd_put(
            addr,
            &format!("/v1/subscriptions/{SUBSCRIPTION}"),
            &format!(r#"{{"topic":"{TOPIC}","ack_timeout_ms":60000}}"#),
        )
        .await?;
        let mut ops: Vec<Box<dyn Op>> = Vec::new();
        for w in 0..cfg.concurrency {
            let conn = crate::http::Conn::connect(addr).await?;
            let publish = MeshdOp::new(conn, cfg.events.clone(), w, cfg.batch);
            ops.push(worker(addr, publish).await?);
        }
        anyhow::Ok(ops)
    };
    let ops = with_stderr(&server, setup.await)?;
    measure(&server, ops, cfg).await
}

pub async fn run_meshd(cfg: &Config, binary: &Path) -> Result<Outcome> {
    let pull_body =
        format!(r#"{{"max_events":{},"wait_ms":{PULL_WAIT_MS}}}"#, cfg.batch).into_bytes();
    meshd_run(cfg, binary, |_, publish| {
        let pull_body = pull_body.clone();
        async move {
            let op: Box<dyn Op> = Box::new(MeshdE2e {
                publish,
                pull_body,
                acked: 0,
            });
            Ok(op)
        }
    })
    .await
}

// ---- meshd, streaming ----------------------------------------------------------------

pub const MESHD_STREAM_DURABILITY: &str =
    "as meshd-e2e (a stream's hand-out is a pull's); SSE stream, acks over POST";

struct MeshdStreamE2e {
    publish: MeshdOp,
    stream: meshd_client::EventStream,
    acked: u64,
}

impl MeshdStreamE2e {
    async fn cycle(&mut self) -> Result<()> {
        self.acked = 0;
        self.publish.publish().await?;
        // Up to a batch from the stream, as a pull takes up to `max_events`: what
        // arrived, and what arrives within PULL_WAIT_MS of the start of this read
        // (this worker's events may have gone to another worker's stream, one that
        // has stopped at the end of a run: then it acks what it has).
        let until = tokio::time::Instant::now() + PULL_WAIT;
        let batch = self.publish.batch();
        let mut ids = Vec::with_capacity(batch);
        while ids.len() < batch {
            let Ok(d) = tokio::time::timeout_at(until, self.stream.next()).await else {
                break;
            };
            let d = d?.ok_or_else(|| anyhow!("the meshd stream ended"))?;
            ids.push(d.delivery_id);
            ids.extend(self.stream.buffered()?.into_iter().map(|d| d.delivery_id));
        }
        if ids.is_empty() {
            return Ok(());
        }
        self.acked = ack_over_post(&mut self.publish, &ids).await?;
        Ok(())
    }
}

pub async fn run_meshd_stream(cfg: &Config, binary: &Path) -> Result<Outcome> {
    let options = meshd_client::StreamOptions {
        max_in_flight: Some(cfg.batch as u32),
        session: None,
    };
    meshd_run(cfg, binary, |addr, publish| {
        let options = options.clone();
        async move {
            let client = meshd_client::Client::connect(&format!("http://{addr}"))?;
            let op: Box<dyn Op> = Box::new(MeshdStreamE2e {
                publish,
                stream: client.stream(SUBSCRIPTION, &options).await?,
                acked: 0,
            });
            Ok(op)
        }
    })
    .await
}

// ---- meshd, WebSocket with in-band acks ---------------------------------------------------

pub const MESHD_WS_DURABILITY: &str =
    "as meshd-e2e (a stream's hand-out is a pull's); WebSocket stream, acks in band";

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

struct MeshdWsE2e {
    publish: MeshdOp,
    ws: Ws,
    /// Deliveries that arrived while this worker waited for an ack's answer.
    held: Vec<String>,
    seq: u64,
    acked: u64,
}

/// A server frame: deliveries, or the answer to the ack with `ref`.
fn ws_frame(text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).with_context(|| format!("a WebSocket frame: {text}"))
}

impl MeshdWsE2e {
    async fn next_frame(
        &mut self,
        until: tokio::time::Instant,
    ) -> Result<Option<serde_json::Value>> {
        use tokio_tungstenite::tungstenite::Message;
        loop {
            let Ok(m) = tokio::time::timeout_at(until, self.ws.next()).await else {
                return Ok(None);
            };
            match m.ok_or_else(|| anyhow!("the WebSocket closed"))?? {
                Message::Text(t) => return ws_frame(&t).map(Some),
                Message::Ping(_) | Message::Pong(_) => continue,
                other => bail!("an unexpected WebSocket frame: {other:?}"),
            }
        }
    }

    fn take_deliveries(&mut self, frame: &serde_json::Value) -> Result<()> {
        let ids = delivery_ids(frame)?;
        self.held.extend(ids);
        Ok(())
    }

    async fn cycle(&mut self) -> Result<()> {
        use futures::SinkExt;
        use tokio_tungstenite::tungstenite::Message;
        self.acked = 0;
        self.publish.publish().await?;
        // Up to a batch, within the pull's 100 ms wait (see the SSE worker).
        let until = tokio::time::Instant::now() + PULL_WAIT;
        let batch = self.publish.batch();
        while self.held.len() < batch {
            let Some(f) = self.next_frame(until).await? else {
                break;
            };
            self.take_deliveries(&f)?;
        }
        if self.held.is_empty() {
            return Ok(());
        }
        let ids = std::mem::take(&mut self.held);
        self.seq += 1;
        let reference = self.seq;
        let frame = serde_json::json!({ "ref": reference, "ack": ids }).to_string();
        self.ws.send(Message::Text(frame.into())).await?;
        // The answer; deliveries that come first are kept for the next cycle.
        let deadline = tokio::time::Instant::now() + FETCH_TIMEOUT;
        let answer = loop {
            let f = self
                .next_frame(deadline)
                .await?
                .ok_or_else(|| anyhow!("no answer to an in-band ack in {FETCH_TIMEOUT:?}"))?;
            if f.get("ref").and_then(|r| r.as_u64()) == Some(reference) {
                break f;
            }
            self.take_deliveries(&f)?;
        };
        self.acked = acked_all(&answer, ids.len())?;
        Ok(())
    }
}

pub async fn run_meshd_ws(cfg: &Config, binary: &Path) -> Result<Outcome> {
    use futures::SinkExt;
    use tokio_tungstenite::tungstenite::Message;
    let batch = cfg.batch;
    meshd_run(cfg, binary, |addr, publish| async move {
        let url =
            format!("ws://{addr}/v1/subscriptions/{SUBSCRIPTION}/stream?max_in_flight={batch}");
        let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str())
            .await
            .context("opening a WebSocket stream")?;
        // Credit enough for the run: max_in_flight is the bound that matters.
        ws.send(Message::Text(r#"{"credit":10000000}"#.into()))
            .await?;
        let op: Box<dyn Op> = Box::new(MeshdWsE2e {
            publish,
            ws,
            held: Vec::new(),
            seq: 0,
            acked: 0,
        });
        Ok(op)
    })
    .await
}

// ---- JetStream -----------------------------------------------------------------------

struct JsE2e {
    publish: JsOp,
    inbox: async_nats::Subject,
    messages: async_nats::Subscriber,
    next_body: Bytes,
    acked: u64,
}

impl JsE2e {
    async fn cycle(&mut self) -> Result<()> {
        self.acked = 0;
        self.publish.publish().await?;
        let client = self.publish.client.clone();
        client
            .publish_with_reply(
                format!("$JS.API.CONSUMER.MSG.NEXT.BENCH.{CONSUMER}"),
                self.inbox.clone(),
                self.next_body.clone(),
            )
            .await
            .context("requesting messages from the consumer")?;
        let mut replies = Vec::with_capacity(self.publish.batch);
        // The messages there are (at most `batch`), then a status message (404 no
        // messages / 408 request expired) once fewer than `batch` were there.
        while replies.len() < self.publish.batch {
            let m = tokio::time::timeout(FETCH_TIMEOUT, self.messages.next())
                .await
                .map_err(|_| anyhow!("a JetStream fetch got no answer in {FETCH_TIMEOUT:?}"))?
                .ok_or_else(|| anyhow!("the fetch inbox subscription ended"))?;
            if m.status.is_some() {
                break;
            }
            let reply = m
                .reply
                .ok_or_else(|| anyhow!("a consumer message without an ack subject"))?;
            replies.push(reply);
        }
        ack_sync(&client, &replies).await?;
        self.acked = replies.len() as u64;
        Ok(())
    }
}

pub const JS_CONNS_DURABILITY: &str =
    "as jetstream-e2e (sync_interval: always, AckSync); each worker on a connection of its own";

/// The pull-consumer run; `conn_per_worker` gives each worker a connection of its own
/// (otherwise all share one, as a NATS application's workers usually do).
pub async fn run_jetstream(
    cfg: &Config,
    binary: &Path,
    sync: JsSync,
    conn_per_worker: bool,
) -> Result<Outcome> {
    let server = procs::start_nats(binary, sync)?;
    let url = format!("nats://{}", server.addr);
    let setup = async {
        let client = js_connect_with_stream(&url).await?;
        // A durable pull consumer with explicit acks; 60 s ack wait as meshd's lease.
        let consumer = serde_json::json!({
            "stream_name": "BENCH",
            "config": {
                "durable_name": CONSUMER,
                "ack_policy": "explicit",
                "deliver_policy": "all",
                "ack_wait": 60_000_000_000u64,
                "max_ack_pending": MAX_IN_FLIGHT,
            },
        });
        js_request(
            &client,
            format!("$JS.API.CONSUMER.CREATE.BENCH.{CONSUMER}"),
            Bytes::from(serde_json::to_vec(&consumer)?),
            "creating the consumer",
        )
        .await?;
        let next_body = Bytes::from(serde_json::to_vec(
            &serde_json::json!({ "batch": cfg.batch, "no_wait": true }),
        )?);
        let mut ops: Vec<Box<dyn Op>> = Vec::new();
        for worker in 0..cfg.concurrency {
            let client = if conn_per_worker {
                crate::systems::js_connect(&url).await?
            } else {
                client.clone()
            };
            let inbox = client.new_inbox();
            let messages = client
                .subscribe(inbox.clone())
                .await
                .map_err(|e| anyhow!("subscribing to a fetch inbox: {e}"))?;
            ops.push(Box::new(JsE2e {
                publish: JsOp {
                    client: client.clone(),
                    events: cfg.events.clone(),
                    worker,
                    seq: 0,
                    batch: cfg.batch,
                    // A batch is one atomic batch publish: JetStream's own
                    // counterpart of meshd's batch request.
                    atomic: true,
                },
                inbox: async_nats::Subject::from(inbox),
                messages,
                next_body: next_body.clone(),
                acked: 0,
            }));
        }
        anyhow::Ok((client, ops))
    };
    let (client, ops) = with_stderr(&server, setup.await)?;
    let outcome = measure(&server, ops, cfg).await;
    drop(client);
    outcome
}

// ---- JetStream, push consumer -----------------------------------------------------------

pub const JS_PUSH_DURABILITY: &str =
    "publish fsynced (sync_interval: always), a batch as one atomic batch; push consumer, AckSync";

const PUSH_CONSUMER: &str = "PUSH";
const PUSH_SUBJECT: &str = "bench.push";
const PUSH_GROUP: &str = "workers";

struct JsPushE2e {
    publish: JsOp,
    messages: async_nats::Subscriber,
    acked: u64,
}

impl JsPushE2e {
    async fn cycle(&mut self) -> Result<()> {
        self.acked = 0;
        self.publish.publish().await?;
        // As for meshd's stream: up to a batch, what arrived and what arrives within
        // PULL_WAIT_MS.
        let until = tokio::time::Instant::now() + PULL_WAIT;
        let mut replies = Vec::with_capacity(self.publish.batch);
        // Flow-control and heartbeat messages carry a status and no ack subject.
        let ack_subject = |m: async_nats::Message| m.status.is_none().then_some(m.reply).flatten();
        while replies.len() < self.publish.batch {
            let m = match self.messages.next().now_or_never() {
                Some(m) => m,
                None => match tokio::time::timeout_at(until, self.messages.next()).await {
                    Ok(m) => m,
                    Err(_) => break,
                },
            };
            replies.extend(ack_subject(
                m.ok_or_else(|| anyhow!("the push subscription ended"))?,
            ));
        }
        ack_sync(&self.publish.client, &replies).await?;
        self.acked = replies.len() as u64;
        Ok(())
    }
}

pub async fn run_jetstream_push(cfg: &Config, binary: &Path) -> Result<Outcome> {
    let server = procs::start_nats(binary, JsSync::Always)?;
    let url = format!("nats://{}", server.addr);
    let setup = async {
        let client = js_connect_with_stream(&url).await?;
        let mut ops: Vec<Box<dyn Op>> = Vec::new();
        let mut subs = Vec::new();
        for _ in 0..cfg.concurrency {
            subs.push(
                client
                    .queue_subscribe(PUSH_SUBJECT, PUSH_GROUP.into())
                    .await
                    .map_err(|e| anyhow!("subscribing to the push subject: {e}"))?,
            );
        }
        // A durable push consumer delivering to the workers' queue group, explicit
        // acks, the same ack wait and in-flight cap as the pull consumer.
        let consumer = serde_json::json!({
            "stream_name": "BENCH",
            "config": {
                "durable_name": PUSH_CONSUMER,
                "deliver_subject": PUSH_SUBJECT,
                "deliver_group": PUSH_GROUP,
                "ack_policy": "explicit",
                "deliver_policy": "all",
                "ack_wait": 60_000_000_000u64,
                "max_ack_pending": MAX_IN_FLIGHT,
            },
        });
        js_request(
            &client,
            format!("$JS.API.CONSUMER.CREATE.BENCH.{PUSH_CONSUMER}"),
            Bytes::from(serde_json::to_vec(&consumer)?),
            "creating the push consumer",
        )
        .await?;
        for (worker, messages) in subs.into_iter().enumerate() {
            ops.push(Box::new(JsPushE2e {
                publish: JsOp {
                    client: client.clone(),
                    events: cfg.events.clone(),
                    worker,
                    seq: 0,
                    batch: cfg.batch,
                    atomic: true,
                },
                messages,
                acked: 0,
            }));
        }
        anyhow::Ok((client, ops))
    };
    let (client, ops) = with_stderr(&server, setup.await)?;
    let outcome = measure(&server, ops, cfg).await;
    drop(client);
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_ids_of_a_pull_answer() {
        let json = |b: &str| serde_json::from_str::<serde_json::Value>(b).unwrap();
        let body = json(
            r#"{"deliveries":[{"delivery_id":"a","partition":0,"offset":1,"attempt":1,"event":{}},{"delivery_id":"b"}]}"#,
        );
        assert_eq!(delivery_ids(&body).unwrap(), vec!["a", "b"]);
        assert!(delivery_ids(&json(r#"{"deliveries":[]}"#))
            .unwrap()
            .is_empty());
        assert!(delivery_ids(&json(r#"{"nope":1}"#)).is_err());
        assert!(delivery_ids(&json(r#"{"deliveries":[{"id":"x"}]}"#)).is_err());
    }
}
