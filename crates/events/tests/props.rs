//! Property tests: publish never panics, valid events round-trip through the stored form
//! and through binary mode, and partitioning is bounded and deterministic.

use std::collections::BTreeMap;

use base64::Engine as _;
use meshd_events::{
    parse_publish, partition_for, partition_for_key, to_binary_mode, Event, EventData,
    ExtensionValue, Limits,
};
use proptest::prelude::*;
use serde_json::Value;

const CE: &str = "application/cloudevents+json";
const BATCH: &str = "application/cloudevents-batch+json";

// ---- generators ------------------------------------------------------------------

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(member_name(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Member names that hit every validation branch.
fn member_name() -> impl Strategy<Value = String> {
    prop_oneof![
        prop::sample::select(vec![
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
            "ext",
            "Bad_Name",
        ])
        .prop_map(str::to_owned),
        "[a-z0-9]{1,6}",
        ".{0,6}",
    ]
}

/// An object that is mostly a valid event, with arbitrary values mixed in.
fn near_event() -> impl Strategy<Value = Value> {
    let valid = prop::sample::select(vec![
        ("specversion", Value::from("1.0")),
        ("id", Value::from("e1")),
        ("source", Value::from("/s")),
        ("type", Value::from("t")),
        ("time", Value::from("2020-01-01T00:00:00Z")),
        ("datacontenttype", Value::from("application/json")),
        ("data_base64", Value::from("AA==")),
        ("partitionkey", Value::from("k")),
        ("ext", Value::from(5)),
    ]);
    (
        prop::collection::vec(valid, 0..10),
        prop::collection::vec((member_name(), json_value()), 0..3),
    )
        .prop_map(|(valid, noise)| {
            let mut object = serde_json::Map::new();
            for (k, v) in valid {
                object.insert(k.to_owned(), v);
            }
            for (k, v) in noise {
                object.insert(k, v);
            }
            Value::Object(object)
        })
}

fn content_type() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(Some(CE.to_owned())),
        Just(Some(format!("{CE}; charset=utf-8"))),
        Just(Some(BATCH.to_owned())),
        Just(Some("application/json".to_owned())),
        Just(Some("text/plain".to_owned())),
        Just(Some("application/cloudevents+xml".to_owned())),
        Just(None),
        ".{0,20}".prop_map(Some),
    ]
}

fn headers() -> impl Strategy<Value = Vec<(String, String)>> {
    let required = vec![
        ("ce-specversion".to_owned(), "1.0".to_owned()),
        ("ce-id".to_owned(), "e1".to_owned()),
        ("ce-source".to_owned(), "/s".to_owned()),
        ("ce-type".to_owned(), "t".to_owned()),
    ];
    let name = prop_oneof![
        prop::sample::select(vec![
            "ce-specversion",
            "ce-id",
            "CE-Source",
            "ce-type",
            "ce-time",
            "ce-partitionkey",
            "ce-datacontenttype",
            "ce-data",
            "ce-Ext",
            "ce-bad_name",
            "ce-",
            "x-other",
        ])
        .prop_map(str::to_owned),
        "ce-.{0,6}",
    ];
    let value = prop_oneof![".{0,12}", "(%[0-9A-Fa-f]{2}|[a-z\"%\\\\ ]){0,8}"];
    (any::<bool>(), prop::collection::vec((name, value), 0..5)).prop_map(
        move |(with_required, extra)| {
            let mut headers = if with_required {
                required.clone()
            } else {
                Vec::new()
            };
            headers.extend(extra);
            headers
        },
    )
}

fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..64),
        json_value().prop_map(|v| v.to_string().into_bytes()),
        near_event().prop_map(|v| v.to_string().into_bytes()),
        prop::collection::vec(near_event(), 0..4)
            .prop_map(|v| Value::Array(v).to_string().into_bytes()),
    ]
}

fn limits() -> impl Strategy<Value = Limits> {
    prop_oneof![
        3 => Just(Limits::default()),
        1 => (0usize..4, 0usize..300).prop_map(|(max_batch, max_event_bytes)| Limits {
            max_batch,
            max_event_bytes,
            now_ms: None,
        }),
    ]
}

