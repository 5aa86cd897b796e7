//! # Push settings: the webhook, its signing secrets, static headers and bounds
//!
//! HTTP API, Additions, "Push, signed and bounded". Secrets and header values are
//! credentials: the API shows them as [`REDACTED`], and a `PUT` that sends
//! [`REDACTED`] (or omits them) keeps what is stored. That resolution happens inside
//! the store's compare-and-set loop ([`Push::resolve`] against the record it is about
//! to replace), so a concurrent update can never pair one writer's URL with another
//! writer's kept secret from a stale read.

use super::error::SubscriptionError;
use base64::Engine;

/// What the API shows instead of a secret or a header value; sent back, it keeps the
/// stored value.
pub const REDACTED: &str = "***";
/// `max_concurrency` when the request does not say.
pub const DEFAULT_MAX_CONCURRENCY: u32 = 16;
/// Documented ranges.
pub const MAX_CONCURRENCY_RANGE: std::ops::RangeInclusive<u32> = 1..=256;
pub const RATE_PER_S_RANGE: std::ops::RangeInclusive<f64> = 0.1..=100_000.0;
/// Secrets per subscription: one, or two while rotating.
pub const MAX_SECRETS: usize = 2;
/// The prefix of a Standard Webhooks symmetric secret.
pub const SECRET_PREFIX: &str = "whsec_";
/// A secret's key length in bytes: any non-empty key (the contract sets no length;
/// Standard Webhooks recommends 24 to 64 random bytes), bounded like every input.
pub const SECRET_BYTES: std::ops::RangeInclusive<usize> = 1..=1024;
/// Static headers per subscription, and the longest name and value.
pub const MAX_HEADERS: usize = 32;
pub const MAX_HEADER_NAME_LEN: usize = 128;
pub const MAX_HEADER_VALUE_LEN: usize = 4096;
/// Header names meshd sets itself or that would break the request's framing.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "content-type",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
];
const RESERVED_PREFIXES: &[&str] = &["ce-", "webhook-", "meshd-"];

/// Push delivery to a webhook. Its `Debug` shows secrets and header values as
/// [`REDACTED`], so no log line or panic message carries a credential.
#[derive(Clone, PartialEq, Eq)]
pub struct Push {
    pub url: String,
    /// Standard Webhooks secrets (`whsec_<base64 key>`); none: unsigned, binary mode.
    /// `None` only in a request: keep the stored ones (the `PUT` omitted them).
    pub secrets: Option<Vec<String>>,
    /// Static headers sent with every request, in the given order (names lower-cased).
    /// `None` only in a request: keep the stored ones.
    pub headers: Option<Vec<(String, String)>>,
    /// Requests in flight at once (per instance serving the subscription's partitions).
    pub max_concurrency: u32,
    /// Requests started per second; `None`: unlimited.
    pub rate_per_s: Option<Rate>,
}

/// Requests per second, a finite number in [`RATE_PER_S_RANGE`] (so `Eq` holds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate(pub f64);

impl Eq for Rate {}

impl std::fmt::Debug for Push {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let redact = |n: usize| vec![REDACTED; n];
        f.debug_struct("Push")
            .field("url", &self.url)
            .field("secrets", &self.secrets.as_ref().map(|s| redact(s.len())))
            .field(
                "headers",
                &self.headers.as_ref().map(|h| {
                    h.iter()
                        .map(|(k, _)| (k.as_str(), REDACTED))
                        .collect::<Vec<_>>()
                }),
            )
            .field("max_concurrency", &self.max_concurrency)
            .field("rate_per_s", &self.rate_per_s)
            .finish()
    }
}

/// A push URL's origin: scheme, host and port (80 / 443 when not given), lower-cased;
/// what a kept credential is bound to. `None` for what is not an http(s) URL (the
/// URL's own validation names that).
pub fn origin(url: &str) -> Option<(String, String, u16)> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "http" => 80,
        "https" => 443,
        _ => return None,
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = match host_port.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']')?;
            (host, after.strip_prefix(':'))
        }
        None => match host_port.rsplit_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (host_port, None),
        },
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default_port,
    };
    Some((scheme, host.to_ascii_lowercase(), port))
}

/// `scheme://host:port` of an [`origin`], for messages.
fn show_origin(o: &Option<(String, String, u16)>) -> String {
    match o {
        Some((scheme, host, port)) if host.contains(':') => format!("{scheme}://[{host}]:{port}"),
        Some((scheme, host, port)) => format!("{scheme}://{host}:{port}"),
        None => "an unparsable URL".to_string(),
    }
}

