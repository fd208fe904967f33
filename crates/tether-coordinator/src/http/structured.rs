//! Constrained output: `response_format` (`json_object`, `json_schema`), and llama.cpp's
//! `grammar` and `json_schema` fields, compiled into the grammar a request's tokens follow.

use serde_json::{Value, json};

use super::AppState;
use super::error::ApiError;
use super::types::CommonParams;
use crate::constraint::{Constraint, ConstraintError, GrammarSpec};

/// The grammar `p` asks for (or `forced`, a forced tool call's), compiled for the served
/// model; `None` when it asks for none.
pub(super) fn constraint(
    state: &AppState,
    p: &CommonParams,
    forced: Option<GrammarSpec>,
) -> Result<Option<Constraint>, ApiError> {
    let mut asked = Vec::new();
    if let Some(spec) = forced {
        asked.push(("tool_choice", spec));
    }
    if let Some(format) = &p.response_format
        && let Some(spec) = response_format(format)?
    {
        asked.push(("response_format", spec));
    }
    if let Some(grammar) = &p.grammar {
        if grammar.contains("::=") {
            return Err(ApiError::invalid_param(
                "grammar",
                "grammar: GBNF (`rule ::= ...`) is not supported; write it in Lark syntax \
                 (`start: ...`, as llguidance reads it)",
            ));
        }
        asked.push(("grammar", GrammarSpec::Lark(grammar.clone())));
    }
    if let Some(schema) = p.json_schema.as_ref().filter(|s| !s.is_null()) {
        asked.push((
            "json_schema",
            GrammarSpec::JsonSchema(schema_of("json_schema", schema)?),
        ));
    }
    let Some((param, spec)) = asked.pop() else {
        return Ok(None);
    };
    if let Some((other, _)) = asked.first() {
        return Err(ApiError::invalid_param(
            param,
            format!("`{param}` and `{other}` both constrain the output; send one of them"),
        ));
    }
    if p.min_tokens.is_some_and(|n| n > 0) {
        return Err(ApiError::invalid_param(
            "min_tokens",
            format!(
                "min_tokens cannot be combined with `{param}`: the grammar decides where the output ends"
            ),
        ));
    }
    let grammars = state.grammars().map_err(|e| {
        ApiError::invalid_param(
            param,
            format!("{param}: this model cannot take grammars: {e}"),
        )
    })?;
    grammars.compile(&spec).map(Some).map_err(|e| match e {
        ConstraintError::Grammar(why) => {
            ApiError::invalid_param(param, format!("{param} cannot be used: {why}"))
        }
        e => ApiError::internal(e.to_string()),
    })
}

/// The grammar of a `response_format` value; `None` for `text`.
fn response_format(format: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    let bad = |param: &str, what: &str| ApiError::invalid_param(param, what.to_string());
    if format.is_null() {
        return Ok(None);
    }
    let kind = format.get("type").and_then(Value::as_str).ok_or_else(|| {
        bad(
            "response_format",
            "response_format must be an object with a `type` of text, json_object or json_schema",
        )
    })?;
    match kind {
        "text" => Ok(None),
        // llama-server also takes a schema beside `json_object`.
        "json_object" => Ok(Some(GrammarSpec::JsonSchema(match format.get("schema") {
            Some(schema) => schema_of("response_format.schema", schema)?,
            None => json!({"type": "object"}),
        }))),
        "json_schema" => {
            let param = "response_format.json_schema";
            let inner = format
                .get("json_schema")
                .filter(|v| v.is_object())
                .ok_or_else(|| bad(param, "json_schema needs an object with a `schema`"))?;
            if let Some(strict) = inner
                .get("strict")
                .filter(|s| !s.is_null() && !s.is_boolean())
            {
                return Err(bad(
                    "response_format.json_schema.strict",
                    &format!("strict must be a boolean; got {strict}"),
                ));
            }
            let schema = inner.get("schema").ok_or_else(|| {
                bad(
                    "response_format.json_schema.schema",
                    "response_format.json_schema.schema is missing",
                )
            })?;
            Ok(Some(GrammarSpec::JsonSchema(schema_of(
                "response_format.json_schema.schema",
                schema,
            )?)))
        }
        other => Err(bad(
            "response_format.type",
            &format!("response_format type `{other}` is not one of text, json_object, json_schema"),
        )),
    }
}

/// A schema value: an object (or `true`, any JSON).
fn schema_of(param: &str, schema: &Value) -> Result<Value, ApiError> {
    match schema {
        Value::Object(_) => Ok(schema.clone()),
        Value::Bool(true) => Ok(json!({})),
        _ => Err(ApiError::invalid_param(
            param,
            format!("{param} must be a JSON schema object; got {schema}"),
        )),
    }
}
