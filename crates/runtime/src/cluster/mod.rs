//! Cluster mode: several instances on one etcd split the partitions of a shared log.
//! `assign` says which instance should own a partition.

pub mod assign;
pub mod forward;
pub mod ownership;
