//! The CLI's connection to meshd: [`meshd_client`]'s transport driven from a
//! current-thread runtime (the CLI does one thing at a time), with its errors mapped to
//! the CLI's exit codes: a failure to connect, or a connection lost or timed out after
//! the request was sent, is [`CliError::Unreachable`] (the latter says the outcome is
//! unknown, as with a 504).

use super::error::{CliError, Problem};
use std::path::Path;

pub use meshd_client::transport::REQUEST_TIMEOUT;
pub use meshd_client::{query, shorten, Method, Request, Response as Answer};

impl From<meshd_client::Error> for CliError {
    fn from(e: meshd_client::Error) -> Self {
        use meshd_client::Error as E;
        match e {
            E::Invalid(m) => CliError::Usage(m),
            E::Unreachable(m) | E::Lost(m) => CliError::Unreachable(m),
            E::Malformed(m) => CliError::Failed(m),
            E::Api(p) => CliError::Api(Problem::from(*p)),
        }
    }
}

/// The client: a current-thread runtime and the API client. Its methods block.
pub struct Client {
    runtime: tokio::runtime::Runtime,
    api: meshd_client::Client,
}

impl Client {
    /// A client of `server` (`http[s]://host[:port][/prefix]`, or `host:port`), with the
    /// bearer `token` when tokens are configured and, for `https://`, the CAs of
    /// `ca_file` (or the system's bundle).
    pub fn new(
        server: &str,
        token: Option<String>,
        ca_file: Option<&Path>,
    ) -> Result<Self, CliError> {
        let target = meshd_client::Target::parse_lenient(server)
            .map_err(|e| CliError::Usage(format!("--server {e}")))?;
        let mut transport = meshd_client::Transport::new()
            .calling("meshd")
            .with_header(
                "user-agent",
                concat!("meshd-cli/", env!("CARGO_PKG_VERSION")),
            )?
            .with_header("accept", "application/json, application/problem+json")?;
        if target.https {
            let tls = meshd_client::tls::connector(ca_file).map_err(|why| {
                CliError::Usage(match ca_file {
                    Some(_) => format!("--ca-file: {why}"),
                    None => format!(
                        "no --ca-file given and the system CA bundle is not usable ({why}); pass --ca-file"
                    ),
                })
            })?;
            transport = transport.with_tls(tls);
        }
        let mut api = meshd_client::Client::new(target, transport);
        if let Some(t) = &token {
            api = api.with_token(t).map_err(|_| {
                CliError::Usage("--token is empty or has control characters".into())
            })?;
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| CliError::Failed(format!("cannot start the async runtime: {e}")))?;
        Ok(Self { runtime, api })
    }

    /// Sends `req` and returns the answer, whatever its status. Only transport
    /// failures are errors.
    pub fn send(&self, req: Request) -> Result<Answer, CliError> {
        Ok(self.runtime.block_on(self.api.send(req))?)
    }

    /// Sends `req`; a 2xx answer is returned, anything else becomes
    /// [`CliError::Api`] with the problem's detail.
    pub fn ok(&self, req: Request) -> Result<Answer, CliError> {
        let answer = self.send(req)?;
        if answer.is_success() {
            Ok(answer)
        } else {
            Err(CliError::Api(Problem::of(&answer)))
        }
    }

    /// Runs `f` with the API client on the CLI's runtime (a stream, read as it
    /// arrives).
    pub fn run<'a, T, F>(&'a self, f: impl FnOnce(&'a meshd_client::Client) -> F) -> T
    where
        F: std::future::Future<Output = T> + 'a,
    {
        self.runtime.block_on(f(&self.api))
    }

    pub fn get(&self, path: String) -> Result<Answer, CliError> {
        self.ok(Request::get(path))
    }
}

/// The body parsed as JSON; `Null` for an empty body (204).
pub fn json(answer: &Answer) -> Result<serde_json::Value, CliError> {
    Ok(answer.json()?)
}
