//! # Meta on etcd v3
//!
//! [`EtcdMeta`] implements the [`Meta`] contract on an etcd v3 cluster: the production
//! backend when more than one meshd instance shares state. Revisions, transactions,
//! leases and watches are etcd's own; this crate maps them onto the contract and its
//! typed errors.
//!
//! ## Availability
//!
//! * [`EtcdMeta::connect`] does not contact etcd: meshd starts (and reports not ready)
//!   while etcd is down. Connections are opened on demand and re-opened after
//!   failures, so the same `EtcdMeta` works again when etcd comes back. With
//!   [`EtcdConfig::credentials`] the client authenticates on the first call to each
//!   endpoint (authenticating is a request), not in `connect`.
//!
//! ## TLS and authentication
//!
//! * With [`EtcdConfig::tls`] every endpoint is reached over `https://` with the
//!   given CA (and client certificate); there is no plaintext fallback. `connect`
//!   reads the PEM files and fails with `InvalidRequest` naming a file it cannot use
//!   (or a certificate without its key).
//! * With [`EtcdConfig::credentials`] each endpoint's client gets an etcd auth token
//!   for the user. etcd forgets tokens when it restarts, and "simple" tokens expire
//!   after `--auth-token-ttl` (300 s) without use; a request refused for an invalid
//!   token re-authenticates once and is sent again (etcd refuses it before applying
//!   it, so a write is not doubled). A watch refused that way ("permission denied")
//!   is retried once after re-authenticating.
//! * Refused credentials (wrong password, no user configured while etcd requires
//!   one, a user without permission) are `Unavailable` with "etcd authentication
//!   refused" in the message: nothing was applied, and the node reports not ready
//!   until the configuration or etcd is fixed.
//! * Every call is bounded by [`EtcdConfig::request_timeout`], failover included; no
//!   call hangs on a frozen etcd. HTTP/2 keep-alive pings break open watches on a
//!   dead or frozen member.
//! * With several endpoints, a call goes to the endpoint that worked last. When that
//!   one fails in a way that proves the request was not applied (connection refused,
//!   no leader, ...), or a read fails, the call is repeated on the next endpoint, each
//!   endpoint at most once per call. A write whose outcome is unknown is not repeated;
//!   it and a timeout move the next call to the next endpoint.
//!
//! ## Errors
//!
//! * `Unavailable`: known not applied (no connection could be made, or etcd refused
//!   it before proposing it), or any failed read. A read never reports "absent"
//!   when etcd could not be read.
//! * `Indeterminate`: a write (put, delete, txn, grant, revoke, compact) that may have
//!   been sent but got no definite answer (timeout, broken connection).
//! * `LeaseNotFound`, `InvalidRequest`, `Conflict`, `Fenced`: as the contract says.

mod classify;
mod config;
mod quota;

pub use config::{ConfigError, EtcdConfig, EtcdCredentials, EtcdTls, SCHEME};

use async_trait::async_trait;
use classify::{classify, Kind, COMPACTED};
use etcd_client::{
    Certificate, Client, CompactionOptions, Compare as EtcdCompare, CompareOp, ConnectOptions,
    EventType, GetOptions, Identity, KvClient, PutOptions, ResponseHeader, TlsOptions,
    Txn as EtcdTxn, TxnOp as EtcdTxnOp, TxnOpResponse, WatchOptions,
};
use futures::stream::{self, StreamExt};
use meshd_meta::{
    prefix_end, Compare, GetResponse, KeyValue, Lease, LeaseId, Meta, MetaError, MetaStatus,
    RangeOptions, RangeResponse, Txn, TxnOp, TxnResponse, WatchBatch, WatchError, WatchEvent,
    WatchStream,
};
use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How etcd says a token expired or is unknown (it forgets tokens when it restarts).
const INVALID_AUTH_TOKEN: &str = "etcdserver: invalid auth token";

/// The largest response this client decodes (etcd's own default request limit is
/// 1.5 MiB, but a range over many keys can be far larger than that).
const MAX_DECODING_MESSAGE_SIZE: usize = 64 * 1024 * 1024;

/// The etcd implementation of [`Meta`]. Cheap to clone; clones share connections.
#[derive(Clone)]
pub struct EtcdMeta {
    inner: Arc<Inner>,
}

