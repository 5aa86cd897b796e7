//! `h` + revision: every change made at one revision, for watches.

use meshd_local::codec::{DecodeError, Decoder, Encoder};
use meshd_meta::{KeyValue, LeaseId, WatchEvent};

const VERSION: u8 = 1;
const PUT: u8 = 1;
const DELETE: u8 = 2;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistoryRecord {
    pub revision: i64,
    pub events: Vec<WatchEvent>,
}

impl HistoryRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::new(VERSION)
            .i64(self.revision)
            .u32(self.events.len() as u32);
        for ev in &self.events {
            e = match ev {
                WatchEvent::Put(kv) => e
                    .u8(PUT)
                    .bytes(&kv.key)
                    .bytes(&kv.value)
                    .i64(kv.create_revision)
                    .i64(kv.version)
                    .i64(kv.lease.map(|l| l.0).unwrap_or(0)),
                WatchEvent::Delete { key, .. } => e.u8(DELETE).bytes(key),
            };
        }
        e.finish()
    }

    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mut d = Decoder::new(b, VERSION)?;
        let revision = d.i64()?;
        if revision < 1 {
            return Err(DecodeError::InvalidField("revision"));
        }
        let n = d.u32()? as usize;
        let mut events = Vec::with_capacity(n.min(1024));
        for _ in 0..n {
            let ev = match d.u8()? {
                PUT => {
                    let key = d.bytes()?;
                    let value = d.bytes()?;
                    let create_revision = d.i64()?;
                    let version = d.i64()?;
                    let lease = d.i64()?;
                    WatchEvent::Put(KeyValue {
                        key,
                        value,
                        create_revision,
                        mod_revision: revision,
                        version,
                        lease: (lease != 0).then_some(LeaseId(lease)),
                    })
                }
                DELETE => WatchEvent::Delete {
                    key: d.bytes()?,
                    revision,
                },
                _ => return Err(DecodeError::InvalidField("event kind")),
            };
            events.push(ev);
        }
        d.finish()?;
        Ok(Self { revision, events })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshd_local::testing::assert_damage_is_detected;
    use proptest::prelude::*;

    fn event(revision: i64) -> impl Strategy<Value = WatchEvent> {
        prop_oneof![
            (
                proptest::collection::vec(any::<u8>(), 1..16),
                proptest::collection::vec(any::<u8>(), 0..16),
                1i64..100,
                any::<i64>()
            )
                .prop_map(move |(key, value, version, lease)| WatchEvent::Put(
                    KeyValue {
                        key,
                        value,
                        create_revision: revision,
                        mod_revision: revision,
                        version,
                        lease: (lease != 0).then_some(LeaseId(lease)),
                    }
                )),
            proptest::collection::vec(any::<u8>(), 1..16)
                .prop_map(move |key| WatchEvent::Delete { key, revision }),
        ]
    }

    proptest! {
        #[test]
        fn round_trips(events in proptest::collection::vec(event(42), 0..8)) {
            let r = HistoryRecord { revision: 42, events };
            prop_assert_eq!(HistoryRecord::decode(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn damage_is_detected() {
        let r = HistoryRecord {
            revision: 9,
            events: vec![
                WatchEvent::Delete {
                    key: b"a".to_vec(),
                    revision: 9,
                },
                WatchEvent::Put(KeyValue {
                    key: b"b".to_vec(),
                    value: b"c".to_vec(),
                    create_revision: 9,
                    mod_revision: 9,
                    version: 1,
                    lease: None,
                }),
            ],
        };
        assert_damage_is_detected(&r.encode(), HistoryRecord::decode);
    }
}
