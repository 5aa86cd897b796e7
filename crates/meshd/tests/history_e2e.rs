//! Histories of concurrent clients checked for linearizability (issue 25, item 2, a
//! first application, without faults yet): a subscription's settings are a register that
//! clients write (`PUT`) and read (`GET`) through both instances of a cluster.

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
            let mut ops: Vec<Op> = Vec::new();
            for i in 0..60u64 {
                let a = &addrs[rng.below(2) as usize];
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
                        Ok(r) if r.status == 200 || r.status == 201 => ops.push(Op::answered(
                            c as usize,
                            RegisterInput::Write(value),
                            call,
                            ret,
                            RegisterOutput::Written,
                        )),
                        // No answer, or one that does not say: it may have happened.
                        Ok(r) if r.status >= 500 => ops.push(Op::unanswered(
                            c as usize,
                            RegisterInput::Write(value),
                            call,
                        )),
                        Err(_) => ops.push(Op::unanswered(
                            c as usize,
                            RegisterInput::Write(value),
                            call,
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
                    ops.push(Op::answered(
                        c as usize,
                        RegisterInput::Read,
                        call,
                        ret,
                        RegisterOutput::Read(seen),
                    ));
                }
            }
            ops
        }
    });
    let history: Vec<Op> = futures::future::join_all(clients)
        .await
        .into_iter()
        .flatten()
        .collect();
    assert!(history.len() >= 80, "{} operations", history.len());
    if let Err((_, verdict)) = check_by_key(&RegisterOf::<u64>::default(), &history, |_| ()) {
        panic!("not linearizable: {verdict:?}\nhistory: {history:#?}");
    }
}