struct Inner {
    endpoints: Vec<Endpoint>,
    /// The index of the endpoint calls go to first.
    current: AtomicUsize,
    request_timeout: Duration,
    /// The etcd user every endpoint's client authenticates as, if any.
    credentials: Option<EtcdCredentials>,
    /// Per endpoint (same order): how to read etcd's quota from its `/metrics`.
    quota: Vec<Option<quota::QuotaProbe>>,
    /// The quota last read (when, value): read at most once a minute.
    quota_cache: std::sync::Mutex<Option<(Instant, Option<u64>)>>,
}

/// How long a read quota is reused (it changes only when etcd restarts).
const QUOTA_EVERY: Duration = Duration::from_secs(60);

struct Endpoint {
    url: String,
    client: Client,
    /// `client`'s KV client, built once (cloning it per call is cheap; building it
    /// from a whole `Client` clone per call was not).
    kv: KvClient,
    /// Set once `client` holds an auth token (only with credentials). From then on
    /// etcd-client renews the token itself when etcd calls it invalid.
    authenticated: tokio::sync::OnceCell<()>,
}

impl std::fmt::Debug for EtcdMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdMeta")
            .field("endpoints", &self.endpoints())
            .field("current", &self.current_endpoint())
            .field("request_timeout", &self.inner.request_timeout)
            .field("credentials", &self.inner.credentials)
            .finish()
    }
}

