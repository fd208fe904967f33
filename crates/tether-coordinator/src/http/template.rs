//! Chat prompts rendered with the model's Jinja template (`tokenizer.chat_template`), the
//! way Hugging Face's `apply_chat_template` does, or with ChatML when the model has none.

use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use tether_model::tokenizer::Tokenizer;

use crate::api::ModelInfo;

/// The template used when the model carries none.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\
{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// ChatML's end-of-turn marker, a stop string when the vocabulary lacks it as a token.
pub const CHATML_END: &str = "<|im_end|>";

const TEMPLATE_NAME: &str = "chat";

/// How much work one rendering of a chat template may do. A template comes from the model
/// file, so it may be hostile: a loop of 10^10 steps or a prompt of gigabytes must fail the
/// one request instead of holding a thread and memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateBudget {
    /// MiniJinja instructions one rendering may execute (its "fuel").
    pub fuel: u64,
    /// Largest rendered prompt, in bytes.
    pub max_output_bytes: usize,
    /// Deepest nesting of loops, blocks and macro calls.
    pub recursion_limit: usize,
}

impl Default for TemplateBudget {
    /// Real templates (Llama 3, Qwen3 with tools) spend a few hundred instructions a
    /// message; 10 million is thousands of long conversations' worth and a fraction of a
    /// second of one core.
    fn default() -> Self {
        Self {
            fuel: 10_000_000,
            max_output_bytes: 64 << 20,
            recursion_limit: 100,
        }
    }
}

/// One message of a conversation, as the template sees it (fields left `None` are
/// undefined there, as templates test them with `is defined`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The text.
    pub content: String,
    /// An assistant message's calls, each call's `function.arguments` an object.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// The call a `tool` message answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The participant's (or function's) name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// Why a template could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template's source does not parse.
    #[error("the chat template does not compile: {0:#}")]
    Compile(minijinja::Error),
    /// Rendering failed, e.g. the template raised an exception about the messages.
    #[error("rendering the chat template: {0:#}")]
    Render(minijinja::Error),
    /// The template ran out of its instruction budget (a runaway loop, likely hostile).
    #[error(
        "the chat template exceeded its rendering budget of {fuel} instructions \
         (--template-fuel); the model's template loops too long for these messages"
    )]
    OutOfFuel {
        /// The budget it ran out of.
        fuel: u64,
    },
    /// The rendered prompt grew past the output limit.
    #[error(
        "the chat template's output exceeded its limit of {max_output_bytes} bytes \
         (--template-max-output); send shorter messages"
    )]
    OutputTooLarge {
        /// The limit it went past.
        max_output_bytes: usize,
    },
}

impl TemplateError {
    /// Whether the model's template, not the request, is at fault (a server error).
    pub fn is_server_fault(&self) -> bool {
        matches!(self, Self::OutOfFuel { .. })
    }
}

