//! Where requests go: one parser for every URL meshd dials (the CLI's `--server`, a push
//! subscription's `push.url`, a cluster peer's advertised address).

use crate::Error;

/// A parsed `http[s]://host[:port][/path]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The host without IPv6 brackets: what is resolved and what a TLS certificate
    /// must name.
    pub host: String,
    pub port: u16,
    /// The path (and query) of the URL, `""` when it has none. For a server it is a
    /// prefix (a meshd behind a path-routing proxy): see [`Target::prefix`]; for a
    /// webhook it is the request path: see [`Target::request_path`].
    pub path: String,
    /// `https://`: TLS, the certificate checked for `host`.
    pub https: bool,
    /// For messages (errors, logs, dead-letter reasons): `scheme://host:port/path`,
    /// never the query or userinfo, where a webhook URL's credentials
    /// (`?apikey=…`) would sit ([`shown`]).
    pub shown: String,
}

impl Target {
    /// Parses `http://…` or `https://…`; a URL without a scheme is refused.
    pub fn parse(url: &str) -> Result<Self, Error> {
        Self::parse_with(url, false)
    }

    /// Like [`Target::parse`], but `host[:port][/prefix]` without a scheme is taken as
    /// `http://` (the CLI's `--server`).
    pub fn parse_lenient(url: &str) -> Result<Self, Error> {
        Self::parse_with(url, true)
    }

    /// A peer at `host:port` (an IPv6 host in brackets), over TLS when `https`.
    pub fn peer(authority: &str, https: bool) -> Result<Self, Error> {
        let scheme = if https { "https" } else { "http" };
        Self::parse(&format!("{scheme}://{authority}"))
    }

    fn parse_with(url: &str, lenient: bool) -> Result<Self, Error> {
        let s = url.trim();
        let bad = |why: &str| Error::Invalid(format!("{}: {why}", shown(s)));
        let (rest, https) = if let Some(r) = s.strip_prefix("http://") {
            (r, false)
        } else if let Some(r) = s.strip_prefix("https://") {
            (r, true)
        } else if lenient && !s.contains("://") {
            (s, false)
        } else {
            return Err(bad("expected http://host:port or https://host:port"));
        };
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(bad("no host"));
        }
        if authority
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '@')
        {
            return Err(bad("not a host:port"));
        }
        // A port is present unless the authority ends in a host (or an IPv6 literal).
        let (host, port) = match authority.rfind(':') {
            Some(i) if !authority[i..].contains(']') => {
                let port = authority[i + 1..]
                    .parse::<u16>()
                    .map_err(|_| bad("the port is not a number from 0 to 65535"))?;
                (&authority[..i], port)
            }
            _ => (authority, if https { 443 } else { 80 }),
        };
        if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
            return Err(bad("an IPv6 host must be in brackets"));
        }
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("no host"));
        }
        if path.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("the path has whitespace or control characters"));
        }
        Ok(Self {
            host: host.to_string(),
            port,
            path: path.to_string(),
            https,
            shown: shown(s),
        })
    }

    /// `host:port` with an IPv6 host in brackets: the `Host` header.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The path as a prefix for API paths (no trailing slash).
    pub fn prefix(&self) -> &str {
        self.path.trim_end_matches('/')
    }

    /// The path as a request path (`/` when the URL has none).
    pub fn request_path(&self) -> String {
        match self.path.as_str() {
            "" => "/".to_string(),
            p if p.starts_with('?') => format!("/{p}"),
            p => p.to_string(),
        }
    }
}

/// A URL as messages show it: without its query and fragment, and without userinfo
/// (`user:password@`), so a credential in a webhook URL never reaches a log line, a
/// metric or a dead-letter reason. `http://h:9/p?apikey=s` shows as `http://h:9/p`.
pub fn shown(url: &str) -> String {
    let url = url.trim();
    let end = url.find(['?', '#']).unwrap_or(url.len());
    let url = &url[..end];
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let slash = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(slash);
    let authority = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    match scheme {
        Some(scheme) => format!("{scheme}://{authority}{path}"),
        None => format!("{authority}{path}"),
    }
}

