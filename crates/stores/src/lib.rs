//! # The state plane's stores
//!
//! Every store is a trait whose doc comment is its contract, with one durable
//! implementation; there is no in-memory implementation in production code.
//!
//! | store | tier | backend | crate |
//! |---|---|---|---|
//! | partition log ([`log`]) | L1 | Local RocksDB | `meshd-stores-local` |
//! | OffsetStore ([`offsets`]) | L1 local | Local RocksDB + cache; fenced checkpoints to Meta | `meshd-stores-local` |
//! | DeliveryStateStore ([`delivery`]) | L1, sub-second flush | Local RocksDB | `meshd-stores-local` |
//! | park index ([`park`]) | L1, durable per write | Local RocksDB | `meshd-stores-local` |
//! | TopicStore ([`topics`]) | L2 cluster-shared | Meta + prefix watch + cache | here |
//! | SubscriptionStore ([`subscriptions`]) | L2 cluster-shared | Meta + prefix watch + cache | here |
//! | SessionStore ([`sessions`]) | L2 cluster-shared | Meta + lease + cache | here |
//! | DeadLetterStore ([`deadletters`]) | L3 durable | Meta (ledger) + the log's dead-letter stream (bodies) | here |
//! | TaskStore ([`tasks`]) | L3 durable | Meta | here |
//! | attempt ledger ([`attempts`]) | L3 durable, cluster mode | Meta (fenced by the partition owner) | here |
//!
//! The stores on Meta depend only on the [`meshd_meta::Meta`] contract, so they run on
//! etcd and on the embedded Meta alike, and their conformance suites run on both.

pub mod attempts;
pub(crate) mod cache;
pub mod deadletters;
pub mod delivery;
pub mod failure;
pub mod log;
pub mod names;
pub mod offsets;
pub mod park;
pub mod sessions;
pub mod subscriptions;
pub mod tasks;
pub mod topics;

mod codec;
pub use codec::Kept;
mod meta_util;
pub use meta_util::delete_prefix;
pub mod time;
