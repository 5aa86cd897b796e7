//! Scenario 4, meta: the two writes meshd's cluster state is made of, measured through
//! meshd's Meta backends and through the raw etcd client.
//!
//! * `cas`: a conditional put, put-if-absent on a fresh key (every request writes a new
//!   key; `Precondition::Absent`, on etcd `create_revision == 0`).
//! * `fenced`: a fenced transaction, as every durable write of an owner is (see
//!   `meshd_meta::fence`): compare the worker's owner key's `mod_revision` with the
//!   epoch it acquired it at, then put the worker's checkpoint key.
//!
//! The question is what meshd's etcd backend costs over a hand-written client sending
//! the same transaction, so the raw client sends the smallest transaction with the same
//! effect: the compare and the put, without the `or_else` read-back meshd adds to name
//! the current value in a `Conflict` (etcd does not run that branch when the compare
//! holds, but it is in every request). Both talk to the same kind of fresh single-member
//! etcd over one HTTP/2 connection shared by all workers (etcd-client multiplexes
//! concurrent requests on its channel). The embedded backend runs in this process, so
//! its CPU column is this process's own (store plus load driver), as for raw RocksDB.

use crate::load::{self, Op};
use crate::procs::{self, Server};
use crate::systems::{with_stderr, Config, Outcome};
use anyhow::{anyhow, bail, Context, Result};
use etcd_client::{Compare, CompareOp, KvClient, TxnOp};
use futures::future::BoxFuture;
use futures::FutureExt;
use meshd_meta::fence::Ownership;
use meshd_meta::{Meta, Precondition, Txn};
use meshd_meta_embedded::{EmbeddedConfig, EmbeddedMeta};
use meshd_meta_etcd::{EtcdConfig, EtcdMeta};
use std::path::Path;
use std::sync::Arc;

/// Which write is measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetaOp {
    /// Put-if-absent on a fresh key.
    Cas,
    /// Compare the owner key's `mod_revision`, then put.
    Fenced,
}

/// What the write goes through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MetaPath {
    /// `meshd_meta_etcd::EtcdMeta` through the `Meta` trait.
    MeshdEtcd,
    /// `etcd_client` directly.
    RawEtcd,
    /// `meshd_meta_embedded::EmbeddedMeta` (its own RocksDB in a temp dir).
    MeshdEmbedded,
}

pub const ETCD_DURABILITY: &str = "etcd: raft commit + WAL fsync per commit (1 member)";
pub const EMBEDDED_DURABILITY: &str = "group-commit fsync (one writer thread)";

fn worker_key(kind: &str, worker: usize) -> Vec<u8> {
    format!("bench/{kind}/{worker}").into_bytes()
}

// ---- through the Meta trait (etcd and embedded backends) ----------------------------

struct MeshdCas {
    meta: Arc<dyn Meta>,
    prefix: Vec<u8>,
    key: Vec<u8>,
    seq: u64,
    value: Arc<[u8]>,
}

impl Op for MeshdCas {
    fn call(&mut self) -> BoxFuture<'_, Result<()>> {
        async move {
            self.key.clear();
            self.key.extend_from_slice(&self.prefix);
            self.key.extend_from_slice(self.seq.to_string().as_bytes());
            self.seq += 1;
            self.meta
                .put(&self.key, &self.value, Precondition::Absent, None)
                .await
                .context("meta put-if-absent")?;
            Ok(())
        }
        .boxed()
    }
}

struct MeshdFenced {
    meta: Arc<dyn Meta>,
    owner: Ownership,
    key: Vec<u8>,
    value: Arc<[u8]>,
}

impl Op for MeshdFenced {
    fn call(&mut self) -> BoxFuture<'_, Result<()>> {
        async move {
            self.owner
                .commit(self.meta.as_ref(), Txn::new().put(&self.key, &self.value))
                .await
                .context("meta fenced txn")?;
            Ok(())
        }
        .boxed()
    }
}

async fn meshd_ops(meta: Arc<dyn Meta>, op: MetaOp, cfg: &Config) -> Result<Vec<Box<dyn Op>>> {
    let mut ops: Vec<Box<dyn Op>> = Vec::with_capacity(cfg.concurrency);
    for worker in 0..cfg.concurrency {
        match op {
            MetaOp::Cas => {
                let mut prefix = worker_key("cas", worker);
                prefix.push(b'/');
                ops.push(Box::new(MeshdCas {
                    meta: meta.clone(),
                    prefix,
                    key: Vec::new(),
                    seq: 0,
                    value: cfg.meta_value.clone(),
                }));
            }
            MetaOp::Fenced => {
                let owner = Ownership::acquire(
                    meta.as_ref(),
                    &worker_key("owner", worker),
                    b"meshd-bench",
                    None,
                )
                .await
                .context("acquiring the owner key")?;
                ops.push(Box::new(MeshdFenced {
                    meta: meta.clone(),
                    owner,
                    key: worker_key("checkpoint", worker),
                    value: cfg.meta_value.clone(),
                }));
            }
        }
    }
    Ok(ops)
}

// ---- the raw etcd client -------------------------------------------------------------