impl EtcdMeta {
    /// Prepares clients for every endpoint of `config` without contacting etcd: this
    /// succeeds while etcd is down, and calls made then fail with `Unavailable`
    /// until it is back. Fails with `InvalidRequest` when there are no endpoints, a
    /// timeout is zero, an endpoint is not a valid address, or a TLS file cannot be
    /// used (the message names it).
    pub async fn connect(config: EtcdConfig) -> Result<Self, MetaError> {
        if config.endpoints.is_empty() {
            return Err(MetaError::InvalidRequest(
                "etcd configuration has no endpoints".into(),
            ));
        }
        for (name, value) in [
            ("request_timeout", config.request_timeout),
            ("connect_timeout", config.connect_timeout),
            ("keep_alive_interval", config.keep_alive_interval),
            ("keep_alive_timeout", config.keep_alive_timeout),
        ] {
            if value.is_zero() {
                return Err(MetaError::InvalidRequest(format!(
                    "etcd configuration: {name} must be greater than zero"
                )));
            }
        }
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_keep_alive(config.keep_alive_interval, config.keep_alive_timeout)
            .with_keep_alive_while_idle(true)
            // A member without a leader refuses requests (and watches) instead of
            // serving stale data or stalling.
            .with_require_leader(true)
            // A request refused for an expired or forgotten token (etcd restarted)
            // re-authenticates once and is sent again. Without credentials this
            // does nothing.
            .with_auto_token_refresh(true);
        let mut loaded_pems = None;
        if let Some(tls) = &config.tls {
            let pems = tls
                .load()
                .map_err(|e| MetaError::InvalidRequest(e.to_string()))?;
            loaded_pems = Some(pems.clone());
            let mut tls_options = TlsOptions::new().ca_certificate(Certificate::from_pem(pems.ca));
            if let Some((cert, key)) = pems.identity {
                tls_options = tls_options.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(tls_options);
        }
        let mut endpoints = Vec::with_capacity(config.endpoints.len());
        for url in &config.endpoints {
            let target = channel_url(url, config.tls.is_some())?;
            // One lazily connecting channel per endpoint. The credentials are not
            // part of `options`: with them `Client::connect` would authenticate at
            // once, which needs a running etcd. Without them it performs no I/O.
            let client = Client::connect([target.as_str()], Some(options.clone()))
                .await
                .map_err(|e| {
                    MetaError::InvalidRequest(format!("etcd endpoint {url:?} is not usable: {e}"))
                })?;
            endpoints.push(Endpoint {
                url: url.clone(),
                kv: kv_client(&client),
                client,
                authenticated: tokio::sync::OnceCell::new(),
            });
        }
        let quota = config
            .endpoints
            .iter()
            .map(|url| match quota::QuotaProbe::new(url, loaded_pems.as_ref()) {
                Ok(p) => Some(p),
                Err(e) => {
                    tracing::warn!(backend = "etcd", endpoint = %url, error = %e, "etcd's quota cannot be read from this endpoint's /metrics; /v1/cluster shows it as unknown");
                    None
                }
            })
            .collect();
        Ok(Self {
            inner: Arc::new(Inner {
                endpoints,
                current: AtomicUsize::new(0),
                request_timeout: config.request_timeout,
                credentials: config.credentials,
                quota,
                quota_cache: std::sync::Mutex::new(None),
            }),
        })
    }

    /// etcd's backend quota (from the current endpoint's `/metrics`), read at most once
    /// a minute; `None` when it cannot be read (logged).
    async fn quota_bytes(&self) -> Option<u64> {
        let cached = *self
            .inner
            .quota_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((at, value)) = cached {
            if at.elapsed() < QUOTA_EVERY {
                return value;
            }
        }
        let i = self.inner.current.load(Ordering::Relaxed) % self.inner.quota.len().max(1);
        let value = match self.inner.quota.get(i).and_then(Option::as_ref) {
            None => None,
            Some(probe) => match probe.read(self.inner.request_timeout).await {
                Ok(v) => Some(v),
                Err(e) => {
                    tracing::warn!(backend = "etcd", endpoint = %self.inner.endpoints[i].url, error = %e, "reading etcd's quota failed; shown as unknown");
                    None
                }
            },
        };
        *self
            .inner
            .quota_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((Instant::now(), value));
        value
    }

    /// Gives `endpoint`'s client an auth token, once (concurrent first calls wait
    /// for one authentication). Nothing to do without credentials.
    async fn authenticate(&self, endpoint: &Endpoint) -> Result<(), etcd_client::Error> {
        let Some(credentials) = &self.inner.credentials else {
            return Ok(());
        };
        endpoint
            .authenticated
            .get_or_try_init(|| async {
                // `update_user` stores the user in the client (shared by its clones)
                // only when etcd accepted it, so a refused password is asked again
                // on the next call rather than remembered.
                endpoint
                    .client
                    .clone()
                    .update_user(Some((
                        credentials.user.clone(),
                        credentials.password.clone(),
                    )))
                    .await
            })
            .await
            .map(|_| ())
    }

    /// The configured endpoints, in order.
    pub fn endpoints(&self) -> Vec<&str> {
        self.inner
            .endpoints
            .iter()
            .map(|e| e.url.as_str())
            .collect()
    }

    /// The endpoint the next call goes to first.
    pub fn current_endpoint(&self) -> &str {
        let n = self.inner.endpoints.len();
        &self.inner.endpoints[self.inner.current.load(Ordering::Relaxed) % n].url
    }

    /// Runs `attempt` on the current endpoint and, while it fails with `Unavailable`
    /// because of the endpoint (a proven "not applied" error, or any failed read),
    /// on the next ones (each at most once), all within one request timeout. `lease`
    /// names the lease the request is about, for `LeaseNotFound`.
    async fn call<T, F, Fut>(
        &self,
        op: &'static str,
        kind: Kind,
        lease: Option<LeaseId>,
        mut attempt: F,
    ) -> Result<T, MetaError>
    where
        F: FnMut(&Endpoint) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let inner = &*self.inner;
        let n = inner.endpoints.len();
        let first = inner.current.load(Ordering::Relaxed) % n;
        let deadline = Instant::now() + inner.request_timeout;
        let mut refused: Vec<String> = Vec::new();
        for step in 0..n {
            let index = (first + step) % n;
            let endpoint = &inner.endpoints[index];
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let on_endpoint = async {
                self.authenticate(endpoint).await?;
                attempt(endpoint).await
            };
            match tokio::time::timeout(left, on_endpoint).await {
                Ok(Ok(value)) => {
                    if step > 0 {
                        self.move_to(first, index);
                    }
                    return Ok(value);
                }
                Ok(Err(err)) => {
                    let failure = classify(&err, kind, lease, &endpoint.url);
                    match failure.error {
                        MetaError::Unavailable(msg) if failure.endpoint_failed && step + 1 < n => {
                            tracing::warn!(
                                backend = "etcd",
                                endpoint = %endpoint.url,
                                op,
                                error = %msg,
                                "etcd endpoint unavailable; trying the next endpoint"
                            );
                            refused.push(msg);
                            continue;
                        }
                        _ => {}
                    }
                    if failure.endpoint_failed {
                        self.skip(index);
                    }
                    let error = match failure.error {
                        MetaError::Unavailable(msg) if !refused.is_empty() => {
                            refused.push(msg);
                            MetaError::Unavailable(refused.join("; "))
                        }
                        error => error,
                    };
                    log_error(op, &endpoint.url, &error);
                    return Err(error);
                }
                Err(_) => {
                    self.skip(index);
                    let what = format!(
                        "etcd {}: no answer to {op} within the request timeout ({:?})",
                        endpoint.url, inner.request_timeout
                    );
                    let error = match kind {
                        Kind::Read => MetaError::Unavailable(what),
                        Kind::Write => MetaError::Indeterminate(what),
                    };
                    log_error(op, &endpoint.url, &error);
                    return Err(error);
                }
            }
        }
        refused.push(format!(
            "request timeout ({:?}) used up before every endpoint was tried",
            inner.request_timeout
        ));
        let error = MetaError::Unavailable(refused.join("; "));
        log_error(op, self.current_endpoint(), &error);
        Err(error)
    }

