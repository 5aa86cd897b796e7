//! etcd-specific behaviour of `EtcdMeta` against real etcd processes: a killed, a
//! frozen and an unreachable etcd, endpoint failover, lease rounding. The generic
//! Meta semantics are certified by the conformance suite.

use anyhow::{ensure, Context};
use futures::StreamExt;
use meshd_meta::{Meta, MetaError, Precondition, WatchError};
use meshd_meta_etcd::{ConfigError, EtcdConfig, EtcdMeta};
use meshd_test_support::etcd::{free_port, EtcdProcess};
use meshd_test_support::wait::wait_until;
use std::future::Future;
use std::time::{Duration, Instant};

/// Scheduling slack on top of a configured timeout (the machine may be busy).
const SLACK: Duration = Duration::from_secs(2);
/// How long etcd may take to serve again after a restart or resume.
const RECOVERY: Duration = Duration::from_secs(15);

async fn meta_for(endpoints: Vec<String>) -> anyhow::Result<(EtcdMeta, Duration)> {
    let config = EtcdConfig::new(endpoints);
    let timeout = config.request_timeout;
    let meta = EtcdMeta::connect(config).await?;
    Ok((meta, timeout))
}

/// Runs `f`, asserting that it returns within `bound`, and returns its result.
async fn bounded<T>(what: &str, bound: Duration, f: impl Future<Output = T>) -> T {
    let t0 = Instant::now();
    let out = f.await;
    let elapsed = t0.elapsed();
    assert!(
        elapsed < bound,
        "{what} took {elapsed:?}, more than the liveness bound {bound:?}"
    );
    out
}

async fn assert_recovers(meta: &EtcdMeta, key: &[u8], value: &[u8]) -> anyhow::Result<()> {
    wait_until(RECOVERY, "the earlier key to be readable again", || async {
        let got = meta.get(key).await?;
        let kv = got
            .kv
            .context("the key written before the failure is missing")?;
        ensure!(kv.value == value, "unexpected value {:?}", kv.value);
        Ok(())
    })
    .await?;
    wait_until(RECOVERY, "a new put to succeed", || async {
        meta.put(b"after", b"ok", Precondition::None, None).await?;
        Ok(())
    })
    .await?;
    let after = meta.get(b"after").await?;
    ensure!(after.kv.map(|kv| kv.value) == Some(b"ok".to_vec()));
    Ok(())
}

#[tokio::test]
async fn given_etcd_killed_when_reading_and_writing_then_unavailable_fast_and_recovers_without_new_client(
) -> anyhow::Result<()> {
    let mut etcd = EtcdProcess::start().await?;
    let (meta, timeout) = meta_for(vec![etcd.endpoint()]).await?;
    meta.put(b"k", b"v1", Precondition::None, None).await?;

    etcd.kill();

    let read = bounded("get on a killed etcd", timeout + SLACK, meta.get(b"k")).await;
    assert!(
        matches!(read, Err(MetaError::Unavailable(_))),
        "a read of a killed etcd must be Unavailable, never absent: {read:?}"
    );
    let write = bounded(
        "put on a killed etcd",
        timeout + SLACK,
        meta.put(b"k", b"v2", Precondition::None, None),
    )
    .await;
    assert!(
        matches!(
            write,
            Err(MetaError::Unavailable(_)) | Err(MetaError::Indeterminate(_))
        ),
        "{write:?}"
    );
    // With the connection known refused, a second read is refused at once.
    let again = bounded(
        "a second get on a killed etcd",
        timeout + SLACK,
        meta.get(b"k"),
    )
    .await;
    assert!(matches!(again, Err(MetaError::Unavailable(_))), "{again:?}");

    etcd.restart().await?;
    assert_recovers(&meta, b"k", b"v1").await
}

