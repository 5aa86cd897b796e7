//! The JetStream log against a nats-server that requires TLS and a user and
//! password: the right CA and password append and read back (and so does a client
//! certificate when the server demands one); a wrong password, no credentials, a
//! CA that did not sign the server's certificate or a plaintext client fail at
//! connect with an error that says which, within the connect deadline; a TLS file
//! that cannot be read is refused by name before any connection.

mod common;

use meshd_log_nats::{NatsConfig, NatsCredentials, NatsLog, NatsTls};
use meshd_stores::log::{LogError, PartitionLog};
use meshd_test_support::certs::TestCerts;
use meshd_test_support::nats::{NatsOptions, NatsProcess};
use std::time::{Duration, Instant};

const USER: &str = "meshd";
const PASSWORD: &str = "s3cret-nats";
/// Scheduling slack on top of the connect deadline (the machine may be busy).
const SLACK: Duration = Duration::from_secs(3);

async fn secured_nats(client_cert_auth: bool) -> (NatsProcess, TestCerts, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let certs = TestCerts::generate(dir.path()).expect("certs");
    let nats = NatsProcess::start_with(NatsOptions {
        tls: Some(certs.clone()),
        client_cert_auth,
        credentials: Some((USER.into(), PASSWORD.into())),
        ..NatsOptions::default()
    })
    .await
    .expect("nats-server starts with TLS and authorization");
    (nats, certs, dir)
}

fn config(
    nats: &NatsProcess,
    ca: &TestCerts,
    client_cert: Option<&TestCerts>,
    password: Option<&str>,
) -> NatsConfig {
    let mut c = common::config(nats);
    c.tls = Some(NatsTls {
        ca_file: ca.ca.clone(),
        cert_file: client_cert.map(|c| c.client_cert.clone()),
        key_file: client_cert.map(|c| c.client_key.clone()),
    });
    c.credentials = password.map(|p| NatsCredentials {
        user: USER.into(),
        password: p.into(),
    });
    c
}

/// Connects, asserting that the answer (either way) comes within the deadline.
async fn connect_bounded(config: NatsConfig) -> Result<NatsLog, LogError> {
    let bound = config.connect_timeout + SLACK;
    let t0 = Instant::now();
    let out = NatsLog::connect(config).await;
    let elapsed = t0.elapsed();
    assert!(
        elapsed < bound,
        "connect took {elapsed:?}, more than {bound:?}"
    );
    out
}

async fn append_and_read_back(log: &NatsLog, topic: &str) {
    let got = log
        .append(
            topic,
            vec![
                (0, b"one".to_vec()),
                (0, b"two".to_vec()),
                (1, b"three".to_vec()),
            ],
        )
        .await
        .expect("append over TLS");
    assert_eq!(got, vec![(0, 0), (0, 1), (1, 0)]);
    let back = log.read(topic, 0, 0, 10, usize::MAX).await.expect("read");
    let payloads: Vec<&[u8]> = back.iter().map(|e| e.payload.as_slice()).collect();
    assert_eq!(payloads, vec![b"one".as_slice(), b"two".as_slice()]);
    let back = log.read(topic, 1, 0, 10, usize::MAX).await.expect("read");
    assert_eq!(back.len(), 1);
    assert_eq!(back[0].payload, b"three");
}

