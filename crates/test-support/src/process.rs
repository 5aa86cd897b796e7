//! Test processes (etcd, nats-server, meshd): spawned so that they never outlive the
//! test, and owned through one type, [`Proc`].

use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::{mpsc, OnceLock};

/// Spawns `cmd` so that it is SIGKILLed when the test process dies.
///
/// `PR_SET_PDEATHSIG` follows the *thread* that forked, not the process, so every
/// child is forked from one thread that lives as long as the test process: a runtime
/// thread that happened to start a process may exit long before the test does.
pub fn spawn_tied_to_test(mut cmd: Command) -> std::io::Result<Child> {
    let parent = std::process::id();
    // SAFETY: the closure runs in the forked child before exec and only makes
    // async-signal-safe calls (prctl, getppid, _exit).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent may have died before prctl took effect.
            if libc::getppid() as u32 != parent {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    type Job = (Command, mpsc::Sender<std::io::Result<Child>>);
    static SPAWNER: OnceLock<mpsc::Sender<Job>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (jobs, queue) = mpsc::channel::<Job>();
        // If the thread cannot start, the send below fails and the caller gets an
        // error instead of a process that could outlive it.
        let _ = std::thread::Builder::new()
            .name("test-process-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in queue {
                    // The caller may have given up; nothing to do then.
                    let _ = reply.send(cmd.spawn());
                }
            });
        jobs
    });
    let gone = || std::io::Error::other("the test process spawner thread is gone");
    let (reply, answer) = mpsc::channel();
    spawner.send((cmd, reply)).map_err(|_| gone())?;
    answer.recv().map_err(|_| gone())?
}

/// Waits until `healthy(addr)` (a blocking probe) says the server `name` serves,
/// failing at once when its process exits and after `deadline` otherwise.
pub async fn wait_healthy(
    child: &mut Option<Child>,
    name: &str,
    addr: std::net::SocketAddr,
    deadline: std::time::Duration,
    healthy: fn(std::net::SocketAddr) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    use anyhow::{bail, Context};
    let end = tokio::time::Instant::now() + deadline;
    loop {
        match child.as_mut() {
            Some(c) => {
                if let Some(status) = c
                    .try_wait()
                    .with_context(|| format!("polling the {name} process"))?
                {
                    *child = None;
                    bail!("{name} exited during startup with {status}");
                }
            }
            None => bail!("{name} is not running"),
        }
        let last = match tokio::task::spawn_blocking(move || healthy(addr)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => format!("{e:#}"),
            Err(e) => format!("health check task: {e}"),
        };
        if tokio::time::Instant::now() >= end {
            bail!("{name} on {addr} did not become healthy within {deadline:?}; last: {last}");
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
}

/// A blocking `GET path` with short timeouts: `Ok` when the answer is 200 and its body
/// contains `expect`.
pub fn http_health(addr: std::net::SocketAddr, path: &str, expect: &str) -> anyhow::Result<()> {
    let r = crate::http::get_blocking(
        &addr.to_string(),
        path,
        std::time::Duration::from_millis(500),
    )?;
    if !(r.status == 200 && r.body.contains(expect)) {
        anyhow::bail!("{path} answered {}: {}", r.status, r.body.trim());
    }
    Ok(())
}

/// Waits (at most 5 s) until every thread of `pid` is in the stopped state (`T` in
/// `/proc/<pid>/task/*/stat`); gives up quietly when `/proc` cannot tell.
fn wait_stopped(pid: u32) {
    let stopped = || -> Option<bool> {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
        let mut all = true;
        for t in tasks.flatten() {
            let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
            // The state follows the command name's closing parenthesis.
            let state = stat.rsplit_once(')')?.1.split_whitespace().next()?;
            all &= matches!(state, "T" | "t");
        }
        Some(all)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        match stopped() {
            Some(true) | None => return,
            Some(false) => std::thread::sleep(std::time::Duration::from_millis(1)),
        }
    }
}

/// A child process a test owns, with the file its output goes to: what the etcd,
/// nats-server and meshd harnesses share. Signals (pause, resume, any other),
/// SIGKILL with reaping, the log's tail, and the log printed when the test panics.
/// Dropping it kills the process.
pub struct Proc {
    /// How the log printed at a panic is titled (`etcd`, `nats-server`, `meshd`).
    name: &'static str,
    child: Option<Child>,
    log_path: std::path::PathBuf,
}

impl Proc {
    /// No process yet; its output will go to `log_path`.
    pub fn new(name: &'static str, log_path: std::path::PathBuf) -> Self {
        Self {
            name,
            child: None,
            log_path,
        }
    }

    /// Spawns `cmd` (tied to the test, see [`spawn_tied_to_test`]) as this process,
    /// after killing the one that ran.
    pub fn spawn(&mut self, cmd: Command) -> std::io::Result<&mut Child> {
        self.kill();
        Ok(self.child.insert(spawn_tied_to_test(cmd)?))
    }

    /// The process while it runs (`None` after [`kill`](Self::kill)).
    pub fn child(&mut self) -> &mut Option<Child> {
        &mut self.child
    }

    /// The process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `sig` to the process, if it runs.
    pub fn signal(&self, sig: libc::c_int) {
        if let Some(pid) = self.pid() {
            // SAFETY: kill(2) with a valid signal number; the pid is our own
            // unreaped child, so it cannot have been recycled for another process.
            unsafe {
                libc::kill(pid as libc::pid_t, sig);
            }
        }
    }

    /// SIGSTOP: its sockets stay open but it answers nothing. Returns once every thread
    /// of the process is stopped (the signal is delivered asynchronously: a thread of a
    /// multi-threaded server could otherwise still answer a request sent right after).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        if let Some(pid) = self.pid() {
            wait_stopped(pid);
        }
    }

    /// SIGCONT after [`pause`](Self::pause).
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// SIGKILL and reap (a paused process is continued first, so that it dies at
    /// once). Does nothing when it is not running.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            self.resume_pid(child.id());
            // Errors mean the process is already gone; `wait` reaps it either way.
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn resume_pid(&self, pid: u32) {
        // SAFETY: as in `signal`.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGCONT);
        }
    }

    /// Takes the running process out (to wait for its exit by other means).
    pub fn take(&mut self) -> Option<Child> {
        self.child.take()
    }

    /// The log file (the process's output).
    pub fn log_path(&self) -> &std::path::Path {
        &self.log_path
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        match std::fs::read(&self.log_path) {
            Ok(bytes) => {
                let text = String::from_utf8_lossy(&bytes);
                let all: Vec<&str> = text.lines().collect();
                all[all.len().saturating_sub(lines)..].join("\n")
            }
            Err(e) => format!("(reading {}: {e})", self.log_path.display()),
        }
    }
}

/// Lines of the log printed when a test panics.
const PANIC_LOG_LINES: usize = 200;

impl Drop for Proc {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "===== {} log ({}, last {PANIC_LOG_LINES} lines) =====\n{}\n===== end of {} log =====",
                self.name,
                self.log_path.display(),
                self.log_tail(PANIC_LOG_LINES),
                self.name
            );
        }
        self.kill();
    }
}
