//! The typed client of meshd's public API (`http-api.md`): one method per operation,
//! typed answers for the data plane, the contract's JSON for the resources an operator
//! reads. Non-2xx answers are [`Error::Api`] with the problem; nothing is retried except
//! where the contract makes a retry safe ([`Client::publish`] after a lost answer or a
//! 504, which relies on the topic's dedup window).
//!
//! A caller that shows an answer rather than reads it (the `meshd` CLI's `--json`)
//! calls the `*_answer` method of the operation: it sends the same request and returns
//! the 2xx answer whole ([`Response`]), its status (201 created, 200 there already or
//! updated) and its body exactly as meshd wrote it, events byte for byte as published.
//! The method without the suffix reads that answer.

use crate::delivery::Delivery;
use crate::paths;
use crate::transport::{Request, Response, Transport};
use crate::{query, Error, Target};
use http::Method;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::time::Duration;

/// How long a request may take on top of any long-poll wait it asks for.
const ANSWER_SLACK: Duration = Duration::from_secs(30);

/// A client of one meshd (or a proxy in front of a cluster).
#[derive(Clone, Debug)]
pub struct Client {
    transport: Transport,
    target: Target,
    /// How often a publish whose outcome is unknown is sent again.
    publish_retries: u32,
    /// Bounds every request instead of its own bound (see [`Client::with_timeout`]).
    timeout: Option<Duration>,
}

/// How often [`Client::publish`] resends a request whose outcome is unknown, by default.
pub const DEFAULT_PUBLISH_RETRIES: u32 = 5;
/// The first pause before such a resend (doubling: 0.2, 0.4, ... 3.2 s).
const PUBLISH_RETRY_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Where a published event was stored.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct Stored {
    pub id: String,
    pub partition: u32,
    pub offset: u64,
    /// Set when the event was already stored within the topic's dedup window.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub duplicate: bool,
}

/// A pull's request (all fields optional in the contract).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Pull {
    /// 1-1000 (meshd's default 10); meshd answers 400 for anything else.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_events: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wait_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
}

/// A pull answer.
#[derive(Deserialize)]
struct Deliveries {
    deliveries: Vec<Delivery>,
}

/// The deliveries of a pull answer (`{"deliveries": [...]}`), each event decoded on
/// its own (see [`Delivery`]): only an answer that is not a list of deliveries is an
/// error ([`Error::Malformed`]).
pub fn deliveries_of(answer: &Response) -> Result<Vec<Delivery>, Error> {
    Ok(answer.json::<Deliveries>()?.deliveries)
}

/// Where a publish answer (`{"events": [...]}`) says each event was stored.
fn placed(answer: &Response) -> Result<Vec<Stored>, Error> {
    #[derive(Deserialize)]
    struct Placed {
        events: Vec<Stored>,
    }
    Ok(answer.json::<Placed>()?.events)
}

/// The answer to an ack.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Acked {
    pub acked: Vec<String>,
    pub unknown: Vec<String>,
    pub fenced: Vec<String>,
    pub failed: Vec<String>,
}

/// The answer to a nack.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Nacked {
    pub retrying: Vec<String>,
    pub dead_lettered: Vec<String>,
    pub dead_lettering: Vec<String>,
    pub unknown: Vec<String>,
    pub fenced: Vec<String>,
}

/// The answer to an extend.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct Extended {
    pub extended: Vec<String>,
    pub unknown: Vec<String>,
}

/// A topic as listed.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct TopicSummary {
    pub name: String,
    pub partitions: u32,
}

/// A topic with its end offsets.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Topic {
    pub name: String,
    pub partitions: u32,
    #[serde(default)]
    pub end_offsets: Vec<u64>,
}

/// A subscription's committed offset in one partition.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Offset {
    pub partition: u32,
    pub committed: u64,
    pub epoch: u64,
}

/// A session as opened.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub struct Session {
    pub session_id: String,
    pub client_id: String,
    pub epoch: u64,
    pub instance: String,
    pub ttl_ms: u64,
}

impl Client {
    /// A client of the meshd at `target` (`http[s]://host:port[/prefix]`).
    pub fn new(target: Target, transport: Transport) -> Self {
        Self {
            transport,
            target,
            // meshd deduplicates publishes within the topic's window (on by default),
            // so a request whose outcome is unknown is safe to send again.
            publish_retries: DEFAULT_PUBLISH_RETRIES,
            timeout: None,
        }
    }

    /// A client of `url` over plain HTTP, or over HTTPS trusting the system's CAs.
    ///
    /// ```
    /// # async fn run() -> Result<(), meshd_client::Error> {
    /// let meshd = meshd_client::Client::connect("http://127.0.0.1:7070")?
    ///     .with_token("s3cret")?;
    /// meshd.create_topic("orders", 4).await?;
    /// let stored = meshd
    ///     .publish("orders", &[serde_json::json!({
    ///         "specversion": "1.0", "id": "o-1", "source": "/shop", "type": "order.placed",
    ///         "data": {"total": 42}
    ///     })])
    ///     .await?;
    /// println!("stored at {}:{}", stored[0].partition, stored[0].offset);
    /// # Ok(()) }
    /// ```
    pub fn connect(url: &str) -> Result<Self, Error> {
        let target = Target::parse(url)?;
        let mut transport = Transport::new();
        if target.https {
            transport = transport.with_tls(crate::tls::connector(None).map_err(Error::Invalid)?);
        }
        Ok(Self::new(target, transport))
    }

    /// Sends `Authorization: Bearer token` with every request.
    pub fn with_token(mut self, token: &str) -> Result<Self, Error> {
        if token.is_empty() || token.chars().any(|c| c.is_control()) {
            return Err(Error::Invalid(
                "the token is empty or has control characters".into(),
            ));
        }
        self.transport = self
            .transport
            .with_header("authorization", &format!("Bearer {token}"))?;
        Ok(self)
    }

    /// How often [`Client::publish`] sends a request again whose outcome is unknown
    /// (default [`DEFAULT_PUBLISH_RETRIES`]; 0 turns it off). Safe while the topic
    /// deduplicates (its `dedup_window_ms`, on by default): each event is stored once
    /// however often it is sent within the window. With dedup off a retry may store an
    /// event twice.
    pub fn with_publish_retries(mut self, retries: u32) -> Self {
        self.publish_retries = retries;
        self
    }

