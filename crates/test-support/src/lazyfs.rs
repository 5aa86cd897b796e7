//! A lazy filesystem for power cuts (the technique of LazyFS): a FUSE filesystem whose
//! whole state lives in this process's memory as two layers, what a program sees now
//! and what a disk would still hold after a power cut. A write, a truncate or an
//! extending `fallocate` changes only the first until the file is `fsync`ed or
//! `fdatasync`ed; a create, unlink, rename, link, `mkdir` or `rmdir` changes a
//! directory's entries, which become durable only when that directory is fsynced (as
//! POSIX asks; ext4 and xfs are more forgiving, so this is the strict reading).
//!
//! [`LazyFs::power_cut`] is the cut: the caller kills every process using the
//! filesystem first (SIGKILL, so nothing gets to sync), then every file falls back to its
//! durable bytes (or, with [`Torn::Prefix`], keeps a seeded prefix of the writes that
//! were pending, the last one possibly cut inside), every directory to its durable
//! entries, what the durable tree no longer reaches is gone, and the filesystem is
//! mounted again at the same path, so the kernel's page cache starts empty too.
//!
//! Programs run on it unmodified. Requests are served one at a time (fuser's session
//! thread), which is slow but fine for tests. Mounting needs `/dev/fuse` and root (or
//! Debian's `fuse3`, whose `fusermount3` fuser falls back on).

use anyhow::{anyhow, Context};
use fuser::{
    FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory,
    ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request, TimeOrNow, FUSE_ROOT_ID,
};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

/// What happens to writes that were not synced when the power goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Torn {
    /// All of them are lost.
    Lost,
    /// Per file, a prefix of them (chosen from the seed) reached the disk, the last
    /// one possibly only in part: the torn tail a real disk can leave.
    Prefix(u64),
    /// Per file with two or more, every one reached the disk but one before the last
    /// (chosen from the seed), whose second half came back as garbage (those bytes
    /// inverted): a disk that wrote its cache out of order and lost power in the middle
    /// of an earlier write's last sectors. A log then holds a record whose header is
    /// intact and whose body fails its checksum, with intact records after it, which
    /// no tail-tolerant recovery may take for a torn tail.
    Garbled(u64),
}

/// When a directory entry (a create, rename, unlink) becomes durable.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Entries {
    /// Only when its directory is fsynced: what POSIX promises (the default).
    #[default]
    DirectoryFsync,
    /// Also when a file is fsynced, every entry on the path to it, as ext4 (with its
    /// default journal) and xfs do in practice: their fsync commits the journal that
    /// holds the create and rename.
    WithFileFsync,
}

/// What a power cut dropped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CutReport {
    /// Files that had writes not yet synced.
    pub files_with_unsynced_writes: usize,
    /// Bytes written but not synced (all of them, lost or kept as a torn prefix).
    pub unsynced_bytes: u64,
    /// Of those, bytes kept as a torn prefix (or, with [`Torn::Garbled`], kept).
    pub torn_bytes_kept: u64,
    /// With [`Torn::Garbled`]: bytes of the writes that came back as garbage.
    pub garbled_bytes: u64,
    /// Directory entries whose create, rename or removal was undone (their directory
    /// was not fsynced after the change).
    pub entries_undone: usize,
}