struct RawCas {
    kv: KvClient,
    prefix: Vec<u8>,
    seq: u64,
    value: Arc<[u8]>,
}

impl Op for RawCas {
    fn call(&mut self) -> BoxFuture<'_, Result<()>> {
        async move {
            let mut key = self.prefix.clone();
            key.extend_from_slice(self.seq.to_string().as_bytes());
            self.seq += 1;
            let txn = etcd_client::Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key, self.value.to_vec(), None)]);
            let r = self.kv.txn(txn).await.context("etcd put-if-absent txn")?;
            if !r.succeeded() {
                bail!("etcd put-if-absent: the key already existed");
            }
            Ok(())
        }
        .boxed()
    }
}

struct RawFenced {
    kv: KvClient,
    owner: Vec<u8>,
    epoch: i64,
    key: Vec<u8>,
    value: Arc<[u8]>,
}

impl Op for RawFenced {
    fn call(&mut self) -> BoxFuture<'_, Result<()>> {
        async move {
            let txn = etcd_client::Txn::new()
                .when([Compare::mod_revision(
                    self.owner.clone(),
                    CompareOp::Equal,
                    self.epoch,
                )])
                .and_then([TxnOp::put(self.key.clone(), self.value.to_vec(), None)]);
            let r = self.kv.txn(txn).await.context("etcd fenced txn")?;
            if !r.succeeded() {
                bail!("etcd fenced txn: fenced (the owner key moved)");
            }
            Ok(())
        }
        .boxed()
    }
}

async fn raw_ops(
    client: &etcd_client::Client,
    op: MetaOp,
    cfg: &Config,
) -> Result<Vec<Box<dyn Op>>> {
    let mut ops: Vec<Box<dyn Op>> = Vec::with_capacity(cfg.concurrency);
    for worker in 0..cfg.concurrency {
        let mut kv = client.kv_client();
        match op {
            MetaOp::Cas => {
                let mut prefix = worker_key("cas", worker);
                prefix.push(b'/');
                ops.push(Box::new(RawCas {
                    kv,
                    prefix,
                    seq: 0,
                    value: cfg.meta_value.clone(),
                }));
            }
            MetaOp::Fenced => {
                // Acquire like `Ownership::acquire`: create the owner key, its epoch is
                // the revision of that write.
                let owner = worker_key("owner", worker);
                let txn = etcd_client::Txn::new()
                    .when([Compare::create_revision(owner.clone(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(owner.clone(), b"meshd-bench".to_vec(), None)]);
                let r = kv.txn(txn).await.context("acquiring the owner key")?;
                if !r.succeeded() {
                    bail!("acquiring the owner key: it already existed");
                }
                let epoch = r
                    .header()
                    .map(|h| h.revision())
                    .ok_or_else(|| anyhow!("etcd answered a txn without a header"))?;
                ops.push(Box::new(RawFenced {
                    kv,
                    owner,
                    epoch,
                    key: worker_key("checkpoint", worker),
                    value: cfg.meta_value.clone(),
                }));
            }
        }
    }
    Ok(ops)
}

// ---- runs ----------------------------------------------------------------------------

pub async fn run(path: MetaPath, op: MetaOp, cfg: &Config, etcd: Option<&Path>) -> Result<Outcome> {
    match path {
        MetaPath::MeshdEmbedded => {
            let dir = tempfile::Builder::new()
                .prefix("meshd-bench-meta-")
                .tempdir()
                .context("creating a temp dir for the embedded meta")?;
            let meta = EmbeddedMeta::open_dir(dir.path(), EmbeddedConfig::default())
                .context("opening the embedded meta")?;
            let meta: Arc<dyn Meta> = Arc::new(meta);
            let ops = meshd_ops(meta.clone(), op, cfg).await?;
            let measured = load::drive_async(ops, 1, cfg.window, Some(std::process::id())).await?;
            // Close (join the writer) before the temp dir goes.
            drop(meta);
            Ok(Outcome {
                measured,
                peak_rss_bytes: None,
            })
        }
        MetaPath::MeshdEtcd | MetaPath::RawEtcd => {
            let etcd = etcd.ok_or_else(|| anyhow!(procs::ETCD_NOT_FOUND))?;
            let server = procs::start_etcd(etcd)?;
            let measured = with_stderr(&server, run_on_etcd(&server, path, op, cfg).await)?;
            let peak = procs::peak_rss_bytes(server.pid())?;
            Ok(Outcome {
                measured,
                peak_rss_bytes: Some(peak),
            })
        }
    }
}

async fn run_on_etcd(
    server: &Server,
    path: MetaPath,
    op: MetaOp,
    cfg: &Config,
) -> Result<load::Measured> {
    let endpoint = server.addr.to_string();
    let client = procs::etcd_when_serving(server).await?;
    let ops = if path == MetaPath::RawEtcd {
        raw_ops(&client, op, cfg).await?
    } else {
        drop(client);
        let meta = EtcdMeta::connect(EtcdConfig::new([endpoint.clone()]))
            .await
            .context("connecting meshd's etcd backend")?;
        meshd_ops(Arc::new(meta), op, cfg).await?
    };
    load::drive_async(ops, 1, cfg.window, Some(server.pid())).await
}
