//! # The SubscriptionStore conformance suite, on both Meta backends
//!
//! Every case is one async function in [`suite`]; [`common::backend_cases!`] stamps out
//! `embedded::<case>` (EmbeddedMeta on a temp dir) and `etcd::<case>` (one real etcd
//! process per test). "Two instances" are two stores on two Meta clients: two
//! `EtcdMeta` clients of one etcd, or two clients of one `EmbeddedMeta`. A backend
//! "restart" SIGKILLs and restarts etcd, or closes and reopens the embedded RocksDB;
//! the stores keep their clients, which must recover on their own.
//!
//! Stories pinned here: a stale `If-Match` never overwrites a newer update; an
//! unconditional PUT never answers a conflict to a concurrent writer; two instances
//! writing the same names converge to Meta's state; an instance reads its own write at
//! once; a cache whose watch position was compacted re-lists (and drops what was
//! deleted meanwhile); every acknowledged subscription survives a backend crash; while
//! Meta is down writes fail typed and nothing is half-written, and the same store
//! works again when Meta is back.

mod common;

use common::{backend_cases, Harness};
use meshd_meta::{Meta, Precondition as MetaPrecondition, RangeOptions};
use meshd_stores::failure::StoreFailure;
use meshd_stores::subscriptions::{
    record, Backoff, Filter, MetaSubscriptionStore, Precondition, Push, StartPosition,
    SubscriptionError, SubscriptionSpec, SubscriptionStore, SubscriptionStoreConfig, REDACTED,
};
use meshd_stores::topics::{self, MetaTopicStore, TopicError, TopicStore};
use meshd_test_support::wait::wait_until;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use suite::*;

backend_cases!(
    create_get_list_update_delete_round_trip_with_revisions,
    if_match_semantics_reject_stale_and_absent_preconditions,
    unconditional_put_under_contention_never_conflicts,
    topic_cannot_change_on_update,
    invalid_values_are_rejected_naming_the_field,
    delete_and_recreate_is_a_new_incarnation,
    two_instances_writing_the_same_names_converge_to_meta,
    an_instance_reads_its_own_writes_at_once,
    given_a_compacted_watch_position_when_the_watch_resumes_then_the_cache_relists,
    given_a_backend_crash_when_it_restarts_then_every_acknowledged_subscription_survives,
    given_meta_down_when_writing_then_errors_are_typed_and_the_same_store_recovers,
    corrupt_records_are_reported_never_decoded,
    a_subscription_on_a_missing_or_deleting_topic_is_topic_not_found,
    a_topic_referenced_by_a_subscription_is_not_deleted,
    given_creates_racing_a_topic_delete_then_no_subscription_references_a_deleted_topic,
    redacted_push_credentials_are_kept_from_the_record_a_put_replaces,
);

// ---------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------

const READY: Duration = Duration::from_secs(15);
const CONVERGE: Duration = Duration::from_secs(20);

async fn store(meta: Arc<dyn Meta>) -> MetaSubscriptionStore {
    let s = MetaSubscriptionStore::start(meta, SubscriptionStoreConfig::default())
        .expect("start the store");
    assert!(s.wait_ready(READY).await, "store ready: {:?}", s.health());
    s
}

/// Creates the topic every [`spec`] is on: subscriptions need an existing topic.
async fn orders(h: &Harness) {
    common::ensure_topic(h.meta(), "orders", 1).await;
}

fn spec(name: &str) -> SubscriptionSpec {
    SubscriptionSpec::new(name, "orders")
}

/// What Meta holds: name -> (revision, incarnation, spec).
type State = BTreeMap<String, (i64, i64, SubscriptionSpec)>;

async fn meta_state(meta: &dyn Meta) -> anyhow::Result<State> {
    let r = meta
        .range(&record::prefix(), RangeOptions::default())
        .await?;
    let mut out = State::new();
    for kv in r.kvs {
        let name = meshd_meta::keys::components(meshd_meta::keys::KeyKind::Subscriptions, &kv.key)
            .and_then(|mut c| c.pop())
            .ok_or_else(|| anyhow::anyhow!("bad key {:?}", kv.key))?;
        let spec = record::decode_value(&name, &kv.value).map_err(anyhow::Error::msg)?;
        out.insert(name, (kv.mod_revision, kv.create_revision, spec));
    }
    Ok(out)
}

async fn cache_state(s: &MetaSubscriptionStore) -> anyhow::Result<State> {
    Ok(s.list()
        .await?
        .into_iter()
        .map(|x| (x.spec.name.clone(), (x.revision, x.incarnation, x.spec)))
        .collect())
}

