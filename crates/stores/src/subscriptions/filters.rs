//! # Subscription filters: the CloudEvents Subscriptions API dialects
//!
//! A subscription's `filters` is a list of expressions, all of which must match
//! (HTTP API, Additions, "Filters"):
//!
//! | expression | matches when |
//! |---|---|
//! | `{"exact": {"attr": "v", ...}}` | every listed attribute is present and equal to its value |
//! | `{"prefix": {"attr": "v", ...}}` | every listed attribute is present and starts with its value |
//! | `{"suffix": {"attr": "v", ...}}` | every listed attribute is present and ends with its value |
//! | `{"all": [f, ...]}` | every sub-expression matches |
//! | `{"any": [f, ...]}` | at least one sub-expression matches |
//! | `{"not": f}` | `f` does not match |
//!
//! Attribute names are CloudEvents context attributes and extensions; values are
//! compared case-sensitively on their string form (an extension's canonical string:
//! `42`, `true`). An absent attribute matches nothing (so `not` of it matches).
//!
//! Parsing validates everything and names the malformed expression by its path
//! (`filters[1].any[0]`); the JSON form written back ([`FilterExpr::to_json`]) is the
//! one accepted, so the record and the API share one codec. The whole list is bounded
//! ([`MAX_FILTER_NODES`], [`MAX_FILTER_DEPTH`], [`MAX_FILTER_VALUE_LEN`]) so a record
//! stays small in Meta and evaluation is cheap and cannot recurse without bound.
//!
//! **Bounds on a write, not on a read.** One `exact` could hold any number of pairs
//! (20 000 pairs took 1.6 s to filter one event with as many extensions, every event,
//! on the partition's task). A write ([`check_write_bounds`], run by the API with
//! paths and by the store on every put) takes at most [`MAX_EXPRESSION_PAIRS`] pairs
//! per top-level expression and [`MAX_FILTERS_BYTES`] of filters. Records written
//! before those bounds are still read ([`FilterExpr::parse_list`] does not apply
//! them): a stored subscription is never lost, and it filters as before (its cost is
//! bounded by the request size it came in with, and each pair is a lookup, below);
//! the next `PUT` of it must fit.
//!
//! Evaluation is pure: it takes a lookup from attribute name to string value, so the
//! delivery core evaluates it without I/O over the attributes the shell extracted (once
//! per event for all subscriptions of a topic: `meshd_runtime::runtime::attributes`),
//! held as an [`AttributeIndex`] so each pair is a binary search, not a scan of the
//! event's attributes.

use serde_json::{Map, Value};
use std::sync::Arc;

/// Which events a subscription receives: those whose CloudEvents `type` and/or
/// `source` equal these (an unset field matches everything). The shorthand `filter`
/// of a subscription, beside its `filters`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    /// The CloudEvents `type` (`"type"` on the wire and in the record).
    pub event_type: Option<String>,
    pub source: Option<String>,
}

/// The longest `type` or `source` of a [`Filter`], in bytes, so a record stays small
/// in Meta.
pub const MAX_FILTER_LEN: usize = 1024;
/// The most expressions (every node, leaves included) in one subscription's filters.
pub const MAX_FILTER_NODES: usize = 64;
/// The deepest nesting of `all`/`any`/`not` (a top-level expression is depth 1).
pub const MAX_FILTER_DEPTH: usize = 8;
/// The longest value compared, in bytes (as the shorthand `filter`).
pub const MAX_FILTER_VALUE_LEN: usize = MAX_FILTER_LEN;
/// The longest attribute name (CloudEvents asks for at most 20; some producers use more).
pub const MAX_ATTRIBUTE_NAME_LEN: usize = 64;
/// The most attribute pairs in one top-level expression of a write, the pairs of the
/// `all`/`any`/`not` inside it included (http-api.md, "Security rules (third round)").
pub const MAX_EXPRESSION_PAIRS: usize = 64;
/// The most bytes of a subscription's filters on a write: `filters` plus the shorthand
/// `filter`, each in the compact JSON form meshd stores and `GET` shows (the request's
/// whitespace and escapes do not count).
pub const MAX_FILTERS_BYTES: usize = 16 * 1024;

