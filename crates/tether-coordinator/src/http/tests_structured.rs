//! Constrained output over real sockets: `response_format`, `json_schema` and `grammar`
//! against the coordinator over an embedded worker running a tiny random model. Every
//! output must parse and validate, whatever the model prefers.

use futures::future::join_all;
use serde_json::{Value, json};

use super::HttpOptions;
use super::test_support::{TEST_CTX, TestServer, engine_with, post, tiny_model};

/// The JSON-schema keywords the validator below checks; the schemas use no others.
pub(super) fn validate(v: &Value, schema: &Value, at: &str) -> Result<(), String> {
    let fail = |what: String| Err(format!("{at}: {what}; value {v}"));
    if let Some(options) = schema.get("enum").and_then(Value::as_array)
        && !options.contains(v)
    {
        return fail("not one of the enum".into());
    }
    let count = |key: &str| schema.get(key).and_then(Value::as_u64);
    let number = |key: &str| schema.get(key).and_then(Value::as_f64);
    match schema.get("type").and_then(Value::as_str) {
        Some("object") => {
            let Some(fields) = v.as_object() else {
                return fail("not an object".into());
            };
            let props = schema.get("properties").and_then(Value::as_object);
            for name in schema["required"].as_array().into_iter().flatten() {
                if !fields.contains_key(name.as_str().unwrap_or_default()) {
                    return fail(format!("required {name} missing"));
                }
            }
            for (name, value) in fields {
                match props.and_then(|p| p.get(name)) {
                    Some(s) => validate(value, s, &format!("{at}.{name}"))?,
                    None if schema["additionalProperties"] == json!(false) => {
                        return fail(format!("unexpected property {name}"));
                    }
                    None => {}
                }
            }
        }
        Some("array") => {
            let Some(items) = v.as_array() else {
                return fail("not an array".into());
            };
            let n = items.len() as u64;
            if count("minItems").is_some_and(|m| n < m) || count("maxItems").is_some_and(|m| n > m)
            {
                return fail(format!("{n} items"));
            }
            for (i, item) in items.iter().enumerate() {
                validate(item, &schema["items"], &format!("{at}[{i}]"))?;
            }
        }
        Some("string") => {
            let Some(s) = v.as_str() else {
                return fail("not a string".into());
            };
            let n = s.chars().count() as u64;
            if count("minLength").is_some_and(|m| n < m)
                || count("maxLength").is_some_and(|m| n > m)
            {
                return fail(format!("{n} characters"));
            }
        }
        Some(kind @ ("integer" | "number")) => {
            let Some(x) = v.as_f64() else {
                return fail("not a number".into());
            };
            if kind == "integer" && !(v.is_i64() || v.is_u64()) {
                return fail("not an integer".into());
            }
            if number("minimum").is_some_and(|m| x < m) || number("maximum").is_some_and(|m| x > m)
            {
                return fail("out of range".into());
            }
        }
        Some("boolean") if !v.is_boolean() => return fail("not a boolean".into()),
        _ => {}
    }
    Ok(())
}

/// Schemas with nesting, enums, arrays, numbers, strings with escapes and required fields,
/// bounded so that a random model finishes them within `max_tokens`.
fn schemas() -> Vec<Value> {
    let short = |n: u64| json!({"type": "string", "maxLength": n});
    vec![
        json!({
            "type": "object",
            "properties": {
                "name": short(6),
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "ok": {"type": "boolean"},
            },
            "required": ["name", "age", "ok"],
            "additionalProperties": false,
        }),
        json!({
            "type": "object",
            "properties": {
                "color": {"enum": ["red", "green", "say \"hi\"\n"]},
                "scores": {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5},
                           "minItems": 1, "maxItems": 3},
            },
            "required": ["color", "scores"],
            "additionalProperties": false,
        }),
        json!({
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "tag": short(4)},
                    "required": ["id", "tag"],
                    "additionalProperties": false,
                },
                "items": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}},
                              "required": ["k"], "additionalProperties": false},
                    "maxItems": 2,
                },
            },
            "required": ["user", "items"],
            "additionalProperties": false,
        }),
        json!({
            "type": "array",
            "items": short(5),
            "minItems": 2,
            "maxItems": 3,
        }),
    ]
}

/// A generation's text and finish reason from either endpoint's reply.
fn text_and_finish(body: &Value) -> (String, String) {
    let choice = &body["choices"][0];
    let text = choice["text"]
        .as_str()
        .or_else(|| choice["message"]["content"].as_str())
        .unwrap_or_default()
        .to_string();
    (text, choice["finish_reason"].as_str().unwrap_or("").into())
}

async fn server() -> TestServer {
    let engine = engine_with(tiny_model(), TEST_CTX, 64, 1 << 30, |c| c.parallel = 4).await;
    // Constrained requests are prepared as heavy work; the tests send eight at once.
    let opts = HttpOptions {
        max_heavy_requests: 16,
        ..HttpOptions::default()
    };
    TestServer::start(engine, opts).await
}

