//! Disk faults for a real process, without root and without test code in the binary:
//! an `LD_PRELOAD` shim with two independent faults, each tripped by its own trigger
//! file.
//!
//! * [`FsyncFault`]: `fsync`, `fdatasync` and `sync_file_range` fail with `EIO`.
//! * [`FullDisk`]: the disk is full — every call that would put bytes into a regular
//!   file (`write`, `pwrite`, `writev`, `pwritev`, `fallocate`, `posix_fallocate` and
//!   their 64-bit and `v2` variants) fails with `ENOSPC`.
//!
//! RocksDB (Debian's `librocksdb.so`, linked dynamically) makes its write-ahead log
//! durable with `fdatasync` (`use_fsync` is off in meshd), directories and manifests
//! with `fsync`, and calls `sync_file_range` only for incremental write-back
//! (`bytes_per_sync`, off by default) — interposed too, so a later change of those
//! options cannot slip past the fault. Rust's `File::sync_all` / `sync_data` are
//! `fsync` / `fdatasync`. A `write()` still reaches the page cache: what a tripped
//! fsync fault models is exactly the case where the data may or may not be on disk, so
//! a write whose fsync failed has an unknown outcome.
//!
//! RocksDB writes its WAL, SST files, MANIFEST and info `LOG` with `write` (WAL and
//! MANIFEST) and `pwrite`, and preallocates with `fallocate` (a failure there is
//! ignored by RocksDB, as on a real full disk the next write is what fails);
//! `librocksdb.so` imports no other write call (`nm -D --undefined-only`). A full
//! disk fails the whole call with `-1`/`ENOSPC` — no partial writes — and only on
//! regular files other than stdin, stdout and stderr (`fstat`, `S_ISREG`, fd > 2), so
//! sockets, pipes and the process's own log (a regular file in meshd's tests, which a
//! real full *data* disk would not hold) keep working. `fsync` is not failed by a full
//! disk: what was written before the disk filled had its space, so syncing it
//! succeeds (use both faults for a disk whose write-back fails too). Writes that glibc
//! makes internally (`stdio`'s `fwrite` buffers) do not go through the interposed
//! symbols; neither RocksDB's data files nor Rust's `File` use them.
//!
//! The shim is C, compiled at test time with the system C compiler (`cc`, always
//! present since rustc links with it), once per test process while any fault is
//! alive. Both faults' [`env`](FullDisk::env) preload the same library, so a process
//! can be started under both by passing both environments (the second `LD_PRELOAD`
//! wins and names the same file).
//!
//! ```no_run
//! # async fn f(bin: &std::path::Path, dir: &std::path::Path) -> anyhow::Result<()> {
//! use meshd_test_support::fault::{FsyncFault, FullDisk};
//! use meshd_test_support::meshd::MeshdProcess;
//! let fault = FsyncFault::build()?;
//! let _meshd = MeshdProcess::start_with_env(bin, dir, &[], &fault.env()).await?;
//! fault.trip()?; // every fsync of meshd now fails with EIO
//! fault.heal()?; // and succeeds again
//!
//! let full = FullDisk::build()?;
//! let _meshd = MeshdProcess::start_with_env(bin, dir, &[], &full.env()).await?;
//! full.trip()?; // every write of meshd to a file now fails with ENOSPC
//! full.heal()?; // space is back
//! # Ok(()) }
//! ```

use anyhow::{anyhow, Context};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, Weak};

/// The environment variable that names the [`FsyncFault`] trigger file to the shim.
pub const TRIGGER_ENV: &str = "MESHD_FAULT_FSYNC_TRIGGER";

/// The environment variable that names the [`FullDisk`] trigger file to the shim.
pub const FULL_TRIGGER_ENV: &str = "MESHD_FAULT_FULL_TRIGGER";

/// The shim. The trigger paths are read once, when the library is loaded; their
/// existence is checked with `access(2)` (a plain syscall, not interposed) on every
/// call, so tripping and healing take effect at the next call.
const SHIM_SOURCE: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static const char *trigger;
static const char *full_trigger;
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_sync_file_range)(int, off_t, off_t, unsigned int);