/// One filter expression.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FilterExpr {
    Exact(Vec<(String, String)>),
    Prefix(Vec<(String, String)>),
    Suffix(Vec<(String, String)>),
    All(Vec<FilterExpr>),
    Any(Vec<FilterExpr>),
    Not(Box<FilterExpr>),
}

/// A malformed expression: `path` names it (`filters[1].any[0]`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct FilterError {
    pub path: String,
    pub reason: String,
}

impl FilterExpr {
    /// Parses and validates a `filters` list (the JSON array of the API and the
    /// record). Errors name the malformed expression's path under `filters`.
    pub fn parse_list(value: &Value) -> Result<Vec<FilterExpr>, FilterError> {
        let Value::Array(items) = value else {
            return Err(FilterError {
                path: "filters".into(),
                reason: "must be an array of filter expressions".into(),
            });
        };
        let mut budget = MAX_FILTER_NODES;
        items
            .iter()
            .enumerate()
            .map(|(i, v)| Self::parse_at(v, &format!("filters[{i}]"), 1, &mut budget))
            .collect()
    }

    fn parse_at(
        value: &Value,
        path: &str,
        depth: usize,
        budget: &mut usize,
    ) -> Result<FilterExpr, FilterError> {
        let bad = |reason: String| FilterError {
            path: path.to_owned(),
            reason,
        };
        if depth > MAX_FILTER_DEPTH {
            return Err(bad(format!(
                "nested deeper than {MAX_FILTER_DEPTH} expressions"
            )));
        }
        if *budget == 0 {
            return Err(bad(format!(
                "the filters hold more than {MAX_FILTER_NODES} expressions"
            )));
        }
        *budget -= 1;
        let Value::Object(map) = value else {
            return Err(bad(
                "must be an object with one of exact, prefix, suffix, all, any, not".into(),
            ));
        };
        let mut entries = map.iter();
        let (dialect, arg) = match (entries.next(), entries.next()) {
            (Some(one), None) => one,
            _ => {
                return Err(bad(format!(
                    "must have exactly one dialect (exact, prefix, suffix, all, any, not), has {}",
                    map.len()
                )))
            }
        };
        match dialect.as_str() {
            "exact" => Ok(FilterExpr::Exact(attributes(arg, dialect).map_err(bad)?)),
            "prefix" => Ok(FilterExpr::Prefix(attributes(arg, dialect).map_err(bad)?)),
            "suffix" => Ok(FilterExpr::Suffix(attributes(arg, dialect).map_err(bad)?)),
            "all" | "any" => {
                let Value::Array(items) = arg else {
                    return Err(bad(format!(
                        "{dialect} must be a non-empty array of expressions"
                    )));
                };
                if items.is_empty() {
                    return Err(bad(format!(
                        "{dialect} must be a non-empty array of expressions"
                    )));
                }
                let subs = items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        Self::parse_at(v, &format!("{path}.{dialect}[{i}]"), depth + 1, budget)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(if dialect == "all" {
                    FilterExpr::All(subs)
                } else {
                    FilterExpr::Any(subs)
                })
            }
            "not" => Ok(FilterExpr::Not(Box::new(Self::parse_at(
                arg,
                &format!("{path}.not"),
                depth + 1,
                budget,
            )?))),
            other => Err(bad(format!(
                "unknown dialect {other:?} (exact, prefix, suffix, all, any, not)"
            ))),
        }
    }

