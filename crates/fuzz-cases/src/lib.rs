//! The case count of meshd's fuzz tests (docs/fuzzing.md), read in one place.
//!
//! Every crate's proptest fuzz tests run [`cases`] cases each
//! (`ProptestConfig::with_cases(cases())`). This crate has no dependencies, so any
//! crate can take it as a dev-dependency without pulling anything else in.

/// The environment variable that sets the number of cases per fuzz test.
pub const CASES_VAR: &str = "MESHD_FUZZ_CASES";

/// The number of cases per fuzz test when [`CASES_VAR`] is unset: the CI pass.
pub const DEFAULT_CASES: u32 = 2000;

/// The number of cases each fuzz test runs: [`CASES_VAR`] when it holds a number,
/// else [`DEFAULT_CASES`].
pub fn cases() -> u32 {
    std::env::var(CASES_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES)
}
