//! Maps etcd client errors to [`MetaError`]s.
//!
//! The rule: a request is reported `Unavailable` only when it is known not to have
//! been applied (the connection could not be established, or etcd refused it before
//! proposing it: no leader, too many requests, ...). Any other failure of a write
//! (a timeout, a broken connection, an unknown answer) is `Indeterminate`. A read
//! that failed is always `Unavailable`: it never reports "absent".

use meshd_meta::{LeaseId, MetaError};
use std::error::Error as StdError;
use std::io::ErrorKind;

/// Whether a request changes state (its failures may be indeterminate) or only reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Read,
    Write,
}

/// How an attempt on one endpoint failed.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) error: MetaError,
    /// The endpoint itself failed (could not connect, broke, refused for lack of a
    /// leader): the next request should try another endpoint.
    pub(crate) endpoint_failed: bool,
}

/// etcd server messages that mean the request was rejected before it was proposed
/// to raft, so it was not applied and may be sent to another member.
const NOT_APPLIED: &[&str] = &[
    "etcdserver: no leader",
    "etcdserver: not capable",
    "etcdserver: too many requests",
    "etcdserver: mvcc: database space exceeded",
    "etcdserver: unhealthy cluster",
    "etcdserver: not leader",
    "etcdserver: corrupt cluster",
];

/// etcd server messages that reject a malformed request.
const INVALID: &[&str] = &[
    "etcdserver: duplicate key given in txn request",
    "etcdserver: key is not provided",
    "etcdserver: value is provided",
    "etcdserver: too many operations in txn request",
    "etcdserver: request is too large",
    "etcdserver: mvcc: required revision is a future revision",
    "etcdserver: mvcc: required revision has been compacted",
    "etcdserver: too large lease TTL",
];

/// etcd server messages that refuse the credentials (or their absence): nothing
/// was applied, and repeating the request on another member would not help.
const AUTH_REFUSED: &[&str] = &[
    "etcdserver: authentication failed, invalid user ID or password",
    "etcdserver: user name is empty",
    "etcdserver: user name not found",
    "etcdserver: invalid auth token",
    "etcdserver: permission denied",
    "etcdserver: authentication is not enabled",
];

pub(crate) const LEASE_NOT_FOUND: &str = "etcdserver: requested lease not found";
pub(crate) const COMPACTED: &str = "etcdserver: mvcc: required revision has been compacted";

/// Classifies an error of one attempt on `endpoint`. `lease` names the lease the
/// request was about, for `LeaseNotFound`.
pub(crate) fn classify(
    err: &etcd_client::Error,
    kind: Kind,
    lease: Option<LeaseId>,
    endpoint: &str,
) -> Failure {
    use etcd_client::Error as E;
    let ctx = Ctx {
        kind,
        lease,
        endpoint,
    };
    match err {
        E::GRpcStatus(status) => ctx.status(
            Code::from_i32(status.code().into()),
            status.message(),
            StdError::source(status),
        ),
        // Raised while building a channel, before anything is sent.
        E::TransportError(e) => ctx.unavailable(format!("transport error: {}", chain(e)), true),
        E::InvalidArgs(_) | E::InvalidUri(_) | E::InvalidMetadataValue(_) | E::Utf8Error(_) => {
            ctx.invalid(err.to_string())
        }
        E::LeaseKeepAliveError(msg) if msg.contains("lease not found") => ctx.lease_not_found(),
        _ => ctx.unknown_outcome(err.to_string()),
    }
}

struct Ctx<'a> {
    kind: Kind,
    lease: Option<LeaseId>,
    endpoint: &'a str,
}

