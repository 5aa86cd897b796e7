//! # CloudEvents 1.0 for meshd: publish, store, partition, attributes, push
//!
//! Pure functions and values, no I/O: the HTTP layer hands [`parse_publish`] a request's
//! content type, headers and body and gets validated [`Event`]s or an [`EventError`]
//! that maps 1:1 to a problem+json answer (400 naming the field, 413, 415).
//!
//! ## Exactly as published
//!
//! http-api.md promises that delivered events are returned exactly as published. So an
//! [`Event`] *is* its stored form: for structured and batch mode the published object's
//! own text (captured with `serde_json::value::RawValue`, never re-serialized, so key
//! order, number formatting like `1.50` or `1e3`, and unknown extensions survive); for
//! binary mode a canonical structured object built from the `ce-*` headers and the
//! body. [`Event::stored`] is what goes into the log; [`Event::from_stored`] reads it
//! back (a corrupt record is an error, never a panic); [`Event::to_raw_json`] embeds it
//! in an answer unchanged.
//!
//! ## Validation
//!
//! * `specversion` is "1.0"; `id`, `source` and `type` are non-empty strings.
//! * Attribute names are lower-case `a-z0-9` (`data` and `data_base64` are members, not
//!   attributes). A member may appear only once.
//! * A `null` attribute is the same as an absent one (JSON format 2.2); `"data": null`
//!   is an explicit null payload.
//! * `subject`, `dataschema`, `datacontenttype` are non-empty strings when present
//!   (the spec's constraint); `datacontenttype` must look like a media type so it can
//!   always become a `Content-Type` header; `time` is an RFC 3339 timestamp.
//! * String attributes contain no control characters (U+0000-U+001F, U+007F-U+009F).
//! * Extensions are strings, integers in the 32-bit range, or booleans; `partitionkey`
//!   is a non-empty string.
//! * `data` and `data_base64` are mutually exclusive; `data_base64` is valid base64.
//! * One event's stored form is at most [`Limits::max_event_bytes`]; a batch holds
//!   1..=[`Limits::max_batch`] events.
//! * An event nests at most [`MAX_JSON_DEPTH`] (64) levels, the event object being
//!   level 1 (so `data` may nest 63); a batch's own array does not count, and a
//!   binary-mode event is measured on its structured form (the body as `data`): see
//!   [`depth`]. A 400 names the member (`data`, `events[3].data`).
//!
//! ## Partitions and delivery
//!
//! [`partition_for`] hashes `partitionkey` (else `id`) with a hash pinned forever;
//! [`Event::attribute`] reads an attribute by name in its string form (what subscription
//! filters compare); [`to_binary_mode`] renders an event
//! for push delivery in HTTP binary mode, the inverse of a binary-mode publish.

mod binary;
pub mod depth;
mod error;
mod event;
mod partition;
mod publish;
mod rfc3339;

pub use binary::to_binary_mode;
pub use depth::{nested_deeper_than, TooDeep, MAX_JSON_DEPTH};
pub use error::EventError;
pub use event::{
    deliver_at_of, may_deliver_later, Event, EventData, ExtensionValue, DELIVER_AT, SPEC_VERSION,
};
pub use partition::{fnv1a64, partition_for, partition_for_key};
pub use publish::{
    parse_publish, Limits, BATCH_CONTENT_TYPE, DEFAULT_MAX_BATCH, DEFAULT_MAX_EVENT_BYTES,
    MAX_DELIVER_AHEAD_MS, STRUCTURED_CONTENT_TYPE,
};

/// `serde_json`'s raw JSON value, as returned by [`Event::to_raw_json`].
pub use serde_json::value::RawValue;
