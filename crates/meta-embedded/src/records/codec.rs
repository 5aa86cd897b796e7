//! The framing every embedded-Meta record shares:
//! `[format version: u8][payload][crc32 of version and payload: u32 LE]`.
//!
//! Decoding checks the checksum first, then the version, then that the payload is
//! consumed exactly, so a damaged or truncated record is reported as such and never
//! decoded into a wrong value.

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("record truncated")]
    Truncated,
    #[error("checksum mismatch")]
    Checksum,
    #[error("unknown record format version {0}")]
    UnknownVersion(u8),
    #[error("{0} trailing bytes after the record")]
    Trailing(usize),
    #[error("invalid field {0}")]
    InvalidField(&'static str),
}

pub(crate) struct Encoder {
    buf: Vec<u8>,
}

impl Encoder {
    pub fn new(version: u8) -> Self {
        Self { buf: vec![version] }
    }

    pub fn u8(mut self, v: u8) -> Self {
        self.buf.push(v);
        self
    }

    pub fn u32(mut self, v: u32) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn i64(mut self, v: i64) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(mut self, v: u64) -> Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn bytes(self, v: &[u8]) -> Self {
        // Meta values are capped far below 4 GiB (see `max_request_bytes`).
        let mut s = self.u32(v.len() as u32);
        s.buf.extend_from_slice(v);
        s
    }

    pub fn finish(mut self) -> Vec<u8> {
        let crc = crc32fast::hash(&self.buf);
        self.buf.extend_from_slice(&crc.to_le_bytes());
        self.buf
    }
}

pub(crate) struct Decoder<'a> {
    payload: &'a [u8],
    pos: usize,
}

impl<'a> Decoder<'a> {
    /// Verifies framing and checksum; `expected` is the only format version known.
    pub fn new(record: &'a [u8], expected: u8) -> Result<Self, DecodeError> {
        if record.len() < 5 {
            return Err(DecodeError::Truncated);
        }
        let (body, crc) = record.split_at(record.len() - 4);
        let crc = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
        if crc32fast::hash(body) != crc {
            return Err(DecodeError::Checksum);
        }
        if body[0] != expected {
            return Err(DecodeError::UnknownVersion(body[0]));
        }
        Ok(Self {
            payload: &body[1..],
            pos: 0,
        })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self.pos.checked_add(n).ok_or(DecodeError::Truncated)?;
        let s = self
            .payload
            .get(self.pos..end)
            .ok_or(DecodeError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn i64(&mut self) -> Result<i64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(i64::from_le_bytes(a))
    }

    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    pub fn bytes(&mut self) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }

    pub fn finish(self) -> Result<(), DecodeError> {
        match self.payload.len() - self.pos {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::DecodeError;

    /// Every strict prefix and every single-bit flip of `record` must fail to decode
    /// with an error (never decode into some value).
    pub fn assert_damage_is_detected<T: std::fmt::Debug>(
        record: &[u8],
        decode: impl Fn(&[u8]) -> Result<T, DecodeError>,
    ) {
        for len in 0..record.len() {
            assert!(
                decode(&record[..len]).is_err(),
                "truncated to {len} decoded"
            );
        }
        for i in 0..record.len() {
            for bit in 0..8 {
                let mut damaged = record.to_vec();
                damaged[i] ^= 1 << bit;
                assert!(
                    decode(&damaged).is_err(),
                    "flip of bit {bit} in byte {i} decoded"
                );
            }
        }
    }
}
