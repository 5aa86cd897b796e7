//! Test infrastructure for meshd: throwaway etcd processes ([`etcd`]) and the Meta
//! conformance suite ([`conformance`]) that every Meta backend runs. Never a
//! dependency of production code.

pub mod conformance;
pub mod etcd;