/// Strings allowed in String attributes: no control characters.
fn text(min: usize) -> impl Strategy<Value = String> {
    proptest::string::string_regex(&format!("[^\\p{{Cc}}]{{{min},16}}")).unwrap()
}

fn timestamp() -> impl Strategy<Value = String> {
    (
        0u32..10000,
        1u32..=12,
        1u32..=28,
        0u32..24,
        0u32..60,
        0u32..61,
        prop::option::of("[0-9]{1,9}"),
        prop_oneof![
            Just("Z".to_owned()),
            (any::<bool>(), 0u32..24, 0u32..60)
                .prop_map(|(neg, h, m)| format!("{}{h:02}:{m:02}", if neg { '-' } else { '+' })),
        ],
    )
        .prop_map(|(y, mo, d, h, mi, s, frac, off)| {
            let frac = frac.map(|f| format!(".{f}")).unwrap_or_default();
            format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}{frac}{off}")
        })
}

const RESERVED: [&str; 10] = [
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "dataschema",
    "datacontenttype",
    "time",
    "data",
    "partitionkey",
];

fn extension_name() -> impl Strategy<Value = String> {
    "[a-z0-9]{1,10}".prop_filter("not a known attribute", |n| !RESERVED.contains(&n.as_str()))
}

fn extension_value() -> impl Strategy<Value = ExtensionValue> {
    prop_oneof![
        text(0).prop_map(ExtensionValue::String),
        any::<i32>().prop_map(ExtensionValue::Integer),
        any::<bool>().prop_map(ExtensionValue::Boolean),
    ]
}

#[derive(Debug, Clone, PartialEq)]
enum Data {
    /// The JSON text (compared as text: f64 text does not round-trip through `Value`).
    Json(String),
    Binary(Vec<u8>),
}

/// The attributes of a valid event, as the test knows them.
#[derive(Debug, Clone, PartialEq)]
struct Model {
    id: String,
    source: String,
    event_type: String,
    subject: Option<String>,
    data_schema: Option<String>,
    data_content_type: Option<String>,
    time: Option<String>,
    partition_key: Option<String>,
    extensions: BTreeMap<String, ExtensionValue>,
    data: Option<Data>,
}

fn model() -> impl Strategy<Value = Model> {
    (
        (text(1), text(1), text(1)),
        (
            prop::option::of(text(1)),
            prop::option::of(text(1)),
            prop::option::of(prop::sample::select(vec![
                "application/json",
                "application/xml",
                "text/plain; charset=utf-8",
                "application/vnd.example+json",
            ])),
            prop::option::of(timestamp()),
            prop::option::of(text(1)),
        ),
        prop::collection::btree_map(extension_name(), extension_value(), 0..5),
        prop_oneof![
            Just(None),
            json_value().prop_map(|v| Some(Data::Json(v.to_string()))),
            prop::collection::vec(any::<u8>(), 0..40).prop_map(|b| Some(Data::Binary(b))),
        ],
    )
        .prop_map(
            |(
                (id, source, event_type),
                (subject, data_schema, dct, time, pk),
                extensions,
                data,
            )| {
                Model {
                    id,
                    source,
                    event_type,
                    subject,
                    data_schema,
                    data_content_type: dct.map(str::to_owned),
                    time,
                    partition_key: pk,
                    extensions,
                    data,
                }
            },
        )
}

