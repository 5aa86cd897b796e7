//! Subscription filters.

use serde::{Deserialize, Serialize};

use crate::event::Event;

/// A subscription's `filter` (`{"type": "...", "source": "..."}`): an event matches when
/// every set attribute is exactly equal (case-sensitive, no patterns). The empty filter
/// matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Filter {
    /// Matches the event's `type` attribute.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

impl Filter {
    pub fn matches(&self, event: &Event) -> bool {
        self.event_type
            .as_deref()
            .is_none_or(|t| t == event.event_type())
            && self.source.as_deref().is_none_or(|s| s == event.source())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(event_type: &str, source: &str) -> Event {
        let body = format!(
            r#"{{"specversion":"1.0","id":"1","source":"{source}","type":"{event_type}"}}"#
        );
        crate::parse_publish(
            Some(crate::STRUCTURED_CONTENT_TYPE),
            &[],
            body.as_bytes(),
            &crate::Limits::default(),
        )
        .unwrap()
        .remove(0)
    }

    #[test]
    fn filters_match_exactly() {
        let e = event("order.created", "/shop");
        let f = |t: Option<&str>, s: Option<&str>| Filter {
            event_type: t.map(str::to_owned),
            source: s.map(str::to_owned),
        };
        assert!(Filter::default().matches(&e));
        assert!(f(Some("order.created"), None).matches(&e));
        assert!(f(None, Some("/shop")).matches(&e));
        assert!(f(Some("order.created"), Some("/shop")).matches(&e));
        assert!(!f(Some("order.created"), Some("/other")).matches(&e));
        assert!(!f(Some("order"), None).matches(&e));
        assert!(!f(Some("Order.Created"), None).matches(&e));
        assert!(!f(None, Some("/shop/")).matches(&e));
    }

    #[test]
    fn filter_json_uses_the_api_names() {
        let f: Filter = serde_json::from_str(r#"{"type":"t","source":"/s"}"#).unwrap();
        assert_eq!(f.event_type.as_deref(), Some("t"));
        assert_eq!(f.source.as_deref(), Some("/s"));
        let f: Filter = serde_json::from_str(r#"{"type":"t"}"#).unwrap();
        assert_eq!(serde_json::to_string(&f).unwrap(), r#"{"type":"t"}"#);
    }
}