/// 1,000 seeded generations, sampled at temperature 1 on both endpoints, over
/// `json_object` and the schemas: every one ends by its grammar, parses and validates.
#[tokio::test]
async fn a_thousand_seeded_generations_all_parse_and_validate() {
    let server = server().await;
    let schemas = schemas();
    let mut cases = Vec::new();
    for seed in 0..1000u64 {
        // One in five is plain `json_object`; the rest go round the schemas.
        let schema = (seed % 5 != 0).then(|| schemas[seed as usize % schemas.len()].clone());
        let format = match &schema {
            Some(s) => {
                json!({"type": "json_schema", "json_schema": {"name": "t", "schema": s, "strict": true}})
            }
            None => json!({"type": "json_object"}),
        };
        let common =
            json!({"max_tokens": 160, "temperature": 1.0, "seed": seed, "response_format": format});
        let (path, mut body) = if seed % 2 == 0 {
            ("/v1/completions", json!({"prompt": "Reply in JSON:"}))
        } else {
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "Reply in JSON."}]}),
            )
        };
        for (k, v) in common.as_object().into_iter().flatten() {
            body[k] = v.clone();
        }
        cases.push((seed, path, body, schema));
    }
    let mut unfinished_objects = 0;
    for chunk in cases.chunks(8) {
        let replies = join_all(
            chunk
                .iter()
                .map(|(_, path, body, _)| post(server.addr, path, body)),
        )
        .await;
        for ((seed, _, _, schema), reply) in chunk.iter().zip(replies) {
            assert_eq!(reply.status, 200, "seed {seed}: {}", reply.body);
            let (text, finish) = text_and_finish(&reply.json());
            if schema.is_none() && finish == "length" {
                // Free-form objects may nest past max_tokens; they are counted below.
                unfinished_objects += 1;
                continue;
            }
            assert_eq!(finish, "stop", "seed {seed}: {text}");
            let value: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
            match schema {
                Some(schema) => validate(&value, schema, "$")
                    .unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}")),
                None => assert!(value.is_object(), "seed {seed}: {text}"),
            }
        }
    }
    assert!(
        unfinished_objects <= 20,
        "{unfinished_objects} of 200 json_object generations did not finish"
    );
    server.stop().await;
}

#[tokio::test]
async fn greedy_streamed_and_scored_constrained_outputs_parse() {
    let server = server().await;
    let schema = &schemas()[0];
    let format = json!({"type": "json_schema", "json_schema": {"name": "p", "schema": schema}});
    // Greedy: the worker returns candidates, not its arg-max, for a constrained row.
    let greedy = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 160, "temperature": 0, "response_format": format,
                "logprobs": 2}),
    )
    .await;
    assert_eq!(greedy.status, 200, "{}", greedy.body);
    let body = greedy.json();
    let (text, finish) = text_and_finish(&body);
    assert_eq!(finish, "stop", "{text}");
    let value: Value = serde_json::from_str(&text).expect("parses");
    validate(&value, schema, "$").expect("validates");
    let tokens = body["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .expect("tokens");
    assert_eq!(
        tokens.len(),
        body["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize
    );
    let streamed = post(
        server.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "go"}], "max_tokens": 160,
                "temperature": 0.9, "seed": 5, "stream": true, "response_format": format}),
    )
    .await;
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    let mut text = String::new();
    let mut finish = String::new();
    for data in streamed.sse_data() {
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(&data).expect("chunk JSON");
        let choice = &chunk["choices"][0];
        text.push_str(choice["delta"]["content"].as_str().unwrap_or_default());
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = f.into();
        }
    }
    assert_eq!(finish, "stop", "{text}");
    let value: Value = serde_json::from_str(&text).expect("the streamed text parses");
    validate(&value, schema, "$").expect("validates");
    server.stop().await;
}

#[tokio::test]
async fn a_lark_grammar_and_a_json_schema_field_constrain_completions() {
    let server = server().await;
    for seed in 0..20u64 {
        let reply = post(
            server.addr,
            "/v1/completions",
            &json!({"prompt": "answer:", "max_tokens": 40, "temperature": 1.0, "seed": seed,
                    "grammar": r#"start: ("yes" | "no") ", " /[0-9]{1,3}/ "!""#}),
        )
        .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let (text, finish) = text_and_finish(&reply.json());
        assert_eq!(finish, "stop", "{text}");
        let (word, rest) = text.split_once(", ").unwrap_or_else(|| panic!("{text}"));
        let number = rest.strip_suffix('!').unwrap_or_else(|| panic!("{text}"));
        assert!(matches!(word, "yes" | "no"), "{text}");
        assert!(
            (1..=3).contains(&number.len()) && number.bytes().all(|b| b.is_ascii_digit()),
            "{text}"
        );
    }
    let schema = json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4});
    let reply = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "n:", "max_tokens": 40, "temperature": 1.0, "seed": 1, "json_schema": schema}),
    )
    .await;
    let (text, finish) = text_and_finish(&reply.json());
    assert_eq!(finish, "stop", "{text}");
    validate(&serde_json::from_str(&text).expect("parses"), &schema, "$").expect("validates");
    // Cut short, the output cannot be complete: finish says so.
    let cut = post(
        server.addr,
        "/v1/completions",
        &json!({"prompt": "n:", "max_tokens": 2, "temperature": 0,
                "json_schema": {"type": "object", "properties": {"long_name": {"type": "string"}}, "required": ["long_name"]}}),
    )
    .await;
    let (text, finish) = text_and_finish(&cut.json());
    assert_eq!(finish, "length", "{text}");
    assert!(serde_json::from_str::<Value>(&text).is_err(), "{text}");
    server.stop().await;
}

