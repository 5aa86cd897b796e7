//! Real `meshd` processes for end-to-end tests: each [`MeshdProcess`] runs the built
//! binary on `--listen 127.0.0.1:0` with its own data dir, learns its address from the
//! start-up line, and can be SIGKILLed, restarted on the same data dir (with the same
//! extra environment, e.g. the [`crate::fault`] shim), paused and resumed. Its stderr
//! goes to a log file that is printed when the test panics.

use crate::process::Proc;
use anyhow::{anyhow, Context};
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// How long a start may take before the test fails (a debug build on 2 cores).
const START_DEADLINE: Duration = Duration::from_secs(30);

pub struct MeshdProcess {
    binary: PathBuf,
    data_dir: PathBuf,
    args: Vec<String>,
    /// Extra environment of every start (kept across restarts), e.g. a fault shim.
    env: Vec<(String, String)>,
    /// The process and its log (stderr).
    proc: Proc,
    addr: String,
    first_line: String,
    _logs: tempfile::TempDir,
}

/// What a `meshd serve` that exited on its own said.
#[derive(Debug)]
pub struct Exited {
    pub code: Option<i32>,
    pub stderr: String,
}

impl MeshdProcess {
    /// Starts `binary serve --listen 127.0.0.1:0 --data-dir data_dir args...` and
    /// waits for its start-up line.
    pub async fn start(binary: &Path, data_dir: &Path, args: &[&str]) -> anyhow::Result<Self> {
        Self::start_with_env(binary, data_dir, args, &[]).await
    }

    /// Like [`start`](Self::start), with extra environment variables for the process
    /// (on top of this process's environment). They are kept for every restart.
    pub async fn start_with_env(
        binary: &Path,
        data_dir: &Path,
        args: &[&str],
        env: &[(String, String)],
    ) -> anyhow::Result<Self> {
        let logs = tempfile::tempdir()?;
        let mut p = Self {
            binary: binary.to_path_buf(),
            data_dir: data_dir.to_path_buf(),
            args: args.iter().map(|s| s.to_string()).collect(),
            env: env.to_vec(),
            proc: Proc::new("meshd", logs.path().join("meshd.log")),
            addr: String::new(),
            first_line: String::new(),
            _logs: logs,
        };
        p.spawn().await?;
        Ok(p)
    }

    /// Runs `meshd serve` expecting it to fail to start; returns its exit and stderr.
    /// A meshd that does start instead is killed, and that is an error.
    pub async fn start_expecting_exit(
        binary: &Path,
        data_dir: &Path,
        args: &[&str],
    ) -> anyhow::Result<Exited> {
        let logs = tempfile::tempdir()?;
        let log_path = logs.path().join("meshd.log");
        let mut proc = Proc::new("meshd", log_path.clone());
        let mut cmd = Command::new(binary);
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data_dir)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(File::create(&log_path)?));
        proc.spawn(cmd)
            .with_context(|| format!("spawning {}", binary.display()))?;
        let end = tokio::time::Instant::now() + START_DEADLINE;
        loop {
            let exited = match proc.child() {
                Some(child) => child.try_wait()?,
                None => return Err(anyhow!("meshd is not running")),
            };
            if let Some(status) = exited {
                proc.take();
                return Ok(Exited {
                    code: status.code(),
                    stderr: std::fs::read_to_string(&log_path)?,
                });
            }
            if tokio::time::Instant::now() >= end {
                let log = proc.log_tail(50);
                proc.kill();
                return Err(anyhow!(
                    "meshd did not exit within {START_DEADLINE:?} (it was expected to refuse to start); log:\n{log}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.proc.log_path())?;
        let mut cmd = Command::new(&self.binary);
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0", "--data-dir"])
            .arg(&self.data_dir)
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        let stdout = self
            .proc
            .spawn(cmd)
            .with_context(|| format!("spawning {}", self.binary.display()))?
            .stdout
            .take()
            .ok_or_else(|| anyhow!("no stdout pipe"))?;
        let read = tokio::task::spawn_blocking(move || {
            let mut reader = BufReader::new(stdout);
            let mut line = String::new();
            reader.read_line(&mut line).map(|_| (line, reader))
        });
        let (line, reader) = match tokio::time::timeout(START_DEADLINE, read).await {
            Ok(Ok(Ok(v))) => v,
            other => {
                let log = self.log_tail(50);
                self.kill();
                return Err(anyhow!(
                    "meshd did not print its start-up line within {START_DEADLINE:?} ({other:?}); log:\n{log}"
                ));
            }
        };
        // Keep draining stdout so the process never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sink = Vec::new();
            let mut r = reader;
            let _ = r.read_to_end(&mut sink);
        });
        let addr = line
            .split_whitespace()
            .find_map(|w| {
                w.strip_prefix("http://")
                    .or_else(|| w.strip_prefix("https://"))
            })
            .ok_or_else(|| {
                anyhow!(
                    "unexpected start-up line {line:?}; log:\n{}",
                    self.log_tail(50)
                )
            })?
            .to_string();
        self.addr = addr;
        self.first_line = line.trim().to_string();
        Ok(())
    }

    /// `host:port` of the HTTP listener.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// The start-up line meshd printed.
    pub fn first_line(&self) -> &str {
        &self.first_line
    }

    /// Kills the process (if running) and starts it again on the same data dir
    /// (it gets a new port).
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn().await
    }

    /// SIGTERM (graceful shutdown), then waits up to `deadline` for the exit; returns
    /// the exit code (`None`: killed by a signal). SIGKILLs it if it does not exit.
    pub async fn terminate(&mut self, deadline: Duration) -> anyhow::Result<Option<i32>> {
        self.proc.signal(libc::SIGTERM);
        let Some(mut child) = self.proc.take() else {
            return Err(anyhow!("meshd is not running"));
        };
        let end = std::time::Instant::now() + deadline;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status.code());
            }
            if std::time::Instant::now() >= end {
                let _ = child.kill();
                let _ = child.wait();
                return Err(anyhow!(
                    "meshd did not exit within {deadline:?} of SIGTERM; log:\n{}",
                    self.log_tail(50)
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the process again on the same data dir after it stopped (it gets a new
    /// port).
    pub async fn start_again(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.spawn().await
    }

    /// SIGHUP: meshd reloads its token files and TLS certificate.
    pub fn hangup(&self) {
        self.proc.signal(libc::SIGHUP);
    }
}

/// The process and its log: `pid`, `kill`, `pause`, `resume`, `signal`, `log_path`,
/// `log_tail` ([`Proc`]).
impl std::ops::Deref for MeshdProcess {
    type Target = Proc;
    fn deref(&self) -> &Proc {
        &self.proc
    }
}

impl std::ops::DerefMut for MeshdProcess {
    fn deref_mut(&mut self) -> &mut Proc {
        &mut self.proc
    }
}
