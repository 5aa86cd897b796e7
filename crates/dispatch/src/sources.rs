//! The core's two sources of non-determinism, injected so tests are deterministic:
//! delivery-id nonces and backoff jitter.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Supplies the unique part of delivery ids.
///
/// A delivery id is `{incarnation}-{partition}-{offset}-{attempt}-{nonce:016x}` (an
/// `r` before the attempt marks a redrive), see [`crate::delivery_id`]. The
/// `(offset, attempt)` part already differs between attempts of one offset, across
/// crashes too (attempt counts never go back); the nonce separates what that cannot:
/// two redrives of one offset (both start at attempt 1) and an offset delivered again
/// after an explicit offset reset.
pub trait IdSource: Send + Sync {
    fn nonce(&mut self) -> u64;
}

/// Draws from `0..=upper` (inclusive) for backoff jitter; answers above `upper` are
/// clamped by the core.
pub trait Jitter: Send + Sync {
    fn sample(&mut self, upper: u64) -> u64;
}

/// Production nonces: 64 random bits per id (seeded from the OS).
pub struct RandomIds(StdRng);

impl RandomIds {
    pub fn new() -> Self {
        Self(StdRng::from_entropy())
    }
}

impl Default for RandomIds {
    fn default() -> Self {
        Self::new()
    }
}

impl IdSource for RandomIds {
    fn nonce(&mut self) -> u64 {
        self.0.gen()
    }
}

/// Deterministic nonces: `start`, `start + 1`, ... Give every core lifetime (for
/// example each recovery in a test) its own `start` range.
pub struct SequentialIds {
    next: u64,
}

impl SequentialIds {
    pub fn starting_at(start: u64) -> Self {
        Self { next: start }
    }
}

impl IdSource for SequentialIds {
    fn nonce(&mut self) -> u64 {
        let n = self.next;
        self.next = self.next.wrapping_add(1);
        n
    }
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
    /// Random ids and random jitter (production).
    pub fn random() -> Self {
        Self {
            ids: Box::new(RandomIds::new()),
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
