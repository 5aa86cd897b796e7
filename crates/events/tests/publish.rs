//! The publish rules of http-api.md ("Topics and events"), one story per test: what a
//! client sends, and which status and field it gets back.

use meshd_events::{
    parse_publish, to_binary_mode, Event, EventData, EventError, ExtensionValue, Limits,
    MAX_DELIVER_AHEAD_MS,
};

const CE: &str = "application/cloudevents+json";
const BATCH: &str = "application/cloudevents-batch+json";

fn h(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

fn structured(body: &str) -> Result<Event, EventError> {
    parse_publish(Some(CE), &[], body.as_bytes(), &Limits::default()).map(|mut v| {
        assert_eq!(v.len(), 1);
        v.remove(0)
    })
}

fn structured_err(body: &str) -> EventError {
    structured(body).expect_err(body)
}

/// A valid event with `extra` members spliced in after `type`.
fn with(extra: &str) -> String {
    let sep = if extra.is_empty() { "" } else { "," };
    format!(r#"{{"specversion":"1.0","id":"e1","source":"/s","type":"t.created"{sep}{extra}}}"#)
}

fn assert_400(err: &EventError, field: &str) {
    assert_eq!(err.status, 400, "{err:?}");
    assert_eq!(err.field.as_deref(), Some(field), "{err:?}");
    let bare = field.rsplit('.').next().unwrap();
    assert!(err.detail.contains(bare), "detail names the field: {err:?}");
}

fn binary(
    content_type: Option<&str>,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Event, EventError> {
    parse_publish(content_type, &h(headers), body, &Limits::default()).map(|mut v| v.remove(0))
}

const REQUIRED: [(&str, &str); 4] = [
    ("ce-specversion", "1.0"),
    ("ce-id", "e1"),
    ("ce-source", "/s"),
    ("ce-type", "t.created"),
];

fn required_plus(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    REQUIRED.iter().chain(extra).copied().collect()
}

// ---- structured mode -------------------------------------------------------------

#[test]
fn structured_event_is_stored_byte_for_byte_as_published() {
    let object = "{ \"type\" : \"t.created\",\n  \"specversion\":\"1.0\", \"id\":\"e1\",\"source\":\"/s\",\n  \"zext\": 7, \"aext\":\"x\\u0041\", \"data\": {\"price\": 1.50, \"n\": 1e3, \"big\": 123456789012345678901234567890} }";
    let body = format!("\n\t {object} \r\n");
    let event = parse_publish(
        Some("Application/CloudEvents+JSON; charset=utf-8"),
        &[],
        body.as_bytes(),
        &Limits::default(),
    )
    .unwrap()
    .remove(0);
    assert_eq!(event.stored(), object.as_bytes());
    assert_eq!(event.to_raw_json().get(), object);
    assert_eq!(event.id(), "e1");
    assert_eq!(event.source(), "/s");
    assert_eq!(event.event_type(), "t.created");
    assert_eq!(event.spec_version(), "1.0");
    assert_eq!(event.partition_key(), None);
    assert_eq!(
        event.extensions(),
        &[
            ("zext".to_owned(), ExtensionValue::Integer(7)),
            ("aext".to_owned(), ExtensionValue::String("xA".to_owned())),
        ]
    );
    assert_eq!(
        event.data(),
        Some(EventData::Json(
            r#"{"price": 1.50, "n": 1e3, "big": 123456789012345678901234567890}"#
        ))
    );
}

#[test]
fn structured_event_round_trips_through_the_stored_form() {
    let body = with(
        r#""subject":"sub","dataschema":"https://x/s","datacontenttype":"application/xml","time":"2018-04-05T17:31:00.5+01:00","partitionkey":"k1","flag":true,"n":-5,"data":"<a/>""#,
    );
    let published = structured(&body).unwrap();
    let back = Event::from_stored(published.stored()).unwrap();
    assert_eq!(back.stored(), body.as_bytes());
    for e in [&published, &back] {
        assert_eq!(e.subject(), Some("sub"));
        assert_eq!(e.data_schema(), Some("https://x/s"));
        assert_eq!(e.data_content_type(), Some("application/xml"));
        assert_eq!(e.time(), Some("2018-04-05T17:31:00.5+01:00"));
        assert_eq!(e.partition_key(), Some("k1"));
        assert_eq!(
            e.extensions(),
            &[
                (
                    "partitionkey".to_owned(),
                    ExtensionValue::String("k1".into())
                ),
                ("flag".to_owned(), ExtensionValue::Boolean(true)),
                ("n".to_owned(), ExtensionValue::Integer(-5)),
            ]
        );
        assert_eq!(e.data(), Some(EventData::Json(r#""<a/>""#)));
    }
}

#[test]
fn null_attributes_are_absent_but_null_data_is_a_payload() {
    let e = structured(&with(
        r#""subject":null,"time":null,"ext":null,"data":null"#,
    ))
    .unwrap();
    assert_eq!(e.subject(), None);
    assert_eq!(e.time(), None);
    assert!(e.extensions().is_empty());
    assert_eq!(e.data(), Some(EventData::Json("null")));
    // data_base64: null is absent too, so it does not clash with data.
    let e = structured(&with(r#""data_base64":null,"data":1"#)).unwrap();
    assert_eq!(e.data(), Some(EventData::Json("1")));
}

#[test]
fn data_base64_is_decoded() {
    let e = structured(&with(r#""data_base64":"AAEC/w==""#)).unwrap();
    assert_eq!(e.data(), Some(EventData::Binary(vec![0, 1, 2, 255])));
    // A JSON-escaped slash is still base64.
    let e = structured(&with(r#""data_base64":"AAEC\/w==""#)).unwrap();
    assert_eq!(e.data(), Some(EventData::Binary(vec![0, 1, 2, 255])));
}

#[test]
fn every_validation_error_names_its_field() {
    let base = |members: &str| format!("{{{members}}}");
    let cases: Vec<(String, &str)> = vec![
        (base(r#""id":"e1","source":"/s","type":"t""#), "specversion"),
        (with("").replace("\"1.0\"", "\"0.3\""), "specversion"),
        (with("").replace("\"1.0\"", "1.0"), "specversion"),
        (
            base(r#""specversion":"1.0","source":"/s","type":"t""#),
            "id",
        ),
        (with("").replace("\"e1\"", "\"\""), "id"),
        (with("").replace("\"e1\"", "5"), "id"),
        (with("").replace("\"e1\"", "null"), "id"),
        (
            base(r#""specversion":"1.0","id":"e1","type":"t""#),
            "source",
        ),
        (with("").replace("\"/s\"", "\"\""), "source"),
        (with("").replace("\"/s\"", "[]"), "source"),
        (
            base(r#""specversion":"1.0","id":"e1","source":"/s""#),
            "type",
        ),
        (with("").replace("\"t.created\"", "\"\""), "type"),
        (with("").replace("\"t.created\"", "true"), "type"),
        (with(r#""time":"yesterday""#), "time"),
        (with(r#""time":"2018-02-30T00:00:00Z""#), "time"),
        (with(r#""time":1522949460"#), "time"),
        (with(r#""subject":5"#), "subject"),
        (with(r#""subject":"""#), "subject"),
        (with(r#""dataschema":{}"#), "dataschema"),
        (with(r#""datacontenttype":5"#), "datacontenttype"),
        (with(r#""datacontenttype":"json""#), "datacontenttype"),
        (with(r#""datacontenttype":"""#), "datacontenttype"),
        (with(r#""partitionkey":"""#), "partitionkey"),
        (with(r#""partitionkey":5"#), "partitionkey"),
        (with(r#""myExt":"x""#), "myExt"),
        (with(r#""my_ext":"x""#), "my_ext"),
        (with(r#""":"x""#), ""),
        (with(r#""ext":{"a":1}"#), "ext"),
        (with(r#""ext":[1]"#), "ext"),
        (with(r#""ext":1.5"#), "ext"),
        (with(r#""ext":1e3"#), "ext"),
        (with(r#""ext":2147483648"#), "ext"),
        (with(r#""ext":"a\u0007b""#), "ext"),
        (with(r#""data":1,"data_base64":"AA==""#), "data_base64"),
        (with(r#""data_base64":"not base64!""#), "data_base64"),
        (with(r#""data_base64":"AA""#), "data_base64"),
        (with(r#""data_base64":5"#), "data_base64"),
        (with(r#""id":"e2""#), "id"),
    ];
    for (body, field) in cases {
        let err = structured_err(&body);
        assert_eq!(err.status, 400, "{body}: {err:?}");
        assert_eq!(err.field.as_deref(), Some(field), "{body}: {err:?}");
        assert!(err.detail.contains(field), "{body}: {err:?}");
    }
}

#[test]
fn the_documented_source_error() {
    let err = structured_err(&with("").replace("\"/s\"", "\"\""));
    assert_eq!(err.field.as_deref(), Some("source"));
    assert_eq!(err.detail, "source must be a non-empty string");
    assert_eq!(err.to_string(), err.detail);
    assert_eq!(err.title(), "Bad Request");
}

#[test]
fn integer_extensions_at_the_edges_of_the_range_are_accepted() {
    let e = structured(&with(r#""lo":-2147483648,"hi":2147483647"#)).unwrap();
    assert_eq!(
        e.extensions(),
        &[
            ("lo".to_owned(), ExtensionValue::Integer(i32::MIN)),
            ("hi".to_owned(), ExtensionValue::Integer(i32::MAX)),
        ]
    );
}

#[test]
fn malformed_structured_bodies_are_400_without_a_field() {
    for body in [
        &b"{"[..],
        b"",
        b"not json",
        b"[]",
        b"\"event\"",
        b"{} x",
        b"\xff{}",
    ] {
        let err = parse_publish(Some(CE), &[], body, &Limits::default()).unwrap_err();
        assert_eq!(err.status, 400, "{body:?}");
        assert_eq!(err.field, None, "{body:?}");
    }
}

// ---- batch mode ------------------------------------------------------------------

#[test]
fn a_batch_keeps_each_element_text_and_its_order() {
    let a = with(r#""data": {"n": 1.0}"#);
    let b = with(r#""data": [1, 2]"#).replace("e1", "e2");
    let body = format!("[ {a} ,\n{b}]");
    let events = parse_publish(Some(BATCH), &[], body.as_bytes(), &Limits::default()).unwrap();
    assert_eq!(events.len(), 2);
    assert_eq!(events[0].stored(), a.as_bytes());
    assert_eq!(events[1].stored(), b.as_bytes());
    assert_eq!(events[1].id(), "e2");
}

#[test]
fn batch_errors_name_the_index() {
    let good = with("");
    let bad = with("").replace("\"/s\"", "\"\"");
    let body = format!("[{good},{good},{good},{bad}]");
    let err = parse_publish(Some(BATCH), &[], body.as_bytes(), &Limits::default()).unwrap_err();
    assert_400(&err, "events[3].source");
    assert!(err.detail.starts_with("events[3]: "), "{err:?}");

    let body = format!("[{good},{good},7]");
    let err = parse_publish(Some(BATCH), &[], body.as_bytes(), &Limits::default()).unwrap_err();
    assert_eq!(err.status, 400);
    assert_eq!(err.field.as_deref(), Some("events[2]"));
}

#[test]
fn batch_shape_errors() {
    let limits = Limits::default();
    let err = parse_publish(Some(BATCH), &[], b"[]", &limits).unwrap_err();
    assert_eq!((err.status, err.field), (400, None));
    let err = parse_publish(Some(BATCH), &[], with("").as_bytes(), &limits).unwrap_err();
    assert_eq!((err.status, err.field), (400, None));
    let err = parse_publish(Some(BATCH), &[], b"[", &limits).unwrap_err();
    assert_eq!((err.status, err.field), (400, None));
}

#[test]
fn a_batch_over_max_batch_is_413() {
    let limits = Limits {
        max_batch: 3,
        ..Limits::default()
    };
    let good = with("");
    let body = format!("[{good},{good},{good}]");
    assert_eq!(
        parse_publish(Some(BATCH), &[], body.as_bytes(), &limits)
            .unwrap()
            .len(),
        3
    );
    let body = format!("[{good},{good},{good},{good}]");
    let err = parse_publish(Some(BATCH), &[], body.as_bytes(), &limits).unwrap_err();
    assert_eq!(err.status, 413);
    assert_eq!(err.title(), "Content Too Large");
    assert_eq!(Limits::default().max_batch, 1000);
}

#[test]
fn an_event_over_max_event_bytes_is_413_naming_the_index() {
    let small = with("");
    let large = with(&format!(r#""data":"{}""#, "x".repeat(200)));
    let limits = Limits {
        max_event_bytes: large.len() - 1,
        ..Limits::default()
    };
    let body = format!("[{small},{large}]");
    let err = parse_publish(Some(BATCH), &[], body.as_bytes(), &limits).unwrap_err();
    assert_eq!(err.status, 413);
    assert_eq!(err.field.as_deref(), Some("events[1]"));

    let err = parse_publish(Some(CE), &[], large.as_bytes(), &limits).unwrap_err();
    assert_eq!(err.status, 413);
    // Exactly at the limit is fine.
    let limits = Limits {
        max_event_bytes: large.len(),
        ..Limits::default()
    };
    parse_publish(Some(CE), &[], large.as_bytes(), &limits).unwrap();
    assert_eq!(Limits::default().max_event_bytes, 1024 * 1024);
}

// ---- 415 -------------------------------------------------------------------------

#[test]
fn no_usable_mode_is_415_naming_the_content_type() {
    let body = with("");
    for ct in [Some("text/plain"), Some("application/json"), None] {
        let err = parse_publish(
            ct,
            &h(&[("x-other", "1")]),
            body.as_bytes(),
            &Limits::default(),
        )
        .unwrap_err();
        assert_eq!(err.status, 415, "{ct:?}");
        assert_eq!(err.title(), "Unsupported Media Type");
        match ct {
            Some(ct) => assert!(err.detail.contains(ct), "{err:?}"),
            None => assert!(err.detail.contains("missing content type"), "{err:?}"),
        }
    }
    // Another CloudEvents format is 415 even with ce- headers.
    let err = binary(Some("application/cloudevents+xml"), &REQUIRED, b"<a/>").unwrap_err();
    assert_eq!(err.status, 415);
    assert!(err.detail.contains("application/cloudevents+xml"));
}

// ---- binary mode -----------------------------------------------------------------

#[test]
fn binary_mode_maps_headers_to_attributes() {
    let headers = [
        ("CE-SpecVersion", "1.0"),
        ("ce-ID", "e1"),
        ("Ce-Source", "/s"),
        ("ce-type", "t.created"),
        ("ce-time", "2018-04-05T17:31:00Z"),
        ("ce-subject", "sub"),
        ("ce-PartitionKey", "k1"),
        ("ce-zext", "5"),
        ("ce-aext", "Euro%20%e2%82%ac%20%F0%9F%98%80"),
        ("x-request-id", "ignored"),
        ("content-type", "text/ignored"),
    ];
    let e = binary(
        Some("application/json; charset=utf-8"),
        &headers,
        b" {\"a\": 1.50} ",
    )
    .unwrap();
    assert_eq!(e.id(), "e1");
    assert_eq!(e.source(), "/s");
    assert_eq!(e.event_type(), "t.created");
    assert_eq!(e.time(), Some("2018-04-05T17:31:00Z"));
    assert_eq!(e.subject(), Some("sub"));
    assert_eq!(e.partition_key(), Some("k1"));
    assert_eq!(
        e.data_content_type(),
        Some("application/json; charset=utf-8")
    );
    assert_eq!(e.data(), Some(EventData::Json(r#"{"a": 1.50}"#)));
    // The canonical stored form: fixed attribute order, then extensions by name.
    assert_eq!(
        std::str::from_utf8(e.stored()).unwrap(),
        r#"{"specversion":"1.0","id":"e1","source":"/s","type":"t.created","datacontenttype":"application/json; charset=utf-8","subject":"sub","time":"2018-04-05T17:31:00Z","aext":"Euro € 😀","partitionkey":"k1","zext":"5","data":{"a": 1.50}}"#
    );
    let back = Event::from_stored(e.stored()).unwrap();
    assert_eq!(back.stored(), e.stored());
    assert_eq!(back.partition_key(), Some("k1"));
}

#[test]
fn binary_mode_header_values_are_unquoted_then_percent_decoded() {
    let e = binary(
        None,
        &required_plus(&[
            ("ce-quoted", r#""a \"b\" c""#),
            ("ce-both", "\"x%20y\""),
            ("ce-spaced", "  v  "),
            ("ce-lit", "100%zz"),
        ]),
        b"",
    )
    .unwrap();
    let ext = |n: &str| {
        e.extensions()
            .iter()
            .find(|(k, _)| k == n)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(
        ext("quoted"),
        Some(ExtensionValue::String(r#"a "b" c"#.into()))
    );
    assert_eq!(ext("both"), Some(ExtensionValue::String("x y".into())));
    assert_eq!(ext("spaced"), Some(ExtensionValue::String("v".into())));
    assert_eq!(ext("lit"), Some(ExtensionValue::String("100%zz".into())));
}

#[test]
fn binary_mode_rejects_invalid_utf8_after_decoding() {
    // %C0%A0: an overlong U+0020, which the binding says MUST be rejected.
    let err = binary(None, &required_plus(&[("ce-subject", "a%C0%A0b")]), b"").unwrap_err();
    assert_400(&err, "subject");
}

#[test]
fn binary_mode_errors_name_the_attribute() {
    let missing_spec = &REQUIRED[1..];
    assert_400(
        &binary(None, missing_spec, b"x").unwrap_err(),
        "specversion",
    );
    let no_source: Vec<_> = REQUIRED
        .iter()
        .copied()
        .filter(|(n, _)| *n != "ce-source")
        .collect();
    assert_400(&binary(None, &no_source, b"x").unwrap_err(), "source");
    assert_400(
        &binary(None, &required_plus(&[("ce-time", "soon")]), b"").unwrap_err(),
        "time",
    );
    assert_400(
        &binary(None, &required_plus(&[("ce-my_ext", "x")]), b"").unwrap_err(),
        "my_ext",
    );
    assert_400(
        &binary(None, &required_plus(&[("ce-id", "again")]), b"").unwrap_err(),
        "id",
    );
    assert_400(
        &binary(
            Some("text/plain"),
            &required_plus(&[("ce-datacontenttype", "text/plain")]),
            b"",
        )
        .unwrap_err(),
        "datacontenttype",
    );
    assert_400(
        &binary(None, &required_plus(&[("ce-data", "x")]), b"").unwrap_err(),
        "data",
    );
    assert_400(
        &binary(Some("not a media type"), &REQUIRED, b"").unwrap_err(),
        "datacontenttype",
    );
    assert_400(
        &binary(None, &required_plus(&[("ce-partitionkey", "")]), b"").unwrap_err(),
        "partitionkey",
    );
}

#[test]
fn binary_mode_body_becomes_data_or_data_base64() {
    // JSON content type and a JSON body: data.
    let e = binary(Some("application/vnd.example+json"), &REQUIRED, b"[1,2]").unwrap();
    assert_eq!(e.data(), Some(EventData::Json("[1,2]")));
    let e = binary(Some("text/json"), &REQUIRED, b"\"s\"").unwrap();
    assert_eq!(e.data(), Some(EventData::Json("\"s\"")));
    // JSON content type but not JSON: base64, datacontenttype kept.
    let e = binary(Some("application/json"), &REQUIRED, b"{oops").unwrap();
    assert_eq!(e.data(), Some(EventData::Binary(b"{oops".to_vec())));
    assert_eq!(e.data_content_type(), Some("application/json"));
    // Other content types: base64, even when the body happens to be JSON.
    let e = binary(Some("text/plain"), &REQUIRED, b"{}").unwrap();
    assert_eq!(e.data(), Some(EventData::Binary(b"{}".to_vec())));
    assert!(std::str::from_utf8(e.stored())
        .unwrap()
        .ends_with(r#""datacontenttype":"text/plain","data_base64":"e30="}"#));
    // No content type: base64 and no datacontenttype.
    let e = binary(None, &REQUIRED, &[0xff, 0]).unwrap();
    assert_eq!(e.data(), Some(EventData::Binary(vec![0xff, 0])));
    assert_eq!(e.data_content_type(), None);
    // Empty body: no data at all.
    let e = binary(Some("application/json"), &REQUIRED, b"").unwrap();
    assert_eq!(e.data(), None);
}

#[test]
fn binary_mode_event_over_the_limit_is_413() {
    let limits = Limits {
        max_event_bytes: 200,
        ..Limits::default()
    };
    let err = parse_publish(None, &h(&REQUIRED), &[7u8; 200], &limits).unwrap_err();
    assert_eq!(err.status, 413);
}

// ---- push: binary mode out -------------------------------------------------------

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

#[test]
fn to_binary_mode_maps_attributes_extensions_and_json_data() {
    let e = structured(&with(
        r#""subject":"a b\"c%d","time":"2018-04-05T17:31:00Z","partitionkey":"k","n":5,"ok":false,"eu":"€","data":{"x": 1.50}"#,
    ))
    .unwrap();
    let (headers, body) = to_binary_mode(&e);
    let expected = [
        ("ce-specversion", "1.0"),
        ("ce-id", "e1"),
        ("ce-source", "/s"),
        ("ce-type", "t.created"),
        ("ce-subject", "a%20b%22c%25d"),
        ("ce-time", "2018-04-05T17:31:00Z"),
        ("ce-partitionkey", "k"),
        ("ce-n", "5"),
        ("ce-ok", "false"),
        ("ce-eu", "%E2%82%AC"),
        ("content-type", "application/json"),
    ];
    assert_eq!(headers, h(&expected));
    assert_eq!(body, br#"{"x": 1.50}"#);
    for (_, v) in &headers {
        assert!(v.bytes().all(|c| (0x21..=0x7e).contains(&c) || c == b' '));
    }
}

#[test]
fn to_binary_mode_data_forms() {
    // A string payload with a non-JSON type is sent as its content.
    let e = structured(&with(
        r#""datacontenttype":"application/xml","data":"<much wow=\"xml\"/>""#,
    ))
    .unwrap();
    let (headers, body) = to_binary_mode(&e);
    assert_eq!(header(&headers, "content-type"), Some("application/xml"));
    assert_eq!(body, br#"<much wow="xml"/>"#);
    // A string payload without a type is JSON: quoted.
    let e = structured(&with(r#""data":"I'm just a string""#)).unwrap();
    let (headers, body) = to_binary_mode(&e);
    assert_eq!(header(&headers, "content-type"), Some("application/json"));
    assert_eq!(body, br#""I'm just a string""#);
    // Binary data: decoded, with its declared type.
    let e = structured(&with(
        r#""datacontenttype":"application/octet-stream","data_base64":"AAEC""#,
    ))
    .unwrap();
    let (headers, body) = to_binary_mode(&e);
    assert_eq!(
        header(&headers, "content-type"),
        Some("application/octet-stream")
    );
    assert_eq!(body, vec![0, 1, 2]);
    // No data: empty body, no content-type.
    let e = structured(&with("")).unwrap();
    let (headers, body) = to_binary_mode(&e);
    assert_eq!(header(&headers, "content-type"), None);
    assert!(body.is_empty());
}

#[test]
fn binary_publish_and_binary_push_are_inverses() {
    let headers = required_plus(&[
        ("ce-subject", "Euro%20%E2%82%AC"),
        ("ce-partitionkey", "p%25"),
        ("ce-dataschema", "https://example.com/s"),
        ("ce-ext", "\"quoted\""),
    ]);
    for (ct, body) in [
        (Some("application/json"), &b"{\"a\":[1,2.50]}"[..]),
        (Some("text/plain; charset=utf-8"), b"hello"),
        (None, b"\x00\x01"),
        (Some("application/json"), b""),
    ] {
        let first = binary(ct, &headers, body).unwrap();
        let (out_headers, out_body) = to_binary_mode(&first);
        let out_ct = header(&out_headers, "content-type");
        assert_eq!(out_ct, ct);
        assert_eq!(out_body, body);
        let again = parse_publish(out_ct, &out_headers, &out_body, &Limits::default()).unwrap();
        assert_eq!(again[0].stored(), first.stored());
    }
}

// ---- stored form -----------------------------------------------------------------

#[test]
fn corrupt_stored_events_are_errors_not_panics() {
    let good = with(r#""data":{"a":1}"#);
    let cases: Vec<Vec<u8>> = vec![
        vec![],
        b"\xff\xfe".to_vec(),
        b"[]".to_vec(),
        b"null".to_vec(),
        good.as_bytes()[..good.len() - 3].to_vec(),
        format!("{good}garbage").into_bytes(),
        format!(" {good}").into_bytes(),
        with("").replace("\"e1\"", "\"\"").into_bytes(),
        with(r#""data_base64":"!!""#).into_bytes(),
    ];
    for bytes in cases {
        let err = Event::from_stored(&bytes).expect_err(&String::from_utf8_lossy(&bytes));
        assert!(err.is_corrupt(), "{err:?}");
        assert_eq!(err.status, 500);
        assert!(err.detail.starts_with("corrupt stored event"), "{err:?}");
    }
}

/// Pins the stored format: events written by this version must read back the same in
/// every later one. Add fixtures here, never change them.
#[test]
fn stored_format_fixtures_read_back() {
    let structured_v1 = br#"{"specversion":"1.0","id":"A234-1234-1234","source":"/mycontext/4","type":"com.example.someevent","time":"2018-04-05T17:31:00Z","comexampleextension1":"value","comexampleothervalue":5,"partitionkey":"order-7","datacontenttype":"application/vnd.apache.thrift.binary","data_base64":"3q2+7w=="}"#;
    let e = Event::from_stored(structured_v1).unwrap();
    assert_eq!(e.id(), "A234-1234-1234");
    assert_eq!(e.source(), "/mycontext/4");
    assert_eq!(e.event_type(), "com.example.someevent");
    assert_eq!(e.partition_key(), Some("order-7"));
    assert_eq!(
        e.data(),
        Some(EventData::Binary(vec![0xde, 0xad, 0xbe, 0xef]))
    );
    assert_eq!(e.stored(), &structured_v1[..]);

    let binary_v1 = br#"{"specversion":"1.0","id":"e1","source":"/s","type":"t","datacontenttype":"application/json","aext":"x","data":{"a":1}}"#;
    let e = Event::from_stored(binary_v1).unwrap();
    assert_eq!(e.data(), Some(EventData::Json(r#"{"a":1}"#)));
    assert_eq!(
        e.extensions(),
        &[("aext".to_owned(), ExtensionValue::String("x".into()))]
    );
}

#[test]
fn an_event_serializes_as_its_stored_json() {
    let object = with(r#""data":{"b":1,"a":1.0}"#);
    let e = structured(&object).unwrap();
    let answer = serde_json::to_string(&[&e]).unwrap();
    assert_eq!(answer, format!("[{object}]"));
}

/// `levels` nested arrays around `1`.
fn nested(levels: usize) -> String {
    format!("{}1{}", "[".repeat(levels), "]".repeat(levels))
}

/// The depth rule (http-api.md, "Security rules (third round)"): the event object is
/// level 1, so `data` may nest 63 levels; the same event is accepted or refused alike
/// alone, in a batch (whose array does not count) and in binary mode (where the body is
/// `data`).
#[test]
fn an_event_nests_at_most_64_levels_alone_in_a_batch_and_in_binary_mode() {
    let ok = with(&format!(r#""data":{}"#, nested(63)));
    let deep = with(&format!(r#""data":{}"#, nested(64)));
    assert_eq!(
        meshd_events::nested_deeper_than(ok.as_bytes(), usize::MAX),
        None
    );
    structured(&ok).unwrap();
    let err = structured_err(&deep);
    assert_400(&err, "data");
    assert!(err.detail.contains("64 levels"), "{err:?}");

    let limits = Limits::default();
    let batch = format!("[{ok},{ok}]");
    let events = parse_publish(Some(BATCH), &[], batch.as_bytes(), &limits).unwrap();
    assert_eq!(events.len(), 2, "the batch's own array does not count");
    let batch = format!("[{ok},{deep},{ok}]");
    let err = parse_publish(Some(BATCH), &[], batch.as_bytes(), &limits).unwrap_err();
    assert_400(&err, "events[1].data");
    assert!(err.detail.starts_with("events[1]: "), "{err:?}");

    let e = binary(Some("application/json"), &REQUIRED, nested(63).as_bytes()).unwrap();
    assert_eq!(e.data(), Some(EventData::Json(nested(63).as_str())));
    let err = binary(Some("application/json"), &REQUIRED, nested(64).as_bytes()).unwrap_err();
    assert_400(&err, "data");
    // A body that is not declared JSON is bytes (`data_base64`): no depth to judge.
    let e = binary(Some("text/plain"), &REQUIRED, nested(64).as_bytes()).unwrap();
    assert_eq!(e.data(), Some(EventData::Binary(nested(64).into_bytes())));

    // Any member is named, before its own rules are applied; brackets inside strings
    // do not count.
    assert_400(
        &structured_err(&with(&format!(r#""ext":{}"#, nested(64)))),
        "ext",
    );
    structured(&with(&format!(r#""data":{{"s":"{}"}}"#, "[".repeat(1000)))).unwrap();
}

#[test]
fn deeply_nested_data_is_refused_without_recursion_and_a_stored_one_still_reads_back() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let event = with(&format!(r#""data":{deep}"#));
    assert_400(&structured_err(&event), "data");
    let batch = format!("[{},{event}]", with(""));
    let err = parse_publish(Some(BATCH), &[], batch.as_bytes(), &Limits::default()).unwrap_err();
    assert_400(&err, "events[1].data");
    let err = binary(Some("application/json"), &REQUIRED, deep.as_bytes()).unwrap_err();
    assert_400(&err, "data");
    // An event stored before the rule is never re-judged: it reads back, without
    // recursion, and renders for push.
    let e = Event::from_stored(event.as_bytes()).unwrap();
    assert_eq!(e.data(), Some(EventData::Json(deep.as_str())));
    let (_, body) = to_binary_mode(&e);
    assert_eq!(body, deep.as_bytes());
    // Unbalanced: a 400, not a stack overflow.
    let err = structured_err(&with(&format!(r#""data":{}"#, "[".repeat(100_000))));
    assert_eq!(err.status, 400);
}

#[test]
fn attributes_lists_every_context_attribute_and_extension_in_its_string_form() {
    let e = structured(&with(
        r#""subject":"s1","time":"2026-01-01T00:00:00Z","region":"eu","priority":3,"urgent":true"#,
    ))
    .unwrap();
    let all: Vec<(String, String)> = e
        .attributes()
        .map(|(k, v)| (k.to_string(), v.into_owned()))
        .collect();
    for (name, value) in &all {
        assert_eq!(e.attribute(name).as_deref(), Some(value.as_str()), "{name}");
    }
    let names: Vec<&str> = all.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "specversion",
            "id",
            "source",
            "type",
            "subject",
            "time",
            "region",
            "priority",
            "urgent"
        ]
    );
    assert_eq!(e.attribute("priority").as_deref(), Some("3"));
    assert_eq!(e.attribute("urgent").as_deref(), Some("true"));
    // Absent optional attributes are not listed.
    assert!(e.attribute("dataschema").is_none());
}

#[test]
fn deliverat_is_an_rfc3339_string_at_most_7_days_ahead_of_the_publish() {
    let now = 1_796_400_000_000i64; // 2026-12-04T16:00:00Z
    let limits = Limits {
        now_ms: Some(now),
        ..Limits::default()
    };
    let publish = |deliverat: &str| {
        parse_publish(
            Some(CE),
            &[],
            with(&format!(r#""deliverat":{deliverat}"#)).as_bytes(),
            &limits,
        )
    };
    // In the past (means now), just ahead, exactly 7 days ahead, with an offset.
    for ok in [
        r#""2001-01-01T00:00:00Z""#,
        r#""2026-12-04T16:00:01Z""#,
        r#""2026-12-11T16:00:00Z""#,
        r#""2026-12-11T18:00:00+02:00""#,
    ] {
        let e = publish(ok)
            .unwrap_or_else(|e| panic!("{ok}: {e:?}"))
            .remove(0);
        assert!(e.deliver_at_ms().is_some(), "{ok}");
    }
    assert_eq!(
        publish(r#""2026-12-11T16:00:00Z""#).unwrap()[0].deliver_at_ms(),
        Some(now + MAX_DELIVER_AHEAD_MS)
    );
    for bad in [
        r#""2026-12-11T16:00:00.001Z""#,
        r#""2027-01-01T00:00:00Z""#,
        r#""tomorrow""#,
        r#""2026-12-05""#,
        "1796400000000",
        "true",
    ] {
        assert_400(&publish(bad).unwrap_err(), "deliverat");
    }
    // The name must be written as is (delivery looks for its bytes).
    let escaped = with(r#""deliver\u0061t":"2026-12-05T00:00:00Z""#);
    let err = parse_publish(Some(CE), &[], escaped.as_bytes(), &limits).unwrap_err();
    assert_400(&err, "deliverat");
    // In a batch the field names the event; in binary mode the header's value counts.
    let body = format!(
        "[{},{}]",
        with(""),
        with(r#""deliverat":"2030-01-01T00:00:00Z""#)
    );
    let err = parse_publish(Some(BATCH), &[], body.as_bytes(), &limits).unwrap_err();
    assert_400(&err, "events[1].deliverat");
    let err = parse_publish(
        None,
        &h(&[
            ("ce-specversion", "1.0"),
            ("ce-id", "b1"),
            ("ce-source", "/s"),
            ("ce-type", "t"),
            ("ce-deliverat", "soon"),
        ]),
        b"",
        &limits,
    )
    .unwrap_err();
    assert_400(&err, "deliverat");
    // Without a clock only the form is checked; a stored event is never re-judged.
    let far = with(r#""deliverat":"2030-01-01T00:00:00Z""#);
    let e = parse_publish(Some(CE), &[], far.as_bytes(), &Limits::default()).unwrap();
    let stored = Event::from_stored(e[0].stored()).unwrap();
    assert_eq!(stored.deliver_at_ms(), e[0].deliver_at_ms());
    let malformed = with(r#""deliverat":"later""#);
    let stored = Event::from_stored(malformed.as_bytes()).unwrap();
    assert_eq!(stored.deliver_at_ms(), None, "read as absent, not corrupt");
}
