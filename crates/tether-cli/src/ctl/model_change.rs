//! `tetherctl --coordinator URL model load|reload|unload`: `POST` and `DELETE
//! /v1/admin/model`. The call answers once the change is done, so it waits as long as the
//! load takes.

use super::ModelChange;
use super::coordinator::reply_json;
use anyhow::{Context, Result};
use serde_json::{Value, json};

/// Runs `change` and prints what the coordinator says it did.
pub(super) fn run(
    agent: &ureq::Agent,
    base: &str,
    api_key: Option<&str>,
    change: &ModelChange,
    json: bool,
) -> Result<()> {
    let url = format!("{base}/v1/admin/model");
    let auth = api_key.map(|key| format!("Bearer {key}"));
    let response = match change {
        ModelChange::Unload => {
            let mut request = agent.delete(url.as_str());
            if let Some(auth) = &auth {
                request = request.header("Authorization", auth);
            }
            request.call()
        }
        ModelChange::Load { .. } | ModelChange::Reload { .. } => {
            let mut request = agent
                .post(url.as_str())
                .header("Content-Type", "application/json");
            if let Some(auth) = &auth {
                request = request.header("Authorization", auth);
            }
            request.send(body(change).to_string())
        }
    }
    .with_context(|| format!("asking the coordinator at {url}"))?;
    let value = reply_json(&url, response)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    let name = |k: &str| value.get(k).and_then(Value::as_str).map(str::to_string);
    let outage = match value.get("outage").and_then(Value::as_bool) {
        Some(true) => " (requests were refused meanwhile)",
        _ => "",
    };
    match (name("model"), name("previous")) {
        (Some(model), Some(previous)) => {
            println!("{model} serves now, in place of {previous}{outage}")
        }
        (Some(model), None) => println!("{model} serves now{outage}"),
        (None, Some(previous)) => println!("{previous} unloaded; no model is loaded"),
        (None, None) => println!("no model is loaded"),
    }
    Ok(())
}

/// The body of `POST /v1/admin/model`; `reload` names no file, so the served one is read.
fn body(change: &ModelChange) -> Value {
    match change {
        ModelChange::Load {
            path,
            id,
            unload_first,
        } => json!({"path": path, "id": id, "unload_first": unload_first}),
        ModelChange::Reload { unload_first } => json!({"unload_first": unload_first}),
        ModelChange::Unload => json!({}),
    }
}
