//! The two value types a [`MetaError`](crate::MetaError) carries: a key with its
//! metadata and a lease id. They live here, below both `error` and `types`; `types`
//! re-exports them with the other value types.

use std::fmt;

/// A lease id issued by the store (never 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub i64);

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}", self.0)
    }
}

/// One key with its store-issued metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// The revision that created this incarnation of the key (a delete and re-create
    /// gives a new one).
    pub create_revision: i64,
    /// The revision of the last write to the key.
    pub mod_revision: i64,
    /// 1 on create, +1 on every put.
    pub version: i64,
    pub lease: Option<LeaseId>,
}