    /// The JSON form (what [`FilterExpr::parse_list`] accepts).
    pub fn to_json(&self) -> Value {
        let pairs = |ps: &[(String, String)]| {
            Value::Object(
                ps.iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect::<Map<_, _>>(),
            )
        };
        let list = |fs: &[FilterExpr]| Value::Array(fs.iter().map(Self::to_json).collect());
        let (dialect, arg) = match self {
            FilterExpr::Exact(p) => ("exact", pairs(p)),
            FilterExpr::Prefix(p) => ("prefix", pairs(p)),
            FilterExpr::Suffix(p) => ("suffix", pairs(p)),
            FilterExpr::All(fs) => ("all", list(fs)),
            FilterExpr::Any(fs) => ("any", list(fs)),
            FilterExpr::Not(f) => ("not", f.to_json()),
        };
        let mut m = Map::new();
        m.insert(dialect.into(), arg);
        Value::Object(m)
    }

    /// The JSON array of a list.
    pub fn list_to_json(filters: &[FilterExpr]) -> Value {
        Value::Array(filters.iter().map(Self::to_json).collect())
    }

    /// Whether an event matches; `attr` gives an attribute's string form, `None` when
    /// the event does not have it.
    pub fn matches<'a>(&self, attr: &dyn Fn(&str) -> Option<&'a str>) -> bool {
        let each = |ps: &[(String, String)], test: fn(&str, &str) -> bool| {
            ps.iter()
                .all(|(name, want)| attr(name).is_some_and(|got| test(got, want)))
        };
        match self {
            FilterExpr::Exact(ps) => each(ps, |got, want| got == want),
            FilterExpr::Prefix(ps) => each(ps, |got, want| got.starts_with(want)),
            FilterExpr::Suffix(ps) => each(ps, |got, want| got.ends_with(want)),
            FilterExpr::All(fs) => fs.iter().all(|f| f.matches(attr)),
            FilterExpr::Any(fs) => fs.iter().any(|f| f.matches(attr)),
            FilterExpr::Not(f) => !f.matches(attr),
        }
    }
}

/// The bounds a subscription's filters must keep when written (not when a stored
/// record is read: see the module docs): at most [`MAX_EXPRESSION_PAIRS`] attribute
/// pairs per top-level expression, counting the pairs of every `all`/`any`/`not` inside
/// it, and at most [`MAX_FILTERS_BYTES`] for `filters` and the shorthand `filter`
/// together. A pair count over the bound names the expression where the count passes
/// it (`filters[1].any[0]`, in document order); a size over the bound names `filters`.
pub fn check_write_bounds(
    filter: Option<&Filter>,
    filters: &[FilterExpr],
) -> Result<(), FilterError> {
    for (i, f) in filters.iter().enumerate() {
        let top = format!("filters[{i}]");
        let mut pairs = 0usize;
        f.count_pairs(&top, &top, &mut pairs)?;
    }
    let shorthand = filter.map_or(0, |f| {
        let mut m = Map::new();
        if let Some(t) = &f.event_type {
            m.insert("type".into(), Value::String(t.clone()));
        }
        if let Some(s) = &f.source {
            m.insert("source".into(), Value::String(s.clone()));
        }
        Value::Object(m).to_string().len()
    });
    let listed = if filters.is_empty() {
        0
    } else {
        FilterExpr::list_to_json(filters).to_string().len()
    };
    let bytes = listed + shorthand;
    if bytes > MAX_FILTERS_BYTES {
        return Err(FilterError {
            path: "filters".into(),
            reason: format!(
                "the filters take {bytes} bytes of JSON (filter and filters, compact), at most {MAX_FILTERS_BYTES}"
            ),
        });
    }
    Ok(())
}

