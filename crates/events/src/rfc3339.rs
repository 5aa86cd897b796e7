//! A strict RFC 3339 `date-time` check (section 5.6), without a time library.
//!
//! `YYYY-MM-DDTHH:MM:SS[.fraction](Z|+HH:MM|-HH:MM)`, with `T` and `Z` accepted in lower
//! case as section 5.6 allows. Calendar ranges are checked (month lengths, leap years);
//! second 60 is accepted for leap seconds. Only the shape is checked: the value is
//! stored as published, never reformatted.

/// Whether `s` is an RFC 3339 `date-time`.
pub(crate) fn is_rfc3339(s: &str) -> bool {
    unix_ms(s).is_some()
}

/// The instant `s` names, in milliseconds since the Unix epoch (UTC; negative before
/// 1970; a fraction beyond milliseconds is cut off; second 60 counts as the next
/// minute's 0), or `None` when `s` is not an RFC 3339 `date-time`.
pub(crate) fn unix_ms(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    // Reads `n` ASCII digits at `at` as a number.
    let num = |at: usize, n: usize| -> Option<u32> {
        let digits = b.get(at..at + n)?;
        digits.iter().try_fold(0u32, |acc, &c| {
            c.is_ascii_digit().then(|| acc * 10 + u32::from(c - b'0'))
        })
    };
    let at = |i: usize, c: u8| b.get(i) == Some(&c);
    let check = |ok: bool| ok.then_some(());

    // full-date: 0..10
    let (year, month, day) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    check(at(4, b'-') && at(7, b'-'))?;
    check((1..=12).contains(&month) && day >= 1 && day <= days_in_month(year, month))?;
    check(at(10, b'T') || at(10, b't'))?;
    // partial-time: 11..19
    let (hour, minute, second) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    check(at(13, b':') && at(16, b':') && hour <= 23 && minute <= 59 && second <= 60)?;
    let mut i = 19;
    let mut millis = 0u32;
    if at(i, b'.') {
        let digits = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        check(digits > 0)?;
        // The first three digits, as milliseconds.
        for k in 0..3 {
            let d = if k < digits {
                u32::from(b[i + 1 + k] - b'0')
            } else {
                0
            };
            millis = millis * 10 + d;
        }
        i += 1 + digits;
    }
    // time-offset: local time = UTC + offset.
    let offset_minutes: i64 = match b.get(i) {
        Some(b'Z' | b'z') => {
            check(i + 1 == b.len())?;
            0
        }
        Some(sign @ (b'+' | b'-')) => {
            let (oh, om) = (num(i + 1, 2)?, num(i + 4, 2)?);
            check(at(i + 3, b':') && oh <= 23 && om <= 59 && i + 6 == b.len())?;
            let m = i64::from(oh * 60 + om);
            if *sign == b'-' {
                -m
            } else {
                m
            }
        }
        _ => return None,
    };
    let days = days_from_civil(i64::from(year), month, day);
    let local_s =
        days * 86_400 + i64::from(hour) * 3600 + i64::from(minute) * 60 + i64::from(second);
    Some((local_s - offset_minutes * 60) * 1000 + i64::from(millis))
}

/// Days from 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        2 if year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400)) => {
            29
        }
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

#[cfg(test)]
mod tests {
    use super::{is_rfc3339, unix_ms};

    #[test]
    fn unix_ms_names_the_instant_in_utc() {
        for (text, ms) in [
            ("1970-01-01T00:00:00Z", 0),
            ("1970-01-01T00:00:00.001Z", 1),
            ("1970-01-01T00:00:00.0019Z", 1),
            ("1969-12-31T23:59:59Z", -1000),
            ("2018-04-05T17:31:00Z", 1_522_949_460_000),
            ("2018-04-05T19:31:00+02:00", 1_522_949_460_000),
            ("2018-04-05T12:01:00.5-05:30", 1_522_949_460_500),
            ("2000-02-29T00:00:00Z", 951_782_400_000),
            ("2016-12-31T23:59:60Z", 1_483_228_800_000),
            ("2026-12-04t16:00:00z", 1_796_400_000_000),
        ] {
            assert_eq!(unix_ms(text), Some(ms), "{text}");
        }
        assert_eq!(unix_ms("2018-04-05T17:31:00"), None);
    }

    #[test]
    fn accepts_rfc3339_date_times() {
        for ok in [
            "2018-04-05T17:31:00Z",
            "2018-04-05t17:31:00z",
            "2018-04-05T17:31:00.1Z",
            "2018-04-05T17:31:00.123456789+05:30",
            "2018-04-05T17:31:00-00:00",
            "2000-02-29T00:00:00Z",
            "2016-12-31T23:59:60Z",
            "0000-01-01T00:00:00Z",
            "9999-12-31T23:59:59+23:59",
        ] {
            assert!(is_rfc3339(ok), "{ok}");
        }
    }

    #[test]
    fn rejects_everything_else() {
        for bad in [
            "",
            "2018-04-05",
            "2018-04-05T17:31Z",
            "2018-04-05 17:31:00Z",
            "2018-04-05T17:31:00",
            "2018-04-05T17:31:00.Z",
            "2018-04-05T17:31:00+0530",
            "2018-04-05T17:31:00+05:3",
            "2018-04-05T17:31:00Zjunk",
            "2018-13-05T17:31:00Z",
            "2018-00-05T17:31:00Z",
            "2018-04-31T17:31:00Z",
            "1900-02-29T00:00:00Z",
            "2018-04-05T24:00:00Z",
            "2018-04-05T23:60:00Z",
            "2018-04-05T23:59:61Z",
            "2018-04-05T23:59:59+24:00",
            "18-04-05T17:31:00Z",
            "2018/04/05T17:31:00Z",
            "+018-04-05T17:31:00Z",
            "2018-04-05T17:31:00.5é",
            "２０１８-04-05T17:31:00Z",
        ] {
            assert!(!is_rfc3339(bad), "{bad}");
        }
    }
}
