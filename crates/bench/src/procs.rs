//! The servers under test, each started by the bench on a free loopback port and a
//! fresh temporary directory, and what the kernel says they cost: CPU seconds from
//! `/proc/PID/stat` (utime + stime) and peak resident memory from `/proc/PID/status`
//! (`VmHWM`). Every measured run gets its own fresh server, so `VmHWM` is the peak of
//! that run (start-up included) and nothing carries over between systems.

use anyhow::{anyhow, bail, Context, Result};
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;

/// CPU time (user + system) a process has used so far, in seconds.
pub fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // The command name (field 2) may contain spaces and parentheses: fields are
    // counted after its closing parenthesis. Field 3 (state) is index 0 there, so
    // utime (field 14) is index 11 and stime (field 15) index 12.
    let rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow!("malformed /proc/{pid}/stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| -> Result<u64> {
        fields
            .get(i)
            .and_then(|f| f.parse().ok())
            .ok_or_else(|| anyhow!("malformed /proc/{pid}/stat (field {})", i + 3))
    };
    let ticks = field(11)? + field(12)?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as f64 } else { 100.0 };
    Ok(ticks as f64 / hz)
}

/// Peak resident set size (`VmHWM`) of a process, in bytes.
pub fn peak_rss_bytes(pid: u32) -> Result<u64> {
    status_kb(pid, "VmHWM:")
}

/// Resident set size now (`VmRSS`) of a process, in bytes.
pub fn rss_bytes(pid: u32) -> Result<u64> {
    status_kb(pid, "VmRSS:")
}

/// A `kB` line of `/proc/{pid}/status`, in bytes.
fn status_kb(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    for line in status.lines() {
        if let Some(v) = line.strip_prefix(field) {
            let kb: u64 = v
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .with_context(|| format!("malformed {field} line {line:?}"))?;
            return Ok(kb * 1024);
        }
    }
    bail!("no {field} in /proc/{pid}/status")
}

fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("binding a free loopback port")?;
    Ok(l.local_addr()?.port())
}

/// A child process that is killed (and reaped) when dropped, with its temp dir.
pub struct Server {
    child: Child,
    pub addr: SocketAddr,
    /// Holds the server's data and config; removed when the server is dropped.
    _dir: TempDir,
    stderr_path: PathBuf,
}

impl Server {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines the server wrote to stderr, for error messages.
    pub fn stderr_tail(&self) -> String {
        tail(&self.stderr_path)
    }

