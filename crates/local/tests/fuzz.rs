//! Fuzzing the record framing every Local record shares.
//!
//! The [`Decoder`] is the first thing that touches bytes read back from RocksDB, so a
//! torn write, a flipped bit on disk or a record of a newer format all arrive here.
//! The story these properties pin: whatever the bytes, decoding answers with a value
//! or a [`DecodeError`], never a panic; and a damaged record (a flipped byte, a cut, an
//! extension) is never read back as a value.
//!
//! Case count: `MESHD_FUZZ_CASES` (default 2000, the CI pass); see docs/fuzzing.md.

use meshd_fuzz_cases::cases;
use meshd_local::codec::{DecodeError, Decoder, Encoder};
use proptest::prelude::*;

/// One field of a record, as written.
#[derive(Clone, Debug, PartialEq)]
enum Field {
    U8(u8),
    U32(u32),
    I64(i64),
    U64(u64),
    Bytes(Vec<u8>),
    Str(String),
}

fn field() -> impl Strategy<Value = Field> {
    prop_oneof![
        any::<u8>().prop_map(Field::U8),
        any::<u32>().prop_map(Field::U32),
        any::<i64>().prop_map(Field::I64),
        any::<u64>().prop_map(Field::U64),
        prop::collection::vec(any::<u8>(), 0..24).prop_map(Field::Bytes),
        ".{0,12}".prop_map(Field::Str),
    ]
}

fn encode(version: u8, fields: &[Field]) -> Vec<u8> {
    let mut e = Encoder::new(version);
    for f in fields {
        e = match f {
            Field::U8(v) => e.u8(*v),
            Field::U32(v) => e.u32(*v),
            Field::I64(v) => e.i64(*v),
            Field::U64(v) => e.u64(*v),
            Field::Bytes(v) => e.bytes(v),
            Field::Str(v) => e.str(v),
        };
    }
    e.finish()
}

/// Reads one field of the kind `like` names.
fn read(d: &mut Decoder<'_>, like: &Field) -> Result<Field, DecodeError> {
    Ok(match like {
        Field::U8(_) => Field::U8(d.u8()?),
        Field::U32(_) => Field::U32(d.u32()?),
        Field::I64(_) => Field::I64(d.i64()?),
        Field::U64(_) => Field::U64(d.u64()?),
        Field::Bytes(_) => Field::Bytes(d.bytes()?),
        Field::Str(_) => Field::Str(d.string()?),
    })
}

/// Decodes a whole record with the schema `schema` (the kinds of its fields).
fn decode(record: &[u8], version: u8, schema: &[Field]) -> Result<Vec<Field>, DecodeError> {
    let mut d = Decoder::new(record, version)?;
    let fields = schema
        .iter()
        .map(|f| read(&mut d, f))
        .collect::<Result<Vec<_>, _>>()?;
    d.finish()?;
    Ok(fields)
}

