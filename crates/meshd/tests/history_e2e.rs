//! Histories of concurrent clients checked against the contract (issue 25, item 2;
//! the cluster crash loop does the same under faults): a subscription's settings are a
//! register that clients write (`PUT`) and read (`GET`) through both instances of a
//! cluster. Writes are conditional in Meta, so their history must be linearizable.
//! Reads come from each instance's cache, which the contract (state-plane.md,
//! SubscriptionStore) keeps read-your-writes and convergent, not linearizable (a read
//! on one instance may lag a write through the other by one cache refresh; an earlier
//! version of this test took reads as linearizable and failed now and then for that
//! reason). So a read must return a written value, and never one that is certainly
//! older than a write its own instance had answered before the read was sent.

mod common;

use common::*;
use meshd_test_support::linearizability::{
    check_by_key, Operation, RegisterInput, RegisterOf, RegisterOutput,
};
use meshd_test_support::rng::Rng;
use serde_json::json;
use std::time::{Duration, Instant};

type Op = Operation<RegisterInput<u64>, RegisterOutput<u64>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_clients_writing_and_reading_a_subscription_through_two_instances_then_the_history_is_linearizable(
) {
    let cluster = SmallCluster::start(2, Duration::from_millis(2000)).await;
    create_topic(&cluster.addr(0), "t", 1).await;
    let addrs = [cluster.addr(0), cluster.addr(1)];
    let start = Instant::now();
    let mut rng = Rng(25);
    let clients = (0..6).map(|c| {
        let addrs = addrs.clone();
        let mut rng = rng.fork();
        async move {
            // Each operation with the instance that served it.
            let mut ops: Vec<(usize, Op)> = Vec::new();
            for i in 0..60u64 {
                let instance = rng.below(2) as usize;
                let a = &addrs[instance];
                let write = rng.below(2) == 0;
                let value = 1000 + c * 100 + i;
                let call = start.elapsed().as_nanos() as u64;
                if write {
                    let r = meshd_test_support::http::send_json(
                        a,
                        "PUT",
                        "/v1/subscriptions/s",
                        &json!({"topic": "t", "ack_timeout_ms": value}),
                    )
                    .await;
                    let ret = start.elapsed().as_nanos() as u64;
                    match r {
                        Ok(r) if r.status == 200 || r.status == 201 => ops.push((
                            instance,
                            Op::answered(
                                c as usize,
                                RegisterInput::Write(value),
                                call,
                                ret,
                                RegisterOutput::Written,
                            ),
                        )),
                        // No answer, or one that does not say: it may have happened.
                        Ok(r) if r.status >= 500 => ops.push((
                            instance,
                            Op::unanswered(c as usize, RegisterInput::Write(value), call),
                        )),
                        Err(_) => ops.push((
                            instance,
                            Op::unanswered(c as usize, RegisterInput::Write(value), call),
                        )),
                        Ok(r) => panic!("PUT answered {} {}", r.status, r.body),
                    }
                } else {
                    let r = meshd_test_support::http::get(a, "/v1/subscriptions/s").await;
                    let ret = start.elapsed().as_nanos() as u64;
                    let seen = match r {
                        Ok(r) if r.status == 404 => None,
                        Ok(r) if r.status == 200 => Some(
                            r.json().unwrap()["ack_timeout_ms"]
                                .as_u64()
                                .expect("ack_timeout_ms"),
                        ),
                        // A failed read changes nothing: left out.
                        _ => continue,
                    };
                    ops.push((
                        instance,
                        Op::answered(
                            c as usize,
                            RegisterInput::Read,
                            call,
                            ret,
                            RegisterOutput::Read(seen),
                        ),
                    ));
                }
            }
            ops
        }
    });
    let history: Vec<(usize, Op)> = futures::future::join_all(clients)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert!(history.len() >= 80, "{} operations", history.len());
    let writes: Vec<Op> = history
        .iter()
        .filter(|(_, op)| op.input != RegisterInput::Read)
        .map(|(_, op)| op.clone())
        .collect();
    assert!(writes.len() >= 40, "{} writes", writes.len());
    if let Err((_, verdict)) = check_by_key(&RegisterOf::<u64>::default(), &writes, |_| ()) {
        panic!("the writes are not linearizable: {verdict:?}\nhistory: {writes:#?}");
    }
    // value -> (call, answer time or None) of the write that wrote it.
    let written: std::collections::BTreeMap<u64, (u64, Option<u64>)> = writes
        .iter()
        .filter_map(|op| match op.input {
            RegisterInput::Write(v) => Some((v, (op.call, op.ret.as_ref().map(|(t, _)| *t)))),
            _ => None,
        })
        .collect();
    let mut reads = 0;
    for (instance, op) in &history {
        let (RegisterInput::Read, Some((ret, RegisterOutput::Read(Some(v))))) =
            (&op.input, &op.ret)
        else {
            continue;
        };
        reads += 1;
        let Some((v_call, v_ret)) = written.get(v) else {
            panic!("a read answered {v}, which no write wrote: {op:?}");
        };
        assert!(
            v_call <= ret,
            "a read answered {v} before its write was sent: {op:?}"
        );
        // Read-your-writes on the serving instance: no write that instance answered
        // before this read was sent was sent after v's write had been answered.
        for (other_instance, w) in &history {
            let (RegisterInput::Write(_), Some((w_ret, _))) = (&w.input, &w.ret) else {
                continue;
            };
            if other_instance == instance && *w_ret <= op.call && v_ret.is_some_and(|t| t < w.call)
            {
                panic!("instance {instance} answered {op:?}, older than its own write {w:?}");
            }
        }
    }
    assert!(reads >= 40, "{reads} reads");
}