impl Push {
    /// A push to `url` with the defaults: unsigned, no headers, 16 at once, no rate.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            secrets: Some(Vec::new()),
            headers: Some(Vec::new()),
            max_concurrency: DEFAULT_MAX_CONCURRENCY,
            rate_per_s: None,
        }
    }

    /// The secrets (none when unsigned or not resolved yet).
    pub fn secrets(&self) -> &[String] {
        self.secrets.as_deref().unwrap_or_default()
    }

    /// The static headers.
    pub fn headers(&self) -> &[(String, String)] {
        self.headers.as_deref().unwrap_or_default()
    }

    /// Replaces [`REDACTED`] markers and omitted lists by what `stored` holds: the
    /// k-th [`REDACTED`] secret stands for the k-th stored secret (so `["whsec_new",
    /// "***"]` rotates in a new secret next to the old one), a [`REDACTED`] header
    /// value for that header's stored value. A marker with nothing stored behind it
    /// is `Invalid`: it would silently drop a credential the caller thinks is kept.
    /// So is a marker while the URL's origin (scheme, host, port) changes: the stored
    /// signing secrets and header values were given for the stored receiver, and a
    /// marker would hand them to another one (http-api.md, "Security rules (third
    /// round)"); the caller sends them again.
    pub fn resolve(&mut self, stored: Option<&Push>) -> Result<(), SubscriptionError> {
        let invalid =
            |field: &'static str, reason: String| Err(SubscriptionError::Invalid { field, reason });
        if let Some(old) = stored {
            let (from, to) = (origin(&old.url), origin(&self.url));
            if from != to {
                let marked = |field: &'static str| {
                    invalid(
                        field,
                        format!(
                            "\"{REDACTED}\" keeps a stored credential only for the same receiver; \
                             this PUT moves the push from {} to {}: send the value again",
                            show_origin(&from),
                            show_origin(&to)
                        ),
                    )
                };
                if self.secrets().iter().any(|s| s == REDACTED) {
                    return marked("push.secrets");
                }
                if self.headers().iter().any(|(_, v)| v == REDACTED) {
                    return marked("push.headers");
                }
            }
        }
        let stored_secrets = stored.map(Push::secrets).unwrap_or_default();
        match &mut self.secrets {
            None => self.secrets = Some(stored_secrets.to_vec()),
            Some(list) => {
                let mut kept = stored_secrets.iter();
                for s in list.iter_mut().filter(|s| *s == REDACTED) {
                    match kept.next() {
                        Some(old) => s.clone_from(old),
                        None => {
                            return invalid(
                                "push.secrets",
                                format!(
                                    "holds more \"{REDACTED}\" entries than the {} stored \
                                     secret(s) they stand for",
                                    stored_secrets.len()
                                ),
                            )
                        }
                    }
                }
            }
        }
        let stored_headers = stored.map(Push::headers).unwrap_or_default();
        match &mut self.headers {
            None => self.headers = Some(stored_headers.to_vec()),
            Some(list) => {
                for (name, value) in list.iter_mut().filter(|(_, v)| v == REDACTED) {
                    match stored_headers.iter().find(|(n, _)| n == name) {
                        Some((_, old)) => value.clone_from(old),
                        None => {
                            return invalid(
                                "push.headers",
                                format!(
                                "{name}: \"{REDACTED}\" keeps a stored value, and none is stored"
                            ),
                            )
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks the settings against their documented ranges (after [`Push::resolve`]:
    /// a marker left is refused like any other bad secret).
    pub fn validate(&self) -> Result<(), SubscriptionError> {
        let invalid =
            |field: &'static str, reason: String| Err(SubscriptionError::Invalid { field, reason });
        let secrets = self.secrets();
        if secrets.len() > MAX_SECRETS {
            return invalid(
                "push.secrets",
                format!(
                    "holds {} secrets, at most {MAX_SECRETS} (two while rotating)",
                    secrets.len()
                ),
            );
        }
        for s in secrets {
            if let Err(e) = secret_key(s) {
                return invalid("push.secrets", e);
            }
        }
        let headers = self.headers();
        if headers.len() > MAX_HEADERS {
            return invalid(
                "push.headers",
                format!("holds {} headers, at most {MAX_HEADERS}", headers.len()),
            );
        }
        for (i, (name, value)) in headers.iter().enumerate() {
            if let Err(e) = header_name(name) {
                return invalid("push.headers", e);
            }
            if headers[..i].iter().any(|(n, _)| n == name) {
                return invalid("push.headers", format!("{name} is given twice"));
            }
            if value.len() > MAX_HEADER_VALUE_LEN
                || !value
                    .bytes()
                    .all(|b| b == b'\t' || (b' '..=b'~').contains(&b) || b >= 0x80)
            {
                return invalid(
                    "push.headers",
                    format!(
                        "the value of {name} must be at most {MAX_HEADER_VALUE_LEN} bytes without \
                         control characters"
                    ),
                );
            }
        }
        if !MAX_CONCURRENCY_RANGE.contains(&self.max_concurrency) {
            return invalid(
                "push.max_concurrency",
                format!("{} is outside 1–256", self.max_concurrency),
            );
        }
        if let Some(Rate(r)) = self.rate_per_s {
            if !r.is_finite() || !RATE_PER_S_RANGE.contains(&r) {
                return invalid("push.rate_per_s", format!("{r} is outside 0.1–100000"));
            }
        }
        Ok(())
    }
}

/// The HMAC key of a `whsec_` secret, or why it is not one.
pub fn secret_key(secret: &str) -> Result<Vec<u8>, String> {
    let Some(b64) = secret.strip_prefix(SECRET_PREFIX) else {
        return Err(format!(
            "a secret is \"{SECRET_PREFIX}\" followed by base64 (a stored secret is kept by \
             sending \"{REDACTED}\")"
        ));
    };
    let key = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("a secret's text after \"{SECRET_PREFIX}\" is not base64: {e}"))?;
    if !SECRET_BYTES.contains(&key.len()) {
        return Err(format!(
            "a secret's key is {} bytes; it must be {} to {} (Standard Webhooks recommends 24 to 64 random bytes)",
            key.len(),
            SECRET_BYTES.start(),
            SECRET_BYTES.end()
        ));
    }
    Ok(key)
}

/// Checks a static header's name (given lower-cased): an HTTP token, not reserved.
fn header_name(name: &str) -> Result<(), String> {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    if name.is_empty() || name.len() > MAX_HEADER_NAME_LEN || !name.bytes().all(token) {
        return Err(format!(
            "{name:?} is not a header name (1–{MAX_HEADER_NAME_LEN} token characters)"
        ));
    }
    let lower = name.to_ascii_lowercase();
    if RESERVED_HEADERS.contains(&lower.as_str())
        || RESERVED_PREFIXES.iter().any(|p| lower.starts_with(p))
    {
        return Err(format!(
            "{name} is set by meshd (host, content-length, content-type, transfer-encoding, \
             connection, upgrade, te, trailer, keep-alive, ce-*, webhook-*, meshd-* are \
             reserved)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
    const OTHER: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

    fn push(secrets: Option<&[&str]>, headers: Option<&[(&str, &str)]>) -> Push {
        Push {
            secrets: secrets.map(|s| s.iter().map(|s| s.to_string()).collect()),
            headers: headers.map(|h| {
                h.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect()
            }),
            ..Push::new("http://hook/x")
        }
    }

    #[test]
    fn origins_compare_scheme_host_and_port_with_default_ports() {
        let o = |u: &str| origin(u);
        assert_eq!(o("http://Hook/x"), o("http://hook:80/y?q=1"));
        assert_eq!(o("https://hook/x"), o("https://user:pw@hook:443"));
        assert_eq!(
            o("http://[::1]:8080/x"),
            Some(("http".into(), "::1".into(), 8080))
        );
        assert_ne!(o("http://hook/x"), o("https://hook/x"));
        assert_ne!(o("http://hook/x"), o("http://hook:8080/x"));
        assert_ne!(o("http://hook/x"), o("http://other/x"));
        assert_eq!(o("ftp://hook/x"), None);
        assert_eq!(o("http://hook:99999/x"), None);
    }

    #[test]
    fn a_redacted_value_is_refused_when_the_url_moves_to_another_origin() {
        let stored = push(Some(&[SECRET]), Some(&[("authorization", "Bearer t")]));
        for url in ["https://hook/x", "http://hook:8080/x", "http://elsewhere/x"] {
            for (mut p, field) in [
                (push(Some(&[REDACTED]), Some(&[])), "push.secrets"),
                (
                    push(Some(&[]), Some(&[("authorization", REDACTED)])),
                    "push.headers",
                ),
            ] {
                p.url = url.to_string();
                let e = p.resolve(Some(&stored)).unwrap_err();
                assert!(
                    matches!(&e, SubscriptionError::Invalid { field: f, .. } if *f == field),
                    "{url}: {e}"
                );
                assert!(e.to_string().contains("http://hook:80"), "{e}");
            }
        }
        // The same origin (another path, the default port spelt out) keeps them.
        let mut p = push(Some(&[REDACTED]), Some(&[("authorization", REDACTED)]));
        p.url = "http://HOOK:80/other?x=1".into();
        p.resolve(Some(&stored)).unwrap();
        assert_eq!(p.secrets(), [SECRET]);
        // Fresh values to the new origin are taken.
        let mut p = push(Some(&[OTHER]), Some(&[("authorization", "Bearer u")]));
        p.url = "http://elsewhere/x".into();
        p.resolve(Some(&stored)).unwrap();
        assert_eq!(p.secrets(), [OTHER]);
    }

    #[test]
    fn redacted_and_omitted_values_keep_what_is_stored() {
        let stored = push(
            Some(&[SECRET]),
            Some(&[("authorization", "Bearer t"), ("x-a", "1")]),
        );
        // Omitted: kept as they are.
        let mut p = push(None, None);
        p.resolve(Some(&stored)).unwrap();
        assert_eq!(p, stored);
        // Rotation: a new secret next to the kept one.
        let mut p = push(
            Some(&[OTHER, REDACTED]),
            Some(&[("authorization", REDACTED)]),
        );
        p.resolve(Some(&stored)).unwrap();
        assert_eq!(p.secrets(), [OTHER, SECRET]);
        assert_eq!(
            p.headers(),
            [("authorization".to_string(), "Bearer t".to_string())]
        );
        p.validate().unwrap();
        // Empty lists remove them.
        let mut p = push(Some(&[]), Some(&[]));
        p.resolve(Some(&stored)).unwrap();
        assert!(p.secrets().is_empty() && p.headers().is_empty());
        // A marker with nothing behind it is refused, never dropped.
        let e = push(Some(&[REDACTED, REDACTED]), None)
            .resolve(Some(&stored))
            .unwrap_err();
        assert!(
            matches!(
                e,
                SubscriptionError::Invalid {
                    field: "push.secrets",
                    ..
                }
            ),
            "{e}"
        );
        let e = push(None, Some(&[("x-b", REDACTED)]))
            .resolve(Some(&stored))
            .unwrap_err();
        assert!(
            matches!(
                e,
                SubscriptionError::Invalid {
                    field: "push.headers",
                    ..
                }
            ),
            "{e}"
        );
        let e = push(Some(&[REDACTED]), None).resolve(None).unwrap_err();
        assert!(
            matches!(
                e,
                SubscriptionError::Invalid {
                    field: "push.secrets",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn debug_output_never_shows_a_credential() {
        let p = push(
            Some(&[SECRET]),
            Some(&[("authorization", "Bearer hunter2")]),
        );
        let text = format!("{p:?}");
        assert!(
            !text.contains("C2FVsBQ") && !text.contains("hunter2"),
            "{text}"
        );
        assert!(text.contains("authorization"), "{text}");
    }

    #[test]
    fn bad_settings_are_named() {
        let cases: Vec<(Push, &str)> = vec![
            (
                push(Some(&["C2FVsBQIhrscChlQIMV+b5sSYspob7oD"]), None),
                "push.secrets",
            ),
            (push(Some(&["whsec_not base64!"]), None), "push.secrets"),
            (push(Some(&["whsec_"]), None), "push.secrets"),
            (push(Some(&[SECRET, OTHER, SECRET]), None), "push.secrets"),
            (push(Some(&[REDACTED]), None), "push.secrets"),
            (push(None, Some(&[("host", "x")])), "push.headers"),
            (push(None, Some(&[("content-type", "x")])), "push.headers"),
            (push(None, Some(&[("ce-id", "x")])), "push.headers"),
            (push(None, Some(&[("webhook-id", "x")])), "push.headers"),
            (
                push(None, Some(&[("meshd-delivery-id", "x")])),
                "push.headers",
            ),
            (
                push(None, Some(&[("transfer-encoding", "x")])),
                "push.headers",
            ),
            (push(None, Some(&[("bad name", "x")])), "push.headers"),
            (
                push(None, Some(&[("x-a", "line\r\nbreak")])),
                "push.headers",
            ),
            (
                push(None, Some(&[("x-a", "1"), ("x-a", "2")])),
                "push.headers",
            ),
            (
                Push {
                    max_concurrency: 0,
                    ..Push::new("http://h/")
                },
                "push.max_concurrency",
            ),
            (
                Push {
                    max_concurrency: 257,
                    ..Push::new("http://h/")
                },
                "push.max_concurrency",
            ),
            (
                Push {
                    rate_per_s: Some(Rate(0.05)),
                    ..Push::new("http://h/")
                },
                "push.rate_per_s",
            ),
            (
                Push {
                    rate_per_s: Some(Rate(f64::NAN)),
                    ..Push::new("http://h/")
                },
                "push.rate_per_s",
            ),
            (
                Push {
                    rate_per_s: Some(Rate(100_001.0)),
                    ..Push::new("http://h/")
                },
                "push.rate_per_s",
            ),
        ];
        for (p, field) in cases {
            match p.validate() {
                Err(SubscriptionError::Invalid { field: f, .. }) => assert_eq!(f, field, "{p:?}"),
                other => panic!("{p:?}: {other:?}"),
            }
        }
        push(
            Some(&[SECRET, OTHER]),
            Some(&[("authorization", "Bearer x")]),
        )
        .validate()
        .unwrap();
        Push {
            rate_per_s: Some(Rate(0.1)),
            max_concurrency: 256,
            ..Push::new("http://h/")
        }
        .validate()
        .unwrap();
    }
}
