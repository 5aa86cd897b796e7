//! The partition-log conformance suite (`meshd_test_support::log_conformance`) on the
//! Local RocksDB log; the JetStream log runs the same cases.

mod common;

use meshd_stores::log::PartitionLog;
use meshd_test_support::log_conformance as suite;
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_appends_get_contiguous_offsets_and_read_back_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let log: Arc<dyn PartitionLog> = Arc::new(stores.log.clone());
    suite::concurrent_appends_get_contiguous_offsets_and_read_back_exactly(&[log]).await;
}

#[tokio::test]
async fn batch_offsets_follow_call_order() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    suite::batch_offsets_follow_call_order(&stores.log).await;
}

#[tokio::test]
async fn deleting_a_topic_removes_its_events_only() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    suite::deleting_a_topic_removes_its_events_only(&stores.log).await;
}

#[tokio::test]
async fn appends_notify_only_the_partitions_appended_to() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    suite::appends_notify_only_the_partitions_appended_to(&stores.log).await;
}

#[tokio::test]
async fn dead_letter_bodies_are_listed_read_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    suite::dead_letter_bodies_are_listed_read_and_deleted(&stores.log).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_answers_the_stored_offset_for_a_key_within_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let stores = common::open(dir.path());
    let log: Arc<dyn PartitionLog> = Arc::new(stores.log.clone());
    suite::dedup_answers_the_stored_offset_for_a_key_within_the_window(&[log]).await;
}
