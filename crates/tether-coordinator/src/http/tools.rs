//! Tool calling on `/v1/chat/completions`: `tools` rendered through the model's own chat
//! template (its `tools` variable, as Hugging Face's `apply_chat_template` passes it), calls
//! parsed from the output in the format that template teaches the model, and `tool_choice`
//! `required` or a named function forced through a grammar, so that even a model that
//! would not call gets a call whose arguments follow the function's parameters schema.

use serde_json::{Value, json};

use super::error::ApiError;
use super::types::ToolDef;
use crate::constraint::{GrammarSpec, json_layout};

/// How a model writes tool calls, read from its chat template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ToolFormat {
    /// Qwen 2.5/3 and Hermes: one `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
    /// block a call, after any text.
    Hermes,
    /// Llama 3.1-3.3: the whole reply is one `{"name": ..., "parameters": {...}}`.
    Llama3,
}

impl ToolFormat {
    /// The format `template` writes, or why none is known.
    fn of_template(template: Option<&str>) -> Result<ToolFormat, String> {
        let Some(t) = template else {
            return Err(
                "the model has no chat template of its own, so it has no tool-call format".into(),
            );
        };
        if t.contains("<tool_call>") {
            Ok(ToolFormat::Hermes)
        } else if t.contains("[TOOL_CALLS]") {
            Err("the model's chat template uses Mistral's [TOOL_CALLS] format, which this server does not parse yet".into())
        } else if t.contains("<|python_tag|>")
            || (t.contains("ipython") && t.contains("parameters"))
        {
            Ok(ToolFormat::Llama3)
        } else {
            Err("the model's chat template writes tool calls in no format this server parses (Qwen/Hermes `<tool_call>`, Llama 3 JSON)".into())
        }
    }

    /// The key of a call's arguments.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "arguments",
            ToolFormat::Llama3 => "parameters",
        }
    }
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Choice {
    /// Never call (the tools are still shown to the model).
    None,
    /// Call when the model writes a call.
    Auto,
    /// Call one of the tools: forced by a grammar.
    Required,
    /// Call this tool: forced by a grammar.
    Named(String),
}

/// A request's tools, checked.
#[derive(Clone, Debug)]
pub(super) struct Tools {
    format: Option<ToolFormat>,
    /// What the request asked for.
    pub choice: Choice,
    /// The `tools` list as the template sees it.
    pub listed: Value,
    /// Each tool's name and parameters schema.
    defs: Vec<(String, Value)>,
}

/// A call found in the output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ToolCall {
    /// The function.
    pub name: String,
    /// Its arguments, a JSON text.
    pub arguments: String,
}

impl ToolCall {
    /// OpenAI's shape of a call, with a fresh id.
    pub(super) fn to_json(&self) -> Value {
        json!({
            "id": format!("call_{}", uuid::Uuid::new_v4().simple()),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
    }
}

/// Most tools a request may list.
const MAX_TOOLS: usize = 128;

/// The tools of a request for a model whose chat template is `template`; `None` when it
/// lists none.
pub(super) fn tools(
    template: Option<&str>,
    list: Option<&[ToolDef]>,
    choice: Option<&Value>,
) -> Result<Option<Tools>, ApiError> {
    let list = list.unwrap_or_default();
    let choice = parse_choice(choice)?;
    if list.is_empty() {
        return match choice {
            Choice::Required | Choice::Named(_) => Err(ApiError::invalid_param(
                "tool_choice",
                "tool_choice asks for a call, but `tools` lists none",
            )),
            Choice::None | Choice::Auto => Ok(None),
        };
    }
    if list.len() > MAX_TOOLS {
        return Err(ApiError::invalid_param(
            "tools",
            format!(
                "{} tools given; at most {MAX_TOOLS} are supported",
                list.len()
            ),
        ));
    }
    let mut defs: Vec<(String, Value)> = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        if tool.kind != "function" {
            return Err(ApiError::invalid_param(
                &format!("tools[{i}].type"),
                format!(
                    "tool type `{}` is not supported; only `function` is",
                    tool.kind
                ),
            ));
        }
        let name = &tool.function.name;
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !valid || defs.iter().any(|d| &d.0 == name) {
            return Err(ApiError::invalid_param(
                &format!("tools[{i}].function.name"),
                format!("`{name}` must be 1 to 64 of a-z, A-Z, 0-9, _ and -, and unique"),
            ));
        }
        let params = match &tool.function.parameters {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(other) => {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].function.parameters"),
                    format!("parameters must be a JSON schema object; got {other}"),
                ));
            }
        };
        defs.push((name.clone(), params));
    }
    if let Choice::Named(name) = &choice
        && !defs.iter().any(|d| &d.0 == name)
    {
        return Err(ApiError::invalid_param(
            "tool_choice",
            format!("tool_choice names `{name}`, which `tools` does not list"),
        ));
    }
    let format = match ToolFormat::of_template(template) {
        Ok(format) => Some(format),
        Err(_) if choice == Choice::None => None,
        Err(why) => {
            return Err(ApiError::invalid_param("tools", why).with_code("unsupported_parameter"));
        }
    };
    let listed = Value::Array(
        list.iter()
            .zip(&defs)
            .map(|(t, (name, params))| {
                let mut function = json!({"name": name, "parameters": params});
                if let Some(d) = &t.function.description {
                    function["description"] = json!(d);
                }
                json!({"type": "function", "function": function})
            })
            .collect(),
    );
    Ok(Some(Tools {
        format,
        choice,
        listed,
        defs,
    }))
}

