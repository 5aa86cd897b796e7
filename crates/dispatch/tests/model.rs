//! Model-based property test (house style 18): random input sequences, with crashes
//! (process kills: every applied write survives) and power cuts (writes since the last
//! sync are lost), against a model of what the stores hold. Commands are applied to a
//! `BTreeMap` of delivery records exactly as the DeliveryStateStore would (`record_attempt`
//! syncs, `update` and `resolve` are buffered until the next sync or `Flush`, and the
//! committed offset a reader sees is the synced one), and a "crash" rebuilds the core
//! with `PartitionCore::recover` from those records.
//!
//! After every step the invariants of at-least-once delivery are checked:
//!
//! * the committed offset never decreases, and every offset below it was acked,
//!   dead-lettered or filtered;
//! * a hand-out's attempt record is durable with that attempt and id (write-ahead);
//! * an offset is never handed out with an attempt at or below an earlier hand-out of
//!   it, across crashes too, and never above `max_attempts`;
//! * an ack that was durable is never followed by a redelivery;
//! * an ack of a superseded attempt or from a fenced session is never `Acked`;
//! * a dead-letter is written with exactly `max_attempts` attempts, once per offset;
//! * `outstanding <= max_in_flight`;
//! * an event with a later `deliverat` is never handed out before it: it is parked
//!   (its park entry durable before `committed` passes it), unparked only when due
//!   (and then, above a gap too: it never waits for earlier offsets), and settled in
//!   the park index (acked, or dead-lettered at `max_attempts`);
//! * a retry due far ahead (`park_retries_after_ms`) is parked with its attempts and
//!   unparked with the count continuing, never handed out before it is due;
//! * ordered delivery (`Config::ordered`): an event with a key is handed out only when
//!   every earlier event of its key is acked or dead-lettered (durably), across crashes
//!   and power cuts; the events parked behind a key are released (by a settlement in
//!   the park index, a `ReleaseKey`, or `KeysHeld` after a crash), so a key is never
//!   held by nobody (the drain proves it);
//! * in the end, a consumer that keeps acking drains everything: the committed offset
//!   reaches the log end and no record is left behind.

use meshd_dispatch::{
    AckOutcome, Command, Config, Delivery, DeliveryRecord, DeliveryRef, DeliveryState, EventMeta,
    ExtendOutcome, Input, NackOutcome, OffsetKey, Partition, PartitionCore, PullId, Reply,
    RngJitter, SessionBinding, SessionCheck, Sources,
};
use meshd_stores::park::{Parked, HELD};
use meshd_stores::subscriptions::{Backoff, FilterExpr, Selector};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};

#[derive(Clone, Debug)]
enum Op {
    /// (kept by the filter, delayed by this many ms, ordering key)
    Publish(Vec<(bool, Option<u64>, Option<u64>)>),
    ParkWrite,
    Unpark {
        idx: usize,
    },
    ParkSettleWrite {
        ok: bool,
    },
    ServeRead {
        fail: bool,
    },
    Pull {
        max: usize,
        bind: bool,
    },
    ReportPersisted {
        idx: usize,
        fail: bool,
    },
    Ack {
        idx: usize,
    },
    AckUnknown,
    Nack {
        idx: usize,
        delay_ms: Option<u64>,
    },
    Extend {
        idx: usize,
        ms: u64,
    },
    Release {
        idx: usize,
    },
    Advance(u64),
    DeadLetterWrite {
        ok: bool,
    },
    Redrive {
        idx: usize,
    },
    RedriveWrite {
        ok: bool,
    },
    Takeover,
    Flush,
    Crash {
        lossy: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => proptest::collection::vec(
            (
                any::<bool>(),
                prop_oneof![3 => Just(None), 1 => (0u64..3000).prop_map(Some)],
                prop_oneof![1 => Just(None), 3 => (1u64..4).prop_map(Some)],
            ),
            1..4
        )
        .prop_map(Op::Publish),
        2 => Just(Op::ParkWrite),
        2 => any::<usize>().prop_map(|idx| Op::Unpark { idx }),
        2 => any::<bool>().prop_map(|ok| Op::ParkSettleWrite { ok }),
        4 => prop::bool::weighted(0.2).prop_map(|fail| Op::ServeRead { fail }),
        4 => (1usize..5, any::<bool>()).prop_map(|(max, bind)| Op::Pull { max, bind }),
        4 => (any::<usize>(), prop::bool::weighted(0.1))
            .prop_map(|(idx, fail)| Op::ReportPersisted { idx, fail }),
        4 => any::<usize>().prop_map(|idx| Op::Ack { idx }),
        1 => Just(Op::AckUnknown),
        2 => (any::<usize>(), prop_oneof![Just(None), (0u64..5000).prop_map(Some)])
            .prop_map(|(idx, delay_ms)| Op::Nack { idx, delay_ms }),
        1 => (any::<usize>(), 100u64..3000).prop_map(|(idx, ms)| Op::Extend { idx, ms }),
        1 => any::<usize>().prop_map(|idx| Op::Release { idx }),
        3 => (0u64..2500).prop_map(Op::Advance),
        2 => any::<bool>().prop_map(|ok| Op::DeadLetterWrite { ok }),
        2 => any::<usize>().prop_map(|idx| Op::Redrive { idx }),
        2 => any::<bool>().prop_map(|ok| Op::RedriveWrite { ok }),
        1 => Just(Op::Takeover),
        1 => Just(Op::Flush),
        1 => any::<bool>().prop_map(|lossy| Op::Crash { lossy }),
    ]
}

