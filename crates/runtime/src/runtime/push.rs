//! Push delivery: one worker per push subscription pulls from the subscription's
//! partitions through the same runtime as HTTP pulls (so the write-ahead attempt rule,
//! leases, retries, backoff and dead-lettering are the same) and POSTs each event to
//! `push.url` in CloudEvents binary mode with `meshd-delivery-attempt`. A 2xx answer
//! within `ack_timeout_ms` acks the delivery; anything else (another status, a timeout,
//! a refused connection) nacks it with that reason. At most `push.max_concurrency`
//! requests per subscription (and instance) are in flight, started at most
//! `push.rate_per_s` per second (in cluster mode each instance takes its share of the
//! rate by the share of partitions it owns). A subscription with `push.secrets` is
//! delivered in structured mode with the Standard Webhooks headers ([`sign`]).

use super::error::RuntimeError;
use super::state::Runtime;
use super::types::{Handed, PullBudget};
use crate::metrics::SubCounters;
use meshd_events::{to_binary_mode, Event};
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::sync::Semaphore;

/// How long one pull of the worker waits for events.
const PULL_WAIT: Duration = Duration::from_secs(1);
/// Under a rate, one pull takes what starts within this long.
const RATE_BATCH: Duration = Duration::from_millis(100);
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

/// What one push subscription's worker delivers with.
#[derive(Clone)]
pub struct PushSettings {
    pub target: Target,
    /// `{subscription}:{incarnation}`: with the partition and offset it makes the
    /// `webhook-id`, the same for every attempt of one event and never reused by a
    /// re-created subscription of the same name.
    pub id_prefix: String,
    /// HMAC keys, decoded from the `whsec_` secrets; empty: unsigned, binary mode.
    pub keys: Vec<Vec<u8>>,
    /// Static headers (validated: none reserved).
    pub headers: Vec<(String, String)>,
    pub max_concurrency: usize,
    /// Requests started per second across the cluster; `None`: unlimited.
    pub rate_per_s: Option<f64>,
    pub ack_timeout: Duration,
}

impl PushSettings {
    /// The settings of a subscription's `push` (secrets that do not decode were
    /// refused when it was written; one that still does not is left out, logged).
    pub fn of(sub: &meshd_stores::subscriptions::Subscription, target: Target) -> Option<Self> {
        let p = sub.spec.push.as_ref()?;
        let keys = p
            .secrets()
            .iter()
            .filter_map(|s| match meshd_stores::subscriptions::push::secret_key(s) {
                Ok(k) => Some(k),
                Err(e) => {
                    tracing::error!(store = "subscriptions", subscription = %sub.name(), error = %e, "a stored push secret does not decode; it is not used");
                    None
                }
            })
            .collect();
        Some(Self {
            target,
            id_prefix: format!("{}:{}", sub.name(), sub.incarnation),
            keys,
            headers: p.headers().to_vec(),
            max_concurrency: p.max_concurrency.max(1) as usize,
            rate_per_s: p.rate_per_s.map(|r| r.0),
            ack_timeout: Duration::from_millis(sub.spec.ack_timeout_ms),
        })
    }
}

/// Paces request starts to a rate: each start is `1 / rate` after the previous one
/// (no burst), so a receiver with a rate limit never sees more.
struct Pacer {
    next: tokio::time::Instant,
}

impl Pacer {
    /// Waits for the next start at `rate` per second (`None`: at once).
    async fn wait(&mut self, rate: Option<f64>) {
        let Some(rate) = rate.filter(|r| *r > 0.0) else {
            return;
        };
        let now = tokio::time::Instant::now();
        let at = self.next.max(now);
        tokio::time::sleep_until(at).await;
        self.next = at + Duration::from_secs_f64(1.0 / rate);
    }
}