fn parse_choice(choice: Option<&Value>) -> Result<Choice, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "tool_choice",
            "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    match choice {
        None | Some(Value::Null) => Ok(Choice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(Choice::None),
            "auto" => Ok(Choice::Auto),
            "required" => Ok(Choice::Required),
            _ => Err(bad()),
        },
        Some(v) if v.get("type").and_then(Value::as_str) == Some("function") => v
            .pointer("/function/name")
            .and_then(Value::as_str)
            .map(|n| Choice::Named(n.to_owned()))
            .ok_or_else(bad),
        Some(_) => Err(bad()),
    }
}

impl Tools {
    /// Whether calls are looked for in the output.
    pub(super) fn parses_calls(&self) -> bool {
        self.choice != Choice::None && self.format.is_some()
    }

    /// The grammar that forces a call (`required`, or a named tool).
    pub(super) fn forced(&self) -> Option<GrammarSpec> {
        let format = self.format?;
        let callable: Vec<&(String, Value)> = match &self.choice {
            Choice::Required => self.defs.iter().collect(),
            Choice::Named(n) => self.defs.iter().filter(|d| &d.0 == n).collect(),
            Choice::None | Choice::Auto => return None,
        };
        let key = format.arguments_key();
        let variants: Vec<Value> = callable
            .iter()
            .map(|(name, params)| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": name}, key: params},
                    "required": ["name", key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = match <[Value; 1]>::try_from(variants) {
            Ok([one]) => one,
            Err(many) => json!({"anyOf": many}),
        };
        schema["x-guidance"] = json_layout();
        let call = format!("call: %json {schema}");
        Some(GrammarSpec::Lark(match format {
            ToolFormat::Hermes => {
                format!("start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\n{call}")
            }
            ToolFormat::Llama3 => format!("start: call\n{call}"),
        }))
    }

    /// The text before the calls (if any) and the calls `text` makes; `None` when it
    /// makes none (or one that does not parse: the text is then returned as it is).
    pub(super) fn parse(&self, text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
        if !self.parses_calls() {
            return None;
        }
        match self.format? {
            ToolFormat::Hermes => parse_hermes(text),
            ToolFormat::Llama3 => {
                let body = text.trim();
                let body = body.strip_prefix("<|python_tag|>").unwrap_or(body);
                let call = call_of(body, &["parameters", "arguments"])?;
                Some((None, vec![call]))
            }
        }
    }
}

/// `<tool_call>` blocks (the last may lack its closing tag: generation stopped there).
fn parse_hermes(text: &str) -> Option<(Option<String>, Vec<ToolCall>)> {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let first = text.find(OPEN)?;
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(after) = rest.strip_prefix(OPEN) {
        let (inner, tail) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        calls.push(call_of(inner.trim(), &["arguments", "parameters"])?);
        rest = tail.trim_start();
    }
    if !rest.is_empty() {
        return None;
    }
    let content = text[..first].trim();
    Some(((!content.is_empty()).then(|| content.to_owned()), calls))
}

/// A call from a JSON object with `name` and arguments under one of `keys`.
fn call_of(json_text: &str, keys: &[&str]) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json_text).ok()?;
    let name = v.get("name")?.as_str()?.to_owned();
    let arguments = keys
        .iter()
        .find_map(|k| v.get(*k))
        .cloned()
        .unwrap_or(json!({}));
    let arguments = match arguments {
        // Some models write the arguments as a JSON string already.
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// An assistant message's `tool_calls` as templates read them: each call's `arguments`
/// as the object it encodes (Hugging Face templates write it with `tojson`).
pub(super) fn calls_for_template(calls: &[Value]) -> Vec<Value> {
    calls
        .iter()
        .map(|call| {
            let mut call = call.clone();
            if let Some(args) = call.pointer_mut("/function/arguments")
                && let Some(parsed) = args.as_str().and_then(|s| serde_json::from_str(s).ok())
            {
                *args = parsed;
            }
            call
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools_for(template: &str, choice: Value) -> Tools {
        let defs: Vec<ToolDef> = serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}},
        ]))
        .expect("tool definitions");
        tools(Some(template), Some(&defs), Some(&choice))
            .expect("valid")
            .expect("some")
    }

    #[test]
    fn hermes_calls_parse_with_the_text_before_them() {
        let t = tools_for("... <tool_call> ...", json!("auto"));
        let (content, calls) = t
            .parse("Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>")
            .expect("calls");
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Oslo"}"#);
        assert!(t.parse("no call here").is_none());
        assert!(t.parse("<tool_call>\n{not json}\n</tool_call>").is_none());
        let unclosed = t
            .parse("<tool_call>{\"name\": \"now\", \"arguments\": {}}")
            .expect("call");
        assert_eq!(unclosed.1[0].name, "now");
    }

    #[test]
    fn llama3_calls_are_the_whole_reply() {
        let t = tools_for("... ipython ... parameters ...", json!("auto"));
        let (_, calls) = t
            .parse(" {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}")
            .expect("a call");
        assert_eq!(calls[0].arguments, r#"{"city":"Rome"}"#);
        assert!(t.parse("The weather is fine.").is_none());
        let none = tools_for("... ipython ... parameters ...", json!("none"));
        assert!(
            none.parse("{\"name\": \"now\", \"parameters\": {}}")
                .is_none(),
            "none parses no call"
        );
    }

    #[test]
    fn forced_choices_make_a_grammar_of_the_callable_tools() {
        let named = tools_for(
            "<tool_call>",
            json!({"type": "function", "function": {"name": "now"}}),
        );
        let Some(GrammarSpec::Lark(g)) = named.forced() else {
            panic!("a grammar")
        };
        assert!(g.starts_with("start: \"<tool_call>\\n\""), "{g}");
        assert!(g.contains("\"now\"") && !g.contains("get_weather"), "{g}");
        let required = tools_for("ipython parameters", json!("required"));
        let Some(GrammarSpec::Lark(g)) = required.forced() else {
            panic!("a grammar")
        };
        assert!(g.contains("anyOf") && g.contains("\"parameters\""), "{g}");
        assert!(tools_for("<tool_call>", json!("auto")).forced().is_none());
    }

    #[test]
    fn bad_tools_and_choices_are_refused_by_name() {
        let defs: Vec<ToolDef> =
            serde_json::from_value(json!([{"type": "function", "function": {"name": "a b"}}]))
                .expect("parses");
        let e = tools(Some("<tool_call>"), Some(&defs), None).expect_err("bad name");
        assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
        let ok: Vec<ToolDef> =
            serde_json::from_value(json!([{"type": "function", "function": {"name": "f"}}]))
                .expect("parses");
        for (template, choice, param) in [
            ("<tool_call>", json!("sometimes"), "tool_choice"),
            (
                "<tool_call>",
                json!({"type": "function", "function": {"name": "g"}}),
                "tool_choice",
            ),
            ("{{ messages }}", json!("auto"), "tools"),
            ("[TOOL_CALLS]", json!("required"), "tools"),
        ] {
            let e = tools(Some(template), Some(&ok), Some(&choice)).expect_err(template);
            assert_eq!(e.param.as_deref(), Some(param), "{template} {choice}");
        }
        let e = tools(Some("<tool_call>"), None, Some(&json!("required"))).expect_err("no tools");
        assert_eq!(e.param.as_deref(), Some("tool_choice"));
        assert!(
            tools(None, Some(&ok), Some(&json!("none")))
                .expect("none needs no format")
                .is_some()
        );
    }
}
