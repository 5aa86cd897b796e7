//! `EtcdMeta` against an etcd that serves TLS only and has authentication enabled:
//! the right CA and password work for every kind of call (put, get, compare-and-set,
//! a fenced write, leases, watches); a wrong password, a missing CA or a missing
//! file fail with an error that says so, within the request timeout, and never fall
//! back to plaintext. Auth tokens outlive etcd's token TTL and an etcd restart
//! (which forgets every token): the client re-authenticates by itself.

use futures::StreamExt;
use meshd_meta::fence::Ownership;
use meshd_meta::{Meta, MetaError, Precondition, Txn};
use meshd_meta_etcd::{EtcdConfig, EtcdCredentials, EtcdMeta, EtcdTls};
use meshd_test_support::certs::TestCerts;
use meshd_test_support::etcd::{EtcdOptions, EtcdProcess, ROOT_USER};
use std::future::Future;
use std::time::{Duration, Instant};

const PASSWORD: &str = "s3cret-root";
/// Scheduling slack on top of the request timeout (the machine may be busy).
const SLACK: Duration = Duration::from_secs(2);

/// etcd over TLS (optionally demanding a client certificate) with auth enabled,
/// and the temp dir holding its certificates.
async fn secured_etcd(
    client_cert_auth: bool,
    auth_token_ttl: Option<Duration>,
) -> anyhow::Result<(EtcdProcess, TestCerts, tempfile::TempDir)> {
    let dir = tempfile::tempdir()?;
    let certs = TestCerts::generate(dir.path())?;
    let mut etcd = EtcdProcess::start_with(EtcdOptions {
        tls: Some(certs.clone()),
        client_cert_auth,
        auth_token_ttl,
        ..EtcdOptions::default()
    })
    .await?;
    etcd.enable_auth(PASSWORD).await?;
    Ok((etcd, certs, dir))
}

fn config(etcd: &EtcdProcess, certs: &TestCerts, client_cert: bool, password: &str) -> EtcdConfig {
    let mut config = EtcdConfig::new([etcd.endpoint()]);
    config.tls = Some(EtcdTls {
        ca_file: certs.ca.clone(),
        cert_file: client_cert.then(|| certs.client_cert.clone()),
        key_file: client_cert.then(|| certs.client_key.clone()),
    });
    config.credentials = Some(EtcdCredentials {
        user: ROOT_USER.into(),
        password: password.into(),
    });
    config
}

/// Runs `f`, asserting that it returns within `bound`, and returns its result.
async fn bounded<T>(what: &str, bound: Duration, f: impl Future<Output = T>) -> T {
    let t0 = Instant::now();
    let out = f.await;
    let elapsed = t0.elapsed();
    assert!(
        elapsed < bound,
        "{what} took {elapsed:?}, more than {bound:?}"
    );
    out
}

/// put, get, compare-and-set (a stale one refused), a fenced write (a stale owner
/// fenced), a lease with a keep-alive, and a watch that sees a write.
async fn exercise(meta: &EtcdMeta, tag: &str) -> anyhow::Result<()> {
    let key = format!("{tag}/k").into_bytes();
    let put = meta.put(&key, b"v1", Precondition::None, None).await?;
    let got = meta.get(&key).await?.kv.expect("the key just written");
    assert_eq!(got.value, b"v1");

    let cas = meta
        .put(&key, b"v2", Precondition::ModRevision(put.revision), None)
        .await?;
    let stale = meta
        .put(&key, b"v3", Precondition::ModRevision(put.revision), None)
        .await;
    assert!(
        matches!(stale, Err(MetaError::Conflict { .. })),
        "{stale:?}"
    );
    assert_eq!(
        meta.get(&key).await?.kv.expect("kept").mod_revision,
        cas.revision
    );

    let owner_key = format!("{tag}/owner").into_bytes();
    let data_key = format!("{tag}/owned").into_bytes();
    let first = Ownership::acquire(meta, &owner_key, b"a", None).await?;
    first
        .commit(meta, Txn::new().put(&data_key, b"by-a"))
        .await?;
    let second = Ownership::take_over(meta, &owner_key, b"b", None).await?;
    let fenced = first
        .commit(meta, Txn::new().put(&data_key, b"stale"))
        .await;
    assert_eq!(fenced.unwrap_err(), MetaError::Fenced);
    second
        .commit(meta, Txn::new().put(&data_key, b"by-b"))
        .await?;
    assert_eq!(meta.get(&data_key).await?.kv.expect("owned").value, b"by-b");

    let lease = meta.grant(Duration::from_secs(30)).await?;
    assert!(meta.keep_alive(lease.id).await? > Duration::ZERO);
    meta.revoke(lease.id).await?;

    let start = meta.get(&key).await?.revision + 1;
    let watch_prefix = format!("{tag}/w/").into_bytes();
    let mut watch = meta.watch(&watch_prefix, start).await?;
    let watched = format!("{tag}/w/x").into_bytes();
    meta.put(&watched, b"seen", Precondition::None, None)
        .await?;
    let batch = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await?
        .expect("watch open")?;
    assert_eq!(batch.events.len(), 1, "{batch:?}");
    // etcd's quota, read from its /metrics over the same TLS (and client
    // certificate): the default 2 GiB.
    assert_eq!(
        meta.status().await?.quota_bytes,
        Some(2 * 1024 * 1024 * 1024)
    );
    Ok(())
}

