//! Scenario 6 (c) and (d): what the state plane costs Meta, and what a move costs
//! consumers.
//!
//! (c) **Meta per delivered event**: one meshd instance in cluster mode, a topic of one
//! partition, and the two consumer patterns that matter: "pull 10, ack 10, nothing else
//! in flight" and "500 deliveries held in flight, the rest pulled and acked one by
//! one". For each, etcd's own counters before and after: `Txn` requests handled
//! (`grpc_server_handled_total{grpc_method="Txn"}`: every write meshd makes is one) and
//! bytes received from gRPC clients (`etcd_network_client_grpc_received_bytes_total`),
//! per delivered event and per pull batch.
//!
//! (d) **Duplicates per move**: N instances, a topic of `--cluster-partitions`
//! partitions, events published up front; a consumer pulls from every live instance and
//! acks at once. A third of the way through, the instance owning the most partitions
//! is SIGSTOPped past its lease (its partitions move) and resumed (sticky moves keep
//! them where they went); two thirds through, the owner of the most partitions is
//! SIGKILLed. Every delivery of an event already delivered is a duplicate; the report
//! gives them per move.

use super::{call, call_json, Cluster, Delivery, DEADLINE, SUBSCRIPTION, TOPIC};
use anyhow::{anyhow, ensure, Result};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

#[derive(Serialize, Clone, Debug)]
pub struct FootprintRun {
    pub pattern: &'static str,
    pub delivered: u64,
    pub pull_batches: u64,
    pub etcd_txns: f64,
    pub etcd_bytes: f64,
    pub txns_per_event: f64,
    pub bytes_per_event: f64,
    pub txns_per_batch: f64,
    pub bytes_per_batch: f64,
}

#[derive(Serialize, Clone, Debug)]
pub struct MovesRun {
    pub events: usize,
    pub deliveries: usize,
    pub moves: usize,
    /// Partitions that changed owner over both moves.
    pub moved_partitions: usize,
    pub duplicates: usize,
    pub duplicates_per_move: f64,
}

/// etcd's counters: (`Txn` requests handled, bytes received from gRPC clients).
async fn etcd_counters(etcd: SocketAddr) -> Result<(f64, f64)> {
    let (status, body) = call(etcd, "GET", "/metrics", None, b"").await?;
    ensure!(status == 200, "etcd /metrics answered {status}");
    let text = String::from_utf8_lossy(&body);
    let value = |l: &str| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
    let mut txns = 0.0;
    let mut bytes = 0.0;
    for l in text.lines() {
        if l.starts_with("grpc_server_handled_total{") && l.contains("grpc_method=\"Txn\"") {
            txns += value(l).unwrap_or(0.0);
        } else if l.starts_with("etcd_network_client_grpc_received_bytes_total") {
            bytes += value(l).unwrap_or(0.0);
        }
    }
    Ok((txns, bytes))
}

fn event(i: usize) -> Value {
    json!({
        "specversion": "1.0",
        "id": format!("fp-{i}"),
        "source": "/meshd-bench",
        "type": "bench.footprint",
        "datacontenttype": "text/plain",
        "data": "x",
    })
}

async fn publish_range(addr: SocketAddr, from: usize, n: usize) -> Result<()> {
    let all: Vec<usize> = (from..from + n).collect();
    for chunk in all.chunks(100) {
        super::publish_batch(addr, chunk.iter().map(|i| event(*i)).collect()).await?;
    }
    Ok(())
}

async fn pull_n(addr: SocketAddr, n: usize) -> Result<Vec<Delivery>> {
    super::pull_with(addr, &json!({"max_events": n, "wait_ms": 1000})).await
}

async fn setup(addr: SocketAddr, partitions: u32, ack_timeout_ms: u64) -> Result<()> {
    crate::systems::meshd_put(
        addr,
        &format!("/v1/topics/{TOPIC}"),
        &json!({ "partitions": partitions }).to_string(),
    )
    .await?;
    call_json(
        addr,
        "PUT",
        &format!("/v1/subscriptions/{SUBSCRIPTION}"),
        "application/json",
        &json!({"topic": TOPIC, "ack_timeout_ms": ack_timeout_ms}),
        &[200, 201],
    )
    .await?;
    Ok(())
}

/// (c): both patterns on one fresh single-instance cluster; `cycles` pull batches each.
pub async fn footprint(
    bins: &super::Binaries<'_>,
    lease_ttl_ms: u64,
    cycles: usize,
) -> Result<Vec<FootprintRun>> {
    let c = Cluster::start(1, bins, lease_ttl_ms).await?;
    let r = footprint_on(&c, cycles).await;
    r.map_err(|e| c.with_logs(e))
}

