//! `meshd topic ...` and `meshd publish`.
//!
//! Publishing streams: stdin is read line by line and sent in batches
//! (`application/cloudevents-batch+json`), each one atomic and durable on the server
//! before its 201. So when something fails part-way, the events before the failing
//! batch are stored and none of the failing batch is; the message says which input
//! lines that was, so an operator can resume with `tail -n +LINE`.

use super::args::{PublishArgs, TopicCmd};
use super::ctx::Ctx;
use super::error::CliError;
use super::output::{cell, cells, list, note, Table};
use meshd_client::Stored;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::{BufRead, IsTerminal};

/// Body budget of one batch, well under the server's 8 MiB request cap (one event may
/// be up to 1 MiB, so a batch of large events is cut by bytes before it hits the cap).
const MAX_BATCH_BYTES: usize = 4 * 1024 * 1024;
/// Progress on stderr every this many events.
const PROGRESS_EVERY: u64 = 1000;
/// How often a batch whose outcome is unknown is sent again (publish dedup makes it
/// safe; pauses of 0.2, 0.4, ... 3.2 s).
const PUBLISH_RETRIES: u32 = 5;
/// Up to this many published events are listed one per row; more are summarised per
/// partition.
const MAX_ROWS: usize = 1000;

pub fn topic(ctx: &Ctx, cmd: TopicCmd) -> Result<(), CliError> {
    match cmd {
        TopicCmd::Create { name, partitions } => {
            let a = ctx
                .client
                .call(|c| c.create_topic_answer(&name, partitions))?;
            ctx.out.answer(&a, |v| {
                let verb = if a.status == 201 {
                    "created"
                } else {
                    "already exists,"
                };
                ctx.out.line(&format!(
                    "topic {} {verb} with {} partitions",
                    cell(v, &["name"]),
                    cell(v, &["partitions"])
                ))
            })
        }
        TopicCmd::List => {
            let a = ctx.client.call(|c| c.topics_answer())?;
            ctx.out.answer(&a, |v| {
                Table::of(&["NAME", "PARTITIONS"], list(v, "topics")?, |t| {
                    cells(t, &["name", "partitions"])
                })
                .print(&ctx.out, "no topics")
            })
        }
        TopicCmd::Get { name } => {
            let a = ctx.client.call(|c| c.topic_answer(&name))?;
            ctx.out.answer(&a, |v| {
                let ends = list(v, "end_offsets")?;
                ctx.out.line(&format!(
                    "topic {}: {} partitions",
                    cell(v, &["name"]),
                    cell(v, &["partitions"])
                ))?;
                Table::of(
                    &["PARTITION", "END_OFFSET"],
                    ends.iter().enumerate(),
                    |(p, end)| vec![p.to_string(), end.to_string()],
                )
                .print(&ctx.out, "no partitions")
            })
        }
        TopicCmd::Delete { name } => {
            ctx.client.call(|c| c.delete_topic(&name))?;
            ctx.out.done(&format!("deleted topic {name}"))
        }
    }
}

/// Checks that `text` is one JSON object; the server checks that it is a CloudEvent.
fn check_event(text: &str) -> Result<(), String> {
    serde_json::from_str::<serde::de::IgnoredAny>(text).map_err(|e| format!("not JSON: {e}"))?;
    if !text.trim_start().starts_with('{') {
        return Err("not a JSON object (one CloudEvent per argument or line)".into());
    }
    Ok(())
}