    /// The keys `txn` compares, read at `revision` (the revision a failed
    /// transaction saw; it wrote nothing). If etcd compacted that revision away in the
    /// meantime, the current values are read instead. A failed read is returned as
    /// is: the transaction was not applied either way.
    async fn read_compared(
        &self,
        txn: &Txn,
        revision: i64,
    ) -> Result<HashMap<Vec<u8>, KeyValue>, MetaError> {
        let mut keys: Vec<&[u8]> = Vec::new();
        for c in &txn.conditions {
            if !keys.contains(&c.compare.key()) {
                keys.push(c.compare.key());
            }
        }
        let reads = |at: Option<i64>| {
            let gets: Vec<EtcdTxnOp> = keys
                .iter()
                .map(|key| {
                    let options = at.map(|r| GetOptions::new().with_revision(r));
                    EtcdTxnOp::get(key.to_vec(), options)
                })
                .collect();
            EtcdTxn::new().and_then(gets)
        };
        let read = |request: EtcdTxn| {
            self.call("txn read-back", Kind::Read, None, move |endpoint| {
                let (mut kv, request) = (endpoint.kv.clone(), request.clone());
                async move { kv.txn(request).await }
            })
        };
        let resp = match read(reads(Some(revision))).await {
            Err(MetaError::InvalidRequest(msg)) if msg.contains(COMPACTED) => {
                read(reads(None)).await?
            }
            other => other?,
        };
        let mut current = HashMap::new();
        for r in resp.op_responses() {
            if let TxnOpResponse::Get(mut get) = r {
                for kv in get.take_kvs() {
                    let kv = convert_kv(kv);
                    current.insert(kv.key.clone(), kv);
                }
            }
        }
        Ok(current)
    }

    /// Remembers the endpoint that answered after `from` failed.
    fn move_to(&self, from: usize, to: usize) {
        let inner = &*self.inner;
        if inner
            .current
            .compare_exchange(from, to, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            tracing::info!(
                backend = "etcd",
                endpoint = %inner.endpoints[to].url,
                previous = %inner.endpoints[from].url,
                "etcd failover: now using this endpoint"
            );
        }
    }

    /// Sends the next calls to the endpoint after `index`, which just failed.
    fn skip(&self, index: usize) {
        let n = self.inner.endpoints.len();
        if n > 1 {
            self.move_to(index, (index + 1) % n);
        }
    }
}

/// The URL the channel of `endpoint` dials: `https://` with TLS, else as given
/// (etcd-client adds `http://`). A configured `http://` endpoint with TLS is an
/// error, never a silent plaintext connection.
fn channel_url(endpoint: &str, tls: bool) -> Result<String, MetaError> {
    let lower = endpoint.to_ascii_lowercase();
    match (
        tls,
        lower.starts_with("http://"),
        lower.starts_with("https://"),
    ) {
        (true, true, _) => Err(MetaError::InvalidRequest(format!(
            "etcd endpoint {endpoint:?} is plain http:// but TLS is configured"
        ))),
        (true, false, false) => Ok(format!("https://{endpoint}")),
        _ => Ok(endpoint.to_string()),
    }
}

fn log_error(op: &'static str, endpoint: &str, error: &MetaError) {
    match error {
        MetaError::LeaseNotFound(_) => {
            tracing::debug!(backend = "etcd", endpoint, op, %error, "etcd request failed")
        }
        _ => tracing::warn!(backend = "etcd", endpoint, op, %error, "etcd request failed"),
    }
}

fn kv_client(client: &Client) -> KvClient {
    client
        .kv_client()
        .max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE)
}

/// The revision in a response header. etcd always sends one; a missing header is a
/// protocol error whose outcome, for a write, is unknown.
fn revision(header: Option<&ResponseHeader>, kind: Kind, op: &str) -> Result<i64, MetaError> {
    match header {
        Some(h) => Ok(h.revision()),
        None => {
            let what = format!("etcd answered {op} without a response header");
            Err(match kind {
                Kind::Read => MetaError::Unavailable(what),
                Kind::Write => MetaError::Indeterminate(what),
            })
        }
    }
}

