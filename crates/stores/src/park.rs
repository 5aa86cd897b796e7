//! # The park index: events that wait for their time
//!
//! Per (subscription incarnation, topic, partition), the events a subscription must not
//! hand out yet (http-api.md, Additions, "Parking"), each with its body: log retention
//! may remove an event from the log while it is parked, and its delivery reads the
//! body from here.
//!
//! ## Contract
//!
//! * [`park`](ParkIndex::park) is durable before it returns: the delivery core hears
//!   of the entry (`Input::Parked`) only then, so the committed offset never passes an
//!   event a crash could lose. Parking an offset that is parked already keeps the first
//!   entry (a repeat after a crash that lost the committed offset's advance parks
//!   nothing twice) and answers `false`.
//! * [`remove`](ParkIndex::remove) is durable before it returns (an event settled and
//!   then brought back by a power cut would be delivered again after its ack).
//! * [`earliest`](ParkIndex::earliest) answers entries in due order without holding
//!   anything per entry in memory: a million parked events cost storage only.
//! * Entries of other partitions and subscription incarnations are never touched.
//! * Errors: [`ParkError::Local`] means the Local store fail-stopped (the partition
//!   stops until a restart); [`ParkError::Unavailable`] (cluster mode: the journal on
//!   the shared log's server did not take the write) changed nothing that matters and
//!   is retried; [`ParkError::Fenced`] (cluster mode) means a later owner of the
//!   partition wrote the entry: this instance has lost the partition and writes
//!   nothing more under its epoch.
//!
//! ## Cluster mode
//!
//! The index must move with its partition, and Meta holds no per-event key ("Meta's
//! footprint"). So each entry is also written to a [`ParkJournal`] on the shared log's
//! server (JetStream), durably before the local write, and settled there before it
//! goes locally; a new owner rebuilds its local index from the journal when it takes
//! the partition ([`ParkIndex::adopt`]) and reads only its local copy afterwards.

use crate::delivery::DeliveryError;
use crate::offsets::OffsetKey;
use async_trait::async_trait;
use std::collections::BTreeSet;

/// A park index call that failed.
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    /// The Local store failed (it fail-stops, like every Local write).
    #[error(transparent)]
    Local(#[from] DeliveryError),
    /// Cluster mode: the journal did not answer or refused; the index is as before
    /// this call where it matters (an entry parked is durable in both or not used; a
    /// settled one is still there), so the caller retries.
    #[error("park journal unavailable: {0}")]
    Unavailable(String),
    /// Cluster mode: the journal entry was written by a later owner of the partition
    /// (a higher epoch) since this owner last saw it; nothing was written. The
    /// partition has moved: the caller stops acting under its epoch.
    #[error("park journal write fenced: {0}")]
    Fenced(String),
}

/// The due time of an entry held behind its key (ordered delivery): it is not due
/// until the event ahead of it on its key is settled ([`ParkIndex::release_key`], or
/// the [`ParkIndex::remove`] of a keyed entry, sets its real due time).
pub const HELD: u64 = u64::MAX;

/// A parked event, as the index answers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Parked {
    pub offset: u64,
    /// Not to be handed out before this (unix ms); [`HELD`]: behind its key.
    pub due_ms: u64,
    /// Attempts made before it was parked (0 for an event parked as it was read).
    pub attempt: u32,
    /// Ordered delivery: the hash of the event's `partitionkey` (FNV-1a 64 of its
    /// bytes, `meshd_events::fnv1a64`: stable, it is stored; two keys of one hash
    /// wait for each other, an extra wait that never breaks an order). Among the keyed entries of one hash, the lowest offset is the one
    /// ahead; the others wait [`HELD`] behind it.
    pub key: Option<u64>,
    /// A held entry's own `deliverat` (unix ms, 0: none): released, it is due at the
    /// later of this and the release.
    pub not_before_ms: u64,
    /// Its place in its key's line: the offset for an event parked as it was read; for
    /// a redriven dead letter (`redrive`), the delivery core's read position when it
    /// was redriven, so it goes behind every event of its key read before and ahead of
    /// every one read after (ties go by offset).
    pub seq: u64,
    /// A redriven dead letter of an ordered subscription, parked at the back of its
    /// key: settled in the dead-letter store too (its entry id is the partition's
    /// for this offset).
    pub redrive: bool,
}

impl Parked {
    /// An entry without an ordering key.
    pub fn new(offset: u64, due_ms: u64, attempt: u32) -> Self {
        Self {
            offset,
            due_ms,
            attempt,
            key: None,
            not_before_ms: 0,
            seq: offset,
            redrive: false,
        }
    }

    /// Behind its key: not due until released.
    pub fn is_held(&self) -> bool {
        self.due_ms == HELD
    }

    /// This held entry, released at `now_ms`: due at the later of `now_ms` and its
    /// own `deliverat`.
    pub fn released(&self, now_ms: u64) -> Parked {
        Parked {
            due_ms: now_ms.max(self.not_before_ms).min(HELD - 1),
            ..self.clone()
        }
    }