/// A compiled chat template with the special-token texts it may use.
pub struct ChatTemplate {
    env: Environment<'static>,
    budget: TemplateBudget,
    bos_token: String,
    eos_token: String,
    chatml_fallback: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("chatml_fallback", &self.chatml_fallback)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source` (ChatML when `None`) with the default budget.
    pub fn new(
        source: Option<&str>,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, TemplateError> {
        Self::with_budget(source, bos_token, eos_token, TemplateBudget::default())
    }

    /// Compiles `source` (ChatML when `None`); each rendering runs under `budget`.
    pub fn with_budget(
        source: Option<&str>,
        bos_token: &str,
        eos_token: &str,
        budget: TemplateBudget,
    ) -> Result<Self, TemplateError> {
        let mut env = budgeted_env(budget);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source.unwrap_or(CHATML_TEMPLATE).to_owned())
            .map_err(TemplateError::Compile)?;
        Ok(Self {
            env,
            budget,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            chatml_fallback: source.is_none(),
        })
    }

    /// The template of `info`'s model, or ChatML when it has none or its template does not
    /// compile (logged, since replies will then likely be poor).
    pub fn for_model(info: &ModelInfo, tokenizer: &Tokenizer, budget: TemplateBudget) -> Self {
        let text = |id: Option<u32>| {
            id.and_then(|id| tokenizer.token_text(id))
                .unwrap_or("")
                .to_owned()
        };
        let (bos, eos) = (text(tokenizer.bos()), text(tokenizer.eos()));
        match ChatTemplate::with_budget(info.chat_template.as_deref(), &bos, &eos, budget) {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(model = %info.id, error = %e, "using ChatML instead of the model's chat template");
                Self::chatml(&bos, &eos, budget)
            }
        }
    }

    /// The ChatML fallback.
    fn chatml(bos_token: &str, eos_token: &str, budget: TemplateBudget) -> Self {
        let mut env = budgeted_env(budget);
        // The built-in template is a constant that compiles; a failure would show in tests.
        let _ = env.add_template(TEMPLATE_NAME, CHATML_TEMPLATE);
        Self {
            env,
            budget,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            chatml_fallback: true,
        }
    }

    /// Whether this is the ChatML fallback rather than the model's own template.
    pub fn is_chatml_fallback(&self) -> bool {
        self.chatml_fallback
    }

    /// The BOS token's text as the template sees it.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The prompt for `messages`, ending with the assistant's turn opened.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, TemplateError> {
        self.render_with_tools(messages, None)
    }

    /// [`ChatTemplate::render`] with the `tools` variable (a list of
    /// `{"type": "function", "function": {...}}`, as Hugging Face passes it).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(TemplateError::Render)?;
        let mut out = BoundedOutput {
            bytes: Vec::new(),
            limit: self.budget.max_output_bytes,
            overflowed: false,
        };
        let rendered = template.render_captured_to(
            minijinja::context! {
                messages => messages,
                tools => tools,
                add_generation_prompt => true,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            },
            &mut out,
        );
        match rendered {
            Ok(_) => String::from_utf8(out.bytes).map_err(|_| {
                TemplateError::Render(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "the rendered prompt is not UTF-8",
                ))
            }),
            Err(_) if out.overflowed => Err(TemplateError::OutputTooLarge {
                max_output_bytes: self.budget.max_output_bytes,
            }),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(TemplateError::OutOfFuel {
                fuel: self.budget.fuel,
            }),
            Err(e) => Err(TemplateError::Render(e)),
        }
    }
}

/// An environment with Hugging Face's options and `budget`'s fuel and recursion limit.
fn budgeted_env(budget: TemplateBudget) -> Environment<'static> {
    // Hugging Face renders chat templates with these two Jinja options on.
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_fuel(Some(budget.fuel));
    env.set_recursion_limit(budget.recursion_limit);
    env
}

/// The rendered bytes, refusing to grow past `limit` (minijinja has no output limit).
struct BoundedOutput {
    bytes: Vec<u8>,
    limit: usize,
    overflowed: bool,
}

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("chat template output limit"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(role, content)| ChatMessage {
                role: (*role).into(),
                content: (*content).into(),
                ..ChatMessage::default()
            })
            .collect()
    }

    /// The template Meta published with Llama 3 Instruct.
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}\
{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}\
{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

    #[test]
    fn llama3_template_renders_headers_and_bos() {
        let t = ChatTemplate::new(Some(LLAMA3), "<|begin_of_text|>", "<|end_of_text|>")
            .expect("compiles");
        let out = t
            .render(&msgs(&[("system", "Be brief. "), ("user", "Hi")]))
            .expect("renders");
        let want = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
<|start_header_id|>assistant<|end_header_id|>\n\n";
        assert_eq!(out, want);
    }

    /// The shape of the template Qwen3's GGUF files carry (tool parts left out): a reversed
    /// scan with `namespace` for the last user turn, `<think>` blocks split off earlier
    /// assistant turns with Python string methods, and `enable_thinking`.
    const QWEN3: &str = r#"{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"#;

    /// Qwen3's template renders: earlier assistant turns lose their `<think>` block, and
    /// with `enable_thinking` undefined (the API has no way to set it) the generation prompt
    /// leaves the model free to think, as Hugging Face's default does.
    #[test]
    fn qwen3_template_renders_with_thinking_on() {
        let t = ChatTemplate::new(Some(QWEN3), "", "<|im_end|>").expect("compiles");
        let out = t
            .render(&msgs(&[
                ("system", "Be brief."),
                ("user", "Hi"),
                ("assistant", "<think>\nThey greet me.\n</think>\n\nHello!"),
                ("user", "Bye"),
            ]))
            .expect("renders");
        let want = "<|im_start|>system\nBe brief.<|im_end|>\n\
<|im_start|>user\nHi<|im_end|>\n\
<|im_start|>assistant\nHello!<|im_end|>\n\
<|im_start|>user\nBye<|im_end|>\n\
<|im_start|>assistant\n";
        assert_eq!(out, want);
    }

    #[test]
    fn chatml_fallback_when_no_template() {
        let t = ChatTemplate::new(None, "<s>", "</s>").expect("compiles");
        assert!(t.is_chatml_fallback());
        let out = t
            .render(&msgs(&[
                ("user", "Hello"),
                ("assistant", "Hi!"),
                ("user", "Bye"),
            ]))
            .expect("renders");
        assert_eq!(
            out,
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi!<|im_end|>\n\
<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_are_on() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(Some(src), "", "").expect("compiles");
        assert_eq!(
            t.render(&msgs(&[("user", "a"), ("user", "b")]))
                .expect("renders"),
            "[a]\n[b]\n"
        );
    }

    #[test]
    fn python_string_methods_work() {
        let src = "{% for m in messages %}{% if m.content.startswith('x') %}{{ m.content.strip().upper() }}{% endif %}{% endfor %}";
        let t = ChatTemplate::new(Some(src), "", "").expect("compiles");
        assert_eq!(
            t.render(&msgs(&[("user", "x y "), ("user", "no")]))
                .expect("renders"),
            "X Y"
        );
    }

    #[test]
    fn raise_exception_fails_the_render_with_its_message() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('roles must start with user') }}{% endif %}ok";
        let t = ChatTemplate::new(Some(src), "", "").expect("compiles");
        let err = t.render(&msgs(&[("assistant", "x")])).expect_err("raises");
        assert!(
            err.to_string().contains("roles must start with user"),
            "{err}"
        );
        assert_eq!(t.render(&msgs(&[("user", "x")])).expect("renders"), "ok");
    }

    #[test]
    fn broken_template_is_a_compile_error() {
        let err = ChatTemplate::new(Some("{% for m in messages %}"), "", "").expect_err("fails");
        assert!(matches!(err, TemplateError::Compile(_)));
    }

    #[test]
    fn runaway_loops_run_out_of_fuel() {
        let src =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let t = ChatTemplate::new(Some(src), "", "").expect("compiles");
        let started = std::time::Instant::now();
        let err = t.render(&msgs(&[("user", "x")])).expect_err("out of fuel");
        assert!(matches!(err, TemplateError::OutOfFuel { .. }), "{err}");
        assert!(err.to_string().contains("rendering budget"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn output_past_the_limit_fails() {
        let budget = TemplateBudget {
            max_output_bytes: 1000,
            ..TemplateBudget::default()
        };
        let src = "{% for i in range(10000) %}xxxxxxxxxx{% endfor %}";
        let t = ChatTemplate::with_budget(Some(src), "", "", budget).expect("compiles");
        let err = t.render(&msgs(&[("user", "x")])).expect_err("too large");
        assert!(
            matches!(
                err,
                TemplateError::OutputTooLarge {
                    max_output_bytes: 1000
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn builtin_chatml_fallback_compiles() {
        let t = ChatTemplate::chatml("<s>", "</s>", TemplateBudget::default());
        assert!(
            t.render(&msgs(&[("user", "q")]))
                .expect("renders")
                .ends_with("assistant\n")
        );
    }
}