/// Renders a model as structured JSON with shuffled members and random whitespace.
fn render(model: &Model, order: &[usize], ws: &[&str]) -> String {
    let s = |v: &str| Value::from(v).to_string();
    let mut members: Vec<(String, String)> = vec![
        ("specversion".into(), s("1.0")),
        ("id".into(), s(&model.id)),
        ("source".into(), s(&model.source)),
        ("type".into(), s(&model.event_type)),
    ];
    let optional = [
        ("subject", &model.subject),
        ("dataschema", &model.data_schema),
        ("datacontenttype", &model.data_content_type),
        ("time", &model.time),
        ("partitionkey", &model.partition_key),
    ];
    for (name, value) in optional {
        if let Some(v) = value {
            members.push((name.into(), s(v)));
        }
    }
    for (name, value) in &model.extensions {
        let v = match value {
            ExtensionValue::String(x) => s(x),
            ExtensionValue::Integer(i) => i.to_string(),
            ExtensionValue::Boolean(b) => b.to_string(),
        };
        members.push((name.clone(), v));
    }
    match &model.data {
        Some(Data::Json(v)) => members.push(("data".into(), v.clone())),
        Some(Data::Binary(b)) => members.push((
            "data_base64".into(),
            s(&base64::engine::general_purpose::STANDARD.encode(b)),
        )),
        None => {}
    }
    let mut keyed: Vec<(usize, (String, String))> = members
        .into_iter()
        .enumerate()
        .map(|(i, m)| (order.get(i).copied().unwrap_or(i), m))
        .collect();
    keyed.sort_by_key(|(k, _)| *k);
    let w = |i: usize| ws[i % ws.len()];
    let parts: Vec<String> = keyed
        .iter()
        .enumerate()
        .map(|(i, (_, (k, v)))| format!("{}{}{}:{}{}", w(i), s(k), w(i + 1), w(i + 2), v))
        .collect();
    format!("{{{}{}}}", parts.join(","), w(7))
}

/// What an event says, for comparison with a model.
fn snapshot(e: &Event) -> Model {
    let data = e.data().map(|d| match d {
        EventData::Json(text) => Data::Json(text.to_owned()),
        EventData::Binary(b) => Data::Binary(b),
    });
    let extensions: BTreeMap<_, _> = e
        .extensions()
        .iter()
        .filter(|(n, _)| n != "partitionkey")
        .cloned()
        .collect();
    assert_eq!(
        extensions.len() + usize::from(e.partition_key().is_some()),
        e.extensions().len()
    );
    Model {
        id: e.id().into(),
        source: e.source().into(),
        event_type: e.event_type().into(),
        subject: e.subject().map(Into::into),
        data_schema: e.data_schema().map(Into::into),
        data_content_type: e.data_content_type().map(Into::into),
        time: e.time().map(Into::into),
        partition_key: e.partition_key().map(Into::into),
        extensions,
        data,
    }
}

fn header_encode(value: &str, raw: bool) -> String {
    let printable = value
        .bytes()
        .all(|c| (0x21..=0x7e).contains(&c) && c != b'%' && c != b'"');
    if raw && printable {
        value.to_owned()
    } else {
        value
            .bytes()
            .map(|b| format!("%{b:02x}"))
            .collect::<String>()
    }
}

/// A model, and the binary-mode request for it: content type, headers, body.
type BinaryRequest = (Model, Option<String>, Vec<(String, String)>, Vec<u8>);

