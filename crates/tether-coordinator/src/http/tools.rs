//! Tool calling on `/v1/chat/completions`: `tools` rendered through the model's own chat
//! template (its `tools` variable, as Hugging Face's `apply_chat_template` passes it), calls
//! parsed from the output in the format that template teaches the model, and `tool_choice`
//! `required` or a named function forced through a grammar, so that even a model that
//! would not call gets a call whose arguments follow the function's parameters schema.

use serde_json::{Value, json};
use tether_model::tokenizer::Tokenizer;

use super::error::ApiError;
use super::mistral_calls;
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
    /// Mistral 7B v0.3, Nemo, Small up to 3.1: `[TOOL_CALLS]` then a JSON array of
    /// `{"name": ..., "arguments": {...}}` (each maybe with an `id`), after any text.
    MistralJson,
    /// Mistral templates of tokenizer v11 on (Small 3.2, ...): `[TOOL_CALLS]name[ARGS]{...}`
    /// a call.
    MistralArgs,
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
        } else if t.contains(mistral_calls::TOOL_CALLS) {
            // Only the newer templates write the name apart from the arguments.
            if t.contains("[ARGS]") {
                Ok(ToolFormat::MistralArgs)
            } else {
                Ok(ToolFormat::MistralJson)
            }
        } else if t.contains("<|python_tag|>")
            || (t.contains("ipython") && t.contains("parameters"))
        {
            Ok(ToolFormat::Llama3)
        } else {
            Err("the model's chat template writes tool calls in no format this server parses (Qwen/Hermes `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`)".into())
        }
    }

    /// The key of a call's arguments.
    fn arguments_key(self) -> &'static str {
        match self {
            ToolFormat::Hermes | ToolFormat::MistralJson | ToolFormat::MistralArgs => "arguments",
            ToolFormat::Llama3 => "parameters",
        }
    }

    fn is_mistral(self) -> bool {
        matches!(self, ToolFormat::MistralJson | ToolFormat::MistralArgs)
    }
}

/// The call format of `template`, if it has a known one.
pub(super) fn template_format(template: Option<&str>) -> Option<ToolFormat> {
    ToolFormat::of_template(template).ok()
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
    /// The id to return, where the format needs ids of its own; else a fresh one is made.
    pub id: Option<String>,
}

