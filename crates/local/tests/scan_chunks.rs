//! `scan_chunks` against the real RocksDB: every key of the range, in order, whatever
//! the chunk size, nothing past the end, and keys that extend a chunk's last key (the
//! resume point is just after it) neither lost nor repeated.

use meshd_local::{scan_chunks, Batch, Durability, KvEngine, RocksEngine};

const CF: &str = "data";

#[test]
fn given_a_range_when_scanned_in_chunks_then_every_key_comes_once_in_order_for_any_step() {
    let dir = tempfile::tempdir().unwrap();
    let engine = RocksEngine::open(dir.path(), &[CF]).unwrap();
    let mut b = Batch::default();
    let mut keys: Vec<Vec<u8>> = Vec::new();
    for i in 0..20u8 {
        keys.push(vec![b'k', i]);
        // A key that extends another: sorts right after it.
        keys.push(vec![b'k', i, 0]);
    }
    for k in &keys {
        b.put(CF, k.clone(), k.iter().rev().copied().collect::<Vec<u8>>());
    }
    // Outside the range on both sides.
    b.put(CF, b"a".to_vec(), b"x".to_vec());
    b.put(CF, b"l".to_vec(), b"x".to_vec());
    engine.write(b, Durability::Sync).unwrap();
    keys.sort();
    for step in [0, 1, 2, 3, 7, 40, 41, 1000] {
        let got: Vec<(Vec<u8>, Vec<u8>)> = scan_chunks(&engine, CF, b"k", b"l", step)
            .collect::<Result<_, _>>()
            .unwrap();
        let got_keys: Vec<Vec<u8>> = got.iter().map(|(k, _)| k.clone()).collect();
        assert_eq!(got_keys, keys, "step {step}");
        assert!(got
            .iter()
            .all(|(k, v)| v == &k.iter().rev().copied().collect::<Vec<u8>>()));
    }
    assert_eq!(scan_chunks(&engine, CF, b"m", b"z", 3).count(), 0);
}
