//! Cluster mode: several instances on one etcd split the partitions of a shared log.
//! `assign` says which instance should own a partition.

// The controller runs in cluster mode (a shared log, issue 7), which is being built:
// until the runtime is wired to it, only its tests and `/v1/cluster` use this module.
#[allow(dead_code)]
pub mod assign;
#[allow(dead_code)]
pub mod ownership;
