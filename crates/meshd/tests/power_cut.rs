//! Power cuts under the real binary: meshd runs unmodified on the lazy
//! filesystem (`meshd_test_support::lazyfs`), which keeps every write that was not
//! fsynced in memory and drops it at the cut, undoes directory changes that were not
//! synced, and can keep a torn prefix of the unsynced tail. A SIGKILL alone keeps the
//! page cache, so before this no test could tell a missing fsync from a present one.
//!
//! What the README promises and these check: a publish answered 201 is on disk; an ack
//! older than `--delivery-flush-ms` is on disk; attempt counts and committed offsets
//! never go back; the publish dedup index keeps every 201'd event (a resend is its
//! duplicate); the embedded Meta never hands out a revision twice; and a torn
//! write-ahead-log tail either opens (nothing acknowledged was in it) or stops the start
//! naming the data dir, and `--wal-recovery point-in-time` then opens with every 201.
//! The last test runs JetStream on the same filesystem (`sync_interval: always` and its
//! default) and reports what each loses (`docs/power-cuts.md`).

mod common;

use common::*;
use meshd_test_support::lazyfs::{Entries, LazyFs, Torn};
use meshd_test_support::meshd::MeshdProcess;
use serde_json::{json, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

const FLUSH_MS: u64 = 100;

/// A data dir on the lazy filesystem, created the way an operator's provisioning does
/// it (the directory and its entry synced), so the cut tests meshd and not the setup.
fn data_dir(fs: &LazyFs) -> PathBuf {
    let d = fs.path().join("data");
    std::fs::create_dir(&d).unwrap();
    std::fs::File::open(fs.path()).unwrap().sync_all().unwrap();
    d
}

async fn start_on(dir: &Path, extra: &[&str]) -> MeshdProcess {
    let flush = FLUSH_MS.to_string();
    let mut args = vec!["--delivery-flush-ms", flush.as_str()];
    args.extend_from_slice(extra);
    MeshdProcess::start(bin(), dir, &args).await.unwrap()
}

/// Publishes `n` events in batches of 10; returns id → (partition, offset) of the 201s.
async fn publish_batches(
    a: &str,
    topic: &str,
    prefix: &str,
    n: usize,
) -> BTreeMap<String, (u64, u64)> {
    let mut placed = BTreeMap::new();
    for chunk in (0..n).collect::<Vec<_>>().chunks(10) {
        let batch: Vec<Value> = chunk
            .iter()
            .map(|i| event(&format!("{prefix}{i}")))
            .collect();
        let r = client(a).publish_answer(topic, &batch).await;
        let r = answered(r, 201, "publish").unwrap();
        for e in r.json::<Value>().unwrap()["events"].as_array().unwrap() {
            placed.insert(
                e["id"].as_str().unwrap().to_string(),
                (
                    e["partition"].as_u64().unwrap(),
                    e["offset"].as_u64().unwrap(),
                ),
            );
        }
    }
    placed
}

/// Every event of every partition, by id, through browse.
async fn browse_all(a: &str, topic: &str, partitions: u64) -> BTreeMap<String, (u64, u64)> {
    let mut found = BTreeMap::new();
    for p in 0..partitions {
        let mut from = 0u64;
        loop {
            let page = client(a).browse(topic, p as u32, from, 1000).await.unwrap();
            let events = page["events"]
                .as_array()
                .unwrap_or_else(|| panic!("browse of {topic}/{p} from {from} answered {page}"));
            if events.is_empty() {
                break;
            }
            for e in events {
                let o = e["offset"].as_u64().unwrap();
                found.insert(e["event"]["id"].as_str().unwrap().to_string(), (p, o));
                from = o + 1;
            }
        }
    }
    found
}

/// Exactly `n` deliveries (pulls never ask for more than are still missing).
async fn pull_exactly(a: &str, sub: &str, n: usize) -> Vec<Delivery> {
    let mut got = Vec::new();
    for _ in 0..200 {
        if got.len() == n {
            return got;
        }
        let more = pull(
            a,
            sub,
            &json!({"max_events": n - got.len(), "wait_ms": 1000}),
        )
        .await
        .unwrap();
        got.extend(more);
    }
    panic!("{} of {n} deliveries", got.len());
}

async fn committed(a: &str, sub: &str) -> BTreeMap<u64, u64> {
    client(a)
        .offsets(sub)
        .await
        .unwrap()
        .iter()
        .map(|o| (u64::from(o.partition), o.committed))
        .collect()
}

async fn revision_of_put(a: &str, name: &str, topic: &str) -> i64 {
    let r = client(a)
        .put_subscription_answer(name, &json!({"topic": topic}))
        .await;
    let (status, body) = status_and_body(r).unwrap();
    assert!(status == 201 || status == 200, "{body}");
    body["revision"].as_i64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_power_cut_then_every_201_and_every_ack_older_than_the_flush_interval_survive_and_nothing_goes_back(
) {
    let mut fs = LazyFs::mount().unwrap();
    let dir = data_dir(&fs);
    let mut m = start_on(&dir, &[]).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 3).await;
    create_subscription(
        &a,
        "s",
        json!({"topic": "t", "start": "earliest", "ack_timeout_ms": 5000, "max_attempts": 10}),
    )
    .await;
    let placed = publish_batches(&a, "t", "e", 120).await;

    // Acked well before the cut (older than the flush interval): must survive.
    let first = pull_exactly(&a, "s", 60).await;
    let r = ack(&a, "s", &ids(&first)).await.unwrap();
    assert_eq!(r["acked"].as_array().unwrap().len(), first.len(), "{r}");
    tokio::time::sleep(Duration::from_millis(FLUSH_MS * 4)).await;
    // Handed out and held, by concurrent pulls (so attempt writes overlap, the
    // partition task's pipelined path): after the cut they come back with a higher
    // attempt, as every hand-out's attempt was durable before its answer.
    let (h1, h2, h3) = tokio::join!(
        pull_exactly(&a, "s", 10),
        pull_exactly(&a, "s", 10),
        pull_exactly(&a, "s", 10)
    );
    let held: Vec<Delivery> = h1.into_iter().chain(h2).chain(h3).collect();
    let before_commit = committed(&a, "s").await;
    let revision_before = revision_of_put(&a, "probe-1", "t").await;
    // Acked just before the cut: inside the flush window, may come back.
    let rest = pull_exactly(&a, "s", 20).await;
    ack(&a, "s", &ids(&rest)).await.unwrap();

    m.kill();
    let report = fs.power_cut(Torn::Lost).unwrap();
    assert!(
        report.unsynced_bytes > 0,
        "the cut dropped nothing, so it proved nothing: {report:?}"
    );
    m.start_again().await.unwrap();
    let a = m.addr().to_string();

    // Every 201 is there, where its answer said.
    let found = browse_all(&a, "t", 3).await;
    for (id, at) in &placed {
        assert_eq!(found.get(id), Some(at), "event {id} answered 201 at {at:?}");
    }
    // Committed offsets never go back.
    let after_commit = committed(&a, "s").await;
    for (p, c) in &before_commit {
        assert!(
            after_commit[p] >= *c,
            "partition {p}: {c} -> {}",
            after_commit[p]
        );
    }
    // The embedded Meta never reuses a revision it answered.
    let revision_after = revision_of_put(&a, "probe-2", "t").await;
    assert!(
        revision_after > revision_before,
        "{revision_before} then {revision_after}"
    );

    // The dedup index is durable with its events: every 201'd event sent again is a
    // duplicate of itself, at the offset its first answer named (nothing stored twice).
    for chunk in placed.keys().cloned().collect::<Vec<_>>().chunks(10) {
        let batch: Vec<Value> = chunk.iter().map(|id| event(id)).collect();
        let r = client(&a).publish_answer("t", &batch).await;
        let r = answered(r, 201, "publish").unwrap();
        for e in r.json::<Value>().unwrap()["events"].as_array().unwrap() {
            let id = e["id"].as_str().unwrap();
            let at = (
                e["partition"].as_u64().unwrap(),
                e["offset"].as_u64().unwrap(),
            );
            assert_eq!(
                e["duplicate"], true,
                "{id} was stored again after the cut: {e}"
            );
            assert_eq!(Some(&at), placed.get(id), "{id}");
        }
    }
    assert_eq!(
        browse_all(&a, "t", 3).await.len(),
        found.len(),
        "nothing stored twice"
    );

    // Drain: acks older than the flush interval never come back; held deliveries come
    // back with a higher attempt; everything not acked durably is delivered.
    let acked_early: BTreeSet<(u64, u64)> = first.iter().map(|d| (d.partition, d.offset)).collect();
    let held_attempt: BTreeMap<(u64, u64), u64> = held
        .iter()
        .map(|d| ((d.partition, d.offset), d.attempt))
        .collect();
    let expected = placed.len() - acked_early.len() - rest.len();
    let again = pull_until(&a, "s", expected, Duration::from_secs(90)).await;
    for d in &again {
        let at = (d.partition, d.offset);
        assert!(
            !acked_early.contains(&at),
            "an ack older than the flush interval was lost: {at:?}"
        );
        if let Some(before) = held_attempt.get(&at) {
            assert!(
                d.attempt > *before,
                "attempt went back at {at:?}: {before} then {}",
                d.attempt
            );
        }
    }
    m.kill();
}

/// The positive control of the test above: the same publishes and cut on a debug
/// build whose engine skips its syncs (`meshd_local::no_sync_for_tests`): the cut must
/// lose 201'd events, and the check of the test above must see it. Without this, a green power-cut
/// test could not tell a missing fsync from a present one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positive_control_a_build_without_syncs_loses_201d_events_at_a_power_cut_and_the_check_sees_it(
) {
    let mut fs = LazyFs::mount().unwrap();
    let dir = data_dir(&fs);
    let flush = FLUSH_MS.to_string();
    let env = [(meshd_local::NO_SYNC_VAR.to_string(), "1".to_string())];
    let mut m = MeshdProcess::start_with_env(bin(), &dir, &["--delivery-flush-ms", &flush], &env)
        .await
        .unwrap();
    assert!(
        m.log_tail(200).contains("SYNCS ARE OFF"),
        "the switch is on: {}",
        m.log_tail(40)
    );
    let a = m.addr().to_string();
    create_topic(&a, "t", 3).await;
    let placed = publish_batches(&a, "t", "e", 120).await;

    // (No restart in between: a restart's recovery flushes what the WAL holds to
    // synced table files, which would make these durable after all.)
    m.kill();
    let report = fs.power_cut(Torn::Lost).unwrap();
    assert!(report.unsynced_bytes > 0, "{report:?}");
    m.start_again().await.unwrap();
    let a = m.addr().to_string();
    // The topic itself (embedded Meta, same engine) may be gone too.
    let (status, topic) = status_and_body(client(&a).topic_answer("t").await).unwrap();
    let found = if status == 200 {
        browse_all(&a, "t", 3).await
    } else {
        assert_eq!(status, 404, "{topic}");
        BTreeMap::new()
    };
    let lost: Vec<&String> = placed
        .iter()
        .filter(|(id, at)| found.get(*id) != Some(at))
        .map(|(id, _)| id)
        .collect();
    eprintln!(
        "without syncs: {} of {} events answered 201 lost at the cut ({} unsynced bytes dropped; topic {})",
        lost.len(),
        placed.len(),
        report.unsynced_bytes,
        status
    );
    assert!(
        !lost.is_empty(),
        "a build without syncs lost nothing at a power cut: the check cannot see a missing fsync"
    );
    m.kill();
}