fn convert_kv(kv: etcd_client::KeyValue) -> KeyValue {
    let (create_revision, mod_revision, version, lease) = (
        kv.create_revision(),
        kv.mod_revision(),
        kv.version(),
        kv.lease(),
    );
    let (key, value) = kv.into_key_value();
    KeyValue {
        key,
        value,
        create_revision,
        mod_revision,
        version,
        lease: (lease != 0).then_some(LeaseId(lease)),
    }
}

/// The etcd key range of a prefix: `[key, range_end)`. The empty prefix (and a
/// prefix of only 0xff bytes) has no upper bound, which etcd spells `"\0"`.
fn prefix_range(prefix: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let key = if prefix.is_empty() {
        vec![0]
    } else {
        prefix.to_vec()
    };
    let end = prefix_end(prefix);
    (key, if end.is_empty() { vec![0] } else { end })
}

fn require_key(key: &[u8]) -> Result<(), MetaError> {
    if key.is_empty() {
        return Err(MetaError::InvalidRequest("empty key".into()));
    }
    Ok(())
}

/// The etcd compare for one contract compare.
fn compare(c: &Compare) -> EtcdCompare {
    match c {
        Compare::Absent { key } => EtcdCompare::create_revision(key.clone(), CompareOp::Equal, 0),
        Compare::Present { key } => {
            EtcdCompare::create_revision(key.clone(), CompareOp::Greater, 0)
        }
        Compare::ModRevision { key, revision } => {
            EtcdCompare::mod_revision(key.clone(), CompareOp::Equal, *revision)
        }
        Compare::Value { key, value } => {
            EtcdCompare::value(key.clone(), CompareOp::Equal, value.clone())
        }
    }
}

/// Turns one watch response into a batch (`Some(Ok)`), the end of the stream
/// (`Some(Err)`), or nothing to report (`None`: a created or progress response).
fn watch_item(
    resp: &etcd_client::WatchResponse,
    endpoint: &str,
) -> Option<Result<WatchBatch, WatchError>> {
    if resp.compact_revision() > 0 {
        return Some(Err(WatchError::Compacted {
            compact_revision: resp.compact_revision(),
        }));
    }
    if resp.canceled() {
        // Any other cancellation (no leader, ...): the caller watches again from
        // the last revision it saw + 1, and learns then if that was compacted.
        let reason = resp.cancel_reason();
        return Some(Err(WatchError::Unavailable(format!(
            "etcd {endpoint} canceled the watch: {}",
            if reason.is_empty() {
                "no reason given"
            } else {
                reason
            }
        ))));
    }
    if resp.events().is_empty() {
        return None;
    }
    let mut events = Vec::with_capacity(resp.events().len());
    for event in resp.events() {
        let Some(kv) = event.kv() else {
            return Some(Err(WatchError::Corrupt(format!(
                "etcd {endpoint} sent a watch event without a key"
            ))));
        };
        events.push(match event.event_type() {
            EventType::Put => WatchEvent::Put(convert_kv(kv.clone())),
            EventType::Delete => WatchEvent::Delete {
                key: kv.key().to_vec(),
                revision: kv.mod_revision(),
            },
        });
    }
    Some(Ok(WatchBatch { events }))
}

/// The contract stream over an established etcd watch. It ends after the first
/// error; dropping it closes the etcd stream, which cancels the watcher.
fn watch_stream(watch: etcd_client::WatchStream, endpoint: String) -> WatchStream {
    stream::unfold(Some(watch), move |state| {
        let endpoint = endpoint.clone();
        async move {
            let mut watch = state?;
            loop {
                match watch.message().await {
                    Ok(Some(resp)) => match watch_item(&resp, &endpoint) {
                        None => continue,
                        Some(Ok(batch)) => return Some((Ok(batch), Some(watch))),
                        Some(Err(e)) => return Some((Err(e), None)),
                    },
                    Ok(None) => {
                        return Some((
                            Err(WatchError::Unavailable(format!(
                                "etcd {endpoint} closed the watch stream"
                            ))),
                            None,
                        ))
                    }
                    Err(e) => {
                        let error = WatchError::Unavailable(format!("etcd {endpoint}: {e}"));
                        tracing::warn!(backend = "etcd", endpoint = %endpoint, %error, "etcd watch broke");
                        return Some((Err(error), None));
                    }
                }
            }
        }
    })
    .boxed()
}

#[async_trait]
impl Meta for EtcdMeta {
    fn backend(&self) -> meshd_meta::Backend {
        meshd_meta::Backend::Etcd
    }