impl ToolCall {
    /// OpenAI's shape of a call.
    pub(super) fn to_json(&self) -> Value {
        let id = match &self.id {
            Some(id) => id.clone(),
            None => format!("call_{}", uuid::Uuid::new_v4().simple()),
        };
        json!({
            "id": id,
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
        if !is_valid_name(name) || defs.iter().any(|d| &d.0 == name) {
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

/// Whether `name` is a function name OpenAI accepts: 1 to 64 of a-z, A-Z, 0-9, _ and -.
pub(super) fn is_valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
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

    /// The grammar that forces a call (`required`, or a named tool); `tokenizer` is the
    /// model's, whose marker tokens the grammar names.
    pub(super) fn forced(&self, tokenizer: &Tokenizer) -> Option<GrammarSpec> {
        let format = self.format?;
        let callable: Vec<&(String, Value)> = match &self.choice {
            Choice::Required => self.defs.iter().collect(),
            Choice::Named(n) => self.defs.iter().filter(|d| &d.0 == n).collect(),
            Choice::None | Choice::Auto => return None,
        };
        if format == ToolFormat::MistralArgs {
            return Some(GrammarSpec::Lark(mistral_calls::args_grammar(
                &callable, tokenizer,
            )));
        }
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
            ToolFormat::MistralJson | ToolFormat::MistralArgs => {
                mistral_calls::array_grammar(&call, tokenizer)
            }
        }))
    }

    /// Control tokens whose text the reply must keep for its calls to be found: the
    /// markers of Mistral's format, which decode to no text in its vocabularies.
    pub(super) fn shown_tokens(&self, tokenizer: &Tokenizer) -> Vec<u32> {
        if !self.format.is_some_and(ToolFormat::is_mistral) {
            return Vec::new();
        }
        mistral_calls::MARKERS
            .iter()
            .filter_map(|m| tokenizer.token_id(m))
            .filter(|&id| tokenizer.token_to_piece(id).is_empty())
            .collect()
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
            ToolFormat::MistralJson | ToolFormat::MistralArgs => mistral_calls::parse(text),
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

/// A call from the text of a JSON object with `name` and arguments under one of `keys`.
fn call_of(json_text: &str, keys: &[&str]) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(json_text).ok()?;
    call_of_value(&v, keys)
}

/// A call from a JSON object with `name` and arguments under one of `keys`.
pub(super) fn call_of_value(v: &Value, keys: &[&str]) -> Option<ToolCall> {
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
    Some(ToolCall {
        name,
        arguments,
        id: None,
    })
}

/// An assistant message's `tool_calls` as templates read them: each call's `arguments`
/// as the object it encodes (Hugging Face templates write it with `tojson`), and ids as
/// a template of `format` accepts them.
pub(super) fn calls_for_template(calls: &[Value], format: Option<ToolFormat>) -> Vec<Value> {
    let mut calls: Vec<Value> = calls
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
        .collect();
    if format.is_some_and(ToolFormat::is_mistral) {
        mistral_calls::calls_with_template_ids(&mut calls);
    }
    calls
}

/// A `tool` message's `tool_call_id` as a template of `format` accepts it: mapped as the
/// call's own id is in [`calls_for_template`], so the two still match.
pub(super) fn call_id_for_template(id: String, format: Option<ToolFormat>) -> String {
    if format.is_some_and(ToolFormat::is_mistral) {
        mistral_calls::template_id(&id)
    } else {
        id
    }
}

#[cfg(test)]
mod tests {
    use tether_model::tokenizer::{TokenType, Vocab};

    use super::*;

    /// `<unk>`, `<s>`, `</s>`, the byte tokens, then Mistral's markers as control tokens.
    fn mistral_tokenizer() -> Tokenizer {
        let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
        let mut types = vec![TokenType::Unknown, TokenType::Control, TokenType::Control];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(TokenType::Byte);
        }
        for marker in ["[TOOL_CALLS]", "[ARGS]"] {
            tokens.push(marker.to_string());
            types.push(TokenType::Control);
        }
        let vocab = Vocab {
            model: "llama".into(),
            scores: vec![0.0; tokens.len()],
            tokens,
            token_types: types,
            bos: Some(1),
            eos: Some(2),
            ..Vocab::default()
        };
        Tokenizer::from_vocab(vocab).expect("a valid vocabulary")
    }

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
        let tokenizer = mistral_tokenizer();
        let Some(GrammarSpec::Lark(g)) = named.forced(&tokenizer) else {
            panic!("a grammar")
        };
        assert!(g.starts_with("start: \"<tool_call>\\n\""), "{g}");
        assert!(g.contains("\"now\"") && !g.contains("get_weather"), "{g}");
        let required = tools_for("ipython parameters", json!("required"));
        let Some(GrammarSpec::Lark(g)) = required.forced(&tokenizer) else {
            panic!("a grammar")
        };
        assert!(g.contains("anyOf") && g.contains("\"parameters\""), "{g}");
        assert!(
            tools_for("<tool_call>", json!("auto"))
                .forced(&tokenizer)
                .is_none()
        );
    }

    const MISTRAL_JSON: &str = "[AVAILABLE_TOOLS] ... [TOOL_CALLS] ... [TOOL_RESULTS]";
    const MISTRAL_ARGS: &str = "[AVAILABLE_TOOLS] ... [TOOL_CALLS]{{ name }}[ARGS]{{ args }}";

