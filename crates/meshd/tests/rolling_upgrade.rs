//! A rolling upgrade through real processes: the previous release's binary
//! (`MESHD_PREVIOUS_BIN`, built by `scripts/previous-release` from the commit in
//! `release/previous`) and this tree's binary share one etcd and one JetStream. Each
//! serves, forwards to and takes over from the other: every record one writes
//! (subscriptions, owner keys, checkpoints, the attempt ledger, membership) the other
//! reads, in both directions (state-plane.md, "Records"). Standalone, each opens the
//! other's data dir and serves the deliveries it left in flight.

mod common;

use common::*;
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::nats::NatsProcess;
use meshd_test_support::wait::wait_until;
use serde_json::json;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

const LEASE_TTL_MS: u64 = 2000;
const DEADLINE: Duration = Duration::from_secs(60);
const PARTITIONS: u64 = 4;

fn previous_bin() -> PathBuf {
    let p = std::env::var_os("MESHD_PREVIOUS_BIN")
        .map(PathBuf::from)
        .expect(
            "MESHD_PREVIOUS_BIN is not set: build the previous release with \
         `MESHD_PREVIOUS_BIN=$(scripts/previous-release)` (scripts/test does)",
        );
    assert!(
        p.is_file(),
        "MESHD_PREVIOUS_BIN={} is not a file",
        p.display()
    );
    p
}

/// The release of the previous binary, as `release/previous` names it.
fn previous_release() -> String {
    let text = std::fs::read_to_string(format!(
        "{}/../../release/previous",
        std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo")
    ))
    .expect("release/previous");
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.split_whitespace().nth(1))
        .expect("release/previous names the release after the commit")
        .to_string()
}

/// Acks `ds` on `a`, sent again after a 503 as a client does: an instance's view of
/// the owners lags Meta's by up to a controller tick, and an ack for a partition it
/// sees moving is refused then. An id acked twice is answered acked or unknown.
async fn ack_retrying(a: &str, ds: &[Delivery]) {
    wait_until(DEADLINE, "the acks answered", || async {
        let r = ack(a, "s", &ids(ds)).await?;
        for list in ["fenced", "failed"] {
            anyhow::ensure!(set(&r[list]).is_empty(), "{r}");
        }
        Ok(())
    })
    .await
    .unwrap();
}

/// (partition, offset) of each delivery.
fn placed_of(ds: &[Delivery]) -> BTreeSet<(u64, u64)> {
    ds.iter().map(|d| (d.partition, d.offset)).collect()
}

/// The instance that owns each partition, as `a` reports it.
async fn owners(a: &str) -> anyhow::Result<Vec<Option<String>>> {
    let v = client(a).cluster().await?;
    let mut out = vec![None; PARTITIONS as usize];
    for p in v["partitions"].as_array().into_iter().flatten() {
        if p["topic"] == "t" {
            let n = p["partition"].as_u64().unwrap_or(u64::MAX) as usize;
            if let Some(slot) = out.get_mut(n) {
                *slot = p["owner"].as_str().map(str::to_string);
            }
        }
    }
    Ok(out)
}

async fn wait_owned_by(a: &str, allowed: &[&str], what: &str) {
    wait_until(DEADLINE, what, || async {
        let o = owners(a).await?;
        anyhow::ensure!(
            o.iter()
                .all(|x| x.as_deref().is_some_and(|x| allowed.contains(&x))),
            "owners {o:?}"
        );
        Ok(())
    })
    .await
    .unwrap();
}

async fn publish_n(a: &str, from: usize, n: usize) -> BTreeSet<(u64, u64)> {
    let mut placed = BTreeSet::new();
    for i in from..from + n {
        placed.insert(publish(a, "t", &event(&format!("e{i}"))).await.unwrap());
    }
    placed
}

