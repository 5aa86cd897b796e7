//! Disk faults for a real process, without root and without test code in the binary:
//! an `LD_PRELOAD` shim that makes `fsync`, `fdatasync` and `sync_file_range` fail with
//! `EIO` while a trigger file exists.
//!
//! RocksDB (Debian's `librocksdb.so`, linked dynamically) makes its write-ahead log
//! durable with `fdatasync` (`use_fsync` is off in meshd), directories and manifests
//! with `fsync`, and calls `sync_file_range` only for incremental write-back
//! (`bytes_per_sync`, off by default) — interposed too, so a later change of those
//! options cannot slip past the fault. Rust's `File::sync_all` / `sync_data` are
//! `fsync` / `fdatasync`. A `write()` still reaches the page cache: what a tripped
//! fault models is exactly the case where the data may or may not be on disk, so a
//! write whose fsync failed has an unknown outcome.
//!
//! The shim is C, compiled at test time with the system C compiler (`cc`, always
//! present since rustc links with it), once per test process while any
//! [`FsyncFault`] is alive.
//!
//! ```no_run
//! # async fn f(bin: &std::path::Path, dir: &std::path::Path) -> anyhow::Result<()> {
//! use meshd_test_support::fault::FsyncFault;
//! use meshd_test_support::meshd::MeshdProcess;
//! let fault = FsyncFault::build()?;
//! let _meshd = MeshdProcess::start_with_env(bin, dir, &[], &fault.env()).await?;
//! fault.trip()?; // every fsync of meshd now fails with EIO
//! fault.heal()?; // and succeeds again
//! # Ok(()) }
//! ```

use anyhow::{anyhow, Context};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, Weak};

/// The environment variable that names the trigger file to the shim.
pub const TRIGGER_ENV: &str = "MESHD_FAULT_FSYNC_TRIGGER";

/// The shim. The trigger path is read once, when the library is loaded; its
/// existence is checked with `access(2)` (a plain syscall, not interposed) on every
/// call, so tripping and healing take effect at the next sync call.
const SHIM_SOURCE: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

static const char *trigger;
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_sync_file_range)(int, off_t, off_t, unsigned int);

/* Runs when the library is loaded, before any thread of the program exists. */
__attribute__((constructor)) static void meshd_fault_init(void) {
    trigger = getenv("MESHD_FAULT_FSYNC_TRIGGER");
    real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    real_sync_file_range =
        (int (*)(int, off_t, off_t, unsigned int))dlsym(RTLD_NEXT, "sync_file_range");
}

static int tripped(void) {
    return trigger != NULL && access(trigger, F_OK) == 0;
}

int fsync(int fd) {
    if (tripped()) { errno = EIO; return -1; }
    if (!real_fsync) { errno = ENOSYS; return -1; }
    return real_fsync(fd);
}

int fdatasync(int fd) {
    if (tripped()) { errno = EIO; return -1; }
    if (!real_fdatasync) { errno = ENOSYS; return -1; }
    return real_fdatasync(fd);
}

int sync_file_range(int fd, off_t offset, off_t nbytes, unsigned int flags) {
    if (tripped()) { errno = EIO; return -1; }
    if (!real_sync_file_range) { errno = ENOSYS; return -1; }
    return real_sync_file_range(fd, offset, nbytes, flags);
}
"#;

/// The compiled shim, shared by every [`FsyncFault`] of this process; its directory
/// is removed when the last one is dropped.
struct Shim {
    so_path: PathBuf,
    _dir: tempfile::TempDir,
}

fn shared_shim() -> anyhow::Result<Arc<Shim>> {
    static SHIM: Mutex<Weak<Shim>> = Mutex::new(Weak::new());
    let mut cached = SHIM.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(shim) = cached.upgrade() {
        return Ok(shim);
    }
    let shim = Arc::new(compile_shim()?);
    *cached = Arc::downgrade(&shim);
    Ok(shim)
}

fn compile_shim() -> anyhow::Result<Shim> {
    let dir = tempfile::Builder::new().prefix("meshd-fault-").tempdir()?;
    let source = dir.path().join("fault.c");
    std::fs::write(&source, SHIM_SOURCE)?;
    let so_path = dir.path().join("libmeshd_fault.so");
    // LD_PRELOAD separates entries with spaces and colons.
    if so_path.display().to_string().contains([' ', ':']) {
        return Err(anyhow!(
            "the temp dir {} cannot be named in LD_PRELOAD (space or colon); set TMPDIR",
            dir.path().display()
        ));
    }
    compile(&source, &so_path, &["-shared", "-fPIC"], &["-ldl"])?;
    Ok(Shim { so_path, _dir: dir })
}

