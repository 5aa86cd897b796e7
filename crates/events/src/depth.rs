//! How deeply JSON nests, measured over the raw text without recursion.
//!
//! The failure this guards against: meshd stores an event as published and parses it
//! with `RawValue`, which skips nested values iteratively and so accepts any depth
//! (100 000 arrays deep was a 201). Consumers parse with a depth limit (serde_json's
//! is 128): one 200-deep event then made every pull answer carrying it unreadable,
//! nothing was acked, and the whole batch, its innocent neighbours included, ended
//! in the dead-letter store. So a publish refuses an event nested deeper than
//! [`MAX_JSON_DEPTH`] (http-api.md, "Security rules (third round)"), and every other
//! JSON request body is held to the same bound.
//!
//! **How depth is counted.** Each `[` or `{` opens one level; the outermost array or
//! object of the measured text is level 1 (a scalar is depth 0). For an event the
//! measured text is the event object itself, so `{"data": [[1]]}` is 3 deep and
//! `data` may nest 63 levels. A batch is measured event by event (its own array does
//! not count), and a binary-mode event is measured on its structured form, where the
//! body is the value of `data`: the same event is accepted or refused alike alone, in
//! a batch or in binary mode.

/// The deepest nesting of a JSON request body, or of one event (http-api.md,
/// "Security rules (third round)"): the outermost array or object is level 1.
pub const MAX_JSON_DEPTH: usize = 64;

/// Where JSON text first nests deeper than allowed (see [`nested_deeper_than`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooDeep {
    /// Byte offset of the `[` or `{` that opens the first level beyond the bound.
    pub at: usize,
    /// When the text is an object: the name of its member whose value nests too deep
    /// (decoded; `None` for an array, or a name that does not decode).
    pub member: Option<String>,
}

/// Whether JSON `text` nests deeper than `max` levels (the outermost array or object
/// is level 1), and where. `text` should be valid JSON: the scan follows strings and
/// their escapes but checks no other syntax (invalid text gets some answer, never a
/// panic). Iterative, one pass, no allocation unless too deep: a 100 000-deep text
/// costs no stack.
pub fn nested_deeper_than(text: &[u8], max: usize) -> Option<TooDeep> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    // The last string that ended at level 1 (a member name when a `:` follows), and
    // the member whose value is being read.
    let mut last_string: Option<(usize, usize)> = None;
    let mut string_start = 0usize;
    let mut member: Option<(usize, usize)> = None;
    let mut outer_is_object = false;
    for (i, &b) in text.iter().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
                if depth == 1 {
                    last_string = Some((string_start, i + 1));
                }
            }
            continue;
        }
        match b {
            b'"' => {
                in_string = true;
                string_start = i;
            }
            b'[' | b'{' => {
                if depth == 0 {
                    outer_is_object = b == b'{';
                }
                depth += 1;
                if depth > max {
                    let member = member
                        .filter(|_| outer_is_object)
                        .and_then(|(s, e)| text.get(s..e))
                        .and_then(|quoted| serde_json::from_slice::<String>(quoted).ok());
                    return Some(TooDeep { at: i, member });
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b':' if depth == 1 => member = last_string,
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(levels: usize, inner: &str) -> String {
        format!("{}{inner}{}", "[".repeat(levels), "]".repeat(levels))
    }

    #[test]
    fn the_outermost_array_or_object_is_level_1() {
        assert_eq!(nested_deeper_than(b"1", 0), None);
        assert_eq!(nested_deeper_than(b"\"x\"", 0), None);
        assert!(nested_deeper_than(b"[]", 0).is_some());
        assert_eq!(nested_deeper_than(b"[]", 1), None);
        assert_eq!(nested_deeper_than(b"{\"a\":[{}]}", 3), None);
        assert_eq!(
            nested_deeper_than(b"{\"a\":[{}]}", 2),
            Some(TooDeep {
                at: 6,
                member: Some("a".into())
            })
        );
        let text = nested(64, "1");
        assert_eq!(nested_deeper_than(text.as_bytes(), 64), None);
        let text = nested(65, "1");
        let e = nested_deeper_than(text.as_bytes(), 64).unwrap();
        assert_eq!((e.at, e.member), (64, None));
        // Siblings do not add up: depth is nesting, not count.
        let wide = format!("[{}]", vec!["[[]]"; 1000].join(","));
        assert_eq!(nested_deeper_than(wide.as_bytes(), 3), None);
    }

    #[test]
    fn brackets_inside_strings_and_escapes_do_not_count() {
        let text = br#"{"a":"[[[[{{{{","b\"[[":"\\","c":["\"]]]]"]}"#;
        assert_eq!(nested_deeper_than(text, 2), None);
        assert!(nested_deeper_than(text, 1).is_some());
    }

    #[test]
    fn the_member_named_is_the_one_holding_the_deep_value_with_escapes_decoded() {
        let text = format!(
            r#"{{"id":"[[[[","d\u0061ta":{},"z":1}}"#,
            nested(3, r#"{"k":"v"}"#)
        );
        let e = nested_deeper_than(text.as_bytes(), 4).unwrap();
        assert_eq!(e.member.as_deref(), Some("data"));
        // A value string equal to a name is not taken for one (no `:` follows it).
        let text = r#"{"a":"b","c":[[]]}"#;
        let e = nested_deeper_than(text.as_bytes(), 2).unwrap();
        assert_eq!(e.member.as_deref(), Some("c"));
    }

    #[test]
    fn a_hundred_thousand_levels_cost_no_stack() {
        let text = nested(100_000, "");
        let e = nested_deeper_than(text.as_bytes(), MAX_JSON_DEPTH).unwrap();
        assert_eq!(e.at, MAX_JSON_DEPTH);
        let text = format!("{}1{}", r#"{"a":"#.repeat(100_000), "}".repeat(100_000));
        let e = nested_deeper_than(text.as_bytes(), MAX_JSON_DEPTH).unwrap();
        assert_eq!(e.member.as_deref(), Some("a"));
    }

    #[test]
    fn invalid_text_gets_an_answer_never_a_panic() {
        for text in [
            &b"]]]]"[..],
            b"\"unterminated [[[",
            b"{\"a\\",
            b"\\",
            b"[\xff[",
            b"",
        ] {
            let _ = nested_deeper_than(text, 1);
        }
    }
}