/// Frames `payload` the way [`Encoder`] does, so a fuzzed payload gets past the
/// checksum and reaches the field readers.
fn seal(version: u8, payload: &[u8]) -> Vec<u8> {
    let mut b = vec![version];
    b.extend_from_slice(payload);
    let crc = crc32fast::hash(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// True when the last four bytes are the checksum of the rest: a frame that is valid
/// by construction, whatever produced it.
fn checksum_holds(record: &[u8]) -> bool {
    record.len() >= 5 && {
        let (body, crc) = record.split_at(record.len() - 4);
        crc32fast::hash(body).to_le_bytes() == crc
    }
}

/// Payloads built from plausible tokens: small flags, length prefixes that may lie,
/// whole numbers, raw bytes, so the readers see cut and over-long fields.
fn payload() -> impl Strategy<Value = Vec<u8>> {
    let token = prop_oneof![
        (0u8..6).prop_map(|b| vec![b]),
        (0u32..40, prop::collection::vec(any::<u8>(), 0..32)).prop_map(|(n, b)| {
            let mut v = n.to_le_bytes().to_vec();
            v.extend(b);
            v
        }),
        any::<u32>().prop_map(|n| n.to_le_bytes().to_vec()),
        any::<u64>().prop_map(|n| n.to_le_bytes().to_vec()),
        prop::collection::vec(any::<u8>(), 0..8),
    ];
    prop::collection::vec(token, 0..8).prop_map(|t| t.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Arbitrary bytes: an error or a frame whose checksum really holds.
    #[test]
    fn fuzz_decoder_arbitrary_bytes(
        bytes in prop::collection::vec(any::<u8>(), 0..64),
        version in any::<u8>(),
        schema in prop::collection::vec(field(), 0..6),
    ) {
        if Decoder::new(&bytes, version).is_ok() {
            prop_assert!(checksum_holds(&bytes) && bytes[0] == version);
        }
        let _ = decode(&bytes, version, &schema);
    }

    /// A well-framed payload of any shape read with any schema: values or errors, no
    /// panic, and a read never runs past the payload.
    #[test]
    fn fuzz_decoder_sealed_payload(
        payload in payload(),
        schema in prop::collection::vec(field(), 0..8),
    ) {
        let record = seal(1, &payload);
        let d = Decoder::new(&record, 1);
        prop_assert!(d.is_ok(), "{:?}", d.err());
        if let Ok(fields) = decode(&record, 1, &schema) {
            // Accepted means the payload is exactly those fields.
            prop_assert_eq!(&encode(1, &fields), &record);
        }
        prop_assert_eq!(
            Decoder::new(&record, 2).err(),
            Some(DecodeError::UnknownVersion(1))
        );
    }

    /// Whatever is written reads back, and reading with another schema never panics.
    #[test]
    fn fuzz_encoded_records_round_trip(
        fields in prop::collection::vec(field(), 0..8),
        other in prop::collection::vec(field(), 0..8),
    ) {
        let record = encode(7, &fields);
        prop_assert_eq!(decode(&record, 7, &fields), Ok(fields.clone()));
        if let Ok(read) = decode(&record, 7, &other) {
            prop_assert_eq!(&encode(7, &read), &record);
        }
    }

    /// A burst of damage of up to 32 bits anywhere (CRC-32 catches every such burst) is
    /// always a checksum error, never a value.
    #[test]
    fn fuzz_flipped_bytes_never_decode(
        fields in prop::collection::vec(field(), 0..8),
        at in any::<prop::sample::Index>(),
        damage in prop::collection::vec(any::<u8>(), 1..=4),
    ) {
        prop_assume!(damage.iter().any(|b| *b != 0));
        let mut record = encode(1, &fields);
        let start = at.index(record.len());
        for (i, d) in damage.iter().enumerate() {
            if let Some(b) = record.get_mut(start + i) {
                *b ^= d;
            }
        }
        prop_assume!(record != encode(1, &fields));
        prop_assert_eq!(decode(&record, 1, &fields), Err(DecodeError::Checksum));
    }

    /// A cut or an extended record is an error; only a cut that happens to leave a
    /// valid frame (probability 2^-32) is skipped, since it is a record by definition.
    #[test]
    fn fuzz_cut_or_extended_records_never_decode(
        fields in prop::collection::vec(field(), 0..8),
        cut in any::<prop::sample::Index>(),
        extra in prop::collection::vec(any::<u8>(), 1..16),
        extend in any::<bool>(),
    ) {
        let full = encode(1, &fields);
        let damaged = if extend {
            let mut d = full.clone();
            d.extend_from_slice(&extra);
            d
        } else {
            full[..cut.index(full.len())].to_vec()
        };
        prop_assume!(!checksum_holds(&damaged));
        prop_assert!(decode(&damaged, 1, &fields).is_err());
        prop_assert!(Decoder::new(&damaged, 1).is_err());
    }
}