/// Waits until every store's cache equals Meta's state.
async fn converged(meta: &dyn Meta, stores: &[&MetaSubscriptionStore]) {
    wait_until(CONVERGE, "caches equal meta", || async {
        let m = meta_state(meta).await?;
        for (i, s) in stores.iter().enumerate() {
            let c = cache_state(s).await?;
            if c != m {
                anyhow::bail!(
                    "store {i} at revision {}: cache {:?} != meta {:?}",
                    s.cache_revision(),
                    summary(&c),
                    summary(&m)
                );
            }
        }
        Ok(())
    })
    .await
    .expect("converged");
}

fn summary(s: &State) -> Vec<(String, i64, u32)> {
    s.iter()
        .map(|(n, (r, _, spec))| (n.clone(), *r, spec.max_attempts))
        .collect()
}

fn is_outage(e: &SubscriptionError) -> bool {
    matches!(
        e,
        SubscriptionError::Store(StoreFailure::Unavailable(_))
            | SubscriptionError::Store(StoreFailure::Indeterminate(_))
    )
}

// ---------------------------------------------------------------------------------
// The cases
// ---------------------------------------------------------------------------------

mod suite {
    use super::*;

    pub async fn redacted_push_credentials_are_kept_from_the_record_a_put_replaces(
        h: &mut Harness,
    ) {
        const OLD: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
        const NEW: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        orders(h).await;
        let s = store(h.meta()).await;
        let with_push = |secrets: Option<Vec<&str>>, headers: Option<Vec<(&str, &str)>>| {
            let mut x = spec("hook");
            x.push = Some(Push {
                secrets: secrets.map(|v| v.into_iter().map(String::from).collect()),
                headers: headers
                    .map(|v| v.into_iter().map(|(k, v)| (k.into(), v.into())).collect()),
                ..Push::new("http://127.0.0.1:9/hook")
            });
            x
        };
        // A create cannot keep what is not there.
        let e = s
            .create(with_push(Some(vec![REDACTED]), None))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                SubscriptionError::Invalid {
                    field: "push.secrets",
                    ..
                }
            ),
            "{e}"
        );
        let created = s
            .create(with_push(
                Some(vec![OLD]),
                Some(vec![("authorization", "Bearer t")]),
            ))
            .await
            .unwrap();
        // Omitted: kept, in the store's answer, its cache and Meta.
        let (kept, _) = s
            .put(
                with_push(None, None),
                Precondition::Revision(created.revision),
            )
            .await
            .unwrap();
        let p = kept.spec.push.as_ref().unwrap();
        assert_eq!(p.secrets(), [OLD]);
        assert_eq!(
            p.headers(),
            [("authorization".to_string(), "Bearer t".to_string())]
        );
        assert_eq!(s.get("hook").await.unwrap().unwrap().spec, kept.spec);
        let m = meta_state(h.meta().as_ref()).await.unwrap();
        assert_eq!(m["hook"].2, kept.spec);
        // Rotation with the marker, unconditionally.
        let (rotated, _) = s
            .put(
                with_push(
                    Some(vec![NEW, REDACTED]),
                    Some(vec![("authorization", REDACTED)]),
                ),
                Precondition::None,
            )
            .await
            .unwrap();
        let p = rotated.spec.push.as_ref().unwrap();
        assert_eq!(p.secrets(), [NEW, OLD]);
        assert_eq!(
            p.headers(),
            [("authorization".to_string(), "Bearer t".to_string())]
        );
        // A marker with nothing behind it changes nothing.
        let e = s
            .put(
                with_push(None, Some(vec![("x-other", REDACTED)])),
                Precondition::None,
            )
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                SubscriptionError::Invalid {
                    field: "push.headers",
                    ..
                }
            ),
            "{e}"
        );
        assert_eq!(s.get("hook").await.unwrap().unwrap(), rotated);
    }

    pub async fn create_get_list_update_delete_round_trip_with_revisions(h: &mut Harness) {
        orders(h).await;
        let s = store(h.meta()).await;
        let mut full = spec("audit");
        full.max_attempts = 3;
        full.ack_timeout_ms = 1500;
        full.backoff = Backoff {
            initial_ms: 10,
            max_ms: 20,
        };
        full.filter = Some(Filter {
            event_type: Some("order.created".into()),
            source: None,
        });
        full.push = Some(Push::new("http://127.0.0.1:9/hook"));
        full.start = StartPosition::Earliest;
        let created = s.create(full.clone()).await.expect("create");
        assert_eq!(created.spec, full);
        assert_eq!(
            created.incarnation, created.revision,
            "a create starts an incarnation"
        );
        assert_eq!(s.get("audit").await.unwrap(), Some(created.clone()));
        s.create(spec("billing")).await.expect("create billing");
        let names: Vec<String> = s
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|x| x.spec.name)
            .collect();
        assert_eq!(names, vec!["audit", "billing"], "listed in name order");

        let mut changed = full.clone();
        changed.max_attempts = 7;
        let (updated, was_created) = s
            .put(changed.clone(), Precondition::Revision(created.revision))
            .await
            .expect("update");
        assert!(!was_created);
        assert!(
            updated.revision > created.revision,
            "an update gets a new revision"
        );
        assert_eq!(updated.incarnation, created.incarnation);
        assert_eq!(s.get("audit").await.unwrap(), Some(updated.clone()));
        // Meta agrees.
        let m = meta_state(h.meta().as_ref()).await.unwrap();
        assert_eq!(m["audit"], (updated.revision, updated.incarnation, changed));

        let (again, was_created) = s.put(spec("billing"), Precondition::None).await.unwrap();
        assert!(
            !was_created,
            "an unconditional put of an existing one updates it"
        );
        let (fresh, was_created) = s.put(spec("new"), Precondition::None).await.unwrap();
        assert!(
            was_created,
            "an unconditional put of a missing one creates it"
        );
        assert!(fresh.revision > again.revision);

        let d = s
            .delete("audit", Precondition::Revision(updated.revision))
            .await
            .expect("delete");
        assert!(d.revision > fresh.revision);
        assert_eq!(d.incarnation, created.incarnation);
        assert_eq!(s.get("audit").await.unwrap(), None);
        let err = s.delete("audit", Precondition::None).await.unwrap_err();
        assert_eq!(
            err,
            SubscriptionError::NotFound {
                name: "audit".into()
            }
        );
        s.delete("new", Precondition::None)
            .await
            .expect("delete new");
        converged(h.meta().as_ref(), &[&s]).await;
        assert_eq!(cache_state(&s).await.unwrap().len(), 1);
    }

    pub async fn if_match_semantics_reject_stale_and_absent_preconditions(h: &mut Harness) {
        orders(h).await;
        let s = store(h.meta()).await;
        let v1 = s.create(spec("a")).await.unwrap();
        // If-None-Match: * when it exists.
        let err = s.create(spec("a")).await.unwrap_err();
        assert_eq!(
            err,
            SubscriptionError::PreconditionFailed {
                name: "a".into(),
                current_revision: Some(v1.revision)
            }
        );
        let mut next = spec("a");
        next.max_attempts = 9;
        let (v2, _) = s
            .put(next.clone(), Precondition::Revision(v1.revision))
            .await
            .unwrap();
        // A stale If-Match: rejected with the current revision, nothing written.
        let mut stale = spec("a");
        stale.max_attempts = 1;
        let err = s
            .put(stale.clone(), Precondition::Revision(v1.revision))
            .await
            .unwrap_err();
        assert_eq!(
            err,
            SubscriptionError::PreconditionFailed {
                name: "a".into(),
                current_revision: Some(v2.revision)
            }
        );
        // Revisions that can never match (0 would mean "absent" in Meta) do not create.
        for r in [0, -1, v2.revision + 1000] {
            let err = s
                .put(spec("nope"), Precondition::Revision(r))
                .await
                .unwrap_err();
            assert_eq!(
                err,
                SubscriptionError::PreconditionFailed {
                    name: "nope".into(),
                    current_revision: None
                },
                "If-Match {r} on a missing subscription"
            );
        }
        let err = s
            .delete("a", Precondition::Revision(v1.revision))
            .await
            .unwrap_err();
        assert_eq!(
            err,
            SubscriptionError::PreconditionFailed {
                name: "a".into(),
                current_revision: Some(v2.revision)
            }
        );
        assert!(matches!(
            s.delete("a", Precondition::Absent).await,
            Err(SubscriptionError::Invalid {
                field: "precondition",
                ..
            })
        ));
        let m = meta_state(h.meta().as_ref()).await.unwrap();
        assert_eq!(m.len(), 1, "nothing else was written: {m:?}");
        assert_eq!(m["a"], (v2.revision, v1.incarnation, next));
        assert_eq!(s.get("a").await.unwrap().unwrap().revision, v2.revision);
    }

    pub async fn unconditional_put_under_contention_never_conflicts(h: &mut Harness) {
        orders(h).await;
        let a = Arc::new(store(h.client().await).await);
        let b = Arc::new(store(h.client().await).await);
        const TASKS: u32 = 8;
        const PUTS: u32 = 8;
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let s = if t % 2 == 0 { a.clone() } else { b.clone() };
            tasks.push(tokio::spawn(async move {
                let mut done = Vec::new();
                for i in 0..PUTS {
                    let mut x = spec("hot");
                    x.max_attempts = t * PUTS + i + 1;
                    match s.put(x, Precondition::None).await {
                        Ok((sub, created)) => {
                            done.push((sub.revision, sub.spec.max_attempts, created))
                        }
                        Err(e) => panic!("task {t} put {i}: {e:?}"),
                    }
                }
                done
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        assert_eq!(all.len() as u32, TASKS * PUTS);
        assert_eq!(
            all.iter().filter(|(_, _, created)| *created).count(),
            1,
            "exactly one put created it"
        );
        let mut revisions: Vec<i64> = all.iter().map(|(r, _, _)| *r).collect();
        revisions.sort();
        revisions.dedup();
        assert_eq!(revisions.len(), all.len(), "every put is its own revision");
        let last = all.iter().max_by_key(|(r, _, _)| *r).unwrap();
        let m = meta_state(h.meta().as_ref()).await.unwrap();
        assert_eq!(
            (m["hot"].0, m["hot"].2.max_attempts),
            (last.0, last.1),
            "the final state is the last acknowledged write"
        );
        converged(h.meta().as_ref(), &[&a, &b]).await;
    }

    pub async fn topic_cannot_change_on_update(h: &mut Harness) {
        orders(h).await;
        let s = store(h.meta()).await;
        let v1 = s.create(spec("a")).await.unwrap();
        let moved = SubscriptionSpec::new("a", "payments");
        let expected = SubscriptionError::TopicChange {
            name: "a".into(),
            current: "orders".into(),
            requested: "payments".into(),
        };
        assert_eq!(
            s.put(moved.clone(), Precondition::None).await.unwrap_err(),
            expected
        );
        assert_eq!(
            s.put(moved, Precondition::Revision(v1.revision))
                .await
                .unwrap_err(),
            expected
        );
        let m = meta_state(h.meta().as_ref()).await.unwrap();
        assert_eq!(m["a"].0, v1.revision, "nothing was written");
        assert_eq!(m["a"].2.topic, "orders");
    }

    pub async fn invalid_values_are_rejected_naming_the_field(h: &mut Harness) {
        orders(h).await;
        let s = store(h.meta()).await;
        let d = spec("d");
        assert_eq!(
            (
                d.max_attempts,
                d.ack_timeout_ms,
                d.backoff.initial_ms,
                d.backoff.max_ms
            ),
            (5, 30_000, 1_000, 60_000),
            "the documented defaults"
        );
        assert_eq!(d.start, StartPosition::Latest);
        type Edit = fn(&mut SubscriptionSpec);
        let cases: Vec<(&str, Edit)> = vec![
            ("name", |x| x.name = String::new()),
            ("name", |x| x.name = "a/b".into()),
            ("name", |x| x.name = "x".repeat(250)),
            ("topic", |x| x.topic = "with space".into()),
            ("max_attempts", |x| x.max_attempts = 0),
            ("max_attempts", |x| x.max_attempts = 1001),
            ("ack_timeout_ms", |x| x.ack_timeout_ms = 99),
            ("ack_timeout_ms", |x| x.ack_timeout_ms = 600_001),
            ("backoff.initial_ms", |x| x.backoff.initial_ms = 0),
            ("backoff.initial_ms", |x| {
                x.backoff = Backoff {
                    initial_ms: 10,
                    max_ms: 9,
                }
            }),
            ("backoff.max_ms", |x| {
                x.backoff = Backoff {
                    initial_ms: 10,
                    max_ms: 3_600_001,
                }
            }),
            ("filter", |x| {
                x.filter = Some(Filter {
                    event_type: None,
                    source: None,
                })
            }),
            ("filter.type", |x| {
                x.filter = Some(Filter {
                    event_type: Some(String::new()),
                    source: None,
                })
            }),
            ("push.url", |x| x.push = Some(Push::new("ftp://x"))),
            // The write bounds of filters hold for every way in, not only the API's.
            ("filters", |x| {
                x.filters = vec![meshd_stores::subscriptions::FilterExpr::Exact(
                    (0..65)
                        .map(|i| (format!("a{i}"), "v".to_string()))
                        .collect(),
                )]
            }),
        ];
        for (field, edit) in cases {
            let mut x = spec("v");
            edit(&mut x);
            for pre in [Precondition::None, Precondition::Absent] {
                match s.put(x.clone(), pre).await {
                    Err(SubscriptionError::Invalid { field: f, reason }) => {
                        assert_eq!(f, field, "{reason}");
                        let msg = SubscriptionError::Invalid { field: f, reason }.to_string();
                        assert!(msg.contains(field), "{msg}");
                    }
                    other => panic!("{field}: expected Invalid, got {other:?}"),
                }
            }
        }
        // The range edges are accepted.
        let mut edge = spec("edge");
        edge.max_attempts = 1000;
        edge.ack_timeout_ms = 100;
        edge.backoff = Backoff {
            initial_ms: 3_600_000,
            max_ms: 3_600_000,
        };
        edge.name = "A-z.0_9".repeat(35) + "abcd";
        assert_eq!(edge.name.len(), 249);
        s.create(edge).await.expect("edges are valid");
        assert_eq!(meta_state(h.meta().as_ref()).await.unwrap().len(), 1);
    }

    pub async fn delete_and_recreate_is_a_new_incarnation(h: &mut Harness) {
        orders(h).await;
        let s = store(h.meta()).await;
        let first = s.create(spec("a")).await.unwrap();
        let (upd, _) = s.put(spec("a"), Precondition::None).await.unwrap();
        assert_eq!(upd.incarnation, first.incarnation);
        let d = s.delete("a", Precondition::None).await.unwrap();
        assert_eq!(d.incarnation, first.incarnation);
        let second = s.create(spec("a")).await.unwrap();
        assert!(second.incarnation > d.revision, "{second:?} after {d:?}");
        assert_ne!(second.incarnation, first.incarnation);
        assert_eq!(
            s.get("a").await.unwrap().unwrap().incarnation,
            second.incarnation
        );
        // The old ETag never matches the new incarnation.
        assert!(matches!(
            s.put(spec("a"), Precondition::Revision(upd.revision)).await,
            Err(SubscriptionError::PreconditionFailed { .. })
        ));
        let other = store(h.client().await).await;
        converged(h.meta().as_ref(), &[&s, &other]).await;
        assert_eq!(
            other.get("a").await.unwrap().unwrap().incarnation,
            second.incarnation
        );
    }

    pub async fn two_instances_writing_the_same_names_converge_to_meta(h: &mut Harness) {
        orders(h).await;
        let a = Arc::new(store(h.client().await).await);
        let b = Arc::new(store(h.client().await).await);
        let mut tasks = Vec::new();
        for t in 0..6u64 {
            let s = if t % 2 == 0 { a.clone() } else { b.clone() };
            tasks.push(tokio::spawn(async move {
                use rand::{Rng, SeedableRng};
                let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                for i in 0..30u32 {
                    let name = format!("n{}", rng.gen_range(0..5));
                    let mut x = spec(&name);
                    x.max_attempts = 1 + (t as u32 * 100 + i) % 1000;
                    let r = match rng.gen_range(0..6) {
                        0 => s.create(x).await.map(|_| ()),
                        1 | 2 => s.put(x, Precondition::None).await.map(|_| ()),
                        3 => match s.get(&name).await.unwrap() {
                            Some(cur) => s
                                .put(x, Precondition::Revision(cur.revision))
                                .await
                                .map(|_| ()),
                            None => Ok(()),
                        },
                        4 => s.delete(&name, Precondition::None).await.map(|_| ()),
                        _ => match s.get(&name).await.unwrap() {
                            Some(cur) => s
                                .delete(&name, Precondition::Revision(cur.revision))
                                .await
                                .map(|_| ()),
                            None => Ok(()),
                        },
                    };
                    match r {
                        Ok(())
                        | Err(SubscriptionError::PreconditionFailed { .. })
                        | Err(SubscriptionError::NotFound { .. }) => {}
                        Err(e) => panic!("task {t} op {i}: unexpected {e:?}"),
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        converged(h.meta().as_ref(), &[&a, &b]).await;
        // And a store started afterwards agrees too.
        let c = store(h.client().await).await;
        converged(h.meta().as_ref(), &[&a, &b, &c]).await;
    }

    pub async fn an_instance_reads_its_own_writes_at_once(h: &mut Harness) {
        orders(h).await;
        let client = h.client().await;
        let s = store(client.clone()).await;
        let other = store(h.client().await).await;
        // With a live watch: every write is visible to the next read.
        for i in 0..20u32 {
            let mut x = spec("live");
            x.max_attempts = i + 1;
            let (w, _) = s.put(x, Precondition::None).await.unwrap();
            let r = s.get("live").await.unwrap().unwrap();
            assert!(
                r.revision >= w.revision,
                "read {} after write {}",
                r.revision,
                w.revision
            );
        }
        // With this instance's watch down, its own writes are still visible at once
        // (and another instance's are not, until the watch is back).
        client.block_watches();
        wait_until(Duration::from_secs(10), "the watch is down", || async {
            anyhow::ensure!(!s.health().live, "still live");
            Ok(())
        })
        .await
        .unwrap();
        let created = s.create(spec("own")).await.unwrap();
        assert_eq!(s.get("own").await.unwrap(), Some(created.clone()));
        let (updated, _) = s.put(spec("own"), Precondition::None).await.unwrap();
        assert_eq!(
            s.get("own").await.unwrap().unwrap().revision,
            updated.revision
        );
        assert!(
            s.cache_revision() < updated.revision,
            "served by the local apply"
        );
        s.delete("live", Precondition::None).await.unwrap();
        assert_eq!(s.get("live").await.unwrap(), None);
        assert!(s
            .list()
            .await
            .unwrap()
            .iter()
            .any(|x| x.spec.name == "own" && x.revision == updated.revision));
        other.create(spec("theirs")).await.unwrap();
        assert_eq!(s.get("theirs").await.unwrap(), None, "the watch is blocked");
        client.unblock_watches();
        converged(h.meta().as_ref(), &[&s, &other]).await;
        assert!(s.get("theirs").await.unwrap().is_some());
    }

    pub async fn given_a_compacted_watch_position_when_the_watch_resumes_then_the_cache_relists(
        h: &mut Harness,
    ) {
        orders(h).await;
        let client = h.client().await;
        let s = store(client.clone()).await;
        let writer = store(h.client().await).await;
        writer.create(spec("kept")).await.unwrap();
        writer.create(spec("updated")).await.unwrap();
        writer.create(spec("deleted")).await.unwrap();
        converged(h.meta().as_ref(), &[&s, &writer]).await;
        assert_eq!(s.health().relists, 0);

        client.block_watches();
        wait_until(Duration::from_secs(10), "the watch is down", || async {
            anyhow::ensure!(!s.health().live, "still live");
            Ok(())
        })
        .await
        .unwrap();
        let seen = s.cache_revision();
        let mut x = spec("updated");
        x.max_attempts = 42;
        writer.put(x, Precondition::None).await.unwrap();
        writer.delete("deleted", Precondition::None).await.unwrap();
        writer.create(spec("added")).await.unwrap();
        writer.create(spec("transient")).await.unwrap();
        let last = writer
            .delete("transient", Precondition::None)
            .await
            .unwrap();
        h.meta().compact(last.revision).await.expect("compact");
        assert!(
            seen + 1 < last.revision,
            "the watch position is compacted away"
        );

        client.unblock_watches();
        converged(h.meta().as_ref(), &[&s, &writer]).await;
        let health = s.health();
        assert!(
            health.relists >= 1,
            "re-listed after compaction: {health:?}"
        );
        assert!(s.wait_ready(READY).await, "{:?}", s.health());
        assert_eq!(s.get("deleted").await.unwrap(), None);
        assert_eq!(
            s.get("updated").await.unwrap().unwrap().spec.max_attempts,
            42
        );
        // And it keeps following after the re-list.
        writer.create(spec("later")).await.unwrap();
        converged(h.meta().as_ref(), &[&s, &writer]).await;
    }

    pub async fn given_a_backend_crash_when_it_restarts_then_every_acknowledged_subscription_survives(
        h: &mut Harness,
    ) {
        orders(h).await;
        let s = Arc::new(store(h.client().await).await);
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for t in 0..3u32 {
            let s = s.clone();
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let mut acked: BTreeMap<String, (i64, u32)> = BTreeMap::new();
                let mut i = 0u32;
                while !stop.load(Ordering::SeqCst) {
                    let name = format!("w{t}-{}", i % 8);
                    let mut x = spec(&name);
                    x.max_attempts = 1 + i % 1000;
                    match s.put(x, Precondition::None).await {
                        Ok((sub, _)) => {
                            acked.insert(name, (sub.revision, sub.spec.max_attempts));
                        }
                        Err(e) => {
                            assert!(is_outage(&e), "only outage errors: {e:?}");
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                    i += 1;
                }
                acked
            }));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        h.restart().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.store(true, Ordering::SeqCst);
        let mut acked = BTreeMap::new();
        for t in tasks {
            acked.extend(t.await.unwrap());
        }
        assert!(!acked.is_empty());
        // A store started after the crash, on a fresh client, sees every
        // acknowledged write (or a later, unacknowledged one of the same name).
        let fresh = store(h.client().await).await;
        for (name, (revision, max_attempts)) in &acked {
            let got = fresh
                .get(name)
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("acknowledged {name} lost"));
            assert!(
                got.revision >= *revision,
                "{name}: {got:?} older than {revision}"
            );
            if got.revision == *revision {
                assert_eq!(got.spec.max_attempts, *max_attempts);
            }
        }
        converged(h.meta().as_ref(), &[&s, &fresh]).await;
    }

    pub async fn given_meta_down_when_writing_then_errors_are_typed_and_the_same_store_recovers(
        h: &mut Harness,
    ) {
        orders(h).await;
        let s = store(h.client().await).await;
        let before = s.create(spec("before")).await.unwrap();
        h.stop();
        let e = s.create(spec("during")).await.unwrap_err();
        assert!(is_outage(&e), "create while down: {e:?}");
        let e = s.put(spec("before"), Precondition::None).await.unwrap_err();
        assert!(is_outage(&e), "put while down: {e:?}");
        let e = s
            .put(spec("before"), Precondition::Revision(before.revision))
            .await
            .unwrap_err();
        assert!(is_outage(&e), "conditional put while down: {e:?}");
        let e = s.delete("before", Precondition::None).await.unwrap_err();
        assert!(is_outage(&e), "delete while down: {e:?}");
        assert!(e.to_string().contains("unavailable") || e.to_string().contains("unknown"));
        // Reads are served from the cache (the last known state).
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
        let after = wait_until(Duration::from_secs(20), "writes work again", || async {
            Ok(s.create(spec("after")).await?)
        })
        .await
        .unwrap();
        assert!(after.revision > before.revision);
        assert!(s.wait_ready(READY).await, "{:?}", s.health());
        // Nothing half-written: "during" is absent or a complete, valid record;
        // "before" is unchanged.
        let m = meta_state(h.meta().as_ref())
            .await
            .expect("every record decodes");
        assert_eq!(
            m["before"],
            (before.revision, before.incarnation, spec("before"))
        );
        if let Some((_, _, x)) = m.get("during") {
            assert_eq!(x, &spec("during"));
        }
        converged(h.meta().as_ref(), &[&s]).await;
    }

    pub async fn corrupt_records_are_reported_never_decoded(h: &mut Harness) {
        orders(h).await;
        let m = h.meta();
        let good = record::encode(&spec("torn")).unwrap();
        m.put(
            &record::key("torn"),
            &good[..good.len() / 2],
            MetaPrecondition::None,
            None,
        )
        .await
        .unwrap();
        m.put(
            &record::key("future"),
            br#"{"v":2,"name":"future"}"#,
            MetaPrecondition::None,
            None,
        )
        .await
        .unwrap();
        let s = store(m.clone()).await;
        s.create(spec("fine")).await.unwrap();
        for name in ["torn", "future"] {
            match s.get(name).await {
                Err(SubscriptionError::Store(StoreFailure::Corrupt { key, reason })) => {
                    assert!(key.ends_with(name), "{key}: {reason}");
                }
                other => panic!("{name}: expected Corrupt, got {other:?}"),
            }
            // An update cannot check the topic of an unreadable record.
            assert!(matches!(
                s.put(spec(name), Precondition::None).await,
                Err(SubscriptionError::Store(StoreFailure::Corrupt { .. }))
            ));
        }
        let names: Vec<String> = s
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|x| x.spec.name)
            .collect();
        assert_eq!(names, vec!["fine"]);
        assert_eq!(s.health().corrupt_records, 2);
        // An operator can delete them.
        s.delete("torn", Precondition::None).await.unwrap();
        let cur = m.get(&record::key("future")).await.unwrap().kv.unwrap();
        s.delete("future", Precondition::Revision(cur.mod_revision))
            .await
            .unwrap();
        assert_eq!(s.get("torn").await.unwrap(), None);
        assert_eq!(s.health().corrupt_records, 0);
    }

    pub async fn a_subscription_on_a_missing_or_deleting_topic_is_topic_not_found(h: &mut Harness) {
        orders(h).await;
        let s = store(h.meta()).await;
        let missing = SubscriptionError::TopicNotFound {
            topic: "missing".into(),
        };
        assert_eq!(missing.kind(), "topic_not_found");
        assert!(!missing.is_retryable());
        assert_eq!(
            s.create(SubscriptionSpec::new("x", "missing"))
                .await
                .unwrap_err(),
            missing
        );
        assert_eq!(
            s.put(SubscriptionSpec::new("x", "missing"), Precondition::None)
                .await
                .unwrap_err(),
            missing
        );
        let a = s.create(spec("a")).await.expect("on an existing topic");
        // The topic marked as being deleted (a delete in progress, or one that died
        // between its mark and its end): every write path refuses it.
        h.meta()
            .put(
                &topics::record::key("orders"),
                &topics::record::encode("orders", 1, true, topics::DEFAULT_DEDUP_WINDOW_MS)
                    .unwrap(),
                MetaPrecondition::None,
                None,
            )
            .await
            .unwrap();
        let deleting = SubscriptionError::TopicNotFound {
            topic: "orders".into(),
        };
        assert_eq!(s.create(spec("y")).await.unwrap_err(), deleting);
        assert_eq!(
            s.put(spec("a"), Precondition::None).await.unwrap_err(),
            deleting
        );
        assert_eq!(
            s.put(spec("a"), Precondition::Revision(a.revision))
                .await
                .unwrap_err(),
            deleting
        );
        let m = meta_state(h.meta().as_ref()).await.unwrap();
        assert_eq!(m.len(), 1, "nothing was written: {m:?}");
        assert_eq!(m["a"].0, a.revision);
        // `ensure` finds the topic still referenced by "a": it unmarks it, and writes
        // work again.
        let t = MetaTopicStore::start(h.meta()).await.unwrap();
        let (_, created) = t.ensure("orders", 1).await.unwrap();
        assert!(!created);
        s.put(spec("a"), Precondition::Revision(a.revision))
            .await
            .expect("update once unmarked");
        s.create(spec("y")).await.expect("create once unmarked");
    }

    pub async fn a_topic_referenced_by_a_subscription_is_not_deleted(h: &mut Harness) {
        orders(h).await;
        let s = store(h.meta()).await;
        let t = MetaTopicStore::start(h.client().await).await.unwrap();
        let before = t.get("orders").await.unwrap().expect("the topic");
        s.create(spec("a")).await.unwrap();
        assert_eq!(
            t.delete("orders").await.unwrap_err(),
            TopicError::InUse {
                name: "orders".into(),
                subscriptions: vec!["a".into()]
            }
        );
        let now = t
            .get("orders")
            .await
            .unwrap()
            .expect("the topic still exists");
        assert_eq!(now.incarnation, before.incarnation);
        s.put(spec("a"), Precondition::None)
            .await
            .expect("the subscription is still writable");
        s.delete("a", Precondition::None).await.unwrap();
        t.delete("orders").await.expect("unreferenced now");
        assert_eq!(
            s.create(spec("a")).await.unwrap_err(),
            SubscriptionError::TopicNotFound {
                topic: "orders".into()
            }
        );
    }

    /// The race: subscriptions created (on two instances, through `create` and the
    /// unconditional `put`) while another instance deletes their topic. Whatever
    /// the interleaving, afterwards the topic exists (unmarked) or no subscription
    /// references it, checked in Meta directly; and every acknowledged create's topic
    /// still exists.
    pub async fn given_creates_racing_a_topic_delete_then_no_subscription_references_a_deleted_topic(
        h: &mut Harness,
    ) {
        let a = Arc::new(store(h.client().await).await);
        let b = Arc::new(store(h.client().await).await);
        let ta = Arc::new(MetaTopicStore::start(h.client().await).await.unwrap());
        let tb = Arc::new(MetaTopicStore::start(h.client().await).await.unwrap());
        let meta = h.meta();
        const ROUNDS: usize = 24;
        const CREATORS: usize = 4;
        let (mut deleted_rounds, mut refused_creates, mut acked_creates) = (0, 0, 0);
        for round in 0..ROUNDS {
            let topic = format!("race{round}");
            ta.ensure(&topic, 1).await.unwrap();
            let mut creators = Vec::new();
            for k in 0..CREATORS {
                let s = if k % 2 == 0 { a.clone() } else { b.clone() };
                let topic = topic.clone();
                creators.push(tokio::spawn(async move {
                    let pause = rand::random::<u64>() % 4000;
                    tokio::time::sleep(Duration::from_micros(pause)).await;
                    let name = format!("{topic}-s{k}");
                    let x = SubscriptionSpec::new(&name, &topic);
                    let r = if k < 2 {
                        s.create(x).await.map(|_| ())
                    } else {
                        s.put(x, Precondition::None).await.map(|_| ())
                    };
                    match r {
                        Ok(()) => Some(name),
                        Err(SubscriptionError::TopicNotFound { .. }) => None,
                        Err(e) => panic!("round {round} creator {k}: {e:?}"),
                    }
                }));
            }
            let t = if round % 2 == 0 {
                ta.clone()
            } else {
                tb.clone()
            };
            let deleter = {
                let topic = topic.clone();
                tokio::spawn(async move {
                    let pause = rand::random::<u64>() % 4000;
                    tokio::time::sleep(Duration::from_micros(pause)).await;
                    for _ in 0..3 {
                        match t.delete(&topic).await {
                            Ok(_) => return true,
                            Err(TopicError::InUse { .. }) => {
                                tokio::time::sleep(Duration::from_millis(1)).await
                            }
                            Err(e) => panic!("round {round} delete: {e:?}"),
                        }
                    }
                    false
                })
            };
            let mut acked = Vec::new();
            for c in creators {
                match c.await.unwrap() {
                    Some(name) => acked.push(name),
                    None => refused_creates += 1,
                }
            }
            let deleted = deleter.await.unwrap();
            acked_creates += acked.len();
            deleted_rounds += usize::from(deleted);

            // Meta, read directly.
            let topic_kv = meta.get(&topics::record::key(&topic)).await.unwrap().kv;
            let referencing: Vec<String> = meta_state(meta.as_ref())
                .await
                .unwrap()
                .into_iter()
                .filter(|(_, (_, _, x))| x.topic == topic)
                .map(|(n, _)| n)
                .collect();
            match topic_kv {
                None => assert!(
                    referencing.is_empty(),
                    "round {round}: topic {topic} is gone but {referencing:?} reference it"
                ),
                Some(kv) => {
                    let rec = topics::record::decode_value(&topic, &kv.value).unwrap();
                    assert!(!rec.deleting, "round {round}: topic left marked");
                }
            }
            let mut acked_sorted = acked.clone();
            acked_sorted.sort();
            assert_eq!(
                referencing, acked_sorted,
                "round {round}: exactly the acknowledged subscriptions exist"
            );
            assert_eq!(
                deleted,
                acked.is_empty(),
                "round {round}: deleted={deleted}, acked={acked:?}"
            );
        }
        eprintln!(
            "{} rounds: topic deleted in {deleted_rounds}, {acked_creates} creates acknowledged, \
             {refused_creates} refused with TopicNotFound",
            ROUNDS
        );
    }
}
