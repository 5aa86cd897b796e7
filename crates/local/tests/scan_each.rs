//! `KvEngine::scan_each` against the real RocksDB, both RocksDB's own (one iterator)
//! and the trait's default (chunks of `scan`, as wrapper engines read): every key of
//! the range once, in order, nothing outside it, keys that extend a chunk's last key
//! neither lost nor repeated, and an early stop stops.

use meshd_local::{Batch, Durability, KvEngine, LocalError, RocksEngine, Rows, SCAN_EACH_STEP};

const CF: &str = "data";

/// RocksDB behind only the required methods: `scan_each` is the trait's default.
struct Chunked(RocksEngine);

impl KvEngine for Chunked {
    fn get(&self, cf: &'static str, key: &[u8]) -> Result<Option<Vec<u8>>, LocalError> {
        self.0.get(cf, key)
    }
    fn scan(
        &self,
        cf: &'static str,
        start: &[u8],
        end: Option<&[u8]>,
        limit: usize,
    ) -> Result<Rows, LocalError> {
        self.0.scan(cf, start, end, limit)
    }
    fn write(&self, batch: Batch, durability: Durability) -> Result<(), LocalError> {
        self.0.write(batch, durability)
    }
    fn sync(&self) -> Result<(), LocalError> {
        self.0.sync()
    }
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
}

fn value_of(k: &[u8]) -> Vec<u8> {
    k.iter().rev().copied().collect()
}

fn all(engine: &dyn KvEngine, start: &[u8], end: &[u8]) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    engine
        .scan_each(CF, start, end, &mut |k, v| {
            assert_eq!(v, value_of(k));
            got.push(k.to_vec());
            true
        })
        .unwrap();
    got
}

#[test]
fn given_a_range_larger_than_a_chunk_when_scanned_each_then_every_key_comes_once_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let engine = RocksEngine::open(dir.path(), &[CF]).unwrap();
    let mut b = Batch::default();
    let mut keys: Vec<Vec<u8>> = Vec::new();
    // More than two chunks of the default; each key also extended by one byte, which
    // sorts right after it (where a chunk resumes).
    for i in 0..(SCAN_EACH_STEP as u32 * 5 / 4) {
        let k = [b"k".as_slice(), &i.to_be_bytes()].concat();
        keys.push([k.as_slice(), &[0]].concat());
        keys.push(k);
    }
    for k in &keys {
        b.put(CF, k.clone(), value_of(k));
    }
    // Outside the range on both sides.
    b.put(CF, b"a".to_vec(), b"x".to_vec());
    b.put(CF, b"l".to_vec(), b"x".to_vec());
    engine.write(b, Durability::Sync).unwrap();
    keys.sort();
    let chunked = Chunked(engine);
    for e in [&chunked.0 as &dyn KvEngine, &chunked] {
        assert_eq!(all(e, b"k", b"l"), keys);
        assert_eq!(all(e, b"m", b"z"), Vec::<Vec<u8>>::new());
        // Stops when told.
        let mut n = 0;
        e.scan_each(CF, b"k", b"l", &mut |_, _| {
            n += 1;
            n < SCAN_EACH_STEP + 3
        })
        .unwrap();
        assert_eq!(n, SCAN_EACH_STEP + 3);
    }
}
