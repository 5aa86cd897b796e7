//! Push delivery: one worker per push subscription pulls from the subscription's
//! partitions through the same runtime as HTTP pulls (so the write-ahead attempt rule,
//! leases, retries, backoff and dead-lettering are the same) and POSTs each event to
//! `push.url` in CloudEvents binary mode with `meshd-delivery-attempt`. A 2xx answer
//! within `ack_timeout_ms` acks the delivery; anything else (another status, a timeout,
//! a refused connection) nacks it with that reason. At most [`CONCURRENCY`] requests
//! per subscription are in flight.

use super::{Handed, Runtime, RuntimeError};
use crate::metrics::SubCounters;
use meshd_events::{to_binary_mode, Event};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::Semaphore;

/// Push requests in flight per subscription.
pub const CONCURRENCY: usize = 16;
/// How long one pull of the worker waits for events.
const PULL_WAIT: Duration = Duration::from_secs(1);
/// Pause after a pull that failed (store failure, restart in progress).
const PULL_RETRY: Duration = Duration::from_millis(500);
pub use meshd_client::Target;

/// The transport of push: TLS for `https://` targets (`tls`: `None` when no CA could
/// be loaded) and `egress` checked at every connect, after name resolution, so a name
/// cannot lead a push somewhere the rules refuse.
pub fn transport(
    tls: Option<tokio_rustls::TlsConnector>,
    egress: Arc<crate::egress::Egress>,
) -> meshd_client::Transport {
    let check: meshd_client::transport::AddressCheck = Arc::new(move |addr| {
        egress
            .check(addr)
            .map_err(|why| format!("refused by the push address rules: {why}"))
    });
    let t = meshd_client::Transport::new().with_address_check(check);
    match tls {
        Some(tls) => t.with_tls(tls),
        None => t,
    }
}

/// Runs until the subscription's incarnation stops (its worker is aborted then) or
/// the runtime is gone.
pub async fn worker(
    runtime: Weak<Runtime>,
    name: String,
    target: Target,
    transport: meshd_client::Transport,
    ack_timeout: Duration,
    counters: Arc<SubCounters>,
    background: crate::background::Background,
) {
    let slots = Arc::new(Semaphore::new(CONCURRENCY));
    loop {
        // Wait for a free slot, then pull as many events as there are free slots.
        let Ok(first) = slots.clone().acquire_owned().await else {
            return;
        };
        let free = slots.available_permits() + 1;
        let Some(rt) = runtime.upgrade() else {
            return;
        };
        // One event per free slot: memory is bounded by the slots (each event at
        // most the largest event size).
        let budget = super::PullBudget::new(free, usize::MAX);
        let handed = rt.pull_running(&name, budget, PULL_WAIT, None).await;
        drop(rt);
        let handed = match handed {
            Ok(h) => h,
            Err(RuntimeError::NotFound(_)) => return,
            Err(RuntimeError::Restarting(_)) => {
                // Stopped for a settings change: this worker is aborted and a new
                // one started with the new settings.
                drop(first);
                tokio::time::sleep(PULL_RETRY).await;
                continue;
            }
            Err(e) => {
                tracing::warn!(subscription = %name, error = %e, "push worker: pull failed; retrying");
                drop(first);
                tokio::time::sleep(PULL_RETRY).await;
                continue;
            }
        };
        let mut permit = Some(first);
        for d in handed {
            let p = match permit.take() {
                Some(p) => p,
                None => match slots.clone().acquire_owned().await {
                    Ok(p) => p,
                    Err(_) => return,
                },
            };
            let runtime = runtime.clone();
            let name = name.clone();
            let target = target.clone();
            let transport = transport.clone();
            let counters = counters.clone();
            background.spawn(async move {
                let outcome = post(&transport, &target, &d, ack_timeout).await;
                let Some(rt) = runtime.upgrade() else {
                    return;
                };
                let id = vec![d.delivery_id.clone()];
                let answered = match outcome {
                    Ok(()) => {
                        SubCounters::add(&counters.push_ok, 1);
                        rt.ack_running(&name, id).await
                    }
                    Err(reason) => {
                        SubCounters::add(&counters.push_failed, 1);
                        tracing::info!(subscription = %name, delivery = %d.delivery_id, attempt = d.attempt, reason = %reason, "push delivery failed");
                        rt.nack_running(&name, id, reason).await
                    }
                };
                if let Err(e) = answered {
                    // The lease runs out and the event is retried.
                    tracing::warn!(subscription = %name, delivery = %d.delivery_id, error = %e, "recording a push outcome failed");
                }
                drop(p);
            });
        }
    }
}

/// One POST in binary mode; `Ok` for a 2xx within `timeout`, else the reason.
pub async fn post(
    transport: &meshd_client::Transport,
    target: &Target,
    d: &Handed,
    timeout: Duration,
) -> Result<(), String> {
    if target.https && !transport.has_tls() {
        return Err(
            "https push without a CA: start meshd with --push-ca-file (no system CA bundle)"
                .to_string(),
        );
    }
    let event = Event::from_stored(&d.body).map_err(|e| format!("stored event: {e}"))?;
    let (headers, body) = to_binary_mode(&event);
    let mut req = meshd_client::Request::post(target.request_path())
        .raw_body(body)
        .timeout(timeout)
        .header("meshd-delivery-attempt", d.attempt.to_string())
        .header("meshd-delivery-id", d.delivery_id.clone());
    for (k, v) in headers {
        req = req.header(&k, v);
    }
    match transport.send_for_status(target, req).await {
        Ok(a) if a.is_success() => Ok(()),
        Ok(a) => Err(format!("http status {}", a.status)),
        Err(e) => Err(e.to_string()),
    }
}
