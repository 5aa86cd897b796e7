//! The key catalog: where every Meta key lives.
//!
//! Keys are `/`-separated paths built from escaped components, so no name can collide
//! with another: a component's `%` and `/` bytes (and any byte outside printable
//! ASCII) are written as `%XX`, which makes the mapping from component lists to keys
//! injective, and a prefix that ends with `/` matches exactly the keys below it.
//!
//! | prefix | layout | value | lifetime |
//! |---|---|---|---|
//! | `meshd/v1/members/` | `members/{instance}` | member record | the instance's lease |
//! | `meshd/v1/owners/` | `owners/{resource kind}/{resource...}` | holder id | the holder's lease; epoch = `mod_revision` |
//! | `meshd/v1/topics/` | `topics/{topic}` | topic record | until deleted |
//! | `meshd/v1/subscriptions/` | `subscriptions/{name}` | subscription record | until deleted |
//! | `meshd/v1/sessions/` | `sessions/client/{client id}` | the session's owner key (session record); its `mod_revision` is the epoch | the session's lease |
//! | `meshd/v1/sessions/` | `sessions/id/{session id}` | `{client_id}`: find a session by id | the lease of the session that wrote it |
//! | `meshd/v1/deadletters/` | `deadletters/entries/{subscription}/{id}` | dead-letter ledger record (references the body in the log) | until deleted or retention |
//! | `meshd/v1/deadletters/` | `deadletters/ids/{id}` | `{subscription}`: find an entry by id | with its entry |
//! | `meshd/v1/tasks/` | `tasks/{id}` | task record; `version` = `mod_revision` | until retention after a terminal state |
//! | `meshd/v1/checkpoints/` | `checkpoints/{subscription incarnation}/{partition}` | offset checkpoint | with the subscription |
//! | `meshd/v1/secrets/` | `secrets/cluster` | the cluster secret of the internal routes (when no `--cluster-secret-file` is given) | forever |
//! | `meshd/v1/attempts/` | `attempts/{subscription}/{incarnation}/{topic}/{partition}` | attempt ledger: the attempt count of every in-flight delivery, rewritten whole, fenced by the partition owner | with the subscription, or until nothing of the partition is in flight |
//!
//! A fixed first component (`client`/`id`, `entries`/`ids`) keeps two key families
//! under one kind apart whatever the names are. Retired prefixes stay listed as
//! reserved and are never reused.

/// The root of every meshd key (the `v1` is the key layout version).
pub const ROOT: &str = "meshd/v1/";

/// Key kinds: each a stable prefix under [`ROOT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyKind {
    Members,
    Owners,
    Topics,
    Subscriptions,
    Sessions,
    DeadLetters,
    Tasks,
    Checkpoints,
    /// Cluster mode: in-flight attempt counts per subscription incarnation and
    /// partition (`meshd_stores::attempts`).
    Attempts,
    /// Cluster mode: the shared secret of the routes between instances.
    Secrets,
    /// Housekeeping meshd does on Meta itself (the last history compaction).
    Maintenance,
}

impl KeyKind {
    /// Every kind (the key catalog test checks each is documented).
    pub const ALL: [KeyKind; 11] = [
        KeyKind::Members,
        KeyKind::Owners,
        KeyKind::Topics,
        KeyKind::Subscriptions,
        KeyKind::Sessions,
        KeyKind::DeadLetters,
        KeyKind::Tasks,
        KeyKind::Checkpoints,
        KeyKind::Attempts,
        KeyKind::Secrets,
        KeyKind::Maintenance,
    ];

    pub fn segment(self) -> &'static str {
        match self {
            KeyKind::Members => "members",
            KeyKind::Owners => "owners",
            KeyKind::Topics => "topics",
            KeyKind::Subscriptions => "subscriptions",
            KeyKind::Sessions => "sessions",
            KeyKind::DeadLetters => "deadletters",
            KeyKind::Tasks => "tasks",
            KeyKind::Checkpoints => "checkpoints",
            KeyKind::Attempts => "attempts",
            KeyKind::Secrets => "secrets",
            KeyKind::Maintenance => "maintenance",
        }
    }
}

/// Builds a key of `kind` from components. `key(kind, &[])` is the prefix of all keys
/// of that kind (ends with `/`).
pub fn key(kind: KeyKind, components: &[&str]) -> Vec<u8> {
    let mut out = String::from(ROOT);
    out.push_str(kind.segment());
    out.push('/');
    for (i, c) in components.iter().enumerate() {
        if i > 0 {
            out.push('/');
        }
        escape_into(c, &mut out);
    }
    out.into_bytes()
}

/// The prefix of every key of `kind` whose first components are `components`
/// (always ends with `/`).
pub fn prefix(kind: KeyKind, components: &[&str]) -> Vec<u8> {
    let mut k = key(kind, components);
    if !components.is_empty() {
        k.push(b'/');
    }
    k
}

/// Escapes one component: `%`, `/` and bytes outside `0x21..=0x7e` become `%XX`.
pub fn escape(component: &str) -> String {
    let mut out = String::with_capacity(component.len());
    escape_into(component, &mut out);
    out
}

fn escape_into(component: &str, out: &mut String) {
    for b in component.bytes() {
        if b == b'%' || b == b'/' || !(0x21..=0x7e).contains(&b) {
            out.push_str(&format!("%{b:02X}"));
        } else {
            out.push(b as char);
        }
    }
}

/// Reverses [`escape`]; `None` for a malformed component.
pub fn unescape(component: &str) -> Option<String> {
    let bytes = component.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = component.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// Splits a key of `kind` back into its unescaped components.
pub fn components(kind: KeyKind, key: &[u8]) -> Option<Vec<String>> {
    let s = std::str::from_utf8(key).ok()?;
    let rest = s.strip_prefix(ROOT)?.strip_prefix(kind.segment())?;
    let rest = rest.strip_prefix('/')?;
    rest.split('/').map(unescape).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn separators_in_names_cannot_collide() {
        assert_ne!(
            key(KeyKind::Owners, &["a/b", "c"]),
            key(KeyKind::Owners, &["a", "b/c"])
        );
        assert_eq!(
            key(KeyKind::Owners, &["a/b"]),
            b"meshd/v1/owners/a%2Fb".to_vec()
        );
    }

    #[test]
    fn a_prefix_matches_only_keys_below_it() {
        let p = prefix(KeyKind::Owners, &["topic"]);
        assert!(key(KeyKind::Owners, &["topic", "1"]).starts_with(&p));
        assert!(!key(KeyKind::Owners, &["topic2", "1"]).starts_with(&p));
    }

    proptest! {
        #[test]
        fn escape_round_trips(parts in proptest::collection::vec(".*", 1..4)) {
            let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
            let k = key(KeyKind::Tasks, &refs);
            prop_assert_eq!(components(KeyKind::Tasks, &k), Some(parts.clone()));
        }

        #[test]
        fn distinct_component_lists_give_distinct_keys(
            a in proptest::collection::vec(".{0,4}", 1..3),
            b in proptest::collection::vec(".{0,4}", 1..3),
        ) {
            let ka = key(KeyKind::Tasks, &a.iter().map(String::as_str).collect::<Vec<_>>());
            let kb = key(KeyKind::Tasks, &b.iter().map(String::as_str).collect::<Vec<_>>());
            prop_assert_eq!(a == b, ka == kb);
        }
    }
}
