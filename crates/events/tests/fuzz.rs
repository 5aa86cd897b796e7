//! Fuzzing the CloudEvents parser beyond tests/props.rs.
//!
//! props.rs feeds `parse_publish` values a serde `Value` can hold. A client can send
//! more: duplicate members, escaped member names (`"i\u0064"` is `id`), lone
//! surrogates, numbers at the 32-bit edge written every way JSON allows, near-valid
//! timestamps, media types and base64, deep nesting, batches of all of these, and
//! binary-mode headers with any name, case and percent-encoding. Whatever arrives, the
//! answer is events or a 400/413/415, never a panic; every accepted event survives its
//! stored form, binary mode and every accessor; and a stored event damaged on disk is
//! a corrupt error or (when the damage is itself a valid event) reads back exactly.
//!
//! Case count: `MESHD_FUZZ_CASES` (default 2000, the CI pass); see docs/fuzzing.md.

use meshd_events::{
    parse_publish, partition_for, to_binary_mode, Event, EventData, Limits, BATCH_CONTENT_TYPE,
    STRUCTURED_CONTENT_TYPE,
};
use meshd_fuzz_cases::cases;
use proptest::prelude::*;

const ATTRIBUTES: &[&str] = &[
    "specversion",
    "id",
    "source",
    "type",
    "time",
    "subject",
    "dataschema",
    "datacontenttype",
    "data",
    "data_base64",
    "partitionkey",
    "ext1",
];

/// A member name as JSON text: plain, escaped, or odd.
fn member_name() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => prop::sample::select(ATTRIBUTES).prop_map(|a| format!("\"{a}\"")),
        1 => Just("\"i\\u0064\"".to_owned()),
        1 => Just("\"\\u0069d\"".to_owned()),
        1 => Just("\"ID\"".to_owned()),
        1 => Just("\"\"".to_owned()),
        1 => Just("\"\\ud800\"".to_owned()),
        1 => "[a-z0-9_]{1,6}".prop_map(|n| format!("\"{n}\"")),
    ]
}

/// A member value as JSON text, near and at the edges of what each attribute takes.
fn value_text() -> impl Strategy<Value = String> {
    let string = prop_oneof![
        Just("1.0".to_owned()),
        Just("e1".to_owned()),
        Just("/s".to_owned()),
        Just("application/json".to_owned()),
        Just("text/plain; charset=utf-8".to_owned()),
        Just("application/".to_owned()),
        Just("AA==".to_owned()),
        Just("AA=".to_owned()),
        Just("A===".to_owned()),
        "[A-Za-z0-9+/=]{0,9}",
        "[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]{1,9})?(Z|z|[+-][0-9]{2}:[0-9]{2})",
        "[0-9T:.Zz+-]{0,30}",
        ".{0,10}",
    ]
    .prop_map(|s| serde_json::to_string(&s).unwrap());
    let raw = prop::sample::select(vec![
        "null",
        "true",
        "false",
        "0",
        "-0",
        "2147483647",
        "2147483648",
        "-2147483648",
        "-2147483649",
        "1e3",
        "1.0",
        "1E400",
        "-1e-400",
        "18446744073709551616",
        "[]",
        "{}",
        "\"\"",
        "\"\\u0000\"",
        "\"\\u007f\"",
        "\"\\u0085\"",
        "\"\\ud800\"",
        "\"\\udc00\\ud800\"",
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
    ])
    .prop_map(str::to_owned);
    prop_oneof![3 => string, 2 => raw, 1 => any::<i64>().prop_map(|n| n.to_string())]
}

/// An event object as text, written member by member (duplicates possible), usually
/// starting from the four required attributes so validation goes deep.
fn event_text() -> impl Strategy<Value = String> {
    let base = prop_oneof![
        4 => Just(vec![
            ("\"specversion\"".to_owned(), "\"1.0\"".to_owned()),
            ("\"id\"".to_owned(), "\"e1\"".to_owned()),
            ("\"source\"".to_owned(), "\"/s\"".to_owned()),
            ("\"type\"".to_owned(), "\"t\"".to_owned()),
        ]),
        1 => Just(vec![]),
    ];
    let ws = prop::sample::select(vec!["", " ", "\n\t", "\u{feff}"]);
    (
        base,
        prop::collection::vec((member_name(), value_text()), 0..5),
        any::<prop::sample::Index>(),
        ws,
    )
        .prop_map(|(mut members, extra, at, ws)| {
            for m in extra {
                let i = at.index(members.len() + 1);
                members.insert(i, m);
            }
            let body: Vec<String> = members
                .iter()
                .map(|(k, v)| format!("{k}:{ws}{v}"))
                .collect();
            format!("{ws}{{{}}}{ws}", body.join(","))
        })
}

