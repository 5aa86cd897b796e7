//! `s`: the store's global state, rewritten atomically with every change.

use meshd_local::codec::{DecodeError, Decoder, Encoder};

const VERSION: u8 = 1;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateRecord {
    /// The global revision: the revision of the last change (0 before any).
    pub revision: i64,
    /// The lowest revision whose history is still kept (watches from below it are
    /// compacted).
    pub history_start: i64,
    /// The next lease id to issue (ids are never reused).
    pub next_lease: i64,
}

impl StateRecord {
    pub fn initial() -> Self {
        Self {
            revision: 0,
            history_start: 1,
            next_lease: 1,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        Encoder::new(VERSION)
            .i64(self.revision)
            .i64(self.history_start)
            .i64(self.next_lease)
            .finish()
    }

    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mut d = Decoder::new(b, VERSION)?;
        let r = Self {
            revision: d.i64()?,
            history_start: d.i64()?,
            next_lease: d.i64()?,
        };
        d.finish()?;
        if r.revision < 0 || r.history_start < 1 || r.next_lease < 1 {
            return Err(DecodeError::InvalidField("state counters"));
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshd_local::testing::assert_damage_is_detected;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trips(revision in 0i64.., history_start in 1i64.., next_lease in 1i64..) {
            let r = StateRecord { revision, history_start, next_lease };
            prop_assert_eq!(StateRecord::decode(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn damage_is_detected() {
        let r = StateRecord {
            revision: 7,
            history_start: 3,
            next_lease: 9,
        };
        assert_damage_is_detected(&r.encode(), StateRecord::decode);
    }
}