async fn footprint_on(c: &Cluster, cycles: usize) -> Result<Vec<FootprintRun>> {
    let a = c.addr(0)?;
    let etcd = c.etcd.addr;
    setup(a, 1, 600_000).await?;
    let mut out = Vec::new();
    // Pattern 1: pull 10, ack 10.
    publish_range(a, 0, cycles * 10).await?;
    let before = etcd_counters(etcd).await?;
    let mut delivered = 0u64;
    for _ in 0..cycles {
        let ds = pull_n(a, 10).await?;
        ensure!(!ds.is_empty(), "nothing to pull");
        delivered += ds.len() as u64;
        super::ack(a, &ds).await?;
    }
    let after = etcd_counters(etcd).await?;
    out.push(run(
        "pull 10, ack 10",
        delivered,
        cycles as u64,
        before,
        after,
    ));
    // Pattern 2: 500 held, the rest one by one.
    publish_range(a, cycles * 10, 500 + cycles).await?;
    let mut held = 0;
    while held < 500 {
        let ds = pull_n(a, 100).await?;
        ensure!(!ds.is_empty(), "nothing to pull");
        held += ds.len();
    }
    let before = etcd_counters(etcd).await?;
    let mut delivered = 0u64;
    for _ in 0..cycles {
        let ds = pull_n(a, 1).await?;
        ensure!(ds.len() == 1, "expected one delivery");
        delivered += 1;
        super::ack(a, &ds).await?;
    }
    let after = etcd_counters(etcd).await?;
    out.push(run(
        "500 held, pull 1, ack 1",
        delivered,
        cycles as u64,
        before,
        after,
    ));
    Ok(out)
}

fn run(
    pattern: &'static str,
    delivered: u64,
    batches: u64,
    before: (f64, f64),
    after: (f64, f64),
) -> FootprintRun {
    let txns = after.0 - before.0;
    let bytes = after.1 - before.1;
    FootprintRun {
        pattern,
        delivered,
        pull_batches: batches,
        etcd_txns: txns,
        etcd_bytes: bytes,
        txns_per_event: txns / delivered.max(1) as f64,
        bytes_per_event: bytes / delivered.max(1) as f64,
        txns_per_batch: txns / batches.max(1) as f64,
        bytes_per_batch: bytes / batches.max(1) as f64,
    }
}

/// (d): duplicates per move.
pub async fn moves(
    bins: &super::Binaries<'_>,
    instances: usize,
    partitions: u32,
    lease_ttl_ms: u64,
    events: usize,
) -> Result<MovesRun> {
    let mut c = Cluster::start(instances, bins, lease_ttl_ms).await?;
    let r = moves_on(&mut c, instances, partitions, lease_ttl_ms, events).await;
    r.map_err(|e| c.with_logs(e))
}

async fn moves_on(
    c: &mut Cluster,
    n: usize,
    partitions: u32,
    lease_ttl_ms: u64,
    events: usize,
) -> Result<MovesRun> {
    let a0 = c.addr(0)?;
    // Leases long enough that nothing runs out while the consumer keeps up.
    setup(a0, partitions, 10_000).await?;
    super::settle(a0, n, partitions).await?;
    // Members that joined after the first take their share after the rebalance delay
    // (3 lease TTLs): let that happen before measuring.
    tokio::time::sleep(Duration::from_millis(lease_ttl_ms * 3 + 1000)).await;
    super::settle(a0, n, partitions).await?;
    publish_range(a0, 0, events).await?;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut deliveries = 0usize;
    let mut moved = std::collections::BTreeSet::new();
    let mut moves = 0;
    let start = Instant::now();
    let mut quiet_since: Option<Instant> = None;
    let ttl = Duration::from_millis(lease_ttl_ms);
    loop {
        ensure!(
            start.elapsed() < DEADLINE * 4,
            "the consumer did not finish: {} of {events} seen",
            seen.len()
        );
        let mut got = 0;
        for i in c.live() {
            let addr = c.addr(i)?;
            let Ok(ds) = super::pull_with(addr, &json!({"max_events": 100, "wait_ms": 0})).await
            else {
                continue;
            };
            got += ds.len();
            for d in &ds {
                *seen.entry(d.event_id.clone()).or_insert(0) += 1;
            }
            deliveries += ds.len();
            let _ = super::ack(addr, &ds).await;
        }
        // The moves.
        let want = match moves {
            0 => events / 3,
            1 => 2 * events / 3,
            _ => usize::MAX,
        };
        if seen.len() >= want {
            let view = super::view(c.addr(c.live()[0])?).await?;
            let mut count: BTreeMap<String, Vec<u32>> = BTreeMap::new();
            for (p, owner) in &view.owners {
                if let Some((o, _)) = owner {
                    count.entry(o.clone()).or_default().push(*p);
                }
            }
            let (victim, parts) = count
                .into_iter()
                .max_by_key(|(_, ps)| ps.len())
                .ok_or_else(|| anyhow!("no owners"))?;
            let idx = c
                .ids
                .iter()
                .position(|x| *x == victim)
                .ok_or_else(|| anyhow!("unknown owner {victim}"))?;
            moved.extend(parts.iter().copied());
            if moves == 0 {
                c.pause(idx)?;
                tokio::time::sleep(ttl * 2).await;
                c.resume(idx)?;
            } else {
                c.kill(idx)?;
            }
            moves += 1;
        }
        if got == 0 && seen.len() == events && moves >= 2 {
            // Leases of what a dead or paused owner held run out (10 s), then quiet.
            let since = *quiet_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(12) {
                break;
            }
        } else if got > 0 {
            quiet_since = None;
        }
        if got == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let duplicates = deliveries - seen.len();
    Ok(MovesRun {
        events,
        deliveries,
        moves,
        moved_partitions: moved.len(),
        duplicates,
        duplicates_per_move: duplicates as f64 / moves.max(1) as f64,
    })
}
