//! What a subscription is: its settings with their defaults, ranges and checks, and
//! the subscription as stored. The store and the subscription record (`record`)
//! both use them, so they live here, below both.

use super::error::SubscriptionError;
use super::filters::{Filter, FilterExpr, Selector, MAX_FILTER_LEN};
use super::push::{Push, REDACTED};
use crate::names::validate_name;

/// `max_attempts` when the request does not say (HTTP API).
pub const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// `ack_timeout_ms` when the request does not say.
pub const DEFAULT_ACK_TIMEOUT_MS: u64 = 30_000;
/// `backoff.initial_ms` when the request does not say.
pub const DEFAULT_BACKOFF_INITIAL_MS: u64 = 1_000;
/// `backoff.max_ms` when the request does not say.
pub const DEFAULT_BACKOFF_MAX_MS: u64 = 60_000;

/// Documented ranges (HTTP API "Conventions").
pub const MAX_ATTEMPTS_RANGE: std::ops::RangeInclusive<u32> = 1..=1000;
pub const ACK_TIMEOUT_MS_RANGE: std::ops::RangeInclusive<u64> = 100..=600_000;
pub const BACKOFF_MAX_MS: u64 = 3_600_000;
/// The longest push URL, so a record stays small in Meta.
pub const MAX_PUSH_URL_LEN: usize = 2048;

/// Retry backoff of a subscription's deliveries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub initial_ms: u64,
    pub max_ms: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial_ms: DEFAULT_BACKOFF_INITIAL_MS,
            max_ms: DEFAULT_BACKOFF_MAX_MS,
        }
    }
}

/// Where a new subscription (incarnation) starts reading each partition.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StartPosition {
    /// At the end of each partition (the default).
    #[default]
    Latest,
    /// At the beginning of each partition.
    Earliest,
}

/// Delivery order among the events of one `partitionkey` (http-api.md, Additions,
/// "Parking").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Ordering {
    /// No order is kept beyond the partition's (the default).
    #[default]
    None,
    /// At most one event of a key in flight, waiting or being dead-lettered; the next
    /// one goes only after it is acked or dead-lettered.
    Key,
}

impl Ordering {
    pub fn as_str(self) -> &'static str {
        match self {
            Ordering::None => "none",
            Ordering::Key => "key",
        }
    }

    /// `"none"` or `"key"`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "none" => Some(Ordering::None),
            "key" => Some(Ordering::Key),
            _ => None,
        }
    }
}

/// What a client asks for: the settings of one subscription.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscriptionSpec {
    pub name: String,
    /// The topic; cannot change once the subscription exists.
    pub topic: String,
    /// Deliveries before an event is dead-lettered (1–1000).
    pub max_attempts: u32,
    /// How long a handed-out event waits for its ack (100–600000 ms).
    pub ack_timeout_ms: u64,
    /// Retry backoff (1 ≤ initial_ms ≤ max_ms ≤ 3600000).
    pub backoff: Backoff,
    pub filter: Option<Filter>,
    /// The CloudEvents Subscriptions API filters (all must match; empty: none).
    pub filters: Vec<FilterExpr>,
    pub push: Option<Push>,
    /// Applies when an incarnation's offsets are first created; stored as given.
    pub start: StartPosition,
    pub ordering: Ordering,
}

impl SubscriptionSpec {
    /// A spec with the documented defaults.
    pub fn new(name: impl Into<String>, topic: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            topic: topic.into(),
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            ack_timeout_ms: DEFAULT_ACK_TIMEOUT_MS,
            backoff: Backoff::default(),
            filter: None,
            filters: Vec::new(),
            push: None,
            start: StartPosition::Latest,
            ordering: Ordering::None,
        }
    }

    /// A copy whose push credentials that keep stored values ([`REDACTED`], or
    /// omitted) are replaced by valid placeholders: what can be checked before the
    /// stored record is read.
    pub(super) fn with_redacted_as_placeholders(&self) -> SubscriptionSpec {
        let mut s = self.clone();
        if let Some(p) = &mut s.push {
            if let Some(list) = &mut p.secrets {
                list.retain(|v| v != REDACTED);
            }
            if let Some(list) = &mut p.headers {
                for (_, v) in list.iter_mut().filter(|(_, v)| v == REDACTED) {
                    v.clear();
                }
            }
        }
        s
    }

    /// Checks every value against its documented range; the error names the field.
    pub fn validate(&self) -> Result<(), SubscriptionError> {
        let invalid =
            |field: &'static str, reason: String| Err(SubscriptionError::Invalid { field, reason });
        if let Err(e) = validate_name(&self.name) {
            return invalid("name", e);
        }
        if let Err(e) = validate_name(&self.topic) {
            return invalid("topic", e);
        }
        if !MAX_ATTEMPTS_RANGE.contains(&self.max_attempts) {
            return invalid(
                "max_attempts",
                format!("{} is outside 1–1000", self.max_attempts),
            );
        }
        if !ACK_TIMEOUT_MS_RANGE.contains(&self.ack_timeout_ms) {
            return invalid(
                "ack_timeout_ms",
                format!("{} is outside 100–600000", self.ack_timeout_ms),
            );
        }
        let b = self.backoff;
        if b.initial_ms < 1 {
            return invalid("backoff.initial_ms", "must be at least 1".into());
        }
        if b.initial_ms > b.max_ms {
            return invalid(
                "backoff.initial_ms",
                format!("{} is above backoff.max_ms {}", b.initial_ms, b.max_ms),
            );
        }
        if b.max_ms > BACKOFF_MAX_MS {
            return invalid(
                "backoff.max_ms",
                format!("{} is above {BACKOFF_MAX_MS}", b.max_ms),
            );
        }
        if let Some(f) = &self.filter {
            if f.event_type.is_none() && f.source.is_none() {
                return invalid("filter", "names neither type nor source".into());
            }
            for (field, value) in [("filter.type", &f.event_type), ("filter.source", &f.source)] {
                if let Some(v) = value {
                    if v.is_empty() || v.len() > MAX_FILTER_LEN {
                        return invalid(
                            field,
                            format!("must be 1–{MAX_FILTER_LEN} bytes, is {}", v.len()),
                        );
                    }
                }
            }
        }
        if !self.filters.is_empty() {
            // One validation for every way in: the JSON form is what is parsed.
            if let Err(e) = FilterExpr::parse_list(&FilterExpr::list_to_json(&self.filters)) {
                return invalid("filters", e.to_string());
            }
        }
        if let Some(p) = &self.push {
            let scheme_ok = p.url.starts_with("http://") || p.url.starts_with("https://");
            if !scheme_ok
                || p.url.len() > MAX_PUSH_URL_LEN
                || p.url.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                return invalid(
                    "push.url",
                    format!(
                        "must be an http:// or https:// URL of at most {MAX_PUSH_URL_LEN} bytes \
                         without spaces"
                    ),
                );
            }
            p.validate()?;
        }
        Ok(())
    }
}

impl Selector {
    /// The selector of a subscription's settings.
    pub fn of(spec: &SubscriptionSpec) -> Self {
        Self::new(spec.filter.as_ref(), &spec.filters)
    }
}

/// A stored subscription.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subscription {
    pub spec: SubscriptionSpec,
    /// The key's `mod_revision`: the `ETag`, store-issued, never reused.
    pub revision: i64,
    /// The key's `create_revision`: offsets and deliveries are keyed by it, so a
    /// re-created subscription starts afresh.
    pub incarnation: i64,
}

impl Subscription {
    pub fn name(&self) -> &str {
        &self.spec.name
    }
}