/// A binary-mode request for a model whose extensions are strings (headers carry no
/// types) and whose data is JSON only with a JSON content type.
fn binary_request() -> impl Strategy<Value = BinaryRequest> {
    (
        model(),
        prop::collection::btree_map(extension_name(), text(0), 0..5),
        any::<bool>(),
        prop::collection::vec(any::<bool>(), 16),
        prop_oneof![
            Just(None),
            prop::sample::select(vec![
                "application/json",
                "application/cloudevents-x+json; v=1",
                "text/plain",
                "application/octet-stream",
            ])
            .prop_map(|s| Some(s.to_owned())),
        ],
        prop_oneof![
            prop::collection::vec(any::<u8>(), 0..40),
            json_value().prop_map(|v| v.to_string().into_bytes()),
        ],
    )
        .prop_map(|(mut m, ext, upper, raw, ct, body)| {
            m.extensions = ext
                .into_iter()
                .map(|(k, v)| (k, ExtensionValue::String(v)))
                .collect();
            m.data_content_type = ct.clone();
            let json_ct = ct.as_deref().is_some_and(|c| c.contains("json"));
            m.data = if body.is_empty() {
                None
            } else if let Some(raw) = json_ct
                .then(|| serde_json::from_slice::<&serde_json::value::RawValue>(&body).ok())
                .flatten()
            {
                Some(Data::Json(raw.get().to_owned()))
            } else {
                Some(Data::Binary(body.clone()))
            };
            let mut attrs: Vec<(String, String)> = vec![
                ("specversion".into(), "1.0".into()),
                ("id".into(), m.id.clone()),
                ("source".into(), m.source.clone()),
                ("type".into(), m.event_type.clone()),
            ];
            for (n, v) in [
                ("subject", &m.subject),
                ("dataschema", &m.data_schema),
                ("time", &m.time),
                ("partitionkey", &m.partition_key),
            ] {
                if let Some(v) = v {
                    attrs.push((n.into(), v.clone()));
                }
            }
            for (n, v) in &m.extensions {
                attrs.push((n.clone(), v.to_canonical_string()));
            }
            let headers = attrs
                .into_iter()
                .enumerate()
                .map(|(i, (n, v))| {
                    let name = if upper {
                        format!("CE-{}", n.to_uppercase())
                    } else {
                        format!("ce-{n}")
                    };
                    (name, header_encode(&v, raw[i % raw.len()]))
                })
                .collect();
            (m, ct, headers, body)
        })
}

