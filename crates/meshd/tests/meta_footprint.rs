//! Meta's footprint, through the binary against an etcd run with
//! its defaults (no auto-compaction, as the README's cluster example leaves it): meshd
//! compacts the history it creates, one instance at a time, and says so in
//! `/metrics`; `/v1/cluster` shows Meta's size and alarms; and its writes per pull
//! batch do not grow with what is in flight.

mod common;

use common::disk::metric;
use common::{
    ack, bin, client, create_subscription, create_topic, event, ids, publish_batch, pull, set,
    status_and_body,
};
use meshd_test_support::etcd::{EtcdOptions, EtcdProcess};
use meshd_test_support::http::{get, send_json};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::nats::NatsProcess;
use meshd_test_support::proxy::TcpProxy;
use meshd_test_support::wait::wait_until;
use serde_json::json;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_etcd_without_auto_compaction_then_meshd_compacts_the_history_it_creates_to_its_retention(
) {
    let etcd = EtcdProcess::start().await.unwrap();
    let meta = format!("etcd://{}", etcd.endpoint());
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    // Two instances on the one etcd: they take turns, never both in one round.
    let env = [(
        "MESHD_META_COMPACTION_CHECK_MS".to_string(),
        "200".to_string(),
    )];
    let args = [
        "--meta",
        meta.as_str(),
        "--meta-compaction-retention",
        "100",
    ];
    let a = MeshdProcess::start_with_env(bin(), dirs[0].path(), &args, &env)
        .await
        .unwrap();
    let b = MeshdProcess::start_with_env(bin(), dirs[1].path(), &args, &env)
        .await
        .unwrap();
    create_topic(a.addr(), "t", 1).await;
    // 400 writes to Meta: a subscription updated over and over.
    for i in 0..400u32 {
        let r = client(a.addr())
            .put_subscription_answer("s", &json!({"topic": "t", "max_attempts": 3 + (i % 2)}))
            .await;
        let (status, body) = status_and_body(r).unwrap();
        assert!(status == 200 || status == 201, "{body}");
    }
    let revision = metric(a.addr(), "meshd_meta_revision{backend=\"etcd\"}")
        .await
        .expect("meshd_meta_revision") as i64;
    assert!(revision > 400, "{revision}");
    // Compacted to within the retention (a compaction follows once the history is
    // half a retention past the last one): the oldest kept revision is close behind.
    let compacted = wait_until(Duration::from_secs(20), "a compaction", || async {
        let to = metric(a.addr(), "meshd_meta_compacted_revision")
            .await?
            .max(metric(b.addr(), "meshd_meta_compacted_revision").await?);
        anyhow::ensure!(
            to as i64 >= revision - 100 - 50,
            "compacted to {to}, revision {revision}"
        );
        Ok(to as i64)
    })
    .await
    .unwrap();
    // etcd agrees: a read of an old revision is refused as compacted.
    let mut client = etcd.admin_client().await.unwrap();
    let old = client
        .get(
            "meshd",
            Some(etcd_client::GetOptions::new().with_revision(compacted - 1)),
        )
        .await;
    assert!(
        matches!(&old, Err(e) if e.to_string().contains("compacted")),
        "{old:?}"
    );
    // One instance per round: together they compacted about once per half retention,
    // not once per check each.
    let total = metric(a.addr(), "meshd_meta_compactions_total")
        .await
        .unwrap()
        + metric(b.addr(), "meshd_meta_compactions_total")
            .await
            .unwrap();
    assert!((1.0..=9.0).contains(&total), "{total} compactions");
    // `/v1/cluster` shows Meta's size and (no) alarms.
    let c = common::client(a.addr()).cluster().await.unwrap();
    assert!(c["meta"]["db_size_bytes"].as_u64().unwrap() > 0, "{c}");
    // etcd's default quota, read from its /metrics.
    assert_eq!(c["meta"]["quota_bytes"], json!(2u64 << 30), "{c}");
    assert_eq!(c["meta"]["alarms"], json!([]), "{c}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_etcd_raises_its_nospace_alarm_then_readyz_metrics_and_the_cluster_view_name_it_and_writes_answer_503(
) {
    let etcd = EtcdProcess::start_with(EtcdOptions {
        quota_backend_bytes: Some(32 * 1024 * 1024),
        ..EtcdOptions::default()
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let meta = format!("etcd://{}", etcd.endpoint());
    let m = MeshdProcess::start(bin(), dir.path(), &["--meta", meta.as_str()])
        .await
        .unwrap();
    let a = m.addr();
    wait_until(Duration::from_secs(20), "ready", || async {
        anyhow::ensure!(client(a).ready().await?);
        Ok(())
    })
    .await
    .unwrap();
    // Another user of the etcd fills it until etcd refuses writes (NOSPACE).
    let mut client = etcd.admin_client().await.unwrap();
    let value = vec![b'x'; 1024 * 1024];
    let mut filled = false;
    for i in 0..200 {
        if let Err(e) = client.put(format!("other/{i}"), value.clone(), None).await {
            assert!(e.to_string().contains("space exceeded"), "{e}");
            filled = true;
            break;
        }
    }
    assert!(filled, "etcd never refused a write");
    // Named everywhere an operator looks (the probe is cached for a second).
    wait_until(
        Duration::from_secs(10),
        "readyz names the alarm",
        || async {
            let r = get(a, "/readyz").await?;
            anyhow::ensure!(r.status == 503, "{}", r.body);
            let v = r.json()?;
            anyhow::ensure!(v["checks"]["meta:etcd"] == "alarm NOSPACE", "{v}");
            Ok(())
        },
    )
    .await
    .unwrap();
    assert_eq!(
        metric(a, "meshd_meta_alarm{backend=\"etcd\",alarm=\"NOSPACE\"}")
            .await
            .unwrap(),
        1.0
    );
    let c = common::client(a).cluster().await.unwrap();
    assert_eq!(c["meta"]["alarms"], json!(["NOSPACE"]), "{c}");
    // The quota the database ran into, as etcd was started with it.
    assert_eq!(c["meta"]["quota_bytes"], json!(32u64 << 20), "{c}");
    assert_eq!(
        metric(a, "meshd_meta_quota_bytes{backend=\"etcd\"}")
            .await
            .unwrap(),
        (32u64 << 20) as f64
    );
    // A write through meshd is refused as unavailable, naming Meta; nothing stored.
    let r = send_json(a, "PUT", "/v1/topics/t", &json!({"partitions": 1}))
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
}

/// etcd's own count of applied `Txn` requests (every write meshd makes is one).
async fn etcd_txns(etcd: &EtcdProcess) -> f64 {
    let body = get(&etcd.endpoint(), "/metrics").await.unwrap().body;
    body.lines()
        .filter(|l| {
            l.starts_with("grpc_server_handled_total{") && l.contains("grpc_method=\"Txn\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Publishes `n` events as batches of 100.
async fn publish_many(a: &str, topic: &str, from: usize, n: usize) {
    for chunk in (from..from + n).collect::<Vec<_>>().chunks(100) {
        let batch: Vec<serde_json::Value> = chunk.iter().map(|i| event(&format!("e{i}"))).collect();
        publish_batch(a, topic, &batch).await.unwrap();
    }
}

/// What one consumer pattern cost Meta: etcd `Txn` requests and bytes sent to etcd,
/// per pull batch.
#[derive(Debug)]
struct Cost {
    txns_per_batch: f64,
    bytes_per_batch: f64,
}

async fn measure<F, Fut>(etcd: &EtcdProcess, proxy: &TcpProxy, batches: usize, run: F) -> Cost
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (txns, bytes) = (etcd_txns(etcd).await, proxy.bytes_sent());
    run().await;
    let (txns_after, bytes_after) = (etcd_txns(etcd).await, proxy.bytes_sent());
    Cost {
        txns_per_batch: (txns_after - txns) / batches as f64,
        bytes_per_batch: (bytes_after - bytes) as f64 / batches as f64,
    }
}

/// Issue 19, "Done when": both consumer patterns of the issue in cluster mode,
/// against an etcd with its defaults, through a proxy that counts the bytes meshd
/// sends it. Meta's writes per pull batch are one small transaction whether nothing
/// or 500 deliveries are in flight (the old ledger rewrote the whole in-flight map,
/// ~3 KB per batch), the attempt ledger's keys stay bounded, and meshd's compaction
/// keeps etcd's history within its retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_default_etcd_then_meta_writes_per_pull_batch_are_constant_whatever_is_in_flight_and_the_history_stays_bounded(
) {
    let etcd = EtcdProcess::start().await.unwrap();
    let proxy = TcpProxy::start(etcd.endpoint().parse().unwrap())
        .await
        .unwrap();
    let nats = NatsProcess::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let meta = format!("etcd://{}", proxy.addr());
    let env = [(
        "MESHD_META_COMPACTION_CHECK_MS".to_string(),
        "200".to_string(),
    )];
    let nats_url = nats.url();
    let m = MeshdProcess::start_with_env(
        bin(),
        dir.path(),
        &[
            "--meta",
            meta.as_str(),
            "--log",
            nats_url.as_str(),
            "--meta-compaction-retention",
            "500",
        ],
        &env,
    )
    .await
    .unwrap();
    let a = m.addr();
    create_topic(a, "t", 1).await;
    create_subscription(a, "s", json!({"topic": "t", "ack_timeout_ms": 120000})).await;
    wait_until(Duration::from_secs(20), "the partition runs", || async {
        anyhow::ensure!(client(a).ready().await?);
        Ok(())
    })
    .await
    .unwrap();

    // Pattern 1: pull 10, ack 10, nothing else in flight.
    publish_many(a, "t", 0, 1000).await;
    let idle = measure(&etcd, &proxy, 100, || async {
        for _ in 0..100 {
            let ds = pull(a, "s", &json!({"max_events": 10, "wait_ms": 1000}))
                .await
                .unwrap();
            assert_eq!(ds.len(), 10);
            let r = ack(a, "s", &ids(&ds)).await.unwrap();
            assert_eq!(set(&r["acked"]).len(), 10, "{r}");
        }
    })
    .await;

    // Pattern 2: 500 deliveries held in flight, the rest pulled and acked one by one.
    publish_many(a, "t", 1000, 800).await;
    for _ in 0..5 {
        let ds = pull(a, "s", &json!({"max_events": 100, "wait_ms": 1000}))
            .await
            .unwrap();
        assert_eq!(ds.len(), 100);
    }
    let held = measure(&etcd, &proxy, 300, || async {
        for _ in 0..300 {
            let ds = pull(a, "s", &json!({"max_events": 1, "wait_ms": 1000}))
                .await
                .unwrap();
            assert_eq!(ds.len(), 1);
            let r = ack(a, "s", &ids(&ds)).await.unwrap();
            assert_eq!(set(&r["acked"]).len(), 1, "{r}");
        }
    })
    .await;
    eprintln!("Meta per pull batch: nothing held {idle:?}, 500 held {held:?}");
    // One ledger transaction per pull batch (plus checkpoints, prunes and the
    // compactor's claim now and then), with 500 in flight as with none.
    for cost in [&idle, &held] {
        assert!(
            (0.9..=1.5).contains(&cost.txns_per_batch),
            "{cost:?}: not one Meta write per pull batch"
        );
    }
    // The bytes follow the batch, not what is in flight: the held pattern's batches
    // (one event) cost no more than the idle pattern's (ten events). The old ledger
    // sent the whole 500-entry map each time (~7 KB).
    assert!(
        held.bytes_per_batch <= idle.bytes_per_batch * 1.5 && held.bytes_per_batch < 1500.0,
        "bytes per batch grew with what is in flight: idle {idle:?}, held {held:?}"
    );
    // The ledger's keys: the held ones' five records and the head, nothing of the
    // 1300 acked deliveries. An acked delivery leaves the ledger once a checkpoint
    // carries it (every `--checkpoint-ms`, 1 s here, also while a gap holds the
    // committed offset), and its record is pruned by the next writes (at most 32 per
    // write; a checkpoint tick with nothing new still prunes): within a few intervals.
    let client = etcd.admin_client().await.unwrap();
    wait_until(
        Duration::from_secs(15),
        "the acked deliveries' records pruned",
        || async {
            let keys = client
                .clone()
                .get(
                    "meshd/v1/attempts/",
                    Some(
                        etcd_client::GetOptions::new()
                            .with_prefix()
                            .with_keys_only(),
                    ),
                )
                .await?;
            anyhow::ensure!(
                keys.kvs().len() <= 8,
                "{} attempt-ledger keys",
                keys.kvs().len()
            );
            Ok(())
        },
    )
    .await
    .unwrap();
    // The history stays bounded: meshd compacts to its retention.
    wait_until(
        Duration::from_secs(20),
        "a compaction to the retention",
        || async {
            let revision = metric(a, "meshd_meta_revision{backend=\"etcd\"}").await?;
            let compacted = metric(a, "meshd_meta_compacted_revision").await?;
            anyhow::ensure!(
                revision - compacted <= 500.0 + 250.0 + 100.0,
                "revision {revision}, compacted to {compacted}"
            );
            Ok(())
        },
    )
    .await
    .unwrap();
}
