//! Throwaway etcd processes for tests that need a real etcd: each [`EtcdProcess`] is
//! one single-member etcd on free loopback ports with its own temporary data
//! directory, which a test can kill (`SIGKILL`), restart on the same data, pause
//! (`SIGSTOP`) and resume (`SIGCONT`).
//!
//! [`EtcdProcess::start_with`] can serve clients over TLS (certificates from
//! [`TestCerts`], optionally demanding a client certificate) and shorten the lifetime
//! of etcd's auth tokens; [`EtcdProcess::enable_auth`] then turns on etcd's
//! authentication with a `root` user.
//!
//! etcd must be installed (`/usr/bin/etcd` from Debian's `etcd-server`); when it is not
//! on `PATH`, [`EtcdProcess::start`] fails with instructions. Tests never skip.

use crate::certs::TestCerts;
use crate::process::Proc;
use anyhow::{anyhow, Context};
use std::fs::OpenOptions;
use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// The error [`EtcdProcess::start`] reports when etcd is not installed.
pub const ETCD_NOT_FOUND: &str = "etcd not found on PATH: install Debian's etcd-server \
     (apt-get install etcd-server) or run scripts/test";

/// How long [`EtcdProcess::start`] and [`EtcdProcess::restart`] wait for etcd to serve.
const READY_DEADLINE: Duration = Duration::from_secs(10);
/// How often `start` tries again with fresh ports when etcd fails to come up.
const START_ATTEMPTS: usize = 3;

/// A free TCP port on 127.0.0.1: binds port 0 and releases it. Another process may
/// take it before the caller binds it; callers that spawn servers retry on failure.
pub fn free_port() -> u16 {
    // Binding an ephemeral port on loopback only fails when the machine is out of
    // ports, which no test can recover from.
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("binding 127.0.0.1:0 for a free port");
    listener
        .local_addr()
        .expect("local address of a bound listener")
        .port()
}

/// How [`EtcdProcess::start_with`] runs etcd. The default is what
/// [`EtcdProcess::start`] does: plain HTTP, no authentication, etcd's token TTL.
#[derive(Clone, Debug, Default)]
pub struct EtcdOptions {
    /// Serve clients over TLS (`https://`) with `server_cert`/`server_key`
    /// (`--cert-file`, `--key-file`). Health checks then go to a plain-HTTP metrics
    /// port.
    pub tls: Option<TestCerts>,
    /// With `tls`: also demand a client certificate signed by the test CA
    /// (`--trusted-ca-file`, `--client-cert-auth`).
    pub client_cert_auth: bool,
    /// `--auth-token-ttl`: how long an unused "simple" auth token lives (whole
    /// seconds, at least 1; etcd's default is 300 s). Every use of a token renews it.
    pub auth_token_ttl: Option<Duration>,
    /// `--quota-backend-bytes`: a small quota, to reach etcd's NOSPACE alarm in a test.
    pub quota_backend_bytes: Option<u64>,
}

/// The `root` user [`EtcdProcess::enable_auth`] creates.
pub const ROOT_USER: &str = "root";

/// One etcd server process, owned by a test. Dropping it kills the process and
/// removes its data directory; the process also dies with the test process.
pub struct EtcdProcess {
    /// The process and its log.
    proc: Proc,
    client_port: u16,
    peer_port: u16,
    /// Plain-HTTP `/health` and `/metrics` when clients are served over TLS.
    metrics_port: u16,
    options: EtcdOptions,
    /// The `root` password once [`enable_auth`](Self::enable_auth) succeeded.
    root_password: Option<String>,
    /// `--name`, and `--initial-cluster` when this is a member of an [`EtcdCluster`]
    /// (`None`: a cluster of one).
    name: String,
    initial_cluster: Option<String>,
    data_dir: PathBuf,
    // Declared last: removed after `drop` has killed the process.
    _dir: tempfile::TempDir,
}

impl EtcdProcess {
    /// Starts etcd on free loopback ports (client and peer) with a fresh data
    /// directory and waits (at most ~10 s) until it answers `/health` with
    /// `"health":"true"`. Retries with new ports a few times when etcd fails to come
    /// up (for example because a port was taken in between).
    pub async fn start() -> anyhow::Result<Self> {
        Self::start_with(EtcdOptions::default()).await
    }

