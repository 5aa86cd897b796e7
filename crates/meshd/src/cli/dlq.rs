//! `meshd dlq ...`: dead letters. Redrive and delete take many ids (or `-` to read
//! them from stdin, one per line), keep going past a failed id, report progress on
//! stderr for long runs, and exit 1 if any id failed.

use super::args::DlqCmd;
use super::ctx::Ctx;
use super::error::{CliError, Problem};
use super::output::{cell, cells, note, Table};
use meshd_client::shorten;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use std::io::BufRead;

/// Progress on stderr every this many ids.
const PROGRESS_EVERY: usize = 100;

#[derive(Deserialize)]
struct Page {
    entries: Vec<Box<RawValue>>,
    next_cursor: Option<String>,
}

pub fn dlq(ctx: &Ctx, cmd: DlqCmd) -> Result<(), CliError> {
    match cmd {
        DlqCmd::List {
            subscription,
            limit,
            cursor,
            all,
        } => list_entries(ctx, subscription, limit, cursor, all),
        DlqCmd::Show { id } => {
            let a = ctx.client.call(|c| c.dead_letter_answer(&id))?;
            ctx.out.answer(&a, |v| {
                let fields = [
                    "id",
                    "subscription",
                    "topic",
                    "partition",
                    "offset",
                    "state",
                    "attempts",
                    "redrives",
                    "reason",
                    "first_attempt_at",
                    "dead_lettered_at",
                ];
                Table::fields(v, &fields).print(&ctx.out, "")?;
                let event = v.get("event").cloned().unwrap_or(Value::Null);
                let pretty =
                    serde_json::to_string_pretty(&event).unwrap_or_else(|_| event.to_string());
                ctx.out.line(&format!("event:\n{pretty}"))
            })
        }
        DlqCmd::Redrive { ids } => each_id(ctx, ids, Action::Redrive),
        DlqCmd::Delete { ids } => each_id(ctx, ids, Action::Delete),
    }
}

/// What `dlq redrive` and `dlq delete` do to each id.
#[derive(Clone, Copy)]
enum Action {
    Redrive,
    Delete,
}

impl Action {
    fn verb(self) -> &'static str {
        match self {
            Action::Redrive => "redrive",
            Action::Delete => "delete",
        }
    }

    /// An id's result when it worked.
    fn done(self) -> &'static str {
        match self {
            Action::Redrive => "redriving",
            Action::Delete => "deleted",
        }
    }

    async fn on(self, api: &meshd_client::Client, id: &str) -> Result<(), meshd_client::Error> {
        match self {
            Action::Redrive => api.redrive(id).await,
            Action::Delete => api.delete_dead_letter(id).await,
        }
    }
}

fn list_entries(
    ctx: &Ctx,
    subscription: Option<String>,
    limit: Option<u32>,
    mut cursor: Option<String>,
    all: bool,
) -> Result<(), CliError> {
    let mut entries: Vec<Box<RawValue>> = Vec::new();
    let next = loop {
        let a = ctx
            .client
            .call(|c| c.dead_letters_answer(subscription.as_deref(), limit, cursor.as_deref()))?;
        if ctx.out.json && !all {
            return ctx.out.raw(&a.body);
        }
        let page: Page = serde_json::from_slice(&a.body).map_err(|e| {
            CliError::Failed(format!(
                "the dead-letter list is not what the contract says ({e}): {}",
                shorten(&a.text(), 200)
            ))
        })?;
        entries.extend(page.entries);
        match page.next_cursor {
            Some(c) if all => cursor = Some(c),
            other => break other,
        }
    };
    if ctx.out.json {
        // Several pages merged into one answer of the same shape, each entry (with its
        // event) exactly as the server sent it.
        let joined: Vec<&str> = entries.iter().map(|e| e.get()).collect();
        return ctx
            .out
            .line(&format!("{{\"entries\":[{}]}}", joined.join(",")));
    }
    let heads = [
        "ID",
        "SUBSCRIPTION",
        "TOPIC",
        "PARTITION",
        "OFFSET",
        "ATTEMPTS",
        "STATE",
        "DEAD_LETTERED_AT",
        "REASON",
    ];
    Table::of(&heads, &entries, |raw| {
        // An entry this CLI cannot decode (an event nested too deep) shows as `-`.
        let e: Value = serde_json::from_str(raw.get()).unwrap_or(Value::Null);
        let mut row = cells(
            &e,
            &[
                "id",
                "subscription",
                "topic",
                "partition",
                "offset",
                "attempts",
                "state",
                "dead_lettered_at",
            ],
        );
        row.push(shorten(&cell(&e, &["reason"]), 60));
        row
    })
    .print(&ctx.out, "no dead-letter entries")?;
    if let Some(c) = next {
        note(&format!(
            "more entries follow: --cursor {c} (or --all for every page)"
        ));
    }
    Ok(())
}

