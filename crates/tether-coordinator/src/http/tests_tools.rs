//! Tool calling over real sockets: tiny random models whose GGUF carries a Qwen-style
//! (`<tool_call>`) or a Llama-3-style (JSON) chat template, forced calls, streamed call
//! deltas, tool messages in the history, and the `openai` Python client when installed.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tether_gguf::{GgmlType, MetaValue};
use tether_model::SynthShape;

use super::HttpOptions;
use super::test_support::{TestServer, engine, engine_with, post, test_dir};
use super::tests_structured::validate;

/// A Qwen/Hermes-style template: tools listed in a system turn, calls in `<tool_call>`.
const HERMES_TEMPLATE: &str = r#"{%- if tools %}<|im_start|>system
You may call functions. Their signatures:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>
{"name": <name>, "arguments": <arguments object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;

/// A Llama-3.1-style template: an `ipython` environment, calls as one JSON object with
/// `parameters`.
const LLAMA3_TEMPLATE: &str = r#"{{ bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
Answer with a JSON object {"name": function name, "parameters": its arguments} to call one of:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"#;

/// The tiny model with `template` as its `tokenizer.chat_template`, written by our writer.
pub(super) fn templated_model(name: &str, template: &str) -> PathBuf {
    let path = test_dir().join(name);
    let extra = vec![(
        "tokenizer.chat_template".to_string(),
        MetaValue::String(template.to_string()),
    )];
    tether_model::synthesize_with(&path, SynthShape::Tiny, GgmlType::Q8_0, 7, extra)
        .expect("synthesizing the templated model");
    path
}

pub(super) fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 8},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": false,
    })
}

pub(super) fn tool_list() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
         "parameters": weather_schema()}},
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
         "additionalProperties": false}}},
    ])
}

pub(super) async fn server(model: &Path) -> TestServer {
    let opts = HttpOptions {
        max_heavy_requests: 16,
        ..HttpOptions::default()
    };
    // The tools make long system prompts of byte tokens.
    TestServer::start(engine(model, 2048, 8).await, opts).await
}

pub(super) fn request(choice: Value, seed: u64) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": tool_list(),
        "tool_choice": choice,
        "max_tokens": 200,
        "temperature": 1.0,
        "seed": seed,
    })
}

/// Checks one returned call: a known function whose arguments follow its schema.
fn check_call(call: &Value, allowed: &[&str]) {
    assert!(
        call["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("call_")),
        "{call}"
    );
    check_function(call, allowed);
}

/// Checks a returned call but its id: a known function whose arguments follow its schema.
pub(super) fn check_function(call: &Value, allowed: &[&str]) {
    assert_eq!(call["type"], "function", "{call}");
    let name = call["function"]["name"].as_str().expect("a name");
    assert!(allowed.contains(&name), "{call}");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().expect("a string"))
            .unwrap_or_else(|e| panic!("{call}: {e}"));
    let schema = match name {
        "get_weather" => weather_schema(),
        _ => json!({"type": "object", "additionalProperties": false}),
    };
    validate(&args, &schema, "$").unwrap_or_else(|e| panic!("{call}: {e}"));
}

#[tokio::test]
async fn forced_calls_come_back_as_tool_calls_for_both_template_families() {
    for (file, template) in [
        ("hermes.gguf", HERMES_TEMPLATE),
        ("llama3.gguf", LLAMA3_TEMPLATE),
    ] {
        let server = server(&templated_model(file, template)).await;
        for seed in 0..12u64 {
            let (choice, allowed): (Value, &[&str]) = if seed % 2 == 0 {
                (
                    json!({"type": "function", "function": {"name": "get_weather"}}),
                    &["get_weather"],
                )
            } else {
                (json!("required"), &["get_weather", "now"])
            };
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
            check_call(&calls[0], allowed);
        }
        server.stop().await;
    }
}

#[tokio::test]
async fn streamed_calls_come_as_tool_call_deltas() {
    let server = server(&templated_model("hermes-stream.gguf", HERMES_TEMPLATE)).await;
    let mut body = request(
        json!({"type": "function", "function": {"name": "get_weather"}}),
        3,
    );
    body["stream"] = json!(true);
    let reply = post(server.addr, "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let mut calls = Vec::new();
    let mut finish = None;
    for data in reply.sse_data() {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).expect("chunk");
        let choice = &chunk["choices"][0];
        if let Some(delta_calls) = choice["delta"]["tool_calls"].as_array() {
            calls.extend(delta_calls.iter().cloned());
        }
        assert!(
            choice["delta"]["content"]
                .as_str()
                .is_none_or(str::is_empty),
            "no text around a forced call: {chunk}"
        );
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    assert_eq!(finish.as_deref(), Some("tool_calls"));
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0]["index"], 0);
    check_call(&calls[0], &["get_weather"]);
    server.stop().await;
}