/// What a cut right after acks above a gap left: meshd started on it (strict, or
/// `point-in-time` once the strict start refused, which must then have named
/// `Corruption` and the data dir), with the 201s it answered before.
struct AfterCut {
    m: MeshdProcess,
    placed: BTreeMap<String, (u64, u64)>,
    refused: bool,
    report: meshd_test_support::lazyfs::CutReport,
    /// Mounted while `m` runs on it.
    _fs: LazyFs,
}

/// Publishes 50 events to a one-partition topic, pulls them all and acks all but
/// offset 0 in requests of `acks_per_request`: acks above a gap are records written to
/// the write-ahead log at once and fsynced within the flush interval, so killed right
/// after them the log has an unsynced tail. Then SIGKILL, the cut `torn`, and a start.
async fn cut_after_acks_above_a_gap(torn: Torn, acks_per_request: usize) -> AfterCut {
    let mut fs = LazyFs::mount().unwrap();
    let dir = data_dir(&fs);
    let mut m = start_on(&dir, &[]).await;
    let a = m.addr().to_string();
    create_topic(&a, "t", 1).await;
    create_subscription(&a, "s", json!({"topic": "t", "start": "earliest"})).await;
    let placed = publish_batches(&a, "t", "e", 50).await;
    let ds = pull_exactly(&a, "s", 50).await;
    for chunk in ds[1..].chunks(acks_per_request) {
        ack(&a, "s", &ids(chunk)).await.unwrap();
    }
    m.kill();
    let report = fs.power_cut(torn).unwrap();
    let flush = FLUSH_MS.to_string();
    let strict = MeshdProcess::start(bin(), &dir, &["--delivery-flush-ms", &flush]).await;
    let (m, refused) = match strict {
        // Nothing acknowledged was damaged in a way it refuses: it opens as it is.
        Ok(m) => (m, false),
        Err(e) => {
            let e = format!("{e:#}");
            assert!(
                e.contains("Corruption") && e.contains(&dir.display().to_string()),
                "{torn:?}: a strict start that fails names the damage and the data dir: {e}"
            );
            (
                start_on(&dir, &["--wal-recovery", "point-in-time"]).await,
                true,
            )
        }
    };
    AfterCut {
        m,
        placed,
        refused,
        report,
        _fs: fs,
    }
}