/// The ids to work on: the arguments, with `-` replaced by stdin's lines.
fn ids_of(args: Vec<String>) -> Result<Vec<String>, CliError> {
    let mut ids = Vec::new();
    for a in args {
        if a == "-" {
            for (n, line) in std::io::stdin().lock().lines().enumerate() {
                let line = line.map_err(|e| {
                    CliError::Usage(format!("stdin line {}: cannot read an id: {e}", n + 1))
                })?;
                let id = line.trim();
                if !id.is_empty() {
                    ids.push(id.to_string());
                }
            }
        } else {
            ids.push(a);
        }
    }
    if ids.is_empty() {
        return Err(CliError::Usage("no ids given".into()));
    }
    Ok(ids)
}

fn each_id(ctx: &Ctx, args: Vec<String>, action: Action) -> Result<(), CliError> {
    let verb = action.verb();
    let ids = ids_of(args)?;
    let total = ids.len();
    let mut done: Vec<String> = Vec::new();
    let mut failed: Vec<(String, Problem)> = Vec::new();
    for (i, id) in ids.into_iter().enumerate() {
        match ctx.client.call(|c| action.on(c, &id)) {
            Ok(()) => done.push(id),
            Err(CliError::Api(p)) => {
                note(&format!("{verb} {id}: {p}"));
                failed.push((id, p));
            }
            Err(CliError::Unreachable(m)) => {
                return Err(CliError::Unreachable(format!(
                    "{m}\n{verb}: {} of {total} ids done, {} failed, stopped at {id}",
                    done.len(),
                    failed.len()
                )))
            }
            Err(e) => return Err(e),
        }
        if total > PROGRESS_EVERY && (i + 1) % PROGRESS_EVERY == 0 {
            note(&format!("{verb}: {} of {total}", i + 1));
        }
    }
    if ctx.out.json {
        let failed_json: Vec<Value> = failed
            .iter()
            .map(|(id, p)| json!({"id": id, "status": p.status, "detail": p.detail, "field": p.field}))
            .collect();
        ctx.out
            .assembled(&json!({ "done": done, "failed": failed_json }))?;
    } else {
        let results =
            done.iter()
                .map(|id| (id, action.done().to_string()))
                .chain(failed.iter().map(|(id, p)| {
                    let why = format!("failed: {} (HTTP {})", shorten(&p.detail, 80), p.status);
                    (id, why)
                }));
        Table::of(&["ID", "RESULT"], results, |(id, result)| {
            vec![id.clone(), result]
        })
        .print(&ctx.out, "")?;
    }
    match failed.len() {
        0 => Ok(()),
        n => Err(CliError::Failed(format!(
            "{verb}: {n} of {total} ids failed"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_the_arguments() {
        assert_eq!(
            ids_of(vec!["a".into(), "b".into()]).unwrap(),
            vec!["a".to_string(), "b".to_string()]
        );
        assert!(matches!(ids_of(vec![]), Err(CliError::Usage(_))));
    }
}