impl Ctx<'_> {
    /// Classifies a gRPC status: etcd's own answers by their message, connect
    /// failures by the I/O error in the source chain, the rest by code.
    fn status(
        &self,
        code: Code,
        message: &str,
        source: Option<&(dyn StdError + 'static)>,
    ) -> Failure {
        let what = describe_status(code, message, source);
        if message == LEASE_NOT_FOUND {
            return self.lease_not_found();
        }
        if NOT_APPLIED.contains(&message) {
            return self.unavailable(what, true);
        }
        if INVALID.contains(&message) {
            return self.invalid(what);
        }
        if AUTH_REFUSED.contains(&message) {
            return self.auth_refused(what);
        }
        if never_connected(code, source) {
            return self.unavailable(what, true);
        }
        match code {
            Code::InvalidArgument
            | Code::OutOfRange
            | Code::FailedPrecondition
            | Code::AlreadyExists => self.invalid(what),
            // The endpoint does not serve etcd's API (tonic maps an HTTP 404 from a
            // proxy or a wrong port to this): nothing was applied there.
            Code::Unimplemented => self.unavailable(what, true),
            // Authentication or authorization refused: not applied, and the endpoint
            // is fine; the node reports not ready until it is fixed.
            Code::PermissionDenied | Code::Unauthenticated => self.auth_refused(what),
            Code::NotFound if message.contains("lease") => self.lease_not_found(),
            // A timeout, a lost leader, a broken connection, or anything unknown: a
            // write may have been applied.
            _ => self.unknown_outcome(what),
        }
    }

    fn lease_not_found(&self) -> Failure {
        Failure {
            error: MetaError::LeaseNotFound(self.lease.unwrap_or(LeaseId(0))),
            endpoint_failed: false,
        }
    }

    fn unavailable(&self, what: String, endpoint_failed: bool) -> Failure {
        Failure {
            error: MetaError::Unavailable(format!("etcd {}: {what}", self.endpoint)),
            endpoint_failed,
        }
    }

    /// Authentication or authorization refused: not applied, and the endpoint is
    /// fine; the node reports not ready until the credentials (or etcd) are fixed.
    fn auth_refused(&self, what: String) -> Failure {
        self.unavailable(
            format!("etcd authentication refused ({what}); check the etcd user and password"),
            false,
        )
    }

    fn unknown_outcome(&self, what: String) -> Failure {
        let what = format!("etcd {}: {what}", self.endpoint);
        Failure {
            error: match self.kind {
                Kind::Read => MetaError::Unavailable(what),
                Kind::Write => MetaError::Indeterminate(what),
            },
            endpoint_failed: true,
        }
    }

    fn invalid(&self, what: String) -> Failure {
        Failure {
            error: MetaError::InvalidRequest(format!("etcd {}: {what}", self.endpoint)),
            endpoint_failed: false,
        }
    }
}

/// Whether the request failed because no connection could be established: nothing
/// was sent. tonic reports connect failures as `Unavailable` with the connector's
/// error (and the OS error) in the source chain; etcd's own `Unavailable` answers
/// carry an `etcdserver:` message and no I/O error.
fn never_connected(code: Code, mut source: Option<&(dyn StdError + 'static)>) -> bool {
    if code != Code::Unavailable {
        return false;
    }
    while let Some(e) = source {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if is_connect_error(io.kind()) {
                return true;
            }
        }
        source = e.source();
    }
    false
}

/// I/O errors that only a connect attempt produces.
fn is_connect_error(kind: ErrorKind) -> bool {
    matches!(
        kind,
        ErrorKind::ConnectionRefused
            | ErrorKind::TimedOut
            | ErrorKind::AddrNotAvailable
            | ErrorKind::HostUnreachable
            | ErrorKind::NetworkUnreachable
    )
}

