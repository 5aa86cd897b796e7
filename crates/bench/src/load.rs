//! The closed-loop load driver and what one measured run records.
//!
//! `concurrency` workers each issue one request at a time, back to back, for a warm-up
//! and then a measured window; none is issued after the window. Requests whose answer
//! arrives inside the window count: their latency (request sent → answer read) goes
//! into the percentiles and their events into the throughput, which is divided by the
//! window's length. (Counting by completion rather than by start keeps requests that
//! take longer than the warm-up from vanishing.) CPU time is read at the window's two
//! ends. When nothing completed inside the window, it stretches to the first
//! completion (see `Stretch`). A run in which nothing completed even then, or a failed
//! request, fails the run: a benchmark that skips errors measures something else.

use anyhow::{Context, Result};
use futures::future::BoxFuture;
use std::time::{Duration, Instant};

/// One request (of `events_per_op` events) against the system under test.
pub trait Op: Send + 'static {
    fn call(&mut self) -> BoxFuture<'_, Result<()>>;

    /// How many events the last call completed, for an op whose count varies (end to
    /// end: the events a pull handed out and the ack confirmed); `None` is the fixed
    /// `events_per_op` of the run.
    fn completed(&self) -> Option<u64> {
        None
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Window {
    pub warmup: Duration,
    pub measure: Duration,
}

/// What one worker (or all of them, merged) saw inside the window.
#[derive(Default)]
pub struct Sample {
    pub latencies_ns: Vec<u64>,
    pub events: u64,
}

impl Sample {
    fn merge(&mut self, other: Sample) {
        self.latencies_ns.extend(other.latencies_ns);
        self.events += other.events;
    }
}

/// The outcome of one measured run, before the server's costs are added.
pub struct Measured {
    pub events: u64,
    pub requests: u64,
    pub seconds: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// CPU seconds of the measured process over the window, when there is one.
    pub cpu_s: Option<f64>,
    /// CPU seconds of this process (the load driver and any client library it
    /// drives, such as an etcd client) over the same window: for the async driver.
    pub client_cpu_s: Option<f64>,
}

/// Runs async workers on the current tokio runtime; `pid` is the server whose CPU
/// time is read at the window's start and after the last answer.
pub async fn drive_async(
    ops: Vec<Box<dyn Op>>,
    events_per_op: u64,
    window: Window,
    pid: Option<u32>,
) -> Result<Measured> {
    let t0 = Instant::now() + window.warmup;
    let end = t0 + window.measure;
    let stretch = Stretch::new(t0, end);
    let mut tasks = Vec::with_capacity(ops.len());
    for mut op in ops {
        let stretch = stretch.clone();
        tasks.push(tokio::spawn(async move {
            let mut s = Sample::default();
            loop {
                let start = Instant::now();
                if !stretch.may_start(start) {
                    break;
                }
                op.call().await?;
                let done = Instant::now();
                let events = op.completed().unwrap_or(events_per_op);
                if stretch.counts(done, events) {
                    s.latencies_ns.push((done - start).as_nanos() as u64);
                    s.events += events;
                }
            }
            anyhow::Ok(s)
        }));
    }
    tokio::time::sleep_until(t0.into()).await;
    let me = std::process::id();
    let client0 = crate::procs::cpu_seconds(me)?;
    let cpu0 = pid.map(crate::procs::cpu_seconds).transpose()?;
    tokio::time::sleep_until(end.into()).await;
    while !stretch.closed(Instant::now()) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let cpu1 = pid.map(crate::procs::cpu_seconds).transpose()?;
    let client1 = crate::procs::cpu_seconds(me)?;
    let mut all = Sample::default();
    let mut first_err = None;
    for t in tasks {
        match t.await.context("a load worker panicked")? {
            Ok(s) => all.merge(s),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let window = Window {
        measure: stretch.end() - t0,
        ..window
    };
    let mut m = finish(all, window, cpu0.zip(cpu1).map(|(a, b)| b - a))?;
    m.client_cpu_s = Some(client1 - client0);
    Ok(m)
}

/// How long a window stays open past its end when nothing completed in it yet: a
/// slow machine (a loaded CI runner, a debug build) can take longer than a tiny window
/// for its first end-to-end cycle. The run still fails when nothing completes by then.
const MAX_STRETCH: Duration = Duration::from_secs(30);

/// The measured window, stretched past its planned end until the first request that
/// completes events does (at most [`MAX_STRETCH`]): a run with nothing completed would
/// otherwise fail on a slow machine. Without a stretch it is the plain window:
/// requests complete and count inside `[t0, end]`, none starts after `end`. With one,
/// the window ends at the first completion after `end`, and throughput is divided by
/// the stretched length.
#[derive(Clone)]
struct Stretch {
    t0: Instant,
    end: Instant,
    inner: std::sync::Arc<std::sync::Mutex<StretchState>>,
}

#[derive(Default)]
struct StretchState {
    /// Whether a request completed events inside the window.
    any: bool,
    /// The first completion after `end`, when the window had none.
    stretched_to: Option<Instant>,
}

impl Stretch {
    fn new(t0: Instant, end: Instant) -> Self {
        Self {
            t0,
            end,
            inner: Default::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, StretchState> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a worker may start a request at `now`.
    fn may_start(&self, now: Instant) -> bool {
        now < self.end || !self.closed(now)
    }

    /// Whether the window is over at `now` (for a request starting, or the driver).
    fn closed(&self, now: Instant) -> bool {
        if now < self.end {
            return false;
        }
        let s = self.state();
        s.any || s.stretched_to.is_some() || now >= self.end + MAX_STRETCH
    }

    /// Whether a request completing `events` at `done` counts.
    fn counts(&self, done: Instant, events: u64) -> bool {
        if done < self.t0 {
            return false;
        }
        let mut s = self.state();
        if done <= self.end {
            s.any |= events > 0;
            return true;
        }
        if s.any || s.stretched_to.is_some() || events == 0 || done > self.end + MAX_STRETCH {
            return false;
        }
        s.stretched_to = Some(done);
        true
    }

    /// The window's end as measured.
    fn end(&self) -> Instant {
        self.state().stretched_to.unwrap_or(self.end)
    }
}

/// Runs blocking workers, one OS thread each (the raw engine: its writes block).
/// CPU time is this process's own over the window.
pub fn drive_threads<F>(
    concurrency: usize,
    events_per_op: u64,
    window: Window,
    make_op: F,
) -> Result<Measured>
where
    F: Fn(usize) -> Box<dyn FnMut() -> Result<()> + Send>,
{
    let t0 = Instant::now() + window.warmup;
    let end = t0 + window.measure;
    let pid = std::process::id();
    let handles: Vec<_> = (0..concurrency)
        .map(|w| {
            let mut op = make_op(w);
            std::thread::spawn(move || {
                let mut s = Sample::default();
                loop {
                    let start = Instant::now();
                    if start >= end {
                        break;
                    }
                    op()?;
                    let done = Instant::now();
                    if done >= t0 && done <= end {
                        s.latencies_ns.push((done - start).as_nanos() as u64);
                        s.events += events_per_op;
                    }
                }
                anyhow::Ok(s)
            })
        })
        .collect();
    std::thread::sleep(t0.saturating_duration_since(Instant::now()));
    let cpu0 = crate::procs::cpu_seconds(pid)?;
    std::thread::sleep(end.saturating_duration_since(Instant::now()));
    let cpu1 = crate::procs::cpu_seconds(pid)?;
    let mut all = Sample::default();
    let mut first_err = None;
    for h in handles {
        match h.join() {
            Ok(Ok(s)) => all.merge(s),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(_) => anyhow::bail!("an engine worker thread panicked"),
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    finish(all, window, Some(cpu1 - cpu0))
}

fn finish(mut all: Sample, window: Window, cpu_s: Option<f64>) -> Result<Measured> {
    if all.events == 0 {
        anyhow::bail!(
            "no request completed inside the {:?} measured window: give more --seconds",
            window.measure
        );
    }
    all.latencies_ns.sort_unstable();
    let pct = |q: f64| percentile(&all.latencies_ns, q) as f64 / 1000.0;
    Ok(Measured {
        events: all.events,
        requests: all.latencies_ns.len() as u64,
        seconds: window.measure.as_secs_f64(),
        p50_us: pct(0.50),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
        cpu_s,
        client_cpu_s: None,
    })
}

/// The nearest-rank percentile of sorted values (0 when there are none).
pub fn percentile(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The median (the mean of the middle two for an even count).
pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_without_completions_stretches_to_the_first_one_and_no_further() {
        let t0 = Instant::now();
        let end = t0 + Duration::from_millis(500);
        let s = Stretch::new(t0, end);
        // Inside the window: an empty pull counts its latency but opens no stretch.
        assert!(s.counts(t0 + Duration::from_millis(100), 0));
        assert!(!s.closed(end));
        assert!(s.may_start(end + Duration::from_millis(1)));
        let first = end + Duration::from_millis(700);
        assert!(!s.counts(end + Duration::from_millis(300), 0));
        assert!(s.counts(first, 3));
        assert!(!s.counts(first + Duration::from_millis(1), 3));
        assert!(s.closed(first));
        assert!(!s.may_start(first));
        assert_eq!(s.end(), first);

        // A window with a completion ends on time.
        let s = Stretch::new(t0, end);
        assert!(s.counts(t0 + Duration::from_millis(10), 1));
        assert!(s.closed(end));
        assert!(!s.counts(end + Duration::from_millis(1), 1));
        assert_eq!(s.end(), end);

        // Nothing within the stretch either: closed after MAX_STRETCH (the run fails).
        let s = Stretch::new(t0, end);
        assert!(!s.closed(end + MAX_STRETCH - Duration::from_millis(1)));
        assert!(s.closed(end + MAX_STRETCH));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=1000).collect();
        assert_eq!(percentile(&v, 0.5), 500);
        assert_eq!(percentile(&v, 0.99), 990);
        assert_eq!(percentile(&v, 0.999), 999);
        assert_eq!(percentile(&[7], 0.999), 7);
        assert_eq!(percentile(&[], 0.5), 0);
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }
}