    /// [`start`](Self::start) with TLS and token settings from `options`.
    pub async fn start_with(options: EtcdOptions) -> anyhow::Result<Self> {
        if options.client_cert_auth && options.tls.is_none() {
            return Err(anyhow!("EtcdOptions: client_cert_auth needs tls"));
        }
        let binary = etcd_binary()?;
        let mut last_error = None;
        for attempt in 1..=START_ATTEMPTS {
            let dir = tempfile::Builder::new()
                .prefix("meshd-etcd-")
                .tempdir()
                .context("creating the etcd temp dir")?;
            let mut etcd = EtcdProcess {
                proc: Proc::new("etcd", dir.path().join("etcd.log")),
                client_port: free_port(),
                peer_port: free_port(),
                metrics_port: free_port(),
                options: options.clone(),
                root_password: None,
                name: "meshd-test".to_string(),
                initial_cluster: None,
                data_dir: dir.path().join("data"),
                _dir: dir,
            };
            while etcd.client_port == etcd.peer_port
                || etcd.metrics_port == etcd.client_port
                || etcd.metrics_port == etcd.peer_port
            {
                etcd.peer_port = free_port();
                etcd.metrics_port = free_port();
            }
            match etcd.spawn_and_wait(&binary).await {
                Ok(()) => return Ok(etcd),
                Err(e) => {
                    let e = e.context(format!(
                        "etcd start attempt {attempt}/{START_ATTEMPTS} failed; log tail:\n{}",
                        etcd.log_tail(40)
                    ));
                    last_error = Some(e);
                    etcd.kill();
                }
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow!("etcd did not start")))
    }

    /// The client address, `127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// The client URL: `https://127.0.0.1:PORT` when etcd serves TLS, else
    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        let scheme = if self.options.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.endpoint())
    }

    /// The certificates etcd serves TLS with, if it does.
    pub fn tls(&self) -> Option<&TestCerts> {
        self.options.tls.as_ref()
    }

    /// Turns on etcd's authentication: adds the user [`ROOT_USER`] with
    /// `root_password`, grants it the `root` role and enables auth. From then on
    /// every request needs a token (a user and password) or, with
    /// `client_cert_auth`, a client certificate whose common name is a user.
    pub async fn enable_auth(&mut self, root_password: &str) -> anyhow::Result<()> {
        let mut client = self.admin_client().await?;
        client
            .user_add(ROOT_USER, root_password, None)
            .await
            .context("adding the etcd root user")?;
        client
            .user_grant_role(ROOT_USER, "root")
            .await
            .context("granting the root role")?;
        client.auth_enable().await.context("enabling etcd auth")?;
        self.root_password = Some(root_password.to_string());
        Ok(())
    }

    /// A client for test setup and inspection: over TLS (with the client
    /// certificate) when etcd serves TLS, as `root` once auth is enabled.
    pub async fn admin_client(&self) -> anyhow::Result<etcd_client::Client> {
        let mut options =
            etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_secs(2));
        if let Some(certs) = &self.options.tls {
            let read =
                |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
            let mut tls = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(read(&certs.ca)?));
            if self.options.client_cert_auth {
                tls = tls.identity(etcd_client::Identity::from_pem(
                    read(&certs.client_cert)?,
                    read(&certs.client_key)?,
                ));
            }
            options = options.with_tls(tls);
        }
        if let Some(password) = &self.root_password {
            options = options.with_user(ROOT_USER, password.clone());
        }
        let url = self.url();
        tokio::time::timeout(
            Duration::from_secs(5),
            etcd_client::Client::connect([url.as_str()], Some(options)),
        )
        .await
        .with_context(|| format!("connecting to etcd {url} timed out"))?
        .with_context(|| format!("connecting to etcd {url}"))
    }

    /// The client port.
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// Kills etcd if it runs, starts it again on the same data directory and the
    /// same ports, and waits until it serves.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let binary = etcd_binary()?;
        self.spawn_and_wait(&binary).await.with_context(|| {
            format!(
                "restarting etcd on {}; log tail:\n{}",
                self.endpoint(),
                self.log_tail(40)
            )
        })
    }
    async fn spawn_and_wait(&mut self, binary: &Path) -> anyhow::Result<()> {
        self.spawn(binary)?;
        self.wait_ready().await
    }

    fn spawn(&mut self, binary: &Path) -> anyhow::Result<()> {
        let client_url = self.url();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let name = self.name.as_str();
        let initial_cluster = self
            .initial_cluster
            .clone()
            .unwrap_or_else(|| format!("{name}={peer_url}"));
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.proc.log_path())
            .with_context(|| format!("opening {}", self.proc.log_path().display()))?;
        writeln!(
            log,
            "=== meshd test harness: starting etcd on {client_url} (peer {peer_url}) ==="
        )
        .context("writing the etcd log")?;
        let stderr = log.try_clone().context("cloning the etcd log handle")?;

        let mut cmd = Command::new(binary);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("ETCD") {
                cmd.env_remove(key);
            }
        }
        cmd.arg("--name")
            .arg(name)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(initial_cluster)
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--initial-cluster-token")
            .arg("meshd-test")
            .arg("--heartbeat-interval")
            .arg("10")
            .arg("--election-timeout")
            .arg("100");
        // No auto-compaction: etcd with its defaults, as the README runs it, so a
        // history that meshd fails to compact fails a test instead of hiding.
        if let Some(certs) = &self.options.tls {
            cmd.arg("--cert-file")
                .arg(&certs.server_cert)
                .arg("--key-file")
                .arg(&certs.server_key)
                .arg("--listen-metrics-urls")
                .arg(format!("http://127.0.0.1:{}", self.metrics_port));
            if self.options.client_cert_auth {
                cmd.arg("--trusted-ca-file")
                    .arg(&certs.ca)
                    .arg("--client-cert-auth");
            }
        }
        if let Some(ttl) = self.options.auth_token_ttl {
            cmd.arg("--auth-token-ttl")
                .arg(ttl.as_secs().max(1).to_string());
        }
        if let Some(bytes) = self.options.quota_backend_bytes {
            cmd.arg("--quota-backend-bytes").arg(bytes.to_string());
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(stderr));
        self.proc.spawn(cmd).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                anyhow!(ETCD_NOT_FOUND)
            } else {
                anyhow!(e).context(format!("spawning {}", binary.display()))
            }
        })?;
        Ok(())
    }

    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        // Over TLS the client port cannot take the plain-HTTP probe; the metrics
        // listener serves the same `/health`.
        let port = if self.options.tls.is_some() {
            self.metrics_port
        } else {
            self.client_port
        };
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        crate::process::wait_healthy(self.proc.child(), "etcd", addr, READY_DEADLINE, health).await
    }
}