/// Every 201 of `cut` is where its answer said.
async fn every_201_kept(cut: &AfterCut, what: &str) {
    let found = browse_all(cut.m.addr(), "t", 1).await;
    for (id, at) in &cut.placed {
        assert_eq!(found.get(id), Some(at), "{what}: event {id} answered 201");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_torn_power_cuts_then_a_strict_start_opens_or_names_the_damage_and_point_in_time_keeps_every_201(
) {
    let mut refused = 0;
    let mut torn = 0;
    for seed in 0..4u64 {
        let cut = cut_after_acks_above_a_gap(Torn::Prefix(seed), 49).await;
        torn += cut.report.torn_bytes_kept;
        refused += cut.refused as usize;
        every_201_kept(&cut, &format!("seed {seed}")).await;
    }
    eprintln!("torn cuts: {refused} of 4 strict starts refused, {torn} torn bytes kept");
    assert!(torn > 0, "no cut tore anything: the test proved nothing");
}

/// The refusal path, run: the disk wrote its cache out of order and lost power in an
/// earlier write's last sectors, so the write-ahead log holds a damaged record (among
/// the unsynced acks above a gap) with intact ones after it. No tail-tolerant recovery
/// may take that for a torn tail: `--wal-recovery strict` (the default) must refuse to
/// start, naming `Corruption` and the data dir; `point-in-time` then opens, dropping
/// the log from the damaged record on, and keeps every 201 (synced before any of it),
/// with the committed offset where the last synced state had it (the gap at offset 0
/// never moved, so 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_a_garbled_write_before_intact_ones_then_a_strict_start_refuses_naming_corruption_and_point_in_time_keeps_every_201(
) {
    let mut refused = 0;
    for seed in 0..4u64 {
        // Acks in requests of 7: each its own unsynced record until the flush.
        let cut = cut_after_acks_above_a_gap(Torn::Garbled(seed), 7).await;
        if !cut.refused {
            eprintln!("seed {seed}: the strict start opened ({:?})", cut.report);
        }
        refused += cut.refused as usize;
        every_201_kept(&cut, &format!("seed {seed}")).await;
        assert_eq!(
            committed(cut.m.addr(), "s").await.get(&0),
            Some(&0),
            "seed {seed}: the gap at offset 0 holds the committed offset"
        );
    }
    eprintln!("garbled cuts: {refused} of 4 strict starts refused");
    assert!(
        refused > 0,
        "no garbled cut made the strict start refuse: the refusal path did not run"
    );
}

/// JetStream on the same filesystem: `n` publishes acknowledged by nats-server, a
/// SIGKILL and a power cut, a restart; returns how many of the acknowledged messages
/// are still in the stream.
async fn jetstream_after_cut(
    default_sync: bool,
    entries: Entries,
    n: usize,
) -> (usize, meshd_test_support::lazyfs::CutReport) {
    use meshd_log_nats::{NatsConfig, NatsLog};
    use meshd_stores::log::PartitionLog;
    use meshd_test_support::nats::{NatsOptions, NatsProcess};
    let mut fs = LazyFs::mount_with(entries).unwrap();
    let store = fs.path().join("jetstream");
    std::fs::create_dir(&store).unwrap();
    std::fs::File::open(fs.path()).unwrap().sync_all().unwrap();
    let mut nats = NatsProcess::start_with(NatsOptions {
        store_dir: Some(store),
        default_sync,
        ..NatsOptions::default()
    })
    .await
    .unwrap();
    let connect = |url: String| async move {
        NatsLog::connect(NatsConfig::parse(&url).unwrap())
            .await
            .unwrap()
    };
    let log = connect(nats.url()).await;
    for i in 0..n {
        log.append("t", vec![(0, format!("message {i}").into_bytes())])
            .await
            .unwrap();
    }
    drop(log);
    nats.kill();
    let report = fs.power_cut(Torn::Lost).unwrap();
    nats.restart().await.unwrap();
    let log = connect(nats.url()).await;
    let kept = match log.bounds("t", 0).await {
        Ok(b) => (b.end - b.start) as usize,
        // The stream itself is gone.
        Err(_) => 0,
    };
    drop(log);
    nats.kill();
    (kept, report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn given_jetstream_on_the_lazy_filesystem_then_a_power_cut_keeps_what_sync_always_acknowledged_and_shows_what_the_default_loses(
) {
    const N: usize = 200;
    let mut kept = Vec::new();
    for (entries, rule) in [
        (
            Entries::WithFileFsync,
            "entries durable with a file fsync (ext4, xfs)",
        ),
        (
            Entries::DirectoryFsync,
            "entries durable only with a directory fsync (POSIX)",
        ),
    ] {
        let (always, always_cut) = jetstream_after_cut(false, entries, N).await;
        let (default, default_cut) = jetstream_after_cut(true, entries, N).await;
        eprintln!(
            "JetStream power cut, {N} acknowledged publishes, {rule}: sync_interval always kept {always} ({always_cut:?}); default kept {default} ({default_cut:?})"
        );
        // The default syncs every 2 minutes: the cut found its acknowledged messages
        // unsynced (the harness did its job), and it keeps fewer than it acknowledged.
        assert!(default_cut.unsynced_bytes > 0, "{default_cut:?}");
        assert!(default < N, "{rule}: {default}");
        kept.push(always);
    }
    // Every acknowledged publish of `sync_interval: always` survives where a file's
    // fsync persists its name (what meshd's cluster mode relies on for its 201s on
    // ext4 and xfs). Under POSIX's rule alone it is recorded, not asserted
    // (docs/power-cuts.md): nats-server does not fsync the directories it creates.
    assert_eq!(kept[0], N);
}
