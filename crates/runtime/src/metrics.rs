//! The runtime's Prometheus metrics: per-subscription delivery counters, per-topic
//! publish counters, store write latency histograms and error counters labelled by
//! store and backend, and the recovery figures. Rendered as text by `/metrics`; every
//! name starts with `meshd_`.

use meshd_meta::Backend;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// Upper bounds (seconds) of the store write latency buckets.
const BUCKETS: [f64; 13] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Counters of one subscription (by name: a re-created subscription continues them,
/// as Prometheus counters should).
#[derive(Default)]
pub struct SubCounters {
    /// Hand-outs (every attempt).
    pub delivered: AtomicU64,
    /// Hand-outs with attempt > 1.
    pub redelivered: AtomicU64,
    pub acked: AtomicU64,
    pub nacked: AtomicU64,
    /// Dead-letter entries created.
    pub dead_lettered: AtomicU64,
    /// Events the filter resolved without delivery are not counted; events that could
    /// not be read for a hand-out are.
    pub read_failures: AtomicU64,
    /// Push requests answered 2xx in time.
    pub push_ok: AtomicU64,
    /// Push requests that failed (status, timeout, connection).
    pub push_failed: AtomicU64,
    /// From the log's append to each event's first hand-out.
    pub delivery_latency: DeliveryLatency,
    /// The same hand-out, ack, nack and dead-letter counts per partition (what
    /// `GET /v1/subscriptions/{name}/stats` answers): their sums are the counters
    /// above, counted at the same places.
    partitions: Mutex<BTreeMap<u32, Arc<PartCounters>>>,
}

/// One partition's share of a subscription's counters (see [`SubCounters`]).
#[derive(Default, Debug)]
pub struct PartCounters {
    pub delivered: AtomicU64,
    pub redelivered: AtomicU64,
    pub acked: AtomicU64,
    pub nacked: AtomicU64,
    pub dead_lettered: AtomicU64,
}

/// What a partition task counts, for its subscription and its partition at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    /// A hand-out; `true` when it is a redelivery (attempt > 1).
    Delivered(bool),
    Acked,
    Nacked,
    DeadLettered,
}

impl SubCounters {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// The counters of partition `p` (created at 0 on first use).
    pub fn partition(&self, p: u32) -> Arc<PartCounters> {
        lock(&self.partitions).entry(p).or_default().clone()
    }

    /// Counts one `what` for the subscription and for `part`.
    pub fn count(&self, part: &PartCounters, what: Counted) {
        let (sub, per) = match what {
            Counted::Delivered(again) => {
                if again {
                    Self::add(&self.redelivered, 1);
                    Self::add(&part.redelivered, 1);
                }
                (&self.delivered, &part.delivered)
            }
            Counted::Acked => (&self.acked, &part.acked),
            Counted::Nacked => (&self.nacked, &part.nacked),
            Counted::DeadLettered => (&self.dead_lettered, &part.dead_lettered),
        };
        Self::add(sub, 1);
        Self::add(per, 1);
    }
}

/// Upper bounds (seconds) of the end-to-end delivery latency buckets: from the log's
/// append to the first hand-out, which includes any backlog the subscription has.
const DELIVERY_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0, 60.0, 300.0, 3600.0,
];

/// A latency histogram over fixed bucket bounds (the runtime's and the HTTP layer's).
pub struct Histogram {
    bounds: &'static [f64],
    buckets: Vec<u64>,
    count: u64,
    sum_seconds: f64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            buckets: vec![0; bounds.len()],
            count: 0,
            sum_seconds: 0.0,
        }
    }

    pub fn observe(&mut self, took: Duration) {
        let s = took.as_secs_f64();
        for (i, b) in self.bounds.iter().enumerate() {
            if s <= *b {
                self.buckets[i] += 1;
            }
        }
        self.count += 1;
        self.sum_seconds += s;
    }

    /// The `_bucket`, `_sum` and `_count` lines of `name` with `labels` (`a="b",…`).
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, n) in self.bounds.iter().zip(&self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {n}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum_seconds);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// A subscription's delivery latency histogram ([`DELIVERY_BUCKETS`]), held with its
/// other counters so a partition task observes its hand-outs without a lookup by name.
pub struct DeliveryLatency(Mutex<Histogram>);