/// One change to a file's bytes, kept until the file is synced.
#[derive(Clone, Debug)]
enum Op {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

/// The bytes `ops` write.
fn written_bytes(ops: &[Op]) -> u64 {
    ops.iter()
        .map(|op| match op {
            Op::Write { data, .. } => data.len() as u64,
            Op::SetLen(_) => 0,
        })
        .sum()
}

/// What of a file's unsynced `pending` changes reaches its `durable` bytes at a cut
/// of kind `torn` (see [`Torn`]), counted in `report`.
fn reach_the_disk(
    durable: &mut Vec<u8>,
    pending: &[Op],
    torn: Torn,
    rng: &mut crate::rng::Rng,
    report: &mut CutReport,
) {
    let keep = |durable: &mut Vec<u8>, op: &Op, report: &mut CutReport| {
        if let Op::Write { data, .. } = op {
            report.torn_bytes_kept += data.len() as u64;
        }
        apply(durable, op);
    };
    match torn {
        Torn::Lost => {}
        Torn::Prefix(_) => {
            let kept = rng.below(pending.len() as u64 + 1) as usize;
            for op in &pending[..kept] {
                keep(durable, op, report);
            }
            // The next write, torn inside.
            if let Some(Op::Write { offset, data }) = pending.get(kept) {
                let part = rng.below(data.len() as u64 + 1) as usize;
                report.torn_bytes_kept += part as u64;
                let torn_write = Op::Write {
                    offset: *offset,
                    data: data[..part].to_vec(),
                };
                apply(durable, &torn_write);
            }
        }
        Torn::Garbled(_) => {
            let writes: Vec<usize> = (0..pending.len())
                .filter(|i| matches!(pending[*i], Op::Write { .. }))
                .collect();
            // One write or none: nothing comes after it to garble before; lost, as
            // without power.
            if writes.len() < 2 {
                return;
            }
            let bad = writes[rng.below(writes.len() as u64 - 1) as usize];
            for (i, op) in pending.iter().enumerate() {
                match op {
                    Op::Write { offset, data } if i == bad => {
                        let half = data.len() / 2;
                        report.garbled_bytes += (data.len() - half) as u64;
                        let garbage = data
                            .iter()
                            .enumerate()
                            .map(|(j, b)| if j < half { *b } else { !b })
                            .collect();
                        let garbled_write = Op::Write {
                            offset: *offset,
                            data: garbage,
                        };
                        apply(durable, &garbled_write);
                    }
                    op => keep(durable, op, report),
                }
            }
        }
    }
}

fn apply(bytes: &mut Vec<u8>, op: &Op) {
    match op {
        Op::Write { offset, data } => {
            let start = *offset as usize;
            let end = start + data.len();
            if bytes.len() < end {
                bytes.resize(end, 0);
            }
            bytes[start..end].copy_from_slice(data);
        }
        Op::SetLen(len) => bytes.resize(*len as usize, 0),
    }
}

#[derive(Debug)]
enum Content {
    File {
        /// What programs read now.
        data: Vec<u8>,
        /// What a power cut leaves.
        durable: Vec<u8>,
        /// The changes between the two, in order.
        pending: Vec<Op>,
    },
    Dir {
        entries: BTreeMap<OsString, u64>,
        durable: BTreeMap<OsString, u64>,
    },
}

#[derive(Debug)]
struct Node {
    content: Content,
    perm: u16,
    uid: u32,
    gid: u32,
    /// Links in the current tree.
    nlink: u32,
    /// Open handles (an unlinked file lives while open).
    open: u32,
    atime: SystemTime,
    mtime: SystemTime,
    ctime: SystemTime,
}

impl Node {
    fn new(content: Content, perm: u16, uid: u32, gid: u32) -> Self {
        let now = SystemTime::now();
        Self {
            content,
            perm,
            uid,
            gid,
            nlink: 1,
            open: 0,
            atime: now,
            mtime: now,
            ctime: now,
        }
    }

    fn is_dir(&self) -> bool {
        matches!(self.content, Content::Dir { .. })
    }
}

/// The state behind the mount, shared with the [`LazyFs`] handle.
#[derive(Debug)]
struct Disk {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
    entries: Entries,
}

impl Disk {
    fn new() -> Self {
        let mut nodes = HashMap::new();
        let root = Node::new(
            Content::Dir {
                entries: BTreeMap::new(),
                durable: BTreeMap::new(),
            },
            0o755,
            0,
            0,
        );
        nodes.insert(FUSE_ROOT_ID, root);
        Self {
            nodes,
            next_ino: FUSE_ROOT_ID + 1,
            entries: Entries::default(),
        }
    }

