//! What a command works with: the connection and the output, from the [`Conn`] flags.

use super::args::Conn;
use super::error::CliError;
use super::http::Client;
use super::output::Out;

/// What a command works with.
pub struct Ctx {
    pub client: Client,
    pub out: Out,
}

impl Ctx {
    pub fn new(conn: &Conn) -> Result<Self, CliError> {
        let token = match &conn.token_file {
            Some(path) => Some(read_token_file(path)?),
            None => conn.token.clone(),
        };
        Ok(Self {
            client: Client::new(&conn.server, token, conn.ca_file.as_deref())?,
            out: Out { json: conn.json },
        })
    }
}

/// The first non-empty line of a token file, trimmed (the file itself is never printed).
fn read_token_file(path: &std::path::Path) -> Result<String, CliError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Usage(format!("--token-file {}: {e}", path.display())))?;
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
        .ok_or_else(|| {
            CliError::Usage(format!(
                "--token-file {}: the file holds no token",
                path.display()
            ))
        })
}