impl Default for DeliveryLatency {
    fn default() -> Self {
        Self(Mutex::new(Histogram::new(&DELIVERY_BUCKETS)))
    }
}

impl DeliveryLatency {
    /// Events handed out for the first time, each `waited` after the log accepted it.
    pub fn observe(&self, waited: impl IntoIterator<Item = Duration>) {
        let mut h = lock(&self.0);
        for w in waited {
            h.observe(w);
        }
    }
}

/// Histograms by one label value (a topic).
struct Labelled {
    bounds: &'static [f64],
    by: Mutex<BTreeMap<String, Histogram>>,
}

impl Labelled {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            by: Mutex::default(),
        }
    }

    fn observe(&self, value: &str, took: Duration) {
        let mut by = lock(&self.by);
        match by.get_mut(value) {
            Some(h) => h.observe(took),
            None => {
                let mut h = Histogram::new(self.bounds);
                h.observe(took);
                by.insert(value.to_string(), h);
            }
        }
    }

    fn render(&self, out: &mut String, name: &str, help: &str, label: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (value, h) in lock(&self.by).iter() {
            h.render(out, name, &format!("{label}=\"{value}\""));
        }
    }
}

/// Everything the runtime counts.
pub struct Metrics {
    subs: Mutex<BTreeMap<String, Arc<SubCounters>>>,
    published: Mutex<BTreeMap<String, u64>>,
    /// Per topic: published events answered as duplicates (not stored again).
    duplicates: Mutex<BTreeMap<String, u64>>,
    latency: Mutex<BTreeMap<(&'static str, Backend, &'static str), Histogram>>,
    errors: Mutex<BTreeMap<(&'static str, Backend, String), u64>>,
    recovery: Mutex<Option<(Duration, u64)>>,
    tasks_requeued: AtomicU64,
    /// Local memtables flushed because their column family was quiet.
    quiet_flushes: AtomicU64,
    /// Hand-outs released because the forwarded answer holding them did not reach
    /// the instance that asked (http-api.md "Bounded answers").
    released: AtomicU64,
    /// Forwarded pulls whose answer did not arrive here (so this instance asked the
    /// owner to release it).
    forward_releases: AtomicU64,
    /// Pulls forwarded to other owners: (asked without waiting, long polls).
    forwarded_pulls: [AtomicU64; 2],
    /// Settle notices to the instances whose streams hold forwarded deliveries: sent,
    /// failed.
    settle_notices: [AtomicU64; 2],
    /// Cluster mode: attempt-ledger writes, entries recorded, records pruned.
    ledger_writes: AtomicU64,
    ledger_entries: AtomicU64,
    ledger_pruned: AtomicU64,
    tasks_refused: Mutex<BTreeMap<String, u64>>,
    tasks_by_state: Mutex<Option<BTreeMap<&'static str, u64>>>,
    publish_seconds: Labelled,
    /// Cluster mode only (rendered when `cluster` is set).
    pub ownership: OwnershipCounters,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            subs: Default::default(),
            published: Default::default(),
            duplicates: Default::default(),
            latency: Default::default(),
            errors: Default::default(),
            recovery: Default::default(),
            tasks_requeued: Default::default(),
            quiet_flushes: Default::default(),
            released: Default::default(),
            forward_releases: Default::default(),
            forwarded_pulls: Default::default(),
            settle_notices: Default::default(),
            ledger_writes: Default::default(),
            ledger_entries: Default::default(),
            ledger_pruned: Default::default(),
            tasks_refused: Default::default(),
            tasks_by_state: Default::default(),
            ownership: Default::default(),
            publish_seconds: Labelled::new(&BUCKETS),
        }
    }
}

/// Partition ownership in cluster mode.
#[derive(Default)]
pub struct OwnershipCounters {
    pub cluster: std::sync::atomic::AtomicBool,
    pub acquired: AtomicU64,
    pub released: AtomicU64,
    /// Partitions dropped without a release (the lease's local deadline passed, the
    /// membership stopped, an owner key was no longer ours).
    pub lost: AtomicU64,
    pub owned: AtomicU64,
    /// From the moment this instance was designated a partition's owner to its
    /// acquisition (the previous owner's drain, or its lease running out): the
    /// takeover time as this instance sees it.
    pub takeover_ms_sum: AtomicU64,
    pub takeover_count: AtomicU64,
    pub takeover_ms_max: AtomicU64,
}

