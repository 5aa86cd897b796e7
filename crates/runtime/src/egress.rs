//! Where push delivery may connect (http-api.md "Push, signed and bounded", the
//! address rules).
//!
//! The story: a push subscription whose `url` was etcd's v3 gateway
//! (`http://127.0.0.1:2379/v3/kv/put`) and an event whose data was an etcd put request
//! wrote a key into the etcd meshd itself uses; planted `members/` or `owners/` keys
//! would have made the peers send the cluster secret elsewhere. So push never connects
//! to:
//!
//! - meshd's own listen or advertise address, its Meta (etcd) or log (NATS) endpoints:
//!   the same port on the same address, or on any address of this machine when the
//!   endpoint is on this machine (a server listening on `0.0.0.0` answers on every
//!   local address, `127.0.0.2` included);
//! - link-local addresses (169.254.0.0/16, fe80::/10: cloud metadata services);
//! - `--push-deny-cidr` ranges; and, when `--push-allow-cidr` is given, anything
//!   outside those ranges (deny wins over allow).
//!
//! The rules apply to the resolved address at every connect, so a name that resolves
//! to a refused address later (DNS rebinding) is refused then; a URL with a literal
//! refused address is refused at `PUT` already.

use std::net::{IpAddr, SocketAddr};

/// An address range `ip/prefix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    ip: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// `10.0.0.0/8`, `fd00::/8`, or a bare address (a /32 or /128).
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let s = s.trim();
        let (ip, prefix) = match s.split_once('/') {
            Some((ip, p)) => (ip, Some(p)),
            None => (s, None),
        };
        let ip: IpAddr = ip
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse()
            .map_err(|_| format!("{s:?} is not an address range (ip/prefix)"))?;
        let max = if ip.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: the prefix must be 0-{max}"))?,
            None => max,
        };
        Ok(Cidr { ip, prefix })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        match (self.ip, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.ip, self.prefix)
    }
}

/// An IPv4 address in IPv6 clothing (`::ffff:a.b.c.d`) is the IPv4 address.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

