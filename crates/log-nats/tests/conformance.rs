//! The partition-log conformance suite (`meshd_test_support::log_conformance`) on a
//! real nats-server, one server per case. Appenders use two clients, as two meshd
//! processes sharing the log would.

mod common;

use meshd_stores::log::PartitionLog;
use meshd_test_support::log_conformance as suite;
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_appends_get_contiguous_offsets_and_read_back_exactly() {
    let nats = common::server().await;
    let logs: Vec<Arc<dyn PartitionLog>> = vec![
        Arc::new(common::connect(&nats).await),
        Arc::new(common::connect(&nats).await),
    ];
    suite::concurrent_appends_get_contiguous_offsets_and_read_back_exactly(&logs).await;
}

#[tokio::test]
async fn batch_offsets_follow_call_order() {
    let nats = common::server().await;
    suite::batch_offsets_follow_call_order(&common::connect(&nats).await).await;
}

#[tokio::test]
async fn deleting_a_topic_removes_its_events_only() {
    let nats = common::server().await;
    suite::deleting_a_topic_removes_its_events_only(&common::connect(&nats).await).await;
}

#[tokio::test]
async fn appends_notify_only_the_partitions_appended_to() {
    let nats = common::server().await;
    suite::appends_notify_only_the_partitions_appended_to(&common::connect(&nats).await).await;
}

#[tokio::test]
async fn dead_letter_bodies_are_listed_read_and_deleted() {
    let nats = common::server().await;
    suite::dead_letter_bodies_are_listed_read_and_deleted(&common::connect(&nats).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_answers_the_stored_offset_for_a_key_within_the_window() {
    let nats = common::server().await;
    let logs: Vec<Arc<dyn PartitionLog>> = vec![
        Arc::new(common::connect(&nats).await),
        Arc::new(common::connect(&nats).await),
    ];
    suite::dedup_answers_the_stored_offset_for_a_key_within_the_window(&logs).await;
}
