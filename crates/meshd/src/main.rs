//! `meshd`: the binary. `meshd serve` runs an instance ([`meshd::server::run`]); every
//! other command is the operator client ([`meshd::cli`]).

use clap::{Parser, Subcommand};
use meshd::{cli, config, server};
use std::process::ExitCode;

/// mimalloc instead of glibc's malloc: glibc's allocator took 14 % of meshd's CPU
/// samples on the single-event publish path (`docs/benchmarks.md`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    meshd::init_logging();
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