    /// The stored form of everything but the offset and due time (which the stores
    /// keep in their keys): attempt (u32 BE), then `0`, or `1` with the key hash,
    /// `not_before_ms` and `seq` (u64 BE each) and `redrive` (one byte). The body
    /// follows it.
    pub fn encode_tail(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.attempt.to_be_bytes());
        match self.key {
            None => out.push(0),
            Some(k) => {
                out.push(1);
                out.extend_from_slice(&k.to_be_bytes());
                out.extend_from_slice(&self.not_before_ms.to_be_bytes());
                out.extend_from_slice(&self.seq.to_be_bytes());
                out.push(u8::from(self.redrive));
            }
        }
    }

    /// Reads [`encode_tail`](Self::encode_tail)'s bytes at the start of `b` into
    /// `self` (whose `offset` is set); answers where the body starts, `None` when `b`
    /// is too short or unknown.
    pub fn decode_tail(&mut self, b: &[u8]) -> Option<usize> {
        let u64_at = |at: usize| -> Option<u64> {
            Some(u64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
        };
        self.attempt = u32::from_be_bytes(b.get(..4)?.try_into().ok()?);
        match b.get(4)? {
            0 => {
                self.key = None;
                self.not_before_ms = 0;
                self.seq = self.offset;
                self.redrive = false;
                Some(5)
            }
            1 => {
                self.key = Some(u64_at(5)?);
                self.not_before_ms = u64_at(13)?;
                self.seq = u64_at(21)?;
                self.redrive = match b.get(29)? {
                    0 => false,
                    1 => true,
                    _ => return None,
                };
                Some(30)
            }
            _ => None,
        }
    }
}

/// What [`ParkIndex::remove`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    /// The offset was parked (and is not any more).
    pub removed: bool,
    /// The entry was keyed and the next entry of its key was held: released with it,
    /// in the same durable write (its new due time).
    pub released: Option<Parked>,
}

#[async_trait]
pub trait ParkIndex: Send + Sync + 'static {
    /// Cluster mode: this instance takes the partition over; its index of the
    /// partition is rebuilt from the journal (whatever an earlier ownership left here
    /// is replaced), and its journal writes from now on carry `epoch`, the owner
    /// epoch of this acquisition (see [`ParkJournal`], "Fencing"). Nothing to do for
    /// an index that is purely local.
    async fn adopt(&self, key: &OffsetKey, epoch: i64) -> Result<(), ParkError>;

    /// Parks the event at `offset` until `due_ms` with its `body`, durably. `true`: a
    /// new entry; `false`: the offset was parked already (its entry is unchanged).
    async fn park(
        &self,
        key: &OffsetKey,
        offset: u64,
        due_ms: u64,
        attempt: u32,
        body: Vec<u8>,
    ) -> Result<bool, ParkError> {
        let entry = Parked::new(offset, due_ms, attempt);
        let created = self.park_many(key, vec![(entry, body)]).await?;
        Ok(created.first().copied().unwrap_or(false))
    }

    /// [`park`](Self::park) for several events of the partition with one durable
    /// write (an event read batch parks its delayed events together: one fsync, not
    /// one per event). Answers per entry, in order.
    async fn park_many(
        &self,
        key: &OffsetKey,
        entries: Vec<(Parked, Vec<u8>)>,
    ) -> Result<Vec<bool>, ParkError>;

    /// Removes `offset`'s entry, durably. A keyed entry's removal releases the next
    /// entry of its key when that one is [`HELD`] (due at the later of `now_ms` and
    /// its own `deliverat`), in the same durable write: a crash never leaves a key
    /// held by nobody.
    async fn remove(&self, key: &OffsetKey, offset: u64, now_ms: u64)
        -> Result<Removed, ParkError>;

    /// Ordered delivery: the event ahead on key `hash` was settled outside the index
    /// (acked or dead-lettered from the log). When the key's first entry is
    /// [`HELD`], it is released (due at the later of `now_ms` and its `deliverat`),
    /// durably, and answered; otherwise (no entry, or the first one is the one ahead
    /// and has its own due time) nothing changes.
    async fn release_key(
        &self,
        key: &OffsetKey,
        hash: u64,
        now_ms: u64,
    ) -> Result<Option<Parked>, ParkError>;

    /// Which of the key `hashes` have an entry in the partition's index (such a key
    /// is taken: a later event of it parks behind).
    async fn keys_parked(
        &self,
        key: &OffsetKey,
        hashes: Vec<u64>,
    ) -> Result<BTreeSet<u64>, DeliveryError>;

    /// The keys whose first entry is [`HELD`]: each waits for an event outside the
    /// index (in the delivery window) or for a release a crash cut off. Read once
    /// when a partition starts (one seek per key).
    async fn held_keys(&self, key: &OffsetKey) -> Result<Vec<u64>, DeliveryError>;

    /// At most `limit` entries of the partition in due order, from the earliest.
    async fn earliest(&self, key: &OffsetKey, limit: usize) -> Result<Vec<Parked>, DeliveryError>;

    /// An unparked event failed and waits again: its entry takes `due_ms` and
    /// `attempt` (the attempts made so far), durably. `false`: it is not parked (it
    /// was settled).
    async fn repark(
        &self,
        key: &OffsetKey,
        offset: u64,
        due_ms: u64,
        attempt: u32,
    ) -> Result<bool, ParkError>;

    /// Unparked events were handed out with these attempts (`(offset, attempt)`):
    /// cluster mode keeps the count in the journal, durably before it returns, so a
    /// new owner continues it (what the attempt ledger does for the window). A purely
    /// local index has nothing to do: the delivery records hold the count.
    async fn record_attempts(
        &self,
        _key: &OffsetKey,
        _attempts: Vec<(u64, u32)>,
    ) -> Result<(), ParkError> {
        Ok(())
    }

    /// `offset`'s entry, `None` when it is not parked.
    async fn entry(&self, key: &OffsetKey, offset: u64) -> Result<Option<Parked>, DeliveryError>;

    /// The body of `offset`'s entry, `None` when it is not parked.
    async fn body(&self, key: &OffsetKey, offset: u64) -> Result<Option<Vec<u8>>, DeliveryError>;

    /// Which of `offsets` are parked, in offset order.
    async fn parked_among(
        &self,
        key: &OffsetKey,
        offsets: Vec<u64>,
    ) -> Result<Vec<u64>, DeliveryError>;

    /// The parked offsets of the partition from `from` on, in offset order, at most
    /// `limit`.
    async fn offsets_from(
        &self,
        key: &OffsetKey,
        from: u64,
        limit: usize,
    ) -> Result<Vec<u64>, DeliveryError>;

    /// How many events of the partition are parked (a scan of the partition's keys:
    /// at partition start, not per request).
    async fn count(&self, key: &OffsetKey) -> Result<u64, DeliveryError>;

    /// Removes every entry of a subscription incarnation (it was deleted).
    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), ParkError>;
}

