//! Writing results: aligned tables for people, raw JSON for scripts. Every write to
//! stdout goes through [`Out`], so a closed pipe (`meshd dlq list | head`) ends the
//! command quietly instead of panicking the way `println!` does.
//!
//! A command shows a server answer with [`Out::answer`] (with `--json` the answer as it
//! came, otherwise what the command makes of it), and makes a table of what it read
//! with [`Table::of`] and [`cells`], or [`Table::fields`] for one object.

use super::error::CliError;
use meshd_client::Response;
use serde_json::Value;
use std::io::Write;

/// Standard output, line by line, in the form the command line asked for.
pub struct Out {
    /// `--json`: the server's JSON answers (or what the CLI merged of several) instead
    /// of tables and sentences.
    pub json: bool,
}

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

    /// A server answer: with `--json` its body exactly as it came, otherwise what
    /// `show` makes of its JSON (a table, a sentence).
    pub fn answer(
        &self,
        answer: &Response,
        show: impl FnOnce(&Value) -> Result<(), CliError>,
    ) -> Result<(), CliError> {
        if self.json {
            return self.raw(&answer.body);
        }
        show(&answer.json()?)
    }

    /// The sentence that reports a command whose answer has no body (204 No Content);
    /// nothing with `--json`, as that answer printed as it came.
    pub fn done(&self, sentence: &str) -> Result<(), CliError> {
        if self.json {
            return Ok(());
        }
        self.line(sentence)
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
    pub fn assembled(&self, v: &Value) -> Result<(), CliError> {
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

    /// A table with a row for each item.
    pub fn of<T>(
        headers: &[&'static str],
        items: impl IntoIterator<Item = T>,
        row: impl FnMut(T) -> Vec<String>,
    ) -> Self {
        let mut t = Self::new(headers);
        for cells in items.into_iter().map(row) {
            t.row(cells);
        }
        t
    }

    /// `FIELD VALUE` rows: each of `keys` with its cell in `v`.
    pub fn fields(v: &Value, keys: &[&str]) -> Self {
        Self::of(&["FIELD", "VALUE"], keys, |k| {
            vec![k.to_string(), cell(v, &[*k])]
        })
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

/// The cells of `keys` in `v`, one for each (see [`cell`]).
pub fn cells(v: &Value, keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| cell(v, &[k])).collect()
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
    fn tables_of_items_and_of_fields() {
        let v = json!({"id": "t1", "n": 2});
        let rows = [&v, &v];
        let t = Table::of(&["ID", "N"], rows, |r| cells(r, &["id", "n"]));
        assert_eq!(t.render(), "ID  N\nt1  2\nt1  2");
        assert_eq!(
            Table::fields(&v, &["id", "gone"]).render(),
            "FIELD  VALUE\nid     t1\ngone   -"
        );
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