impl OwnershipCounters {
    pub fn takeover(&self, took: Duration) {
        let ms = took.as_millis() as u64;
        self.takeover_ms_sum.fetch_add(ms, Ordering::Relaxed);
        self.takeover_count.fetch_add(1, Ordering::Relaxed);
        self.takeover_ms_max.fetch_max(ms, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String) {
        use std::fmt::Write;
        if !self.cluster.load(Ordering::Relaxed) {
            return;
        }
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let _ = writeln!(out, "# HELP meshd_owned_partitions Partitions this instance owns now.\n# TYPE meshd_owned_partitions gauge\nmeshd_owned_partitions {}", get(&self.owned));
        let _ = writeln!(out, "# HELP meshd_ownership_changes_total Partition ownership changes on this instance, by kind (acquired, released, lost).\n# TYPE meshd_ownership_changes_total counter");
        for (kind, c) in [
            ("acquired", &self.acquired),
            ("released", &self.released),
            ("lost", &self.lost),
        ] {
            let _ = writeln!(
                out,
                "meshd_ownership_changes_total{{kind=\"{kind}\"}} {}",
                get(c)
            );
        }
        let _ = writeln!(out, "# HELP meshd_partition_takeover_seconds From being designated a partition's owner to acquiring it.\n# TYPE meshd_partition_takeover_seconds summary");
        let _ = writeln!(
            out,
            "meshd_partition_takeover_seconds_sum {}",
            get(&self.takeover_ms_sum) as f64 / 1000.0
        );
        let _ = writeln!(
            out,
            "meshd_partition_takeover_seconds_count {}",
            get(&self.takeover_count)
        );
        let _ = writeln!(out, "# HELP meshd_partition_takeover_seconds_max The longest takeover seen.\n# TYPE meshd_partition_takeover_seconds_max gauge\nmeshd_partition_takeover_seconds_max {}", get(&self.takeover_ms_max) as f64 / 1000.0);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding a metrics lock cannot leave a counter half-updated in a
    // way that matters; keep counting.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Metrics {
    pub fn subscription(&self, name: &str) -> Arc<SubCounters> {
        lock(&self.subs)
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    pub fn published(&self, topic: &str, events: u64) {
        *lock(&self.published).entry(topic.to_string()).or_default() += events;
    }

    /// `events` of a publish were duplicates within the topic's dedup window.
    pub fn duplicates(&self, topic: &str, events: u64) {
        *lock(&self.duplicates).entry(topic.to_string()).or_default() += events;
    }

    /// One store write (`op`) took `took`.
    pub fn write_latency(
        &self,
        store: &'static str,
        backend: Backend,
        op: &'static str,
        took: Duration,
    ) {
        lock(&self.latency)
            .entry((store, backend, op))
            .or_insert_with(|| Histogram::new(&BUCKETS))
            .observe(took);
    }

    /// One publish request to `topic` took `took`, from its arrival to its answer
    /// being ready (its events durable).
    pub fn publish_latency(&self, topic: &str, took: Duration) {
        self.publish_seconds.observe(topic, took);
    }

    /// One failed store call, by error kind.
    pub fn store_error(&self, store: &'static str, backend: Backend, kind: &str) {
        *lock(&self.errors)
            .entry((store, backend, kind.to_string()))
            .or_default() += 1;
    }

    /// One attempt-ledger write applied (cluster mode): entries recorded, records
    /// pruned.
    pub fn ledger_write(&self, entries: usize, pruned: usize) {
        self.ledger_writes.fetch_add(1, Ordering::Relaxed);
        self.ledger_entries
            .fetch_add(entries as u64, Ordering::Relaxed);
        self.ledger_pruned
            .fetch_add(pruned as u64, Ordering::Relaxed);
    }

    /// Memtables of quiet Local column families flushed (bounding the WAL replay).
    pub fn quiet_flushes(&self, n: u64) {
        self.quiet_flushes.fetch_add(n, Ordering::Relaxed);
    }

    /// Hand-outs of a forwarded answer released at the asking instance's request.
    pub fn released(&self, n: u64) {
        self.released.fetch_add(n, Ordering::Relaxed);
    }

    /// A forwarded pull's answer did not arrive; its owner was asked to release it.
    /// A pull forwarded to another owner; `waits`: a long poll.
    pub fn forwarded_pull(&self, waits: bool) {
        self.forwarded_pulls[usize::from(waits)].fetch_add(1, Ordering::Relaxed);
    }

    /// A notice told (or failed to tell) another instance that deliveries its streams
    /// hold were settled here.
    pub fn settle_notice(&self, ok: bool) {
        self.settle_notices[usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn forward_release(&self) {
        self.forward_releases.fetch_add(1, Ordering::Relaxed);
    }

    pub fn tasks_requeued(&self) {
        self.tasks_requeued.fetch_add(1, Ordering::Relaxed);
    }

    /// A task write refused by the task's state (illegal transition, stale version,
    /// fenced session, ...), by kind.
    pub fn task_refused(&self, kind: &str) {
        *lock(&self.tasks_refused)
            .entry(kind.to_string())
            .or_default() += 1;
    }

    /// The latest count of tasks per state (from a periodic scan).
    pub fn task_counts(&self, counts: BTreeMap<&'static str, u64>) {
        *lock(&self.tasks_by_state) = Some(counts);
    }

    pub fn recovered(&self, took: Duration, records: u64) {
        *lock(&self.recovery) = Some((took, records));
    }

    /// Appends the counters (gauges are rendered by the runtime, which knows them).
    pub fn render(&self, out: &mut String) {
        self.ownership.render(out);
        let subs = lock(&self.subs);
        type Field = fn(&SubCounters) -> &AtomicU64;
        let families: [(&str, &str, Field); 8] = [
            (
                "meshd_deliveries_total",
                "Events handed out (every attempt).",
                |c| &c.delivered,
            ),
            (
                "meshd_redeliveries_total",
                "Hand-outs with attempt > 1.",
                |c| &c.redelivered,
            ),
            ("meshd_acks_total", "Deliveries acked.", |c| &c.acked),
            (
                "meshd_nacks_total",
                "Deliveries nacked by consumers.",
                |c| &c.nacked,
            ),
            (
                "meshd_dead_letters_total",
                "Events moved to the dead-letter store.",
                |c| &c.dead_lettered,
            ),
            (
                "meshd_push_requests_ok_total",
                "Push requests answered 2xx within the ack timeout.",
                |c| &c.push_ok,
            ),
            (
                "meshd_push_requests_failed_total",
                "Push requests that failed (another status, a timeout, a refused connection).",
                |c| &c.push_failed,
            ),
            (
                "meshd_delivery_read_failures_total",
                "Events that could not be read from the log for a hand-out or a dead-letter.",
                |c| &c.read_failures,
            ),
        ];
        for (name, help, field) in families {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (sub, c) in subs.iter() {
                let _ = writeln!(
                    out,
                    "{name}{{subscription=\"{sub}\"}} {}",
                    field(c).load(Ordering::Relaxed)
                );
            }
        }
        let _ = writeln!(out, "# HELP meshd_delivery_latency_seconds From the log's append to an event's first hand-out, by subscription (backlog included).\n# TYPE meshd_delivery_latency_seconds histogram");
        for (sub, c) in subs.iter() {
            let h = lock(&c.delivery_latency.0);
            if h.count > 0 {
                h.render(
                    out,
                    "meshd_delivery_latency_seconds",
                    &format!("subscription=\"{sub}\""),
                );
            }
        }
        drop(subs);
        let _ = writeln!(out, "# HELP meshd_published_events_total Events durably appended to the log.\n# TYPE meshd_published_events_total counter");
        for (topic, n) in lock(&self.published).iter() {
            let _ = writeln!(out, "meshd_published_events_total{{topic=\"{topic}\"}} {n}");
        }
        let _ = writeln!(out, "# HELP meshd_publish_duplicates_total Published events answered as duplicates of an event stored within the topic's dedup window (not stored again).\n# TYPE meshd_publish_duplicates_total counter");
        for (topic, n) in lock(&self.duplicates).iter() {
            let _ = writeln!(
                out,
                "meshd_publish_duplicates_total{{topic=\"{topic}\"}} {n}"
            );
        }
        let _ = writeln!(out, "# HELP meshd_store_write_seconds Store write latency.\n# TYPE meshd_store_write_seconds histogram");
        for ((store, backend, op), h) in lock(&self.latency).iter() {
            let labels = format!("store=\"{store}\",backend=\"{backend}\",op=\"{op}\"");
            h.render(out, "meshd_store_write_seconds", &labels);
        }
        self.publish_seconds.render(
            out,
            "meshd_publish_seconds",
            "Successful publish requests by topic, from the body in hand to the answer (events durable).",
            "topic",
        );
        let _ = writeln!(out, "# HELP meshd_store_errors_total Failed store calls by store, backend and error kind.\n# TYPE meshd_store_errors_total counter");
        for ((store, backend, kind), n) in lock(&self.errors).iter() {
            let _ = writeln!(
                out,
                "meshd_store_errors_total{{store=\"{store}\",backend=\"{backend}\",kind=\"{kind}\"}} {n}"
            );
        }
        let _ = writeln!(out, "# HELP meshd_local_quiet_flushes_total Memtables of quiet Local column families flushed on the timer, so the write-ahead log a start after a crash replays stays bounded.\n# TYPE meshd_local_quiet_flushes_total counter\nmeshd_local_quiet_flushes_total{{backend=\"rocksdb\"}} {}", self.quiet_flushes.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP meshd_deliveries_released_total Hand-outs of a pull forwarded by another instance whose answer did not reach it: due again at once, the attempt not counted.\n# TYPE meshd_deliveries_released_total counter\nmeshd_deliveries_released_total {}", self.released.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP meshd_forwarded_pull_releases_total Pulls forwarded to another instance whose answer did not arrive here, or long polls given up because another owner answered first (their owner was asked to release what they handed out).\n# TYPE meshd_forwarded_pull_releases_total counter\nmeshd_forwarded_pull_releases_total {}", self.forward_releases.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP meshd_stream_settle_notices_total Notices to the instance holding a stream that deliveries it pulled through this owner were acked or nacked elsewhere (so its credit comes back before their leases run out): sent, or failed (then the credit comes back at the lease deadline).\n# TYPE meshd_stream_settle_notices_total counter\nmeshd_stream_settle_notices_total{{result=\"sent\"}} {}\nmeshd_stream_settle_notices_total{{result=\"failed\"}} {}", self.settle_notices[0].load(Ordering::Relaxed), self.settle_notices[1].load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP meshd_forwarded_pulls_total Pulls forwarded to the owners of other partitions: asked without waiting, or long polls (a waiting pull holds one at each owner).\n# TYPE meshd_forwarded_pulls_total counter\nmeshd_forwarded_pulls_total{{wait=\"no\"}} {}\nmeshd_forwarded_pulls_total{{wait=\"long\"}} {}", self.forwarded_pulls[0].load(Ordering::Relaxed), self.forwarded_pulls[1].load(Ordering::Relaxed));
        if self.ownership.cluster.load(Ordering::Relaxed) {
            let _ = writeln!(out, "# HELP meshd_attempt_ledger_writes_total Cluster mode: attempt-ledger transactions applied in Meta (one per pull batch or extend, or a prune).\n# TYPE meshd_attempt_ledger_writes_total counter\nmeshd_attempt_ledger_writes_total {}", self.ledger_writes.load(Ordering::Relaxed));
            let _ = writeln!(out, "# HELP meshd_attempt_ledger_entries_total Cluster mode: deliveries recorded in the attempt ledger.\n# TYPE meshd_attempt_ledger_entries_total counter\nmeshd_attempt_ledger_entries_total {}", self.ledger_entries.load(Ordering::Relaxed));
            let _ = writeln!(out, "# HELP meshd_attempt_ledger_pruned_total Cluster mode: attempt-ledger records deleted because they held nothing current.\n# TYPE meshd_attempt_ledger_pruned_total counter\nmeshd_attempt_ledger_pruned_total {}", self.ledger_pruned.load(Ordering::Relaxed));
        }
        let _ = writeln!(out, "# HELP meshd_tasks_requeued_total Tasks returned to submitted because their assignee's session ended.\n# TYPE meshd_tasks_requeued_total counter\nmeshd_tasks_requeued_total {}", self.tasks_requeued.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP meshd_task_writes_refused_total Task claims and transitions refused by the task's state, by kind.\n# TYPE meshd_task_writes_refused_total counter");
        for (kind, n) in lock(&self.tasks_refused).iter() {
            let _ = writeln!(
                out,
                "meshd_task_writes_refused_total{{kind=\"{kind}\"}} {n}"
            );
        }
        if let Some(counts) = lock(&self.tasks_by_state).as_ref() {
            let _ = writeln!(
                out,
                "# HELP meshd_tasks Tasks by state (scanned every 30 s).\n# TYPE meshd_tasks gauge"
            );
            for (state, n) in counts {
                let _ = writeln!(out, "meshd_tasks{{state=\"{state}\"}} {n}");
            }
        }
        if let Some((took, records)) = *lock(&self.recovery) {
            let _ = writeln!(out, "# HELP meshd_recovery_seconds How long the boot recovery of delivery state took.\n# TYPE meshd_recovery_seconds gauge\nmeshd_recovery_seconds {}", took.as_secs_f64());
            let _ = writeln!(out, "# HELP meshd_recovery_records Delivery records re-armed at boot.\n# TYPE meshd_recovery_records gauge\nmeshd_recovery_records {records}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_count_everything() {
        let m = Metrics::default();
        m.write_latency(
            "log",
            Backend::RocksDb,
            "append",
            Duration::from_micros(300),
        );
        m.write_latency("log", Backend::RocksDb, "append", Duration::from_millis(20));
        m.write_latency("log", Backend::RocksDb, "append", Duration::from_secs(9));
        let mut out = String::new();
        m.render(&mut out);
        let line = |le: &str| {
            out.lines()
                .find(|l| {
                    l.starts_with("meshd_store_write_seconds_bucket")
                        && l.contains(&format!("le=\"{le}\""))
                })
                .map(|l| l.rsplit(' ').next().unwrap_or("").to_string())
        };
        assert_eq!(line("0.0005").as_deref(), Some("1"));
        assert_eq!(line("0.025").as_deref(), Some("2"));
        assert_eq!(line("5").as_deref(), Some("2"));
        assert_eq!(line("+Inf").as_deref(), Some("3"));
    }

    #[test]
    fn labelled_histograms_keep_one_series_per_label_value() {
        let m = Metrics::default();
        m.publish_latency("orders", Duration::from_millis(3));
        m.publish_latency("orders", Duration::from_millis(30));
        m.publish_latency("audit", Duration::from_secs(20));
        m.subscription("billing")
            .delivery_latency
            .observe([Duration::from_secs(90)]);
        let mut out = String::new();
        m.render(&mut out);
        for sample in [
            r#"meshd_publish_seconds_bucket{topic="orders",le="0.005"} 1"#,
            r#"meshd_publish_seconds_bucket{topic="orders",le="0.05"} 2"#,
            r#"meshd_publish_seconds_bucket{topic="orders",le="+Inf"} 2"#,
            r#"meshd_publish_seconds_count{topic="audit"} 1"#,
            r#"meshd_publish_seconds_bucket{topic="audit",le="5"} 0"#,
            r#"meshd_delivery_latency_seconds_bucket{subscription="billing",le="60"} 0"#,
            r#"meshd_delivery_latency_seconds_bucket{subscription="billing",le="300"} 1"#,
            r#"meshd_delivery_latency_seconds_sum{subscription="billing"} 90"#,
        ] {
            assert!(out.lines().any(|l| l == sample), "no {sample} in:\n{out}");
        }
    }

    #[test]
    fn subscription_counters_render_with_their_label() {
        let m = Metrics::default();
        let c = m.subscription("audit");
        SubCounters::add(&c.acked, 3);
        let mut out = String::new();
        m.render(&mut out);
        assert!(
            out.contains("meshd_acks_total{subscription=\"audit\"} 3"),
            "{out}"
        );
    }
}