    async fn get(&self, key: &[u8]) -> Result<GetResponse, MetaError> {
        require_key(key)?;
        let mut resp = self
            .call("get", Kind::Read, None, |endpoint| {
                let (mut kv, key) = (endpoint.kv.clone(), key.to_vec());
                async move { kv.get(key, None).await }
            })
            .await?;
        let revision = revision(resp.header(), Kind::Read, "get")?;
        Ok(GetResponse {
            revision,
            kv: resp.take_kvs().into_iter().next().map(convert_kv),
        })
    }

    async fn range(
        &self,
        prefix: &[u8],
        options: RangeOptions,
    ) -> Result<RangeResponse, MetaError> {
        let (from, end) = prefix_range(prefix);
        let start = match options.start {
            Some(start) if !start.starts_with(prefix) => {
                return Err(MetaError::InvalidRequest(format!(
                    "range start {:?} does not start with the prefix {:?}",
                    String::from_utf8_lossy(&start),
                    String::from_utf8_lossy(prefix)
                )))
            }
            Some(start) if !start.is_empty() => start,
            _ => from,
        };
        let mut get = GetOptions::new().with_range(end);
        if options.limit > 0 {
            get = get.with_limit(i64::try_from(options.limit).unwrap_or(i64::MAX));
        }
        let mut resp = self
            .call("range", Kind::Read, None, |endpoint| {
                let (mut kv, start, get) = (endpoint.kv.clone(), start.clone(), get.clone());
                async move { kv.get(start, Some(get)).await }
            })
            .await?;
        let revision = revision(resp.header(), Kind::Read, "range")?;
        let more = resp.more();
        Ok(RangeResponse {
            revision,
            kvs: resp.take_kvs().into_iter().map(convert_kv).collect(),
            more,
        })
    }

    /// One etcd transaction: the compares and the operations on success. When a
    /// compare fails, the compared keys are read at the revision the transaction saw
    /// (so exactly what it compared against), from which [`Txn::failure`] decides
    /// between `Fenced` and `Conflict { current }`. The read is a second request only
    /// on failure: carried in every transaction as its `else` branch, it made each
    /// fenced write measurably slower (etcd decodes and stores the whole request).
    async fn txn(&self, txn: Txn) -> Result<TxnResponse, MetaError> {
        txn.validate()?;
        let compares: Vec<EtcdCompare> =
            txn.conditions.iter().map(|c| compare(&c.compare)).collect();
        let ops: Vec<EtcdTxnOp> = txn
            .ops
            .iter()
            .map(|op| match op {
                TxnOp::Put { key, value, lease } => {
                    let options = lease.map(|l| PutOptions::new().with_lease(l.0));
                    EtcdTxnOp::put(key.clone(), value.clone(), options)
                }
                TxnOp::Delete { key } => EtcdTxnOp::delete(key.clone(), None),
            })
            .collect();
        let request = EtcdTxn::new().when(compares).and_then(ops);
        let lease = txn.ops.iter().find_map(|op| match op {
            TxnOp::Put { lease, .. } => *lease,
            TxnOp::Delete { .. } => None,
        });

        let resp = self
            .call("txn", Kind::Write, lease, |endpoint| {
                let (mut kv, request) = (endpoint.kv.clone(), request.clone());
                async move { kv.txn(request).await }
            })
            .await?;
        let revision = revision(resp.header(), Kind::Write, "txn")?;
        if resp.succeeded() {
            let deleted = resp
                .op_responses()
                .iter()
                .map(|r| match r {
                    TxnOpResponse::Delete(d) => u64::try_from(d.deleted()).unwrap_or(0),
                    _ => 0,
                })
                .sum();
            return Ok(TxnResponse { revision, deleted });
        }
        let current = self.read_compared(&txn, revision).await?;
        Err(txn.failure(|key| current.get(key)))
    }

    /// etcd grants whole seconds: the TTL is rounded up to whole seconds (at least
    /// one), and the answer carries the TTL etcd granted, which may be longer still
    /// (etcd's minimum TTL depends on its election timeout).
    async fn grant(&self, ttl: Duration) -> Result<Lease, MetaError> {
        let seconds = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let seconds = i64::try_from(seconds.max(1))
            .map_err(|_| MetaError::InvalidRequest(format!("lease TTL {ttl:?} is too large")))?;
        let resp = self
            .call("grant", Kind::Write, None, |endpoint| {
                let mut client = endpoint.client.clone();
                async move { client.lease_grant(seconds, None).await }
            })
            .await?;
        let granted = u64::try_from(resp.ttl()).unwrap_or(0);
        if resp.id() == 0 || granted == 0 {
            return Err(MetaError::Indeterminate(format!(
                "etcd answered the lease grant without a lease (id {}, ttl {}, error {:?})",
                resp.id(),
                resp.ttl(),
                resp.error()
            )));
        }
        Ok(Lease {
            id: LeaseId(resp.id()),
            ttl: Duration::from_secs(granted),
        })
    }

