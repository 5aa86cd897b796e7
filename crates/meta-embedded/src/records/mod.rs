//! The embedded Meta's persisted records and their keys, one module per record
//! (house style 9). Everything lives in the `meta` column family of the Local RocksDB.
//!
//! | key | record | lifetime |
//! |---|---|---|
//! | `s` | [`state::StateRecord`]: revision, history start, next lease id | forever; rewritten with every change |
//! | `k` + user key | [`key_record::KeyRecord`]: value, create/mod revision, version, lease | until deleted |
//! | `h` + revision (u64 BE) | [`history::HistoryRecord`]: the events of one revision | until compacted (bounded history) |
//! | `l` + lease id (u64 BE) | [`lease::LeaseRecord`]: the TTL | until revoked or expired |
//! | `a` + lease id (u64 BE) + user key | empty: "this key is attached to this lease" | with the attachment |
//!
//! Prefixes are single bytes and are never reused for another meaning.

pub mod codec;
pub mod history;
pub mod key_record;
pub mod lease;
pub mod state;

pub use codec::DecodeError;

/// The column family of the embedded Meta in the Local RocksDB.
pub const CF: &str = "meta";

pub const STATE_KEY: &[u8] = b"s";
pub const KEY_PREFIX: u8 = b'k';
pub const HISTORY_PREFIX: u8 = b'h';
pub const LEASE_PREFIX: u8 = b'l';
pub const ATTACH_PREFIX: u8 = b'a';

pub fn key_key(user_key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + user_key.len());
    k.push(KEY_PREFIX);
    k.extend_from_slice(user_key);
    k
}

pub fn history_key(revision: i64) -> Vec<u8> {
    let mut k = vec![HISTORY_PREFIX];
    k.extend_from_slice(&(revision as u64).to_be_bytes());
    k
}

pub fn lease_key(lease: i64) -> Vec<u8> {
    let mut k = vec![LEASE_PREFIX];
    k.extend_from_slice(&(lease as u64).to_be_bytes());
    k
}

pub fn attach_prefix(lease: i64) -> Vec<u8> {
    let mut k = vec![ATTACH_PREFIX];
    k.extend_from_slice(&(lease as u64).to_be_bytes());
    k
}

pub fn attach_key(lease: i64, user_key: &[u8]) -> Vec<u8> {
    let mut k = attach_prefix(lease);
    k.extend_from_slice(user_key);
    k
}

/// Decodes the lease id of a `l` key.
pub fn lease_id_of(key: &[u8]) -> Option<i64> {
    let b: [u8; 8] = key.get(1..9)?.try_into().ok()?;
    Some(u64::from_be_bytes(b) as i64)
}
