//! Spawning test processes (etcd, meshd) so that they never outlive the test.

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
