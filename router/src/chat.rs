//! Chat templates: the model's `chat_template` from `tokenizer_config.json`, rendered in
//! Rust with minijinja the way `transformers`' `apply_chat_template` renders it with
//! jinja2 (trim_blocks, lstrip_blocks, Python string methods, `raise_exception`), tool
//! definitions and tool calls in history included.

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use serde_json::Value;

const TEMPLATE: &str = "chat";

/// One message as the template sees it: `content` flattened to text, tool calls and
/// results as transformers passes them.
#[derive(Debug, Clone, Serialize)]
pub struct TemplateMessage {
    pub role: String,
    /// `None` (null) only for an assistant message that just calls tools.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<TemplateToolCall>>,
    /// A `tool` message's answer to this call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl TemplateMessage {
    /// A message of plain text.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: Some(content.into()),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// A call in history: `{"id", "type": "function", "function": {"name", "arguments"}}`,
/// the arguments an object (transformers' templates read them as one, not as the JSON
/// string of OpenAI's API).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TemplateToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: TemplateFunctionCall,
}

impl TemplateToolCall {
    /// A function call.
    pub fn new(id: String, name: String, arguments: Value) -> Self {
        Self {
            id,
            kind: "function",
            function: TemplateFunctionCall { name, arguments },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TemplateFunctionCall {
    pub name: String,
    pub arguments: Value,
}

/// Variables a request adds to the template's (`chat_template_kwargs`).
pub type TemplateKwargs = serde_json::Map<String, Value>;

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    supports_tools: bool,
}

/// `json.dumps` spacing: `", "` between items, `": "` after keys.
struct SpacedJson;

impl serde_json::ser::Formatter for SpacedJson {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        writer.write_all(if first { b"" } else { b", " })
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        writer.write_all(if first { b"" } else { b", " })
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// transformers' `tojson` filter (not jinja2's): `json.dumps(x, ensure_ascii=False,
/// indent=indent)`, keys in their order, nothing HTML-escaped. Tool templates print
/// the tools and the calls' arguments with it.
fn tojson(
    value: minijinja::Value,
    indent: Option<usize>,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let indent = match indent {
        Some(n) => Some(n),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&spaces);
            value.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out, formatter,
            ))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out, SpacedJson,
        )),
    };
    written.map_err(|e| {
        minijinja::Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON")
            .with_source(e)
    })?;
    let text = String::from_utf8(out).unwrap_or_default();
    Ok(minijinja::Value::from_safe_string(text))
}

/// Whether the template source reads a `tools` variable (the word alone, not inside
/// another name such as `tool_calls`).
fn mentions_tools(source: &str) -> bool {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    source.match_indices("tools").any(|(at, word)| {
        let before = source[..at].chars().next_back();
        let after = source[at + word.len()..].chars().next();
        !before.is_some_and(is_name) && !after.is_some_and(is_name)
    })
}