/// Splits `host:port` (an IPv6 host in brackets) into the host without brackets and
/// the port; `None` when there is no valid port.
pub fn split_host_port(authority: &str) -> Option<(&str, u16)> {
    let (host, port) = authority.rsplit_once(':')?;
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return None;
    }
    let port = port.parse().ok()?;
    Some((host.trim_start_matches('[').trim_end_matches(']'), port))
}

/// Percent-encodes one path segment or query value: everything but RFC 3986
/// unreserved characters, so no argument can change the request's shape.
pub fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `?k=v&...` from the pairs whose value is present (empty when none is).
pub fn query(pairs: &[(&str, Option<String>)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", segment(v))))
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(t: &Target) -> (&str, u16, &str) {
        (t.host.as_str(), t.port, t.path.as_str())
    }

    #[test]
    fn a_url_is_shown_without_its_query_fragment_or_userinfo() {
        assert_eq!(shown("http://h:9/p?apikey=s3cret"), "http://h:9/p");
        assert_eq!(shown("https://u:pw@h/p#frag"), "https://h/p");
        assert_eq!(shown("http://h?token=x"), "http://h");
        assert_eq!(shown("h:1/mesh"), "h:1/mesh");
        let t = Target::parse("http://127.0.0.1:9/hook?apikey=s3cret").unwrap();
        assert_eq!(t.shown, "http://127.0.0.1:9/hook");
        assert_eq!(
            t.request_path(),
            "/hook?apikey=s3cret",
            "the request keeps it"
        );
        let e = Target::parse("http://u:s3cret@h/x")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cret"), "{e}");
    }

    #[test]
    fn servers_peers_and_webhooks_parse_alike() {
        let t = Target::parse_lenient("http://127.0.0.1:7070").unwrap();
        assert_eq!(hp(&t), ("127.0.0.1", 7070, ""));
        assert_eq!(t.authority(), "127.0.0.1:7070");
        let t = Target::parse_lenient("localhost:1/mesh/").unwrap();
        assert_eq!((hp(&t), t.prefix()), (("localhost", 1, "/mesh/"), "/mesh"));
        assert_eq!(hp(&Target::parse("http://h").unwrap()), ("h", 80, ""));
        assert_eq!(
            Target::parse("http://[::1]").unwrap().authority(),
            "[::1]:80"
        );
        let t = Target::parse("https://[::1]:9/x").unwrap();
        assert_eq!((hp(&t), t.https), (("::1", 9, "/x"), true));
        assert_eq!(Target::parse("https://h").unwrap().port, 443);
        let t = Target::parse("http://127.0.0.1:8080/hook?x=1").unwrap();
        assert_eq!(t.request_path(), "/hook?x=1");
        assert_eq!(Target::parse("http://e.com").unwrap().request_path(), "/");
        assert_eq!(
            Target::parse("http://e.com?a=b").unwrap().request_path(),
            "/?a=b"
        );
        assert_eq!(hp(&Target::peer("[::1]:7", false).unwrap()), ("::1", 7, ""));
        for bad in [
            "ftp://h",
            "http://",
            "http://h:x",
            "http://a b",
            "h:99999",
            "http://:80/",
            "http://u@h/",
            "http://::1:9/",
        ] {
            assert!(
                matches!(Target::parse_lenient(bad), Err(Error::Invalid(_))),
                "{bad}"
            );
        }
        assert!(Target::parse("h:1").is_err(), "a scheme is required");
    }

    #[test]
    fn hosts_and_ports_split_with_ipv6_in_brackets() {
        assert_eq!(split_host_port("127.0.0.1:7070"), Some(("127.0.0.1", 7070)));
        assert_eq!(split_host_port("[::1]:9"), Some(("::1", 9)));
        assert_eq!(split_host_port("h:x"), None);
        assert_eq!(split_host_port("::1:9"), None);
        assert_eq!(split_host_port("h"), None);
    }

    #[test]
    fn segments_cannot_smuggle_anything() {
        assert_eq!(segment("orders.v1_x-y~"), "orders.v1_x-y~");
        assert_eq!(segment("a/b c\r\n?"), "a%2Fb%20c%0D%0A%3F");
        assert_eq!(
            query(&[
                ("a", Some("x y".into())),
                ("b", None),
                ("c", Some("&".into()))
            ]),
            "?a=x%20y&c=%26"
        );
        assert_eq!(query(&[("a", None)]), "");
    }
}
