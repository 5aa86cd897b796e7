//! The key catalog (`docs/key-catalog.md`) names every column family and every Meta
//! key kind the code uses: adding one without documenting it fails here.

use meshd_meta::keys::KeyKind;
use meshd_stores_local::keys::COLUMN_FAMILIES;

fn catalog() -> String {
    // At run time: a test binary reused from another checkout's build would read
    // that checkout's catalog.
    let path = format!(
        "{}/../../docs/key-catalog.md",
        std::env::var("CARGO_MANIFEST_DIR").expect("run by cargo")
    );
    std::fs::read_to_string(path).expect("docs/key-catalog.md exists")
}

#[test]
fn every_local_column_family_is_in_the_catalog() {
    let doc = catalog();
    for cf in COLUMN_FAMILIES {
        assert!(
            doc.contains(&format!("| `{cf}` |")),
            "column family {cf} missing from docs/key-catalog.md"
        );
    }
}

#[test]
fn every_meta_key_kind_is_in_the_catalog() {
    let doc = catalog();
    for kind in KeyKind::ALL {
        let segment = kind.segment();
        assert!(
            doc.contains(&format!("| `{segment}` |")),
            "key kind {segment} missing from docs/key-catalog.md"
        );
    }
}
