//! What can go wrong in a CLI command, and the exit code each gets. Scripts branch on
//! the code: 1 the server answered with an error (or a command partly failed), 2 the
//! command line or its input was wrong (nothing was sent for the bad part), 3 the
//! server could not be reached or the connection was lost.

use std::process::ExitCode;

#[derive(Debug)]
pub enum CliError {
    /// Bad usage or bad input (exit 2).
    Usage(String),
    /// The server answered 4xx/5xx (exit 1).
    Api(Problem),
    /// No connection, or it was lost before a full answer (exit 3).
    Unreachable(String),
    /// Anything else that failed: a malformed answer, a partial failure (exit 1).
    Failed(String),
}

impl CliError {
    pub fn exit_code(&self) -> ExitCode {
        ExitCode::from(match self {
            CliError::Usage(_) => 2,
            CliError::Api(_) | CliError::Failed(_) => 1,
            CliError::Unreachable(_) => 3,
        })
    }
}

/// A failed call of the client: a failure to connect, or a connection lost or timed out
/// after the request was sent, is [`CliError::Unreachable`] (the latter says the
/// outcome is unknown, as with a 504).
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

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Usage(m) | CliError::Unreachable(m) | CliError::Failed(m) => f.write_str(m),
            CliError::Api(p) => p.fmt(f),
        }
    }
}

/// The parts of an RFC 9457 answer an operator needs.
#[derive(Debug, Clone)]
pub struct Problem {
    pub status: u16,
    pub detail: String,
    pub field: Option<String>,
    pub retry_after: Option<String>,
    /// What the CLI adds: what this failure means for the command as a whole.
    pub context: Option<String>,
}

impl From<meshd_client::Problem> for Problem {
    fn from(p: meshd_client::Problem) -> Self {
        Self {
            status: p.status,
            detail: p.detail,
            field: p.field,
            retry_after: p.retry_after,
            context: None,
        }
    }
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (HTTP {})", self.detail, self.status)?;
        if let Some(field) = &self.field {
            write!(f, "\nfield: {field}")?;
        }
        if let Some(r) = &self.retry_after {
            write!(f, "\nretry after: {r} s")?;
        }
        if let Some(c) = &self.context {
            write!(f, "\n{c}")?;
        }
        Ok(())
    }
}
