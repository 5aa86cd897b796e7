//! The switch that turns the RocksDB engine's syncs off in a debug build.

/// The positive control of the power-cut tests: in a **debug build** (tests build meshd
/// so) with `MESHD_TEST_NO_SYNC=1` in its environment, the RocksDB engine's synced
/// writes are plain writes and its WAL syncs do nothing, so everything still reaches
/// the page cache (a SIGKILL alone loses nothing) while a power cut loses what was
/// answered as durable. `tests/power_cut.rs` runs a cut under it and expects the loss
/// to be detected; without that, a green power-cut test could not tell a missing fsync
/// from a present one. A release build (`cfg(not(debug_assertions))`) has no such
/// switch: the function is a constant `false` there. `meshd serve` logs an error at
/// start while it is on.
#[cfg(debug_assertions)]
pub fn no_sync_for_tests() -> bool {
    static NO_SYNC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NO_SYNC.get_or_init(|| std::env::var_os(NO_SYNC_VAR).is_some_and(|v| v == "1"))
}

/// Always `false` in a release build: syncs cannot be switched off.
#[cfg(not(debug_assertions))]
pub const fn no_sync_for_tests() -> bool {
    false
}

/// The environment variable of [`no_sync_for_tests`] (read by debug builds only).
pub const NO_SYNC_VAR: &str = "MESHD_TEST_NO_SYNC";
