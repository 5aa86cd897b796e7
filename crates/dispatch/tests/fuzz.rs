//! Fuzzing the one parser of client bytes in dispatch: the
//! delivery id an ack, nack or extend names, which routes it to a partition core.
//! Ids come straight from request bodies, so anything may arrive: the answer is a
//! partition or `None`, never a panic, and only a well-formed id names a partition.
//!
//! Case count: `MESHD_FUZZ_CASES` (default 2000, the CI pass); see docs/fuzzing.md.

use meshd_dispatch::DeliveryId;
use meshd_fuzz_cases::cases;
use proptest::prelude::*;

/// Ids of five dash-separated parts, each near or at its valid form.
fn id() -> impl Strategy<Value = String> {
    let number = prop_oneof![
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        Just("4294967296".to_owned()),
        Just(String::new()),
        "[0-9a-fr+-]{0,6}",
        ".{0,4}",
    ];
    let parts = prop::collection::vec(number, 0..7);
    prop_oneof![
        parts.prop_map(|p| p.join("-")),
        (
            any::<i64>(),
            any::<u32>(),
            any::<u64>(),
            any::<u32>(),
            any::<u64>(),
            any::<bool>()
        )
            .prop_map(|(inc, p, off, att, nonce, r)| {
                format!(
                    "{inc}-{p}-{off}-{}{att}-{nonce:x}",
                    if r { "r" } else { "" }
                )
            }),
        ".{0,40}",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn fuzz_delivery_id_partition(id in id()) {
        if let Some(d) = DeliveryId::parse(&id) {
            // The partition is the second of the last five parts, exactly as written,
            // and the id prints back as it was read.
            let parts: Vec<&str> = id.rsplitn(5, '-').collect();
            prop_assert_eq!(parts.len(), 5);
            prop_assert_eq!(parts[3].parse::<u32>().ok(), Some(d.partition));
            prop_assert_eq!(d.to_string(), id);
        }
    }
}