/// The CloudEvent `meshd publish TOPIC --type T [--data JSON] [--source S] [--id I]`
/// sends: `id` generated unless given, `source` `meshd-cli` unless given, and `data`
/// (JSON, so `datacontenttype` is `application/json`) when given.
fn built_event(
    event_type: &str,
    data: Option<&str>,
    source: Option<String>,
    id: Option<String>,
) -> Result<String, CliError> {
    let mut event = serde_json::json!({
        "specversion": "1.0",
        "id": id.unwrap_or_else(|| format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>())),
        "source": source.unwrap_or_else(|| "meshd-cli".to_string()),
        "type": event_type,
    });
    if let Some(data) = data {
        let data: Value = serde_json::from_str(data).map_err(|e| {
            CliError::Usage(format!(
                "--data is JSON ({e}); quote text as a JSON string: --data '\"hello\"'"
            ))
        })?;
        event["datacontenttype"] = "application/json".into();
        event["data"] = data;
    }
    Ok(event.to_string())
}

/// Batches events and sends them.
struct Publisher<'a> {
    ctx: &'a Ctx,
    topic: &'a str,
    batch_size: usize,
    /// The events of the batch being filled, as the operator wrote them (the server
    /// stores each event's own text, so it is sent unchanged).
    batch: Vec<String>,
    /// Where each event of the batch came from ("stdin line 7"), for error messages.
    origins: Vec<String>,
    batch_bytes: usize,
    /// Where every event published so far was stored.
    placed: Vec<Stored>,
    next_progress: u64,
}

impl<'a> Publisher<'a> {
    fn new(ctx: &'a Ctx, topic: &'a str, batch_size: usize) -> Self {
        Self {
            ctx,
            topic,
            batch_size,
            batch: Vec::new(),
            origins: Vec::new(),
            batch_bytes: 0,
            placed: Vec::new(),
            next_progress: PROGRESS_EVERY,
        }
    }

    fn add(&mut self, event: String, origin: String) -> Result<(), CliError> {
        if !self.batch.is_empty() && self.batch_bytes + event.len() + 1 > MAX_BATCH_BYTES {
            self.flush()?;
        }
        self.batch_bytes += event.len() + 1;
        self.batch.push(event);
        self.origins.push(origin);
        if self.batch.len() >= self.batch_size {
            self.flush()?;
        }
        Ok(())
    }

    /// What is stored so far, for messages about a failure.
    fn so_far(&self) -> String {
        match self.placed.len() {
            0 => "no events were published".to_string(),
            1 => "the 1 event before it was published".to_string(),
            n => format!("the {n} events before it were published"),
        }
    }