/// Waits until the subscription's committed offsets reach the topic's end offsets, in
/// the owners and in their checkpoints in etcd (what a new owner starts from: acks not
/// checkpointed yet are redelivered after a crash, the documented duplicates per move).
async fn wait_all_committed(a: &str, etcd: &str) {
    use meshd_meta::keys::{prefix, KeyKind};
    use meshd_meta::Meta;
    let ends = end_offsets(a, "t").await;
    for (p, end) in ends.iter().enumerate() {
        wait_committed(a, "s", p as u64, *end).await;
    }
    let meta = meshd_meta_etcd::EtcdMeta::connect(meshd_meta_etcd::EtcdConfig::new([etcd]))
        .await
        .unwrap();
    wait_until(DEADLINE, "checkpoints at the end offsets", || async {
        let kvs = meta
            .range(&prefix(KeyKind::Checkpoints, &["s"]), Default::default())
            .await?
            .kvs;
        let mut at = vec![0u64; ends.len()];
        for kv in kvs {
            let key = String::from_utf8_lossy(&kv.key).into_owned();
            let p: usize = key.rsplit('/').next().unwrap_or_default().parse()?;
            let v: serde_json::Value = serde_json::from_slice(&kv.value)?;
            if let (Some(slot), Some(o)) = (at.get_mut(p), v["committed"]["offset"].as_u64()) {
                *slot = o;
            }
        }
        anyhow::ensure!(at == ends, "checkpoints {at:?}, ends {ends:?}");
        Ok(())
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_the_previous_release_and_this_one_on_one_etcd_then_each_serves_forwards_to_and_takes_over_from_the_other(
) {
    let previous = previous_bin();
    let etcd = EtcdProcess::start().await.unwrap();
    let nats = NatsProcess::start().await.unwrap();
    let secret_dir = tempfile::tempdir().unwrap();
    let secret_file = secret_dir.path().join("secret");
    std::fs::write(
        &secret_file,
        "rolling-upgrade-secret-0123456789abcdef0123\n",
    )
    .unwrap();
    let common_args = cluster_args(
        &etcd,
        &nats,
        &secret_file,
        Duration::from_millis(LEASE_TTL_MS),
    );
    let args = |id: &'static str| {
        let mut a: Vec<String> = common_args.to_vec();
        a.extend(["--instance-id".to_string(), id.to_string()]);
        a
    };
    // Instance ids whose rendezvous weights split the topic's partitions between them.
    let (old_dir, new_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let old_args = args("prev");
    let mut new_args = args("next");
    // Retries due a second ahead would be parked: not while the previous release is
    // a member (it does not know the park journal).
    new_args.extend(["--park-retries-after-ms".to_string(), "1000".to_string()]);
    let as_strs = |a: &[String]| a.iter().map(String::clone).collect::<Vec<_>>();
    let start = |bin: PathBuf, dir: PathBuf, a: Vec<String>| async move {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        MeshdProcess::start(&bin, &dir, &a).await.unwrap()
    };
    let mut old = start(previous.clone(), old_dir.path().into(), as_strs(&old_args)).await;
    let mut new = start(bin().into(), new_dir.path().into(), as_strs(&new_args)).await;
    let (o, n) = (old.addr().to_string(), new.addr().to_string());

    // Both releases are members and announce themselves; partitions split between them.
    create_topic(&n, "t", PARTITIONS as u32).await;
    create_subscription(&o, "s", json!({"topic": "t", "ack_timeout_ms": 2000})).await;
    // The designated split (rendezvous weights of these ids for topic t): moves are
    // paced and sticky, so wait for all of it before anything is handed out.
    let designated = ["prev", "next", "prev", "next"].map(|x| Some(x.to_string()));
    wait_until(DEADLINE, "the partitions split as designated", || async {
        let own = owners(&o).await?;
        anyhow::ensure!(own == designated, "{own:?}");
        Ok(())
    })
    .await
    .unwrap();
    let members = client(&n).cluster().await.unwrap();
    let listed: BTreeSet<&str> = members["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["instance"].as_str())
        .collect();
    assert_eq!(listed, BTreeSet::from(["next", "prev"]), "{members}");
    // The previous release announces itself; while it is a member, new record shapes
    // stay off (membership::oldest_release).
    let release_of = |id: &str| {
        members["members"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["instance"] == id)
            .map(|m| m["release"].clone())
    };
    assert_eq!(
        release_of("next"),
        Some(members["release"].clone()),
        "{members}"
    );
    assert_eq!(
        release_of("prev"),
        Some(json!(previous_release())),
        "{members}"
    );
    assert_eq!(
        members["oldest_release"],
        json!(previous_release()),
        "{members}"
    );

    // Second-wave settings the previous release would ignore (filters) or read as a
    // corrupt record (a topic's dedup window) are refused while it is a member; a
    // PUT that leaves the window at its default is taken and the previous release
    // still reads the topic.
    let filtered = json!({"topic": "t", "filters": [{"prefix": {"type": "x"}}]});
    let r = meshd_test_support::http::send_json(&n, "PUT", "/v1/subscriptions/f", &filtered)
        .await
        .unwrap();
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json().unwrap()["field"], "filters", "{}", r.body);
    // Signed or bounded push: an older member would push unsigned and unbounded.
    let signed = |topic: &str| {
        json!({"topic": topic, "push": {"url": "http://127.0.0.1:9/hook",
               "secrets": ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"],
               "max_concurrency": 2, "rate_per_s": 10}})
    };
    let r = meshd_test_support::http::send_json(&n, "PUT", "/v1/subscriptions/w", &signed("t"))
        .await
        .unwrap();
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json().unwrap()["field"], "push", "{}", r.body);
    // Ordering per key: an older owner would hand a key's events out together.
    let ordered = json!({"topic": "t", "ordering": "key"});
    let r = meshd_test_support::http::send_json(&n, "PUT", "/v1/subscriptions/o", &ordered)
        .await
        .unwrap();
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json().unwrap()["field"], "ordering", "{}", r.body);
    let r = meshd_test_support::http::send_json(
        &n,
        "PUT",
        "/v1/topics/t",
        &json!({"partitions": PARTITIONS, "dedup_window_ms": 60000}),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json().unwrap()["field"], "dedup_window_ms", "{}", r.body);
    // A nack's delay_ms: the previous release's owner route would refuse the field.
    let r = nack_delayed(&n).await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json().unwrap()["field"], "delay_ms", "{}", r.body);
    // deliverat: an older member would hand the event out at once, and one taking a
    // partition over would not know what was parked.
    let r = publish_delayed(&n).await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(r.json().unwrap()["field"], "deliverat", "{}", r.body);
    // Nor are long retries parked: a nacked event's retry (backoff 2 s) waits as a
    // delivery record on this release's partitions too (topic u, apart from t).
    create_topic(&n, "u", 8).await;
    create_subscription(
        &n,
        "r",
        json!({"topic": "u", "ack_timeout_ms": 60000, "start": "earliest",
               "backoff": {"initial_ms": 2000, "max_ms": 2000}}),
    )
    .await;
    wait_until(
        DEADLINE,
        "every partition of u owned, some by next",
        || async {
            let v = client(&n).cluster().await?;
            let of_u: Vec<&serde_json::Value> = v["partitions"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["topic"] == "u")
                .collect();
            anyhow::ensure!(
                of_u.len() == 8 && of_u.iter().all(|p| p["owner"].is_string()),
                "{v}"
            );
            anyhow::ensure!(of_u.iter().any(|p| p["owner"] == "next"), "{v}");
            Ok(())
        },
    )
    .await
    .unwrap();
    let cluster = client(&n).cluster().await.unwrap();
    let on_next: BTreeSet<u64> = cluster["partitions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["topic"] == "u" && p["owner"] == "next")
        .filter_map(|p| p["partition"].as_u64())
        .collect();
    for i in 0..16 {
        publish(&n, "u", &event(&format!("u{i}"))).await.unwrap();
    }
    // This release's partitions are what the check is about (the previous release
    // cannot park at all).
    let got = pull_until(&n, "r", 1, DEADLINE).await;
    assert!(
        got.iter().any(|d| on_next.contains(&d.partition)),
        "nothing from next's partitions {on_next:?}: {:?}",
        summary(&got)
    );
    let r = nack(&n, "r", &ids(&got), "later").await.unwrap();
    assert_eq!(set(&r["retrying"]).len(), got.len(), "{r}");
    let stats = answered(client(&n).stats_answer("r").await, 200, "stats")
        .unwrap()
        .json::<serde_json::Value>()
        .unwrap();
    let parked: u64 = stats["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["parked"].as_u64().unwrap_or(0))
        .sum();
    assert_eq!(parked, 0, "a retry was parked in a mixed cluster: {stats}");
    let r = client(&n)
        .put_topic_answer(
            "t",
            &json!({"partitions": PARTITIONS, "dedup_window_ms": 120000}),
        )
        .await;
    answered(r, 200, "PUT topic t").unwrap();
    create_subscription(&o, "by-previous", json!({"topic": "t"})).await;
    answered(client(&o).topics_answer().await, 200, "GET /v1/topics")
        .unwrap_or_else(|e| panic!("the previous release reads the topic: {e:#}"));

    // Publishes through both; a consumer on each gets the other's partitions through
    // forwarding, and acks go back across releases.
    let mut placed = publish_n(&o, 0, 10).await;
    placed.append(&mut publish_n(&n, 10, 10).await);
    let from_old = pull_until(&o, "s", 10, DEADLINE).await;
    let from_new = pull_until(&n, "s", 20 - from_old.len(), DEADLINE).await;
    let got: BTreeSet<(u64, u64)> = from_old
        .iter()
        .chain(&from_new)
        .map(|d| (d.partition, d.offset))
        .collect();
    assert_eq!(got, placed, "every event, through either release");
    assert_eq!(from_old.len() + from_new.len(), placed.len(), "each once");
    // Acks sent to the instance that did not hand the delivery out; the committed
    // offsets (in the owners and their checkpoints) prove that every one landed.
    ack_retrying(&n, &from_old).await;
    ack_retrying(&o, &from_new).await;
    wait_all_committed(&n, &etcd.endpoint()).await;

    // This release dies with deliveries in flight: the previous one takes its
    // partitions from its records and hands those out again as the next attempt.
    let more = publish_n(&o, 20, 8).await;
    let held = pull_until(&n, "s", 8, DEADLINE).await;
    new.kill();
    wait_owned_by(&o, &["prev"], "the previous release owns every partition").await;
    let again = pull_until(&o, "s", 8, DEADLINE).await;
    assert_eq!(
        placed_of(&again),
        more,
        "exactly the unacked events come back"
    );
    for d in &again {
        let before = held
            .iter()
            .find(|h| (h.partition, h.offset) == (d.partition, d.offset));
        assert!(d.attempt >= 2 || before.is_none(), "{:?}", summary(&again));
    }
    ack_retrying(&o, &again).await;
    wait_all_committed(&o, &etcd.endpoint()).await;

    // And the other way: this release comes back, the previous one dies with work in
    // flight, and this release continues from the previous one's records.
    new.start_again().await.unwrap();
    let n = new.addr().to_string();
    let last = publish_n(&n, 28, 8).await;
    let held = pull_until(&o, "s", 8, DEADLINE).await;
    assert_eq!(placed_of(&held), last);
    old.kill();
    wait_owned_by(&n, &["next"], "this release owns every partition").await;
    let again = pull_until(&n, "s", 8, DEADLINE).await;
    assert_eq!(
        placed_of(&again),
        last,
        "nothing acked under the previous release comes back, everything unacked does"
    );
    assert!(
        again.iter().all(|d| d.attempt >= 2),
        "{:?}",
        summary(&again)
    );
    ack_retrying(&n, &again).await;
    wait_all_committed(&n, &etcd.endpoint()).await;
    assert_no_delivery(&n, "s", 500, "everything was acked").await;
    // The previous release has left: the settings it would ignore are taken now.
    wait_until(
        DEADLINE,
        "filters accepted once every member runs this release",
        || async {
            let r = client(&n).put_subscription_answer("f", &filtered).await;
            answered(r, 201, "PUT subscription f")?;
            Ok(())
        },
    )
    .await
    .unwrap();
    let r = client(&n)
        .put_topic_answer(
            "t",
            &json!({"partitions": PARTITIONS, "dedup_window_ms": 60000}),
        )
        .await;
    answered(r, 200, "PUT topic t").unwrap();
    let r = nack_delayed(&n).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let r = publish_delayed(&n).await;
    assert_eq!(r.status, 201, "{}", r.body);
    // A signed push (on a topic of its own, with nothing to push).
    create_topic(&n, "quiet", 1).await;
    create_subscription(&n, "w", signed("quiet")).await;
}

/// How many keys under the one-byte `prefix` a column family of the data dir holds
/// (meshd must be stopped).
fn keys_under(dir: &std::path::Path, cf: &'static str, prefix: u8) -> usize {
    use meshd_local::KvEngine;
    let engine =
        meshd_local::RocksEngine::open(dir, meshd_stores_local::keys::COLUMN_FAMILIES).unwrap();
    let prefix = [prefix];
    engine
        .scan(
            cf,
            &prefix,
            Some(&meshd_stores_local::keys::end_of(&prefix)),
            0,
        )
        .unwrap()
        .len()
}

/// How many entries of the deadline index earlier releases kept in the `deliveries`
/// column family (`x` keys) the data dir holds (meshd must be stopped).
fn deadline_index_entries(dir: &std::path::Path) -> usize {
    keys_under(dir, "deliveries", meshd_stores_local::keys::DEADLINE)
}

#[tokio::test]
async fn given_a_standalone_data_dir_of_the_previous_release_then_this_release_serves_what_it_left_in_flight_and_back(
) {
    let previous = previous_bin();
    let dir = tempfile::tempdir().unwrap();
    let mut old = MeshdProcess::start(&previous, dir.path(), &[])
        .await
        .unwrap();
    let o = old.addr().to_string();
    create_topic(&o, "t", 1).await;
    create_subscription(&o, "s", json!({"topic": "t", "ack_timeout_ms": 3000})).await;
    let placed = publish_n(&o, 0, 10).await;
    let mut first = pull_until(&o, "s", 10, DEADLINE).await;
    assert_eq!(placed_of(&first), placed);
    first.sort_by_key(|d| d.offset);
    let held = first.split_off(4);
    ack_retrying(&o, &first).await;
    // Shown once durable: the four acks survive the SIGKILL.
    wait_committed(&o, "s", 0, 4).await;
    old.kill();
    assert_eq!(
        deadline_index_entries(dir.path()),
        held.len(),
        "the previous release keeps a deadline entry per record in flight"
    );

    // This release on the previous one's data dir: the six unacked come back as
    // attempt 2, the acked never; the old index is gone from the data dir.
    let mut new = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let n = new.addr().to_string();
    let again = pull_until(&n, "s", held.len(), DEADLINE).await;
    assert_eq!(placed_of(&again), placed_of(&held));
    assert!(
        again.iter().all(|d| d.attempt == 2),
        "{:?}",
        summary(&again)
    );
    ack_retrying(&n, &again).await;
    wait_committed(&n, "s", 0, 10).await;
    let last = publish_n(&n, 10, 2).await;
    let in_flight = pull_until(&n, "s", 2, DEADLINE).await;
    assert_eq!(placed_of(&in_flight), last);
    new.kill();
    assert_eq!(
        deadline_index_entries(dir.path()),
        0,
        "dropped at open, never written"
    );

    // And back: the previous release serves what this one left in flight.
    let mut old = MeshdProcess::start(&previous, dir.path(), &[])
        .await
        .unwrap();
    let o = old.addr().to_string();
    let again = pull_until(&o, "s", 2, DEADLINE).await;
    assert_eq!(placed_of(&again), last);
    assert!(
        again.iter().all(|d| d.attempt == 2),
        "{:?}",
        summary(&again)
    );
    ack_retrying(&o, &again).await;
    wait_committed(&o, "s", 0, 12).await;
    assert_no_delivery(&o, "s", 500, "everything was acked").await;
    old.kill();
}

/// Publishes one event with a `deliverat` an hour ahead to topic `t`.
async fn publish_delayed(a: &str) -> meshd_test_support::http::Response {
    let at = meshd_stores::time::Timestamp::from_millis(
        meshd_stores::time::Timestamp::now().as_millis() + 3_600_000,
    )
    .unwrap()
    .to_rfc3339();
    let e = json!({"specversion":"1.0","id":"delayed","source":"/u","type":"t","deliverat":at});
    meshd_test_support::http::request_with(
        a,
        "POST",
        "/v1/topics/t/events",
        &[("Content-Type", "application/cloudevents+json")],
        e.to_string().as_bytes(),
    )
    .await
    .unwrap()
}

/// A nack with `delay_ms` (of an id that is no delivery: only the gate matters here).
async fn nack_delayed(a: &str) -> meshd_test_support::http::Response {
    meshd_test_support::http::send_json(
        a,
        "POST",
        "/v1/subscriptions/s/nack",
        &json!({"delivery_ids": ["not-a-delivery"], "delay_ms": 1000}),
    )
    .await
    .unwrap()
}

/// How many dedup runs (`r` records) the data dir holds (meshd stopped).
fn dedup_runs(dir: &std::path::Path) -> usize {
    keys_under(
        dir,
        meshd_stores_local::keys::CF_LOG,
        meshd_stores_local::keys::DEDUP_RUN,
    )
}

/// POSTs `ids` to topic `t` as one batch; each answer's (partition, offset,
/// duplicate).
async fn publish_ids(a: &str, ids: &[String]) -> Vec<(u64, u64, bool)> {
    let events: Vec<serde_json::Value> = ids
        .iter()
        .map(|id| json!({"specversion": "1.0", "id": id, "source": "/upgrade", "type": "t"}))
        .collect();
    let r = answered(client(a).publish_answer("t", &events).await, 201, "publish").unwrap();
    let body: serde_json::Value = r.json().unwrap();
    body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["partition"].as_u64().unwrap(),
                e["offset"].as_u64().unwrap(),
                e["duplicate"].as_bool().unwrap_or(false),
            )
        })
        .collect()
}

