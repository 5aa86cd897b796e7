//! `meshd`: the server as a library. [`serve`] runs an instance on a bound listener
//! until a shutdown future completes (what the binary, an embedding program or an
//! in-process test calls); [`server::run`] is the binary's form (binds after recovery,
//! stops at SIGTERM).
//!
//! Boot is a pipeline (house style 11): config → validate → open stores → recover →
//! serve → stop. The runtime it serves is `meshd-runtime`; the HTTP client of the CLI
//! is `meshd-client`. Code that needs the runtime names `meshd_runtime` itself.

mod access;
mod admission;
mod api;
mod browser;
pub mod cli;
pub mod config;
mod console;
mod http;
mod http_metrics;
mod listen;
mod metered;
mod problem;
mod quota;
mod routes;
pub mod server;
mod status;
mod unread;

pub use config::{Config, ServeArgs};
pub use server::serve;

/// Structured logs on stderr, filtered with `RUST_LOG` (default `info`);
/// `MESHD_LOG_FORMAT=json` writes one JSON object per line.
pub fn init_logging() {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if std::env::var("MESHD_LOG_FORMAT").as_deref() == Ok("json") {
        builder.json().init();
    } else {
        builder.init();
    }
}
