//! `meshd::serve` in process: an instance on a listener the caller bound, driven through
//! the typed client (`meshd-client`) and stopped by the caller's shutdown future.
//! Durability is proven through the binary elsewhere; this proves the library entry
//! point, the client against the real server, and that a stopped `serve` has ended
//! every task it started and closed its stores (a second `serve` opens the same data
//! directory in the same process).

use meshd_client::{Client, Pull};
use serde_json::json;
use std::time::Duration;

async fn start(
    dir: &std::path::Path,
) -> (
    Client,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = meshd::Config::resolve(meshd::ServeArgs {
        data_dir: Some(dir.to_path_buf()),
        ..Default::default()
    })
    .unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(meshd::serve(listener, config, async move {
        let _ = stopped.await;
    }));
    let client = Client::connect(&format!("http://{addr}")).unwrap();
    let mut server = server;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let ready = client.ready().await;
        if matches!(ready, Ok(true)) {
            break;
        }
        if server.is_finished() {
            panic!("serve ended before it was ready: {:?}", (&mut server).await);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never ready: {ready:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (client, stop, server)
}

async fn stop(
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<anyhow::Result<()>>,
) {
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("serve returns after its shutdown future")
        .expect("serve did not panic")
        .expect("serve stopped cleanly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_bound_listener_then_serve_runs_an_instance_until_told_to_stop() {
    let dir = tempfile::tempdir().unwrap();
    let (meshd, halt, server) = start(dir.path()).await;
    assert!(meshd.create_topic("orders", 2).await.unwrap());
    assert!(
        !meshd.create_topic("orders", 2).await.unwrap(),
        "exists alike"
    );
    meshd
        .put_subscription("billing", &json!({ "topic": "orders" }))
        .await
        .unwrap();
    let events: Vec<_> = (0..3)
        .map(|i| json!({"specversion": "1.0", "id": format!("o-{i}"), "source": "/shop", "type": "order.placed"}))
        .collect();
    let stored = meshd.publish("orders", &events).await.unwrap();
    assert_eq!(stored.len(), 3);
    assert!(stored
        .iter()
        .zip(&events)
        .all(|(s, e)| e["id"] == s.id.as_str()));
    let pull = Pull {
        max_events: Some(10),
        wait_ms: Some(1000),
        ..Pull::default()
    };
    let mut got = Vec::new();
    while got.len() < 3 {
        let more = meshd.pull("billing", &pull).await.unwrap();
        assert!(!more.is_empty(), "fewer than 3 deliveries: {got:?}");
        got.extend(more);
    }
    assert!(got.iter().all(|d| d.attempt == 1));
    let ids: Vec<String> = got.iter().map(|d| d.delivery_id.clone()).collect();
    let acked = meshd.ack("billing", &ids).await.unwrap();
    assert_eq!(acked.acked.len(), 3, "{acked:?}");
    // A problem answer is a typed error with the contract's status and detail.
    match meshd.pull("nobody", &pull).await {
        Err(meshd_client::Error::Api(p)) => assert_eq!(p.status, 404, "{p:?}"),
        other => panic!("pull of an unknown subscription: {other:?}"),
    }
    stop(halt, server).await;
    let gone = meshd.ready().await.unwrap_err();
    assert!(
        matches!(gone, meshd_client::Error::Unreachable(_)),
        "{gone}"
    );
}

/// Structured shutdown: when `serve` returns, every background task it started has
/// ended and the Local engine is closed, so the same process can open the directory
/// again (RocksDB's lock and meshd's own are released) and finds its state there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_stopped_serve_then_a_second_serve_opens_the_same_directory_with_its_state() {
    let dir = tempfile::tempdir().unwrap();
    let pull = Pull {
        max_events: Some(10),
        wait_ms: Some(1000),
        ..Pull::default()
    };
    let (meshd, halt, server) = start(dir.path()).await;
    assert!(meshd.create_topic("orders", 1).await.unwrap());
    meshd
        .put_subscription(
            "billing",
            &json!({ "topic": "orders", "ack_timeout_ms": 1000 }),
        )
        .await
        .unwrap();
    let events: Vec<_> = (0..3)
        .map(|i| json!({"specversion": "1.0", "id": format!("o-{i}"), "source": "/shop", "type": "order.placed"}))
        .collect();
    meshd.publish("orders", &events).await.unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        let more = meshd.pull("billing", &pull).await.unwrap();
        assert!(!more.is_empty(), "fewer than 3 deliveries: {got:?}");
        got.extend(more);
    }
    got.sort_by_key(|d| d.offset);
    // The first stays unacked; the others are acked.
    let acked: Vec<String> = got[1..].iter().map(|d| d.delivery_id.clone()).collect();
    assert_eq!(meshd.ack("billing", &acked).await.unwrap().acked.len(), 2);
    stop(halt, server).await;

    let (meshd, halt, server) = start(dir.path()).await;
    let topics = meshd.topics().await.unwrap();
    assert!(topics.iter().any(|t| t.name == "orders"), "{topics:?}");
    // The unacked event comes back once its lease has run out, as attempt 2; the
    // acked ones never do.
    let mut again = Vec::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while again.is_empty() && tokio::time::Instant::now() < until {
        again = meshd.pull("billing", &pull).await.unwrap();
    }
    let seen: Vec<(u64, u32)> = again.iter().map(|d| (d.offset, d.attempt)).collect();
    assert_eq!(seen, vec![(got[0].offset, 2)], "{again:?}");
    let ids: Vec<String> = again.iter().map(|d| d.delivery_id.clone()).collect();
    assert_eq!(meshd.ack("billing", &ids).await.unwrap().acked.len(), 1);
    assert!(meshd.pull("billing", &pull).await.unwrap().is_empty());
    stop(halt, server).await;
}
