//! The etcd fence, reached for real (issue 25: the paused-owner story credited the
//! fence, but a resumed owner stops at its local lease deadline before it writes, so
//! the fence was probably never reached). Here the owner's attempt-ledger write is
//! already on the wire when the owner stops: its requests to etcd are held in a
//! blackhole and the process is paused, its lease ends in etcd (revoked: what etcd does
//! when it runs out, without waiting as long as the write's own request timeout),
//! another instance takes the partition, and only then does the held write reach etcd,
//! carrying the old epoch.
//!
//! Checked: etcd refused it (no record it carried is in etcd's history: after the
//! takeover no (offset, attempt) of the partition is written twice, which a stale
//! record and the new owner's own would do), the old owner got etcd's refusal (its
//! write counted `fenced`) and handed out nothing of the partition, and the deliveries
//! it had in flight before the pause are honoured by the new owner (their acks
//! answered `acked`), while every event is delivered in the end.

mod common;

use common::*;
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http::{get, sample_of};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::nats::NatsProcess;
use meshd_test_support::proxy::{Hold, TcpProxy};
use meshd_test_support::wait::wait_until;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

const LEASE_TTL: Duration = Duration::from_millis(1500);
const PARTITIONS: u64 = 4;
const DEADLINE: Duration = Duration::from_secs(30);
const SECRET: &str = "fencing-e2e-secret-0123456789abcdef0123456789";

/// `/v1/cluster`'s owners: partition -> (owner, epoch).
async fn owners(a: &str) -> anyhow::Result<BTreeMap<u64, (String, i64)>> {
    let v = client(a).cluster().await?;
    let mut out = BTreeMap::new();
    for p in v["partitions"].as_array().into_iter().flatten() {
        if let (Some("t"), Some(n), Some(o), Some(e)) = (
            p["topic"].as_str(),
            p["partition"].as_u64(),
            p["owner"].as_str(),
            p["epoch"].as_i64(),
        ) {
            out.insert(n, (o.to_string(), e));
        }
    }
    Ok(out)
}

async fn pull_own_a(a: &str, max_events: u64, timeout: Duration) -> anyhow::Result<Vec<Delivery>> {
    pull_own(a, SECRET, max_events, timeout).await
}