    fn flush(&mut self) -> Result<(), CliError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let range = match (self.origins.first(), self.origins.last()) {
            (Some(a), Some(b)) if a != b => format!("{a} to {b}"),
            (Some(a), _) => a.clone(),
            _ => String::new(),
        };
        // A batch whose outcome is unknown (a 504, a lost or refused connection) is
        // sent again: within the topic's dedup window each event is stored once.
        let mut tries = 0u32;
        let placed = loop {
            let unknown = match self
                .ctx
                .client
                .call(|c| c.publish_texts(self.topic, &self.batch))
            {
                Ok(placed) => break placed,
                Err(CliError::Api(p)) if p.status == 504 => format!("answered 504: {}", p.detail),
                Err(CliError::Api(p)) => return Err(self.refused(p, &range)),
                Err(CliError::Unreachable(m)) => m,
                Err(e) => return Err(e),
            };
            if tries >= PUBLISH_RETRIES {
                return Err(CliError::Unreachable(format!(
                    "{unknown} (after {PUBLISH_RETRIES} retries)\n{}; the batch of {range} may or may not have been",
                    self.so_far()
                )));
            }
            tries += 1;
            note(&format!(
                "the batch of {range} {unknown}; sending it again ({tries} of {PUBLISH_RETRIES})"
            ));
            std::thread::sleep(std::time::Duration::from_millis(100 << tries.min(5)));
        };
        if placed.len() != self.batch.len() {
            return Err(CliError::Failed(format!(
                "sent {} events but the server placed {}",
                self.batch.len(),
                placed.len()
            )));
        }
        self.placed.extend(placed);
        self.batch.clear();
        self.origins.clear();
        self.batch_bytes = 0;
        let n = self.placed.len() as u64;
        if n >= self.next_progress {
            note(&format!("published {n} events"));
            self.next_progress = (n / PROGRESS_EVERY + 1) * PROGRESS_EVERY;
        }
        Ok(())
    }

    /// The batch of `range` was refused: the problem, saying which input an event it
    /// names came from and what was published before.
    fn refused(&self, mut p: super::error::Problem, range: &str) -> CliError {
        // `events[3].source` names an event of this batch: say where it came from.
        if let Some(i) = p
            .field
            .as_deref()
            .and_then(|f| f.strip_prefix("events["))
            .and_then(|f| f.split(']').next())
            .and_then(|i| i.parse::<usize>().ok())
        {
            if let Some(origin) = self.origins.get(i) {
                p.detail = format!("{} (the event from {origin})", p.detail);
            }
        }
        p.context = Some(format!(
            "{}; none of the batch of {range} was",
            self.so_far()
        ));
        CliError::Api(p)
    }

    fn finish(mut self) -> Result<(), CliError> {
        self.flush()?;
        let out = &self.ctx.out;
        if out.json {
            return out.assembled(&json!({ "events": self.placed }));
        }
        if self.placed.len() <= MAX_ROWS {
            return Table::of(&["ID", "PARTITION", "OFFSET"], &self.placed, |e| {
                vec![e.id.clone(), e.partition.to_string(), e.offset.to_string()]
            })
            .print(out, "no events to publish");
        }
        // partition -> (events, lowest offset, highest offset)
        let mut per: BTreeMap<u32, (u64, u64, u64)> = BTreeMap::new();
        for e in &self.placed {
            let o = e.offset;
            let s = per.entry(e.partition).or_insert((0, o, o));
            s.0 += 1;
            s.1 = s.1.min(o);
            s.2 = s.2.max(o);
        }
        out.line(&format!(
            "published {} events to {}",
            self.placed.len(),
            self.topic
        ))?;
        let heads = ["PARTITION", "EVENTS", "FIRST_OFFSET", "LAST_OFFSET"];
        Table::of(&heads, per, |(p, (n, lo, hi))| {
            vec![p.to_string(), n.to_string(), lo.to_string(), hi.to_string()]
        })
        .print(out, "")
    }
}

pub fn publish(ctx: &Ctx, a: PublishArgs) -> Result<(), CliError> {
    let mut p = Publisher::new(ctx, &a.topic, a.batch_size as usize);
    if let Some(event_type) = &a.event_type {
        let event = built_event(event_type, a.data.as_deref(), a.source, a.id)?;
        p.add(event, "the event of --type".into())?;
        return p.finish();
    }
    if !a.events.is_empty() {
        // Arguments are all checked before anything is sent.
        for (i, e) in a.events.iter().enumerate() {
            check_event(e).map_err(|why| CliError::Usage(format!("argument {}: {why}", i + 1)))?;
        }
        for (i, e) in a.events.iter().enumerate() {
            p.add(e.clone(), format!("argument {}", i + 1))?;
        }
        return p.finish();
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        note("reading events from stdin, one JSON object per line; end with Ctrl-D");
    }
    for (n, line) in stdin.lock().lines().enumerate() {
        let line_no = n + 1;
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                // Send what came before, so "everything before line N" holds.
                p.flush()?;
                let why = if e.kind() == std::io::ErrorKind::InvalidData {
                    "not UTF-8".to_string()
                } else {
                    format!("cannot read: {e}")
                };
                return Err(CliError::Usage(format!(
                    "stdin line {line_no}: {why}; {}",
                    p.so_far()
                )));
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        if let Err(why) = check_event(&line) {
            p.flush()?;
            return Err(CliError::Usage(format!(
                "stdin line {line_no}: {why}; {}",
                p.so_far()
            )));
        }
        p.add(line, format!("stdin line {line_no}"))?;
    }
    p.finish()
}
