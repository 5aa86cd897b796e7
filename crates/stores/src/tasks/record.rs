//! The task record: the value of `meshd/v1/tasks/{id}`.
//!
//! JSON, versioned by a `"v"` field (this module writes and reads `1`):
//!
//! ```json
//! {"v":1,"id":"t-1","agent":"summarizer","state":"working",
//!  "input":{...},"output":{...},
//!  "history":[{"state":"submitted","at":"2025-01-02T03:04:05.678Z"},
//!             {"state":"working","at":"2025-01-02T03:04:06.000Z"}],
//!  "assignee":{"session":"s-1","epoch":42,"client_id":"summarizer",
//!              "session_key":"meshd/v1/sessions/summarizer"},
//!  "created_at":"2025-01-02T03:04:05.678Z"}
//! ```
//!
//! `output` is absent while the task has none (a present `null` is an output).
//! The task's `version` is not stored: it is the key's Meta `mod_revision`.
//!
//! Decoding is strict about what it knows: a record that is not JSON (truncated,
//! garbled), has another `v`, misses a field, has an id other than its key's, an empty
//! history, a state that is not its last history entry, or a claimed state without an
//! assignee is reported as corrupt, never turned into some other task. A top-level
//! field this release does not know (a newer one wrote it) is kept in the task
//! ([`Kept`]) and written back by every transition.

use super::types::{Assignee, HistoryEntry, Task, TaskState};
use crate::codec::{decode_named, Kept};
use crate::time::Timestamp;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The record version this module writes.
pub const VERSION: u64 = 1;

#[derive(Serialize)]
struct RecordOut<'a> {
    v: u64,
    id: &'a str,
    agent: &'a str,
    state: TaskState,
    input: &'a Value,
    /// Absent when the task has no output (`null` is an output).
    #[serde(skip_serializing_if = "Option::is_none")]
    output: Option<&'a Value>,
    history: Vec<HistoryV1>,
    assignee: Option<AssigneeV1>,
    created_at: Timestamp,
    #[serde(flatten)]
    kept: &'a Kept,
}

#[derive(Deserialize)]
struct RecordV1 {
    #[allow(dead_code)] // checked before this struct is decoded
    v: u64,
    id: String,
    agent: String,
    state: TaskState,
    input: Value,
    #[serde(default, deserialize_with = "present")]
    output: Option<Value>,
    history: Vec<HistoryV1>,
    assignee: Option<AssigneeV1>,
    created_at: Timestamp,
    #[serde(flatten)]
    kept: Kept,
}

#[derive(Serialize, Deserialize)]
struct HistoryV1 {
    state: TaskState,
    at: Timestamp,
}

#[derive(Serialize, Deserialize)]
struct AssigneeV1 {
    session: String,
    epoch: i64,
    client_id: String,
    session_key: String,
}

/// A present field is `Some`, even when it is `null` (serde's `Option` would read
/// `null` as `None`); an absent one is `None` through `#[serde(default)]`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// Encodes a task (its `version` is not part of the record).
pub fn encode(task: &Task) -> Result<Vec<u8>, String> {
    let out = RecordOut {
        v: VERSION,
        id: &task.id,
        agent: &task.agent,
        state: task.state,
        input: &task.input,
        output: task.output.as_ref(),
        history: task
            .history
            .iter()
            .map(|h| HistoryV1 {
                state: h.state,
                at: h.at,
            })
            .collect(),
        assignee: task.assignee.as_ref().map(|a| AssigneeV1 {
            session: a.session.clone(),
            epoch: a.epoch,
            client_id: a.client_id.clone(),
            session_key: a.session_key.clone(),
        }),
        created_at: task.created_at,
        kept: &task.kept,
    };
    serde_json::to_vec(&out).map_err(|e| format!("encoding task {}: {e}", task.id))
}