/// The publish dedup index across an upgrade and back, through the previous release
/// (which has no dedup): this release keeps one record per run of a batch (`r`), the
/// previous release opens a data dir holding them and serves (it does not read
/// them, and does not deduplicate), and this release, back on it, still answers its
/// own events as duplicates with their offsets.
#[tokio::test]
async fn given_dedup_runs_in_a_standalone_data_dir_then_the_previous_release_serves_it_and_this_one_still_answers_them(
) {
    let previous = previous_bin();
    let dir = tempfile::tempdir().unwrap();
    let ids = |from: usize, n: usize| -> Vec<String> {
        (from..from + n).map(|i| format!("d{i}")).collect()
    };
    let mut old = MeshdProcess::start(&previous, dir.path(), &[])
        .await
        .unwrap();
    create_topic(old.addr(), "t", 3).await;
    old.kill();

    let mut new = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let n = new.addr().to_string();
    let first = publish_ids(&n, &ids(0, 30)).await;
    assert!(first.iter().all(|(_, _, dup)| !dup));
    let again = publish_ids(&n, &ids(0, 30)).await;
    for (a, f) in again.iter().zip(&first) {
        assert_eq!(*a, (f.0, f.1, true));
    }
    new.kill();
    let partitions: BTreeSet<u64> = first.iter().map(|(p, _, _)| *p).collect();
    assert_eq!(
        dedup_runs(dir.path()),
        partitions.len(),
        "one run per partition of the batch"
    );

    // Back to the previous release: it opens the data dir and serves.
    let mut old = MeshdProcess::start(&previous, dir.path(), &[])
        .await
        .unwrap();
    let o = old.addr().to_string();
    let other = publish_ids(&o, &ids(100, 3)).await;
    assert_eq!(other.len(), 3);
    old.kill();

    // And this release again: its runs still answer.
    let mut new = MeshdProcess::start(bin(), dir.path(), &[]).await.unwrap();
    let back = publish_ids(new.addr(), &ids(0, 30)).await;
    for (a, f) in back.iter().zip(&first) {
        assert_eq!(*a, (f.0, f.1, true), "after the round trip");
    }
    new.kill();
}
