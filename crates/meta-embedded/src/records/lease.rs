//! `l` + lease id: a granted lease. Its deadline is not persisted: on open every lease
//! gets its full TTL again (as etcd does after a leader change), so a restart can
//! delay an expiry by at most one TTL and never expires a lease early.

use meshd_local::codec::{DecodeError, Decoder, Encoder};

const VERSION: u8 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseRecord {
    pub ttl_ms: u64,
}

impl LeaseRecord {
    pub fn encode(&self) -> Vec<u8> {
        Encoder::new(VERSION).u64(self.ttl_ms).finish()
    }

    pub fn decode(b: &[u8]) -> Result<Self, DecodeError> {
        let mut d = Decoder::new(b, VERSION)?;
        let r = Self { ttl_ms: d.u64()? };
        d.finish()?;
        if r.ttl_ms == 0 {
            return Err(DecodeError::InvalidField("ttl_ms"));
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
        fn round_trips(ttl_ms in 1u64..) {
            let r = LeaseRecord { ttl_ms };
            prop_assert_eq!(LeaseRecord::decode(&r.encode()), Ok(r));
        }
    }

    #[test]
    fn damage_is_detected() {
        assert_damage_is_detected(&LeaseRecord { ttl_ms: 1500 }.encode(), LeaseRecord::decode);
    }
}
