//! A fake shell for the story tests: a log in a Vec, a fake clock, and helpers that
//! feed inputs and pick commands apart. Everything is deterministic (sequential ids,
//! fixed jitter).
#![allow(dead_code)]

use meshd_dispatch::{
    AckOutcome, Command, Config, Delivery, DeliveryRecord, DeliveryRef, EventMeta, FixedJitter,
    Input, NackOutcome, OffsetKey, Partition, PartitionCore, PullId, Reply, SessionBinding,
    Sources,
};
use meshd_stores::subscriptions::{Backoff, Selector};
use std::collections::BTreeMap;

pub fn key() -> OffsetKey {
    OffsetKey {
        subscription: "audit".into(),
        incarnation: 7,
        topic: "orders".into(),
        partition: 3,
    }
}

pub fn partition() -> Partition {
    Partition {
        key: key(),
        log_id: "instance-1".into(),
        owner_epoch: 11,
        reset_epoch: 0,
    }
}

/// max_attempts 3, ack timeout 1000 ms, backoff 100..800 ms, generous bounds.
pub fn config() -> Config {
    Config {
        max_attempts: 3,
        ack_timeout_ms: 1000,
        backoff: Backoff {
            initial_ms: 100,
            max_ms: 800,
        },
        max_in_flight: 1000,
        max_window: 10_000,
        max_pending: 1000,
        read_batch: 100,
        read_retry_ms: 500,
        selector: Selector::default(),
        unknown_size_bytes: 1 << 20,
        // Retries wait (the stories of parked retries set it).
        park_retries_after_ms: None,
        ordered: false,
    }
}

pub const T0: u64 = 1_000_000;

pub struct Shell {
    pub core: PartitionCore,
    pub now: u64,
    /// Event metadata by offset (offset = index).
    pub log: Vec<EventMeta>,
    next_pull: u64,
}

pub fn event(offset: u64) -> EventMeta {
    typed(offset, "order.created", "/shop")
}

/// An event with this CloudEvents `type` and `source` (what the tests' filters read).
pub fn typed(offset: u64, event_type: &str, source: &str) -> EventMeta {
    EventMeta {
        offset,
        attributes: vec![
            ("type".into(), event_type.into()),
            ("source".into(), source.into()),
        ]
        .into(),
        size: 100,
        deliver_at_ms: None,
        key: None,
        key_parked: false,
    }
}

impl Shell {
    /// A core at committed offset `committed` over a log that already holds offsets
    /// `0..committed` (resolved before).
    pub fn new(config: Config, committed: u64) -> Self {
        let core = PartitionCore::new(
            partition(),
            config,
            committed,
            Sources::deterministic(0, FixedJitter::Max),
        )
        .expect("valid config");
        let log = (0..committed).map(event).collect();
        Self {
            core,
            now: T0,
            log,
            next_pull: 1,
        }
    }

    pub fn recovered(
        config: Config,
        committed: u64,
        records: Vec<DeliveryRecord>,
        now: u64,
        log_len: u64,
    ) -> (Self, Vec<Command>) {
        Self::recovered_parked(config, committed, records, &BTreeMap::new(), now, log_len)
    }

    /// [`Shell::recovered`] with the offsets the park index holds (and the attempts
    /// their entries hold).
    pub fn recovered_parked(
        config: Config,
        committed: u64,
        records: Vec<DeliveryRecord>,
        parked: &BTreeMap<u64, u32>,
        now: u64,
        log_len: u64,
    ) -> (Self, Vec<Command>) {
        let (core, cmds) = PartitionCore::recover(
            partition(),
            config,
            committed,
            records,
            parked,
            now,
            Sources::deterministic(1 << 32, FixedJitter::Max),
        )
        .expect("recover");
        let log = (0..log_len).map(event).collect();
        (
            Self {
                core,
                now,
                log,
                next_pull: 1,
            },
            cmds,
        )
    }

    pub fn at(&mut self, t: u64) {
        self.now = t;
    }

    pub fn advance(&mut self, ms: u64) {
        self.now += ms;
    }

    /// Feeds one input, then answers every `ReadLog` from the log (as a shell would),
    /// and returns all commands.
    pub fn input(&mut self, input: Input) -> Vec<Command> {
        let cmds = self.core.handle(input, self.now).expect("valid input");
        self.serve_reads(cmds)
    }

    /// Feeds one input without serving reads.
    pub fn raw(&mut self, input: Input) -> Vec<Command> {
        self.core.handle(input, self.now).expect("valid input")
    }

    pub fn serve_reads(&mut self, cmds: Vec<Command>) -> Vec<Command> {
        let mut all = Vec::new();
        let mut queue = cmds;
        loop {
            let mut next = None;
            for c in queue {
                if let Command::ReadLog { from, max } = &c {
                    next = Some((*from, *max));
                }
                all.push(c);
            }
            let Some((from, max)) = next else {
                return all;
            };
            let events: Vec<EventMeta> = self
                .log
                .iter()
                .skip(from as usize)
                .take(max)
                .cloned()
                .collect();
            queue = self
                .core
                .handle(Input::EventsRead(events), self.now)
                .expect("read answer");
        }
    }

    /// Appends events (with the given type/source) and tells the core the new end.
    pub fn publish_typed(&mut self, events: &[(&str, &str)]) -> Vec<Command> {
        for (t, s) in events {
            let offset = self.log.len() as u64;
            self.log.push(typed(offset, t, s));
        }
        self.input(Input::LogEnd(self.log.len() as u64))
    }