#[tokio::test]
async fn given_etcd_paused_when_writing_then_indeterminate_and_reads_unavailable_within_timeout(
) -> anyhow::Result<()> {
    let etcd = EtcdProcess::start().await?;
    let (meta, timeout) = meta_for(vec![etcd.endpoint()]).await?;
    meta.put(b"k", b"v1", Precondition::None, None).await?;

    etcd.pause();

    let write = bounded(
        "put on a paused etcd",
        timeout + SLACK,
        meta.put(b"k", b"v2", Precondition::None, None),
    )
    .await;
    assert!(
        matches!(write, Err(MetaError::Indeterminate(_))),
        "a write sent to a frozen etcd has an unknown outcome: {write:?}"
    );
    let read = bounded("get on a paused etcd", timeout + SLACK, meta.get(b"k")).await;
    assert!(
        matches!(read, Err(MetaError::Unavailable(_))),
        "a read of a frozen etcd must be Unavailable: {read:?}"
    );
    let grant = bounded(
        "grant on a paused etcd",
        timeout + SLACK,
        meta.grant(Duration::from_secs(5)),
    )
    .await;
    assert!(
        matches!(grant, Err(MetaError::Indeterminate(_))),
        "{grant:?}"
    );
    let status = bounded("status on a paused etcd", timeout + SLACK, meta.status()).await;
    assert!(
        matches!(status, Err(MetaError::Unavailable(_))),
        "{status:?}"
    );

    etcd.resume();

    // The indeterminate put may or may not have been applied; either value is fine.
    wait_until(RECOVERY, "reads after resume", || async {
        let got = meta.get(b"k").await?;
        let value = got.kv.context("key missing after resume")?.value;
        ensure!(
            value == b"v1" || value == b"v2",
            "unexpected value {value:?}"
        );
        Ok(())
    })
    .await?;
    wait_until(RECOVERY, "writes after resume", || async {
        meta.put(b"after", b"ok", Precondition::None, None).await?;
        Ok(())
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn given_a_dead_endpoint_first_when_requests_run_then_they_succeed_on_the_live_one(
) -> anyhow::Result<()> {
    let etcd = EtcdProcess::start().await?;
    let dead = format!("127.0.0.1:{}", free_port());
    let (meta, timeout) = meta_for(vec![dead, etcd.endpoint()]).await?;
    for i in 0..20u32 {
        let key = format!("failover/{i}");
        let value = i.to_string();
        let put = bounded(
            "put with a dead first endpoint",
            timeout + SLACK,
            meta.put(key.as_bytes(), value.as_bytes(), Precondition::None, None),
        )
        .await
        .with_context(|| format!("put {i}"))?;
        let got = meta
            .get(key.as_bytes())
            .await
            .with_context(|| format!("get {i}"))?;
        let kv = got.kv.context("written key is missing")?;
        ensure!(kv.value == value.as_bytes() && kv.mod_revision == put.revision);
    }
    assert_eq!(
        meta.current_endpoint(),
        etcd.endpoint(),
        "the live endpoint is remembered"
    );
    let range = meta.range(b"failover/", Default::default()).await?;
    assert_eq!(range.kvs.len(), 20);
    Ok(())
}

#[tokio::test]
async fn given_a_frozen_endpoint_first_when_a_call_times_out_then_later_calls_use_the_live_one(
) -> anyhow::Result<()> {
    let etcd = EtcdProcess::start().await?;
    // Accepts TCP connections (the kernel does) but never answers, like a frozen member.
    let silent = std::net::TcpListener::bind("127.0.0.1:0")?;
    let frozen = silent.local_addr()?.to_string();
    let (meta, timeout) = meta_for(vec![frozen, etcd.endpoint()]).await?;

    let first = bounded("get on a frozen endpoint", timeout + SLACK, meta.get(b"k")).await;
    assert!(
        matches!(first, Err(MetaError::Unavailable(_))),
        "the first call waits its timeout on the frozen endpoint: {first:?}"
    );
    assert_eq!(
        meta.current_endpoint(),
        etcd.endpoint(),
        "the next calls move on"
    );
    for i in 0..5u32 {
        let key = format!("frozen/{i}");
        bounded(
            "put after moving off the frozen endpoint",
            timeout,
            meta.put(key.as_bytes(), b"v", Precondition::None, None),
        )
        .await?;
    }
    drop(silent);
    Ok(())
}

#[tokio::test]
async fn given_a_watch_when_etcd_is_killed_or_paused_then_the_stream_ends_with_unavailable(
) -> anyhow::Result<()> {
    let mut etcd = EtcdProcess::start().await?;
    let config = EtcdConfig::new([etcd.endpoint()]);
    // A broken connection is noticed within one keep-alive interval plus timeout.
    let detect = config.keep_alive_interval + config.keep_alive_timeout + SLACK;
    let meta = EtcdMeta::connect(config).await?;

    // Killed: the connection closes.
    let put = meta.put(b"w/a", b"1", Precondition::None, None).await?;
    let mut watch = meta.watch(b"w/", put.revision).await?;
    let first = watch.next().await.context("watch ended early")??;
    assert_eq!(first.events.len(), 1);
    etcd.kill();
    let end = bounded("a watch on a killed etcd to end", detect, watch.next()).await;
    assert!(
        matches!(end, Some(Err(WatchError::Unavailable(_)))),
        "{end:?}"
    );
    etcd.restart().await?;

    // Paused: the connection stays open but keep-alive pings go unanswered.
    let put = wait_until(RECOVERY, "a put after restart", || async {
        Ok(meta.put(b"w/b", b"2", Precondition::None, None).await?)
    })
    .await?;
    let mut watch = meta.watch(b"w/", put.revision).await?;
    let first = watch.next().await.context("watch ended early")??;
    assert_eq!(first.events[0].revision(), put.revision);
    etcd.pause();
    let end = bounded("a watch on a paused etcd to end", detect, watch.next()).await;
    etcd.resume();
    assert!(
        matches!(end, Some(Err(WatchError::Unavailable(_)))),
        "{end:?}"
    );
    Ok(())
}

/// etcd (default `--grpc-keepalive-min-time 5s`) closes a connection whose client pings
/// more often than that with GOAWAY "too_many_pings". With a 1 s ping interval every
/// idle watch broke after ~4 s; with the default interval it stays open.
#[tokio::test]
async fn given_an_idle_watch_when_nothing_changes_past_etcds_ping_policy_then_it_stays_open_and_sees_the_next_write(
) -> anyhow::Result<()> {
    let etcd = EtcdProcess::start().await?;
    let config = EtcdConfig::new([etcd.endpoint()]);
    assert!(
        config.keep_alive_interval >= Duration::from_secs(5),
        "{config:?}"
    );
    let meta = EtcdMeta::connect(config).await?;
    let start = meta.status().await?.revision + 1;
    let mut watch = meta.watch(b"idle/", start).await?;
    // Two of etcd's ping-strike windows without any event on the stream.
    let idle = tokio::time::timeout(Duration::from_secs(9), watch.next()).await;
    assert!(
        idle.is_err(),
        "the idle watch ended or saw an event: {idle:?}"
    );
    let put = meta.put(b"idle/a", b"1", Precondition::None, None).await?;
    let next = bounded("the write on the idle watch", SLACK, watch.next()).await;
    match next {
        Some(Ok(batch)) => assert_eq!(batch.events[0].revision(), put.revision),
        other => panic!("the idle watch broke: {other:?}"),
    }
    Ok(())
}

/// Reads one gauge from etcd's `/metrics` on the client port.
fn etcd_metric(endpoint: &str, name: &str) -> anyhow::Result<f64> {
    let body =
        meshd_test_support::http::get_blocking(endpoint, "/metrics", Duration::from_secs(2))?.body;
    let line = body
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .with_context(|| format!("metric {name} not found"))?;
    let value = line
        .split_whitespace()
        .nth(1)
        .context("metric without a value")?;
    Ok(value.parse()?)
}

#[tokio::test]
async fn dropping_a_watch_stream_cancels_the_watcher_in_etcd() -> anyhow::Result<()> {
    const WATCHERS: &str = "etcd_debugging_mvcc_watcher_total";
    let etcd = EtcdProcess::start().await?;
    let (meta, _) = meta_for(vec![etcd.endpoint()]).await?;
    let endpoint = etcd.endpoint();
    let watchers = |expected: f64| {
        let endpoint = endpoint.clone();
        async move {
            let n = etcd_metric(&endpoint, WATCHERS)?;
            ensure!(n == expected, "{n} watchers, expected {expected}");
            Ok(())
        }
    };

    let a = meta.watch(b"drop/", 1).await?;
    let b = meta.watch(b"drop/", 1).await?;
    wait_until(RECOVERY, "two watchers in etcd", || watchers(2.0)).await?;
    drop(a);
    wait_until(RECOVERY, "one watcher after dropping one stream", || {
        watchers(1.0)
    })
    .await?;
    drop(b);
    wait_until(RECOVERY, "no watcher after dropping both", || watchers(0.0)).await?;
    Ok(())
}

#[tokio::test]
async fn lease_ttl_is_rounded_up_to_whole_seconds() -> anyhow::Result<()> {
    let etcd = EtcdProcess::start().await?;
    let (meta, _) = meta_for(vec![etcd.endpoint()]).await?;

    let lease = meta.grant(Duration::from_millis(1500)).await?;
    assert_eq!(lease.ttl, Duration::from_secs(2));
    assert_eq!(meta.keep_alive(lease.id).await?, Duration::from_secs(2));

    let short = meta.grant(Duration::from_millis(1)).await?;
    assert_eq!(short.ttl, Duration::from_secs(1), "at least one second");
    let whole = meta.grant(Duration::from_secs(3)).await?;
    assert_eq!(
        whole.ttl,
        Duration::from_secs(3),
        "whole seconds stay as they are"
    );

    meta.revoke(lease.id).await?;
    let gone = meta.keep_alive(lease.id).await;
    assert_eq!(gone, Err(MetaError::LeaseNotFound(lease.id)));
    let again = meta.revoke(lease.id).await;
    assert_eq!(again, Err(MetaError::LeaseNotFound(lease.id)));
    Ok(())
}

#[test]
fn config_parse_rejects_bad_urls() {
    let ok = EtcdConfig::parse("etcd://127.0.0.1:2379,10.0.0.2:2379").expect("valid");
    assert_eq!(ok.endpoints, vec!["127.0.0.1:2379", "10.0.0.2:2379"]);
    assert_eq!(ok.request_timeout, Duration::from_secs(2));

    for (url, check) in [
        ("http://127.0.0.1:2379", "Scheme"),
        ("etcd://", "NoEndpoints"),
        ("etcd://127.0.0.1", "MissingPort"),
        ("etcd://127.0.0.1:2379,", "MissingHost"),
        ("etcd://127.0.0.1:99999", "InvalidPort"),
        ("etcd://127.0.0.1:2379/meshd", "InvalidEndpoint"),
    ] {
        let err: ConfigError = EtcdConfig::parse(url).expect_err(url);
        assert!(format!("{err:?}").starts_with(check), "{url}: {err:?}");
        assert!(
            err.to_string().contains(url),
            "the error names {url}: {err}"
        );
    }
}
