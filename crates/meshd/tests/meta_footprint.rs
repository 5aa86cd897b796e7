//! Meta's footprint (issue 19, first part), through the binary against an etcd run with
//! its defaults (no auto-compaction, as the README's cluster example leaves it): meshd
//! compacts the history it creates, one instance at a time, and says so in
//! `/metrics`; `/v1/cluster` shows Meta's size and alarms.

mod common;

use common::disk::metric;
use common::{bin, create_topic};
use meshd_test_support::etcd::{EtcdOptions, EtcdProcess};
use meshd_test_support::http::{get, send_json};
use meshd_test_support::meshd::MeshdProcess;
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
        let r = send_json(
            a.addr(),
            "PUT",
            "/v1/subscriptions/s",
            &json!({"topic": "t", "max_attempts": 3 + (i % 2)}),
        )
        .await
        .unwrap();
        assert!(r.status == 200 || r.status == 201, "{}", r.body);
    }
    let revision = get(a.addr(), "/metrics")
        .await
        .unwrap()
        .body
        .lines()
        .find_map(|l| {
            l.strip_prefix("meshd_meta_revision{backend=\"etcd\"} ")
                .and_then(|v| v.parse::<i64>().ok())
        })
        .expect("meshd_meta_revision");
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
    let c = get(a.addr(), "/v1/cluster").await.unwrap().json().unwrap();
    assert!(c["meta"]["db_size_bytes"].as_u64().unwrap() > 0, "{c}");
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
        anyhow::ensure!(get(a, "/readyz").await?.status == 200);
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
    let c = get(a, "/v1/cluster").await.unwrap().json().unwrap();
    assert_eq!(c["meta"]["alarms"], json!(["NOSPACE"]), "{c}");
    // A write through meshd is refused as unavailable, naming Meta; nothing stored.
    let r = send_json(a, "PUT", "/v1/topics/t", &json!({"partitions": 1}))
        .await
        .unwrap();
    assert_eq!(r.status, 503, "{}", r.body);
}