/// A special token in tokenizer_config.json: a string or `{"content": ...}`.
fn token_text(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

/// --chat-template's value: the file it names, else the template itself when it reads as
/// one (it has a Jinja tag), else an error naming the flag.
fn replacement_template(value: &str) -> Result<String, String> {
    match std::fs::read_to_string(value) {
        Ok(text) => Ok(text),
        Err(_) if value.contains("{{") || value.contains("{%") => Ok(value.to_string()),
        Err(e) => Err(format!(
            "--chat-template {value}: {e}, and it is no Jinja template"
        )),
    }
}

impl ChatTemplate {
    /// The template of `<dir>/tokenizer_config.json`; `None` when the model has none.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, String> {
        Self::load(dir, None)
    }

    /// The template of `<dir>/tokenizer_config.json` (else `<dir>/chat_template.jinja`),
    /// or `replacement` in its place (the
    /// --chat-template flag: a template file, or the template itself, as vLLM takes it),
    /// with the model's BOS and EOS tokens either way; `None` when there is neither.
    pub fn load(dir: &Path, replacement: Option<&str>) -> Result<Option<Self>, String> {
        let path = if dir.is_dir() {
            dir.join("tokenizer_config.json")
        } else {
            dir.with_file_name("tokenizer_config.json")
        };
        let config: Value = match std::fs::read_to_string(&path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?
            }
            Err(_) => Value::Null,
        };
        let template = match (replacement, config.get("chat_template")) {
            (Some(replacement), _) => replacement_template(replacement)?,
            (None, Some(Value::String(s))) => s.clone(),
            // A list of named templates: the one called "default".
            (None, Some(Value::Array(list))) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .unwrap_or_default()
                .to_string(),
            // transformers 4.43+ saves the template beside the config instead.
            (None, _) => std::fs::read_to_string(path.with_file_name("chat_template.jinja"))
                .unwrap_or_default(),
        };
        if template.is_empty() {
            return Ok(None);
        }
        let bos = token_text(config.get("bos_token"));
        let eos = token_text(config.get("eos_token"));
        Self::new(template, bos, eos).map(Some)
    }

    pub fn new(template: String, bos_token: String, eos_token: String) -> Result<Self, String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<String, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_filter("tojson", tojson);
        let supports_tools = mentions_tools(&template);
        env.add_template_owned(TEMPLATE, template)
            .map_err(|e| format!("invalid chat template: {e}"))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
            supports_tools,
        })
    }

    /// Whether the template has a tool section of its own (its source reads `tools`).
    pub fn supports_tools(&self) -> bool {
        self.supports_tools
    }

    /// The prompt for `messages`, ending with the assistant's turn opened. `tools` are
    /// OpenAI's `{"type": "function", "function": {...}}` objects, given to the template
    /// as transformers' `apply_chat_template(tools=...)` gives them (`none` when absent).
    pub fn render(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[Value]>,
    ) -> Result<String, String> {
        self.render_with(messages, tools, &TemplateKwargs::new())
    }

    /// As `render`, with more variables for the template (`chat_template_kwargs`, as
    /// transformers passes `apply_chat_template`'s extra keyword arguments: e.g.
    /// `enable_thinking`); they cannot replace the messages, tools or special tokens.
    pub fn render_with(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&[Value]>,
        kwargs: &TemplateKwargs,
    ) -> Result<String, String> {
        let template = self.env.get_template(TEMPLATE).map_err(|e| e.to_string())?;
        template
            .render(minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                tools => minijinja::Value::from(minijinja::value::Serde(tools)),
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
                ..minijinja::Value::from(minijinja::value::Serde(kwargs))
            })
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidOperation => e.detail().unwrap_or("invalid messages").to_string(),
                _ => format!("chat template: {e}"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> TemplateMessage {
        TemplateMessage::text(role, content)
    }

    #[test]
    fn renders_like_jinja2_with_python_methods_and_trimmed_blocks() {
        let template = "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\n[U]{{ m.content.strip() }}\n  {% else %}\n[{{ m.role.upper() }}]{{ m.content }}\n  {% endif %}\n{% endfor %}{% if add_generation_prompt %}[A]{% endif %}";
        let t = ChatTemplate::new(template.into(), "<s>".into(), "</s>".into()).unwrap();
        let out = t
            .render(
                &[message("system", "be brief"), message("user", "  hi  ")],
                None,
            )
            .unwrap();
        assert_eq!(out, "<s>[SYSTEM]be brief\n[U]hi\n[A]");
    }

    #[test]
    fn raise_exception_is_the_template_s_own_message() {
        let template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}";
        let t = ChatTemplate::new(template.into(), String::new(), String::new()).unwrap();
        let err = t.render(&[message("assistant", "x")], None).unwrap_err();
        assert_eq!(err, "Conversations must start with a user");
    }

    #[test]
    fn a_list_of_named_templates_uses_the_default_one() {
        let dir = std::env::temp_dir().join(format!("cadence-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({
            "bos_token": {"content": "<s>"},
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}
            ]
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[message("user", "yo")], None).unwrap(), "<s>yo");
        // Without one in the config, chat_template.jinja's.
        let config = serde_json::json!({"bos_token": "<s>"});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "{{ bos_token }}!").unwrap();
        let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[message("user", "yo")], None).unwrap(), "<s>!");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_chat_template_flag_replaces_the_models_and_keeps_its_tokens() {
        let dir = std::env::temp_dir().join(format!("cadence-chat-flag-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({"bos_token": "<s>", "chat_template": "model's"});
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let inline = "{{ bos_token }}[{{ messages[0]['content'] }}]";
        let t = ChatTemplate::load(&dir, Some(inline)).unwrap().unwrap();
        assert_eq!(t.render(&[message("user", "yo")], None).unwrap(), "<s>[yo]");
        let file = dir.join("template.jinja");
        std::fs::write(&file, "{{ messages[0]['content'] }}!").unwrap();
        let t = ChatTemplate::load(&dir, file.to_str()).unwrap().unwrap();
        assert_eq!(t.render(&[message("user", "yo")], None).unwrap(), "yo!");
        let err = ChatTemplate::load(&dir, Some("/no/such.jinja"))
            .err()
            .unwrap();
        assert!(err.contains("--chat-template /no/such.jinja"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A template reading tools, calls and results the way tool templates (Qwen's, ...)
    /// do; every newline is written as an expression, so trim_blocks leaves them all.
    const TOOL_TEMPLATE: &str = concat!(
        "{% if tools %}<tools>{{ '\\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}",
        "{% endfor %}</tools>{{ '\\n' }}{% endif %}",
        "{% for m in messages %}<{{ m.role }}>",
        "{% if m.content is none %}∅{% else %}{{ m.content }}{% endif %}",
        "{% for c in m.tool_calls or [] %}",
        "[{{ c.id }} {{ c.type }} {{ c.function.name }} {{ c.function.arguments | tojson }}]",
        "{% endfor %}",
        "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ '\\n' }}",
        "{% endfor %}<assistant>"
    );

    #[test]
    fn tools_calls_and_results_reach_the_template_as_transformers_passes_them() {
        let t = ChatTemplate::new(TOOL_TEMPLATE.into(), String::new(), String::new()).unwrap();
        assert!(t.supports_tools());
        let call = TemplateToolCall {
            id: "call_1".into(),
            kind: "function",
            function: TemplateFunctionCall {
                name: "get_weather".into(),
                arguments: serde_json::json!({"city": "Paris", "unit": "c"}),
            },
        };
        let messages = [
            message("system", "Be brief."),
            message("user", "Weather in Paris?"),
            TemplateMessage {
                content: None,
                tool_calls: Some(vec![call]),
                ..message("assistant", "")
            },
            TemplateMessage {
                tool_call_id: Some("call_1".into()),
                ..message("tool", "22")
            },
        ];
        let tools = [serde_json::json!({"type": "function", "function": {
            "name": "get_weather", "description": "Weather <now> in 'a' city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})];
        let out = t.render(&messages, Some(&tools)).unwrap();
        // tojson as transformers': keys in order, `, ` and `: `, nothing HTML-escaped.
        let want = concat!(
            "<tools>\n",
            r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> in 'a' city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}"#,
            "\n</tools>\n",
            "<system>Be brief.\n",
            "<user>Weather in Paris?\n",
            r#"<assistant>∅[call_1 function get_weather {"city": "Paris", "unit": "c"}]"#,
            "\n<tool>22(call_1)\n",
            "<assistant>"
        );
        assert_eq!(out, want);
        // Without tools the template sees `none`.
        let out = t.render(&messages[..2], None).unwrap();
        assert_eq!(
            out,
            "<system>Be brief.\n<user>Weather in Paris?\n<assistant>"
        );
    }

    #[test]
    fn kwargs_reach_the_template_but_do_not_replace_its_variables() {
        let template = "{{ messages[0].content }}{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>{% endif %}";
        let t = ChatTemplate::new(template.into(), String::new(), String::new()).unwrap();
        let render = |kwargs: Value| {
            let kwargs = kwargs.as_object().unwrap().clone();
            t.render_with(&[message("user", "q")], None, &kwargs)
                .unwrap()
        };
        assert_eq!(render(serde_json::json!({})), "q<think>");
        assert_eq!(
            render(serde_json::json!({"enable_thinking": false})),
            "q<think></think>"
        );
        assert_eq!(
            render(serde_json::json!({"messages": [{"content": "x"}]})),
            "q<think>"
        );
    }

    #[test]
    fn tojson_takes_an_indent() {
        let template = "{{ x | tojson(indent=2) }}|{{ x | tojson }}";
        let t = ChatTemplate::new(template.into(), String::new(), String::new()).unwrap();
        assert!(!t.supports_tools());
        let env = &t.env;
        let out = env
            .get_template(TEMPLATE)
            .unwrap()
            .render(minijinja::context! { x => minijinja::Value::from(minijinja::value::Serde(serde_json::json!({"b": [1, 2], "a": {}}))) })
            .unwrap();
        assert_eq!(
            out,
            "{\n  \"b\": [\n    1,\n    2\n  ],\n  \"a\": {}\n}|{\"b\": [1, 2], \"a\": {}}"
        );
    }

    #[test]
    fn tool_support_is_the_word_tools_in_the_source() {
        let supports = |source: &str| {
            ChatTemplate::new(source.into(), String::new(), String::new())
                .unwrap()
                .supports_tools()
        };
        assert!(supports("{% if tools %}x{% endif %}"));
        assert!(supports("{{ tools|length }}"));
        assert!(!supports("{{ messages[0].tool_calls }}"));
        assert!(!supports("{% set my_tools = 1 %}{{ toolset }}"));
    }
}
