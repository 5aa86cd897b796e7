//! # What the stores on Meta share: error classes, compare-and-set, paged scans
//!
//! Every store maps Meta's failures onto its own error type, whose `Store` variant
//! keeps Meta's classification visible ([`FromMeta`], [`StoreFailure`]); writes conditional on a version
//! treat a failed compare as a lost race, not an error ([`won`],
//! [`commit_at_version`]); and ledgers without a cache scan their prefix page by page
//! ([`PrefixPages`]).

use crate::failure::StoreFailure;
use meshd_meta::fence::Ownership;
use meshd_meta::{Compare, KeyValue, Meta, MetaError, RangeOptions, RangeResponse, Txn};

/// How often a call that makes its own compare-and-set retries after losing a race
/// before it reports `Unavailable` (not applied; retry later). Every lost race means
/// another writer made progress, so this is only reached under pathological contention.
pub(crate) const MAX_CAS_ATTEMPTS: usize = 64;

/// A store error that keeps Meta's failure classes visible: they become its
/// [`StoreFailure`]; what is left is the store's own answer ([`special`](Self::special))
/// or, when the store never asks for it, [`StoreFailure::Failed`].
pub(crate) trait FromMeta: From<StoreFailure> {
    /// The store's own answer to the other errors (fenced, conflict, ...); `Err`
    /// gives the error back to be reported as [`StoreFailure::Failed`].
    fn special(e: MetaError) -> Result<Self, MetaError> {
        Err(e)
    }

    /// Maps a Meta error the caller did not handle itself.
    fn from_meta(e: MetaError) -> Self {
        match StoreFailure::from_meta(e) {
            Ok(f) => f.into(),
            Err(other) => {
                Self::special(other).unwrap_or_else(|e| StoreFailure::Failed(e.to_string()).into())
            }
        }
    }
}

/// A compare-and-set's answer: `Ok(Ok(_))` it won, `Ok(Err(current))` it lost (a
/// compare failed; `current` is the value Meta reported, if any), `Err` Meta failed.
pub(crate) fn won<T>(
    r: Result<T, MetaError>,
) -> Result<Result<T, Option<Box<KeyValue>>>, MetaError> {
    match r {
        Ok(t) => Ok(Ok(t)),
        Err(MetaError::Conflict { current }) => Ok(Err(current)),
        Err(e) => Err(e),
    }
}

/// Commits `txn` if `key` is still at `version` (its `mod_revision`), fenced by
/// `fence` when given. `Ok(None)`: it is not (lost a race: re-read and decide again).
/// The answer is the commit's revision.
pub(crate) async fn commit_at_version(
    meta: &dyn Meta,
    key: &[u8],
    version: i64,
    txn: Txn,
    fence: Option<&Ownership>,
) -> Result<Option<i64>, MetaError> {
    let txn = txn.when(Compare::ModRevision {
        key: key.to_vec(),
        revision: version,
    });
    let r = match fence {
        Some(owner) => owner.commit(meta, txn).await,
        None => meta.txn(txn).await,
    };
    Ok(won(r)?.ok().map(|r| r.revision))
}

/// The smallest key after `key`.
pub(crate) fn after(mut key: Vec<u8>) -> Vec<u8> {
    key.push(0);
    key
}

/// A prefix read page by page (each page one consistent `range`).
pub(crate) struct PrefixPages {
    prefix: Vec<u8>,
    /// Where the next page starts (`None`: at the prefix).
    start: Option<Vec<u8>>,
    limit: usize,
    done: bool,
}

impl PrefixPages {
    /// Pages of `limit` keys under `prefix`, from `start` (inclusive) when given.
    pub(crate) fn new(prefix: Vec<u8>, start: Option<Vec<u8>>, limit: usize) -> Self {
        Self {
            prefix,
            start,
            limit,
            done: false,
        }
    }

    /// The next page; `None` after the last one.
    pub(crate) async fn next(
        &mut self,
        meta: &dyn Meta,
    ) -> Result<Option<RangeResponse>, MetaError> {
        if self.done {
            return Ok(None);
        }
        let page = meta
            .range(
                &self.prefix,
                RangeOptions {
                    start: self.start.clone(),
                    limit: self.limit,
                },
            )
            .await?;
        match page.kvs.last() {
            Some(last) if page.more => self.start = Some(after(last.key.clone())),
            _ => self.done = true,
        }
        Ok(Some(page))
    }
}

/// Deletes every key under `prefix`, `page` keys per transaction (Meta has no range
/// delete; etcd allows at most 128 operations per transaction by default). Not atomic
/// across pages; repeating it is safe. Returns how many keys it deleted.
pub async fn delete_prefix(
    meta: &dyn Meta,
    prefix: Vec<u8>,
    page: usize,
) -> Result<u64, MetaError> {
    let mut pages = PrefixPages::new(prefix, None, page);
    let mut deleted = 0u64;
    while let Some(p) = pages.next(meta).await? {
        if p.kvs.is_empty() {
            continue;
        }
        let txn = p
            .kvs
            .iter()
            .fold(meshd_meta::Txn::new(), |txn, kv| txn.delete(&kv.key));
        deleted += meta.txn(txn).await?.deleted;
    }
    Ok(deleted)
}