    /// With [`Entries::WithFileFsync`]: the entries naming `ino` and, up the tree,
    /// the entries naming its directories become durable.
    fn persist_path_to(&mut self, ino: u64) {
        let mut wanted = vec![ino];
        let mut done = HashSet::new();
        while let Some(child) = wanted.pop() {
            if !done.insert(child) {
                continue;
            }
            let parents: Vec<(u64, OsString)> = self
                .nodes
                .iter()
                .filter_map(|(p, n)| match &n.content {
                    Content::Dir { entries, .. } => entries
                        .iter()
                        .find(|(_, c)| **c == child)
                        .map(|(name, _)| (*p, name.clone())),
                    Content::File { .. } => None,
                })
                .collect();
            for (parent, name) in parents {
                if let Some(Content::Dir { durable, .. }) =
                    self.nodes.get_mut(&parent).map(|n| &mut n.content)
                {
                    durable.insert(name, child);
                }
                wanted.push(parent);
            }
        }
    }

    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let n = self.nodes.get(&ino)?;
        let (kind, size, nlink) = match &n.content {
            Content::File { data, .. } => (FileType::RegularFile, data.len() as u64, n.nlink),
            Content::Dir { entries, .. } => {
                let subdirs = entries
                    .values()
                    .filter(|c| self.nodes.get(c).is_some_and(Node::is_dir))
                    .count() as u32;
                (FileType::Directory, 4096, 2 + subdirs)
            }
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: n.atime,
            mtime: n.mtime,
            ctime: n.ctime,
            crtime: n.ctime,
            kind,
            perm: n.perm,
            nlink,
            uid: n.uid,
            gid: n.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        })
    }

    fn entries(&self, dir: u64) -> Result<&BTreeMap<OsString, u64>, i32> {
        match self.nodes.get(&dir).map(|n| &n.content) {
            Some(Content::Dir { entries, .. }) => Ok(entries),
            Some(_) => Err(libc::ENOTDIR),
            None => Err(libc::ENOENT),
        }
    }

    fn entries_mut(&mut self, dir: u64) -> Result<&mut BTreeMap<OsString, u64>, i32> {
        match self.nodes.get_mut(&dir).map(|n| &mut n.content) {
            Some(Content::Dir { entries, .. }) => Ok(entries),
            Some(_) => Err(libc::ENOTDIR),
            None => Err(libc::ENOENT),
        }
    }

    fn lookup(&self, parent: u64, name: &OsStr) -> Result<u64, i32> {
        self.entries(parent)?.get(name).copied().ok_or(libc::ENOENT)
    }

    fn touch(&mut self, ino: u64) {
        if let Some(n) = self.nodes.get_mut(&ino) {
            let now = SystemTime::now();
            n.mtime = now;
            n.ctime = now;
        }
    }

    /// A new node linked as `parent/name`.
    fn create(&mut self, parent: u64, name: &OsStr, node: Node) -> Result<u64, i32> {
        if self.entries(parent)?.contains_key(name) {
            return Err(libc::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.nodes.insert(ino, node);
        self.entries_mut(parent)?.insert(name.to_os_string(), ino);
        self.touch(parent);
        Ok(ino)
    }

    /// A change to a file's bytes: applied now, durable at the next sync.
    fn change(&mut self, ino: u64, op: Op) -> Result<(), i32> {
        match self.nodes.get_mut(&ino).map(|n| &mut n.content) {
            Some(Content::File { data, pending, .. }) => {
                apply(data, &op);
                pending.push(op);
            }
            Some(_) => return Err(libc::EISDIR),
            None => return Err(libc::ENOENT),
        }
        self.touch(ino);
        Ok(())
    }

    fn sync_file(&mut self, ino: u64) -> Result<(), i32> {
        match self.nodes.get_mut(&ino).map(|n| &mut n.content) {
            Some(Content::File {
                durable, pending, ..
            }) => {
                for op in pending.drain(..) {
                    apply(durable, &op);
                }
                if self.entries == Entries::WithFileFsync {
                    self.persist_path_to(ino);
                }
                Ok(())
            }
            Some(Content::Dir { .. }) => self.sync_dir(ino),
            None => Err(libc::ENOENT),
        }
    }

    fn sync_dir(&mut self, ino: u64) -> Result<(), i32> {
        match self.nodes.get_mut(&ino).map(|n| &mut n.content) {
            Some(Content::Dir { entries, durable }) => {
                *durable = entries.clone();
            }
            Some(Content::File { .. }) => return self.sync_file(ino),
            None => return Err(libc::ENOENT),
        }
        self.collect();
        Ok(())
    }

    /// Drops nodes that neither the current tree (links or open handles) nor the
    /// durable tree can reach any more.
    fn collect(&mut self) {
        let durable = self.reachable(true);
        self.nodes.retain(|ino, n| {
            *ino == FUSE_ROOT_ID || n.nlink > 0 || n.open > 0 || durable.contains(ino)
        });
    }

    fn reachable(&self, durable: bool) -> HashSet<u64> {
        let mut seen = HashSet::from([FUSE_ROOT_ID]);
        let mut stack = vec![FUSE_ROOT_ID];
        while let Some(ino) = stack.pop() {
            if let Some(Content::Dir {
                entries,
                durable: d,
            }) = self.nodes.get(&ino).map(|n| &n.content)
            {
                let children = if durable { d } else { entries };
                for c in children.values() {
                    if self.nodes.contains_key(c) && seen.insert(*c) {
                        stack.push(*c);
                    }
                }
            }
        }
        seen
    }

    fn unlink(&mut self, parent: u64, name: &OsStr, want_dir: bool) -> Result<(), i32> {
        let ino = self.lookup(parent, name)?;
        let node = self.nodes.get(&ino).ok_or(libc::ENOENT)?;
        match (&node.content, want_dir) {
            (Content::Dir { entries, .. }, true) => {
                if !entries.is_empty() {
                    return Err(libc::ENOTEMPTY);
                }
            }
            (Content::Dir { .. }, false) => return Err(libc::EISDIR),
            (Content::File { .. }, true) => return Err(libc::ENOTDIR),
            (Content::File { .. }, false) => {}
        }
        self.entries_mut(parent)?.remove(name);
        self.touch(parent);
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.nlink = n.nlink.saturating_sub(1);
            n.ctime = SystemTime::now();
        }
        self.collect();
        Ok(())
    }

    fn rename(
        &mut self,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
    ) -> Result<(), i32> {
        if flags & !libc::RENAME_NOREPLACE != 0 {
            return Err(libc::EINVAL);
        }
        let ino = self.lookup(parent, name)?;
        self.entries(newparent)?;
        if let Ok(target) = self.lookup(newparent, newname) {
            if target == ino {
                return Ok(());
            }
            if flags & libc::RENAME_NOREPLACE != 0 {
                return Err(libc::EEXIST);
            }
            let moving_dir = self.nodes.get(&ino).is_some_and(Node::is_dir);
            match self.nodes.get(&target).map(|n| &n.content) {
                Some(Content::Dir { entries, .. }) if !moving_dir || !entries.is_empty() => {
                    return Err(if moving_dir {
                        libc::ENOTEMPTY
                    } else {
                        libc::EISDIR
                    })
                }
                Some(Content::File { .. }) if moving_dir => return Err(libc::ENOTDIR),
                _ => {}
            }
            if let Some(t) = self.nodes.get_mut(&target) {
                t.nlink = t.nlink.saturating_sub(1);
            }
        }
        self.entries_mut(parent)?.remove(name);
        self.entries_mut(newparent)?
            .insert(newname.to_os_string(), ino);
        self.touch(parent);
        self.touch(newparent);
        self.collect();
        Ok(())
    }

    fn power_cut(&mut self, torn: Torn) -> CutReport {
        let mut report = CutReport::default();
        // One generator for the whole cut (files in the fixed order below; a cut that
        // loses everything draws nothing from it).
        let mut rng = match torn {
            Torn::Lost => crate::rng::Rng(0),
            Torn::Prefix(seed) | Torn::Garbled(seed) => crate::rng::Rng(seed),
        };
        // Files in a fixed order, so a seed always tears the same way.
        let mut inos: Vec<u64> = self.nodes.keys().copied().collect();
        inos.sort_unstable();
        for ino in inos {
            let Some(node) = self.nodes.get_mut(&ino) else {
                continue;
            };
            node.open = 0;
            match &mut node.content {
                Content::File {
                    data,
                    durable,
                    pending,
                } => {
                    if !pending.is_empty() {
                        report.files_with_unsynced_writes += 1;
                        report.unsynced_bytes += written_bytes(pending);
                        reach_the_disk(durable, pending, torn, &mut rng, &mut report);
                        pending.clear();
                    }
                    *data = durable.clone();
                }
                Content::Dir { entries, durable } => {
                    let undone = entries
                        .iter()
                        .filter(|(k, v)| durable.get(*k) != Some(v))
                        .count()
                        + durable.keys().filter(|k| !entries.contains_key(*k)).count();
                    report.entries_undone += undone;
                    *entries = durable.clone();
                }
            }
        }
        // Only what the durable tree reaches is left; links are counted again.
        let live = self.reachable(true);
        self.nodes.retain(|ino, _| live.contains(ino));
        let mut links: HashMap<u64, u32> = HashMap::new();
        for n in self.nodes.values() {
            if let Content::Dir { entries, .. } = &n.content {
                for c in entries.values() {
                    *links.entry(*c).or_default() += 1;
                }
            }
        }
        for (ino, n) in self.nodes.iter_mut() {
            n.nlink = if *ino == FUSE_ROOT_ID {
                1
            } else {
                links.get(ino).copied().unwrap_or(0)
            };
        }
        report
    }
}