    /// Bounds every request, connect to answer, by `timeout`, long polls included:
    /// by default a request may take 60 s, a pull its `wait_ms` plus 30 s, and a
    /// stream's answer head 30 s. A request not answered in time is [`Error::Lost`]
    /// (or [`Error::Unreachable`] when it never left). For a caller that must not wait
    /// longer than it would for any answer, whatever the request asks meshd to wait
    /// (the tests: a long poll that only meshd's stop can end must not end by its
    /// own wait).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Sends `req` (its path under the target's prefix) and returns the answer, whatever
    /// its status. Bounded by [`Client::with_timeout`] when set, else by its own
    /// timeout.
    pub async fn send(&self, mut req: Request) -> Result<Response, Error> {
        req.path = format!("{}{}", self.target.prefix(), req.path);
        if let Some(t) = self.timeout {
            req.timeout = t;
        }
        self.transport.send(&self.target, req).await
    }

    /// Sends `req`; a non-2xx answer is [`Error::Api`].
    pub async fn ok(&self, req: Request) -> Result<Response, Error> {
        self.send(req).await?.success()
    }

    // Health and operations.

    /// `GET /readyz`: `Ok(true)` when ready, `Ok(false)` with 503.
    pub async fn ready(&self) -> Result<bool, Error> {
        let a = self.send(Request::get("/readyz")).await?;
        match a.status {
            200 => Ok(true),
            503 => Ok(false),
            _ => Err(Error::Api(Box::new(crate::Problem::of(&a)))),
        }
    }

    /// `GET /metrics`: the Prometheus text.
    pub async fn metrics(&self) -> Result<String, Error> {
        Ok(self.ok(Request::get("/metrics")).await?.text())
    }

    /// `GET /v1/cluster`.
    pub async fn cluster(&self) -> Result<Value, Error> {
        self.cluster_answer().await?.json()
    }

    /// [`Client::cluster`], the answer kept whole.
    pub async fn cluster_answer(&self) -> Result<Response, Error> {
        self.ok(Request::get(paths::CLUSTER)).await
    }

    // Topics and events.

    /// `PUT /v1/topics/{topic}`: `true` when created, `false` when it existed alike.
    pub async fn create_topic(&self, topic: &str, partitions: u32) -> Result<bool, Error> {
        Ok(self.create_topic_answer(topic, partitions).await?.status == 201)
    }

    /// [`Client::create_topic`], the answer kept whole: 201 when created, 200 when it
    /// existed alike, with the topic.
    pub async fn create_topic_answer(
        &self,
        topic: &str,
        partitions: u32,
    ) -> Result<Response, Error> {
        self.put_topic_answer(topic, &json!({ "partitions": partitions }))
            .await
    }

    /// `PUT /v1/topics/{topic}` with the contract's settings object (`partitions`, and
    /// `dedup_window_ms` when not the default); the answer is the topic as stored.
    pub async fn put_topic(&self, topic: &str, settings: &Value) -> Result<Value, Error> {
        self.put_topic_answer(topic, settings).await?.json()
    }

    /// [`Client::put_topic`], the answer kept whole: 201 when created, 200 when it
    /// existed (with the same partitions; a `dedup_window_ms` sent is then updated).
    pub async fn put_topic_answer(&self, topic: &str, settings: &Value) -> Result<Response, Error> {
        self.ok(Request::new(Method::PUT, paths::topic(topic)).json(settings))
            .await
    }

    pub async fn delete_topic(&self, topic: &str) -> Result<(), Error> {
        self.ok(Request::new(Method::DELETE, paths::topic(topic)))
            .await
            .map(drop)
    }

    pub async fn topics(&self) -> Result<Vec<TopicSummary>, Error> {
        #[derive(Deserialize)]
        struct List {
            topics: Vec<TopicSummary>,
        }
        Ok(self.topics_answer().await?.json::<List>()?.topics)
    }

    /// [`Client::topics`], the answer kept whole.
    pub async fn topics_answer(&self) -> Result<Response, Error> {
        self.ok(Request::get(paths::TOPICS)).await
    }

    pub async fn topic(&self, topic: &str) -> Result<Topic, Error> {
        self.topic_answer(topic).await?.json()
    }

    /// [`Client::topic`], the answer kept whole.
    pub async fn topic_answer(&self, topic: &str) -> Result<Response, Error> {
        self.ok(Request::get(paths::topic(topic))).await
    }

    /// Publishes structured-mode CloudEvents as one batch; answered once every event is
    /// durable. A request whose outcome is unknown (connection lost, 504) is sent again
    /// up to [`Client::with_publish_retries`] times (within the topic's dedup window
    /// each event is then stored once).
    pub async fn publish(&self, topic: &str, events: &[Value]) -> Result<Vec<Stored>, Error> {
        placed(&self.publish_answer(topic, events).await?)
    }

    /// [`Client::publish`], the answer kept whole (201 with where each event was
    /// stored); retried as [`Client::publish`] is.
    pub async fn publish_answer(&self, topic: &str, events: &[Value]) -> Result<Response, Error> {
        let texts: Vec<String> = events.iter().map(Value::to_string).collect();
        self.publish_texts_answer(topic, &texts).await
    }

    /// [`Client::publish`] for events given as JSON text, each sent exactly as written:
    /// meshd stores an event's own text, so consumers get these bytes (its key order,
    /// its spelling of numbers). Each text must be one JSON object; one that is not
    /// makes meshd refuse the whole batch (400). Retried as [`Client::publish`] is.
    pub async fn publish_texts<S: AsRef<str>>(
        &self,
        topic: &str,
        events: &[S],
    ) -> Result<Vec<Stored>, Error> {
        placed(&self.publish_texts_answer(topic, events).await?)
    }

