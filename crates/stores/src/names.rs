//! The one name rule: topics, subscriptions, client ids, agents, task ids and instance
//! ids are 1–249 characters of `[A-Za-z0-9._-]` (they become Meta key components and
//! JetStream stream names; 249 is Kafka's topic limit, kept for familiarity).

/// The longest name.
pub const MAX_NAME_LEN: usize = 249;

/// Whether `name` follows the rule.
pub fn is_valid_name(name: &str) -> bool {
    validate_name(name).is_ok()
}

/// `Ok` when `name` follows the rule; otherwise what is wrong with it.
pub fn validate_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!(
            "is {} characters long; at most {MAX_NAME_LEN} are allowed",
            name.len()
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "contains {c:?}; only A-Z, a-z, 0-9, '.', '_' and '-' are allowed"
        ));
    }
    Ok(())
}

/// `Err` (the reason, naming `what`) unless `name` follows the rule.
pub fn check_name_reason(what: &str, name: &str) -> Result<(), String> {
    validate_name(name).map_err(|e| format!("{what} {name:?} {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule() {
        for ok in ["a", "Agent-1.x_y", &"a".repeat(MAX_NAME_LEN)] {
            assert!(is_valid_name(ok), "{ok:?}");
        }
        for (bad, why) in [
            ("", "empty"),
            (&"a".repeat(MAX_NAME_LEN + 1) as &str, "at most 249"),
            ("a/b", "'/'"),
            ("a b", "' '"),
            ("é", "'é'"),
        ] {
            let e = validate_name(bad).unwrap_err();
            assert!(e.contains(why), "{bad:?}: {e}");
            assert!(!is_valid_name(bad));
        }
        assert_eq!(
            check_name_reason("agent", "a/b").unwrap_err(),
            "agent \"a/b\" contains '/'; only A-Z, a-z, 0-9, '.', '_' and '-' are allowed"
        );
    }
}
