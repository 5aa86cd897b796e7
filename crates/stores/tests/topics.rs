//! # The TopicStore conformance suite, on both Meta backends
//!
//! Every case runs on the embedded Meta and on a real etcd ([`common::backend_cases!`]).
//! "Two instances" are two stores on two Meta clients. A backend "restart" SIGKILLs and
//! restarts etcd, or closes and reopens the embedded RocksDB.
//!
//! Stories pinned here: PUT semantics of `ensure` (created / same / mismatch); names
//! and partition counts outside their ranges are rejected naming the field; caches of
//! two instances converge; `get` finds a topic created elsewhere at once (its cache
//! miss reads Meta); a referenced topic is never deleted (`InUse`) and an absent one is
//! `NotFound`; a delete interrupted between its mark and its end is finished by the
//! next `ensure` or `delete`; while Meta is down errors are typed (never "absent")
//! and the same store works again afterwards; topics survive a backend crash.

mod common;

use common::{backend_cases, Harness};
use meshd_meta::{Meta, Precondition as MetaPrecondition, RangeOptions};
use meshd_stores::failure::StoreFailure;
use meshd_stores::subscriptions::{
    MetaSubscriptionStore, Precondition, SubscriptionError, SubscriptionSpec, SubscriptionStore,
    SubscriptionStoreConfig,
};
use meshd_stores::topics::{record, MetaTopicStore, Topic, TopicError, TopicStore};
use meshd_test_support::wait::wait_until;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use suite::*;

backend_cases!(
    ensure_creates_then_returns_the_same_and_rejects_another_partition_count,
    invalid_names_and_partition_counts_are_rejected_naming_the_field,
    get_and_list_in_name_order,
    two_instances_converge_to_meta,
    get_finds_a_topic_created_by_another_instance_at_once,
    delete_is_not_found_when_absent_and_in_use_while_referenced,
    given_a_crash_between_mark_and_delete_then_ensure_and_delete_recover,
    given_meta_down_then_errors_are_typed_and_the_same_store_recovers,
    given_a_backend_restart_then_topics_survive,
    corrupt_records_are_reported_never_decoded,
);

const READY: Duration = Duration::from_secs(15);
const CONVERGE: Duration = Duration::from_secs(20);

async fn store(meta: Arc<dyn Meta>) -> MetaTopicStore {
    let s = MetaTopicStore::start(meta).await.expect("start the store");
    assert!(s.wait_ready(READY).await, "store ready: {:?}", s.health());
    s
}

async fn subscriptions(meta: Arc<dyn Meta>) -> MetaSubscriptionStore {
    let s = MetaSubscriptionStore::start(meta, SubscriptionStoreConfig::default())
        .expect("start the subscription store");
    assert!(s.wait_ready(READY).await, "{:?}", s.health());
    s
}

/// What Meta holds: name -> (partitions, deleting, revision, incarnation, window).
type State = BTreeMap<String, (u32, bool, i64, i64, u64)>;

async fn meta_state(meta: &dyn Meta) -> anyhow::Result<State> {
    let r = meta
        .range(&record::prefix(), RangeOptions::default())
        .await?;
    let mut out = State::new();
    for kv in r.kvs {
        let name = meshd_meta::keys::components(meshd_meta::keys::KeyKind::Topics, &kv.key)
            .and_then(|mut c| c.pop())
            .ok_or_else(|| anyhow::anyhow!("bad key {:?}", kv.key))?;
        let rec = record::decode_value(&name, &kv.value).map_err(anyhow::Error::msg)?;
        out.insert(
            name,
            (
                rec.partitions,
                rec.deleting,
                kv.mod_revision,
                kv.create_revision,
                rec.dedup_window_ms,
            ),
        );
    }
    Ok(out)
}

/// The live (unmarked) topics in Meta, as the store reports them.
async fn meta_topics(meta: &dyn Meta) -> anyhow::Result<Vec<Topic>> {
    Ok(meta_state(meta)
        .await?
        .into_iter()
        .filter(|(_, (_, deleting, _, _, _))| !deleting)
        .map(
            |(name, (partitions, _, revision, incarnation, window))| Topic {
                name,
                partitions,
                revision,
                incarnation,
                dedup_window_ms: window,
            },
        )
        .collect())
}

async fn converged(meta: &dyn Meta, stores: &[&MetaTopicStore]) {
    wait_until(CONVERGE, "caches equal meta", || async {
        let m = meta_topics(meta).await?;
        for (i, s) in stores.iter().enumerate() {
            let c = s.list().await?;
            anyhow::ensure!(c == m, "store {i}: cache {c:?} != meta {m:?}");
        }
        Ok(())
    })
    .await
    .expect("converged");
}