    #[test]
    fn mistral_calls_parse_after_the_text_before_them() {
        let t = tools_for(MISTRAL_JSON, json!("auto"));
        let (content, calls) = t
            .parse("Checking.[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}, \"id\": \"a1b2C3d4E\"}, {\"name\": \"now\", \"arguments\": {}}]")
            .expect("calls");
        assert_eq!(content.as_deref(), Some("Checking."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Oslo"}"#);
        assert_eq!(
            calls[0].id.as_deref(),
            Some("a1b2C3d4E"),
            "the model's id is kept"
        );
        let fresh = calls[1].id.as_deref().expect("an id is made");
        assert!(
            fresh.len() == 9 && fresh.bytes().all(|b| b.is_ascii_alphanumeric()),
            "{fresh}"
        );
        let (content, calls) = t
            .parse("[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}]")
            .expect("no space, no text");
        assert_eq!((content, calls.len()), (None, 1));
        let one = t
            .parse("[TOOL_CALLS]{\"name\": \"now\", \"arguments\": \"{}\"}")
            .expect("a lone object");
        assert_eq!(one.1[0].arguments, "{}");
    }

    #[test]
    fn malformed_mistral_calls_stay_text() {
        let t = tools_for(MISTRAL_JSON, json!("auto"));
        for text in [
            "no marker here",
            "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}",
            "[TOOL_CALLS] [{not json}]",
            "[TOOL_CALLS] []",
            "[TOOL_CALLS] [{\"arguments\": {}}]",
            "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}] and then prose",
            "[TOOL_CALLS]now[ARGS]{broken",
            "[TOOL_CALLS]two words[ARGS]{}",
        ] {
            assert!(t.parse(text).is_none(), "{text}");
        }
    }

    #[test]
    fn mistral_v11_calls_name_each_call_before_its_arguments() {
        let t = tools_for(MISTRAL_ARGS, json!("auto"));
        let (content, calls) = t
            .parse("Sure. [TOOL_CALLS]get_weather[ARGS]{\"city\": \"Rome\"}[TOOL_CALLS]now[CALL_ID]Xy12345ab[ARGS]{}")
            .expect("calls");
        assert_eq!(content.as_deref(), Some("Sure."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Rome"}"#);
        assert_eq!(calls[1].name, "now");
        assert_eq!(calls[1].id.as_deref(), Some("Xy12345ab"));
        // Either Mistral template family reads the other's form too.
        let json_form = "[TOOL_CALLS][{\"name\": \"now\", \"arguments\": {}}]";
        assert!(t.parse(json_form).is_some());
        let v03 = tools_for(MISTRAL_JSON, json!("auto"));
        assert!(v03.parse("[TOOL_CALLS]now[ARGS]{}").is_some());
    }

    #[test]
    fn forced_mistral_calls_start_with_the_marker_token() {
        let tokenizer = mistral_tokenizer();
        let calls = tokenizer
            .token_id("[TOOL_CALLS]")
            .expect("in the vocabulary");
        let args = tokenizer.token_id("[ARGS]").expect("in the vocabulary");
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let Some(GrammarSpec::Lark(g)) = tools_for(MISTRAL_JSON, named.clone()).forced(&tokenizer)
        else {
            panic!("a grammar")
        };
        assert!(
            g.starts_with(&format!("start: <[{calls}]> \" \"? \"[\" call \"]\"")),
            "{g}"
        );
        assert!(g.contains("\"arguments\"") && !g.contains("\"now\""), "{g}");
        let Some(GrammarSpec::Lark(g)) =
            tools_for(MISTRAL_ARGS, json!("required")).forced(&tokenizer)
        else {
            panic!("a grammar")
        };
        assert!(g.starts_with(&format!("start: <[{calls}]> call\n")), "{g}");
        assert!(
            g.contains(&format!(
                "\"get_weather\" <[{args}]> args0 | \"now\" <[{args}]> args1"
            )),
            "{g}"
        );
        // Without the tokens, the markers are text.
        let plain = Tokenizer::from_vocab(Vocab {
            model: "llama".into(),
            tokens: vec!["<unk>".into(), "<s>".into(), "</s>".into()],
            scores: vec![0.0; 3],
            token_types: vec![TokenType::Unknown, TokenType::Control, TokenType::Control],
            bos: Some(1),
            eos: Some(2),
            ..Vocab::default()
        })
        .expect("a vocabulary");
        let Some(GrammarSpec::Lark(g)) = tools_for(MISTRAL_JSON, named).forced(&plain) else {
            panic!("a grammar")
        };
        assert!(g.starts_with("start: \"[TOOL_CALLS]\" \" \"? \"[\""), "{g}");
        let shown = tools_for(MISTRAL_ARGS, json!("auto")).shown_tokens(&tokenizer);
        assert_eq!(
            shown,
            vec![calls, args],
            "the markers' text reaches the parser"
        );
        assert!(
            tools_for("<tool_call>", json!("auto"))
                .shown_tokens(&tokenizer)
                .is_empty()
        );
    }

    #[test]
    fn history_ids_are_mapped_for_mistral_templates_only() {
        let calls = [json!({"id": "call_1", "type": "function",
                            "function": {"name": "now", "arguments": "{}"}})];
        let mistral = template_format(Some(MISTRAL_JSON));
        let mapped = calls_for_template(&calls, mistral);
        let id = mapped[0]["id"].as_str().expect("an id");
        assert!(
            id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()),
            "{id}"
        );
        assert_eq!(mapped[0]["function"]["arguments"], json!({}));
        assert_eq!(
            call_id_for_template("call_1".into(), mistral),
            id,
            "a result matches its call"
        );
        let hermes = template_format(Some("<tool_call>"));
        assert_eq!(calls_for_template(&calls, hermes)[0]["id"], "call_1");
        assert_eq!(call_id_for_template("call_1".into(), hermes), "call_1");
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
