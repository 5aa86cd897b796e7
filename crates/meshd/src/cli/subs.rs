//! `meshd sub ...` and `meshd pull`.

use super::args::{OrderingArg, PullArgs, Start, SubCmd, SubCreate, TailArgs};
use super::ctx::Ctx;
use super::error::CliError;
use super::output::{cell, cells, list, note, Table};
use meshd_client::shorten;
use serde_json::{json, Map, Value};

/// The columns of a subscription's row (see [`row_of`]).
const SUBSCRIPTION: [&str; 8] = [
    "NAME",
    "TOPIC",
    "START",
    "MAX_ATTEMPTS",
    "ACK_TIMEOUT_MS",
    "FILTER",
    "PUSH",
    "REVISION",
];

/// The columns of `sub stats`, each with the field of a partition's figures it shows.
const STATS: [(&str, &str); 14] = [
    ("PARTITION", "partition"),
    ("COMMITTED", "committed"),
    ("END", "end_offset"),
    ("BACKLOG", "backlog"),
    ("IN_FLIGHT", "in_flight"),
    ("WAITING", "waiting_retries"),
    ("PARKED", "parked"),
    ("DEAD_LETTERING", "dead_lettering"),
    ("DELIVERED", "delivered_total"),
    ("REDELIVERED", "redelivered_total"),
    ("ACKED", "acked_total"),
    ("NACKED", "nacked_total"),
    ("DEAD_LETTERED", "dead_lettered_total"),
    ("OWNER", "owner"),
];

pub fn sub(ctx: &Ctx, cmd: SubCmd) -> Result<(), CliError> {
    match cmd {
        SubCmd::Create(c) => create(ctx, *c),
        SubCmd::List => {
            let a = ctx.client.call(|c| c.subscriptions_answer())?;
            ctx.out.answer(&a, |v| {
                Table::of(&SUBSCRIPTION, list(v, "subscriptions")?, row_of)
                    .print(&ctx.out, "no subscriptions")
            })
        }
        SubCmd::Get { name } => {
            let a = ctx.client.call(|c| c.subscription_answer(&name))?;
            ctx.out.answer(&a, |s| {
                let offsets = ctx.client.call(|c| c.offsets(&name))?;
                Table::of(&SUBSCRIPTION, [s], row_of).print(&ctx.out, "")?;
                ctx.out.line("")?;
                Table::of(&["PARTITION", "COMMITTED", "EPOCH"], &offsets, |o| {
                    vec![
                        o.partition.to_string(),
                        o.committed.to_string(),
                        o.epoch.to_string(),
                    ]
                })
                .print(&ctx.out, "no committed offsets yet")
            })
        }
        SubCmd::Stats { name } => stats(ctx, &name),
        SubCmd::Delete { name } => {
            ctx.client.call(|c| c.delete_subscription(&name))?;
            ctx.out.done(&format!("deleted subscription {name}"))
        }
    }
}

/// An event's data as shown: text as is, JSON compact, `data_base64` as sent.
fn data_of(e: &Value) -> String {
    match e.get("data").or_else(|| e.get("data_base64")) {
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
        None => "-".into(),
    }
}

/// A delivery's event for the table cells, and its data column; an event this CLI
/// cannot decode has no cells (`-`) and says so in the data column.
fn event_and_data(d: &meshd_client::Delivery) -> (Value, String) {
    match &d.event {
        Ok(e) => (e.clone(), data_of(e)),
        Err(u) => (Value::Null, format!("(undecodable event: {})", u.reason)),
    }
}

fn row_of(s: &Value) -> Vec<String> {
    let filter = match s.get("filter") {
        Some(Value::Object(f)) if !f.is_empty() => f
            .iter()
            .map(|(k, v)| {
                format!(
                    "{k}={}",
                    v.as_str().map_or_else(|| v.to_string(), str::to_string)
                )
            })
            .collect::<Vec<_>>()
            .join(","),
        _ => "-".into(),
    };
    let filter = match (s.get("filters"), filter.as_str()) {
        (Some(f), "-") => f.to_string(),
        (Some(f), shorthand) => format!("{shorthand} {f}"),
        (None, _) => filter,
    };
    let push = s
        .get("push")
        .map_or_else(|| "-".to_string(), |p| cell(p, &["url"]));
    vec![
        cell(s, &["name"]),
        cell(s, &["topic"]),
        cell(s, &["start"]),
        cell(s, &["max_attempts"]),
        cell(s, &["ack_timeout_ms"]),
        shorten(&filter, 60),
        shorten(&push, 60),
        cell(s, &["revision"]),
    ]
}