    /// SIGKILL and reap (the cluster scenario's crash); the temp dir stays until drop.
    pub fn kill(&mut self) -> Result<()> {
        self.child
            .kill()
            .with_context(|| format!("SIGKILL of pid {}", self.child.id()))?;
        self.child
            .wait()
            .with_context(|| format!("reaping pid {}", self.child.id()))?;
        Ok(())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn tail(path: &Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Where the meshd binary is: `--meshd`, else `$CARGO_TARGET_DIR/release/meshd`, else
/// `target/release/meshd` under the workspace, else next to this binary.
pub fn locate_meshd(flag: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = flag {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        bail!("--meshd {}: no such file", p.display());
    }
    let mut candidates = Vec::new();
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        candidates.push(PathBuf::from(t).join("release/meshd"));
    }
    // crates/bench -> the workspace root.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    candidates.push(root.join("target/release/meshd"));
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            candidates.push(dir.join("meshd"));
        }
    }
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            anyhow!(
                "no meshd binary (looked at {}); build it with `cargo build --release -p meshd` or pass --meshd PATH",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// Starts `meshd serve --listen 127.0.0.1:0 --data-dir <tmp>` and reads the address
/// from its start-up line `meshd listening on http://ADDR ...`.
pub fn start_meshd(binary: &Path) -> Result<Server> {
    start_meshd_with(binary, &[])
}

/// [`start_meshd`] with extra `serve` flags (cluster mode: `--meta etcd://...`,
/// `--log nats://...`, `--instance-id`, `--lease-ttl-ms`).
pub fn start_meshd_with(binary: &Path, extra: &[String]) -> Result<Server> {
    let dir = tempfile::Builder::new()
        .prefix("meshd-bench-")
        .tempdir()
        .context("creating a temp dir for meshd")?;
    let data = dir.path().join("data");
    spawn_meshd(binary, dir, &data, extra)
}

/// [`start_meshd_with`] on a data dir the caller keeps (a restart on the same data:
/// the recovery scenario); only stderr goes to the server's own temp dir.
pub fn start_meshd_on(binary: &Path, data: &Path, extra: &[String]) -> Result<Server> {
    let dir = tempfile::Builder::new()
        .prefix("meshd-bench-")
        .tempdir()
        .context("creating a temp dir for meshd's stderr")?;
    spawn_meshd(binary, dir, data, extra)
}

fn spawn_meshd(binary: &Path, dir: TempDir, data: &Path, extra: &[String]) -> Result<Server> {
    let stderr_path = dir.path().join("meshd.stderr");
    let stderr = std::fs::File::create(&stderr_path).context("creating meshd's stderr file")?;
    let mut child = Command::new(binary)
        .arg("serve")
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--data-dir")
        .arg(data)
        .args(extra)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(stderr))
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow!("meshd has no stdout pipe"))?;
    // Read the first line on a thread so a silent meshd cannot hang the bench; the
    // thread keeps draining stdout afterwards so meshd never blocks on a full pipe.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let first = reader.read_line(&mut line).map(|_| line);
        let _ = tx.send(first);
        let mut sink = Vec::new();
        let _ = reader.read_to_end(&mut sink);
    });
    let mut server = Server {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        _dir: dir,
        stderr_path,
    };
    let line = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Ok(line)) => line,
        Ok(Err(e)) => bail!("reading meshd's stdout: {e}"),
        Err(_) => bail!(
            "meshd printed no start-up line within 30 s; stderr:\n{}",
            server.stderr_tail()
        ),
    };
    let addr = line
        .strip_prefix("meshd listening on http://")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|a| a.parse::<SocketAddr>().ok())
        .ok_or_else(|| {
            anyhow!(
                "unexpected meshd start-up line {line:?}; stderr:\n{}",
                server.stderr_tail()
            )
        })?;
    server.addr = addr;
    Ok(server)
}

/// JetStream's file-store durability for a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JsSync {
    /// `sync_interval: always`: every ack is fsynced (equal to meshd's promise).
    Always,
    /// nats-server's default: fsync every 2 minutes; acks come from the page cache.
    Default,
}

impl JsSync {
    pub fn label(self) -> &'static str {
        match self {
            JsSync::Always => "fsync every ack (sync_interval: always)",
            JsSync::Default => "relaxed: fsync every 2 min (default sync_interval)",
        }
    }
}

/// nats-server's `max_inflight_per_stream` for atomic batches in the bench (its
/// server-wide default, `max_inflight_total`).
const BATCHES_IN_FLIGHT: usize = 1000;

/// Starts `nats-server -js` with its store in a temp dir.
pub fn start_nats(binary: &Path, sync: JsSync) -> Result<Server> {
    let dir = tempfile::Builder::new()
        .prefix("meshd-bench-nats-")
        .tempdir()
        .context("creating a temp dir for nats-server")?;
    let port = free_port()?;
    let store = dir.path().join("store");
    let sync_line = match sync {
        JsSync::Always => "  sync_interval: always\n",
        JsSync::Default => "",
    };
    // Atomic batches in flight per stream: nats-server allows 50 by default, which 64
    // workers publishing batches at once pass ("atomic publish batch is incomplete");
    // the bench raises it to the server-wide default so every configuration runs.
    let config = format!(
        "# written by meshd-bench\nlisten: 127.0.0.1:{port}\njetstream {{\n  store_dir: {store:?}\n{sync_line}  limits {{ batch {{ max_inflight_per_stream: {BATCHES_IN_FLIGHT} }} }}\n}}\n",
        store = store.display().to_string(),
    );
    let config_path = dir.path().join("nats.conf");
    std::fs::write(&config_path, config).context("writing nats-server's config")?;
    let stderr_path = dir.path().join("nats.stderr");
    let stderr = std::fs::File::create(&stderr_path).context("creating nats' stderr file")?;
    let child = Command::new(binary)
        .arg("-js")
        .arg("-c")
        .arg(&config_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(stderr))
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    Ok(Server {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        _dir: dir,
        stderr_path,
    })
}