/// Decodes the record stored under the key of task `key_id`, whose Meta
/// `mod_revision` is `version`. The error is the reason it is corrupt.
pub fn decode(key_id: &str, bytes: &[u8], version: i64) -> Result<Task, String> {
    let r: RecordV1 = decode_named(bytes, VERSION, "task record")?;
    if r.id != key_id {
        return Err(format!(
            "record of task {:?} stored under the key of task {key_id:?}",
            r.id
        ));
    }
    match r.history.last() {
        None => return Err("task record with an empty history".into()),
        Some(last) if last.state != r.state => {
            return Err(format!(
                "task state {} is not its last history entry ({})",
                r.state, last.state
            ))
        }
        Some(_) => {}
    }
    if r.state.is_claimed() && r.assignee.is_none() {
        return Err(format!("task in state {} without an assignee", r.state));
    }
    Ok(Task {
        id: r.id,
        agent: r.agent,
        state: r.state,
        input: r.input,
        output: r.output,
        history: r
            .history
            .into_iter()
            .map(|h| HistoryEntry {
                state: h.state,
                at: h.at,
            })
            .collect(),
        assignee: r.assignee.map(|a| Assignee {
            session: a.session,
            epoch: a.epoch,
            client_id: a.client_id,
            session_key: a.session_key,
        }),
        created_at: r.created_at,
        kept: r.kept,
        version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            // Multiples of 1/8 are exact in binary and in decimal.
            any::<i32>().prop_map(|i| Value::from(f64::from(i) / 8.0)),
            ".{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(".{0,6}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn arb_state() -> impl Strategy<Value = TaskState> {
        proptest::sample::select(TaskState::ALL.to_vec())
    }

    fn arb_time() -> impl Strategy<Value = Timestamp> {
        (0i64..=253_402_300_799_999).prop_map(|m| Timestamp::from_millis(m).unwrap())
    }

    prop_compose! {
        fn arb_task()(
            id in "[A-Za-z0-9._-]{1,40}",
            agent in "[A-Za-z0-9._-]{1,40}",
            input in arb_json(),
            output in proptest::option::of(arb_json()),
            earlier in proptest::collection::vec((arb_state(), arb_time()), 0..5),
            state in arb_state(),
            last_at in arb_time(),
            assignee in proptest::option::of(("[a-f0-9]{1,32}", 1i64..i64::MAX, "[a-z]{1,8}", ".{1,40}")),
            created_at in arb_time(),
            version in 1i64..i64::MAX,
        ) -> Task {
            let mut history: Vec<HistoryEntry> =
                earlier.into_iter().map(|(state, at)| HistoryEntry { state, at }).collect();
            history.push(HistoryEntry { state, at: last_at });
            let assignee = match assignee {
                Some((session, epoch, client_id, session_key)) => Some(Assignee { session, epoch, client_id, session_key }),
                None if state.is_claimed() => Some(Assignee {
                    session: "s".into(), epoch: 1, client_id: agent.clone(), session_key: "k".into(),
                }),
                None => None,
            };
            Task { id, agent, state, input, output, history, assignee, created_at, version, kept: Kept::default() }
        }
    }

    proptest! {
        #[test]
        fn round_trips(task in arb_task()) {
            let bytes = encode(&task).unwrap();
            let back = decode(&task.id, &bytes, task.version).unwrap();
            prop_assert_eq!(back, task);
        }

        #[test]
        fn every_truncation_is_corrupt(task in arb_task(), cut in any::<proptest::sample::Index>()) {
            let bytes = encode(&task).unwrap();
            let cut = cut.index(bytes.len());
            prop_assert!(decode(&task.id, &bytes[..cut], task.version).is_err());
        }
    }

    fn sample() -> Task {
        Task {
            id: "t-1".into(),
            agent: "agent".into(),
            state: TaskState::Working,
            input: serde_json::json!({"q": 1}),
            output: None,
            history: vec![
                HistoryEntry {
                    state: TaskState::Submitted,
                    at: Timestamp::from_millis(1).unwrap(),
                },
                HistoryEntry {
                    state: TaskState::Working,
                    at: Timestamp::from_millis(2).unwrap(),
                },
            ],
            assignee: Some(Assignee {
                session: "s".into(),
                epoch: 7,
                client_id: "agent".into(),
                session_key: "meshd/v1/sessions/agent".into(),
            }),
            created_at: Timestamp::from_millis(1).unwrap(),
            version: 9,
            kept: Kept::default(),
        }
    }

    fn reencode(f: impl FnOnce(&mut serde_json::Map<String, Value>)) -> Vec<u8> {
        let mut v: Value = serde_json::from_slice(&encode(&sample()).unwrap()).unwrap();
        f(v.as_object_mut().unwrap());
        serde_json::to_vec(&v).unwrap()
    }

    #[test]
    fn pinned_format() {
        let bytes = encode(&sample()).unwrap();
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            r#"{"v":1,"id":"t-1","agent":"agent","state":"working","input":{"q":1},"history":[{"state":"submitted","at":"1970-01-01T00:00:00.001Z"},{"state":"working","at":"1970-01-01T00:00:00.002Z"}],"assignee":{"session":"s","epoch":7,"client_id":"agent","session_key":"meshd/v1/sessions/agent"},"created_at":"1970-01-01T00:00:00.001Z"}"#
        );
    }

    #[test]
    fn a_field_a_newer_release_wrote_is_kept_and_written_back() {
        let newer = reencode(|m| {
            m.insert("priority".into(), serde_json::json!({"level": 3}));
        });
        let t = decode("t-1", &newer, 9).expect("an unknown field is not corrupt");
        assert_eq!(t.kept.names().collect::<Vec<_>>(), ["priority"]);
        let mut moved = t.clone();
        moved.state = TaskState::Completed;
        moved.history.push(HistoryEntry {
            state: TaskState::Completed,
            at: Timestamp::from_millis(3).unwrap(),
        });
        let again: Value = serde_json::from_slice(&encode(&moved).unwrap()).unwrap();
        assert_eq!(
            again["priority"],
            serde_json::json!({"level": 3}),
            "{again}"
        );
        assert_eq!(again["state"], "completed");
        // Inside a nested object an unknown field is ignored (and not kept).
        let nested = reencode(|m| {
            m["assignee"]["lease"] = Value::from(1);
        });
        let t = decode("t-1", &nested, 9).expect("ignored");
        assert!(t.kept.is_empty());
    }

    #[test]
    fn a_null_output_is_an_output() {
        // Found by `round_trips`: serde reads a present `null` as `None`.
        let mut t = sample();
        t.output = Some(Value::Null);
        let bytes = encode(&t).unwrap();
        assert_eq!(
            decode(&t.id, &bytes, t.version).unwrap().output,
            Some(Value::Null)
        );
        t.output = None;
        let bytes = encode(&t).unwrap();
        assert!(!String::from_utf8(bytes.clone()).unwrap().contains("output"));
        assert_eq!(decode(&t.id, &bytes, t.version).unwrap().output, None);
    }

    #[test]
    fn every_garbled_structural_byte_is_corrupt() {
        let good = encode(&sample()).unwrap();
        for (i, b) in good.iter().enumerate() {
            if b"{}[]:,\"".contains(b) {
                let mut bad = good.clone();
                bad[i] = b'#';
                assert!(
                    decode("t-1", &bad, 9).is_err(),
                    "byte {i} garbled still decodes: {}",
                    String::from_utf8_lossy(&bad)
                );
            }
        }
    }

    #[test]
    fn unknown_versions_and_inconsistent_records_are_corrupt() {
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "v2",
                reencode(|m| {
                    m.insert("v".into(), Value::from(2));
                }),
            ),
            (
                "no v",
                reencode(|m| {
                    m.remove("v");
                }),
            ),
            (
                "v as string",
                reencode(|m| {
                    m.insert("v".into(), Value::from("1"));
                }),
            ),
            (
                "missing field",
                reencode(|m| {
                    m.remove("agent");
                }),
            ),
            (
                "bad state",
                reencode(|m| {
                    m.insert("state".into(), Value::from("done"));
                }),
            ),
            (
                "state not last in history",
                reencode(|m| {
                    m.insert("state".into(), Value::from("input-required"));
                }),
            ),
            (
                "empty history",
                reencode(|m| {
                    m.insert("history".into(), Value::Array(vec![]));
                }),
            ),
            (
                "claimed without assignee",
                reencode(|m| {
                    m.insert("assignee".into(), Value::Null);
                }),
            ),
            (
                "bad timestamp",
                reencode(|m| {
                    m.insert("created_at".into(), Value::from("yesterday"));
                }),
            ),
            ("not json", b"\x00\x01garbage".to_vec()),
            ("empty", Vec::new()),
        ];
        for (what, bytes) in cases {
            assert!(decode("t-1", &bytes, 9).is_err(), "{what} decoded");
        }
        let err = decode("t-2", &encode(&sample()).unwrap(), 9).unwrap_err();
        assert!(err.contains("t-2"), "{err}");
    }
}