fn describe_status(code: Code, message: &str, source: Option<&(dyn StdError + 'static)>) -> String {
    let mut text = format!("{code:?}: {message}");
    if let Some(source) = source {
        let source = chain(source);
        if !message.contains(&source) {
            text.push_str(" (");
            text.push_str(&source);
            text.push(')');
        }
    }
    text
}

/// An error and its sources, joined with ": ", without repeating a message that
/// is already contained in the text.
pub(crate) fn chain(err: &(dyn StdError + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        let s = e.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        source = e.source();
    }
    text
}

/// gRPC status codes (the wire values), so this crate needs no direct tonic
/// dependency to read the code of an etcd-client status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Code {
    Ok,
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    pub(crate) fn from_i32(code: i32) -> Self {
        match code {
            0 => Code::Ok,
            1 => Code::Cancelled,
            3 => Code::InvalidArgument,
            4 => Code::DeadlineExceeded,
            5 => Code::NotFound,
            6 => Code::AlreadyExists,
            7 => Code::PermissionDenied,
            8 => Code::ResourceExhausted,
            9 => Code::FailedPrecondition,
            10 => Code::Aborted,
            11 => Code::OutOfRange,
            12 => Code::Unimplemented,
            13 => Code::Internal,
            14 => Code::Unavailable,
            15 => Code::DataLoss,
            16 => Code::Unauthenticated,
            _ => Code::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with a source, like tonic's connect error wrapping an I/O error.
    #[derive(Debug)]
    struct Wrapped(&'static str, std::io::Error);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl StdError for Wrapped {
        fn source(&self) -> Option<&(dyn StdError + 'static)> {
            Some(&self.1)
        }
    }

    fn ctx(kind: Kind) -> Ctx<'static> {
        Ctx {
            kind,
            lease: Some(LeaseId(7)),
            endpoint: "127.0.0.1:2379",
        }
    }

    fn status(kind: Kind, code: Code, message: &str, source: Option<&Wrapped>) -> Failure {
        ctx(kind).status(
            code,
            message,
            source.map(|s| s as &(dyn StdError + 'static)),
        )
    }

    #[test]
    fn a_refused_connection_is_unavailable_even_for_writes() {
        let refused = Wrapped(
            "tcp connect error",
            std::io::Error::from(ErrorKind::ConnectionRefused),
        );
        for kind in [Kind::Read, Kind::Write] {
            let f = status(kind, Code::Unavailable, "tcp connect error", Some(&refused));
            assert!(matches!(f.error, MetaError::Unavailable(_)), "{f:?}");
            assert!(f.endpoint_failed);
        }
        let timed_out = Wrapped(
            "tcp connect error",
            std::io::Error::from(ErrorKind::TimedOut),
        );
        let f = status(
            Kind::Write,
            Code::Unavailable,
            "tcp connect error",
            Some(&timed_out),
        );
        assert!(matches!(f.error, MetaError::Unavailable(_)), "{f:?}");
    }

    #[test]
    fn a_broken_or_timed_out_write_is_indeterminate_and_a_read_unavailable() {
        for (code, message) in [
            (Code::Unavailable, "etcdserver: request timed out"),
            (Code::Unavailable, "etcdserver: leader changed"),
            (Code::Unavailable, "http2 error: keep-alive timed out"),
            (Code::Cancelled, "operation was canceled: connection closed"),
            (Code::Unknown, "transport error"),
            (Code::DeadlineExceeded, "context deadline exceeded"),
        ] {
            let f = status(Kind::Write, code, message, None);
            assert!(
                matches!(f.error, MetaError::Indeterminate(_)),
                "{message}: {f:?}"
            );
            assert!(f.endpoint_failed);
            let f = status(Kind::Read, code, message, None);
            assert!(
                matches!(f.error, MetaError::Unavailable(_)),
                "{message}: {f:?}"
            );
        }
        // A reset after sending is no connect error.
        let reset = Wrapped(
            "connection error",
            std::io::Error::from(ErrorKind::ConnectionReset),
        );
        let f = status(Kind::Write, Code::Unknown, "connection error", Some(&reset));
        assert!(matches!(f.error, MetaError::Indeterminate(_)), "{f:?}");
    }

    #[test]
    fn etcd_refusals_before_raft_are_unavailable() {
        for message in ["etcdserver: no leader", "etcdserver: too many requests"] {
            let f = status(Kind::Write, Code::Unavailable, message, None);
            assert!(matches!(f.error, MetaError::Unavailable(_)), "{f:?}");
            assert!(f.endpoint_failed);
        }
    }

    #[test]
    fn lease_and_invalid_answers_are_typed() {
        let f = status(Kind::Write, Code::NotFound, LEASE_NOT_FOUND, None);
        assert_eq!(f.error, MetaError::LeaseNotFound(LeaseId(7)));
        assert!(!f.endpoint_failed);
        for message in [
            "etcdserver: duplicate key given in txn request",
            "etcdserver: mvcc: required revision is a future revision",
        ] {
            let f = status(Kind::Write, Code::InvalidArgument, message, None);
            assert!(matches!(f.error, MetaError::InvalidRequest(_)), "{f:?}");
        }
        let f = status(Kind::Read, Code::Unimplemented, "HTTP 404", None);
        assert!(matches!(f.error, MetaError::Unavailable(_)) && f.endpoint_failed);
    }

    #[test]
    fn refused_credentials_are_unavailable_and_say_so() {
        for (code, message) in [
            (
                Code::InvalidArgument,
                "etcdserver: authentication failed, invalid user ID or password",
            ),
            (Code::InvalidArgument, "etcdserver: user name is empty"),
            (Code::Unauthenticated, "etcdserver: invalid auth token"),
            (Code::PermissionDenied, "etcdserver: permission denied"),
        ] {
            for kind in [Kind::Read, Kind::Write] {
                let f = status(kind, code, message, None);
                assert!(
                    matches!(&f.error, MetaError::Unavailable(m) if m.contains("etcd authentication refused")),
                    "{message}: {f:?}"
                );
                assert!(!f.endpoint_failed);
            }
        }
    }

    #[test]
    fn grpc_codes_map_from_wire_values() {
        assert_eq!(Code::from_i32(14), Code::Unavailable);
        assert_eq!(Code::from_i32(5), Code::NotFound);
        assert_eq!(Code::from_i32(99), Code::Unknown);
    }
}
