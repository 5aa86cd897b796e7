//! Wall-clock timestamps of records: milliseconds since the Unix epoch, written as
//! RFC 3339 UTC strings with millisecond precision (`2025-01-02T03:04:05.678Z`).
//!
//! Timestamps are informational (history, retention). They never order writes or
//! fence anyone: that is what Meta's revisions are for. The text form is strict (one
//! length, one layout) so a garbled record is reported as corrupt instead of being
//! read as some other instant.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The largest instant the text form can hold: 9999-12-31T23:59:59.999Z.
const MAX_MILLIS: i64 = 253_402_300_799_999;

/// Milliseconds since the Unix epoch, in `0..=9999-12-31T23:59:59.999Z`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

impl Timestamp {
    /// `None` outside the representable range.
    pub fn from_millis(millis: i64) -> Option<Self> {
        (0..=MAX_MILLIS).contains(&millis).then_some(Self(millis))
    }

    pub fn as_millis(self) -> i64 {
        self.0
    }

    /// The current wall-clock time (clamped to the representable range).
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    /// Clamps instants before 1970 to the epoch and after 9999 to the maximum.
    pub fn from_system_time(t: SystemTime) -> Self {
        let millis = match t.duration_since(UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_millis()).unwrap_or(MAX_MILLIS),
            Err(_) => 0,
        };
        Self(millis.clamp(0, MAX_MILLIS))
    }

    /// This instant minus `d`, saturating at the epoch.
    pub fn saturating_sub(self, d: Duration) -> Self {
        let d = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Self(self.0.saturating_sub(d).max(0))
    }

    /// The RFC 3339 form, `YYYY-MM-DDTHH:MM:SS.mmmZ`.
    pub fn to_rfc3339(self) -> String {
        self.to_string()
    }

    /// Parses exactly the form [`to_rfc3339`](Self::to_rfc3339) writes.
    pub fn parse_rfc3339(s: &str) -> Option<Self> {
        let b = s.as_bytes();
        if b.len() != 24 {
            return None;
        }
        let layout_ok = b[4] == b'-'
            && b[7] == b'-'
            && b[10] == b'T'
            && b[13] == b':'
            && b[16] == b':'
            && b[19] == b'.'
            && b[23] == b'Z';
        if !layout_ok {
            return None;
        }
        let num = |from: usize, to: usize| -> Option<i64> {
            let digits = &b[from..to];
            if !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            Some(
                digits
                    .iter()
                    .fold(0i64, |acc, d| acc * 10 + i64::from(d - b'0')),
            )
        };
        let year = num(0, 4)?;
        let month = num(5, 7)?;
        let day = num(8, 10)?;
        let hour = num(11, 13)?;
        let minute = num(14, 16)?;
        let second = num(17, 19)?;
        let milli = num(20, 23)?;
        if !(1..=12).contains(&month)
            || day < 1
            || day > days_in_month(year, month)
            || hour > 23
            || minute > 59
            || second > 59
        {
            return None;
        }
        let days = days_from_civil(year, month, day);
        let millis = ((days * 24 + hour) * 60 + minute) * 60_000 + second * 1000 + milli;
        Self::from_millis(millis)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let days = self.0.div_euclid(86_400_000);
        let rest = self.0.rem_euclid(86_400_000);
        let (year, month, day) = civil_from_days(days);
        let (hour, minute) = (rest / 3_600_000, rest / 60_000 % 60);
        let (second, milli) = (rest / 1000 % 60, rest % 1000);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}.{milli:03}Z"
        )
    }
}

impl serde::Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Timestamp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        Timestamp::parse_rfc3339(&s).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "invalid timestamp {s:?} (expected YYYY-MM-DDTHH:MM:SS.mmmZ)"
            ))
        })
    }
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        _ => 28,
    }
}

// Howard Hinnant's civil-calendar algorithms (proleptic Gregorian, days since
// 1970-01-01). Only years 1970..=9999 reach them.
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn formats_known_instants() {
        assert_eq!(
            Timestamp::from_millis(0).unwrap().to_string(),
            "1970-01-01T00:00:00.000Z"
        );
        assert_eq!(
            Timestamp::from_millis(951_782_400_001).unwrap().to_string(),
            "2000-02-29T00:00:00.001Z"
        );
        assert_eq!(
            Timestamp::from_millis(MAX_MILLIS).unwrap().to_string(),
            "9999-12-31T23:59:59.999Z"
        );
        assert_eq!(Timestamp::from_millis(MAX_MILLIS + 1), None);
        assert_eq!(Timestamp::from_millis(-1), None);
    }

    #[test]
    fn rejects_malformed_text() {
        for bad in [
            "",
            "1970-01-01T00:00:00Z",
            "1970-01-01T00:00:00.000",
            "1970-01-01 00:00:00.000Z",
            "1970-13-01T00:00:00.000Z",
            "1970-02-29T00:00:00.000Z",
            "1900-01-01T00:00:00.000Z",
            "1970-01-01T24:00:00.000Z",
            "1970-01-01T00:60:00.000Z",
            "1970-01-01T00:00:60.000Z",
            "1970-01-01T00:00:00.+00Z",
            "197O-01-01T00:00:00.000Z",
        ] {
            assert_eq!(Timestamp::parse_rfc3339(bad), None, "{bad:?}");
        }
        assert!(Timestamp::parse_rfc3339("2024-02-29T12:00:00.000Z").is_some());
    }

    proptest! {
        #[test]
        fn text_round_trips(millis in 0..=MAX_MILLIS) {
            let t = Timestamp::from_millis(millis).unwrap();
            prop_assert_eq!(Timestamp::parse_rfc3339(&t.to_string()), Some(t));
        }

        #[test]
        fn text_order_is_time_order(a in 0..=MAX_MILLIS, b in 0..=MAX_MILLIS) {
            let (ta, tb) = (Timestamp(a), Timestamp(b));
            prop_assert_eq!(ta.to_string().cmp(&tb.to_string()), ta.cmp(&tb));
        }
    }
}
