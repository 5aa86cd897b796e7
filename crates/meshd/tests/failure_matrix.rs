//! The failure matrix (`docs/state-store-failure-matrix.md`) names the test behind
//! every claim. This test fails when a named test or test file does not exist, so the
//! document cannot drift from the code. A test file (a `.rs` path whose file lives
//! under a `tests/` directory) counts only with the test that shows the claim, as
//! `file.rs::test_function`, and that file must define the function: a bare test file
//! fails, naming the token. Source files (under `src/`) may be named bare. Metric names
//! it gives as the operator's signal must appear in the source too.

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    // At run time: a test binary reused from another checkout's build would name
    // that checkout.
    Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo"))
        .join("../..")
        .canonicalize()
        .expect("workspace root")
}

fn rust_files(dir: &Path, out: &mut Vec<(String, String)>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            out.push((p.to_string_lossy().replace('\\', "/"), text));
        }
    }
}

/// A test function name: lowercase words joined by `_`, long enough not to be a
/// field or a metric label.
fn is_test_name(s: &str) -> bool {
    s.len() >= 20
        && s.contains('_')
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn defines(text: &str, name: &str) -> bool {
    text.contains(&format!("fn {name}("))
        || text.contains(&format!("fn {name}<"))
        || text.contains(&format!("fn {name} ("))
}

#[test]
fn every_test_the_failure_matrix_names_exists() {
    let root = workspace();
    let doc = std::fs::read_to_string(root.join("docs/state-store-failure-matrix.md"))
        .expect("the failure matrix");
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    let root_dir = format!("{}/", root.to_string_lossy().replace('\\', "/"));
    let under_tests = |p: &str| {
        p.strip_prefix(root_dir.as_str())
            .unwrap_or(p)
            .split('/')
            .any(|dir| dir == "tests")
    };
    let mut checked = 0;
    let mut missing = Vec::new();
    for token in doc.split('`').skip(1).step_by(2) {
        // Metric names (the operator's signal) must be rendered somewhere.
        if let Some(metric) = token.strip_prefix("meshd_") {
            let name = format!("meshd_{}", metric.split(['{', ' ']).next().unwrap_or(""));
            if !files.iter().any(|(_, text)| text.contains(&name)) {
                missing.push(format!("{token}: no source renders {name}"));
            }
            continue;
        }
        let (path, name) = match token.rsplit_once("::") {
            Some((p, n)) => (Some(p), n),
            None => (None, token),
        };
        let file = path
            .filter(|p| p.ends_with(".rs"))
            .or_else(|| (token.ends_with(".rs") && !token.contains(' ')).then_some(token));
        let candidates: Vec<&(String, String)> = match file {
            Some(f) => files
                .iter()
                .filter(|(p, _)| p.ends_with(&format!("/{f}")))
                .collect(),
            None => files.iter().collect(),
        };
        if file.is_some() && candidates.is_empty() {
            missing.push(format!("{token}: no file ends with {}", file.unwrap_or("")));
            continue;
        }
        // A test file alone is no evidence: name the test in it.
        if path.is_none() && file.is_some() && candidates.iter().any(|(p, _)| under_tests(p)) {
            missing.push(format!(
                "{token}: names a test file, not a test: write `{token}::<test function>`"
            ));
            continue;
        }
        // `file.rs::name` must define `name` there, whatever it looks like.
        if is_test_name(name) || (path.is_some() && file.is_some()) {
            checked += 1;
            if !candidates.iter().any(|(_, text)| defines(text, name)) {
                missing.push(format!(
                    "{token}: no `fn {name}` in {} file(s)",
                    candidates.len()
                ));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the failure matrix names tests that do not exist, or test files without their test:\n{}",
        missing.join("\n")
    );
    assert!(
        checked >= 40,
        "only {checked} test names found in the matrix: is the parser broken?"
    );
}
