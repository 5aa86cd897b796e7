//! The typed client of meshd's public API (`http-api.md`): one method per operation,
//! typed answers for the data plane, the contract's JSON for the resources an operator
//! reads. Non-2xx answers are [`Error::Api`] with the problem; nothing is retried except
//! where the contract makes a retry safe ([`Client::publish`] after a lost answer or a
//! 504, which relies on the topic's dedup window).

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
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_events: Option<u32>,
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

    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Sends `req` (its path under the target's prefix) and returns the answer, whatever
    /// its status.
    pub async fn send(&self, mut req: Request) -> Result<Response, Error> {
        req.path = format!("{}{}", self.target.prefix(), req.path);
        self.transport.send(&self.target, req).await
    }

    /// Sends `req`; a non-2xx answer is [`Error::Api`].
    pub async fn ok(&self, req: Request) -> Result<Response, Error> {
        self.send(req).await?.success()
    }

    async fn get_json<T: serde::de::DeserializeOwned>(&self, path: String) -> Result<T, Error> {
        self.ok(Request::get(path)).await?.json()
    }

    async fn post_json<T: serde::de::DeserializeOwned>(
        &self,
        path: String,
        body: &Value,
    ) -> Result<T, Error> {
        self.ok(Request::post(path).json(body)).await?.json()
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
        self.get_json(paths::CLUSTER.into()).await
    }

    // Topics and events.

    /// `PUT /v1/topics/{topic}`: `true` when created, `false` when it existed alike.
    pub async fn create_topic(&self, topic: &str, partitions: u32) -> Result<bool, Error> {
        let a = self
            .ok(Request::new(Method::PUT, paths::topic(topic))
                .json(&json!({ "partitions": partitions })))
            .await?;
        Ok(a.status == 201)
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
        Ok(self.get_json::<List>(paths::TOPICS.into()).await?.topics)
    }

    pub async fn topic(&self, topic: &str) -> Result<Topic, Error> {
        self.get_json(paths::topic(topic)).await
    }

    /// Publishes structured-mode CloudEvents as one batch; answered once every event is
    /// durable. A request whose outcome is unknown (connection lost, 504) is sent again
    /// up to [`Client::with_publish_retries`] times (within the topic's dedup window
    /// each event is then stored once).
    pub async fn publish(&self, topic: &str, events: &[Value]) -> Result<Vec<Stored>, Error> {
        #[derive(Deserialize)]
        struct Answer {
            events: Vec<Stored>,
        }
        let body = Value::Array(events.to_vec()).to_string();
        let path = paths::events(topic);
        let mut tries = 0;
        loop {
            let req = Request::post(path.clone())
                .body("application/cloudevents-batch+json", body.clone());
            match self.ok(req).await {
                Ok(a) => return Ok(a.json::<Answer>()?.events),
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
        let q = query(&[
            ("from", Some(from.to_string())),
            ("limit", Some(limit.to_string())),
        ]);
        self.get_json(format!("{}{q}", paths::partition_events(topic, partition)))
            .await
    }

    // Subscriptions.

    /// `PUT /v1/subscriptions/{name}` with the contract's settings object; the answer
    /// is the subscription as stored.
    pub async fn put_subscription(&self, name: &str, settings: &Value) -> Result<Value, Error> {
        self.ok(Request::new(Method::PUT, paths::subscription(name)).json(settings))
            .await?
            .json()
    }

    pub async fn subscription(&self, name: &str) -> Result<Value, Error> {
        self.get_json(paths::subscription(name)).await
    }

    pub async fn subscriptions(&self) -> Result<Vec<Value>, Error> {
        let v: Value = self.get_json(paths::SUBSCRIPTIONS.into()).await?;
        Ok(v.get("subscriptions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default())
    }

    pub async fn delete_subscription(&self, name: &str) -> Result<(), Error> {
        self.ok(Request::new(Method::DELETE, paths::subscription(name)))
            .await
            .map(drop)
    }

    pub async fn offsets(&self, name: &str) -> Result<Vec<Offset>, Error> {
        #[derive(Deserialize)]
        struct List {
            offsets: Vec<Offset>,
        }
        Ok(self
            .get_json::<List>(paths::subscription_action(name, "offsets"))
            .await?
            .offsets)
    }

    /// Resets the committed offset of one partition (may move backwards).
    pub async fn reset_offset(
        &self,
        name: &str,
        partition: u32,
        offset: u64,
    ) -> Result<Value, Error> {
        self.ok(Request::new(Method::PUT, paths::offset(name, partition))
            .json(&json!({ "offset": offset })))
            .await?
            .json()
    }

    // Consuming.

    /// Leases up to `max_events` deliveries, waiting up to `wait_ms` for the first.
    pub async fn pull(&self, name: &str, pull: &Pull) -> Result<Vec<Delivery>, Error> {
        let wait = Duration::from_millis(pull.wait_ms.unwrap_or(0));
        let body = serde_json::to_value(pull).map_err(|e| Error::Invalid(e.to_string()))?;
        let req = Request::post(paths::subscription_action(name, "pull"))
            .json(&body)
            .timeout(wait + ANSWER_SLACK);
        deliveries_of(&self.ok(req).await?)
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
            .timeout(ANSWER_SLACK);
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
        self.get_json(paths::subscription_action(name, "stats"))
            .await
    }

    pub async fn ack(&self, name: &str, ids: &[String]) -> Result<Acked, Error> {
        self.post_json(
            paths::subscription_action(name, "ack"),
            &json!({ "delivery_ids": ids }),
        )
        .await
    }

    pub async fn nack(&self, name: &str, ids: &[String], reason: &str) -> Result<Nacked, Error> {
        self.post_json(
            paths::subscription_action(name, "nack"),
            &json!({ "delivery_ids": ids, "reason": reason }),
        )
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
        self.post_json(
            paths::subscription_action(name, "nack"),
            &json!({ "delivery_ids": ids, "reason": reason, "delay_ms": delay_ms }),
        )
        .await
    }

    pub async fn extend(
        &self,
        name: &str,
        ids: &[String],
        ack_timeout_ms: u64,
    ) -> Result<Extended, Error> {
        self.post_json(
            paths::subscription_action(name, "extend"),
            &json!({ "delivery_ids": ids, "ack_timeout_ms": ack_timeout_ms }),
        )
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
        let q = query(&[
            ("subscription", subscription.map(str::to_string)),
            ("limit", limit.map(|l| l.to_string())),
            ("cursor", cursor.map(str::to_string)),
        ]);
        self.get_json(format!("{}{q}", paths::DEAD_LETTERS)).await
    }

    pub async fn dead_letter(&self, id: &str) -> Result<Value, Error> {
        self.get_json(paths::dead_letter(id)).await
    }

    pub async fn redrive(&self, id: &str) -> Result<(), Error> {
        self.ok(Request::post(paths::redrive(id))).await.map(drop)
    }

    pub async fn delete_dead_letter(&self, id: &str) -> Result<(), Error> {
        self.ok(Request::new(Method::DELETE, paths::dead_letter(id)))
            .await
            .map(drop)
    }

    // Sessions.

    pub async fn open_session(&self, client_id: &str, ttl_ms: u64) -> Result<Session, Error> {
        self.post_json(
            paths::SESSIONS.into(),
            &json!({ "client_id": client_id, "ttl_ms": ttl_ms }),
        )
        .await
    }

    pub async fn heartbeat(&self, session: &str) -> Result<Value, Error> {
        self.ok(Request::post(paths::heartbeat(session)))
            .await?
            .json()
    }

    pub async fn sessions(&self) -> Result<Value, Error> {
        self.get_json(paths::SESSIONS.into()).await
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
        let mut body = json!({ "agent": agent, "input": input });
        if let Some(id) = id {
            body["id"] = json!(id);
        }
        self.post_json(paths::TASKS.into(), &body).await
    }

    pub async fn task(&self, id: &str) -> Result<Value, Error> {
        self.get_json(paths::task(id)).await
    }

    pub async fn tasks(&self, agent: Option<&str>, state: Option<&str>) -> Result<Value, Error> {
        let q = query(&[
            ("agent", agent.map(str::to_string)),
            ("state", state.map(str::to_string)),
        ]);
        self.get_json(format!("{}{q}", paths::TASKS)).await
    }

    pub async fn claim_task(&self, id: &str, session: &str) -> Result<Value, Error> {
        self.post_json(
            paths::task_action(id, "claim"),
            &json!({ "session": session }),
        )
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
        self.ok(Request::post(paths::task_action(id, "cancel")))
            .await?
            .json()
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
