//! Test infrastructure for meshd: throwaway etcd processes ([`etcd`]) and nats-server
//! processes with JetStream ([`nats`]), real meshd processes ([`meshd`]) with a small
//! HTTP client ([`http`]), deadline-bounded waits ([`wait`]), a TCP proxy that can be
//! cut ([`proxy`]), an fsync fault for real processes ([`fault`]), a lazy filesystem for
//! power cuts ([`lazyfs`]), the Meta conformance
//! suite ([`conformance`]) that every Meta backend runs and the partition-log
//! conformance suite ([`log_conformance`]). Never a dependency of production code.

pub mod certs;
pub mod conformance;
pub mod etcd;
pub mod fault;
pub mod http;
pub mod lazyfs;
pub mod linearizability;
pub mod log_conformance;
pub mod meshd;
pub mod nats;
pub mod process;
pub mod proxy;
pub mod rng;
pub mod wait;