/// Writes topic `name`'s record directly, marked as being deleted (what a delete
/// that died between its mark and its end leaves behind).
async fn mark_directly(meta: &dyn Meta, name: &str, partitions: u32) -> i64 {
    meta.put(
        &record::key(name),
        &record::encode(
            name,
            partitions,
            true,
            meshd_stores::topics::DEFAULT_DEDUP_WINDOW_MS,
        )
        .unwrap(),
        MetaPrecondition::None,
        None,
    )
    .await
    .expect("write a marked record")
    .revision
}

fn is_outage(e: &TopicError) -> bool {
    matches!(
        e,
        TopicError::Store(StoreFailure::Unavailable(_))
            | TopicError::Store(StoreFailure::Indeterminate(_))
    )
}

mod suite {
    use super::*;

    pub async fn ensure_creates_then_returns_the_same_and_rejects_another_partition_count(
        h: &mut Harness,
    ) {
        let s = store(h.meta()).await;
        let (created, was_created) = s.ensure("orders", 3).await.expect("create");
        assert!(was_created);
        assert_eq!(created.name, "orders");
        assert_eq!(created.partitions, 3);
        assert_eq!(
            created.revision, created.incarnation,
            "a create starts an incarnation"
        );
        let (same, was_created) = s.ensure("orders", 3).await.expect("same");
        assert!(!was_created);
        assert_eq!(same, created, "the same count changes nothing");
        let err = s.ensure("orders", 4).await.unwrap_err();
        assert_eq!(
            err,
            TopicError::PartitionMismatch {
                name: "orders".into(),
                existing: 3,
                requested: 4
            }
        );
        assert_eq!(err.kind(), "partition_mismatch");
        assert!(!err.is_retryable());
        let m = meta_state(h.meta().as_ref()).await.unwrap();
        assert_eq!(
            m["orders"],
            (
                3,
                false,
                created.revision,
                created.incarnation,
                meshd_stores::topics::DEFAULT_DEDUP_WINDOW_MS
            ),
            "nothing else was written"
        );
        // Concurrent ensures of one name: exactly one creates it.
        let s = Arc::new(s);
        let other = Arc::new(store(h.client().await).await);
        let mut tasks = Vec::new();
        for t in 0..8 {
            let s = if t % 2 == 0 { s.clone() } else { other.clone() };
            tasks.push(tokio::spawn(async move { s.ensure("hot", 7).await }));
        }
        let mut created = 0;
        let mut incarnations = Vec::new();
        for t in tasks {
            let (topic, c) = t.await.unwrap().expect("ensure hot");
            created += usize::from(c);
            incarnations.push(topic.incarnation);
        }
        assert_eq!(created, 1, "exactly one ensure created it");
        incarnations.dedup();
        assert_eq!(incarnations.len(), 1, "one incarnation: {incarnations:?}");
    }

    pub async fn invalid_names_and_partition_counts_are_rejected_naming_the_field(h: &mut Harness) {
        let s = store(h.meta()).await;
        let long = "x".repeat(250);
        for name in ["", "a/b", "with space", "é", long.as_str()] {
            for r in [
                s.ensure(name, 1).await.map(|_| ()),
                s.get(name).await.map(|_| ()),
                s.delete(name).await.map(|_| ()),
            ] {
                match r {
                    Err(TopicError::Invalid { field, reason }) => {
                        assert_eq!(field, "name", "{name:?}: {reason}")
                    }
                    other => panic!("{name:?}: expected Invalid, got {other:?}"),
                }
            }
        }
        for p in [0, 1025, u32::MAX] {
            match s.ensure("t", p).await {
                Err(e @ TopicError::Invalid { field, .. }) => {
                    assert_eq!(field, "partitions");
                    assert!(e.to_string().contains("partitions"), "{e}");
                    assert_eq!(e.kind(), "invalid");
                }
                other => panic!("{p}: expected Invalid, got {other:?}"),
            }
        }
        assert!(meta_state(h.meta().as_ref()).await.unwrap().is_empty());
        // The edges are accepted.
        let edge = "A-z.0_9".repeat(35) + "abcd";
        assert_eq!(edge.len(), 249);
        s.ensure(&edge, 1)
            .await
            .expect("249 characters, 1 partition");
        s.ensure("big", 1024).await.expect("1024 partitions");
    }