/// A cluster of etcd members on loopback (plain HTTP, etcd's defaults but the short
/// election settings every test etcd has), each an [`EtcdProcess`] a test can kill,
/// restart on its data, pause and resume. A majority keeps it serving; killing the
/// [`leader`](Self::leader) makes the others elect a new one.
pub struct EtcdCluster {
    pub members: Vec<EtcdProcess>,
}

impl EtcdCluster {
    /// Starts `n` members and waits until every one answers `/health` (a leader is
    /// elected). Retries with fresh ports a few times, as [`EtcdProcess::start`] does.
    pub async fn start(n: usize) -> anyhow::Result<Self> {
        let binary = etcd_binary()?;
        let mut last_error = None;
        for attempt in 1..=START_ATTEMPTS {
            let mut members = Vec::new();
            let mut ports = std::collections::BTreeSet::new();
            for i in 0..n {
                let dir = tempfile::Builder::new()
                    .prefix("meshd-etcd-")
                    .tempdir()
                    .context("creating the etcd temp dir")?;
                let mut port = || loop {
                    let p = free_port();
                    if ports.insert(p) {
                        return p;
                    }
                };
                members.push(EtcdProcess {
                    proc: Proc::new("etcd", dir.path().join("etcd.log")),
                    client_port: port(),
                    peer_port: port(),
                    metrics_port: port(),
                    options: EtcdOptions::default(),
                    root_password: None,
                    name: format!("member-{i}"),
                    initial_cluster: None,
                    data_dir: dir.path().join("data"),
                    _dir: dir,
                });
            }
            let initial: Vec<String> = members
                .iter()
                .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
                .collect();
            let mut cluster = Self { members };
            for m in &mut cluster.members {
                m.initial_cluster = Some(initial.join(","));
            }
            let mut started = Ok(());
            for m in &mut cluster.members {
                started = started.and_then(|()| m.spawn(&binary));
            }
            for m in &mut cluster.members {
                if started.is_ok() {
                    started = m.wait_ready().await;
                }
            }
            match started {
                Ok(()) => return Ok(cluster),
                Err(e) => {
                    let tails: Vec<String> =
                        cluster.members.iter().map(|m| m.log_tail(20)).collect();
                    last_error = Some(e.context(format!(
                        "etcd cluster start attempt {attempt}/{START_ATTEMPTS} failed; log tails:\n{}",
                        tails.join("\n---\n")
                    )));
                }
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow!("the etcd cluster did not start")))
    }

    /// Every member's client address, comma-separated (`--meta etcd://...`).
    pub fn endpoints(&self) -> String {
        let list: Vec<String> = self.members.iter().map(|m| m.endpoint()).collect();
        list.join(",")
    }

