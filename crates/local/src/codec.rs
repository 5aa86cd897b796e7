//! The framing every Local record shares (embedded Meta, log, offsets, deliveries):
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

pub struct Encoder {
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
        // Records are capped far below 4 GiB by their stores (Meta requests, events).
        let mut s = self.u32(v.len() as u32);
        s.buf.extend_from_slice(v);
        s
    }

    pub fn str(self, v: &str) -> Self {
        self.bytes(v.as_bytes())
    }

    pub fn finish(mut self) -> Vec<u8> {
        let crc = crc32fast::hash(&self.buf);
        self.buf.extend_from_slice(&crc.to_le_bytes());
        self.buf
    }
}

pub struct Decoder<'a> {
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

    pub fn string(&mut self) -> Result<String, DecodeError> {
        String::from_utf8(self.bytes()?).map_err(|_| DecodeError::InvalidField("utf-8 string"))
    }

    pub fn finish(self) -> Result<(), DecodeError> {
        match self.payload.len() - self.pos {
            0 => Ok(()),
            n => Err(DecodeError::Trailing(n)),
        }
    }
}
