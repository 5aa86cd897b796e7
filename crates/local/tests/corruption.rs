//! Damaged bytes on disk, against the real RocksDB: a flipped byte in the
//! write-ahead log stops the open (no silent point-in-time cut), a flipped byte in an
//! SST is reported on read with its column family and key, and the engine
//! fail-stops.

use meshd_local::{Batch, Durability, KvEngine, LocalError, RocksEngine};
use std::path::{Path, PathBuf};

const CF: &str = "data";

fn files_with_ext(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    out.sort();
    out
}

/// Flips one bit of `file` at `at` (a fraction of its length).
fn flip(file: &Path, at: f64) {
    let mut bytes = std::fs::read(file).unwrap();
    let i = ((bytes.len() as f64) * at) as usize;
    bytes[i] ^= 0x10;
    std::fs::write(file, bytes).unwrap();
}

fn fill(engine: &RocksEngine, n: u32) {
    for i in 0..n {
        let mut b = Batch::default();
        b.put(
            CF,
            format!("key-{i:05}").into_bytes(),
            format!("value {i} {}", "v".repeat(200)).into_bytes(),
        );
        engine.write(b, Durability::Sync).unwrap();
    }
}

#[test]
fn given_a_flipped_byte_in_the_middle_of_the_wal_when_opening_then_the_open_fails_naming_corruption_instead_of_dropping_later_writes(
) {
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = RocksEngine::open(dir.path(), &[CF]).unwrap();
        fill(&engine, 500);
    }
    let wals = files_with_ext(dir.path(), "log");
    let wal = wals
        .iter()
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("a WAL file");
    flip(wal, 0.3);
    let err = RocksEngine::open(dir.path(), &[CF])
        .err()
        .expect("a damaged WAL must not open");
    assert!(matches!(err, LocalError::OpenCorrupt { .. }), "{err:?}");
    assert!(err.to_string().contains("Corruption"), "{err}");
}

#[test]
fn given_a_flipped_byte_in_an_sst_when_reading_then_corrupt_is_reported_with_the_key_and_the_engine_fail_stops(
) {
    let dir = tempfile::tempdir().unwrap();
    {
        let engine = RocksEngine::open(dir.path(), &[CF]).unwrap();
        fill(&engine, 500);
        engine.flush_all().unwrap();
    }
    let ssts = files_with_ext(dir.path(), "sst");
    assert_eq!(ssts.len(), 1, "{ssts:?}");
    // Early in the file: inside the first data block.
    flip(&ssts[0], 0.01);
    let engine = RocksEngine::open(dir.path(), &[CF]).unwrap();
    assert_eq!(engine.failure(), None);
    let err = engine.get(CF, b"key-00000").unwrap_err();
    match &err {
        LocalError::Corrupt { cf, key, reason } => {
            assert_eq!(*cf, CF);
            assert_eq!(key, "key-00000");
            assert!(reason.contains("Corruption"), "{reason}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    let failure = engine.failure().expect("fail-stopped");
    assert!(failure.contains("key-00000"), "{failure}");
    // A scan over the damaged block fails too, and nothing is written any more.
    assert!(matches!(
        engine.scan(CF, b"key-", None, 0),
        Err(LocalError::Corrupt { .. })
    ));
    let mut b = Batch::default();
    b.put(CF, b"after".to_vec(), b"x".to_vec());
    assert!(matches!(
        engine.write(b, Durability::Sync),
        Err(LocalError::Poisoned(_))
    ));
}
