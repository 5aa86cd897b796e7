//! The park journal (`meshd_stores::park::ParkJournal`) on a real nats-server: the
//! entries put and not settled are what `load` answers, per subscription incarnation
//! and partition, with their bodies and attempts; a settled entry stays settled; every
//! acknowledged put and settle survives nats-server's SIGKILL; a deleted subscription's
//! entries go; a put under an older owner epoch than the entry's last write is fenced.

mod common;

use meshd_stores::offsets::OffsetKey;
use meshd_stores::park::{JournalWrite, ParkError, ParkJournal, Parked};

/// A new park by the owner of epoch 1.
const NEW: JournalWrite = JournalWrite {
    epoch: 1,
    fresh: true,
};
/// A put over an entry by the owner of epoch 1.
const AGAIN: JournalWrite = JournalWrite {
    epoch: 1,
    fresh: false,
};

fn pkey(subscription: &str, incarnation: i64, partition: u32) -> OffsetKey {
    OffsetKey {
        subscription: subscription.into(),
        incarnation,
        topic: "orders.eu".into(),
        partition,
    }
}

fn entry(offset: u64, due_ms: u64, attempt: u32) -> Parked {
    Parked::new(offset, due_ms, attempt)
}

async fn loaded(j: &dyn ParkJournal, key: &OffsetKey) -> Vec<(u64, u64, u32, String)> {
    let mut v: Vec<_> = j
        .load(key)
        .await
        .unwrap()
        .into_iter()
        .map(|(p, body)| {
            (
                p.offset,
                p.due_ms,
                p.attempt,
                String::from_utf8(body).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_put_and_not_settled_are_loaded_per_partition_and_survive_a_sigkill() {
    let mut nats = common::server().await;
    let j = common::connect(&nats).await;
    let a = pkey("billing.eu", 7, 0);
    // Nothing parked yet (the journal's stream does not even exist): nothing loaded.
    assert!(loaded(&j, &a).await.is_empty());
    j.put(&a, &entry(3, 5000, 0), b"three", NEW).await.unwrap();
    j.put(&a, &entry(1, 9000, 2), b"one", NEW).await.unwrap();
    j.put(&a, &entry(8, 100, 0), b"", NEW).await.unwrap();
    j.put(
        &pkey("billing.eu", 7, 1),
        &entry(3, 1, 0),
        b"other partition",
        NEW,
    )
    .await
    .unwrap();
    j.put(
        &pkey("billing.eu", 8, 0),
        &entry(3, 1, 0),
        b"other incarnation",
        NEW,
    )
    .await
    .unwrap();
    j.put(
        &pkey("billing", 7, 0),
        &entry(3, 1, 0),
        b"other subscription",
        NEW,
    )
    .await
    .unwrap();
    // Settled, and settled twice (a retried settle): gone either way.
    j.settle(&a, 3, 1).await.unwrap();
    j.settle(&a, 3, 1).await.unwrap();
    j.settle(&a, 99, 1).await.unwrap(); // never parked: nothing changes
    let want = vec![(1, 9000, 2, "one".to_string()), (8, 100, 0, String::new())];
    assert_eq!(loaded(&j, &a).await, want);
    assert_eq!(
        loaded(&j, &pkey("billing.eu", 7, 1)).await,
        [(3, 1, 0, "other partition".to_string())]
    );

    // Every acknowledged put and settle is there after nats-server's SIGKILL
    // (`sync_interval: always`).
    nats.kill();
    nats.restart().await.unwrap();
    let j = common::connect(&nats).await;
    assert_eq!(loaded(&j, &a).await, want);

    // A deleted subscription incarnation's entries go, and only its own.
    j.drop_subscription("billing.eu", 7).await.unwrap();
    assert!(loaded(&j, &a).await.is_empty());
    assert!(loaded(&j, &pkey("billing.eu", 7, 1)).await.is_empty());
    assert_eq!(loaded(&j, &pkey("billing.eu", 8, 0)).await.len(), 1);
    assert_eq!(loaded(&j, &pkey("billing", 7, 0)).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_with_more_entries_than_one_read_loads_them_all() {
    let nats = common::server().await;
    let j = common::connect(&nats).await;
    let a = pkey("s", 1, 0);
    let n = 1500u64;
    let puts = (0..n).map(|o| {
        let j = &j;
        let a = &a;
        async move { j.put(a, &entry(o, o, 0), b"x", NEW).await }
    });
    for r in futures::future::join_all(puts).await {
        r.unwrap();
    }
    let got = loaded(&j, &a).await;
    assert_eq!(got.len(), n as usize);
    assert_eq!(got.first().map(|e| e.0), Some(0));
    assert_eq!(got.last().map(|e| e.0), Some(n - 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_that_exists_but_answers_no_direct_gets_is_unavailable_never_read_as_empty() {
    let nats = common::server().await;
    let j = common::connect(&nats).await;
    // The journal's stream exists, but nothing answers direct gets on it (as while no
    // server serves it): what it holds cannot be read, which must not read as nothing
    // parked (a new owner would take the partition with its parked events lost).
    let create = serde_json::json!({
        "name": "meshd_park",
        "subjects": ["meshd.park.>"],
        "storage": "file",
        "max_msgs_per_subject": 1,
        "allow_direct": false,
        "allow_msg_ttl": true,
    });
    let answer = j
        .client()
        .request(
            "$JS.API.STREAM.CREATE.meshd_park".to_string(),
            create.to_string().into(),
        )
        .await
        .expect("create stream");
    assert!(
        !String::from_utf8_lossy(&answer.payload).contains("\"error\""),
        "{:?}",
        answer.payload
    );
    let a = pkey("s", 1, 0);
    j.put(&a, &entry(3, 5000, 0), b"three", NEW).await.unwrap();
    match j.load(&a).await {
        Err(meshd_stores::park::ParkError::Unavailable(reason)) => {
            assert!(reason.contains("direct gets"), "{reason}")
        }
        other => panic!("a journal that cannot be read answered {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_entry_keeps_its_key_and_deliverat_and_a_release_put_replaces_its_due_time() {
    let nats = common::server().await;
    let j = common::connect(&nats).await;
    let a = pkey("ordered", 1, 0);
    let held = Parked {
        key: Some(0xfeed_beef),
        not_before_ms: 77_000,
        ..entry(4, meshd_stores::park::HELD, 0)
    };
    j.put(&a, &held, b"four", NEW).await.unwrap();
    j.put(&a, &entry(2, 1000, 1), b"two", NEW).await.unwrap();
    let all = j.load(&a).await.unwrap();
    assert_eq!(
        all,
        [
            (held.clone(), b"four".to_vec()),
            (entry(2, 1000, 1), b"two".to_vec())
        ]
    );
    // Released: the same subject put again with its due time replaces the entry.
    let released = held.released(90_000);
    j.put(&a, &released, b"four", AGAIN).await.unwrap();
    let mut all = j.load(&a).await.unwrap();
    all.sort_by_key(|(p, _)| p.offset);
    assert_eq!(
        all,
        [
            (entry(2, 1000, 1), b"two".to_vec()),
            (released, b"four".to_vec())
        ]
    );
}

fn owner(epoch: i64, fresh: bool) -> JournalWrite {
    JournalWrite { epoch, fresh }
}

fn fenced(r: Result<(), ParkError>, by: i64) {
    match r {
        Err(ParkError::Fenced(reason)) => {
            assert!(reason.contains(&format!("epoch {by}")), "{reason}")
        }
        other => panic!("a stale owner's put answered {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_owner_cannot_bring_back_an_entry_its_successor_settled_nor_overwrite_its_puts() {
    let nats = common::server().await;
    // Two instances, as after a takeover: the old owner (epoch 5) was paused past its
    // lease, the new one (epoch 9) adopted the partition.
    let old = common::connect(&nats).await;
    let new = common::connect(&nats).await;
    let a = pkey("s", 1, 0);
    old.put(&a, &entry(3, 1000, 0), b"three", owner(5, true))
        .await
        .unwrap();
    // The new owner writes over the old owner's entry (its attempt count after a
    // hand-out): a later epoch may.
    new.put(&a, &entry(3, 1000, 1), b"three", owner(9, false))
        .await
        .unwrap();
    // The old owner wakes and writes its own count: refused, whether it expects the
    // entry or a new one, and the new owner's entry stands.
    fenced(
        old.put(&a, &entry(3, 1000, 7), b"three", owner(5, false))
            .await,
        9,
    );
    fenced(
        old.put(&a, &entry(3, 1000, 7), b"three", owner(5, true))
            .await,
        9,
    );
    assert_eq!(loaded(&new, &a).await, [(3, 1000, 1, "three".to_string())]);

    // The new owner settles it (its consumer acked). The old owner's put after that
    // must not bring it back: the next owner would deliver the acked event again.
    new.settle(&a, 3, 9).await.unwrap();
    fenced(
        old.put(&a, &entry(3, 1000, 7), b"three", owner(5, false))
            .await,
        9,
    );
    fenced(
        old.put(&a, &entry(3, 1000, 7), b"three", owner(5, true))
            .await,
        9,
    );
    assert!(loaded(&new, &a).await.is_empty());

    // The owner itself parks the offset again over its own settle mark (a redriven
    // dead letter at the back of its key), as a new park.
    new.put(&a, &entry(3, 2000, 0), b"three", owner(9, true))
        .await
        .unwrap();
    assert_eq!(loaded(&new, &a).await, [(3, 2000, 0, "three".to_string())]);

    // An entry written without an epoch (by an older release) is any owner's to
    // write over.
    let subject = meshd_log_nats::names::Names::new("meshd").park_subject(&a, 4);
    let mut payload = vec![1u8];
    payload.extend_from_slice(&4u64.to_be_bytes());
    payload.extend_from_slice(&500u64.to_be_bytes());
    payload.extend_from_slice(&0u32.to_be_bytes());
    payload.extend_from_slice(b"four");
    let ack = new
        .client()
        .request(subject, payload.into())
        .await
        .expect("publish as an older release");
    assert!(
        !String::from_utf8_lossy(&ack.payload).contains("\"error\""),
        "{:?}",
        ack.payload
    );
    assert!(loaded(&new, &a)
        .await
        .contains(&(4, 500, 0, "four".to_string())));
    old.put(&a, &entry(4, 500, 1), b"four", owner(5, false))
        .await
        .unwrap();
    assert!(loaded(&new, &a)
        .await
        .contains(&(4, 500, 1, "four".to_string())));
}

/// The park stream's leader and its other replicas, by server name, as the stream's
/// leader reports them.
async fn park_stream_peers(log: &meshd_log_nats::NatsLog) -> Option<(String, Vec<String>)> {
    let answer = log
        .client()
        .request("$JS.API.STREAM.INFO.meshd_park".to_string(), "".into())
        .await
        .ok()?;
    let v: serde_json::Value = serde_json::from_slice(&answer.payload).ok()?;
    let cluster = &v["cluster"];
    let leader = cluster["leader"].as_str()?.to_string();
    let others = cluster["replicas"]
        .as_array()?
        .iter()
        .filter_map(|r| r["name"].as_str().map(str::to_string))
        .collect();
    Some((leader, others))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_three_replicas_a_replica_cut_off_from_its_leader_never_answers_a_short_journal() {
    // A new owner rebuilds its park index from what its nats-server member answers
    // (direct gets, which any replica may answer). A replica that falls behind must
    // answer the whole journal or nothing (the acquisition is retried), never the
    // entries it happens to have: the owner would take the partition with acknowledged
    // parked events lost.
    let cluster = meshd_test_support::nats::NatsCluster::start(3)
        .await
        .expect("a 3-node nats cluster");
    // A member answers JetStream requests once the cluster has a meta leader:
    // connecting is retried.
    let connect = |i: usize| {
        let mut c = common::config(&cluster.nodes[i]);
        c.replicas = 3;
        async move {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            loop {
                match meshd_log_nats::NatsLog::connect(c.clone()).await {
                    Ok(log) => return log,
                    Err(e) if std::time::Instant::now() < deadline => {
                        eprintln!("connect to member {i}: {e}; retried");
                        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    }
                    Err(e) => panic!("member {i}: {e}"),
                }
            }
        }
    };
    // Clients of each member, connected while the cluster is whole (a member cut off
    // from JetStream's meta leader takes no new connection but keeps those it has).
    let mut owners = Vec::new();
    for i in 0..3 {
        owners.push(connect(i).await);
    }
    let a = pkey("s", 1, 0);
    // The first put creates the journal with three replicas.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        match owners[0].put(&a, &entry(1, 100, 0), b"one", NEW).await {
            Ok(()) => break,
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("first put: {e}; retried");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            Err(e) => panic!("the journal was never created: {e}"),
        }
    }
    let (leader, others) = park_stream_peers(&owners[0]).await.expect("stream peers");
    assert_eq!(others.len(), 2, "three replicas: {leader} and {others:?}");
    let lagging = cluster.index_of(&others[0]).expect("a member");
    let leader_i = cluster.index_of(&leader).expect("a member");
    // One replica falls behind: cut off from the others, its clients still reach it.
    cluster.isolate(lagging);
    // The leader and the third replica are a quorum: these puts are acknowledged.
    for o in 2..=5u64 {
        owners[leader_i]
            .put(&a, &entry(o, 100 + o, 0), b"later", NEW)
            .await
            .expect("a put with a quorum");
    }
    let want: Vec<u64> = (1..=5).collect();
    let offsets = |v: &[(Parked, Vec<u8>)]| v.iter().map(|(p, _)| p.offset).collect::<Vec<_>>();
    assert_eq!(offsets(&owners[leader_i].load(&a).await.unwrap()), want);
    // Through the lagging replica: the whole journal or an error, never a short one
    // (direct gets answered [1] here).
    for _ in 0..2 {
        match owners[lagging].load(&a).await {
            Err(meshd_stores::park::ParkError::Unavailable(_)) => {}
            Ok(got) => assert_eq!(offsets(&got), want, "a short journal was answered"),
            Err(e) => panic!("{e}"),
        }
    }
    // Healed, it catches up and answers everything.
    cluster.heal(lagging);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        match owners[lagging].load(&a).await {
            Ok(got) if offsets(&got) == want => break,
            other if std::time::Instant::now() < deadline => {
                eprintln!("load through the healed member: {other:?}; retried");
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
            other => panic!("the healed member answered {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_from_the_stream_leader_load_what_direct_gets_load_page_by_page() {
    // With replicas > 1 a takeover reads the journal from the stream's leader (the
    // test above shows why); on one server that path must load exactly what the
    // direct one does.
    let nats = common::server().await;
    let direct = common::connect(&nats).await;
    let mut c = common::config(&nats);
    c.park_reads_from_leader = true;
    let leader = meshd_log_nats::NatsLog::connect(c).await.expect("connect");
    let a = pkey("s", 1, 0);
    // Nothing parked yet, the journal does not even exist: nothing loaded.
    assert!(leader.load(&a).await.unwrap().is_empty());
    for o in 0..1200u64 {
        direct
            .put(&a, &entry(o, 10_000 + o, (o % 3) as u32), b"x", NEW)
            .await
            .unwrap();
    }
    direct
        .put(&pkey("s", 1, 1), &entry(5, 1, 0), b"other partition", NEW)
        .await
        .unwrap();
    for o in (0..1200u64).step_by(7) {
        direct.settle(&a, o, 1).await.unwrap();
    }
    let by_leader = loaded(&leader, &a).await;
    assert_eq!(
        by_leader.len(),
        1200 - 172,
        "every entry put and not settled"
    );
    assert_eq!(by_leader, loaded(&direct, &a).await);
    assert_eq!(
        loaded(&leader, &pkey("s", 1, 1)).await,
        [(5, 1, 0, "other partition".to_string())]
    );
}
