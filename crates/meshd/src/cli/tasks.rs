//! `meshd task ...` and `meshd session list`. Only the HTTP contract is assumed: fields
//! the contract does not fix (the list keys of a task page) are read defensively and
//! shown as `-` when absent.

use super::args::{SessionCmd, TaskCmd};
use super::ctx::Ctx;
use super::error::CliError;
use super::output::{cell, cells, list, note, Table};
use meshd_client::shorten;
use serde_json::Value;

pub fn task(ctx: &Ctx, cmd: TaskCmd) -> Result<(), CliError> {
    match cmd {
        TaskCmd::Submit { agent, id, input } => {
            // Without --input meshd answers that the input is required.
            let input = match input {
                Some(text) => serde_json::from_str(&text)
                    .map_err(|e| CliError::Usage(format!("--input is not JSON: {e}")))?,
                None => Value::Null,
            };
            let a = ctx
                .client
                .call(|c| c.submit_task_answer(id.as_deref(), &agent, &input))?;
            ctx.out.answer(&a, |v| {
                if a.status == 200 {
                    note("a task with this id and body exists already: nothing changed");
                }
                Table::of(&["ID", "STATE", "VERSION"], [v], |v| {
                    cells(v, &["id", "state", "version"])
                })
                .print(&ctx.out, "")
            })
        }
        TaskCmd::Get { id } => {
            let a = ctx.client.call(|c| c.task_answer(&id))?;
            ctx.out.answer(&a, |v| {
                let mut t = Table::fields(v, &["id", "agent", "state", "version"]);
                let assignee = match v.get("assignee") {
                    Some(a) if a.is_object() => {
                        format!(
                            "session {} epoch {}",
                            cell(a, &["session"]),
                            cell(a, &["epoch"])
                        )
                    }
                    _ => "-".into(),
                };
                t.row(vec!["assignee".into(), assignee]);
                t.row(vec!["input".into(), shorten(&cell(v, &["input"]), 200)]);
                t.row(vec!["output".into(), shorten(&cell(v, &["output"]), 200)]);
                t.print(&ctx.out, "")?;
                if let Some(Value::Array(history)) = v.get("history") {
                    ctx.out.line("")?;
                    Table::of(&["AT", "STATE"], history, |step| {
                        cells(step, &["at", "state"])
                    })
                    .print(&ctx.out, "")?;
                }
                Ok(())
            })
        }
        TaskCmd::List {
            agent,
            state,
            limit,
            cursor,
        } => {
            let a = ctx.client.call(|c| {
                c.tasks_answer(agent.as_deref(), state.as_deref(), limit, cursor.as_deref())
            })?;
            ctx.out.answer(&a, |v| {
                let heads = ["ID", "AGENT", "STATE", "VERSION", "ASSIGNEE"];
                Table::of(&heads, list(v, "tasks")?, |task| {
                    let mut row = cells(task, &["id", "agent", "state", "version"]);
                    row.push(
                        task.get("assignee")
                            .map_or_else(|| "-".to_string(), |a| cell(a, &["session"])),
                    );
                    row
                })
                .print(&ctx.out, "no tasks")?;
                if let Some(c) = v.get("next_cursor").and_then(Value::as_str) {
                    note(&format!("more tasks follow: --cursor {c}"));
                }
                Ok(())
            })
        }
        TaskCmd::Cancel { id } => {
            let a = ctx.client.call(|c| c.cancel_task_answer(&id))?;
            ctx.out.answer(&a, |v| {
                let state = match cell(v, &["state"]) {
                    s if s == "-" => "canceled".to_string(),
                    s => s,
                };
                ctx.out.line(&format!("task {id}: {state}"))
            })
        }
    }
}

pub fn session(ctx: &Ctx, cmd: SessionCmd) -> Result<(), CliError> {
    match cmd {
        SessionCmd::List => {
            let a = ctx.client.call(|c| c.sessions_answer())?;
            ctx.out.answer(&a, |v| {
                let heads = ["SESSION", "CLIENT_ID", "EPOCH", "INSTANCE", "TTL_MS"];
                Table::of(&heads, list(v, "sessions")?, |s| {
                    let mut row = vec![cell(s, &["session_id", "id"])];
                    row.extend(cells(s, &["client_id", "epoch", "instance", "ttl_ms"]));
                    row
                })
                .print(&ctx.out, "no live sessions")
            })
        }
    }
}
