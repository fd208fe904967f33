//! Tool calling with Mistral-style templates over real sockets: a tiny random model whose
//! vocabulary has Mistral's markers as control tokens (so they decode to no text, as in
//! the real files), forced calls in both the JSON-array and the `[ARGS]` form, streamed
//! call deltas, and call ids that the template's own check accepts on the next turn.

use std::path::PathBuf;

use serde_json::{Value, json};
use tether_gguf::{GgmlType, GgufFile, MetaArray, MetaValue};
use tether_model::SynthShape;

use super::test_support::{Reply, post, test_dir};
use super::tests_tools::{check_function, request, server, tool_list};

/// A Mistral-style template (7B v0.3, Nemo): tools before the last user turn, calls as a
/// JSON array after `[TOOL_CALLS]`, results in `[TOOL_RESULTS]`, and ids of 9 characters
/// or an exception, as Mistral's own templates insist.
const MISTRAL_TEMPLATE: &str = r#"{{- bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == "user" %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {%- if tools and loop.index0 == ns.last_user %}
            {{- "[AVAILABLE_TOOLS]" + (tools | tojson) + "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST]" + message.content + "[/INST]" }}
    {%- elif message.role == "assistant" and message.tool_calls %}
        {{- "[TOOL_CALLS][" }}
        {%- for call in message.tool_calls %}
            {%- if call.id is not defined or call.id | length != 9 %}
                {{- raise_exception("Tool call ids must be 9 letters and digits") }}
            {%- endif %}
            {{- {"name": call.function.name, "arguments": call.function.arguments, "id": call.id} | tojson }}
            {%- if not loop.last %}{{ ", " }}{% endif %}
        {%- endfor %}
        {{- "]" + eos_token }}
    {%- elif message.role == "tool" %}
        {%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
            {{- raise_exception("Tool call ids must be 9 letters and digits") }}
        {%- endif %}
        {{- "[TOOL_RESULTS]" + ({"content": message.content, "call_id": message.tool_call_id} | tojson) + "[/TOOL_RESULTS]" }}
    {%- elif message.role == "assistant" %}
        {{- message.content + eos_token }}
    {%- else %}
        {{- raise_exception("Only user, assistant and tool roles are supported") }}
    {%- endif %}
{%- endfor %}"#;

/// The newer form (tokenizer v11 on, Mistral Small 3.2): `[TOOL_CALLS]name[ARGS]{...}` a
/// call.
const MISTRAL_ARGS_TEMPLATE: &str = r#"{{- bos_token }}
{%- if tools %}{{ "[AVAILABLE_TOOLS]" + (tools | tojson) + "[/AVAILABLE_TOOLS]" }}{% endif %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- "[INST]" + message.content + "[/INST]" }}
    {%- elif message.role == "assistant" and message.tool_calls %}
        {%- for call in message.tool_calls %}
            {{- "[TOOL_CALLS]" + call.function.name + "[ARGS]" + (call.function.arguments | tojson) }}
        {%- endfor %}
        {{- eos_token }}
    {%- elif message.role == "tool" %}
        {{- "[TOOL_RESULTS]" + message.content + "[/TOOL_RESULTS]" }}
    {%- elif message.role == "assistant" %}
        {{- message.content + eos_token }}
    {%- endif %}
{%- endfor %}"#;

/// Mistral's markers, control tokens in its vocabularies.
const MARKERS: [&str; 8] = [
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[ARGS]",
];

/// The tiny model with `template`, the last filler pieces of its vocabulary turned into
/// Mistral's markers as control tokens.
fn mistral_model(name: &str, template: &str) -> PathBuf {
    let base = super::tests_tools::templated_model(&format!("base-{name}"), template);
    let (mut tokens, mut types) = {
        let file = GgufFile::open(&base).expect("reading the synthesized model");
        let tokens: Vec<String> = match file.get("tokenizer.ggml.tokens") {
            Some(MetaValue::Array(a)) => a
                .as_strings()
                .expect("token strings")
                .iter()
                .map(str::to_owned)
                .collect(),
            other => panic!("tokens: {other:?}"),
        };
        let types = match file.get("tokenizer.ggml.token_type") {
            Some(MetaValue::Array(a)) => a.to_i32s().expect("token types"),
            other => panic!("token types: {other:?}"),
        };
        (tokens, types)
    };
    let first = tokens.len() - MARKERS.len();
    for (i, marker) in MARKERS.iter().enumerate() {
        tokens[first + i] = (*marker).to_owned();
        // llama.cpp's code for a control token.
        types[first + i] = 3;
    }
    let path = test_dir().join(name);
    let extra = vec![
        (
            "tokenizer.chat_template".to_string(),
            MetaValue::String(template.to_string()),
        ),
        (
            "tokenizer.ggml.tokens".to_string(),
            MetaValue::Array(MetaArray::strings(&tokens)),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            MetaValue::Array(MetaArray::I32(types)),
        ),
    ];
    tether_model::synthesize_with(&path, SynthShape::Tiny, GgmlType::Q8_0, 7, extra)
        .expect("synthesizing the Mistral-style model");
    path
}

