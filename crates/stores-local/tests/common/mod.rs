//! Opening the Local stores for tests: on a real RocksDB, optionally behind the
//! power-cut fault injector, and reopening from what survived.

#![allow(dead_code)]

use meshd_local::testing::{DurableImage, PowerCut, PowerCutEngine};
use meshd_local::{KvEngine, RocksEngine};
use meshd_stores_local::keys::COLUMN_FAMILIES;
use meshd_stores_local::LocalStores;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub const FLUSH: Duration = Duration::from_millis(50);

pub fn open(dir: &Path) -> LocalStores {
    let engine = RocksEngine::open(dir, COLUMN_FAMILIES).expect("open rocksdb");
    LocalStores::open(Arc::new(engine), "test-instance", FLUSH).expect("open local stores")
}

/// Local stores over a power-cut engine, and its switch.
pub fn open_with_power_cut(dir: &Path) -> (LocalStores, PowerCut) {
    let engine = RocksEngine::open(dir, COLUMN_FAMILIES).expect("open rocksdb");
    let (engine, power) = PowerCutEngine::wrap(engine, COLUMN_FAMILIES).expect("wrap");
    let engine: Arc<dyn KvEngine> = Arc::new(engine);
    (
        LocalStores::open(engine, "test-instance", FLUSH).expect("open local stores"),
        power,
    )
}

/// Boots fresh stores in `dir` from what was durable at the cut.
pub fn reboot_from(image: &DurableImage, dir: &Path) -> LocalStores {
    {
        let fresh = RocksEngine::open(dir, COLUMN_FAMILIES).expect("open rocksdb");
        image.restore_into(&fresh).expect("restore image");
    }
    open(dir)
}