    pub async fn get_and_list_in_name_order(h: &mut Harness) {
        let s = store(h.meta()).await;
        assert_eq!(s.get("nope").await.unwrap(), None);
        assert!(s.list().await.unwrap().is_empty());
        let (b, _) = s.ensure("b", 2).await.unwrap();
        let (a, _) = s.ensure("a", 1).await.unwrap();
        let (c, _) = s.ensure("c.x_y-z", 3).await.unwrap();
        assert_eq!(s.get("a").await.unwrap(), Some(a.clone()));
        assert_eq!(s.get("b").await.unwrap(), Some(b.clone()));
        assert_eq!(s.list().await.unwrap(), vec![a.clone(), b, c]);
        let d = s.delete("b").await.expect("delete");
        assert!(d.revision > a.revision);
        assert_eq!(s.get("b").await.unwrap(), None, "reads its own delete");
        assert_eq!(
            s.list()
                .await
                .unwrap()
                .into_iter()
                .map(|t| t.name)
                .collect::<Vec<_>>(),
            vec!["a", "c.x_y-z"]
        );
        converged(h.meta().as_ref(), &[&s]).await;
    }

    pub async fn two_instances_converge_to_meta(h: &mut Harness) {
        let a = Arc::new(store(h.client().await).await);
        let b = Arc::new(store(h.client().await).await);
        let mut tasks = Vec::new();
        for t in 0..4u64 {
            let s = if t % 2 == 0 { a.clone() } else { b.clone() };
            tasks.push(tokio::spawn(async move {
                use rand::{Rng, SeedableRng};
                let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                for i in 0..25 {
                    let name = format!("t{}", rng.gen_range(0..4));
                    let r = if rng.gen_bool(0.6) {
                        s.ensure(&name, 1 + rng.gen_range(0..2)).await.map(|_| ())
                    } else {
                        s.delete(&name).await.map(|_| ())
                    };
                    match r {
                        Ok(())
                        | Err(TopicError::PartitionMismatch { .. })
                        | Err(TopicError::NotFound { .. }) => {}
                        Err(e) => panic!("task {t} op {i}: unexpected {e:?}"),
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        converged(h.meta().as_ref(), &[&a, &b]).await;
        assert!(
            meta_state(h.meta().as_ref())
                .await
                .unwrap()
                .values()
                .all(|(_, deleting, _, _, _)| !deleting),
            "no delete left a mark behind"
        );
        let c = store(h.client().await).await;
        converged(h.meta().as_ref(), &[&a, &b, &c]).await;
    }

    pub async fn get_finds_a_topic_created_by_another_instance_at_once(h: &mut Harness) {
        let client = h.client().await;
        let s = store(client.clone()).await;
        let other = store(h.client().await).await;
        // With this instance's watch down, its cache cannot learn of the new topic:
        // the answer must come from Meta.
        client.block_watches();
        wait_until(Duration::from_secs(10), "the watch is down", || async {
            anyhow::ensure!(!s.health().live, "still live");
            Ok(())
        })
        .await
        .unwrap();
        let (created, _) = other.ensure("elsewhere", 5).await.unwrap();
        assert_eq!(s.get("elsewhere").await.unwrap(), Some(created.clone()));
        // And with a live watch, at once too (no waiting for the watch event).
        client.unblock_watches();
        assert!(s.wait_ready(READY).await);
        for i in 0..10 {
            let (t, _) = other.ensure(&format!("now{i}"), 1).await.unwrap();
            assert_eq!(s.get(&t.name).await.unwrap(), Some(t));
        }
        // A topic deleted elsewhere disappears from this cache too.
        other.delete("elsewhere").await.unwrap();
        wait_until(CONVERGE, "the delete reaches the cache", || async {
            anyhow::ensure!(s.get("elsewhere").await?.is_none());
            Ok(())
        })
        .await
        .unwrap();
        converged(h.meta().as_ref(), &[&s, &other]).await;
    }

    pub async fn delete_is_not_found_when_absent_and_in_use_while_referenced(h: &mut Harness) {
        let s = store(h.meta()).await;
        let subs = subscriptions(h.client().await).await;
        assert_eq!(
            s.delete("ghost").await.unwrap_err(),
            TopicError::NotFound {
                name: "ghost".into()
            }
        );
        let (orders, _) = s.ensure("orders", 2).await.unwrap();
        s.ensure("other", 1).await.unwrap();
        subs.create(SubscriptionSpec::new("b-audit", "orders"))
            .await
            .unwrap();
        subs.create(SubscriptionSpec::new("a-billing", "orders"))
            .await
            .unwrap();
        subs.create(SubscriptionSpec::new("elsewhere", "other"))
            .await
            .unwrap();
        let err = s.delete("orders").await.unwrap_err();
        assert_eq!(
            err,
            TopicError::InUse {
                name: "orders".into(),
                subscriptions: vec!["a-billing".into(), "b-audit".into()]
            }
        );
        assert_eq!(err.kind(), "in_use");
        // The topic still exists, unmarked, same incarnation.
        let now = s.get("orders").await.unwrap().expect("still there");
        assert_eq!(now.incarnation, orders.incarnation);
        let m = meta_state(h.meta().as_ref()).await.unwrap();
        assert!(!m["orders"].1, "not left marked: {m:?}");
        // Subscriptions on it can be written again.
        subs.put(
            SubscriptionSpec::new("b-audit", "orders"),
            Precondition::None,
        )
        .await
        .expect("update after a refused delete");
        // Once unreferenced, it goes.
        subs.delete("a-billing", Precondition::None).await.unwrap();
        subs.delete("b-audit", Precondition::None).await.unwrap();
        let d = s.delete("orders").await.expect("delete when unreferenced");
        assert_eq!(d.incarnation, orders.incarnation);
        assert_eq!(s.get("orders").await.unwrap(), None);
        assert_eq!(
            s.delete("orders").await.unwrap_err(),
            TopicError::NotFound {
                name: "orders".into()
            }
        );
        assert_eq!(
            subs.create(SubscriptionSpec::new("late", "orders"))
                .await
                .unwrap_err(),
            SubscriptionError::TopicNotFound {
                topic: "orders".into()
            }
        );
        // A re-created topic is a new incarnation.
        let (again, created) = s.ensure("orders", 2).await.unwrap();
        assert!(created);
        assert!(again.incarnation > d.revision);
    }

    pub async fn given_a_crash_between_mark_and_delete_then_ensure_and_delete_recover(
        h: &mut Harness,
    ) {
        let meta = h.meta();
        let s = store(h.client().await).await;
        let subs = subscriptions(h.client().await).await;

        // 1. Unreferenced and marked: reads as absent; `ensure` finishes the delete
        //    and creates it afresh, with the requested count.
        let (old, _) = s.ensure("lonely", 2).await.unwrap();
        let marked = mark_directly(meta.as_ref(), "lonely", 2).await;
        wait_until(CONVERGE, "the mark reaches the cache", || async {
            anyhow::ensure!(s.list().await?.is_empty());
            Ok(())
        })
        .await
        .unwrap();
        assert_eq!(s.get("lonely").await.unwrap(), None, "marked reads absent");
        assert_eq!(
            subs.create(SubscriptionSpec::new("x", "lonely"))
                .await
                .unwrap_err(),
            SubscriptionError::TopicNotFound {
                topic: "lonely".into()
            },
            "no subscription on a topic being deleted"
        );
        let (fresh, created) = s.ensure("lonely", 5).await.expect("ensure recovers");
        assert!(created, "a fresh topic");
        assert!(fresh.incarnation > marked, "{fresh:?} after {marked}");
        assert_ne!(fresh.incarnation, old.incarnation);
        assert_eq!(fresh.partitions, 5);
        assert_eq!(s.get("lonely").await.unwrap(), Some(fresh));

        // 2. Referenced and marked (a subscription created before the mark): `ensure`
        //    unmarks it and answers as for an existing topic.
        let (kept, _) = s.ensure("busy", 3).await.unwrap();
        subs.create(SubscriptionSpec::new("reader", "busy"))
            .await
            .unwrap();
        mark_directly(meta.as_ref(), "busy", 3).await;
        assert_eq!(
            s.ensure("busy", 4).await.unwrap_err(),
            TopicError::PartitionMismatch {
                name: "busy".into(),
                existing: 3,
                requested: 4
            },
            "unmarked, then compared"
        );
        let (back, created) = s.ensure("busy", 3).await.unwrap();
        assert!(!created);
        assert_eq!(back.incarnation, kept.incarnation, "the same topic");
        assert!(!meta_state(meta.as_ref()).await.unwrap()["busy"].1);
        subs.create(SubscriptionSpec::new("reader2", "busy"))
            .await
            .expect("subscriptions work again");

        // 3. `delete` resumes a marked topic: InUse (and unmarked) while referenced,
        //    deleted once not.
        mark_directly(meta.as_ref(), "busy", 3).await;
        assert!(matches!(
            s.delete("busy").await,
            Err(TopicError::InUse { subscriptions, .. }) if subscriptions == vec!["reader", "reader2"]
        ));
        assert!(!meta_state(meta.as_ref()).await.unwrap()["busy"].1);
        subs.delete("reader", Precondition::None).await.unwrap();
        subs.delete("reader2", Precondition::None).await.unwrap();
        mark_directly(meta.as_ref(), "busy", 3).await;
        let d = s.delete("busy").await.expect("delete resumes");
        assert_eq!(d.incarnation, kept.incarnation);
        assert!(!meta_state(meta.as_ref())
            .await
            .unwrap()
            .contains_key("busy"));
        converged(meta.as_ref(), &[&s]).await;
    }

    pub async fn given_meta_down_then_errors_are_typed_and_the_same_store_recovers(
        h: &mut Harness,
    ) {
        let s = store(h.client().await).await;
        let (before, _) = s.ensure("before", 2).await.unwrap();
        h.stop();
        for (what, r) in [
            ("ensure new", s.ensure("during", 1).await.map(|_| ())),
            ("ensure existing", s.ensure("before", 2).await.map(|_| ())),
            ("delete", s.delete("before").await.map(|_| ())),
            ("get unknown", s.get("unknown").await.map(|_| ())),
        ] {
            let e = r.expect_err(what);
            assert!(is_outage(&e), "{what}: {e:?}");
        }
        assert!(TopicError::Store(StoreFailure::Unavailable("x".into())).is_retryable());
        // A cached topic is still served.
        assert_eq!(s.get("before").await.unwrap(), Some(before.clone()));
        wait_until(
            Duration::from_secs(10),
            "the cache reports not live",
            || async {
                anyhow::ensure!(!s.health().live, "{:?}", s.health());
                Ok(())
            },
        )
        .await
        .unwrap();
        assert!(!s.health().is_ready());

        h.start().await;
        let (after, _) = wait_until(Duration::from_secs(20), "writes work again", || async {
            Ok(s.ensure("after", 1).await?)
        })
        .await
        .unwrap();
        assert!(after.revision > before.revision);
        assert!(s.wait_ready(READY).await, "{:?}", s.health());
        // The delete that failed while down left no mark behind, or a mark the next
        // delete or ensure finishes.
        let (b, _) = s.ensure("before", 2).await.expect("before is usable");
        assert_eq!(b.partitions, 2);
        let m = meta_state(h.meta().as_ref()).await.unwrap();
        assert!(!m["before"].1, "{m:?}");
        converged(h.meta().as_ref(), &[&s]).await;
    }

    pub async fn given_a_backend_restart_then_topics_survive(h: &mut Harness) {
        let s = store(h.client().await).await;
        let mut made = Vec::new();
        for i in 0..5u32 {
            made.push(s.ensure(&format!("t{i}"), i + 1).await.unwrap().0);
        }
        s.delete("t0").await.unwrap();
        made.remove(0);
        h.restart().await;
        h.wait_ready().await;
        let fresh = store(h.client().await).await;
        assert_eq!(fresh.list().await.unwrap(), made);
        assert_eq!(fresh.get("t0").await.unwrap(), None);
        // The old store recovers by itself and agrees.
        assert!(s.wait_ready(READY).await, "{:?}", s.health());
        converged(h.meta().as_ref(), &[&s, &fresh]).await;
        let (again, created) = s.ensure("t3", 4).await.unwrap();
        assert!(!created);
        assert_eq!(again, made[2]);
    }

    pub async fn corrupt_records_are_reported_never_decoded(h: &mut Harness) {
        let m = h.meta();
        m.put(
            &record::key("torn"),
            br#"{"v":1,"name":"torn","parti"#,
            MetaPrecondition::None,
            None,
        )
        .await
        .unwrap();
        m.put(
            &record::key("future"),
            br#"{"v":2,"name":"future","partitions":1}"#,
            MetaPrecondition::None,
            None,
        )
        .await
        .unwrap();
        let s = store(m.clone()).await;
        s.ensure("fine", 1).await.unwrap();
        for name in ["torn", "future"] {
            for r in [
                s.get(name).await.map(|_| ()),
                s.ensure(name, 1).await.map(|_| ()),
                s.delete(name).await.map(|_| ()),
            ] {
                match r {
                    Err(TopicError::Store(StoreFailure::Corrupt { key, reason })) => {
                        assert!(key.ends_with(name), "{key}: {reason}")
                    }
                    other => panic!("{name}: expected Corrupt, got {other:?}"),
                }
            }
        }
        let names: Vec<String> = s
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|t| t.name)
            .collect();
        assert_eq!(names, vec!["fine"]);
        assert_eq!(s.health().corrupt_records, 2);
        // A subscription on a topic whose record is corrupt is refused, not written.
        let subs = subscriptions(h.client().await).await;
        assert!(matches!(
            subs.create(SubscriptionSpec::new("x", "torn")).await,
            Err(SubscriptionError::Store(StoreFailure::Corrupt { .. }))
        ));
    }
}
