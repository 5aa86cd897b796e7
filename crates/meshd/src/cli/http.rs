//! The CLI's connection to meshd: [`meshd_client::Client`] driven from a
//! current-thread runtime (the CLI does one thing at a time). Its errors become the
//! CLI's exit codes as [`CliError`] says.

use super::error::CliError;
use std::future::Future;
use std::path::Path;

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
        // A batch whose outcome is unknown is sent again by `meshd publish` itself: it
        // notes each retry on stderr and also retries a refused connection.
        let mut api = meshd_client::Client::new(target, transport).with_publish_retries(0);
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

    /// Runs one call of the API client to its end: `client.call(|c| c.topics_answer())`.
    /// A non-2xx answer is [`CliError::Api`] with the problem.
    pub fn call<'a, T, F>(
        &'a self,
        f: impl FnOnce(&'a meshd_client::Client) -> F,
    ) -> Result<T, CliError>
    where
        F: Future<Output = Result<T, meshd_client::Error>>,
    {
        Ok(self.runtime.block_on(f(&self.api))?)
    }

    /// Runs `f` with the API client on the CLI's runtime (a stream, read as it
    /// arrives).
    pub fn run<'a, T, F>(&'a self, f: impl FnOnce(&'a meshd_client::Client) -> F) -> T
    where
        F: Future<Output = T> + 'a,
    {
        self.runtime.block_on(f(&self.api))
    }
}
