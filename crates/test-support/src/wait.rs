//! Deadline-bounded polling for tests: never sleep a fixed time and hope, poll a
//! condition until it holds or a deadline passes, and on timeout say what was awaited
//! and the last error seen.

use anyhow::anyhow;
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

/// Polls `f` until it returns `Ok`, for at most `deadline` in total.
///
/// Each attempt is itself bounded by the time left, so an attempt that hangs cannot
/// stretch the deadline. Between attempts it waits 10 ms, doubling up to 200 ms. On
/// timeout the error names `what`, the deadline, the number of attempts and the last
/// error `f` returned (or that the last attempt did not finish in time).
pub async fn wait_until<F, Fut, T>(deadline: Duration, what: &str, mut f: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let start = Instant::now();
    let end = start + deadline;
    let mut pause = Duration::from_millis(10);
    let mut attempts = 0u32;
    let mut previous: Option<String> = None;
    loop {
        attempts += 1;
        let left = end.saturating_duration_since(Instant::now());
        let last = match tokio::time::timeout(left, f()).await {
            Ok(Ok(value)) => return Ok(value),
            Ok(Err(e)) => format!("{e:#}"),
            Err(_) => match &previous {
                // The one before says what was wrong; the cut-off one cannot.
                Some(p) => format!("{p} (and the last attempt did not finish before the deadline)"),
                None => "the last attempt did not finish before the deadline".to_string(),
            },
        };
        previous = Some(last.clone());
        let now = Instant::now();
        if now >= end {
            return Err(anyhow!(
                "timed out after {:?} ({} attempts) waiting for {}; last error: {}",
                now - start,
                attempts,
                what,
                last
            ));
        }
        tokio::time::sleep(pause.min(end - now)).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_the_first_success() {
        let mut n = 0;
        let v = wait_until(Duration::from_secs(5), "the third attempt", || {
            n += 1;
            let n = n;
            async move {
                if n < 3 {
                    Err(anyhow!("attempt {n} not yet"))
                } else {
                    Ok(n)
                }
            }
        })
        .await
        .expect("succeeds on the third attempt");
        assert_eq!(v, 3);
    }

    #[tokio::test]
    async fn times_out_with_the_last_error() {
        let t0 = Instant::now();
        let err = wait_until(Duration::from_millis(100), "nothing", || async {
            Err::<(), _>(anyhow!("still broken"))
        })
        .await
        .expect_err("never succeeds");
        assert!(t0.elapsed() < Duration::from_secs(2));
        let msg = format!("{err}");
        assert!(msg.contains("waiting for nothing"), "{msg}");
        assert!(msg.contains("still broken"), "{msg}");
    }

    #[tokio::test]
    async fn a_hanging_attempt_does_not_stretch_the_deadline() {
        let t0 = Instant::now();
        let err = wait_until(Duration::from_millis(100), "a hang", || async {
            std::future::pending::<anyhow::Result<()>>().await
        })
        .await
        .expect_err("never finishes");
        assert!(t0.elapsed() < Duration::from_secs(2));
        assert!(format!("{err}").contains("did not finish"), "{err}");
    }
}
