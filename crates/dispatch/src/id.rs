//! The delivery id: its one format and its one parser.

use std::fmt;

/// A delivery id, `{incarnation}-{partition}-{offset}-{attempt}-{tag:016x}`, with an
/// `r` before the attempt for a redrive. The tag is a MAC over the delivery's fields
/// ([`crate::IdKey::mac`]) or, for a redrive, random: the other fields route an ack to
/// its partition; the tag makes an id unguessable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeliveryId {
    pub incarnation: i64,
    pub partition: u32,
    pub offset: u64,
    pub attempt: u32,
    pub redrive: bool,
    pub tag: u64,
}

impl DeliveryId {
    /// Parses an id as [`fmt::Display`] writes it; `None` for anything else (an id a
    /// client made up is then `unknown`, never a panic).
    pub fn parse(s: &str) -> Option<Self> {
        let mut parts = s.rsplitn(5, '-');
        let tag = parts.next()?;
        let attempt = parts.next()?;
        let offset = parts.next()?;
        let partition = parts.next()?;
        let incarnation = parts.next()?;
        if tag.len() != 16 || !tag.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return None;
        }
        let (redrive, attempt) = match attempt.strip_prefix('r') {
            Some(rest) => (true, rest),
            None => (false, attempt),
        };
        let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
        if !digits(attempt) || !digits(offset) || !digits(partition) {
            return None;
        }
        Some(Self {
            incarnation: incarnation.parse().ok()?,
            partition: partition.parse().ok()?,
            offset: offset.parse().ok()?,
            attempt: attempt.parse().ok()?,
            redrive,
            tag: u64::from_str_radix(tag, 16).ok()?,
        })
    }
}

impl fmt::Display for DeliveryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}-{}-{}-{}{}-{:016x}",
            self.incarnation,
            self.partition,
            self.offset,
            if self.redrive { "r" } else { "" },
            self.attempt,
            self.tag
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_what_it_did_not_write() {
        let id = DeliveryId {
            incarnation: 42,
            partition: 3,
            offset: 17,
            attempt: 2,
            redrive: false,
            tag: 0xff,
        };
        assert_eq!(id.to_string(), "42-3-17-2-00000000000000ff");
        assert_eq!(DeliveryId::parse("42-3-17-2-00000000000000ff"), Some(id));
        let r = DeliveryId {
            redrive: true,
            ..id
        };
        assert_eq!(r.to_string(), "42-3-17-r2-00000000000000ff");
        assert_eq!(DeliveryId::parse(&r.to_string()), Some(r));
        for bad in [
            "",
            "garbage",
            "a-b",
            "42-3-17-2-ff",
            "42-3-17-2-00000000000000FF",
            "42-3-17-x2-00000000000000ff",
            "42-3--2-00000000000000ff",
            "42-+3-17-2-00000000000000ff",
            "x-3-17-2-00000000000000ff",
            "42-3-17-2-acquired",
            "42-4294967296-17-2-00000000000000ff",
        ] {
            assert_eq!(DeliveryId::parse(bad), None, "{bad:?}");
        }
    }
}
