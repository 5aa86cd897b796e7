//! The Meta conformance suite against EmbeddedMeta. "Restart" closes the store
//! (stopping its writer and releasing RocksDB and the directory lock) and reopens the
//! same directory, which runs the same recovery as a process start.

use async_trait::async_trait;
use meshd_meta::Meta;
use meshd_meta_embedded::{EmbeddedConfig, EmbeddedMeta};
use meshd_test_support::conformance::MetaHarness;
use std::sync::Arc;

struct Embedded {
    dir: tempfile::TempDir,
    meta: Arc<EmbeddedMeta>,
}

async fn harness() -> Embedded {
    let dir = tempfile::tempdir().expect("temp dir");
    let meta = EmbeddedMeta::open_dir(dir.path(), EmbeddedConfig::default()).expect("open");
    Embedded {
        dir,
        meta: Arc::new(meta),
    }
}

#[async_trait]
impl MetaHarness for Embedded {
    fn meta(&self) -> Arc<dyn Meta> {
        self.meta.clone()
    }

    async fn restart(&mut self) -> anyhow::Result<()> {
        self.meta.close();
        self.meta = Arc::new(EmbeddedMeta::open_dir(
            self.dir.path(),
            EmbeddedConfig::default(),
        )?);
        Ok(())
    }
}

meshd_test_support::meta_conformance_tests!(embedded, crate::harness());
