//! The Meta conformance suite (being written).