/// Cluster mode: park entries kept on the shared log's server, so that the next owner
/// of a partition can rebuild its index ([`ParkIndex::adopt`]).
///
/// * `put` and `settle` are durable (as the log's appends are: fsynced or replicated
///   to a quorum) before they return; an error is [`ParkError::Unavailable`] (the
///   write may have been stored: a repeated `put` or `settle` of the same offset is
///   harmless).
/// * `load` answers the entries put and not settled, with their bodies.
///
/// ## Fencing
///
/// Every write carries the writer's owner `epoch` (Meta's, monotonic across owners).
/// A `put` is conditional on the entry's last write: it is refused with
/// [`ParkError::Fenced`] when that write carries a higher epoch, so an owner that was
/// paused past its lease cannot bring back an entry its successor settled (the
/// successor's next takeover would deliver the acked event again) nor overwrite what
/// the successor put. The check and the write are one step on the server (an expected
/// last sequence of the entry's subject), not a read followed by a blind write.
/// `fresh`: the writer expects no entry (a new park), which costs no read when it is
/// right. A `settle` is unconditional: it follows an ack of the event or a fenced
/// dead-letter write, so even a stale one never drops an event that was not consumed.
/// Entries written without an epoch (an older release) count as epoch 0. A settled
/// entry's mark expires (an hour on JetStream): an owner paused longer than that
/// could put the entry again, which costs one more delivery at the next takeover.
/// Who puts a journal entry and what it expects to find ([`ParkJournal`], "Fencing").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JournalWrite {
    /// The writer's owner epoch.
    pub epoch: i64,
    /// No entry is expected (a new park; a settled entry's mark is fine too).
    pub fresh: bool,
}

#[async_trait]
pub trait ParkJournal: Send + Sync + 'static {
    async fn put(
        &self,
        key: &OffsetKey,
        entry: &Parked,
        body: &[u8],
        write: JournalWrite,
    ) -> Result<(), ParkError>;
    async fn settle(&self, key: &OffsetKey, offset: u64, epoch: i64) -> Result<(), ParkError>;
    /// One page of the partition's entries put and not settled, with their bodies: at
    /// most `max` read from journal position `from` on (1 at first), and the position
    /// to go on from (`None`: the end). Unavailable when the journal cannot be read
    /// whole: never a short answer taken for the end.
    async fn load_page(
        &self,
        key: &OffsetKey,
        from: u64,
        max: usize,
    ) -> Result<(Vec<(Parked, Vec<u8>)>, Option<u64>), ParkError>;

    /// Every entry of the partition (pages of [`load_page`](Self::load_page), all in
    /// memory: for tests and small partitions; `adopt` goes page by page).
    async fn load(&self, key: &OffsetKey) -> Result<Vec<(Parked, Vec<u8>)>, ParkError> {
        let mut out = Vec::new();
        let mut from = Some(1);
        while let Some(at) = from {
            let (page, next) = self.load_page(key, at, 1000).await?;
            out.extend(page);
            from = next;
        }
        Ok(out)
    }
    async fn drop_subscription(
        &self,
        subscription: &str,
        incarnation: i64,
    ) -> Result<(), ParkError>;
}
