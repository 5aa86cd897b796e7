//! Value types of the Meta contract.

use crate::error::MetaError;
pub use crate::kv::{KeyValue, LeaseId};
use std::collections::HashSet;
use std::time::Duration;

/// A granted lease with its effective TTL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lease {
    pub id: LeaseId,
    pub ttl: Duration,
}

/// A condition on one key's current state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Precondition {
    /// Unconditional.
    None,
    /// The key must not exist.
    Absent,
    /// The key's `mod_revision` must equal this (0 means absent).
    ModRevision(i64),
}

/// One compare of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compare {
    /// The key must not exist.
    Absent { key: Vec<u8> },
    /// The key must exist.
    Present { key: Vec<u8> },
    /// The key's `mod_revision` must equal `revision` (0 means absent).
    ModRevision { key: Vec<u8>, revision: i64 },
    /// The key must exist with exactly this value.
    Value { key: Vec<u8>, value: Vec<u8> },
}

impl Compare {
    pub fn key(&self) -> &[u8] {
        match self {
            Compare::Absent { key }
            | Compare::Present { key }
            | Compare::ModRevision { key, .. }
            | Compare::Value { key, .. } => key,
        }
    }

    /// Evaluates the compare against the key's current value. Backends that cannot
    /// tell which compare of a failed transaction failed use this on the values they
    /// read back, so both backends report failures identically.
    pub fn holds(&self, current: Option<&KeyValue>) -> bool {
        match self {
            Compare::Absent { .. } => current.is_none(),
            Compare::Present { .. } => current.is_some(),
            Compare::ModRevision { revision, .. } => {
                current.map(|kv| kv.mod_revision).unwrap_or(0) == *revision
            }
            Compare::Value { value, .. } => current.map(|kv| &kv.value) == Some(value),
        }
    }
}

/// What a failed compare means to the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFail {
    /// A precondition of the caller's own write: `Conflict { current }`.
    Conflict,
    /// An ownership check: `Fenced`.
    Fenced,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Condition {
    pub compare: Compare,
    pub on_fail: OnFail,
}

/// One operation of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOp {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: Option<LeaseId>,
    },
    Delete {
        key: Vec<u8>,
    },
}

impl TxnOp {
    pub fn key(&self) -> &[u8] {
        match self {
            TxnOp::Put { key, .. } | TxnOp::Delete { key } => key,
        }
    }
}

/// Several compares and several operations, applied all or none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    pub conditions: Vec<Condition>,
    pub ops: Vec<TxnOp>,
}

impl Txn {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a compare whose failure is a `Conflict`.
    pub fn when(mut self, compare: Compare) -> Self {
        self.conditions.push(Condition {
            compare,
            on_fail: OnFail::Conflict,
        });
        self
    }

    /// Adds a compare whose failure is `Fenced`.
    pub fn fence(mut self, compare: Compare) -> Self {
        self.conditions.push(Condition {
            compare,
            on_fail: OnFail::Fenced,
        });
        self
    }

    /// Adds the compare that a [`Precondition`] on `key` stands for.
    pub fn when_precondition(self, key: &[u8], precondition: Precondition) -> Self {
        match precondition {
            Precondition::None => self,
            Precondition::Absent => self.when(Compare::Absent { key: key.to_vec() }),
            Precondition::ModRevision(revision) => self.when(Compare::ModRevision {
                key: key.to_vec(),
                revision,
            }),
        }
    }

    pub fn put(self, key: &[u8], value: &[u8]) -> Self {
        self.put_with_lease(key, value, None)
    }

    pub fn put_with_lease(mut self, key: &[u8], value: &[u8], lease: Option<LeaseId>) -> Self {
        self.ops.push(TxnOp::Put {
            key: key.to_vec(),
            value: value.to_vec(),
            lease,
        });
        self
    }

    pub fn delete(mut self, key: &[u8]) -> Self {
        self.ops.push(TxnOp::Delete { key: key.to_vec() });
        self
    }

    /// Checks what both backends reject: empty keys, and two operations on one key
    /// (etcd refuses "duplicate key given in txn request").
    pub fn validate(&self) -> Result<(), MetaError> {
        let mut seen = HashSet::new();
        for c in &self.conditions {
            if c.compare.key().is_empty() {
                return Err(MetaError::InvalidRequest("empty key in compare".into()));
            }
        }
        for op in &self.ops {
            if op.key().is_empty() {
                return Err(MetaError::InvalidRequest("empty key in operation".into()));
            }
            if !seen.insert(op.key()) {
                return Err(MetaError::InvalidRequest(format!(
                    "two operations on key {} in one transaction",
                    String::from_utf8_lossy(op.key())
                )));
            }
        }
        Ok(())
    }