/* Runs when the library is loaded, before any thread of the program exists. */
__attribute__((constructor)) static void meshd_fault_init(void) {
    trigger = getenv("MESHD_FAULT_FSYNC_TRIGGER");
    full_trigger = getenv("MESHD_FAULT_FULL_TRIGGER");
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

/* The full disk. Whether `fd` is a regular file (not stdin, stdout or stderr) while
   the disk is full, and the call would need space (`len` > 0). The cheap checks come
   first: this runs on every write of the process, sockets included. */
static int full(int fd, size_t len) {
    if (full_trigger == NULL || fd <= 2 || len == 0) return 0;
    if (access(full_trigger, F_OK) != 0) return 0;
    struct stat st;
    return fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
}

static size_t iov_len(const struct iovec *iov, int n) {
    size_t len = 0;
    for (int i = 0; i < n; i++) len += iov[i].iov_len;
    return len;
}

/* The real function, resolved at first use: a write may come from another library's
   constructor before ours has run. Racing threads store the same pointer. */
#define REAL_OR(name, missing)                                               \
    static __typeof__(&name) real;                                           \
    __typeof__(&name) fn = __atomic_load_n(&real, __ATOMIC_ACQUIRE);         \
    if (!fn) {                                                               \
        fn = (__typeof__(&name))dlsym(RTLD_NEXT, #name);                     \
        if (!fn) { missing; }                                                \
        __atomic_store_n(&real, fn, __ATOMIC_RELEASE);                       \
    }
#define REAL(name) REAL_OR(name, errno = ENOSYS; return -1)

ssize_t write(int fd, const void *buf, size_t count) {
    if (full(fd, count)) { errno = ENOSPC; return -1; }
    REAL(write);
    return fn(fd, buf, count);
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    if (full(fd, count)) { errno = ENOSPC; return -1; }
    REAL(pwrite);
    return fn(fd, buf, count, offset);
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off64_t offset) {
    if (full(fd, count)) { errno = ENOSPC; return -1; }
    REAL(pwrite64);
    return fn(fd, buf, count, offset);
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt) {
    if (iovcnt > 0 && full(fd, iov_len(iov, iovcnt))) { errno = ENOSPC; return -1; }
    REAL(writev);
    return fn(fd, iov, iovcnt);
}

ssize_t pwritev(int fd, const struct iovec *iov, int iovcnt, off_t offset) {
    if (iovcnt > 0 && full(fd, iov_len(iov, iovcnt))) { errno = ENOSPC; return -1; }
    REAL(pwritev);
    return fn(fd, iov, iovcnt, offset);
}

ssize_t pwritev64(int fd, const struct iovec *iov, int iovcnt, off64_t offset) {
    if (iovcnt > 0 && full(fd, iov_len(iov, iovcnt))) { errno = ENOSPC; return -1; }
    REAL(pwritev64);
    return fn(fd, iov, iovcnt, offset);
}

ssize_t pwritev2(int fd, const struct iovec *iov, int iovcnt, off_t offset, int flags) {
    if (iovcnt > 0 && full(fd, iov_len(iov, iovcnt))) { errno = ENOSPC; return -1; }
    REAL(pwritev2);
    return fn(fd, iov, iovcnt, offset, flags);
}

ssize_t pwritev64v2(int fd, const struct iovec *iov, int iovcnt, off64_t offset, int flags) {
    if (iovcnt > 0 && full(fd, iov_len(iov, iovcnt))) { errno = ENOSPC; return -1; }
    REAL(pwritev64v2);
    return fn(fd, iov, iovcnt, offset, flags);
}

int fallocate(int fd, int mode, off_t offset, off_t len) {
    if (full(fd, (size_t)len)) { errno = ENOSPC; return -1; }
    REAL(fallocate);
    return fn(fd, mode, offset, len);
}

int fallocate64(int fd, int mode, off64_t offset, off64_t len) {
    if (full(fd, (size_t)len)) { errno = ENOSPC; return -1; }
    REAL(fallocate64);
    return fn(fd, mode, offset, len);
}

/* posix_fallocate returns the error number instead of setting errno. */
int posix_fallocate(int fd, off_t offset, off_t len) {
    if (full(fd, (size_t)len)) return ENOSPC;
    REAL_OR(posix_fallocate, return ENOSYS);
    return fn(fd, offset, len);
}

int posix_fallocate64(int fd, off64_t offset, off64_t len) {
    if (full(fd, (size_t)len)) return ENOSPC;
    REAL_OR(posix_fallocate64, return ENOSYS);
    return fn(fd, offset, len);
}
"#;

/// The compiled shim, shared by every [`FsyncFault`] and [`FullDisk`] of this
/// process; its directory is removed when the last one is dropped.
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

/// A trigger file in its own temp dir: the shim faults while it exists. Dropping it
/// removes the dir, which heals the fault.
struct Trigger {
    shim: Arc<Shim>,
    /// Which fault the shim reads this trigger for ([`TRIGGER_ENV`] or
    /// [`FULL_TRIGGER_ENV`]).
    env_var: &'static str,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Trigger {
    fn build(env_var: &'static str, file_name: &str) -> anyhow::Result<Self> {
        let shim = shared_shim()?;
        let dir = tempfile::Builder::new()
            .prefix("meshd-fault-trigger-")
            .tempdir()?;
        Ok(Self {
            shim,
            env_var,
            path: dir.path().join(file_name),
            _dir: dir,
        })
    }

    fn env(&self) -> Vec<(String, String)> {
        let so = self.shim.so_path.display().to_string();
        let preload = match std::env::var("LD_PRELOAD") {
            Ok(existing) if !existing.trim().is_empty() => format!("{so} {existing}"),
            _ => so,
        };
        vec![
            ("LD_PRELOAD".to_string(), preload),
            (self.env_var.to_string(), self.path.display().to_string()),
        ]
    }

    fn trip(&self, content: &[u8]) -> anyhow::Result<()> {
        std::fs::write(&self.path, content)
            .with_context(|| format!("creating the trigger {}", self.path.display()))
    }

    fn heal(&self) -> anyhow::Result<()> {
        match std::fs::remove_file(&self.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => {
                Err(e).with_context(|| format!("removing the trigger {}", self.path.display()))
            }
        }
    }

    fn is_tripped(&self) -> bool {
        self.path.exists()
    }
}

/// An fsync fault for the processes started with [`FsyncFault::env`]: while
/// [tripped](FsyncFault::trip), their `fsync`, `fdatasync` and `sync_file_range`
/// fail with `EIO`; once [healed](FsyncFault::heal) they work again. Dropping it
/// heals it (the trigger lives in its own temp dir).
pub struct FsyncFault {
    trigger: Trigger,
}

impl FsyncFault {
    /// Compiles the shim (once per process while any fault is alive) and prepares a
    /// trigger, not tripped.
    pub fn build() -> anyhow::Result<Self> {
        Ok(Self {
            trigger: Trigger::build(TRIGGER_ENV, "fsync-fails")?,
        })
    }

    /// The shared library to preload.
    pub fn so_path(&self) -> &Path {
        &self.trigger.shim.so_path
    }

    /// The file whose existence trips the fault.
    pub fn trigger_path(&self) -> &Path {
        &self.trigger.path
    }

    /// The environment that puts a child process under this fault: `LD_PRELOAD`
    /// (ahead of any preload this process already has) and the trigger path.
    pub fn env(&self) -> Vec<(String, String)> {
        self.trigger.env()
    }

    /// From now on every sync call of the faulted processes fails with `EIO`.
    pub fn trip(&self) -> anyhow::Result<()> {
        self.trigger.trip(b"EIO\n")
    }

    /// From now on sync calls work again.
    pub fn heal(&self) -> anyhow::Result<()> {
        self.trigger.heal()
    }

    pub fn is_tripped(&self) -> bool {
        self.trigger.is_tripped()
    }
}

/// A full disk for the processes started with [`FullDisk::env`]: while
/// [tripped](FullDisk::trip), every write of theirs to a regular file (other than
/// stdin, stdout and stderr) fails with `ENOSPC`, as do `fallocate` and
/// `posix_fallocate`; once [healed](FullDisk::heal) ("space is back") they work
/// again. Syncs, reads, sockets and pipes are not affected. Dropping it heals it.
pub struct FullDisk {
    trigger: Trigger,
}

impl FullDisk {
    /// Compiles the shim (once per process while any fault is alive; shared with
    /// [`FsyncFault`]) and prepares a trigger, not tripped.
    pub fn build() -> anyhow::Result<Self> {
        Ok(Self {
            trigger: Trigger::build(FULL_TRIGGER_ENV, "disk-full")?,
        })
    }

    /// The shared library to preload.
    pub fn so_path(&self) -> &Path {
        &self.trigger.shim.so_path
    }

    /// The file whose existence fills the disk.
    pub fn trigger_path(&self) -> &Path {
        &self.trigger.path
    }

    /// The environment that puts a child process under this fault: `LD_PRELOAD`
    /// (ahead of any preload this process already has) and the trigger path.
    pub fn env(&self) -> Vec<(String, String)> {
        self.trigger.env()
    }

    /// From now on every write of the faulted processes to a file fails with `ENOSPC`.
    pub fn trip(&self) -> anyhow::Result<()> {
        self.trigger.trip(b"ENOSPC\n")
    }

    /// Space is back: writes work again.
    pub fn heal(&self) -> anyhow::Result<()> {
        self.trigger.heal()
    }

    pub fn is_tripped(&self) -> bool {
        self.trigger.is_tripped()
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

    /// A child that makes each write call of the full-disk fault on a file, then
    /// writes to a pipe and to its stderr (a regular file here) and fsyncs the file,
    /// and prints the errno of each (0: success).
    const FULL_PROBE_SOURCE: &str = r#"
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/uio.h>
#include <unistd.h>

static int err(long rc) { return rc >= 0 ? 0 : errno; }

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    int fd = open(argv[1], O_CREAT | O_WRONLY | O_TRUNC, 0600);
    if (fd < 0) { perror("open"); return 3; }
    struct iovec iov = { .iov_base = "x", .iov_len = 1 };
    int w = err(write(fd, "x", 1));
    int pw = err(pwrite(fd, "x", 1, 1));
    int pw64 = err(pwrite64(fd, "x", 1, 2));
    int wv = err(writev(fd, &iov, 1));
    int pwv = err(pwritev(fd, &iov, 1, 4));
    int fa = err(fallocate(fd, 0, 0, 4096));
    int pfa = posix_fallocate(fd, 0, 8192);
    int p[2];
    if (pipe(p) != 0) { perror("pipe"); return 4; }
    int pipe_w = err(write(p[1], "x", 1));
    int stderr_w = err(write(2, "x\n", 2));
    int sync = err(fsync(fd));
    printf("write=%d pwrite=%d pwrite64=%d writev=%d pwritev=%d fallocate=%d "
           "posix_fallocate=%d pipe=%d stderr=%d fsync=%d\n",
           w, pw, pw64, wv, pwv, fa, pfa, pipe_w, stderr_w, sync);
    return 0;
}
"#;

    #[test]
    fn given_the_shim_preloaded_when_the_disk_is_full_then_file_writes_fail_with_enospc_pipes_stderr_and_syncs_work_and_after_healing_writes_succeed(
    ) {
        let full = FullDisk::build().expect("build the fault shim");
        let work = tempfile::tempdir().unwrap();
        let source = work.path().join("probe.c");
        std::fs::write(&source, FULL_PROBE_SOURCE).unwrap();
        let bin = work.path().join("probe");
        compile(&source, &bin, &[], &[]).expect("compile the probe");
        let file = work.path().join("data");
        let run = |env: &[(String, String)]| {
            let stderr = std::fs::File::create(work.path().join("stderr")).unwrap();
            let out = Command::new(&bin)
                .arg(&file)
                .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .stderr(stderr)
                .output()
                .expect("run the probe");
            assert!(out.status.success(), "probe failed: {out:?}");
            String::from_utf8(out.stdout).unwrap().trim().to_string()
        };
        let ok = "write=0 pwrite=0 pwrite64=0 writev=0 pwritev=0 fallocate=0 \
                  posix_fallocate=0 pipe=0 stderr=0 fsync=0";
        let full_answer = format!(
            "write={0} pwrite={0} pwrite64={0} writev={0} pwritev={0} fallocate={0} \
             posix_fallocate={0} pipe=0 stderr=0 fsync=0",
            libc::ENOSPC
        );

        assert_eq!(run(&full.env()), ok, "not tripped yet");
        full.trip().unwrap();
        assert!(full.is_tripped());
        assert_eq!(run(&full.env()), full_answer, "disk full");
        assert_eq!(run(&[]), ok, "a process without the shim is not affected");
        let fsync = FsyncFault::build().unwrap();
        assert_eq!(
            run(&fsync.env()),
            ok,
            "the full disk's trigger is not the fsync fault's"
        );
        full.heal().unwrap();
        assert!(!full.is_tripped());
        assert_eq!(run(&full.env()), ok, "space is back");
        full.heal().expect("healing twice is fine");
    }

    #[test]
    fn faults_of_one_process_share_the_shim_but_not_the_trigger() {
        let a = FsyncFault::build().unwrap();
        let b = FsyncFault::build().unwrap();
        assert_eq!(a.so_path(), b.so_path());
        assert_ne!(a.trigger_path(), b.trigger_path());
        a.trip().unwrap();
        assert!(!b.is_tripped());
        let full = FullDisk::build().unwrap();
        assert_eq!(full.so_path(), a.so_path());
        assert!(!full.is_tripped());
    }
}
