//! A partition's attempt ledger stays loadable through a redelivery storm behind
//! stragglers (two meshd on one etcd and nats-server). Every round a consumer pulls
//! what is due, keeps one delivery (its lease runs on) and nacks the rest for an
//! immediate retry: each round re-records nearly every offset in new records while
//! the kept one stays current in an old record. Without compaction every such record
//! stayed in etcd for its straggler, and past the load cap a new owner's takeover
//! failed on every try. With it, what etcd holds stays within about twice the current
//! entries, and after a SIGKILL of the owner the other instance takes the partition
//! over with every delivery in flight and honours the acks of the current attempts.

mod common;

use common::*;
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::time::Duration;

const EVENTS: usize = 1000;
const ROUNDS: u64 = 60;
const TTL: Duration = Duration::from_millis(2000);

/// Entries in every attempt-ledger record in etcd (current or not): what a new owner
/// reads.
async fn stored_entries(etcd: &meshd_test_support::etcd::EtcdProcess) -> usize {
    let mut client = etcd.admin_client().await.unwrap();
    let got = client
        .get(
            "meshd/v1/attempts/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    got.kvs()
        .iter()
        .filter(|kv| kv.key_str().is_ok_and(|k| k.contains("/r/")))
        .map(|kv| {
            meshd_stores::attempts::decode_record(kv.value())
                .expect("an attempt-ledger record")
                .len()
        })
        .sum()
}

/// Pulls (1000 at a time, so each pull fills ledger records) until `n` arrived.
async fn pull_full(a: &str, n: usize, within: Duration) -> Vec<Delivery> {
    let got: std::sync::Arc<std::sync::Mutex<Vec<Delivery>>> = Default::default();
    wait_until(within, &format!("{n} deliveries"), || {
        let got = got.clone();
        async move {
            let more = pull(a, "s", &json!({"max_events": 1000, "wait_ms": 500})).await?;
            let mut got = got.lock().unwrap();
            got.extend(more);
            anyhow::ensure!(got.len() >= n, "{} of {n}", got.len());
            Ok(())
        }
    })
    .await
    .unwrap();
    let all = got.lock().unwrap().clone();
    all
}

async fn owner_of(a: &str) -> Option<String> {
    let v = client(a).cluster().await.ok()?;
    v["partitions"]
        .as_array()?
        .iter()
        .find(|p| p["topic"] == "t" && p["partition"] == 0)?["owner"]
        .as_str()
        .map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_redelivery_storm_behind_stragglers_then_the_ledger_stays_small_and_a_new_owner_takes_over(
) {
    let mut cluster = SmallCluster::start(2, TTL).await;
    let a0 = cluster.addr(0);
    create_topic(&a0, "t", 1).await;
    create_subscription(
        &a0,
        "s",
        json!({"topic": "t", "start": "earliest", "max_attempts": 1000, "ack_timeout_ms": 600000}),
    )
    .await;
    cluster.wait_settled("t", 1).await;
    let owner = cluster.designated_owner("t", 0);
    let (a, other) = (cluster.addr(owner), cluster.addr(1 - owner));
    let batch: Vec<Value> = (0..EVENTS).map(|i| event(&format!("e{i}"))).collect();
    for chunk in batch.chunks(100) {
        publish_batch(&a, "t", chunk).await.unwrap();
    }

    let mut kept: Vec<Delivery> = Vec::new();
    let mut last_nacked: Vec<Delivery> = Vec::new();
    for round in 0..ROUNDS {
        let got = pull_full(&a, EVENTS - kept.len(), Duration::from_secs(10)).await;
        // Keep one (the first of the pull: in its first record), nack the rest now.
        let (keep, rest) = got.split_first().expect("something due");
        kept.push(keep.clone());
        nack_delayed(&a, "s", &ids(rest), 0).await;
        last_nacked = rest.to_vec();
        let stored = stored_entries(&cluster.etcd).await;
        assert!(
            stored <= 2 * EVENTS + 1000,
            "round {round}: {stored} ledger entries in etcd for {EVENTS} offsets in flight"
        );
    }
    assert!(
        ROUNDS as usize * meshd_stores::attempts::RECORD_FRESH_ENTRIES
            > meshd_stores::attempts::MAX_LOADED_ENTRIES,
        "the storm would have passed the load cap without compaction"
    );

    // The owner dies; the other instance loads the ledger and continues.
    cluster.nodes[owner].kill();
    let survivor = format!("inst-{}", 1 - owner);
    wait_until(TTL * 10, "the survivor owns the partition", || async {
        anyhow::ensure!(owner_of(&other).await.as_deref() == Some(survivor.as_str()));
        Ok(())
    })
    .await
    .unwrap();
    // It inherited every delivery from the ledger: all 1000 in flight (a nack is not
    // written to Meta, so the nacked ones keep the lease they were handed out with),
    // and it honours the acks of the attempts the dead owner handed out last.
    // (Without compaction the survivor held the owner key but could not load the
    // ledger: "partition 0 of topic \"t\" has no owner right now", for good.)
    wait_until(TTL * 10, "the survivor serving the partition", || async {
        let stats = client(&other).stats("s").await?;
        anyhow::ensure!(
            stats["partitions"][0]["in_flight"] == EVENTS as u64,
            "{stats}"
        );
        Ok(())
    })
    .await
    .unwrap();
    let all: Vec<Delivery> = kept.iter().chain(&last_nacked).cloned().collect();
    let answer = ack(&other, "s", &ids(&all)).await.unwrap();
    assert_eq!(
        answer["acked"].as_array().map(Vec::len),
        Some(EVENTS),
        "{answer}"
    );
    wait_committed(&other, "s", 0, EVENTS as u64).await;
}