fn assert_unavailable_saying(result: Result<NatsLog, LogError>, says: &str) {
    match result {
        Err(LogError::Unavailable(m)) if m.contains(says) => {
            assert!(!m.contains(PASSWORD), "the password leaked: {m}");
        }
        Err(other) => panic!("expected Unavailable saying {says:?}, got {other:?}"),
        Ok(_) => panic!("expected Unavailable saying {says:?}, but it connected"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_nats_with_tls_and_a_password_when_connecting_with_the_ca_and_the_password_then_appends_read_back(
) {
    let (mut nats, certs, _dir) = secured_nats(false).await;
    let log = connect_bounded(config(&nats, &certs, None, Some(PASSWORD)))
        .await
        .expect("connect with CA and password");
    append_and_read_back(&log, "secure").await;

    // The client reconnects by itself, again over TLS with the password.
    nats.restart().await.expect("restart");
    meshd_test_support::wait::wait_until(
        Duration::from_secs(15),
        "an append after the server restart",
        || async { Ok(log.append("secure", vec![(0, b"four".to_vec())]).await?) },
    )
    .await
    .expect("appends after a reconnect");
    let back = log
        .read("secure", 0, 0, 10, usize::MAX)
        .await
        .expect("read");
    assert_eq!(
        back.last().map(|e| e.payload.as_slice()),
        Some(b"four".as_slice())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_nats_demanding_client_certificates_when_connecting_with_one_then_appends_read_back_and_without_one_connect_fails(
) {
    let (nats, certs, _dir) = secured_nats(true).await;
    let log = connect_bounded(config(&nats, &certs, Some(&certs), Some(PASSWORD)))
        .await
        .expect("connect with a client certificate");
    append_and_read_back(&log, "mtls").await;
    let without = connect_bounded(config(&nats, &certs, None, Some(PASSWORD))).await;
    assert!(
        matches!(without, Err(LogError::Unavailable(_))),
        "{:?}",
        without.map(|_| ())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_nats_with_a_password_when_the_password_is_wrong_or_missing_then_connect_fails_with_authorization_refused_within_the_deadline(
) {
    let (nats, certs, _dir) = secured_nats(false).await;
    assert_unavailable_saying(
        connect_bounded(config(&nats, &certs, None, Some("wrong-password"))).await,
        "authorization refused",
    );
    assert_unavailable_saying(
        connect_bounded(config(&nats, &certs, None, None)).await,
        "authorization refused",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_nats_requiring_tls_when_connecting_in_plaintext_or_with_another_ca_then_connect_fails_and_never_in_plaintext(
) {
    let (nats, _certs, _dir) = secured_nats(false).await;
    // No TLS configured: the server demands it, the client must not get through.
    let mut plain = common::config(&nats);
    plain.credentials = Some(NatsCredentials {
        user: USER.into(),
        password: PASSWORD.into(),
    });
    let result = connect_bounded(plain).await;
    assert!(
        matches!(result, Err(LogError::Unavailable(_))),
        "{:?}",
        result.map(|_| ())
    );

    // A CA that did not sign the server's certificate.
    let other_dir = tempfile::tempdir().expect("temp dir");
    let other = TestCerts::generate(other_dir.path()).expect("certs");
    assert_unavailable_saying(
        connect_bounded(config(&nats, &other, None, Some(PASSWORD))).await,
        "TLS failed",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_nats_without_tls_when_the_client_requires_it_then_connect_fails() {
    let nats = common::server().await;
    let dir = tempfile::tempdir().expect("temp dir");
    let certs = TestCerts::generate(dir.path()).expect("certs");
    let result = connect_bounded(config(&nats, &certs, None, None)).await;
    assert!(
        matches!(result, Err(LogError::Unavailable(_))),
        "{:?}",
        result.map(|_| ())
    );
}

#[tokio::test]
async fn given_tls_files_that_cannot_be_read_when_connecting_then_invalid_naming_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let certs = TestCerts::generate(dir.path()).expect("certs");
    let missing = dir.path().join("no-such-ca.pem");
    let mut c = NatsConfig {
        servers: vec!["127.0.0.1:1".into()],
        ..NatsConfig::default()
    };
    c.tls = Some(NatsTls {
        ca_file: missing.clone(),
        cert_file: None,
        key_file: None,
    });
    match NatsLog::connect(c.clone()).await {
        Err(LogError::Invalid(m)) if m.contains(&missing.display().to_string()) => {}
        other => panic!(
            "expected Invalid naming {missing:?}: {:?}",
            other.map(|_| ())
        ),
    }
    c.tls = Some(NatsTls {
        ca_file: certs.ca.clone(),
        cert_file: Some(certs.client_cert.clone()),
        key_file: None,
    });
    match NatsLog::connect(c.clone()).await {
        Err(LogError::Invalid(m))
            if m.contains(&certs.client_cert.display().to_string()) && m.contains("key_file") => {}
        other => panic!("expected Invalid naming the cert: {:?}", other.map(|_| ())),
    }
    let missing_key = dir.path().join("no-such-key.pem");
    c.tls = Some(NatsTls {
        ca_file: certs.ca.clone(),
        cert_file: Some(certs.client_cert.clone()),
        key_file: Some(missing_key.clone()),
    });
    match NatsLog::connect(c).await {
        Err(LogError::Invalid(m)) if m.contains(&missing_key.display().to_string()) => {}
        other => panic!(
            "expected Invalid naming {missing_key:?}: {:?}",
            other.map(|_| ())
        ),
    }
}
