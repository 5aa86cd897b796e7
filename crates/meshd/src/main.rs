//! `meshd`: the event-mesh runtime binary. Boot is a pipeline (house style 11):
//! config → validate → open stores → recover → serve.

mod access;
mod admission;
mod api;
mod browser;
mod cli;
mod cluster;
mod compaction;
mod config;
mod egress;
mod listen;
mod membership;
mod metered;
mod metrics;
mod problem;
mod quota;
mod requeue;
mod runtime;
mod server;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "meshd",
    version,
    about = "meshd: an event mesh with a state plane that does not lie"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up: the size of the serve flags does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run a meshd instance.
    Serve(config::ServeArgs),
    /// The operator client commands (topic, publish, sub, pull, dlq, task, session).
    #[command(flatten)]
    Client(cli::Command),
}

fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse();
    match cli.command {
        Command::Client(cmd) => cli::run(cmd),
        Command::Serve(args) => {
            let config = match config::Config::resolve(args) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("meshd: {e}");
                    return ExitCode::from(2);
                }
            };
            let runtime = match tokio::runtime::Runtime::new() {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("meshd: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match runtime.block_on(server::run(config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("meshd: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

/// Structured logs on stderr, filtered with `RUST_LOG` (default `info`);
/// `MESHD_LOG_FORMAT=json` writes one JSON object per line.
fn init_logging() {
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