    /// [`Client::publish_texts`], the answer kept whole.
    async fn publish_texts_answer<S: AsRef<str>>(
        &self,
        topic: &str,
        events: &[S],
    ) -> Result<Response, Error> {
        let mut body =
            String::with_capacity(2 + events.iter().map(|e| e.as_ref().len() + 1).sum::<usize>());
        body.push('[');
        for (i, e) in events.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            body.push_str(e.as_ref());
        }
        body.push(']');
        self.publish_body(topic, "application/cloudevents-batch+json", body.into())
            .await
    }

    /// Publishes one CloudEvent in structured mode (`application/cloudevents+json`, the
    /// event itself as the body, not a batch of one); answered once it is durable, with
    /// where it was stored. Retried as [`Client::publish`] is.
    pub async fn publish_event(&self, topic: &str, event: &Value) -> Result<Stored, Error> {
        let answer = self.publish_event_answer(topic, event).await?;
        let mut stored = placed(&answer)?;
        match stored.len() {
            1 => Ok(stored.remove(0)),
            n => Err(Error::Malformed(format!(
                "a publish of one event answered {n} placements: {}",
                crate::error::shorten(&answer.text(), 200)
            ))),
        }
    }

    /// [`Client::publish_event`], the answer kept whole (201 with the one placement).
    pub async fn publish_event_answer(
        &self,
        topic: &str,
        event: &Value,
    ) -> Result<Response, Error> {
        self.publish_body(
            topic,
            "application/cloudevents+json",
            event.to_string().into(),
        )
        .await
    }

    /// POSTs `body` to the topic's events, sent again while its outcome is unknown (up
    /// to [`Client::with_publish_retries`] times): the 2xx answer.
    async fn publish_body(
        &self,
        topic: &str,
        content_type: &str,
        body: bytes::Bytes,
    ) -> Result<Response, Error> {
        let path = paths::events(topic);
        let mut tries = 0;
        loop {
            let req = Request::post(path.clone()).body(content_type, body.clone());
            match self.ok(req).await {
                Ok(a) => return Ok(a),
                Err(e) if e.outcome_unknown() && tries < self.publish_retries => {
                    tries += 1;
                    // A 504 or a lost connection: give the server a moment (a
                    // restart, a fail-over) before the same request goes again.
                    tokio::time::sleep(PUBLISH_RETRY_PAUSE * (1 << tries.min(5))).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Browses a partition from `from` (does not affect delivery).
    pub async fn browse(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
        limit: u32,
    ) -> Result<Value, Error> {
        self.browse_answer(topic, partition, from, limit)
            .await?
            .json()
    }

    /// [`Client::browse`], the answer kept whole (each event byte for byte as
    /// published).
    pub async fn browse_answer(
        &self,
        topic: &str,
        partition: u32,
        from: u64,
        limit: u32,
    ) -> Result<Response, Error> {
        let q = query(&[
            ("from", Some(from.to_string())),
            ("limit", Some(limit.to_string())),
        ]);
        self.ok(Request::get(format!(
            "{}{q}",
            paths::partition_events(topic, partition)
        )))
        .await
    }

    // Subscriptions.

    /// `PUT /v1/subscriptions/{name}` with the contract's settings object; the answer
    /// is the subscription as stored.
    pub async fn put_subscription(&self, name: &str, settings: &Value) -> Result<Value, Error> {
        self.put_subscription_answer(name, settings).await?.json()
    }

    /// [`Client::put_subscription`], the answer kept whole: 201 when created, 200 when
    /// an existing subscription was updated.
    pub async fn put_subscription_answer(
        &self,
        name: &str,
        settings: &Value,
    ) -> Result<Response, Error> {
        self.ok(Request::new(Method::PUT, paths::subscription(name)).json(settings))
            .await
    }

    /// `PUT /v1/subscriptions/{name}` with `If-None-Match: *`: creates the subscription
    /// and never changes one that exists (that is [`Error::Api`] with status 412). The
    /// answer is the subscription as stored.
    pub async fn create_subscription(&self, name: &str, settings: &Value) -> Result<Value, Error> {
        self.create_subscription_answer(name, settings)
            .await?
            .json()
    }

    /// [`Client::create_subscription`], the answer kept whole.
    pub async fn create_subscription_answer(
        &self,
        name: &str,
        settings: &Value,
    ) -> Result<Response, Error> {
        self.ok(Request::new(Method::PUT, paths::subscription(name))
            .json(settings)
            .header("if-none-match", "*"))
            .await
    }

    pub async fn subscription(&self, name: &str) -> Result<Value, Error> {
        self.subscription_answer(name).await?.json()
    }

    /// [`Client::subscription`], the answer kept whole.
    pub async fn subscription_answer(&self, name: &str) -> Result<Response, Error> {
        self.ok(Request::get(paths::subscription(name))).await
    }

    pub async fn subscriptions(&self) -> Result<Vec<Value>, Error> {
        let v: Value = self.subscriptions_answer().await?.json()?;
        Ok(v.get("subscriptions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default())
    }

    /// [`Client::subscriptions`], the answer kept whole (`{"subscriptions": [...]}`).
    pub async fn subscriptions_answer(&self) -> Result<Response, Error> {
        self.ok(Request::get(paths::SUBSCRIPTIONS)).await
    }

    pub async fn delete_subscription(&self, name: &str) -> Result<(), Error> {
        self.delete_subscription_answer(name).await.map(drop)
    }

    /// [`Client::delete_subscription`], the answer kept whole (204).
    pub async fn delete_subscription_answer(&self, name: &str) -> Result<Response, Error> {
        self.ok(Request::new(Method::DELETE, paths::subscription(name)))
            .await
    }

    pub async fn offsets(&self, name: &str) -> Result<Vec<Offset>, Error> {
        #[derive(Deserialize)]
        struct List {
            offsets: Vec<Offset>,
        }
        Ok(self.offsets_answer(name).await?.json::<List>()?.offsets)
    }

    /// [`Client::offsets`], the answer kept whole (`{"offsets": [...]}`).
    pub async fn offsets_answer(&self, name: &str) -> Result<Response, Error> {
        self.ok(Request::get(paths::subscription_action(name, "offsets")))
            .await
    }

    /// Resets the committed offset of one partition (may move backwards).
    pub async fn reset_offset(
        &self,
        name: &str,
        partition: u32,
        offset: u64,
    ) -> Result<Value, Error> {
        self.reset_offset_answer(name, partition, offset)
            .await?
            .json()
    }

    /// [`Client::reset_offset`], the answer kept whole (200 with the partition's
    /// committed offset and its new epoch).
    pub async fn reset_offset_answer(
        &self,
        name: &str,
        partition: u32,
        offset: u64,
    ) -> Result<Response, Error> {
        self.ok(Request::new(Method::PUT, paths::offset(name, partition))
            .json(&json!({ "offset": offset })))
            .await
    }

    // Consuming.

    /// Leases up to `max_events` deliveries, waiting up to `wait_ms` for the first.
    pub async fn pull(&self, name: &str, pull: &Pull) -> Result<Vec<Delivery>, Error> {
        deliveries_of(&self.pull_answer(name, pull).await?)
    }

    /// [`Client::pull`], the answer kept whole (each event in it byte for byte as
    /// published); [`deliveries_of`] reads it.
    pub async fn pull_answer(&self, name: &str, pull: &Pull) -> Result<Response, Error> {
        let wait = Duration::from_millis(pull.wait_ms.unwrap_or(0));
        let body = serde_json::to_value(pull).map_err(|e| Error::Invalid(e.to_string()))?;
        let req = Request::post(paths::subscription_action(name, "pull"))
            .json(&body)
            .timeout(wait + ANSWER_SLACK);
        self.ok(req).await
    }

    /// Opens a stream of deliveries (Server-Sent Events); read it with
    /// [`EventStream::next`](crate::EventStream::next) and ack as with a pull.
    pub async fn stream(
        &self,
        name: &str,
        options: &crate::StreamOptions,
    ) -> Result<crate::EventStream, Error> {
        let path = format!(
            "{}{}{}",
            self.target.prefix(),
            paths::subscription_action(name, "stream"),
            query(&[
                (
                    "max_in_flight",
                    options.max_in_flight.map(|n| n.to_string())
                ),
                ("session", options.session.clone()),
            ])
        );
        let req = Request::get(path)
            .header("accept", "text/event-stream")
            .timeout(self.timeout.unwrap_or(ANSWER_SLACK));
        let answer = self.transport.send_streaming(&self.target, req).await?;
        if !(200..300).contains(&answer.status) {
            let answer = answer.rest(64 * 1024, ANSWER_SLACK).await?;
            return Err(answer
                .success()
                .err()
                .unwrap_or_else(|| Error::Malformed("a refused stream answered 2xx".into())));
        }
        Ok(crate::EventStream::new(answer))
    }

    /// `GET .../stats`: per partition committed, end offset, backlog, in flight,
    /// waiting retries, parked, dead-lettering and the counters.
    pub async fn stats(&self, name: &str) -> Result<Value, Error> {
        self.stats_answer(name).await?.json()
    }

    /// [`Client::stats`], the answer kept whole.
    pub async fn stats_answer(&self, name: &str) -> Result<Response, Error> {
        self.ok(Request::get(paths::subscription_action(name, "stats")))
            .await
    }

    pub async fn ack(&self, name: &str, ids: &[String]) -> Result<Acked, Error> {
        self.ack_answer(name, ids).await?.json()
    }

    /// [`Client::ack`], the answer kept whole.
    pub async fn ack_answer(&self, name: &str, ids: &[String]) -> Result<Response, Error> {
        self.ok(Request::post(paths::subscription_action(name, "ack"))
            .json(&json!({ "delivery_ids": ids })))
            .await
    }

    pub async fn nack(&self, name: &str, ids: &[String], reason: &str) -> Result<Nacked, Error> {
        self.nack_answer(name, ids, reason).await?.json()
    }

    /// [`Client::nack`], the answer kept whole.
    pub async fn nack_answer(
        &self,
        name: &str,
        ids: &[String],
        reason: &str,
    ) -> Result<Response, Error> {
        self.ok(Request::post(paths::subscription_action(name, "nack"))
            .json(&json!({ "delivery_ids": ids, "reason": reason })))
            .await
    }

    /// A nack whose retries wait `delay_ms` (0 to 86 400 000) instead of the
    /// subscription's backoff; each still counts as a failed attempt.
    pub async fn nack_delayed(
        &self,
        name: &str,
        ids: &[String],
        reason: &str,
        delay_ms: u64,
    ) -> Result<Nacked, Error> {
        self.nack_delayed_answer(name, ids, reason, delay_ms)
            .await?
            .json()
    }

    /// [`Client::nack_delayed`], the answer kept whole.
    pub async fn nack_delayed_answer(
        &self,
        name: &str,
        ids: &[String],
        reason: &str,
        delay_ms: u64,
    ) -> Result<Response, Error> {
        self.ok(Request::post(paths::subscription_action(name, "nack"))
            .json(&json!({ "delivery_ids": ids, "reason": reason, "delay_ms": delay_ms })))
            .await
    }

    pub async fn extend(
        &self,
        name: &str,
        ids: &[String],
        ack_timeout_ms: u64,
    ) -> Result<Extended, Error> {
        self.extend_answer(name, ids, ack_timeout_ms).await?.json()
    }

    /// [`Client::extend`], the answer kept whole.
    pub async fn extend_answer(
        &self,
        name: &str,
        ids: &[String],
        ack_timeout_ms: u64,
    ) -> Result<Response, Error> {
        self.ok(Request::post(paths::subscription_action(name, "extend"))
            .json(&json!({ "delivery_ids": ids, "ack_timeout_ms": ack_timeout_ms })))
            .await
    }

    // Dead letters.

    /// One page of dead letters (`subscription` filters), with `next_cursor`.
    pub async fn dead_letters(
        &self,
        subscription: Option<&str>,
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<Value, Error> {
        self.dead_letters_answer(subscription, limit, cursor)
            .await?
            .json()
    }

    /// [`Client::dead_letters`], the answer kept whole (each entry's event byte for
    /// byte as published).
    pub async fn dead_letters_answer(
        &self,
        subscription: Option<&str>,
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<Response, Error> {
        let q = query(&[
            ("subscription", subscription.map(str::to_string)),
            ("limit", limit.map(|l| l.to_string())),
            ("cursor", cursor.map(str::to_string)),
        ]);
        self.ok(Request::get(format!("{}{q}", paths::DEAD_LETTERS)))
            .await
    }

    pub async fn dead_letter(&self, id: &str) -> Result<Value, Error> {
        self.dead_letter_answer(id).await?.json()
    }

    /// [`Client::dead_letter`], the answer kept whole.
    pub async fn dead_letter_answer(&self, id: &str) -> Result<Response, Error> {
        self.ok(Request::get(paths::dead_letter(id))).await
    }

    pub async fn redrive(&self, id: &str) -> Result<(), Error> {
        self.redrive_answer(id).await.map(drop)
    }

    /// [`Client::redrive`], the answer kept whole (202: accepted, delivered afresh
    /// later).
    pub async fn redrive_answer(&self, id: &str) -> Result<Response, Error> {
        self.ok(Request::post(paths::redrive(id))).await
    }

    pub async fn delete_dead_letter(&self, id: &str) -> Result<(), Error> {
        self.ok(Request::new(Method::DELETE, paths::dead_letter(id)))
            .await
            .map(drop)
    }

    // Sessions.

    pub async fn open_session(&self, client_id: &str, ttl_ms: u64) -> Result<Session, Error> {
        self.open_session_answer(client_id, ttl_ms).await?.json()
    }

    /// [`Client::open_session`], the answer kept whole (201 with the session).
    pub async fn open_session_answer(
        &self,
        client_id: &str,
        ttl_ms: u64,
    ) -> Result<Response, Error> {
        self.ok(Request::post(paths::SESSIONS)
            .json(&json!({ "client_id": client_id, "ttl_ms": ttl_ms })))
            .await
    }

    pub async fn heartbeat(&self, session: &str) -> Result<Value, Error> {
        self.heartbeat_answer(session).await?.json()
    }

    /// [`Client::heartbeat`], the answer kept whole.
    pub async fn heartbeat_answer(&self, session: &str) -> Result<Response, Error> {
        self.ok(Request::post(paths::heartbeat(session))).await
    }

    pub async fn sessions(&self) -> Result<Value, Error> {
        self.sessions_answer().await?.json()
    }

    /// [`Client::sessions`], the answer kept whole.
    pub async fn sessions_answer(&self) -> Result<Response, Error> {
        self.ok(Request::get(paths::SESSIONS)).await
    }

    pub async fn close_session(&self, session: &str) -> Result<(), Error> {
        self.ok(Request::new(Method::DELETE, paths::session(session)))
            .await
            .map(drop)
    }

    // Tasks.

    /// Submits a task (`id` makes the submit idempotent).
    pub async fn submit_task(
        &self,
        id: Option<&str>,
        agent: &str,
        input: &Value,
    ) -> Result<Value, Error> {
        self.submit_task_answer(id, agent, input).await?.json()
    }

    /// [`Client::submit_task`], the answer kept whole: 201 when submitted, 200 for a
    /// repeat of the same submit (nothing changed).
    pub async fn submit_task_answer(
        &self,
        id: Option<&str>,
        agent: &str,
        input: &Value,
    ) -> Result<Response, Error> {
        let mut body = json!({ "agent": agent, "input": input });
        if let Some(id) = id {
            body["id"] = json!(id);
        }
        self.ok(Request::post(paths::TASKS).json(&body)).await
    }

    pub async fn task(&self, id: &str) -> Result<Value, Error> {
        self.task_answer(id).await?.json()
    }

    /// [`Client::task`], the answer kept whole.
    pub async fn task_answer(&self, id: &str) -> Result<Response, Error> {
        self.ok(Request::get(paths::task(id))).await
    }

    /// One page of tasks (`agent` and `state` filter), with `next_cursor` when more
    /// follow.
    pub async fn tasks(
        &self,
        agent: Option<&str>,
        state: Option<&str>,
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<Value, Error> {
        self.tasks_answer(agent, state, limit, cursor).await?.json()
    }

    /// [`Client::tasks`], the answer kept whole.
    pub async fn tasks_answer(
        &self,
        agent: Option<&str>,
        state: Option<&str>,
        limit: Option<u32>,
        cursor: Option<&str>,
    ) -> Result<Response, Error> {
        let q = query(&[
            ("agent", agent.map(str::to_string)),
            ("state", state.map(str::to_string)),
            ("limit", limit.map(|l| l.to_string())),
            ("cursor", cursor.map(str::to_string)),
        ]);
        self.ok(Request::get(format!("{}{q}", paths::TASKS))).await
    }

    pub async fn claim_task(&self, id: &str, session: &str) -> Result<Value, Error> {
        self.claim_task_answer(id, session).await?.json()
    }

    /// [`Client::claim_task`], the answer kept whole.
    pub async fn claim_task_answer(&self, id: &str, session: &str) -> Result<Response, Error> {
        self.ok(Request::post(paths::task_action(id, "claim")).json(&json!({ "session": session })))
            .await
    }

    /// Moves a task to `to`, conditional on `version` (`If-Match`).
    pub async fn transition_task(
        &self,
        id: &str,
        version: u64,
        to: &str,
        output: Option<&Value>,
        session: Option<&str>,
    ) -> Result<Value, Error> {
        let mut body = json!({ "to": to });
        if let Some(o) = output {
            body["output"] = o.clone();
        }
        if let Some(s) = session {
            body["session"] = json!(s);
        }
        self.ok(Request::post(paths::task_action(id, "transition"))
            .json(&body)
            .header("if-match", format!("\"{version}\"")))
            .await?
            .json()
    }

    pub async fn cancel_task(&self, id: &str) -> Result<Value, Error> {
        self.cancel_task_answer(id).await?.json()
    }

    /// [`Client::cancel_task`], the answer kept whole.
    pub async fn cancel_task_answer(&self, id: &str) -> Result<Response, Error> {
        self.ok(Request::post(paths::task_action(id, "cancel")))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(body: String) -> Response {
        Response {
            status: 200,
            headers: Default::default(),
            body: body.into(),
        }
    }

    fn delivery(n: u32, event: &str) -> String {
        format!(
            r#"{{"delivery_id":"d{n}","partition":0,"offset":{n},"attempt":1,"event":{event}}}"#
        )
    }

    fn event(id: &str, data: &str) -> String {
        format!(r#"{{"specversion":"1.0","id":"{id}","source":"/s","type":"t","data":{data}}}"#)
    }

    /// The story: a pull answer decoded as one document failed whole on one event
    /// deeper than serde_json's limit (128), so the caller acked nothing and every
    /// event of the batch went back, again and again, into the dead-letter store.
    #[test]
    fn one_undecodable_event_fails_only_its_own_delivery_never_the_batch() {
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        let events = [event("a", "{}"), event("deep", &deep), event("c", "[1,2]")];
        let body = format!(
            r#"{{"deliveries":[{}]}}"#,
            events
                .iter()
                .zip(0..)
                .map(|(e, n)| delivery(n, e))
                .collect::<Vec<_>>()
                .join(",")
        );
        // What decoding the answer as one document does.
        assert!(serde_json::from_str::<Value>(&body).is_err());

        let got = deliveries_of(&answer(body)).unwrap();
        let ids: Vec<&str> = got.iter().map(|d| d.delivery_id.as_str()).collect();
        assert_eq!(
            ids,
            ["d0", "d1", "d2"],
            "every delivery is there to ack or nack"
        );
        assert_eq!(got[0].event.as_ref().unwrap()["id"], "a");
        assert_eq!(
            got[2].event.as_ref().unwrap()["data"],
            serde_json::json!([1, 2])
        );
        let undecodable = got[1].event.as_ref().unwrap_err();
        assert!(
            undecodable.reason.contains("recursion limit"),
            "{undecodable}"
        );
        assert_eq!(undecodable.raw.get(), events[1], "kept exactly as sent");
        assert_eq!((got[1].offset, got[1].attempt), (1, 1));

        // Serialized, each delivery is the contract's object again, byte for byte.
        for (d, e) in got.iter().zip(&events) {
            let n = d.offset as u32;
            let text = serde_json::to_string(d).unwrap();
            if d.event.is_ok() {
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v, serde_json::from_str::<Value>(&delivery(n, e)).unwrap());
            } else {
                assert_eq!(text, delivery(n, e));
            }
        }
    }

    /// A meshd stand-in on a port of its own: each request (head and body, as text) is
    /// handed to the test, and every connection is answered `status` with `body`.
    async fn stand_in(
        status: &str,
        body: &str,
    ) -> (Client, tokio::sync::mpsc::UnboundedReceiver<String>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let answer = format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                // The head, then as many body bytes as it announces.
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let n = s.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                    let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    if got.len() >= end + 4 + len {
                        break;
                    }
                }
                let _ = tx.send(String::from_utf8_lossy(&got).into_owned());
                let _ = s.write_all(answer.as_bytes()).await;
            }
        });
        (Client::connect(&url).unwrap(), rx)
    }

    /// The request line, the header lines (lowercase) and the body of a request.
    fn parts(request: &str) -> (&str, String, &str) {
        let (head, body) = request.split_once("\r\n\r\n").unwrap();
        let (line, headers) = head.split_once("\r\n").unwrap();
        (line, headers.to_lowercase(), body)
    }

    /// The CLI prints `--json` answers as meshd wrote them and says "created" or
    /// "already exists" from the status: an `_answer` method keeps both, and the method
    /// without the suffix reads the same answer.
    #[tokio::test]
    async fn an_answer_is_kept_as_sent_and_read_alike() {
        // Keys out of order and spaced: nothing a re-serialised value would keep.
        let topic = r#"{ "partitions": 3,"name":"orders" , "end_offsets":[4, 0,1]}"#;
        let (meshd, mut sent) = stand_in("201 Created", topic).await;
        let a = meshd.create_topic_answer("a/b", 3).await.unwrap();
        assert_eq!((a.status, &a.body[..]), (201, topic.as_bytes()));
        let request = sent.recv().await.unwrap();
        let (line, headers, body) = parts(&request);
        assert_eq!(line, "PUT /v1/topics/a%2Fb HTTP/1.1");
        assert!(
            headers.contains("content-type: application/json"),
            "{headers}"
        );
        assert_eq!(body, r#"{"partitions":3}"#);
        assert!(
            meshd.create_topic("a/b", 3).await.unwrap(),
            "201 is created"
        );

        let (meshd, _sent) = stand_in("200 OK", topic).await;
        assert!(
            !meshd.create_topic("orders", 3).await.unwrap(),
            "200 existed"
        );
        let a = meshd.topic_answer("orders").await.unwrap();
        assert_eq!(a.text(), topic);
        let t = meshd.topic("orders").await.unwrap();
        assert_eq!((t.name.as_str(), t.partitions), ("orders", 3));
        assert_eq!(t.end_offsets, [4, 0, 1]);
    }

    #[tokio::test]
    async fn each_answer_method_sends_its_operation() {
        let (meshd, mut sent) = stand_in("200 OK", "{}").await;
        let mut next = || sent.try_recv().unwrap();
        meshd.topics_answer().await.unwrap();
        assert!(next().starts_with("GET /v1/topics HTTP/1.1\r\n"));
        meshd.subscriptions_answer().await.unwrap();
        assert!(next().starts_with("GET /v1/subscriptions HTTP/1.1\r\n"));
        meshd.subscription_answer("s 1").await.unwrap();
        assert!(next().starts_with("GET /v1/subscriptions/s%201 HTTP/1.1\r\n"));
        meshd.stats_answer("s").await.unwrap();
        assert!(next().starts_with("GET /v1/subscriptions/s/stats HTTP/1.1\r\n"));
        meshd
            .dead_letters_answer(Some("s"), Some(5), Some("c/1"))
            .await
            .unwrap();
        assert!(next()
            .starts_with("GET /v1/deadletters?subscription=s&limit=5&cursor=c%2F1 HTTP/1.1\r\n"));
        meshd.dead_letter_answer("d").await.unwrap();
        assert!(next().starts_with("GET /v1/deadletters/d HTTP/1.1\r\n"));
        meshd.sessions_answer().await.unwrap();
        assert!(next().starts_with("GET /v1/sessions HTTP/1.1\r\n"));
        meshd.task_answer("t").await.unwrap();
        assert!(next().starts_with("GET /v1/tasks/t HTTP/1.1\r\n"));
        meshd
            .tasks_answer(Some("a b"), None, Some(2), Some("x"))
            .await
            .unwrap();
        assert!(next().starts_with("GET /v1/tasks?agent=a%20b&limit=2&cursor=x HTTP/1.1\r\n"));
        meshd
            .tasks(None, Some("working"), None, None)
            .await
            .unwrap();
        assert!(next().starts_with("GET /v1/tasks?state=working HTTP/1.1\r\n"));
        meshd.cancel_task_answer("t").await.unwrap();
        assert!(next().starts_with("POST /v1/tasks/t/cancel HTTP/1.1\r\n"));
        meshd
            .submit_task_answer(Some("t"), "agent", &json!({"k": 1}))
            .await
            .unwrap();
        let request = next();
        let (line, _, body) = parts(&request);
        assert_eq!(line, "POST /v1/tasks HTTP/1.1");
        assert_eq!(body, r#"{"agent":"agent","id":"t","input":{"k":1}}"#);
        let pull = Pull {
            max_events: Some(100),
            wait_ms: Some(0),
            ..Pull::default()
        };
        meshd.pull_answer("s", &pull).await.unwrap();
        let request = next();
        let (line, _, body) = parts(&request);
        assert_eq!(line, "POST /v1/subscriptions/s/pull HTTP/1.1");
        assert_eq!(body, r#"{"max_events":100,"wait_ms":0}"#);
    }

    /// `meshd sub create` is create-only: it must never replace a subscription that
    /// exists, which `If-None-Match: *` makes meshd refuse (412).
    #[tokio::test]
    async fn a_create_never_replaces_a_subscription_a_put_may() {
        let (meshd, mut sent) = stand_in("201 Created", r#"{"name":"s"}"#).await;
        let settings = json!({"topic": "orders"});
        let a = meshd
            .create_subscription_answer("s", &settings)
            .await
            .unwrap();
        assert_eq!((a.status, a.text().as_str()), (201, r#"{"name":"s"}"#));
        let request = sent.recv().await.unwrap();
        let (line, headers, body) = parts(&request);
        assert_eq!(line, "PUT /v1/subscriptions/s HTTP/1.1");
        assert!(headers.contains("if-none-match: *"), "{headers}");
        assert_eq!(body, r#"{"topic":"orders"}"#);
        meshd.put_subscription_answer("s", &settings).await.unwrap();
        let request = sent.recv().await.unwrap();
        let (line, headers, _) = parts(&request);
        assert_eq!(line, "PUT /v1/subscriptions/s HTTP/1.1");
        assert!(!headers.contains("if-none-match"), "{headers}");

        let (meshd, _sent) = stand_in(
            "412 Precondition Failed",
            r#"{"type":"about:blank","title":"Precondition Failed","status":412,"detail":"exists"}"#,
        )
        .await;
        match meshd.create_subscription("s", &settings).await {
            Err(Error::Api(p)) => assert_eq!((p.status, p.detail.as_str()), (412, "exists")),
            other => panic!("{other:?}"),
        }
    }

    /// meshd stores each event's own text: `publish_texts` sends the operator's bytes
    /// (key order, number spelling, spaces) and nothing else, one batch.
    #[tokio::test]
    async fn published_texts_are_sent_as_written() {
        let placed = r#"{"events":[{"id":"a","partition":0,"offset":7},{"id":"b","partition":1,"offset":2,"duplicate":true}]}"#;
        let (meshd, mut sent) = stand_in("201 Created", placed).await;
        let events = [
            r#"{"type":"t", "specversion":"1.0","id":"a","source":"/s","data":1.50}"#,
            r#" {"id":"b","specversion":"1.0","source":"/s","type":"t"}"#,
        ];
        let stored = meshd.publish_texts("orders", &events).await.unwrap();
        let request = sent.recv().await.unwrap();
        let (line, headers, body) = parts(&request);
        assert_eq!(line, "POST /v1/topics/orders/events HTTP/1.1");
        assert!(
            headers.contains("content-type: application/cloudevents-batch+json"),
            "{headers}"
        );
        assert_eq!(body, format!("[{},{}]", events[0], events[1]));
        assert_eq!(
            stored,
            [
                Stored {
                    id: "a".into(),
                    partition: 0,
                    offset: 7,
                    duplicate: false
                },
                Stored {
                    id: "b".into(),
                    partition: 1,
                    offset: 2,
                    duplicate: true
                }
            ]
        );
        // `publish` sends the same batch for the same events as values.
        let values: Vec<Value> = events
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        meshd.publish("orders", &values).await.unwrap();
        let request = sent.recv().await.unwrap();
        let (_, _, body) = parts(&request);
        assert_eq!(body, Value::Array(values).to_string());
    }

    /// The answer twins of the data plane send what their typed methods send, and
    /// the typed methods read those answers.
    #[tokio::test]
    async fn each_data_plane_answer_method_sends_its_operation() {
        let (meshd, mut sent) = stand_in("200 OK", "{}").await;
        let mut next = || {
            let request = sent.try_recv().unwrap();
            let (line, _, body) = parts(&request);
            (line.to_string(), body.to_string())
        };
        let ids = ["d1".to_string(), "d 2".to_string()];
        meshd.ack_answer("s", &ids).await.unwrap();
        assert_eq!(
            next(),
            (
                "POST /v1/subscriptions/s/ack HTTP/1.1".into(),
                r#"{"delivery_ids":["d1","d 2"]}"#.into()
            )
        );
        meshd.nack_answer("s", &ids[..1], "bad").await.unwrap();
        assert_eq!(
            next(),
            (
                "POST /v1/subscriptions/s/nack HTTP/1.1".into(),
                r#"{"delivery_ids":["d1"],"reason":"bad"}"#.into()
            )
        );
        meshd
            .nack_delayed_answer("s", &ids[..1], "later", 500)
            .await
            .unwrap();
        assert_eq!(
            next(),
            (
                "POST /v1/subscriptions/s/nack HTTP/1.1".into(),
                r#"{"delay_ms":500,"delivery_ids":["d1"],"reason":"later"}"#.into()
            )
        );
        meshd.extend_answer("s", &ids[..1], 9000).await.unwrap();
        assert_eq!(
            next(),
            (
                "POST /v1/subscriptions/s/extend HTTP/1.1".into(),
                r#"{"ack_timeout_ms":9000,"delivery_ids":["d1"]}"#.into()
            )
        );
        meshd.offsets_answer("s/1").await.unwrap();
        assert_eq!(
            next(),
            (
                "GET /v1/subscriptions/s%2F1/offsets HTTP/1.1".into(),
                String::new()
            )
        );
        meshd.browse_answer("t", 2, 10, 1000).await.unwrap();
        assert_eq!(
            next(),
            (
                "GET /v1/topics/t/partitions/2/events?from=10&limit=1000 HTTP/1.1".into(),
                String::new()
            )
        );
        meshd.cluster_answer().await.unwrap();
        assert_eq!(next(), ("GET /v1/cluster HTTP/1.1".into(), String::new()));
        let settings = json!({"partitions": 2, "dedup_window_ms": 0});
        meshd.put_topic_answer("t", &settings).await.unwrap();
        assert_eq!(
            next(),
            (
                "PUT /v1/topics/t HTTP/1.1".into(),
                r#"{"dedup_window_ms":0,"partitions":2}"#.into()
            )
        );
        assert_eq!(meshd.put_topic("t", &settings).await.unwrap(), json!({}));
        next();
        meshd.open_session_answer("worker 1", 5000).await.unwrap();
        assert_eq!(
            next(),
            (
                "POST /v1/sessions HTTP/1.1".into(),
                r#"{"client_id":"worker 1","ttl_ms":5000}"#.into()
            )
        );
        meshd.heartbeat_answer("s/1").await.unwrap();
        assert_eq!(
            next(),
            (
                "POST /v1/sessions/s%2F1/heartbeat HTTP/1.1".into(),
                String::new()
            )
        );
        meshd.reset_offset_answer("s", 3, 0).await.unwrap();
        assert_eq!(
            next(),
            (
                "PUT /v1/subscriptions/s/offsets/3 HTTP/1.1".into(),
                r#"{"offset":0}"#.into()
            )
        );
        meshd.delete_subscription_answer("s").await.unwrap();
        assert_eq!(
            next(),
            ("DELETE /v1/subscriptions/s HTTP/1.1".into(), String::new())
        );
        meshd.redrive_answer("s/d1").await.unwrap();
        assert_eq!(
            next(),
            (
                "POST /v1/deadletters/s%2Fd1/redrive HTTP/1.1".into(),
                String::new()
            )
        );
        meshd.claim_task_answer("t", "s1").await.unwrap();
        assert_eq!(
            next(),
            (
                "POST /v1/tasks/t/claim HTTP/1.1".into(),
                r#"{"session":"s1"}"#.into()
            )
        );

        let outcome = r#"{"acked":["d1"],"unknown":[],"fenced":[],"failed":[]}"#;
        let (meshd, _sent) = stand_in("200 OK", outcome).await;
        let acked = meshd.ack("s", &ids[..1]).await.unwrap();
        assert_eq!(acked.acked, ["d1"]);
        let offsets = r#"{"offsets":[{"partition":1,"committed":7,"epoch":2}]}"#;
        let (meshd, _sent) = stand_in("200 OK", offsets).await;
        let o = meshd.offsets("s").await.unwrap();
        assert_eq!((o[0].partition, o[0].committed, o[0].epoch), (1, 7, 2));
    }

    /// Structured mode is its own content mode of a publish: the body is the event
    /// itself, not a batch of one, and the answer places that one event.
    #[tokio::test]
    async fn one_event_is_published_in_structured_mode() {
        let placed = r#"{"events":[{"id":"a","partition":1,"offset":4}]}"#;
        let (meshd, mut sent) = stand_in("201 Created", placed).await;
        let event = json!({"specversion": "1.0", "id": "a", "source": "/s", "type": "t"});
        let stored = meshd.publish_event("orders", &event).await.unwrap();
        assert_eq!(
            stored,
            Stored {
                id: "a".into(),
                partition: 1,
                offset: 4,
                duplicate: false
            }
        );
        let request = sent.recv().await.unwrap();
        let (line, headers, body) = parts(&request);
        assert_eq!(line, "POST /v1/topics/orders/events HTTP/1.1");
        assert!(
            headers.contains("content-type: application/cloudevents+json"),
            "{headers}"
        );
        assert_eq!(body, event.to_string());
        let a = meshd.publish_event_answer("orders", &event).await.unwrap();
        assert_eq!((a.status, a.text().as_str()), (201, placed));
        let a = meshd
            .publish_answer("orders", std::slice::from_ref(&event))
            .await
            .unwrap();
        assert_eq!(a.status, 201);
        sent.recv().await.unwrap();
        let request = sent.recv().await.unwrap();
        let (_, headers, body) = parts(&request);
        assert!(
            headers.contains("content-type: application/cloudevents-batch+json"),
            "{headers}"
        );
        assert_eq!(body, format!("[{event}]"));

        let two = r#"{"events":[{"id":"a","partition":0,"offset":1},{"id":"b","partition":0,"offset":2}]}"#;
        let (meshd, _sent) = stand_in("201 Created", two).await;
        match meshd.publish_event("orders", &event).await {
            Err(Error::Malformed(m)) => assert!(m.contains("2 placements"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    /// `with_timeout` bounds a long poll too: a pull asking meshd to wait 60 s on a
    /// server that never answers ends by the client's bound, not by 60 s + 30 s.
    #[tokio::test]
    async fn with_timeout_bounds_every_request_long_polls_included() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let held = tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((s, _)) = l.accept().await {
                open.push(s);
            }
        });
        let meshd = Client::connect(&url)
            .unwrap()
            .with_timeout(Duration::from_millis(300));
        let pull = Pull {
            wait_ms: Some(60_000),
            ..Pull::default()
        };
        let t0 = std::time::Instant::now();
        match meshd.pull("s", &pull).await {
            Err(Error::Lost(_)) => {}
            other => panic!("{other:?}"),
        }
        match meshd.topics().await {
            Err(Error::Lost(_)) => {}
            other => panic!("{other:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        held.abort();
    }

    #[test]
    fn an_answer_that_is_not_a_list_of_deliveries_is_malformed() {
        for body in [
            r#"{"deliveries":{}}"#.to_owned(),
            format!(r#"{{"deliveries":[{}]}}"#, delivery(0, "[[[")),
            r#"{"deliveries":[{"delivery_id":"d","partition":0,"offset":0,"attempt":1}]}"#
                .to_owned(),
        ] {
            match deliveries_of(&answer(body.clone())) {
                Err(Error::Malformed(_)) => {}
                other => panic!("{body}: {other:?}"),
            }
        }
    }
}
