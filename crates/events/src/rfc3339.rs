//! A strict RFC 3339 `date-time` check (section 5.6), without a time library.
//!
//! `YYYY-MM-DDTHH:MM:SS[.fraction](Z|+HH:MM|-HH:MM)`, with `T` and `Z` accepted in lower
//! case as section 5.6 allows. Calendar ranges are checked (month lengths, leap years);
//! second 60 is accepted for leap seconds. Only the shape is checked: the value is
//! stored as published, never reformatted.

/// Whether `s` is an RFC 3339 `date-time`.
pub(crate) fn is_rfc3339(s: &str) -> bool {
    let b = s.as_bytes();
    // Reads `n` ASCII digits at `at` as a number.
    let num = |at: usize, n: usize| -> Option<u32> {
        let digits = b.get(at..at + n)?;
        digits.iter().try_fold(0u32, |acc, &c| {
            c.is_ascii_digit().then(|| acc * 10 + u32::from(c - b'0'))
        })
    };
    let at = |i: usize, c: u8| b.get(i) == Some(&c);

    // full-date: 0..10
    let (Some(year), Some(month), Some(day)) = (num(0, 4), num(5, 2), num(8, 2)) else {
        return false;
    };
    if !at(4, b'-') || !at(7, b'-') {
        return false;
    }
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return false;
    }
    if !(at(10, b'T') || at(10, b't')) {
        return false;
    }
    // partial-time: 11..19
    let (Some(hour), Some(minute), Some(second)) = (num(11, 2), num(14, 2), num(17, 2)) else {
        return false;
    };
    if !at(13, b':') || !at(16, b':') || hour > 23 || minute > 59 || second > 60 {
        return false;
    }
    let mut i = 19;
    if at(i, b'.') {
        let digits = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 {
            return false;
        }
        i += 1 + digits;
    }
    // time-offset
    match b.get(i) {
        Some(b'Z' | b'z') => i + 1 == b.len(),
        Some(b'+' | b'-') => {
            let (Some(oh), Some(om)) = (num(i + 1, 2), num(i + 4, 2)) else {
                return false;
            };
            at(i + 3, b':') && oh <= 23 && om <= 59 && i + 6 == b.len()
        }
        _ => false,
    }
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
    use super::is_rfc3339;

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
