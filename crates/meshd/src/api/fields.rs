//! Reading JSON request bodies field by field, so every wrong value gets a 400 that
//! names its field (serde's messages for a wrong type or a negative number do not).

use super::{body_problem, json_body, require_json_content_type};
use crate::problem::Problem;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::HeaderMap;
use serde_json::{Map, Value};
use std::ops::RangeInclusive;

/// A JSON object body with only the allowed fields. An empty body is `{}` (every field
/// of the routes that use this is optional or checked by name).
pub struct Fields(Map<String, Value>);

impl Fields {
    pub fn parse(
        headers: &HeaderMap,
        body: Result<Bytes, BytesRejection>,
        allowed: &[&str],
    ) -> Result<Self, Problem> {
        let body = body.map_err(body_problem)?;
        require_json_content_type(headers)?;
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self(Map::new()));
        }
        let Value::Object(map) = json_body::<Value>(headers, Ok(body))? else {
            return Err(Problem::bad_request("the body must be a JSON object"));
        };
        if let Some(unknown) = map.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(Problem::invalid_field(
                unknown,
                format!("unknown field {unknown:?}; expected one of {allowed:?}"),
            ));
        }
        Ok(Self(map))
    }

    /// Takes a field's raw JSON value out (`None` when absent).
    pub fn take(&mut self, name: &str) -> Option<Value> {
        self.0.remove(name)
    }

    fn present(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    /// An integer field within `range`, `None` when absent or null.
    pub fn u64_in(&self, name: &str, range: RangeInclusive<u64>) -> Result<Option<u64>, Problem> {
        let Some(v) = self.present(name) else {
            return Ok(None);
        };
        v.as_u64()
            .filter(|n| range.contains(n))
            .map(Some)
            .ok_or_else(|| {
                Problem::invalid_field(
                    name,
                    format!(
                        "{name} must be an integer from {} to {}, got {v}",
                        range.start(),
                        range.end()
                    ),
                )
            })
    }

    /// A string field of at most `max_len` bytes, `None` when absent or null.
    pub fn str(&self, name: &str, max_len: usize) -> Result<Option<&str>, Problem> {
        match self.present(name) {
            None => Ok(None),
            Some(Value::String(s)) if s.len() <= max_len => Ok(Some(s)),
            Some(Value::String(_)) => Err(Problem::invalid_field(
                name,
                format!("{name} is longer than {max_len} bytes"),
            )),
            Some(v) => Err(Problem::invalid_field(
                name,
                format!("{name} must be a string, got {v}"),
            )),
        }
    }

    /// A boolean field, `None` when absent or null.
    pub fn bool(&self, name: &str) -> Result<Option<bool>, Problem> {
        match self.present(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Problem::invalid_field(
                name,
                format!("{name} must be true or false, got {v}"),
            )),
        }
    }

    /// [`Fields::str`], owned.
    pub fn string(&self, name: &str, max_len: usize) -> Result<Option<String>, Problem> {
        Ok(self.str(name, max_len)?.map(str::to_string))
    }

    /// A list of at most `max` strings of at most `max_len` bytes each.
    pub fn string_list(
        &self,
        name: &str,
        max: usize,
        max_len: usize,
    ) -> Result<Option<Vec<String>>, Problem> {
        let bad = |detail: String| Problem::invalid_field(name, detail);
        match self.present(name) {
            None => Ok(None),
            Some(Value::Array(items)) => {
                if items.len() > max {
                    return Err(bad(format!(
                        "{name} has {} entries; at most {max}",
                        items.len()
                    )));
                }
                items
                    .iter()
                    .map(|v| match v {
                        Value::String(s) if !s.is_empty() && s.len() <= max_len => Ok(s.clone()),
                        other => Err(bad(format!(
                            "{name} entries must be non-empty strings of at most {max_len} bytes, got {other}"
                        ))),
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(Some)
            }
            Some(v) => Err(bad(format!("{name} must be a list of strings, got {v}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str, allowed: &[&str]) -> Result<Fields, Problem> {
        Fields::parse(
            &HeaderMap::new(),
            Ok(Bytes::from(body.to_string())),
            allowed,
        )
    }

    #[test]
    fn empty_body_is_an_empty_object() {
        let f = parse("", &["a"]).expect("empty is {}");
        assert_eq!(f.u64_in("a", 0..=5).expect("absent"), None);
    }

    #[test]
    fn wrong_values_name_their_field() {
        let f = parse(r#"{"max_events": -1, "ids": [1]}"#, &["max_events", "ids"]).expect("object");
        let e = f.u64_in("max_events", 1..=1000).expect_err("negative");
        assert_eq!(e.extra.get("field"), Some(&Value::from("max_events")));
        let e = f.string_list("ids", 10, 10).expect_err("not strings");
        assert_eq!(e.extra.get("field"), Some(&Value::from("ids")));
        let e = parse(r#"{"nope": 1}"#, &["a"])
            .err()
            .expect("unknown field");
        assert_eq!(e.extra.get("field"), Some(&Value::from("nope")));
        assert!(parse("[1]", &["a"]).is_err());
    }

    #[test]
    fn ranges_are_inclusive() {
        let f = parse(r#"{"w": 30000}"#, &["w"]).expect("object");
        assert_eq!(f.u64_in("w", 0..=30000).expect("in range"), Some(30000));
        let f = parse(r#"{"w": 30001}"#, &["w"]).expect("object");
        assert!(f.u64_in("w", 0..=30000).is_err());
    }
}