/// Runs until the subscription's incarnation stops (its worker is aborted then) or
/// the runtime is gone.
pub async fn worker(
    runtime: Weak<Runtime>,
    name: String,
    settings: PushSettings,
    transport: meshd_client::Transport,
    counters: Arc<SubCounters>,
    background: crate::background::Background,
) {
    let slots = Arc::new(Semaphore::new(settings.max_concurrency));
    let settings = Arc::new(settings);
    let mut pacer = Pacer {
        next: tokio::time::Instant::now(),
    };
    loop {
        // Wait for a free slot, then pull as many events as there are free slots.
        let Ok(first) = slots.clone().acquire_owned().await else {
            return;
        };
        let free = slots.available_permits() + 1;
        let Some(rt) = runtime.upgrade() else {
            return;
        };
        // In cluster mode each instance pushes the partitions it owns: its share of
        // the rate follows its share of the partitions.
        let rate = settings
            .rate_per_s
            .map(|r| r * rt.local_share(&name).unwrap_or(1.0));
        // One event per free slot: memory is bounded by the slots (each event at
        // most the largest event size). Under a rate, at most what starts within
        // [`RATE_BATCH`], so no lease runs down while its request waits its turn.
        let n = match rate {
            Some(r) => free.min(((r * RATE_BATCH.as_secs_f64()) as usize).max(1)),
            None => free,
        };
        let budget = PullBudget::new(n, usize::MAX);
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
            // The lease runs from the hand-out: a paced request may start late, and
            // a lease that runs out while it waits is retried like any other.
            pacer.wait(rate).await;
            let runtime = runtime.clone();
            let name = name.clone();
            let settings = settings.clone();
            let transport = transport.clone();
            let counters = counters.clone();
            background.spawn(async move {
                let outcome = post(&transport, &settings, &d).await;
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

/// The Standard Webhooks `webhook-signature` value: `v1,<base64 HMAC-SHA256 of
/// "id.timestamp.body">` per key, space-separated.
pub fn sign(keys: &[Vec<u8>], id: &str, timestamp: i64, body: &[u8]) -> String {
    use base64::Engine;
    use hmac::Mac;
    keys.iter()
        .map(|key| {
            // HMAC takes a key of any length; `new_from_slice` cannot fail for it.
            let mut mac = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(key)
                .unwrap_or_else(|_| unreachable!("HMAC accepts every key length"));
            mac.update(id.as_bytes());
            mac.update(b".");
            mac.update(timestamp.to_string().as_bytes());
            mac.update(b".");
            mac.update(body);
            let tag = mac.finalize().into_bytes();
            format!(
                "v1,{}",
                base64::engine::general_purpose::STANDARD.encode(tag)
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One POST: binary mode, or, signed, structured mode with the Standard Webhooks
/// headers; `Ok` for a 2xx within the ack timeout, else the reason.
pub async fn post(
    transport: &meshd_client::Transport,
    settings: &PushSettings,
    d: &Handed,
) -> Result<(), String> {
    let target = &settings.target;
    if target.https && !transport.has_tls() {
        return Err(
            "https push without a CA: start meshd with --push-ca-file (no system CA bundle)"
                .to_string(),
        );
    }
    let mut req = meshd_client::Request::post(target.request_path())
        .timeout(settings.ack_timeout)
        .header("meshd-delivery-attempt", d.attempt.to_string())
        .header("meshd-delivery-id", d.delivery_id.clone());
    for (k, v) in &settings.headers {
        req = req.header(k, v.clone());
    }
    if settings.keys.is_empty() {
        let event = Event::from_stored(&d.body).map_err(|e| format!("stored event: {e}"))?;
        let (headers, body) = to_binary_mode(&event);
        req = req.raw_body(body);
        for (k, v) in headers {
            req = req.header(&k, v);
        }
    } else {
        // Structured mode: the stored event is the body, so the signature covers
        // every attribute, extensions included.
        let id = format!("{}:{}:{}", settings.id_prefix, d.partition, d.offset);
        let timestamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|t| t.as_secs() as i64)
            .unwrap_or(0);
        let signature = sign(&settings.keys, &id, timestamp, &d.body);
        req = req
            .header(
                "content-type",
                meshd_events::STRUCTURED_CONTENT_TYPE.to_string(),
            )
            .header("webhook-id", id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .raw_body(d.body.clone());
    }
    match transport.send_for_status(target, req).await {
        Ok(a) if a.is_success() => Ok(()),
        Ok(a) => Err(format!("http status {}", a.status)),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;

    /// The Standard Webhooks specification's published vector (its reference
    /// libraries' `test_sign`).
    #[test]
    fn signatures_match_the_standard_webhooks_test_vector() {
        let secret = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
        let key = base64::engine::general_purpose::STANDARD
            .decode(secret.strip_prefix("whsec_").unwrap())
            .unwrap();
        let body = br#"{"email":"test@example.com","username":"test_user"}"#;
        assert_eq!(
            sign(
                std::slice::from_ref(&key),
                "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
                1649367553,
                body
            ),
            "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw="
        );
        // Two secrets (rotation): one signature each, space-separated, in order.
        let other = vec![7u8; 32];
        let both = sign(
            &[other.clone(), key.clone()],
            "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
            1649367553,
            body,
        );
        let parts: Vec<&str> = both.split(' ').collect();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1], "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=");
        assert_eq!(
            parts[0],
            sign(
                &[other],
                "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
                1649367553,
                body
            )
        );
        // Any change to id, timestamp or body changes it.
        for (id, ts, b) in [
            ("msg_27UH4WbU6Z5A5EzD8u03UvzRbpK", 1649367553, &body[..]),
            ("msg_27UH4WbU6Z5A5EzD8u03UvzRbpk", 1649367554, &body[..]),
            ("msg_27UH4WbU6Z5A5EzD8u03UvzRbpk", 1649367553, &body[1..]),
        ] {
            assert_ne!(
                sign(std::slice::from_ref(&key), id, ts, b),
                "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw="
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_pacer_spaces_starts_by_the_rate() {
        let mut p = Pacer {
            next: tokio::time::Instant::now(),
        };
        let t0 = tokio::time::Instant::now();
        for _ in 0..5 {
            p.wait(Some(4.0)).await;
        }
        // Starts at 0, 250, 500, 750, 1000 ms.
        assert_eq!(t0.elapsed(), Duration::from_millis(1000));
        let t1 = tokio::time::Instant::now();
        p.wait(None).await;
        assert_eq!(t1.elapsed(), Duration::ZERO, "no rate: at once");
    }
}