impl FilterExpr {
    /// Adds this expression's pairs to `pairs` (pre-order, as written), failing at the
    /// expression (`path`) where the count of the top-level expression `top` passes
    /// [`MAX_EXPRESSION_PAIRS`]. Recursion is bounded by [`MAX_FILTER_DEPTH`], which
    /// parsing enforces.
    fn count_pairs(&self, top: &str, path: &str, pairs: &mut usize) -> Result<(), FilterError> {
        let (dialect, subs): (&str, &[FilterExpr]) = match self {
            FilterExpr::Exact(ps) | FilterExpr::Prefix(ps) | FilterExpr::Suffix(ps) => {
                *pairs += ps.len();
                if *pairs > MAX_EXPRESSION_PAIRS {
                    return Err(FilterError {
                        path: path.to_owned(),
                        reason: format!(
                            "{top} holds more than {MAX_EXPRESSION_PAIRS} attribute pairs \
                             (the pairs inside all, any and not count); split it or narrow it"
                        ),
                    });
                }
                return Ok(());
            }
            FilterExpr::All(fs) => ("all", fs),
            FilterExpr::Any(fs) => ("any", fs),
            FilterExpr::Not(f) => return f.count_pairs(top, &format!("{path}.not"), pairs),
        };
        for (i, f) in subs.iter().enumerate() {
            f.count_pairs(top, &format!("{path}.{dialect}[{i}]"), pairs)?;
        }
        Ok(())
    }
}

/// An event's attributes by name, each in its string form: what filters look up.
///
/// Sorted by name once, when built (once per event for every subscription of a
/// topic), so each pair of a filter is a binary search: a filter no longer scans the
/// event's attributes for every pair (an event may carry thousands of extensions).
/// Names are unique in an event; should a list repeat one, the first wins, as a scan
/// would find it. Cloning shares the list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttributeIndex(Arc<[(String, String)]>);

impl AttributeIndex {
    pub fn new(mut pairs: Vec<(String, String)>) -> Self {
        // Stable: of equal names the first stays first, and `dedup_by` keeps it.
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        pairs.dedup_by(|later, earlier| later.0 == earlier.0);
        Self(pairs.into())
    }

    /// The string form of attribute `name`, `None` when the event lacks it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| k.as_str().cmp(name))
            .ok()
            .map(|i| self.0[i].1.as_str())
    }

    /// Every attribute, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether both are the same list (not only equal ones).
    pub fn ptr_eq(a: &Self, b: &Self) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl From<Vec<(String, String)>> for AttributeIndex {
    fn from(pairs: Vec<(String, String)>) -> Self {
        Self::new(pairs)
    }
}

impl FromIterator<(String, String)> for AttributeIndex {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        Self::new(iter.into_iter().collect())
    }
}

/// Which events a subscription receives: its shorthand `filter` (one `exact` over
/// `type` and `source`) and its `filters`, all of which must match. The empty selector
/// takes everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selector {
    exprs: Vec<FilterExpr>,
}

impl Selector {
    pub fn new(filter: Option<&Filter>, filters: &[FilterExpr]) -> Self {
        let shorthand = filter.map(|f| {
            let pairs = [("type", &f.event_type), ("source", &f.source)]
                .into_iter()
                .filter_map(|(k, v)| v.as_ref().map(|v| (k.to_owned(), v.clone())))
                .collect();
            FilterExpr::Exact(pairs)
        });
        let exprs = shorthand
            .into_iter()
            .chain(filters.iter().cloned())
            .collect();
        Self { exprs }
    }

    /// Whether it takes every event (no attribute needs to be looked at).
    pub fn takes_all(&self) -> bool {
        self.exprs.is_empty()
    }

    /// Whether an event with these attributes is delivered.
    pub fn matches<'a>(&self, attr: &dyn Fn(&str) -> Option<&'a str>) -> bool {
        self.exprs.iter().all(|f| f.matches(attr))
    }

    /// [`Selector::matches`] over an event's [`AttributeIndex`].
    pub fn matches_index(&self, attributes: &AttributeIndex) -> bool {
        self.matches(&|name| attributes.get(name))
    }
}