fn body() -> impl Strategy<Value = (Option<String>, Vec<u8>)> {
    prop_oneof![
        4 => event_text().prop_map(|e| (Some(STRUCTURED_CONTENT_TYPE.to_owned()), e.into_bytes())),
        3 => prop::collection::vec(prop_oneof![4 => event_text(), 1 => value_text()], 0..5)
            .prop_map(|v| (Some(BATCH_CONTENT_TYPE.to_owned()), format!("[{}]", v.join(",")).into_bytes())),
        1 => (event_text(), any::<prop::sample::Index>()).prop_map(|(e, at)| {
            let b = e.into_bytes();
            let cut = at.index(b.len() + 1);
            (Some(STRUCTURED_CONTENT_TYPE.to_owned()), b[..cut].to_vec())
        }),
        1 => prop::collection::vec(any::<u8>(), 0..64)
            .prop_map(|b| (Some(format!("{STRUCTURED_CONTENT_TYPE}; charset=latin1")), b)),
    ]
}

fn limits() -> impl Strategy<Value = Limits> {
    prop_oneof![
        4 => Just(Limits::default()),
        1 => (0usize..6, 0usize..400).prop_map(|(max_batch, max_event_bytes)| Limits { max_batch, max_event_bytes, now_ms: None }),
    ]
}

/// Binary-mode header names in any case, including names that only look like `ce-`.
fn header_name() -> impl Strategy<Value = String> {
    let attr = prop::sample::select(vec![
        "specversion",
        "id",
        "source",
        "type",
        "time",
        "subject",
        "dataschema",
        "datacontenttype",
        "partitionkey",
        "data",
        "data_base64",
        "ext",
        "",
        "Bad_Name",
        "é",
    ]);
    (
        attr,
        prop::sample::select(vec!["ce-", "CE-", "Ce-", "ce_", "x-ce-", "content-type"]),
    )
        .prop_map(|(a, p)| format!("{p}{a}"))
}

/// Header values: percent-encoding (valid, cut, of invalid UTF-8), quotes, controls.
fn header_value() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
            "1.0",
            "e1",
            "/s",
            "t",
            "%",
            "%2",
            "%zz",
            "%ff%fe",
            "%e2%82%ac",
            "%00",
            "\"q\"",
            "2020-01-01T00:00:00Z",
            "12",
            "true",
            "-2147483649",
            "",
        ])
        .prop_map(str::to_owned),
        "(%[0-9A-Fa-f]{2}|[a-z0-9 \"%\\\\\u{7f}\u{0}]){0,10}",
        ".{0,10}",
    ]
}

fn binary_request() -> impl Strategy<Value = (Option<String>, Vec<(String, String)>, Vec<u8>)> {
    let required = vec![
        ("ce-specversion".to_owned(), "1.0".to_owned()),
        ("ce-id".to_owned(), "e1".to_owned()),
        ("ce-source".to_owned(), "/s".to_owned()),
        ("ce-type".to_owned(), "t".to_owned()),
    ];
    let content_type = prop_oneof![
        Just(None),
        prop::sample::select(vec![
            "application/json",
            "text/plain",
            "application/octet-stream",
            "application/",
            "APPLICATION/JSON; charset=utf-8",
            "application/cloudevents",
            "x",
            "",
        ])
        .prop_map(|s| Some(s.to_owned())),
        ".{0,16}".prop_map(Some),
    ];
    let body = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..48),
        value_text().prop_map(String::into_bytes),
        event_text().prop_map(String::into_bytes),
    ];
    (
        any::<bool>(),
        prop::collection::vec((header_name(), header_value()), 0..6),
        content_type,
        body,
    )
        .prop_map(move |(with_required, extra, ct, body)| {
            let mut headers = if with_required {
                required.clone()
            } else {
                Vec::new()
            };
            headers.extend(extra);
            (ct, headers, body)
        })
}