/// Attributes are never cached by the kernel: every call asks (the state changes
/// behind its back at a power cut, and correctness matters more than speed here).
const TTL: Duration = Duration::ZERO;

struct Fs {
    disk: Arc<Mutex<Disk>>,
}

impl Fs {
    fn disk(&self) -> MutexGuard<'_, Disk> {
        self.disk.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn reply_entry(disk: &Disk, r: Result<u64, i32>, reply: ReplyEntry) {
    match r.and_then(|ino| disk.attr(ino).ok_or(libc::ENOENT)) {
        Ok(attr) => reply.entry(&TTL, &attr, 0),
        Err(e) => reply.error(e),
    }
}

fn empty(r: Result<(), i32>, reply: ReplyEmpty) {
    match r {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(e),
    }
}

impl Filesystem for Fs {
    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        let disk = self.disk();
        let r = disk.lookup(parent, name);
        reply_entry(&disk, r, reply);
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.disk().attr(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(libc::ENOENT),
        }
    }

    fn setattr(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<u64>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<u32>,
        reply: ReplyAttr,
    ) {
        let mut disk = self.disk();
        if let Some(len) = size {
            if let Err(e) = disk.change(ino, Op::SetLen(len)) {
                return reply.error(e);
            }
        }
        let Some(n) = disk.nodes.get_mut(&ino) else {
            return reply.error(libc::ENOENT);
        };
        let at = |t: TimeOrNow| match t {
            TimeOrNow::SpecificTime(t) => t,
            TimeOrNow::Now => SystemTime::now(),
        };
        if let Some(m) = mode {
            n.perm = (m & 0o7777) as u16;
        }
        if let Some(u) = uid {
            n.uid = u;
        }
        if let Some(g) = gid {
            n.gid = g;
        }
        if let Some(t) = atime {
            n.atime = at(t);
        }
        if let Some(t) = mtime {
            n.mtime = at(t);
        }
        n.ctime = SystemTime::now();
        match disk.attr(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(libc::ENOENT),
        }
    }

