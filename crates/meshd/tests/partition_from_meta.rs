//! One instance cut off from etcd while another still reaches it (a TCP proxy between
//! the first instance and etcd, closed and reopened by the test): the cut-off instance
//! reports not ready and refuses Meta writes with 503/504 instead of pretending, the
//! other keeps working, and once the proxy is restored the first instance is ready
//! again and sees what was written meanwhile, without a restart.

mod common;

use common::*;
use meshd_test_support::etcd::EtcdProcess;
use meshd_test_support::http::{get, send_json};
use meshd_test_support::meshd::MeshdProcess;
use meshd_test_support::proxy::TcpProxy;
use meshd_test_support::wait::wait_until;
use serde_json::json;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(30);

async fn readiness(a: &str) -> anyhow::Result<(u16, serde_json::Value)> {
    let r = get(a, "/readyz").await?;
    Ok((r.status, r.json()?))
}

async fn wait_ready(a: &str, want: u16) -> serde_json::Value {
    wait_until(DEADLINE, &format!("/readyz {want} on {a}"), || async {
        let (status, body) = readiness(a).await?;
        anyhow::ensure!(status == want, "{status}: {body}");
        Ok(body)
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_one_instance_cut_off_from_etcd_then_it_is_not_ready_and_refuses_writes_while_the_other_serves_and_it_recovers_when_reconnected(
) {
    let etcd = EtcdProcess::start().await.unwrap();
    let proxy = TcpProxy::start(etcd.endpoint().parse().unwrap())
        .await
        .unwrap();
    let via_proxy = format!("etcd://{}", proxy.addr());
    let direct = format!("etcd://{}", etcd.endpoint());
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = MeshdProcess::start(bin(), da.path(), &["--meta", &via_proxy])
        .await
        .unwrap();
    let b = MeshdProcess::start(bin(), db.path(), &["--meta", &direct])
        .await
        .unwrap();
    wait_ready(a.addr(), 200).await;
    wait_ready(b.addr(), 200).await;

    proxy.cut();
    let body = wait_ready(a.addr(), 503).await;
    assert_ne!(body["checks"]["meta:etcd"], "ok", "{body}");
    let (status, body) = readiness(b.addr()).await.unwrap();
    assert_eq!(status, 200, "the other instance still reaches etcd: {body}");

    // The other instance writes; the cut-off one cannot, and says so.
    create_topic(b.addr(), "t", 1).await;
    create_subscription(b.addr(), "s", json!({"topic": "t"})).await;
    let r = send_json(a.addr(), "PUT", "/v1/topics/u", &json!({"partitions": 1}))
        .await
        .unwrap();
    assert!(
        matches!(r.status, 503 | 504),
        "a write without Meta is refused honestly: {} {}",
        r.status,
        r.body
    );
    if r.status == 503 {
        assert!(
            r.headers
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case("retry-after")),
            "{r:?}"
        );
    }

    proxy.restore();
    wait_ready(a.addr(), 200).await;
    wait_until(DEADLINE, "instance A sees B's subscription", || async {
        let r = get(a.addr(), "/v1/subscriptions/s").await?;
        anyhow::ensure!(r.status == 200, "{} {}", r.status, r.body);
        Ok(())
    })
    .await
    .unwrap();
    // And it writes again, without a restart.
    create_topic(a.addr(), "u", 1).await;
}
