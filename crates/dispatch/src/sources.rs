//! The core's two sources of non-determinism, injected so tests are deterministic:
//! delivery-id tags and backoff jitter.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What a delivery id is made of, as the id source sees it: the authenticated
/// fields of http-api.md "Cluster: moves, takeovers and Meta's footprint".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdFields<'a> {
    pub subscription: &'a str,
    pub incarnation: i64,
    /// The partition's offset-reset epoch (`Committed::epoch`).
    pub reset_epoch: u64,
    pub topic: &'a str,
    pub partition: u32,
    pub offset: u64,
    pub attempt: u32,
    /// The epoch of the session the attempt is bound to, if any.
    pub session_epoch: Option<i64>,
    /// A redrive of a dead-lettered offset (never reconstructed by another owner).
    pub redrive: bool,
}

/// Supplies the last part of delivery ids.
///
/// A delivery id is `{incarnation}-{partition}-{offset}-{attempt}-{tag:016x}` (an `r`
/// before the attempt marks a redrive). Production tags ([`MacIds`]) are a MAC over
/// [`IdFields`] keyed by a secret, so an owner that inherits a partition rebuilds the
/// id of every delivery still in flight from its attempt ledger and honours its ack,
/// while nobody without the key can forge one, and an id of one reset epoch or
/// session epoch is no id of another.
pub trait IdSource: Send + Sync {
    fn tag(&mut self, fields: &IdFields<'_>) -> u64;
}

/// The key of [`MacIds`]: in cluster mode derived from the cluster secret (every
/// member computes the same tags), standalone drawn at boot.
#[derive(Clone)]
pub struct IdKey([u8; 32]);

impl std::fmt::Debug for IdKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IdKey(..)")
    }
}

impl IdKey {
    /// The key every member derives from the cluster secret (domain-separated, so
    /// the secret itself is never the MAC key).
    pub fn from_secret(secret: &[u8]) -> Self {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(b"meshd delivery id key v1\0");
        h.update(secret);
        Self(h.finalize().into())
    }

    /// A key of 256 random bits (standalone: ids never leave this instance).
    pub fn random() -> Self {
        let mut k = [0u8; 32];
        rand::thread_rng().fill(&mut k[..]);
        Self(k)
    }

    /// The tag of a window delivery: HMAC-SHA256 over the length-prefixed fields,
    /// truncated to 64 bits.
    pub fn mac(&self, f: &IdFields<'_>) -> u64 {
        use hmac::Mac;
        // new_from_slice accepts any key length, so this never fails.
        let Ok(mut m) = hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.0) else {
            return 0;
        };
        for s in [f.subscription, f.topic] {
            m.update(&(s.len() as u64).to_be_bytes());
            m.update(s.as_bytes());
        }
        m.update(&f.incarnation.to_be_bytes());
        m.update(&f.reset_epoch.to_be_bytes());
        m.update(&f.partition.to_be_bytes());
        m.update(&f.offset.to_be_bytes());
        m.update(&f.attempt.to_be_bytes());
        match f.session_epoch {
            Some(e) => {
                m.update(&[1]);
                m.update(&e.to_be_bytes());
            }
            None => m.update(&[0]),
        }
        let out = m.finalize().into_bytes();
        let mut first = [0u8; 8];
        first.copy_from_slice(&out[..8]);
        u64::from_be_bytes(first)
    }
}

/// Production tags: [`IdKey::mac`] for window deliveries (rebuildable by any holder
/// of the key), 64 random bits for redrives (two redrives of one offset both start
/// at attempt 1, and a redrive never moves to another owner in flight).
pub struct MacIds {
    key: IdKey,
    rng: StdRng,
}

impl MacIds {
    pub fn new(key: IdKey) -> Self {
        Self {
            key,
            rng: StdRng::from_entropy(),
        }
    }
}

impl IdSource for MacIds {
    fn tag(&mut self, fields: &IdFields<'_>) -> u64 {
        if fields.redrive {
            self.rng.gen()
        } else {
            self.key.mac(fields)
        }
    }
}

/// Deterministic tags: `start`, `start + 1`, ... whatever the fields. Give every
/// core lifetime (for example each recovery in a test) its own `start` range.
pub struct SequentialIds {
    next: u64,
}

impl SequentialIds {
    pub fn starting_at(start: u64) -> Self {
        Self { next: start }
    }
}

impl IdSource for SequentialIds {
    fn tag(&mut self, _fields: &IdFields<'_>) -> u64 {
        let n = self.next;
        self.next = self.next.wrapping_add(1);
        n
    }
}

/// Draws from `0..=upper` (inclusive) for backoff jitter; answers above `upper` are
/// clamped by the core.
pub trait Jitter: Send + Sync {
    fn sample(&mut self, upper: u64) -> u64;
}

/// Jitter from a pseudo-random generator: seeded from the OS in production
/// ([`RngJitter::from_entropy`]), from a fixed seed in tests ([`RngJitter::seeded`]).
pub struct RngJitter(StdRng);

impl RngJitter {
    pub fn from_entropy() -> Self {
        Self(StdRng::from_entropy())
    }

    pub fn seeded(seed: u64) -> Self {
        Self(StdRng::seed_from_u64(seed))
    }
}

impl Jitter for RngJitter {
    fn sample(&mut self, upper: u64) -> u64 {
        self.0.gen_range(0..=upper)
    }
}

/// Fixed jitter for tests: always the lowest or always the highest value, so a delay
/// is exactly `ceil(cap/2)` or exactly `cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FixedJitter {
    Min,
    Max,
}

impl Jitter for FixedJitter {
    fn sample(&mut self, upper: u64) -> u64 {
        match self {
            FixedJitter::Min => 0,
            FixedJitter::Max => upper,
        }
    }
}

/// Both sources, boxed, as the core takes them.
pub struct Sources {
    pub ids: Box<dyn IdSource>,
    pub jitter: Box<dyn Jitter>,
}

impl Sources {
    /// MAC'd ids under `key` and random jitter (production).
    pub fn production(key: IdKey) -> Self {
        Self {
            ids: Box::new(MacIds::new(key)),
            jitter: Box::new(RngJitter::from_entropy()),
        }
    }

    /// Sequential ids from `id_start` and the given jitter (tests).
    pub fn deterministic(id_start: u64, jitter: impl Jitter + 'static) -> Self {
        Self {
            ids: Box::new(SequentialIds::starting_at(id_start)),
            jitter: Box::new(jitter),
        }
    }
}