    fn mknod(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(libc::EPERM);
        }
        let mut disk = self.disk();
        let node = file_node(mode & !umask, req);
        let r = disk.create(parent, name, node);
        reply_entry(&disk, r, reply);
    }

    fn mkdir(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut disk = self.disk();
        let node = Node::new(
            Content::Dir {
                entries: BTreeMap::new(),
                durable: BTreeMap::new(),
            },
            ((mode & !umask) & 0o7777) as u16,
            req.uid(),
            req.gid(),
        );
        let r = disk.create(parent, name, node);
        reply_entry(&disk, r, reply);
    }

    fn unlink(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        empty(self.disk().unlink(parent, name, false), reply);
    }

    fn rmdir(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEmpty) {
        empty(self.disk().unlink(parent, name, true), reply);
    }

    fn rename(
        &mut self,
        _req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        newparent: u64,
        newname: &OsStr,
        flags: u32,
        reply: ReplyEmpty,
    ) {
        empty(
            self.disk().rename(parent, name, newparent, newname, flags),
            reply,
        );
    }

    fn link(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        newparent: u64,
        newname: &OsStr,
        reply: ReplyEntry,
    ) {
        let mut disk = self.disk();
        let r = (|| {
            if disk.nodes.get(&ino).ok_or(libc::ENOENT)?.is_dir() {
                return Err(libc::EPERM);
            }
            if disk.entries(newparent)?.contains_key(newname) {
                return Err(libc::EEXIST);
            }
            disk.entries_mut(newparent)?
                .insert(newname.to_os_string(), ino);
            if let Some(n) = disk.nodes.get_mut(&ino) {
                n.nlink += 1;
            }
            disk.touch(newparent);
            Ok(ino)
        })();
        reply_entry(&disk, r, reply);
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        let mut disk = self.disk();
        if flags & libc::O_TRUNC != 0 {
            if let Err(e) = disk.change(ino, Op::SetLen(0)) {
                return reply.error(e);
            }
        }
        match disk.nodes.get_mut(&ino) {
            Some(n) => {
                n.open += 1;
                reply.opened(0, 0);
            }
            None => reply.error(libc::ENOENT),
        }
    }

    fn create(
        &mut self,
        req: &Request<'_>,
        parent: u64,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let mut disk = self.disk();
        let ino = match disk.lookup(parent, name) {
            Ok(_) if flags & libc::O_EXCL != 0 => return reply.error(libc::EEXIST),
            Ok(ino) => {
                if flags & libc::O_TRUNC != 0 {
                    if let Err(e) = disk.change(ino, Op::SetLen(0)) {
                        return reply.error(e);
                    }
                }
                ino
            }
            Err(_) => match disk.create(parent, name, file_node(mode & !umask, req)) {
                Ok(ino) => ino,
                Err(e) => return reply.error(e),
            },
        };
        if let Some(n) = disk.nodes.get_mut(&ino) {
            n.open += 1;
        }
        match disk.attr(ino) {
            Some(a) => reply.created(&TTL, &a, 0, 0, 0),
            None => reply.error(libc::ENOENT),
        }
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let disk = self.disk();
        match disk.nodes.get(&ino).map(|n| &n.content) {
            Some(Content::File { data, .. }) => {
                let start = (offset.max(0) as usize).min(data.len());
                let end = (start + size as usize).min(data.len());
                reply.data(&data[start..end]);
            }
            Some(_) => reply.error(libc::EISDIR),
            None => reply.error(libc::ENOENT),
        }
    }

    fn write(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        data: &[u8],
        _write_flags: u32,
        flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyWrite,
    ) {
        let mut disk = self.disk();
        let op = Op::Write {
            offset: offset.max(0) as u64,
            data: data.to_vec(),
        };
        if let Err(e) = disk.change(ino, op) {
            return reply.error(e);
        }
        // O_SYNC / O_DSYNC writes are durable when they return.
        if flags & (libc::O_SYNC | libc::O_DSYNC) != 0 {
            if let Err(e) = disk.sync_file(ino) {
                return reply.error(e);
            }
        }
        reply.written(data.len() as u32);
    }

    fn flush(&mut self, _req: &Request<'_>, _ino: u64, _fh: u64, _owner: u64, reply: ReplyEmpty) {
        reply.ok();
    }

    fn release(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        _flags: i32,
        _lock_owner: Option<u64>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let mut disk = self.disk();
        if let Some(n) = disk.nodes.get_mut(&ino) {
            n.open = n.open.saturating_sub(1);
        }
        disk.collect();
        reply.ok();
    }

    fn fsync(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        empty(self.disk().sync_file(ino), reply);
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        let disk = self.disk();
        let entries = match disk.entries(ino) {
            Ok(e) => e,
            Err(e) => return reply.error(e),
        };
        let mut all: Vec<(u64, FileType, OsString)> = vec![
            (ino, FileType::Directory, ".".into()),
            (ino, FileType::Directory, "..".into()),
        ];
        for (name, child) in entries {
            let kind = if disk.nodes.get(child).is_some_and(Node::is_dir) {
                FileType::Directory
            } else {
                FileType::RegularFile
            };
            all.push((*child, kind, name.clone()));
        }
        for (i, (child, kind, name)) in all.into_iter().enumerate().skip(offset.max(0) as usize) {
            if reply.add(child, (i + 1) as i64, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        empty(self.disk().sync_dir(ino), reply);
    }

    fn statfs(&mut self, _req: &Request<'_>, _ino: u64, reply: ReplyStatfs) {
        // Plenty of room: 64 GiB in 4 KiB blocks.
        reply.statfs(1 << 24, 1 << 24, 1 << 24, 1 << 20, 1 << 20, 4096, 255, 4096);
    }

    fn fallocate(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        length: i64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut disk = self.disk();
        // Only plain allocation: with FALLOC_FL_KEEP_SIZE nothing visible changes.
        if mode & !libc::FALLOC_FL_KEEP_SIZE != 0 {
            return reply.error(libc::EOPNOTSUPP);
        }
        if mode & libc::FALLOC_FL_KEEP_SIZE != 0 {
            return reply.ok();
        }
        let end = (offset.max(0) + length.max(0)) as u64;
        let len = match disk.nodes.get(&ino).map(|n| &n.content) {
            Some(Content::File { data, .. }) => data.len() as u64,
            Some(_) => return reply.error(libc::EISDIR),
            None => return reply.error(libc::ENOENT),
        };
        if end > len {
            if let Err(e) = disk.change(ino, Op::SetLen(end)) {
                return reply.error(e);
            }
        }
        reply.ok();
    }
}

fn file_node(mode: u32, req: &Request<'_>) -> Node {
    Node::new(
        Content::File {
            data: Vec::new(),
            durable: Vec::new(),
            pending: Vec::new(),
        },
        (mode & 0o7777) as u16,
        req.uid(),
        req.gid(),
    )
}

/// A mounted lazy filesystem (see the module docs). Unmounted on drop.
pub struct LazyFs {
    disk: Arc<Mutex<Disk>>,
    session: Option<fuser::BackgroundSession>,
    mountpoint: PathBuf,
    _dir: tempfile::TempDir,
}

impl LazyFs {
    /// Mounts an empty lazy filesystem on a fresh temporary directory, with POSIX's
    /// rule for directory entries ([`Entries::DirectoryFsync`]).
    pub fn mount() -> anyhow::Result<Self> {
        Self::mount_with(Entries::DirectoryFsync)
    }

    /// [`LazyFs::mount`] with the given rule for directory entries.
    pub fn mount_with(entries: Entries) -> anyhow::Result<Self> {
        if !Path::new("/dev/fuse").exists() {
            return Err(anyhow!(
                "/dev/fuse does not exist: the power-cut tests need FUSE (the kernel module; Debian's fuse3 for non-root mounts)"
            ));
        }
        let dir = tempfile::Builder::new().prefix("meshd-lazyfs-").tempdir()?;
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&mountpoint)?;
        let mut disk = Disk::new();
        disk.entries = entries;
        let mut fs = Self {
            disk: Arc::new(Mutex::new(disk)),
            session: None,
            mountpoint,
            _dir: dir,
        };
        fs.attach()?;
        Ok(fs)
    }

    fn attach(&mut self) -> anyhow::Result<()> {
        let options = [
            MountOption::FSName("meshd-lazyfs".into()),
            MountOption::RW,
            MountOption::AllowOther,
        ];
        let fs = Fs {
            disk: self.disk.clone(),
        };
        let session = fuser::spawn_mount2(fs, &self.mountpoint, &options).with_context(|| {
            format!(
                "mounting the lazy filesystem on {}",
                self.mountpoint.display()
            )
        })?;
        self.session = Some(session);
        Ok(())
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// The power cut (see the module docs). Kill every process that has files open
    /// here first: their writes in flight would otherwise land after the cut. The
    /// kernel closes a killed process's files shortly after it is reaped; the cut
    /// waits (a few seconds at most) until no file is open, and refuses otherwise.
    pub fn power_cut(&mut self, torn: Torn) -> anyhow::Result<CutReport> {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let open: u32 = self
                .disk
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .nodes
                .values()
                .map(|n| n.open)
                .sum();
            if open == 0 {
                break;
            }
            if std::time::Instant::now() >= deadline {
                return Err(anyhow!(
                    "{open} files are still open on the lazy filesystem: kill the processes using it before the power cut"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.detach();
        let report = self
            .disk
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .power_cut(torn);
        self.attach()?;
        Ok(report)
    }

    /// Bytes written but not yet synced, over every file (what a cut now would put at
    /// risk).
    pub fn unsynced_bytes(&self) -> u64 {
        let disk = self.disk.lock().unwrap_or_else(|e| e.into_inner());
        disk.nodes
            .values()
            .map(|n| match &n.content {
                Content::File { pending, .. } => written_bytes(pending),
                Content::Dir { .. } => 0,
            })
            .sum()
    }
}

impl LazyFs {
    /// Unmounts and waits for the session thread. Its result is not an error of
    /// ours: it ends when the kernel closes the connection, which it reports as it
    /// likes (fuser's own `join` panics on that).
    fn detach(&mut self) {
        let Some(session) = self.session.take() else {
            return;
        };
        let guard = {
            let s = session;
            let fuser::BackgroundSession { guard, .. } = s;
            guard
            // The rest of the session (the mount) is dropped here: unmounted.
        };
        let _ = guard.join();
    }
}

impl Drop for LazyFs {
    fn drop(&mut self) {
        self.detach();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::{self, File, OpenOptions};
    use std::io::Write;

    fn sync_dir(p: &Path) {
        File::open(p).unwrap().sync_all().unwrap();
    }

    #[test]
    fn an_unsynced_write_is_lost_and_a_synced_one_kept() {
        let mut fs = LazyFs::mount().unwrap();
        let root = fs.path().to_path_buf();
        let d = root.join("d");
        fs::create_dir(&d).unwrap();
        sync_dir(&root);
        let synced = d.join("synced");
        let mut f = File::create(&synced).unwrap();
        f.write_all(b"durable").unwrap();
        f.sync_all().unwrap();
        sync_dir(&d);
        f.write_all(b" and then more").unwrap();
        drop(f);
        assert_eq!(
            fs::read(&synced).unwrap(),
            b"durable and then more",
            "visible before the cut"
        );
        assert_eq!(fs.unsynced_bytes(), 14);

        let report = fs.power_cut(Torn::Lost).unwrap();
        assert_eq!(report.files_with_unsynced_writes, 1);
        assert_eq!(report.unsynced_bytes, 14);
        assert_eq!(
            fs::read(&synced).unwrap(),
            b"durable",
            "only the synced bytes"
        );
        assert_eq!(fs.unsynced_bytes(), 0);
    }

    #[test]
    fn a_create_or_rename_without_a_directory_fsync_is_undone() {
        let mut fs = LazyFs::mount().unwrap();
        let root = fs.path().to_path_buf();
        // Synced data whose entry reaches the disk with the directory sync below.
        let mut f = File::create(root.join("orphan")).unwrap();
        f.write_all(b"x").unwrap();
        f.sync_all().unwrap();
        // A file made durable the way RocksDB writes CURRENT: temp file, sync, rename,
        // sync the directory.
        let mut t = File::create(root.join("tmp")).unwrap();
        t.write_all(b"v2").unwrap();
        t.sync_all().unwrap();
        fs::rename(root.join("tmp"), root.join("current")).unwrap();
        sync_dir(&root);
        // A rename after the last directory sync is undone.
        fs::rename(root.join("current"), root.join("moved")).unwrap();
        drop((f, t));
        let report = fs.power_cut(Torn::Lost).unwrap();
        assert!(report.entries_undone >= 2, "{report:?}");
        assert_eq!(fs::read(root.join("current")).unwrap(), b"v2");
        assert!(!root.join("moved").exists());
        // "orphan" was in the directory when it was synced (the sync came after the
        // create), so it stays: only changes after a directory sync are undone.
        assert_eq!(fs::read(root.join("orphan")).unwrap(), b"x");
        let gone = root.join("late");
        File::create(&gone).unwrap().sync_all().unwrap();
        fs.power_cut(Torn::Lost).unwrap();
        assert!(!gone.exists(), "created after the last directory sync");
    }

    #[test]
    fn with_file_fsync_entries_a_synced_new_file_keeps_its_name() {
        let mut fs = LazyFs::mount_with(Entries::WithFileFsync).unwrap();
        let root = fs.path().to_path_buf();
        fs::create_dir(root.join("d")).unwrap();
        let mut f = File::create(root.join("d/synced")).unwrap();
        f.write_all(b"x").unwrap();
        f.sync_all().unwrap();
        File::create(root.join("d/unsynced")).unwrap();
        drop(f);
        fs.power_cut(Torn::Lost).unwrap();
        assert_eq!(fs::read(root.join("d/synced")).unwrap(), b"x");
        assert!(!root.join("d/unsynced").exists());
    }

    #[test]
    fn a_cut_is_refused_while_a_file_is_open() {
        let mut fs = LazyFs::mount().unwrap();
        let f = File::create(fs.path().join("held")).unwrap();
        let e = fs.power_cut(Torn::Lost).unwrap_err();
        assert!(e.to_string().contains("still open"), "{e}");
        drop(f);
        fs.power_cut(Torn::Lost).unwrap();
    }

    /// A synced empty file `log` on `fs` with ten unsynced writes of 100 bytes after
    /// it (`a…`, `b…`, …).
    fn ten_unsynced_writes(fs: &LazyFs) -> std::path::PathBuf {
        let root = fs.path().to_path_buf();
        let p = root.join("log");
        let mut f = File::create(&p).unwrap();
        sync_dir(&root);
        f.sync_all().unwrap();
        for i in 0..10u8 {
            f.write_all(&[b'a' + i; 100]).unwrap();
        }
        p
    }

    #[test]
    fn a_torn_cut_keeps_a_prefix_of_the_unsynced_writes() {
        let mut kept_any = false;
        let mut lost_any = false;
        for seed in 0..8 {
            let mut fs = LazyFs::mount().unwrap();
            let p = ten_unsynced_writes(&fs);
            fs.power_cut(Torn::Prefix(seed)).unwrap();
            let got = fs::read(&p).unwrap();
            let want: Vec<u8> = (0..10u8).flat_map(|i| [b'a' + i; 100]).collect();
            assert!(want.starts_with(&got), "a prefix, never anything else");
            kept_any |= !got.is_empty();
            lost_any |= got.len() < want.len();
        }
        assert!(kept_any && lost_any, "seeds tear at different points");
    }

    #[test]
    fn a_garbled_cut_keeps_every_unsynced_write_but_one_earlier_one_half_garbage() {
        let mut fs = LazyFs::mount().unwrap();
        let p = ten_unsynced_writes(&fs);
        let report = fs.power_cut(Torn::Garbled(3)).unwrap();
        assert_eq!(report.garbled_bytes, 50, "{report:?}");
        let got = fs::read(&p).unwrap();
        assert_eq!(got.len(), 1000, "every write is there");
        let bad: Vec<usize> = (0..10)
            .filter(|i| got[i * 100..(i + 1) * 100] != [b'a' + *i as u8; 100])
            .collect();
        assert_eq!(bad.len(), 1, "exactly one write garbled: {bad:?}");
        assert!(
            bad[0] < 9,
            "never the last: a damaged record with intact ones after it"
        );
        let c = b'a' + bad[0] as u8;
        let write = &got[bad[0] * 100..(bad[0] + 1) * 100];
        assert!(write[..50].iter().all(|b| *b == c), "its first half intact");
        assert!(
            write[50..].iter().all(|b| *b == !c),
            "its second half garbage"
        );
    }

    #[test]
    fn an_unlinked_file_comes_back_until_its_directory_is_synced() {
        let mut fs = LazyFs::mount().unwrap();
        let root = fs.path().to_path_buf();
        let p = root.join("f");
        let mut f = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&p)
            .unwrap();
        f.write_all(b"keep").unwrap();
        f.sync_all().unwrap();
        sync_dir(&root);
        drop(f);
        fs::remove_file(&p).unwrap();
        fs.power_cut(Torn::Lost).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"keep");
        fs::remove_file(&p).unwrap();
        sync_dir(&root);
        fs.power_cut(Torn::Lost).unwrap();
        assert!(!p.exists());
    }
}