fn config() -> impl Strategy<Value = Config> {
    (
        1u32..5,
        1usize..5,
        2usize..9,
        1usize..5,
        1usize..6,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(
                max_attempts,
                max_in_flight,
                max_window,
                read_batch,
                max_pending,
                filtered,
                park_retries,
                ordered,
            )| Config {
                max_attempts,
                ack_timeout_ms: 1000,
                backoff: Backoff {
                    initial_ms: 100,
                    max_ms: 400,
                },
                max_in_flight,
                max_window,
                max_pending,
                read_batch,
                read_retry_ms: 200,
                selector: if filtered {
                    Selector::new(
                        None,
                        &[FilterExpr::Exact(vec![("type".into(), "keep".into())])],
                    )
                } else {
                    Selector::default()
                },
                unknown_size_bytes: 1 << 20,
                // Nack delays go up to 5 s: some retries are parked.
                park_retries_after_ms: park_retries.then_some(2000),
                ordered,
            },
        )
}

fn key() -> OffsetKey {
    OffsetKey {
        subscription: "audit".into(),
        incarnation: 5,
        topic: "orders".into(),
        partition: 0,
    }
}

fn partition() -> Partition {
    Partition {
        key: key(),
        log_id: "instance-a".into(),
        owner_epoch: 3,
        reset_epoch: 0,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DlState {
    Dead,
    Redriving,
}

#[derive(Clone, Debug)]
enum MetaWrite {
    Succeeded { offset: u64 },
    Failed { offset: u64 },
}

/// A settlement of an unparked event the shell is writing.
#[derive(Clone, Debug)]
enum ParkSettle {
    Acked {
        offset: u64,
    },
    DeadLetter {
        offset: u64,
    },
    /// Retried far ahead: the entry takes this due time and attempt count.
    Repark {
        offset: u64,
        due: u64,
        attempt: u32,
    },
}

struct World {
    config: Config,
    core: PartitionCore,
    generation: u64,
    now: u64,
    log: Vec<EventMeta>,

    // -- the DeliveryStateStore + OffsetStore model --
    records: BTreeMap<u64, DeliveryRecord>,
    /// Records as of the last sync (what a power cut leaves).
    synced: BTreeMap<u64, DeliveryRecord>,
    committed: u64,
    /// The committed offset as of the last sync: what a power cut leaves, and what the
    /// OffsetStore shows.
    synced_committed: u64,

    // -- the DeadLetterStore model --
    dead: BTreeMap<u64, (DlState, u32)>,

    // -- the park index model (writes are synced) --
    /// Parked offsets: when they are due (`HELD`: behind their key), the attempts
    /// made before parking, the key.
    parked: BTreeMap<u64, Parked>,
    /// Unparked events whose ack was accepted (durable: the shell flushes before it
    /// settles them in the index).
    parked_acked: BTreeSet<u64>,
    /// Offsets ever dead-lettered (durably): done for their key, redriven or not.
    ever_dead: BTreeSet<u64>,
    /// Offsets the shell has fed `Unpark` for in this life (lost in a crash).
    unparked: BTreeSet<u64>,
    park_writes: VecDeque<Parked>,
    park_settles: VecDeque<ParkSettle>,
    /// Highest attempt handed out per parked offset.
    max_park_handed: HashMap<u64, u32>,
    /// Offsets whose `Repark` failed: tried again with the same due time, nearer by
    /// then.
    repark_retried: BTreeSet<u64>,

    // -- the shell's outstanding work (lost in a crash) --
    read: Option<(u64, usize)>,
    persists: Vec<(u64, u32)>,
    dl_writes: VecDeque<u64>,
    redrive_writes: VecDeque<MetaWrite>,

    // -- the consumer and what it has seen --
    held: Vec<Delivery>,
    /// Highest attempt handed out per window offset, across crashes.
    max_handed: HashMap<u64, u32>,
    /// Offsets whose latest attempt was released (never reached a consumer): their
    /// next hand-out may carry the same attempt number again, never a lower one.
    released: HashSet<(bool, u64)>,
    /// Highest attempt handed out per redriven offset, in the current redrive.
    max_redrive_handed: HashMap<u64, u32>,
    /// Latest delivery id handed out per (redrive?, offset).
    latest_id: HashMap<(bool, u64), String>,
    acked_synced: BTreeSet<u64>,
    acked_unsynced: BTreeSet<u64>,
    session: SessionBinding,
    next_pull: u64,
}

impl World {
    fn new(config: Config) -> Self {
        let core = PartitionCore::new(
            partition(),
            config.clone(),
            0,
            Sources::deterministic(0, RngJitter::seeded(0)),
        )
        .expect("config");
        Self {
            config,
            core,
            generation: 0,
            now: 1_000_000,
            log: Vec::new(),
            records: BTreeMap::new(),
            synced: BTreeMap::new(),
            committed: 0,
            synced_committed: 0,
            dead: BTreeMap::new(),
            parked: BTreeMap::new(),
            parked_acked: BTreeSet::new(),
            ever_dead: BTreeSet::new(),
            unparked: BTreeSet::new(),
            park_writes: VecDeque::new(),
            park_settles: VecDeque::new(),
            max_park_handed: HashMap::new(),
            repark_retried: BTreeSet::new(),
            read: None,
            persists: Vec::new(),
            dl_writes: VecDeque::new(),
            redrive_writes: VecDeque::new(),
            held: Vec::new(),
            max_handed: HashMap::new(),
            released: HashSet::new(),
            max_redrive_handed: HashMap::new(),
            latest_id: HashMap::new(),
            acked_synced: BTreeSet::new(),
            acked_unsynced: BTreeSet::new(),
            session: SessionBinding {
                session_id: "s-0".into(),
                epoch: 1,
            },
            next_pull: 0,
        }
    }

    fn feed(&mut self, input: Input) {
        let cmds = self
            .core
            .handle(input.clone(), self.now)
            .unwrap_or_else(|e| panic!("{input:?} refused: {e}"));
        self.run(cmds);
    }

    fn sync(&mut self) {
        self.synced = self.records.clone();
        assert!(
            self.committed >= self.synced_committed,
            "committed went back"
        );
        self.synced_committed = self.committed;
        let acked = std::mem::take(&mut self.acked_unsynced);
        self.acked_synced.extend(acked);
    }

    fn filtered(&self, offset: u64) -> bool {
        !self.config.matches(&self.log[offset as usize])
    }

    fn delivery(&self, id: &str) -> Option<&Delivery> {
        self.held.iter().rev().find(|d| d.delivery_id == id)
    }

    /// What the shell's SessionStore cache says about the session a delivery is bound
    /// to: the live session's epoch, or fenced (`None`) for any earlier session.
    fn check_for(&self, d: &Delivery) -> Option<SessionCheck> {
        d.session.as_ref().map(|b| SessionCheck {
            session_id: b.session_id.clone(),
            current_epoch: (b.session_id == self.session.session_id).then_some(self.session.epoch),
        })
    }

    fn run(&mut self, cmds: Vec<Command>) {
        // Replies come last (after the writes they report), but they tell the model
        // which acks were accepted, which the Resolve check before them needs.
        let (replies, writes): (Vec<_>, Vec<_>) = cmds
            .into_iter()
            .partition(|c| matches!(c, Command::Reply(_)));
        for c in replies {
            self.execute(c);
        }
        for c in writes {
            self.execute(c);
        }
        self.check_bounds();
    }

    fn execute(&mut self, c: Command) {
        let max = self.config.max_attempts;
        match c {
            Command::ReadLog { from, max } => {
                assert!(self.read.is_none(), "one read at a time");
                assert!(max >= 1);
                assert!(
                    from + max as u64 <= self.committed + self.config.max_window as u64,
                    "the window is bounded"
                );
                self.read = Some((from, max));
            }
            Command::PersistAttempt { record, .. } => {
                assert!(record.attempt >= 1 && record.attempt <= max, "{record:?}");
                assert_eq!(record.state, DeliveryState::InFlight);
                if let Some(old) = self.records.get(&record.offset) {
                    assert!(
                        record.attempt >= old.attempt,
                        "attempt count went back: {old:?} -> {record:?}"
                    );
                }
                self.persists.push((record.offset, record.attempt));
                self.records.insert(record.offset, record);
                self.sync(); // record_attempt is durable before it returns
            }
            Command::HandOut { delivery, .. } => {
                let d = delivery;
                assert!(d.attempt >= 1 && d.attempt <= max, "{d:?}");
                let durable = self.synced.get(&d.offset).expect("write-ahead: no record");
                assert_eq!(
                    (durable.attempt, &durable.delivery_id, durable.state),
                    (d.attempt, &d.delivery_id, DeliveryState::InFlight),
                    "write-ahead: the hand-out's record is not durable"
                );
                let redrive = d.redrive_of.is_some() || d.parked;
                if d.redrive_of.is_none() {
                    self.check_key_order(d.offset);
                }
                if d.parked {
                    let due = self
                        .parked
                        .get(&d.offset)
                        .expect("unparked without an entry")
                        .due_ms;
                    assert!(due <= self.now, "handed out before its deliverat: {d:?}");
                    assert!(d.redrive_of.is_none());
                    assert!(
                        !self.parked_acked.contains(&d.offset),
                        "an acked unparked event was handed out again: {d:?}"
                    );
                    let prev = self.max_park_handed.entry(d.offset).or_insert(0);
                    if self.released.remove(&(true, d.offset)) {
                        assert!(d.attempt >= *prev, "parked attempt went back: {d:?}");
                    } else {
                        assert!(d.attempt > *prev, "parked attempt went back: {d:?}");
                    }
                    *prev = d.attempt;
                } else if redrive {
                    assert!(d.offset < self.committed);
                    let prev = self.max_redrive_handed.entry(d.offset).or_insert(0);
                    if self.released.remove(&(true, d.offset)) {
                        assert!(d.attempt >= *prev, "redrive attempt went back: {d:?}");
                    } else {
                        assert!(d.attempt > *prev, "redrive attempt went back: {d:?}");
                    }
                    *prev = d.attempt;
                } else {
                    assert!(d.offset >= self.committed, "hand-out below committed");
                    assert!(
                        !self.parked.contains_key(&d.offset),
                        "a parked event was handed out from the window: {d:?}"
                    );
                    assert!(
                        self.log[d.offset as usize]
                            .deliver_at_ms
                            .is_none_or(|at| at <= self.now),
                        "handed out before its deliverat: {d:?}"
                    );
                    assert!(
                        !self.acked_synced.contains(&d.offset)
                            && !self.acked_unsynced.contains(&d.offset),
                        "an acked offset was redelivered: {d:?}"
                    );
                    let prev = self.max_handed.entry(d.offset).or_insert(0);
                    if self.released.remove(&(false, d.offset)) {
                        assert!(d.attempt >= *prev, "attempt went back: {d:?} after {prev}");
                    } else {
                        assert!(d.attempt > *prev, "attempt went back: {d:?} after {prev}");
                    }
                    *prev = d.attempt;
                }
                self.latest_id
                    .insert((redrive, d.offset), d.delivery_id.clone());
                self.held.push(d);
            }
            Command::Update(r) => {
                assert!(
                    self.records.contains_key(&r.offset),
                    "update of a record that is not there (would resurrect it): {r:?}"
                );
                assert!(r.attempt >= self.records[&r.offset].attempt);
                self.records.insert(r.offset, r);
            }
            Command::Resolve { remove, advance } => {
                for o in &remove {
                    self.records.remove(o);
                }
                if let Some(a) = advance {
                    assert_eq!(a.key, key());
                    assert!(a.to > self.committed, "committed must only grow");
                    for o in self.committed..a.to {
                        assert!(
                            self.acked_synced.contains(&o)
                                || self.acked_unsynced.contains(&o)
                                || self.dead.contains_key(&o)
                                || self.filtered(o)
                                || self.parked.contains_key(&o)
                                || self.parked_acked.contains(&o),
                            "offset {o} committed but neither acked, dead-lettered, filtered nor parked"
                        );
                        assert!(
                            !self.records.contains_key(&o),
                            "record {o} left below the committed offset"
                        );
                    }
                    assert!(a.to as usize <= self.log.len());
                    self.committed = a.to;
                } else {
                    // A settled redrive's record goes durably (the shell flushes).
                    self.sync();
                }
            }
            Command::DeadLetter(req) => {
                assert_eq!(req.attempts, max, "dead-lettered at exactly max_attempts");
                assert!(req.offset >= self.committed);
                let r = self
                    .records
                    .get(&req.offset)
                    .expect("record while dead-lettering");
                assert_eq!(r.state, DeliveryState::DeadLettering);
                assert!(!self.dl_writes.contains(&req.offset));
                self.dl_writes.push_back(req.offset);
            }
            Command::RedriveSucceeded { entry_id, offset } => {
                // The shell makes buffered writes durable before it settles a
                // redrive in Meta.
                self.sync();
                assert_eq!(entry_id, partition().dead_letter_id(offset));
                assert_eq!(
                    self.dead.get(&offset).map(|e| e.0),
                    Some(DlState::Redriving)
                );
                self.redrive_writes
                    .push_back(MetaWrite::Succeeded { offset });
            }
            Command::RedriveFailed {
                entry_id,
                offset,
                attempts,
                ..
            } => {
                self.sync();
                assert_eq!(entry_id, partition().dead_letter_id(offset));
                assert_eq!(attempts, max);
                assert_eq!(
                    self.dead.get(&offset).map(|e| e.0),
                    Some(DlState::Redriving)
                );
                self.redrive_writes.push_back(MetaWrite::Failed { offset });
            }
            Command::Park {
                offset,
                due_ms,
                attempt,
                key,
                not_before_ms,
            } => {
                assert!(offset >= self.committed, "park below committed");
                assert!(due_ms > self.now, "parked though due");
                assert_eq!(key, self.key_of(offset), "parked with another key");
                if due_ms == HELD {
                    assert!(self.config.ordered && key.is_some(), "held without a key");
                    assert_eq!(attempt, 0, "a retry is never held behind its own key");
                    assert_eq!(
                        not_before_ms,
                        self.log[offset as usize].deliver_at_ms.unwrap_or(0)
                    );
                } else if attempt == 0 {
                    assert_eq!(self.log[offset as usize].deliver_at_ms, Some(due_ms));
                } else {
                    // A retry due far ahead: parked with the attempts made so far.
                    let after = self
                        .config
                        .park_retries_after_ms
                        .expect("a retry parked though retries are never parked");
                    assert!(due_ms - self.now >= after, "a near retry was parked");
                    assert!(attempt < max, "parked at max_attempts");
                    assert_eq!(
                        self.records.get(&offset).map(|r| r.attempt),
                        Some(attempt),
                        "parked with another attempt count than its record"
                    );
                }
                self.park_writes.push_back(Parked {
                    key,
                    not_before_ms,
                    ..Parked::new(offset, due_ms, attempt)
                });
            }
            Command::ParkSettled { offset } => {
                self.sync();
                assert!(self.parked.contains_key(&offset));
                self.park_settles.push_back(ParkSettle::Acked { offset });
            }
            Command::ParkDeadLetter(req) => {
                self.sync();
                assert_eq!(req.attempts, max, "dead-lettered at exactly max_attempts");
                assert!(self.parked.contains_key(&req.offset));
                self.park_settles
                    .push_back(ParkSettle::DeadLetter { offset: req.offset });
            }
            Command::ReleaseKey { key } => {
                assert!(self.config.ordered, "a key released though unordered");
                // The shell flushes buffered records before a release that finds
                // something (a lost ack must not let the next event go first).
                if self.parked.values().any(|p| p.key == Some(key)) {
                    self.sync();
                }
                self.release_first_of(key, None);
            }
            Command::Repark {
                offset,
                due_ms,
                attempt,
            } => {
                // The shell makes the waiting record durable first.
                self.sync();
                assert!(
                    self.parked.contains_key(&offset),
                    "repark of nothing parked"
                );
                let after = self
                    .config
                    .park_retries_after_ms
                    .expect("reparked though retries are never parked");
                if !self.repark_retried.remove(&offset) {
                    assert!(due_ms - self.now >= after, "a near retry was reparked");
                }
                assert!(attempt < max, "reparked at max_attempts");
                assert_eq!(
                    self.records.get(&offset).map(|r| (r.attempt, r.state)),
                    Some((attempt, DeliveryState::WaitingRetry)),
                    "reparked without its waiting record"
                );
                self.park_settles.push_back(ParkSettle::Repark {
                    offset,
                    due: due_ms,
                    attempt,
                });
            }
            Command::Reply(reply) => self.check_reply(reply),
        }
    }

    /// The ordering key of a logged event (as the shell fills it: ordered only).
    fn key_of(&self, offset: u64) -> Option<u64> {
        self.log[offset as usize]
            .key
            .filter(|_| self.config.ordered)
    }

    /// The park index's release: the first entry of `key` (other than `removed`, the
    /// entry just removed, which must have been the first) becomes due when held.
    fn release_first_of(&mut self, key: u64, removed: Option<u64>) {
        let of_key: Vec<u64> = self
            .parked
            .iter()
            .filter(|(_, p)| p.key == Some(key))
            .map(|(o, _)| *o)
            .collect();
        let first = match removed {
            Some(r) if of_key.first() == Some(&r) => of_key.get(1),
            Some(_) => None,
            None => of_key.first(),
        };
        if let Some(&o) = first {
            let now = self.now;
            if let Some(p) = self.parked.get_mut(&o) {
                if p.is_held() {
                    *p = p.released(now);
                }
            }
        }
    }

    /// Ordered: every earlier event of `offset`'s key is acked or dead-lettered.
    fn check_key_order(&self, offset: u64) {
        let Some(k) = self.key_of(offset) else {
            return;
        };
        for o in 0..offset {
            if self.key_of(o) != Some(k) || self.filtered(o) {
                continue;
            }
            let done = self.acked_synced.contains(&o)
                || self.acked_unsynced.contains(&o)
                || self.parked_acked.contains(&o)
                || self.ever_dead.contains(&o);
            assert!(
                done,
                "offset {offset} of key {k} handed out before offset {o} of that key was acked or dead-lettered"
            );
        }
    }

    fn check_reply(&mut self, reply: Reply) {
        let (id, resolved, accepted) = match &reply {
            Reply::Ack {
                delivery_id,
                outcome,
            } => (
                delivery_id,
                *outcome == AckOutcome::Acked,
                *outcome == AckOutcome::Acked,
            ),
            Reply::Nack {
                delivery_id,
                outcome,
            } => (
                delivery_id,
                false,
                matches!(
                    outcome,
                    NackOutcome::Retrying { .. } | NackOutcome::DeadLettering
                ),
            ),
            Reply::Extend {
                delivery_id,
                outcome,
            } => (
                delivery_id,
                false,
                matches!(outcome, ExtendOutcome::Extended { .. }),
            ),
            Reply::Release {
                delivery_id,
                released,
            } => {
                // Not a consumer's call (the shell releases what it could not
                // deliver), so no session is checked: the attempt just did not count.
                if let Some(d) = self.delivery(delivery_id).filter(|_| *released) {
                    self.released
                        .insert((d.redrive_of.is_some() || d.parked, d.offset));
                }
                return;
            }
        };
        if !accepted {
            return;
        }
        let Some(d) = self.delivery(id).cloned() else {
            // Ids from before a crash that this run never saw handed out are only the
            // recovered ones (handed out by an earlier life): accepted is fine.
            return;
        };
        let redrive = d.redrive_of.is_some() || d.parked;
        assert_eq!(
            self.latest_id.get(&(redrive, d.offset)),
            Some(&d.delivery_id),
            "a superseded attempt was accepted: {reply:?}"
        );
        if let Some(b) = &d.session {
            assert_eq!(b, &self.session, "a fenced session was accepted: {reply:?}");
        }
        if resolved && !redrive {
            self.acked_unsynced.insert(d.offset);
        }
        if resolved && d.parked {
            self.parked_acked.insert(d.offset);
        }
    }

    fn check_bounds(&self) {
        if let Err(e) = self.core.check_consistency() {
            panic!("inconsistent core: {e}");
        }
        let s = self.core.stats();
        assert!(s.committed == self.committed, "core and store disagree");
        assert!(
            s.outstanding <= self.config.max_in_flight,
            "outstanding {} above max_in_flight {}",
            s.outstanding,
            self.config.max_in_flight
        );
        assert!(
            s.persisting + s.in_flight + s.waiting + s.dead_lettering <= self.config.max_in_flight
        );
        assert!(s.next_to_read <= self.committed + self.config.max_window as u64);
        // Read-ahead stops at max_pending; one read may overshoot it by a batch.
        // (Redriven entries wait as pending too; they have their own bound. So do
        // events unparked in the window: entries the window held already.)
        let in_window = self.unparked.range(self.committed..).count();
        assert!(
            s.pending.saturating_sub(s.redrives + in_window)
                < self.config.max_pending + self.config.read_batch,
            "pending {} beyond max_pending {} + read_batch {}",
            s.pending,
            self.config.max_pending,
            self.config.read_batch
        );
        if let Some(t) = self.core.next_wakeup() {
            assert!(
                t >= self.now || s.in_flight > 0,
                "a wake-up in the past: {t}"
            );
        }
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Publish(events) => {
                for (keep, delay, key) in events {
                    let offset = self.log.len() as u64;
                    self.log.push(EventMeta {
                        deliver_at_ms: delay.map(|d| self.now + d),
                        key,
                        ..kept_or_dropped(offset, keep)
                    });
                }
                self.feed(Input::LogEnd(self.log.len() as u64));
            }
            Op::ServeRead { fail } => {
                let Some((from, max)) = self.read.take() else {
                    return;
                };
                if fail {
                    self.feed(Input::ReadFailed);
                } else {
                    // The shell fills keys for an ordered subscription only, and marks
                    // those the park index holds.
                    let events = self
                        .log
                        .iter()
                        .skip(from as usize)
                        .take(max)
                        .map(|e| {
                            let key = e.key.filter(|_| self.config.ordered);
                            EventMeta {
                                key,
                                key_parked: key.is_some_and(|k| {
                                    self.parked.values().any(|p| p.key == Some(k))
                                }),
                                ..e.clone()
                            }
                        })
                        .collect();
                    self.feed(Input::EventsRead(events));
                }
            }
            Op::Pull { max, bind } => {
                self.next_pull += 1;
                let session = bind.then(|| self.session.clone());
                self.feed(Input::Pull {
                    pull_id: PullId(self.next_pull),
                    max_events: max,
                    max_bytes: u64::MAX,
                    at_least_one: true,
                    session,
                });
            }
            Op::ReportPersisted { idx, fail } => {
                if self.persists.is_empty() {
                    return;
                }
                let (offset, attempt) = self.persists.remove(idx % self.persists.len());
                // `fail`: the write landed but was reported failed (the harshest case).
                if fail {
                    self.feed(Input::PersistFailed { offset, attempt });
                } else {
                    self.feed(Input::AttemptPersisted { offset, attempt });
                }
            }
            Op::Ack { idx }
            | Op::Nack { idx, .. }
            | Op::Release { idx }
            | Op::Extend { idx, .. }
                if self.held.is_empty() =>
            {
                let _ = idx;
            }
            Op::Ack { idx } => {
                let d = self.held[idx % self.held.len()].clone();
                let r = DeliveryRef {
                    delivery_id: d.delivery_id.clone(),
                    session: self.check_for(&d),
                };
                self.feed(Input::Ack(vec![r]));
            }
            Op::AckUnknown => {
                let id = "5-0-0-1-ffffffffffffffff";
                let cmds = self
                    .core
                    .handle(Input::Ack(vec![DeliveryRef::unbound(id)]), self.now)
                    .unwrap();
                let replies: Vec<&Command> = cmds
                    .iter()
                    .filter(|c| matches!(c, Command::Reply(_)))
                    .collect();
                assert_eq!(
                    replies,
                    [&Command::Reply(Reply::Ack {
                        delivery_id: id.into(),
                        outcome: AckOutcome::Unknown
                    })]
                );
                self.run(cmds);
            }
            Op::Nack { idx, delay_ms } => {
                let d = self.held[idx % self.held.len()].clone();
                let r = DeliveryRef {
                    delivery_id: d.delivery_id.clone(),
                    session: self.check_for(&d),
                };
                self.feed(Input::Nack {
                    deliveries: vec![r],
                    reason: "consumer failed".into(),
                    delay_ms,
                });
            }
            Op::Extend { idx, ms } => {
                let d = self.held[idx % self.held.len()].clone();
                let r = DeliveryRef {
                    delivery_id: d.delivery_id.clone(),
                    session: self.check_for(&d),
                };
                self.feed(Input::Extend {
                    deliveries: vec![r],
                    ack_timeout_ms: ms,
                });
            }
            Op::Release { idx } => {
                let d = self.held[idx % self.held.len()].clone();
                self.feed(Input::Release(vec![d.delivery_id.clone()]));
            }
            Op::Advance(ms) => {
                self.now += ms;
                self.feed(Input::Tick);
            }
            Op::DeadLetterWrite { ok } => {
                let Some(offset) = self.dl_writes.pop_front() else {
                    return;
                };
                if ok {
                    // Created once per offset; a retry finds the entry.
                    self.dead.entry(offset).or_insert((DlState::Dead, 0));
                    self.ever_dead.insert(offset);
                    self.feed(Input::DeadLettered { offset });
                } else {
                    self.feed(Input::DeadLetterUnavailable { offset });
                }
            }
            Op::Redrive { idx } => {
                // The shell redrives only below the committed offset the OffsetStore
                // shows, and that read makes pending resolves durable first.
                self.sync();
                let dead: Vec<u64> = self
                    .dead
                    .iter()
                    .filter(|(_, e)| e.0 == DlState::Dead)
                    .map(|(o, _)| *o)
                    .collect();
                if dead.is_empty() {
                    return;
                }
                let offset = dead[idx % dead.len()];
                let input = Input::Redrive {
                    entry_id: partition().dead_letter_id(offset),
                    offset,
                };
                match self.core.handle(input, self.now) {
                    Ok(cmds) => {
                        self.dead.get_mut(&offset).unwrap().0 = DlState::Redriving;
                        self.max_redrive_handed.remove(&offset);
                        self.run(cmds);
                    }
                    // Above a gap it is not committed yet, or too many under way: the
                    // shell leaves the entry `dead`.
                    Err(meshd_dispatch::CoreError::RedriveOfUnresolvedOffset { .. })
                    | Err(meshd_dispatch::CoreError::RedriveBacklogFull { .. }) => {}
                    Err(e) => panic!("redrive refused: {e}"),
                }
            }
            Op::RedriveWrite { ok } => {
                let Some(w) = self.redrive_writes.pop_front() else {
                    return;
                };
                let offset = match w {
                    MetaWrite::Succeeded { offset } | MetaWrite::Failed { offset } => offset,
                };
                if ok {
                    match w {
                        MetaWrite::Succeeded { .. } => {
                            self.dead.remove(&offset);
                        }
                        MetaWrite::Failed { .. } => {
                            let e = self.dead.get_mut(&offset).unwrap();
                            *e = (DlState::Dead, e.1 + 1);
                        }
                    }
                    self.feed(Input::RedriveSettled { offset });
                } else {
                    self.feed(Input::RedriveUnavailable { offset });
                }
            }
            Op::Takeover => {
                let epoch = self.session.epoch + 1;
                self.session = SessionBinding {
                    session_id: format!("s-{epoch}"),
                    epoch,
                };
            }
            Op::ParkWrite => {
                let Some(entry) = self.park_writes.pop_front() else {
                    return;
                };
                let offset = entry.offset;
                // Durable (synced) before the core hears of it; an offset parked
                // already keeps its first entry (as the index does).
                self.parked.entry(offset).or_insert(entry);
                // Unparked, its attempts continue those of the window.
                let window = self.max_handed.get(&offset).copied().unwrap_or(0);
                self.max_park_handed.entry(offset).or_insert(window);
                self.feed(Input::Parked { offset });
            }
            Op::Unpark { idx } => {
                let due: Vec<(u64, u32)> = self
                    .parked
                    .iter()
                    .filter(|(o, p)| p.due_ms <= self.now && !self.unparked.contains(o))
                    .map(|(o, p)| (*o, p.attempt))
                    .collect();
                if due.is_empty() {
                    return;
                }
                let (offset, attempt) = due[idx % due.len()];
                match self
                    .core
                    .handle(Input::Unpark { offset, attempt }, self.now)
                {
                    Ok(cmds) => {
                        self.unparked.insert(offset);
                        self.run(cmds);
                    }
                    // Too many redrives under way: the shell tries again later. A
                    // due event parked above a gap is never refused: it does not
                    // wait for the offsets before it.
                    Err(meshd_dispatch::CoreError::RedriveBacklogFull { .. }) => {}
                    Err(e) => panic!("unpark refused: {e}"),
                }
            }
            Op::ParkSettleWrite { ok } => {
                let Some(w) = self.park_settles.pop_front() else {
                    return;
                };
                let offset = match w {
                    ParkSettle::Acked { offset }
                    | ParkSettle::DeadLetter { offset }
                    | ParkSettle::Repark { offset, .. } => offset,
                };
                if let (true, ParkSettle::Repark { due, attempt, .. }) = (ok, &w) {
                    // Parked again: waits for its new time; the count continues.
                    if let Some(p) = self.parked.get_mut(&offset) {
                        p.due_ms = *due;
                        p.attempt = *attempt;
                    }
                    self.unparked.remove(&offset);
                    self.feed(Input::RedriveSettled { offset });
                    return;
                }
                if ok {
                    if let ParkSettle::DeadLetter { .. } = w {
                        self.dead.entry(offset).or_insert((DlState::Dead, 0));
                        self.ever_dead.insert(offset);
                    }
                    // A keyed entry's removal releases the next of its key (one write).
                    if let Some(k) = self.parked.get(&offset).and_then(|p| p.key) {
                        self.release_first_of(k, Some(offset));
                    }
                    self.parked.remove(&offset);
                    self.unparked.remove(&offset);
                    self.max_park_handed.remove(&offset);
                    self.feed(Input::RedriveSettled { offset });
                } else {
                    if let ParkSettle::Repark { .. } = w {
                        self.repark_retried.insert(offset);
                    }
                    self.feed(Input::RedriveUnavailable { offset });
                }
            }
            Op::Flush => self.sync(),
            Op::Crash { lossy } => self.crash(lossy),
        }
    }

    fn crash(&mut self, lossy: bool) {
        if lossy {
            self.records = self.synced.clone();
            self.committed = self.synced_committed;
            self.acked_unsynced.clear();
        }
        self.sync();
        self.read = None;
        self.persists.clear();
        self.dl_writes.clear();
        self.redrive_writes.clear();
        self.park_writes.clear();
        self.park_settles.clear();
        self.repark_retried.clear();
        self.unparked.clear();
        self.generation += 1;
        let (core, cmds) = PartitionCore::recover(
            partition(),
            self.config.clone(),
            self.committed,
            self.records.values().cloned().collect(),
            &self.parked.iter().map(|(o, p)| (*o, p.attempt)).collect(),
            self.now,
            Sources::deterministic(self.generation << 40, RngJitter::seeded(self.generation)),
        )
        .expect("recover from what the store holds");
        self.core = core;
        // Parked offsets recovered from their records as unparked are under way
        // already: below the committed offset, and at or above it those whose ack
        // is being settled (any other record there is a parked retry's, resolved).
        self.unparked = self
            .parked
            .keys()
            .filter(|o| self.core.is_unparked(**o))
            .copied()
            .collect();
        self.run(cmds);
        // Keys whose first park entry is held: released once nothing holds them.
        let mut firsts: BTreeMap<u64, bool> = BTreeMap::new();
        for p in self.parked.values() {
            if let Some(k) = p.key {
                firsts.entry(k).or_insert(p.is_held());
            }
        }
        let held: Vec<u64> = firsts
            .into_iter()
            .filter(|(_, h)| *h)
            .map(|(k, _)| k)
            .collect();
        if !held.is_empty() {
            self.feed(Input::KeysHeld(held));
        }
        // Boot: the log end, and every entry still `redriving` is injected again.
        self.feed(Input::LogEnd(self.log.len() as u64));
        let redriving: Vec<u64> = self
            .dead
            .iter()
            .filter(|(_, e)| e.0 == DlState::Redriving)
            .map(|(o, _)| *o)
            .collect();
        for offset in redriving {
            self.feed(Input::Redrive {
                entry_id: partition().dead_letter_id(offset),
                offset,
            });
        }
    }

    /// A consumer that keeps acking, a store that works, time that passes: everything
    /// must drain.
    fn drain(&mut self) {
        for _ in 0..500 {
            let idle = self.committed as usize == self.log.len()
                && self.dead.values().all(|e| e.0 == DlState::Dead)
                && self.records.is_empty()
                && self.parked.is_empty()
                && self.core.stats().outstanding == 0
                && self.core.stats().redrives == 0;
            if idle && self.dead.is_empty() {
                return;
            }
            if idle {
                // Everything is resolved: redrive the dead letters (as many as the
                // core takes at once); a consumer that acks must settle every one.
                for _ in 0..self.dead.len() {
                    self.step(Op::Redrive { idx: 0 });
                }
            }
            self.step(Op::ServeRead { fail: false });
            while !self.persists.is_empty() {
                self.step(Op::ReportPersisted {
                    idx: 0,
                    fail: false,
                });
            }
            while !self.dl_writes.is_empty() {
                self.step(Op::DeadLetterWrite { ok: true });
            }
            while !self.redrive_writes.is_empty() {
                self.step(Op::RedriveWrite { ok: true });
            }
            while !self.park_writes.is_empty() {
                self.step(Op::ParkWrite);
            }
            while !self.park_settles.is_empty() {
                self.step(Op::ParkSettleWrite { ok: true });
            }
            for _ in 0..self.parked.len() {
                self.step(Op::Unpark { idx: 0 });
            }
            let before = self.held.len();
            self.step(Op::Pull {
                max: 4,
                bind: false,
            });
            while !self.persists.is_empty() {
                self.step(Op::ReportPersisted {
                    idx: 0,
                    fail: false,
                });
            }
            let fresh: Vec<Delivery> = self.held[before..].to_vec();
            if !fresh.is_empty() {
                let refs = fresh
                    .iter()
                    .map(|d| DeliveryRef {
                        delivery_id: d.delivery_id.clone(),
                        session: self.check_for(d),
                    })
                    .collect();
                self.feed(Input::Ack(refs));
            }
            self.step(Op::Advance(1500));
        }
        let s = self.core.stats();
        panic!(
            "did not drain: committed {} of {}, stats {s:?}, records {:?}, dead {:?}, parked {:?}",
            self.committed,
            self.log.len(),
            self.records,
            self.dead,
            self.parked
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 1024,
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn delivery_core_keeps_at_least_once_under_random_inputs_and_crashes(
        config in config(),
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let mut w = World::new(config);
        for op in ops {
            w.step(op);
        }
        w.drain();
        // Every offset is resolved, and nothing is left in the store.
        prop_assert_eq!(w.committed as usize, w.log.len());
        prop_assert!(w.records.is_empty());
    }
}

/// Any input at all, valid or not, at any time: the core answers `Ok` or a typed
/// error, never panics, and keeps its bounds.
fn arb_input() -> impl Strategy<Value = Input> {
    let offset = prop_oneof![0u64..12, Just(u64::MAX), Just(u64::MAX - 1)];
    let id = prop_oneof![
        "[0-9a-f-]{0,24}",
        (0u64..12, 1u32..4, 0u64..40).prop_map(|(o, a, n)| format!("5-0-{o}-{a}-{n:016x}")),
    ];
    let check = proptest::option::of(("s-[0-2]", proptest::option::of(0i64..3)).prop_map(
        |(session_id, current_epoch)| SessionCheck {
            session_id,
            current_epoch,
        },
    ));
    let refs = proptest::collection::vec(
        (id, check).prop_map(|(delivery_id, session)| DeliveryRef {
            delivery_id,
            session,
        }),
        0..3,
    );
    let events = (
        offset.clone(),
        0usize..5,
        any::<bool>(),
        proptest::option::of(prop_oneof![0u64..2_000_000, Just(u64::MAX)]),
        proptest::option::of(0u64..3),
        any::<bool>(),
    )
        .prop_map(|(from, n, keep, deliver_at_ms, key, key_parked)| {
            Input::EventsRead(
                (0..n as u64)
                    .map(|i| EventMeta {
                        deliver_at_ms,
                        key,
                        key_parked,
                        ..kept_or_dropped(from.saturating_add(i), keep)
                    })
                    .collect(),
            )
        });
    prop_oneof![
        prop_oneof![0u64..15, Just(u64::MAX)].prop_map(Input::LogEnd),
        events,
        Just(Input::ReadFailed),
        proptest::collection::vec(0u64..3, 0..3).prop_map(Input::KeysHeld),
        (0usize..5, any::<bool>()).prop_map(|(max_events, bind)| Input::Pull {
            pull_id: PullId(1),
            max_events,
            max_bytes: u64::MAX,
            at_least_one: true,
            session: bind.then(|| SessionBinding {
                session_id: "s-1".into(),
                epoch: 1
            }),
        }),
        (offset.clone(), 0u32..4)
            .prop_map(|(offset, attempt)| Input::AttemptPersisted { offset, attempt }),
        (offset.clone(), 0u32..4)
            .prop_map(|(offset, attempt)| Input::PersistFailed { offset, attempt }),
        refs.clone().prop_map(Input::Ack),
        (refs.clone(), proptest::option::of(0u64..u64::MAX)).prop_map(|(deliveries, delay_ms)| {
            Input::Nack {
                deliveries,
                reason: "r".into(),
                delay_ms,
            }
        }),
        (
            refs,
            prop_oneof![0u64..200, 100u64..700_000, Just(u64::MAX)]
        )
            .prop_map(|(deliveries, ack_timeout_ms)| Input::Extend {
                deliveries,
                ack_timeout_ms
            }),
        Just(Input::Tick),
        offset
            .clone()
            .prop_map(|offset| Input::DeadLettered { offset }),
        offset
            .clone()
            .prop_map(|offset| Input::DeadLetterUnavailable { offset }),
        (offset.clone(), any::<bool>()).prop_map(|(offset, good)| Input::Redrive {
            entry_id: if good {
                partition().dead_letter_id(offset)
            } else {
                "x".into()
            },
            offset
        }),
        offset
            .clone()
            .prop_map(|offset| Input::RedriveSettled { offset }),
        offset
            .clone()
            .prop_map(|offset| Input::RedriveUnavailable { offset }),
        offset.clone().prop_map(|offset| Input::Parked { offset }),
        (offset, 0u32..4).prop_map(|(offset, attempt)| Input::Unpark { offset, attempt }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn delivery_core_never_panics_on_any_input(
        config in config(),
        committed in prop_oneof![0u64..5, Just(u64::MAX - 3)],
        steps in proptest::collection::vec(
            (arb_input(), prop_oneof![0u64..3000, Just(u64::MAX / 2)]), 1..80),
    ) {
        let mut core = PartitionCore::new(
            partition(),
            config.clone(),
            committed,
            Sources::deterministic(0, RngJitter::seeded(1)),
        )
        .unwrap();
        let mut now = 1_000_000u64;
        let mut last_committed = committed;
        for (input, dt) in steps {
            now = now.saturating_add(dt);
            let before = core.stats();
            match core.handle(input, now) {
                Ok(_) => {}
                Err(_) => prop_assert_eq!(core.stats(), before, "an error changed state"),
            }
            let s = core.stats();
            prop_assert!(s.committed >= last_committed);
            last_committed = s.committed;
            prop_assert!(s.outstanding <= config.max_in_flight);
            if let Err(e) = core.check_consistency() {
                panic!("inconsistent core: {e}");
            }
            let _ = core.next_wakeup();
            let _ = core.ready(now);
        }
    }
}

/// An event the filtered model configuration keeps (`type` "keep") or drops.
fn kept_or_dropped(offset: u64, keep: bool) -> EventMeta {
    EventMeta {
        offset,
        attributes: vec![
            ("type".into(), if keep { "keep" } else { "drop" }.into()),
            ("source".into(), "/s".into()),
        ]
        .into(),
        size: 100,
        deliver_at_ms: None,
        key: None,
        key_parked: false,
    }
}