/// Everything a consumer of an accepted event may call.
fn exercise(e: &Event, limits: &Limits) -> Result<(), TestCaseError> {
    prop_assert!(e.stored().len() <= limits.max_event_bytes);
    let back = Event::from_stored(e.stored());
    prop_assert!(back.is_ok(), "{:?}", back.err());
    let back = back.unwrap();
    prop_assert_eq!(back.stored(), e.stored());
    prop_assert_eq!(e.to_raw_json().get().as_bytes(), e.stored());
    prop_assert!(!e.id().is_empty() && !e.source().is_empty() && !e.event_type().is_empty());
    prop_assert_eq!(e.spec_version(), "1.0");
    let _ = (
        e.partition_key(),
        e.data_content_type(),
        e.data_schema(),
        e.subject(),
        e.time(),
    );
    let _ = e.extensions();
    match e.data() {
        // JSON text without lone surrogate escapes such as "\ud800" (refused at
        // publish, or kept as `data_base64` in binary mode), which strict parsers
        // refuse. (Numbers beyond f64, valid JSON, stay as published.)
        Some(EventData::Json(text)) => {
            prop_assert!(serde_json::from_str::<&serde_json::value::RawValue>(text).is_ok());
            if let Err(e) = serde_json::from_str::<serde_json::Value>(text) {
                prop_assert!(!e.to_string().contains("surrogate"), "{}: {}", e, text);
            }
        }
        Some(EventData::Binary(_)) | None => {}
    }
    for (_, v) in e.extensions() {
        let _ = v.to_canonical_string();
    }
    for partitions in [1, 7, 1024] {
        prop_assert!(partition_for(e, partitions) < partitions);
    }
    // What subscription filters compare: every attribute by name, in its string form.
    let attr = |name: &str| e.attribute(name).map(|v| v.into_owned());
    prop_assert_eq!(attr("type"), Some(e.event_type().to_owned()));
    prop_assert_eq!(attr("source"), Some(e.source().to_owned()));
    prop_assert_eq!(attr("subject"), e.subject().map(str::to_owned));
    for (name, v) in e.extensions() {
        prop_assert_eq!(attr(name), Some(v.to_canonical_string()));
    }
    // Push delivery renders binary mode; publishing that back must be accepted.
    let (headers, body) = to_binary_mode(e);
    let ct = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
        .map(|(_, v)| v.clone());
    let again = parse_publish(ct.as_deref(), &headers, &body, &Limits::default());
    prop_assert!(
        again.is_ok(),
        "binary mode of {:?} rejected: {:?}",
        String::from_utf8_lossy(e.stored()),
        again.err()
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Structured and batch bodies written member by member.
    #[test]
    fn fuzz_structured_and_batch_bodies((ct, body) in body(), limits in limits()) {
        match parse_publish(ct.as_deref(), &[], &body, &limits) {
            Ok(events) => {
                prop_assert!(!events.is_empty() && events.len() <= limits.max_batch.max(1));
                for e in &events {
                    exercise(e, &limits)?;
                }
            }
            Err(e) => prop_assert!([400, 413, 415].contains(&e.status), "{:?}", e),
        }
    }

    /// Binary mode: any header names, cases and encodings, any content type and body.
    #[test]
    fn fuzz_binary_mode_requests((ct, headers, body) in binary_request(), limits in limits()) {
        match parse_publish(ct.as_deref(), &headers, &body, &limits) {
            Ok(events) => {
                prop_assert_eq!(events.len(), 1);
                exercise(&events[0], &limits)?;
            }
            Err(e) => prop_assert!([400, 413, 415].contains(&e.status), "{:?}", e),
        }
    }

    /// A stored event damaged on disk (a byte changed, a cut, an extension) is a
    /// corrupt error, or valid JSON that reads back as exactly itself.
    #[test]
    fn fuzz_damaged_stored_events(
        text in event_text(),
        how in 0u8..3,
        at in any::<prop::sample::Index>(),
        byte in any::<u8>(),
    ) {
        let Ok(events) = parse_publish(Some(STRUCTURED_CONTENT_TYPE), &[], text.as_bytes(), &Limits::default()) else {
            return Ok(());
        };
        let mut stored = events[0].stored().to_vec();
        match how {
            0 => {
                let i = at.index(stored.len());
                stored[i] = byte;
            }
            1 => stored.truncate(at.index(stored.len())),
            _ => stored.push(byte),
        }
        match Event::from_stored(&stored) {
            Ok(e) => prop_assert_eq!(e.stored(), &stored[..]),
            Err(e) => prop_assert!(e.is_corrupt(), "{:?}", e),
        }
    }
}
