//! `meshd task ...` and `meshd session list`. Only the HTTP contract is assumed: fields
//! the contract does not fix (the list keys of a task page) are read defensively and
//! shown as `-` when absent.

use super::error::CliError;
use super::output::{cell, list, note, Table};
use super::{Ctx, SessionCmd, TaskCmd};
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
            if ctx.json {
                return ctx.out.raw(&a.body);
            }
            let v: Value = a.json()?;
            if a.status == 200 {
                note("a task with this id and body exists already: nothing changed");
            }
            let mut t = Table::new(&["ID", "STATE", "VERSION"]);
            t.row(vec![
                cell(&v, &["id"]),
                cell(&v, &["state"]),
                cell(&v, &["version"]),
            ]);
            t.print(&ctx.out, "")
        }
        TaskCmd::Get { id } => {
            let a = ctx.client.call(|c| c.task_answer(&id))?;
            if ctx.json {
                return ctx.out.raw(&a.body);
            }
            let v: Value = a.json()?;
            let mut t = Table::new(&["FIELD", "VALUE"]);
            for k in ["id", "agent", "state", "version"] {
                t.row(vec![k.to_string(), cell(&v, &[k])]);
            }
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
            t.row(vec!["input".into(), shorten(&cell(&v, &["input"]), 200)]);
            t.row(vec!["output".into(), shorten(&cell(&v, &["output"]), 200)]);
            ctx.out.line(&t.render())?;
            if let Some(Value::Array(history)) = v.get("history") {
                let mut h = Table::new(&["AT", "STATE"]);
                for step in history {
                    h.row(vec![cell(step, &["at"]), cell(step, &["state"])]);
                }
                ctx.out.line("")?;
                h.print(&ctx.out, "")?;
            }
            Ok(())
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
            if ctx.json {
                return ctx.out.raw(&a.body);
            }
            let v: Value = a.json()?;
            let mut t = Table::new(&["ID", "AGENT", "STATE", "VERSION", "ASSIGNEE"]);
            for task in list(&v, "tasks")? {
                let assignee = task
                    .get("assignee")
                    .map_or_else(|| "-".to_string(), |a| cell(a, &["session"]));
                t.row(vec![
                    cell(task, &["id"]),
                    cell(task, &["agent"]),
                    cell(task, &["state"]),
                    cell(task, &["version"]),
                    assignee,
                ]);
            }
            t.print(&ctx.out, "no tasks")?;
            if let Some(c) = v.get("next_cursor").and_then(Value::as_str) {
                note(&format!("more tasks follow: --cursor {c}"));
            }
            Ok(())
        }
        TaskCmd::Cancel { id } => {
            let a = ctx.client.call(|c| c.cancel_task_answer(&id))?;
            if ctx.json {
                return ctx.out.raw(&a.body);
            }
            let v: Value = a.json()?;
            let state = match cell(&v, &["state"]) {
                s if s == "-" => "canceled".to_string(),
                s => s,
            };
            ctx.out.line(&format!("task {id}: {state}"))
        }
    }
}

pub fn session(ctx: &Ctx, cmd: SessionCmd) -> Result<(), CliError> {
    match cmd {
        SessionCmd::List => {
            let a = ctx.client.call(|c| c.sessions_answer())?;
            if ctx.json {
                return ctx.out.raw(&a.body);
            }
            let v: Value = a.json()?;
            let mut t = Table::new(&["SESSION", "CLIENT_ID", "EPOCH", "INSTANCE", "TTL_MS"]);
            for s in list(&v, "sessions")? {
                t.row(vec![
                    cell(s, &["session_id", "id"]),
                    cell(s, &["client_id"]),
                    cell(s, &["epoch"]),
                    cell(s, &["instance"]),
                    cell(s, &["ttl_ms"]),
                ]);
            }
            t.print(&ctx.out, "no live sessions")
        }
    }
}