#[tokio::test]
async fn every_choice_of_a_forced_call_follows_its_own_grammar() {
    let model = templated_model("hermes-choices.gguf", HERMES_TEMPLATE);
    let engine = engine_with(&model, 2048, 8, 1 << 30, |c| c.parallel = 3).await;
    let opts = HttpOptions {
        max_heavy_requests: 16,
        ..HttpOptions::default()
    };
    let server = TestServer::start(engine, opts).await;
    let mut body = request(json!("required"), 5);
    body["n"] = json!(3);
    let reply = post(server.addr, "/v1/chat/completions", &body).await;
    assert_eq!(reply.status, 200, "{}", reply.body);
    let whole = reply.json();
    let choices = whole["choices"].as_array().expect("choices");
    assert_eq!(choices.len(), 3, "{whole}");
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(choice["index"], i);
        assert_eq!(choice["finish_reason"], "tool_calls", "{whole}");
        let calls = choice["message"]["tool_calls"].as_array().expect("calls");
        assert_eq!(calls.len(), 1, "{whole}");
        check_call(&calls[0], &["get_weather", "now"]);
    }
    body["stream"] = json!(true);
    let reply = post(server.addr, "/v1/chat/completions", &body).await;
    let mut calls = vec![Vec::new(); 3];
    for data in reply.sse_data().iter().filter(|d| d.as_str() != "[DONE]") {
        let chunk: Value = serde_json::from_str(data).expect("chunk");
        for choice in chunk["choices"].as_array().expect("choices") {
            let i = choice["index"].as_u64().expect("index") as usize;
            if let Some(delta) = choice["delta"]["tool_calls"].as_array() {
                calls[i].extend(delta.iter().cloned());
            }
        }
    }
    for (i, choice) in choices.iter().enumerate() {
        assert_eq!(calls[i].len(), 1, "choice {i} streams its call: {calls:?}");
        let streamed = &calls[i][0]["function"];
        assert_eq!(
            streamed, &choice["message"]["tool_calls"][0]["function"],
            "a streamed choice calls as the whole one did"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn tool_results_in_the_history_reach_the_template() {
    let server = server(&templated_model("hermes-history.gguf", HERMES_TEMPLATE)).await;
    let user = json!({"role": "user", "content": "Weather in Oslo?"});
    let call = json!({"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"celsius\"}"}});
    let assistant = json!({"role": "assistant", "content": null, "tool_calls": [call]});
    let result =
        json!({"role": "tool", "tool_call_id": "call_1", "content": "12 degrees and raining"});
    let ask = |messages: Value| {
        json!({"messages": messages, "tools": tool_list(), "tool_choice": "none", "max_tokens": 1,
               "temperature": 0})
    };
    let short = post(server.addr, "/v1/chat/completions", &ask(json!([user]))).await;
    let long = post(
        server.addr,
        "/v1/chat/completions",
        &ask(json!([user, assistant, result])),
    )
    .await;
    assert_eq!(long.status, 200, "{}", long.body);
    let tokens =
        |r: &super::test_support::Reply| r.json()["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    // The call and the result, byte tokens mostly: far more than a few tokens.
    let added = tokens(&long) - tokens(&short);
    let expected = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Oslo\",\"unit\":\"celsius\"}}\n</tool_call><tool_response>\n12 degrees and raining\n</tool_response>".len() as u64;
    assert!(added >= expected / 2, "the history added {added} tokens");
    // `none` never parses a call, and plain chat without tools is unchanged.
    assert_ne!(long.json()["choices"][0]["finish_reason"], "tool_calls");
    server.stop().await;
}

/// The `openai` Python package against the server, when it is installed (CI installs it).
#[tokio::test]
async fn the_openai_python_client_gets_tool_calls_json_and_embeddings() {
    let has_openai = tokio::process::Command::new("python3")
        .args(["-c", "import openai"])
        .output()
        .await
        .is_ok_and(|o| o.status.success());
    if !has_openai {
        eprintln!("skipped: the openai Python package is not installed (pip install openai)");
        return;
    }
    let script = r#"
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused")
tools = json.loads(sys.argv[2])
r = client.chat.completions.create(model=sys.argv[4], messages=[{"role": "user", "content": "Weather?"}],
    tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=200, seed=1)
c = r.choices[0]
assert c.finish_reason == "tool_calls", c
call = c.message.tool_calls[0]
args = json.loads(call.function.arguments)
assert call.function.name == "get_weather" and set(args) == {"city", "unit"}, call
stream = client.chat.completions.create(model=sys.argv[4], messages=[{"role": "user", "content": "Weather?"}],
    tools=tools, tool_choice="required", max_tokens=200, seed=2, stream=True)
names, finish = [], None
for chunk in stream:
    d = chunk.choices[0].delta
    for tc in d.tool_calls or []:
        names.append(tc.function.name)
    finish = chunk.choices[0].finish_reason or finish
assert finish == "tool_calls" and names and names[0] in ("get_weather", "now"), (finish, names)
j = client.chat.completions.create(model=sys.argv[4], messages=[{"role": "user", "content": "JSON"}],
    response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": json.loads(sys.argv[3])}},
    max_tokens=200, seed=3)
json.loads(j.choices[0].message.content)
# The client asks for base64 vectors unless told otherwise, and decodes them.
e = client.embeddings.create(model=sys.argv[4], input=["ba be", "bi"])
assert [d.index for d in e.data] == [0, 1], e
assert abs(sum(x * x for x in e.data[0].embedding) - 1) < 1e-3, e.data[0]
f = client.embeddings.create(model=sys.argv[4], input="bo", encoding_format="float", dimensions=4)
assert len(f.data[0].embedding) == 4, f
print("ok")
"#;
    // A Qwen/Hermes template and a Llama 3 one: each format's calls through the client.
    for (name, template) in [
        ("hermes-openai", HERMES_TEMPLATE),
        ("llama3-openai", LLAMA3_TEMPLATE),
    ] {
        let server = server(&templated_model(&format!("{name}.gguf"), template)).await;
        let base = format!("http://{}/v1", server.addr);
        let out = tokio::process::Command::new("python3")
            .args([
                "-c",
                script,
                &base,
                &tool_list().to_string(),
                &weather_schema().to_string(),
                name,
            ])
            .output()
            .await
            .expect("running python3");
        assert!(
            out.status.success(),
            "stdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        server.stop().await;
    }
}