#[tokio::test]
async fn bad_constraints_are_refused_naming_the_field() {
    let server = server().await;
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().into_iter().flatten() {
            body[k] = v.clone();
        }
        body
    };
    for (body, param, says) in [
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}}),
            ),
            "response_format",
            "dependentSchemas",
        ),
        (
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
            "response_format.json_schema.schema",
            "missing",
        ),
        (
            chat(json!({"response_format": {"type": "xml"}})),
            "response_format.type",
            "xml",
        ),
        (
            chat(json!({"response_format": "json"})),
            "response_format",
            "type",
        ),
        (
            chat(json!({"grammar": "root ::= \"a\""})),
            "grammar",
            "GBNF",
        ),
        (
            chat(json!({"grammar": "start: missing_rule"})),
            "grammar",
            "missing_rule",
        ),
        (
            chat(json!({"grammar": "start: \"a\"", "response_format": {"type": "json_object"}})),
            "grammar",
            "response_format",
        ),
        (
            chat(json!({"response_format": {"type": "json_object"}, "min_tokens": 2})),
            "min_tokens",
            "grammar",
        ),
        (
            chat(json!({"json_schema": [1]})),
            "json_schema",
            "schema object",
        ),
    ] {
        let reply = post(server.addr, "/v1/chat/completions", &body).await;
        assert_eq!(reply.status, 400, "{body}: {}", reply.body);
        let error = &reply.json()["error"];
        assert_eq!(error["param"], param, "{body}: {error}");
        assert!(
            error["message"].as_str().is_some_and(|m| m.contains(says)),
            "{body}: {error}"
        );
    }
    // A text format asks for nothing.
    let plain = post(
        server.addr,
        "/v1/chat/completions",
        &chat(json!({"response_format": {"type": "text"}, "max_tokens": 2})),
    )
    .await;
    assert_eq!(plain.status, 200, "{}", plain.body);
    server.stop().await;
}

/// Time per generated token with a JSON schema against without, through the API on the
/// cpu (`cargo test -p tether-coordinator --release bench_constrained -- --ignored
/// --nocapture`; `TETHER_BENCH_MODEL=FILE` for another model than the tiny one). The GPU
/// figure comes from `tether bench --serve --json-schema FILE` ([cli.md]).
#[tokio::test]
#[ignore = "a benchmark: prints figures, asserts nothing about speed"]
async fn bench_constrained_decode() {
    let model = std::env::var_os("TETHER_BENCH_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| tiny_model().to_path_buf());
    let engine = engine_with(&model, 512, 4, 1 << 34, |c| c.parallel = 1).await;
    let server = TestServer::start(engine, HttpOptions::default()).await;
    // A string that cannot end before max_tokens: every request generates them all
    // (`TETHER_BENCH_SCHEMA`: another schema, whose requests may end sooner).
    let schema = match std::env::var("TETHER_BENCH_SCHEMA") {
        Ok(text) => serde_json::from_str(&text).expect("TETHER_BENCH_SCHEMA is JSON"),
        Err(_) => {
            json!({"type": "object", "properties": {"text": {"type": "string", "minLength": 100000}},
                         "required": ["text"]})
        }
    };
    let n = 200;
    let run = |format: Option<Value>| {
        let mut body =
            json!({"prompt": "Write:", "max_tokens": n, "temperature": 0, "ignore_eos": true});
        if let Some(f) = format {
            body["response_format"] = f;
        }
        body
    };
    let plain = run(None);
    let constrained = run(Some(
        json!({"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}),
    ));
    let mut per_token = Vec::new();
    for (name, body) in [("plain", &plain), ("json_schema", &constrained)] {
        // Warm-up (the first constrained request indexes the vocabulary).
        post(server.addr, "/v1/completions", body).await;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let started = std::time::Instant::now();
            let reply = post(server.addr, "/v1/completions", body).await;
            let tokens = reply.json()["usage"]["completion_tokens"]
                .as_u64()
                .unwrap_or(0);
            assert!(tokens > 0, "{}", reply.body);
            best = best.min(started.elapsed().as_secs_f64() / tokens as f64);
        }
        println!(
            "{name}: {:.1} us a token (best of 5, at most {n} tokens)",
            best * 1e6
        );
        per_token.push(best);
    }
    println!(
        "json_schema costs {:+.1}% a token",
        (per_token[1] / per_token[0] - 1.0) * 100.0
    );
    server.stop().await;
}