// ---- properties ------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// (a) Whatever arrives, publish answers with events or a 400/413/415, and every
    /// event it accepts reads back from its stored form.
    #[test]
    fn publish_never_panics(
        ct in content_type(),
        headers in headers(),
        body in body(),
        limits in limits(),
    ) {
        match parse_publish(ct.as_deref(), &headers, &body, &limits) {
            Ok(events) => {
                prop_assert!(!events.is_empty());
                for e in events {
                    prop_assert!(e.stored().len() <= limits.max_event_bytes);
                    let back = Event::from_stored(e.stored()).unwrap();
                    prop_assert_eq!(back.stored(), e.stored());
                    let _ = to_binary_mode(&e);
                }
            }
            Err(e) => prop_assert!([400, 413, 415].contains(&e.status), "{:?}", e),
        }
    }

    /// A corrupt stored event is an error, never a panic.
    #[test]
    fn from_stored_never_panics(bytes in body()) {
        if let Err(e) = Event::from_stored(&bytes) {
            prop_assert!(e.is_corrupt());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    /// (b) A valid structured event is stored byte for byte and reads back the same.
    #[test]
    fn structured_round_trip(
        m in model(),
        order in prop::collection::vec(0usize..32, 32),
        ws in prop::collection::vec(prop::sample::select(vec!["", " ", "\n", "\t ", "\r\n  "]), 8),
    ) {
        let text = render(&m, &order, &ws);
        let events = parse_publish(Some(CE), &[], text.as_bytes(), &Limits::default())
            .map_err(|e| TestCaseError::fail(format!("{e:?} for {text}")))?;
        prop_assert_eq!(events[0].stored(), text.as_bytes());
        prop_assert_eq!(&snapshot(&events[0]), &m);
        let back = Event::from_stored(events[0].stored()).unwrap();
        prop_assert_eq!(back.stored(), text.as_bytes());
        prop_assert_eq!(&snapshot(&back), &m);
        prop_assert_eq!(partition_for(&back, 7), partition_for(&events[0], 7));
    }

    /// (b) The same in a batch: each element keeps its own text.
    #[test]
    fn batch_round_trip(models in prop::collection::vec(model(), 1..5)) {
        let texts: Vec<String> = models.iter().map(|m| render(m, &[], &[" "])).collect();
        let body = format!("[{}]", texts.join(",\n"));
        let events = parse_publish(Some(BATCH), &[], body.as_bytes(), &Limits::default()).unwrap();
        prop_assert_eq!(events.len(), models.len());
        for ((e, text), m) in events.iter().zip(&texts).zip(&models) {
            prop_assert_eq!(e.stored(), text.as_bytes());
            prop_assert_eq!(&snapshot(e), m);
        }
    }

    /// (b) Binary in, binary out, binary in again: the same attributes and data, and
    /// the same canonical stored form.
    #[test]
    fn binary_round_trip((m, ct, headers, body) in binary_request()) {
        let first = parse_publish(ct.as_deref(), &headers, &body, &Limits::default())
            .map_err(|e| TestCaseError::fail(format!("{e:?} for {headers:?}")))?
            .remove(0);
        prop_assert_eq!(&snapshot(&first), &m);
        let (out_headers, out_body) = to_binary_mode(&first);
        let out_ct = out_headers
            .iter()
            .find(|(n, _)| n == "content-type")
            .map(|(_, v)| v.as_str());
        prop_assert_eq!(out_ct, ct.as_deref());
        let again = parse_publish(out_ct, &out_headers, &out_body, &Limits::default())
            .unwrap()
            .remove(0);
        prop_assert_eq!(&snapshot(&again), &m);
        prop_assert_eq!(again.stored(), first.stored());
    }

    /// Structured in, binary out, binary in: every attribute survives, extensions as
    /// their canonical strings (the binding carries no types), and the body is the data.
    #[test]
    fn structured_to_binary_keeps_attributes(m in model()) {
        let text = render(&m, &[], &[""]);
        let e = parse_publish(Some(CE), &[], text.as_bytes(), &Limits::default()).unwrap().remove(0);
        let (headers, body) = to_binary_mode(&e);
        for (name, value) in &headers {
            prop_assert!(name.starts_with("ce-") || name == "content-type");
            prop_assert!(value.bytes().all(|c| (0x20..=0x7e).contains(&c)), "{:?}", value);
        }
        let ct = headers.iter().find(|(n, _)| n == "content-type").map(|(_, v)| v.as_str());
        let back = parse_publish(ct, &headers, &body, &Limits::default()).unwrap().remove(0);
        let mut expected = m.clone();
        for v in expected.extensions.values_mut() {
            *v = ExtensionValue::String(v.to_canonical_string());
        }
        if matches!(m.data, Some(Data::Json(_))) && m.data_content_type.is_none() {
            expected.data_content_type = Some("application/json".into());
        }
        let mut got = snapshot(&back);
        // The payload's bytes are compared instead: a non-JSON type arrives as base64,
        // and data_base64 of zero bytes is an empty body, so no data.
        got.data = None;
        expected.data = None;
        prop_assert_eq!(got, expected);
        let expected_body: Vec<u8> = match (&m.data, e.data()) {
            (None, _) => Vec::new(),
            (Some(Data::Binary(b)), _) => b.clone(),
            (Some(Data::Json(t)), _)
                if t.starts_with('"')
                    && m.data_content_type.as_deref().is_some_and(|c| !c.contains("json")) =>
            {
                serde_json::from_str::<String>(t).unwrap().into_bytes()
            }
            (Some(Data::Json(_)), Some(EventData::Json(t))) => t.as_bytes().to_vec(),
            other => return Err(TestCaseError::fail(format!("{other:?}"))),
        };
        prop_assert_eq!(body, expected_body);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(5000))]

    /// (c) Partitions are in range and deterministic.
    #[test]
    fn partition_is_bounded_and_deterministic(
        key in prop::collection::vec(any::<u8>(), 0..64),
        partitions in prop_oneof![1u32..=1024, 1u32..=u32::MAX],
    ) {
        let p = partition_for_key(&key, partitions);
        prop_assert!(p < partitions);
        prop_assert_eq!(p, partition_for_key(&key, partitions));
    }

    #[test]
    fn event_partition_uses_partitionkey_else_id(m in model(), partitions in 1u32..=1024) {
        let text = render(&m, &[], &[""]);
        let e = parse_publish(Some(CE), &[], text.as_bytes(), &Limits::default()).unwrap().remove(0);
        let key = m.partition_key.as_deref().unwrap_or(&m.id);
        let p = partition_for(&e, partitions);
        prop_assert!(p < partitions);
        prop_assert_eq!(p, partition_for_key(key.as_bytes(), partitions));
    }
}
