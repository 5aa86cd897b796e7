//! Writing results: aligned tables for people, raw JSON for scripts. Every write to
//! stdout goes through [`Out`], so a closed pipe (`meshd dlq list | head`) ends the
//! command quietly instead of panicking the way `println!` does.

use super::error::CliError;
use serde_json::Value;
use std::io::Write;

/// Standard output, line by line.
pub struct Out;

impl Out {
    pub fn line(&self, s: &str) -> Result<(), CliError> {
        let mut out = std::io::stdout().lock();
        match writeln!(out, "{s}").and_then(|()| out.flush()) {
            Ok(()) => Ok(()),
            // The reader went away: nothing more to say, and not a failure.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
            Err(e) => Err(CliError::Failed(format!("cannot write to stdout: {e}"))),
        }
    }

    /// A server answer's body exactly as it came (the `--json` output).
    /// An empty body (204) prints nothing.
    pub fn raw(&self, body: &[u8]) -> Result<(), CliError> {
        let text = String::from_utf8_lossy(body);
        if text.trim().is_empty() {
            return Ok(());
        }
        self.line(text.trim_end())
    }

    /// A JSON value the CLI assembled (several answers merged).
    pub fn json(&self, v: &Value) -> Result<(), CliError> {
        self.line(&v.to_string())
    }
}

/// A message on stderr (progress, warnings); a failed write there is not worth failing
/// the command for.
pub fn note(s: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{s}");
}

/// An aligned table: a header row and left-aligned columns two spaces apart.
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&'static str]) -> Self {
        Self {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows
            .push(cells.into_iter().map(|c| clean(&c)).collect());
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn render(&self) -> String {
        let cols = self.headers.len();
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate().take(cols) {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        let header: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        for r in std::iter::once(&header).chain(self.rows.iter()) {
            let mut line = String::new();
            for (i, width) in widths.iter().enumerate() {
                let cell = r.get(i).map(String::as_str).unwrap_or("");
                line.push_str(cell);
                if i + 1 < cols {
                    let pad = width.saturating_sub(cell.chars().count()) + 2;
                    line.extend(std::iter::repeat_n(' ', pad));
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out.pop();
        out
    }

    /// Prints the table, or `empty` on stderr when it has no rows.
    pub fn print(&self, out: &Out, empty: &str) -> Result<(), CliError> {
        if self.is_empty() {
            note(empty);
            Ok(())
        } else {
            out.line(&self.render())
        }
    }
}

/// Control characters (a newline in an event type, an escape sequence in a reason)
/// would break the alignment or the terminal: show them escaped.
pub fn clean(s: &str) -> String {
    if s.chars().any(char::is_control) {
        s.chars()
            .flat_map(|c| {
                if c.is_control() {
                    c.escape_default().collect::<Vec<_>>()
                } else {
                    vec![c]
                }
            })
            .collect()
    } else {
        s.to_string()
    }
}

/// A field of a JSON object as a table cell: strings bare, numbers as numbers, absent
/// or null as `-`, anything else as compact JSON. The first present key wins.
pub fn cell(v: &Value, keys: &[&str]) -> String {
    for k in keys {
        match v.get(*k) {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => return s.clone(),
            Some(other) => return other.to_string(),
        }
    }
    "-".to_string()
}

/// The list under `key`, or the first list in the object when `key` is absent (for
/// answers whose exact shape is still being settled).
pub fn list<'a>(v: &'a Value, key: &str) -> Result<&'a Vec<Value>, CliError> {
    if let Some(Value::Array(a)) = v.get(key) {
        return Ok(a);
    }
    if let Value::Array(a) = v {
        return Ok(a);
    }
    v.as_object()
        .and_then(|o| o.values().find_map(Value::as_array))
        .ok_or_else(|| {
            CliError::Failed(format!(
                "the server's answer has no {key:?} list: {}",
                meshd_client::shorten(&v.to_string(), 200)
            ))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tables_align_and_escape() {
        let mut t = Table::new(&["NAME", "PARTITIONS"]);
        t.row(vec!["orders".into(), "3".into()]);
        t.row(vec!["a\nb".into(), "12".into()]);
        assert_eq!(t.render(), "NAME    PARTITIONS\norders  3\na\\nb    12");
    }

    #[test]
    fn cells_and_lists() {
        let v = json!({"a": "x", "b": 3, "c": null, "d": {"k": 1}, "items": [1]});
        assert_eq!(cell(&v, &["a"]), "x");
        assert_eq!(cell(&v, &["c", "b"]), "3");
        assert_eq!(cell(&v, &["d"]), "{\"k\":1}");
        assert_eq!(cell(&v, &["zz"]), "-");
        assert_eq!(list(&v, "items").unwrap().len(), 1);
        assert_eq!(list(&json!({"other": [1, 2]}), "tasks").unwrap().len(), 2);
        assert!(list(&json!({"n": 1}), "tasks").is_err());
    }
}