/// Asserts `id` is as Mistral's templates demand.
fn check_id(call: &Value) {
    let id = call["id"].as_str().expect("an id");
    assert!(
        id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()),
        "{call}"
    );
}

/// The forced choice of `seed`: a named function or any.
fn forced_choice(seed: u64) -> (Value, &'static [&'static str]) {
    if seed.is_multiple_of(2) {
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            &["get_weather"],
        )
    } else {
        (json!("required"), &["get_weather", "now"])
    }
}

#[tokio::test]
async fn forced_mistral_calls_come_back_as_tool_calls_in_both_forms() {
    for (file, template) in [
        ("mistral.gguf", MISTRAL_TEMPLATE),
        ("mistral-args.gguf", MISTRAL_ARGS_TEMPLATE),
    ] {
        let server = server(&mistral_model(file, template)).await;
        for seed in 0..6u64 {
            let (choice, allowed) = forced_choice(seed);
            let reply = post(server.addr, "/v1/chat/completions", &request(choice, seed)).await;
            assert_eq!(reply.status, 200, "{file}: {}", reply.body);
            let body = reply.json();
            let choice = &body["choices"][0];
            assert_eq!(
                choice["finish_reason"], "tool_calls",
                "{file} seed {seed}: {body}"
            );
            assert_eq!(choice["message"]["content"], Value::Null, "{body}");
            let calls = choice["message"]["tool_calls"]
                .as_array()
                .expect("tool_calls");
            assert_eq!(calls.len(), 1, "{body}");
            check_id(&calls[0]);
            check_function(&calls[0], allowed);
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn streamed_mistral_calls_come_as_tool_call_deltas() {
    let server = server(&mistral_model("mistral-stream.gguf", MISTRAL_TEMPLATE)).await;
    let (choice, allowed) = forced_choice(1);
    let mut body = request(choice, 4);
    body["stream"] = json!(true);
    let reply = post(server.addr, "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let mut calls = Vec::new();
    let mut finish = None;
    for data in reply.sse_data().iter().filter(|d| d.as_str() != "[DONE]") {
        let chunk: Value = serde_json::from_str(data).expect("chunk");
        let choice = &chunk["choices"][0];
        if let Some(delta_calls) = choice["delta"]["tool_calls"].as_array() {
            calls.extend(delta_calls.iter().cloned());
        }
        assert!(
            choice["delta"]["content"]
                .as_str()
                .is_none_or(str::is_empty),
            "neither text nor the marker around a forced call: {chunk}"
        );
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["index"], 0);
    check_id(&calls[0]);
    check_function(&calls[0], allowed);
    server.stop().await;
}

#[tokio::test]
async fn a_returned_call_and_its_result_render_on_the_next_turn() {
    let server = server(&mistral_model("mistral-history.gguf", MISTRAL_TEMPLATE)).await;
    let user = json!({"role": "user", "content": "Weather in Oslo?"});
    let first = post(
        server.addr,
        "/v1/chat/completions",
        &request(forced_choice(0).0, 2),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let message = first.json()["choices"][0]["message"].clone();
    let returned = message["tool_calls"][0].clone();
    let ask = |messages: Value| {
        json!({"messages": messages, "tools": tool_list(), "tool_choice": "auto",
               "max_tokens": 1, "temperature": 0})
    };
    let short = post(server.addr, "/v1/chat/completions", &ask(json!([user]))).await;
    assert_eq!(short.status, 200, "{}", short.body);
    let tokens = |r: &Reply| r.json()["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    // The call as it came back, and one with an OpenAI-style id the template would refuse
    // as it is: both reach the template with the result that answers them.
    for call in [
        returned.clone(),
        json!({"id": "call_abc", "type": "function",
               "function": {"name": "now", "arguments": "{}"}}),
    ] {
        let assistant = json!({"role": "assistant", "content": null, "tool_calls": [call]});
        let result = json!({"role": "tool", "tool_call_id": call["id"], "content": "12 degrees"});
        let long = post(
            server.addr,
            "/v1/chat/completions",
            &ask(json!([user, assistant, result, {"role": "user", "content": "And now?"}])),
        )
        .await;
        assert_eq!(long.status, 200, "{call}: {}", long.body);
        // The call's JSON and the result, byte tokens mostly: far more than a few tokens.
        let added = tokens(&long) - tokens(&short);
        assert!(added >= 40, "the history added {added} tokens");
    }
    server.stop().await;
}