#[tokio::test]
async fn given_etcd_with_tls_and_auth_when_connecting_with_the_ca_and_right_password_then_put_get_cas_and_fenced_writes_work(
) -> anyhow::Result<()> {
    let (etcd, certs, _dir) = secured_etcd(false, None).await?;
    let meta = EtcdMeta::connect(config(&etcd, &certs, false, PASSWORD)).await?;
    exercise(&meta, "plain-ca").await?;
    let debug = format!("{meta:?}");
    assert!(!debug.contains(PASSWORD), "{debug}");
    Ok(())
}

#[tokio::test]
async fn given_etcd_demanding_client_certificates_when_connecting_with_one_then_calls_work_and_without_one_they_fail(
) -> anyhow::Result<()> {
    let (etcd, certs, _dir) = secured_etcd(true, None).await?;
    let meta = EtcdMeta::connect(config(&etcd, &certs, true, PASSWORD)).await?;
    exercise(&meta, "mtls").await?;

    let without = EtcdMeta::connect(config(&etcd, &certs, false, PASSWORD)).await?;
    let timeout = EtcdConfig::DEFAULT_REQUEST_TIMEOUT;
    let read = bounded(
        "get without a client cert",
        timeout + SLACK,
        without.get(b"k"),
    )
    .await;
    assert!(matches!(read, Err(MetaError::Unavailable(_))), "{read:?}");
    Ok(())
}