/// Every put to `prefix` from `from_revision` on, as (revision, key, value), read
/// through a watch.
async fn puts_since(
    etcd: &EtcdProcess,
    prefix: &str,
    from_revision: i64,
) -> Vec<(i64, String, Vec<u8>)> {
    let mut client = etcd.admin_client().await.unwrap();
    let now = client
        .get(
            prefix,
            Some(etcd_client::GetOptions::new().with_count_only()),
        )
        .await
        .unwrap()
        .header()
        .map(|h| h.revision())
        .unwrap();
    let mut stream = client
        .watch(
            prefix,
            Some(
                etcd_client::WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(from_revision),
            ),
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    let mut seen = from_revision - 1;
    while seen < now {
        let Ok(Ok(Some(resp))) =
            tokio::time::timeout(Duration::from_secs(2), stream.message()).await
        else {
            // Nothing more under the prefix up to `now`.
            break;
        };
        assert_eq!(resp.compact_revision(), 0, "history compacted");
        for e in resp.events() {
            let kv = e.kv().unwrap();
            seen = seen.max(kv.mod_revision());
            if e.event_type() == etcd_client::EventType::Put {
                out.push((
                    kv.mod_revision(),
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    kv.value().to_vec(),
                ));
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_an_owners_ledger_write_held_on_the_wire_past_its_lease_when_it_arrives_after_the_takeover_then_etcd_refuses_it(
) {
    let etcd = EtcdProcess::start().await.unwrap();
    let nats = NatsProcess::start().await.unwrap();
    let proxy = TcpProxy::start(etcd.endpoint().parse().unwrap())
        .await
        .unwrap();
    let secret_dir = tempfile::tempdir().unwrap();
    let secret_file = secret_dir.path().join("secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).unwrap();
    let args = cluster_args(&etcd, &nats, &secret_file, LEASE_TTL);
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // A reaches etcd through the proxy; B directly.
    let mut a_args: Vec<String> = args.clone();
    let at = a_args.iter().position(|x| x == "--meta").unwrap();
    a_args[at + 1] = format!("etcd://{}", proxy.addr());
    a_args.extend(["--instance-id".to_string(), "inst-a".to_string()]);
    let mut b_args = args.clone();
    b_args.extend(["--instance-id".to_string(), "inst-b".to_string()]);
    let strs = |v: &Vec<String>| v.iter().map(String::clone).collect::<Vec<_>>();
    let (a_args, b_args) = (strs(&a_args), strs(&b_args));
    let a_refs: Vec<&str> = a_args.iter().map(String::as_str).collect();
    let b_refs: Vec<&str> = b_args.iter().map(String::as_str).collect();
    let a = MeshdProcess::start(bin(), da.path(), &a_refs)
        .await
        .unwrap();
    let b = MeshdProcess::start(bin(), db.path(), &b_refs)
        .await
        .unwrap();
    let (aa, ba) = (a.addr().to_string(), b.addr().to_string());

    create_topic(&ba, "t", PARTITIONS as u32).await;
    create_subscription(&ba, "s", json!({"topic": "t", "ack_timeout_ms": 60000})).await;
    // Every partition owned, some by A (the assignment over two members).
    let before = wait_until(
        DEADLINE,
        "every partition owned, A among the owners",
        || async {
            let o = owners(&ba).await?;
            anyhow::ensure!(o.len() == PARTITIONS as usize, "{o:?}");
            anyhow::ensure!(o.values().any(|(owner, _)| owner == "inst-a"), "{o:?}");
            Ok(o)
        },
    )
    .await
    .unwrap();
    let lost: BTreeSet<u64> = before
        .iter()
        .filter(|(_, (o, _))| o == "inst-a")
        .map(|(p, _)| *p)
        .collect();
    for i in 0..80 {
        publish(&ba, "t", &event(&format!("e{i}"))).await.unwrap();
    }

    // Work in flight on A: a first hand-out of its partitions, held by the consumer.
    // (A learns of B's appends through the log a moment later: a pull that finds
    // nothing yet is asked again.)
    let in_flight = wait_until(DEADLINE, "A hands out its first events", || async {
        let got = pull_own_a(&aa, 6, Duration::from_secs(10)).await?;
        anyhow::ensure!(!got.is_empty(), "nothing handed out yet");
        Ok(got)
    })
    .await
    .unwrap();
    assert!(
        !in_flight.is_empty() && in_flight.iter().all(|d| lost.contains(&d.partition)),
        "A hands out its own partitions: {in_flight:?}"
    );
    // Then more events, so A's next pull has something to write to its ledger.
    for i in 80..120 {
        publish(&ba, "t", &event(&format!("e{i}"))).await.unwrap();
    }
    wait_until(DEADLINE, "A sees the new events", || async {
        let v = client(&aa).stats("s").await?;
        let backlog: u64 = v["partitions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["partition"].as_u64().is_some_and(|n| lost.contains(&n)))
            .filter_map(|p| p["backlog"].as_u64())
            .sum();
        anyhow::ensure!(backlog > 0, "backlog {backlog}: {v}");
        Ok(())
    })
    .await
    .unwrap();

    // A's requests to etcd stop on the wire; its next pull's ledger write goes out
    // into the blackhole (seen as bytes reaching the proxy), then A is paused.
    let revision_at_hold = etcd
        .admin_client()
        .await
        .unwrap()
        .get(
            "meshd/",
            Some(etcd_client::GetOptions::new().with_count_only()),
        )
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    proxy.hold(Hold::Requests);
    let sent_before = proxy.bytes_sent();
    let stuck_pull = tokio::spawn({
        let aa = aa.clone();
        async move { pull_own_a(&aa, 100, Duration::from_secs(60)).await }
    });
    wait_until(DEADLINE, "A's ledger write on the wire", || async {
        // A transaction with a record is a few hundred bytes; a lease keep-alive a
        // few dozen.
        let sent = proxy.bytes_sent() - sent_before;
        anyhow::ensure!(sent >= 200, "{sent} bytes");
        Ok(())
    })
    .await
    .unwrap();
    a.pause();
    // Its lease ends in etcd now (revoked, as etcd does when it runs out: every key
    // on it goes, its owner keys too), so B takes over well within the held write's
    // request timeout (2 s, which also runs while A is paused): on resume the write's
    // answer is etcd's, not A's own timeout. Waiting for the lease to run out would
    // take as long as that timeout, and A would then give up first (`indeterminate`).
    let mut admin = etcd.admin_client().await.unwrap();
    let member = admin.get("meshd/v1/members/inst-a", None).await.unwrap();
    let lease = member.kvs().first().map(|kv| kv.lease()).unwrap_or(0);
    assert!(lease != 0, "A's member key is on its lease: {member:?}");
    admin.lease_revoke(lease).await.unwrap();

    // Its lease runs out in etcd; B takes every partition, under new epochs.
    let after = wait_until(DEADLINE, "B owns every partition", || async {
        let o = owners(&ba).await?;
        anyhow::ensure!(
            o.len() == PARTITIONS as usize && o.values().all(|(owner, _)| owner == "inst-b"),
            "{o:?}"
        );
        Ok(o)
    })
    .await
    .unwrap();
    for p in &lost {
        assert!(
            after[p].1 > before[p].1,
            "partition {p}: a new epoch {after:?}"
        );
    }
    // The held write reaches etcd now, with the old epoch; then A runs again.
    proxy.restore();
    a.resume();
    let stale = stuck_pull.await.unwrap();
    if let Ok(ds) = &stale {
        assert!(
            ds.iter().all(|d| !lost.contains(&d.partition)),
            "the old owner handed out a lost partition: {ds:?}"
        );
    }
    // A learned it from etcd: its held ledger write was refused by the fence (counted
    // `fenced`), and it stopped acting on the partition. (An `indeterminate` count,
    // a write whose answer A's request timeout gave up on, is reported but proves
    // nothing about the fence.)
    let (fenced, indeterminate) =
        wait_until(DEADLINE, "A counted a fenced ledger write", || async {
            let page = get(&aa, "/metrics").await?;
            anyhow::ensure!(page.status == 200, "/metrics answered {}", page.status);
            // A kind is absent from the page until its first error.
            let count = |kind: &str| {
                sample_of(
                    &page.body,
                    &format!(
                        "meshd_store_errors_total{{store=\"attempts\",backend=\"etcd\",kind=\"{kind}\"}}"
                    ),
                )
                .unwrap_or(0.0)
            };
            let (fenced, indeterminate) = (count("fenced"), count("indeterminate"));
            anyhow::ensure!(
                fenced >= 1.0,
                "attempt-ledger writes failed fenced {fenced}, indeterminate {indeterminate}"
            );
            Ok((fenced, indeterminate))
        })
        .await
        .unwrap();
    eprintln!(
        "the old owner's failed attempt-ledger writes: fenced {fenced}, indeterminate {indeterminate}"
    );

    // The deliveries A had in flight are honoured by B.
    let r = ack(&ba, "s", &ids(&in_flight)).await.unwrap();
    assert_eq!(
        set(&r["acked"]).len(),
        in_flight.len(),
        "every ack of the current attempt is honoured by the new owner: {r}"
    );
    // Everything else is delivered through B (pull errors are failures, not empty).
    let mut seen: BTreeSet<String> = in_flight
        .iter()
        .map(|d| d.event["id"].as_str().unwrap().to_string())
        .collect();
    let start = std::time::Instant::now();
    while seen.len() < 120 {
        assert!(
            start.elapsed() < DEADLINE,
            "{} of 120 events delivered",
            seen.len()
        );
        let ds = pull(&ba, "s", &json!({"max_events": 100, "wait_ms": 200}))
            .await
            .expect("a pull through the new owner");
        if !ds.is_empty() {
            let r = ack(&ba, "s", &ids(&ds)).await.expect("an ack");
            assert_eq!(set(&r["acked"]).len(), ds.len(), "{r}");
        }
        seen.extend(
            ds.iter()
                .map(|d| d.event["id"].as_str().unwrap().to_string()),
        );
    }

    // etcd's history: after the hold, no (partition, offset, attempt) is recorded in
    // the ledger twice. A stale record that got through would name what B then
    // handed out and recorded itself.
    let puts = puts_since(&etcd, "meshd/v1/attempts/", revision_at_hold).await;
    let mut recorded: BTreeMap<(u64, u64, u64), i64> = BTreeMap::new();
    for (revision, key, value) in &puts {
        let Some(p) = key
            .split("/t/")
            .nth(1)
            .and_then(|rest| rest.split('/').next())
            .and_then(|p| p.parse::<u64>().ok())
        else {
            continue;
        };
        if !key.contains("/r/") {
            continue;
        }
        let record: Value = serde_json::from_slice(value).unwrap();
        for d in record["d"].as_array().unwrap() {
            let (o, att) = (d[0].as_u64().unwrap(), d[1].as_u64().unwrap());
            if let Some(first) = recorded.insert((p, o, att), *revision) {
                panic!(
                    "p{p} o{o} attempt {att} recorded at revision {first} and again at {revision}: a stale owner's write got through"
                );
            }
        }
    }
    assert!(
        recorded.keys().any(|(p, _, _)| lost.contains(p)),
        "the new owner recorded its hand-outs of the lost partitions: {recorded:?}"
    );
}