    /// Opens a keep-alive stream (which renews the lease once), renews it again to
    /// learn the TTL, and closes the stream: a bounded request/response, no
    /// background task. `LeaseNotFound` when etcd answers TTL 0.
    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, MetaError> {
        let ttl = self
            .call("keep_alive", Kind::Read, Some(lease), |endpoint| {
                let mut client = endpoint.client.clone();
                async move {
                    let (mut keeper, mut responses) = client.lease_keep_alive(lease.0).await?;
                    keeper.keep_alive().await?;
                    match responses.message().await? {
                        Some(resp) => Ok(resp.ttl()),
                        None => Err(etcd_client::Error::LeaseKeepAliveError(
                            "etcd closed the keep-alive stream".into(),
                        )),
                    }
                }
            })
            .await?;
        if ttl <= 0 {
            return Err(MetaError::LeaseNotFound(lease));
        }
        Ok(Duration::from_secs(u64::try_from(ttl).unwrap_or(0)))
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), MetaError> {
        self.call("revoke", Kind::Write, Some(lease), |endpoint| {
            let mut client = endpoint.client.clone();
            async move { client.lease_revoke(lease.0).await }
        })
        .await
        .map(|_| ())
    }

    /// Waits until etcd confirmed the watcher (within the request timeout), then
    /// streams its events. A compacted start revision yields
    /// [`WatchError::Compacted`] with etcd's compact revision.
    async fn watch(&self, prefix: &[u8], start_revision: i64) -> Result<WatchStream, MetaError> {
        if start_revision < 1 {
            return Err(MetaError::InvalidRequest(format!(
                "watch start revision {start_revision} is below 1"
            )));
        }
        let (key, end) = prefix_range(prefix);
        let options = WatchOptions::new()
            .with_range(end)
            .with_start_revision(start_revision);
        let authenticated = self.inner.credentials.is_some();
        let (watch, first, endpoint) = self
            .call("watch", Kind::Read, None, |endpoint| {
                let (client, key, options) =
                    (endpoint.client.clone(), key.clone(), options.clone());
                async move {
                    let mut refreshed = false;
                    loop {
                        let mut watch = client
                            .watch_client()
                            .max_decoding_message_size(MAX_DECODING_MESSAGE_SIZE)
                            .watch(key.clone(), Some(options.clone()))
                            .await?;
                        match watch.message().await? {
                            // etcd checks the token of each watch it creates on an
                            // open stream and cancels the watch (instead of failing
                            // the RPC, which etcd-client would retry) when the token
                            // expired or etcd restarted: authenticate again, once.
                            Some(first)
                                if authenticated
                                    && !refreshed
                                    && first.canceled()
                                    && first.cancel_reason().contains(INVALID_AUTH_TOKEN) =>
                            {
                                refreshed = true;
                                client.refresh_token().await?;
                            }
                            Some(first) => return Ok((watch, first)),
                            None => {
                                return Err(etcd_client::Error::WatchError(
                                    "etcd closed the watch stream before confirming it".into(),
                                ))
                            }
                        }
                    }
                }
            })
            .await
            .map(|(watch, first)| (watch, first, self.current_endpoint().to_string()))?;
        match watch_item(&first, &endpoint) {
            None => Ok(watch_stream(watch, endpoint)),
            Some(Ok(batch)) => Ok(stream::iter([Ok(batch)])
                .chain(watch_stream(watch, endpoint))
                .boxed()),
            // etcd refused to create the watcher (no leader, permissions, ...).
            Some(Err(WatchError::Unavailable(reason)))
                if reason.contains(INVALID_AUTH_TOKEN) || reason.contains("permission denied") =>
            {
                Err(MetaError::Unavailable(format!(
                    "etcd authentication refused ({reason}); check the etcd user and password"
                )))
            }
            Some(Err(WatchError::Unavailable(reason))) => Err(MetaError::Unavailable(reason)),
            Some(Err(e)) => Ok(stream::iter([Err(e)]).boxed()),
        }
    }