/// Runs `$CC` (or `cc`) on `source`, writing `output`.
fn compile(source: &Path, output: &Path, flags: &[&str], libs: &[&str]) -> anyhow::Result<()> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = Command::new(&cc)
        .args(flags)
        .args(["-O1", "-Wall", "-o"])
        .arg(output)
        .arg(source)
        .args(libs)
        .output()
        .with_context(|| {
            format!("running the C compiler {cc:?} (needed to build the fault shim)")
        })?;
    if !out.status.success() {
        return Err(anyhow!(
            "{cc} failed on {}: {}",
            source.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// An fsync fault for the processes started with [`FsyncFault::env`]: while
/// [tripped](FsyncFault::trip), their `fsync`, `fdatasync` and `sync_file_range`
/// fail with `EIO`; once [healed](FsyncFault::heal) they work again. Dropping it
/// heals it (the trigger lives in its own temp dir).
pub struct FsyncFault {
    shim: Arc<Shim>,
    trigger_path: PathBuf,
    _trigger_dir: tempfile::TempDir,
}

impl FsyncFault {
    /// Compiles the shim (once per process while any fault is alive) and prepares a
    /// trigger, not tripped.
    pub fn build() -> anyhow::Result<Self> {
        let shim = shared_shim()?;
        let dir = tempfile::Builder::new()
            .prefix("meshd-fault-trigger-")
            .tempdir()?;
        Ok(Self {
            shim,
            trigger_path: dir.path().join("fsync-fails"),
            _trigger_dir: dir,
        })
    }

    /// The shared library to preload.
    pub fn so_path(&self) -> &Path {
        &self.shim.so_path
    }

    /// The file whose existence trips the fault.
    pub fn trigger_path(&self) -> &Path {
        &self.trigger_path
    }

    /// The environment that puts a child process under this fault: `LD_PRELOAD`
    /// (ahead of any preload this process already has) and the trigger path.
    pub fn env(&self) -> Vec<(String, String)> {
        let so = self.shim.so_path.display().to_string();
        let preload = match std::env::var("LD_PRELOAD") {
            Ok(existing) if !existing.trim().is_empty() => format!("{so} {existing}"),
            _ => so,
        };
        vec![
            ("LD_PRELOAD".to_string(), preload),
            (
                TRIGGER_ENV.to_string(),
                self.trigger_path.display().to_string(),
            ),
        ]
    }

    /// From now on every sync call of the faulted processes fails with `EIO`.
    pub fn trip(&self) -> anyhow::Result<()> {
        std::fs::write(&self.trigger_path, b"EIO\n")
            .with_context(|| format!("creating the trigger {}", self.trigger_path.display()))
    }

    /// From now on sync calls work again.
    pub fn heal(&self) -> anyhow::Result<()> {
        match std::fs::remove_file(&self.trigger_path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e)
                .with_context(|| format!("removing the trigger {}", self.trigger_path.display())),
        }
    }

    pub fn is_tripped(&self) -> bool {
        self.trigger_path.exists()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child that calls each sync function on a file it just wrote and prints the
    /// errno of each (0: success).
    const PROBE_SOURCE: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

static int err(int rc) { return rc == 0 ? 0 : errno; }

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    int fd = open(argv[1], O_CREAT | O_WRONLY | O_TRUNC, 0600);
    if (fd < 0) { perror("open"); return 3; }
    if (write(fd, "x", 1) != 1) { perror("write"); return 4; }
    int a = err(fsync(fd));
    int b = err(fdatasync(fd));
    int c = err(sync_file_range(fd, 0, 1, SYNC_FILE_RANGE_WRITE));
    printf("fsync=%d fdatasync=%d sync_file_range=%d\n", a, b, c);
    return 0;
}
"#;

    fn probe(bin: &Path, file: &Path, env: &[(String, String)]) -> String {
        let out = Command::new(bin)
            .arg(file)
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .expect("run the probe");
        assert!(
            out.status.success(),
            "probe failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    #[test]
    fn given_the_shim_preloaded_when_tripped_then_every_sync_call_fails_with_eio_and_after_healing_succeeds(
    ) {
        let fault = FsyncFault::build().expect("build the fault shim");
        let work = tempfile::tempdir().unwrap();
        let source = work.path().join("probe.c");
        std::fs::write(&source, PROBE_SOURCE).unwrap();
        let bin = work.path().join("probe");
        compile(&source, &bin, &[], &[]).expect("compile the probe");
        let file = work.path().join("data");
        let ok = "fsync=0 fdatasync=0 sync_file_range=0";
        let eio = format!("fsync={0} fdatasync={0} sync_file_range={0}", libc::EIO);

        assert_eq!(probe(&bin, &file, &fault.env()), ok, "not tripped yet");
        fault.trip().unwrap();
        assert!(fault.is_tripped());
        assert_eq!(probe(&bin, &file, &fault.env()), eio, "tripped");
        assert_eq!(
            probe(&bin, &file, &[]),
            ok,
            "a process without the shim is not affected"
        );
        fault.heal().unwrap();
        assert!(!fault.is_tripped());
        assert_eq!(probe(&bin, &file, &fault.env()), ok, "healed");
        fault.heal().expect("healing twice is fine");
    }

    #[test]
    fn faults_of_one_process_share_the_shim_but_not_the_trigger() {
        let a = FsyncFault::build().unwrap();
        let b = FsyncFault::build().unwrap();
        assert_eq!(a.so_path(), b.so_path());
        assert_ne!(a.trigger_path(), b.trigger_path());
        a.trip().unwrap();
        assert!(!b.is_tripped());
    }
}
