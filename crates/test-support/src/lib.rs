//! Test infrastructure for meshd: throwaway etcd processes ([`etcd`]), real meshd
//! processes ([`meshd`]) with a small HTTP client ([`http`]), deadline-bounded waits
//! ([`wait`]), a TCP proxy that can be cut ([`proxy`]), an fsync fault for real processes
//! ([`fault`]) and the Meta conformance suite ([`conformance`]) that every Meta backend
//! runs. Never a dependency of production code.

pub mod conformance;
pub mod etcd;
pub mod fault;
pub mod http;
pub mod meshd;
pub mod process;
pub mod proxy;
pub mod wait;