    /// Decides the error of a transaction whose compares did not all hold, given the
    /// current value of every compared key (`lookup`). Fences are checked first.
    pub fn failure<'a>(&self, lookup: impl Fn(&[u8]) -> Option<&'a KeyValue>) -> MetaError {
        if self
            .conditions
            .iter()
            .any(|c| c.on_fail == OnFail::Fenced && !c.compare.holds(lookup(c.compare.key())))
        {
            return MetaError::Fenced;
        }
        for c in &self.conditions {
            let current = lookup(c.compare.key());
            if !c.compare.holds(current) {
                return MetaError::conflict(current.cloned());
            }
        }
        // Every compare holds on the values read back: the state changed between the
        // transaction and the read. Report a conflict with no better knowledge.
        MetaError::conflict(None)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnResponse {
    /// The revision of the transaction's changes, or the store's revision when it
    /// changed nothing.
    pub revision: i64,
    /// How many keys its deletes removed.
    pub deleted: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PutResponse {
    pub revision: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeleteResponse {
    pub revision: i64,
    pub deleted: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GetResponse {
    /// The store revision the read observed.
    pub revision: i64,
    pub kv: Option<KeyValue>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeOptions {
    /// First key to return (inclusive); `None` starts at the prefix.
    pub start: Option<Vec<u8>>,
    /// At most this many keys; 0 means all.
    pub limit: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeResponse {
    pub revision: i64,
    pub kvs: Vec<KeyValue>,
    pub more: bool,
}

/// One change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// The key was written; `kv` is its new state.
    Put(KeyValue),
    /// The key was deleted at `revision`.
    Delete { key: Vec<u8>, revision: i64 },
}

impl WatchEvent {
    pub fn revision(&self) -> i64 {
        match self {
            WatchEvent::Put(kv) => kv.mod_revision,
            WatchEvent::Delete { revision, .. } => *revision,
        }
    }

    pub fn key(&self) -> &[u8] {
        match self {
            WatchEvent::Put(kv) => &kv.key,
            WatchEvent::Delete { key, .. } => key,
        }
    }
}

/// Changes of one or more consecutive revisions, in revision order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchBatch {
    pub events: Vec<WatchEvent>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaStatus {
    pub revision: i64,
    pub db_size_bytes: u64,
    /// The size at which Meta refuses writes (etcd's `--quota-backend-bytes`), when
    /// known: `None` for the embedded Meta (bounded by its disk) and when etcd's
    /// metrics cannot be read.
    pub quota_bytes: Option<u64>,
    /// Active alarms by name (etcd's `NOSPACE`, `CORRUPT`): while `NOSPACE` is raised
    /// every write fails. Empty for the embedded Meta.
    pub alarms: Vec<String>,
}

/// The smallest key greater than every key starting with `prefix` (etcd's
/// `range_end` for a prefix); empty when no such key exists (prefix of all 0xff).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_last_byte() {
        assert_eq!(prefix_end(b"a/"), b"a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), Vec::<u8>::new());
    }

    #[test]
    fn duplicate_keys_are_rejected() {
        let txn = Txn::new().put(b"k", b"1").delete(b"k");
        assert!(matches!(txn.validate(), Err(MetaError::InvalidRequest(_))));
    }

    #[test]
    fn fence_failure_wins_over_conflict() {
        let owner = KeyValue {
            key: b"owner".to_vec(),
            value: vec![],
            create_revision: 5,
            mod_revision: 7,
            version: 1,
            lease: None,
        };
        let txn = Txn::new()
            .when(Compare::Absent {
                key: b"owner".to_vec(),
            })
            .fence(Compare::ModRevision {
                key: b"owner".to_vec(),
                revision: 5,
            });
        let err = txn.failure(|k| (k == b"owner").then_some(&owner));
        assert_eq!(err, MetaError::Fenced);
    }

    #[test]
    fn conflict_reports_the_failed_key() {
        let kv = KeyValue {
            key: b"b".to_vec(),
            value: b"x".to_vec(),
            create_revision: 2,
            mod_revision: 3,
            version: 2,
            lease: None,
        };
        let txn = Txn::new()
            .when(Compare::Absent { key: b"a".to_vec() })
            .when(Compare::ModRevision {
                key: b"b".to_vec(),
                revision: 2,
            });
        let err = txn.failure(|k| (k == b"b").then_some(&kv));
        assert_eq!(err, MetaError::conflict(Some(kv.clone())));
    }
}