    /// Physical compaction: returns once etcd has dropped the history before
    /// `revision`. Compacting at or below an earlier compaction succeeds (the
    /// history is already gone); a revision above the current one is
    /// `InvalidRequest`.
    async fn compact(&self, revision: i64) -> Result<(), MetaError> {
        if revision < 1 {
            return Err(MetaError::InvalidRequest(format!(
                "compact revision {revision} is below 1"
            )));
        }
        self.call("compact", Kind::Write, None, |endpoint| {
            let mut kv = endpoint.kv.clone();
            async move {
                let options = CompactionOptions::new().with_physical();
                match kv.compact(revision, Some(options)).await {
                    Ok(_) => Ok(()),
                    Err(etcd_client::Error::GRpcStatus(s)) if s.message() == COMPACTED => Ok(()),
                    Err(e) => Err(e),
                }
            }
        })
        .await
    }

    /// The status of one member (the current endpoint's). A member that has no
    /// leader cannot serve linearizable requests, so it counts as unavailable.
    async fn status(&self) -> Result<MetaStatus, MetaError> {
        let resp = self
            .call("status", Kind::Read, None, |endpoint| {
                let mut client = endpoint.client.clone();
                async move {
                    let status = client.status().await?;
                    if status.leader() == 0 {
                        return Err(etcd_client::Error::EndpointError(
                            "the member has no leader".into(),
                        ));
                    }
                    let alarms = client
                        .alarm(
                            etcd_client::AlarmAction::Get,
                            etcd_client::AlarmType::None,
                            None,
                        )
                        .await?;
                    Ok((status, alarms))
                }
            })
            .await?;
        let (status, alarms) = resp;
        let mut names: Vec<String> = alarms
            .alarms()
            .iter()
            .map(|a| a.alarm().as_str_name().to_string())
            .collect();
        names.sort();
        names.dedup();
        Ok(MetaStatus {
            revision: revision(status.header(), Kind::Read, "status")?,
            db_size_bytes: u64::try_from(status.db_size()).unwrap_or(0),
            quota_bytes: self.quota_bytes().await,
            alarms: names,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_range_covers_the_prefix() {
        assert_eq!(prefix_range(b"a/"), (b"a/".to_vec(), b"a0".to_vec()));
        assert_eq!(prefix_range(b""), (vec![0], vec![0]));
        assert_eq!(prefix_range(b"\xff"), (b"\xff".to_vec(), vec![0]));
    }

    #[tokio::test]
    async fn connect_needs_no_running_etcd() {
        let meta = EtcdMeta::connect(EtcdConfig::new(["127.0.0.1:1"]))
            .await
            .expect("lazy connect");
        assert_eq!(meta.backend(), meshd_meta::Backend::Etcd);
        assert_eq!(meta.current_endpoint(), "127.0.0.1:1");
        let err = meta.get(b"k").await.expect_err("nothing listens on port 1");
        assert!(matches!(err, MetaError::Unavailable(_)), "{err:?}");
    }

    #[tokio::test]
    async fn connect_rejects_an_empty_configuration() {
        let err = EtcdMeta::connect(EtcdConfig::new(Vec::<String>::new()))
            .await
            .expect_err("no endpoints");
        assert!(matches!(err, MetaError::InvalidRequest(_)), "{err:?}");
        let mut config = EtcdConfig::new(["127.0.0.1:1"]);
        config.request_timeout = Duration::ZERO;
        let err = EtcdMeta::connect(config).await.expect_err("zero timeout");
        assert!(matches!(err, MetaError::InvalidRequest(_)), "{err:?}");
    }

    #[tokio::test]
    async fn invalid_requests_are_rejected_before_sending() {
        let meta = EtcdMeta::connect(EtcdConfig::new(["127.0.0.1:1"]))
            .await
            .expect("lazy connect");
        let invalid = |r: Result<(), MetaError>| matches!(r, Err(MetaError::InvalidRequest(_)));
        assert!(invalid(meta.watch(b"p/", 0).await.map(|_| ())));
        assert!(invalid(meta.compact(0).await));
        assert!(invalid(meta.get(b"").await.map(|_| ())));
        assert!(invalid(
            meta.txn(Txn::new().put(b"k", b"1").delete(b"k"))
                .await
                .map(|_| ())
        ));
        assert!(invalid(
            meta.range(
                b"p/",
                RangeOptions {
                    start: Some(b"q/".to_vec()),
                    limit: 0
                }
            )
            .await
            .map(|_| ())
        ));
    }
}