    /// Appends events not to be handed out before these times (`None`: at once) and
    /// tells the core the new end.
    pub fn publish_delayed(&mut self, deliver_at: &[Option<u64>]) -> Vec<Command> {
        for at in deliver_at {
            let offset = self.log.len() as u64;
            self.log.push(EventMeta {
                deliver_at_ms: *at,
                ..event(offset)
            });
        }
        self.input(Input::LogEnd(self.log.len() as u64))
    }

    /// Appends events of the given stored sizes and tells the core the new end.
    pub fn publish_sized(&mut self, sizes: &[u64]) -> Vec<Command> {
        for size in sizes {
            let offset = self.log.len() as u64;
            self.log.push(EventMeta {
                size: *size,
                ..event(offset)
            });
        }
        self.input(Input::LogEnd(self.log.len() as u64))
    }

    /// A pull with a byte budget: the records the core asked to persist.
    pub fn pull_bytes(
        &mut self,
        max: usize,
        max_bytes: u64,
        at_least_one: bool,
    ) -> Vec<DeliveryRecord> {
        let pull_id = self.pull_id();
        let cmds = self.input(Input::Pull {
            pull_id,
            max_events: max,
            max_bytes,
            at_least_one,
            session: None,
        });
        persists(&cmds)
    }

    pub fn publish(&mut self, n: usize) -> Vec<Command> {
        let events = vec![("order.created", "/shop"); n];
        self.publish_typed(&events)
    }

    pub fn pull_id(&mut self) -> PullId {
        self.next_pull += 1;
        PullId(self.next_pull)
    }

    /// A pull: returns the records the core asked to persist (nothing handed out yet).
    pub fn pull_with(
        &mut self,
        max: usize,
        session: Option<SessionBinding>,
    ) -> Vec<DeliveryRecord> {
        let pull_id = self.pull_id();
        let cmds = self.input(Input::Pull {
            pull_id,
            max_events: max,
            max_bytes: u64::MAX,
            at_least_one: true,
            session,
        });
        assert!(
            handouts(&cmds).is_empty(),
            "a pull never hands out before the attempt is persisted: {cmds:?}"
        );
        persists(&cmds)
    }

    pub fn pull(&mut self, max: usize) -> Vec<DeliveryRecord> {
        self.pull_with(max, None)
    }

    /// Reports the records durable; returns the hand-outs.
    pub fn persisted(&mut self, records: &[DeliveryRecord]) -> Vec<Delivery> {
        let mut out = Vec::new();
        for r in records {
            let cmds = self.input(Input::AttemptPersisted {
                offset: r.offset,
                attempt: r.attempt,
            });
            out.extend(handouts(&cmds));
        }
        out
    }

    /// Pull and persist: the deliveries a consumer receives.
    pub fn deliver(&mut self, max: usize) -> Vec<Delivery> {
        let records = self.pull(max);
        self.persisted(&records)
    }

    pub fn deliver_with(&mut self, max: usize, session: SessionBinding) -> Vec<Delivery> {
        let records = self.pull_with(max, Some(session));
        self.persisted(&records)
    }

    pub fn ack(&mut self, ids: &[&str]) -> Vec<Command> {
        self.input(Input::Ack(
            ids.iter().map(|i| DeliveryRef::unbound(*i)).collect(),
        ))
    }

    pub fn nack(&mut self, ids: &[&str], reason: &str) -> Vec<Command> {
        self.input(Input::Nack {
            deliveries: ids.iter().map(|i| DeliveryRef::unbound(*i)).collect(),
            reason: reason.into(),
            delay_ms: None,
        })
    }

    pub fn tick(&mut self) -> Vec<Command> {
        self.input(Input::Tick)
    }
}

pub fn persists(cmds: &[Command]) -> Vec<DeliveryRecord> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::PersistAttempt { record, .. } => Some(record.clone()),
            _ => None,
        })
        .collect()
}

pub fn handouts(cmds: &[Command]) -> Vec<Delivery> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::HandOut { delivery, .. } => Some(delivery.clone()),
            _ => None,
        })
        .collect()
}

pub fn updates(cmds: &[Command]) -> Vec<DeliveryRecord> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Update(r) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

/// `(remove, advance.to)` of every Resolve.
pub fn resolves(cmds: &[Command]) -> Vec<(Vec<u64>, Option<u64>)> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Resolve { remove, advance } => {
                Some((remove.clone(), advance.as_ref().map(|a| a.to)))
            }
            _ => None,
        })
        .collect()
}

pub fn dead_letters(cmds: &[Command]) -> Vec<meshd_dispatch::DeadLetterRequest> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::DeadLetter(d) => Some(d.clone()),
            _ => None,
        })
        .collect()
}

pub fn reads(cmds: &[Command]) -> Vec<(u64, usize)> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::ReadLog { from, max } => Some((*from, *max)),
            _ => None,
        })
        .collect()
}

pub fn ack_outcomes(cmds: &[Command]) -> Vec<AckOutcome> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Reply(Reply::Ack { outcome, .. }) => Some(outcome.clone()),
            _ => None,
        })
        .collect()
}

pub fn nack_outcomes(cmds: &[Command]) -> Vec<NackOutcome> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Reply(Reply::Nack { outcome, .. }) => Some(outcome.clone()),
            _ => None,
        })
        .collect()
}

pub fn offsets(ds: &[Delivery]) -> Vec<u64> {
    ds.iter().map(|d| d.offset).collect()
}

/// Everything that changes the store or the consumer (replies and reads excluded).
pub fn effects(cmds: &[Command]) -> Vec<&Command> {
    cmds.iter()
        .filter(|c| !matches!(c, Command::Reply(_) | Command::ReadLog { .. }))
        .collect()
}

/// Every reply, in order.
pub fn replies(cmds: &[Command]) -> Vec<Reply> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Reply(r) => Some(r.clone()),
            _ => None,
        })
        .collect()
}