fn create(ctx: &Ctx, c: SubCreate) -> Result<(), CliError> {
    let mut body = Map::new();
    body.insert("topic".into(), json!(c.topic));
    if let Some(n) = c.max_attempts {
        body.insert("max_attempts".into(), json!(n));
    }
    if let Some(n) = c.ack_timeout_ms {
        body.insert("ack_timeout_ms".into(), json!(n));
    }
    if let Some(s) = c.start {
        let s = match s {
            Start::Earliest => "earliest",
            Start::Latest => "latest",
        };
        body.insert("start".into(), json!(s));
    }
    if let Some(o) = c.ordering {
        let o = match o {
            OrderingArg::None => "none",
            OrderingArg::Key => "key",
        };
        body.insert("ordering".into(), json!(o));
    }
    if c.filter_type.is_some() || c.filter_source.is_some() {
        let mut f = Map::new();
        if let Some(t) = c.filter_type {
            f.insert("type".into(), json!(t));
        }
        if let Some(s) = c.filter_source {
            f.insert("source".into(), json!(s));
        }
        body.insert("filter".into(), Value::Object(f));
    }
    if let Some(text) = c.filters {
        let filters: Value = serde_json::from_str(&text)
            .map_err(|e| CliError::Usage(format!("--filters is not JSON: {e}")))?;
        body.insert("filters".into(), filters);
    }
    if c.backoff_initial_ms.is_some() || c.backoff_max_ms.is_some() {
        let mut b = Map::new();
        if let Some(n) = c.backoff_initial_ms {
            b.insert("initial_ms".into(), json!(n));
        }
        if let Some(n) = c.backoff_max_ms {
            b.insert("max_ms".into(), json!(n));
        }
        body.insert("backoff".into(), Value::Object(b));
    }
    if let Some(u) = c.push_url {
        let mut push = Map::new();
        push.insert("url".into(), json!(u));
        if !c.push_secrets.is_empty() {
            push.insert("secrets".into(), json!(c.push_secrets));
        }
        if !c.push_headers.is_empty() {
            let mut headers = Map::new();
            for h in &c.push_headers {
                let (k, v) = h.split_once('=').ok_or_else(|| {
                    CliError::Usage(format!("--push-header {h:?} is not NAME=VALUE"))
                })?;
                headers.insert(k.to_string(), json!(v));
            }
            push.insert("headers".into(), Value::Object(headers));
        }
        if let Some(n) = c.push_max_concurrency {
            push.insert("max_concurrency".into(), json!(n));
        }
        if let Some(r) = c.push_rate_per_s {
            push.insert("rate_per_s".into(), json!(r));
        }
        body.insert("push".into(), Value::Object(push));
    } else if !c.push_secrets.is_empty()
        || !c.push_headers.is_empty()
        || c.push_max_concurrency.is_some()
        || c.push_rate_per_s.is_some()
    {
        return Err(CliError::Usage(
            "--push-secret, --push-header, --push-max-concurrency and --push-rate-per-s need \
             --push-url"
                .into(),
        ));
    }
    let settings = Value::Object(body);
    let a = if c.upsert {
        ctx.client
            .call(|api| api.put_subscription_answer(&c.name, &settings))
    } else {
        // Create-only: an existing subscription is never changed by accident.
        ctx.client
            .call(|api| api.create_subscription_answer(&c.name, &settings))
    };
    let a = match a {
        Err(CliError::Api(mut p)) if p.status == 412 && !c.upsert => {
            p.detail = format!(
                "subscription {} already exists (update it with --upsert, or delete it first)",
                c.name
            );
            return Err(CliError::Api(p));
        }
        a => a?,
    };
    ctx.out.answer(&a, |v| {
        let verb = if a.status == 201 {
            "created"
        } else {
            "updated"
        };
        ctx.out.line(&format!(
            "subscription {} {verb} on topic {} (revision {})",
            cell(v, &["name"]),
            cell(v, &["topic"]),
            cell(v, &["revision"])
        ))
    })
}