/// The nats-server binary: `$MESHD_NATS_SERVER`, else the venv `scripts/env.sh` installs.
pub fn locate_nats() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("MESHD_NATS_SERVER") {
        return Ok(PathBuf::from(p));
    }
    let venv = PathBuf::from("/var/tmp/meshd-tools/venv/bin/nats-server");
    if venv.is_file() {
        return Ok(venv);
    }
    bail!("no nats-server: set MESHD_NATS_SERVER (`source scripts/env.sh && meshd_need_nats`)")
}

/// Polls `f` until it succeeds or `within` passes, returning its last error.
pub async fn retry<T, F, Fut>(within: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// The error when etcd is missing: the meta scenario measures a real etcd.
pub const ETCD_NOT_FOUND: &str = "etcd not found on PATH (the meta scenario starts its own): \
     install Debian's etcd-server (`apt-get install etcd-server`, or `source scripts/env.sh`)";

/// The etcd binary: the first `etcd` on `PATH`.
pub fn locate_etcd() -> Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow!(ETCD_NOT_FOUND))
}

/// A client of the etcd `server` once it serves: a read is answered (a leader is
/// elected and the member serves), retried for 30 s.
pub async fn etcd_when_serving(server: &Server) -> Result<etcd_client::Client> {
    let endpoint = server.addr.to_string();
    retry(Duration::from_secs(30), || async {
        let mut client = etcd_client::Client::connect([endpoint.as_str()], None)
            .await
            .map_err(|e| anyhow!("connecting to etcd at {endpoint}: {e}"))?;
        client
            .get("bench/ready", None)
            .await
            .map_err(|e| anyhow!("etcd at {endpoint} is not serving: {e}"))?;
        Ok(client)
    })
    .await
}

/// Starts a single-member etcd on free loopback ports with its data dir in a temp dir.
/// Raft timing as meshd's test harness (`--heartbeat-interval 10 --election-timeout
/// 100`) so it elects itself leader within a fraction of a second; a single member
/// still appends and fsyncs its WAL before answering every write. The caller waits
/// until it serves (a request that succeeds).
pub fn start_etcd(binary: &Path) -> Result<Server> {
    let dir = tempfile::Builder::new()
        .prefix("meshd-bench-etcd-")
        .tempdir()
        .context("creating a temp dir for etcd")?;
    let client_port = free_port()?;
    let mut peer_port = free_port()?;
    while peer_port == client_port {
        peer_port = free_port()?;
    }
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let stderr_path = dir.path().join("etcd.log");
    let log = std::fs::File::create(&stderr_path).context("creating etcd's log file")?;
    let log2 = log.try_clone().context("cloning etcd's log handle")?;
    let mut cmd = Command::new(binary);
    // ETCD_* variables would configure etcd behind the flags' back.
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("ETCD") {
            cmd.env_remove(key);
        }
    }
    let child = cmd
        .arg("--name")
        .arg("bench")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--listen-client-urls")
        .arg(&client_url)
        .arg("--advertise-client-urls")
        .arg(&client_url)
        .arg("--listen-peer-urls")
        .arg(&peer_url)
        .arg("--initial-advertise-peer-urls")
        .arg(&peer_url)
        .arg("--initial-cluster")
        .arg(format!("bench={peer_url}"))
        .arg("--initial-cluster-state")
        .arg("new")
        .arg("--heartbeat-interval")
        .arg("10")
        .arg("--election-timeout")
        .arg("100")
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    Ok(Server {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], client_port)),
        _dir: dir,
        stderr_path,
    })
}
