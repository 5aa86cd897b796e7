//! `k` + user key: the current state of one key.

use meshd_local::codec::{DecodeError, Decoder, Encoder};
use meshd_meta::{KeyValue, LeaseId};

const VERSION: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyRecord {
    pub value: Vec<u8>,
    pub create_revision: i64,
    pub mod_revision: i64,
    pub version: i64,
    /// 0 when the key has no lease.
    pub lease: i64,
}

impl KeyRecord {
    pub fn encode(&self) -> Vec<u8> {
        Encoder::new(VERSION)
            .i64(self.create_revision)
            .i64(self.mod_revision)
            .i64(self.version)
            .i64(self.lease)
            .bytes(&self.value)
            .finish()
    }

    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mut d = Decoder::new(b, VERSION)?;
        let r = Self {
            create_revision: d.i64()?,
            mod_revision: d.i64()?,
            version: d.i64()?,
            lease: d.i64()?,
            value: d.bytes()?,
        };
        d.finish()?;
        if r.create_revision < 1 || r.mod_revision < r.create_revision || r.version < 1 {
            return Err(DecodeError::InvalidField("revisions"));
        }
        Ok(r)
    }

    pub fn to_kv(&self, key: &[u8]) -> KeyValue {
        KeyValue {
            key: key.to_vec(),
            value: self.value.clone(),
            create_revision: self.create_revision,
            mod_revision: self.mod_revision,
            version: self.version,
            lease: (self.lease != 0).then_some(LeaseId(self.lease)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshd_local::testing::assert_damage_is_detected;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trips(
            value in proptest::collection::vec(any::<u8>(), 0..64),
            create in 1i64..1_000_000,
            delta in 0i64..1_000_000,
            version in 1i64..1_000,
            lease in any::<i64>(),
        ) {
            let r = KeyRecord { value, create_revision: create, mod_revision: create + delta, version, lease };
            prop_assert_eq!(KeyRecord::decode(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn damage_is_detected() {
        let r = KeyRecord {
            value: b"v".to_vec(),
            create_revision: 2,
            mod_revision: 5,
            version: 3,
            lease: 0,
        };
        assert_damage_is_detected(&r.encode(), KeyRecord::decode);
    }
}
