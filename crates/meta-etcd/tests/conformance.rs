//! The Meta conformance suite against a real etcd (Debian's etcd-server 3.4), one
//! throwaway etcd process per case. "Restart" SIGKILLs the etcd process and starts it
//! again on the same data dir and ports; the same `EtcdMeta` client is kept and must
//! recover on its own.

use async_trait::async_trait;
use meshd_meta::Meta;
use meshd_meta_etcd::{EtcdConfig, EtcdMeta};
use meshd_test_support::conformance::MetaHarness;
use meshd_test_support::etcd::EtcdProcess;
use std::sync::Arc;

struct Etcd {
    process: EtcdProcess,
    meta: Arc<EtcdMeta>,
}

async fn harness() -> Etcd {
    let process = EtcdProcess::start().await.expect("start etcd");
    let meta = EtcdMeta::connect(EtcdConfig::new([process.endpoint()]))
        .await
        .expect("connect");
    Etcd {
        process,
        meta: Arc::new(meta),
    }
}

#[async_trait]
impl MetaHarness for Etcd {
    fn meta(&self) -> Arc<dyn Meta> {
        self.meta.clone()
    }

    async fn restart(&mut self) -> anyhow::Result<()> {
        self.process.kill();
        self.process.restart().await
    }
}

meshd_test_support::meta_conformance_tests!(etcd, crate::harness());