/// The `{"attr": "value", ...}` argument of `exact`, `prefix` and `suffix`.
fn attributes(arg: &Value, dialect: &str) -> Result<Vec<(String, String)>, String> {
    let Value::Object(map) = arg else {
        return Err(format!(
            "{dialect} must be an object of attribute names to string values"
        ));
    };
    if map.is_empty() {
        return Err(format!("{dialect} names no attribute"));
    }
    map.iter()
        .map(|(name, v)| {
            if name.is_empty()
                || name.len() > MAX_ATTRIBUTE_NAME_LEN
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            {
                return Err(format!(
                    "{dialect}.{name}: an attribute name is 1–{MAX_ATTRIBUTE_NAME_LEN} \
                     lower-case letters and digits"
                ));
            }
            if name == "data" || name == "data_base64" {
                return Err(format!(
                    "{dialect}.{name}: the event's data is not an attribute"
                ));
            }
            let Value::String(s) = v else {
                return Err(format!("{dialect}.{name} must be a string"));
            };
            if s.len() > MAX_FILTER_VALUE_LEN {
                return Err(format!(
                    "{dialect}.{name} is {} bytes, at most {MAX_FILTER_VALUE_LEN}",
                    s.len()
                ));
            }
            Ok((name.clone(), s.clone()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Vec<FilterExpr>, FilterError> {
        FilterExpr::parse_list(&v)
    }

    fn event<'a>(attrs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<&'a str> {
        move |name| attrs.iter().find(|(k, _)| *k == name).map(|(_, v)| *v)
    }

    fn all_match(filters: &[FilterExpr], attrs: &[(&str, &str)]) -> bool {
        let lookup = event(attrs);
        filters.iter().all(|f| f.matches(&lookup))
    }

    #[test]
    fn every_dialect_matches_as_the_contract_says() {
        let e = [
            ("type", "com.shop.order.created"),
            ("source", "/shop/eu"),
            ("tenant", "acme"),
            ("priority", "7"),
        ];
        let cases = [
            (json!([{"exact": {"type": "com.shop.order.created"}}]), true),
            (json!([{"exact": {"type": "com.shop.order"}}]), false),
            (
                json!([{"exact": {"type": "Com.shop.order.created"}}]),
                false,
            ),
            (
                json!([{"exact": {"type": "com.shop.order.created", "tenant": "acme"}}]),
                true,
            ),
            (
                json!([{"exact": {"type": "com.shop.order.created", "tenant": "other"}}]),
                false,
            ),
            (json!([{"prefix": {"type": "com.shop."}}]), true),
            (json!([{"prefix": {"type": "com.bank."}}]), false),
            (json!([{"suffix": {"source": "/eu"}}]), true),
            (json!([{"suffix": {"source": "/us"}}]), false),
            (json!([{"exact": {"priority": "7"}}]), true),
            // An absent attribute matches nothing, and `not` of it matches.
            (json!([{"exact": {"region": "eu"}}]), false),
            (json!([{"prefix": {"region": ""}}]), false),
            (json!([{"not": {"exact": {"region": "eu"}}}]), true),
            (
                json!([{"any": [{"exact": {"tenant": "x"}}, {"suffix": {"source": "/eu"}}]}]),
                true,
            ),
            (
                json!([{"any": [{"exact": {"tenant": "x"}}, {"suffix": {"source": "/us"}}]}]),
                false,
            ),
            (
                json!([{"all": [{"exact": {"tenant": "acme"}}, {"prefix": {"source": "/shop"}}]}]),
                true,
            ),
            (
                json!([{"all": [{"exact": {"tenant": "acme"}}, {"prefix": {"source": "/bank"}}]}]),
                false,
            ),
            // The list is an implicit `all`.
            (
                json!([{"prefix": {"type": "com.shop."}}, {"not": {"exact": {"tenant": "acme"}}}]),
                false,
            ),
            (json!([]), true),
        ];
        for (filters, want) in cases {
            let parsed = parse(filters.clone()).unwrap();
            assert_eq!(all_match(&parsed, &e), want, "{filters}");
        }
    }

    #[test]
    fn malformed_expressions_are_named_by_their_path() {
        let cases = [
            (json!({"exact": {}}), "filters"),
            (json!([{"exact": {}}]), "filters[0]"),
            (
                json!([{"exact": {"type": "a"}}, {"any": [{"bogus": {}}]}]),
                "filters[1].any[0]",
            ),
            (json!([{"exact": {"type": 5}}]), "filters[0]"),
            (json!([{"exact": {"Type": "a"}}]), "filters[0]"),
            (json!([{"exact": {"data": "a"}}]), "filters[0]"),
            (
                json!([{"exact": {"type": "a"}, "prefix": {"type": "a"}}]),
                "filters[0]",
            ),
            (json!([{}]), "filters[0]"),
            (json!(["type"]), "filters[0]"),
            (json!([{"all": []}]), "filters[0]"),
            (json!([{"any": {"exact": {"type": "a"}}}]), "filters[0]"),
            (
                json!([{"not": [{"exact": {"type": "a"}}]}]),
                "filters[0].not",
            ),
            (
                json!([{"not": {"all": [{"exact": {"type": "a"}}, {"not": 3}]}}]),
                "filters[0].not.all[1].not",
            ),
            (
                json!([{"prefix": {"type": "x".repeat(MAX_FILTER_VALUE_LEN + 1)}}]),
                "filters[0]",
            ),
        ];
        for (filters, path) in cases {
            let e = parse(filters.clone()).unwrap_err();
            assert_eq!(e.path, path, "{filters}: {e}");
        }
    }

    #[test]
    fn size_and_depth_are_bounded() {
        let mut deep = json!({"exact": {"type": "a"}});
        for _ in 0..MAX_FILTER_DEPTH {
            deep = json!({"not": deep});
        }
        let e = parse(json!([deep])).unwrap_err();
        assert!(e.reason.contains("deeper"), "{e}");
        let wide: Vec<Value> = (0..=MAX_FILTER_NODES)
            .map(|_| json!({"exact": {"type": "a"}}))
            .collect();
        let e = parse(Value::Array(wide)).unwrap_err();
        assert_eq!(e.path, format!("filters[{MAX_FILTER_NODES}]"));
        // Exactly at the bounds is fine.
        let mut deep = json!({"exact": {"type": "a"}});
        for _ in 1..MAX_FILTER_DEPTH {
            deep = json!({"not": deep});
        }
        parse(json!([deep])).unwrap();
    }

    /// `n` distinct pairs `{"a0": "v", "a1": "v", ...}`.
    fn pairs(n: usize) -> Value {
        Value::Object((0..n).map(|i| (format!("a{i}"), json!("v"))).collect())
    }

    fn bounds(filters: Value) -> Result<(), FilterError> {
        check_write_bounds(None, &parse(filters).unwrap())
    }

    #[test]
    fn an_expression_holds_at_most_64_pairs_counting_those_nested_inside_it() {
        bounds(json!([{"exact": pairs(MAX_EXPRESSION_PAIRS)}])).unwrap();
        let e = bounds(json!([{"exact": pairs(MAX_EXPRESSION_PAIRS + 1)}])).unwrap_err();
        assert_eq!(e.path, "filters[0]");
        assert!(e.reason.contains("64 attribute pairs"), "{e}");
        // Nested: 40 + 24 is the bound, one more in a later branch passes it there.
        let nested = |last: usize| {
            json!([{"exact": {"type": "t"}}, {"all": [
                {"prefix": pairs(40)},
                {"any": [{"exact": {"x": "1"}}, {"not": {"suffix": pairs(last)}}]}
            ]}])
        };
        bounds(nested(23)).unwrap();
        let e = bounds(nested(24)).unwrap_err();
        assert_eq!(e.path, "filters[1].all[1].any[1].not");
        assert!(e.reason.starts_with("filters[1] holds"), "{e}");
        // Each top-level expression has its own 64.
        bounds(json!([{"exact": pairs(64)}, {"exact": pairs(64)}])).unwrap();
    }

    #[test]
    fn the_filters_take_at_most_16_kib_with_the_shorthand_counted() {
        // 17 expressions of one pair each, whose values make the compact list exactly
        // `len` bytes (each value at most MAX_FILTER_VALUE_LEN).
        let sized = |len: usize| {
            const N: usize = 17;
            let empty = |n: usize| {
                Value::Array(vec![json!({"exact": {"a": ""}}); n])
                    .to_string()
                    .len()
            };
            let mut left = len - empty(N);
            let list: Vec<Value> = (0..N)
                .map(|i| {
                    let take = left.div_ceil(N - i);
                    left -= take;
                    json!({"exact": {"a": "x".repeat(take)}})
                })
                .collect();
            let v = Value::Array(list);
            assert_eq!(v.to_string().len(), len);
            v
        };
        bounds(sized(MAX_FILTERS_BYTES)).unwrap();
        let e = bounds(sized(MAX_FILTERS_BYTES + 1)).unwrap_err();
        assert_eq!(e.path, "filters");
        assert!(
            e.reason.contains(&format!("{}", MAX_FILTERS_BYTES + 1)),
            "{e}"
        );
        // The shorthand counts too: `{"type":"t"}` is 12 bytes.
        let list = parse(sized(MAX_FILTERS_BYTES - 12)).unwrap();
        let t = super::super::Filter {
            event_type: Some("t".into()),
            source: None,
        };
        check_write_bounds(Some(&t), &list).unwrap();
        let list = parse(sized(MAX_FILTERS_BYTES - 11)).unwrap();
        assert_eq!(
            check_write_bounds(Some(&t), &list).unwrap_err().path,
            "filters"
        );
    }

    #[test]
    fn a_stored_list_past_the_write_bounds_still_parses_and_matches() {
        // Written before the bounds: read back as it was (never lost), evaluated by
        // lookups.
        let mut big = pairs(MAX_EXPRESSION_PAIRS * 4);
        big["type"] = json!("t");
        let stored = json!([{"exact": big}]);
        let parsed = parse(stored).unwrap();
        assert!(check_write_bounds(None, &parsed).is_err());
        let mut attrs: Vec<(String, String)> = (0..MAX_EXPRESSION_PAIRS * 4)
            .map(|i| (format!("a{i}"), "v".to_string()))
            .collect();
        attrs.push(("type".into(), "t".into()));
        let index = AttributeIndex::new(attrs.clone());
        assert!(Selector::new(None, &parsed).matches_index(&index));
        attrs[7].1 = "w".into();
        assert!(!Selector::new(None, &parsed).matches_index(&AttributeIndex::new(attrs)));
    }

    #[test]
    fn the_attribute_index_finds_what_a_scan_finds() {
        let list = vec![
            ("type".to_string(), "t".to_string()),
            ("a".to_string(), "1".to_string()),
            ("zz".to_string(), "last".to_string()),
            ("a".to_string(), "second a".to_string()),
            ("".to_string(), "empty name".to_string()),
        ];
        let scan = |name: &str| {
            list.iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        let index = AttributeIndex::from(list.clone());
        for name in ["type", "a", "zz", "", "b", "typ", "types", "A"] {
            assert_eq!(index.get(name), scan(name), "{name:?}");
        }
        assert_eq!(
            index.len(),
            4,
            "a repeated name is kept once (its first value)"
        );
        assert!(AttributeIndex::default().get("type").is_none());
        let again = index.clone();
        assert!(AttributeIndex::ptr_eq(&index, &again));
    }

    #[test]
    fn the_json_form_round_trips_and_names_every_attribute() {
        let text = json!([
            {"exact": {"type": "t", "tenant": "acme"}},
            {"any": [{"prefix": {"source": "/a"}}, {"not": {"suffix": {"subject": ".tmp"}}}]},
            {"all": [{"exact": {"priority": "1"}}]}
        ]);
        let parsed = parse(text.clone()).unwrap();
        assert_eq!(FilterExpr::list_to_json(&parsed), text);
    }
}