pub fn pull(ctx: &Ctx, a: PullArgs) -> Result<(), CliError> {
    let pull = meshd_client::Pull {
        max_events: a.max,
        wait_ms: a.wait_ms,
        ..meshd_client::Pull::default()
    };
    let answer = ctx.client.call(|c| c.pull_answer(&a.subscription, &pull))?;
    // Each event is decoded on its own: one this CLI cannot read is shown as such and
    // does not hide (or leave unacked) the others.
    let deliveries = meshd_client::deliveries_of(&answer)?;
    // With --json the pull answer is printed exactly as it came, before acking, so the
    // events are shown even if the ack then fails.
    if ctx.out.json {
        ctx.out.raw(&answer.body)?;
    } else {
        let heads = [
            "PARTITION",
            "OFFSET",
            "ATTEMPT",
            "ID",
            "TYPE",
            "SOURCE",
            "DATA",
            "DELIVERY_ID",
        ];
        Table::of(&heads, &deliveries, |d| {
            let (e, data) = event_and_data(d);
            vec![
                d.partition.to_string(),
                d.offset.to_string(),
                d.attempt.to_string(),
                cell(&e, &["id"]),
                cell(&e, &["type"]),
                cell(&e, &["source"]),
                shorten(&data, 60),
                d.delivery_id.clone(),
            ]
        })
        .print(&ctx.out, "no deliveries")?;
    }
    let undecodable = deliveries.iter().filter(|d| d.event.is_err()).count();
    if undecodable > 0 {
        note(&format!(
            "{undecodable} of {} deliveries carry an event this CLI cannot decode (see DATA; --json prints them as sent)",
            deliveries.len()
        ));
    }
    if !a.ack || deliveries.is_empty() {
        return Ok(());
    }
    let ids: Vec<String> = deliveries.iter().map(|d| d.delivery_id.clone()).collect();
    let acked = ctx.client.call(|c| c.ack(&a.subscription, &ids))?;
    let not_acked: Vec<String> = [
        ("unknown", &acked.unknown),
        ("fenced", &acked.fenced),
        ("failed", &acked.failed),
    ]
    .iter()
    .filter(|(_, ids)| !ids.is_empty())
    .map(|(k, ids)| format!("{} {k}", ids.len()))
    .collect();
    if !not_acked.is_empty() {
        return Err(CliError::Failed(format!(
            "acked {} of {} deliveries; {} (those will be delivered again)",
            acked.acked.len(),
            ids.len(),
            not_acked.join(", ")
        )));
    }
    note(&format!("acked {} deliveries", acked.acked.len()));
    Ok(())
}

/// `meshd sub stats NAME`.
fn stats(ctx: &Ctx, name: &str) -> Result<(), CliError> {
    let a = ctx.client.call(|c| c.stats_answer(name))?;
    ctx.out.answer(&a, |v| {
        let keys = STATS.map(|(_, k)| k);
        let mut unavailable = Vec::new();
        Table::of(&STATS.map(|(h, _)| h), list(v, "partitions")?, |p| {
            if p.get("available") == Some(&Value::Bool(false)) {
                unavailable.push(format!(
                    "partition {}: {}",
                    cell(p, &["partition"]),
                    cell(p, &["detail"])
                ));
                let mut row = vec![cell(p, &["partition"])];
                row.resize(keys.len(), "?".to_string());
                return row;
            }
            cells(p, &keys)
        })
        .print(&ctx.out, "no partitions")?;
        for u in &unavailable {
            note(&format!("unavailable: {u}"));
        }
        Ok(())
    })
}

/// `meshd tail SUBSCRIPTION [--ack]`: one line per delivery (the delivery's JSON
/// with --json), acked once printed with --ack.
pub fn tail(ctx: &Ctx, a: TailArgs) -> Result<(), CliError> {
    let options = meshd_client::StreamOptions {
        max_in_flight: a.max_in_flight,
        session: None,
    };
    ctx.client.run(|api| async move {
        let mut stream = api.stream(&a.subscription, &options).await?;
        let mut seen = 0u64;
        while a.count.is_none_or(|n| seen < n) {
            let Some(d) = stream.next().await? else {
                note("the stream ended (meshd is stopping)");
                return Ok(());
            };
            seen += 1;
            if ctx.out.json {
                // As text: an undecodable event is written as meshd sent it.
                let line = serde_json::to_string(&d)
                    .map_err(|e| CliError::Failed(format!("cannot print a delivery: {e}")))?;
                ctx.out.line(&line)?;
            } else {
                let (e, data) = event_and_data(&d);
                ctx.out.line(&format!(
                    "{}:{} attempt {} {} {} {} {}",
                    d.partition,
                    d.offset,
                    d.attempt,
                    cell(&e, &["id"]),
                    cell(&e, &["type"]),
                    cell(&e, &["source"]),
                    shorten(&data, 120)
                ))?;
            }
            if a.ack {
                let acked = api.ack(&a.subscription, std::slice::from_ref(&d.delivery_id)).await?;
                if acked.acked.is_empty() {
                    note(&format!(
                        "delivery {}:{} was not acked (unknown, fenced or failed); it will be delivered again",
                        d.partition, d.offset
                    ));
                }
            }
        }
        Ok(())
    })
}