/// Whether `ip` is an address of this machine: loopback, unspecified, or one a socket
/// can be bound to (the kernel knows its own addresses).
fn is_local(ip: IpAddr) -> bool {
    let ip = canonical(ip);
    ip.is_loopback()
        || ip.is_unspecified()
        || std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

fn link_local(ip: IpAddr) -> bool {
    match canonical(ip) {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// One of meshd's own endpoints, by what it is (for the refusal's reason).
#[derive(Clone, Debug)]
struct Endpoint {
    what: &'static str,
    addr: SocketAddr,
    /// On this machine: then every local address at that port is it.
    local: bool,
}

/// The rules push connects by (see the module docs).
#[derive(Debug, Default)]
pub struct Egress {
    /// Added as they become known (the listen address only once bound); read at
    /// every connect.
    own: std::sync::RwLock<Vec<Endpoint>>,
    deny: Vec<Cidr>,
    allow: Vec<Cidr>,
}

impl Egress {
    pub fn new(deny: Vec<Cidr>, allow: Vec<Cidr>) -> Self {
        Self {
            own: Default::default(),
            deny,
            allow,
        }
    }

    /// Adds one of meshd's own endpoints (`what`: "meshd's listen address", "Meta
    /// (etcd)", …) at its resolved addresses.
    pub fn add_own(&self, what: &'static str, addrs: impl IntoIterator<Item = SocketAddr>) {
        let mut own = self
            .own
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for addr in addrs {
            own.push(Endpoint {
                what,
                addr,
                local: is_local(addr.ip()),
            });
        }
    }

    /// Resolves `host:port` endpoints (a backend's, meshd's advertise address) and
    /// adds them; one that does not resolve now is logged and left out.
    pub async fn add_own_named(&self, what: &'static str, endpoints: &[String]) {
        for ep in endpoints {
            match tokio::net::lookup_host(ep.as_str()).await {
                Ok(addrs) => self.add_own(what, addrs),
                Err(e) => {
                    tracing::warn!(endpoint = %ep, what, error = %e, "cannot resolve an endpoint push must not target; it is not excluded by address")
                }
            }
        }
    }

    /// `Err(reason)` when push must not connect to `addr`.
    pub fn check(&self, addr: SocketAddr) -> Result<(), String> {
        let ip = canonical(addr.ip());
        let own = self
            .own
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for e in own.iter() {
            if e.addr.port() != addr.port() {
                continue;
            }
            if canonical(e.addr.ip()) == ip || (e.local && is_local(ip)) {
                return Err(format!(
                    "{addr} is {} (push never targets meshd's own services)",
                    e.what
                ));
            }
        }
        if link_local(ip) {
            return Err(format!("{addr} is a link-local address"));
        }
        if let Some(c) = self.deny.iter().find(|c| c.contains(ip)) {
            return Err(format!(
                "{addr} is in a denied range ({c}, --push-deny-cidr)"
            ));
        }
        if !self.allow.is_empty() && !self.allow.iter().any(|c| c.contains(ip)) {
            return Err(format!("{addr} is outside --push-allow-cidr"));
        }
        Ok(())
    }

    /// The check of a URL host that is a literal address (for `PUT`); `Ok` for a name
    /// (checked at every connect instead). A literal is read as the resolver reads it,
    /// so `127.1`, `2130706433` and `0x7f000001` are 127.0.0.1 here too.
    pub fn check_literal(&self, host: &str, port: u16) -> Result<(), String> {
        let ip = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
            .ok()
            .or_else(|| inet_aton(host).map(IpAddr::V4));
        match ip {
            Some(ip) => self.check(SocketAddr::new(ip, port)).map_err(|e| {
                if ip.to_string() == host {
                    e
                } else {
                    format!("{host} is the address {ip}: {e}")
                }
            }),
            None => Ok(()),
        }
    }
}

/// An IPv4 address in any form the C resolver accepts (`inet_aton`): one to four
/// dot-separated numbers, each decimal, octal (a leading `0`) or hexadecimal (`0x`),
/// the last filling the bytes left (`127.1` is 127.0.0.1, `2130706433` too). `None`
/// for anything else, which is then a host name.
pub fn inet_aton(text: &str) -> Option<std::net::Ipv4Addr> {
    let parts: Vec<&str> = text.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let mut numbers = Vec::with_capacity(parts.len());
    for part in &parts {
        let (digits, radix) =
            if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
                (hex, 16)
            } else if part.len() > 1 && part.starts_with('0') {
                (&part[1..], 8)
            } else {
                (*part, 10)
            };
        if digits.is_empty() && radix != 16 {
            return None;
        }
        // `0x` alone is 0 to inet_aton.
        let n = if digits.is_empty() {
            0
        } else {
            if !digits.chars().all(|c| c.is_digit(radix)) {
                return None;
            }
            u64::from_str_radix(digits, radix).ok()?
        };
        numbers.push(n);
    }
    let (last, leading) = numbers.split_last()?;
    if leading.iter().any(|n| *n > 0xff) {
        return None;
    }
    let room = 8 * (4 - leading.len() as u32);
    if *last >= 1u64 << room {
        return None;
    }
    let mut value = *last as u32;
    for (i, n) in leading.iter().enumerate() {
        value |= (*n as u32) << (24 - 8 * i as u32);
    }
    Some(std::net::Ipv4Addr::from(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn ipv4_literals_are_read_as_the_resolver_reads_them() {
        let ip = |s: &str| inet_aton(s).map(|a| a.to_string());
        for (text, want) in [
            ("127.0.0.1", "127.0.0.1"),
            ("127.1", "127.0.0.1"),
            ("127.0.1", "127.0.0.1"),
            ("2130706433", "127.0.0.1"),
            ("0x7f000001", "127.0.0.1"),
            ("0X7F.1", "127.0.0.1"),
            ("0177.0.0.1", "127.0.0.1"),
            ("017700000001", "127.0.0.1"),
            ("169.254.169.254", "169.254.169.254"),
            ("0xa9fea9fe", "169.254.169.254"),
            ("0", "0.0.0.0"),
            ("4294967295", "255.255.255.255"),
        ] {
            assert_eq!(ip(text).as_deref(), Some(want), "{text}");
        }
        for name in [
            "example.com",
            "4294967296",
            "256.1",
            "1.2.3.4.5",
            "08",
            "1..2",
            "",
            "0xg",
            "1.2.3.256",
            "localhost",
        ] {
            assert_eq!(ip(name), None, "{name}");
        }
        let e = Egress::new(vec![], vec![]);
        e.add_own("meshd's listen address", [sa("127.0.0.1:7070")]);
        for host in ["127.1", "2130706433", "0x7f000001"] {
            let err = e.check_literal(host, 7070).unwrap_err();
            assert!(err.contains("127.0.0.1"), "{host}: {err}");
        }
        assert!(e.check_literal("0xa9fea9fe", 80).is_err());
        assert!(e.check_literal("example.com", 7070).is_ok());
    }

    #[test]
    fn ranges_contain_their_addresses() {
        let c = Cidr::parse("10.0.0.0/8").unwrap();
        assert!(c.contains("10.1.2.3".parse().unwrap()));
        assert!(!c.contains("11.0.0.1".parse().unwrap()));
        assert!(c.contains("::ffff:10.9.9.9".parse().unwrap()));
        let c = Cidr::parse("fd00::/8").unwrap();
        assert!(c.contains("fd12::1".parse().unwrap()));
        assert!(!c.contains("fe80::1".parse().unwrap()));
        assert!(Cidr::parse("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
        assert!(Cidr::parse("192.0.2.7")
            .unwrap()
            .contains("192.0.2.7".parse().unwrap()));
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("nope/8").is_err());
    }

    #[test]
    fn own_endpoints_link_local_and_operator_ranges_are_refused() {
        let e = Egress::new(vec![Cidr::parse("192.0.2.0/24").unwrap()], vec![]);
        e.add_own("Meta (etcd)", [sa("127.0.0.1:2379")]);
        e.add_own("meshd's listen address", [sa("0.0.0.0:7070")]);
        // etcd on loopback: any local address at its port is etcd.
        assert!(e.check(sa("127.0.0.1:2379")).unwrap_err().contains("etcd"));
        assert!(e.check(sa("127.0.0.2:2379")).is_err());
        assert!(e.check(sa("[::1]:2379")).is_err());
        assert!(e.check(sa("[::ffff:127.0.0.1]:2379")).is_err());
        assert!(e
            .check(sa("127.0.0.1:7070"))
            .unwrap_err()
            .contains("listen"));
        assert!(e.check(sa("127.0.0.1:8080")).is_ok());
        assert!(e
            .check(sa("169.254.169.254:80"))
            .unwrap_err()
            .contains("link-local"));
        assert!(e.check(sa("[fe80::1]:80")).is_err());
        assert!(e
            .check(sa("192.0.2.10:443"))
            .unwrap_err()
            .contains("--push-deny-cidr"));
        assert!(e.check(sa("198.51.100.1:443")).is_ok());
        // An allow list refuses what is outside it; deny wins inside it.
        let e = Egress::new(
            vec![Cidr::parse("10.1.0.0/16").unwrap()],
            vec![Cidr::parse("10.0.0.0/8").unwrap()],
        );
        assert!(e.check(sa("10.2.0.1:80")).is_ok());
        assert!(e.check(sa("10.1.0.1:80")).is_err());
        assert!(e
            .check(sa("198.51.100.1:80"))
            .unwrap_err()
            .contains("--push-allow-cidr"));
        assert!(e.check_literal("example.com", 80).is_ok());
    }
}