    /// The index of the member that is the leader now, asked of the members that
    /// answer (`None` when none answers or none knows a leader).
    pub async fn leader(&self) -> Option<usize> {
        for m in &self.members {
            if m.pid().is_none() {
                continue;
            }
            let Ok(mut client) = m.admin_client().await else {
                continue;
            };
            let Ok(Ok(status)) =
                tokio::time::timeout(Duration::from_secs(2), client.status()).await
            else {
                continue;
            };
            let leader = status.leader();
            for (i, other) in self.members.iter().enumerate() {
                let Ok(mut c) = other.admin_client().await else {
                    continue;
                };
                if let Ok(Ok(s)) = tokio::time::timeout(Duration::from_secs(2), c.status()).await {
                    if s.header().map(|h| h.member_id()) == Some(leader) {
                        return Some(i);
                    }
                }
            }
        }
        None
    }

    /// Restarts member `i` (killed or not) on its data and waits until it serves.
    pub async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        self.members[i].restart().await
    }
}

/// A blocking `GET /health` with short timeouts: `Ok` when etcd says it is healthy.
fn health(addr: SocketAddr) -> anyhow::Result<()> {
    crate::process::http_health(addr, "/health", r#""health":"true""#)
}

/// The etcd binary on `PATH`, or the install instructions.
fn etcd_binary() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("etcd"))
        .find(|candidate| is_executable(candidate))
        .ok_or_else(|| anyhow!(ETCD_NOT_FOUND))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The process and its log: `pid`, `kill`, `pause`, `resume`, `signal`, `log_path`,
/// `log_tail` ([`Proc`]).
impl std::ops::Deref for EtcdProcess {
    type Target = Proc;
    fn deref(&self) -> &Proc {
        &self.proc
    }
}

impl std::ops::DerefMut for EtcdProcess {
    fn deref_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn starts_pauses_resumes_kills_and_restarts() {
        let mut etcd = EtcdProcess::start().await.expect("etcd starts");
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, etcd.client_port()));
        let first_pid = etcd.pid().expect("running");
        health(addr).expect("healthy after start");

        etcd.pause();
        assert!(
            tokio::task::spawn_blocking(move || health(addr))
                .await
                .expect("join")
                .is_err(),
            "a paused etcd answers nothing"
        );
        etcd.resume();
        crate::wait::wait_until(
            Duration::from_secs(5),
            "etcd healthy after resume",
            || async { tokio::task::spawn_blocking(move || health(addr)).await? },
        )
        .await
        .expect("healthy after resume");

        etcd.kill();
        etcd.kill();
        assert_eq!(etcd.pid(), None);
        assert!(std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err());

        etcd.restart().await.expect("restarts on the same port");
        assert_ne!(etcd.pid(), Some(first_pid));
        assert_eq!(etcd.endpoint(), format!("127.0.0.1:{}", addr.port()));
        health(addr).expect("healthy after restart");
    }

    #[tokio::test]
    async fn a_three_member_cluster_serves_through_the_loss_of_its_leader() {
        let mut cluster = EtcdCluster::start(3).await.expect("cluster starts");
        assert_eq!(cluster.endpoints().split(',').count(), 3);
        let leader = cluster.leader().await.expect("a leader");
        let other = (leader + 1) % 3;
        let mut client = cluster.members[other].admin_client().await.unwrap();
        client.put("k", "1", None).await.unwrap();

        cluster.members[leader].kill();
        crate::wait::wait_until(Duration::from_secs(10), "a new leader", || async {
            let l = cluster.leader().await;
            anyhow::ensure!(l.is_some() && l != Some(leader), "leader {l:?}");
            Ok(())
        })
        .await
        .unwrap();
        let mut client = cluster.members[other].admin_client().await.unwrap();
        client.put("k", "2", None).await.expect("a majority serves");

        cluster
            .restart(leader)
            .await
            .expect("the old leader rejoins");
        let mut client = cluster.members[leader].admin_client().await.unwrap();
        let got = client.get("k", None).await.expect("a linearizable read");
        assert_eq!(got.kvs()[0].value(), b"2");
    }

    #[tokio::test]
    async fn drop_kills_the_process_and_removes_the_data_dir() {
        let etcd = EtcdProcess::start().await.expect("etcd starts");
        let pid = etcd.pid().expect("running") as libc::pid_t;
        let dir = etcd.log_path().parent().expect("log dir").to_path_buf();
        drop(etcd);
        assert!(!dir.exists(), "the temp dir is removed");
        // SAFETY: signal 0 only checks whether the pid exists.
        let alive = unsafe { libc::kill(pid, 0) } == 0;
        assert!(!alive, "etcd {pid} is gone");
    }
}
