//! The operator CLI: `meshd topic|publish|sub|pull|dlq|task|session`, a client of the
//! public HTTP API (`../shared/design/http-api.md`) and nothing else, so it works
//! against any meshd that keeps that contract, local or remote.
//!
//! Shape: clap parses into the structs of [`args`]; each command calls the typed methods of
//! [`meshd_client::Client`] (through the blocking [`http::Client`]; no request is built
//! here), and prints either an aligned table or, with `--json`, the server's answer
//! exactly as it came (the `*_answer` methods keep it; several answers merged only
//! where one command sends several requests). Failures map to exit codes in
//! [`error`].

mod args;
mod ctx;
mod dlq;
mod error;
mod http;
mod output;
mod subs;
mod tasks;
mod topics;

pub use args::*;
use ctx::Ctx;
use std::process::ExitCode;

/// Runs one client command; errors go to stderr and become the exit code.
pub fn run(cmd: Command) -> ExitCode {
    let result = match cmd {
        Command::Topic(a) => Ctx::new(&a.conn).and_then(|c| topics::topic(&c, a.cmd)),
        Command::Publish(a) => Ctx::new(&a.conn).and_then(|c| topics::publish(&c, a)),
        Command::Sub(a) => Ctx::new(&a.conn).and_then(|c| subs::sub(&c, a.cmd)),
        Command::Pull(a) => Ctx::new(&a.conn).and_then(|c| subs::pull(&c, a)),
        Command::Tail(a) => Ctx::new(&a.conn).and_then(|c| subs::tail(&c, a)),
        Command::Dlq(a) => Ctx::new(&a.conn).and_then(|c| dlq::dlq(&c, a.cmd)),
        Command::Task(a) => Ctx::new(&a.conn).and_then(|c| tasks::task(&c, a.cmd)),
        Command::Session(a) => Ctx::new(&a.conn).and_then(|c| tasks::session(&c, a.cmd)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            output::note(&format!("meshd: {e}"));
            e.exit_code()
        }
    }
}