#[tokio::test]
async fn given_etcd_with_auth_when_the_password_is_wrong_then_every_call_fails_naming_authentication_within_the_timeout(
) -> anyhow::Result<()> {
    let (etcd, certs, _dir) = secured_etcd(false, None).await?;
    let config = config(&etcd, &certs, false, "wrong-password");
    let timeout = config.request_timeout;
    // connect contacts nobody; the first call authenticates.
    let meta = EtcdMeta::connect(config).await?;
    let read = bounded("get with a wrong password", timeout + SLACK, meta.get(b"k")).await;
    match &read {
        Err(MetaError::Unavailable(m)) if m.contains("etcd authentication refused") => {}
        other => panic!("expected a named authentication error, got {other:?}"),
    }
    let write = bounded(
        "put with a wrong password",
        timeout + SLACK,
        meta.put(b"k", b"v", Precondition::None, None),
    )
    .await;
    match &write {
        Err(MetaError::Unavailable(m)) if m.contains("etcd authentication refused") => {}
        other => panic!("a refused write is known not applied: {other:?}"),
    }

    // No credentials at all against an etcd that requires them: refused, named.
    let mut anonymous = EtcdConfig::new([etcd.endpoint()]);
    anonymous.tls = Some(EtcdTls {
        ca_file: certs.ca.clone(),
        cert_file: None,
        key_file: None,
    });
    let meta = EtcdMeta::connect(anonymous).await?;
    let read = bounded("get without credentials", timeout + SLACK, meta.get(b"k")).await;
    match &read {
        Err(MetaError::Unavailable(m)) if m.contains("etcd authentication refused") => {}
        other => panic!("expected a named authentication error, got {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn given_etcd_serving_tls_when_connecting_without_the_ca_then_calls_fail_and_never_succeed_in_plaintext(
) -> anyhow::Result<()> {
    let (etcd, _certs, _dir) = secured_etcd(false, None).await?;
    let mut config = EtcdConfig::new([etcd.endpoint()]);
    config.credentials = Some(EtcdCredentials {
        user: ROOT_USER.into(),
        password: PASSWORD.into(),
    });
    let timeout = config.request_timeout;
    let meta = EtcdMeta::connect(config).await?;
    let read = bounded(
        "plaintext get on a TLS etcd",
        timeout + SLACK,
        meta.get(b"k"),
    )
    .await;
    assert!(matches!(read, Err(MetaError::Unavailable(_))), "{read:?}");
    let write = bounded(
        "plaintext put on a TLS etcd",
        timeout + SLACK,
        meta.put(b"k", b"v", Precondition::None, None),
    )
    .await;
    assert!(write.is_err(), "{write:?}");

    // An http:// endpoint with TLS configured is refused at connect.
    let other = tempfile::tempdir()?;
    let certs = TestCerts::generate(other.path())?;
    let mut config = EtcdConfig::new([format!("http://{}", etcd.endpoint())]);
    config.tls = Some(EtcdTls {
        ca_file: certs.ca.clone(),
        cert_file: None,
        key_file: None,
    });
    let err = EtcdMeta::connect(config)
        .await
        .expect_err("http:// with TLS");
    assert!(matches!(err, MetaError::InvalidRequest(_)), "{err:?}");

    // A CA that did not sign etcd's certificate: the handshake fails.
    let mut config = EtcdConfig::new([etcd.endpoint()]);
    config.tls = Some(EtcdTls {
        ca_file: certs.ca.clone(),
        cert_file: None,
        key_file: None,
    });
    let meta = EtcdMeta::connect(config).await?;
    let read = bounded("get with the wrong CA", timeout + SLACK, meta.get(b"k")).await;
    assert!(matches!(read, Err(MetaError::Unavailable(_))), "{read:?}");
    Ok(())
}

#[tokio::test]
async fn given_tls_files_that_cannot_be_read_when_connecting_then_invalid_request_naming_the_file(
) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let certs = TestCerts::generate(dir.path())?;
    let missing = dir.path().join("no-such-ca.pem");
    let mut config = EtcdConfig::new(["127.0.0.1:1"]);
    config.tls = Some(EtcdTls {
        ca_file: missing.clone(),
        cert_file: None,
        key_file: None,
    });
    let err = EtcdMeta::connect(config.clone())
        .await
        .expect_err("missing CA");
    match &err {
        MetaError::InvalidRequest(m) if m.contains(&missing.display().to_string()) => {}
        other => panic!("expected InvalidRequest naming {missing:?}: {other:?}"),
    }

    config.tls = Some(EtcdTls {
        ca_file: certs.ca.clone(),
        cert_file: Some(certs.client_cert.clone()),
        key_file: None,
    });
    let err = EtcdMeta::connect(config.clone())
        .await
        .expect_err("cert without key");
    match &err {
        MetaError::InvalidRequest(m)
            if m.contains(&certs.client_cert.display().to_string()) && m.contains("key_file") => {}
        other => panic!("expected InvalidRequest naming the cert and key_file: {other:?}"),
    }

    let missing_key = dir.path().join("no-such-key.pem");
    config.tls = Some(EtcdTls {
        ca_file: certs.ca.clone(),
        cert_file: Some(certs.client_cert.clone()),
        key_file: Some(missing_key.clone()),
    });
    let err = EtcdMeta::connect(config).await.expect_err("missing key");
    match &err {
        MetaError::InvalidRequest(m) if m.contains(&missing_key.display().to_string()) => {}
        other => panic!("expected InvalidRequest naming {missing_key:?}: {other:?}"),
    }
    Ok(())
}

#[tokio::test]
async fn given_an_authenticated_client_when_its_token_expires_and_etcd_restarts_then_calls_leases_and_watches_keep_working(
) -> anyhow::Result<()> {
    // Tokens unused for 2 s expire.
    let (mut etcd, certs, _dir) = secured_etcd(false, Some(Duration::from_secs(2))).await?;
    let meta = EtcdMeta::connect(config(&etcd, &certs, false, PASSWORD)).await?;
    exercise(&meta, "fresh").await?;
    let lease = meta.grant(Duration::from_secs(60)).await?;

    // Idle past the token TTL before each kind of call, so each is the first to
    // meet an expired token: it re-authenticates by itself.
    let idle = Duration::from_secs(4);
    // A client that does not re-authenticate shows that the token did expire.
    let mut raw = etcd.admin_client().await?;
    tokio::time::sleep(idle).await;
    let expired = raw.get("fresh/k", None).await;
    assert!(
        matches!(&expired, Err(e) if e.to_string().contains("invalid auth token")),
        "{expired:?}"
    );
    let start = meta.get(b"fresh/k").await.map(|r| r.revision + 1);
    tokio::time::sleep(idle).await;
    let mut watch = meta.watch(b"expired/w/", start?).await?;
    meta.put(b"expired/w/x", b"seen", Precondition::None, None)
        .await?;
    let batch = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await?
        .expect("watch open")?;
    assert_eq!(batch.events.len(), 1, "{batch:?}");
    tokio::time::sleep(idle).await;
    assert!(meta.keep_alive(lease.id).await? > Duration::ZERO);
    tokio::time::sleep(idle).await;
    meta.put(b"expired/k", b"v", Precondition::None, None)
        .await?;
    tokio::time::sleep(idle).await;
    exercise(&meta, "expired").await?;

    // A restarted etcd knows no token at all.
    etcd.restart().await?;
    meshd_test_support::wait::wait_until(
        Duration::from_secs(15),
        "a get after the etcd restart",
        || async { Ok(meta.get(b"fresh/k").await.map(|_| ())?) },
    )
    .await?;
    exercise(&meta, "restarted").await?;
    assert!(meta.keep_alive(lease.id).await? > Duration::ZERO);
    Ok(())
}
